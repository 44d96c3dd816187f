"""Multi-turn route capture and table building, side by side with a SkyRL-style baseline.

Shape: 48 layers, top-8, 128 experts (uint8, 384 B per token). Workloads: one 64-turn
conversation of 25K tokens (each turn ~half observation/prompt, ~half generated tokens), and
64 trajectories of 2K-8K tokens in 2-6 turns each. Each turn's new rows (the suffix the engine
returns for ``prompt start = captured``) are delivered as a **writable** numpy array, as a
decoder hands them over.

Cases (each in its own subprocess, so peak memory is per case; ``--quick`` runs them in one):
  copy_warm      one copy of the final routes into a warm buffer (this run's memcpy)
  copy_fresh     one copy of the final routes into a fresh array (allocation + first touch)
  baseline       an independent implementation of SkyRL's approach (RoutedExpertTrace-style):
                 keep each turn's array, concatenate them at finalize; no id checks
  trace_handover r3arrow: RouteTrace.record(..., copy=False) per turn (validated once) +
                 finalize (one write of the trace's bytes)
  trace_unchecked  trace_handover with `r3arrow.ids.check_routes` stubbed out (breakdown
                 only: the cost of capture without validation, as the baseline has none)
  trace_copy     r3arrow default, record(...) copies each writable turn (the caller may reuse
                 its buffer), then finalize joins
  store          the capture path: store.trace(tid).record(..., copy=False) + finalize (the
                 store then holds slices of the finalized buffer)
  table_traces   rollout_table from the finalized traces (routes referenced, not copied)
  table_store    TurnStore.routes_chunked + rollout_table (routes referenced, not copied)
  table_copy     for reference: TurnStore.routes (one gather copy) + rollout_table
  recv_full      full-prefix capture (no prompt starts): every turn's whole prefix decoded into
                 a fresh array, the latest kept (route bytes moved: the O(N^2) path)
  wire           capture over the wire, r3arrow: each turn's vLLM payload (base64 ``.npy``, the
                 bytes inside the response body, as `lift_routes` hands them over) decoded by the
                 client's `response_routes` / `decode_routes` (header, size, shape and dtype
                 checks), then RouteTrace.record (range and duplicate-id checks) + finalize
  wire_guarded   wire plus the client's default route-quality guard (`check_route_quality`),
                 which SkyRL has no counterpart of (breakdown only)
  wire_skyrl     capture over the wire, SkyRL PR #1912's own functions from a checkout of the
                 PR head (``_skyrl_real.py``): each turn's packed payload (its
                 ``pack_routed_experts`` of the same rows) through ``decode_packed_routed_experts``
                 and ``RoutedExpertTrace.record_generation``, then ``finalize`` (no duplicate
                 check, no range check against the expert count); ``n/a`` without a checkout

Peak memory is what the case allocates (tracemalloc for numpy + the Arrow pool's peak), the
caller's delivered arrays excluded (made before measuring); "x trace bytes" divides it by the
final routes' bytes. Table cases time only the table build (their inputs are made before).

Targets (issue 13): capture (trace_handover) <= 1.0x the baseline's time and <= 1.1x the
trace's bytes at peak; table building (table_traces, table_store) <= 0.2x a memcpy. Issue 21:
the wire capture (wire) <= 1.0x SkyRL #1912's (wire_skyrl) on the same rows.

    .venv/bin/python benchmarks/bench_capture.py            # full size (~1 min)
    .venv/bin/python benchmarks/bench_capture.py --quick    # small sizes, in one process (seconds)
    ... --skyrl-checkout DIR   # SkyRL's side from DIR (default: extracted from the mirror)
"""

from __future__ import annotations

import gc
import json
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import _skyrl_real
import numpy as np
import pyarrow as pa
from _common import (
    GB,
    best_of,
    machine_line,
    markdown_table,
    memcpy_gbps,
    parser,
    run_isolated,
)

from r3arrow import RouteSpec, RouteTrace, TurnStore, rollout_table
from r3arrow.capture import check_route_quality
from r3arrow.client._protocol import LIFTED, decode_routes, response_routes
from r3arrow.codec import encode_vllm
from r3arrow.spec import routes_to_numpy
from r3arrow.testing import random_routes

