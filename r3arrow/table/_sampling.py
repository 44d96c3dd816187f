"""Dynamic sampling: drop or replace groups whose value carries no advantage signal.

``docs/design.md``, "Dynamic sampling". The rules follow SkyRL and verl (SkyRL 0.3.0,
``skyrl/train/utils/trainer_utils.py``: ``zero_variance_filter``, ``handle_filter_sampling``,
``handle_replace_sampling``, ``get_bad_sample_replacements``; verl 0.9.1,
``verl/trainer/ppo/v1/replay_buffer.py``: ``ReplayBuffer._dapo_filtered_keys``):

* A group is **uniform** (no signal) when it has at least two *live* trajectories and
  their values differ by at most ``tolerance`` (``max - min <= tolerance``; 0 = exact
  equality, as verl's ``np.std == 0``). Every other group is kept, so a **group of one is
  kept** (it has no spread to test), as in both.
* With ``ignore_masked=True`` (SkyRL's ``zero_variance_filter``) a trajectory whose loss
  mask is all zero is not live: it is left out of the spread test, so a masked member
  cannot make a uniform group look varied, but it **shares its group's fate** (kept with a
  kept group, dropped or replaced with a uniform one).
* Token-level values (a list column such as ``token_rewards``) are reduced per trajectory
  by a named rule, ``reduce="sum" | "mean" | "last" | "max"`` (`reduce_tokens`); SkyRL and
  verl sum token rewards.
* `filter_groups` keeps the rows of kept groups in their original order (DAPO).
  `replace_groups` keeps the row count: each uniform group takes the rows of a kept
  group (distinct kept groups while there are enough, else drawn with replacement, as
  SkyRL's ``get_bad_sample_replacements``), provided more than ``min_replace_ratio`` of
  the groups are kept; otherwise its `ReplaceResult` holds the table unchanged with
  ``enough=False`` (SkyRL's keep-sampling signal).

Whole rows are selected with Arrow ``take``/``filter``: every per-trajectory column,
routes included, stays with its trajectory; R3-off tables work the same.
"""

from __future__ import annotations

import dataclasses
import math
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


def reduce_tokens(table: pa.Table, column: str, *, reduce: Reduce | str) -> np.ndarray:
    """One float64 value per trajectory from the list column ``column``, by the rule ``reduce``.

    ``"sum"`` (0 for an empty list), ``"mean"``, ``"last"`` and ``"max"`` (NaN for an empty
    list: there is no value to take). The column is a ``list`` / ``large_list`` of
    integers, floats or bools. Raises ``ValueError`` for an unknown rule, `SchemaError` for
    a missing or non-list column and for null lists or null values (``row`` set).
    """
    check_choice(reduce, "reduce", REDUCTIONS)
    col = _column(table, column, "reduce")
    t = col.type
    if not (
        (pa.types.is_list(t) or pa.types.is_large_list(t))
        and (
            pa.types.is_integer(t.value_type)
            or pa.types.is_floating(t.value_type)
            or pa.types.is_boolean(t.value_type)
        )
    ):
        raise SchemaError(f"{column}: expected a list of numbers per trajectory, found {t}")
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


def _group_codes(table: pa.Table, by: str) -> tuple[np.ndarray, int]:
    col = _column(table, by, "group by")
    _no_nulls(table, col, by)
    enc = cast("pa.DictionaryArray[Any, Any]", pc.dictionary_encode(col).combine_chunks())
    return np.asarray(enc.indices.to_numpy(zero_copy_only=False), dtype=np.int64), len(
        enc.dictionary
    )


def _values(table: pa.Table, value: str, reduce: str | None) -> tuple[np.ndarray, bool]:
    """(float64 value per row, whether the values are numbers) for the spread test."""
    col = _column(table, value, "compare")
    is_list = pa.types.is_list(col.type) or pa.types.is_large_list(col.type)
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
    t = col.type
    if pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_boolean(t):
        return np.asarray(col.to_numpy(), dtype=np.float64), True
    enc = cast("pa.DictionaryArray[Any, Any]", pc.dictionary_encode(col).combine_chunks())
    return np.asarray(enc.indices.to_numpy(zero_copy_only=False), dtype=np.float64), False


def _live(table: pa.Table) -> np.ndarray:
    """Bool per row: the loss mask has a nonzero value (the trajectory is trained on)."""
    mask = _column(table, "loss_mask", "find live trajectories (ignore_masked=True)")
    _no_nulls(table, mask, "loss_mask")
    flat = pc.list_flatten(mask)
    if flat.null_count:
        raise SchemaError(f"loss_mask: expected no null mask values, found {flat.null_count}")
    nonzero = np.concatenate([[0], np.cumsum(flat.to_numpy(zero_copy_only=False) != 0)])
    ends = np.cumsum(list_lengths(mask))
    return np.asarray(nonzero[ends] - nonzero[ends - list_lengths(mask)] > 0, dtype=bool)


