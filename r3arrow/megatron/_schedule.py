"""Schedule scope (``docs/design.md`` §7 Schedule scope): one replay or record schedule per
thread at a time. A schedule owns the ``RouterReplay`` instances it installs into or records:
each is cleared when the schedule first takes it and again when the schedule ends; instances
it never takes keep their state. `install_replay` is the replay trust boundary (Megatron
accepts wrong targets silently): every target's shape, dtype and ids are checked once before
it is queued (§4 Expert ids). The record schedule collects the routers' own top-k
(``docs/train-routes.md``, "Contract of record_schedule")."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Literal, get_args

import torch

from r3arrow._checks import check_choice, check_int, check_nonnegative_int
from r3arrow.collate import Microbatch
from r3arrow.errors import ReplayDuplicateError, ReplayError, ReplayRangeError
from r3arrow.ids import check_routes
from r3arrow.megatron._probe import (
    ReplayProbe,
    add_fallback,
    close_fallback,
    close_probe,
    open_fallback,
    open_probe,
)
from r3arrow.megatron._routers import (
    _check_spec_fits,
    _global_layer,
    _instances,
    _is_mtp,
    _numbered,
    _router_replay,
    _routers,
)
from r3arrow.spec import RouteSpec

ReplayAction = Literal["replay_forward", "replay_backward"]

_local = threading.local()  # .schedule: this thread's open _Schedule, if any


class _Schedule:
    """An open schedule: its name, the action it sets, the instances it took (by id:
    instance and the action it gave it, None for the native ones) and the targets it
    registered fallback rows for (None: none yet, the classes unpatched)."""

    __slots__ = ("action", "fallback", "name", "probe", "taken")

    def __init__(self, name: str, action: Any) -> None:
        self.name, self.action = name, action
        self.probe: ReplayProbe | None = None
        self.taken: dict[int, tuple[Any, Any]] = {}
        self.fallback: list[torch.Tensor] | None = None

    def take(self, instances: Iterable[Any], action: Any) -> None:
        """Give ``instances`` ``action`` (None: native), clearing each on its first take."""
        for inst in instances:
            held = self.taken.get(id(inst))
            if held is None:
                inst.clear_indices()
            if held is None or held[1] is not action:
                self.taken[id(inst)] = (inst, action)
                if action is None:
                    inst.clear_router_replay_action()
                else:
                    inst.set_router_replay_action(action)


def _open(name: str, action: Any) -> _Schedule:
    """Open schedule ``name`` on this thread; `ReplayError` naming the open one, if any."""
    active: _Schedule | None = getattr(_local, "schedule", None)
    if active is not None:
        raise ReplayError(
            f"{name}: expected no schedule in progress on this thread, found an open "
            f"{active.name} (schedules do not nest; end it first)"
        )
    schedule = _local.schedule = _Schedule(name, action)
    return schedule


def _close(schedule: _Schedule) -> None:
    """End ``schedule``: every instance it took is cleared (indices, FIFO, action), its
    fallback rows dropped."""
    _local.schedule = None
    try:
        for inst, _ in schedule.taken.values():
            inst.clear_indices()
            inst.clear_router_replay_action()
    finally:
        if schedule.fallback is not None:
            targets, schedule.fallback = schedule.fallback, None
            close_fallback(targets)


def _replaying(caller: str) -> _Schedule:
    """This thread's open replay schedule with an action, else `ReplayError` naming it."""
    schedule: _Schedule | None = getattr(_local, "schedule", None)
    if schedule is None or schedule.name != "replay_schedule" or schedule.action is None:
        found = (
            "none"
            if schedule is None
            else "replay_schedule(None) (routers free)"
            if schedule.name == "replay_schedule"
            else f"an open {schedule.name}"
        )
        raise ReplayError(
            f"{caller}: expected an open replay_schedule('replay_forward' or "
            f"'replay_backward') around it, found {found}"
        )
    return schedule


