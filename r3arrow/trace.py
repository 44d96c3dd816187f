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

import hashlib
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa

from r3arrow._checks import check_int, check_positive_int
from r3arrow.errors import (
    PrefixMismatchError,
    R3ArrowError,
    RouteDTypeError,
    RouteShapeError,
    TerminalGapError,
    TraceStateError,
)
from r3arrow.ids import check_routes
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


# ------------------------------------------------------------- covered tokens
def as_token_ids(ids: Any, name: str = "prompt_ids") -> np.ndarray:
    """Token ids as a flat int32 numpy array (a read-only array of that kind is not copied).

    Raises ``ValueError`` (argument misuse) for a non-flat or non-integer sequence, or ids
    outside ``[0, 2**31)``.
    """
    if isinstance(ids, np.ndarray) and ids.dtype == np.int32 and ids.ndim == 1:
        arr = ids
    else:
        raw = np.asarray(ids)
        if raw.ndim != 1 or (raw.size and raw.dtype.kind not in "iu"):
            raise ValueError(
                f"{name}: expected a flat sequence of int token ids, found shape "
                f"{list(raw.shape)} of dtype {raw.dtype}"
            )
        if raw.size and (int(raw.min()) < 0 or int(raw.max()) > np.iinfo(np.int32).max):
            raise ValueError(
                f"{name}: expected token ids in [0, 2**31), found [{int(raw.min())}, "
                f"{int(raw.max())}]"
            )
        arr = raw.astype(np.int32)
    if arr.flags.writeable:
        arr = arr.copy()  # the caller may reuse its buffer: keep what was checked
        arr.flags.writeable = False
    return arr


class CoveredTokens:
    """The token ids a trace has covered, with a rolling blake2b digest; O(new tokens) per turn.

    The ids live in one growable int32 buffer (doubling: appending a turn never re-copies
    what is covered, amortised); the digest is blake2b over the int32 (native byte order)
    bytes of ``tokens[:length]``, updated with each turn's new tokens only.
    """

    def __init__(self) -> None:
        self._buf = np.zeros(0, dtype=np.int32)
        self._len = 0
        self._hash = hashlib.blake2b(digest_size=16)

    def __len__(self) -> int:
        return self._len

    @property
    def tokens(self) -> np.ndarray:
        """The covered ids ``[length]`` int32 (a read-only view)."""
        view = self._buf[: self._len]
        view.flags.writeable = False
        return view

    @property
    def digest(self) -> str:
        """Hex blake2b-128 of the covered ids' int32 bytes."""
        return self._hash.hexdigest()

    def first_difference(self, ids: np.ndarray) -> int:
        """First position where ``ids`` does not extend the covered ids, or -1 if it does.

        A prompt shorter than the covered ids differs at its own length. One vectorised
        comparison over the overlap.
        """
        n = self._len
        m = min(n, ids.shape[0])
        diff = np.flatnonzero(self._buf[:m] != ids[:m])
        if diff.size:
            return int(diff[0])
        return m if m < n else -1

    def extended(
        self, prompt: np.ndarray, tail: np.ndarray | None = None
    ) -> tuple[np.ndarray, Any]:
        """(buffer, digest) covering ``prompt`` then ``tail``; changes nothing.

        ``prompt`` must extend the covered ids (checked by the caller). The buffer is this
        one when it has room (the new ids are written past ``length``, where no reader
        looks), else a doubled copy; only the new ids are hashed.
        """
        n, p = self._len, prompt.shape[0]
        m = p + (0 if tail is None else tail.shape[0])
        buf = self._buf
        if m > buf.shape[0]:
            buf = np.empty(max(m, 2 * buf.shape[0], 64), dtype=np.int32)
            buf[:n] = self._buf[:n]
        buf[n:p] = prompt[n:]
        if tail is not None:
            buf[p:m] = tail
        digest = self._hash.copy()
        digest.update(buf[n:m].tobytes())
        return buf, digest

    def commit(self, buf: np.ndarray, digest: Any, length: int) -> None:
        """Adopt what `extended` returned."""
        self._buf, self._hash, self._len = buf, digest, length


