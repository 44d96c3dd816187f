"""Exception types. Every error says what was expected and what was found.

All inherit from :class:`R3ArrowError` and from the builtin they refine
(``ValueError``/``TypeError``/``RuntimeError``), so callers can catch either.
"""

from __future__ import annotations


class R3ArrowError(Exception):
    """Base class of every error r3arrow raises on purpose."""


class RouteShapeError(R3ArrowError, ValueError):
    """Routes have the wrong rank, layer count, top-k or row count."""


class RouteDTypeError(R3ArrowError, TypeError):
    """Routes or a payload use a dtype that is not an accepted integer type."""


class ExpertRangeError(R3ArrowError, ValueError):
    """An expert id is negative or not below ``num_experts``."""


class DuplicateExpertError(R3ArrowError, ValueError):
    """A token's top-k row on a MoE layer names the same expert twice."""


class TerminalGapError(R3ArrowError, ValueError):
    """A routed-expert row is missing for a token that the loss trains on."""


class TraceStateError(R3ArrowError, RuntimeError):
    """A trace was used out of order (for example finalized twice)."""


class ContiguityError(R3ArrowError, ValueError):
    """Turn appends of one trajectory leave a gap, overlap or repeat a turn."""


class PayloadError(R3ArrowError, ValueError):
    """A wire payload is malformed: bad base64, header, shape or byte count."""


class PayloadTooLargeError(PayloadError):
    """A payload (or the array its header declares) exceeds the allowed size."""


class SchemaError(R3ArrowError, ValueError):
    """A table or file does not follow the rollout schema, or is not a rollout file."""


class EngineError(R3ArrowError, RuntimeError):
    """An inference engine answered with an error or an unusable response."""


class EngineHTTPError(EngineError):
    """The engine answered with an HTTP error status (``status``) or could not be reached (``None``)."""

    def __init__(self, message: str, *, status: int | None = None, body: str = "", url: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.body = body
        self.url = url


class ReplayError(R3ArrowError, ValueError):
    """Replay targets (or a collator's layout) do not fit the routers they are meant for."""


class ReplayRangeError(ReplayError, ExpertRangeError):
    """A replay target names an expert outside ``[0, num_experts)``."""


class ReplayDuplicateError(ReplayError, DuplicateExpertError):
    """A replay target names the same expert twice for one token."""


__all__ = [
    "ContiguityError",
    "DuplicateExpertError",
    "EngineError",
    "EngineHTTPError",
    "ExpertRangeError",
    "PayloadError",
    "PayloadTooLargeError",
    "R3ArrowError",
    "ReplayDuplicateError",
    "ReplayError",
    "ReplayRangeError",
    "RouteDTypeError",
    "RouteShapeError",
    "SchemaError",
    "TerminalGapError",
    "TraceStateError",
]
