"""The interleave copy of a layer-group restore (``docs/storage.md``, "Full reads").

A run ``(part, src_byte, dst_byte, nbytes)`` copies those bytes of every token of
``parts[part]`` into its output row: a numba kernel (`r3arrow._kernels`) once numba is
imported, else numpy over cache-sized blocks of rows, into Arrow pool memory.
"""

from __future__ import annotations

import itertools
import os
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import Any

import numpy as np
import pyarrow as pa

from r3arrow._kernels import compiled, decided

#: Outputs smaller than this use numpy (a kernel call has a fixed cost).
NUMBA_MIN_BYTES = 1 << 20
#: Bytes interleaved with numpy after which this module imports numba itself.
IMPORT_AFTER_BYTES = 2 << 30
#: Threads of the numba path (row ranges of at least `_MIN_SLICE` bytes of output each).
THREADS = max(1, min(4, os.cpu_count() or 1))
_MIN_SLICE = 4 << 20
_BLOCK = 2 << 20  # numpy path: output bytes per block of rows (stays in cache)

Run = tuple[int, int, int, int]  # (part, src_byte, dst_byte, nbytes)

_SEEN = 0  # bytes interleaved with numpy before numba was imported
_POOL: ThreadPoolExecutor | None = None
_POOL_PID = 0


def _numba(nbytes: int = 0, *, force: bool = False) -> ModuleType | None:
    """The numba kernels (`r3arrow._kernels.compiled`), importing numba (about 1 s) only once
    something else did, with ``force`` or after `IMPORT_AFTER_BYTES` copied with numpy.
    """
    global _SEEN
    if not decided() and not force and "numba" not in sys.modules and _SEEN < IMPORT_AFTER_BYTES:
        _SEEN += nbytes
        return None
    return compiled()


def _pool() -> ThreadPoolExecutor:
    """The shared copy threads; a new pool in a forked child (its parent's threads are gone)."""
    global _POOL, _POOL_PID
    if _POOL is None or os.getpid() != _POOL_PID:
        _POOL = ThreadPoolExecutor(THREADS, thread_name_prefix="r3arrow-interleave")
        _POOL_PID = os.getpid()
    return _POOL


def word_size(widths: Sequence[int], runs: Sequence[Run], row_bytes: int) -> int:
    """The widest of 8, 4, 2, 1 bytes dividing every part width, run offset and length."""
    values = [*widths, row_bytes, *(v for r in runs for v in r[1:])]
    return next((w for w in (8, 4, 2) if all(v % w == 0 for v in values)), 1)


def interleave(
    parts: Sequence[np.ndarray], runs: Sequence[Run], tokens: int, row_bytes: int
) -> pa.Buffer:
    """A new buffer of ``tokens`` rows of ``row_bytes`` filled by ``runs`` from ``parts``
    (C-contiguous ``[tokens, width]`` uint8 arrays); bytes no run writes are undefined.
    """
    nbytes = tokens * row_bytes
    out = pa.allocate_buffer(nbytes)
    if not nbytes or not runs:
        return out
    word = word_size([p.shape[1] for p in parts], runs, row_bytes)
    dtype = np.dtype(f"u{word}")
    raw = np.frombuffer(out, dtype=dtype)  # type: ignore[call-overload]  # pa.Buffer is a buffer
    dst = raw.reshape(tokens, row_bytes // word)
    dst.flags.writeable = True
    src = [p.view(dtype) for p in parts]
    for view in src:  # one numba type for every source: read-only (aligned, checked below)
        view.flags.writeable = False
    plan = [(p, s // word, d // word, n // word) for p, s, d, n in runs]
    kernels = _numba(nbytes) if nbytes >= NUMBA_MIN_BYTES else None
    if kernels is not None and all(v.flags.aligned for v in src):
        _numba_copy(kernels, dst, src, plan, tokens, row_bytes)
    else:
        block = max(1, _BLOCK // row_bytes)
        for lo in range(0, tokens, block):
            rows = slice(lo, lo + block)
            for p, s, d, n in plan:
                dst[rows, d : d + n] = src[p][rows, s : s + n]
    return out


def _numba_copy(
    kernels: ModuleType,
    dst: np.ndarray,
    src: list[np.ndarray],
    plan: list[Run],
    tokens: int,
    row_bytes: int,
) -> None:
    """The runs in passes of up to ``kernels.ARITY`` parts, each over row ranges on threads."""
    arity: int = kernels.ARITY
    used = sorted({p for p, _, _, _ in plan})
    slices = max(1, min(THREADS, tokens * row_bytes // _MIN_SLICE))
    bounds = np.linspace(0, tokens, slices + 1).astype(np.int64).tolist()
    for i in range(0, len(used), arity):
        chosen = used[i : i + arity]
        slot = {p: j for j, p in enumerate(chosen)}
        # Pad to a fixed arity (one compiled signature); padded slots have no runs.
        arrays: tuple[Any, ...] = tuple(src[p] for p in chosen) + (src[chosen[0]],) * (
            arity - len(chosen)
        )
        table = np.asarray(
            [(slot[p], s, d, n) for p, s, d, n in plan if p in slot], dtype=np.int64
        ).reshape(-1, 4)
        if slices == 1:
            kernels.copy_runs(dst, arrays, table, 0, tokens)
            continue
        jobs = [
            _pool().submit(kernels.copy_runs, dst, arrays, table, a, b)
            for a, b in itertools.pairwise(bounds)
        ]
        for job in jobs:
            job.result()


def warm_up() -> None:
    """Compile (or load from numba's cache) the kernel for every word size, if numba is used."""
    kernels = _numba(force=True)
    if kernels is None:
        return
    for word in (1, 2, 4, 8):
        dtype = np.dtype(f"u{word}")
        part = np.zeros((2, 2 * word), dtype=np.uint8)
        part.flags.writeable = False
        out = np.zeros((2, 2), dtype=dtype)
        arrays = (part.view(dtype),) * kernels.ARITY
        kernels.copy_runs(out, arrays, np.asarray([[0, 0, 0, 2]], dtype=np.int64), 0, 2)
