"""Benchmark: one (DP rank, PP stage)'s share of a rollout directory, local and on Ray (issue 14).

Generates a step root (``--steps`` × ``--batch`` trajectories of about ``--mean`` tokens,
48 layers × top-8 of 128 experts, uint8; two files per step) in a temporary directory and
removes it afterwards (also on an error). Page cache warm. Each case runs in a fresh
process (its own peak RSS: VmHWM, reset after the warm-up) and measures, in that process,
alternating ``--repeat`` times (best of each reported):

* ``read``: the stage's projected read of every step, ``r3arrow.iter_rollouts(root,
  layers=12..23)`` — the read rate of a stage's share, the baseline of every ratio;
* ``collate``: ``r3arrow.collate.collate_directory`` of DP rank 0 for that stage (plan +
  read + collate to int32, packed, align 8), with the case's DP size, plan and budget.

``ratio`` = collate rate / read rate, rates being route bytes (the rank's tokens × 12
layers × 8) per second. The first collator call of the process (``first_call_s``: numba's
cached machine code loaded, or compiled when the cache is cold) is timed apart. The
``ray`` cases start a local cluster (2 CPUs, 256 MB object store), deliver every shard
of DP × PP with `r3arrow.ray.shard_microbatches` to one actor per rank and report each
rank's peak RSS and its growth while consuming, the driver's peak and the delivery time
(cold: workers importing; warm: a second pass). The machine's memcpy speed is measured in
the same run. Run from the repository root (``--quick`` in CI: a 23 MB directory)::

    .venv/bin/python benchmarks/bench_shards.py [--quick] [--no-ray] [--ray-only] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from _common import (
    machine_line,
    markdown_table,
    memcpy_gbps,
    parser,
    peak_rss_mb,
    reset_peak_rss,
    run_isolated,
)

import r3arrow
from r3arrow.io import iter_rollouts, write_rollouts
from r3arrow.spec import RouteSpec
from r3arrow.testing import random_rollouts

SPEC = RouteSpec(num_layers=48, topk=8, num_experts=128, moe_layers=None)
STAGE = tuple(range(12, 24))  # PP stage 2 of 4
MB = 1 << 20
#: Collation cases: name -> collate_directory arguments (``max_memory`` "step" = 1.5x the
#: estimated stage share of one step: the step fits the budget, not twice).
CASES: dict[str, dict[str, Any]] = {
    "dp1": {"dp_size": 1, "max_tokens": 64 * 1024, "max_memory": 128 * MB},
    "dp1-nmb4-tight": {"dp_size": 1, "num_microbatches": 4, "max_memory": "step"},
    "dp2-balanced": {
        "dp_size": 2,
        "max_tokens": 64 * 1024,
        "max_memory": 128 * MB,
        "dp_assign": "balanced",
    },
    "dp2-contiguous": {
        "dp_size": 2,
        "max_tokens": 64 * 1024,
        "max_memory": 128 * MB,
        "dp_assign": "contiguous",
    },
}


def make_root(root: Path, steps: int, batch: int, mean: int, seed: int = 0) -> int:
    """Write ``steps`` steps of ``batch`` random trajectories (two files each); return tokens."""
    rng = np.random.default_rng(seed)
    tokens = 0
    for s in range(steps):
        prompts = rng.integers(mean // 8, mean // 4, size=batch)
        responses = rng.integers(mean // 2, mean, size=batch)
        shapes = [(int(p), int(r), int(p + r - 1)) for p, r in zip(prompts, responses, strict=True)]
        tokens += sum(c for _, _, c in shapes)
        table = random_rollouts(rng, SPEC, shapes, tag=f"s{s}")
        write_rollouts(table.slice(0, batch // 2), root, step=s)
        write_rollouts(table.slice(batch // 2), root, step=s)
    return tokens


def _stage_bytes(tokens: int) -> int:
    return tokens * len(STAGE) * SPEC.topk * np.dtype(SPEC.dtype).itemsize


def _read(root: Path) -> int:
    """The stage's projected read of every step; returns the route tokens read."""
    tokens = 0
    for table in iter_rollouts(root, layers=list(STAGE), max_memory=256 * MB):
        tokens += int(r3arrow.table.captured_lengths(table).sum())
    return tokens


