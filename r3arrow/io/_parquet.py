"""Parquet: the writer, discovery (`rollout_files`) and the one reader (`iter_rollouts`,
`read_rollouts`, which read Arrow IPC files too); the contract is the package docstring."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from r3arrow._checks import check_int, check_regular
from r3arrow._schema import ATTEMPT, ROUTES_MISSING
from r3arrow._typing import PathLike
from r3arrow._validated import is_validated
from r3arrow._versions import check_new_keys
from r3arrow.errors import R3ArrowError, SchemaError
from r3arrow.io._groups import stored_layer_groups
from r3arrow.io._ipc import is_ipc, read_ipc_file
from r3arrow.io._layout import (
    STEP_COLUMN,
    atomic_path,
    check_reserved,
    check_steps,
    rollout_paths,
    step_dir,
    step_parts,
)
from r3arrow.io._project import local_layers, project_layers, projected_spec
from r3arrow.io._storage import restore, to_storage
from r3arrow.io._stream import (
    DEFAULT_MAX_MEMORY,
    DEFAULT_ROW_GROUP_BYTES,
    PAGE_BYTES,
    FileRef,
    Identity,
    concat,
    empty_piece,
    iter_pieces,
    open_file,
    open_parquet,
    row_group_bounds,
    shape,
)
from r3arrow.io._verify import (
    DIGEST_KEY,
    check_storage,
    check_table,
    digest_record,
    footer_spec,
    reading,
    sealed,
    table_spec,
    unsealed,
)
from r3arrow.spec import SPEC_METADATA_KEY, RouteSpec
from r3arrow.table import route_layers

Source = PathLike | Sequence["RolloutFile"]


def _check_attempts(table: pa.Table, root: PathLike, step: int) -> None:
    """A keyed new part (an ``attempt`` column) of ``root/step=N``: its keys are new to the
    step's parts (`r3arrow._versions.check_new_keys`; ``docs/versions.md``)."""
    if ATTEMPT not in table.schema.names:
        return
    parts: list[tuple[Path, pa.Table | None]] = []
    for f in step_parts(root, step):
        check_regular(f)  # a FIFO would block the read
        try:
            names = pq.read_schema(f).names
            keys = None
            if ATTEMPT in names:
                keys = pq.read_table(f, columns=["trajectory_id", ATTEMPT])
        except (OSError, pa.ArrowException) as exc:
            raise SchemaError(
                f"{f}: expected a readable rollout part to check attempts against, found {exc}",
                path=f,
            ) from exc
        parts.append((f, keys))
    check_new_keys(table, parts)


#: Rows per row group at most (pyarrow before 15 caps a row group there by default): each
#: bound the writer digests is then exactly one row group.
_MAX_ROWS = 1 << 20


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
    """Write a rollout table to Parquet atomically, validated first; return the file.

    ``step=N``: ``path`` is a root and the file a new part of ``path/step=N/``.
    ``portable=True``: routes as nested integer lists, else in layer groups of ``layer_group``
    (``None``: ``max(1, L // 8)`` layers; an int: that many; a sequence: the sizes). Row groups
    of about ``row_group_bytes`` unless ``row_group_rows`` (``docs/storage.md``). Raises, before
    touching the disk, ``TypeError`` / ``ValueError`` for bad arguments (``step`` an int in
    ``[0, 2**63)``), `SchemaError` for a column named ``__r3arrow*`` or, with ``step``,
    ``step`` (the readers add the partition's), and the validation errors. A part never
    replaces another; with ``step``, a table with an ``attempt`` column whose (``trajectory_id``,
    ``attempt``) keys an earlier part of that step holds, or a step whose parts lack the
    column, raises `SchemaError` (``path``: that part; ``row``, ``trajectory_id``) before
    anything is written (``docs/versions.md``; writers of one step's keys are serialised by
    the caller: the check and the new part are not one atomic step).
    """
    if portable and layer_group is not None:
        raise ValueError("layer_group: expected None with portable=True (nested lists)")
    target = DEFAULT_ROW_GROUP_BYTES
    if row_group_bytes is not None:
        target = check_int(row_group_bytes, "row_group_bytes", minimum=1)
    dest = Path(path) if step is None else step_dir(path, step)
    check_reserved(table.schema.names, in_root=step is not None)
    if not is_validated(table):
        check_storage(table)
        check_table(table, table_spec(table))
    if step is not None:
        _check_attempts(table, path, step)
    storage = to_storage(table, portable=portable, layer_group=layer_group)
    if row_group_rows is not None:
        size = check_int(row_group_rows, "row_group_rows", minimum=1)
        bounds = [(a, min(a + size, table.num_rows)) for a in range(0, table.num_rows, size)]
    else:
        bounds = row_group_bounds(table, target)
    bounds = [(c, min(c + _MAX_ROWS, b)) for a, b in bounds for c in range(a, b, _MAX_ROWS)]
    meta = {**(storage.schema.metadata or {}), DIGEST_KEY: digest_record(storage, bounds)}
    storage = storage.replace_schema_metadata(sealed(meta))
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
            data_page_size=PAGE_BYTES,
            use_compliant_nested_type=False,  # keep list child names ("item"): exact round trip
            write_page_checksum=True,
        ) as writer,
    ):
        if not bounds:  # no rows: an empty file with the schema
            writer.write_table(storage)
        for a, b in bounds:  # one row group each, as `digest_record` digested them
            writer.write_table(storage.slice(a, b - a), row_group_size=b - a)
    return paths[-1]