@contextlib.contextmanager
def replay_schedule(
    action: ReplayAction | None = "replay_forward", *, measure_agreement: bool = False
) -> Iterator[ReplayProbe | None]:
    """Scope of one pipeline schedule; `install_replay` needs one, once per microbatch.

    ``action``: what `install_replay` sets on the routers it installs into,
    ``"replay_forward"`` (default) or ``"replay_backward"``; None leaves every router free
    (`install_replay` refuses). Each router is cleared when the schedule first installs into
    it and again on exit, errors included; routers it installs nothing into are untouched.
    Another schedule of this thread open raises `ReplayError` (``record_schedule`` included:
    they do not nest). ``measure_agreement=True`` yields a `ReplayProbe`
    (``docs/replay-probe.md``); otherwise nothing is patched and the block gets None.
    """
    if not isinstance(measure_agreement, bool):
        raise TypeError(
            f"measure_agreement: expected a bool, found {type(measure_agreement).__name__}"
        )
    act = None
    if action is not None:
        act = _router_replay().RouterReplayAction(
            check_choice(action, "action", get_args(ReplayAction))
        )
    schedule = _open("replay_schedule", act)
    ok = False
    try:
        if measure_agreement:
            schedule.probe = open_probe()
        yield schedule.probe
        ok = True
    finally:
        try:
            if schedule.probe is not None:
                close_probe(schedule.probe, ok=ok)
        finally:
            _close(schedule)


@contextlib.contextmanager
def replay_backward() -> Iterator[None]:
    """Switch the routers the open `replay_schedule` replays to ``REPLAY_BACKWARD``
    (recompute pops targets in install order), restoring their actions on exit. Raises
    `ReplayError` outside a replay schedule with an action."""
    insts = [i for i, act in _replaying("replay_backward").taken.values() if act is not None]
    before = [inst.router_replay_action for inst in insts]
    backward = _router_replay().RouterReplayAction.REPLAY_BACKWARD
    for inst in insts:
        inst.set_router_replay_action(backward)
    try:
        yield
    finally:
        for inst, act in zip(insts, before, strict=True):
            inst.set_router_replay_action(act)


class RouteRecorder:
    """Handle yielded by `record_schedule`; ``layers``: the global (0-based) layer id of each
    recorded router, in router order."""

    def __init__(self, instances: Sequence[Any], layers: Sequence[int]) -> None:
        self._instances = list(instances)
        self.layers: tuple[int, ...] = tuple(layers)
        self._open = True

    def take(self) -> dict[int, torch.Tensor]:
        """The top-k each router recorded in its last forward, ``{global layer id: int64
        [tokens, K]}`` in Megatron's router token order, on the router's device; the state
        is then dropped. Raises `ReplayError` when a router recorded nothing since the last
        `take`, and after the schedule has ended.
        """
        if not self._open:
            raise ReplayError("take: expected an open record_schedule, found it ended")
        got = [inst.get_recorded_indices() for inst in self._instances]
        missing = [g for g, t in zip(self.layers, got, strict=True) if t is None]
        if missing:
            raise ReplayError(
                f"take: expected routes recorded by a forward pass since the last take on every "
                f"recorded router, found none on layers {missing} (run the microbatch's forward "
                f"first; call take once per microbatch)"
            )
        for inst in self._instances:
            inst.record_indices(None)  # the next take needs a fresh forward
        return {g: t.detach() for g, t in zip(self.layers, got, strict=True)}

    def __repr__(self) -> str:
        state = "open" if self._open else "ended"
        return f"RouteRecorder(layers={list(self.layers)}, {state})"


def _layer_ids(routers: list[Any], layers: Sequence[int] | None) -> list[int]:
    if layers is None:
        ids = _numbered(routers, " or layers= naming their global ids (record_schedule)")
    else:
        ids = [check_int(g, "layers[i]", minimum=0) for g in layers]
        if len(ids) != len(routers):
            raise ValueError(
                f"layers: expected one global layer id per recorded router ({len(routers)}), "
                f"found {len(ids)}"
            )
    if len(set(ids)) != len(ids):
        raise ValueError(f"layers: expected distinct global layer ids, found {ids}")
    return ids


