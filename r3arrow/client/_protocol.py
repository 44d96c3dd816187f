"""vLLM's wire protocol, client side (pure): ``generate`` and ``completions`` bodies and
responses (``docs/design.md``, "Wire formats"; ``docs/vllm-schema.md``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
import reprlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal

import numpy as np
import orjson

from r3arrow._coverage import expected_rows
from r3arrow._routes import as_route_rows
from r3arrow.codec import DEFAULT_MAX_BYTES, decode_packed, decode_vllm
from r3arrow.errors import EngineResponseError, PayloadError, RouteDTypeError, RouteShapeError
from r3arrow.ids import check_routes
from r3arrow.spec import RouteSpec

Endpoint = Literal["generate", "completions"]

ENDPOINT_PATHS: dict[Endpoint, str] = {
    "generate": "/inference/v1/generate",
    "completions": "/v1/completions",
}

#: Set by the client from the trace (or ``prompt_start``); never by the caller.
PROMPT_START_KEY = "routed_experts_prompt_start"

_SHOW = reprlib.Repr()  # bounded depth and length: engine data of any shape prints safely
_SHOW.maxlevel, _SHOW.maxlist, _SHOW.maxdict, _SHOW.maxstring = 4, 8, 8, 80


def shown(value: object) -> str:
    """A short repr of engine data (a plain repr may recurse past Python's limit, or be huge)."""
    return _SHOW.repr(value)


def malformed(field: str, expected: str, value: object) -> EngineResponseError:
    """The error for a response whose ``field`` is not ``expected``."""
    return EngineResponseError(
        f"engine response: expected {field} {expected}, found {shown(value)}", field=field
    )


@dataclasses.dataclass(frozen=True)
class ParsedResponse:
    """The parts of a response the client uses (``payload_bytes`` 0 for nested lists)."""

    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None
    logprobs: list[float] | None
    routes: np.ndarray | None
    payload_bytes: int


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
    """The JSON body asking ``endpoint`` to continue ``prompt_token_ids``."""
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


def error_message(body: bytes | bytearray) -> str:
    """Best-effort error text of an engine error body."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError:
        obj = None
    err = obj.get("error", obj.get("detail", obj.get("message"))) if isinstance(obj, dict) else None
    if isinstance(err, dict) and "message" in err:
        err = err["message"]
    if err is None:  # not JSON (an HTML page, say): its start on one line, and its size
        text = " ".join(bytes(body[:800]).decode(errors="replace").split())
        return text[:200] + (f"... ({len(body)} bytes, not JSON)" if len(body) > 200 else "")
    return (err if isinstance(err, str) else shown(err))[:2000]


_ROUTES_KEY = b'"routed_experts"'
_TO_STRING = re.compile(rb'[ \t\r\n]*:[ \t\r\n]*"')  # JSON whitespace, ':', a string's quote
#: The placeholder `lift_routes` leaves where the payload string was.
LIFTED = "\x00r3arrow:lifted"
_LIFTED_JSON = orjson.dumps(LIFTED)


def lift_routes(body: bytes | bytearray) -> tuple[bytes | bytearray, memoryview | None]:
    """(body with a `LIFTED` placeholder, payload) of a body whose one ``routed_experts`` is a
    string, else (body, None): JSON-parsing the payload would cost ~10x its decode.
    """
    i = body.find(_ROUTES_KEY)
    to = None if i < 0 else _TO_STRING.match(body, i + len(_ROUTES_KEY))
    if to is None:  # no key, or a null/list/dict value: the slow path
        return body, None
    j = to.end() - 1
    end = body.find(b'"', j + 1)
    # a second key (n > 1) or an escape sequence (a JSON encoder escaping "/") take the slow path
    if end < 0 or body.find(_ROUTES_KEY, end) >= 0 or body.find(b"\\", j + 1, end) >= 0:
        return body, None
    return body[:j] + _LIFTED_JSON + body[end + 1 :], memoryview(body)[j + 1 : end]


def load_body(body: bytes | bytearray) -> tuple[Any, bytes | bytearray, memoryview | None]:
    """(JSON, body as parsed, `lift_routes` payload or None); `EngineResponseError` if not JSON."""
    body, lifted = lift_routes(body)
    try:
        return orjson.loads(body), body, lifted
    except orjson.JSONDecodeError as exc:
        raise EngineResponseError(
            f"engine response: expected JSON, found {bytes(body[:200])!r} ({exc})"
        ) from None


def generated_ids(
    tokens: object, where: str, hint: str = "", vocab_size: int | None = None
) -> list[int]:
    """``tokens`` (found at ``where``) if a non-empty list of ints (not bools) in ``[0,
    vocab_size)`` (None: ``2**31``, as traces store int32), else `EngineResponseError`."""
    if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
        raise malformed(where, f"as a list of ints{hint}", tokens)
    if not tokens:
        raise malformed(where, "to hold at least one generated token", tokens)
    top = 2**31 if vocab_size is None else vocab_size
    for i, t in enumerate(tokens):
        if not 0 <= t < top:
            raise EngineResponseError(
                f"engine response: expected {where} in [0, {top}), found {t} at {where}[{i}]",
                field=f"{where}[{i}]",
            )
    return tokens


def logprob_list(values: list[Any], where: str, n: int, key: str = "") -> list[float]:
    """``values`` (of the entries at ``where``, each one's ``key``) as floats, one per generated
    token (``n``) and each a JSON number, else `EngineResponseError`."""
    if len(values) != n:
        raise EngineResponseError(
            f"engine response: expected {where} to hold one logprob per generated token ({n}), "
            f"found {len(values)}",
            field=where,
        )
    for i, v in enumerate(values):
        if type(v) is not float and type(v) is not int:
            raise malformed(f"{where}[{i}]{key}", "as a number (a logprob)", v)
    return [float(v) for v in values]


def response_routes(
    raw: object,
    lifted: memoryview | None,
    where: str,
    decode: Callable[[object], tuple[np.ndarray, int]] | None,
) -> tuple[np.ndarray | None, int]:
    """(read-only routes or None, payload bytes) of ``raw``, the ``routed_experts`` at ``where``
    (or the lifted payload), decoded unless ``decode`` is None; `EngineResponseError` if misplaced.
    """
    if lifted is not None:
        if raw != LIFTED:
            raise EngineResponseError(
                f"engine response: expected routed_experts inside {where}, found it elsewhere",
                field=f"{where}.routed_experts",
            )
        raw = lifted
    if decode is None or raw is None:
        return None, 0
    routes, payload = decode(raw)
    routes.flags.writeable = False  # a fresh buffer no one else holds: the trace keeps it
    return routes, payload


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
    if arr.size and bool in set(map(type, np.array(value, dtype=object).ravel())):
        raise RouteDTypeError("routed_experts: expected integer nested lists, found a bool")
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
    """A response's ``routed_experts`` as ``[rows, L, K]``: (array, payload bytes).

    A base64 ``.npy`` string, SkyRL's packed dict or nested lists (0 bytes); with ``spec`` the
    shape and (``check_ids``) the ids are checked. Raises the codec's and `r3arrow.ids`' errors.
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
        if arr.dtype.kind not in "iu" or arr.ndim != 3 or arr.shape[1:] != spec.row_shape:
            arr = as_route_rows(arr, spec, what="routed_experts")  # shape only; raises here
        if check_ids:
            check_routes(arr, spec, what="routed_experts")
    return arr, nbytes


def parse_response(
    body: bytes | bytearray,
    *,
    endpoint: Endpoint = "generate",
    spec: RouteSpec | None = None,
    max_payload_bytes: int = DEFAULT_MAX_BYTES,
    want_routes: bool = True,
    check_ids: bool = True,
    vocab_size: int | None = None,
) -> ParsedResponse:
    """Parse a 2xx body of ``endpoint`` (generated ids in ``[0, vocab_size)``):
    `EngineResponseError` if malformed, and `decode_routes`' errors."""
    obj, body, lifted = load_body(body)
    choices = obj.get("choices") if isinstance(obj, dict) else None
    if not isinstance(choices, list) or not choices or not isinstance(choices[0], dict):
        raise malformed("choices", "as a non-empty list of choice objects", choices)
    if len(choices) != 1:
        raise EngineResponseError(
            f"engine response: expected exactly one choice (n=1), found {len(choices)}",
            field="choices",
        )
    ch = choices[0]
    hint = " (the completions endpoint needs return_token_ids=true)"
    tokens = generated_ids(
        ch.get("token_ids"),
        "choices[0].token_ids",
        hint if endpoint == "completions" else "",
        vocab_size,
    )
    decode = functools.partial(
        decode_routes, spec=spec, max_bytes=max_payload_bytes, check_ids=check_ids
    )
    routes, payload = response_routes(
        ch.get("routed_experts"), lifted, "choices[0]", decode if want_routes else None
    )
    return ParsedResponse(
        token_ids=tokens,
        finish_reason=optional(ch.get("finish_reason"), "choices[0].finish_reason", str),
        stop_reason=optional(ch.get("stop_reason"), "choices[0].stop_reason", int, str),
        logprobs=_logprobs(ch.get("logprobs"), len(tokens)),
        routes=routes,
        payload_bytes=payload,
    )


def optional(value: Any, field: str, *types: type) -> Any:
    """``value`` if null or exactly one of ``types`` (a bool is no int), else
    `EngineResponseError`."""
    if value is None or type(value) in types:
        return value
    names = " or ".join(t.__name__ for t in types)
    raise malformed(field, f"as {names} or null", value)


def _logprobs(lp: object, n: int) -> list[float] | None:
    """The ``n`` sampled-token logprobs of either endpoint's ``logprobs`` (None if null)."""
    where = "choices[0].logprobs"
    if lp is None:
        return None
    content = lp.get("content") if isinstance(lp, dict) else None
    if isinstance(content, list):  # generate: [{"token_id", "logprob", ...}]
        values = [c.get("logprob") if isinstance(c, dict) else None for c in content]
        return logprob_list(values, f"{where}.content", n, ".logprob")
    token_lps = lp.get("token_logprobs") if isinstance(lp, dict) else None
    if isinstance(token_lps, list):  # completions (OpenAI): null is "none", read as NaN
        values = [math.nan if v is None else v for v in token_lps]
        return logprob_list(values, f"{where}.token_logprobs", n)
    raise malformed(where, "as {'content': [...]}, {'token_logprobs': [...]} or null", lp)


def check_row_count(
    routes: np.ndarray, *, prompt_tokens: int, generated_tokens: int, prompt_start: int, url: str
) -> None:
    """`RouteShapeError` (naming ``url``) unless ``routes`` has ``P - start + G - 1`` rows."""
    want = expected_rows(
        prompt_tokens=prompt_tokens, generated_tokens=generated_tokens, prompt_start=prompt_start
    )
    if routes.shape[0] != want:
        raise RouteShapeError(
            f"routed_experts from {url}: expected {want} rows (P={prompt_tokens} - "
            f"prompt_start={prompt_start} + G={generated_tokens} - 1), found {routes.shape[0]}"
        )
