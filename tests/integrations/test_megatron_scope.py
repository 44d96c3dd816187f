"""Scope of replay with real megatron-core routers (0.16.1, CPU, gloo world of one).

Replay reaches the routers of the model given and no other (a colocated reference policy, the
orphaned routers of a rebuilt decoder); schedules do not nest either way; `install_replay`
needs an open `replay_schedule`; a route spec must have the model's layer count; a pipeline
stage with only dense layers gets a collator and has nothing to install.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

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
    collator_for,
    install_replay,
    record_schedule,
    replay_backward,
    replay_schedule,
)
from r3arrow.table import rollout_table  # noqa: E402
from r3arrow.testing.megatron import CpuMegatron, build_routers, cpu_router_harness  # noqa: E402

HIDDEN, EXPERTS, TOPK = 16, 8, 2
SPEC = RouteSpec(num_layers=4, topk=TOPK, num_experts=EXPERTS, moe_layers=(1, 2, 3))
MOE = [1, 2, 3]
ODD = [0, 1, 0, 1, 0, 1, 0, 0]  # MoE layers 2, 4 and 6 (1-based) of eight


@pytest.fixture
def megatron() -> Iterator[CpuMegatron]:
    with cpu_router_harness() as meg:
        yield meg


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


def _config(**kw: Any) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    base: dict[str, Any] = {
        "num_layers": 4, "hidden_size": HIDDEN, "num_attention_heads": 2,
        "num_moe_experts": EXPERTS, "moe_ffn_hidden_size": HIDDEN, "moe_router_topk": TOPK,
        "moe_enable_routing_replay": True, "moe_router_load_balancing_type": "none",
        "use_cpu_initialization": True,
    }  # fmt: skip
    return TransformerConfig(**(base | kw))


def _maps(routers: list[Any], hidden: torch.Tensor, mb: Microbatch) -> list[torch.Tensor]:
    with torch.no_grad():
        return [r(hidden, padding_mask=mb.padding_mask.T)[1] for r in routers]


def _follows(routing_map: torch.Tensor, target: torch.Tensor) -> bool:
    return bool(torch.equal(routing_map, torch.zeros_like(routing_map).scatter_(1, target, True)))


def _state(routers: list[Any]) -> list[tuple[Any, Any, list[Any]]]:
    """(action, target, backward FIFO) of each router's ``RouterReplay``, by identity."""
    return [
        (r.router_replay.router_replay_action, r.router_replay.target_topk_idx,
         list(r.router_replay.replay_backward_list))
        for r in routers
    ]  # fmt: skip


def _same(a: list[tuple[Any, Any, list[Any]]], b: list[tuple[Any, Any, list[Any]]]) -> bool:
    return len(a) == len(b) and all(
        x[0] == y[0] and x[1] is y[1] and len(x[2]) == len(y[2])
        and all(p is q for p, q in zip(x[2], y[2], strict=True))
        for x, y in zip(a, b, strict=True)
    )  # fmt: skip


