"""Chunked, threaded numpy kernels shared by the counting and agreement statistics.

Cache-sized chunks of tokens (slices, or index arrays of a selection) run on one thread
pool (numpy and torch release the GIL). `r3arrow._kernels.compiled` picks the numba
kernels instead where it can; both give the same integers and errors.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np

from r3arrow.errors import DuplicateExpertError, ExpertRangeError, RouteShapeError, SchemaError
from r3arrow.ids import check_routes

# Ids per chunk of the kernels: small enough that codes and bool temporaries stay in
# cache, large enough that the per-chunk Python overhead is noise (measured: 2**18).
CHUNK_IDS = 1 << 18
_MAX_THREADS = 8
# Ids per chunk of the numba kernels: large (no cache-sized temporaries), several per thread.
NUMBA_CHUNK_IDS = 1 << 22
_POOL: ThreadPoolExecutor | None = None
_POOL_LOCK = threading.Lock()
_T = TypeVar("_T")
Chunk = np.ndarray | slice


_INT64 = np.iinfo(np.int64)


def exact_sum(what: str, a: np.ndarray | int, b: np.ndarray | int) -> np.ndarray:
    """``a + b`` as int64, exact: `SchemaError` where a sum leaves int64 (never wraps)."""
    x, y = np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)
    with np.errstate(over="ignore"):
        out = np.asarray(x + y)
    # Two's complement: a sum wrapped exactly where its sign differs from both operands'.
    if np.any(((x ^ out) & (y ^ out)) < 0):
        raise SchemaError(
            f"{what}: expected sums that fit int64 (the partials' encoding), found one beyond "
            f"{_INT64.max}"
        )
    return out


def router_block(arr: np.ndarray, layers: list[int] | None, rows: Chunk) -> np.ndarray:
    """``arr[rows][:, layers]`` with one gather (a view when both are trivial)."""
    if layers is None:
        return arr[rows]
    if isinstance(rows, slice):
        return arr[rows, layers, :]
    return np.asarray(arr[np.ix_(rows, np.asarray(layers, dtype=np.intp))])


def chunks(n: int, rows: int, sel: np.ndarray | None) -> Iterator[Chunk]:
    """Chunks of at most ``rows`` of ``n`` rows: slices, or index arrays of the selected rows."""
    if sel is None:
        for s in range(0, n, rows):
            yield slice(s, min(s + rows, n))
    else:
        idx = np.flatnonzero(sel)
        for s in range(0, idx.size, rows):
            yield idx[s : s + rows]


def check_selection(sel: np.ndarray | None, n: int) -> np.ndarray | None:
    """``sel`` as a bool ``[n]`` array (``None`` passes); `RouteShapeError` otherwise."""
    if sel is None:
        return None
    s = np.asarray(sel)
    if s.dtype != np.bool_ or s.shape != (n,):
        raise RouteShapeError(
            f"token selection: expected bool [{n}], found {s.dtype} {list(s.shape)}"
        )
    return s


def check_ids(
    block: np.ndarray, num_experts: int | None, layers: Sequence[int], what: str, rows: Chunk
) -> None:
    """`r3arrow.ids.check_routes` on ``block`` ``[c, len(layers), K]``, rows ``rows`` of a
    route array: the error's ``token`` (and message) is the row in the whole array."""
    if isinstance(rows, slice):
        check_routes(
            block,
            num_experts=num_experts,
            layer_ids=layers,
            what=what,
            token_offset=rows.start or 0,
        )
        return
    try:
        check_routes(block, num_experts=num_experts, layer_ids=layers, what=what)
    except (ExpertRangeError, DuplicateExpertError) as exc:
        if exc.token is None:  # pragma: no cover - check_routes always sets it
            raise
        t = exc.token
        row = block[t : t + 1]
        check_routes(
            row, num_experts=num_experts, layer_ids=layers, what=what, token_offset=int(rows[t])
        )
        raise  # pragma: no cover - the row alone fails the same check


def raise_range(
    arr: np.ndarray, num_experts: int, layers: Sequence[int], sel: np.ndarray | None, what: str
) -> None:
    """Raise the `ExpertRangeError` of the first selected row of ``arr`` ``[T, n, K]`` with an
    id outside ``[0, num_experts)`` (one is known to exist)."""
    bad = arr >= num_experts
    if arr.dtype.kind == "i":
        bad |= arr < 0
    per_row = bad.any(axis=(1, 2))
    if sel is not None:
        per_row &= sel
    t = int(np.argmax(per_row))
    check_routes(
        arr[t : t + 1], num_experts=num_experts, layer_ids=layers, what=what, token_offset=t
    )
    raise AssertionError(f"{what}: row {t} expected out of range")  # pragma: no cover


def cpus() -> int:
    """The CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def _threads() -> int:
    return max(1, min(_MAX_THREADS, cpus()))


def _pool() -> ThreadPoolExecutor:
    """The kernels' thread pool, started once (a pool per call costs a thread start per chunk)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = ThreadPoolExecutor(_threads(), thread_name_prefix="r3arrow-stats")
        return _POOL


def map_chunks(fn: Callable[[Chunk], _T], parts: list[Chunk]) -> Iterator[_T]:
    """``fn`` over chunks, on a thread pool when there are several (the kernels release the GIL)."""
    if len(parts) <= 1 or _threads() == 1:
        yield from map(fn, parts)
        return
    yield from _pool().map(fn, parts)


def bincount(codes: np.ndarray) -> np.ndarray:
    """Counts of non-negative integer ``codes`` (torch's bincount when installed: GIL-free)."""
    try:
        import torch
    except ImportError:  # torch is the optional "torch" extra
        return np.bincount(codes.reshape(-1))
    return np.asarray(torch.bincount(torch.from_numpy(codes.reshape(-1))).numpy())


__all__ = [
    "CHUNK_IDS",
    "NUMBA_CHUNK_IDS",
    "Chunk",
    "bincount",
    "check_ids",
    "check_selection",
    "chunks",
    "cpus",
    "map_chunks",
    "raise_range",
    "router_block",
]
