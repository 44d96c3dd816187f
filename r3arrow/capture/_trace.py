"""Incremental per-trajectory capture: `TokenTrace` (any fixed-shape per-token column) and
`RouteTrace`, the one place a turn's routes are validated (``docs/design.md``, "Rows and
incremental capture"; row ownership: ``docs/capture.md``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any, Literal, get_args

import numpy as np
import pyarrow as pa

from r3arrow._checks import check_choice, check_int, check_positive_int
from r3arrow._coverage import check_terminal_gap, expected_rows
from r3arrow._routes import as_route_rows, rectangular
from r3arrow._schema import placeholder_rows
from r3arrow._validated import mark_validated
from r3arrow.errors import (
    PrefixMismatchError,
    R3ArrowError,
    RouteDTypeError,
    RouteShapeError,
    TraceStateError,
)
from r3arrow.ids import check_routes
from r3arrow.spec import RouteSpec

#: A token count: an ``int`` or a numpy integer (``bool`` is refused).
TokenCount = int | np.integer[Any]
#: What `TokenTrace.record` does with a delivery of fewer rows than the turn needs: raise
#: (``"error"``) or record them and mark the rest missing (``"mark"``, ``docs/fallback.md``).
OnShort = Literal["error", "mark"]
_ON_SHORT: tuple[str, ...] = get_args(OnShort)


def as_token_ids(ids: Any, name: str = "prompt_ids") -> np.ndarray:
    """Token ids as a read-only flat int32 array; ``ValueError`` unless ints in ``[0, 2**31)``."""
    raw = ids if isinstance(ids, np.ndarray) else np.asarray(ids)
    if raw.ndim != 1 or (raw.size and raw.dtype.kind not in "iu"):
        raise ValueError(
            f"{name}: expected a flat sequence of int token ids, found shape "
            f"{list(raw.shape)} of dtype {raw.dtype}"
        )
    if raw.size and (int(raw.min()) < 0 or int(raw.max()) > np.iinfo(np.int32).max):
        raise ValueError(
            f"{name}: expected token ids in [0, 2**31), found [{int(raw.min())}, {int(raw.max())}]"
        )
    if raw.dtype == np.int32 and not raw.flags.writeable:
        return raw
    arr = raw.astype(np.int32)  # a copy: the caller may reuse its buffer, keep what was checked
    arr.flags.writeable = False
    return arr


def owned(arr: np.ndarray, dtype: np.dtype[Any], *, copy: bool = True) -> np.ndarray:
    """``arr`` read-only, C-contiguous in ``dtype``: copied if converted, or writable and copy."""
    if arr.dtype != dtype or not arr.flags.c_contiguous or (copy and arr.flags.writeable):
        arr = arr.astype(dtype, order="C")
    elif arr.flags.writeable:
        arr = arr.view()
    arr.flags.writeable = False
    return arr


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
        # The covered ids: the first `_covered` of a growable buffer, and their bytes' digest.
        self._ids = np.zeros(0, dtype=np.int32)
        self._covered = 0
        self._hash = hashlib.blake2b(digest_size=16)
        self._checked: np.ndarray | None = None  # check_extends' result since the last record
        self._missing: list[tuple[int, int]] = []  # (start, stop) row spans marked missing

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
    def missing(self) -> np.ndarray | None:
        """uint8 ``[captured]`` marks (1: the row is a placeholder, its route never arrived),
        or None when no row was marked (``record(..., on_short="mark")``)."""
        if not self._missing:
            return None
        marks = np.zeros(self._captured, dtype=np.uint8)
        for a, b in self._missing:
            marks[a:b] = 1
        return marks

    @property
    def covered_tokens(self) -> np.ndarray:
        """The token ids the recorded turns covered (``[n]`` int32, a read-only view)."""
        view = self._ids[: self._covered]
        view.flags.writeable = False
        return view

    @property
    def covered_digest(self) -> str:
        """Hex blake2b-128 of the int32 bytes of `covered_tokens`."""
        return self._hash.hexdigest()

    def check_extends(self, prompt_ids: Any) -> np.ndarray:
        """``prompt_ids`` as read-only int32 checked to extend `covered_tokens` (`record` given the
        result skips the comparison); ``ValueError`` (not flat ints), `PrefixMismatchError`.
        """
        ids = as_token_ids(prompt_ids)
        n = self._covered
        m = min(n, ids.shape[0])
        diff = np.flatnonzero(self._ids[:m] != ids[:m])
        if diff.size:
            pos = int(diff[0])
            found = f"token id {int(ids[pos])} at position {pos} where the trace has "
            found += str(int(self._ids[pos]))
        elif m < n:
            pos = m
            found = f"a prompt of {m} tokens that ends at token {m}"
        else:
            self._checked = ids
            return ids
        where = f"trajectory {self._tid!r}: " if self._tid is not None else ""
        raise PrefixMismatchError(
            f"{where}{self.name}: expected the prompt to extend the {n} tokens the trace covers, "
            f"found {found} (re-tokenized history? keep the token ids the engine saw and "
            "generated)",
            token=pos,
            trajectory_id=self._tid,
        )

    def _cover(
        self, p: int, g: int, prompt_ids: Any, generated_ids: Any
    ) -> tuple[np.ndarray, Any, int] | None:
        """(buffer, digest, count) covering the turn's ids, checked; the trace is unchanged."""
        if prompt_ids is None:
            if generated_ids is not None:
                raise ValueError("generated_ids: expected prompt_ids with them, found none")
            return None
        known = prompt_ids is self._checked  # check_extends compared it; nothing recorded since
        ids = prompt_ids if known else self.check_extends(prompt_ids)
        if ids.shape[0] != p:
            raise ValueError(f"prompt_ids: expected prompt_tokens={p} ids, found {ids.shape[0]}")
        gen = None if generated_ids is None else as_token_ids(generated_ids, "generated_ids")
        if gen is not None and gen.shape[0] != g:
            raise ValueError(
                f"generated_ids: expected generated_tokens={g} ids, found {gen.shape[0]}"
            )
        n, m = self._covered, p + (0 if gen is None else g)
        buf = self._ids
        if m > buf.shape[0]:
            buf = np.empty(max(m, 2 * buf.shape[0], 64), dtype=np.int32)
            buf[:n] = self._ids[:n]
        buf[n:p] = ids[n:]  # past the covered ids: invisible until committed
        if gen is not None:
            buf[p:m] = gen
        digest = self._hash.copy()
        digest.update(buf[n:m].tobytes())
        return buf, digest, m

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

    def _filler(self, n: int, dtype: np.dtype[Any]) -> np.ndarray:
        """The ``n`` rows a missing row holds (zeros here; `RouteTrace`: `placeholder_rows`)."""
        return np.zeros((n, *self.row_shape), dtype=dtype)

    def _empty(self) -> np.ndarray:
        """No rows, as `_coerce` takes them (``rows=None`` under ``on_short="mark"``)."""
        return np.zeros((0, *self.row_shape), dtype=self.dtype)

    def _accept(self, start: int, arr: np.ndarray, state: Any, marks: np.ndarray | None) -> None:
        """Hook: a validated, owned turn (``marks``: uint8 per row, or None when every row
        arrived) before the trace commits it (may raise)."""

    def record(
        self,
        rows: Any,
        *,
        prompt_tokens: TokenCount,
        generated_tokens: TokenCount,
        prompt_ids: Any = None,
        generated_ids: Any = None,
        copy: bool = True,
        on_short: OnShort = "error",
    ) -> int:
        """Append one response's ``P - captured + G - 1`` rows; return the token index of the first.

        ``prompt_ids``/``generated_ids`` (``P``/``G`` ids) extend `covered_tokens`. ``copy=False``
        hands a writable array over (kept as a read-only view: do not mutate it while the trace, its
        store or the result live). ``on_short="mark"`` (``docs/fallback.md``): ``n`` rows fewer
        than the turn needs fill its first ``n`` positions, checked as ever, and the rest hold
        placeholders marked in `missing`; ``rows=None`` or no rows marks the whole turn. More
        rows than the turn needs always raise (never truncated). On any error nothing changes.
        Raises ``TypeError``/``ValueError`` (bad counts, ids or ``on_short``),
        `PrefixMismatchError`, `DuplicateExpertError`, `ExpertRangeError`, `RouteShapeError`
        (row count or shape, ``P <= captured``), `RouteDTypeError`, `TraceStateError`
        (finalized).
        """
        if on_short != "error":
            check_choice(on_short, "on_short", _ON_SHORT)
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
            cover = self._cover(p, g, prompt_ids, generated_ids)
            marking = on_short == "mark"
            arr, dtype, state = self._coerce(self._empty() if marking and rows is None else rows)
            want = expected_rows(prompt_tokens=p, generated_tokens=g, prompt_start=self._captured)
            n = arr.shape[0]
            if n > want or (n < want and not marking):
                raise RouteShapeError(
                    f"{self.name}: expected {want} rows (P={p} - captured={self._captured} + G={g} "
                    f"- 1), found {n}"
                )
            marks: np.ndarray | None = None
            if n < want:  # on_short="mark": the rows that came first, placeholders after
                full = np.empty((want, *self.row_shape), dtype=dtype)
                full[:n] = arr
                full[n:] = self._filler(want - n, dtype)
                full.flags.writeable = False
                arr = full
                marks = np.zeros(want, dtype=np.uint8)
                marks[n:] = 1
            else:
                # The caller may reuse its buffer: copy unless handed over or made from a list.
                arr = owned(arr, dtype, copy=copy and not isinstance(rows, list | tuple))
            start = self._captured
            self._accept(start, arr, state, marks)
            self._chunks.append(arr)
            self._captured += want
            if marks is not None:
                self._missing.append((start + n, start + want))
            self._seen_tokens = p + g
            if cover is not None:
                self._ids, self._hash, self._covered = cover
            self._checked = None
            return start
        except R3ArrowError as exc:
            if exc.trajectory_id is None:
                exc.trajectory_id = self._tid
            raise

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
        chunks = self._chunks
        if len(chunks) == 1 and chunks[0].dtype == self.dtype:
            rows = chunks[0]  # one turn: read-only and C-contiguous already
        else:  # the trace's one write of its rows
            rows = np.empty((self._captured, *self.row_shape), dtype=self.dtype)
            if chunks:
                # Values were range-checked on record, so narrowing casts are exact.
                np.concatenate(chunks, axis=0, out=rows, casting="unsafe")
            rows.flags.writeable = False
        result: pa.Array[Any] = pa.array(rows.reshape(-1))
        for size in reversed(self.row_shape):
            result = pa.FixedSizeListArray.from_arrays(result, size)
        self._finished(rows, result)
        self._finalized = True
        self._chunks = []
        return result

    def _finished(self, rows: np.ndarray, result: pa.Array[Any]) -> None:
        """Hook: the joined rows and the Arrow result, before the trace is finalized."""


