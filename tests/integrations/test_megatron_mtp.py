"""MTP policy of `install_replay` with real megatron-core routers (0.16.1, CPU, gloo world of one).

Megatron registers the routers of multi-token-prediction (MTP) layers as ``RouterReplay``
instances too (Megatron-LM #7404), so ``set_replay_data`` wants a tensor for them although no
engine reports their routes. The MTP router here is a real ``TopKRouter`` numbered the way
megatron-core numbers the router inside MTP depth ``d`` (``MultiTokenPredictionLayer`` builds
its transformer layer with ``layer_number = num_layers + d`` and ``MoELayer.set_layer_number``
passes it on): ``build_routers(..., [num_layers + d - 1], mtp_num_layers=...)``, with the
decoder's config, built after the decoder routers as ``GPTModel`` builds its MTP block.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, get_args

import numpy as np
import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = [
    pytest.mark.megatron,
    pytest.mark.filterwarnings("ignore:full scope is deprecated:UserWarning"),
]

from r3arrow import RouteSpec  # noqa: E402
from r3arrow.collate import MegatronCollator, Microbatch  # noqa: E402
from r3arrow.errors import ReplayError  # noqa: E402
from r3arrow.megatron import (  # noqa: E402
    MtpPolicy,
    install_replay,
    replay_backward,
    replay_schedule,
    router_layers,
)
from r3arrow.megatron._routers import _global_layer  # noqa: E402
from r3arrow.table import rollout_table  # noqa: E402
from r3arrow.testing.megatron import CpuMegatron, build_routers, cpu_router_harness  # noqa: E402

HIDDEN, EXPERTS, TOPK = 16, 8, 2
DECODER = RouteSpec(num_layers=4, topk=TOPK, num_experts=EXPERTS, moe_layers=(1, 2, 3))
MOE, MTP = [1, 2, 3], 4  # MTP depth 1: global layer 4, layer_number 5 > num_layers 4
# Routes that also carry the MTP layer (mtp="replay"): global layer ids 0..4.
WITH_MTP = RouteSpec(num_layers=5, topk=TOPK, num_experts=EXPERTS, moe_layers=(1, 2, 3, 4))


@pytest.fixture
def megatron() -> Iterator[CpuMegatron]:
    """One harness per test: also checks the harness restores what it touched."""
    before = torch.cuda.current_device
    with cpu_router_harness() as meg:
        yield meg
    assert torch.cuda.current_device is before
    assert meg.RouterReplay.global_router_replay_instances == []
    assert not torch.distributed.is_initialized()


def _model() -> tuple[torch.nn.ModuleList, list[Any]]:
    """Decoder routers for MOE, then the MTP router (build order of ``GPTModel``)."""
    routers = build_routers(DECODER, [*MOE, MTP], hidden=HIDDEN, mtp_num_layers=1)
    return torch.nn.ModuleList(routers), routers


def _table(spec: RouteSpec, lengths: list[int], seed: int = 0) -> Any:
    rng = np.random.default_rng(seed)
    routes = []
    for n in lengths:
        r = np.zeros((n, spec.num_layers, TOPK), dtype=np.uint8)
        for layer in spec.router_layers:
            r[:, layer] = np.argsort(rng.random((n, EXPERTS)), axis=1)[:, :TOPK]
        routes.append(r)
    return rollout_table(
        trajectory_id=[f"t{i}" for i in range(len(lengths))],
        group_id=["g"] * len(lengths),
        prompt_ids=[[1, 2] for _ in lengths],
        response_ids=[rng.integers(3, 50, n - 1).tolist() for n in lengths],
        loss_mask=[[1] * (n - 1) for n in lengths],
        reward=[0.0] * len(lengths),
        routes=routes,
        spec=spec,
    )


def _follows(routing_map: torch.Tensor, target: torch.Tensor) -> bool:
    replayed = torch.zeros_like(routing_map).scatter_(1, target.long(), True)
    return bool(torch.equal(routing_map, replayed))


def _route(routers: list[Any], hidden: torch.Tensor, mb: Microbatch) -> list[torch.Tensor]:
    with torch.no_grad():
        return [r(hidden, padding_mask=mb.padding_mask.T)[1] for r in routers]


def test_mtp_router_is_registered_and_marked(megatron: CpuMegatron) -> None:
    model, routers = _model()
    assert len(megatron.RouterReplay.global_router_replay_instances) == 4  # MTP registers too
    assert routers[-1].layer_number == DECODER.num_layers + 1
    assert router_layers(model) == MOE  # MTP is not a decoder layer
    mb = MegatronCollator(DECODER, layers=MOE)(_table(DECODER, [5, 4]))
    # What Megatron itself says on the count mismatch (the error r3arrow replaces):
    with pytest.raises(ValueError, match="does not match instances"):
        megatron.RouterReplay.set_replay_data(mb.replay_targets())


def test_exclude_default_replays_decoder_and_routes_mtp_natively(megatron: CpuMegatron) -> None:
    model, routers = _model()
    mb = MegatronCollator(DECODER, layers=MOE)(_table(DECODER, [6, 3, 5]))
    b, s = mb.input_ids.shape
    hidden = torch.randn(s, b, HIDDEN)
    free = _route(routers, hidden, mb)  # no schedule: every router routes natively
    mtp_inst = routers[-1].router_replay
    with replay_schedule():
        targets = install_replay(mb, model)  # mtp="exclude" is the default
        assert len(targets) == len(MOE)
        assert mtp_inst.router_replay_action is None and mtp_inst.target_topk_idx is None
        replayed = _route(routers, hidden, mb)
        with replay_backward():  # recompute: decoder pops its targets, MTP stays native
            assert mtp_inst.router_replay_action is None
            recomputed = _route(routers, hidden, mb)
    for maps in (replayed, recomputed):
        for routing_map, target in zip(maps[:3], mb.replay_targets(), strict=True):
            assert _follows(routing_map, target)
        assert torch.equal(maps[3], free[3])  # the MTP router used its own weights
    assert not any(_follows(m, t) for m, t in zip(free[:3], mb.replay_targets(), strict=True))
    with_mtp = MegatronCollator(WITH_MTP, layers=[*MOE, MTP])(_table(WITH_MTP, [4]))
    with replay_schedule():  # the next schedule may replay the MTP router
        install_replay(with_mtp, model, mtp="replay")
        assert mtp_inst.router_replay_action == megatron.RouterReplayAction.REPLAY_FORWARD


def test_replay_policy_replays_mtp_from_its_global_layer(megatron: CpuMegatron) -> None:
    model, routers = _model()
    mb = MegatronCollator(WITH_MTP, layers=[*MOE, MTP])(_table(WITH_MTP, [5, 7]))
    b, s = mb.input_ids.shape
    with replay_schedule():
        targets = install_replay(mb, model, mtp="replay")
        maps = _route(routers, torch.randn(s, b, HIDDEN), mb)
    assert len(targets) == 4
    assert all(_follows(m, t) for m, t in zip(maps, mb.replay_targets(), strict=True))
    decoder_only = MegatronCollator(DECODER, layers=MOE)(_table(DECODER, [5, 7]))
    with (
        replay_schedule(),
        pytest.raises(ReplayError, match=r"MTP routers \(layer_number \[5\]\).*mtp='replay'"),
    ):
        install_replay(decoder_only, model, mtp="replay")


def test_error_policy_and_unknown_policy(megatron: CpuMegatron) -> None:
    model, _ = _model()
    mb = MegatronCollator(DECODER, layers=MOE)(_table(DECODER, [4]))
    with replay_schedule():
        with pytest.raises(ReplayError, match=r"found 1 with layer_number \[5\] > num_layers 4"):
            install_replay(mb, model, mtp="error")
        with pytest.raises(ValueError, match="mtp: expected one of 'exclude', 'replay', 'error'"):
            install_replay(mb, model, mtp="skip")  # type: ignore[arg-type]
        mtp_targets = MegatronCollator(WITH_MTP, layers=[*MOE, MTP])(_table(WITH_MTP, [4]))
        with pytest.raises(ReplayError, match=r"targets for MTP layers need mtp='replay'"):
            install_replay(mtp_targets, model)
        for inst in megatron.RouterReplay.global_router_replay_instances:
            assert inst.target_topk_idx is None  # nothing reached Megatron
    assert get_args(MtpPolicy) == ("exclude", "replay", "error")


def test_count_mismatch_without_routers_names_mtp_and_the_options(megatron: CpuMegatron) -> None:
    _model()
    mb = MegatronCollator(DECODER, layers=MOE)(_table(DECODER, [5, 4]))
    with replay_schedule(), pytest.raises(ReplayError) as info:
        install_replay(mb)
    msg = str(info.value)
    assert "4 routers), found 3 targets for layers [1, 2, 3]" in msg
    assert "MTP routers" in msg and "routers=" in msg
    assert all(f"mtp='{p}'" in msg for p in get_args(MtpPolicy))
    assert "does not match instances" not in msg  # not Megatron's generic error


def test_routers_outside_the_given_ones_are_untouched(megatron: CpuMegatron) -> None:
    """The decoder's routers only (the MTP block not passed): the MTP router is not the
    schedule's and keeps its state."""
    _, routers = _model()
    mb = MegatronCollator(DECODER, layers=MOE)(_table(DECODER, [4]))
    mtp_inst = routers[3].router_replay
    mtp_inst.set_router_replay_action(megatron.RouterReplayAction.RECORD)
    with replay_schedule():
        assert len(install_replay(mb, routers[:3])) == len(MOE)
        assert mtp_inst.router_replay_action == megatron.RouterReplayAction.RECORD
    assert mtp_inst.router_replay_action == megatron.RouterReplayAction.RECORD


