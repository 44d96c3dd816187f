"""SkyRL's R3 test cases, translated to r3arrow's API.

Source: NovaSky-AI/SkyRL, PR #1912 head 4bb8674956eb75fc53d8cd397ffdbe3980539012 (the R3
stack #1908-#1912); each group names the file it comes from. The inputs and expected
values are SkyRL's; the calls are r3arrow's equivalents (SkyRL function -> r3arrow function
is noted per group). Cases where r3arrow differs by design assert r3arrow's documented rule
and say why (``docs/design.md`` sections). Cases that exercise SkyRL's own plumbing with no
r3arrow counterpart are left out: tokenizer and chat-template plumbing, step-wise merging,
Ray/HTTP mocks of SkyRL's own servers, dispatcher patches, stateful batch accumulation
(translated as a concatenation), Megatron monkeypatch fixtures (the real-router checks live
in tests/integrations/test_megatron.py). 85 cases (parametrizations counted) from 11 files.
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch

from r3arrow._routes import dummy_route_row
from r3arrow.adapters.skyrl import from_generator_output, to_training_inputs
from r3arrow.capture import RouteTrace, TokenTrace
from r3arrow.codec import decode_packed, encode_packed
from r3arrow.collate import MegatronCollator, Parallelism
from r3arrow.errors import (
    ExpertRangeError,
    PayloadError,
    R3ArrowError,
    RouteDTypeError,
    RouteShapeError,
    TerminalGapError,
    TraceStateError,
)
from r3arrow.spec import RouteSpec
from r3arrow.table import (
    captured_lengths,
    filter_groups,
    flat_routes,
    replace_groups,
    rollout_table,
    router_padding_mask,
    take_rows,
)
from r3arrow.table._sampling import varied_groups


def pylist(x: Any) -> list[Any]:
    """``x.to_pylist()``, loosely typed (pyarrow-stubs refuse it on list arrays)."""
    out: list[Any] = x.to_pylist()
    return out


# ------------------------------------------------------------------------------------------
# tests/backends/skyrl_train/utils/test_routed_experts.py: compact_routed_expert_indices.
# r3arrow: encode_packed applies the same narrowest-dtype rule on the wire (uint8, int16,
# int32); decode_packed gives the compact array back.
COMPACTION = [
    (np.arange(12).reshape(3, 2, 2), "uint8"),
    (np.array([[[2**8 - 1]]]), "uint8"),
    (np.array([[[0, 2**8]]]), "int16"),
    (np.array([[[0, 2**15 - 1]]]), "int16"),
    (np.array([[[0, 2**15]]]), "int32"),
    (np.array([[[0, 2**31 - 1]]], dtype=np.int64), "int32"),
    (np.empty((0, 2, 2), dtype=np.int64), "uint8"),
]


@pytest.mark.parametrize(("routes", "expected"), COMPACTION)
def test_compaction_picks_smallest_safe_dtype(routes: np.ndarray, expected: str) -> None:
    payload = encode_packed(routes)
    compact = decode_packed(payload)
    assert payload["dtype"] == expected and compact.dtype == np.dtype(expected)
    assert compact.flags.c_contiguous
    np.testing.assert_array_equal(compact, routes)


def test_compaction_makes_read_only_arrays_writable() -> None:
    routes = np.arange(12, dtype=np.uint8).reshape(3, 2, 2)
    routes.flags.writeable = False
    # r3arrow never hands out writable views of what it checked: a read-only input is
    # accepted as is, and a table built from it holds its own buffer.
    table = rollout_table(
        trajectory_id=["t"],
        group_id=["g"],
        prompt_ids=[[1, 2]],
        response_ids=[[3, 4]],
        loss_mask=[[1, 1]],
        reward=[0.0],
        routes=[routes],
        spec=RouteSpec(2, 2, 16),
    )
    np.testing.assert_array_equal(flat_routes(table)[0], routes)


def test_compaction_copies_non_contiguous_input() -> None:
    routes = np.arange(24).reshape(6, 2, 2)[::2]
    compact = decode_packed(encode_packed(routes))
    assert compact.flags.c_contiguous
    np.testing.assert_array_equal(compact, routes)


def test_compaction_of_nested_lists_follows_r3arrow_rule() -> None:
    # SkyRL refuses nested lists so the old list format cannot slip through. By design
    # r3arrow's adapter accepts SkyRL 0.3.0's nested lists (one np.asarray per trajectory)
    # and checks them like any array (docs/design.md, "Expert ids"): shape, range, duplicates.
    spec = RouteSpec(1, 2, 8)
    out = {
        "prompt_token_ids": [[1]],
        "response_ids": [[2]],
        "rewards": [0.0],
        "loss_masks": [[1]],
        "rollout_expert_indices": [[[[1, 2]]]],
    }
    table = from_generator_output(out, spec, uids=["u"])
    assert flat_routes(table)[0].tolist() == [[[1, 2]]]


@pytest.mark.parametrize(
    ("routes", "error"),
    [
        (np.array([1, 2]), RouteShapeError),  # not 3-D
        (np.array([[[1.0]]]), RouteDTypeError),  # not integral
        (np.array([[[-1]]]), ExpertRangeError),  # negative expert id
        (np.array([[[2**31]]], dtype=np.uint64), ExpertRangeError),  # exceeds int32
    ],
)
def test_compaction_rejects_invalid_routes(routes: np.ndarray, error: type[Exception]) -> None:
    with pytest.raises(error):
        encode_packed(routes)
    assert issubclass(error, ValueError | TypeError)  # SkyRL raises the builtins


# ------------------------------------------------------------------------------------------
# tests/backends/skyrl_train/inference_servers/test_generate_wire.py:
# pack_routed_experts / decode_packed_routed_experts -> encode_packed / decode_packed.
@pytest.mark.parametrize(
    ("routes", "expected"),
    [*COMPACTION, (np.arange(24).reshape(6, 2, 2)[::2], "uint8")],
)
def test_packed_routed_experts_round_trip(routes: np.ndarray, expected: str) -> None:
    payload = encode_packed(routes)
    decoded = decode_packed(payload)
    assert payload["dtype"] == expected and decoded.dtype.name == expected
    assert decoded.flags.c_contiguous
    np.testing.assert_array_equal(decoded, routes)


def test_packed_routed_experts_uses_raw_base64() -> None:
    assert encode_packed(np.array([[[1, 2, 3]]]))["data"] == "AQID"


@pytest.mark.parametrize(
    "routes", [np.array([1, 2]), np.array([[[-1]]]), np.array([[[2**31]]], dtype=np.uint64)]
)
def test_pack_rejects_invalid_routes(routes: np.ndarray) -> None:
    with pytest.raises(ValueError):
        encode_packed(routes)


def test_pack_of_nested_lists_follows_r3arrow_rule() -> None:
    # SkyRL: TypeError for nested lists. r3arrow's encoder takes any integer array-like
    # (it is the sending side; the ids are still checked), so the payload is valid.
    assert decode_packed(encode_packed([[[1, 2]]])).tolist() == [[[1, 2]]]


def test_pack_accepts_torch_tensors() -> None:
    routes = torch.arange(12, dtype=torch.int64).reshape(3, 2, 2)
    decoded = decode_packed(encode_packed(routes))
    assert decoded.dtype == np.uint8
    np.testing.assert_array_equal(decoded, routes.numpy())


def test_pack_moves_device_tensors_to_host() -> None:
    calls: list[str] = []

    class DeviceTensor:  # the call sequence of a CUDA tensor (duck-typed, as in SkyRL)
        def __init__(self, array: np.ndarray) -> None:
            self._array = array

        def detach(self) -> DeviceTensor:
            calls.append("detach")
            return self

        def cpu(self) -> DeviceTensor:
            calls.append("cpu")
            return self

        def numpy(self) -> np.ndarray:
            calls.append("numpy")
            return self._array

    routes = np.arange(12, dtype=np.int64).reshape(3, 2, 2)
    decoded = decode_packed(encode_packed(DeviceTensor(routes)))
    assert calls == ["detach", "cpu", "numpy"]
    np.testing.assert_array_equal(decoded, routes)


@pytest.mark.parametrize("shape", [[1, 1, 1], [np.int64(1), np.int32(1), 1]])
def test_decode_accepts_numpy_integer_dims(shape: list[Any]) -> None:
    assert decode_packed({"data": "AQ==", "shape": shape, "dtype": "uint8"}).shape == (1, 1, 1)


def test_decode_rejects_incorrect_byte_count() -> None:
    with pytest.raises(PayloadError, match="bytes"):
        decode_packed({"data": "AQ==", "shape": [2, 1, 1], "dtype": "uint8"})


@pytest.mark.parametrize(
    "payload",
    [
        {"data": "!", "shape": [1, 1, 1], "dtype": "uint8"},
        {"data": "AQ==", "shape": [True, 1, 1], "dtype": "uint8"},
        {"data": "AQ==", "shape": [np.bool_(True), 1, 1], "dtype": "uint8"},
        {"data": "AQ==", "shape": [1.0, 1, 1], "dtype": "uint8"},
        {"data": "AQ==", "shape": [-1, 1, 1], "dtype": "uint8"},
    ],
)
def test_decode_rejects_malformed_payloads(payload: dict[str, Any]) -> None:
    with pytest.raises(PayloadError):
        decode_packed(payload)


def test_decode_rejects_uint16_as_skyrl_does() -> None:
    with pytest.raises(RouteDTypeError, match="found 'uint16'"):
        decode_packed({"data": "AQA=", "shape": [1, 1, 1], "dtype": "uint16"})


def test_decode_of_noncanonical_dtype_follows_r3arrow_rule() -> None:
    # SkyRL refuses an int32 payload whose ids fit int16 ("non-canonical dtype"). r3arrow
    # decodes what the payload declares (engines disagree on wire dtypes, docs/design.md
    # "Expert ids") and checks the ids; the table then stores the spec's narrowest dtype.
    routes = np.array([[[300]]], dtype=np.int32)
    payload = {"data": base64.b64encode(routes.tobytes()).decode(), "shape": [1, 1, 1]}
    decoded = decode_packed({**payload, "dtype": "int32"})
    assert decoded.dtype == np.int32 and decoded.tolist() == [[[300]]]


# ------------------------------------------------------------------------------------------
# tests/backends/skyrl_train/distributed/test_token_metadata.py: TokenMetadataTrace and
# RoutedExpertTrace -> TokenTrace and RouteTrace (docs/design.md, "Rows and incremental capture").
def test_token_metadata_trace_chunks_and_independent_schema() -> None:
    trace, other = TokenTrace((3,), np.int32), TokenTrace((4,), np.float32)
    trace.record(np.ones((2, 3), dtype=np.int32), prompt_tokens=2, generated_tokens=1)
    trace.record(np.zeros((1, 3), dtype=np.int32), prompt_tokens=3, generated_tokens=1)
    with pytest.raises(RouteShapeError, match="num_tokens >= 4"):
        trace.finalize(num_tokens=2, loss_mask=[0, 0])
    result = trace.finalize(num_tokens=4, loss_mask=[0, 0, 0, 0])
    assert len(result) == 3
    assert len(other.finalize(num_tokens=0, loss_mask=[])) == 0
    with pytest.raises(TraceStateError, match="twice"):
        trace.finalize(num_tokens=4, loss_mask=[0, 0, 0, 0])


@pytest.mark.parametrize(
    ("rows", "match"),
    [
        (np.ones((2, 2), dtype=np.int32), "2|rows"),  # 2 rows where 1 is expected
        (np.ones((1, 3), dtype=np.int32), "3|shape"),  # another row shape
    ],
)
def test_token_metadata_trace_rejects_invalid_chunks(rows: np.ndarray, match: str) -> None:
    trace = TokenTrace((2,), np.int32)
    trace.record(np.ones((1, 2), dtype=np.int32), prompt_tokens=1, generated_tokens=1)
    with pytest.raises(R3ArrowError, match=match):
        trace.record(rows, prompt_tokens=2, generated_tokens=1)
    assert trace.captured == 1  # unchanged on error


def test_token_metadata_trace_non_contiguous_rows_follow_r3arrow_rule() -> None:
    # SkyRL refuses non-contiguous chunks; r3arrow copies them once into its buffer.
    trace = TokenTrace((1,), np.int32)
    trace.record(np.ones((2, 2), dtype=np.int32)[:, ::2], prompt_tokens=2, generated_tokens=1)
    assert trace.captured == 2


def test_token_metadata_trace_widens_instead_of_schema_changed() -> None:
    # SkyRL: "schema changed" when a later chunk has another dtype. By design a RouteTrace
    # widens its content (docs/design.md, "Expert ids": models above 256 experts crashed).
    trace = RouteTrace(RouteSpec(1, 2, None))
    trace.record(np.array([[[0, 1]]], dtype=np.uint8), prompt_tokens=1, generated_tokens=1)
    trace.record(np.array([[[300, 2]]], dtype=np.int16), prompt_tokens=2, generated_tokens=1)
    routes = trace.finalize(num_tokens=3, loss_mask=[0, 0, 0])
    assert pylist(routes) == [[[0, 1]], [[300, 2]]]


def _routes(rows: int) -> np.ndarray:
    return np.arange(rows * 4, dtype=np.int32).reshape(rows, 2, 2) % 8


def test_routed_expert_trace_tracks_multiturn_suffix_and_terminal_gap() -> None:
    trace = RouteTrace(RouteSpec(2, 2, 8))
    trace.record(_routes(4), prompt_tokens=3, generated_tokens=2)
    assert trace.captured == 4  # SkyRL's prompt_start
    trace.record(_routes(4), prompt_tokens=7, generated_tokens=2)
    result = trace.finalize(num_tokens=9, loss_mask=[0, 0, 0, 1, 1, 0, 0, 1, 1])
    # SkyRL pads to 9 rows with a dummy last row; r3arrow keeps the 8 captured rows and the
    # padding mask marks row 8 (docs/design.md, "Ragged routes and the terminal gap").
    assert len(result) == 8


@pytest.mark.parametrize("active", [False, True])
def test_routed_expert_trace_only_pads_masked_suffix(active: bool) -> None:
    trace = RouteTrace(RouteSpec(2, 2, 8))
    trace.record(_routes(3), prompt_tokens=3, generated_tokens=1)
    mask = [0, 0, 0, 0, int(active)]
    if active:
        with pytest.raises(TerminalGapError, match="loss-active target at token 4"):
            trace.finalize(num_tokens=5, loss_mask=mask)
    else:
        assert len(trace.finalize(num_tokens=5, loss_mask=mask)) == 3  # ragged: no dummy rows


# ------------------------------------------------------------------------------------------
# tests/backends/skyrl_train/distributed/test_token_metadata.py (packed layout):
# build_token_metadata_layout + align_token_metadata -> MegatronCollator(packed=True, align=4).
def test_microbatch_rows_share_one_packed_layout() -> None:
    spec = RouteSpec(1, 2, 32)
    # SkyRL's two left-padded rows [0,1,1,1] / [0,0,1,1]: 3 and 2 real tokens; the captured
    # rows are those its router mask leaves False (3 rows, and 2 rows), in r3arrow's terms.
    table = rollout_table(
        trajectory_id=["a", "b"],
        group_id=["g", "g"],
        prompt_ids=[[1], [2]],
        response_ids=[[3, 4], [5]],
        loss_mask=[[0, 0], [0]],
        reward=[0.0, 1.0],
        routes=[
            np.array([[[10, 11]], [[12, 13]], [[14, 15]]]),
            np.array([[[20, 21]], [[22, 23]]]),
        ],
        spec=spec,
    )
    mb = MegatronCollator(spec, packed=True, align=4)(table)
    dummy = [0, 1]
    assert mb.routes is not None
    assert mb.routes[0, :, 0].tolist() == [
        [10, 11],
        [12, 13],
        [14, 15],
        dummy,
        [20, 21],
        [22, 23],
        dummy,
        dummy,
    ]
    assert mb.padding_mask.tolist() == [[False, False, False, True, False, False, True, True]]
    assert mb.cu_seqlens_padded is not None and mb.cu_seqlens_padded.tolist() == [0, 4, 8]


# ------------------------------------------------------------------------------------------
# tests/train/dataset/test_preprocess.py: make_router_padding_mask and the routed-expert
# tensor of convert_prompts_responses_to_batch_tensors -> router_padding_mask and
# r3arrow.adapters.skyrl.to_training_inputs.
def _out(routes: list[Any], prompts: list[list[int]], responses: list[list[int]]) -> Any:
    return {
        "prompt_token_ids": prompts,
        "response_ids": responses,
        "rewards": [0.0] * len(prompts),
        "loss_masks": [[1] * len(r) for r in responses],
        "rollout_expert_indices": routes,
    }


def _batch(routes: list[Any], prompts: list[list[int]], responses: list[list[int]]) -> Any:
    spec = RouteSpec(np.asarray(routes[0]).shape[1], np.asarray(routes[0]).shape[2], 2**16)
    out = _out(routes, prompts, responses)
    return to_training_inputs(from_generator_output(out, spec, uids=["u"] * len(prompts)))


def test_router_padding_mask_marks_left_padding_and_uncaptured_suffix() -> None:
    spec = RouteSpec(1, 2, 8)
    # SkyRL: attention [[0,1,1,1],[1,1,1,1]], captured [2, 4].
    routes = [np.tile([[[0, 1]]], (2, 1, 1)), np.tile([[[0, 1]]], (4, 1, 1))]
    out = _out(routes, [[1], [1, 2]], [[2, 3], [3, 4]])
    out["loss_masks"] = [[1, 0], [1, 1]]
    table = from_generator_output(out, spec, uids=["a", "b"])
    assert pylist(router_padding_mask(table)) == [[False, False, True], [False] * 4]
    batch = to_training_inputs(table)
    assert batch["router_padding_mask"].tolist() == [
        [True, False, False, True],
        [False, False, False, False],
    ]


def test_routed_expert_tensor_uses_unique_dummy_routes() -> None:
    routes = [
        np.asarray([[[2, 3], [4, 5]], [[6, 7], [0, 1]]], dtype=np.uint8),
        np.asarray([[[1, 2], [3, 4]], [[5, 6], [7, 0]], [[2, 4], [6, 7]]], dtype=np.uint8),
    ]
    routed = _batch(routes, [[10], [20]], [[11, 12], [21, 22]])["rollout_expert_indices"]
    assert routed.shape == (2, 3, 2, 2) and routed.dtype == np.uint8
    assert routed[0, 2].tolist() == [[0, 1], [0, 1]]


@pytest.mark.parametrize(
    ("max_id", "source", "expected"), [(2**8, np.int16, np.int16), (2**15, np.int32, np.int32)]
)
def test_routed_expert_tensor_promotes_mixed_batch_dtype(
    max_id: int, source: type[np.integer[Any]], expected: type[np.integer[Any]]
) -> None:
    routes = [
        np.asarray([[[1, 2]]], dtype=np.uint8),
        np.asarray([[[max_id, max_id + 1]]], dtype=source),
    ]
    routed = _batch(routes, [[10], [20]], [[11], [21]])["rollout_expert_indices"]
    assert routed.dtype == expected
    assert routed[1, 0].tolist() == [[max_id, max_id + 1]]


def test_routed_expert_tensor_accepts_read_only_arrays() -> None:
    routes = np.asarray([[[1, 2]], [[3, 4]]], dtype=np.uint8)
    routes.flags.writeable = False
    routed = _batch([routes], [[10]], [[11]])["rollout_expert_indices"]
    assert routed.dtype == np.uint8 and routed.tolist() == [[[[1, 2]], [[3, 4]]]]


def test_routed_expert_tensor_nested_lists_follow_r3arrow_rule() -> None:
    # SkyRL #1912 refuses nested lists here; r3arrow accepts the released 0.3.0 layout.
    routed = _batch([[[[1, 2]], [[3, 4]]]], [[10]], [[11]])["rollout_expert_indices"]
    assert routed.tolist() == [[[[1, 2]], [[3, 4]]]]


@pytest.mark.parametrize("dtype", [np.uint16, np.int64])
def test_routed_expert_tensor_narrows_wide_dtypes(dtype: type[np.integer[Any]]) -> None:
    routes = np.asarray([[[1, 2]], [[3, 4]]], dtype=dtype)
    routed = _batch([routes], [[10]], [[11]])["rollout_expert_indices"]
    assert routed.dtype == np.uint8 and routed.tolist() == [[[[1, 2]], [[3, 4]]]]


def test_routed_expert_tensor_retightens_after_truncation() -> None:
    routes = np.asarray([[[1, 2]], [[3, 4]], [[300, 5]]], dtype=np.int16)
    routed = _batch([routes[:2]], [[10]], [[11]])["rollout_expert_indices"]
    assert routed.dtype == np.uint8 and routed.tolist() == [[[[1, 2]], [[3, 4]]]]


def test_rollout_expert_indices_shape_padding_and_alignment() -> None:
    rei_0 = np.asarray([[[1, 2]] * 2 for _ in range(5)], dtype=np.uint8)
    rei_1 = np.asarray([[[3, 4]] * 2 for _ in range(6)], dtype=np.uint8)
    batch = _batch([rei_0, rei_1], [[1, 2], [3, 4, 5, 6]], [[10, 11, 12], [20, 21]])
    rei, attn = batch["rollout_expert_indices"], batch["attention_mask"]
    assert rei.shape == (2, 6, 2, 2)
    dummy = [[0, 1]] * 2
    assert rei[0, 0].tolist() == dummy and rei[0, 1].tolist() == [[1, 2]] * 2
    assert rei[1, 0].tolist() == [[3, 4]] * 2
    assert ((rei == np.array(dummy)).all(axis=(2, 3)) == (attn == 0)).all()


# ------------------------------------------------------------------------------------------
# tests/backends/skyrl_train/utils/test_replay_utils.py: replay padding indices and the
# sequence-parallel padding mask -> dummy_route_row and megatron.model_inputs.
@pytest.mark.parametrize("dtype", [np.uint8, np.uint16, np.int32])
def test_replay_padding_indices_are_unique(dtype: type[np.integer[Any]]) -> None:
    # r3arrow's storage dtypes are uint8/uint16/int32 (SkyRL's int16 is its wire dtype).
    e = {np.uint8: 8, np.uint16: 300, np.int32: 70_000}[dtype]
    row = dummy_route_row(RouteSpec(4, 3, e))
    assert row.dtype == dtype and row.shape == (4, 3)
    np.testing.assert_array_equal(row, np.broadcast_to(np.arange(3), (4, 3)))


@pytest.mark.parametrize("topk", [0, -1])
def test_replay_padding_rejects_missing_topk(topk: int) -> None:
    with pytest.raises(ValueError, match="topk"):
        RouteSpec(4, topk, 8)


@pytest.mark.parametrize(
    ("pre_process", "expected"),
    [
        (True, [[False, False, True, True]]),  # "gpt", first stage: megatron scatters itself
        (False, [[True, True]]),  # "gpt", later stage: pre-scattered (rank 1 of tp 2)
    ],
)
def test_sequence_parallel_mask_layout(pre_process: bool, expected: list[list[bool]]) -> None:
    # SkyRL's third case ("hybrid" models, which never scatter) is pre_process=False here:
    # r3arrow asks the caller whether the stage scatters, not which model class it is.
    from r3arrow.megatron import model_inputs

    spec = RouteSpec(1, 2, 8)
    table = rollout_table(
        trajectory_id=["t"],
        group_id=["g"],
        prompt_ids=[[1, 2]],
        response_ids=[[3, 4]],
        loss_mask=[[0, 0]],
        reward=[0.0],
        routes=[np.array([[[0, 1]], [[2, 3]]])],
        spec=spec,
    )
    mb = MegatronCollator(spec, parallel=Parallelism(tp_size=2, tp_rank=1, sequence_parallel=True))(
        table
    )
    assert model_inputs(mb, pre_process=pre_process)["padding_mask"].tolist() == expected


# ------------------------------------------------------------------------------------------
# tests/train/test_trainer_utils.py: dynamic sampling (zero_variance_filter,
# handle_replace_sampling, handle_filter_sampling, filter_generator_output) ->
# varied_groups, replace_groups, filter_groups, take_rows (docs/design.md,
# "Dynamic sampling").
def _table(
    rewards: list[Any], uids: list[str], *, masks: list[list[int]] | None = None
) -> pa.Table:
    """SkyRL's generator output of the case as a rollout table (one route row per token)."""
    n = len(rewards)
    extra: dict[str, Any] = {}
    if isinstance(rewards[0], list):  # token-level rewards: one per response token
        responses = [[10 + i] * len(r) for i, r in enumerate(rewards)]
        masks = [[1] * len(r) for r in rewards]
        extra["token_rewards"] = pa.array(rewards, type=pa.large_list(pa.float64()))
        scalar = [float(sum(r)) for r in rewards]
    else:
        responses = [[10 + i, 20 + i] for i in range(n)]
        masks = masks or [[1, 1]] * n
        scalar = [float(r) for r in rewards]
    routes = [np.array([[[i % 7, i % 7 + 1]]] * (2 + len(r))) for i, r in enumerate(responses)]
    return rollout_table(
        trajectory_id=[f"t{i}" for i in range(n)],
        group_id=uids,
        prompt_ids=[[1, 2]] * n,
        response_ids=responses,
        loss_mask=masks,
        reward=scalar,
        routes=routes,
        spec=RouteSpec(1, 2, 8),
        **extra,
    )


