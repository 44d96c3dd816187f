"""Where each trajectory's tokens go in a microbatch: alignment, padding, CP chunks.

``docs/design.md``, §5 Layouts for Megatron. Vectorised over trajectories.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from r3arrow._checks import check_positive_int


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
    if cp_size == 1:  # one segment per sequence: all of it
        return _Layout(positions, columns, traj, zeros, full, base, col, gbase, cu, cu_pad, max_len)
    # Chunk r then chunk 2cp-1-r of each sequence (row), back to back; lengths divide by 2cp.
    chunk = full // (2 * cp_size)
    start = np.stack([cp_rank * chunk, (2 * cp_size - 1 - cp_rank) * chunk], axis=1).reshape(-1)
    return _Layout(
        positions,
        columns,
        np.repeat(traj, 2),
        start,
        np.repeat(chunk, 2),
        np.stack([base, base + chunk], axis=1).reshape(-1),
        np.repeat(col, 2),
        np.repeat(gbase, 2) + start,
        cu,
        cu_pad,
        max_len,
    )
