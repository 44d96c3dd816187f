"""Incremental per-trajectory capture of token-aligned rows across turns.

`TokenTrace` is the generic accumulator for any fixed-shape per-token column
(routes, sampled logprobs, ...); `RouteTrace` specialises it for routed experts
(id-range checks, dtype widening). Semantics (DESIGN §2): a request sends the
whole conversation as prompt with ``prompt start = captured`` and must return
exactly ``P - captured + G - 1`` rows; finalize keeps only the captured rows and
checks that every missing row predicts a loss-masked token.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa

from r3arrow.errors import RouteDTypeError, RouteShapeError, TerminalGapError, TraceStateError
from r3arrow.spec import RouteSpec, as_route_rows, check_route_ids, numpy_to_routes


def expected_rows(*, prompt_tokens: int, generated_tokens: int, prompt_start: int) -> int:
    """Rows an engine returns for prompt length P, G generated tokens and prompt start s."""
    return prompt_tokens - prompt_start + generated_tokens - 1


def check_terminal_gap(captured: int, loss_mask: Any, *, num_tokens: int) -> np.ndarray:
    """Validate the uncaptured suffix of one trajectory; return the mask as a numpy bool array.

    Row i predicts token i+1, so rows ``[captured, num_tokens-1)`` may be missing
    only where ``loss_mask[i+1] == 0``. Raises `TerminalGapError` naming the first
    loss-active token without a row, `RouteShapeError` on a mask of the wrong length.
    """
    mask = np.asarray(loss_mask)
    if mask.ndim != 1 or mask.shape[0] != num_tokens:
        raise RouteShapeError(
            f"loss_mask: expected a 1-D mask over all {num_tokens} tokens, found shape {list(mask.shape)}"
        )
    if captured > num_tokens:
        raise RouteShapeError(
            f"expected at most num_tokens={num_tokens} captured rows, found {captured}"
        )
    active = np.flatnonzero(mask[captured + 1 :])
    if active.size:
        token = captured + 1 + int(active[0])
        raise TerminalGapError(
            f"missing routed-expert row for loss-active target at token {token} "
            f"(captured {captured} of {num_tokens} tokens; rows >= {captured} are missing)"
        )
    return mask.astype(bool, copy=False)


class TokenTrace:
    """Accumulates one trajectory's fixed-shape per-token rows, turn by turn, in O(N).

    Chunks are kept as given (read-only arrays are not copied; writable ones are
    copied so a caller reusing its buffer cannot corrupt the trace) and joined
    once, in `finalize`, directly into the result buffer.
    """

    def __init__(self, row_shape: tuple[int, ...], dtype: Any, *, name: str = "rows") -> None:
        self.row_shape = tuple(int(d) for d in row_shape)
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
    def _coerce(self, rows: Any) -> np.ndarray:
        """Turn input into a numpy array of shape ``[rows, *row_shape]`` storable exactly as ``dtype``."""
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
                    f"{self.name}: expected values in [{info.min}, {info.max}] ({self.dtype}), found [{lo}, {hi}]"
                )
        return arr

    def record(self, rows: Any, *, prompt_tokens: int, generated_tokens: int) -> int:
        """Append one response's rows; returns the token index of its first row.

        ``rows`` must have ``prompt_tokens - captured + generated_tokens - 1`` rows.
        On any error the trace is unchanged.
        """
        if self._finalized:
            raise TraceStateError(
                f"{self.name}: trace already finalized; expected no further record()"
            )
        for label, v in (("prompt_tokens", prompt_tokens), ("generated_tokens", generated_tokens)):
            if not isinstance(v, int | np.integer) or isinstance(v, bool) or v < 1:
                raise RouteShapeError(f"{self.name}: expected {label} >= 1, found {v!r}")
        p, g = int(prompt_tokens), int(generated_tokens)
        if p <= self._captured:
            raise RouteShapeError(
                f"{self.name}: expected prompt_tokens > captured={self._captured} (prompt start must "
                f"lie inside the prompt), found prompt_tokens={p}"
            )
        arr = self._coerce(rows)
        want = expected_rows(prompt_tokens=p, generated_tokens=g, prompt_start=self._captured)
        if arr.shape[0] != want:
            raise RouteShapeError(
                f"{self.name}: expected {want} rows (P={p} - captured={self._captured} + G={g} - 1), "
                f"found {arr.shape[0]}"
            )
        if arr.flags.writeable or arr.dtype != self.dtype:
            # Own the rows (a caller may reuse its buffer) and narrow them now: one copy.
            arr = arr.astype(self.dtype)
        start = self._captured
        self._chunks.append(arr)
        self._captured += want
        self._seen_tokens = p + g
        return start

    # -------------------------------------------------------------- finishing
    def _join(self) -> np.ndarray:
        if (
            len(self._chunks) == 1
            and self._chunks[0].dtype == self.dtype
            and self._chunks[0].flags.c_contiguous
        ):
            return self._chunks[0]  # one turn: already owned, immutable or a private copy
        out = np.empty((self._captured, *self.row_shape), dtype=self.dtype)
        if self._chunks:
            # Values were range-checked on record, so narrowing casts are exact.
            np.concatenate(self._chunks, axis=0, out=out, casting="unsafe")
        return out

    def _to_arrow(self, arr: np.ndarray) -> pa.Array:
        flat = pa.array(arr.reshape(-1))
        out: pa.Array = flat
        for size in reversed(self.row_shape):
            out = pa.FixedSizeListArray.from_arrays(out, size)
        return out

    def finalize(self, *, num_tokens: int, loss_mask: Any) -> pa.Array:
        """Return the captured rows (length == captured) as one Arrow array.

        ``loss_mask`` covers all ``num_tokens`` tokens of the trajectory; every
        uncaptured row must predict a loss-masked token (`TerminalGapError`).
        Raises `TraceStateError` if called twice.
        """
        if self._finalized:
            raise TraceStateError(f"{self.name}: finalize() called twice; expected exactly once")
        if num_tokens < self._seen_tokens:
            raise RouteShapeError(
                f"{self.name}: expected num_tokens >= {self._seen_tokens} (tokens seen by the engine), "
                f"found {num_tokens}"
            )
        check_terminal_gap(self._captured, loss_mask, num_tokens=int(num_tokens))
        result = self._to_arrow(self._join())
        self._finalized = True
        self._chunks = []
        return result


class RouteTrace(TokenTrace):
    """Incremental routed-expert capture for one trajectory (DESIGN §2, §5).

    Accepts numpy arrays of any integer dtype or Arrow arrays of the per-token
    routes type. Ids are range-checked on the router layers. When
    ``spec.num_experts`` is None the storage dtype widens as larger ids arrive
    (never "schema changed"); `finalize` returns ``spec.arrow_type`` data.
    """

    def __init__(self, spec: RouteSpec) -> None:
        super().__init__(spec.row_shape, spec.dtype, name="routes")
        self.spec = spec

    def _coerce(self, rows: Any) -> np.ndarray:
        arr = as_route_rows(rows, self.spec, what="routes")
        _, hi = check_route_ids(arr, self.spec, what="routes")
        if self.spec.num_experts is None and hi >= 0:
            self.spec = self.spec.widened_for(hi)
            self.dtype = self.spec.dtype
        return arr

    def record(self, rows: Any, *, prompt_tokens: int, generated_tokens: int) -> int:
        before = self.spec
        try:
            return super().record(
                rows, prompt_tokens=prompt_tokens, generated_tokens=generated_tokens
            )
        except Exception:
            self.spec, self.dtype = before, before.dtype  # leave the trace unchanged
            raise

    def _to_arrow(self, arr: np.ndarray) -> pa.Array:
        return numpy_to_routes(arr, self.spec)  # _join wrote spec.dtype (kept in step with dtype)


__all__ = ["RouteTrace", "TokenTrace", "check_terminal_gap", "expected_rows"]
