"""`TurnStore`: turn appends as Arrow record batches, assembled into a routes column.

``docs/design.md``, "Rows and incremental capture"; ``docs/capture.md``.
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

_NO_INTS = np.zeros(0, dtype=np.int64)


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


def _check_tid(trajectory_id: Any) -> None:
    if not isinstance(trajectory_id, str):
        raise TypeError(f"trajectory_id: expected a str, found {type(trajectory_id).__name__}")


def _turn_rows(
    spec: RouteSpec, trajectory_id: str, token_start: int, routes: Any
) -> tuple[np.ndarray, RouteSpec]:
    """Validated rows in storage dtype, owned (writable input is copied)."""
    _check_tid(trajectory_id)
    what = f"turn of {trajectory_id!r}"
    if token_start < 0:
        raise ContiguityError(
            f"{what}: expected token_start >= 0, found {token_start}",
            trajectory_id=trajectory_id,
            token=token_start,
        )
    try:
        arr, spec, _ = validate_route_rows(routes, spec, what=what)
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
    tid = pa.array([trajectory_id], type=pa.large_string())
    start = pa.array([token_start], type=pa.int64())
    return pa.RecordBatch.from_arrays([tid, start, col], schema=turn_schema(spec))


def turn_batch(
    spec: RouteSpec, trajectory_id: str, token_start: int, routes: Any
) -> pa.RecordBatch:
    """One turn as a one-row record batch (validated, in storage dtype)."""
    rows, spec = _turn_rows(spec, trajectory_id, token_start, routes)
    return _batch_of(spec, trajectory_id, token_start, rows)


@dataclasses.dataclass
class _Entry:
    """One appended batch of turns: turn ``i`` is ``rows[offsets[i]:offsets[i + 1]]`` (read-only,
    C-contiguous, ``spec.dtype``); ``batch`` is built on demand for a trace's turns, ``final`` is
    the finalized buffer ``rows`` slices (a bound trace's).
    """

    tids: list[str]
    starts: np.ndarray  # int64 [turns]
    rows: np.ndarray
    offsets: np.ndarray  # int64 [turns + 1], from 0
    spec: RouteSpec
    batch: pa.RecordBatch | None = None
    final: np.ndarray | None = None

    def record_batch(self) -> pa.RecordBatch:
        if self.batch is None:
            self.batch = _batch_of(self.spec, self.tids[0], int(self.starts[0]), self.rows)
        return self.batch


class TurnStore:
    """Thread-safe append-only log of turn record batches for many trajectories.

    `trace` is the capture path (each turn validated once, by the trace); `append` and
    `append_batch` validate outside data with the same validator.
    """

    _NAMES = ("trajectory_id", "token_start", "routes")

    def __init__(self, spec: RouteSpec) -> None:
        self.spec = spec
        self._entries: list[_Entry] = []
        self._lock = threading.Lock()

    def trace(self, trajectory_id: str) -> RouteTrace:
        """A `RouteTrace` that appends each turn it records here, at its ``token_start``.

        It starts at the store's spec (both widen when ``num_experts`` is None); on finalize its
        turns here become slices of the finalized rows. ``TypeError`` for a non-str id.
        """
        _check_tid(trajectory_id)
        mine: list[_Entry] = []

        def sink(token_start: int, rows: np.ndarray, spec: RouteSpec) -> None:
            mine.append(self._append_trusted(trajectory_id, token_start, rows, spec))

        def final_sink(rows: np.ndarray, spec: RouteSpec) -> None:
            with self._lock:  # the same turns, now views of the one finalized buffer
                for entry in mine:
                    a = int(entry.starts[0])
                    entry.rows = rows[a : a + entry.rows.shape[0]]
                    entry.spec, entry.batch, entry.final = spec, None, rows
            mine.clear()

        return RouteTrace._bound(self.spec, trajectory_id, sink, final_sink)

    def append(self, trajectory_id: str, token_start: int, routes: Any) -> None:
        """Append outside rows ``[rows, L, K]`` at ``token_start``, validated.

        Raises `RouteShapeError`, `RouteDTypeError`, `ExpertRangeError`, `DuplicateExpertError`
        (with ``trajectory_id``) and `ContiguityError` (negative ``token_start``).
        """
        rows, spec = _turn_rows(self.spec, trajectory_id, int(token_start), routes)
        self._append_trusted(trajectory_id, int(token_start), rows, spec)

    def _append_trusted(
        self, trajectory_id: str, token_start: int, rows: np.ndarray, spec: RouteSpec
    ) -> _Entry:
        """Append validated, owned rows (``spec.dtype``, C-contiguous) without a check."""
        starts = np.array([token_start], dtype=np.int64)
        offsets = np.array([0, rows.shape[0]], dtype=np.int64)
        entry = _Entry([trajectory_id], starts, rows, offsets, spec)
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
        """All turns as one table (cast to the widest routes dtype; no copy otherwise)."""
        schema = turn_schema(self.spec)
        batches = [
            b if b.schema.equals(schema) else b.select([0, 1, 2]).cast(schema)
            for b in self.batches()
        ]
        return pa.Table.from_batches(batches, schema=schema)

    def routes(self, trajectory_ids: Sequence[str] | pa.Array[Any]) -> pa.LargeListArray[Any]:
        """Routes column aligned with ``trajectory_ids`` (no turns: ``[]``), with one copy.

        Marked as checked for `r3arrow.rollout_table`. Raises `ContiguityError` when a
        trajectory's turns leave a gap, overlap or repeat (``token``: the first token not covered
        exactly once) and ``ValueError`` for repeated ids.
        """
        n, spec, parts, pos, lens, _ = self._plan(trajectory_ids)
        values = np.empty((int(lens.sum()), *spec.row_shape), dtype=spec.dtype)
        if parts:
            # Ids were checked on append; narrower batches are widened by this one copy.
            np.concatenate(parts, axis=0, out=values, casting="unsafe")
        offsets = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(np.bincount(pos, weights=lens, minlength=n).astype(np.int64), out=offsets[1:])
        out: pa.LargeListArray[Any] = pa.LargeListArray.from_arrays(
            pa.array(offsets, type=pa.int64()), numpy_to_routes(values, spec)
        )
        mark_validated(out, spec=spec, max_id=_id_bound(spec))
        return out

    def routes_chunked(self, trajectory_ids: Sequence[str] | pa.Array[Any]) -> pa.ChunkedArray[Any]:
        """`routes` as a ``ChunkedArray`` referencing finalized buffers instead of copying them.

        A trajectory whose turns tile one read-only buffer is its own chunk; the others are joined.
        Same values, checks, errors and mark as `routes` (``docs/capture.md``).
        """
        n, spec, parts, pos, _, finals = self._plan(trajectory_ids)
        per_traj: list[list[np.ndarray]] = [[] for _ in range(n)]
        whole: list[Any] = [None] * n  # the one finalized buffer, False if several
        for part, f, p in zip(parts, finals, pos.tolist(), strict=True):
            per_traj[p].append(part)
            whole[p] = f if whole[p] is None or whole[p] is f else False
        items: list[Sequence[np.ndarray]] = [
            # A finalized trajectory's turns tile its buffer (checked): reference it whole.
            [f] if isinstance(f, np.ndarray) and f.shape[0] == sum(q.shape[0] for q in t) else t
            for t, f in zip(per_traj, whole, strict=True)
        ]
        out = chunked_routes(items, spec)
        mark_validated(out, spec=spec, max_id=_id_bound(spec))
        return out

    def _plan(
        self, trajectory_ids: Sequence[str] | pa.Array[Any]
    ) -> tuple[int, RouteSpec, list[np.ndarray], np.ndarray, np.ndarray, list[np.ndarray | None]]:
        """(count wanted, spec, views of their turns' rows in output order, each one's position and
        length and the finalized buffer it slices); `ContiguityError` unless each trajectory's turns
        tile ``[0, captured)``.
        """
        wanted = pa.array(trajectory_ids, type=pa.large_string())
        if pc.count_distinct(wanted).as_py() != len(wanted):
            raise ValueError("trajectory_ids: expected unique ids, found duplicates")
        with self._lock:
            entries, spec = list(self._entries), self.spec
            views = [(e.rows, e.offsets, e.final) for e in entries]
        turn_ids = pa.array([t for e in entries for t in e.tids], type=pa.large_string())
        pos = pc.index_in(turn_ids, value_set=wanted)
        sel = np.flatnonzero(np.asarray(pc.is_valid(pos).to_numpy(zero_copy_only=False)))
        pos_np = np.asarray(pos.to_numpy(zero_copy_only=False))[sel].astype(np.int64)
        start = np.concatenate([_NO_INTS, *(e.starts for e in entries)])[sel]
        lens = np.concatenate([_NO_INTS, *(np.diff(off) for _, off, _ in views)])[sel]
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
        # Zero-copy views of the turns, in output order (a slice per turn: cheap next to a copy).
        turns = sel[order]
        first_turn = np.cumsum([0] + [off.size - 1 for _, off, _ in views])
        which = (np.searchsorted(first_turn, turns, side="right") - 1).tolist()
        local = (turns - first_turn[which]).tolist()
        parts = [
            views[c][0][views[c][1][r] : views[c][1][r + 1]]
            for c, r in zip(which, local, strict=True)
        ]
        return len(wanted), spec, parts, pos_s, lens_s, [views[c][2] for c in which]

    def clear(self) -> None:
        with self._lock:
            self._entries = []


def _id_bound(spec: RouteSpec) -> int:
    """An upper bound of the ids held: every turn was checked for its spec."""
    if spec.num_experts is not None:
        return spec.num_experts - 1
    return int(np.iinfo(spec.dtype).max)
