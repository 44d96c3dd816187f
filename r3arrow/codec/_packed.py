"""SkyRL's packed routes: ``{"data": base64, "shape": [N, L, K], "dtype": name}``."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Final

import numpy as np

from r3arrow.codec._base64 import as_b64_input, b64_decoded_len, b64decode, b64encode
from r3arrow.codec._common import (
    DEFAULT_MAX_BYTES,
    WIRE_DTYPES,
    WIRE_LE,
    check_against_spec,
    check_max_bytes,
    check_rows_for_encode,
    check_shape,
    too_large,
    view_rows,
    wire_name,
)
from r3arrow.errors import PayloadError, RouteDTypeError
from r3arrow.spec import RouteSpec

_PACKED_KEYS: Final[frozenset[str]] = frozenset({"data", "shape", "dtype"})


def decode_packed(
    obj: Mapping[str, Any], spec: RouteSpec | None = None, *, max_bytes: int = DEFAULT_MAX_BYTES
) -> np.ndarray:
    """Decode SkyRL's ``{"data": base64, "shape": [N, L, K], "dtype": name}`` to ``[N, L, K]``.

    ``dtype`` is one of uint8/uint16/int16/int32, data little-endian; the keys must be exactly
    these three. The result keeps the payload dtype and is a writable view on the decoded buffer.
    """
    what = "packed routes"
    max_bytes = check_max_bytes(max_bytes)
    if not isinstance(obj, Mapping):
        raise PayloadError(
            f"{what}: expected a dict with keys data/shape/dtype, found {type(obj).__name__}"
        )
    if set(obj) != _PACKED_KEYS:
        raise PayloadError(
            f"{what}: expected keys ['data', 'dtype', 'shape'], found {sorted(map(str, obj))}"
        )
    name = obj["dtype"]
    if not isinstance(name, str) or name not in WIRE_LE:
        raise RouteDTypeError(
            f"{what}: expected dtype one of {list(WIRE_DTYPES)}, found {name!r:.100}"
        )
    dt = WIRE_LE[name]
    shape = check_shape(obj["shape"], what)
    s = as_b64_input(obj["data"], what)
    declared = math.prod(shape) * dt.itemsize
    if declared > max_bytes:
        raise too_large(what, declared, max_bytes, f"shape {list(shape)} of {name}")
    found = b64_decoded_len(s, what)
    if found != declared:
        raise PayloadError(
            f"{what}: shape {list(shape)} of {name} expects {declared:,} bytes, found {found:,}"
        )
    buf = b64decode(s, what)
    return check_against_spec(view_rows(buf, 0, dt, shape), spec, what)


def encode_packed(arr: Any) -> dict[str, Any]:
    """Encode ``[rows, L, K]`` routes (uint8/uint16/int16/int32) as SkyRL's packed dict."""
    a = check_rows_for_encode(arr, "encode_packed")
    name = wire_name(a.dtype, "encode_packed")
    a = np.ascontiguousarray(a, dtype=WIRE_LE[name])
    return {"data": b64encode(a.reshape(-1).view(np.uint8)), "shape": list(a.shape), "dtype": name}
