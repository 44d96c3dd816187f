"""Rollout persistence: r3arrow Parquet (fixed_size_binary per token) vs naive Parquet, IPC, memcpy.

Shape: 48 layers, top-8, 128 experts (uint8 ids); 64 trajectories of 2K-8K tokens (~128 MB of
routes; ``--quick``: 8 trajectories of 256-1K tokens). Ids are 8 distinct experts per token and
layer, drawn uniformly (about 47 of 64 bits of entropy: uniform routing is the hard case for
compression; real routing is skewed and compresses better).

Cases: ``write_rollouts``/``read_rollouts`` (uncompressed, zstd; reads validate the rows and
check the row-group digests, ``validate=False`` is the "read alone" case of the validation
target: footer and digests only, docs/storage.md "Integrity"); the naive baseline
``pq.write_table`` of the same table with its nested ``fixed_size_list`` routes as-is and
``pq.read_table`` back (uncompressed, zstd, and pyarrow's defaults: snappy + dictionary);
Arrow IPC ``write_ipc``/``read_rollouts`` (memory-mapped; "+ touch" also reads every route byte);
and a warm-buffer memcpy of the raw route bytes, measured in the same run.

Each case runs in its own process, so its peak RSS (VmHWM, not ``ru_maxrss``, which a child
inherits from its parent on Linux) and Arrow pool peak are its own; "op RSS" is that peak minus
the resident size just before the operation (the table, for writes).
Times are the best of several runs after a warm-up ("first" is the first, cold-allocator
run); files live in the page cache. GB/s counts route bytes only. "x naive" is the naive
case's best time over this case's for the same operation and compression.

    .venv/bin/python benchmarks/bench_io.py            # ~128 MB of routes (about a minute)
    .venv/bin/python benchmarks/bench_io.py --quick    # seconds
"""

from __future__ import annotations

import argparse
import itertools
import json
import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from _common import (  # the script's folder is on sys.path when run as a script
    GB,
    arrow_peak_mb,
    machine_line,
    markdown_table,
    memcpy_gbps,
    parser,
    peak_rss_mb,
    proc_status_mb,
    run_isolated,
)

import r3arrow
from r3arrow.spec import RouteSpec, numpy_to_routes, routes_to_numpy

LAYERS, TOPK, EXPERTS = 48, 8, 128
SPEC = RouteSpec(num_layers=LAYERS, topk=TOPK, num_experts=EXPERTS)

# case -> (operation, format, compression); naive cases are the baselines of their operation
CASES: dict[str, tuple[str, str, str]] = {
    "r3_write_none": ("write", "r3arrow parquet", "none"),
    "r3_write_zstd": ("write", "r3arrow parquet", "zstd"),
    "naive_write_none": ("write", "naive nested parquet", "none"),
    "naive_write_zstd": ("write", "naive nested parquet", "zstd"),
    "naive_write_default": ("write", "naive nested parquet", "default (snappy)"),
    "ipc_write": ("write", "r3arrow IPC", "none"),
    "r3_read_none": ("read", "r3arrow parquet", "none"),
    "r3_read_zstd": ("read", "r3arrow parquet", "zstd"),
    "r3_read_trusted": ("read", "r3arrow parquet, validate=False", "none"),
    "naive_read_none": ("read", "naive nested parquet", "none"),
    "naive_read_zstd": ("read", "naive nested parquet", "zstd"),
    "naive_read_default": ("read", "naive nested parquet", "default (snappy)"),
    "ipc_read": ("read", "r3arrow IPC (mmap, lazy open)", "none"),
    "ipc_read_touch": ("read", "r3arrow IPC (mmap) + touch", "none"),
}
FILES = {
    "r3_write_none": "r3_none.parquet",
    "r3_write_zstd": "r3_zstd.parquet",
    "naive_write_none": "naive_none.parquet",
    "naive_write_zstd": "naive_zstd.parquet",
    "naive_write_default": "naive_default.parquet",
    "ipc_write": "r3.arrow",
}
READ_FILE = {
    "r3_read_none": "r3_none.parquet",
    "r3_read_zstd": "r3_zstd.parquet",
    "r3_read_trusted": "r3_none.parquet",
    "naive_read_none": "naive_none.parquet",
    "naive_read_zstd": "naive_zstd.parquet",
    "naive_read_default": "naive_default.parquet",
    "ipc_read": "r3.arrow",
    "ipc_read_touch": "r3.arrow",
}
BASELINE = {
    "r3_write_none": "naive_write_none",
    "r3_write_zstd": "naive_write_zstd",
    "ipc_write": "naive_write_none",
    "r3_read_none": "naive_read_none",
    "r3_read_zstd": "naive_read_zstd",
    "r3_read_trusted": "naive_read_none",
    "ipc_read_touch": "naive_read_none",
}


