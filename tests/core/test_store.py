"""TurnStore: turn appends as record batches, concurrent appends, contiguity checks, assembly."""

from __future__ import annotations

import itertools
import random
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

from r3arrow import RouteSpec, RouteTrace, TurnStore
from r3arrow.capture._store import turn_schema
from r3arrow.errors import (
    ContiguityError,
    ExpertRangeError,
    R3ArrowError,
    RouteShapeError,
    SchemaError,
)
from r3arrow.spec import routes_to_numpy
from r3arrow.testing import random_routes

SPEC = RouteSpec(num_layers=3, topk=2, num_experts=16, moe_layers=(0, 2))


def turn_batch(
    spec: RouteSpec, trajectory_id: str, token_start: int, routes: Any
) -> pa.RecordBatch:
    """One validated turn as the one-row record batch `TurnStore.append` stores."""
    store = TurnStore(spec)
    store.append(trajectory_id, token_start, routes)
    return store.batches()[0]


def pylist(arr: Any) -> list[Any]:
    """``arr.to_pylist()``, loosely typed (pyarrow-stubs refuse it on list arrays)."""
    out: list[Any] = arr.to_pylist()
    return out


def as_lists(col: pa.LargeListArray[Any], spec: RouteSpec) -> list[np.ndarray]:
    """Per-trajectory numpy routes from a ``large_list`` routes column."""
    offsets = np.asarray(col.offsets)
    values = routes_to_numpy(col.values.slice(int(offsets[0]), int(offsets[-1] - offsets[0])), spec)
    return [values[a - offsets[0] : b - offsets[0]] for a, b in itertools.pairwise(offsets)]


def split_turns(rng: np.random.Generator, total: int) -> list[int]:
    """Random positive turn lengths summing to ``total``."""
    if total == 0:
        return []
    cuts = np.sort(
        rng.choice(np.arange(1, total), size=min(total - 1, int(rng.integers(0, 5))), replace=False)
    )
    lengths: list[int] = np.diff(np.concatenate([[0], cuts, [total]])).astype(int).tolist()
    return lengths


# -------------------------------------------------------------- turn batches


def test_turn_batch_schema_and_content() -> None:
    data = random_routes(np.random.default_rng(0), 4, SPEC)
    batch = turn_batch(SPEC, "traj-1", 7, data.astype(np.int64))
    assert batch.schema.equals(turn_schema(SPEC), check_metadata=True)
    assert batch.num_rows == 1
    assert batch.column("trajectory_id").to_pylist() == ["traj-1"]
    assert batch.column("token_start").to_pylist() == [7]
    assert batch.schema.field("routes").type == SPEC.routes_type
    np.testing.assert_array_equal(
        as_lists(cast("pa.LargeListArray[Any]", batch.column("routes")), SPEC)[0], data
    )
    assert RouteSpec.from_schema(batch.schema).same_shape(SPEC)


def test_turn_batch_rejects_bad_turns() -> None:
    ok = random_routes(np.random.default_rng(0), 2, SPEC)
    with pytest.raises(RouteShapeError):
        turn_batch(SPEC, "t", 0, np.zeros((2, 4, 2), dtype=np.uint8))
    bad = ok.astype(np.int64)
    bad[1, 2, 0] = 16
    with pytest.raises(ExpertRangeError, match="'t'"):
        turn_batch(SPEC, "t", 0, bad)
    with pytest.raises(ContiguityError, match="token_start >= 0"):
        turn_batch(SPEC, "t", -1, ok)


# --------------------------------------------------------------- assembling


