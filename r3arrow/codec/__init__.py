"""Wire codecs for routed-expert payloads: vLLM ``.npy``, SkyRL packed, SGLang raw int32, Arrow IPC.

``docs/design.md``, "Wire formats". Decoders validate before they allocate and decode once:
``[rows, L, K]`` writable views (zero-copy read-only ones for Arrow IPC). With a
`RouteSpec`, ``L``/``K`` must match and router-layer ids lie in ``[0, num_experts)``. For
ANY payload a decoder raises only `R3ArrowError` subclasses (`PayloadError`,
`PayloadTooLargeError` over ``max_bytes``, `RouteDTypeError`, `RouteShapeError` including a
row of more than 2**24 ids, `ExpertRangeError` / `SchemaError`), wrapping a library
exception that still escapes into `PayloadError`; a bad ``spec``, ``max_bytes`` or
``max_ratio`` argument raises ``ValueError`` / ``TypeError``. What corruption can pass
(no format checksums its ids) is in that section too.
"""

from __future__ import annotations

from r3arrow._public import set_homes
from r3arrow.codec._common import DEFAULT_MAX_BYTES
from r3arrow.codec._ipc import DEFAULT_MAX_RATIO, decode_ipc, decode_ipc_routes, encode_ipc
from r3arrow.codec._npy import decode_vllm, encode_vllm
from r3arrow.codec._packed import decode_packed, encode_packed
from r3arrow.codec._sglang import decode_sglang, encode_sglang

__all__ = [
    "DEFAULT_MAX_BYTES",
    "DEFAULT_MAX_RATIO",
    "decode_ipc",
    "decode_ipc_routes",
    "decode_packed",
    "decode_sglang",
    "decode_vllm",
    "encode_ipc",
    "encode_packed",
    "encode_sglang",
    "encode_vllm",
]

set_homes(globals(), __all__)
