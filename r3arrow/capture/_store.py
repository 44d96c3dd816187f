"""`TurnStore`: turn appends as Arrow record batches, assembled into a routes column
(``docs/design.md``, "Rows and incremental capture"; ``docs/capture.md``)."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import threading
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from r3arrow._routes import chunk, chunked_routes
from r3arrow._schema import MISSING_KEY, ROUTES_MISSING, missing_routes
from r3arrow._validated import mark_validated
from r3arrow.capture._trace import RouteTrace, owned, validate_route_rows
from r3arrow.errors import ContiguityError, R3ArrowError, SchemaError
from r3arrow.ids import check_routes
from r3arrow.spec import RouteSpec, numpy_to_routes, routes_to_numpy


@functools.lru_cache(maxsize=64)
def turn_schema(spec: RouteSpec, missing: bool = False) -> pa.Schema:
    """Schema of one turn batch: ``trajectory_id``, ``token_start``, ``routes`` and, with
    ``missing``, ``routes_missing`` (``large_list<uint8>``, one 0/1 per route row) and
    `MISSING_KEY` (``docs/fallback.md``)."""
    fields: list[pa.Field[Any]] = [
        pa.field("trajectory_id", pa.large_string(), nullable=False),
        pa.field("token_start", pa.int64(), nullable=False),
        pa.field("routes", spec.routes_type, nullable=False),
    ]
    meta = cast("dict[bytes | str, bytes | str]", spec.to_metadata())
    if missing:
        fields.append(pa.field(ROUTES_MISSING, pa.large_list(pa.uint8()), nullable=False))
        meta = {**meta, MISSING_KEY: b"1"}
    return pa.schema(fields, metadata=meta)


def _marks_column(marks: Sequence[np.ndarray]) -> pa.LargeListArray[Any]:
    """``large_list<uint8>`` of one mark list per entry of ``marks``."""
    offsets = np.cumsum([0, *(m.shape[0] for m in marks)], dtype=np.int64)
    flat = np.concatenate(marks) if marks else np.zeros(0, np.uint8)
    return pa.LargeListArray.from_arrays(
        pa.array(offsets, type=pa.int64()), pa.array(flat, type=pa.uint8())
    )


def _check_tid(trajectory_id: Any) -> None:
    if not isinstance(trajectory_id, str):
        raise TypeError(f"trajectory_id: expected a str, found {type(trajectory_id).__name__}")


@dataclasses.dataclass
class _Turn:
    """One turn: ``rows`` read-only, C-contiguous, in ``spec.dtype``; ``final``: the finalized
    buffer of a bound trace that ``rows`` slices; ``batch``: the turn as a record batch, cached;
    ``missing``: uint8 per row (1: a placeholder for a route that never arrived), or None.
    """

    tid: str
    start: int
    rows: np.ndarray
    spec: RouteSpec
    final: np.ndarray | None = None
    batch: pa.RecordBatch | None = None
    missing: np.ndarray | None = None

    def marks(self) -> np.ndarray:
        """uint8 per row: `missing`, or zeros."""
        if self.missing is not None:
            return self.missing
        return np.zeros(self.rows.shape[0], dtype=np.uint8)

    def record_batch(self) -> pa.RecordBatch:
        if self.batch is None:
            tid = pa.array([self.tid], type=pa.large_string())
            start = pa.array([self.start], type=pa.int64())
            col = chunk([self.rows], [self.rows.shape[0]], self.spec)
            cols: list[pa.Array[Any]] = [tid, start, col]
            if self.missing is not None:
                cols.append(_marks_column([self.missing]))
            schema = turn_schema(self.spec, self.missing is not None)
            self.batch = pa.RecordBatch.from_arrays(cols, schema=schema)
        return self.batch


class TurnStore:
    """Thread-safe append-only log of turn record batches for many trajectories.

    `trace` is the capture path (each turn validated once, by the trace); `append` and
    `append_batch` validate outside data with the same validator. Rows a trace marked missing
    (``on_short="mark"``, ``docs/fallback.md``) keep their marks: `routes_missing`, and a
    ``routes_missing`` column in `batches` / `to_table` when any row is marked.
    """

    def __init__(self, spec: RouteSpec) -> None:
        self.spec = spec
        self._turns: list[_Turn] = []
        self._log: list[_Turn | pa.RecordBatch] = []  # appends, in order, for `batches`
        self._lock = threading.Lock()

    def trace(self, trajectory_id: str) -> RouteTrace:
        """A `RouteTrace` that appends each turn it records here, at its ``token_start``.

        It starts at the store's spec (both widen when ``num_experts`` is None); on finalize its
        turns here become slices of the finalized rows. ``TypeError`` for a non-str id.
        """
        _check_tid(trajectory_id)
        mine: list[_Turn] = []

        def sink(
            token_start: int, rows: np.ndarray, spec: RouteSpec, marks: np.ndarray | None
        ) -> None:
            turn = _Turn(trajectory_id, token_start, rows, spec, missing=marks)
            self._add([turn], spec, turn)
            mine.append(turn)

        def final_sink(rows: np.ndarray, spec: RouteSpec) -> None:
            with self._lock:  # the same turns, now views of the one finalized buffer
                for turn in mine:
                    turn.rows = rows[turn.start : turn.start + turn.rows.shape[0]]
                    turn.spec, turn.batch, turn.final = spec, None, rows
            mine.clear()

        trace = RouteTrace(self.spec)
        trace._tid, trace._sink, trace._final_sink = trajectory_id, sink, final_sink
        return trace

    def append(self, trajectory_id: str, token_start: int, routes: Any) -> None:
        """Append outside rows ``[rows, L, K]`` at ``token_start``, validated.

        Raises `RouteShapeError`, `RouteDTypeError`, `ExpertRangeError`, `DuplicateExpertError`
        (with ``trajectory_id``) and `ContiguityError` (negative ``token_start``).
        """
        start = int(token_start)
        _check_tid(trajectory_id)
        what = f"turn of {trajectory_id!r}"
        if start < 0:
            raise ContiguityError(
                f"{what}: expected token_start >= 0, found {start}",
                trajectory_id=trajectory_id,
                token=start,
            )
        try:
            arr, spec, _ = validate_route_rows(routes, self.spec, what=what)
        except R3ArrowError as exc:
            if exc.trajectory_id is None:
                exc.trajectory_id = trajectory_id
            raise
        # Owned: a caller reusing its buffer cannot corrupt the store.
        turn = _Turn(trajectory_id, start, owned(arr, spec.dtype), spec)
        self._add([turn], spec, turn)

    def append_batch(self, batch: pa.RecordBatch) -> None:
        """Append a record batch of turns (schema `turn_schema`, with or without
        ``routes_missing``; any number of rows); `SchemaError` for bad marks as
        `r3arrow._schema.missing_routes` raises."""
        if batch.schema.names[:3] != (names := turn_schema(self.spec).names):
            raise SchemaError(f"turn batch: expected columns {names}, found {batch.schema.names}")
        spec = RouteSpec.from_schema(batch.schema)
        if not spec.same_shape(self.spec):
            raise SchemaError(f"turn batch: expected routes shaped like {self.spec}, found {spec}")
        col = cast("pa.LargeListArray[Any]", batch.column(2))
        if col.null_count or batch.column(0).null_count or batch.column(1).null_count:
            raise SchemaError("turn batch: expected no nulls")
        rows = routes_to_numpy(col.flatten(), spec)
        check_routes(rows, spec, what="turn batch")
        offsets = np.asarray(col.offsets, dtype=np.int64)
        bounds = (offsets - offsets[0]).tolist()
        starts = np.asarray(batch.column(1).to_numpy(zero_copy_only=False), dtype=np.int64)
        tids = batch.column(0).to_pylist()
        marks = missing_routes(batch)
        turns = [
            _Turn(
                str(t),
                s,
                rows[a:b],
                spec,
                missing=None if marks is None or not marks[a:b].any() else marks[a:b].copy(),
            )
            for t, s, (a, b) in zip(tids, starts.tolist(), itertools.pairwise(bounds), strict=True)
        ]
        self._add(turns, spec, batch)

    def _add(self, turns: list[_Turn], spec: RouteSpec, logged: _Turn | pa.RecordBatch) -> None:
        with self._lock:
            if spec.dtype.itemsize > self.spec.dtype.itemsize:
                if self.spec.num_experts is not None:
                    raise SchemaError(
                        f"turn batch: expected {self.spec.dtype} routes, found {spec.dtype}"
                    )
                self.spec = spec
            self._turns.extend(turns)
            self._log.append(logged)

    @property
    def num_turns(self) -> int:
        with self._lock:
            return len(self._turns)

    def batches(self) -> list[pa.RecordBatch]:
        with self._lock:
            return [e if isinstance(e, pa.RecordBatch) else e.record_batch() for e in self._log]

    def to_table(self) -> pa.Table:
        """All turns as one table (cast to the widest routes dtype; no copy otherwise), with a
        ``routes_missing`` column (zeros on whole turns) when any turn has a marked row."""
        with self._lock:
            marked = any(t.missing is not None for t in self._turns)
        if not marked:
            schema = turn_schema(self.spec)
            batches = [
                b if b.schema.equals(schema) else b.select([0, 1, 2]).cast(schema)
                for b in self.batches()
            ]
            return pa.Table.from_batches(batches, schema=schema)
        schema = turn_schema(self.spec, True)
        out = []
        for b in self.batches():
            if ROUTES_MISSING not in b.schema.names:
                lens = np.diff(np.asarray(cast("Any", b.column(2)).offsets, dtype=np.int64))
                zeros = _marks_column([np.zeros(int(n), np.uint8) for n in lens])
                b = pa.RecordBatch.from_arrays([*b.columns[:3], zeros], names=schema.names)
            else:
                b = b.select([*schema.names[:3], ROUTES_MISSING])
            out.append(b if b.schema.equals(schema) else b.cast(schema))
        return pa.Table.from_batches(out, schema=schema)

    def routes(self, trajectory_ids: Sequence[str] | pa.Array[Any]) -> pa.LargeListArray[Any]:
        """Routes column aligned with ``trajectory_ids`` (no turns: ``[]``), with one copy.

        Marked as checked for `r3arrow.rollout_table`. Raises `ContiguityError` when a
        trajectory's turns leave a gap, overlap or repeat (``token``: the first token not covered
        exactly once) and ``ValueError`` for repeated ids.
        """
        spec, items = self._plan(trajectory_ids)
        parts = [p for t in items for p in t]
        offsets = np.cumsum([0, *(sum(p.shape[0] for p in t) for t in items)], dtype=np.int64)
        values = np.empty((int(offsets[-1]), *spec.row_shape), dtype=spec.dtype)
        if parts:
            # Ids were checked on append; narrower turns are widened by this one copy.
            np.concatenate(parts, axis=0, out=values, casting="unsafe")
        out: pa.LargeListArray[Any] = pa.LargeListArray.from_arrays(
            pa.array(offsets, type=pa.int64()), numpy_to_routes(values, spec)
        )
        return mark_validated(out, spec=spec, max_id=_id_bound(spec))

    def routes_chunked(self, trajectory_ids: Sequence[str] | pa.Array[Any]) -> pa.ChunkedArray[Any]:
        """`routes` as a ``ChunkedArray`` referencing finalized buffers instead of copying them.

        A trajectory whose turns tile one read-only buffer is its own chunk; the others are joined.
        Same values, checks, errors and mark as `routes` (``docs/capture.md``).
        """
        spec, items = self._plan(trajectory_ids)
        return mark_validated(chunked_routes(items, spec), spec=spec, max_id=_id_bound(spec))

    def routes_missing(
        self, trajectory_ids: Sequence[str] | pa.Array[Any]
    ) -> pa.LargeListArray[Any] | None:
        """The ``routes_missing`` column (``large_list<uint8>``, one 0/1 per row of `routes`)
        aligned with ``trajectory_ids``, or None when none of their rows is marked; checks and
        errors as `routes` (``docs/fallback.md``)."""
        _, ordered = self._ordered(trajectory_ids)
        if not any(t.missing is not None for turns in ordered for t in turns):
            return None
        per = [
            np.concatenate([t.marks() for t in turns]) if turns else np.zeros(0, np.uint8)
            for turns in ordered
        ]
        return _marks_column(per)

    def _plan(
        self, trajectory_ids: Sequence[str] | pa.Array[Any]
    ) -> tuple[RouteSpec, list[list[np.ndarray]]]:
        """(spec, each wanted trajectory's turns as views in token order, or its finalized buffer
        when they tile it); `ContiguityError` unless each trajectory's turns tile ``[0, captured)``.
        """
        spec, ordered = self._ordered(trajectory_ids)
        items: list[list[np.ndarray]] = []
        for turns in ordered:
            rows = [t.rows for t in turns]
            finals = {id(t.final) for t in turns}
            f = turns[0].final if turns else None
            # A finalized trajectory's turns tile its buffer (checked): reference it whole.
            tiled = isinstance(f, np.ndarray) and f.shape[0] == sum(q.shape[0] for q in rows)
            if len(finals) == 1 and tiled:
                rows = [cast(np.ndarray, f)]
            items.append(rows)
        return spec, items

    def _ordered(
        self, trajectory_ids: Sequence[str] | pa.Array[Any]
    ) -> tuple[RouteSpec, list[list[_Turn]]]:
        """(spec, each wanted trajectory's turns in token order); `ContiguityError` unless each
        trajectory's turns tile ``[0, captured)``, ``ValueError`` for repeated ids."""
        wanted = pa.array(trajectory_ids, type=pa.large_string())
        if pc.count_distinct(wanted).as_py() != len(wanted):
            raise ValueError("trajectory_ids: expected unique ids, found duplicates")
        with self._lock:
            turns, spec = list(self._turns), self.spec
        pos = pc.index_in(pa.array([t.tid for t in turns], type=pa.large_string()), wanted)
        sel = np.flatnonzero(np.asarray(pc.is_valid(pos).to_numpy(zero_copy_only=False)))
        pos_np = np.asarray(pos.to_numpy(zero_copy_only=False))[sel].astype(np.int64)
        start = np.array([t.start for t in turns], dtype=np.int64)[sel]
        lens = np.array([t.rows.shape[0] for t in turns], dtype=np.int64)[sel]
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
        ordered: list[list[_Turn]] = [[] for _ in range(len(wanted))]
        for i, p in zip(sel[order].tolist(), pos_s.tolist(), strict=True):
            ordered[p].append(turns[i])
        return spec, ordered

    def clear(self) -> None:
        with self._lock:
            self._turns, self._log = [], []


def _id_bound(spec: RouteSpec) -> int:
    """An upper bound of the ids held: every turn was checked for its spec."""
    if spec.num_experts is not None:
        return spec.num_experts - 1
    return int(np.iinfo(spec.dtype).max)
