"""r3arrow.stats over streamed paths: exact counts whatever the pieces, both kernels, bounded RAM.

Streamed statistics (a file or root read piece by piece under ``max_memory``, the next piece
read while the current one is counted) must give the integers of the in-memory statistics on
the whole table, for every row-group size, budget, token subset and kernel backend (numba or
numpy, `r3arrow.testing.use_backend`), also for multi-chunk tables (chunked routes), and must
hold about the budget, not a step.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import textwrap
import typing
from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any, cast

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from r3arrow import stats
from r3arrow.errors import DuplicateExpertError, ExpertRangeError, SchemaError
from r3arrow.io import read_rollouts, rollout_files, write_rollouts
from r3arrow.ray import RayExecutor  # an executor object: constructing one needs no ray
from r3arrow.spec import RouteSpec, numpy_to_routes
from r3arrow.stats import _sources as stats_sources
from r3arrow.table import rollout_table
from r3arrow.testing import random_rollouts, random_routes, use_backend
from r3arrow.testing.strategies import rollout_tables, shapes, specs

SPEC = RouteSpec(num_layers=4, topk=2, num_experts=12, moe_layers=(0, 2, 3))
HAS_NUMBA = importlib.util.find_spec("numba") is not None
BACKENDS = ["numba", "numpy"] if HAS_NUMBA else ["numpy"]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run the test with the numba kernels and with the numpy ones (`use_backend`)."""
    with use_backend(request.param):
        yield str(request.param)


def _trainer_table(rng: np.random.Generator, spec: RouteSpec, n: int, tag: str) -> pa.Table:
    """``n`` trajectories (5 prompt, 30 response, 33 rows) with a ``trainer_routes`` column:
    the routes with about 30% of the rows redrawn."""
    routes = [random_routes(rng, 33, spec) for _ in range(n)]
    trainer = []
    for r in routes:
        t = r.copy()
        flip = np.asarray(rng.random(t.shape[0]) < 0.3)
        t[flip] = random_routes(rng, int(np.count_nonzero(flip)), spec)
        trainer.append(t)
    offsets = np.arange(n + 1, dtype=np.int64) * 33
    column = pa.LargeListArray.from_arrays(
        pa.array(offsets, type=pa.int64()), numpy_to_routes(np.concatenate(trainer), spec)
    )
    return rollout_table(
        trajectory_id=[f"{tag}-{i}" for i in range(n)],
        group_id=[f"g{i // 2}" for i in range(n)],
        prompt_ids=[list(range(5))] * n,
        response_ids=[list(range(30))] * n,
        loss_mask=[[1] * 29 + [0]] * n,
        reward=rng.random(n),
        routes=routes,
        spec=spec,
        trainer_routes=column,
    )


def _write_steps(
    root: Path, tables: list[pa.Table], row_group_rows: int | None, parts: int = 2
) -> None:
    for step, t in enumerate(tables):
        cut = t.num_rows // parts
        pieces = [t.slice(0, cut), t.slice(cut)] if parts == 2 else [t]
        for piece in pieces:
            write_rollouts(piece, root, step=step, row_group_rows=row_group_rows)


# ----------------------------------------------------------- exact counts
@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(
    spec=specs(max_layers=4, max_topk=3, widths=("uint8", "uint16")),  # dense [L, E] counts
    seed=st.integers(0, 2**32 - 1),
    steps=st.integers(1, 3),
    row_group_rows=st.none() | st.integers(1, 3),
    max_memory=st.none() | st.integers(1, 1 << 16),
    tokens=st.sampled_from(typing.get_args(stats.TokenSubset)),
    data=st.data(),
)
def test_streamed_counts_equal_in_memory_counts(
    tmp_path_factory: pytest.TempPathFactory,
    backend: str,
    spec: RouteSpec,
    seed: int,
    steps: int,
    row_group_rows: int | None,
    max_memory: int | None,
    tokens: str,
    data: st.DataObject,
) -> None:
    """Any row-group size and budget (down to 1 byte: a trajectory per piece): same integers."""
    rng = np.random.default_rng(seed)
    tables = [
        random_rollouts(rng, spec, data.draw(shapes(max_rows=5, max_tokens=12)), tag=f"s{s}")
        for s in range(steps)
    ]
    tables = [t for t in tables if t.num_rows] or [random_rollouts(rng, spec, [(3, 4, 6)])]
    root = tmp_path_factory.mktemp("stream")
    _write_steps(root, tables, row_group_rows)
    whole = read_rollouts(root)
    kw: dict[str, Any] = {"tokens": tokens}
    streamed = stats.expert_counts(root, max_memory=max_memory, **kw)
    assert streamed == stats.expert_counts(whole, **kw)
    assert streamed == stats.expert_counts(pa.concat_tables(tables), **kw)
    by_step = stats.expert_counts_by_step(root, max_memory=max_memory, **kw)
    assert by_step == stats.expert_counts_by_step(whole, **kw)
    checked = stats.expert_counts(root, max_memory=max_memory, validate=True, **kw)
    assert checked == streamed


