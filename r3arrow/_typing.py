"""Type aliases shared across modules."""

from __future__ import annotations

import os
from typing import Any, TypeAlias

import pyarrow as pa

PathLike: TypeAlias = str | os.PathLike[str]
"""A filesystem path: ``str`` or any ``os.PathLike[str]``."""

TableLike: TypeAlias = pa.Table | pa.RecordBatch
"""A rollout table or one record batch of it."""

ArrowArray: TypeAlias = "pa.Array[Any] | pa.ChunkedArray[Any]"
"""An Arrow column, contiguous or chunked."""
