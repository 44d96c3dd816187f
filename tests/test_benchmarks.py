"""The benchmarks' shared ``--against REV``: both runs, matched tables, ratios."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parents[1] / "benchmarks"


def _common() -> Any:
    """``benchmarks/_common.py``, loaded from its file (the folder is not a package)."""
    spec = importlib.util.spec_from_file_location("_bench_common", BENCH_DIR / "_common.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_COMMON = _common()
markdown_tables = _COMMON.markdown_tables
ratio_tables = _COMMON.ratio_tables


def test_ratio_tables_match_rows_by_label_and_divide_numbers() -> None:
    this = "| case | ms | x base |\n|---|---|---|\n| a | 2.0 | 1,000 |\n| b | 3 | n/a |\n"
    other = (
        "| case | ms | x base |\n|---|---|---|\n| b | 6 | n/a |\n| a | 4.0 | 500 |\n| c | 1 | 1 |\n"
    )
    assert markdown_tables(this) == (
        [(["case", "ms", "x base"], [["a", "2.0", "1,000"], ["b", "3", "n/a"]])]
    )
    assert markdown_tables(ratio_tables(this, other)) == [
        (["case", "ms", "x base"], [["a", "0.50", "2.00"], ["b", "0.50", "n/a"]])
    ]
    # other headers: not comparable, nothing printed
    assert ratio_tables(this, other.replace("ms", "s")) == ""


def test_against_runs_the_script_on_both_checkouts(tmp_path: Path) -> None:
    """A script of this folder's kind, run with ``--against DIR``: once with this tree's r3arrow,
    once with the r3arrow found in DIR, and the ratio of their tables."""
    other = tmp_path / "other"
    (other / "r3arrow").mkdir(parents=True)
    (other / "r3arrow" / "__init__.py").write_text("SPEED = 4.0\n")
    script = BENCH_DIR / "_against_probe.py"
    script.write_text(
        "import r3arrow\n"
        "from _common import markdown_table, parser\n"
        "args = parser('probe').parse_args()\n"
        "speed = getattr(r3arrow, 'SPEED', 2.0)\n"
        "print(markdown_table([['copy', speed]], ['case', 'GB/s']))\n"
    )
    try:
        proc = subprocess.run(
            [sys.executable, str(script), "--quick", "--against", str(other)],
            cwd=BENCH_DIR,
            capture_output=True,
            text=True,
            timeout=120,
        )
    finally:
        script.unlink()
    assert proc.returncode == 0, proc.stderr
    sections = proc.stdout.split("### ")
    assert sections[1].startswith("this tree") and "| copy | 2" in sections[1]
    assert sections[2].startswith(f"--against {other}") and "| copy | 4" in sections[2]
    assert markdown_tables(sections[3]) == [(["case", "GB/s"], [["copy", "0.50"]])]
