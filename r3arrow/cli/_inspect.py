"""``r3arrow inspect``: a summary of a rollout file or root, streamed by row group.

The summary never materialises a step (``docs/design.md``, "Persistence"; issue 14): the
footers give the schema, spec and row-group counts, then each row group is read on its
own (`r3arrow.io.read_rollouts` with ``row_groups=``, validated), its lengths added up
and dropped, so memory stays at one row group whatever the run's size. An Arrow IPC file
is memory-mapped by the same reader, which does not load it either.

Also the input checks every command shares: `check_input` (a directory or a regular
file: a FIFO would block the open, a device never ends) and `is_ipc`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow as pa

from r3arrow.spec import RouteSpec

_IPC_MAGIC = b"ARROW1"


def check_input(path: Path) -> None:
    """``path`` exists and is a directory or a regular file (`SchemaError` for a FIFO etc.)."""
    from r3arrow._checks import check_regular

    if not path.exists():
        raise FileNotFoundError(f"{path}: no such rollout file or directory")
    if not path.is_dir():
        check_regular(path)


def is_ipc(path: Path) -> bool:
    """An Arrow IPC (Feather v2) file, by its magic bytes (any suffix)."""
    check_input(path)
    if path.is_dir():
        return False
    with open(path, "rb") as fh:
        return fh.read(len(_IPC_MAGIC)) == _IPC_MAGIC


def size_on_disk(path: Path) -> int:
    """Bytes of ``path`` (a file) or of every non-hidden file under it (a directory)."""
    if path.is_file():
        return path.stat().st_size
    return sum(
        p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")
    )


def human_bytes(n: float) -> str:
    """``n`` bytes as ``"12.3 MiB"`` (``"512 B"`` below a KiB)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


def _temp_summary(path: Path) -> dict[str, int]:
    """Leftover writers' temp files beside or under ``path``: count and bytes (all, dead)."""
    from r3arrow.io import find_temps

    temps = find_temps(path)
    return {
        "temp_files": len(temps),
        "temp_bytes": sum(t.size for t in temps),
        "stale_temp_bytes": sum(t.size for t in temps if t.stale),
    }


class _Totals:
    """Running sums over the row groups read so far."""

    def __init__(self) -> None:
        self.rows = 0
        self.tokens = 0
        self.captured = 0

    def add(self, table: pa.Table, r3: bool) -> None:
        from r3arrow.table import captured_lengths, sequence_lengths

        self.rows += table.num_rows
        self.tokens += int(sequence_lengths(table).sum())
        if r3:
            self.captured += int(captured_lengths(table).sum())


def _ipc_totals(path: Path) -> tuple[pa.Schema, RouteSpec | None, _Totals, list[int] | None]:
    from r3arrow.io import read_rollouts
    from r3arrow.table import has_routes, route_spec

    table = read_rollouts(path)  # an IPC file: memory-mapped: the buffers are not loaded
    spec = route_spec(table) if has_routes(table) else None
    totals = _Totals()
    totals.add(table, spec is not None)
    steps = None
    if "step" in table.schema.names:  # an IPC copy of a directory read keeps its step column
        steps = [int(s) for s in np.unique(table.column("step").to_numpy())]
    return table.schema, spec, totals, steps


def _parquet_totals(
    path: Path,
) -> tuple[pa.Schema, RouteSpec | None, _Totals, list[int]]:
    """Footers first (schema, one spec for all files), then every row group on its own."""
    from r3arrow.io import read_rollouts, rollout_files

    files = rollout_files(path)
    spec = files[0].spec
    totals = _Totals()
    for f in files:
        for g in range(f.num_row_groups):
            totals.add(read_rollouts([f], row_groups=[g]), spec is not None)
    steps = sorted({f.step for f in files if f.step is not None})
    schema = files[0].schema
    if path.is_dir():
        schema = schema.append(pa.field("step", pa.int64()))
    return schema, spec, totals, steps


def inspect_summary(path: Path) -> dict[str, Any]:
    """Schema, spec, rows, tokens, captured fraction and size on disk of a rollout file or dir.

    Streams (see the module docstring). Raises what the readers raise for a missing,
    corrupt or inconsistent input (`SchemaError` with ``path``, ``FileNotFoundError``).
    """
    check_input(path)
    steps: list[int] | None
    if is_ipc(path):
        schema, spec, totals, steps = _ipc_totals(path)
    else:
        schema, spec, totals, found = _parquet_totals(path)
        steps = found if path.is_dir() else None
    schema = schema.remove_metadata()
    info: dict[str, Any] = {
        "path": str(path),
        "rows": totals.rows,
        "columns": {f.name: str(f.type) for f in schema},
        "spec": orjson.loads(spec.to_json()) if spec is not None else None,
        "tokens": totals.tokens,
        "captured_rows": totals.captured,
        "captured_fraction": float(totals.captured / totals.tokens) if totals.tokens else 0.0,
        "route_bytes": totals.captured * spec.row_nbytes if spec is not None else 0,
        "size_on_disk": size_on_disk(path),
        **_temp_summary(path),
    }
    if steps is not None:
        info["steps"] = steps
    return info


__all__ = ["check_input", "human_bytes", "inspect_summary", "is_ipc", "size_on_disk"]
