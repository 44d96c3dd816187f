"""Routes storage: per-token ``fixed_size_binary`` on disk, the nested routes type in memory.

Writers now store layer groups (`r3arrow.io._groups`, ``docs/storage.md``); this
module keeps the single-value form of older files (`to_storage` still produces it)
and the entry points every format goes through (`from_storage`, `route_rows`).

Parquet stores a nested ``fixed_size_list`` value by value with repetition and
definition levels (slow, ~4x larger), so every routes-typed column is stored as
``large_list<fixed_size_binary(L*K*itemsize)>``: one opaque little-endian value
per token, whose bytes are exactly the token's ``[L, K]`` ids in the spec's
dtype. Restoring the nested type reinterprets the same buffer (zero-copy). The
names of the converted columns and the format tag travel in the schema metadata
under ``r3arrow.routes_storage`` (see ``docs/design.md``, "Persistence").

This module is the only place that knows the storage form: readers restore it
with :func:`from_storage`, and :func:`route_rows` reads a ragged routes column in
either form as a ``[T, L, K]`` numpy view.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any, cast

import numpy as np
import orjson
import pyarrow as pa

from r3arrow._typing import ArrowArray
from r3arrow.errors import SchemaError
from r3arrow.spec import RouteSpec, routes_to_numpy
from r3arrow.table import list_lengths

STORAGE_KEY = b"r3arrow.routes_storage"
STORAGE_FORMAT = "fixed_size_binary/little-endian"

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError(
        "r3arrow.io stores routes as little-endian bytes; big-endian hosts are unsupported"
    )


def storage_type(spec: RouteSpec) -> pa.DataType:
    """The stored type of a routes column: ``large_list<fixed_size_binary(spec.row_nbytes)>``."""
    return pa.large_list(pa.binary(spec.row_nbytes))


def decode_tokens(binary: pa.Array[Any], spec: RouteSpec, *, what: str = "routes") -> pa.Array[Any]:
    """Per-token ``fixed_size_binary(row_nbytes)`` values as the nested per-token type, zero-copy.

    ``binary`` may be a slice (its offset is honoured). Returns a
    ``fixed_size_list<fixed_size_list<dtype, K>, L>`` array of ``len(binary)``
    tokens over the same buffer. Raises `SchemaError` if the byte width is not
    the spec's ``row_nbytes``.
    """
    width = binary.type.byte_width if pa.types.is_fixed_size_binary(binary.type) else -1
    if width != spec.row_nbytes:
        raise SchemaError(
            f"{what} storage: expected fixed_size_binary({spec.row_nbytes}) for {spec}, "
            f"found {binary.type}"
        )
    per = spec.num_layers * spec.topk
    leaf = pa.Array.from_buffers(
        spec.arrow_value_type,
        len(binary) * per,
        [None, binary.buffers()[1]],
        offset=binary.offset * per,
    )
    return pa.FixedSizeListArray.from_arrays(
        pa.FixedSizeListArray.from_arrays(leaf, spec.topk), spec.num_layers
    )


def _encode(col: pa.Array[Any], spec: RouteSpec) -> pa.Array[Any]:
    """``large_list<nested>`` → ``large_list<fixed_size_binary>``, zero-copy when contiguous."""
    lists = cast("pa.LargeListArray[Any]", col)
    offsets = np.asarray(lists.offsets, dtype=np.int64)
    values = np.ascontiguousarray(routes_to_numpy(lists.flatten(), spec))
    binary = pa.Array.from_buffers(
        pa.binary(spec.row_nbytes),
        values.shape[0],
        [None, pa.py_buffer(values)],  # type: ignore[arg-type]  # stubs: ndarray is a buffer
    )
    return pa.LargeListArray.from_arrays(pa.array(offsets - offsets[0]), binary)


def _decode(col: pa.Array[Any], spec: RouteSpec) -> pa.Array[Any]:
    """``large_list<fixed_size_binary>`` → ``large_list<per-token nested>``, zero-copy."""
    lists = cast("pa.LargeListArray[Any]", col)
    return pa.LargeListArray.from_arrays(lists.offsets, decode_tokens(lists.values, spec))


def _map_columns(
    table: pa.Table,
    names: list[str],
    fn: Callable[[pa.Array[Any], RouteSpec], pa.Array[Any]],
    spec: RouteSpec,
    typ: pa.DataType,
) -> pa.Table:
    for name in names:
        idx = table.schema.get_field_index(name)
        if idx < 0:  # projected away
            continue
        chunks = [fn(c, spec) for c in table.column(idx).chunks]
        col = pa.chunked_array(chunks, type=typ)  # type: ignore[call-overload]  # any DataType
        table = table.set_column(idx, table.schema.field(idx).with_type(typ), col)
    return table


def to_storage(table: pa.Table) -> pa.Table:
    """The table with every routes-typed column as ``large_list<fixed_size_binary>``.

    That is what Parquet stores (``routes`` and e.g. a trainer-routes column of
    the same type); the converted column names go in the schema metadata. The
    spec comes from the schema metadata (`SchemaError` without it).
    """
    spec = RouteSpec.from_schema(table.schema)
    names = [f.name for f in table.schema if f.type == spec.routes_type]
    out = _map_columns(table, names, _encode, spec, storage_type(spec))
    meta = {
        **(table.schema.metadata or {}),
        STORAGE_KEY: orjson.dumps({"format": STORAGE_FORMAT, "columns": names}),
    }
    return out.replace_schema_metadata(meta)


def from_storage(table: pa.Table) -> pa.Table:
    """Restore nested routes columns from their storage form (spec from schema metadata); zero-copy.

    The storage form is the layer-group one (`r3arrow.io._groups`, format
    ``layer_groups/v1``, what writers store), the older single
    ``fixed_size_binary`` one, or the portable nested-list one
    (`r3arrow.io._portable`, format ``nested_list/v1``); all come back as the
    exact nested ``fixed_size_list`` type (zero-copy but for the one interleave
    copy of several layer groups). A table without the
    storage metadata is returned unchanged. Raises `SchemaError` if the metadata
    is malformed or a column does not have the stored type of the spec.
    """
    spec = RouteSpec.from_schema(table.schema)
    meta = dict(table.schema.metadata or {})
    raw = meta.pop(STORAGE_KEY, None)
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
    from r3arrow.io._groups import GROUP_FORMAT, restore  # they import this module
    from r3arrow.io._portable import PORTABLE_FORMAT, from_portable

    if fmt == GROUP_FORMAT:
        return restore(table)
    if fmt == PORTABLE_FORMAT:
        return from_portable(table, names).replace_schema_metadata(meta)
    if fmt != STORAGE_FORMAT:
        raise SchemaError(
            f"routes storage: expected format {STORAGE_FORMAT!r} or {PORTABLE_FORMAT!r}, "
            f"found {fmt!r}"
        )
    for name in names:
        if name in table.schema.names and not pa.types.is_large_list(table.schema.field(name).type):
            raise SchemaError(
                f"{name} storage: expected large_list, found {table.schema.field(name).type}"
            )
    out = _map_columns(table, names, _decode, spec, spec.routes_type)
    return out.replace_schema_metadata(meta)


def route_rows(col: ArrowArray, spec: RouteSpec, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(rows ``[T, L, K]``, lengths int64 ``[B]``) of a ragged routes column, nested or stored form.

    ``col`` is a ``list`` / ``large_list`` of per-token routes (the nested type,
    the portable ``list<list<dtype>>`` form, or a storage form when read without
    :func:`from_storage`: ``fixed_size_binary`` or a struct of every layer group).
    The rows are a view of the column's buffer when it has one chunk and one group
    (several chunks are combined first; several groups interleaved by one copy).
    Raises `SchemaError` naming column ``name`` if it is not such a column.
    """
    arr: pa.Array[Any]
    if isinstance(col, pa.ChunkedArray):
        arr = cast("pa.Array[Any]", col.combine_chunks() if col.num_chunks != 1 else col.chunk(0))
    else:
        arr = col
    if not (pa.types.is_large_list(arr.type) or pa.types.is_list(arr.type)):
        raise SchemaError(
            f"column {name!r}: expected a large_list of per-token routes, found {arr.type}"
        )
    values = cast("pa.LargeListArray[Any]", arr).flatten()
    if pa.types.is_fixed_size_binary(values.type):
        values = decode_tokens(values, spec, what=f"column {name!r}")
    elif pa.types.is_struct(values.type):  # layer-group storage
        from r3arrow.io._groups import token_rows

        return token_rows(values, spec, name), list_lengths(arr)
    else:
        from r3arrow.io._portable import is_portable_type, portable_tokens

        if is_portable_type(values.type):
            values = portable_tokens(values, spec, name)
    return routes_to_numpy(values, spec), list_lengths(arr)


__all__ = [
    "STORAGE_FORMAT",
    "STORAGE_KEY",
    "decode_tokens",
    "from_storage",
    "route_rows",
    "storage_type",
    "to_storage",
]
