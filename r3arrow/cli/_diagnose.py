"""``r3arrow diagnose``: the R3 paper's routing-disagreement quantities of a run.

The numbers come from the diagnostics beside the rollouts (`r3arrow.io.read_diagnostics`)
or else from a ``train_routes`` column (`r3arrow.stats.route_agreement_by_step`); see
``docs/diagnostics.md`` for the quantities printed and drawn (`r3arrow.plot.plot_disagreement`).
"""

from __future__ import annotations

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


#: The log-prob mismatch metrics printed beside each step's disagreement.
MISMATCH_SHOWN = ("k3", "frac_abs_gt_ln2", "token_mult_prob_error")


def load_mismatch(path: Path) -> dict[int, dict[str, float]]:
    """``step -> mismatch row`` of the ``train_vs_rollout`` (or only) mismatch diagnostics
    under ``path`` (`r3arrow.io.read_diagnostics` with ``kind="mismatch"``); {} for none."""
    from r3arrow.io import read_diagnostics

    if not path.is_dir():
        return {}
    table = read_diagnostics(path, kind="mismatch")
    rows: list[dict[str, Any]] = table.to_pylist()
    sources = sorted({r["source"] for r in rows})
    pick = "train_vs_rollout" if "train_vs_rollout" in sources else (sources or [None])[0]
    return {
        int(r["step"]): {k: v for k, v in r.items() if k not in ("step", "source")}
        for r in rows
        if r["source"] == pick
    }


def report(
    source: str,
    per_step: Mapping[int, RouteAgreement],
    mismatch: Mapping[int, Mapping[str, float]] | None = None,
) -> dict[str, Any]:
    """JSON-ready report: totals, per step (with ``mismatch``: each step's log-prob mismatch
    row under ``"mismatch"``, None for a step without one), per layer (fractions as floats)."""
    total = functools.reduce(operator.add, (per_step[s] for s in sorted(per_step)))
    with np.errstate(all="ignore"):
        decisions = 1.0 - total.mean_overlap
        sets = 1.0 - total.identical_fraction
    return {
        "source": source,
        "topk": total.topk,
        "total": _quantities(total),
        "steps": [
            {
                "step": s,
                **_quantities(per_step[s]),
                **({} if mismatch is None else {"mismatch": _finite(mismatch.get(s))}),
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


def _finite(row: Mapping[str, float] | None) -> dict[str, float | None] | None:
    """A mismatch row with NaN as None (JSON has no NaN)."""
    if row is None:
        return None
    return {k: (None if v != v else float(v)) for k, v in row.items()}


def _mismatch_cells(row: Mapping[str, Any] | None) -> str:
    if row is None:
        return "   " + "-".rjust(12) * len(MISMATCH_SHOWN)
    cells = ("n/a" if row[k] is None else f"{row[k]:.4g}" for k in MISMATCH_SHOWN)
    return "   " + "".join(c.rjust(12) for c in cells)


def print_report(path: Path, info: Mapping[str, Any]) -> None:
    """The human-readable form of `report`."""
    t = info["total"]
    steps = info["steps"]
    where = f"{len(steps)} step{'s' if len(steps) != 1 else ''}"
    print(f"routing disagreement of {path} ({info['source']}, {where}, top-{info['topk']})")
    print(f"  tokens compared:                         {t['tokens']}")
    print(f"  router decisions that differ:            {t['decisions_differ']:.2%}")
    print(f"  tokens differing on at least one layer:  {t['tokens_differ_any_layer']:.2%}")
    with_lp = any("mismatch" in s for s in steps)
    if len(steps) > 1 or with_lp:
        head = "  step   tokens   decisions differ   tokens differ (any layer)"
        if with_lp:
            head += "   " + "".join(k.rjust(12) for k in ("lp k3", "|Δ|>ln2", "mult_err"))
        print(head)
        for s in steps:
            print(
                f"  {s['step']:>4} {s['tokens']:>8}   {s['decisions_differ']:>16.2%}"
                f"   {s['tokens_differ_any_layer']:>25.2%}"
                + (_mismatch_cells(s.get("mismatch")) if with_lp else "")
            )
    print("  layer   decisions differ   top-k set differs")
    for row in info["layers"]:
        print(
            f"  {row['layer']:>5}   {row['decisions_differ']:>16.2%}"
            f"   {row['top_k_set_differs']:>17.2%}"
        )


__all__ = [
    "MISMATCH_SHOWN",
    "TRAIN_ROUTES",
    "agreements_from_table",
    "load_agreements",
    "load_mismatch",
    "print_report",
    "report",
]
