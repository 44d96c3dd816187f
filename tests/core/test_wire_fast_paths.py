"""The capture path's fast paths give what the general code gives.

* ``.npy`` headers as ``np.save`` writes them are read by a match (`_np_save_header`), every
  other header by the general parser; for any array ``np.save`` writes, the two agree, and a
  header the match refuses still meets the general parser's errors.
* ``check_routes(..., exact=False)`` on uint8 top-8 ids of a power-of-two expert count takes
  the range from the kernel's OR of the ids: ids at and past the bound still raise.
"""

from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from r3arrow import codec
from r3arrow.codec import _npy
from r3arrow.errors import DuplicateExpertError, ExpertRangeError, PayloadError, R3ArrowError
from r3arrow.ids import check_routes
from r3arrow.spec import RouteSpec

FAST = settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def np_save_b64(arr: np.ndarray) -> str:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode()


def header_b64(text: str, data: bytes = b"") -> str:
    """A version 1.0 ``.npy`` with header ``text`` padded as numpy pads it, then ``data``."""
    raw = text.encode("latin1")
    raw += b" " * (-(10 + len(raw) + 1) % 64) + b"\n"
    return base64.b64encode(
        b"\x93NUMPY\x01\x00" + len(raw).to_bytes(2, "little") + raw + data
    ).decode()


@FAST
@given(
    dtype=st.sampled_from(["|u1", "<u2", ">u2", "<i2", ">i4", "<i4"]),
    rows=st.integers(0, 3000),
    layers=st.integers(1, 64),
    topk=st.integers(1, 9),
)
def test_np_save_headers_read_by_match_as_by_the_general_parser(
    dtype: str, rows: int, layers: int, topk: int
) -> None:
    arr = np.zeros((rows, layers, topk), dtype=dtype)
    s = np_save_b64(arr)
    general = _npy._read_npy_header(s, "t")  # also lets the match know the dtype
    assert _npy._np_save_header(s) == general
    out = codec.decode_vllm(s)
    assert out.shape == arr.shape and out.dtype == arr.dtype.newbyteorder("=")


def test_np_save_payload_decodes_to_np_load_values() -> None:
    rng = np.random.default_rng(0)
    arr = rng.integers(0, 300, (5, 4, 3)).astype("<u2")
    s = np_save_b64(arr)
    for _ in range(2):  # first by the general parser, then by the match
        assert codec.decode_vllm(s).tolist() == arr.tolist()
    assert _npy._np_save_header(s) is not None


@pytest.mark.parametrize(
    ("text", "match"),
    [
        # literal_eval refuses leading zeros: so must the match
        ("{'descr': '|u1', 'fortran_order': False, 'shape': (02, 3, 2), }", "unreadable"),
        ("{'descr': '|u1', 'fortran_order': True, 'shape': (1, 3, 2), }", "fortran_order False"),
        ("{'descr': '<f4', 'fortran_order': False, 'shape': (0, 3, 2), }", "dtype one of"),
        ("{'descr': '|u1', 'fortran_order': False, 'shape': (1, 0, 2), }", "L >= 1"),
    ],
)
def test_headers_the_match_refuses_meet_the_general_errors(text: str, match: str) -> None:
    codec.decode_vllm(np_save_b64(np.zeros((1, 3, 2), np.uint8)))  # '|u1' known to the match
    s = header_b64(text, b"\x00" * 6)
    assert _npy._np_save_header(s) is None
    with pytest.raises(R3ArrowError, match=match):
        codec.decode_vllm(s)


def test_np_save_header_with_a_wrong_data_size_still_raises() -> None:
    s = np_save_b64(np.zeros((4, 3, 2), np.uint8))
    codec.decode_vllm(s)
    raw = base64.b64decode(s)[:-6]  # one row short
    with pytest.raises(PayloadError, match="expects"):
        codec.decode_vllm(base64.b64encode(raw).decode())


@pytest.mark.parametrize("experts", [64, 128, 256, 100])
def test_uint8_top8_range_at_the_bound(experts: int) -> None:
    spec = RouteSpec(num_layers=3, topk=8, num_experts=experts)
    rows = np.tile(np.arange(8, dtype=np.uint8), (40, 3, 1))
    rows[:, :, 0] = experts - 8  # distinct ids, the largest experts - 1
    rows[:, :, 7] = experts - 1
    hi = check_routes(rows, spec, exact=False)[1]
    assert experts - 1 <= hi < experts
    if experts < 256:
        bad = rows.copy()
        bad[17, 2, 3] = experts  # one past the bound
        with pytest.raises(ExpertRangeError) as info:
            check_routes(bad, spec, exact=False)
        assert (info.value.token, info.value.layer) == (17, 2)
    dup = rows.copy()
    dup[5, 1, 4] = dup[5, 1, 6]
    with pytest.raises(DuplicateExpertError) as dinfo:
        check_routes(dup, spec, exact=False)
    assert (dinfo.value.token, dinfo.value.layer) == (5, 1)