LAYERS, TOPK, EXPERTS = 48, 8, 128
SPEC = RouteSpec(num_layers=LAYERS, topk=TOPK, num_experts=EXPERTS)
CAPTURE = ("baseline", "trace_handover", "trace_unchecked", "trace_copy", "store")
TABLES = ("table_traces", "table_store", "table_copy")
WIRE = ("wire", "wire_guarded", "wire_skyrl")
CASES = ("copy_warm", "copy_fresh", *CAPTURE, *TABLES, "recv_full", *WIRE)


# ---------------------------------------------------------------- workloads
@dataclass
class Conversation:
    """One trajectory: per turn (P, G, new rows, full-prefix rows) and its final routes."""

    tid: str
    turns: list[tuple[int, int, int, int]]
    routes: np.ndarray  # [captured, L, K], the rows the engine reports over the conversation

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
    return Conversation(tid, out, random_routes(rng, captured, SPEC))


def workload(name: str, quick: bool) -> list[Conversation]:
    rng = np.random.default_rng(0 if name == "conv" else 1)
    if name == "conv":
        total, turns = (4096, 16) if quick else (25000, 64)
        return [plan(rng, "conv", total, turns)]
    n, lo, hi = (8, 512, 2048) if quick else (64, 2048, 8192)
    return [
        plan(rng, f"t{i}", int(rng.integers(lo, hi + 1)), int(rng.integers(2, 7))) for i in range(n)
    ]


def deliveries(conv: Conversation) -> list[np.ndarray]:
    """Each turn's new rows as its own writable buffer (what a decoder hands over)."""
    out, start = [], 0
    for _, _, rows, _ in conv.turns:
        out.append(conv.routes[start : start + rows].copy())
        start += rows
    return out


# ------------------------------------------------------------------ baseline
class ConcatTrace:
    """SkyRL's approach, implemented independently: keep each turn's array, join at the end.

    Per turn the delivered array is kept as is (no copy, no check); `finalize` concatenates
    the turns once. What SkyRL's trainer would then hold is this one array.
    """

    def __init__(self) -> None:
        self._turns: list[np.ndarray] = []

    def record(self, rows: np.ndarray) -> None:
        self._turns.append(np.asarray(rows))

    def finalize(self) -> np.ndarray:
        out = np.concatenate(self._turns, axis=0)
        self._turns = []
        return out


# --------------------------------------------------------------------- cases
def _capture(
    convs: list[Conversation], parts: list[list[np.ndarray]], *, copy: bool
) -> list[pa.Array[Any]]:
    out = []
    for conv, cs in zip(convs, parts, strict=True):
        trace = RouteTrace(SPEC)
        for (p, g, _, _), chunk in zip(conv.turns, cs, strict=True):
            trace.record(chunk, prompt_tokens=p, generated_tokens=g, copy=copy)
        mask = np.zeros(conv.num_tokens, dtype=np.uint8)
        out.append(trace.finalize(num_tokens=conv.num_tokens, loss_mask=mask))
    return out


def _store_capture(convs: list[Conversation], parts: list[list[np.ndarray]]) -> TurnStore:
    store = TurnStore(SPEC)
    traces = [store.trace(c.tid) for c in convs]
    order = [  # turn-major: the agent loops interleave their appends
        (i, t)
        for t in range(max(len(c.turns) for c in convs))
        for i, c in enumerate(convs)
        if t < len(c.turns)
    ]
    for i, t in order:
        p, g, _, _ = convs[i].turns[t]
        traces[i].record(parts[i][t], prompt_tokens=p, generated_tokens=g, copy=False)
    for trace, conv in zip(traces, convs, strict=True):
        mask = np.zeros(conv.num_tokens, dtype=np.uint8)
        trace.finalize(num_tokens=conv.num_tokens, loss_mask=mask)
    return store