@contextlib.contextmanager
def record_schedule(
    model_or_routers: Any, *, layers: Sequence[int] | None = None, mtp: bool = False
) -> Iterator[RouteRecorder]:
    """Scope in which the routers of ``model_or_routers`` record their own top-k.

    ``model_or_routers``: a model, a router or a list of either, built with
    ``moe_enable_routing_replay``. ``layers``: their global ids in router order (default:
    ``layer_number``). ``mtp``: record multi-token-prediction routers too (default: they
    route natively, unrecorded). The recorded routers' replay state is cleared on entry and
    on exit, errors included; other routers are untouched. Yields a `RouteRecorder`:
    ``take()`` after each microbatch's forward.

    Raises `ReplayError` if a record or replay schedule of this thread is open (they do not
    nest), no router with a ``RouterReplay`` is found, or a router has no ``layer_number``;
    `TypeError` for an object that is no router nor model, `TypeError`/`ValueError` for
    misuse of ``layers``.
    """
    routers = _routers(model_or_routers)
    if not mtp:
        routers = [r for r in routers if not _is_mtp(r)]
    if not routers:
        raise ReplayError("record_schedule: expected at least one MoE router, found none")
    ids = _layer_ids(routers, layers)
    instances = [r.router_replay for r in routers]
    schedule = _open("record_schedule", _router_replay().RouterReplayAction.RECORD)
    recorder = RouteRecorder(instances, ids)
    try:
        schedule.take(instances, schedule.action)
        yield recorder
    finally:
        recorder._open = False
        _close(schedule)


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


MissingPolicy = Literal["error", "native"]
"""What `install_replay` does with tokens whose route is missing (``missing=``)."""

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
    missing: MissingPolicy = "error",
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

    Tokens whose rollout route is missing (`Microbatch.fallback_mask`, ``docs/fallback.md``):
    ``missing="error"`` (default) refuses a microbatch with any on this rank's routers
    (`ReplayError`: how many, which sequences); ``"native"`` lets each installed router
    choose exactly those tokens itself, by megatron-core's own top-k of its scores (forward
    and ``REPLAY_BACKWARD`` recompute alike), while every other token replays its target.
    A microbatch without marks takes the same path under both. The fraction that fell back:
    ``sum(mb.fallback_routes) / sum(mb.token_routes)`` over the schedule's microbatches.

    Raises `TypeError`/`ValueError` for argument misuse (raw targets without
    ``num_tokens``, ``layers`` not one per target, an unknown ``mtp`` or ``missing``) and
    `ReplayError` (`ReplayRangeError`, `ReplayDuplicateError` for ids; missing routes under
    ``missing="error"``) before anything reaches Megatron, and outside a `replay_schedule`
    with an action.
    """
    mtp = check_choice(mtp, "mtp", get_args(MtpPolicy))  # type: ignore[assignment]
    missing = check_choice(missing, "missing", get_args(MissingPolicy))  # type: ignore[assignment]
    if isinstance(mb, Microbatch) and (mb.spec is None or not mb.r3):
        raise ReplayError(
            "install_replay: expected a microbatch with routes, found one collated with R3 "
            "off (MegatronCollator(spec=None)); leave the routers free (replay_schedule(None)) "
            "instead of installing targets"
        )
    schedule = _replaying("install_replay")
    micro = mb if isinstance(mb, Microbatch) else None
    fallback = micro is not None and micro.fallback_routes > 0
    if fallback and missing == "error":
        assert micro is not None
        raise ReplayError(_missing_message(micro))
    if isinstance(mb, Microbatch):
        assert mb.spec is not None  # checked above
        spec: RouteSpec | None = mb.spec
        targets = mb.replay_targets()
        tokens = mb.num_router_tokens
        ids = list(mb.layers)
        experts = num_experts if num_experts is not None else mb.spec.num_experts
        topk: int | None = mb.spec.topk
    else:
        spec = None
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
        if spec is not None:
            _check_spec_fits(spec, (getattr(r, "config", None) for r in given))
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
    for name, t in zip(ids, targets, strict=True):  # int32/int64 [tokens, top-k] tensors
        what = f"replay target of layer {name}: expected"
        if not isinstance(t, torch.Tensor):
            raise ReplayError(f"{what} a torch.Tensor, found {type(t).__name__}", layer=name)
        if t.dtype not in (torch.int32, torch.int64):
            raise ReplayError(f"{what} int32 or int64, found {t.dtype}", layer=name)
        if topk is None and t.dim() == 2:
            topk = int(t.shape[1])
        if t.dim() != 2 or t.shape[0] != tokens or t.shape[1] != topk:
            raise ReplayError(
                f"{what} [{tokens}, {topk}] (tokens this rank's router sees, top-k), "
                f"found {list(t.shape)}",
                layer=name,
            )
    if check and targets and micro is not None and spec is not None:
        # A microbatch's targets share one buffer: one blockwise scan of all its layers,
        # skipped when the collator's fused pass checked the same bound (docs/collation.md).
        if not (micro.ids_validated and experts == spec.num_experts):
            _check_target_ids(micro.replay_tensor(), experts, micro.layers)
    elif check:
        for name, t in zip(ids, targets, strict=True):
            _check_target_ids(t.unsqueeze(0), experts, [name])
    schedule.take(native, None)
    schedule.take(receivers, schedule.action)
    if fallback and targets:
        assert micro is not None
        if schedule.fallback is None:
            open_fallback()
            schedule.fallback = []
        schedule.fallback.extend(targets)
        add_fallback(targets, _router_rows(micro, micro.fallback_mask))
    for inst, t in zip(receivers, targets, strict=True):
        inst.set_target_indices(t)
    if schedule.probe is not None:
        # the padding for routers handed no mask (raw targets: none): the routers' token
        # order (flat ``s * b + b_idx``), this TP rank's slice under sequence parallelism
        pad = None if micro is None else _router_rows(micro, micro.padding_mask)
        schedule.probe._padding.update(dict.fromkeys(map(id, receivers), pad))
    return targets


def _router_rows(micro: Microbatch, mask: torch.Tensor | None) -> torch.Tensor:
    """A ``[b, S]`` mask of ``micro`` in the routers' token order (flat ``s * b + b_idx``),
    this TP rank's slice under sequence parallelism."""
    assert mask is not None
    rows = mask.transpose(0, 1).reshape(-1)
    if micro.sequence_parallel:
        n = micro.num_router_tokens
        rows = rows[micro.tp_rank * n : (micro.tp_rank + 1) * n]
    return rows


