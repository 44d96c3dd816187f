"""``r3arrow inspect``: a summary of a rollout file or root, one row group at a time.

The footers give the schema, spec and row groups; each row group is then read on its
own (validated), its lengths added up and dropped, so memory stays at one row group
(``docs/design.md``, "Persistence"). An Arrow IPC file is memory-mapped, not loaded.
Also the input checks every command shares: `check_input`, `rollout_input` and `is_ipc`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow as pa

from r3arrow.errors import SchemaError

_IPC_MAGIC = b"ARROW1"


def check_input(path: Path) -> None:
    """``path`` exists and is a directory or a regular file (`SchemaError` for a FIFO etc.)."""
    from r3arrow._checks import check_regular

    if not path.exists():
        raise FileNotFoundError(f"{path}: no such rollout file or directory")
    if not path.is_dir():
        check_regular(path)


def rollout_input(path: Path) -> Path:
    """``path`` checked (`check_input`); a folder without ``step=N/`` partitions holding one
    rollout ``.parquet`` beside other outputs (the demo's output folder) is that file."""
    check_input(path)
    if not path.is_dir() or path.name.startswith("step=") or any(path.glob("step=*")):
        return path
    files = sorted(p.name for p in path.glob("*.parquet") if not p.name.startswith("."))
    if len(files) > 1:
        raise SchemaError(
            f"{path}: expected step=N/ partitions or one rollout .parquet file, found "
            f"{len(files)} files {files}: pass one of them",
            path=path,
        )
    return path / files[0] if files else path


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


def _sizes(table: pa.Table, r3: bool) -> tuple[int, int, int]:
    """(rows, tokens, captured route rows) of one table."""
    from r3arrow.table import captured_lengths, sequence_lengths

    captured = int(captured_lengths(table).sum()) if r3 else 0
    return table.num_rows, int(sequence_lengths(table).sum()), captured


def inspect_summary(path: Path) -> dict[str, Any]:
    """Schema, spec, rows, tokens, captured fraction and size on disk of a rollout file or dir.

    Streams (see the module docstring). Raises what the readers raise for a missing,
    corrupt or inconsistent input (`SchemaError` with ``path``, ``FileNotFoundError``).
    """
    from r3arrow.io import find_temps, read_rollouts, rollout_files
    from r3arrow.table import has_routes, route_spec

    path = rollout_input(path)
    steps: list[int] | None = None
    if is_ipc(path):
        table = read_rollouts(path)  # memory-mapped: the buffers are not loaded
        spec = route_spec(table) if has_routes(table) else None
        sizes = [_sizes(table, spec is not None)]
        schema = table.schema
        if "step" in schema.names:  # an IPC copy of a directory read keeps its step column
            steps = [int(s) for s in np.unique(table.column("step").to_numpy())]
    else:
        files = rollout_files(path)
        spec, schema = files[0].spec, files[0].schema
        sizes = [
            _sizes(read_rollouts([f], row_groups=[g]), spec is not None)
            for f in files
            for g in range(f.num_row_groups)
        ]
        if path.is_dir():
            schema = schema.append(pa.field("step", pa.int64()))
            steps = sorted({f.step for f in files if f.step is not None})
    rows, tokens, captured = (int(x) for x in np.array(sizes, np.int64).reshape(-1, 3).sum(0))
    temps = find_temps(path)
    info: dict[str, Any] = {
        "path": str(path),
        "rows": rows,
        "columns": {f.name: str(f.type) for f in schema.remove_metadata()},
        "spec": orjson.loads(spec.to_json()) if spec is not None else None,
        "tokens": tokens,
        "captured_rows": captured,
        "captured_fraction": float(captured / tokens) if tokens else 0.0,
        "route_bytes": captured * spec.row_nbytes if spec is not None else 0,
        "size_on_disk": size_on_disk(path),
        "temp_files": len(temps),
        "temp_bytes": sum(t.size for t in temps),
        "stale_temp_bytes": sum(t.size for t in temps if t.stale),
    }
    if steps is not None:
        info["steps"] = steps
    return info


__all__ = [
    "check_input",
    "human_bytes",
    "inspect_summary",
    "is_ipc",
    "rollout_input",
    "size_on_disk",
]
