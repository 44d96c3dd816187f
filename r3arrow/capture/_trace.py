"""Incremental per-trajectory capture: `TokenTrace` (any fixed-shape per-token column) and
`RouteTrace`, the one place a turn's routes are validated (``docs/design.md``, "Rows and
incremental capture"; row ownership: ``docs/capture.md``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import numpy as np
import pyarrow as pa

from r3arrow._checks import check_int, check_positive_int
from r3arrow._coverage import check_terminal_gap, expected_rows
from r3arrow._routes import as_route_rows, rectangular
from r3arrow._validated import mark_validated
from r3arrow.errors import (
    PrefixMismatchError,
    R3ArrowError,
    RouteDTypeError,
    RouteShapeError,
    TraceStateError,
)
from r3arrow.ids import check_routes
from r3arrow.spec import RouteSpec, numpy_to_routes

#: Gets each validated turn of a bound trace, ``(token_start, rows, spec)``, rows read-only in
#: ``spec.dtype``; raising leaves the trace unchanged.
TurnSink = Callable[[int, np.ndarray, RouteSpec], None]
#: Gets a bound trace's finalized rows, ``(rows, spec)``.
FinalSink = Callable[[np.ndarray, RouteSpec], None]
#: A token count: an ``int`` or a numpy integer (``bool`` is refused).
TokenCount = int | np.integer[Any]


def as_token_ids(ids: Any, name: str = "prompt_ids") -> np.ndarray:
    """Token ids as a read-only flat int32 array; ``ValueError`` unless ints in ``[0, 2**31)``."""
    if isinstance(ids, np.ndarray) and ids.dtype == np.int32 and ids.ndim == 1:
        if not ids.flags.writeable:
            return ids
        arr = ids.copy()  # the caller may reuse its buffer: keep what was checked
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
    arr.flags.writeable = False
    return arr


class CoveredTokens:
    """The covered ids in one growable int32 buffer, with a blake2b-128 digest of their bytes."""

    def __init__(self) -> None:
        self._buf = np.zeros(0, dtype=np.int32)
        self._len = 0
        self._hash = hashlib.blake2b(digest_size=16)

    def __len__(self) -> int:
        return self._len

    @property
    def tokens(self) -> np.ndarray:
        """The covered ids, ``[length]`` int32 (a read-only view)."""
        view = self._buf[: self._len]
        view.flags.writeable = False
        return view

    @property
    def digest(self) -> str:
        """Hex blake2b-128 of the covered ids' int32 bytes."""
        return self._hash.hexdigest()

    def check_extends(self, ids: np.ndarray, *, name: str, trajectory_id: str | None) -> None:
        """`PrefixMismatchError` unless ``ids`` extend the covered ids (``token``: first change)."""
        n = self._len
        m = min(n, ids.shape[0])
        diff = np.flatnonzero(self._buf[:m] != ids[:m])
        if diff.size:
            pos = int(diff[0])
            found = f"token id {int(ids[pos])} at position {pos} where the trace has "
            found += str(int(self._buf[pos]))
        elif m < n:
            pos = m
            found = f"a prompt of {m} tokens that ends at token {m}"
        else:
            return
        where = f"trajectory {trajectory_id!r}: " if trajectory_id is not None else ""
        raise PrefixMismatchError(
            f"{where}{name}: expected the prompt to extend the {n} tokens the trace covers, "
            f"found {found} (re-tokenized history? keep the token ids the engine saw and "
            "generated)",
            token=pos,
            trajectory_id=trajectory_id,
        )

    def extended(
        self, prompt: np.ndarray, tail: np.ndarray | None = None
    ) -> tuple[np.ndarray, Any]:
        """(buffer, digest) covering ``prompt`` then ``tail`` for `commit`; changes nothing seen."""
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


