"""The expert-id rules, in one place (``docs/design.md``, "Expert ids").

* On a **router layer** every id is in ``[0, num_experts)`` (``num_experts=None``: only
  ``>= 0``), and the ``K`` ids of one token's row are distinct.
* On a **dense layer** (no router; vLLM reports a row of zeros) values are not expert ids and
  are not checked for duplicates, but they must be ``>= 0`` and fit the storage dtype, so that
  no narrowing cast ever wraps a value.

Public: `check_routes` (the rules on a `RouteSpec`'s routes, or on router-layer ids of a numpy
array or torch tensor, checked where it lives) and `gather_router_ids` (the fused collation
pass). The fast paths (the numba kernels of `r3arrow._kernels`, or numpy per cache-sized block)
only decide whether a block fails; the reference `_check_block` then names the offender, so
every backend raises the same error.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any, Literal, NamedTuple, overload

import numpy as np

from r3arrow._kernels import compiled
from r3arrow.errors import DuplicateExpertError, ExpertRangeError

if TYPE_CHECKING:
    from r3arrow.spec import RouteSpec

_BLOCK_IDS = 1 << 17  # ids per block: the transposed block stays in L2


# K == 2 ids of <= 2 bytes fit one machine word: the word's two halves compare as integers
# (bit patterns, so signed dtypes compare exactly too), no transposed copy needed.
_WORD_OF: dict[int, np.dtype[Any]] = {1: np.dtype(np.uint16), 2: np.dtype(np.uint32)}


class _Scratch:
    """Reused buffers of the numpy duplicate test: ``has_duplicate(blk)`` says whether some
    row of ``blk`` ``[A, B, K]`` (at most ``size`` rows ``A * B``) repeats an id. ``K == 2``:
    one comparison (of a word's halves when contiguous); ``K >= 3``: a transposed copy, then
    one contiguous comparison per distance ``r``."""

    def __init__(self, k: int, size: int, dtype: np.dtype[Any]) -> None:
        self.k = k
        word = _WORD_OF.get(dtype.itemsize) if k == 2 else None
        self.word = word
        self.eq = np.empty(size * max(1, k - 1), dtype=np.bool_)
        self.xt = np.empty(size * k if k > 2 else 0, dtype=dtype)
        self.lo = np.empty(size if word is not None else 0, dtype=word or dtype)
        self.hi = np.empty(size if word is not None else 0, dtype=word or dtype)

    def has_duplicate(self, blk: np.ndarray) -> bool:
        k = self.k
        n = blk.shape[0] * blk.shape[1]
        if k == 2:
            eq = self.eq[:n]
            word = self.word
            if word is not None and blk.flags.c_contiguous:
                w = blk.reshape(-1).view(word)
                bits = 8 * blk.dtype.itemsize
                lo, hi = self.lo[:n], self.hi[:n]
                np.bitwise_and(w, (1 << bits) - 1, out=lo)
                np.right_shift(w, bits, out=hi)
                np.equal(lo, hi, out=eq)
            else:
                np.equal(blk[..., 0], blk[..., 1], out=eq.reshape(blk.shape[:2]))
            return bool(eq.any())
        xt = self.xt[: k * n].reshape(k, n)
        np.copyto(xt.reshape(k, blk.shape[0], blk.shape[1]), blk.transpose(2, 0, 1))
        for r in range(1, k):
            eq = self.eq[: (k - r) * n].reshape(k - r, n)
            np.equal(xt[: k - r], xt[r:], out=eq)
            if bool(eq.any()):
                return True
        return False


def _first(mask: Any) -> list[int]:
    """Index (as ints) of the first True of a numpy array or torch tensor."""
    if isinstance(mask, np.ndarray):
        return [int(v) for v in np.argwhere(mask)[0]]
    return [int(v) for v in mask.nonzero()[0].tolist()]


def _check_router_ids(
    arr: Any,
    num_experts: int | None,
    layer_ids: Sequence[int],
    *,
    layers_first: bool = False,
    what: str = "routes",
    token_offset: int = 0,
    range_error: type[ExpertRangeError] = ExpertRangeError,
    duplicate_error: type[DuplicateExpertError] = DuplicateExpertError,
) -> None:
    """`check_routes` without a spec (its router-layer form, arguments as there)."""
    if arr.ndim != 3:
        raise ValueError(f"{what}: expected a 3-d id array, found shape {list(arr.shape)}")
    n_layers = arr.shape[0] if layers_first else arr.shape[1]
    tokens = arr.shape[1] if layers_first else arr.shape[0]
    k = int(arr.shape[2])
    if len(layer_ids) != n_layers:
        raise ValueError(f"layer_ids: expected {n_layers} ids, found {len(layer_ids)}")
    if tokens == 0 or n_layers == 0:
        return
    numpy_in = isinstance(arr, np.ndarray)
    on_cpu = numpy_in or arr.device.type == "cpu"
    data: Any = arr if numpy_in else (arr.numpy() if on_cpu else arr)
    step = max(1, _BLOCK_IDS // max(1, n_layers * k))
    where = _Where(
        num_experts, layer_ids, layers_first, what, token_offset, range_error, duplicate_error
    )
    if not on_cpu:  # a tensor on an accelerator: the reference check, run there
        for a in range(0, tokens, step):
            _check_block(data[:, a : a + step] if layers_first else data[a : a + step], a, where)
        return
    dtype = np.dtype(data.dtype)
    kernels = compiled() if dtype.kind in "iu" and dtype.isnative else None
    if kernels is not None:
        _check_cpu_numba(data, step, where, kernels)
        return
    scratch = _Scratch(k, min(step, tokens) * n_layers, dtype) if k > 1 else None
    for a in range(0, tokens, step):
        blk = data[:, a : a + step] if layers_first else data[a : a + step]
        if _fails(blk, num_experts, scratch):  # the reference names the first offender
            _check_block(blk, a, where, must_fail=True)


def _fails(blk: np.ndarray, num_experts: int | None, scratch: _Scratch | None) -> bool:
    """Whether block ``blk`` ``[A, B, K]`` breaks a rule: a min/max, then `_Scratch`."""
    lo = int(blk.min()) if blk.dtype.kind == "i" else 0
    if lo < 0 or (num_experts is not None and int(blk.max()) >= num_experts):
        return True
    return scratch is not None and scratch.has_duplicate(blk)


def _check_cpu_numba(data: np.ndarray, step: int, w: _Where, kernels: ModuleType) -> None:
    """`_check_router_ids` on the numba backend: the first failing token (out of range or
    repeating an id), then the reference `_check_block` on its block of ``step`` tokens (the
    numpy loop's block, hence its error)."""
    layers_first = w.layers_first
    tokens = data.shape[1] if layers_first else data.shape[0]
    e = w.num_experts
    first = tokens
    lo = int(data.min()) if data.dtype.kind == "i" else 0
    if lo < 0 or (e is not None and int(data.max()) >= e):  # an error: allocating is fine
        bad = data < 0 if e is None else (data < 0) | (data >= e)
        per_token = bad.any(axis=(0, 2) if layers_first else (1, 2))
        first = int(np.argmax(per_token))
    dup = int(kernels.first_duplicate_token(data, layers_first))
    if 0 <= dup < first:
        first = dup
    if first < tokens:
        a = first - first % step
        blk = data[:, a : a + step] if layers_first else data[a : a + step]
        _check_block(blk, a, w, must_fail=True)


class _Where(NamedTuple):
    """How `_check_router_ids` was called (bound, layer ids, layout, names, error types)."""

    num_experts: int | None
    layer_ids: Sequence[int]
    layers_first: bool
    what: str
    token_offset: int
    range_error: type[ExpertRangeError]
    duplicate_error: type[DuplicateExpertError]


def _check_block(blk: Any, a: int, w: _Where, must_fail: bool = False) -> None:
    """The reference check of one block (tokens ``a ..``), numpy or torch. It defines the
    offender reported: in the first failing block, an out-of-range id first (the first in
    ``(k, layer, token)`` order), else a duplicate at the smallest distance ``r`` (then the
    first in that order). ``must_fail``: a fast path said the block fails."""
    k = int(blk.shape[2])
    perm = (2, 0, 1) if w.layers_first else (2, 1, 0)
    numpy_in = isinstance(blk, np.ndarray)
    # [K, layers, tokens_in_block], contiguous: every test below is a straight vector op.
    xt = np.ascontiguousarray(blk.transpose(perm)) if numpy_in else blk.permute(perm).contiguous()
    signed = bool(np.dtype(xt.dtype).kind == "i") if numpy_in else True
    lo = int(xt.min()) if signed else 0
    hi = int(xt.max())
    e = w.num_experts
    if lo < 0 or (e is not None and hi >= e):
        bad = xt < 0 if e is None else (xt < 0) | (xt >= e)
        kk, layer, tok = _first(bad)
        value = int(xt[kk, layer, tok])
        bound = ">= 0" if value < 0 else f"< num_experts={e}"
        raise w.range_error(
            f"{w.what}: expected expert ids {bound}, found {value} "
            f"(token {w.token_offset + a + tok}, layer {w.layer_ids[layer]})",
            token=w.token_offset + a + tok,
            layer=w.layer_ids[layer],
        )
    for r in range(1, k):
        eq = xt[: k - r] == xt[r:]
        if bool(eq.any()):
            _, layer, tok = _first(eq)
            row = xt[:, layer, tok].tolist()
            raise w.duplicate_error(
                f"{w.what}: expected {k} distinct experts per token and layer, found {row} "
                f"(token {w.token_offset + a + tok}, layer {w.layer_ids[layer]})",
                token=w.token_offset + a + tok,
                layer=w.layer_ids[layer],
            )
    if must_fail:  # pragma: no cover - a fast path and the reference disagree
        raise AssertionError(f"{w.what}: block at token {w.token_offset + a} expected to fail")


_ROW_OF: dict[int, np.dtype[Any]] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.uint16),
    4: np.dtype(np.uint32),
    8: np.dtype(np.uint64),
}


