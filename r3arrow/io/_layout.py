"""The on-disk layout: ``step=N/`` partitions, part names, discovery, atomic writes.

A rollout root holds one hive-style partition per training step
(``root/step=N/part-NNNNN.parquet``; see ``docs/design.md``, "Persistence"). Writers
never expose a half-written file: they write ``.<name>.tmp-<host>-<pid>-<uuid>``
beside the destination, fsync it, rename it into place (a new part is hard-linked
to the first free part name, so two writers never replace each other's file) and
fsync the directory, so the new name survives a power loss. Readers only ever
look at ``part-*.parquet`` names, so temporary files are invisible to them.

A writer killed mid-write (SIGKILL, OOM) leaves its temp behind. The temp's name
says which host and process wrote it, so the next successful write to the same
directory removes the temps of writers on this host that are no longer alive
(:func:`remove_stale_temps`); a live writer's temp and another host's temp (on a
shared file system) are never touched. ``r3arrow gc`` does the same on demand.

Partition names are canonical: ``step=`` followed by the decimal digits of the
step without leading zeros (``step=0``, ``step=12``). A directory named like a
partition but not canonical (``step=01``) is refused (`SchemaError`), never read
as an alias of ``step=1``. No other module of r3arrow builds or parses these names.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import socket
import stat
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from r3arrow._checks import check_int, check_nonnegative_int, check_regular
from r3arrow._typing import PathLike
from r3arrow.errors import SchemaError

# ``step=`` and ASCII digits; canonical ones are told apart separately so that ``step=01``
# is an error rather than an invisible directory or an alias of ``step=1``.
_STEP_LIKE = re.compile(r"^step=([0-9]+)$")
_CANONICAL_STEP = re.compile(r"^(0|[1-9][0-9]*)$")
PART_GLOB = "part-*.parquet"

# ``.<name>.tmp-<host>-<pid>-<uuid hex>``; the host is sanitised to [A-Za-z0-9._-].
_TEMP = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<host>[A-Za-z0-9._-]+)-(?P<pid>[0-9]+)-[0-9a-f]{32}$")


def check_step(step: Any) -> int:
    """``step`` as an int ``>= 0``: ``TypeError`` for a non-int (no float, bool or str
    coercion: ``1.9``, ``True``, ``"1_0"``, ``" 3 "`` are refused), ``ValueError`` if negative.
    """
    return check_nonnegative_int(step, "step")


def step_dir(root: PathLike, step: int) -> Path:
    """The partition directory of ``step`` under ``root`` (``root/step=N``); see `check_step`."""
    return Path(root) / f"step={check_step(step)}"


def dir_step(path: Path) -> int | None:
    """The step of a partition directory named ``step=N``, else ``None``.

    Raises `SchemaError` (``path`` set) for digits with a leading zero such as
    ``step=01`` (see the module docstring); other names (``step=x``) are not partitions.
    """
    m = _STEP_LIKE.match(path.name)
    if m is None:
        return None
    if not _CANONICAL_STEP.match(m.group(1)):
        raise SchemaError(
            f"{path}: expected a partition named step=N with N a non-negative integer "
            f"without leading zeros, found {path.name!r}",
            path=path,
        )
    return int(m.group(1))


def _iterdir(root: Path) -> list[Path]:
    try:
        return list(root.iterdir())
    except FileNotFoundError:
        raise FileNotFoundError(f"{root}: no such rollout directory") from None
    except OSError as exc:  # permission, not a directory, I/O
        raise SchemaError(f"{root}: cannot list the rollout directory ({exc})", path=root) from exc


def list_steps(root: PathLike) -> list[int]:
    """Steps present under a ``step=N`` partitioned directory, ascending.

    Only directories named ``step=<digits>`` count (``step=x`` is ignored).
    Raises ``FileNotFoundError`` if ``root`` does not exist, `SchemaError`
    naming the directories if one is named like a partition but not canonically
    (``step=01``, alone or next to ``step=1``).
    """
    root = Path(root)
    found: dict[int, Path] = {}
    bad: list[Path] = []
    for child in _iterdir(root):
        if _STEP_LIKE.match(child.name) is None or not child.is_dir():
            continue
        try:
            s = dir_step(child)
        except SchemaError:
            bad.append(child)
            continue
        assert s is not None
        found[s] = child
    if bad:
        names = sorted(p.name for p in bad)
        twins = sorted(found[int(n[5:])].name for n in names if int(n[5:]) in found)
        also = f" next to {twins}" if twins else ""
        raise SchemaError(
            f"{root}: expected partitions named step=N without leading zeros, found "
            f"{names}{also}; rename or remove them (they are not read as aliases)",
            path=root,
        )
    return sorted(found)


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


def rollout_paths(
    path: PathLike, *, steps: Sequence[int] | None = None
) -> list[tuple[int | None, Path]]:
    """``(step, file)`` of every rollout Parquet file under ``path``, in read order.

    ``path`` is a rollout file (one ``(None, path)``), a root of ``step=N/``
    partitions (``(N, part)`` in numeric step order, then part order) or one
    partition directory ``step=N`` itself. ``steps`` selects partitions; every
    requested step must exist (`r3arrow.io.rollout_files` checks their footers).

    Raises
    ------
    FileNotFoundError
        ``path`` does not exist.
    TypeError
        ``steps`` is not a sequence of ints.
    SchemaError
        ``steps`` given for a single file; ``path`` is neither a regular file
        nor a directory (a FIFO, a device); a directory without step partitions
        or part files, or with a non-canonical ``step=`` name; a requested step
        that is absent (``path`` field set).
    """
    wanted = check_steps(steps)
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such rollout file or directory")
    if not p.is_dir():
        check_regular(p)
        if wanted is not None:
            raise SchemaError(f"{p}: steps= needs a step=N/ directory, found a single file", path=p)
        return [(None, p)]
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
    files: list[tuple[int | None, Path]] = (
        [(s, f) for s, f in pairs if wanted is None or s in wanted]
        if pairs
        else list(step_files(p, wanted))
    )
    if not files:
        raise SchemaError(f"{p}: expected step=N/*.parquet rollout files, found none", path=p)
    return files


# ------------------------------------------------------------------ temp files
def _host() -> str:
    """This host's name as it appears in temp names (characters outside [A-Za-z0-9.] -> ``_``)."""
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "localhost"