def test_routes_is_per_trajectory_concatenation_in_requested_order() -> None:
    rng = np.random.default_rng(1)
    store = TurnStore(SPEC)
    a1, a2, b1, c1, c2, c3 = (random_routes(rng, n, SPEC) for n in (3, 2, 4, 1, 1, 5))
    # Interleaved appends, and turns of one trajectory out of order.
    store.append("c", 2, c3)
    store.append("a", 0, a1)
    store.append("b", 0, b1)
    store.append("c", 0, c1)
    store.append("a", 3, a2)
    store.append("c", 1, c2)
    assert store.num_turns == 6
    col = store.routes(["b", "missing", "a", "c"])
    assert col.type == SPEC.routes_type
    assert len(col) == 4
    got = as_lists(col, SPEC)
    np.testing.assert_array_equal(got[0], b1)
    assert got[1].shape == (0, 3, 2)  # a trajectory with no turns gets an empty list
    np.testing.assert_array_equal(got[2], np.concatenate([a1, a2]))
    np.testing.assert_array_equal(got[3], np.concatenate([c1, c2, c3]))
    # Another order gives the same rows, re-aligned; a subset ignores the other trajectories.
    got2 = as_lists(store.routes(pa.array(["c", "a"])), SPEC)
    np.testing.assert_array_equal(got2[0], got[3])
    np.testing.assert_array_equal(got2[1], got[2])


def test_empty_store_and_empty_request() -> None:
    store = TurnStore(SPEC)
    col = store.routes(["x", "y"])
    assert col.type == SPEC.routes_type
    assert pylist(col) == [[], []]
    assert len(store.routes([])) == 0


def test_duplicate_requested_ids_rejected() -> None:
    store = TurnStore(SPEC)
    with pytest.raises(ValueError, match="unique") as info:  # argument misuse: a builtin
        store.routes(["a", "a"])
    assert not isinstance(info.value, R3ArrowError)


def test_gap_detected_with_clear_message() -> None:
    rng = np.random.default_rng(2)
    store = TurnStore(SPEC)
    store.append("ok", 0, random_routes(rng, 2, SPEC))
    store.append("traj-7", 0, random_routes(rng, 3, SPEC))
    store.append("traj-7", 4, random_routes(rng, 2, SPEC))  # rows 3 are missing
    with pytest.raises(
        ContiguityError, match=r"'traj-7'.*starting at token 3, found one at 4 \(a gap\)"
    ):
        store.routes(["ok", "traj-7"])
    assert len(store.routes(["ok"])) == 1  # other trajectories are still assembled


def test_first_turn_must_start_at_zero() -> None:
    store = TurnStore(SPEC)
    store.append("t", 2, random_routes(np.random.default_rng(3), 2, SPEC))
    with pytest.raises(ContiguityError, match=r"'t'.*token 0, found one at 2 \(a gap\)"):
        store.routes(["t"])


def test_overlap_detected_with_clear_message() -> None:
    rng = np.random.default_rng(4)
    store = TurnStore(SPEC)
    store.append("t", 0, random_routes(rng, 5, SPEC))
    store.append("t", 3, random_routes(rng, 4, SPEC))  # rows 3, 4 twice
    with pytest.raises(
        ContiguityError, match=r"'t'.*starting at token 5, found one at 3 \(an overlap\)"
    ):
        store.routes(["t"])


def test_duplicate_turn_detected_with_clear_message() -> None:
    rng = np.random.default_rng(5)
    store = TurnStore(SPEC)
    t0, t1 = random_routes(rng, 3, SPEC), random_routes(rng, 2, SPEC)
    store.append("t", 0, t0)
    store.append("t", 3, t1)
    store.append("t", 3, t1)  # an agent loop retried its append
    with pytest.raises(ContiguityError, match=r"'t'.*found one at 3 \(a repeated turn\)"):
        store.routes(["t"])


