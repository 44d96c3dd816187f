"""`rollout_table`: build and validate a rollout table from per-trajectory columns.

Routes are checked per part (ids in range) before any join into the storage dtype, so the
narrowing cast never wraps a value; the table is then validated (the rules of
`r3arrow.table._validate`) and marked validated, so writing it does not check it again.

No copy of the routes where a buffer can be referenced (``docs/capture.md``): the routes
column is a ``ChunkedArray`` whose chunks reference each finalized trace's buffer (one
chunk per trajectory of at least `MIN_CHUNK_BYTES`; smaller ones share a joined chunk), and
arrays a `RouteTrace` finalized are not id-checked again (`r3arrow._validated.checked_for`).
With R3 off (``routes=None, spec=None``) the table has no ``routes`` column and no spec.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from r3arrow._routes import chunk, chunked, chunked_routes
from r3arrow._schema import rollout_schema
from r3arrow._validated import checked_for, mark_validated
from r3arrow.errors import R3ArrowError, RouteShapeError, SchemaError
from r3arrow.ids import check_routes
from r3arrow.spec import RouteSpec, routes_to_numpy
from r3arrow.table._validate import recheck_row, validate_table


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


#: A trajectory's rows become their own chunk (referenced, not copied) from this size on;
#: smaller ones are joined into shared chunks, since a chunk costs a few microseconds of
#: bookkeeping here and in every consumer (about a memcpy of this many bytes).
def _check_part_ids(part: np.ndarray, spec: RouteSpec, row: int) -> int:
    """Id range of trajectory ``row``'s routes; returns the largest id (errors get ``row``)."""
    try:
        return check_routes(part, spec, what=f"routes[{row}]", rules="range")[1]
    except R3ArrowError as exc:
        exc.row = row
        raise


def _column_parts(
    routes: pa.LargeListArray[Any] | pa.ListArray[Any], spec: RouteSpec, base: int
) -> tuple[np.ndarray, np.ndarray]:
    """(flat rows, per-trajectory lengths) of one list chunk; rows ``base..`` of the table."""
    if routes.null_count:  # a null row's values would be dropped by flatten: refuse first
        first = int(np.flatnonzero(np.asarray(routes.is_null()))[0])
        raise SchemaError(
            f"routes: expected no null trajectory rows, found {routes.null_count} "
            f"(first: row {base + first})",
            row=base + first,
        )
    return routes_to_numpy(routes.flatten(), spec), np.diff(
        np.asarray(routes.offsets, dtype=np.int64)
    )


def _check_flat_ids(flat: np.ndarray, lens: np.ndarray, spec: RouteSpec, base: int) -> int:
    """Id range of a chunk's flat rows; an error names the trajectory's row (and its token)."""
    try:
        return check_routes(flat, spec, what="routes", rules="range")[1]
    except R3ArrowError as exc:  # failure path only: re-check the trajectory's own rows
        ends = np.cumsum(lens)
        row = int(np.searchsorted(ends, exc.token or 0, side="right"))
        start = int(ends[row] - lens[row])
        _check_part_ids(flat[start : int(ends[row])], spec, base + row)
        raise  # pragma: no cover - the row's own check raises


