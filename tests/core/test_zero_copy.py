"""Capture ownership (``record(copy=False)``) and tables that reference traces' buffers.

``docs/capture.md``: a handed-over turn is kept without a copy, the default still protects
against a caller reusing its buffer, and `rollout_table` / `TurnStore.routes_chunked` build a
multi-chunk routes column that references each finalized trace's buffer.
"""

from __future__ import annotations

import itertools
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import r3arrow._routes
from r3arrow import RouteSpec, RouteTrace, TurnStore, read_rollouts, write_rollouts
from r3arrow.errors import DuplicateExpertError, ExpertRangeError
from r3arrow.spec import routes_to_numpy
from r3arrow.table import rollout_table, validate_rollouts
from r3arrow.testing import assert_rollouts_equal, random_routes
from r3arrow.testing.strategies import routes as routes_strategy
from r3arrow.testing.strategies import specs

# 384 B per token: a few hundred tokens exceed MIN_CHUNK_BYTES (128 KiB).
BIG = RouteSpec(num_layers=48, topk=8, num_experts=128)


def rows_of(n: int, spec: RouteSpec = BIG, *, seed: int = 0) -> np.ndarray:
    return random_routes(np.random.default_rng(seed), n, spec)


def capture(
    rows: np.ndarray, splits: list[int], spec: RouteSpec, *, copy: bool = True, store: Any = None
) -> tuple[pa.Array[Any], int]:
    """Record ``rows`` as turns ending at ``splits`` (prompt start = captured); finalize."""
    trace = RouteTrace(spec) if store is None else store.trace(f"t{id(rows)}")
    bounds = [0, *splits, rows.shape[0]]
    for a, b in itertools.pairwise(bounds):
        if b == a:
            continue  # no rows at all: a trajectory that captured nothing
        # The turn's rows: P - a + G - 1 = b - a with G = 1, so P = b.
        trace.record(rows[a:b].copy(), prompt_tokens=b, generated_tokens=1, copy=copy)
    n = rows.shape[0] + 1
    return trace.finalize(num_tokens=n, loss_mask=np.zeros(n, np.uint8)), n


def table_of(finals: list[Any], lengths: list[int], spec: RouteSpec) -> pa.Table:
    return rollout_table(
        trajectory_id=[f"t{i}" for i in range(len(lengths))],
        group_id=["g"] * len(lengths),
        prompt_ids=[np.zeros(n - 1, np.int32) for n in lengths],
        response_ids=[np.zeros(1, np.int32) for _ in lengths],
        loss_mask=[np.zeros(1, np.uint8) for _ in lengths],
        reward=np.zeros(len(lengths)),
        routes=finals,
        spec=spec,
    )


def leaf(arr: Any) -> np.ndarray:
    return routes_to_numpy(arr.flatten() if isinstance(arr, pa.LargeListArray) else arr)


# ------------------------------------------------------------------ ownership
def test_copy_false_keeps_the_callers_array() -> None:
    rows = rows_of(300)
    trace = RouteTrace(BIG)
    trace.record(rows, prompt_tokens=300, generated_tokens=1, copy=False)
    out = trace.finalize(num_tokens=301, loss_mask=np.zeros(301, np.uint8))
    assert np.shares_memory(routes_to_numpy(out), rows)  # one turn: no copy at all
    assert rows.flags.writeable  # the caller's own array object is untouched


def test_default_copy_protects_against_the_caller_reusing_its_buffer() -> None:
    rows = rows_of(300)
    want = rows.copy()
    trace = RouteTrace(BIG)
    trace.record(rows, prompt_tokens=300, generated_tokens=1)
    rows[:] = 0  # the caller reuses its buffer for the next decode
    out = trace.finalize(num_tokens=301, loss_mask=np.zeros(301, np.uint8))
    assert not np.shares_memory(routes_to_numpy(out), rows)
    np.testing.assert_array_equal(routes_to_numpy(out), want)


_TURN = 16_000  # rows of the measured turn: 6 MiB


def _record_peak(copy: bool) -> int:
    # Large enough that the numpy backend's fixed, cache-sized scratch of the id check
    # (a few hundred KiB, whatever the turn's size) stays far below a copy of the turn.
    rows = rows_of(_TURN + 4)
    trace = RouteTrace(BIG)
    trace.record(rows[:4].copy(), prompt_tokens=4, generated_tokens=1, copy=copy)  # warm
    tracemalloc.start()
    try:
        trace.record(rows[4:], prompt_tokens=_TURN + 4, generated_tokens=1, copy=copy)
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_copy_false_allocates_no_copy_of_the_turn() -> None:
    nbytes = _TURN * BIG.row_nbytes
    assert _record_peak(copy=True) >= nbytes  # the private copy
    assert _record_peak(copy=False) < nbytes // 10  # bookkeeping only


def test_read_only_turns_are_never_copied() -> None:
    rows = rows_of(300)
    rows.flags.writeable = False  # a decoded payload
    trace = RouteTrace(BIG)
    trace.record(rows, prompt_tokens=300, generated_tokens=1)  # default copy=True
    out = trace.finalize(num_tokens=301, loss_mask=np.zeros(301, np.uint8))
    assert np.shares_memory(routes_to_numpy(out), rows)


def test_copy_false_still_validates_and_leaves_the_trace_unchanged() -> None:
    bad = np.zeros((4, 48, 8), np.uint8)  # every expert repeated
    trace = RouteTrace(BIG)
    with pytest.raises(DuplicateExpertError):
        trace.record(bad, prompt_tokens=4, generated_tokens=1, copy=False)
    assert (trace.captured, trace.num_turns) == (0, 0)


