"""Where each trajectory's tokens go in a microbatch: alignment, padding, CP chunks.

``docs/design.md``, §5 Layouts for Megatron. Vectorised over trajectories.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from r3arrow._checks import check_positive_int
from r3arrow.errors import RouteShapeError


def alignment_multiple(
    *, align: int = 1, tp_size: int = 1, cp_size: int = 1, fp8: bool = False
) -> int:
    """Length multiple of a sequence (packed) or of the row length (unpacked).

    ``tp``; ``tp*cp*2`` with context parallelism; combined by lcm with ``16*cp``
    under FP8 and with the user's ``align``. Raises `TypeError`/`ValueError` unless
    ``align``, ``tp_size`` and ``cp_size`` are positive ints.
    """
    align = check_positive_int(align, "align")
    tp_size = check_positive_int(tp_size, "tp_size")
    cp_size = check_positive_int(cp_size, "cp_size")
    base = tp_size * cp_size * 2 if cp_size > 1 else tp_size
    if fp8:
        base = math.lcm(base, 16 * cp_size)
    return math.lcm(align, base)


@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where each trajectory's chunks go on this rank (vectorised over segments)."""

    positions: int  # P: positions per column
    columns: int  # C: b (unpacked) or 1 (packed)
    seg_traj: np.ndarray  # trajectory of each segment
    seg_start: np.ndarray  # first token position (in its sequence) of the segment
    seg_len: np.ndarray  # positions in the segment (padding included)
    seg_at: np.ndarray  # first local position
    seg_col: np.ndarray  # column (row of the unpacked batch, 0 packed)
    seg_global: np.ndarray  # first position in the full pre-CP layout (token_index)
    cu_seqlens: np.ndarray | None
    cu_seqlens_padded: np.ndarray | None
    max_seqlen: int


def _layout(n: np.ndarray, *, packed: bool, multiple: int, cp_size: int, cp_rank: int) -> _Layout:
    """The layout of sequences of lengths ``n`` ``[B]`` on CP rank ``cp_rank``."""
    b = n.shape[0]
    traj = np.arange(b, dtype=np.int64)
    zeros = np.zeros(b, dtype=np.int64)
    cu: np.ndarray | None = None
    cu_pad: np.ndarray | None = None
    if packed:
        full = -(-n // multiple) * multiple
        cu_pad = np.concatenate(([0], np.cumsum(full))).astype(np.int64)
        cu = np.concatenate(([0], np.cumsum(n))).astype(np.int64)
        positions, columns, col, gbase = int(cu_pad[-1]) // cp_size, 1, zeros, cu_pad[:-1]
        max_len = int(full.max())
    else:
        max_len = -(-int(n.max()) // multiple) * multiple
        positions, columns, col, gbase = max_len // cp_size, b, traj, zeros
        full = np.full(b, max_len, dtype=np.int64)
    base = gbase // cp_size
    if cp_size == 1:
        return _Layout(positions, columns, traj, zeros, full, base, col, gbase, cu, cu_pad, max_len)
    # Chunk r then chunk 2cp-1-r of each sequence (row), back to back; lengths divide by 2cp.
    chunk = full // (2 * cp_size)
    first, second = cp_rank * chunk, (2 * cp_size - 1 - cp_rank) * chunk

    def pairs(x: np.ndarray, y: np.ndarray) -> np.ndarray:
        return np.stack([x, y], axis=1).reshape(-1)

    return _Layout(
        positions,
        columns,
        np.repeat(traj, 2),
        pairs(first, second),
        np.repeat(chunk, 2),
        pairs(base, base + chunk),
        np.repeat(col, 2),
        pairs(gbase + first, gbase + second),
        cu,
        cu_pad,
        max_len,
    )


def layer_positions(present: Sequence[int], layers: Sequence[int]) -> np.ndarray:
    """int64 index into a routes column's layer axis of each global layer in ``layers``.

    ``present``: the global layer of each route row present (`r3arrow.table.route_layers`).
    Raises `RouteShapeError` naming the missing layers.
    """
    where = {g: i for i, g in enumerate(present)}
    missing = [g for g in layers if g not in where]
    if missing:
        raise RouteShapeError(
            f"routes: expected global layers {list(layers)} (this collator's routers), found a "
            f"table holding layers {list(present)}; missing {missing} (read the table with "
            f"layers= including them)"
        )
    return np.asarray([where[g] for g in layers], dtype=np.int64)
