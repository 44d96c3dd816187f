"""Summaries over counts: per-step stacking, imbalance, entropy, dead/hot experts, drift.

All are Polars expressions over `expert_load` / `agreement_over_steps` frames and
accept a ``DataFrame`` or a ``LazyFrame`` (the type in is the type out).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TypeVar

import polars as pl

from r3arrow.errors import SchemaError
from r3arrow.stats._agreement import RouteAgreement

Frame = TypeVar("Frame", pl.DataFrame, pl.LazyFrame)


def stack_steps(frames: Mapping[int, pl.DataFrame]) -> pl.DataFrame:
    """Per-step frames stacked with a leading ``step`` (Int64) column, in mapping order."""
    if not frames:
        raise SchemaError("by step: expected at least one step, found none")
    return pl.concat(
        [f.select(pl.lit(s, dtype=pl.Int64).alias("step"), pl.all()) for s, f in frames.items()],
        how="vertical",
    )


def agreement_over_steps(results: Mapping[int, RouteAgreement]) -> pl.DataFrame:
    """Long frame of ``step``, ``layer``, ``tokens``, ``identical``, ``overlap``, ``differing``.

    One row per (step, layer); ``differing``: the step's fraction of tokens that differ on
    at least one layer (the same on each of the step's rows).
    """
    frames = {
        s: r.per_layer().with_columns(
            pl.lit(r.differing_fraction, dtype=pl.Float64).alias("differing")
        )
        for s, r in sorted(results.items())
    }
    return stack_steps(frames)


def _keys(frame: pl.DataFrame | pl.LazyFrame) -> list[str]:
    names = frame.collect_schema().names()
    for need in ("layer", "expert", "tokens"):
        if need not in names:
            raise SchemaError(
                f"expected an expert_load frame (layer, expert, tokens), found columns {names}"
            )
    return ["step", "layer"] if "step" in names else ["layer"]


def load_summary(load: Frame, *, hot_factor: float = 2.0) -> Frame:
    """Per layer (and step): imbalance, entropy, dead and hot experts of an `expert_load` frame.

    Columns: ``[step,] layer``, ``experts``, ``routed`` (sum of ``tokens``),
    ``max_over_mean``, ``cv`` (population std / mean), ``entropy`` (bits), ``entropy_norm``
    (entropy / log2(experts); 1 = uniform), ``dead`` (experts with 0 tokens), ``hot``
    (experts above ``hot_factor`` × mean). NaN where a layer routed nothing.
    """
    keys: list[str] = _keys(load)
    t = pl.col("tokens").cast(pl.Float64)
    p = t / t.sum()
    return (
        load.group_by(keys, maintain_order=True)
        .agg(
            pl.len().cast(pl.Int64).alias("experts"),
            pl.col("tokens").sum().cast(pl.Int64).alias("routed"),
            (t.max() / t.mean()).alias("max_over_mean"),
            (t.std(ddof=0) / t.mean()).alias("cv"),
            (-pl.when(t > 0).then(p * p.log(2)).otherwise(0.0).sum()).alias("entropy"),
            (pl.col("tokens") == 0).sum().cast(pl.Int64).alias("dead"),
            (t > hot_factor * t.mean()).sum().cast(pl.Int64).alias("hot"),
        )
        .with_columns(
            pl.when(pl.col("routed") > 0)
            .then(pl.col("entropy"))
            .otherwise(float("nan"))
            .alias("entropy")
        )
        .with_columns(
            (pl.col("entropy") / pl.col("experts").cast(pl.Float64).log(2)).alias("entropy_norm")
        )
        .sort(keys)
    )


def dead_experts(load: Frame) -> Frame:
    """Rows of ``load`` whose expert received no token: ``[step,] layer, expert``."""
    keys: list[str] = _keys(load)
    return load.filter(pl.col("tokens") == 0).select([*keys, "expert"])


def hot_experts(load: Frame, factor: float = 2.0) -> Frame:
    """Experts above ``factor`` × their layer's mean: ``[step,] layer, expert, tokens, ratio``."""
    keys: list[str] = _keys(load)
    tokens = pl.col("tokens").cast(pl.Float64)
    ratio = tokens / tokens.mean().over(keys)
    return (
        load.with_columns(ratio.alias("ratio"))
        .filter(pl.col("ratio") > factor)
        .select([*keys, "expert", "tokens", "ratio"])
    )


def _drift(joined: Frame, keys: list[str]) -> Frame:
    """Per ``keys`` group of (tokens_a, tokens_b) rows: total variation, JS (bits), max shift."""
    ta = pl.col("tokens_a").cast(pl.Float64)
    tb = pl.col("tokens_b").cast(pl.Float64)
    p = ta / ta.sum().over(keys)
    q = tb / tb.sum().over(keys)
    framed = joined.with_columns(p.alias("_p"), q.alias("_q")).with_columns(
        ((pl.col("_p") + pl.col("_q")) / 2).alias("_m")
    )

    def kl(x: str) -> pl.Expr:
        return (
            pl.when(pl.col(x) > 0)
            .then(pl.col(x) * (pl.col(x) / pl.col("_m")).log(2))
            .otherwise(0.0)
        )

    return (
        framed.group_by(keys, maintain_order=True)
        .agg(
            (0.5 * (pl.col("_p") - pl.col("_q")).abs().sum()).alias("tv"),
            (0.5 * kl("_p").sum() + 0.5 * kl("_q").sum()).alias("js"),
            (pl.col("_p") - pl.col("_q")).abs().max().alias("max_shift"),
        )
        .sort(keys)
    )


def load_drift(a: pl.DataFrame, b: pl.DataFrame) -> pl.DataFrame:
    """How layer load distributions moved from ``a`` to ``b`` (`expert_load` frames, no ``step``).

    Per ``layer``: ``tv`` (total variation distance of the expert shares, in [0, 1]), ``js``
    (Jensen-Shannon divergence, bits, in [0, 1]), ``max_shift`` (largest change of one
    expert's share). Experts missing on one side count 0.
    """
    for f in (a, b):
        if _keys(f) != ["layer"]:
            raise SchemaError(
                "load_drift: expected expert_load frames without a step column; "
                "use drift_over_steps"
            )
    layers_a, layers_b = set(a["layer"].unique().to_list()), set(b["layer"].unique().to_list())
    if layers_a != layers_b:
        raise SchemaError(
            f"load_drift: expected the same layers, found {sorted(layers_a)} and {sorted(layers_b)}"
        )
    joined = (
        a.select("layer", "expert", pl.col("tokens").alias("tokens_a"))
        .join(
            b.select("layer", "expert", pl.col("tokens").alias("tokens_b")),
            on=["layer", "expert"],
            how="full",
            coalesce=True,
        )
        .fill_null(0)
    )
    return _drift(joined, ["layer"])


def drift_over_steps(load: Frame) -> Frame:
    """`load_drift` between each step and the previous one of a by-step `expert_load` frame:
    ``step``, ``prev_step``, ``layer``, ``tv``, ``js``, ``max_shift`` (the first step has none)."""
    if _keys(load) != ["step", "layer"]:
        raise SchemaError(
            "drift_over_steps: expected an expert_load frame with a step column (by_step)"
        )
    steps = load.select(pl.col("step").unique().sort())
    order = steps.with_columns(pl.col("step").shift(-1).alias("next_step")).drop_nulls()
    prev = load.join(order, on="step").select(
        pl.col("next_step").alias("step"),
        pl.col("step").alias("prev_step"),
        "layer",
        "expert",
        pl.col("tokens").alias("tokens_a"),
    )
    cur = load.join(order.select(pl.col("next_step").alias("step")), on="step").select(
        "step", "layer", "expert", pl.col("tokens").alias("tokens_b")
    )
    joined = (
        prev.join(cur, on=["step", "layer", "expert"], how="full", coalesce=True)
        .with_columns(pl.col("tokens_a").fill_null(0), pl.col("tokens_b").fill_null(0))
        .with_columns(pl.col("prev_step").max().over("step"))
    )
    return _drift(joined, ["step", "prev_step", "layer"])


__all__ = [
    "Frame",
    "agreement_over_steps",
    "dead_experts",
    "drift_over_steps",
    "hot_experts",
    "load_drift",
    "load_summary",
    "stack_steps",
]
