"""TokenTrace / RouteTrace: incremental multi-turn capture, terminal gap, widening, bad input."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from r3arrow import RouteSpec, RouteTrace
from r3arrow._coverage import (
    check_terminal_gap,
    expected_rows,
    first_terminal_gap,
    first_terminal_gap_rows,
)
from r3arrow.capture import TokenTrace
from r3arrow.errors import (
    ExpertRangeError,
    PrefixMismatchError,
    R3ArrowError,
    RouteDTypeError,
    RouteShapeError,
    TerminalGapError,
    TraceStateError,
)
from r3arrow.spec import numpy_to_routes, routes_to_numpy
from r3arrow.testing import random_routes

SPEC = RouteSpec(num_layers=3, topk=2, num_experts=8)


def rows_of(n: int, spec: RouteSpec = SPEC, *, seed: int = 0, dtype: Any = None) -> np.ndarray:
    return random_routes(np.random.default_rng(seed), n, spec, dtype=dtype)


def to_np(arr: pa.Array[Any], spec: RouteSpec) -> np.ndarray:
    return routes_to_numpy(arr, spec)


# ------------------------------------------------------------ literal cases


def test_expected_rows() -> None:
    assert expected_rows(prompt_tokens=5, generated_tokens=3, prompt_start=0) == 7
    assert expected_rows(prompt_tokens=10, generated_tokens=4, prompt_start=7) == 6


def test_multi_turn_suffix_literal() -> None:
    trace = RouteTrace(SPEC)
    assert trace.captured == 0  # the first request sends prompt start 0
    t1 = rows_of(7, seed=1)  # P1=5, G1=3: P1 - 0 + G1 - 1 = 7 rows
    assert trace.record(t1, prompt_tokens=5, generated_tokens=3) == 0
    assert trace.captured == 7 == 5 + 3 - 1  # the second request sends P1 + G1 - 1
    assert trace.seen_tokens == 8
    # Turn 2: 2 observation tokens appended (P2 = 10), G2 = 4: P2 - 7 + G2 - 1 = 6 rows.
    t2 = rows_of(6, seed=2)
    assert trace.record(t2, prompt_tokens=10, generated_tokens=4) == 7
    assert trace.captured == 13 == 10 + 4 - 1
    assert trace.num_turns == 2
    # Final observation of 2 tokens: N = 16, rows 13 and 14 (predicting tokens 14, 15) are missing.
    mask = np.zeros(16, dtype=np.uint8)
    mask[5:8] = 1  # turn 1 generated tokens 5, 6, 7
    mask[10:14] = (
        1  # turn 2 generated tokens 10..13 (13 is the last sampled token: predicted by row 12)
    )
    out = trace.finalize(num_tokens=16, loss_mask=mask)
    assert isinstance(out, pa.Array)
    assert out.type == SPEC.arrow_type
    assert len(out) == 13  # ragged: no padding rows for the terminal gap
    np.testing.assert_array_equal(to_np(out, SPEC), np.concatenate([t1, t2]))
    assert trace.finalized


def test_terminal_gap_loss_active_target_raises_naming_the_token() -> None:
    trace = RouteTrace(SPEC)
    trace.record(rows_of(7), prompt_tokens=5, generated_tokens=3)  # captured 7, tokens 0..7
    mask = np.zeros(10, dtype=np.uint8)
    mask[9] = 1  # token 9 would need row 8; rows 7, 8 are missing
    with pytest.raises(
        TerminalGapError, match="missing routed-expert row for loss-active target at token 9"
    ):
        trace.finalize(num_tokens=10, loss_mask=mask)
    assert not trace.finalized  # a failed finalize leaves the trace usable
    mask[8] = 1
    with pytest.raises(TerminalGapError, match="at token 8"):  # the first offending token is named
        trace.finalize(num_tokens=10, loss_mask=mask)
    # The last sampled token (7) is predicted by captured row 6: loss-active is fine there.
    mask[:] = 0
    mask[5:8] = 1
    out = trace.finalize(num_tokens=10, loss_mask=mask)
    assert len(out) == 7


def test_terminal_gap_only_where_loss_masked() -> None:
    # The gap starts at row `captured`, predicting token captured + 1; token `captured` itself
    # is covered.
    assert check_terminal_gap(3, [0, 0, 1, 1, 0, 0], num_tokens=6).dtype == np.bool_
    with pytest.raises(TerminalGapError, match="token 4"):
        check_terminal_gap(3, [0, 0, 1, 1, 1, 0], num_tokens=6)
    with pytest.raises(TerminalGapError, match="token 5"):
        check_terminal_gap(3, [1, 1, 1, 1, 0, 1], num_tokens=6)
    check_terminal_gap(0, [1, 0, 0], num_tokens=3)  # token 0 is predicted by no row: never required
    with pytest.raises(TerminalGapError, match="token 1"):
        check_terminal_gap(0, [0, 1, 0], num_tokens=3)


def test_finalize_with_no_turns_is_empty() -> None:
    out = RouteTrace(SPEC).finalize(num_tokens=3, loss_mask=[1, 0, 0])
    assert out.type == SPEC.arrow_type and len(out) == 0


def test_finalize_mask_and_length_errors() -> None:
    trace = RouteTrace(SPEC)
    trace.record(rows_of(4), prompt_tokens=3, generated_tokens=2)
    with pytest.raises(RouteShapeError, match="over all 6 tokens"):
        trace.finalize(num_tokens=6, loss_mask=np.zeros(5))
    with pytest.raises(RouteShapeError):
        trace.finalize(num_tokens=6, loss_mask=np.zeros((6, 1)))
    with pytest.raises(RouteShapeError, match="num_tokens >= 5"):
        trace.finalize(num_tokens=4, loss_mask=np.zeros(4))
    assert len(trace.finalize(num_tokens=5, loss_mask=np.zeros(5))) == 4


def test_finalize_twice_and_record_after_finalize_rejected() -> None:
    trace = RouteTrace(SPEC)
    trace.record(rows_of(2), prompt_tokens=2, generated_tokens=1)
    trace.finalize(num_tokens=3, loss_mask=np.zeros(3))
    with pytest.raises(TraceStateError, match="twice"):
        trace.finalize(num_tokens=3, loss_mask=np.zeros(3))
    with pytest.raises(TraceStateError):
        trace.record(rows_of(1), prompt_tokens=3, generated_tokens=1)


@pytest.mark.parametrize(
    ("rows", "match"),
    [
        (rows_of(6), "expected 7 rows"),  # one too few
        (rows_of(8), "expected 7 rows"),  # one too many (the reference's full prefix + last token)
        (np.zeros((7, 4, 2), dtype=np.uint8), r"\[rows, 3, 2\]"),  # wrong layer count
        (np.zeros((7, 3, 3), dtype=np.uint8), r"\[rows, 3, 2\]"),  # wrong top-k
        (np.zeros((7, 6), dtype=np.uint8), r"\[rows, 3, 2\]"),  # flattened
        (np.zeros(7, dtype=np.uint8), r"\[rows, 3, 2\]"),
    ],
)
def test_chunk_with_wrong_shape_rejected_and_trace_unchanged(rows: np.ndarray, match: str) -> None:
    trace = RouteTrace(SPEC)
    first = rows_of(3, seed=5)
    trace.record(first, prompt_tokens=3, generated_tokens=1)  # captured 3
    with pytest.raises(RouteShapeError, match=match):
        trace.record(rows, prompt_tokens=6, generated_tokens=5)  # wants 6 - 3 + 5 - 1 = 7 rows
    assert (trace.captured, trace.num_turns, trace.seen_tokens) == (3, 1, 4)
    second = rows_of(7, seed=6)
    trace.record(second, prompt_tokens=6, generated_tokens=5)
    out = trace.finalize(num_tokens=11, loss_mask=np.zeros(11))
    np.testing.assert_array_equal(to_np(out, SPEC), np.concatenate([first, second]))


def test_non_contiguous_turns_rejected() -> None:
    trace = RouteTrace(SPEC)
    trace.record(
        rows_of(5), prompt_tokens=4, generated_tokens=2
    )  # captured 5, conversation of 6 tokens
    # The prompt start (captured = 5) must lie inside the prompt.
    with pytest.raises(RouteShapeError, match="captured=5"):
        trace.record(rows_of(0), prompt_tokens=5, generated_tokens=1)
    # A prompt that drops part of the conversation (shorter than the 6 tokens seen) is rejected too.
    with pytest.raises(RouteShapeError, match="prompt_tokens=3"):
        trace.record(np.zeros((0, 3, 2), dtype=np.uint8), prompt_tokens=3, generated_tokens=3)
    assert (trace.captured, trace.seen_tokens) == (5, 6)
    # Continuing exactly where the conversation stopped is fine: 6 - 5 + 1 - 1 = 1 row.
    assert trace.record(rows_of(1), prompt_tokens=6, generated_tokens=1) == 5


def test_strided_numpy_input_is_accepted_exactly() -> None:
    big = rows_of(10, RouteSpec(num_layers=6, topk=2, num_experts=8), seed=3)
    view = big[::2, ::2]  # non-contiguous view, [5, 3, 2]
    trace = RouteTrace(SPEC)
    trace.record(view, prompt_tokens=4, generated_tokens=2)
    np.testing.assert_array_equal(
        to_np(trace.finalize(num_tokens=6, loss_mask=np.zeros(6)), SPEC), view
    )


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"prompt_tokens": 0, "generated_tokens": 1}, ValueError, r"prompt_tokens.*\[1, inf\]"),
        ({"prompt_tokens": 3, "generated_tokens": 0}, ValueError, r"generated_tokens.*\[1, inf\]"),
        ({"prompt_tokens": True, "generated_tokens": 1}, TypeError, "prompt_tokens"),
        ({"prompt_tokens": 3.0, "generated_tokens": 1}, TypeError, "prompt_tokens"),
        ({"prompt_tokens": 3, "generated_tokens": -1}, ValueError, "generated_tokens"),
    ],
)
def test_bad_token_counts_rejected(
    kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    # Token counts are arguments: misuse raises the builtin, not an R3ArrowError.
    trace = RouteTrace(SPEC)
    with pytest.raises(error, match=match) as info:
        trace.record(rows_of(2), **kwargs)
    assert not isinstance(info.value, R3ArrowError)
    assert trace.captured == 0


def test_numpy_integer_token_counts_accepted() -> None:
    trace = RouteTrace(SPEC)
    trace.record(rows_of(3), prompt_tokens=np.int64(3), generated_tokens=np.int32(1))
    assert trace.captured == 3


# ----------------------------------------------------------- inputs, dtypes


@pytest.mark.parametrize(
    "dtype", [np.uint8, np.int8, np.uint16, np.int16, np.uint32, np.int32, np.uint64, np.int64]
)
def test_any_integer_numpy_dtype_is_stored_in_spec_dtype(dtype: type) -> None:
    data = rows_of(4, dtype=dtype)
    trace = RouteTrace(SPEC)
    trace.record(data, prompt_tokens=3, generated_tokens=2)
    out = trace.finalize(num_tokens=5, loss_mask=np.zeros(5))
    assert out.type == SPEC.arrow_type
    np.testing.assert_array_equal(to_np(out, SPEC), data)


def test_float_and_object_numpy_rejected() -> None:
    trace = RouteTrace(SPEC)
    with pytest.raises(RouteDTypeError):
        trace.record(rows_of(2).astype(np.float32), prompt_tokens=2, generated_tokens=1)
    with pytest.raises(RouteDTypeError):
        trace.record(rows_of(2).astype(object), prompt_tokens=2, generated_tokens=1)
    assert trace.captured == 0


def test_arrow_input_of_spec_type() -> None:
    a, b = rows_of(4, seed=1), rows_of(3, seed=2)
    trace = RouteTrace(SPEC)
    trace.record(numpy_to_routes(a, SPEC), prompt_tokens=3, generated_tokens=2)
    chunked = pa.chunked_array([numpy_to_routes(b[:1], SPEC), numpy_to_routes(b[1:], SPEC)])
    trace.record(chunked, prompt_tokens=6, generated_tokens=2)
    sliced = numpy_to_routes(np.concatenate([a, b]), SPEC).slice(
        4, 2
    )  # an Arrow slice: offset != 0
    trace.record(sliced, prompt_tokens=9, generated_tokens=1)
    out = trace.finalize(num_tokens=10, loss_mask=np.zeros(10))
    np.testing.assert_array_equal(to_np(out, SPEC), np.concatenate([a, b, b[:2]]))


def test_arrow_input_with_wrong_type_or_nulls_rejected() -> None:
    trace = RouteTrace(SPEC)
    with pytest.raises(RouteShapeError):
        trace.record(
            numpy_to_routes(np.zeros((2, 4, 2), dtype=np.uint8)),
            prompt_tokens=2,
            generated_tokens=1,
        )
    with pytest.raises(RouteShapeError):
        trace.record(
            pa.array([[[0, 1]] * 3, None], type=SPEC.arrow_type),
            prompt_tokens=2,
            generated_tokens=1,
        )
    with pytest.raises(RouteShapeError):
        trace.record(pa.array([1, 2], type=pa.uint8()), prompt_tokens=2, generated_tokens=1)
    assert trace.captured == 0


def test_writable_chunk_reused_by_caller_does_not_corrupt_trace() -> None:
    buf = rows_of(3, seed=9)
    want = buf.copy()
    trace = RouteTrace(SPEC)
    trace.record(buf, prompt_tokens=3, generated_tokens=1)
    buf[:] = 7  # the caller reuses its receive buffer
    np.testing.assert_array_equal(
        to_np(trace.finalize(num_tokens=4, loss_mask=np.zeros(4)), SPEC), want
    )


def test_read_only_chunk_is_accepted() -> None:
    data = rows_of(3, seed=4)
    ro = np.frombuffer(data.tobytes(), dtype=data.dtype).reshape(
        data.shape
    )  # as a decoder returns it
    assert not ro.flags.writeable
    trace = RouteTrace(SPEC)
    trace.record(ro, prompt_tokens=3, generated_tokens=1)
    np.testing.assert_array_equal(
        to_np(trace.finalize(num_tokens=4, loss_mask=np.zeros(4)), SPEC), data
    )


# ---------------------------------------------------------------- id range


def test_id_range_errors_and_trace_unchanged() -> None:
    spec = RouteSpec(num_layers=3, topk=2, num_experts=8, moe_layers=(0, 2))
    trace = RouteTrace(spec)
    good = random_routes(np.random.default_rng(0), 3, spec)
    trace.record(good, prompt_tokens=3, generated_tokens=1)
    bad_high = random_routes(np.random.default_rng(1), 2, spec).astype(np.int64)
    bad_high[1, 2, 0] = 8
    with pytest.raises(ExpertRangeError, match=r"num_experts=8, found 8 \(token 1, layer 2\)"):
        trace.record(bad_high, prompt_tokens=4, generated_tokens=2)
    bad_neg = random_routes(np.random.default_rng(2), 2, spec).astype(np.int64)
    bad_neg[0, 0, 1] = -1
    with pytest.raises(ExpertRangeError, match=">= 0"):
        trace.record(bad_neg, prompt_tokens=4, generated_tokens=2)
    assert (trace.captured, trace.num_turns, trace.spec) == (3, 1, spec)
    nxt = random_routes(np.random.default_rng(3), 2, spec)
    nxt[:, 1] = 0  # dense-layer zeros are fine
    trace.record(nxt, prompt_tokens=4, generated_tokens=2)
    out = trace.finalize(num_tokens=6, loss_mask=np.zeros(6))
    np.testing.assert_array_equal(to_np(out, spec), np.concatenate([good, nxt]))


def test_dense_layer_values_are_not_range_checked_against_num_experts() -> None:
    spec = RouteSpec(num_layers=2, topk=2, num_experts=4, moe_layers=(1,))
    data = np.array([[[0, 0], [1, 3]], [[9, 9], [0, 2]]], dtype=np.uint8)  # dense layer 0 carries 9
    trace = RouteTrace(spec)
    trace.record(data, prompt_tokens=2, generated_tokens=1)
    np.testing.assert_array_equal(
        to_np(trace.finalize(num_tokens=3, loss_mask=np.zeros(3)), spec), data
    )


@pytest.mark.parametrize("value", [-1, 1000])
def test_dense_layer_value_outside_storage_dtype_is_never_silently_wrapped(value: int) -> None:
    # Ids on dense layers are not range-checked, but they must not be silently reinterpreted when
    # narrowed to the storage dtype (-1 -> 255, 1000 -> 232): either a typed error or exact storage.
    spec = RouteSpec(num_layers=2, topk=2, num_experts=None, moe_layers=(1,))
    data = np.array([[[value, 0], [0, 1]]], dtype=np.int64)
    trace = RouteTrace(spec)
    try:
        trace.record(data, prompt_tokens=1, generated_tokens=1)
        out = trace.finalize(num_tokens=2, loss_mask=np.zeros(2))
    except R3ArrowError:
        return
    np.testing.assert_array_equal(to_np(out, trace.spec).astype(np.int64), data)


def test_widening_when_a_later_turn_has_id_at_least_256() -> None:
    # Defect 3.1 of the reference: the first turn's uint8 locked the trace ("schema changed").
    spec = RouteSpec(num_layers=2, topk=2, num_experts=None)
    trace = RouteTrace(spec)
    t1 = np.array([[[0, 255], [1, 2]]] * 3, dtype=np.uint8)
    trace.record(t1, prompt_tokens=3, generated_tokens=1)
    assert trace.spec.dtype == np.uint8
    t2 = np.array([[[256, 3], [299, 0]]] * 2, dtype=np.int32)
    trace.record(t2, prompt_tokens=5, generated_tokens=1)  # 5 - 3 + 1 - 1 = 2 rows
    assert trace.spec.dtype == np.uint16
    t3 = np.array([[[4, 5], [6, 7]]], dtype=np.uint8)
    trace.record(t3, prompt_tokens=6, generated_tokens=1)
    assert trace.spec.dtype == np.uint16  # never narrows back
    out = trace.finalize(num_tokens=7, loss_mask=np.zeros(7))
    assert out.type == trace.spec.arrow_type == pa.list_(pa.list_(pa.uint16(), 2), 2)
    np.testing.assert_array_equal(
        to_np(out, trace.spec), np.concatenate([t1, t2, t3]).astype(np.uint16)
    )


def test_widening_to_int32() -> None:
    trace = RouteTrace(RouteSpec(num_layers=1, topk=2, num_experts=None))
    data = np.array([[[70000, 1]]], dtype=np.int64)
    trace.record(data, prompt_tokens=1, generated_tokens=1)
    out = trace.finalize(num_tokens=2, loss_mask=np.zeros(2))
    assert out.type.value_type.value_type == pa.int32()
    np.testing.assert_array_equal(to_np(out, trace.spec), data)


def test_failed_record_does_not_widen() -> None:
    trace = RouteTrace(RouteSpec(num_layers=1, topk=2, num_experts=None))
    with pytest.raises(RouteShapeError):  # wide ids but the wrong row count
        trace.record(np.array([[[300, 1]]] * 2), prompt_tokens=1, generated_tokens=1)
    assert trace.spec.dtype == np.uint8 and trace.dtype == np.uint8
    trace.record(np.array([[[3, 1]]]), prompt_tokens=1, generated_tokens=1)
    assert (
        trace.finalize(num_tokens=2, loss_mask=np.zeros(2)).type.value_type.value_type == pa.uint8()
    )


def test_known_num_experts_over_256_is_uint16_from_the_start() -> None:
    spec = RouteSpec(num_layers=2, topk=2, num_experts=300)
    trace = RouteTrace(spec)
    assert trace.spec.dtype == np.uint16
    small = np.array([[[0, 1], [2, 3]]] * 2, dtype=np.uint8)
    trace.record(small, prompt_tokens=2, generated_tokens=1)
    big = np.array([[[298, 299], [256, 0]]], dtype=np.int64)
    trace.record(big, prompt_tokens=3, generated_tokens=1)
    assert trace.spec == spec
    out = trace.finalize(num_tokens=4, loss_mask=np.zeros(4))
    assert out.type == spec.arrow_type
    np.testing.assert_array_equal(to_np(out, spec), np.concatenate([small, big]))
    with pytest.raises(ExpertRangeError):
        RouteTrace(spec).record(np.array([[[300, 1], [0, 1]]]), prompt_tokens=1, generated_tokens=1)


# ------------------------------------------------------------ generic trace


def test_token_trace_scalar_rows_for_logprobs() -> None:
    trace = TokenTrace((), np.float32, name="logprobs")
    a = np.array([-0.5, -1.25, -0.125], dtype=np.float32)
    b = np.array([-2.0, -0.25], dtype=np.float32)
    assert trace.record(a, prompt_tokens=2, generated_tokens=2) == 0
    assert trace.record(b, prompt_tokens=5, generated_tokens=1) == 3
    out = trace.finalize(num_tokens=6, loss_mask=np.zeros(6))
    assert out.type == pa.float32()
    assert len(out) == 5
    np.testing.assert_array_equal(out.to_numpy(), np.concatenate([a, b]))


def test_token_trace_vector_rows_for_topk_logprobs() -> None:
    trace = TokenTrace((4,), np.float32, name="topk_logprobs")
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    trace.record(a, prompt_tokens=2, generated_tokens=2)
    out = trace.finalize(num_tokens=4, loss_mask=np.zeros(4))
    assert out.type == pa.list_(pa.float32(), 4)
    flat = cast("pa.FixedSizeListArray[Any, Any]", out).flatten()
    np.testing.assert_array_equal(flat.to_numpy().reshape(3, 4), a)
    with pytest.raises(RouteShapeError, match=r"\[rows, 4\]"):
        TokenTrace((4,), np.float32).record(np.zeros((3, 5)), prompt_tokens=2, generated_tokens=2)
    with pytest.raises(RouteShapeError, match=r"\[rows\]"):
        TokenTrace((), np.float32).record(np.zeros((3, 1)), prompt_tokens=2, generated_tokens=2)


def test_token_trace_terminal_gap_and_state() -> None:
    trace = TokenTrace((), np.float32)
    trace.record(np.zeros(2, dtype=np.float32), prompt_tokens=2, generated_tokens=1)
    with pytest.raises(TerminalGapError, match="token 4"):
        trace.finalize(num_tokens=5, loss_mask=[0, 0, 1, 0, 1])
    trace.finalize(num_tokens=5, loss_mask=[0, 0, 1, 0, 0])
    with pytest.raises(TraceStateError):
        trace.finalize(num_tokens=5, loss_mask=[0, 0, 1, 0, 0])


def test_token_trace_rejects_values_it_cannot_store_exactly() -> None:
    # An int32 trace must not silently truncate floats, and a float trace must not accept text.
    ints = TokenTrace((), np.int32, name="ids")
    with pytest.raises(R3ArrowError):
        ints.record(np.array([0.5, 1.7]), prompt_tokens=2, generated_tokens=1)
    assert ints.captured == 0
    floats = TokenTrace((), np.float32, name="logprobs")
    with pytest.raises(R3ArrowError):
        floats.record(np.array(["a", "b"]), prompt_tokens=2, generated_tokens=1)
    assert floats.captured == 0


# ------------------------------------------------------------------ property


@dataclass
class Turn:
    obs: int  # tokens appended to the conversation before this request (the first: the prompt)
    gen: int  # generated tokens


_TURNS = st.lists(
    st.builds(Turn, obs=st.integers(0, 6), gen=st.integers(1, 6)), min_size=1, max_size=6
)


def _plan(turns: list[Turn]) -> list[tuple[int, int, int]]:
    """(P, G, rows) per turn for a conversation; the first prompt has at least one token."""
    out, seen, captured = [], 0, 0
    for i, t in enumerate(turns):
        p = seen + t.obs + (1 if i == 0 else 0)
        rows = expected_rows(prompt_tokens=p, generated_tokens=t.gen, prompt_start=captured)
        out.append((p, t.gen, rows))
        seen, captured = p + t.gen, captured + rows
    return out


@st.composite
def _specs(draw: st.DrawFn, num_experts: int | None) -> RouteSpec:
    layers = draw(st.integers(1, 5))
    topk = draw(st.integers(1, 4))
    moe = draw(st.lists(st.integers(0, layers - 1), min_size=1, max_size=layers, unique=True))
    return RouteSpec(num_layers=layers, topk=topk, num_experts=num_experts, moe_layers=tuple(moe))


@given(
    turns=_TURNS,
    tail=st.integers(0, 4),
    num_experts=st.sampled_from([None, 8, 300, 70000]),
    in_dtype=st.sampled_from([np.uint8, np.uint16, np.int16, np.int32, np.int64]),
    as_arrow=st.lists(st.booleans(), min_size=6, max_size=6),
    read_only=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
    data=st.data(),
)
def test_any_valid_turn_sequence_finalizes_to_the_concatenation(
    turns: list[Turn],
    tail: int,
    num_experts: int | None,
    in_dtype: type,
    as_arrow: list[bool],
    read_only: bool,
    seed: int,
    data: st.DataObject,
) -> None:
    rng = np.random.default_rng(seed)
    spec = data.draw(_specs(num_experts))
    trace = RouteTrace(spec)
    max_id = min(int(np.iinfo(in_dtype).max) + 1, num_experts or 600)
    chunks: list[np.ndarray] = []
    for i, (p, g, rows) in enumerate(_plan(turns)):
        assert trace.captured == sum(len(c) for c in chunks)
        chunk = random_routes(rng, rows, spec, num_experts=max_id, dtype=in_dtype)
        chunks.append(chunk)
        arg: Any = chunk
        if as_arrow[i] and in_dtype in (np.uint8, np.uint16, np.int32):
            arg = numpy_to_routes(chunk)
        elif read_only:
            arg = np.frombuffer(chunk.tobytes(), dtype=chunk.dtype).reshape(chunk.shape)
        assert trace.record(arg, prompt_tokens=p, generated_tokens=g) == sum(
            len(c) for c in chunks[:-1]
        )
    want = np.concatenate(chunks).astype(np.int64)
    num_tokens = trace.seen_tokens + tail
    mask = np.zeros(num_tokens, dtype=np.uint8)
    mask[: trace.captured + 1] = rng.integers(0, 2, size=trace.captured + 1)
    out = trace.finalize(num_tokens=num_tokens, loss_mask=mask)
    assert len(out) == trace.captured == want.shape[0]
    assert out.type == trace.spec.arrow_type
    if num_experts is not None:
        assert trace.spec == spec
    else:
        assert trace.spec.dtype == RouteSpec(1, 1, max(int(want.max(initial=0)) + 1, 1)).dtype
    np.testing.assert_array_equal(to_np(out, trace.spec).astype(np.int64), want)


_MUTATIONS = [
    "rows_minus",
    "rows_plus",
    "layers",
    "topk",
    "rank",
    "float",
    "too_high",
    "negative",
    "prompt_short",
    "prompt_not_after_start",
    "gen_zero",
]


@given(
    turns=_TURNS,
    mutation=st.sampled_from(_MUTATIONS),
    where=st.integers(0, 5),
    delta=st.integers(1, 3),
    seed=st.integers(0, 2**32 - 1),
)
def test_any_invalid_turn_raises_typed_error_and_leaves_trace_unchanged(
    turns: list[Turn], mutation: str, where: int, delta: int, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    spec = RouteSpec(num_layers=3, topk=2, num_experts=8, moe_layers=(0, 2))
    plan = _plan(turns)
    where = where % len(plan)
    trace = RouteTrace(spec)
    chunks = []
    for i, (p, g, rows) in enumerate(plan):
        chunk = random_routes(rng, rows, spec)
        if i == where:
            bad: Any = chunk.astype(np.int64)
            bp, bg = p, g
            if mutation == "rows_minus":
                bad = bad[: max(0, rows - delta)]
            elif mutation == "rows_plus":
                bad = np.concatenate([bad, bad[:1].repeat(delta, axis=0)])
            elif mutation == "layers":
                bad = np.zeros((rows, 3 + delta, 2), dtype=np.uint8)
            elif mutation == "topk":
                bad = np.zeros((rows, 3, 2 + delta), dtype=np.uint8)
            elif mutation == "rank":
                bad = bad.reshape(rows, -1)
            elif mutation == "float":
                bad = bad.astype(np.float64)
            elif mutation == "too_high":
                bad[-1, 2, 1] = 8 + delta - 1
            elif mutation == "negative":
                bad[0, 0, 0] = -delta
            elif mutation == "prompt_short":
                bp = trace.seen_tokens - delta
            elif mutation == "prompt_not_after_start":
                bp = trace.captured - delta + 1
            elif mutation == "gen_zero":
                bg = 1 - delta
            before = (trace.captured, trace.seen_tokens, trace.num_turns, trace.spec)
            if mutation == "prompt_short" and bp >= trace.seen_tokens:
                pass
            else:
                # token counts < 1 are argument misuse (a builtin); the rest is bad data
                error = ValueError if bp < 1 or bg < 1 else R3ArrowError
                with pytest.raises(error):
                    trace.record(bad, prompt_tokens=bp, generated_tokens=bg)
                assert (trace.captured, trace.seen_tokens, trace.num_turns, trace.spec) == before
        trace.record(chunk, prompt_tokens=p, generated_tokens=g)
        chunks.append(chunk)
    out = trace.finalize(num_tokens=trace.seen_tokens, loss_mask=np.zeros(trace.seen_tokens))
    np.testing.assert_array_equal(to_np(out, spec), np.concatenate(chunks))


def test_invalid_mutation_catalogue_is_exercised() -> None:
    # Every mutation used above raises on a fixed case (guards against a mutation that never fires).
    spec = RouteSpec(num_layers=3, topk=2, num_experts=8, moe_layers=(0, 2))
    for mutation in _MUTATIONS:
        trace = RouteTrace(spec)
        trace.record(
            random_routes(np.random.default_rng(0), 4, spec), prompt_tokens=3, generated_tokens=2
        )
        rows = random_routes(np.random.default_rng(1), 4, spec).astype(np.int64)
        p, g = 7, 2  # 7 - 4 + 2 - 1 = 4 rows
        bad: Any = rows
        if mutation == "rows_minus":
            bad = rows[:3]
        elif mutation == "rows_plus":
            bad = np.concatenate([rows, rows[:1]])
        elif mutation == "layers":
            bad = np.zeros((4, 4, 2), dtype=np.uint8)
        elif mutation == "topk":
            bad = np.zeros((4, 3, 3), dtype=np.uint8)
        elif mutation == "rank":
            bad = rows.reshape(4, -1)
        elif mutation == "float":
            bad = rows.astype(np.float64)
        elif mutation == "too_high":
            bad[0, 0, 0] = 8
        elif mutation == "negative":
            bad[0, 2, 0] = -1
        elif mutation == "prompt_short":
            p = 4
        elif mutation == "prompt_not_after_start":
            p = 3
        elif mutation == "gen_zero":
            g = 0
        error = ValueError if p < 1 or g < 1 else R3ArrowError
        with pytest.raises(error):
            trace.record(bad, prompt_tokens=p, generated_tokens=g)
        assert trace.captured == 4


@pytest.mark.parametrize(
    "ragged",
    [
        [[1, 2], [3]],
        [[[0, 1], [2, 3], [4, 5]], [[0, 1], [2, 3]]],
        [[[0, 1], [2, 3], [4, 5]], [[0, 1], [2, 3], [4]]],
    ],
)
def test_ragged_nested_lists_raise_typed_error(ragged: list[Any]) -> None:
    with pytest.raises(R3ArrowError):
        RouteTrace(SPEC).record(ragged, prompt_tokens=1, generated_tokens=2)
    with pytest.raises(R3ArrowError):
        TokenTrace((2,), np.float32).record(ragged, prompt_tokens=1, generated_tokens=2)


@given(
    arr=hnp.arrays(
        dtype=st.one_of(
            hnp.integer_dtypes(),
            hnp.unsigned_integer_dtypes(),
            hnp.floating_dtypes(),
            hnp.boolean_dtypes(),
            hnp.byte_string_dtypes(max_len=2),
        ),
        shape=hnp.array_shapes(min_dims=0, max_dims=4, min_side=0, max_side=4),
    ),
    prompt=st.integers(-1, 5),
    gen=st.integers(-1, 4),
)
def test_arbitrary_arrays_are_accepted_only_when_valid(
    arr: np.ndarray, prompt: int, gen: int
) -> None:
    spec = RouteSpec(num_layers=3, topk=2, num_experts=8, moe_layers=(0, 2))
    valid = (
        prompt >= 1
        and gen >= 1
        and arr.dtype.kind in "iu"
        and arr.ndim == 3
        and arr.shape[1:] == (3, 2)
        and arr.shape[0] == prompt + gen - 1
        and bool(
            ((arr[:, [0, 2]].astype(np.int64) >= 0) & (arr[:, [0, 2]].astype(np.int64) < 8)).all()
        )
        and bool(
            (arr[:, 1].astype(np.int64) >= 0).all() and (arr[:, 1].astype(np.int64) < 256).all()
        )
    )
    trace = RouteTrace(spec)
    try:
        trace.record(arr, prompt_tokens=prompt, generated_tokens=gen)
    except R3ArrowError:
        assert not valid, "a valid payload was rejected"
        assert prompt >= 1 and gen >= 1, "bad token counts must raise a builtin"
        assert trace.captured == 0
        return
    except ValueError:  # argument misuse: token counts below 1
        assert prompt < 1 or gen < 1, "a builtin error for bad data"
        assert trace.captured == 0
        return
    assert valid, "an invalid payload was accepted"
    out = trace.finalize(num_tokens=prompt + gen, loss_mask=np.zeros(prompt + gen))
    np.testing.assert_array_equal(to_np(out, spec), arr)


# ------------------------------------------------------------ covered tokens
def test_covered_tokens_extend_turn_by_turn_and_refuse_drift() -> None:
    trace = RouteTrace(SPEC)
    assert trace.covered_tokens.size == 0
    trace.check_extends([5, 6, 7])  # nothing covered yet: any prompt extends it
    empty_digest = trace.covered_digest
    trace.record(rows_of(4), prompt_tokens=3, generated_tokens=2, prompt_ids=[5, 6, 7],
                 generated_ids=[8, 9])  # fmt: skip
    assert trace.covered_tokens.tolist() == [5, 6, 7, 8, 9]
    assert trace.covered_tokens.dtype == np.int32 and not trace.covered_tokens.flags.writeable
    assert trace.covered_digest != empty_digest
    ok = trace.check_extends(np.array([5, 6, 7, 8, 9, 1], dtype=np.int64))
    assert ok.dtype == np.int32 and ok.tolist() == [5, 6, 7, 8, 9, 1]
    # re-tokenized history: the generated [8, 9] came back as [8, 10]
    with pytest.raises(PrefixMismatchError, match="position 4 where the trace has 9") as info:
        trace.check_extends([5, 6, 7, 8, 10, 1])
    assert info.value.token == 4 and isinstance(info.value, ValueError)
    with pytest.raises(PrefixMismatchError, match="ends at token 3") as short:
        trace.check_extends([5, 6, 7])
    assert short.value.token == 3
    before = (trace.captured, trace.num_turns, trace.covered_digest)
    with pytest.raises(PrefixMismatchError):  # record checks too when not handed check's array
        trace.record(rows_of(2), prompt_tokens=6, generated_tokens=1,
                     prompt_ids=[5, 6, 7, 8, 10, 1])  # fmt: skip
    assert (trace.captured, trace.num_turns, trace.covered_digest) == before
    trace.record(rows_of(2), prompt_tokens=6, generated_tokens=1, prompt_ids=ok)
    assert trace.covered_tokens.tolist() == [5, 6, 7, 8, 9, 1]  # no generated ids: prompt only


@pytest.mark.parametrize("writeable", [True, False])
def test_negative_int32_token_ids_are_refused(writeable: bool) -> None:
    """int32 arrays take the zero-copy path, and are range-checked like every other input."""
    ids = np.array([5, -1, 7], dtype=np.int32)
    ids.flags.writeable = writeable
    trace = RouteTrace(SPEC)
    with pytest.raises(ValueError, match=r"token ids in \[0, 2\*\*31\), found \[-1, 7\]"):
        trace.check_extends(ids)
    with pytest.raises(ValueError, match="token ids"):
        trace.record(rows_of(4), prompt_tokens=3, generated_tokens=2, prompt_ids=ids)
    assert trace.captured == 0 and trace.covered_tokens.size == 0


def test_digest_is_blake2b_of_the_covered_int32_bytes() -> None:
    import hashlib

    trace = RouteTrace(SPEC)
    trace.record(rows_of(4), prompt_tokens=3, generated_tokens=2, prompt_ids=[1, 2, 3],
                 generated_ids=[4, 5])  # fmt: skip
    want = hashlib.blake2b(np.arange(1, 6, dtype=np.int32).tobytes(), digest_size=16)
    assert trace.covered_digest == want.hexdigest()


def test_bound_trace_prefix_error_carries_the_trajectory_id() -> None:
    from r3arrow import TurnStore

    store = TurnStore(SPEC)
    trace = store.trace("t")
    trace.record(rows_of(2), prompt_tokens=2, generated_tokens=1, prompt_ids=[1, 2])
    with pytest.raises(PrefixMismatchError) as info:
        trace.check_extends([1, 3, 4])
    assert info.value.fields() == {"trajectory_id": "t", "token": 1}
    with pytest.raises(PrefixMismatchError):
        trace.record(rows_of(2), prompt_tokens=3, generated_tokens=1, prompt_ids=[1, 3, 4])
    assert store.num_turns == 1


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"prompt_ids": [1, 2]}, "prompt_tokens=3 ids"),
        ({"prompt_ids": [1, 2, 3], "generated_ids": [4]}, "generated_tokens=2 ids"),
        ({"generated_ids": [4, 5]}, "expected prompt_ids"),
        ({"prompt_ids": [[1, 2, 3]]}, "flat sequence"),
        ({"prompt_ids": [1, -2, 3]}, r"\[0, 2\*\*31\)"),
    ],
)
def test_token_id_argument_misuse_is_a_value_error(kw: dict[str, Any], match: str) -> None:
    trace = RouteTrace(SPEC)
    with pytest.raises(ValueError, match=match) as info:
        trace.record(rows_of(4), prompt_tokens=3, generated_tokens=2, **kw)
    assert not isinstance(info.value, R3ArrowError)
    assert trace.captured == 0


@given(
    turns=st.lists(
        st.tuples(st.integers(1, 5), st.integers(1, 4), st.booleans()), min_size=1, max_size=6
    ),
    drift=st.integers(0, 10**6),
    seed=st.integers(0, 2**16),
)
def test_any_conversation_is_covered_and_any_drift_is_located(
    turns: list[tuple[int, int, bool]], drift: int, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    trace = RouteTrace(SPEC)
    conv: list[int] = rng.integers(0, 100, size=2).tolist()
    covered = 0
    for obs, g, with_gen in turns:
        conv += rng.integers(0, 100, size=obs).tolist()
        p = len(conv)
        gen = rng.integers(0, 100, size=g).tolist()
        ids = trace.check_extends(conv)
        rows = rows_of(p - trace.captured + g - 1, seed=seed)
        trace.record(rows, prompt_tokens=p, generated_tokens=g, prompt_ids=ids,
                     generated_ids=gen if with_gen else None)  # fmt: skip
        conv += gen
        covered = len(conv) if with_gen else p
        assert trace.covered_tokens.tolist() == conv[:covered]
    pos = drift % covered
    bad = list(conv)
    bad[pos] += 1
    with pytest.raises(PrefixMismatchError) as info:
        trace.check_extends(bad)
    assert info.value.token == pos


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(
        st.tuples(st.integers(0, 5), st.integers(0, 6), st.integers(0, 11), st.integers(0, 2**6)),
        min_size=1,
        max_size=6,
    )
)
def test_first_terminal_gap_rows_matches_the_per_token_rule(
    rows: list[tuple[int, int, int, int]],
) -> None:
    """The table-level form (uncovered tails only) finds the per-token rule's first violation."""
    plen = np.array([p for p, _, _, _ in rows], dtype=np.int64)
    rlen = np.array([r for _, r, _, _ in rows], dtype=np.int64)
    cap = np.minimum([c for _, _, c, _ in rows], plen + rlen)
    mask = np.concatenate(
        [np.array([(bits >> j) & 1 for j in range(r)], np.uint8) for _, r, _, bits in rows]
    )
    parent = np.repeat(np.arange(len(rows)), rlen)
    starts = np.concatenate([[0], np.cumsum(rlen)[:-1]])
    pos = plen[parent] + (np.arange(mask.size) - starts[parent])
    k = first_terminal_gap(mask, pos, cap[parent]) if mask.size else -1
    want = None if k < 0 else (int(parent[k]), int(pos[k]))
    assert first_terminal_gap_rows(mask, rlen, plen, cap) == want
