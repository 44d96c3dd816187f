"""Sources → partials: rollout tables, files and step roots as exact per-step partials.

Every statistic is a sum of *partials that add up exactly* (`ExpertCounts`,
`RouteAgreement`). A table is processed one record batch at a time (grouped by
its ``step`` column when it has one; a multi-chunk routes column is never
combined); a path is streamed by row group under a memory budget
(`r3arrow.stats._stream`: only the needed columns, the next piece read while
the current one is counted), so no step is ever resident. An executor
(`r3arrow.stats._api.Executor`) runs the same `BlockPartials` on every block and sums
the encoded vectors with `combine_vectors`, so all paths give identical integers.
"""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Literal, TypeAlias, TypeVar, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from r3arrow._checks import check_int
from r3arrow._routes import as_route_rows
from r3arrow._schema import list_lengths
from r3arrow._typing import ArrowArray, PathLike, TableLike
from r3arrow.errors import RouteShapeError, SchemaError
from r3arrow.io import project_layers, route_rows
from r3arrow.spec import RouteSpec
from r3arrow.stats._agreement import RouteAgreement, compare_routes
from r3arrow.stats._counts import ExpertCounts, count_routes
from r3arrow.stats._selection import check_subset, columns_for, token_selection, use_column
from r3arrow.stats._stream import check_budget, iter_pieces
from r3arrow.table import flat_routes, route_layers, route_spec

Source: TypeAlias = "TableLike | PathLike"
Kind = Literal["counts", "agreement"]
Part = TypeVar("Part", ExpertCounts, RouteAgreement)


# ================================================================== sources
def is_path(source: object) -> bool:
    """True for a ``str`` or ``os.PathLike`` (a rollout file or root)."""
    return isinstance(source, str | os.PathLike)


def _batches(table: TableLike) -> Iterator[TableLike]:
    if isinstance(table, pa.RecordBatch):
        yield table
        return
    batches = table.to_batches()
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


def iter_source(
    source: Source,
    columns: list[str],
    steps: Sequence[int] | None,
    max_memory: int | None = None,
    validate: bool = False,
    layers: Sequence[int] | None = None,
) -> Iterator[tuple[int | None, TableLike]]:
    """(step, batch) pairs of a table, record batch, rollout file or step-partitioned root.

    A path is streamed with only ``columns``, in pieces bounded by ``max_memory``
    bytes (`r3arrow.stats._stream.iter_pieces`; ``validate``: its full row
    checks; ``layers``: a layer projection, layer projection); a table must have the
    columns (and ``layers`` must be None).
    Raises ``TypeError`` for another kind of source, `SchemaError` for missing
    columns or steps (see `r3arrow.io.rollout_files`).
    """
    budget = check_budget(max_memory)
    if is_path(source):
        path = cast(PathLike, source)
        pieces = iter_pieces(path, columns, steps, budget, validate=validate, layers=layers)
        for step, piece in pieces:
            # A piece may span row groups (chunks): count batch by batch, never combined.
            batches = list(_batches(piece))[::-1]
            del piece
            while batches:
                yield step, batches.pop()
        return
    if not isinstance(source, pa.Table | pa.RecordBatch):
        raise TypeError(
            f"expected a rollout table, record batch or Parquet path, found {type(source).__name__}"
        )
    if layers is not None:
        raise TypeError("layers: applies to a Parquet path source, found an in-memory table")
    missing = [c for c in columns if c not in source.schema.names]
    if missing:
        raise SchemaError(f"expected columns {missing}, found {source.schema.names}")
    yield from _table_steps(source, steps)