def test_append_batch_with_several_turns_and_wrong_schemas() -> None:
    rng = np.random.default_rng(6)
    a, b = random_routes(rng, 2, SPEC), random_routes(rng, 3, SPEC)
    two = pa.concat_batches(  # type: ignore[attr-defined]  # missing from pyarrow-stubs
        [turn_batch(SPEC, "x", 0, a), turn_batch(SPEC, "x", 2, b)]
    )
    store = TurnStore(SPEC)
    store.append_batch(two)
    assert store.num_turns == 2
    np.testing.assert_array_equal(as_lists(store.routes(["x"]), SPEC)[0], np.concatenate([a, b]))
    renamed = two.rename_columns(["traj", "token_start", "routes"])
    with pytest.raises(SchemaError, match="expected columns"):
        store.append_batch(renamed)
    other = RouteSpec(num_layers=4, topk=2, num_experts=16)
    with pytest.raises(SchemaError):
        store.append_batch(
            turn_batch(other, "y", 0, np.tile(np.arange(2, dtype=np.uint8), (1, 4, 1)))
        )
    no_meta = two.replace_schema_metadata(None)
    with pytest.raises(SchemaError, match=r"r3arrow\.spec"):
        store.append_batch(no_meta)
    wide = RouteSpec(num_layers=3, topk=2, num_experts=300, moe_layers=(0, 2))
    with pytest.raises(SchemaError, match="uint8"):  # the store's num_experts is known: no widening
        rows = np.array([[[0, 1], [0, 0], [0, 1]]], dtype=np.uint16)  # layer 1 dense: zeros
        store.append_batch(turn_batch(wide, "y", 0, rows))
    assert store.num_turns == 2


def test_widening_store_with_unknown_num_experts() -> None:
    spec = RouteSpec(num_layers=2, topk=2, num_experts=None)
    store = TurnStore(spec)
    t1 = np.array([[[0, 1], [2, 3]]] * 2, dtype=np.uint8)
    t2 = np.array([[[256, 1], [400, 3]]], dtype=np.int64)  # defect 3.1: a later turn with id >= 256
    store.append("a", 0, t1)
    store.append("a", 2, t2)
    store.append("b", 0, t1[:1])
    col = store.routes(["a", "b"])
    assert store.spec.dtype == np.uint16
    assert col.type == store.spec.routes_type
    got = as_lists(col, store.spec)
    np.testing.assert_array_equal(got[0], np.concatenate([t1, t2]))
    np.testing.assert_array_equal(got[1], t1[:1])
    table = store.to_table()
    assert table.num_rows == 3 and table.schema.field("routes").type == store.spec.routes_type


def test_store_routes_feed_a_trace_equivalent_column() -> None:
    # Turns recorded in a RouteTrace and appended to a TurnStore give the same routes.
    rng = np.random.default_rng(7)
    store, trace = TurnStore(SPEC), RouteTrace(SPEC)
    seen = 0
    for obs, gen in ((4, 3), (2, 5), (1, 1)):
        p = seen + obs
        rows = p - trace.captured + gen - 1
        chunk = random_routes(rng, rows, SPEC)
        start = trace.record(chunk, prompt_tokens=p, generated_tokens=gen)
        store.append("t", start, chunk)
        seen = p + gen
    out = trace.finalize(num_tokens=seen, loss_mask=np.zeros(seen))
    np.testing.assert_array_equal(
        as_lists(store.routes(["t"]), SPEC)[0], routes_to_numpy(out, SPEC)
    )


# -------------------------------------------------------------- concurrency


def test_concurrent_appends_from_many_threads() -> None:
    num_traj, threads = 48, 8
    rng = np.random.default_rng(8)
    expected = {
        f"traj-{i}": random_routes(rng, int(rng.integers(1, 60)), SPEC) for i in range(num_traj)
    }
    plans = {tid: split_turns(rng, len(r)) for tid, r in expected.items()}
    store = TurnStore(SPEC)
    barrier = threading.Barrier(threads)

    def agent_loop(worker: int) -> None:
        barrier.wait()  # start together to maximise interleaving
        for tid in list(expected)[worker::threads]:
            start = 0
            for n in plans[tid]:
                store.append(tid, start, expected[tid][start : start + n])
                start += n

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(agent_loop, range(threads)))
    assert store.num_turns == sum(len(p) for p in plans.values())
    ids = list(expected)
    random.Random(0).shuffle(ids)
    got = as_lists(store.routes(ids), SPEC)
    for tid, routes in zip(ids, got, strict=True):
        np.testing.assert_array_equal(routes, expected[tid])


# ------------------------------------------------------------------ property