def test_replay_reaches_the_given_model_only(megatron: CpuMegatron) -> None:
    """A colocated reference policy and the orphaned routers of a prebuild (verl #7340) stay
    as they were: their action and targets, during the schedule and after it."""
    orphans = build_routers(SPEC, MOE, hidden=HIDDEN, seed=3)  # built, then discarded
    own = build_routers(SPEC, MOE, hidden=HIDDEN, seed=1)
    policy = torch.nn.ModuleList(own)
    reference = build_routers(SPEC, MOE, hidden=HIDDEN, seed=2)
    assert len(megatron.RouterReplay.global_router_replay_instances) == 9
    stale = torch.zeros(4, TOPK, dtype=torch.int64)
    orphans[0].router_replay.set_target_indices(stale)
    orphans[0].router_replay.set_router_replay_action(megatron.RouterReplayAction.REPLAY_FORWARD)
    reference[1].router_replay.set_router_replay_action(megatron.RouterReplayAction.RECORD)
    before = _state(orphans + reference)
    mb = MegatronCollator(SPEC, layers=MOE)(_table(SPEC, [6, 4, 5]))
    b, s = mb.input_ids.shape
    hidden = torch.randn(s, b, HIDDEN)
    free = _maps(reference[:1], hidden, mb)
    with replay_schedule():
        assert _same(_state(orphans + reference), before)  # entering touches no router
        targets = install_replay(mb, policy)
        assert len(targets) == len(MOE)
        assert _same(_state(orphans + reference), before)
        replayed = _maps(own, hidden, mb)
        with replay_backward():
            assert _same(_state(orphans + reference), before)
            assert all(
                r.router_replay.router_replay_action == megatron.RouterReplayAction.REPLAY_BACKWARD
                for r in own
            )
        native = _maps(reference[:1], hidden, mb)  # the reference routes by its own weights
    assert _same(_state(orphans + reference), before)
    assert all(_follows(m, t) for m, t in zip(replayed, mb.replay_targets(), strict=True))
    assert torch.equal(native[0], free[0])
    assert _state(own) == [(None, None, [])] * len(MOE)  # cleared on exit
    with replay_schedule():  # VPP: a list of model chunks, each its own routers
        assert len(
            install_replay(mb, [torch.nn.ModuleList(own[:1]), torch.nn.ModuleList(own[1:])])
        ) == len(MOE)
    assert _same(_state(orphans + reference), before)


def test_a_model_whose_routers_do_not_match_is_refused(megatron: CpuMegatron) -> None:
    build_routers(SPEC, MOE, hidden=HIDDEN, seed=2)  # another model's routers
    policy = torch.nn.ModuleList(build_routers(SPEC, MOE, hidden=HIDDEN))
    table = _table(SPEC, [5, 4])
    with replay_schedule():
        with pytest.raises(
            ReplayError, match=r"global layers \[1, 2\], found routers for \[1, 2, 3\]"
        ):
            install_replay(MegatronCollator(SPEC, layers=[1, 2])(table), policy)
        mb = MegatronCollator(SPEC, layers=MOE)(table)
        with pytest.raises(ReplayError, match=r"one target per RouterReplay instance"):
            install_replay(mb)  # no model: every instance of the process, in order
        assert all(
            i.target_topk_idx is None and i.router_replay_action is None
            for i in megatron.RouterReplay.global_router_replay_instances
        )


def test_schedules_do_not_nest_either_way(megatron: CpuMegatron) -> None:
    routers = build_routers(SPEC, MOE, hidden=HIDDEN)
    mb = MegatronCollator(SPEC, layers=MOE)(_table(SPEC, [5, 4]))
    b, s = mb.input_ids.shape
    hidden = torch.randn(s, b, HIDDEN)
    record = megatron.RouterReplayAction.RECORD
    with record_schedule(routers) as rec:
        for inner in (replay_schedule, lambda: record_schedule(routers)):
            with pytest.raises(ReplayError, match="found an open record_schedule"), inner():
                pass
            assert all(r.router_replay.router_replay_action == record for r in routers)
        _maps(routers, hidden, mb)
        assert sorted(rec.take()) == MOE  # the recording goes on
    with replay_schedule():
        install_replay(mb, routers)
        before = _state(routers)
        for inner in (replay_schedule, lambda: record_schedule(routers)):
            with pytest.raises(ReplayError, match="found an open replay_schedule"), inner():
                pass
            assert _same(_state(routers), before)
        maps = _maps(routers, hidden, mb)
    assert all(_follows(m, t) for m, t in zip(maps, mb.replay_targets(), strict=True))


def test_install_needs_an_open_replay_schedule(megatron: CpuMegatron) -> None:
    routers = build_routers(SPEC, MOE, hidden=HIDDEN)
    mb = MegatronCollator(SPEC, layers=MOE)(_table(SPEC, [5, 4]))
    with pytest.raises(ReplayError, match=r"install_replay: expected an open replay_schedule"):
        install_replay(mb, routers)
    with (
        pytest.raises(ReplayError, match=r"replay_backward: expected an open replay_schedule"),
        replay_backward(),
    ):
        pass
    with replay_schedule(None), pytest.raises(ReplayError, match=r"replay_schedule\(None\)"):
        install_replay(mb, routers)
    with record_schedule(routers), pytest.raises(ReplayError, match="record_schedule"):
        install_replay(mb, routers)
    assert _state(routers) == [(None, None, [])] * len(MOE)


