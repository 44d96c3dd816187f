"""`TurnStore`: turn appends as Arrow record batches, assembled into a routes column.

Many agent loops append concurrently (one record batch per turn: trajectory id,
token start, routes). `TurnStore.routes` builds the ragged per-trajectory
``large_list`` column with one gather (one copy of the route bytes), after
checking that each trajectory's turns tile ``[0, captured)`` exactly.

Two ways in (``docs/design.md``, "Rows and incremental capture"):

* `TurnStore.trace` returns a `RouteTrace` bound to the store. The trace validates
  each turn once (`RouteTrace.record`) and hands it over; the store appends it as
  one record batch without a second check. This is the capture path.
* `TurnStore.append` / `TurnStore.append_batch` take outside data and validate it
  (a trust boundary), with the same validator the trace uses.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from r3arrow.errors import ContiguityError, R3ArrowError, SchemaError
from r3arrow.ids import check_routes
from r3arrow.spec import RouteSpec, numpy_to_routes, routes_to_numpy
from r3arrow.trace import RouteTrace, validate_route_rows


@functools.lru_cache(maxsize=64)
def turn_schema(spec: RouteSpec) -> pa.Schema:
    """Schema of one turn batch: ``trajectory_id``, ``token_start``, ``routes``."""
    fields: list[pa.Field[Any]] = [
        pa.field("trajectory_id", pa.large_string(), nullable=False),
        pa.field("token_start", pa.int64(), nullable=False),
        pa.field("routes", spec.routes_type, nullable=False),
    ]
    meta = cast("dict[bytes | str, bytes | str]", spec.to_metadata())
    return pa.schema(fields, metadata=meta)


def _turn_rows(
    spec: RouteSpec, trajectory_id: str, token_start: int, routes: Any
) -> tuple[np.ndarray, RouteSpec]:
    """Validated rows ``[rows, L, K]`` in storage dtype, owned (writable input is copied)."""
    if not isinstance(trajectory_id, str):
        raise TypeError(f"trajectory_id: expected a str, found {type(trajectory_id).__name__}")
    what = f"turn of {trajectory_id!r}"
    if token_start < 0:
        raise ContiguityError(
            f"{what}: expected token_start >= 0, found {token_start}",
            trajectory_id=trajectory_id,
            token=token_start,
        )
    try:
        arr, spec = validate_route_rows(routes, spec, what=what)
    except R3ArrowError as exc:
        if exc.trajectory_id is None:
            exc.trajectory_id = trajectory_id
        raise
    if arr.dtype != spec.dtype or arr.flags.writeable or not arr.flags.c_contiguous:
        arr = arr.astype(spec.dtype, order="C")  # a caller reusing its buffer cannot corrupt it
        arr.flags.writeable = False
    return arr, spec


def _batch_of(
    spec: RouteSpec, trajectory_id: str, token_start: int, rows: np.ndarray
) -> pa.RecordBatch:
    tokens = numpy_to_routes(rows, spec)
    col = pa.LargeListArray.from_arrays(pa.array([0, len(tokens)], type=pa.int64()), tokens)
    return pa.RecordBatch.from_arrays(
        [
            pa.array([trajectory_id], type=pa.large_string()),
            pa.array([token_start], type=pa.int64()),
            col,
        ],
        schema=turn_schema(spec),
    )


def turn_batch(
    spec: RouteSpec, trajectory_id: str, token_start: int, routes: Any
) -> pa.RecordBatch:
    """One turn as a one-row record batch (routes ``[rows, L, K]``, validated, storage dtype)."""
    rows, spec = _turn_rows(spec, trajectory_id, token_start, routes)
    return _batch_of(spec, trajectory_id, token_start, rows)


class TurnStore:
    """Thread-safe append-only log of turn record batches for many trajectories.

    Beside each batch it keeps the numpy view of its route rows (taken once, at
    append), so assembling the routes column is one gather, not a walk over Arrow
    objects per turn.

    Capture with ``trace = store.trace(trajectory_id)`` and pass ``trace`` to the
    engine client (or call ``trace.record``): each turn is validated once by the
    trace and appended here as one batch. `append` and `append_batch` validate
    outside data.
    """

    _NAMES = ("trajectory_id", "token_start", "routes")

    def __init__(self, spec: RouteSpec) -> None:
        self.spec = spec
        self._batches: list[pa.RecordBatch] = []
        self._views: list[tuple[np.ndarray, np.ndarray]] = []  # (rows [n, L, K], offsets [turns+1])
        self._lock = threading.Lock()

    def trace(self, trajectory_id: str) -> RouteTrace:
        """A new `RouteTrace` for ``trajectory_id`` that records into this store.

        Each ``trace.record(...)`` validates the turn once (shape, dtype, id range,
        distinct experts, row count, and the prompt ids when given) and appends it here
        as one record batch at ``token_start = trace.captured`` before the turn, without
        a second check; on any error neither the trace nor the store changes. The trace
        starts at this store's current spec (with ``num_experts=None`` both widen as
        larger ids arrive).
        Raises ``TypeError`` if ``trajectory_id`` is not a ``str``.
        """
        if not isinstance(trajectory_id, str):
            raise TypeError(f"trajectory_id: expected a str, found {type(trajectory_id).__name__}")

        def sink(token_start: int, rows: np.ndarray, spec: RouteSpec) -> None:
            self._append_trusted(trajectory_id, token_start, rows, spec)

        return RouteTrace._bound(self.spec, trajectory_id, sink)

    def append(self, trajectory_id: str, token_start: int, routes: Any) -> None:
        """Append one turn's rows ``[rows, L, K]`` (outside data: validated) at ``token_start``.

        Raises `RouteShapeError`, `RouteDTypeError`, `ExpertRangeError`,
        `DuplicateExpertError` (bad rows, ``trajectory_id`` set) and `ContiguityError`
        (negative ``token_start``).
        """
        rows, spec = _turn_rows(self.spec, trajectory_id, int(token_start), routes)
        self._append_trusted(trajectory_id, int(token_start), rows, spec)

    def _append_trusted(
        self, trajectory_id: str, token_start: int, rows: np.ndarray, spec: RouteSpec
    ) -> None:
        """Append validated, owned rows (storage dtype of ``spec``, C-contiguous): no checks."""
        batch = _batch_of(spec, trajectory_id, token_start, rows)
        self._add(batch, spec, rows, np.array([0, rows.shape[0]], dtype=np.int64))

    def append_batch(self, batch: pa.RecordBatch) -> None:
        """Append a record batch of turns (schema `turn_schema`; any number of rows)."""
        if tuple(batch.schema.names[:3]) != self._NAMES:
            raise SchemaError(
                f"turn batch: expected columns {list(self._NAMES)}, found {batch.schema.names}"
            )
        spec = RouteSpec.from_schema(batch.schema)
        if not spec.same_shape(self.spec):
            raise SchemaError(f"turn batch: expected routes shaped like {self.spec}, found {spec}")
        col = cast("pa.LargeListArray[Any]", batch.column(2))
        if col.null_count or batch.column(0).null_count or batch.column(1).null_count:
            raise SchemaError("turn batch: expected no nulls")
        offsets = np.asarray(col.offsets, dtype=np.int64)
        rows = routes_to_numpy(col.flatten(), spec)
        check_routes(rows, spec, what="turn batch")
        self._add(batch, spec, rows, offsets - offsets[0])

    def _add(
        self, batch: pa.RecordBatch, spec: RouteSpec, rows: np.ndarray, offsets: np.ndarray
    ) -> None:
        with self._lock:
            if spec.dtype.itemsize > self.spec.dtype.itemsize:
                if self.spec.num_experts is not None:
                    raise SchemaError(
                        f"turn batch: expected {self.spec.dtype} routes, found {spec.dtype}"
                    )
                self.spec = spec
            self._batches.append(batch)
            self._views.append((rows, offsets))

    @property
    def num_turns(self) -> int:
        return sum(b.num_rows for b in self._batches)

    def batches(self) -> list[pa.RecordBatch]:
        with self._lock:
            return list(self._batches)

    def to_table(self) -> pa.Table:
        """All turns as one table (batches cast to the widest routes dtype; no copy otherwise)."""
        schema = turn_schema(self.spec)
        batches = [
            b if b.schema.equals(schema) else b.select([0, 1, 2]).cast(schema)
            for b in self.batches()
        ]
        return pa.Table.from_batches(batches, schema=schema)

    def routes(self, trajectory_ids: Sequence[str] | pa.Array[Any]) -> pa.LargeListArray[Any]:
        """Routes column aligned with ``trajectory_ids`` (a trajectory with no turns gets []).

        Raises `ContiguityError` if a trajectory's turns leave a gap, overlap, or
        repeat a turn (``trajectory_id`` set, ``token`` = the first token not covered
        exactly once); ``ValueError`` if ``trajectory_ids`` repeats an id.
        """
        wanted = pa.array(trajectory_ids, type=pa.large_string())
        if pc.count_distinct(wanted).as_py() != len(wanted):
            raise ValueError("trajectory_ids: expected unique ids, found duplicates")
        with self._lock:
            batches, views, spec = list(self._batches), list(self._views), self.spec
        turn_ids = pa.chunked_array([b.column(0) for b in batches], type=pa.large_string())
        pos = pc.index_in(turn_ids, value_set=wanted)
        sel = np.flatnonzero(np.asarray(pc.is_valid(pos).to_numpy(zero_copy_only=False)))
        pos_np = np.asarray(pos.to_numpy(zero_copy_only=False))[sel].astype(np.int64)
        starts = [np.asarray(b.column(1).to_numpy()) for b in batches]
        start = (np.concatenate(starts) if starts else np.zeros(0, np.int64))[sel]
        lens_all = [np.diff(off) for _, off in views]
        lens = (np.concatenate(lens_all) if lens_all else np.zeros(0, np.int64))[sel]
        order = np.lexsort((start, pos_np))
        pos_s, start_s, lens_s = pos_np[order], start[order], lens[order]
        first = np.ones(order.size, dtype=bool)
        first[1:] = pos_s[1:] != pos_s[:-1]
        expect = np.where(first, 0, np.concatenate([[0], start_s[:-1] + lens_s[:-1]]))
        bad = np.flatnonzero(start_s != expect)
        if bad.size:
            k = int(bad[0])
            tid = wanted[int(pos_s[k])].as_py()
            kind = (
                "a repeated turn"
                if not first[k] and start_s[k] == start_s[k - 1]
                else "an overlap"
                if start_s[k] < expect[k]
                else "a gap"
            )
            raise ContiguityError(
                f"trajectory {tid!r}: expected a turn starting at token {int(expect[k])}, "
                f"found one at {int(start_s[k])} ({kind})",
                trajectory_id=tid,
                token=min(int(expect[k]), int(start_s[k])),
            )
        values = _gather(views, sel[order], spec)
        per_traj = np.bincount(pos_s, weights=lens_s, minlength=len(wanted)).astype(np.int64)
        offsets = np.zeros(len(wanted) + 1, dtype=np.int64)
        np.cumsum(per_traj, out=offsets[1:])
        out: pa.LargeListArray[Any] = pa.LargeListArray.from_arrays(
            pa.array(offsets, type=pa.int64()), numpy_to_routes(values, spec)
        )
        return out

    def clear(self) -> None:
        with self._lock:
            self._batches = []
            self._views = []


def _gather(
    views: list[tuple[np.ndarray, np.ndarray]], turns: np.ndarray, spec: RouteSpec
) -> np.ndarray:
    """Rows of the given turns (global turn indices, in order), concatenated: one copy.

    A loop per turn slices zero-copy views (cheap next to the copy); narrower
    batches are widened by the same copy.
    """
    first_turn = np.cumsum([0] + [off.size - 1 for _, off in views])
    which = np.searchsorted(first_turn, turns, side="right") - 1
    local = turns - first_turn[which]
    parts = [
        views[c][0][views[c][1][r] : views[c][1][r + 1]]
        for c, r in zip(which.tolist(), local.tolist(), strict=True)
    ]
    out = np.empty((sum(p.shape[0] for p in parts), *spec.row_shape), dtype=spec.dtype)
    if parts:
        np.concatenate(parts, axis=0, out=out, casting="unsafe")  # ids were checked on append
    return out


__all__ = ["TurnStore", "turn_batch", "turn_schema"]
