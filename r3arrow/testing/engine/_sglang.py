"""SGLang's native ``POST /generate``, server side: request validation, error JSON, responses.

A hand-written copy of what SGLang 0.5.23 (``--enable-return-routed-experts
--skip-tokenizer-init``) accepts and answers, from its source (sgl-project/sglang at v0.5.23;
``docs/sglang.md`` has the field table):

* request (``python/sglang/srt/managers/io_struct.py``, ``GenerateReqInput``; the JSON
  contract in ``python/sglang/api/v1/api_types.py``, ``decode_GenerateRequest`` /
  ``decode_SamplingParams``): ``{"input_ids": [ids], "sampling_params": {"max_new_tokens"
  (128), "temperature" (1.0), "sampling_seed", "stop_token_ids", "ignore_eos",
  "min_new_tokens", "n", ...}, "return_routed_experts": false, "routed_experts_start_len": 0,
  "rid"?, "stream"?}``. Unknown ``sampling_params`` keys are refused; unknown top-level keys
  are ignored.
* response (``python/sglang/srt/managers/tokenizer_manager.py``, ``_handle_batch_output``,
  the ``BatchTokenIDOutput`` branch: no ``text`` without a tokenizer): ``{"output_ids",
  "meta_info": {"id", "finish_reason", "prompt_tokens", "weight_version", "num_retractions",
  "reasoning_tokens", "completion_tokens", "cached_tokens", "routed_experts"?,
  "e2e_latency"}}``; ``n > 1`` answers a list of such objects.
* ``finish_reason`` (``python/sglang/srt/managers/schedule_batch.py``): ``{"type":
  "length", "length": G}`` or ``{"type": "stop", "matched": token_id}``.
* ``routed_experts`` only with ``return_routed_experts``: base64 of raw int32 ``[P - start
  + G - 1, L, K]`` (`r3arrow.codec.encode_sglang`;
  ``python/sglang/srt/managers/detokenizer_manager.py``), rows ``[start, seqlen - 1)``.
* errors: a contract violation is HTTP 400 ``{"error": "<text>"}`` (`contract_error`;
  ``python/sglang/srt/entrypoints/http_server.py``, ``generate_request``); a ``ValueError``
  (no input, ``routed_experts_start_len`` outside ``[0, P]``,
  ``python/sglang/srt/managers/scheduler.py``) is HTTP 400 ``{"error": {"message"}}``
  (`value_error`, ``_create_error_response``); a body FastAPI cannot parse is HTTP 400 in
  SGLang's ``ErrorResponse`` (`validation_error`).

Differences from SGLang (all stricter, each a 400 ``{"error": {"message"}}``): text
prompts, streaming, logprobs and sampling features the tiny model lacks (``top_p`` ...);
token ids outside the vocabulary; a batch of prompts.
"""

from __future__ import annotations

import secrets
from http import HTTPStatus
from typing import Any

from r3arrow.testing.engine import _protocol as proto

GENERATE_PATH = "/generate"

#: ``SamplingParams`` fields, in SGLang's order (``_FIELDS_SamplingParams``).
SAMPLING_FIELDS: tuple[str, ...] = (
    "max_new_tokens",
    "stop",
    "stop_token_ids",
    "stop_regex",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_new_tokens",
    "n",
    "json_schema",
    "regex",
    "ebnf",
    "structural_tag",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "stream_interval",
    "logit_bias",
    "sampling_seed",
    "custom_params",
    "beam_width",
    "watermark",
    "choice",
)
#: Fields the tiny model does not implement, with the values that mean "off".
UNSUPPORTED_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "stop": (None, [], ""),
    "stop_regex": (None, [], ""),
    "top_p": (None, 1, 1.0),
    "top_k": (None, -1, 1073741824),
    "min_p": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "json_schema": (None,),
    "regex": (None,),
    "ebnf": (None,),
    "structural_tag": (None,),
    "logit_bias": (None, {}),
    "custom_params": (None,),
    "beam_width": (None,),
    "watermark": (None,),
    "choice": (None, []),
}


class SGLangError(Exception):
    """An error answer: HTTP ``status`` with SGLang's JSON ``payload``."""

    def __init__(self, status: int, payload: dict[str, Any]) -> None:
        super().__init__(str(payload))
        self.status = status
        self.payload = payload


