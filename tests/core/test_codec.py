"""Wire codecs: vLLM .npy, SkyRL packed, SGLang raw int32, Arrow IPC."""

from __future__ import annotations

import base64
import io
import time
import tracemalloc
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from r3arrow import codec
from r3arrow.codec._ipc import IPC_ROWS_METADATA_KEY
from r3arrow.codec._packed import packed_dtype_for
from r3arrow.errors import (
    ExpertRangeError,
    PayloadError,
    PayloadTooLargeError,
    R3ArrowError,
    RouteDTypeError,
    RouteShapeError,
)
from r3arrow.spec import SPEC_METADATA_KEY, RouteSpec, numpy_to_routes

SPEC = RouteSpec(num_layers=3, topk=2, num_experts=16)
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def vllm_payload(arr: np.ndarray) -> bytes:
    """Exactly what vLLM's HTTP layer puts in ``choices[i].routed_experts``."""
    buf = io.BytesIO()
    np.save(buf, arr)
    return base64.b64encode(buf.getvalue())


def npy_with_header(
    header: dict[str, Any] | str, data: bytes = b"", version: tuple[int, int] = (1, 0)
) -> str:
    """A hand-built .npy file (any header text, padded like numpy's) then ``data``, as base64."""
    text = (header if isinstance(header, str) else repr(header)).encode("utf8")
    width = 2 if version == (1, 0) else 4
    text += b" " * (-(8 + width + len(text) + 1) % 64) + b"\n"
    raw = b"\x93NUMPY" + bytes(version) + len(text).to_bytes(width, "little") + text + data
    return base64.b64encode(raw).decode()


def ipc_bytes(table: pa.Table, **opts: Any) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema, options=pa.ipc.IpcWriteOptions(**opts)) as w:
        w.write_table(table)
    return bytes(sink.getvalue().to_pybytes())


# ------------------------------------------------------------------------ vLLM
def test_vllm_literal_payload_as_vllm_sends_it() -> None:
    arr = np.array([[[1, 2], [0, 0], [15, 3]], [[4, 5], [0, 0], [6, 7]]], dtype=np.uint8)
    spec = RouteSpec(3, 2, 16, moe_layers=(0, 2))
    payload = vllm_payload(arr)
    for form in (payload, payload.decode()):
        out = codec.decode_vllm(form, spec)
        assert out.dtype == np.uint8 and out.shape == (2, 3, 2)
        assert out.tolist() == arr.tolist()
    assert out.flags.writeable  # a view on a private buffer, not the caller's string


def test_vllm_uint16_for_more_than_256_experts() -> None:
    spec = RouteSpec(2, 2, 300)
    arr = np.array([[[299, 256], [0, 1]]], dtype=np.uint16)
    out = codec.decode_vllm(vllm_payload(arr).decode(), spec)
    assert out.dtype == np.uint16 and out.tolist() == [[[299, 256], [0, 1]]]


def test_vllm_big_endian_payload_is_byteswapped() -> None:
    arr = np.array([[[258, 3]]], dtype=">u2")
    out = codec.decode_vllm(vllm_payload(arr), RouteSpec(1, 2, 300))
    assert out.dtype == np.dtype("uint16") and out.dtype.isnative
    assert out.tolist() == [[[258, 3]]]


@pytest.mark.parametrize("version", [(1, 0), (2, 0), (3, 0)])
def test_vllm_all_npy_versions(version: tuple[int, int]) -> None:
    arr = np.arange(12, dtype=np.int32).reshape(2, 3, 2)
    header = {"descr": "<i4", "fortran_order": False, "shape": (2, 3, 2)}
    out = codec.decode_vllm(npy_with_header(header, arr.tobytes(), version))
    assert out.tolist() == arr.tolist()


def test_encode_vllm_is_a_plain_npy_file() -> None:
    arr = np.array([[[1, 2], [3, 4], [5, 6]]], dtype=np.uint16)
    raw = base64.b64decode(codec.encode_vllm(arr), validate=True)
    back = np.load(io.BytesIO(raw), allow_pickle=False)
    assert back.dtype == np.uint16 and back.tolist() == arr.tolist()


