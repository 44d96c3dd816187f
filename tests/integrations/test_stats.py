"""r3arrow.stats: expert load, token subsets, summaries, drift, route agreement, interop."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import typing
from itertools import pairwise
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

import r3arrow
from r3arrow import stats
from r3arrow.errors import DuplicateExpertError, ExpertRangeError, RouteShapeError, SchemaError
from r3arrow.io import read_rollouts, write_rollouts
from r3arrow.spec import RouteSpec
from r3arrow.table import flat_routes, rollout_table
from r3arrow.testing import random_routes


# ------------------------------------------------------------------ helpers
def make_table(
    rng: np.random.Generator,
    spec: RouteSpec,
    shapes: list[tuple[int, int, int]],
    *,
    tag: str = "t",
    trainer_flip: float | None = None,
    **extra: Any,
) -> pa.Table:
    """Rollout table; ``shapes`` = (prompt len, response len, captured rows) per trajectory.

    With ``trainer_flip``, adds a ``trainer_routes`` column: the routes with each
    (token, layer) top-k set permuted, and a fraction of them given one new expert.
    """
    routes = [random_routes(rng, c, spec) for _, _, c in shapes]
    masks = []
    for p, r, c in shapes:
        m = rng.integers(0, 2, r).astype(np.uint8)
        m[p + np.arange(r) > c] = 0  # target p+j needs row p+j-1 < c
        masks.append(m.tolist())
    if trainer_flip is not None:
        extra["trainer_routes"] = _trainer_column(rng, spec, routes, trainer_flip)
    return rollout_table(
        trajectory_id=[f"{tag}-{i}" for i in range(len(shapes))],
        group_id=[f"g{i // 2}" for i in range(len(shapes))],
        prompt_ids=[list(range(p)) for p, _, _ in shapes],
        response_ids=[list(range(r)) for _, r, _ in shapes],
        loss_mask=masks,
        reward=rng.random(len(shapes)),
        routes=routes,
        spec=spec,
        **extra,
    )


def _trainer_column(
    rng: np.random.Generator, spec: RouteSpec, routes: list[np.ndarray], flip: float
) -> pa.LargeListArray[Any]:
    e = spec.num_experts or 256
    out = []
    for r in routes:
        t = r.copy()
        t = np.take_along_axis(
            t, np.argsort(rng.random(t.shape), axis=-1), axis=-1
        )  # order ignored
        for tok, layer in zip(*np.nonzero(rng.random(t.shape[:2]) < flip), strict=True):
            if layer in spec.router_layers:
                unused = np.setdiff1d(np.arange(e), t[tok, layer])
                t[tok, layer, rng.integers(spec.topk)] = rng.choice(unused)
        out.append(t)
    flat = np.concatenate(out) if out else np.zeros((0, *spec.row_shape), spec.dtype)
    offsets = np.concatenate([[0], np.cumsum([len(r) for r in routes])]).astype(np.int64)
    return pa.LargeListArray.from_arrays(
        pa.array(offsets, type=pa.int64()), r3arrow.spec.numpy_to_routes(flat, spec)
    )


def reference_load(rows: np.ndarray, spec: RouteSpec, num_experts: int) -> np.ndarray:
    """Per-layer np.bincount, router layers only."""
    return np.stack(
        [
            np.bincount(rows[:, layer, :].ravel(), minlength=num_experts)
            for layer in spec.router_layers
        ]
    )


def as_matrix(load: pl.DataFrame, spec: RouteSpec) -> np.ndarray:
    return load["tokens"].to_numpy().reshape(len(spec.router_layers), -1)


SPEC = RouteSpec(num_layers=5, topk=3, num_experts=12, moe_layers=(1, 2, 4))


# ------------------------------------------------------------- expert load
@given(
    st.integers(1, 6),
    st.integers(1, 4),
    st.integers(4, 300),
    st.sets(st.integers(0, 5), min_size=1),
    st.lists(
        st.tuples(st.integers(1, 8), st.integers(1, 8), st.integers(0, 16)), min_size=0, max_size=6
    ),
    st.integers(0, 2**32 - 1),
)
def test_expert_load_matches_bincount(
    num_layers: int,
    topk: int,
    num_experts: int,
    moe: set[int],
    shapes: list[tuple[int, int, int]],
    seed: int,
) -> None:
    layers = tuple(sorted(i for i in moe if i < num_layers)) or (0,)
    spec = RouteSpec(
        num_layers=num_layers,
        topk=min(topk, num_experts),
        num_experts=num_experts,
        moe_layers=layers,
    )
    shapes = [(p, r, min(c, p + r)) for p, r, c in shapes]
    rng = np.random.default_rng(seed)
    table = make_table(rng, spec, shapes)
    load = stats.expert_load(table)
    rows, _ = flat_routes(table)
    assert load.columns == ["layer", "expert", "tokens"]
    assert load.dtypes == [pl.Int32, pl.Int32, pl.Int64]
    assert load["layer"].to_list() == [
        layer for layer in spec.router_layers for _ in range(num_experts)
    ]
    assert load["expert"].to_list() == list(range(num_experts)) * len(spec.router_layers)
    np.testing.assert_array_equal(as_matrix(load, spec), reference_load(rows, spec, num_experts))
    assert stats.expert_counts(table).tokens == rows.shape[0]


def test_dense_layer_ids_are_not_counted() -> None:
    spec = RouteSpec(num_layers=3, topk=2, num_experts=4, moe_layers=(1,))
    rows = np.zeros((5, 3, 2), np.uint8)
    rows[:, 1] = [2, 3]
    rows[:, 0] = [0, 1]  # a dense layer carrying ids: ignored, not counted
    load = stats.count_routes(rows, spec).to_polars()
    assert load["layer"].unique().to_list() == [1]
    assert load["tokens"].to_list() == [0, 0, 5, 5]


def test_large_random_load_and_multichunk_table(rng: np.random.Generator) -> None:
    spec = RouteSpec(num_layers=6, topk=4, num_experts=200, moe_layers=(0, 2, 3, 5))
    parts = [
        make_table(rng, spec, [(40, 900, 939), (8, 3000, 3000)], tag=f"p{i}") for i in range(3)
    ]
    table = pa.concat_tables(parts)  # three chunks: processed batch by batch
    assert table.column("routes").num_chunks == 3
    rows = np.concatenate([flat_routes(t)[0] for t in parts])
    np.testing.assert_array_equal(
        as_matrix(stats.expert_load(table), spec), reference_load(rows, spec, 200)
    )


@pytest.mark.parametrize("num_experts", [12, 256, 1000, 70_000])
def test_kernels_over_many_chunks(num_experts: int) -> None:
    """Large inputs: several chunks on the thread pool, every storage dtype, any selection."""
    spec = RouteSpec(num_layers=5, topk=3, num_experts=num_experts, moe_layers=(1, 2, 4))
    rng = np.random.default_rng(num_experts)
    rows = random_routes(rng, 60_000, spec)
    rows[:, 0] = rng.integers(
        0, np.iinfo(spec.dtype).max, size=(60_000, 3)
    )  # dense layers: junk, ignored
    sel = rng.random(60_000) < 0.7
    counts = stats.count_routes(rows, spec)
    np.testing.assert_array_equal(counts.counts, reference_load(rows, spec, num_experts))
    picked = stats.count_routes(rows, spec, select=sel)
    np.testing.assert_array_equal(picked.counts, reference_load(rows[sel], spec, num_experts))
    assert (counts.tokens, picked.tokens) == (60_000, int(sel.sum()))
    other = rows.copy()
    flip = rng.random((60_000, 5)) < 0.1
    other[flip] = random_routes(rng, 60_000, spec)[flip]
    got = stats.route_agreement(rows, other, spec, tokens=sel)
    a, b = rows[sel][:, [1, 2, 4]], other[sel][:, [1, 2, 4]]
    ov = (a[..., :, None] == b[..., None, :]).sum(axis=(-1, -2))
    np.testing.assert_array_equal(got.overlap, ov.sum(axis=0))
    np.testing.assert_array_equal(got.identical, (ov == 3).sum(axis=0))
    assert got.all_identical == int((ov == 3).all(axis=1).sum())


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.int32])
def test_out_of_range_id_in_a_late_chunk(dtype: Any) -> None:
    spec = RouteSpec(num_layers=4, topk=2, num_experts=10, moe_layers=(0, 1, 3))
    rows = random_routes(np.random.default_rng(1), 50_000, spec, dtype=dtype)
    rows[45_000, 1] = [3, 10]  # spills into layer 3's codes
    with pytest.raises(ExpertRangeError, match=r"found 10 \(token 45000, layer 1\)"):
        stats.count_routes(rows, spec)
    with pytest.raises(ExpertRangeError, match=r"found 10 \(token 45000, layer 1\)"):
        stats.count_routes(rows, spec, select=np.arange(50_000) > 40_000)
    assert stats.count_routes(rows, spec, select=np.arange(50_000) < 40_000).tokens == 40_000


def test_unknown_num_experts_spans_ids_seen() -> None:
    spec = RouteSpec(num_layers=2, topk=2, num_experts=None)
    rows = np.array([[[0, 5], [1, 2]], [[5, 3], [2, 1]]], np.uint8)
    counts = stats.count_routes(rows, spec)
    assert counts.num_experts == 6
    np.testing.assert_array_equal(counts.counts, [[1, 0, 0, 1, 0, 2], [0, 2, 2, 0, 0, 0]])
    wider = counts + stats.count_routes(np.array([[[7, 0], [0, 1]]], np.uint8), spec)
    assert wider.num_experts == 8 and wider.tokens == 3
    np.testing.assert_array_equal(wider.counts[:, :6].sum(), counts.counts.sum() + 3)


def test_ids_out_of_range_raise_before_counting() -> None:
    spec = RouteSpec(num_layers=2, topk=2, num_experts=5, moe_layers=(1,))
    rows = np.zeros((3, 2, 2), np.uint8)
    rows[:, 1] = [0, 1]
    rows[2, 1] = [4, 5]
    with pytest.raises(ExpertRangeError, match=r"< num_experts=5, found 5 \(token 2, layer 1\)"):
        stats.count_routes(rows, spec)
    neg = rows.astype(np.int32)
    neg[2, 1] = [-1, 2]
    with pytest.raises(ExpertRangeError, match="found -1"):
        stats.count_routes(neg, spec)
    rows[2, 0] = [9, 9]  # dense layer: not checked, not counted
    rows[2, 1] = [3, 4]
    assert stats.count_routes(rows, spec).counts.sum() == 6


def test_bad_arguments() -> None:
    rng = np.random.default_rng(0)
    table = make_table(rng, SPEC, [(2, 2, 3)])
    with pytest.raises(ValueError, match="tokens: expected one of"):
        stats.expert_load(table, tokens="decode")  # type: ignore[arg-type]
    with pytest.raises(RouteShapeError, match=r"expected bool \[3\]"):
        stats.count_routes(flat_routes(table)[0], SPEC, select=np.ones(2, bool))
    with pytest.raises(SchemaError, match="step"):
        stats.expert_load(table, by_step=True)
    with pytest.raises(TypeError, match="expected a rollout table"):
        stats.expert_load([1, 2, 3])


def test_executor_and_argument_misuse_raise_builtins(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    table = make_table(rng, SPEC, [(2, 2, 3)])
    with pytest.raises(TypeError, match="executor: expected None or an Executor"):
        stats.expert_load(table, executor="ray")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="executor: expected None or an Executor"):
        stats.route_agreement(table, "routes", executor="ray")  # type: ignore[call-overload]
    from r3arrow.ray import RayExecutor  # constructing it needs no ray

    with pytest.raises(ValueError, match="reduce: expected one of"):
        RayExecutor(reduce="tree")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="spec: applies to an executor's dataset"):
        stats.expert_counts(table, spec=SPEC)
    with pytest.raises(TypeError, match="steps"):
        stepped = table.append_column("step", pa.array([0], pa.int64()))
        stats.expert_load(stepped, steps=["0"])  # type: ignore[list-item]
    write_rollouts(table, tmp_path, step=0)
    with pytest.raises(TypeError, match="steps"):
        stats.expert_load(tmp_path, steps=[0.0])  # type: ignore[list-item]


class _ListExecutor:
    """A test `stats.Executor` without Ray: the "dataset" is a list of rollout tables."""

    def __init__(self) -> None:
        self.columns: list[str] = []

    def map_reduce(
        self,
        source: Any,
        block_fn: Any,
        combine_fn: Any,
        *,
        columns: Any,
        spec: RouteSpec | None,
        steps: Any,
        by_step: bool,
    ) -> tuple[dict[int | None, np.ndarray], RouteSpec]:
        assert spec is not None and steps is None
        self.columns = list(columns)
        acc: dict[int | None, np.ndarray] = {}
        for table in source:  # the spec travels in each block's metadata
            for step, vec in block_fn(table.select([*columns, "step"])).items():
                key = step if by_step else None
                acc[key] = combine_fn(acc.get(key, np.zeros(0, np.int64)), vec)
        return acc, spec


def test_an_executor_gets_the_partials_and_sums_them_exactly() -> None:
    """Any object with ``map_reduce`` is an executor: the same integers as local streaming."""
    rng = np.random.default_rng(3)
    parts = [
        make_table(rng, SPEC, [(3, 9, 11), (2, 5, 6)], tag=f"s{s}", trainer_flip=0.2)
        for s in (0, 1, 1)
    ]
    parts = [
        t.append_column("step", pa.array([s] * 2, pa.int64()))
        for t, s in zip(parts, (0, 1, 1), strict=True)
    ]
    whole = pa.concat_tables(parts)
    ex = _ListExecutor()
    assert isinstance(ex, stats.Executor)
    got = stats.expert_counts(parts, tokens="loss", spec=SPEC, executor=ex)
    assert got == stats.expert_counts(whole, tokens="loss")
    assert "loss_mask" in ex.columns and "trainer_routes" not in ex.columns
    by_step = stats.expert_load(parts, by_step=True, spec=SPEC, executor=ex)
    assert by_step.equals(stats.expert_load(whole, by_step=True))
    agree = stats.route_agreement_by_step(parts, "trainer_routes", spec=SPEC, executor=ex)
    assert agree == stats.route_agreement_by_step(whole, "trainer_routes")
    assert stats.route_agreement([], "trainer_routes", SPEC, executor=ex).tokens == 0  # empty
    with pytest.raises(ValueError, match="executor=None only"):
        stats.expert_counts(parts, spec=SPEC, executor=ex, max_memory=1 << 20)


def test_agreement_errors_name_the_global_row() -> None:
    """Id errors in a selection chunk report the row of the whole array, with fields set."""
    spec = RouteSpec(num_layers=2, topk=2, num_experts=6)
    a = random_routes(np.random.default_rng(4), 40, spec)
    b = a.copy()
    b[33, 1] = [5, 5]
    sel = np.arange(40) % 3 == 0  # row 33 is selected
    with pytest.raises(DuplicateExpertError, match=r"\(token 33, layer 1\)") as dup:
        stats.route_agreement(a, b, spec, tokens=sel)
    assert (dup.value.token, dup.value.layer) == (33, 1)
    b[33, 1] = [2, 6]
    with pytest.raises(ExpertRangeError, match=r"found 6 \(token 33, layer 1\)") as rng_err:
        stats.route_agreement(a, b, spec)
    assert (rng_err.value.token, rng_err.value.layer) == (33, 1)
    assert stats.route_agreement(a, b, spec, tokens=np.arange(40) < 33).tokens == 33


# ----------------------------------------------------------- token subsets
def test_token_subsets_literal() -> None:
    spec = RouteSpec(num_layers=1, topk=1, num_experts=8)
    # P=3, R=4, captured 6 of N=7; loss over the response [1, 0, 1, 1]:
    # sequence mask [0 0 0 1 0 1 1]; row i is "loss" iff token i+1 is trained: rows 2, 4, 5.
    routes = np.arange(6, dtype=np.uint8).reshape(6, 1, 1)
    table = rollout_table(
        trajectory_id=["a", "b"],
        group_id=["g", "g"],
        prompt_ids=[[7, 7, 7], [1]],
        response_ids=[[1, 2, 3, 4], [5, 6]],
        loss_mask=[[1, 0, 1, 1], [1, 0]],
        reward=[0.0, 1.0],
        routes=[routes, np.array([[[6]], [[7]]], np.uint8)],
        spec=spec,
    )
    # Second trajectory: P=1, R=2, captured 2: row 0 predicts token 1 (trained), row 1 not.
    sel = {t: stats.token_selection(table, t) for t in ("prompt", "response", "loss")}
    assert stats.token_selection(table, "all") is None
    # rows of trajectory a (6), then of trajectory b (2)
    assert sel["prompt"].tolist() == [1, 1, 1, 0, 0, 0, 1, 0]  # type: ignore[union-attr]
    assert sel["response"].tolist() == [0, 0, 0, 1, 1, 1, 0, 1]  # type: ignore[union-attr]
    assert sel["loss"].tolist() == [0, 0, 1, 0, 1, 1, 1, 0]  # type: ignore[union-attr]
    loss = stats.expert_load(table, tokens="loss")
    assert loss.filter(pl.col("tokens") > 0)["expert"].to_list() == [2, 4, 5, 6]
    prompt = stats.expert_load(table, tokens="prompt")
    assert prompt.filter(pl.col("tokens") > 0)["expert"].to_list() == [0, 1, 2, 6]
    assert stats.expert_counts(table, tokens="response").tokens == 4


def test_token_subsets_partition_the_rows(rng: np.random.Generator) -> None:
    table = make_table(rng, SPEC, [(5, 9, 13), (1, 30, 25), (7, 2, 9), (3, 3, 0)])
    rows, _ = flat_routes(table)
    prompt = stats.expert_counts(table, tokens="prompt")
    response = stats.expert_counts(table, tokens="response")
    np.testing.assert_array_equal((prompt + response).counts, stats.expert_counts(table).counts)
    sel = stats.token_selection(table, "loss")
    assert sel is not None
    np.testing.assert_array_equal(
        stats.expert_counts(table, tokens="loss").counts, reference_load(rows[sel], SPEC, 12)
    )


# --------------------------------------------------------------- summaries
def test_load_summary_literal() -> None:
    load = pl.DataFrame(
        {
            "layer": pl.Series([3] * 4 + [7] * 4, dtype=pl.Int32),
            "expert": pl.Series([0, 1, 2, 3] * 2, dtype=pl.Int32),
            "tokens": pl.Series([4, 0, 2, 2, 1, 1, 1, 1], dtype=pl.Int64),
        }
    )
    s = stats.load_summary(load, hot_factor=1.5)
    assert s["layer"].to_list() == [3, 7]
    assert s["routed"].to_list() == [8, 4]
    assert s["max_over_mean"].to_list() == [2.0, 1.0]
    assert s["cv"][0] == pytest.approx(np.std([4, 0, 2, 2]) / 2)
    assert s["cv"][1] == 0.0
    assert s["entropy"][0] == pytest.approx(1.5)  # shares 1/2, 1/4, 1/4
    assert s["entropy_norm"].to_list() == pytest.approx([0.75, 1.0])
    assert s["dead"].to_list() == [1, 0]
    assert s["hot"].to_list() == [1, 0]
    lazy = stats.load_summary(load.lazy(), hot_factor=1.5)
    assert isinstance(lazy, pl.LazyFrame)
    assert lazy.collect().equals(s)
    assert stats.dead_experts(load).rows() == [(3, 1)]
    assert stats.hot_experts(load, 1.5).rows() == [(3, 0, 4, 2.0)]


def test_summary_of_empty_selection_is_nan() -> None:
    spec = RouteSpec(num_layers=1, topk=1, num_experts=3)
    s = stats.load_summary(stats.count_routes(np.zeros((0, 1, 1), np.uint8), spec).to_polars())
    assert s["routed"].to_list() == [0]
    assert np.isnan(s["max_over_mean"][0]) and np.isnan(s["entropy"][0])


def test_load_drift_literal() -> None:
    def frame(tokens: list[int]) -> pl.DataFrame:
        return stats.ExpertCounts((0,), np.array([tokens]), 1).to_polars()

    same = stats.load_drift(frame([3, 1, 0, 0]), frame([6, 2, 0, 0]))
    assert same.select("tv", "js", "max_shift").row(0) == (0.0, 0.0, 0.0)
    disjoint = stats.load_drift(frame([2, 2, 0, 0]), frame([0, 0, 1, 1]))
    assert disjoint.select("tv", "js", "max_shift").row(0) == pytest.approx((1.0, 1.0, 0.5))
    half = stats.load_drift(frame([1, 1, 0, 0]), frame([1, 0, 1, 0]))
    assert half["tv"][0] == pytest.approx(0.5)
    assert half["js"][0] == pytest.approx(0.5)  # 2 x 0.5 x (0.25 log2(0.5/0.25) ... ) = 0.5 bit


# ---------------------------------------------------------- route agreement
def test_agreement_literal_cases() -> None:
    spec = RouteSpec(num_layers=1, topk=4, num_experts=8)
    a = np.array([[[0, 1, 2, 3]]] * 4, np.uint8)
    b = np.array([[[0, 1, 2, 3]], [[3, 2, 1, 0]], [[4, 5, 6, 7]], [[2, 3, 4, 5]]], np.uint8)
    # identical, identical up to order, disjoint, half overlap
    each = [stats.route_agreement(a[i : i + 1], b[i : i + 1], spec) for i in range(4)]
    assert [r.identical_fraction[0] for r in each] == [1.0, 1.0, 0.0, 0.0]
    assert [r.mean_overlap[0] for r in each] == [1.0, 1.0, 0.0, 0.5]
    assert [r.differing_fraction for r in each] == [0.0, 0.0, 1.0, 1.0]
    total = stats.route_agreement(a, b, spec)
    assert total == sum(each[1:], each[0])
    assert total.identical_fraction[0] == 0.5
    assert total.mean_overlap[0] == pytest.approx(2.5 / 4)
    assert total.summary() == pytest.approx(
        {"tokens": 4.0, "identical": 0.5, "identical_min": 0.5, "overlap": 0.625, "differing": 0.5}
    )


def test_agreement_any_layer_differs() -> None:
    spec = RouteSpec(num_layers=3, topk=2, num_experts=4, moe_layers=(0, 2))
    a = np.array(
        [[[0, 1], [0, 0], [2, 3]], [[0, 1], [0, 0], [2, 3]], [[0, 1], [0, 0], [2, 3]]], np.uint8
    )
    b = a.copy()
    b[0, 2] = [3, 1]  # token 0 differs on layer 2 only
    b[1, 0] = [1, 0]  # token 1: order only
    b[2, 1] = [3, 3]  # token 2: dense layer junk is ignored
    r = stats.route_agreement(a, b, spec)
    assert r.layers == (0, 2)
    assert r.identical_fraction.tolist() == [1.0, pytest.approx(2 / 3)]
    assert r.mean_overlap.tolist() == [1.0, pytest.approx(5 / 6)]
    assert r.differing_fraction == pytest.approx(1 / 3)
    frame = r.per_layer()
    assert frame.columns == ["layer", "tokens", "identical", "overlap"]
    assert frame["layer"].to_list() == [0, 2]
    sel = stats.route_agreement(a, b, spec, tokens=np.array([False, True, True]))
    assert sel.tokens == 2 and sel.differing_fraction == 0.0


@given(st.integers(1, 4), st.integers(0, 40), st.integers(0, 2**32 - 1))
def test_agreement_matches_set_reference(topk: int, rows: int, seed: int) -> None:
    spec = RouteSpec(num_layers=3, topk=topk, num_experts=6)
    rng = np.random.default_rng(seed)
    a = random_routes(rng, rows, spec)
    b = random_routes(rng, rows, spec)
    b[: rows // 2] = a[: rows // 2][..., ::-1]
    r = stats.route_agreement(a, b.astype(np.int64), spec)
    ov = np.array(
        [[len(set(a[t, li]) & set(b[t, li])) for li in range(3)] for t in range(rows)]
    ).reshape(rows, 3)
    assert r.tokens == rows
    np.testing.assert_array_equal(r.overlap, ov.sum(axis=0))
    np.testing.assert_array_equal(r.identical, (ov == topk).sum(axis=0))
    assert r.all_identical == int((ov == topk).all(axis=1).sum())
    assert stats.RouteAgreement.from_vector(r.to_vector()) == r


def test_agreement_rejects_bad_input() -> None:
    spec = RouteSpec(num_layers=1, topk=2, num_experts=4)
    a = np.array([[[0, 1]]], np.uint8)
    with pytest.raises(DuplicateExpertError, match=r"routes b.*\[2, 2\]"):
        stats.route_agreement(a, np.array([[[2, 2]]], np.uint8), spec)
    with pytest.raises(ExpertRangeError, match="found 4"):
        stats.route_agreement(a, np.array([[[0, 4]]], np.int64), spec)
    with pytest.raises(RouteShapeError, match="one shape"):
        stats.route_agreement(a, np.zeros((2, 1, 2), np.uint8), spec)
    with pytest.raises(TypeError, match="needs a rollout table"):
        stats.route_agreement(a, a, spec, tokens="loss")


def test_agreement_on_tables(rng: np.random.Generator) -> None:
    table = make_table(rng, SPEC, [(4, 20, 23), (6, 9, 10), (2, 2, 1)], trainer_flip=0.3)
    rows_a, _ = flat_routes(table)
    rows_b, _ = flat_routes(
        table.select(["trainer_routes"])
        .rename_columns(["routes"])
        .replace_schema_metadata(table.schema.metadata)
    )
    expected = stats.route_agreement(rows_a, rows_b, SPEC)
    assert expected.identical.min() > 0 and expected.differing_fraction > 0
    assert stats.route_agreement(table, "trainer_routes") == expected
    assert stats.route_agreement(table, rows_b) == expected
    other = table.drop_columns(["routes"]).rename_columns(
        [
            n if n != "trainer_routes" else "routes"
            for n in table.drop_columns(["routes"]).column_names
        ]
    )
    assert (
        stats.route_agreement(table, other.replace_schema_metadata(table.schema.metadata))
        == expected
    )
    sel = stats.token_selection(table, "loss")
    assert sel is not None
    assert stats.route_agreement(table, "trainer_routes", tokens="loss") == stats.route_agreement(
        rows_a, rows_b, SPEC, tokens=sel
    )
    with pytest.raises(RouteShapeError, match="same trajectories"):
        stats.route_agreement(table, other.slice(1).replace_schema_metadata(table.schema.metadata))
    with pytest.raises(SchemaError, match="'nope'"):
        stats.route_agreement(table, "nope")


# ------------------------------------------------------ multi-step directory
@pytest.fixture(scope="module")
def step_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[pa.Table]]:
    rng = np.random.default_rng(7)
    root = tmp_path_factory.mktemp("steps")
    tables = []
    for step in (0, 1, 3, 10):
        shapes = [(int(rng.integers(1, 30)), int(rng.integers(1, 200)), 0) for _ in range(5)]
        shapes = [(p, r, p + r - int(rng.integers(1, 3))) for p, r, _ in shapes]
        t = make_table(rng, SPEC, shapes, tag=f"s{step}", trainer_flip=0.1 * (step + 1) / 11)
        write_rollouts(t.slice(0, 2), root, step=step)
        write_rollouts(t.slice(2), root, step=step)  # two parts per step
        tables.append(t)
    return root, tables


def test_directory_equals_concatenated_table(step_dir: tuple[Path, list[pa.Table]]) -> None:
    root, tables = step_dir
    whole = read_rollouts(root)
    for tokens in typing.get_args(stats.TokenSubset):
        on_disk = stats.expert_load(root, tokens=tokens)
        assert on_disk.equals(stats.expert_load(whole, tokens=tokens))
        concat = pa.concat_tables([t for t in tables])
        assert on_disk.equals(stats.expert_load(concat, tokens=tokens))
    by_step = stats.expert_load(root, by_step=True)
    assert by_step.columns == ["step", "layer", "expert", "tokens"]
    assert by_step["step"].unique().sort().to_list() == [0, 1, 3, 10]
    assert by_step.equals(stats.expert_load(whole, by_step=True))
    for step, t in zip((0, 1, 3, 10), tables, strict=True):
        assert by_step.filter(pl.col("step") == step).drop("step").equals(stats.expert_load(t))
    sub = stats.expert_load(root, steps=[1, 10])
    assert sub.equals(stats.expert_load(pa.concat_tables([tables[1], tables[3]])))
    with pytest.raises(SchemaError, match=r"steps \[2\]"):
        stats.expert_load(root, steps=[2])


def test_directory_agreement_and_drift(step_dir: tuple[Path, list[pa.Table]]) -> None:
    root, tables = step_dir
    per = stats.route_agreement_by_step(root, "trainer_routes", tokens="loss")
    assert list(per) == [0, 1, 3, 10]
    for (step, r), t in zip(per.items(), tables, strict=True):
        assert r == stats.route_agreement(t, "trainer_routes", tokens="loss"), step
    total = stats.route_agreement(root, "trainer_routes", tokens="loss")
    assert total == sum(list(per.values())[1:], per[0])
    frame = stats.agreement_over_steps(per)
    assert frame.columns == ["step", "layer", "tokens", "identical", "overlap", "differing"]
    assert frame.height == 4 * len(SPEC.router_layers)
    by_step = stats.expert_load(root, by_step=True)
    drift = stats.drift_over_steps(by_step)
    assert drift.select("step", "prev_step").unique(maintain_order=True).rows() == [
        (1, 0),
        (3, 1),
        (10, 3),
    ]
    for prev, cur in pairwise((0, 1, 3, 10)):
        pair = stats.load_drift(
            by_step.filter(pl.col("step") == prev).drop("step"),
            by_step.filter(pl.col("step") == cur).drop("step"),
        )
        got = drift.filter(pl.col("step") == cur).drop("step", "prev_step")
        assert got.equals(pair)


def test_directory_memory_is_one_step_at_a_time(tmp_path: Path) -> None:
    """Stats over 8 steps keep Arrow's peak allocation near two steps' routes, not all of them.

    Each step here is one small row group, so a piece is a step: the statistic holds the
    piece it counts and the one read ahead (plus a restore copy); see
    ``test_stats_stream.py`` for a step larger than the budget.
    """
    spec = RouteSpec(num_layers=16, topk=8, num_experts=64)
    rng = np.random.default_rng(3)
    steps = 8
    for step in range(steps):
        t = make_table(rng, spec, [(100, 3900, 3999)] * 4, tag=f"m{step}")  # ~2 MB of routes
        write_rollouts(t, tmp_path, step=step)
    step_bytes = 4 * 3999 * spec.row_nbytes
    script = textwrap.dedent(
        f"""
        import json, pyarrow as pa
        from r3arrow import stats
        load = stats.expert_load({str(tmp_path)!r}, tokens="loss")
        peak = pa.default_memory_pool().max_memory()
        print(json.dumps({{"peak": peak, "sum": int(load["tokens"].sum())}}))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["sum"] > 0
    assert got["peak"] < 4 * step_bytes, (got, step_bytes)  # two pieces read ahead, ~3.5x
    assert got["peak"] < steps * step_bytes / 2


