"""Shared by every wire codec: size caps, wire dtypes, shape checks and the spec check.

``docs/design.md``, "Wire formats". Range checks go through :mod:`r3arrow.ids`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Final

import numpy as np

from r3arrow._checks import check_nonnegative_int
from r3arrow.codec._base64 import b64decode
from r3arrow.errors import (
    PayloadError,
    PayloadTooLargeError,
    R3ArrowError,
    RouteDTypeError,
    RouteShapeError,
)
from r3arrow.ids import check_routes
from r3arrow.spec import RouteSpec

#: Default bound on a decoded payload (and on the array a header declares), in bytes.
DEFAULT_MAX_BYTES: Final[int] = 8 << 30

#: Payload dtypes the base64 codecs accept, by name (values are little-endian on the wire).
WIRE_DTYPES: Final[tuple[str, ...]] = ("uint8", "uint16", "int16", "int32")
WIRE_LE: Final[dict[str, np.dtype[Any]]] = {n: np.dtype(n).newbyteorder("<") for n in WIRE_DTYPES}

#: Most ids one route row ``[L, K]`` may declare: a header with zero rows holds no data, so
#: no byte cap stops its ``L`` and ``K`` from reaching numpy's shape limits.
MAX_ROW_IDS: Final[int] = 1 << 24


def check_spec_arg(spec: object, what: str) -> None:
    """``spec`` must be a `RouteSpec` or None (argument misuse raises ``TypeError``)."""
    if spec is not None and not isinstance(spec, RouteSpec):
        raise TypeError(f"{what}: expected spec a RouteSpec or None, found {type(spec).__name__}")


@contextmanager
def payload_boundary(what: str) -> Iterator[None]:
    """Nothing but an `R3ArrowError` leaves a decoder: a library exception no check foresaw
    becomes a `PayloadError` (`PayloadTooLargeError` for ``MemoryError``), its cause kept."""
    try:
        yield
    except R3ArrowError:
        raise
    except Exception as exc:
        raise _boundary_error(what, exc) from exc


def _boundary_error(what: str, exc: Exception) -> PayloadError:
    """What `payload_boundary` raises for ``exc``, an exception no check foresaw."""
    if isinstance(exc, MemoryError):
        return PayloadTooLargeError(f"{what}: decoding ran out of memory: {exc}")
    return PayloadError(
        f"{what}: expected a well-formed payload, found one that fails to decode "
        f"({type(exc).__name__}: {exc})"
    )


def guarded_decode(
    decode: Callable[[Any, RouteSpec | None, int, str], np.ndarray],
    payload: Any,
    spec: RouteSpec | None,
    max_bytes: Any,
    what: str,
) -> np.ndarray:
    """``decode(payload, spec, max_bytes, what)`` inside `payload_boundary`, after the
    argument checks (`check_max_bytes`, `check_spec_arg`), which raise builtins."""
    if type(max_bytes) is not int or max_bytes < 0:  # the common case skips the call
        max_bytes = check_max_bytes(max_bytes)
    if spec is not None:
        check_spec_arg(spec, what)
    try:  # `payload_boundary`, inline: a context manager costs more than a small decode
        return decode(payload, spec, max_bytes, what)
    except R3ArrowError:
        raise
    except Exception as exc:
        raise _boundary_error(what, exc) from exc


def check_max_bytes(max_bytes: Any) -> int:
    return check_nonnegative_int(max_bytes, "max_bytes")


def too_large(what: str, declared: int, max_bytes: int, detail: str) -> PayloadTooLargeError:
    return PayloadTooLargeError(
        f"{what}: {detail} declares {declared:,} bytes, more than max_bytes={max_bytes:,}"
    )


def check_shape(shape: object, what: str) -> tuple[int, int, int]:
    if not isinstance(shape, list | tuple):
        raise PayloadError(f"{what}: expected shape as a list of 3 ints, found {shape!r:.100}")
    if not all(
        isinstance(d, int | np.integer) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise PayloadError(
            f"{what}: expected non-negative int shape entries, found {list(shape)!r:.200}"
        )
    if len(shape) != 3:
        raise RouteShapeError(f"{what}: expected a 3-D shape [rows, L, K], found {list(shape)}")
    rows, layers, topk = (int(d) for d in shape)
    check_row_shape(layers, topk, what)
    return rows, layers, topk


def check_row_shape(layers: int, topk: int, what: str) -> None:
    """A row ``[L, K]`` needs ``L, K >= 1`` and ``L * K <= MAX_ROW_IDS`` (`RouteShapeError`)."""
    if layers < 1 or topk < 1:
        raise RouteShapeError(
            f"{what}: expected L >= 1 and K >= 1 in [rows, L, K], found L={layers}, K={topk}"
        )
    if layers * topk > MAX_ROW_IDS:
        raise RouteShapeError(
            f"{what}: expected at most {MAX_ROW_IDS:,} ids per row (L * K), found "
            f"L={layers:,} x K={topk:,}"
        )


def check_spec_shape(shape: tuple[int, ...], spec: RouteSpec, what: str) -> None:
    """`RouteShapeError` unless ``shape`` is ``[rows, L, K]`` of ``spec``."""
    if shape[1:] != spec.row_shape:
        raise RouteShapeError(
            f"{what}: expected [rows, {spec.num_layers}, {spec.topk}], found {list(shape)}"
        )


def check_rows_for_encode(arr: Any, what: str) -> np.ndarray:
    a = np.asarray(arr)
    if a.dtype.kind not in "iu":
        raise RouteDTypeError(f"{what}: expected an integer array, found dtype {a.dtype}")
    if a.ndim != 3 or a.shape[1] < 1 or a.shape[2] < 1:
        raise RouteShapeError(
            f"{what}: expected shape [rows, L, K] with L, K >= 1, found {list(a.shape)}"
        )
    return a


def encode_spec(arr: np.ndarray, spec: RouteSpec | None, what: str) -> tuple[RouteSpec, int]:
    """(the spec ``arr``'s ids were range-checked against, the largest id or -1); without
    ``spec``: ids ``>= 0`` that fit int32.
    """
    if spec is None:
        spec = RouteSpec(arr.shape[1], arr.shape[2], None)
    else:
        check_spec_shape(arr.shape, spec, what)
    return spec, check_routes(arr, spec, what=what, rules="range")[1]


def wire_name(dt: np.dtype[Any], what: str) -> str:
    name = dt.newbyteorder("=").name if dt.byteorder in "<>" else dt.name
    if dt.fields is not None or dt.subdtype is not None or name not in WIRE_DTYPES:
        raise RouteDTypeError(f"{what}: expected dtype one of {list(WIRE_DTYPES)}, found {dt}")
    return name


def decode_rows(
    s: str | memoryview,
    offset: int,
    dt: np.dtype[Any],
    shape: tuple[int, int, int],
    spec: RouteSpec | None,
    what: str,
) -> np.ndarray:
    """Base64 ``s`` as ``[rows, L, K]`` rows from ``offset``, checked against ``spec``."""
    arr = view_rows(b64decode(s, what), offset, dt, shape)
    if spec is not None:
        check_spec_shape(arr.shape, spec, what)
        check_routes(arr, spec, what=what, rules="range")
    return arr


def view_rows(
    buf: bytearray, offset: int, dt: np.dtype[Any], shape: tuple[int, int, int]
) -> np.ndarray:
    """``[rows, L, K]`` view on ``buf[offset:]``, native byte order (byteswapped copy if not)."""
    count = shape[0] * shape[1] * shape[2]
    arr = np.frombuffer(buf, dtype=dt, count=count, offset=offset).reshape(shape)
    if not dt.isnative:
        arr = arr.astype(dt.newbyteorder("="))
    return arr