def test_route_spec_layer_count_must_be_the_models(megatron: CpuMegatron) -> None:
    """A 6-layer route spec on an 8-layer model whose MoE layers are 2, 4 and 6 (1-based)."""
    eight = RouteSpec(num_layers=8, topk=TOPK, num_experts=EXPERTS, moe_layers=(1, 3, 5))
    six = RouteSpec(num_layers=6, topk=TOPK, num_experts=EXPERTS, moe_layers=(1, 3, 5))
    model = torch.nn.ModuleList(build_routers(eight, [1, 3, 5], hidden=HIDDEN))
    wrong = "route spec: expected 8 layers (the model's num_layers), found 6"
    with pytest.raises(ReplayError, match=f"^{re.escape(wrong)}"):
        collator_for(six, model=model)
    with pytest.raises(ReplayError, match=re.escape(wrong)):
        collator_for(six, _config(num_layers=8, moe_layer_freq=ODD))
    mb = MegatronCollator(six, layers=[1, 3, 5])(_table(six, [5, 4]))
    with replay_schedule(), pytest.raises(ReplayError, match=re.escape(wrong)):
        install_replay(mb, model)
    assert collator_for(eight, model=model).layers == (1, 3, 5)
    # MTP: routes of the decoder, or of the decoder and its MTP layers, both fit
    cfg = _config(num_layers=8, moe_layer_freq=ODD, mtp_num_layers=1)
    nine = RouteSpec(num_layers=9, topk=TOPK, num_experts=EXPERTS, moe_layers=(1, 3, 5, 8))
    assert collator_for(nine, cfg).layers == (1, 3, 5)
    with pytest.raises(ReplayError, match=r"expected 8 layers .* or 9 .*found 6"):
        collator_for(six, cfg)


def test_dense_only_stage_collates_and_installs_nothing(megatron: CpuMegatron) -> None:
    """Stage 0 of two holds dense layers 0 and 1 only: its collator carries tokens, masks and
    cu_seqlens like stage 1's, no routes, and `install_replay` has nothing to install."""
    spec = RouteSpec(num_layers=4, topk=TOPK, num_experts=EXPERTS, moe_layers=(2, 3))
    cfg = _config(
        moe_layer_freq=[0, 0, 1, 1], pipeline_model_parallel_size=2, pipeline_dtype=torch.float32
    )
    table = _table(spec, [6, 3, 5])
    first = collator_for(spec, cfg, pp_rank=0, packed=True, align=4)
    last = collator_for(spec, cfg, pp_rank=1, packed=True, align=4)
    assert (first.layers, last.layers) == ((), (2, 3))
    mb0, mb1 = first(table), last(table)
    for name in ("input_ids", "position_ids", "labels", "loss_mask", "label_mask",
                 "padding_mask", "cu_seqlens", "cu_seqlens_padded"):  # fmt: skip
        assert torch.equal(getattr(mb0, name), getattr(mb1, name)), name
    assert mb0.layers == () and mb0.replay_targets() == []
    assert mb0.routes is not None and mb0.routes.shape == (*mb1.input_ids.shape, 0, TOPK)
    other = build_routers(spec, [2, 3], hidden=HIDDEN)  # stage 1's routers (another model)
    dense_stage = torch.nn.Linear(HIDDEN, HIDDEN)  # no router
    with replay_schedule():
        assert install_replay(mb0, dense_stage) == []
        with pytest.raises(ReplayError, match=r"global layers \[\], found routers for \[2, 3\]"):
            install_replay(mb0, other)
    assert _state(other) == [(None, None, [])] * 2
    assert collator_for(spec, model=dense_stage, config=cfg).layers == ()
