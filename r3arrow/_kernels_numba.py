"""Numba kernels behind `r3arrow.ids`: the first token whose top-k row repeats an id, and
the fused collation pass (`gather_widen`: gather, check while compact, widen to int32;
``docs/collation.md``).

Private; `r3arrow.ids` imports this module lazily, on the first CPU check, and only when numba
imports and ``R3ARROW_NO_NUMBA`` is not set (docs/design.md, "Expert ids"). The kernels only
*find* the first failing token; `r3arrow.ids` then runs its reference block check on the block
holding that token, so messages, error fields and the "first offender" rule are the reference
check's.

Three paths, all returning the smallest failing token index (``-1``: no duplicate), for
``[tokens, layers, K]`` or, with ``layers_first``, ``[layers, tokens, K]`` ids:

* words (C-contiguous, little-endian, a row of ``K * itemsize`` = 2, 4 or 8 bytes): the ids
  are read as uint64 words of ``64 // (K * itemsize)`` whole rows, ``K`` lanes of 8, 16 or 32
  bits each. For each rotation ``r = 1 .. K // 2`` by ``r`` lanes within every row,
  ``x = w ^ rot(w, r)`` has a zero lane exactly when two ids at distance ``r`` (or ``K - r``)
  in one row are equal, and ``(x - 0x01..01) & ~x & 0x80..80`` (per lane) is nonzero exactly
  when ``x`` has a zero lane. The test is OR-accumulated over a chunk of words without
  branches, which LLVM vectorises; a failing chunk is rescanned row by row. Rows outside the
  whole words (head and tail of a range) are tested one by one.
* elements (C-contiguous, any other row size): per row, the ``K // 2`` lane rotations compare
  ``K`` ids each (every pair of positions at least once), unrolled for the usual ``K``.
* general (any strides): a chunk of rows is transposed into a ``[K, chunk]`` buffer, then each
  rotation and position is one contiguous vector comparison.

Top-8 uint8 rows (the usual shape) have kernels of their own with constant shifts and masks
(`r3arrow._kernels_top8`): numba passes ``k``/``bits`` as runtime values, so the generic word
kernels cannot fold them, and those run about twice as fast. `scan_top8` is the fused
per-turn check of `r3arrow.ids.check_turn_routes` (range and duplicates, one pass);
`gather_widen` of top-8 uint8 runs `_gather8` (test in registers, widen without staging).

Compilation: ``cache=True`` stores the machine code in ``__pycache__`` next to this file (or
numba's user cache where that is not writable; ``NUMBA_CACHE_DIR`` overrides), so the first
call in a fresh environment compiles for about 2-6 s per (dtype, layout, writable) signature
(5.5 s for C-contiguous uint8 on a busy 2-core machine; a later process loads the cached
code: 0.26 s for its first check including numba's import, 0.01 s per other kernel);
`warm_up` compiles the common signatures outside any timed code. ``nogil=True``: the checks
run in parallel with other Python threads.
"""

from __future__ import annotations

import sys
from typing import Any

import numba
import numpy as np

from r3arrow._kernels_top8 import _first_row8, _gather8, _scan8

_CHUNK = 1024  # rows per chunk: the chunk's words (or transposed ids) stay in L1

_WORD: dict[int, np.dtype[Any]] = {
    2: np.dtype(np.uint16),
    4: np.dtype(np.uint32),
    8: np.dtype(np.uint64),
}


@numba.njit(cache=True, nogil=True)
def _lane_masks(k: int, bits: int, fields: int) -> tuple[Any, Any, Any]:
    """``(ones, highs, rows)`` for ``fields`` rows of ``k`` lanes of ``bits`` in a uint64:
    bit 0 of every lane, the top bit of every lane, and every row's bits (all ones)."""
    kb = k * bits
    one = np.uint64(1)
    ones = np.uint64(0)
    for q in range(k * fields):
        ones |= one << np.uint64(q * bits)
    field = np.uint64(0xFFFFFFFFFFFFFFFF) if kb == 64 else (one << np.uint64(kb)) - one
    rows = np.uint64(0)
    for q in range(fields):
        rows |= field << np.uint64(q * kb)
    return ones, ones << np.uint64(bits - 1), rows


