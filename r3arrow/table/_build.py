"""`rollout_table`: build and validate a rollout table from per-trajectory columns.

Routes are range-checked per part before any join into the storage dtype, so the narrowing
cast never wraps; the routes column references each finalized trace's buffer where it can
(``docs/capture.md``), and arrays a `RouteTrace` finalized are not id-checked again
(`r3arrow._validated.checked_for`). The result is validated and marked so.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from r3arrow._routes import chunk, chunked, chunked_routes
from r3arrow._schema import MISSING_KEY, ROUTES_MISSING, rollout_schema
from r3arrow._validated import checked_for, mark_validated
from r3arrow.errors import RouteShapeError, SchemaError
from r3arrow.spec import RouteSpec, routes_to_numpy
from r3arrow.table._validate import check_chunk_ids, validate_table


def _check_rows(name: str, rows: int, found: int) -> None:
    if found != rows:
        raise SchemaError(f"{name}: expected {rows} rows (one per trajectory), found {found}")


#: The exact range of each list value type `rollout_table` converts to.
_BOUNDS = {"int32": (-(2**31), 2**31 - 1), "uint8": (0, 2**8 - 1)}


def _fits(values: pa.Array[Any], typ: pa.DataType, mask: bool) -> Any:
    """Per value of a list column's ``values``, whether it converts to ``typ`` exactly (a
    boolean array, null stays null); ``None`` when no value of this type can: ints and
    integral floats, and for a ``mask`` bools (``True`` is 1)."""
    t = values.type
    if pa.types.is_null(t) or (mask and pa.types.is_boolean(t)):
        return pc.is_valid(values)
    if not (pa.types.is_integer(t) or pa.types.is_floating(t)):
        return None
    lo, hi = _BOUNDS[str(typ)]
    ok: Any = pc.and_(pc.greater_equal(values, lo), pc.less_equal(values, hi))  # type: ignore[call-overload]
    return pc.and_(ok, pc.equal(values, pc.floor(values))) if pa.types.is_floating(t) else ok


def _large_list(
    values: Any, value_type: pa.DataType, name: str, tids: pa.Array[Any], *, mask: bool = False
) -> pa.Array[Any]:
    """A column of per-trajectory sequences (Arrow, numpy arrays or Python lists, one per row
    of ``tids``) as ``large_list<value_type>``, nulls kept; `SchemaError` naming the row for
    a value it does not hold exactly (`_fits`)."""
    want = pa.large_list(value_type)
    if isinstance(values, pa.ChunkedArray):
        values = values.combine_chunks()
    try:
        if isinstance(values, pa.Array):
            arr = values
        elif len(values) and all(isinstance(v, np.ndarray) for v in values):
            offsets = pa.array(np.cumsum([0, *map(len, values)]), type=pa.int64())
            arr = pa.LargeListArray.from_arrays(offsets, pa.array(np.concatenate(values)))
        else:  # types inferred, never a lossy conversion on the way in
            arr = pa.array(values)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, ValueError) as exc:
        raise SchemaError(
            f"{name}: expected a sequence of {value_type} lists, found {exc}"
        ) from exc
    _check_rows(name, len(tids), len(arr))
    if pa.types.is_null(arr.type):  # no row has a list: the nulls are refused by validation
        return pa.nulls(len(arr), want)
    if not (pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type)):
        raise SchemaError(f"{name}: expected {want}, found {arr.type}")
    lists = cast("pa.LargeListArray[Any]", arr)
    flat = lists.flatten()
    ok = _fits(flat, value_type, mask)
    what = "0 or 1 (bools, ints or integral floats)" if mask else f"integral {value_type} token ids"
    if ok is None:
        raise SchemaError(f"{name}: expected {what}, found {flat.type} values")
    if (bad := np.flatnonzero(~ok.fill_null(True).to_numpy(zero_copy_only=False))).size:
        starts = np.asarray(lists.offsets, dtype=np.int64)
        row = int(np.searchsorted(starts - starts[0], bad[0], side="right")) - 1
        raise SchemaError(
            f"row {row}: {name}: expected {what}, found {flat[int(bad[0])].as_py()!r}",
            row=row,
            trajectory_id=tids[row].as_py(),
        )
    return lists if lists.type == want else lists.cast(want)


def _column(values: Any, typ: pa.DataType | None, name: str, rows: int) -> pa.Array[Any]:
    """A column of ``typ`` (None: as given or inferred) with ``rows`` values; nulls are kept."""
    try:
        arr = values.combine_chunks() if isinstance(values, pa.ChunkedArray) else pa.array(values)
        arr = arr if typ is None else arr.cast(typ)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, TypeError) as exc:
        raise SchemaError(f"{name}: expected values convertible to {typ}, found {exc}") from exc
    _check_rows(name, rows, len(arr))
    return arr


Owing = list[tuple[int, np.ndarray, np.ndarray]]  # (first row, flat rows, lengths) per part


def _range_checked(owing: Owing, spec: RouteSpec, ids: pa.Table) -> RouteSpec:
    """``spec`` (widened without ``num_experts``) once the parts' id range is checked."""
    hi = max((check_chunk_ids(ids, f, n, spec, b, "range") for b, f, n in owing), default=-1)
    return spec.widened_for(hi) if spec.num_experts is None else spec


