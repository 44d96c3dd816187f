"""Copy kernels: token slices, and compact route rows → the layer-major replay buffer.

Routes go through the fused pass of `r3arrow.ids.gather_router_ids` (``docs/collation.md``)
once per chunk of the routes column (`_RouteSource`), never per token or per layer.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import numpy as np
import pyarrow as pa

from r3arrow._schema import trajectory_id_at
from r3arrow.errors import DuplicateExpertError, ExpertRangeError, R3ArrowError
from r3arrow.ids import check_routes, gather_router_ids


def _put(
    out: np.ndarray,
    at: int,
    a: int,
    b: int,
    p: int,
    prompt: np.ndarray,
    po: int,
    resp: np.ndarray,
    ro: int,
) -> None:
    """out[at : at+b-a] = tokens [a, b) of a sequence whose first ``p`` tokens are its prompt."""
    if a < p:
        e = min(b, p)
        out[at : at + e - a] = prompt[po + a : po + e]
    if b > p:
        s = max(a, p)
        out[at + s - a : at + b - a] = resp[ro + s - p : ro + b - p]


class _RouteSource:
    """A record batch's compact routes ``[T, L, K]``, offsets, first row and output span."""

    def __init__(
        self, routes: np.ndarray, offsets: np.ndarray, row0: int, batch: pa.RecordBatch
    ) -> None:
        self.routes, self.offsets, self.row0, self.batch = routes, offsets, row0, batch
        self.lo = self.col_lo = sys.maxsize
        self.hi = self.col_hi = -1

    def cover(self, at: int, end: int, col: int) -> None:
        """Record that positions ``[at, end)`` of column ``col`` take rows of this source."""
        self.lo, self.hi = min(self.lo, at), max(self.hi, end)
        self.col_lo, self.col_hi = min(self.col_lo, col), max(self.col_hi, col + 1)

    def pieces(
        self, positions: int, *, packed: bool, split: int
    ) -> list[tuple[_RouteSource, tuple[int, int, int, int]]]:
        """``(self, span)`` in ``split`` pieces of positions; ``span`` as
        `r3arrow.ids.gather_router_ids` takes it."""
        if self.hi < 0:
            return []
        if packed:
            p_lo, p_hi, c_lo, c_hi = self.lo, self.hi, 0, 1
        else:
            p_lo, p_hi, c_lo, c_hi = 0, positions, self.col_lo, self.col_hi
        per = max(1, -(-(p_hi - p_lo) // max(1, split)))
        return [(self, (p0, min(p_hi, p0 + per), c_lo, c_hi)) for p0 in range(p_lo, p_hi, per)]

    def error_at(
        self,
        exc: ExpertRangeError | DuplicateExpertError,
        layer_index: np.ndarray,
        num_experts: int | None,
        layers: Sequence[int],
    ) -> R3ArrowError:
        """``exc`` (its token: a route row of this source) restated with ``row`` (table row),
        ``trajectory_id`` and ``token`` within the trajectory."""
        if exc.token is None:
            return exc
        i = int(np.searchsorted(self.offsets, exc.token, side="right")) - 1
        g = self.row0 + i
        tid = trajectory_id_at(self.batch, i)
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        try:  # the reference check on this trajectory: its token positions and layers
            check_routes(
                self.routes[a:b][:, layer_index],
                num_experts=num_experts,
                layer_ids=layers,
                what=f"routes of row {g}",
            )
        except (ExpertRangeError, DuplicateExpertError) as found:
            return type(found)(
                found.message, trajectory_id=tid, row=g, token=found.token, layer=found.layer
            )
        return exc  # pragma: no cover - the same rows failed the fused pass


def _run_gathers(
    pieces: list[tuple[_RouteSource, tuple[int, int, int, int]]],
    pos_row: np.ndarray,
    lm: np.ndarray,
    layer_index: np.ndarray,
    num_experts: int | None,
    layers: Sequence[int],
    check: bool,
) -> None:
    """One worker's share of the fused pass into ``lm``."""
    for src, span in pieces:
        try:
            gather_router_ids(
                src.routes, layer_index, pos_row, lm, num_experts, layers, span=span, check=check
            )
        except (ExpertRangeError, DuplicateExpertError) as exc:
            raise src.error_at(exc, layer_index, num_experts, layers) from None
