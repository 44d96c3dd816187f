"""r3arrow.plot: PNG heatmaps and over-step plots from the stats frames (headless)."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest
from test_stats import SPEC, make_table

pytest.importorskip("matplotlib", reason="matplotlib is not installed (the plot extra)")

from r3arrow import plot, stats
from r3arrow.errors import SchemaError

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    """(width, height) from the IHDR chunk; asserts a well-formed PNG header."""
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE
    assert data[12:16] == b"IHDR"
    assert data.rstrip(b"\x00")[-8:-4] == b"IEND"
    width, height = struct.unpack(">II", data[16:24])
    return int(width), int(height)


@pytest.fixture(scope="module")
def by_step() -> tuple[pl.DataFrame, dict[int, stats.RouteAgreement]]:
    rng = np.random.default_rng(5)
    tables = [
        make_table(rng, SPEC, [(4, 60, 63), (9, 30, 38)], tag=f"s{s}", trainer_flip=0.1 + 0.2 * i)
        for i, s in enumerate((0, 10, 20, 30))
    ]
    load = pl.concat(
        [
            stats.expert_load(t).select(pl.lit(s, dtype=pl.Int64).alias("step"), pl.all())
            for s, t in zip((0, 10, 20, 30), tables, strict=True)
        ]
    )
    agreement = {
        s: stats.route_agreement(t, "trainer_routes")
        for s, t in zip((0, 10, 20, 30), tables, strict=True)
    }
    return load, agreement


def test_expert_load_heatmap(
    tmp_path: Path, by_step: tuple[pl.DataFrame, dict[int, stats.RouteAgreement]]
) -> None:
    load, _ = by_step
    one = load.filter(pl.col("step") == 0).drop("step")
    out = plot.plot_expert_load(one, tmp_path / "sub" / "load.png")
    assert out == tmp_path / "sub" / "load.png"
    width, height = png_size(out)
    assert 600 <= width <= 2500 and 300 <= height <= 1600
    assert out.stat().st_size > 10_000
    # A step column is summed over: same picture as the summed frame.
    summed = plot.plot_expert_load(load, tmp_path / "all.png")
    total = load.group_by("layer", "expert").agg(pl.col("tokens").sum()).sort("layer", "expert")
    again = plot.plot_expert_load(total, tmp_path / "total.png")
    assert summed.read_bytes() == again.read_bytes()
    assert summed.read_bytes() != out.read_bytes()


def test_imbalance_over_steps(
    tmp_path: Path, by_step: tuple[pl.DataFrame, dict[int, stats.RouteAgreement]]
) -> None:
    load, _ = by_step
    a = plot.plot_imbalance(load, tmp_path / "imb.png")
    b = plot.plot_imbalance(stats.load_summary(load), tmp_path / "imb2.png")
    assert a.read_bytes() == b.read_bytes()  # load frame or its summary: same plot
    width, height = png_size(a)
    assert width >= 600 and height >= 500
    c = plot.plot_imbalance(load, tmp_path / "cv.png", metric="cv")
    assert c.read_bytes() != a.read_bytes()
    with pytest.raises(SchemaError, match="step column"):
        plot.plot_imbalance(load.drop("step"), tmp_path / "x.png")
    with pytest.raises(ValueError, match="metric"):  # argument misuse: a builtin
        plot.plot_imbalance(load, tmp_path / "x.png", metric="nope")


def test_agreement_over_steps(
    tmp_path: Path, by_step: tuple[pl.DataFrame, dict[int, stats.RouteAgreement]]
) -> None:
    _, agreement = by_step
    a = plot.plot_agreement(agreement, tmp_path / "agr.png")
    b = plot.plot_agreement(stats.agreement_over_steps(agreement), tmp_path / "agr2.png")
    assert a.read_bytes() == b.read_bytes()
    width, height = png_size(a)
    assert width >= 600 and height >= 500
    assert a.stat().st_size > 10_000


def test_bad_inputs(
    tmp_path: Path, by_step: tuple[pl.DataFrame, dict[int, stats.RouteAgreement]]
) -> None:
    load, _ = by_step
    with pytest.raises(ValueError, match=r"\.png"):
        plot.plot_expert_load(load, tmp_path / "load.jpg")
    with pytest.raises(SchemaError, match="expert_load frame"):
        plot.plot_expert_load(load.drop("tokens"), tmp_path / "load.png")
    with pytest.raises(SchemaError, match="agreement_over_steps"):
        plot.plot_agreement(load, tmp_path / "agr.png")
    assert not list(tmp_path.iterdir())


def _load_frame(rng: np.random.Generator, layers: int, experts: int) -> pl.DataFrame:
    counts = rng.poisson(rng.gamma(1.0, 50.0, size=(layers, experts)))
    counts[0, :2] = 0  # dead experts
    return pl.DataFrame(
        {
            "layer": pl.Series(np.repeat(np.arange(layers) * 2 + 1, experts), dtype=pl.Int32),
            "expert": pl.Series(np.tile(np.arange(experts), layers), dtype=pl.Int32),
            "tokens": pl.Series(counts.reshape(-1), dtype=pl.Int64),
        }
    )


@pytest.mark.parametrize("shape", [(1, 4), (3, 8), (48, 128)])
def test_heatmap_text_stays_inside_the_figure(tmp_path: Path, shape: tuple[int, int]) -> None:
    """Nothing is clipped: a label running past an edge leaves ink on the image border."""
    from matplotlib.image import imread

    out = plot.plot_expert_load(
        _load_frame(np.random.default_rng(1), *shape), tmp_path / "load.png"
    )
    rgb = imread(out)[..., :3]
    border = np.concatenate([rgb[0], rgb[-1], rgb[:, 0], rgb[:, -1]])
    assert (border.min(axis=1) > 0.9).all(), "ink on the border: a label is cut off"


def test_disagreement_one_step_and_over_steps(
    tmp_path: Path, by_step: tuple[pl.DataFrame, dict[int, stats.RouteAgreement]]
) -> None:
    _, agreement = by_step
    one = plot.plot_disagreement({10: agreement[10]}, tmp_path / "one.png")
    width, height = png_size(one)
    assert 600 <= width <= 2500 and 300 <= height <= 1600
    many = plot.plot_disagreement(agreement, tmp_path / "many.png", title="t")
    assert png_size(many)[1] > height  # lines over steps above a layer x step heatmap
    with pytest.raises(ValueError, match="at least one step"):
        plot.plot_disagreement({}, tmp_path / "none.png")
    with pytest.raises(ValueError, match=r"\.png"):
        plot.plot_disagreement(agreement, tmp_path / "x.jpg")


def test_dead_experts_stand_apart_from_cold_ones() -> None:
    """The heatmap's colours (its RGBA data, not pixels): 0 tokens has its own colour, far
    from every colour of the scale; a 1/27-of-mean expert sits at the scale's clipped end."""
    cold = [0, 1, 540, 4] + [11] * 28  # mean 27: dead, 1/27 of the mean, 20x, the rest
    load = pl.DataFrame(
        {
            "layer": pl.Series(np.repeat([1, 3], 32), dtype=pl.Int32),
            "expert": pl.Series(np.tile(np.arange(32), 2), dtype=pl.Int32),
            "tokens": pl.Series(cold + [8] * 32, dtype=pl.Int64),
        }
    )
    image = plot._load_image(load)
    assert image.lim == 4 and image.rgba.shape == (2, 32, 4)
    scale = plot._load_scale()(np.linspace(0.0, 1.0, 256))[:, :3]
    dead = image.rgba[0, 0, :3]
    assert np.linalg.norm(scale - dead, axis=1).min() > 0.5  # no load is drawn near dead
    np.testing.assert_allclose(image.rgba[0, 1, :3], scale[0])  # 1/27: the clipped cold end
    np.testing.assert_allclose(image.rgba[0, 2, :3], scale[-1])  # 20x: the clipped hot end
    assert (image.rgba[1, :, :3] > 0.9).all()  # balanced: white


