"""Router padding mask on pipeline stages under sequence parallelism, real megatron-core routers.

megatron-core 0.16.1 scatters the padding mask to the TP rank's sequence-parallel slice in
``GPTModel._preprocess`` on the first stage only; a later stage receives ``S/tp`` hidden
states but would pass the whole ``[b, S]`` mask on. ``model_inputs(pre_process=False)``
must give those routers the slice. TP 2 is simulated in a gloo world of one: each TP rank's
routers are fed the ``S/2`` slice that rank's hidden states hold (as the existing tests do),
the routers are built with ``sequence_parallel=True`` and aux loss on, and the mask goes
through ``MoELayer.forward``'s own ``transpose(0, 1)`` before the router, as in a model.
"""

from __future__ import annotations

import socket
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = [
    pytest.mark.megatron,
    pytest.mark.filterwarnings("ignore:full scope is deprecated:UserWarning"),
]

from r3arrow import RouteSpec  # noqa: E402
from r3arrow.collate import MegatronCollator, Microbatch, Parallelism  # noqa: E402
from r3arrow.megatron import (  # noqa: E402
    apply_shims,
    install_replay,
    model_inputs,
    remove_shims,
    replay_schedule,
)
from r3arrow.megatron._shim import _all_padding_aux_loss_fix_present  # noqa: E402
from r3arrow.microbatch import is_padding_table, split_microbatches  # noqa: E402
from r3arrow.table import rollout_table  # noqa: E402
from r3arrow.testing.megatron import (  # noqa: E402
    CpuMegatron,
    aux_loss_values,
    build_routers,
    cpu_router_harness,
)

HIDDEN, EXPERTS, TOPK, COEFF = 16, 8, 2, 0.01
SPEC = RouteSpec(num_layers=3, topk=TOPK, num_experts=EXPERTS, moe_layers=(1, 2))
MOE = [1, 2]


def _clear_aux_tracker(moe_utils: Any) -> None:
    """Clear megatron-core's aux-loss tracker (0.19 deprecates the 0.16 spelling)."""
    if hasattr(moe_utils, "get_moe_metrics_tracker"):
        moe_utils.get_moe_metrics_tracker().clear()
    else:
        moe_utils.clear_aux_losses_tracker()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def megatron() -> Iterator[CpuMegatron]:
    """gloo world of one, Megatron model parallel (1, 1), CPU router detours (scoped)."""
    with cpu_router_harness() as meg:
        yield meg


def _routers(meg: Any) -> list[Any]:
    """Training-mode routers with aux loss, built for TP 2 with sequence parallelism."""
    meg.RouterReplay.clear_global_router_replay_instances()
    out = build_routers(
        SPEC,
        MOE,
        hidden=HIDDEN,
        ffn_hidden_size=2 * HIDDEN,
        moe_ffn_hidden_size=2 * HIDDEN,
        moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=COEFF,
        tensor_model_parallel_size=2,
        expert_tensor_parallel_size=1,
        sequence_parallel=True,
    )
    for r in out:
        r.train()
    return out


def _table(lengths: list[int], captured: list[int], seed: int = 0) -> pa.Table:
    rng = np.random.default_rng(seed)
    routes = []
    for c in captured:
        r = np.zeros((c, SPEC.num_layers, TOPK), dtype=np.uint8)
        for layer in MOE:
            r[:, layer] = np.stack([rng.choice(EXPERTS, TOPK, replace=False) for _ in range(c)])
        routes.append(r)
    return rollout_table(
        trajectory_id=[f"t{i}" for i in range(len(lengths))],
        group_id=["g"] * len(lengths),
        prompt_ids=[[1, 2] for _ in lengths],
        response_ids=[rng.integers(3, 50, n - 2).tolist() for n in lengths],
        loss_mask=[
            [int(2 + j <= c) for j in range(n - 2)] for n, c in zip(lengths, captured, strict=True)
        ],
        reward=[0.0] * len(lengths),
        routes=routes,
        spec=SPEC,
    )


def _route(routers: list[Any], hidden: torch.Tensor, padding_bs: torch.Tensor) -> list[Any]:
    """The routers as ``MoELayer.forward`` runs them: the ``[b, s]`` mask transposed first."""
    mask = padding_bs.transpose(0, 1).bool()
    return [r(hidden, padding_mask=mask) for r in routers]


