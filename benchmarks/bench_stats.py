"""Benchmark: expert-load statistics (r3arrow.stats, locally and on Ray) against baselines.

Part 1, in memory (≥ 100M expert ids in the full run): `r3arrow.stats.expert_load`
(one ``np.bincount`` over ``layer * E + id`` codes per cache-sized chunk) vs a
numpy ``np.bincount`` per layer and vs a naive Polars explode + group-by.
Part 2, a multi-step Parquet directory: the single-process streamed path vs
``r3arrow.stats.expert_load(..., executor=r3arrow.ray.RayExecutor())`` on a local 2-CPU
Ray cluster (driver and Ray hash-aggregate reduction).

The in-memory cases share one subprocess and run interleaved round-robin (the
machine is shared: interleaving spreads its noise evenly); each directory case
runs in its own subprocess. Peak memory is the RSS high-water mark of the timed
runs alone (VmHWM reset per run) plus Arrow's pool peak. Results are checked
equal (sha256 of the count matrix) and reported with the memory-copy speed
measured in the same run. Run from the repository root::

    .venv/bin/python benchmarks/bench_stats.py [--quick] [--no-ray]
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
from _common import (  # the script's folder is on sys.path when run as a script
    arrow_peak_mb,
    best_of,
    machine_line,
    markdown_table,
    memcpy_gbps,
    parser,
    proc_status_mb,
    reset_peak_rss,
    run_isolated,
)

LAYERS, TOPK, EXPERTS = 48, 8, 128
STEPS, PARTS = 8, 2


def _sizes(quick: bool) -> tuple[int, int]:
    """(trajectories, tokens per trajectory); full: 64 × 4095 rows × 384 ids = 100.6M ids."""
    return (16, 512) if quick else (64, 4096)


def make_table(trajectories: int, tokens: int, seed: int = 0) -> Any:
    """A valid rollout table: distinct ids per (token, layer), uint8 storage."""
    from r3arrow.spec import RouteSpec
    from r3arrow.table import rollout_table

    spec = RouteSpec(num_layers=LAYERS, topk=TOPK, num_experts=EXPERTS)
    rng = np.random.default_rng(seed)
    prompt = min(96, tokens // 4)
    response = tokens - prompt
    rows = tokens - 1  # the last sampled token has no row
    # Skewed starts (some experts hot) plus K distinct offsets: valid top-k sets.
    weights = rng.dirichlet(np.full(EXPERTS, 0.7), size=LAYERS)
    routes = []
    for _ in range(trajectories):
        u = rng.random((rows, LAYERS, 1))
        starts = (np.cumsum(weights, axis=1)[None, :, :] < u).sum(axis=2, keepdims=True)
        routes.append(((starts + np.arange(TOPK)) % EXPERTS).astype(np.uint8))
    masks = [(rng.random(response) < 0.8).astype(np.uint8) for _ in range(trajectories)]
    for m in masks:
        m[-1] = 0  # the last token's row is missing (terminal gap)
    return rollout_table(
        trajectory_id=[f"t{i}" for i in range(trajectories)],
        group_id=[f"g{i // 8}" for i in range(trajectories)],
        prompt_ids=[np.zeros(prompt, np.int32) for _ in range(trajectories)],
        response_ids=[np.ones(response, np.int32) for _ in range(trajectories)],
        loss_mask=masks,
        reward=rng.random(trajectories),
        routes=routes,
        spec=spec,
    )


def timed(fn: Any, repeat: int, warmup: int) -> tuple[float, float]:
    """(best seconds, peak RSS above the pre-run RSS in MB) of ``fn`` after ``warmup`` untimed runs.

    The peak is this process's VmHWM after resetting it (``clear_refs``), so imports and
    data generation before the timed runs do not count (ru_maxrss cannot be reset and
    even survives exec).
    """
    for _ in range(warmup):
        fn()
    reset_peak_rss()
    before = proc_status_mb("VmRSS")
    seconds = best_of(fn, repeat, warmup=0)
    return seconds, proc_status_mb("VmHWM") - before


def digest(counts: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(counts, dtype=np.int64).tobytes()).hexdigest()[:16]


# ------------------------------------------------------------------ child cases
MEMORY_CASES = ("r3arrow", "r3arrow-loss", "bincount", "polars-naive")


def case_memory(trajectories: int, tokens: int, rounds: int) -> dict[str, Any]:
    """All in-memory cases in one process on one table, interleaved round-robin.

    Interleaving spreads the noise of a shared machine over every case alike;
    each case's peak RSS is measured on its own (VmHWM reset before each run).
    """
    import polars as pl

    from r3arrow import stats
    from r3arrow.table import flat_routes

    table = make_table(trajectories, tokens)
    rows, _ = flat_routes(table)
    df = pl.from_arrow(table.select(["routes"]))
    assert isinstance(df, pl.DataFrame)

    def naive() -> np.ndarray:
        out = (
            df.lazy()
            .select(pl.col("routes").explode())  # a row per token: Array(UInt8, (L, K))
            .select(pl.col("routes").arr.explode())  # a row per (token, layer): Array(UInt8, K)
            .with_columns((pl.int_range(pl.len()) % LAYERS).alias("layer"))
            .explode("routes")  # a row per expert id
            .group_by("layer", "routes")
            .len()
            .collect()
        )
        dense = np.zeros((LAYERS, EXPERTS), np.int64)
        dense[out["layer"].to_numpy(), out["routes"].to_numpy().astype(np.int64)] = out[
            "len"
        ].to_numpy()
        return dense

    fns: dict[str, Any] = {
        "r3arrow": lambda: stats.expert_load(table)["tokens"].to_numpy(),
        "r3arrow-loss": lambda: stats.expert_load(table, tokens="loss")["tokens"].to_numpy(),
        "bincount": lambda: np.stack(
            [np.bincount(rows[:, i, :].ravel(), minlength=EXPERTS) for i in range(LAYERS)]
        ),
        "polars-naive": naive,
    }
    results = {name: fn() for name, fn in fns.items()}  # warm-up (imports, thread pools)
    best = dict.fromkeys(fns, float("inf"))
    extra = dict.fromkeys(fns, 0.0)
    for r in range(rounds):
        for name, fn in fns.items():
            if name == "polars-naive" and r >= 2:
                continue  # slow: two runs are enough
            seconds, peak = timed(fn, 1, warmup=0)
            best[name] = min(best[name], seconds)
            extra[name] = max(extra[name], peak)
    return {
        name: {
            "seconds": best[name],
            "ids": int(rows.size),
            "digest": digest(results[name]),
            "extra_peak_mb": extra[name],
            "arrow_peak_mb": arrow_peak_mb(),
        }
        for name in fns
    }


def case_directory(name: str, root: str) -> dict[str, Any]:
    from r3arrow import stats

    result: dict[str, Any] = {}
    cold = None
    if name == "dir-local":

        def fn() -> None:
            result["c"] = stats.expert_load(root)["tokens"].to_numpy()

        repeat = 3
    else:
        import ray

        from r3arrow.ray import RayExecutor

        t0 = time.perf_counter()
        ray.init(
            num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level=logging.ERROR
        )
        ray.data.DataContext.get_current().enable_progress_bars = False
        init = time.perf_counter() - t0
        executor = RayExecutor(reduce="ray" if name == "dir-ray-hash" else "driver")

        def fn() -> None:
            load = stats.expert_load(root, executor=executor)
            result["c"] = load["tokens"].to_numpy()

        t0 = time.perf_counter()
        fn()
        cold = time.perf_counter() - t0
        result["init"] = init
        repeat = 2
    seconds, extra = timed(fn, repeat, warmup=1 if cold is None else 0)
    out = {
        "seconds": seconds,
        "digest": digest(result["c"]),
        "ids": int(result["c"].sum()),
        "extra_peak_mb": extra,
        "rss_mb": proc_status_mb("VmRSS"),
        "arrow_peak_mb": arrow_peak_mb(),
    }
    if cold is not None:
        out["cold_seconds"] = cold
        out["init_seconds"] = result["init"]
        import ray

        ray.shutdown()
    return out


# ------------------------------------------------------------------ parent
def main() -> None:
    p = parser(__doc__ or "")
    p.add_argument("--no-ray", action="store_true", help="skip the Ray Data cases")
    p.add_argument("--case", help=argparse_hidden())
    p.add_argument("--trajectories", type=int, default=0, help=argparse_hidden())
    p.add_argument("--tokens", type=int, default=0, help=argparse_hidden())
    p.add_argument("--rounds", type=int, default=5, help=argparse_hidden())
    p.add_argument("--root", default="", help=argparse_hidden())
    args = p.parse_args()
    if args.case:
        if args.case.startswith("dir-"):
            print(json.dumps(case_directory(args.case, args.root)))
        else:
            print(json.dumps(case_memory(args.trajectories, args.tokens, args.rounds)))
        return

    trajectories, tokens = _sizes(args.quick)
    me = str(Path(__file__).resolve())
    print(f"# bench_stats ({'quick' if args.quick else 'full'})\n\n{machine_line()}")
    copy = memcpy_gbps(64 << 20 if args.quick else 256 << 20)
    print(f"memcpy: {copy:.1f} GB/s\n")

    # Part 1: in memory.
    cases = list(MEMORY_CASES)
    size = ["--trajectories", str(trajectories), "--tokens", str(tokens)]
    res = run_isolated(me, ["--case", "memory", *size])
    ids = res["r3arrow"]["ids"]
    digests = {res[c]["digest"] for c in ("r3arrow", "bincount", "polars-naive")}
    if len(digests) != 1:
        raise SystemExit(f"results differ: { {c: res[c]['digest'] for c in cases} }")
    naive, binc = res["polars-naive"]["seconds"], res["bincount"]["seconds"]
    fastest_baseline = min(naive, binc)
    labels = {
        "r3arrow": "r3arrow.stats.expert_load (all tokens)",
        "r3arrow-loss": "r3arrow.stats.expert_load (tokens='loss')",
        "bincount": "numpy bincount per layer",
        "polars-naive": "Polars explode + group_by (naive)",
    }
    rows = []
    for c in cases:
        r = res[c]
        s = r["seconds"]
        rows.append(
            [
                labels[c],
                s * 1e3,
                ids / s / 1e6,
                ids / s / 1e9 / copy,
                naive / s,
                fastest_baseline / s,
                r["extra_peak_mb"],
                r["arrow_peak_mb"],
            ]
        )
    print(
        f"## Expert load in memory: {ids / 1e6:.1f}M expert ids "
        f"({LAYERS} layers × top-{TOPK}, {EXPERTS} experts, uint8)\n"
    )
    print(
        markdown_table(
            rows,
            [
                "case",
                "ms",
                "M ids/s",
                "GB/s ÷ memcpy",
                "× naive",
                "× fastest baseline",
                "peak RSS above start MB",
                "Arrow pool peak MB",
            ],
        )
    )
    ratio = fastest_baseline / res["r3arrow"]["seconds"]
    print(
        f"\ntargets{' (set for ≥ 100M ids; this is --quick)' if args.quick else ''}: "
        f"within 2× of the faster baseline → {ratio:.2f}× "
        f"({'met' if ratio >= 0.5 else 'MISSED'}); "
        f"≥ 10× naive → {naive / res['r3arrow']['seconds']:.1f}× "
        f"({'met' if naive / res['r3arrow']['seconds'] >= 10 else 'MISSED'})\n"
    )
    print(
        "Peak RSS above start: the timed runs only (VmHWM reset after data generation and a "
        "warm-up run; "
        "the warm-up imports torch, whose libraries are not counted). The input routes are "
        f"{ids / 2**20:.0f} MiB.\n"
    )

    # Part 2: a multi-step directory, single process vs Ray.
    from r3arrow.io import write_rollouts

    tmp = Path(tempfile.mkdtemp(prefix="bench_stats_"))
    try:
        table = make_table(trajectories, tokens, seed=1)
        per = max(1, table.num_rows // (STEPS * PARTS))
        written = 0
        for step in range(STEPS):
            for part in range(PARTS):
                start = (step * PARTS + part) * per
                if start < table.num_rows:
                    write_rollouts(table.slice(start, per), tmp, step=step)
                    written += 1
        del table
        disk = sum(f.stat().st_size for f in tmp.rglob("*.parquet"))
        ray_cases = ["dir-ray-driver"] + ([] if args.quick else ["dir-ray-hash"])
        dir_cases = ["dir-local"] + ([] if args.no_ray else ray_cases)
        dres = {c: run_isolated(me, ["--case", c, "--root", str(tmp)]) for c in dir_cases}
        if len({d["digest"] for d in dres.values()}) != 1:
            raise SystemExit(
                f"directory results differ: { {c: d['digest'] for c, d in dres.items()} }"
            )
        local = dres["dir-local"]["seconds"]
        dir_ids = dres["dir-local"]["ids"]
        dlabels = {
            "dir-local": "r3arrow.stats.expert_load(dir), 1 process, streamed by step",
            "dir-ray-driver": "r3arrow.stats.expert_load(dir, executor=RayExecutor()), 2 CPUs, "
            "reduce='driver'",
            "dir-ray-hash": "r3arrow.stats.expert_load(dir, executor=RayExecutor(reduce='ray')), "
            "2 CPUs (hash aggregate)",
        }
        drows = []
        for c, d in dres.items():
            drows.append(
                [
                    dlabels[c],
                    d["seconds"] * 1e3,
                    d.get("cold_seconds", float("nan")) * 1e3,
                    dir_ids / d["seconds"] / 1e6,
                    local / d["seconds"],
                    d["extra_peak_mb"],
                    d["arrow_peak_mb"],
                ]
            )
        print(
            f"## Multi-file directory: {written} Parquet files ({STEPS} steps), "
            f"{disk / 2**20:.0f} MiB on disk "
            f"(page cache warm), {dir_ids / 1e6:.1f}M expert ids\n"
        )
        print(
            markdown_table(
                drows,
                [
                    "case",
                    "ms (warm)",
                    "ms (first run)",
                    "M ids/s",
                    "× single process",
                    "driver peak RSS above start MB",
                    "driver Arrow pool peak MB",
                ],
            )
        )
        if not args.no_ray:
            print(
                f"\nRay init: {dres['dir-ray-driver']['init_seconds']:.1f} s (not included). "
                "Worker memory is not in the driver's RSS. The machine has 2 cores shared with "
                "the driver, the raylet and the object store."
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    main()