@dataclasses.dataclass(frozen=True)
class RolloutFile:
    """One rollout Parquet file as `rollout_files` checked it (footer only): ``step``
    (``None`` outside a root), ``spec`` (``None``: R3 off), the ``schema`` its rows read as,
    each row group's decoded bytes, and ``layer_groups``, the global layer ids of each stored
    group (``None`` for portable and R3-off files; ``docs/storage.md``, "Layout"). Readers read
    ``footer`` only from the file it was read from (``identity``: device, inode, size, mtime),
    else `SchemaError`.
    """

    path: Path
    step: int | None
    spec: RouteSpec | None
    schema: pa.Schema
    num_rows: int
    row_group_bytes: tuple[int, ...]
    layer_groups: tuple[tuple[int, ...], ...] | None
    footer: pq.FileMetaData = dataclasses.field(repr=False, compare=False)
    identity: Identity = dataclasses.field(repr=False, compare=False)

    @property
    def num_row_groups(self) -> int:
        """The file's row groups (``len(row_group_bytes)``)."""
        return len(self.row_group_bytes)


def _checked_file(step: int | None, path: Path) -> RolloutFile:
    with reading(path), open_file(path) as (fh, identity), open_parquet(fh) as pf:
        md = pf.metadata
        schema = pf.schema_arrow
        spec = footer_spec(pf)
        check_reserved(schema.names, in_root=step is not None)
        sizes = tuple(md.row_group(g).total_byte_size for g in range(md.num_row_groups))
        restored = unsealed(restore(schema.empty_table())).schema
        groups = stored_layer_groups(schema, spec)
        return RolloutFile(path, step, spec, restored, md.num_rows, sizes, groups, md, identity)


def _routes_of(f: RolloutFile) -> str:
    """What a file's routes are, to compare: its spec and global layers, or R3 off."""
    if f.spec is None:
        return "no spec: no routes (R3 off)"
    return f"spec {f.spec} of layers {list(route_layers(f.schema))}"


def _check_one_spec(files: Sequence[RolloutFile]) -> None:
    """`SchemaError` unless every file has the first one's spec and (projected) layers."""
    first = files[0]
    for f in files[1:]:
        if f.spec != first.spec or (
            f.spec is not None and route_layers(f.schema) != route_layers(first.schema)
        ):
            raise SchemaError(
                f"{f.path}: expected the {_routes_of(first)} of {first.path}, found "
                f"{_routes_of(f)}",
                path=f.path,
            )


def rollout_files(
    path: PathLike, *, steps: Sequence[int] | None = None, require_routes: bool = False
) -> list[RolloutFile]:
    """Every rollout Parquet file of a file, ``step=N/`` root or partition, in read order,
    its footer checked, all of one spec (``require_routes``: not R3 off); ``steps`` must exist.

    Raises ``FileNotFoundError``, ``TypeError`` / ``ValueError`` (bad ``steps``) and
    `SchemaError` (``path`` set) for a bad layout (``steps`` with a file, no partitions or
    parts, ``step=01``, an absent step, a FIFO or device), an unreadable, corrupt or foreign
    file, a reserved column (``__r3arrow*``, ``step`` in a root), two specs or two sets of
    projected layers.
    """
    files = [_checked_file(step, f) for step, f in rollout_paths(path, steps=steps)]
    _check_one_spec(files)
    first = files[0]
    if require_routes and first.spec is None:
        raise SchemaError(
            f"{first.path}: expected an r3arrow rollout file with routes (metadata key "
            f"{SPEC_METADATA_KEY.decode()!r}), found an R3-off file (columns "
            f"{first.schema.names})",
            path=first.path,
        )
    return files


def _refs(files: Sequence[RolloutFile]) -> list[FileRef]:
    return [(f.step, f.path, f.footer, f.identity) for f in files]


