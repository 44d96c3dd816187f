"""`r3arrow.stats.r3_metrics`: the pinned ``r3/...`` keys, hand-computed values, no NaN."""

from __future__ import annotations

import math

import numpy as np
import pytest

import r3arrow
from r3arrow.stats import RouteAgreement, r3_metrics

# 4 tokens, layers 1 and 3, top-2: layer 1 identical on 3 tokens, layer 3 on 2; 2 tokens
# identical on both layers
AGREE = RouteAgreement(
    layers=(1, 3),
    topk=2,
    tokens=4,
    identical=np.array([3, 2], np.int64),
    overlap=np.array([7, 6], np.int64),
    all_identical=2,
)
MISMATCH = {
    "tokens": 3.0,
    "k1": 0.0,
    "k2": 1 / 3,
    "k3": 0.25,
    "abs_mean": 2 / 3,
    "abs_max": 1.0,
    "frac_abs_gt_ln2": 2 / 3,
    "token_mult_prob_error": 2.0,
    "js_divergence": 0.05,
}


def test_the_keys_are_pinned_and_the_values_computed_by_hand() -> None:
    got = r3_metrics(
        agreement=AGREE,
        mismatch=MISMATCH,
        route_bytes_per_token=12.5,
        fallback_token_route_fraction=0.25,
        capture_seconds=0.5,
        collation_seconds=2,
    )
    assert got == {
        "r3/routing/disagreement": 0.5,  # 1 - 2/4
        "r3/routing/identical": pytest.approx(5 / 8),  # (3 + 2) / (4 * 2)
        "r3/routing/layer/1/disagreement": 0.25,  # 1 - 3/4
        "r3/routing/layer/3/disagreement": 0.5,  # 1 - 2/4
        "r3/mismatch/tokens": 3.0,
        "r3/mismatch/k1": 0.0,
        "r3/mismatch/k2": pytest.approx(1 / 3),
        "r3/mismatch/k3": 0.25,
        "r3/mismatch/abs_mean": pytest.approx(2 / 3),
        "r3/mismatch/abs_max": 1.0,
        "r3/mismatch/frac_abs_gt_ln2": pytest.approx(2 / 3),
        "r3/mismatch/token_mult_prob_error": 2.0,
        "r3/mismatch/js_divergence": 0.05,
        "r3/route_bytes_per_token": 12.5,
        "r3/fallback_token_route_fraction": 0.25,
        "r3/time/capture_s": 0.5,
        "r3/time/collation_s": 2.0,
    }
    assert all(type(k) is str and type(v) is float for k, v in got.items())


def test_loggers_never_see_nan_and_the_fallback_key_is_always_there() -> None:
    assert r3_metrics() == {"r3/fallback_token_route_fraction": 0.0}
    empty = {k: (0.0 if k == "tokens" else math.nan) for k in MISMATCH}
    no_tokens = RouteAgreement.empty(r3arrow.RouteSpec(num_layers=2, num_experts=4, topk=2))
    got = r3_metrics(agreement=no_tokens, mismatch=empty)
    assert got == {"r3/mismatch/tokens": 0.0, "r3/fallback_token_route_fraction": 0.0}
    assert all(math.isfinite(v) for v in got.values())


def test_misuse() -> None:
    with pytest.raises(TypeError, match="agreement"):
        r3_metrics(agreement={"tokens": 1})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="mismatch"):
        r3_metrics(mismatch={"k3": 0.1})
    with pytest.raises(ValueError, match="fraction"):
        r3_metrics(fallback_token_route_fraction=1.5)
    with pytest.raises(ValueError, match="route_bytes_per_token"):
        r3_metrics(route_bytes_per_token=-1.0)
    with pytest.raises(ValueError, match="capture_seconds"):
        r3_metrics(capture_seconds=math.inf)
    with pytest.raises(TypeError, match="collation_seconds"):
        r3_metrics(collation_seconds="1s")  # type: ignore[arg-type]
