"""Megatron-core side with the real megatron-core (0.16.1, CPU, gloo world size 1).

Record → store → replay round trips through real ``TopKRouter``s, schedule-scoped replay
state, target validation, the expert-bias padding-mask shim, stage router layers.
"""

from __future__ import annotations

import types
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

import r3arrow  # noqa: E402
from r3arrow import RouteSpec  # noqa: E402
from r3arrow.collate import MegatronCollator, Microbatch  # noqa: E402
from r3arrow.errors import (  # noqa: E402
    DuplicateExpertError,
    ExpertRangeError,
    ReplayDuplicateError,
    ReplayError,
    ReplayRangeError,
)
from r3arrow.megatron import (  # noqa: E402
    apply_shims,
    install_replay,
    model_inputs,
    record_schedule,
    remove_shims,
    replay_backward,
    replay_schedule,
    router_layers,
)
from r3arrow.megatron._shim import _padding_mask_fix_present  # noqa: E402
from r3arrow.table import rollout_table  # noqa: E402
from r3arrow.testing.megatron import CpuMegatron, build_routers, cpu_router_harness  # noqa: E402

HIDDEN, EXPERTS, TOPK = 16, 8, 2


@pytest.fixture(scope="module")
def megatron() -> Iterator[CpuMegatron]:
    """gloo world of one, Megatron model parallel (1, 1), CPU router detours (scoped)."""
    with cpu_router_harness() as meg:
        yield meg


def _config(**kw: Any) -> Any:
    from megatron.core.transformer.transformer_config import TransformerConfig

    base: dict[str, Any] = {
        "num_layers": 4,
        "hidden_size": HIDDEN,
        "num_attention_heads": 2,
        "num_moe_experts": EXPERTS,
        "ffn_hidden_size": 2 * HIDDEN,
        "moe_ffn_hidden_size": 2 * HIDDEN,
        "moe_router_topk": TOPK,
        "moe_enable_routing_replay": True,
        "moe_router_load_balancing_type": "none",
        "use_cpu_initialization": True,
    }
    base.update(kw)
    return TransformerConfig(**base)


def _routers(meg: CpuMegatron, layers: list[int], **kw: Any) -> list[Any]:
    """Fresh routers (the only RouterReplay instances of the process) for global ``layers``."""
    meg.RouterReplay.clear_global_router_replay_instances()
    return build_routers(SPEC, layers, hidden=HIDDEN, **kw)