def gather_router_ids(
    src: np.ndarray,
    layer_index: np.ndarray,
    pos_row: np.ndarray,
    out: np.ndarray,
    num_experts: int | None,
    layer_ids: Sequence[int],
    *,
    span: tuple[int, int, int, int] | None = None,
    check: bool = True,
    what: str = "routes",
) -> None:
    """The fused collation pass: gather router layers, check their ids, widen to int32.

    One cache-blocked pass (``docs/collation.md``): each block of output positions is
    gathered, checked with the router-layer rules while still compact, then widened into
    ``out``; every backend raises the same error for the same input.

    Parameters
    ----------
    src:
        Compact ids ``[T, L, K]`` (any integer dtype; C-contiguous, e.g. an Arrow buffer).
    layer_index:
        int64 ``[n_local]``: the layer (index into ``src``'s axis 1) of each output layer.
    pos_row:
        int64 ``[P, C]``: the row of ``src`` each output position takes; -1 for the dummy
        row ``[0, 1, .., K-1]`` (padding, uncaptured tokens).
    out:
        ``[n_local, P, C, K]``, C-contiguous, written in place: int32, or ``src``'s dtype
        (gather and check only, the ids stay compact: widened later, e.g. on a device).
    num_experts:
        Exclusive bound of the ids (None: only ``>= 0``).
    layer_ids:
        The global layer id of each output layer (messages and error fields).
    span:
        ``(p_lo, p_hi, c_lo, c_hi)``: only positions ``[p_lo, p_hi)`` x columns
        ``[c_lo, c_hi)`` are read from ``pos_row`` and written (default: all).
    check:
        False: gather and widen only (no id test).
    what:
        What the ids are, for messages.

    Raises
    ------
    ExpertRangeError, DuplicateExpertError
        As `check_routes` on the first failing source row (``token`` = that row of
        ``src``; ``layer`` its global layer); ``out`` is then partly written.
    ValueError
        Shapes or dtypes that do not fit each other.
    """
    n_local = int(layer_index.shape[0])
    if src.ndim != 3 or pos_row.ndim != 2 or out.ndim != 4:
        raise ValueError(
            f"gather_router_ids: expected src [T, L, K], pos_row [P, C], out [n_local, P, C, K]; "
            f"found {list(src.shape)}, {list(pos_row.shape)}, {list(out.shape)}"
        )
    k = int(src.shape[2])
    if (
        tuple(out.shape) != (n_local, *pos_row.shape, k)
        or out.dtype not in (np.dtype(np.int32), src.dtype)
        or not out.flags.c_contiguous
    ):
        raise ValueError(
            f"gather_router_ids: expected a C-contiguous out of int32 or {src.dtype}, shape "
            f"{[n_local, *pos_row.shape, k]}; found {out.dtype} {list(out.shape)}"
        )
    n_p, n_c = (int(v) for v in pos_row.shape)
    where = (0, n_p, 0, n_c) if span is None else tuple(int(v) for v in span)
    if len(where) != 4 or not (
        0 <= where[0] <= where[1] <= n_p and 0 <= where[2] <= where[3] <= n_c
    ):
        raise ValueError(
            f"span: expected (p_lo, p_hi, c_lo, c_hi) within [0, {n_p}] x [0, {n_c}], found {span}"
        )
    if len(layer_ids) != n_local:
        raise ValueError(f"layer_ids: expected {n_local} ids, found {len(layer_ids)}")
    if out.size == 0 or where[0] == where[1] or where[2] == where[3]:
        return
    src = np.ascontiguousarray(src)
    pos_row = np.ascontiguousarray(pos_row, dtype=np.int64)
    layer_index = np.ascontiguousarray(layer_index, dtype=np.int64)
    dtype = np.dtype(src.dtype)
    kernels = compiled() if dtype.kind in "iu" and dtype.isnative else None
    if kernels is not None:
        bad = int(kernels.gather_widen(src, layer_index, pos_row, out, where, num_experts, check))
    else:
        p_lo, p_hi, c_lo, c_hi = where
        sub = pos_row[p_lo:p_hi, c_lo:c_hi]
        q = _gather_numpy(src, layer_index, sub, out[:, p_lo:p_hi, c_lo:c_hi], num_experts, check)
        w = c_hi - c_lo
        bad = -1 if q < 0 else (p_lo + q // w) * n_c + c_lo + q % w
    if bad >= 0:
        _raise_at(src, layer_index, int(pos_row.reshape(-1)[bad]), num_experts, layer_ids, what)


def _raise_at(
    src: np.ndarray,
    layer_index: np.ndarray,
    row: int,
    num_experts: int | None,
    layer_ids: Sequence[int],
    what: str,
) -> None:
    """Raise the reference error of source row ``row`` (-1: the dummy row)."""
    k = int(src.shape[2])
    if row < 0:
        raise ExpertRangeError(
            f"{what}: expected top-k {k} <= num_experts={num_experts} (padding positions get "
            f"the dummy row [0 .. {k - 1}]), found num_experts={num_experts}"
        )
    _check_router_ids(
        src[row : row + 1][:, layer_index], num_experts, layer_ids, token_offset=row, what=what
    )
    raise AssertionError(f"{what}: row {row} expected to fail")  # pragma: no cover


def _gather_numpy(
    src: np.ndarray,
    layer_index: np.ndarray,
    pos_row: np.ndarray,
    out: np.ndarray,
    num_experts: int | None,
    check: bool,
) -> int:
    """`gather_router_ids` with numpy, per block: a ``take`` of the local layers, the tests on
    the compact block, a transpose in cache and the widening copy. Returns the first failing
    position (flat ``p * C + c`` of the views ``pos_row``/``out``) or -1."""
    tokens, layers, k = (int(v) for v in src.shape)
    n_local = int(layer_index.shape[0])
    n_p, n_c = (int(v) for v in pos_row.shape)
    row_bytes = k * src.dtype.itemsize
    row_dtype = _ROW_OF.get(row_bytes, np.dtype((np.void, row_bytes)))
    rows = src.reshape(tokens, layers * k).view(row_dtype)
    dummy = np.frombuffer(np.arange(k, dtype=src.dtype).tobytes(), dtype=row_dtype)[0]
    step = max(1, _BLOCK_IDS // max(1, n_c * n_local * k))
    scratch = _Scratch(k, step * n_c * n_local, np.dtype(src.dtype)) if check and k > 1 else None
    tmp = np.empty((n_local, step * n_c), dtype=row_dtype)
    for p0 in range(0, n_p, step):
        p1 = min(n_p, p0 + step)
        idx = pos_row[p0:p1].reshape(-1)
        m = idx.shape[0]
        pad = idx < 0
        if tokens == 0:
            stage = np.empty((m, n_local), dtype=row_dtype)
            stage[:] = dummy
        else:
            stage = rows[np.where(pad, 0, idx)[:, None], layer_index[None, :]]
            stage[pad] = dummy
        if check:
            ids = stage.view(src.dtype).reshape(m, n_local, k)
            if _fails(ids, num_experts, scratch):
                return p0 * n_c + _first_bad_row(ids, num_experts)
        t = tmp[:, :m]
        np.copyto(t, stage.T)
        np.copyto(out[:, p0:p1], t.view(src.dtype).reshape(n_local, p1 - p0, n_c, k))
    return -1


def _first_bad_row(ids: np.ndarray, num_experts: int | None) -> int:
    """First row (axis 0) of a failing block ``[m, layers, K]`` breaking a rule."""
    bad = ids < 0 if num_experts is None else (ids < 0) | (ids >= num_experts)
    per_row = bad.any(axis=(1, 2))
    k = ids.shape[2]
    for r in range(1, k):
        per_row |= (ids[..., : k - r] == ids[..., r:]).any(axis=(1, 2))
    return int(np.argmax(per_row))


def _check_range(arr: np.ndarray, spec: RouteSpec, what: str) -> tuple[int, int]:
    """`check_routes` ``rules="range"``: ``(min, max)`` of ``arr`` ``[rows, L, K]``."""
    if arr.size == 0:
        return 0, -1
    hi = int(arr.max())
    lo = int(arr.min()) if arr.dtype.kind == "i" else 0
    e = spec.num_experts
    cap = spec.storage_cap
    if lo >= 0 and hi <= cap and (e is None or hi < e):
        return lo, hi
    layers = list(spec.router_layers)
    if layers and (lo < 0 or (e is not None and hi >= e)):
        _check_router_ids(
            arr[:, layers, :] if spec.moe_layers is not None else arr, e, layers, what=what
        )
    bad = (arr < 0) | (arr > cap)
    if bad.any():
        tok, layer, _ = _first(bad)
        raise ExpertRangeError(
            f"{what}: expected values <= {cap} "
            f"(storage {spec.dtype if e is not None else 'int32'}) "
            f"and >= 0 on every layer, found {int(arr[tok, layer][bad[tok, layer]][0])} "
            f"(token {tok}, layer {layer}; dense layers should be 0)",
            token=tok,
            layer=layer,
        )
    return lo, hi


# id(spec) -> (spec, storage cap, id bound or -1): computing them costs microseconds per turn.
# The spec is kept (its id is not reused while cached) and compared by identity.
_BOUNDS: dict[int, tuple[RouteSpec, int, int]] = {}


def _lean_check(arr: Any, spec: RouteSpec, *, exact: bool = True) -> int | None:
    """`check_routes`' fast path: the largest id (``exact=False``: an upper bound below
    ``num_experts``) when ``arr`` passes both rules, None when it fails or the path does not
    apply (numba backend, non-empty C-contiguous native unsigned ``[rows, L, K]``, ``K >= 2``,
    every layer a router layer): the caller then runs the reference checks."""
    if (
        type(arr) is not np.ndarray
        or spec.moe_layers is not None
        or arr.ndim != 3
        or arr.dtype.kind != "u"
        or not arr.flags.c_contiguous
        or not arr.dtype.isnative
        or arr.size == 0
        or arr.shape[2] < 2
    ):
        return None
    kernels = compiled()
    if kernels is None:
        return None
    entry = _BOUNDS.get(id(spec))
    if entry is None or entry[0] is not spec:  # by identity: hashing a spec costs a call
        e = spec.num_experts
        if len(_BOUNDS) > 64:  # specs are few; never grow without bound
            _BOUNDS.clear()
        entry = _BOUNDS[id(spec)] = (spec, spec.storage_cap, -1 if e is None else int(e))
    bounds = entry[1:]
    if not exact and arr.dtype.itemsize == 1 and arr.shape[2] == 8 and bounds[1] >= 0:
        experts = bounds[1]  # uint8: always <= the cap
        if experts & (experts - 1) == 0:
            # ids < experts, a power of two (128, 256), iff their OR is: the OR the kernel
            # returns decides the range, and its loop runs the duplicate test alone.
            top: int | None = kernels.scan_top8(arr, None)
            return top if top is not None and top < experts else None
        bound: int | None = kernels.scan_top8(arr, experts)
        return bound
    hi = int(arr.max())
    if hi > bounds[0] or 0 <= bounds[1] <= hi:
        return None
    if kernels.first_duplicate_token(arr, False) >= 0:
        return None
    return hi


def _check_distinct(arr: np.ndarray, spec: RouteSpec, what: str) -> None:
    """`check_routes` ``rules="distinct"`` (negative ids are left to the range rule)."""
    if arr.shape[0] == 0 or spec.topk == 1:
        return
    layers = list(spec.router_layers)
    sub = arr if spec.moe_layers is None else arr[:, layers, :]
    try:
        _check_router_ids(sub, None, layers, what=what)
    except ExpertRangeError:  # negative ids: the range rule reports those
        return
    except DuplicateExpertError as exc:
        if (
            spec.moe_layers is None
            and exc.layer is not None
            and exc.token is not None
            and not arr[:, exc.layer, :].any()
        ):
            raise DuplicateExpertError(
                f"{exc.message}; layer {exc.layer} is all zeros, as vLLM reports dense "
                f"layers: declare the router layers with RouteSpec(moe_layers=...)",
                token=exc.token,
                layer=exc.layer,
            ) from None
        raise


Rules = Literal["all", "range", "distinct"]


@overload
def check_routes(
    arr: np.ndarray,
    spec: RouteSpec,
    *,
    what: str = ...,
    rules: Rules = ...,
    exact: bool = ...,
) -> tuple[int, int]: ...


@overload
def check_routes(
    arr: Any,
    spec: None = ...,
    *,
    what: str = ...,
    num_experts: int | None = ...,
    layer_ids: Sequence[int] | None = ...,
    layers_first: bool = ...,
    token_offset: int = ...,
    range_error: type[ExpertRangeError] = ...,
    duplicate_error: type[DuplicateExpertError] = ...,
) -> None: ...


def check_routes(
    arr: Any,
    spec: RouteSpec | None = None,
    *,
    what: str = "routes",
    rules: Rules = "all",
    exact: bool = True,
    num_experts: int | None = None,
    layer_ids: Sequence[int] | None = None,
    layers_first: bool = False,
    token_offset: int = 0,
    range_error: type[ExpertRangeError] = ExpertRangeError,
    duplicate_error: type[DuplicateExpertError] = DuplicateExpertError,
) -> tuple[int, int] | None:
    """The expert-id rules on ``arr``; raise on the first violation.

    **With a spec** (the routes of a `RouteSpec`): ``arr`` is a numpy ``[rows, L, K]`` array
    of every layer; returns ``(min, max)`` of its values (``(0, -1)`` for no rows).

    * ``rules="all"`` (default): the id range (router layers in ``[0, num_experts)``; every
      layer ``>= 0`` and within the storage dtype, `RouteSpec.storage_cap`), then distinct
      experts on router layers (with ``moe_layers=None`` every layer is a router layer; a
      duplicate on a layer that is all zeros, as vLLM reports dense layers, gets a hint to
      declare ``moe_layers``).
    * ``rules="range"``: the id range only (returns (min, max));
      ``rules="distinct"``: distinct experts only (returns ``(0, -1)``).
    * ``exact=False`` (the capture path, ``rules="all"``): the returned max may be an upper
      bound of the largest id, still ``< num_experts`` (the min is then 0); exact when
      ``num_experts`` is None.

    **Without a spec** (router-layer ids): ``arr`` holds router layers only (select them
    first), numpy array or torch tensor, ``[tokens, layers, K]`` or ``[layers, tokens, K]``
    with ``layers_first``; ids must lie in ``[0, num_experts)`` (``num_experts=None``: only
    ``>= 0``) and be distinct per row. ``layer_ids``: the global layer id of each entry of the
    layer axis, for messages (default ``0 ..``); ``token_offset``: added to token positions in
    messages and fields; ``range_error``/``duplicate_error``: the exception types to raise
    (the replay boundary raises its own subclasses). Returns None. Which offender an error
    names, when there are several, is defined by the reference block check `_check_block`.

    Raises
    ------
    ExpertRangeError
        (or ``range_error``) an id out of range; ``token`` and ``layer`` locate it.
    DuplicateExpertError
        (or ``duplicate_error``) a router-layer row names the same expert twice.
    ValueError
        Arguments that do not fit each other (a 3-d array, ``layer_ids`` per layer, the
        spec-only or router-only options with the other form).
    """
    if spec is None:
        if rules != "all" or not exact:
            raise ValueError("check_routes: rules and exact need a spec")
        if arr.ndim != 3:
            raise ValueError(f"{what}: expected a 3-d id array, found shape {list(arr.shape)}")
        layers = range(int(arr.shape[0 if layers_first else 1])) if layer_ids is None else layer_ids
        _check_router_ids(
            arr,
            num_experts,
            layers,
            layers_first=layers_first,
            what=what,
            token_offset=token_offset,
            range_error=range_error,
            duplicate_error=duplicate_error,
        )
        return None
    if (
        num_experts is not None
        or layer_ids is not None
        or layers_first
        or token_offset
        or range_error is not ExpertRangeError
        or duplicate_error is not DuplicateExpertError
    ):
        raise ValueError("check_routes: with a spec, the router-layer options do not apply")
    if rules == "all":
        if not exact and spec.num_experts is not None:
            lean = _lean_check(arr, spec, exact=False)
            if lean is not None:
                return 0, lean
        lean = _lean_check(arr, spec)
        if lean is not None:
            return 0, lean
        lo_hi = _check_range(arr, spec, what)
        _check_distinct(arr, spec, what)
        return lo_hi
    if rules == "range":
        return _check_range(arr, spec, what)
    if rules == "distinct":
        _check_distinct(arr, spec, what)
        return 0, -1
    raise ValueError(f"rules: expected 'all', 'range' or 'distinct', found {rules!r}")


__all__ = ["check_routes", "gather_router_ids"]