def _check_columns(
    columns: Sequence[str] | None, files: Sequence[tuple[Path, list[str]]]
) -> list[str] | None:
    """``columns`` (``None``: all) once each is ``step`` or a column of every one of ``files``
    (path, column names), ``routes_missing`` added after ``routes`` where a file has it (a
    projection never drops the marks that say which route rows are placeholders,
    ``docs/fallback.md``): ``TypeError`` for a str or a non-str name, ``ValueError`` for none
    or a name no file has (naming those they have), `SchemaError` for one some files lack."""
    if columns is None:
        return None
    if isinstance(columns, str | bytes) or not isinstance(columns, Sequence):
        raise TypeError(
            f"columns: expected a sequence of column names (None: all), found "
            f"{type(columns).__name__} {columns!r:.80}"
        )
    if bad := [c for c in columns if not isinstance(c, str)]:
        raise TypeError(f"columns: expected column names (str), found {bad[:4]!r:.80}")
    if not columns:
        raise ValueError("columns: expected at least one column name (None reads all), found none")
    for path, names in files:
        if missing := [c for c in columns if c not in names and c != STEP_COLUMN]:
            if any(c in other for c in missing for _, other in files):
                raise SchemaError(
                    f"{path}: expected columns {missing}, found columns {names}", path=path
                )
            raise ValueError(f"columns: expected names of the columns {names}, found {missing}")
    out = list(columns)
    marked = any(ROUTES_MISSING in names for _, names in files)
    if marked and "routes" in out and ROUTES_MISSING not in out:
        out.insert(out.index("routes") + 1, ROUTES_MISSING)
    return out


def _check_layers(layers: Sequence[int] | None, path: Path, schema: pa.Schema) -> None:
    """``layers`` (global ids) checked against a file's restored ``schema`` before any read:
    as `project_layers` raises (a dense-only choice too), `SchemaError` for an R3-off file."""
    if layers is None:
        return
    if SPEC_METADATA_KEY not in (schema.metadata or {}):
        raise SchemaError(f"{path}: layers= expected a file with routes, found R3 off", path=path)
    try:
        projected_spec(RouteSpec.from_schema(schema), local_layers(schema, layers))
    except R3ArrowError as exc:  # RouteShapeError: layers a projected file lacks
        exc.path, exc.message = str(path), f"{path}: {exc.message}"
        exc.args = (exc.message,)
        raise


def _selected(
    path: Source,
    wanted: list[int] | None,
    columns: Sequence[str] | None,
    layers: Sequence[int] | None,
    row_groups: Sequence[int] | None,
) -> tuple[list[RolloutFile], list[RolloutFile], list[str] | None, list[int] | None]:
    """Every file of ``path``, those to read (``steps`` filtered), the checked ``columns`` and
    ``row_groups``; ``layers`` checked."""
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
        _check_one_spec(files)
    keep = [f for f in files if wanted is None or f.step in wanted]
    step = [STEP_COLUMN] if files[0].step is not None else []
    names = _check_columns(columns, [(f.path, f.schema.names + step) for f in keep or files[:1]])
    _check_layers(layers, files[0].path, files[0].schema)
    if row_groups is None:
        return files, keep, names, None
    if len(files) != 1:
        raise ValueError(f"row_groups: expected a single rollout file, found {len(files)} files")
    if isinstance(row_groups, str | bytes) or not isinstance(row_groups, Sequence):
        raise TypeError(f"row_groups: expected a sequence of ints, found {type(row_groups)}")
    n = files[0].num_row_groups
    groups = [check_int(g, "row_groups", minimum=0) for g in row_groups]
    if not groups:
        raise ValueError("row_groups: expected at least one index (None reads all), found none")
    if bad := [g for g in groups if g >= n]:
        raise ValueError(f"row_groups: expected indices below {n} ({files[0].path}), found {bad}")
    return files, keep, names, groups


def _ipc(
    path: Source,
    steps: list[int] | None,
    columns: Sequence[str] | None,
    layers: Sequence[int] | None,
    row_groups: Sequence[int] | None,
    validate: bool,
) -> pa.Table | None:
    """``path``'s rows if it is an Arrow IPC file (by its magic bytes), else None."""
    if isinstance(path, Sequence) and not isinstance(path, str | bytes):
        return None
    if not is_ipc(p := Path(path)):
        return None
    if steps is not None:
        raise SchemaError(f"{p}: steps= needs a step=N/ directory, found an IPC file", path=p)
    if row_groups is not None:
        raise ValueError(f"row_groups: expected a Parquet file, found an Arrow IPC file {p}")
    table = read_ipc_file(p)
    names = _check_columns(columns, [(p, table.schema.names)])
    _check_layers(layers, p, table.schema)
    with reading(p):
        if validate:
            table = check_table(table, table_spec(table))
        if layers is not None:
            table = project_layers(table, layers)
        return shape(table, None, names, validate)


