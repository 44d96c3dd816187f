"""PNG plots of routing statistics (matplotlib, headless: Agg canvas, no pyplot state).

Inputs are the frames and agreements of `r3arrow.stats`; each function writes one PNG and
returns its path (a non-``.png`` path raises ``ValueError``). Needs the ``plot`` extra.
"""

from __future__ import annotations

import re
import textwrap
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from r3arrow._extras import require

with require(extra="plot", feature="r3arrow.plot"):
    import matplotlib
    import polars as pl

from r3arrow._typing import PathLike
from r3arrow.errors import SchemaError
from r3arrow.stats import RouteAgreement, agreement_over_steps, load_summary

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

_DPI = 120
_REFERENCE = {
    "max_over_mean": (1.0, "balanced (1)"),
    "cv": (0.0, "balanced (0)"),
    "entropy_norm": (1.0, "uniform (1)"),
}
_METRICS = {
    "max_over_mean": "max / mean expert load",
    "cv": "coefficient of variation of expert load",
    "entropy_norm": "normalised routing entropy (1 = uniform)",
    "dead": "dead experts (0 tokens)",
    "hot": "hot experts (> 2 × mean)",
}


def _figure(width: float, height: float) -> Figure:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=_DPI, layout="constrained")
    FigureCanvasAgg(fig)
    return fig


def _png(path: PathLike) -> Path:
    out = Path(path)
    if out.suffix.lower() != ".png":
        raise ValueError(f"expected a .png path, found {out}")
    return out


def _save(fig: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=_DPI)
    return path


def _clamp(x: float, lo: float, hi: float) -> float:
    return max(lo, min(hi, x))


# A vertical colour-bar label is centred on the bar and not shrunk by the layout: a line
# longer than the bar runs past the figure's edge. ~9 characters per inch of bar at 10 pt;
# 30 fit the shortest bar (~2.3 in).
_BAR_CHARS_PER_INCH, _BAR_MIN_CHARS = 9, 30


def _wrap_label(label: str, chars: int) -> str:
    """Lines of at most ``chars`` characters, never breaking inside parentheses."""
    keep = re.sub(r"\([^)]*\)", lambda m: m.group().replace(" ", "\u00a0"), label)
    lines = (textwrap.fill(line, chars) for line in keep.splitlines())
    return "\n".join(lines).replace("\u00a0", " ")


def _colorbar(fig: Figure, img: Any, ax: Axes, label: str, *, inches: float, **kw: Any) -> Any:
    """Colour bar beside ``ax`` (``inches`` tall): label wrapped to fit it, width in proportion."""
    bar = fig.colorbar(img, ax=ax, pad=0.01, aspect=_clamp(4 * inches, 12, 40), **kw)
    bar.set_label(_wrap_label(label, max(_BAR_MIN_CHARS, int(_BAR_CHARS_PER_INCH * inches))))
    return bar


def _ticks(ax: Axes, ids: Sequence[int], axis: str, max_ticks: int) -> None:
    """Label rows (``axis="y"``) or columns with the ids they show (MoE layers may have gaps)."""
    raw = max(1, int(np.ceil(len(ids) / max_ticks)))
    mag = 10 ** (len(str(raw)) - 1)
    step = next(m * mag for m in (1, 2, 5, 10) if m * mag >= raw)  # round strides: 1, 2, 5 x 10^k
    pos = list(range(0, len(ids), step))
    labels = [str(ids[i]) for i in pos]
    if axis == "y":
        ax.set_yticks(pos, labels)
    else:
        ax.set_xticks(pos, labels)


def _matrix(
    frame: pl.DataFrame, row: str, col: str, value: str
) -> tuple[list[int], list[int], np.ndarray]:
    """Pivot a long frame to a dense ``[rows, cols]`` float matrix (missing cells NaN)."""
    rv, cv = frame[row].to_numpy(), frame[col].to_numpy()
    rows, cols = np.unique(rv), np.unique(cv)
    out = np.full((rows.size, cols.size), np.nan)
    out[np.searchsorted(rows, rv), np.searchsorted(cols, cv)] = (
        frame[value].cast(pl.Float64).to_numpy()
    )
    return rows.tolist(), cols.tolist(), out


#: The expert-load heatmap: dead experts (0 tokens) black, layers that routed nothing grey;
#: the scale is RdBu_r without its near-black ends, so no load is drawn close to dead.
_DEAD, _EMPTY = (0.0, 0.0, 0.0, 1.0), (0.73, 0.73, 0.73, 1.0)


