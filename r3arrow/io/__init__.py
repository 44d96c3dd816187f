"""Persistence: rollout tables to Parquet (and Arrow IPC), exact and atomic.

This package is the only owner of the on-disk layout (see ``docs/design.md``,
"Persistence"):

- **Layout** (`r3arrow.io._layout`): one hive-style ``step=N/`` partition per
  training step under a root, ``part-NNNNN.parquet`` files, writes to a
  temporary file renamed into place. `list_steps` and `iter_rollout_files`
  discover what is there.
- **Routes storage** (`r3arrow.io._groups`, `r3arrow.io._storage`; ``docs/storage.md``):
  routes columns are stored as layer groups,
  ``large_list<struct<l0_6: fixed_size_binary(6*K*itemsize), ...>>`` (opaque
  little-endian values; Parquet would store nested lists value by value, slow and
  ~4x larger), so a reader of some layers reads only their groups, and restored to
  the nested type on read (`from_storage`, `route_rows`; `project_layers` projects
  in memory; the interleave copy of a multi-group read is `r3arrow.io._interleave`).
  Files of the older single ``fixed_size_binary`` form still read.
  `scan_rollout_files` reports each file's stored groups (``RolloutFile.layer_groups``).
- **Streaming** (`r3arrow.io._stream`): readers go row group by row group under a
  ``max_memory`` budget (`DEFAULT_MAX_MEMORY`); writers cut row groups by bytes
  (`DEFAULT_ROW_GROUP_BYTES`).
- **Parquet** (`r3arrow.io._parquet`): `write_rollouts`, `read_rollouts`,
  `iter_rollouts`, `scan_rollouts`, `read_rollouts_dataset`, and the readers
  the integrations build on: `iter_rollout_tables` (restored tables with their
  step), `scan_rollout_files` (spec and files from the footers) and
  `read_row_group`.
- **Arrow IPC** (`r3arrow.io._ipc`): `write_ipc`, `read_ipc` (memory-mapped).

- **Trust boundary** (`r3arrow.io._verify`): what every Parquet reader checks.

The spec travels in the file metadata. Files carry Parquet page checksums and
a SHA-256 over the r3arrow metadata (``r3arrow.meta_sha256``); readers verify
both (older files without them still read, unchecked on that point), the
schema version and the spec, and — unless ``validate=False`` — the rows they
return (columns, types, no nulls, lengths, expert ids). Every error is an
`R3ArrowError` (mostly `SchemaError`) with ``path`` naming the file; no Arrow
or OS exception escapes for a corrupt or foreign file. A rollout table without
``routes`` and without a spec (R3 off) is written and read back as is.
``write_rollouts(portable=True)`` stores routes as nested integer lists for
generic tools (`r3arrow.io._portable`). Argument misuse (a negative or non-int
``step``) raises ``ValueError`` / ``TypeError``.
"""

from __future__ import annotations

from r3arrow.io._diagnostics import (
    DIAGNOSTICS_SCHEMA,
    NATIVE_VS_REPLAY,
    read_diagnostics,
    write_diagnostics,
)
from r3arrow.io._groups import project_layers
from r3arrow.io._ipc import read_ipc, write_ipc
from r3arrow.io._layout import (
    TempFile,
    check_step,
    find_temps,
    iter_rollout_files,
    list_steps,
    remove_stale_temps,
)
from r3arrow.io._parquet import (
    RolloutFile,
    iter_rollout_tables,
    iter_rollouts,
    read_rollouts,
    read_rollouts_dataset,
    read_row_group,
    scan_rollout_files,
    scan_rollouts,
    write_rollouts,
)
from r3arrow.io._portable import to_portable
from r3arrow.io._storage import from_storage, route_rows, to_storage
from r3arrow.io._stream import DEFAULT_MAX_MEMORY, DEFAULT_ROW_GROUP_BYTES

__all__ = [
    "DEFAULT_MAX_MEMORY",
    "DEFAULT_ROW_GROUP_BYTES",
    "DIAGNOSTICS_SCHEMA",
    "NATIVE_VS_REPLAY",
    "RolloutFile",
    "TempFile",
    "check_step",
    "find_temps",
    "from_storage",
    "iter_rollout_files",
    "iter_rollout_tables",
    "iter_rollouts",
    "list_steps",
    "project_layers",
    "read_diagnostics",
    "read_ipc",
    "read_rollouts",
    "read_rollouts_dataset",
    "read_row_group",
    "remove_stale_temps",
    "route_rows",
    "scan_rollout_files",
    "scan_rollouts",
    "to_portable",
    "to_storage",
    "write_diagnostics",
    "write_ipc",
    "write_rollouts",
]
