"""r3arrow.adapters.slime against a field-by-field mirror of slime's ``Sample``.

slime is not on PyPI. ``Sample`` below mirrors the dataclass in THUDM/slime
``slime/utils/types.py`` at commit 624b824a898ab0ec1fcb4d373004c7f3852bf515 (2026-08-21),
every field in order with its default, the nested ``Status`` / ``SpecInfo`` /
``PrefixCacheInfo`` and ``to_dict`` / ``from_dict`` (slime's dict form, which `to_samples`
returns and `from_samples` reads); ``Sample.from_dict`` on `to_samples` output checks the names.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from r3arrow import R3ArrowError, read_rollouts, write_rollouts
from r3arrow._routes import dummy_route_row
from r3arrow.adapters.slime import from_samples, to_samples
from r3arrow.errors import ExpertRangeError, RouteShapeError, SchemaError, TerminalGapError
from r3arrow.spec import RouteSpec
from r3arrow.table import captured_lengths, flat_routes, sequence_lengths
from r3arrow.testing import random_rollouts, random_routes
from r3arrow.testing.strategies import rollout_tables


@dataclasses.dataclass
class Sample:
    """slime's ``Sample``: every field in order with its default, the nested types, and
    ``to_dict`` / ``from_dict`` as slime writes them (the other methods left out)."""

    group_index: int | None = None
    index: int | None = None
    rollout_id: int | None = None
    prompt: str | list[dict[str, str]] = ""
    tokens: list[int] = dataclasses.field(default_factory=list)
    multimodal_inputs: dict[str, Any] | None = None
    multimodal_train_inputs: dict[str, Any] | None = None
    multimodal_train_input_id: str | None = None
    apply_chat_template_kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = dataclasses.field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    rollout_top_p_token_ids: list[int] | torch.Tensor | None = None
    rollout_top_p_token_offsets: list[int] | torch.Tensor | None = None
    rollout_routed_experts: list[list[int]] | torch.Tensor | None = None
    remove_sample: bool = False
    teacher_log_probs: list[float] | None = None

    class Status(enum.Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    status: Status = Status.PENDING
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    generate_function_path: str | None = None
    custom_rm_path: str | None = None
    train_metadata: dict[str, Any] | None = None
    session_id: str | None = None
    non_generation_time: float = 0.0

    @dataclasses.dataclass
    class SpecInfo:
        spec_accept_token_num: int = 0
        spec_draft_token_num: int = 0
        spec_verify_ct: int = 0
        completion_token_num: int = 0

        def to_dict(self) -> dict[str, int]:
            return dataclasses.asdict(self)

        @staticmethod
        def from_dict(data: dict[str, int]) -> Sample.SpecInfo:
            names = [f.name for f in dataclasses.fields(Sample.SpecInfo)]
            return Sample.SpecInfo(**{n: data.get(n, 0) for n in names})

    spec_info: SpecInfo = dataclasses.field(default_factory=SpecInfo)

    @dataclasses.dataclass
    class PrefixCacheInfo:
        cached_tokens: int = 0
        total_prompt_tokens: int = 0

        def to_dict(self) -> dict[str, int]:
            return dataclasses.asdict(self)

        @staticmethod
        def from_dict(data: dict[str, int]) -> Sample.PrefixCacheInfo:
            names = [f.name for f in dataclasses.fields(Sample.PrefixCacheInfo)]
            return Sample.PrefixCacheInfo(**{n: data.get(n, 0) for n in names})

    prefix_cache_info: PrefixCacheInfo = dataclasses.field(default_factory=PrefixCacheInfo)

    def to_dict(self) -> dict[str, Any]:
        value = self.__dict__.copy()
        value["status"] = self.status.value
        value["spec_info"] = self.spec_info.to_dict()
        value["prefix_cache_info"] = self.prefix_cache_info.to_dict()
        return value

    @staticmethod
    def from_dict(data: dict[str, Any]) -> Sample:
        data = dict(data)
        data["status"] = Sample.Status(data["status"])
        data["spec_info"] = Sample.SpecInfo.from_dict(data.get("spec_info", {}))
        data["prefix_cache_info"] = Sample.PrefixCacheInfo.from_dict(
            data.get("prefix_cache_info", {})
        )
        field_names = set(Sample.__dataclass_fields__.keys())
        sample = Sample(**{k: v for k, v in data.items() if k in field_names})
        for key, value in data.items():
            if key not in field_names:
                setattr(sample, key, value)
        return sample


SPEC = RouteSpec(num_layers=3, topk=2, num_experts=8)


def _sample(
    rng: np.random.Generator, prompt: int, response: int, *, index: int, group: int, **kw: Any
) -> Sample:
    tokens = rng.integers(1, 100, size=prompt + response).tolist()
    # SGLang's int32 decode, as Sample.update_from_meta_info stores it.
    experts = torch.from_numpy(random_routes(rng, prompt + response - 1, SPEC).astype(np.int32))
    return Sample(
        group_index=group,
        index=index,
        tokens=tokens,
        response_length=response,
        reward=kw.pop("reward", float(index)),
        loss_mask=kw.pop("loss_mask", [1] * response),
        rollout_routed_experts=kw.pop("rollout_routed_experts", experts),
        status=Sample.Status.COMPLETED,
        **kw,
    )


def test_samples_to_table_and_back() -> None:
    rng = np.random.default_rng(0)
    samples = [
        _sample(rng, 3, 2, index=0, group=0, rollout_log_probs=[-0.5, -0.1]),
        _sample(rng, 4, 3, index=1, group=0, rollout_log_probs=[-1.0, -0.2, -0.3]),
        _sample(rng, 2, 1, index=2, group=1, rollout_log_probs=[-0.7], loss_mask=None),
    ]
    table = from_samples(samples, SPEC)
    assert table.column("trajectory_id").to_pylist() == ["0", "1", "2"]
    assert table.column("group_id").to_pylist() == ["0", "0", "1"]
    assert table.column("prompt_ids").to_pylist()[0] == samples[0].tokens[:3]
    assert table.column("loss_mask").to_pylist()[2] == [1]  # None: all ones, as slime fills it
    assert captured_lengths(table).tolist() == [4, 6, 2]  # len(tokens) - 1: all captured
    back = to_samples(table, as_dataclass="dict")
    for orig, d in zip(samples, back, strict=True):
        want = _plain(orig)  # a None loss mask comes back as slime fills it: all ones
        want["loss_mask"] = want["loss_mask"] or [1] * orig.response_length
        assert _plain(Sample.from_dict(d)) == want  # every key is a Sample field
        assert d["rollout_log_probs"] == pytest.approx(orig.rollout_log_probs)
        assert d["rollout_routed_experts"].dtype == np.int32
        assert orig.rollout_routed_experts is not None
        np.testing.assert_array_equal(d["rollout_routed_experts"], orig.rollout_routed_experts)
        # slime's prepare_routed_experts_for_routing_replay asserts this row count
        assert d["rollout_routed_experts"].shape[0] == len(d["tokens"]) - 1


def _plain(sample: Sample) -> dict[str, Any]:
    """slime's dict form, the routes and the float32 log-probs (checked apart) left out."""
    d = sample.to_dict()
    for name in ("rollout_routed_experts", "rollout_log_probs"):
        d.pop(name)
    top_p = d["rollout_top_p_token_ids"]
    d["rollout_top_p_token_ids"] = top_p.tolist() if isinstance(top_p, torch.Tensor) else top_p
    return d


