"""Agreement during replay: the routers' own top-k vs the replayed targets, no second pass;
and route-local fallback: the router's own top-k for the tokens whose route is missing.

Contract, hook points (``RouterReplay.get_replay_topk`` and ``TopKRouter.routing``, patched
on the classes only while a probing schedule, or one with fallback targets, is open) and the
three exact paths (numba on the CPU, torch on the CPU, the full top-k elsewhere):
``docs/replay-probe.md``; fallback: ``docs/fallback.md``, "Replay".
"""

from __future__ import annotations

import dataclasses
import functools
import threading
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from r3arrow._kernels import compiled
from r3arrow.errors import ReplayError
from r3arrow.megatron._routers import _global_layer, _router_replay

if TYPE_CHECKING:
    from r3arrow.stats import RouteAgreement

_lock = threading.Lock()
_originals: dict[str, Any] = {}
_users = 0
_local = threading.local()  # .probe: the open ReplayProbe; .frame: (instance, router, mask)
# id(target tensor) -> (the target, bool [tokens] fallback rows): process-wide, since the
# REPLAY_BACKWARD recompute may run on autograd's device thread; a target's identity says
# which microbatch's rows it carries, forward or recompute, in any order.
_fallbacks: dict[int, _Fallback] = {}


@dataclasses.dataclass
class _Layer:
    """A ``RouterReplay`` instance's calls: int8 ``[T]`` ``|native ∩ target|`` rows, -1 = pad."""

    layer: int
    topk: int
    rows: list[torch.Tensor] = dataclasses.field(default_factory=list)


class ReplayProbe:
    """Agreement of the routers' native top-k with the replayed targets over one schedule.

    Yielded by ``replay_schedule(measure_agreement=True)``; read `agreement` after the
    ``with`` block. Counts are this process's routers and tokens (add the ranks'
    `RouteAgreement`s; compare pipeline stages per stage).
    """

    def __init__(self) -> None:
        self._layers: dict[int, _Layer] = {}  # id(RouterReplay instance) -> its calls
        # id(RouterReplay instance) -> padding rows of the microbatch installed last (None:
        # raw targets), for routers not handed a padding mask
        self._padding: dict[int, torch.Tensor | None] = {}
        self._problem: str | None = None
        self._state = "open"  # "open" -> "done" | "failed"
        self._counts: tuple[Any, ...] | None = None  # RouteAgreement fields, on the host
        self._agreement: RouteAgreement | None = None

    def __repr__(self) -> str:
        return (
            f"ReplayProbe({self._state}, layers={sorted(a.layer for a in self._layers.values())})"
        )

    @property
    def agreement(self) -> RouteAgreement:
        """`r3arrow.stats.RouteAgreement` of the schedule (needs the ``stats`` extra).

        ``layers``: the routers that replayed (ascending global ids); ``tokens``: the
        non-padding tokens of every observed call. Raises `ReplayError` while the schedule
        is open, after it raised, or when the calls could not be aligned (saying why).
        """
        problem = {
            "open": "expected a finished schedule, found it still open (read it after the "
            "replay_schedule block)",
            "failed": "expected a schedule that completed, found one that raised (its partial "
            "counts were dropped)",
        }.get(self._state, self._problem)
        if problem is not None:
            raise ReplayError(f"ReplayProbe.agreement: {problem}")
        if self._agreement is None:
            from r3arrow.stats import RouteAgreement  # the stats extra, only when read

            assert self._counts is not None
            self._agreement = RouteAgreement(*self._counts)
        return self._agreement

    def _fail(self, problem: str) -> None:
        if self._problem is None:
            self._problem = problem

    def _observe(
        self,
        inst: Any,
        scores: torch.Tensor,
        replayed: tuple[torch.Tensor, torch.Tensor],
        topk: int,
        groups: tuple[int | None, int | None],
        default_compute_topk: Any,
        fallback: torch.Tensor | None = None,
    ) -> None:
        """Record one replayed call: ``scores`` ``[T, E]``, ``replayed`` (probs, ids ``[T, K]``);
        ``fallback`` rows (routed natively) are left out like padding."""
        frame = getattr(_local, "frame", None)
        if frame is None or frame[0] is not inst:  # not called from this router's routing()
            frame = (inst, None, None)
        _, router, pad = frame
        if pad is None:
            pad = self._padding.get(id(inst))
        tokens, k = int(scores.shape[0]), int(replayed[1].shape[-1])
        acc = self._layers.get(id(inst))
        if acc is None:
            acc = _Layer(_layer_id(inst, router), k)
            self._layers[id(inst)] = acc
            if acc.layer < 0:
                self._fail(
                    "expected routers with a layer_number or registered RouterReplay "
                    "instances, found a router with neither"
                )
        if self._problem is not None:
            return
        if acc.topk != k or k > 127:
            self._fail(
                f"layer {acc.layer}: expected one top-k (at most 127) on every call, found "
                f"{acc.topk} and {k}"
            )
            return
        if pad is not None:
            if pad.numel() != tokens:
                self._fail(
                    f"layer {acc.layer}: expected a padding mask of {tokens} tokens (the "
                    f"router's rows), found {list(pad.shape)}"
                )
                return
            pad = pad.reshape(-1).to(device=scores.device, dtype=torch.bool)
        if fallback is not None:
            fb = fallback.to(device=scores.device)
            pad = fb if pad is None else pad | fb
        acc.rows.append(_overlap_row(scores, replayed, topk, groups, default_compute_topk, pad))

    def _finish(self, ok: bool) -> None:
        """Close: the rows become `agreement`'s counts (one host sync), or are dropped."""
        layers = sorted(self._layers.values(), key=lambda a: a.layer)
        self._layers, self._padding = {}, {}
        self._state = "done" if ok else "failed"
        if ok and self._problem is None:
            try:
                self._counts = _summed(layers, self._fail)
            except Exception as exc:  # the schedule itself succeeded: report on read
                self._fail(f"summing the counts raised {type(exc).__name__}: {exc}")


