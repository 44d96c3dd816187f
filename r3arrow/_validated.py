"""Which tables r3arrow has already validated in this process.

A table built by :func:`r3arrow.rollout_table` or returned by a validating
reader has passed the rollout checks; writing it again must not re-validate it
(one check per trust boundary). Arrow tables are immutable, so identity is
enough: the registry holds weak references and forgets a table when it dies.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

_lock = threading.Lock()
_validated: dict[int, weakref.ref[Any]] = {}


def mark_validated(table: Any) -> Any:
    """Record that ``table`` (a ``pa.Table`` or ``pa.RecordBatch``) passed validation; return it."""
    key = id(table)

    def forget(_: weakref.ref[Any], key: int = key) -> None:
        with _lock:
            _validated.pop(key, None)

    with _lock:
        _validated[key] = weakref.ref(table, forget)
    return table


def is_validated(table: Any) -> bool:
    """True if ``table`` is the very object passed to :func:`mark_validated` (and still alive)."""
    with _lock:
        ref = _validated.get(id(table))
    return ref is not None and ref() is table
