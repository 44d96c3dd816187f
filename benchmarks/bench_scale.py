"""Benchmark: runs larger than memory at disk speed (issue 14, "Done when").

Generates its data (and removes it, also on Ctrl-C or an error):

* a rollout directory of ``--steps`` × ``--parts`` files, 48 layers × top-8 of 128 experts
  (uint8), ≥ 30 GB by default (``--gb``); ``--quick``: about 200 MB;
* separately one single step larger than half of this machine's memory (sized from
  ``/proc/meminfo``; ``--quick``: 100 MB, ``--no-big`` skips it).

Then measures, in the same run, each case in a fresh subprocess (its own peak RSS: VmHWM),
with the page cache dropped before each case (``fsync`` + ``posix_fadvise(DONTNEED)`` per
file; ``--warm`` keeps it):

* ``memcpy``: this machine's memory-copy speed (the reference for every rate);
* ``raw read``: pyarrow reading the files' routes columns row group by row group (the
  baseline every ratio divides by);
* ``iterate``: ``r3arrow.iter_rollouts(root)`` (every column, default budget);
* ``stats``: ``r3arrow.stats.expert_load(root)``;
* ``collate``: one pipeline stage (layers 12–23 of 48) with
  ``r3arrow.collate.collate_directory`` ("n/a" where it is not importable);
* ``stage of 4``: bytes read from disk (``/proc/self/io`` ``read_bytes``) by
  ``iter_rollouts(root, columns=["routes"], layers=range(12, 24))`` over those of
  reading every layer's routes.

Rates are route bytes (tokens × 48 × 8) per second. Targets: peak RSS ≤ 3 GB, ≥ 0.8× the raw
read rate, stage of 4 ≤ 0.3× the bytes. Run from the repository root (``--quick`` in CI)::

    .venv/bin/python benchmarks/bench_scale.py [--quick] [--gb 30] [--no-big] [--warm]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from _common import (  # the script's folder is on sys.path when run as a script
    GB,
    machine_line,
    markdown_table,
    memcpy_gbps,
    parser,
    peak_rss_mb,
    run_isolated,
)

LAYERS, TOPK, EXPERTS = 48, 8, 128
ROW_BYTES = LAYERS * TOPK  # uint8 ids
STAGE = (12, 24)  # a stage of a 4-stage pipeline
TOKENS_PER_TRAJECTORY = 32_768
MICROBATCH_TOKENS = 131_072  # one-stage collation: a trainer-sized microbatch
PROMPT = 1_024


# ------------------------------------------------------------------ data
def _trajectories(rng: np.random.Generator, n: int, tokens: int) -> list[np.ndarray]:
    """``n`` valid ``[tokens - 1, L, K]`` uint8 route arrays (distinct ids per set), fast.

    One random block of top-k sets; each trajectory adds its own offset mod E (a shift
    keeps a set's ids distinct), so generation costs one add per id.
    """
    block = (rng.integers(0, EXPERTS, (tokens - 1, LAYERS, 1)) + np.arange(TOPK)) % EXPERTS
    block = block.astype(np.uint8)
    offsets = rng.integers(0, EXPERTS, n)
    return [(block + np.uint8(o)) & np.uint8(EXPERTS - 1) for o in offsets]


def generate(root: Path, steps: int, parts: int, part_bytes: int, seed: int) -> dict[str, Any]:
    """Write ``steps`` × ``parts`` rollout files of about ``part_bytes`` route bytes each."""
    import r3arrow
    from r3arrow.io import write_rollouts

    spec = r3arrow.RouteSpec(num_layers=LAYERS, topk=TOPK, num_experts=EXPERTS)
    rng = np.random.default_rng(seed)
    tokens = min(TOKENS_PER_TRAJECTORY, max(64, part_bytes // ROW_BYTES))
    n = max(1, round(part_bytes / ((tokens - 1) * ROW_BYTES)))
    response = tokens - PROMPT if tokens > 2 * PROMPT else tokens // 2
    prompt = tokens - response
    mask = np.ones(response, np.uint8)
    mask[-1] = 0  # the last sampled token has no route row (terminal gap)
    total_tokens = 0
    t0 = time.perf_counter()
    for step in range(steps):
        for part in range(parts):
            routes = _trajectories(rng, n, tokens)
            table = r3arrow.rollout_table(
                trajectory_id=[f"s{step}p{part}t{i}" for i in range(n)],
                group_id=[f"s{step}g{i // 8}" for i in range(n)],
                prompt_ids=[np.zeros(prompt, np.int32)] * n,
                response_ids=[np.ones(response, np.int32)] * n,
                loss_mask=[mask] * n,
                reward=rng.random(n),
                routes=routes,
                spec=spec,
            )
            write_rollouts(table, root, step=step)
            total_tokens += n * (tokens - 1)
            del table, routes
    return {
        "route_bytes": total_tokens * ROW_BYTES,
        "disk_bytes": sum(f.stat().st_size for f in root.rglob("*.parquet")),
        "files": steps * parts,
        "seconds": time.perf_counter() - t0,
        "peak_rss_mb": peak_rss_mb(),
    }


def drop_cache(root: Path) -> None:
    """Evict ``root``'s Parquet files from the page cache (written pages are synced first)."""
    for f in sorted(root.rglob("*.parquet")):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_bytes() -> int:
    """Bytes this process caused to be read from storage (``/proc/self/io``); -1 off Linux."""
    try:
        with open("/proc/self/io") as fh:
            for line in fh:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


# ------------------------------------------------------------------ cases (children)
def _raw(root: Path, *, verify: bool = False) -> None:
    """pyarrow alone: every file's routes column(s), row group by row group.

    ``verify``: with page-checksum verification, as every r3arrow reader does.
    """
    import pyarrow.parquet as pq

    for f in sorted(root.rglob("*.parquet")):
        with pq.ParquetFile(f, page_checksum_verification=verify) as pf:
            names = [n for n in pf.schema_arrow.names if n == "routes"]
            for g in range(pf.metadata.num_row_groups):
                pf.read_row_group(g, columns=names)


def _raw_crc(root: Path) -> None:
    _raw(root, verify=True)


def _iterate(root: Path) -> None:
    import r3arrow

    for _ in r3arrow.iter_rollouts(root):
        pass


def _stats(root: Path) -> None:
    from r3arrow import stats

    stats.expert_load(root)


def _collate(root: Path) -> None:
    """One stage's share: layers 12-23, one DP rank, microbatches of <= 131,072 tokens.

    A trainer's microbatch is bounded in tokens, not a fixed fraction of the step: with
    ``num_microbatches=4`` a 14 GB step's microbatch alone would be 3.5 GB of int32 targets.

    ``dp_assign="contiguous"``: with one DP rank (or ranks that own contiguous row ranges)
    each rank reads its row groups in file order instead of gathering length-balanced rows
    from all of them; the microbatch count is the same on every rank either way.
    """
    import r3arrow

    try:
        from r3arrow.collate import collate_directory
    except ImportError as exc:
        raise NotImplementedError(f"r3arrow.collate.collate_directory: {exc}") from exc
    spec = r3arrow.RouteSpec(num_layers=LAYERS, topk=TOPK, num_experts=EXPERTS)
    collator = r3arrow.MegatronCollator(spec, layers=range(*STAGE))
    for _ in collate_directory(
        root, collator, max_tokens=MICROBATCH_TOKENS, dp_assign="contiguous"
    ):
        pass


def _stage(root: Path) -> None:
    import r3arrow

    for _ in r3arrow.iter_rollouts(root, columns=["routes"], layers=list(range(*STAGE))):
        pass


def _all_layers(root: Path) -> None:
    import r3arrow

    for _ in r3arrow.iter_rollouts(root, columns=["routes"]):
        pass


CASES = {
    "raw": _raw,
    "raw+crc": _raw_crc,
    "iterate": _iterate,
    "stats": _stats,
    "collate": _collate,
    "stage": _stage,
    "all-layers": _all_layers,
}


def _warm_up(name: str) -> float:
    """Imports and the numba kernels' load outside the timed part; returns its seconds.

    The kernels use ``cache=True``: a fresh process loads their machine code from the cache
    (compiling only the first time on a machine). The case itself runs once on a tiny
    directory of the same spec, so every kernel signature it uses is loaded before timing.
    """
    t0 = time.perf_counter()
    import pyarrow.parquet  # noqa: F401

    import r3arrow
    from r3arrow import stats

    spec = r3arrow.RouteSpec(num_layers=LAYERS, topk=TOPK, num_experts=EXPERTS)
    stats.count_routes(_trajectories(np.random.default_rng(0), 1, 64)[0], spec)
    if name in ("stats", "collate", "iterate"):
        with tempfile.TemporaryDirectory(prefix="bench_scale_warm_") as tiny:
            generate(Path(tiny), 1, 4, 64 * 1024, seed=1)  # 4 trajectories: 4 microbatches
            with contextlib.suppress(NotImplementedError):
                CASES[name](Path(tiny))
    return time.perf_counter() - t0


def run_case(name: str, root: Path, warm: bool) -> dict[str, Any]:
    """One case in this (fresh) process: seconds, read_bytes, own peak RSS (warm-up untimed)."""
    warm_up = _warm_up(name)
    if not warm:
        drop_cache(root)
    before = read_bytes()
    t0 = time.perf_counter()
    try:
        CASES[name](root)
    except NotImplementedError as exc:
        return {"na": str(exc)}
    return {
        "seconds": time.perf_counter() - t0,
        "read_bytes": read_bytes() - before,
        "peak_rss_mb": peak_rss_mb(),
        "warm_up_s": warm_up,
    }


# ------------------------------------------------------------------ parent
def _mem_total() -> int:
    with open("/proc/meminfo") as fh:
        for line in fh:
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    raise SystemExit("bench_scale: /proc/meminfo has no MemTotal (Linux only)")


def _child(me: str, args: list[str], timeout: float) -> dict[str, Any]:
    out = run_isolated(me, args, timeout=timeout)
    return out


def _measure(
    me: str, root: Path, label: str, route_bytes: int, warm: bool, cases: Sequence[str]
) -> list[list[Any]]:
    """Every case on ``root``: table rows (case, s, GB/s, × raw read, peak RSS GB, read GB)."""
    res = {}
    for case in [c for c in CASES if c in cases]:
        args = ["--case", case, "--root", str(root)] + (["--warm"] if warm else [])
        res[case] = _child(me, args, timeout=6 * 3600)
    raw = route_bytes / res["raw"]["seconds"]
    raw_crc = route_bytes / res["raw+crc"]["seconds"]
    rows: list[list[Any]] = []
    for case in [c for c in ("raw", "raw+crc", "iterate", "stats", "collate") if c in res]:
        r = res[case]
        if "na" in r:
            rows.append([f"{label}: {case}", "n/a", "n/a", "n/a", "n/a", "n/a", r["na"][:60]])
            continue
        rate = route_bytes / r["seconds"]
        rows.append(
            [
                f"{label}: {case}",
                r["seconds"],
                rate / GB,
                rate / raw,
                rate / raw_crc,
                r["peak_rss_mb"] / 1024,
                r["read_bytes"] / GB,
            ]
        )
    warm_ups = ", ".join(f"{c} {r['warm_up_s']:.2f} s" for c, r in res.items() if "warm_up_s" in r)
    print(f"{label}: untimed warm-up per process (imports, numba cache, tiny run): {warm_ups}")
    if "stage" not in res or "all-layers" not in res:
        return rows
    full, stage = res["all-layers"]["read_bytes"], res["stage"]["read_bytes"]
    ratio = stage / full if full > 0 else float("nan")
    rows.append(
        [
            f"{label}: stage of 4 (layers {STAGE[0]}-{STAGE[1] - 1}) bytes read",
            res["stage"]["seconds"],
            f"{ratio:.3f}× of all layers",
            "target ≤ 0.3×" + (" (met)" if ratio <= 0.3 else " (MISSED)"),
            "",
            res["stage"]["peak_rss_mb"] / 1024,
            stage / GB,
        ]
    )
    return rows


def main() -> None:
    p = parser(__doc__ or "")
    p.add_argument("--gb", type=float, default=None, help="route GB of the directory (30)")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--parts", type=int, default=4)
    p.add_argument("--no-big", action="store_true", help="skip the single step > memory / 2")
    p.add_argument("--warm", action="store_true", help="keep the page cache between cases")
    p.add_argument("--dir", default=None, help="where to generate (default: a temp dir)")
    p.add_argument(
        "--cases",
        default=",".join(CASES),
        help=f"comma-separated subset of {','.join(CASES)} (raw and raw+crc always run)",
    )
    p.add_argument("--case", help=argparse.SUPPRESS)
    p.add_argument("--root", help=argparse.SUPPRESS)
    p.add_argument("--gen", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case, Path(args.root), args.warm)))
        return
    if args.gen:
        steps, parts, part_bytes, seed = (int(x) for x in args.gen.split(","))
        print(json.dumps(generate(Path(args.root), steps, parts, part_bytes, seed)))
        return

    cases = sorted({"raw", "raw+crc", *args.cases.split(",")})
    unknown = [c for c in cases if c not in CASES]
    if unknown:
        raise SystemExit(f"bench_scale: unknown cases {unknown}; expected names from {list(CASES)}")
    me = str(Path(__file__).resolve())
    gb = args.gb if args.gb is not None else (0.2 if args.quick else 30.0)
    steps, parts = (4, 2) if args.quick and args.gb is None else (args.steps, args.parts)
    big_bytes = 100 << 20 if args.quick else int(_mem_total() * 0.55)
    need = gb * GB + (0 if args.no_big else big_bytes)
    base = Path(args.dir) if args.dir else Path(tempfile.gettempdir())
    free = shutil.disk_usage(base).free
    if need * 1.05 > free:
        raise SystemExit(f"bench_scale: needs {need / GB:.1f} GB free in {base}, has {free / GB}")
    tmp = Path(tempfile.mkdtemp(prefix="bench_scale_", dir=base))

    def stop(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    try:
        print(f"# bench_scale ({'quick' if args.quick else 'full'})\n\n{machine_line()}")
        copy = memcpy_gbps(64 << 20 if args.quick else 512 << 20)
        print(f"memcpy: {copy:.1f} GB/s; memory {_mem_total() / GB:.1f} GB\n")
        datasets = [("run", tmp / "run", steps, parts, int(gb * GB / (steps * parts)))]
        if not args.no_big:
            big_parts = max(2, round(big_bytes / (1 << 30)))
            datasets.append(("big step", tmp / "big", 1, big_parts, big_bytes // big_parts))
        rows: list[list[Any]] = []
        for label, root, s, n, part_bytes in datasets:
            root.mkdir()
            gen = _child(
                me, ["--gen", f"{s},{n},{part_bytes},{len(rows)}", "--root", str(root)], 6 * 3600
            )
            print(
                f"{label}: {gen['files']} files, {gen['route_bytes'] / GB:.2f} GB of routes, "
                f"{gen['disk_bytes'] / GB:.2f} GB on disk, written in {gen['seconds']:.0f} s"
            )
            rows += _measure(me, root, label, gen["route_bytes"], args.warm, cases)
            shutil.rmtree(root, ignore_errors=True)  # free the disk before the next dataset
        print()
        print(
            markdown_table(
                rows,
                [
                    "case",
                    "s",
                    "GB/s",
                    "× raw read",
                    "× raw read + CRC",
                    "peak RSS GB",
                    "read from disk GB",
                ],
            )
        )
        print(
            f"\nrates: route bytes per second; raw read = pyarrow reading the routes columns "
            "(+ CRC: with page-checksum verification, which every r3arrow reader does) "
            f"({'warm' if args.warm else 'page cache dropped before each case'}). "
            "Targets: peak RSS ≤ 3 GB, ≥ 0.8× raw read, stage of 4 ≤ 0.3× the bytes."
        )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
