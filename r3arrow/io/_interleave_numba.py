"""Numba kernel of `r3arrow.io._interleave`: every run of a token, token by token.

Private; imported lazily by `r3arrow.io._interleave` (never by ``import r3arrow``) when
numba imports and ``R3ARROW_NO_NUMBA`` is unset. ``cache=True``: the machine code is stored
next to this file (or in numba's user cache; ``NUMBA_CACHE_DIR`` overrides), so only the
first process in an environment compiles (about 1-3 s per word size); ``nogil=True``: row
ranges run on several threads.
"""

from __future__ import annotations

from typing import Any

import numba

#: Sources per kernel call: callers pad the tuple to this length (one compiled signature).
ARITY = 8


@numba.njit(cache=True, nogil=True, boundscheck=False)
def copy_runs(out: Any, srcs: Any, runs: Any, r0: int, r1: int) -> None:  # pragma: no cover
    """``out[i, d:d+n] = srcs[p][i, s:s+n]`` for each run ``(p, s, d, n)`` and row ``r0..r1``.

    ``out``: ``[T, W]`` words (C order); ``srcs``: a tuple of ``ARITY`` ``[T, w_p]`` word
    arrays; ``runs``: ``[R, 4]`` int64. Token-major: each output row is written once, in
    cache, from every source.
    """
    nruns = runs.shape[0]
    for i in range(r0, r1):
        row = out[i]
        for r in range(nruns):
            p = runs[r, 0]
            s = runs[r, 1]
            d = runs[r, 2]
            n = runs[r, 3]
            src = srcs[p][i]
            for j in range(n):
                row[d + j] = src[s + j]


__all__ = ["ARITY", "copy_runs"]