# ---------------------------------------------------------- tables, no copy
def test_rollout_table_references_each_finalized_trace() -> None:
    datas = [rows_of(n, seed=i) for i, n in enumerate((400, 700, 500))]
    made = [capture(d, [d.shape[0] // 3, d.shape[0] // 2], BIG, copy=False) for d in datas]
    finals = [f for f, _ in made]
    table = table_of(finals, [n for _, n in made], BIG)
    col = table.column("routes")
    assert col.num_chunks == 3  # one chunk per trajectory, no join
    for i, final in enumerate(finals):
        assert np.shares_memory(leaf(col.chunk(i)), routes_to_numpy(final))
        np.testing.assert_array_equal(leaf(col.chunk(i)), datas[i])
    assert validate_rollouts(table) == BIG


def test_small_trajectories_share_one_joined_chunk() -> None:
    datas = [rows_of(n, seed=i) for i, n in enumerate((5, 600, 3, 4))]
    made = [capture(d, [], BIG) for d in datas]
    table = table_of([f for f, _ in made], [n for _, n in made], BIG)
    col = table.column("routes")
    assert col.num_chunks == 3  # [5], [600] referenced, [3, 4] joined
    assert [len(c) for c in col.chunks] == [1, 1, 2]
    validate_rollouts(table)


def test_writable_numpy_parts_are_copied_into_the_table() -> None:
    data = rows_of(600)
    table = table_of([data], [601], BIG)
    got = leaf(table.column("routes").chunk(0))
    assert not np.shares_memory(got, data)  # an immutable column must not follow a caller
    data[:] = 0
    np.testing.assert_array_equal(got, rows_of(600))


def test_a_finalized_trace_is_checked_again_for_a_narrower_spec() -> None:
    final, n = capture(rows_of(300), [100], BIG)  # ids up to 127
    narrow = RouteSpec(num_layers=48, topk=8, num_experts=64)
    with pytest.raises(ExpertRangeError) as info:
        table_of([final], [n], narrow)
    assert info.value.row == 0


def test_store_routes_chunked_references_the_finalized_buffers() -> None:
    store = TurnStore(BIG)
    datas = [rows_of(n, seed=i) for i, n in enumerate((500, 800))]
    finals = [capture(d, [100, 250], BIG, copy=False, store=store)[0] for d in datas]
    ids = [f"t{id(d)}" for d in datas]
    col = store.routes_chunked(ids)
    assert col.num_chunks == 2
    for chunk, final, data in zip(col.chunks, finals, datas, strict=True):
        assert np.shares_memory(leaf(chunk), routes_to_numpy(final))
        np.testing.assert_array_equal(leaf(chunk), data)
    joined = store.routes(ids)  # the one-buffer form: same values
    assert pa.chunked_array([joined]).equals(col)
    # The store's turns are now slices of the finalized buffers: same turns, same starts.
    assert store.num_turns == 6
    starts = [b.column(1)[0].as_py() for b in store.batches()]
    assert starts == [0, 100, 250, 0, 100, 250]
    first = leaf(store.batches()[1].column(2))
    assert np.shares_memory(first, routes_to_numpy(finals[0]))


def test_multi_chunk_table_round_trips_through_parquet(tmp_path: Path) -> None:
    datas = [rows_of(n, seed=i) for i, n in enumerate((450, 350))]
    made = [capture(d, [200], BIG, copy=False) for d in datas]
    table = table_of([f for f, _ in made], [n for _, n in made], BIG)
    assert table.column("routes").num_chunks == 2
    both = pa.concat_tables([table, table.slice(1, 1)])  # more chunks, as a consumer may see
    assert both.column("routes").num_chunks == 3
    validate_rollouts(both)
    path = write_rollouts(both, tmp_path / "r.parquet")
    assert_rollouts_equal(read_rollouts(path), both)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), spec=specs(max_layers=4, max_topk=3))
def test_chunked_table_equals_single_buffer_table(data: st.DataObject, spec: RouteSpec) -> None:
    trajectories = data.draw(st.lists(routes_strategy(spec, max_rows=12), min_size=1, max_size=4))
    finals, lengths = [], []
    for rows in trajectories:
        cuts = sorted(set(data.draw(st.lists(st.integers(1, max(1, rows.shape[0] - 1))))))
        cuts = [c for c in cuts if 0 < c < rows.shape[0]]
        copy = data.draw(st.booleans())
        final, n = capture(rows, cuts, spec, copy=copy)
        finals.append(final)
        lengths.append(n)
    old = r3arrow._routes.MIN_CHUNK_BYTES
    r3arrow._routes.MIN_CHUNK_BYTES = 0  # every trajectory its own chunk
    try:
        chunked = table_of(finals, lengths, spec)
    finally:
        r3arrow._routes.MIN_CHUNK_BYTES = old
    flat = np.concatenate(trajectories, axis=0)
    offsets = np.cumsum([0, *(t.shape[0] for t in trajectories)])
    one = pa.LargeListArray.from_arrays(
        pa.array(offsets, pa.int64()),
        pa.FixedSizeListArray.from_arrays(
            pa.FixedSizeListArray.from_arrays(pa.array(flat.reshape(-1)), spec.topk),
            spec.num_layers,
        ),
    )
    single = table_of(one, lengths, spec)  # type: ignore[arg-type]
    assert single.column("routes").num_chunks == 1
    assert chunked.column("routes").num_chunks == len(trajectories)
    assert_rollouts_equal(chunked, single)
    assert validate_rollouts(chunked) == validate_rollouts(single)
