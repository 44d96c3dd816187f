"""Route-local fallback counts: the token routes a rollout never delivered (``docs/fallback.md``).

A route row marked in ``routes_missing`` holds a placeholder; the trainer's own router
computes that token's experts while every delivered route replays. The counts follow
NeMo-RL (``nemo_rl/experience/rollouts.py``, ``_add_r3_fallback_metrics``): a token route
is one route row (every layer of a missing row is missing, so rows x router layers gives
the same fraction), counted over every captured route row, and the fraction is 0.0 when
there are no route rows.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from r3arrow._schema import captured_lengths, missing_routes
from r3arrow._typing import TableLike
from r3arrow.stats._kernels import exact_sum


@dataclasses.dataclass(frozen=True)
class RouteFallback:
    """Exact fallback counts of rollout rows: ``trajectories`` and ``route_rows`` read, of
    them ``fallback_trajectories`` with at least one missing route row and ``missing_rows``
    missing route rows. Adds (``a + b``, exact: `SchemaError` past int64)."""

    trajectories: int
    fallback_trajectories: int
    route_rows: int
    missing_rows: int

    def __add__(self, other: RouteFallback) -> RouteFallback:
        if not isinstance(other, RouteFallback):
            return NotImplemented
        sums = [
            int(exact_sum(f"RouteFallback.{f.name}", getattr(self, f.name), getattr(other, f.name)))
            for f in dataclasses.fields(self)
        ]
        return RouteFallback(*sums)

    @property
    def fraction(self) -> float:
        """``missing_rows / route_rows``: the fraction of token routes that fell back (0.0
        without route rows), what `r3_metrics` takes as ``fallback_token_route_fraction``."""
        return self.missing_rows / self.route_rows if self.route_rows else 0.0


def route_fallback(table: TableLike) -> RouteFallback:
    """`RouteFallback` of a rollout table or record batch with routes: its ``routes_missing``
    marks counted (none without the column). `SchemaError` for R3 off or bad marks (as
    validation raises)."""
    lengths = captured_lengths(table)
    marks = missing_routes(table)
    if marks is None:
        return RouteFallback(int(lengths.size), 0, int(lengths.sum()), 0)
    parent = np.repeat(np.arange(lengths.size, dtype=np.int64), lengths)
    per = np.bincount(parent[marks != 0], minlength=lengths.size)
    return RouteFallback(
        int(lengths.size), int(np.count_nonzero(per)), int(lengths.sum()), int(marks.sum())
    )


def delivered(table: TableLike, select: np.ndarray | None) -> tuple[np.ndarray | None, int]:
    """(``select`` without the rows whose route is missing, rows dropped so): the selection
    of route rows a statistic over delivered routes reads (``select`` None: all rows)."""
    marks = missing_routes(table)
    if marks is None or not marks.any():
        return select, 0
    gone = marks != 0
    if select is None:
        return ~gone, int(np.count_nonzero(gone))
    return select & ~gone, int(np.count_nonzero(select & gone))


__all__ = ["RouteFallback", "delivered", "route_fallback"]
