"""EngineClient against the embedded reference engine over real HTTP on 127.0.0.1.

Every test talks to a real `EngineServer` (threaded HTTP server, vLLM's schema) through
httpx; faults are injected server-side with `FaultPlan`. The retry policy, the wire
protocol and the checks on bad responses are tested in milliseconds on
`httpx.MockTransport` in test_client_protocol.py; this file keeps what needs real sockets,
the real model and real timeouts.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import numpy as np
import pytest

import r3arrow
from r3arrow.client import EngineClient, GenerateOutput, RetryPolicy
from r3arrow.errors import (
    EngineError,
    EngineHTTPError,
    PayloadError,
    R3ArrowError,
    RouteShapeError,
)
from r3arrow.spec import routes_to_numpy
from r3arrow.testing.engine import EngineServer, Fault, FaultPlan, ReferenceEngine, TinyMoEConfig

GEN = "/inference/v1/generate"
COMP = "/v1/completions"
SP = {"max_tokens": 3, "temperature": 0.0}


@pytest.fixture(scope="module")
def engine() -> ReferenceEngine:
    return ReferenceEngine(TinyMoEConfig(seed=7))


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def trace_rows(trace: r3arrow.RouteTrace, num_tokens: int) -> np.ndarray:
    """The trace's captured rows as numpy (finalizes it; the mask trains nothing)."""
    arr = trace.finalize(num_tokens=num_tokens, loss_mask=np.zeros(num_tokens, np.uint8))
    return routes_to_numpy(arr, trace.spec)


def snapshot(trace: r3arrow.RouteTrace) -> tuple[int, int, int]:
    return trace.captured, trace.seen_tokens, trace.num_turns


async def conversation(
    client: EngineClient,
    trace: r3arrow.RouteTrace,
    prompt: list[int],
    turns: int,
    obs: int = 2,
    **kw: Any,
) -> tuple[list[int], list[GenerateOutput]]:
    """Grow a conversation: generate, then append ``obs`` observation tokens, ``turns`` times."""
    conv = list(prompt)
    outs = []
    for t in range(turns):
        out = await client.generate(conv, sampling_params=SP, trace=trace, **kw)
        outs.append(out)
        conv += out.token_ids
        if t + 1 < turns:
            conv += [(conv[-1] * 7 + k + 1) % 512 for k in range(obs)]
    return conv, outs


# --------------------------------------------------------------------- semantics
def test_three_turns_send_captured_as_prompt_start_and_match_engine_routing(
    engine: ReferenceEngine, server: EngineServer
) -> None:
    spec = engine.spec
    trace = r3arrow.RouteTrace(spec)

    async def main() -> tuple[list[int], list[GenerateOutput]]:
        async with r3arrow.EngineClient(server.url, spec) as client:
            return await conversation(client, trace, list(range(3, 14)), turns=3)

    conv, outs = run(main())
    starts = [b["sampling_params"]["routed_experts_prompt_start"] for b in server.log.bodies(GEN)]
    # prompt 11, G=3 each, 2 observation tokens: rows 11+3-1=13, then (16+3-1-13)=5, then 5
    assert starts == [0, 13, 18]
    assert [o.prompt_start for o in outs] == starts
    assert [o.num_route_rows for o in outs] == [13, 5, 5]
    assert [o.token_start for o in outs] == [0, 13, 18]
    assert [len(b["token_ids"]) for b in server.log.bodies(GEN)] == [11, 16, 21]
    assert all(o.finish_reason == "length" and len(o.token_ids) == 3 for o in outs)
    assert trace.captured == len(conv) - 1 == 23
    # the finished routes are the engine's own routing of the whole conversation
    np.testing.assert_array_equal(
        trace_rows(trace, len(conv)), engine.routes_for(conv)[: len(conv) - 1]
    )


