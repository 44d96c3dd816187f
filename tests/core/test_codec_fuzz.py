"""Fuzzing every codec decoder: round trips, and no input makes one raise anything but ours.

For each decoder (vLLM ``.npy`` base64, SkyRL packed dict, SGLang base64, Arrow IPC as bytes
and as a ``pyarrow.Buffer`` through `decode_ipc` and `decode_ipc_routes`):

(a) any valid routes round-trip: encode, then decode, gives the original ids and shape;
(b) any bytes, and any mutation of a valid payload (byte flips and sets, truncation,
    extension, insertion, deletion, base64 text edits, ``.npy`` header edits, random dicts
    for packed), either raise an `R3ArrowError` or decode to exactly the encoded array. Never
    another exception; never a different array of the same shape, except where the format
    cannot tell (documented in ``r3arrow.codec``):

    * a mutation confined to the id bytes (no format checksums them) decodes as those ids
      when they stay in range (``"data edit"`` below);
    * ``.npy``: flipping the header's byte-order mark (``'<u2'`` to ``'>u2'``) reads the
      ids byteswapped; a spec catches it only when swapped ids leave ``[0, num_experts)``;
    * SGLang: the payload has no length, so a cut or an extension by whole rows is a valid,
      shorter or longer payload (the only case where another shape decodes).

The tally of outcomes (examples run, errors by type) is written as JSON to the file named by
``R3ARROW_FUZZ_REPORT`` when that variable is set; ``R3ARROW_FUZZ_SCALE=N`` runs N times the
examples. The four inputs that crashed the decoders
before (issue 9.4) are literal cases at the end.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import os
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from r3arrow import codec
from r3arrow.codec._ipc import RATIO_FLOOR_BYTES, _FlatTable
from r3arrow.codec._packed import packed_dtype_for
from r3arrow.errors import PayloadError, PayloadTooLargeError, R3ArrowError, RouteShapeError
from r3arrow.spec import RouteSpec, numpy_to_routes, routes_to_numpy
from r3arrow.testing import strategies as r3st

# R3ARROW_FUZZ_SCALE=N runs N times the examples (a longer local soak; CI uses 1).
SCALE = int(os.environ.get("R3ARROW_FUZZ_SCALE", "1"))
_SLOW_OK = [HealthCheck.too_slow]
FUZZ = settings(max_examples=200 * SCALE, deadline=None, suppress_health_check=_SLOW_OK)
ROUND = settings(max_examples=100 * SCALE, deadline=None, suppress_health_check=_SLOW_OK)
IPC_FUZZ = settings(max_examples=300 * SCALE, deadline=None, suppress_health_check=_SLOW_OK)
SPEC = RouteSpec(num_layers=3, topk=2, num_experts=16)

COUNTS: Counter[str] = Counter()


@pytest.fixture(scope="module", autouse=True)
def _report() -> Iterator[None]:
    yield
    path = os.environ.get("R3ARROW_FUZZ_REPORT")
    if path:
        with open(path, "w") as f:
            json.dump(dict(sorted(COUNTS.items())), f, indent=1)


def outcome(
    fmt: str,
    decode: Callable[[], np.ndarray],
    original: np.ndarray | None,
    spec: RouteSpec,
    *,
    data_edit: bool = False,
    alternatives: tuple[np.ndarray, ...] = (),
    other_rows_ok: bool = False,
    ids_checked: bool = True,
) -> None:
    """Run one decode and check it against the contract in the module docstring."""
    COUNTS[f"{fmt}: examples"] += 1
    try:
        out = decode()
    except R3ArrowError as exc:
        COUNTS[f"{fmt}: raised {type(exc).__name__}"] += 1
        return
    # Anything else propagates and fails the test. A decoded array is always well formed:
    assert out.ndim == 3 and out.shape[1:] == spec.row_shape
    if out.size and ids_checked:  # without a spec a decoder checks structure only
        assert spec.num_experts is not None and out.min() >= 0
        assert int(out[:, list(spec.router_layers)].max(initial=0)) < spec.num_experts
    if original is None:  # arbitrary input: a well-formed decode is all we can ask
        COUNTS[f"{fmt}: decoded (arbitrary input)"] += 1
        return
    if out.shape != original.shape:
        assert other_rows_ok, f"{fmt}: decoded {out.shape}, encoded {original.shape}"
        COUNTS[f"{fmt}: decoded other row count"] += 1
        return
    if np.array_equal(out, original):
        COUNTS[f"{fmt}: decoded equal"] += 1
        return
    if any(np.array_equal(out, alt) for alt in alternatives):
        COUNTS[f"{fmt}: decoded byteswapped"] += 1
        return
    assert data_edit, f"{fmt}: a non-data mutation decoded different ids of the same shape"
    COUNTS[f"{fmt}: decoded data edit"] += 1


# ---------------------------------------------------------------- strategies
@st.composite
def cases(draw: st.DrawFn, max_rows: int = 12) -> tuple[np.ndarray, RouteSpec]:
    spec = draw(r3st.specs(max_layers=4, max_topk=3))
    return draw(r3st.routes(spec, max_rows=max_rows)), spec


@st.composite
def byte_mutation(
    draw: st.DrawFn, raw: bytes, window: tuple[int, int] = (0, 0)
) -> tuple[bytes, bool]:
    """One or a few edits of ``raw`` (flip, set, truncate, extend, insert, delete), and
    whether any edit touched the id bytes ``raw[window[0]:window[1]]``.

    The window follows insertions and deletions before it. Half the edits land inside it,
    which random positions in a payload that is mostly header would rarely reach.
    """
    out = bytearray(raw)
    lo, hi = window
    touched = False
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["flip", "set", "cut", "extend", "insert", "delete"]))
        if hi > lo and draw(st.booleans()):
            pos = draw(st.integers(lo, hi - 1))
        else:
            pos = draw(st.integers(0, max(len(out) - 1, 0)))
        if kind in ("flip", "set") and out:
            out[pos] = (
                out[pos] ^ draw(st.integers(1, 255))
                if kind == "flip"
                else draw(st.integers(0, 255))
            )
            touched |= lo <= pos < hi
        elif kind == "cut":
            cut = draw(st.integers(0, len(out)))
            del out[cut:]
            touched |= cut < hi
            lo, hi = min(lo, cut), min(hi, cut)
        elif kind == "extend":
            out += draw(st.binary(min_size=1, max_size=24))
        elif kind == "insert":
            n = len(extra := draw(st.binary(min_size=1, max_size=8)))
            out[pos:pos] = extra
            touched |= lo < pos < hi
            if pos <= lo:
                lo, hi = lo + n, hi + n
            elif pos < hi:
                hi += n
        elif kind == "delete" and out:
            n = min(draw(st.integers(1, 8)), len(out) - pos)
            del out[pos : pos + n]
            touched |= pos < hi and pos + n > lo
            a, b = max(pos, lo), min(pos + n, hi)  # the deleted part of the window
            shift = max(0, min(pos + n, lo) - pos)
            lo, hi = lo - shift, hi - shift - max(0, b - a)
    return bytes(out), touched


B64_CHARS = st.sampled_from(
    [*"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/=", *"-_ \né\x00"]
)


@st.composite
def text_mutation(draw: st.DrawFn, text: str) -> str:
    """One or a few edits of base64 ``text``: replace, cut, add or drop characters."""
    out = list(text)
    for _ in range(draw(st.integers(1, 3))):
        kind = draw(st.sampled_from(["replace", "cut", "add", "drop"]))
        pos = draw(st.integers(0, max(len(out) - 1, 0)))
        if kind == "replace" and out:
            out[pos] = draw(B64_CHARS)
        elif kind == "cut":
            del out[draw(st.integers(0, len(out))) :]
        elif kind == "add":
            out[pos:pos] = draw(st.lists(B64_CHARS, min_size=1, max_size=8))
        elif kind == "drop" and out:
            del out[pos]
    return "".join(out)


def b64_bytes(text: str) -> bytes | None:
    """What a strict decoder reads from ``text`` (None: not valid base64)."""
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return None


def only_inside(mutated: bytes | None, raw: bytes, lo: int, hi: int) -> bool:
    """Whether ``mutated`` differs from ``raw`` only within ``raw[lo:hi]`` (same length)."""
    if mutated is None or len(mutated) != len(raw):
        return False
    return mutated[:lo] == raw[:lo] and mutated[hi:] == raw[hi:]


# ---------------------------------------------------------------- (a) round trips
@ROUND
@given(cases(max_rows=40))
def test_round_trip_every_decoder(case: tuple[np.ndarray, RouteSpec]) -> None:
    arr, spec = case
    ipc = codec.encode_ipc(arr, spec)
    decoded = {
        "vllm": codec.decode_vllm(codec.encode_vllm(arr), spec),
        "vllm bytes": codec.decode_vllm(codec.encode_vllm(arr).encode(), spec),
        "packed": codec.decode_packed(codec.encode_packed(arr), spec),
        "packed int64": codec.decode_packed(codec.encode_packed(arr.astype(np.int64)), spec),
        "packed +spec": codec.decode_packed(codec.encode_packed(arr, spec), spec),
        "sglang": codec.decode_sglang(codec.encode_sglang(arr), spec),
        "ipc routes buffer": codec.decode_ipc_routes(ipc, spec),
        "ipc routes bytes": codec.decode_ipc_routes(ipc.to_pybytes(), spec),
        "ipc routes no spec": codec.decode_ipc_routes(ipc.to_pybytes()),
        "ipc table": routes_to_numpy(codec.decode_ipc(ipc, spec).column("routes")),
    }
    for name, out in decoded.items():
        COUNTS[f"round trip {name}: examples"] += 1
        assert out.shape == arr.shape and np.array_equal(out, arr), name
    assert codec.encode_packed(arr)["dtype"] == packed_dtype_for(int(arr.max(initial=0)))


# ---------------------------------------------------------------- (b) arbitrary input
@FUZZ
@given(st.one_of(st.binary(max_size=400), st.text(max_size=400)), st.booleans())
def test_arbitrary_input_raises_only_r3arrow_errors(junk: bytes | str, as_b64: bool) -> None:
    raw = junk.encode() if isinstance(junk, str) else junk
    payload: bytes | str = base64.b64encode(raw) if as_b64 else junk
    outcome("vllm", lambda: codec.decode_vllm(payload, SPEC), None, SPEC)
    outcome("sglang", lambda: codec.decode_sglang(payload, SPEC), None, SPEC)
    for obj in (
        {"data": payload, "shape": [len(raw) // 6, 3, 2], "dtype": "uint8"},
        {"data": payload, "shape": [len(raw) // 12, 3, 2], "dtype": "int16"},
    ):
        outcome("packed", lambda: codec.decode_packed(obj, SPEC), None, SPEC)  # noqa: B023
    outcome("ipc routes", lambda: codec.decode_ipc_routes(raw, SPEC), None, SPEC)
    outcome("ipc routes", lambda: codec.decode_ipc_routes(raw), None, SPEC, ids_checked=False)
    COUNTS["ipc table: examples"] += 1
    with pytest.raises(R3ArrowError):  # random bytes are never a complete Arrow stream
        codec.decode_ipc(raw, SPEC)


JSONISH = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats()
    | st.text(max_size=12)
    | st.binary(max_size=12)
    | st.sampled_from(["uint8", "uint16", "int16", "int32", "int64", "<i2", "float32"]),
    lambda inner: st.lists(inner, max_size=4) | st.tuples(inner, inner, inner),
    max_leaves=8,
)


@FUZZ
@given(
    st.dictionaries(
        st.sampled_from(["data", "shape", "dtype", "extra"]) | st.text(max_size=4),
        JSONISH,
        max_size=5,
    )
    | st.fixed_dictionaries(  # the right keys, values anything plausible
        {
            "data": st.text("AQIDBAUG=/+", max_size=16) | st.binary(max_size=12) | JSONISH,
            "shape": st.lists(st.integers(-1, 8) | st.just(2**64), max_size=4) | JSONISH,
            "dtype": st.sampled_from(["uint8", "uint16", "int16", "int32", "int8"]) | JSONISH,
        }
    )
    | JSONISH
)
def test_random_packed_objects_raise_only_r3arrow_errors(obj: Any) -> None:
    outcome("packed random", lambda: codec.decode_packed(obj, SPEC), None, SPEC)
    outcome("packed random", lambda: codec.decode_packed(obj), None, SPEC)


@FUZZ
@given(
    st.lists(st.integers(-3, 2**66) | st.sampled_from([0, 1, 2, 3, 6, 2**31]), max_size=5),
    st.sampled_from(["uint8", "uint16", "int16", "int32"]),
    st.integers(0, 64),
)
def test_packed_headers_with_any_shape_and_dtype(shape: list[int], dtype: str, n: int) -> None:
    obj = {"data": base64.b64encode(bytes(range(n))).decode(), "shape": shape, "dtype": dtype}
    outcome("packed header", lambda: codec.decode_packed(obj, SPEC), None, SPEC)


# ---------------------------------------------------------------- (b) mutated vLLM
def npy_raw(arr: np.ndarray) -> tuple[bytes, int]:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    raw = buf.getvalue()
    return raw, 10 + int.from_bytes(raw[8:10], "little")


@st.composite
def header_edit(draw: st.DrawFn, arr: np.ndarray) -> str:
    """A hand-edited ``.npy`` header (any descr, shape and order, or arbitrary text)."""
    descr = draw(
        st.sampled_from(["|u1", "<u2", ">u2", "<i2", "<i4", ">i4", "=u2", "u1,", "i4,(", "(2,)u1"])
        | st.sampled_from(["<i8", "|O", "<f4", "uint16", "V", "<U2", "[('a','<u2')]"])
        | st.text(max_size=8)
    )
    dims = st.integers(-2, 2**66) | st.sampled_from(list(arr.shape))
    shape = draw(st.lists(dims, max_size=4).map(tuple) | st.just(arr.shape))
    order = draw(st.sampled_from(["False", "True", "0", "None"]))
    text = f"{{'descr': {descr!r}, 'fortran_order': {order}, 'shape': {shape!r}, }}"
    return draw(st.just(text) | st.text(max_size=80))


def npy_with_text(text: str, data: bytes) -> bytes:
    body = text.encode("utf8", errors="replace")
    body += b" " * (-(10 + len(body) + 1) % 64) + b"\n"
    return b"\x93NUMPY\x01\x00" + len(body).to_bytes(2, "little") + body + data


@FUZZ
@given(cases(), st.data())
def test_mutated_vllm_payloads(case: tuple[np.ndarray, RouteSpec], data: st.DataObject) -> None:
    arr, spec = case
    raw, offset = npy_raw(arr)
    swapped_header = raw[:offset].replace(b"'<", b"'>")
    byteswapped = (arr.byteswap(),) if arr.dtype.itemsize > 1 else ()
    how = data.draw(st.sampled_from(["bytes", "text", "header"]))
    mutated: bytes | None
    touched = False
    if how == "bytes":
        mutated, touched = data.draw(byte_mutation(raw, (offset, len(raw))))
        payload: str = base64.b64encode(mutated).decode()
    elif how == "text":
        payload = data.draw(text_mutation(codec.encode_vllm(arr)))
        mutated = b64_bytes(payload)
        touched = only_inside(mutated, raw, offset, len(raw))
    else:
        mutated = npy_with_text(data.draw(header_edit(arr)), raw[offset:])
        payload = base64.b64encode(mutated).decode()
    flipped_order = mutated is not None and mutated[:offset] == swapped_header
    outcome(
        f"vllm {how}",
        lambda: codec.decode_vllm(payload, spec),
        arr,
        spec,
        data_edit=touched,
        alternatives=byteswapped if flipped_order else (),
    )


# ---------------------------------------------------------------- (b) mutated packed
@FUZZ
@given(cases(), st.data())
def test_mutated_packed_payloads(case: tuple[np.ndarray, RouteSpec], data: st.DataObject) -> None:
    arr, spec = case
    obj = codec.encode_packed(arr)
    raw = base64.b64decode(obj["data"])
    how = data.draw(st.sampled_from(["bytes", "text", "shape", "dtype", "keys"]))
    touched = False
    if how == "bytes":
        mutated, touched = data.draw(byte_mutation(raw, (0, len(raw))))
        obj["data"] = base64.b64encode(mutated).decode()
    elif how == "text":
        obj["data"] = data.draw(text_mutation(obj["data"]))
        touched = only_inside(b64_bytes(obj["data"]), raw, 0, len(raw))
    elif how == "shape":
        dims = st.integers(-2, 2**40) | st.sampled_from([*arr.shape, 0, 1, 2 * arr.shape[0]])
        obj["shape"] = data.draw(st.lists(dims, max_size=4))
    elif how == "dtype":
        obj["dtype"] = data.draw(JSONISH)
    else:
        key = data.draw(st.sampled_from(["data", "shape", "dtype"]))
        obj[data.draw(st.sampled_from(["", "Data", "extra", key]))] = obj.pop(key)
    # The shape, dtype and keys are the header; only the id bytes are data.
    outcome(f"packed {how}", lambda: codec.decode_packed(obj, spec), arr, spec, data_edit=touched)


# ---------------------------------------------------------------- (b) mutated SGLang
@FUZZ
@given(cases(), st.data())
def test_mutated_sglang_payloads(case: tuple[np.ndarray, RouteSpec], data: st.DataObject) -> None:
    arr, spec = case
    text = codec.encode_sglang(arr)
    raw = base64.b64decode(text)
    if data.draw(st.booleans()):
        mutated, touched = data.draw(byte_mutation(raw, (0, len(raw))))
        payload = base64.b64encode(mutated).decode()
    else:
        payload = data.draw(text_mutation(text))
        touched = only_inside(b64_bytes(payload), raw, 0, len(raw))
    outcome(
        "sglang",
        lambda: codec.decode_sglang(payload, spec),
        arr.astype(np.int32),
        spec,
        data_edit=touched,
        other_rows_ok=True,  # no length on the wire: whole rows cut or added stay valid
    )


# ---------------------------------------------------------------- (b) mutated Arrow IPC
def ipc_data_range(raw: bytes) -> tuple[int, int]:
    """Where the id bytes (the leaf values buffer of the one record batch) sit in ``raw``."""
    found = ipc_leaf_buffer(raw)
    return (0, 0) if found is None else (found[1], found[2])


def ipc_leaf_buffer(raw: bytes) -> tuple[int, int, int] | None:
    """(where its offset is written, data start, data end) of the leaf buffer, or None."""
    pos = 0
    while pos + 8 <= len(raw):
        assert raw[pos : pos + 4] == b"\xff\xff\xff\xff"
        meta_len = int.from_bytes(raw[pos + 4 : pos + 8], "little")
        meta = raw[pos + 8 : pos + 8 + meta_len]
        if meta_len == 0:
            break
        root = _FlatTable(meta, int.from_bytes(meta[:4], "little"))
        body = pos + 8 + meta_len
        batch = root.table(2)
        if root.scalar(1, 1) == 3 and batch is not None:  # the record batch
            vec = batch.ref(2)
            last = batch._int(vec, 4) - 1
            off = batch._int(vec + 4 + 16 * last, 8, signed=True)
            end = body + off + batch._int(vec + 12 + 16 * last, 8, signed=True)
            return pos + 8 + vec + 4 + 16 * last, body + off, end
        pos = body + root.scalar(3, 8)
    return None  # an empty table is written without a record batch: no id bytes


@IPC_FUZZ
@given(cases(), st.data())
def test_mutated_ipc_streams(case: tuple[np.ndarray, RouteSpec], data: st.DataObject) -> None:
    arr, spec = case
    raw = codec.encode_ipc(arr, spec).to_pybytes()
    lo, hi = ipc_data_range(raw)
    assert raw[lo:hi] == np.ascontiguousarray(arr, spec.dtype).tobytes()
    # the id bytes and the body padding after them (which no reader looks at)
    mutated, edit = data.draw(byte_mutation(raw, (lo, lo + -(-(hi - lo) // 8) * 8)))
    expect = arr.astype(spec.dtype)
    outcome(
        "ipc routes", lambda: codec.decode_ipc_routes(mutated, spec), expect, spec, data_edit=edit
    )
    outcome(
        "ipc routes buffer",
        lambda: codec.decode_ipc_routes(pa.py_buffer(mutated)),
        expect,
        spec,
        data_edit=edit,
        ids_checked=False,
    )
    try:
        table = codec.decode_ipc(mutated, spec)
    except R3ArrowError as exc:
        COUNTS["ipc table: examples"] += 1
        COUNTS[f"ipc table: raised {type(exc).__name__}"] += 1
        return
    if "routes" not in table.column_names:  # decode_ipc reads any table: not an error
        COUNTS["ipc table: decoded a table without 'routes' (renamed column)"] += 1
        return
    col = table.column("routes")
    outcome("ipc table", lambda: routes_to_numpy(col), expect, spec, data_edit=edit)


def test_ipc_buffer_offsets_must_follow_the_writer_layout() -> None:
    """An edited offset could slide the ids over their padding: same shape, shifted ids."""
    arr = np.array([[[1, 2], [3, 4], [5, 6]]], np.uint8)  # 6 id bytes, padded to 8 in the body
    raw = bytearray(codec.encode_ipc(arr, SPEC).to_pybytes())
    found = ipc_leaf_buffer(bytes(raw))
    assert found is not None
    at, lo, hi = found
    assert raw[lo:hi] == arr.tobytes() and raw[at : at + 8] == bytes(8)
    raw[at] = 2
    with pytest.raises(
        PayloadError,
        match=r"buffer 3 at offset 0 \(after the previous buffer, padded\), found offset 2",
    ):
        codec.decode_ipc_routes(bytes(raw))


# ---------------------------------------------------------------- the four known crashers
@pytest.mark.parametrize("dims", [(10**20, 10**20), (2**40, 2**40), (2**13, 2**12 + 1)])
def test_zero_rows_with_huge_layers_and_topk(dims: tuple[int, int]) -> None:
    """No bytes, so no size cap applies: before, numpy's reshape raised ValueError."""
    obj = {"data": "", "shape": [0, *dims], "dtype": "uint8"}
    with pytest.raises(RouteShapeError, match="ids per row"):
        codec.decode_packed(obj)
    header = {"descr": "|u1", "fortran_order": False, "shape": (0, *dims)}
    payload = base64.b64encode(npy_with_text(repr(header), b"")).decode()
    with pytest.raises(RouteShapeError, match="ids per row"):
        codec.decode_vllm(payload)
    ok = codec.decode_packed({"data": "", "shape": [0, 2**12, 2**12], "dtype": "uint8"})
    assert ok.shape == (0, 4096, 4096)


