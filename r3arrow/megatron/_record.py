"""Record schedule: the trainer routers' own top-k, collected per microbatch
(``docs/train-routes.md``, "Contract of record_schedule")."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from r3arrow._checks import check_int
from r3arrow.errors import ReplayError
from r3arrow.megatron._routers import _global_layer, _is_mtp, _replay_of, _router_replay, _routers
from r3arrow.megatron._schedule import _close, _open


class RouteRecorder:
    """Handle yielded by `record_schedule`: the recorded routers and their global layer ids.

    ``layers``: the global (0-based) layer id of each recorded router, in router order.
    """

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


def _layer_ids(routers: Sequence[Any], layers: Sequence[int] | None) -> list[int]:
    if layers is not None:
        ids = [check_int(g, "layers[i]", minimum=0) for g in layers]
        if len(ids) != len(routers):
            raise ValueError(
                f"layers: expected one global layer id per recorded router ({len(routers)}), "
                f"found {len(ids)}"
            )
    else:
        unnumbered = [type(r).__name__ for r in routers if getattr(r, "layer_number", None) is None]
        if unnumbered:
            raise ReplayError(
                "record_schedule: expected routers with a layer_number (1-based, global) or "
                f"layers= naming their global ids, found {len(unnumbered)} without one"
            )
        ids = [_global_layer(r) for r in routers]
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
    nest), no router is found, or a router has no ``RouterReplay``/``layer_number``;
    `TypeError`/`ValueError` for misuse of ``layers``.
    """
    routers = _routers(model_or_routers)
    if not mtp:
        routers = [r for r in routers if not _is_mtp(r)]
    if not routers:
        raise ReplayError("record_schedule: expected at least one MoE router, found none")
    ids = _layer_ids(routers, layers)
    instances = [_replay_of(r) for r in routers]
    schedule = _open("record_schedule", _router_replay().RouterReplayAction.RECORD)
    recorder = RouteRecorder(instances, ids)
    try:
        schedule.take(instances, schedule.action)
        yield recorder
    finally:
        recorder._open = False
        _close(schedule)
