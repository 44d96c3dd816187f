"""Incremental per-trajectory capture of token-aligned rows across turns: the one capture path.

`TokenTrace` is the generic accumulator for any fixed-shape per-token column
(routes, sampled logprobs, ...); `RouteTrace` specialises it for routed experts
(shape, dtype and id-range checks through :mod:`r3arrow.ids`, dtype widening).

Semantics (``docs/design.md``, "Rows and incremental capture" and "Ragged routes
and the terminal gap"): a request sends the whole conversation as prompt with
``prompt start = captured`` and must return exactly ``P - captured + G - 1`` rows;
row ``i`` predicts token ``i + 1``, so the rows a trajectory never captures may
only predict loss-masked tokens. That terminal-gap rule is implemented once, in
`r3arrow._coverage`; the rollout table's validation uses the same functions.

**The capture path.** `RouteTrace.record` is the only place a turn's routes are
validated. A trace made by `TurnStore.trace` is *bound* to that store:
every turn it records (validated, owned, read-only, in storage dtype) is handed to
the store as one record batch at ``token_start = captured before the turn``, which
the store trusts without a second check. ``TurnStore.append`` (outside data) stays a
validating trust boundary and uses the same validator (`validate_route_rows`).

**What a trace covers.** Given the token ids of each turn (``prompt_ids``, and
``generated_ids``), a trace remembers the conversation it has covered: the ids
themselves (int32, one growable buffer, O(new tokens) per turn) and a blake2b
digest of their int32 bytes, kept incrementally. `TokenTrace.check_extends` then
refuses a prompt that does not extend them (`PrefixMismatchError`, ``token`` = the
first differing position) *before* a request is sent: chat-template
re-tokenization drift would otherwise pair routes with tokens they were not
computed for.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa

from r3arrow._checks import check_int, check_positive_int
from r3arrow._coverage import check_terminal_gap, expected_rows
from r3arrow._routes import as_route_rows, rectangular
from r3arrow._validated import mark_validated
from r3arrow.capture._covered import CoveredTokens, as_token_ids, prefix_mismatch_error
from r3arrow.errors import (
    R3ArrowError,
    RouteDTypeError,
    RouteShapeError,
    TraceStateError,
)
from r3arrow.ids import check_routes
from r3arrow.spec import RouteSpec, numpy_to_routes

#: Receives each validated turn of a bound `RouteTrace`: ``(token_start, rows, spec)``, rows
#: ``[n, L, K]`` read-only in ``spec.dtype``. Raising leaves the trace unchanged.
TurnSink = Callable[[int, np.ndarray, RouteSpec], None]

#: Receives a bound `RouteTrace`'s finalized rows: ``(turn starts, rows, spec)``; the store then
#: holds slices of ``rows`` instead of the per-turn arrays (``docs/capture.md``).
FinalSink = Callable[[list[int], np.ndarray, RouteSpec], None]

#: A token count: an ``int`` or a numpy integer (``bool`` is refused).
TokenCount = int | np.integer[Any]


# ---------------------------------------------------------------------- traces
class TokenTrace:
    """Accumulates one trajectory's fixed-shape per-token rows, turn by turn, in O(N).

    Each turn is kept as one read-only, C-contiguous chunk in ``dtype``; chunks are
    joined once, in `finalize`, directly into the result buffer (one write of the
    trace's bytes; a single turn is returned as is). Ownership (``docs/capture.md``):
    a turn is kept **without a copy** when it is read-only (a decoded payload), when the
    trace made the array itself (rows given as a list), or when the caller hands it over
    with ``record(..., copy=False)``; a writable array the caller may reuse is copied
    once (the default), and rows in another dtype or layout are converted by that copy.

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
        self._covered = CoveredTokens()
        self._checked: tuple[np.ndarray, int] | None = None  # (ids, covered) of check_extends

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

    @property
    def covered_tokens(self) -> np.ndarray:
        """The token ids recorded turns covered (``[n]`` int32, read-only; see `check_extends`)."""
        return self._covered.tokens

    @property
    def covered_digest(self) -> str:
        """Hex blake2b-128 of the int32 bytes of `covered_tokens` (kept incrementally)."""
        return self._covered.digest

    def check_extends(self, prompt_ids: Any) -> np.ndarray:
        """Check that ``prompt_ids`` extends `covered_tokens`; return them as int32 (read-only).

        Call it before sending a request; pass the returned array to `record` as
        ``prompt_ids``, which then skips its own comparison (one comparison per request).
        A trace that never recorded ids covers nothing, and every prompt extends it.

        Raises
        ------
        ValueError
            ``prompt_ids`` is not a flat sequence of int ids (argument misuse).
        PrefixMismatchError
            the prompt differs from the covered ids, or is shorter; ``token`` is the first
            differing position (the prompt's length if it ends early).
        """
        ids = as_token_ids(prompt_ids)
        pos = self._covered.first_difference(ids)
        if pos >= 0:
            raise prefix_mismatch_error(
                self._covered, ids, pos, name=self.name, trajectory_id=self._trajectory_id()
            )
        self._checked = (ids, len(self._covered))
        return ids

    def _ids_for(
        self, p: int, g: int, prompt_ids: Any, generated_ids: Any
    ) -> tuple[np.ndarray, np.ndarray | None] | None:
        """The turn's (prompt ids, generated ids), checked against the counts and the coverage."""
        if prompt_ids is None:
            if generated_ids is not None:
                raise ValueError("generated_ids: expected prompt_ids with them, found none")
            return None
        checked = self._checked
        if checked is not None and checked[0] is prompt_ids and checked[1] == len(self._covered):
            ids = checked[0]  # compared by check_extends, and nothing recorded since
        else:
            ids = self.check_extends(prompt_ids)
        if ids.shape[0] != p:
            raise ValueError(f"prompt_ids: expected prompt_tokens={p} ids, found {ids.shape[0]}")
        gen = None if generated_ids is None else as_token_ids(generated_ids, "generated_ids")
        if gen is not None and gen.shape[0] != g:
            raise ValueError(
                f"generated_ids: expected generated_tokens={g} ids, found {gen.shape[0]}"
            )
        return ids, gen

    # --------------------------------------------------------------- recording
    def _coerce(self, rows: Any) -> tuple[np.ndarray, Any]:
        """Check ``rows`` (shape ``[rows, *row_shape]``, storable exactly as ``dtype``).

        Returns (array, state for `_accept`); changes nothing.
        """
        want = f"[{', '.join(['rows', *map(str, self.row_shape)])}]"
        arr = rectangular(rows, f"{self.name}: expected a rectangular {want} array")
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

    def record(
        self,
        rows: Any,
        *,
        prompt_tokens: TokenCount,
        generated_tokens: TokenCount,
        prompt_ids: Any = None,
        generated_ids: Any = None,
        copy: bool = True,
    ) -> int:
        """Append one response's rows; returns the token index of its first row.

        ``rows`` must have ``prompt_tokens - captured + generated_tokens - 1`` rows.
        ``prompt_ids`` (the ``P`` prompt ids the request sent) and ``generated_ids``
        (the ``G`` generated ids) extend `covered_tokens`; without them the coverage stays
        as it was (still a prefix of the conversation). On any error the trace is unchanged.

        ``copy=False`` hands a writable numpy array over to the trace: it is kept (through a
        read-only view) instead of copied, and **the caller must not mutate it afterwards**
        (nor the buffer it views) until the trace is finalized and the result is dropped: the
        finalized rows of a one-turn trace, and a bound trace's store, reference it. Rows
        that are read-only, or that the trace converts anyway (another dtype, not
        C-contiguous, a list), are never copied twice; ``copy`` changes nothing for them.

        Raises
        ------
        TypeError, ValueError
            ``prompt_tokens`` / ``generated_tokens`` not ints ``>= 1``; ids that are not a
            flat int sequence, or whose lengths are not ``P`` / ``G`` (argument misuse).
        PrefixMismatchError
            ``prompt_ids`` do not extend `covered_tokens` (``token`` = first difference).
        DuplicateExpertError, ExpertRangeError
            a router-layer row repeats an expert, or an id is out of range (data errors).
        RouteShapeError
            wrong row count or row shape, or a prompt that does not extend past ``captured``.
        RouteDTypeError
            values not storable exactly in the trace's dtype.
        TraceStateError
            the trace was finalized.
        """
        try:
            if self._finalized:
                raise TraceStateError(
                    f"{self.name}: trace already finalized; expected no further record()"
                )
            p = check_positive_int(prompt_tokens, "prompt_tokens")
            g = check_positive_int(generated_tokens, "generated_tokens")
            if p <= self._captured:
                raise RouteShapeError(
                    f"{self.name}: expected prompt_tokens > captured={self._captured} (prompt "
                    f"start must lie inside the prompt), found prompt_tokens={p}"
                )
            ids = self._ids_for(p, g, prompt_ids, generated_ids)
            arr, state = self._coerce(rows)
            want = expected_rows(prompt_tokens=p, generated_tokens=g, prompt_start=self._captured)
            if arr.shape[0] != want:
                raise RouteShapeError(
                    f"{self.name}: expected {want} rows (P={p} - captured={self._captured} + G={g} "
                    f"- 1), found {arr.shape[0]}"
                )
            dtype = self._storage_dtype(state)
            if arr.dtype != dtype or not arr.flags.c_contiguous:
                arr = arr.astype(dtype, order="C")  # narrow / make contiguous: the one copy
                arr.flags.writeable = False
            elif arr.flags.writeable:
                # Copy unless handed over (copy=False) or made here from a list: the caller may
                # reuse its buffer, and the trace keeps what was checked.
                arr = arr.copy() if copy and not isinstance(rows, list | tuple) else arr.view()
                arr.flags.writeable = False
            start = self._captured
            cover = None if ids is None else self._covered.extended(*ids)
            self._accept(start, arr, state)
            self._chunks.append(arr)
            self._captured += want
            self._seen_tokens = p + g
            if cover is not None and ids is not None:
                self._covered.commit(*cover, p + (0 if ids[1] is None else g))
            self._checked = None
            return start
        except R3ArrowError as exc:
            if exc.trajectory_id is None:
                exc.trajectory_id = self._trajectory_id()
            raise

    def _storage_dtype(self, state: Any) -> np.dtype[Any]:
        return self.dtype

    # -------------------------------------------------------------- finishing
    def _join(self) -> np.ndarray:
        """The turns in one read-only buffer: the trace's one write of its rows."""
        if len(self._chunks) == 1 and self._chunks[0].dtype == self.dtype:
            return self._chunks[0]  # one turn: read-only and C-contiguous already
        out = np.empty((self._captured, *self.row_shape), dtype=self.dtype)
        if self._chunks:
            # Values were range-checked on record, so narrowing casts are exact.
            np.concatenate(self._chunks, axis=0, out=out, casting="unsafe")
        out.flags.writeable = False
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

        The turns are joined once, straight into the result's buffer (one write; a single
        turn is returned without one). A `RouteTrace`'s result is recorded as checked
        (`checked_for`): `r3arrow.rollout_table` references it without checking its ids again.

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
        rows = self._join()
        result = self._to_arrow(rows)
        self._finished(rows, result)
        self._finalized = True
        self._chunks = []
        return result

    def _starts(self) -> list[int]:
        """Token start of each recorded turn."""
        out, start = [], 0
        for chunk in self._chunks:
            out.append(start)
            start += chunk.shape[0]
        return out

    def _finished(self, rows: np.ndarray, result: pa.Array[Any]) -> None:
        """Hook run with the joined rows and the Arrow result before the trace is finalized."""


