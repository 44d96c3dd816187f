"""SkyRL's packed routes: ``{"data": base64, "shape": [N, L, K], "dtype": name}``.

The format is SkyRL's ``pack_routed_experts`` / ``decode_packed_routed_experts``
(NovaSky-AI/SkyRL, ``skyrl/backends/skyrl_train/inference_servers/generate_wire.py``), over
``compact_routed_expert_indices`` and ``ROUTED_EXPERT_DTYPES`` in
``skyrl/backends/skyrl_train/utils/routed_experts.py``:

* ``data`` is the base64 of the C-order id bytes in numpy's native order (SkyRL reads them
  with ``np.frombuffer(data, dtype)``); r3arrow writes and reads little-endian, which is
  native on every platform SkyRL runs on.
* ``dtype`` is one of ``uint8`` / ``int16`` / ``int32``, and it must be the *narrowest*
  for the ids: ``uint8`` if the largest id is below 2**8, ``int16`` below 2**15, else
  ``int32``. SkyRL's decoder rejects any other name (``uint16`` included) and any wider
  ("non-canonical") dtype than the ids need, so `encode_packed` emits exactly that one.
* ``shape`` is a list of three plain ints.

`decode_packed` accepts the same three dtype names, and is more lenient than SkyRL only in
accepting a wider one than the ids need.
The released skyrl 0.3.0 wheel predates the format (it sends nested lists); its
``skyrl/train/dataset/preprocess.py`` already downcast to the same three dtypes.
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
    guarded_decode,
    too_large,
)
from r3arrow.errors import PayloadError, RouteDTypeError, RouteShapeError
from r3arrow.ids import check_routes
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
    """Decode SkyRL's ``{"data": base64, "shape": [N, L, K], "dtype": name}`` to ``[N, L, K]``.

    ``dtype`` is one of uint8/int16/int32 (what SkyRL and `encode_packed` write), data
    little-endian; the keys must be exactly these three. The
    result keeps the payload dtype and is a writable view on the decoded buffer.

    Raises only `R3ArrowError` subclasses for any ``obj``: `PayloadError` (not a dict, keys,
    shape entries, base64, byte count), `PayloadTooLargeError`, `RouteDTypeError`,
    `RouteShapeError` (rank, ``L``/``K`` < 1 or ``L * K`` over ``MAX_ROW_IDS``, spec
    mismatch), `ExpertRangeError`. ``TypeError``/``ValueError`` only for bad ``spec`` /
    ``max_bytes`` arguments. The data bytes carry no checksum: a corrupted id that stays
    in range decodes as that id.
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


def _host_array(arr: Any) -> Any:
    """A torch tensor (CPU or CUDA; duck-typed, the core never imports torch) as numpy."""
    if hasattr(arr, "detach") and hasattr(arr, "cpu") and hasattr(arr, "numpy"):
        return arr.detach().cpu().numpy()
    return arr


def packed_dtype_for(max_id: int) -> str:
    """The narrowest SkyRL dtype holding ids ``0..max_id`` (uint8, int16 or int32)."""
    for name, cap in SKYRL_DTYPES:
        if max_id <= cap:
            return name
    raise ValueError(f"packed_dtype_for: expected max_id <= {2**31 - 1}, found {max_id}")


def encode_packed(arr: Any, spec: RouteSpec | None = None) -> dict[str, Any]:
    """Encode ``[rows, L, K]`` routes as SkyRL's packed dict, in the narrowest SkyRL dtype.

    ``arr`` is any integer numpy array (int64 included) or a torch tensor (CPU or CUDA,
    copied to host). The wire dtype is chosen from the largest id: ``uint8`` if it is below
    256, ``int16`` below 32768, else ``int32`` (SkyRL's rule; SkyRL's decoder refuses any
    other dtype, ``uint16`` included). Ids are checked by :mod:`r3arrow.ids` before anything
    is narrowed, so nothing wraps: a negative id or one over int32 raises `ExpertRangeError`,
    as does, with ``spec``, a router-layer id not below ``spec.num_experts`` (``spec`` also
    fixes ``L``/``K``: `RouteShapeError`). A non-integer dtype raises `RouteDTypeError`, a
    rank other than 3 `RouteShapeError`. ``spec`` of another type is a ``TypeError``.
    """
    what = "encode_packed"
    check_spec_arg(spec, what)
    a = check_rows_for_encode(_host_array(arr), what)
    if spec is None:
        spec = RouteSpec(a.shape[1], a.shape[2], None)
    elif a.shape[1:] != spec.row_shape:
        raise RouteShapeError(
            f"{what}: expected [rows, {spec.num_layers}, {spec.topk}], found {list(a.shape)}"
        )
    _, hi = check_routes(a, spec, what=what, rules="range")
    name = packed_dtype_for(max(hi, 0))
    # In range for ``name`` (checked above), so the cast is exact; a no-op for C-order uint8.
    a = np.ascontiguousarray(a, dtype=WIRE_LE[name])
    return {"data": b64encode(a.reshape(-1).view(np.uint8)), "shape": list(a.shape), "dtype": name}
