"""EngineClient's retry policy, wire protocol and response checks, on `httpx.MockTransport`.

`FakeVLLM` answers vLLM's generate and completions endpoints in-process (no sockets, no
model): each request generates ``max_tokens`` tokens, and the route row of token position
``t`` is a fixed function of ``t`` (`rows_for`), so every captured row can be checked. Faults
are the embedded engine's own (`FaultPlan`, `corrupt_routes`), plus transport errors that
only a mock can raise on demand. Integration over real HTTP is in test_client.py.
"""

from __future__ import annotations

import asyncio
import email.utils
import random
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import numpy as np
import orjson
import pytest

import r3arrow
from r3arrow.client import (
    EngineClient,
    GenerateOutput,
    RetryPolicy,
)
from r3arrow.client._protocol import ENDPOINT_PATHS, build_request, decode_routes, parse_response
from r3arrow.client._retry import retry_after_seconds
from r3arrow.codec import encode_packed, encode_vllm
from r3arrow.errors import (
    DuplicateExpertError,
    EngineError,
    EngineHTTPError,
    ExpertRangeError,
    PayloadError,
    PayloadTooLargeError,
    PrefixMismatchError,
    R3ArrowError,
    RouteDTypeError,
    RouteQualityError,
    RouteShapeError,
    TraceStateError,
)
from r3arrow.spec import RouteSpec, routes_to_numpy
from r3arrow.testing.engine import Fault, FaultPlan, corrupt_routes, drift_prompt
from r3arrow.testing.engine._protocol import error_body, status_type

URL = "http://engine.test"
GEN = ENDPOINT_PATHS["generate"]
COMP = ENDPOINT_PATHS["completions"]
SPEC = RouteSpec(num_layers=4, topk=2, num_experts=8, moe_layers=(1, 2, 3))
SP = {"max_tokens": 3, "temperature": 0.0}

TransportErrorFactory = Callable[[httpx.Request], httpx.TransportError]


def rows_for(start: int, stop: int) -> np.ndarray:
    """The route rows of token positions ``start .. stop - 1``: ``[rows, 4, 2]`` uint8."""
    t = np.arange(start, stop)[:, None]
    layer = np.arange(4)[None, :]
    first = (3 * t + layer) % 8
    second = (first + 1 + t % 3) % 8
    rows = np.stack([first, second], axis=-1).astype(np.uint8)
    rows[:, 0] = 0  # layer 0 is dense: vLLM reports zeros
    return rows


