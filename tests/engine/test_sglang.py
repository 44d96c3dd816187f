"""SGLang's ``/generate`` on the embedded engine over real HTTP, and EngineClient on both protocols.

The server half checks the endpoint against what SGLang 0.5.23's source accepts and answers
(``docs/sglang.md``): request fields, the contract and ``ValueError`` error JSON, the response
JSON, ``routed_experts`` only when asked, the ``routed_experts_start_len`` rule. The client half
runs the same conversation, faults and bad payloads through both protocols against one
`EngineServer` (it serves vLLM's and SGLang's paths together) and checks that both capture the
engine's own routing. MockTransport versions of the protocol-independent tests:
test_sglang_protocol.py.
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import r3arrow
from r3arrow.client import EngineClient, GenerateOutput, Protocol, RetryPolicy
from r3arrow.client import _sglang as sglang_proto
from r3arrow.codec import decode_sglang
from r3arrow.errors import EngineHTTPError, R3ArrowError, RouteShapeError
from r3arrow.spec import routes_to_numpy
from r3arrow.testing.engine import EngineServer, Fault, FaultPlan, ReferenceEngine, TinyMoEConfig
from r3arrow.testing.engine._sglang import SAMPLING_FIELDS

GEN = "/generate"
PROTOCOLS: tuple[Protocol, ...] = ("vllm", "sglang")


@pytest.fixture(scope="module")
def engine() -> ReferenceEngine:
    return ReferenceEngine(TinyMoEConfig(seed=11, eos_token_id=None))


def post(server: EngineServer, body: Any) -> httpx.Response:
    return httpx.post(server.url + GEN, json=body, timeout=30)


def sp(protocol: Protocol, tokens: int = 3) -> dict[str, Any]:
    key = "max_tokens" if protocol == "vllm" else "max_new_tokens"
    return {key: tokens, "temperature": 0.0}


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def trace_rows(trace: r3arrow.RouteTrace, num_tokens: int) -> np.ndarray:
    arr = trace.finalize(num_tokens=num_tokens, loss_mask=np.zeros(num_tokens, np.uint8))
    return routes_to_numpy(arr, trace.spec)


# ------------------------------------------------------------------ the endpoint
def test_response_fields_and_rows_follow_sglang(
    engine: ReferenceEngine, server: EngineServer
) -> None:
    prompt = [3, 1, 4, 1, 5, 9]
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": 4, "temperature": 0},
        "return_routed_experts": True,
        "routed_experts_start_len": 2,
        "rid": "req-1",
    }
    resp = post(server, body)
    assert resp.status_code == 200, resp.text
    obj = resp.json()
    assert list(obj) == ["output_ids", "meta_info"]  # --skip-tokenizer-init: no "text"
    meta = obj["meta_info"]
    assert list(meta)[:3] == ["id", "finish_reason", "prompt_tokens"]
    assert meta["id"] == "req-1" and meta["prompt_tokens"] == 6
    assert meta["completion_tokens"] == 4 and len(obj["output_ids"]) == 4
    assert meta["finish_reason"] == {"type": "length", "length": 4}
    # rows [start, seqlen - 1): P - start + G - 1
    rows = decode_sglang(meta["routed_experts"], engine.spec)
    assert rows.dtype == np.int32 and rows.shape == (6 - 2 + 4 - 1, *engine.spec.row_shape)
    full = engine.routes_for(prompt + obj["output_ids"])
    np.testing.assert_array_equal(rows, full[2 : 6 + 4 - 1])


def test_routes_only_when_asked_and_start_ignored_otherwise(server: EngineServer) -> None:
    body = {"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}}
    meta = post(server, body).json()["meta_info"]
    assert "routed_experts" not in meta
    # without return_routed_experts SGLang does not check routed_experts_start_len
    meta = post(server, {**body, "routed_experts_start_len": 99}).json()["meta_info"]
    assert "routed_experts" not in meta


@pytest.mark.parametrize("start", [0, 3])
def test_start_len_may_equal_the_prompt_length(
    engine: ReferenceEngine, server: EngineServer, start: int
) -> None:
    body = {
        "input_ids": [7, 8, 9],
        "sampling_params": {"max_new_tokens": 3, "temperature": 0},
        "return_routed_experts": True,
        "routed_experts_start_len": start,
    }
    meta = post(server, body).json()["meta_info"]
    assert decode_sglang(meta["routed_experts"], engine.spec).shape[0] == 3 - start + 3 - 1


@pytest.mark.parametrize(
    ("start", "message"),
    [
        (4, "recv_req.routed_experts_start_len=4 is higher than the number of input tokens "
         "len(req.origin_input_ids)=3. Please use a smaller routed_experts_start_len."),
        (-1, "recv_req.routed_experts_start_len=-1 is lower than 0. "
         "Please use a non-negative routed_experts_start_len."),
    ],
)  # fmt: skip
def test_start_len_outside_the_prompt_is_a_400(
    server: EngineServer, start: int, message: str
) -> None:
    body = {
        "input_ids": [1, 2, 3],
        "return_routed_experts": True,
        "routed_experts_start_len": start,
    }
    resp = post(server, body)
    assert resp.status_code == 400 and resp.json() == {"error": {"message": message}}


def test_contract_errors_are_400_with_a_string(server: EngineServer) -> None:
    resp = post(server, {"input_ids": [1, 2], "sampling_params": {"max_tokens": 3}})
    assert resp.status_code == 400
    err = resp.json()["error"]
    assert isinstance(err, str)
    fields = ", ".join(f"`{f}`" for f in SAMPLING_FIELDS)
    assert err == f"unknown field `max_tokens`, expected one of {fields}"
    resp = post(server, {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": "3"}})
    assert resp.json() == {"error": 'invalid type: string "3", expected i64'}
    resp = post(server, {"input_ids": [1, True]})
    assert resp.json() == {"error": "invalid type: boolean `true`, expected i64"}
    resp = post(server, [1, 2])
    assert resp.json() == {"error": "invalid type: sequence, expected struct GenerateRequest"}


def test_value_errors_are_400_with_a_message(server: EngineServer, engine: ReferenceEngine) -> None:
    resp = post(server, {"sampling_params": {"max_new_tokens": 2}})
    assert resp.status_code == 400
    assert resp.json() == {
        "error": {"message": "Either text, input_ids or input_embeds should be provided."}
    }
    limit = engine.config.max_model_len
    resp = post(server, {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": limit}})
    assert resp.status_code == 400
    assert resp.json()["error"]["message"].startswith(
        f"Requested token count exceeds the model's maximum context length of {limit} tokens. "
        f"You requested a total of {limit + 2} tokens: 2 tokens from the input messages"
    )
    resp = post(server, {"input_ids": [engine.config.vocab_size]})
    vocab = engine.config.vocab_size
    assert resp.status_code == 400
    assert f"expected token ids in [0, {vocab})" in resp.json()["error"]["message"]


def test_stop_token_and_n(server: EngineServer, engine: ReferenceEngine) -> None:
    greedy = {"max_new_tokens": 1, "temperature": 0}  # SGLang's default temperature is 1.0
    first = post(server, {"input_ids": [5, 6], "sampling_params": greedy}).json()
    stop = first["output_ids"][0]
    body = {
        "input_ids": [5, 6],
        "sampling_params": {"max_new_tokens": 5, "temperature": 0, "stop_token_ids": [stop]},
    }
    obj = post(server, body).json()
    assert obj["output_ids"] == [stop]
    assert obj["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    many = post(server, {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2, "n": 3}})
    assert isinstance(many.json(), list) and len(many.json()) == 3


def test_status_fault_answers_in_sglang_shape(server: EngineServer, plan: FaultPlan) -> None:
    plan.then(Fault.status(503, retry_after=1))
    resp = post(server, {"input_ids": [1, 2]})
    assert resp.status_code == 503 and resp.headers["retry-after"] == "1"
    assert resp.json() == {"error": {"message": "injected fault: HTTP 503"}}
    assert plan.seen(GEN) == 1


# ----------------------------------------------------------- the client, both protocols
@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_conversation_captures_the_engine_routing(
    engine: ReferenceEngine, server: EngineServer, protocol: Protocol
) -> None:
    trace = r3arrow.RouteTrace(engine.spec)

    async def main() -> tuple[list[int], list[GenerateOutput]]:
        conv = list(range(3, 14))
        outs = []
        async with EngineClient(server.url, engine.spec, protocol=protocol) as client:
            for turn in range(3):
                out = await client.generate(conv, sampling_params=sp(protocol), trace=trace)
                outs.append(out)
                conv += out.token_ids + ([11, 12] if turn < 2 else [])
        return conv, outs

    conv, outs = run(main())
    assert [o.prompt_start for o in outs] == [0, 13, 18]
    assert [o.num_route_rows for o in outs] == [13, 5, 5]
    assert all(o.finish_reason == "length" for o in outs)
    np.testing.assert_array_equal(
        trace_rows(trace, len(conv)), engine.routes_for(conv)[: len(conv) - 1]
    )


def test_both_protocols_capture_identical_routes(
    engine: ReferenceEngine, server: EngineServer
) -> None:
    async def capture(protocol: Protocol) -> tuple[list[int], np.ndarray]:
        trace = r3arrow.RouteTrace(engine.spec)
        async with EngineClient(server.url, engine.spec, protocol=protocol) as client:
            out = await client.generate(
                [9, 8, 7, 6, 5], sampling_params=sp(protocol, 4), trace=trace
            )
        conv = [9, 8, 7, 6, 5, *out.token_ids]
        return out.token_ids, trace_rows(trace, len(conv))

    vllm, sglang = run(capture("vllm")), run(capture("sglang"))
    assert vllm[0] == sglang[0]
    np.testing.assert_array_equal(vllm[1], sglang[1])


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_probe_spec(engine: ReferenceEngine, server: EngineServer, protocol: Protocol) -> None:
    c = engine.config

    async def main() -> Any:
        async with EngineClient(server.url, protocol=protocol) as client:
            sglang = protocol == "sglang"
            return await client.probe_spec(
                num_experts=c.num_experts,
                num_layers=c.num_layers if sglang else None,
                topk=c.topk if sglang else None,
            )

    assert run(main()) == engine.spec


def test_sglang_probe_needs_the_row_shape(server: EngineServer) -> None:
    async def main() -> None:
        async with EngineClient(server.url, protocol="sglang") as client:
            await client.probe_spec()

    with pytest.raises(ValueError, match="num_layers= and topk="):
        run(main())


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_server_faults_are_retried_and_recorded_once(
    engine: ReferenceEngine, server: EngineServer, plan: FaultPlan, protocol: Protocol
) -> None:
    plan.then(Fault.status(503)).then(Fault.drop_connection())
    trace = r3arrow.RouteTrace(engine.spec)

    async def main() -> GenerateOutput:
        async with EngineClient(
            server.url, engine.spec, protocol=protocol, retry=RetryPolicy(backoff_base=0.001)
        ) as client:
            out: GenerateOutput = await client.generate(
                [4, 5, 6], sampling_params=sp(protocol), trace=trace
            )
            return out

    out = run(main())
    assert out.attempts == 3 and trace.num_turns == 1 and trace.captured == 3 + 3 - 1


@pytest.mark.parametrize("protocol", PROTOCOLS)
@pytest.mark.parametrize(
    "fault", [Fault.malformed_routes("truncated"), Fault.short_routes(1), Fault.no_routes()]
)
def test_bad_routes_over_http_leave_the_trace(
    engine: ReferenceEngine, server: EngineServer, plan: FaultPlan, protocol: Protocol, fault: Fault
) -> None:
    plan.then(fault)
    trace = r3arrow.RouteTrace(engine.spec)

    async def main() -> dict[str, int]:
        async with EngineClient(server.url, engine.spec, protocol=protocol) as client:
            with pytest.raises(R3ArrowError):
                await client.generate([4, 5, 6], sampling_params=sp(protocol), trace=trace)
            assert trace.captured == 0 and trace.num_turns == 0
            await client.generate([4, 5, 6], sampling_params=sp(protocol), trace=trace)
            return client.stats

    stats = run(main())
    assert stats["data_errors"] == 1 and stats["retries"] == 0 and trace.captured == 5


def test_sglang_rejection_message_reaches_the_caller(server: EngineServer) -> None:
    async def main() -> None:
        async with EngineClient(server.url, protocol="sglang") as client:
            await client.generate([1, 2], sampling_params={"max_tokens": 2}, return_routes=False)

    with pytest.raises(EngineHTTPError, match=r"HTTP 400: unknown field `max_tokens`") as info:
        run(main())
    assert info.value.status == 400


def test_sglang_client_refuses_other_endpoints() -> None:
    with pytest.raises(ValueError, match="one generate endpoint"):
        EngineClient("http://x", protocol="sglang", endpoint="completions")
    with pytest.raises(ValueError, match="protocol"):
        EngineClient("http://x", protocol="tgi")  # type: ignore[arg-type]


def test_sglang_routes_need_a_spec(server: EngineServer) -> None:
    async def main() -> None:
        async with EngineClient(server.url, protocol="sglang") as client:
            await client.generate([1, 2], sampling_params={"max_new_tokens": 2})

    with pytest.raises(R3ArrowError, match="carry no shape"):
        run(main())


def test_short_rows_name_the_sglang_server(
    engine: ReferenceEngine, server: EngineServer, plan: FaultPlan
) -> None:
    plan.then(Fault.short_routes(2))

    async def main() -> None:
        async with EngineClient(server.url, engine.spec, protocol="sglang") as client:
            await client.generate([1, 2, 3, 4], sampling_params=sp("sglang"))

    with pytest.raises(RouteShapeError, match=rf"from {server.url}: expected 6 rows .* found 4"):
        run(main())


# ------------------------------------------------------------- the row rule, at random
@settings(max_examples=25)
@given(
    prompt=st.lists(st.integers(0, 511), min_size=1, max_size=12),
    generated=st.integers(1, 4),
    data=st.data(),
)
def test_rows_are_start_to_seqlen_minus_one(
    engine: ReferenceEngine, prompt: list[int], generated: int, data: st.DataObject
) -> None:
    """``[start, P + G - 1)`` for every ``start`` in ``[0, P]``, the engine's own routing."""
    start = data.draw(st.integers(0, len(prompt)), label="start")
    with EngineServer(engine) as srv:
        obj = post(
            srv,
            {
                "input_ids": prompt,
                "sampling_params": {"max_new_tokens": generated, "temperature": 0},
                "return_routed_experts": True,
                "routed_experts_start_len": start,
            },
        ).json()
    out = obj["output_ids"]
    assert len(out) == generated
    rows = decode_sglang(obj["meta_info"]["routed_experts"], engine.spec)
    full = engine.routes_for(prompt + out)
    np.testing.assert_array_equal(rows, full[start : len(prompt) + generated - 1])


