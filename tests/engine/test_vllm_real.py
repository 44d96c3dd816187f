"""Integration test against a real vLLM server (marked ``vllm``; skipped unless configured).

Start a vLLM server with routed-expert capture (``--enable-return-routed-experts
--enable-scale-out``; see README, "Testing against a real vLLM"), then run
``R3ARROW_VLLM_URL=http://127.0.0.1:8021 pytest -m vllm tests/engine/test_vllm_real.py -s``.
Optional: ``R3ARROW_VLLM_VOCAB`` (default 512) bounds the token ids sent,
``R3ARROW_VLLM_NUM_EXPERTS`` (default: unknown, the trace widens as needed).
``R3ARROW_REQUIRE_VLLM=1`` (set by ``.ci/run``) makes a missing server a failure.
"""

from __future__ import annotations

import asyncio
import os
from typing import cast

import numpy as np
import pyarrow as pa
import pytest

import r3arrow
from r3arrow.capture import TurnStore
from r3arrow.client import EngineClient, RetryPolicy
from r3arrow.rollout import Trajectory, run_rollouts, run_trajectory
from r3arrow.spec import routes_to_numpy
from r3arrow.table import flat_routes, input_ids
from r3arrow.testing.rollout import ArithmeticEnv

URL = os.environ.get("R3ARROW_VLLM_URL")
VOCAB = int(os.environ.get("R3ARROW_VLLM_VOCAB", "512"))
NUM_EXPERTS = (
    int(os.environ["R3ARROW_VLLM_NUM_EXPERTS"])
    if os.environ.get("R3ARROW_VLLM_NUM_EXPERTS")
    else None
)

# Skipped without R3ARROW_VLLM_URL, a failure under R3ARROW_REQUIRE_VLLM=1 (tests/conftest.py).
pytestmark = pytest.mark.vllm

GREEDY = {"max_tokens": 6, "temperature": 0.0, "ignore_eos": True}


async def _probe_spec(url: str) -> r3arrow.RouteSpec:
    """The route shape the server reports, from one tiny request (prompt start 0)."""
    async with EngineClient(url, timeout=120, vocab_size=VOCAB) as client:
        return await client.probe_spec(num_experts=NUM_EXPERTS)


def topk_set_agreement(a: np.ndarray, b: np.ndarray) -> float:
    """Fraction of (token, layer) pairs whose top-k expert *sets* agree."""
    assert a.shape == b.shape
    return float(np.mean(np.all(np.sort(a, axis=-1) == np.sort(b, axis=-1), axis=-1)))


def test_multiturn_routes_match_full_prefix_request() -> None:
    assert URL is not None
    spec = asyncio.run(_probe_spec(URL))
    env = ArithmeticEnv(vocab_size=VOCAB, turns=6, observation_len=3)
    prompt = [(7 * i + 3) % VOCAB for i in range(20)]

    async def main() -> tuple[Trajectory, np.ndarray, np.ndarray]:
        store = TurnStore(spec)
        async with EngineClient(
            URL, spec, timeout=300, retry=RetryPolicy(max_retries=1), vocab_size=VOCAB
        ) as client:
            traj = await run_trajectory(
                client,
                env,
                prompt,
                trajectory_id="t0",
                store=store,
                max_turns=6,
                sampling_params=GREEDY,
            )
            conv_ids = traj.prompt_ids + traj.response_ids
            # One full-prefix request over the whole conversation: rows for all N tokens.
            full = await client.generate(
                conv_ids, sampling_params={**GREEDY, "max_tokens": 1}, prompt_start=0
            )
        assert full.routed_experts is not None
        routes = routes_to_numpy(store.routes(["t0"]).flatten(), store.spec)
        return traj, routes, np.asarray(full.routed_experts)

    traj, routes, full = asyncio.run(main())
    n = len(traj.prompt_ids) + len(traj.response_ids)
    assert traj.num_turns == 6 and traj.stop == "done"
    captured = 0
    for o in traj.outputs:  # prompt start honoured, P - start + G - 1 rows per turn
        assert o.prompt_start == captured
        assert o.num_route_rows == o.prompt_tokens - o.prompt_start + len(o.token_ids) - 1
        captured += o.num_route_rows
    assert captured == traj.num_routes == n - 1
    # finished trace: every token but the last sampled one has a row
    assert routes.shape == (n - 1, spec.num_layers, spec.topk)
    assert full.shape == (n, spec.num_layers, spec.topk)
    rate = topk_set_agreement(routes, full[: n - 1])
    exact = float(np.mean(np.all(routes == full[: n - 1], axis=-1)))
    print(
        f"\nvLLM multi-turn vs full-prefix: top-k set agreement {rate:.4%}, "
        f"exact order {exact:.4%} over {routes.shape[0]} tokens x {spec.num_layers} layers"
    )
    assert rate >= 0.99