def _columns(convs: list[Conversation]) -> dict[str, Any]:
    """The non-route columns over ``convs`` (prompt = first turn's prompt, the rest response),
    made before timing: the table cases time the table build, not making token lists."""
    prompts = [np.zeros(c.turns[0][0], dtype=np.int32) for c in convs]
    responses = [np.zeros(c.num_tokens - c.turns[0][0], dtype=np.int32) for c in convs]
    return {
        "trajectory_id": [c.tid for c in convs],
        "group_id": ["g"] * len(convs),
        "prompt_ids": prompts,
        "response_ids": responses,
        "loss_mask": [np.zeros(r.size, dtype=np.uint8) for r in responses],
        "reward": np.zeros(len(convs)),
    }


def _table(columns: dict[str, Any], routes: Any) -> pa.Table:
    return rollout_table(**columns, routes=routes, spec=SPEC)


def _wire_r3arrow(
    convs: list[Conversation], parts: list[list[np.ndarray]], *, guard: bool
) -> Callable[[], list[pa.Array[Any]]]:
    """The client's handling of each turn's routes (module docstring, ``wire``)."""
    bodies = [[memoryview(encode_vllm(c).encode()) for c in cs] for cs in parts]
    masks = [np.zeros(c.num_tokens, dtype=np.uint8) for c in convs]

    def decode(raw: object) -> tuple[np.ndarray, int]:
        return decode_routes(raw, SPEC, check_ids=False)  # ids: in record, as the client

    def run() -> list[pa.Array[Any]]:
        out = []
        for conv, payloads, mask in zip(convs, bodies, masks, strict=True):
            trace = RouteTrace(SPEC)
            for (p, g, _, _), payload in zip(conv.turns, payloads, strict=True):
                routes, _ = response_routes(LIFTED, payload, "choices[0]", decode)
                assert routes is not None
                if guard:
                    check_route_quality(routes, SPEC, what="routed_experts")
                trace.record(routes, prompt_tokens=p, generated_tokens=g)
            out.append(trace.finalize(num_tokens=conv.num_tokens, loss_mask=mask))
        return out

    return run


def _wire_skyrl(
    sk: Any, convs: list[Conversation], parts: list[list[np.ndarray]]
) -> Callable[[], list[np.ndarray]]:
    """SkyRL #1912's client-side decode and accumulation (module docstring, ``wire_skyrl``);
    returns the captured rows of each trajectory (its final padding row dropped)."""
    payloads = [[sk.generate_wire.pack_routed_experts(c) for c in cs] for cs in parts]
    masks = [[0] * c.num_tokens for c in convs]
    decode = sk.generate_wire.decode_packed_routed_experts
    trace_type = sk.routed_experts.RoutedExpertTrace

    def run() -> list[np.ndarray]:
        out = []
        for conv, packed, mask in zip(convs, payloads, masks, strict=True):
            trace = trace_type()
            for (p, g, _, _), payload in zip(conv.turns, packed, strict=True):
                trace.record_generation(
                    prompt_token_count=p, generated_token_count=g, routed_experts=decode(payload)
                )
            rows = trace.finalize(token_count=conv.num_tokens, loss_mask=mask)
            out.append(rows[: conv.routes.shape[0]])
        return out

    return run


