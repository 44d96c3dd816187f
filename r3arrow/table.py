"""The rollout table: one row per trajectory, routes ragged beside every other column.

Building (`rollout_table`), validating (`validate_rollouts`), derived columns
(`router_padding_mask`, `sequence_loss_mask`), row selection that keeps every
column attached (`take_rows`, `filter_rows`) and dynamic sampling
(`filter_groups`, `replace_groups`). All vectorised with Arrow compute/numpy.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from r3arrow.errors import RouteShapeError, SchemaError, TerminalGapError
from r3arrow.spec import RouteSpec, check_route_ids, numpy_to_routes, routes_to_numpy

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
_VERSION_KEY = b"r3arrow.schema"


def rollout_schema(spec: RouteSpec, extra: Sequence[pa.Field] = ()) -> pa.Schema:
    """Arrow schema of a rollout table for ``spec``, with ``extra`` fields after the core ones."""
    core = [
        pa.field("trajectory_id", pa.large_string(), nullable=False),
        pa.field("group_id", pa.large_string(), nullable=False),
        pa.field("prompt_ids", pa.large_list(pa.int32()), nullable=False),
        pa.field("response_ids", pa.large_list(pa.int32()), nullable=False),
        pa.field("loss_mask", pa.large_list(pa.uint8()), nullable=False),
        pa.field("reward", pa.float64(), nullable=False),
        pa.field("routes", spec.routes_type, nullable=False),
    ]
    meta = {**spec.to_metadata(), _VERSION_KEY: SCHEMA_VERSION.encode()}
    return pa.schema([*core, *extra], metadata=meta)


# ------------------------------------------------------------------ building
def _large_list(values: Any, value_type: pa.DataType, name: str, rows: int) -> pa.Array:
    """Coerce a column of per-trajectory sequences to ``large_list<value_type>``."""
    want = pa.large_list(value_type)
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    if isinstance(values, pa.Array):
        arr = values
    elif len(values) and all(isinstance(v, np.ndarray) for v in values):
        lens = np.fromiter((len(v) for v in values), dtype=np.int64, count=len(values))
        offsets = np.zeros(len(values) + 1, dtype=np.int64)
        np.cumsum(lens, out=offsets[1:])
        flat = np.concatenate(values) if len(values) else np.empty(0)
        arr = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(flat))
    else:
        try:
            arr = pa.array(values, type=want)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError) as exc:
            raise SchemaError(
                f"{name}: expected a sequence of {value_type} lists, found {exc}"
            ) from exc
    if len(arr) != rows:
        raise SchemaError(f"{name}: expected {rows} rows (one per trajectory), found {len(arr)}")
    if arr.type != want:
        try:
            arr = arr.cast(want)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
            raise SchemaError(f"{name}: expected {want}, found {arr.type} ({exc})") from exc
    if arr.null_count:
        raise SchemaError(f"{name}: expected no null rows, found {arr.null_count}")
    return arr


def _column(values: Any, typ: pa.DataType | None, name: str, rows: int) -> pa.Array:
    """A column of ``typ`` (None: as given or inferred) with ``rows`` values; nulls are kept."""
    try:
        arr = values.combine_chunks() if isinstance(values, pa.ChunkedArray) else pa.array(values)
        arr = arr if typ is None else arr.cast(typ)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, TypeError) as exc:
        raise SchemaError(f"{name}: expected values convertible to {typ}, found {exc}") from exc
    if len(arr) != rows:
        raise SchemaError(f"{name}: expected {rows} rows (one per trajectory), found {len(arr)}")
    return arr


def _routes_column(routes: Any, spec: RouteSpec, rows: int) -> tuple[pa.LargeListArray, RouteSpec]:
    """Build ``large_list<spec.arrow_type>`` from finalized per-trajectory arrays (at most one copy).

    Ids are checked per part before the parts are joined straight into the storage dtype.
    """
    if isinstance(routes, pa.ChunkedArray):
        routes = routes.combine_chunks()
    if isinstance(routes, pa.LargeListArray | pa.ListArray):
        if routes.null_count:
            raise SchemaError(f"routes: expected no null rows, found {routes.null_count}")
        parts = [routes_to_numpy(routes.flatten(), spec)]
        lens = np.diff(np.asarray(routes.offsets, dtype=np.int64))
    else:
        parts = [
            routes_to_numpy(r, spec) if isinstance(r, pa.Array | pa.ChunkedArray) else np.asarray(r)
            for r in routes
        ]
        for i, p in enumerate(parts):
            if p.ndim != 3 or p.shape[1:] != spec.row_shape or p.dtype.kind not in "iu":
                raise RouteShapeError(
                    f"routes[{i}]: expected integer [rows, {spec.num_layers}, {spec.topk}], "
                    f"found {p.dtype} {list(p.shape)}"
                )
        lens = np.fromiter((p.shape[0] for p in parts), dtype=np.int64, count=len(parts))
    if len(lens) != rows:
        raise SchemaError(f"routes: expected {rows} rows (one per trajectory), found {len(lens)}")
    hi = max(
        (check_route_ids(p, spec, what=f"routes[{i}]")[1] for i, p in enumerate(parts)), default=-1
    )
    if spec.num_experts is None:
        spec = spec.widened_for(hi)
    if len(parts) == 1 and parts[0].dtype == spec.dtype:
        flat = parts[0]
    else:  # ids were range-checked for the storage dtype: the narrowing cast is exact
        flat = np.empty((int(lens.sum()), *spec.row_shape), dtype=spec.dtype)
        if parts:
            np.concatenate(parts, axis=0, out=flat, casting="unsafe")
    offsets = np.zeros(rows + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    return pa.LargeListArray.from_arrays(pa.array(offsets), numpy_to_routes(flat, spec)), spec


def rollout_table(
    *,
    trajectory_id: Sequence[str] | pa.Array,
    group_id: Sequence[str] | pa.Array,
    prompt_ids: Any,
    response_ids: Any,
    loss_mask: Any,
    reward: Sequence[float] | np.ndarray | pa.Array,
    routes: Any,
    spec: RouteSpec,
    **extra: Any,
) -> pa.Table:
    """Build and validate a rollout table (schema rollout.v1, spec in the metadata).

    ``routes`` is a sequence of finalized per-trajectory arrays (Arrow per-token
    routes or numpy ``[rows, L, K]``), or a ``large_list`` column. Extra keyword
    columns (one value per trajectory) are kept after the core columns.
    Raises `SchemaError`, `RouteShapeError`, `ExpertRangeError`, `TerminalGapError`.
    """
    rows = len(trajectory_id)
    tid = _column(trajectory_id, pa.large_string(), "trajectory_id", rows)
    gid = _column(group_id, pa.large_string(), "group_id", rows)
    rew = _column(reward, pa.float64(), "reward", rows)
    routes_col, spec = _routes_column(routes, spec, rows)
    cols: dict[str, pa.Array] = {
        "trajectory_id": tid,
        "group_id": gid,
        "prompt_ids": _large_list(prompt_ids, pa.int32(), "prompt_ids", rows),
        "response_ids": _large_list(response_ids, pa.int32(), "response_ids", rows),
        "loss_mask": _large_list(loss_mask, pa.uint8(), "loss_mask", rows),
        "reward": rew,
        "routes": routes_col,
    }
    extra_fields = []
    for name, values in extra.items():
        if name in cols:
            raise SchemaError(f"extra column {name!r} collides with a core column")
        arr = _column(values, None, name, rows)
        cols[name] = arr
        extra_fields.append(pa.field(name, arr.type))
    schema = rollout_schema(spec, extra_fields)
    for name, value in (("trajectory_id", tid), ("group_id", gid), ("reward", rew)):
        if value.null_count:
            raise SchemaError(f"{name}: expected no nulls, found {value.null_count}")
    table = pa.Table.from_arrays(list(cols.values()), schema=schema)
    validate_rollouts(table)
    return table


# ---------------------------------------------------------------- validation
def route_spec(table: pa.Table | pa.RecordBatch) -> RouteSpec:
    """The `RouteSpec` stored in a rollout table's schema metadata."""
    return RouteSpec.from_schema(table.schema)