class FakeVLLM:
    """vLLM's two generation endpoints as an async `httpx.MockTransport` handler."""

    def __init__(self, plan: FaultPlan | None = None) -> None:
        self.plan = plan if plan is not None else FaultPlan()
        #: Transport errors raised by the next requests, in order (before any fault).
        self.errors: deque[TransportErrorFactory] = deque()
        self.bodies: list[dict[str, Any]] = []
        self.in_flight = 0
        self.peak_in_flight = 0

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    def count(self, path: str = GEN) -> int:
        return self.plan.seen(path)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        self.in_flight += 1
        self.peak_in_flight = max(self.peak_in_flight, self.in_flight)
        try:
            return await self._answer(request)
        finally:
            self.in_flight -= 1

    async def _answer(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        body = orjson.loads(request.content)
        self.bodies.append(body)
        fault = self.plan.take(path)
        if self.errors:
            raise self.errors.popleft()(request)
        if fault is not None and fault.kind == "delay":
            await asyncio.sleep(fault.seconds)
            fault = None
        if fault is not None and fault.kind == "status":
            code = fault.status_code
            headers = {} if fault.retry_after is None else {"retry-after": f"{fault.retry_after:g}"}
            err = error_body(code, f"injected fault: HTTP {code}", err_type=status_type(code))
            return httpx.Response(code, json=err, headers=headers)
        if fault is not None and fault.kind == "drop_connection":
            raise httpx.RemoteProtocolError("Server disconnected", request=request)
        if path == GEN:
            prompt, sp = body["token_ids"], body["sampling_params"]
        else:
            prompt, sp = body["prompt"], body
        g = int(sp.get("max_tokens", 16))
        start = int(sp.get("routed_experts_prompt_start", 0))
        tokens = [(sum(prompt) + i) % 500 + 1 for i in range(g)]
        rows = rows_for(start, len(prompt) + g - 1)
        routes = encode_vllm(rows) if fault is None else corrupt_routes(rows, fault)
        choice: dict[str, Any] = {
            "index": 0,
            "finish_reason": "length",
            "stop_reason": None,
            "token_ids": tokens,
            "routed_experts": routes,
        }
        if sp.get("logprobs") is not None:
            choice["logprobs"] = {"content": [{"token_id": t, "logprob": -0.5} for t in tokens]}
        return httpx.Response(200, json={"choices": [choice]})


def client_for(fake: FakeVLLM, spec: RouteSpec | None = SPEC, **kw: Any) -> EngineClient:
    return EngineClient(URL, spec, transport=fake.transport(), **kw)


def run(coro: Awaitable[Any]) -> Any:
    async def main() -> Any:
        return await coro

    return asyncio.run(main())


def trace_rows(trace: r3arrow.RouteTrace, num_tokens: int) -> np.ndarray:
    """The trace's captured rows as numpy (finalizes it; the mask trains nothing)."""
    arr = trace.finalize(num_tokens=num_tokens, loss_mask=np.zeros(num_tokens, np.uint8))
    return routes_to_numpy(arr, trace.spec)


def snapshot(trace: r3arrow.RouteTrace) -> tuple[int, int, int]:
    return trace.captured, trace.seen_tokens, trace.num_turns


def connect_error(request: httpx.Request) -> httpx.TransportError:
    return httpx.ConnectError("connection refused", request=request)


def read_timeout(request: httpx.Request) -> httpx.TransportError:
    return httpx.ReadTimeout("timed out", request=request)


# ------------------------------------------------------------------ retries
@pytest.mark.parametrize(
    "failure",
    ["503", "500", "429", "drop_connection", "connect_error", "read_timeout"],
)
def test_transient_failures_are_retried_and_recorded_once(failure: str) -> None:
    fake = FakeVLLM()
    if failure.isdigit():
        fake.plan.then(Fault.status(int(failure)), times=2)
    elif failure == "drop_connection":
        fake.plan.then(Fault.drop_connection(), times=2)
    else:
        fake.errors.extend([connect_error if failure == "connect_error" else read_timeout] * 2)
    trace = r3arrow.RouteTrace(SPEC)
    prompt = list(range(1, 9))

    async def main() -> tuple[GenerateOutput, dict[str, int]]:
        retry_timeouts = failure == "read_timeout"
        async with client_for(
            fake,
            retry=RetryPolicy(backoff_base=0.001, max_retries=3, retry_timeouts=retry_timeouts),
        ) as client:
            out = await client.generate(prompt, sampling_params=SP, trace=trace)
            return out, client.stats

    out, stats = run(main())
    assert fake.count() == 3 and out.attempts == 3
    assert stats["retries"] == 2 and stats["recorded"] == 1 and stats["requests"] == 3
    assert trace.num_turns == 1 and trace.captured == 8 + 3 - 1
    np.testing.assert_array_equal(trace_rows(trace, 11), rows_for(0, 10))


def test_retries_exhausted_raise_engine_http_error_and_leave_trace() -> None:
    fake = FakeVLLM(FaultPlan().then(Fault.status(502), times=None))
    trace = r3arrow.RouteTrace(SPEC)

    async def main() -> None:
        async with client_for(fake, retry=RetryPolicy(backoff_base=0.001, max_retries=2)) as client:
            await client.generate([1, 2, 3], sampling_params=SP, trace=trace)

    with pytest.raises(EngineHTTPError, match=r"after 3 attempts.*HTTP 502") as info:
        run(main())
    assert info.value.status == 502 and isinstance(info.value, EngineError)
    assert info.value.url == URL and "injected fault" in info.value.body
    assert fake.count() == 3 and snapshot(trace) == (0, 0, 0)


@pytest.mark.parametrize("code", [400, 404, 422])
def test_client_errors_fail_at_once(code: int) -> None:
    fake = FakeVLLM(FaultPlan().then(Fault.status(code), times=None))
    trace = r3arrow.RouteTrace(SPEC)

    async def main() -> None:
        async with client_for(fake, retry=RetryPolicy(backoff_base=0.001, max_retries=5)) as client:
            await client.generate([1, 2, 3], sampling_params=SP, trace=trace)

    with pytest.raises(EngineHTTPError, match=rf"HTTP {code}: injected fault") as info:
        run(main())
    assert info.value.status == code
    assert fake.count() == 1 and snapshot(trace) == (0, 0, 0)


@pytest.mark.parametrize("declared", [True, False])
def test_oversized_response_body_is_refused_not_retried(declared: bool) -> None:
    """A body past ``max_body_bytes`` stops being read: a data error, no retry, trace unchanged."""
    fake = FakeVLLM()
    calls = 0

    async def handle(request: httpx.Request) -> httpx.Response:
        nonlocal calls
        calls += 1
        answer = await fake.handle(request)
        if declared:
            return answer

        async def chunks() -> Any:  # streamed: no Content-Length to refuse up front
            yield answer.content[:100]
            yield answer.content[100:]

        return httpx.Response(200, content=chunks())

    trace = r3arrow.RouteTrace(SPEC)

    async def main() -> None:
        transport = httpx.MockTransport(handle)
        async with EngineClient(
            URL, SPEC, transport=transport, retry=RetryPolicy(max_retries=3)
        ) as client:
            client.max_body_bytes = 200  # any generate response with routes is larger
            await client.generate([1, 2, 3], sampling_params=SP, trace=trace)

    found = "found Content-Length" if declared else "found more"
    with pytest.raises(PayloadTooLargeError, match=rf"response body <= 200 bytes.*{found}"):
        run(main())
    assert calls == 1 and snapshot(trace) == (0, 0, 0)


def test_retry_after_header_values() -> None:
    assert retry_after_seconds(None) is None and retry_after_seconds("") is None
    assert retry_after_seconds("soon") is None
    assert retry_after_seconds("0.3") == 0.3 and retry_after_seconds("-4") == 0.0
    assert retry_after_seconds(email.utils.formatdate(0, usegmt=True)) == 0.0  # in the past
    future = email.utils.formatdate(time.time() + 100, usegmt=True)
    wait = retry_after_seconds(future)
    assert wait is not None and 95 < wait <= 100


def test_backoff_is_jittered_exponential_and_honours_retry_after() -> None:
    policy = RetryPolicy(backoff_base=0.1, backoff_max=1.0, retry_after_max=2.0)
    rng = random.Random(0)
    for attempt, cap in [(0, 0.1), (1, 0.2), (2, 0.4), (3, 0.8), (4, 1.0), (9, 1.0)]:
        delays = [policy.delay(attempt, None, rng) for _ in range(50)]
        assert all(cap / 2 <= d <= cap for d in delays)
        assert len(set(delays)) > 1  # jittered
    assert policy.delay(0, 1.5, rng) == 1.5
    assert policy.delay(0, 60, rng) == 2.0  # capped at retry_after_max
    assert [policy.retries_status(s) for s in (400, 404, 422, 429, 500, 503)] == [
        *[False] * 3,
        *[True] * 3,
    ]
    seeded = RetryPolicy(seed=5)
    same = [seeded.delay(2, None, random.Random(seeded.seed)) for _ in range(2)]
    assert same[0] == same[1]  # the policy's seed makes the jitter reproducible


def test_retry_after_is_honoured_and_bounded() -> None:
    plan = FaultPlan().then(Fault.status(429, retry_after=0.05))
    fake = FakeVLLM(plan.then(Fault.status(503, retry_after=60)))

    async def main() -> float:
        async with client_for(
            fake, retry=RetryPolicy(backoff_base=0.001, retry_after_max=0.06)
        ) as client:
            t0 = time.perf_counter()
            await client.generate([1, 2], sampling_params=SP)
            return time.perf_counter() - t0

    elapsed = run(main())
    assert 0.05 + 0.06 <= elapsed < 5  # waited the 0.05 s asked for, and 60 s capped at 0.06 s
    assert fake.count() == 3


def test_timeouts_are_not_retried_unless_asked() -> None:
    fake = FakeVLLM()
    fake.errors.append(read_timeout)
    trace = r3arrow.RouteTrace(SPEC)

    async def main() -> None:
        async with client_for(fake, retry=RetryPolicy(max_retries=3)) as client:
            await client.generate([1, 2, 3], sampling_params=SP, trace=trace)

    with pytest.raises(EngineHTTPError, match="timed out") as info:
        run(main())
    assert info.value.status is None and fake.count() == 1 and snapshot(trace) == (0, 0, 0)


def test_connect_errors_exhausted_name_the_transport_error() -> None:
    fake = FakeVLLM()
    fake.errors.extend([connect_error] * 3)

    async def main() -> None:
        async with client_for(fake, retry=RetryPolicy(backoff_base=0.001, max_retries=2)) as client:
            await client.generate([1, 2, 3], sampling_params=SP)

    with pytest.raises(EngineHTTPError, match=r"after 3 attempts.*ConnectError") as info:
        run(main())
    assert info.value.status is None and fake.count() == 3


# ------------------------------------------------------------- bad responses
@pytest.mark.parametrize("mode", ["base64", "not_npy", "object", "float", "truncated", "shape"])
def test_malformed_payload_fails_that_request_and_leaves_trace(mode: str) -> None:
    fake = FakeVLLM()
    trace = r3arrow.RouteTrace(SPEC)
    prompt = list(range(2, 12))

    async def main() -> tuple[R3ArrowError, list[int]]:
        async with client_for(fake, retry=RetryPolicy(backoff_base=0.001)) as client:
            first = await client.generate(prompt, sampling_params=SP, trace=trace)
            conv = prompt + first.token_ids + [1, 2]
            before = snapshot(trace)
            fake.plan.then(Fault.malformed_routes(mode))  # type: ignore[arg-type]
            with pytest.raises(R3ArrowError) as info:
                await client.generate(conv, sampling_params=SP, trace=trace)
            assert snapshot(trace) == before
            # the trace is still usable: the same turn succeeds without the fault
            again = await client.generate(conv, sampling_params=SP, trace=trace)
            return info.value, conv + again.token_ids

    err, conv = run(main())
    assert isinstance(err, PayloadError | RouteShapeError | RouteDTypeError)
    assert "routed_experts" in str(err)
    assert fake.count() == 3  # never retried
    np.testing.assert_array_equal(trace_rows(trace, len(conv)), rows_for(0, len(conv) - 1))


@pytest.mark.parametrize("fault", [Fault.short_routes(1), Fault.extra_routes(2)])
def test_wrong_row_count_is_a_data_error_never_retried(fault: Fault) -> None:
    fake = FakeVLLM(FaultPlan().then(fault))
    trace = r3arrow.RouteTrace(SPEC)

    async def main() -> None:
        async with client_for(fake, retry=RetryPolicy(backoff_base=0.001)) as client:
            await client.generate(list(range(1, 11)), sampling_params=SP, trace=trace)

    want = 10 + 3 - 1
    found = want - fault.rows if fault.kind == "short_routes" else want + fault.rows
    with pytest.raises(
        RouteShapeError, match=rf"from {URL}: expected {want} rows .* found {found}"
    ):
        run(main())
    assert fake.count() == 1 and snapshot(trace) == (0, 0, 0)


def test_missing_routes_with_a_trace_is_an_engine_error() -> None:
    fake = FakeVLLM(FaultPlan().then(Fault.no_routes()).then(Fault.no_routes()))
    trace = r3arrow.RouteTrace(SPEC)

    async def main() -> GenerateOutput:
        async with client_for(fake) as client:
            with pytest.raises(EngineError, match="--enable-return-routed-experts"):
                await client.generate([5, 6, 7], sampling_params=SP, trace=trace)
            return await client.generate([5, 6, 7], sampling_params=SP)  # no trace: allowed

    plain = run(main())
    assert snapshot(trace) == (0, 0, 0)
    assert plain.routed_experts is None and plain.num_route_rows == 0


@pytest.mark.parametrize("with_trace", [True, False])
def test_expert_ids_out_of_range_for_the_spec(with_trace: bool) -> None:
    """Checked once, by r3arrow.ids: in the trace's record, or at the client's decode."""
    narrow = RouteSpec(num_layers=4, topk=2, num_experts=2, moe_layers=SPEC.moe_layers)
    fake = FakeVLLM()
    trace = r3arrow.RouteTrace(narrow) if with_trace else None

    async def main() -> None:
        async with client_for(fake, narrow) as client:
            await client.generate(list(range(30)), sampling_params=SP, trace=trace)

    with pytest.raises(ExpertRangeError, match=r"expected expert ids < num_experts=2") as info:
        run(main())
    assert info.value.token is not None and info.value.layer in SPEC.router_layers
    assert fake.count() == 1
    assert trace is None or snapshot(trace) == (0, 0, 0)


@pytest.mark.parametrize("with_trace", [True, False])
@pytest.mark.parametrize("fault", [Fault.duplicate_experts(), Fault.zero_router_layer()])
def test_duplicate_experts_are_a_data_error_never_retried(fault: Fault, with_trace: bool) -> None:
    """Checked once, by r3arrow.ids: in the trace's record, or at the client's decode.

    A zeroed router layer is the route-quality guard's (see the next test); without it, it
    is a duplicate (K=2: each zero row repeats expert 0).
    """
    fake = FakeVLLM(FaultPlan().then(fault))
    trace = r3arrow.RouteTrace(SPEC) if with_trace else None
    conv = list(range(1, 11))

    async def main() -> dict[str, int]:
        async with client_for(
            fake, retry=RetryPolicy(backoff_base=0.001), route_quality=False
        ) as client:
            with pytest.raises(DuplicateExpertError, match="distinct experts") as info:
                await client.generate(conv, sampling_params=SP, trace=trace)
            assert info.value.layer == 1  # the first router layer (layer 0 is dense)
            want = 6 if fault.kind == "duplicate_experts" else 0  # middle row / first row
            assert info.value.token == want
            await client.generate(conv, sampling_params=SP, trace=trace)  # the next one is fine
            return client.stats

    stats = run(main())
    assert fake.count() == 2 and stats["retries"] == 0 and stats["data_errors"] == 1
    assert stats["recorded"] == (1 if with_trace else 0)
    assert trace is None or trace.captured == 12


@pytest.mark.parametrize("with_trace", [True, False])
def test_zeroed_router_layer_is_a_route_quality_error(with_trace: bool) -> None:
    """The guard runs before the id rules: the engine-bug message, not "distinct experts"."""
    fake = FakeVLLM(FaultPlan().then(Fault.zero_router_layer()))
    trace = r3arrow.RouteTrace(SPEC) if with_trace else None

    async def main() -> dict[str, int]:
        async with client_for(fake, retry=RetryPolicy(backoff_base=0.001)) as client:
            with pytest.raises(RouteQualityError, match="all zeros") as info:
                await client.generate(list(range(1, 11)), sampling_params=SP, trace=trace)
            assert info.value.layer == 1 and info.value.bugs
            return client.stats

    stats = run(main())
    assert fake.count() == 1 and stats["retries"] == 0 and stats["data_errors"] == 1
    assert trace is None or snapshot(trace) == (0, 0, 0)


def test_prefix_drift_is_refused_before_sending() -> None:
    fake = FakeVLLM()
    trace = r3arrow.RouteTrace(SPEC)

    async def main() -> tuple[dict[str, int], int]:
        async with client_for(fake) as client:
            out = await client.generate([5, 6, 7], sampling_params=SP, trace=trace)
            conv = [5, 6, 7, *out.token_ids, 9]
            drifted = drift_prompt(conv, 4, 512)  # the second generated token re-tokenized
            with pytest.raises(PrefixMismatchError, match="position 4") as info:
                await client.generate(drifted, sampling_params=SP, trace=trace)
            assert info.value.token == 4
            with pytest.raises(PrefixMismatchError, match="position 0"):
                await client.generate([4, *conv[1:]], sampling_params=SP, trace=trace)
            sent = fake.count()
            await client.generate(conv, sampling_params=SP, trace=trace)
            return client.stats, sent

    stats, sent = run(main())
    assert sent == 1 and fake.count() == 2  # nothing was sent for the drifted prompts
    assert stats["prefix_mismatches"] == 2 and stats["data_errors"] == 0
    assert trace.covered_tokens.size == 7 + 3 and trace.captured == (3 + 3 - 1) + (7 - 5 + 3 - 1)


def test_probe_spec_infers_dense_layers_from_all_zero_rows() -> None:
    fake = FakeVLLM()

    async def main(**kw: Any) -> RouteSpec:
        async with client_for(fake, None) as client:
            return await client.probe_spec(num_experts=8, **kw)

    assert run(main()) == SPEC  # layer 0 answered zeros: dense
    assert run(main(infer_dense=False)).moe_layers is None
    fake.plan.then(Fault.malformed_routes("shape"))
    with pytest.raises(RouteShapeError):  # no spec to check against, but still [rows, L, K]
        run(main())


# ------------------------------------------------------------- requests
def test_bad_requests_are_rejected_before_sending() -> None:
    fake = FakeVLLM()
    trace = r3arrow.RouteTrace(SPEC)

    async def main() -> None:
        async with client_for(fake, vocab_size=512) as client:
            first = await client.generate([1, 2, 3, 4], sampling_params=SP, trace=trace)
            conv = [1, 2, 3, 4, *first.token_ids]
            with pytest.raises(RouteShapeError, match="extend the trace"):
                await client.generate(conv[:5], sampling_params=SP, trace=trace)
            with pytest.raises(ValueError, match=r"ids in \[0, 512\), found 512 at position 1"):
                await client.generate([1, 512], sampling_params=SP)
            with pytest.raises(ValueError, match="found -1"):
                await client.generate([-1, 5], sampling_params=SP)
            with pytest.raises(ValueError, match="n=1, no stream"):
                await client.generate(conv, sampling_params={**SP, "n": 2}, trace=trace)
            with pytest.raises(ValueError, match="set by the client"):
                await client.generate(
                    conv, sampling_params={**SP, "routed_experts_prompt_start": 0}, trace=trace
                )
            with pytest.raises(ValueError, match=r"prompt_start: expected an int in \[0, 1\]"):
                await client.generate([1, 2], sampling_params=SP, prompt_start=2)
            not_an_int: Any = 1.0
            with pytest.raises(TypeError, match="prompt_start: expected an int"):
                await client.generate([1, 2], sampling_params=SP, prompt_start=not_an_int)
            with pytest.raises(
                ValueError,
                match="flat sequence of int token ids, found shape \\[2\\] of dtype float64",
            ):
                await client.generate([1.0, 2.5], sampling_params=SP)  # type: ignore[list-item]
            with pytest.raises(ValueError, match="found shape \\[1, 2\\]"):
                await client.generate([[1, 2]], sampling_params=SP)  # type: ignore[list-item]
            with pytest.raises(ValueError, match="return_routes=False with a trace"):
                await client.generate(conv, sampling_params=SP, trace=trace, return_routes=False)
            other = r3arrow.RouteTrace(RouteSpec(num_layers=3, topk=2, num_experts=8))
            with pytest.raises(RouteShapeError, match="trace: expected routes shaped like"):
                await client.generate(conv, sampling_params=SP, trace=other)

    run(main())
    assert fake.count() == 1 and trace.num_turns == 1


def test_finalized_trace_is_refused() -> None:
    fake = FakeVLLM()
    trace = r3arrow.RouteTrace(SPEC)
    trace.finalize(num_tokens=0, loss_mask=np.zeros(0, np.uint8))

    async def main() -> None:
        async with client_for(fake) as client:
            await client.generate([1, 2], sampling_params=SP, trace=trace)

    with pytest.raises(TraceStateError, match="already finalized"):
        run(main())
    assert fake.count() == 0


def test_numpy_token_ids_are_sent_as_plain_ints() -> None:
    fake = FakeVLLM()

    async def main() -> tuple[GenerateOutput, GenerateOutput]:
        async with client_for(fake) as client:
            scalars = await client.generate(
                [np.int64(1), np.int32(2), 3],  # type: ignore[list-item]
                sampling_params=SP,
            )
            array = await client.generate(
                np.array([1, 2, 3], np.uint16),  # type: ignore[arg-type]
                sampling_params=SP,
            )
            return scalars, array

    scalars, array = run(main())
    assert [b["token_ids"] for b in fake.bodies] == [[1, 2, 3], [1, 2, 3]]
    assert scalars.token_ids == array.token_ids and scalars.prompt_tokens == 3
    np.testing.assert_array_equal(scalars.routed_experts, array.routed_experts)


def test_request_bodies_of_both_endpoints() -> None:
    gen = build_request("generate", [1, 2], {"max_tokens": 2}, prompt_start=1, cache_salt="s")
    assert gen == {
        "token_ids": [1, 2],
        "sampling_params": {"max_tokens": 2, "routed_experts_prompt_start": 1},
        "cache_salt": "s",
    }
    comp = build_request("completions", [1, 2], {"max_tokens": 2}, prompt_start=0, model="m")
    assert comp == {
        "prompt": [1, 2],
        "max_tokens": 2,
        "return_token_ids": True,
        "routed_experts_prompt_start": 0,
        "model": "m",
    }
    plain = build_request("generate", [1], {}, prompt_start=0, return_routes=False)
    assert plain == {"token_ids": [1], "sampling_params": {}}
    fake = FakeVLLM()

    async def main() -> GenerateOutput:
        async with client_for(
            fake, endpoint="completions", model="tiny", cache_salt="salt-A"
        ) as client:
            return await client.generate([4, 5, 6], sampling_params=SP, cache_salt="salt-B")

    out = run(main())
    assert fake.count(COMP) == 1 and fake.bodies[0]["cache_salt"] == "salt-B"
    assert fake.bodies[0]["model"] == "tiny" and out.num_route_rows == 3 + 3 - 1


def test_constructor_validates_options() -> None:
    with pytest.raises(ValueError, match="http"):
        EngineClient("localhost:8000")
    with pytest.raises(ValueError, match="distinct"):
        EngineClient(["http://a", "http://a"])
    with pytest.raises(ValueError, match="endpoint: expected one of 'generate', 'completions'"):
        EngineClient("http://a", endpoint="chat")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"max_concurrency: expected an int in \[1, inf\]"):
        EngineClient("http://a", max_concurrency=0)
    with pytest.raises(TypeError, match="max_concurrency: expected an int"):
        EngineClient("http://a", max_concurrency=2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"max_retries: expected an int in \[0, inf\], found -1"):
        EngineClient("http://a", retry=RetryPolicy(max_retries=-1))
    with pytest.raises(
        ValueError, match=r"max_payload_bytes: expected an int in \[0, inf\], found -1"
    ):
        EngineClient("http://a", max_payload_bytes=-1)
    with pytest.raises(ValueError, match=r"vocab_size: expected an int in \[1, inf\], found 0"):
        EngineClient("http://a", vocab_size=0)
    with pytest.raises(ValueError, match="backoff_max: expected seconds >= 0, found -1"):
        EngineClient("http://a", retry=RetryPolicy(backoff_max=-1))
    with pytest.raises(ValueError, match="protocol: expected one of 'vllm', 'sglang'"):
        EngineClient("http://a", protocol="grpc")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="retry: expected a RetryPolicy, found dict"):
        EngineClient("http://a", retry={"max_retries": 1})  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="retry_timeouts: expected a bool"):
        RetryPolicy(retry_timeouts=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="spec: expected a RouteSpec"):
        EngineClient("http://a", spec=(4, 2))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"transport: expected an httpx\.AsyncBaseTransport"):
        EngineClient("http://a", transport=httpx.HTTPTransport())  # type: ignore[arg-type]


