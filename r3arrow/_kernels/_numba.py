"""The numba kernels of r3arrow, all of them (private; loaded by `r3arrow._kernels.compiled`).

Every kernel has a numpy (or torch) twin beside its caller, the reference: the kernels only
*find* (the first failing token or position, a flag for bad input) and the caller re-runs its
reference on that piece, so messages, error fields and the "first offender" rule are the
reference's. Sections:

* **Expert ids** (`first_duplicate_token`, `scan_top8`, `gather_widen`; caller `r3arrow.ids`):
  for the checks, rows of ``K * itemsize`` = 2, 4 or 8 bytes are read as uint64 words of
  ``64 // (K * bits)`` rows; for each rotation ``r = 1 .. K // 2`` lanes within every row,
  ``x = w ^ rot(w, r)`` has a zero lane exactly when two ids at distance ``r`` are equal,
  and ``(x - 0x01..01) & ~x & 0x80..80`` is nonzero exactly when ``x`` has one; the test is
  OR-accumulated without branches (vectorised), and a failing range is rescanned row by row.
  Other rows compare the ``K // 2`` rotations per row; strided ids are copied in blocks. The
  fused top-8 check (`scan_top8`, `_scan8`, a numba intrinsic) streams uint8 rows as LLVM
  vectors of 64 bytes (8 rows): per vector the OR, a lane maximum when a bound applies, and
  the 28 lane pairs of each row compared with 3 lane rotations and 4 compares (masked
  compares on AVX-512), AND-accumulated; measured 0.15 ns per row, a 150 KB turn in less
  time than a memcpy or numpy's min + max of its bytes. The fused collation gather
  (`gather_widen`, `_gather_kernel`) handles each (token, layer) row as one LLVM vector of
  ``K`` lanes (`_widen_row`, a numba intrinsic): one load, a compare against the bound,
  ``K // 2`` lane rotations compared with it, one widening and one
  store, the flags OR-accumulated per block and a failing block rescanned. Numba's loop
  vectoriser cannot do this itself (8-lane rows are too short for it, and it cannot prove
  the ids and the output apart); target-independent IR vectors are lowered for the host's
  SIMD (SSE2 up to AVX-512), so no CPU feature is assumed. The specialisations per top-k
  and lane width are generated (`_word_kernel`, `_elems_kernel`, `_gather_kernel`):
  closures over constants only, which numba folds (about twice the speed of runtime shift
  amounts) and its disk cache keys on, so every later process loads them.
* **Statistics** (`count_codes`, `agree`; `r3arrow.stats`): one pass over the
  ids; they never raise, bad input is flagged.
* **Interleave** (`copy_runs`; `r3arrow.io`): the runs of a layer-group restore.
* **Replay probe** (`overlap_rows`, `overlap_rows_bf16`; `r3arrow.megatron`,
  ``docs/replay-probe.md``): ``|native ∩ replayed|`` per token in one read of the scores.

``cache=True`` stores machine code in ``__pycache__`` beside this file (or numba's user cache;
``NUMBA_CACHE_DIR`` overrides); ``nogil=True`` lets the kernels run beside other threads.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import numba
import numpy as np
from llvmlite import ir as llvm_ir  # type: ignore[import-untyped]
from numba.core import cgutils, types
from numba.extending import intrinsic

_CHUNK = 1024  # rows per chunk of the elementwise duplicate test
_BLOCK = 1 << 16  # ids per contiguous copy of a strided input: the copy stays in L2
_GATHER_BLOCK = 256  # positions per block of the fused gather's flags
_SCAN_VECTOR = 64  # bytes per vector of `_scan8`'s main loop: 8 rows, one cache line
_U8 = np.dtype(np.uint8)  # compared as a dtype: half the cost of ``!= np.uint8``
# Positions ahead whose id rows the fused gather prefetches: a stage's rows are a strided
# slice of each token's ids, which the hardware prefetchers follow late (measured: uint16
# top-8 rows 13 -> 8 ns, uint8 top-8 6 -> 4.5 ns per row; 12 to 64 ahead all alike).
_PREFETCH = 32
_WORD: dict[int, np.dtype[Any]] = {
    2: np.dtype(np.uint16),
    4: np.dtype(np.uint32),
    8: np.dtype(np.uint64),
}


# ------------------------------------------------------------------------------ expert ids
def _masks(k: int, bits: int, fields: int) -> tuple[int, int, int]:
    """``(ones, highs, rows)`` for ``fields`` rows of ``k`` lanes of ``bits`` in a uint64: bit 0
    of every lane, the top bit of every lane, and every row's bits (all ones)."""
    kb = k * bits
    ones = sum(1 << (q * bits) for q in range(k * fields))
    field = (1 << kb) - 1
    rows = sum(field << (q * kb) for q in range(fields))
    return ones, ones << (bits - 1), rows