def test_routed_experts_of_each_turn_are_the_new_rows(
    engine: ReferenceEngine, server: EngineServer
) -> None:
    trace = r3arrow.RouteTrace(engine.spec)

    async def main() -> tuple[list[int], list[GenerateOutput]]:
        async with EngineClient(server.url, engine.spec) as client:
            return await conversation(client, trace, [9, 8, 7, 6], turns=2, obs=4)

    conv, outs = run(main())
    full = engine.routes_for(conv)
    for o in outs:
        assert o.routed_experts is not None and not o.routed_experts.flags.writeable
        np.testing.assert_array_equal(
            o.routed_experts, full[o.prompt_start : o.prompt_start + o.num_route_rows]
        )
        assert o.payload_bytes > o.num_route_rows * engine.spec.row_nbytes  # base64 + .npy header
        assert o.response_bytes > o.payload_bytes


def test_probe_spec_reads_the_route_shape_and_the_dense_layers(
    engine: ReferenceEngine, plan: FaultPlan, server: EngineServer
) -> None:
    async def main(**kw: Any) -> r3arrow.RouteSpec:
        async with EngineClient(server.url) as client:
            return await client.probe_spec(num_experts=8, **kw)

    # layer 0 is dense (zeros in the probe): the engine's own spec, moe_layers included
    spec = run(main())
    assert spec == engine.config.route_spec()
    assert spec == r3arrow.RouteSpec(num_layers=4, topk=2, num_experts=8, moe_layers=(1, 2, 3))
    assert run(main(infer_dense=False)) == r3arrow.RouteSpec(num_layers=4, topk=2, num_experts=8)
    # an engine whose router layer answers zeros is taken at its word (a guard is elsewhere)
    plan.then(Fault.zero_router_layer())
    assert run(main()).moe_layers == (2, 3)
    plan.then(Fault.no_routes())
    with pytest.raises(EngineError, match="no routed_experts"):
        run(main())


def test_without_trace_prompt_start_is_sent_as_given(
    engine: ReferenceEngine, server: EngineServer
) -> None:
    prompt = list(range(20, 32))

    async def main() -> GenerateOutput:
        async with EngineClient(server.url, engine.spec) as client:
            return await client.generate(prompt, sampling_params=SP, prompt_start=5)

    out = run(main())
    assert server.log.bodies(GEN)[0]["sampling_params"]["routed_experts_prompt_start"] == 5
    assert out.num_route_rows == 12 - 5 + 3 - 1 and out.token_start is None
    full = engine.routes_for(prompt + out.token_ids)
    np.testing.assert_array_equal(out.routed_experts, full[5 : 12 + 3 - 1])


def test_completions_endpoint_with_token_prompts(
    engine: ReferenceEngine, server: EngineServer
) -> None:
    trace = r3arrow.RouteTrace(engine.spec)

    async def main() -> tuple[list[int], list[GenerateOutput]]:
        async with EngineClient(
            server.url, engine.spec, endpoint="completions", model="r3arrow-tiny-moe"
        ) as client:
            return await conversation(client, trace, list(range(40, 50)), turns=2)

    conv, outs = run(main())
    bodies = server.log.bodies(COMP)
    assert [b["routed_experts_prompt_start"] for b in bodies] == [0, outs[0].num_route_rows]
    assert all(b["return_token_ids"] is True and b["model"] == "r3arrow-tiny-moe" for b in bodies)
    assert bodies[1]["prompt"] == conv[: len(bodies[1]["prompt"])]
    np.testing.assert_array_equal(trace_rows(trace, len(conv)), engine.routes_for(conv)[:-1])


def test_logprobs_cache_salt_and_model_pass_through(
    engine: ReferenceEngine, server: EngineServer
) -> None:
    async def main() -> GenerateOutput:
        async with EngineClient(server.url, engine.spec, cache_salt="salt-A") as client:
            return await client.generate([1, 2, 3], sampling_params={**SP, "logprobs": 0})

    out = run(main())
    body = server.log.bodies(GEN)[0]
    assert body["cache_salt"] == "salt-A" and "model" not in body
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    assert all(lp <= 0 for lp in out.logprobs)


