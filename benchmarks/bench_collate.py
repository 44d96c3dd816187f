"""Collate a rollout batch into PP-local int32 replay targets: r3arrow vs the dense baseline.

Default (issue 3): 64 trajectories of 2K–8K tokens, 48 layers, top-8, 128 experts (uint8),
PP=4 stage 1 (router layers 12..23), packed. Reports, measured in this run:

* time of ``MegatronCollator(...)(table)`` (all microbatch tensors, not only routes) and its
  ratio to a memory copy of the int32 replay-target bytes (target ≤ 2×);
* the dense baseline: left-pad every trajectory into ``[B, S_max, L, K]``, select the stage's
  layers, permute to Megatron's token order, convert to int32 (target ≥ 5× slower);
* peak memory of each path above its input (each case in its own process; Linux VmHWM reset
  through ``/proc/self/clear_refs`` after the input is built), target ≥ 4× lower;
* R3 off (``MegatronCollator(spec=None)``, packed, the same table without routes): the model
  inputs only, its output being the token tensors (no target; shows what routes add).

First, issue 13's chain, side by side (``benchmarks/_chain.py``; ``--chain-only`` for just
this): 32 trajectories of 4K tokens (131K), PP=4 stage 1, packed, align 8; r3arrow's
``rollout_table`` from finalized traces -> collate -> validated ``install_replay`` into real
megatron-core ``RouterReplay`` instances vs an independent SkyRL-#1912-style baseline (dense
left-padded ``[B, S_max, L, K]``, ``index_select``, aligned packing, per-layer int32 split,
``set_replay_data``) and SkyRL PR #1912's own functions, imported from a checkout of the PR
head (``benchmarks/_skyrl_real.py``: the trainer's ``convert_prompts_responses_to_batch_tensors``
and ``make_router_padding_mask``, the worker's ``build_token_metadata_layout`` and
``setup_per_microbatch_replay_forward`` packed, the stage chosen by SkyRL's
``patch_topk_router_layer_number`` numbers; targets checked equal to r3arrow's first;
``--skyrl-checkout DIR``, else extracted from the mirror, else an ``n/a (reason)`` row); ratios
to both and to a memcpy of the output, peak memory (targets: >= 10x faster than the baseline
and than SkyRL #1912's functions, <= 3x memcpy;
``docs/collation.md``). The chain runs once per thread count of ``--chain-threads`` (default
``1,2``: one core, both cores), every side with the same threads; the memcpy is
single-threaded.

Then the fused gather kernel alone (`r3arrow.ids.gather_router_ids`, ``--kernels-only`` for just
this) for top-k 2, 4, 6, 8 of uint8 and uint16 ids, 12 local layers of 48, at 1 and 2 threads:
ns per (token, layer) row and the ratio to the limit, about 0.7x a memcpy of the int32 output (a
stage's rows are a fraction of each token's cache lines of ids; the output is the bytes that
must be written).

Run: ``.venv/bin/python benchmarks/bench_collate.py`` (``--quick`` for a small size).
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from _common import best_of, machine_line, markdown_table, parser, proc_status_mb, reset_peak_rss


def make_table(
    n_traj: int, lo: int, hi: int, layers: int, topk: int, experts: int, seed: int = 0
) -> Any:
    """A valid rollout table: ragged routes (captured = tokens - 1), distinct ids per row."""
    import r3arrow

    rng = np.random.default_rng(seed)
    n = rng.integers(lo, hi + 1, n_traj)
    plen = np.minimum(rng.integers(64, 1024, n_traj), n - 1)
    cap = n - 1
    total = int(cap.sum())
    # Distinct ids without a [T, L, K] int64 temporary: random start + K distinct offsets mod E.
    dt = np.uint8 if experts <= 256 else np.uint16
    routes = np.empty((total, layers, topk), dtype=dt)
    offs = rng.permutation(experts)[:topk].astype(np.int64)
    chunk = 1 << 16
    for a in range(0, total, chunk):
        b = min(total, a + chunk)
        starts = rng.integers(0, experts, (b - a, layers, 1))
        routes[a:b] = ((starts + offs) % experts).astype(dt)
    bounds = np.concatenate([[0], np.cumsum(cap)])
    spec = r3arrow.RouteSpec(num_layers=layers, topk=topk, num_experts=experts)
    return r3arrow.rollout_table(
        trajectory_id=[f"t{i}" for i in range(n_traj)],
        group_id=[f"g{i // 8}" for i in range(n_traj)],
        prompt_ids=[rng.integers(0, 32000, int(p), dtype=np.int32) for p in plen],
        response_ids=[
            rng.integers(0, 32000, int(m - p), dtype=np.int32) for m, p in zip(n, plen, strict=True)
        ],
        loss_mask=[np.ones(int(m - p), dtype=np.uint8) for m, p in zip(n, plen, strict=True)],
        reward=rng.random(n_traj),
        routes=[routes[bounds[i] : bounds[i + 1]] for i in range(n_traj)],
        spec=spec,
    )


def dense_baseline(table: Any, layers: list[int]) -> list[Any]:
    """Reference path: left-pad into [B, S_max, L, K], select layers, permute to [L, S, B, K],
    widen."""
    import torch

    from r3arrow.table import flat_routes, sequence_lengths

    routes, offs = flat_routes(table)
    n = sequence_lengths(table)
    b, s_max = len(n), int(n.max())
    _, n_layers, k = routes.shape
    dense = torch.zeros((b, s_max, n_layers, k), dtype=torch.uint8)
    src = torch.from_numpy(routes)
    for i in range(b):
        c = int(offs[i + 1] - offs[i])
        start = s_max - int(n[i])
        dense[i, start : start + c] = src[int(offs[i]) : int(offs[i + 1])]
    local = dense.index_select(2, torch.tensor(layers))
    out = local.permute(2, 1, 0, 3).contiguous().to(torch.int32)
    return list(out.reshape(len(layers), s_max * b, k).unbind(0))


def run_case(args: Any) -> dict[str, Any]:
    import torch

    torch.set_num_threads(args.threads)
    import r3arrow

    table = make_table(
        args.trajectories, args.min_tokens, args.max_tokens, args.layers, args.topk, args.experts
    )
    per_stage = args.layers // args.pp
    layers = list(range(args.stage * per_stage, (args.stage + 1) * per_stage))
    spec = r3arrow.table.route_spec(table)
    r3off = args.case == "r3off"
    if r3off:
        table = table.drop_columns(["routes"]).replace_schema_metadata(None)

    def collator() -> Any:
        return r3arrow.MegatronCollator(
            None if r3off else spec,
            layers=None if r3off else layers,
            packed=args.case != "unpacked",
            align=args.align,
            validate=not args.no_validate,
            num_threads=args.threads,
        )

    def make() -> Any:
        if args.case == "dense":
            return lambda t: dense_baseline(t, layers)
        collate = collator()
        if r3off:
            fields = ("input_ids", "position_ids", "labels", "loss_mask", "label_mask")
            return lambda t: [getattr(mb, f) for mb in [collate(t)] for f in fields]
        return lambda t: collate(t).replay_targets()

    collate_for_check = collator()

    # Warm the code paths (lazy imports, kernel caches) on two rows with another instance,
    # so the peak below is the path's own memory on the full batch.
    make()(table.slice(0, 2))
    path = make()

    def fn() -> Any:
        return path(table)

    gc.collect()
    rss_before = proc_status_mb("VmRSS")
    reset = reset_peak_rss()
    t0 = time.perf_counter()
    out = fn()
    cold = time.perf_counter() - t0
    # MiB above the input; NaN where VmHWM cannot be reset (it would include the input build)
    peak = proc_status_mb("VmHWM") - rss_before if reset else float("nan")
    out_bytes = sum(int(t.numel()) * t.element_size() for t in out)
    del out
    # Interleave the case with a copy of its output bytes (warm buffers): same conditions.
    src = np.ones(out_bytes, dtype=np.uint8)
    dst = np.zeros_like(src)
    warm = copy = float("inf")
    for _ in range(args.repeat):
        copy = min(copy, best_of(lambda: np.copyto(dst, src), 1, warmup=0))
        warm = min(warm, best_of(fn, 1, warmup=0))
    check = float("nan")
    # Install-time check of the targets (ids in range, no duplicates); R3 off has none.
    if args.case in ("packed", "unpacked"):
        from r3arrow.errors import ReplayDuplicateError, ReplayRangeError
        from r3arrow.ids import check_routes

        mb = collate_for_check(table)

        def install_check() -> None:  # what r3arrow.megatron.install_replay runs on a microbatch
            check_routes(
                mb.replay_tensor(),
                num_experts=spec.num_experts,
                layer_ids=mb.layers,
                layers_first=True,
                what="replay target",
                range_error=ReplayRangeError,
                duplicate_error=ReplayDuplicateError,
            )

        check = best_of(install_check, 3)
    return {
        "check_s": check,
        "case": args.case,
        "warm_s": warm,
        "cold_s": cold,
        "copy_s": copy,
        "peak_extra_mb": peak,
        "out_bytes": out_bytes,
        "tokens": int(r3arrow.table.sequence_lengths(table).sum()),
    }


def print_kernels(args: Any) -> None:
    """The gather kernel per top-k and id width, at 1 and 2 threads (the span cut in halves
    over a thread pool, as the collator does): ns per (token, layer) row, x a memcpy of the
    int32 output (one thread's ``np.copyto``, interleaved with the kernel's runs), x the
    limit (0.7x that memcpy). Distinct ids from a random start + K distinct offsets mod E
    (no ``[T, L, E]`` temporary)."""
    from concurrent.futures import ThreadPoolExecutor

    from r3arrow._kernels import backend
    from r3arrow.ids import gather_router_ids

    tokens = 8192 if args.quick else 131072
    layers, local = 48, list(range(12, 24))
    index = np.asarray(local, dtype=np.int64)
    rng = np.random.default_rng(0)
    pos_row = np.arange(tokens, dtype=np.int64).reshape(tokens, 1)
    pool = ThreadPoolExecutor(max_workers=2)
    rows = []
    for dtype, experts in ((np.uint8, 128), (np.uint16, 512)):
        for k in (2, 4, 6, 8):
            starts = rng.integers(0, experts, (tokens, layers, 1))
            src = ((starts + rng.permutation(experts)[:k]) % experts).astype(dtype)
            out = np.empty((len(local), tokens, 1, k), dtype=np.int32)
            copy_dst = np.empty_like(out)

            def piece(span: tuple[int, int, int, int]) -> None:
                gather_router_ids(src, index, pos_row, out, experts, local, span=span)  # noqa: B023

            halves = [(0, tokens // 2, 0, 1), (tokens // 2, tokens, 0, 1)]
            runs: dict[int, Callable[[], object]] = {
                1: lambda: piece((0, tokens, 0, 1)),
                2: lambda: [f.result() for f in [pool.submit(piece, h) for h in halves]],  # noqa: B023
            }
            runs[1]()  # compiles (or loads from numba's cache) and faults the pages in
            runs[2]()
            copy = t1 = t2 = float("inf")
            for _ in range(args.repeat):  # interleaved: the same load for every side
                copy = min(copy, best_of(lambda: np.copyto(copy_dst, out), 1, warmup=0))  # noqa: B023
                t1 = min(t1, best_of(runs[1], 1, warmup=0))
                t2 = min(t2, best_of(runs[2], 1, warmup=0))
            for threads, t in ((1, t1), (2, t2)):
                ns = t / (tokens * len(local)) * 1e9
                rows.append(
                    [f"top-{k} {np.dtype(dtype).name}", threads, ns, t / copy, t / (0.7 * copy)]
                )
    pool.shutdown()
    print(
        f"fused gather ({backend()} backend): {tokens:,} tokens, 12 of {layers} layers, "
        "best of --repeat; memcpy = one thread's copy of the int32 output"
    )
    print(
        markdown_table(rows, ["ids", "threads", "ns per row", "x memcpy", "x limit (0.7x memcpy)"])
    )
    print()


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--trajectories", type=int, default=64)
    p.add_argument("--min-tokens", type=int, default=2048)
    p.add_argument("--max-tokens", type=int, default=8192)
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--pp", type=int, default=4)
    p.add_argument("--stage", type=int, default=1)
    p.add_argument("--align", type=int, default=1)
    p.add_argument("--repeat", type=int, default=9)
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads / collator threads, every case",
    )
    p.add_argument(
        "--no-validate", action="store_true", help="skip the rollout-table terminal-gap check"
    )
    p.add_argument(
        "--chain-trajectories", type=int, default=32, help="chain: trajectories (issue 13)"
    )
    p.add_argument("--chain-tokens", type=int, default=4096, help="chain: tokens per trajectory")
    p.add_argument("--chain-align", type=int, default=8, help="chain: packed alignment")
    p.add_argument("--chain-only", action="store_true", help="only the chain table")
    p.add_argument(
        "--skyrl-checkout",
        default=None,
        help="chain: a directory holding SkyRL PR #1912's skyrl package (default: extracted "
        "from the mirror, see _skyrl_real.py)",
    )
    p.add_argument("--kernels-only", action="store_true", help="only the gather-kernel table")
    p.add_argument(
        "--chain-threads", default="1,2", help="chain: thread counts to run, comma-separated"
    )
    p.add_argument(
        "--case",
        choices=[
            "packed",
            "unpacked",
            "dense",
            "r3off",
            "chain-r3arrow",
            "chain-baseline",
            "chain-skyrl",
        ],
        help=argparse_hidden(),
    )
    args = p.parse_args()
    if args.quick:
        args.trajectories, args.min_tokens, args.max_tokens, args.repeat = 8, 256, 1024, 3
        args.chain_trajectories, args.chain_tokens = 8, 512
    if args.case and args.case.startswith("chain-"):
        from _chain import run_chain

        args.trajectories, args.tokens, args.align = (
            args.chain_trajectories,
            args.chain_tokens,
            args.chain_align,
        )
        print(json.dumps(run_chain(args, args.case.removeprefix("chain-"))))
        return
    if args.case:
        print(json.dumps(run_case(args)))
        return

    print_kernels(args)
    if args.kernels_only:
        return
    forward = [a for a in sys.argv[1:]]
    print_chain(args, forward)
    if args.chain_only:
        return
    results: dict[str, dict[str, Any]] = {}
    for case in ("packed", "unpacked", "dense", "r3off"):
        results[case] = _case(forward, case)
    packed = results["packed"]
    copy_s = packed["copy_s"]
    gbps = packed["out_bytes"] / copy_s / 1e9
    dense = results["dense"]
    rows = []
    for case in ("packed", "unpacked", "dense", "r3off"):
        r = results[case]
        rows.append(
            [
                {
                    "packed": "r3arrow packed",
                    "unpacked": "r3arrow unpacked",
                    "dense": "dense baseline",
                    "r3off": "r3arrow packed, R3 off (no routes)",
                }[case],
                r["warm_s"] * 1e3,
                r["cold_s"] * 1e3,
                r["warm_s"] / r["copy_s"],
                dense["warm_s"] / r["warm_s"],
                r["out_bytes"] / 2**20,
                r["peak_extra_mb"],
                dense["peak_extra_mb"] / r["peak_extra_mb"]
                if r["peak_extra_mb"] > 0
                else float("nan"),
                r["check_s"] * 1e3,
            ]
        )
    print(
        f"{args.trajectories} trajectories, {packed['tokens']:,} tokens, {args.layers} layers, "
        f"top-{args.topk}, {args.experts} experts, PP={args.pp} stage {args.stage}; "
        f"torch threads={args.threads}; "
        f"memcpy {gbps:.1f} GB/s ({copy_s * 1e3:.1f} ms for the packed target bytes, measured "
        "interleaved with each case in its process)"
    )
    print(machine_line())
    print()
    print(
        markdown_table(
            rows,
            [
                "path",
                "warm ms",
                "cold ms",
                "× memcpy of its output",
                "dense ÷ this (time)",
                "output MiB",
                "peak above input MiB",
                "dense ÷ this (peak)",
                "install check ms",
            ],
        )
    )
    print()
    print(
        "command: .venv/bin/python benchmarks/bench_collate.py"
        + (" " + " ".join(forward) if forward else "")
    )


def _case(forward: list[str], case: str) -> dict[str, Any]:
    import subprocess

    proc = subprocess.run(
        [sys.executable, __file__, *forward, "--case", case],
        capture_output=True,
        text=True,
        check=False,
        env=dict(os.environ),
    )
    if proc.returncode != 0:
        raise SystemExit(f"case {case} failed:\n{proc.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def print_chain(args: Any, forward: list[str]) -> None:
    """Issue 13's chain (table -> collate -> validated install) vs the SkyRL-style baseline
    and SkyRL #1912 head's functions (``_skyrl_real.py``), once per thread count of
    ``--chain-threads`` (every side gets the same torch / collator threads; the memcpy is one
    thread's, the same for every row). A SkyRL that cannot be loaded gives an ``n/a (reason)``
    row."""
    counts = [int(v) for v in str(args.chain_threads).split(",") if v.strip()]
    runs = []
    for t in counts:
        extra = [*forward, "--threads", str(t)]  # the last --threads wins
        runs.append(
            (
                t,
                _case(extra, "chain-r3arrow"),
                _case(extra, "chain-baseline"),
                _case(extra, "chain-skyrl"),
            )
        )
    timed = [r for run in runs for r in run[1:] if "na" not in r]
    copy_s = min(r["copy_s"] for r in timed)
    fastest = min(b["warm_s"] for _, _, b, _ in runs)  # the baseline's best time at any threads
    sky_ok = [s for _, _, _, s in runs if "na" not in s]
    fastest_sky = min(s["warm_s"] for s in sky_ok) if sky_ok else float("nan")
    rows: list[list[Any]] = []
    for t, r3_t, base_t, sky_t in runs:
        sides = (
            (f"r3arrow chain, {t} thread(s)", r3_t),
            (f"SkyRL-style, {t}", base_t),
            (f"SkyRL #1912 head, {t}", sky_t),
        )
        for name, r in sides:
            if "na" in r:
                rows.append([f"{name}: n/a ({r['na']})", *["n/a"] * 9])
                continue
            sky_w = sky_t.get("warm_s")
            rows.append(
                [
                    name,
                    r["warm_s"] * 1e3,
                    r["cold_s"] * 1e3,
                    r["warm_s"] / copy_s,
                    base_t["warm_s"] / r["warm_s"],
                    fastest / r["warm_s"],
                    "n/a" if sky_w is None else sky_w / r["warm_s"],
                    fastest_sky / r["warm_s"] if sky_ok else "n/a",
                    r["out_bytes"] / 2**20,
                    r["peak_extra_mb"],
                ]
            )
    best = min(runs, key=lambda run: run[1]["warm_s"])
    r3 = best[1]
    print(
        f"Chain (issue 13): {args.chain_trajectories} trajectories, {r3['tokens']:,} tokens, "
        f"{args.layers} layers x top-{args.topk} of {args.experts} (uint8), PP={args.pp} stage "
        f"{args.stage}, packed, align {args.chain_align}; threads={counts}; memcpy (1 thread) "
        f"of the int32 targets {copy_s * 1e3:.2f} ms ({r3['out_bytes'] / copy_s / 1e9:.1f} GB/s)"
    )
    print(machine_line())
    print()
    print(
        markdown_table(
            rows,
            [
                "path",
                "warm ms",
                "cold ms",
                "x memcpy of output",
                "baseline / this (same threads)",
                "fastest baseline / this",
                "SkyRL #1912 / this (same threads)",
                "fastest SkyRL #1912 / this",
                "output MiB",
                "peak above input MiB",
            ],
        )
    )
    parts = (("rollout_table", "table_s"), ("collate", "collate_s"), ("install", "install_s"))
    print()
    print(
        f"r3arrow parts (warm, {best[0]} thread(s)): "
        + ", ".join(f"{n} {r3[k] * 1e3:.2f} ms ({r3[k] / copy_s:.2f}x memcpy)" for n, k in parts)
        + f"; collate + validated install {(r3['collate_s'] + r3['install_s']) / copy_s:.2f}x "
        f"memcpy; r3arrow / fastest baseline {r3['warm_s'] / fastest:.3f}; r3arrow / fastest "
        + (f"SkyRL #1912 {r3['warm_s'] / fastest_sky:.3f}" if sky_ok else "SkyRL #1912 n/a")
    )
    if sky_ok:
        sky = min(sky_ok, key=lambda r: r["warm_s"])
        sky_parts = (
            (
                "trainer: convert_prompts_responses_to_batch_tensors + make_router_padding_mask",
                "convert_s",
            ),
            (
                "worker: build_token_metadata_layout + setup_per_microbatch_replay_forward",
                "setup_s",
            ),
        )
        print(
            "SkyRL #1912 head parts (warm, fastest threads): "
            + ", ".join(f"{n} {sky[k] * 1e3:.2f} ms ({sky[k] / copy_s:.2f}x)" for n, k in sky_parts)
            + f"; its {args.layers // args.pp} targets hold {sky['held_bytes'] / 2**20:.1f} MiB "
            f"(views of one buffer; output {sky['out_bytes'] / 2**20:.1f} MiB); "
            "targets == r3arrow's == the rollout's "
            f"on {sky['checked_tokens']:,} captured tokens x {args.layers // args.pp} layers; "
            f"{sky['note']}"
        )
    else:
        print(f"SkyRL #1912 head: n/a ({runs[0][3]['na']})")
    print()


def argparse_hidden() -> str:
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
