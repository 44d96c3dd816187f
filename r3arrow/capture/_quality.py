"""The route-quality guard: well-formed routes matching a known engine bug (``docs/design.md``,
"Error policy").

With ``K >= 2`` an all-zero row repeats expert 0, a fault at any row count; otherwise a few
tokens may agree by chance, so those rules need `MIN_IDENTICAL_ROWS` rows (a router picking
one set with ``p = 0.5`` does it 32 times with ``0.5**31 < 1e-9``; the known faults hit
whole responses). Run before the id rules so a zeroed layer gets this message; it reads
values by equality only (unvalidated ids are safe). Row 0 and `_SAMPLE_ROWS` rows filter the
layers, so ordinary routes cost O(1) in the row count.
"""

from __future__ import annotations

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
    """`RouteQualityError` if one response's ``[rows, L, K]`` routes match a known engine bug.

    On ``spec.router_layers``: a layer all zeros on every row (``topk >= 2``, or ``min_rows``
    rows), or ``min_rows`` rows routed to one expert set; the ``min_rows`` rules only when
    ``num_experts > topk``. ``layer`` is the first such layer (zeros first). ``ValueError`` if
    ``rows`` is not shaped for ``spec`` or ``min_rows < 2``.
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
    # With num_experts == topk every token uses every expert: one possible expert set, so
    # neither identical routing nor (with K == 1) all zeros says anything about the engine.
    varied = spec.num_experts is None or spec.num_experts > spec.topk
    # All zeros: row 0 names the candidate layers, the rest of the rows confirm them.
    zero = layers[~rows[0, layers].any(axis=-1)]
    if zero.size and (spec.topk >= 2 or (n >= min_rows and varied)):
        confirmed = zero[~rows[:, zero].any(axis=(0, 2))]
        if confirmed.size:
            layer = int(confirmed[0])
            hint = (
                f"; if layer {layer} has no router, declare the router layers with "
                "RouteSpec(moe_layers=...)"
                if spec.moe_layers is None
                else ""
            )
            raise RouteQualityError(
                f"{what}: router layer {layer} is all zeros on all {n} rows, as if every token "
                "selected expert 0; expected the experts the router chose. This matches known "
                f"engine bugs: {_ZERO_DETAIL}; upgrade the engine or turn the feature off, or "
                f"pass route_quality=False to accept these routes{hint}",
                layer=layer,
                bugs=ZERO_LAYER_BUGS,
            )
    if n < min_rows or not varied:
        return
    # Identical routing: the same sorted row on every row of a prefix, then on all rows.
    first = np.sort(rows[0, layers], axis=-1)  # [router layers, K]
    head = np.sort(rows[1:_SAMPLE_ROWS, layers], axis=-1)
    same = (head == first).all(axis=(0, 2))
    if not same.any():
        return
    cand = layers[same]
    ident = (np.sort(rows[:, cand], axis=-1) == first[same]).all(axis=(0, 2))
    if ident.any():
        i = int(np.argmax(ident))
        layer, ids = int(cand[i]), first[same][i].tolist()
        raise RouteQualityError(
            f"{what}: router layer {layer} routes all {n} rows to the same experts {ids}; "
            "expected routing that varies by token. Routing that never varies is an engine "
            f"fault like the known all-zero routing bugs ({_ZERO_DETAIL}); pass "
            "route_quality=False to accept these routes",
            layer=layer,
            bugs=ZERO_LAYER_BUGS,
        )
