"""Cost of ``replay_schedule(measure_agreement=True)`` on megatron-core router forwards (CPU).

Real megatron-core ``TopKRouter``s (r3arrow.testing.megatron harness, gloo world of one), one
microbatch of ``tokens`` router tokens (5 % padding), ``layers`` routers, replayed from
targets that are the routers' own choice with one expert swapped on ``--disagree`` of the rows
(default 10 %, the R3 paper's rate). Each case runs one whole schedule: install the targets
(ids not re-scanned), every router's forward, and for the probe reading ``probe.agreement``
(its one host sync); once under ``no_grad`` (a log-prob pass: the cheapest forward, so the
probe's share is largest) and once with autograd on (a training forward, no backward).
Reported, measured in this run:

* plain replay: ``replay_schedule()`` (the baseline);
* probed replay: ``replay_schedule(measure_agreement=True)``, and its overhead over the
  baseline (target <= 10 %), on the numba kernel (the ``fast`` extra; when numba imports)
  and on the torch fallback (the numpy backend: `r3arrow.testing.use_backend` per run);
* native routing (no replay action) for reference, and the machine's memory-copy speed;
* the kernel's first call in a fresh process, cold (compiling into an empty numba cache)
  and warm (loading the ``cache=True`` machine code), each in its own subprocess.

Default: 8192 tokens, hidden 2048, 128 experts, top-8 (the router shape of Qwen3-30B-A3B),
4 routers; ``--quick``: 2048 tokens, 2 routers. Run: ``.venv/bin/python benchmarks/bench_probe.py``.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
from typing import Any

import torch
from _common import best_of, machine_line, markdown_table, memcpy_gbps, parser


def _targets(
    routers: list[Any], hidden: torch.Tensor, disagree: float, gen: torch.Generator, sched: Any
) -> list[torch.Tensor]:
    """The routers' own choice (``record_schedule``) with one expert swapped on a ``disagree``
    share of rows per layer: replay targets as an engine that disagrees that often would
    send them."""
    with sched(routers) as rec, torch.no_grad():
        for r in routers:
            r(hidden)
        native = [t.clone() for t in rec.take().values()]
    experts = int(routers[0].config.num_moe_experts)
    out = []
    for t in native:
        k = int(t.shape[1])
        # K+1 consecutive ids after the last one: at most K-1 of them are in the row
        cands = (t[:, -1:] + torch.arange(1, k + 2)) % experts
        free = ~(cands.unsqueeze(2) == t.unsqueeze(1)).any(2)
        swap = cands.gather(1, free.int().argmax(1, keepdim=True)).squeeze(1)
        rows = torch.rand(t.shape[0], generator=gen) < disagree
        t[rows, -1] = swap[rows]
        out.append(t.int())
    return out


_FIRST_CALL = """
import importlib
import time

import numpy as np
import r3arrow.megatron  # torch and megatron-core: not the kernel's cost

t0 = time.perf_counter()
k = importlib.import_module("r3arrow._kernels._numba")
ids = np.zeros((4, 2), np.int32)
ids[:, 1] = 1
for s in (np.ones((4, 8), np.float32), np.ones((4, 8), np.float64)):
    k.overlap_rows(s, ids, np.zeros(0, np.uint8), np.empty(4, np.int8))
    k.overlap_rows(s, ids.astype(np.int64), np.zeros(0, np.uint8), np.empty(4, np.int8))
