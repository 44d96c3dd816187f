"""`r3arrow demo` end to end at a small size.

engine → rollouts → Parquet → stats → collation → replay → replay diagnostics.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import orjson
import pyarrow.compute as pc
import pytest

import r3arrow
from r3arrow.cli import EXIT_OK, main
from r3arrow.testing.demo import DemoConfig, DemoResult, run_demo

HAVE_MEGATRON = importlib.util.find_spec("megatron") is not None
if HAVE_MEGATRON:
    # Import it once, quietly, as test_megatron.py does: megatron-core 0.16.1 and torch emit
    # DeprecationWarnings at import time (third-party noise), and every warning is an error here.
    pytest.importorskip("megatron.core")


def test_demo_small_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = DemoConfig(
        groups=3,
        samples=3,
        turns=2,
        max_tokens=6,
        out_dir=tmp_path,
        progress=False,
        microbatch_tokens=256,
    )
    result = run_demo(cfg)
    out = capsys.readouterr().out
    assert result.ok
    # every trajectory has its turns' tokens and a ragged route column of captured rows
    table = result.table
    assert table.num_rows == 9
    r3arrow.validate_rollouts(table)
    # dynamic sampling kept whole groups with varied rewards, in order
    kept = result.kept
    for group in set(kept.column("group_id").to_pylist()):
        rewards = [
            r
            for g, r in zip(
                kept.column("group_id").to_pylist(), kept.column("reward").to_pylist(), strict=True
            )
            if g == group
        ]
        assert len(set(rewards)) > 1 or kept.num_rows == table.num_rows
    back = r3arrow.read_rollouts(result.parquet)
    assert back.equals(kept)
    assert result.heatmap is not None and result.heatmap.read_bytes()[:4] == b"\x89PNG"
    assert result.microbatches >= 1
    assert "[5/7] megatron collation" in out
    if HAVE_MEGATRON:
        captured = int(r3arrow.table.captured_lengths(kept).sum())
        assert result.replay_tokens == captured
        assert result.replay_mismatches == 0
        assert "routing identical to the engine's" in out
        _check_diagnostics(result, tmp_path, out, capsys)


def _check_diagnostics(
    result: DemoResult, out_dir: Path, out: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Stage 7: bfloat16 routers disagree measurably, float32 ones do not; persisted."""
    captured = int(r3arrow.table.captured_lengths(result.kept).sum())
    native, control = result.native_agreement, result.control_agreement
    assert native.tokens == control.tokens == captured
    assert native.layers == (1, 2, 3)  # the engine's router layers, global ids
    assert native.all_identical < native.tokens  # bfloat16 flips some top-k boundaries
    assert control.all_identical == control.tokens  # float32: the engine's choice exactly
    assert "[7/7] replay diagnostics" in out and "R3-paper quantities" in out
    assert "replayed routing identical to the engine's; probe matches" in out
    assert result.diagnostics is not None and result.diagnostics.is_relative_to(out_dir)
    assert main(["diagnose", str(out_dir), "--json"]) == EXIT_OK
    info = orjson.loads(capsys.readouterr().out)
    assert info["source"] == "native_vs_replay"
    assert info["total"]["tokens"] == captured
    assert info["total"]["tokens_differ_any_layer"] == pytest.approx(native.differing_fraction)
    assert 0 < info["total"]["decisions_differ"] < 0.1
    png = out_dir / "diag.png"
    assert main(["diagnose", str(out_dir), "--png", str(png)]) == EXIT_OK
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert "tokens differing on at least one layer" in capsys.readouterr().out
    _check_mismatch(result, out_dir, out, capsys)


