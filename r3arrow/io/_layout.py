"""The on-disk layout: ``step=N/`` partitions, part names, atomic writes and writers' temps.

``docs/design.md``, "Persistence". No other module builds or parses these names.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import socket
import stat
import uuid
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

try:
    import fcntl
except ImportError:  # no flock (Windows): a temp's owner is its pid/host hint alone
    fcntl = None  # type: ignore[assignment]

from r3arrow._checks import check_int, check_regular
from r3arrow._typing import PathLike
from r3arrow.errors import SchemaError

#: The largest step a root holds (the int64 ``step`` column readers add), for writers and readers.
MAX_STEP = 2**63 - 1
#: The column readers add to a root's rows; a table written to a root may not have one.
STEP_COLUMN = "step"
#: Prefix of the column names r3arrow keeps for itself (never written, never read).
RESERVED_PREFIX = "__r3arrow"
# Canonical digits are told apart separately: ``step=01`` is an error, not an invisible dir.
_STEP_LIKE = re.compile(r"^step=([0-9]+)$")
_CANONICAL_STEP = re.compile(r"^(0|[1-9][0-9]*)$")
# ``.<name>.tmp-<host>-<pid>-<uuid hex>``; the host is sanitised to [A-Za-z0-9._-].
_TEMP = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<host>[A-Za-z0-9._-]+)-(?P<pid>[0-9]+)-[0-9a-f]{32}$")


def check_step(step: Any, name: str = "step") -> int:
    """``step`` as an int in ``[0, MAX_STEP]``: ``TypeError`` for a non-int (``1.9``, ``True``,
    ``"1_0"`` are refused), ``ValueError`` outside.
    """
    return check_int(step, name, minimum=0, maximum=MAX_STEP)


def check_reserved(names: Sequence[str], in_root: bool) -> None:
    """`SchemaError` for a column named ``__r3arrow*``, or ``step`` in a root (``in_root``):
    the readers' own columns, which a file's column must never stand in for.
    """
    bad = [n for n in names if n.startswith(RESERVED_PREFIX) or (in_root and n == STEP_COLUMN)]
    if bad:
        raise SchemaError(
            f"expected no reserved column ({STEP_COLUMN!r} in a step root, where readers add "
            f"the partition's; {RESERVED_PREFIX + '*'!r}), found {bad}; drop or rename them"
        )


def step_dir(root: PathLike, step: int) -> Path:
    """The partition directory of ``step`` under ``root`` (``root/step=N``)."""
    return Path(root) / f"step={check_step(step)}"


def _name_step(name: str) -> int | None:
    """The step of a canonical ``step=N`` name (``N <= MAX_STEP``), else ``None``."""
    m = _STEP_LIKE.match(name)
    if m is None or not _CANONICAL_STEP.match(m.group(1)) or len(m.group(1)) > 19:
        return None
    step = int(m.group(1))
    return step if step <= MAX_STEP else None


def dir_step(path: Path) -> int | None:
    """The step of a directory named ``step=N``, else ``None``; `SchemaError` for ``step=01``
    or ``N > MAX_STEP``."""
    if _STEP_LIKE.match(path.name) is None:
        return None
    step = _name_step(path.name)
    if step is None:
        raise SchemaError(
            f"{path}: expected a partition named step=N with N an integer in [0, {MAX_STEP}] "
            f"without leading zeros, found {path.name!r}",
            path=path,
        )
    return step


def _iterdir(root: Path) -> list[Path]:
    try:
        return list(root.iterdir())
    except FileNotFoundError:
        raise FileNotFoundError(f"{root}: no such rollout directory") from None
    except OSError as exc:  # permission, not a directory, I/O
        raise SchemaError(f"{root}: cannot list the rollout directory ({exc})", path=root) from exc


def _list_steps(root: Path) -> list[int]:
    """Steps of the ``step=N`` directories under ``root``, ascending; `SchemaError` naming
    every non-canonical one (and its canonical twin)."""
    found: dict[int, Path] = {}
    bad: list[Path] = []
    for child in _iterdir(root):
        if _STEP_LIKE.match(child.name) is None or not child.is_dir():
            continue
        if (step := _name_step(child.name)) is not None:
            found[step] = child
        else:
            bad.append(child)
    if bad:
        names = sorted(p.name for p in bad)
        twins = sorted(found[int(n[5:])].name for n in names if int(n[5:]) in found)
        also = f" next to {twins}" if twins else ""
        raise SchemaError(
            f"{root}: expected partitions named step=N, N in [0, {MAX_STEP}] without leading "
            f"zeros, found {names}{also}; rename or remove them (they are not read as aliases)",
            path=root,
        )
    return sorted(found)


def _part_files(directory: Path) -> list[Path]:
    return sorted(directory.glob("part-*.parquet"))


def step_parts(root: PathLike, step: int) -> list[Path]:
    """The part files already in ``root/step=N``, in part order (none where it does not exist)."""
    return _part_files(step_dir(root, step))


def check_steps(steps: Sequence[int] | None) -> list[int] | None:
    """``steps`` as a list of ints (``None`` passes): `check_step` of each."""
    if steps is None:
        return None
    if isinstance(steps, str | bytes) or not isinstance(steps, Sequence | set | frozenset):
        raise TypeError(f"steps: expected a sequence of ints, found {type(steps).__name__}")
    return [check_step(s, "steps") for s in steps]


def rollout_paths(
    path: PathLike, *, steps: Sequence[int] | None = None
) -> list[tuple[int | None, Path]]:
    """``(step, file)`` of every rollout file under ``path`` (a file: ``(None, path)``), in
    numeric step order, then part order; raises the layout errors `rollout_files` lists."""
    wanted = check_steps(steps)
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such rollout file or directory")
    if not p.is_dir():
        check_regular(p)
        if wanted is not None:
            raise SchemaError(f"{p}: steps= needs a step=N/ directory, found a single file", path=p)
        return [(None, p)]
    dirs = {s: p / f"step={s}" for s in _list_steps(p)}
    own = dir_step(p)
    if not dirs and own is not None:  # one partition directory
        dirs = {own: p}
    present = list(dirs)
    if not present:
        raise SchemaError(f"{p}: expected step=N/ rollout partitions, found none", path=p)
    if wanted is not None and (missing := sorted(set(wanted) - set(present))):
        raise SchemaError(f"{p}: expected steps {missing} to exist, found steps {present}", path=p)
    files: list[tuple[int | None, Path]] = [
        (s, f) for s in present if wanted is None or s in wanted for f in _part_files(dirs[s])
    ]
    if not files:
        raise SchemaError(f"{p}: expected step=N/*.parquet rollout files, found none", path=p)
    return files


def _host() -> str:
    """This host's name as it appears in temp names (characters outside [A-Za-z0-9.] -> ``_``)."""
    return re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "localhost"


