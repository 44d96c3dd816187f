"""Rollout tables → the tensors Megatron-core trains on, with this rank's replay targets.

`MegatronCollator` turns a rollout table (or record batch) into one `Microbatch`:
``input_ids``/``position_ids``/``loss_mask``/``padding_mask`` ``[b, S]`` (unpacked) or
``[1, T]`` (packed THD), int32 routes for this pipeline stage's routers only, and
``replay_targets()`` in Megatron's token order. Layout rules (``docs/design.md``,
"Layouts for Megatron"):

* sequences start at position 0 of their row (unpacked) or segment (packed); alignment
  and batch padding follow them;
* every position without a captured route (alignment padding, batch padding, the
  uncaptured suffix) has ``padding_mask`` True and the dummy route ``[0, 1, …, K-1]``
  (see "Router padding mask and dummy rows");
* context parallel rank r keeps chunks r and 2·cp−1−r of every sequence (unpacked: of
  every row) split into 2·cp chunks; sequence parallelism slices the router tokens by
  TP rank (the model inputs stay whole: Megatron scatters them itself).

Routes are never materialised for all layers nor left-padded. The output is one
layer-major int32 buffer ``[L_local, P, C, K]`` whose per-layer slices are the replay
targets (contiguous, no copy); it is written once, in cache-sized blocks. Output buffers
come from a pool and are reused once nothing references them (first touch of fresh pages
costs more than the copy); large copies are split over threads.

R3 off: ``MegatronCollator(spec=None)`` collates tables without routes into the same model
inputs, with no replay buffer (``Microbatch.routes`` is None).

Microbatch planning (`r3arrow.microbatch.split_microbatches`; with ``dp_size`` the same
number of microbatches on every DP rank, padding microbatches where a rank has fewer,
``Microbatch.is_padding``) lives in the torch-free `r3arrow.microbatch`. Megatron-specific
construction (a collator from a Megatron config or model) is ``collator_for`` of the
Megatron integration, which imports this package (never the other way round).

Modules: `_collator` (the collator), `_microbatch` (the output type and the scatter of
model outputs), `_layout` (alignment and positions), `_kernels` (route copy kernels),
`_buffers` (output memory).
"""

from __future__ import annotations

from r3arrow._public import set_homes
from r3arrow.collate._collator import MegatronCollator, Parallelism
from r3arrow.collate._directory import collate_directory
from r3arrow.collate._inverse import uncollate_routes
from r3arrow.collate._layout import alignment_multiple
from r3arrow.collate._microbatch import (
    Microbatch,
)

__all__ = [
    "MegatronCollator",
    "Microbatch",
    "Parallelism",
    "alignment_multiple",
    "collate_directory",
    "uncollate_routes",
]

set_homes(globals(), __all__)
