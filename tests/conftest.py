"""Shared test settings and helpers for the whole suite (kept small on purpose).

Hypothesis profiles: ``default`` (no deadline, 50 examples), ``ci`` (no deadline,
25 examples, for the 2-core CI box) and ``thorough`` (500 examples). Select with
``HYPOTHESIS_PROFILE=ci``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

from r3arrow.engine import EngineServer, FaultPlan, ReferenceEngine

_COMMON: dict[str, Any] = {
    "deadline": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
}
settings.register_profile("default", max_examples=50, **_COMMON)
settings.register_profile("ci", max_examples=25, **_COMMON)
settings.register_profile("thorough", max_examples=500, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


@pytest.fixture
def plan() -> FaultPlan:
    """An empty fault plan for `server`; tests queue faults on it."""
    return FaultPlan()


@pytest.fixture
def server(engine: ReferenceEngine, plan: FaultPlan) -> Iterator[EngineServer]:
    """The embedded engine over real HTTP on 127.0.0.1 (each test module defines ``engine``)."""
    with EngineServer(engine, faults=plan) as srv:
        yield srv