# ------------------------------------------------------------------ data
def generate_routes(tokens: int, seed: int = 0) -> np.ndarray:
    """``[tokens, 48, 8]`` uint8: per (token, layer) 8 distinct experts of 128, in random order.

    Expert j of a row is drawn from bucket ``perm[j]`` (16 experts each) of a random permutation
    of the 8 buckets: distinct by construction, vectorised, no rejection loop.
    """
    rng = np.random.default_rng(seed)
    perms = np.array(list(itertools.permutations(range(TOPK))), dtype=np.uint8)  # 8! rows
    rows = tokens * LAYERS
    out = np.empty((rows, TOPK), dtype=np.uint8)
    step = 1 << 20
    for lo in range(0, rows, step):  # chunks bound the temporaries
        hi = min(rows, lo + step)
        pick = rng.integers(0, len(perms), hi - lo)
        out[lo:hi] = perms[pick] * np.uint8(EXPERTS // TOPK) + rng.integers(
            0, EXPERTS // TOPK, (hi - lo, TOPK), dtype=np.uint8
        )
    return out.reshape(tokens, LAYERS, TOPK)


def trajectory_lengths(quick: bool, seed: int = 1) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if quick:
        return rng.integers(256, 1025, 8)
    return rng.integers(2048, 8193, 64)


def build_table(routes: np.ndarray, lengths: np.ndarray) -> pa.Table:
    """A rollout table of trajectories of ``lengths`` tokens, each captured but the last."""
    n = len(lengths)
    prompt = lengths // 4
    response = lengths - prompt
    captured = lengths - 1
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(captured, out=offsets[1:])
    assert offsets[-1] == routes.shape[0]
    col = pa.LargeListArray.from_arrays(pa.array(offsets), numpy_to_routes(routes, SPEC))
    rng = np.random.default_rng(2)
    return r3arrow.rollout_table(
        trajectory_id=[f"traj-{i}" for i in range(n)],
        group_id=[f"group-{i // 8}" for i in range(n)],
        prompt_ids=[rng.integers(0, 150_000, p).astype(np.int32) for p in prompt],
        response_ids=[rng.integers(0, 150_000, r).astype(np.int32) for r in response],
        loss_mask=[np.ones(r, dtype=np.uint8) for r in response],
        reward=rng.random(n),
        routes=col,
        spec=SPEC,
    )


# ----------------------------------------------------------- child side
def timed(fn: Callable[[], Any], repeat: int, warmup: int) -> tuple[float, float, Any]:
    """(first run, best run, last result) in seconds; the first run counts as a warm-up."""
    times = []
    out = None
    for _ in range(warmup + repeat):
        out = None  # free the previous result before the next run
        t0 = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t0)
    best = min(times[warmup:]) if repeat else min(times)
    return times[0], best, out


