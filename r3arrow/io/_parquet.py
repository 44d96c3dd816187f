"""Parquet: rollout tables to files and ``step=N/`` roots, exact and atomic; the one reader.

`write_rollouts` stores routes in layer groups (or portable lists; the dispatcher
`r3arrow.io._storage`), cuts row groups by bytes and seals the r3arrow metadata.
`rollout_files` discovers a file or root and checks every footer (one spec for all).
`iter_rollouts` is the one reader: bounded pieces of restored rows (`r3arrow.io._stream`,
``docs/storage.md``), a root's pieces with their int64 ``step`` column; `read_rollouts`
is the concatenation of its pieces. Both also read an Arrow IPC file (recognised by its
magic bytes, `r3arrow.io._ipc`). Files carry Parquet page checksums (CRC-32 per page)
and a SHA-256 over the r3arrow metadata (``r3arrow.meta_sha256``); readers verify both.

Every reader is a trust boundary (`r3arrow.io._verify`): a file must be an r3arrow
rollout file, all files of a root share one spec, and — unless ``validate=False`` —
what it returns is checked (core columns and types, no nulls, loss-mask lengths, routes
``<=`` tokens, the expert-id rules). Tables that pass are marked validated (writing them
again does not re-check them). Every error is an `R3ArrowError` (mostly `SchemaError`)
with ``path`` naming the file; no Arrow or OS exception escapes for a corrupt file. A
table without ``routes`` and without ``r3arrow.spec`` metadata is an R3-off rollout table:
it is written and read back as is.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from r3arrow._checks import check_int
from r3arrow._typing import PathLike
from r3arrow._validated import is_validated
from r3arrow.errors import SchemaError
from r3arrow.io._groups import stored_layer_groups
from r3arrow.io._ipc import is_ipc, read_ipc_file
from r3arrow.io._layout import atomic_path, check_steps, rollout_paths, step_dir
from r3arrow.io._project import project_layers
from r3arrow.io._storage import restore, to_storage
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
    check_storage,
    check_table,
    footer_spec,
    reading,
    sealed,
    unsealed,
)
from r3arrow.spec import SPEC_METADATA_KEY, RouteSpec

Source = PathLike | Sequence["RolloutFile"]


# ---------------------------------------------------------------------- write
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
    storage = to_storage(table, portable=portable, layer_group=layer_group)
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


# ------------------------------------------------------------------ discovery
@dataclasses.dataclass(frozen=True)
class RolloutFile:
    """One rollout Parquet file as `rollout_files` found and checked it (footer only).

    ``path``; ``step`` (``None`` for a file outside a root); ``spec`` (``None``: R3 off);
    ``schema``: the Arrow schema its rows read as (routes restored, spec in the
    metadata, no ``step`` column); ``num_rows``; ``row_group_bytes``: each row group's
    decoded size from the footer (every column; a layer projection reads about its
    fraction of the routes part), for callers that plan reads under a memory budget
    (Ray, directory collation); ``layer_groups``: the global layer ids of each stored
    layer group, in order (``((0, ..., 5), (6, ..., 11), ...)``; they partition the
    file's layers), ``None`` for portable and R3-off files (``docs/storage.md``,
    "Layout"). Reading ``layers=`` one whole group at a time restores without a copy.
    """

    path: Path
    step: int | None
    spec: RouteSpec | None
    schema: pa.Schema
    num_rows: int
    row_group_bytes: tuple[int, ...]
    layer_groups: tuple[tuple[int, ...], ...] | None
    footer: pq.FileMetaData = dataclasses.field(repr=False, compare=False)

    @property
    def num_row_groups(self) -> int:
        """The file's row groups (``len(row_group_bytes)``)."""
        return len(self.row_group_bytes)


def _checked_file(step: int | None, path: Path) -> RolloutFile:
    """The `RolloutFile` of ``path`` with its footer checked (`r3arrow.io._verify`)."""
    with reading(path), open_parquet(path) as pf:
        md = pf.metadata
        schema = pf.schema_arrow
        spec = footer_spec(pf, path)
        sizes = tuple(md.row_group(g).total_byte_size for g in range(md.num_row_groups))
        restored = unsealed(restore(schema.empty_table())).schema
        groups = stored_layer_groups(schema, spec)
        return RolloutFile(path, step, spec, restored, md.num_rows, sizes, groups, md)


