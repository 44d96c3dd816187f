"""Wire codecs for routed-expert payloads: vLLM ``.npy``, SkyRL packed, SGLang raw int32, Arrow IPC.

Every decoder validates before it allocates: the size an encoded payload decodes to is
computed from the base64 length, a header's declared array size is checked against
``max_bytes`` and against that byte count, and only then is the payload decoded, once,
into its final buffer. Decoded arrays are ``[rows, L, K]`` views on that buffer (writable,
no second copy); Arrow IPC decoding is zero-copy on the input buffer (read-only views).
With a `RouteSpec`, ``L``/``K`` must match and router-layer ids must lie in
``[0, num_experts)``; without one only the structure is checked.

Errors: `PayloadError` (bad base64, header, keys, byte count, IPC stream),
`PayloadTooLargeError` (over ``max_bytes``), `RouteDTypeError`, `RouteShapeError`,
`ExpertRangeError` / `SchemaError` (from the spec checks).
"""

from __future__ import annotations

import ast
import base64 as _stdlib_base64
import binascii
import io
import math
from collections.abc import Mapping
from typing import Any, Final

import numpy as np
import pyarrow as pa

from r3arrow.errors import (
    ExpertRangeError,
    PayloadError,
    PayloadTooLargeError,
    R3ArrowError,
    RouteDTypeError,
    RouteShapeError,
    SchemaError,
)
from r3arrow.spec import (
    SPEC_METADATA_KEY,
    RouteSpec,
    check_route_ids,
    numpy_to_routes,
    routes_to_numpy,
    storage_dtype_for,
)

_pybase64: Any
try:  # SIMD base64 (~10x stdlib); the stdlib fallback is correct but slow.
    import pybase64 as _pybase64
except ImportError:  # pragma: no cover - pybase64 is a core dependency
    _pybase64 = None
#: Whether the SIMD ``pybase64`` backend is in use.
HAVE_PYBASE64: Final[bool] = _pybase64 is not None

#: Default bound on a decoded payload (and on the array a header declares), in bytes.
DEFAULT_MAX_BYTES: Final[int] = 8 << 30

#: Schema metadata key holding the row count `encode_ipc` wrote; a stream cut at a
#: message boundary reads as a valid shorter stream, this makes it detectable.
IPC_ROWS_METADATA_KEY: Final[bytes] = b"r3arrow.num_rows"

#: Payload dtypes the base64 codecs accept, by name (values are little-endian on the wire).
WIRE_DTYPES: Final[tuple[str, ...]] = ("uint8", "uint16", "int16", "int32")
_WIRE_LE: Final[dict[str, np.dtype[Any]]] = {n: np.dtype(n).newbyteorder("<") for n in WIRE_DTYPES}

_NPY_MAGIC: Final[bytes] = b"\x93NUMPY"
_NPY_MAX_HEADER: Final[int] = 10_000  # numpy's own default bound (np.load max_header_size)

B64Payload = str | bytes | bytearray | memoryview


# --------------------------------------------------------------------- base64 helpers
def _check_max_bytes(max_bytes: int) -> int:
    if not isinstance(max_bytes, int | np.integer) or isinstance(max_bytes, bool) or max_bytes < 0:
        raise ValueError(f"max_bytes: expected a non-negative int, found {max_bytes!r}")
    return int(max_bytes)


def _as_b64_input(s: object, what: str) -> str | memoryview:
    if isinstance(s, str):
        return s
    if isinstance(s, bytes | bytearray | memoryview):
        mv = memoryview(s)
        if not mv.c_contiguous:
            raise PayloadError(f"{what}: expected a contiguous bytes-like base64 payload")
        return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
    raise PayloadError(f"{what}: expected a base64 str or bytes, found {type(s).__name__}")


def _b64_decoded_len(s: str | memoryview, what: str) -> int:
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


def _b64decode(s: str | memoryview, what: str) -> bytearray:
    """Strictly decode base64 (alphabet and padding validated) into a fresh, writable bytearray."""
    try:
        if _pybase64 is not None:
            out: bytearray = _pybase64.b64decode_as_bytearray(s, validate=True)
            return out
        return bytearray(_stdlib_base64.b64decode(s, validate=True))
    except (binascii.Error, ValueError, TypeError) as exc:
        raise PayloadError(f"{what}: invalid base64: {exc}") from None


