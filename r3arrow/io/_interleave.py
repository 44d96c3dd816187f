"""The interleave copy of a layer-group restore: stored groups into per-token route rows.

A full (or multi-group) read of ``layer_groups/v1`` storage (`r3arrow.io._groups`) gets
one ``[T, group bytes]`` array per stored group and must produce the in-memory
``[T, L' * K * itemsize]`` rows. `interleave` does that one copy, described as *runs*:
``(part, src_byte, dst_byte, nbytes)`` = copy bytes ``src_byte .. +nbytes`` of every
token of ``parts[part]`` to bytes ``dst_byte .. +nbytes`` of the same token's output row.
A run is a range of consecutive wanted layers inside one stored group.

Why this module (``docs/storage.md``, "Full reads"): the copy moves many small pieces
(48 bytes per group and token for 6 layers of top-8 uint8), so a per-group numpy copy
spends its time in per-row loop overhead, not moving memory.

* On the numba backend (`r3arrow._kernels`; extra ``fast``) with numba already imported
  (see `_numba`: importing it costs about 1 s) and an output of at least `NUMBA_MIN_BYTES`,
  a compiled kernel (`r3arrow._kernels._numba.copy_runs`) walks the
  tokens once and copies every run of a token in machine words (8, 4, 2 or 1 bytes:
  the widest dividing every offset and length), reading up to 8 groups per pass. Row
  ranges run on up to `THREADS` threads (the kernel releases the GIL).
* Without numba, numpy copies blocks of rows whose output stays in cache (about 2 MiB),
  run by run, viewed as the same machine words.

The output is allocated from Arrow's memory pool (``pa.allocate_buffer``): the pool keeps
freed pages mapped, so consecutive pieces of a stream reuse them instead of faulting in
fresh pages from the OS, and Arrow's pool statistics count it like the rest of a piece.
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
    """`r3arrow._kernels.compiled` (the numba kernels, or None on the numpy backend).

    numba is imported here (the backend decided) only when something else already imported
    it (the id checks of a validating read, the statistics kernels), when ``force`` is set
    (`warm_up`), or once this process has interleaved `IMPORT_AFTER_BYTES` with numpy:
    importing it and loading the cached kernel costs about 1 s, which pays off only over gigabytes.
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
    for word in (8, 4, 2):
        if all(v % word == 0 for v in values):
            return word
    return 1


def interleave(
    parts: Sequence[np.ndarray], runs: Sequence[Run], tokens: int, row_bytes: int
) -> pa.Buffer:
    """A new buffer of ``tokens`` rows of ``row_bytes``, filled by ``runs`` from ``parts``.

    ``parts``: C-contiguous ``[tokens, width]`` uint8 arrays (one per stored group).
    The runs must cover every output byte (the caller checks the layers are covered);
    bytes no run writes are left undefined. Raises nothing for valid input.
    """
    nbytes = tokens * row_bytes
    out = pa.allocate_buffer(nbytes)
    if not nbytes or not runs:
        return out
    word = word_size([p.shape[1] for p in parts], runs, row_bytes)
    dtype = np.dtype(f"u{word}")
    dst = np.frombuffer(out, dtype=dtype).reshape(tokens, row_bytes // word)  # type: ignore[call-overload]  # pa.Buffer is a buffer
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


__all__ = [
    "IMPORT_AFTER_BYTES",
    "NUMBA_MIN_BYTES",
    "THREADS",
    "Run",
    "interleave",
    "warm_up",
    "word_size",
]
