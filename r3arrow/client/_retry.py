"""The client's retry policy: what is retried, how long to wait, which server to try next.

Retried (up to ``max_retries`` times, then `EngineHTTPError`):

* connection errors (``httpx.TransportError``: refused, reset, dropped mid-response) and
  connect/pool timeouts; a connect failure also moves the request to the next server;
* read/write timeouts only with ``retry_timeouts=True`` (a slow engine may still be
  generating: retrying by default would double its load);
* HTTP 429 and 5xx, honouring ``Retry-After`` on 429/503 up to ``retry_after_max`` seconds.

Never retried: other 4xx (the request itself is wrong), and every data error in a 2xx
response (bad payload, wrong row count, ids out of range): the engine answered, and asking
again would only hide a bug.

Waits grow exponentially, ``min(backoff_max, backoff_base * 2**attempt)``, with "equal
jitter" (half fixed, half uniform), so that retries of many clients spread out and a wait is
never zero.
"""

from __future__ import annotations

import dataclasses
import email.utils
import random
import time

import httpx

from r3arrow._checks import check_nonnegative_int, check_optional_int

#: Statuses that are retried besides 5xx.
RETRY_STATUSES = frozenset({429})
#: Statuses whose ``Retry-After`` header is honoured.
RETRY_AFTER_STATUSES = frozenset({429, 503})


def retry_after_seconds(value: str | None) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or an HTTP date); None if absent/invalid."""
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
    """How an `EngineClient` retries (``EngineClient(..., retry=RetryPolicy(...))``).

    ``max_retries``: retries after the first attempt (an int >= 0); ``backoff_base`` /
    ``backoff_max``: the exponential backoff in seconds; ``retry_after_max``: the longest
    ``Retry-After`` honoured, in seconds; ``retry_timeouts``: also retry read/write timeouts;
    ``seed``: seed of the jitter (None: unseeded). Argument misuse raises
    `ValueError`/`TypeError`.
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
        """Whether an HTTP error ``status`` (>= 400) is worth another attempt."""
        return status >= 500 or status in RETRY_STATUSES

    def retries_exception(self, exc: httpx.TransportError) -> bool:
        """Whether a transport error is worth another attempt (a read timeout only if allowed)."""
        if isinstance(exc, httpx.TimeoutException):
            return isinstance(exc, httpx.ConnectTimeout | httpx.PoolTimeout) or self.retry_timeouts
        return True

    @staticmethod
    def fails_over(exc: httpx.TransportError) -> bool:
        """Whether the server could not be reached at all (try the next base URL)."""
        return isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout)

    @staticmethod
    def retry_after(response: httpx.Response) -> float | None:
        """The wait a 429/503 response asks for (None: none asked, or another status)."""
        if response.status_code not in RETRY_AFTER_STATUSES:
            return None
        return retry_after_seconds(response.headers.get("retry-after"))

    def delay(self, attempt: int, retry_after: float | None, rng: random.Random) -> float:
        """Seconds to wait before retry ``attempt + 1`` (``attempt`` counts from 0).

        Exponential with equal jitter, in ``[cap / 2, cap]`` for ``cap = min(backoff_max,
        backoff_base * 2**attempt)``; at least ``min(retry_after, retry_after_max)``. ``rng``
        draws the jitter (the client's, seeded by ``seed``).
        """
        cap = min(self.backoff_max, self.backoff_base * (2.0**attempt))
        delay = cap / 2 + rng.uniform(0, cap / 2)
        if retry_after is not None:
            delay = max(delay, min(retry_after, self.retry_after_max))
        return delay


__all__ = ["RETRY_AFTER_STATUSES", "RETRY_STATUSES", "RetryPolicy", "retry_after_seconds"]
