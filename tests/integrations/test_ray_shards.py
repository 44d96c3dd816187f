"""shard_microbatches on a local Ray cluster: actors standing for (DP rank, PP stage) ranks.

Each actor iterates its Shard; the union over ranks must be every trajectory x every
layer exactly once, each DP rank must get the same microbatch count per step, and
every shard must equal the in-memory split_microbatches plan at its layers.
"""

from __future__ import annotations

import logging
import resource
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from r3arrow.errors import SchemaError
from r3arrow.io import read_rollouts, write_rollouts
from r3arrow.microbatch import PADDING_TRAJECTORY_ID, is_padding_table, split_microbatches
from r3arrow.spec import RouteSpec
from r3arrow.table import flat_routes, route_layers
from r3arrow.testing import random_rollouts

ray = pytest.importorskip("ray", reason="ray is not installed (the ray extra)")
r3collate = pytest.importorskip("r3arrow.collate", reason="torch is not installed")
r3ray = pytest.importorskip("r3arrow.ray")

pytestmark = [
    pytest.mark.ray,
    pytest.mark.filterwarnings("ignore::DeprecationWarning:ray"),  # Ray's own noise
]
SPEC = RouteSpec(num_layers=6, topk=2, num_experts=16, moe_layers=None)
STAGES = ((0, 1), (2, 3, 4, 5))
STEPS = (1, 4)


@pytest.fixture(scope="module")
def cluster() -> Iterator[None]:
    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        logging_level=logging.ERROR,
        object_store_memory=80 << 20,
    )
    ray.data.DataContext.get_current().enable_progress_bars = False
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    rng = np.random.default_rng(5)
    path = tmp_path_factory.mktemp("ray_shards")
    for step in STEPS:
        shapes = []
        for _ in range(9):
            p, r = int(rng.integers(1, 10)), int(rng.integers(1, 25))
            shapes.append((p, r, int(rng.integers(0, p + r + 1))))
        t = random_rollouts(rng, SPEC, shapes, tag=f"s{step}")
        write_rollouts(t.slice(0, 4), path, step=step, row_group_rows=2)
        chunked = pa.concat_tables([t.slice(4, 3), t.slice(7)])  # multi-chunk routes column
        write_rollouts(chunked, path, step=step, row_group_rows=3)
    return path


@ray.remote(num_cpus=0)
class Rank:
    """A worker standing for one (DP rank, PP stage): consumes its shard, reports it."""

    def consume(self, shard: Any) -> tuple[list[dict[str, Any]], int]:
        out = []
        for step, j, table in shard.iter_tables():
            routes, offsets = flat_routes(table)
            out.append(
                {
                    "step": step,
                    "j": j,
                    "ids": table.column("trajectory_id").to_pylist(),
                    "padding": is_padding_table(table),
                    "layers": route_layers(table),
                    "routes": np.asarray(routes),
                    "offsets": np.asarray(offsets),
                }
            )
        peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return out, int(peak_kb)


def test_every_rank_gets_exactly_its_share(cluster: None, root: Path) -> None:
    dp = 2
    shards = r3ray.shard_microbatches(
        root,
        dp_size=dp,
        pp_layers=STAGES,
        max_tokens=64,
        multiple=4,
        max_memory=2000,
        dp_assign="balanced",
    )
    assert sorted(shards) == [(d, p) for d in range(dp) for p in range(len(STAGES))]
    actors = {key: Rank.remote() for key in shards}  # type: ignore[attr-defined]
    results = ray.get([actors[k].consume.remote(shards[k]) for k in shards])
    got = dict(zip(shards, results, strict=True))
    whole = read_rollouts(root)
    delivered: dict[tuple[int, str, int], np.ndarray] = {}  # (step, trajectory, layer)
    for step in STEPS:
        table = read_rollouts(root, steps=[step])
        full_routes, full_offsets = flat_routes(table)
        index = {t: i for i, t in enumerate(table.column("trajectory_id").to_pylist())}
        counts = set()
        for (d, p), (mbs, peak_kb) in got.items():
            assert peak_kb > 0
            mine = [m for m in mbs if m["step"] == step]
            counts.add(len(mine))
            plan = split_microbatches(table, max_tokens=64, multiple=4, dp_size=dp, dp_rank=d)
            assert [m["j"] for m in mine] == list(range(len(plan)))
            for m, part in zip(mine, plan, strict=True):
                assert m["ids"] == part.column("trajectory_id").to_pylist()
                assert m["padding"] == is_padding_table(part)
                if m["padding"]:
                    assert m["ids"] == [PADDING_TRAJECTORY_ID]
                    continue
                assert m["layers"] == STAGES[p]  # only this stage's layers travelled
                for k, tid in enumerate(m["ids"]):
                    rows = m["routes"][m["offsets"][k] : m["offsets"][k + 1]]
                    i = index[tid]
                    want = full_routes[full_offsets[i] : full_offsets[i + 1]]
                    for n, layer in enumerate(STAGES[p]):
                        key = (step, tid, layer)
                        assert key not in delivered  # no duplicates
                        delivered[key] = rows[:, n]
                        np.testing.assert_array_equal(rows[:, n], want[:, layer])
        assert len(counts) == 1  # the same microbatch count on every rank
    everything = {
        (s, t, layer)
        for s, t in zip(
            whole.column("step").to_pylist(), whole.column("trajectory_id").to_pylist(), strict=True
        )
        for layer in range(SPEC.num_layers)
    }
    assert set(delivered) == everything


