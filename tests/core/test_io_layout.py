"""The on-disk layout (r3arrow.io._layout): canonical step names, step checks, temp files.

Real files in a temporary directory; dead writers are real processes that have exited.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

from r3arrow.errors import SchemaError
from r3arrow.io import read_rollouts, rollout_files, write_rollouts
from r3arrow.io._layout import (
    atomic_path,
    check_step,
    find_temps,
    remove_stale_temps,
    step_dir,
    temp_name,
)


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # reaped: the pid names no process now
    return proc.pid


def _temp(directory: Path, *, pid: int | None = None, size: int = 100) -> Path:
    name = temp_name("part-00000.parquet")
    if pid is not None:
        name = name.replace(f"-{os.getpid()}-", f"-{pid}-")
    path = directory / name
    path.write_bytes(b"\0" * size)
    return path


# ------------------------------------------------------------------ step names
def test_non_canonical_step_alone_is_an_error(tmp_path: Path, small_rollouts: pa.Table) -> None:
    write_rollouts(small_rollouts, tmp_path, step=1)
    (tmp_path / "step=1").rename(tmp_path / "step=01")
    with pytest.raises(SchemaError, match=r"step=01") as exc:
        rollout_files(tmp_path)
    assert exc.value.path == str(tmp_path)
    with pytest.raises(SchemaError, match=r"step=01"):
        read_rollouts(tmp_path)
    with pytest.raises(SchemaError, match=r"step=01"):
        rollout_files(tmp_path / "step=01")


def test_non_canonical_step_next_to_canonical_names_both(
    tmp_path: Path, small_rollouts: pa.Table
) -> None:
    write_rollouts(small_rollouts, tmp_path, step=1)
    write_rollouts(small_rollouts, tmp_path, step=2)
    (tmp_path / "step=2").rename(tmp_path / "step=001")
    with pytest.raises(SchemaError) as exc:
        rollout_files(tmp_path)
    assert "step=001" in str(exc.value) and "step=1" in str(exc.value)


def test_other_step_like_names_are_not_partitions(tmp_path: Path, small_rollouts: pa.Table) -> None:
    for name in ("step=x", "step=", "step=-1", "step=1.0", "step=\u0661"):  # Arabic-Indic one
        (tmp_path / name).mkdir()
    write_rollouts(small_rollouts, tmp_path, step=0)
    assert [f.step for f in rollout_files(tmp_path)] == [0]


@pytest.mark.parametrize(
    ("value", "error"),
    [
        (1.9, TypeError),
        (1.0, TypeError),
        (True, TypeError),
        ("1_0", TypeError),
        (" 3 ", TypeError),
        ("3", TypeError),
        (-1, ValueError),
    ],
)
def test_step_must_be_a_nonnegative_int(
    value: Any, error: type[Exception], tmp_path: Path, small_rollouts: pa.Table
) -> None:
    with pytest.raises(error, match="step"):
        check_step(value)
    with pytest.raises(error, match="step"):
        write_rollouts(small_rollouts, tmp_path, step=value)
    assert list(tmp_path.iterdir()) == []  # refused before touching the disk


@given(st.floats() | st.text() | st.booleans() | st.binary() | st.decimals())
def test_step_never_coerces(value: Any) -> None:
    with pytest.raises(TypeError, match="step"):
        check_step(value)


@given(st.integers(0, 2**63 - 1))
def test_every_step_round_trips_through_its_directory_name(step: int) -> None:
    from r3arrow.io._layout import dir_step

    d = step_dir("root", step)
    assert d.name == f"step={step}" and dir_step(d) == step


def test_numpy_int_step_is_canonical(tmp_path: Path) -> None:
    assert check_step(np.int64(7)) == 7
    assert step_dir(tmp_path, 7) == tmp_path / "step=7"
    assert check_step(0) == 0


# ------------------------------------------------------------------ temp files
def test_temp_names_carry_host_and_pid(tmp_path: Path) -> None:
    with atomic_path(tmp_path / "r.parquet") as paths:
        name = paths[0].name
        paths[0].write_bytes(b"data")
        (t,) = find_temps(tmp_path)
        assert t.path == paths[0] and t.pid == os.getpid() and t.alive is True and t.size == 4
    assert name.startswith(".r.parquet.tmp-") and f"-{os.getpid()}-" in name
    assert find_temps(tmp_path) == []


def test_next_write_removes_only_dead_writers_temps(
    tmp_path: Path, small_rollouts: pa.Table
) -> None:
    d = tmp_path / "step=0"
    d.mkdir()
    dead = _temp(d, pid=_dead_pid(), size=123)
    live = _temp(d)  # this very process
    other = d / f".part-00000.parquet.tmp-some-other-host-{_dead_pid()}-{'a' * 32}"
    other.write_bytes(b"x")
    by_path = {t.path: t for t in find_temps(tmp_path)}
    assert by_path[dead].alive is False and by_path[dead].size == 123
    assert by_path[live].alive is True
    assert by_path[other].alive is None and by_path[other].host == "some-other-host"
    write_rollouts(small_rollouts, tmp_path, step=0)
    assert not dead.exists()
    assert live.exists() and other.exists()


def test_remove_stale_temps_dry_run_and_sizes(tmp_path: Path) -> None:
    (tmp_path / "step=3").mkdir()
    a = _temp(tmp_path, pid=_dead_pid(), size=10)
    b = _temp(tmp_path / "step=3", pid=_dead_pid(), size=20)
    assert sorted(remove_stale_temps(tmp_path, dry_run=True)) == sorted([(a, 10), (b, 20)])
    assert a.exists() and b.exists()
    assert sorted(remove_stale_temps(tmp_path)) == sorted([(a, 10), (b, 20)])
    assert not a.exists() and not b.exists()
    assert remove_stale_temps(tmp_path) == []
    with pytest.raises(FileNotFoundError):
        find_temps(tmp_path / "missing")


def test_directory_is_fsynced_after_rename(
    tmp_path: Path, small_rollouts: pa.Table, monkeypatch: pytest.MonkeyPatch
) -> None:
    synced: list[bool] = []
    real = os.fsync

    def spy(fd: int) -> None:
        synced.append(stat.S_ISDIR(os.fstat(fd).st_mode))
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    write_rollouts(small_rollouts, tmp_path / "r.parquet")
    assert synced == [False, True]  # the file, then its directory
    synced.clear()
    write_rollouts(small_rollouts, tmp_path / "root", step=0)
    assert synced == [False, True]


def test_fifo_is_refused(tmp_path: Path) -> None:
    fifo = tmp_path / "f.parquet"
    os.mkfifo(fifo)
    with pytest.raises(SchemaError, match="FIFO") as exc:
        rollout_files(fifo)
    assert exc.value.path == str(fifo)
    with pytest.raises(SchemaError, match="FIFO") as exc:
        read_rollouts(fifo)
    assert exc.value.path == str(fifo)
