"""Output memory of the collator: a pool of reusable byte buffers and 64-byte aligned views.

Fresh pages cost more to touch than the copy into them, so the collator takes each
microbatch's buffer from a `_BufferPool` and carves its arrays out of it with an `_Arena`.
With a CUDA device, the compact replay buffer is written into a `_PinnedStage` (page-locked
host memory, so the copy to the device is asynchronous) reused once its last copy is done.
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


class _PinnedStage:
    """One reusable page-locked host buffer for the compact ids shipped to a CUDA device.

    `take` waits for the previous asynchronous copy out of the buffer (a CUDA event recorded
    by `shipped`) before handing the memory out again, so a ``non_blocking`` copy never
    reads bytes the next collation is writing. Not thread-safe (one per collator).
    """

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
