"""Split rollouts into microbatches of whole trajectories, by token budget or by count.

Torch-free: `plan_dp_microbatches` plans on trajectory lengths, `split_microbatches` applies
the plan to a table. The cost model is the collator's layouts and the DP padding
microbatches are `padding_table` (``docs/design.md``, §5 Layouts for Megatron, *Splitting*
and *Data parallelism*).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from r3arrow._checks import check_int, check_optional_int, check_positive_int
from r3arrow._schema import ROUTES_MISSING
from r3arrow._validated import is_validated, mark_validated
from r3arrow.errors import SchemaError
from r3arrow.table import sequence_lengths, take_rows

#: Schema metadata key marking a DP padding microbatch table (value ``b"1"``).
PADDING_METADATA_KEY = b"r3arrow.padding"
#: ``trajectory_id`` (and ``group_id``) of the dummy trajectory of a padding table.
PADDING_TRAJECTORY_ID = "__r3arrow_padding__"


def _split(
    cost: np.ndarray, budget: int | None, bins: int | None, packed: bool
) -> list[np.ndarray]:
    """One DP rank's microbatches: the fewest (at least ``bins``) whose costs fit ``budget``."""
    order = np.argsort(-cost, kind="stable")
    if budget is None:
        return _balance(cost, order, bins or 1)
    # No fewer microbatches than the budget allows, nor than asked for; one trajectory per
    # microbatch (the last count) fits, since every cost does.
    for count in range(max(bins or 1, -(-int(cost.sum()) // budget)), cost.size):
        groups = _balance(cost, order, count)
        if all((cost[g].sum() if packed else g.size * cost[g].max()) <= budget for g in groups):
            return groups
    return _balance(cost, order, cost.size)


def _assign(cost: np.ndarray, order: np.ndarray, bins: int) -> np.ndarray:
    """Bin of each item: longest first onto the least loaded bin (lowest index on ties)."""
    load = np.zeros(bins, dtype=np.int64)
    assign = np.empty(cost.shape[0], dtype=np.int64)
    for i in order.tolist():  # per trajectory, on B-sized metadata only
        j = int(np.argmin(load))
        assign[i] = j
        load[j] += cost[i]
    return assign


def _balance(cost: np.ndarray, order: np.ndarray, bins: int) -> list[np.ndarray]:
    assign = _assign(cost, order, bins)
    return sorted((np.flatnonzero(assign == j) for j in range(bins)), key=lambda g: int(g[0]))


def plan_dp_microbatches(
    lengths: Sequence[int] | np.ndarray,
    *,
    max_tokens: int | None = None,
    num_microbatches: int | None = None,
    multiple: int = 1,
    packed: bool = True,
    dp_size: int = 1,
) -> list[list[np.ndarray]]:
    """The microbatch plan: row indices of every DP rank's microbatches, ``plan[rank][j]``.

    Trajectories stay whole; indices are int64 and ascending, microbatches ordered by their
    first row; every row ``0 .. B-1`` appears exactly once. ``lengths``: tokens (prompt +
    response) per trajectory, ``[B]``, all ``>= 1``. ``max_tokens``: the fewest microbatches
    (at least ``num_microbatches``) whose costs fit it; ``num_microbatches`` alone: exactly
    that many, balanced by cost. Cost: lengths rounded up to ``multiple`` (e.g.
    `r3arrow.collate.alignment_multiple`), summed (``packed``) or ``rows x longest``.
    Balancing is longest first onto the least loaded bin. ``dp_size``: trajectories are
    balanced over the ranks that way first and each rank's share is split (a rank with
    fewer trajectories than ``num_microbatches`` gets one per trajectory); every rank is
    padded to the largest count (at least ``num_microbatches``) with empty arrays, last.

    Raises ``TypeError``/``ValueError`` for ``max_tokens``/``multiple``/``dp_size`` not a
    positive int, ``num_microbatches`` not in ``1 .. B``, or neither given; `SchemaError`
    (``row`` set) for ``lengths`` not a non-empty 1-D array of lengths ``>= 1`` or a
    trajectory alone over the budget.
    """
    dp = check_positive_int(dp_size, "dp_size")
    mult = check_positive_int(multiple, "multiple")
    budget = check_optional_int(max_tokens, "max_tokens", minimum=1)
    bins = check_optional_int(num_microbatches, "num_microbatches", minimum=1)
    if budget is None and bins is None:
        raise ValueError("expected max_tokens, num_microbatches or both, found neither")
    n = np.asarray(lengths, dtype=np.int64)
    if n.ndim != 1 or n.size == 0:
        raise SchemaError(
            f"expected a non-empty 1-D array of trajectory lengths, found shape {list(n.shape)}"
        )
    if int(n.min()) < 1:
        i = int(np.argmin(n))
        raise SchemaError(f"expected trajectory lengths >= 1, found {int(n[i])} at row {i}", row=i)
    if bins is not None and bins > n.size:
        raise ValueError(
            f"num_microbatches: expected 1..{n.size} (one trajectory at least each), found {bins}"
        )
    cost = np.asarray(-(-n // mult) * mult, dtype=np.int64)
    if budget is not None and budget < int(cost.max()):
        i = int(np.argmax(cost))
        raise SchemaError(
            f"max_tokens: trajectory at row {i} needs {int(cost[i])} tokens after alignment to "
            f"{mult}, budget is {budget}; trajectories are never split",
            row=i,
        )
    assign = _assign(cost, np.argsort(-cost, kind="stable"), dp)
    plan: list[list[np.ndarray]] = []
    for rank in range(dp):
        rows = np.flatnonzero(assign == rank)
        count = None if bins is None else min(bins, int(rows.size))
        plan.append(
            [rows[g] for g in _split(cost[rows], budget, count, packed)] if rows.size else []
        )
    total = max(max(len(p) for p in plan), bins or 1)
    empty = np.zeros(0, dtype=np.int64)
    return [p + [empty] * (total - len(p)) for p in plan]


def padding_table(table: pa.Table) -> pa.Table:
    """A DP padding microbatch with ``table``'s schema: one dummy trajectory.

    Trajectory and group id `PADDING_TRAJECTORY_ID`, one prompt token 0, empty response and
    loss mask, reward 0, no route rows (nor ``routes_missing`` marks, nor rows in another
    column of the routes type, e.g. ``train_routes``); other columns null. The schema
    metadata is kept and `PADDING_METADATA_KEY` added; marked validated when ``table`` is.
    The collator gives it ``padding_mask`` True everywhere, dummy routes, loss mask 0 and
    ``Microbatch.is_padding``: a loss normalised per microbatch must not divide by its zero
    loss-mask sum, and with a router aux loss apply ``r3arrow.megatron.apply_shims()``
    (megatron-core 0.16.1 gives NaN).

    Raises `SchemaError` when ``table`` lacks the token columns.
    """
    for name in ("trajectory_id", "group_id", "prompt_ids", "response_ids", "loss_mask"):
        if name not in table.schema.names:
            raise SchemaError(f"expected column {name!r}, found columns {table.schema.names}")
    values: dict[str, Any] = {
        "trajectory_id": [PADDING_TRAJECTORY_ID],
        "group_id": [PADDING_TRAJECTORY_ID],
        "prompt_ids": [[0]],
        "response_ids": [[]],
        "loss_mask": [[]],
        "reward": [0.0],
        "routes": [[]],
        ROUTES_MISSING: [[]],
    }
    if "routes" in table.schema.names:  # e.g. train_routes: R2 collates from it
        routes_type = table.schema.field("routes").type
        values.update({f.name: [[]] for f in table.schema if f.type == routes_type})
    arrays = [
        pa.array(values[f.name], type=f.type) if f.name in values else pa.nulls(1, type=f.type)
        for f in table.schema
    ]
    meta = {**(table.schema.metadata or {}), PADDING_METADATA_KEY: b"1"}
    out = pa.Table.from_arrays(arrays, schema=table.schema.with_metadata(meta))
    return mark_validated(out) if is_validated(table) else out


def is_padding_table(table: pa.Table | pa.RecordBatch) -> bool:
    """Whether ``table`` is a DP padding microbatch (`padding_table`)."""
    meta = table.schema.metadata
    return bool(meta) and meta.get(PADDING_METADATA_KEY) == b"1"


def split_microbatches(
    table: pa.Table,
    *,
    max_tokens: int | None = None,
    num_microbatches: int | None = None,
    multiple: int = 1,
    packed: bool = True,
    dp_size: int = 1,
    dp_rank: int | None = None,
) -> list[pa.Table]:
    """DP rank ``dp_rank``'s microbatches of ``table``, whole trajectories each.

    The plan is `plan_dp_microbatches` on the prompt + response lengths; each part keeps
    every column and the schema metadata; padding microbatches (`padding_table`) come last.
    ``dp_rank`` is required with ``dp_size > 1``. Works with or without a ``routes``
    column. Raises as `plan_dp_microbatches`, and ``ValueError`` for a missing or
    out-of-range ``dp_rank``.
    """
    dp = check_positive_int(dp_size, "dp_size")
    if dp > 1 and dp_rank is None:
        raise ValueError(f"dp_rank: expected an int in [0, {dp}) with dp_size={dp}, found None")
    rank = 0 if dp_rank is None else check_int(dp_rank, "dp_rank", minimum=0, maximum=dp - 1)
    groups = plan_dp_microbatches(
        sequence_lengths(table),
        max_tokens=max_tokens,
        num_microbatches=num_microbatches,
        multiple=multiple,
        packed=packed,
        dp_size=dp,
    )[rank]
    return [take_rows(table, g) if g.size else padding_table(table) for g in groups]


__all__ = [
    "is_padding_table",
    "padding_table",
    "plan_dp_microbatches",
    "split_microbatches",
]