k.overlap_rows_bf16(np.ones((4, 8), np.uint16), ids, np.zeros(0, np.uint8), np.empty(4, np.int8))
print(time.perf_counter() - t0)
"""


def _first_call_s() -> tuple[float, float] | None:
    """Seconds of importing the kernel module and its first calls (float32/float64 with
    int32/int64 ids, bfloat16) in a fresh process: (cold: empty numba cache, warm: cached),
    or None without numba."""
    try:
        import numba  # noqa: F401
    except ImportError:
        return None
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, NUMBA_CACHE_DIR=cache)
        out = [
            float(
                subprocess.run(
                    [sys.executable, "-c", _FIRST_CALL],
                    env=env,
                    check=True,
                    capture_output=True,
                    text=True,
                ).stdout.split()[-1]
            )
            for _ in range(2)
        ]
    return out[0], out[1]


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument("--hidden", type=int, default=None)
    p.add_argument("--experts", type=int, default=128)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--repeat", type=int, default=None)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument(
        "--disagree",
        type=float,
        default=0.1,
        help="share of rows whose target differs from the native choice (default 0.1, the "
        "R3 paper's ~10 %% of router decisions; 1.0: every row)",
    )
    args = p.parse_args()
    tokens = args.tokens or (2048 if args.quick else 8192)
    hidden_size = args.hidden or 2048
    layers = args.layers or (2 if args.quick else 4)
    repeat = args.repeat or (25 if args.quick else 15)
    torch.set_num_threads(args.threads)

    from r3arrow import RouteSpec
    from r3arrow._kernels import backend
    from r3arrow.megatron import install_replay, record_schedule, replay_schedule
    from r3arrow.testing import use_backend
    from r3arrow.testing.megatron import build_routers, cpu_router_harness

    spec = RouteSpec(num_layers=layers, topk=args.topk, num_experts=args.experts)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, 1, hidden_size, generator=gen)  # packed: [s = T, b = 1, h]
    pad = torch.rand(tokens, 1, generator=gen) < 0.05
    results: dict[str, Any] = {}
    with cpu_router_harness():
        routers = build_routers(spec, range(layers), hidden=hidden_size)
        targets = _targets(routers, hidden, args.disagree, gen, record_schedule)

        def forward(grad: bool) -> None:
            with torch.set_grad_enabled(grad):
                for r in routers:
                    r(hidden, padding_mask=pad)

        def plain(grad: bool) -> None:
            with replay_schedule():
                install_replay(targets, num_tokens=tokens, check=False)
                forward(grad)

        def probed(grad: bool) -> None:
            with replay_schedule(measure_agreement=True) as probe:
                install_replay(targets, num_tokens=tokens, check=False)
                forward(grad)
            assert probe is not None
            results["tokens_counted"] = probe.agreement.tokens
            results["identical_fraction"] = probe.agreement.summary()["identical"]

        def probed_torch(grad: bool) -> None:
            with use_backend("numpy"):
                probed(grad)

        def native(grad: bool) -> None:
            with replay_schedule(None):
                forward(grad)

        # interleave single runs of the cases (min of each) so load on a shared machine
        # hits all of them alike
        cases = [
            (f"{name} {mode}", functools.partial(fn, mode == "grad"))
            for mode in ("no_grad", "grad")
            for name, fn in (
                ("plain", plain),
                ("probed", probed),
                ("torch", probed_torch),
                ("native", native),
            )
        ]
        times: dict[str, list[float]] = {name: [] for name, _ in cases}
        for _, fn in cases:
            fn()  # warm-up
        for _ in range(repeat):
            for name, fn in cases:
                times[name].append(best_of(fn, 1, warmup=0))
    best = {name: min(v) for name, v in times.items()}
    path = "numba" if backend() == "numba" else "torch"
    first = _first_call_s()
    gbps = memcpy_gbps(tokens * hidden_size * 4)
    rows, out = [], dict(results)
    per = 1e9 / (tokens * layers)
    for mode in ("no_grad", "grad"):
        base, probe_t, torch_t, nat = (
            best[f"{c} {mode}"] for c in ("plain", "probed", "torch", "native")
        )
        over, over_t = probe_t / base - 1.0, torch_t / base - 1.0
        rows += [
            [f"replay, {mode} (baseline)", base * 1e3, base * per, "-"],
            [f"replay + probe ({path}), {mode}", probe_t * 1e3, probe_t * per, f"{over:+.1%}"],
            [f"replay + probe (torch), {mode}", torch_t * 1e3, torch_t * per, f"{over_t:+.1%}"],
            [f"native routing, {mode}", nat * 1e3, nat * per, f"{nat / base - 1.0:+.1%}"],
        ]
        out |= {
            f"replay_ms_{mode}": base * 1e3,
            f"probe_ms_{mode}": probe_t * 1e3,
            f"probe_torch_ms_{mode}": torch_t * 1e3,
            f"native_ms_{mode}": nat * 1e3,
            f"overhead_{mode}": over,
            f"overhead_torch_{mode}": over_t,
        }
    print(machine_line(), f"torch={torch.__version__} threads={args.threads}")
    print(
        f"{tokens} tokens x {layers} routers, hidden {hidden_size}, {args.experts} experts, "
        f"top-{args.topk}, {args.disagree:.0%} of rows disagree; memcpy {gbps:.1f} GB/s"
    )
    print(markdown_table(rows, ["schedule", "ms", "ns / token / layer", "vs replay"]))
    for mode in ("no_grad", "grad"):
        over = out[f"overhead_{mode}"]
        verdict = "ok" if over <= 0.10 else "ABOVE TARGET"
        print(f"probe overhead ({path}), {mode}: {over:+.1%} (target <= +10 %): {verdict}")
    if first is not None:
        print(
            f"numba kernel, first call in a fresh process: cold {first[0]:.2f} s (compiles), "
            f"warm {first[1]:.2f} s (cache=True)"
        )
        out |= {"first_call_cold_s": first[0], "first_call_warm_s": first[1]}
    out["path"] = path
    out |= {
        "tokens": tokens,
        "hidden": hidden_size,
        "experts": args.experts,
        "topk": args.topk,
        "layers": layers,
        "disagree": args.disagree,
        "memcpy_gbps": gbps,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
