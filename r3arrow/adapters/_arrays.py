"""Array and id helpers shared by the adapters (numpy and pyarrow only).

The checkers read a framework's values and raise `SchemaError` (``row`` set) for anything
that is not what the rollout schema holds, never a builtin error.
"""

from __future__ import annotations

import numbers
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import pyarrow.compute as pc

from r3arrow.errors import SchemaError

_KINDS = {"int": ("iu", "integers"), "mask": ("iub", "0/1 values"), "float": ("iuf", "numbers")}


def host(x: Any) -> Any:
    """A torch tensor as numpy (duck-typed: no torch import); anything else unchanged."""
    return x.detach().cpu().numpy() if hasattr(x, "detach") else x


def vector(value: Any, name: str, row: int, kind: Literal["int", "mask", "float"]) -> np.ndarray:
    """``value`` (a list, numpy array or tensor) as a 1-d numpy array of ``kind``'s dtypes
    (``"mask"``: 0/1 only; empty: int64 / float64)."""
    kinds, what = _KINDS[kind]
    try:
        arr = np.asarray(host(value))
    except (TypeError, ValueError, OverflowError, RuntimeError) as exc:
        raise SchemaError(f"{name}: expected a flat list of {what}, found {exc}", row=row) from exc
    if arr.ndim == 1 and arr.size == 0:
        return arr.astype(np.float64 if kind == "float" else np.int64)
    if arr.ndim != 1 or arr.dtype.kind not in kinds:
        raise SchemaError(
            f"{name}: expected a flat list of {what}, found {arr.dtype} {list(arr.shape)}",
            row=row,
        )
    if kind == "mask" and ((arr != 0) & (arr != 1)).any():
        bad = arr[(arr != 0) & (arr != 1)][0]
        raise SchemaError(f"{name}: expected 0/1 values, found {bad}", row=row)
    return arr


def number(value: Any, name: str, row: int) -> float:
    """A real number (Python, numpy or a 0-d tensor; never a bool) as a float."""
    try:
        v = host(value)
    except (TypeError, RuntimeError) as exc:  # a bfloat16 tensor, say
        raise SchemaError(f"{name}: expected a number, found {exc}", row=row) from exc
    if isinstance(v, np.ndarray) and v.ndim == 0:
        v = v.item()
    if isinstance(v, bool | np.bool_) or not isinstance(v, numbers.Real):
        raise SchemaError(f"{name}: expected a number, found {v!r:.80}", row=row)
    return float(v)


def id_strings(values: Sequence[Any], name: str) -> list[str]:
    """Ids as strings, each given as a non-empty string or an integer (None, NaN, "" and
    anything else raise: no two trajectories share a made-up id like ``'None'``)."""
    out: list[str] = []
    for i, v in enumerate(values):
        if isinstance(v, str) and v:
            out.append(str(v))
        elif isinstance(v, numbers.Integral) and not isinstance(v, bool | np.bool_):
            out.append(str(int(v)))
        else:
            raise SchemaError(
                f"{name}[{i}]: expected a non-empty string or an integer id, found {v!r:.80}",
                row=i,
            )
    return out


def check_unique(tids: Sequence[str], name: str) -> None:
    """`SchemaError` at the second row of the first trajectory id given twice."""
    seen: dict[str, int] = {}
    for i, t in enumerate(tids):
        first = seen.setdefault(t, i)
        if first != i:
            raise SchemaError(
                f"{name}: expected unique trajectory ids, found {t!r} at rows {first} and {i}",
                row=i,
                trajectory_id=t,
            )


def flat_values(col: Any) -> np.ndarray:
    """The flattened values of an Arrow list column as numpy."""
    return np.asarray(pc.list_flatten(col).to_numpy(zero_copy_only=False))


def scatter(
    values: np.ndarray,
    lengths: np.ndarray,
    start: np.ndarray,
    shape: tuple[int, ...],
    fill: Any,
    dtype: Any = None,
) -> np.ndarray:
    """Ragged rows into a dense ``shape`` array, ``fill`` elsewhere.

    ``values``: the rows' items concatenated (``[sum(lengths), ...]``); row ``i``'s items
    land at ``out[i, start[i] : start[i] + lengths[i]]``. ``dtype``: default ``values``'.
    """
    rows = np.repeat(np.arange(lengths.size), lengths)
    shift = np.repeat(start - (np.cumsum(lengths) - lengths), lengths)
    out = np.full(shape, fill, dtype=values.dtype if dtype is None else dtype)
    out[rows, np.arange(values.shape[0]) + shift] = values
    return out


__all__ = ["check_unique", "flat_values", "host", "id_strings", "number", "scatter", "vector"]
