"""Numba kernel of the agreement probe: ``|native ∩ replayed|`` per token in one read of the scores.

Private; `r3arrow.megatron._probe` imports it lazily (only when numba imports — the optional
extra ``fast`` — and ``R3ARROW_NO_NUMBA`` is unset) for CPU float32/float64/bfloat16 scores
without group-limited routing. Without it the probe's torch path gives the same integers.

Per row: no allocation, one int8 written (``docs/replay-probe.md``, "Cost"):

* **Sure identical.** ``floor`` = the weakest replayed score; when the replayed ids are
  distinct and exactly K experts score ``>= floor`` (NaN counts as above: torch.topk ranks
  it first), the replayed set R is the unique top-k set N: the row is K.
* **Otherwise**, with R's scores sorted (u_1 >= ... >= u_K) and c(v) = #experts scoring
  ``>= v``: R's members in N are u_1..u_p, p the largest j with c(u_j) <= K. One more
  counting pass per step down (at most two steps): c(u_p) = K decides the row (p);
  c(u_p) = K-1 with one max/second-max pass below u_p (strict: N unique) decides it
  (p, plus one when u_(p+1) is that max).
* **General** (further down, or repeated replayed ids from an unchecked target): the K+1
  largest by insertion; when the K-th is strictly above the (K+1)-th, N = {e : score >=
  K-th} is unique, whatever top-k implementation picks it, and ``|N ∩ R|`` counts R's
  distinct ids scoring at least the K-th.
* **Unsure** — a tie across the K-th place, a NaN, an id outside ``[0, E)`` — the row is
  ``-2`` and the caller runs megatron's own top-k on it (ties decided exactly as the router
  decides them; a bad id raises there).

Compilation: ``cache=True`` keeps the machine code in ``__pycache__``; a fresh environment
compiles once per signature (a few seconds).
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

UNSURE = -2  # the row needs the native top-k
PADDING = -1  # the row is padding (not counted)


@numba.njit(cache=True, nogil=True, inline="always")
def _row(s: Any, i: int, ids: Any, t: int, top: Any, mark: Any) -> int:  # pragma: no cover
    """``|N ∩ R|`` of one row: scores ``s[i]`` (float ``[., E]``), replayed ids ``ids[t]``
    (``[., K]``; 2-D indexing, not row views: a view costs a reference count per row);
    scratch: ``top`` ``[K + 1]`` of ``s``'s dtype, ``mark`` uint8 ``[E]``, all zero on entry
    (the caller clears ``mark[ids]`` after the row). `UNSURE` when N is not decided."""
    e_n = s.shape[1]
    k = ids.shape[1]
    for j in range(k):
        if ids[t, j] < 0 or ids[t, j] >= e_n:
            return UNSURE
    floor = np.inf
    nan = False
    distinct = True
    for j in range(k):
        r = ids[t, j]
        v = s[i, r]
        nan |= v != v
        if v < floor:
            floor = v
        distinct &= mark[r] == 0
        mark[r] = 1
    if nan:
        return UNSURE
    if not distinct:
        return _row_repeated(s[i], ids[t], top)
    above = 0
    for e in range(e_n):
        above += not (s[i, e] < floor)  # NaN counts as above (torch.topk ranks it first)
    if above == k:
        return int(k)
    # R's scores descending (u_1 >= ... >= u_K). With c(v) = #experts scoring >= v (NaN
    # counted: torch.topk ranks it first), R's members in N are u_1..u_p, p the largest j
    # with c(u_j) <= K; c(u_K) > K here. One counting pass per step down, at most two.
    n = 0
    for j in range(k):
        n = _insert(top, n, k, s[i, ids[t, j]])
    for p in range(k - 1, max(k - 3, 0), -1):
        up = top[p - 1]
        above = 0
        for e in range(e_n):
            above += not (s[i, e] < up)
        if above > k:
            continue
        if above == k:  # exactly K experts >= u_p: N = those, the (K+1)-th is below
            return p
        if above < k - 1:
            break  # N needs two or more experts below u_p: the general path
        # N = the K-1 experts >= u_p and the largest one below; decided when that one is
        # unique (a strict second): it is R's u_(p+1) or not
        m1 = -np.inf
        m2 = -np.inf
        for e in range(e_n):
            x = s[i, e]
            nan |= x != x
            if x < up:
                m2 = max(m2, min(m1, x))
                m1 = max(m1, x)
        if nan or not (m1 > m2):
            return UNSURE
        return p + int(top[p] == m1)
    # general: the K+1 largest, descending: R's scores (in top already), then the other
    # experts against the current (K+1)-th: R holds most of the top, so few insert
    top[k] = -np.inf
    for e in range(e_n):
        x = s[i, e]
        nan |= x != x
        if x > top[k] and mark[e] == 0:
            _insert(top, k + 1, k, x)
    kth = top[k - 1]
    if nan or top[k] == kth:  # a tie across the K-th place: megatron's top-k decides
        return UNSURE
    hits = 0
    for j in range(k):
        hits += s[i, ids[t, j]] >= kth
    return hits


@numba.njit(cache=True, nogil=True, inline="always")
def _insert(top: Any, n: int, k: int, x: Any) -> int:  # pragma: no cover
    """Insert ``x`` into the descending ``top[:n]`` (capacity K+1); return the new length."""
    if n <= k:
        i = n
        n += 1
    else:
        i = k
    while i > 0 and top[i - 1] < x:
        top[i] = top[i - 1]
        i -= 1
    top[i] = x
    return n


@numba.njit(cache=True, nogil=True)
def _row_repeated(s: Any, ids: Any, top: Any) -> int:  # pragma: no cover
    """`_row` when the replayed ids repeat one (an unchecked target): the K+1 largest of
    every expert, then R's distinct ids scoring at least the K-th."""
    k = ids.shape[0]
    n = 0
    for e in range(s.shape[0]):
        x = s[e]
        if x != x:
            return UNSURE
        if n <= k or x > top[k]:
            n = _insert(top, n, k, x)
    kth = top[k - 1]
    if top[k] == kth:
        return UNSURE
    hits = 0
    for j in range(k):
        seen = False
        for i in range(j):
            seen |= ids[i] == ids[j]
        hits += (not seen) and s[ids[j]] >= kth
    return hits


