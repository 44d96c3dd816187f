"""Embedded reference inference engine: a tiny deterministic MoE model served with vLLM's HTTP schema.

`ReferenceEngine` generates and records its own top-k routing per token and layer;
`EngineServer` serves it on loopback exactly like vLLM's ``/inference/v1/generate`` and
``/v1/completions`` (routed experts as base64 ``.npy``, vLLM's row semantics);
`FaultPlan` injects delays, error statuses, dropped connections and bad route payloads.
"""

from r3arrow.engine.faults import Fault, FaultPlan
from r3arrow.engine.model import (
    EngineRequestError,
    GenerateResult,
    ReferenceEngine,
    TinyMoE,
    TinyMoEConfig,
)
from r3arrow.engine.server import EngineServer, RequestLog, encode_npy_b64

__all__ = [
    "EngineRequestError",
    "EngineServer",
    "Fault",
    "FaultPlan",
    "GenerateResult",
    "ReferenceEngine",
    "RequestLog",
    "TinyMoE",
    "TinyMoEConfig",
    "encode_npy_b64",
]
