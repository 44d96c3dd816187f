"""Arrow IPC streams of routes: zero-copy decoding, sizes bounded from the message metadata.

`_declared_ipc_bytes` reads the buffer sizes each record batch declares from its
flatbuffer metadata (a small bounds-checked reader, `_FlatTable`) before any body
is decoded, so a stream cannot make the reader allocate more than ``max_bytes``.

Streams must be little-endian (a big-endian schema is refused: Arrow would silently byteswap
every id if one bit of the flag flipped), laid out as writers lay them out (buffers back to
back, each padded to 8 or 64 bytes) and end at their end-of-stream marker (or the end of the
input); anything else is a `PayloadError`.

A compressed stream is also bounded relative to its own size: by default the record batches
may declare at most ``max_ratio`` (`DEFAULT_MAX_RATIO`, 64) times the payload's bytes once
decompressed, but never less than `RATIO_FLOOR_BYTES` (64 MiB), so that a few kilobytes of
zstd cannot make a reader allocate gigabytes under the 8 GiB ``max_bytes`` default. Real
route streams compress 2-10x (random ids barely compress); an uncompressed stream declares at
most its own size, so only compression bombs reach the bound. ``max_ratio=None`` turns it off
(``max_bytes`` still applies). Both bounds raise `PayloadTooLargeError` before anything is
decompressed.
"""

from __future__ import annotations

from typing import Any, Final

import numpy as np
import pyarrow as pa

