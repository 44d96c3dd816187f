"""r3arrow.adapters.verl against a real verl 0.9.1 DataProto (docs/frameworks/verl.md)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from r3arrow import R3ArrowError, RouteSpec
from r3arrow._schema import list_lengths
from r3arrow.errors import DuplicateExpertError, ExpertRangeError, RouteShapeError, SchemaError
from r3arrow.table import captured_lengths, flat_routes, take_rows
from r3arrow.testing import assert_rollouts_equal, random_routes
from r3arrow.testing.strategies import rollout_tables, specs

torch = pytest.importorskip("torch", reason="torch is not installed (the torch extra)")
protocol = pytest.importorskip(
    "verl.protocol", reason="verl is not installed (pip install --no-deps verl==0.9.1)"
)
from r3arrow.adapters.verl import (  # noqa: E402
    CAPTURED_KEY,
    SCHEMA_KEY,
    from_dataproto,
    to_dataproto,
)

PAD = 151643
SPEC = RouteSpec(num_layers=4, topk=2, num_experts=8, moe_layers=(1, 2, 3))


def _float32_rewards(table: pa.Table) -> pa.Table:
    """verl's rm_scores are float32: round rewards so the round trip can be exact."""
    i = table.schema.get_field_index("reward")
    reward = table.column("reward").to_numpy().astype(np.float32).astype(np.float64)
    return table.set_column(i, table.schema.field("reward"), pa.array(reward))


def _verl_batch(
    prompts: Sequence[Sequence[int]],
    responses: Sequence[Sequence[int]],
    masks: Sequence[Sequence[int]],
    engine_rows: Sequence[np.ndarray],
    scores: Sequence[float],
    *,
    width_p: int,
    width_r: int,
    uids: Sequence[str],
) -> Any:
    """A DataProto built the way verl 0.9.1 builds one, step by step (not via the adapter).

    ``AgentLoopWorker._agent_loop_postprocess``: tokenizer.pad left (prompts) / right
    (responses, response_mask), ``response_mask * response_attention_mask``, routes as int16
    at ``start_pos = prompt_width - len(prompt)``, ``compute_position_id_with_mask``;
    ``_postprocess``: ``rm_scores[arange, attention_mask[:, P:].sum(1) - 1] = scores``.
    """
    rows = []
    for p, r, m, e in zip(prompts, responses, masks, engine_rows, strict=True):
        pp = torch.tensor([PAD] * (width_p - len(p)) + list(p), dtype=torch.long)
        pa_ = torch.tensor([0] * (width_p - len(p)) + [1] * len(p), dtype=torch.long)
        rr = torch.tensor(list(r) + [PAD] * (width_r - len(r)), dtype=torch.long)
        ra = torch.tensor([1] * len(r) + [0] * (width_r - len(r)), dtype=torch.long)
        mm = torch.tensor(list(m) + [PAD] * (width_r - len(m)), dtype=torch.long) * ra
        att = torch.cat([pa_, ra])
        routes = torch.zeros(width_p + width_r, *e.shape[1:], dtype=torch.int16)
        start = width_p - len(p)
        routes[start : start + e.shape[0]] = torch.from_numpy(e.astype(np.int16))
        rows.append((pp, rr, mm, att, torch.cat([pp, rr]), routes))
    prompts_t, responses_t, mask_t, att_t, ids_t, routes_t = (
        torch.stack([row[i] for row in rows]) for i in range(6)
    )
    position = torch.clip(torch.cumsum(att_t, dim=-1) - 1, min=0, max=None)
    rm = torch.zeros_like(mask_t, dtype=torch.float32)
    rm[torch.arange(len(rows)), att_t[:, width_p:].sum(dim=1) - 1] = torch.tensor(
        list(scores), dtype=torch.float32
    )
    return protocol.DataProto.from_dict(
        tensors={
            "prompts": prompts_t,
            "responses": responses_t,
            "response_mask": mask_t,
            "input_ids": ids_t,
            "attention_mask": att_t,
            "position_ids": position,
            "routed_experts": routes_t,
            "rm_scores": rm,
        },
        non_tensors={"uid": np.array(list(uids), dtype=object)},
    )