def case_collate(root: Path, name: str, step_tokens: int, repeat: int) -> dict[str, Any]:
    """Read and collate alternately in this process; best of each, the first call apart."""
    from r3arrow.collate import MegatronCollator, collate_directory

    kwargs = dict(CASES[name])
    if kwargs["max_memory"] == "step":
        kwargs["max_memory"] = int(1.5 * step_tokens * (len(STAGE) * SPEC.topk + 16))
    collator = MegatronCollator(SPEC, layers=STAGE, packed=True, align=8)
    first = sorted(root.rglob("*.parquet"))[0]
    sample = r3arrow.io.read_rollouts(first, row_groups=[0]).slice(0, 2)
    t0 = time.perf_counter()
    collator(sample)  # numba: cached machine code loaded (or compiled) outside the timing
    first_call = time.perf_counter() - t0

    def collate() -> tuple[int, int]:
        tokens, count = 0, 0
        for _, mb in collate_directory(root, collator, dp_rank=0, **kwargs):
            tokens += int(mb.captured.sum())
            count += 1
            del mb
        return tokens, count

    read_tokens = _read(root)  # warm the page cache and the imports
    reset_peak_rss()
    best_read, best_collate = float("inf"), float("inf")
    share, count = 0, 0
    for _ in range(repeat):
        t0 = time.perf_counter()
        _read(root)
        best_read = min(best_read, time.perf_counter() - t0)
        t0 = time.perf_counter()
        share, count = collate()
        best_collate = min(best_collate, time.perf_counter() - t0)
    read_gbps = _stage_bytes(read_tokens) / best_read / 1e9
    collate_gbps = _stage_bytes(share) / best_collate / 1e9
    return {
        "first_call_s": first_call,
        "read_s": best_read,
        "collate_s": best_collate,
        "read_gbps": read_gbps,
        "collate_gbps": collate_gbps,
        "ratio": collate_gbps / read_gbps,
        "share": share / read_tokens,
        "microbatches": count,
        "max_memory_mb": kwargs["max_memory"] / MB,
        "peak_rss_mb": peak_rss_mb(),
    }


