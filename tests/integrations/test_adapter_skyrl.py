"""r3arrow.adapters.skyrl against SkyRL 0.3.0's own types and preprocessing.

``skyrl.train.generators.base`` does not import on Python 3.11 (``skyrl/tinker/types.py``,
reached through ``skyrl/backends/__init__.py``, puts a ``typing.TypedDict`` in a pydantic
model, which pydantic 2 refuses below Python 3.12), so `GeneratorOutput` is mirrored field
by field below and the mirror is held to the released source by parsing it. The released
``convert_prompts_responses_to_batch_tensors`` (``skyrl/train/dataset/preprocess.py``: torch,
jaxtyping, transformers) is loaded from the installed wheel and compared with
`to_training_inputs`. Both skip when the wheel is not installed.
"""

from __future__ import annotations

import ast
import importlib.util
import types
from pathlib import Path
from typing import Any, TypedDict

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from r3arrow import R3ArrowError
from r3arrow._routes import dummy_route_row
from r3arrow.adapters.skyrl import from_generator_output, to_generator_output, to_training_inputs
from r3arrow.errors import (
    DuplicateExpertError,
    ExpertRangeError,
    RouteShapeError,
    SchemaError,
    TerminalGapError,
)
from r3arrow.spec import RouteSpec
from r3arrow.table import captured_lengths, flat_routes, router_padding_mask
from r3arrow.testing import random_rollouts, random_routes
from r3arrow.testing.strategies import rollout_tables, specs


class TrajectoryID:
    """Mirror of ``skyrl.train.generators.base.TrajectoryID`` (a dataclass of two fields)."""

    def __init__(self, instance_id: str, repetition_id: int) -> None:
        self.instance_id = instance_id
        self.repetition_id = repetition_id


class GeneratorOutput(TypedDict):
    """Mirror of skyrl 0.3.0 ``skyrl/train/generators/base.py`` ``GeneratorOutput``."""

    prompt_token_ids: list[list[int]]
    response_ids: list[list[int]]
    rewards: list[float] | list[list[float]]
    loss_masks: list[list[int]]
    stop_reasons: list[str] | None
    rollout_metrics: dict[str, Any] | None
    rollout_logprobs: list[list[float]] | None
    trajectory_ids: list[TrajectoryID] | None
    trajectory_generation_times: list[float] | None
    rollout_expert_indices: list[Any] | None  # [batch, seq, layers, topk] or #1912 arrays
    is_last_step: list[bool] | None
    env_metrics: list[dict[str, Any]] | None
    pixel_values: list[Any] | None
    image_grid_thw: list[Any] | None


def _skyrl_root() -> Path:
    spec = importlib.util.find_spec("skyrl")
    if spec is None or spec.origin is None:
        pytest.skip("skyrl 0.3.0 is not installed (pip install --no-deps the wheel)")
    return Path(spec.origin).parent