def make_case(
    name: str, convs: list[Conversation], skyrl_checkout: str | None = None
) -> tuple[Callable[[], Any], Callable[[Any], None], Callable[[], None]] | str:
    """(fn to time, check of its result against the final routes, reset between runs), or
    the reason the case cannot run (``wire_skyrl`` without SkyRL)."""
    finals = [c.routes for c in convs]
    columns = _columns(convs)

    def check_arrays(out: list[Any]) -> None:
        assert len(out) == len(finals)
        for got, want in zip(out, finals, strict=True):
            got = got if isinstance(got, np.ndarray) else routes_to_numpy(got, SPEC)
            assert np.array_equal(got, want)

    def check_table(table: pa.Table) -> None:
        col: Any = table.column("routes")
        check_arrays([routes_to_numpy(col.slice(i, 1).chunk(0).flatten()) for i in range(len(col))])

    def nothing() -> None:
        return None

    if name == "copy_warm":
        src = np.concatenate([f.reshape(-1) for f in finals])
        dst = np.empty_like(src)
        dst[:] = 0
        return (lambda: np.copyto(dst, src)), (lambda _: None), nothing
    if name == "copy_fresh":
        return (lambda: [np.array(f) for f in finals]), check_arrays, nothing
    parts = [deliveries(c) for c in convs]
    if name == "baseline":

        def run_baseline() -> list[np.ndarray]:
            out = []
            for cs in parts:
                trace = ConcatTrace()
                for chunk in cs:
                    trace.record(chunk)
                out.append(trace.finalize())
            return out

        return run_baseline, check_arrays, nothing
    if name == "trace_unchecked":
        import r3arrow.capture._trace as trace_mod

        def stub(arr: np.ndarray, spec: RouteSpec, **kw: Any) -> tuple[int, int]:
            return 0, EXPERTS - 1  # what the check returns for valid ids of this spec

        def run_unchecked() -> list[pa.Array[Any]]:
            names = vars(trace_mod)  # the name trace.py calls (imported, not re-exported)
            real = names["check_routes"]
            names["check_routes"] = stub
            try:
                return _capture(convs, parts, copy=False)
            finally:
                names["check_routes"] = real

        return run_unchecked, check_arrays, nothing
    if name in ("trace_handover", "trace_copy"):
        copy = name == "trace_copy"
        return (lambda: _capture(convs, parts, copy=copy)), check_arrays, nothing
    if name == "store":

        def check_store(store: TurnStore) -> None:
            check_table(_table(columns, store.routes_chunked([c.tid for c in convs])))

        return (lambda: _store_capture(convs, parts)), check_store, nothing
    if name == "table_traces":
        traces = _capture(convs, parts, copy=False)
        return (lambda: _table(columns, traces)), check_table, nothing
    if name in ("table_store", "table_copy"):
        store = _store_capture(convs, parts)
        ids = [c.tid for c in convs]
        if name == "table_store":
            return (lambda: _table(columns, store.routes_chunked(ids))), check_table, nothing
        return (lambda: _table(columns, store.routes(ids))), check_table, nothing
    if name == "recv_full":

        def run_recv_full() -> list[np.ndarray]:
            out: list[np.ndarray] = []
            for conv in convs:
                latest = conv.routes[:0]
                for _, _, _, full in conv.turns:
                    latest = np.array(conv.routes[:full])  # decode of the full-prefix payload
                out.append(latest)
            return out

        return run_recv_full, check_arrays, nothing
    if name in ("wire", "wire_guarded"):
        return _wire_r3arrow(convs, parts, guard=name == "wire_guarded"), check_arrays, nothing
    if name == "wire_skyrl":
        sk, note = _skyrl_real.load(*_skyrl_real.checkout_dir(skyrl_checkout), _skyrl_real.WIRE)
        if sk is None:
            return note
        return _wire_skyrl(sk, convs, parts), check_arrays, nothing
    raise ValueError(f"unknown case {name!r}")


def run_case(name: str, wl: str, quick: bool, skyrl_checkout: str | None) -> dict[str, Any]:
    """Run one case in this process: allocation peak of the first call, then best-of timing;
    ``{"na": reason}`` for a case that cannot run here."""
    convs = workload(wl, quick)
    case = make_case(name, convs, skyrl_checkout)
    if isinstance(case, str):
        return {"na": case}
    fn, check, _ = case
    fn()  # warm: compiled kernels, first-call caches (not what capture allocates per trajectory)
    gc.collect()
    pool = pa.default_memory_pool()
    arrow_before = pool.bytes_allocated()
    tracemalloc.start()
    tracemalloc.reset_peak()
    out = fn()
    _, np_peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    arrow_peak = max(0, (pool.max_memory() or 0) - arrow_before)
    check(out)
    del out
    gc.collect()
    # Best of enough runs to see through a busy machine: ~1 s per case (0.2 s quick), 5..50 runs.
    t0 = time.perf_counter()
    fn()
    once = time.perf_counter() - t0
    seconds = best_of(fn, int(min(50, max(5, (0.2 if quick else 1.0) / max(once, 1e-6)))), warmup=0)
    return {"seconds": seconds, "alloc_peak_bytes": np_peak + arrow_peak}