def validate_route_rows(
    routes: Any, spec: RouteSpec, *, what: str = "routes"
) -> tuple[np.ndarray, RouteSpec]:
    """The one route-row validator: shape, dtype, ids; returns (rows, spec to store them in).

    ``routes`` is numpy (any integer dtype) or Arrow per-token routes; the rows come
    back as given (not copied). The ids follow both rules of :mod:`r3arrow.ids` (range, and
    distinct experts per router-layer row: a duplicate is a data error, and on an all-zero
    layer of a spec without ``moe_layers`` the message says to declare the dense layers).
    The returned spec is ``spec`` widened for the largest id when ``spec.num_experts`` is
    None. Raises `RouteShapeError`, `RouteDTypeError`, `ExpertRangeError`,
    `DuplicateExpertError` (with ``token`` and ``layer`` set).
    """
    arr, spec, _ = _validated_rows(routes, spec, what=what)
    return arr, spec


def _validated_rows(
    routes: Any, spec: RouteSpec, *, what: str
) -> tuple[np.ndarray, RouteSpec, int]:
    """`validate_route_rows`, plus an upper bound of the largest id, exact when
    ``spec.num_experts`` is None (-1 for no rows; `r3arrow.ids.check_routes`, ``exact=False``)."""
    arr = as_route_rows(routes, spec, what=what)
    hi = check_routes(arr, spec, what=what, exact=False)[1]
    if spec.num_experts is None and hi >= 0:
        spec = spec.widened_for(hi)
    return arr, spec, hi