def contract_error(message: str) -> SGLangError:
    """A 400 as ``generate_request`` answers a contract violation: ``{"error": text}``."""
    return SGLangError(400, {"error": message})


def value_error(message: str, status: int = 400) -> SGLangError:
    """An error as ``_create_error_response`` renders a ``ValueError``.

    The body is ``{"error": {"message": message}}``.
    """
    return SGLangError(status, {"error": {"message": message}})


def validation_error(message: str) -> SGLangError:
    """A 400 as SGLang's ``RequestValidationError`` handler renders it (``ErrorResponse``)."""
    return SGLangError(
        400,
        {
            "object": "error",
            "message": message,
            "type": HTTPStatus.BAD_REQUEST.phrase,
            "param": None,
            "code": 400,
        },
    )


def unexpected(v: object) -> str:
    """serde's ``Unexpected`` text, as ``api_types._unexpected`` writes it."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"boolean `{'true' if v else 'false'}`"
    if isinstance(v, int):
        return f"integer `{v}`"
    if isinstance(v, float):
        return f"floating point `{v}`"
    if isinstance(v, str):
        return f'string "{v}"'
    if isinstance(v, list):
        return "sequence"
    if isinstance(v, dict):
        return "map"
    return type(v).__name__


def _invalid(v: object, expected: str) -> SGLangError:
    return contract_error(f"invalid type: {unexpected(v)}, expected {expected}")


def _int(v: object, default: int | None) -> int | None:
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int):
        raise _invalid(v, "i64")
    return v


def _float(v: object, default: float) -> float:
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise _invalid(v, "f64")
    return float(v)


def _bool(v: object, default: bool) -> bool:
    if v is None:
        return default
    if not isinstance(v, bool):
        raise _invalid(v, "a boolean")
    return v


def _int_list(v: object) -> list[int] | None:
    if v is None:
        return None
    if not isinstance(v, list):
        raise _invalid(v, "a sequence")
    for e in v:
        if e is None:
            raise _invalid(e, "i64")
        _int(e, None)
    return v


def _unknown_field(key: str) -> SGLangError:
    listed = ", ".join(f"`{f}`" for f in SAMPLING_FIELDS)
    return contract_error(f"unknown field `{key}`, expected one of {listed}")


def prompt_ids(body: dict[str, Any]) -> list[int]:
    """``body["input_ids"]``, one flat prompt, checked as SGLang's contract checks it."""
    if body.get("text") is not None:
        raise value_error(
            "text prompts need a tokenizer; the r3arrow reference engine runs as SGLang with "
            "--skip-tokenizer-init and takes input_ids"
        )
    ids = body.get("input_ids")
    if ids is None:
        raise value_error("Either text, input_ids or input_embeds should be provided.")
    if not isinstance(ids, list):
        raise _invalid(ids, "a value or an array of values for TokenIdsOrList")
    if ids and isinstance(ids[0], list):
        raise value_error("a batch of prompts is not supported by the r3arrow reference engine")
    for t in ids:
        if t is None:
            raise _invalid(t, "i64")
        _int(t, None)
    if not ids:
        raise value_error("input_ids: expected at least one token, found none")
    return ids


#: ``SamplingParams.max_new_tokens`` when the request has none.
DEFAULT_MAX_NEW_TOKENS = 128


