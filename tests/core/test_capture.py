"""The one capture path (`TurnStore.trace`), one check per boundary, structured error fields."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pytest

import r3arrow.capture._trace
import r3arrow.ids
from r3arrow import RouteSpec, RouteTrace, TurnStore
from r3arrow._coverage import check_terminal_gap, first_terminal_gap
from r3arrow._validated import is_validated
from r3arrow.errors import (
    ContiguityError,
    DuplicateExpertError,
    ExpertRangeError,
    R3ArrowError,
    RouteShapeError,
    SchemaError,
    TerminalGapError,
)
from r3arrow.table import (
    filter_groups,
    filter_rows,
    replace_groups,
    rollout_table,
    take_rows,
    validate_rollouts,
)
from r3arrow.testing import random_routes

SPEC = RouteSpec(num_layers=3, topk=2, num_experts=16, moe_layers=(0, 2))


def rows_of(n: int, spec: RouteSpec = SPEC, *, seed: int = 0, dtype: Any = None) -> np.ndarray:
    return random_routes(np.random.default_rng(seed), n, spec, dtype=dtype)


def store_rows(store: TurnStore, tid: str) -> np.ndarray:
    col = store.routes([tid])
    return r3arrow.spec.routes_to_numpy(col.flatten(), store.spec)


# ------------------------------------------------------------------ capture path
def test_bound_trace_records_each_turn_into_its_store() -> None:
    store = TurnStore(SPEC)
    trace = store.trace("t")
    assert isinstance(trace, RouteTrace) and trace.trajectory_id == "t"
    a, b = rows_of(4, seed=1), rows_of(3, seed=2)
    assert trace.record(a, prompt_tokens=3, generated_tokens=2) == 0
    assert trace.record(b, prompt_tokens=6, generated_tokens=2) == 4
    turns = store.to_table()
    assert turns.column("trajectory_id").to_pylist() == ["t", "t"]
    assert turns.column("token_start").to_pylist() == [0, 4]
    np.testing.assert_array_equal(store_rows(store, "t"), np.concatenate([a, b]))
    # the trace itself still finalizes to the same rows
    out = trace.finalize(num_tokens=8, loss_mask=np.zeros(8))
    np.testing.assert_array_equal(r3arrow.spec.routes_to_numpy(out, SPEC), np.concatenate([a, b]))
    assert RouteTrace(SPEC).trajectory_id is None


def test_bound_trace_validates_once_and_the_store_trusts_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[int] = []
    real = r3arrow.ids.check_routes

    def counting(arr: np.ndarray, spec: RouteSpec, **kw: Any) -> Any:
        calls.append(arr.shape[0])
        return real(arr, spec, **kw)

    monkeypatch.setattr(r3arrow.capture._trace, "check_routes", counting)
    store = TurnStore(SPEC)
    trace = store.trace("t")
    trace.record(rows_of(4), prompt_tokens=3, generated_tokens=2)
    trace.record(rows_of(2), prompt_tokens=5, generated_tokens=2)
    assert calls == [4, 2]  # one id check per turn, none in the store
    store.append("u", 0, rows_of(2))  # outside data: the store's own (same) validator
    assert calls == [4, 2, 2]


def test_bound_trace_shares_the_read_only_buffer_with_the_store() -> None:
    store = TurnStore(SPEC)
    trace = store.trace("t")
    rows = rows_of(4).astype(SPEC.dtype)
    rows.flags.writeable = False  # a decoded payload the caller no longer writes
    trace.record(rows, prompt_tokens=3, generated_tokens=2)
    col: Any = store.batches()[0].column(2)
    leaf = col.flatten().flatten().flatten()
    assert leaf.buffers()[1].address == rows.ctypes.data  # zero-copy into the store
    writable = rows_of(4, seed=3)
    other = store.trace("w")
    other.record(writable, prompt_tokens=3, generated_tokens=2)
    writable[:] = 0  # the caller reuses its buffer: the store kept its own copy
    np.testing.assert_array_equal(store_rows(store, "w"), rows_of(4, seed=3))


@pytest.mark.parametrize(
    ("rows", "kw", "error"),
    [
        (rows_of(3), {"prompt_tokens": 3, "generated_tokens": 2}, RouteShapeError),  # 4 wanted
        (np.full((4, 3, 2), 16), {"prompt_tokens": 3, "generated_tokens": 2}, ExpertRangeError),
        (rows_of(4), {"prompt_tokens": 0, "generated_tokens": 2}, ValueError),
        (
            np.zeros((4, 3, 2), np.uint8),
            {"prompt_tokens": 3, "generated_tokens": 2},
            DuplicateExpertError,
        ),
    ],
)
def test_a_rejected_turn_changes_neither_trace_nor_store(
    rows: np.ndarray, kw: dict[str, Any], error: type[Exception]
) -> None:
    store = TurnStore(SPEC)
    trace = store.trace("t")
    with pytest.raises(error) as info:
        trace.record(rows, **kw)
    assert (trace.captured, trace.num_turns, store.num_turns) == (0, 0, 0)
    if isinstance(info.value, R3ArrowError):
        assert info.value.trajectory_id == "t"
    trace.record(rows_of(4), prompt_tokens=3, generated_tokens=2)
    assert store.num_turns == 1


def test_duplicate_experts_are_a_data_error_at_record_and_nothing_changes() -> None:
    store = TurnStore(SPEC)
    trace = store.trace("t")
    trace.record(rows_of(4), prompt_tokens=3, generated_tokens=2)
    bad = rows_of(2, seed=5)
    bad[1, 2, 1] = bad[1, 2, 0]  # layer 2 routes; layer 1 is dense (zeros) and unchecked
    with pytest.raises(DuplicateExpertError) as info:
        trace.record(bad, prompt_tokens=5, generated_tokens=2)
    assert isinstance(info.value, R3ArrowError) and isinstance(info.value, ValueError)
    assert info.value.fields() == {"trajectory_id": "t", "token": 1, "layer": 2}
    assert (trace.captured, trace.num_turns, store.num_turns) == (4, 1, 1)
    with pytest.raises(DuplicateExpertError, match="token 1, layer 2"):
        store.append("u", 0, bad)  # outside data: the same rule
    assert store.num_turns == 1


def test_duplicate_on_an_all_zero_layer_hints_at_moe_layers() -> None:
    all_router = RouteSpec(num_layers=3, topk=2, num_experts=16)  # dense layer 1 undeclared
    rows = rows_of(4)  # SPEC's rows: zeros on layer 1
    trace = TurnStore(all_router).trace("t")
    with pytest.raises(DuplicateExpertError, match=r"layer 1 is all zeros.*moe_layers") as info:
        trace.record(rows, prompt_tokens=3, generated_tokens=2)
    assert (info.value.layer, info.value.token, info.value.trajectory_id) == (1, 0, "t")
    assert trace.captured == 0


def test_bound_traces_widen_with_the_store_when_num_experts_is_unknown() -> None:
    spec = RouteSpec(num_layers=2, topk=2, num_experts=None)
    store = TurnStore(spec)
    small, wide = store.trace("a"), store.trace("b")
    small.record(np.array([[[0, 1], [2, 3]]] * 2), prompt_tokens=2, generated_tokens=1)
    wide.record(np.array([[[0, 300], [2, 3]]] * 2), prompt_tokens=2, generated_tokens=1)
    assert small.spec.dtype == np.uint8 and wide.spec.dtype == np.uint16
    assert store.spec.dtype == np.uint16
    col = store.routes(["a", "b"])
    assert r3arrow.spec.routes_to_numpy(col.flatten(), store.spec)[2:, 0, 1].tolist() == [300, 300]


def test_store_trace_argument_checks() -> None:
    with pytest.raises(TypeError, match="trajectory_id"):
        TurnStore(SPEC).trace(3)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="RouteSpec"):
        RouteTrace("spec")  # type: ignore[arg-type]


def test_two_traces_for_one_trajectory_are_caught_on_assembly() -> None:
    store = TurnStore(SPEC)
    for _ in range(2):
        store.trace("t").record(rows_of(2), prompt_tokens=2, generated_tokens=1)
    with pytest.raises(ContiguityError, match="repeated turn") as info:
        store.routes(["t"])
    assert (info.value.trajectory_id, info.value.token) == ("t", 0)


# ------------------------------------------------------------------ terminal gap
def test_terminal_gap_rule_is_one_function() -> None:
    mask = np.array([0, 1, 0, 1, 1])
    assert first_terminal_gap(mask, np.arange(5), 3) == 4
    assert first_terminal_gap(mask, np.arange(5), 4) == -1
    with pytest.raises(TerminalGapError, match="token 4") as info:
        check_terminal_gap(3, mask, num_tokens=5, trajectory_id="t")
    assert (info.value.token, info.value.trajectory_id) == (4, "t")
    store = TurnStore(SPEC)
    trace = store.trace("bound")
    trace.record(rows_of(2), prompt_tokens=2, generated_tokens=1)
    with pytest.raises(TerminalGapError) as info:
        trace.finalize(num_tokens=5, loss_mask=[0, 0, 1, 0, 1])
    assert (info.value.token, info.value.trajectory_id) == (4, "bound")


def _base(**change: Any) -> dict[str, Any]:
    cols: dict[str, Any] = {
        "trajectory_id": ["a", "b"],
        "group_id": ["g", "g"],
        "prompt_ids": [[1], [2]],
        "response_ids": [[1, 2], [3, 4, 5]],
        "loss_mask": [[1, 0], [1, 0, 0]],
        "reward": [0.0, 1.0],
        "routes": [rows_of(1), rows_of(2)],
    }
    return {**cols, **change}


def test_table_errors_carry_row_and_trajectory_id() -> None:
    with pytest.raises(TerminalGapError) as gap:
        rollout_table(**_base(loss_mask=[[1, 0], [1, 0, 1]]), spec=SPEC)
    assert (gap.value.row, gap.value.trajectory_id, gap.value.token) == (1, "b", 3)
    with pytest.raises(RouteShapeError) as many:
        rollout_table(**_base(routes=[rows_of(1), rows_of(5)]), spec=SPEC)
    assert (many.value.row, many.value.trajectory_id) == (1, "b")
    with pytest.raises(SchemaError) as short:
        rollout_table(**_base(loss_mask=[[1, 0], [1]]), spec=SPEC)
    assert (short.value.row, short.value.trajectory_id) == (1, "b")
    bad = rows_of(2)
    bad[1, 2, 0] = 16
    with pytest.raises(ExpertRangeError, match=r"routes\[1\]") as ids:
        rollout_table(**_base(routes=[rows_of(1), bad]), spec=SPEC)
    assert (ids.value.row, ids.value.token, ids.value.layer) == (1, 1, 2)
    # a large_list column: the offending trajectory and its own token are located
    col = pa.LargeListArray.from_arrays(
        pa.array([0, 1, 3], type=pa.int64()),
        r3arrow.spec.numpy_to_routes(np.concatenate([rows_of(1), bad]).astype(np.uint8), SPEC),
    )
    with pytest.raises(ExpertRangeError, match=r"routes\[1\]") as located:
        rollout_table(**_base(routes=col), spec=SPEC)
    assert (located.value.row, located.value.token, located.value.layer) == (1, 1, 2)


def test_built_and_selected_tables_are_marked_validated() -> None:
    four = {k: v + v for k, v in _base().items()}
    four.update(trajectory_id=["a", "b", "c", "d"], group_id=["g", "g", "h", "h"])
    four.update(reward=[0.0, 1.0, 1.0, 1.0])  # group h is uniform
    table = rollout_table(**four, spec=SPEC)
    assert is_validated(table)
    validate_rollouts(table)  # still valid: the mark only saves a second check
    assert is_validated(take_rows(table, [1, 0]))
    assert is_validated(filter_rows(table, [True, False, True, False]))
    assert is_validated(filter_groups(table)) and filter_groups(table).num_rows == 2
    assert is_validated(replace_groups(table).table)
    outside = pa.Table.from_batches(table.to_batches())
    assert not is_validated(outside) and not is_validated(take_rows(outside, [0]))
