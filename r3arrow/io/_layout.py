"""The on-disk layout: ``step=N/`` partitions, part names, discovery, atomic writes.

A rollout root holds one hive-style partition per training step
(``root/step=N/part-NNNNN.parquet``; see ``docs/design.md``, "Persistence"). Writers
never expose a half-written file: they write ``.<name>.tmp-<uuid>`` beside the
destination, fsync it and then rename it into place (a new part is hard-linked
to the first free part name, so two writers never replace each other's file).
Readers only ever look at ``part-*.parquet`` names, so temporary files are
invisible to them. No other module of r3arrow builds or parses these names.
"""

from __future__ import annotations

import contextlib
import os
import re
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.dataset as ds

from r3arrow._checks import check_int, check_nonnegative_int
from r3arrow._typing import PathLike
from r3arrow.errors import SchemaError

_STEP_DIR = re.compile(r"^step=(\d+)$")
PART_GLOB = "part-*.parquet"
#: Hive partitioning of a rollout root: the directory key ``step`` as int64.
STEP_PARTITIONING = ds.partitioning(pa.schema([("step", pa.int64())]), flavor="hive")


def step_dir(root: PathLike, step: int) -> Path:
    """The partition directory of ``step`` under ``root`` (``root/step=N``)."""
    return Path(root) / f"step={check_nonnegative_int(step, 'step')}"


def dir_step(path: Path) -> int | None:
    """The step of a partition directory named ``step=N``, else ``None``."""
    m = _STEP_DIR.match(path.name)
    return int(m.group(1)) if m else None


def list_steps(root: PathLike) -> list[int]:
    """Steps present under a ``step=N`` partitioned directory, ascending.

    Only directories named ``step=<digits>`` count. Raises ``FileNotFoundError``
    if ``root`` does not exist.
    """
    out = []
    for child in Path(root).iterdir():
        s = dir_step(child)
        if s is not None and child.is_dir():
            out.append(s)
    return sorted(out)


def part_files(directory: Path) -> list[Path]:
    """The part files of one partition directory, in part order (temp files excluded)."""
    return sorted(directory.glob(PART_GLOB))


def step_files(root: Path, steps: Sequence[int] | None = None) -> list[tuple[int, Path]]:
    """(step, part file) of a root, numeric step order then part order; ``steps`` filters."""
    wanted = None if steps is None else set(steps)
    return [
        (s, f)
        for s in list_steps(root)
        if wanted is None or s in wanted
        for f in part_files(root / f"step={s}")
    ]


def check_steps(steps: Sequence[int] | None) -> list[int] | None:
    """``steps`` as a list of ints (``None`` passes); raises ``TypeError`` for a non-int."""
    if steps is None:
        return None
    if isinstance(steps, str | bytes) or not isinstance(steps, Sequence | set | frozenset):
        raise TypeError(f"steps: expected a sequence of ints, found {type(steps).__name__}")
    return [check_int(s, "steps") for s in steps]


def iter_rollout_files(
    path: PathLike, *, steps: Sequence[int] | None = None
) -> Iterator[tuple[int | None, Path]]:
    """Yield ``(step, file)`` for every rollout Parquet file under ``path``, in read order.

    ``path`` is a rollout file (one ``(None, path)``), a root of ``step=N/``
    partitions (``(N, part)`` in numeric step order, then part order) or one
    partition directory ``step=N`` itself. ``steps`` selects partitions; every
    requested step must exist. This is how `r3arrow.stats` and `r3arrow.ray`
    find their inputs: they never look at directory names themselves.

    Raises
    ------
    FileNotFoundError
        ``path`` does not exist.
    TypeError
        ``steps`` is not a sequence of ints.
    SchemaError
        ``steps`` given for a single file; a directory without step partitions
        or part files; a requested step that is absent (``path`` field set).
    """
    wanted = check_steps(steps)
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such rollout file or directory")
    if not p.is_dir():
        if wanted is not None:
            raise SchemaError(f"{p}: steps= needs a step=N/ directory, found a single file", path=p)
        yield None, p
        return
    present = list_steps(p)
    own = dir_step(p)
    if not present and own is not None:  # one partition directory
        pairs = [(own, f) for f in part_files(p)]
        present = [own]
    else:
        pairs = []
    if not present:
        raise SchemaError(f"{p}: expected step=N/ rollout partitions, found none", path=p)
    if wanted is not None and (missing := sorted(set(wanted) - set(present))):
        raise SchemaError(f"{p}: expected steps {missing} to exist, found steps {present}", path=p)
    files = (
        [(s, f) for s, f in pairs if wanted is None or s in wanted]
        if pairs
        else step_files(p, wanted)
    )
    if not files:
        raise SchemaError(f"{p}: expected step=N/*.parquet rollout files, found none", path=p)
    yield from files


def _claim_next_part(tmp: Path, directory: Path) -> Path:
    """Hard-link ``tmp`` to the first free ``part-NNNNN.parquet`` (never replaces a part)."""
    n = len(part_files(directory))
    while True:
        target = directory / f"part-{n:05d}.parquet"
        try:
            os.link(tmp, target)
            return target
        except FileExistsError:
            n += 1


@contextlib.contextmanager
def atomic_path(dest: Path, *, new_part: bool = False) -> Iterator[list[Path]]:
    """Yield ``[tmp]`` beside ``dest``; on success move it into place and append the final path.

    ``new_part``: ``dest`` is a partition directory and the file becomes its next
    free part. On failure the temp file is removed and the destination is untouched.
    """
    directory = dest if new_part else dest.parent
    directory.mkdir(parents=True, exist_ok=True)
    tmp = directory / f".{dest.name}.tmp-{uuid.uuid4().hex}"
    paths = [tmp]
    try:
        yield paths
        with open(tmp, "rb+") as fh:
            os.fsync(fh.fileno())
        if new_part:
            paths.append(_claim_next_part(tmp, directory))
        else:
            os.replace(tmp, dest)
            paths.append(dest)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()


__all__ = [
    "STEP_PARTITIONING",
    "atomic_path",
    "check_steps",
    "dir_step",
    "iter_rollout_files",
    "list_steps",
    "part_files",
    "step_dir",
    "step_files",
]
