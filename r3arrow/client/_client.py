"""`EngineClient`: pooled async HTTP to one set of engine servers, with incremental capture."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import hashlib
import itertools
import math
import random
import zlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal, get_args

import httpx
import numpy as np
import orjson

from r3arrow._checks import (
    check_choice,
    check_int,
    check_nonnegative_int,
    check_optional_int,
    check_positive_int,
)
from r3arrow.capture import OnShort, RouteTrace, check_route_quality
from r3arrow.client import _sglang
from r3arrow.client._protocol import (
    ENDPOINT_PATHS,
    PROMPT_START_KEY,
    Endpoint,
    ParsedResponse,
    build_request,
    check_row_count,
    error_message,
    parse_response,
)
from r3arrow.client._retry import RetryPolicy
from r3arrow.codec import DEFAULT_MAX_RATIO
from r3arrow.errors import (
    DuplicateExpertError,
    EngineError,
    EngineHTTPError,
    EngineResponseError,
    ExpertRangeError,
    PayloadTooLargeError,
    PrefixMismatchError,
    R3ArrowError,
    RouteDTypeError,
    RouteQualityError,
    RouteShapeError,
    TraceStateError,
)
from r3arrow.ids import check_routes
from r3arrow.spec import RouteSpec

_OFFLOAD_BYTES = 1 << 20  # decode larger responses in a worker thread
#: A response holds a route row per token: 1 GiB holds 256K rows of 4 KiB (128 layers x top-8
#: x int32, the widest wire dtype).
_MAX_PAYLOAD_BYTES = 1 << 30
_BODY_SLACK_BYTES = 64 << 20  # JSON beside the route payload (token ids, logprobs)
#: A compressed body decodes to at most DEFAULT_MAX_RATIO x its bytes, never capped below
#: this (the rule of `r3arrow.codec.decode_ipc`).
_RATIO_FLOOR_BYTES = 64 << 20
#: The content codings the client accepts (its Accept-Encoding) and their zlib ``wbits``.
_ENCODINGS = {"gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
_INFLATE_STEP = 1 << 20  # most bytes one decompress call may return
_NO_ROUTES_HINT = "(start vLLM with --enable-return-routed-experts)"
_DEFAULT_RETRY = RetryPolicy()  # frozen: one shared default

#: The wire protocols `EngineClient` speaks (``protocol=``).
Protocol = Literal["vllm", "sglang"]


@dataclasses.dataclass(frozen=True)
class GenerateOutput:
    """One finished generation.

    ``routed_experts``: ``[num_route_rows, L, K]`` read-only, or None; ``token_start``: its
    first row's index in the trace; ``payload_bytes``: as received (base64); ``attempts``: HTTP
    attempts; ``base_url``: the server that answered. ``missing_rows``: the turn's rows the
    trace marked missing under ``on_short="mark"`` (``docs/fallback.md``), ``fallback`` why
    (None when every row arrived); a payload refused then is not in ``routed_experts``.
    """

    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[float] | None
    routed_experts: np.ndarray | None
    prompt_tokens: int
    prompt_start: int
    num_route_rows: int
    payload_bytes: int
    response_bytes: int
    token_start: int | None
    base_url: str
    attempts: int
    stop_reason: int | str | None = None
    missing_rows: int = 0
    fallback: str | None = None


def _inflate(inflate: Any, data: bytes) -> Iterator[bytes]:
    """``data`` decoded a step at a time: a bomb never decodes far past the reader's bound."""
    while True:
        part = inflate.decompress(data, _INFLATE_STEP)
        yield part
        data = inflate.unconsumed_tail
        if not data and len(part) < _INFLATE_STEP:  # else zlib may hold more output
            return


