"""Deterministic fault injection for `EngineServer`: delays, error statuses, dropped
connections and corrupted route payloads, consumed in order by generation requests.

    plan = FaultPlan().then(Fault.status(503), times=2).then(Fault.short_routes(1))
    with EngineServer(engine, faults=plan) as server:
        ...                       # 1st and 2nd generation requests: 503, 3rd: one row short
    plan.seen("/inference/v1/generate")   # generation requests received on that path
"""

from __future__ import annotations

import dataclasses
import threading
from collections import Counter, deque
from typing import Literal

FaultKind = Literal[
    "delay",
    "status",
    "drop_connection",
    "malformed_routes",
    "short_routes",
    "extra_routes",
    "no_routes",
]
MalformedMode = Literal["base64", "not_npy", "object", "float", "truncated", "shape"]

#: Paths whose requests consume faults (vLLM's generation endpoints).
GENERATION_PATHS = ("/inference/v1/generate", "/v1/completions")
_MALFORMED_MODES = ("base64", "not_npy", "object", "float", "truncated", "shape")


@dataclasses.dataclass(frozen=True)
class Fault:
    """One injected fault; build it with the static constructors."""

    kind: FaultKind
    seconds: float = 0.0
    status_code: int = 0
    retry_after: float | None = None
    rows: int = 0
    mode: MalformedMode = "base64"

    @staticmethod
    def delay(seconds: float) -> Fault:
        """Wait ``seconds`` before answering normally."""
        if not seconds >= 0:
            raise ValueError(f"Fault.delay: expected seconds >= 0, found {seconds!r}")
        return Fault("delay", seconds=float(seconds))

    @staticmethod
    def status(code: int, *, retry_after: float | None = None) -> Fault:
        """Answer with HTTP ``code`` (e.g. 503, 429, 500) and vLLM's error JSON, without generating.

        ``retry_after`` (seconds) adds a ``Retry-After`` header.
        """
        if not 400 <= code <= 599:
            raise ValueError(
                f"Fault.status: expected an HTTP error code in [400, 599], found {code}"
            )
        if retry_after is not None and not retry_after >= 0:
            raise ValueError(
                f"Fault.status: expected retry_after >= 0 or None, found {retry_after!r}"
            )
        return Fault("status", status_code=int(code), retry_after=retry_after)

    @staticmethod
    def drop_connection() -> Fault:
        """Close the connection after reading the request, without any response."""
        return Fault("drop_connection")

    @staticmethod
    def malformed_routes(mode: MalformedMode = "base64") -> Fault:
        """Generate normally, then replace every ``routed_experts`` with a corrupt payload.

        Modes: ``base64`` (not base64), ``not_npy`` (base64 of bytes that are no .npy),
        ``object`` (.npy header declaring an object array, which needs pickle),
        ``float`` (float32 values), ``truncated`` (.npy data cut short), ``shape``
        (2-D ``[rows, L*K]``).
        """
        if mode not in _MALFORMED_MODES:
            raise ValueError(
                f"Fault.malformed_routes: expected a mode in {_MALFORMED_MODES}, found {mode!r}"
            )
        return Fault("malformed_routes", mode=mode)

    @staticmethod
    def short_routes(n: int = 1) -> Fault:
        """Generate normally, then drop the last ``n`` rows of ``routed_experts``."""
        if n < 1:
            raise ValueError(f"Fault.short_routes: expected n >= 1, found {n}")
        return Fault("short_routes", rows=int(n))

    @staticmethod
    def extra_routes(n: int = 1) -> Fault:
        """Generate normally, then append ``n`` well-formed rows to ``routed_experts``."""
        if n < 1:
            raise ValueError(f"Fault.extra_routes: expected n >= 1, found {n}")
        return Fault("extra_routes", rows=int(n))

    @staticmethod
    def no_routes() -> Fault:
        """Generate normally, but answer ``routed_experts: null`` (capture disabled)."""
        return Fault("no_routes")


@dataclasses.dataclass
class _Entry:
    fault: Fault
    remaining: int | None  # None: forever
    endpoint: str | None


class FaultPlan:
    """A thread-safe queue of faults consumed by generation requests, in order.

    Each generation request takes the first queued entry whose endpoint matches
    (``None`` matches both generation paths); requests to other paths never take
    faults. An entry added with ``times=None`` applies to every later request.
    `seen` counts every request the server received, by path, faulted or not.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: deque[_Entry] = deque()
        self._seen: Counter[str] = Counter()
        self._injected: list[tuple[str, Fault]] = []

    def then(
        self, fault: Fault, *, times: int | None = 1, endpoint: str | None = None
    ) -> FaultPlan:
        """Queue ``fault`` for the next ``times`` matching requests (``None``: all); returns self."""
        if not isinstance(fault, Fault):
            raise TypeError(f"FaultPlan.then: expected a Fault, found {type(fault).__name__}")
        if times is not None and times < 1:
            raise ValueError(f"FaultPlan.then: expected times >= 1 or None, found {times}")
        if endpoint is not None and endpoint not in GENERATION_PATHS:
            raise ValueError(
                f"FaultPlan.then: expected endpoint None or one of {GENERATION_PATHS}, found {endpoint!r}"
            )
        with self._lock:
            self._queue.append(_Entry(fault, times, endpoint))
        return self

    def take(self, path: str) -> Fault | None:
        """Record a request on ``path``; return the fault it must suffer (if any), consuming it."""
        with self._lock:
            self._seen[path] += 1
            if path not in GENERATION_PATHS:
                return None
            for entry in self._queue:
                if entry.endpoint is None or entry.endpoint == path:
                    if entry.remaining is not None:
                        entry.remaining -= 1
                        if entry.remaining == 0:
                            self._queue.remove(entry)
                    self._injected.append((path, entry.fault))
                    return entry.fault
            return None

    def seen(self, path: str | None = None) -> int:
        """Requests received on ``path`` (``None``: on every path)."""
        with self._lock:
            return sum(self._seen.values()) if path is None else self._seen[path]

    @property
    def injected(self) -> list[tuple[str, Fault]]:
        """(path, fault) of every fault applied so far, in order."""
        with self._lock:
            return list(self._injected)

    @property
    def pending(self) -> int:
        """Faults still queued (an entry with ``times=None`` counts as one)."""
        with self._lock:
            return sum(1 if e.remaining is None else e.remaining for e in self._queue)
