"""Replay targets checked, then queued on the routers of the open replay schedule.

Megatron accepts wrong targets silently; this is the replay trust boundary, where every
target's shape, dtype and ids are checked once (``docs/design.md`` §4 Expert ids, §7).
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
    _check_spec_fits,
    _global_layer,
    _instances,
    _is_mtp,
    _replay_of,
    _routers,
)
from r3arrow.megatron._schedule import _replaying


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
    targets: Sequence[torch.Tensor], names: Sequence[int], num_tokens: int, topk: int | None
) -> None:
    """Each target an int32/int64 ``[num_tokens, topk]`` tensor, else `ReplayError`."""
    for name, t in zip(names, targets, strict=True):
        what = f"replay target of layer {name}: expected"
        if not isinstance(t, torch.Tensor):
            raise ReplayError(f"{what} a torch.Tensor, found {type(t).__name__}", layer=name)
        if t.dtype not in (torch.int32, torch.int64):
            raise ReplayError(f"{what} int32 or int64, found {t.dtype}", layer=name)
        if topk is None and t.dim() == 2:
            topk = int(t.shape[1])
        if t.dim() != 2 or t.shape[0] != num_tokens or t.shape[1] != topk:
            raise ReplayError(
                f"{what} [{num_tokens}, {topk}] (tokens this rank's router sees, top-k), "
                f"found {list(t.shape)}",
                layer=name,
            )


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
    """Validate replay targets, then queue them on the routers of the open `replay_schedule`
    with its action; return them in layer order.

    ``mb``: a `Microbatch` (targets, token count, layers and ``num_experts`` from it; R3 off
    raises `ReplayError`) or ``[tokens, K]`` tensors (then ``num_tokens`` is required;
    ``layers`` their global ids, default ``0..n-1``). ``routers`` (a model, model chunks or
    routers): targets go to its own routers by ``layer_number``, which must be exactly the
    targets' layers, and ``num_experts``/top-k and a microbatch's spec layer count
    (``num_layers``, or plus ``mtp_num_layers``) are checked against them; routers outside
    it are untouched. Without it: one target per ``RouterReplay`` instance of this process,
    in instance order. ``check=False`` skips the id scan (shapes are always checked). A
    microbatch of a stage without routers (no layers) installs nothing and returns ``[]``.

    MTP routers (``layer_number > config.num_layers``; Megatron registers them as replay
    instances too, Megatron-LM #7404): ``mtp="exclude"`` (default) leaves them routing
    natively for the schedule; ``"replay"`` replays them from routes of global layer
    ``layer_number - 1``; ``"error"`` refuses them. Without ``routers`` a count mismatch
    raises `ReplayError` naming MTP.

    Raises `TypeError`/`ValueError` for argument misuse (raw targets without
    ``num_tokens``, ``layers`` not one per target, an unknown ``mtp``) and `ReplayError`
    (`ReplayRangeError`, `ReplayDuplicateError` for ids) before anything reaches Megatron,
    and outside a `replay_schedule` with an action.
    """
    mtp = check_choice(mtp, "mtp", get_args(MtpPolicy))  # type: ignore[assignment]
    if isinstance(mb, Microbatch) and (mb.spec is None or not mb.r3):
        raise ReplayError(
            "install_replay: expected a microbatch with routes, found one collated with R3 "
            "off (MegatronCollator(spec=None)); leave the routers free (replay_schedule(None)) "
            "instead of installing targets"
        )
    schedule = _replaying("install_replay")
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
    native: list[Any] = []
    if routers is not None:
        given = _routers(routers)
        if isinstance(mb, Microbatch):
            assert mb.spec is not None
            _check_spec_fits(mb.spec, (getattr(r, "config", None) for r in given))
        receivers, native, experts, topk = _match(ids, given, experts, topk, mtp)
    else:
        receivers = _instances()
        if len(targets) != len(receivers):
            raise ReplayError(
                f"expected one target per RouterReplay instance of this process "
                f"({len(receivers)} routers), found {len(targets)} targets for layers {ids}; "
                f"pass routers=<the model> to replay its own routers only (MTP routers, which "
                f"Megatron registers too, Megatron-LM #7404, are then told apart: "
                f"{_MTP_OPTIONS})"
            )
    _check_targets(targets, ids, tokens, topk)
    if check and targets and isinstance(mb, Microbatch):
        # A microbatch's targets share one buffer: one blockwise scan of all its layers,
        # skipped when the collator's fused pass checked the same bound (docs/collation.md).
        assert mb.spec is not None
        if not (mb.ids_validated and experts == mb.spec.num_experts):
            _check_target_ids(mb.replay_tensor(), experts, mb.layers)
    elif check:
        for name, t in zip(ids, targets, strict=True):
            _check_target_ids(t.unsqueeze(0), experts, [name])
    pad = None
    if schedule.probe is not None and isinstance(mb, Microbatch):
        pad = _router_padding(mb)  # the probe's padding for routers handed no mask
    schedule.install(receivers, targets, native, pad)
    return targets


def _router_padding(mb: Microbatch) -> torch.Tensor:
    """bool ``[num_router_tokens]``: `Microbatch.padding_mask` in the routers' token order
    (flat ``s * b + b_idx``), this TP rank's slice under sequence parallelism."""
    pad = mb.padding_mask.transpose(0, 1).reshape(-1)
    if mb.sequence_parallel and mb.tp_size > 1:
        per = pad.numel() // mb.tp_size
        pad = pad[mb.tp_rank * per : (mb.tp_rank + 1) * per]
    return pad


def _mtp_numbers(routers: list[Any]) -> list[int]:
    # 1-based global numbers (num_layers + depth for MTP), whatever numbering the release uses.
    return sorted(_global_layer(r) + 1 for r in routers)


def _agreeing(router: Any, attr: str, want: int | None, layer: int, label: str) -> int | None:
    """``want``, or the router's ``attr`` when ``want`` is None; `ReplayError` if they differ."""
    got = getattr(router, attr, None)
    if got is None:
        return want
    if want is not None and int(got) != int(want):
        raise ReplayError(
            f"router of layer {layer}: expected {label}{want} (routes), found {got}", layer=layer
        )
    return int(got) if want is None else want


def _match(
    ids: list[int], routers: list[Any], experts: int | None, topk: int | None, mtp: MtpPolicy
) -> tuple[list[Any], list[Any], int | None, int | None]:
    """(the instance of each of ``ids``, native MTP instances, experts, top-k): ``routers``
    by ``layer_number`` (else in order), exactly one per target layer."""
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
        found = list(ids)
    else:
        found = [_global_layer(r) for r in replayed]
    by_layer = dict(zip(found, replayed, strict=True))
    if len(by_layer) != len(found) or sorted(found) != sorted(ids):
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
            f"{sorted(found)}{hint}"
        )
    for g in ids:
        experts = _agreeing(by_layer[g], "num_experts", experts, g, "num_experts=")
        topk = _agreeing(by_layer[g], "topk", topk, g, "top-k ")
    native = [] if mtp == "replay" else [_replay_of(r) for r in mtp_routers]
    return [_replay_of(by_layer[g]) for g in ids], native, experts, topk
