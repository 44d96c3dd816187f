"""vLLM's HTTP protocol, server side: request validation, error JSON and response shapes.

A hand-written copy of what vLLM 0.32.0 (``--enable-return-routed-experts
--enable-scale-out --skip-tokenizer-init``) accepts and answers, see docs/vllm-schema.md:

* ``POST /inference/v1/generate``: ``{"token_ids", "sampling_params", "model"?, "request_id"?,
  "return_token_ids"?, ...}`` -> ``{"request_id": "generate-tokens-...", "choices": [{"index",
  "finish_reason", "stop_reason", "token_ids", "routed_experts", "sampling_mask",
  "weight_versions", "logprobs"}], "usage", ...}``
* ``POST /v1/completions``: OpenAI completions with ``"prompt": [ids]`` (or a list of them) and
  the sampling parameters at top level; ``choices[i].token_ids`` only with
  ``"return_token_ids": true``.
* ``GET /health`` (200, empty body), ``GET /v1/models``.

``routed_experts`` is base64 of an ``.npy`` file (`encode_npy_b64`), ``[P - start + G - 1, L,
K]``. Errors are ``{"error": {"message", "type", "param", "code"}}`` (`error_body`); request
validation raises `ErrorResponse`, which the server turns into that body. Differences from
vLLM (all stricter): token ids outside the vocabulary are a 400 (vLLM's engine dies on them),
``P + max_tokens > max_model_len`` is a 400 (vLLM silently lowers ``max_tokens``), and
streaming, text prompts and sampling features the tiny model lacks (``top_p`` ...) are a 400
instead of being ignored.
"""

from __future__ import annotations

import dataclasses
import io
import secrets
import time
from http import HTTPStatus
from typing import TYPE_CHECKING, Any

import numpy as np
import pybase64

if TYPE_CHECKING:
    from r3arrow.testing.engine.model import GenerateResult

GENERATE_PATH = "/inference/v1/generate"
COMPLETIONS_PATH = "/v1/completions"
GET_PATHS = ("/health", "/v1/models")
POST_PATHS = (GENERATE_PATH, COMPLETIONS_PATH)

#: Sampling parameters the tiny model does not implement, with the values that mean "off".
UNSUPPORTED_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "top_p": (1, 1.0, None),
    "top_k": (0, -1, None),
    "min_p": (0, 0.0, None),
    "presence_penalty": (0, 0.0, None),
    "frequency_penalty": (0, 0.0, None),
    "repetition_penalty": (1, 1.0, None),
    "prompt_logprobs": (None,),
    "stop": (None, [], ""),
    "logit_bias": (None, {}),
    "allowed_token_ids": (None, []),
    "bad_words": (None, []),
    "echo": (False, None),
    "best_of": (None, 1),
}


# ------------------------------------------------------------------ errors
def error_body(
    status: int, message: str, *, err_type: str, param: str | None = None
) -> dict[str, Any]:
    """vLLM's error JSON: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": err_type, "param": param, "code": status}}


class ErrorResponse(Exception):
    """An error answer: vLLM's ``{"error": {...}}`` body (`body`) with HTTP ``status``."""

    def __init__(
        self, status: int, message: str, *, err_type: str, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type
        self.param = param

    def body(self) -> dict[str, Any]:
        return error_body(self.status, self.message, err_type=self.err_type, param=self.param)


def status_type(code: int) -> str:
    """vLLM's ``error.type`` for an HTTP status."""
    named = {
        500: "InternalServerError",
        503: "ServiceUnavailableError",
        404: "NotFoundError",
        400: "BadRequestError",
    }
    if code in named:
        return named[code]
    try:
        return HTTPStatus(code).phrase
    except ValueError:
        return "Error"


def schema_error(loc: str, kind: str, msg: str, value: object) -> ErrorResponse:
    """A 400 as vLLM renders pydantic validation errors (type "Bad Request", param = loc)."""
    shown: object = value
    if isinstance(value, list | tuple | dict):
        shown = f"<{type(value).__name__} of {len(value)} items>"
    detail = {"type": kind, "loc": loc, "msg": msg, "input": shown}
    return ErrorResponse(400, f"1 validation error:\n  {detail}", err_type="Bad Request", param=loc)


def bad_request(message: str, param: str | None = None) -> ErrorResponse:
    """A 400 as vLLM renders its own checks (type "BadRequestError")."""
    return ErrorResponse(400, message, err_type="BadRequestError", param=param)


# ------------------------------------------------------------------ fields
def get_int(obj: dict[str, Any], key: str, loc: str, default: int | None) -> int | None:
    """``obj[key]`` as an int (an integral float is accepted, like pydantic), else ``default``."""
    value = obj.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise schema_error(f"{loc}.{key}", "int_parsing", "Input should be a valid integer", value)
    return value


def get_float(obj: dict[str, Any], key: str, loc: str, default: float) -> float:
    """``obj[key]`` as a float, else ``default``."""
    value = obj.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise schema_error(f"{loc}.{key}", "float_parsing", "Input should be a valid number", value)
    return float(value)


def get_bool(obj: dict[str, Any], key: str, loc: str, default: bool) -> bool:
    """``obj[key]`` as a bool (no coercion), else ``default``."""
    value = obj.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise schema_error(f"{loc}.{key}", "bool_parsing", "Input should be a valid boolean", value)
    return value


def get_int_list(obj: dict[str, Any], key: str, loc: str) -> list[int] | None:
    """``obj[key]`` as a list of ints, or None when absent."""
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in value
    ):
        raise schema_error(
            f"{loc}.{key}", "list_type", "Input should be a valid list of integers", value
        )
    return value


