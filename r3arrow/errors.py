"""Exception types and the error policy (``docs/design.md``, "Error policy").

Argument misuse raises a builtin ``TypeError``/``ValueError``. Bad data, payloads, state and
protocol raise `R3ArrowError` subclasses, each also deriving from the builtin it refines,
with a message saying what was expected and what was found and the structured fields
``trajectory_id``, ``row`` (a table or route row), ``token`` (a position), ``layer`` (a
global layer id) and ``path`` (``None`` where they do not apply), so callers never parse
messages. Callers catch them to drop a sample, retry a request or quarantine a file.
"""

from __future__ import annotations

from typing import Any


class R3ArrowError(Exception):
    """Base class of every error r3arrow raises on purpose (fields: module docstring)."""

    def __init__(
        self,
        message: str,
        *,
        trajectory_id: str | None = None,
        row: int | None = None,
        token: int | None = None,
        layer: int | None = None,
        path: Any = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.trajectory_id = trajectory_id
        self.row = None if row is None else int(row)
        self.token = None if token is None else int(token)
        self.layer = None if layer is None else int(layer)
        self.path = None if path is None else str(path)

    def fields(self) -> dict[str, Any]:
        """The structured fields that are set, as a dict (for logs and JSON)."""
        names = ("trajectory_id", "row", "token", "layer", "path")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    def __reduce__(self) -> tuple[Any, ...]:
        # Exceptions cross process boundaries (Ray tasks, multiprocessing): keep the fields.
        return (_rebuild, (type(self), self.message, self.__dict__))


def _rebuild(cls: type[R3ArrowError], message: str, state: dict[str, Any]) -> R3ArrowError:
    err = cls.__new__(cls)
    Exception.__init__(err, message)
    err.__dict__.update(state)
    return err


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


class PrefixMismatchError(R3ArrowError, ValueError):
    """A request's prompt does not extend its trace's tokens (``token``: the first difference)."""


class PayloadError(R3ArrowError, ValueError):
    """A wire payload is malformed: bad base64, header, shape or byte count."""


class PayloadTooLargeError(PayloadError):
    """A payload (or the array its header declares) exceeds the allowed size."""


class SchemaError(R3ArrowError, ValueError):
    """A table or file does not follow the rollout schema, or is not a rollout file."""


class EngineError(R3ArrowError, RuntimeError):
    """An inference engine answered with an error or an unusable response."""


class EngineHTTPError(EngineError):
    """The engine answered an HTTP error ``status`` (None: unreachable), ``body`` truncated."""

    def __init__(
        self, message: str, *, status: int | None = None, body: str = "", url: str = ""
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = body
        self.url = url


class EngineResponseError(EngineError):
    """A 2xx engine response is malformed: ``field`` is the offending value's JSON path (like
    ``"output_ids[0]"``; ``""``: the whole body), ``url`` the server (set by `EngineClient`)."""

    def __init__(self, message: str, *, field: str = "", url: str = "") -> None:
        super().__init__(message)
        self.field = field
        self.url = url


class RouteQualityError(EngineError):
    """Well-formed routes matching a known engine bug (`r3arrow.capture.check_route_quality`);
    ``layer``: the global layer, ``bugs``: the upstream reports (like ``"vLLM #44116"``).
    """

    def __init__(
        self,
        message: str,
        *,
        layer: int | None = None,
        bugs: tuple[str, ...] = (),
        trajectory_id: str | None = None,
    ) -> None:
        super().__init__(message, layer=layer, trajectory_id=trajectory_id)
        self.bugs = tuple(bugs)


class EngineRequestError(R3ArrowError, ValueError):
    """A request the embedded engine refuses with HTTP 400 (``param``: vLLM's ``error.param``)."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


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
    "EngineRequestError",
    "EngineResponseError",
    "ExpertRangeError",
    "PayloadError",
    "PayloadTooLargeError",
    "PrefixMismatchError",
    "R3ArrowError",
    "ReplayDuplicateError",
    "ReplayError",
    "ReplayRangeError",
    "RouteDTypeError",
    "RouteQualityError",
    "RouteShapeError",
    "SchemaError",
    "TerminalGapError",
    "TraceStateError",
]