def _hand_aux_loss(router: Any, hidden: torch.Tensor, padding_sb: torch.Tensor) -> float:
    """Switch load-balancing loss over the unpadded tokens of this rank (TP group of one)."""
    with torch.no_grad():
        logits = hidden.reshape(-1, HIDDEN) @ router.weight.T
        if router.bias is not None:
            logits = logits + router.bias
        scores = torch.softmax(logits.float(), dim=-1)
        top = torch.topk(scores, TOPK, dim=1).indices
        valid = ~padding_sb.reshape(-1)
        counts = torch.zeros(EXPERTS)
        for e in top[valid].reshape(-1).tolist():
            counts[e] += 1
        tokens = int(valid.sum())
        probs = scores[valid].sum(0)
    return float((probs * counts).sum() * EXPERTS * COEFF / (TOPK * tokens * tokens))


def _tracked_aux_loss(meg: CpuMegatron, layer: int) -> float:
    values = aux_loss_values(meg.moe_utils)
    return float(values[layer]) * COEFF


def _sp_slice(x: torch.Tensor, mb: Microbatch) -> torch.Tensor:
    """This TP rank's sequence-parallel share of ``[s, ...]`` (scatter along the sequence)."""
    per = x.shape[0] // mb.tp_size
    return x[mb.tp_rank * per : (mb.tp_rank + 1) * per]


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("tp_rank", [0, 1])
def test_later_stage_routers_get_the_sequence_parallel_slice(
    megatron: CpuMegatron, packed: bool, tp_rank: int
) -> None:
    routers = _routers(megatron)
    table = _table([5, 8, 3], [5, 6, 3])  # trajectory 1 has an uncaptured suffix
    mb = MegatronCollator(
        SPEC,
        layers=MOE,
        packed=packed,
        parallel=Parallelism(tp_size=2, tp_rank=tp_rank, sequence_parallel=True),
    )(table)
    b, s = mb.input_ids.shape  # packed: b == 1, s == T
    torch.manual_seed(3)
    full_hidden = torch.randn(s, b, HIDDEN)
    hidden = _sp_slice(full_hidden, mb)  # what this TP rank receives from the previous stage
    first = model_inputs(mb, pre_process=True)
    later = model_inputs(mb, pre_process=False)
    assert first["padding_mask"] is mb.padding_mask  # the first stage scatters it itself
    assert later["padding_mask"].shape == (b, s // 2) and later["padding_mask"].is_contiguous()
    # Megatron's scatter: split the [s, b] mask along the sequence, transpose back.
    expected = _sp_slice(mb.padding_mask.transpose(0, 1), mb).transpose(0, 1)
    assert torch.equal(later["padding_mask"], expected)
    assert torch.equal(model_inputs(mb, pre_process=False)["padding_mask"], expected)

    with replay_schedule():
        install_replay(mb, routers)
        # Without the fix: the whole [b, S] mask against S/2 tokens crashes in aux-loss routing.
        with pytest.raises(RuntimeError, match="must match the size"):
            _route(routers[:1], hidden, first["padding_mask"])
    _clear_aux_tracker(megatron.moe_utils)
    with replay_schedule():
        install_replay(mb, routers)
        out = _route(routers, hidden, later["padding_mask"])
    pad_sb = later["padding_mask"].transpose(0, 1)
    flat_pad = pad_sb.reshape(-1)
    assert int((~flat_pad).sum()) > 0
    for layer, (router, target, (probs, routing_map)) in enumerate(
        zip(routers, mb.replay_targets(), out, strict=True)
    ):
        assert routing_map.shape == (mb.num_router_tokens, EXPERTS)
        replayed = torch.zeros(mb.num_router_tokens, EXPERTS, dtype=torch.bool)
        replayed.scatter_(1, target.long(), True)
        assert torch.equal(routing_map, replayed)  # every token follows its replay target
        assert bool((target[flat_pad] == torch.arange(TOPK, dtype=torch.int32)).all())
        assert probs.requires_grad
        aux = _tracked_aux_loss(megatron, MOE[layer])
        assert np.isfinite(aux) and aux > 0
        assert aux == pytest.approx(_hand_aux_loss(router, hidden, pad_sb), rel=1e-5)
    _clear_aux_tracker(megatron.moe_utils)


def test_stage_from_model_and_without_sequence_parallelism(
    megatron: CpuMegatron,
) -> None:
    table = _table([5, 3], [5, 3])
    mb = MegatronCollator(
        SPEC, layers=MOE, parallel=Parallelism(tp_size=2, tp_rank=1, sequence_parallel=True)
    )(table)
    cfg = types.SimpleNamespace(tensor_model_parallel_size=2, sequence_parallel=True)
    chunk = types.SimpleNamespace(pre_process=False, config=cfg)
    wrapped = types.SimpleNamespace(module=types.SimpleNamespace(module=chunk))  # DDP(Float16)
    assert model_inputs(mb, model=wrapped)["padding_mask"].shape == (2, 3)
    chunk.pre_process = True
    assert model_inputs(mb, model=chunk)["padding_mask"] is mb.padding_mask
    # parallel_state initialised, no pipelining: this rank is the first stage.
    assert model_inputs(mb)["padding_mask"] is mb.padding_mask
    with pytest.raises(ValueError, match="sequence_parallel=False"):
        model_inputs(
            mb,
            model=types.SimpleNamespace(
                pre_process=False,
                config=types.SimpleNamespace(tensor_model_parallel_size=2, sequence_parallel=False),
            ),
        )
    with pytest.raises(TypeError, match="one model chunk"):
        model_inputs(mb, model=[chunk, chunk])
    with pytest.raises(TypeError, match="pre_process attribute"):
        model_inputs(mb, model=torch.nn.Linear(2, 2))
    plain = MegatronCollator(SPEC, layers=MOE, parallel=Parallelism(tp_size=2, tp_rank=1))(table)
    assert model_inputs(plain, pre_process=False)["padding_mask"] is plain.padding_mask


def test_all_padding_microbatch_aux_loss_is_zero_with_the_shim(
    megatron: CpuMegatron,
) -> None:
    """A DP padding microbatch (padding mask True everywhere) through aux-loss routers."""
    table = _table([5, 8, 3], [5, 6, 3])
    parts = split_microbatches(table, num_microbatches=2, dp_size=3, dp_rank=2)
    assert [is_padding_table(p) for p in parts] == [False, True]
    collate = MegatronCollator(
        SPEC, layers=MOE, parallel=Parallelism(tp_size=2, tp_rank=0, sequence_parallel=True)
    )
    real, pad = collate(parts[0]), collate(parts[1])
    assert pad.is_padding

    def run(mb: Microbatch) -> tuple[list[float], list[torch.Tensor]]:
        routers = _routers(megatron)
        b, s = mb.input_ids.shape
        torch.manual_seed(4)
        hidden = torch.randn(s // 2, b, HIDDEN)
        _clear_aux_tracker(megatron.moe_utils)
        with replay_schedule():
            install_replay(mb, routers)
            out = _route(routers, hidden, model_inputs(mb, pre_process=False)["padding_mask"])
        sum(probs.sum() for probs, _ in out).backward()
        aux = [_tracked_aux_loss(megatron, g) for g in MOE]
        _clear_aux_tracker(megatron.moe_utils)
        return aux, [r.weight.grad for r in routers]

    remove_shims()
    assert _all_padding_aux_loss_fix_present() is False  # 0.16.1 divides 0 by 0 tokens
    aux, grads = run(pad)
    assert all(np.isnan(a) for a in aux) and all(bool(g.isnan().any()) for g in grads)
    before, _ = run(real)
    assert apply_shims()["all_padding_aux_loss"] is True
    try:
        assert apply_shims()["all_padding_aux_loss"] is True  # idempotent
        assert _all_padding_aux_loss_fix_present() is True
        aux, grads = run(pad)
        assert aux == [0.0, 0.0] and all(bool(g.isfinite().all()) for g in grads)
        after, _ = run(real)
        assert after == before  # microbatches with real tokens: unchanged
    finally:
        remove_shims()
    assert _all_padding_aux_loss_fix_present() is False


def test_stage_from_parallel_state_pipeline_and_virtual_ranks(
    megatron: CpuMegatron, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stage from Megatron's parallel_state: pipeline rank, then model chunk under VPP
    (the world of one has no pipeline: its rank getters stand in for those of a larger one)."""
    from megatron.core import parallel_state

    mb = MegatronCollator(
        SPEC, layers=MOE, parallel=Parallelism(tp_size=2, tp_rank=0, sequence_parallel=True)
    )(_table([5, 3], [5, 3]))
    whole, sliced = (2, 6), (2, 3)
    vpp: list[int | None] = [None]
    pp_rank = [0]
    monkeypatch.setattr(
        parallel_state, "get_virtual_pipeline_model_parallel_world_size", lambda: vpp[0]
    )
    monkeypatch.setattr(parallel_state, "get_pipeline_model_parallel_rank", lambda: pp_rank[0])
    assert tuple(model_inputs(mb)["padding_mask"].shape) == whole
    pp_rank[0] = 1
    assert tuple(model_inputs(mb)["padding_mask"].shape) == sliced
    assert model_inputs(mb, pre_process=True)["padding_mask"] is mb.padding_mask  # explicit wins
    vpp[0], pp_rank[0] = 2, 0
    assert tuple(model_inputs(mb, vp_stage=0)["padding_mask"].shape) == whole
    assert tuple(model_inputs(mb, vp_stage=1)["padding_mask"].shape) == sliced
    with pytest.raises(ValueError, match="expected vp_stage"):
        model_inputs(mb)


# ------------------------------------------------------------------ real TP group of 2
def _tp2_worker(rank: int, port: int, out: str) -> None:
    """One TP rank of a gloo world of 2 (CPU): a later pipeline stage's routers under SP,
    unpacked then packed. Writes its findings to ``out/rank{rank}.json``."""
    import json
    import os

    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.router_replay import RouterReplay

    # Child process only (spawned for this test): megatron-core 0.16.1 routers on the CPU in a
    # world of two, which cpu_router_harness (a world of one) does not set up.
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment,return-value]
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)
    meg = types.SimpleNamespace(TopKRouter=TopKRouter, RouterReplay=RouterReplay)
    results = {}
    try:
        for packed in (False, True):
            routers = _routers(meg)
            assert routers[0].tp_cp_group.size() == 2
            mb = MegatronCollator(
                SPEC,
                layers=MOE,
                packed=packed,
                parallel=Parallelism(tp_size=2, tp_rank=rank, sequence_parallel=True),
            )(_table([5, 8, 3], [5, 6, 3]))
            b, s = mb.input_ids.shape
            torch.manual_seed(3)
            full_hidden = torch.randn(s, b, HIDDEN)
            hidden = _sp_slice(full_hidden, mb)
            mask = model_inputs(mb, pre_process=False)["padding_mask"]
            # What Megatron's first stage does with the whole mask over this real TP group.
            scattered = tensor_parallel.scatter_to_sequence_parallel_region(
                mb.padding_mask.transpose(0, 1).contiguous()
            ).transpose(0, 1)
            crashed = False
            with replay_schedule():
                install_replay(mb, routers)
                try:  # the whole mask, as megatron passes it on to a later stage
                    _route(routers[:1], hidden, mb.padding_mask)
                except RuntimeError as exc:
                    crashed = "must match the size" in str(exc)
            _clear_aux_tracker(moe_utils)
            with replay_schedule():
                install_replay(mb, routers)
                outs = _route(routers, hidden, mask)
            tracked = aux_loss_values(moe_utils)
            followed = []
            for target, (_, routing_map) in zip(mb.replay_targets(), outs, strict=True):
                replayed = torch.zeros_like(routing_map).scatter_(1, target.long(), True)
                followed.append(bool(torch.equal(routing_map, replayed)))
            full_pad = mb.padding_mask.transpose(0, 1)
            results[str(packed)] = {
                "crashed_without_fix": crashed,
                "mask_equal": bool(torch.equal(mask, scattered)),
                "followed": followed,
                "aux": [float(tracked[g]) * COEFF for g in MOE],
                "full": [_hand_aux_loss(r, full_hidden, full_pad) for r in routers],
            }
        with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
    finally:
        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()


def test_real_tp2_group_later_stage_mask_routing_and_aux_loss(tmp_path: Any) -> None:
    """Two gloo processes form a real TP group: the whole mask crashes a later stage's
    routers, the pre-sliced one equals Megatron's own scatter, routing follows the targets,
    and the TP ranks' aux losses add up to the loss of the whole unsplit microbatch over its
    unpadded tokens."""
    import json
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    port = _free_port()
    procs = [ctx.Process(target=_tp2_worker, args=(r, port, str(tmp_path))) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=240)
    assert [p.exitcode for p in procs] == [0, 0]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for layout in ("False", "True"):
        for res in ranks:
            got = res[layout]
            assert got["crashed_without_fix"] and got["mask_equal"] and all(got["followed"])
        for layer in range(len(MOE)):
            total = ranks[0][layout]["aux"][layer] + ranks[1][layout]["aux"][layer]
            assert total == pytest.approx(ranks[0][layout]["full"][layer], rel=1e-5)
