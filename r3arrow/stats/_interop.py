"""Zero-copy interop: Polars frames and torch tensors over the Arrow buffers.

(Hugging Face ``datasets.Dataset(table)`` shares the table too; its ``"arrow"`` format
keeps the routes type, while ``"numpy"`` widens ids to int64, a copy.)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import numpy as np
import polars as pl
import pyarrow as pa

from r3arrow._typing import TableLike
from r3arrow.errors import RouteShapeError
from r3arrow.table import route_spec

if TYPE_CHECKING:
    import torch


def to_polars(table: pa.Table) -> pl.DataFrame:
    """A rollout table as a Polars frame without copying (routes: ``List(Array(dtype, (L, K)))``;
    the spec is not carried: Polars has no schema metadata)."""
    return cast(pl.DataFrame, pl.from_arrow(table, rechunk=False))


def routes_torch(table: TableLike) -> tuple[torch.Tensor, torch.Tensor]:
    """(routes ``[T, L, K]``, offsets int64 ``[B+1]``) as torch tensors on the Arrow buffer.

    The routes alias read-only Arrow memory (do not write); a multi-chunk column is
    combined first (one copy).
    """
    import torch

    spec = route_spec(table)
    col: Any = table.column("routes")  # a large_list array (the stubs type columns loosely)
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    offsets = np.asarray(col.offsets, dtype=np.int64)
    tokens = col.flatten()
    if tokens.null_count:
        raise RouteShapeError(f"expected no null tokens in routes, found {tokens.null_count}")
    leaf = tokens.flatten().flatten()
    if len(leaf) != len(tokens) * spec.num_layers * spec.topk:
        raise RouteShapeError(
            f"expected {len(tokens) * spec.num_layers * spec.topk} expert ids, found {len(leaf)}"
        )
    rows = torch.utils.dlpack.from_dlpack(leaf).view(len(tokens), spec.num_layers, spec.topk)
    return rows, torch.from_numpy((offsets - offsets[0]).copy())


__all__ = ["routes_torch", "to_polars"]