def rollout_files(
    path: PathLike, *, steps: Sequence[int] | None = None, require_routes: bool = False
) -> list[RolloutFile]:
    """Every rollout Parquet file under ``path``, in read order, footers checked.

    ``path`` is a rollout file, a root of ``step=N/`` partitions (numeric step order,
    then part order) or one partition directory ``step=N``. ``steps`` selects
    partitions; every requested step must exist. All files must share one spec (or
    none: R3 off); ``require_routes`` refuses R3-off files. This is how the planners
    (`r3arrow.stats`, `r3arrow.ray`, directory collation) find their inputs; pass the
    result (or some of it) to `iter_rollouts` / `read_rollouts` to read it.

    Raises ``FileNotFoundError`` if ``path`` does not exist, ``TypeError`` if ``steps``
    is not a sequence of ints, `SchemaError` (``path`` set) for ``steps`` given with a
    single file, a path that is neither a regular file nor a directory, a directory
    without partitions or part files or with a non-canonical ``step=`` name, a
    requested step that is absent, an unreadable, corrupt or foreign file (version,
    metadata checksum, spec, layer groups), two files that disagree on the spec, and
    (``require_routes``) a file without routes.
    """
    files = [_checked_file(step, f) for step, f in rollout_paths(path, steps=steps)]
    first = files[0]
    for f in files[1:]:
        if f.spec != first.spec:
            want = first.spec if first.spec is not None else "no routes (R3 off)"
            found = f.spec if f.spec is not None else "no routes (R3 off)"
            raise SchemaError(
                f"{f.path}: expected the spec of {first.path} ({want}), found {found}",
                path=f.path,
            )
    if require_routes and first.spec is None:
        raise SchemaError(
            f"{first.path}: expected an r3arrow rollout file with routes (metadata key "
            f"{SPEC_METADATA_KEY.decode()!r}), found an R3-off file (columns "
            f"{first.schema.names})",
            path=first.path,
        )
    return files


# ---------------------------------------------------------------------- read
def _selected(
    path: Source, wanted: list[int] | None, row_groups: Sequence[int] | None
) -> tuple[list[RolloutFile], list[RolloutFile], list[int] | None]:
    """Every file of ``path``, those to read (``steps`` filtered), the checked ``row_groups``."""
    if isinstance(path, str | bytes) or not isinstance(path, Sequence):
        p = Path(path)
        if not p.exists():
            raise FileNotFoundError(f"{p}: no such rollout file or directory")
        if wanted is not None and not p.is_dir():
            raise SchemaError(f"{p}: steps= needs a step=N/ directory, found a single file", path=p)
        files = rollout_files(p)
    else:
        files = [f for f in path if isinstance(f, RolloutFile)]
        if not files or len(files) != len(path):
            raise TypeError("path: expected a rollout path or RolloutFile s of rollout_files")
    keep = [f for f in files if wanted is None or f.step in wanted]
    if row_groups is None:
        return files, keep, None
    if len(files) != 1:
        raise ValueError(f"row_groups: expected a single rollout file, found {len(files)} files")
    if isinstance(row_groups, str | bytes) or not isinstance(row_groups, Sequence):
        raise TypeError(f"row_groups: expected a sequence of ints, found {type(row_groups)}")
    n = files[0].num_row_groups
    groups = [check_int(g, "row_groups", minimum=0) for g in row_groups]
    if bad := [g for g in groups if g >= n]:
        raise ValueError(f"row_groups: expected indices below {n} ({files[0].path}), found {bad}")
    return files, keep, groups


def _ipc_path(path: Source) -> Path | None:
    """``path`` as a `Path` when it names one Arrow IPC file (by its magic bytes), else None."""
    if isinstance(path, Sequence) and not isinstance(path, str | bytes):
        return None
    p = Path(path)
    return p if is_ipc(p) else None


def _ipc(
    p: Path,
    steps: list[int] | None,
    columns: Sequence[str] | None,
    layers: Sequence[int] | None,
    row_groups: Sequence[int] | None,
    validate: bool,
) -> pa.Table:
    """An Arrow IPC rollout file, memory-mapped, checked, then selected like Parquet."""
    if steps is not None:
        raise SchemaError(f"{p}: steps= needs a step=N/ directory, found an IPC file", path=p)
    if row_groups is not None:
        raise ValueError(f"row_groups: expected a Parquet file, found an Arrow IPC file {p}")
    table = read_ipc_file(p, validate=validate)
    with reading(p):
        if layers is not None:
            table = project_layers(table, layers)
        return shape(table, None, columns, validate)


