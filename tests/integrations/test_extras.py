"""One missing-extra message everywhere: every subpackage and CLI command with its optional
dependency hidden in a fresh interpreter (a meta-path finder installed by a sitecustomize on
``PYTHONPATH``; nothing is uninstalled). The message names what needs the package and the
extra that installs it (``pyproject.toml``); the CLI prints it as its one error line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import r3arrow
from r3arrow.spec import RouteSpec
from r3arrow.testing import random_rollouts

SPEC = RouteSpec(num_layers=2, topk=2, num_experts=4)

_HIDE = textwrap.dedent(
    """
    import os, sys

    _HIDDEN = set(filter(None, os.environ.get("R3ARROW_TEST_HIDE", "").split(",")))


    class _Hide:
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] in _HIDDEN:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None


    sys.meta_path.insert(0, _Hide())
    """
)


def _run(tmp_path: Path, hide: str, args: list[str]) -> subprocess.CompletedProcess[str]:
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(_HIDE)
    env = {**os.environ, "PYTHONPATH": str(site), "R3ARROW_TEST_HIDE": hide}
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=env, timeout=120, check=False
    )


def _message(feature: str, package: str, extra: str) -> str:
    return f"{feature} needs {package}: pip install 'r3arrow[{extra}]'"


_CATCH = """
import json, sys
try:
    {code}
except ImportError as exc:
    print(json.dumps({{"message": str(exc), "cause": type(exc.__cause__).__name__}}))
    sys.exit(3)
"""


@pytest.mark.parametrize(
    ("code", "hide", "feature", "extra"),
    [
        ("import r3arrow.stats", "polars", "r3arrow.stats", "stats"),
        ("import r3arrow; r3arrow.stats", "polars", "r3arrow.stats", "stats"),
        ("import r3arrow.plot", "matplotlib", "r3arrow.plot", "plot"),
        ("import r3arrow.plot", "polars", "r3arrow.plot", "plot"),
        ("import r3arrow.collate", "torch", "r3arrow.collate", "torch"),
        ("import r3arrow.megatron", "torch", "r3arrow.megatron", "megatron"),
        ("import r3arrow.client", "httpx", "r3arrow.client", "client"),
        ("import r3arrow.rollout", "httpx", "r3arrow.client", "client"),
        ("import r3arrow.adapters.verl", "torch", "r3arrow.adapters.verl", "torch"),
        ("import r3arrow.testing.demo", "torch", "r3arrow demo", "all"),
        ("import r3arrow.ray as r; r.rollout_dataset('x')", "ray", "r3arrow.ray", "ray"),
        (
            "import r3arrow.ray as r; r.shard_microbatches('x', dp_size=1, pp_layers=[[0]])",
            "ray",
            "r3arrow.ray",
            "ray",
        ),
        (
            "import r3arrow; from r3arrow.adapters.skyrl import to_training_inputs as f; "
            "f(r3arrow.read_rollouts(sys.argv[1]), tensors='torch')",
            "torch",
            "r3arrow.adapters.skyrl",
            "torch",
        ),
    ],
)
def test_a_hidden_dependency_names_its_extra(
    tmp_path: Path, code: str, hide: str, feature: str, extra: str
) -> None:
    table = random_rollouts(np.random.default_rng(0), SPEC, [(2, 2, 3)])
    path = r3arrow.write_rollouts(table, tmp_path / "r.parquet")
    proc = _run(tmp_path, hide, ["-c", _CATCH.format(code=code), str(path)])
    assert proc.returncode == 3, proc.stdout + proc.stderr
    got = json.loads(proc.stdout)
    assert got == {"message": _message(feature, hide, extra), "cause": "ModuleNotFoundError"}


_EVERY = "polars,torch,httpx,matplotlib,tqdm,ray,megatron,numba"


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    """A rollout root with a ``train_routes`` column (what ``diagnose`` reads without
    diagnostics), a JSON-lines dump for ``convert``."""
    table = random_rollouts(np.random.default_rng(1), SPEC, [(2, 3, 4), (3, 2, 4)])
    table = table.append_column("train_routes", table.column("routes"))
    r3arrow.write_rollouts(table, tmp_path / "run", step=0)
    np.save(tmp_path / "t0.npy", np.array([[[0, 1], [2, 3]]] * 3, dtype=np.int32))
    line = {"prompt_ids": [1, 2], "response_ids": [3, 4], "routes_npy": "t0.npy"}
    (tmp_path / "dump.jsonl").write_text(json.dumps(line) + "\n")
    return tmp_path


@pytest.mark.parametrize(
    ("args", "hide", "feature", "extra"),
    [
        (["demo", "--out", "{tmp}/demo", "--no-progress"], "torch", "r3arrow demo", "all"),
        (["stats", "{tmp}/run"], "polars", "r3arrow.stats", "stats"),
        (["stats", "{tmp}/run", "--plot", "{tmp}/l.png"], "matplotlib", "r3arrow.plot", "plot"),
        (["diagnose", "{tmp}/run"], "polars", "r3arrow.stats", "stats"),
        (["diagnose", "{tmp}/run", "--png", "{tmp}/d.png"], "matplotlib", "r3arrow.plot", "plot"),
        (
            [
                *("convert", "{tmp}/dump.jsonl", "--out", "{tmp}/c.parquet", "--format", "npy"),
                *("--num-layers", "2", "--topk", "2", "--num-experts", "4"),
            ],
            "tqdm",
            "r3arrow convert",
            "cli",
        ),
    ],
)
def test_cli_commands_name_the_extra_in_one_line(
    run_dir: Path, args: list[str], hide: str, feature: str, extra: str
) -> None:
    argv = [a.format(tmp=run_dir) for a in args]
    proc = _run(run_dir, hide, ["-m", "r3arrow", *argv])
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert proc.stderr == f"r3arrow: error: {_message(feature, hide, extra)}\n"


@pytest.mark.parametrize(
    "args",
    [
        ["inspect", "{tmp}/run"],
        ["export", "{tmp}/run", "{tmp}/p.parquet", "--portable"],
        ["gc", "{tmp}/run", "--dry-run"],
    ],
)
def test_core_commands_need_no_extra(run_dir: Path, args: list[str]) -> None:
    proc = _run(run_dir, _EVERY, ["-m", "r3arrow", *(a.format(tmp=run_dir) for a in args)])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stderr == ""