def _released_preprocess() -> types.ModuleType:
    path = _skyrl_root() / "train" / "dataset" / "preprocess.py"
    for dep in ("jaxtyping", "transformers"):
        if importlib.util.find_spec(dep) is None:
            pytest.skip(f"{dep} is needed to load SkyRL's preprocess.py")
    spec = importlib.util.spec_from_file_location("_skyrl_preprocess", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # only torch, jaxtyping, transformers: no skyrl package init
    return module


def test_mirror_matches_released_generator_output() -> None:
    tree = ast.parse((_skyrl_root() / "train" / "generators" / "base.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GeneratorOutput")
    released = [
        n.target.id
        for n in cls.body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    ]
    assert released == list(GeneratorOutput.__annotations__)
    tid = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "TrajectoryID")
    fields = [n.target.id for n in tid.body if isinstance(n, ast.AnnAssign)]  # type: ignore[union-attr]
    assert fields == ["instance_id", "repetition_id"]  # mirrored by TrajectoryID above


SPEC = RouteSpec(num_layers=3, topk=2, num_experts=8)


def _output(
    routes: list[Any], *, prompts: list[list[int]], responses: list[list[int]], **kw: Any
) -> GeneratorOutput:
    n = len(prompts)
    out = GeneratorOutput(
        prompt_token_ids=prompts,
        response_ids=responses,
        rewards=kw.pop("rewards", [float(i) for i in range(n)]),
        loss_masks=kw.pop("loss_masks", [[1] * len(r) for r in responses]),
        stop_reasons=None,
        rollout_metrics=None,
        rollout_logprobs=kw.pop("rollout_logprobs", None),
        trajectory_ids=kw.pop(
            "trajectory_ids", [TrajectoryID(f"p{i // 2}", i % 2) for i in range(n)]
        ),
        trajectory_generation_times=None,
        rollout_expert_indices=routes,
        is_last_step=None,
        env_metrics=None,
        pixel_values=None,
        image_grid_thw=None,
    )
    assert not kw
    return out


@given(table=rollout_tables(layouts=False, user_metadata=False), nested=st.booleans())
def test_round_trip_with_captured_undoes_the_padded_gap(table: pa.Table, nested: bool) -> None:
    out, cap, uids = to_generator_output(table, layout="nested" if nested else "compact")
    lengths = [
        len(p) + len(r) for p, r in zip(out["prompt_token_ids"], out["response_ids"], strict=True)
    ]
    assert [len(x) for x in out["rollout_expert_indices"]] == lengths  # finalize's N rows
    spec = RouteSpec.from_schema(table.schema)
    back = from_generator_output(out, spec, captured=cap, uids=uids)
    for name in ("group_id", "prompt_ids", "response_ids", "loss_mask", "reward"):
        assert back.column(name).equals(table.column(name)), name
    np.testing.assert_array_equal(captured_lengths(back), captured_lengths(table))
    np.testing.assert_array_equal(flat_routes(back)[0], flat_routes(table)[0])
    assert router_padding_mask(back).equals(router_padding_mask(table))


def _mask(table: pa.Table) -> list[Any]:
    """The router padding mask as lists, loosely typed (pyarrow-stubs refuse list arrays)."""
    mask: Any = router_padding_mask(table)
    out: list[Any] = mask.to_pylist()
    return out


def test_without_captured_padded_rows_count_as_routes() -> None:
    rng = np.random.default_rng(0)
    table = random_rollouts(rng, SPEC, [(3, 2, 3)])  # 5 tokens, 3 captured: gap of 2
    out, cap, uids = to_generator_output(table)
    back = from_generator_output(out, SPEC, uids=uids)
    # The documented limit: the 2 dummy rows are now indistinguishable from routes.
    assert captured_lengths(back).tolist() == [5]
    assert _mask(back) == [[False] * 5]
    np.testing.assert_array_equal(flat_routes(back)[0][3:], np.stack([dummy_route_row(SPEC)] * 2))
    with_cap = from_generator_output(out, SPEC, captured=cap, uids=uids)
    assert _mask(with_cap) == [[False] * 3 + [True] * 2]


def test_released_nested_lists_torch_and_int64_inputs() -> None:
    rng = np.random.default_rng(1)
    r0 = random_routes(rng, 4, SPEC)
    r1 = random_routes(rng, 3, SPEC)
    prompts, responses = [[1, 2, 3], [4, 5]], [[6, 7], [8, 9]]
    for routes in (
        [r0.tolist(), r1.tolist()],  # skyrl 0.3.0
        [r0.astype(np.int64), torch.from_numpy(r1.astype(np.int32))],  # #1912 arrays, torch
    ):
        t = from_generator_output(_output(routes, prompts=prompts, responses=responses), SPEC)
        assert t.column("trajectory_id").to_pylist() == ["p0_0", "p0_1"]
        assert t.column("group_id").to_pylist() == ["p0", "p0"]
        np.testing.assert_array_equal(flat_routes(t)[0], np.concatenate([r0, r1]))


def test_optional_columns_and_per_token_rewards() -> None:
    rng = np.random.default_rng(2)
    out = _output(
        [random_routes(rng, 3, SPEC)],
        prompts=[[1, 2]],
        responses=[[3, 4]],
        rewards=[[0.0, 1.5]],
        rollout_logprobs=[[-0.5, -0.25]],
    )
    out["stop_reasons"] = ["stop"]
    t = from_generator_output(out, SPEC)
    assert t.column("reward").to_pylist() == [1.5]
    assert t.column("token_rewards").to_pylist() == [[0.0, 1.5]]
    assert t.column("rollout_logprobs").to_pylist() == [[-0.5, -0.25]]
    assert t.column("stop_reason").to_pylist() == ["stop"]
    batch = to_training_inputs(t)
    assert batch["rewards"].tolist() == [[0.0, 1.5]]


@pytest.mark.parametrize(
    ("routes", "kw", "error", "match"),
    [
        ([[[[0, 1]] * 3] * 9], {}, RouteShapeError, "more|rows"),  # 9 rows for 4 tokens
        ([[[[0, 1]] * 2] * 3], {}, RouteShapeError, r"\[seq, 3, 2\]"),  # 2 layers, not 3
        ([[[[0, 1], [1, 0], [-1, 2]]] * 3], {}, ExpertRangeError, "-1"),
        ([[[[0, 1], [1, 0], [8, 2]]] * 3], {}, ExpertRangeError, "num_experts=8"),
        ([[[[0, 0], [1, 2], [3, 4]]] * 3], {}, DuplicateExpertError, "token 0"),
        ([[[[0, 1]] * 3]], {}, TerminalGapError, "token 2"),  # 1 row, response trained
        ([[[[0, 1]] * 3] * 3], {"captured": [4]}, RouteShapeError, "captured=4"),
        ([[[[0, 1]] * 3] * 3], {"captured": [-1]}, ValueError, "non-negative"),
        (None, {}, SchemaError, "rollout_expert_indices"),
    ],
)
def test_bad_inputs_are_refused(
    routes: Any, kw: dict[str, Any], error: type[Exception], match: str
) -> None:
    out = _output([] if routes is None else routes, prompts=[[1, 2]], responses=[[3, 4]])
    if routes is None:
        out["rollout_expert_indices"] = None
    with pytest.raises(error, match=match):
        from_generator_output(out, SPEC, **kw)


def test_logprobs_must_cover_the_response() -> None:
    out = _output(
        [[[[0, 1]] * 3] * 3], prompts=[[1, 2]], responses=[[3, 4]], rollout_logprobs=[[-0.5]]
    )
    with pytest.raises(SchemaError, match="rollout_logprobs") as err:
        from_generator_output(out, SPEC)
    assert err.value.row == 0


def test_zero_dim_tensor_rewards_and_empty_batch() -> None:
    out = _output([[[[0, 1]] * 3] * 3], prompts=[[1, 2]], responses=[[3, 4]])
    out["rewards"] = [torch.tensor(2.5)]  # type: ignore[typeddict-item]  # a generator's tensor
    assert from_generator_output(out, SPEC).column("reward").to_pylist() == [2.5]
    empty = _output([], prompts=[], responses=[], trajectory_ids=[])
    assert from_generator_output(empty, SPEC, captured=[]).num_rows == 0


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"loss_masks": None}, "loss_masks"),
        ({"prompt_token_ids": None}, "prompt_token_ids"),
        ({"rewards": [None]}, "rewards"),
        ({"rewards": ["x"]}, "rewards"),
        ({"loss_masks": [[1, 2]]}, "loss_masks"),
        ({"response_ids": [[3, "4"]]}, "response_ids"),
        ({"trajectory_ids": [None]}, r"trajectory_ids\[0\]: expected a TrajectoryID"),
        ({"trajectory_ids": [TrajectoryID(None, 0)]}, "instance_id"),  # type: ignore[arg-type]
        ({"trajectory_ids": [TrajectoryID("", 0)]}, "instance_id"),
        ({"trajectory_ids": [TrajectoryID("p", None)]}, "repetition_id"),  # type: ignore[arg-type]
        ({"stop_reasons": [3]}, "stop_reasons"),
    ],
)
def test_malformed_fields_are_refused(change: dict[str, Any], match: str) -> None:
    out = _output([[[[0, 1]] * 3] * 3], prompts=[[1, 2]], responses=[[3, 4]])
    out.update(change)  # type: ignore[typeddict-item]
    with pytest.raises(SchemaError, match=match):
        from_generator_output(out, SPEC)


