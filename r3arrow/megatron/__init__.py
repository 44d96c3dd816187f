"""Megatron-core side of R3: schedule-scoped replay state and validated replay targets.

* `replay_schedule` clears Megatron's global ``RouterReplay`` state before a pipeline
  schedule and in ``finally`` (forward-only log-prob passes included), and sets the action;
  ``measure_agreement=True`` yields a `ReplayProbe` whose ``agreement`` compares each
  router's own top-k with what it replayed (``docs/replay-probe.md``).
* `install_replay` checks every target (one per router instance, row count = tokens this
  rank's router sees, ids in ``[0, num_experts)``, no expert twice in a row) and only then
  calls ``RouterReplay.set_replay_data``: Megatron itself accepts wrong targets silently.
  MTP policy (``mtp=``): Megatron registers multi-token-prediction routers as replay
  instances too (Megatron-LM #7404); by default (``"exclude"``) they route natively while
  the decoder replays; ``"replay"`` replays them from routes of their global layers,
  ``"error"`` refuses them. A target count that does not match the instances raises
  `ReplayError` naming MTP and the options, never Megatron's bare ``ValueError``.
* `replay_backward` switches to ``REPLAY_BACKWARD`` for activation recomputation.
* `model_inputs` passes the router padding mask (and ``PackedSeqParams``) to ``GPTModel``,
  pre-sliced to the TP rank's sequence-parallel share on pipeline stages that do not embed
  tokens (`stage_padding_mask`; Megatron scatters the mask on the first stage only).
* `apply_padding_mask_shim` makes a ``[tokens]`` padding mask broadcast as ``[tokens, 1]``
  in expert-bias accounting on releases without Megatron-LM #6114;
  `apply_all_padding_aux_loss_shim` keeps the load-balancing loss of an all-padding (DP
  padding) microbatch at 0 instead of NaN.
* `stage_router_layers` / `router_layers` give the global ids of a stage's routers;
  `collator_for` builds this rank's `r3arrow.collate.MegatronCollator`.
* `r3arrow.testing.megatron` (import it explicitly): real megatron-core routers on a CPU
  machine for tests, demos and examples (`cpu_router_harness`, `build_routers`,
  `replay_check`), not for training.

megatron-core is imported inside the functions only (tested with 0.16.1; routers of 0.17+
carry ``layer_number`` as 0.16 routers built inside a ``TransformerLayer`` already do).
This package imports `r3arrow.collate`, never the other way round.

Modules: `_routers` (megatron access, routers of a model), `_schedule` (replay state
scope), `_probe` (agreement during replay), `_install` (target checks and installation),
`_inputs` (model inputs), `_shim` (expert-bias shim), `_stages` (stage router layers,
`collator_for`), `cpu` (CPU harness).
"""

from __future__ import annotations

from r3arrow.errors import ReplayDuplicateError, ReplayRangeError
from r3arrow.megatron._inputs import model_inputs, packed_seq_params, stage_padding_mask
from r3arrow.megatron._install import MTP_POLICIES, install_replay, validate_targets
from r3arrow.megatron._probe import ReplayProbe
from r3arrow.megatron._record import RouteRecorder, record_schedule
from r3arrow.megatron._routers import router_layers
from r3arrow.megatron._schedule import (
    clear_replay_state,
    replay_backward,
    replay_schedule,
    set_replay_action,
)
from r3arrow.megatron._shim import (
    all_padding_aux_loss_fix_present,
    apply_all_padding_aux_loss_shim,
    apply_padding_mask_shim,
    padding_mask_fix_present,
    remove_all_padding_aux_loss_shim,
    remove_padding_mask_shim,
)
from r3arrow.megatron._stages import collator_for, moe_layer_pattern, stage_router_layers

__all__ = [
    "MTP_POLICIES",
    "ReplayDuplicateError",
    "ReplayProbe",
    "ReplayRangeError",
    "RouteRecorder",
    "all_padding_aux_loss_fix_present",
    "apply_all_padding_aux_loss_shim",
    "apply_padding_mask_shim",
    "clear_replay_state",
    "collator_for",
    "install_replay",
    "model_inputs",
    "moe_layer_pattern",
    "packed_seq_params",
    "padding_mask_fix_present",
    "record_schedule",
    "remove_all_padding_aux_loss_shim",
    "remove_padding_mask_shim",
    "replay_backward",
    "replay_schedule",
    "router_layers",
    "set_replay_action",
    "stage_padding_mask",
    "stage_router_layers",
    "validate_targets",
]