def _check_mismatch(
    result: DemoResult, out_dir: Path, out: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Stage 7, R3 on the log-probs: the bfloat16 trainer-side forward of the whole model,
    native routing vs the rollout's routes replayed, against the engine's log-probs."""
    captured = int(r3arrow.table.captured_lengths(result.kept).sum())
    loss_tokens = pc.sum(pc.list_flatten(result.kept.column("loss_mask"))).as_py()
    native, replay = result.trainer_agreement["native"], result.trainer_agreement["replay"]
    assert native.tokens == replay.tokens == captured
    assert replay.all_identical == replay.tokens  # replayed: routing disagreement 0
    assert 0 < native.differing_fraction < 0.2  # bfloat16 flips near-tied top-k boundaries
    lp_n, lp_r = result.mismatch["native"], result.mismatch["replay"]
    assert lp_n["tokens"] == lp_r["tokens"] == loss_tokens > 0
    # on the demo's seed, replay's mismatch is strictly smaller than native's (what is left
    # is bfloat16 rounding), on every per-token measure
    for key in ("k3", "k2", "abs_mean", "abs_max", "js_divergence"):
        assert 0 < lp_r[key] < lp_n[key], key
    assert 1 < lp_r["token_mult_prob_error"] < lp_n["token_mult_prob_error"]
    # the printed table: rows native / replay, routing disagreement beside the mismatch
    assert "mode     routing differs loss tokens         k3    |Δ|>ln2   mult_err" in out
    for mode, agreement, lp in (("native", native, lp_n), ("replay", replay, lp_r)):
        cells = "".join(
            f"{lp[k]:>11.4g}"
            for k in ("k3", "frac_abs_gt_ln2", "token_mult_prob_error", "js_divergence", "abs_max")
        )
        row = f"    {mode:<8}{agreement.differing_fraction:>16.2%}{loss_tokens:>12}{cells}"
        assert row in out.splitlines()
    # r3arrow diagnose pairs each mismatch with its own routing, and shows both
    assert main(["diagnose", str(out_dir), "--json"]) == EXIT_OK
    rows = orjson.loads(capsys.readouterr().out)["logprob_mismatch"]
    assert [(r["step"], r["source"], r["routing"]["source"]) for r in rows] == [
        (0, "trainer_native", "trainer_native_routing"),
        (0, "trainer_replay", "trainer_replay_routing"),
    ]
    for r, agreement, lp in ((rows[0], native, lp_n), (rows[1], replay, lp_r)):
        assert r["routing"]["tokens"] == captured
        assert r["routing"]["tokens_differ_any_layer"] == pytest.approx(
            agreement.differing_fraction
        )
        assert r["k3"] == pytest.approx(lp["k3"]) and r["tokens"] == loss_tokens
    assert main(["diagnose", str(out_dir)]) == EXIT_OK
    text = capsys.readouterr().out
    assert "log-prob mismatch beside routing disagreement" in text
    assert f"trainer_native  trainer_native_routing  {native.differing_fraction:>8.2%}" in text
    assert f"trainer_replay  trainer_replay_routing  {0:>8.2%}" in text


def test_demo_without_megatron_skips_the_megatron_stages(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import r3arrow.testing.demo

    monkeypatch.setattr(r3arrow.testing.demo, "_megatron_available", lambda: False)
    cfg = DemoConfig(
        groups=2, samples=2, turns=1, max_tokens=3, out_dir=tmp_path, progress=False
    )  # fmt: skip
    assert run_demo(cfg).ok
    out = capsys.readouterr().out
    assert "[6/7] replay: skipped (megatron-core not installed" in out
    assert "[7/7] replay diagnostics: skipped (megatron-core not installed)" in out
    assert not (tmp_path / "_diagnostics").exists()


def test_demo_cli_flags(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(
        [
            "demo",
            "--groups",
            "2",
            "--samples",
            "2",
            "--turns",
            "2",
            "--max-tokens",
            "4",
            "--out",
            str(tmp_path / "d"),
            "--no-progress",
            "--no-replay",
        ]
    )
    assert code == EXIT_OK
    out = capsys.readouterr().out
    assert "replay: skipped (--no-replay)" in out
    assert "[7/7] replay diagnostics: skipped (--no-replay)" in out
    assert (tmp_path / "d" / "rollouts.parquet").exists()


def test_demo_shape_flags_shape_the_embedded_engine(tmp_path: Path) -> None:
    code = main(
        [
            "demo",
            "--groups",
            "1",
            "--samples",
            "2",
            "--turns",
            "1",
            "--max-tokens",
            "3",
            "--out",
            str(tmp_path),
            "--no-progress",
            "--no-replay",
            "--num-layers",
            "3",
            "--topk",
            "3",
            "--num-experts",
            "300",
            "--moe-layers",
            "0",
            "2",
        ]
    )
    assert code == EXIT_OK
    spec = r3arrow.table.route_spec(r3arrow.read_rollouts(tmp_path / "rollouts.parquet"))
    assert (spec.num_layers, spec.topk, spec.num_experts) == (3, 3, 300)
    assert spec.router_layers == (0, 2) and spec.dtype == "uint16"


def test_demo_against_an_engine_url_probes_the_route_shape(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Without --num-layers/--topk the demo asks the engine for the shape (`probe_spec`)."""
    from r3arrow.testing.engine import EngineServer, ReferenceEngine, TinyMoEConfig

    engine = ReferenceEngine(TinyMoEConfig(num_layers=3, topk=3))
    cfg = DemoConfig(
        groups=1, samples=2, turns=1, max_tokens=3, out_dir=tmp_path, num_experts=8,
        progress=False, replay=False,
    )  # fmt: skip
    with EngineServer(engine) as server:
        result = run_demo(dataclasses.replace(cfg, engine_url=server.url))
    assert result.ok and "external engine" in capsys.readouterr().out
    spec = r3arrow.table.route_spec(result.table)
    assert (spec.num_layers, spec.topk, spec.num_experts) == (3, 3, 8)
    assert spec.router_layers == (1, 2)  # layer 0 is dense: probed from its all-zero rows


@pytest.mark.skipif(not HAVE_MEGATRON, reason="megatron-core is not installed")
def test_demo_cli_against_an_engine_url_without_shape_flags_replays(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`r3arrow demo --engine-url URL`, no shape flags: the probe gives num_experts=None (as
    vLLM's does), and the replay stage sizes its routers from the routes observed."""
    from r3arrow.testing.engine import EngineServer, ReferenceEngine, TinyMoEConfig

    engine = ReferenceEngine(TinyMoEConfig(num_layers=3, topk=2, num_experts=8))
    with EngineServer(engine) as server:
        code = main(
            [
                "demo", "--engine-url", server.url, "--groups", "2", "--samples", "2",
                "--turns", "1", "--max-tokens", "4", "--out", str(tmp_path), "--no-progress",
            ]
        )  # fmt: skip
    out = capsys.readouterr().out
    assert code == EXIT_OK, out
    spec = r3arrow.table.route_spec(r3arrow.read_rollouts(tmp_path / "rollouts.parquet"))
    assert spec.num_experts is None  # nothing told the demo the expert count
    table = r3arrow.read_rollouts(tmp_path / "rollouts.parquet")
    flat, _ = r3arrow.table.flat_routes(table)
    sized = max(int(flat[:, list(spec.router_layers)].max()) + 1, spec.topk)
    assert f"routers sized from the routes observed ({sized} = max id + 1" in out
    assert "[6/7] replay into" in out and "routing identical to the engine's" in out
    assert "[7/7] replay diagnostics: skipped (needs the embedded engine's" in out


def test_demo_ctrl_c_stops_between_stages_without_a_traceback(tmp_path: Path) -> None:
    """SIGINT during stage 1: the demo stops before stage 2, exits 130, prints no traceback."""
    import signal
    import subprocess
    import sys

    argv = [sys.executable, "-m", "r3arrow", "demo", "--out", str(tmp_path / "d")]
    argv += ["--groups", "8", "--samples", "4", "--turns", "4", "--no-progress", "--no-replay"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    first = proc.stdout.readline()
    assert first.startswith("[1/7]"), first
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, (out, err)
    assert "[2/7]" not in out
    assert "Traceback" not in err
    assert "interrupted" in err
