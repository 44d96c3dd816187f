"""`TurnStore`: turn appends as Arrow record batches, assembled into a routes column.

Many agent loops append concurrently (one record batch per turn: trajectory id,
token start, routes). `TurnStore.routes` builds the ragged per-trajectory
``large_list`` column with one Arrow ``take`` (one copy of the route bytes),
after checking that each trajectory's turns tile ``[0, captured)`` exactly.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from r3arrow.errors import ContiguityError, SchemaError
from r3arrow.spec import RouteSpec, as_route_rows, check_route_ids, numpy_to_routes, routes_to_numpy


@functools.lru_cache(maxsize=64)
def turn_schema(spec: RouteSpec) -> pa.Schema:
    """Schema of one turn batch: ``trajectory_id``, ``token_start``, ``routes``."""
    return pa.schema(
        [
            pa.field("trajectory_id", pa.large_string(), nullable=False),
            pa.field("token_start", pa.int64(), nullable=False),
            pa.field("routes", spec.routes_type, nullable=False),
        ],
        metadata=spec.to_metadata(),
    )


def turn_batch(spec: RouteSpec, trajectory_id: str, token_start: int, routes: Any) -> pa.RecordBatch:
    """One turn as a one-row record batch (routes ``[rows, L, K]``, validated, storage dtype)."""
    arr = as_route_rows(routes, spec, what=f"turn of {trajectory_id!r}")
    _, hi = check_route_ids(arr, spec, what=f"turn of {trajectory_id!r}")
    spec = spec.widened_for(hi) if spec.num_experts is None else spec
    if arr.dtype != spec.dtype:
        arr = arr.astype(spec.dtype)
    if token_start < 0:
        raise ContiguityError(f"turn of {trajectory_id!r}: expected token_start >= 0, found {token_start}")
    tokens = numpy_to_routes(arr, spec)
    col = pa.LargeListArray.from_arrays(pa.array([0, len(tokens)], type=pa.int64()), tokens)
    return pa.RecordBatch.from_arrays(
        [pa.array([trajectory_id], type=pa.large_string()), pa.array([token_start], type=pa.int64()), col],
        schema=turn_schema(spec),
    )


class TurnStore:
    """Thread-safe append-only log of turn record batches for many trajectories."""

    def __init__(self, spec: RouteSpec) -> None:
        self.spec = spec
        self._batches: list[pa.RecordBatch] = []
        self._lock = threading.Lock()

    def append(self, trajectory_id: str, token_start: int, routes: Any) -> None:
        """Append one turn's rows ``[rows, L, K]`` starting at token ``token_start``."""
        self.append_batch(turn_batch(self.spec, trajectory_id, int(token_start), routes))

    def append_batch(self, batch: pa.RecordBatch) -> None:
        """Append a record batch of turns (schema `turn_schema`; any number of rows)."""
        names = ["trajectory_id", "token_start", "routes"]
        if batch.schema.names[:3] != names:
            raise SchemaError(f"turn batch: expected columns {names}, found {batch.schema.names}")
        spec = RouteSpec.from_schema(batch.schema)
        if not spec.same_shape(self.spec):
            raise SchemaError(f"turn batch: expected routes shaped like {self.spec}, found {spec}")
        with self._lock:
            if spec.dtype.itemsize > self.spec.dtype.itemsize:
                if self.spec.num_experts is not None:
                    raise SchemaError(f"turn batch: expected {self.spec.dtype} routes, found {spec.dtype}")
                self.spec = spec
            self._batches.append(batch)

    @property
    def num_turns(self) -> int:
        return sum(b.num_rows for b in self._batches)

    def batches(self) -> list[pa.RecordBatch]:
        with self._lock:
            return list(self._batches)

    def to_table(self) -> pa.Table:
        """All turns as one table (batches cast to the widest routes dtype; no copy otherwise)."""
        schema = turn_schema(self.spec)
        batches = [b if b.schema.equals(schema) else b.select([0, 1, 2]).cast(schema) for b in self.batches()]
        return pa.Table.from_batches(batches, schema=schema)

    def routes(self, trajectory_ids: Sequence[str] | pa.Array) -> pa.LargeListArray:
        """Routes column aligned with ``trajectory_ids`` (a trajectory with no turns gets []).

        Raises `ContiguityError` if a trajectory's turns leave a gap, overlap, or
        repeat a turn.
        """
        wanted = pa.array(trajectory_ids, type=pa.large_string())
        if pc.count_distinct(wanted).as_py() != len(wanted):
            raise ContiguityError("trajectory_ids: expected unique ids, found duplicates")
        table = self.to_table()
        pos = pc.index_in(table.column("trajectory_id"), value_set=wanted)
        sel = np.flatnonzero(np.asarray(pc.is_valid(pos).to_numpy(zero_copy_only=False)))
        pos_np = np.asarray(pos.to_numpy(zero_copy_only=False))[sel].astype(np.int64)
        start = np.asarray(table.column("token_start").to_numpy())[sel]
        lens = np.asarray(pc.list_value_length(table.column("routes")).to_numpy(zero_copy_only=False))[sel]
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
                "a repeated turn" if not first[k] and start_s[k] == start_s[k - 1]
                else "an overlap" if start_s[k] < expect[k] else "a gap"
            )
            raise ContiguityError(
                f"trajectory {tid!r}: expected a turn starting at token {int(expect[k])}, found one at "
                f"{int(start_s[k])} ({kind})"
            )
        values = self._gather(table.column("routes"), sel[order])
        per_traj = np.bincount(pos_s, weights=lens_s, minlength=len(wanted)).astype(np.int64)
        offsets = np.zeros(len(wanted) + 1, dtype=np.int64)
        np.cumsum(per_traj, out=offsets[1:])
        return pa.LargeListArray.from_arrays(pa.array(offsets), numpy_to_routes(values, self.spec))

    def _gather(self, routes: pa.ChunkedArray, turns: np.ndarray) -> np.ndarray:
        """Rows of the given turns (table row indices), concatenated in that order: one copy.

        A loop per turn slices zero-copy views (cheap next to the copy; Arrow's
        ``take`` on a chunked list column would copy twice).
        """
        views: list[np.ndarray] = []
        bounds: list[np.ndarray] = []
        for chunk in routes.chunks:
            offsets = np.asarray(chunk.offsets, dtype=np.int64)
            views.append(routes_to_numpy(chunk.flatten(), self.spec))
            bounds.append(offsets - offsets[0])
        first_row = np.cumsum([0] + [len(c) for c in routes.chunks])
        which = np.searchsorted(first_row, turns, side="right") - 1
        local = turns - first_row[which]
        parts = [views[c][bounds[c][r] : bounds[c][r + 1]] for c, r in zip(which.tolist(), local.tolist(), strict=True)]
        total = sum(p.shape[0] for p in parts)
        out = np.empty((total, *self.spec.row_shape), dtype=self.spec.dtype)
        if parts:
            np.concatenate(parts, axis=0, out=out, casting="unsafe")  # ids checked on append
        return out

    def clear(self) -> None:
        with self._lock:
            self._batches = []


__all__ = ["TurnStore", "turn_batch", "turn_schema"]
