"""Parquet: rollout tables to files and ``step=N/`` roots, exact and atomic.

Routes are written in layer-group storage (`r3arrow.io._groups`; older files hold
one ``fixed_size_binary`` value per token, `r3arrow.io._storage`) and restored on
read; the spec travels in the file metadata. Row groups are cut by bytes and every
reader streams them (`r3arrow.io._stream`, ``docs/storage.md``): `iter_rollouts` and
`iter_rollout_tables` yield bounded ``(step, table)`` pieces under ``max_memory``, and
``layers=`` reads only the layer groups holding those layers (layer projection). Files are written
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
from r3arrow.io._groups import plan_groups, read_leaves, stored_layer_groups, to_group_storage
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
from r3arrow.io._stream import (
    DEFAULT_MAX_MEMORY,
    DEFAULT_ROW_GROUP_BYTES,
    concat,
    empty_table,
    iter_pieces,
    open_parquet,
    restore_unit,
    row_group_bounds,
    shape,
)
from r3arrow.io._verify import (
    check_rows,
    check_storage,
    check_table,
    file_spec,
    footer_spec,
    open_error,
    reading,
    sealed,
)
from r3arrow.spec import SPEC_METADATA_KEY, RouteSpec

#: Parquet page checksums are verified on every read (files without them read unchecked).
_PARQUET_FORMAT = ds.ParquetFileFormat(
    default_fragment_scan_options=ds.ParquetFragmentScanOptions(page_checksum_verification=True)
)


# ---------------------------------------------------------------------- write
def _storage_form(
    table: pa.Table, portable: bool, layer_group: int | Sequence[int] | None
) -> pa.Table:
    """What Parquet stores: routes as layer-group (or portable) columns; R3 off as is."""
    if SPEC_METADATA_KEY not in (table.schema.metadata or {}):
        return table  # R3 off: no routes to convert (check_table refused a routes column)
    if portable:
        return to_portable(table)
    spec = RouteSpec.from_schema(table.schema)
    return to_group_storage(table, plan_groups(spec.num_layers, layer_group))


def write_rollouts(
    table: pa.Table,
    path: PathLike,
    *,
    step: int | None = None,
    compression: str | None = "none",
    compression_level: int | None = None,
    row_group_rows: int | None = None,
    row_group_bytes: int | None = None,
    layer_group: int | Sequence[int] | None = None,
    portable: bool = False,
) -> Path:
    """Write a rollout table to Parquet atomically; return the file written.

    The table is validated (the checks of the readers, `r3arrow.io._verify`)
    unless r3arrow built or validated this very table already. With ``step=N``
    (an int ``>= 0``), ``path`` is a root directory and the file goes to
    ``path/step=N/part-XXXXX.parquet`` (a new part each call). ``compression``
    is any Parquet codec ("none", "zstd", "lz4", "snappy"). ``portable=True``
    stores routes as plain nested integer lists (readable by pandas, Polars,
    DuckDB, datasets; larger and slower) instead of binary layer groups;
    r3arrow reads both. Every page carries a CRC-32 and the r3arrow metadata a
    SHA-256 (``r3arrow.meta_sha256``). A table without ``routes`` and without a
    spec (R3 off) is written as is. A routes column of many chunks is written
    chunk by chunk (never combined).

    Layout (``docs/storage.md``): routes are stored in groups of consecutive
    layers so a reader of some layers reads only their groups; ``layer_group``
    picks them (``None``: ``max(1, L // 8)`` layers per group; an int: that many
    layers per group; a sequence: the group sizes, e.g. one per pipeline stage).
    Row groups hold about ``row_group_bytes`` decoded bytes each (default 64 MiB;
    streaming readers hold about one at a time); an explicit ``row_group_rows``
    wins. Raises the validation errors (`SchemaError`, `TerminalGapError`, ...)
    before touching the disk, ``TypeError`` / ``ValueError`` for a bad ``step``,
    ``layer_group``, ``row_group_bytes`` or ``layer_group`` with ``portable``.
    """
    if portable and layer_group is not None:
        raise ValueError("layer_group: expected None with portable=True (nested lists)")
    target = DEFAULT_ROW_GROUP_BYTES
    if row_group_bytes is not None:
        target = check_int(row_group_bytes, "row_group_bytes", minimum=1)
    if not is_validated(table):
        meta = table.schema.metadata or {}
        spec = RouteSpec.from_schema(table.schema) if SPEC_METADATA_KEY in meta else None
        check_storage(table)
        check_table(table, spec)
    dest = Path(path) if step is None else step_dir(path, step)
    storage = _storage_form(table, portable, layer_group)
    bounds = (
        [(0, table.num_rows)] if row_group_rows is not None else row_group_bounds(table, target)
    )
    storage = storage.replace_schema_metadata(sealed(dict(storage.schema.metadata or {})))
    no_dict = [n for n in storage.schema.names if n != "routes"]
    with (
        atomic_path(dest, new_part=step is not None) as paths,
        pq.ParquetWriter(
            paths[0],
            storage.schema,
            compression=compression,  # type: ignore[arg-type]  # validated by Arrow
            compression_level=compression_level,
            use_dictionary=no_dict,  # type: ignore[arg-type]  # stubs: a list of columns is valid
            write_statistics=no_dict,
            data_page_size=8 << 20,
            use_compliant_nested_type=False,  # keep list child names ("item"): exact round trip
            write_page_checksum=True,
        ) as writer,
    ):
        if not bounds:  # no rows: an empty file with the schema
            writer.write_table(storage)
        for a, b in bounds:
            writer.write_table(storage.slice(a, b - a), row_group_size=row_group_rows or b - a)
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


def _footer(
    path: Path, footers: dict[Path, pq.FileMetaData] | None = None
) -> tuple[pa.Schema, tuple[int, ...], RouteSpec | None, tuple[tuple[int, ...], ...] | None]:
    """(Arrow schema, decoded bytes per row group, spec, layer groups) of a checked footer.

    ``footers``: where to keep the checked footer, so the read that follows does not
    parse and check it again (`r3arrow.io._stream.iter_pieces`).
    """
    with reading(path), open_parquet(path) as pf:
        md = pf.metadata
        sizes = tuple(md.row_group(g).total_byte_size for g in range(md.num_row_groups))
        schema = pf.schema_arrow
        spec = footer_spec(pf, path)
        if footers is not None:
            footers[path] = md
        return schema, sizes, spec, stored_layer_groups(schema, spec)


@dataclasses.dataclass(frozen=True)
class RolloutFile:
    """One rollout Parquet file: its ``path``, ``step`` (``None`` outside a root), row groups.

    ``row_group_bytes``: each row group's decoded size from the footer (every
    column; a layer projection reads about its fraction of the routes part), for
    callers that plan reads under a memory budget (Ray, directory collation).
    ``layer_groups``: the global layer ids of each stored layer group, in order
    (``((0, ..., 5), (6, ..., 11), ...)``; they partition the file's layers), for a
    file in ``layer_groups/v1`` storage; ``None`` for the older single-value and the
    portable layouts and for R3-off files (``docs/storage.md``, "Layout"). Reading
    ``layers=`` one whole group at a time restores without a copy.
    """

    path: Path
    step: int | None
    num_row_groups: int
    row_group_bytes: tuple[int, ...] = ()
    layer_groups: tuple[tuple[int, ...], ...] | None = None


def _scan(
    pairs: Sequence[tuple[int | None, Path]],
    footers: dict[Path, pq.FileMetaData] | None = None,
) -> tuple[RouteSpec | None, pa.Schema, list[RolloutFile]]:
    spec: RouteSpec | None = None
    first: tuple[Path, pa.Schema] | None = None
    out = []
    for step, f in pairs:
        schema, sizes, s, groups = _footer(f, footers)
        if first is None:
            spec, first = s, (f, schema)
        elif s != spec:
            want = spec if spec is not None else "no routes (R3 off)"
            found = s if s is not None else "no routes (R3 off)"
            raise SchemaError(
                f"{f}: expected the spec of {first[0]} ({want}), found {found}", path=f
            )
        out.append(RolloutFile(f, step, len(sizes), sizes, groups))
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
    layers: Sequence[int] | None = None,
) -> pa.Table:
    """One row group of a rollout file, routes restored; with ``step``, an int64 ``step`` column.

    The table keeps the file's schema metadata (the spec) and is validated like
    `read_rollouts` (``validate=False`` skips the data checks); ``layers`` projects
    the routes like `read_rollouts` (only those layer groups are read). Raises
    `SchemaError` (``path`` set) for an unreadable, corrupt or foreign file, the
    validation errors (``path`` set) for bad data, and ``ValueError`` /
    ``TypeError`` for a ``row_group`` that is not an index of the file.
    """
    p = Path(path)
    group = check_int(row_group, "row_group", minimum=0)
    with reading(p), open_parquet(p) as pf:
        schema = pf.schema_arrow
        footer_spec(pf, p)
        groups = pf.metadata.num_row_groups
        if group < groups:
            leaves = read_leaves(schema, columns, layers)
            table = pf.read_row_group(group, columns=leaves)
            check_rows(table, pf.metadata.row_group(group).num_rows, p, f"row group {group}")
    if group >= groups:  # argument misuse, raised outside the corrupt-file translation
        raise ValueError(f"row_group: expected an index below {groups} ({p}), found {group}")
    table = restore_unit(
        table.replace_schema_metadata(schema.metadata),
        p,
        layers,
        validate,
        validate,
        columns is not None,
    )
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
    rows are not validated (use `read_rollouts` for that). Routes come in their
    storage form (a struct of layer groups, ``docs/storage.md``).
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such rollout file or directory")
    with reading(p):
        if p.is_dir():
            return ds.dataset(
                [str(f) for _, f in step_files(p)],
                format=_PARQUET_FORMAT,
                partition_base_dir=str(p),
                partitioning=STEP_PARTITIONING,
            )
        return ds.dataset(p, format=_PARQUET_FORMAT)


def _files(
    p: Path, wanted: Sequence[int] | None, footers: dict[Path, pq.FileMetaData] | None = None
) -> tuple[list[tuple[int | None, Path]], list[RolloutFile]]:
    """The (step, file) pairs to read under ``p`` (file or root) and all scanned files.

    ``footers`` receives each checked footer (see `_footer`).
    """
    if p.is_dir():
        pairs: list[tuple[int | None, Path]] = list(step_files(p))
        if not pairs:
            raise SchemaError(f"{p}: expected step=N/*.parquet rollout files, found none", path=p)
        _, _, scanned = _scan(pairs, footers)
        keep = [(f.step, f.path) for f in scanned if wanted is None or f.step in wanted]
        return keep, scanned
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such rollout file or directory")
    _, _, scanned = _scan([(None, p)], footers)
    return [(None, p)], scanned


def read_rollouts(
    path: PathLike,
    *,
    columns: Sequence[str] | None = None,
    steps: Sequence[int] | None = None,
    layers: Sequence[int] | None = None,
    validate: bool = True,
) -> pa.Table:
    """Read a rollout Parquet file or ``step=N`` directory whole; routes restored, spec kept.

    A directory reads in step order and adds an int64 ``step`` column (kept under
    ``columns`` only if listed); ``steps`` selects partitions (absent ones read
    as no rows). Every file must carry the same spec (or none: R3 off).
    ``layers`` (global layer ids) returns a projected table (layer projection,
    ``docs/storage.md``): routes columns hold only those layers, ascending, the
    spec has ``num_layers = len(layers)`` and ``r3arrow.route_layers`` names them;
    a layer-group file reads only the groups holding them. For bounded memory
    use `iter_rollouts`.

    The footer (version, metadata checksum, spec, layer groups) and page
    checksums are always verified. The rows are validated — core columns and
    types, no nulls, loss-mask lengths, routes ``<=`` tokens, ids in range and
    distinct on router layers, the terminal-gap rule — unless ``validate=False``
    (for a caller re-reading files it wrote itself in a hot loop); a validated
    table is marked so writing it again skips the checks. Files written before
    the checksums existed read without those checks.

    Raises `SchemaError` (``path`` set) on a corrupt or foreign file, the
    validation errors (``path`` set) on bad rows, ``FileNotFoundError`` if
    ``path`` does not exist, ``TypeError`` if ``steps`` holds a non-int,
    ``ValueError`` / `RouteShapeError` for ``layers`` the file does not hold.
    """
    wanted = check_steps(steps)
    p = Path(path)
    footers: dict[Path, pq.FileMetaData] = {}
    pairs, scanned = _files(p, wanted, footers)
    parts = [
        t
        for _, t in iter_pieces(
            pairs,
            footers=footers,
            columns=columns,
            layers=layers,
            max_memory=None,
            batch_rows=None,
            validate=False,
            check=validate,
        )
    ]
    if not parts:  # no selected step is present: no rows, the schema of the first file
        first = scanned[0]
        empty = restore_unit(
            empty_table(first.path, columns, layers), first.path, None, False, False, False
        )
        parts = [shape(empty, first.step, columns, False)]
    table = parts[0] if len(parts) == 1 else concat(parts, p)
    if not validate:
        return table
    with reading(p):
        meta = table.schema.metadata or {}
        spec = RouteSpec.from_schema(table.schema) if SPEC_METADATA_KEY in meta else None
        return check_table(table, spec, projected=columns is not None)


def iter_rollouts(
    path: PathLike,
    *,
    steps: Sequence[int] | None = None,
    columns: Sequence[str] | None = None,
    layers: Sequence[int] | None = None,
    max_memory: int | None = DEFAULT_MAX_MEMORY,
    batch_rows: int | None = None,
    validate: bool = True,
) -> Iterator[tuple[int | None, pa.Table]]:
    """Yield bounded ``(step, table)`` pieces of a rollout file or root, in read order.

    A directory yields its steps in numeric order (``steps`` filters; absent
    ones are skipped), each piece with the ``step`` column like `read_rollouts`;
    a file yields ``(None, piece)``. The memory budget (``docs/storage.md``): a piece
    holds at most ``max_memory / 4`` bytes of restored rows (default budget
    1 GiB; ``None``: one piece per step) and at most ``batch_rows`` rows; pieces
    of one step are consecutive and never span two steps; only about one row
    group is read ahead. ``layers`` projects like `read_rollouts`. Each piece is
    checked like `read_rollouts` (``validate=False`` skips the data checks).
    Same errors, raised when the piece holding the fault is read.
    """
    wanted = check_steps(steps)
    p = Path(path)
    footers: dict[Path, pq.FileMetaData] = {}
    pairs, _ = _files(p, wanted, footers)
    yield from iter_pieces(
        pairs,
        footers=footers,
        columns=columns,
        layers=layers,
        max_memory=max_memory,
        batch_rows=batch_rows,
        validate=validate,
    )


def iter_rollout_tables(
    path: PathLike,
    *,
    columns: Sequence[str] | None = None,
    steps: Sequence[int] | None = None,
    layers: Sequence[int] | None = None,
    max_memory: int | None = DEFAULT_MAX_MEMORY,
    validate: bool = True,
) -> Iterator[tuple[int | None, pa.Table]]:
    """Yield bounded ``(step, table)`` pieces of restored rollout rows (the stats reader).

    The files are those of `iter_rollout_files` (a file, a root or one
    partition; every requested step must exist), all checked to share one spec
    before the first piece is read. Pieces as `iter_rollouts` makes them
    (``max_memory``, ``layers``; several consecutive pieces per step when a step
    exceeds the budget); a step's pieces have the int64 ``step`` column (when
    listed under ``columns`` or ``columns`` is ``None``); a single file yields
    ``(None, piece)``. Checked like `read_rollouts` (``validate=False`` skips
    the data checks). `r3arrow.stats`, Ray reads and directory collation build on it.
    """
    spec_files = list(iter_rollout_files(path, steps=steps))
    footers: dict[Path, pq.FileMetaData] = {}
    _scan(spec_files, footers)
    yield from iter_pieces(
        spec_files,
        footers=footers,
        columns=columns,
        layers=layers,
        max_memory=max_memory,
        batch_rows=None,
        validate=validate,
    )


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