def test_harness_refuses_to_nest(megatron: CpuMegatron) -> None:
    with pytest.raises(RuntimeError, match="model parallel state"), cpu_router_harness():
        pass


@pytest.mark.filterwarnings("ignore:Warning. tp_group is None:DeprecationWarning")
def test_real_gpt_model_with_an_mtp_block(megatron: CpuMegatron) -> None:
    """megatron-core's own ``GPTModel`` with an MTP block (local specs, built on the CPU; its
    forward needs CUDA RNG state, so the routers are run directly): the MTP router registers,
    is numbered past ``num_layers`` and is left native by the default policy."""
    import warnings

    from megatron.core.transformer.transformer_config import TransformerConfig

    with warnings.catch_warnings():
        # third-party import-time noise: TE/Apex absent, deprecated module aliases, torch.jit
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_decoder_block_spec,
            get_gpt_mtp_block_spec,
        )
        from megatron.core.models.gpt.gpt_model import GPTModel

    cfg = TransformerConfig(
        num_layers=2,
        hidden_size=HIDDEN,
        num_attention_heads=2,
        num_moe_experts=4,
        ffn_hidden_size=2 * HIDDEN,
        moe_ffn_hidden_size=HIDDEN,
        moe_router_topk=TOPK,
        moe_enable_routing_replay=True,
        moe_router_load_balancing_type="none",
        use_cpu_initialization=True,
        mtp_num_layers=1,
    )
    decoder = get_gpt_decoder_block_spec(cfg, use_transformer_engine=False)
    mtp = get_gpt_mtp_block_spec(cfg, decoder, use_transformer_engine=False)
    model = GPTModel(cfg, decoder, vocab_size=64, max_sequence_length=32, mtp_block_spec=mtp)
    routers = [m for m in model.modules() if getattr(m, "router_replay", None) is not None]
    # 0.16 numbers the MTP router num_layers + 1; 0.19 numbers it 1 in its block and flags it.
    assert [_global_layer(r) for r in routers] == [0, 1, 2]
    assert len(megatron.RouterReplay.global_router_replay_instances) == 3
    assert router_layers(model) == [0, 1]
    spec = RouteSpec(num_layers=2, topk=TOPK, num_experts=4)
    rng = np.random.default_rng(1)
    routes = [np.argsort(rng.random((n, 2, 4)), axis=2)[:, :, :TOPK] for n in (6, 4)]
    table = rollout_table(
        trajectory_id=["a", "b"],
        group_id=["g", "g"],
        prompt_ids=[[1], [2]],
        response_ids=[list(range(3, 8)), [3, 4, 5]],
        loss_mask=[[1] * 5, [1] * 3],
        reward=[0.0, 1.0],
        routes=[r.astype(np.uint8) for r in routes],
        spec=spec,
    )
    mb = MegatronCollator(spec, layers=[0, 1])(table)
    b, s = mb.input_ids.shape
    with replay_schedule():
        with pytest.raises(ReplayError, match=r"MTP routers.*mtp='exclude'"):
            install_replay(mb)
        with pytest.raises(ReplayError, match=r"layer_number \[3\] > num_layers 2"):
            install_replay(mb, model, mtp="error")
        assert len(install_replay(mb, model)) == 2
        assert routers[2].router_replay.router_replay_action is None
        maps = _route(routers, torch.randn(s, b, HIDDEN), mb)
    assert all(_follows(m, t) for m, t in zip(maps[:2], mb.replay_targets(), strict=True))
