"""The rollout table: one row per trajectory, routes ragged beside every other column.

``docs/design.md``, "The Arrow data model" (R3 off included) and "Dynamic sampling":
building, validation, derived columns, row selection that keeps every column attached,
dynamic sampling and dropping stale policy versions (``docs/versions.md``), all vectorised.
`rollout_table` and selections of a validated table mark their result validated; errors
carry ``row`` and ``trajectory_id``.
"""

from __future__ import annotations

from r3arrow._public import set_homes
from r3arrow._schema import (
    captured_lengths,
    has_routes,
    rollout_schema,
    route_layers,
    route_spec,
    sequence_lengths,
)
from r3arrow.table._build import rollout_table
from r3arrow.table._derived import (
    filter_rows,
    flat_routes,
    input_ids,
    router_padding_mask,
    sequence_loss_mask,
    take_rows,
    with_columns,
)
from r3arrow.table._sampling import (
    ReplaceResult,
    filter_groups,
    reduce_tokens,
    replace_groups,
)
from r3arrow.table._validate import validate_rollouts
from r3arrow.table._versions import drop_stale

__all__ = [
    "ReplaceResult",
    "captured_lengths",
    "drop_stale",
    "filter_groups",
    "filter_rows",
    "flat_routes",
    "has_routes",
    "input_ids",
    "reduce_tokens",
    "replace_groups",
    "rollout_schema",
    "rollout_table",
    "route_layers",
    "route_spec",
    "router_padding_mask",
    "sequence_lengths",
    "sequence_loss_mask",
    "take_rows",
    "validate_rollouts",
    "with_columns",
]

set_homes(globals(), __all__)