@pytest.mark.parametrize("row_group_rows", [1, 3, None])
def test_streamed_agreement_and_drift(
    tmp_path: Path, backend: str, row_group_rows: int | None
) -> None:
    rng = np.random.default_rng(5)
    tables = [_trainer_table(rng, SPEC, 5, f"s{s}") for s in range(3)]
    _write_steps(tmp_path, tables, row_group_rows)
    whole = read_rollouts(tmp_path)
    for tokens in typing.get_args(stats.TokenSubset):
        subset = cast(stats.TokenSubset, tokens)
        got = stats.route_agreement(tmp_path, "trainer_routes", tokens=subset, max_memory=1)
        assert got == stats.route_agreement(whole, "trainer_routes", tokens=subset)
    per = stats.route_agreement_by_step(tmp_path, "trainer_routes", max_memory=4096)
    assert per == stats.route_agreement_by_step(whole, "trainer_routes")
    assert 0 < per[0].summary()["identical"] < 1
    load = stats.expert_load(tmp_path, by_step=True, max_memory=4096)
    assert load.equals(stats.expert_load(whole, by_step=True))
    assert stats.drift_over_steps(load).equals(
        stats.drift_over_steps(stats.expert_load(whole, by_step=True))
    )


def test_backends_give_the_same_integers() -> None:
    """numba and numpy kernels: every id width, dense layers, a selection, signed storage."""
    if not HAS_NUMBA:
        pytest.skip("numba (extra 'fast') not installed")
    rng = np.random.default_rng(11)
    cases = [
        (RouteSpec(num_layers=5, topk=3, num_experts=40, moe_layers=(1, 4)), None),
        (RouteSpec(num_layers=3, topk=2, num_experts=256), None),
        (RouteSpec(num_layers=2, topk=4, num_experts=300), None),
        (RouteSpec(num_layers=3, topk=2, num_experts=70_000), None),
        (RouteSpec(num_layers=3, topk=2, num_experts=90), np.int8),
        (RouteSpec(num_layers=3, topk=2, num_experts=200), np.int16),
        (RouteSpec(num_layers=3, topk=2, num_experts=90), np.int64),
    ]
    for spec, dtype in cases:
        a = random_routes(rng, 3000, spec)
        b = random_routes(rng, 3000, spec)
        if dtype is not None:
            a, b = a.astype(dtype), b.astype(dtype)
        sel = rng.random(3000) < 0.4
        results = []
        for name in ("numba", "numpy"):
            with use_backend(name):
                results.append(
                    (
                        stats.count_routes(a, spec),
                        stats.count_routes(a, spec, select=sel),
                        stats.compare_routes(a, b, spec),
                        stats.compare_routes(a, b, spec, select=sel),
                    )
                )
        assert results[0] == results[1], (spec, dtype)
        assert results[0][0].tokens == 3000 and results[0][1].tokens == int(sel.sum())


@pytest.mark.parametrize("bad", [-1, 12, 255])
def test_out_of_range_ids_raise_on_both_backends(backend: str, bad: int) -> None:
    spec = RouteSpec(num_layers=3, topk=2, num_experts=12)
    rows = random_routes(np.random.default_rng(0), 500, spec).astype(np.int16)
    rows[321, 2, 1] = bad
    with pytest.raises(ExpertRangeError, match=r"token 321, layer 2") as err:
        stats.count_routes(rows, spec)
    assert (err.value.token, err.value.layer) == (321, 2)
    sel = np.ones(500, dtype=bool)
    sel[321] = False  # an unselected bad row is not counted, hence not checked
    assert stats.count_routes(rows, spec, select=sel).tokens == 499


