"""The client's retry policy (``docs/design.md``, "Error policy"): connection errors,
connect/pool timeouts (a connect failure also tries the next server), read/write timeouts
only with ``retry_timeouts``, 429 and 5xx; never other 4xx nor data errors.
"""

from __future__ import annotations

import dataclasses
import email.utils
import random
import time

import httpx

from r3arrow._checks import check_nonnegative_int, check_optional_int


def retry_after_seconds(value: str | None) -> float | None:
    """Seconds of a Retry-After header (seconds or an HTTP date); None if absent or invalid."""
    if not value:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        pass
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    return max(0.0, when.timestamp() - time.time())


@dataclasses.dataclass(frozen=True)
class RetryPolicy:
    """How an `EngineClient` retries: ``max_retries`` after the first attempt, backoff in seconds
    (`delay`), the longest ``Retry-After`` honoured, whether read/write timeouts are retried, and
    the jitter's ``seed``. Argument misuse raises `ValueError`/`TypeError`.
    """

    max_retries: int = 3
    backoff_base: float = 0.1
    backoff_max: float = 5.0
    retry_after_max: float = 30.0
    retry_timeouts: bool = False
    seed: int | None = None

    def __post_init__(self) -> None:
        check_nonnegative_int(self.max_retries, "max_retries")
        for name in ("backoff_base", "backoff_max", "retry_after_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise TypeError(f"{name}: expected a number of seconds, found {value!r}")
            if not value >= 0:
                raise ValueError(f"{name}: expected seconds >= 0, found {value!r}")
            object.__setattr__(self, name, float(value))
        if not isinstance(self.retry_timeouts, bool):
            raise TypeError(f"retry_timeouts: expected a bool, found {self.retry_timeouts!r}")
        check_optional_int(self.seed, "seed")

    @staticmethod
    def retries_status(status: int) -> bool:
        """Whether an HTTP error ``status`` is worth another attempt."""
        return status >= 500 or status == 429

    def retries_exception(self, exc: httpx.TransportError) -> bool:
        """Whether a transport error is worth another attempt."""
        if isinstance(exc, httpx.TimeoutException):
            return isinstance(exc, httpx.ConnectTimeout | httpx.PoolTimeout) or self.retry_timeouts
        return True

    @staticmethod
    def fails_over(exc: httpx.TransportError) -> bool:
        """Whether the server could not be reached (try the next base URL)."""
        return isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout)

    @staticmethod
    def retry_after(response: httpx.Response) -> float | None:
        """The wait a 429/503 response asks for, if any."""
        if response.status_code not in (429, 503):
            return None
        return retry_after_seconds(response.headers.get("retry-after"))

    def delay(self, attempt: int, retry_after: float | None, rng: random.Random) -> float:
        """Seconds before retry ``attempt + 1``: uniform in ``[cap / 2, cap]`` for ``cap =
        min(backoff_max, backoff_base * 2**attempt)``, and at least ``min(retry_after,
        retry_after_max)``.
        """
        cap = min(self.backoff_max, self.backoff_base * (2.0**attempt))
        delay = cap / 2 + rng.uniform(0, cap / 2)
        if retry_after is not None:
            delay = max(delay, min(retry_after, self.retry_after_max))
        return delay
