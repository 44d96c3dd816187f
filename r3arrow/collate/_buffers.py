"""Output memory of the collator: reusable byte buffers, 64-byte aligned views, pinned stage.

Fresh pages cost more to touch than the copy into them, so each microbatch's arrays are
carved (`_Arena`) out of a pooled buffer (`_BufferPool`); for a CUDA device the compact
replay buffer is written into page-locked memory (`_PinnedStage`) for an async copy.
"""

from __future__ import annotations

import math
import sys
import threading
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

_ALIGN = 64


class _BufferPool:
    """Byte buffers reused once no array or tensor views them (their refcount), thread-safe."""

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
            fits = [
                i
                for i in range(len(self._buffers))
                if self._buffers[i].nbytes >= nbytes and self._is_free(i)
            ]
            if fits:
                return self._buffers[min(fits, key=lambda i: self._buffers[i].nbytes)]
            self._drop_free()  # free buffers that are too small go rather than stay
            buf = np.empty(nbytes + nbytes // 8, dtype=np.uint8)  # headroom for the next batch
            if len(self._buffers) < self.max_buffers:
                self._buffers.append(buf)
            return buf

    def _drop_free(self) -> None:
        busy = [not self._is_free(i) for i in range(len(self._buffers))]
        self._buffers = [b for b, keep in zip(self._buffers, busy, strict=True) if keep]

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
        return sum(
            -(-math.prod(shape) * np.dtype(dtype).itemsize // _ALIGN) * _ALIGN
            for shape, dtype in parts
        )

    def take(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        dt = np.dtype(dtype)
        n = math.prod(shape) * dt.itemsize
        out: np.ndarray = self.buf[self.offset : self.offset + n].view(dt).reshape(shape)
        self.offset += -(-n // _ALIGN) * _ALIGN
        return out


class _PinnedStage:
    """A reusable page-locked buffer for ids shipped to CUDA; `take` first waits for the last
    copy out of it (`shipped`), so the next collation never overwrites bytes in flight."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None
        self._event: Any = None

    def take(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
        """A writable ``shape``/``dtype`` numpy view of the pinned buffer (grown as needed)."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        n = max(1, math.prod(shape) * dtype.itemsize)
        if self._buf is None or int(self._buf.numel()) < n:
            self._buf = torch.empty(n + n // 8, dtype=torch.uint8, pin_memory=True)
        arr: np.ndarray = self._buf[:n].numpy().view(dtype).reshape(shape)
        return arr

    def tensor(self, nbytes: int) -> torch.Tensor:
        """The first ``nbytes`` of the buffer as a pinned uint8 tensor."""
        assert self._buf is not None
        return self._buf[:nbytes]

    def shipped(self, device: torch.device) -> None:
        """Record that a copy out of the buffer was queued on ``device``'s current stream."""
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(device))
        self._event = event
