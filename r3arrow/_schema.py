"""Schema rollout.v1 (``docs/design.md``, "The Arrow data model";
``schemas/rollout.v1.json``) and the per-row lengths every table module reads."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, Final, cast

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
#: Schema metadata key of a layer-projected table's global layer ids (`route_layers`).
ROUTE_LAYERS_KEY = b"r3arrow.route_layers"
#: Optional extra columns (``docs/mismatch.md``): the rollout engine's and the trainer's
#: log-prob of each response token, ``list<float32>`` one per response token.
ROLLOUT_LOGPROBS = "rollout_logprobs"
TRAIN_LOGPROBS = "train_logprobs"
#: Optional extra columns (``docs/versions.md``), both ``int64 >= 0`` without nulls: the policy
#: (weight) version that generated a row and the row's attempt (0 for a first try). With
#: ``attempt`` a row's key is (``trajectory_id``, ``attempt``), unique in a table and in a step.
POLICY_VERSION: Final = "policy_version"
ATTEMPT: Final = "attempt"
#: The float metrics of a log-prob mismatch, in order (`r3arrow.stats.logprob_mismatch`'s keys
#: after ``tokens``; the columns of a stored mismatch row; ``docs/mismatch.md``).
MISMATCH_FLOATS = (
    "k1",
    "k2",
    "k3",
    "abs_mean",
    "abs_max",
    "frac_abs_gt_ln2",
    "token_mult_prob_error",
    "js_divergence",
)


#: Default diagnostics ``source`` of a mismatch: the trainer's log-probs against the engine's.
TRAIN_VS_ROLLOUT = "train_vs_rollout"
#: The agreement source of mismatch source ``S``'s own routing is ``S + ROUTING_SUFFIX``
#: (a step's file per source holds one kind, so the two cannot share a name); ``r3arrow
#: diagnose`` pairs them, the demo writes them.
ROUTING_SUFFIX = "_routing"
#: Optional column (``docs/fallback.md``): ``large_list<uint8>``, one entry per ``routes`` row,
#: 1 where the engine delivered no route for that token. Its ``routes`` row then holds the
#: placeholder of `placeholder_rows` (ids ``0..K-1`` on every layer), which never replays.
ROUTES_MISSING = "routes_missing"
#: Schema metadata key of a table whose routes may have missing rows (value ``b"1"``): a
#: table that carries it without the ``routes_missing`` column is refused, so dropping the
#: column can never turn placeholders into routes.
MISSING_KEY = b"r3arrow.routes_missing"


def placeholder_rows(spec: RouteSpec, n: int) -> np.ndarray:
    """The ``[n, L, K]`` rows (``spec.dtype``) a missing token route holds: ``0..K-1`` on every
    layer, in range and distinct, so every id check passes and only the mark says they are
    not routes."""
    row = np.arange(spec.topk, dtype=spec.dtype)
    return np.broadcast_to(row, (n, spec.num_layers, spec.topk)).copy()


def missing_routes(table: pa.Table | pa.RecordBatch) -> np.ndarray | None:
    """The flat uint8 ``[T]`` marks of a table's route rows (1 = missing), aligned with the
    flattened ``routes`` column; None when the table has no ``routes_missing`` column (and no
    `MISSING_KEY`). `SchemaError` when the key is there without the column, the column is not
    a list of 0/1 ``uint8`` with one entry per route row, or a list is null."""
    names = table.schema.names
    if ROUTES_MISSING not in names:
        if MISSING_KEY in (table.schema.metadata or {}):
            raise SchemaError(
                f"expected a {ROUTES_MISSING!r} column (metadata {MISSING_KEY.decode()!r} says "
                f"some route rows are placeholders for missing routes), found none (columns "
                f"{names}); read or select it with 'routes'"
            )
        return None
    require_routes(table, ROUTES_MISSING)
    col = table.column(ROUTES_MISSING)
    value_type = getattr(col.type, "value_type", None)
    if not (pa.types.is_large_list(col.type) or pa.types.is_list(col.type)) or (
        value_type != pa.uint8()
    ):
        raise SchemaError(
            f"column {ROUTES_MISSING!r}: expected large_list<uint8> (one 0/1 per route row), "
            f"found {col.type}"
        )
    lengths, want = list_lengths(col), captured_lengths(table)
    if not np.array_equal(lengths, want):
        row = int(np.flatnonzero(lengths != want)[0])
        raise SchemaError(
            f"column {ROUTES_MISSING!r}: expected one mark per route row, found "
            f"{int(lengths[row])} marks for {int(want[row])} route rows in row {row}",
            row=row,
            trajectory_id=trajectory_id_at(table, row),
        )
    flat = pc.list_flatten(col)
    if flat.null_count:
        raise SchemaError(
            f"column {ROUTES_MISSING!r}: expected a 0/1 mark per route row, found "
            f"{flat.null_count} null marks"
        )
    marks = np.asarray(flat.to_numpy(zero_copy_only=False), dtype=np.uint8)
    if marks.size and int(marks.max()) > 1:
        raise SchemaError(
            f"column {ROUTES_MISSING!r}: expected 0 (route delivered) or 1 (missing), found "
            f"{int(marks.max())}"
        )
    return marks


def rollout_schema(spec: RouteSpec | None, extra: Sequence[pa.Field[Any]] = ()) -> pa.Schema:
    """Arrow schema of a rollout table for ``spec`` (``None``: R3 off), ``extra`` fields last."""
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
    """The `RouteSpec` in a rollout table's schema metadata; `SchemaError` when absent (the
    message names R3 off for an R3-off table: test `has_routes` first where R3 may be off)."""
    meta = table.schema.metadata or {}
    if not has_routes(table) and SPEC_METADATA_KEY not in meta:
        raise SchemaError(
            f"no routes column (R3 off): the table has no RouteSpec (columns {table.schema.names})"
        )
    return RouteSpec.from_schema(table.schema)


def route_layers(table: pa.Table | pa.RecordBatch | pa.Schema) -> tuple[int, ...]:
    """The global layer id of each route row of a table or schema, ascending (a projected
    table's ``r3arrow.route_layers``); `SchemaError` for R3 off or a malformed value.
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
    """Length of every list in a (chunked) list column, int64 ``[rows]``; `SchemaError`
    for a null list."""
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
    prompt, response = (list_lengths(table.column(c)) for c in ("prompt_ids", "response_ids"))
    lengths: np.ndarray = prompt + response
    return lengths


def trajectory_id_at(table: pa.Table | pa.RecordBatch, row: int) -> str | None:
    """The ``trajectory_id`` of ``row`` (None if the column is missing or the value null)."""
    if "trajectory_id" not in table.schema.names:
        return None
    value = table.column("trajectory_id")[row].as_py()
    return value if isinstance(value, str) else None
