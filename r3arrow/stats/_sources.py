"""Sources → partials: rollout tables, files and step roots as exact per-step partials.

A table is processed record batch by record batch (grouped by its ``step`` column when
it has one; a multi-chunk routes column is never combined). A path's files are listed
once per statistic, so every pass reads the same files while a writer adds steps. It is
streamed: the
bounded pieces of `r3arrow.io.iter_rollouts` (each at most a quarter of ``max_memory``,
only the needed columns), the next read on a thread while the current one is counted, so
at most two are resident whatever the step size. Expert counts of layer-group files take
a pass per stored group (`layered_counts`: whole groups restore without the interleave
copy), ``PASS_THREADS`` passes at once, each with a share of the budget (``docs/scale.md``).
An executor runs the same `BlockPartials` on every block and sums the encoded vectors
with `combine_vectors`: every path gives identical integers. Grouped by ``policy_version``
(`iter_groups`), each batch is split by its version column instead (``docs/versions.md``).
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal, TypeAlias, TypeVar, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from r3arrow._checks import check_int
from r3arrow._routes import as_route_rows
from r3arrow._schema import POLICY_VERSION, list_lengths
from r3arrow._typing import ArrowArray, PathLike, TableLike
from r3arrow._versions import check_version_column
from r3arrow.errors import RouteShapeError, SchemaError
from r3arrow.io import (
    DEFAULT_MAX_MEMORY,
    RolloutFile,
    iter_rollouts,
    project_layers,
    rollout_files,
    route_rows,
)
from r3arrow.spec import RouteSpec
from r3arrow.stats._agreement import RouteAgreement, compare_routes
from r3arrow.stats._counts import ExpertCounts, count_routes
from r3arrow.stats._fallback import delivered
from r3arrow.stats._kernels import cpus
from r3arrow.stats._selection import (
    check_column,
    check_layers,
    check_subset,
    columns_for,
    token_selection,
    use_column,
)
from r3arrow.table import flat_routes, route_layers, route_spec

#: A table or record batch, a rollout file or root, or the `Files` listed from one.
Source: TypeAlias = "TableLike | PathLike | Files"
Kind = Literal["counts", "agreement"]
Part = TypeVar("Part", ExpertCounts, RouteAgreement)
_T = TypeVar("_T")
_END = object()
_PART: dict[str, type[ExpertCounts] | type[RouteAgreement]] = {
    "counts": ExpertCounts,
    "agreement": RouteAgreement,
}
_NO_STEPS = (
    "by step: expected a step-partitioned directory or a table with a 'step' column, found neither"
)


# ================================================================ streaming
def check_budget(max_memory: object) -> int:
    """``max_memory`` (an int ``>= 1`` or None for the default) as bytes."""
    if max_memory is None:
        return DEFAULT_MAX_MEMORY
    return check_int(max_memory, "max_memory", minimum=1)


def prefetch(items: Iterator[_T]) -> Iterator[_T]:
    """The items of ``items``, the next one produced on a worker thread meanwhile.

    At most two items are alive at once; an exception of ``items`` is raised here, in
    order; closing this generator waits for the read in flight.
    """
    with ThreadPoolExecutor(1, thread_name_prefix="r3arrow-prefetch") as pool:
        ahead = pool.submit(next, items, _END)
        while True:
            item = ahead.result()
            if item is _END:
                return
            ahead = pool.submit(next, items, _END)
            yield item  # type: ignore[misc]  # _END is handled above
            del item  # not kept alive while the next one is read


def _stepped(
    pieces: Iterator[pa.Table], steps: list[int | None], keep: bool
) -> Iterator[tuple[int | None, pa.Table]]:
    """``(step, piece)`` of `r3arrow.io.iter_rollouts` pieces (a root's carry ``step``): in step
    order, never spanning two steps; an empty piece is the only one of a step without rows."""
    order = list(dict.fromkeys(steps))
    at = -1
    for piece in pieces:
        if piece.num_rows and "step" in piece.schema.names:
            at = order.index(int(piece.column("step")[0].as_py()), max(at, 0))
        elif not piece.num_rows:
            at += 1
        else:
            at = 0
        if "step" in piece.schema.names and not keep:
            piece = piece.drop_columns(["step"])
        yield order[min(at, len(order) - 1)], piece


# ================================================================== sources
def is_path(source: object) -> bool:
    """True for a ``str`` or ``os.PathLike`` (a rollout file or root)."""
    return isinstance(source, str | os.PathLike)


def is_table(source: object) -> bool:
    """True for a ``pyarrow.Table`` or ``RecordBatch``."""
    return isinstance(source, pa.Table | pa.RecordBatch)


def projected(source: TableLike, layers: Sequence[int]) -> pa.Table:
    """An in-memory table or batch projected to the global ``layers``."""
    table = source if isinstance(source, pa.Table) else pa.Table.from_batches([source])
    return project_layers(table, layers)


def _batches(table: TableLike) -> Iterator[TableLike]:
    """The record batches of ``table`` (itself when it has none), its metadata on each."""
    batches = table.to_batches() if isinstance(table, pa.Table) else []
    if not batches:
        yield table
        return
    meta = table.schema.metadata
    for b in batches:
        yield b if b.schema.metadata == meta else b.replace_schema_metadata(meta)


def _table_steps(
    source: TableLike, steps: Sequence[int] | None
) -> Iterator[tuple[int | None, TableLike]]:
    """(step, batch) of an in-memory table: by its ``step`` column when it has one."""
    if "step" not in source.schema.names:
        if steps is not None:
            raise SchemaError(f"steps= needs a 'step' column, found {source.schema.names}")
        for batch in _batches(source):
            yield None, batch
        return
    step_col = source.column("step")
    if step_col.null_count:
        raise SchemaError(f"step: expected no nulls, found {step_col.null_count}")
    values = np.asarray(step_col.to_numpy(), dtype=np.int64)
    wanted = (
        np.unique(values)
        if steps is None
        else np.asarray(sorted({check_int(s, "steps") for s in steps}), np.int64)
    )
    table = source if isinstance(source, pa.Table) else pa.Table.from_batches([source])
    for s in wanted:
        rows = np.flatnonzero(values == s)
        if rows.size == values.size:
            sub = table
        elif rows.size and rows[-1] - rows[0] + 1 == rows.size:
            sub = table.slice(int(rows[0]), int(rows.size))  # contiguous: zero-copy
        else:
            sub = table.take(rows).replace_schema_metadata(table.schema.metadata)
        for batch in _batches(sub):
            yield int(s), batch


@dataclasses.dataclass(frozen=True)
class Files:
    """A path's rollout files (`r3arrow.io.rollout_files`), listed once for a whole statistic."""

    files: list[RolloutFile]


def iter_source(
    source: Source,
    columns: list[str],
    steps: Sequence[int] | None,
    max_memory: int | None = None,
    validate: bool = False,
    layers: Sequence[int] | None = None,
) -> Iterator[tuple[int | None, TableLike]]:
    """(step, batch) pairs of a table, record batch, rollout file, step-partitioned root
    or `Files` (``steps`` then already applied).

    A path or `Files` is streamed (module docstring) with only ``columns``: ``steps`` must exist,
    ``max_memory`` is the budget in bytes (default 1 GiB), ``layers`` global layer ids to
    read, ``validate`` adds the row checks of `r3arrow.io.read_rollouts` (footers and
    row-group digests, or page checksums, are always verified); ``step`` is None for a
    file outside a root. A table
    must hold ``columns`` (and ``layers`` must be None: ``TypeError``). Raises
    ``TypeError`` for another source, `SchemaError` for missing columns or steps, and
    what `r3arrow.io.rollout_files` / `r3arrow.io.iter_rollouts` raise.
    """
    budget = check_budget(max_memory)
    if is_path(source):
        source = Files(rollout_files(cast(PathLike, source), steps=steps))  # steps must exist
    if isinstance(source, Files):
        files = source.files
        pieces = iter_rollouts(
            files,
            columns=[*columns, "step"],
            layers=None if layers is None else list(layers),
            max_memory=budget,
            validate=bool(validate),
        )
        for step, piece in prefetch(_stepped(pieces, [f.step for f in files], "step" in columns)):
            # A piece may span row groups (chunks): count batch by batch, never combined.
            batches = list(_batches(piece))[::-1]
            del piece
            while batches:
                yield step, batches.pop()
        return
    if not is_table(source):
        raise TypeError(
            f"expected a rollout table, record batch or Parquet path, found {type(source).__name__}"
        )
    table = cast(TableLike, source)
    if layers is not None:
        raise TypeError("layers: applies to a Parquet path source, found an in-memory table")
    missing = [c for c in columns if c not in table.schema.names]
    if missing:
        raise SchemaError(f"expected columns {missing}, found {table.schema.names}")
    yield from _table_steps(table, steps)


#: What a statistic's partials are keyed by: the ``step`` (None outside a root or a table
#: without one) or the ``policy_version`` of the rows (``docs/versions.md``).
Group = Literal["step", "policy_version"]


def _version_rows(batch: TableLike) -> Iterator[tuple[int, TableLike]]:
    """(version, rows) of one batch, versions ascending, rows in order (one version: the
    batch itself); `SchemaError` for a bad ``policy_version`` column."""
    check_version_column(batch, POLICY_VERSION)
    values = np.asarray(batch.column(POLICY_VERSION).to_numpy(zero_copy_only=False), np.int64)
    table = batch if isinstance(batch, pa.Table) else pa.Table.from_batches([batch])
    for v in np.unique(values):
        rows = np.flatnonzero(values == v)
        if rows.size == values.size:
            yield int(v), batch
            continue
        yield int(v), table.take(rows).replace_schema_metadata(table.schema.metadata)


def iter_groups(
    source: Source,
    columns: list[str],
    steps: Sequence[int] | None,
    max_memory: int | None = None,
    validate: bool = False,
    layers: Sequence[int] | None = None,
    *,
    by: Group = "step",
) -> Iterator[tuple[int | None, TableLike]]:
    """The (step, batch) pairs of `iter_source`, or with ``by="policy_version"`` (version,
    rows) pairs: each batch split by its ``policy_version`` column, also read from a path.
    Raises as `iter_source`, and `SchemaError` (``path`` set for a file) for a source
    without a ``policy_version`` column or one that breaks its rules."""
    if by == "step":
        yield from iter_source(source, columns, steps, max_memory, validate, layers)
        return
    if is_path(source):
        source, steps = Files(rollout_files(cast(PathLike, source), steps=steps)), None
    names: list[tuple[Path | None, list[str]]]
    if isinstance(source, Files):
        names = [(f.path, f.schema.names) for f in source.files]
    else:
        names = [(None, cast(TableLike, source).schema.names)] if is_table(source) else []
    for path, have in names:
        if POLICY_VERSION not in have:
            where = f"{path}: " if path is not None else ""
            raise SchemaError(
                f"{where}by version: expected a {POLICY_VERSION!r} column (docs/versions.md), "
                f"found columns {have}",
                path=path,
            )
    wanted = [*columns, POLICY_VERSION]
    for _, batch in iter_source(source, wanted, steps, max_memory, validate, layers):
        yield from _version_rows(batch)


# ============================================================ batch partials
def _global(part: Part, batch: TableLike, spec: RouteSpec) -> Part:
    """``part`` with global layer ids (a layer-projected batch: `r3arrow.table.route_layers`)."""
    ids = route_layers(batch)
    if ids == tuple(range(spec.num_layers)):
        return part
    return dataclasses.replace(part, layers=tuple(ids[i] for i in part.layers))


def batch_counts(batch: TableLike, tokens: str = "all", column: str = "routes") -> ExpertCounts:
    """`ExpertCounts` (global layer ids) of routes column ``column`` of one table or batch;
    ``routes`` rows marked missing (placeholders, ``docs/fallback.md``) are not counted."""
    batch = use_column(batch, column)
    select = token_selection(batch, tokens)
    if column == "routes":  # the trainer's routes of another column are real on every row
        select, _ = delivered(batch, select)
    spec = route_spec(batch)
    rows, _ = flat_routes(batch)
    return _global(count_routes(rows, spec, select=select), batch, spec)


def aligned_rows(batch: TableLike, col: ArrowArray, spec: RouteSpec, other: str) -> np.ndarray:
    """Rows of the ragged routes column ``col``, checked to route the same tokens as ``routes``."""
    rows_b, len_b = route_rows(col, spec, other)
    len_a = list_lengths(batch.column("routes"))
    if not np.array_equal(len_a, len_b):
        i = int(np.flatnonzero(len_a != len_b)[0])
        raise RouteShapeError(
            f"row {i}: expected {other!r} to route the same {len_a[i]} tokens as 'routes', "
            f"found {len_b[i]} rows",
            row=i,
        )
    return rows_b


def batch_agreement(batch: TableLike, other: str, tokens: str = "all") -> RouteAgreement:
    """`RouteAgreement` (global layer ids) of ``routes`` vs the routes column ``other``; rows
    whose ``routes`` are missing are left out and counted (``missing``)."""
    spec = route_spec(batch)
    rows_a, _ = flat_routes(batch)
    if other not in batch.schema.names:
        raise SchemaError(f"expected a second routes column {other!r}, found {batch.schema.names}")
    rows_b = aligned_rows(batch, batch.column(other), spec, other)
    select, missing = delivered(batch, token_selection(batch, tokens))
    local = compare_routes(rows_a, rows_b, spec, select=select)
    return _global(dataclasses.replace(local, missing=missing), batch, spec)


def batch_parts(
    source: Source,
    tokens: str,
    steps: Sequence[int] | None,
    part_of: Callable[[TableLike], Part],
    extra: Sequence[str] = (),
    max_memory: int | None = None,
    validate: bool = False,
    *,
    column: str = "routes",
    layers: Sequence[int] | None = None,
    by: Group = "step",
) -> Iterator[tuple[int | None, Part]]:
    """(step or version, ``part_of(batch)``) per batch of ``source`` (`iter_groups` by
    ``by``), reading only ``column``, ``extra`` and the columns of subset ``tokens``."""
    check_subset(tokens)
    columns = columns_for(tokens, extra, column=column)
    groups = iter_groups(source, columns, steps, max_memory, validate, layers, by=by)
    for step, batch in groups:
        part = part_of(batch)
        del batch  # not resident while the next step is read
        yield step, part


def sum_parts(
    parts: Iterator[tuple[int | None, Part]],
    source: object,
    spec: RouteSpec | None,
    empty: Callable[[RouteSpec], Part],
) -> Part:
    """Sum of the partials; ``empty(spec)`` of the source's spec when there are none."""
    total: Part | None = None
    for _, part in parts:
        total = part if total is None else total + part
    if total is not None:
        return total
    if spec is None and is_table(source):
        spec = route_spec(cast(TableLike, source))
    if spec is None:
        raise SchemaError(f"{source}: expected rollout data, found none")
    return empty(spec)


def sum_by_step(parts: Iterator[tuple[int | None, Part]]) -> dict[int, Part]:
    """Partials summed per step, ascending; raises `SchemaError` if the source has no steps."""
    out: dict[int, Part] = {}
    for step, part in parts:
        if step is None:
            raise SchemaError(_NO_STEPS)
        out[step] = out[step] + part if step in out else part
    return dict(sorted(out.items()))


# ========================================================= layer-group passes
#: Layer-group passes read at once (at most; never more than the CPUs).
PASS_THREADS = 2


def stored_groups(source: Files, layers: Sequence[int] | None = None) -> list[list[int]] | None:
    """The wanted router layers (``layers``; None: all) of each stored layer group of
    ``source`` (files with routes); None unless every file has the same groups
    (`r3arrow.io.RolloutFile.layer_groups`) and at least two hold wanted layers."""
    spec = source.files[0].spec
    assert spec is not None  # listed with require_routes
    groups = {f.layer_groups for f in source.files}
    if len(groups) != 1:
        return None
    (seen,) = groups
    if seen is None:
        return None
    wanted = set(spec.router_layers)
    if layers is not None:
        present = {i for g in seen for i in g}
        missing = sorted(set(layers) - present)
        if missing:  # as layer projection (io's layer projection) for a full table
            raise ValueError(f"layers: expected ids in [0, {len(present)}), found {missing}")
        wanted &= set(layers)
        if not wanted:
            raise ValueError(
                f"layers: expected at least one router layer, found dense layers {list(layers)}"
            )
    passes = [[i for i in g if i in wanted] for g in seen]
    passes = [p for p in passes if p]
    return passes if len(passes) > 1 else None


def _stack(parts: list[ExpertCounts]) -> ExpertCounts:
    """Counts of disjoint layer sets of the same tokens, stacked in layer order."""
    if len({p.tokens for p in parts}) != 1:
        raise RouteShapeError(  # pragma: no cover - the passes read the same rows
            f"layered counts: expected the same tokens in every pass, found "
            f"{[p.tokens for p in parts]}"
        )
    width = max(p.num_experts for p in parts)  # each num_experts wide when it is known
    counts = np.zeros((sum(len(p.layers) for p in parts), width), dtype=np.int64)
    layers: list[int] = []
    for p in sorted(parts, key=lambda p: p.layers[0]):
        counts[len(layers) : len(layers) + len(p.layers), : p.num_experts] = p.counts
        layers += p.layers
    return ExpertCounts(tuple(layers), counts, parts[0].tokens)


def layered_counts(
    files: Files,
    tokens: str,
    max_memory: int | None,
    validate: bool,
    *,
    column: str = "routes",
    layers: Sequence[int] | None = None,
) -> dict[int | None, ExpertCounts] | None:
    """Per-step `ExpertCounts` of routes column ``column`` of ``files``, a pass per stored
    layer group (``layers``: only those); None where `stored_groups` is or there are no rows."""
    passes = stored_groups(files, layers)
    if passes is None:
        return None
    threads = max(1, min(PASS_THREADS, cpus(), len(passes)))
    share = max(1, check_budget(max_memory) // threads)  # the passes at once share the budget
    columns = columns_for(tokens, column=column)

    def one_pass(group: list[int]) -> dict[int | None, ExpertCounts]:
        sums: dict[int | None, ExpertCounts] = {}
        for step, batch in iter_source(files, columns, None, share, validate, group):
            part = batch_counts(batch, tokens, column)  # global layer ids
            sums[step] = sums[step] + part if step in sums else part
        return sums

    per: dict[int | None, list[ExpertCounts]] = {}
    # A pool of its own: the passes wait on the kernels' shared pool, so they cannot run in it.
    with ThreadPoolExecutor(threads, thread_name_prefix="r3arrow-pass") as pool:
        for sums in pool.map(one_pass, passes):
            for step, total in sums.items():
                per.setdefault(step, []).append(total)
    return {step: _stack(parts) for step, parts in per.items()} or None


def count_parts(
    source: Any,
    tokens: Any,
    steps: Sequence[int] | None,
    max_memory: int | None,
    validate: bool,
    column: Any,
    layers: Any,
    by: Group = "step",
) -> Iterator[tuple[int | None, ExpertCounts]]:
    """(step or version, `ExpertCounts`) partials of a local ``expert_counts`` source (see
    there): by step a pass per stored layer group of a path in layer-group storage, else
    batch by batch."""
    column = check_column(column)
    wanted = check_layers(layers)
    if is_path(source):
        check_subset(tokens)
        source, steps = Files(rollout_files(source, steps=steps, require_routes=True)), None
        if by == "step":
            per = layered_counts(source, tokens, max_memory, validate, column=column, layers=wanted)
            if per is not None:
                return iter(per.items())
    if wanted is not None and is_table(source):
        source, wanted = projected(source, wanted), None
    return batch_parts(
        source,
        tokens,
        steps,
        lambda batch: batch_counts(batch, tokens, column),
        (),
        max_memory,
        validate,
        column=column,
        layers=wanted,
        by=by,
    )


def agreement_parts(
    a: Any,
    b: Any,
    spec: RouteSpec | None,
    tokens: Any,
    steps: Sequence[int] | None,
    max_memory: int | None = None,
    validate: bool = False,
    layers: list[int] | None = None,
    by: Group = "step",
) -> Iterator[tuple[int | None, RouteAgreement]]:
    """(step or version, `RouteAgreement`) partials of the local ``route_agreement`` inputs
    (see there).

    ``layers`` (checked global ids; ``b`` a column name only): a path reads only those
    layers, a table is projected in memory. ``by="policy_version"``: ``a`` a table or path
    and ``b`` a column name (else ``TypeError``).
    """
    tabular = is_table(a) or is_path(a)
    if by != "step" and not (isinstance(b, str) and tabular):
        raise TypeError(
            "by_version: expected a rollout table or path a and the name of a routes column b, "
            f"found {type(a).__name__} and {type(b).__name__}"
        )
    if layers is not None and not (isinstance(b, str) and tabular):
        raise TypeError("layers: applies to a table or path and the name of a routes column b")
    if layers is not None and is_table(a):
        a, layers = projected(a, layers), None
    if not tabular:
        yield None, _array_agreement(a, b, spec, tokens)
        return
    if isinstance(tokens, np.ndarray):
        raise TypeError(
            "tokens: a bool mask is for numpy inputs; tables and paths take a subset name"
        )
    if isinstance(b, str):
        other = b
        yield from batch_parts(
            a,
            tokens,
            steps,
            lambda batch: batch_agreement(batch, other, tokens),
            (b,),
            max_memory,
            validate,
            layers=layers,
            by=by,
        )
        return
    check_subset(tokens)
    if is_path(a) or steps is not None:
        raise TypeError(
            "route_agreement: with a path or steps=, b must name a routes column of the same files"
        )
    ta = cast(TableLike, a)
    sa = route_spec(ta) if spec is None else spec
    rows_a, _ = flat_routes(ta)
    if is_table(b):
        ids_a, ids_b = ta.column("trajectory_id"), b.column("trajectory_id")
        if b.num_rows != ta.num_rows or (
            ta.num_rows and not pc.all(pc.equal(ids_a, ids_b)).as_py()
        ):
            raise RouteShapeError(
                "expected two tables of the same trajectories in one order, found "
                f"{ta.num_rows} and {b.num_rows} rows with different trajectory ids"
            )
        rows_b = aligned_rows(ta, b.column("routes"), sa, "routes of b")
    else:
        rows_b = as_route_rows(b, sa, what="routes b")
    select, missing = delivered(ta, token_selection(ta, tokens))
    if is_table(b):  # rows b did not deliver either
        every = np.ones(rows_b.shape[0], dtype=bool)
        select, gone = delivered(b, every if select is None else select)
        missing += gone
    agreement = compare_routes(rows_a, rows_b, sa, select=select)
    yield None, dataclasses.replace(agreement, missing=missing)


def _array_agreement(a: Any, b: Any, spec: RouteSpec | None, tokens: Any) -> RouteAgreement:
    """`compare_routes` of two ``[T, L, K]`` arrays (``tokens``: "all" or a bool mask)."""
    if spec is None:
        arr = np.asarray(a)
        if arr.ndim != 3:
            raise RouteShapeError(f"routes a: expected [rows, L, K], found shape {list(arr.shape)}")
        spec = RouteSpec(num_layers=arr.shape[1], topk=arr.shape[2], num_experts=None)
    if not isinstance(tokens, np.ndarray) and tokens != "all":
        raise TypeError(f"tokens={tokens!r} needs a rollout table; numpy inputs take a bool mask")
    select = tokens if isinstance(tokens, np.ndarray) else None
    return compare_routes(a, b, spec, select=select)


# ================================================ encoded partials (executors)
def decode(kind: Kind, vec: Any) -> ExpertCounts | RouteAgreement:
    """The partial an int64 vector encodes (inverse of ``to_vector``)."""
    return _PART[kind].from_vector(vec)


def combine_vectors(kind: Kind, a: Any, b: Any) -> np.ndarray:
    """Sum of two encoded partials (decoded: headers differ, e.g. in width); empty = zero."""
    va, vb = np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)
    if va.size == 0:
        return vb
    if vb.size == 0:
        return va
    part: Any = _PART[kind]
    return cast(np.ndarray, (part.from_vector(va) + part.from_vector(vb)).to_vector())


def combiner(kind: Kind) -> Callable[[Any, Any], np.ndarray]:
    """A picklable ``combine_vectors`` for ``kind``."""
    return functools.partial(combine_vectors, kind)


class BlockPartials:
    """Picklable table → ``{step or None: encoded partial}`` of one statistic (an executor's
    block map): ``kind`` "counts" (`batch_counts` of ``column``) or "agreement"
    (`batch_agreement` against ``other``) over subset ``tokens``. The table needs the
    spec in its schema metadata; a ``step`` column groups the rows."""

    def __init__(
        self, kind: Kind, tokens: str, other: str | None, *, column: str = "routes"
    ) -> None:
        check_subset(tokens)
        if kind == "agreement" and other is None:
            raise TypeError("agreement partials: expected the name of a second routes column")
        self.kind = kind
        self.tokens = tokens
        self.other = other
        self.column = column

    def _extra(self) -> tuple[str, ...]:
        return () if self.other is None else (self.other,)

    def columns(self) -> list[str]:
        """The columns the statistic reads."""
        return columns_for(self.tokens, self._extra(), column=self.column)

    def _part(self, batch: TableLike) -> ExpertCounts | RouteAgreement:
        if self.kind == "counts":
            return batch_counts(batch, self.tokens, self.column)
        return batch_agreement(batch, cast(str, self.other), self.tokens)

    def __call__(self, table: pa.Table) -> dict[int | None, np.ndarray]:
        out: dict[int | None, np.ndarray] = {}
        parts: Iterator[tuple[int | None, Any]] = batch_parts(
            table, self.tokens, None, self._part, self._extra(), column=self.column
        )
        for step, part in parts:
            vec = part.to_vector()
            out[step] = combine_vectors(self.kind, out[step], vec) if step in out else vec
        return out


__all__ = [
    "PASS_THREADS",
    "BlockPartials",
    "Files",
    "Group",
    "Kind",
    "Source",
    "agreement_parts",
    "aligned_rows",
    "batch_agreement",
    "batch_counts",
    "batch_parts",
    "check_budget",
    "combine_vectors",
    "combiner",
    "count_parts",
    "decode",
    "is_path",
    "is_table",
    "iter_groups",
    "iter_source",
    "layered_counts",
    "prefetch",
    "projected",
    "stored_groups",
    "sum_by_step",
    "sum_parts",
]