def _load_scale() -> Any:
    from matplotlib.colors import ListedColormap

    return ListedColormap(matplotlib.colormaps["RdBu_r"](np.linspace(0.15, 0.85, 256)))


class _LoadImage(NamedTuple):
    """The expert-load heatmap's data: ``rgba`` shows log2 of ``rel`` (load ÷ layer mean)
    clipped to ``[-lim, lim]`` on `_load_scale`, `_DEAD` where ``counts`` is exactly 0."""

    layers: list[int]
    experts: list[int]
    counts: np.ndarray
    rel: np.ndarray
    rgba: np.ndarray
    lim: float


def _load_image(load: pl.DataFrame) -> _LoadImage:
    if not {"layer", "expert", "tokens"} <= set(load.columns):
        raise SchemaError(
            f"expected an expert_load frame (layer, expert, tokens), found {load.columns}"
        )
    if load.height == 0:
        raise SchemaError("expected a non-empty expert_load frame, found no rows")
    if "step" in load.columns:
        load = load.group_by("layer", "expert").agg(pl.col("tokens").sum())
    layers, experts, counts = _matrix(load, "layer", "expert", "tokens")
    counts = np.nan_to_num(counts)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean = counts.mean(axis=1, keepdims=True)
        rel = np.where(mean > 0, counts / mean, np.nan)
        logs = np.log2(rel)
    finite = np.isfinite(logs)
    lim = float(np.clip(np.ceil(np.abs(logs[finite]).max()), 1, 4)) if finite.any() else 1.0
    rgba = _load_scale()((np.clip(np.nan_to_num(logs), -lim, lim) + lim) / (2 * lim))
    rgba[rel == 0] = _DEAD
    rgba[np.isnan(rel)] = _EMPTY
    return _LoadImage(layers, experts, counts, rel, rgba, lim)


def plot_expert_load(load: pl.DataFrame, path: PathLike, *, title: str | None = None) -> Path:
    """Heatmap (layer × expert) of each expert's load ÷ its layer's mean, log2 scale.

    ``load``: an `r3arrow.stats.expert_load` frame (a ``step`` column is summed over).
    Blue under-used, white balanced, red hot (clipped at 1/16× and 16× at most); black
    dead (exactly 0 tokens, a colour no load gets); grey a layer that routed nothing.
    """
    out = _png(path)
    layers, experts, counts, rel, rgba, lim = _load_image(load)
    height = _clamp(1.8 + 0.2 * len(layers), 3.2, 12)
    fig = _figure(_clamp(3.5 + 0.045 * len(experts), 6.5, 16), height)
    ax = fig.add_subplot()
    ax.imshow(rgba, aspect="auto", interpolation="nearest")
    _ticks(ax, layers, "y", 24)
    _ticks(ax, experts, "x", 16)
    ax.set_xlabel("expert id")
    ax.set_ylabel("MoE layer (global id)")
    from matplotlib.cm import ScalarMappable
    from matplotlib.colors import Normalize

    scale = ScalarMappable(Normalize(-lim, lim), _load_scale())
    bar = _colorbar(
        fig, scale, ax, "load ÷ layer mean (log scale)\nblack = dead (0 tokens)", inches=height
    )
    ticks = np.arange(-lim, lim + 1)
    labels = [f"{2.0**t:g}×" if t >= 0 else f"1/{2.0**-t:g}×" for t in ticks]
    labels[0], labels[-1] = f"≤{labels[0]}", f"≥{labels[-1]}"  # clipped beyond
    bar.set_ticks(list(ticks), labels=labels)
    worst_per_layer = np.where(np.isfinite(rel), rel, -np.inf).max(axis=1)
    worst = int(np.argmax(worst_per_layer)) if counts.size else 0
    dead = int((rel == 0).sum())
    routed = int(counts.sum(axis=1).max()) if counts.size else 0
    ax.set_title(
        title
        or f"Expert load: {len(layers)} MoE layers × {len(experts)} experts, "
        f"{routed:,} routed per layer\n"
        f"worst max/mean {worst_per_layer[worst]:.2f} (layer {layers[worst]}), "
        f"{dead} dead (layer, expert)",
        fontsize=10,
    )
    return _save(fig, out)


