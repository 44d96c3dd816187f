"""EngineClient's protocol-independent behaviour over both wire protocols, on `httpx.MockTransport`.

`FakeEngine` answers vLLM's ``/inference/v1/generate`` and SGLang's ``/generate`` in-process:
each request generates ``max_tokens`` (vLLM) / ``max_new_tokens`` (SGLang) tokens, and the
route row of token position ``t`` is a fixed function of ``t`` (`rows_for`), so every captured
row can be checked. Every test runs for both protocols: incremental capture (row counts, the
start field, multi-turn), retries (5xx, dropped connections, ``Retry-After``), bad responses
(malformed payloads, short/extra rows, missing routes, duplicate ids), size caps and the
route-quality guard. Faults are the embedded engine's (`FaultPlan`, `corrupt_routes` with the
protocol's wire). Over real HTTP: test_sglang.py.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import numpy as np
import orjson
import pytest

import r3arrow
from r3arrow.client import EngineClient, GenerateOutput, Protocol, RetryPolicy
from r3arrow.client import _client as client_module
from r3arrow.codec import encode_sglang, encode_vllm
from r3arrow.errors import (
    DuplicateExpertError,
    EngineError,
    EngineHTTPError,
    ExpertRangeError,
    PayloadError,
    PayloadTooLargeError,
    R3ArrowError,
    RouteDTypeError,
    RouteQualityError,
    RouteShapeError,
)
from r3arrow.spec import RouteSpec, routes_to_numpy
from r3arrow.testing.engine import Fault, FaultPlan, corrupt_routes
from r3arrow.testing.engine._protocol import error_body, status_type
from r3arrow.testing.engine.faults import Wire

URL = "http://engine.test"
SPEC = RouteSpec(num_layers=4, topk=2, num_experts=8, moe_layers=(1, 2, 3))
PROTOCOLS: tuple[Protocol, ...] = ("vllm", "sglang")
PATH = {"vllm": "/inference/v1/generate", "sglang": "/generate"}
START = {"vllm": "routed_experts_prompt_start", "sglang": "routed_experts_start_len"}

pytestmark = pytest.mark.parametrize("protocol", PROTOCOLS)


def sp(protocol: Protocol, tokens: int = 3) -> dict[str, Any]:
    """Sampling parameters in the protocol's own spelling."""
    key = "max_tokens" if protocol == "vllm" else "max_new_tokens"
    return {key: tokens, "temperature": 0.0}


def rows_for(start: int, stop: int) -> np.ndarray:
    """The route rows of token positions ``start .. stop - 1``: ``[rows, 4, 2]`` uint8."""
    t = np.arange(start, stop)[:, None]
    layer = np.arange(4)[None, :]
    first = (3 * t + layer) % 8
    second = (first + 1 + t % 3) % 8
    rows = np.stack([first, second], axis=-1).astype(np.uint8)
    rows[:, 0] = 0  # layer 0 is dense: both engines report zeros
    return rows


