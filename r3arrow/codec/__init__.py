"""Wire codecs for routed-expert payloads: vLLM ``.npy``, SkyRL packed, SGLang raw int32, Arrow IPC.

One module per wire format (``docs/design.md``, "Wire formats"): ``_npy`` (vLLM),
``_packed`` (SkyRL), ``_sglang`` (SGLang), ``_ipc`` (Arrow IPC), over ``_base64``
(strict, bounded base64) and ``_common`` (size caps, wire dtypes, shape checks).

Every decoder validates before it allocates: the size an encoded payload decodes to is
computed from the base64 length, a header's declared array size is checked against
``max_bytes`` and against that byte count, and only then is the payload decoded, once,
into its final buffer. Decoded arrays are ``[rows, L, K]`` views on that buffer (writable,
no second copy); Arrow IPC decoding is zero-copy on the input buffer (read-only views).
With a `RouteSpec`, ``L``/``K`` must match and router-layer ids must lie in
``[0, num_experts)`` (checked by :mod:`r3arrow.ids`); without one only the structure is
checked. A decoder is a trust boundary: its output needs no second check.

Errors: `PayloadError` (bad base64, header, keys, byte count, IPC stream),
`PayloadTooLargeError` (over ``max_bytes``), `RouteDTypeError`, `RouteShapeError`,
`ExpertRangeError` / `SchemaError` (from the spec checks); a negative or non-int
``max_bytes`` is argument misuse (``ValueError`` / ``TypeError``).
"""

from __future__ import annotations

from r3arrow.codec._base64 import HAVE_PYBASE64, B64Payload
from r3arrow.codec._common import DEFAULT_MAX_BYTES, WIRE_DTYPES
from r3arrow.codec._ipc import IPC_ROWS_METADATA_KEY, decode_ipc, decode_ipc_routes, encode_ipc
from r3arrow.codec._npy import decode_vllm, encode_vllm
from r3arrow.codec._packed import decode_packed, encode_packed
from r3arrow.codec._sglang import decode_sglang, encode_sglang

__all__ = [
    "DEFAULT_MAX_BYTES",
    "HAVE_PYBASE64",
    "IPC_ROWS_METADATA_KEY",
    "WIRE_DTYPES",
    "B64Payload",
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