def prompt_ids(value: object, loc: str) -> list[int]:
    """A token-id prompt as vLLM's schema checks it (a non-empty list of ints >= 0)."""
    if not isinstance(value, list) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in value
    ):
        raise schema_error(loc, "list_type", "Input should be a valid list of integers", value)
    if not value:
        raise schema_error(
            loc, "too_short", "List should have at least 1 item after validation, not 0", value
        )
    if any(t < 0 for t in value):
        raise schema_error(
            loc, "value_error", "Value error, token_ids must not contain negative values", value
        )
    return value


# ---------------------------------------------------------------- sampling
@dataclasses.dataclass(frozen=True)
class Sampling:
    """The sampling parameters of one request, validated (``start``: routes prompt start)."""

    n: int
    max_tokens: int | None
    temperature: float
    seed: int | None
    start: int
    stop_token_ids: list[int] | None
    ignore_eos: bool
    min_tokens: int
    logprobs: int | None


def parse_sampling(obj: dict[str, Any], loc: str, *, default_max_tokens: int | None) -> Sampling:
    """Validate the sampling parameters found in ``obj`` (at ``loc`` of the body)."""
    for key, allowed in UNSUPPORTED_DEFAULTS.items():
        if key in obj and obj[key] not in allowed:
            raise bad_request(
                f"{key}={obj[key]!r} is not supported by the r3arrow reference engine "
                f"(supported: the default, {allowed[0]!r})",
                key,
            )
    start = get_int(obj, "routed_experts_prompt_start", loc, 0)
    assert start is not None
    if start < 0:
        raise schema_error(
            f"{loc}.routed_experts_prompt_start",
            "greater_than_equal",
            "Input should be greater than or equal to 0",
            str(start),
        )
    n = get_int(obj, "n", loc, 1)
    assert n is not None
    if n < 1:
        raise bad_request(f"n must be at least 1, got {n}. (parameter=n, value={n})", "n")
    min_tokens = get_int(obj, "min_tokens", loc, 0)
    assert min_tokens is not None
    logprobs = get_int(obj, "logprobs", loc, None)
    if logprobs is not None and logprobs < -1:
        raise bad_request(
            f"logprobs must be non-negative or -1, got {logprobs}. "
            f"(parameter=logprobs, value={logprobs})",
            "logprobs",
        )
    return Sampling(
        n=n,
        max_tokens=get_int(obj, "max_tokens", loc, default_max_tokens),
        temperature=get_float(obj, "temperature", loc, 1.0),
        seed=get_int(obj, "seed", loc, None),
        start=start,
        stop_token_ids=get_int_list(obj, "stop_token_ids", loc),
        ignore_eos=get_bool(obj, "ignore_eos", loc, False),
        min_tokens=min_tokens,
        logprobs=logprobs,
    )


def reject_streaming(obj: dict[str, Any]) -> None:
    """A 400 for ``stream=true`` (the reference engine answers whole responses only)."""
    if obj.get("stream"):
        raise bad_request("stream=true is not supported by the r3arrow reference engine", "stream")


def check_model(body: dict[str, Any], model_name: str) -> None:
    """A 404 as vLLM answers when ``body["model"]`` names another model."""
    model = body.get("model")
    if model is not None and model != model_name:
        raise ErrorResponse(
            404,
            f"The model `{model}` does not exist. Valid aliases: {model_name}",
            err_type="NotFoundError",
            param="model",
        )