class FakeEngine:
    """vLLM's generate and SGLang's ``/generate`` as an async `httpx.MockTransport` handler."""

    def __init__(self, plan: FaultPlan | None = None) -> None:
        self.plan = plan if plan is not None else FaultPlan()
        self.bodies: list[dict[str, Any]] = []
        self.connect_errors = 0

    def transport(self) -> httpx.MockTransport:
        return httpx.MockTransport(self.handle)

    def count(self) -> int:
        return len(self.bodies)

    async def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        body = orjson.loads(request.content)
        self.bodies.append(body)
        if self.connect_errors:
            self.connect_errors -= 1
            raise httpx.ConnectError("connection refused", request=request)
        fault = self.plan.take(path)
        sglang = path == PATH["sglang"]
        if fault is not None and fault.kind == "status":
            code = fault.status_code
            headers = {} if fault.retry_after is None else {"retry-after": f"{fault.retry_after:g}"}
            message = f"injected fault: HTTP {code}"
            err = (
                {"error": {"message": message}}
                if sglang
                else error_body(code, message, err_type=status_type(code))
            )
            return httpx.Response(code, json=err, headers=headers)
        if fault is not None and fault.kind == "drop_connection":
            raise httpx.RemoteProtocolError("Server disconnected", request=request)
        if sglang:
            prompt, params = body["input_ids"], body["sampling_params"]
            g = int(params.get("max_new_tokens", 128))
            start = int(body.get("routed_experts_start_len", 0))
        else:
            prompt, params = body["token_ids"], body["sampling_params"]
            g = int(params.get("max_tokens", 16))
            start = int(params.get("routed_experts_prompt_start", 0))
        tokens = [(sum(prompt) + i) % 500 + 1 for i in range(g)]
        rows = rows_for(start, len(prompt) + g - 1)
        wire: Wire = "sglang" if sglang else "npy"
        routes: str | None
        if fault is None:
            routes = encode_sglang(rows) if sglang else encode_vllm(rows)
        else:
            routes = corrupt_routes(rows, fault, wire=wire)
        if sglang:
            meta: dict[str, Any] = {
                "id": "r",
                "finish_reason": {"type": "length", "length": g},
                "prompt_tokens": len(prompt),
                "completion_tokens": g,
            }
            if routes is not None and body.get("return_routed_experts"):
                meta["routed_experts"] = routes
            return httpx.Response(200, json={"output_ids": tokens, "meta_info": meta})
        choice = {"index": 0, "finish_reason": "length", "token_ids": tokens}
        choice["routed_experts"] = routes
        return httpx.Response(200, json={"choices": [choice]})


def client_for(
    fake: FakeEngine, protocol: Protocol, spec: RouteSpec | None = SPEC, **kw: Any
) -> EngineClient:
    return EngineClient(URL, spec, protocol=protocol, transport=fake.transport(), **kw)


def run(coro: Awaitable[Any]) -> Any:
    async def main() -> Any:
        return await coro

    return asyncio.run(main())


def trace_rows(trace: r3arrow.RouteTrace, num_tokens: int) -> np.ndarray:
    arr = trace.finalize(num_tokens=num_tokens, loss_mask=np.zeros(num_tokens, np.uint8))
    return routes_to_numpy(arr, trace.spec)


def snapshot(trace: r3arrow.RouteTrace) -> tuple[int, int, int]:
    return trace.captured, trace.seen_tokens, trace.num_turns


def sent_start(protocol: Protocol, body: dict[str, Any]) -> int:
    where = body if protocol == "sglang" else body["sampling_params"]
    start: int = where[START[protocol]]
    return start


# ------------------------------------------------------------ incremental capture
def test_multi_turn_capture_sends_captured_as_start(protocol: Protocol) -> None:
    fake = FakeEngine()
    trace = r3arrow.RouteTrace(SPEC)

    async def main() -> tuple[list[int], list[GenerateOutput]]:
        conv = list(range(1, 12))
        outs = []
        async with client_for(fake, protocol) as client:
            for turn in range(3):
                out = await client.generate(conv, sampling_params=sp(protocol), trace=trace)
                outs.append(out)
                conv += out.token_ids + ([7, 9] if turn < 2 else [])
        return conv, outs

    conv, outs = run(main())
    starts = [sent_start(protocol, b) for b in fake.bodies]
    assert starts == [0, 13, 18]  # P=11, G=3: 11+3-1 rows, then 16+3-1-13, then 21+3-1-18
    assert [o.num_route_rows for o in outs] == [13, 5, 5]
    assert [o.token_start for o in outs] == [0, 13, 18]
    assert all(o.finish_reason == "length" for o in outs)
    assert trace.captured == len(conv) - 1
    np.testing.assert_array_equal(trace_rows(trace, len(conv)), rows_for(0, len(conv) - 1))


def test_without_trace_the_start_is_sent_as_given(protocol: Protocol) -> None:
    fake = FakeEngine()

    async def main() -> GenerateOutput:
        async with client_for(fake, protocol) as client:
            out: GenerateOutput = await client.generate(
                list(range(10)), sampling_params=sp(protocol, 2), prompt_start=10 - 1
            )
            return out

    out = run(main())
    assert sent_start(protocol, fake.bodies[0]) == 9
    assert out.num_route_rows == 10 - 9 + 2 - 1 and out.routed_experts is not None
    np.testing.assert_array_equal(out.routed_experts, rows_for(9, 11))


