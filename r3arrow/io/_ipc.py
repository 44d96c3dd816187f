"""Arrow IPC (Feather v2): rollout tables as uncompressed, memory-mappable files.

IPC keeps the Arrow schema verbatim (nested routes type, list child names,
metadata), so no storage conversion is needed; reads are zero-copy, memory-mapped.
`write_ipc` writes one; the readers of `r3arrow.io._parquet` recognise one by its
magic bytes (`is_ipc`) and read it with `read_ipc_file`, behind the same trust
boundary as Parquet (`r3arrow.io._verify`).
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from r3arrow._checks import check_regular
from r3arrow._typing import PathLike
from r3arrow._validated import is_validated
from r3arrow.errors import SchemaError
from r3arrow.io._layout import atomic_path
from r3arrow.io._verify import check_table, file_spec, reading
from r3arrow.table import validate_rollouts

#: The first bytes of an Arrow IPC file.
IPC_MAGIC = b"ARROW1"


def write_ipc(table: pa.Table, path: PathLike) -> Path:
    """Write a rollout table as an uncompressed Arrow IPC file, atomically; return the path.

    Validated like `write_rollouts` (skipped for a table r3arrow already validated);
    `read_rollouts` / `iter_rollouts` read it back memory-mapped. Raises the
    validation errors before touching the disk.
    """
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
    """Whether ``path`` is a regular file starting with the Arrow IPC magic bytes.

    ``False`` for a directory or a missing path (the readers report those);
    `SchemaError` for a FIFO, device or socket (opening one would block).
    """
    if not path.exists() or path.is_dir():
        return False
    check_regular(path)
    try:
        with open(path, "rb") as fh:
            return fh.read(len(IPC_MAGIC)) == IPC_MAGIC
    except OSError as exc:
        raise SchemaError(f"{path}: cannot read the rollout file ({exc})", path=path) from exc


def read_ipc_file(path: Path, *, validate: bool = True) -> pa.Table:
    """An IPC rollout file, memory-mapped (zero-copy, lazy paging), checked.

    The schema must carry r3arrow metadata (a table without ``routes`` and without a
    spec is an R3-off file); with ``validate`` the rows are checked like
    `read_rollouts` does. Raises `SchemaError` (``path`` set) for an unreadable or
    foreign file and the r3arrow error of the first bad row (``path`` set).
    """
    try:
        table = pa.ipc.open_file(pa.memory_map(str(path))).read_all()
    except (pa.ArrowException, OSError) as exc:
        raise SchemaError(
            f"{path}: expected an r3arrow Arrow IPC rollout file, found an unreadable file ({exc})",
            path=path,
        ) from exc
    with reading(path):
        spec = file_spec(table.schema, path)
        if validate:
            table = check_table(table, spec)
    return table


__all__ = ["IPC_MAGIC", "is_ipc", "read_ipc_file", "write_ipc"]
