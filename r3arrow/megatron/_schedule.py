"""Schedule-scoped replay state: cleared before a pipeline schedule and in ``finally``
(``docs/design.md`` §7 Schedule scope).

Instances `install_replay` marks native (MTP routers under ``mtp="exclude"``) hold no
targets: the replay actions skip them until `_clear_replay_state` drops the marks.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator
from typing import Any, Literal

from r3arrow._checks import check_choice
from r3arrow.errors import ReplayError
from r3arrow.megatron._probe import ReplayProbe, close_probe, open_probe
from r3arrow.megatron._routers import _instances, _replay_of, _router_replay

ReplayAction = Literal["replay_forward", "replay_backward", "record"]
_ACTIONS: tuple[ReplayAction, ...] = ("replay_forward", "replay_backward", "record")


def _as_action(action: ReplayAction | None) -> Any:
    """The ``RouterReplayAction`` (or None) of a name; `ValueError` naming the choices."""
    if action is None:
        return None
    return _router_replay().RouterReplayAction(check_choice(action, "action", _ACTIONS))


_scope = threading.local()
_NATIVE = "_r3arrow_native"  # attribute on a RouterReplay instance: route natively


def _mark_native(instances: Iterable[Any]) -> None:
    """Mark instances native (no targets, no action) until the next `_clear_replay_state`."""
    for inst in instances:
        setattr(inst, _NATIVE, True)
        inst.clear_router_replay_action()


def _is_native(inst: Any) -> bool:
    return bool(getattr(inst, _NATIVE, False))


def _clear_replay_state() -> None:
    """Drop every router's recorded/target indices, backward FIFO, action and native mark."""
    rr = _router_replay().RouterReplay
    rr.clear_global_indices()
    rr.clear_global_router_replay_action()
    for inst in rr.global_router_replay_instances:
        if hasattr(inst, _NATIVE):
            delattr(inst, _NATIVE)


def _set_replay_action(action: ReplayAction | None, routers: Iterable[Any] | None = None) -> None:
    """Set ``action`` (None: clear) on ``routers``, else on all but native replaying ones."""
    act = _as_action(action)
    if routers is None:
        replaying = act is not None and act.value.startswith("replay")
        targets = [i for i in _instances() if not (replaying and _is_native(i))]
    else:
        targets = [_replay_of(r) for r in routers]
    for inst in targets:
        if act is None:
            inst.clear_router_replay_action()
        else:
            inst.set_router_replay_action(act)


@contextlib.contextmanager
def replay_schedule(
    action: ReplayAction | None = "replay_forward", *, measure_agreement: bool = False
) -> Iterator[ReplayProbe | None]:
    """Scope of one pipeline schedule: replay state cleared on entry and in ``finally``.

    ``action`` is set on every router after the clear: ``"replay_forward"`` (default),
    ``"replay_backward"``, ``"record"`` or None (routers free); another value raises
    `ValueError`. Install each microbatch's targets inside, in schedule order. Not
    reentrant (`ReplayError`). ``measure_agreement=True`` yields a `ReplayProbe`
    (``docs/replay-probe.md``); otherwise nothing is patched and the block gets None.
    """
    if not isinstance(measure_agreement, bool):
        raise TypeError(
            f"measure_agreement: expected a bool, found {type(measure_agreement).__name__}"
        )
    if getattr(_scope, "active", False):
        raise ReplayError(
            "replay_schedule: expected no schedule in progress, found one (nested call)"
        )
    _clear_replay_state()
    _scope.active = True
    probe: ReplayProbe | None = None
    ok = False
    try:
        _set_replay_action(action)
        if measure_agreement:
            probe = open_probe()
        yield probe
        ok = True
    finally:
        _scope.active = False
        try:
            if probe is not None:
                close_probe(probe, ok=ok)
        finally:
            _clear_replay_state()


@contextlib.contextmanager
def replay_backward() -> Iterator[None]:
    """Switch every router but the native ones to ``REPLAY_BACKWARD`` (recompute pops targets
    in install order), restoring each router's previous action on exit."""
    insts = _instances()
    before = [inst.router_replay_action for inst in insts]
    _set_replay_action("replay_backward")
    try:
        yield
    finally:
        for inst, act in zip(insts, before, strict=True):
            if act is None:
                inst.clear_router_replay_action()
            else:
                inst.set_router_replay_action(act)