class TokenTrace:
    """One trajectory's rows of ``row_shape`` (positive ints; ``()``: scalars), turn by turn.

    A turn is kept as one read-only C-contiguous chunk in ``dtype``, copied only if writable
    (unless handed over) or converted; `finalize` joins the chunks with one write.
    """

    def __init__(self, row_shape: tuple[int, ...], dtype: Any, *, name: str = "rows") -> None:
        self.row_shape = tuple(check_positive_int(d, "row_shape") for d in row_shape)
        self.dtype: np.dtype[Any] = np.dtype(dtype)
        self.name = name
        self._tid: str | None = None
        self._chunks: list[np.ndarray] = []
        self._captured = 0
        self._seen_tokens = 0
        self._finalized = False
        self._covered = CoveredTokens()
        self._checked: tuple[np.ndarray, int] | None = None  # (ids, covered) of check_extends

    @property
    def captured(self) -> int:
        """Rows held so far: the prompt start of the next request."""
        return self._captured

    @property
    def seen_tokens(self) -> int:
        """Conversation length (P + G) at the last recorded turn; 0 before any."""
        return self._seen_tokens

    @property
    def num_turns(self) -> int:
        return len(self._chunks)

    @property
    def finalized(self) -> bool:
        return self._finalized

    @property
    def covered_tokens(self) -> np.ndarray:
        """The token ids the recorded turns covered (``[n]`` int32, read-only)."""
        return self._covered.tokens

    @property
    def covered_digest(self) -> str:
        """Hex blake2b-128 of the int32 bytes of `covered_tokens`."""
        return self._covered.digest

    def check_extends(self, prompt_ids: Any) -> np.ndarray:
        """``prompt_ids`` as read-only int32, checked to extend `covered_tokens` (pass the result to
        `record`, which then skips its own comparison).

        Raises ``ValueError`` (not flat ints) and `PrefixMismatchError` (``token``: first change).
        """
        ids = as_token_ids(prompt_ids)
        self._covered.check_extends(ids, name=self.name, trajectory_id=self._tid)
        self._checked = (ids, len(self._covered))
        return ids

    def _ids_for(
        self, p: int, g: int, prompt_ids: Any, generated_ids: Any
    ) -> tuple[np.ndarray, np.ndarray | None] | None:
        """The turn's (prompt ids, generated ids), checked against the counts and coverage."""
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

    def _coerce(self, rows: Any) -> tuple[np.ndarray, np.dtype[Any], Any]:
        """(``rows`` checked as ``[rows, *row_shape]`` storable in ``dtype``, dtype, state)."""
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
        return arr, self.dtype, None

    def _accept(self, start: int, arr: np.ndarray, state: Any) -> None:
        """Hook: a validated, owned turn before the trace commits it (may raise)."""

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
        """Append one response's ``P - captured + G - 1`` rows; return the token index of the first.

        ``prompt_ids``/``generated_ids`` (``P``/``G`` ids) extend `covered_tokens`. ``copy=False``
        hands a writable array over (kept as a read-only view: do not mutate it while the trace, its
        store or the result live). On any error nothing changes. Raises ``TypeError``/``ValueError``
        (bad counts or ids), `PrefixMismatchError`, `DuplicateExpertError`, `ExpertRangeError`,
        `RouteShapeError` (row count or shape, ``P <= captured``), `RouteDTypeError`,
        `TraceStateError` (finalized).
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
            arr, dtype, state = self._coerce(rows)
            want = expected_rows(prompt_tokens=p, generated_tokens=g, prompt_start=self._captured)
            if arr.shape[0] != want:
                raise RouteShapeError(
                    f"{self.name}: expected {want} rows (P={p} - captured={self._captured} + G={g} "
                    f"- 1), found {arr.shape[0]}"
                )
            if arr.dtype != dtype or not arr.flags.c_contiguous:
                arr = arr.astype(dtype, order="C")  # narrow / make contiguous: the one copy
                arr.flags.writeable = False
            elif arr.flags.writeable:
                # The caller may reuse its buffer: copy unless handed over or made from a list.
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
                exc.trajectory_id = self._tid
            raise

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
        out: pa.Array[Any] = pa.array(arr.reshape(-1))
        for size in reversed(self.row_shape):
            out = pa.FixedSizeListArray.from_arrays(out, size)
        return out

    def finalize(self, *, num_tokens: TokenCount, loss_mask: Any) -> pa.Array[Any]:
        """The ``captured`` rows as one Arrow array (once; then `TraceStateError`).

        Every uncaptured row of the ``num_tokens`` must predict a token ``loss_mask`` masks
        (`TerminalGapError`); `RouteShapeError` if ``num_tokens < seen_tokens`` or the mask is off.
        """
        if self._finalized:
            raise TraceStateError(f"{self.name}: finalize() called twice; expected exactly once")
        n = check_int(num_tokens, "num_tokens", minimum=0)
        if n < self._seen_tokens:
            raise RouteShapeError(
                f"{self.name}: expected num_tokens >= {self._seen_tokens} (tokens seen by the "
                f"engine), found {n}",
                trajectory_id=self._tid,
            )
        check_terminal_gap(self._captured, loss_mask, num_tokens=n, trajectory_id=self._tid)
        rows = self._join()
        result = self._to_arrow(rows)
        self._finished(rows, result)
        self._finalized = True
        self._chunks = []
        return result

    def _finished(self, rows: np.ndarray, result: pa.Array[Any]) -> None:
        """Hook: the joined rows and the Arrow result, before the trace is finalized."""


def validate_route_rows(
    routes: Any, spec: RouteSpec, *, what: str = "routes"
) -> tuple[np.ndarray, RouteSpec, int]:
    """The one route-row validator: (rows as given, spec to store them in, id bound).

    Checks shape, dtype and both id rules of `r3arrow.ids`; a spec without ``num_experts`` is
    widened for the largest id, and the bound (-1 for no rows) is then exact.
    """
    arr = as_route_rows(routes, spec, what=what)
    hi = check_routes(arr, spec, what=what, exact=False)[1]
    if spec.num_experts is None and hi >= 0:
        spec = spec.widened_for(hi)
    return arr, spec, hi


class RouteTrace(TokenTrace):
    """Routed-expert capture for one trajectory (``docs/design.md``, "Layouts for Megatron").

    Turns (numpy of any integer dtype, or Arrow) are checked once by `validate_route_rows`;
    without ``spec.num_experts`` the dtype widens for larger ids. `finalize` returns
    ``spec.arrow_type`` data marked as checked. A `TurnStore.trace` also appends each turn to
    its store and sets ``trajectory_id`` on errors.
    """

    def __init__(self, spec: RouteSpec) -> None:
        if not isinstance(spec, RouteSpec):
            raise TypeError(f"spec: expected a RouteSpec, found {type(spec).__name__}")
        super().__init__(spec.row_shape, spec.dtype, name="routes")
        self.spec = spec
        self._sink: TurnSink | None = None
        self._final_sink: FinalSink | None = None
        self._hi = -1  # largest id recorded (for `checked_for`)

    @classmethod
    def _bound(
        cls, spec: RouteSpec, trajectory_id: str, sink: TurnSink, final_sink: FinalSink
    ) -> RouteTrace:
        """A trace whose validated turns go to ``sink`` and finalized rows to ``final_sink``."""
        trace = cls(spec)
        trace._tid, trace._sink, trace._final_sink = trajectory_id, sink, final_sink
        return trace

    @property
    def trajectory_id(self) -> str | None:
        """The trajectory this trace captures into its store (None if unbound)."""
        return self._tid

    def _coerce(self, rows: Any) -> tuple[np.ndarray, np.dtype[Any], Any]:
        arr, spec, hi = validate_route_rows(rows, self.spec)
        return arr, spec.dtype, (spec, hi)

    def _accept(self, start: int, arr: np.ndarray, state: Any) -> None:
        spec: RouteSpec = state[0]
        if self._sink is not None:
            self._sink(start, arr, spec)  # the store trusts the validated turn
        self.spec, self.dtype = spec, spec.dtype
        self._hi = max(self._hi, int(state[1]))

    def _finished(self, rows: np.ndarray, result: pa.Array[Any]) -> None:
        mark_validated(result, spec=self.spec, max_id=self._hi)
        if self._final_sink is not None:
            self._final_sink(rows, self.spec)

    def _to_arrow(self, arr: np.ndarray) -> pa.Array[Any]:
        return numpy_to_routes(arr, self.spec)  # _join wrote spec.dtype (kept in step)
