"""Capture: a rollout's routes, checked once per turn, kept as Arrow (``docs/capture.md``):
`RouteTrace` (base `TokenTrace`) for one trajectory, `TurnStore` for many, and
`check_route_quality`, the guard against known engine bugs; `OnShort`, the policy for a turn
whose routes did not all arrive (``docs/fallback.md``).
"""

from __future__ import annotations

from r3arrow._public import set_homes
from r3arrow.capture._quality import check_route_quality
from r3arrow.capture._store import TurnStore
from r3arrow.capture._trace import OnShort, RouteTrace, TokenTrace

__all__ = ["OnShort", "RouteTrace", "TokenTrace", "TurnStore", "check_route_quality"]

set_homes(globals(), __all__)
