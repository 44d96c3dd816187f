"""Expert counts: exact routed-token counts per router layer and expert.

One pass over the ids on a thread pool, no Python loop per token or layer: with numba a
compiled kernel adds each id to its (layer, expert) counter; without it, per cache-sized
chunk, one bincount of ``layer * E + id`` codes (torch's when installed: GIL-free). Both
give the same integers (``docs/scale.md``).
"""

from __future__ import annotations

import dataclasses
import threading
from types import ModuleType
from typing import Any

import numpy as np
import polars as pl

from r3arrow._kernels import compiled
from r3arrow._routes import as_route_rows
from r3arrow.errors import RouteShapeError, SchemaError
from r3arrow.spec import RouteSpec
from r3arrow.stats._kernels import (
    CHUNK_IDS,
    NUMBA_CHUNK_IDS,
    Chunk,
    bincount,
    check_selection,
    chunks,
    exact_sum,
    map_chunks,
    raise_range,
)


@dataclasses.dataclass(frozen=True, eq=False)
class ExpertCounts:
    """Exact routed-token counts per router layer and expert.

    ``counts``: int64 ``[len(layers), num_experts]``, ``counts[i, e]`` the selected tokens
    layer ``layers[i]`` sent to expert ``e`` (each row sums to ``topk * tokens``). Counts
    add (``a + b``, exact: `SchemaError` past int64); with an unknown ``num_experts`` the
    expert axis spans the ids seen and addition pads the narrower side with zeros.
    """

    layers: tuple[int, ...]
    counts: np.ndarray
    tokens: int

    def __post_init__(self) -> None:
        c = np.asarray(self.counts)
        if c.ndim != 2 or c.shape[0] != len(self.layers):
            raise RouteShapeError(
                f"ExpertCounts: expected counts [{len(self.layers)}, E], found {list(c.shape)}"
            )
        object.__setattr__(self, "counts", c.astype(np.int64, copy=False))

    @property
    def num_experts(self) -> int:
        return int(self.counts.shape[1])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ExpertCounts):
            return NotImplemented
        return (self.layers, self.tokens) == (other.layers, other.tokens) and np.array_equal(
            self.counts, other.counts
        )

    def __add__(self, other: ExpertCounts) -> ExpertCounts:
        if not isinstance(other, ExpertCounts):
            return NotImplemented
        if other.layers != self.layers:
            raise RouteShapeError(
                f"ExpertCounts: expected the same router layers {list(self.layers)}, "
                f"found {list(other.layers)}"
            )
        e = max(self.num_experts, other.num_experts)
        a, b = (np.pad(p.counts, ((0, 0), (0, e - p.num_experts))) for p in (self, other))
        tokens = int(exact_sum("ExpertCounts.tokens", self.tokens, other.tokens))
        return ExpertCounts(self.layers, exact_sum("ExpertCounts.counts", a, b), tokens)

    @classmethod
    def empty(cls, spec: RouteSpec) -> ExpertCounts:
        """Zero counts for ``spec`` (``num_experts`` wide, or 0 wide when unknown)."""
        return cls(
            spec.router_layers,
            np.zeros((len(spec.router_layers), spec.num_experts or 0), np.int64),
            0,
        )

    def to_polars(self) -> pl.DataFrame:
        """Long frame ``layer`` (Int32, global id), ``expert`` (Int32), ``tokens`` (Int64), in
        (layer, expert) order."""
        n, e = self.counts.shape
        return pl.DataFrame(
            {
                "layer": pl.Series(
                    np.repeat(np.asarray(self.layers, dtype=np.int32), e), dtype=pl.Int32
                ),
                "expert": pl.Series(np.tile(np.arange(e, dtype=np.int32), n), dtype=pl.Int32),
                "tokens": pl.Series(self.counts.reshape(-1), dtype=pl.Int64),
            }
        )

    def to_vector(self) -> np.ndarray:
        """Flat int64 ``[n_layers, E, tokens, *layers, *counts]`` (inverse: `from_vector`)."""
        head = np.array([len(self.layers), self.num_experts, self.tokens], dtype=np.int64)
        return np.concatenate([head, np.asarray(self.layers, np.int64), self.counts.reshape(-1)])

    @classmethod
    def from_vector(cls, vec: Any) -> ExpertCounts:
        v = np.asarray(vec, dtype=np.int64)
        n, e = int(v[0]), int(v[1])
        if v.size != 3 + n + n * e:
            raise SchemaError(
                f"ExpertCounts vector: expected {3 + n + n * e} values, found {v.size}"
            )
        return cls(tuple(int(x) for x in v[3 : 3 + n]), v[3 + n :].reshape(n, e).copy(), int(v[2]))


