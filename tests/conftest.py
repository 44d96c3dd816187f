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
from r3arrow.spec import RouteSpec

_COMMON: dict[str, Any] = {
    "deadline": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
}
settings.register_profile("default", max_examples=50, **_COMMON)
settings.register_profile("ci", max_examples=25, **_COMMON)
settings.register_profile("thorough", max_examples=500, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


def random_routes(
    rng: np.random.Generator,
    rows: int,
    spec: RouteSpec,
    *,
    num_experts: int | None = None,
    dtype: Any = None,
) -> np.ndarray:
    """Valid routes ``[rows, L, K]``: distinct ids in ``[0, E)`` on router layers, zeros on dense ones.

    ``E`` is ``num_experts`` if given, else ``spec.num_experts`` (else 256); the dtype is
    ``dtype`` if given, else ``spec.dtype`` (it must hold ``E - 1``).
    """
    e = num_experts if num_experts is not None else (spec.num_experts or 256)
    dt = np.dtype(dtype) if dtype is not None else spec.dtype
    out = np.zeros((rows, spec.num_layers, spec.topk), dtype=dt)
    layers = list(spec.router_layers)
    if rows == 0:
        return out
    if rows * len(layers) * e <= 4_000_000:
        # K distinct ids per (token, layer): the first K of a random permutation.
        ids = np.argsort(rng.random((rows, len(layers), e)), axis=-1)[..., : spec.topk]
    else:
        # Large sizes: a random start plus K fixed distinct offsets, modulo E.
        starts = rng.integers(0, e, size=(rows, len(layers), 1))
        ids = (starts + rng.permutation(e)[: spec.topk]) % e
    out[:, layers, :] = ids.astype(dt)
    return out


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