# The generated kernels close over constants only: numba's disk cache keys a closure by a
# pickle of its cells, and a dispatcher's pickle changes per process. The helpers are module
# globals taking the constants as arguments, inlined (LLVM folds them as literals).
@numba.njit(cache=True, nogil=True, inline="always")
def _row_dup(v: Any, bits: int, kb: int, half: int, ones: Any, highs: Any, field: Any) -> Any:
    """Nonzero: row ``v`` (low ``kb`` bits, lanes of ``bits``) has two equal lanes."""
    t = np.uint64(0)
    for r in range(1, half + 1):
        s = np.uint64(r * bits)
        x = v ^ (((v >> s) | (v << np.uint64(kb - r * bits))) & field)
        t |= (x - ones) & ~x
    return t & highs


@numba.njit(cache=True, nogil=True, inline="always")
def _word_dup(v: Any, bits: int, kb: int, half: int, ones: Any, highs: Any, lows: Any) -> Any:
    """Nonzero: some row of the whole word ``v`` has two equal lanes (``lows``: per rotation
    ``r``, the bits of every row that move down by ``r`` lanes)."""
    full = np.uint64(0xFFFFFFFFFFFFFFFF)
    t = np.uint64(0)
    for i in range(half):
        s = np.uint64((i + 1) * bits)
        low = lows[i]
        rot = ((v >> s) & low) | ((v << np.uint64(kb - (i + 1) * bits)) & (full & ~low))
        x = v ^ rot
        t |= (x - ones) & ~x
    return t & highs