def _single_turn(spec: RouteSpec = SPEC, seed: int = 0) -> tuple[Any, list[np.ndarray]]:
    """Three single-turn samples; the engine routes every token but the last sampled one."""
    rng = np.random.default_rng(seed)
    plens, rlens = [3, 5, 1], [4, 2, 6]
    prompts = [rng.integers(0, 1000, n).tolist() for n in plens]
    responses = [rng.integers(0, 1000, n).tolist() for n in rlens]
    rows = [random_routes(rng, p + r - 1, spec) for p, r in zip(plens, rlens, strict=True)]
    data = _verl_batch(
        prompts,
        responses,
        [[1] * n for n in rlens],
        rows,
        [1.0, 0.0, 0.5],
        width_p=6,
        width_r=7,
        uids=["a", "a", "b"],
    )
    return data, rows


def _assert_same_tensors(a: Any, b: Any) -> None:
    assert set(a.batch.keys()) == set(b.batch.keys())
    for key in a.batch.keys():  # noqa: SIM118 - iterating a TensorDict walks its rows
        x, y = a.batch[key], b.batch[key]
        assert x.dtype == y.dtype, key
        assert torch.equal(x, y), key


def test_verl_built_batch_reads_and_round_trips() -> None:
    data, rows = _single_turn()
    table = from_dataproto(data, SPEC, pad_token_id=PAD)
    assert table.column("group_id").to_pylist() == ["a", "a", "b"]
    assert table.column("trajectory_id").to_pylist() == ["0", "1", "2"]
    assert table.column("reward").to_pylist() == [1.0, 0.0, 0.5]
    assert list_lengths(table.column("prompt_ids")).tolist() == [3, 5, 1]
    assert data.batch["prompts"][0, 3:].tolist() == table.column("prompt_ids")[0].as_py()
    # verl's rule: every attended row but the last
    assert captured_lengths(table).tolist() == [6, 6, 6]
    assert flat_routes(table)[0].tolist() == np.concatenate(rows).tolist()
    again = to_dataproto(table, pad_token_id=PAD, max_prompt_length=6, max_response_length=7)
    _assert_same_tensors(data, again)
    assert again.non_tensor_batch["uid"].tolist() == ["a", "a", "b"]
    assert again.non_tensor_batch[CAPTURED_KEY].tolist() == [6, 6, 6]
    assert_rollouts_equal(from_dataproto(again, SPEC), table)


