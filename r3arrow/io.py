"""Persistence: rollout tables to Parquet (and Arrow IPC), exact and atomic.

Parquet stores nested ``fixed_size_list`` ids value by value with levels (slow,
~4x larger), so routes are written as ``large_list<fixed_size_binary(L*K*itemsize)>``
(one opaque little-endian value per token) and restored to the nested type on
read without copying. The spec travels in the file metadata. Writes go to a
temporary file in the destination directory and are renamed into place.
A directory of ``step=N/`` partitions reads as one table (with a ``step`` column).
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from r3arrow.errors import SchemaError
from r3arrow.spec import SPEC_METADATA_KEY, RouteSpec, routes_to_numpy
from r3arrow.table import validate_rollouts

_STORAGE_KEY = b"r3arrow.routes_storage"
_STORAGE_FORMAT = "fixed_size_binary/little-endian"
_STEP_DIR = re.compile(r"^step=(\d+)$")
PathLike = str | os.PathLike[str]

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError(
        "r3arrow.io stores routes as little-endian bytes; big-endian hosts are unsupported"
    )


# --------------------------------------------------------- storage conversion
def _storage_routes(col: pa.Array, spec: RouteSpec) -> pa.LargeListArray:
    """``large_list<per-token nested>`` → ``large_list<fixed_size_binary>``, zero-copy when contiguous."""
    offsets = np.asarray(col.offsets, dtype=np.int64)
    values = np.ascontiguousarray(routes_to_numpy(col.flatten(), spec))
    binary = pa.Array.from_buffers(
        pa.binary(spec.row_nbytes), values.shape[0], [None, pa.py_buffer(values)]
    )
    return pa.LargeListArray.from_arrays(pa.array(offsets - offsets[0]), binary)


def _nested_routes(col: pa.Array, spec: RouteSpec) -> pa.LargeListArray:
    """``large_list<fixed_size_binary>`` → ``large_list<per-token nested>``, zero-copy."""
    binary = col.values
    width = binary.type.byte_width if pa.types.is_fixed_size_binary(binary.type) else -1
    if width != spec.row_nbytes:
        raise SchemaError(
            f"routes storage: expected fixed_size_binary({spec.row_nbytes}) for {spec}, found {binary.type}"
        )
    buf = binary.buffers()[1]
    leaf = pa.Array.from_buffers(
        spec.arrow_value_type,
        len(binary) * spec.num_layers * spec.topk,
        [None, buf],
        offset=binary.offset * spec.num_layers * spec.topk,
    )
    tokens = pa.FixedSizeListArray.from_arrays(
        pa.FixedSizeListArray.from_arrays(leaf, spec.topk), spec.num_layers
    )
    return pa.LargeListArray.from_arrays(col.offsets, tokens)


def _map_columns(
    table: pa.Table,
    names: list[str],
    fn: Callable[[pa.Array, RouteSpec], pa.Array],
    spec: RouteSpec,
    typ: pa.DataType,
) -> pa.Table:
    for name in names:
        idx = table.schema.get_field_index(name)
        if idx < 0:  # projected away
            continue
        col = pa.chunked_array([fn(c, spec) for c in table.column(idx).chunks], type=typ)
        table = table.set_column(idx, table.schema.field(idx).with_type(typ), col)
    return table


def to_storage(table: pa.Table) -> pa.Table:
    """The table with every routes-typed column (``routes`` and e.g. trainer routes) as
    ``large_list<fixed_size_binary>``, what Parquet stores; the column names go in the metadata."""
    spec = RouteSpec.from_schema(table.schema)
    names = [f.name for f in table.schema if f.type == spec.routes_type]
    out = _map_columns(
        table, names, _storage_routes, spec, pa.large_list(pa.binary(spec.row_nbytes))
    )
    meta = {
        **(table.schema.metadata or {}),
        _STORAGE_KEY: orjson.dumps({"format": _STORAGE_FORMAT, "columns": names}),
    }
    return out.replace_schema_metadata(meta)


def from_storage(table: pa.Table) -> pa.Table:
    """Restore nested routes columns from their storage form (spec from schema metadata); zero-copy."""
    spec = RouteSpec.from_schema(table.schema)
    meta = dict(table.schema.metadata or {})
    raw = meta.pop(_STORAGE_KEY, None)
    if raw is None:
        return table
    try:
        info = orjson.loads(raw)
        names = [str(n) for n in info["columns"]]
        fmt = info["format"]
    except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
        raise SchemaError(
            f"routes storage metadata: expected {{format, columns}} JSON, found {raw!r:.120}"
        ) from exc
    if fmt != _STORAGE_FORMAT:
        raise SchemaError(f"routes storage: expected format {_STORAGE_FORMAT!r}, found {fmt!r}")
    for name in names:
        if name in table.schema.names and not pa.types.is_large_list(table.schema.field(name).type):
            raise SchemaError(
                f"{name} storage: expected large_list, found {table.schema.field(name).type}"
            )
    out = _map_columns(table, names, _nested_routes, spec, spec.routes_type)
    return out.replace_schema_metadata(meta)


# ------------------------------------------------------------------ atomicity
def _claim_next_part(tmp: Path, directory: Path) -> Path:
    """Hard-link ``tmp`` to the first free ``part-NNNNN.parquet`` (never replaces another writer's part)."""
    n = len(list(directory.glob("part-*.parquet")))
    while True:
        target = directory / f"part-{n:05d}.parquet"
        try:
            os.link(tmp, target)
            return target
        except FileExistsError:
            n += 1


@contextlib.contextmanager
def _atomic_path(dest: Path, *, new_part: bool = False) -> Iterator[list[Path]]:
    """Yield ``[tmp]`` beside ``dest``; on success move it into place and append the final path.

    ``new_part``: ``dest`` is a directory and the file becomes its next free part.
    On failure the temp file is removed and the destination is untouched.
    """
    directory = dest if new_part else dest.parent
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{dest.name}.tmp-{uuid.uuid4().hex}"
    paths = [tmp]
    try:
        yield paths
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        if new_part:
            paths.append(_claim_next_part(tmp, directory))
        else:
            os.replace(tmp, dest)
            paths.append(dest)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


# --------------------------------------------------------------------- Parquet
def write_rollouts(
    table: pa.Table,
    path: PathLike,
    *,
    step: int | None = None,
    compression: str | None = "none",
    compression_level: int | None = None,
    row_group_rows: int | None = None,
) -> Path:
    """Validate and write a rollout table to Parquet atomically; return the file written.

    With ``step=N``, ``path`` is a root directory and the file goes to
    ``path/step=N/part-XXXXX.parquet`` (a new part each call). ``compression``
    is any Parquet codec ("none", "zstd", "lz4", "snappy").
    """
    validate_rollouts(table)
    dest = Path(path)
    if step is not None:
        if int(step) < 0:
            raise ValueError(f"step: expected >= 0, found {step}")
        dest = dest / f"step={int(step)}"
    storage = to_storage(table)
    no_dict = [n for n in storage.schema.names if n != "routes"]
    with _atomic_path(dest, new_part=step is not None) as paths:
        pq.write_table(
            storage,
            paths[0],
            compression=compression,
            compression_level=compression_level,
            use_dictionary=no_dict,
            write_statistics=no_dict,
            row_group_size=row_group_rows,
            data_page_size=8 << 20,
            use_compliant_nested_type=False,  # keep list child names ("item"): exact round trip
        )
    return paths[-1]


def _open_error(path: Path, exc: BaseException) -> SchemaError:
    return SchemaError(
        f"{path}: expected an r3arrow rollout Parquet file, found an unreadable file ({exc})"
    )


def _check_rollout_schema(schema: pa.Schema, path: Path) -> RouteSpec:
    if SPEC_METADATA_KEY not in (schema.metadata or {}):
        raise SchemaError(
            f"{path}: expected an r3arrow rollout file (metadata key {SPEC_METADATA_KEY.decode()!r}), "
            f"found a file without it (columns {schema.names})"
        )
    try:
        return RouteSpec.from_schema(schema)
    except SchemaError as exc:
        raise SchemaError(f"{path}: {exc}") from exc


def _restore(table: pa.Table, path: Path) -> pa.Table:
    try:
        return from_storage(table)
    except SchemaError as exc:
        raise SchemaError(f"{path}: {exc}") from exc


def _step_files(root: Path) -> list[Path]:
    """Part files of a step directory, in numeric step order then part order."""
    return [
        f for s in list_steps(root) for f in sorted((root / f"step={s}").glob("part-*.parquet"))
    ]


def list_steps(root: PathLike) -> list[int]:
    """Steps present under a ``step=N`` partitioned directory, ascending."""
    out = []
    for child in Path(root).iterdir():
        m = _STEP_DIR.match(child.name)
        if m and child.is_dir():
            out.append(int(m.group(1)))
    return sorted(out)


def read_rollouts_dataset(path: PathLike) -> ds.Dataset:
    """A `pyarrow.dataset.Dataset` over a file or step directory (storage types, lazy)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such rollout file or directory")
    try:
        if p.is_dir():
            return ds.dataset(
                [str(f) for f in _step_files(p)],
                format="parquet",
                partition_base_dir=str(p),
                partitioning=ds.partitioning(pa.schema([("step", pa.int64())]), flavor="hive"),
            )
        return ds.dataset(p, format="parquet")
    except (pa.ArrowInvalid, OSError) as exc:
        raise _open_error(p, exc) from exc


def read_rollouts(
    path: PathLike,
    *,
    columns: Sequence[str] | None = None,
    steps: Sequence[int] | None = None,
) -> pa.Table:
    """Read a rollout Parquet file or ``step=N`` directory; routes restored, spec kept.

    A directory reads in step order and adds an int64 ``step`` column (kept under
    ``columns`` only if listed); ``steps`` selects partitions. Every file must
    carry the same spec. Raises `SchemaError` on a corrupt or foreign file.
    """
    p = Path(path)
    if p.is_dir():
        dataset = read_rollouts_dataset(p)
        files = [Path(f) for f in dataset.files]
        if not files:
            raise SchemaError(f"{p}: expected step=N/*.parquet rollout files, found none")
        first: pa.Schema | None = None
        for f in files:
            try:
                schema = pq.read_schema(f)
            except (pa.ArrowInvalid, OSError) as exc:
                raise _open_error(f, exc) from exc
            spec = _check_rollout_schema(schema, f)
            if first is None:
                first, first_spec = schema, spec
            elif spec != first_spec:
                raise SchemaError(
                    f"{f}: expected the spec of {files[0]} ({first_spec}), found {spec}"
                )
        assert first is not None
        filt = ds.field("step").isin([int(s) for s in steps]) if steps is not None else None
        try:
            table = dataset.to_table(
                columns=list(columns) if columns is not None else None, filter=filt
            )
        except (pa.ArrowInvalid, pa.ArrowTypeError, OSError) as exc:
            raise SchemaError(
                f"{p}: step files do not share one rollout schema/spec ({exc})"
            ) from exc
        return _restore(table.replace_schema_metadata(first.metadata), p)
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such rollout file or directory")
    try:
        pf = pq.ParquetFile(p)
        _check_rollout_schema(pf.schema_arrow, p)
        table = pf.read(columns=list(columns) if columns is not None else None)
    except (pa.ArrowInvalid, OSError) as exc:
        raise _open_error(p, exc) from exc
    return _restore(table, p)


def iter_rollouts(
    path: PathLike,
    *,
    columns: Sequence[str] | None = None,
    steps: Sequence[int] | None = None,
    batch_rows: int | None = None,
) -> Iterator[tuple[int | None, pa.Table]]:
    """Yield ``(step, table)`` one step at a time (a file: ``(None, batch)`` per ``batch_rows``)."""
    p = Path(path)
    if p.is_dir():
        for s in list_steps(p):
            if steps is None or s in steps:
                yield s, read_rollouts(p, columns=columns, steps=[s])
        return
    if batch_rows is None:
        yield None, read_rollouts(p, columns=columns)
        return
    try:
        pf = pq.ParquetFile(p)
        schema = pf.schema_arrow
        _check_rollout_schema(schema, p)
        for batch in pf.iter_batches(
            batch_size=batch_rows, columns=list(columns) if columns else None
        ):
            t = pa.Table.from_batches([batch]).replace_schema_metadata(schema.metadata)
            yield None, _restore(t, p)
    except (pa.ArrowInvalid, OSError) as exc:
        raise _open_error(p, exc) from exc


def scan_rollouts(path: PathLike, **kwargs: Any) -> Iterator[pa.Table]:
    """Tables from `iter_rollouts`, without the step key."""
    for _, table in iter_rollouts(path, **kwargs):
        yield table


# ------------------------------------------------------------------- Arrow IPC
def write_ipc(table: pa.Table, path: PathLike) -> Path:
    """Write a rollout table as an uncompressed Arrow IPC (Feather v2) file, atomically."""
    validate_rollouts(table)
    with (
        _atomic_path(Path(path)) as paths,
        pa.OSFile(str(paths[0]), "wb") as sink,
        pa.ipc.new_file(sink, table.schema) as writer,
    ):
        writer.write_table(table)
    return paths[-1]


def read_ipc(path: PathLike, *, memory_map: bool = True) -> pa.Table:
    """Read an IPC rollout file; memory-mapped (zero-copy, lazy paging) by default."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such file")
    try:
        source = pa.memory_map(str(p)) if memory_map else pa.OSFile(str(p))
        table = pa.ipc.open_file(source).read_all()
    except (pa.ArrowInvalid, OSError) as exc:
        raise SchemaError(
            f"{p}: expected an r3arrow Arrow IPC rollout file, found an unreadable file ({exc})"
        ) from exc
    _check_rollout_schema(table.schema, p)
    return table


__all__ = [
    "from_storage",
    "iter_rollouts",
    "list_steps",
    "read_ipc",
    "read_rollouts",
    "read_rollouts_dataset",
    "scan_rollouts",
    "to_storage",
    "write_ipc",
    "write_rollouts",
]
