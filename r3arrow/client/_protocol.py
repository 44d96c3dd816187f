"""vLLM's generate wire protocol, client side: request bodies, response parsing, route decoding.

Two endpoints carry a token-id prompt and return token ids with the routed experts
(``docs/design.md``, "Wire formats"):

* ``generate``: ``POST /inference/v1/generate`` with ``{"token_ids", "sampling_params":
  {..., "routed_experts_prompt_start"}}``;
* ``completions``: ``POST /v1/completions`` with ``{"prompt": [ids], ..., "return_token_ids":
  true, "routed_experts_prompt_start"}``.

Both answer ``{"choices": [{"token_ids", "finish_reason", "stop_reason", "logprobs",
"routed_experts"}]}`` with ``routed_experts`` as base64 ``.npy`` of ``[P - start + G - 1, L,
K]`` rows. This module is pure (no I/O): it builds bodies and parses bytes. Expert-id checks
go through :mod:`r3arrow.ids` (via the codec's spec check), never a copy of them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import numpy as np
import orjson

from r3arrow._coverage import expected_rows
from r3arrow._routes import as_route_rows
from r3arrow.client._models import ParsedResponse
from r3arrow.codec import DEFAULT_MAX_BYTES, decode_packed, decode_vllm
from r3arrow.errors import EngineError, PayloadError, RouteDTypeError, RouteShapeError
from r3arrow.ids import check_routes
from r3arrow.spec import RouteSpec

Endpoint = Literal["generate", "completions"]

#: Request paths of the two supported endpoints.
ENDPOINT_PATHS: dict[Endpoint, str] = {
    "generate": "/inference/v1/generate",
    "completions": "/v1/completions",
}

#: Set by the client from the trace (or ``prompt_start``); never by the caller.
PROMPT_START_KEY = "routed_experts_prompt_start"


def build_request(
    endpoint: Endpoint,
    prompt_token_ids: Sequence[int],
    sampling_params: Mapping[str, Any],
    *,
    prompt_start: int,
    return_routes: bool = True,
    model: str | None = None,
    cache_salt: str | None = None,
) -> dict[str, Any]:
    """The JSON body asking ``endpoint`` to continue ``prompt_token_ids``.

    With ``return_routes``, ``routed_experts_prompt_start = prompt_start`` goes where the
    endpoint expects it (inside ``sampling_params`` for generate, top level for completions).
    ``model`` and ``cache_salt`` are added when not None.
    """
    body: dict[str, Any]
    if endpoint == "generate":
        sp = dict(sampling_params)
        if return_routes:
            sp[PROMPT_START_KEY] = prompt_start
        body = {"token_ids": prompt_token_ids, "sampling_params": sp}
    else:
        body = {"prompt": prompt_token_ids, **sampling_params, "return_token_ids": True}
        if return_routes:
            body[PROMPT_START_KEY] = prompt_start
    if model is not None:
        body["model"] = model
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    return body


def error_message(body: bytes) -> str:
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
#: The placeholder `lift_routes` leaves where the payload string was.
LIFTED = "\x00r3arrow:lifted"
_LIFTED_JSON = orjson.dumps(LIFTED)
_JSON_SPACE = b" \t\r\n"


def lift_routes(body: bytes) -> tuple[bytes, memoryview | None]:
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


def load_body(body: bytes) -> tuple[Any, bytes, memoryview | None]:
    """(parsed JSON, body as parsed, lifted payload or None) of a response body (`lift_routes`).

    Raises `EngineError` when the body is not JSON.
    """
    body, lifted = lift_routes(body)
    try:
        return orjson.loads(body), body, lifted
    except orjson.JSONDecodeError as exc:
        raise EngineError(f"engine response: expected JSON, found {body[:200]!r} ({exc})") from None


def routes_value(raw: object, lifted: memoryview | None, where: str) -> object:
    """The ``routed_experts`` value found at ``where``: the `lift_routes` payload if one was cut.

    Raises `EngineError` when a payload was cut out of the body but ``raw`` (the value at
    ``where``) is not its placeholder.
    """
    if lifted is None:
        return raw
    if raw != LIFTED:
        raise EngineError(
            f"engine response: expected routed_experts inside {where}, found it elsewhere"
        )
    return lifted


def _decode_nested(value: list[Any], spec: RouteSpec | None) -> np.ndarray:
    """Nested JSON lists ``[rows][L][K]`` (the slow legacy form) as an integer array."""
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
    return arr


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
    ``check_ids``, ids must satisfy `r3arrow.ids.check_routes` (router-layer ids in
    ``[0, num_experts)`` and distinct per row). Raises `PayloadError`, `RouteShapeError`,
    `RouteDTypeError`, `ExpertRangeError`, `DuplicateExpertError`.
    """
    nbytes = 0
    if isinstance(value, str | bytes | bytearray | memoryview):
        arr, nbytes = decode_vllm(value, max_bytes=max_bytes), len(value)
    elif isinstance(value, Mapping):
        data = value.get("data")
        arr = decode_packed(value, max_bytes=max_bytes)
        nbytes = len(data) if isinstance(data, str) else 0
    elif isinstance(value, list):
        arr = _decode_nested(value, spec)
    else:
        raise PayloadError(
            "routed_experts: expected a base64 .npy string, a packed dict or nested lists, "
            f"found {type(value).__name__}"
        )
    if spec is not None:
        arr = as_route_rows(arr, spec, what="routed_experts")  # shape only; a view
        if check_ids:
            check_routes(arr, spec, what="routed_experts")
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

    ``check_ids=False`` skips the expert-id checks (a `RouteTrace` does them on record).
    Raises `EngineError` when the body is not a response of the expected shape (no
    ``choices[0].token_ids``, no tokens generated, more than one choice) and the codec's
    errors for a bad ``routed_experts`` payload (see `decode_routes`).
    """
    obj, body, lifted = load_body(body)
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
            f"engine response: expected choices[0].token_ids as a list of ints{hint}, "
            f"found {tokens!r:.200}"
        )
    if not tokens:
        raise EngineError("engine response: expected at least one generated token, found none")
    routes: np.ndarray | None = None
    payload = 0
    raw = routes_value(ch.get("routed_experts"), lifted, "choices[0]")
    if want_routes and raw is not None:
        routes, payload = decode_routes(raw, spec, max_bytes=max_payload_bytes, check_ids=check_ids)
        routes.flags.writeable = False  # a fresh buffer no one else holds: the trace keeps it
    finish = ch.get("finish_reason")
    stop = ch.get("stop_reason")
    return ParsedResponse(
        token_ids=tokens,
        finish_reason=finish if isinstance(finish, str) else None,
        stop_reason=stop if isinstance(stop, int | str) else None,
        logprobs=_logprobs(ch.get("logprobs")),
        routes=routes,
        payload_bytes=payload,
    )


def _logprobs(lp: object) -> list[float] | None:
    """Sampled-token logprobs of either endpoint's ``logprobs`` object (None if absent)."""
    if not isinstance(lp, dict):
        return None
    try:
        if isinstance(lp.get("content"), list):  # generate: [{"token_id", "logprob", ...}]
            return [float(c["logprob"]) for c in lp["content"]]
        if isinstance(lp.get("token_logprobs"), list):  # completions (OpenAI)
            return [float(v) if v is not None else math.nan for v in lp["token_logprobs"]]
    except (KeyError, TypeError, ValueError) as exc:
        raise EngineError(
            f"engine response: expected numeric logprobs, found {lp!r:.200} ({exc})"
        ) from None
    return None


def check_row_count(
    routes: np.ndarray, *, prompt_tokens: int, generated_tokens: int, prompt_start: int, url: str
) -> int:
    """Return ``P - prompt_start + G - 1``, the row count vLLM sends; raise if ``routes`` differ.

    Raises `RouteShapeError` naming the server ``url``.
    """
    want = expected_rows(
        prompt_tokens=prompt_tokens, generated_tokens=generated_tokens, prompt_start=prompt_start
    )
    if routes.shape[0] != want:
        raise RouteShapeError(
            f"routed_experts from {url}: expected {want} rows (P={prompt_tokens} - "
            f"prompt_start={prompt_start} + G={generated_tokens} - 1), found {routes.shape[0]}"
        )
    return want


__all__ = [
    "ENDPOINT_PATHS",
    "LIFTED",
    "PROMPT_START_KEY",
    "Endpoint",
    "build_request",
    "check_row_count",
    "decode_routes",
    "error_message",
    "lift_routes",
    "load_body",
    "parse_response",
    "routes_value",
]
