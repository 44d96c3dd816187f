"""Plan and read one (DP rank, PP stage)'s share of a rollout directory, by row group.

Torch-free core (numpy, pyarrow, `r3arrow.io`): the pieces that
`r3arrow.collate.collate_directory` (local, one process per rank) and
`r3arrow.ray.shard_microbatches` (Ray Data read tasks) are built from, so a Ray read task
never imports torch. Per step:

1. **Plan** (`plan_steps`): the token columns of every row group are read (prompt and
   response ids only: a few bytes per token against ``L*K`` route bytes), and
   `r3arrow.microbatch.plan_dp_microbatches` plans every DP rank on the step's lengths:
   the very plan `r3arrow.microbatch.split_microbatches` gives on the whole step in
   memory, so every rank gets the same number of microbatches (padding microbatches
   last) and every rank computes the same plan.
   ``dp_assign="contiguous"`` plans with `plan_contiguous` instead: each DP rank a
   contiguous row range, so it reads only its own row groups.
2. **Read** (`read_share`): the rank's microbatches are grouped into *waves* whose
   estimated bytes fit ``max_memory``; for a wave, each row group holding one of its
   rows is read with only the stage's layers (``layers=``: a layer-projected read,
   ``docs/storage.md``) and the wave's rows are taken out of it (one copy, then the
   group's other rows are dropped; a group whose rows are all the wave's is kept as is),
   so at most ``max_memory`` plus one row group is resident. A wave's microbatch is a
   zero-copy concatenation of slices of those pieces, rows in ascending step order (as
   `split_microbatches` orders them).

Every row group is validated as it is read (``validate=True``, the readers' checks of
`r3arrow.io`), and the microbatch tables are marked validated so a collator does not
check them again. Memory: the budget bounds the pieces of one wave; one microbatch is
never split, so a microbatch larger than ``max_memory`` still forms a wave of its own.
More than one wave per step re-reads the row groups shared by two waves (``docs/ray.md``).

`read_ahead` overlaps reading the next wave with the caller's use of the current one
(`r3arrow.collate.collate_directory` collates meanwhile) when both fit the budget.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np
import pyarrow as pa

from r3arrow._checks import check_choice, check_int, check_optional_int, check_positive_int
from r3arrow._schema import ROLLOUT_COLUMNS, list_lengths
from r3arrow._typing import PathLike
from r3arrow._validated import is_validated, mark_validated
from r3arrow.errors import SchemaError
from r3arrow.io import DEFAULT_MAX_MEMORY, read_rollouts, rollout_files
from r3arrow.microbatch import padding_table, plan_dp_microbatches
from r3arrow.spec import RouteSpec

#: Columns a collator reads: the core columns; ``routes`` is added with a spec.
COLLATE_COLUMNS = tuple(c for c in ROLLOUT_COLUMNS if c != "routes")
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
    """The microbatch plan of one step for every DP rank.

    ``groups``: the step's row groups in row order; ``lengths``: tokens (prompt +
    response) of every row, int64 ``[B]``; ``microbatches[rank][j]``: the rows (int64,
    ascending, step order) of microbatch ``j`` of DP rank ``rank`` — empty for a padding
    microbatch. Every rank has ``num_microbatches`` of them; every row is in exactly one.
    """

    step: int | None
    groups: tuple[RowGroupRef, ...]
    lengths: np.ndarray
    microbatches: tuple[tuple[np.ndarray, ...], ...]

    @property
    def num_microbatches(self) -> int:
        return len(self.microbatches[0])

    @property
    def num_rows(self) -> int:
        return int(self.lengths.shape[0])


def plan_contiguous(
    lengths: np.ndarray,
    *,
    dp_size: int,
    max_tokens: int | None = None,
    num_microbatches: int | None = None,
    multiple: int = 1,
    packed: bool = True,
) -> list[list[np.ndarray]]:
    """A DP plan like `plan_dp_microbatches` whose ranks hold contiguous rows.

    Rank ``r`` gets the rows whose cost midpoint (lengths rounded up to ``multiple``,
    cumulated in row order) falls in the ``r``-th ``1/dp_size`` of the total cost: a
    contiguous range, balanced to within one trajectory. Each range is split by
    `plan_dp_microbatches` (``dp_size=1``); every rank is padded (empty arrays, last) to the largest
    count. A rank then reads only the row groups of its range. Raises as
    `plan_dp_microbatches`.
    """
    dp_size = check_positive_int(dp_size, "dp_size")
    multiple = check_positive_int(multiple, "multiple")
    max_tokens = check_optional_int(max_tokens, "max_tokens", minimum=1)
    bins = check_optional_int(num_microbatches, "num_microbatches", minimum=1)
    n = np.asarray(lengths, dtype=np.int64)
    malformed = n.ndim != 1 or n.size == 0 or int(n.min(initial=1)) < 1
    neither = max_tokens is None and bins is None
    if malformed or neither or (bins is not None and bins > n.size):
        # Let the balanced planner raise its error for these (same messages).
        return plan_dp_microbatches(
            n,
            dp_size=dp_size,
            max_tokens=max_tokens,
            num_microbatches=bins,
            multiple=multiple,
            packed=packed,
        )
    cost = -(-n // multiple) * multiple
    if max_tokens is not None and int(cost.max()) > max_tokens:  # raises, naming the row
        plan_dp_microbatches(n, max_tokens=max_tokens, multiple=multiple, packed=packed)
    cum = np.cumsum(cost)
    mid = cum - cost / 2
    owner = np.minimum((mid * dp_size // int(cum[-1])).astype(np.int64), dp_size - 1)
    plan: list[list[np.ndarray]] = []
    for rank in range(dp_size):  # per DP rank: not a hot loop
        rows = np.flatnonzero(owner == rank)
        if not rows.size:
            plan.append([])
            continue
        count = None if bins is None else min(bins, int(rows.size))
        (parts,) = plan_dp_microbatches(
            n[rows],
            max_tokens=max_tokens,
            num_microbatches=count,
            multiple=multiple,
            packed=packed,
        )
        plan.append([rows[g] for g in parts])
    total = max(max(len(p) for p in plan), bins or 1)
    empty = np.zeros(0, dtype=np.int64)
    return [p + [empty] * (total - len(p)) for p in plan]


#: DP assignments of `plan_steps`: "balanced" (`plan_dp_microbatches`, the plan of
#: `split_microbatches`) or "contiguous" (`plan_contiguous`, each rank a row range).
DP_ASSIGNMENTS = ("balanced", "contiguous")


def _step_plan(
    step: int | None,
    groups: list[RowGroupRef],
    lengths: list[np.ndarray],
    dp_size: int,
    assign: str,
    options: dict[str, Any],
) -> StepPlan:
    n = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    if n.size == 0:
        where = groups[0].path if groups else "the step"
        raise SchemaError(f"step {step}: expected trajectories to plan, found none in {where}")
    planner = plan_contiguous if assign == "contiguous" else plan_dp_microbatches
    plan = planner(n, dp_size=dp_size, **options)
    return StepPlan(step, tuple(groups), n, tuple(tuple(rank) for rank in plan))


def plan_steps(
    path: PathLike,
    *,
    steps: Sequence[int] | None = None,
    dp_size: int = 1,
    max_tokens: int | None = None,
    num_microbatches: int | None = None,
    multiple: int = 1,
    packed: bool = True,
    dp_assign: str = "balanced",
    validate: bool = True,
) -> tuple[RouteSpec, Iterator[StepPlan]]:
    """The spec of ``path`` (a rollout file or step root) and a lazy plan per step.

    Footers are read (and every file checked to share one spec) before returning; each
    `StepPlan` is computed when the iterator reaches it, from the step's token columns
    (read row group by row group, validated unless ``validate=False``). The plan is
    `r3arrow.microbatch.plan_dp_microbatches` with these arguments (``max_tokens``,
    ``num_microbatches`` per rank; ``multiple`` and ``packed`` the collator's layout), or
    with ``dp_assign="contiguous"`` `plan_contiguous` (each DP rank a row range, so it
    reads only its row groups; not the plan of `split_microbatches`). A file outside a
    root is one step, ``None``.

    Raises ``TypeError``/``ValueError`` for argument misuse (as `plan_dp_microbatches`,
    checked here), `SchemaError` (``path`` set) for a missing, foreign or corrupt file or
    mixed specs, and, while iterating, the readers' validation errors and `SchemaError`
    for a trajectory over ``max_tokens``.
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
        for step, step_group in itertools.groupby(files, key=lambda f: f.step):
            groups: list[RowGroupRef] = []
            lengths: list[np.ndarray] = []
            start = 0
            for f in step_group:
                for g in range(f.num_row_groups):  # per row group: not a hot loop
                    cols = read_rollouts(
                        [f],
                        row_groups=[g],
                        columns=["prompt_ids", "response_ids"],
                        validate=validate,
                    )
                    n = list_lengths(cols.column("prompt_ids")) + list_lengths(
                        cols.column("response_ids")
                    )
                    groups.append(RowGroupRef(str(f.path), g, start, int(n.shape[0])))
                    lengths.append(n)
                    start += int(n.shape[0])
            yield _step_plan(step, groups, lengths, dp, assign, options)

    return spec, plans()


def _read(
    ref: RowGroupRef,
    columns: Sequence[str],
    layers: Sequence[int] | None,
    validate: bool,
) -> pa.Table:
    """One row group: ``columns`` only and, with ``layers``, only those (a projected read)."""
    table = read_rollouts(
        ref.path,
        row_groups=[ref.row_group],
        columns=list(columns),
        layers=None if layers is None else list(layers),
        validate=validate,
    )
    if table.num_rows != ref.num_rows:  # the file changed since it was planned
        raise SchemaError(
            f"{ref.path}: row group {ref.row_group} expected {ref.num_rows} rows (planned), "
            f"found {table.num_rows}",
            path=ref.path,
        )
    return table


def _waves(sizes: np.ndarray, budget: int) -> list[range]:
    """Consecutive microbatches whose estimated bytes fit ``budget`` (one at least each)."""
    waves: list[range] = []
    first, total = 0, 0
    for j, size in enumerate(sizes.tolist()):  # per microbatch: not a hot loop
        if j > first and total + size > budget:
            waves.append(range(first, j))
            first, total = j, 0
        total += size
    waves.append(range(first, len(sizes)))
    return waves


def read_share(
    plan: StepPlan,
    dp_rank: int,
    *,
    layers: Sequence[int] | None = None,
    columns: Sequence[str] | None = None,
    spec: RouteSpec | None = None,
    max_memory: int = DEFAULT_MAX_MEMORY,
    validate: bool = True,
) -> Iterator[tuple[int, pa.Table]]:
    """Yield ``(j, table)`` for every microbatch ``j`` of DP rank ``dp_rank`` in ``plan``.

    Tables hold the microbatch's trajectories in step order, ``columns`` only (default
    `COLLATE_COLUMNS` + ``routes``) and, with ``layers``, only those layers (a projected
    table: `r3arrow.table.route_layers` names them); they keep the file's
    schema metadata and, when ``validate``, are marked validated. A padding microbatch
    is `r3arrow.microbatch.padding_table` of the step's schema. ``spec`` (the files'
    spec) sizes the memory estimate: a token costs its route bytes (``len(layers)`` or
    ``spec.num_layers`` rows of ``topk`` ids) plus 16.
    At most ``max_memory`` bytes (estimated) of taken rows plus one row group are resident.

    Raises ``ValueError``/``TypeError`` for a ``dp_rank`` outside the plan or a
    ``max_memory`` that is not a positive int (at call time), and while iterating the
    readers' errors and `SchemaError` (``path`` set) if a row group no longer holds the
    rows it was planned with.
    """
    ranks = len(plan.microbatches)
    rank = check_int(dp_rank, "dp_rank", minimum=0, maximum=ranks - 1)
    budget = check_positive_int(max_memory, "max_memory")
    cols = [*COLLATE_COLUMNS, "routes"] if columns is None else list(columns)
    layer_list = None if layers is None else [check_int(i, "layers") for i in layers]
    per_token = _per_token(spec, layer_list)
    waves = _load_waves(plan, rank, layer_list, cols, budget, per_token, validate)
    return itertools.chain.from_iterable(wave.tables() for wave in waves)


def _per_token(spec: RouteSpec | None, layers: Sequence[int] | None) -> int:
    """Estimated bytes per token read: the route rows of ``layers`` (or all) plus the ids."""
    if spec is None:
        return _TOKEN_BYTES
    count = spec.num_layers if layers is None else len(layers)
    return _TOKEN_BYTES + count * spec.topk * np.dtype(spec.dtype).itemsize


def _empty(table: pa.Table, validate: bool) -> pa.Table:
    """No rows of ``table`` (its schema and metadata), validated if ``table`` was."""
    out = table.slice(0, 0)
    return mark_validated(out) if validate and is_validated(table) else out


@dataclasses.dataclass
class _Wave:
    """Consecutive microbatches ``js`` of one rank, their rows taken out of the row groups."""

    step: int | None
    js: range
    mbs: tuple[np.ndarray, ...]
    real: list[int]
    pieces: list[pa.Table]
    #: Per piece: its rows in (microbatch, step row) order; those of microbatch ``real[k]``
    #: are ``index[b[k]:b[k + 1]]`` with ``b`` the piece's ``bounds``.
    indices: list[np.ndarray]
    bounds: list[np.ndarray]
    template: pa.Table
    validate: bool

    def tables(self) -> Iterator[tuple[int, pa.Table]]:
        validated = self.validate and all(is_validated(p) for p in self.pieces)
        meta = self.template.schema.metadata
        for j in self.js:
            if not self.mbs[j].size:
                yield j, padding_table(self.template)
                continue
            k = self.real.index(j)
            parts = [
                piece.slice(a, n)
                for piece, index, b in zip(self.pieces, self.indices, self.bounds, strict=True)
                for a, n in _runs(index[b[k] : b[k + 1]])
            ]
            out = pa.concat_tables(parts).replace_schema_metadata(meta)  # zero-copy
            yield j, mark_validated(out) if validated else out


def _runs(index: np.ndarray) -> list[tuple[int, int]]:
    """``(start, length)`` of each run of consecutive values of an ascending ``index``."""
    if not index.size:
        return []
    cut = np.flatnonzero(np.diff(index) != 1) + 1
    starts = index[np.concatenate(([0], cut))]
    lengths = np.diff(np.concatenate(([0], cut, [index.size])))
    return list(zip(starts.tolist(), lengths.tolist(), strict=True))


def _wave_loaders(
    plan: StepPlan,
    rank: int,
    layers: list[int] | None,
    columns: list[str],
    budget: int,
    per_token: int,
    validate: bool,
) -> Iterator[tuple[int, Callable[[], _Wave]]]:
    """``(estimated bytes, load)`` of each of the rank's waves of ``plan``, in order.

    ``load()`` reads the wave's row groups and takes its rows; the loads must be called
    in order (the first wave's schema is the template of padding microbatches), each at
    most once, from any one thread at a time.
    """
    mbs = plan.microbatches[rank]
    starts = np.asarray([g.start for g in plan.groups], dtype=np.int64)
    sizes = np.asarray([int(plan.lengths[m].sum()) * per_token for m in mbs], dtype=np.int64)
    state: dict[str, pa.Table] = {}

    def load(wave: range) -> _Wave:
        real = [j for j in wave if mbs[j].size]
        pieces: list[pa.Table] = []
        indices: list[np.ndarray] = []
        bounds: list[np.ndarray] = []
        if real:
            rows = np.concatenate([mbs[j] for j in real])
            owner = np.repeat(np.arange(len(real)), [mbs[j].size for j in real])
            order = np.lexsort((rows, owner))  # by microbatch, then step order
            rows, owner = rows[order], owner[order]
            group = np.searchsorted(starts, rows, side="right") - 1
            by_group = np.argsort(group, kind="stable")  # keeps (microbatch, row) order
            for gi in np.unique(group).tolist():  # per row group: not a hot loop
                sel = by_group[group[by_group] == gi]
                ref = plan.groups[gi]
                table = _read(ref, columns, layers, validate)
                local = rows[sel] - ref.start
                if local.size == ref.num_rows:  # the whole group is ours: keep it, no copy
                    piece, index = table, local
                else:  # take our rows out, so the group's other rows go now
                    piece = table.take(pa.array(local, type=pa.int64()))
                    piece = piece.replace_schema_metadata(table.schema.metadata)
                    if validate and is_validated(table):
                        mark_validated(piece)
                    index = np.arange(local.size, dtype=np.int64)
                pieces.append(piece)
                indices.append(index)
                bounds.append(np.searchsorted(owner[sel], np.arange(len(real) + 1)))
                del table
            if "template" not in state:
                state["template"] = _empty(pieces[0], validate)
        elif "template" not in state:  # only padding so far: the schema of the first row group
            state["template"] = _empty(_read(plan.groups[0], columns, layers, validate), validate)
        return _Wave(
            plan.step, wave, mbs, real, pieces, indices, bounds, state["template"], validate
        )

    for wave in _waves(sizes, budget):
        yield int(sizes[wave.start : wave.stop].sum()), functools.partial(load, wave)


def _load_waves(
    plan: StepPlan,
    rank: int,
    layers: list[int] | None,
    columns: list[str],
    budget: int,
    per_token: int,
    validate: bool,
) -> Iterator[_Wave]:
    """The rank's waves of ``plan``, each loaded (read, taken) when the iterator reaches it."""
    for _, load in _wave_loaders(plan, rank, layers, columns, budget, per_token, validate):
        yield load()


def read_ahead(loaders: Iterator[tuple[int, Callable[[], T]]], budget: int) -> Iterator[T]:
    """``load()`` of each ``(size, load)``, the next loaded on a thread while this one is used.

    Reading (Arrow's Parquet reader) and collating (numpy/numba copies) release the GIL,
    so the next wave is read on a background thread while the caller collates the
    current one, but only when both fit ``budget`` together (estimated ``size`` bytes):
    otherwise it is read once the caller asks for it, after it dropped the current item
    (it must: the caller holds no reference to an item when it asks for the next). So at
    most ``budget`` (or one item larger than it) is resident, and a step whose share fits
    the budget is read in one wave (no row group read twice). ``loaders`` is advanced
    (the next step planned: its token columns) on the caller's thread while the
    background thread reads, which balances the two threads (read | plan + collate).
    Errors surface in order.
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
    "COLLATE_COLUMNS",
    "DEFAULT_MAX_MEMORY",
    "DP_ASSIGNMENTS",
    "RowGroupRef",
    "StepPlan",
    "plan_contiguous",
    "plan_steps",
    "read_ahead",
    "read_share",
]
