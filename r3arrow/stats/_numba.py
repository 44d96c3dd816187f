"""Numba kernels of the statistics: one pass over the ids for expert counts and agreement.

Private; `r3arrow.stats._counts` and `r3arrow.stats._agreement` import this module lazily,
on the first statistic computed, through `r3arrow.stats._kernels.numba_kernels` — only
when numba imports (the optional extra ``fast``) and the environment variable
``R3ARROW_NO_NUMBA`` is not set (``""`` or ``"0"`` count as unset; read on every call,
so tests can switch backends). Without numba the numpy
kernels of `r3arrow.stats._kernels` give the same integers.

The kernels never raise: they count (or compare) and flag bad input — an id outside
``[0, num_experts)`` on a router layer, or a repeated id within a top-k set for agreement —
and the caller re-runs the numpy reference on that input, which raises the documented error
(the first offending row, same message and fields as without numba). ``nogil=True``: a
statistic runs in parallel with the prefetching reader (`r3arrow.stats._stream`) and with
itself on several chunks.

Compilation: ``cache=True`` keeps the machine code in ``__pycache__`` (or numba's user cache);
the first call per (dtype, layout) signature in a fresh environment compiles for a few seconds.
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np


@numba.njit(cache=True, nogil=True)
def count_codes(ids: Any, sel: Any, base: Any, e: int, out: Any) -> None:  # pragma: no cover
    """``out[base[l] + min(ids[t, l, k], e)] += 1`` for the selected rows ``t``.

    ``ids`` ``[T, L, K]`` unsigned integers (the caller views signed ids as unsigned);
    ``sel`` uint8 ``[T]`` (empty: every row); ``base`` int64 ``[L]`` (a router layer's
    rank × (e + 1), a dense layer's the discard range). An id ``>= e`` lands in the layer's
    overflow bucket ``e`` (branch-free), so one count there flags a bad id. ``out`` int64,
    accumulated (not cleared). Numba-compiled (the coverage tool does not see the body).
    """
    n, nl, k = ids.shape
    use_sel = sel.size > 0
    for t in range(n):
        if use_sel and sel[t] == 0:
            continue
        for layer in range(nl):
            b = base[layer]
            for j in range(k):
                out[b + min(ids[t, layer, j], e)] += 1


@numba.njit(cache=True, nogil=True)
def count_bytes(ids: Any, sel: Any, base: Any, out: Any) -> None:  # pragma: no cover
    """``out[base[l] + ids[t, l, k]] += 1`` for the selected rows: uint8 ids, 256 per layer.

    The fast path of `count_codes` for one-byte ids: every id has a counter (no clamp), and
    ids ``>= e`` are found afterwards in the counters above ``e``. ``out`` uint32 or int64
    (the caller keeps a call below 2**32 ids per counter).
    """
    n, nl, k = ids.shape
    use_sel = sel.size > 0
    for t in range(n):
        if use_sel and sel[t] == 0:
            continue
        for layer in range(nl):
            b = base[layer]
            for j in range(k):
                out[b + ids[t, layer, j]] += 1


@numba.njit(cache=True, nogil=True)
def agree(
    a: Any, b: Any, sel: Any, pick: Any, e: int, identical: Any, overlap: Any
) -> tuple[int, int, int]:  # pragma: no cover
    """Per router layer ``pick[i]``: identical sets to ``identical[i]``, |A∩B| to ``overlap[i]``.

    ``a``, ``b`` ``[T, L, K]`` integers, aligned rows; ``sel`` uint8 ``[T]`` (empty: every
    row); ``e`` the number of experts. Returns (tokens identical on every layer, tokens
    compared, 1 if an id is out of range or repeats within a set, else 0). Sets are marked
    in two ``[e]`` stamp arrays (a fresh stamp per (token, layer): nothing to clear).
    """
    n = a.shape[0]
    k = a.shape[2]
    marks_a = np.zeros(e, np.int64)
    marks_b = np.zeros(e, np.int64)
    stamp = 0
    all_same = 0
    ntok = 0
    use_sel = sel.size > 0
    for t in range(n):
        if use_sel and sel[t] == 0:
            continue
        ntok += 1
        every = True
        for i in range(pick.size):
            layer = pick[i]
            stamp += 1
            for j in range(k):
                v = b[t, layer, j]
                if v < 0 or v >= e or marks_b[v] == stamp:
                    return all_same, ntok, 1
                marks_b[v] = stamp
            ov = 0
            for j in range(k):
                v = a[t, layer, j]
                if v < 0 or v >= e or marks_a[v] == stamp:
                    return all_same, ntok, 1
                marks_a[v] = stamp
                if marks_b[v] == stamp:
                    ov += 1
            overlap[i] += ov
            if ov == k:
                identical[i] += 1
            else:
                every = False
        if every:
            all_same += 1
    return all_same, ntok, 0


def selection_bytes(sel: np.ndarray | None) -> np.ndarray:
    """``sel`` as the kernels' uint8 view (an empty array for ``None``: every row)."""
    if sel is None:
        return np.zeros(0, np.uint8)
    return sel.view(np.uint8)


__all__ = ["agree", "count_bytes", "count_codes", "selection_bytes"]
