"""The rollout table: one row per trajectory, routes ragged beside every other column.

Building (`rollout_table`), validating (`validate_rollouts`), derived columns
(`router_padding_mask`, `sequence_loss_mask`), row selection that keeps every
column attached (`take_rows`, `filter_rows`) and dynamic sampling
(`filter_groups`, `replace_groups`). All vectorised with Arrow compute/numpy.
See ``docs/design.md``, "The Arrow data model" and "Dynamic sampling".

One check per trust boundary: `rollout_table` validates what it is given and
marks the table it returns as validated (:mod:`r3arrow._validated`), so writing it
does not validate it again; so do `take_rows`, `filter_rows`, `filter_groups` and
`replace_groups` for results of a validated table. Validation errors carry
``row`` and ``trajectory_id``; argument misuse raises ``ValueError``/``TypeError``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from r3arrow._validated import is_validated, mark_validated
from r3arrow.errors import R3ArrowError, RouteShapeError, SchemaError
from r3arrow.ids import check_route_ids
from r3arrow.spec import RouteSpec, numpy_to_routes, routes_to_numpy
from r3arrow.trace import first_terminal_gap, terminal_gap_error

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


def rollout_schema(spec: RouteSpec, extra: Sequence[pa.Field[Any]] = ()) -> pa.Schema:
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
    meta = cast(
        "dict[bytes | str, bytes | str]",
        {**spec.to_metadata(), _VERSION_KEY: SCHEMA_VERSION.encode()},
    )
    return pa.schema([*core, *extra], metadata=meta)


# ------------------------------------------------------------------ building
def _large_list(values: Any, value_type: pa.DataType, name: str, rows: int) -> pa.Array[Any]:
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
        arr = pa.LargeListArray.from_arrays(pa.array(offsets, type=pa.int64()), pa.array(flat))
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


def _column(values: Any, typ: pa.DataType | None, name: str, rows: int) -> pa.Array[Any]:
    """A column of ``typ`` (None: as given or inferred) with ``rows`` values; nulls are kept."""
    try:
        arr = values.combine_chunks() if isinstance(values, pa.ChunkedArray) else pa.array(values)
        arr = arr if typ is None else arr.cast(typ)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, TypeError) as exc:
        raise SchemaError(f"{name}: expected values convertible to {typ}, found {exc}") from exc
    if len(arr) != rows:
        raise SchemaError(f"{name}: expected {rows} rows (one per trajectory), found {len(arr)}")
    return arr


def _check_part_ids(part: np.ndarray, spec: RouteSpec, row: int) -> int:
    """Id range of trajectory ``row``'s routes; returns the largest id (errors get ``row``)."""
    try:
        return check_route_ids(part, spec, what=f"routes[{row}]")[1]
    except R3ArrowError as exc:
        exc.row = row
        raise


def _routes_column(
    routes: Any, spec: RouteSpec, rows: int
) -> tuple[pa.LargeListArray[Any], RouteSpec]:
    """``large_list<spec.arrow_type>`` from finalized per-trajectory arrays (at most one copy).

    Ids are checked per part before the parts are joined straight into the storage dtype.
    """
    if isinstance(routes, pa.ChunkedArray):
        routes = routes.combine_chunks()
    column = isinstance(routes, pa.LargeListArray | pa.ListArray)
    if column:
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
                    f"found {p.dtype} {list(p.shape)}",
                    row=i,
                )
        lens = np.fromiter((p.shape[0] for p in parts), dtype=np.int64, count=len(parts))
    if len(lens) != rows:
        raise SchemaError(f"routes: expected {rows} rows (one per trajectory), found {len(lens)}")
    if column:
        try:
            hi = check_route_ids(parts[0], spec, what="routes")[1]
        except R3ArrowError as exc:  # name the trajectory and its token (failure path only)
            ends = np.cumsum(lens)
            row = int(np.searchsorted(ends, exc.token or 0, side="right"))
            start = int(ends[row] - lens[row])
            _check_part_ids(parts[0][start : int(ends[row])], spec, row)
            raise  # pragma: no cover - the row's own check raises
    else:
        hi = max((_check_part_ids(p, spec, i) for i, p in enumerate(parts)), default=-1)
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
    return pa.LargeListArray.from_arrays(
        pa.array(offsets, type=pa.int64()), numpy_to_routes(flat, spec)
    ), spec


