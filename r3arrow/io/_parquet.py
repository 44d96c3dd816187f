"""Parquet: rollout tables to files and ``step=N/`` roots, exact and atomic.

Routes are written in their storage form (`r3arrow.io._storage`) and restored on
read without copying; the spec travels in the file metadata. Every reader checks
that a file is an r3arrow rollout file and that all files of a root share one
spec, and raises `SchemaError` with the offending ``path`` otherwise.
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

from r3arrow._typing import PathLike
from r3arrow._validated import is_validated
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
from r3arrow.io._storage import from_storage, to_storage
from r3arrow.spec import SPEC_METADATA_KEY, RouteSpec
from r3arrow.table import validate_rollouts

_READ_ERRORS = (pa.ArrowInvalid, OSError)


# ---------------------------------------------------------------------- write
def write_rollouts(
    table: pa.Table,
    path: PathLike,
    *,
    step: int | None = None,
    compression: str | None = "none",
    compression_level: int | None = None,
    row_group_rows: int | None = None,
) -> Path:
    """Write a rollout table to Parquet atomically; return the file written.

    The table is validated (`validate_rollouts`) unless r3arrow built or
    validated this very table already. With ``step=N`` (an int ``>= 0``),
    ``path`` is a root directory and the file goes to
    ``path/step=N/part-XXXXX.parquet`` (a new part each call). ``compression``
    is any Parquet codec ("none", "zstd", "lz4", "snappy"). Raises the
    validation errors (`SchemaError`, `TerminalGapError`, ...) before touching
    the disk, ``TypeError`` / ``ValueError`` for a bad ``step``.
    """
    if not is_validated(table):
        validate_rollouts(table)
    dest = Path(path) if step is None else step_dir(path, step)
    storage = to_storage(table)
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
        )
    return paths[-1]


# -------------------------------------------------------------------- checks
def open_error(path: Path, exc: BaseException) -> SchemaError:
    """The `SchemaError` for a file that Arrow cannot open as Parquet."""
    return SchemaError(
        f"{path}: expected an r3arrow rollout Parquet file, found an unreadable file ({exc})",
        path=path,
    )


def check_rollout_schema(schema: pa.Schema, path: Path) -> RouteSpec:
    """The spec of a rollout file's Arrow schema; `SchemaError` (``path`` set) without one."""
    if SPEC_METADATA_KEY not in (schema.metadata or {}):
        raise SchemaError(
            f"{path}: expected an r3arrow rollout file (metadata key "
            f"{SPEC_METADATA_KEY.decode()!r}), found a file without it (columns {schema.names})",
            path=path,
        )
    try:
        return RouteSpec.from_schema(schema)
    except SchemaError as exc:
        raise SchemaError(f"{path}: {exc}", path=path) from exc


def _restore(table: pa.Table, path: Path) -> pa.Table:
    try:
        return from_storage(table)
    except SchemaError as exc:
        raise SchemaError(f"{path}: {exc}", path=path) from exc


def _footer(path: Path) -> tuple[pa.Schema, int]:
    """(Arrow schema, row groups) from a Parquet footer."""
    try:
        with pq.ParquetFile(path) as pf:
            return pf.schema_arrow, pf.metadata.num_row_groups
    except _READ_ERRORS as exc:
        raise open_error(path, exc) from exc


@dataclasses.dataclass(frozen=True)
class RolloutFile:
    """One rollout Parquet file: its ``path``, ``step`` (``None`` outside a root), row groups."""

    path: Path
    step: int | None
    num_row_groups: int


def _scan(
    pairs: Sequence[tuple[int | None, Path]],
) -> tuple[RouteSpec, pa.Schema, list[RolloutFile]]:
    spec: RouteSpec | None = None
    first: tuple[Path, pa.Schema] | None = None
    out = []
    for step, f in pairs:
        schema, row_groups = _footer(f)
        s = check_rollout_schema(schema, f)
        if first is None:
            spec, first = s, (f, schema)
        elif s != spec:
            raise SchemaError(f"{f}: expected the spec of {first[0]} ({spec}), found {s}", path=f)
        out.append(RolloutFile(f, step, row_groups))
    assert spec is not None and first is not None  # callers pass at least one file
    return spec, first[1], out


def scan_rollout_files(
    path: PathLike, *, steps: Sequence[int] | None = None
) -> tuple[RouteSpec, list[RolloutFile]]:
    """The spec shared by every rollout file under ``path`` and the files (footers only).

    Files as `iter_rollout_files` finds them (same errors). Raises `SchemaError`
    (``path`` set) if a file is unreadable, lacks the spec, or two files disagree.
    """
    spec, _, files = _scan(list(iter_rollout_files(path, steps=steps)))
    return spec, files


def read_row_group(
    path: PathLike,
    row_group: int,
    columns: Sequence[str] | None = None,
    step: int | None = None,
) -> pa.Table:
    """One row group of a rollout file, routes restored; with ``step``, an int64 ``step`` column.

    The table keeps the file's schema metadata (the spec). Raises `SchemaError`
    (``path`` set) for an unreadable or foreign file.
    """
    p = Path(path)
    try:
        with pq.ParquetFile(p) as pf:
            schema = pf.schema_arrow
            check_rollout_schema(schema, p)
            table = pf.read_row_group(row_group, columns=None if columns is None else list(columns))
    except _READ_ERRORS as exc:
        raise open_error(p, exc) from exc
    table = _restore(table.replace_schema_metadata(schema.metadata), p)
    if step is not None:
        values = pa.array(np.full(table.num_rows, step, dtype=np.int64))
        table = table.append_column(pa.field("step", pa.int64()), values)
    return table