def _cmap(name: str, under: str | None = None) -> Any:
    return matplotlib.colormaps[name].with_extremes(bad="#bbbbbb", under=under)


def _lines_and_heatmap(
    path: Path,
    steps: list[int],
    layers: list[int],
    values: np.ndarray,
    lines: Mapping[str, np.ndarray],
    *,
    title: str,
    ylabel: str,
    bar_label: str,
    cmap: str,
    vmin: float | None = None,
    vmax: float | None = None,
    ylim: tuple[float, float] | None = None,
    reference: tuple[float, str] | None = None,
) -> Path:
    """Top: summary lines over steps; bottom: layer × step heatmap of ``values``, colour bar."""
    height = _clamp(4.2 + 0.16 * len(layers), 6.0, 14)
    fig = _figure(_clamp(4.5 + 0.12 * len(steps), 7.5, 16), height)
    ratio = _clamp(len(layers) / 10, 1.0, 3.0)
    top, bottom = fig.subplots(2, 1, height_ratios=[1.0, ratio])
    x = np.arange(len(steps))
    marker = "o" if len(steps) <= 40 else None
    for label, ys in lines.items():
        top.plot(x, ys, marker=marker, markersize=3.5, linewidth=1.5, label=label)
    if reference is not None:
        top.axhline(reference[0], color="0.4", linestyle="--", linewidth=1.0, label=reference[1])
    top.set_xlim(-0.5, len(steps) - 0.5)
    if ylim is not None:
        top.set_ylim(*ylim)
    top.set_ylabel(ylabel)
    top.grid(True, alpha=0.3)
    top.legend(fontsize=8, loc="best")
    _ticks(top, steps, "x", 16)
    top.set_xlabel("training step")
    top.set_title(title, fontsize=10)
    img = bottom.imshow(
        values, aspect="auto", interpolation="nearest", cmap=_cmap(cmap), vmin=vmin, vmax=vmax
    )
    _ticks(bottom, layers, "y", 24)
    _ticks(bottom, steps, "x", 16)
    bottom.set_xlabel("training step")
    bottom.set_ylabel("MoE layer (global id)")
    _colorbar(fig, img, bottom, bar_label, inches=height * ratio / (1 + ratio))
    return _save(fig, path)


def plot_imbalance(
    frame: pl.DataFrame, path: PathLike, *, metric: str = "max_over_mean", title: str | None = None
) -> Path:
    """Load imbalance over steps: mean / worst / best layer lines and a layer × step heatmap.

    ``frame``: a by-step `expert_load` frame or its `load_summary`; ``metric``: a summary
    column (max_over_mean, cv, entropy_norm, dead, hot).
    """
    out = _png(path)
    if "step" not in frame.columns:
        raise SchemaError(
            f"expected a frame with a step column (by_step=True), found {frame.columns}"
        )
    summary = load_summary(frame) if "expert" in frame.columns else frame
    if metric not in summary.columns:  # argument misuse: a builtin (docs/design.md, Error policy)
        raise ValueError(f"metric: expected one of {list(_METRICS)}, found {metric!r}")
    layers, steps, values = _matrix(summary, "layer", "step", metric)
    with np.errstate(all="ignore"):
        lines = {
            "mean over layers": np.nanmean(values, axis=0),
            "worst layer": np.nanmax(values, axis=0),
            "best layer": np.nanmin(values, axis=0),
        }
    label = _METRICS.get(metric, metric)
    return _lines_and_heatmap(
        out,
        steps,
        layers,
        values,
        lines,
        title=title or f"Load imbalance over {len(steps)} steps ({len(layers)} MoE layers)",
        ylabel=label,
        bar_label=label,
        cmap="magma_r" if metric != "entropy_norm" else "magma",
        reference=_REFERENCE.get(metric),
    )


def _floor_tenth(values: np.ndarray) -> float:
    """Colour-scale floor: 0 unless every value is high, then the tenth below the min (≤ 0.9)."""
    finite = values[np.isfinite(values)]
    return float(min(0.9, np.floor(finite.min() * 10) / 10)) if finite.size else 0.0