def temp_name(dest_name: str) -> str:
    """The name of a fresh temp file for ``dest_name``: ``.NAME.tmp-<host>-<pid>-<uuid>``."""
    return f".{dest_name}.tmp-{_host()}-{os.getpid()}-{uuid.uuid4().hex}"


def _pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists in this PID namespace (a zombie counts; so may a reused
    pid); a hint only, since a writer in another namespace has another pid there."""
    if pid <= 0:
        return True  # never signal a process group: treat as alive, keep the file
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError):
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


def _try_lock(fd: int) -> bool:
    """Take the exclusive lock of the open temp ``fd`` without waiting; False if a writer holds
    it, or if the file system cannot lock (ownership unknown: the temp is kept). Without
    flock (Windows) True: the pid hint alone decides."""
    if fcntl is None:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # BlockingIOError: held; ENOLCK, EOPNOTSUPP: no locks here
        return False
    return True


@contextlib.contextmanager
def _abandoned(path: Path) -> Iterator[bool]:
    """Whether no writer holds the temp ``path``'s lock, holding that lock meanwhile (False:
    held, gone or unreadable)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:  # gone (renamed into place), not ours to read
        yield False
        return
    try:
        yield _try_lock(fd)
    finally:
        os.close(fd)  # releases the lock