def _from_column(
    routes: pa.LargeListArray[Any] | pa.ListArray[Any] | pa.ChunkedArray[Any],
    spec: RouteSpec,
    ids: pa.Table,
) -> tuple[pa.ChunkedArray[Any], RouteSpec, Owing]:
    """A list column's chunks re-wrapped, referencing their rows (a copy only to cast)."""
    chunks = list(routes.chunks) if isinstance(routes, pa.ChunkedArray) else [routes]
    owing: Owing = []
    base = 0
    for ch in chunks:
        if not isinstance(ch, pa.LargeListArray | pa.ListArray):
            raise SchemaError(f"routes: expected a list column, found {ch.type}")
        if ch.null_count:  # a null row's values would be dropped by flatten: refuse first
            first = base + int(np.flatnonzero(np.asarray(ch.is_null()))[0])
            raise SchemaError(
                f"routes: expected no null trajectory rows, found {ch.null_count} "
                f"(first: row {first})",
                row=first,
            )
        lens = np.diff(np.asarray(ch.offsets, dtype=np.int64))
        owing.append((base, routes_to_numpy(ch.flatten(), spec), lens))
        base += len(ch)
    _check_rows("routes", ids.num_rows, base)
    if checked_for(routes, spec):  # a TurnStore's column: every turn was checked
        return chunked(chunks, type=spec.routes_type), spec, []
    spec = _range_checked(owing, spec, ids)
    wrapped = [chunk([f], n.tolist(), spec) for _, f, n in owing] or [chunk([], [], spec)]
    return chunked(wrapped, type=spec.routes_type), spec, owing