def _summed(layers: list[_Layer], fail: Any) -> tuple[Any, ...] | None:
    """`RouteAgreement` fields of the recorded rows, or None after ``fail(reason)`` when the
    calls cannot be combined. Call n of every layer is the same microbatch (Megatron runs a
    model chunk's microbatches in order), so the rows stack into ``[layers, tokens]``."""
    ids = [a.layer for a in layers]
    if not layers:
        return ((), 0, 0, np.zeros(0, np.int64), np.zeros(0, np.int64), 0)
    if len(set(ids)) != len(ids):
        fail(f"expected one router per global layer, found layers {ids}")
        return None
    calls = [len(a.rows) for a in layers]
    if len(set(calls)) != 1 or len({a.topk for a in layers}) != 1:
        fail(
            f"expected every router to replay the same number of calls with one top-k, found "
            f"calls {calls} and top-k {[a.topk for a in layers]} for layers {ids}"
        )
        return None
    shapes = [[int(r.shape[0]) for r in a.rows] for a in layers]
    for a, got in zip(layers, shapes, strict=True):
        for n, (want, found) in enumerate(zip(shapes[0], got, strict=True)):
            if want != found:
                fail(
                    f"layer {a.layer}: expected call {n} to route the {want} tokens layer "
                    f"{layers[0].layer}'s call {n} routed, found {found}"
                )
                return None
    k = layers[0].topk
    dev = layers[0].rows[0].device
    grid = torch.stack([torch.cat(a.rows).to(dev) for a in layers])  # [L, tokens] int8
    same = grid == k
    counts = torch.cat(
        [
            same.sum(dim=1),
            grid.clamp(min=0).sum(dim=1, dtype=torch.int64),
            (grid >= 0).sum(dim=1),
            same.all(dim=0).sum().reshape(1),
        ]
    )
    host = counts.cpu().numpy().astype(np.int64)  # the schedule's one host sync
    identical, overlap, tokens = host[:-1].reshape(3, len(layers))
    if (tokens != tokens[0]).any():
        fail(
            f"expected every layer to see the same non-padding tokens, found {tokens.tolist()} "
            f"for layers {ids}"
        )
        return None
    return (tuple(ids), k, int(tokens[0]), identical, overlap, int(host[-1]))