@numba.njit(cache=True, nogil=True, inline="always")
def _first_word_row(words: Any, rows: Any, start: int, stop: int, g: Any) -> int:
    """The first row in ``[start, stop)`` repeating an id, -1 for none: whole words branch-free
    (vectorised), the ragged ends and a failing range row by row. ``g``: `_geometry`."""
    bits, kb, per, half, one_ones, one_highs, one_field, w_ones, w_highs, lows = g
    lo_word = (start + per - 1) // per  # words wholly inside [start, stop)
    hi_word = max(lo_word, min(stop // per, words.shape[0]))
    head_end = min(stop, lo_word * per)
    for j in range(start, head_end):
        if _row_dup(np.uint64(rows[j]), bits, kb, half, one_ones, one_highs, one_field) != 0:
            return j
    sub = words[lo_word:hi_word]  # a loop from 0 to a length vectorises
    acc = np.uint64(0)
    for j in range(sub.shape[0]):
        acc |= _word_dup(sub[j], bits, kb, half, w_ones, w_highs, lows)
    if acc != 0:
        for j in range(lo_word * per, hi_word * per):
            if _row_dup(np.uint64(rows[j]), bits, kb, half, one_ones, one_highs, one_field):
                return j
    for j in range(max(head_end, hi_word * per), stop):
        if _row_dup(np.uint64(rows[j]), bits, kb, half, one_ones, one_highs, one_field) != 0:
            return j
    return -1


def _geometry(k: int, bits: int) -> tuple[Any, ...]:
    """The constants of rows of ``k`` lanes of ``bits``: ``(bits, kb, per, half, one_ones,
    one_highs, one_field, w_ones, w_highs, lows)`` (`_masks` for one row and a whole word)."""
    kb = k * bits
    per = 64 // kb  # rows per uint64
    half = k // 2
    one = tuple(np.uint64(v) for v in _masks(k, bits, 1))
    word = tuple(np.uint64(v) for v in _masks(k, bits, per))
    lows = tuple(
        np.uint64(sum(((1 << (kb - r * bits)) - 1) << (q * kb) for q in range(per)))
        for r in range(1, half + 1)
    )
    return (bits, kb, per, half, *one, word[0], word[1], lows)


@functools.cache
def _word_kernel(k: int, bits: int) -> Callable[..., Any]:
    """``first_token(words, rows, n_a, n_b, layers_first)`` for rows of ``k`` lanes of ``bits``
    (``k * bits`` = 16, 32 or 64), generated with the row geometry and masks as constants: the
    smallest token of C-contiguous ``[A, B]`` rows (``rows``: one unsigned word each;
    ``words``: the same bytes as whole uint64 words) whose row repeats an id, -1 for none."""
    g = _geometry(k, bits)

    @numba.njit(cache=True, nogil=True)
    def first_token(words: Any, rows: Any, n_a: int, n_b: int, layers_first: bool) -> int:
        if not layers_first:
            j = _first_word_row(words, rows, 0, n_a * n_b, g)
            return -1 if j < 0 else j // n_b
        limit = n_b  # layers first: the smallest failing token over all layers
        for a in range(n_a):
            j = _first_word_row(words, rows, a * n_b, a * n_b + limit, g)
            if j >= 0:
                limit = j - a * n_b
        return limit if limit < n_b else -1

    return first_token


@numba.njit(cache=True, nogil=True, inline="always")
def _first_elems_row(flat: Any, start: int, stop: int, k: int) -> int:
    """The first row of ``k`` ids in ``[start, stop)`` of ``flat`` repeating an id, -1 for
    none: per chunk the ``k // 2`` lane rotations OR-accumulated, a failing chunk rescanned."""
    half = k // 2
    i = start
    while i < stop:
        end = min(i + _CHUNK, stop)
        acc = False
        for j in range(i, end):
            b = j * k
            for r in range(1, half + 1):
                for q in range(k):
                    acc |= flat[b + q] == flat[b + (q + r) % k]
        if acc:
            for j in range(i, end):
                b = j * k
                for r in range(1, half + 1):
                    for q in range(k):
                        if flat[b + q] == flat[b + (q + r) % k]:
                            return j
        i = end
    return -1


@functools.cache
def _elems_kernel(k: int) -> Callable[..., Any]:
    """``first_token(flat, n_a, n_b, layers_first)`` on C-contiguous ids ``flat`` (``[A, B, K]``
    flattened, any row size), generated with ``K`` constant: the ``K // 2`` lane rotations
    unroll and LLVM vectorises across rows with interleaved loads."""

    @numba.njit(cache=True, nogil=True)
    def first_token(flat: Any, n_a: int, n_b: int, layers_first: bool) -> int:
        if not layers_first:
            j = _first_elems_row(flat, 0, n_a * n_b, k)
            return -1 if j < 0 else j // n_b
        limit = n_b
        for a in range(n_a):
            j = _first_elems_row(flat, a * n_b, a * n_b + limit, k)
            if j >= 0:
                limit = j - a * n_b
        return limit if limit < n_b else -1

    return first_token


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
    if not x.flags.c_contiguous:  # strided: contiguous copies of ~_BLOCK rows at a time
        axis = 1 if layers_first else 0
        step = max(1, _BLOCK // max(1, x.shape[1 - axis] * x.shape[2]))
        for t0 in range(0, x.shape[axis], step):
            block = x[:, t0 : t0 + step] if layers_first else x[t0 : t0 + step]
            t = first_duplicate_token(np.ascontiguousarray(block), layers_first)
            if t >= 0:
                return t0 + t
        return -1
    n_a, n_b, k = (int(v) for v in x.shape)
    views = _word_views(x)
    if views is None:
        return int(_elems_kernel(k)(x.reshape(-1), n_a, n_b, layers_first))
    words, rows = views
    first_token = _word_kernel(k, 8 * x.dtype.itemsize)
    return int(first_token(words, rows, n_a, n_b, layers_first))


def _scan8_typing(typingctx: Any, ids: Any, top: Any, ranged: Any) -> Any:
    """``_scan8(ids, top, ranged)``: one pass over the rows of 8 uint8 ids of C-contiguous
    ``ids`` (any shape, size a multiple of 8). Returns -1 when some row repeats an id (or, with
    ``ranged`` (a literal), has an id above ``top``), else the largest lane of the OR of all
    rows (capped at ``top`` when ranged). In LLVM IR: a loop over 64-byte vectors (8 rows) and
    one over the remaining rows (8-byte vectors); per vector the OR, the lane maximum when
    ranged, and every lane pair of a row compared ``!=`` with 3 rotations and 4 compares: the
    row rotated by 1, 3 and 4 lanes (a funnel shift of each 64-bit row: ``vprolq`` on
    AVX-512, two shifts elsewhere), ``v != rot1`` (lane distance 1), ``v != rot3`` (3),
    ``rot1 != rot3`` (2), ``v != rot4`` (4); distances 5..7 are the same pairs the other way
    round. The compares are ANDed (AVX-512: each masked by the last) and AND-accumulated as
    a byte mask (an ``i1`` vector accumulator is scalarised on SSE2). Generic vectors,
    lowered for whatever SIMD the host has (SSE2 up)."""
    if not (
        isinstance(ranged, types.IntegerLiteral)
        and isinstance(ids, types.Array)
        and ids.dtype == types.uint8
        and ids.layout == "C"
    ):
        return None
    with_range = bool(ranged.literal_value)
    sig = types.int64(ids, top, ranged)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        arr = context.make_array(signature.args[0])(context, builder, args[0])
        i8, i64 = llvm_ir.IntType(8), llvm_ir.IntType(64)
        base = builder.bitcast(arr.data, i8.as_pointer())
        n_bytes = builder.zext(arr.nitems, i64) if arr.nitems.type.width < 64 else arr.nitems
        n_big = builder.udiv(n_bytes, i64(_SCAN_VECTOR))
        done = builder.mul(n_big, i64(_SCAN_VECTOR))
        n_rows = builder.udiv(builder.sub(n_bytes, done), i64(8))

        def reduce(op: str, v: Any) -> Any:
            ty = v.type.element
            name = f"llvm.vector.reduce.{op}.v{v.type.count}i{ty.width}"
            fn = _CG.get_or_insert_function(
                builder.module, llvm_ir.FunctionType(ty, [v.type]), name
            )
            return builder.call(fn, [v])

        def scan(n: int, count: Any, offset: Any) -> tuple[Any, Any, Any]:
            """The loop over ``count`` vectors of ``n`` bytes from byte ``offset``: (OR as a
            uint64, largest id, every row distinct)."""
            vec = llvm_ir.VectorType(i8, n)
            rows_ty = llvm_ir.VectorType(i64, n // 8)
            fshr = _CG.get_or_insert_function(
                builder.module,
                llvm_ir.FunctionType(rows_ty, [rows_ty] * 3),
                f"llvm.fshr.v{n // 8}i64",
            )
            turns = {r: llvm_ir.Constant(rows_ty, [8 * r] * (n // 8)) for r in (1, 3, 4)}
            seen_p = _CG.alloca_once_value(builder, llvm_ir.Constant(vec, [0] * n))
            max_p = _CG.alloca_once_value(builder, llvm_ir.Constant(vec, [0] * n))
            ok_p = _CG.alloca_once_value(builder, llvm_ir.Constant(vec, [255] * n))
            with _CG.for_range(builder, count) as loop:
                at = builder.add(offset, builder.mul(loop.index, i64(n)))
                ptr = builder.bitcast(builder.gep(base, [at]), vec.as_pointer())
                v = builder.load(ptr, align=1)
                builder.store(builder.or_(builder.load(seen_p), v), seen_p)
                if with_range:
                    m = builder.load(max_p)
                    builder.store(builder.select(builder.icmp_unsigned(">", v, m), v, m), max_p)
                w = builder.bitcast(v, rows_ty)
                rot = {
                    r: builder.bitcast(builder.call(fshr, [w, w, turn]), vec)
                    for r, turn in turns.items()
                }
                ok = None
                for a, b in ((v, rot[1]), (v, rot[3]), (rot[1], rot[3]), (v, rot[4])):
                    ne = builder.icmp_unsigned("!=", a, b)
                    ok = ne if ok is None else builder.and_(ok, ne)
                builder.store(builder.and_(builder.load(ok_p), builder.sext(ok, vec)), ok_p)
            seen = reduce(
                "or", builder.bitcast(builder.load(seen_p), llvm_ir.VectorType(i64, n // 8))
            )
            return (
                seen,
                reduce("umax", builder.load(max_p)),
                builder.icmp_unsigned("!=", reduce("umin", builder.load(ok_p)), i8(0)),
            )

        big = scan(_SCAN_VECTOR, n_big, i64(0))
        rows = scan(8, n_rows, done)
        seen = builder.or_(big[0], rows[0])
        result = builder.zext(reduce("umax", builder.bitcast(seen, llvm_ir.VectorType(i8, 8))), i64)
        ok = builder.and_(big[2], rows[2])
        if with_range:
            top = args[1]
            hi = builder.zext(
                builder.select(builder.icmp_unsigned(">", big[1], rows[1]), big[1], rows[1]), i64
            )
            ok = builder.and_(ok, builder.icmp_unsigned("<=", hi, top))
            result = builder.select(builder.icmp_unsigned(">", result, top), top, result)
        return builder.select(ok, result, i64(-1))

    return sig, codegen


_scan8: Any = intrinsic(_scan8_typing)  # Any: called only inside numba kernels


@functools.cache
def _scan_kernel(ranged: int) -> Callable[..., Any]:
    """``scan(ids, top) -> int`` (`_scan8`) with the range test compiled in or out (a closure
    constant: numba's disk cache keys on it)."""

    @numba.njit(cache=True, nogil=True)
    def scan(ids: Any, top: int) -> int:  # pragma: no cover - numba-compiled
        return _scan8(ids, top, ranged)  # type: ignore[no-any-return]

    return scan


def scan_top8(x: np.ndarray, bound: int | None) -> int | None:
    """One fused pass over C-contiguous uint8 ids ``x`` ``[..., 8]`` (the usual top-8 of at
    most 256 experts): every id ``< bound`` and no row repeating an id. Returns an upper
    bound of the largest id (the largest lane of the OR of all rows, capped at ``bound - 1``)
    when both hold, None when some row fails (or ``x`` does not fit: the caller
    then runs the reference checks). Byte lanes: any byte order."""
    if x.dtype != _U8 or x.ndim < 1 or x.shape[-1] != 8 or not x.flags.c_contiguous:
        return None
    if bound is None or bound >= 256:  # every uint8 id is in range: the test compiles out
        top: int = _scan_kernel(0)(x, 255)
    else:
        top = _scan_kernel(1)(x, bound - 1) if bound > 0 else -1
    return None if top < 0 else top


def _widen_row_typing(
    typingctx: Any, out: Any, li: Any, o: Any, src: Any, s: Any, top: Any, k: Any
) -> Any:
    """``_widen_row(out, li, o, src, s, top, K)``: widen the ``K`` ids ``src[s : s + K]`` into
    ``out[li, o : o + K]`` (zero- or sign-extended as ``src``'s dtype, truncated to a narrower
    ``out``) and return 1 when some id, as an unsigned lane, is above ``top`` or two ids are
    equal, else 0 (``K`` a literal). One vector of ``K`` lanes in LLVM IR: an unaligned load,
    ``K // 2`` lane rotations (shuffles) compared with it, one conversion and one store;
    LLVM lowers it for whatever SIMD the host has (SSE2 up), no CPU feature assumed."""
    if not isinstance(k, types.IntegerLiteral):
        return None
    n = int(k.literal_value)
    sig = types.int64(out, li, o, src, s, top, k)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        out_ty, src_ty = signature.args[0], signature.args[3]
        dst = context.make_array(out_ty)(context, builder, args[0])
        dptr = _CG.get_item_pointer(
            context, builder, out_ty, dst, [args[1], args[2]], wraparound=False
        )
        ids = context.make_array(src_ty)(context, builder, args[3])
        sptr = _CG.get_item_pointer(context, builder, src_ty, ids, [args[4]], wraparound=False)
        lane = llvm_ir.IntType(src_ty.dtype.bitwidth)
        vec = llvm_ir.VectorType(lane, n)
        v = builder.load(builder.bitcast(sptr, vec.as_pointer()), align=1)
        limit = args[5] if lane.width == 64 else builder.trunc(args[5], lane)
        splat = llvm_ir.Constant(vec, llvm_ir.Undefined)
        for q in range(n):
            splat = builder.insert_element(splat, limit, llvm_ir.IntType(32)(q))
        bad = builder.icmp_unsigned(">", v, splat)
        for r in range(1, n // 2 + 1):
            turn = llvm_ir.Constant(
                llvm_ir.VectorType(llvm_ir.IntType(32), n), [(q + r) % n for q in range(n)]
            )
            bad = builder.or_(
                bad, builder.icmp_unsigned("==", v, builder.shuffle_vector(v, v, turn))
            )
        mask = builder.bitcast(bad, llvm_ir.IntType(n))
        flag = builder.icmp_unsigned("!=", mask, llvm_ir.IntType(n)(0))
        wide = llvm_ir.VectorType(llvm_ir.IntType(out_ty.dtype.bitwidth), n)
        if wide.element.width > lane.width:
            w = builder.sext(v, wide) if src_ty.dtype.signed else builder.zext(v, wide)
        elif wide.element.width < lane.width:
            w = builder.trunc(v, wide)
        else:
            w = v
        builder.store(w, builder.bitcast(dptr, wide.as_pointer()), align=1)
        return builder.zext(flag, llvm_ir.IntType(64))

    return sig, codegen


def _prefetch_typing(typingctx: Any, src: Any, s: Any) -> Any:
    """``_prefetch(src, s)``: a read hint for the cache line of ``src[s]`` (``llvm.prefetch``:
    ``prefetcht0`` on x86, nothing where a target has none; never faults)."""
    sig = types.void(src, s)

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        ids = context.make_array(signature.args[0])(context, builder, args[0])
        ptr = _CG.get_item_pointer(
            context, builder, signature.args[0], ids, [args[1]], wraparound=False
        )
        byte = llvm_ir.IntType(8).as_pointer()
        i32 = llvm_ir.IntType(32)
        fnty = llvm_ir.FunctionType(llvm_ir.VoidType(), [byte, i32, i32, i32])
        fn = builder.module.declare_intrinsic("llvm.prefetch", [byte], fnty)
        builder.call(fn, [builder.bitcast(ptr, byte), i32(0), i32(3), i32(1)])  # read, keep
        return context.get_dummy_value()

    return sig, codegen


_widen_row: Any = intrinsic(_widen_row_typing)  # Any: called only inside numba kernels
_prefetch: Any = intrinsic(_prefetch_typing)
_CG: Any = cgutils  # numba's codegen helpers (untyped)


@functools.cache
def _gather_kernel(k: int) -> Callable[..., Any]:
    """The fused gather of `gather_widen` for rows of ``k`` ids, generated with ``K`` constant
    (`_widen_row`'s vector width): ``gather(src, n_layers, layer_index, pos_row, out, span,
    dummy, top, check, pf_first, pf_lines)``, ``src`` the ids flat (``[T * L * K]``, any
    integer dtype), ``dummy`` the dummy row ``[0 .. K-1]`` in that dtype, ``out``
    ``[n_local, P * C * K]``; the ``pf_lines`` cache lines from id ``pf_first`` of a token's
    ids are prefetched `_PREFETCH` positions ahead. Every row is
    tested and widened in registers (`_widen_row`); per block of positions the flags are
    OR-accumulated, and a failing block is rescanned position by position and returns its
    first failing position ``p * C + col`` (``out`` written up to that block's end); -1 if
    none fails."""

    @numba.njit(cache=True, nogil=True, boundscheck=False, error_model="numpy")
    def gather(
        src: Any,
        n_layers: int,
        layer_index: Any,
        pos_row: Any,
        out: Any,
        span: Any,
        dummy: Any,
        top: Any,
        check: bool,
        pf_first: int,
        pf_lines: int,
    ) -> int:  # pragma: no cover - numba-compiled
        n_c = pos_row.shape[1]
        p_lo, p_hi, c_lo, c_hi = span[0], span[1], span[2], span[3]
        n_local = layer_index.shape[0]
        line = max(1, 64 // src.itemsize)  # ids per cache line
        for p0 in range(p_lo, p_hi, _GATHER_BLOCK):
            p1 = min(p_hi, p0 + _GATHER_BLOCK)
            acc = 0
            for p in range(p0, p1):
                for col in range(c_lo, c_hi):
                    r = pos_row[p, col]
                    o = (p * n_c + col) * k
                    if r < 0:
                        for li in range(n_local):
                            acc |= _widen_row(out, li, o, dummy, 0, top, k)
                    else:
                        b = r * n_layers
                        for li in range(n_local):
                            acc |= _widen_row(out, li, o, src, (b + layer_index[li]) * k, top, k)
                    if p + _PREFETCH < p_hi:
                        ahead = pos_row[p + _PREFETCH, col]
                        if ahead >= 0:
                            a = ahead * n_layers * k + pf_first
                            for i in range(pf_lines):
                                _prefetch(src, a + i * line)
            if check and acc != 0:
                for p in range(p0, p1):
                    for col in range(c_lo, c_hi):
                        r = pos_row[p, col]
                        o = (p * n_c + col) * k
                        bad = 0
                        for li in range(n_local):
                            if r < 0:
                                bad |= _widen_row(out, li, o, dummy, 0, top, k)
                            else:
                                s = (r * n_layers + layer_index[li]) * k
                                bad |= _widen_row(out, li, o, src, s, top, k)
                        if bad != 0:
                            return int(p * n_c + col)
        return -1

    return gather


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
    ``>= 0`` when signed, no id twice in a row); the return value is the flat index
    ``p * C + c`` of the first failing position (``out`` then partly written), -1 if none.
    Unchecked ids are widened as numpy casts them (sign-extended when signed). One generated
    kernel per top-k (`_gather_kernel`), any id dtype.
    """
    bits = 8 * src.dtype.itemsize
    half = 1 << (bits - 1)
    lim = (half if bound is None else min(bound, half)) if src.dtype.kind == "i" else bound
    top = (1 << bits) - 1 if lim is None or lim >= 1 << bits else lim - 1
    k = int(src.shape[2])
    gather = _gather_kernel(k)
    first, last = (int(layer_index.min()), int(layer_index.max())) if layer_index.size else (0, 0)
    span_bytes = (last - first + 1) * k * src.dtype.itemsize  # the local layers' ids per token
    return int(
        gather(
            src.reshape(-1),
            int(src.shape[1]),
            layer_index,
            pos_row,
            out.reshape(out.shape[0], -1),
            np.asarray(span, dtype=np.int64),
            np.arange(k, dtype=src.dtype),
            np.uint64(top),
            check,
            first * k,
            span_bytes // 64 + 2,  # lines the span can touch, unaligned
        )
    )


def warm_up() -> None:
    """Compile (or load from the cache) the id kernels for the common route dtypes and layouts:
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
    top8 = np.tile(np.arange(8, dtype=np.uint8), (2, 3, 1))  # [rows, layers, 8], as ids.py
    top8_ro = top8.copy()
    top8_ro.setflags(write=False)
    for v in (top8, top8_ro):
        for bound in (None, 200):  # the fused per-turn check, without and with the range test
            scan_top8(v, bound)


# ------------------------------------------------------------------------------ statistics
@numba.njit(cache=True, nogil=True)
def count_codes(ids: Any, sel: Any, base: Any, e: int, out: Any) -> None:  # pragma: no cover
    """``out[base[l] + min(ids[t, l, k], e)] += 1`` for the selected rows ``t``.

    ``ids`` ``[T, L, K]`` unsigned integers (the caller views signed ids as unsigned);
    ``sel`` uint8 ``[T]`` (empty: every row); ``base`` int64 ``[L]`` (a router layer's
    rank × (e + 1), a dense layer's the discard range). An id ``>= e`` lands in the layer's
    overflow bucket ``e`` (branch-free), so one count there flags a bad id (uint8 ids with
    ``e = 255`` and 256 counters per layer: a counter per value). ``out`` int64 or uint32,
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


# ------------------------------------------------------------------------------ interleave
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


# ---------------------------------------------------------------------------- replay probe
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


__all__ = [
    "ARITY",
    "PADDING",
    "UNSURE",
    "agree",
    "copy_runs",
    "count_codes",
    "first_duplicate_token",
    "gather_widen",
    "overlap_rows",
    "overlap_rows_bf16",
    "scan_top8",
    "selection_bytes",
    "warm_up",
]
