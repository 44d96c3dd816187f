"""Real megatron-core routers on a CPU machine: for tests, demos and examples, not for training.

megatron-core's ``TopKRouter`` runs on a CPU once three things hold: a ``torch.distributed``
world (gloo, one rank) with Megatron model parallel (1, 1) initialised, a
``torch.cuda.current_device`` that answers without a GPU (0.16.1 moves router weights to it),
and a ``te_general_gemm`` name in ``moe_utils`` (0.16.1 reads it even without Transformer
Engine). `cpu_router_harness` provides all three for the duration of a ``with`` block and
restores everything on exit; `build_routers` builds real routers with random weights inside
it; `replay_check` replays a microbatch into them and counts tokens whose experts differ from
the rollout's. `experts_from_routes` sizes routers for a table whose spec does not know its
expert count (vLLM does not report it).

Nothing here is needed, or meant, for training: a trainer has a GPU, its own process groups
and its own model; it uses `r3arrow.megatron.install_replay` and `replay_schedule` directly.
megatron-core is imported inside the functions only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import socket
from collections.abc import Iterator, Sequence
from typing import Any, cast

import numpy as np
import pyarrow as pa
import torch

from r3arrow._checks import check_int
from r3arrow.spec import RouteSpec


@dataclasses.dataclass(frozen=True)
class CpuMegatron:
    """The megatron-core names a harness user needs (yielded by `cpu_router_harness`)."""

    TopKRouter: Any
    RouterReplay: Any
    RouterReplayAction: Any
    moe_utils: Any


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def aux_loss_tracker(moe_utils: Any) -> dict[str, Any]:
    """megatron-core's per-layer aux-loss tracker dict (``"load_balancing_loss"`` -> values).

    0.16 exposes it as ``get_moe_layer_wise_logging_tracker()``; later releases deprecate that
    for ``get_moe_metrics_tracker().metrics``. Both return the same live dict.
    """
    if hasattr(moe_utils, "get_moe_metrics_tracker"):
        return cast("dict[str, Any]", moe_utils.get_moe_metrics_tracker().metrics)
    return cast("dict[str, Any]", moe_utils.get_moe_layer_wise_logging_tracker())


def aux_loss_values(moe_utils: Any, name: str = "load_balancing_loss") -> Any:
    """The per-layer values tensor megatron-core tracked for aux loss ``name``.

    0.16 keeps ``{"values": tensor, ...}`` dicts; 0.19 keeps ``MetricEntry`` objects.
    Raises ``KeyError`` if nothing was tracked under ``name``.
    """
    entry = aux_loss_tracker(moe_utils)[name]
    return entry["values"] if isinstance(entry, dict) else entry.values


@contextlib.contextmanager
def cpu_router_harness() -> Iterator[CpuMegatron]:
    """A gloo world of one with Megatron model parallel (1, 1), for routers on this CPU.

    Scoped: on exit the process group (if this block started it), the model-parallel state,
    ``torch.cuda.current_device`` (patched only without a GPU), ``moe_utils.te_general_gemm``
    (added only when absent), the ``RouterReplay`` instance list and the MoE aux-loss tracker
    are all as they were before the block. Inside, the instance list starts empty (routers
    built inside are the only instances of the process) and is restored on exit.

    Raises `RuntimeError` if Megatron model parallel is already initialised (this block would
    tear down state it does not own) and `ImportError` without megatron-core.
    """
    import torch.distributed as dist
    from megatron.core import parallel_state
    from megatron.core.transformer.moe import moe_utils
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    if parallel_state.model_parallel_is_initialized():
        raise RuntimeError(
            "cpu_router_harness: expected no Megatron model parallel state, found it "
            "initialised (the harness is for CPU tests and demos, not inside a trainer)"
        )
    saved_instances = list(RouterReplay.global_router_replay_instances)
    tracker = aux_loss_tracker(moe_utils)
    saved_tracker = dict(tracker)
    patched_cuda = not torch.cuda.is_available()
    saved_device = torch.cuda.current_device
    had_te = hasattr(moe_utils, "te_general_gemm")
    started = False
    try:
        if patched_cuda:
            setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))  # noqa: B010
        if not had_te:
            moe_utils.te_general_gemm = None
        started = not dist.is_initialized()
        if started:
            dist.init_process_group(
                "gloo", init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1
            )
        parallel_state.initialize_model_parallel(1, 1)
        RouterReplay.clear_global_router_replay_instances()
        yield CpuMegatron(TopKRouter, RouterReplay, RouterReplayAction, moe_utils)
    finally:
        RouterReplay.clear_global_router_replay_instances()
        RouterReplay.global_router_replay_instances.extend(saved_instances)
        tracker.clear()
        tracker.update(saved_tracker)
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        if started and dist.is_initialized():
            dist.destroy_process_group()
        if patched_cuda:
            setattr(torch.cuda, "current_device", saved_device)  # noqa: B010
        if not had_te and hasattr(moe_utils, "te_general_gemm"):
            del moe_utils.te_general_gemm


def build_routers(
    spec: RouteSpec,
    layers: Sequence[int],
    *,
    hidden: int = 16,
    seed: int = 0,
    num_experts: int | None = None,
    **config: Any,
) -> list[Any]:
    """Real megatron-core ``TopKRouter``s (random weights, seeded) for the global ``layers``.

    Call inside `cpu_router_harness`. Router ``i`` gets ``layer_number = layers[i] + 1``
    (Megatron's 1-based global numbering) and registers one ``RouterReplay`` instance, in
    ``layers`` order. The ``TransformerConfig`` has ``num_layers=spec.num_layers``, top-k
    ``spec.topk``, ``num_experts`` (default ``spec.num_experts``), replay on, no load
    balancing; ``config`` keywords override or add fields. An id ``>= spec.num_layers`` is an
    MTP router, numbered as megatron-core numbers the router of MTP depth ``d``
    (``num_layers + d``); it needs ``mtp_num_layers`` in ``config``.

    Raises `ValueError` when the expert count is unknown (``spec.num_experts`` and
    ``num_experts`` both None: see `experts_from_routes`) or a layer id is out of range.
    """
    from megatron.core.transformer.moe.moe_utils import get_default_pg_collection
    from megatron.core.transformer.moe.router import TopKRouter
    from megatron.core.transformer.transformer_config import TransformerConfig

    experts = num_experts if num_experts is not None else spec.num_experts
    if experts is None:
        raise ValueError(
            "build_routers: expected num_experts (the spec has none: size it from the routes "
            "with experts_from_routes), found None"
        )
    experts = check_int(experts, "num_experts", minimum=spec.topk)
    hidden = check_int(hidden, "hidden", minimum=1)
    total = spec.num_layers + int(config.get("mtp_num_layers") or 0)
    ids = [check_int(g, "layers[i]", minimum=0, maximum=total - 1) for g in layers]
    fields: dict[str, Any] = {
        "num_layers": spec.num_layers,
        "hidden_size": hidden,
        "num_attention_heads": 2,
        "num_moe_experts": experts,
        "moe_ffn_hidden_size": hidden,
        "moe_router_topk": spec.topk,
        "moe_enable_routing_replay": True,
        "moe_router_load_balancing_type": "none",
        "use_cpu_initialization": True,
    }
    fields.update(config)
    cfg = TransformerConfig(**fields)
    torch.manual_seed(seed)
    routers = []
    for g in ids:
        router = TopKRouter(cfg, pg_collection=get_default_pg_collection())
        router.set_layer_number(g + 1)
        routers.append(router)
    return routers


def experts_from_routes(table: pa.Table, spec: RouteSpec | None = None) -> int:
    """An expert count that fits every id the table's router layers carry.

    ``max id + 1`` over the spec's router layers (``spec`` defaults to the table's), at least
    top-k: the smallest router that can replay the routes. For specs without ``num_experts``
    (an engine that does not report it); the real count may be larger (unused experts).
    Raises `R3ArrowError` subclasses for a table without a valid route spec.
    """
    from r3arrow.table import flat_routes, route_spec

    spec = route_spec(table) if spec is None else spec
    rows, _ = flat_routes(table)
    layers = list(spec.router_layers)
    top = int(rows[:, layers, :].max()) + 1 if rows.shape[0] and layers else 0
    return max(top, spec.topk)


def replay_check(routers: Sequence[Any], mb: Any, table: pa.Table) -> tuple[int, int]:
    """Replay ``mb`` into ``routers``; return (tokens checked, tokens whose experts differ).

    ``mb``: a packed `r3arrow.collate.Microbatch` collated from ``table`` for the routers'
    layers (one router per ``mb.layers`` entry, in that order, built by `build_routers`).
    The routers' weights are random: every captured token must nevertheless select exactly
    the table's experts on every layer, because the targets are replayed. Runs inside one
    `r3arrow.megatron.replay_schedule`; hidden states are random ``[T, 1, hidden]``.
    """
    from r3arrow.megatron import install_replay, replay_schedule
    from r3arrow.table import flat_routes

    if not mb.packed:
        raise ValueError("replay_check: expected a packed microbatch, found an unpacked one")
    cfg = routers[0].config
    experts, hidden_size = int(cfg.num_moe_experts), int(cfg.hidden_size)
    hidden = torch.randn(mb.num_tokens, 1, hidden_size)  # packed: [s = T, b = 1, h]
    with replay_schedule(), torch.no_grad():
        install_replay(mb, list(routers))
        maps = [router(hidden, padding_mask=mb.padding_mask.reshape(-1))[1] for router in routers]
    chosen = torch.stack(maps, dim=1)  # [T, L_local, E] bool
    got = chosen[~mb.padding_mask.reshape(-1)]
    engine_rows, _ = flat_routes(table)
    want = np.zeros((engine_rows.shape[0], len(mb.layers), experts), dtype=bool)
    ids = engine_rows[:, list(mb.layers), :].astype(np.int64)
    np.put_along_axis(want, ids, True, axis=-1)
    differ = (got.numpy() != want).any(axis=(1, 2))
    return int(got.shape[0]), int(differ.sum())


__all__ = [
    "CpuMegatron",
    "aux_loss_tracker",
    "aux_loss_values",
    "build_routers",
    "cpu_router_harness",
    "experts_from_routes",
    "replay_check",
]