def test_agreement_duplicates_raise_on_both_backends(backend: str) -> None:
    spec = RouteSpec(num_layers=2, topk=3, num_experts=10)
    rng = np.random.default_rng(2)
    a, b = random_routes(rng, 400, spec), random_routes(rng, 400, spec)
    b[77, 1] = [4, 4, 5]
    with pytest.raises(DuplicateExpertError, match=r"routes b.*token 77, layer 1"):
        stats.compare_routes(a, b, spec)
    b[77, 1] = [4, 3, 5]
    a[90, 0, 0] = 10
    with pytest.raises(ExpertRangeError, match=r"routes a.*token 90, layer 0"):
        stats.compare_routes(a, b, spec)


# ------------------------------------------------------ multi-chunk tables (chunked routes)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(table=rollout_tables(SPEC, max_rows=6, max_tokens=10), cuts=st.lists(st.integers(0, 6)))
def test_multichunk_tables_count_like_one_chunk(table: pa.Table, cuts: list[int]) -> None:
    """A routes column of many chunks (one per trajectory, or anywhere): same counts."""
    n = table.num_rows
    bounds = sorted({0, n, *(min(c, n) for c in cuts)})
    pieces = [table.slice(a, b - a) for a, b in pairwise(bounds)]
    chunked = pa.concat_tables(pieces) if pieces else table
    per_traj = pa.Table.from_batches(
        [b for i in range(n) for b in table.slice(i, 1).to_batches()], schema=table.schema
    )
    for tokens in typing.get_args(stats.TokenSubset):
        want = stats.expert_counts(table.combine_chunks(), tokens=tokens)
        assert stats.expert_counts(chunked, tokens=tokens) == want
        if n:
            assert stats.expert_counts(per_traj, tokens=tokens) == want


def test_multichunk_routes_are_never_combined() -> None:
    """Counting a many-chunk table allocates no copy of the routes (no ``combine_chunks``).

    Arrow allocations during the statistic go to a fresh proxy pool whose peak is measured.
    """
    rng = np.random.default_rng(4)
    parts = [random_rollouts(rng, SPEC, [(40, 900, 939)] * 3, tag=f"c{i}") for i in range(4)]
    table = pa.concat_tables(parts)
    assert table.column("routes").num_chunks == 4
    routes_bytes = table.column("routes").nbytes
    want = sum((stats.expert_counts(p) for p in parts[1:]), stats.expert_counts(parts[0]))
    before = pa.default_memory_pool()
    pool = pa.proxy_memory_pool(before)
    pa.set_memory_pool(pool)
    try:
        assert stats.expert_counts(table) == want
        assert stats.expert_counts(table, tokens="loss").tokens > 0
    finally:
        pa.set_memory_pool(before)
    assert (pool.max_memory() or 0) < routes_bytes // 4, (pool.max_memory(), routes_bytes)


@pytest.mark.parametrize("layout", ["groups", "one group", "portable"])
def test_every_storage_layout_counts_the_same(tmp_path: Path, layout: str) -> None:
    """Layer-group files (a pass per group), one-group and portable files (one pass)."""
    rng = np.random.default_rng(8)
    tables = [random_rollouts(rng, SPEC, [(4, 20, 23)] * 4, tag=f"s{s}") for s in range(2)]
    for step, t in enumerate(tables):
        if layout == "portable":
            write_rollouts(t, tmp_path, step=step, portable=True)
        else:
            group = 1 if layout == "groups" else SPEC.num_layers
            write_rollouts(t, tmp_path, step=step, layer_group=group, row_group_rows=2)
    passes = stats_sources.stored_groups(stats_sources.Files(rollout_files(tmp_path)))
    assert (passes is not None) == (layout == "groups")
    if passes is not None:
        assert passes == [[i] for i in SPEC.router_layers]
    whole = pa.concat_tables(tables)
    subsets: tuple[stats.TokenSubset, ...] = ("all", "loss")
    for subset in subsets:
        by_step = stats.expert_counts_by_step(tmp_path, tokens=subset, max_memory=2048)
        assert by_step == {s: stats.expert_counts(t, tokens=subset) for s, t in enumerate(tables)}
        assert stats.expert_counts(tmp_path, tokens=subset) == stats.expert_counts(
            whole, tokens=subset
        )