def test_prompt_start_per_turn_and_row_counts() -> None:
    """Each turn sends prompt start = captured rows and gets P - start + G - 1 rows back."""
    assert URL is not None
    spec = asyncio.run(_probe_spec(URL))

    async def main() -> list[tuple[int, int, int, int, int]]:
        trace = r3arrow.RouteTrace(spec)
        conv = [(5 * i + 1) % VOCAB for i in range(16)]
        seen = []
        async with EngineClient(URL, spec, timeout=300) as client:
            for turn in range(3):
                before = trace.captured
                out = await client.generate(conv, sampling_params=GREEDY, trace=trace)
                seen.append(
                    (before, out.prompt_start, len(conv), len(out.token_ids), out.num_route_rows)
                )
                conv = conv + out.token_ids + [(turn * 31 + k) % VOCAB for k in range(2)]
        return seen

    seen = asyncio.run(main())
    captured = 0
    for before, start, p, g, rows in seen:
        assert before == captured == start
        assert rows == p - start + g - 1
        captured += rows


def test_completions_endpoint_with_token_prompts() -> None:
    assert URL is not None
    spec = asyncio.run(_probe_spec(URL))

    async def main() -> list[tuple[int, int, int, int]]:
        trace = r3arrow.RouteTrace(spec)
        conv = list(range(30, 42))
        seen = []
        async with EngineClient(URL, spec, endpoint="completions", timeout=300) as client:
            for _ in range(2):
                out = await client.generate(conv, sampling_params=GREEDY, trace=trace)
                seen.append((out.prompt_start, len(conv), len(out.token_ids), out.num_route_rows))
                conv = conv + out.token_ids + [1, 2]
        return seen

    (s0, p0, g0, r0), (s1, p1, g1, r1) = asyncio.run(main())
    assert (s0, r0) == (0, p0 + g0 - 1)
    assert s1 == r0 and r1 == p1 - s1 + g1 - 1


def test_sampled_rollouts_agree_with_full_prefix_requests() -> None:
    """Concurrent sampled multi-turn rollouts: each row's routes vs one full-prefix request."""
    assert URL is not None
    spec = asyncio.run(_probe_spec(URL))
    env = ArithmeticEnv(vocab_size=VOCAB, turns=3, observation_len=4)
    prompts = [[(11 * i + 2) % VOCAB for i in range(12)], [(3 * i + 50) % VOCAB for i in range(9)]]

    async def main() -> tuple[pa.Table, list[np.ndarray]]:
        async with EngineClient(
            URL, spec, timeout=300, retry=RetryPolicy(max_retries=1), vocab_size=VOCAB
        ) as client:
            table = await run_rollouts(
                client,
                env,
                prompts,
                group_size=2,
                max_turns=3,
                seed=5,
                sampling_params={"max_tokens": 5, "temperature": 1.0, "ignore_eos": True},
            )
            convs = cast("list[list[int]]", input_ids(table).to_pylist())  # type: ignore[misc]
            fulls = await asyncio.gather(
                *(
                    client.generate(ids, sampling_params={**GREEDY, "max_tokens": 1})
                    for ids in convs
                )
            )
        return table, [np.asarray(f.routed_experts) for f in fulls]

    table, fulls = asyncio.run(main())
    r3arrow.validate_rollouts(table)
    values, offsets = flat_routes(table)
    captured = np.concatenate([values[offsets[i] : offsets[i + 1]] for i in range(table.num_rows)])
    reference = np.concatenate([f[: offsets[i + 1] - offsets[i]] for i, f in enumerate(fulls)])
    rate = topk_set_agreement(captured, reference)
    print(
        f"\nvLLM sampled rollouts ({table.num_rows} trajectories) vs full-prefix: "
        f"top-k set agreement {rate:.4%} over {captured.shape[0]} tokens"
    )
    assert rate >= 0.99
