"""Schedule-scoped replay state: cleared before a pipeline schedule and in ``finally``.

See ``docs/design.md``, "Schedule scope": Megatron keeps replay targets in global
``RouterReplay`` state; a schedule that raises must not leave them for the next one.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator
from typing import Any

from r3arrow.errors import ReplayError
from r3arrow.megatron._routers import _instances, _replay_of, _router_replay


def _as_action(action: Any) -> Any:
    """A ``RouterReplayAction`` (or None) from an enum or its value; `ValueError` otherwise."""
    enum = _router_replay().RouterReplayAction
    if action is None or isinstance(action, enum):
        return action
    try:
        return enum(str(action).lower())
    except ValueError:
        raise ValueError(
            f"action: expected a RouterReplayAction or one of {[a.value for a in enum]}, "
            f"found {action!r}"
        ) from None


_scope = threading.local()


def clear_replay_state() -> None:
    """Drop every router's recorded/target indices, backward FIFO and action."""
    rr = _router_replay().RouterReplay
    rr.clear_global_indices()
    rr.clear_global_router_replay_action()


def set_replay_action(action: Any, routers: Iterable[Any] | None = None) -> None:
    """Set ``action`` ("record", "replay_forward", "replay_backward", an enum or None) on every
    router instance, or on the ``RouterReplay`` instances of ``routers`` only."""
    act = _as_action(action)
    targets = _instances() if routers is None else [_replay_of(r) for r in routers]
    for inst in targets:
        if act is None:
            inst.clear_router_replay_action()
        else:
            inst.set_router_replay_action(act)


@contextlib.contextmanager
def replay_schedule(action: Any = "replay_forward") -> Iterator[None]:
    """Scope of one pipeline schedule: replay state cleared on entry and in ``finally``.

    ``action`` is set on every router after the clear (None leaves routers free). Install
    each microbatch's targets inside, in schedule order; never clear between microbatches
    (``REPLAY_BACKWARD`` consumes them first-in first-out). Not reentrant.
    """
    if getattr(_scope, "active", False):
        raise ReplayError(
            "replay_schedule: expected no schedule in progress, found one (nested call)"
        )
    clear_replay_state()
    _scope.active = True
    try:
        set_replay_action(action)
        yield
    finally:
        _scope.active = False
        clear_replay_state()


@contextlib.contextmanager
def replay_backward() -> Iterator[None]:
    """Switch every router to ``REPLAY_BACKWARD`` (recompute pops targets in install order),
    restoring each router's previous action on exit."""
    insts = _instances()
    before = [inst.router_replay_action for inst in insts]
    set_replay_action("replay_backward")
    try:
        yield
    finally:
        for inst, act in zip(insts, before, strict=True):
            if act is None:
                inst.clear_router_replay_action()
            else:
                inst.set_router_replay_action(act)
