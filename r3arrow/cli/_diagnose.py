"""``r3arrow diagnose``: the R3 paper's routing-disagreement quantities of a run.

The numbers come from the diagnostics beside the rollouts (`r3arrow.io.read_diagnostics`)
or else from a ``train_routes`` column (`r3arrow.stats.route_agreement_by_step`); see
``docs/diagnostics.md`` for the quantities printed and drawn (`r3arrow.plot.plot_disagreement`).
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from r3arrow.cli._inspect import rollout_input
from r3arrow.errors import SchemaError
from r3arrow.stats import RouteAgreement

#: Routes column of the trainer's own routing (train routes).
TRAIN_ROUTES = "train_routes"


def agreements_from_table(table: pa.Table) -> dict[str, dict[int, RouteAgreement]]:
    """``source -> step -> RouteAgreement`` of a `r3arrow.io.read_diagnostics` table."""
    out: dict[str, dict[int, RouteAgreement]] = {}
    if table.num_rows == 0:
        return out
    cols = {n: table.column(n).to_numpy() for n in table.schema.names if n != "source"}
    sources = np.asarray(table.column("source").to_pylist(), dtype=object)
    keys = np.stack([cols["step"], np.unique(sources, return_inverse=True)[1]], axis=1)
    # Rows come sorted by (step, source, layer): each group is one contiguous run.
    starts = np.flatnonzero(np.r_[True, (keys[1:] != keys[:-1]).any(axis=1)])
    ends = np.r_[starts[1:], table.num_rows]
    for a, b in zip(starts.tolist(), ends.tolist(), strict=True):
        agreement = RouteAgreement(
            tuple(int(x) for x in cols["layer"][a:b]),
            int(cols["topk"][a]),
            int(cols["tokens"][a]),
            cols["identical"][a:b],
            cols["overlap"][a:b],
            int(cols["all_identical"][a]),
        )
        out.setdefault(str(sources[a]), {})[int(cols["step"][a])] = agreement
    return out


def _has_column(path: Path, name: str) -> bool:
    """Whether the rollouts under ``path`` carry column ``name`` (footers only; none: False)."""
    from r3arrow.io import rollout_files

    if path.is_dir() and not any(p.is_dir() for p in path.iterdir() if p.name != "_diagnostics"):
        return False  # diagnostics only, or nothing
    return name in rollout_files(path)[0].schema.names


def load_agreements(path: Path, source: str | None = None) -> tuple[str, dict[int, RouteAgreement]]:
    """(source label, step -> agreement) for ``path``; see the module docstring.

    ``source`` picks a diagnostics source; by default the only one, or
    ``native_vs_replay`` when there are several. A single rollout file (no steps) comes
    back as step 0. Raises `SchemaError` (``path`` set) when ``path`` has neither
    diagnostics nor a ``train_routes`` column, or ``source`` names none of its sources.
    """
    from r3arrow import stats
    from r3arrow.io import NATIVE_VS_REPLAY, read_diagnostics

    found = agreements_from_table(read_diagnostics(path)) if path.is_dir() else {}
    if found:
        if source is None:
            source = next(iter(found)) if len(found) == 1 else NATIVE_VS_REPLAY
        if source not in found:
            raise SchemaError(
                f"{path}: expected --source to be one of {sorted(found)}, found {source!r}",
                path=path,
            )
        return source, found[source]
    if source is not None:
        raise SchemaError(f"{path}: expected diagnostics of source {source!r}, found none")
    rollouts = rollout_input(path)
    if not _has_column(rollouts, TRAIN_ROUTES):
        raise SchemaError(
            f"{path}: expected replay diagnostics (_diagnostics/, written by "
            f"r3arrow.io.write_diagnostics) or rollouts with a {TRAIN_ROUTES!r} column "
            f"(trainer routes), found neither",
            path=path,
        )
    label = f"routes_vs_{TRAIN_ROUTES}"
    if rollouts.is_file():
        return label, {0: stats.route_agreement(rollouts, TRAIN_ROUTES)}
    return label, stats.route_agreement_by_step(rollouts, TRAIN_ROUTES)


def _quantities(a: RouteAgreement) -> dict[str, float]:
    s = a.summary()
    return {
        "tokens": int(a.tokens),
        "decisions_differ": 1.0 - s["overlap"],
        "tokens_differ_any_layer": s["differing"],
        "top_k_set_differs_mean_layer": 1.0 - s["identical"],
    }


#: The log-prob mismatch metrics printed beside the routing disagreement: (key, header).
MISMATCH_SHOWN = (
    ("k3", "k3"),
    ("frac_abs_gt_ln2", "|Δ|>ln2"),
    ("token_mult_prob_error", "mult_err"),
    ("js_divergence", "js_div"),
    ("abs_max", "|Δ| max"),
)


@dataclasses.dataclass(frozen=True)
class MismatchRow:
    """One stored log-prob mismatch (``step``, ``source``, ``metrics``: the
    `r3arrow.stats.logprob_mismatch` dict) beside its routing disagreement: ``routing``,
    the agreement of source ``routing_source`` at that step, or None."""

    step: int
    source: str
    metrics: dict[str, float]
    routing_source: str | None
    routing: RouteAgreement | None


def load_mismatch(
    path: Path, source: str, per_step: Mapping[int, RouteAgreement]
) -> list[MismatchRow]:
    """Every log-prob mismatch stored under ``path`` (`r3arrow.io.read_diagnostics` with
    ``kind="mismatch"``), by step then source, each beside its routing disagreement: for
    mismatch source ``S``, the agreement stored as ``S + ROUTING_SUFFIX`` at that step (the
    demo's ``trainer_native_routing`` beside ``trainer_native``), else ``per_step``'s (the
    report's ``source``, e.g. a trainer's ``native_vs_replay`` beside its
    ``train_vs_rollout``), else none. [] for a file or a directory without mismatch
    diagnostics.
    """
    from r3arrow._schema import ROUTING_SUFFIX
    from r3arrow.io import read_diagnostics

    if not path.is_dir():
        return []
    stored = read_diagnostics(path, kind="mismatch").to_pylist()
    if not stored:
        return []
    same = agreements_from_table(read_diagnostics(path))
    out: list[MismatchRow] = []
    for row in stored:
        step, name = int(row["step"]), str(row["source"])
        paired = name + ROUTING_SUFFIX
        own = same.get(paired, {}).get(step)
        label, agreement = (paired, own) if own is not None else (source, per_step.get(step))
        metrics = {
            k: int(v) if k == "tokens" else float(v)
            for k, v in row.items()
            if k not in ("step", "source")
        }
        out.append(
            MismatchRow(step, name, metrics, label if agreement is not None else None, agreement)
        )
    return out


def load_fallback(path: Path) -> list[dict[str, Any]]:
    """Every route fallback stored under ``path`` (`r3arrow.io.read_diagnostics` with
    ``kind="fallback"``, ``docs/fallback.md``): one dict per step and source (``step``,
    ``source``, the `r3arrow.stats.RouteFallback` counts, ``fraction``), by step then
    source; [] for a file or a directory without them."""
    from r3arrow.io import read_diagnostics

    if not path.is_dir():
        return []
    rows = read_diagnostics(path, kind="fallback").to_pylist()
    return [
        {k: (float(v) if k == "fraction" else v) for k, v in r.items()}
        for r in sorted(rows, key=lambda r: (r["step"], r["source"]))
    ]


def _step_pick(source: str, rows: list[MismatchRow]) -> str | None:
    """The mismatch source shown under each step of ``source``'s report: the same name, else
    ``train_vs_rollout``, else the only one; None when several fit none of these."""
    from r3arrow._schema import TRAIN_VS_ROLLOUT

    names = {r.source for r in rows}
    for name in (source, TRAIN_VS_ROLLOUT):
        if name in names:
            return name
    return next(iter(names)) if len(names) == 1 else None


def _json_row(row: MismatchRow) -> dict[str, Any]:
    routing = None
    if row.routing is not None:
        routing = {
            "source": row.routing_source,
            "tokens": int(row.routing.tokens),
            "tokens_differ_any_layer": float(row.routing.differing_fraction),
        }
    return {"step": row.step, "source": row.source, "routing": routing, **_finite(row.metrics)}


def report(
    source: str,
    per_step: Mapping[int, RouteAgreement],
    mismatch: list[MismatchRow] | None = None,
    fallback: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """JSON-ready report: totals, per step, per layer (fractions as floats). With
    ``mismatch`` (`load_mismatch`'s rows, non-empty): ``"logprob_mismatch"`` lists them
    (``step``, ``source``, ``routing``: ``{source, tokens, tokens_differ_any_layer}`` or
    None, then the metrics, NaN as None), and each step has under ``"mismatch"`` the
    metrics of one source (`_step_pick`: the name of ``source``, else
    ``train_vs_rollout``, else the only one), None for a step without it. With
    ``fallback`` (`load_fallback`'s rows, non-empty): ``"fallback"`` lists them."""
    total = functools.reduce(operator.add, (per_step[s] for s in sorted(per_step)))
    with np.errstate(all="ignore"):
        decisions = 1.0 - total.mean_overlap
        sets = 1.0 - total.identical_fraction
    rows = mismatch or []
    pick = _step_pick(source, rows) if rows else None
    by_step = {r.step: _finite(r.metrics) for r in rows if r.source == pick}
    out = {
        "source": source,
        "topk": total.topk,
        "total": _quantities(total),
        "steps": [
            {
                "step": s,
                **_quantities(per_step[s]),
                **({"mismatch": by_step.get(s)} if rows else {}),
            }
            for s in sorted(per_step)
        ],
        "layers": [
            {
                "layer": int(layer),
                "decisions_differ": float(decisions[i]),
                "top_k_set_differs": float(sets[i]),
            }
            for i, layer in enumerate(total.layers)
        ],
    }
    if rows:
        out["logprob_mismatch"] = [_json_row(r) for r in rows]
    if fallback:
        out["fallback"] = list(fallback)
    return out


def _finite(row: Mapping[str, Any]) -> dict[str, Any]:
    """A mismatch row with NaN as None (JSON has no NaN)."""
    return {k: (None if isinstance(v, float) and v != v else v) for k, v in row.items()}


def _cell(value: float | None, fmt: str) -> str:
    return "n/a" if value is None else format(value, fmt)


def print_report(path: Path, info: Mapping[str, Any]) -> None:
    """The human-readable form of `report`: the disagreement, then (with mismatch
    diagnostics) one line per step and mismatch source beside its routing disagreement."""
    t = info["total"]
    steps = info["steps"]
    where = f"{len(steps)} step{'s' if len(steps) != 1 else ''}"
    print(f"routing disagreement of {path} ({info['source']}, {where}, top-{info['topk']})")
    print(f"  tokens compared:                         {t['tokens']}")
    print(f"  router decisions that differ:            {t['decisions_differ']:.2%}")
    print(f"  tokens differing on at least one layer:  {t['tokens_differ_any_layer']:.2%}")
    if len(steps) > 1:
        print("  step   tokens   decisions differ   tokens differ (any layer)")
        for s in steps:
            print(
                f"  {s['step']:>4} {s['tokens']:>8}   {s['decisions_differ']:>16.2%}"
                f"   {s['tokens_differ_any_layer']:>25.2%}"
            )
    print("  layer   decisions differ   top-k set differs")
    for row in info["layers"]:
        print(
            f"  {row['layer']:>5}   {row['decisions_differ']:>16.2%}"
            f"   {row['top_k_set_differs']:>17.2%}"
        )
    fallback = info.get("fallback")
    if fallback:
        print("route fallback (token routes the engine did not deliver; the trainer's router")
        print("computes them under install_replay(missing='native'))")
        print("  step  source            trajectories   route rows   missing   fraction")
        for f in fallback:
            print(
                f"  {f['step']:>4}  {f['source']:<16}  {f['fallback_trajectories']:>5} of "
                f"{f['trajectories']:<4}  {f['route_rows']:>10}  {f['missing_rows']:>8}"
                f"  {f['fraction']:>9.2%}"
            )
    rows = info.get("logprob_mismatch")
    if not rows:
        return
    width = max(len("source"), *(len(r["source"]) for r in rows))
    routed = max(len("routing of"), *(len(r["routing"]["source"]) for r in rows if r["routing"]))
    print(
        "log-prob mismatch beside routing disagreement (routing: tokens whose top-k set "
        "differs on >= 1 layer; log-probs: loss tokens)"
    )
    print(
        f"  step  {'source':<{width}}  {'routing of':<{routed}}  {'differs':>8}"
        f"  {'loss tokens':>11}" + "".join(h.rjust(11) for _, h in MISMATCH_SHOWN)
    )
    for r in rows:
        routing = r["routing"]
        of, differ = "-", None
        if routing is not None:
            of, differ = routing["source"], routing["tokens_differ_any_layer"]
        cells = "".join(_cell(r[k], ".4g").rjust(11) for k, _ in MISMATCH_SHOWN)
        print(
            f"  {r['step']:>4}  {r['source']:<{width}}  {of:<{routed}}  "
            f"{_cell(differ, '.2%'):>8}  {int(r['tokens']):>11}{cells}"
        )


def plot(
    out: Path, name: str, per_step: Mapping[int, RouteAgreement], mismatch: list[MismatchRow]
) -> Path:
    """``--png``: with mismatch diagnostics `r3arrow.plot.plot_mismatch` (every mismatch
    source beside its routing disagreement, as `load_mismatch` pairs them), else
    `r3arrow.plot.plot_disagreement` of ``per_step`` (per layer, over steps)."""
    from r3arrow import plot as plots

    if not mismatch:
        return plots.plot_disagreement(per_step, out, title=f"Routing disagreement: {name}")
    lp: dict[str, dict[int, dict[str, float]]] = {}
    routing: dict[str, dict[int, RouteAgreement]] = {}
    for r in mismatch:
        lp.setdefault(r.source, {})[r.step] = r.metrics
        if r.routing is not None:
            routing.setdefault(r.source, {})[r.step] = r.routing
    title = f"Log-prob k3 beside routing disagreement: {name}"
    return plots.plot_mismatch(lp, routing, out, title=title)


__all__ = [
    "MISMATCH_SHOWN",
    "TRAIN_ROUTES",
    "MismatchRow",
    "agreements_from_table",
    "load_agreements",
    "load_fallback",
    "load_mismatch",
    "plot",
    "print_report",
    "report",
]