from r3arrow.codec._common import (
    DEFAULT_MAX_BYTES,
    check_max_bytes,
    check_row_shape,
    check_rows_for_encode,
    check_spec_arg,
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

#: Schema metadata key holding the row count `encode_ipc` wrote; a stream cut at a
#: message boundary reads as a valid shorter stream, this makes it detectable.
IPC_ROWS_METADATA_KEY: Final[bytes] = b"r3arrow.num_rows"

#: Default bound on decompressed bytes per payload byte of an Arrow IPC stream.
DEFAULT_MAX_RATIO: Final[float] = 64.0
#: The ratio bound never goes below this many decompressed bytes (64 MiB).
RATIO_FLOOR_BYTES: Final[int] = 64 << 20


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
        arr = check_rows_for_encode(routes, "encode_ipc")
    if spec is None:
        # ids >= 0 that fit int32 (no expert count known); the dtype is kept or inferred
        _, hi = check_routes(
            arr, RouteSpec(arr.shape[1], arr.shape[2], None), what="encode_ipc", rules="range"
        )
        keep = arr.dtype.name in ("uint8", "uint16", "int32")
        dt = arr.dtype if keep else storage_dtype_for(hi + 1 if arr.size else 1)
        spec = RouteSpec(arr.shape[1], arr.shape[2], None, id_dtype=dt.name)
    else:
        if arr.shape[1:] != spec.row_shape:
            raise RouteShapeError(
                f"encode_ipc: expected [rows, {spec.num_layers}, {spec.topk}], found "
                f"{list(arr.shape)}"
            )
        _, hi = check_routes(arr, spec, what="encode_ipc", rules="range")
        spec = spec.widened_for(hi)
    target = spec.dtype.newbyteorder("=")  # check_routes ensured every layer fits it
    return np.ascontiguousarray(arr, dtype=target), spec


def encode_ipc(routes: Any, spec: RouteSpec | None = None) -> Any:
    """Serialise routes as an Arrow IPC stream; return a ``pyarrow.Buffer`` (``bytes()`` copies).

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
        # Arrow would byteswap a big-endian stream on read: one flipped bit in the schema
        # would then turn every id into its byteswapped value. Every writer r3arrow meets
        # is little-endian, so the flag is refused rather than trusted.
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
            # Writers lay buffers out back to back, each padded to 8 (or 64) bytes. Holding
            # streams to that means an edited offset cannot slide a buffer over its padding
            # or a neighbour and decode shifted ids of the right shape.
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
    b = _as_arrow_buffer(buf)
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


def _check_sent_spec(sent: RouteSpec | None, spec: RouteSpec) -> None:
    if sent is not None and not sent.same_shape(spec):
        raise RouteShapeError(
            f"Arrow IPC: expected routes [rows, {spec.num_layers}, {spec.topk}] on router layers "
            f"{list(spec.router_layers)}, found metadata spec {sent.to_json().decode()}"
        )


def decode_ipc(
    buf: Any,
    spec: RouteSpec | None = None,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_ratio: float | None = DEFAULT_MAX_RATIO,
) -> Any:
    """Read an Arrow IPC stream into a ``pyarrow.Table`` on ``buf``'s memory (zero-copy).

    With ``spec``: a spec in the schema metadata must have the same shape, and a ``"routes"``
    column (per-token type, or a ``large_list`` of it) must match ``L``/``K`` with ids in range.
    Raises only `R3ArrowError` subclasses for any ``buf``: `PayloadError` for anything that is
    not a complete, valid stream, `PayloadTooLargeError` over ``max_bytes`` or ``max_ratio``
    (module docstring), `SchemaError` / `RouteShapeError` / `ExpertRangeError` for the spec
    checks. ``TypeError``/``ValueError`` only for bad ``spec``/``max_bytes``/``max_ratio``.
    """
    max_bytes = check_max_bytes(max_bytes)
    ratio = _check_ratio(max_ratio)
    check_spec_arg(spec, "decode_ipc")
    with payload_boundary("Arrow IPC"):
        table, sent = _read_ipc(buf, max_bytes, ratio)
        if spec is not None:
            _check_sent_spec(sent, spec)
            if "routes" in table.column_names:
                col = _routes_column(table)
                t = col.type  # per-token type, or a large_list of it (a rollout table)
                per_token = t.value_type if pa.types.is_large_list(t) or pa.types.is_list(t) else t
                _check_routes_type(per_token)
                if (per_token.list_size, per_token.value_type.list_size) != spec.row_shape:
                    raise RouteShapeError(
                        f"Arrow IPC: expected routes [rows, {spec.num_layers}, {spec.topk}], "
                        f"found {per_token}"
                    )
                for chunk in _route_chunks(col):
                    _check_no_inner_nulls(chunk)
                    check_routes(
                        routes_to_numpy(chunk, spec), spec, what="Arrow IPC routes", rules="range"
                    )
        return table


def decode_ipc_routes(
    buf: Any,
    spec: RouteSpec | None = None,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_ratio: float | None = DEFAULT_MAX_RATIO,
) -> np.ndarray:
    """Decode an `encode_ipc` stream to ``[rows, L, K]`` numpy, a read-only view on ``buf``.

    Zero-copy when the stream holds one record batch (as `encode_ipc` writes); several batches are
    concatenated (one copy). Requires one ``"routes"`` column of the per-token routes type; its
    shape is checked against ``spec`` (else the metadata spec), ids only against ``spec``.
    Raises what `decode_ipc` raises, and `RouteShapeError` for another column type or a
    null layer row; only `R3ArrowError` subclasses for any ``buf``.
    """
    max_bytes = check_max_bytes(max_bytes)
    ratio = _check_ratio(max_ratio)
    check_spec_arg(spec, "decode_ipc_routes")
    with payload_boundary("Arrow IPC"):
        return _decode_ipc_routes(buf, spec, max_bytes, ratio)


def _decode_ipc_routes(
    buf: Any, spec: RouteSpec | None, max_bytes: int, max_ratio: float | None
) -> np.ndarray:
    table, sent = _read_ipc(buf, max_bytes, max_ratio)
    if spec is not None:
        _check_sent_spec(sent, spec)
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
        arr = routes_to_numpy(col, spec if spec is not None else sent)
    if spec is not None:
        if arr.shape[1:] != spec.row_shape:
            raise RouteShapeError(
                f"Arrow IPC: expected [rows, {spec.num_layers}, {spec.topk}], found "
                f"{list(arr.shape)}"
            )
        check_routes(arr, spec, what="Arrow IPC routes", rules="range")
    elif sent is not None and arr.shape[1:] != sent.row_shape:
        raise RouteShapeError(
            f"Arrow IPC: metadata spec says [rows, {sent.num_layers}, {sent.topk}], found "
            f"{list(arr.shape)}"
        )
    return arr