def _b64encode(data: Any) -> str:
    if _pybase64 is not None:
        out: str = _pybase64.b64encode_as_string(data)
        return out
    return _stdlib_base64.b64encode(data).decode("ascii")


def _b64_prefix(s: str | memoryview, nbytes: int, what: str) -> bytearray:
    """Decode just enough leading base64 characters to cover ``nbytes`` bytes (fewer if short)."""
    nchars = min(len(s), -(-nbytes // 3) * 4)
    return _b64decode(s[:nchars], what)


def _too_large(what: str, declared: int, max_bytes: int, detail: str) -> PayloadTooLargeError:
    return PayloadTooLargeError(
        f"{what}: {detail} declares {declared:,} bytes, more than max_bytes={max_bytes:,}"
    )


# --------------------------------------------------------------------- validation helpers
def _check_shape(shape: object, what: str) -> tuple[int, int, int]:
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
    if layers < 1 or topk < 1:
        raise RouteShapeError(
            f"{what}: expected L >= 1 and K >= 1 in [rows, L, K], found {list(shape)}"
        )
    return rows, layers, topk


def _check_against_spec(arr: np.ndarray, spec: RouteSpec | None, what: str) -> np.ndarray:
    if spec is None:
        return arr
    if arr.shape[1:] != spec.row_shape:
        raise RouteShapeError(
            f"{what}: expected [rows, {spec.num_layers}, {spec.topk}], found {list(arr.shape)}"
        )
    check_route_ids(arr, spec, what=what)
    return arr


def _check_rows_for_encode(arr: Any, what: str) -> np.ndarray:
    a = np.asarray(arr)
    if a.dtype.kind not in "iu":
        raise RouteDTypeError(f"{what}: expected an integer array, found dtype {a.dtype}")
    if a.ndim != 3 or a.shape[1] < 1 or a.shape[2] < 1:
        raise RouteShapeError(
            f"{what}: expected shape [rows, L, K] with L, K >= 1, found {list(a.shape)}"
        )
    return a


def _wire_name(dt: np.dtype[Any], what: str) -> str:
    name = dt.newbyteorder("=").name if dt.byteorder in "<>" else dt.name
    if dt.fields is not None or dt.subdtype is not None or name not in WIRE_DTYPES:
        raise RouteDTypeError(f"{what}: expected dtype one of {list(WIRE_DTYPES)}, found {dt}")
    return name


def _view(
    buf: bytearray, offset: int, dt: np.dtype[Any], shape: tuple[int, int, int]
) -> np.ndarray:
    """``[rows, L, K]`` view on ``buf[offset:]`` in native byte order (byteswapped copy if not native)."""
    count = shape[0] * shape[1] * shape[2]
    arr = np.frombuffer(buf, dtype=dt, count=count, offset=offset).reshape(shape)
    if not dt.isnative:
        arr = arr.astype(dt.newbyteorder("="))
    return arr


# --------------------------------------------------------------------- vLLM (.npy)
def _parse_npy_header(
    s: str | memoryview, what: str
) -> tuple[int, np.dtype[Any], tuple[int, int, int]]:
    """Read the ``.npy`` header from the head of base64 ``s``: (data offset, dtype, shape)."""
    head = _b64_prefix(s, 12, what)
    if len(head) < 10 or bytes(head[:6]) != _NPY_MAGIC:
        raise PayloadError(
            f"{what}: expected an .npy payload starting with {_NPY_MAGIC!r}, found {bytes(head[:8])!r}"
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
    raw = _b64_prefix(s, offset, what)
    if len(raw) < offset:
        raise PayloadError(
            f"{what}: truncated .npy header: expected {offset} bytes, found {len(raw)}"
        )
    try:
        # literal_eval parses literals only (no code execution); the size bound keeps it cheap.
        header = ast.literal_eval(bytes(raw[start:offset]).decode(enc))
    except (
        ValueError,
        SyntaxError,
        TypeError,
        MemoryError,
        RecursionError,
        UnicodeDecodeError,
    ) as exc:
        raise PayloadError(f"{what}: unreadable .npy header: {exc}") from None
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
    if not isinstance(descr, str):
        raise RouteDTypeError(
            f"{what}: expected a plain integer dtype one of {list(WIRE_DTYPES)}, found {descr!r:.100}"
        )
    try:
        dt = np.dtype(descr)
    except (TypeError, ValueError) as exc:
        raise RouteDTypeError(
            f"{what}: expected dtype one of {list(WIRE_DTYPES)}, found {descr!r:.100} ({exc})"
        ) from None
    _wire_name(dt, what)
    return offset, dt, _check_shape(header["shape"], what)


def decode_vllm(
    b64_npy: B64Payload, spec: RouteSpec | None = None, *, max_bytes: int = DEFAULT_MAX_BYTES
) -> np.ndarray:
    """Decode vLLM's ``routed_experts`` (base64 of an ``.npy`` file) to ``[rows, L, K]``.

    Accepts uint8/uint16/int16/int32 in either byte order (big-endian is byteswapped into a
    new array); the result keeps the payload's dtype and is a writable view on the decoded
    buffer. No pickle, no object/structured dtypes, no Fortran order.
    """
    what = "vLLM routed_experts"
    max_bytes = _check_max_bytes(max_bytes)
    s = _as_b64_input(b64_npy, what)
    found = _b64_decoded_len(s, what)
    if found > max_bytes + _NPY_MAX_HEADER + 12:
        raise PayloadTooLargeError(
            f"{what}: payload of {found:,} bytes exceeds max_bytes={max_bytes:,}"
        )
    offset, dt, shape = _parse_npy_header(s, what)
    declared = math.prod(shape) * dt.itemsize
    if declared > max_bytes:
        raise _too_large(
            what, declared, max_bytes, f".npy header (shape {list(shape)}, dtype {dt})"
        )
    if offset + declared != found:
        raise PayloadError(
            f"{what}: .npy header (shape {list(shape)}, dtype {dt}) expects {offset + declared:,} bytes "
            f"({offset} header + {declared:,} data), found {found:,}"
        )
    buf = _b64decode(s, what)
    return _check_against_spec(_view(buf, offset, dt, shape), spec, what)


def encode_vllm(arr: Any) -> str:
    """Encode ``[rows, L, K]`` routes as vLLM does: base64 of ``np.save`` output (no pickle)."""
    a = _check_rows_for_encode(arr, "encode_vllm")
    _wire_name(a.dtype, "encode_vllm")
    bio = io.BytesIO()
    np.lib.format.write_array(bio, np.ascontiguousarray(a), allow_pickle=False)
    return _b64encode(bio.getbuffer())


# --------------------------------------------------------------------- SkyRL packed
_PACKED_KEYS: Final[frozenset[str]] = frozenset({"data", "shape", "dtype"})


def decode_packed(
    obj: Mapping[str, Any], spec: RouteSpec | None = None, *, max_bytes: int = DEFAULT_MAX_BYTES
) -> np.ndarray:
    """Decode SkyRL's ``{"data": base64, "shape": [N, L, K], "dtype": name}`` to ``[N, L, K]``.

    ``dtype`` is one of uint8/uint16/int16/int32, data little-endian; the keys must be exactly
    these three. The result keeps the payload dtype and is a writable view on the decoded buffer.
    """
    what = "packed routes"
    max_bytes = _check_max_bytes(max_bytes)
    if not isinstance(obj, Mapping):
        raise PayloadError(
            f"{what}: expected a dict with keys data/shape/dtype, found {type(obj).__name__}"
        )
    if set(obj) != _PACKED_KEYS:
        raise PayloadError(
            f"{what}: expected keys ['data', 'dtype', 'shape'], found {sorted(map(str, obj))}"
        )
    name = obj["dtype"]
    if not isinstance(name, str) or name not in _WIRE_LE:
        raise RouteDTypeError(
            f"{what}: expected dtype one of {list(WIRE_DTYPES)}, found {name!r:.100}"
        )
    dt = _WIRE_LE[name]
    shape = _check_shape(obj["shape"], what)
    s = _as_b64_input(obj["data"], what)
    declared = math.prod(shape) * dt.itemsize
    if declared > max_bytes:
        raise _too_large(what, declared, max_bytes, f"shape {list(shape)} of {name}")
    found = _b64_decoded_len(s, what)
    if found != declared:
        raise PayloadError(
            f"{what}: shape {list(shape)} of {name} expects {declared:,} bytes, found {found:,}"
        )
    buf = _b64decode(s, what)
    return _check_against_spec(_view(buf, 0, dt, shape), spec, what)


def encode_packed(arr: Any) -> dict[str, Any]:
    """Encode ``[rows, L, K]`` routes (uint8/uint16/int16/int32) as SkyRL's packed dict."""
    a = _check_rows_for_encode(arr, "encode_packed")
    name = _wire_name(a.dtype, "encode_packed")
    a = np.ascontiguousarray(a, dtype=_WIRE_LE[name])
    return {"data": _b64encode(a.reshape(-1).view(np.uint8)), "shape": list(a.shape), "dtype": name}


# --------------------------------------------------------------------- SGLang raw int32
_SGLANG_DTYPE: Final[np.dtype[Any]] = np.dtype("<i4")


def decode_sglang(
    b64: B64Payload, spec: RouteSpec, *, max_bytes: int = DEFAULT_MAX_BYTES
) -> np.ndarray:
    """Decode SGLang's ``meta_info["routed_experts"]`` (base64 of raw little-endian int32) to
    ``[rows, spec.num_layers, spec.topk]`` int32, a writable view on the decoded buffer."""
    what = "SGLang routed_experts"
    max_bytes = _check_max_bytes(max_bytes)
    if not isinstance(spec, RouteSpec):
        raise TypeError(
            f"decode_sglang: expected a RouteSpec (the payload has no shape), found {type(spec).__name__}"
        )
    s = _as_b64_input(b64, what)
    found = _b64_decoded_len(s, what)
    if found > max_bytes:
        raise PayloadTooLargeError(
            f"{what}: payload of {found:,} bytes exceeds max_bytes={max_bytes:,}"
        )
    row = spec.num_layers * spec.topk * _SGLANG_DTYPE.itemsize
    if found % row:
        raise PayloadError(
            f"{what}: expected a multiple of {row} bytes (int32 rows of [{spec.num_layers}, {spec.topk}]), "
            f"found {found:,} bytes ({found / row:.3f} rows)"
        )
    buf = _b64decode(s, what)
    arr = _view(buf, 0, _SGLANG_DTYPE, (found // row, spec.num_layers, spec.topk))
    return _check_against_spec(arr, spec, what)


def encode_sglang(arr: Any) -> str:
    """Encode ``[rows, L, K]`` integer routes as SGLang does: base64 of raw little-endian int32."""
    a = _check_rows_for_encode(arr, "encode_sglang")
    if a.dtype.itemsize > 4 or a.dtype == np.uint32:
        info = np.iinfo(np.int32)
        if a.size and (a.min() < info.min or a.max() > info.max):
            raise RouteDTypeError(
                f"encode_sglang: expected ids that fit int32, found range [{a.min()}, {a.max()}]"
            )
    a = np.ascontiguousarray(a, dtype=_SGLANG_DTYPE)
    return _b64encode(a.reshape(-1).view(np.uint8))


# --------------------------------------------------------------------- Arrow IPC
def _as_arrow_buffer(buf: object) -> Any:
    if isinstance(buf, pa.Buffer):
        return buf
    if isinstance(buf, bytes | bytearray | memoryview):
        return pa.py_buffer(buf)
    raise PayloadError(f"Arrow IPC: expected bytes or a pyarrow.Buffer, found {type(buf).__name__}")


def _prepare_routes(routes: Any, spec: RouteSpec | None) -> tuple[np.ndarray, RouteSpec]:
    if isinstance(routes, pa.Array | pa.ChunkedArray):
        arr = routes_to_numpy(routes, spec)
    else:
        arr = _check_rows_for_encode(routes, "encode_ipc")
    if spec is None:
        lo = int(arr.min()) if arr.size else 0
        if lo < 0:
            raise ExpertRangeError(f"encode_ipc: expected expert ids >= 0, found {lo}")
        keep = arr.dtype.name in ("uint8", "uint16", "int32")
        dt = arr.dtype if keep else storage_dtype_for(int(arr.max()) + 1 if arr.size else 1)
        spec = RouteSpec(arr.shape[1], arr.shape[2], None, id_dtype=dt.name)
    else:
        if arr.shape[1:] != spec.row_shape:
            raise RouteShapeError(
                f"encode_ipc: expected [rows, {spec.num_layers}, {spec.topk}], found {list(arr.shape)}"
            )
        _, hi = check_route_ids(arr, spec, what="encode_ipc")
        spec = spec.widened_for(hi)
    target = spec.dtype.newbyteorder("=")  # check_route_ids ensured every layer fits it
    return np.ascontiguousarray(arr, dtype=target), spec


def encode_ipc(routes: Any, spec: RouteSpec | None = None) -> Any:
    """Serialise routes as an Arrow IPC stream; returns a ``pyarrow.Buffer`` (``bytes(buf)`` copies).

    ``routes`` is ``[rows, L, K]`` numpy or a per-token Arrow routes array: the stream then has one
    column ``"routes"`` of ``spec.arrow_type`` (ids checked against ``spec``; without a spec it is
    inferred). A ``pa.Table``/``RecordBatch`` is written as is. The spec (when known) and the row
    count travel in the schema metadata.
    """
    if isinstance(routes, pa.RecordBatch):
        routes = pa.Table.from_batches([routes])
    if isinstance(routes, pa.Table):
        table = routes
        meta = dict(table.schema.metadata or {})
        if spec is not None:
            sent = _schema_spec(table.schema)
            if sent is not None and not sent.same_shape(spec):
                raise RouteShapeError(
                    f"encode_ipc: table metadata spec {sent.to_json().decode()} does not match {spec}"
                )
            meta.update(spec.to_metadata())
    else:
        arr, spec = _prepare_routes(routes, spec)
        table = pa.table({"routes": numpy_to_routes(arr, spec)})
        meta = spec.to_metadata()
    meta[IPC_ROWS_METADATA_KEY] = str(table.num_rows).encode()
    table = table.replace_schema_metadata(meta)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue()


class _FlatTable:
    """Bounds-checked reader of one flatbuffer table (just what `_declared_ipc_bytes` needs)."""

    def __init__(self, buf: bytes, pos: int) -> None:
        self.buf, self.pos = buf, pos
        vt = pos - self._int(pos, 4, signed=True)
        self.vt, self.vt_size = vt, self._int(vt, 2)

    def _int(self, at: int, size: int, *, signed: bool = False) -> int:
        if at < 0 or at + size > len(self.buf):
            raise PayloadError("Arrow IPC: corrupted message metadata (offset out of bounds)")
        return int.from_bytes(self.buf[at : at + size], "little", signed=signed)

    def field(self, i: int) -> int:
        """Absolute position of field ``i`` (0 when absent)."""
        slot = 4 + 2 * i
        off = self._int(self.vt + slot, 2) if slot + 2 <= self.vt_size else 0
        return self.pos + off if off else 0

    def scalar(self, i: int, size: int, default: int = 0) -> int:
        at = self.field(i)
        return self._int(at, size, signed=True) if at else default

    def ref(self, i: int) -> int:
        """Target position of offset-typed field ``i`` (table, vector, union); 0 when absent."""
        at = self.field(i)
        return at + self._int(at, 4) if at else 0

    def table(self, i: int) -> _FlatTable | None:
        at = self.ref(i)
        return _FlatTable(self.buf, at) if at else None


_MSG_DICTIONARY_BATCH, _MSG_RECORD_BATCH = 2, 3


def _declared_ipc_bytes(b: Any) -> int:
    """Sum of the buffer sizes the stream's record batches declare once decompressed, read from
    the message metadata before any body is decoded (a compressed body states its own size)."""
    total = 0
    reader = pa.ipc.MessageReader.open_stream(b)
    while True:
        try:
            msg = reader.read_next_message()
        except StopIteration:
            return total
        meta = msg.metadata.to_pybytes()
        if len(meta) < 8:
            raise PayloadError("Arrow IPC: corrupted message metadata (too short)")
        root = _FlatTable(meta, int.from_bytes(meta[:4], "little"))
        kind = root.scalar(1, 1)
        batch = root.table(2) if kind in (_MSG_RECORD_BATCH, _MSG_DICTIONARY_BATCH) else None
        if batch is not None and kind == _MSG_DICTIONARY_BATCH:
            batch = batch.table(1)
        if batch is None:
            continue
        vec = batch.ref(2)  # Buffer structs {offset: int64, length: int64}
        count = batch._int(vec, 4) if vec else 0
        compressed = batch.field(3) != 0
        body = msg.body
        for k in range(count):  # one entry per Arrow buffer, not per row
            offset = batch._int(vec + 4 + 16 * k, 8, signed=True)
            length = batch._int(vec + 12 + 16 * k, 8, signed=True)
            if offset < 0 or length < 0 or (body is not None and offset + length > body.size):
                raise PayloadError(
                    f"Arrow IPC: buffer [{offset}, {offset + length}) outside a {0 if body is None else body.size}-byte body"
                )
            if compressed and length >= 8 and body is not None:
                declared = int.from_bytes(
                    body[offset : offset + 8].to_pybytes(), "little", signed=True
                )
                total += length if declared == -1 else max(declared, 0)
            else:
                total += length


_ARROW_READ_ERRORS: Final = (
    pa.ArrowException,
    OSError,
    ValueError,
    TypeError,
    KeyError,
    IndexError,
    EOFError,
)


def _route_chunks(col: Any) -> list[Any]:
    """Per-token routes arrays of a ``routes`` column (per-token type or ``large_list`` of it)."""
    out = []
    for chunk in col.chunks:
        out.append(
            chunk.flatten()
            if pa.types.is_large_list(chunk.type) or pa.types.is_list(chunk.type)
            else chunk
        )
    return out


def _schema_spec(schema: Any) -> RouteSpec | None:
    """The spec in ``schema``'s metadata, None if absent; malformed metadata raises `SchemaError`."""
    if not schema.metadata or SPEC_METADATA_KEY not in schema.metadata:
        return None
    try:
        return RouteSpec.from_schema(schema)
    except R3ArrowError:
        raise
    except (ValueError, TypeError, AttributeError) as exc:
        raise SchemaError(
            f"Arrow IPC: expected a RouteSpec in metadata {SPEC_METADATA_KEY.decode()!r}, found "
            f"{schema.metadata[SPEC_METADATA_KEY]!r:.200} ({exc})"
        ) from None


def _routes_column(table: Any) -> Any:
    names = table.column_names
    if names.count("routes") != 1:
        raise PayloadError(f"Arrow IPC: expected one 'routes' column, found columns {names}")
    return table.column("routes")


def _read_ipc(buf: Any, max_bytes: int) -> tuple[Any, RouteSpec | None]:
    """Read and structurally validate a complete stream; return (table, spec from its metadata)."""
    max_bytes = _check_max_bytes(max_bytes)
    b = _as_arrow_buffer(buf)
    if b.size > max_bytes:
        raise PayloadTooLargeError(
            f"Arrow IPC: payload of {b.size:,} bytes exceeds max_bytes={max_bytes:,}"
        )
    try:
        declared = _declared_ipc_bytes(b)
        if declared > max_bytes:
            raise PayloadTooLargeError(
                f"Arrow IPC: record batches declare {declared:,} decoded bytes, more than max_bytes={max_bytes:,}"
            )
        table = pa.ipc.open_stream(b).read_all()
        table.validate(full=True)
    except PayloadError:
        raise
    except MemoryError as exc:
        raise PayloadTooLargeError(
            f"Arrow IPC: stream declares more memory than available: {exc}"
        ) from None
    except _ARROW_READ_ERRORS as exc:
        raise PayloadError(
            f"Arrow IPC: expected a valid Arrow IPC stream, found {b.size:,} bytes that fail: {exc}"
        ) from None
    total = table.get_total_buffer_size()
    if total > max_bytes:  # backstop; `_declared_ipc_bytes` already bounds compressed bodies
        raise PayloadTooLargeError(
            f"Arrow IPC: decoded buffers of {total:,} bytes exceed max_bytes={max_bytes:,}"
        )
    meta = table.schema.metadata
    if meta and IPC_ROWS_METADATA_KEY in meta:
        rows = meta[IPC_ROWS_METADATA_KEY]
        if rows != str(table.num_rows).encode():
            raise PayloadError(
                f"Arrow IPC: stream declares {rows.decode(errors='replace')!r} rows, found "
                f"{table.num_rows} (truncated stream?)"
            )
        rest = {k: v for k, v in meta.items() if k != IPC_ROWS_METADATA_KEY}
        table = table.replace_schema_metadata(rest or None)
    return table, _schema_spec(table.schema)


def _check_sent_spec(sent: RouteSpec | None, spec: RouteSpec) -> None:
    if sent is not None and not sent.same_shape(spec):
        raise RouteShapeError(
            f"Arrow IPC: expected routes [rows, {spec.num_layers}, {spec.topk}] on router layers "
            f"{list(spec.router_layers)}, found metadata spec {sent.to_json().decode()}"
        )


def decode_ipc(
    buf: Any, spec: RouteSpec | None = None, *, max_bytes: int = DEFAULT_MAX_BYTES
) -> Any:
    """Read an Arrow IPC stream into a ``pyarrow.Table`` whose buffers reference ``buf`` (zero-copy).

    With ``spec``: a spec in the schema metadata must have the same shape, and a ``"routes"``
    column (per-token type, or a ``large_list`` of it) must match ``L``/``K`` with ids in range.
    Raises `PayloadError` for anything that is not a complete, valid stream.
    """
    table, sent = _read_ipc(buf, max_bytes)
    if spec is not None:
        _check_sent_spec(sent, spec)
        if "routes" in table.column_names:
            for chunk in _route_chunks(_routes_column(table)):
                check_route_ids(routes_to_numpy(chunk, spec), spec, what="Arrow IPC routes")
    return table


def decode_ipc_routes(
    buf: Any, spec: RouteSpec | None = None, *, max_bytes: int = DEFAULT_MAX_BYTES
) -> np.ndarray:
    """Decode an `encode_ipc` stream of routes to ``[rows, L, K]`` numpy, a read-only view on ``buf``.

    Zero-copy when the stream holds one record batch (as `encode_ipc` writes); several batches are
    concatenated (one copy). Requires one ``"routes"`` column of the per-token routes type; its
    shape is checked against ``spec`` (else the metadata spec), ids only against ``spec``.
    """
    table, sent = _read_ipc(buf, max_bytes)
    if spec is not None:
        _check_sent_spec(sent, spec)
    col = _routes_column(table)
    t = col.type
    if not (pa.types.is_fixed_size_list(t) and pa.types.is_fixed_size_list(t.value_type)):
        raise RouteShapeError(
            f"Arrow IPC: expected 'routes' of type fixed_size_list<fixed_size_list<int, K>, L>, found {t}"
        )
    if col.num_chunks == 0:
        if not pa.types.is_integer(t.value_type.value_type):
            raise RouteShapeError(f"Arrow IPC: expected integer expert ids, found {t}")
        arr = np.empty(
            (0, t.list_size, t.value_type.list_size), t.value_type.value_type.to_pandas_dtype()
        )
    else:
        arr = routes_to_numpy(col, spec if spec is not None else sent)
    if spec is not None:
        if arr.shape[1:] != spec.row_shape:
            raise RouteShapeError(
                f"Arrow IPC: expected [rows, {spec.num_layers}, {spec.topk}], found {list(arr.shape)}"
            )
        check_route_ids(arr, spec, what="Arrow IPC routes")
    elif sent is not None and arr.shape[1:] != sent.row_shape:
        raise RouteShapeError(
            f"Arrow IPC: metadata spec says [rows, {sent.num_layers}, {sent.topk}], found {list(arr.shape)}"
        )
    return arr


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