def test_vllm_header_claiming_a_terabyte_fails_fast_without_allocating() -> None:
    payload = npy_with_header(
        {"descr": "|u1", "fortran_order": False, "shape": (10**6, 10**3, 10**3)}
    )
    assert len(payload) < 200
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        with pytest.raises(PayloadTooLargeError, match="1,000,000,000,000 bytes"):
            codec.decode_vllm(payload)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - t0 < 1.0
    assert peak < 1 << 20


def test_vllm_max_bytes_is_per_call() -> None:
    payload = vllm_payload(np.zeros((100, 3, 2), np.uint8))
    assert codec.decode_vllm(payload, max_bytes=600).shape == (100, 3, 2)
    with pytest.raises(PayloadTooLargeError, match="max_bytes=599"):
        codec.decode_vllm(payload, max_bytes=599)


def test_vllm_declared_shape_must_match_byte_count() -> None:
    good = np.zeros((4, 3, 2), np.uint8)
    header = {"descr": "|u1", "fortran_order": False, "shape": (5, 3, 2)}
    with pytest.raises(
        PayloadError, match=r"expects 158 bytes \(128 header \+ 30 data\), found 152"
    ):
        codec.decode_vllm(npy_with_header(header, good.tobytes()))
    header["shape"] = (3, 3, 2)  # trailing bytes are as wrong as missing ones
    with pytest.raises(PayloadError, match="found 152"):
        codec.decode_vllm(npy_with_header(header, good.tobytes()))


@pytest.mark.parametrize(
    ("payload", "match"),
    [
        ("not base64!", "invalid base64"),
        ("QUJD" * 3 + "QUJ", "multiple of 4"),
        ("QUJDQUJD\nQUJD", "invalid base64"),
        ("", "expected an .npy payload"),
        (base64.b64encode(b"PK\x03\x04 a zip file, not npy").decode(), "expected an .npy payload"),
        (base64.b64encode(b"\x93NUMPY\x09\x00\x10\x00").decode(), "version"),
    ],
)
def test_vllm_malformed_payloads(payload: str, match: str) -> None:
    with pytest.raises(PayloadError, match=match):
        codec.decode_vllm(payload)


@pytest.mark.parametrize("descr", ["<f4", "<i8", "|i1", "|b1", "<u4", "|O", "<U3", "|V2"])
def test_vllm_rejects_dtypes(descr: str) -> None:
    header = {"descr": descr, "fortran_order": False, "shape": (0, 3, 2)}
    with pytest.raises(
        RouteDTypeError, match=r"expected dtype one of \['uint8', 'uint16', 'int16', 'int32'\]"
    ):
        codec.decode_vllm(npy_with_header(header))


def test_vllm_never_unpickles_object_arrays() -> None:
    buf = io.BytesIO()
    np.save(buf, np.array([[[1, 2]]], dtype=object), allow_pickle=True)
    with pytest.raises(RouteDTypeError, match="found object"):
        codec.decode_vllm(base64.b64encode(buf.getvalue()))


def test_vllm_rejects_structured_and_fortran() -> None:
    structured = {"descr": [("a", "|u1")], "fortran_order": False, "shape": (1, 1, 1)}
    with pytest.raises(RouteDTypeError, match="plain integer dtype"):
        codec.decode_vllm(npy_with_header(structured, b"\x00"))
    fortran = {"descr": "|u1", "fortran_order": True, "shape": (1, 1, 1)}
    with pytest.raises(PayloadError, match="fortran_order False"):
        codec.decode_vllm(npy_with_header(fortran, b"\x00"))


def test_vllm_rejects_header_code_and_extra_keys() -> None:
    text = "{'descr': __import__('os').getcwd(), 'fortran_order': False, 'shape': (1, 1, 1)}"
    with pytest.raises(PayloadError, match=r"unreadable \.npy header"):
        codec.decode_vllm(npy_with_header(text, b"\x00"))
    with pytest.raises(PayloadError, match=r"unreadable \.npy header"):
        codec.decode_vllm(npy_with_header("{'descr': '|u1', " + "(" * 5000, b"\x00"))
    extra = {"descr": "|u1", "fortran_order": False, "shape": (1, 1, 1), "x": 1}
    with pytest.raises(PayloadError, match="header keys"):
        codec.decode_vllm(npy_with_header(extra, b"\x00"))