# ------------------------------------------------------------------ interop
def _leaf(routes: Any) -> Any:
    """The id leaf array of a ``large_list<fixed_size_list<fixed_size_list>>`` routes array."""
    return routes.values.values.values


def test_polars_is_zero_copy(rng: np.random.Generator) -> None:
    table = make_table(rng, SPEC, [(3, 5, 7), (2, 2, 4)])
    df = stats.to_polars(table)
    assert df.schema["routes"] == pl.List(pl.Array(pl.UInt8, (5, 3)))
    leaf = _leaf(table.column("routes").chunk(0))
    back = df["routes"].to_arrow()
    back = back.chunk(0) if isinstance(back, pa.ChunkedArray) else back
    assert _leaf(back).buffers()[1].address == leaf.buffers()[1].address
    assert df["routes"].to_list() == table.column("routes").to_pylist()


def test_torch_is_zero_copy(rng: np.random.Generator) -> None:
    spec = RouteSpec(num_layers=2, topk=2, num_experts=1000)  # uint16 storage
    table = make_table(rng, spec, [(3, 5, 7), (2, 2, 4), (1, 1, 0)])
    rows, offsets = stats.routes_torch(table)
    ref_rows, ref_offsets = flat_routes(table)
    assert rows.shape == (11, 2, 2)
    assert rows.data_ptr() == ref_rows.ctypes.data
    np.testing.assert_array_equal(rows.numpy(), ref_rows)
    assert offsets.tolist() == ref_offsets.tolist()


