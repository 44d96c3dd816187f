"""The route-quality guard (r3arrow.capture): the known engine-bug signatures, and only them.

Valid random routes never trip it (property test over specs); each signature (an all-zero
router layer, identical routing on every row) is planted on literal cases, at and around the
thresholds, on the first or last rows (past the cheap prefilter), and on dense layers where
it must not fire.
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from r3arrow.capture._quality import MIN_IDENTICAL_ROWS, ZERO_LAYER_BUGS, check_route_quality
from r3arrow.errors import DuplicateExpertError, EngineError, RouteQualityError
from r3arrow.ids import check_routes
from r3arrow.spec import RouteSpec
from r3arrow.testing import random_routes
from r3arrow.testing.strategies import routes, specs

FAST = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SPEC = RouteSpec(num_layers=4, topk=2, num_experts=16, moe_layers=(1, 2, 3))
TOP1 = RouteSpec(num_layers=3, topk=1, num_experts=8)


def valid(n: int, spec: RouteSpec = SPEC, seed: int = 0) -> np.ndarray:
    return random_routes(np.random.default_rng(seed), n, spec)


@FAST
@given(data=st.data(), spec=specs(max_layers=5, max_topk=4))
def test_valid_routes_pass(data: st.DataObject, spec: RouteSpec) -> None:
    # Uniform routing over C(E, K) >= 2 expert sets: 32 identical rows on some layer by
    # chance is below 5 * 2**-31 per example (E == K, one possible set, is exempt).
    check_route_quality(data.draw(routes(spec, min_rows=0, max_rows=80)), spec)


@pytest.mark.parametrize("n", [1, 2, 5, 40])
def test_zero_router_layer_topk2_any_row_count(n: int) -> None:
    rows = valid(n)
    rows[:, 2] = 0
    with pytest.raises(RouteQualityError) as info:
        check_route_quality(rows, SPEC, what="routed_experts")
    err = info.value
    assert isinstance(err, EngineError)
    assert err.layer == 2 and err.bugs == ZERO_LAYER_BUGS
    for name in ("vLLM #44116", "#44214", "vllm-ascend #16314", "SGLang #37949"):
        assert name in err.message
    assert err.message.startswith(f"routed_experts: router layer 2 is all zeros on all {n} rows")
    assert "route_quality=False" in err.message and "moe_layers" not in err.message


def test_first_zero_layer_reported_and_dense_zeros_ignored() -> None:
    rows = valid(10)
    assert not rows[:, 0].any()  # layer 0 is dense: zeros by design
    check_route_quality(rows, SPEC)
    rows[:, 3] = 0
    rows[:, 1] = 0
    with pytest.raises(RouteQualityError) as info:
        check_route_quality(rows, SPEC)
    assert info.value.layer == 1


def test_zero_layer_needs_every_row() -> None:
    rows = valid(MIN_IDENTICAL_ROWS + 5)
    rows[:, 1] = 0
    rows[-1, 1] = [3, 4]  # the last row, past the prefilter, is routed
    check_route_quality(rows, SPEC)


def test_topk1_zeros_need_min_rows() -> None:
    rows = valid(MIN_IDENTICAL_ROWS - 1, TOP1)
    rows[:, 1] = 0  # 31 tokens all choosing expert 0 can be a skewed router
    check_route_quality(rows, TOP1)
    rows = np.concatenate([rows, rows[:1]])
    with pytest.raises(RouteQualityError, match=r"router layer 1 is all zeros on all 32 rows"):
        check_route_quality(rows, TOP1)
    # every layer a router layer: the message says how to declare dense ones
    assert TOP1.moe_layers is None
    with pytest.raises(RouteQualityError, match=r"RouteSpec\(moe_layers=\.\.\.\)"):
        check_route_quality(rows, TOP1)


def test_identical_routing_any_order() -> None:
    n = MIN_IDENTICAL_ROWS
    rows = valid(n)
    rows[:, 3] = [5, 9]
    rows[n - 1, 3] = [9, 5]  # same set, other order
    with pytest.raises(RouteQualityError) as info:
        check_route_quality(rows, SPEC)
    assert info.value.layer == 3 and info.value.bugs == ZERO_LAYER_BUGS
    assert f"routes all {n} rows to the same experts [5, 9]" in info.value.message
    rows[n - 1, 3] = [9, 4]  # one row differs, past the prefilter: no fault
    check_route_quality(rows, SPEC)
    rows[n - 1, 3] = [9, 5]
    check_route_quality(rows[:-1], SPEC)  # below the threshold
    check_route_quality(rows, SPEC, min_rows=n + 1)  # the caller's threshold


def test_no_variation_possible_when_experts_equal_topk() -> None:
    spec = RouteSpec(num_layers=2, topk=2, num_experts=2)
    rows = valid(50, spec)  # every token necessarily uses both experts
    check_route_quality(rows, spec)
    one = RouteSpec(num_layers=2, topk=1, num_experts=1)
    check_route_quality(np.zeros((50, 2, 1), dtype=np.uint8), one)


def test_runs_before_the_id_rules() -> None:
    """The client calls the guard first: the all-zero layer reads as the engine bug."""
    rows = valid(6)
    rows[:, 2] = 0
    with pytest.raises(DuplicateExpertError):
        check_routes(rows, SPEC)
    with pytest.raises(RouteQualityError):
        check_route_quality(rows, SPEC)
    bad = valid(6).astype(np.int32)
    bad[0, 1] = [-3, 400]  # unvalidated ids are safe input: the id rules report them
    check_route_quality(bad, SPEC)


def test_argument_errors() -> None:
    with pytest.raises(ValueError, match=r"expected routes \[rows, 4, 2\], found shape \[3, 4\]"):
        check_route_quality(np.zeros((3, 4), dtype=np.uint8), SPEC)
    with pytest.raises(ValueError, match=r"found shape \[3, 3, 2\]"):
        check_route_quality(np.zeros((3, 3, 2), dtype=np.uint8), SPEC)
    with pytest.raises(ValueError, match="min_rows"):
        check_route_quality(valid(3), SPEC, min_rows=1)
    check_route_quality(np.zeros((0, 4, 2), dtype=np.uint8), SPEC)
