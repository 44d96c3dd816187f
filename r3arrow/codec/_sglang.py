"""SGLang's ``meta_info["routed_experts"]``: base64 of raw little-endian int32.

The payload has no shape: rows are ``[spec.num_layers, spec.topk]``.
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np

from r3arrow.codec._base64 import B64Payload, as_b64_input, b64_decoded_len, b64encode
from r3arrow.codec._common import (
    DEFAULT_MAX_BYTES,
    check_max_bytes,
    check_rows_for_encode,
    decode_rows,
    payload_boundary,
)
from r3arrow.errors import PayloadError, PayloadTooLargeError, RouteDTypeError
from r3arrow.spec import RouteSpec

_SGLANG_DTYPE: Final[np.dtype[Any]] = np.dtype("<i4")


def decode_sglang(
    b64: B64Payload, spec: RouteSpec, *, max_bytes: int = DEFAULT_MAX_BYTES
) -> np.ndarray:
    """SGLang's routes (no length or checksum) as ``[rows, L, K]`` int32 of ``spec``, a writable
    view. Raises as the package docstring says.
    """
    what = "SGLang routed_experts"
    max_bytes = check_max_bytes(max_bytes)
    if not isinstance(spec, RouteSpec):
        raise TypeError(
            "decode_sglang: expected a RouteSpec (the payload has no shape), found "
            f"{type(spec).__name__}"
        )
    with payload_boundary(what):
        return _decode_sglang(b64, spec, max_bytes, what)


def _decode_sglang(b64: B64Payload, spec: RouteSpec, max_bytes: int, what: str) -> np.ndarray:
    s = as_b64_input(b64, what)
    found = b64_decoded_len(s, what)
    if found > max_bytes:
        raise PayloadTooLargeError(
            f"{what}: payload of {found:,} bytes exceeds max_bytes={max_bytes:,}"
        )
    row = spec.num_layers * spec.topk * _SGLANG_DTYPE.itemsize
    if found % row:
        raise PayloadError(
            f"{what}: expected a multiple of {row} bytes (int32 rows of [{spec.num_layers}, "
            f"{spec.topk}]), found {found:,} bytes ({found / row:.3f} rows)"
        )
    return decode_rows(s, 0, _SGLANG_DTYPE, (found // row, spec.num_layers, spec.topk), spec, what)


def encode_sglang(arr: Any) -> str:
    """Encode ``[rows, L, K]`` integer routes as SGLang does: base64 of raw little-endian int32."""
    a = check_rows_for_encode(arr, "encode_sglang")
    if a.dtype.itemsize > 4 or a.dtype == np.uint32:
        info = np.iinfo(np.int32)
        if a.size and (a.min() < info.min or a.max() > info.max):
            raise RouteDTypeError(
                f"encode_sglang: expected ids that fit int32, found range [{a.min()}, {a.max()}]"
            )
    a = np.ascontiguousarray(a, dtype=_SGLANG_DTYPE)
    return b64encode(a.reshape(-1).view(np.uint8))
