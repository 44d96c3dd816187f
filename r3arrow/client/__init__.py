"""Async engine client: vLLM's and SGLang's generate APIs with incremental route capture.

``EngineClient(urls, spec, protocol="vllm" | "sglang", retry=RetryPolicy(...))``: the same
`generate` call, trace semantics, retries and size caps over either wire protocol (SGLang:
``docs/sglang.md``). Its HTTP errors are `r3arrow.errors.EngineHTTPError`.

`EngineClient` sends a whole conversation as the prompt and, with a `RouteTrace`,
``routed_experts_prompt_start = trace.captured`` (``docs/design.md``, "Ragged routes and the
terminal gap"), so each response carries only the rows the trace lacks: ``P - captured + G - 1``
of them. The rows are decoded (base64 ``.npy``, no pickle), checked (shape, row count, id
range) and recorded into the trace once, after a successful decode; any error leaves the trace
unchanged.

Transport: one pooled `httpx.AsyncClient` for a set of base URLs, a concurrency limit,
timeouts, retries with exponential backoff and jitter on connection errors, 429 and 5xx
(never on other 4xx, never on data errors), and sticky routing of a session to one base URL
(rendezvous hashing) so the engine's prefix cache keeps working across turns.

Modules behind this package: ``_client`` (`EngineClient`: pooling, routing, the request
loop), ``_protocol`` (request bodies, response parsing and route decoding; pure),
``_sglang`` (SGLang's ``POST /generate``: bodies and parsing; pure), ``_retry`` (what is
retried and how long to wait), ``_models`` (result types).
"""

from r3arrow._public import set_homes
from r3arrow.client._client import EngineClient, Protocol
from r3arrow.client._models import GenerateOutput
from r3arrow.client._protocol import Endpoint
from r3arrow.client._retry import RetryPolicy

__all__ = [
    "Endpoint",
    "EngineClient",
    "GenerateOutput",
    "Protocol",
    "RetryPolicy",
]

set_homes(globals(), __all__)
