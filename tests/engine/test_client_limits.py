"""EngineClient against hostile engines over real HTTP on 127.0.0.1 (`Fault.respond`,
`Fault.trickle`): whatever a response holds, only `R3ArrowError` escapes; ``timeout`` is one
deadline for the whole request; decoded bodies stay under their cap and compression ratio.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import socket
import time
import tracemalloc
import zlib
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import orjson
import pytest
from hypothesis import given
from hypothesis import strategies as st

import r3arrow
from r3arrow.capture import TurnStore
from r3arrow.client import Endpoint, EngineClient, Protocol, RetryPolicy
from r3arrow.client._retry import retry_after_seconds
from r3arrow.errors import (
    EngineHTTPError,
    EngineResponseError,
    PayloadTooLargeError,
    R3ArrowError,
)
from r3arrow.rollout import Conversation, Step, run_trajectory
from r3arrow.testing.engine import EngineServer, Fault, FaultPlan, ReferenceEngine, TinyMoEConfig

PROMPT = [1, 2, 3, 4, 5]
#: Each response format the client parses: (protocol, endpoint, where the generated ids are).
WIRES: dict[str, tuple[Protocol, Endpoint, str]] = {
    "vllm-generate": ("vllm", "generate", "choices[0].token_ids"),
    "vllm-completions": ("vllm", "completions", "choices[0].token_ids"),
    "sglang": ("sglang", "generate", "output_ids"),
}
#: Stand-ins that `mutated` swaps for JSON that orjson cannot write: too deep, too big.
RAW = {
    "\x00deep": b"[" * 1000 + b"]" * 1000,
    "\x00big": b"1" + b"0" * 30,
    "\x00neg": b"-" + b"9" * 30,
}
NASTY = st.one_of(
    st.sampled_from(
        [
            *(-5, -1, 0, 2**31, 2**63, 2**64 - 1, -(2**63), 1e308, -0.0, 0.5, True, False, None),
            *("", "x", "NaN", "AAAA", "!!", [], {}, [[]], [None], [True, 1], [-5, 7], [[[0]]]),
            *([[[-1, 2**63]]], [[[2**64 - 1]]], [[[1, True]]], {"type": "abort"}, {"type": 1}),
            *({"data": "AAAA"}, {"type": "stop", "matched": True}, *RAW),
        ]
    ),
    st.integers(min_value=-(2**63), max_value=2**64 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
    st.lists(st.integers(-3, 2**31 + 3), max_size=6),
    st.lists(st.lists(st.lists(st.integers(-1, 300), max_size=3), max_size=3), max_size=3),
)
ENCODINGS = ["identity"] * 4 + ["gzip", "deflate", "gzip-uncompressed", "br"]


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def sampling(protocol: Protocol) -> dict[str, Any]:
    key = "max_tokens" if protocol == "vllm" else "max_new_tokens"
    return {key: 3, "temperature": 0.0}


def encoded(body: bytes, encoding: str) -> tuple[bytes, dict[str, str]]:
    """(body, headers) of ``body`` sent with ``encoding`` (the last two: lying headers)."""
    if encoding == "gzip":
        return zlib.compress(body, wbits=31), {"content-encoding": "gzip"}
    if encoding == "deflate":
        return zlib.compress(body), {"content-encoding": "deflate"}
    if encoding == "gzip-uncompressed":
        return body, {"content-encoding": "gzip"}
    return body, {} if encoding == "identity" else {"content-encoding": encoding}


@functools.cache
def gzip_bomb(decoded: int = 512 << 20) -> bytes:
    """gzip of ``decoded`` zero bytes (512 MiB: a 509 KiB body), built 1 MiB at a time."""
    z = zlib.compressobj(9, zlib.DEFLATED, 31)
    block = bytes(1 << 20)
    return b"".join([*(z.compress(block) for _ in range(decoded >> 20)), z.flush()])


@pytest.fixture(scope="module")
def engine() -> ReferenceEngine:
    return ReferenceEngine(TinyMoEConfig(seed=7))


@pytest.fixture(scope="module")
def hostile(engine: ReferenceEngine) -> Iterator[EngineServer]:
    """One server for every hypothesis example (each gives it the plan of its answer)."""
    with EngineServer(engine) as srv:
        yield srv


@pytest.fixture(scope="module")
def valid(hostile: EngineServer, engine: ReferenceEngine) -> dict[str, Any]:
    """A valid response (JSON) of each wire to PROMPT, logprobs included (the engine gives
    them on generate only: the others get what vLLM's completions and SGLang answer)."""
    out = {}
    for name, (protocol, endpoint, _) in WIRES.items():
        client = EngineClient(hostile.url, engine.spec, protocol=protocol, endpoint=endpoint)
        sp = sampling(protocol) | ({"logprobs": 1} if name == "vllm-generate" else {})
        body = client.build_request(PROMPT, sp, prompt_start=0)
        out[name] = httpx.post(hostile.url + client.path, json=body, timeout=30).json()
        run(client.aclose())
    ids = out["vllm-completions"]["choices"][0]["token_ids"]
    out["vllm-completions"]["choices"][0]["logprobs"] = {"token_logprobs": [-0.5] * len(ids)}
    meta = out["sglang"]["meta_info"]
    meta["output_token_logprobs"] = [[-0.5, t, None] for t in out["sglang"]["output_ids"]]
    return out


def paths(obj: Any, at: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield at
    items = (
        obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    )
    for key, value in items:
        yield from paths(value, (*at, key))


def mutated(obj: Any, data: st.DataObject) -> bytes:
    """``obj`` with 1-3 values replaced, deleted, inserted or (strings: the route payloads
    among them) spliced, as JSON bytes, sometimes cut short."""
    obj = copy.deepcopy(obj)
    for _ in range(data.draw(st.integers(1, 3))):
        path = data.draw(st.sampled_from(list(paths(obj))))
        value = copy.deepcopy(data.draw(NASTY))  # sampled_from shares its values
        if not path:
            obj = value
            continue
        parent = functools.reduce(lambda o, k: o[k], path[:-1], obj)
        op = data.draw(st.sampled_from(["set", "set", "delete", "insert", "splice"]))
        if op == "splice" and isinstance(parent[path[-1]], str):
            text = parent[path[-1]]
            i = data.draw(st.integers(0, len(text)))
            j = data.draw(st.integers(i, min(len(text), i + 8)))
            parent[path[-1]] = text[:i] + data.draw(st.text(max_size=8)) + text[j:]
        elif op == "delete":
            del parent[path[-1]]
        elif op == "insert" and isinstance(parent, list):
            parent.insert(path[-1], value)
        else:
            parent[path[-1]] = value
    body = orjson.dumps(obj)
    for mark, raw in RAW.items():
        body = body.replace(orjson.dumps(mark), raw)
    return (
        body[: data.draw(st.integers(0, len(body)))] if data.draw(st.integers(0, 9)) == 0 else body
    )


# ------------------------------------------------------------------ N8: engine data
@pytest.mark.parametrize("wire", WIRES)
@given(data=st.data())
def test_any_mutated_response_raises_only_r3arrow_errors(
    engine: ReferenceEngine,
    hostile: EngineServer,
    valid: dict[str, Any],
    wire: str,
    data: st.DataObject,
) -> None:
    """Responses of a real server, mutated (wrong JSON types, huge or negative ints, bools as
    ints, non-list fields, deep nesting, cut bodies, lying encodings, error statuses): the
    client returns well-formed output or raises an `R3ArrowError`, and the trace is unchanged.
    """
    srv = hostile
    srv.faults = plan = FaultPlan()  # a failed example leaves nothing queued for the next
    protocol, endpoint, _ = WIRES[wire]
    body, headers = encoded(mutated(valid[wire], data), data.draw(st.sampled_from(ENCODINGS)))
    status = data.draw(st.sampled_from([200] * 6 + [201, 301, 400, 429, 503]))
    if status in (429, 503):
        headers["retry-after"] = data.draw(
            st.text(st.characters(min_codepoint=32, max_codepoint=126))
        )
    plan.then(Fault.respond(body, status=status, headers=headers))
    use_trace = data.draw(st.booleans())
    vocab = engine.config.vocab_size

    async def main() -> None:
        async with EngineClient(
            srv.url,
            engine.spec,
            protocol=protocol,
            endpoint=endpoint,
            retry=RetryPolicy(max_retries=0),
            vocab_size=vocab,
        ) as client:
            trace = r3arrow.RouteTrace(engine.spec) if use_trace else None
            try:
                out = await client.generate(PROMPT, sampling_params=sampling(protocol), trace=trace)
            except R3ArrowError:
                assert trace is None or trace.captured == 0
                return
        assert all(type(t) is int and 0 <= t < vocab for t in out.token_ids)
        assert out.logprobs is None or (
            len(out.logprobs) == len(out.token_ids) and all(type(v) is float for v in out.logprobs)
        )
        assert out.finish_reason is None or type(out.finish_reason) is str
        assert out.stop_reason is None or type(out.stop_reason) in (int, str)

    run(main())
    assert plan.pending == 0


@given(value=st.text())
def test_any_retry_after_header_gives_seconds_or_none(value: str) -> None:
    seconds = retry_after_seconds(value)
    assert seconds is None or seconds >= 0


class Done:
    def step(self, conversation: Conversation) -> Step:
        return Step(done=True)


@pytest.mark.parametrize("wire", WIRES)
def test_a_negative_generated_id_is_an_engine_response_error_in_a_rollout(
    engine: ReferenceEngine, valid: dict[str, Any], server: EngineServer, plan: FaultPlan, wire: str
) -> None:
    """N8: ``output_ids: [-5, ...]`` raised a builtin ValueError out of the rollout loop."""
    protocol, endpoint, where = WIRES[wire]
    bad = copy.deepcopy(valid[wire])
    ids = bad["output_ids"] if protocol == "sglang" else bad["choices"][0]["token_ids"]
    ids[0] = -5
    plan.then(Fault.respond(orjson.dumps(bad)))
    store = TurnStore(engine.spec)

    async def main() -> None:
        async with EngineClient(
            server.url, engine.spec, protocol=protocol, endpoint=endpoint
        ) as client:
            await run_trajectory(
                client,
                Done(),
                PROMPT,
                trajectory_id="t0",
                store=store,
                sampling_params=sampling(protocol),
            )

    with pytest.raises(EngineResponseError, match=r"found -5 at") as info:
        run(main())
    err = info.value
    assert (err.trajectory_id, err.field, err.url) == ("t0", f"{where}[0]", server.url)


def test_generated_ids_past_the_vocabulary_are_refused(
    engine: ReferenceEngine, valid: dict[str, Any], server: EngineServer, plan: FaultPlan
) -> None:
    """An id the next turn's prompt check would refuse (a builtin there) fails here, as data."""
    bad = copy.deepcopy(valid["vllm-generate"])
    ids = bad["choices"][0]["token_ids"]
    ids[-1] = 512
    plan.then(Fault.respond(orjson.dumps(bad)))

    async def main() -> None:
        async with EngineClient(server.url, engine.spec, vocab_size=512) as client:
            await client.generate(PROMPT, sampling_params=sampling("vllm"))

    with pytest.raises(EngineResponseError, match=r"in \[0, 512\), found 512") as info:
        run(main())
    assert info.value.field == f"choices[0].token_ids[{len(ids) - 1}]"


# ------------------------------------------------------------------ N9: the deadline
def test_timeout_is_a_deadline_for_the_whole_request(
    engine: ReferenceEngine, server: EngineServer, plan: FaultPlan
) -> None:
    """N9: a body trickled a byte at a time over 3 s passed a per-read timeout of 0.5 s."""
    plan.then(Fault.trickle(3.0))

    async def main() -> float:
        async with EngineClient(server.url, engine.spec, timeout=0.5) as client:
            t0 = time.perf_counter()
            with pytest.raises(EngineHTTPError, match=r"timed out.*0.5 s deadline") as info:
                await client.generate(PROMPT, sampling_params=sampling("vllm"))
            assert info.value.status is None and info.value.url == server.url
            return time.perf_counter() - t0

    assert run(main()) < 2.0  # well before the trickle ends
    assert server.log.count("/inference/v1/generate") == 1  # a late body is not retried


def test_a_missed_deadline_is_retried_with_retry_timeouts(
    engine: ReferenceEngine, server: EngineServer, plan: FaultPlan
) -> None:
    plan.then(Fault.trickle(3.0))
    retry = RetryPolicy(max_retries=1, backoff_base=0.0, retry_timeouts=True)

    async def main() -> int:
        async with EngineClient(server.url, engine.spec, timeout=0.5, retry=retry) as client:
            out = await client.generate(PROMPT, sampling_params=sampling("vllm"))
            return out.attempts

    assert run(main()) == 2


def test_a_deadline_missed_while_connecting_fails_over(
    engine: ReferenceEngine, server: EngineServer
) -> None:
    """A listener whose accept queue is full drops the SYN: the connect phase misses the
    deadline, which is retried on the next URL like a connect timeout."""
    with socket.socket() as full:
        full.bind(("127.0.0.1", 0))
        full.listen(0)
        queued = [socket.socket() for _ in range(4)]
        for sock in queued:
            sock.setblocking(False)
            sock.connect_ex(full.getsockname())
        retry = RetryPolicy(max_retries=1, backoff_base=0.0)
        blackhole = "http://{}:{}".format(*full.getsockname())

        async def main() -> tuple[str, int]:
            async with EngineClient(
                [blackhole, server.url], engine.spec, timeout=0.5, retry=retry
            ) as client:
                out = await client.generate(PROMPT, sampling_params=sampling("vllm"))
                return out.base_url, out.attempts

        try:
            assert run(main()) == (server.url, 2)
        finally:
            for sock in queued:
                sock.close()


@pytest.mark.parametrize(
    ("timeout", "error"),
    [
        *((0, ValueError), (-1.0, ValueError), (float("inf"), ValueError)),
        *((float("nan"), ValueError), (True, TypeError), ("5", TypeError)),
        (httpx.Timeout(5.0), TypeError),
    ],
)
def test_timeout_must_be_finite_positive_seconds(timeout: Any, error: type[Exception]) -> None:
    with pytest.raises(error, match="timeout: expected"):
        EngineClient("http://127.0.0.1:9", timeout=timeout)


# ------------------------------------------------------------------ N10: body caps
def test_a_gzip_bomb_stops_at_the_ratio_cap_in_bounded_memory(
    engine: ReferenceEngine, server: EngineServer, plan: FaultPlan
) -> None:
    """N10: a 509 KiB gzip body decoding to 512 MiB was decoded whole before failing."""
    bomb = gzip_bomb()
    plan.then(Fault.respond(bomb, headers={"content-encoding": "gzip"}))

    async def main() -> None:
        async with EngineClient(server.url, engine.spec) as client:
            await client.generate(PROMPT, sampling_params=sampling("vllm"))

    tracemalloc.start()
    try:
        with pytest.raises(PayloadTooLargeError, match=r"64x its [\d,]+ compressed bytes"):
            run(main())
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 128 << 20  # the ratio cap's 64 MiB floor and slack; uncapped: over 512 MiB


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_compressed_responses_decode_to_the_engine_routes(
    engine: ReferenceEngine,
    valid: dict[str, Any],
    server: EngineServer,
    plan: FaultPlan,
    encoding: str,
) -> None:
    body, headers = encoded(orjson.dumps(valid["vllm-generate"]), encoding)
    plan.then(Fault.respond(body, headers=headers))

    async def main() -> np.ndarray:
        async with EngineClient(server.url, engine.spec) as client:
            out = await client.generate(PROMPT, sampling_params=sampling("vllm"))
            assert out.response_bytes == len(orjson.dumps(valid["vllm-generate"]))
            assert out.routed_experts is not None
            return out.routed_experts

    conv = PROMPT + valid["vllm-generate"]["choices"][0]["token_ids"]
    np.testing.assert_array_equal(run(main()), engine.routes_for(conv)[:-1])


@pytest.mark.parametrize(
    ("case", "match"),
    [
        ("br", r"Content-Encoding gzip, deflate or identity.*found 'br'"),
        ("not gzip", r"expected a gzip body, found one that fails to decode"),
        ("cut", r"gzip body cut short"),
        ("two members", r"data after the end of its gzip body"),
    ],
)
def test_undecodable_bodies_are_engine_response_errors(
    engine: ReferenceEngine,
    valid: dict[str, Any],
    server: EngineServer,
    plan: FaultPlan,
    case: str,
    match: str,
) -> None:
    """Never an httpx error, never a silently truncated body."""
    raw = orjson.dumps(valid["vllm-generate"])
    gz = zlib.compress(raw, wbits=31)
    body = {"br": raw, "not gzip": raw, "cut": gz[:-10], "two members": gz + gz}[case]
    coding = "br" if case == "br" else "gzip"
    plan.then(Fault.respond(body, headers={"content-encoding": coding}))

    async def main() -> None:
        async with EngineClient(server.url, engine.spec) as client:
            await client.generate(PROMPT, sampling_params=sampling("vllm"))

    with pytest.raises(EngineResponseError, match=match) as info:
        run(main())
    assert info.value.url == server.url


def test_the_default_body_cap_is_what_a_long_context_response_holds() -> None:
    """1 GiB of routes (256K rows of 4 KiB: 128 layers x top-8 x int32) as base64, plus the
    JSON beside them; not the 11.5 GB the codec's 8 GiB payload bound implied."""
    client = EngineClient("http://127.0.0.1:9")
    assert client.max_payload_bytes == 1 << 30
    assert client.max_body_bytes == (1 << 30) * 4 // 3 + (64 << 20)
    run(client.aclose())
