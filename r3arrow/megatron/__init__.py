"""Megatron-core side of R3: schedule-scoped replay state and validated replay targets.

`replay_schedule` scopes one pipeline schedule (its `ReplayProbe` measures agreement,
``docs/replay-probe.md``); `install_replay` checks every target before the given model's
routers see it (``missing="native"``: the routers choose the tokens whose route is missing,
``docs/fallback.md``); `replay_backward` switches to recompute replay; `record_schedule` and its
`RouteRecorder` collect the routers' own top-k (``docs/train-routes.md``); `model_inputs`
gives ``GPTModel.forward`` its keyword arguments; `apply_shims`/`remove_shims` patch the
padding bugs of the installed release; `router_layers` and `collator_for` fit a pipeline
stage. Semantics: ``docs/design.md`` §3, §5, §6 and §7. megatron-core is imported inside
the functions only; CPU test harness: `r3arrow.testing.megatron`.
"""

from __future__ import annotations

from r3arrow._extras import require

with require(extra="megatron", feature="r3arrow.megatron"):
    import torch  # noqa: F401 - the extra's message before the modules below need it

from r3arrow._public import set_homes
from r3arrow.megatron._probe import ReplayProbe
from r3arrow.megatron._schedule import (
    MissingPolicy,
    MtpPolicy,
    RouteRecorder,
    install_replay,
    record_schedule,
    replay_backward,
    replay_schedule,
)
from r3arrow.megatron._shim import apply_shims, remove_shims
from r3arrow.megatron._stages import collator_for, model_inputs, router_layers

__all__ = [
    "MissingPolicy",
    "MtpPolicy",
    "ReplayProbe",
    "RouteRecorder",
    "apply_shims",
    "collator_for",
    "install_replay",
    "model_inputs",
    "record_schedule",
    "remove_shims",
    "replay_backward",
    "replay_schedule",
    "router_layers",
]

set_homes(globals(), __all__)
