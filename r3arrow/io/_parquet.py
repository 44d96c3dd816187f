"""Parquet: rollout tables to files and ``step=N/`` roots, exact and atomic.

Routes are written in their storage form (`r3arrow.io._storage`) and restored on
read without copying; the spec travels in the file metadata. Files are written
with Parquet page checksums (CRC-32 per page) and a SHA-256 over the r3arrow
metadata (``r3arrow.meta_sha256``); readers verify both.

Every reader is a trust boundary (`r3arrow.io._verify`): it checks that a file
is an r3arrow rollout file, that all files of a root share one spec, and —
unless ``validate=False`` — what it returns (core columns and types, no nulls,
loss-mask lengths, routes ``<=`` tokens, the expert-id rules). Tables that pass
are marked validated (writing them again does not re-check them). Every error
is an `R3ArrowError` (mostly `SchemaError`) with ``path`` naming the file; no
Arrow or OS exception escapes a reader for a corrupt file.

A table without a ``routes`` column and without ``r3arrow.spec`` metadata is an
R3-off rollout table (rollouts recorded without routing replay): it is written
and read back as is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from itertools import groupby
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from r3arrow._checks import check_int
from r3arrow._typing import PathLike
from r3arrow._validated import is_validated, mark_validated
from r3arrow.errors import SchemaError
from r3arrow.io._layout import (
    STEP_PARTITIONING,
    atomic_path,
    check_steps,
    iter_rollout_files,
    list_steps,
    step_dir,
    step_files,
)
from r3arrow.io._portable import to_portable
from r3arrow.io._storage import from_storage, to_storage
from r3arrow.io._verify import (
    READ_ERRORS,
    check_rows,
    check_storage,
    check_table,
    file_spec,
    footer_spec,
    open_error,
    reading,
    sealed,
    unsealed,
)
from r3arrow.spec import SPEC_METADATA_KEY, RouteSpec

#: Parquet page checksums are verified on every read (files without them read unchecked).
_PARQUET_FORMAT = ds.ParquetFileFormat(
    default_fragment_scan_options=ds.ParquetFragmentScanOptions(page_checksum_verification=True)
)


# ---------------------------------------------------------------------- write
def _storage_form(table: pa.Table, portable: bool) -> pa.Table:
    """What Parquet stores: routes as storage (or portable) columns; R3-off tables as they are."""
    if SPEC_METADATA_KEY not in (table.schema.metadata or {}):
        return table  # R3 off: no routes to convert (check_table refused a routes column)
    return to_portable(table) if portable else to_storage(table)


def write_rollouts(
    table: pa.Table,
    path: PathLike,
    *,
    step: int | None = None,
    compression: str | None = "none",
    compression_level: int | None = None,
    row_group_rows: int | None = None,
    portable: bool = False,
) -> Path:
    """Write a rollout table to Parquet atomically; return the file written.

    The table is validated (the checks of the readers, `r3arrow.io._verify`)
    unless r3arrow built or validated this very table already. With ``step=N``
    (an int ``>= 0``), ``path`` is a root directory and the file goes to
    ``path/step=N/part-XXXXX.parquet`` (a new part each call). ``compression``
    is any Parquet codec ("none", "zstd", "lz4", "snappy"). ``portable=True``
    stores routes as plain nested integer lists (readable by pandas, Polars,
    DuckDB, datasets; larger and slower) instead of one binary value per token;
    r3arrow reads both. Every page carries a CRC-32 and the r3arrow metadata a
    SHA-256 (``r3arrow.meta_sha256``). A table without ``routes`` and without a
    spec (R3 off) is written as is. Raises the validation errors (`SchemaError`,
    `TerminalGapError`, ...) before touching the disk, ``TypeError`` /
    ``ValueError`` for a bad ``step``.
    """
    if not is_validated(table):
        meta = table.schema.metadata or {}
        spec = RouteSpec.from_schema(table.schema) if SPEC_METADATA_KEY in meta else None
        check_storage(table)
        check_table(table, spec)
    dest = Path(path) if step is None else step_dir(path, step)
    storage = _storage_form(table, portable)
    storage = storage.replace_schema_metadata(sealed(dict(storage.schema.metadata or {})))
    no_dict = [n for n in storage.schema.names if n != "routes"]
    with atomic_path(dest, new_part=step is not None) as paths:
        pq.write_table(
            storage,
            paths[0],
            compression=compression,  # type: ignore[arg-type]  # validated by Arrow
            compression_level=compression_level,
            use_dictionary=no_dict,  # type: ignore[arg-type]  # stubs: a list of columns is valid
            write_statistics=no_dict,
            row_group_size=row_group_rows,
            data_page_size=8 << 20,
            use_compliant_nested_type=False,  # keep list child names ("item"): exact round trip
            write_page_checksum=True,
        )
    return paths[-1]


# -------------------------------------------------------------------- checks
def check_rollout_schema(schema: pa.Schema, path: Path) -> RouteSpec:
    """The spec of a rollout file's Arrow schema; `SchemaError` (``path`` set) without one.

    The footer checks of `r3arrow.io._verify.file_spec` (version, metadata
    checksum, spec); an R3-off schema (no spec) is refused here.
    """
    spec = file_spec(schema, path)
    if spec is None:
        raise SchemaError(
            f"{path}: expected an r3arrow rollout file with routes (metadata key "
            f"{SPEC_METADATA_KEY.decode()!r}), found an R3-off file (columns {schema.names})",
            path=path,
        )
    return spec


def _restore(
    table: pa.Table,
    path: Path,
    spec: RouteSpec | None,
    validate: bool,
    columns: Sequence[str] | None,
) -> pa.Table:
    """Storage-form ``table`` of ``path`` restored, and (``validate``) checked and marked."""
    with reading(path):
        if validate:
            check_storage(table)
        out = unsealed(from_storage(table) if spec is not None else table)
        return check_table(out, spec, projected=columns is not None) if validate else out


def _open(path: Path) -> pq.ParquetFile:
    """A ParquetFile that verifies page checksums (the caller wraps errors with `reading`)."""
    return pq.ParquetFile(path, page_checksum_verification=True)


def _read_groups(pf: pq.ParquetFile, path: Path, columns: Sequence[str] | None) -> pa.Table:
    """All row groups of ``pf``, each read by its own reader and checked against its row count.

    One reader across row groups trusts each page header's value count, which
    the page checksum does not cover: a corrupt count shifts values from one
    row group into the next without an error. A reader per row group stops at
    the group's row count from the (checked) footer.
    """
    names = None if columns is None else list(columns)
    md = pf.metadata
    if md.num_row_groups == 0:
        return pf.read(columns=names)
    parts = []
    for g in range(md.num_row_groups):
        part = pf.read_row_group(g, columns=names)
        check_rows(part, md.row_group(g).num_rows, path, f"row group {g}")
        parts.append(part)
    return parts[0] if len(parts) == 1 else pa.concat_tables(parts)


def _footer(path: Path) -> tuple[pa.Schema, int, RouteSpec | None]:
    """(Arrow schema, row groups, spec) from a checked Parquet footer."""
    with reading(path), _open(path) as pf:
        return pf.schema_arrow, pf.metadata.num_row_groups, footer_spec(pf, path)


@dataclasses.dataclass(frozen=True)
class RolloutFile:
    """One rollout Parquet file: its ``path``, ``step`` (``None`` outside a root), row groups."""

    path: Path
    step: int | None
    num_row_groups: int


def _scan(
    pairs: Sequence[tuple[int | None, Path]],
) -> tuple[RouteSpec | None, pa.Schema, list[RolloutFile]]:
    spec: RouteSpec | None = None
    first: tuple[Path, pa.Schema] | None = None
    out = []
    for step, f in pairs:
        schema, row_groups, s = _footer(f)
        if first is None:
            spec, first = s, (f, schema)
        elif s != spec:
            want = spec if spec is not None else "no routes (R3 off)"
            found = s if s is not None else "no routes (R3 off)"
            raise SchemaError(
                f"{f}: expected the spec of {first[0]} ({want}), found {found}", path=f
            )
        out.append(RolloutFile(f, step, row_groups))
    assert first is not None  # callers pass at least one file
    return spec, first[1], out


def scan_rollout_files(
    path: PathLike, *, steps: Sequence[int] | None = None
) -> tuple[RouteSpec, list[RolloutFile]]:
    """The spec shared by every rollout file under ``path`` and the files (footers only).

    Files as `iter_rollout_files` finds them (same errors). Raises `SchemaError`
    (``path`` set) if a file is unreadable, is not a rollout file with routes,
    fails its metadata checks, or two files disagree.
    """
    spec, schema, files = _scan(list(iter_rollout_files(path, steps=steps)))
    if spec is None:
        check_rollout_schema(schema, files[0].path)
    assert spec is not None
    return spec, files


def read_row_group(
    path: PathLike,
    row_group: int,
    columns: Sequence[str] | None = None,
    step: int | None = None,
    *,
    validate: bool = True,
) -> pa.Table:
    """One row group of a rollout file, routes restored; with ``step``, an int64 ``step`` column.

    The table keeps the file's schema metadata (the spec) and is validated like
    `read_rollouts` (``validate=False`` skips the data checks). Raises
    `SchemaError` (``path`` set) for an unreadable, corrupt or foreign file, the
    validation errors (``path`` set) for bad data, and ``ValueError`` /
    ``TypeError`` for a ``row_group`` that is not an index of the file.
    """
    p = Path(path)
    group = check_int(row_group, "row_group", minimum=0)
    with reading(p), _open(p) as pf:
        schema = pf.schema_arrow
        spec = footer_spec(pf, p)
        groups = pf.metadata.num_row_groups
        if group < groups:
            table = pf.read_row_group(group, columns=None if columns is None else list(columns))
            check_rows(table, pf.metadata.row_group(group).num_rows, p, f"row group {group}")
    if group >= groups:  # argument misuse, raised outside the corrupt-file translation
        raise ValueError(f"row_group: expected an index below {groups} ({p}), found {group}")
    table = _restore(table.replace_schema_metadata(schema.metadata), p, spec, validate, columns)
    if step is not None:
        values = pa.array(np.full(table.num_rows, step, dtype=np.int64))
        table = table.append_column(pa.field("step", pa.int64()), values)
        if validate:
            mark_validated(table)
    return table


# ---------------------------------------------------------------------- read
def read_rollouts_dataset(path: PathLike) -> ds.Dataset:
    """A `pyarrow.dataset.Dataset` over a file or step directory (storage types, lazy, unchecked).

    A directory is read with hive partitioning (``step`` int64), its part files
    in numeric step order. Page checksums are verified when it is scanned; the
    rows are not validated (use `read_rollouts` for that).
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such rollout file or directory")
    with reading(p):
        if p.is_dir():
            return _dataset(p, [f for _, f in step_files(p)])
        return ds.dataset(p, format=_PARQUET_FORMAT)


