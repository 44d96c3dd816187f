"""`rollout_table`: build and validate a rollout table from per-trajectory columns.

Routes are checked per part (ids in range) before the parts are joined straight into the
storage dtype, so the narrowing cast never wraps a value; the table is then validated
(`r3arrow.table._validate`) and marked validated, so writing it does not check it again.
With R3 off (``routes=None, spec=None``) the table has no ``routes`` column and no spec.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from r3arrow._validated import mark_validated
from r3arrow.errors import R3ArrowError, RouteShapeError, SchemaError
from r3arrow.ids import check_route_ids
from r3arrow.spec import RouteSpec, numpy_to_routes, routes_to_numpy
from r3arrow.table._schema import rollout_schema
from r3arrow.table._validate import validate_table


def _large_list(values: Any, value_type: pa.DataType, name: str, rows: int) -> pa.Array[Any]:
    """Coerce a column of per-trajectory sequences to ``large_list<value_type>`` (nulls kept)."""
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

    Ids are range-checked per part before the parts are joined straight into the storage
    dtype (the distinct-experts rule is checked by validation afterwards).
    """
    if isinstance(routes, pa.ChunkedArray):
        routes = routes.combine_chunks()
    column = isinstance(routes, pa.LargeListArray | pa.ListArray)
    if column:
        if routes.null_count:  # a null row's values would be dropped by flatten: refuse first
            first = int(np.flatnonzero(np.asarray(routes.is_null()))[0])
            raise SchemaError(
                f"routes: expected no null trajectory rows, found {routes.null_count} "
                f"(first: row {first})",
                row=first,
            )
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
    trajectory_id: Sequence[str] | pa.Array[Any] | pa.ChunkedArray[Any],
    group_id: Sequence[str] | pa.Array[Any] | pa.ChunkedArray[Any],
    prompt_ids: Any,
    response_ids: Any,
    loss_mask: Any,
    reward: Sequence[float] | np.ndarray | pa.Array[Any] | pa.ChunkedArray[Any],
    routes: Any = None,
    spec: RouteSpec | None = None,
    **extra: Any,
) -> pa.Table:
    """Build and validate a rollout table (schema rollout.v1, spec in the metadata).

    ``routes`` is a sequence of finalized per-trajectory arrays (Arrow per-token routes or
    numpy ``[rows, L, K]``), or a ``large_list`` column, described by ``spec``. Omit both
    (``routes=None, spec=None``) for an R3-off table: no ``routes`` column and no spec
    metadata. Extra keyword columns (one value per trajectory) follow the core columns.

    Raises ``TypeError`` when only one of ``routes`` / ``spec`` is given or ``spec`` is not
    a `RouteSpec`; `SchemaError`, `RouteShapeError`, `ExpertRangeError`,
    `DuplicateExpertError`, `TerminalGapError` for bad data (with ``row`` and
    ``trajectory_id`` set when a trajectory is at fault). The returned table is marked
    validated (a writer does not check it again).
    """
    if (routes is None) != (spec is None):
        given, missing = ("routes", "spec") if spec is None else ("spec", "routes")
        raise TypeError(
            f"rollout_table: expected routes and spec together (or neither, R3 off), "
            f"found {given}= without {missing}="
        )
    if spec is not None and not isinstance(spec, RouteSpec):
        raise TypeError(f"rollout_table: expected spec to be a RouteSpec, found {type(spec)}")
    rows = len(trajectory_id)
    cols: dict[str, pa.Array[Any]] = {
        "trajectory_id": _column(trajectory_id, pa.large_string(), "trajectory_id", rows),
        "group_id": _column(group_id, pa.large_string(), "group_id", rows),
        "prompt_ids": _large_list(prompt_ids, pa.int32(), "prompt_ids", rows),
        "response_ids": _large_list(response_ids, pa.int32(), "response_ids", rows),
        "loss_mask": _large_list(loss_mask, pa.uint8(), "loss_mask", rows),
        "reward": _column(reward, pa.float64(), "reward", rows),
    }
    if spec is not None:
        cols["routes"], spec = _routes_column(routes, spec, rows)
    extra_fields = []
    for name, values in extra.items():
        if name in cols or name == "routes":
            raise SchemaError(f"extra column {name!r} collides with a core column")
        arr = _column(values, None, name, rows)
        cols[name] = arr
        extra_fields.append(pa.field(name, arr.type))
    schema = rollout_schema(spec, extra_fields)
    table = pa.Table.from_arrays(list(cols.values()), schema=schema)
    validate_table(table, ids="distinct")  # the id range was checked per part above
    mark_validated(table)
    return table