# --------------------------------------------------------------------- main
def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--case", choices=CASES, help="run one case here and print its JSON (internal)")
    p.add_argument("--workload", choices=("conv", "batch"), default="conv")
    p.add_argument(
        "--skyrl-checkout",
        default=None,
        help="a directory holding SkyRL PR #1912's skyrl package (wire_skyrl; default: "
        "extracted from the mirror, see _skyrl_real.py)",
    )
    args = p.parse_args()
    if args.case:
        print(json.dumps(run_case(args.case, args.workload, args.quick, args.skyrl_checkout)))
        return

    print(f"# bench_capture {'(quick)' if args.quick else ''}\n\n{machine_line()}")
    print(f"memcpy (warm, 64 MiB): {memcpy_gbps(64 << 20):.1f} GB/s\n")
    flags = ["--quick"] if args.quick else []
    if args.skyrl_checkout:
        flags += ["--skyrl-checkout", args.skyrl_checkout]
    targets = []
    for wl in ("conv", "batch"):
        convs = workload(wl, args.quick)
        final = sum(c.routes.nbytes for c in convs)
        full = sum(f for c in convs for _, _, _, f in c.turns) * SPEC.row_nbytes
        tokens = sum(c.num_tokens for c in convs)
        turns = sorted({len(c.turns) for c in convs})
        ntraj = len(convs)
        del convs
        if args.quick:  # in-process: seconds, not one interpreter start per case
            res = {c: run_case(c, wl, True, args.skyrl_checkout) for c in CASES}
        else:
            res = {
                c: run_isolated(__file__, ["--case", c, "--workload", wl, *flags]) for c in CASES
            }
        warm = res["copy_warm"]["seconds"]
        base = res["baseline"]["seconds"]
        rows: list[list[Any]] = []
        for c in CASES:
            r = res[c]
            if "na" in r:
                rows.append([f"{c}: n/a ({r['na']})", *["n/a"] * 7])
                continue
            rows.append(
                [
                    c,
                    (full if c == "recv_full" else final) / 2**20,
                    r["seconds"] * 1e3,
                    final / r["seconds"] / GB,
                    r["seconds"] / base,
                    r["seconds"] / warm,
                    r["alloc_peak_bytes"] / 2**20,
                    r["alloc_peak_bytes"] / final,
                ]
            )
        desc = f"{turns[0]} turns" if len(turns) == 1 else f"{turns[0]}-{turns[-1]} turns each"
        print(
            f"## {wl}: {ntraj} trajectories, {tokens:,} tokens, {desc}; "
            f"final routes {final / 2**20:.1f} MiB\n"
        )
        print(
            markdown_table(
                rows,
                [
                    "case",
                    "route MiB in",
                    "time ms",
                    "GB/s of final",
                    "x baseline",
                    "x memcpy",
                    "alloc peak MiB",
                    "x trace bytes",
                ],
            )
        )
        print()
        cap = res["trace_handover"]
        sky = res["wire_skyrl"]
        targets.append(
            [
                wl,
                _verdict(cap["seconds"] / base, 1.0),
                f"{res['trace_unchecked']['seconds'] / base:.2f}",
                _verdict(cap["alloc_peak_bytes"] / final, 1.1),
                _verdict(res["table_traces"]["seconds"] / warm, 0.2),
                _verdict(res["table_store"]["seconds"] / warm, 0.2),
                "n/a" if "na" in sky else _verdict(res["wire"]["seconds"] / sky["seconds"], 1.0),
            ]
        )
    print("## targets\n")
    print(
        markdown_table(
            targets,
            [
                "workload",
                "capture / baseline time (<=1.0)",
                "the same, id checks stubbed",
                "capture peak / trace bytes (<=1.1)",
                "table_traces / memcpy (<=0.2)",
                "table_store / memcpy (<=0.2)",
                "wire / wire_skyrl (<=1.0)",
            ],
        )
    )


def _verdict(ratio: float, limit: float) -> str:
    return f"{ratio:.2f} " + ("PASS" if ratio <= limit else "FAIL")


if __name__ == "__main__":
    main()