@pytest.mark.parametrize(
    ("shape", "err", "match"),
    [
        ((6, 2), RouteShapeError, "3-D shape"),
        ((1, 2, 3, 1), RouteShapeError, "3-D shape"),
        ((3, 0, 2), RouteShapeError, "L >= 1"),
        ((-1, 3, 2), PayloadError, "non-negative int"),
        ((1.5, 3, 2), PayloadError, "non-negative int"),
    ],
)
def test_vllm_bad_shapes(shape: tuple[Any, ...], err: type[Exception], match: str) -> None:
    with pytest.raises(err, match=match):
        codec.decode_vllm(npy_with_header({"descr": "|u1", "fortran_order": False, "shape": shape}))


def test_vllm_spec_checks_shape_and_ids_on_router_layers_only() -> None:
    spec = RouteSpec(3, 2, 16, moe_layers=(1,))
    ok = np.array([[[200, 255], [3, 4], [99, 0]]], dtype=np.uint8)  # dense layers: not ids
    assert codec.decode_vllm(vllm_payload(ok), spec).tolist() == ok.tolist()
    bad = ok.copy()
    bad[0, 1, 1] = 16
    with pytest.raises(ExpertRangeError, match="num_experts=16, found 16"):
        codec.decode_vllm(vllm_payload(bad), spec)
    with pytest.raises(RouteShapeError, match=r"expected \[rows, 3, 2\], found \[1, 3, 1\]"):
        codec.decode_vllm(vllm_payload(ok[:, :, :1]), spec)
    neg = np.array([[[0, 1], [-1, 2], [0, 0]]], dtype=np.int16)
    with pytest.raises(ExpertRangeError, match=">= 0"):
        codec.decode_vllm(vllm_payload(neg), spec)


# ------------------------------------------------------------------------ SkyRL packed
def test_packed_literal() -> None:
    obj = {
        "data": base64.b64encode(bytes([1, 2, 3, 4, 5, 6])).decode(),
        "shape": [1, 3, 2],
        "dtype": "uint8",
    }
    assert codec.decode_packed(obj, SPEC).tolist() == [[[1, 2], [3, 4], [5, 6]]]
    le16 = b"".join(int(v).to_bytes(2, "little", signed=True) for v in (258, 7))
    obj16 = {"data": base64.b64encode(le16).decode(), "shape": [1, 1, 2], "dtype": "int16"}
    out = codec.decode_packed(obj16)
    assert out.dtype == np.int16 and out.tolist() == [[[258, 7]]]


def test_encode_packed_matches_skyrl_layout() -> None:
    arr = np.array([[[1, 300]]], dtype=np.int16)
    obj = codec.encode_packed(arr)
    assert obj["shape"] == [1, 1, 2] and obj["dtype"] == "int16"
    assert base64.b64decode(obj["data"]) == arr.astype("<i2").tobytes()


@pytest.mark.parametrize(
    ("top", "name"),
    [(0, "uint8"), (255, "uint8"), (256, "int16"), (32767, "int16"), (32768, "int32")],
)
@pytest.mark.parametrize("dtype", ["uint16", "int32", "int64", "uint64"])
def test_encode_packed_emits_the_narrowest_skyrl_dtype(top: int, name: str, dtype: str) -> None:
    arr = np.array([[[0, top]], [[1, 2]]], dtype=dtype)
    obj = codec.encode_packed(arr)
    assert obj["dtype"] == name and obj["shape"] == [2, 1, 2]
    # SkyRL's reader: np.frombuffer(raw, np.dtype(name)).reshape(shape)
    back = np.frombuffer(base64.b64decode(obj["data"]), np.dtype(name)).reshape(obj["shape"])
    assert back.tolist() == arr.tolist()
    assert codec.decode_packed(obj).tolist() == arr.tolist()


def test_encode_packed_refuses_ids_that_would_wrap() -> None:
    with pytest.raises(ExpertRangeError, match=r"found -1 \(token 1, layer 0"):
        codec.encode_packed(np.array([[[0, 1]], [[-1, 2]]], np.int64))
    with pytest.raises(ExpertRangeError, match="found 2147483648"):
        codec.encode_packed(np.array([[[0, 2**31]]], np.int64))
    with pytest.raises(ExpertRangeError, match="found 16"):
        codec.encode_packed(np.full((1, 3, 2), 16, np.int64), SPEC)
    with pytest.raises(RouteShapeError, match=r"expected \[rows, 3, 2\]"):
        codec.encode_packed(np.zeros((1, 2, 2), np.int64), SPEC)
    with pytest.raises(RouteDTypeError):
        codec.encode_packed(np.zeros((1, 3, 2), np.float32))
    with pytest.raises(TypeError, match="RouteSpec or None"):
        codec.encode_packed(np.zeros((1, 3, 2), np.uint8), "spec")  # type: ignore[arg-type]


