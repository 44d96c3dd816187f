"""Microbatch planning (torch-free core): whole trajectories, token budget or count, balance."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

import r3arrow
from r3arrow.errors import SchemaError
from r3arrow.microbatch import (
    PADDING_TRAJECTORY_ID,
    is_padding_table,
    plan_dp_microbatches,
    split_microbatches,
)
from r3arrow.spec import RouteSpec
from r3arrow.table import sequence_lengths


def test_split_by_token_budget_and_count_literal() -> None:
    lens = [5, 3, 8, 2, 6]
    groups = plan_dp_microbatches(lens, max_tokens=10)[0]
    assert sorted(i for g in groups for i in g.tolist()) == list(range(5))
    assert all(sum(lens[i] for i in g) <= 10 for g in groups) and len(groups) == 3
    assert all(np.all(np.diff(g) > 0) for g in groups)  # rows ascending within a microbatch
    assert [len(g) for g in plan_dp_microbatches(lens, num_microbatches=5)[0]] == [1] * 5
    two = plan_dp_microbatches(lens, num_microbatches=2)[0]
    loads = sorted(sum(lens[i] for i in g) for g in two)
    assert sum(loads) == 24 and loads[1] - loads[0] <= max(lens)  # longest-first balance bound
    assert len(plan_dp_microbatches(lens, max_tokens=100, num_microbatches=2)[0]) == 2
    assert len(plan_dp_microbatches(lens, max_tokens=8, multiple=4)[0]) == 4  # costs 8,4,8,4,8
    unpacked = plan_dp_microbatches([4, 4, 1, 1], max_tokens=8, packed=False)[0]
    assert all(len(g) * max([4, 4, 1, 1][i] for i in g) <= 8 for g in unpacked)
    with pytest.raises(SchemaError, match=r"needs 8 tokens.*budget is 7"):
        plan_dp_microbatches(lens, max_tokens=7)
    with pytest.raises(ValueError, match=r"num_microbatches: expected 1\.\.5"):
        plan_dp_microbatches(lens, num_microbatches=6)
    with pytest.raises(ValueError, match="neither"):
        plan_dp_microbatches(lens)


def test_split_rejects_non_positive_lengths_and_sizes() -> None:
    # a zero-length trajectory once left a microbatch empty (IndexError), a negative one
    # was balanced silently, multiple=0 divided by zero
    with pytest.raises(SchemaError, match=r"lengths >= 1, found 0 at row 1"):
        plan_dp_microbatches([3, 0], num_microbatches=2)
    with pytest.raises(SchemaError, match=r"lengths >= 1, found -1 at row 1"):
        plan_dp_microbatches([3, -1], max_tokens=5)
    with pytest.raises(ValueError, match=r"multiple: expected an int in \[1, inf\], found 0"):
        plan_dp_microbatches([3, 2], max_tokens=5, multiple=0)
    with pytest.raises(ValueError, match=r"max_tokens: expected an int in \[1, inf\], found 0"):
        plan_dp_microbatches([3, 2], max_tokens=0)


@given(
    st.lists(st.integers(1, 50), min_size=1, max_size=30), st.integers(50, 200), st.integers(1, 4)
)
def test_split_keeps_every_trajectory_once_within_budget(
    lens: list[int], budget: int, multiple: int
) -> None:
    budget = max(budget, -(-max(lens) // multiple) * multiple)
    groups = plan_dp_microbatches(lens, max_tokens=budget, multiple=multiple)[0]
    assert sorted(i for g in groups for i in g.tolist()) == list(range(len(lens)))
    costs = [sum(-(-lens[i] // multiple) * multiple for i in g) for g in groups]
    assert max(costs) <= budget
    assert len(groups) <= len(lens)
    assert len(groups) >= math.ceil(sum(-(-n // multiple) * multiple for n in lens) / budget)


def test_errors_carry_the_row() -> None:
    with pytest.raises(SchemaError) as info:
        plan_dp_microbatches([3, 0], num_microbatches=2)
    assert info.value.row == 1
    with pytest.raises(SchemaError) as info:
        plan_dp_microbatches([3, 9, 2], max_tokens=5)
    assert info.value.row == 1
    with pytest.raises(TypeError, match="max_tokens: expected an int"):
        plan_dp_microbatches([3, 2], max_tokens=True)
    with pytest.raises(SchemaError, match=r"non-empty 1-D"):
        plan_dp_microbatches([], num_microbatches=1)


SPEC = RouteSpec(num_layers=2, topk=1, num_experts=4)


def _table(lens: list[int]) -> pa.Table:
    """A rollout table of trajectories ``t0, t1, ...`` with these lengths (prompt of 1)."""
    return r3arrow.rollout_table(
        trajectory_id=[f"t{i}" for i in range(len(lens))],
        group_id=["g"] * len(lens),
        prompt_ids=[[1]] * len(lens),
        response_ids=[list(range(n - 1)) for n in lens],
        loss_mask=[[1] * (n - 1) for n in lens],
        reward=[0.0] * len(lens),
        routes=[np.zeros((n - 1, 2, 1), dtype=np.uint8) for n in lens],
        spec=SPEC,
    )


def test_split_microbatches_on_a_table_keeps_rows_and_spec() -> None:
    spec = SPEC
    table = _table([4, 2, 5, 1])
    parts = split_microbatches(table, max_tokens=6)
    assert all(int(sequence_lengths(part).sum()) <= 6 for part in parts)
    ids = sorted(str(t) for part in parts for t in part.column("trajectory_id").to_pylist())
    assert ids == ["t0", "t1", "t2", "t3"]
    assert all(r3arrow.table.route_spec(part) == spec for part in parts)


def _as_lists(groups: list[np.ndarray]) -> list[list[int]]:
    return [g.tolist() for g in groups]


def test_dp_balanced_plan_literal() -> None:
    lens = [8, 1, 1, 1, 6, 2]
    # Ranks by cost, longest first, ties to the lower rank: rank 0 {0, 1, 3}, rank 1 {2, 4, 5};
    # then each share in two microbatches.
    plan = plan_dp_microbatches(lens, dp_size=2, num_microbatches=2)
    assert [_as_lists(p) for p in plan] == [[[0], [1, 3]], [[2, 5], [4]]]
    table = _table([8, 1, 1, 1, 6, 2])
    for rank in range(2):
        got = split_microbatches(table, num_microbatches=2, dp_size=2, dp_rank=rank)
        ids = [[int(str(t)[1:]) for t in part.column("trajectory_id").to_pylist()] for part in got]
        assert ids == _as_lists(plan[rank])
    # Rank 0 needs two microbatches within the budget, ranks 1 and 2 one: both get a padding one.
    plan = plan_dp_microbatches([8, 8, 8, 1], dp_size=3, max_tokens=8)
    assert [_as_lists(p) for p in plan] == [[[0], [3]], [[1], []], [[2], []]]
    # Fewer trajectories than ranks: a rank of padding only.
    assert [_as_lists(p) for p in plan_dp_microbatches([3], dp_size=2, max_tokens=4)] == [
        [[0]],
        [[]],
    ]
    # num_microbatches above a rank's share: padding fills it up.
    plan = plan_dp_microbatches([5, 4, 3], dp_size=2, num_microbatches=2)
    assert [_as_lists(p) for p in plan] == [[[0], []], [[1], [2]]]
    assert all(g.dtype == np.int64 for p in plan for g in p)


def test_dp_arguments_are_checked() -> None:
    table = _table([3, 2])
    with pytest.raises(ValueError, match=r"dp_rank: expected an int in \[0, 2\).*found None"):
        split_microbatches(table, num_microbatches=1, dp_size=2)
    with pytest.raises(ValueError, match=r"dp_rank: expected an int in \[0, 1\]"):
        split_microbatches(table, num_microbatches=1, dp_size=2, dp_rank=2)
    with pytest.raises(ValueError, match=r"dp_size: expected an int in \[1, inf\]"):
        split_microbatches(table, num_microbatches=1, dp_size=0)
    with pytest.raises(ValueError, match=r"dp_size: expected an int in \[1, inf\]"):
        plan_dp_microbatches([3, 2], num_microbatches=1, dp_size=0)
    with pytest.raises(ValueError, match=r"num_microbatches: expected 1\.\.2"):
        plan_dp_microbatches([3, 2], dp_size=2, num_microbatches=3)
    with pytest.raises(SchemaError, match=r"row 1 needs 9 tokens.*budget is 5") as info:
        plan_dp_microbatches([3, 9, 2], dp_size=2, max_tokens=5)
    assert info.value.row == 1
    with pytest.raises(ValueError, match="neither"):
        plan_dp_microbatches([3], dp_size=2)


def _cost(lens: list[int], g: np.ndarray, multiple: int, packed: bool) -> int:
    c = [-(-lens[i] // multiple) * multiple for i in g.tolist()]
    return sum(c) if packed else len(c) * max(c)


@given(
    st.lists(st.integers(1, 40), min_size=1, max_size=30),
    st.integers(1, 5),
    st.sampled_from([1, 4]),
    st.booleans(),
    st.one_of(st.none(), st.integers(40, 120)),
    st.integers(1, 6),
)
def test_dp_plan_covers_every_trajectory_once_with_equal_counts(
    lens: list[int],
    dp: int,
    multiple: int,
    packed: bool,
    budget: int | None,
    count: int,
) -> None:
    count = min(count, len(lens))
    if budget is not None:
        budget = max(budget, -(-max(lens) // multiple) * multiple)
    bins = None if budget is not None and count % 2 else count  # budget alone, count, or both
    plan = plan_dp_microbatches(
        lens, dp_size=dp, max_tokens=budget, num_microbatches=bins, multiple=multiple, packed=packed
    )
    assert len(plan) == dp
    total = len(plan[0])
    assert all(len(p) == total for p in plan) and total >= (bins or 1)
    rows = sorted(i for p in plan for g in p for i in g.tolist())
    assert rows == list(range(len(lens)))  # every trajectory on exactly one rank, once
    for rank, groups in enumerate(plan):
        sizes = [g.size for g in groups]
        real = sum(1 for n in sizes if n)
        assert all(n == 0 for n in sizes[real:])  # padding microbatches last
        for g in groups[:real]:
            assert np.all(np.diff(g) > 0)
            if budget is not None:
                assert _cost(lens, g, multiple, packed) <= budget
        same = plan_dp_microbatches(  # every rank computes the same plan
            lens,
            max_tokens=budget,
            num_microbatches=bins,
            multiple=multiple,
            packed=packed,
            dp_size=dp,
        )[rank]
        assert _as_lists(same) == _as_lists(groups)
    # Longest-first onto the least loaded rank: loads differ by at most one trajectory's cost.
    cost = [-(-n // multiple) * multiple for n in lens]
    loads = [sum(cost[i] for g in p for i in g.tolist()) for p in plan]
    assert max(loads) - min(loads) <= max(cost)
    if dp == 1:
        plain = plan_dp_microbatches(
            lens, max_tokens=budget, num_microbatches=bins, multiple=multiple, packed=packed
        )[0]
        assert _as_lists(plain) == _as_lists(plan[0])


def test_split_microbatches_with_dp_pads_with_dummy_tables() -> None:
    spec = RouteSpec(num_layers=2, topk=2, num_experts=4)
    lens = [9, 2, 2]
    table = r3arrow.rollout_table(
        trajectory_id=[f"t{i}" for i in range(3)],
        group_id=["g"] * 3,
        prompt_ids=[[1]] * 3,
        response_ids=[list(range(n - 1)) for n in lens],
        loss_mask=[[1] * (n - 1) for n in lens],
        reward=[0.0] * 3,
        routes=[np.tile(np.arange(2, dtype=np.uint8), (n, 2, 1)) for n in lens],
        spec=spec,
        advantage=[1.0, 2.0, 3.0],
    )
    ranks = [split_microbatches(table, max_tokens=9, dp_size=2, dp_rank=r) for r in range(2)]
    assert [len(parts) for parts in ranks] == [1, 1]  # rank 0 {t0}, rank 1 {t1, t2}
    ranks = [split_microbatches(table, num_microbatches=2, dp_size=2, dp_rank=r) for r in range(2)]
    assert [[is_padding_table(p) for p in parts] for parts in ranks] == [
        [False, True],
        [False, False],
    ]
    pad = ranks[0][1]
    assert pad.schema == table.schema.with_metadata(pad.schema.metadata)
    assert pad.to_pylist() == [
        {
            "trajectory_id": PADDING_TRAJECTORY_ID,
            "group_id": PADDING_TRAJECTORY_ID,
            "prompt_ids": [0],
            "response_ids": [],
            "loss_mask": [],
            "reward": 0.0,
            "routes": [],
            "advantage": None,
        }
    ]
    assert r3arrow.table.route_spec(pad) == spec and r3arrow.validate_rollouts(pad) == spec
    ids = [str(t) for parts in ranks for p in parts for t in p.column("trajectory_id").to_pylist()]
    assert sorted(t for t in ids if t != PADDING_TRAJECTORY_ID) == ["t0", "t1", "t2"]


def test_core_module_imports_no_torch() -> None:
    code = "import sys, r3arrow.microbatch; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