def _missing_message(micro: Microbatch) -> str:
    """The ``missing="error"`` refusal: how many tokens, which sequences of the microbatch."""
    assert micro.fallback_mask is not None
    tokens = micro.fallback_routes // max(1, len(micro.layers))
    rows = _router_rows(micro, micro.fallback_mask)
    flat = torch.nonzero(rows.cpu()).reshape(-1)
    if micro.sequence_parallel:
        flat = flat + micro.tp_rank * micro.num_router_tokens
    columns = int(micro.fallback_mask.shape[0])
    pos, col = flat // columns, flat % columns  # [P, C] flat order
    if micro.packed:
        assert micro.cu_seqlens_padded is not None
        index = micro.token_index
        full = pos if index is None else index.cpu().to(torch.int64)[pos]
        bounds = micro.cu_seqlens_padded.cpu().to(torch.int64)[1:]
        seqs = torch.searchsorted(bounds, full, right=True)
    else:
        seqs = col
    which = sorted(set(seqs.tolist()))
    shown = ", ".join(map(str, which[:8])) + (", ..." if len(which) > 8 else "")
    return (
        f"install_replay: expected a route for every token (missing='error'), found {tokens} "
        f"tokens whose rollout route is missing (routes_missing marks) on this rank's "
        f"routers, in sequences [{shown}] of the microbatch (rows of its table); pass "
        f"missing='native' to let the routers choose exactly those tokens (docs/fallback.md)"
    )


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
    native = [] if mtp == "replay" else [r.router_replay for r in mtp_routers]
    return [by_layer[g].router_replay for g in ids], native, experts, topk
