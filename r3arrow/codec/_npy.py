"""vLLM's ``routed_experts``: base64 of an ``.npy`` file.

No pickle; the header is parsed, and the declared size checked, before the payload is decoded.
"""

from __future__ import annotations

import ast
import contextlib
import io
import math
import re
from typing import Any, Final

import numpy as np

from r3arrow.codec._base64 import (
    B64Payload,
    as_b64_input,
    b64_decoded_len,
    b64_prefix,
    b64decode,
    b64encode,
)
from r3arrow.codec._common import (
    DEFAULT_MAX_BYTES,
    MAX_ROW_IDS,
    WIRE_DTYPES,
    check_rows_for_encode,
    check_shape,
    decode_rows,
    guarded_decode,
    too_large,
    wire_name,
)
from r3arrow.errors import PayloadError, PayloadTooLargeError, RouteDTypeError
from r3arrow.spec import RouteSpec

_NPY_MAGIC: Final[bytes] = b"\x93NUMPY"
_NPY_V1: Final[bytes] = _NPY_MAGIC + b"\x01\x00"
_NPY_MAX_HEADER: Final[int] = 10_000  # numpy's own default bound (np.load max_header_size)
# A plain dtype code only: numpy's parser of comma and sub-array forms raises SyntaxError.
_PLAIN_DESCR: Final[re.Pattern[str]] = re.compile(r"[<>=|]?[A-Za-z][A-Za-z0-9]{0,15}")
# The header ``np.save`` writes for a C-order 3-D array, byte for byte (keys sorted, one space
# after each ``:`` and ``,``, a trailing ``, `` before ``}``, space padding, ``\n``); ints
# without leading zeros, so the match means what `ast.literal_eval` of the text would.
_NPY_HEADER: Final[re.Pattern[bytes]] = re.compile(
    rb"\{'descr': '([<>=|]?[A-Za-z][A-Za-z0-9]{0,15})', 'fortran_order': False, "
    rb"'shape': \((0|[1-9][0-9]{0,17}), (0|[1-9][0-9]{0,17}), (0|[1-9][0-9]{0,17})\), \} *\n"
)
#: Base64 characters decoded for the header on the fast path: 129 bytes, more than the 128 of
#: the header ``np.save`` writes for a 3-D array (a longer one takes the general parser).
_HEAD_CHARS: Final[int] = 172
#: ``descr`` strings already found to name a wire dtype (few: one per engine and dtype).
_WIRE_DESCR: dict[bytes, np.dtype[Any]] = {}


def _parse_npy_header(
    s: str | memoryview, what: str
) -> tuple[int, np.dtype[Any], tuple[int, int, int]]:
    """Read the ``.npy`` header from the head of base64 ``s``: (data offset, dtype, shape).

    `_np_save_header` first (one small decode and a match, for the headers ``np.save`` writes);
    anything else, errors included, takes the general parser `_read_npy_header`.
    """
    fast = _np_save_header(s)
    return _read_npy_header(s, what) if fast is None else fast


def _np_save_header(s: str | memoryview) -> tuple[int, np.dtype[Any], tuple[int, int, int]] | None:
    """`_read_npy_header`'s result for a version 1.0 header as ``np.save`` writes it, of a
    known wire dtype and a row within `check_row_shape`'s bounds; None for anything else (the
    general parser then decides, and words any error)."""
    try:
        head = b64decode(s[:_HEAD_CHARS], "")
    except PayloadError:
        return None
    if len(head) < 10 or not head.startswith(_NPY_V1):
        return None
    offset = 10 + (head[8] | head[9] << 8)  # little-endian uint16 header length
    m = _NPY_HEADER.fullmatch(head, 10, offset) if offset <= len(head) else None
    if m is None:
        return None
    dt = _WIRE_DESCR.get(m[1])
    if dt is None:
        return None
    rows, layers, topk = int(m[2]), int(m[3]), int(m[4])
    if layers < 1 or topk < 1 or layers * topk > MAX_ROW_IDS:
        return None
    return offset, dt, (rows, layers, topk)


