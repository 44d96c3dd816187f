"""Rollout tables → the tensors Megatron-core trains on, with this rank's replay targets.

`MegatronCollator` turns a rollout table into one `Microbatch` (model inputs ``[b, S]`` or
packed ``[1, T]``, int32 replay targets of this stage's routers in Megatron's token order;
``spec=None``: R3 off, no targets); `collate_directory` streams a rollout directory for one
(DP rank, PP stage); `uncollate_routes` inverts the layout for what the routers chose.
Layout rules: ``docs/design.md`` §3 and §5; the copy path: ``docs/collation.md``.
Microbatch planning is the torch-free `r3arrow.microbatch`; a collator for a Megatron rank
comes from ``r3arrow.megatron.collator_for``.
"""

from __future__ import annotations

from r3arrow._extras import require

with require(extra="torch", feature="r3arrow.collate"):
    import torch  # noqa: F401 - the extra's message before the modules below need it

from r3arrow._public import set_homes
from r3arrow.collate._collator import MegatronCollator, Parallelism
from r3arrow.collate._directory import collate_directory
from r3arrow.collate._inverse import uncollate_routes
from r3arrow.collate._layout import alignment_multiple
from r3arrow.collate._microbatch import Microbatch

__all__ = [
    "MegatronCollator",
    "Microbatch",
    "Parallelism",
    "alignment_multiple",
    "collate_directory",
    "uncollate_routes",
]

set_homes(globals(), __all__)
