"""Multi-turn route capture: incremental prompt starts vs the O(N²) full-prefix baseline.

Shape: 48 layers, top-8, 128 experts (uint8, 384 B per token). Workloads: one 64-turn
conversation of 32K tokens (each turn ~256 observation/prompt + ~256 generated tokens), and
64 trajectories of 2K-8K tokens in 2-6 turns each. Per request the engine returns
``P - start + G - 1`` rows: incremental capture sends ``start = captured``, the baseline sends
``start = 0`` (all ``P + G - 1`` rows every turn) and keeps the latest full tensor.

Cases (each in its own subprocess, so peak memory is per case):
  copy_warm     one copy of the final trace(s) into a warm buffer (this run's memcpy speed)
  copy_fresh    one copy of the final trace(s) into a fresh array (allocation + first touch)
  trace_ro      RouteTrace.record per turn + finalize; chunks read-only, as a decode returns them
  trace_rw      same with writable chunks (the trace copies each: a reused buffer cannot corrupt it)
  store_append  the capture path only: store.trace(tid).record per turn (validated once by the
                trace, one record batch per turn into the store; no assembly)
  store         the capture path + routes() for all trajectories
  recv_incr     end to end: materialise each turn's new rows (decode into a fresh read-only array),
                record, finalize
  recv_full     baseline end to end: materialise every turn's full prefix into a fresh array, keep
                the latest (what the reference did before prompt starts)

Targets: >= 20x fewer route bytes at 64 turns; assembly (trace_ro, store) within 2x one copy of
the final trace (copy_fresh).

    .venv/bin/python benchmarks/bench_capture.py            # full size (~1 min)
    .venv/bin/python benchmarks/bench_capture.py --quick    # small sizes, in one process (seconds)
"""

from __future__ import annotations

import gc
import itertools
import json
import sys
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa
from _common import (
    GB,
    best_of,
    machine_line,
    markdown_table,
    memcpy_gbps,
    parser,
    proc_status_mb,
    run_isolated,
)

from r3arrow import RouteSpec, RouteTrace, TurnStore, routes_to_numpy
from r3arrow.testing import random_routes

LAYERS, TOPK, EXPERTS = 48, 8, 128
SPEC = RouteSpec(num_layers=LAYERS, topk=TOPK, num_experts=EXPERTS)
CASES = (
    "copy_warm",
    "copy_fresh",
    "trace_ro",
    "trace_rw",
    "store_append",
    "store",
    "recv_incr",
    "recv_full",
)


# ---------------------------------------------------------------- workloads
@dataclass
class Conversation:
    """One trajectory: per turn (P, G, incremental rows, full-prefix rows) and its final routes."""

    tid: str
    turns: list[tuple[int, int, int, int]]
    routes: np.ndarray  # [captured, L, K], the rows the engine reports over the whole conversation

    @property
    def num_tokens(self) -> int:
        p, g, _, _ = self.turns[-1]
        return p + g


