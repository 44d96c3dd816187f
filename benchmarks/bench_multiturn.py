"""Multi-turn end-to-end: route bytes with incremental prompt starts vs full-prefix returns,
and client-side CPU per route byte for base64 ``.npy`` vs nested-JSON routes.

Part 1 runs real conversations through `EngineClient` against the embedded reference engine
over real HTTP; the engine serves from a child process so this process's CPU time is the
client's alone. Each scenario runs the same greedy conversation twice: incremental (the trace
sends ``routed_experts_prompt_start = captured``; O(N) rows in total) and full-prefix (prompt
start 0 every turn, what a client without incremental capture receives; O(N^2)). With a
conversation of length ``L_t`` after turn t, the row ratio is ``sum_t L_t / L_T``: at most
``(T+1)/2`` when the first prompt is short, approaching ``T`` when it dominates (agents with
long system prompts and tool specs).

Part 2 times the client's whole response handling (`r3arrow.client.parse_response`: JSON
parse, decode, shape and id checks) on one large response body with the routes as base64
``.npy`` (vLLM) and as nested JSON lists (the legacy form), per route byte, beside the
machine's memory-copy speed.

Run: ``python benchmarks/bench_multiturn.py [--quick]`` from the repository root.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import orjson
from _common import (
    arrow_peak_mb,
    best_of,
    machine_line,
    markdown_table,
    memcpy_gbps,
    parser,
    peak_rss_mb,
)

import r3arrow
from r3arrow.client import EngineClient
from r3arrow.client._protocol import decode_routes, parse_response
from r3arrow.codec import encode_vllm
from r3arrow.testing import random_routes

# A model with realistic route rows for its size: 12 layers (layer 0 dense), top-8 of 32.
ENGINE_CONFIG: dict[str, Any] = {
    "num_layers": 12,
    "topk": 8,
    "num_experts": 32,
    "dense_layers": (0,),
    "hidden_size": 32,
    "num_heads": 2,
    "intermediate_size": 64,
    "moe_intermediate_size": 16,
    "max_model_len": 4096,
    "seed": 0,
}

_SERVER = """
import sys, time
from r3arrow.testing.engine import EngineServer, ReferenceEngine, TinyMoEConfig
cfg = TinyMoEConfig(**{cfg!r})
with EngineServer(ReferenceEngine(cfg)) as srv:
    print(srv.url, flush=True)
    sys.stdin.read()  # serve until the parent closes stdin