def _rich(rng: np.random.Generator) -> list[Sample]:
    """Samples whose unmapped fields hold every kind slime puts there."""
    a = _sample(rng, 3, 2, index=0, group=0, label="4", metadata={"k": 1})
    a.prompt = "2+2?"
    b = _sample(
        rng,
        2,
        3,
        index=1,
        group=0,
        metadata={"other": [1, 2], "nested": {"x": None}},
        weight_versions=["v1", "v2"],
        teacher_log_probs=[-0.5, -1.0, -2.0],
        rollout_top_p_token_ids=torch.tensor([5, 6], dtype=torch.int32),
        remove_sample=True,
        non_generation_time=0.25,
    )
    b.prompt = [{"role": "user", "content": "hi"}]
    b.status = Sample.Status.TRUNCATED
    b.spec_info.spec_verify_ct = 3
    return [a, b]


def test_unmapped_fields_round_trip(tmp_path: Path) -> None:
    samples = _rich(np.random.default_rng(9))
    table = from_samples(samples, SPEC)
    assert table.column("status").to_pylist() == ["completed", "truncated"]
    assert table.column("label").to_pylist() == ["4", None]
    assert "multimodal_inputs" not in table.column_names  # None in every sample: nothing held
    disk = read_rollouts(write_rollouts(table, tmp_path / "s.parquet"))
    for source in (table, disk):
        back = [Sample.from_dict(d) for d in to_samples(source, as_dataclass="dict")]
        assert [_plain(s) for s in back] == [_plain(s) for s in samples]


