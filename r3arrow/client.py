"""Async engine client: vLLM's token-in/token-out generate API with incremental route capture.

`EngineClient` sends a whole conversation as the prompt and, with a `RouteTrace`,
``routed_experts_prompt_start = trace.captured`` (DESIGN §2), so each response carries only
the rows the trace lacks: ``P - captured + G - 1`` of them. The rows are decoded (base64
``.npy``, no pickle), checked (shape, row count, id range) and recorded into the trace once,
after a successful decode; any error leaves the trace unchanged.

Transport: one pooled `httpx.AsyncClient` for a set of base URLs, a concurrency limit,
timeouts, retries with exponential backoff and jitter on connection errors, 429 and 5xx
(never on other 4xx, never on data errors), and sticky routing of a session to one base URL
(rendezvous hashing) so the engine's prefix cache keeps working across turns.
"""

from __future__ import annotations

import asyncio
import dataclasses
import email.utils
import hashlib
import itertools
import math
import random
import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import httpx
import numpy as np
import orjson

from r3arrow.codec import DEFAULT_MAX_BYTES, decode_packed, decode_vllm
from r3arrow.errors import (
    EngineError,
    EngineHTTPError,
    PayloadError,
    PayloadTooLargeError,
    RouteDTypeError,
    RouteShapeError,
    TraceStateError,
)
from r3arrow.spec import RouteSpec, check_route_ids
from r3arrow.trace import RouteTrace, expected_rows

Endpoint = Literal["generate", "completions"]

#: Request paths of the two supported endpoints.
ENDPOINT_PATHS: dict[str, str] = {
    "generate": "/inference/v1/generate",
    "completions": "/v1/completions",
}
_RETRY_STATUS_MIN = 500
_OFFLOAD_BYTES = 1 << 20  # decode larger responses in a worker thread
_BODY_SLACK_BYTES = 64 << 20  # JSON beside the route payload (token ids, logprobs)


@dataclasses.dataclass(frozen=True)
class GenerateOutput:
    """One finished generation.

    ``routed_experts`` is ``[num_route_rows, L, K]`` (rows for tokens ``prompt_start ..
    P + G - 2``; read-only) or None when the engine returned none. ``token_start`` is the token
    index of its first row in the trace (None without a trace). ``payload_bytes`` counts the
    route payload as received (base64 characters); ``response_bytes`` the whole HTTP body.
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


@dataclasses.dataclass(frozen=True)
class ParsedResponse:
    """The parts of an engine response the client uses (see `parse_response`)."""

    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None
    logprobs: list[float] | None
    routes: np.ndarray | None
    payload_bytes: int


def _error_message(body: bytes) -> str:
    """Best-effort error text of an engine error body (vLLM: ``{"error": {"message": ...}}``)."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body[:500].decode(errors="replace")
    if isinstance(obj, dict):
        err = obj.get("error", obj.get("detail", obj.get("message")))
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])[:2000]
        if err is not None:
            return str(err)[:2000]
    return body[:500].decode(errors="replace")


_ROUTES_KEY = b'"routed_experts"'
_LIFTED = "\x00r3arrow:lifted"
_LIFTED_JSON = orjson.dumps(_LIFTED)
_JSON_SPACE = b" \t\r\n"


def _lift_routes(body: bytes) -> tuple[bytes, memoryview | None]:
    """Cut a base64 ``routed_experts`` string out of a JSON body without JSON-parsing it.

    A base64 payload is most of a response and JSON-parsing it into a str costs ~10x its
    decode; base64 has no characters JSON escapes, so the raw bytes between its quotes are
    the payload. Returns (body with a placeholder string, payload view) when the key occurs
    exactly once with a string value, else (body, None) and the caller parses normally.
    """
    i = body.find(_ROUTES_KEY)
    if i < 0:
        return body, None
    j = i + len(_ROUTES_KEY)
    n = len(body)
    while j < n and body[j] in _JSON_SPACE:
        j += 1
    if j >= n or body[j] != 0x3A:  # ':'
        return body, None
    j += 1
    while j < n and body[j] in _JSON_SPACE:
        j += 1
    if j >= n or body[j] != 0x22:  # '"': a string value (null/list/dict take the slow path)
        return body, None
    end = body.find(b'"', j + 1)
    # a second key (n > 1) or an escape sequence (a JSON encoder escaping "/") take the slow path
    if end < 0 or body.find(_ROUTES_KEY, end) >= 0 or body.find(b"\\", j + 1, end) >= 0:
        return body, None
    return body[:j] + _LIFTED_JSON + body[end + 1 :], memoryview(body)[j + 1 : end]


