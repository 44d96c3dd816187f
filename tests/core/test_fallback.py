"""Route-local fallback, the data half (``docs/fallback.md``): `RouteTrace.record` with
``on_short="mark"``, the marks through `TurnStore`, `rollout_table` / `validate_rollouts` and
Parquet (layer groups, ``layers=`` and ``columns=`` projections)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from r3arrow import RouteSpec, RouteTrace, TurnStore
from r3arrow._schema import MISSING_KEY, ROUTES_MISSING, missing_routes, placeholder_rows
from r3arrow.errors import (
    DuplicateExpertError,
    ExpertRangeError,
    RouteShapeError,
    SchemaError,
)
from r3arrow.io import read_rollouts, write_rollouts
from r3arrow.spec import routes_to_numpy
from r3arrow.table import flat_routes, rollout_table, validate_rollouts
from r3arrow.testing import random_routes

SPEC = RouteSpec(num_layers=3, topk=2, num_experts=8)
LITERAL = RouteSpec(num_layers=2, topk=2, num_experts=4)


def rows_of(n: int, spec: RouteSpec = SPEC, *, seed: int = 0) -> np.ndarray:
    return random_routes(np.random.default_rng(seed), n, spec)


def pylist(arr: Any) -> list[Any]:
    """``arr.to_pylist()``, loosely typed (pyarrow-stubs refuse it on list arrays)."""
    out: list[Any] = arr.to_pylist()
    return out


def marks_of(table: pa.Table) -> list[list[int]]:
    return pylist(table.column(ROUTES_MISSING))


# ------------------------------------------------------------------ the trace


def test_short_delivery_marks_the_tail_literal() -> None:
    trace = RouteTrace(LITERAL)
    got = np.array([[[1, 2], [3, 0]], [[2, 3], [0, 1]]], dtype=np.uint8)  # 2 of P=3 + G=2 - 1
    assert trace.record(got, prompt_tokens=3, generated_tokens=2, on_short="mark") == 0
    assert trace.captured == 4 and trace.seen_tokens == 5
    assert trace.missing is not None and trace.missing.tolist() == [0, 0, 1, 1]
    out = routes_to_numpy(trace.finalize(num_tokens=5, loss_mask=[0, 0, 0, 1, 1]), LITERAL)
    want = [
        [[1, 2], [3, 0]],
        [[2, 3], [0, 1]],
        [[0, 1], [0, 1]],  # placeholders: ids 0..K-1 on every layer
        [[0, 1], [0, 1]],
    ]
    assert out.tolist() == want


def test_failed_turn_marks_the_whole_turn_literal() -> None:
    trace = RouteTrace(LITERAL)
    first = np.array([[[1, 2], [3, 0]]] * 4, dtype=np.uint8)
    trace.record(first, prompt_tokens=3, generated_tokens=2)
    assert trace.missing is None  # nothing marked: no marks at all
    # Turn 2: P=7, captured=4, G=2: 7 - 4 + 2 - 1 = 4 rows, none delivered (None, then []).
    assert trace.record(None, prompt_tokens=7, generated_tokens=2, on_short="mark") == 4
    empty = np.zeros((0, 2, 2), dtype=np.uint8)
    assert trace.record(empty, prompt_tokens=10, generated_tokens=1, on_short="mark") == 8
    assert trace.captured == 10
    assert trace.missing is not None
    assert trace.missing.tolist() == [0] * 4 + [1] * 4 + [1] * 2
    out = routes_to_numpy(trace.finalize(num_tokens=11, loss_mask=[0] * 11), LITERAL)
    assert out[:4].tolist() == first.tolist()
    assert out[4:].tolist() == placeholder_rows(LITERAL, 6).tolist()


def test_error_policy_is_unchanged() -> None:
    trace = RouteTrace(SPEC)
    with pytest.raises(RouteShapeError, match="expected 7 rows"):
        trace.record(rows_of(6), prompt_tokens=5, generated_tokens=3)
    with pytest.raises(RouteShapeError, match="expected 7 rows"):
        trace.record(rows_of(0), prompt_tokens=5, generated_tokens=3)
    assert trace.captured == 0 and trace.missing is None
    with pytest.raises(ValueError, match="on_short"):
        trace.record(rows_of(7), prompt_tokens=5, generated_tokens=3, on_short="pad")  # type: ignore[arg-type]


def test_more_rows_than_wanted_always_raise() -> None:
    trace = RouteTrace(SPEC)
    with pytest.raises(RouteShapeError, match=r"expected 7 rows .* found 8"):
        trace.record(rows_of(8), prompt_tokens=5, generated_tokens=3, on_short="mark")
    assert trace.captured == 0 and trace.missing is None


def test_arrived_rows_are_still_checked() -> None:
    trace = RouteTrace(SPEC)
    bad = rows_of(3)
    bad[1, 0, 1] = bad[1, 0, 0]
    with pytest.raises(DuplicateExpertError):
        trace.record(bad, prompt_tokens=5, generated_tokens=3, on_short="mark")
    far = rows_of(3).astype(np.int32)
    far[0, 2, 0] = 8
    with pytest.raises(ExpertRangeError):
        trace.record(far, prompt_tokens=5, generated_tokens=3, on_short="mark")
    assert trace.captured == 0 and trace.missing is None


def test_unknown_num_experts_keeps_placeholders_in_the_id_bound() -> None:
    """All rows missing without num_experts: the result's bound still covers ids 0..K-1."""
    spec = RouteSpec(num_layers=2, topk=3, num_experts=None)
    store = TurnStore(spec)
    trace = store.trace("t")
    trace.record(None, prompt_tokens=3, generated_tokens=2, on_short="mark")
    trace.finalize(num_tokens=5, loss_mask=[0] * 5)
    table = rollout_table(
        trajectory_id=["t"],
        group_id=["g"],
        prompt_ids=[[1, 2, 3]],
        response_ids=[[4, 5]],
        loss_mask=[[0, 0]],
        reward=[0.0],
        routes=store.routes_chunked(["t"]),
        spec=store.spec,
        routes_missing=store.routes_missing(["t"]),
    )
    validate_rollouts(table)
    rows, _ = flat_routes(table)
    assert rows.tolist() == [[[0, 1, 2]] * 2] * 4
    assert marks_of(table) == [[1, 1, 1, 1]]


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.tuples(st.integers(1, 6), st.integers(1, 4), st.integers(0, 10)), max_size=4),
    st.integers(0, 2**31 - 1),
)
def test_mark_split_keeps_arrived_rows_bit_for_bit(
    turns: list[tuple[int, int, int]], seed: int
) -> None:
    """Random short deliveries: the arrived rows are kept as given, the rest are placeholders
    and marked, and every count matches a trace recording the whole turns."""
    rng = np.random.default_rng(seed)
    trace = RouteTrace(SPEC)
    p = 1
    want_rows: list[Any] = []
    want_marks: list[int] = []
    for extra_prompt, g, short in turns:
        p += extra_prompt
        want = p - trace.captured + g - 1
        n = max(0, want - short)
        got = random_routes(rng, n, SPEC)
        start = trace.record(got, prompt_tokens=p, generated_tokens=g, on_short="mark")
        assert start == len(want_rows)
        want_rows += [*got.tolist(), *placeholder_rows(SPEC, want - n).tolist()]
        want_marks += [0] * n + [1] * (want - n)
        p += g
    assert trace.captured == len(want_rows)
    marks = trace.missing
    if any(want_marks):
        assert marks is not None and marks.tolist() == want_marks
    else:
        assert marks is None
    out = trace.finalize(num_tokens=p, loss_mask=np.zeros(p, np.uint8))
    assert routes_to_numpy(out, SPEC).reshape(-1, 3, 2).tolist() == want_rows