def _mismatch(k3: float) -> dict[str, float]:
    """A `logprob_mismatch`-shaped dict (only k3 matters to the figure)."""
    return {
        "tokens": 40.0,
        "k1": 0.0,
        "k2": 0.0,
        "k3": k3,
        "abs_mean": 0.0,
        "abs_max": 0.0,
        "frac_abs_gt_ln2": 0.0,
        "token_mult_prob_error": 1.0,
        "js_divergence": 0.0,
    }


@pytest.fixture
def figures(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """Every matplotlib Figure saved while the test runs (still written to its file)."""
    from matplotlib.figure import Figure

    saved: list[Any] = []
    original = Figure.savefig

    def record(self: Figure, *args: Any, **kwargs: Any) -> None:
        saved.append(self)
        original(self, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", record)
    return saved


def test_mismatch_beside_disagreement_one_step_draws_both_bars_per_source(
    tmp_path: Path, figures: list[Any]
) -> None:
    native = stats.RouteAgreement((1, 2), 2, 20, np.array([19, 18]), np.array([39, 38]), 17)
    replay = stats.RouteAgreement((1, 2), 2, 20, np.array([20, 20]), np.array([40, 40]), 20)
    out = plot.plot_mismatch(
        {"native": {3: _mismatch(2e-4)}, "replay": {3: _mismatch(5e-5)}},
        {"native": {3: native}, "replay": {3: replay}},
        tmp_path / "m.png",
    )
    assert png_size(out)[0] >= 600
    (fig,) = figures
    ax, right = fig.axes  # the disagreement axis and its twin for the mismatch
    assert [t.get_text() for t in ax.get_xticklabels()] == ["native", "replay"]
    assert [round(p.get_height(), 6) for p in ax.patches] == [0.15, 0.0]  # 3 of 20 tokens
    assert [p.get_height() for p in right.patches] == [2e-4, 5e-5]
    labels = [t.get_text() for t in [*ax.texts, *right.texts]]  # the bar labels
    assert labels == ["15.00%", "0.00%", "0.0002", "5e-05"]
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == [
        "routing differs (tokens, ≥ 1 layer)",
        "log-prob k3",
    ]
    assert right.get_ylabel() == "log-prob k3 (loss tokens)"


def test_mismatch_beside_disagreement_over_steps_draws_a_line_pair_per_source(
    tmp_path: Path,
    by_step: tuple[pl.DataFrame, dict[int, stats.RouteAgreement]],
    figures: list[Any],
) -> None:
    _, agreement = by_step
    steps = sorted(agreement)
    lp = {"r3": {s: _mismatch(0.01 * (i + 1)) for i, s in enumerate(steps)}}
    lp["other"] = {steps[0]: _mismatch(0.5)}  # one step only, and no routing of its own
    plot.plot_mismatch(lp, {"r3": agreement}, tmp_path / "m.png", metric="k3", title="t")
    (fig,) = figures
    ax, right = fig.axes
    assert ax.get_title() == "t"
    solid = {line.get_label(): line for line in ax.get_lines()}
    dashed = {line.get_label(): line for line in right.get_lines()}
    assert set(solid) == {"r3: routing differs (tokens, ≥ 1 layer)",
                          "other: routing differs (tokens, ≥ 1 layer)"}  # fmt: skip
    assert set(dashed) == {"r3: log-prob k3", "other: log-prob k3"}
    r3_routing = solid["r3: routing differs (tokens, ≥ 1 layer)"].get_ydata()
    want = [agreement[s].differing_fraction for s in steps]
    np.testing.assert_allclose(np.asarray(r3_routing, float), want)
    np.testing.assert_allclose(
        np.asarray(dashed["r3: log-prob k3"].get_ydata(), float), [0.01, 0.02, 0.03, 0.04]
    )
    other = np.asarray(dashed["other: log-prob k3"].get_ydata(), float)
    assert other[0] == 0.5 and np.isnan(other[1:]).all()
    assert np.isnan(np.asarray(solid["other: routing differs (tokens, ≥ 1 layer)"].get_ydata(),
                               float)).all()  # fmt: skip
    assert all(line.get_linestyle() == "--" for line in dashed.values())
    assert all(line.get_linestyle() == "-" for line in solid.values())
    (legend,) = fig.legends
    assert len(legend.get_texts()) == 4


def test_mismatch_plot_misuse(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="at least one source"):
        plot.plot_mismatch({}, {}, tmp_path / "m.png")
    with pytest.raises(ValueError, match="metric: expected one of"):
        plot.plot_mismatch({"a": {0: _mismatch(0.1)}}, {}, tmp_path / "m.png", metric="tokens")
    with pytest.raises(ValueError, match=r"\.png"):
        plot.plot_mismatch({"a": {0: _mismatch(0.1)}}, {}, tmp_path / "m.svg")
