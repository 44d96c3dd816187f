"""Embedded reference inference engine: a tiny deterministic MoE model behind vLLM's and SGLang's
HTTP schemas.

`ReferenceEngine` generates and records its own top-k routing per token and layer;
`EngineServer` serves it on loopback exactly like vLLM's ``/inference/v1/generate`` and
``/v1/completions`` (routed experts as base64 ``.npy``, vLLM's row semantics) and, on the
same server, SGLang's native ``/generate`` (``return_routed_experts``,
``routed_experts_start_len``, base64 raw int32; ``docs/sglang.md``);
`FaultPlan` injects delays, trickled bodies, error statuses, dropped connections, bad route
payloads and raw answers of any shape.

Modules: ``model`` (`TinyMoE`, `TinyMoEConfig`, `ReferenceEngine`: torch, no HTTP),
``_protocol`` (vLLM's request validation, error JSON and response shapes; `encode_npy_b64`),
``_sglang`` (the same for SGLang's ``/generate``),
``faults`` (`Fault`, `FaultPlan`, `corrupt_routes`, `drift_prompt`: what each fault does),
``server`` (`EngineServer`, `RequestLog`: the HTTP server). Invalid requests raise
`r3arrow.errors.EngineRequestError`.
"""

from r3arrow.testing.engine._protocol import encode_npy_b64
from r3arrow.testing.engine.faults import Fault, FaultPlan, corrupt_routes, drift_prompt
from r3arrow.testing.engine.model import GenerateResult, ReferenceEngine, TinyMoE, TinyMoEConfig
from r3arrow.testing.engine.server import EngineServer, RequestLog

__all__ = [
    "EngineServer",
    "Fault",
    "FaultPlan",
    "GenerateResult",
    "ReferenceEngine",
    "RequestLog",
    "TinyMoE",
    "TinyMoEConfig",
    "corrupt_routes",
    "drift_prompt",
    "encode_npy_b64",
]