def test_encode_packed_accepts_torch_tensors() -> None:
    torch = pytest.importorskip("torch")
    t = torch.tensor([[[3, 300], [0, 1], [2, 5]]], dtype=torch.int64)
    obj = codec.encode_packed(t)
    assert obj["dtype"] == "int16" and codec.decode_packed(obj).tolist() == t.tolist()
    obj8 = codec.encode_packed(t.clamp(max=15).to(torch.int32), SPEC)  # a non-contiguous source
    assert obj8["dtype"] == "uint8"
    assert codec.decode_packed(obj8, SPEC).tolist() == t.clamp(max=15).tolist()
    if torch.cuda.is_available():  # pragma: no cover - CPU CI
        assert codec.encode_packed(t.cuda()) == obj


def test_decode_packed_accepts_every_skyrl_dtype() -> None:
    arr = np.array([[[1, 7]]])
    for name in ("uint8", "int16", "int32"):
        raw = arr.astype(np.dtype(name).newbyteorder("<")).tobytes()
        obj = {"data": base64.b64encode(raw).decode(), "shape": [1, 1, 2], "dtype": name}
        out = codec.decode_packed(obj)
        assert out.dtype == np.dtype(name) and out.tolist() == [[[1, 7]]]


@pytest.mark.parametrize(
    ("mutate", "err", "match"),
    [
        (lambda o: o.pop("dtype"), PayloadError, "expected keys"),
        (lambda o: o.update(extra=1), PayloadError, "expected keys"),
        (lambda o: o.update(dtype="float32"), RouteDTypeError, "found 'float32'"),
        (lambda o: o.update(dtype="int64"), RouteDTypeError, "found 'int64'"),
        (lambda o: o.update(dtype=None), RouteDTypeError, "found None"),
        (lambda o: o.update(shape="2,3,2"), PayloadError, "list of 3 ints"),
        (lambda o: o.update(shape=[2, 3, -2]), PayloadError, "non-negative"),
        (lambda o: o.update(shape=[2, True, 2]), PayloadError, "non-negative int"),
        (lambda o: o.update(shape=[12]), RouteShapeError, "3-D"),
        (lambda o: o.update(shape=[3, 3, 2]), PayloadError, "expects 18 bytes, found 12"),
        (lambda o: o.update(shape=[1, 3, 2]), PayloadError, "expects 6 bytes, found 12"),
        (lambda o: o.update(dtype="int16"), PayloadError, "expects 24 bytes, found 12"),
        (lambda o: o.update(dtype="uint16"), RouteDTypeError, "found 'uint16'"),
        (lambda o: o.update(data=o["data"][:-4]), PayloadError, "found 9"),
        (lambda o: o.update(data=o["data"][:-1]), PayloadError, "multiple of 4"),
        (lambda o: o.update(data="@" + o["data"][1:]), PayloadError, "invalid base64"),
        (lambda o: o.update(data=12), PayloadError, "base64 str or bytes"),
        (lambda o: o.update(shape=[10**6, 10**3, 10**3]), PayloadTooLargeError, "max_bytes"),
        (lambda o: o.update(shape=[2, 3, 1]), PayloadError, "expects 6 bytes"),
    ],
)
def test_packed_errors(mutate: Any, err: type[Exception], match: str) -> None:
    obj = codec.encode_packed(np.zeros((2, 3, 2), np.uint8))
    mutate(obj)
    with pytest.raises(err, match=match):
        codec.decode_packed(obj)


def test_packed_spec_checks() -> None:
    with pytest.raises(RouteShapeError):
        codec.decode_packed(codec.encode_packed(np.zeros((2, 2, 3), np.uint8)), SPEC)
    with pytest.raises(ExpertRangeError):
        codec.decode_packed(codec.encode_packed(np.full((2, 3, 2), 16, np.uint8)), SPEC)
    with pytest.raises(PayloadError, match="dict"):
        codec.decode_packed([1, 2, 3])  # type: ignore[arg-type]


