"""Dynamic sampling: drop or replace groups whose value carries no advantage signal.

The rules, SkyRL's and verl's, are ``docs/design.md``, "Dynamic sampling". Whole rows are
selected with Arrow ``take``/``filter``, so routes stay with their trajectory.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, Literal, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from r3arrow._checks import check_choice, check_int
from r3arrow._schema import list_lengths, trajectory_id_at
from r3arrow.errors import SchemaError
from r3arrow.table._derived import filter_rows, take_rows
from r3arrow.table._validate import raise_at_first

Reduce = Literal["sum", "mean", "last", "max"]
REDUCTIONS: tuple[str, ...] = ("sum", "mean", "last", "max")


def _column(table: pa.Table, name: str, role: str) -> pa.ChunkedArray[Any]:
    if name not in table.schema.names:
        raise SchemaError(f"expected a column {name!r} to {role}, found {table.schema.names}")
    return table.column(name)


def _no_nulls(table: pa.Table, col: pa.Array[Any] | pa.ChunkedArray[Any], name: str) -> None:
    if col.null_count:
        row = int(np.flatnonzero(pc.is_null(col).to_numpy(zero_copy_only=False))[0])
        raise SchemaError(
            f"{name}: expected no nulls, found {col.null_count} (first: row {row})",
            row=row,
            trajectory_id=trajectory_id_at(table, row),
        )


def _is_number(t: pa.DataType) -> bool:
    return pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t)


def _is_list(t: pa.DataType) -> bool:
    return pa.types.is_list(t) or pa.types.is_large_list(t)


def _codes(col: pa.ChunkedArray[Any]) -> tuple[np.ndarray, int]:
    """(int64 dictionary code per row, number of distinct values)."""
    enc = cast("pa.DictionaryArray[Any, Any]", pc.dictionary_encode(col).combine_chunks())
    codes = np.asarray(enc.indices.to_numpy(zero_copy_only=False), dtype=np.int64)
    return codes, len(enc.dictionary)


def reduce_tokens(table: pa.Table, column: str, *, reduce: Reduce | str) -> np.ndarray:
    """One float64 value per trajectory of the list column ``column`` (numbers or bools):
    ``reduce`` is ``"sum"`` (0 when empty), ``"mean"``, ``"last"`` or ``"max"`` (NaN when
    empty), else ``ValueError``; `SchemaError` for a missing, non-list or null column.
    """
    check_choice(reduce, "reduce", REDUCTIONS)
    col = _column(table, column, "reduce")
    if not (_is_list(col.type) and _is_number(col.type.value_type)):
        raise SchemaError(f"{column}: expected a list of numbers per trajectory, found {col.type}")
    _no_nulls(table, col, column)
    lens = list_lengths(col)
    flat = pc.list_flatten(col)
    if flat.null_count:
        first = int(np.flatnonzero(pc.is_null(flat).to_numpy(zero_copy_only=False))[0])
        row = int(np.repeat(np.arange(lens.size), lens)[first])
        raise SchemaError(
            f"{column}: expected no null values, found {flat.null_count} (first: row {row})",
            row=row,
            trajectory_id=trajectory_id_at(table, row),
        )
    vals = np.asarray(flat.to_numpy(zero_copy_only=False), dtype=np.float64)
    ends = np.cumsum(lens)
    starts = ends - lens
    full = lens > 0
    out = np.zeros(lens.size) if reduce == "sum" else np.full(lens.size, np.nan)
    if vals.size:  # reduceat over the non-empty lists only: their starts increase strictly
        if reduce in ("sum", "mean"):
            out[full] = np.add.reduceat(vals, starts[full])
            if reduce == "mean":
                out[full] /= lens[full]
        elif reduce == "max":
            out[full] = np.maximum.reduceat(vals, starts[full])
        else:
            out[full] = vals[ends[full] - 1]
    return out


def _values(table: pa.Table, value: str, reduce: str | None) -> tuple[np.ndarray, bool]:
    """(float64 value per row, whether the values are numbers) for the spread test."""
    col = _column(table, value, "compare")
    is_list = _is_list(col.type)
    if is_list != (reduce is not None):
        if is_list:
            raise ValueError(
                f"value={value!r} is a list column ({col.type}): pass reduce= one of "
                f"{', '.join(map(repr, REDUCTIONS))} (SkyRL and verl sum token rewards)"
            )
        raise ValueError(f"reduce={reduce!r} needs a list column, found {value!r} ({col.type})")
    if is_list:
        return reduce_tokens(table, value, reduce=cast("str", reduce)), True
    _no_nulls(table, col, value)
    if _is_number(col.type):
        return np.asarray(col.to_numpy(), dtype=np.float64), True
    return _codes(col)[0].astype(np.float64), False


def _live(table: pa.Table) -> np.ndarray:
    """Bool per row: the loss mask has a nonzero value (the trajectory is trained on)."""
    mask = _column(table, "loss_mask", "find live trajectories (ignore_masked=True)")
    _no_nulls(table, mask, "loss_mask")
    flat = pc.list_flatten(mask)
    if flat.null_count:
        raise SchemaError(f"loss_mask: expected no null mask values, found {flat.null_count}")
    nonzero = np.concatenate([[0], np.cumsum(flat.to_numpy(zero_copy_only=False) != 0)])
    lens = list_lengths(mask)
    ends = np.cumsum(lens)
    return np.asarray(nonzero[ends] - nonzero[ends - lens] > 0, dtype=bool)


def _number(value: Any, name: str, want: str, ok: Callable[[float], bool]) -> float:
    """``value`` as a float: ``TypeError`` unless a number, ``ValueError`` unless ``ok``."""
    if isinstance(value, bool) or not isinstance(value, int | float | np.floating):
        raise TypeError(f"{name}: expected {want}, found {value!r:.80}")
    if not ok(float(value)):
        raise ValueError(f"{name}: expected {want}, found {value!r}")
    return float(value)


def _kept_groups(
    table: pa.Table,
    by: str,
    value: str,
    tolerance: Any,
    ignore_masked: bool,
    reduce: str | None,
) -> tuple[np.ndarray, np.ndarray]:
    """(group code per row, bool per group: kept) under the rules of dynamic sampling."""
    tol = _number(
        tolerance, "tolerance", "a finite number >= 0", lambda t: t >= 0 and math.isfinite(t)
    )
    group_col = _column(table, by, "group by")
    _no_nulls(table, group_col, by)
    codes, n = _codes(group_col)
    vals, numeric = _values(table, value, reduce)
    if tol and not numeric:
        raise ValueError(f"tolerance={tolerance!r} needs numeric values, found {value!r} values")
    live = _live(table) if ignore_masked else np.ones(codes.size, dtype=bool)
    raise_at_first(
        table,
        live & np.isnan(vals),
        SchemaError,
        lambda row: f"{value}: expected a number for every live trajectory, found NaN (row {row})",
    )
    lo, hi = np.full(n, np.inf), np.full(n, -np.inf)
    np.minimum.at(lo, codes[live], vals[live])
    np.maximum.at(hi, codes[live], vals[live])
    count = np.bincount(codes[live], minlength=n)
    with np.errstate(invalid="ignore"):  # inf - inf where a group's values are all inf
        spread = np.where(hi == lo, 0.0, hi - lo)
    uniform = (count >= 2) & (spread <= tol)
    return codes, ~uniform


def varied_groups(
    table: pa.Table,
    by: str = "group_id",
    value: str = "reward",
    *,
    tolerance: float = 0.0,
    ignore_masked: bool = True,
    reduce: Reduce | None = None,
) -> np.ndarray:
    """Bool per row: True where `filter_groups` keeps the row's group (parameters as there)."""
    codes, kept = _kept_groups(table, by, value, tolerance, ignore_masked, reduce)
    return np.asarray(kept[codes], dtype=bool)


