"""Layer-group routes storage, ``layer_groups/v1`` (``docs/storage.md``, "Layout"): a leaf
format, importing no other format nor the dispatcher."""

from __future__ import annotations

import contextlib
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
    relist,
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


def plan_groups(num_layers: int, layer_group: int | Sequence[int] | None = None) -> Groups:
    """The ``(start, stop)`` layer ranges of the stored groups (`write_rollouts`'s
    ``layer_group``); ``TypeError`` / ``ValueError`` for anything but ``None``, an int
    ``>= 1`` or positive ints summing to ``num_layers``."""
    if layer_group is None:
        n = max(1, num_layers // DEFAULT_GROUPS)
    elif isinstance(layer_group, int) and not isinstance(layer_group, bool):
        n = check_int(layer_group, "layer_group", minimum=1)
    elif isinstance(layer_group, Sequence) and not isinstance(layer_group, str | bytes):
        given = [check_int(n, "layer_group", minimum=1) for n in layer_group]
        if sum(given) != num_layers:
            raise ValueError(
                f"layer_group: expected group sizes summing to num_layers={num_layers}, "
                f"found {given} (sum {sum(given)})"
            )
        return tuple(itertools.pairwise([0, *itertools.accumulate(given)]))
    else:
        raise TypeError(
            f"layer_group: expected None, an int or a sequence of ints, "
            f"found {type(layer_group).__name__}"
        )
    return tuple((a, min(a + n, num_layers)) for a in range(0, num_layers, n))


def _field_name(group: tuple[int, int]) -> str:
    return f"l{group[0]}_{group[1]}"


def group_storage_type(spec: RouteSpec, groups: Groups) -> pa.DataType:
    """``large_list<struct<l{a}_{b}: fixed_size_binary((b-a)*K*itemsize), ...>>``, no nulls."""
    width = spec.topk * spec.dtype.itemsize
    struct = pa.struct(
        [pa.field(_field_name(g), pa.binary((g[1] - g[0]) * width), nullable=False) for g in groups]
    )
    return pa.large_list(pa.field("item", struct, nullable=False))


def file_groups(info: dict[str, Any], spec: RouteSpec) -> Groups:
    """The groups of ``layer_groups/v1`` storage metadata; `SchemaError` unless they are
    ``[start, stop]`` int pairs partitioning ``[0, spec.num_layers)`` in order."""
    raw = info.get("groups")
    groups: Groups = ()
    with contextlib.suppress(TypeError, ValueError):
        groups = tuple((a, b) for a, b in raw)  # type: ignore[union-attr]
    stops = [b for _, b in groups]
    if not (
        groups
        and all(type(v) is int for g in groups for v in g)
        and groups == tuple(itertools.pairwise([0, *stops]))
        and stops[-1] == spec.num_layers
        and all(a < b for a, b in groups)
    ):
        raise SchemaError(
            f"routes storage metadata: expected layer groups [start, stop] partitioning "
            f"[0, {spec.num_layers}) in order, found {raw!r:.120}"
        )
    return groups


def _group_info(schema: pa.Schema) -> dict[str, Any] | None:
    info = storage_info(cast("dict[bytes, bytes] | None", schema.metadata))
    return info if info is not None and info["format"] == GROUP_FORMAT else None


def stored_layer_groups(
    schema: pa.Schema, spec: RouteSpec | None
) -> tuple[tuple[int, ...], ...] | None:
    """The global layer ids of each stored group of a checked file schema (``None`` for
    portable and R3-off files); raises like `file_groups`."""
    info = _group_info(schema)
    if spec is None or info is None:
        return None
    present = route_layers(schema)
    return tuple(tuple(present[a:b]) for a, b in file_groups(info, spec))


def check_group_schema(schema: pa.Schema, spec: RouteSpec) -> None:
    """`SchemaError` (no path) unless every stored column of a ``layer_groups/v1`` schema
    is ``group_storage_type(spec, groups)`` of the recorded groups."""
    info = _group_info(schema)
    if info is None:
        return
    want = group_storage_type(spec, file_groups(info, spec))
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


def to_group_storage(table: pa.Table, groups: Groups) -> pa.Table:
    """Every routes-typed column in ``layer_groups/v1`` storage, chunk by chunk (one copy
    per group, vectorised); `SchemaError` without a spec. The metadata gains `STORAGE_KEY`."""
    spec = RouteSpec.from_schema(table.schema)
    width = spec.topk * spec.dtype.itemsize
    typ = group_storage_type(spec, groups)

    def encode(chunk: pa.Array[Any], name: str) -> pa.Array[Any]:
        rows = routes_to_numpy(cast("pa.LargeListArray[Any]", chunk).flatten(), spec)
        t = rows.shape[0]
        as_bytes = np.ascontiguousarray(rows).reshape(t, spec.num_layers * spec.topk)
        as_bytes = as_bytes.view(np.uint8)
        children = []
        for a, b in groups:
            part = np.ascontiguousarray(as_bytes[:, a * width : b * width])
            buf = pa.py_buffer(part)  # type: ignore[arg-type]  # ndarray is a buffer
            children.append(pa.Array.from_buffers(pa.binary((b - a) * width), t, [None, buf]))
        fields = list(typ.value_type)  # type: ignore[attr-defined]  # a large_list's struct
        struct = pa.StructArray.from_arrays(children, fields=fields)
        return relist(chunk, struct, typ)

    names = [f.name for f in table.schema if f.type == spec.routes_type]
    info = {"format": GROUP_FORMAT, "columns": names, "groups": [list(g) for g in groups]}
    meta = {**(table.schema.metadata or {}), STORAGE_KEY: orjson.dumps(info)}
    return set_columns(table, names, encode, typ, meta)


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
        if not (0 <= a < b <= spec.num_layers and field.type == pa.binary((b - a) * width)):
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


def restore_groups(
    table: pa.Table, spec: RouteSpec, info: dict[str, Any], layers: Sequence[int] | None
) -> pa.Table:
    """A ``layer_groups/v1`` table (parsed storage ``info``) restored, projected to the
    global ``layers`` (decoding only their groups); `SchemaError` for storage that does not
    match its metadata, and what `local_layers` raises."""
    meta = cast("dict[bytes, bytes]", dict(table.schema.metadata or {}))
    file_groups(info, spec)
    local = list(range(spec.num_layers)) if layers is None else local_layers(table.schema, layers)
    meta.pop(STORAGE_KEY)
    new = spec if layers is None else projected_spec(spec, local)

    def restore_chunk(chunk: pa.Array[Any], name: str) -> pa.Array[Any]:
        if not pa.types.is_large_list(chunk.type):
            raise SchemaError(
                f"column {name!r}: expected large_list routes storage, found {chunk.type}"
            )
        values = cast("pa.LargeListArray[Any]", chunk).flatten()
        return relist(chunk, _assemble(_parts(values, spec, name), local, spec, name))

    new_meta = meta if layers is None else projected_meta(meta, spec, local)
    return set_columns(table, info["columns"], restore_chunk, new.routes_type, new_meta)


def token_rows(values: pa.Array[Any], spec: RouteSpec, name: str) -> np.ndarray:
    """``[T, L, K]`` rows of stored per-token values (a struct of every layer group)."""
    every = list(range(spec.num_layers))
    return routes_to_numpy(_assemble(_parts(values, spec, name), every, spec, name), spec)


def group_leaves(
    schema: pa.Schema, info: dict[str, Any], names: list[str] | None, layers: Sequence[int]
) -> list[str]:
    """The Parquet column paths of ``names`` (``None``: all) holding the global ``layers``:
    a stored routes column becomes its groups' (``routes.list.item.l0_6``)."""
    spec = RouteSpec.from_schema(schema)
    local = local_layers(schema, layers)
    need = [g for g in file_groups(info, spec) if any(g[0] <= i < g[1] for i in local)]
    out: list[str] = []
    for name in names if names is not None else schema.names:
        if name in info["columns"]:
            out.extend(f"{name}.list.item.{_field_name(g)}" for g in need)
        else:
            out.append(name)
    return out