def parse_request(body: dict[str, Any]) -> proto.Sampling:
    """Validate ``body``'s sampling and route fields; the result in the vLLM side's form.

    ``start`` is ``routed_experts_start_len`` (checked against the prompt by `check_start`);
    ``max_tokens`` is None when the request gives no ``max_new_tokens`` (see
    `max_new_tokens`).
    """
    if _bool(body.get("stream"), False):
        raise value_error("stream=true is not supported by the r3arrow reference engine")
    if body.get("return_logprob"):
        raise value_error("return_logprob is not supported by the r3arrow reference engine")
    sp = body.get("sampling_params")
    if sp is None:
        sp = {}
    if isinstance(sp, list):
        raise value_error("a list of sampling_params is not supported by the r3arrow engine")
    if not isinstance(sp, dict):
        raise _invalid(sp, "a value or an array of values for SamplingParamsOrList")
    for key in sp:
        if key not in SAMPLING_FIELDS:
            raise _unknown_field(key)
    for key, allowed in UNSUPPORTED_DEFAULTS.items():
        if key in sp and sp[key] not in allowed:
            raise value_error(
                f"{key}={sp[key]!r} is not supported by the r3arrow reference engine "
                f"(supported: the default)"
            )
    n = _int(sp.get("n"), 1)
    max_new = _int(sp.get("max_new_tokens"), None)
    min_new = _int(sp.get("min_new_tokens"), 0)
    assert n is not None and min_new is not None
    if n < 1:
        raise value_error(f"n must be at least 1, got {n}.")
    if max_new is not None and max_new < 1:
        raise value_error(
            f"max_new_tokens must be at least 1 in the r3arrow reference engine, got {max_new}."
        )
    start = _int(body.get("routed_experts_start_len"), 0)
    assert start is not None
    return proto.Sampling(
        n=n,
        max_tokens=max_new,
        temperature=_float(sp.get("temperature"), 1.0),
        seed=_int(sp.get("sampling_seed"), None),
        start=start,
        stop_token_ids=_int_list(sp.get("stop_token_ids")),
        ignore_eos=_bool(sp.get("ignore_eos"), False),
        min_tokens=min_new,
        logprobs=None,
    )


def max_new_tokens(requested: int | None, prompt_tokens: int, context_len: int) -> int:
    """The tokens to generate, as SGLang's tokenizer manager bounds them.

    An explicit ``max_new_tokens`` past the context is a 400 with SGLang's message; without
    one, the default (128) is lowered to the room left in the context.
    """
    if requested is None:
        return max(1, min(DEFAULT_MAX_NEW_TOKENS, context_len - prompt_tokens))
    if requested + prompt_tokens > context_len:
        raise value_error(
            "Requested token count exceeds the model's maximum context length "
            f"of {context_len} tokens. You requested a total of {requested + prompt_tokens} "
            f"tokens: {prompt_tokens} tokens from the input messages and "
            f"{requested} tokens for the completion. Please reduce the number "
            "of tokens in the input messages or the completion to fit within the limit."
        )
    return requested


def check_start(start: int, prompt_tokens: int) -> None:
    """SGLang's scheduler check of ``routed_experts_start_len`` (``[0, P]``), same messages."""
    if start < 0:
        raise value_error(
            f"recv_req.routed_experts_start_len={start} is lower than 0. "
            "Please use a non-negative routed_experts_start_len."
        )
    if start > prompt_tokens:
        raise value_error(
            f"recv_req.routed_experts_start_len={start} is higher than the number of input "
            f"tokens len(req.origin_input_ids)={prompt_tokens}. Please use a smaller "
            "routed_experts_start_len."
        )


def finish_reason(reason: str, token_ids: list[int], stop: int | None) -> dict[str, Any]:
    """SGLang's ``finish_reason`` JSON (``FINISH_LENGTH`` / ``FINISH_MATCHED_TOKEN``)."""
    if reason == "stop":
        return {"type": "stop", "matched": stop if stop is not None else token_ids[-1]}
    return {"type": "length", "length": len(token_ids)}


def response(
    *,
    rid: str | None,
    prompt_tokens: int,
    token_ids: list[int],
    finish: dict[str, Any],
    routes: str | None,
    latency: float,
) -> dict[str, Any]:
    """One finished ``/generate`` answer, keys in SGLang's order (``routes``: the payload)."""
    meta: dict[str, Any] = {
        "id": rid if rid is not None else secrets.token_hex(16),
        "finish_reason": finish,
        "prompt_tokens": prompt_tokens,
        "weight_version": "default",
        "num_retractions": 0,
        "reasoning_tokens": 0,
        "completion_tokens": len(token_ids),
        "cached_tokens": 0,
    }
    if routes is not None:
        meta["routed_experts"] = routes
    meta["e2e_latency"] = latency
    return {"output_ids": token_ids, "meta_info": meta}


__all__ = [
    "DEFAULT_MAX_NEW_TOKENS",
    "GENERATE_PATH",
    "SAMPLING_FIELDS",
    "SGLangError",
    "check_start",
    "contract_error",
    "finish_reason",
    "max_new_tokens",
    "parse_request",
    "prompt_ids",
    "response",
    "unexpected",
    "validation_error",
    "value_error",
]
