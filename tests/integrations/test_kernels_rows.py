"""The fused collation kernel reports exactly what the numpy reference reports.

`r3arrow.ids.gather_router_ids` on the numba backend (the generated `_gather_kernel` per
top-k, its rows as LLVM vectors) and on the numpy fallback, the same inputs: top-k 1..8,
uint8 / uint16 / int32 storage (int8 for the sign of unchecked widening), random spans and
dummy positions, and random bad rows (an id out of range, negative, or a duplicate at any
pair of lanes). Both raise the same error (type, message, token, layer) for the first failing
position, or write the same output.
"""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from r3arrow.errors import DuplicateExpertError, ExpertRangeError
from r3arrow.ids import gather_router_ids
from r3arrow.testing import use_backend

pytest.importorskip("numba")

_BOUND = {np.dtype(np.uint8): 256, np.dtype(np.uint16): 1200, np.dtype(np.int32): 1200}


def _outcome(
    backend: Literal["numba", "numpy"],
    src: np.ndarray,
    layer_index: np.ndarray,
    pos_row: np.ndarray,
    out_dtype: Any,
    num_experts: int | None,
    span: tuple[int, int, int, int],
    check: bool,
) -> tuple[str, Any]:
    """("ok", out) or ("error", (type, message, token, layer)) of one backend's call."""
    out = np.full((layer_index.shape[0], *pos_row.shape, src.shape[2]), 77, dtype=out_dtype)
    layer_ids = [10 * int(v) for v in layer_index]
    with use_backend(backend):
        try:
            gather_router_ids(
                src, layer_index, pos_row, out, num_experts, layer_ids, span=span, check=check
            )
        except (ExpertRangeError, DuplicateExpertError) as exc:
            return "error", (type(exc), str(exc), exc.token, exc.layer)
    return "ok", out


@st.composite
def _cases(draw: st.DrawFn) -> dict[str, Any]:
    dtype = np.dtype(draw(st.sampled_from([np.uint8, np.uint16, np.int32])))
    k = draw(st.integers(1, 8))
    experts = draw(st.integers(k, _BOUND[dtype]))
    tokens = draw(st.integers(1, 60))
    layers = draw(st.integers(1, 5))
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    starts = rng.integers(0, experts, (tokens, layers, 1))
    src = ((starts + rng.permutation(experts)[:k]) % experts).astype(dtype)
    bad = draw(
        st.lists(
            st.tuples(
                st.sampled_from(["dup", "range", "negative"]),
                st.integers(0, tokens - 1),
                st.integers(0, layers - 1),
                st.integers(0, k - 1),
                st.integers(0, k - 1),
            ),
            max_size=3,
        )
    )
    for kind, t, layer, a, b in bad:
        if kind == "dup" and a != b:
            src[t, layer, b] = src[t, layer, a]
        elif kind == "range" and experts < _BOUND[dtype]:
            src[t, layer, a] = experts + (b % (_BOUND[dtype] - experts))
        elif kind == "negative" and dtype.kind == "i":
            src[t, layer, a] = -1 - b
    n_local = draw(st.integers(1, layers))
    layer_index = rng.permutation(layers)[:n_local].astype(np.int64)
    positions = draw(st.integers(1, 400))
    columns = draw(st.integers(1, 3))
    pos_row = rng.integers(-1, tokens, (positions, columns)).astype(np.int64)
    p_lo = draw(st.integers(0, positions - 1))
    p_hi = draw(st.integers(p_lo + 1, positions))
    c_lo = draw(st.integers(0, columns - 1))
    c_hi = draw(st.integers(c_lo + 1, columns))
    return {
        "src": src,
        "layer_index": layer_index,
        "pos_row": pos_row,
        "out_dtype": draw(st.sampled_from([np.int32, dtype])),
        "num_experts": draw(st.sampled_from([experts, None])),
        "span": (p_lo, p_hi, c_lo, c_hi),
        "check": draw(st.booleans()),
    }


@settings(max_examples=150, deadline=None)
@given(case=_cases())
def test_kernel_reports_what_numpy_reports(case: dict[str, Any]) -> None:
    fast = _outcome("numba", **case)
    ref = _outcome("numpy", **case)
    assert fast[0] == ref[0]
    if ref[0] == "error":
        assert fast[1] == ref[1]
    else:
        np.testing.assert_array_equal(fast[1], ref[1])


@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.int32])
@pytest.mark.parametrize("k", range(2, 9))
def test_every_lane_pair_and_the_first_position(dtype: Any, k: int) -> None:
    """A duplicate at each pair of lanes, in a later block, is found at its position."""
    rng = np.random.default_rng(k)
    tokens, layers = 3000, 4
    starts = rng.integers(0, 100, (tokens, layers, 1))
    src = ((starts + rng.permutation(100)[:k]) % 100).astype(dtype)
    layer_index = np.array([3, 1], dtype=np.int64)
    pos_row = np.arange(tokens, dtype=np.int64).reshape(tokens, 1)
    for a in range(k):
        for b in range(a + 1, k):
            bad = src.copy()
            t = 2000 + 7 * a + b  # past the first blocks of every row size
            bad[t, 1, b] = bad[t, 1, a]
            bad[t + 300, 3, a] = bad[t + 300, 3, b]  # a later one: not reported
            for backend in ("numba", "numpy"):
                out = np.zeros((2, tokens, 1, k), dtype=np.int32)
                with use_backend(backend), pytest.raises(DuplicateExpertError) as info:
                    gather_router_ids(bad, layer_index, pos_row, out, 100, [30, 10])
                assert (info.value.token, info.value.layer) == (t, 10), (backend, a, b)


def test_unchecked_signed_ids_widen_with_their_sign() -> None:
    """``check=False`` copies negative ids as they are (sign-extended), on both backends."""
    src = np.array([[[-3, 5, 7, -128]], [[1, 2, 3, 4]]], dtype=np.int8)
    pos_row = np.array([[1], [0], [-1]], dtype=np.int64)
    expect = np.array([[[[1, 2, 3, 4]], [[-3, 5, 7, -128]], [[0, 1, 2, 3]]]], dtype=np.int32)
    for backend in ("numba", "numpy"):
        out = np.zeros((1, 3, 1, 4), dtype=np.int32)
        with use_backend(backend):
            gather_router_ids(src, np.array([0]), pos_row, out, 100, [0], check=False)
        np.testing.assert_array_equal(out, expect)
