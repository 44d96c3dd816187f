"""examples/verl_loop.py runs end to end in a subprocess (embedded engine, real verl types)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip(
    "verl.protocol", reason="verl is not installed (pip install --no-deps verl==0.9.1)"
)
pytest.importorskip("httpx", reason="httpx is not installed (the client extra)")
pytest.importorskip("polars", reason="polars is not installed (the stats extra)")

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "verl_loop.py"


def test_verl_loop_example(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-W", "error", str(EXAMPLE), "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    for stage in range(1, 8):
        assert f"[{stage}/7]" in out, out
    assert "round trip exact: True" in out.split("[3/7]")[1].splitlines()[0]
    assert "the engine's rows: True" in out.split("[3/7]")[1].splitlines()[0]
    assert "round trip exact: True" in out.split("[4/7]")[1].splitlines()[0]
    assert "routed_experts" in out and "int16" in out
    if "[7/7] replay: skipped" not in out:
        assert "routing identical to the engine's" in out
    assert out.rstrip().endswith("ok"), out
    assert (tmp_path / "rollouts.parquet").stat().st_size > 0
