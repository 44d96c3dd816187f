"""Arrow IPC (Feather v2): rollout tables as uncompressed, memory-mappable files.

IPC keeps the Arrow schema verbatim (nested routes type, list child names,
metadata), so no storage conversion is needed; reads are zero-copy when
memory-mapped.
"""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from r3arrow._typing import PathLike
from r3arrow._validated import is_validated
from r3arrow.errors import SchemaError
from r3arrow.io._layout import atomic_path, check_regular
from r3arrow.io._verify import check_table, file_spec, reading
from r3arrow.table import validate_rollouts


def write_ipc(table: pa.Table, path: PathLike) -> Path:
    """Write a rollout table as an uncompressed Arrow IPC file, atomically; return the path.

    Validated like `write_rollouts` (skipped for a table r3arrow already validated).
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


def read_ipc(path: PathLike, *, memory_map: bool = True, validate: bool = True) -> pa.Table:
    """Read an IPC rollout file; memory-mapped (zero-copy, lazy paging) by default.

    The same trust boundary as the Parquet readers: the schema must carry r3arrow
    metadata (a table without ``routes`` and without a spec is an R3-off file), and
    with ``validate`` (default) the rows are checked like `read_rollouts` does
    (columns, types, nulls, lengths, expert ids); ``validate=False`` keeps only the
    schema checks. Raises ``FileNotFoundError`` if ``path`` does not exist,
    `SchemaError` (``path`` set) for a path that is not a regular file (a FIFO would
    block), an unreadable or foreign file, and the r3arrow error of the first bad row
    (``path`` set).
    """
    p = Path(path)
    check_regular(p)
    try:
        source = pa.memory_map(str(p)) if memory_map else pa.OSFile(str(p), "rb")
        table = pa.ipc.open_file(source).read_all()
    except (pa.ArrowException, OSError) as exc:
        raise SchemaError(
            f"{p}: expected an r3arrow Arrow IPC rollout file, found an unreadable file ({exc})",
            path=p,
        ) from exc
    with reading(p):
        spec = file_spec(table.schema, p)
        if validate:
            table = check_table(table, spec)
    return table


__all__ = ["read_ipc", "write_ipc"]