def _from_sequence(
    routes: Any, spec: RouteSpec, ids: pa.Table
) -> tuple[pa.ChunkedArray[Any], RouteSpec, Owing]:
    """Finalized per-trajectory arrays (numpy or Arrow) as a column, without copying buffers
    where they can be referenced (`chunked_routes`)."""
    given = list(routes)
    _check_rows("routes", ids.num_rows, len(given))
    owing: Owing = []
    for i, r in enumerate(given):
        if checked_for(r, spec):  # finalized by a RouteTrace: ids checked
            continue
        p = np.asarray(routes_to_numpy(r, spec) if isinstance(r, pa.Array | pa.ChunkedArray) else r)
        if p.ndim != 3 or p.shape[1:] != spec.row_shape or p.dtype.kind not in "iu":
            raise RouteShapeError(
                f"routes[{i}]: expected integer [rows, {spec.num_layers}, {spec.topk}], "
                f"found {p.dtype} {list(p.shape)}",
                row=i,
            )
        owing.append((i, p, np.array([p.shape[0]], dtype=np.int64)))
    spec = _range_checked(owing, spec, ids)
    parts = {i: p for i, p, _ in owing}
    items: list[Sequence[np.ndarray] | pa.Array[Any]] = []
    for i, r in enumerate(given):
        if i in parts:
            items.append([parts[i]])
        elif r.type == spec.arrow_type:
            items.append(r)
        else:  # checked, but narrower than a widened spec: cast by the join
            items.append([routes_to_numpy(r)])
    return chunked_routes(items, spec), spec, owing


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
    routes_missing: Any = None,
    **extra: Any,
) -> pa.Table:
    """Build and validate a rollout table (schema rollout.v1, spec in the metadata), marked
    validated. Token ids and ``loss_mask`` (Arrow, numpy or Python lists) hold integers or
    integral floats that fit int32 / uint8 (masks: 0 or 1, bools allowed), never converted
    lossily. ``routes``: per-trajectory arrays (Arrow or numpy ``[rows, L, K]``) or a
    ``large_list`` column of ``spec``; neither for R3 off. ``routes_missing`` (with
    ``routes``; None: no column): one 0/1 list per trajectory, one mark per route row (1: a
    placeholder for a route that never arrived, ``docs/fallback.md``), stored as
    ``large_list<uint8>`` after ``routes`` with the `MISSING_KEY` metadata. Extra keyword
    columns follow. ``TypeError`` for one of ``routes`` / ``spec`` alone, ``routes_missing``
    without them or a bad ``spec``; `SchemaError`,
    `RouteShapeError`, `ExpertRangeError`, `DuplicateExpertError`, `TerminalGapError` for bad
    data (``row``, ``trajectory_id`` set).
    """
    if (routes is None) != (spec is None):
        given, missing = ("routes", "spec") if spec is None else ("spec", "routes")
        raise TypeError(
            f"rollout_table: expected routes and spec together (or neither, R3 off), "
            f"found {given}= without {missing}="
        )
    if spec is not None and not isinstance(spec, RouteSpec):
        raise TypeError(f"rollout_table: expected spec to be a RouteSpec, found {type(spec)}")
    if routes_missing is not None and spec is None:
        raise TypeError(
            "rollout_table: expected routes_missing= with routes= and spec=, found it without"
        )
    rows = len(trajectory_id)
    tids = _column(trajectory_id, pa.large_string(), "trajectory_id", rows)
    cols: dict[str, pa.Array[Any] | pa.ChunkedArray[Any]] = {
        "trajectory_id": tids,
        "group_id": _column(group_id, pa.large_string(), "group_id", rows),
        "prompt_ids": _large_list(prompt_ids, pa.int32(), "prompt_ids", tids),
        "response_ids": _large_list(response_ids, pa.int32(), "response_ids", tids),
        "loss_mask": _large_list(loss_mask, pa.uint8(), "loss_mask", tids, mask=True),
        "reward": _column(reward, pa.float64(), "reward", rows),
    }
    owing: Owing = []
    if spec is not None:
        ids = pa.table({"trajectory_id": cols["trajectory_id"]})
        is_col = isinstance(routes, pa.LargeListArray | pa.ListArray | pa.ChunkedArray)
        build = _from_column if is_col else _from_sequence
        cols["routes"], spec, owing = build(routes, spec, ids)
    extra_fields = []
    if routes_missing is not None:
        marks = _large_list(routes_missing, pa.uint8(), ROUTES_MISSING, tids, mask=True)
        cols[ROUTES_MISSING] = marks
        extra_fields.append(pa.field(ROUTES_MISSING, marks.type))
    for name, values in extra.items():
        if name in cols or name in ("routes", ROUTES_MISSING):
            raise SchemaError(f"extra column {name!r} collides with a core column")
        arr = _column(values, None, name, rows)
        cols[name] = arr
        extra_fields.append(pa.field(name, arr.type))
    schema = rollout_schema(spec, extra_fields)
    if routes_missing is not None:
        schema = schema.with_metadata({**(schema.metadata or {}), MISSING_KEY: b"1"})
    table = pa.Table.from_arrays(list(cols.values()), schema=schema)
    if spec is None:
        validate_table(table, ids="distinct")
    else:  # the id range was checked per part above; distinct ids where the capture did not
        validate_table(table, ids="none")
        for base, flat, lens in owing:
            check_chunk_ids(table, flat, lens, spec, base, "distinct")
    mark_validated(table)
    return table
