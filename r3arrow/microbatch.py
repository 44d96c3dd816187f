"""Split rollouts into microbatches of whole trajectories, by token budget or by count.

Torch-free (numpy and pyarrow only): the planner runs wherever tables are, before any
trainer tensor exists. `plan_dp_microbatches` plans on trajectory lengths;
`split_microbatches` applies the plan to a rollout table. The cost model matches the
layouts of `r3arrow.collate.MegatronCollator` (see ``docs/design.md``, "Layouts for
Megatron"): packed, a microbatch costs the sum of its lengths rounded up to the alignment
multiple; unpacked, its rows times the longest rounded length.

Data parallelism (``dp_size > 1``): Megatron runs the same number of microbatches on every
DP rank. Trajectories are balanced over the ranks by token cost (longest first onto the
least loaded rank), each rank's share is split as above, and ranks with fewer microbatches
get padding microbatches: an empty index array in the plan, and in `split_microbatches` a
`padding_table` (one dummy trajectory of one pad token, no route rows, empty response, so
the collator gives it ``padding_mask`` True everywhere, dummy routes ``[0 .. K-1]`` and loss
mask 0; it is marked in the schema metadata, see `is_padding_table`). Padding microbatches
come last on their rank. The plan depends only on the lengths and arguments, so every rank
computes the same one.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from r3arrow._checks import check_int, check_optional_int, check_positive_int
from r3arrow._validated import is_validated, mark_validated
from r3arrow.errors import SchemaError
from r3arrow.table import sequence_lengths, take_rows

#: Schema metadata key marking a DP padding microbatch table (value ``b"1"``).
PADDING_METADATA_KEY = b"r3arrow.padding"
#: ``trajectory_id`` (and ``group_id``) of the dummy trajectory of a padding table.
PADDING_TRAJECTORY_ID = "__r3arrow_padding__"


def _round_up(x: np.ndarray, m: int) -> np.ndarray:
    return np.asarray(-(-x // m) * m, dtype=np.int64)


def _lengths(lengths: Sequence[int] | np.ndarray) -> np.ndarray:
    n = np.asarray(lengths, dtype=np.int64)
    if n.ndim != 1 or n.size == 0:
        raise SchemaError(
            f"expected a non-empty 1-D array of trajectory lengths, found shape {list(n.shape)}"
        )
    if int(n.min()) < 1:
        i = int(np.argmin(n))
        found = int(n[i])
        raise SchemaError(f"expected trajectory lengths >= 1, found {found} at row {i}", row=i)
    return n


def _split(
    lengths: Sequence[int] | np.ndarray,
    max_tokens: int | None,
    num_microbatches: int | None,
    multiple: int,
    packed: bool,
) -> list[np.ndarray]:
    """One DP rank's microbatches of `plan_dp_microbatches`."""
    multiple = check_positive_int(multiple, "multiple")
    budget = check_optional_int(max_tokens, "max_tokens", minimum=1)
    if budget is None and num_microbatches is None:
        raise ValueError("expected max_tokens, num_microbatches or both, found neither")
    n = _lengths(lengths)
    bins = check_optional_int(num_microbatches, "num_microbatches", minimum=1)
    if bins is not None and bins > n.size:
        raise ValueError(
            f"num_microbatches: expected 1..{n.size} (one trajectory at least each), found {bins}"
        )
    cost = _round_up(n, multiple)
    order = np.argsort(-cost, kind="stable")
    if budget is None:
        return _balance(cost, order, bins or 1)
    worst = int(cost.max())
    if budget < worst:
        i = int(np.argmax(cost))
        raise SchemaError(
            f"max_tokens: trajectory at row {i} needs {worst} tokens after alignment to "
            f"{multiple}, budget is {budget}; trajectories are never split",
            row=i,
        )
    # No fewer microbatches than the budget allows, nor than asked for.
    lo = max(bins or 1, -(-int(cost.sum()) // budget))
    for count in range(lo, n.size + 1):
        groups = _balance(cost, order, count)
        if all(_cost(cost[g], packed) <= budget for g in groups):
            return groups
    # One trajectory per microbatch always fits once every cost does; kept as a guard.
    raise SchemaError(  # pragma: no cover
        f"max_tokens={budget}: no split of {n.size} trajectories fits the budget"
    )


def _cost(costs: np.ndarray, packed: bool) -> int:
    return int(costs.sum()) if packed else int(costs.shape[0] * costs.max())


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
    groups = [np.flatnonzero(assign == j) for j in range(bins)]
    groups.sort(key=lambda g: int(g[0]))
    return groups


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

    Every trajectory stays whole; indices are int64 and ascending, microbatches ordered by
    their first row. Without data parallelism (``dp_size=1``) the plan is ``[microbatches]``.

    Parameters
    ----------
    lengths:
        Tokens (prompt + response) of each trajectory, ``[B]``, all ``>= 1``.
    max_tokens:
        Token budget per microbatch (dynamic batch size): the fewest microbatches, at
        least ``num_microbatches``, whose costs all fit it.
    num_microbatches:
        Alone: exactly that many microbatches, balanced by cost (``1 .. B``).
    multiple:
        Alignment multiple of a sequence (packed) or of the row length (unpacked),
        e.g. `r3arrow.collate.alignment_multiple`.
    packed:
        Cost model: sum of rounded lengths (packed) or ``rows x longest rounded length``.
    dp_size:
        Data parallelism: trajectories are balanced over the ``dp_size`` ranks by cost
        (lengths rounded up to ``multiple``, longest first onto the least loaded rank); each
        rank's share is split as above (``max_tokens`` and ``num_microbatches`` per rank; a
        rank with fewer trajectories than ``num_microbatches`` splits into one per
        trajectory). Every rank then gets ``M`` microbatches, ``M`` the largest count (at
        least ``num_microbatches``): the missing ones are padding, empty arrays after the
        real ones. A rank may hold only padding when there are fewer trajectories than
        ranks. Every row ``0 .. B-1`` appears exactly once over all ranks.

    Balancing is longest-first onto the least loaded microbatch.

    Raises
    ------
    TypeError, ValueError
        ``max_tokens``/``multiple``/``dp_size`` not a positive int, ``num_microbatches`` not
        in ``1 .. B``, or neither ``max_tokens`` nor ``num_microbatches`` given.
    SchemaError
        ``lengths`` is not a non-empty 1-D array of lengths ``>= 1`` (``row`` set), or a
        trajectory alone exceeds the budget (``row`` set).
    """
    dp = check_positive_int(dp_size, "dp_size")
    mult = check_positive_int(multiple, "multiple")
    budget = check_optional_int(max_tokens, "max_tokens", minimum=1)
    bins = check_optional_int(num_microbatches, "num_microbatches", minimum=1)
    if budget is None and bins is None:
        raise ValueError("expected max_tokens, num_microbatches or both, found neither")
    n = _lengths(lengths)
    if bins is not None and bins > n.size:
        raise ValueError(
            f"num_microbatches: expected 1..{n.size} (one trajectory at least each), found {bins}"
        )
    cost = _round_up(n, mult)
    if budget is not None and budget < int(cost.max()):
        _split(n, budget, None, mult, packed)  # raises, naming the row of the whole batch
    assign = _assign(cost, np.argsort(-cost, kind="stable"), dp)
    plan: list[list[np.ndarray]] = []
    for rank in range(dp):
        rows = np.flatnonzero(assign == rank)
        if rows.size == 0:
            plan.append([])
            continue
        count = None if bins is None else min(bins, int(rows.size))
        plan.append([rows[g] for g in _split(n[rows], budget, count, mult, packed)])
    total = max(max(len(p) for p in plan), bins or 1)
    empty = np.zeros(0, dtype=np.int64)
    return [p + [empty] * (total - len(p)) for p in plan]


def padding_table(table: pa.Table) -> pa.Table:
    """A DP padding microbatch with ``table``'s schema: one dummy trajectory.

    The trajectory (id and group `PADDING_TRAJECTORY_ID`) has one prompt token 0, an empty
    response and loss mask, reward 0 and, when ``table`` has a ``routes`` column, no route
    rows; other columns are null. The schema metadata (the spec) is kept and
    `PADDING_METADATA_KEY` added. The collator gives it ``padding_mask`` True at every
    position, dummy route rows ``[0 .. K-1]``, loss mask 0 and ``Microbatch.is_padding``.
    Marked validated when ``table`` is.

    Its loss mask sums to 0: a loss normalised per microbatch must not divide by it (one
    normalised over the global batch's tokens is unaffected). With a router aux loss on,
    megatron-core 0.16.1 divides by its zero unpadded tokens (NaN gradients); apply
    ``r3arrow.megatron.apply_shims()`` first.

    Raises `SchemaError` when ``table`` lacks the token columns.
    """
    fields = {f.name: f for f in table.schema}
    for name in ("trajectory_id", "group_id", "prompt_ids", "response_ids", "loss_mask"):
        if name not in fields:
            raise SchemaError(f"expected column {name!r}, found columns {table.schema.names}")
    values: dict[str, Any] = {
        "trajectory_id": [PADDING_TRAJECTORY_ID],
        "group_id": [PADDING_TRAJECTORY_ID],
        "prompt_ids": [[0]],
        "response_ids": [[]],
        "loss_mask": [[]],
        "reward": [0.0],
        "routes": [[]],
    }
    arrays = [
        pa.array(values[f.name], type=f.type) if f.name in values else pa.nulls(1, type=f.type)
        for f in table.schema
    ]
    meta: dict[bytes, bytes] = dict(table.schema.metadata or {})
    meta[PADDING_METADATA_KEY] = b"1"
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
    """Split a rollout table into microbatches of whole trajectories.

    The plan is `plan_dp_microbatches` on the prompt + response lengths; each part keeps
    every column and the schema metadata (the spec). With ``dp_size > 1``, the microbatches
    of DP rank ``dp_rank`` (required; in ``[0, dp_size)``): as many on every rank, padding
    microbatches (`padding_table`) last. Works on tables with or without a ``routes``
    column (R3 off). Raises as `plan_dp_microbatches` does, and ``ValueError`` for a
    missing or out-of-range ``dp_rank``.
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