# ------------------------------------------------------------------------ SGLang
def test_sglang_literal() -> None:
    raw = np.array([5, 6, 7, 8, 0, 1, 9, 10, 11, 12, 2, 3], dtype="<i4").tobytes()
    out = codec.decode_sglang(base64.b64encode(raw).decode(), SPEC)
    assert out.dtype == np.int32 and out.shape == (2, 3, 2)
    assert out[1].tolist() == [[9, 10], [11, 12], [2, 3]]


def test_sglang_errors() -> None:
    raw = np.zeros(7, dtype="<i4").tobytes()
    with pytest.raises(PayloadError, match=r"multiple of 24 bytes .* found 28 bytes"):
        codec.decode_sglang(base64.b64encode(raw), SPEC)
    with pytest.raises(ExpertRangeError):
        codec.decode_sglang(codec.encode_sglang(np.full((1, 3, 2), -1, np.int32)), SPEC)
    with pytest.raises(PayloadTooLargeError):
        codec.decode_sglang(codec.encode_sglang(np.zeros((2, 3, 2), np.int32)), SPEC, max_bytes=47)
    with pytest.raises(TypeError, match="RouteSpec"):
        codec.decode_sglang("", None)  # type: ignore[arg-type]
    with pytest.raises(RouteDTypeError, match="fit int32"):
        codec.encode_sglang(np.full((1, 1, 1), 2**40, np.int64))


# ------------------------------------------------------------------------ Arrow IPC
def test_ipc_routes_are_zero_copy_views_on_the_input() -> None:
    arr = np.random.default_rng(0).integers(0, 16, size=(64, 3, 2), dtype=np.uint8)
    buf = codec.encode_ipc(arr, SPEC)
    assert isinstance(buf, pa.Buffer)
    raw = buf.to_pybytes()
    out = codec.decode_ipc_routes(raw, SPEC)
    assert np.array_equal(out, arr) and out.dtype == np.uint8
    assert np.shares_memory(out, np.frombuffer(raw, np.uint8))
    assert not out.flags.writeable
    out2 = codec.decode_ipc_routes(buf)  # a pa.Buffer works too, spec comes from metadata
    lo, hi = buf.address, buf.address + buf.size
    assert lo <= out2.__array_interface__["data"][0] < hi


def test_ipc_stream_layout() -> None:
    arr = np.arange(12, dtype=np.uint8).reshape(2, 3, 2)
    table = codec.decode_ipc(codec.encode_ipc(arr, SPEC))
    assert table.column_names == ["routes"]
    assert table.schema.field("routes").type == SPEC.arrow_type
    sent = RouteSpec.from_schema(table.schema)
    assert sent.same_shape(SPEC) and sent.num_experts == 16 and sent.dtype == np.dtype(np.uint8)
    assert IPC_ROWS_METADATA_KEY not in table.schema.metadata
    assert table.column("routes").to_pylist()[1] == [[6, 7], [8, 9], [10, 11]]


def test_ipc_inputs_arrow_array_table_batch() -> None:
    arr = np.arange(12, dtype=np.uint8).reshape(2, 3, 2)
    routes = numpy_to_routes(arr, SPEC)
    assert np.array_equal(codec.decode_ipc_routes(codec.encode_ipc(routes, SPEC)), arr)
    table = pa.table({"trajectory_id": pa.array(["a", "b"], pa.large_string()), "routes": routes})
    back = codec.decode_ipc(codec.encode_ipc(table, SPEC), SPEC)
    assert back.equals(table) and back.schema.metadata[SPEC_METADATA_KEY] == SPEC.to_json()
    batch = table.to_batches()[0]
    assert codec.decode_ipc(codec.encode_ipc(batch)).equals(table)


