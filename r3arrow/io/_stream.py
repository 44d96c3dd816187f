"""Streaming rollout reads under a memory budget, and row groups sized for them.

Readers never materialise a step (``docs/storage.md``, "Streaming"). `iter_pieces`
reads the files of a root (or one file) row group by row group, in read order, and
yields ``(step, table)`` pieces: restored rollout rows of one step whose size stays
within a quarter of ``max_memory`` (the piece the caller holds, the next one being
read, the restore copy of a layer-group read and the validation temporaries all fit
in the budget). Consecutive small row groups of one step (across its part files)
are merged into one piece; a row group larger than the piece size is read in record
batches of proportionally fewer rows. Sizes come from the footer (a row group's
decoded bytes over all its columns: an upper bound for a column or layer
projection, so projected pieces hold fewer rows than they could, never more).
``max_memory=None`` lifts the bound (one piece per step, `read_rollouts`).

`row_group_bounds` is the writer's half: row groups cut by bytes (default
`DEFAULT_ROW_GROUP_BYTES` of decoded data each), so a streamed read of a file
written by r3arrow holds about one row group at a time whatever the step size.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from itertools import groupby, pairwise
from pathlib import Path
from typing import Any, cast

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from r3arrow._checks import check_int
from r3arrow._schema import list_lengths
from r3arrow._validated import mark_validated
from r3arrow.errors import SchemaError
from r3arrow.io._storage import read_leaves, restore
from r3arrow.io._verify import (
    check_rows,
    check_storage,
    check_table,
    footer_spec,
    reading,
    unsealed,
)
from r3arrow.spec import SPEC_METADATA_KEY, RouteSpec

#: Default budget of a streaming reader, in bytes: fits a laptop.
DEFAULT_MAX_MEMORY = 1 << 30
#: Default decoded bytes per row group written (64 MiB: 16 pieces per default budget).
DEFAULT_ROW_GROUP_BYTES = 64 << 20
#: A piece is at most this fraction of ``max_memory`` (see the module docstring).
PIECE_FRACTION = 4
#: Read buffer for row groups split into batches: pages stream instead of whole chunks.
_BUFFER = 4 << 20


def check_budget(max_memory: Any) -> int | None:
    """``max_memory`` as a positive int of bytes, or ``None`` (unbounded)."""
    if max_memory is None:
        return None
    return check_int(max_memory, "max_memory", minimum=1)


def open_parquet(
    path: Path, *, buffered: bool = False, metadata: pq.FileMetaData | None = None
) -> pq.ParquetFile:
    """A ParquetFile verifying page checksums; ``buffered`` streams pages of a column chunk.

    ``metadata``: the file's footer, already read and checked (it is not read again).
    """
    return pq.ParquetFile(
        path,
        page_checksum_verification=True,
        buffer_size=_BUFFER if buffered else 0,
        metadata=metadata,
    )


# -------------------------------------------------------------------- write
def row_group_bounds(table: pa.Table, target: int) -> list[tuple[int, int]]:
    """``(start, stop)`` row ranges of about ``target`` decoded bytes each (>= 1 row each).

    A row's bytes are its routes (route rows × bytes per row, every routes-typed
    column) plus an even share of the other columns; a group closes at the first
    row starting past a multiple of ``target``, so a group exceeds ``target`` by at
    most one row. An empty table has no ranges.
    """
    n = table.num_rows
    if n == 0:
        return []
    meta = table.schema.metadata or {}
    route_bytes = np.zeros(n, dtype=np.float64)
    other = float(table.nbytes)
    if SPEC_METADATA_KEY in meta:
        spec = RouteSpec.from_schema(table.schema)
        for field in table.schema:
            if field.type == spec.routes_type:
                per = list_lengths(table.column(field.name)).astype(np.float64) * spec.row_nbytes
                route_bytes += per
                other -= float(per.sum())
    per_row = route_bytes + max(other, 0.0) / n
    start = np.cumsum(per_row) - per_row
    bucket = (start // max(target, 1)).astype(np.int64)
    cuts = np.flatnonzero(np.diff(bucket)) + 1
    edges = [0, *cuts.tolist(), n]
    return [(int(a), int(b)) for a, b in pairwise(edges)]


# --------------------------------------------------------------------- read
#: Placeholder column of a unit read for ``step`` alone (dropped by `shape`).
ROWS_COLUMN = "__r3arrow_rows"


def _rows_only(rows: int, schema: pa.Schema) -> pa.Table:
    """``rows`` rows of one all-null placeholder column, with the file's metadata.

    Arrow drops the row count of a table without columns on ``replace_schema_metadata``
    and ``concat_tables``, so a read of no file column (``columns=["step"]``) carries
    its rows in this column; `shape` removes it.
    """
    meta = cast("Any", schema.metadata)
    return pa.table({ROWS_COLUMN: pa.nulls(rows)}).replace_schema_metadata(meta)


def _file_units(
    path: Path,
    columns: Sequence[str] | None,
    layers: Sequence[int] | None,
    target: int | None,
    batch_rows: int | None,
    footer: pq.FileMetaData | None = None,
    row_groups: Sequence[int] | None = None,
) -> Iterator[tuple[pa.Table, int]]:
    """(storage-form table, footer bytes) of a file's row groups, split to fit ``target``.

    ``footer``: the file's footer, already checked by `r3arrow.io._verify.footer_spec`
    (else it is read and checked here). Each row group is held to the footer's row
    count (see `r3arrow.io._verify.check_rows`). ``row_groups``: only those (valid
    indices, in that order). Errors carry ``path``.
    """
    with reading(path), open_parquet(path, buffered=target is not None, metadata=footer) as pf:
        schema = pf.schema_arrow
        if footer is None:
            footer_spec(pf, path)
        leaves = read_leaves(schema, columns, layers)
        md = pf.metadata
        for g in range(md.num_row_groups) if row_groups is None else row_groups:
            rg = md.row_group(g)
            rows = rg.num_rows
            # The row group's decoded size over all columns: an upper bound of what a column or
            # layer projection reads. Column-chunk metadata is not consulted: Arrow aborts the
            # process (no exception) on some corrupt column-chunk footers.
            nbytes = rg.total_byte_size
            fits = target is None or nbytes <= target
            if leaves is not None and not leaves:  # only ``step``: the rows, no file column
                yield _rows_only(rows, schema), 0
                continue
            if fits and (batch_rows is None or rows <= batch_rows):
                part = pf.read_row_group(g, columns=leaves)
                check_rows(part, rows, path, f"row group {g}")
                yield part.replace_schema_metadata(schema.metadata), nbytes
                continue
            size = rows if fits or target is None else max(1, rows * target // max(nbytes, 1))
            size = min(size, batch_rows) if batch_rows is not None else size
            seen = 0
            for batch in pf.iter_batches(batch_size=size, row_groups=[g], columns=leaves):
                seen += batch.num_rows
                part = pa.Table.from_batches([batch]).replace_schema_metadata(schema.metadata)
                yield part, nbytes * batch.num_rows // max(rows, 1)
            if seen != rows:
                raise SchemaError(
                    f"{path}: expected {rows} rows in row group {g} (footer), read {seen} "
                    f"(corrupt file)",
                    path=path,
                )


def empty_table(
    path: Path, columns: Sequence[str] | None, layers: Sequence[int] | None
) -> pa.Table:
    """No rows, with the restored schema of ``path`` under ``columns`` / ``layers``."""
    with reading(path), open_parquet(path) as pf:
        schema = pf.schema_arrow
        footer_spec(pf, path)
        table = schema.empty_table()
        if columns is not None:
            table = table.select([c for c in dict.fromkeys(columns) if c in schema.names])
        return restore(table, layers)


def restore_unit(
    table: pa.Table,
    path: Path,
    layers: Sequence[int] | None,
    check: bool,
    validate: bool,
    projected: bool,
) -> pa.Table:
    """A storage-form unit of ``path`` restored; ``check``: nulls checked first; ``validate``."""
    with reading(path):
        if check:
            check_storage(table)
        out = unsealed(restore(table, layers))
        if not validate:
            return out
        meta = out.schema.metadata or {}
        spec = RouteSpec.from_schema(out.schema) if SPEC_METADATA_KEY in meta else None
        return check_table(out, spec, projected=projected)


def shape(
    table: pa.Table, step: int | None, columns: Sequence[str] | None, validated: bool
) -> pa.Table:
    """``table`` with the int64 ``step`` column (a root's rows) in the order ``columns`` ask."""
    want_step = step is not None and (columns is None or "step" in columns)
    if want_step and "step" not in table.schema.names:
        values = pa.array(np.full(table.num_rows, step, dtype=np.int64))
        table = table.append_column(pa.field("step", pa.int64()), values)
    if columns is not None or ROWS_COLUMN in table.schema.names:
        names = table.schema.names if columns is None else columns
        order = [c for c in dict.fromkeys(names) if c in table.schema.names and c != ROWS_COLUMN]
        if order != table.schema.names:
            table = table.select(order)
    return mark_validated(table) if validated else table


def concat(parts: list[pa.Table], where: Path) -> pa.Table:
    """Restored pieces as one table (chunks kept), the first one's metadata; `SchemaError`."""
    meta = parts[0].schema.metadata
    try:
        return pa.concat_tables([p.replace_schema_metadata(meta) for p in parts])
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise SchemaError(
            f"{where}: step files do not share one rollout schema/spec ({exc})", path=where
        ) from exc


def iter_pieces(
    files: Sequence[tuple[int | None, Path]],
    *,
    columns: Sequence[str] | None,
    layers: Sequence[int] | None,
    max_memory: int | None,
    batch_rows: int | None,
    validate: bool,
    check: bool | None = None,
    footers: Mapping[Path, pq.FileMetaData] | None = None,
    row_groups: Sequence[int] | None = None,
) -> Iterator[pa.Table]:
    """Table pieces of ``(step, file)`` pairs in order, each within ``max_memory / 4`` bytes.

    Pieces are restored (and projected to ``layers``), checked like `read_rollouts`
    when ``validate`` (``check``, default ``validate``: the storage null checks),
    carry a ``step`` column for a root's files and never span two steps. A step (or
    file) without rows yields one empty table. ``footers``: checked footers by path
    (each file is then opened once, its footer not parsed again); ``row_groups``: of a
    single file, only those (`_file_units`). See the module docstring.
    """
    budget = check_budget(max_memory)
    target = None if budget is None else max(1, budget // PIECE_FRACTION)
    rows_cap = None if batch_rows is None else check_int(batch_rows, "batch_rows", minimum=1)
    projected = columns is not None
    storage_check = validate if check is None else check
    for step, group in groupby(files, key=lambda f: f[0]):
        paths = [f for _, f in group]
        pending: list[pa.Table] = []
        held = rows = 0
        emitted = False
        for path in paths:
            footer = None if footers is None else footers.get(path)
            units = _file_units(path, columns, layers, target, rows_cap, footer, row_groups)
            for unit, nbytes in units:
                if pending and (
                    (target is not None and held + nbytes > target)
                    or (rows_cap is not None and rows + unit.num_rows > rows_cap)
                ):
                    yield shape(concat(pending, path), step, columns, validate)
                    emitted = True
                    pending, held, rows = [], 0, 0
                pending.append(restore_unit(unit, path, layers, storage_check, validate, projected))
                held += nbytes
                rows += unit.num_rows
        if pending:
            yield shape(concat(pending, paths[-1]), step, columns, validate)
        elif not emitted:
            empty = restore_unit(
                empty_table(paths[0], columns, layers), paths[0], None, False, validate, projected
            )
            yield shape(empty, step, columns, validate)


__all__ = [
    "DEFAULT_MAX_MEMORY",
    "DEFAULT_ROW_GROUP_BYTES",
    "PIECE_FRACTION",
    "check_budget",
    "concat",
    "empty_table",
    "iter_pieces",
    "open_parquet",
    "restore_unit",
    "row_group_bounds",
    "shape",
]
