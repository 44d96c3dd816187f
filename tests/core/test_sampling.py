"""Dynamic sampling: filter_groups / replace_groups / reduce_tokens.

Literal cases for each rule (singleton groups kept, the tolerance boundary, all-masked
trajectories left out of the spread test, the replace signal, token-reward reductions),
a transcription of SkyRL's ``zero_variance_filter`` as the reference, and property tests on
`r3arrow.testing.strategies.rollout_tables`: every column, routes included, stays with its
trajectory, and kept rows keep their order.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import r3arrow
from r3arrow import RouteSpec
from r3arrow._validated import is_validated
from r3arrow.errors import SchemaError
from r3arrow.table import (
    ReplaceResult,
    filter_groups,
    reduce_tokens,
    replace_groups,
    rollout_table,
    with_columns,
)
from r3arrow.table._sampling import varied_groups
from r3arrow.testing import random_routes
from r3arrow.testing.strategies import rollout_tables

SPEC = RouteSpec(num_layers=3, topk=2, num_experts=16, moe_layers=(0, 2))


def pylist(arr: Any) -> list[Any]:
    out: list[Any] = arr.to_pylist()
    return out


def table_of(
    groups: list[str],
    rewards: list[float],
    masks: list[list[int]] | None = None,
    **extra: Any,
) -> pa.Table:
    """One trajectory per group entry: prompt of 2, response of 2, all 3 needed rows captured."""
    n = len(groups)
    rng = np.random.default_rng(n)
    return rollout_table(
        trajectory_id=[f"t{i}" for i in range(n)],
        group_id=groups,
        prompt_ids=[[1, 2]] * n,
        response_ids=[[3, 4]] * n,
        loss_mask=masks if masks is not None else [[1, 1]] * n,
        reward=rewards,
        routes=[random_routes(rng, 3, SPEC) for _ in range(n)],
        spec=SPEC,
        step=list(range(n)),
        **extra,
    )


def steps(table: pa.Table) -> list[int]:
    return pylist(table.column("step"))


def rows_by_id(table: pa.Table) -> dict[str, dict[str, Any]]:
    return {r["trajectory_id"]: r for r in table.to_pylist()}


def assert_rows_intact(result: pa.Table, source: pa.Table) -> None:
    """Every row of ``result`` is its trajectory's source row, every column (routes too)."""
    assert result.schema.equals(source.schema, check_metadata=True)
    src = rows_by_id(source)
    for row in result.to_pylist():
        assert row == src[row["trajectory_id"]]


def skyrl_zero_variance_filter(
    rewards: list[float], uids: list[str], loss_masks: list[list[int]] | None, tol: float
) -> list[int]:
    """SkyRL 0.3.0 ``skyrl/train/utils/trainer_utils.py::zero_variance_filter``, transcribed."""
    is_live = [True] * len(rewards) if loss_masks is None else [sum(m) > 0 for m in loss_masks]
    uid2live: dict[str, list[float]] = defaultdict(list)
    for uid, reward, live in zip(uids, rewards, is_live, strict=True):
        if live:
            uid2live[uid].append(reward)

    def zero_variance(uid: str) -> bool:
        vals = uid2live.get(uid, [])
        return len(vals) > 1 and (max(vals) - min(vals)) <= tol

    kept = {uid for uid in set(uids) if not zero_variance(uid)}
    return [i for i, uid in enumerate(uids) if uid in kept]


# ------------------------------------------------------------ filter: literal rules


def test_filter_groups_literal_singleton_kept_order_kept() -> None:
    # a varies; b all 0; c all 1; d a single row (no spread to test: kept, as SkyRL/verl).
    table = table_of(["a", "b", "a", "c", "b", "c", "d"], [1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 0.5])
    out = filter_groups(table)
    assert steps(out) == [0, 2, 6]
    assert_rows_intact(out, table)
    assert varied_groups(table).tolist() == [True, False, True, False, False, False, True]
    assert is_validated(out)  # a validated source gives a validated result
    assert r3arrow.table.filter_groups is filter_groups


@pytest.mark.parametrize(
    ("tolerance", "kept"),
    [(0.0, True), (0.125, True), (0.25, True), (0.5, False), (0.75, False)],
)
def test_tolerance_boundary(tolerance: float, kept: bool) -> None:
    # Spread 0.5 (exact in binary): uniform when the spread is <= tolerance.
    table = table_of(["g", "g", "g"], [1.0, 1.25, 1.5])
    assert filter_groups(table, tolerance=tolerance).num_rows == (3 if kept else 0)