def child(case: str, work: Path, quick: bool) -> dict[str, Any]:
    op, fmt, comp = CASES[case]
    naive = fmt.startswith("naive")
    repeat, warmup = (2, 0) if naive and not quick else (5, 1)
    routes_path = work / "routes.npy"
    lengths = np.load(work / "lengths.npy", allow_pickle=False)
    res: dict[str, Any] = {"case": case}
    if op == "write":
        table = build_table(np.load(routes_path, allow_pickle=False), lengths)
        dest = work / FILES[case]
        pq_comp = {"none": "none", "zstd": "zstd"}.get(comp)
        fn: Callable[[], Any]
        if case.startswith("r3"):
            fn = lambda: r3arrow.write_rollouts(table, dest, compression=comp)  # noqa: E731
        elif case == "ipc_write":
            fn = lambda: r3arrow.io.write_ipc(table, dest)  # noqa: E731
        elif pq_comp is None:  # pyarrow's defaults, exactly as a user would call it
            fn = lambda: pq.write_table(table, dest)  # noqa: E731
        else:
            fn = lambda: pq.write_table(table, dest, compression=pq_comp)  # noqa: E731
        res["rss_before_mb"] = proc_status_mb("VmRSS")
        res["first_s"], res["best_s"], _ = timed(fn, repeat, warmup)
        res["file_bytes"] = dest.stat().st_size
    else:
        src = work / READ_FILE[case]
        if case == "r3_read_trusted":
            fn = lambda: r3arrow.read_rollouts(src, validate=False)  # noqa: E731
        elif case.startswith("r3") or case == "ipc_read":
            fn = lambda: r3arrow.read_rollouts(src)  # noqa: E731
        elif case == "ipc_read_touch":

            def fn() -> Any:
                t = r3arrow.read_rollouts(src)
                view = routes_to_numpy(t.column("routes").chunk(0).flatten(), SPEC)
                return t, np.bitwise_xor.reduce(view.reshape(-1).view(np.uint64))
        else:
            fn = lambda: pq.read_table(src)  # noqa: E731
        res["rss_before_mb"] = proc_status_mb("VmRSS")
        res["first_s"], res["best_s"], out = timed(fn, repeat, warmup)
        got = out[0] if isinstance(out, tuple) else out
        # outside the timing and after the peak was taken: the data read back is the data written
        res["peak_rss_mb"] = peak_rss_mb()
        res["arrow_peak_mb"] = arrow_peak_mb()
        col = got.column("routes").combine_chunks()
        leaf = col.flatten().flatten().flatten().to_numpy(zero_copy_only=False)
        expected = np.load(routes_path, allow_pickle=False)
        res["ok"] = bool(np.array_equal(leaf, expected.reshape(-1)))
        return res
    res["peak_rss_mb"] = peak_rss_mb()
    res["arrow_peak_mb"] = arrow_peak_mb()
    res["ok"] = True
    return res


