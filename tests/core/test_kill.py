"""SIGKILL a writer at random moments: no partial file under a final name, no leftover temps.

A real child process writes a ~32 MiB rollout file over and over (replacing one
file and adding step parts); the test kills it with SIGKILL at random moments,
several times, and checks after each kill that every visible file is complete
and that the next write to the directory removed the dead writers' temps.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from r3arrow.io import TempFile, find_temps, read_rollouts, write_rollouts
from r3arrow.spec import RouteSpec
from r3arrow.testing import assert_rollouts_equal, random_rollouts

REPO = Path(__file__).resolve().parents[2]
SPEC = RouteSpec(num_layers=48, topk=8, num_experts=128)
SHAPES = [(1024, 1024, 2047)] * 40  # 40 x 2047 tokens x 384 B ≈ 31 MiB of routes

_WRITER = """
import sys
from pathlib import Path
import numpy as np
from r3arrow.io import write_rollouts
from r3arrow.spec import RouteSpec
from r3arrow.testing import random_rollouts

root = Path(sys.argv[1])
spec = RouteSpec(num_layers=48, topk=8, num_experts=128)
table = random_rollouts(np.random.default_rng(0), spec, [(1024, 1024, 2047)] * 40)
print("ready", flush=True)
while True:
    write_rollouts(table, root / "r.parquet")
    write_rollouts(table, root / "run", step=0)
"""


def _expected() -> pa.Table:
    return random_rollouts(np.random.default_rng(0), SPEC, SHAPES)


def _kill_writer(root: Path, delay: float) -> int:
    """Start the writer, SIGKILL it ``delay`` seconds after it is ready; return its pid."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-c", _WRITER, str(root)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    try:
        assert proc.stdout is not None and proc.stderr is not None
        line = proc.stdout.readline()
        assert line.strip() == b"ready", proc.stderr.read()
        time.sleep(delay)
        assert proc.poll() is None, proc.stderr.read()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)  # reaped: its pid names no process any more
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
    assert proc.returncode == -signal.SIGKILL
    return proc.pid


def _temps(root: Path) -> list[TempFile]:
    """The temps beside ``r.parquet`` and in the ``run`` root's partitions."""
    run = root / "run"
    return find_temps(root) + (find_temps(run) if run.exists() else [])


def _visible_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*") if p.is_file() and not p.name.startswith("."))


@pytest.mark.slow
def test_sigkill_at_random_moments_never_exposes_a_partial_file(tmp_path: Path) -> None:
    rng = np.random.default_rng(20)
    expected = _expected()
    killed: set[int] = set()
    saw_temp = False
    for delay in rng.uniform(0.05, 0.9, size=5):
        killed.add(_kill_writer(tmp_path, float(delay)))
        for f in _visible_files(tmp_path):  # every final name holds a complete file
            assert_rollouts_equal(read_rollouts(f), expected)
        saw_temp |= any(t.pid in killed for t in _temps(tmp_path))
    # the next write to each directory removes the dead writers' temps there
    small = random_rollouts(np.random.default_rng(1), SPEC, [(2, 2, 3)])
    write_rollouts(small, tmp_path / "other.parquet")
    write_rollouts(small, tmp_path / "run", step=0)
    assert [t for t in _temps(tmp_path) if t.pid in killed] == []
    assert saw_temp or not killed, "no kill landed mid-write: the test checked nothing"