def test_infinite_values_compare_without_warnings() -> None:
    # inf == inf is uniform (no spread); inf vs a finite value is varied (filterwarnings=error).
    inf = float("inf")
    table = table_of(["a", "a", "b", "b", "c", "c"], [inf, inf, inf, 0.0, -inf, -inf])
    assert steps(filter_groups(table, tolerance=1.0)) == [2, 3]


def test_tolerance_argument_errors() -> None:
    table = table_of(["g", "g"], [0.0, 1.0])
    for bad in (-0.1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="tolerance"):
            filter_groups(table, tolerance=bad)
    with pytest.raises(TypeError, match="tolerance"):
        filter_groups(table, tolerance=True)
    with pytest.raises(TypeError, match="tolerance"):
        filter_groups(table, tolerance="0.1")  # type: ignore[arg-type]
    labelled = table.append_column("label", pa.array(["x", "y"]))
    assert filter_groups(labelled, value="label").num_rows == 2  # strings compare for equality
    with pytest.raises(ValueError, match="numeric"):
        filter_groups(labelled, value="label", tolerance=0.5)


def test_all_masked_trajectories_are_left_out_of_the_spread_test() -> None:
    z, one = [0, 0], [1, 1]
    table = table_of(
        ["a", "a", "a", "b", "b", "c", "c", "d", "d"],
        [1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0, 1.0, 0.0],
        [one, z, one, one, z, z, z, [0, 1], [1, 0]],
    )
    # a: live rewards 1, 1 -> uniform: dropped with its masked member (same fate).
    # b: one live member -> no spread to test: kept, masked member too.
    # c: no live member -> kept (SkyRL keeps groups with <= 1 live trajectory).
    # d: partly masked trajectories are live: spread 1 -> kept.
    assert steps(filter_groups(table)) == [3, 4, 5, 6, 7, 8]
    assert steps(filter_groups(table, ignore_masked=False)) == [0, 1, 2, 3, 4, 7, 8]
    masks = pylist(table.column("loss_mask"))
    rewards = pylist(table.column("reward"))
    groups = pylist(table.column("group_id"))
    assert steps(filter_groups(table)) == skyrl_zero_variance_filter(rewards, groups, masks, 0.0)


def test_filter_groups_other_columns_and_errors() -> None:
    table = table_of(["g"] * 6, [0.0] * 6)
    grouped = table.append_column("label", pa.array(["x", "x", "y", "x", "x", "x"]))
    grouped = grouped.append_column("bucket", pa.array([0, 0, 0, 1, 1, 1]))
    out = filter_groups(grouped, by="bucket", value="label")  # string values; an int group key
    assert out.column("bucket").to_pylist() == [0, 0, 0]
    with pytest.raises(SchemaError, match="'nope'"):
        filter_groups(table, by="nope")
    with pytest.raises(SchemaError, match="'nope'"):
        filter_groups(table, value="nope")
    nulls = table.append_column("score", pa.array([1.0, None, 0.0, 1.0, 1.0, 1.0]))
    with pytest.raises(SchemaError, match=r"score: expected no nulls.*row 1") as info:
        filter_groups(nulls, value="score")
    assert info.value.trajectory_id == "t1"
    nan = table.append_column("score", pa.array([1.0, np.nan, 0.0, 1.0, 1.0, 1.0]))
    with pytest.raises(SchemaError, match="NaN"):
        filter_groups(nan, value="score")


# ------------------------------------------------------------- token-level values


def test_reduce_tokens_literal() -> None:
    values = [[1.0, 2.0, 3.0], [], [5.0], [-1.0, 4.0]]
    table = table_of(["a", "a", "b", "b"], [0.0] * 4, token_rewards=values)
    nan = np.nan
    want = {
        "sum": [6.0, 0.0, 5.0, 3.0],
        "mean": [2.0, nan, 5.0, 1.5],
        "last": [3.0, nan, 5.0, 4.0],
        "max": [3.0, nan, 5.0, 4.0],
    }
    chunked = pa.concat_tables([table.slice(0, 1), table.slice(1, 2), table.slice(3)])
    for rule, expected in want.items():
        for t in (table, chunked):
            got = reduce_tokens(t, "token_rewards", reduce=rule)
            assert got.dtype == np.float64
            np.testing.assert_array_equal(got, expected)
    ints = table_of(["a"], [0.0], token_rewards=pa.array([[1, 2]], pa.large_list(pa.int8())))
    assert reduce_tokens(ints, "token_rewards", reduce="sum").tolist() == [3.0]