def _kept(table: pa.Table, **kw: Any) -> list[int]:
    return [int(i) for i in np.flatnonzero(varied_groups(table, **kw))]


def test_zero_variance_filter_mixed_groups() -> None:
    t = _table([1.0, 2.0, 3.0, 3.0, 5.0], ["uid1", "uid1", "uid2", "uid2", "uid3"])
    assert _kept(t) == [0, 1, 4]


def test_zero_variance_filter_all_zero_variance_duplicates() -> None:
    assert _kept(_table([1.0, 1.0, 2.0, 2.0], ["a", "a", "b", "b"])) == []


def test_zero_variance_filter_singletons_kept() -> None:
    assert _kept(_table([1.0, 1.0, 1.0], ["x", "y", "z"])) == [0, 1, 2]


def test_zero_variance_filter_tolerance() -> None:
    t = _table([0.6667, 0.66670001, 1.0, 0.0], ["a", "a", "b", "b"])
    assert _kept(t, tolerance=0.0) == [0, 1, 2, 3]
    assert _kept(t, tolerance=1e-6) == [2, 3]


def test_zero_variance_filter_ignores_masked_trajectories() -> None:
    t = _table([1.0, 1.0, 0.0, 0.0], ["a"] * 4, masks=[[1, 1], [1, 1], [0, 0], [0, 0]])
    assert _kept(t) == []