def _layer_id(inst: Any, router: Any) -> int:
    """Global layer by ``layer_number`` (router or instance), else build position, else -1."""
    if router is not None and getattr(router, "layer_number", None) is not None:
        return _global_layer(router)
    number = getattr(inst, "layer_number", None)
    if number is not None:
        return int(number) - 1
    instances = _router_replay().RouterReplay.global_router_replay_instances
    return next((i for i, x in enumerate(instances) if x is inst), -1)


def _overlap_row(
    scores: torch.Tensor,
    replayed: tuple[torch.Tensor, torch.Tensor],
    topk: int,
    groups: tuple[int | None, int | None],
    default_compute_topk: Any,
    pad: torch.Tensor | None,
) -> torch.Tensor:
    """The int8 ``[T]`` row of `_Layer`: ``|N ∩ R|`` per row (-1 where ``pad`` marks), N the
    router's own top-k of ``scores``, R the replayed ids ``replayed[1]``. On the CPU by the
    numba kernel, else on the rows R may not be the unique top-k set of (ties, NaN: the
    native top-k); off the CPU or with group-limited routing N on every row
    (``docs/replay-probe.md``, "Cost")."""
    probs, target = replayed
    k = int(target.shape[-1])
    kern = compiled()
    cpu = scores.device.type == "cpu" and not groups[1] and k == topk
    if (
        kern is not None
        and cpu
        and scores.dim() == 2
        and target.shape == (scores.shape[0], k)
        and int(scores.shape[1]) > k
        and target.dtype in (torch.int32, torch.int64)
        and scores.dtype in _MARKABLE
    ):
        s = scores.detach().contiguous()
        mask = _NO_PAD if pad is None else pad.contiguous().view(torch.uint8).numpy()
        out = torch.empty(int(scores.shape[0]), dtype=torch.int8)
        if s.dtype == torch.bfloat16:
            fn, vals = kern.overlap_rows_bf16, s.view(torch.int16).numpy().view(np.uint16)
        else:
            fn, vals = kern.overlap_rows, s.numpy()
        if fn(vals, target.contiguous().numpy(), mask, out.numpy()):
            rest = torch.nonzero(out == kern.UNSURE).reshape(-1)
            overlap = _rows_overlap(scores, target, rest, topk, groups, default_compute_topk)
            out[rest] = overlap.to(torch.int8)
        return out
    target = target.to(torch.int64)
    if cpu and probs.shape == target.shape:
        values = scores.detach()
        if values.dtype not in _MARKABLE:  # float16 cannot hold the marks; float32 holds it
            values = values.float()
        floor = probs.detach().to(scores.dtype).to(values.dtype).amin(dim=1)  # weakest replayed
        # One scatter does both checks: replayed slots get distinct marks -(j+1)·2^100, below
        # any router score, so the row max is the best non-replayed score, and reading the
        # marks back finds a repeated id (its slot holds one mark for two j).
        marks = _marks(k, values.dtype).expand(target.shape)
        marked = values.scatter(1, target, marks)
        others = marked.amax(dim=1)
        repeated = (marked.gather(1, target) != marks).any(dim=1)
        # not `>=`: a NaN (torch.topk ranks it first) must leave the row unsure
        unsure = ~(others < floor) | repeated | (floor <= _MARK_FLOOR)
        if pad is not None:
            unsure.masked_fill_(pad, False)
        overlap = torch.full((int(target.shape[0]),), k, dtype=torch.int64)
        rest = torch.nonzero(unsure).reshape(-1)
        if rest.numel():
            overlap[rest] = _rows_overlap(scores, target, rest, topk, groups, default_compute_topk)
    else:
        native = default_compute_topk(scores, topk, num_groups=groups[0], group_topk=groups[1])
        overlap = _set_overlap(native[1], target)
    row = overlap.to(torch.int8)
    if pad is not None:
        row.masked_fill_(pad, -1)
    return row