# ------------------------------------------------------------------ the store


def _two_trajectories() -> TurnStore:
    store = TurnStore(LITERAL)
    a = store.trace("a")
    a.record(np.array([[[1, 2], [3, 0]]] * 4, np.uint8), prompt_tokens=3, generated_tokens=2)
    a.record(
        np.array([[[2, 3], [0, 1]]], np.uint8), prompt_tokens=7, generated_tokens=1, on_short="mark"
    )  # 1 of 7 - 4 + 1 - 1 = 3 rows
    a.finalize(num_tokens=8, loss_mask=[0, 0, 0, 1, 1, 0, 0, 1])
    b = store.trace("b")
    b.record(np.array([[[0, 3], [1, 2]]] * 2, np.uint8), prompt_tokens=2, generated_tokens=1)
    return store


def test_store_keeps_marks_per_turn_literal() -> None:
    store = _two_trajectories()
    col = store.routes_missing(["b", "a"])
    assert col is not None and pylist(col) == [[0, 0], [0, 0, 0, 0, 0, 1, 1]]
    assert store.routes_missing(["b"]) is None  # none of b's rows is marked
    table = store.to_table()
    assert table.schema.metadata is not None and table.schema.metadata[MISSING_KEY] == b"1"
    assert table.column(ROUTES_MISSING).to_pylist() == [[0, 0, 0, 0], [0, 1, 1], [0, 0]]
    # A second store takes the batches back, marks and all.
    copy = TurnStore(LITERAL)
    for batch in store.batches():
        copy.append_batch(batch)
    got = copy.routes_missing(["a", "b"])
    assert got is not None and pylist(got) == [[0, 0, 0, 0, 0, 1, 1], [0, 0]]


