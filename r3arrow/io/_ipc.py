"""Arrow IPC rollout files: the schema verbatim, uncompressed, read memory-mapped."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from r3arrow._checks import check_regular
from r3arrow._typing import PathLike
from r3arrow._validated import is_validated
from r3arrow.errors import SchemaError
from r3arrow.io._layout import atomic_path
from r3arrow.io._verify import file_spec, reading
from r3arrow.table import validate_rollouts

IPC_MAGIC = b"ARROW1"


def write_ipc(table: pa.Table, path: PathLike) -> Path:
    """Write a rollout table, validated first, as an uncompressed Arrow IPC file, atomically."""
    if not is_validated(table):
        validate_rollouts(table)
    with (
        atomic_path(Path(path)) as paths,
        pa.OSFile(str(paths[0]), "wb") as sink,
        pa.ipc.new_file(sink, table.schema) as writer,
    ):
        writer.write_table(table)
    return paths[-1]


def is_ipc(path: Path) -> bool:
    """Whether ``path`` is a regular file starting with the IPC magic (a FIFO or device:
    `SchemaError`).
    """
    if not path.exists() or path.is_dir():
        return False
    check_regular(path)
    try:
        with open(path, "rb") as fh:
            return fh.read(len(IPC_MAGIC)) == IPC_MAGIC
    except OSError as exc:
        raise SchemaError(f"{path}: cannot read the rollout file ({exc})", path=path) from exc


def read_ipc_file(path: Path) -> pa.Table:
    """An IPC rollout file, memory-mapped, its schema checked (its rows are not)."""
    try:
        table = pa.ipc.open_file(pa.memory_map(str(path))).read_all()
    except (pa.ArrowException, OSError) as exc:
        raise SchemaError(
            f"{path}: expected an r3arrow Arrow IPC rollout file, found an unreadable file ({exc})",
            path=path,
        ) from exc
    with reading(path):
        file_spec(table.schema)
    return table