def decode_routes(
    value: Any,
    spec: RouteSpec | None,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    check_ids: bool = True,
) -> tuple[np.ndarray, int]:
    """Decode a response's ``routed_experts`` to ``[rows, L, K]``; returns (array, payload bytes).

    Accepts vLLM's base64 ``.npy`` string, SkyRL's packed dict, or nested JSON lists (the slow
    legacy form; payload bytes reported as 0). With ``spec``, ``L``/``K`` must match and, if
    ``check_ids``, router-layer ids must lie in ``[0, num_experts)``. Raises `PayloadError`,
    `RouteShapeError`, `RouteDTypeError`, `ExpertRangeError`.
    """
    nbytes = 0
    if isinstance(value, str | bytes | bytearray | memoryview):
        arr, nbytes = decode_vllm(value, max_bytes=max_bytes), len(value)
    elif isinstance(value, Mapping):
        data = value.get("data")
        arr, nbytes = (
            decode_packed(value, max_bytes=max_bytes),
            len(data) if isinstance(data, str) else 0,
        )
    elif isinstance(value, list):
        try:
            arr = np.asarray(value)
        except ValueError as exc:
            raise PayloadError(
                f"routed_experts: expected nested lists [rows][L][K], found ragged lists ({exc})"
            ) from None
        if arr.size == 0 and spec is not None:
            arr = np.empty((0, *spec.row_shape), dtype=spec.dtype)
        if arr.dtype.kind not in "iu":
            raise RouteDTypeError(
                f"routed_experts: expected integer nested lists, found dtype {arr.dtype}"
            )
        if arr.ndim != 3:
            raise RouteShapeError(
                f"routed_experts: expected [rows, L, K], found shape {list(arr.shape)}"
            )
    else:
        raise PayloadError(
            f"routed_experts: expected a base64 .npy string, a packed dict or nested lists, found {type(value).__name__}"
        )
    if spec is not None:
        if arr.shape[1:] != spec.row_shape:
            raise RouteShapeError(
                f"routed_experts: expected [rows, {spec.num_layers}, {spec.topk}], found {list(arr.shape)}"
            )
        if check_ids:
            check_route_ids(arr, spec, what="routed_experts")
    return arr, nbytes