@pytest.mark.parametrize("descr", ["i4,(", "u1,", "u1,u1", "(2,)u1", "i4 ", "<u2\x00", ""])
def test_npy_comma_and_subarray_dtype_strings(descr: str) -> None:
    """Before, numpy's comma-dtype parser raised SyntaxError out of decode_vllm."""
    header = {"descr": descr, "fortran_order": False, "shape": (0, 3, 2)}
    payload = base64.b64encode(npy_with_text(repr(header), b"")).decode()
    with pytest.raises(R3ArrowError, match="expected dtype one of"):
        codec.decode_vllm(payload)


def negative_list_size_streams() -> list[bytes]:
    """Empty [0, 5, 7] streams with L or K patched to -L / -K in the schema flatbuffer."""
    raw = codec.encode_ipc(np.zeros((0, 5, 7), np.uint8)).to_pybytes()
    out = []
    for size in (5, 7):
        needle = size.to_bytes(4, "little")
        at = raw.find(needle)
        while at >= 0:
            forged = raw[:at] + (-size).to_bytes(4, "little", signed=True) + raw[at + 4 :]
            try:
                t = pa.ipc.open_stream(forged).schema.field("routes").type
            except (pa.ArrowException, ValueError, KeyError):
                t = None
            if t is not None and f"[{-size}]" in str(t):
                out.append(forged)
                break
            at = raw.find(needle, at + 1)
    assert len(out) == 2, "could not find the list sizes in the schema"
    return out


