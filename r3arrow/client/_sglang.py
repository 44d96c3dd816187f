"""SGLang's native generate protocol, client side: request bodies and response parsing.

Every field name, the row rule and the error shapes are taken from SGLang's own source
(sgl-project/sglang at v0.5.23; ``docs/sglang.md`` has the field table):

* request, ``POST /generate`` (``python/sglang/srt/entrypoints/http_server.py``,
  ``generate_request``; fields of ``GenerateReqInput`` in
  ``python/sglang/srt/managers/io_struct.py``): ``{"input_ids": [ids], "sampling_params":
  {...}, "return_routed_experts": true, "routed_experts_start_len": start}``. The sampling
  parameters are SGLang's (``max_new_tokens``, ``sampling_seed``, ``ignore_eos`` ...; unknown
  keys are a 400, ``python/sglang/api/v1/api_types.py``) and are sent as given.
* response (``python/sglang/srt/managers/tokenizer_manager.py``, ``_handle_batch_output``,
  with ``--skip-tokenizer-init`` no ``text``): ``{"text"?, "output_ids": [ids], "meta_info":
  {"id", "finish_reason": {"type": "length", "length"} | {"type": "stop", "matched"},
  "prompt_tokens", "completion_tokens", "cached_tokens", "routed_experts"?, ...}}``.
* ``meta_info["routed_experts"]``: base64 of the raw int32 ``[rows, num_layers, topk]``
  buffer (``python/sglang/srt/managers/detokenizer_manager.py``,
  ``_b64_encode_per_request``), no shape: decoded with `r3arrow.codec.decode_sglang` and the
  spec. Present only when ``return_routed_experts`` was asked.
* rows: ``[routed_experts_start_len, seqlen - 1)`` with ``seqlen = P + G``
  (``python/sglang/srt/managers/scheduler_components/batch_result_processor.py``,
  ``_maybe_collect_routed_experts``; ``python/sglang/srt/state_capturer/base.py``,
  ``get_topk``), i.e. ``P - start + G - 1``, vLLM's rule; ``start`` must lie in ``[0, P]``
  (``python/sglang/srt/managers/scheduler.py``, ``Scheduler._handle_generate_request``,
  else a 400).
* errors: HTTP 400 ``{"error": "<text>"}`` for a body breaking the JSON contract
  (``generate_contract_error``), HTTP 400 ``{"error": {"message": "<text>"}}`` for a
  ``ValueError`` (``_create_error_response``; e.g. a bad ``routed_experts_start_len``).
  `r3arrow.client._protocol.error_message` reads both.

Pure (no I/O). Expert-id checks go through :mod:`r3arrow.ids` via the codec.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from r3arrow._checks import check_optional_int
from r3arrow.client._models import ParsedResponse
from r3arrow.client._protocol import load_body, routes_value
from r3arrow.codec import DEFAULT_MAX_BYTES, decode_sglang
from r3arrow.errors import EngineError, PayloadError
from r3arrow.ids import check_routes
from r3arrow.spec import RouteSpec

#: SGLang's native generate path.
GENERATE_PATH = "/generate"
#: Top-level request fields the client sets (from the trace, or ``prompt_start``).
START_KEY = "routed_experts_start_len"
RETURN_KEY = "return_routed_experts"
#: Server flag that enables capture (``ServerArgs.enable_return_routed_experts``).
NO_ROUTES_HINT = "(start SGLang with --enable-return-routed-experts)"


def build_request(
    prompt_token_ids: Sequence[int],
    sampling_params: Mapping[str, Any],
    *,
    prompt_start: int,
    return_routes: bool = True,
    cache_salt: str | None = None,
) -> dict[str, Any]:
    """The ``POST /generate`` body continuing ``prompt_token_ids``.

    With ``return_routes``: ``return_routed_experts: true`` and ``routed_experts_start_len =
    prompt_start`` at top level. ``cache_salt`` (a ``GenerateReqInput`` field) when not None.
    """
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
    """The row shape a probe decodes with: the arguments, else the client's ``known`` spec.

    No ``moe_layers``: the probe learns them, so ids are range-checked, not deduplicated.
    Raises `ValueError` when neither gives ``num_layers`` and ``topk``.
    """
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
    """(finish type, matched stop) of ``meta_info["finish_reason"]`` (a dict, or None)."""
    fr = meta.get("finish_reason")
    if fr is None:
        return None, None
    if not isinstance(fr, dict) or not isinstance(fr.get("type"), str):
        raise EngineError(
            "engine response: expected meta_info.finish_reason as {'type': ...} or null, "
            f"found {fr!r:.200}"
        )
    kind: str = fr["type"]
    if kind == "abort":  # SGLang answers some aborts with HTTP 200 and this finish reason
        raise EngineError(f"engine response: the request was aborted: {fr.get('message')!r:.500}")
    matched = fr.get("matched")
    return kind, matched if isinstance(matched, int | str) and kind == "stop" else None


def decode_routes(
    value: object, spec: RouteSpec, *, max_bytes: int = DEFAULT_MAX_BYTES, check_ids: bool = True
) -> tuple[np.ndarray, int]:
    """``meta_info["routed_experts"]`` as ``[rows, L, K]`` int32; returns (array, payload bytes).

    Raises `PayloadError` (not a string, not base64, not whole int32 rows), and with
    ``check_ids`` `ExpertRangeError`/`DuplicateExpertError` (`r3arrow.ids.check_routes`).
    """
    if not isinstance(value, str | memoryview):
        raise PayloadError(
            "SGLang routed_experts: expected a base64 string of int32 rows, found "
            f"{type(value).__name__}"
        )
    arr = decode_sglang(value, spec, max_bytes=max_bytes)
    if check_ids:
        check_routes(arr, spec, what="routed_experts")
    return arr, len(value)


def parse_response(
    body: bytes,
    *,
    spec: RouteSpec | None,
    max_payload_bytes: int = DEFAULT_MAX_BYTES,
    want_routes: bool = True,
    check_ids: bool = True,
) -> ParsedResponse:
    """Parse a successful ``/generate`` response body (one sample, not streamed).

    ``spec`` gives the row shape (the payload has none); routes in a response without a spec
    are an `EngineError`. Raises `EngineError` for a body of the wrong shape (not a JSON
    object, a batch list, no ``output_ids``, no token generated, an abort) and the codec's
    errors for a bad payload (see `decode_routes`). The base64 payload is cut out of the body
    before JSON parsing (`lift_routes`: parsing it into a str would cost ~10x its decode).
    """
    obj, body, lifted = load_body(body)
    if not isinstance(obj, dict):
        raise EngineError(
            "engine response: expected one JSON object (n=1, one prompt), found "
            f"{type(obj).__name__} {body[:200]!r}"
        )
    tokens = obj.get("output_ids")
    if not isinstance(tokens, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in tokens
    ):
        raise EngineError(
            f"engine response: expected output_ids as a list of ints, found {tokens!r:.200}"
        )
    if not tokens:
        raise EngineError("engine response: expected at least one generated token, found none")
    meta = obj.get("meta_info")
    if not isinstance(meta, dict):
        raise EngineError(f"engine response: expected a meta_info object, found {meta!r:.200}")
    finish, matched = _finish(meta)
    routes: np.ndarray | None = None
    payload = 0
    raw = routes_value(meta.get("routed_experts"), lifted, "meta_info")
    if want_routes and raw is not None:
        if spec is None:
            raise EngineError(
                "SGLang routed_experts carry no shape: expected a RouteSpec (pass spec=, or "
                "probe_spec(num_layers=, topk=))"
            )
        routes, payload = decode_routes(raw, spec, max_bytes=max_payload_bytes, check_ids=check_ids)
        routes.flags.writeable = False  # a fresh buffer no one else holds: the trace keeps it
    return ParsedResponse(
        token_ids=tokens,
        finish_reason=finish,
        stop_reason=matched,
        logprobs=_logprobs(meta.get("output_token_logprobs")),
        routes=routes,
        payload_bytes=payload,
    )


def _logprobs(value: object) -> list[float] | None:
    """Sampled-token logprobs of ``meta_info["output_token_logprobs"]`` (``[[lp, id, text]]``)."""
    if not isinstance(value, list):
        return None
    try:
        return [float(entry[0]) for entry in value]
    except (IndexError, KeyError, TypeError, ValueError) as exc:
        raise EngineError(
            f"engine response: expected output_token_logprobs as [[logprob, id, text], ...], "
            f"found {value!r:.200} ({exc})"
        ) from None


__all__ = [
    "GENERATE_PATH",
    "NO_ROUTES_HINT",
    "RETURN_KEY",
    "START_KEY",
    "build_request",
    "decode_routes",
    "parse_response",
    "probe_shape",
]
