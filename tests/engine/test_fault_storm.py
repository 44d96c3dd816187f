"""Fault storm: 64 concurrent conversations against the embedded engine over real HTTP.

Run once per wire protocol (vLLM's ``/inference/v1/generate``, SGLang's ``/generate``): the
faults apply to both, corrupt payloads in each protocol's own encoding.

One `FaultPlan` mixes transient faults (5xx, 429, dropped connections, delays: retried)
with corrupt payloads (malformed payloads, short/extra rows, duplicate experts, a zeroed
router layer: data errors, never retried; the zeroed layer is the route-quality guard's),
and some conversations re-tokenize their history before the second turn (prefix drift,
refused before sending). Every conversation
captures through one `TurnStore`. Afterwards:

* every conversation that completed holds exactly the engine's own routing of its whole
  conversation in the store: no row lost, none recorded twice;
* every corrupt payload failed exactly one request, with a data error, and was not retried;
  every drift was refused with `PrefixMismatchError` before anything was sent;
* a failed request left its trace and the store as they were.

The transient faults number fewer than ``max_retries``, so no request can exhaust its
retries whichever requests the faults land on (the plan is consumed in arrival order).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from typing import Any

import numpy as np
import pytest

from r3arrow import TurnStore
from r3arrow.client import EngineClient, Protocol, RetryPolicy
from r3arrow.errors import (
    DuplicateExpertError,
    ExpertRangeError,
    PayloadError,
    PrefixMismatchError,
    R3ArrowError,
    RouteDTypeError,
    RouteQualityError,
    RouteShapeError,
)
from r3arrow.spec import routes_to_numpy
from r3arrow.testing.engine import (
    EngineServer,
    Fault,
    FaultPlan,
    ReferenceEngine,
    TinyMoEConfig,
    drift_prompt,
)
from r3arrow.testing.engine.faults import MALFORMED_MODES

GEN = {"vllm": "/inference/v1/generate", "sglang": "/generate"}
CONVERSATIONS = 64
DRIFTING = 8  # conversations whose second-turn prompt is re-tokenized
SP: dict[str, dict[str, Any]] = {
    "vllm": {"max_tokens": 2, "temperature": 0.0, "ignore_eos": True},
    "sglang": {"max_new_tokens": 2, "temperature": 0.0, "ignore_eos": True},
}

TRANSIENT = [
    *[Fault.status(503)] * 6,
    *[Fault.status(500)] * 4,
    *[Fault.status(429, retry_after=0)] * 3,
    *[Fault.drop_connection()] * 6,
    *[Fault.delay(0.02)] * 5,
]
CORRUPT = [
    *[Fault.malformed_routes(m) for m in MALFORMED_MODES],
    Fault.short_routes(1),
    Fault.short_routes(3),
    Fault.extra_routes(1),
    Fault.extra_routes(2),
    *[Fault.duplicate_experts()] * 3,
    Fault.duplicate_experts(layer=3),
    *[Fault.zero_router_layer()] * 2,
]
#: What each corrupt fault must surface as (all data errors: R3ArrowError, never retried).
#: SGLang's raw int32 has no dtype header: float bits arrive as ids out of range.
EXPECTED_ERROR: dict[str, tuple[type[R3ArrowError], ...]] = {
    "malformed_routes": (PayloadError, RouteShapeError, RouteDTypeError, ExpertRangeError),
    "short_routes": (RouteShapeError,),
    "extra_routes": (RouteShapeError,),
    "duplicate_experts": (DuplicateExpertError,),
    "zero_router_layer": (RouteQualityError,),  # the guard's: a known engine bug
}


@pytest.fixture(scope="module")
def engine() -> ReferenceEngine:
    return ReferenceEngine(TinyMoEConfig(seed=11))


async def converse(
    client: EngineClient,
    store: TurnStore,
    k: int,
    prompt: list[int],
    drift: bool,
    vocab: int,
    sampling: dict[str, Any],
) -> dict[str, Any]:
    """Two turns; stops at the first error. Returns what happened, for the checks."""
    trace = store.trace(f"c{k}")
    conv = list(prompt)
    result: dict[str, Any] = {"id": f"c{k}", "trace": trace, "error": None, "turn": 0}
    for turn in range(2):
        if turn == 1:
            conv += [(conv[-1] * 7 + 3) % vocab]  # an observation token
            if drift:  # the chat template re-tokenized a generated token of turn 1
                conv = drift_prompt(conv, len(prompt) + 1, vocab)
        before = (trace.captured, trace.num_turns, trace.covered_digest)
        try:
            out = await client.generate(conv, sampling_params=sampling, trace=trace)
        except R3ArrowError as exc:
            result.update(error=exc, turn=turn)
            result["unchanged"] = before == (
                trace.captured,
                trace.num_turns,
                trace.covered_digest,
            )
            return result
        conv += out.token_ids
    result["conv"] = conv
    return result


@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
def test_fault_storm_loses_no_row_and_rejects_every_corrupt_payload(
    engine: ReferenceEngine, protocol: Protocol
) -> None:
    rng = random.Random(5)
    faults = TRANSIENT + CORRUPT
    rng.shuffle(faults)
    plan = FaultPlan()
    for fault in faults:
        plan.then(fault)
    vocab = engine.config.vocab_size
    spec = engine.config.route_spec()
    store = TurnStore(spec)
    gen = np.random.default_rng(5)
    prompts = [
        gen.integers(1, vocab, size=int(gen.integers(6, 14))).tolist() for _ in range(CONVERSATIONS)
    ]
    drifting = set(rng.sample(range(CONVERSATIONS), DRIFTING))

    async def storm(url: str) -> tuple[list[dict[str, Any]], dict[str, int]]:
        async with EngineClient(
            url,
            spec,
            protocol=protocol,
            max_concurrency=CONVERSATIONS,
            # more retries than all transient faults together
            retry=RetryPolicy(
                max_retries=len(TRANSIENT), backoff_base=0.001, backoff_max=0.005, seed=5
            ),
            timeout=30.0,
        ) as client:
            results = await asyncio.gather(
                *(
                    converse(client, store, k, p, k in drifting, vocab, SP[protocol])
                    for k, p in enumerate(prompts)
                )
            )
            return list(results), dict(client.stats)

    t0 = time.perf_counter()
    with EngineServer(engine, faults=plan) as server:
        results, stats = asyncio.run(storm(server.url))
    elapsed = time.perf_counter() - t0

    assert plan.pending == 0  # every queued fault hit a request
    injected: Counter[str] = Counter(f.kind for _, f in plan.injected)
    n_corrupt = sum(injected[kind] for kind in EXPECTED_ERROR)
    assert n_corrupt == len(CORRUPT)

    failed = [r for r in results if r["error"] is not None]
    drifted = [r for r in failed if isinstance(r["error"], PrefixMismatchError)]
    data = [r for r in failed if not isinstance(r["error"], PrefixMismatchError)]
    # a failed request changed nothing, and nothing else failed: transient faults all recovered
    assert all(r["unchanged"] for r in failed)
    # every corrupt payload: exactly one failed request, a data error of the expected kind
    assert len(data) == len(CORRUPT) == stats["data_errors"]
    allowed = tuple(t for types in EXPECTED_ERROR.values() for t in types)
    assert all(isinstance(r["error"], allowed) for r in data), [r["error"] for r in data]
    duplicates = sum(isinstance(r["error"], DuplicateExpertError) for r in data)
    assert duplicates == injected["duplicate_experts"]
    quality = sum(isinstance(r["error"], RouteQualityError) for r in data)
    assert quality == injected["zero_router_layer"]
    assert all(r["error"].trajectory_id == r["id"] for r in data)
    # drift: refused before sending, naming the first re-tokenized position
    for r in drifted:
        k = int(r["id"][1:])
        assert k in drifting and r["turn"] == 1
        assert r["error"].token == len(prompts[k]) + 1
    drifting_alive = {int(r["id"][1:]) for r in results if r["turn"] == 1 or "conv" in r}
    assert {int(r["id"][1:]) for r in drifted} == drifting & drifting_alive
    assert stats["prefix_mismatches"] == len(drifted)
    # requests: one per attempted turn, plus one per retried transient fault; data errors and
    # drifts were not retried
    attempted = sum(2 if "conv" in r else r["turn"] + 1 for r in results) - len(drifted)
    retried = sum(injected[k] for k in ("status", "drop_connection"))
    assert stats["retries"] == retried
    assert plan.seen(GEN[protocol]) == stats["requests"] == attempted + retried

    # completed conversations: the store holds exactly the engine's routing, once
    done = [r for r in results if "conv" in r]
    assert len(done) >= CONVERSATIONS - len(CORRUPT) - DRIFTING
    col = store.routes([r["id"] for r in done])  # raises on any gap, overlap or repeat
    offsets = np.asarray(col.offsets)
    rows = routes_to_numpy(col.flatten(), store.spec)
    for i, r in enumerate(done):
        conv = r["conv"]
        assert r["trace"].captured == len(conv) - 1
        assert r["trace"].covered_tokens.tolist() == conv
        np.testing.assert_array_equal(
            rows[offsets[i] : offsets[i + 1]], engine.routes_for(conv)[: len(conv) - 1]
        )
    # failed conversations keep only their earlier, good turns
    for r in failed:
        assert r["trace"].num_turns == r["turn"]
    assert store.num_turns == sum(r["trace"].num_turns for r in results)
    assert elapsed < 30  # ~1-3 s on 2 shared cores; the bound only catches a hang