def case_ray(root: Path, dp: int, pp: int) -> dict[str, Any]:
    """Every shard of ``dp`` × ``pp`` delivered to one actor per rank; per-rank memory."""
    import ray

    import r3arrow.ray as r3ray

    ray.init(
        num_cpus=2,
        include_dashboard=False,
        log_to_driver=False,
        logging_level=logging.ERROR,
        object_store_memory=256 * MB,
    )
    ray.data.DataContext.get_current().enable_progress_bars = False

    @ray.remote(num_cpus=0)
    class Rank:
        def consume(self, shard: Any) -> dict[str, float]:
            reset_peak_rss()
            start = peak_rss_mb()
            t0 = time.perf_counter()
            tokens, count = 0, 0
            for _, _, table in shard.iter_tables():
                tokens += int(r3arrow.table.captured_lengths(table).sum())
                count += 1
            return {
                "s": time.perf_counter() - t0,
                "microbatches": count,
                "tokens": tokens,
                "rss_start_mb": start,
                "peak_rss_mb": peak_rss_mb(),
            }

    stages = [tuple(range(i * 48 // pp, (i + 1) * 48 // pp)) for i in range(pp)]
    reset_peak_rss()
    t0 = time.perf_counter()
    shards = r3ray.shard_microbatches(
        root,
        dp_size=dp,
        pp_layers=stages,
        max_tokens=64 * 1024,
        multiple=8,
        max_memory=64 * MB,
        object_store_memory=64 * MB,
    )
    plan_s = time.perf_counter() - t0
    actors = {k: Rank.remote() for k in shards}  # type: ignore[attr-defined]
    ray.get([a.__ray_ready__.remote() for a in actors.values()])
    t0 = time.perf_counter()
    cold = ray.get([actors[k].consume.remote(shards[k]) for k in shards])
    cold_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    warm = ray.get([actors[k].consume.remote(shards[k]) for k in shards])
    warm_s = time.perf_counter() - t0
    ray.shutdown()
    layers = 48 // pp
    delivered = sum(v["tokens"] for v in warm) * layers * SPEC.topk
    return {
        "plan_s": plan_s,
        "cold_s": cold_s,
        "warm_s": warm_s,
        "warm_gbps": delivered / warm_s / 1e9,
        "rank_peak_rss_mb": max(v["peak_rss_mb"] for v in cold + warm),
        "rank_growth_mb": max(v["peak_rss_mb"] - v["rss_start_mb"] for v in warm),
        "driver_peak_rss_mb": peak_rss_mb(),
        "ranks": {f"dp{k[0]}_pp{k[1]}": v for k, v in zip(shards, warm, strict=True)},
    }


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--no-ray", action="store_true", help="skip the Ray cases")
    p.add_argument("--ray-only", action="store_true", help="only the Ray cases")
    p.add_argument("--repeat", type=int, default=3, help="alternating repeats per case")
    p.add_argument("--case", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.case:  # a child: --case ROOT NAME STEP_TOKENS | --case ROOT ray DP PP
        root, name, *rest = args.case
        if name == "ray":
            out = case_ray(Path(root), int(rest[0]), int(rest[1]))
        else:
            out = case_collate(Path(root), name, int(rest[0]), args.repeat)
        print(json.dumps(out))
        return
    steps, batch, mean = (2, 16, 2048) if args.quick else (6, 24, 4096)
    tmp = Path(tempfile.mkdtemp(prefix="r3bench_shards_"))
    try:
        tokens = make_root(tmp, steps, batch, mean)
        size = sum(f.stat().st_size for f in tmp.rglob("*.parquet"))
        print(f"# {machine_line()}; memcpy {memcpy_gbps(256 * MB):.1f} GB/s")
        print(
            f"# {steps} steps x {batch} trajectories, {tokens} tokens, 48 layers x top-8 uint8, "
            f"{size / 1e6:.0f} MB on disk; stage = layers 12-23; best of {args.repeat}"
        )
        me = str(Path(__file__).resolve())
        repeat = ["--repeat", str(args.repeat)]
        if not args.ray_only:
            rows = []
            for name in CASES:
                res = run_isolated(me, ["--case", str(tmp), name, str(tokens // steps), *repeat])
                rows.append(
                    [
                        name,
                        res["microbatches"],
                        f"{res['share']:.2f}",
                        res["read_s"],
                        res["collate_s"],
                        res["read_gbps"],
                        res["collate_gbps"],
                        res["ratio"],
                        res["first_call_s"],
                        res["peak_rss_mb"],
                    ]
                )
            headers = [
                "case",
                "mbs",
                "share",
                "read s",
                "collate s",
                "read GB/s",
                "collate GB/s",
                "ratio",
                "first call s",
                "peak RSS MB",
            ]
            print(markdown_table(rows, headers))
        if not args.no_ray:
            for dp, pp in [(2, 2), (1, 4)]:
                res = run_isolated(me, ["--case", str(tmp), "ray", str(dp), str(pp)])
                ranks = res.pop("ranks")
                for key in ("rusage_maxrss_mb", "peak_rss_mb"):  # the driver's is reported
                    res.pop(key, None)
                print(f"ray dp{dp} x pp{pp}", json.dumps(res))
                print("  ranks", json.dumps(ranks))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