# ---------------------------------------------------------------- responses
def encode_npy_b64(arr: np.ndarray) -> str:
    """vLLM's ``numpy2base64``: base64 (ASCII) of the ``.npy`` bytes of ``arr``."""
    with io.BytesIO() as buf:
        np.save(buf, arr, allow_pickle=False)
        return pybase64.b64encode(buf.getbuffer()).decode("ascii")


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    """vLLM's ``usage`` object."""
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "completion_tokens": completion_tokens,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


def generate_logprobs(res: GenerateResult, num: int) -> dict[str, Any]:
    """vLLM's GenerateLogProbs: per token the sampled entry, then ``top_logprobs`` = the first
    ``max(num, 1)`` of {sampled, top-1, top-2, ...} (the sampled token appears once)."""
    assert (
        res.logprobs is not None and res.logprob_ranks is not None and res.top_logprobs is not None
    )
    content = []
    for tok, lp, rank, top in zip(
        res.token_ids, res.logprobs, res.logprob_ranks, res.top_logprobs, strict=True
    ):
        entries = [{"token_id": tok, "logprob": lp, "rank": rank}]
        for j, (tid, tlp) in enumerate(top):
            if tid != tok:
                entries.append({"token_id": tid, "logprob": tlp, "rank": j + 1})
        content.append({**entries[0], "top_logprobs": entries[: max(num, 1)]})
    return {"content": content}


def generate_choice(
    index: int, res: GenerateResult, routes: str | None, logprobs: int | None
) -> dict[str, Any]:
    """One ``choices[i]`` of a generate response (``routes``: the encoded payload)."""
    return {
        "index": index,
        "finish_reason": res.finish_reason,
        "stop_reason": res.stop_reason,
        "token_ids": res.token_ids,
        "routed_experts": routes,
        "sampling_mask": None,
        "weight_versions": [{"version": "default", "start": 0, "end": len(res.token_ids)}],
        "logprobs": None if logprobs is None else generate_logprobs(res, logprobs),
    }


def generate_response(
    *,
    request_id: str | None,
    model_name: str,
    prompt: list[int],
    return_token_ids: bool,
    choices: list[dict[str, Any]],
    completion_tokens: int,
) -> dict[str, Any]:
    """A whole ``/inference/v1/generate`` response, keys in vLLM's order."""
    rid = request_id if request_id is not None else secrets.token_hex(8)
    return {
        "request_id": f"generate-tokens-{rid}",
        "model": model_name,
        "created": int(time.time()),
        "usage": usage(len(prompt), completion_tokens),
        "prompt_logprobs": None,
        "prompt_token_id_logprobs": None,
        "prompt_token_ids": prompt if return_token_ids else None,
        "mm_placeholders": None,
        "metrics": None,
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "output_mode": "tokens",
        "choices": choices,
    }


def completion_choice(
    index: int, res: GenerateResult, prompt: list[int], routes: str | None, return_token_ids: bool
) -> dict[str, Any]:
    """One ``choices[i]`` of a completions response (``text`` empty: no tokenizer)."""
    return {
        "index": index,
        "text": "",
        "logprobs": None,
        "finish_reason": res.finish_reason,
        "stop_reason": res.stop_reason,
        "token_ids": res.token_ids if return_token_ids else None,
        "prompt_logprobs": None,
        "prompt_token_ids": prompt if return_token_ids else None,
        "routed_experts": routes,
    }


def completions_response(
    *, model_name: str, choices: list[dict[str, Any]], prompt_tokens: int, completion_tokens: int
) -> dict[str, Any]:
    """A whole ``/v1/completions`` response, keys in vLLM's order."""
    return {
        "id": f"cmpl-{secrets.token_hex(8)}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": "r3arrow-reference-engine",
        "usage": usage(prompt_tokens, completion_tokens),
        "kv_transfer_params": None,
        "ec_transfer_params": None,
        "metrics": None,
    }


def models_response(model_name: str, created: int, max_model_len: int) -> dict[str, Any]:
    """vLLM's ``GET /v1/models`` answer for one model."""
    return {
        "object": "list",
        "data": [
            {
                "id": model_name,
                "object": "model",
                "created": created,
                "owned_by": "r3arrow",
                "root": model_name,
                "parent": None,
                "max_model_len": max_model_len,
                "permission": [
                    {
                        "id": f"modelperm-{secrets.token_hex(8)}",
                        "object": "model_permission",
                        "created": created,
                        "allow_create_engine": False,
                        "allow_sampling": True,
                        "allow_logprobs": True,
                        "allow_search_indices": False,
                        "allow_view": True,
                        "allow_fine_tuning": False,
                        "organization": "*",
                        "group": None,
                        "is_blocking": False,
                    }
                ],
            }
        ],
    }