def test_zero_variance_filter_single_live_trajectory_kept() -> None:
    t = _table([1.0, 0.0], ["a", "a"], masks=[[1, 1], [0, 0]])
    assert _kept(t) == [0, 1]


def test_handle_replace_sampling_sufficient_good_samples() -> None:
    t = _table([1.0, 2.0, 1.0, 1.0, 3.0, 4.0], ["uid1", "uid1", "uid2", "uid2", "uid3", "uid3"])
    result = replace_groups(t, min_replace_ratio=0.3)
    assert result.enough is True
    out = result.table
    assert out.num_rows == 6
    assert "uid2" not in out.column("group_id").to_pylist()
    # routes travel with their rows: every row's routes are those of its response
    by_response = {tuple(r): i for i, r in enumerate(pylist(t.column("response_ids")))}
    values, offsets = flat_routes(t)
    out_values, out_offsets = flat_routes(out)
    for j, response in enumerate(pylist(out.column("response_ids"))):
        i = by_response[tuple(response)]
        np.testing.assert_array_equal(
            out_values[out_offsets[j] : out_offsets[j + 1]], values[offsets[i] : offsets[i + 1]]
        )


def test_handle_replace_sampling_insufficient_good_samples() -> None:
    t = _table([1.0, 1.0, 2.0, 2.0], ["uid1", "uid1", "uid2", "uid2"])
    result = replace_groups(t, min_replace_ratio=0.3)
    assert result.enough is False  # SkyRL's keep_sampling=True
    assert result.table.equals(t)