def _rows_overlap(
    scores: torch.Tensor,
    target: torch.Tensor,
    rest: torch.Tensor,
    topk: int,
    groups: tuple[int | None, int | None],
    default_compute_topk: Any,
) -> torch.Tensor:
    """int64 ``|N ∩ R|`` of rows ``rest`` only, N by ``default_compute_topk``."""
    native = default_compute_topk(
        scores.index_select(0, rest), topk, num_groups=groups[0], group_topk=groups[1]
    )
    return _set_overlap(native[1], target.index_select(0, rest).to(torch.int64))


_NO_PAD = np.zeros(0, np.uint8)
_MARKABLE = (torch.float32, torch.float64, torch.bfloat16)
_MARK_FLOOR = -(2.0**99)  # scores at or below it could meet the marks: always unsure


@functools.lru_cache(maxsize=32)
def _marks(k: int, dtype: torch.dtype) -> torch.Tensor:
    """``[1, k]``: -(j+1)·2^100, exact in float32/float64/bfloat16 for k <= 127."""
    return (-(torch.arange(1, k + 1, dtype=torch.float64) * 2.0**100)).to(dtype).reshape(1, k)


def _set_overlap(native: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """int64 ``[T]``: how many of each row's (distinct) native ids occur in the target row."""
    return (native.unsqueeze(-1) == target.unsqueeze(-2)).any(-1).sum(-1)


def _get_replay_topk(
    self: Any,
    scores: torch.Tensor,
    topk: int,
    num_groups: int | None = None,
    group_topk: int | None = None,
    default_compute_topk: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``RouterReplay.get_replay_topk``, with the router's own top-k on the fallback rows of
    the target it replays, observed by the thread's probe on ``REPLAY_FORWARD``."""
    probe: ReplayProbe | None = getattr(_local, "probe", None)
    action = getattr(self, "router_replay_action", None)
    value = getattr(action, "value", None)
    entry = _fallback_of(self, value) if _fallbacks else None
    out = _originals["get_replay_topk"](
        self, scores, topk, num_groups, group_topk, default_compute_topk
    )
    fallback = None
    if entry is not None:
        groups = (num_groups, group_topk)
        out = _with_native(scores, out, entry, value, topk, groups, default_compute_topk)
        fallback = entry.rows
    if (
        probe is not None
        and default_compute_topk is not None
        and getattr(action, "value", None) == "replay_forward"
    ):
        try:
            with torch.no_grad():
                groups = (num_groups, group_topk)
                probe._observe(self, scores, out, topk, groups, default_compute_topk, fallback)
        except Exception as exc:  # a failed measurement must not fail the replayed forward
            probe._fail(f"observing a replayed router call raised {type(exc).__name__}: {exc}")
    return out  # type: ignore[no-any-return]


class _Fallback:
    """A fallback target: the target tensor, its bool ``[tokens]`` fallback rows, and the ids
    its last forward routed (target rows replayed, fallback rows native; None before it)."""

    __slots__ = ("chosen", "rows", "target")

    def __init__(self, target: torch.Tensor, rows: torch.Tensor) -> None:
        self.target, self.rows = target, rows
        self.chosen: torch.Tensor | None = None


def _fallback_of(inst: Any, action: str | None) -> _Fallback | None:
    """The `_Fallback` of the target ``inst`` replays now (forward: the one installed last;
    recompute: the head of its FIFO, which the original pops), None if it has none."""
    if action == "replay_forward":
        target = getattr(inst, "target_topk_idx", None)
    elif action == "replay_backward":
        queue = getattr(inst, "replay_backward_list", None)
        target = queue[0] if queue else None
    else:
        return None
    entry = _fallbacks.get(id(target)) if target is not None else None
    return entry if entry is not None and entry.target is target else None


def _with_native(
    scores: torch.Tensor,
    replayed: tuple[torch.Tensor, torch.Tensor],
    entry: _Fallback,
    action: str | None,
    topk: int,
    groups: tuple[int | None, int | None],
    default_compute_topk: Any,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(probs, ids) of a replayed call with the fallback rows' ids replaced by megatron-core's
    own top-k of the same ``scores`` (``default_compute_topk``: group-limited routing and the
    expert bias as the release applies them; over every row, as the router would route
    them without replay); probs gathered as replay does. The forward's ids are kept, and a
    ``REPLAY_BACKWARD`` recompute of the target replays them (as NeMo-RL does), so it
    routes as the forward did even if its scores differ in the last bit."""
    ids = replayed[1]
    if action == "replay_backward" and entry.chosen is not None:
        chosen = entry.chosen.to(device=scores.device)
        _fallbacks.pop(id(entry.target), None)  # popped from the FIFO: its one recompute
        return scores.gather(1, chosen), chosen
    if default_compute_topk is None:
        raise ReplayError(
            "fallback routing: expected megatron-core's top-k function (default_compute_topk) "
            "in RouterReplay.get_replay_topk, found None; the installed release does not pass "
            "it, so missing routes cannot fall back to the router"
        )
    rows = entry.rows.to(device=scores.device)
    if int(rows.numel()) != int(ids.shape[0]):
        raise ReplayError(
            f"fallback routing: expected {int(ids.shape[0])} fallback rows (the router's "
            f"tokens), found {int(rows.numel())}"
        )
    with torch.no_grad():
        native = default_compute_topk(scores, topk, num_groups=groups[0], group_topk=groups[1])
    merged = torch.where(rows.reshape(-1, 1), native[1].to(ids.dtype), ids)
    if action == "replay_forward":
        entry.chosen = merged.detach()
    return scores.gather(1, merged), merged


def add_fallback(targets: list[torch.Tensor], rows: torch.Tensor) -> None:
    """Route the bool ``[tokens]`` ``rows`` of each of ``targets`` natively while registered."""
    with _lock:
        for t in targets:
            _fallbacks[id(t)] = _Fallback(t, rows)


def open_fallback() -> None:
    """Patch the classes for a schedule that will register fallback targets."""
    _patch(1)


def close_fallback(targets: list[torch.Tensor]) -> None:
    """Drop ``targets``' fallback rows; restore the classes after the last user."""
    try:
        with _lock:
            for t in targets:
                _fallbacks.pop(id(t), None)
    finally:
        _patch(-1)


def _routing(self: Any, logits: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """``TopKRouter.routing``, remembering (instance, router, padding mask) for the probe."""
    original = _originals["routing"]
    inst = getattr(self, "router_replay", None)
    if inst is None or getattr(_local, "probe", None) is None:
        return original(self, logits, *args, **kwargs)
    pad = kwargs.get("padding_mask", args[0] if args else None)
    saved = getattr(_local, "frame", None)
    _local.frame = (inst, self, pad)
    try:
        return original(self, logits, *args, **kwargs)
    finally:
        _local.frame = saved


_get_replay_topk._r3arrow_probe = True  # type: ignore[attr-defined]
_routing._r3arrow_probe = True  # type: ignore[attr-defined]


def _patch(users: int) -> None:
    """Add ``users`` (1 or -1) to the open probes; patch on the first, restore after the last."""
    global _users
    from megatron.core.transformer.moe.router import TopKRouter

    rr = _router_replay().RouterReplay
    with _lock:
        if _users == 0:
            _originals["get_replay_topk"] = rr.__dict__["get_replay_topk"]
            _originals["routing"] = TopKRouter.__dict__["routing"]
            rr.get_replay_topk = _get_replay_topk
            TopKRouter.routing = _routing
        _users += users
        if _users == 0:
            rr.get_replay_topk = _originals.pop("get_replay_topk")
            TopKRouter.routing = _originals.pop("routing")


def open_probe() -> ReplayProbe:
    """Start observing this thread's replayed router calls (class patches in place)."""
    _patch(1)
    probe = ReplayProbe()
    _local.probe = probe
    _local.frame = None
    return probe


def close_probe(probe: ReplayProbe, *, ok: bool) -> None:
    """Stop observing; finish ``probe`` (counts on success, dropped on error)."""
    _local.probe = None
    _local.frame = None
    try:
        probe._finish(ok)
    finally:
        _patch(-1)