def rollout_table(
    *,
    trajectory_id: Sequence[str] | pa.Array[Any],
    group_id: Sequence[str] | pa.Array[Any],
    prompt_ids: Any,
    response_ids: Any,
    loss_mask: Any,
    reward: Sequence[float] | np.ndarray | pa.Array[Any],
    routes: Any,
    spec: RouteSpec,
    **extra: Any,
) -> pa.Table:
    """Build and validate a rollout table (schema rollout.v1, spec in the metadata).

    ``routes`` is a sequence of finalized per-trajectory arrays (Arrow per-token
    routes or numpy ``[rows, L, K]``), or a ``large_list`` column. Extra keyword
    columns (one value per trajectory) are kept after the core columns.
    Raises `SchemaError`, `RouteShapeError`, `ExpertRangeError`, `TerminalGapError`
    (with ``row`` set when a trajectory is at fault). The returned table is marked
    validated (a writer does not check it again).
    """
    rows = len(trajectory_id)
    tid = _column(trajectory_id, pa.large_string(), "trajectory_id", rows)
    gid = _column(group_id, pa.large_string(), "group_id", rows)
    rew = _column(reward, pa.float64(), "reward", rows)
    routes_col, spec = _routes_column(routes, spec, rows)
    cols: dict[str, pa.Array[Any]] = {
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
    mark_validated(table)
    return table


# ---------------------------------------------------------------- validation
def route_spec(table: pa.Table | pa.RecordBatch) -> RouteSpec:
    """The `RouteSpec` stored in a rollout table's schema metadata."""
    return RouteSpec.from_schema(table.schema)


def list_lengths(col: pa.Array[Any] | pa.ChunkedArray[Any]) -> np.ndarray:
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


def _trajectory_id(table: pa.Table | pa.RecordBatch, row: int) -> str | None:
    value = table.column("trajectory_id")[row].as_py()
    return value if isinstance(value, str) else None


def validate_rollouts(table: pa.Table | pa.RecordBatch) -> RouteSpec:
    """Check schema, per-row lengths and the terminal-gap rule for every trajectory.

    Returns the table's spec. Vectorised over the whole table. Raises `SchemaError`
    (schema, loss mask length), `RouteShapeError` (more route rows than tokens) and
    `TerminalGapError` (``docs/design.md``, "Ragged routes and the terminal gap"),
    each with ``row`` and ``trajectory_id`` set when a row is at fault.
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
            f"row {i}: expected loss_mask over the {rlen[i]} response tokens, found {mlen[i]}",
            row=i,
            trajectory_id=_trajectory_id(table, i),
        )
    bad = np.flatnonzero(cap > plen + rlen)
    if bad.size:
        i = int(bad[0])
        raise RouteShapeError(
            f"row {i}: expected at most {plen[i] + rlen[i]} route rows (tokens), found {cap[i]}",
            row=i,
            trajectory_id=_trajectory_id(table, i),
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
        k = first_terminal_gap(flat, pos, cap[parent])
        if k >= 0:
            row = int(parent[k])
            raise terminal_gap_error(
                token=int(pos[k]),
                captured=int(cap[row]),
                num_tokens=int(plen[row] + rlen[row]),
                trajectory_id=_trajectory_id(table, row),
                row=row,
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


def router_padding_mask(table: pa.Table | pa.RecordBatch) -> pa.LargeListArray[Any]:
    """``large_list<bool>`` over prompt+response: True where no route was captured."""
    total = sequence_lengths(table)
    offsets, parent, pos = _ragged_positions(total)
    flags = pos >= captured_lengths(table)[parent]
    return pa.LargeListArray.from_arrays(
        pa.array(offsets, type=pa.int64()), pa.array(flags, type=pa.bool_())
    )


def _join_prompt_response(
    table: pa.Table | pa.RecordBatch,
    prompt: np.ndarray | None,
    response: str,
    dtype: Any,
    typ: pa.DataType,
) -> pa.LargeListArray[Any]:
    """Per trajectory, ``prompt`` values (None = zeros) then the ``response`` column's values."""
    plen = list_lengths(table.column("prompt_ids"))
    offsets, parent, pos = _ragged_positions(plen + list_lengths(table.column("response_ids")))
    out = np.zeros(offsets[-1], dtype=dtype)
    is_prompt = pos < plen[parent]
    if prompt is not None:
        out[is_prompt] = prompt
    out[~is_prompt] = np.asarray(
        pc.list_flatten(table.column(response)).to_numpy(zero_copy_only=False)
    )
    return pa.LargeListArray.from_arrays(
        pa.array(offsets, type=pa.int64()), pa.array(out, type=typ)
    )


def sequence_loss_mask(table: pa.Table | pa.RecordBatch) -> pa.LargeListArray[Any]:
    """``large_list<uint8>`` over prompt+response: 0 on the prompt, the response mask after."""
    return _join_prompt_response(table, None, "loss_mask", np.uint8, pa.uint8())


def input_ids(table: pa.Table | pa.RecordBatch) -> pa.LargeListArray[Any]:
    """``large_list<int32>``: prompt_ids followed by response_ids, per trajectory."""
    prompt = np.asarray(pc.list_flatten(table.column("prompt_ids")).to_numpy(zero_copy_only=False))
    return _join_prompt_response(table, prompt, "response_ids", np.int32, pa.int32())


def flat_routes(table: pa.Table | pa.RecordBatch) -> tuple[np.ndarray, np.ndarray]:
    """(routes ``[sum(captured), L, K]``, offsets ``[B+1]``); zero-copy for a one-chunk column."""
    raw = table.column("routes")
    if isinstance(raw, pa.ChunkedArray):
        raw = raw.combine_chunks() if raw.num_chunks != 1 else raw.chunk(0)
    col = cast("pa.LargeListArray[Any]", raw)
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


def _selected(result: pa.Table, source: pa.Table) -> pa.Table:
    """``result`` (rows of ``source``, metadata kept), marked validated if ``source`` was."""
    out = _keep_metadata(result, source)
    return mark_validated(out) if is_validated(source) else out


def take_rows(table: pa.Table, indices: Any) -> pa.Table:
    """Rows at ``indices`` (every column, schema metadata kept)."""
    idx = np.asarray(
        indices.to_numpy(zero_copy_only=False) if isinstance(indices, pa.Array) else indices
    )
    if idx.size and idx.dtype.kind not in "iu":
        raise TypeError(f"take_rows: expected integer row indices, found dtype {idx.dtype}")
    if idx.ndim != 1:
        raise ValueError(f"take_rows: expected a 1-D index array, found shape {list(idx.shape)}")
    return _selected(table.take(pa.array(idx, type=pa.int64())), table)


def filter_rows(table: pa.Table, mask: Any) -> pa.Table:
    """Rows where ``mask`` is true (every column, schema metadata kept)."""
    m = (
        mask
        if isinstance(mask, pa.Array | pa.ChunkedArray)
        else pa.array(np.asarray(mask, dtype=bool))
    )
    if len(m) != table.num_rows:
        raise ValueError(f"filter mask: expected {table.num_rows} values, found {len(m)}")
    return _selected(table.filter(m), table)


def _dictionary(col: pa.ChunkedArray[Any]) -> pa.DictionaryArray[Any, Any]:
    return cast("pa.DictionaryArray[Any, Any]", pc.dictionary_encode(col).combine_chunks())


def _group_codes(table: pa.Table, by: str) -> tuple[np.ndarray, int]:
    if by not in table.schema.names:
        raise SchemaError(f"expected a column {by!r} to group by, found {table.schema.names}")
    enc = _dictionary(table.column(by))
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
        vals = np.asarray(_dictionary(table.column(value)).indices)
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


def with_columns(table: pa.Table, columns: Mapping[str, pa.Array[Any]]) -> pa.Table:
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