def test_handle_replace_sampling_single_sample_per_prompt() -> None:
    t = _table([1.0, 1.0], ["uid1", "uid2"])
    result = replace_groups(t, min_replace_ratio=0.3)
    assert result.enough is True and result.table.equals(t)


def test_handle_replace_sampling_token_level_rewards() -> None:
    # SkyRL's comment says uid1 varies and uid2 is uniform ([2.0, 2.0]); its data has [1.0]
    # as uid2's last reward (sum 1.0, so varied). [2.0] encodes the stated intent.
    t = _table([[1.0, 2.0], [3.0, 4.0, 5.0], [1.0, 1.0], [2.0]], ["uid1", "uid1", "uid2", "uid2"])
    assert _kept(t, value="token_rewards", reduce="sum") == [0, 1]
    result = replace_groups(t, value="token_rewards", reduce="sum", min_replace_ratio=0.3)
    assert result.enough is True and result.table.num_rows == 4


def test_handle_filter_sampling_sufficient_prompts() -> None:
    kept = filter_groups(_table([1.0, 2.0, 3.0, 3.0], ["uid1", "uid1", "uid2", "uid2"]))
    assert kept.column("group_id").to_pylist() == ["uid1", "uid1"]


def test_handle_filter_sampling_accumulation() -> None:
    # SkyRL accumulates filtered batches until train_batch_size prompts: r3arrow's tables
    # concatenate, and the routes stay with their rows.
    first = filter_groups(_table([1.0, 2.0], ["uid1", "uid1"]))
    second = filter_groups(_table([3.0, 4.0], ["uid2", "uid2"]))
    both = pa.concat_tables([first, second])
    assert both.num_rows == 4 and captured_lengths(both).tolist() == [4, 4, 4, 4]


