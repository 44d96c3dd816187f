"""Portable routes storage: plain nested integer lists that generic tools read as numbers.

The default storage form (layer groups, `r3arrow.io._groups`) is opaque
``fixed_size_binary`` values: fast and compact, but pandas, Polars, DuckDB and
Hugging Face ``datasets`` see bytes, not expert ids. A portable file
stores every routes-typed column as

    ``large_list<list<list<dtype>>>``  (trajectory -> token -> layer -> top-k ids)

with the spec's id dtype (uint8, uint16 or int32), which every one of those tools
reads as integers (``docs/portable.md`` has the per-tool recipe and the
measured costs). The schema metadata key ``r3arrow.routes_storage`` records the
format ``nested_list/v1`` and the converted columns, so `from_portable` restores
the exact nested ``fixed_size_list`` type on read (zero-copy: the leaf values
buffer is reused, only the list lengths are checked).

Both conversions are vectorised: offsets are built with ``numpy.arange`` and
the id buffer is shared, never copied per token. A leaf format: it imports no other
format and not the dispatcher (`r3arrow.io._storage`).
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import orjson
import pyarrow as pa

from r3arrow.errors import SchemaError
from r3arrow.io._project import STORAGE_KEY
from r3arrow.spec import RouteSpec, routes_to_numpy

PORTABLE_FORMAT = "nested_list/v1"


def portable_type(spec: RouteSpec) -> pa.DataType:
    """The portable type of a routes column: ``large_list<list<list<dtype>>>``."""
    return pa.large_list(pa.list_(pa.list_(spec.arrow_value_type)))


def is_portable_type(token_type: pa.DataType) -> bool:
    """Whether a per-token type is the portable ``list<list<...>>`` form."""
    return pa.types.is_list(token_type) and pa.types.is_list(token_type.value_type)


def _offsets(n: int, step: int) -> pa.Int32Array:
    """``[0, step, 2*step, ... n*step]`` as int32 list offsets."""
    return cast("pa.Int32Array", pa.array(np.arange(0, (n + 1) * step, step, dtype=np.int32)))


def _to_nested(col: pa.Array[Any], spec: RouteSpec) -> pa.Array[Any]:
    """``large_list<fixed_size_list<fixed_size_list>>`` → ``large_list<list<list>>``."""
    lists = cast("pa.LargeListArray[Any]", col)
    offsets = np.asarray(lists.offsets, dtype=np.int64)
    rows = np.ascontiguousarray(routes_to_numpy(lists.flatten(), spec))  # [T, L, K] view
    t = rows.shape[0]
    leaf = pa.array(rows.reshape(-1))
    inner = pa.ListArray.from_arrays(_offsets(t * spec.num_layers, spec.topk), leaf)
    middle = pa.ListArray.from_arrays(_offsets(t, spec.num_layers), inner)
    return pa.LargeListArray.from_arrays(pa.array(offsets - offsets[0]), middle)


def _check_lengths(arr: pa.Array[Any], n: int, size: int, what: str) -> None:
    """Every list of ``arr`` (a ``list`` array without nulls) has length ``size``."""
    if arr.null_count:
        raise SchemaError(f"{what}: expected no null lists, found {arr.null_count}")
    offs = np.asarray(cast("pa.ListArray[Any]", arr).offsets, dtype=np.int64)
    if offs.size != n + 1 or np.any(np.diff(offs) != size):
        bad = np.flatnonzero(np.diff(offs) != size)
        found = int(np.diff(offs)[bad[0]]) if bad.size else -1
        raise SchemaError(f"{what}: expected lists of {size} values, found one of {found}")


def portable_tokens(middle: pa.Array[Any], spec: RouteSpec, name: str) -> pa.Array[Any]:
    """Per-token ``list<list<dtype>>`` values as the nested per-token ``fixed_size_list`` type.

    Zero-copy over the leaf buffer; `SchemaError` naming column ``name`` if a
    token does not have ``num_layers`` lists of ``topk`` non-null ids of the
    spec's dtype.
    """
    t = len(middle)
    _check_lengths(middle, t, spec.num_layers, f"column {name!r} (layers per token)")
    inner = cast("pa.ListArray[Any]", middle).flatten()
    _check_lengths(inner, t * spec.num_layers, spec.topk, f"column {name!r} (ids per layer)")
    leaf = cast("pa.ListArray[Any]", inner).flatten()
    if leaf.type != spec.arrow_value_type or leaf.null_count:
        raise SchemaError(
            f"column {name!r}: expected non-null {spec.arrow_value_type} expert ids, "
            f"found {leaf.type} with {leaf.null_count} nulls"
        )
    return pa.FixedSizeListArray.from_arrays(
        pa.FixedSizeListArray.from_arrays(leaf, spec.topk), spec.num_layers
    )


def _from_nested(col: pa.Array[Any], spec: RouteSpec, name: str) -> pa.Array[Any]:
    """``large_list<list<list<dtype>>>`` → ``large_list`` of the nested routes type."""
    lists = cast("pa.LargeListArray[Any]", col)
    tokens = portable_tokens(lists.flatten(), spec, name)
    offsets = np.asarray(lists.offsets, dtype=np.int64)
    return pa.LargeListArray.from_arrays(pa.array(offsets - offsets[0]), tokens)


def _routes_columns(table: pa.Table, spec: RouteSpec) -> list[str]:
    return [f.name for f in table.schema if f.type == spec.routes_type]


def to_portable(table: pa.Table) -> pa.Table:
    """The table with every routes-typed column as ``large_list<list<list<dtype>>>``.

    The input has the in-memory routes type (``large_list`` of the spec's nested
    ``fixed_size_list``) and the spec in its schema metadata (`SchemaError`
    without it). The result carries ``r3arrow.routes_storage`` =
    ``{"format": "nested_list/v1", "columns": [...]}`` so every r3arrow reader
    restores the exact type (`from_portable`). Other columns are unchanged.
    """
    spec = RouteSpec.from_schema(table.schema)
    names = _routes_columns(table, spec)
    typ = portable_type(spec)
    for name in names:
        idx = table.schema.get_field_index(name)
        chunks = [_to_nested(c, spec) for c in table.column(idx).chunks]
        col = pa.chunked_array(chunks, type=typ)  # type: ignore[call-overload]  # any DataType
        table = table.set_column(idx, table.schema.field(idx).with_type(typ), col)
    meta = {
        **(table.schema.metadata or {}),
        STORAGE_KEY: orjson.dumps({"format": PORTABLE_FORMAT, "columns": names}),
    }
    return table.replace_schema_metadata(meta)


def from_portable(table: pa.Table, names: list[str]) -> pa.Table:
    """Restore the portable columns ``names`` (those present) to the nested routes type.

    Called by the dispatcher (`r3arrow.io._storage.restore`) for the ``nested_list/v1``
    format (the storage key is left for it to drop). Raises `SchemaError` naming the
    column if a column is not ``large_list<list<list<dtype>>>`` of the spec's shape and dtype.
    """
    spec = RouteSpec.from_schema(table.schema)
    for name in names:
        idx = table.schema.get_field_index(name)
        if idx < 0:  # projected away
            continue
        typ = table.schema.field(idx).type
        if not (pa.types.is_large_list(typ) and is_portable_type(typ.value_type)):
            raise SchemaError(
                f"column {name!r}: expected portable routes {portable_type(spec)}, found {typ}"
            )
        chunks = [_from_nested(c, spec, name) for c in table.column(idx).chunks]
        col = pa.chunked_array(chunks, type=spec.routes_type)  # type: ignore[call-overload]
        table = table.set_column(idx, table.schema.field(idx).with_type(spec.routes_type), col)
    return table


__all__ = [
    "PORTABLE_FORMAT",
    "from_portable",
    "is_portable_type",
    "portable_tokens",
    "portable_type",
    "to_portable",
]
