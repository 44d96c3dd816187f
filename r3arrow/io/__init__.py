"""Persistence: rollout tables to Parquet (and Arrow IPC), exact and atomic.

This package is the only owner of the on-disk layout (see ``docs/design.md``,
"Persistence", and ``docs/storage.md``). Public face:

- **Write**: `write_rollouts` (Parquet; ``step=N`` appends a part to a root;
  ``portable=True`` stores routes as nested integer lists for generic tools) and
  `write_ipc` (Arrow IPC, memory-mappable). Both validate first and write atomically.
- **Discover**: `rollout_files` — every file of a file, root or partition with its
  footer checked (`RolloutFile`: step, spec, schema, rows, row groups, layer groups).
- **Read**: `iter_rollouts` — the one reader: bounded, validated pieces (a root's
  with their int64 ``step`` column) of a Parquet file, root, partition, IPC file or
  `RolloutFile` s, with ``steps=``, ``columns=``, ``layers=`` (layer projection),
  ``row_groups=`` and a ``max_memory`` budget (`DEFAULT_MAX_MEMORY`); `read_rollouts`
  is the concatenation of its pieces. `project_layers` projects an in-memory table
  like ``layers=``; `route_rows` gives the ``[T, L, K]`` rows of a routes column.
- **Diagnostics**: `write_diagnostics` / `read_diagnostics` (the diagnostics schema,
  `NATIVE_VS_REPLAY`), per-step route agreement beside the rollouts.
- **Temp files**: `find_temps`, `remove_stale_temps` (`TempFile`), what ``r3arrow gc`` uses.

Module map: `._layout` (``step=N/`` partitions, part names, atomic writes, temps),
`._storage` (the dispatcher over the routes storage formats: the leaf formats
`._groups`, layer groups, default, and `._portable`, nested lists, over the shared
`._project`: storage metadata and layer projection; the interleave copy of a
multi-group read is `._interleave`), `._stream` (row groups cut by bytes,
`DEFAULT_ROW_GROUP_BYTES`; pieces under the memory budget), `._verify` (the trust
boundary), `._parquet` (writer, discovery, reader), `._ipc`, `._diagnostics`.

Contract: the spec travels in the file metadata. Files carry Parquet page checksums
and a SHA-256 over the r3arrow metadata (``r3arrow.meta_sha256``); readers verify
both, the schema version and the spec, and — unless ``validate=False`` — the rows they
return (columns, types, no nulls, lengths, expert ids). Every error is an
`R3ArrowError` (mostly `SchemaError`) with ``path`` naming the file; no Arrow or OS
exception escapes for a corrupt or foreign file. A rollout table without ``routes``
and without a spec (R3 off) is written and read back as is. Argument misuse (a
negative or non-int ``step``, a bad ``row_groups``) raises ``ValueError`` / ``TypeError``.
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
    "route_rows",
    "write_diagnostics",
    "write_ipc",
    "write_rollouts",
]

set_homes(globals(), __all__)