def plan(rng: np.random.Generator, tid: str, total: int, turns: int) -> Conversation:
    """A conversation of ``total`` tokens in ``turns`` turns (each ~half observation, half new)."""
    per = np.full(turns, total // turns)
    per[: total % turns] += 1
    obs = np.maximum(1, (per * rng.uniform(0.375, 0.625, size=turns)).astype(int))
    gen = np.maximum(1, per - obs)
    seen = captured = 0
    out = []
    for o, g in zip(obs.tolist(), gen.tolist(), strict=True):
        p = seen + o
        rows = p - captured + g - 1
        out.append((p, g, rows, p + g - 1))
        seen, captured = p + g, captured + rows
    routes = random_routes(rng, captured, SPEC)
    return Conversation(tid, out, routes)


def workload(name: str, quick: bool) -> list[Conversation]:
    rng = np.random.default_rng(0 if name == "conv" else 1)
    if name == "conv":
        total, turns = (4096, 16) if quick else (32768, 64)
        return [plan(rng, "conv", total, turns)]
    n, lo, hi = (8, 512, 2048) if quick else (64, 2048, 8192)
    return [
        plan(rng, f"t{i}", int(rng.integers(lo, hi + 1)), int(rng.integers(2, 7))) for i in range(n)
    ]


def chunks(conv: Conversation, *, writable: bool) -> list[np.ndarray]:
    """Each turn's new rows as its own buffer (read-only: what decoding a bytes payload returns)."""
    out, start = [], 0
    for _, _, rows, _ in conv.turns:
        part = conv.routes[start : start + rows]
        start += rows
        out.append(
            part.copy() if writable else np.frombuffer(part.tobytes(), np.uint8).reshape(part.shape)
        )
    return out


# -------------------------------------------------------------------- cases
def make_case(
    name: str, convs: list[Conversation]
) -> tuple[Callable[[], Any], Callable[[Any], None]]:
    """(fn to time, check of its result against the final routes)."""
    finals = [c.routes for c in convs]
    masks = [np.zeros(c.num_tokens, dtype=np.uint8) for c in convs]

    def check_list(out: list[np.ndarray]) -> None:
        assert len(out) == len(finals)
        for got, want in zip(out, finals, strict=True):
            assert np.array_equal(got, want)

    if name == "copy_warm":
        src = np.concatenate([f.reshape(-1) for f in finals])
        dst = np.empty_like(src)
        dst[:] = 0
        return (lambda: np.copyto(dst, src)), (lambda _: None)
    if name == "copy_fresh":
        return (lambda: [np.array(f) for f in finals]), check_list
    if name in ("trace_ro", "trace_rw"):
        parts = [chunks(c, writable=name == "trace_rw") for c in convs]

        def run_trace() -> list[pa.Array[Any]]:
            out = []
            for conv, cs, mask in zip(convs, parts, masks, strict=True):
                trace = RouteTrace(SPEC)
                for (p, g, _, _), chunk in zip(conv.turns, cs, strict=True):
                    trace.record(chunk, prompt_tokens=p, generated_tokens=g)
                out.append(trace.finalize(num_tokens=conv.num_tokens, loss_mask=mask))
            return out

        return run_trace, lambda out: check_list([routes_to_numpy(a, SPEC) for a in out])
    if name in ("store", "store_append"):
        parts = [chunks(c, writable=False) for c in convs]
        ids = [c.tid for c in convs]
        # Turn-major order: the agent loops interleave their appends.
        order = [
            (i, t)
            for t in range(max(len(c.turns) for c in convs))
            for i, c in enumerate(convs)
            if t < len(c.turns)
        ]
        starts = [
            np.concatenate([[0], np.cumsum([r for _, _, r, _ in c.turns])[:-1]]).tolist()
            for c in convs
        ]

        def append_all() -> TurnStore:
            # The one capture path: each trajectory's trace validates a turn once and hands it
            # to the store (rollout.py does the same through the client).
            store = TurnStore(SPEC)
            traces = [store.trace(tid) for tid in ids]
            for i, t in order:
                p, g, _, _ = convs[i].turns[t]
                start = traces[i].record(parts[i][t], prompt_tokens=p, generated_tokens=g)
                assert start == starts[i][t]
            return store

        if name == "store_append":
            return (
                append_all,
                lambda store: None if store.num_turns == len(order) else sys.exit("lost turns"),
            )

        def run_store() -> pa.Array[Any]:
            return append_all().routes(ids)

        def check_store(col: Any) -> None:
            offsets = np.asarray(col.offsets)
            flat = routes_to_numpy(col.values, SPEC)
            check_list([flat[a:b] for a, b in itertools.pairwise(offsets)])

        return run_store, check_store
    if name == "recv_incr":

        def run_recv_incr() -> list[pa.Array[Any]]:
            out = []
            for conv, mask in zip(convs, masks, strict=True):
                trace = RouteTrace(SPEC)
                for p, g, rows, _ in conv.turns:
                    start = trace.captured
                    chunk = np.array(
                        conv.routes[start : start + rows]
                    )  # decode of this turn's payload
                    chunk.flags.writeable = False
                    trace.record(chunk, prompt_tokens=p, generated_tokens=g)
                out.append(trace.finalize(num_tokens=conv.num_tokens, loss_mask=mask))
            return out

        return run_recv_incr, lambda out: check_list([routes_to_numpy(a, SPEC) for a in out])
    if name == "recv_full":

        def run_recv_full() -> list[np.ndarray]:
            out: list[np.ndarray] = []
            for conv in convs:
                latest = conv.routes[:0]
                for _, _, _, full in conv.turns:
                    latest = np.array(conv.routes[:full])  # decode of the full-prefix payload
                out.append(latest)
            return out

        return run_recv_full, check_list
    raise ValueError(f"unknown case {name!r}")


def run_case(name: str, wl: str, quick: bool) -> dict[str, Any]:
    """Run one case in this process: memory of the first call, then best-of timing."""
    convs = workload(wl, quick)
    fn, check = make_case(name, convs)
    gc.collect()
    rss_before = proc_status_mb("VmRSS")
    arrow_before = pa.default_memory_pool().max_memory()
    tracemalloc.start()
    out = fn()
    _, np_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    arrow_peak = max(0, (pa.default_memory_pool().max_memory() or 0) - (arrow_before or 0))
    rss_delta = proc_status_mb("VmHWM") - rss_before  # NaN without /proc
    check(out)
    del out
    gc.collect()
    # Best of enough runs to see through a busy machine: ~1 s per case (0.2 s quick), 5..50 runs.
    t0 = time.perf_counter()
    fn()
    once = time.perf_counter() - t0
    seconds = best_of(fn, int(min(50, max(5, (0.2 if quick else 1.0) / max(once, 1e-6)))), warmup=0)
    return {
        "seconds": seconds,
        "alloc_peak_mb": (np_peak + arrow_peak) / 2**20,
        "rss_peak_delta_mb": max(0.0, rss_delta) if rss_delta == rss_delta else rss_delta,
    }


# --------------------------------------------------------------------- main
def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--case", choices=CASES, help="run one case here and print its JSON (internal)")
    p.add_argument("--workload", choices=("conv", "batch"), default="conv")
    args = p.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case, args.workload, args.quick)))
        return

    print(f"# bench_capture {'(quick)' if args.quick else ''}\n\n{machine_line()}")
    gbps = memcpy_gbps(64 << 20)
    print(f"memcpy (warm, 64 MiB): {gbps:.1f} GB/s\n")
    flags = ["--quick"] if args.quick else []
    summary = []
    for wl in ("conv", "batch"):
        convs = workload(wl, args.quick)
        row_bytes = SPEC.row_nbytes
        final = sum(c.routes.nbytes for c in convs)
        incr = sum(r for c in convs for _, _, r, _ in c.turns) * row_bytes
        full = sum(f for c in convs for _, _, _, f in c.turns) * row_bytes
        tokens = sum(c.num_tokens for c in convs)
        turns = sorted({len(c.turns) for c in convs})
        ntraj = len(convs)
        del convs
        if args.quick:  # in-process: seconds, not one interpreter start per case; no per-case RSS
            res = {c: dict(run_case(c, wl, True), rss_peak_delta_mb="-") for c in CASES}
        else:
            res = {
                c: run_isolated(__file__, ["--case", c, "--workload", wl, *flags]) for c in CASES
            }
        one_copy = res["copy_fresh"]["seconds"]
        warm = res["copy_warm"]["seconds"]
        moved = {"recv_full": full}
        rows = []
        for c in CASES:
            r = res[c]
            rows.append(
                [
                    c,
                    moved.get(c, final) / 2**20,
                    r["seconds"] * 1e3,
                    final / r["seconds"] / GB,
                    r["seconds"] / one_copy,
                    r["seconds"] / warm,
                    r["alloc_peak_mb"],
                    r["rss_peak_delta_mb"],
                ]
            )
        desc = f"{turns[0]} turns" if len(turns) == 1 else f"{turns[0]}-{turns[-1]} turns each"
        print(
            f"## {wl}: {ntraj} trajectories, {tokens:,} tokens, {desc}; "
            f"final routes {final / 2**20:.1f} MiB\n"
        )
        print(
            f"route bytes: incremental {incr / 2**20:.1f} MiB, full prefix {full / 2**20:.1f} MiB, "
            f"ratio {full / incr:.1f}x\n"
        )
        print(
            markdown_table(
                rows,
                [
                    "case",
                    "route MiB in",
                    "time ms",
                    "GB/s of final",
                    "x one copy",
                    "x warm memcpy",
                    "alloc peak MiB",
                    "RSS peak Δ MiB",
                ],
            )
        )
        print()
        summary.append(
            (
                wl,
                full / incr,
                res["trace_ro"]["seconds"] / one_copy,
                res["store"]["seconds"] / one_copy,
                res["recv_full"]["seconds"] / res["recv_incr"]["seconds"],
            )
        )
    print("## targets\n")
    srows = []
    for wl, ratio, tr, st, speed in summary:
        verdict = "" if wl != "conv" or args.quick else " PASS" if ratio >= 20 else " FAIL"
        srows.append(
            [
                wl,
                f"{ratio:.1f}x{verdict}",
                f"{tr:.2f}" + (" PASS" if tr <= 2 else " FAIL"),
                f"{st:.2f}" + (" PASS" if st <= 2 else " FAIL"),
                f"{speed:.1f}x",
            ]
        )
    print(
        markdown_table(
            srows,
            [
                "workload",
                "route bytes full/incremental (>=20x at 64 turns)",
                "trace_ro / one copy (<=2)",
                "store / one copy (<=2)",
                "recv_full / recv_incr time",
            ],
        )
    )


if __name__ == "__main__":
    main()