@numba.njit(cache=True, nogil=True)
def overlap_rows(scores: Any, ids: Any, pad: Any, out: Any) -> int:  # pragma: no cover
    """Fill ``out`` (int8 ``[T]``) with ``|N ∩ R|`` per row; return the number of `UNSURE` rows.

    ``scores`` ``[T, E]`` float32/float64 (C order), ``E > K``; ``ids`` ``[T, K]`` int32 or
    int64; ``pad`` uint8 ``[T]`` (nonzero: padding, row `PADDING`) or empty (no mask).
    """
    t_n = scores.shape[0]
    k = ids.shape[1]
    use_pad = pad.size > 0
    top = np.empty(k + 1, scores.dtype)
    mark = np.zeros(scores.shape[1], np.uint8)
    unsure = 0
    for t in range(t_n):
        if use_pad and pad[t] != 0:
            out[t] = PADDING
            continue
        v = _row(scores, t, ids, t, top, mark)
        for j in range(k):  # clear the row's marks (an id out of range set none)
            if 0 <= ids[t, j] < mark.size:
                mark[ids[t, j]] = 0
        out[t] = v
        unsure += v == UNSURE
    return unsure


@numba.njit(cache=True, nogil=True)
def overlap_rows_bf16(bits: Any, ids: Any, pad: Any, out: Any) -> int:  # pragma: no cover
    """`overlap_rows` for bfloat16 scores given as their uint16 bit patterns ``[T, E]``:
    each row widens to float32 exactly (the high half of the float32 pattern) in a scratch
    row, so every comparison is the bfloat16 one."""
    t_n, e_n = bits.shape
    k = ids.shape[1]
    use_pad = pad.size > 0
    wide = np.empty(e_n, np.uint32)
    row = wide.view(np.float32).reshape((1, e_n))
    top = np.empty(k + 1, np.float32)
    mark = np.zeros(e_n, np.uint8)
    unsure = 0
    for t in range(t_n):
        if use_pad and pad[t] != 0:
            out[t] = PADDING
            continue
        for e in range(e_n):
            wide[e] = np.uint32(bits[t, e]) << np.uint32(16)
        v = _row(row, 0, ids, t, top, mark)
        for j in range(k):  # clear the row's marks (an id out of range set none)
            if 0 <= ids[t, j] < mark.size:
                mark[ids[t, j]] = 0
        out[t] = v
        unsure += v == UNSURE
    return unsure


__all__ = ["PADDING", "UNSURE", "overlap_rows", "overlap_rows_bf16"]