def _dataset(base: Path, files: Sequence[Path]) -> ds.Dataset:
    return ds.dataset(
        [str(f) for f in files],
        format=_PARQUET_FORMAT,
        partition_base_dir=str(base),
        partitioning=STEP_PARTITIONING,
    )


def _read_files(
    base: Path,
    files: Sequence[Path],
    meta: Any,
    spec: RouteSpec | None,
    columns: Sequence[str] | None,
    steps: Sequence[int] | None,
    validate: bool,
) -> pa.Table:
    """Part files under ``base`` as one restored table with the ``step`` key column."""
    filt = ds.field("step").isin(list(steps)) if steps is not None else None
    try:
        table = _dataset(base, files).to_table(
            columns=list(columns) if columns is not None else None, filter=filt
        )
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise SchemaError(
            f"{base}: step files do not share one rollout schema/spec ({exc})", path=base
        ) from exc
    except READ_ERRORS as exc:  # a corrupt page (checksum) or unreadable file
        raise open_error(base, exc) from exc
    return _restore(table.replace_schema_metadata(meta), base, spec, validate, columns)


def _root_files(p: Path) -> tuple[pa.Schema, RouteSpec | None, list[RolloutFile]]:
    files = step_files(p)
    if not files:
        raise SchemaError(f"{p}: expected step=N/*.parquet rollout files, found none", path=p)
    spec, schema, scanned = _scan(files)
    return schema, spec, scanned