# --------------------------------------------------------------- client-side parsing
@pytest.mark.parametrize(
    ("body", "message"),
    [
        (b"[]", "expected one JSON object"),
        (b'{"meta_info": {}}', "expected output_ids as a list of ints"),
        (b'{"output_ids": [], "meta_info": {}}', "at least one generated token"),
        (b'{"output_ids": [1]}', "expected meta_info as an object"),
        (b'{"output_ids": [1], "meta_info": {"finish_reason": "length"}}', "finish_reason"),
        (
            b'{"output_ids": [1], "meta_info": {"finish_reason": {"type": "abort", '
            b'"message": "out of memory"}}}',
            "aborted: 'out of memory'",
        ),
        (b'{"output_ids": [1], "meta_info": {"routed_experts": [[0]]}}', "base64 string"),
        (b"not json", "expected JSON"),
        (b'{"output_ids": [1], "meta_info": {}, "routed_experts": "AAAA"}', "found it elsewhere"),
    ],
)
def test_sglang_parse_response_refuses_malformed_bodies(body: bytes, message: str) -> None:
    spec = TinyMoEConfig().route_spec()
    with pytest.raises(R3ArrowError, match=message):
        sglang_proto.parse_response(body, spec=spec)


def test_sglang_parse_response_reads_finish_and_logprobs() -> None:
    spec = TinyMoEConfig().route_spec()
    body = (
        b'{"output_ids": [4, 2], "meta_info": {"finish_reason": {"type": "stop", "matched": 2},'
        b' "output_token_logprobs": [[-0.5, 4, null], [-1.5, 2, null]]}}'
    )
    parsed = sglang_proto.parse_response(body, spec=spec)
    assert parsed.token_ids == [4, 2] and parsed.finish_reason == "stop"
    assert parsed.stop_reason == 2 and parsed.logprobs == [-0.5, -1.5] and parsed.routes is None


def test_generate_answers_post_and_put_only(server: EngineServer) -> None:
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}}
    put = httpx.put(server.url + GEN, json=body, timeout=30)
    assert put.status_code == 200 and len(put.json()["output_ids"]) == 1
    get = httpx.get(server.url + GEN, timeout=30)
    assert get.status_code == 405 and get.headers["allow"] == "POST, PUT"


@pytest.mark.parametrize("protocol", PROTOCOLS)
def test_probe_with_a_wrong_shape_fails(server: EngineServer, protocol: Protocol) -> None:
    """vLLM checks a given shape against its .npy header; SGLang's bytes do not divide into it."""

    async def main() -> None:
        async with EngineClient(server.url, protocol=protocol) as client:
            await client.probe_spec(num_layers=3, topk=2)

    want = r"expected routes of num_layers=3" if protocol == "vllm" else r"int32 rows of \[3, 2\]"
    with pytest.raises(R3ArrowError, match=want):
        run(main())