# ----------------------------------------------------------- parent side
def prepare(work: Path, quick: bool) -> dict[str, Any]:
    lengths = trajectory_lengths(quick)
    routes = generate_routes(int((lengths - 1).sum()))
    np.save(work / "routes.npy", routes, allow_pickle=False)
    np.save(work / "lengths.npy", lengths, allow_pickle=False)
    build_table(routes, lengths)  # validates the data once (ids, terminal gap)
    return {
        "raw_bytes": routes.nbytes,
        "tokens": int(routes.shape[0]),
        "trajectories": len(lengths),
    }


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--keep", action="store_true", help="keep the files under /tmp")
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.child, Path(args.work), args.quick)))
        return

    t_start = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="r3arrow-bench-io-", dir="/tmp"))
    try:
        info = prepare(work, args.quick)
        raw = info["raw_bytes"]
        copy_gbps = memcpy_gbps(raw)
        results: dict[str, dict[str, Any]] = {}
        for case in CASES:
            extra = ["--quick"] if args.quick else []
            results[case] = run_isolated(
                __file__, ["--child", case, "--work", str(work), *extra], timeout=600
            )
            if not results[case].get("ok"):
                raise SystemExit(f"{case}: data read back differs from the data written")
        report(info, copy_gbps, results, args.quick, time.perf_counter() - t_start)
    finally:
        if args.keep:
            print(f"files kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


def report(
    info: dict[str, Any],
    copy_gbps: float,
    results: dict[str, dict[str, Any]],
    quick: bool,
    elapsed: float,
) -> None:
    raw = info["raw_bytes"]
    rows: list[list[Any]] = []
    for case, (op, fmt, comp) in CASES.items():
        r = results[case]
        lazy = case == "ipc_read"  # opening a memory map reads nothing: no throughput to report
        gbps = raw / r["best_s"] / GB
        base = BASELINE.get(case)
        if base:
            vs_naive = f"{results[base]['best_s'] / r['best_s']:.1f}x"
        else:
            vs_naive = "(baseline)" if fmt.startswith("naive") else "-"
        file_bytes = r.get("file_bytes") or results[_writer_of(case)].get("file_bytes")
        rows.append(
            [
                op,
                fmt,
                comp,
                r["best_s"],
                r["first_s"],
                "-" if lazy else gbps,
                vs_naive,
                "-" if lazy else f"{gbps / copy_gbps:.3f}",
                f"{file_bytes / raw:.3f}" if file_bytes else "",
                r["peak_rss_mb"],
                r["peak_rss_mb"] - r["rss_before_mb"],
                r["arrow_peak_mb"],
            ]
        )
    rows.append(
        [
            "copy",
            "memcpy of the raw route bytes (warm buffer)",
            "-",
            raw / copy_gbps / GB,
            "-",
            copy_gbps,
            "-",
            "1.000",
            "-",
            "-",
            "-",
            "-",
        ]
    )
    size = "quick" if quick else "full"
    print(f"# bench_io ({size}): {machine_line()}")
    print(
        f"{info['trajectories']} trajectories, {info['tokens']:,} tokens, "
        f"routes [{LAYERS}, {TOPK}] "
        f"uint8 ({EXPERTS} experts): {raw / 2**20:.1f} MiB raw; memcpy {copy_gbps:.1f} GB/s\n"
    )
    headers = [
        "op",
        "format",
        "compression",
        "best s",
        "first s",
        "GB/s",
        "x naive",
        "/ memcpy",
        "file / raw",
        "peak RSS MB",
        "op RSS MB",
        "arrow peak MB",
    ]
    print(markdown_table(rows, headers))
    print(
        "\npeak RSS: the case's own process (VmHWM); op RSS: peak minus the resident size just "
        "before the operation (the table, for writes); arrow peak: pyarrow pool high-water mark."
    )
    ratio = {c: results[BASELINE[c]]["best_s"] / results[c]["best_s"] for c in BASELINE}
    size_ratio = results["r3_write_none"]["file_bytes"] / raw
    print()
    for op in ("write", "read"):
        x = ratio[f"r3_{op}_none"]
        print(
            f"target {op:5s} >= 10x naive (uncompressed): {x:.1f}x {'PASS' if x >= 10 else 'FAIL'}"
            f"   (zstd vs naive zstd: {ratio[f'r3_{op}_zstd']:.1f}x)"
        )
    checked = results["r3_read_none"]["best_s"] / results["r3_read_trusted"]["best_s"]
    print(
        f"target read + validate <= 1.3x read alone (validate=False, uncompressed): "
        f"{checked:.2f}x {'PASS' if checked <= 1.3 else 'FAIL'}"
    )
    print(
        f"target file  <= 1.05x raw route bytes (uncompressed, whole file): {size_ratio:.3f} "
        f"{'PASS' if size_ratio <= 1.05 else 'FAIL'}"
        f"   (zstd: {results['r3_write_zstd']['file_bytes'] / raw:.3f})"
    )
    if quick:
        print(
            "(quick sizes are dominated by fixed per-call costs; the targets are for the full size)"
        )
    print(f"\n(total {elapsed:.0f} s)")


def _writer_of(case: str) -> str:
    name = READ_FILE.get(case)
    return next((w for w, f in FILES.items() if f == name), case)


if __name__ == "__main__":
    main()
