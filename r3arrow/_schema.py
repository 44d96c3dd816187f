"""Schema rollout.v1 and the per-row lengths every other table module reads.

The core columns, their Arrow types and the schema metadata (``docs/design.md``, "The
Arrow data model"; ``schemas/rollout.v1.json``). With R3 on, the table has a ``routes``
column and carries its `RouteSpec` under ``r3arrow.spec``; with R3 off it has neither
(`has_routes`), and everything but the routes (building, validation, loss masks, input
ids, row selection, dynamic sampling) works the same.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc

from r3arrow.errors import SchemaError
from r3arrow.spec import SPEC_METADATA_KEY, RouteSpec

#: Core columns of schema rollout.v1, in order (see schemas/rollout.v1.json).
ROLLOUT_COLUMNS: tuple[str, ...] = (
    "trajectory_id",
    "group_id",
    "prompt_ids",
    "response_ids",
    "loss_mask",
    "reward",
    "routes",
)
SCHEMA_VERSION = "rollout.v1"
VERSION_KEY = b"r3arrow.schema"
#: Schema metadata key of a layer-projected table: JSON list of the global layer id of each
#: route row present (see `route_layers`; ``docs/storage.md``, "Layer projection").
ROUTE_LAYERS_KEY = b"r3arrow.route_layers"


def rollout_schema(spec: RouteSpec | None, extra: Sequence[pa.Field[Any]] = ()) -> pa.Schema:
    """Arrow schema of a rollout table for ``spec``, with ``extra`` fields after the core ones.

    ``spec=None`` is the R3-off schema: no ``routes`` field and no ``r3arrow.spec``
    metadata (only ``r3arrow.schema``).
    """
    core = [
        pa.field("trajectory_id", pa.large_string(), nullable=False),
        pa.field("group_id", pa.large_string(), nullable=False),
        pa.field("prompt_ids", pa.large_list(pa.int32()), nullable=False),
        pa.field("response_ids", pa.large_list(pa.int32()), nullable=False),
        pa.field("loss_mask", pa.large_list(pa.uint8()), nullable=False),
        pa.field("reward", pa.float64(), nullable=False),
    ]
    meta: dict[bytes, bytes] = {VERSION_KEY: SCHEMA_VERSION.encode()}
    if spec is not None:
        core.append(pa.field("routes", spec.routes_type, nullable=False))
        meta = {**spec.to_metadata(), **meta}
    return pa.schema([*core, *extra], metadata=cast("dict[bytes | str, bytes | str]", meta))


def has_routes(table: pa.Table | pa.RecordBatch) -> bool:
    """True if the table has a ``routes`` column (R3 on); False for an R3-off table."""
    return "routes" in table.schema.names


def route_spec(table: pa.Table | pa.RecordBatch) -> RouteSpec:
    """The `RouteSpec` stored in a rollout table's schema metadata.

    Raises `SchemaError` when it is absent; for an R3-off table (no ``routes`` column and
    no spec) the message says so. Test `has_routes` first where R3 may be off.
    """
    meta = table.schema.metadata or {}
    if not has_routes(table) and SPEC_METADATA_KEY not in meta:
        raise SchemaError(
            f"no routes column (R3 off): the table has no RouteSpec (columns {table.schema.names})"
        )
    return RouteSpec.from_schema(table.schema)


def route_layers(table: pa.Table | pa.RecordBatch | pa.Schema) -> tuple[int, ...]:
    """The global layer id of each route row present in the table's routes, ascending.

    A full table holds every layer: ``tuple(range(spec.num_layers))``. A layer-projected
    table (``r3arrow.read_rollouts(..., layers=...)``) holds ``spec.num_layers`` of them
    and records their global ids under ``r3arrow.route_layers`` (a JSON list); route row
    ``i`` of a token is global layer ``route_layers(table)[i]``. A schema is accepted too.

    Raises `SchemaError` for an R3-off table (no spec) and for a ``r3arrow.route_layers``
    value that is not a strictly ascending list of ``spec.num_layers`` non-negative ints.
    """
    schema = table if isinstance(table, pa.Schema) else table.schema
    meta = schema.metadata or {}
    if SPEC_METADATA_KEY not in meta:
        raise SchemaError(
            f"route_layers: expected a RouteSpec (metadata key {SPEC_METADATA_KEY.decode()!r}), "
            f"found none (R3 off; columns {schema.names})"
        )
    spec = RouteSpec.from_schema(schema)
    raw = meta.get(ROUTE_LAYERS_KEY)
    if raw is None:
        return tuple(range(spec.num_layers))
    try:
        layers = orjson.loads(raw)
    except orjson.JSONDecodeError:
        layers = None
    ok = (
        isinstance(layers, list)
        and len(layers) == spec.num_layers
        and all(type(i) is int and i >= 0 for i in layers)
        and all(a < b for a, b in itertools.pairwise(layers))
    )
    if not ok:
        raise SchemaError(
            f"metadata key {ROUTE_LAYERS_KEY.decode()!r}: expected a strictly ascending JSON "
            f"list of {spec.num_layers} non-negative layer ids (num_layers of {spec}), "
            f"found {bytes(raw)!r:.120}"
        )
    return tuple(cast("list[int]", layers))


def require_routes(table: pa.Table | pa.RecordBatch, what: str) -> None:
    """Raise `SchemaError` naming ``what`` if the table has no ``routes`` column (R3 off)."""
    if not has_routes(table):
        raise SchemaError(
            f"{what}: expected a 'routes' column, found no routes column (R3 off; "
            f"columns {table.schema.names})"
        )


def list_lengths(col: pa.Array[Any] | pa.ChunkedArray[Any]) -> np.ndarray:
    """Length of every list in a (chunked) list column, int64 ``[rows]``.

    Raises `SchemaError` for a null list (its length is undefined).
    """
    lengths = pc.list_value_length(col)
    if lengths.null_count:
        raise SchemaError(f"expected no null lists, found {lengths.null_count}")
    return np.asarray(lengths.to_numpy(zero_copy_only=False), dtype=np.int64)


def captured_lengths(table: pa.Table | pa.RecordBatch) -> np.ndarray:
    """Captured route rows per trajectory (int64 ``[B]``); `SchemaError` if R3 is off."""
    require_routes(table, "captured_lengths")
    return list_lengths(table.column("routes"))


def sequence_lengths(table: pa.Table | pa.RecordBatch) -> np.ndarray:
    """Prompt + response tokens per trajectory (int64 ``[B]``)."""
    lengths: np.ndarray = list_lengths(table.column("prompt_ids")) + list_lengths(
        table.column("response_ids")
    )
    return lengths


def trajectory_id_at(table: pa.Table | pa.RecordBatch, row: int) -> str | None:
    """The ``trajectory_id`` of ``row`` (None if the column is missing or the value null)."""
    if "trajectory_id" not in table.schema.names:
        return None
    value = table.column("trajectory_id")[row].as_py()
    return value if isinstance(value, str) else None
