"""`drop_stale`: the rows of a rollout table within ``max_lag`` policy versions of the current
one (``docs/versions.md``; the column rules are `r3arrow._versions`)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from r3arrow._checks import check_int
from r3arrow._schema import POLICY_VERSION, trajectory_id_at
from r3arrow._versions import VERSION_TYPE, check_version_column, first_true
from r3arrow.errors import SchemaError
from r3arrow.table._derived import filter_rows


def drop_stale(table: pa.Table, *, current_version: int, max_lag: int) -> pa.Table:
    """The rows of ``table`` generated at most ``max_lag`` versions before ``current_version``
    (``current_version - policy_version <= max_lag``), in order, every column and the schema
    metadata kept (a validated table's result is marked validated; NeMo-RL's replay-buffer
    age window, ``docs/versions.md``).

    The mask is one pyarrow compute over the column; when every row is kept the table itself
    is returned (no copy), else Arrow's filter. ``current_version``, ``max_lag``: ints
    ``>= 0`` (else ``TypeError`` / ``ValueError``); ``TypeError`` for a table that is not a
    ``pyarrow.Table``. Raises `SchemaError` for a table without ``policy_version``, a column
    that breaks the rules of `check_versions`, or a row newer than ``current_version``
    (``row``, ``trajectory_id``: a row the trainer's weights cannot have generated yet).
    """
    if not isinstance(table, pa.Table):
        raise TypeError(f"drop_stale: expected a pyarrow.Table, found {type(table).__name__}")
    current = check_int(current_version, "current_version", minimum=0)
    lag = check_int(max_lag, "max_lag", minimum=0)
    if POLICY_VERSION not in table.schema.names:
        raise SchemaError(
            f"drop_stale: expected a {POLICY_VERSION!r} column (stamped by the rollout loop, "
            f"docs/versions.md), found columns {table.schema.names}"
        )
    check_version_column(table, POLICY_VERSION)
    col = table.column(POLICY_VERSION)
    newer = pc.greater(col, pa.scalar(current, VERSION_TYPE))
    if pc.any(newer).as_py():
        row = first_true(newer)
        raise SchemaError(
            f"row {row}: {POLICY_VERSION}: expected at most current_version={current}, found "
            f"{col[row].as_py()}",
            row=row,
            trajectory_id=trajectory_id_at(table, row),
        )
    keep = pc.greater_equal(col, pa.scalar(current - lag, VERSION_TYPE))
    if pc.all(keep).as_py() is not False:  # all kept (or no rows): nothing to copy
        return table
    return filter_rows(table, keep)
