"""Capture: a rollout's routes, checked once per turn, kept as Arrow (``docs/capture.md``):
`RouteTrace` (base `TokenTrace`) for one trajectory, `TurnStore` for many, and
`check_route_quality`, the guard against known engine bugs.
"""

from __future__ import annotations

from r3arrow._public import set_homes
from r3arrow.capture._quality import check_route_quality
from r3arrow.capture._store import TurnStore
from r3arrow.capture._trace import RouteTrace, TokenTrace

__all__ = ["RouteTrace", "TokenTrace", "TurnStore", "check_route_quality"]

set_homes(globals(), __all__)
