"""One flat ``dict[str, float]`` of R3 metrics for any logger (``docs/metrics.md``).

Keys are stable ``r3/...`` strings, values Python floats, never NaN or infinite: a value
that is undefined (no tokens, no input) is left out, so wandb, TensorBoard and MLflow take
the dict as it is.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from r3arrow.stats._agreement import RouteAgreement
from r3arrow.stats._mismatch import MISMATCH_KEYS

#: Fraction of token routes the trainer's router computed itself (``docs/fallback.md``).
FALLBACK_KEY = "r3/fallback_token_route_fraction"


def _fraction(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name}: expected a float, found {type(value).__name__}")
    out = float(value)
    if not 0.0 <= out <= 1.0:
        raise ValueError(f"{name}: expected a fraction in [0, 1], found {out}")
    return out


def _nonnegative(value: object, name: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise TypeError(f"{name}: expected a float, found {type(value).__name__}")
    out = float(value)
    if not (math.isfinite(out) and out >= 0):
        raise ValueError(f"{name}: expected a finite value >= 0, found {out}")
    return out


def r3_metrics(
    *,
    agreement: RouteAgreement | None = None,
    mismatch: Mapping[str, float] | None = None,
    route_bytes_per_token: float | None = None,
    fallback_token_route_fraction: float | None = None,
    capture_seconds: float | None = None,
    collation_seconds: float | None = None,
) -> dict[str, float]:
    """R3 metrics of one step as a flat ``{"r3/...": float}`` dict for a logger.

    ``agreement`` (`RouteAgreement`, e.g. `route_agreement_by_step` of a step) gives
    ``r3/routing/disagreement`` (fraction of tokens whose top-k set differs on at least
    one router layer), ``r3/routing/identical`` (layer mean of identical fractions) and
    ``r3/routing/layer/{L}/disagreement`` (1 − identical fraction of global layer L);
    ``mismatch`` (a `logprob_mismatch` dict) gives ``r3/mismatch/{key}`` for each of its
    keys; ``route_bytes_per_token`` gives ``r3/route_bytes_per_token``; ``capture_seconds`` /
    ``collation_seconds`` (the step's wall time in route capture and in collation, finite
    ``>= 0``) give ``r3/time/capture_s`` / ``r3/time/collation_s``.
    ``r3/fallback_token_route_fraction`` is always present: ``fallback_token_route_fraction``
    (`RouteFallback.fraction` of the step's rollouts, or the ``fraction`` of its stored
    ``read_diagnostics(kind="fallback")`` row; ``docs/fallback.md``), 0.0 when None (no route
    fell back). Undefined values (no tokens) are left out, never NaN. ``TypeError`` /
    ``ValueError`` for bad inputs.
    """
    out: dict[str, float] = {}
    if agreement is not None:
        if not isinstance(agreement, RouteAgreement):
            raise TypeError(
                f"agreement: expected a RouteAgreement, found {type(agreement).__name__}"
            )
        if agreement.tokens:
            out["r3/routing/disagreement"] = float(agreement.differing_fraction)
            out["r3/routing/identical"] = float(agreement.summary()["identical"])
            for layer, ident in zip(agreement.layers, agreement.identical_fraction, strict=True):
                out[f"r3/routing/layer/{layer}/disagreement"] = 1.0 - float(ident)
    if mismatch is not None:
        if not isinstance(mismatch, Mapping) or set(mismatch) != set(MISMATCH_KEYS):
            raise ValueError(
                f"mismatch: expected a logprob_mismatch dict with keys {list(MISMATCH_KEYS)}, "
                f"found {list(mismatch) if isinstance(mismatch, Mapping) else mismatch!r:.80}"
            )
        for key in MISMATCH_KEYS:
            value: Any = mismatch[key]
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"mismatch[{key!r}]: expected a float, found {value!r:.40}")
            if math.isfinite(value):
                out[f"r3/mismatch/{key}"] = float(value)
    for key, value, name in (
        ("r3/route_bytes_per_token", route_bytes_per_token, "route_bytes_per_token"),
        ("r3/time/capture_s", capture_seconds, "capture_seconds"),
        ("r3/time/collation_s", collation_seconds, "collation_seconds"),
    ):
        if value is not None:
            out[key] = _nonnegative(value, name)
    fallback = fallback_token_route_fraction
    out[FALLBACK_KEY] = 0.0 if fallback is None else _fraction(fallback, "fallback")
    return out


__all__ = ["FALLBACK_KEY", "r3_metrics"]
