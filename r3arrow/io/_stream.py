"""Streaming reads under a memory budget and row groups sized for them (``docs/storage.md``,
"Streaming")."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Sequence
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
    check_digests,
    check_rows,
    check_storage,
    check_table,
    reading,
    row_digests,
    table_spec,
    unsealed,
)

#: Default budget of a streaming reader, in bytes: fits a laptop.
DEFAULT_MAX_MEMORY = 1 << 30
#: Default decoded bytes per row group written (64 MiB: 16 pieces per default budget).
DEFAULT_ROW_GROUP_BYTES = 64 << 20
#: A piece is at most this fraction of ``max_memory``: the piece held, the next one read,
#: the restore copy and the validation temporaries all fit in the budget.
PIECE_FRACTION = 4
#: Data page size of the writer: a row group split into batches streams page by page, so a
#: reader holds about one page per column chunk read beside the batch.
PAGE_BYTES = 64 << 10
#: Read buffer per column chunk of a row group split into batches (neither whole chunks
#: pre-buffered nor read unbuffered, which both hold the whole row group).
_BUFFER = 64 << 10
#: Placeholder column of a unit read for ``step`` alone (dropped by `shape`).
ROWS_COLUMN = "__r3arrow_rows"

#: (device, inode, size, mtime in ns) of an open file: what its footer was read from.
Identity = tuple[int, int, int, int]
#: What the readers need of a checked file: (step, path, footer, identity).
FileRef = tuple[int | None, Path, pq.FileMetaData, Identity]


@contextlib.contextmanager
def open_file(path: Path, identity: Identity | None = None) -> Iterator[tuple[Any, Identity]]:
    """``path`` opened for reading, with its `Identity`; ``identity``: that of the file whose
    footer was read, else `SchemaError` (replaced or rewritten since: never read under a
    footer that does not describe it)."""
    with pa.OSFile(str(path), "r") as fh:
        st = os.fstat(fh.fileno())
        found = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        if identity is not None and found != identity:
            raise SchemaError(
                f"{path}: expected the file whose footer was read (device, inode, size, "
                f"mtime {identity}), found another ({found}): replaced or rewritten since; "
                f"read it again",
                path=path,
            )
        yield fh, found


def open_parquet(
    source: Any,
    metadata: pq.FileMetaData | None = None,
    *,
    streaming: bool = False,
    verify: bool = True,
) -> pq.ParquetFile:
    """A ParquetFile of an open file, verifying page checksums unless ``verify=False`` (the
    caller checks the decoded columns' digests instead); ``metadata``: the footer, already
    read and checked from it; ``streaming``: pages read as batches need them."""
    return pq.ParquetFile(
        source,
        page_checksum_verification=verify,
        buffer_size=_BUFFER if streaming else 0,
        pre_buffer=not streaming,
        metadata=metadata,
    )


def row_group_bounds(table: pa.Table, target: int) -> list[tuple[int, int]]:
    """``(start, stop)`` row ranges of about ``target`` decoded bytes (>= 1 row) each: a row's
    route rows plus an even share of the other columns.
    """
    n = table.num_rows
    if n == 0:
        return []
    route_bytes = np.zeros(n, dtype=np.float64)
    other = float(table.nbytes)
    if (spec := table_spec(table)) is not None:
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


def advise_random(fh: Any) -> None:
    """Tell the kernel an open file is read at random (no read-ahead past what is asked):
    a projected read skips the column chunks between those it reads. A no-op where the
    platform lacks ``posix_fadvise`` (macOS, Windows)."""
    if hasattr(os, "posix_fadvise"):
        with contextlib.suppress(OSError):  # advice only: a file system may not take it
            os.posix_fadvise(fh.fileno(), 0, 0, os.POSIX_FADV_RANDOM)


def _file_units(
    file: FileRef,
    columns: Sequence[str] | None,
    layers: Sequence[int] | None,
    target: int | None,
    batch_rows: int | None,
    row_groups: Sequence[int] | None,
) -> Iterator[tuple[pa.Table, int]]:
    """(storage-form table, footer bytes) of a file's row groups, split to fit ``target``
    (streamed page by page), each held to the checked footer's row count. A row group read
    whole is checked against the file's digests (`row_digests`); page checksums are
    verified instead where a read column has none (older files, columns with nulls) and
    for row groups streamed page by page (their batches are used before the group ends)."""
    _, path, footer, identity = file
    with (
        reading(path),
        open_file(path, identity) as (fh, _),
        open_parquet(fh, footer, streaming=True) as streamed,
    ):
        schema = streamed.schema_arrow
        leaves = read_leaves(schema, columns, layers)
        md = streamed.metadata
        record = row_digests(schema, md.num_row_groups)
        read = schema.names if columns is None else [c for c in columns if c in schema.names]
        digested = record is not None and set(read) <= record[0]
        if leaves is not None:
            advise_random(fh)
        with open_parquet(fh, footer, verify=not digested) as pf:
            yield from _group_units(
                pf, streamed, leaves, read, target, batch_rows, row_groups, record
            )


def _group_units(
    pf: pq.ParquetFile,
    streamed: pq.ParquetFile,
    leaves: list[str] | None,
    read: list[str],
    target: int | None,
    batch_rows: int | None,
    row_groups: Sequence[int] | None,
    record: tuple[frozenset[str], list[dict[str, str]]] | None,
) -> Iterator[tuple[pa.Table, int]]:
    """`_file_units` of one open file: the ``leaves`` of the columns ``read``."""

    def check_read(table: pa.Table | pa.RecordBatch, g: int) -> None:
        # pyarrow skips a column path the file lacks: a footer whose names were changed
        if missing := [c for c in read if c not in table.schema.names]:
            raise SchemaError(
                f"row group {g}: expected columns {missing} in the file's column chunks, "
                f"found {table.schema.names} (corrupt footer)"
            )

    schema = pf.schema_arrow
    md = pf.metadata
    for g in range(md.num_row_groups) if row_groups is None else row_groups:
        rg = md.row_group(g)
        rows = rg.num_rows
        # Decoded size over all columns (an upper bound for a projection). Column-chunk
        # metadata is not consulted: Arrow aborts the process on some corrupt ones.
        nbytes = rg.total_byte_size
        fits = target is None or nbytes <= target
        if leaves is not None and not leaves:  # only ``step``: the rows, no file column
            # Arrow drops the row count of a table without columns: a placeholder keeps it.
            rows_only = pa.table({ROWS_COLUMN: pa.nulls(rows)})
            yield rows_only.replace_schema_metadata(cast("Any", schema.metadata)), 0
            continue
        if fits and (record is not None or batch_rows is None or rows <= batch_rows):
            part = pf.read_row_group(g, columns=leaves)
            check_rows(part.num_rows, rows, f"row group {g}")
            check_read(part, g)
            if record is not None:  # verified whole, before any of its rows is used
                check_digests(part, record[0], record[1][g], f"row group {g}")
            part = part.replace_schema_metadata(schema.metadata)
            if batch_rows is None or rows <= batch_rows:
                yield part, nbytes
                continue
            for a in range(0, rows, batch_rows):  # zero-copy slices of the checked group
                size = min(batch_rows, rows - a)
                yield part.slice(a, size), nbytes * size // rows
            continue
        size = rows if fits or target is None else max(1, rows * target // max(nbytes, 1))
        size = min(size, batch_rows) if batch_rows is not None else size
        seen = 0
        for batch in streamed.iter_batches(batch_size=size, row_groups=[g], columns=leaves):
            seen += batch.num_rows
            check_read(batch, g)
            part = pa.Table.from_batches([batch]).replace_schema_metadata(schema.metadata)
            yield part, nbytes * batch.num_rows // max(rows, 1)
        check_rows(seen, rows, f"row group {g}")


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
        return check_table(out, table_spec(out), projected=projected) if validate else out


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


def empty_piece(
    file: FileRef, columns: Sequence[str] | None, layers: Sequence[int] | None, validate: bool
) -> pa.Table:
    """No rows of ``file``, its schema under ``columns`` / ``layers``."""
    step, path, footer, _ = file
    with reading(path):
        schema = footer.schema.to_arrow_schema()
        table = schema.empty_table()
        if columns is not None:
            table = table.select([c for c in dict.fromkeys(columns) if c in schema.names])
        table = restore(table, layers)
    table = restore_unit(table, path, None, False, validate, columns is not None)
    return shape(table, step, columns, validate)


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
    files: Sequence[FileRef],
    *,
    columns: Sequence[str] | None,
    layers: Sequence[int] | None,
    max_memory: int | None,
    batch_rows: int | None,
    validate: bool,
    check: bool | None = None,
    row_groups: Sequence[int] | None = None,
) -> Iterator[pa.Table]:
    """The pieces `iter_rollouts` yields for ``files`` (``max_memory`` and ``batch_rows``
    checked now); ``check`` (default ``validate``): the storage null checks."""
    budget = None if max_memory is None else check_int(max_memory, "max_memory", minimum=1)
    target = None if budget is None else max(1, budget // PIECE_FRACTION)
    rows_cap = None if batch_rows is None else check_int(batch_rows, "batch_rows", minimum=1)
    storage_check = validate if check is None else check
    return _pieces(files, columns, layers, target, rows_cap, validate, storage_check, row_groups)


def _pieces(
    files: Sequence[FileRef],
    columns: Sequence[str] | None,
    layers: Sequence[int] | None,
    target: int | None,
    rows_cap: int | None,
    validate: bool,
    storage_check: bool,
    row_groups: Sequence[int] | None,
) -> Iterator[pa.Table]:
    projected = columns is not None
    for step, group in groupby(files, key=lambda f: f[0]):
        step_files = list(group)
        pending: list[pa.Table] = []
        held = rows = 0
        emitted = False
        for file in step_files:
            path = file[1]
            units = _file_units(file, columns, layers, target, rows_cap, row_groups)
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
            yield shape(concat(pending, step_files[-1][1]), step, columns, validate)
        elif not emitted:
            yield empty_piece(step_files[0], columns, layers, validate)