def test_ipc_spec_inference_and_widening() -> None:
    arr = np.array([[[1, 300]]], dtype=np.int64)
    out = codec.decode_ipc_routes(codec.encode_ipc(arr))
    assert out.dtype == np.uint16 and out.tolist() == [[[1, 300]]]
    spec = RouteSpec(1, 2, None)  # unknown expert count: storage widens for the ids seen
    assert codec.decode_ipc_routes(codec.encode_ipc(arr, spec), spec).tolist() == [[[1, 300]]]
    with pytest.raises(ExpertRangeError):
        codec.encode_ipc(-arr)
    dense_junk = np.array(
        [[[1, 2], [300, 0]]], dtype=np.uint16
    )  # layer 1 is dense: not checked as ids
    with pytest.raises(
        ExpertRangeError, match=r"<= 255 \(storage uint8\).* found 300 \(token 0, layer 1"
    ):
        codec.encode_ipc(dense_junk, RouteSpec(2, 2, 16, moe_layers=(0,)))
    zeros = dense_junk.copy()
    zeros[0, 1] = 0
    out = codec.decode_ipc_routes(codec.encode_ipc(zeros, RouteSpec(2, 2, 16, moe_layers=(0,))))
    assert out.dtype == np.uint8 and out.tolist() == zeros.tolist()


def test_ipc_spec_mismatch_and_ids() -> None:
    buf = codec.encode_ipc(np.zeros((2, 3, 2), np.uint8), SPEC)
    with pytest.raises(RouteShapeError):
        codec.decode_ipc_routes(buf, RouteSpec(3, 1, 16))
    tokens = numpy_to_routes(np.full((1, 3, 2), 20, np.uint8))
    table = pa.table({"routes": tokens})
    with pytest.raises(ExpertRangeError, match="num_experts=16, found 20"):
        codec.decode_ipc(ipc_bytes(table), SPEC)
    rollout = pa.table(
        {"routes": pa.LargeListArray.from_arrays(pa.array([0, 1], type=pa.int64()), tokens)}
    )
    with pytest.raises(ExpertRangeError):
        codec.decode_ipc(ipc_bytes(rollout), SPEC)
    with pytest.raises(PayloadError, match="expected one 'routes' column"):
        codec.decode_ipc_routes(ipc_bytes(pa.table({"x": [1]})))


def test_ipc_garbage_truncation_and_limits() -> None:
    buf = codec.encode_ipc(np.ones((4, 3, 2), np.uint8), SPEC).to_pybytes()
    for junk in (b"", b"\x00" * 16, b"hello world, not arrow at all", buf[::-1]):
        with pytest.raises(PayloadError, match="Arrow IPC"):
            codec.decode_ipc(junk)
    for cut in range(len(buf) - 8):  # the last 8 bytes are the optional end-of-stream marker
        with pytest.raises(PayloadError):
            codec.decode_ipc_routes(buf[:cut])
    assert np.array_equal(codec.decode_ipc_routes(buf[: len(buf) - 8]), np.ones((4, 3, 2)))
    with pytest.raises(PayloadTooLargeError):
        codec.decode_ipc(buf, max_bytes=len(buf) - 1)
    with pytest.raises(PayloadError, match=r"pyarrow\.Buffer"):
        codec.decode_ipc("a string")


def test_ipc_compressed_bomb_is_bounded_before_decompressing() -> None:
    table = pa.table({"routes": numpy_to_routes(np.zeros((50_000, 3, 2), np.uint8))})
    raw = ipc_bytes(table, compression="lz4")
    assert np.array_equal(codec.decode_ipc_routes(raw), np.zeros((50_000, 3, 2)))
    with pytest.raises(PayloadTooLargeError, match="declare 300,000 decoded bytes"):
        codec.decode_ipc(raw, max_bytes=299_999)
    size = (300_000).to_bytes(8, "little")
    at = raw.rfind(size)  # the last buffer's own uncompressed-length prefix
    forged = raw[:at] + (10**12).to_bytes(8, "little") + raw[at + 8 :]
    before = pa.default_memory_pool().max_memory()
    with pytest.raises(PayloadTooLargeError, match="1,000,000,"):
        codec.decode_ipc(forged)
    assert pa.default_memory_pool().max_memory() == before


def test_ipc_trailing_bytes_after_end_of_stream_are_refused() -> None:
    buf = codec.encode_ipc(np.ones((2, 3, 2), np.uint8), SPEC).to_pybytes()
    assert buf.endswith(b"\xff\xff\xff\xff\x00\x00\x00\x00")
    for tail in (b"\x00", b"junk", buf):  # a second stream concatenated is refused too
        with pytest.raises(PayloadError, match="more bytes after it"):
            codec.decode_ipc_routes(buf + tail)


