"""The route-quality guard: well-formed routes that match a known engine bug.

Some engine faults produce routes that pass every id rule of `r3arrow.ids` (or fail one
with a misleading message) yet record nothing the router chose; replaying them trains the
model on garbage. `check_route_quality` recognises the two known signatures on one engine
response ``[rows, L, K]`` and raises `RouteQualityError` (an `EngineError`) naming the
upstream bug reports and the layer:

* **A router layer that is all zeros** on every row, "as if every token selected expert
  0": vLLM's FlashInfer monolithic MoE kernels (vLLM #44116, fixed by #44214),
  vllm-ascend #16314, SGLang's NGRAM speculative decoding (SGLang #37949).
* **Every row routed identically** on a router layer (the same expert set, in any order,
  on all rows): no real router does that over a whole response, and a fault of the kind
  above that leaves a constant non-zero buffer would look like it.

Thresholds (why): with ``K >= 2`` an all-zero row repeats expert 0, which valid routes
never do, so one such layer is a fault at any row count. A single token, or a few, can
legitimately pick the same experts (``K == 1`` routers, and skewed routers in general), so
the all-zero rule for ``K == 1`` and the identical-rows rule need at least
`MIN_IDENTICAL_ROWS` (32) rows: a router that gives its favourite expert set probability
``p = 0.5`` routes 32 tokens identically by chance with probability ``0.5**31 < 1e-9``,
while 8 rows would leave ``0.5**7``, almost 1%. The faults above affect whole responses
(hundreds of tokens), so the threshold costs no detection in practice.

Order: the client runs this guard *before* the id rules (`r3arrow.ids.check_routes`;
docs/design.md, §4 Expert ids), because an all-zero row with ``K >= 2`` is also a duplicate
and the user should see the engine-bug message, not "expected K distinct experts". The
guard reads values only through equality and zero tests, so unvalidated (even
out-of-range) ids are safe input. The caller switches it off (the client's
``route_quality=False``) to accept such routes.

Cost: independent of the row count for ordinary routes. Row 0 and a prefix of
``_SAMPLE_ROWS`` rows are tested first, vectorised over the router layers; only a layer
that survives those (all zeros on row 0, or the same set on every sampled row) is tested
on all rows. ``benchmarks/bench_validate.py`` measures it against a memory copy.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from r3arrow.errors import RouteQualityError
from r3arrow.spec import RouteSpec

MIN_IDENTICAL_ROWS = 32
"""Rows a response needs before identical routing (or, with ``K == 1``, all zeros) is a fault."""

_SAMPLE_ROWS = 8  # rows in the cheap prefilter: random routes almost never survive it

ZERO_LAYER_BUGS: tuple[str, ...] = ("vLLM #44116", "vllm-ascend #16314", "SGLang #37949")
"""Upstream reports of router layers recorded as all zeros."""

_ZERO_DETAIL = (
    "vLLM #44116 (FlashInfer monolithic MoE kernels, fixed by vLLM #44214), "
    "vllm-ascend #16314, SGLang #37949 (NGRAM speculative decoding)"
)


def check_route_quality(
    rows: np.ndarray,
    spec: RouteSpec,
    *,
    what: str = "routes",
    min_rows: int = MIN_IDENTICAL_ROWS,
) -> None:
    """Raise `RouteQualityError` if one engine response's routes match a known engine bug.

    Parameters
    ----------
    rows:
        One response's routes, ``[rows, num_layers, topk]``, any integer dtype (numpy).
    spec:
        The routes' spec; only ``spec.router_layers`` are tested (dense layers are zero by
        design).
    what:
        What the routes are, for the message.
    min_rows:
        Rows needed before identical routing (and all zeros with ``topk == 1``) is a
        fault; see the module docstring for why the default is `MIN_IDENTICAL_ROWS`.

    Raises
    ------
    RouteQualityError
        A router layer is all zeros on every row (with ``topk >= 2``, or at least
        ``min_rows`` rows), or routes every one of at least ``min_rows`` rows to the same
        expert set (both only when ``num_experts > topk``, i.e. routing can vary).
        ``layer`` is the first such global layer id (all-zero layers first),
        ``bugs`` the matching upstream reports.
    ValueError
        ``rows`` is not ``[rows, num_layers, topk]`` for ``spec`` or ``min_rows < 2``.
    """
    if rows.ndim != 3 or tuple(rows.shape[1:]) != spec.row_shape:
        raise ValueError(
            f"{what}: expected routes [rows, {spec.num_layers}, {spec.topk}], "
            f"found shape {list(rows.shape)}"
        )
    if isinstance(min_rows, bool) or not isinstance(min_rows, int) or min_rows < 2:
        raise ValueError(f"min_rows: expected an int >= 2, found {min_rows!r}")
    n = int(rows.shape[0])
    if n == 0:
        return
    layers = np.asarray(spec.router_layers, dtype=np.intp)
    k, e = spec.topk, spec.num_experts
    # With num_experts == topk every token uses every expert: one possible expert set, so
    # neither identical routing nor (with K == 1) all zeros says anything about the engine.
    varied = e is None or e > k
    # All zeros: row 0 names the candidate layers, the rest of the rows confirm them.
    zero = layers[~rows[0, layers].any(axis=-1)]
    if zero.size and (k >= 2 or (n >= min_rows and varied)):
        confirmed = zero[~rows[:, zero].any(axis=(0, 2))]
        if confirmed.size:
            _raise_zero(int(confirmed[0]), n, spec, what)
    if n < min_rows or not varied:
        return
    # Identical routing: the same sorted row on every row of a prefix, then on all rows.
    first = np.sort(rows[0, layers], axis=-1)  # [router layers, K]
    head = np.sort(rows[1:_SAMPLE_ROWS, layers], axis=-1)
    same = (head == first).all(axis=(0, 2))
    if not same.any():
        return
    cand = layers[same]
    rest = np.sort(rows[:, cand], axis=-1)
    ident = (rest == first[same]).all(axis=(0, 2))
    if ident.any():
        i = int(np.argmax(ident))
        _raise_identical(int(cand[i]), n, first[same][i], what)


def _raise_zero(layer: int, n: int, spec: RouteSpec, what: str) -> None:
    hint = (
        f"; if layer {layer} has no router, declare the router layers with "
        f"RouteSpec(moe_layers=...)"
        if spec.moe_layers is None
        else ""
    )
    raise RouteQualityError(
        f"{what}: router layer {layer} is all zeros on all {n} rows, as if every token "
        f"selected expert 0; expected the experts the router chose. This matches known engine "
        f"bugs: {_ZERO_DETAIL}; upgrade the engine or turn the feature off, or pass "
        f"route_quality=False to accept these routes{hint}",
        layer=layer,
        bugs=ZERO_LAYER_BUGS,
    )


def _raise_identical(layer: int, n: int, experts: Any, what: str) -> None:
    ids = [int(v) for v in experts]
    raise RouteQualityError(
        f"{what}: router layer {layer} routes all {n} rows to the same experts {ids}; "
        f"expected routing that varies by token. Routing that never varies is an engine "
        f"fault like the known all-zero routing bugs ({_ZERO_DETAIL}); pass "
        f"route_quality=False to accept these routes",
        layer=layer,
        bugs=ZERO_LAYER_BUGS,
    )


__all__ = ["MIN_IDENTICAL_ROWS", "ZERO_LAYER_BUGS", "check_route_quality"]