def filter_groups(
    table: pa.Table,
    by: str = "group_id",
    value: str = "reward",
    *,
    tolerance: float = 0.0,
    ignore_masked: bool = True,
    reduce: Reduce | None = None,
) -> pa.Table:
    """Drop uniform groups (DAPO dynamic sampling; ``docs/design.md``, "Dynamic sampling").

    ``by``: the group column; ``value``: numbers, strings or, with ``reduce``, a list column;
    ``tolerance``: numbers this close are equal; ``ignore_masked``: all-zero-mask rows follow
    their group but are left out of the test. `SchemaError` for a missing column, nulls or
    NaN on a live row, ``ValueError`` / ``TypeError`` for bad ``tolerance`` / ``reduce``.
    """
    kept = varied_groups(
        table, by, value, tolerance=tolerance, ignore_masked=ignore_masked, reduce=reduce
    )
    return filter_rows(table, kept)


@dataclasses.dataclass(frozen=True, eq=False)
class ReplaceResult:
    """What `replace_groups` did: ``table`` (the input when not ``enough``); ``source_rows``
    (int64 ``[B]``: output row ``i`` is input row ``source_rows[i]``); the group counts;
    ``enough``: more than ``min_replace_ratio`` of the groups were kept (False is SkyRL's
    ``keep_sampling``).
    """

    table: pa.Table
    source_rows: np.ndarray
    num_groups: int
    kept_groups: int
    replaced_groups: int
    enough: bool


