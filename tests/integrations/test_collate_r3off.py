"""R3 off: `MegatronCollator(spec=None)` on rollout tables without routes.

The model inputs must be exactly those of the same trajectories collated with routes
captured on every token; the microbatch has no replay targets and refuses to hand any out.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from r3arrow import RouteSpec
from r3arrow.collate import MegatronCollator, Microbatch, Parallelism
from r3arrow.errors import ReplayError, SchemaError
from r3arrow.megatron import install_replay, model_inputs
from r3arrow.megatron._stages import _stage_padding_mask  # no megatron-core import (packed)
from r3arrow.microbatch import is_padding_table, padding_table, split_microbatches
from r3arrow.table import rollout_table
from r3arrow.testing import random_rollouts
from r3arrow.testing.strategies import specs

TOKEN_FIELDS = (
    "input_ids",
    "position_ids",
    "labels",
    "loss_mask",
    "label_mask",
    "padding_mask",
    "cu_seqlens",
    "cu_seqlens_padded",
    "token_index",
)


def _plain_table(
    prompts: list[list[int]], responses: list[list[int]], masks: list[list[int]]
) -> pa.Table:
    """A rollout table without routes nor r3arrow metadata, built with pyarrow directly."""
    rows = len(prompts)
    return pa.table(
        {
            "trajectory_id": pa.array([f"t{i}" for i in range(rows)], pa.large_string()),
            "group_id": pa.array(["g"] * rows, pa.large_string()),
            "prompt_ids": pa.array(prompts, pa.large_list(pa.int32())),
            "response_ids": pa.array(responses, pa.large_list(pa.int32())),
            "loss_mask": pa.array(masks, pa.large_list(pa.uint8())),
            "reward": pa.array([0.0] * rows, pa.float64()),
        }
    )


def _without_routes(table: pa.Table) -> pa.Table:
    return table.drop_columns(["routes"]).replace_schema_metadata(None)


def _assert_same_inputs(off: Microbatch, on: Microbatch) -> None:
    for name in TOKEN_FIELDS:
        a, b = getattr(off, name), getattr(on, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == b.dtype and torch.equal(a, b), name
    np.testing.assert_array_equal(off.seq_lens, on.seq_lens)
    assert (off.max_seqlen, off.num_router_tokens) == (on.max_seqlen, on.num_router_tokens)


def test_r3_off_literal_uncaptured_suffix_is_not_padding() -> None:
    table = _plain_table([[5, 6], [7]], [[8, 9, 10], [11]], [[1, 1, 0], [1]])
    mb = MegatronCollator(None, align=4)(table)
    assert mb.routes is None and mb.layer_major is None and mb.spec is None and not mb.r3
    assert mb.layers == () and not mb.is_padding
    assert mb.input_ids.tolist() == [[5, 6, 8, 9, 10, 0, 0, 0], [7, 11, 0, 0, 0, 0, 0, 0]]
    assert mb.loss_mask.tolist() == [[0, 0, 1, 1, 0, 0, 0, 0], [0, 1, 0, 0, 0, 0, 0, 0]]
    assert mb.labels[0, :4].tolist() == [6, 8, 9, 10]
    # only alignment and batch padding are padding: the routers route every real token
    assert mb.padding_mask.tolist() == [[False] * 5 + [True] * 3, [False] * 2 + [True] * 6]
    np.testing.assert_array_equal(mb.captured, mb.seq_lens)
    assert mb.num_router_tokens == 16 and "r3 off" in repr(mb)
    kw = model_inputs(mb)  # megatron-core not needed unpacked
    assert kw["padding_mask"] is mb.padding_mask and kw["input_ids"] is mb.input_ids
    packed = MegatronCollator(None, packed=True, align=4)(table)
    assert packed.cu_seqlens is not None and packed.cu_seqlens.tolist() == [0, 5, 7]
    assert packed.cu_seqlens_padded is not None and packed.cu_seqlens_padded.tolist() == [0, 8, 12]
    assert packed.padding_mask.tolist() == [[False] * 5 + [True] * 3 + [False] * 2 + [True] * 2]


def test_r3_off_refuses_replay_clearly() -> None:
    mb = MegatronCollator(None)(_plain_table([[1]], [[2, 3]], [[1, 1]]))
    with pytest.raises(ReplayError, match=r"collated with R3 off"):
        mb.replay_targets()
    with pytest.raises(ReplayError, match=r"collated with R3 off"):
        mb.replay_tensor()
    with pytest.raises(ReplayError, match=r"install_replay: expected a microbatch with routes"):
        install_replay(mb)
    assert mb.to("cpu").routes is None


def test_r3_off_argument_and_table_errors() -> None:
    spec = RouteSpec(num_layers=2, topk=2, num_experts=4)
    plain = _plain_table([[1]], [[2]], [[1]])
    with pytest.raises(ValueError, match=r"layers: expected None with R3 off"):
        MegatronCollator(None, layers=[0])
    with pytest.raises(TypeError, match=r"RouteSpec \(or None for R3 off\)"):
        MegatronCollator("spec")  # type: ignore[arg-type]
    with pytest.raises(SchemaError, match=r"expected column 'routes'.*spec=None\) \(R3 off\)"):
        MegatronCollator(spec)(plain)
    with pytest.raises(SchemaError, match=r"expected column 'loss_mask'"):
        MegatronCollator(None)(plain.drop_columns(["loss_mask"]))
    bad = plain.set_column(2, "prompt_ids", pa.array([["a"]], pa.large_list(pa.string())))
    with pytest.raises(SchemaError, match=r"'prompt_ids': expected a list of integers"):
        MegatronCollator(None)(bad)
    with pytest.raises(SchemaError, match=r"row 0: expected .*loss_mask over the 1 response"):
        MegatronCollator(None)(_plain_table([[1]], [[2]], [[1, 1]]))
    with pytest.raises(SchemaError, match="empty table"):
        MegatronCollator(None)(plain.slice(0, 0))


def test_r3_off_table_with_a_routes_column_ignores_it() -> None:
    spec = RouteSpec(num_layers=2, topk=2, num_experts=4)
    table = random_rollouts(np.random.default_rng(0), spec, [(2, 3, 5), (1, 2, 3)])
    off, on = MegatronCollator(None)(table), MegatronCollator(spec)(table)
    _assert_same_inputs(off, on)
    assert off.routes is None


def test_r3_off_padding_microbatch() -> None:
    table = _plain_table([[1, 2], [3]], [[4], [5, 6]], [[1], [1, 0]])
    parts = split_microbatches(table, num_microbatches=1, dp_size=3, dp_rank=2)
    assert len(parts) == 1 and is_padding_table(parts[0])
    mb = MegatronCollator(None, align=4, pad_token_id=-1)(parts[0])
    assert mb.is_padding and mb.routes is None
    assert bool(mb.padding_mask.all()) and float(mb.loss_mask.sum()) == 0.0
    assert mb.input_ids.tolist() == [[-1] * 4] and "padding" in repr(mb)
    assert padding_table(table).schema.metadata == {b"r3arrow.padding": b"1"}


@st.composite
def _full_capture_cases(draw: st.DrawFn) -> tuple[RouteSpec, pa.Table, dict[str, Any]]:
    """A table whose routes cover every token, and collator settings (TP, CP, SP, packing)."""
    spec = draw(specs(max_layers=3, max_topk=2, widths=("uint8",)))
    rows = draw(st.integers(1, 5))
    shapes = []
    for _ in range(rows):
        p, r = draw(st.integers(0, 6)), draw(st.integers(0, 6))
        if p + r == 0:
            p = 1
        shapes.append((p, r, p + r))
    table = random_rollouts(np.random.default_rng(draw(st.integers(0, 2**16))), spec, shapes)
    tp = draw(st.sampled_from([1, 2]))
    cp = draw(st.sampled_from([1, 2]))
    kw = {
        "packed": draw(st.booleans()),
        "align": draw(st.sampled_from([1, 3, 4])),
        "parallel": Parallelism(
            tp_size=tp,
            tp_rank=draw(st.integers(0, tp - 1)),
            cp_size=cp,
            cp_rank=draw(st.integers(0, cp - 1)),
            sequence_parallel=draw(st.booleans()),
        ),
    }
    return spec, table, kw


@settings(max_examples=60, deadline=None)
@given(_full_capture_cases())
def test_r3_off_inputs_equal_fully_captured_r3_on(
    case: tuple[RouteSpec, pa.Table, dict[str, Any]],
) -> None:
    spec, table, kw = case
    on = MegatronCollator(spec, **kw)(table)
    off = MegatronCollator(None, **kw)(_without_routes(table))
    _assert_same_inputs(off, on)
    assert off.routes is None and on.routes is not None
    for pre_process in (True, False):
        a = _stage_padding_mask(off, pre_process=pre_process)
        assert torch.equal(a, _stage_padding_mask(on, pre_process=pre_process))


def test_r3_off_rollout_table_without_routes_collates_like_a_plain_table() -> None:
    prompts, responses, masks = [[5, 6], [7]], [[8, 9, 10], [11]], [[1, 1, 0], [1]]
    built = rollout_table(
        trajectory_id=["t0", "t1"],
        group_id=["g", "g"],
        prompt_ids=prompts,
        response_ids=responses,
        loss_mask=masks,
        reward=[0.0, 0.0],
        routes=None,
    )
    assert "routes" not in built.schema.names
    for packed in (False, True):
        collate = MegatronCollator(None, packed=packed, align=4)
        _assert_same_inputs(collate(built), collate(_plain_table(prompts, responses, masks)))