def plot_agreement(
    agreement: pl.DataFrame | Mapping[int, RouteAgreement],
    path: PathLike,
    *,
    title: str | None = None,
) -> Path:
    """Route agreement over steps (identical-set and overlap fractions, tokens differing
    anywhere) and per layer: an `agreement_over_steps` frame or ``route_agreement_by_step``."""
    out = _png(path)
    frame = agreement if isinstance(agreement, pl.DataFrame) else agreement_over_steps(agreement)
    need = {"step", "layer", "tokens", "identical", "overlap", "differing"}
    if not need <= set(frame.columns):
        raise SchemaError(
            f"expected an agreement_over_steps frame ({sorted(need)}), found {frame.columns}"
        )
    layers, steps, ident = _matrix(frame, "layer", "step", "identical")
    _, _, overlap = _matrix(frame, "layer", "step", "overlap")
    per_step = frame.group_by("step").agg(pl.col("differing").first()).sort("step")
    with np.errstate(all="ignore"):
        lines = {
            "identical top-k set (mean over layers)": np.nanmean(ident, axis=0),
            "identical top-k set (worst layer)": np.nanmin(ident, axis=0),
            "mean overlap |A∩B| / K": np.nanmean(overlap, axis=0),
            "tokens differing on ≥ 1 layer": per_step["differing"].to_numpy(),
        }
    return _lines_and_heatmap(
        out,
        steps,
        layers,
        ident,
        lines,
        title=title or f"Rollout vs trainer routes over {len(steps)} steps",
        ylabel="fraction of tokens",
        bar_label="fraction of tokens with an identical top-k set",
        cmap="viridis",
        vmin=_floor_tenth(ident),
        vmax=1.0,
        ylim=(-0.02, 1.02),
    )


def plot_disagreement(
    agreement: Mapping[int, RouteAgreement],
    path: PathLike,
    *,
    title: str | None = None,
) -> Path:
    """Disagreement per router layer (the R3 paper's quantities), ``r3arrow diagnose``'s PNG
    without log-prob mismatch diagnostics (with them: `plot_mismatch`).

    ``agreement``: step -> `RouteAgreement`. One step: bars per layer of the router
    decisions that differ (``1 - overlap / (tokens * K)``) and the tokens whose top-k set
    differs; several: those over steps and a layer × step heatmap. Raises ``ValueError``
    for an empty mapping.
    """
    out = _png(path)
    if not agreement:
        raise ValueError("agreement: expected at least one step, found none")
    steps = sorted(agreement)
    first = agreement[steps[0]]
    layers = list(first.layers)
    with np.errstate(all="ignore"):
        decisions = np.stack([1.0 - agreement[s].mean_overlap for s in steps], axis=1)
        tokens = np.stack([1.0 - agreement[s].identical_fraction for s in steps], axis=1)
    anywhere = np.array([agreement[s].differing_fraction for s in steps])
    if len(steps) > 1:
        with np.errstate(all="ignore"):
            lines = {
                "router decisions that differ (mean over layers)": np.nanmean(decisions, axis=0),
                "router decisions that differ (worst layer)": np.nanmax(decisions, axis=0),
                "tokens differing on ≥ 1 layer": anywhere,
            }
        top = np.nanmax(np.concatenate([decisions.ravel(), anywhere, [0.01]]))
        return _lines_and_heatmap(
            out,
            steps,
            layers,
            decisions,
            lines,
            title=title or f"Routing disagreement over {len(steps)} steps",
            ylabel="fraction",
            bar_label="fraction of router decisions that differ",
            cmap="magma_r",
            vmin=0.0,
            ylim=(0.0, float(min(1.02, top * 1.1 + 0.01))),
        )
    fig = _figure(_clamp(3.5 + 0.3 * len(layers), 6.0, 16), 4.2)
    ax = fig.subplots()
    x = np.arange(len(layers))
    width = 0.4
    ax.bar(x - width / 2, decisions[:, 0], width, label="router decisions that differ")
    ax.bar(x + width / 2, tokens[:, 0], width, label="tokens whose top-k set differs")
    _ticks(ax, layers, "x", 32)
    ax.set_xlabel("MoE layer (global id)")
    from matplotlib.ticker import PercentFormatter

    ax.set_ylabel("fraction")
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    head = title or f"Routing disagreement (step {steps[0]}, {first.tokens} tokens)"
    sub = f"tokens differing on ≥ 1 layer: {anywhere[0]:.1%}"
    ax.set_title(f"{head}\n{sub}", fontsize=10)
    return _save(fig, out)


_ROUTING_LABEL = "routing differs (tokens, ≥ 1 layer)"