def test_ipc_id_type_must_match_the_metadata_spec() -> None:
    table = pa.table({"routes": numpy_to_routes(np.ones((2, 3, 2), np.uint16))})
    forged = table.replace_schema_metadata(SPEC.to_metadata())  # SPEC stores uint8
    with pytest.raises(RouteDTypeError, match="metadata spec says ids of uint8, found uint16"):
        codec.decode_ipc_routes(ipc_bytes(forged))


def test_ipc_spec_check_covers_streams_without_batches() -> None:
    empty = pa.table({"routes": pa.array([], RouteSpec(2, 2, 16).arrow_type)})
    with pytest.raises(RouteShapeError, match=r"expected routes \[rows, 3, 2\]"):
        codec.decode_ipc(ipc_bytes(empty), SPEC)


# ------------------------------------------------------------------------ empties
@pytest.mark.parametrize("dtype", ["uint8", "uint16", "int16", "int32"])
def test_empty_round_trips(dtype: str) -> None:
    empty = np.zeros((0, 3, 2), dtype)
    assert codec.decode_vllm(codec.encode_vllm(empty), SPEC).shape == (0, 3, 2)
    assert codec.decode_packed(codec.encode_packed(empty), SPEC).shape == (0, 3, 2)
    assert codec.decode_sglang(codec.encode_sglang(empty), SPEC).shape == (0, 3, 2)
    out = codec.decode_ipc_routes(codec.encode_ipc(empty, SPEC), SPEC)
    assert out.shape == (0, 3, 2) and out.dtype == SPEC.dtype


# ------------------------------------------------------------------------ properties
DTYPES = st.sampled_from(["uint8", "uint16", "int16", "int32"])


@st.composite
def routes_and_spec(
    draw: st.DrawFn, dtypes: st.SearchStrategy[str] = DTYPES
) -> tuple[np.ndarray, RouteSpec]:
    rows, layers, topk = draw(st.integers(0, 50)), draw(st.integers(1, 6)), draw(st.integers(1, 4))
    dtype = np.dtype(draw(dtypes))
    hi = min(int(np.iinfo(dtype).max) + 1, 70_000)
    experts = draw(st.integers(topk, hi))
    arr = draw(hnp.arrays(dtype, (rows, layers, topk), elements=st.integers(0, experts - 1)))
    return arr, RouteSpec(layers, topk, experts)


@FAST
@given(routes_and_spec())
def test_round_trip_every_codec(case: tuple[np.ndarray, RouteSpec]) -> None:
    arr, spec = case
    v = codec.decode_vllm(codec.encode_vllm(arr), spec)
    p = codec.decode_packed(codec.encode_packed(arr), spec)
    s = codec.decode_sglang(codec.encode_sglang(arr), spec)
    i = codec.decode_ipc_routes(codec.encode_ipc(arr, spec), spec)
    assert v.dtype == arr.dtype and s.dtype == np.int32
    # packed narrows to SkyRL's dtype for the largest id (never uint16)
    assert p.dtype == packed_dtype_for(int(arr.max(initial=0)))
    assert i.dtype == spec.dtype
    for out in (v, p, s, i):
        assert out.shape == arr.shape and np.array_equal(out, arr)


@FAST
@given(st.one_of(st.binary(max_size=300), st.text(max_size=300)), st.booleans())
def test_random_input_raises_r3arrow_errors_only(junk: bytes | str, b64: bool) -> None:
    payload: bytes | str = (
        base64.b64encode(junk.encode() if isinstance(junk, str) else junk) if b64 else junk
    )
    for decode in (
        lambda: codec.decode_vllm(payload, SPEC),
        lambda: codec.decode_packed({"data": payload, "shape": [1, 3, 2], "dtype": "uint8"}, SPEC),
        lambda: codec.decode_ipc(payload.encode() if isinstance(payload, str) else payload, SPEC),
    ):
        with pytest.raises(R3ArrowError):
            decode()
    try:  # SGLang payloads carry no length: a valid multiple of the row size is valid data
        out = codec.decode_sglang(payload, SPEC)
    except R3ArrowError:
        return
    assert out.shape[1:] == (3, 2) and out.min(initial=0) >= 0 and out.max(initial=0) < 16


