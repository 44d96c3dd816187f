"""`TurnStore`: turn appends as Arrow record batches, assembled into a routes column.

Many agent loops append concurrently (one record batch per turn: trajectory id,
token start, routes). `TurnStore.routes` builds the ragged per-trajectory
``large_list`` column with one gather (one copy of the route bytes), after
checking that each trajectory's turns tile ``[0, captured)`` exactly;
`TurnStore.routes_chunked` builds the same column as a ``ChunkedArray`` that references
each finalized trajectory's buffer without a copy (``docs/capture.md``).

Two ways in (``docs/design.md``, "Rows and incremental capture"):

* `TurnStore.trace` returns a `RouteTrace` bound to the store. The trace validates
  each turn once (`RouteTrace.record`) and hands it over; the store appends it as
  one record batch without a second check. This is the capture path. When the trace
  is finalized, the store swaps the trajectory's turns for slices of the finalized
  buffer (same turns, same starts: the per-turn arrays are released), so
  `routes_chunked` can reference it.
* `TurnStore.append` / `TurnStore.append_batch` take outside data and validate it
  (a trust boundary), with the same validator the trace uses.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from r3arrow._routes import chunked_routes
from r3arrow._validated import mark_validated
from r3arrow.capture._trace import RouteTrace, validate_route_rows
from r3arrow.errors import ContiguityError, R3ArrowError, SchemaError
from r3arrow.ids import check_routes
from r3arrow.spec import RouteSpec, numpy_to_routes, routes_to_numpy


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


@dataclasses.dataclass
class _Entry:
    """One appended batch of turns: a bound trace's turn, or a batch from outside.

    ``rows`` ``[n, L, K]`` (read-only, C-contiguous, ``spec.dtype``) hold the turns back to
    back, turn ``i`` at ``rows[offsets[i]:offsets[i + 1]]``; ``batch`` is the record batch,
    built on demand for a trace's turns (appending stays a few list operations).
    """

    tids: list[str]
    starts: np.ndarray  # int64 [turns]
    rows: np.ndarray
    offsets: np.ndarray  # int64 [turns + 1], from 0
    spec: RouteSpec
    batch: pa.RecordBatch | None = None
    final: np.ndarray | None = None  # the finalized trajectory ``rows`` slices (a bound trace)

    def record_batch(self) -> pa.RecordBatch:
        if self.batch is None:
            self.batch = _batch_of(self.spec, self.tids[0], int(self.starts[0]), self.rows)
        return self.batch


class TurnStore:
    """Thread-safe append-only log of turn record batches for many trajectories.

    Beside each batch it keeps the numpy view of its route rows (taken once, at
    append), so assembling the routes column is one gather, not a walk over Arrow
    objects per turn.

    Capture with ``trace = store.trace(trajectory_id)`` and pass ``trace`` to the
    engine client (or call ``trace.record``): each turn is validated once by the
    trace and appended here as one batch. `append` and `append_batch` validate
    outside data. ``trace.finalize(...)`` swaps the trajectory's turns for slices of the
    finalized buffer; `routes_chunked` then references that buffer without a copy.
    """

    _NAMES = ("trajectory_id", "token_start", "routes")

    def __init__(self, spec: RouteSpec) -> None:
        self.spec = spec
        self._entries: list[_Entry] = []
        self._lock = threading.Lock()

    def trace(self, trajectory_id: str) -> RouteTrace:
        """A new `RouteTrace` for ``trajectory_id`` that records into this store.

        Each ``trace.record(...)`` validates the turn once (shape, dtype, id range,
        distinct experts, row count, and the prompt ids when given) and appends it here
        as one record batch at ``token_start = trace.captured`` before the turn, without
        a second check; on any error neither the trace nor the store changes. The trace
        starts at this store's current spec (with ``num_experts=None`` both widen as
        larger ids arrive). ``trace.finalize(...)`` replaces the turns it recorded here by
        slices of its finalized rows (same values and starts), releasing the per-turn
        arrays. Raises ``TypeError`` if ``trajectory_id`` is not a ``str``.
        """
        if not isinstance(trajectory_id, str):
            raise TypeError(f"trajectory_id: expected a str, found {type(trajectory_id).__name__}")
        mine: list[_Entry] = []

        def sink(token_start: int, rows: np.ndarray, spec: RouteSpec) -> None:
            mine.append(self._append_trusted(trajectory_id, token_start, rows, spec))

        def final_sink(starts: list[int], rows: np.ndarray, spec: RouteSpec) -> None:
            ends = [*starts[1:], rows.shape[0]]
            with self._lock:  # the same rows, now views of the one finalized buffer
                for entry, a, b in zip(mine, starts, ends, strict=True):
                    entry.rows, entry.spec, entry.batch = rows[a:b], spec, None
                    entry.final = rows
            mine.clear()

        return RouteTrace._bound(self.spec, trajectory_id, sink, final_sink)

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
    ) -> _Entry:
        """Append validated, owned rows (storage dtype of ``spec``, C-contiguous): no checks."""
        entry = _Entry(
            [trajectory_id],
            np.array([token_start], dtype=np.int64),
            rows,
            np.array([0, rows.shape[0]], dtype=np.int64),
            spec,
        )
        self._add(entry)
        return entry

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
        tids = [str(t) for t in batch.column(0).to_pylist()]
        starts = np.asarray(batch.column(1).to_numpy(zero_copy_only=False), dtype=np.int64)
        self._add(_Entry(tids, starts, rows, offsets - offsets[0], spec, batch))

    def _add(self, entry: _Entry) -> None:
        spec = entry.spec
        with self._lock:
            if spec.dtype.itemsize > self.spec.dtype.itemsize:
                if self.spec.num_experts is not None:
                    raise SchemaError(
                        f"turn batch: expected {self.spec.dtype} routes, found {spec.dtype}"
                    )
                self.spec = spec
            self._entries.append(entry)

    @property
    def num_turns(self) -> int:
        with self._lock:
            return sum(len(e.tids) for e in self._entries)

    def batches(self) -> list[pa.RecordBatch]:
        with self._lock:
            return [e.record_batch() for e in self._entries]

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

        One buffer: every route is copied once (`routes_chunked` avoids the copy). Every
        turn was checked on its way in, so `r3arrow.rollout_table` does not check the
        column's ids again (`r3arrow.capture._trace.checked_for`).
        Raises `ContiguityError` if a trajectory's turns leave a gap, overlap, or
        repeat a turn (``trajectory_id`` set, ``token`` = the first token not covered
        exactly once); ``ValueError`` if ``trajectory_ids`` repeats an id.
        """
        wanted, plan, spec = self._plan(trajectory_ids)
        views, turns, pos_s, lens_s, _ = plan
        values = _gather(views, turns, spec)
        per_traj = np.bincount(pos_s, weights=lens_s, minlength=len(wanted)).astype(np.int64)
        offsets = np.zeros(len(wanted) + 1, dtype=np.int64)
        np.cumsum(per_traj, out=offsets[1:])
        out: pa.LargeListArray[Any] = pa.LargeListArray.from_arrays(
            pa.array(offsets, type=pa.int64()), numpy_to_routes(values, spec)
        )
        mark_validated(out, spec=spec, max_id=_id_bound(spec))
        return out

    def routes_chunked(self, trajectory_ids: Sequence[str] | pa.Array[Any]) -> pa.ChunkedArray[Any]:
        """`routes` as a ``ChunkedArray`` that references finalized buffers (no copy).

        A trajectory whose turns are consecutive slices of one read-only buffer (a finalized
        bound trace's, or a single turn) becomes its own chunk referencing that buffer;
        the others (and small ones) are joined into shared chunks (one copy of their rows).
        Same values, order, checks and errors as `routes`; consumers must accept many chunks
        (``docs/capture.md``). Like `routes`' column, the result is known to
        `r3arrow.rollout_table` as checked (its ids are not checked again).
        """
        wanted, plan, spec = self._plan(trajectory_ids)
        views, turns, pos_s, _, finals = plan
        per_traj: list[list[np.ndarray]] = [[] for _ in range(len(wanted))]
        whole: list[Any] = [None] * len(wanted)  # the one finalized buffer, False if several
        parts, which = _turn_parts(views, turns, with_entries=True)
        for part, c, p in zip(parts, which, pos_s.tolist(), strict=True):
            per_traj[p].append(part)
            f = finals[c]
            whole[p] = f if whole[p] is None or whole[p] is f else False
        items: list[Sequence[np.ndarray]] = [
            # A finalized trajectory's turns tile its buffer (checked above): reference it whole.
            [f] if isinstance(f, np.ndarray) and f.shape[0] == sum(q.shape[0] for q in t) else t
            for t, f in zip(per_traj, whole, strict=True)
        ]
        out = chunked_routes(items, spec)
        mark_validated(out, spec=spec, max_id=_id_bound(spec))
        return out

    def _plan(
        self, trajectory_ids: Sequence[str] | pa.Array[Any]
    ) -> tuple[
        pa.Array[Any],
        tuple[
            list[tuple[np.ndarray, np.ndarray]],
            np.ndarray,
            np.ndarray,
            np.ndarray,
            list[np.ndarray | None],
        ],
        RouteSpec,
    ]:
        """The wanted ids, (views, global turns in output order, their rows, lengths, each
        entry's finalized buffer), spec.

        Checks that each wanted trajectory's turns tile ``[0, captured)`` exactly.
        """
        wanted = pa.array(trajectory_ids, type=pa.large_string())
        if pc.count_distinct(wanted).as_py() != len(wanted):
            raise ValueError("trajectory_ids: expected unique ids, found duplicates")
        with self._lock:
            entries, spec = list(self._entries), self.spec
            views = [(e.rows, e.offsets) for e in entries]
            finals = [e.final for e in entries]
        turn_ids = pa.array([t for e in entries for t in e.tids], type=pa.large_string())
        pos = pc.index_in(turn_ids, value_set=wanted)
        sel = np.flatnonzero(np.asarray(pc.is_valid(pos).to_numpy(zero_copy_only=False)))
        pos_np = np.asarray(pos.to_numpy(zero_copy_only=False))[sel].astype(np.int64)
        starts = [e.starts for e in entries]
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
        return wanted, (views, sel[order], pos_s, lens_s, finals), spec

    def clear(self) -> None:
        with self._lock:
            self._entries = []


