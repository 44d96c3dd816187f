"""Megatron-core side of R3: schedule-scoped replay state and validated replay targets.

* `replay_schedule` (context manager) clears Megatron's global ``RouterReplay`` state
  before a pipeline schedule and in ``finally`` (forward-only log-prob passes included) and
  sets ``action`` (``"replay_forward"`` default, ``"replay_backward"``, ``"record"`` or None:
  routers free; another value raises `ValueError`). Nested schedules raise `ReplayError`.
  ``measure_agreement=True`` yields a `ReplayProbe` whose ``agreement`` compares each
  router's own top-k with what it replayed (``docs/replay-probe.md``).
* `install_replay` checks every target (one per router instance, row count = tokens this
  rank's router sees, ids in ``[0, num_experts)``, no expert twice in a row) and only then
  hands them to ``RouterReplay``: Megatron itself accepts wrong targets silently. Raises
  `ReplayError` (`r3arrow.errors.ReplayRangeError`, `r3arrow.errors.ReplayDuplicateError`
  for ids) before anything reaches Megatron, `TypeError`/`ValueError` for argument misuse.
  MTP policy (``mtp=``, a `MtpPolicy`): Megatron registers multi-token-prediction routers
  as replay instances too (Megatron-LM #7404); by default (``"exclude"``) they route
  natively while the decoder replays; ``"replay"`` replays them from routes of their global
  layers, ``"error"`` refuses them. A target count that does not match the instances raises
  `ReplayError` naming MTP and the options, never Megatron's bare ``ValueError``.
* `replay_backward` (context manager) switches to ``REPLAY_BACKWARD`` for activation
  recomputation and restores each router's action on exit.
* `record_schedule` (context manager) lets the routers record their own top-k; its
  `RouteRecorder` hands them out per microbatch (``docs/train-routes.md``).
* `model_inputs` gives ``GPTModel.forward`` its keyword arguments: the router padding mask
  (and ``PackedSeqParams`` when packed), pre-sliced to the TP rank's sequence-parallel
  share on pipeline stages that do not embed tokens (Megatron scatters the mask on the
  first stage only).
* `apply_shims` installs the padding shims the installed release needs, decided by
  behaviour, and returns which are in place (``{"padding_mask": bool,
  "all_padding_aux_loss": bool}``): a ``[tokens]`` padding mask broadcast as
  ``[tokens, 1]`` in expert-bias accounting (releases without Megatron-LM #6114), and a
  load-balancing loss of 0 instead of NaN on an all-padding (DP padding) microbatch.
  `remove_shims` undoes them.
* `router_layers` gives the global ids of the routers of a model, or of a pipeline stage
  from a config; `collator_for` builds this rank's `r3arrow.collate.MegatronCollator`.
* `r3arrow.testing.megatron` (import it explicitly): real megatron-core routers on a CPU
  machine for tests, demos and examples (`cpu_router_harness`, `build_routers`,
  `replay_check`), not for training.

megatron-core is imported inside the functions only (tested with 0.16.1; routers of 0.17+
carry ``layer_number`` as 0.16 routers built inside a ``TransformerLayer`` already do).
This package imports `r3arrow.collate`, never the other way round.

Modules: `_routers` (megatron access, routers of a model), `_schedule` (replay state
scope), `_probe` (agreement during replay), `_install` (target checks and installation),
`_record` (record schedule), `_inputs` (model inputs), `_shim` (padding shims), `_stages`
(router layers, `collator_for`).
"""

from __future__ import annotations

from r3arrow._public import set_homes
from r3arrow.megatron._inputs import model_inputs
from r3arrow.megatron._install import MtpPolicy, install_replay
from r3arrow.megatron._probe import ReplayProbe
from r3arrow.megatron._record import RouteRecorder, record_schedule
from r3arrow.megatron._schedule import replay_backward, replay_schedule
from r3arrow.megatron._shim import apply_shims, remove_shims
from r3arrow.megatron._stages import collator_for, router_layers

__all__ = [
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