def test_handle_filter_sampling_single_sample_per_prompt() -> None:
    kept = filter_groups(_table([1.0, 1.0], ["uid1", "uid2"]))
    assert kept.num_rows == 2


def test_filter_generator_output() -> None:
    t = _table([1.0, 2.0, 3.0], ["a", "b", "c"])
    filtered = take_rows(t, [0, 2])
    assert filtered.column("reward").to_pylist() == [1.0, 3.0]
    assert filtered.column("response_ids").to_pylist() == [[10, 20], [12, 22]]
    values, _ = flat_routes(t)
    np.testing.assert_array_equal(
        flat_routes(filtered)[0], np.concatenate([values[0:4], values[8:12]])
    )


# ------------------------------------------------------------------------------------------
# tests/backends/skyrl_train/test_token_based_batching_utils.py:
# TokenBasedBatchIterator._create_padding_microbatch -> split_microbatches(dp_size=...)
# padding microbatches collated by MegatronCollator.
def test_padding_microbatch_uses_unique_dummy_routes() -> None:
    from r3arrow.microbatch import split_microbatches

    spec = RouteSpec(2, 3, 16)
    routes = [np.tile(np.array([[7, 8, 9]]), (3, 2, 1))]
    table = rollout_table(
        trajectory_id=["t"],
        group_id=["g"],
        prompt_ids=[[1, 2]],
        response_ids=[[3, 4]],
        loss_mask=[[1, 1]],
        reward=[0.0],
        routes=routes,
        spec=spec,
    )
    # two DP ranks, one trajectory: rank 1 gets a padding microbatch
    (part,) = split_microbatches(table, max_tokens=8, dp_size=2, dp_rank=1)
    mb = MegatronCollator(spec)(part)
    assert mb.routes is not None
    expected = torch.tensor([0, 1, 2], dtype=torch.int32).expand_as(mb.routes)
    assert torch.equal(mb.routes, expected)
    assert bool(mb.padding_mask.all()) and float(mb.loss_mask.sum()) == 0.0