def read_rollouts(
    path: PathLike,
    *,
    columns: Sequence[str] | None = None,
    steps: Sequence[int] | None = None,
    validate: bool = True,
) -> pa.Table:
    """Read a rollout Parquet file or ``step=N`` directory; routes restored, spec kept.

    A directory reads in step order and adds an int64 ``step`` column (kept under
    ``columns`` only if listed); ``steps`` selects partitions (absent ones read
    as no rows). Every file must carry the same spec (or none: R3 off).

    The footer (version, metadata checksum, spec) and page checksums are always
    verified. The rows are validated — core columns and types, no nulls,
    loss-mask lengths, routes ``<=`` tokens, ids in range and distinct on router
    layers, the terminal-gap rule — unless ``validate=False`` (for a caller
    re-reading files it wrote itself in a hot loop); a validated table is
    marked so writing it again skips the checks. Files written before the
    checksums existed read without those checks.

    Raises `SchemaError` (``path`` set) on a corrupt or foreign file, the
    validation errors (``path`` set) on bad rows, ``FileNotFoundError`` if
    ``path`` does not exist, ``TypeError`` if ``steps`` holds a non-int.
    """
    wanted = check_steps(steps)
    p = Path(path)
    if p.is_dir():
        schema, spec, files = _root_files(p)
        return _read_files(
            p, [f.path for f in files], schema.metadata, spec, columns, wanted, validate
        )
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such rollout file or directory")
    with reading(p), _open(p) as pf:
        spec = footer_spec(pf, p)
        table = _read_groups(pf, p, columns)
        table = table.replace_schema_metadata(pf.schema_arrow.metadata)  # the copy checked
    return _restore(table, p, spec, validate, columns)