def replace_groups(
    table: pa.Table,
    by: str = "group_id",
    value: str = "reward",
    *,
    seed: int = 0,
    min_replace_ratio: float = 0.0,
    tolerance: float = 0.0,
    ignore_masked: bool = True,
    reduce: Reduce | None = None,
) -> ReplaceResult:
    """Replace the rows of each uniform group by a kept group's (drawn with ``seed``); the
    k-th row becomes row ``k mod size`` of the replacement. With ``kept_groups <=
    min_replace_ratio * num_groups`` (a ratio in ``[0, 1]``) nothing is replaced and
    ``enough`` is False. Otherwise as `filter_groups`.
    """
    seed = check_int(seed, "seed", minimum=0)
    ratio = _number(
        min_replace_ratio, "min_replace_ratio", "a number in [0, 1]", lambda r: 0 <= r <= 1
    )
    codes, kept = _kept_groups(table, by, value, tolerance, ignore_masked, reduce)
    n, good = kept.size, int(kept.sum())
    identity = np.arange(codes.size, dtype=np.int64)
    if good == n:
        return ReplaceResult(table, identity, n, good, 0, True)
    if not good > n * ratio:
        return ReplaceResult(table, identity, n, good, 0, False)
    kept_ids, dropped_ids = np.flatnonzero(kept), np.flatnonzero(~kept)
    rng = np.random.default_rng(seed)
    if kept_ids.size >= dropped_ids.size:
        chosen = rng.permutation(kept_ids)[: dropped_ids.size]
    else:
        chosen = rng.choice(kept_ids, size=dropped_ids.size)
    draw = np.zeros(n, dtype=np.int64)
    draw[dropped_ids] = chosen
    order = np.argsort(codes, kind="stable")
    sizes = np.bincount(codes, minlength=n)
    first = np.cumsum(sizes) - sizes
    rank = np.empty(codes.size, dtype=np.int64)
    rank[order] = np.arange(codes.size) - first[codes[order]]
    src = identity.copy()
    rows = np.flatnonzero(~kept[codes])
    g = draw[codes[rows]]
    src[rows] = order[first[g] + rank[rows] % sizes[g]]
    return ReplaceResult(take_rows(table, src), src, n, good, int(dropped_ids.size), True)