def test_layout_matches_verl() -> None:
    data, _ = _single_turn()
    table = from_dataproto(data, SPEC)
    out = to_dataproto(table, pad_token_id=PAD)
    b = out.batch
    assert b["prompts"].shape == (3, 5) and b["responses"].shape == (3, 6)
    for key in ("prompts", "responses", "input_ids", "attention_mask", "position_ids"):
        assert b[key].dtype == torch.int64, key
    assert b["response_mask"].dtype == torch.int64
    assert b["rm_scores"].dtype == torch.float32
    assert b["routed_experts"].dtype == torch.int16
    assert b["routed_experts"].shape == (3, 11, 4, 2)
    assert b["prompts"][2].tolist()[:4] == [PAD] * 4  # left-padded
    assert b["responses"][1].tolist()[2:] == [PAD] * 4  # right-padded
    assert torch.equal(b["input_ids"], torch.cat([b["prompts"], b["responses"]], dim=1))
    att = b["attention_mask"]
    assert torch.equal(b["position_ids"], torch.clip(torch.cumsum(att, -1) - 1, min=0))
    assert b["rm_scores"][0].tolist() == [0.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    # routes sit at the attended tokens; padding rows are zero
    assert not b["routed_experts"][att == 0].any()


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_table_round_trip_exact(data: st.DataObject) -> None:
    spec = data.draw(specs(widths=("uint8",)))
    table = _float32_rewards(data.draw(rollout_tables(spec)))
    if table.num_rows:
        rlen = np.asarray(list_lengths(table.column("response_ids")).tolist())
        if rlen.max() == 0:
            return  # verl keeps the score in a response column: none exists
    extra_p, extra_r = data.draw(st.integers(0, 3)), data.draw(st.integers(0, 3))
    plen = list_lengths(table.column("prompt_ids")).tolist()
    rlen_l = list_lengths(table.column("response_ids")).tolist()
    proto = to_dataproto(
        table,
        pad_token_id=0,
        max_prompt_length=max(plen, default=0) + extra_p,
        max_response_length=max(rlen_l, default=1) + extra_r,
    )
    back = from_dataproto(proto, spec, pad_token_id=0)
    assert_rollouts_equal(back, table)
    _assert_same_tensors(proto, to_dataproto(back, pad_token_id=0, **_widths(proto)))


def _widths(proto: Any) -> dict[str, int]:
    return {
        "max_prompt_length": int(proto.batch["prompts"].shape[1]),
        "max_response_length": int(proto.batch["responses"].shape[1]),
    }


def test_verl_dataproto_operations() -> None:
    data, _ = _single_turn()
    table = from_dataproto(data, SPEC)
    proto = to_dataproto(table, pad_token_id=PAD)
    both = protocol.DataProto.concat([proto, proto])
    assert len(both) == 6
    with pytest.raises(SchemaError, match="unique trajectory ids") as err:
        from_dataproto(both, SPEC)  # the same trajectories twice
    assert err.value.row == 3 and err.value.trajectory_id == "0"
    # row indices: distinct ids (the stored ones left out: "trajectory_id" is a core column)
    again = from_dataproto(both, SPEC, trajectory_key=None, ignore=["trajectory_id"])
    assert again.column("routes").to_pylist() == table.column("routes").to_pylist() * 2
    first, second = proto.chunk(chunks=3)[0], proto.chunk(chunks=3)[1:]
    assert_rollouts_equal(from_dataproto(first, SPEC), take_rows(table, [0]))
    assert len(second) == 2
    picked = proto.select(
        batch_keys=[
            *("prompts", "responses", "attention_mask", "response_mask", "rm_scores"),
            "routed_experts",
        ],
        non_tensor_batch_keys=["uid", "trajectory_id", CAPTURED_KEY],
    )
    assert_rollouts_equal(from_dataproto(picked, SPEC), table)
    extra = protocol.DataProto.from_dict(
        tensors={"advantages": torch.arange(3, dtype=torch.float32)}
    )
    joined = proto.union(extra)
    out = from_dataproto(joined, SPEC)
    assert out.column("advantages").to_pylist() == [0.0, 1.0, 2.0]
    assert out.schema.field("advantages").type == pa.float32()
    _assert_same_tensors(joined, to_dataproto(out, pad_token_id=PAD))


def test_multi_turn_observations() -> None:
    """Tool tokens have response_mask 0 but their routes are kept (they are attended)."""
    rng = np.random.default_rng(1)
    prompt = [5, 6, 7]
    # gen(3) + tool observation(2) + gen(2): the engine routes all but the last token
    response = [10, 11, 12, 90, 91, 13, 14]
    mask = [1, 1, 1, 0, 0, 1, 1]
    rows = random_routes(rng, len(prompt) + len(response) - 1, SPEC)
    data = _verl_batch(
        [prompt], [response], [mask], [rows], [1.0], width_p=4, width_r=8, uids=["g"]
    )
    table = from_dataproto(data, SPEC, pad_token_id=PAD)
    assert table.column("loss_mask")[0].as_py() == mask
    assert captured_lengths(table).tolist() == [9]
    assert flat_routes(table)[0].tolist() == rows.tolist()
    _assert_same_tensors(data, to_dataproto(table, pad_token_id=PAD, **_widths(data)))


def test_trailing_observation_needs_nonzero_rule() -> None:
    """A loop that ends on observations: the engine stopped routing at its last generation."""
    rng = np.random.default_rng(2)
    prompt, response, mask = [5, 6], [10, 11, 90, 91, 92], [1, 1, 0, 0, 0]
    rows = random_routes(rng, 3, SPEC)  # tokens 0..2 routed; the observation never was
    data = _verl_batch(
        [prompt], [response], [mask], [rows], [0.0], width_p=2, width_r=5, uids=["g"]
    )
    with pytest.raises(RouteShapeError, match="captured='nonzero'") as err:
        from_dataproto(data, SPEC)
    assert err.value.row == 0 and err.value.token == 3
    table = from_dataproto(data, SPEC, captured="nonzero")
    assert captured_lengths(table).tolist() == [3]
    again = to_dataproto(table, pad_token_id=PAD, **_widths(data))
    _assert_same_tensors(data, again)
    table2 = from_dataproto(data, SPEC, captured=[3])
    assert_rollouts_equal(table2, table)


def test_dense_layers_zero_rows() -> None:
    spec = RouteSpec(num_layers=5, topk=2, num_experts=16, moe_layers=(1, 3))
    data, _ = _single_turn(spec, seed=3)
    routes = data.batch["routed_experts"]
    assert not routes[:, :, [0, 2, 4]].any()
    table = from_dataproto(data, spec)
    assert table.schema.metadata == from_dataproto(data, spec).schema.metadata
    _assert_same_tensors(data, to_dataproto(table, pad_token_id=PAD, **_widths(data)))


def test_extra_keys_keep_their_kind_and_dtype() -> None:
    data, _ = _single_turn()
    data.batch["rollout_log_probs"] = -torch.rand(3, 7, dtype=torch.float32) * (
        data.batch["attention_mask"][:, 6:] > 0
    )
    data.batch["old_log_probs"] = data.batch["rollout_log_probs"] * 0.5
    data.batch["seq_score"] = torch.tensor([1, 2, 3], dtype=torch.int32)
    data.non_tensor_batch["__num_turns__"] = np.array([2, 2, 4], dtype=np.int32)
    data.non_tensor_batch["data_source"] = np.array(["gsm8k", "math", "gsm8k"], dtype=object)
    table = from_dataproto(data, SPEC)
    # verl's log-prob keys land in the rollout table's log-prob columns, and go back
    assert list_lengths(table.column("rollout_logprobs")).tolist() == [4, 2, 6]
    assert "rollout_log_probs" not in table.column_names
    assert table.schema.field("seq_score").type == pa.int32()
    assert list_lengths(table.column("train_logprobs")).tolist() == [4, 2, 6]
    back = to_dataproto(table, pad_token_id=PAD, **_widths(data))
    _assert_same_tensors(data, back)
    turns = back.non_tensor_batch["__num_turns__"]
    assert turns.dtype == np.int32 and turns.tolist() == [2, 2, 4]
    assert back.non_tensor_batch["data_source"].dtype == object
    assert_rollouts_equal(from_dataproto(back, SPEC), table)


def _with(data: Any, key: str, value: Any) -> Any:
    tensors = {k: data.batch[k].clone() for k in data.batch.keys()}  # noqa: SIM118
    tensors[key] = value
    return protocol.DataProto.from_dict(tensors=tensors, non_tensors=dict(data.non_tensor_batch))


def test_bad_dataproto_inputs() -> None:
    data, _ = _single_turn()
    b = data.batch
    with pytest.raises(TypeError, match="DataProto"):
        from_dataproto({"prompts": b["prompts"]}, SPEC)
    with pytest.raises(SchemaError, match="missing \\['responses'"):
        from_dataproto(protocol.DataProto.from_dict(tensors={"prompts": b["prompts"]}), SPEC)
    with pytest.raises(SchemaError, match=r"routed_experts'\]: expected integer \[3, 13, 4, 3\]"):
        from_dataproto(data, RouteSpec(num_layers=4, topk=3, num_experts=8))
    att = b["attention_mask"].clone()
    att[0, 0] = 1  # a prompt pad token attended: not left padding
    with pytest.raises(SchemaError, match="left-padding") as err:
        from_dataproto(_with(data, "attention_mask", att), SPEC)
    assert err.value.row == 0
    att = b["attention_mask"].clone()
    att[1, 12] = 1  # a response token after the padding started
    with pytest.raises(SchemaError, match="right-padding"):
        from_dataproto(_with(data, "attention_mask", att), SPEC)
    mask = b["response_mask"].clone()
    mask[1, 5] = 1
    with pytest.raises(SchemaError, match="0 on response padding"):
        from_dataproto(_with(data, "response_mask", mask), SPEC)
    scores = b["rm_scores"].clone()
    scores[0, 0] = 0.25
    with pytest.raises(SchemaError, match="last response token only"):
        from_dataproto(_with(data, "rm_scores", scores), SPEC)
    ids = b["input_ids"].clone()
    ids[0, -1] = 3
    with pytest.raises(SchemaError, match="input_ids"):
        from_dataproto(_with(data, "input_ids", ids), SPEC)
    with pytest.raises(SchemaError, match="position_ids"):
        from_dataproto(_with(data, "position_ids", b["position_ids"] + 1), SPEC)
    with pytest.raises(SchemaError, match="pad id 0"):
        from_dataproto(data, SPEC, pad_token_id=0)
    routes = b["routed_experts"].clone()
    routes[0, 0, 1] = torch.tensor([1, 2], dtype=torch.int16)  # a padding position
    with pytest.raises(RouteShapeError, match="outside its 6 captured rows"):
        from_dataproto(_with(data, "routed_experts", routes), SPEC)
    routes = b["routed_experts"].clone()
    routes[1, 3, 1] = torch.tensor([9, 2], dtype=torch.int16)
    with pytest.raises(ExpertRangeError):
        from_dataproto(_with(data, "routed_experts", routes), SPEC)
    routes[1, 3, 1] = torch.tensor([2, 2], dtype=torch.int16)
    with pytest.raises(DuplicateExpertError):
        from_dataproto(_with(data, "routed_experts", routes), SPEC)
    with pytest.raises(ValueError, match=r"captured\[1\]: expected 0\.\.7"):
        from_dataproto(data, SPEC, captured=[6, 8, 6])
    with pytest.raises(ValueError, match="captured: expected None"):
        from_dataproto(data, SPEC, captured="all")
    cube = _with(data, "hidden", torch.zeros(3, 2, 2))
    with pytest.raises(ValueError, match="ignore=\\['hidden'\\]"):
        from_dataproto(cube, SPEC)
    assert "hidden" not in from_dataproto(cube, SPEC, ignore=["hidden"]).schema.names


def test_bad_to_dataproto_arguments() -> None:
    data, _ = _single_turn()
    table = from_dataproto(data, SPEC)
    with pytest.raises(ValueError, match="more than max_prompt_length=4"):
        to_dataproto(table, pad_token_id=PAD, max_prompt_length=4)
    with pytest.raises(ValueError, match="max_response_length"):
        to_dataproto(table, pad_token_id=PAD, max_response_length=-1)
    with pytest.raises(TypeError, match="pad_token_id"):
        to_dataproto(table, pad_token_id=None)  # type: ignore[arg-type]
    wide = RouteSpec(num_layers=1, topk=1, num_experts=40_000)
    rng = np.random.default_rng(0)
    from r3arrow.testing import random_rollouts

    with pytest.raises(ValueError, match="int16"):
        to_dataproto(random_rollouts(rng, wide, [(2, 2, 3)]), pad_token_id=PAD)


def test_rollout_table_extras_round_trip() -> None:
    """Extras of a table r3arrow built (no verl kinds recorded) travel as non-tensor keys."""
    rng = np.random.default_rng(5)
    from r3arrow.testing import random_rollouts

    table = _float32_rewards(
        random_rollouts(
            rng,
            SPEC,
            [(2, 3, 4), (3, 2, 4)],
            stop=pa.array(["length", "stop"], type=pa.large_string()),
            num_turns=pa.array([1, 3], type=pa.int16()),
            note=pa.array([None, "x"]),
        )
    )
    table = table.replace_schema_metadata({**(table.schema.metadata or {}), b"user.run": b"7"})
    proto = to_dataproto(table, pad_token_id=PAD)
    assert proto.non_tensor_batch["stop"].tolist() == ["length", "stop"]
    assert proto.non_tensor_batch["num_turns"].dtype == np.int16
    assert_rollouts_equal(from_dataproto(proto, SPEC), table)
    halves = [to_dataproto(table.slice(i, 1), pad_token_id=PAD, **_widths(proto)) for i in (0, 1)]
    assert_rollouts_equal(from_dataproto(protocol.DataProto.concat(halves), SPEC), table)


@pytest.mark.parametrize("bad", [None, float("nan"), ""])
def test_missing_group_ids_are_refused(bad: Any) -> None:
    data, _ = _single_turn()
    data.non_tensor_batch["uid"] = np.array([bad, bad, "g1"], dtype=object)
    with pytest.raises(SchemaError, match=r"non_tensor_batch\['uid'\]\[0\]") as err:
        from_dataproto(data, SPEC)
    assert err.value.row == 0


def test_a_corrupted_schema_in_meta_info_is_refused() -> None:
    data, _ = _single_turn()
    proto = to_dataproto(from_dataproto(data, SPEC), pad_token_id=PAD)
    raw = proto.meta_info[SCHEMA_KEY]
    errors = set()
    for i in range(len(raw)):
        for byte in (0, 0xFF, raw[i] ^ 1):
            proto.meta_info[SCHEMA_KEY] = raw[:i] + bytes([byte]) + raw[i + 1 :]
            try:
                from_dataproto(proto, SPEC)
            except R3ArrowError as exc:
                errors.add(type(exc))
    assert errors <= {SchemaError}


_NASTY_TENSOR_VALUES = st.sampled_from([-1, 2, 255, 256, 2**15, 2**31, 2**40, 0.5, float("nan")])


@given(st.data())
def test_malformed_batches_raise_only_r3arrow_errors(data: st.DataObject) -> None:
    """One key of a valid DataProto removed, re-typed, reshaped or one element changed, a
    non-tensor key replaced, or a byte of the schema in meta_info changed: an R3ArrowError
    or a table, never a builtin error."""
    base, _ = _single_turn()
    base.non_tensor_batch["data_source"] = np.array(["a", "b", "c"], dtype=object)
    proto = to_dataproto(from_dataproto(base, SPEC), pad_token_id=PAD)
    where = data.draw(st.sampled_from(["batch", "non_tensor", "meta_info"]))
    if where == "batch":
        key = data.draw(st.sampled_from(sorted(proto.batch.keys())))
        t = proto.batch[key]
        how = data.draw(st.sampled_from(["remove", "dtype", "narrow", "rank", "element"]))
        if how == "remove":
            del proto.batch[key]
        elif how == "dtype":
            dtype = data.draw(
                st.sampled_from(
                    [
                        torch.float32,
                        torch.bfloat16,
                        torch.bool,
                        torch.int8,
                        torch.uint8,
                        torch.int64,
                    ]
                )
            )
            proto.batch[key] = t.to(dtype)
        elif how == "narrow" and t.ndim > 1:
            proto.batch[key] = t[:, : max(t.shape[1] - 1, 0)].clone()
        elif how == "rank":
            proto.batch[key] = (
                t.reshape(t.shape[0], -1)[:, :1].clone() if t.ndim > 1 else t[:, None]
            )
        else:
            t = t.double().clone()
            flat = t.view(-1)
            flat[data.draw(st.integers(0, flat.numel() - 1))] = data.draw(_NASTY_TENSOR_VALUES)
            proto.batch[key] = t.to(proto.batch[key].dtype) if data.draw(st.booleans()) else t
    elif where == "non_tensor":
        key = data.draw(st.sampled_from(sorted(proto.non_tensor_batch)))
        values: list[Any] = [None, float("nan"), "", b"x", 1.5, {}, 2**70, -1, [1, 2]]
        value = data.draw(st.sampled_from(values))
        arr = np.array(list(proto.non_tensor_batch[key]), dtype=object)
        if data.draw(st.booleans()):
            arr[data.draw(st.integers(0, 2))] = value
        else:
            arr = np.array([value] * data.draw(st.integers(0, 4)), dtype=object)
        proto.non_tensor_batch[key] = arr
    else:
        raw = bytearray(proto.meta_info[SCHEMA_KEY])
        raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
        proto.meta_info[SCHEMA_KEY] = bytes(raw)
    with contextlib.suppress(R3ArrowError):
        from_dataproto(proto, SPEC)


def test_id_keys() -> None:
    data, _ = _single_turn()
    data.non_tensor_batch["prompt_uid"] = np.array(["p0", "p0", "p1"], dtype=object)
    data.non_tensor_batch["sample"] = np.array(["s0", "s1", "s2"], dtype=object)
    table = from_dataproto(data, SPEC, group_key="prompt_uid", trajectory_key="sample")
    assert table.column("group_id").to_pylist() == ["p0", "p0", "p1"]
    assert table.column("trajectory_id").to_pylist() == ["s0", "s1", "s2"]
    assert "prompt_uid" not in table.schema.names and "sample" not in table.schema.names
    assert table.column("uid").to_pylist() == ["a", "a", "b"]  # no longer the group: an extra
    with pytest.raises(ValueError, match="extra column 'uid': collides"):
        to_dataproto(table, pad_token_id=PAD)
    alone = from_dataproto(data, SPEC, group_key=None, ignore=["prompt_uid", "sample", "uid"])
    assert alone.column("group_id").to_pylist() == ["0", "1", "2"]