def test_a_missing_field_is_refused() -> None:
    out = _output([[[[0, 1]] * 3] * 3], prompts=[[1, 2]], responses=[[3, 4]])
    del out["loss_masks"]  # type: ignore[misc]
    with pytest.raises(SchemaError, match="loss_masks"):
        from_generator_output(out, SPEC)


def test_ids_must_name_distinct_trajectories() -> None:
    routes = [[[[0, 1]] * 3] * 3] * 2
    out = _output(routes, prompts=[[1, 2]] * 2, responses=[[3, 4]] * 2)
    out["trajectory_ids"] = [TrajectoryID("p", 0), TrajectoryID("p", 0)]
    with pytest.raises(SchemaError, match="unique") as err:
        from_generator_output(out, SPEC)
    assert err.value.row == 1 and err.value.trajectory_id == "p_0"
    out["trajectory_ids"] = None
    with pytest.raises(SchemaError, match=r"uids\[1\]"):
        from_generator_output(out, SPEC, uids=["g", float("nan")])  # type: ignore[list-item]


_NASTY = st.sampled_from(
    [None, "x", "", -1, 256, 2**70, float("nan"), 1.5, True, [], [[1]], {}, b"\xff", object()]
)


@given(st.data())
def test_malformed_outputs_raise_only_r3arrow_errors(data: st.DataObject) -> None:
    """One field, one entry of one or one element of an entry of a valid output changed
    (or the field removed): an R3ArrowError or a table, never a builtin error."""
    rng = np.random.default_rng(8)
    out: dict[str, Any] = dict(
        _output(
            [random_routes(rng, 4, SPEC), random_routes(rng, 3, SPEC)],
            prompts=[[1, 2, 3], [4, 5]],
            responses=[[6, 7], [8, 9]],
            rewards=[[0.0, 1.0], [0.5, 0.0]],
            rollout_logprobs=[[-0.5, -0.1], [-1.0, -0.2]],
        )
    )
    out["stop_reasons"] = ["stop", "length"]
    key = data.draw(st.sampled_from(sorted(out)))
    where = data.draw(st.sampled_from(["remove", "field", "entry", "element"]))
    value = out[key]
    if where == "remove":
        del out[key]
    elif where == "field" or not isinstance(value, list) or not value:
        out[key] = data.draw(_NASTY)
    else:
        value = list(value)
        i = data.draw(st.integers(0, len(value) - 1))
        entry = value[i]
        if where == "element" and isinstance(entry, list | np.ndarray) and len(entry):
            entry = np.asarray(entry).tolist()
            entry[data.draw(st.integers(0, len(entry) - 1))] = data.draw(_NASTY)
            value[i] = entry
        else:
            value[i] = data.draw(_NASTY)
        out[key] = value
    try:
        from_generator_output(out, SPEC)
    except R3ArrowError:
        pass
    except ValueError as exc:  # documented: no trajectory_ids, so uids= must name the groups
        assert key == "trajectory_ids" and "uids=" in str(exc)


