"""Strict, bounded base64: decoded sizes from the length alone, SIMD ``pybase64`` when present."""

from __future__ import annotations

import base64 as _stdlib_base64
import binascii
from typing import Any, Final

from r3arrow.errors import PayloadError

_pybase64: Any
try:  # SIMD base64 (~10x stdlib); the stdlib fallback is correct but slow.
    import pybase64 as _pybase64
except ImportError:  # pragma: no cover - pybase64 is a core dependency
    _pybase64 = None
#: Whether the SIMD ``pybase64`` backend is in use.
HAVE_PYBASE64: Final[bool] = _pybase64 is not None

B64Payload = str | bytes | bytearray | memoryview


def as_b64_input(s: object, what: str) -> str | memoryview:
    if isinstance(s, str):
        return s
    if isinstance(s, bytes | bytearray | memoryview):
        mv = memoryview(s)
        if not mv.c_contiguous:
            raise PayloadError(f"{what}: expected a contiguous bytes-like base64 payload")
        return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
    raise PayloadError(f"{what}: expected a base64 str or bytes, found {type(s).__name__}")


def b64_decoded_len(s: str | memoryview, what: str) -> int:
    """Exact decoded length of padded base64 ``s`` from its length alone (no decoding)."""
    n = len(s)
    if n % 4:
        raise PayloadError(
            f"{what}: invalid base64: expected a length that is a multiple of 4, found {n}"
        )
    if n == 0:
        return 0
    tail = s[-2:]
    pad = tail.count("=") if isinstance(tail, str) else bytes(tail).count(b"=")
    return n // 4 * 3 - pad


def b64decode(s: str | memoryview, what: str) -> bytearray:
    """Strictly decode base64 (alphabet and padding validated) into a fresh, writable bytearray."""
    try:
        if _pybase64 is not None:
            out: bytearray = _pybase64.b64decode_as_bytearray(s, validate=True)
            return out
        return bytearray(_stdlib_base64.b64decode(s, validate=True))
    except (binascii.Error, ValueError, TypeError) as exc:
        raise PayloadError(f"{what}: invalid base64: {exc}") from exc


def b64encode(data: Any) -> str:
    if _pybase64 is not None:
        out: str = _pybase64.b64encode_as_string(data)
        return out
    return _stdlib_base64.b64encode(data).decode("ascii")


def b64_prefix(s: str | memoryview, nbytes: int, what: str) -> bytearray:
    """Decode just enough leading base64 characters to cover ``nbytes`` bytes (fewer if short)."""
    nchars = min(len(s), -(-nbytes // 3) * 4)
    return b64decode(s[:nchars], what)