def validate_route_rows(
    routes: Any, spec: RouteSpec, *, what: str = "routes"
) -> tuple[np.ndarray, RouteSpec, int]:
    """The one route-row validator (shape, dtype, both id rules): (rows as given, spec to store
    them in, id bound; -1 for no rows). Without ``num_experts`` the spec widens for the largest
    id, and the bound is exact."""
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
        # Set by `TurnStore.trace` (with `_tid`): `_sink` gets each validated turn before the trace
        # commits it (raising leaves the trace unchanged), `_final_sink` the finalized rows.
        self._sink: Callable[[int, np.ndarray, RouteSpec, np.ndarray | None], None] | None = None
        self._final_sink: Callable[[np.ndarray, RouteSpec], None] | None = None
        self._hi = -1  # largest id recorded (for `checked_for`)

    @property
    def trajectory_id(self) -> str | None:
        """The trajectory this trace captures into its store (None if unbound)."""
        return self._tid

    def _coerce(self, rows: Any) -> tuple[np.ndarray, np.dtype[Any], Any]:
        arr, spec, hi = validate_route_rows(rows, self.spec)
        return arr, spec.dtype, (spec, hi)

    def _filler(self, n: int, dtype: np.dtype[Any]) -> np.ndarray:
        return placeholder_rows(self.spec, n).astype(dtype, copy=False)

    def _accept(self, start: int, arr: np.ndarray, state: Any, marks: np.ndarray | None) -> None:
        spec: RouteSpec = state[0]
        if self._sink is not None:
            self._sink(start, arr, spec, marks)  # the store trusts the validated turn
        self.spec, self.dtype = spec, spec.dtype
        hi = int(state[1]) if marks is None else max(int(state[1]), spec.topk - 1)  # placeholders
        self._hi = max(self._hi, hi)

    def _finished(self, rows: np.ndarray, result: pa.Array[Any]) -> None:
        mark_validated(result, spec=self.spec, max_id=self._hi)
        if self._final_sink is not None:
            self._final_sink(rows, self.spec)