@FAST
@given(routes_and_spec(), st.data())
def test_truncated_payloads_are_rejected(
    case: tuple[np.ndarray, RouteSpec], data: st.DataObject
) -> None:
    arr, spec = case
    v = codec.encode_vllm(arr)
    cut = data.draw(st.integers(0, len(v) - 1))
    with pytest.raises(R3ArrowError):
        codec.decode_vllm(v[:cut], spec)
    p = codec.encode_packed(arr)
    assume(p["data"])
    p["data"] = p["data"][: data.draw(st.integers(0, len(p["data"]) - 1))]
    with pytest.raises(R3ArrowError):
        codec.decode_packed(p, spec)
    ipc = codec.encode_ipc(arr, spec).to_pybytes()
    with pytest.raises(R3ArrowError):
        codec.decode_ipc_routes(ipc[: data.draw(st.integers(0, len(ipc) - 9))], spec)


@FAST
@given(routes_and_spec(st.sampled_from(["uint8", "uint16", "int16"])), st.data())
def test_corrupted_npy_header_never_yields_other_values(
    case: tuple[np.ndarray, RouteSpec], data: st.DataObject
) -> None:
    arr, _ = case
    spec = RouteSpec(
        arr.shape[1], arr.shape[2], min(128, max(arr.shape[2], int(arr.max(initial=0)) + 1))
    )
    assume(int(arr.max(initial=0)) < 128)
    raw = bytearray(base64.b64decode(codec.encode_vllm(arr)))
    hlen = 10 + int.from_bytes(raw[8:10], "little")
    pos = data.draw(st.integers(0, hlen - 1))
    raw[pos] = data.draw(st.integers(0, 255).filter(lambda b: b != raw[pos]))
    try:
        out = codec.decode_vllm(base64.b64encode(bytes(raw)), spec)
    except R3ArrowError:
        return
    assert out.shape == arr.shape and np.array_equal(out, arr)


@FAST
@given(routes_and_spec(), st.lists(st.integers(-3, 10**13), min_size=0, max_size=5))
def test_mutated_packed_shape_is_rejected_or_identical(
    case: tuple[np.ndarray, RouteSpec], shape: list[int]
) -> None:
    arr, spec = case
    obj = codec.encode_packed(arr)
    obj["shape"] = shape
    try:
        out = codec.decode_packed(obj, spec)
    except R3ArrowError:
        return
    assert list(out.shape) == list(arr.shape) and np.array_equal(out, arr)


@settings(max_examples=150, deadline=None)
@given(routes_and_spec(st.sampled_from(["uint8", "uint16", "int32"])), st.data())
def test_mutated_ipc_stream_raises_or_decodes_valid_routes(
    case: tuple[np.ndarray, RouteSpec], data: st.DataObject
) -> None:
    arr, spec = case
    raw = bytearray(codec.encode_ipc(arr, spec).to_pybytes())
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(raw) - 1))
        raw[pos] = data.draw(st.integers(0, 255))
    try:
        out = codec.decode_ipc_routes(bytes(raw), spec)
    except R3ArrowError:
        return
    # Body bytes carry no checksum: a flipped id can decode, but only as a well-formed,
    # in-range route array of the declared shape.
    assert out.shape == arr.shape
    if out.size:
        assert spec.num_experts is not None
        assert out.min() >= 0 and out.max() < spec.num_experts


def test_stdlib_base64_fallback_is_equivalent(monkeypatch: pytest.MonkeyPatch) -> None:
    arr = (np.arange(24, dtype=np.uint16) % 16).reshape(4, 3, 2)
    fast = (codec.encode_vllm(arr), codec.encode_packed(arr), codec.encode_sglang(arr))
    monkeypatch.setattr(codec._base64, "_pybase64", None)  # the backend lives in codec._base64
    assert (codec.encode_vllm(arr), codec.encode_packed(arr), codec.encode_sglang(arr)) == fast
    assert np.array_equal(codec.decode_vllm(fast[0], SPEC), arr)
    assert codec.decode_vllm(fast[0]).flags.writeable
    assert np.array_equal(codec.decode_sglang(fast[2], SPEC), arr)
    with pytest.raises(PayloadError, match="invalid base64"):
        codec.decode_packed({**fast[1], "data": "*" + fast[1]["data"][1:]})