# ============================================================ batch partials
def batch_counts(batch: TableLike, tokens: str = "all", column: str = "routes") -> ExpertCounts:
    """`ExpertCounts` of routes column ``column`` of one rollout table or record batch.

    Routes restored, spec in the metadata; the layers are global ids, also for a
    layer-projected batch (layer projection, mapped through `r3arrow.table.route_layers`).
    """
    batch = use_column(batch, column)
    spec = route_spec(batch)
    rows, _ = flat_routes(batch)
    local = count_routes(rows, spec, select=token_selection(batch, tokens))
    ids = route_layers(batch)
    if ids == tuple(range(spec.num_layers)):
        return local
    return ExpertCounts(tuple(ids[i] for i in local.layers), local.counts, local.tokens)


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
    """`RouteAgreement` of ``routes`` vs the routes column ``other`` of one table or batch."""
    spec = route_spec(batch)
    rows_a, _ = flat_routes(batch)
    if other not in batch.schema.names:
        raise SchemaError(f"expected a second routes column {other!r}, found {batch.schema.names}")
    rows_b = aligned_rows(batch, batch.column(other), spec, other)
    local = compare_routes(rows_a, rows_b, spec, select=token_selection(batch, tokens))
    ids = route_layers(batch)  # a layer-projected batch (layer projection): global ids
    if ids == tuple(range(spec.num_layers)):
        return local
    return dataclasses.replace(local, layers=tuple(ids[i] for i in local.layers))


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
) -> Iterator[tuple[int | None, Part]]:
    """(step, partial) per batch of ``source``, reading only the columns the statistic needs.

    ``max_memory``, ``validate``, ``layers``: how a path is streamed (`iter_source`);
    ``column``: the routes column read (instead of ``routes``).
    """
    check_subset(tokens)
    columns = columns_for(tokens, extra, column=column)
    for step, batch in iter_source(source, columns, steps, max_memory, validate, layers):
        part = part_of(batch)
        del batch  # not resident while the next step is read
        yield step, part


def _source_spec(source: object) -> RouteSpec | None:
    if isinstance(source, pa.Table | pa.RecordBatch):
        return route_spec(source)
    return None


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
    s = spec or _source_spec(source)
    if s is None:
        raise SchemaError(f"{source}: expected rollout data, found none")
    return empty(s)


_NO_STEPS = (
    "by step: expected a step-partitioned directory or a table with a 'step' column, found neither"
)


def sum_by_step(parts: Iterator[tuple[int | None, Part]]) -> dict[int, Part]:
    """Partials summed per step, ascending; raises `SchemaError` if the source has no steps."""
    out: dict[int, Part] = {}
    for step, part in parts:
        if step is None:
            raise SchemaError(_NO_STEPS)
        out[step] = out[step] + part if step in out else part
    return dict(sorted(out.items()))


def _same_ids(a: TableLike, b: TableLike) -> bool:
    if a.num_rows == 0:
        return True
    return bool(pc.all(pc.equal(a.column("trajectory_id"), b.column("trajectory_id"))).as_py())


