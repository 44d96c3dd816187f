"""Schedule scope (``docs/design.md`` §7 Schedule scope): one replay or record schedule per
thread at a time. A schedule owns the ``RouterReplay`` instances it installs into or records:
each is cleared when the schedule first takes it and again when the schedule ends; instances
it never takes keep their state."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator
from typing import Any, Literal

import torch

from r3arrow._checks import check_choice
from r3arrow.errors import ReplayError
from r3arrow.megatron._probe import ReplayProbe, close_probe, open_probe
from r3arrow.megatron._routers import _router_replay

ReplayAction = Literal["replay_forward", "replay_backward"]
_ACTIONS: tuple[ReplayAction, ...] = ("replay_forward", "replay_backward")

_local = threading.local()  # .schedule: this thread's open _Schedule, if any


class _Schedule:
    """An open schedule: its name, the action it sets, and the instances it took (by id:
    instance and the action it gave it, None for the native ones)."""

    __slots__ = ("action", "name", "probe", "taken")

    def __init__(self, name: str, action: Any) -> None:
        self.name, self.action = name, action
        self.probe: ReplayProbe | None = None
        self.taken: dict[int, tuple[Any, Any]] = {}

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

    def install(
        self,
        receivers: list[Any],
        targets: list[torch.Tensor],
        native: list[Any],
        padding: torch.Tensor | None,
    ) -> None:
        """Queue ``targets`` on ``receivers`` (this schedule's action) and leave ``native``
        free; an open probe learns the rows ``padding`` marks (router token order)."""
        self.take(native, None)
        self.take(receivers, self.action)
        for inst, t in zip(receivers, targets, strict=True):
            inst.set_target_indices(t)
        if self.probe is not None:
            self.probe._padding.update(dict.fromkeys(map(id, receivers), padding))

    def replaying(self) -> list[Any]:
        return [inst for inst, act in self.taken.values() if act is not None]


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
    """End ``schedule``: every instance it took is cleared (indices, FIFO, action)."""
    _local.schedule = None
    for inst, _ in schedule.taken.values():
        inst.clear_indices()
        inst.clear_router_replay_action()


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
        act = _router_replay().RouterReplayAction(check_choice(action, "action", _ACTIONS))
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
    insts = _replaying("replay_backward").replaying()
    before = [inst.router_replay_action for inst in insts]
    backward = _router_replay().RouterReplayAction.REPLAY_BACKWARD
    for inst in insts:
        inst.set_router_replay_action(backward)
    try:
        yield
    finally:
        for inst, act in zip(insts, before, strict=True):
            inst.set_router_replay_action(act)