class RouteTrace(TokenTrace):
    """Incremental routed-expert capture for one trajectory.

    See ``docs/design.md``, "Ragged routes and the terminal gap" and "Layouts for
    Megatron". Accepts numpy arrays of any integer dtype or Arrow arrays of the
    per-token routes type, validated once by `validate_route_rows`. When
    ``spec.num_experts`` is None the storage dtype widens as larger ids arrive
    (never "schema changed"); `finalize` returns ``spec.arrow_type`` data.

    A trace from `TurnStore.trace` is bound to its store
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
        self._final_sink: FinalSink | None = None
        self._hi = -1  # largest id recorded (for `checked_for`)

    @classmethod
    def _bound(
        cls,
        spec: RouteSpec,
        trajectory_id: str,
        sink: TurnSink,
        final_sink: FinalSink | None = None,
    ) -> RouteTrace:
        """A trace whose validated turns go to ``sink`` and finalized rows to ``final_sink``."""
        trace = cls(spec)
        trace._tid, trace._sink, trace._final_sink = trajectory_id, sink, final_sink
        return trace

    @property
    def trajectory_id(self) -> str | None:
        """The trajectory this trace captures into its store (None for an unbound trace)."""
        return self._tid

    def _trajectory_id(self) -> str | None:
        return self._tid

    def _coerce(self, rows: Any) -> tuple[np.ndarray, Any]:
        arr, spec, hi = _validated_rows(rows, self.spec, what="routes")
        return arr, (spec, hi)

    def _storage_dtype(self, state: Any) -> np.dtype[Any]:
        spec: RouteSpec = state[0]
        return spec.dtype

    def _accept(self, start: int, arr: np.ndarray, state: Any) -> None:
        spec: RouteSpec = state[0]
        if self._sink is not None:
            self._sink(start, arr, spec)  # the store trusts the validated turn
        self.spec, self.dtype = spec, spec.dtype
        self._hi = max(self._hi, int(state[1]))

    def _finished(self, rows: np.ndarray, result: pa.Array[Any]) -> None:
        mark_validated(result, spec=self.spec, max_id=self._hi)
        if self._final_sink is not None:
            self._final_sink(self._starts(), rows, self.spec)

    def _to_arrow(self, arr: np.ndarray) -> pa.Array[Any]:
        return numpy_to_routes(arr, self.spec)  # _join wrote spec.dtype (kept in step with dtype)


__all__ = [
    "FinalSink",
    "RouteTrace",
    "TokenTrace",
    "TurnSink",
    "validate_route_rows",
]
