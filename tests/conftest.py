"""Shared test settings and fixtures for the whole suite (the one place for them).

Hypothesis profiles: ``default`` (no deadline, 50 examples), ``ci`` (no deadline,
25 examples, for the 2-core CI box) and ``thorough`` (500 examples). Select with
``HYPOTHESIS_PROFILE=ci``.

Data builders and strategies are not fixtures: tests import them from `r3arrow.testing`
(`random_routes`, `random_rollouts`, `assert_rollouts_equal`) and
`r3arrow.testing.strategies` (`specs`, `routes`, `shapes`, `rollout_tables`), never from
this file.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from r3arrow.spec import RouteSpec
from r3arrow.testing import random_rollouts
from r3arrow.testing.strategies import specs

if TYPE_CHECKING:  # the engine needs torch: imported only by the fixtures that use it, so the
    # core tests run in a venv with only the core requirements (.ci/run)
    from r3arrow.testing.engine import EngineServer, FaultPlan, ReferenceEngine

_COMMON: dict[str, Any] = {
    "deadline": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
}
settings.register_profile("default", max_examples=50, **_COMMON)
settings.register_profile("ci", max_examples=25, **_COMMON)
settings.register_profile("thorough", max_examples=500, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

# ``st.from_type(RouteSpec)`` draws from the shared strategy.
st.register_type_strategy(RouteSpec, specs())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``vllm`` need a real vLLM at ``R3ARROW_VLLM_URL``: skipped without one.

    CI (``.ci/run``) starts a real vLLM and sets ``R3ARROW_REQUIRE_VLLM=1``: there a missing
    server is a failure of the whole run, never a skip.
    """
    vllm_items = [item for item in items if item.get_closest_marker("vllm") is not None]
    if not vllm_items or os.environ.get("R3ARROW_VLLM_URL"):
        return
    if os.environ.get("R3ARROW_REQUIRE_VLLM") == "1":
        pytest.exit(
            "R3ARROW_REQUIRE_VLLM=1 but R3ARROW_VLLM_URL is not set: expected the URL of the "
            "vLLM server that .ci/run starts",
            returncode=1,
        )
    skip = pytest.mark.skip(
        reason="no real vLLM server configured: set R3ARROW_VLLM_URL to a vLLM server started "
        "with --enable-return-routed-experts --enable-scale-out (see README, 'Testing against a "
        "real vLLM')"
    )
    for item in vllm_items:
        item.add_marker(skip)


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


@pytest.fixture
def small_spec() -> RouteSpec:
    """4 layers (layer 0 dense), top-2 of 8 experts: the demo's model shape, ids uint8."""
    return RouteSpec(num_layers=4, topk=2, num_experts=8, moe_layers=(1, 2, 3))


@pytest.fixture
def small_rollouts(rng: np.random.Generator, small_spec: RouteSpec) -> pa.Table:
    """A valid 4-trajectory rollout table of `small_spec` (two groups of two): fully captured,
    one short of the last token, a zero-row trajectory, and one with a terminal gap."""
    return random_rollouts(rng, small_spec, [(5, 4, 9), (3, 6, 8), (4, 2, 0), (2, 5, 5)])


@pytest.fixture
def plan() -> FaultPlan:
    """An empty fault plan for `server`; tests queue faults on it."""
    from r3arrow.testing.engine import FaultPlan

    return FaultPlan()


@pytest.fixture
def server(engine: ReferenceEngine, plan: FaultPlan) -> Iterator[EngineServer]:
    """The embedded engine over real HTTP on 127.0.0.1 (each test module defines ``engine``)."""
    from r3arrow.testing.engine import EngineServer

    with EngineServer(engine, faults=plan) as srv:
        yield srv
