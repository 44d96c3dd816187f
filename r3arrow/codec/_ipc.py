"""Arrow IPC streams of routes: zero-copy decoding, sizes bounded from the message metadata.

``docs/design.md``, "Wire formats": `_declared_ipc_bytes` reads the buffer sizes each
record batch declares from its flatbuffer metadata (`_FlatTable`, bounds-checked) before any
body is decoded, against ``max_bytes`` and, for compressed bodies, ``max_ratio`` times the
payload (at least `RATIO_FLOOR_BYTES`). Streams must be little-endian, laid out as writers
lay them out and end at their end-of-stream marker; anything else is a `PayloadError`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, TypeVar

import numpy as np
import pyarrow as pa

from r3arrow.codec._common import (
    DEFAULT_MAX_BYTES,
    check_max_bytes,
    check_row_shape,
    check_rows_for_encode,
    check_spec_arg,
    check_spec_shape,
    encode_spec,
    payload_boundary,
)
from r3arrow.errors import (
    PayloadError,
    PayloadTooLargeError,
    R3ArrowError,
    RouteDTypeError,
    RouteShapeError,
    SchemaError,
)
from r3arrow.ids import check_routes
from r3arrow.spec import (
    SPEC_METADATA_KEY,
    RouteSpec,
    numpy_to_routes,
    routes_to_numpy,
    storage_dtype_for,
)

T = TypeVar("T")

#: Schema metadata key of the row count `encode_ipc` wrote: a stream cut at a message
#: boundary reads as a valid shorter stream.
IPC_ROWS_METADATA_KEY: Final[bytes] = b"r3arrow.num_rows"

#: Default bound on decompressed bytes per payload byte of an Arrow IPC stream.
DEFAULT_MAX_RATIO: Final[float] = 64.0
#: The ratio bound never goes below this many decompressed bytes (64 MiB).
RATIO_FLOOR_BYTES: Final[int] = 64 << 20


def _prepare_routes(routes: Any, spec: RouteSpec | None) -> tuple[np.ndarray, RouteSpec]:
    if isinstance(routes, pa.Array | pa.ChunkedArray):
        arr = routes_to_numpy(routes, spec)
    else:
        arr = check_rows_for_encode(routes, "encode_ipc")
    checked, hi = encode_spec(arr, spec, "encode_ipc")
    if spec is None:  # the dtype is kept or inferred
        keep = arr.dtype.name in ("uint8", "uint16", "int32")
        dt = arr.dtype if keep else storage_dtype_for(hi + 1 if arr.size else 1)
        spec = RouteSpec(arr.shape[1], arr.shape[2], None, id_dtype=dt.name)
    else:
        spec = checked.widened_for(hi)
    target = spec.dtype.newbyteorder("=")  # check_routes ensured every layer fits it
    return np.ascontiguousarray(arr, dtype=target), spec


def encode_ipc(routes: Any, spec: RouteSpec | None = None) -> Any:
    """Routes as an Arrow IPC stream (a ``pyarrow.Buffer``): ``[rows, L, K]`` numpy or per-token
    Arrow routes as a ``"routes"`` column (ids checked against ``spec``, else it is inferred),
    a ``pa.Table`` / ``RecordBatch`` as is; the spec and row count in the metadata.
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
                    f"encode_ipc: table metadata spec {sent.to_json().decode()} does not match "
                    f"{spec}"
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
    """Bounds-checked reader of one flatbuffer table (what `_declared_ipc_bytes` needs)."""

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


_MSG_SCHEMA, _MSG_DICTIONARY_BATCH, _MSG_RECORD_BATCH = 1, 2, 3


