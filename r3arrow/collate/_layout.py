"""Where each trajectory's tokens go in a microbatch: alignment, padding, CP chunks.

See ``docs/design.md``, "Layouts for Megatron": sequences start at position 0 of their row
(unpacked) or segment (packed); alignment and batch padding follow them. Context-parallel
rank r keeps chunks r and 2·cp−1−r of every sequence (unpacked: of every row) split into
2·cp chunks. Everything here is vectorised over trajectories.
"""

from __future__ import annotations

import dataclasses
import itertools
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


def _round_up(x: np.ndarray, m: int) -> np.ndarray:
    return np.asarray(-(-x // m) * m, dtype=np.int64)


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
    if packed:
        padded = _round_up(n, multiple)
        cu_pad = np.zeros(b + 1, dtype=np.int64)
        np.cumsum(padded, out=cu_pad[1:])
        cu = np.zeros(b + 1, dtype=np.int64)
        np.cumsum(n, out=cu[1:])
        positions, columns = int(cu_pad[-1]) // cp_size, 1
        col = np.zeros(b, dtype=np.int64)
        full, base, gbase = padded, cu_pad[:-1] // cp_size, cu_pad[:-1]
        cu_out, cu_pad_out, max_len = cu, cu_pad, int(padded.max())
    else:
        width = int(_round_up(n.max(keepdims=True), multiple)[0])
        positions, columns = width // cp_size, b
        col = traj
        full = np.full(b, width, dtype=np.int64)
        base, gbase = np.zeros(b, dtype=np.int64), np.zeros(b, dtype=np.int64)
        cu_out, cu_pad_out, max_len = None, None, width
    if cp_size == 1:
        return _Layout(
            positions,
            columns,
            traj,
            np.zeros(b, np.int64),
            full,
            base,
            col,
            gbase,
            cu_out,
            cu_pad_out,
            max_len,
        )
    # Chunk r then chunk 2cp-1-r of each sequence (row), back to back; lengths divide by 2cp.
    chunk = full // (2 * cp_size)
    first, second = cp_rank * chunk, (2 * cp_size - 1 - cp_rank) * chunk
    return _Layout(
        positions,
        columns,
        np.repeat(traj, 2),
        np.stack([first, second], axis=1).reshape(-1),
        np.repeat(chunk, 2),
        np.stack([base, base + chunk], axis=1).reshape(-1),
        np.repeat(col, 2),
        np.stack([gbase + first, gbase + second], axis=1).reshape(-1),
        cu_out,
        cu_pad_out,
        max_len,
    )


def _layer_selector(layers: Sequence[int]) -> slice | np.ndarray:
    """A basic slice when the layers are an arithmetic progression (a view), else an index array."""
    if len(layers) == 1:
        return slice(layers[0], layers[0] + 1)
    step = layers[1] - layers[0]
    if step > 0 and all(b - a == step for a, b in itertools.pairwise(layers)):
        return slice(layers[0], layers[-1] + 1, step)
    return np.asarray(layers, dtype=np.intp)


def layer_positions(present: Sequence[int], layers: Sequence[int]) -> np.ndarray:
    """int64 index into a routes column's layer axis of each global layer in ``layers``.

    ``present``: the global layer id of each route row present (`r3arrow.table.route_layers`;
    a projected table holds a subset, layer projection). Raises `RouteShapeError` naming the
    layers that are missing.
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