def test_a_step_written_while_counting_is_not_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A root a writer appends to: the files are listed once per call, so every layer-group
    pass reads the same files (the hook writes a new step right after the listing)."""
    rng = np.random.default_rng(9)
    tables = [random_rollouts(rng, SPEC, [(4, 20, 23)] * 2, tag=f"s{s}") for s in range(2)]
    for step, t in enumerate(tables):
        write_rollouts(t, tmp_path, step=step, layer_group=1)
    late = random_rollouts(rng, SPEC, [(4, 20, 23)] * 2, tag="late")

    def list_then_write(*args: Any, **kwargs: Any) -> Any:
        files = rollout_files(*args, **kwargs)
        if not (tmp_path / "step=2").exists():
            write_rollouts(late, tmp_path, step=2, layer_group=1)
        return files

    monkeypatch.setattr(stats_sources, "rollout_files", list_then_write)
    assert stats.expert_load(tmp_path).equals(stats.expert_load(pa.concat_tables(tables)))
    assert stats.expert_counts(tmp_path) == stats.expert_counts(pa.concat_tables([*tables, late]))


# ---------------------------------------------------------------- arguments
def test_budget_and_validate_arguments(tmp_path: Path) -> None:
    table = random_rollouts(np.random.default_rng(1), SPEC, [(3, 5, 7)] * 2)
    write_rollouts(table, tmp_path, step=0)
    with pytest.raises(ValueError, match="max_memory"):
        stats.expert_load(tmp_path, max_memory=0)
    with pytest.raises(TypeError, match="max_memory"):
        stats.expert_load(tmp_path, max_memory="1GB")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="executor=None only"):
        stats.expert_load(tmp_path, executor=RayExecutor(), max_memory=1 << 20)
    with pytest.raises(ValueError, match="executor=None only"):
        stats.route_agreement(tmp_path, "routes", executor=RayExecutor(), validate=True)
    with pytest.raises(SchemaError, match=r"steps \[3\]"):
        stats.expert_load(tmp_path, steps=[3], max_memory=1 << 20)
    # A route set agrees with itself, streamed or not.
    same = stats.route_agreement(tmp_path, "routes", max_memory=1)
    assert same.summary()["identical"] == 1.0


# ------------------------------------------------------------ bounded memory
def test_streamed_stats_hold_the_budget_not_a_step(tmp_path: Path) -> None:
    """A 16 MB step, a 4 MB budget: Arrow's peak allocation stays near the budget.

    Each step is one file of 16 row groups of ~1 MB. Reading a whole step (the old path)
    would peak above 16 MB; the streamed statistic holds two pieces of at most a quarter of
    the budget (plus the restore copy), measured in a fresh process (after a warm-up call
    for imports and compilation) by a fresh Arrow pool's peak and tracemalloc's (numpy).
    """
    spec = RouteSpec(num_layers=16, topk=8, num_experts=64)
    rng = np.random.default_rng(3)
    steps, per_step = 2, 16
    for step in range(steps):
        t = random_rollouts(rng, spec, [(100, 7900, 7999)] * per_step, tag=f"m{step}")
        write_rollouts(t, tmp_path, step=step, row_group_rows=1)
    step_bytes = per_step * 7999 * spec.row_nbytes
    budget = 4 << 20
    script = textwrap.dedent(
        f"""
        import json, tracemalloc, pyarrow as pa
        from r3arrow import stats
        stats.expert_load({str(tmp_path)!r}, steps=[0], max_memory=1 << 30)  # imports, JIT
        tracemalloc.start()
        pool = pa.proxy_memory_pool(pa.default_memory_pool())
        pa.set_memory_pool(pool)
        load = stats.expert_load({str(tmp_path)!r}, tokens="loss", max_memory={budget})
        _, py_peak = tracemalloc.get_traced_memory()
        peak = pool.max_memory()
        print(json.dumps({{"peak": peak, "py_peak": py_peak, "sum": int(load["tokens"].sum())}}))
        """
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=120
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["sum"] > 0
    assert step_bytes > 3 * budget
    assert got["peak"] < budget + step_bytes // per_step, (got, budget)
    assert got["py_peak"] < budget, got  # numpy temporaries (counts, selections) stay small
