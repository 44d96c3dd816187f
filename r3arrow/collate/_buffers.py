"""Output memory of the collator: a pool of reusable byte buffers and 64-byte aligned views.

Fresh pages cost more to touch than the copy into them, so the collator takes each
microbatch's buffer from a `_BufferPool` and carves its arrays out of it with an `_Arena`.
"""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Iterable
from typing import Any

import numpy as np

_ALIGN = 64


class _BufferPool:
    """Reuses byte buffers once no array or tensor views them any more.

    A buffer is free when the pool holds the only reference to it: every numpy view
    and every tensor made by ``torch.from_numpy`` keeps the base array alive, so the
    reference count is exact. Thread-safe.
    """

    def __init__(self, max_buffers: int = 32) -> None:
        self.max_buffers = max_buffers
        self._buffers: list[np.ndarray] = []
        self._lock = threading.Lock()

    def _is_free(self, i: int) -> bool:
        # References: the list slot and getrefcount's argument.
        return sys.getrefcount(self._buffers[i]) <= 2

    def take(self, nbytes: int) -> np.ndarray:
        nbytes = max(int(nbytes), 1)
        with self._lock:
            best = -1
            for i in range(len(self._buffers)):
                size = self._buffers[i].nbytes
                if (
                    size >= nbytes
                    and self._is_free(i)
                    and (best < 0 or size < self._buffers[best].nbytes)
                ):
                    best = i
            if best >= 0:
                return self._buffers[best]
            # Replace free buffers that are too small rather than keeping them around.
            self._drop_free()
            # 1/8 headroom so the next, slightly larger batch fits.
            buf = np.empty(nbytes + nbytes // 8, dtype=np.uint8)
            if len(self._buffers) < self.max_buffers:
                self._buffers.append(buf)
            return buf

    def _drop_free(self) -> None:
        busy = [not self._is_free(i) for i in range(len(self._buffers))]
        self._buffers = [self._buffers[i] for i in range(len(busy)) if busy[i]]

    def clear(self) -> None:
        """Drop every free buffer."""
        with self._lock:
            self._drop_free()

    def __len__(self) -> int:
        return len(self._buffers)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._buffers)


class _Arena:
    """Carves 64-byte aligned typed views out of one byte buffer."""

    def __init__(self, buf: np.ndarray) -> None:
        self.buf = buf
        self.offset = 0

    @staticmethod
    def size(parts: Iterable[tuple[tuple[int, ...], Any]]) -> int:
        total = 0
        for shape, dtype in parts:
            total += -(-math.prod(shape) * np.dtype(dtype).itemsize // _ALIGN) * _ALIGN
        return total

    def take(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        dt = np.dtype(dtype)
        n = math.prod(shape) * dt.itemsize
        out: np.ndarray = self.buf[self.offset : self.offset + n].view(dt).reshape(shape)
        self.offset += -(-n // _ALIGN) * _ALIGN
        return out