def test_group_ids_are_required() -> None:
    out = _output([[[[0, 1]] * 3] * 3], prompts=[[1, 2]], responses=[[3, 4]], trajectory_ids=None)
    with pytest.raises(ValueError, match="uids="):
        from_generator_output(out, SPEC)
    assert from_generator_output(out, SPEC, uids=["u"]).column("group_id").to_pylist() == ["u"]


@given(spec=specs(widths=("uint8", "uint16")), data=st.data())
def test_training_inputs_match_released_preprocessing(spec: RouteSpec, data: st.DataObject) -> None:
    pre = _released_preprocess()
    table = data.draw(rollout_tables(spec).filter(lambda t: t.num_rows > 0))
    out, _, _ = to_generator_output(table, layout="nested", pad_terminal_gap=False)
    tokenizer = types.SimpleNamespace(pad_token_id=7)  # preprocess reads only pad_token_id
    rewards = [
        [0.0] * (len(r) - 1) + [w] if r else []
        for r, w in zip(out["response_ids"], out["rewards"], strict=True)
    ]
    seq, attn, action, rew, loss, _, routes = pre.convert_prompts_responses_to_batch_tensors(
        tokenizer,
        out["prompt_token_ids"],
        out["response_ids"],
        rewards,
        out["loss_masks"],
        None,
        out["rollout_expert_indices"],
    )
    mine = to_training_inputs(table, pad_token_id=7)
    np.testing.assert_array_equal(mine["sequences"], seq.numpy())
    np.testing.assert_array_equal(mine["attention_mask"], attn.numpy())
    np.testing.assert_array_equal(mine["response_mask"], action.numpy())
    np.testing.assert_array_equal(mine["loss_mask"], loss.numpy())
    np.testing.assert_array_equal(mine["rewards"], rew.numpy())
    padding = mine["router_padding_mask"]
    if routes is not None:  # SkyRL writes zeros where r3arrow writes dummy rows
        assert mine["rollout_expert_indices"].shape == tuple(routes.shape)
        np.testing.assert_array_equal(
            mine["rollout_expert_indices"][~padding], routes.numpy()[~padding]
        )
        assert mine["rollout_expert_indices"].dtype == np.dtype(str(routes.dtype).split(".")[1])
    assert (mine["rollout_expert_indices"][padding] == dummy_route_row(spec)).all()


