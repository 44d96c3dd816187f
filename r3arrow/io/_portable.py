"""Portable routes storage, ``nested_list/v1``: nested integer lists generic tools read
(``docs/portable.md``), restored zero-copy. A leaf format like `r3arrow.io._groups`."""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import orjson
import pyarrow as pa

from r3arrow.errors import SchemaError
from r3arrow.io._project import STORAGE_KEY, relist, set_columns
from r3arrow.spec import RouteSpec, routes_to_numpy

PORTABLE_FORMAT = "nested_list/v1"


def portable_type(spec: RouteSpec) -> pa.DataType:
    """The portable type of a routes column: ``large_list<list<list<dtype>>>``."""
    return pa.large_list(pa.list_(pa.list_(spec.arrow_value_type)))


def is_portable_type(token_type: pa.DataType) -> bool:
    """Whether a per-token type is the portable ``list<list<...>>`` form."""
    return pa.types.is_list(token_type) and pa.types.is_list(token_type.value_type)


def _lists(values: pa.Array[Any], n: int, size: int) -> pa.Array[Any]:
    """``values`` as ``n`` lists of ``size`` each."""
    offsets = pa.array(np.arange(0, (n + 1) * size, size, dtype=np.int32))
    return pa.ListArray.from_arrays(cast("pa.Int32Array", offsets), values)


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
    """Per-token ``list<list<dtype>>`` values as the nested ``fixed_size_list`` type,
    zero-copy; `SchemaError` unless each token has ``L`` lists of ``K`` non-null ids."""
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


def to_portable(table: pa.Table) -> pa.Table:
    """Every routes-typed column as ``large_list<list<list<dtype>>>``, `STORAGE_KEY`
    recorded; `SchemaError` without a spec."""
    spec = RouteSpec.from_schema(table.schema)

    def nest(chunk: pa.Array[Any], name: str) -> pa.Array[Any]:
        lists = cast("pa.LargeListArray[Any]", chunk)
        rows = np.ascontiguousarray(routes_to_numpy(lists.flatten(), spec))  # [T, L, K] view
        t = rows.shape[0]
        inner = _lists(pa.array(rows.reshape(-1)), t * spec.num_layers, spec.topk)
        return relist(chunk, _lists(inner, t, spec.num_layers))

    names = [f.name for f in table.schema if f.type == spec.routes_type]
    info = {"format": PORTABLE_FORMAT, "columns": names}
    meta = {**(table.schema.metadata or {}), STORAGE_KEY: orjson.dumps(info)}
    return set_columns(table, names, nest, portable_type(spec), meta)


def from_portable(table: pa.Table, names: list[str]) -> pa.Table:
    """The portable columns ``names`` (those present) restored to the nested routes type;
    `SchemaError` naming a column that is not `portable_type`."""
    spec = RouteSpec.from_schema(table.schema)
    for name in names:
        idx = table.schema.get_field_index(name)
        typ = table.schema.field(idx).type if idx >= 0 else None
        if typ is not None and not (
            pa.types.is_large_list(typ) and is_portable_type(typ.value_type)
        ):
            raise SchemaError(
                f"column {name!r}: expected portable routes {portable_type(spec)}, found {typ}"
            )

    def restore(chunk: pa.Array[Any], name: str) -> pa.Array[Any]:
        values = cast("pa.LargeListArray[Any]", chunk).flatten()
        return relist(chunk, portable_tokens(values, spec, name))

    return set_columns(table, names, restore, spec.routes_type)