def parse_response(
    body: bytes,
    *,
    endpoint: Endpoint = "generate",
    spec: RouteSpec | None = None,
    max_payload_bytes: int = DEFAULT_MAX_BYTES,
    want_routes: bool = True,
    check_ids: bool = True,
) -> ParsedResponse:
    """Parse a successful engine response body (JSON) of ``endpoint``.

    ``check_ids=False`` skips the expert-id range check (a `RouteTrace` does it on record).
    Raises `EngineError` when the body is not a response of the expected shape (no
    ``choices[0].token_ids``, no tokens generated) and the codec's errors for a bad
    ``routed_experts`` payload.
    """
    body, lifted = _lift_routes(body)
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise EngineError(f"engine response: expected JSON, found {body[:200]!r} ({exc})") from None
    choices = obj.get("choices") if isinstance(obj, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise EngineError(
            f"engine response: expected a non-empty 'choices' list, found {body[:200]!r}"
        )
    if len(choices) != 1:
        raise EngineError(
            f"engine response: expected exactly one choice (n=1), found {len(choices)}"
        )
    ch = choices[0]
    tokens = ch.get("token_ids")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in tokens
    ):
        hint = (
            " (the completions endpoint needs return_token_ids=true)"
            if endpoint == "completions"
            else ""
        )
        raise EngineError(
            f"engine response: expected choices[0].token_ids as a list of ints{hint}, found {tokens!r:.200}"
        )
    if not tokens:
        raise EngineError("engine response: expected at least one generated token, found none")
    logprobs: list[float] | None = None
    lp = ch.get("logprobs")
    if isinstance(lp, dict):
        try:
            if isinstance(lp.get("content"), list):  # generate: [{"token_id", "logprob", ...}]
                logprobs = [float(c["logprob"]) for c in lp["content"]]
            elif isinstance(lp.get("token_logprobs"), list):  # completions (OpenAI)
                logprobs = [float(v) if v is not None else math.nan for v in lp["token_logprobs"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise EngineError(
                f"engine response: expected numeric logprobs, found {lp!r:.200} ({exc})"
            ) from None
    routes: np.ndarray | None = None
    payload = 0
    raw = ch.get("routed_experts")
    if lifted is not None:
        if raw != _LIFTED:
            raise EngineError(
                "engine response: expected routed_experts inside choices[0], found it elsewhere"
            )
        raw = lifted
    if want_routes and raw is not None:
        routes, payload = decode_routes(raw, spec, max_bytes=max_payload_bytes, check_ids=check_ids)
        routes.flags.writeable = (
            False  # fresh buffer no one else holds: lets the trace keep it uncopied
        )
    finish = ch.get("finish_reason")
    stop = ch.get("stop_reason")
    return ParsedResponse(
        token_ids=tokens,
        finish_reason=finish if isinstance(finish, str) else None,
        stop_reason=stop if isinstance(stop, int | str) else None,
        logprobs=logprobs,
        routes=routes,
        payload_bytes=payload,
    )


def _retry_after_seconds(value: str | None) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or an HTTP date); None if absent/invalid."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


def _score(session_id: str, url: str) -> int:
    digest = hashlib.blake2b(f"{url}\x00{session_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


class EngineClient:
    """Async client for one set of engine servers (vLLM or the embedded reference engine).

    ``EngineClient(url_or_urls, spec)``; use as ``async with``. Options: ``endpoint``
    ("generate": ``POST /inference/v1/generate``; "completions": ``POST /v1/completions`` with
    token-id prompts), ``max_concurrency`` (requests in flight), ``timeout`` (seconds or
    `httpx.Timeout`), ``max_retries`` with ``backoff_base``/``backoff_max`` seconds
    (exponential, jittered; ``Retry-After`` on 429/503 honoured up to ``retry_after_max``),
    ``retry_timeouts`` (also retry read/write timeouts), ``model``, ``cache_salt`` (default
    for every request), ``max_payload_bytes`` (bound on a decoded route payload),
    ``vocab_size`` (reject prompt ids outside ``[0, vocab_size)`` before sending: vLLM started
    with ``--skip-tokenizer-init`` does not check them and its engine core dies on one),
    ``seed`` (of the retry jitter).
    """

    def __init__(
        self,
        base_url: str | Sequence[str],
        spec: RouteSpec | None = None,
        *,
        endpoint: Endpoint = "generate",
        model: str | None = None,
        max_concurrency: int = 64,
        timeout: float | httpx.Timeout = 300.0,
        max_retries: int = 3,
        backoff_base: float = 0.1,
        backoff_max: float = 5.0,
        retry_after_max: float = 30.0,
        retry_timeouts: bool = False,
        cache_salt: str | None = None,
        max_payload_bytes: int = DEFAULT_MAX_BYTES,
        headers: Mapping[str, str] | None = None,
        vocab_size: int | None = None,
        seed: int | None = None,
    ) -> None:
        urls = [base_url] if isinstance(base_url, str) else list(base_url)
        if not urls or not all(
            isinstance(u, str) and u.startswith(("http://", "https://")) for u in urls
        ):
            raise ValueError(f"base_url: expected one or more http(s) URLs, found {base_url!r}")
        if len(set(urls)) != len(urls):
            raise ValueError(f"base_url: expected distinct URLs, found {urls}")
        if endpoint not in ENDPOINT_PATHS:
            raise ValueError(
                f"endpoint: expected one of {sorted(ENDPOINT_PATHS)}, found {endpoint!r}"
            )
        if not isinstance(max_concurrency, int) or max_concurrency < 1:
            raise ValueError(f"max_concurrency: expected an int >= 1, found {max_concurrency!r}")
        if not isinstance(max_retries, int) or max_retries < 0:
            raise ValueError(f"max_retries: expected an int >= 0, found {max_retries!r}")
        if not isinstance(max_payload_bytes, int) or max_payload_bytes < 0:
            raise ValueError(
                f"max_payload_bytes: expected an int >= 0, found {max_payload_bytes!r}"
            )
        if vocab_size is not None and (not isinstance(vocab_size, int) or vocab_size < 1):
            raise ValueError(f"vocab_size: expected None or an int >= 1, found {vocab_size!r}")
        if not (backoff_base >= 0 and backoff_max >= 0 and retry_after_max >= 0):
            raise ValueError(
                f"backoff_base/backoff_max/retry_after_max: expected >= 0, found "
                f"{backoff_base}/{backoff_max}/{retry_after_max}"
            )
        self.base_urls: tuple[str, ...] = tuple(u.rstrip("/") for u in urls)
        self.spec = spec
        self.endpoint: Endpoint = endpoint
        self.model = model
        self.max_concurrency = max_concurrency
        self.max_retries = max_retries
        self.backoff_base = float(backoff_base)
        self.backoff_max = float(backoff_max)
        self.retry_after_max = float(retry_after_max)
        self.retry_timeouts = retry_timeouts
        self.cache_salt = cache_salt
        self.max_payload_bytes = int(max_payload_bytes)
        # A response body may hold the base64 payload (4/3 of it) plus JSON around it; past
        # this bound the body is not read on (a misbehaving engine cannot exhaust memory).
        self.max_body_bytes = self.max_payload_bytes * 4 // 3 + _BODY_SLACK_BYTES
        self.vocab_size = vocab_size
        self.timeout = (
            timeout if isinstance(timeout, httpx.Timeout) else httpx.Timeout(float(timeout))
        )
        self._http = httpx.AsyncClient(
            timeout=self.timeout,
            limits=httpx.Limits(
                max_connections=max_concurrency * len(self.base_urls),
                max_keepalive_connections=max_concurrency * len(self.base_urls),
            ),
            headers={"content-type": "application/json", **dict(headers or {})},
        )
        self._sem = asyncio.Semaphore(max_concurrency)
        self._rng = random.Random(seed)
        self._round_robin = itertools.count()
        self._busy_traces: set[int] = set()
        #: Counters: requests sent, retries, route payload bytes and rows received, responses recorded.
        self.stats: dict[str, int] = {
            "requests": 0,
            "retries": 0,
            "payload_bytes": 0,
            "route_rows": 0,
            "recorded": 0,
        }

    # ------------------------------------------------------------- lifecycle
    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Close the connection pool."""
        await self._http.aclose()

    # --------------------------------------------------------------- routing
    def urls_for(self, session_id: str | None) -> list[str]:
        """Base URLs in the order a request of ``session_id`` tries them.

        A session maps to the same URL every time (rendezvous hashing: adding or removing a
        server moves only the sessions of that server); without a session, round robin.
        """
        if len(self.base_urls) == 1:
            return list(self.base_urls)
        if session_id is None:
            k = next(self._round_robin) % len(self.base_urls)
            return list(self.base_urls[k:] + self.base_urls[:k])
        return sorted(self.base_urls, key=lambda u: _score(session_id, u), reverse=True)

    def _backoff(self, attempt: int, retry_after: float | None) -> float:
        cap = min(self.backoff_max, self.backoff_base * (2.0**attempt))
        delay = cap / 2 + self._rng.uniform(0, cap / 2)  # "equal jitter": never 0, spreads retries
        if retry_after is not None:
            delay = max(delay, min(retry_after, self.retry_after_max))
        return delay

    async def probe_spec(
        self, *, num_experts: int | None = None, token_ids: Sequence[int] = (1, 2, 3)
    ) -> RouteSpec:
        """Ask the engine for the route shape: one 1-token request with prompt start 0.

        Returns ``RouteSpec(L, K, num_experts)`` from the returned ``[P, L, K]`` rows (the
        engine does not report ``num_experts``; None lets traces widen the dtype as needed).
        Raises `EngineError` if the engine returns no routes.
        """
        out = await self.generate(token_ids, sampling_params={"max_tokens": 1, "ignore_eos": True})
        if out.routed_experts is None:
            raise EngineError(
                f"engine {out.base_url} returned no routed_experts; expected [rows, L, K] "
                "(start vLLM with --enable-return-routed-experts)"
            )
        _, layers, topk = out.routed_experts.shape
        return RouteSpec(num_layers=layers, topk=topk, num_experts=num_experts)

    # -------------------------------------------------------------- requests
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
        body: dict[str, Any]
        if self.endpoint == "generate":
            sp = dict(sampling_params)
            if return_routes:
                sp["routed_experts_prompt_start"] = prompt_start
            body = {"token_ids": prompt_token_ids, "sampling_params": sp}
        else:
            body = {"prompt": prompt_token_ids, **sampling_params, "return_token_ids": True}
            if return_routes:
                body["routed_experts_prompt_start"] = prompt_start
        if self.model is not None:
            body["model"] = self.model
        if salt is not None:
            body["cache_salt"] = salt
        return body

    async def _read_capped(self, resp: httpx.Response, url: str) -> bytes:
        """The body of a streamed response, refusing (`PayloadTooLargeError`) past ``max_body_bytes``."""
        cap = self.max_body_bytes
        declared = resp.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > cap:
            raise PayloadTooLargeError(
                f"engine {url}: expected a response body <= {cap} bytes (max_payload_bytes="
                f"{self.max_payload_bytes}), found Content-Length {declared}"
            )
        parts: list[bytes] = []
        size = 0
        async for chunk in resp.aiter_bytes():
            size += len(chunk)
            if size > cap:
                raise PayloadTooLargeError(
                    f"engine {url}: expected a response body <= {cap} bytes (max_payload_bytes="
                    f"{self.max_payload_bytes}), found more"
                )
            parts.append(chunk)
        return b"".join(parts)

    async def _post(self, body: bytes, urls: list[str]) -> tuple[bytes, str, int]:
        """POST with retries; returns (2xx body, base URL, attempts). Raises `EngineHTTPError`,
        or `PayloadTooLargeError` for a body past ``max_body_bytes`` (never retried)."""
        path = ENDPOINT_PATHS[self.endpoint]
        failover = 0
        last: str = ""
        for attempt in range(self.max_retries + 1):
            url = urls[failover % len(urls)]
            retry_after: float | None = None
            try:
                async with self._sem:
                    self.stats["requests"] += 1
                    request = self._http.build_request("POST", url + path, content=body)
                    resp = await self._http.send(request, stream=True)
                    try:
                        content = await self._read_capped(resp, url)
                    finally:
                        await resp.aclose()
            except httpx.TimeoutException as exc:
                kind = type(exc).__name__
                if isinstance(exc, httpx.ConnectTimeout | httpx.PoolTimeout) or self.retry_timeouts:
                    last = f"{kind} from {url}"
                else:
                    raise EngineHTTPError(
                        f"engine request to {url}{path} timed out ({kind}; timeout={self.timeout})",
                        url=url,
                    ) from exc
                failover += isinstance(exc, httpx.ConnectTimeout)
            except httpx.TransportError as exc:
                last = f"{type(exc).__name__} from {url}: {exc}"
                failover += isinstance(exc, httpx.ConnectError)
            else:
                status = resp.status_code
                if status < 400:
                    return content, url, attempt + 1
                msg = _error_message(content)
                if status != 429 and status < _RETRY_STATUS_MIN:
                    raise EngineHTTPError(
                        f"engine {url}{path} rejected the request: HTTP {status}: {msg}",
                        status=status,
                        body=msg,
                        url=url,
                    )
                last = f"HTTP {status} from {url}: {msg}"
                if status in (429, 503):
                    retry_after = _retry_after_seconds(resp.headers.get("retry-after"))
                if attempt == self.max_retries:
                    raise EngineHTTPError(
                        f"engine {url}{path} failed after {attempt + 1} attempts: {last}",
                        status=status,
                        body=msg,
                        url=url,
                    )
            if attempt == self.max_retries:
                break
            self.stats["retries"] += 1
            await asyncio.sleep(self._backoff(attempt, retry_after))
        raise EngineHTTPError(
            f"engine {url}{path} failed after {self.max_retries + 1} attempts: {last}", url=url
        )

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
    ) -> GenerateOutput:
        """Generate after ``prompt_token_ids`` (the whole conversation so far, P tokens).

        With ``trace``: sends ``routed_experts_prompt_start = trace.captured`` and records the
        ``P - captured + G - 1`` returned rows into it, once, after the response decoded and
        checked; any error leaves the trace unchanged. Without: sends ``prompt_start``.
        ``session_id`` pins the request to one base URL (default: the trace's identity).
        Raises `EngineHTTPError` (HTTP 4xx at once; 5xx/429/connection errors after
        ``max_retries`` retries; timeouts), `EngineError` (unusable response),
        `PayloadError`/`RouteShapeError`/`ExpertRangeError` (bad routes; never retried),
        `TraceStateError` (a trace already has a request in flight).
        """
        ids = np.asarray(prompt_token_ids)
        if ids.size == 0:
            raise ValueError("prompt_token_ids: expected at least one token, found none")
        if ids.ndim != 1 or ids.dtype.kind not in "iu":
            raise ValueError(
                f"prompt_token_ids: expected a flat sequence of int token ids, found shape "
                f"{list(ids.shape)} of dtype {ids.dtype}"
            )
        out_of_range = ids < 0 if self.vocab_size is None else (ids < 0) | (ids >= self.vocab_size)
        bad = np.flatnonzero(out_of_range)
        if bad.size:
            raise ValueError(
                f"prompt_token_ids: expected ids in [0, {self.vocab_size if self.vocab_size is not None else 'vocab'}), "
                f"found {int(ids[bad[0]])} at position {int(bad[0])}"
            )
        prompt: list[int] = ids.tolist()  # plain ints: numpy scalars are not JSON-serialisable
        p = len(prompt)
        sp = dict(sampling_params or {})
        if sp.get("n", 1) != 1 or sp.get("stream"):
            raise ValueError(
                f"sampling_params: expected one non-streamed sample per request (n=1, no stream), "
                f"found n={sp.get('n', 1)!r}, stream={sp.get('stream')!r}"
            )
        if "routed_experts_prompt_start" in sp:
            raise ValueError(
                "sampling_params: routed_experts_prompt_start is set by the client "
                "(from the trace, or the prompt_start argument); found it in sampling_params"
            )
        spec = self.spec
        if trace is not None:
            if not return_routes:
                raise ValueError("return_routes=False with a trace: expected routes to record")
            if spec is not None and not spec.same_shape(trace.spec):
                raise RouteShapeError(
                    f"trace: expected routes shaped like {spec}, found {trace.spec}"
                )
            spec = trace.spec
            if trace.finalized:
                raise TraceStateError("trace: already finalized; expected an open trace")
            prompt_start = trace.captured
            if p <= prompt_start or p < trace.seen_tokens:
                raise RouteShapeError(
                    f"prompt_token_ids: expected the conversation to extend the trace's "
                    f"{trace.seen_tokens} tokens (and exceed captured={prompt_start}), found {p} tokens"
                )
            if id(trace) in self._busy_traces:
                raise TraceStateError(
                    "trace: a request for this trace is already in flight; expected one at a time"
                )
        elif not isinstance(prompt_start, int) or not 0 <= prompt_start < p:
            raise ValueError(f"prompt_start: expected an int in [0, {p}), found {prompt_start!r}")
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
            parse_args: dict[str, Any] = {
                "endpoint": self.endpoint,
                "spec": spec,
                "max_payload_bytes": self.max_payload_bytes,
                "want_routes": return_routes,
                "check_ids": trace is None,  # the trace checks ids when it records
            }
            if len(content) > _OFFLOAD_BYTES:  # keep the event loop responsive while decoding
                parsed = await asyncio.to_thread(parse_response, content, **parse_args)
            else:
                parsed = parse_response(content, **parse_args)
            g = len(parsed.token_ids)
            routes = parsed.routes
            rows = 0
            token_start: int | None = None
            if routes is not None:
                want = expected_rows(prompt_tokens=p, generated_tokens=g, prompt_start=prompt_start)
                if routes.shape[0] != want:
                    raise RouteShapeError(
                        f"routed_experts from {url}: expected {want} rows (P={p} - prompt_start={prompt_start} "
                        f"+ G={g} - 1), found {routes.shape[0]}"
                    )
                rows = want
                if trace is not None:
                    token_start = trace.record(routes, prompt_tokens=p, generated_tokens=g)
                    self.stats["recorded"] += 1
            elif trace is not None:
                raise EngineError(
                    f"engine {url} returned no routed_experts; expected {p - prompt_start + g - 1} rows "
                    "(start vLLM with --enable-return-routed-experts)"
                )
        finally:
            if trace is not None:
                self._busy_traces.discard(id(trace))
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
        )


__all__ = [
    "ENDPOINT_PATHS",
    "EngineClient",
    "EngineHTTPError",
    "GenerateOutput",
    "ParsedResponse",
    "decode_routes",
    "parse_response",
]