def _id_bound(spec: RouteSpec) -> int:
    """An upper bound of the ids this store holds: every turn was checked for its spec."""
    if spec.num_experts is not None:
        return spec.num_experts - 1
    return int(np.iinfo(spec.dtype).max)


def _turn_parts(
    views: list[tuple[np.ndarray, np.ndarray]], turns: np.ndarray, *, with_entries: bool = False
) -> tuple[list[np.ndarray], list[int]]:
    """Zero-copy views of the given turns' rows (global turn indices, in that order), and the
    entry each comes from (only ``with_entries``; else ``[]``).

    A loop per turn slices views (cheap next to any copy of the rows).
    """
    first_turn = np.cumsum([0] + [off.size - 1 for _, off in views])
    which = (np.searchsorted(first_turn, turns, side="right") - 1).tolist()
    local = (turns - first_turn[which]).tolist()
    parts = [
        views[c][0][views[c][1][r] : views[c][1][r + 1]] for c, r in zip(which, local, strict=True)
    ]
    return parts, which if with_entries else []


def _gather(
    views: list[tuple[np.ndarray, np.ndarray]], turns: np.ndarray, spec: RouteSpec
) -> np.ndarray:
    """Rows of the given turns (global turn indices, in order), concatenated: one copy.

    Narrower batches are widened by the same copy.
    """
    parts, _ = _turn_parts(views, turns)
    out = np.empty((sum(p.shape[0] for p in parts), *spec.row_shape), dtype=spec.dtype)
    if parts:
        np.concatenate(parts, axis=0, out=out, casting="unsafe")  # ids were checked on append
    return out


__all__ = ["TurnStore", "turn_batch", "turn_schema"]