def test_token_rewards_as_the_filter_value() -> None:
    # Per-trajectory sums: a -> 1, 1 (uniform); b -> 1, 2 (varied); c -> 0.5 (singleton).
    tokens = [[0.5, 0.5], [1.0, 0.0], [1.0], [2.0, 0.0], [0.5]]
    table = table_of(["a", "a", "b", "b", "c"], [0.0] * 5, token_rewards=tokens)
    assert steps(filter_groups(table, value="token_rewards", reduce="sum")) == [2, 3, 4]
    # By the last token: a -> 0.5, 0 (varied); b -> 1, 0 (varied).
    assert steps(filter_groups(table, value="token_rewards", reduce="last")) == [0, 1, 2, 3, 4]
    # By the max: a -> 0.5, 1; b -> 1, 2: both varied.
    assert steps(filter_groups(table, value="token_rewards", reduce="max")) == [0, 1, 2, 3, 4]
    # By the mean: a -> 0.5, 0.5 (uniform); b -> 1, 1 (uniform).
    assert steps(filter_groups(table, value="token_rewards", reduce="mean")) == [4]


def test_token_value_errors() -> None:
    table = table_of(["a", "a"], [0.0, 1.0], token_rewards=[[1.0], []])
    with pytest.raises(ValueError, match="reduce="):
        filter_groups(table, value="token_rewards")  # a list column needs a rule
    with pytest.raises(ValueError, match="list column"):
        filter_groups(table, reduce="sum")  # reward is scalar
    with pytest.raises(ValueError, match="reduce"):
        reduce_tokens(table, "token_rewards", reduce="median")
    with pytest.raises(SchemaError, match="list of numbers"):
        reduce_tokens(table.append_column("w", pa.array([["x"], []])), "w", reduce="sum")
    with pytest.raises(SchemaError, match="'nope'"):
        reduce_tokens(table, "nope", reduce="sum")
    # A live trajectory with no token value has no mean: an error, not a silent NaN group.
    with pytest.raises(SchemaError, match=r"NaN \(row 1\)"):
        filter_groups(table, value="token_rewards", reduce="mean")
    masked = table_of(
        ["a", "a", "a"], [0.0] * 3, [[1, 1], [1, 1], [0, 0]], token_rewards=[[1.0], [1.0], []]
    )
    assert filter_groups(masked, value="token_rewards", reduce="mean").num_rows == 0  # ignored
    nulls = table_of(["a", "a"], [0.0, 1.0], token_rewards=[[1.0], [2.0, None]])
    with pytest.raises(SchemaError, match=r"no null values.*row 1") as info:
        reduce_tokens(nulls, "token_rewards", reduce="sum")
    assert (info.value.row, info.value.trajectory_id) == (1, "t1")


# ----------------------------------------------------------------- replace: literal


def test_replace_groups_literal_and_deterministic() -> None:
    table = table_of(
        ["a", "a", "b", "b", "b", "c", "c", "d", "d"],
        [0.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.5, 0.0, 0.0],
    )  # kept: a, c; uniform: b, d
    out = replace_groups(table, seed=3).table
    assert out.num_rows == table.num_rows
    assert out.schema.equals(table.schema, check_metadata=True)
    assert out.equals(replace_groups(table, seed=3).table)  # deterministic under a seed
    got = steps(out)
    assert [got[i] for i in (0, 1, 5, 6)] == [0, 1, 5, 6]  # kept rows stay in place
    assert all(got[p] in {0, 1, 5, 6} for p in (2, 3, 4, 7, 8))
    group_of = dict(enumerate(pylist(table.column("group_id"))))
    source_b = {group_of[got[p]] for p in (2, 3, 4)}
    source_d = {group_of[got[p]] for p in (7, 8)}
    assert len(source_b) == len(source_d) == 1  # one replacement group per uniform group
    assert source_b != source_d  # 2 kept >= 2 uniform: distinct replacements (as SkyRL)
    a_or_c = [got[p] for p in (2, 3, 4)]
    assert a_or_c in ([0, 1, 0], [5, 6, 5])  # k-th row <- row k mod size
    assert_rows_intact(out, table)
    r3arrow.validate_rollouts(out)