def _read_npy_header(
    s: str | memoryview, what: str
) -> tuple[int, np.dtype[Any], tuple[int, int, int]]:
    """The general ``.npy`` header parser (any version 1.0, 2.0 or 3.0 header); raises."""
    head = b64_prefix(s, 12, what)
    if len(head) < 10 or bytes(head[:6]) != _NPY_MAGIC:
        raise PayloadError(
            f"{what}: expected an .npy payload starting with {_NPY_MAGIC!r}, found "
            f"{bytes(head[:8])!r}"
        )
    major, minor = head[6], head[7]
    if (major, minor) == (1, 0):
        hlen, start, enc = int.from_bytes(head[8:10], "little"), 10, "latin1"
    elif (major, minor) in ((2, 0), (3, 0)):
        if len(head) < 12:
            raise PayloadError(f"{what}: truncated .npy header")
        hlen, start = int.from_bytes(head[8:12], "little"), 12
        enc = "utf8" if major == 3 else "latin1"
    else:
        raise PayloadError(
            f"{what}: expected .npy format version 1.0, 2.0 or 3.0, found {major}.{minor}"
        )
    if hlen > _NPY_MAX_HEADER:
        raise PayloadError(
            f"{what}: expected an .npy header of at most {_NPY_MAX_HEADER} bytes, found {hlen}"
        )
    offset = start + hlen
    raw = b64_prefix(s, offset, what)
    if len(raw) < offset:
        raise PayloadError(
            f"{what}: truncated .npy header: expected {offset} bytes, found {len(raw)}"
        )
    try:
        # literal_eval parses literals only (no code execution); the size bound keeps it cheap.
        header = ast.literal_eval(bytes(raw[start:offset]).decode(enc))
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError) as exc:
        raise PayloadError(f"{what}: unreadable .npy header: {exc}") from exc
    if not isinstance(header, dict) or set(header) != {"descr", "fortran_order", "shape"}:
        keys = sorted(map(str, header)) if isinstance(header, dict) else type(header).__name__
        raise PayloadError(
            f"{what}: expected .npy header keys ['descr', 'fortran_order', 'shape'], found {keys}"
        )
    if header["fortran_order"] is not False:
        raise PayloadError(
            f"{what}: expected fortran_order False (C order), found {header['fortran_order']!r}"
        )
    descr = header["descr"]
    dt = None
    if isinstance(descr, str) and _PLAIN_DESCR.fullmatch(descr):
        with contextlib.suppress(TypeError, ValueError, SyntaxError):
            dt = np.dtype(descr)
    if dt is None:
        raise RouteDTypeError(
            f"{what}: expected dtype one of {list(WIRE_DTYPES)} as a plain integer dtype code, "
            f"found {descr!r:.100}"
        )
    wire_name(dt, what)
    shape = check_shape(header["shape"], what)
    if len(_WIRE_DESCR) < 64:  # a valid wire dtype: the fast path may take it from now on
        _WIRE_DESCR[descr.encode("latin1")] = dt
    return offset, dt, shape


def decode_vllm(
    b64_npy: B64Payload, spec: RouteSpec | None = None, *, max_bytes: int = DEFAULT_MAX_BYTES
) -> np.ndarray:
    """vLLM's ``routed_experts`` (base64 of an ``.npy`` file) as ``[rows, L, K]``: a writable
    view in uint8/uint16/int16/int32 (big-endian byteswapped into a new array); no pickle,
    object dtypes or Fortran order. Raises as the package docstring says.
    """
    return guarded_decode(_decode_vllm, b64_npy, spec, max_bytes, "vLLM routed_experts")


def _decode_vllm(
    b64_npy: B64Payload, spec: RouteSpec | None, max_bytes: int, what: str
) -> np.ndarray:
    s = as_b64_input(b64_npy, what)
    found = b64_decoded_len(s, what)
    if found > max_bytes + _NPY_MAX_HEADER + 12:
        raise PayloadTooLargeError(
            f"{what}: payload of {found:,} bytes exceeds max_bytes={max_bytes:,}"
        )
    offset, dt, shape = _parse_npy_header(s, what)
    declared = math.prod(shape) * dt.itemsize
    if declared > max_bytes:
        raise too_large(what, declared, max_bytes, f".npy header (shape {list(shape)}, dtype {dt})")
    if offset + declared != found:
        raise PayloadError(
            f"{what}: .npy header (shape {list(shape)}, dtype {dt}) expects "
            f"{offset + declared:,} bytes ({offset} header + {declared:,} data), found {found:,}"
        )
    return decode_rows(s, offset, dt, shape, spec, what)


def encode_vllm(arr: Any) -> str:
    """Encode ``[rows, L, K]`` routes as vLLM does: base64 of ``np.save`` output (no pickle)."""
    a = check_rows_for_encode(arr, "encode_vllm")
    wire_name(a.dtype, "encode_vllm")
    bio = io.BytesIO()
    np.lib.format.write_array(bio, np.ascontiguousarray(a), allow_pickle=False)
    return b64encode(bio.getbuffer())
