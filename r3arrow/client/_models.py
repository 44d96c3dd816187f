"""The client's result types: one finished generation, and the parts of a response it uses."""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class GenerateOutput:
    """One finished generation.

    ``routed_experts`` is ``[num_route_rows, L, K]`` (rows for tokens ``prompt_start ..
    P + G - 2``; read-only) or None when the engine returned none. ``token_start`` is the token
    index of its first row in the trace (None without a trace). ``payload_bytes`` counts the
    route payload as received (base64 characters); ``response_bytes`` the whole HTTP body.
    ``attempts`` is the number of HTTP attempts the request took (1 without retries) and
    ``base_url`` the server that answered.
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
    """The parts of an engine response the client uses (see `parse_response`).

    ``routes`` is ``[rows, L, K]`` (read-only) or None; ``payload_bytes`` is the size of the
    route payload as received (0 for nested JSON lists).
    """

    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None
    logprobs: list[float] | None
    routes: np.ndarray | None
    payload_bytes: int


__all__ = ["GenerateOutput", "ParsedResponse"]