def agreement_parts(
    a: Any,
    b: Any,
    spec: RouteSpec | None,
    tokens: Any,
    steps: Sequence[int] | None,
    max_memory: int | None = None,
    validate: bool = False,
    layers: list[int] | None = None,
) -> Iterator[tuple[int | None, RouteAgreement]]:
    """(step, `RouteAgreement`) partials of the local ``route_agreement`` inputs (see there).

    ``layers`` (checked global ids; with ``b`` a column name only): a path reads only
    those layers, a table is projected in memory (`r3arrow.io.project_layers`).
    """
    if layers is not None and not (
        isinstance(b, str) and (isinstance(a, pa.Table | pa.RecordBatch) or is_path(a))
    ):
        raise TypeError("layers: applies to a table or path and the name of a routes column b")
    if layers is not None and isinstance(a, pa.Table | pa.RecordBatch):
        a, layers = (
            project_layers(a if isinstance(a, pa.Table) else pa.Table.from_batches([a]), layers),
            None,
        )
    if isinstance(a, pa.Table | pa.RecordBatch) or is_path(a):
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
            )
            return
        check_subset(tokens)
        if is_path(a) or steps is not None:
            raise TypeError(
                "route_agreement: with a path or steps=, b must name a routes column "
                "of the same files"
            )
        ta = cast(TableLike, a)
        sa = route_spec(ta) if spec is None else spec
        rows_a, _ = flat_routes(ta)
        if isinstance(b, pa.Table | pa.RecordBatch):
            if b.num_rows != ta.num_rows or not _same_ids(ta, b):
                raise RouteShapeError(
                    "expected two tables of the same trajectories in one order, found "
                    f"{ta.num_rows} and {b.num_rows} rows with different trajectory ids"
                )
            rows_b = aligned_rows(ta, b.column("routes"), sa, "routes of b")
        else:
            rows_b = as_route_rows(b, sa, what="routes b")
        yield None, compare_routes(rows_a, rows_b, sa, select=token_selection(ta, tokens))
        return
    if spec is None:
        arr = np.asarray(a)
        if arr.ndim != 3:
            raise RouteShapeError(f"routes a: expected [rows, L, K], found shape {list(arr.shape)}")
        spec = RouteSpec(num_layers=arr.shape[1], topk=arr.shape[2], num_experts=None)
    select = None
    if isinstance(tokens, np.ndarray):
        select = tokens
    elif tokens != "all":
        raise TypeError(f"tokens={tokens!r} needs a rollout table; numpy inputs take a bool mask")
    yield None, compare_routes(a, b, spec, select=select)


# ================================================ encoded partials (executors)
def decode(kind: Kind, vec: Any) -> ExpertCounts | RouteAgreement:
    """The partial an int64 vector encodes (inverse of ``to_vector``)."""
    if kind == "counts":
        return ExpertCounts.from_vector(vec)
    return RouteAgreement.from_vector(vec)


def combine_vectors(kind: Kind, a: Any, b: Any) -> np.ndarray:
    """Sum of two encoded partials (decoded: headers differ, e.g. in width); empty = zero."""
    va, vb = np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)
    if va.size == 0:
        return vb
    if vb.size == 0:
        return va
    if kind == "counts":
        return (ExpertCounts.from_vector(va) + ExpertCounts.from_vector(vb)).to_vector()
    return (RouteAgreement.from_vector(va) + RouteAgreement.from_vector(vb)).to_vector()


def combiner(kind: Kind) -> Callable[[Any, Any], np.ndarray]:
    """A picklable ``combine_vectors`` for ``kind``."""
    return functools.partial(combine_vectors, kind)


class BlockPartials:
    """Table → ``{step or None: encoded partial}`` of one statistic (an executor's block map).

    Picklable. ``kind`` "counts" (`batch_counts` of routes column ``column``) or "agreement"
    (`batch_agreement` against column ``other``); ``tokens`` the subset. The table
    needs the spec in its schema metadata; a ``step`` column groups the rows.
    """

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

    def columns(self) -> list[str]:
        """The columns the statistic reads."""
        extra = () if self.other is None else (self.other,)
        return columns_for(self.tokens, extra, column=self.column)

    def __call__(self, table: pa.Table) -> dict[int | None, np.ndarray]:
        out: dict[int | None, np.ndarray] = {}
        parts: Iterator[tuple[int | None, ExpertCounts | RouteAgreement]]
        if self.kind == "counts":
            tokens, column = self.tokens, self.column
            parts = batch_parts(
                table, tokens, None, lambda b: batch_counts(b, tokens, column), column=column
            )
        else:
            other = cast(str, self.other)
            parts = agreement_parts(table, other, None, self.tokens, None)
        for step, part in parts:
            vec = part.to_vector()
            out[step] = combine_vectors(self.kind, out[step], vec) if step in out else vec
        return out


__all__ = [
    "BlockPartials",
    "Kind",
    "Source",
    "agreement_parts",
    "aligned_rows",
    "batch_agreement",
    "batch_counts",
    "batch_parts",
    "combine_vectors",
    "combiner",
    "decode",
    "is_path",
    "iter_source",
    "sum_by_step",
    "sum_parts",
]