def test_concurrent_conversations_do_not_mix(engine: ReferenceEngine, server: EngineServer) -> None:
    n = 64
    traces = [r3arrow.RouteTrace(engine.spec) for _ in range(n)]
    prompts = [[(i * 13 + k) % 512 for k in range(5 + i % 7)] for i in range(n)]

    async def main() -> list[tuple[list[int], list[GenerateOutput]]]:
        async with EngineClient(server.url, engine.spec, max_concurrency=n) as client:
            return await asyncio.gather(
                *(conversation(client, t, p, turns=2) for t, p in zip(traces, prompts, strict=True))
            )

    results = run(main())
    assert server.log.count(GEN) == 2 * n
    for (conv, _), trace, prompt in zip(results, traces, prompts, strict=True):
        assert conv[: len(prompt)] == prompt
        np.testing.assert_array_equal(trace_rows(trace, len(conv)), engine.routes_for(conv)[:-1])


# ------------------------------------------------------------------------ faults
def test_server_faults_are_retried_and_recorded_once(
    engine: ReferenceEngine, plan: FaultPlan, server: EngineServer
) -> None:
    plan.then(Fault.status(503)).then(Fault.drop_connection())
    trace = r3arrow.RouteTrace(engine.spec)

    async def main() -> tuple[GenerateOutput, dict[str, int]]:
        async with EngineClient(
            server.url, engine.spec, retry=RetryPolicy(backoff_base=0.01, max_retries=3)
        ) as client:
            out = await client.generate(list(range(1, 9)), sampling_params=SP, trace=trace)
            return out, client.stats

    out, stats = run(main())
    assert server.log.count(GEN) == 3 and out.attempts == 3
    assert stats["retries"] == 2 and stats["recorded"] == 1
    assert trace.num_turns == 1 and trace.captured == 8 + 3 - 1
    conv = list(range(1, 9)) + out.token_ids
    np.testing.assert_array_equal(trace_rows(trace, len(conv)), engine.routes_for(conv)[:-1])


def test_engine_rejection_message_reaches_the_caller(
    engine: ReferenceEngine, server: EngineServer
) -> None:
    async def main() -> None:
        async with EngineClient(
            server.url, engine.spec, retry=RetryPolicy(max_retries=3)
        ) as client:
            await client.generate([1, 2, 3], sampling_params={"max_tokens": 10**6})

    with pytest.raises(
        EngineHTTPError, match=r"HTTP 400: max_tokens=1000000 cannot be greater"
    ) as info:
        run(main())
    assert info.value.status == 400 and server.log.count(GEN) == 1


def test_malformed_payload_fails_that_request_and_leaves_trace(
    engine: ReferenceEngine, plan: FaultPlan, server: EngineServer
) -> None:
    """Over real HTTP; every corruption mode is covered on MockTransport."""
    trace = r3arrow.RouteTrace(engine.spec)
    prompt = list(range(2, 12))

    async def main() -> tuple[R3ArrowError, tuple[int, int, int], list[int]]:
        async with EngineClient(
            server.url, engine.spec, retry=RetryPolicy(backoff_base=0.01)
        ) as client:
            first = await client.generate(prompt, sampling_params=SP, trace=trace)
            conv = prompt + first.token_ids + [1, 2]
            before = snapshot(trace)
            plan.then(Fault.malformed_routes("truncated"))
            with pytest.raises(R3ArrowError) as info:
                await client.generate(conv, sampling_params=SP, trace=trace)
            after = snapshot(trace)
            assert before == after
            # the trace is still usable: the same turn succeeds without the fault
            again = await client.generate(conv, sampling_params=SP, trace=trace)
            return info.value, before, conv + again.token_ids

    err, _, conv = run(main())
    assert isinstance(err, PayloadError | RouteShapeError | r3arrow.errors.RouteDTypeError)
    assert "routed_experts" in str(err)
    assert server.log.count(GEN) == 3  # never retried
    np.testing.assert_array_equal(trace_rows(trace, len(conv)), engine.routes_for(conv)[:-1])


