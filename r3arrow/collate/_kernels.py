"""Copy kernels: compact Arrow route rows → the layer-major int32 replay buffer.

Per cache-sized block: gather the local layers of a block of tokens from the compact
buffer, transpose in cache (each token's ``[K]`` ids moving as one machine word), widen
into place. Packed: `_RouteCopier` per trajectory chunk; unpacked: `_RowGatherer` per block
of positions over all rows, so the sequence-major output is written contiguously too.
Python loops run per chunk or per block, never per token or per layer.
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: Bytes of compact routes transposed per block (fits in L2 next to its int32 output).
_BLOCK_BYTES = 1 << 17

_ROW_VIEW: dict[int, np.dtype[Any]] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.uint16),
    4: np.dtype(np.uint32),
    8: np.dtype(np.uint64),
}


def _put(
    out: np.ndarray,
    at: int,
    a: int,
    b: int,
    p: int,
    prompt: np.ndarray,
    po: int,
    resp: np.ndarray,
    ro: int,
) -> None:
    """out[at : at+b-a] = tokens [a, b) of a sequence whose first ``p`` tokens are its prompt."""
    if a < p:
        e = min(b, p)
        out[at : at + e - a] = prompt[po + a : po + e]
    if b > p:
        s = max(a, p)
        out[at + s - a : at + b - a] = resp[ro + s - p : ro + b - p]


class _RouteCopier:
    """Packed kernel: compact rows ``[s0, s0+count)``, local layers → ``lm[:, at:at+count, 0]``.

    Per cache-sized block: (1) gather the block's local layers into a contiguous buffer
    (one element per token when the layers are a contiguous range: a single strided loop
    instead of one call per token), (2) transpose it in cache, each token's ``[K]`` ids
    moving as one machine word (or a K·itemsize void), (3) widen into the int32 output,
    contiguous per layer.
    """

    def __init__(self, routes: np.ndarray, select: slice | np.ndarray, lm: np.ndarray) -> None:
        tokens, layers, k = routes.shape
        n_local = lm.shape[0]
        self.select, self.k, self.dtype, self.lm = select, k, routes.dtype, lm
        row_bytes = k * routes.dtype.itemsize
        self.row_dtype: np.dtype[Any] = _ROW_VIEW.get(row_bytes, np.dtype((np.void, row_bytes)))
        self.rows = routes.reshape(tokens, layers * k).view(self.row_dtype)
        contiguous = isinstance(select, slice) and select.step in (None, 1)
        self.span = np.dtype((np.void, n_local * row_bytes)) if contiguous else None
        self.block = max(64, _BLOCK_BYTES // max(1, n_local * row_bytes))
        self.gathered = np.empty((self.block, n_local), dtype=self.row_dtype)
        self.tmp = np.empty((n_local, self.block), dtype=self.row_dtype)
        # int32 storage needs no widening: copy whole 4·K-byte rows.
        self.out_row = np.dtype((np.void, 4 * k))
        self.lm_rows = lm.reshape(n_local, lm.shape[1] * lm.shape[2] * k).view(self.out_row)

    def copy(self, s0: int, count: int, at: int) -> None:
        n_local = self.lm.shape[0]
        for off in range(0, count, self.block):
            c = min(self.block, count - off)
            t = self.tmp[:, :c]
            src = self.rows[s0 + off : s0 + off + c, self.select]
            if self.span is not None:
                g = self.gathered[:c]
                np.copyto(g.view(self.span), src.view(self.span))
                np.copyto(t, g.T)
            else:
                np.copyto(t, src.T)
            a, b = at + off, at + off + c
            if self.dtype == np.dtype(np.int32):
                np.copyto(self.lm_rows[:, a:b], t.view(self.out_row))
            else:
                np.copyto(self.lm[:, a:b, 0, :], t.view(self.dtype).reshape(n_local, c, self.k))


class _RowGatherer:
    """Unpacked kernel: for positions ``[p0, p1)`` of every row, gather the local layers'
    routes (dummy rows where not captured) with one ``take``, transpose in cache, widen into
    the contiguous ``lm[:, p0:p1, :, :]``."""

    def __init__(
        self,
        routes: np.ndarray,
        select: slice | np.ndarray,
        lm: np.ndarray,
        first_row: np.ndarray,
        captured: np.ndarray,
    ) -> None:
        tokens, layers, k = routes.shape
        n_local, positions, columns, _ = lm.shape
        self.k, self.dtype, self.columns, self.select = k, routes.dtype, columns, select
        row_bytes = k * routes.dtype.itemsize
        self.row_dtype: np.dtype[Any] = _ROW_VIEW.get(row_bytes, np.dtype((np.void, row_bytes)))
        self.rows = routes.reshape(tokens, layers * k).view(self.row_dtype)
        self.layer_index = np.arange(layers)[select]
        self.first_row, self.captured = first_row, captured
        self.empty = tokens == 0
        self.block_positions = max(1, (4 * _BLOCK_BYTES) // max(1, columns * n_local * row_bytes))
        self.tmp = np.empty((n_local, self.block_positions * columns), dtype=self.row_dtype)
        dummy = np.tile(np.arange(k, dtype=routes.dtype), n_local)
        self.dummy = np.frombuffer(dummy.tobytes(), dtype=self.row_dtype)
        self.lm_flat = lm.reshape(n_local, positions * columns, k)
        self.lm_rows = self.lm_flat.reshape(n_local, positions * columns * k).view(
            np.dtype((np.void, 4 * k))
        )

    def run(self, t_of_p: np.ndarray, p0: int, p1: int) -> None:
        t = t_of_p[p0:p1]
        c = t.shape[0] * self.columns
        idx = self.first_row[None, :] + t[:, None]
        pad = (t[:, None] >= self.captured[None, :]).reshape(-1)
        flat = idx.reshape(-1)
        flat[pad] = 0
        if self.empty:
            stage = np.empty((c, self.tmp.shape[0]), dtype=self.row_dtype)
            stage[:] = self.dummy
        else:
            # Advanced index on tokens + basic slice on layers: one row copy per token.
            if isinstance(self.select, slice):
                stage = self.rows[flat, self.select]
            else:
                stage = self.rows[flat[:, None], self.layer_index[None, :]]
            stage[pad] = self.dummy
        tmp = self.tmp[:, :c]
        np.copyto(tmp, stage.T)
        q0, q1 = p0 * self.columns, p1 * self.columns
        if self.dtype == np.dtype(np.int32):
            np.copyto(self.lm_rows[:, q0:q1], tmp.view(self.lm_rows.dtype))
        else:
            np.copyto(self.lm_flat[:, q0:q1], tmp.view(self.dtype).reshape(tmp.shape[0], c, self.k))


def _run_copies(
    sources: list[np.ndarray],
    select: slice | np.ndarray,
    lm: np.ndarray,
    jobs: list[tuple[int, int, int, int]],
    pads: list[tuple[int, int]],
) -> None:
    """Packed route copies ``(source, first row, rows, at)`` and dummy rows ``[0 .. K-1]`` at
    ``(at, positions)``; one worker's share, with its own scratch buffers."""
    copiers: dict[int, _RouteCopier] = {}
    for src, s0, count, at in jobs:
        cp = copiers.get(src)
        if cp is None:
            cp = copiers[src] = _RouteCopier(sources[src], select, lm)
        cp.copy(s0, count, at)
    if pads:
        k = lm.shape[3]
        out_row = np.dtype((np.void, 4 * k))
        lm_rows = lm.reshape(lm.shape[0], lm.shape[1] * lm.shape[2] * k).view(out_row)
        dummy = np.arange(k, dtype=np.int32).view(out_row)[0]
        for at, count in pads:
            lm_rows[:, at : at + count] = dummy