def test_slime_type_comes_from_from_dict(monkeypatch: pytest.MonkeyPatch) -> None:
    module = types.ModuleType("slime.utils.types")
    module.Sample = Sample  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "slime.utils.types", module)
    samples = _rich(np.random.default_rng(10))
    back = to_samples(from_samples(samples, SPEC))
    assert all(type(s) is Sample for s in back)
    assert back[1].status is Sample.Status.TRUNCATED and back[1].spec_info.spec_verify_ct == 3
    assert isinstance(back[0].rollout_routed_experts, torch.Tensor)
    assert [_plain(s) for s in back] == [_plain(s) for s in samples]
    plain = to_samples(random_rollouts(np.random.default_rng(4), SPEC, [(2, 2, 3)]))
    assert plain[0].status is Sample.Status.PENDING  # not carried: slime's default


def test_fields_neither_arrow_nor_json_carry_are_refused() -> None:
    (s,) = _rich(np.random.default_rng(11))[:1]
    s.metadata = {"score": float("nan")}  # JSON has no NaN
    with pytest.raises(SchemaError, match=r"ignore=\['metadata'\]"):
        from_samples([s], SPEC)
    assert "metadata" not in from_samples([s], SPEC, ignore=["metadata"]).column_names


def test_an_extra_column_named_like_a_mapped_field_is_refused() -> None:
    rng = np.random.default_rng(12)
    table = random_rollouts(rng, SPEC, [(2, 2, 3)], tokens=pa.array([1]))
    with pytest.raises(ValueError, match="'tokens'"):
        to_samples(table)


def test_dict_samples_nested_lists_and_dict_rewards() -> None:
    rng = np.random.default_rng(1)
    s = dataclasses.asdict(_sample(rng, 2, 2, index=5, group=3, reward={"acc": 1.0}))
    s["rollout_routed_experts"] = np.asarray(s["rollout_routed_experts"]).tolist()
    with pytest.raises(SchemaError, match="reward_key"):
        from_samples([s], SPEC)
    table = from_samples([s], SPEC, reward_key="acc")
    assert table.column("reward").to_pylist() == [1.0]
    assert table.column("trajectory_id").to_pylist() == ["5"]


@given(table=rollout_tables(SPEC))
def test_tables_with_full_capture_round_trip(table: pa.Table) -> None:
    full = table.filter(
        pa.array(captured_lengths(table) == np.maximum(sequence_lengths(table) - 1, 0))
    )
    samples = to_samples(full, as_dataclass="dict")
    if not samples:
        return
    back = from_samples(samples, SPEC)
    for name in ("prompt_ids", "response_ids", "loss_mask", "reward"):
        assert back.column(name).to_pylist() == full.column(name).to_pylist(), name
    np.testing.assert_array_equal(flat_routes(back)[0], flat_routes(full)[0])


def test_terminal_gap_is_refused_or_filled_on_request() -> None:
    table = random_rollouts(np.random.default_rng(2), SPEC, [(3, 3, 4)])  # 6 tokens, 4 rows
    with pytest.raises(RouteShapeError, match="fill_gap=True") as err:
        to_samples(table)
    assert err.value.row == 0 and err.value.trajectory_id == "t-0"
    (d,) = to_samples(table, fill_gap=True, as_dataclass="dict")
    experts = d["rollout_routed_experts"]
    assert experts.shape == (5, 3, 2)
    np.testing.assert_array_equal(experts[:4], flat_routes(table)[0])
    np.testing.assert_array_equal(experts[4], dummy_route_row(SPEC))


