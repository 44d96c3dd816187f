"""Layer-group routes storage and layer projection (``docs/storage.md``).

A routes-typed column is stored as

    ``large_list<item: struct<l0_6: fixed_size_binary(6*K*itemsize), l6_12: ..., ...>>``

(format ``layer_groups/v1``): one struct field per group of consecutive layers, each
field the little-endian ``[layers, K]`` ids of that group for one token. Parquet keeps
every struct field in its own column chunk, so a reader that needs some layers (a
pipeline stage, a per-layer analysis) reads only the chunks of the groups that hold
them. Field ``l{a}_{b}`` holds the file's route rows ``a`` to ``b - 1`` (half-open); the
groups partition ``[0, num_layers)`` in order and are also recorded in the
``r3arrow.routes_storage`` metadata (``{"format", "columns", "groups"}``), sealed by the
metadata SHA-256 (`r3arrow.io._verify`), and the reader checks the two agree.

Restoring gives the normal in-memory type ``large_list<fixed_size_list<fixed_size_list<
dtype, K>, L>>``: zero-copy when one group is wanted whole, else one interleave copy of
the wanted bytes (vectorised per group, never per token or layer). A projected table
(``layers=``) holds only the wanted layers (ascending global ids) with a `RouteSpec` of
that shape and the global ids under ``r3arrow.route_layers`` (`r3arrow.io._project`).
A leaf format: it imports no other format and not the dispatcher (`r3arrow.io._storage`).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import orjson
import pyarrow as pa

from r3arrow._checks import check_int
from r3arrow.errors import SchemaError
from r3arrow.io._interleave import Run, interleave
from r3arrow.io._project import (
    STORAGE_KEY,
    local_layers,
    projected_meta,
    projected_spec,
    set_columns,
    storage_info,
    wrap,
)
from r3arrow.spec import RouteSpec, routes_to_numpy
from r3arrow.table import route_layers

GROUP_FORMAT = "layer_groups/v1"
#: Default number of groups: a stage of a 4-stage pipeline reads 2 of 8 (L divisible by 8).
DEFAULT_GROUPS = 8
_FIELD = re.compile(r"^l([0-9]+)_([0-9]+)$")

Groups = tuple[tuple[int, int], ...]


# ------------------------------------------------------------------ grouping
def plan_groups(num_layers: int, layer_group: int | Sequence[int] | None = None) -> Groups:
    """The ``(start, stop)`` layer ranges of the stored groups.

    ``None``: groups of ``max(1, num_layers // 8)`` layers (the last one holds the
    rest). An int ``n >= 1``: groups of ``n`` layers. A sequence of positive ints
    summing to ``num_layers``: those group sizes (e.g. the layers of each pipeline
    stage). Raises ``TypeError`` / ``ValueError`` for anything else.
    """
    if layer_group is None:
        sizes = [max(1, num_layers // DEFAULT_GROUPS)]
    elif isinstance(layer_group, int) and not isinstance(layer_group, bool):
        sizes = [check_int(layer_group, "layer_group", minimum=1)]
    elif isinstance(layer_group, Sequence) and not isinstance(layer_group, str | bytes):
        given = [check_int(n, "layer_group", minimum=1) for n in layer_group]
        if sum(given) != num_layers:
            raise ValueError(
                f"layer_group: expected group sizes summing to num_layers={num_layers}, "
                f"found {given} (sum {sum(given)})"
            )
        bounds = np.concatenate([[0], np.cumsum(given)]).tolist()
        return tuple((int(a), int(b)) for a, b in itertools.pairwise(bounds))
    else:
        raise TypeError(
            f"layer_group: expected None, an int or a sequence of ints, "
            f"found {type(layer_group).__name__}"
        )
    n = sizes[0]
    return tuple((a, min(a + n, num_layers)) for a in range(0, num_layers, n))


def field_name(group: tuple[int, int]) -> str:
    """The struct field of a group: ``l{start}_{stop}``."""
    return f"l{group[0]}_{group[1]}"


def group_storage_type(spec: RouteSpec, groups: Groups) -> pa.DataType:
    """``large_list<struct<l{a}_{b}: fixed_size_binary((b-a)*K*itemsize), ...>>``, no nulls."""
    width = spec.topk * spec.dtype.itemsize
    struct = pa.struct(
        [pa.field(field_name(g), pa.binary((g[1] - g[0]) * width), nullable=False) for g in groups]
    )
    return pa.large_list(pa.field("item", struct, nullable=False))


def file_groups(info: dict[str, Any], spec: RouteSpec) -> Groups:
    """The checked groups of ``layer_groups/v1`` storage metadata.

    Raises `SchemaError` unless they are ``[start, stop]`` int pairs that partition
    ``[0, spec.num_layers)`` in order.
    """
    raw = info.get("groups")
    try:
        groups = tuple((int(a), int(b)) for a, b in raw)  # type: ignore[union-attr]
        ok = all(type(v) is int for pair in raw for v in pair)  # type: ignore[union-attr]
    except (TypeError, ValueError):
        groups, ok = (), False
    bounds = [g[0] for g in groups] + [groups[-1][1]] if groups else []
    if (
        not ok
        or not groups
        or bounds[0] != 0
        or bounds[-1] != spec.num_layers
        or any(a >= b for a, b in groups)
        or any(groups[i][1] != groups[i + 1][0] for i in range(len(groups) - 1))
    ):
        raise SchemaError(
            f"routes storage metadata: expected layer groups [start, stop] partitioning "
            f"[0, {spec.num_layers}) in order, found {raw!r:.120}"
        )
    return groups


def stored_layer_groups(
    schema: pa.Schema, spec: RouteSpec | None
) -> tuple[tuple[int, ...], ...] | None:
    """The global layer ids of each stored group of a checked file schema, or ``None``.

    ``None`` unless the file is in ``layer_groups/v1`` storage (portable and R3-off
    files). A layer-projected file maps its route rows through
    ``r3arrow.route_layers``. Raises `SchemaError` like `file_groups`.
    """
    info = storage_info(cast("dict[bytes, bytes] | None", schema.metadata))
    if spec is None or info is None or info["format"] != GROUP_FORMAT:
        return None
    present = route_layers(schema)
    return tuple(tuple(present[a:b]) for a, b in file_groups(info, spec))


def check_group_schema(schema: pa.Schema, spec: RouteSpec) -> None:
    """Footer check of a ``layer_groups/v1`` file: every stored column has the recorded groups.

    Raises `SchemaError` (the caller adds the path) if a listed column is not
    ``group_storage_type(spec, groups)`` (missing, reordered or resized fields).
    """
    info = storage_info(cast("dict[bytes, bytes] | None", schema.metadata))
    if info is None or info["format"] != GROUP_FORMAT:
        return
    groups = file_groups(info, spec)
    want = group_storage_type(spec, groups)
    for name in info["columns"]:
        if name not in schema.names:
            if name == "routes":
                raise SchemaError(f"column 'routes': expected {want}, found no such column")
            continue
        found = schema.field(name).type
        if not (
            pa.types.is_large_list(found)
            and pa.types.is_struct(found.value_type)
            and found.value_type == want.value_type  # type: ignore[attr-defined]
        ):
            raise SchemaError(
                f"column {name!r}: expected layer-group storage {want} (metadata "
                f"{STORAGE_KEY.decode()!r}), found {found}"
            )


# ------------------------------------------------------------------- encode
def _encode(col: pa.Array[Any], spec: RouteSpec, groups: Groups) -> pa.Array[Any]:
    """One ``large_list<nested>`` chunk as layer-group storage (one copy per group, vectorised)."""
    lists = cast("pa.LargeListArray[Any]", col)
    offsets = np.asarray(lists.offsets, dtype=np.int64)
    rows = routes_to_numpy(lists.flatten(), spec)  # [T, L, K], a view when contiguous
    t = rows.shape[0]
    width = spec.topk * spec.dtype.itemsize
    as_bytes = np.ascontiguousarray(rows).reshape(t, spec.num_layers * spec.topk).view(np.uint8)
    children: list[pa.Array[Any]] = []
    for a, b in groups:
        part = np.ascontiguousarray(as_bytes[:, a * width : b * width])
        children.append(
            pa.Array.from_buffers(
                pa.binary((b - a) * width),
                t,
                [None, pa.py_buffer(part)],  # type: ignore[arg-type]  # ndarray is a buffer
            )
        )
    typ = group_storage_type(spec, groups)
    struct = pa.StructArray.from_arrays(children, fields=list(typ.value_type))  # type: ignore[attr-defined]
    return pa.LargeListArray.from_arrays(pa.array(offsets - offsets[0]), struct, type=typ)


def to_group_storage(table: pa.Table, groups: Groups) -> pa.Table:
    """The table with every routes-typed column in ``layer_groups/v1`` storage.

    The spec comes from the schema metadata (`SchemaError` without it); a
    multi-chunk column is converted chunk by chunk (never combined). The metadata
    gains ``r3arrow.routes_storage`` = ``{"format", "columns", "groups"}``.
    """
    spec = RouteSpec.from_schema(table.schema)
    names = [f.name for f in table.schema if f.type == spec.routes_type]
    typ = group_storage_type(spec, groups)
    for name in names:
        idx = table.schema.get_field_index(name)
        chunks = [_encode(c, spec, groups) for c in table.column(idx).chunks]
        col = pa.chunked_array(chunks, type=typ)  # type: ignore[call-overload]  # any DataType
        table = table.set_column(idx, table.schema.field(idx).with_type(typ), col)
    info = {"format": GROUP_FORMAT, "columns": names, "groups": [list(g) for g in groups]}
    return table.replace_schema_metadata(
        {**(table.schema.metadata or {}), STORAGE_KEY: orjson.dumps(info)}
    )


def _parts(values: pa.Array[Any], spec: RouteSpec, name: str) -> list[tuple[int, int, Any]]:
    """(start, stop, fixed_size_binary array) of each stored group of a token array."""
    if not pa.types.is_struct(values.type):
        raise SchemaError(
            f"column {name!r}: expected layer-group routes storage (struct of "
            f"fixed_size_binary), found {values.type}"
        )
    struct = cast("pa.StructArray", values)
    if struct.null_count:
        raise SchemaError(f"column {name!r}: expected no null tokens, found {struct.null_count}")
    width = spec.topk * spec.dtype.itemsize
    out = []
    for field, child in zip(struct.type, struct.flatten(), strict=True):
        m = _FIELD.match(field.name)
        a, b = (int(m.group(1)), int(m.group(2))) if m else (0, 0)
        if (
            m is None
            or not 0 <= a < b <= spec.num_layers
            or field.type != pa.binary((b - a) * width)
        ):
            raise SchemaError(
                f"column {name!r}: expected layer-group fields l<start>_<stop> of "
                f"fixed_size_binary((stop-start)*{width}) within {spec.num_layers} layers, "
                f"found {field.name}: {field.type}"
            )
        if child.null_count:
            raise SchemaError(
                f"column {name!r}: expected no null values in {field.name}, "
                f"found {child.null_count}"
            )
        out.append((a, b, child))
    return out


def _assemble(
    parts: list[tuple[int, int, Any]], local: Sequence[int], spec: RouteSpec, name: str
) -> pa.Array[Any]:
    """The route rows ``local`` of every token, from the stored groups ``parts``."""
    t = len(parts[0][2]) if parts else 0
    n = len(local)
    lo, hi = local[0], local[-1] + 1
    for a, b, child in parts:  # one whole group wanted: no copy
        if (a, b) == (lo, hi) and hi - lo == n:
            return wrap(child.buffers()[1], t, spec, n, child.offset)
    width = spec.topk * spec.dtype.itemsize
    want = np.asarray(local, dtype=np.int64)
    covered = np.zeros(n, dtype=bool)
    arrays: list[np.ndarray] = []
    runs: list[Run] = []
    for a, b, child in parts:
        dst = np.flatnonzero((want >= a) & (want < b))
        if not dst.size:
            continue
        size = (b - a) * width
        arrays.append(
            np.frombuffer(
                child.buffers()[1], dtype=np.uint8, count=t * size, offset=child.offset * size
            ).reshape(t, size)
        )
        # Runs of consecutive wanted layers (consecutive in the output too).
        breaks = np.flatnonzero(np.diff(want[dst]) != 1) + 1
        for seg in np.split(dst, breaks):
            src0 = int(want[seg[0]] - a) * width
            runs.append((len(arrays) - 1, src0, int(seg[0]) * width, int(seg.size) * width))
        covered[dst] = True
    if not covered.all():
        absent = want[~covered].tolist()
        raise SchemaError(f"column {name!r}: expected stored groups holding layers {absent}")
    return wrap(interleave(arrays, runs, t, n * width), t, spec, n, 0)


def _restore_chunk(
    chunk: pa.Array[Any], spec: RouteSpec, local: Sequence[int], name: str
) -> pa.Array[Any]:
    lists = cast("pa.LargeListArray[Any]", chunk)
    if not pa.types.is_large_list(lists.type):
        raise SchemaError(
            f"column {name!r}: expected large_list routes storage, found {lists.type}"
        )
    offsets = np.asarray(lists.offsets, dtype=np.int64)
    tokens = _assemble(_parts(lists.flatten(), spec, name), local, spec, name)
    return pa.LargeListArray.from_arrays(pa.array(offsets - offsets[0]), tokens)


def restore_groups(
    table: pa.Table, spec: RouteSpec, info: dict[str, Any], layers: Sequence[int] | None
) -> pa.Table:
    """A ``layer_groups/v1`` table (parsed storage ``info``) restored, maybe projected.

    ``layers`` (global ids, see `r3arrow.io._project.local_layers`): only the groups
    read are decoded and only those route rows come back; ``None``: every layer. The
    storage key is dropped from the metadata. Raises `SchemaError` for storage that
    does not match its metadata, and the errors of ``local_layers``.
    """
    meta = cast("dict[bytes, bytes]", dict(table.schema.metadata or {}))
    file_groups(info, spec)
    local = list(range(spec.num_layers)) if layers is None else local_layers(table.schema, layers)
    meta.pop(STORAGE_KEY)
    new_meta = meta if layers is None else projected_meta(meta, spec, local)
    new = spec if layers is None else projected_spec(spec, local)
    out = set_columns(
        table,
        info["columns"],
        lambda c, n: _restore_chunk(c, spec, local, n),
        new.routes_type,
    )
    return out.replace_schema_metadata(new_meta)


def token_rows(values: pa.Array[Any], spec: RouteSpec, name: str) -> np.ndarray:
    """``[T, L, K]`` rows of stored per-token values (a struct of every layer group)."""
    return routes_to_numpy(
        _assemble(_parts(values, spec, name), list(range(spec.num_layers)), spec, name), spec
    )


def group_leaves(
    schema: pa.Schema, info: dict[str, Any], names: list[str] | None, layers: Sequence[int]
) -> list[str]:
    """The Parquet column paths of ``names`` (``None``: all) holding the global ``layers``.

    A stored routes column becomes the paths of the groups holding those layers
    (``routes.list.item.l0_6``); other names pass through. Raises like ``local_layers``.
    """
    spec = RouteSpec.from_schema(schema)
    groups = file_groups(info, spec)
    local = local_layers(schema, layers)
    need = [g for g in groups if any(g[0] <= i < g[1] for i in local)]
    out: list[str] = []
    for name in names if names is not None else schema.names:
        if name in info["columns"]:
            out.extend(f"{name}.list.item.{field_name(g)}" for g in need)
        else:
            out.append(name)
    return out


__all__ = [
    "DEFAULT_GROUPS",
    "GROUP_FORMAT",
    "check_group_schema",
    "file_groups",
    "group_leaves",
    "group_storage_type",
    "plan_groups",
    "restore_groups",
    "stored_layer_groups",
    "to_group_storage",
    "token_rows",
]