# ---------------------------------------------------------------------- read
def read_rollouts_dataset(path: PathLike) -> ds.Dataset:
    """A `pyarrow.dataset.Dataset` over a file or step directory (storage types, lazy).

    A directory is read with hive partitioning (``step`` int64), its part files
    in numeric step order.
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such rollout file or directory")
    try:
        if p.is_dir():
            return _dataset(p, [f for _, f in step_files(p)])
        return ds.dataset(p, format="parquet")
    except _READ_ERRORS as exc:
        raise open_error(p, exc) from exc


def _dataset(base: Path, files: Sequence[Path]) -> ds.Dataset:
    return ds.dataset(
        [str(f) for f in files],
        format="parquet",
        partition_base_dir=str(base),
        partitioning=STEP_PARTITIONING,
    )


def _read_files(
    base: Path,
    files: Sequence[Path],
    meta: Any,
    columns: Sequence[str] | None,
    steps: Sequence[int] | None,
) -> pa.Table:
    """Part files under ``base`` as one restored table with the ``step`` key column."""
    filt = ds.field("step").isin(list(steps)) if steps is not None else None
    try:
        table = _dataset(base, files).to_table(
            columns=list(columns) if columns is not None else None, filter=filt
        )
    except (pa.ArrowInvalid, pa.ArrowTypeError, OSError) as exc:
        raise SchemaError(
            f"{base}: step files do not share one rollout schema/spec ({exc})", path=base
        ) from exc
    return _restore(table.replace_schema_metadata(meta), base)


def _root_files(p: Path) -> tuple[pa.Schema, list[RolloutFile]]:
    files = step_files(p)
    if not files:
        raise SchemaError(f"{p}: expected step=N/*.parquet rollout files, found none", path=p)
    _, schema, scanned = _scan(files)
    return schema, scanned


def read_rollouts(
    path: PathLike,
    *,
    columns: Sequence[str] | None = None,
    steps: Sequence[int] | None = None,
) -> pa.Table:
    """Read a rollout Parquet file or ``step=N`` directory; routes restored, spec kept.

    A directory reads in step order and adds an int64 ``step`` column (kept under
    ``columns`` only if listed); ``steps`` selects partitions (absent ones read
    as no rows). Every file must carry the same spec. Raises `SchemaError`
    (``path`` set) on a corrupt or foreign file, ``FileNotFoundError`` if
    ``path`` does not exist, ``TypeError`` if ``steps`` holds a non-int.
    """
    wanted = check_steps(steps)
    p = Path(path)
    if p.is_dir():
        schema, files = _root_files(p)
        return _read_files(p, [f.path for f in files], schema.metadata, columns, wanted)
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such rollout file or directory")
    try:
        with pq.ParquetFile(p) as pf:
            check_rollout_schema(pf.schema_arrow, p)
            table = pf.read(columns=list(columns) if columns is not None else None)
    except _READ_ERRORS as exc:
        raise open_error(p, exc) from exc
    return _restore(table, p)


def _by_step(
    files: Sequence[RolloutFile], meta: Any, columns: Sequence[str] | None
) -> Iterator[tuple[int | None, pa.Table]]:
    for step, group in groupby(files, key=lambda f: f.step):
        paths = [f.path for f in group]
        if step is None:
            for f in paths:
                yield None, read_rollouts(f, columns=columns)
            continue
        yield step, _read_files(paths[0].parent.parent, paths, meta, columns, [step])


def iter_rollouts(
    path: PathLike,
    *,
    columns: Sequence[str] | None = None,
    steps: Sequence[int] | None = None,
    batch_rows: int | None = None,
) -> Iterator[tuple[int | None, pa.Table]]:
    """Yield ``(step, table)`` one step at a time (a file: ``(None, batch)`` per ``batch_rows``).

    A directory yields its steps in numeric order (``steps`` filters; absent
    ones are skipped), each table with the ``step`` column like `read_rollouts`;
    only one step is resident at a time. Same errors as `read_rollouts`.
    """
    wanted = check_steps(steps)
    p = Path(path)
    if p.is_dir():
        schema, files = _root_files(p)
        keep = [f for f in files if wanted is None or f.step in wanted]
        yield from _by_step(keep, schema.metadata, columns)
        return
    if batch_rows is None:
        yield None, read_rollouts(p, columns=columns)
        return
    try:
        with pq.ParquetFile(p) as pf:
            schema = pf.schema_arrow
            check_rollout_schema(schema, p)
            for batch in pf.iter_batches(
                batch_size=batch_rows, columns=list(columns) if columns else None
            ):
                t = pa.Table.from_batches([batch]).replace_schema_metadata(schema.metadata)
                yield None, _restore(t, p)
    except _READ_ERRORS as exc:
        raise open_error(p, exc) from exc


def iter_rollout_tables(
    path: PathLike,
    *,
    columns: Sequence[str] | None = None,
    steps: Sequence[int] | None = None,
) -> Iterator[tuple[int | None, pa.Table]]:
    """Yield ``(step, table)`` of restored rollout rows, one step (or file) at a time.

    The files are those of `iter_rollout_files` (a file, a root or one
    partition; every requested step must exist), all checked to share one spec
    before the first table is read. A step's table has the int64 ``step``
    column (when listed under ``columns`` or ``columns`` is ``None``); a single
    file yields ``(None, table)``. The reader `r3arrow.stats` builds on.
    """
    spec_files = list(iter_rollout_files(path, steps=steps))
    _, schema, files = _scan(spec_files)
    yield from _by_step(files, schema.metadata, columns)


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