def _stream(
    path: Source,
    steps: Sequence[int] | None,
    columns: Sequence[str] | None,
    layers: Sequence[int] | None,
    row_groups: Sequence[int] | None,
    max_memory: int | None,
    batch_rows: int | None,
    validate: bool,
) -> tuple[Callable[[], pa.Schema], Iterator[pa.Table]]:
    """(the pieces' schema, read on demand; the pieces), the arguments and footers checked."""
    wanted = check_steps(steps)
    if (ipc := _ipc(path, wanted, columns, layers, row_groups, validate)) is not None:
        return (lambda: ipc.schema), iter([ipc])
    every, files, names, groups = _selected(path, wanted, columns, layers, row_groups)
    first = _refs(files or every[:1])[0]
    pieces = iter_pieces(
        _refs(files),
        columns=names,
        layers=layers,
        max_memory=max_memory,
        batch_rows=batch_rows,
        validate=validate,
        row_groups=groups,
    )
    return (lambda: empty_piece(first, names, layers, validate).schema), pieces


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

    ``path``: as `rollout_files` (every footer checked first), an Arrow IPC file (one piece)
    or `RolloutFile` s. A root's pieces gain an int64 ``step`` column, the partition's (so a
    root's rows read back with one more column than was written). ``steps`` (absent ones
    read as no rows), ``columns`` (at least one; ``step`` is a root's, none elsewhere),
    ``layers`` (global ids) and ``row_groups`` (of one Parquet file) select; a piece holds
    at most ``max_memory / 4`` bytes (``None``: a step) and ``batch_rows`` rows of one step
    (``docs/storage.md``, "Streaming"). Rows are validated unless ``validate=False``.
    Raises, before any row is read, ``TypeError`` / ``ValueError`` for bad arguments (an
    unknown column, a layer outside the file) and what `rollout_files` raises; as the faulty
    piece is read, the validation errors and `SchemaError` (``path`` set) for a corrupt file
    or one replaced since its footer was read; `RouteShapeError` for ``layers`` a projected
    file lacks.
    """
    args = (steps, columns, layers, row_groups, max_memory, batch_rows, validate)
    return _stream(path, *args)[1]


def rollout_reader(
    path: Source,
    *,
    steps: Sequence[int] | None = None,
    columns: Sequence[str] | None = None,
    layers: Sequence[int] | None = None,
    row_groups: Sequence[int] | None = None,
    max_memory: int | None = DEFAULT_MAX_MEMORY,
    batch_rows: int | None = None,
    validate: bool = True,
) -> pa.RecordBatchReader:
    """The rows `iter_rollouts` yields for the same arguments as one Arrow stream, routes
    decoded, for tools that read Arrow streams (DuckDB, Polars, pandas, ``datasets``:
    ``docs/portable.md``). Raises as `iter_rollouts`: the arguments and footers now, the
    rows' errors as the stream is read, in bounded pieces.
    """
    args = (steps, columns, layers, row_groups, max_memory, batch_rows, validate)
    schema_of, pieces = _stream(path, *args)
    schema = schema_of()
    batches = (
        pa.RecordBatch.from_arrays(b.columns, schema=schema)
        for piece in pieces
        for b in piece.to_batches()
    )
    return pa.RecordBatchReader.from_batches(schema, batches)


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
    """The rows `iter_rollouts` yields for the same arguments (a root's with its ``step``
    column) as one table (chunks kept), validated as a whole unless ``validate=False``; no
    row selected: no rows, the first file's schema. ``max_memory`` / ``batch_rows`` bound
    the pieces read, not the result.
    """
    wanted = check_steps(steps)
    if (ipc := _ipc(path, wanted, columns, layers, row_groups, validate)) is not None:
        return ipc
    every, files, names, groups = _selected(path, wanted, columns, layers, row_groups)
    first = every[0]
    where = first.path if isinstance(path, Sequence) and not isinstance(path, str) else Path(path)
    parts = list(
        iter_pieces(
            _refs(files),
            columns=names,
            layers=layers,
            max_memory=max_memory,
            batch_rows=batch_rows,
            validate=False,
            check=validate,
            row_groups=groups,
        )
    )
    if not parts:  # no selected step is present
        parts = [empty_piece(_refs([first])[0], names, layers, False)]
    table = parts[0] if len(parts) == 1 else concat(parts, where)
    if not validate:
        return table
    with reading(where):
        return check_table(table, table_spec(table), projected=names is not None)