def test_last_token_routed_cannot_be_held() -> None:
    table = random_rollouts(np.random.default_rng(3), SPEC, [(2, 2, 4)])  # 4 rows for 4 tokens
    with pytest.raises(RouteShapeError, match="len\\(tokens\\) - 1 = 3"):
        to_samples(table, fill_gap=True)


def test_real_slime_is_optional() -> None:
    table = random_rollouts(np.random.default_rng(4), SPEC, [(2, 2, 3)])
    with pytest.raises(ImportError):
        to_samples(table, as_dataclass="slime")  # slime is not installed here
    assert isinstance(to_samples(table)[0], dict)  # "auto" falls back to dicts
    with pytest.raises(ValueError, match="as_dataclass"):
        to_samples(table, as_dataclass="pydantic")


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"group_index": None}, SchemaError, "group_index"),
        ({"response_length": 99}, SchemaError, "response_length"),
        ({"rollout_routed_experts": None}, RouteShapeError, "None"),
        (
            {"rollout_routed_experts": torch.zeros(4, 2, 2, dtype=torch.int32)},
            RouteShapeError,
            r"\[rows, 3, 2\]",
        ),
        ({"rollout_routed_experts": torch.full((4, 3, 2), -1)}, ExpertRangeError, "-1"),
        ({"rollout_routed_experts": torch.tensor([[[0, 1]] * 3])}, TerminalGapError, "token 3"),
        ({"reward": None}, SchemaError, "reward"),
        ({"reward": "x"}, SchemaError, "reward"),
        ({"loss_mask": [1, 256]}, SchemaError, "loss_mask"),
        ({"loss_mask": [1, 2]}, SchemaError, "loss_mask"),
        ({"group_index": float("nan")}, SchemaError, "group_index"),
        ({"group_index": ""}, SchemaError, "group_index"),
        ({"rollout_log_probs": [-0.5]}, SchemaError, "rollout_log_probs"),
        ({"rollout_log_probs": [-0.5, -0.1, -0.2]}, SchemaError, "rollout_log_probs"),
    ],
)
def test_bad_samples_are_refused(
    change: dict[str, Any], error: type[Exception], match: str
) -> None:
    s = dataclasses.replace(_sample(np.random.default_rng(5), 3, 2, index=0, group=0), **change)
    with pytest.raises(error, match=match):
        from_samples([s], SPEC)


def test_duplicate_indices_are_refused() -> None:
    rng = np.random.default_rng(6)
    samples = [_sample(rng, 2, 2, index=i, group=0) for i in (4, 4)]
    with pytest.raises(SchemaError, match="unique") as err:
        from_samples(samples, SPEC)
    assert err.value.row == 1 and err.value.trajectory_id == "4"


_NASTY = st.sampled_from(
    [None, "x", "", -1, 256, 2**70, float("nan"), 1.5, True, [], [[1]], {}, b"\xff", object()]
)


@given(st.data())
def test_malformed_samples_raise_only_r3arrow_errors(data: st.DataObject) -> None:
    """One field (or one element of one) of one valid sample changed: an R3ArrowError or a
    table, never a builtin error."""
    samples = _rich(np.random.default_rng(7))
    s = data.draw(st.sampled_from(samples))
    name = data.draw(st.sampled_from([f.name for f in dataclasses.fields(Sample)]))
    value = getattr(s, name)
    if isinstance(value, list | torch.Tensor) and len(value) and data.draw(st.booleans()):
        value = list(value) if isinstance(value, list) else value.tolist()
        value[data.draw(st.integers(0, len(value) - 1))] = data.draw(_NASTY)
    else:
        value = data.draw(_NASTY)
    setattr(s, name, value)
    form = data.draw(st.sampled_from(["object", "dict"]))
    with contextlib.suppress(R3ArrowError):
        from_samples([x if form == "object" else vars(x).copy() for x in samples], SPEC)


def test_adapters_import_no_framework_nor_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys, r3arrow.adapters.skyrl, r3arrow.adapters.slime; "
        "bad = [m for m in ('torch', 'skyrl', 'slime', 'polars', 'httpx') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