def _forward(
    routers: list[Any], hidden: torch.Tensor, padding: torch.Tensor | None = None
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    with torch.no_grad():
        return [r(hidden, padding_mask=padding) for r in routers]


def _mb_routes(mb: Microbatch) -> torch.Tensor:
    assert mb.routes is not None
    return mb.routes


SPEC = RouteSpec(num_layers=4, topk=TOPK, num_experts=EXPERTS, moe_layers=(1, 2, 3))
MOE = [1, 2, 3]


def _recorded_table(
    routers: list[Any],
    lengths: list[int],
    captured: list[int],
    hidden: torch.Tensor,
) -> Any:
    """Record the routers' top-k on ``hidden`` [S, b, H] and store routes per trajectory."""
    with record_schedule(routers) as rec:
        _forward(routers, hidden)
        recorded = rec.take()
    s, b = hidden.shape[:2]
    per_layer = [recorded[g].reshape(s, b, TOPK) for g in MOE]  # sequence-major token order
    routes = []
    for i, c in enumerate(captured):
        # dense layer 0 stays zero (as vLLM reports it)
        r = np.zeros((c, SPEC.num_layers, TOPK), dtype=np.uint8)
        for layer, t in zip(MOE, per_layer, strict=True):
            r[:, layer] = t[:c, i].numpy()
        routes.append(r)
    rng = np.random.default_rng(5)
    prompt = [rng.integers(1, 100, 2).tolist() for _ in lengths]
    response = [rng.integers(1, 100, n - 2).tolist() for n in lengths]
    return rollout_table(
        trajectory_id=[f"t{i}" for i in range(len(lengths))],
        group_id=["g"] * len(lengths),
        prompt_ids=prompt,
        response_ids=response,
        loss_mask=[
            [int(2 + j <= c) for j in range(n - 2)] for n, c in zip(lengths, captured, strict=True)
        ],
        reward=[0.0] * len(lengths),
        routes=routes,
        spec=SPEC,
    )


def _to_positions(hidden: torch.Tensor, mb: Microbatch) -> torch.Tensor:
    """Hidden states [S0, b, H] of the recorded batch laid out as the microbatch's [s, b', H]."""
    lens = mb.seq_lens
    if mb.packed:
        assert mb.cu_seqlens_padded is not None
        out = torch.randn(mb.input_ids.shape[1], 1, HIDDEN)
        for i, n in enumerate(lens.tolist()):
            start = int(mb.cu_seqlens_padded[i])
            out[start : start + n, 0] = hidden[:n, i]
        return out
    out = torch.randn(mb.input_ids.shape[1], mb.input_ids.shape[0], HIDDEN)
    out[: hidden.shape[0]] = hidden
    return out


def _token_positions(mb: Microbatch) -> list[tuple[int, int, int]]:
    """(trajectory, t, flat Megatron token index) of every captured token of the microbatch."""
    out = []
    b = mb.input_ids.shape[0]
    for i, c in enumerate(mb.captured.tolist()):
        for t in range(c):
            if mb.packed:
                assert mb.cu_seqlens_padded is not None
                out.append((i, t, int(mb.cu_seqlens_padded[i]) + t))
            else:
                out.append((i, t, t * b + i))
    return out


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("align", [1, 4])
def test_record_store_replay_round_trip(megatron: CpuMegatron, packed: bool, align: int) -> None:
    routers = _routers(megatron, MOE)
    lengths, captured = [5, 9, 7], [4, 8, 5]  # ragged; trajectory 2 ends with a loss-free gap
    torch.manual_seed(1)
    hidden = torch.randn(max(lengths), len(lengths), HIDDEN)
    table = _recorded_table(routers, lengths, captured, hidden)
    recorded = _forward(routers, hidden)  # free routing (no action) = what RECORD saw
    mb = MegatronCollator(SPEC, layers=MOE, packed=packed, align=align)(table)
    assert mb.num_router_tokens == mb.input_ids.numel()
    replay_hidden = _to_positions(hidden, mb)
    with replay_schedule():
        install_replay(mb, routers)
        replayed = _forward(routers, replay_hidden, mb.padding_mask)
    b0 = hidden.shape[1]
    positions = _token_positions(mb)
    assert len(positions) == sum(captured)
    flat_pad = mb.padding_mask.T.reshape(-1) if not mb.packed else mb.padding_mask.reshape(-1)
    for (probs_r, map_r), (probs_p, map_p) in zip(recorded, replayed, strict=True):
        for i, t, q in positions:
            src = t * b0 + i
            assert torch.equal(map_p[q], map_r[src]), (i, t)
            torch.testing.assert_close(probs_p[q], probs_r[src])
        # every padded token routes to the dummy experts 0..K-1, and only those are padded
        padded = torch.nonzero(flat_pad).reshape(-1)
        assert len(padded) == mb.input_ids.numel() - sum(captured)
        dummy = torch.zeros(EXPERTS, dtype=torch.bool)
        dummy[:TOPK] = True
        assert bool((map_p[padded] == dummy).all())
    assert all(
        inst.target_topk_idx is None
        for inst in megatron.RouterReplay.global_router_replay_instances
    )


def test_replay_by_instance_order_and_stage_subset(megatron: CpuMegatron) -> None:
    """A PP stage holding layers 2 and 3 only: the collator selects them, instance order is used."""
    routers = _routers(megatron, MOE)
    lengths, captured = [6, 4], [5, 3]
    hidden = torch.randn(6, 2, HIDDEN)
    table = _recorded_table(routers, lengths, captured, hidden)
    recorded = _forward(routers, hidden)
    weights = [r.state_dict() for r in routers[1:]]
    stage = _routers(megatron, [2, 3])
    for r, w in zip(stage, weights, strict=True):
        r.load_state_dict(w)
    mb = MegatronCollator(SPEC, layers=[2, 3])(table)
    flat, offsets = r3arrow.table.flat_routes(table)
    np.testing.assert_array_equal(
        _mb_routes(mb)[0, :5].numpy(), flat[offsets[0] : offsets[1], 2:].astype(np.int32)
    )
    with replay_schedule():
        targets = install_replay(mb)  # no routers given: instance order
        replayed = _forward(stage, hidden)
    for (_, map_p), (_, map_r), t in zip(replayed, recorded[1:], targets, strict=True):
        for i, c in enumerate(captured):
            for s in range(c):
                assert torch.equal(map_p[s * 2 + i], map_r[s * 2 + i])
        assert t.dtype == torch.int32 and t.is_contiguous()


def test_schedule_clears_state_even_when_it_raises(megatron: CpuMegatron) -> None:
    routers = _routers(megatron, MOE)
    table = _recorded_table(routers, [4, 3], [3, 2], torch.randn(4, 2, HIDDEN))
    mb = MegatronCollator(SPEC, layers=MOE)(table)
    with pytest.raises(RuntimeError, match="boom"), replay_schedule():
        install_replay(mb, routers)
        insts = megatron.RouterReplay.global_router_replay_instances
        assert all(
            i.target_topk_idx is not None and len(i.replay_backward_list) == 1 for i in insts
        )
        raise RuntimeError("boom")
    for inst in megatron.RouterReplay.global_router_replay_instances:
        assert inst.target_topk_idx is None
        assert inst.replay_backward_list == []
        assert inst.router_replay_action is None
    with (
        pytest.raises(ReplayError, match="found an open replay_schedule"),
        replay_schedule(),
        replay_schedule(),
    ):
        pass


def test_forward_only_then_training_does_not_leak(megatron: CpuMegatron) -> None:
    routers = _routers(megatron, MOE)
    h1, h2 = torch.randn(5, 2, HIDDEN), torch.randn(6, 2, HIDDEN)
    mb1 = MegatronCollator(SPEC, layers=MOE)(_recorded_table(routers, [5, 4], [4, 3], h1))
    mb2 = MegatronCollator(SPEC, layers=MOE)(_recorded_table(routers, [6, 3], [5, 2], h2))
    with replay_schedule():  # forward-only log-prob pass
        install_replay(mb1, routers)
        _forward(routers, h1, mb1.padding_mask)
    with replay_schedule():  # training pass: only mb2's targets may be queued
        install_replay(mb2, routers)
        for inst, t in zip(
            megatron.RouterReplay.global_router_replay_instances, mb2.replay_targets(), strict=True
        ):
            assert len(inst.replay_backward_list) == 1 and torch.equal(
                inst.replay_backward_list[0], t
            )
        forward = _forward(routers, h2, mb2.padding_mask)
        with replay_backward():  # activation recompute pops the queued targets
            again = _forward(routers, h2, mb2.padding_mask)
        for inst in megatron.RouterReplay.global_router_replay_instances:
            assert inst.replay_backward_list == []
            assert inst.router_replay_action == megatron.RouterReplayAction.REPLAY_FORWARD
    for (_, a), (_, b) in zip(forward, again, strict=True):
        assert torch.equal(a, b)


def _assert_untouched(meg: CpuMegatron) -> None:
    for inst in meg.RouterReplay.global_router_replay_instances:
        assert inst.target_topk_idx is None and inst.replay_backward_list == []


DUPLICATE_ON_LAYER_2 = (
    r"replay target: expected 2 distinct experts per token and layer, found .* layer 2\)"
)


def test_wrong_targets_rejected_before_megatron(megatron: CpuMegatron) -> None:
    routers = _routers(megatron, MOE)
    table = _recorded_table(routers, [5, 4], [4, 3], torch.randn(5, 2, HIDDEN))
    collate = MegatronCollator(SPEC, layers=MOE)
    good = collate(table).replay_targets()
    n = good[0].shape[0]
    with replay_schedule():
        with pytest.raises(ReplayError, match=rf"expected \[{n}, 2\].*found \[{n - 1}, 2\]"):
            install_replay(
                [t if i else t[:-1] for i, t in enumerate(good)], num_tokens=n, layers=MOE
            )
        with pytest.raises(ReplayError, match="expected one target per RouterReplay instance"):
            install_replay(good[:2], num_tokens=n)
        dup = [t.clone() for t in good]
        dup[1][0, 1] = dup[1][0, 0]
        with pytest.raises(DuplicateExpertError, match=DUPLICATE_ON_LAYER_2):
            install_replay(dup, num_tokens=n, layers=MOE, num_experts=EXPERTS)
        high = [t.clone() for t in good]
        high[0][3, 0] = EXPERTS
        with pytest.raises(ExpertRangeError, match=r"found 8 \(token 3, layer 0\)") as info:
            install_replay(high, num_tokens=n, num_experts=EXPERTS)
        assert isinstance(info.value, ReplayRangeError)
        assert (info.value.token, info.value.layer) == (3, 0)
        with pytest.raises(ReplayError, match="int32 or int64"):
            install_replay([t.to(torch.uint8) for t in good], num_tokens=n)
        mb = collate(table)
        _mb_routes(mb)[1, 2, 1, 1] = _mb_routes(mb)[1, 2, 1, 0]
        with pytest.raises(DuplicateExpertError, match=DUPLICATE_ON_LAYER_2) as dup_info:
            install_replay(mb, routers)
        assert isinstance(dup_info.value, ReplayDuplicateError) and dup_info.value.layer == 2
        mb = collate(table)
        _mb_routes(mb)[0, 3, 2, 0] = EXPERTS
        with pytest.raises(
            ExpertRangeError,
            match=rf"expected expert ids < num_experts={EXPERTS}, found .* layer 3\)",
        ):
            install_replay(mb)
        with pytest.raises(ReplayError, match=r"routers for global layers \[1, 2\]"):
            install_replay(MegatronCollator(SPEC, layers=[1, 2])(table), routers)
        _assert_untouched(megatron)
        assert isinstance(ReplayError("x"), ValueError)


def test_shim_counts_padding_mask_like_a_hand_count(megatron: CpuMegatron) -> None:
    from megatron.core.transformer.moe.router import TopKRouter

    remove_shims()
    assert _padding_mask_fix_present() is False  # 0.16.1 lacks Megatron-LM #6114
    assert apply_shims()["padding_mask"] is True
    patched = TopKRouter._apply_expert_bias
    assert apply_shims()["padding_mask"] is True  # idempotent
    assert TopKRouter._apply_expert_bias is patched
    assert _padding_mask_fix_present() is True
    try:
        (router,) = _routers(
            megatron, [1], moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid"
        )
        router.train()
        s, b = 5, 3  # 15 tokens != 8 experts: the unpatched broadcast would raise
        hidden = torch.randn(s, b, HIDDEN)
        padding = torch.zeros(s, b, dtype=torch.bool)
        padding[3:, 0] = True
        padding[4:, 2] = True
        _, routing_map = router(hidden, padding_mask=padding)
        hand = np.zeros(EXPERTS)
        rmap, pad = routing_map.detach().numpy(), padding.reshape(-1).numpy()
        for tok in range(s * b):
            if not pad[tok]:
                hand[np.flatnonzero(rmap[tok])] += 1
        np.testing.assert_array_equal(router.local_tokens_per_expert.numpy(), hand)
        assert hand.sum() == TOPK * int((~padding).sum())
    finally:
        remove_shims()
    assert TopKRouter._apply_expert_bias is not patched


def test_model_inputs_pass_padding_mask_and_packed_params(megatron: CpuMegatron) -> None:
    routers = _routers(megatron, MOE)
    table = _recorded_table(routers, [5, 4], [4, 3], torch.randn(5, 2, HIDDEN))
    mb = MegatronCollator(SPEC, layers=MOE, packed=True, align=4)(table)
    kw = model_inputs(mb)
    assert (
        kw["padding_mask"] is mb.padding_mask and kw["padding_mask"].shape == kw["input_ids"].shape
    )
    psp = kw["packed_seq_params"]
    assert psp.qkv_format == "thd" and psp.cu_seqlens_q.tolist() == [0, 5, 9]
    assert psp.cu_seqlens_q_padded.tolist() == [0, 8, 12] and psp.max_seqlen_q == 8
    assert "packed_seq_params" not in model_inputs(MegatronCollator(SPEC, layers=MOE)(table))


# ------------------------------------------------------------- stage router layers
@pytest.mark.parametrize(
    ("kw", "expect"),
    [
        ({"num_layers": 8, "pipeline_model_parallel_size": 4}, {0: [0, 1], 1: [2, 3], 3: [6, 7]}),
        (
            {
                "num_layers": 8,
                "pipeline_model_parallel_size": 4,
                "moe_layer_freq": [0, 0, 0, 1, 1, 1, 1, 1],
            },
            {0: [], 1: [3], 2: [4, 5]},
        ),
        (
            {"num_layers": 8, "pipeline_model_parallel_size": 2, "moe_layer_freq": 2},
            {0: [0, 2], 1: [4, 6]},
        ),
        (
            {
                "num_layers": 8,
                "pipeline_model_parallel_size": 2,
                "virtual_pipeline_model_parallel_size": 2,
            },
            {0: [0, 1, 4, 5], 1: [2, 3, 6, 7]},
        ),
        ({"num_layers": 4, "mtp_num_layers": 1}, {0: [0, 1, 2, 3]}),
    ],
)
def test_router_layers_of_a_stage_match_megatron(
    megatron: CpuMegatron, kw: dict[str, Any], expect: dict[int, list[int]]
) -> None:
    extra = (
        {"pipeline_dtype": torch.float32} if kw.get("pipeline_model_parallel_size", 1) > 1 else {}
    )
    cfg = _config(**kw, **extra)
    for rank, layers in expect.items():
        assert router_layers(cfg, pp_rank=rank, use_megatron=True) == layers
        assert router_layers(cfg, pp_rank=rank, use_megatron=False) == layers


def test_router_layers_of_a_stage_pure_python_without_megatron_config() -> None:
    cfg = types.SimpleNamespace(
        num_layers=6,
        num_moe_experts=4,
        moe_layer_freq=[0, 1, 1, 1, 1, 1],
        pipeline_model_parallel_size=3,
    )
    assert [router_layers(cfg, pp_rank=r, use_megatron=False) for r in range(3)] == [
        [1],
        [2, 3],
        [4, 5],
    ]
    dense = types.SimpleNamespace(num_layers=3, num_moe_experts=None)
    assert router_layers(dense, use_megatron=False) == []  # no layer has a router
    with pytest.raises(ReplayError, match="expected 6 entries"):
        router_layers(
            types.SimpleNamespace(num_layers=6, num_moe_experts=4, moe_layer_freq=[1, 0]),
            use_megatron=False,
        )
    uneven = types.SimpleNamespace(**vars(cfg), num_layers_in_first_pipeline_stage=1)
    with pytest.raises(ReplayError, match="need megatron-core"):
        router_layers(uneven, pp_rank=0, use_megatron=False)


def test_router_layers_from_layer_number_and_collator_for(megatron: CpuMegatron) -> None:
    routers = _routers(megatron, [1, 3])
    model = torch.nn.ModuleList(routers)
    assert router_layers(model) == [1, 3]
    with pytest.raises(TypeError, match="with a config only"):
        router_layers(model, pp_rank=0)
    collate = r3arrow.megatron.collator_for(SPEC, model=model)
    assert collate.layers == (1, 3) and collate.parallel.tp_size == 1
    cfg = _config(moe_layer_freq=[0, 1, 1, 1])
    assert r3arrow.megatron.collator_for(SPEC, cfg).layers == (1, 2, 3)
    off = r3arrow.megatron.collator_for(None, cfg)  # R3 off: no layers, sizes from the config
    assert off.spec is None and off.layers == () and off.parallel.tp_size == 1


def test_experts_from_routes_covers_router_layers_only() -> None:
    """max id + 1 over the router layers, at least top-k; dense-layer rows do not count."""
    from r3arrow.testing.megatron import experts_from_routes

    spec = RouteSpec(num_layers=3, topk=2, num_experts=None, moe_layers=(1, 2))
    routes = np.zeros((4, 3, 2), dtype=np.uint8)
    routes[:, 0] = [9, 10]  # a dense layer's rows (an engine may fill them): ignored
    routes[:, 1:] = [0, 1]
    routes[2, 2] = [5, 3]

    def table(r: np.ndarray) -> Any:
        return rollout_table(
            trajectory_id=["t"], group_id=["g"], prompt_ids=[[1]], response_ids=[[2, 3, 4, 5]],
            loss_mask=[[1, 1, 1, 1]], reward=[0.0], routes=[r], spec=spec,
        )  # fmt: skip

    assert experts_from_routes(table(routes)) == 6
    routes[:, 1:] = [0, 1]
    assert experts_from_routes(table(routes)) == 2  # ids 0 and 1 only: two experts suffice
