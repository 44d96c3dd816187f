"""What the storage formats share: the storage metadata (`STORAGE_KEY`) and layer projection
(``docs/storage.md``, "Layer projection"). Big-endian hosts are refused."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from typing import Any, cast

import numpy as np
import orjson
import pyarrow as pa

from r3arrow._checks import check_int
from r3arrow._schema import ROUTE_LAYERS_KEY
from r3arrow.errors import RouteShapeError, SchemaError
from r3arrow.spec import SPEC_METADATA_KEY, RouteSpec, routes_to_numpy
from r3arrow.table import route_layers

STORAGE_KEY = b"r3arrow.routes_storage"

if sys.byteorder != "little":  # pragma: no cover - every supported platform is little-endian
    raise ImportError(
        "r3arrow.io stores routes as little-endian bytes; big-endian hosts are unsupported"
    )


def storage_info(meta: dict[bytes, bytes] | None) -> dict[str, Any] | None:
    """The parsed `STORAGE_KEY` metadata (``None`` without it); `SchemaError` if malformed."""
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
    """The spec of route rows ``local`` (ascending indices into ``spec``'s layers);
    ``ValueError`` if none is a router layer."""
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
    """Indices into the route rows of the global ``layers`` (sorted, unique): ``TypeError`` for
    non-ints, ``ValueError`` for none or one outside a full table, `RouteShapeError` for one a
    projected table lacks.
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
        if ROUTE_LAYERS_KEY not in (schema.metadata or {}):
            raise ValueError(f"layers: expected ids in [0, {len(present)}), found {missing}")
        raise RouteShapeError(
            f"expected layers {missing} in the routes, found a projected table with layers "
            f"{list(present)}"
        )
    return [index[g] for g in wanted]


def projected_meta(meta: dict[bytes, bytes], spec: RouteSpec, local: Sequence[int]) -> Any:
    """``meta`` with the spec and global layer ids of route rows ``local``."""
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


def relist(
    lists: pa.Array[Any], values: pa.Array[Any], typ: pa.DataType | None = None
) -> pa.Array[Any]:
    """``values`` under the offsets of the ``large_list`` chunk ``lists`` (rebased to 0)."""
    offsets = np.asarray(cast("pa.LargeListArray[Any]", lists).offsets, dtype=np.int64)
    return pa.LargeListArray.from_arrays(pa.array(offsets - offsets[0]), values, type=typ)


def set_columns(
    table: pa.Table,
    names: Sequence[str],
    fn: Callable[[pa.Array[Any], str], pa.Array[Any]],
    typ: pa.DataType,
    meta: Any = None,
) -> pa.Table:
    """Each present column of ``names`` mapped chunk by chunk by ``fn(chunk, name)`` to
    ``typ``; ``meta``: the result's schema metadata (default: kept)."""
    for name in names:
        idx = table.schema.get_field_index(name)
        if idx < 0:  # projected away
            continue
        chunks = [fn(c, name) for c in table.column(idx).chunks]
        col = pa.chunked_array(chunks, type=typ)  # type: ignore[call-overload]  # any DataType
        table = table.set_column(idx, table.schema.field(idx).with_type(typ), col)
    return table if meta is None else table.replace_schema_metadata(meta)


def project_layers(table: pa.Table, layers: Sequence[int]) -> pa.Table:
    """An in-memory rollout table with only the global ``layers`` in its routes columns
    (``docs/storage.md``, "Layer projection"; one gather copy per chunk). Raises like
    `local_layers`, `SchemaError` without a spec."""
    spec = RouteSpec.from_schema(table.schema)
    local = local_layers(table.schema, layers)
    index = np.asarray(local, dtype=np.int64)

    def gather(chunk: pa.Array[Any], name: str) -> pa.Array[Any]:
        rows = routes_to_numpy(cast("pa.LargeListArray[Any]", chunk).flatten(), spec)
        kept = np.ascontiguousarray(rows[:, index])
        buf = pa.py_buffer(kept)  # type: ignore[arg-type]  # ndarray is a buffer
        return relist(chunk, wrap(buf, kept.shape[0], spec, len(local), 0))

    names = [f.name for f in table.schema if f.type == spec.routes_type]
    meta = projected_meta(dict(table.schema.metadata or {}), spec, local)
    return set_columns(table, names, gather, projected_spec(spec, local).routes_type, meta)
