"""Hypothesis strategies for r3arrow data: specs, routes for a spec, rollout tables.

Needs ``hypothesis`` (a test dependency; ``r3arrow.testing`` itself does not import it).

* `specs`: a `RouteSpec` whose storage dtype is uint8, uint16 or int32 (docs/design.md,
  §4 Expert ids), with or without dense layers.
* `routes`: valid ``[rows, L, K]`` routes for a spec (distinct ids on router layers,
  zeros on dense ones), as numpy in the spec's storage dtype.
* `shapes`: per-trajectory ``(prompt_len, response_len, captured)`` triples, zero-row
  trajectories included.
* `rollout_tables`: a valid rollout table, optionally sliced or split into chunks (what
  filtering and concatenation produce) and with user metadata beside the spec.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
import pyarrow as pa
from hypothesis import strategies as st

from r3arrow.spec import RouteSpec
from r3arrow.testing import random_rollouts, random_routes

Width = Literal["uint8", "uint16", "int32"]

# Expert counts whose storage dtype is each width (int32: kept small enough to test fast).
_EXPERTS: dict[str, tuple[int, int]] = {
    "uint8": (1, 256),
    "uint16": (257, 65_536),
    "int32": (65_537, 2**31 - 1),
}


@st.composite
def specs(
    draw: st.DrawFn,
    *,
    max_layers: int = 6,
    max_topk: int = 4,
    widths: tuple[Width, ...] = ("uint8", "uint16", "int32"),
    dense_layers: bool = True,
) -> RouteSpec:
    """A `RouteSpec` with ``1..max_layers`` layers, top-``1..max_topk`` and a storage width
    drawn from ``widths``; with ``dense_layers`` some specs list only some router layers."""
    topk = draw(st.integers(1, max_topk))
    width = draw(st.sampled_from(widths))
    lo, hi = _EXPERTS[width]
    num_experts = draw(st.integers(max(lo, topk), hi))
    num_layers = draw(st.integers(1, max_layers))
    moe: tuple[int, ...] | None = None
    if dense_layers and draw(st.booleans()):
        moe = tuple(sorted(draw(st.sets(st.integers(0, num_layers - 1), min_size=1))))
    return RouteSpec(num_layers=num_layers, topk=topk, num_experts=num_experts, moe_layers=moe)


@st.composite
def routes(
    draw: st.DrawFn, spec: RouteSpec, *, min_rows: int = 0, max_rows: int = 16
) -> np.ndarray:
    """Valid routes ``[rows, L, K]`` for ``spec``, storage dtype, ``min_rows..max_rows`` rows."""
    rows = draw(st.integers(min_rows, max_rows))
    seed = draw(st.integers(0, 2**32 - 1))
    return random_routes(np.random.default_rng(seed), rows, spec)


@st.composite
def shapes(
    draw: st.DrawFn, *, max_rows: int = 6, max_tokens: int = 8
) -> list[tuple[int, int, int]]:
    """``(prompt_len, response_len, captured)`` per trajectory; ``captured`` is often 0."""
    out = []
    for _ in range(draw(st.integers(0, max_rows))):
        p = draw(st.integers(0, max_tokens))
        r = draw(st.integers(0, max_tokens))
        c = draw(st.integers(0, p + r) | st.just(0))
        out.append((p, r, c))
    return out


@st.composite
def rollout_tables(
    draw: st.DrawFn,
    spec: RouteSpec | None = None,
    *,
    max_rows: int = 6,
    max_tokens: int = 8,
    layouts: bool = True,
    user_metadata: bool = True,
) -> pa.Table:
    """A valid rollout table (`r3arrow.testing.random_rollouts`) for ``spec`` (drawn by
    `specs` when None). With ``layouts`` it may be a slice or two chunks; with
    ``user_metadata`` it may carry extra schema metadata beside the spec."""
    if spec is None:
        spec = draw(specs())
    seed = draw(st.integers(0, 2**32 - 1))
    table = random_rollouts(
        np.random.default_rng(seed), spec, draw(shapes(max_rows=max_rows, max_tokens=max_tokens))
    )
    n = table.num_rows
    layout = draw(st.sampled_from(["plain", "slice", "chunks"])) if layouts else "plain"
    if layout == "slice" and n:
        start = draw(st.integers(0, n))
        table = table.slice(start, draw(st.integers(0, n - start)))
    elif layout == "chunks" and n:
        k = draw(st.integers(0, n))
        table = pa.concat_tables([table.slice(0, k), table.slice(k)])
    if user_metadata and draw(st.booleans()):
        meta = {**(table.schema.metadata or {}), b"user.note": "über".encode(), b"user.run": b"42"}
        table = table.replace_schema_metadata(meta)
    return table


__all__ = ["rollout_tables", "routes", "shapes", "specs"]