def test_one_request_per_trace_at_a_time() -> None:
    fake = FakeVLLM(FaultPlan().then(Fault.delay(0.05)))
    trace = r3arrow.RouteTrace(SPEC)

    async def main() -> list[Any]:
        async with client_for(fake) as client:
            first = asyncio.create_task(client.generate([1, 2, 3], sampling_params=SP, trace=trace))
            await asyncio.sleep(0.01)
            second = client.generate([1, 2, 3], sampling_params=SP, trace=trace)
            return list(await asyncio.gather(first, second, return_exceptions=True))

    first, second = run(main())
    assert isinstance(first, GenerateOutput) and isinstance(second, TraceStateError)
    assert trace.num_turns == 1 and fake.count() == 1


def test_max_concurrency_bounds_requests_in_flight() -> None:
    fake = FakeVLLM(FaultPlan().then(Fault.delay(0.01), times=None))

    async def main() -> None:
        async with client_for(fake, max_concurrency=2) as client:
            await asyncio.gather(
                *(client.generate([i + 1, 2], sampling_params={"max_tokens": 1}) for i in range(6))
            )

    run(main())
    assert fake.count() == 6 and fake.peak_in_flight == 2


# ------------------------------------------------------------- response decoding
def test_parse_response_accepts_packed_and_nested_routes() -> None:
    routes = rows_for(0, 4)
    for payload in (encode_vllm(routes), encode_packed(routes), routes.tolist()):
        body = orjson.dumps(
            {"choices": [{"token_ids": [9], "finish_reason": "length", "routed_experts": payload}]}
        )
        parsed = parse_response(body, spec=SPEC)
        assert parsed.routes is not None and not parsed.routes.flags.writeable
        np.testing.assert_array_equal(parsed.routes, routes)
        assert parsed.token_ids == [9] and parsed.finish_reason == "length"
    # the base64 string is cut out of the raw body; spacing and escaped "/" still decode right
    b64 = encode_vllm(routes)
    spaced = b'{"choices": [{"token_ids": [9], "routed_experts" :  "' + b64.encode() + b'"}]}'
    np.testing.assert_array_equal(parse_response(spaced, spec=SPEC).routes, routes)
    ones = np.full((3, 4, 2), 255, np.uint8)  # base64 "////..."
    escaped = orjson.dumps(
        {"choices": [{"token_ids": [9], "routed_experts": encode_vllm(ones)}]}
    ).replace(b"/", b"\\/")
    assert b"\\/" in escaped
    np.testing.assert_array_equal(parse_response(escaped).routes, ones)
    two = orjson.dumps({"choices": [{"token_ids": [9], "routed_experts": b64}] * 2})
    with pytest.raises(EngineError, match="exactly one choice"):
        parse_response(two)
    outside = orjson.dumps({"routed_experts": b64, "choices": [{"token_ids": [9]}]})
    with pytest.raises(EngineError, match="found it elsewhere"):
        parse_response(outside)
    with pytest.raises(EngineError, match="at least one generated token"):
        parse_response(b'{"choices": [{"token_ids": [], "routed_experts": null}]}')
    with pytest.raises(EngineError, match="return_token_ids"):
        parse_response(b'{"choices": [{"text": ""}]}', endpoint="completions")
    with pytest.raises(EngineError, match="expected JSON"):
        parse_response(b"<html>")
    with pytest.raises(EngineError, match="expected choices as a non-empty list"):
        parse_response(b'{"choices": []}')
    with pytest.raises(PayloadError, match="ragged"):
        parse_response(b'{"choices": [{"token_ids": [1], "routed_experts": [[[1, 2]], [[1]]]}]}')
    with pytest.raises(RouteDTypeError, match="integer nested lists, found dtype float64"):
        parse_response(b'{"choices": [{"token_ids": [1], "routed_experts": [[[1.5, 2]]]}]}')
    with pytest.raises(PayloadError, match="found int"):
        parse_response(b'{"choices": [{"token_ids": [1], "routed_experts": 7}]}')


