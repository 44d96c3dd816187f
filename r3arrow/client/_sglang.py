"""SGLang's native protocol, client side (pure): ``POST /generate`` bodies and responses, the
routes raw int32 without a shape; each field and its source: ``docs/sglang.md``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from r3arrow._checks import check_optional_int
from r3arrow.client._protocol import (
    ParsedResponse,
    generated_ids,
    load_body,
    logprob_list,
    malformed,
    optional,
    response_routes,
    shown,
)
from r3arrow.codec import DEFAULT_MAX_BYTES, decode_sglang
from r3arrow.errors import EngineError, EngineResponseError, PayloadError
from r3arrow.ids import check_routes
from r3arrow.spec import RouteSpec

GENERATE_PATH = "/generate"
#: Top-level request fields the client sets (from the trace, or ``prompt_start``).
START_KEY = "routed_experts_start_len"
RETURN_KEY = "return_routed_experts"
NO_ROUTES_HINT = "(start SGLang with --enable-return-routed-experts)"


def build_request(
    prompt_token_ids: Sequence[int],
    sampling_params: Mapping[str, Any],
    *,
    prompt_start: int,
    return_routes: bool = True,
    cache_salt: str | None = None,
) -> dict[str, Any]:
    """The ``POST /generate`` body continuing ``prompt_token_ids``."""
    body: dict[str, Any] = {
        "input_ids": prompt_token_ids,
        "sampling_params": dict(sampling_params),
    }
    if return_routes:
        body[RETURN_KEY] = True
        body[START_KEY] = prompt_start
    if cache_salt is not None:
        body["cache_salt"] = cache_salt
    return body


def probe_shape(
    num_layers: int | None, topk: int | None, num_experts: int | None, known: RouteSpec | None
) -> RouteSpec:
    """The spec a probe decodes with (the arguments, else ``known``); `ValueError` without one."""
    num_layers = check_optional_int(num_layers, "num_layers", minimum=1)
    topk = check_optional_int(topk, "topk", minimum=1)
    if num_layers is None or topk is None:
        if known is None:
            raise ValueError(
                "probe_spec: SGLang's routes carry no shape; expected num_layers= and "
                "topk= (or a client spec), found neither"
            )
        num_layers = known.num_layers if num_layers is None else num_layers
        topk = known.topk if topk is None else topk
    return RouteSpec(num_layers=num_layers, topk=topk, num_experts=num_experts)


def _finish(meta: dict[str, Any]) -> tuple[str | None, int | str | None]:
    """(finish type, matched stop) of ``meta_info["finish_reason"]``; `EngineError` on abort."""
    where = "meta_info.finish_reason"
    fr = meta.get("finish_reason")
    if fr is None:
        return None, None
    if not isinstance(fr, dict) or type(fr.get("type")) is not str:
        raise malformed(where, "as {'type': ...} or null", fr)
    kind: str = fr["type"]
    if kind == "abort":  # SGLang answers some aborts with HTTP 200 and this finish reason
        raise EngineError(f"engine response: the request was aborted: {shown(fr.get('message'))}")
    if kind != "stop":
        return kind, None
    return kind, optional(fr.get("matched"), f"{where}.matched", int, str)


def parse_response(
    body: bytes | bytearray,
    *,
    spec: RouteSpec | None,
    max_payload_bytes: int = DEFAULT_MAX_BYTES,
    want_routes: bool = True,
    check_ids: bool = True,
    vocab_size: int | None = None,
) -> ParsedResponse:
    """Parse a 2xx ``/generate`` body (``spec`` gives the row shape; routes without one are an
    `EngineError`; generated ids in ``[0, vocab_size)``): `EngineResponseError` if malformed,
    `PayloadError` or the id rules' errors for a bad payload.
    """
    obj, body, lifted = load_body(body)
    if not isinstance(obj, dict):
        raise EngineResponseError(
            f"engine response: expected one JSON object (n=1, one prompt), found {shown(obj)}"
        )
    tokens = generated_ids(obj.get("output_ids"), "output_ids", vocab_size=vocab_size)
    meta = obj.get("meta_info")
    if not isinstance(meta, dict):
        raise malformed("meta_info", "as an object", meta)
    finish, matched = _finish(meta)

    def decode(value: object) -> tuple[np.ndarray, int]:
        if spec is None:
            raise EngineError(
                "SGLang routed_experts carry no shape: expected a RouteSpec (pass spec=, or "
                "probe_spec(num_layers=, topk=))"
            )
        if not isinstance(value, str | memoryview):
            raise PayloadError(
                "SGLang routed_experts: expected a base64 string of int32 rows, found "
                f"{type(value).__name__}"
            )
        arr = decode_sglang(value, spec, max_bytes=max_payload_bytes)
        if check_ids:
            check_routes(arr, spec, what="routed_experts")
        return arr, len(value)

    routes, payload = response_routes(
        meta.get("routed_experts"), lifted, "meta_info", decode if want_routes else None
    )
    return ParsedResponse(
        token_ids=tokens,
        finish_reason=finish,
        stop_reason=matched,
        logprobs=_logprobs(meta.get("output_token_logprobs"), len(tokens)),
        routes=routes,
        payload_bytes=payload,
    )


def _logprobs(value: object, n: int) -> list[float] | None:
    """The ``n`` logprobs of ``meta_info["output_token_logprobs"]`` (``[[lp, id, text], ...]``;
    None if null)."""
    where = "meta_info.output_token_logprobs"
    if value is None:
        return None
    if not isinstance(value, list):
        raise malformed(where, "as [[logprob, id, text], ...] or null", value)
    values = [e[0] if isinstance(e, list) and e else None for e in value]
    return logprob_list(values, where, n, "[0]")