def _declared_ipc_bytes(b: Any) -> int:
    """Sum of the buffer sizes the stream's record batches declare once decompressed, read from
    the message metadata before any body is decoded (a compressed body states its own size)."""
    total = 0
    source = pa.BufferReader(b)
    reader = pa.ipc.MessageReader.open_stream(source)
    while True:
        try:
            msg = reader.read_next_message()
        except StopIteration:
            if source.tell() != b.size:  # the reader would silently ignore them
                raise PayloadError(
                    f"Arrow IPC: expected the stream to end at its end-of-stream marker, found "
                    f"{b.size - source.tell():,} more bytes after it"
                ) from None
            return total
        meta = msg.metadata.to_pybytes()
        if len(meta) < 8:
            raise PayloadError("Arrow IPC: corrupted message metadata (too short)")
        root = _FlatTable(meta, int.from_bytes(meta[:4], "little"))
        kind = root.scalar(1, 1)
        schema = root.table(2) if kind == _MSG_SCHEMA else None
        # Arrow byteswaps a big-endian stream: one flipped bit would byteswap every id.
        if schema is not None and schema.scalar(0, 2) != 0:
            raise PayloadError(
                "Arrow IPC: expected a little-endian stream (schema endianness 0), found "
                f"endianness {schema.scalar(0, 2)}; big-endian streams are not accepted"
            )
        batch = root.table(2) if kind in (_MSG_RECORD_BATCH, _MSG_DICTIONARY_BATCH) else None
        if batch is not None and kind == _MSG_DICTIONARY_BATCH:
            batch = batch.table(1)
        if batch is None:
            continue
        vec = batch.ref(2)  # Buffer structs {offset: int64, length: int64}
        count = batch._int(vec, 4) if vec else 0
        compressed = batch.field(3) != 0
        body = msg.body
        end = 0
        for k in range(count):  # one entry per Arrow buffer, not per row
            offset = batch._int(vec + 4 + 16 * k, 8, signed=True)
            length = batch._int(vec + 12 + 16 * k, 8, signed=True)
            if offset < 0 or length < 0 or (body is not None and offset + length > body.size):
                raise PayloadError(
                    f"Arrow IPC: buffer [{offset}, {offset + length}) outside a "
                    f"{0 if body is None else body.size}-byte body"
                )
            # Writers lay buffers out back to back, padded to 8 (or 64) bytes: an edited
            # offset cannot slide a buffer over its padding and decode shifted ids.
            if offset not in (-(-end // 8) * 8, -(-end // 64) * 64):
                raise PayloadError(
                    f"Arrow IPC: expected buffer {k} at offset {-(-end // 8) * 8} (after the "
                    f"previous buffer, padded), found offset {offset}"
                )
            end = offset + length
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


def _schema_spec(schema: Any) -> RouteSpec | None:
    """The spec in ``schema``'s metadata, or None; malformed metadata raises `SchemaError`."""
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
        ) from exc


def _check_ratio(max_ratio: Any) -> float | None:
    """``max_ratio`` as a float ``>= 1``, or None (argument misuse raises a builtin)."""
    if max_ratio is None:
        return None
    if isinstance(max_ratio, bool) or not isinstance(max_ratio, int | float):
        raise TypeError(f"max_ratio: expected a number or None, found {type(max_ratio).__name__}")
    if not max_ratio >= 1:  # also rejects NaN
        raise ValueError(f"max_ratio: expected a number >= 1 or None, found {max_ratio!r}")
    return float(max_ratio)


def _check_routes_type(t: Any) -> None:
    """``t`` must be ``fixed_size_list<fixed_size_list<int, K>, L>`` with a sane ``[L, K]``."""
    if not (
        pa.types.is_fixed_size_list(t)
        and pa.types.is_fixed_size_list(t.value_type)
        and pa.types.is_integer(t.value_type.value_type)
    ):
        raise RouteShapeError(
            "Arrow IPC: expected 'routes' of type fixed_size_list<fixed_size_list<int, K>, L>, "
            f"found {t}"
        )
    # A schema is not checked by Arrow: a negative or huge list size reads "fine".
    check_row_shape(t.list_size, t.value_type.list_size, "Arrow IPC routes")


def _check_no_inner_nulls(chunk: Any) -> None:
    """A null ``[K]`` row inside a token would read as whatever bytes sit under it."""
    inner = chunk.flatten()
    if inner.null_count:
        raise RouteShapeError(
            f"Arrow IPC: expected no null layer rows in routes, found {inner.null_count}"
        )


def _check_type_sizes(t: Any) -> None:
    """Arrow reads a fixed-size list of negative size from a schema without complaint."""
    if pa.types.is_fixed_size_list(t) and t.list_size < 0:
        raise PayloadError(f"Arrow IPC: expected list sizes >= 0 in the schema, found {t}")
    if pa.types.is_dictionary(t):
        _check_type_sizes(t.value_type)
    for i in range(t.num_fields):
        _check_type_sizes(t.field(i).type)


def _routes_column(table: Any) -> Any:
    names = table.column_names
    if names.count("routes") != 1:
        raise PayloadError(f"Arrow IPC: expected one 'routes' column, found columns {names}")
    return table.column("routes")


def _read_ipc(buf: Any, max_bytes: int, max_ratio: float | None) -> tuple[Any, RouteSpec | None]:
    """Read and structurally validate a complete stream; return (table, spec from its metadata)."""
    b = pa.py_buffer(buf) if isinstance(buf, bytes | bytearray | memoryview) else buf
    if not isinstance(b, pa.Buffer):
        raise PayloadError(
            f"Arrow IPC: expected bytes or a pyarrow.Buffer, found {type(buf).__name__}"
        )
    if b.size > max_bytes:
        raise PayloadTooLargeError(
            f"Arrow IPC: payload of {b.size:,} bytes exceeds max_bytes={max_bytes:,}"
        )
    try:
        declared = _declared_ipc_bytes(b)
        if declared > max_bytes:
            raise PayloadTooLargeError(
                f"Arrow IPC: record batches declare {declared:,} decoded bytes, more than "
                f"max_bytes={max_bytes:,}"
            )
        if max_ratio is not None:
            cap = max(RATIO_FLOOR_BYTES, int(max_ratio * b.size))
            if declared > cap:
                raise PayloadTooLargeError(
                    f"Arrow IPC: record batches declare {declared:,} decoded bytes, more than "
                    f"max_ratio={max_ratio:g} x the {b.size:,}-byte payload (at least "
                    f"{RATIO_FLOOR_BYTES:,} bytes; pass max_ratio=None to lift)"
                )
        reader = pa.ipc.open_stream(b)
        for field in reader.schema:
            _check_type_sizes(field.type)
        table = reader.read_all()
        table.validate(full=True)
    except PayloadError:
        raise
    except MemoryError as exc:
        raise PayloadTooLargeError(
            f"Arrow IPC: stream declares more memory than available: {exc}"
        ) from exc
    except _ARROW_READ_ERRORS as exc:
        raise PayloadError(
            f"Arrow IPC: expected a valid Arrow IPC stream, found {b.size:,} bytes that fail: {exc}"
        ) from exc
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


def _check_sent_spec(sent: RouteSpec | None, spec: RouteSpec | None) -> None:
    if sent is not None and spec is not None and not sent.same_shape(spec):
        raise RouteShapeError(
            f"Arrow IPC: expected routes [rows, {spec.num_layers}, {spec.topk}] on router layers "
            f"{list(spec.router_layers)}, found metadata spec {sent.to_json().decode()}"
        )


def _guarded(
    decode: Callable[[Any, RouteSpec | None, int, float | None], T],
    buf: Any,
    spec: RouteSpec | None,
    max_bytes: Any,
    max_ratio: Any,
    what: str,
) -> T:
    """``decode(buf, spec, max_bytes, max_ratio)`` inside the boundary, arguments checked."""
    max_bytes = check_max_bytes(max_bytes)
    ratio = _check_ratio(max_ratio)
    check_spec_arg(spec, what)
    with payload_boundary("Arrow IPC"):
        return decode(buf, spec, max_bytes, ratio)


def decode_ipc(
    buf: Any,
    spec: RouteSpec | None = None,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_ratio: float | None = DEFAULT_MAX_RATIO,
) -> Any:
    """An Arrow IPC stream as a ``pyarrow.Table`` on ``buf``'s memory (zero-copy).

    With ``spec``: a metadata spec of the same shape, a ``"routes"`` column (per-token type or
    a ``large_list`` of it) of its ``L``/``K`` with ids in range. Raises as the package
    docstring says (`PayloadTooLargeError` also over ``max_ratio``).
    """
    return _guarded(_decode_ipc, buf, spec, max_bytes, max_ratio, "decode_ipc")


def _decode_ipc(buf: Any, spec: RouteSpec | None, max_bytes: int, max_ratio: float | None) -> Any:
    table, sent = _read_ipc(buf, max_bytes, max_ratio)
    if spec is None:
        return table
    _check_sent_spec(sent, spec)
    if "routes" not in table.column_names:
        return table
    col = _routes_column(table)
    nested = pa.types.is_large_list(col.type) or pa.types.is_list(col.type)  # a rollout table
    per_token = col.type.value_type if nested else col.type
    _check_routes_type(per_token)
    if (per_token.list_size, per_token.value_type.list_size) != spec.row_shape:
        raise RouteShapeError(
            f"Arrow IPC: expected routes [rows, {spec.num_layers}, {spec.topk}], found {per_token}"
        )
    for chunk in col.chunks:
        tokens = chunk.flatten() if nested else chunk
        _check_no_inner_nulls(tokens)
        check_routes(routes_to_numpy(tokens, spec), spec, what="Arrow IPC routes", rules="range")
    return table


def decode_ipc_routes(
    buf: Any,
    spec: RouteSpec | None = None,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_ratio: float | None = DEFAULT_MAX_RATIO,
) -> np.ndarray:
    """An `encode_ipc` stream as ``[rows, L, K]`` numpy, a read-only view on ``buf`` for one
    record batch: one ``"routes"`` column of the per-token type, its shape checked against
    ``spec`` (else the metadata spec), ids against ``spec``. Raises as `decode_ipc`.
    """
    return _guarded(_decode_ipc_routes, buf, spec, max_bytes, max_ratio, "decode_ipc_routes")


def _decode_ipc_routes(
    buf: Any, spec: RouteSpec | None, max_bytes: int, max_ratio: float | None
) -> np.ndarray:
    table, sent = _read_ipc(buf, max_bytes, max_ratio)
    _check_sent_spec(sent, spec)
    want = spec if spec is not None else sent
    col = _routes_column(table)
    t = col.type
    _check_routes_type(t)
    if sent is not None and t.value_type.value_type != sent.arrow_value_type:
        raise RouteDTypeError(
            f"Arrow IPC: metadata spec says ids of {sent.arrow_value_type}, found "
            f"{t.value_type.value_type}"
        )
    for chunk in col.chunks:
        _check_no_inner_nulls(chunk)
    if col.num_chunks == 0:
        arr = np.empty(
            (0, t.list_size, t.value_type.list_size), t.value_type.value_type.to_pandas_dtype()
        )
    else:
        arr = routes_to_numpy(col, want)
    if want is not None:
        check_spec_shape(arr.shape, want, "Arrow IPC")
    if spec is not None:
        check_routes(arr, spec, what="Arrow IPC routes", rules="range")
    return arr