def _score(session_id: str, url: str) -> int:
    digest = hashlib.blake2b(f"{url}\x00{session_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class EngineClient:
    """Async client for one set of engine servers; use as ``async with``.

    ``spec`` is the route shape responses must have (None: see `probe_spec`; SGLang requests
    that return routes need one); ``endpoint`` is vLLM's ``"generate"`` or ``"completions"``;
    sampling parameters go as given, in the protocol's spelling. ``timeout``: seconds one HTTP
    attempt may take in all, connect, send, headers and body (a deadline, not a per-read limit;
    a wait for a ``max_concurrency`` slot is not counted); an attempt past it while connecting
    is retried on the next URL, after that only with ``RetryPolicy.retry_timeouts``.
    ``max_payload_bytes`` bounds a decoded route payload (default 1 GiB: 256K rows of 128 layers
    x top-8 x int32); the decoded body stays within ``max_body_bytes`` (its base64, 4/3 of it, +
    64 MiB of JSON) and, gzip or deflate, `r3arrow.codec.DEFAULT_MAX_RATIO` x its compressed
    bytes (at least 64 MiB), checked as it decodes. ``vocab_size`` bounds prompt ids before
    sending (vLLM with ``--skip-tokenizer-init`` dies on one) and generated ids (else ``[0,
    2**31)``); ``route_quality`` runs `r3arrow.capture.check_route_quality` on every response;
    ``transport`` replaces the network. Argument misuse raises `ValueError`/`TypeError`.
    """

    def __init__(
        self,
        urls: str | Sequence[str],
        spec: RouteSpec | None = None,
        *,
        protocol: Protocol = "vllm",
        endpoint: Endpoint = "generate",
        retry: RetryPolicy = _DEFAULT_RETRY,
        model: str | None = None,
        max_concurrency: int = 64,
        timeout: float = 300.0,
        cache_salt: str | None = None,
        max_payload_bytes: int = _MAX_PAYLOAD_BYTES,
        headers: Mapping[str, str] | None = None,
        vocab_size: int | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        route_quality: bool = True,
    ) -> None:
        given = [urls] if isinstance(urls, str) else list(urls)
        if not given or not all(
            isinstance(u, str) and u.startswith(("http://", "https://")) for u in given
        ):
            raise ValueError(f"urls: expected one or more http(s) URLs, found {urls!r}")
        if len(set(given)) != len(given):
            raise ValueError(f"urls: expected distinct URLs, found {given}")
        if spec is not None and not isinstance(spec, RouteSpec):
            raise TypeError(f"spec: expected a RouteSpec or None, found {type(spec).__name__}")
        check_choice(endpoint, "endpoint", get_args(Endpoint))
        check_choice(protocol, "protocol", get_args(Protocol))
        if not isinstance(retry, RetryPolicy):
            raise TypeError(f"retry: expected a RetryPolicy, found {type(retry).__name__}")
        if protocol == "sglang" and endpoint != "generate":
            raise ValueError(
                f"endpoint: SGLang has one generate endpoint (POST {_sglang.GENERATE_PATH}); "
                f"expected the default 'generate', found {endpoint!r}"
            )
        if not isinstance(route_quality, bool):
            raise TypeError(f"route_quality: expected a bool, found {route_quality!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, int | float):
            raise TypeError(f"timeout: expected seconds as a number, found {timeout!r:.80}")
        if not 0 < timeout < math.inf:
            raise ValueError(f"timeout: expected finite seconds > 0, found {timeout!r}")
        max_concurrency = check_positive_int(max_concurrency, "max_concurrency")
        max_payload_bytes = check_nonnegative_int(max_payload_bytes, "max_payload_bytes")
        vocab_size = check_optional_int(vocab_size, "vocab_size", minimum=1)
        if transport is not None and not isinstance(transport, httpx.AsyncBaseTransport):
            raise TypeError(
                f"transport: expected an httpx.AsyncBaseTransport or None, found "
                f"{type(transport).__name__}"
            )
        self.base_urls: tuple[str, ...] = tuple(u.rstrip("/") for u in given)
        self.spec = spec
        self.endpoint: Endpoint = endpoint
        self.protocol: Protocol = protocol
        self.route_quality = route_quality
        sglang = protocol == "sglang"
        self.path = _sglang.GENERATE_PATH if sglang else ENDPOINT_PATHS[endpoint]
        self._no_routes_hint = _sglang.NO_ROUTES_HINT if sglang else _NO_ROUTES_HINT
        self._reserved = (_sglang.START_KEY, _sglang.RETURN_KEY) if sglang else (PROMPT_START_KEY,)
        self.model = model
        self.max_concurrency = max_concurrency
        self.retry = retry
        self._rng = random.Random(retry.seed)
        self.cache_salt = cache_salt
        self.max_payload_bytes = max_payload_bytes
        # A body holds the base64 payload (4/3 of it) and JSON; a misbehaving engine cannot
        # make the client read on past this bound.
        self.max_body_bytes = self.max_payload_bytes * 4 // 3 + _BODY_SLACK_BYTES
        self.vocab_size = vocab_size
        self.timeout = float(timeout)
        pool = max_concurrency * len(self.base_urls)
        self._http = httpx.AsyncClient(
            timeout=None,  # the per-attempt deadline (_attempt) bounds every phase
            limits=httpx.Limits(max_connections=pool, max_keepalive_connections=pool),
            headers={
                "content-type": "application/json",
                "accept-encoding": ", ".join(_ENCODINGS),
                **dict(headers or {}),
            },
            transport=transport,
        )
        self._sem = asyncio.Semaphore(max_concurrency)
        self._round_robin = itertools.count()
        self._busy_traces: set[int] = set()
        #: Counters; ``data_errors``: 2xx responses rejected (never retried),
        #: ``prefix_mismatches``: requests refused because the prompt does not extend its trace.
        #: ``missing_rows``: rows recorded as missing (``on_short="mark"``).
        names = ("requests", "retries", "payload_bytes", "route_rows", "recorded", "missing_rows")
        self.stats: dict[str, int] = dict.fromkeys((*names, "data_errors", "prefix_mismatches"), 0)

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    def urls_for(self, session_id: str | None) -> list[str]:
        """Base URLs in the order a request of ``session_id`` tries them: rendezvous hashing
        (a session keeps its URL; a server change moves only its sessions), else round robin."""
        if len(self.base_urls) == 1:
            return list(self.base_urls)
        if session_id is None:
            k = next(self._round_robin) % len(self.base_urls)
            return list(self.base_urls[k:] + self.base_urls[:k])
        return sorted(self.base_urls, key=lambda u: _score(session_id, u), reverse=True)

    async def probe_spec(
        self,
        *,
        num_experts: int | None = None,
        token_ids: Sequence[int] | None = None,
        infer_dense: bool = True,
        num_layers: int | None = None,
        topk: int | None = None,
    ) -> RouteSpec:
        """``RouteSpec(L, K, num_experts, moe_layers)`` from one 1-token request at prompt start 0.

        With ``infer_dense``, ``moe_layers`` are the layers with a nonzero id (for ``K == 1``, probe
        with varied ``token_ids``, default ``1 .. 32`` modulo ``vocab_size``, or declare them).
        ``num_layers``/``topk`` are checked against a vLLM response (`RouteShapeError`) and give
        SGLang's shape (default: ``spec``, else `ValueError`). `EngineError` for no routes or zeros.
        """
        if token_ids is None:
            token_ids = [i % (self.vocab_size or 33) for i in range(1, 33)]
        if self.protocol == "sglang":
            shape = _sglang.probe_shape(num_layers, topk, num_experts, self.spec)
            prompt = self._prompt_list(token_ids)
            sp = {"max_new_tokens": 1, "ignore_eos": True}
            body = orjson.dumps(self.build_request(prompt, sp, prompt_start=0))
            content, url, _ = await self._post(body, self.urls_for(None))
            parsed = await self._parse(content, url, shape, want_routes=True)
            routes = parsed.routes
            if routes is not None:
                check_row_count(
                    routes,
                    prompt_tokens=len(prompt),
                    generated_tokens=len(parsed.token_ids),
                    prompt_start=0,
                    url=url,
                )
        else:
            out = await self.generate(
                token_ids, sampling_params={"max_tokens": 1, "ignore_eos": True}
            )
            routes, url = out.routed_experts, out.base_url
            for name, want, axis in (("num_layers", num_layers, 1), ("topk", topk, 2)):
                if want is not None and routes is not None and routes.shape[axis] != want:
                    raise RouteShapeError(
                        f"engine {url}: expected routes of {name}={want}, found shape "
                        f"{list(routes.shape)}"
                    )
        if routes is None:
            raise EngineError(
                f"engine {url} returned no routed_experts; expected [rows, L, K] "
                + self._no_routes_hint
            )
        _, layers, topk = routes.shape
        moe: tuple[int, ...] | None = None
        if infer_dense:
            moe = tuple(int(i) for i in np.flatnonzero(routes.any(axis=(0, 2))))
            if not moe:
                raise EngineError(
                    f"engine {url}: expected a router layer (a nonzero expert id) in "
                    f"the probe's {routes.shape[0]} rows, found all {layers} layers all zeros"
                )
        return RouteSpec(num_layers=layers, topk=topk, num_experts=num_experts, moe_layers=moe)

    def build_request(
        self,
        prompt_token_ids: Sequence[int],
        sampling_params: Mapping[str, Any],
        *,
        prompt_start: int,
        return_routes: bool = True,
        cache_salt: str | None = None,
    ) -> dict[str, Any]:
        """The JSON body for ``prompt_token_ids`` on this client's endpoint."""
        salt = cache_salt if cache_salt is not None else self.cache_salt
        if self.protocol == "sglang":
            return _sglang.build_request(
                prompt_token_ids,
                sampling_params,
                prompt_start=prompt_start,
                return_routes=return_routes,
                cache_salt=salt,
            )
        return build_request(
            self.endpoint,
            prompt_token_ids,
            sampling_params,
            prompt_start=prompt_start,
            return_routes=return_routes,
            model=self.model,
            cache_salt=salt,
        )

    async def _read_capped(self, resp: httpx.Response, url: str) -> bytearray:
        """The decoded body of a streamed response, never more than ``max_body_bytes`` nor, for
        a compressed one, the ratio cap (`PayloadTooLargeError`); `EngineResponseError` for a
        coding it does not accept or a body that does not decode whole."""
        cap = self.max_body_bytes
        declared = resp.headers.get("content-length")
        expected = (
            f"engine {url}: expected a response body <= {cap} bytes "
            f"(max_payload_bytes={self.max_payload_bytes})"
        )
        if declared is not None and declared.isdigit() and int(declared) > cap:
            raise PayloadTooLargeError(f"{expected}, found Content-Length {declared}")
        coding = resp.headers.get("content-encoding", "identity").strip().lower()
        if resp.is_stream_consumed:  # answered from memory (httpx.MockTransport), decoded
            coding = "identity"
        if coding != "identity" and coding not in _ENCODINGS:
            raise EngineResponseError(
                f"engine {url}: expected Content-Encoding gzip, deflate or identity (what the "
                f"client accepts), found {coding!r:.80}",
                url=url,
            )
        inflate = zlib.decompressobj(_ENCODINGS[coding]) if coding in _ENCODINGS else None
        body = bytearray()  # grows in place: no joined copy beside the parts
        raw = 0
        try:
            async for chunk in resp.aiter_bytes() if inflate is None else resp.aiter_raw():
                raw += len(chunk)
                bound = cap
                if inflate is not None:
                    bound = min(cap, max(_RATIO_FLOOR_BYTES, int(DEFAULT_MAX_RATIO * raw)))
                for part in (chunk,) if inflate is None else _inflate(inflate, chunk):
                    if len(body) + len(part) > bound:
                        raise PayloadTooLargeError(
                            f"engine {url}: expected a {coding} body to decode to at most "
                            f"{DEFAULT_MAX_RATIO:g}x its {raw:,} compressed bytes (at least "
                            f"{_RATIO_FLOOR_BYTES:,}), found more"
                            if bound < cap
                            else f"{expected}, found more"
                        )
                    body += part
                if inflate is not None and inflate.unused_data:
                    raise EngineResponseError(
                        f"engine {url}: expected one {coding} stream, found data after the end "
                        f"of its {coding} body",
                        url=url,
                    )
        except zlib.error as exc:
            raise EngineResponseError(
                f"engine {url}: expected a {coding} body, found one that fails to decode ({exc})",
                url=url,
            ) from None
        if inflate is not None and not inflate.eof:
            raise EngineResponseError(
                f"engine {url}: expected a whole {coding} body, found a {coding} body cut short "
                f"after {raw:,} bytes",
                url=url,
            )
        return body

    async def _attempt(self, url: str, body: bytes) -> tuple[httpx.Response, bytearray]:
        """(response, body) of one POST to ``url + path`` within ``timeout`` in all; a missed
        deadline raises httpx's `ConnectTimeout` while connecting, else its `ReadTimeout`."""
        phase = [""]

        async def trace(event: str, info: Any) -> None:  # httpcore's progress events
            phase[0] = event

        request = self._http.build_request(
            "POST", url + self.path, content=body, extensions={"trace": trace}
        )
        try:
            async with asyncio.timeout(self.timeout) as deadline:
                resp = await self._http.send(request, stream=True)
                try:
                    return resp, await self._read_capped(resp, url)
                finally:
                    await resp.aclose()
        except TimeoutError:
            if not deadline.expired():
                raise
            late = httpx.ConnectTimeout if phase[0].startswith("connection.") else httpx.ReadTimeout
            raise late(
                f"no whole response (connect to last body byte) within the timeout={self.timeout:g}"
                " s deadline",
                request=request,
            ) from None

    async def _post(self, body: bytes, urls: list[str]) -> tuple[bytearray, str, int]:
        """(2xx body, base URL, attempts) of a POST with retries; raises `EngineHTTPError` and
        `PayloadTooLargeError` (never retried)."""
        path, policy = self.path, self.retry
        failover = 0
        status: int | None = None
        msg = last = ""
        url = urls[0]
        for attempt in range(policy.max_retries + 1):
            url = urls[failover % len(urls)]
            retry_after: float | None = None
            try:
                async with self._sem:
                    self.stats["requests"] += 1
                    resp, content = await self._attempt(url, body)
            except httpx.TransportError as exc:
                kind = type(exc).__name__
                detail = f": {exc}" if str(exc) else ""
                if not policy.retries_exception(exc):
                    raise EngineHTTPError(
                        f"engine request to {url}{path} timed out ({kind}{detail})", url=url
                    ) from exc
                status, msg = None, ""
                last = f"{kind} from {url}{detail}"
                failover += policy.fails_over(exc)
            else:
                status = resp.status_code
                if 200 <= status < 300:
                    return content, url, attempt + 1
                msg = error_message(content)
                if not policy.retries_status(status):
                    raise EngineHTTPError(
                        f"engine {url}{path} rejected the request: HTTP {status}: {msg}",
                        status=status,
                        body=msg,
                        url=url,
                    )
                last = f"HTTP {status} from {url}: {msg}"
                retry_after = policy.retry_after(resp)
            if attempt == policy.max_retries:
                break
            self.stats["retries"] += 1
            await asyncio.sleep(policy.delay(attempt, retry_after, self._rng))
        raise EngineHTTPError(
            f"engine {url}{path} failed after {policy.max_retries + 1} attempts: {last}",
            status=status,
            body=msg,
            url=url,
        )

    def _prompt_list(self, prompt_token_ids: Sequence[int]) -> list[int]:
        """The prompt as checked plain ints (numpy scalars are not JSON-serialisable)."""
        ids = np.asarray(prompt_token_ids)
        if ids.size == 0:
            raise ValueError("prompt_token_ids: expected at least one token, found none")
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise ValueError(
                f"prompt_token_ids: expected a flat sequence of int token ids, found shape "
                f"{list(ids.shape)} of dtype {ids.dtype}"
            )
        vocab = self.vocab_size
        bad = np.flatnonzero((ids < 0) if vocab is None else (ids < 0) | (ids >= vocab))
        if bad.size:
            bound = vocab if vocab is not None else "vocab"
            raise ValueError(
                f"prompt_token_ids: expected ids in [0, {bound}), "
                f"found {int(ids[bad[0]])} at position {int(bad[0])}"
            )
        prompt: list[int] = ids.tolist()
        return prompt

    def _check_trace(self, trace: RouteTrace, prompt: list[int]) -> tuple[RouteSpec, np.ndarray]:
        """(spec responses for ``trace`` must have, prompt ids checked to extend it)."""
        prompt_tokens = len(prompt)
        if self.spec is not None and not self.spec.same_shape(trace.spec):
            raise RouteShapeError(
                f"trace: expected routes shaped like {self.spec}, found {trace.spec}"
            )
        if trace.finalized:
            raise TraceStateError("trace: already finalized; expected an open trace")
        captured = trace.captured
        if prompt_tokens <= captured or prompt_tokens < trace.seen_tokens:
            raise RouteShapeError(
                f"prompt_token_ids: expected the conversation to extend the trace's "
                f"{trace.seen_tokens} tokens (and exceed captured={captured}), "
                f"found {prompt_tokens} tokens"
            )
        if id(trace) in self._busy_traces:
            raise TraceStateError(
                "trace: a request for this trace is already in flight; expected one at a time"
            )
        try:
            ids = trace.check_extends(prompt)
        except PrefixMismatchError:
            self.stats["prefix_mismatches"] += 1
            raise
        return trace.spec, ids

    async def _parse(
        self, content: bytearray, url: str, spec: RouteSpec | None, *, want_routes: bool
    ) -> ParsedResponse:
        """A 2xx body parsed in this client's protocol; an `EngineResponseError` names ``url``."""
        parser: Any = (
            _sglang.parse_response
            if self.protocol == "sglang"
            else functools.partial(parse_response, endpoint=self.endpoint)
        )
        # Route ids are checked after the quality guard (`_accept`): there without a trace, in
        # trace.record with one. SGLang's codec range-checks ids as it decodes.
        parse: Callable[[bytearray], ParsedResponse] = functools.partial(
            parser,
            spec=spec,
            max_payload_bytes=self.max_payload_bytes,
            want_routes=want_routes,
            check_ids=False,
            vocab_size=self.vocab_size,
        )
        try:
            if len(content) > _OFFLOAD_BYTES:  # keep the event loop responsive while decoding
                return await asyncio.to_thread(parse, content)
            return parse(content)
        except EngineResponseError as exc:
            exc.url = url
            raise

    async def _accept(
        self,
        content: bytearray,
        url: str,
        spec: RouteSpec | None,
        return_routes: bool,
        trace: RouteTrace | None,
        ids: np.ndarray | None,
        p: int,
        prompt_start: int,
        on_short: OnShort = "error",
    ) -> tuple[ParsedResponse, int | None, int, str | None]:
        """Decode a 2xx body, check it and record it into ``trace``: (parsed, token start,
        rows marked missing, why). Under ``on_short="mark"`` a route payload that is short,
        fails to decode, is refused by the quality guard or the id rules, or is null marks the
        turn's missing rows instead of raising (``docs/fallback.md``); the tokens must parse."""
        marking = on_short == "mark" and trace is not None
        fallback: str | None = None
        try:
            parsed = await self._parse(content, url, spec, want_routes=return_routes)
        except R3ArrowError as exc:
            if not marking:
                raise
            try:  # the tokens without the payload: did the payload alone fail?
                parsed = await self._parse(content, url, spec, want_routes=False)
            except R3ArrowError:
                raise exc from None
            fallback = f"route payload refused ({type(exc).__name__}: {exc})"
        g = len(parsed.token_ids)
        routes = parsed.routes
        token_start: int | None = None
        want = p - prompt_start + g - 1
        if routes is not None:
            if not marking or routes.shape[0] > want:  # more rows: never truncated
                check_row_count(
                    routes, prompt_tokens=p, generated_tokens=g, prompt_start=prompt_start, url=url
                )
            if spec is not None:
                # The guard runs before the id rules: a zeroed router layer is also a
                # duplicate, and the engine-bug message is the one that explains it.
                try:
                    if self.route_quality:
                        check_route_quality(routes, spec, what=f"routed_experts from {url}")
                except RouteQualityError as exc:
                    if not marking:
                        raise
                    routes, fallback = None, f"route payload refused ({exc})"
                if trace is None and routes is not None:
                    check_routes(routes, spec, what="routed_experts", exact=False)
        elif trace is not None and not marking:
            raise EngineError(
                f"engine {url} returned no routed_experts; expected {want} rows "
                + self._no_routes_hint
            )
        missing = 0
        if trace is not None:
            record = functools.partial(
                trace.record,
                prompt_tokens=p,
                generated_tokens=g,
                prompt_ids=ids,
                generated_ids=parsed.token_ids,
                on_short=on_short,
            )
            try:
                token_start = record(routes)
            except (DuplicateExpertError, ExpertRangeError, RouteDTypeError, RouteShapeError) as e:
                if not marking or routes is None:
                    raise
                # The trace is unchanged: the whole turn is marked instead.
                routes, fallback = None, f"route payload refused ({e})"
                token_start = record(None)
            # Recorded: the rows that arrived fill the turn's first positions, the rest marked.
            missing = want - (0 if routes is None else int(routes.shape[0]))
            if missing and fallback is None:
                fallback = (
                    f"short route payload ({want - missing} of {want} rows)"
                    if routes is not None
                    else "no routed_experts"
                )
            self.stats["recorded"] += 1
            self.stats["missing_rows"] += missing
        if routes is not parsed.routes:  # a refused payload is not handed on as routes
            parsed = dataclasses.replace(parsed, routes=routes)
        return parsed, token_start, missing, fallback

    async def generate(
        self,
        prompt_token_ids: Sequence[int],
        *,
        sampling_params: Mapping[str, Any] | None = None,
        trace: RouteTrace | None = None,
        prompt_start: int = 0,
        session_id: str | None = None,
        cache_salt: str | None = None,
        return_routes: bool = True,
        on_short: OnShort = "error",
    ) -> GenerateOutput:
        """Generate after ``prompt_token_ids``, the whole conversation so far (P tokens).

        With ``trace`` (whose tokens the prompt must extend), sends ``trace.captured`` as the prompt
        start and records the ``P - captured + G - 1`` rows once checked; any error leaves it
        unchanged. Else sends ``prompt_start`` in ``[0, P)``. ``session_id`` pins a base URL
        (default: the trace's). Raises `ValueError`/`TypeError`, `PrefixMismatchError` and
        `TraceStateError` before sending, then `EngineHTTPError`, `EngineError` and data errors
        (never retried; ``stats["data_errors"]``): `EngineResponseError`, `PayloadError`,
        `RouteShapeError`, `ExpertRangeError`, `DuplicateExpertError`, `RouteQualityError`;
        whatever the engine answers, nothing but an `R3ArrowError`. ``on_short="mark"`` (with a
        ``trace``; ``docs/fallback.md``): a short, undecodable, refused or null route payload
        is recorded with the missing rows marked (``missing_rows``, ``fallback``) instead of
        raising; more rows than asked, token and HTTP errors raise as ever.
        """
        check_choice(on_short, "on_short", get_args(OnShort))
        if on_short == "mark" and trace is None:
            raise ValueError("on_short='mark': expected a trace to mark rows in, found none")
        prompt = self._prompt_list(prompt_token_ids)
        p = len(prompt)
        sp = dict(sampling_params or {})
        if sp.get("n", 1) != 1 or sp.get("stream"):
            raise ValueError(
                f"sampling_params: expected one non-streamed sample per request (n=1, no stream), "
                f"found n={sp.get('n', 1)!r}, stream={sp.get('stream')!r}"
            )
        for key in self._reserved:
            if key in sp:
                raise ValueError(
                    f"sampling_params: {key} is set by the client "
                    "(from the trace, or the prompt_start argument); found it in sampling_params"
                )
        spec = self.spec
        ids: np.ndarray | None = None
        if trace is not None:
            if not return_routes:
                raise ValueError("return_routes=False with a trace: expected routes to record")
            spec, ids = self._check_trace(trace, prompt)
            prompt_start = trace.captured
        else:
            prompt_start = check_int(prompt_start, "prompt_start", minimum=0, maximum=p - 1)
        if session_id is None and trace is not None:
            session_id = f"trace-{id(trace):x}"
        body = orjson.dumps(
            self.build_request(
                prompt,
                sp,
                prompt_start=prompt_start,
                return_routes=return_routes,
                cache_salt=cache_salt,
            )
        )
        if trace is not None:
            self._busy_traces.add(id(trace))
        try:
            content, url, attempts = await self._post(body, self.urls_for(session_id))
            try:
                parsed, token_start, missing, fallback = await self._accept(
                    content, url, spec, return_routes, trace, ids, p, prompt_start, on_short
                )
            except R3ArrowError as exc:
                if not isinstance(exc, EngineHTTPError):
                    self.stats["data_errors"] += 1  # the engine answered: never retried
                if trace is not None and exc.trajectory_id is None:
                    exc.trajectory_id = trace.trajectory_id  # which sample to drop
                raise
        finally:
            if trace is not None:
                self._busy_traces.discard(id(trace))
        routes = parsed.routes
        rows = 0 if routes is None else routes.shape[0]
        self.stats["payload_bytes"] += parsed.payload_bytes
        self.stats["route_rows"] += rows
        return GenerateOutput(
            token_ids=parsed.token_ids,
            finish_reason=parsed.finish_reason,
            logprobs=parsed.logprobs,
            routed_experts=routes,
            prompt_tokens=p,
            prompt_start=prompt_start,
            num_route_rows=rows,
            payload_bytes=parsed.payload_bytes,
            response_bytes=len(content),
            token_start=token_start,
            base_url=url,
            attempts=attempts,
            stop_reason=parsed.stop_reason,
            missing_rows=missing,
            fallback=fallback,
        )