def count_routes(routes: Any, spec: RouteSpec, *, select: np.ndarray | None = None) -> ExpertCounts:
    """Per-layer expert counts of routes ``[T, L, K]`` (numpy or Arrow), router layers only.

    ``select``: optional bool ``[T]`` of rows to count. Raises `ExpertRangeError`
    (``token`` = the route row, ``layer`` set) for an id outside ``[0, num_experts)`` on a
    router layer (``docs/design.md``, "Expert ids"), `RouteShapeError` for a bad shape or
    ``select``.
    """
    arr = as_route_rows(routes, spec)
    sel = check_selection(select, arr.shape[0])
    layers = list(spec.router_layers)
    nl, k = len(layers), spec.topk
    ntok = arr.shape[0] if sel is None else int(np.count_nonzero(sel))
    if ntok == 0:
        return ExpertCounts.empty(spec)
    e = spec.num_experts
    nb = compiled()
    if nb is not None and e is not None and arr.dtype.itemsize <= 4:  # int64 ids: numpy
        return _count_numba(nb, arr, spec, e, sel, ntok)
    signed = arr.dtype.kind == "i"
    if e is None or signed:
        # Unknown E: the expert axis spans the ids seen. Signed storage: negative ids
        # would move codes backwards, which the per-layer totals below cannot detect.
        sub = arr if spec.moe_layers is None else arr[:, layers, :]
        seen = sub if sel is None else sub[sel]
        lo, hi = int(seen.min()), int(seen.max())
        e = hi + 1 if e is None else e
        if lo < 0 or hi >= e:
            raise_range(sub, e, layers, sel, "routes")
        if signed:  # ids checked: count the router layers only
            arr = sub
    # Code base per layer: rank among the router layers × E; a dense layer's ids land in
    # the discard range [nl * E, top) that an unsigned id can reach.
    width = arr.shape[1]
    if signed or spec.moe_layers is None:  # every layer of ``arr`` is a router layer
        rank = np.arange(width, dtype=np.int64)
    else:
        rank = np.full(width, nl, dtype=np.int64)
        rank[layers] = np.arange(nl)
    top = nl * e if signed else nl * e + int(np.iinfo(arr.dtype).max) + 1
    code_dtype = next(t for t in (np.int16, np.int32, np.int64) if top <= np.iinfo(t).max)
    base = np.broadcast_to((rank * e).astype(code_dtype)[:, None], (width, k))
    rows = max(1, CHUNK_IDS // (width * k))

    local = threading.local()  # one codes buffer per worker thread, reused across chunks

    def count(chunk: Chunk) -> np.ndarray:
        block = arr[chunk]
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = np.empty((rows, width, k), dtype=code_dtype)
        codes = buf[: block.shape[0]]
        np.add(block, base, out=codes, casting="unsafe")
        return bincount(codes)

    total = np.zeros(top, dtype=np.int64)
    for part in map_chunks(count, list(chunks(arr.shape[0], rows, sel))):
        total[: part.size] += part
    counts = total[: nl * e].reshape(nl, e)
    # Each router layer gets exactly K ids per token; an id >= E spills into a later
    # layer's (or the discard) range, so the lowest layer with one comes up short.
    # Unsigned ids only: signed ones were checked above.
    if np.any(counts.sum(axis=1) != k * ntok):
        raise_range(arr[:, layers, :], e, layers, sel, "routes")
    return ExpertCounts(spec.router_layers, counts.copy(), ntok)


def _count_numba(
    nb: ModuleType, arr: np.ndarray, spec: RouteSpec, e: int, sel: np.ndarray | None, ntok: int
) -> ExpertCounts:
    """`count_routes` by the numba kernel: ``[T, L, K]`` ids, known ``num_experts`` ``e``.

    Each router layer has ``e`` counters and an overflow bucket (dense layers share one
    discard range); a count in an overflow bucket raises the reference `ExpertRangeError`.
    Signed ids are viewed as unsigned: a negative id becomes ``>= 2**(bits-1)``, above every
    id the dtype holds, so counting up to ``min(e, 2**(bits-1))`` flags it too.
    """
    ids = arr
    if arr.dtype.kind == "i":
        ids = arr.view(arr.dtype.str.replace("i", "u"))
        e_kernel = min(e, 1 << (8 * arr.dtype.itemsize - 1))
    else:
        e_kernel = e
    layers = list(spec.router_layers)
    # One-byte ids: a counter for each of the 256 values (the clamp at 255 never moves one),
    # uint32 counters (a chunk holds < 2**32 ids) that stay in L1; wider ids: e + 1 int64
    # counters per layer.
    one_byte = ids.dtype.itemsize == 1
    if one_byte:
        e_kernel = min(e_kernel, 256)
    nl, w = len(layers), (256 if one_byte else e_kernel + 1)
    width = arr.shape[1]
    base = np.full(width, nl * w, dtype=np.int64)
    base[layers] = np.arange(nl, dtype=np.int64) * w
    rows = max(1, NUMBA_CHUNK_IDS // max(1, width * spec.topk))
    sel_b = nb.selection_bytes(sel)

    def count(chunk: Chunk) -> np.ndarray:
        assert isinstance(chunk, slice)
        part_sel = sel_b if sel is None else sel_b[chunk]
        if one_byte:
            small = np.zeros((nl + 1) * w, dtype=np.uint32)
            nb.count_codes(ids[chunk], part_sel, base, 255, small)
            return small
        out = np.zeros((nl + 1) * w, dtype=np.int64)
        nb.count_codes(ids[chunk], part_sel, base, e_kernel, out)
        return out

    total = np.zeros((nl + 1) * w, dtype=np.int64)
    for part in map_chunks(count, list(chunks(arr.shape[0], rows, None))):
        total += part
    counts = total[: nl * w].reshape(nl, w)
    if counts[:, e_kernel:].any():
        raise_range(arr[:, layers, :], e, layers, sel, "routes")
    out = np.zeros((nl, e), dtype=np.int64)
    out[:, :e_kernel] = counts[:, :e_kernel]
    return ExpertCounts(spec.router_layers, out, ntok)


__all__ = ["ExpertCounts", "count_routes"]