def list_lengths(col: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """Length of every list in a (chunked) list column, int64 ``[rows]``."""
    return np.asarray(pc.list_value_length(col).to_numpy(zero_copy_only=False), dtype=np.int64)


def captured_lengths(table: pa.Table | pa.RecordBatch) -> np.ndarray:
    """Captured route rows per trajectory (int64 ``[B]``)."""
    return list_lengths(table.column("routes"))


def sequence_lengths(table: pa.Table | pa.RecordBatch) -> np.ndarray:
    """Prompt + response tokens per trajectory (int64 ``[B]``)."""
    lengths: np.ndarray = list_lengths(table.column("prompt_ids")) + list_lengths(
        table.column("response_ids")
    )
    return lengths


def validate_rollouts(table: pa.Table | pa.RecordBatch) -> RouteSpec:
    """Check schema, per-row lengths and the terminal-gap rule for every trajectory.

    Returns the table's spec. Vectorised over the whole table.
    """
    spec = route_spec(table)
    expected = rollout_schema(spec)
    for f in expected:
        if f.name not in table.schema.names:
            raise SchemaError(
                f"expected column {f.name!r} ({f.type}), found columns {table.schema.names}"
            )
        found = table.schema.field(f.name).type
        if found != f.type:
            raise SchemaError(f"column {f.name!r}: expected {f.type}, found {found}")
    plen = list_lengths(table.column("prompt_ids"))
    rlen = list_lengths(table.column("response_ids"))
    mlen = list_lengths(table.column("loss_mask"))
    cap = captured_lengths(table)
    bad = np.flatnonzero(mlen != rlen)
    if bad.size:
        i = int(bad[0])
        raise SchemaError(
            f"row {i}: expected loss_mask over the {rlen[i]} response tokens, found {mlen[i]}"
        )
    bad = np.flatnonzero(cap > plen + rlen)
    if bad.size:
        i = int(bad[0])
        raise RouteShapeError(
            f"row {i}: expected at most {plen[i] + rlen[i]} route rows (tokens), found {cap[i]}"
        )
    # Terminal gap: a loss-active response token t (absolute position P + j) needs row t-1.
    mask = table.column("loss_mask")
    flat = np.asarray(pc.list_flatten(mask).to_numpy(zero_copy_only=False))
    if flat.size:
        parent = np.asarray(
            pc.list_parent_indices(mask).to_numpy(zero_copy_only=False), dtype=np.int64
        )
        starts = np.concatenate([[0], np.cumsum(mlen)[:-1]])
        pos = plen[parent] + (np.arange(flat.size) - starts[parent])
        viol = np.flatnonzero((flat != 0) & (pos > cap[parent]))
        if viol.size:
            k = int(viol[0])
            row = int(parent[k])
            tid = table.column("trajectory_id")[row].as_py()
            raise TerminalGapError(
                f"trajectory {tid!r} (row {row}): missing routed-expert row for loss-active target at "
                f"token {int(pos[k])} (captured {int(cap[row])} of {int(plen[row] + rlen[row])} tokens)"
            )
    return spec


# ------------------------------------------------------------ derived columns
def _ragged_positions(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(offsets [B+1], parent [T], position-in-row [T]) for rows of the given lengths."""
    offsets = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    parent = np.repeat(np.arange(lengths.size, dtype=np.int64), lengths)
    pos = np.arange(offsets[-1], dtype=np.int64) - offsets[:-1][parent]
    return offsets, parent, pos


def router_padding_mask(table: pa.Table | pa.RecordBatch) -> pa.LargeListArray:
    """``large_list<bool>`` over prompt+response: True where no route was captured."""
    total = sequence_lengths(table)
    offsets, parent, pos = _ragged_positions(total)
    flags = pos >= captured_lengths(table)[parent]
    return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(flags, type=pa.bool_()))


def _join_prompt_response(
    table: pa.Table | pa.RecordBatch,
    prompt: np.ndarray | None,
    response: str,
    dtype: Any,
    typ: pa.DataType,
) -> pa.LargeListArray:
    """Per trajectory, ``prompt`` values (None = zeros) then the ``response`` column's, as large_list."""
    plen = list_lengths(table.column("prompt_ids"))
    offsets, parent, pos = _ragged_positions(plen + list_lengths(table.column("response_ids")))
    out = np.zeros(offsets[-1], dtype=dtype)
    is_prompt = pos < plen[parent]
    if prompt is not None:
        out[is_prompt] = prompt
    out[~is_prompt] = np.asarray(
        pc.list_flatten(table.column(response)).to_numpy(zero_copy_only=False)
    )
    return pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(out, type=typ))


def sequence_loss_mask(table: pa.Table | pa.RecordBatch) -> pa.LargeListArray:
    """``large_list<uint8>`` over prompt+response: 0 on the prompt, the response mask after."""
    return _join_prompt_response(table, None, "loss_mask", np.uint8, pa.uint8())


def input_ids(table: pa.Table | pa.RecordBatch) -> pa.LargeListArray:
    """``large_list<int32>``: prompt_ids followed by response_ids, per trajectory."""
    prompt = np.asarray(pc.list_flatten(table.column("prompt_ids")).to_numpy(zero_copy_only=False))
    return _join_prompt_response(table, prompt, "response_ids", np.int32, pa.int32())


def flat_routes(table: pa.Table | pa.RecordBatch) -> tuple[np.ndarray, np.ndarray]:
    """(routes ``[sum(captured), L, K]``, offsets ``[B+1]``): zero-copy for a single-chunk column."""
    col = table.column("routes")
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    spec = route_spec(table)
    offsets = np.asarray(col.offsets, dtype=np.int64)
    values = routes_to_numpy(col.flatten(), spec)
    return values, offsets - offsets[0]


# --------------------------------------------------------------- row selection
def _keep_metadata(result: pa.Table, source: pa.Table) -> pa.Table:
    return (
        result
        if result.schema.metadata == source.schema.metadata
        else result.replace_schema_metadata(source.schema.metadata)
    )


def take_rows(table: pa.Table, indices: Any) -> pa.Table:
    """Rows at ``indices`` (every column, schema metadata kept)."""
    idx = np.asarray(
        indices.to_numpy(zero_copy_only=False) if isinstance(indices, pa.Array) else indices
    )
    if idx.size and idx.dtype.kind not in "iu":
        raise SchemaError(f"take_rows: expected integer row indices, found dtype {idx.dtype}")
    if idx.ndim != 1:
        raise SchemaError(f"take_rows: expected a 1-D index array, found shape {list(idx.shape)}")
    return _keep_metadata(table.take(pa.array(idx.astype(np.int64, copy=False))), table)


def filter_rows(table: pa.Table, mask: Any) -> pa.Table:
    """Rows where ``mask`` is true (every column, schema metadata kept)."""
    m = (
        mask
        if isinstance(mask, pa.Array | pa.ChunkedArray)
        else pa.array(np.asarray(mask, dtype=bool))
    )
    if len(m) != table.num_rows:
        raise SchemaError(f"filter mask: expected {table.num_rows} values, found {len(m)}")
    return _keep_metadata(table.filter(m), table)


def _group_codes(table: pa.Table, by: str) -> tuple[np.ndarray, int]:
    if by not in table.schema.names:
        raise SchemaError(f"expected a column {by!r} to group by, found {table.schema.names}")
    enc = pc.dictionary_encode(table.column(by)).combine_chunks()
    return np.asarray(enc.indices.to_numpy(zero_copy_only=False), dtype=np.int64), len(
        enc.dictionary
    )


def varied_groups(table: pa.Table, by: str = "group_id", value: str = "reward") -> np.ndarray:
    """Bool per row: True where the row's group has at least two distinct ``value``s."""
    codes, n = _group_codes(table, by)
    if value not in table.schema.names:
        raise SchemaError(f"expected a column {value!r} to compare, found {table.schema.names}")
    vals = np.asarray(table.column(value).to_numpy())
    if vals.dtype.kind not in "iufb":
        vals = np.asarray(pc.dictionary_encode(table.column(value)).combine_chunks().indices)
    vals = vals.astype(np.float64)
    lo = np.full(n, np.inf)
    hi = np.full(n, -np.inf)
    np.minimum.at(lo, codes, vals)
    np.maximum.at(hi, codes, vals)
    return np.asarray((hi > lo)[codes], dtype=bool)


def filter_groups(table: pa.Table, by: str = "group_id", value: str = "reward") -> pa.Table:
    """Drop groups whose ``value`` is the same for every row (DAPO dynamic sampling); order kept."""
    return filter_rows(table, varied_groups(table, by, value))


def replace_groups(
    table: pa.Table, by: str = "group_id", value: str = "reward", *, seed: int = 0
) -> pa.Table:
    """Replace each row of a dropped (uniform-``value``) group by a row of a kept group.

    Each dropped group draws one kept group (uniformly, with replacement, from a
    ``numpy`` generator seeded by ``seed``); its k-th row becomes the replacement
    group's ``k mod size``-th row. Row count and positions of kept rows are
    unchanged; replacement rows keep their own trajectory and group ids.
    Raises `SchemaError` when every group is uniform (nothing to draw from).
    """
    codes, n = _group_codes(table, by)
    keep = varied_groups(table, by, value)
    if keep.all():
        return table
    kept_groups = np.unique(codes[keep])
    if kept_groups.size == 0:
        raise SchemaError(
            f"replace_groups: every group has a uniform {value!r}; no group to draw from"
        )
    order = np.argsort(codes, kind="stable")
    sizes = np.bincount(codes, minlength=n)
    first = np.zeros(n, dtype=np.int64)
    np.cumsum(sizes[:-1], out=first[1:])
    rank = np.empty(codes.size, dtype=np.int64)
    rank[order] = np.arange(codes.size) - first[codes[order]]
    draw = np.random.default_rng(seed).choice(kept_groups, size=n)
    src = np.arange(codes.size, dtype=np.int64)
    dropped = np.flatnonzero(~keep)
    g = draw[codes[dropped]]
    src[dropped] = order[first[g] + rank[dropped] % sizes[g]]
    return take_rows(table, src)


def with_columns(table: pa.Table, columns: Mapping[str, pa.Array]) -> pa.Table:
    """Append or replace columns, keeping schema metadata."""
    out = table
    for name, col in columns.items():
        if name in out.schema.names:
            out = out.set_column(out.schema.get_field_index(name), name, col)
        else:
            out = out.append_column(name, col)
    return _keep_metadata(out, table)


__all__ = [
    "ROLLOUT_COLUMNS",
    "SCHEMA_VERSION",
    "captured_lengths",
    "filter_groups",
    "filter_rows",
    "flat_routes",
    "input_ids",
    "list_lengths",
    "replace_groups",
    "rollout_schema",
    "rollout_table",
    "route_spec",
    "router_padding_mask",
    "sequence_lengths",
    "sequence_loss_mask",
    "take_rows",
    "validate_rollouts",
    "varied_groups",
    "with_columns",
]