def test_timeout_is_honoured_and_not_retried(
    engine: ReferenceEngine, plan: FaultPlan, server: EngineServer
) -> None:
    plan.then(Fault.delay(3.0))
    trace = r3arrow.RouteTrace(engine.spec)

    async def main() -> float:
        async with EngineClient(
            server.url, engine.spec, timeout=0.3, retry=RetryPolicy(max_retries=3)
        ) as client:
            t0 = time.perf_counter()
            with pytest.raises(EngineHTTPError, match="timed out"):
                await client.generate([1, 2, 3], sampling_params=SP, trace=trace)
            return time.perf_counter() - t0

    assert run(main()) < 2.0
    assert server.log.count(GEN) == 1 and snapshot(trace) == (0, 0, 0)


# ------------------------------------------------------------------ sticky routing
def test_sessions_stick_to_one_server_and_fail_over(engine: ReferenceEngine) -> None:
    with EngineServer(engine) as a, EngineServer(engine) as b:
        urls = [a.url, b.url]
        client = EngineClient(urls, engine.spec)
        homes = {f"s{i}": client.urls_for(f"s{i}")[0] for i in range(32)}
        assert set(homes.values()) == set(urls)  # sessions spread over both servers
        again = EngineClient(list(reversed(urls)), engine.spec)
        assert all(again.urls_for(s)[0] == u for s, u in homes.items())  # stable, order-independent
        run(client.aclose())
        run(again.aclose())
        on_b = [s for s, u in homes.items() if u == b.url][:3]
        trace = r3arrow.RouteTrace(engine.spec)

        async def turns(client: EngineClient, session: str, n: int) -> None:
            conv = [3, 1, 4, 1, 5]
            for _ in range(n):
                out = await client.generate(
                    conv, sampling_params=SP, trace=trace, session_id=session
                )
                conv = conv + out.token_ids + [2]

        async def main() -> None:
            async with EngineClient(urls, engine.spec) as client:
                await turns(client, on_b[0], 3)
                # one conversation, three turns, all on its home server
                assert (a.log.count(GEN), b.log.count(GEN)) == (0, 3)
                # traces without an explicit session id stick too; plain requests go round robin
                t2 = r3arrow.RouteTrace(engine.spec)
                conv2 = [7, 7, 7, 7]
                traced, plain = set(), []
                for _ in range(3):
                    out = await client.generate(conv2, sampling_params={"max_tokens": 1}, trace=t2)
                    traced.add(out.base_url)
                    conv2 += [*out.token_ids, 2]
                    plain.append(
                        (await client.generate([7, 7], sampling_params={"max_tokens": 1})).base_url
                    )
                assert len(traced) == 1
                assert set(plain) == set(urls) and plain[0] != plain[1]

        run(main())
        b.stop()  # home server of on_b sessions goes away: fail over to the other one

        async def failover() -> GenerateOutput:
            async with EngineClient(
                urls, engine.spec, retry=RetryPolicy(backoff_base=0.01)
            ) as client:
                return await client.generate([1, 2, 3], sampling_params=SP, session_id=on_b[1])

        out = run(failover())
        assert out.base_url == a.url and out.attempts == 2


def test_unreachable_server_raises_after_retries(engine: ReferenceEngine) -> None:
    with EngineServer(engine) as srv:
        url = srv.url
    trace = r3arrow.RouteTrace(engine.spec)

    async def main() -> None:
        async with EngineClient(
            url, engine.spec, retry=RetryPolicy(backoff_base=0.001, max_retries=2)
        ) as client:
            await client.generate([1, 2, 3], sampling_params=SP, trace=trace)

    with pytest.raises(EngineHTTPError, match=r"after 3 attempts.*ConnectError") as info:
        run(main())
    assert info.value.status is None and snapshot(trace) == (0, 0, 0)
