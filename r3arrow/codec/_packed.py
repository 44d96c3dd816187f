"""SkyRL's packed routes: ``{"data": base64, "shape": [N, L, K], "dtype": name}``.

SkyRL's ``pack_routed_experts`` / ``decode_packed_routed_experts`` (NovaSky-AI/SkyRL,
``skyrl/backends/skyrl_train/inference_servers/generate_wire.py`` over
``skyrl/backends/skyrl_train/utils/routed_experts.py``): ``data`` is the base64 of the
C-order id bytes (little-endian, native wherever SkyRL runs), ``shape`` three plain ints,
``dtype`` the narrowest of uint8 / int16 / int32 for the ids (``docs/design.md``, "Wire
formats"). The released skyrl 0.3.0 wheel predates the format (it sends nested lists).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Final

import numpy as np

from r3arrow.codec._base64 import as_b64_input, b64_decoded_len, b64encode
from r3arrow.codec._common import (
    DEFAULT_MAX_BYTES,
    WIRE_LE,
    check_rows_for_encode,
    check_shape,
    check_spec_arg,
    decode_rows,
    encode_spec,
    guarded_decode,
    too_large,
)
from r3arrow.errors import PayloadError, RouteDTypeError
from r3arrow.spec import RouteSpec

_PACKED_KEYS: Final[frozenset[str]] = frozenset({"data", "shape", "dtype"})

#: The dtypes SkyRL decodes, narrowest first, with the largest id each holds.
SKYRL_DTYPES: Final[tuple[tuple[str, int], ...]] = (
    ("uint8", 2**8 - 1),
    ("int16", 2**15 - 1),
    ("int32", 2**31 - 1),
)
_NAMES: Final[tuple[str, ...]] = tuple(name for name, _ in SKYRL_DTYPES)


def decode_packed(
    obj: Mapping[str, Any], spec: RouteSpec | None = None, *, max_bytes: int = DEFAULT_MAX_BYTES
) -> np.ndarray:
    """SkyRL's ``{"data": base64, "shape": [N, L, K], "dtype": name}`` as ``[N, L, K]``, a
    writable view: exactly those keys, dtype uint8/int16/int32 (wider than needed is
    accepted), data little-endian. Raises as the package docstring says.
    """
    return guarded_decode(_decode_packed, obj, spec, max_bytes, "packed routes")


def _decode_packed(
    obj: Mapping[str, Any], spec: RouteSpec | None, max_bytes: int, what: str
) -> np.ndarray:
    if not isinstance(obj, Mapping):
        raise PayloadError(
            f"{what}: expected a dict with keys data/shape/dtype, found {type(obj).__name__}"
        )
    if set(obj) != _PACKED_KEYS:
        raise PayloadError(
            f"{what}: expected keys ['data', 'dtype', 'shape'], found {sorted(map(str, obj))}"
        )
    name = obj["dtype"]
    if not isinstance(name, str) or name not in _NAMES:
        raise RouteDTypeError(f"{what}: expected dtype one of {list(_NAMES)}, found {name!r:.100}")
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
    return decode_rows(s, 0, dt, shape, spec, what)


def packed_dtype_for(max_id: int) -> str:
    """The narrowest SkyRL dtype holding ids ``0..max_id`` (uint8, int16 or int32)."""
    for name, cap in SKYRL_DTYPES:
        if max_id <= cap:
            return name
    raise ValueError(f"packed_dtype_for: expected max_id <= {2**31 - 1}, found {max_id}")


def encode_packed(arr: Any, spec: RouteSpec | None = None) -> dict[str, Any]:
    """``[rows, L, K]`` routes (integer numpy, or a torch tensor copied to host) as SkyRL's
    packed dict in the narrowest SkyRL dtype. Ids are checked before narrowing: a negative
    id, one over int32 or (with ``spec``, which also fixes ``L``/``K``) not below
    ``num_experts`` raises `ExpertRangeError`; also `RouteDTypeError`, `RouteShapeError`,
    ``TypeError`` for a bad ``spec``.
    """
    what = "encode_packed"
    check_spec_arg(spec, what)
    if hasattr(arr, "detach") and hasattr(arr, "cpu") and hasattr(arr, "numpy"):  # torch
        arr = arr.detach().cpu().numpy()
    a = check_rows_for_encode(arr, what)
    _, hi = encode_spec(a, spec, what)
    name = packed_dtype_for(max(hi, 0))
    # In range for ``name`` (checked above), so the cast is exact; a no-op for C-order uint8.
    a = np.ascontiguousarray(a, dtype=WIRE_LE[name])
    return {"data": b64encode(a.reshape(-1).view(np.uint8)), "shape": list(a.shape), "dtype": name}