def test_training_inputs_literal_layout() -> None:
    routes = [
        np.array([[[2, 3]], [[4, 5]]], dtype=np.uint8),  # 3 tokens, 2 captured
        np.array([[[1, 2]], [[3, 4]], [[5, 6]]], dtype=np.uint8),  # 4 tokens, 3 captured
    ]
    spec = RouteSpec(num_layers=1, topk=2, num_experts=8)
    out = _output(routes, prompts=[[10], [20, 21]], responses=[[11, 12], [22, 23]])
    batch = to_training_inputs(from_generator_output(out, spec), tensors="torch")
    assert batch["sequences"].tolist() == [[0, 10, 11, 12], [20, 21, 22, 23]]
    assert batch["attention_mask"].tolist() == [[0, 1, 1, 1], [1, 1, 1, 1]]
    assert batch["response_mask"].tolist() == [[1, 1], [1, 1]]
    assert batch["rewards"].tolist() == [[0.0, 0.0], [0.0, 1.0]]
    assert batch["rollout_expert_indices"][:, :, 0].tolist() == [
        [[0, 1], [2, 3], [4, 5], [0, 1]],
        [[1, 2], [3, 4], [5, 6], [0, 1]],
    ]
    assert batch["router_padding_mask"].tolist() == [
        [True, False, False, True],
        [False, False, False, True],
    ]
    assert batch["rollout_expert_indices"].dtype == torch.uint8
    assert batch["uids"] == ["p0", "p0"]


def test_training_inputs_widen_like_skyrl() -> None:
    spec = RouteSpec(num_layers=1, topk=2, num_experts=40_000)
    routes = [np.array([[[300, 2]]]), np.array([[[1, 33_000]]])]
    out = _output(routes, prompts=[[1], [2]], responses=[[3], [4]])
    batch = to_training_inputs(from_generator_output(out, spec))
    assert batch["rollout_expert_indices"].dtype == np.int32  # >= 2**15: int32, as SkyRL
    spec16 = RouteSpec(num_layers=1, topk=2, num_experts=1000)
    out16 = _output(
        [np.array([[[300, 2]]]), np.array([[[1, 3]]])], prompts=[[1], [2]], responses=[[3], [4]]
    )
    assert (
        to_training_inputs(from_generator_output(out16, spec16))["rollout_expert_indices"].dtype
        == np.int16
    )


def test_training_inputs_refuse_bad_options() -> None:
    table = random_rollouts(np.random.default_rng(3), SPEC, [(2, 2, 3)])
    with pytest.raises(ValueError, match="tensors"):
        to_training_inputs(table, tensors="jax")
    with pytest.raises(ValueError, match="at least one"):
        to_training_inputs(table.slice(0, 0))