def test_store_without_marks_is_unchanged() -> None:
    store = TurnStore(SPEC)
    trace = store.trace("t")
    trace.record(rows_of(7), prompt_tokens=5, generated_tokens=3, on_short="mark")  # all arrived
    assert store.routes_missing(["t"]) is None
    assert store.to_table().schema.names == ["trajectory_id", "token_start", "routes"]
    assert MISSING_KEY not in (store.to_table().schema.metadata or {})


def test_append_batch_refuses_bad_marks() -> None:
    store = _two_trajectories()
    batch = store.to_table().combine_chunks().to_batches()[0]
    bad = batch.set_column(
        3, ROUTES_MISSING, pa.array([[0, 2, 0, 0], [0, 0, 1], [0, 0]], pa.large_list(pa.uint8()))
    )
    with pytest.raises(SchemaError, match=r"expected 0 .* or 1"):
        TurnStore(LITERAL).append_batch(bad)


# ------------------------------------------------------------------ the table


def _table(store: TurnStore, **over: Any) -> pa.Table:
    ids = ["a", "b"]
    args: dict[str, Any] = {
        "trajectory_id": ids,
        "group_id": ["g", "g"],
        "prompt_ids": [[5, 6, 7], [5, 6]],
        "response_ids": [[1, 2, 3, 4, 9], [1, 2]],
        "loss_mask": [[1, 1, 0, 0, 1], [1, 0]],
        "reward": [1.0, 0.0],
        "routes": store.routes_chunked(ids),
        "spec": store.spec,
        "routes_missing": store.routes_missing(ids),
    }
    return rollout_table(**{**args, **over})


def test_rollout_table_carries_the_marks() -> None:
    table = _table(_two_trajectories())
    assert table.schema.field(ROUTES_MISSING).type == pa.large_list(pa.uint8())
    assert table.schema.metadata is not None and table.schema.metadata[MISSING_KEY] == b"1"
    assert marks_of(table) == [[0, 0, 0, 0, 0, 1, 1], [0, 0]]
    marks = missing_routes(table)
    assert marks is not None and marks.tolist() == [0, 0, 0, 0, 0, 1, 1, 0, 0]
    assert validate_rollouts(table) == LITERAL
    plain = _table(_two_trajectories(), routes_missing=None)
    assert ROUTES_MISSING not in plain.schema.names
    assert MISSING_KEY not in (plain.schema.metadata or {})