def plot_mismatch(
    mismatch: Mapping[str, Mapping[int, Mapping[str, float]]],
    agreement: Mapping[str, Mapping[int, RouteAgreement]],
    path: PathLike,
    *,
    metric: str = "k3",
    title: str | None = None,
) -> Path:
    """Log-prob mismatch beside routing disagreement, per source (``docs/mismatch.md``).

    ``mismatch``: source -> step -> `r3arrow.stats.logprob_mismatch` dict; ``agreement``:
    source -> step -> the `RouteAgreement` of that source's routing (a source or step
    without one draws no disagreement). Left axis: the fraction of tokens whose top-k set
    differs on at least one layer (`RouteAgreement.differing_fraction`); right axis:
    ``metric``, a key of the mismatch dicts other than ``tokens``. One step in all: two
    bars per source, labelled with their values; several: per source, the disagreement as
    a solid line and ``metric`` as a dashed one over steps, one colour per source. Raises
    ``ValueError`` for no sources, an unknown ``metric`` or a non-``.png`` path.
    """
    from matplotlib.ticker import PercentFormatter

    from r3arrow._schema import MISMATCH_FLOATS

    out = _png(path)
    if not mismatch:
        raise ValueError("mismatch: expected at least one source, found none")
    if metric not in MISMATCH_FLOATS:
        raise ValueError(f"metric: expected one of {list(MISMATCH_FLOATS)}, found {metric!r}")
    sources = list(mismatch)
    steps = sorted({s for per in mismatch.values() for s in per})

    def routing(source: str, step: int) -> float:
        a = agreement.get(source, {}).get(step)
        return np.nan if a is None else float(a.differing_fraction)

    def value(source: str, step: int) -> float:
        row = mismatch[source].get(step)
        return np.nan if row is None else float(row[metric])

    fig = _figure(_clamp(4.5 + 1.2 * len(sources) + 0.12 * len(steps), 7.0, 16), 4.6)
    ax = fig.subplots()
    right = ax.twinx()
    ax.set_ylabel(f"{_ROUTING_LABEL}")
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    right.set_ylabel(f"log-prob {metric} (loss tokens)")
    ax.grid(True, axis="y", alpha=0.3)
    if len(steps) == 1:
        (step,) = steps
        x = np.arange(len(sources))
        width = 0.38
        shares = np.array([routing(s, step) for s in sources], float)
        values = np.array([value(s, step) for s in sources], float)
        left = ax.bar(x - width / 2, shares, width, color="C0", label=_ROUTING_LABEL)
        bars = right.bar(x + width / 2, values, width, color="C1", label=f"log-prob {metric}")
        ax.bar_label(left, labels=[f"{v:.2%}" for v in shares], fontsize=8)
        right.bar_label(bars, labels=[f"{v:.3g}" for v in values], fontsize=8)
        ax.set_xticks(x, sources)
        ax.set_xlabel(f"source (step {step})")
        # room above the bars for their labels; an all-zero (or all-NaN) side keeps a scale
        for axis, drawn in ((ax, shares), (right, values)):
            high = float(np.nanmax(drawn)) if np.isfinite(drawn).any() else 0.0
            axis.set_ylim(0.0, high * 1.15 if high > 0 else 0.01)
    else:
        x = np.arange(len(steps))
        marker = "o" if len(steps) <= 40 else None
        for i, source in enumerate(sources):
            colour = f"C{i % 10}"
            ax.plot(
                x,
                [routing(source, s) for s in steps],
                color=colour,
                marker=marker,
                markersize=3.5,
                label=f"{source}: {_ROUTING_LABEL}",
            )
            right.plot(
                x,
                [value(source, s) for s in steps],
                color=colour,
                linestyle="--",
                marker=marker,
                markersize=3.5,
                label=f"{source}: log-prob {metric}",
            )
        ax.set_xlim(-0.5, len(steps) - 0.5)
        _ticks(ax, steps, "x", 16)
        ax.set_xlabel("training step")
    handles, labels = ax.get_legend_handles_labels()
    more, more_labels = right.get_legend_handles_labels()
    # below the axes: inside, the twin axis would draw over it and it would hide data
    fig.legend(
        handles + more, labels + more_labels, loc="outside lower center", ncols=2, fontsize=8
    )
    ax.set_title(title or f"Log-prob {metric} beside routing disagreement", fontsize=10)
    return _save(fig, out)


__all__ = [
    "plot_agreement",
    "plot_disagreement",
    "plot_expert_load",
    "plot_imbalance",
    "plot_mismatch",
]