@dataclasses.dataclass(frozen=True)
class TempFile:
    """A writer's temporary file: ``host`` and ``pid`` name the writer; ``alive`` is whether
    it still writes: its lock is held or its pid runs here (``None``: unknown, another host)."""

    path: Path
    size: int
    host: str
    pid: int
    alive: bool | None

    @property
    def stale(self) -> bool:
        """A temp that :func:`remove_stale_temps` removes: its writer on this host is gone."""
        return self.alive is False


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
        alive = None
        if host == here:
            with _abandoned(child) as free:
                alive = _pid_alive(pid) or not free
        out.append(TempFile(child, st.st_size, host, pid, alive))
    return out


def find_temps(path: PathLike) -> list[TempFile]:
    """The writers' temp files in the directory ``path`` (and its ``step=*`` partitions) or
    beside the file ``path``, sorted; ``FileNotFoundError`` without ``path``.
    """
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such file or directory")
    dirs = [p.parent]
    if p.is_dir():
        dirs = [p, *(c for c in _iterdir(p) if c.is_dir() and _STEP_LIKE.match(c.name))]
    here = _host()
    return sorted((t for d in dirs for t in _scan_temps(d, here)), key=lambda t: t.path)


def _remove_stale(temps: Iterable[TempFile], dry_run: bool = False) -> list[tuple[Path, int]]:
    """Remove the stale ``temps`` whose lock is still free (checked again, held while removing)."""
    removed = []
    for t in (t for t in temps if t.stale):
        with _abandoned(t.path) as free:
            if not free:
                continue
            if not dry_run:
                try:
                    t.path.unlink()
                except FileNotFoundError:  # removed meanwhile
                    continue
        removed.append((t.path, t.size))
    return removed


def remove_stale_temps(path: PathLike, *, dry_run: bool = False) -> list[tuple[Path, int]]:
    """Remove the temps (as `find_temps`) of writers on this host that are gone (no lock held,
    no such pid here); their ``(path, bytes)`` (``dry_run``: remove nothing).
    """
    return _remove_stale(find_temps(path), dry_run)


def _locked_temp(directory: Path, dest_name: str) -> tuple[Path, int]:
    """A new temp file for ``dest_name`` and an open descriptor holding its exclusive lock:
    the writer's ownership, which survives PID namespaces (`remove_stale_temps`)."""
    while True:
        tmp = directory / temp_name(dest_name)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        if fcntl is not None:
            # ENOLCK, EOPNOTSUPP: this file system has no locks; removal then keeps the temp
            with contextlib.suppress(OSError):
                fcntl.flock(fd, fcntl.LOCK_EX)
        if os.fstat(fd).st_nlink:  # not removed as abandoned before the lock was taken
            return tmp, fd
        os.close(fd)


def fsync_dir(directory: Path) -> None:
    """Flush ``directory``'s entries (a rename or link into it) to stable storage."""
    # Some platforms cannot open a directory, some file systems refuse to fsync one.
    with contextlib.suppress(OSError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _claim_next_part(tmp: Path, directory: Path) -> Path:
    """Hard-link ``tmp`` to the first free ``part-NNNNN.parquet`` (never replaces a part)."""
    n = len(_part_files(directory))
    while True:
        target = directory / f"part-{n:05d}.parquet"
        try:
            os.link(tmp, target)
            return target
        except FileExistsError:
            n += 1


@contextlib.contextmanager
def atomic_path(dest: Path, *, new_part: bool = False) -> Iterator[list[Path]]:
    """Yield ``[tmp]`` beside ``dest``, locked by this writer until it is gone; on success move
    it into place (``new_part``: the next free part of the directory ``dest``), append the
    final path and remove stale temps.
    """
    directory = dest if new_part else dest.parent
    directory.mkdir(parents=True, exist_ok=True)
    if not new_part and dest.is_dir():
        raise IsADirectoryError(f"{dest}: expected a file path, found a directory")
    tmp, fd = _locked_temp(directory, dest.name)
    paths = [tmp]
    try:
        try:
            yield paths
            os.fsync(fd)
            if new_part:
                paths.append(_claim_next_part(tmp, directory))
            else:
                os.replace(tmp, dest)
                paths.append(dest)
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
    finally:
        os.close(fd)  # the lock goes with the temp's name
    fsync_dir(directory)
    with contextlib.suppress(OSError, SchemaError):  # housekeeping never fails a write
        _remove_stale(_scan_temps(directory, _host()))
