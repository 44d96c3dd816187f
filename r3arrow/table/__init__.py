"""The rollout table: one row per trajectory, routes ragged beside every other column.

Building (`rollout_table`), validating (`validate_rollouts`), derived columns
(`router_padding_mask`, `sequence_loss_mask`, `input_ids`), row selection that keeps
every column attached (`take_rows`, `filter_rows`) and dynamic sampling (`filter_groups`,
`replace_groups`, `reduce_tokens`). All vectorised with Arrow
compute/numpy. See ``docs/design.md``, "The Arrow data model" and "Dynamic sampling".

R3 on or off: a table built with ``routes`` and ``spec`` has a ``routes`` column and its
spec in the schema metadata; one built without (``routes=None, spec=None``) has neither
(`has_routes` is False). Everything but the routes works on both; `router_padding_mask`,
`flat_routes`, `captured_lengths` and `route_spec` raise `SchemaError` with R3 off.

One check per trust boundary: `rollout_table` validates what it is given and marks the
table it returns as validated (:mod:`r3arrow._validated`), so writing it does not validate
it again; so do `take_rows`, `filter_rows`, `filter_groups` and `replace_groups` for
results of a validated table. Validation errors carry ``row`` and ``trajectory_id``;
argument misuse raises ``ValueError``/``TypeError``.

Modules: ``_schema`` (schema, spec, lengths), ``_build`` (`rollout_table`), ``_validate``
(`validate_rollouts`), ``_derived`` (derived columns, row selection), ``_sampling``
(dynamic sampling).
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

__all__ = [
    "ReplaceResult",
    "captured_lengths",
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
