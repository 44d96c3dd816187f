"""Numba kernels for top-8 uint8 routes (the usual shape: 8 of at most 256 experts), each
row one little-endian 64-bit word of 8 byte lanes. Private, imported by
`r3arrow._kernels_numba` (docs/design.md, "Expert ids"; ``docs/collation.md``).

Shifts and masks are compile-time constants here: numba passes ints as runtime values, so the
generic word kernels of `r3arrow._kernels_numba` (``k`` and ``bits`` as arguments) cannot
fold them, and these run about twice as fast. Tests: ``tests/core/test_ids.py`` and
``tests/integrations/test_collate_fused.py`` (both compare with the reference checks).
"""

from __future__ import annotations

from typing import Any

import numba
import numpy as np

_ONES8 = np.uint64(0x0101010101010101)  # bit 0 of every byte lane
_HIGHS8 = np.uint64(0x8080808080808080)  # bit 7 of every byte lane


@numba.njit(cache=True, nogil=True, inline="always")
def _dup_bits8(v: Any) -> Any:
    """Top bits of the byte lanes of ``v ^ rot(v, r)``, ``r = 1 .. 4``, that are zero: nonzero
    exactly when the 8 ids of row ``v`` (top-8 of uint8) hold two equal ones. Shift amounts
    and masks are compile-time constants here (numba passes ints as runtime values, so the
    generic `_first_row_fail` cannot fold them): about twice the speed."""
    t = np.uint64(0)
    for r in (8, 16, 24, 32):
        x = v ^ ((v >> np.uint64(r)) | (v << np.uint64(64 - r)))
        t |= (x - _ONES8) & ~x
    return t & _HIGHS8


@numba.njit(cache=True, nogil=True)
def _first_row8(words: Any, start: int, stop: int) -> int:
    """`_first_row_fail` for top-8 uint8 (one row per word) with `_dup_bits8`.

    One branch-free pass over the whole range (a chunked loop, as in `_first_row_fail`,
    measured 1.8x slower here), then, only if some row fails, a scan for the first one."""
    sub = words[start:stop]  # a loop from 0 to a length vectorises; start..stop did not
    acc = np.uint64(0)
    for j in range(sub.shape[0]):  # branch-free: vectorised across words
        acc |= _dup_bits8(sub[j])
    if acc == 0:
        return -1
    for j in range(start, stop):
        if _dup_bits8(words[j]) != 0:
            return j
    return -1  # pragma: no cover - acc said some row fails


@numba.njit(cache=True, nogil=True)
def _scan8(words: Any, mode: int, c: Any) -> tuple[Any, bool]:
    """(OR of all words, some row fails) for top-8 uint8 rows: range (`_range_bits`, ``mode``
    1 or 2; 0: no bound) and duplicates (`_dup_bits8`) in one branch-free pass."""
    acc = np.uint64(0)
    seen = np.uint64(0)
    if mode == 1:  # one loop per mode: a branch inside the loop would stop vectorisation
        for j in range(words.shape[0]):
            w = words[j]
            seen |= w
            acc |= _dup_bits8(w) | ((w | ((w & ~_HIGHS8) + c)) & _HIGHS8)
    elif mode == 2:
        for j in range(words.shape[0]):
            w = words[j]
            seen |= w
            acc |= _dup_bits8(w) | (w & ((w & ~_HIGHS8) + c) & _HIGHS8)
    else:
        for j in range(words.shape[0]):
            w = words[j]
            seen |= w
            acc |= _dup_bits8(w)
    return seen, acc != 0


@numba.njit(cache=True, nogil=True)
def _gather8(
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
) -> int:
    """The fused gather for top-8 uint8 (`r3arrow._kernels_numba.gather_widen`'s arguments):
    each position's local-layer words are tested (range ``mode``/``c`` as `_scan8`, and
    duplicates) in registers, still compact, and widened straight into ``out``
    ``[n_local, P * C * 8]`` int32: no staging buffer (measured about 20% faster than staging
    a block first). Per block of 256 positions the tests are OR-accumulated; a failing block
    returns its first failing position ``p * C + col`` before the next block is written
    (``out`` is then partly written, as documented), -1 if none fails."""
    n_c = pos_row.shape[1]
    p_lo, p_hi, c_lo, c_hi = span[0], span[1], span[2], span[3]
    n_local = layer_index.shape[0]
    for p0 in range(p_lo, p_hi, 256):
        p1 = min(p_hi, p0 + 256)
        acc = np.uint64(0)
        for p in range(p0, p1):
            for col in range(c_lo, c_hi):
                r = pos_row[p, col]
                base = r * n_layers
                o = (p * n_c + col) * 8
                for li in range(n_local):
                    w = dummy if r < 0 else words[base + layer_index[li]]
                    if check:
                        acc |= _bad8(w, mode, c)
                    d = out[li]
                    for q in range(8):
                        d[o + q] = np.int32((w >> np.uint64(8 * q)) & np.uint64(0xFF))
        if acc != 0:
            for p in range(p0, p1):
                for col in range(c_lo, c_hi):
                    r = pos_row[p, col]
                    for li in range(n_local):
                        w = dummy if r < 0 else words[r * n_layers + layer_index[li]]
                        if _bad8(w, mode, c) != 0:
                            return int(p * n_c + col)
    return -1


@numba.njit(cache=True, nogil=True, inline="always")
def _bad8(w: Any, mode: int, c: Any) -> Any:
    """Nonzero when row ``w`` repeats an id or (``mode`` 1 or 2, `_scan8`) has one out of
    range."""
    bad = _dup_bits8(w)
    if mode == 1:
        bad |= (w | ((w & ~_HIGHS8) + c)) & _HIGHS8
    elif mode == 2:
        bad |= w & ((w & ~_HIGHS8) + c) & _HIGHS8
    return bad
