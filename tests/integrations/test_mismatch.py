"""`r3arrow.stats.logprob_mismatch`: hand-computed literals on small tables, paths and errors."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

import r3arrow
from r3arrow.errors import SchemaError
from r3arrow.stats import logprob_mismatch

LN2 = math.log(2.0)


def table(
    rollout: list[list[float]], train: list[list[float]], mask: list[list[int]], **extra: Any
) -> pa.Table:
    n = len(mask)
    return r3arrow.rollout_table(
        trajectory_id=[f"t{i}" for i in range(n)],
        group_id=["g"] * n,
        prompt_ids=[[1]] * n,
        response_ids=[[5] * len(m) for m in mask],
        loss_mask=mask,
        reward=[0.0] * n,
        rollout_logprobs=pa.array(rollout, pa.large_list(pa.float32())),
        train_logprobs=pa.array(train, pa.large_list(pa.float32())),
        **extra,
    )


# Row 0: Δ = [-1.0 - (-1.0), -2.0 - (-1.0), (masked)] = [0, -1]; row 1: Δ = [1.0] (masked 2nd)
# Values chosen as exact float32: -1.0, -2.0, -0.5, -1.5, -3.0, -9.0.
ROLL = [[-1.0, -1.0, -3.0], [-1.5, -0.5]]
TRAIN = [[-1.0, -2.0, -9.0], [-0.5, -9.0]]
MASK = [[1, 1, 0], [1, 0]]
D = [0.0, -1.0, 1.0]


def test_every_metric_by_hand_over_loss_masked_tokens() -> None:
    got = logprob_mismatch(table(ROLL, TRAIN, MASK))
    e, ie = math.e, 1 / math.e
    assert list(got) == [
        "tokens",
        "k1",
        "k2",
        "k3",
        "abs_mean",
        "abs_max",
        "frac_abs_gt_ln2",
        "token_mult_prob_error",
        "js_divergence",
    ]
    assert got["tokens"] == 3.0
    assert got["k1"] == pytest.approx((0 + 1 - 1) / 3)  # mean(-Δ)
    assert got["k2"] == pytest.approx((0 + 0.5 + 0.5) / 3)  # mean(Δ²/2)
    # mean(e^Δ - 1 - Δ): 0, e^-1 - 1 + 1, e - 1 - 1
    assert got["k3"] == pytest.approx((0 + ie + (e - 2)) / 3)
    assert got["abs_mean"] == pytest.approx(2 / 3)
    assert got["abs_max"] == 1.0
    assert got["frac_abs_gt_ln2"] == pytest.approx(2 / 3)  # |−1|, |1| > 0.693
    assert got["token_mult_prob_error"] == pytest.approx((1 + e + e) / 3)  # mean(e^|Δ|)

    def js(d: float) -> float:  # p_train = e^d, p_rollout = 1 (relative): m = (e^d + 1) / 2
        m = (math.exp(d) + 1) / 2
        pt, pr = math.exp(d), 1.0
        return 0.5 * (pt / m - 1 - math.log(pt / m)) + 0.5 * (pr / m - 1 - math.log(pr / m))

    assert js(0.0) == 0.0
    assert got["js_divergence"] == pytest.approx(sum(js(d) for d in D) / 3)


def test_frac_gt_ln2_threshold_and_empty_mask_gives_nan() -> None:
    got = logprob_mismatch(table([[-1.0]], [[-1.0 - 0.69]], [[1]]))
    assert got["frac_abs_gt_ln2"] == 0.0 and got["tokens"] == 1.0
    got = logprob_mismatch(table([[-1.0]], [[-1.7]], [[1]]))
    assert got["frac_abs_gt_ln2"] == 1.0
    empty = logprob_mismatch(table([[-1.0]], [[-5.0]], [[0]]))
    assert empty["tokens"] == 0.0
    assert all(math.isnan(v) for k, v in empty.items() if k != "tokens")


def test_by_step_and_overall_add_up_and_a_root_gives_the_same(tmp_path: Path) -> None:
    t0 = table(ROLL, TRAIN, MASK)
    t1 = table([[-1.0, -1.0]], [[-3.0, -1.0]], [[1, 1]])  # Δ = [-2, 0]
    per = logprob_mismatch(
        pa.concat_tables(
            [
                t0.append_column("step", pa.array([0, 0], pa.int64())),
                t1.append_column("step", pa.array([1], pa.int64())),
            ]
        ),
        by_step=True,
    )
    assert list(per) == [0, 1]
    assert per[1]["tokens"] == 2.0 and per[1]["abs_max"] == 2.0
    assert per[1]["k1"] == pytest.approx(1.0)  # mean(2, 0)
    assert per[1]["frac_abs_gt_ln2"] == 0.5
    r3arrow.write_rollouts(t0, tmp_path, step=0)
    r3arrow.write_rollouts(t1, tmp_path, step=1)
    from_root = logprob_mismatch(tmp_path, by_step=True)
    assert list(from_root) == [0, 1]
    assert all(from_root[s] == pytest.approx(per[s]) for s in per)
    overall = logprob_mismatch(tmp_path)
    assert overall["tokens"] == 5.0
    assert overall["abs_max"] == 2.0
    assert overall["k1"] == pytest.approx((0 + 1 - 1 + 2 + 0) / 5)
    assert logprob_mismatch(tmp_path, steps=[1]) == pytest.approx(per[1])


def test_bad_data_and_misuse() -> None:
    with pytest.raises(SchemaError, match="train_logprobs"):
        logprob_mismatch(table(ROLL, TRAIN, MASK).drop_columns(["train_logprobs"]))
    with pytest.raises(SchemaError, match="one value per response token") as err:
        logprob_mismatch(table([[-1.0, -1.0], [-1.0]], [[-1.0, -1.0], [-1.0, -2.0]], [[1, 1], [1]]))
    assert err.value.row == 1 and err.value.trajectory_id == "t1"
    with pytest.raises(SchemaError, match="finite") as err:
        logprob_mismatch(
            table([[-1.0, -1.0], [-1.0, float("-inf")]], [[-1.0] * 2] * 2, [[1, 1]] * 2)
        )
    assert (err.value.row, err.value.token) == (1, 1)
    # a non-finite value on a masked-out token is ignored
    ok = logprob_mismatch(table([[-1.0, float("nan")]], [[-1.0, -1.0]], [[1, 0]]))
    assert ok["tokens"] == 1.0 and ok["k3"] == 0.0
    with pytest.raises(SchemaError, match="by step"):
        logprob_mismatch(table(ROLL, TRAIN, MASK), by_step=True)
    with pytest.raises(TypeError, match="by_step"):
        logprob_mismatch(table(ROLL, TRAIN, MASK), by_step=1)  # type: ignore[call-overload]
    with pytest.raises(TypeError):
        logprob_mismatch([1, 2])


def test_stored_beside_the_routing_diagnostics_and_shown_by_diagnose(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    import numpy as np

    from r3arrow.cli import EXIT_OK, main
    from r3arrow.io import read_diagnostics, write_diagnostics
    from r3arrow.stats import RouteAgreement

    agree = RouteAgreement((0, 1), 2, 4, np.array([3, 2]), np.array([7, 6]), 2)
    lp = logprob_mismatch(table(ROLL, TRAIN, MASK))
    for step in (0, 1):
        write_diagnostics(tmp_path, step, agree)
    p = write_diagnostics(tmp_path, 1, lp)
    assert p.name == "train_vs_rollout.parquet"
    rows = read_diagnostics(tmp_path, kind="mismatch").to_pylist()
    assert [(r["step"], r["tokens"], r["source"]) for r in rows] == [(1, 3, "train_vs_rollout")]
    assert rows[0]["k3"] == pytest.approx(lp["k3"])
    assert read_diagnostics(tmp_path).num_rows == 4  # agreement rows only, by default
    assert main(["diagnose", str(tmp_path), "--json"]) == EXIT_OK
    steps = json.loads(capsys.readouterr().out)["steps"]
    assert steps[0]["mismatch"] is None
    assert steps[1]["mismatch"]["frac_abs_gt_ln2"] == pytest.approx(2 / 3)
    assert main(["diagnose", str(tmp_path), "--png", str(tmp_path / "d.png")]) == EXIT_OK
    out = capsys.readouterr().out
    assert "|Δ|>ln2" in out and "0.6667" in out
    assert (tmp_path / "d.png").stat().st_size > 0
    with pytest.raises(TypeError, match="keys"):
        write_diagnostics(tmp_path, 0, {"k3": 0.1})
    with pytest.raises(ValueError, match="kind"):
        read_diagnostics(tmp_path, kind="other")  # type: ignore[arg-type]