def temp_name(dest_name: str) -> str:
    """The name of a fresh temp file for ``dest_name``: ``.NAME.tmp-<host>-<pid>-<uuid>``."""
    return f".{dest_name}.tmp-{_host()}-{os.getpid()}-{uuid.uuid4().hex}"


def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (a zombie counts; so may a reused pid)."""
    if pid <= 0:
        return True  # never signal a process group: treat as alive, keep the file
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    except OverflowError:
        return False
    return True


@dataclasses.dataclass(frozen=True)
class TempFile:
    """A writer's temporary file.

    ``host`` and ``pid`` name the writer; ``alive`` is whether that writer still
    runs: ``True`` / ``False`` on this host, ``None`` when unknown (another host).
    """

    path: Path
    size: int
    host: str
    pid: int
    alive: bool | None

    @property
    def stale(self) -> bool:
        """A temp that :func:`remove_stale_temps` removes: its writer on this host is dead."""
        return self.alive is False


def _temp_dirs(path: Path) -> list[Path]:
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or directory")
    if not path.is_dir():
        return [path.parent]
    out = [path]
    for child in _iterdir(path):
        if child.is_dir() and _STEP_LIKE.match(child.name):
            out.append(child)
    return out


def _scan_temps(directory: Path, here: str) -> list[TempFile]:
    """The temp files directly inside ``directory``."""
    out = []
    for child in _iterdir(directory):
        m = _TEMP.match(child.name)
        if m is None:
            continue
        try:
            st = child.lstat()
        except FileNotFoundError:  # renamed into place meanwhile
            continue
        if not stat.S_ISREG(st.st_mode):
            continue
        host, pid = m.group("host"), int(m.group("pid"))
        alive = _pid_alive(pid) if host == here else None
        out.append(TempFile(child, st.st_size, host, pid, alive))
    return out


def find_temps(path: PathLike) -> list[TempFile]:
    """The writers' temp files under ``path``, sorted by path.

    ``path`` is a directory (its own temps and those of its ``step=*``
    partitions) or a file (the temps beside it). Raises ``FileNotFoundError`` if
    ``path`` does not exist.
    """
    here = _host()
    out = [t for d in _temp_dirs(Path(path)) for t in _scan_temps(d, here)]
    return sorted(out, key=lambda t: t.path)


def remove_stale_temps(path: PathLike, *, dry_run: bool = False) -> list[tuple[Path, int]]:
    """Remove the temps of dead writers on this host under ``path``; return ``(path, bytes)``.

    Only temps whose writer ran on this host and is no longer alive are removed
    (see `find_temps` for which directories are searched); a live writer's temp and
    another host's are kept. ``dry_run``: list, remove
    nothing. A temp that vanishes meanwhile is skipped.
    """
    removed = []
    for t in find_temps(path):
        if not t.stale:
            continue
        if not dry_run:
            try:
                t.path.unlink()
            except FileNotFoundError:
                continue
        removed.append((t.path, t.size))
    return removed


def fsync_dir(directory: Path) -> None:
    """Flush ``directory``'s entries (a rename or link into it) to stable storage."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms that cannot open a directory
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - file systems that refuse fsync on a directory
        pass
    finally:
        os.close(fd)


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
    free part. The temp is fsynced before the rename and the directory after it.
    On failure the temp file is removed and the destination is untouched. After
    a successful write the temps of dead writers in the directory are removed
    (`remove_stale_temps`; errors there never fail the write).
    """
    directory = dest if new_part else dest.parent
    directory.mkdir(parents=True, exist_ok=True)
    if not new_part and dest.is_dir():
        raise IsADirectoryError(f"{dest}: expected a file path, found a directory")
    tmp = directory / temp_name(dest.name)
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
    fsync_dir(directory)
    with contextlib.suppress(OSError, SchemaError):  # housekeeping never fails a write
        for t in _scan_temps(directory, _host()):
            if t.stale:
                with contextlib.suppress(FileNotFoundError):
                    t.path.unlink()


__all__ = [
    "TempFile",
    "atomic_path",
    "check_step",
    "check_steps",
    "dir_step",
    "find_temps",
    "fsync_dir",
    "list_steps",
    "part_files",
    "remove_stale_temps",
    "rollout_paths",
    "step_dir",
    "step_files",
    "temp_name",
]
