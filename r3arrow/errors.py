"""Exception types and r3arrow's error policy.

The policy (modelled on httpx's):

* **Argument misuse raises a builtin.** A caller passing the wrong type or an
  out-of-range option (``topk=0``, ``tokens="everything"``, ``step=1.9``) gets
  :class:`TypeError` or :class:`ValueError`, never an r3arrow type: the fix is in
  the calling code, not in the data. :mod:`r3arrow._checks` holds the shared
  helpers for these checks.
* **Bad data, payloads, state and protocol raise** :class:`R3ArrowError`
  **subclasses.** Routes with a wrong shape or an out-of-range or duplicated id, a
  malformed engine payload, a file that is not a valid rollout file, a trace used
  out of order, an engine that answers with an error: the fix is in the data or
  the system that produced it, and callers catch these to drop a sample, retry a
  request or quarantine a file.
* Every r3arrow error also derives from the builtin it refines (``ValueError``,
  ``TypeError`` or ``RuntimeError``), so code that catches the builtin keeps
  working.
* Every message says what was expected and what was found. Where they apply, the
  error carries **structured fields** so callers never parse messages:
  ``trajectory_id``, ``row`` (a row of a table or a route row), ``token`` (a
  token position in a sequence), ``layer`` (a global layer id) and ``path`` (a
  file or directory). A field that does not apply is ``None``.

Hierarchy::

    R3ArrowError
    ├── RouteShapeError        (ValueError)  wrong rank, layer count, top-k or row count
    ├── RouteDTypeError        (TypeError)   not an accepted integer dtype
    ├── ExpertRangeError       (ValueError)  id negative or not below num_experts
    │   └── ReplayRangeError   (+ ReplayError)
    ├── DuplicateExpertError   (ValueError)  the same expert twice in one top-k row
    │   └── ReplayDuplicateError (+ ReplayError)
    ├── TerminalGapError       (ValueError)  a loss-active token has no route row
    ├── TraceStateError        (RuntimeError) a trace used out of order
    ├── ContiguityError        (ValueError)  turn appends leave a gap or overlap
    ├── PrefixMismatchError    (ValueError)  a request does not extend its trace
    ├── PayloadError           (ValueError)  a malformed wire payload
    │   └── PayloadTooLargeError
    ├── SchemaError            (ValueError)  a table or file off the rollout schema
    ├── EngineError            (RuntimeError) an engine error or unusable response
    │   ├── EngineHTTPError    (status, body, url)
    │   └── RouteQualityError  (layer; bugs) routes that look valid but match a known engine bug
    ├── EngineRequestError     (ValueError; param) a request the embedded engine refuses (HTTP 400)
    └── ReplayError            (ValueError)  targets that do not fit the routers
"""

from __future__ import annotations

from typing import Any


class R3ArrowError(Exception):
    """Base class of every error r3arrow raises on purpose.

    Parameters
    ----------
    message:
        What was expected and what was found.
    trajectory_id, row, token, layer, path:
        Where the problem is, when that applies (``None`` otherwise): the
        trajectory's id, a row index (table row or route row), a token position,
        a global layer id, and a file or directory path (as ``str``).
    """

    trajectory_id: str | None
    row: int | None
    token: int | None
    layer: int | None
    path: str | None

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
    """A request's prompt does not extend the tokens its trace already covers.

    ``token`` is the first position where the prompt differs.
    """


class PayloadError(R3ArrowError, ValueError):
    """A wire payload is malformed: bad base64, header, shape or byte count."""


class PayloadTooLargeError(PayloadError):
    """A payload (or the array its header declares) exceeds the allowed size."""


class SchemaError(R3ArrowError, ValueError):
    """A table or file does not follow the rollout schema, or is not a rollout file."""


class EngineError(R3ArrowError, RuntimeError):
    """An inference engine answered with an error or an unusable response."""


class EngineHTTPError(EngineError):
    """The engine answered with an HTTP error status (``status``), or was unreachable (``None``).

    ``body`` is the (truncated) response body, ``url`` the URL that was requested.
    """

    def __init__(
        self, message: str, *, status: int | None = None, body: str = "", url: str = ""
    ) -> None:
        super().__init__(message)
        self.status = status
        self.body = body
        self.url = url


class RouteQualityError(EngineError):
    """An engine returned routes that are well-formed but match a known engine bug.

    Examples: a router layer whose rows are all zero ("as if every token selected
    expert 0": vLLM #44116, fixed by #44214; vllm-ascend #16314; SGLang NGRAM
    speculative decoding, SGLang #37949), or every token of a response routed
    identically. ``layer`` is the global layer id; ``bugs`` lists the upstream
    reports the pattern matches (strings like ``"vLLM #44116"``).
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
    """A generation request is invalid; the embedded engine answers HTTP 400 with vLLM's error JSON.

    ``param`` names the offending request parameter (vLLM's ``error.param``).
    """

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
