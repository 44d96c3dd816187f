"""examples/skyrl_loop.py and examples/slime_loop.py run end to end as scripts.

Each runs in its own interpreter (as a user would run it) on the embedded engine, real
HTTP on 127.0.0.1, real Parquet files under ``tmp_path`` and, where megatron-core is
installed, real ``TopKRouter``s; it prints one line per stage and exits 0 only when every
check passed.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["skyrl_loop", "slime_loop"])
def test_example_runs(name: str, tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "examples" / f"{name}.py"), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=180,
        cwd=tmp_path,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = proc.stdout.splitlines()
    for stage in range(1, 9):
        assert any(line.startswith(f"[{stage}/8]") for line in lines), proc.stdout
    assert lines[-1].endswith(": ok"), proc.stdout
    assert (tmp_path / "rollouts.parquet").is_file()
    if importlib.util.find_spec("megatron") is not None:
        assert "routing identical to the engine's" in proc.stdout