def test_hugging_face_datasets_recipe(rng: np.random.Generator) -> None:
    datasets = pytest.importorskip(
        "datasets", reason="Hugging Face datasets is not installed (optional)"
    )
    table = make_table(rng, SPEC, [(3, 5, 7), (2, 2, 4)])
    hf = datasets.Dataset(table)
    leaf = _leaf(table.column("routes").chunk(0))
    assert (
        hf.data.table.column("routes").chunk(0).values.values.values.buffers()[1].address
        == leaf.buffers()[1].address
    )
    arrow = hf.with_format("arrow")[:]
    back = pa.Table.from_arrays(arrow.columns, schema=table.schema)  # datasets drops r3arrow.spec
    assert back.equals(table)
    assert r3arrow.validate_rollouts(back) == SPEC
    assert stats.expert_load(back).equals(stats.expert_load(table))


def test_partials_add_exactly_near_the_int64_limit() -> None:
    """Sums near 2**62 stay exact; one past int64 raises instead of wrapping negative."""
    big = 2**62 - 1  # big + big == 2**63 - 2, the largest even int64
    a = stats.RouteAgreement((1, 2), 2, big, np.array([big, 1]), np.array([big, 3]), big)
    total = a + a
    assert total.tokens == total.all_identical == 2 * big
    assert total.identical.tolist() == [2 * big, 2] and total.overlap.tolist() == [2 * big, 6]
    with pytest.raises(SchemaError, match="int64"):
        total + a
    c = stats.ExpertCounts((1,), np.array([[big, 0]]), big)
    assert (c + c).counts.tolist() == [[2 * big, 0]]
    with pytest.raises(SchemaError, match="int64"):
        c + c + c
