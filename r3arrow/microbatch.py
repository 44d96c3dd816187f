"""Split rollouts into microbatches of whole trajectories, by token budget or by count.

Torch-free (numpy and pyarrow only): the planner runs wherever tables are, before any
trainer tensor exists. `split_microbatch_indices` plans on trajectory lengths;
`split_microbatches` applies the plan to a rollout table. The cost model matches the
layouts of `r3arrow.collate.MegatronCollator` (see ``docs/design.md``, "Layouts for
Megatron"): packed, a microbatch costs the sum of its lengths rounded up to the alignment
multiple; unpacked, its rows times the longest rounded length.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from r3arrow._checks import check_optional_int, check_positive_int
from r3arrow.errors import SchemaError
from r3arrow.table import sequence_lengths, take_rows


def _round_up(x: np.ndarray, m: int) -> np.ndarray:
    return np.asarray(-(-x // m) * m, dtype=np.int64)


def split_microbatch_indices(
    lengths: Sequence[int] | np.ndarray,
    *,
    max_tokens: int | None = None,
    num_microbatches: int | None = None,
    multiple: int = 1,
    packed: bool = True,
) -> list[np.ndarray]:
    """Row indices (int64, ascending) of each microbatch; every trajectory stays whole.

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

    Balancing is longest-first onto the least loaded microbatch; microbatches are
    ordered by their first row.

    Raises
    ------
    TypeError, ValueError
        ``max_tokens``/``multiple`` not a positive int, ``num_microbatches`` not in
        ``1 .. B``, or neither ``max_tokens`` nor ``num_microbatches`` given.
    SchemaError
        ``lengths`` is not a non-empty 1-D array of lengths ``>= 1`` (``row`` set), or a
        trajectory alone exceeds the budget (``row`` set).
    """
    multiple = check_positive_int(multiple, "multiple")
    budget = check_optional_int(max_tokens, "max_tokens", minimum=1)
    if budget is None and num_microbatches is None:
        raise ValueError("expected max_tokens, num_microbatches or both, found neither")
    n = np.asarray(lengths, dtype=np.int64)
    if n.ndim != 1 or n.size == 0:
        raise SchemaError(
            f"expected a non-empty 1-D array of trajectory lengths, found shape {list(n.shape)}"
        )
    if int(n.min()) < 1:
        i = int(np.argmin(n))
        found = int(n[i])
        raise SchemaError(f"expected trajectory lengths >= 1, found {found} at row {i}", row=i)
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


def _balance(cost: np.ndarray, order: np.ndarray, bins: int) -> list[np.ndarray]:
    load = np.zeros(bins, dtype=np.int64)
    assign = np.empty(cost.shape[0], dtype=np.int64)
    for i in order.tolist():  # per trajectory, on B-sized metadata only
        j = int(np.argmin(load))
        assign[i] = j
        load[j] += cost[i]
    groups = [np.flatnonzero(assign == j) for j in range(bins)]
    groups.sort(key=lambda g: int(g[0]))
    return groups


def split_microbatches(
    table: pa.Table,
    *,
    max_tokens: int | None = None,
    num_microbatches: int | None = None,
    multiple: int = 1,
    packed: bool = True,
) -> list[pa.Table]:
    """Split a rollout table into microbatches of whole trajectories.

    The plan is `split_microbatch_indices` on the prompt + response lengths; each part
    keeps every column and the schema metadata (the spec). Raises as that function does.
    """
    groups = split_microbatch_indices(
        sequence_lengths(table),
        max_tokens=max_tokens,
        num_microbatches=num_microbatches,
        multiple=multiple,
        packed=packed,
    )
    return [take_rows(table, g) for g in groups]


__all__ = ["split_microbatch_indices", "split_microbatches"]
