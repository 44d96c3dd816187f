"""Persistence: rollout tables to Parquet and Arrow IPC, exact, atomic, verified on read.

The only owner of the on-disk layout; the contract is ``docs/design.md``, "Persistence", and
``docs/storage.md``. Write with `write_rollouts` / `write_ipc`, discover with
`rollout_files`, read with `iter_rollouts` (bounded pieces), `read_rollouts` or, for generic
tools, `rollout_reader` (an Arrow stream); replay
diagnostics with `write_diagnostics` / `read_diagnostics`; writers' temps with
`find_temps` / `remove_stale_temps` (``r3arrow gc``).
"""

from __future__ import annotations

from r3arrow._public import set_homes
from r3arrow.io._diagnostics import (
    NATIVE_VS_REPLAY,
    read_diagnostics,
    write_diagnostics,
)
from r3arrow.io._ipc import write_ipc
from r3arrow.io._layout import TempFile, find_temps, remove_stale_temps
from r3arrow.io._parquet import (
    RolloutFile,
    iter_rollouts,
    read_rollouts,
    rollout_files,
    rollout_reader,
    write_rollouts,
)
from r3arrow.io._project import project_layers
from r3arrow.io._storage import route_rows
from r3arrow.io._stream import DEFAULT_MAX_MEMORY, DEFAULT_ROW_GROUP_BYTES

__all__ = [
    "DEFAULT_MAX_MEMORY",
    "DEFAULT_ROW_GROUP_BYTES",
    "NATIVE_VS_REPLAY",
    "RolloutFile",
    "TempFile",
    "find_temps",
    "iter_rollouts",
    "project_layers",
    "read_diagnostics",
    "read_rollouts",
    "remove_stale_temps",
    "rollout_files",
    "rollout_reader",
    "route_rows",
    "write_diagnostics",
    "write_ipc",
    "write_rollouts",
]

set_homes(globals(), __all__)