def test_start_fields_in_sampling_params_are_refused(protocol: Protocol) -> None:
    fake = FakeEngine()

    async def main() -> None:
        async with client_for(fake, protocol) as client:
            bad = {**sp(protocol), START[protocol]: 0}
            await client.generate([1, 2, 3], sampling_params=bad)

    with pytest.raises(ValueError, match="set by the client"):
        run(main())
    assert fake.count() == 0


def test_probe_spec_reads_shape_and_dense_layers(protocol: Protocol) -> None:
    fake = FakeEngine()

    async def main() -> RouteSpec:
        async with client_for(fake, protocol, None) as client:
            shape = (4, 2) if protocol == "sglang" else (None, None)
            spec: RouteSpec = await client.probe_spec(
                num_experts=8, num_layers=shape[0], topk=shape[1]
            )
            return spec

    assert run(main()) == SPEC


# ------------------------------------------------------------------------ retries
@pytest.mark.parametrize("failure", ["503", "500", "429", "drop_connection", "connect_error"])
def test_transient_failures_are_retried_and_recorded_once(protocol: Protocol, failure: str) -> None:
    fake = FakeEngine()
    if failure.isdigit():
        fake.plan.then(Fault.status(int(failure)), times=2)
    elif failure == "drop_connection":
        fake.plan.then(Fault.drop_connection(), times=2)
    else:
        fake.connect_errors = 2
    trace = r3arrow.RouteTrace(SPEC)

    async def main() -> tuple[GenerateOutput, dict[str, int]]:
        async with client_for(fake, protocol, retry=RetryPolicy(backoff_base=0.001)) as client:
            out = await client.generate(
                list(range(1, 9)), sampling_params=sp(protocol), trace=trace
            )
            return out, client.stats

    out, stats = run(main())
    assert fake.count() == 3 and out.attempts == 3
    assert stats["retries"] == 2 and stats["recorded"] == 1
    assert trace.captured == 8 + 3 - 1
    np.testing.assert_array_equal(trace_rows(trace, 11), rows_for(0, 10))


def test_retry_after_is_honoured(protocol: Protocol) -> None:
    fake = FakeEngine(FaultPlan().then(Fault.status(503, retry_after=0.2)))

    async def main() -> GenerateOutput:
        async with client_for(fake, protocol, retry=RetryPolicy(backoff_base=0.001)) as client:
            out: GenerateOutput = await client.generate([1, 2, 3], sampling_params=sp(protocol))
            return out

    began = time.perf_counter()
    out = run(main())
    assert time.perf_counter() - began >= 0.2 and out.attempts == 2


@pytest.mark.parametrize("code", [400, 404, 422])
def test_client_errors_fail_at_once_with_the_engine_message(protocol: Protocol, code: int) -> None:
    fake = FakeEngine(FaultPlan().then(Fault.status(code), times=None))
    trace = r3arrow.RouteTrace(SPEC)

    async def main() -> None:
        async with client_for(fake, protocol, retry=RetryPolicy(max_retries=5)) as client:
            await client.generate([1, 2, 3], sampling_params=sp(protocol), trace=trace)

    with pytest.raises(EngineHTTPError, match=rf"HTTP {code}: injected fault") as info:
        run(main())
    assert info.value.status == code and info.value.body == f"injected fault: HTTP {code}"
    assert fake.count() == 1 and snapshot(trace) == (0, 0, 0)


def test_retries_exhausted_leave_the_trace(protocol: Protocol) -> None:
    fake = FakeEngine(FaultPlan().then(Fault.status(502), times=None))
    trace = r3arrow.RouteTrace(SPEC)

    async def main() -> None:
        async with client_for(
            fake, protocol, retry=RetryPolicy(backoff_base=0.001, max_retries=2)
        ) as client:
            await client.generate([1, 2, 3], sampling_params=sp(protocol), trace=trace)

    with pytest.raises(EngineHTTPError, match=r"after 3 attempts.*HTTP 502"):
        run(main())
    assert fake.count() == 3 and snapshot(trace) == (0, 0, 0)