@pytest.mark.parametrize("which", [0, 1])
def test_negative_fixed_size_list_in_ipc_schema(which: int) -> None:
    """Arrow reads the schema "fine"; before, np.empty raised on the negative dimension."""
    forged = negative_list_size_streams()[which]
    with pytest.raises(PayloadError, match="list sizes >= 0"):
        codec.decode_ipc_routes(forged)
    with pytest.raises(PayloadError, match="list sizes >= 0"):
        codec.decode_ipc(forged)


def zstd_bomb(batches: int = 64, batch_bytes: int = 8 << 20) -> bytes:
    zeros = np.zeros((batch_bytes // 32, 4, 8), np.uint8)
    batch = pa.record_batch({"routes": numpy_to_routes(zeros)})
    sink = pa.BufferOutputStream()
    opts = pa.ipc.IpcWriteOptions(compression="zstd")
    with pa.ipc.new_stream(sink, batch.schema, options=opts) as writer:
        for _ in range(batches):
            writer.write_batch(batch)
    return bytes(sink.getvalue().to_pybytes())


def test_zstd_bomb_is_refused_under_the_default_cap() -> None:
    """~30 KB declaring 512 MiB: under the 8 GiB default it used to be decompressed."""
    bomb = zstd_bomb()
    assert len(bomb) < 64_000
    before = pa.default_memory_pool().max_memory()
    with pytest.raises(PayloadTooLargeError, match=r"536,870,912 decoded bytes.*max_ratio=64"):
        codec.decode_ipc_routes(bomb)
    with pytest.raises(PayloadTooLargeError, match="max_ratio=64"):
        codec.decode_ipc(bomb)
    with pytest.raises(PayloadTooLargeError, match="max_ratio=2"):
        codec.decode_ipc(bomb, max_ratio=2)
    # max_ratio=None lifts only the ratio: max_bytes still refuses it before decompressing
    with pytest.raises(PayloadTooLargeError, match="max_bytes=536,870,911"):
        codec.decode_ipc(bomb, max_ratio=None, max_bytes=(512 << 20) - 1)
    assert pa.default_memory_pool().max_memory() == before


def test_ratio_floor_lets_small_compressed_streams_through() -> None:
    small = zstd_bomb(batches=2, batch_bytes=1 << 20)  # 2 MiB from a few KB: under the floor
    assert len(small) * codec.DEFAULT_MAX_RATIO < 2 << 20 < RATIO_FLOOR_BYTES
    assert codec.decode_ipc_routes(small).shape == (2 * (1 << 20) // 32, 4, 8)
    with pytest.raises(PayloadTooLargeError, match="max_bytes"):
        codec.decode_ipc_routes(small, max_bytes=1 << 20)


@pytest.mark.parametrize(
    ("ratio", "err"), [(0.5, ValueError), (float("nan"), ValueError), ("64", TypeError)]
)
def test_max_ratio_misuse_is_a_builtin_error(ratio: Any, err: type[Exception]) -> None:
    raw = codec.encode_ipc(np.zeros((1, 3, 2), np.uint8), SPEC).to_pybytes()
    with pytest.raises(err) as info:
        codec.decode_ipc(raw, max_ratio=ratio)
    assert not isinstance(info.value, R3ArrowError)


def test_spec_argument_misuse_is_a_builtin_error() -> None:
    zeros = np.zeros((1, 3, 2), np.uint8)
    bad: Any = "spec"
    calls: list[Callable[[], Any]] = [
        lambda: codec.decode_vllm(codec.encode_vllm(zeros), bad),
        lambda: codec.decode_packed(codec.encode_packed(zeros), bad),
        lambda: codec.decode_ipc_routes(codec.encode_ipc(zeros), bad),
        lambda: codec.decode_ipc(codec.encode_ipc(zeros), bad),
        lambda: codec.encode_packed(zeros, bad),
    ]
    for call in calls:
        with pytest.raises(TypeError, match="RouteSpec or None") as info:
            call()
        assert not isinstance(info.value, R3ArrowError)


def test_library_failures_are_wrapped_with_their_cause(monkeypatch: pytest.MonkeyPatch) -> None:
    """The backstop: an exception no check foresaw leaves as PayloadError, cause attached."""

    def broken(*_: Any, **__: Any) -> Any:
        raise IndexError("simulated library bug")

    monkeypatch.setattr(codec._common, "view_rows", broken)
    with pytest.raises(PayloadError, match="IndexError: simulated library bug") as info:
        codec.decode_packed(codec.encode_packed(np.zeros((1, 3, 2), np.uint8)))
    assert isinstance(info.value.__cause__, IndexError)
    monkeypatch.setattr(codec._common, "view_rows", lambda *_: (_ for _ in ()).throw(MemoryError()))
    with pytest.raises(PayloadTooLargeError, match="out of memory"):
        codec.decode_packed(codec.encode_packed(np.zeros((1, 3, 2), np.uint8)))
