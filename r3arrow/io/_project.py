"""Routes helpers every storage format shares: the storage metadata and layer projection.

Parquet stores routes-typed columns in a storage form (layer groups, `r3arrow.io._groups`,
or portable nested lists, `r3arrow.io._portable`); which one, and which columns, is
recorded under the schema metadata key ``r3arrow.routes_storage`` (`STORAGE_KEY`,
``{"format", "columns"[, "groups"]}`` JSON, parsed by `storage_info`). Layer projection
(``docs/storage.md``): a projected table holds only some layers (ascending global ids) as
the normal nested routes type, a `RouteSpec` of that shape and the global ids under
``r3arrow.route_layers`` (`r3arrow.table.route_layers`); `project_layers` projects an
in-memory table. Routes are stored as little-endian bytes: big-endian hosts are refused.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import orjson
import pyarrow as pa

from r3arrow._checks import check_int
from r3arrow._schema import ROUTE_LAYERS_KEY
from r3arrow.errors import RouteShapeError, SchemaError
from r3arrow.spec import SPEC_METADATA_KEY, RouteSpec, routes_to_numpy
from r3arrow.table import route_layers

#: Schema metadata key of the routes storage form (``{"format", "columns"[, "groups"]}``).
STORAGE_KEY = b"r3arrow.routes_storage"

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError(
        "r3arrow.io stores routes as little-endian bytes; big-endian hosts are unsupported"
    )


def storage_info(meta: dict[bytes, bytes] | None) -> dict[str, Any] | None:
    """The parsed ``r3arrow.routes_storage`` metadata (``None`` without it).

    Raises `SchemaError` if it is not ``{format, columns[, groups]}`` JSON.
    """
    raw = (meta or {}).get(STORAGE_KEY)
    if raw is None:
        return None
    try:
        info = orjson.loads(raw)
        names = [str(n) for n in info["columns"]]
        fmt = str(info["format"])
        groups = info.get("groups")
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise SchemaError(
            f"routes storage metadata: expected {{format, columns}} JSON, found {raw!r:.120}"
        ) from exc
    return {"format": fmt, "columns": names, "groups": groups}


def projected_spec(spec: RouteSpec, local: Sequence[int]) -> RouteSpec:
    """The spec of the route rows ``local`` (ascending indices into ``spec``'s layers).

    ``moe_layers`` become the local indices of the router layers kept (``None`` if
    all are). Raises ``ValueError`` if none of ``local`` is a router layer.
    """
    router = set(spec.router_layers)
    moe = [i for i, layer in enumerate(local) if layer in router]
    if not moe:
        raise ValueError(
            f"layers: expected at least one router layer of {list(spec.router_layers)}, "
            f"found only dense layers"
        )
    return RouteSpec(
        num_layers=len(local),
        topk=spec.topk,
        num_experts=spec.num_experts,
        moe_layers=tuple(moe),
        id_dtype=spec.id_dtype,
    )


def local_layers(schema: pa.Schema, layers: Sequence[int]) -> list[int]:
    """Indices into the table's route rows of the global ``layers`` (sorted, unique).

    Raises ``TypeError`` for a non-int or a non-sequence, ``ValueError`` for an
    empty list or a layer outside ``[0, num_layers)`` of a full table, and
    `RouteShapeError` naming the layers a projected table does not hold.
    """
    if isinstance(layers, str | bytes) or not isinstance(layers, Sequence | set | frozenset):
        raise TypeError(f"layers: expected a sequence of ints, found {type(layers).__name__}")
    wanted = sorted({check_int(i, "layers", minimum=0) for i in layers})
    if not wanted:
        raise ValueError("layers: expected at least one layer id, found none")
    present = route_layers(schema)
    index = {g: i for i, g in enumerate(present)}
    missing = [g for g in wanted if g not in index]
    if missing:
        meta = schema.metadata or {}
        if ROUTE_LAYERS_KEY not in meta:
            raise ValueError(f"layers: expected ids in [0, {len(present)}), found {missing}")
        raise RouteShapeError(
            f"expected layers {missing} in the routes, found a projected table with layers "
            f"{list(present)}"
        )
    return [index[g] for g in wanted]


def projected_meta(meta: dict[bytes, bytes], spec: RouteSpec, local: Sequence[int]) -> Any:
    present = route_layers(pa.schema([], metadata=cast("Any", meta)))
    out = dict(meta)
    out[SPEC_METADATA_KEY] = projected_spec(spec, local).to_json()
    out[ROUTE_LAYERS_KEY] = orjson.dumps([present[i] for i in local])
    return out


def wrap(data: Any, rows: int, spec: RouteSpec, num_layers: int, offset: int) -> pa.Array[Any]:
    """Per-token nested routes of ``num_layers`` layers over buffer ``data`` (zero-copy)."""
    per = num_layers * spec.topk
    leaf = pa.Array.from_buffers(
        spec.arrow_value_type, rows * per, [None, data], offset=offset * per
    )
    return pa.FixedSizeListArray.from_arrays(
        pa.FixedSizeListArray.from_arrays(leaf, spec.topk), num_layers
    )


def _project_nested(
    chunk: pa.Array[Any], spec: RouteSpec, local: Sequence[int], name: str
) -> pa.Array[Any]:
    """A restored ``large_list<nested>`` chunk's route rows ``local`` (one gather copy)."""
    lists = cast("pa.LargeListArray[Any]", chunk)
    rows = routes_to_numpy(lists.flatten(), spec)
    kept = np.ascontiguousarray(rows[:, np.asarray(local, dtype=np.int64)])
    offsets = np.asarray(lists.offsets, dtype=np.int64)
    tokens = wrap(pa.py_buffer(kept), kept.shape[0], spec, len(local), 0)  # type: ignore[arg-type]
    return pa.LargeListArray.from_arrays(pa.array(offsets - offsets[0]), tokens)


def set_columns(table: pa.Table, names: Sequence[str], fn: Any, typ: pa.DataType) -> pa.Table:
    """``table`` with each present column of ``names`` mapped by ``fn(chunk, name)`` to ``typ``."""
    for name in names:
        idx = table.schema.get_field_index(name)
        if idx < 0:  # projected away
            continue
        chunks = [fn(c, name) for c in table.column(idx).chunks]
        col = pa.chunked_array(chunks, type=typ)  # type: ignore[call-overload]  # any DataType
        table = table.set_column(idx, table.schema.field(idx).with_type(typ), col)
    return table


def project_layers(table: pa.Table, layers: Sequence[int]) -> pa.Table:
    """An in-memory rollout table with only the global ``layers`` in its routes columns.

    The result follows layer projection (``docs/storage.md``): routes-typed columns hold
    the wanted layers in ascending global order as the normal nested type with
    ``L' = len(set(layers))``; the schema metadata carries the projected spec and
    the global ids under ``r3arrow.route_layers``. One gather copy per chunk; chunks
    are never combined. Raises like `local_layers`, and `SchemaError` for a table
    without a spec.
    """
    spec = RouteSpec.from_schema(table.schema)
    local = local_layers(table.schema, layers)
    names = [f.name for f in table.schema if f.type == spec.routes_type]
    meta = projected_meta(dict(table.schema.metadata or {}), spec, local)
    new = projected_spec(spec, local)
    out = set_columns(
        table, names, lambda c, n: _project_nested(c, spec, local, n), new.routes_type
    )
    return out.replace_schema_metadata(meta)


__all__ = [
    "STORAGE_KEY",
    "local_layers",
    "project_layers",
    "projected_meta",
    "projected_spec",
    "set_columns",
    "storage_info",
    "wrap",
]