def iter_rollouts(
    path: Source,
    *,
    steps: Sequence[int] | None = None,
    columns: Sequence[str] | None = None,
    layers: Sequence[int] | None = None,
    row_groups: Sequence[int] | None = None,
    max_memory: int | None = DEFAULT_MAX_MEMORY,
    batch_rows: int | None = None,
    validate: bool = True,
) -> Iterator[pa.Table]:
    """Yield bounded pieces of restored rollout rows of a file, root or IPC file, in order.

    ``path``: a rollout Parquet file, a root of ``step=N/`` partitions or one partition
    (files as `rollout_files` finds them, footers checked and one spec shared before the
    first piece), an Arrow IPC file (by its magic bytes: one memory-mapped piece), or
    `RolloutFile` s from `rollout_files` (not checked again). Pieces of a step carry its
    int64 ``step`` column (when ``columns`` is ``None`` or lists it); a file outside a
    root has none. ``steps`` selects partitions (absent ones read as no rows);
    ``columns`` selects and orders columns; ``layers`` (global layer ids) projects the
    routes columns (layer projection, ``docs/storage.md``: only those layers, ascending,
    the spec has ``num_layers = len(layers)`` and ``r3arrow.route_layers`` names them; a
    layer-group file reads only the groups holding them); ``row_groups`` reads only
    those row groups (indices, in that order) of a single Parquet file.

    The memory budget (``docs/storage.md``): a piece holds at most ``max_memory / 4``
    bytes of restored rows (default budget 1 GiB; ``None``: one piece per step) and at
    most ``batch_rows`` rows; pieces never span two steps; only about one row group is
    read ahead. A step or file without rows yields one empty piece. The footer and page
    checksums are always verified; the rows are validated (as `read_rollouts`) unless
    ``validate=False``, and validated pieces are marked so.

    Raises (when the piece holding the fault is read) ``FileNotFoundError`` if ``path``
    does not exist, the errors of `rollout_files` (but absent ``steps`` are no error),
    `SchemaError` (``path`` set) for a corrupt or foreign file or ``steps`` on a single
    file, the validation errors (``path`` set) for bad rows, ``TypeError`` /
    ``ValueError`` for bad ``steps``, ``row_groups`` (out of range, or more than one
    file), ``max_memory`` or ``batch_rows``, ``ValueError`` / `RouteShapeError` for
    ``layers`` the file does not hold.
    """
    wanted = check_steps(steps)
    if (ipc := _ipc_path(path)) is not None:
        yield _ipc(ipc, wanted, columns, layers, row_groups, validate)
        return
    _, files, groups = _selected(path, wanted, row_groups)
    yield from iter_pieces(
        [(f.step, f.path) for f in files],
        footers={f.path: f.footer for f in files},
        columns=columns,
        layers=layers,
        max_memory=max_memory,
        batch_rows=batch_rows,
        validate=validate,
        row_groups=groups,
    )


def read_rollouts(
    path: Source,
    *,
    steps: Sequence[int] | None = None,
    columns: Sequence[str] | None = None,
    layers: Sequence[int] | None = None,
    row_groups: Sequence[int] | None = None,
    max_memory: int | None = None,
    batch_rows: int | None = None,
    validate: bool = True,
) -> pa.Table:
    """The rows `iter_rollouts` yields for the same arguments, as one table (chunks kept).

    ``max_memory`` / ``batch_rows`` bound the pieces read on the way (as in `iter_rollouts`;
    default: whole row groups), not the result, which holds every selected row.

    The spec stays in the schema metadata; with no row selected (``steps`` absent),
    no rows with the schema of the first file. Validated as a whole (error rows index
    the whole table) unless ``validate=False`` (for a caller re-reading files it wrote
    itself in a hot loop); a validated table is marked so writing it again skips the
    checks. For bounded memory use `iter_rollouts`. Raises what `iter_rollouts` raises.
    """
    wanted = check_steps(steps)
    if (ipc := _ipc_path(path)) is not None:
        return _ipc(ipc, wanted, columns, layers, row_groups, validate)
    every, files, groups = _selected(path, wanted, row_groups)
    first = every[0]
    where = first.path if isinstance(path, Sequence) and not isinstance(path, str) else Path(path)
    parts = list(
        iter_pieces(
            [(f.step, f.path) for f in files],
            footers={f.path: f.footer for f in files},
            columns=columns,
            layers=layers,
            max_memory=max_memory,
            batch_rows=batch_rows,
            validate=False,
            check=validate,
            row_groups=groups,
        )
    )
    if not parts:  # no selected step is present: no rows, the schema of the first file
        empty = restore_unit(
            empty_table(first.path, columns, layers), first.path, None, False, False, False
        )
        parts = [shape(empty, first.step, columns, False)]
    table = parts[0] if len(parts) == 1 else concat(parts, where)
    if not validate:
        return table
    with reading(where):
        meta = table.schema.metadata or {}
        spec = RouteSpec.from_schema(table.schema) if SPEC_METADATA_KEY in meta else None
        return check_table(table, spec, projected=columns is not None)


__all__ = ["RolloutFile", "iter_rollouts", "read_rollouts", "rollout_files", "write_rollouts"]