def test_replace_groups_result_and_the_keep_sampling_signal() -> None:
    table = table_of(["a", "a", "b", "b", "c", "c", "d", "d"], [0, 1, 1, 1, 0, 0, 1, 1])
    info = replace_groups(table, seed=1)  # 1 of 4 groups kept, more than 0 * 4
    assert isinstance(info, ReplaceResult)
    assert (info.num_groups, info.kept_groups, info.replaced_groups) == (4, 1, 3)
    assert info.enough
    assert steps(info.table) == [0, 1, 0, 1, 0, 1, 0, 1]  # with replacement: fewer kept
    assert info.source_rows.tolist() == steps(info.table)
    # SkyRL's threshold: enough iff kept > min_replace_ratio * groups (strict).
    below = replace_groups(table, seed=1, min_replace_ratio=0.25)  # 1 > 1.0: no
    assert not below.enough  # SkyRL's keep_sampling: sample another batch
    assert below.table is table and below.replaced_groups == 0
    assert below.source_rows.tolist() == list(range(8))
    assert replace_groups(table, seed=1, min_replace_ratio=0.2).enough  # 1 > 0.8
    assert (below.num_groups, below.kept_groups) == (4, 1)  # a signal, never an error
    for bad in (-0.1, 1.5):
        with pytest.raises(ValueError, match="min_replace_ratio"):
            replace_groups(table, min_replace_ratio=bad)
    with pytest.raises(TypeError, match="min_replace_ratio"):
        replace_groups(table, min_replace_ratio=None)  # type: ignore[arg-type]


def test_replace_groups_edge_cases() -> None:
    varied = table_of(["a", "a", "b", "b"], [0.0, 1.0, 1.0, 0.0])
    assert replace_groups(varied, seed=0).table is varied  # nothing dropped: unchanged
    info = replace_groups(varied, min_replace_ratio=1.0)
    assert info.enough and info.replaced_groups == 0  # nothing to replace counts as enough
    uniform = table_of(["a", "a", "b", "b"], [1.0, 1.0, 0.0, 0.0])
    none_kept = replace_groups(uniform, seed=0)  # every group uniform: nothing to draw from
    assert not none_kept.enough and none_kept.kept_groups == 0 and none_kept.table is uniform
    empty = varied.slice(0, 0)
    assert replace_groups(empty).table.num_rows == 0 and filter_groups(empty).num_rows == 0
    with pytest.raises(ValueError, match="seed"):
        replace_groups(varied, seed=-1)


# ------------------------------------------------------------ properties (hypothesis)


def _regroup(table: pa.Table, data: st.DataObject) -> pa.Table:
    """``table`` with drawn group ids and 0/1 rewards (so some groups are uniform)."""
    n = table.num_rows
    groups = data.draw(st.lists(st.sampled_from(["g0", "g1", "g2", "g3"]), min_size=n, max_size=n))
    rewards = data.draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=n, max_size=n))
    return with_columns(
        table,
        {
            "group_id": pa.array(groups, pa.large_string()),
            "reward": pa.array(rewards, pa.float64()),
        },
    )


@settings(max_examples=60, deadline=None)
@given(table=rollout_tables(max_rows=8), data=st.data(), ignore_masked=st.booleans())
def test_filter_groups_keeps_rows_whole_and_in_order(
    table: pa.Table, data: st.DataObject, ignore_masked: bool
) -> None:
    table = _regroup(table, data)
    out = filter_groups(table, ignore_masked=ignore_masked)
    ids = pylist(table.column("trajectory_id"))
    kept = skyrl_zero_variance_filter(
        pylist(table.column("reward")),
        pylist(table.column("group_id")),
        pylist(table.column("loss_mask")) if ignore_masked else None,
        0.0,
    )
    assert pylist(out.column("trajectory_id")) == [ids[i] for i in kept]  # order kept
    assert_rows_intact(out, table)  # routes and every other column stay attached
    if out.num_rows:
        r3arrow.validate_rollouts(out)


@settings(max_examples=60, deadline=None)
@given(table=rollout_tables(max_rows=8), data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_replace_groups_keeps_rows_whole(table: pa.Table, data: st.DataObject, seed: int) -> None:
    table = _regroup(table, data)
    keep = varied_groups(table)
    info = replace_groups(table, seed=seed)
    if not info.enough:
        assert table.num_rows and not keep.any() and info.table is table
        return
    out = info.table
    assert out.num_rows == table.num_rows
    assert out.equals(replace_groups(table, seed=seed).table)
    src = info.source_rows
    for i in range(table.num_rows):
        assert src[i] == i if keep[i] else keep[src[i]]  # kept stay, others come from kept
    assert pylist(out.column("trajectory_id")) == [
        pylist(table.column("trajectory_id"))[j] for j in src
    ]
    assert_rows_intact(out, table)
