"""The benchmarks' shared ``--against REV`` (both runs, matched tables, ratios) and the SkyRL
#1912 checkout loader of ``_skyrl_real.py``."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

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


def _skyrl_real() -> Any:
    """``benchmarks/_skyrl_real.py``, loaded from its file."""
    spec = importlib.util.spec_from_file_location("_bench_skyrl_real", BENCH_DIR / "_skyrl_real.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_LOADER_PROBE = """
import sys
sys.path.insert(0, sys.argv[1])
import _skyrl_real as R
path, note = R.checkout_dir(sys.argv[2])
sk, note = R.load(path, note, R.CHAIN)
assert sk is not None, note
for fn in (sk.preprocess.convert_prompts_responses_to_batch_tensors,
           sk.preprocess.make_router_padding_mask,
           sk.token_metadata.build_token_metadata_layout,
           sk.replay_utils.setup_per_microbatch_replay_forward):
    print(fn.__name__, fn.__code__.co_filename)
"""


def test_skyrl_loader_imports_the_pr_heads_four_functions_from_the_given_dir(
    tmp_path: Path,
) -> None:
    """The chain's SkyRL side runs SkyRL #1912's own code from a checkout of the PR head
    (extracted here from the mirror into ``tmp_path``), never the installed package."""
    pytest.importorskip("torch")
    pytest.importorskip("jaxtyping")
    pytest.importorskip("megatron.core")
    real = _skyrl_real()
    mirror = Path(os.environ.get("SKYRL_MIRROR", real.DEFAULT_MIRROR))
    if not mirror.is_dir():
        pytest.skip(f"no SkyRL mirror at {mirror}")
    archive = subprocess.run(
        ["git", f"--git-dir={mirror}", "archive", real.SKYRL_COMMIT, "skyrl"],
        capture_output=True,
        check=False,
    )
    if archive.returncode != 0:
        pytest.skip(f"the mirror lacks {real.SKYRL_COMMIT}")
    subprocess.run(["tar", "-x", "-C", str(tmp_path)], input=archive.stdout, check=True)
    proc = subprocess.run(
        [sys.executable, "-c", _LOADER_PROBE, str(BENCH_DIR), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = dict(line.split(" ", 1) for line in proc.stdout.strip().splitlines())
    assert sorted(found) == [
        "build_token_metadata_layout",
        "convert_prompts_responses_to_batch_tensors",
        "make_router_padding_mask",
        "setup_per_microbatch_replay_forward",
    ]
    for where in found.values():
        assert Path(where).resolve().is_relative_to(tmp_path.resolve()), where


def test_skyrl_loader_says_why_without_a_checkout(tmp_path: Path) -> None:
    real = _skyrl_real()
    path, note = real.checkout_dir(str(tmp_path))
    assert path is None and "no skyrl/__init__.py" in note
    assert real.load(path, note, real.CHAIN) == (None, note)
