"""Incremental per-trajectory capture of token-aligned rows across turns: the one capture path.

`TokenTrace` is the generic accumulator for any fixed-shape per-token column
(routes, sampled logprobs, ...); `RouteTrace` specialises it for routed experts
(shape, dtype and id-range checks through :mod:`r3arrow.ids`, dtype widening).

Semantics (``docs/design.md``, "Rows and incremental capture" and "Ragged routes
and the terminal gap"): a request sends the whole conversation as prompt with
``prompt start = captured`` and must return exactly ``P - captured + G - 1`` rows;
row ``i`` predicts token ``i + 1``, so the rows a trajectory never captures may
only predict loss-masked tokens. That terminal-gap rule is implemented once, here
(`first_terminal_gap`, `terminal_gap_error`, `check_terminal_gap`); the rollout
table's validation uses the same functions.

**The capture path.** `RouteTrace.record` is the only place a turn's routes are
validated. A trace made by `r3arrow.store.TurnStore.trace` is *bound* to that store:
every turn it records (validated, owned, read-only, in storage dtype) is handed to
the store as one record batch at ``token_start = captured before the turn``, which
the store trusts without a second check. ``TurnStore.append`` (outside data) stays a
validating trust boundary and uses the same validator (`validate_route_rows`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa

from r3arrow._checks import check_int, check_positive_int
from r3arrow.errors import (
    R3ArrowError,
    RouteDTypeError,
    RouteShapeError,
    TerminalGapError,
    TraceStateError,
)
from r3arrow.ids import check_route_ids
from r3arrow.spec import RouteSpec, as_route_rows, numpy_to_routes

#: Receives each validated turn of a bound `RouteTrace`: ``(token_start, rows, spec)``, rows
#: ``[n, L, K]`` read-only in ``spec.dtype``. Raising leaves the trace unchanged.
TurnSink = Callable[[int, np.ndarray, RouteSpec], None]

#: A token count: an ``int`` or a numpy integer (``bool`` is refused).
TokenCount = int | np.integer[Any]


def expected_rows(*, prompt_tokens: int, generated_tokens: int, prompt_start: int) -> int:
    """Rows an engine returns for prompt length P, G generated tokens and prompt start s."""
    return prompt_tokens - prompt_start + generated_tokens - 1


# ---------------------------------------------------------------- terminal gap
def first_terminal_gap(loss_mask: np.ndarray, positions: np.ndarray, captured: Any) -> int:
    """Index into ``loss_mask`` of the first loss-active token without a route row, or -1.

    The terminal-gap rule (``docs/design.md``, "Ragged routes and the terminal gap"):
    route row ``i`` predicts token ``i + 1``, so a trajectory that captured ``c`` rows
    covers the targets ``1 .. c``; a loss-active token at position ``t > c`` has no row.

    Parameters
    ----------
    loss_mask:
        ``[T]`` mask values (nonzero = the loss trains on that token).
    positions:
        ``[T]`` token position of each mask value within its trajectory.
    captured:
        Captured rows: a scalar, or ``[T]`` (the value's trajectory's count).
    """
    viol = np.flatnonzero((loss_mask != 0) & (positions > captured))
    return int(viol[0]) if viol.size else -1


def terminal_gap_error(
    *,
    token: int,
    captured: int,
    num_tokens: int,
    trajectory_id: str | None = None,
    row: int | None = None,
) -> TerminalGapError:
    """The `TerminalGapError` for a loss-active ``token`` without a route row (fields set)."""
    where = ""
    if trajectory_id is not None:
        where = f"trajectory {trajectory_id!r}" + (f" (row {row})" if row is not None else "")
        where += ": "
    return TerminalGapError(
        f"{where}missing routed-expert row for loss-active target at token {token} "
        f"(captured {captured} of {num_tokens} tokens; rows >= {captured} are missing)",
        token=token,
        trajectory_id=trajectory_id,
        row=row,
    )


def check_terminal_gap(
    captured: int, loss_mask: Any, *, num_tokens: int, trajectory_id: str | None = None
) -> np.ndarray:
    """Validate the uncaptured suffix of one trajectory; return the mask as a numpy bool array.

    ``loss_mask`` covers all ``num_tokens`` tokens (prompt included). Rows
    ``[captured, num_tokens-1)`` may be missing only where ``loss_mask[i+1] == 0``.

    Raises
    ------
    TerminalGapError
        naming (``token``, ``trajectory_id``) the first loss-active token without a row.
    RouteShapeError
        a mask of the wrong length, or more captured rows than tokens.
    """
    mask = np.asarray(loss_mask)
    if mask.ndim != 1 or mask.shape[0] != num_tokens:
        raise RouteShapeError(
            f"loss_mask: expected a 1-D mask over all {num_tokens} tokens, "
            f"found shape {list(mask.shape)}",
            trajectory_id=trajectory_id,
        )
    if captured > num_tokens:
        raise RouteShapeError(
            f"expected at most num_tokens={num_tokens} captured rows, found {captured}",
            trajectory_id=trajectory_id,
        )
    tail = mask[captured + 1 :]
    k = first_terminal_gap(tail, np.arange(captured + 1, num_tokens), captured)
    if k >= 0:
        raise terminal_gap_error(
            token=captured + 1 + k,
            captured=captured,
            num_tokens=num_tokens,
            trajectory_id=trajectory_id,
        )
    return mask.astype(bool, copy=False)


# ---------------------------------------------------------------------- traces
class TokenTrace:
    """Accumulates one trajectory's fixed-shape per-token rows, turn by turn, in O(N).

    Each turn is kept as one owned, read-only, C-contiguous chunk in ``dtype``
    (read-only contiguous input of that dtype is kept uncopied; anything else is
    copied once, so a caller reusing its buffer cannot corrupt the trace); chunks
    are joined once, in `finalize`, directly into the result buffer.

    Parameters
    ----------
    row_shape:
        Shape of one token's row (``()`` for scalars); positive ints
        (``TypeError`` / ``ValueError`` otherwise).
    dtype:
        numpy dtype the rows are stored in.
    name:
        What the rows are, for messages.
    """

    def __init__(self, row_shape: tuple[int, ...], dtype: Any, *, name: str = "rows") -> None:
        self.row_shape = tuple(check_positive_int(d, "row_shape") for d in row_shape)
        self.dtype: np.dtype[Any] = np.dtype(dtype)
        self.name = name
        self._chunks: list[np.ndarray] = []
        self._captured = 0
        self._seen_tokens = 0
        self._finalized = False

    # ------------------------------------------------------------------ state
    @property
    def captured(self) -> int:
        """Rows held so far: the prompt start to send with the next request."""
        return self._captured

    @property
    def seen_tokens(self) -> int:
        """Length of the conversation at the last recorded turn (P + G), 0 before any."""
        return self._seen_tokens

    @property
    def num_turns(self) -> int:
        return len(self._chunks)

    @property
    def finalized(self) -> bool:
        return self._finalized

    # --------------------------------------------------------------- recording
    def _coerce(self, rows: Any) -> tuple[np.ndarray, Any]:
        """Check ``rows`` (shape ``[rows, *row_shape]``, storable exactly as ``dtype``).

        Returns (array, state for `_accept`); changes nothing.
        """
        want = f"[{', '.join(['rows', *map(str, self.row_shape)])}]"
        try:
            arr = np.asarray(rows)
        except (ValueError, TypeError) as exc:
            raise RouteShapeError(
                f"{self.name}: expected a rectangular {want} array, found {exc}"
            ) from exc
        if arr.ndim != 1 + len(self.row_shape) or arr.shape[1:] != self.row_shape:
            raise RouteShapeError(f"{self.name}: expected shape {want}, found {list(arr.shape)}")
        if arr.size and not np.can_cast(arr.dtype, self.dtype, "same_kind"):
            raise RouteDTypeError(
                f"{self.name}: expected values storable as {self.dtype}, found dtype {arr.dtype}"
            )
        if arr.size and self.dtype.kind in "iu" and not np.can_cast(arr.dtype, self.dtype):
            info = np.iinfo(self.dtype)
            lo, hi = int(arr.min()), int(arr.max())
            if lo < info.min or hi > info.max:
                raise RouteDTypeError(
                    f"{self.name}: expected values in [{info.min}, {info.max}] ({self.dtype}), "
                    f"found [{lo}, {hi}]"
                )
        return arr, None

    def _accept(self, start: int, arr: np.ndarray, state: Any) -> None:
        """Hook run with a validated, owned turn before the trace commits it (may raise)."""

    def record(self, rows: Any, *, prompt_tokens: TokenCount, generated_tokens: TokenCount) -> int:
        """Append one response's rows; returns the token index of its first row.

        ``rows`` must have ``prompt_tokens - captured + generated_tokens - 1`` rows.
        On any error the trace is unchanged.

        Raises
        ------
        TypeError, ValueError
            ``prompt_tokens`` / ``generated_tokens`` not ints ``>= 1`` (argument misuse).
        RouteShapeError
            wrong row count or row shape, or a prompt that does not extend past ``captured``.
        RouteDTypeError
            values not storable exactly in the trace's dtype.
        TraceStateError
            the trace was finalized.
        """
        if self._finalized:
            raise TraceStateError(
                f"{self.name}: trace already finalized; expected no further record()"
            )
        p = check_positive_int(prompt_tokens, "prompt_tokens")
        g = check_positive_int(generated_tokens, "generated_tokens")
        if p <= self._captured:
            raise RouteShapeError(
                f"{self.name}: expected prompt_tokens > captured={self._captured} (prompt start "
                f"must lie inside the prompt), found prompt_tokens={p}"
            )
        arr, state = self._coerce(rows)
        want = expected_rows(prompt_tokens=p, generated_tokens=g, prompt_start=self._captured)
        if arr.shape[0] != want:
            raise RouteShapeError(
                f"{self.name}: expected {want} rows (P={p} - captured={self._captured} + G={g} "
                f"- 1), found {arr.shape[0]}"
            )
        dtype = self._storage_dtype(state)
        if arr.flags.writeable or arr.dtype != dtype or not arr.flags.c_contiguous:
            # Own the rows (a caller may reuse its buffer) and narrow them now: one copy.
            arr = arr.astype(dtype, order="C")
            arr.flags.writeable = False
        start = self._captured
        self._accept(start, arr, state)
        self._chunks.append(arr)
        self._captured += want
        self._seen_tokens = p + g
        return start

    def _storage_dtype(self, state: Any) -> np.dtype[Any]:
        return self.dtype

    # -------------------------------------------------------------- finishing
    def _join(self) -> np.ndarray:
        if len(self._chunks) == 1 and self._chunks[0].dtype == self.dtype:
            return self._chunks[0]  # one turn: owned, read-only and C-contiguous
        out = np.empty((self._captured, *self.row_shape), dtype=self.dtype)
        if self._chunks:
            # Values were range-checked on record, so narrowing casts are exact.
            np.concatenate(self._chunks, axis=0, out=out, casting="unsafe")
        return out

    def _to_arrow(self, arr: np.ndarray) -> pa.Array[Any]:
        flat = pa.array(arr.reshape(-1))
        out: pa.Array[Any] = flat
        for size in reversed(self.row_shape):
            out = pa.FixedSizeListArray.from_arrays(out, size)
        return out

    def _trajectory_id(self) -> str | None:
        return None

    def finalize(self, *, num_tokens: TokenCount, loss_mask: Any) -> pa.Array[Any]:
        """Return the captured rows (length == captured) as one Arrow array.

        ``loss_mask`` covers all ``num_tokens`` tokens of the trajectory; every
        uncaptured row must predict a loss-masked token (`TerminalGapError`).
        Raises `TraceStateError` if called twice, `RouteShapeError` if
        ``num_tokens`` is below the tokens the engine saw or the mask is off.
        """
        if self._finalized:
            raise TraceStateError(f"{self.name}: finalize() called twice; expected exactly once")
        n = check_int(num_tokens, "num_tokens", minimum=0)
        if n < self._seen_tokens:
            raise RouteShapeError(
                f"{self.name}: expected num_tokens >= {self._seen_tokens} (tokens seen by the "
                f"engine), found {n}",
                trajectory_id=self._trajectory_id(),
            )
        check_terminal_gap(
            self._captured, loss_mask, num_tokens=n, trajectory_id=self._trajectory_id()
        )
        result = self._to_arrow(self._join())
        self._finalized = True
        self._chunks = []
        return result


def validate_route_rows(
    routes: Any, spec: RouteSpec, *, what: str = "routes"
) -> tuple[np.ndarray, RouteSpec]:
    """The one route-row validator: shape, dtype, id range; returns (rows, spec to store them in).

    ``routes`` is numpy (any integer dtype) or Arrow per-token routes; the rows come
    back as given (not copied). The returned spec is ``spec`` widened for the largest
    id when ``spec.num_experts`` is None. Raises `RouteShapeError`, `RouteDTypeError`,
    `ExpertRangeError` (with ``token`` and ``layer`` set).
    """
    arr = as_route_rows(routes, spec, what=what)
    _, hi = check_route_ids(arr, spec, what=what)
    if spec.num_experts is None and hi >= 0:
        spec = spec.widened_for(hi)
    return arr, spec


class RouteTrace(TokenTrace):
    """Incremental routed-expert capture for one trajectory.

    See ``docs/design.md``, "Ragged routes and the terminal gap" and "Layouts for
    Megatron". Accepts numpy arrays of any integer dtype or Arrow arrays of the
    per-token routes type, validated once by `validate_route_rows`. When
    ``spec.num_experts`` is None the storage dtype widens as larger ids arrive
    (never "schema changed"); `finalize` returns ``spec.arrow_type`` data.

    A trace from `r3arrow.store.TurnStore.trace` is bound to its store
    (``trajectory_id`` set): each recorded turn is also appended to the store, and
    errors carry the ``trajectory_id``. ``RouteTrace(spec)`` is unbound.
    """

    def __init__(self, spec: RouteSpec) -> None:
        if not isinstance(spec, RouteSpec):
            raise TypeError(f"spec: expected a RouteSpec, found {type(spec).__name__}")
        super().__init__(spec.row_shape, spec.dtype, name="routes")
        self.spec = spec
        self._tid: str | None = None
        self._sink: TurnSink | None = None

    @classmethod
    def _bound(cls, spec: RouteSpec, trajectory_id: str, sink: TurnSink) -> RouteTrace:
        """A trace whose validated turns go to ``sink`` (used by `TurnStore.trace`)."""
        trace = cls(spec)
        trace._tid, trace._sink = trajectory_id, sink
        return trace

    @property
    def trajectory_id(self) -> str | None:
        """The trajectory this trace captures into its store (None for an unbound trace)."""
        return self._tid

    def _trajectory_id(self) -> str | None:
        return self._tid

    def _coerce(self, rows: Any) -> tuple[np.ndarray, Any]:
        return validate_route_rows(rows, self.spec, what="routes")

    def _storage_dtype(self, state: Any) -> np.dtype[Any]:
        spec: RouteSpec = state
        return spec.dtype

    def _accept(self, start: int, arr: np.ndarray, state: Any) -> None:
        spec: RouteSpec = state
        if self._sink is not None:
            self._sink(start, arr, spec)  # the store trusts the validated turn
        self.spec, self.dtype = spec, spec.dtype

    def record(self, rows: Any, *, prompt_tokens: TokenCount, generated_tokens: TokenCount) -> int:
        if self._tid is None:
            return super().record(
                rows, prompt_tokens=prompt_tokens, generated_tokens=generated_tokens
            )
        try:
            return super().record(
                rows, prompt_tokens=prompt_tokens, generated_tokens=generated_tokens
            )
        except R3ArrowError as exc:
            if exc.trajectory_id is None:
                exc.trajectory_id = self._tid
            raise

    def _to_arrow(self, arr: np.ndarray) -> pa.Array[Any]:
        return numpy_to_routes(arr, self.spec)  # _join wrote spec.dtype (kept in step with dtype)


__all__ = [
    "RouteTrace",
    "TokenTrace",
    "TurnSink",
    "check_terminal_gap",
    "expected_rows",
    "first_terminal_gap",
    "terminal_gap_error",
    "validate_route_rows",
]