@numba.njit(cache=True, nogil=True)
def _row_fails(v: Any, k: int, bits: int) -> bool:
    """Row ``v`` (``k`` lanes of ``bits`` in the low ``k * bits`` bits) has two equal lanes."""
    kb = k * bits
    ones, highs, field = _lane_masks(k, bits, 1)
    for r in range(1, k // 2 + 1):
        s = r * bits
        x = v ^ (((v >> np.uint64(s)) | (v << np.uint64(kb - s))) & field)
        if (x - ones) & ~x & highs:
            return True
    return False


@numba.njit(cache=True, nogil=True)
def _first_row_fail(words: Any, rows: Any, start: int, stop: int, k: int, bits: int) -> int:
    """First row in ``[start, stop)`` with two equal lanes, else -1.

    ``rows``: one unsigned word per row (``k`` lanes of ``bits``); ``words``: the same bytes
    as uint64, ``64 // (k * bits)`` rows each (the whole words only). Called with literal
    ``k`` and ``bits`` (`_first_row`): LLVM inlines it and folds the masks and shifts into
    constants (about twice the speed of runtime shift amounts). Words are tested in chunks,
    OR-accumulating without branches (vectorised); a failing chunk is rescanned row by row.
    """
    kb = k * bits
    per = 64 // kb  # rows per uint64
    ones, highs, field = _lane_masks(k, bits, per)
    lo_word = (start + per - 1) // per  # words wholly inside [start, stop)
    hi_word = min(stop // per, words.shape[0])
    head_end = min(stop, lo_word * per)
    for j in range(start, head_end):
        if _row_fails(np.uint64(rows[j]), k, bits):
            return j
    i = lo_word
    while i < hi_word:
        end = min(i + _CHUNK, hi_word)
        acc = np.uint64(0)
        for j in range(i, end):  # branch-free: vectorised across words
            v = words[j]
            t = np.uint64(0)  # `& highs` once per word, not per rotation (half the time)
            for r in range(1, k // 2 + 1):
                s = r * bits
                if kb == 64:  # one row per word: a plain rotation
                    rot = (v >> np.uint64(s)) | (v << np.uint64(64 - s))
                else:
                    low = np.uint64(0)  # per row: the bits that move down by s (rotation)
                    for q in range(per):
                        low |= ((np.uint64(1) << np.uint64(kb - s)) - np.uint64(1)) << np.uint64(
                            q * kb
                        )
                    high = field & ~low
                    rot = ((v >> np.uint64(s)) & low) | ((v << np.uint64(kb - s)) & high)
                x = v ^ rot
                t |= (x - ones) & ~x
            acc |= t & highs
        if acc != 0:
            for j in range(i * per, end * per):  # this chunk fails: its first failing row
                if _row_fails(np.uint64(rows[j]), k, bits):
                    return j
        i = end
    for j in range(max(head_end, hi_word * per), stop):
        if _row_fails(np.uint64(rows[j]), k, bits):
            return j
    return -1


def scan_top8(x: np.ndarray, bound: int | None) -> int | None:
    """One fused pass over C-contiguous uint8 ids ``x`` ``[..., 8]`` (the usual top-8 of at
    most 256 experts): every id ``< bound`` and no row repeating an id. Returns an upper
    bound of the largest id (the largest lane of the OR of all rows, capped at ``bound - 1``)
    when both hold, None when some row fails (or ``x`` does not fit: the caller
    then runs the reference checks)."""
    if (
        x.dtype != np.uint8
        or x.ndim < 1
        or x.shape[-1] != 8
        or not x.flags.c_contiguous
        or sys.byteorder != "little"
    ):
        return None
    lane = _LANE8.get(bound)
    if lane is None:  # a few bounds per process (one per model): cached, not per call
        mode, c = range_constant(8, bound, False)
        lane = _LANE8[bound] = (mode, np.uint64(c))
    seen, bad = _scan8(x.reshape(-1).view(np.uint64), lane[0], lane[1])
    if bad:
        return None
    top = max(int(seen).to_bytes(8, "little"))  # per lane, an OR is >= every id it covers
    return top if bound is None else min(top, bound - 1)  # every id passed ``< bound``


_LANE8: dict[int | None, tuple[int, Any]] = {}  # bound -> (mode, lane constant) of scan_top8


@numba.njit(cache=True, nogil=True)
def _first_row(words: Any, rows: Any, start: int, stop: int, k: int, bits: int) -> int:
    """`_first_row_fail` with literal ``k`` and ``bits``, one branch per row width of ``rows``
    (its itemsize is known when compiling: only the matching branches are kept)."""
    width = rows.itemsize
    if width == 8:
        if k == 8:
            return int(_first_row8(rows, start, stop))
        if k == 4:
            return int(_first_row_fail(words, rows, start, stop, 4, 16))
        return int(_first_row_fail(words, rows, start, stop, 2, 32))
    if width == 4:
        if k == 4:
            return int(_first_row_fail(words, rows, start, stop, 4, 8))
        return int(_first_row_fail(words, rows, start, stop, 2, 16))
    return int(_first_row_fail(words, rows, start, stop, 2, 8))


@numba.njit(cache=True, nogil=True)
def _first_token_words(
    words: Any, rows: Any, n_a: int, n_b: int, layers_first: bool, k: int, bits: int
) -> int:
    """`first_duplicate_token` on C-contiguous ``[A, B]`` rows (``rows``, one word each)."""
    if not layers_first:
        j = _first_row(words, rows, 0, n_a * n_b, k, bits)
        return -1 if j < 0 else j // n_b
    limit = n_b  # layers first: the smallest failing token over all layers
    for a in range(n_a):
        j = _first_row(words, rows, a * n_b, a * n_b + limit, k, bits)
        if j >= 0:
            limit = j - a * n_b
    return limit if limit < n_b else -1


@numba.njit(cache=True, nogil=True)
def _first_row_elems_fail(flat: Any, start: int, stop: int, k: int) -> int:
    """First row in ``[start, stop)`` of C-contiguous ``flat`` (rows of ``k`` ids) repeating an
    id, else -1. Called with a literal ``k`` (`_first_row_elems`): the ``K // 2`` lane
    rotations unroll and LLVM vectorises across rows with interleaved loads."""
    i = start
    while i < stop:
        end = min(i + _CHUNK, stop)
        acc = False
        for j in range(i, end):
            b = j * k
            for r in range(1, k // 2 + 1):
                for q in range(k):
                    acc |= flat[b + q] == flat[b + (q + r) % k]
        if acc:
            for j in range(i, end):
                b = j * k
                for r in range(1, k // 2 + 1):
                    for q in range(k):
                        if flat[b + q] == flat[b + (q + r) % k]:
                            return j
        i = end
    return -1


@numba.njit(cache=True, nogil=True)
def _first_row_elems(flat: Any, start: int, stop: int, k: int) -> int:
    """`_first_row_elems_fail` with a literal ``k`` for the usual top-k (3 to 10)."""
    if k == 8:
        return int(_first_row_elems_fail(flat, start, stop, 8))
    if k == 6:
        return int(_first_row_elems_fail(flat, start, stop, 6))
    if k == 4:
        return int(_first_row_elems_fail(flat, start, stop, 4))
    if k == 10:
        return int(_first_row_elems_fail(flat, start, stop, 10))
    if k == 3:
        return int(_first_row_elems_fail(flat, start, stop, 3))
    return int(_first_row_elems_fail(flat, start, stop, k))


@numba.njit(cache=True, nogil=True)
def _first_token_elems(flat: Any, n_a: int, n_b: int, layers_first: bool, k: int) -> int:
    """`first_duplicate_token` on C-contiguous ids ``flat`` (``[A, B, K]`` flattened)."""
    if not layers_first:
        j = _first_row_elems(flat, 0, n_a * n_b, k)
        return -1 if j < 0 else j // n_b
    limit = n_b
    for a in range(n_a):
        j = _first_row_elems(flat, a * n_b, a * n_b + limit, k)
        if j >= 0:
            limit = j - a * n_b
    return limit if limit < n_b else -1


@numba.njit(cache=True, nogil=True)
def _chunk_fail(xt: Any, m: int, k: int) -> int:
    """First column ``< m`` of ``xt`` ``[K, chunk]`` holding two equal ids, else -1."""
    acc = False
    for r in range(1, k // 2 + 1):
        for i in range(k):
            i2 = (i + r) % k
            for c in range(m):  # contiguous: vectorised
                acc |= xt[i, c] == xt[i2, c]
    if not acc:
        return -1
    for c in range(m):
        for r in range(1, k // 2 + 1):
            for i in range(k):
                if xt[i, c] == xt[(i + r) % k, c]:
                    return c
    return -1  # pragma: no cover - acc said some column fails


@numba.njit(cache=True, nogil=True)
def _first_token_general(x: Any, layers_first: bool) -> int:
    """`first_duplicate_token` for any ``K``, dtype and strides (transposed chunks)."""
    n_a, n_b, k = x.shape
    xt = np.empty((k, _CHUNK), dtype=x.dtype)
    if not layers_first and n_b > _CHUNK:  # tokens wider than a chunk: piece by piece
        for a in range(n_a):
            for b0 in range(0, n_b, _CHUNK):
                m = min(_CHUNK, n_b - b0)
                for q in range(m):
                    for i in range(k):
                        xt[i, q] = x[a, b0 + q, i]
                if _chunk_fail(xt, m, k) >= 0:
                    return a
        return -1
    if not layers_first:  # whole tokens per chunk, rows in (token, layer) order
        per = _CHUNK // n_b
        for a0 in range(0, n_a, per):
            a1 = min(a0 + per, n_a)
            m = 0
            for a in range(a0, a1):
                for b in range(n_b):
                    for i in range(k):
                        xt[i, m] = x[a, b, i]
                    m += 1
            c = _chunk_fail(xt, m, k)
            if c >= 0:
                return int(a0 + c // n_b)
        return -1
    limit = n_b  # layers first: tokens along axis 1, the smallest failing one over layers
    for a in range(n_a):
        t0 = 0
        while t0 < limit:
            m = min(_CHUNK, limit - t0)
            for q in range(m):
                for i in range(k):
                    xt[i, q] = x[a, t0 + q, i]
            c = _chunk_fail(xt, m, k)
            if c >= 0:
                limit = t0 + c
                break
            t0 += m
    return limit if limit < n_b else -1


def _word_views(x: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """``x`` ``[A, B, K]`` as (whole uint64 words, one word per row), or None where rows are
    not 2, 4 or 8 bytes of a C-contiguous little-endian array."""
    row = _WORD.get(x.shape[2] * x.dtype.itemsize)
    if row is None or not x.flags.c_contiguous or sys.byteorder != "little":
        return None
    flat = x.reshape(-1).view(np.uint8)
    n_words = flat.shape[0] // 8
    return flat[: n_words * 8].view(np.uint64), flat.view(row)


def first_duplicate_token(x: np.ndarray, layers_first: bool) -> int:
    """The smallest token index whose row of ``x`` repeats an id, or -1 for none.

    ``x``: integer ids ``[tokens, layers, K]`` (``[layers, tokens, K]`` with
    ``layers_first``), any strides. Signed ids compare as bit patterns (exact).
    """
    if x.size == 0 or x.shape[2] < 2:
        return -1
    # Equality of bit patterns: signed ids as the unsigned type of their size (exact, and
    # half as many compiled signatures).
    x = x.view(np.dtype(f"u{x.dtype.itemsize}"))
    n_a, n_b, k = (int(v) for v in x.shape)
    views = _word_views(x)
    if views is None and x.flags.c_contiguous:
        return int(_first_token_elems(x.reshape(-1), n_a, n_b, layers_first, k))
    if views is None:
        return int(_first_token_general(x, layers_first))
    words, rows = views
    return int(_first_token_words(words, rows, n_a, n_b, layers_first, k, 8 * x.dtype.itemsize))


_GATHER_BLOCK = 256  # positions per block of the fused gather: the block's words stay in L1


@numba.njit(cache=True, nogil=True, inline="always")
def _range_bits(w: Any, mode: int, c: Any, highs: Any) -> Any:
    """Top bits of the lanes of ``w`` out of range (``mode`` 0: no bound; 1: lane ``>= b`` for
    a bound ``b <= 2**(bits-1)``, negative signed lanes included; 2: lane ``>= b`` for a bound
    above that), ``c`` the bound's lane constant (`range_constant`)."""
    if mode == 0:
        return np.uint64(0)
    low = (w & ~highs) + c  # lanes of at most bits-1 bits plus c: no carry between lanes
    if mode == 1:
        return (w | low) & highs
    return w & low & highs


@numba.njit(cache=True, nogil=True)
def _gather_words_fail(
    words: Any,
    n_layers: int,
    layer_index: Any,
    pos_row: Any,
    out: Any,
    span: Any,
    dummy: Any,
    mode: int,
    c: Any,
    check: bool,
    k: int,
    bits: int,
) -> int:
    """`gather_widen` for rows of one uint64 word (``k * bits == 64``), literal ``k``/``bits``.

    Per block of positions: gather each position's local-layer words into ``buf`` (layer
    major), test the whole block (range and duplicates, branch-free, SWAR as in
    `_first_row_fail`), and only then widen it, layer by layer, into ``out``
    ``[n_local, P * C * K]``
    (contiguous runs: one per block when the span covers every column, else one per
    position), a zero-extending loop LLVM vectorises.
    """
    n_c = pos_row.shape[1]
    p_lo, p_hi, c_lo, c_hi = span[0], span[1], span[2], span[3]
    width = c_hi - c_lo
    n_local = layer_index.shape[0]
    ones, highs, field = _lane_masks(k, bits, 1)
    # Block words layer-major: buf[li * cap + j] for position j of the block.
    cap = _GATHER_BLOCK * width
    buf = np.empty(n_local * cap, dtype=np.uint64)
    for p0 in range(p_lo, p_hi, _GATHER_BLOCK):
        p1 = min(p_hi, p0 + _GATHER_BLOCK)
        m = (p1 - p0) * width
        j = 0
        for p in range(p0, p1):  # per position: its row's local layers, nearby in memory
            for col in range(c_lo, c_hi):
                r = pos_row[p, col]
                if r < 0:
                    for li in range(n_local):
                        buf[li * cap + j] = dummy
                else:
                    base = r * n_layers
                    for li in range(n_local):
                        buf[li * cap + j] = words[base + layer_index[li]]
                j += 1
        if check:
            acc = np.uint64(0)
            for li in range(n_local):
                row = li * cap
                for j in range(row, row + m):  # branch-free: vectorised
                    w = buf[j]
                    bad = _range_bits(w, mode, c, highs)
                    for rr in range(1, k // 2 + 1):
                        s = rr * bits
                        x = w ^ (((w >> np.uint64(s)) | (w << np.uint64(64 - s))) & field)
                        bad |= (x - ones) & ~x & highs
                    acc |= bad
            if acc != 0:
                first = m
                for li in range(n_local):
                    q = _first_bad_word(buf[li * cap : li * cap + m], m, mode, c, k, bits)
                    first = min(first, q)
                return int((p0 + first // width) * n_c + c_lo + first % width)
        for li in range(n_local):
            dst = out[li]
            blk = buf[li * cap : li * cap + m]
            if bits == 8:
                _widen_runs(blk.view(np.uint8), dst, p0, p1, n_c, c_lo, width, k)
            elif bits == 16:
                _widen_runs(blk.view(np.uint16), dst, p0, p1, n_c, c_lo, width, k)
            else:
                _widen_runs(blk.view(np.uint32), dst, p0, p1, n_c, c_lo, width, k)
    return -1


@numba.njit(cache=True, nogil=True, inline="always")
def _widen_runs(
    lanes: Any, dst: Any, p0: int, p1: int, n_c: int, c_lo: int, width: int, k: int
) -> None:
    """``dst`` (one layer's flat int32 output) at positions ``[p0, p1)`` x columns
    ``[c_lo, c_lo + width)`` from the block's compact ``lanes`` (same order)."""
    if width == n_c:
        base = p0 * n_c * k
        for j in range((p1 - p0) * width * k):  # one contiguous run: vectorised
            dst[base + j] = lanes[j]
        return
    run = width * k
    for p in range(p0, p1):
        base = (p * n_c + c_lo) * k
        src = (p - p0) * run
        for j in range(run):
            dst[base + j] = lanes[src + j]


@numba.njit(cache=True, nogil=True)
def _first_bad_word(buf: Any, m: int, mode: int, c: Any, k: int, bits: int) -> int:
    """First of ``buf[:m]`` failing the range or duplicate test (the block is known to fail)."""
    _, highs, _ = _lane_masks(k, bits, 1)
    for j in range(m):
        w = buf[j]
        if _range_bits(w, mode, c, highs) != 0 or _row_fails(w, k, bits):
            return j
    return m  # pragma: no cover - the block failed


@numba.njit(cache=True, nogil=True)
def _gather_elems(
    src: Any,
    layer_index: Any,
    pos_row: Any,
    out: Any,
    span: Any,
    bound: Any,
    bounded: bool,
    check: bool,
) -> int:
    """`gather_widen` for any row size: ``src`` ``[T, L, K]`` unsigned (bit patterns)."""
    n_c = pos_row.shape[1]
    p_lo, p_hi, c_lo, c_hi = span[0], span[1], span[2], span[3]
    width = c_hi - c_lo
    n_local = layer_index.shape[0]
    k = src.shape[2]
    buf = np.empty(_GATHER_BLOCK * width * k, dtype=src.dtype)
    for p0 in range(p_lo, p_hi, _GATHER_BLOCK):
        p1 = min(p_hi, p0 + _GATHER_BLOCK)
        m = (p1 - p0) * width
        for li in range(n_local):
            layer = layer_index[li]
            j = 0
            for p in range(p0, p1):
                for col in range(c_lo, c_hi):
                    r = pos_row[p, col]
                    for q in range(k):
                        buf[j * k + q] = q if r < 0 else src[r, layer, q]
                    j += 1
            if check:
                for j in range(m):
                    for q in range(k):
                        v = buf[j * k + q]
                        bad = bounded and np.uint64(v) >= bound
                        for q2 in range(q + 1, k):
                            bad = bad or v == buf[j * k + q2]
                        if bad:
                            return int((p0 + j // width) * n_c + c_lo + j % width)
            _widen_runs(buf, out[li], p0, p1, n_c, c_lo, width, k)
    return -1


@numba.njit(cache=True, nogil=True)
def _gather_words(
    words: Any,
    n_layers: int,
    layer_index: Any,
    pos_row: Any,
    out: Any,
    span: Any,
    dummy: Any,
    mode: int,
    c: Any,
    check: bool,
    k: int,
) -> int:
    """`_gather_words_fail` with literal ``k`` and ``bits`` (one word per row)."""
    args = (words, n_layers, layer_index, pos_row, out, span, dummy, mode, c, check)
    if k == 8:  # top-8 uint8: constant shifts, no staging buffer (`_gather8`)
        return int(_gather8(*args))
    if k == 4:
        return int(_gather_words_fail(*args, 4, 16))
    return int(_gather_words_fail(*args, 2, 32))


def range_constant(bits: int, bound: int | None, signed: bool) -> tuple[int, int]:
    """``(mode, lane constant)`` of `_range_bits` for ids of ``bits`` bits and an exclusive
    ``bound`` (None: only signed ids need a test, ``>= 0``)."""
    half = 1 << (bits - 1)
    if signed:  # negative ids have the top bit set: a bound of at most half catches them
        bound = half if bound is None else min(bound, half)
    if bound is None or (not signed and bound >= 1 << bits):
        return 0, 0
    per = half - bound if bound <= half else (1 << bits) - bound
    lanes = 64 // bits
    return (1 if bound <= half else 2), sum(per << (q * bits) for q in range(lanes))


def gather_widen(
    src: np.ndarray,
    layer_index: np.ndarray,
    pos_row: np.ndarray,
    out: np.ndarray,
    span: tuple[int, int, int, int],
    bound: int | None,
    check: bool,
) -> int:
    """Fused gather + id check + int32 widening; the first failing position, or -1.

    ``src`` ``[T, L, K]`` integer ids (C-contiguous); ``layer_index`` int64 ``[n_local]``;
    ``pos_row`` int64 ``[P, C]`` (C-contiguous): the source row of each output position, -1
    for the dummy row ``[0 .. K-1]``; ``out`` int32 (or ``src``'s dtype) ``[n_local, P, C,
    K]``, C-contiguous; only positions ``[p_lo, p_hi)`` x columns ``[c_lo, c_hi)`` of ``span``
    are read and written. With ``check``, every block is tested (ids below ``bound``,
    ``>= 0`` when signed, no id twice in a row) before it is widened; the return value is the
    flat index ``p * C + c`` of the first failing position of the first failing block
    (``out`` then partly written), -1 if none.
    """
    signed = src.dtype.kind == "i"
    bits = 8 * src.dtype.itemsize
    u = src.view(np.dtype(f"u{src.dtype.itemsize}"))
    k = int(src.shape[2])
    flat = out.reshape(out.shape[0], -1)
    where = np.asarray(span, dtype=np.int64)
    if k * src.dtype.itemsize == 8 and sys.byteorder == "little":
        mode, c = range_constant(bits, bound, signed)
        dummy = sum(q << (q * bits) for q in range(k))
        words = u.reshape(-1).view(np.uint64)
        return int(
            _gather_words(
                words,
                int(src.shape[1]),
                layer_index,
                pos_row,
                flat,
                where,
                np.uint64(dummy),
                mode,
                np.uint64(c),
                check,
                k,
            )
        )
    half = 1 << (bits - 1)
    lim = (half if bound is None else min(bound, half)) if signed else bound
    return int(
        _gather_elems(
            u, layer_index, pos_row, flat, where, np.uint64(lim or 0), lim is not None, check
        )
    )


def warm_up() -> None:
    """Compile (or load from the cache) the kernels for the common route dtypes and layouts:
    writable and read-only (Arrow buffers), C-contiguous and strided, both layouts, and the
    fused top-8 check (`scan_top8`). The fused gather (`gather_widen`) compiles on its first
    call (a collator's warm-up call)."""
    for dtype in (np.uint8, np.uint16, np.uint32, np.uint64):
        for k in (2, 8):
            x = np.zeros((2, 3, k), dtype=dtype)
            x[..., 1] = 1
            ro = x.copy()
            ro.setflags(write=False)
            for layers_first in (False, True):
                for v in (x, ro, x[:, ::2]):
                    first_duplicate_token(v, layers_first)
    top8 = np.tile(np.arange(8, dtype=np.uint8), (2, 3, 1))
    for bound in (None, 128, 200):  # the fused per-turn check, each range mode
        scan_top8(top8, bound)


__all__ = ["first_duplicate_token", "gather_widen", "range_constant", "scan_top8", "warm_up"]