def prefix_mismatch_error(
    covered: CoveredTokens,
    ids: np.ndarray,
    pos: int,
    *,
    name: str,
    trajectory_id: str | None,
) -> PrefixMismatchError:
    """The `PrefixMismatchError` for ``ids`` first differing from ``covered`` at ``pos``."""
    n = len(covered)
    if pos >= ids.shape[0]:
        found = f"a prompt of {ids.shape[0]} tokens that ends at token {pos}"
    else:
        found = (
            f"token id {int(ids[pos])} at position {pos} where the trace has "
            f"{int(covered.tokens[pos])}"
        )
    where = f"trajectory {trajectory_id!r}: " if trajectory_id is not None else ""
    return PrefixMismatchError(
        f"{where}{name}: expected the prompt to extend the {n} tokens the trace covers, found "
        f"{found} (re-tokenized history? keep the token ids the engine saw and generated)",
        token=pos,
        trajectory_id=trajectory_id,
    )


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

    def record(
        self,
        rows: Any,
        *,
        prompt_tokens: TokenCount,
        generated_tokens: TokenCount,
        prompt_ids: Any = None,
        generated_ids: Any = None,
    ) -> int:
        """Append one response's rows; returns the token index of its first row.

        ``rows`` must have ``prompt_tokens - captured + generated_tokens - 1`` rows.
        ``prompt_ids`` (the ``P`` prompt ids the request sent) and ``generated_ids``
        (the ``G`` generated ids) extend `covered_tokens`; without them the coverage stays
        as it was (still a prefix of the conversation). On any error the trace is unchanged.

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
        ids = self._ids_for(p, g, prompt_ids, generated_ids)
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
        cover = None if ids is None else self._covered.extended(*ids)
        self._accept(start, arr, state)
        self._chunks.append(arr)
        self._captured += want
        self._seen_tokens = p + g
        if cover is not None and ids is not None:
            self._covered.commit(*cover, p + (0 if ids[1] is None else g))
        self._checked = None
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
    """The one route-row validator: shape, dtype, ids; returns (rows, spec to store them in).

    ``routes`` is numpy (any integer dtype) or Arrow per-token routes; the rows come
    back as given (not copied). The ids follow both rules of :mod:`r3arrow.ids` (range, and
    distinct experts per router-layer row: a duplicate is a data error, and on an all-zero
    layer of a spec without ``moe_layers`` the message says to declare the dense layers).
    The returned spec is ``spec`` widened for the largest id when ``spec.num_experts`` is
    None. Raises `RouteShapeError`, `RouteDTypeError`, `ExpertRangeError`,
    `DuplicateExpertError` (with ``token`` and ``layer`` set).
    """
    arr = as_route_rows(routes, spec, what=what)
    _, hi = check_routes(arr, spec, what=what)
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

    def record(
        self,
        rows: Any,
        *,
        prompt_tokens: TokenCount,
        generated_tokens: TokenCount,
        prompt_ids: Any = None,
        generated_ids: Any = None,
    ) -> int:
        kwargs: dict[str, Any] = {
            "prompt_tokens": prompt_tokens,
            "generated_tokens": generated_tokens,
            "prompt_ids": prompt_ids,
            "generated_ids": generated_ids,
        }
        if self._tid is None:
            return super().record(rows, **kwargs)
        try:
            return super().record(rows, **kwargs)
        except R3ArrowError as exc:
            if exc.trajectory_id is None:
                exc.trajectory_id = self._tid
            raise

    def _to_arrow(self, arr: np.ndarray) -> pa.Array[Any]:
        return numpy_to_routes(arr, self.spec)  # _join wrote spec.dtype (kept in step with dtype)


__all__ = [
    "CoveredTokens",
    "RouteTrace",
    "TokenTrace",
    "TurnSink",
    "as_token_ids",
    "check_terminal_gap",
    "expected_rows",
    "first_terminal_gap",
    "prefix_mismatch_error",
    "terminal_gap_error",
    "validate_route_rows",
]
