"""Replay targets checked, then handed to ``RouterReplay.set_replay_data``.

Megatron itself accepts wrong targets silently; this is the replay trust boundary, where
every target's shape, dtype and ids are checked once (the id rules are `r3arrow.ids`;
``docs/design.md``, "Expert ids").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal, get_args

import torch

from r3arrow._checks import check_choice, check_nonnegative_int
from r3arrow.collate import Microbatch
from r3arrow.errors import ReplayDuplicateError, ReplayError, ReplayRangeError
from r3arrow.ids import check_routes
from r3arrow.megatron._routers import (
    _global_layer,
    _is_mtp,
    _replay_of,
    _router_replay,
    _routers,
)
from r3arrow.megatron._schedule import _mark_native


def _check_target_ids(arr: torch.Tensor, num_experts: int | None, layer_ids: Sequence[int]) -> None:
    """The id rules on ``[layers, tokens, K]`` replay targets (`r3arrow.ids.check_routes`)."""
    check_routes(
        arr,
        num_experts=num_experts,
        layer_ids=layer_ids,
        layers_first=True,
        what="replay target",
        range_error=ReplayRangeError,
        duplicate_error=ReplayDuplicateError,
    )


def _check_targets(
    targets: Sequence[torch.Tensor],
    names: Sequence[int],
    num_tokens: int,
    topk: int | None,
    num_experts: int | None,
    check_ids: bool,
) -> None:
    """Each target an int32/int64 ``[num_tokens, topk]`` tensor (top-k: the first target's when
    None), else `ReplayError` with ``layer`` set; with ``check_ids`` also ids in
    ``[0, num_experts)`` and no expert twice in a row (`ReplayRangeError`/
    `ReplayDuplicateError`, ``token`` and ``layer`` set). ``names``: global layer ids."""
    for name, t in zip(names, targets, strict=True):
        if not isinstance(t, torch.Tensor):
            raise ReplayError(
                f"replay target of layer {name}: expected a torch.Tensor, found {type(t).__name__}",
                layer=name,
            )
        if t.dtype not in (torch.int32, torch.int64):
            raise ReplayError(
                f"replay target of layer {name}: expected int32 or int64, found {t.dtype}",
                layer=name,
            )
        if topk is None and t.dim() == 2:
            topk = int(t.shape[1])
        if t.dim() != 2 or t.shape[0] != num_tokens or t.shape[1] != topk:
            raise ReplayError(
                f"replay target of layer {name}: expected [{num_tokens}, {topk}] (tokens this "
                f"rank's router sees, top-k), found {list(t.shape)}",
                layer=name,
            )
    if check_ids:
        for name, t in zip(names, targets, strict=True):
            _check_target_ids(t.unsqueeze(0), num_experts, [name])


MtpPolicy = Literal["exclude", "replay", "error"]
"""What `install_replay` does with multi-token-prediction routers (``mtp=``)."""
_MTP_OPTIONS = (
    "mtp='exclude' (default: MTP routers route natively, no targets), mtp='replay' (the "
    "microbatch carries routes for their global layers, layer_number - 1) or mtp='error'"
)


def install_replay(
    mb: Microbatch | Sequence[torch.Tensor],
    routers: Any = None,
    *,
    num_tokens: int | None = None,
    num_experts: int | None = None,
    layers: Sequence[int] | None = None,
    check: bool = True,
    mtp: MtpPolicy = "exclude",
) -> list[torch.Tensor]:
    """Validate replay targets, then hand them to Megatron's ``RouterReplay``; return them.

    ``mb``: a `Microbatch` (targets, token count, layers and ``num_experts`` from it; one
    collated with R3 off raises `ReplayError`) or a list
    of ``[tokens, K]`` tensors in router-instance order (then ``num_tokens`` is required).
    ``routers`` (a model, modules or routers): targets go to routers by ``layer_number``
    (1-based global), which must match the microbatch's layers; ``num_experts`` and top-k are
    checked against each router. Without ``routers`` targets follow instance order and their
    number must equal the router instances of this process. ``check=False`` skips the id
    scan (shapes are always checked).

    MTP policy (``docs/design.md``, "PP-local layers"). Megatron registers the routers of
    multi-token-prediction layers as ``RouterReplay`` instances too (Megatron-LM #7404) and
    ``set_replay_data`` wants one tensor per instance; an MTP router is one whose
    ``layer_number`` exceeds ``config.num_layers`` (megatron-core numbers the router of MTP
    depth ``d`` as ``num_layers + d``). Engines report decoder layers only, so:

    * ``mtp="exclude"`` (default): MTP routers among ``routers`` get no target; their
      instances are marked native for the schedule (action None, skipped by
      the replay actions and `replay_backward`), so they route with their own weights while
      the decoder replays. The return value has one target per replayed instance.
    * ``mtp="replay"``: MTP routers are replayed like decoder routers, by global layer
      ``layer_number - 1``; the microbatch must carry routes for those layers.
    * ``mtp="error"``: MTP routers among ``routers`` raise `ReplayError`.

    Without ``routers`` MTP routers cannot be told apart: a target count that does not match
    the instance count raises `ReplayError` naming MTP as a likely cause and the options.

    Raises `TypeError`/`ValueError` for argument misuse (raw targets without ``num_tokens``,
    ``layers`` not one per target, an unknown ``mtp``) and `ReplayError` (subclasses
    `ReplayRangeError`, `ReplayDuplicateError`) for targets that do not fit, before anything
    reaches Megatron.
    """
    mtp = check_choice(mtp, "mtp", get_args(MtpPolicy))  # type: ignore[assignment]
    if isinstance(mb, Microbatch) and (mb.spec is None or not mb.r3):
        raise ReplayError(
            "install_replay: expected a microbatch with routes, found one collated with R3 "
            "off (MegatronCollator(spec=None)); leave the routers free (replay_schedule(None)) "
            "instead of installing targets"
        )
    rr = _router_replay().RouterReplay
    instances = list(rr.global_router_replay_instances)
    if isinstance(mb, Microbatch):
        assert mb.spec is not None  # checked above
        targets = mb.replay_targets()
        tokens = mb.num_router_tokens
        ids = list(mb.layers)
        experts = num_experts if num_experts is not None else mb.spec.num_experts
        topk: int | None = mb.spec.topk
    else:
        targets = list(mb)
        if num_tokens is None:
            raise TypeError(
                "install_replay: expected num_tokens (the router's local token count) with raw "
                "targets, found None"
            )
        tokens, experts, topk = check_nonnegative_int(num_tokens, "num_tokens"), num_experts, None
        ids = list(layers) if layers is not None else list(range(len(targets)))
    if len(ids) != len(targets):
        raise ValueError(f"layers: expected one layer id per target ({len(targets)}), found {ids}")
    ordered = targets
    receivers = instances
    native: list[Any] = []
    if routers is not None:
        plan = _order_by_routers(targets, ids, _routers(routers), instances, experts, topk, mtp)
        ordered, receivers, native, experts, topk = plan
    elif len(targets) != len(instances):
        raise ReplayError(
            f"expected one target per RouterReplay instance of this process ({len(instances)} "
            f"routers), found {len(targets)} targets for layers {ids}; if the extra instances "
            f"are MTP routers (Megatron registers them too, Megatron-LM #7404), pass "
            f"routers=<the model> so install_replay can tell them apart, with {_MTP_OPTIONS}"
        )
    # A microbatch's targets share one buffer: scan all its layers in one blockwise pass.
    fast = isinstance(mb, Microbatch)
    _check_targets(targets, ids, tokens, topk, experts, check and not fast)
    # The collator's fused pass already checked these ids against the same bound: once per
    # trust boundary (docs/collation.md). Another bound (routers' or the caller's) re-checks.
    if (
        check
        and isinstance(mb, Microbatch)
        and not (mb.ids_validated and mb.spec is not None and experts == mb.spec.num_experts)
    ):
        _check_target_ids(mb.replay_tensor(), experts, mb.layers)
    if native:
        # Megatron's set_replay_data wants a tensor for every instance: hand the replayed
        # ones theirs the way it does (set_target_indices) and leave the native ones free.
        _mark_native(native)
        for inst, t in zip(receivers, ordered, strict=True):
            inst.set_target_indices(t)
    else:
        rr.set_replay_data(ordered)
    return ordered


def _mtp_numbers(routers: list[Any]) -> list[int]:
    # 1-based global numbers (num_layers + depth for MTP), whatever numbering the release uses.
    return sorted(_global_layer(r) + 1 for r in routers)


def _order_by_routers(
    targets: list[torch.Tensor],
    ids: list[int],
    routers: list[Any],
    instances: list[Any],
    experts: int | None,
    topk: int | None,
    mtp: MtpPolicy,
) -> tuple[list[torch.Tensor], list[Any], list[Any], int | None, int | None]:
    """(targets in instance order, the instances that receive them, native MTP instances,
    experts, top-k), mapped through each router's ``layer_number`` under the MTP policy."""
    mtp_routers = [r for r in routers if _is_mtp(r)]
    if mtp_routers and mtp == "error":
        raise ReplayError(
            f"expected no MTP routers (mtp='error'), found {len(mtp_routers)} with "
            f"layer_number {_mtp_numbers(mtp_routers)} > num_layers "
            f"{int(mtp_routers[0].config.num_layers)}; choose {_MTP_OPTIONS}"
        )
    replayed = routers if mtp == "replay" else [r for r in routers if not _is_mtp(r)]
    if any(getattr(r, "layer_number", None) is None for r in replayed):
        if len(replayed) != len(ids):
            raise ReplayError(
                f"expected {len(ids)} routers for layers {ids}, found {len(replayed)}"
            )
        by_layer = dict(zip(ids, replayed, strict=True))
    else:
        by_layer = {_global_layer(r): r for r in replayed}
    if sorted(by_layer) != sorted(ids):
        hint = ""
        if mtp == "replay" and mtp_routers:
            hint = (
                f"; MTP routers (layer_number {_mtp_numbers(mtp_routers)}) are replayed with "
                f"mtp='replay', so the microbatch needs routes for their layers; or choose "
                f"{_MTP_OPTIONS}"
            )
        elif mtp_routers and set(ids) & {_global_layer(r) for r in mtp_routers}:
            hint = f"; targets for MTP layers need mtp='replay' (found mtp={mtp!r})"
        raise ReplayError(
            f"expected routers for global layers {sorted(ids)}, found routers for "
            f"{sorted(by_layer)}{hint}"
        )
    target_of = {id(_replay_of(by_layer[g])): t for g, t in zip(ids, targets, strict=True)}
    native = [] if mtp == "replay" else [_replay_of(r) for r in mtp_routers]
    native_ids = {id(inst) for inst in native}
    covered = [i for i, inst in enumerate(instances) if id(inst) in target_of]
    missing = [
        i for i, inst in enumerate(instances) if id(inst) not in target_of.keys() | native_ids
    ]
    if missing or len(covered) != len(target_of):
        raise ReplayError(
            f"expected targets for every RouterReplay instance of this process "
            f"({len(instances)}), found {len(covered)} covered by layers {ids} and "
            f"{len(native)} MTP routers left native (uncovered instances {missing}: routers "
            f"not in `routers`, e.g. another model's, or MTP routers of a module not passed; "
            f"pass the whole model)"
        )
    for g in ids:
        r = by_layer[g]
        e = getattr(r, "num_experts", None)
        if e is not None and experts is not None and int(e) != int(experts):
            raise ReplayError(
                f"router of layer {g}: expected num_experts={experts} (routes), found {e}",
                layer=g,
            )
        experts = int(e) if e is not None and experts is None else experts
        k = getattr(r, "topk", None)
        if k is not None and topk is not None and int(k) != int(topk):
            raise ReplayError(
                f"router of layer {g}: expected top-k {topk} (routes), found {k}", layer=g
            )
        topk = int(k) if k is not None and topk is None else topk
    receivers = [inst for inst in instances if id(inst) in target_of]
    return [target_of[id(inst)] for inst in receivers], receivers, native, experts, topk