# ------------------------------------------------------------------ bad responses
@pytest.mark.parametrize("mode", ["base64", "not_npy", "object", "float", "truncated", "shape"])
def test_malformed_payload_is_a_data_error_and_leaves_the_trace(
    protocol: Protocol, mode: str
) -> None:
    fake = FakeEngine()
    trace = r3arrow.RouteTrace(SPEC)
    prompt = list(range(2, 12))

    async def main() -> tuple[R3ArrowError, list[int], dict[str, int]]:
        async with client_for(fake, protocol, retry=RetryPolicy(backoff_base=0.001)) as client:
            first = await client.generate(prompt, sampling_params=sp(protocol), trace=trace)
            conv = prompt + first.token_ids + [1, 2]
            before = snapshot(trace)
            fake.plan.then(Fault.malformed_routes(mode))  # type: ignore[arg-type]
            with pytest.raises(R3ArrowError) as info:
                await client.generate(conv, sampling_params=sp(protocol), trace=trace)
            assert snapshot(trace) == before
            again = await client.generate(conv, sampling_params=sp(protocol), trace=trace)
            return info.value, conv + again.token_ids, client.stats

    err, conv, stats = run(main())
    # SGLang's raw int32 has no dtype header: float bits arrive as ids far out of range
    kinds = (PayloadError, RouteShapeError, RouteDTypeError, ExpertRangeError)
    assert isinstance(err, kinds) and "routed_experts" in str(err)
    assert fake.count() == 3 and stats["data_errors"] == 1 and stats["retries"] == 0
    np.testing.assert_array_equal(trace_rows(trace, len(conv)), rows_for(0, len(conv) - 1))


@pytest.mark.parametrize("fault", [Fault.short_routes(1), Fault.extra_routes(2)])
def test_wrong_row_count_is_a_data_error(protocol: Protocol, fault: Fault) -> None:
    fake = FakeEngine(FaultPlan().then(fault))
    trace = r3arrow.RouteTrace(SPEC)

    async def main() -> None:
        async with client_for(fake, protocol, retry=RetryPolicy(backoff_base=0.001)) as client:
            await client.generate(list(range(1, 11)), sampling_params=sp(protocol), trace=trace)

    want = 10 + 3 - 1
    found = want - fault.rows if fault.kind == "short_routes" else want + fault.rows
    with pytest.raises(RouteShapeError, match=rf"expected {want} rows .* found {found}"):
        run(main())
    assert fake.count() == 1 and snapshot(trace) == (0, 0, 0)


def test_missing_routes_with_a_trace_is_an_engine_error(protocol: Protocol) -> None:
    fake = FakeEngine(FaultPlan().then(Fault.no_routes(), times=2))
    trace = r3arrow.RouteTrace(SPEC)
    engine = "SGLang" if protocol == "sglang" else "vLLM"

    async def main() -> GenerateOutput:
        async with client_for(fake, protocol) as client:
            with pytest.raises(EngineError, match=f"start {engine} with --enable-return"):
                await client.generate([5, 6, 7], sampling_params=sp(protocol), trace=trace)
            out: GenerateOutput = await client.generate([5, 6, 7], sampling_params=sp(protocol))
            return out

    plain = run(main())
    assert snapshot(trace) == (0, 0, 0) and plain.routed_experts is None


@pytest.mark.parametrize("with_trace", [True, False])
def test_duplicate_experts_are_a_data_error(protocol: Protocol, with_trace: bool) -> None:
    fake = FakeEngine(FaultPlan().then(Fault.duplicate_experts()))
    trace = r3arrow.RouteTrace(SPEC) if with_trace else None

    async def main() -> dict[str, int]:
        async with client_for(fake, protocol) as client:
            with pytest.raises(DuplicateExpertError, match="distinct experts") as info:
                await client.generate(list(range(1, 11)), sampling_params=sp(protocol), trace=trace)
            assert info.value.layer == 1 and info.value.token == 6
            return client.stats

    stats = run(main())
    assert fake.count() == 1 and stats["data_errors"] == 1
    assert trace is None or snapshot(trace) == (0, 0, 0)