def _routes_column(
    routes: Any, spec: RouteSpec, rows: int
) -> tuple[pa.ChunkedArray[Any], RouteSpec, list[tuple[int, np.ndarray, np.ndarray]]]:
    """The routes column from finalized per-trajectory arrays or a list column; no route copy
    where a buffer can be referenced (`chunked_routes`).

    Ids are range-checked before any join into the storage dtype (so the narrowing cast never
    wraps), except for arrays `r3arrow._validated.checked_for` the spec (the capture path checked
    them). Returns (column, spec, the parts still owing the distinct-experts check as
    (first row, flat rows, lengths)).
    """
    if isinstance(routes, pa.LargeListArray | pa.ListArray | pa.ChunkedArray):
        chunks = list(routes.chunks) if isinstance(routes, pa.ChunkedArray) else [routes]
        flats, lens_list, base = [], [], 0
        for ch in chunks:
            if not isinstance(ch, pa.LargeListArray | pa.ListArray):
                raise SchemaError(f"routes: expected a list column, found {ch.type}")
            flat, lens = _column_parts(ch, spec, base)
            flats.append(flat)
            lens_list.append(lens)
            base += len(lens)
        if base != rows:
            raise SchemaError(f"routes: expected {rows} rows (one per trajectory), found {base}")
        firsts = np.cumsum([0] + [len(x) for x in lens_list])[:-1].tolist()
        if checked_for(routes, spec):  # a TurnStore's column: every turn was checked
            return chunked(chunks, type=spec.routes_type), spec, []
        hi = max(
            (
                _check_flat_ids(f, n, spec, b)
                for f, n, b in zip(flats, lens_list, firsts, strict=True)
            ),
            default=-1,
        )
        spec = spec.widened_for(hi) if spec.num_experts is None else spec
        # Re-wrapping a chunk's own flat rows references them (a copy only to cast the dtype).
        col = chunked(
            [chunk([f], n.tolist(), spec) for f, n in zip(flats, lens_list, strict=True)]
            or [chunk([], [], spec)],
            type=spec.routes_type,
        )
        owing = list(zip(firsts, flats, lens_list, strict=True))
        return col, spec, owing
    given = list(routes)
    if len(given) != rows:
        raise SchemaError(f"routes: expected {rows} rows (one per trajectory), found {len(given)}")
    trusted = [checked_for(r, spec) for r in given]  # finalized by a RouteTrace: ids checked
    parts: list[np.ndarray | None] = [
        None
        if ok
        else routes_to_numpy(r, spec)
        if isinstance(r, pa.Array | pa.ChunkedArray)
        else np.asarray(r)
        for r, ok in zip(given, trusted, strict=True)
    ]
    for i, p in enumerate(parts):
        if p is not None and (
            p.ndim != 3 or p.shape[1:] != spec.row_shape or p.dtype.kind not in "iu"
        ):
            raise RouteShapeError(
                f"routes[{i}]: expected integer [rows, {spec.num_layers}, {spec.topk}], "
                f"found {p.dtype} {list(p.shape)}",
                row=i,
            )
    hi = max(
        (_check_part_ids(p, spec, i) for i, p in enumerate(parts) if p is not None),
        default=-1,
    )
    if spec.num_experts is None:
        spec = spec.widened_for(hi)
    owing = [
        (i, p, np.array([p.shape[0]], dtype=np.int64)) for i, p in enumerate(parts) if p is not None
    ]
    items: list[Sequence[np.ndarray] | pa.Array[Any]] = []
    for r, p in zip(given, parts, strict=True):
        if p is not None:
            items.append([p])
        elif r.type == spec.arrow_type:
            items.append(r)
        else:  # checked, but narrower than a widened spec: cast by the join
            items.append([routes_to_numpy(r)])
    return chunked_routes(items, spec), spec, owing


def _check_distinct(
    table: pa.Table, spec: RouteSpec, owing: list[tuple[int, np.ndarray, np.ndarray]]
) -> None:
    """The distinct-experts rule on the parts not checked by the capture path."""
    for base, flat, lens in owing:
        try:
            check_routes(flat, spec, what="routes", rules="distinct")
        except R3ArrowError as exc:  # failure path: re-check the trajectory for its own token
            ends = np.cumsum(lens)
            row = int(np.searchsorted(ends, exc.token or 0, side="right"))
            start, end = int(ends[row] - lens[row]), int(ends[row])
            recheck_row(exc, table, flat[start:end], spec, base + row, rules="distinct")


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
    cols: dict[str, pa.Array[Any] | pa.ChunkedArray[Any]] = {
        "trajectory_id": _column(trajectory_id, pa.large_string(), "trajectory_id", rows),
        "group_id": _column(group_id, pa.large_string(), "group_id", rows),
        "prompt_ids": _large_list(prompt_ids, pa.int32(), "prompt_ids", rows),
        "response_ids": _large_list(response_ids, pa.int32(), "response_ids", rows),
        "loss_mask": _large_list(loss_mask, pa.uint8(), "loss_mask", rows),
        "reward": _column(reward, pa.float64(), "reward", rows),
    }
    owing: list[tuple[int, np.ndarray, np.ndarray]] = []
    if spec is not None:
        cols["routes"], spec, owing = _routes_column(routes, spec, rows)
    extra_fields = []
    for name, values in extra.items():
        if name in cols or name == "routes":
            raise SchemaError(f"extra column {name!r} collides with a core column")
        arr = _column(values, None, name, rows)
        cols[name] = arr
        extra_fields.append(pa.field(name, arr.type))
    schema = rollout_schema(spec, extra_fields)
    table = pa.Table.from_arrays(list(cols.values()), schema=schema)
    if spec is None:
        validate_table(table, ids="distinct")
    else:  # the id range was checked per part above; distinct ids where the capture did not
        validate_table(table, ids="none")
        _check_distinct(table, spec, owing)
    mark_validated(table)
    return table