def test_parse_response_logprobs_and_stop_reason() -> None:
    gen = {"content": [{"token_id": 4, "logprob": -0.25}, {"token_id": 5, "logprob": -1}]}
    body = orjson.dumps({"choices": [{"token_ids": [4, 5], "logprobs": gen, "stop_reason": 5}]})
    parsed = parse_response(body, want_routes=False)
    assert parsed.logprobs == [-0.25, -1.0] and parsed.stop_reason == 5 and parsed.routes is None
    comp = {"token_logprobs": [-0.5, None]}
    body = orjson.dumps({"choices": [{"token_ids": [4, 5], "logprobs": comp}]})
    lps = parse_response(body, endpoint="completions").logprobs
    assert lps is not None and lps[0] == -0.5 and np.isnan(lps[1])
    bad = orjson.dumps({"choices": [{"token_ids": [4], "logprobs": {"content": [{"x": 1}]}}]})
    with pytest.raises(EngineError, match=r"logprobs.content\[0\].logprob as a number"):
        parse_response(bad)


def test_decode_routes_checks_shape_and_ids_against_the_spec() -> None:
    routes = rows_for(0, 5)
    arr, nbytes = decode_routes(encode_vllm(routes), SPEC)
    np.testing.assert_array_equal(arr, routes)
    assert nbytes == len(encode_vllm(routes))
    with pytest.raises(RouteShapeError, match=r"routed_experts: expected shape \[rows, 4, 3\]"):
        decode_routes(encode_vllm(routes), RouteSpec(num_layers=4, topk=3, num_experts=8))
    narrow = RouteSpec(num_layers=4, topk=2, num_experts=3, moe_layers=SPEC.moe_layers)
    with pytest.raises(ExpertRangeError, match=r"routed_experts: expected expert ids < num_exp"):
        decode_routes(encode_vllm(routes), narrow)
    unchecked, _ = decode_routes(encode_vllm(routes), narrow, check_ids=False)
    np.testing.assert_array_equal(unchecked, routes)
    empty, _ = decode_routes([], SPEC)
    assert empty.shape == (0, 4, 2) and empty.dtype == SPEC.dtype