@pytest.mark.parametrize(
    ("marks", "match"),
    [
        ([[0, 0, 0, 0, 0, 1], [0, 0]], "expected one mark per route row, found 6 marks for 7"),
        ([[0, 0, 0, 0, 0, 1, 1, 1], [0, 0]], "found 8 marks for 7"),
        ([[0, 0, 0, 0, 0, 1, 1], [0]], "found 1 marks for 2"),
        ([[0, 0, 0, 0, 0, 1, 2], [0, 0]], r"or 1 \(missing\), found 2"),
        ([[0, 0, 0, 0, 0, 1, None], [0, 0]], "no null marks"),
        ([None, [0, 0]], "no null rows"),
    ],
)
def test_rollout_table_refuses_bad_marks(marks: list[Any], match: str) -> None:
    with pytest.raises(SchemaError, match=match):
        _table(_two_trajectories(), routes_missing=marks)


def test_validate_refuses_bad_mark_columns() -> None:
    table = _table(_two_trajectories())
    i = table.schema.get_field_index(ROUTES_MISSING)
    # The key without the column: the placeholders would read as routes.
    dropped = table.drop_columns([ROUTES_MISSING])
    assert dropped.schema.metadata is not None and MISSING_KEY in dropped.schema.metadata
    with pytest.raises(SchemaError, match="expected a 'routes_missing' column"):
        validate_rollouts(dropped)
    longer = pa.array([[0] * 7, [0, 0, 1]], pa.large_list(pa.uint8()))
    with pytest.raises(SchemaError, match="found 3 marks for 2 route rows in row 1") as exc:
        validate_rollouts(table.set_column(i, ROUTES_MISSING, longer))
    assert exc.value.trajectory_id == "b"
    wide = pa.array([[0] * 7, [0, 0]], pa.large_list(pa.int32()))
    with pytest.raises(SchemaError, match="expected large_list<uint8>"):
        validate_rollouts(table.set_column(i, ROUTES_MISSING, wide))
    with pytest.raises(TypeError, match="routes_missing= with routes= and spec="):
        rollout_table(
            trajectory_id=["a"],
            group_id=["g"],
            prompt_ids=[[1]],
            response_ids=[[2]],
            loss_mask=[[1]],
            reward=[0.0],
            routes_missing=[[]],
        )


# ------------------------------------------------------------------ Parquet


@pytest.mark.parametrize("portable", [False, True])
def test_parquet_round_trips_the_marks(tmp_path: Path, portable: bool) -> None:
    table = _table(_two_trajectories())
    path = write_rollouts(table, tmp_path / "r.parquet", portable=portable, layer_group=None)
    back = read_rollouts(path)
    assert marks_of(back) == marks_of(table)
    assert back.schema.metadata is not None and back.schema.metadata[MISSING_KEY] == b"1"
    assert flat_routes(back)[0].tolist() == flat_routes(table)[0].tolist()


def test_projections_keep_the_marks(tmp_path: Path) -> None:
    table = _table(_two_trajectories())
    path = write_rollouts(table, tmp_path / "r.parquet", layer_group=1)  # a group per layer
    only = read_rollouts(path, columns=["trajectory_id", "routes"])
    assert only.schema.names == ["trajectory_id", "routes", ROUTES_MISSING]
    assert marks_of(only) == [[0, 0, 0, 0, 0, 1, 1], [0, 0]]
    one = read_rollouts(path, layers=[1])
    assert marks_of(one) == marks_of(table)
    rows, _ = flat_routes(one)
    assert rows[:, 0].tolist() == flat_routes(table)[0][:, 1].tolist()
    both = read_rollouts(path, columns=["routes"], layers=[0])
    assert both.schema.names == ["routes", ROUTES_MISSING] and marks_of(both) == marks_of(table)
    # Neither routes nor marks asked: neither read (the key stays; no marks are needed).
    assert read_rollouts(path, columns=["reward"]).schema.names == ["reward"]