"""


def start_server() -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _SERVER.format(cfg=ENGINE_CONFIG)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    url = proc.stdout.readline().strip()
    if not url.startswith("http://"):
        proc.kill()
        raise RuntimeError(f"engine server failed to start (got {url!r})")
    return proc, url


def observation(tokens: list[int], n: int) -> list[int]:
    last = tokens[-1]
    return [(last * 31 + 7 * k + 1) % 512 for k in range(n)]


async def conversation(
    client: EngineClient,
    spec: r3arrow.RouteSpec,
    *,
    prompt_len: int,
    turns: int,
    gen: int,
    obs: int,
    incremental: bool,
) -> dict[str, Any]:
    """One greedy conversation; returns route bytes/rows received, client CPU and the tokens."""
    conv = [(13 * i + 5) % 512 for i in range(prompt_len)]
    trace = r3arrow.RouteTrace(spec) if incremental else None
    sp = {"max_tokens": gen, "temperature": 0.0}
    payload = rows = 0
    last_routes: np.ndarray | None = None
    cpu0, t0 = time.process_time(), time.perf_counter()
    for t in range(turns):
        out = await client.generate(conv, sampling_params=sp, trace=trace, session_id="c")
        payload += out.payload_bytes
        rows += out.num_route_rows
        last_routes = out.routed_experts
        conv = conv + out.token_ids
        if t + 1 < turns:
            conv += observation(out.token_ids, obs)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - t0
    routes = None
    if trace is not None:
        arr = trace.finalize(num_tokens=len(conv), loss_mask=np.zeros(len(conv), np.uint8))
        routes = r3arrow.spec.routes_to_numpy(arr, spec)
    else:
        routes = last_routes  # the last full-prefix answer covers the whole conversation
    return {
        "payload": payload,
        "rows": rows,
        "cpu": cpu,
        "wall": wall,
        "tokens": len(conv),
        "routes": routes,
    }


def part1(scenarios: list[tuple[str, int, int, int, int]]) -> list[list[Any]]:
    spec = r3arrow.RouteSpec(
        num_layers=ENGINE_CONFIG["num_layers"],
        topk=ENGINE_CONFIG["topk"],
        num_experts=ENGINE_CONFIG["num_experts"],
        moe_layers=tuple(range(1, ENGINE_CONFIG["num_layers"])),
    )
    proc, url = start_server()
    table = []
    try:
        for name, prompt_len, turns, gen, obs in scenarios:

            async def main(
                prompt_len: int = prompt_len, turns: int = turns, gen: int = gen, obs: int = obs
            ) -> tuple[dict[str, Any], dict[str, Any]]:
                async with EngineClient(url, spec, timeout=600) as client:
                    await client.generate(
                        [1, 2, 3], sampling_params={"max_tokens": 1}
                    )  # warm the connection
                    kw = {"prompt_len": prompt_len, "turns": turns, "gen": gen, "obs": obs}
                    inc = await conversation(client, spec, incremental=True, **kw)
                    full = await conversation(client, spec, incremental=False, **kw)
                    return inc, full

            inc, full = asyncio.run(main())
            n = inc["tokens"]
            assert full["tokens"] == n, "greedy conversations diverged"
            assert inc["rows"] == n - 1, (inc["rows"], n)
            # same routes either way (the engine is causal to the bit in float64)
            assert full["routes"] is not None and np.array_equal(inc["routes"], full["routes"])
            route_bytes = inc["rows"] * spec.row_nbytes
            table.append(
                [
                    name,
                    turns,
                    n,
                    inc["rows"],
                    full["rows"],
                    full["rows"] / inc["rows"],
                    (turns + 1) / 2,
                    inc["payload"] / 1e3,
                    full["payload"] / 1e3,
                    full["payload"] / inc["payload"],
                    inc["cpu"] * 1e3 / turns,
                    full["cpu"] * 1e3 / turns,
                    inc["cpu"] * 1e9 / route_bytes,
                ]
            )
    finally:
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait(timeout=30)
    return table


def part2(
    rows: int, layers: int, topk: int, experts: int, repeat: int
) -> tuple[list[list[Any]], float]:
    spec = r3arrow.RouteSpec(num_layers=layers, topk=topk, num_experts=experts)
    rng = np.random.default_rng(0)
    routes = random_routes(rng, rows, spec)  # valid: distinct experts per row (checked on decode)
    choice = {"index": 0, "finish_reason": "length", "token_ids": [1, 2, 3]}
    bodies = {
        "base64 .npy (vLLM)": orjson.dumps(
            {"choices": [{**choice, "routed_experts": encode_vllm(routes)}]}
        ),
        "nested JSON lists": orjson.dumps(
            {"choices": [{**choice, "routed_experts": routes.tolist()}]}
        ),
    }
    npy_body = bodies["base64 .npy (vLLM)"]

    def generic() -> np.ndarray:
        # the same payload through a plain JSON parse first (what a generic client does)
        return decode_routes(orjson.loads(npy_body)["choices"][0]["routed_experts"], spec)[0]

    cases: list[tuple[str, Callable[[], np.ndarray | None], int]] = [
        (
            "base64 .npy, r3arrow client",
            lambda: parse_response(npy_body, spec=spec).routes,
            len(npy_body),
        ),
        ("base64 .npy, generic JSON parse", generic, len(npy_body)),
        (
            "nested JSON lists",
            lambda: parse_response(bodies["nested JSON lists"], spec=spec).routes,
            len(bodies["nested JSON lists"]),
        ),
    ]
    nbytes = routes.nbytes
    copy = memcpy_gbps(nbytes)
    out = []
    base: float | None = None
    for name, fn, size in cases:
        got = fn()
        assert got is not None and np.array_equal(got, routes)
        cpu0 = time.process_time()
        wall = best_of(fn, repeat)
        cpu = (time.process_time() - cpu0) / (repeat + 1)
        base = wall if base is None else base
        out.append(
            [
                name,
                size / 1e6,
                wall * 1e3,
                cpu * 1e9 / nbytes,
                nbytes / wall / 1e9,
                copy / (nbytes / wall / 1e9),
                wall / base,
            ]
        )
    return out, copy


def main() -> None:
    ap = parser(__doc__ or "")
    args = ap.parse_args()
    if args.quick:
        scenarios = [("chat", 16, 8, 2, 6), ("agent (long prompt)", 64, 8, 2, 6)]
        p2 = (2048, 48, 8, 128, 3)
    else:
        scenarios = [("chat", 32, 32, 2, 6), ("agent (long prompt)", 256, 32, 2, 6)]
        p2 = (16384, 48, 8, 128, 5)
    print(f"# bench_multiturn ({'quick' if args.quick else 'full'})\n\n{machine_line()}\n")
    t0 = time.perf_counter()
    rows1 = part1(scenarios)
    print(
        f"## Route payload per conversation: incremental prompt starts vs full-prefix returns\n\n"
        f"engine: {ENGINE_CONFIG['num_layers']} layers x top-{ENGINE_CONFIG['topk']} "
        f"(row = {ENGINE_CONFIG['num_layers'] * ENGINE_CONFIG['topk']} B uint8), greedy, each turn "
        f"generates G tokens then appends O observation tokens; client CPU per captured route byte "
        f"(engine in a child process)\n"
    )
    print(
        markdown_table(
            rows1,
            [
                "scenario",
                "turns",
                "tokens",
                "rows incr",
                "rows full",
                "row ratio",
                "(T+1)/2",
                "kB incr",
                "kB full",
                "byte ratio",
                "client CPU ms/turn incr",
                "client CPU ms/turn full",
                "client ns/route B incr",
            ],
        )
    )
    r, L, K, E, rep = p2
    rows2, copy = part2(r, L, K, E, rep)
    print(
        f"\n## Client CPU per route byte: one response of {r} rows x {L} layers x top-{K} "
        f"({r * L * K / 1e6:.1f} MB of uint8 routes)\n\nmemcpy: {copy:.1f} GB/s\n"
    )
    print(
        markdown_table(
            rows2,
            [
                "routes as",
                "body MB",
                "parse ms",
                "CPU ns/route B",
                "GB/s of routes",
                "x memcpy time",
                "time vs r3arrow",
            ],
        )
    )
    print(
        f"\npeak RSS {peak_rss_mb():.0f} MB, Arrow pool peak {arrow_peak_mb():.1f} MB, "
        f"total {time.perf_counter() - t0:.1f} s"
    )


if __name__ == "__main__":
    main()