def _by_step(
    files: Sequence[RolloutFile],
    meta: Any,
    spec: RouteSpec | None,
    columns: Sequence[str] | None,
    validate: bool,
) -> Iterator[tuple[int | None, pa.Table]]:
    for step, group in groupby(files, key=lambda f: f.step):
        paths = [f.path for f in group]
        if step is None:
            for f in paths:
                yield None, read_rollouts(f, columns=columns, validate=validate)
            continue
        base = paths[0].parent.parent
        yield step, _read_files(base, paths, meta, spec, columns, [step], validate)


def iter_rollouts(
    path: PathLike,
    *,
    columns: Sequence[str] | None = None,
    steps: Sequence[int] | None = None,
    batch_rows: int | None = None,
    validate: bool = True,
) -> Iterator[tuple[int | None, pa.Table]]:
    """Yield ``(step, table)`` one step at a time (a file: ``(None, batch)`` per ``batch_rows``).

    A directory yields its steps in numeric order (``steps`` filters; absent
    ones are skipped), each table with the ``step`` column like `read_rollouts`;
    only one step is resident at a time. Each table is checked like
    `read_rollouts` (``validate=False`` skips the data checks). Same errors.
    """
    wanted = check_steps(steps)
    p = Path(path)
    if p.is_dir():
        schema, spec, files = _root_files(p)
        keep = [f for f in files if wanted is None or f.step in wanted]
        yield from _by_step(keep, schema.metadata, spec, columns, validate)
        return
    if batch_rows is None:
        yield None, read_rollouts(p, columns=columns, validate=validate)
        return
    with reading(p), _open(p) as pf:
        schema = pf.schema_arrow
        spec = footer_spec(pf, p)
        names = list(columns) if columns else None
        for g in range(pf.metadata.num_row_groups):  # one reader per group: see _read_groups
            seen = 0
            for batch in pf.iter_batches(batch_size=batch_rows, row_groups=[g], columns=names):
                seen += batch.num_rows
                t = pa.Table.from_batches([batch]).replace_schema_metadata(schema.metadata)
                yield None, _restore(t, p, spec, validate, columns)
            if seen != pf.metadata.row_group(g).num_rows:
                raise SchemaError(
                    f"{p}: expected {pf.metadata.row_group(g).num_rows} rows in row group {g} "
                    f"(footer), read {seen} (corrupt file)",
                    path=p,
                )


def iter_rollout_tables(
    path: PathLike,
    *,
    columns: Sequence[str] | None = None,
    steps: Sequence[int] | None = None,
    validate: bool = True,
) -> Iterator[tuple[int | None, pa.Table]]:
    """Yield ``(step, table)`` of restored rollout rows, one step (or file) at a time.

    The files are those of `iter_rollout_files` (a file, a root or one
    partition; every requested step must exist), all checked to share one spec
    before the first table is read. A step's table has the int64 ``step``
    column (when listed under ``columns`` or ``columns`` is ``None``); a single
    file yields ``(None, table)``. Tables are checked like `read_rollouts`
    (``validate=False`` skips the data checks). The reader `r3arrow.stats`
    builds on.
    """
    spec_files = list(iter_rollout_files(path, steps=steps))
    spec, schema, files = _scan(spec_files)
    yield from _by_step(files, schema.metadata, spec, columns, validate)


def scan_rollouts(path: PathLike, **kwargs: Any) -> Iterator[pa.Table]:
    """Tables from `iter_rollouts`, without the step key."""
    for _, table in iter_rollouts(path, **kwargs):
        yield table


__all__ = [
    "RolloutFile",
    "check_rollout_schema",
    "iter_rollout_tables",
    "iter_rollouts",
    "list_steps",
    "open_error",
    "read_rollouts",
    "read_rollouts_dataset",
    "read_row_group",
    "scan_rollout_files",
    "scan_rollouts",
    "write_rollouts",
]
