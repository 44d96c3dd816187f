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

Errors: for ANY payload a decoder raises only `R3ArrowError` subclasses: `PayloadError`
(bad base64, header, keys, byte count, IPC stream), `PayloadTooLargeError` (over
``max_bytes``; for Arrow IPC also over ``max_ratio`` times the payload, with a floor),
`RouteDTypeError`, `RouteShapeError` (including a row ``[L, K]`` of more than 2**24 ids,
which a zero-row payload could otherwise declare), `ExpertRangeError` / `SchemaError` (from
the spec checks). The root causes are checked before allocating; a library exception that
still escapes is wrapped into `PayloadError` at the decoder boundary with the original as
``__cause__`` (`_common.payload_boundary`). A bad ``spec``, ``max_bytes`` or ``max_ratio``
argument is misuse (``ValueError`` / ``TypeError``).

No format checksums its id bytes, so what corruption can go unnoticed is bounded, not nil
(``tests/core/test_codec_fuzz.py`` checks exactly this): a changed id byte whose value stays
in range decodes as that value; flipping an ``.npy`` header's byte-order mark reads the ids
byteswapped (caught only when they leave ``[0, num_experts)``); an SGLang payload has no
length, so whole rows cut or added decode as fewer or more rows; and without a spec, a
packed or ``.npy`` shape edit that keeps the byte count (``[2, 3, 2]`` to ``[3, 2, 2]``)
decodes as that shape, so pass a spec to pin ``L`` and ``K``. Arrow IPC streams are held to
the layout writers produce (buffers back to back, nothing after the end-of-stream marker, the
ids' type as the metadata spec says), so an edit outside the id bytes is refused or harmless.

SkyRL packed: `encode_packed` writes the narrowest dtype SkyRL decodes (uint8/int16/int32,
see `_packed`); `decode_packed` accepts those three.
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