@given(
    lengths=st.lists(st.integers(0, 30), min_size=1, max_size=8),
    seed=st.integers(0, 2**32 - 1),
    chunks=st.integers(1, 3),
)
def test_routes_equals_concatenation_for_any_append_order(
    lengths: list[int], seed: int, chunks: int
) -> None:
    rng = np.random.default_rng(seed)
    expected = {f"t{i}": random_routes(rng, n, SPEC) for i, n in enumerate(lengths)}
    turns = []
    for tid, r in expected.items():
        start = 0
        for n in split_turns(rng, len(r)):
            turns.append((tid, start, r[start : start + n]))
            start += n
    order = rng.permutation(len(turns)) if turns else np.array([], dtype=int)
    store = TurnStore(SPEC)
    # Append as batches of several turns too (chunks > 1): any batching gives the same result.
    parts = np.array_split(order, chunks) if len(order) else []
    for part in parts:
        if len(part):
            store.append_batch(
                pa.concat_batches(  # type: ignore[attr-defined]  # missing from pyarrow-stubs
                    [turn_batch(SPEC, *turns[i]) for i in part]
                )
            )
    ids = list(expected)[::-1]
    got = as_lists(store.routes(ids), SPEC)
    for tid, routes in zip(ids, got, strict=True):
        np.testing.assert_array_equal(routes, expected[tid])


@given(
    lengths=st.lists(st.integers(2, 20), min_size=1, max_size=5),
    victim=st.integers(0, 100),
    kind=st.sampled_from(["drop", "duplicate", "shift_left", "shift_right"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_broken_turn_sequences_are_detected(
    lengths: list[int], victim: int, kind: str, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    turns = []
    for i, n in enumerate(lengths):
        r = random_routes(rng, n, SPEC)
        sizes = split_turns(rng, n)
        if len(sizes) < 2:
            sizes = [1, n - 1]
        start = 0
        for k in sizes:
            turns.append((f"t{i}", start, r[start : start + k]))
            start += k
    # Pick a turn that is not the last of its trajectory, so dropping it leaves a gap.
    inner = [j for j in range(len(turns)) if j + 1 < len(turns) and turns[j + 1][0] == turns[j][0]]
    j = inner[victim % len(inner)]
    tid = turns[j][0]
    if kind == "drop":
        turns.pop(j)
    elif kind == "duplicate":
        turns.append(turns[j])
    elif kind == "shift_left":
        turns[j + 1] = (tid, turns[j + 1][1] - 1, turns[j + 1][2])
    else:
        turns[j + 1] = (tid, turns[j + 1][1] + 1, turns[j + 1][2])
    store = TurnStore(SPEC)
    for k in rng.permutation(len(turns)):
        store.append(*turns[k])
    with pytest.raises(ContiguityError, match=repr(tid)):
        store.routes([f"t{i}" for i in range(len(lengths))])


def test_invalid_appends_raise_typed_errors_and_store_unchanged() -> None:
    store = TurnStore(SPEC)
    store.append("a", 0, random_routes(np.random.default_rng(9), 2, SPEC))
    bad_inputs = [
        np.zeros((2, 3), dtype=np.uint8),
        np.zeros((2, 3, 2), dtype=np.float32),
        np.full((2, 3, 2), 99, dtype=np.int64),
        np.full((2, 3, 2), -1, dtype=np.int64),
        pa.array([1, 2, 3]),
    ]
    for bad in bad_inputs:
        with pytest.raises(R3ArrowError):
            store.append("a", 2, bad)
    assert store.num_turns == 1


@pytest.mark.parametrize("value", [-1, 1000])
def test_dense_layer_value_outside_storage_dtype_is_never_silently_wrapped(value: int) -> None:
    # Dense-layer ids are not range-checked, but narrowing must not wrap them
    # (-1 -> 255, 1000 -> 232).
    spec = RouteSpec(num_layers=2, topk=2, num_experts=None, moe_layers=(1,))
    data = np.array([[[value, 0], [0, 1]]], dtype=np.int64)
    store = TurnStore(spec)
    try:
        store.append("t", 0, data)
        got = as_lists(store.routes(["t"]), store.spec)[0]
    except R3ArrowError:
        return
    np.testing.assert_array_equal(got.astype(np.int64), data)
