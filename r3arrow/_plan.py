"""Plan and read one (DP rank, PP stage)'s share of a rollout directory, by row group: the
torch-free pieces of `r3arrow.collate.collate_directory` and `r3arrow.ray.shard_microbatches`
(a Ray read task never imports torch). ``docs/ray.md``, "The plan" and "The read".
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Literal, TypeVar, get_args

import numpy as np
import pyarrow as pa

from r3arrow._checks import check_choice, check_int, check_optional_int, check_positive_int
from r3arrow._schema import ROLLOUT_COLUMNS
from r3arrow._typing import PathLike
from r3arrow._validated import is_validated, mark_validated
from r3arrow.errors import SchemaError
from r3arrow.io import DEFAULT_MAX_MEMORY, read_rollouts, rollout_files
from r3arrow.microbatch import padding_table, plan_dp_microbatches
from r3arrow.spec import RouteSpec
from r3arrow.table import sequence_lengths, take_rows

#: Columns a share is read with: the rollout columns, ``routes`` last.
_COLUMNS = (*(c for c in ROLLOUT_COLUMNS if c != "routes"), "routes")
#: DP assignments of `plan_steps` (``docs/scale.md``, "Per-rank reads"): "contiguous" (the
#: default, `plan_contiguous`: each rank a row range snapped to row groups, balanced to within
#: one trajectory's cost, reading only its own row groups) or "balanced"
#: (`plan_dp_microbatches`, exactly the in-memory plan of `split_microbatches`, whose ranks
#: read the stage's layers of nearly every row group).
DpAssign = Literal["contiguous", "balanced"]
DP_ASSIGNMENTS: tuple[str, ...] = get_args(DpAssign)
T = TypeVar("T")
#: Bytes per token of the non-route columns in the memory estimate (ids, mask, offsets).
_TOKEN_BYTES = 16


@dataclasses.dataclass(frozen=True)
class RowGroupRef:
    """One Parquet row group of a step: rows ``start .. start + num_rows`` in step order."""

    path: str
    row_group: int
    start: int
    num_rows: int


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """The microbatch plan of one step: ``groups`` in row order, int64 ``lengths`` ``[B]``,
    ``microbatches[rank][j]`` the ascending rows of microbatch ``j`` (empty: padding)."""

    step: int | None
    groups: tuple[RowGroupRef, ...]
    lengths: np.ndarray
    microbatches: tuple[tuple[np.ndarray, ...], ...]

    @property
    def num_microbatches(self) -> int:
        return len(self.microbatches[0])


def plan_contiguous(
    lengths: np.ndarray,
    *,
    dp_size: int,
    max_tokens: int | None = None,
    num_microbatches: int | None = None,
    multiple: int = 1,
    packed: bool = True,
    group_starts: Sequence[int] | None = None,
) -> list[list[np.ndarray]]:
    """A DP plan like `plan_dp_microbatches` whose ranks hold contiguous rows: rank ``r``
    gets the rows whose cost midpoint (cumulated in row order) falls in the ``r``-th
    ``1/dp_size`` of the total cost. ``group_starts``: the first rows of the row groups
    (from the footers); a boundary between ranks moves to the start of a row group where
    that keeps every rank within one trajectory's cost of an even share, so no row group
    is read by two ranks there. Raises as `plan_dp_microbatches`, ``TypeError`` /
    ``ValueError`` for ``group_starts`` not ints in ``[0, len(lengths)]``."""
    dp_size = check_positive_int(dp_size, "dp_size")
    multiple = check_positive_int(multiple, "multiple")
    max_tokens = check_optional_int(max_tokens, "max_tokens", minimum=1)
    bins = check_optional_int(num_microbatches, "num_microbatches", minimum=1)
    n = np.asarray(lengths, dtype=np.int64)
    cost = -(-n // multiple) * multiple
    options: dict[str, Any] = {"max_tokens": max_tokens, "multiple": multiple, "packed": packed}
    if (
        n.ndim != 1
        or n.size == 0
        or int(n.min(initial=1)) < 1
        or (max_tokens is None and bins is None)
        or (bins is not None and bins > n.size)
        or (max_tokens is not None and int(cost.max()) > max_tokens)
    ):
        # The balanced planner raises its error for these (same messages).
        return plan_dp_microbatches(n, dp_size=dp_size, num_microbatches=bins, **options)
    cum = np.cumsum(cost)
    owner = np.minimum(((cum - cost / 2) * dp_size // int(cum[-1])).astype(np.int64), dp_size - 1)
    if group_starts is not None:
        starts = [
            check_int(g, "group_starts", minimum=0, maximum=int(n.size)) for g in group_starts
        ]
        owner = _snap(owner, cost, dp_size, np.unique(np.asarray(starts, dtype=np.int64)))
    plan: list[list[np.ndarray]] = []
    for rank in range(dp_size):  # per DP rank: not a hot loop
        rows = np.flatnonzero(owner == rank)
        count = None if bins is None else min(bins, int(rows.size))
        parts = (
            plan_dp_microbatches(n[rows], num_microbatches=count, **options)[0] if rows.size else []
        )
        plan.append([rows[g] for g in parts])
    total = max(max(len(p) for p in plan), bins or 1)
    empty = np.zeros(0, dtype=np.int64)
    return [p + [empty] * (total - len(p)) for p in plan]


def _snap(owner: np.ndarray, cost: np.ndarray, dp_size: int, starts: np.ndarray) -> np.ndarray:
    """``owner`` (each row's rank, non-decreasing) with each rank boundary moved to the
    row-group start whose preceding cost is nearest the boundary's even share, if within
    half the largest cost (the midpoint rule's own bound: every rank stays within one
    trajectory's cost of ``total / dp_size``); unchanged if that would reorder the ranks."""
    edges = np.searchsorted(owner, np.arange(1, dp_size)).astype(np.int64)
    before = np.concatenate([np.zeros(1, np.int64), np.cumsum(cost)])  # cost before row i
    total = float(before[-1])
    half = float(cost.max()) / 2
    inner = starts[(starts > 0) & (starts < owner.size)]
    if inner.size:
        for r in range(1, dp_size):  # per DP rank boundary: not a hot loop
            ideal = r * total / dp_size
            gap = np.abs(before[inner] - ideal)
            k = int(np.argmin(gap))
            if gap[k] <= half:
                edges[r - 1] = inner[k]
    if np.any(np.diff(edges) < 0):
        return owner
    return np.searchsorted(edges, np.arange(owner.size), side="right").astype(np.int64)


def plan_steps(
    path: PathLike,
    *,
    steps: Sequence[int] | None = None,
    dp_size: int = 1,
    max_tokens: int | None = None,
    num_microbatches: int | None = None,
    multiple: int = 1,
    packed: bool = True,
    dp_assign: DpAssign = "contiguous",
    validate: bool = True,
) -> tuple[RouteSpec, Iterator[StepPlan]]:
    """The spec of ``path`` (a rollout file or step root) and a lazy `StepPlan` per step.

    Footers are read (one spec for every file) before returning; each plan is made from
    the step's token columns (validated unless ``validate=False``) when the iterator
    reaches it, by `plan_contiguous` with these arguments and the row groups' first rows
    (``dp_assign="contiguous"``, the default) or by `plan_dp_microbatches`
    (``dp_assign="balanced"``). A file outside a root is step ``None``.

    Raises ``TypeError``/``ValueError`` for argument misuse (checked here), `SchemaError`
    (``path`` set) for a missing, foreign or corrupt file or mixed specs and, while
    iterating, the readers' validation errors and `SchemaError` for a trajectory over
    ``max_tokens``.
    """
    dp = check_positive_int(dp_size, "dp_size")
    assign = check_choice(dp_assign, "dp_assign", DP_ASSIGNMENTS)
    options: dict[str, Any] = {
        "max_tokens": check_optional_int(max_tokens, "max_tokens", minimum=1),
        "num_microbatches": check_optional_int(num_microbatches, "num_microbatches", minimum=1),
        "multiple": check_positive_int(multiple, "multiple"),
        "packed": bool(packed),
    }
    if options["max_tokens"] is None and options["num_microbatches"] is None:
        raise ValueError("expected max_tokens, num_microbatches or both, found neither")
    files = rollout_files(path, steps=steps, require_routes=True)
    spec = files[0].spec
    assert spec is not None  # require_routes

    def plans() -> Iterator[StepPlan]:
        for step, step_files in itertools.groupby(files, key=lambda f: f.step):
            groups: list[RowGroupRef] = []
            lengths: list[np.ndarray] = [np.zeros(0, np.int64)]
            start = 0
            for f in step_files:
                for g in range(f.num_row_groups):  # per row group: not a hot loop
                    cols = read_rollouts(
                        [f],
                        row_groups=[g],
                        columns=["prompt_ids", "response_ids"],
                        validate=validate,
                    )
                    n = sequence_lengths(cols)
                    groups.append(RowGroupRef(str(f.path), g, start, int(n.shape[0])))
                    lengths.append(n)
                    start += int(n.shape[0])
            n = np.concatenate(lengths)
            if n.size == 0:
                where = groups[0].path if groups else "the step"
                raise SchemaError(
                    f"step {step}: expected trajectories to plan, found none in {where}"
                )
            if assign == "contiguous":  # rank boundaries at row-group starts where balanced
                starts = [g.start for g in groups]
                plan = plan_contiguous(n, dp_size=dp, group_starts=starts, **options)
            else:
                plan = plan_dp_microbatches(n, dp_size=dp, **options)
            yield StepPlan(step, tuple(groups), n, tuple(tuple(rank) for rank in plan))

    return spec, plans()


def _read(ref: RowGroupRef, layers: list[int] | None, validate: bool) -> pa.Table:
    """One row group and, with ``layers``, only those (a projected read)."""
    table = read_rollouts(
        ref.path, row_groups=[ref.row_group], columns=_COLUMNS, layers=layers, validate=validate
    )
    if table.num_rows != ref.num_rows:  # the file changed since it was planned
        raise SchemaError(
            f"{ref.path}: row group {ref.row_group} expected {ref.num_rows} rows (planned), "
            f"found {table.num_rows}",
            path=ref.path,
        )
    return table


def read_share(
    plan: StepPlan,
    dp_rank: int,
    *,
    layers: Sequence[int] | None = None,
    spec: RouteSpec | None = None,
    max_memory: int = DEFAULT_MAX_MEMORY,
    validate: bool = True,
) -> Iterator[tuple[int, pa.Table]]:
    """Yield ``(j, table)`` for every microbatch ``j`` of DP rank ``dp_rank`` in ``plan``.

    Rows in step order, the rollout columns and, with ``layers``, only those layers; the
    file's schema metadata kept, marked validated with ``validate``; padding microbatches are
    `r3arrow.microbatch.padding_table`. At most ``max_memory`` estimated bytes (16 per token
    plus, with ``spec``, its route rows) of taken rows plus one row group are resident.

    Raises ``ValueError``/``TypeError`` at call time for a ``dp_rank`` outside the plan or
    a ``max_memory`` that is not a positive int, and while iterating the readers' errors
    and `SchemaError` (``path`` set) if a row group no longer holds its planned rows.
    """
    rank = check_int(dp_rank, "dp_rank", minimum=0, maximum=len(plan.microbatches) - 1)
    budget = check_positive_int(max_memory, "max_memory")
    layer_list = None if layers is None else [check_int(i, "layers") for i in layers]
    loaders = _wave_loaders(plan, rank, layer_list, spec, budget, validate)
    return itertools.chain.from_iterable(load().tables for _, load in loaders)


@dataclasses.dataclass
class _Wave:
    """Consecutive microbatches ``js`` of one rank: ``tables``, ``(j, table)`` each, are
    zero-copy slices of ``pieces``, the wave's rows taken out of the row groups."""

    step: int | None
    js: range
    pieces: list[pa.Table]
    tables: list[tuple[int, pa.Table]]


def _wave_loaders(
    plan: StepPlan,
    rank: int,
    layers: list[int] | None,
    spec: RouteSpec | None,
    budget: int,
    validate: bool,
) -> Iterator[tuple[int, Callable[[], _Wave]]]:
    """``(estimated bytes, load)`` of each of the rank's waves, to load in order (the first
    wave's schema is the padding template), each once, one thread at a time. The estimate
    per token: the route rows of ``layers`` (or all, with ``spec``) plus the ids."""
    per_token = _TOKEN_BYTES
    if spec is not None:
        count = spec.num_layers if layers is None else len(layers)
        per_token += count * spec.topk * np.dtype(spec.dtype).itemsize
    mbs = plan.microbatches[rank]
    starts = np.asarray([g.start for g in plan.groups], dtype=np.int64)
    sizes = np.asarray([int(plan.lengths[m].sum()) * per_token for m in mbs], dtype=np.int64)
    state: dict[str, pa.Table] = {}

    def load(wave: range) -> _Wave:
        real = [j for j in wave if mbs[j].size]
        pieces: list[pa.Table] = []
        parts: dict[int, list[pa.Table]] = {j: [] for j in real}
        if real:
            rows = np.concatenate([mbs[j] for j in real])  # by microbatch, then step order
            owner = np.repeat(np.arange(len(real)), [mbs[j].size for j in real])
            group = np.searchsorted(starts, rows, side="right") - 1
            for gi in np.unique(group).tolist():  # per row group: not a hot loop
                sel = np.flatnonzero(group == gi)
                ref = plan.groups[gi]
                table = _read(ref, layers, validate)
                local = rows[sel] - ref.start
                if local.size == ref.num_rows:  # the whole group is ours: keep it, no copy
                    piece, index = table, local
                else:  # take our rows out, so the group's other rows go now
                    piece, index = take_rows(table, local), np.arange(local.size, dtype=np.int64)
                pieces.append(piece)
                bounds = np.searchsorted(owner[sel], np.arange(len(real) + 1)).tolist()
                for k, j in enumerate(real):  # microbatch j's runs of rows of this piece
                    idx = index[bounds[k] : bounds[k + 1]]
                    for run in np.split(idx, np.flatnonzero(np.diff(idx) != 1) + 1):
                        if run.size:
                            parts[j].append(piece.slice(int(run[0]), int(run.size)))
                del table
        if "template" not in state:  # only padding so far: the schema of the first row group
            first = pieces[0] if pieces else _read(plan.groups[0], layers, validate)
            empty = first.slice(0, 0)
            state["template"] = mark_validated(empty) if validate and is_validated(first) else empty
        template = state["template"]
        validated = validate and all(is_validated(p) for p in pieces)
        tables = []
        for j in wave:
            if not mbs[j].size:
                tables.append((j, padding_table(template)))
                continue
            out = pa.concat_tables(parts[j]).replace_schema_metadata(template.schema.metadata)
            tables.append((j, mark_validated(out) if validated else out))  # zero-copy
        return _Wave(plan.step, wave, pieces, tables)

    # waves: consecutive microbatches whose estimated bytes fit the budget (one at least each)
    first, total = 0, 0
    for j, size in enumerate(sizes.tolist()):  # per microbatch: not a hot loop
        if j > first and total + size > budget:
            yield total, functools.partial(load, range(first, j))
            first, total = j, 0
        total += size
    yield total, functools.partial(load, range(first, len(sizes)))


def read_ahead(loaders: Iterator[tuple[int, Callable[[], T]]], budget: int) -> Iterator[T]:
    """``load()`` of each ``(size, load)``, the next loaded on a thread while this one is used
    if both sizes fit ``budget``, else once the caller, holding no reference to the current
    item, asks for it. ``loaders`` advances on the caller's thread. Errors surface in order.
    """
    with ThreadPoolExecutor(1, thread_name_prefix="r3arrow-read") as pool:
        current = next(loaders, None)
        if current is None:
            return
        future: Future[T] | None = pool.submit(current[1])
        upcoming = next(loaders, None)  # planned while the first wave is read
        while future is not None:
            item = future.result()
            future = None
            if upcoming is not None and current[0] + upcoming[0] <= budget:
                future = pool.submit(upcoming[1])  # both fit: read it meanwhile
            yield item
            del item  # the caller dropped it too: a read started below has the budget
            if upcoming is None:
                return
            current = upcoming
            if future is None:
                future = pool.submit(current[1])
            upcoming = next(loaders, None)  # plan the one after while this one is read


__all__ = [
    "DP_ASSIGNMENTS",
    "RowGroupRef",
    "StepPlan",
    "plan_contiguous",
    "plan_steps",
    "read_ahead",
    "read_share",
]
