"""r3arrow.ray on a local Ray cluster (2 CPUs): results equal the single-process path exactly."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from test_stats import SPEC, make_table

from r3arrow import stats
from r3arrow.errors import SchemaError
from r3arrow.io import read_rollouts, write_rollouts

ray = pytest.importorskip("ray", reason="ray is not installed (the ray extra)")
r3ray = pytest.importorskip("r3arrow.ray")
ON_RAY = r3ray.RayExecutor()

pytestmark = [
    pytest.mark.ray,
    # Ray's own deprecation noise (raised inside ray.*), not r3arrow's.
    pytest.mark.filterwarnings("ignore::DeprecationWarning:ray"),
]
STEPS = (0, 2, 5)


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def step_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = np.random.default_rng(11)
    root = tmp_path_factory.mktemp("ray_steps")
    for step in STEPS:
        shapes = [(int(rng.integers(1, 20)), int(rng.integers(2, 80)), 0) for _ in range(6)]
        shapes = [(p, r, p + r - 1) for p, r, _ in shapes]
        t = make_table(rng, SPEC, shapes, tag=f"s{step}", trainer_flip=0.05 * (step + 1))
        write_rollouts(t.slice(0, 3), root, step=step)
        write_rollouts(t.slice(3), root, step=step)
    return root


def _sorted(table: pa.Table) -> pa.Table:
    return table.sort_by([("step", "ascending"), ("trajectory_id", "ascending")])


def test_read_restores_routes(cluster: None, step_dir: Path) -> None:
    ds = r3ray.rollout_dataset(step_dir, steps=[2, 5])
    got = _sorted(pa.concat_tables(ds.iter_batches(batch_format="pyarrow", batch_size=None)))
    want = _sorted(read_rollouts(step_dir, steps=[2, 5]))
    assert got.schema.field("routes").type == SPEC.routes_type
    assert got.schema.field("step").type == pa.int64()
    assert got.select(want.column_names).to_pylist() == want.to_pylist()
    assert r3ray.rollout_spec(step_dir) == SPEC
    one_file = sorted((step_dir / "step=5").glob("*.parquet"))[0]  # no step column
    assert stats.expert_load(one_file, tokens="response", executor=ON_RAY).equals(
        stats.expert_load(one_file, tokens="response")
    )
    with pytest.raises(SchemaError, match="step"):
        stats.expert_load(one_file, by_step=True, executor=ON_RAY)


def test_stats_equal_local_path(cluster: None, step_dir: Path) -> None:
    assert stats.expert_load(step_dir, tokens="loss", by_step=True, executor=ON_RAY).equals(
        stats.expert_load(step_dir, tokens="loss", by_step=True)
    )
    # A Dataset source (needs the spec), with and without a step filter.
    ds = r3ray.rollout_dataset(step_dir).materialize()
    agreement = stats.route_agreement(ds, "trainer_routes", SPEC, executor=ON_RAY)
    assert agreement == stats.route_agreement(step_dir, "trainer_routes")
    assert agreement.differing_fraction > 0
    got = stats.expert_counts(ds, spec=SPEC, steps=[0, 5], tokens="prompt", executor=ON_RAY)
    assert got == stats.expert_counts(step_dir, steps=[0, 5], tokens="prompt")
    with pytest.raises(TypeError, match="spec="):  # argument misuse: a builtin
        stats.expert_counts(ds, executor=ON_RAY)
    with pytest.raises(TypeError, match="in-memory Table"):  # a table streams locally
        stats.expert_counts(read_rollouts(step_dir), executor=ON_RAY)
    with pytest.raises(TypeError, match="name a routes column"):
        stats.route_agreement(ds, ds, SPEC, executor=ON_RAY)


def test_ray_hash_aggregate_equals_local_path(cluster: None, step_dir: Path) -> None:
    """reduce="ray": Ray's AggregateFnV2 + groupby("step") over the partials."""
    hashed = r3ray.RayExecutor(reduce="ray")
    got = stats.route_agreement_by_step(step_dir, "trainer_routes", tokens="loss", executor=hashed)
    assert got == stats.route_agreement_by_step(step_dir, "trainer_routes", tokens="loss")
    assert {s: a.differing_fraction > 0 for s, a in got.items()} == dict.fromkeys(STEPS, True)
    total = stats.expert_counts(step_dir, tokens="response", executor=hashed)
    assert total == stats.expert_counts(step_dir, tokens="response")
