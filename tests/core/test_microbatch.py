"""Microbatch planning (torch-free core): whole trajectories, token budget or count, balance."""

from __future__ import annotations

import math
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import r3arrow
from r3arrow.errors import SchemaError
from r3arrow.microbatch import split_microbatch_indices, split_microbatches
from r3arrow.spec import RouteSpec
from r3arrow.table import sequence_lengths


def test_split_by_token_budget_and_count_literal() -> None:
    lens = [5, 3, 8, 2, 6]
    groups = split_microbatch_indices(lens, max_tokens=10)
    assert sorted(i for g in groups for i in g.tolist()) == list(range(5))
    assert all(sum(lens[i] for i in g) <= 10 for g in groups) and len(groups) == 3
    assert all(np.all(np.diff(g) > 0) for g in groups)  # rows ascending within a microbatch
    assert [len(g) for g in split_microbatch_indices(lens, num_microbatches=5)] == [1] * 5
    two = split_microbatch_indices(lens, num_microbatches=2)
    loads = sorted(sum(lens[i] for i in g) for g in two)
    assert sum(loads) == 24 and loads[1] - loads[0] <= max(lens)  # longest-first balance bound
    assert len(split_microbatch_indices(lens, max_tokens=100, num_microbatches=2)) == 2
    assert len(split_microbatch_indices(lens, max_tokens=8, multiple=4)) == 4  # costs 8,4,8,4,8
    unpacked = split_microbatch_indices([4, 4, 1, 1], max_tokens=8, packed=False)
    assert all(len(g) * max([4, 4, 1, 1][i] for i in g) <= 8 for g in unpacked)
    with pytest.raises(SchemaError, match=r"needs 8 tokens.*budget is 7"):
        split_microbatch_indices(lens, max_tokens=7)
    with pytest.raises(ValueError, match=r"num_microbatches: expected 1\.\.5"):
        split_microbatch_indices(lens, num_microbatches=6)
    with pytest.raises(ValueError, match="neither"):
        split_microbatch_indices(lens)


def test_split_rejects_non_positive_lengths_and_sizes() -> None:
    # a zero-length trajectory once left a microbatch empty (IndexError), a negative one
    # was balanced silently, multiple=0 divided by zero
    with pytest.raises(SchemaError, match=r"lengths >= 1, found 0 at row 1"):
        split_microbatch_indices([3, 0], num_microbatches=2)
    with pytest.raises(SchemaError, match=r"lengths >= 1, found -1 at row 1"):
        split_microbatch_indices([3, -1], max_tokens=5)
    with pytest.raises(ValueError, match=r"multiple: expected an int in \[1, inf\], found 0"):
        split_microbatch_indices([3, 2], max_tokens=5, multiple=0)
    with pytest.raises(ValueError, match=r"max_tokens: expected an int in \[1, inf\], found 0"):
        split_microbatch_indices([3, 2], max_tokens=0)


@given(
    st.lists(st.integers(1, 50), min_size=1, max_size=30), st.integers(50, 200), st.integers(1, 4)
)
def test_split_keeps_every_trajectory_once_within_budget(
    lens: list[int], budget: int, multiple: int
) -> None:
    budget = max(budget, -(-max(lens) // multiple) * multiple)
    groups = split_microbatch_indices(lens, max_tokens=budget, multiple=multiple)
    assert sorted(i for g in groups for i in g.tolist()) == list(range(len(lens)))
    costs = [sum(-(-lens[i] // multiple) * multiple for i in g) for g in groups]
    assert max(costs) <= budget
    assert len(groups) <= len(lens)
    assert len(groups) >= math.ceil(sum(-(-n // multiple) * multiple for n in lens) / budget)


def test_errors_carry_the_row() -> None:
    with pytest.raises(SchemaError) as info:
        split_microbatch_indices([3, 0], num_microbatches=2)
    assert info.value.row == 1
    with pytest.raises(SchemaError) as info:
        split_microbatch_indices([3, 9, 2], max_tokens=5)
    assert info.value.row == 1
    with pytest.raises(TypeError, match="max_tokens: expected an int"):
        split_microbatch_indices([3, 2], max_tokens=True)
    with pytest.raises(SchemaError, match=r"non-empty 1-D"):
        split_microbatch_indices([], num_microbatches=1)


def test_split_microbatches_on_a_table_keeps_rows_and_spec() -> None:
    spec = RouteSpec(num_layers=2, topk=1, num_experts=4)
    lens = [4, 2, 5, 1]
    table = r3arrow.rollout_table(
        trajectory_id=[f"t{i}" for i in range(4)],
        group_id=["g"] * 4,
        prompt_ids=[[1]] * 4,
        response_ids=[list(range(n - 1)) for n in lens],
        loss_mask=[[1] * (n - 1) for n in lens],
        reward=[0.0] * 4,
        routes=[np.zeros((n - 1, 2, 1), dtype=np.uint8) for n in lens],
        spec=spec,
    )
    parts = split_microbatches(table, max_tokens=6)
    assert all(int(sequence_lengths(part).sum()) <= 6 for part in parts)
    ids = sorted(str(t) for part in parts for t in part.column("trajectory_id").to_pylist())
    assert ids == ["t0", "t1", "t2", "t3"]
    assert all(r3arrow.route_spec(part) == spec for part in parts)


def test_core_module_imports_no_torch() -> None:
    code = "import sys, r3arrow.microbatch; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], check=False).returncode == 0