def _tolerance(tolerance: Any) -> float:
    if isinstance(tolerance, bool) or not isinstance(tolerance, int | float | np.floating):
        raise TypeError(f"tolerance: expected a number >= 0, found {tolerance!r:.80}")
    tol = float(tolerance)
    if not (tol >= 0 and math.isfinite(tol)):
        raise ValueError(f"tolerance: expected a finite number >= 0, found {tolerance!r}")
    return tol


def _kept_groups(
    table: pa.Table,
    by: str,
    value: str,
    tolerance: Any,
    ignore_masked: bool,
    reduce: str | None,
) -> tuple[np.ndarray, np.ndarray]:
    """(group code per row, bool per group: kept) under the module's rules."""
    tol = _tolerance(tolerance)
    codes, n = _group_codes(table, by)
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
    """Bool per row: True where `filter_groups` keeps the row's group (not uniform).

    Parameters as `filter_groups`.
    """
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
    """Drop uniform groups (DAPO dynamic sampling); kept rows stay in their order.

    Parameters
    ----------
    by:
        The group column (any type without nulls).
    value:
        The compared column: numbers, strings (compared for equality) or, with
        ``reduce``, a list column of token-level values.
    tolerance:
        Values within ``tolerance`` of each other count as equal (numbers only).
    ignore_masked:
        Leave trajectories whose loss mask is all zero out of the spread test (they still
        follow their group).
    reduce:
        The rule for a list ``value`` column (`reduce_tokens`); ``None`` for a scalar one.

    Raises `SchemaError` for a missing column, nulls, or NaN on a live trajectory;
    ``ValueError`` / ``TypeError`` for a bad ``tolerance`` or ``reduce``.
    """
    return filter_rows(
        table,
        varied_groups(
            table, by, value, tolerance=tolerance, ignore_masked=ignore_masked, reduce=reduce
        ),
    )


@dataclasses.dataclass(frozen=True, eq=False)
class ReplaceResult:
    """What `replace_groups` did.

    ``table``: the result (the input unchanged when ``enough`` is False);
    ``source_rows``: int64 ``[B]``, output row ``i`` is input row ``source_rows[i]``;
    ``num_groups`` / ``kept_groups`` / ``replaced_groups``: group counts (``replaced_groups``
    is 0 when nothing was replaced); ``enough``: more than ``min_replace_ratio`` of the
    groups were kept (or nothing needed replacing); False is SkyRL's ``keep_sampling``: sample
    another batch.
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
    """Replace the rows of each uniform group by the rows of a kept group; a `ReplaceResult`.

    Uniform groups draw kept groups with a ``numpy`` generator seeded by ``seed``: distinct
    ones when there are at least as many kept groups as uniform ones, else uniformly with
    replacement. The k-th row of a uniform group becomes the ``k mod size``-th row of its
    replacement group (which keeps its own trajectory and group ids). Row count and kept
    rows' positions are unchanged. When ``kept_groups <= min_replace_ratio * num_groups``
    (SkyRL's threshold; with the default 0, when every group is uniform) nothing is replaced
    and ``enough`` is False: the result signals, never raises for it. Other parameters and
    errors as `filter_groups`; ``min_replace_ratio`` must lie in ``[0, 1]``.
    """
    seed = check_int(seed, "seed", minimum=0)
    if isinstance(min_replace_ratio, bool) or not isinstance(
        min_replace_ratio, int | float | np.floating
    ):
        raise TypeError(f"min_replace_ratio: expected a number, found {min_replace_ratio!r:.80}")
    if not 0.0 <= float(min_replace_ratio) <= 1.0:
        raise ValueError(
            f"min_replace_ratio: expected a number in [0, 1], found {min_replace_ratio}"
        )
    codes, kept = _kept_groups(table, by, value, tolerance, ignore_masked, reduce)
    n, good = kept.size, int(kept.sum())
    identity = np.arange(codes.size, dtype=np.int64)
    if good == n:
        return ReplaceResult(table, identity, n, good, 0, True)
    if not good > n * float(min_replace_ratio):
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
    first = np.zeros(n, dtype=np.int64)
    np.cumsum(sizes[:-1], out=first[1:])
    rank = np.empty(codes.size, dtype=np.int64)
    rank[order] = np.arange(codes.size) - first[codes[order]]
    src = identity.copy()
    rows = np.flatnonzero(~kept[codes])
    g = draw[codes[rows]]
    src[rows] = order[first[g] + rank[rows] % sizes[g]]
    return ReplaceResult(take_rows(table, src), src, n, good, int(dropped_ids.size), True)