# ------------------------------------------------------------------------------------------
# tests/backends/skyrl_train/test_train_batch.py (test_train_batch_pickle_uint_dtypes):
# SkyRL pickles batches across Ray; r3arrow never pickles and moves routes through Arrow
# IPC / Parquet, which must keep the storage dtype.
@pytest.mark.parametrize("num_experts", [8, 300, 70_000])
def test_train_batch_serialisation_keeps_route_dtypes(num_experts: int, tmp_path: Path) -> None:
    from r3arrow.io import read_rollouts, write_ipc, write_rollouts

    spec = RouteSpec(1, 2, num_experts)
    table = rollout_table(
        trajectory_id=["t"],
        group_id=["g"],
        prompt_ids=[[1]],
        response_ids=[[2]],
        loss_mask=[[1]],
        reward=[1.0],
        routes=[np.array([[[num_experts - 1, 0]]])],
        spec=spec,
    )
    for back in (
        read_rollouts(write_rollouts(table, tmp_path / "r.parquet")),
        read_rollouts(write_ipc(table, tmp_path / "r.arrow")),
    ):
        values = flat_routes(back)[0]
        assert values.dtype == spec.dtype and values.tolist() == [[[num_experts - 1, 0]]]


# ------------------------------------------------------------------------------------------
# tests/backends/skyrl_train/inference_servers/test_remote_inference_client.py and
# tests/train/generators/test_skyrl_gym_generator.py: the client decodes routes and sends
# the prompt start; a multi-turn loop captures incrementally -> EngineClient + RouteTrace
# against the embedded engine over real HTTP.
@pytest.fixture
def engine() -> Any:
    from r3arrow.testing.engine import ReferenceEngine, TinyMoEConfig

    return ReferenceEngine(TinyMoEConfig(seed=0, vocab_size=64))