def test_expert_ids_out_of_range_for_the_spec(protocol: Protocol) -> None:
    narrow = RouteSpec(num_layers=4, topk=2, num_experts=2, moe_layers=SPEC.moe_layers)
    fake = FakeEngine()

    async def main() -> None:
        async with client_for(fake, protocol, narrow) as client:
            await client.generate(
                list(range(30)), sampling_params=sp(protocol), trace=r3arrow.RouteTrace(narrow)
            )

    with pytest.raises(ExpertRangeError, match=r"expected expert ids < num_experts=2"):
        run(main())


# ---------------------------------------------------------------------- size caps
def test_payload_past_max_payload_bytes_is_refused(protocol: Protocol) -> None:
    fake = FakeEngine()
    trace = r3arrow.RouteTrace(SPEC)

    async def main() -> None:
        async with client_for(fake, protocol, max_payload_bytes=64) as client:
            await client.generate(list(range(40)), sampling_params=sp(protocol), trace=trace)

    with pytest.raises(PayloadTooLargeError, match=r"max_bytes=64"):
        run(main())
    assert fake.count() == 1 and snapshot(trace) == (0, 0, 0)


def test_body_past_max_body_bytes_is_refused_not_retried(protocol: Protocol) -> None:
    fake = FakeEngine()
    trace = r3arrow.RouteTrace(SPEC)

    async def main() -> None:
        async with client_for(fake, protocol, retry=RetryPolicy(max_retries=3)) as client:
            client.max_body_bytes = 200
            await client.generate(list(range(1, 30)), sampling_params=sp(protocol), trace=trace)

    with pytest.raises(PayloadTooLargeError, match="response body <= 200 bytes"):
        run(main())
    assert fake.count() == 1 and snapshot(trace) == (0, 0, 0)


# -------------------------------------------------------------- route-quality guard
def _failing_guard(calls: list[int]) -> Callable[..., None]:
    def guard(rows: np.ndarray, spec: RouteSpec, *, what: str = "routes") -> None:
        calls.append(rows.shape[0])
        if len(calls) == 1:
            raise RouteQualityError(f"{what}: looks like a known engine bug")

    return guard


@pytest.mark.parametrize("enabled", [True, False])
def test_route_quality_failure_is_a_data_error(
    protocol: Protocol, enabled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    monkeypatch.setattr(client_module, "check_route_quality", _failing_guard(calls))
    fake = FakeEngine()
    trace = r3arrow.RouteTrace(SPEC)

    async def main() -> dict[str, int]:
        async with client_for(fake, protocol, route_quality=enabled) as client:
            conv = list(range(1, 9))
            if enabled:
                with pytest.raises(RouteQualityError, match="known engine bug") as info:
                    await client.generate(conv, sampling_params=sp(protocol), trace=trace)
                assert info.value.trajectory_id == trace.trajectory_id
                assert snapshot(trace) == (0, 0, 0)
            await client.generate(conv, sampling_params=sp(protocol), trace=trace)
            return client.stats

    stats = run(main())
    assert stats["data_errors"] == int(enabled) and stats["retries"] == 0
    assert calls == ([10, 10] if enabled else [])
    assert trace.captured == 10 and fake.count() == 1 + int(enabled)


def test_route_quality_is_checked_without_a_trace(
    protocol: Protocol, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[int] = []
    monkeypatch.setattr(client_module, "check_route_quality", _failing_guard(calls))
    fake = FakeEngine()

    async def main() -> None:
        async with client_for(fake, protocol) as client:
            await client.generate([1, 2, 3], sampling_params=sp(protocol))

    with pytest.raises(RouteQualityError):
        run(main())
    assert calls == [3 + 3 - 1]