def test_bounded_store_and_single_stage(cluster: None, root: Path) -> None:
    """One stage of every layer, the object store capped, two read tasks in flight."""
    shards = r3ray.shard_microbatches(
        root,
        dp_size=1,
        pp_layers=[range(SPEC.num_layers)],
        num_microbatches=3,
        read_tasks=2,
        object_store_memory=8 << 20,
    )
    shard = shards[0, 0]
    assert shard.steps == STEPS and shard.num_microbatches == (3, 3)
    limits = shard.dataset.context.execution_options.resource_limits
    assert limits.object_store_memory == 8 << 20
    tables = [t for _, _, t in shard.iter_tables()]
    want = [
        part
        for step in STEPS
        for part in split_microbatches(read_rollouts(root, steps=[step]), num_microbatches=3)
    ]
    assert [t.column("trajectory_id").to_pylist() for t in tables] == [
        w.column("trajectory_id").to_pylist() for w in want
    ]
    for t, w in zip(tables, want, strict=True):
        np.testing.assert_array_equal(flat_routes(t)[0], flat_routes(w)[0])
    # What a rank's collator makes of a delivered microbatch equals the local collation.
    collator = r3collate.MegatronCollator(SPEC, packed=True, align=4)
    for t, w in zip(tables, want, strict=True):
        got, local = collator(t), collator(w)
        for name in ("input_ids", "position_ids", "loss_mask", "padding_mask", "layer_major"):
            np.testing.assert_array_equal(
                getattr(got, name).numpy(), getattr(local, name).numpy(), err_msg=name
            )
        np.testing.assert_array_equal(got.cu_seqlens.numpy(), local.cu_seqlens.numpy())
        np.testing.assert_array_equal(got.seq_lens, local.seq_lens)


def test_contiguous_assignment(cluster: None, root: Path) -> None:
    """dp_assign="contiguous": each DP rank a row range; together every trajectory once."""
    shards = r3ray.shard_microbatches(
        root, dp_size=2, pp_layers=[(1, 2)], num_microbatches=2, dp_assign="contiguous"
    )
    seen: dict[int, list[Any]] = {}
    counts = set()
    for d in range(2):
        mbs = list(shards[d, 0].iter_tables())
        counts.add(len(mbs))
        for step, _, table in mbs:
            assert route_layers(table) == (1, 2)
            if not is_padding_table(table):
                seen.setdefault(step, []).extend(table.column("trajectory_id").to_pylist())
    assert len(counts) == 1
    for step in STEPS:
        ids: list[Any] = read_rollouts(root, steps=[step]).column("trajectory_id").to_pylist()
        assert sorted(seen[step]) == sorted(ids)


def test_argument_misuse(root: Path) -> None:
    with pytest.raises(ValueError, match="pp_layers"):
        r3ray.shard_microbatches(root, dp_size=1, pp_layers=[], num_microbatches=1)
    with pytest.raises(ValueError, match="one stage only"):
        r3ray.shard_microbatches(root, dp_size=1, pp_layers=[(0, 1), (1,)], num_microbatches=1)
    with pytest.raises(ValueError, match=r"layers in 0\.\.5"):
        r3ray.shard_microbatches(root, dp_size=1, pp_layers=[(0, 6)], num_microbatches=1)
    with pytest.raises(ValueError, match="dp_size"):
        r3ray.shard_microbatches(root, dp_size=0, pp_layers=[(0,)], num_microbatches=1)
    with pytest.raises(ValueError, match="neither"):
        r3ray.shard_microbatches(root, dp_size=1, pp_layers=[(0,)])
    with pytest.raises(FileNotFoundError):
        r3ray.shard_microbatches(root / "nope", dp_size=1, pp_layers=[(0,)], num_microbatches=1)


def test_stream_cut_short_is_detected(cluster: None, root: Path) -> None:
    shards = r3ray.shard_microbatches(
        root, dp_size=1, pp_layers=[(0,)], steps=[4], num_microbatches=2
    )
    shard = shards[0, 0]
    assert shard.steps == (4,)
    assert [(s, j) for s, j, _ in shard.iter_tables()] == [(4, 0), (4, 1)]
    short = r3ray.Shard(
        dp_rank=0,
        pp_stage=0,
        layers=(0,),
        steps=(*shard.steps, 9),
        num_microbatches=(*shard.num_microbatches, 1),
        dataset=shard.dataset,
    )
    with pytest.raises(SchemaError, match="stream ended"):
        list(short.iter_tables())