def test_generate_decodes_routes_and_sends_prompt_start(server: Any, engine: Any) -> None:
    import asyncio

    from r3arrow.client import EngineClient

    spec = engine.config.route_spec()

    async def run() -> tuple[int, int, int]:
        trace = RouteTrace(spec)
        async with EngineClient(server.url, spec, vocab_size=64) as client:
            first = await client.generate(
                [1, 2, 3], sampling_params={"max_tokens": 2, "ignore_eos": True}, trace=trace
            )
            after_first = trace.captured
            prompt = [1, 2, 3, *first.token_ids, 5, 6]
            await client.generate(
                prompt, sampling_params={"max_tokens": 2, "ignore_eos": True}, trace=trace
            )
            return after_first, trace.captured, int(client.stats["route_rows"])

    after_first, captured, transferred = asyncio.run(run())
    assert after_first == 3 + 2 - 1  # P - 0 + G - 1 rows
    assert captured == 7 + 2 - 1  # the whole conversation but the last sampled token
    assert transferred == captured  # incremental: the second request started at row 4


def test_generate_rejects_list_routed_experts() -> None:
    from r3arrow.codec import decode_vllm

    # SkyRL: the wire must carry packed routes, not nested lists.
    with pytest.raises((PayloadError, TypeError)):
        decode_vllm([[[0, 1]]])  # type: ignore[arg-type]
