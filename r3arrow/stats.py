"""Routing analytics: expert load, imbalance, entropy, drift and route agreement.

Counting is vectorised: per cache-sized chunk of tokens, ``layer * E + id``
codes and one bincount (torch's: GIL-free, so chunks run on a thread pool),
no loop per token or layer. Every statistic is built from *partial counts that add up exactly*
(`ExpertCounts`, `RouteAgreement`): a table is processed one record batch at a
time, a ``step=N`` Parquet directory one step at a time (only that step's
routes are resident), and the Ray path (`r3arrow.ray`) sums the same partials
across workers — so all three give identical integers. Summaries over the
counts (`load_summary`, `load_drift`, ...) are Polars expressions and accept a
``DataFrame`` or a ``LazyFrame``.

Token subsets (``tokens=``), over route rows (row ``i`` routes token ``i``,
i.e. the forward pass whose logits predict token ``i + 1``):

- ``"all"``: every captured row.
- ``"prompt"``: rows ``i < P`` (forward passes over prompt tokens, the prefill).
- ``"response"``: rows ``i >= P`` (forward passes over response tokens).
- ``"loss"``: rows ``i`` whose *next* token ``i + 1`` is loss-active — the
  forward passes whose logits the policy loss trains on (the same rule as the
  terminal-gap check). Row ``P - 1`` is in this set when the first response
  token is trained; the last response token's row never is.

Interop (zero-copy): `to_polars` (``polars.from_arrow``), `routes_torch`
(DLPack from the Arrow buffer). Hugging Face ``datasets`` wraps a rollout
table without copying::

    hf = datasets.Dataset(table)                  # Arrow table shared, not copied
    arrow = hf.with_format("arrow")[:]             # pyarrow.Table, routes type intact
    back = pa.Table.from_arrays(arrow.columns, schema=table.schema)  # spec metadata, non-null fields

(``with_format("numpy")`` widens ids to int64 — a copy; use the arrow format
and `r3arrow.table.flat_routes` for a zero-copy ``[T, L, K]`` view.)
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeAlias, TypeVar, cast

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from r3arrow.errors import (
    DuplicateExpertError,
    ExpertRangeError,
    RouteShapeError,
    SchemaError,
)
from r3arrow.spec import RouteSpec, as_route_rows, routes_to_numpy
from r3arrow.table import flat_routes, list_lengths, route_spec

if TYPE_CHECKING:
    import torch

TokenSubset = Literal["all", "prompt", "response", "loss"]
TOKEN_SUBSETS: tuple[str, ...] = ("all", "prompt", "response", "loss")
Source: TypeAlias = "pa.Table | pa.RecordBatch | str | os.PathLike[str]"
Frame = TypeVar("Frame", pl.DataFrame, pl.LazyFrame)

# Ids per chunk of the kernels: small enough that codes and bool temporaries stay in
# cache, large enough that the per-chunk Python overhead is noise (measured: 2**18).
_CHUNK_IDS = 1 << 18
_MAX_THREADS = 8
_T = TypeVar("_T")
_SEL_COLUMNS: dict[str, tuple[str, ...]] = {
    "all": (),
    "prompt": ("prompt_ids",),
    "response": ("prompt_ids",),
    "loss": ("prompt_ids", "response_ids", "loss_mask"),
}


# ============================================================ token selection
def _check_subset(tokens: str) -> None:
    if tokens not in TOKEN_SUBSETS:
        raise ValueError(f"tokens: expected one of {list(TOKEN_SUBSETS)}, found {tokens!r}")


def token_selection(table: pa.Table | pa.RecordBatch, tokens: str) -> np.ndarray | None:
    """Bool ``[sum(captured)]`` over the route rows of `flat_routes` (``None`` for ``"all"``).

    See the module docstring for the subsets. Raises `SchemaError` if a needed
    column is missing, ``ValueError`` for an unknown subset.
    """
    _check_subset(tokens)
    if tokens == "all":
        return None
    for name in _SEL_COLUMNS[tokens]:
        if name not in table.schema.names:
            raise SchemaError(
                f"tokens={tokens!r}: expected column {name!r}, found {table.schema.names}"
            )
    cap = list_lengths(table.column("routes"))
    plen = list_lengths(table.column("prompt_ids"))
    starts = np.zeros(cap.size + 1, dtype=np.int64)
    np.cumsum(cap, out=starts[1:])
    parent = np.repeat(np.arange(cap.size, dtype=np.int64), cap)
    pos = np.arange(starts[-1], dtype=np.int64) - starts[:-1][parent]
    if tokens == "prompt":
        return np.asarray(pos < plen[parent])
    if tokens == "response":
        return np.asarray(pos >= plen[parent])
    rlen = list_lengths(table.column("response_ids"))
    mlen = list_lengths(table.column("loss_mask"))
    if not np.array_equal(mlen, rlen):
        i = int(np.flatnonzero(mlen != rlen)[0])
        raise SchemaError(
            f"row {i}: expected loss_mask over the {rlen[i]} response tokens, found {mlen[i]}"
        )
    mask = np.asarray(pc.list_flatten(table.column("loss_mask")).to_numpy(zero_copy_only=False))
    rstart = np.zeros(rlen.size + 1, dtype=np.int64)
    np.cumsum(rlen, out=rstart[1:])
    nxt = pos + 1 - plen[parent]  # response index of the token row i predicts
    ok = (nxt >= 0) & (nxt < rlen[parent])
    if mask.size == 0:
        return np.zeros(pos.size, dtype=bool)
    idx = rstart[:-1][parent] + np.where(ok, nxt, 0)
    np.minimum(idx, mask.size - 1, out=idx)  # rows with ok=False may point one past the end
    return np.asarray(ok & (mask[idx] != 0))


# ============================================================== expert counts
@dataclasses.dataclass(frozen=True, eq=False)
class ExpertCounts:
    """Exact routed-token counts: ``counts[i, e]`` = selected tokens that layer ``layers[i]`` sent to expert ``e``.

    ``counts`` is int64 ``[len(layers), num_experts]``; each row sums to
    ``topk * tokens``. Counts add (``a + b``) across batches, steps and workers;
    with an unknown ``num_experts`` the expert axis spans the ids seen and
    addition pads the narrower side with zeros.
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
                f"ExpertCounts: expected the same router layers {list(self.layers)}, found {list(other.layers)}"
            )
        e = max(self.num_experts, other.num_experts)
        out = np.zeros((len(self.layers), e), dtype=np.int64)
        out[:, : self.num_experts] += self.counts
        out[:, : other.num_experts] += other.counts
        return ExpertCounts(self.layers, out, self.tokens + other.tokens)

    @classmethod
    def empty(cls, spec: RouteSpec) -> ExpertCounts:
        """Zero counts for ``spec`` (``num_experts`` wide, or 0 wide when unknown)."""
        return cls(
            spec.router_layers,
            np.zeros((len(spec.router_layers), spec.num_experts or 0), np.int64),
            0,
        )

    def to_polars(self) -> pl.DataFrame:
        """Long frame ``layer`` (Int32, global id), ``expert`` (Int32), ``tokens`` (Int64), (layer, expert) order."""
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
        """Flat int64 encoding ``[n_layers, E, tokens, *layers, *counts]`` (inverse: `from_vector`)."""
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


def _router_block(
    arr: np.ndarray, layers: list[int] | None, rows: np.ndarray | slice
) -> np.ndarray:
    """``arr[rows][:, layers]`` with one gather (a view when both are trivial)."""
    if layers is None:
        return arr[rows]
    if isinstance(rows, slice):
        return arr[rows, layers, :]
    return np.asarray(arr[np.ix_(rows, np.asarray(layers, dtype=np.intp))])


def _chunks(n: int, rows: int, sel: np.ndarray | None) -> Iterator[np.ndarray | slice]:
    if sel is None:
        for s in range(0, n, rows):
            yield slice(s, min(s + rows, n))
    else:
        idx = np.flatnonzero(sel)
        for s in range(0, idx.size, rows):
            yield idx[s : s + rows]


def _check_selection(sel: np.ndarray | None, n: int) -> np.ndarray | None:
    if sel is None:
        return None
    s = np.asarray(sel)
    if s.dtype != np.bool_ or s.shape != (n,):
        raise RouteShapeError(
            f"token selection: expected bool [{n}], found {s.dtype} {list(s.shape)}"
        )
    return s


def _range_error(
    block: np.ndarray, num_experts: int, layers: Sequence[int], what: str
) -> ExpertRangeError:
    bad = np.argwhere((block < 0) | (block >= num_experts))[0]
    value = int(block[tuple(bad)])
    return ExpertRangeError(
        f"{what}: expected expert ids in [0, {num_experts}) on router layers, found {value} "
        f"(layer {layers[int(bad[1])]})"
    )


def _threads() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(_MAX_THREADS, cpus))


def _map_chunks(
    fn: Callable[[np.ndarray | slice], _T], chunks: list[np.ndarray | slice]
) -> Iterator[_T]:
    """``fn`` over chunks, on a thread pool when there are several (numpy and torch release the GIL)."""
    if len(chunks) <= 1 or _threads() == 1:
        yield from map(fn, chunks)
        return
    with ThreadPoolExecutor(_threads()) as pool:
        yield from pool.map(fn, chunks)


def _bincount(codes: np.ndarray) -> np.ndarray:
    """Counts of non-negative integer ``codes`` (torch's bincount: faster than numpy's and GIL-free)."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is a core dependency
        return np.bincount(codes.reshape(-1))
    return torch.bincount(torch.from_numpy(codes.reshape(-1))).numpy()


def count_routes(routes: Any, spec: RouteSpec, *, select: np.ndarray | None = None) -> ExpertCounts:
    """Per-layer expert counts of routes ``[T, L, K]`` (numpy or Arrow), router layers only.

    ``select``: optional bool ``[T]`` of rows to count. Vectorised: per
    cache-sized chunk of tokens, codes ``layer * E + id`` (dense layers go to a
    discard range) and one bincount, chunks on a thread pool. Raises
    `ExpertRangeError` for an id outside ``[0, num_experts)`` on a router layer.
    """
    arr = as_route_rows(routes, spec)
    sel = _check_selection(select, arr.shape[0])
    layers = list(spec.router_layers)
    nl, k = len(layers), spec.topk
    ntok = arr.shape[0] if sel is None else int(np.count_nonzero(sel))
    if ntok == 0:
        return ExpertCounts.empty(spec)
    e = spec.num_experts
    signed = arr.dtype.kind == "i"
    if e is None or signed:
        # Unknown E: the expert axis spans the ids seen. Signed storage: negative ids
        # would move codes backwards, which the per-layer totals below cannot detect.
        sub = arr if spec.moe_layers is None else arr[:, layers, :]
        seen = sub if sel is None else sub[sel]
        lo, hi = int(seen.min()), int(seen.max())
        e = hi + 1 if e is None else e
        if lo < 0 or hi >= e:
            raise _range_error(seen, e, layers, "routes")
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
    rows = max(1, _CHUNK_IDS // (width * k))

    local = threading.local()  # one codes buffer per worker thread, reused across chunks

    def count(chunk: np.ndarray | slice) -> np.ndarray:
        block = arr[chunk]
        buf = getattr(local, "buf", None)
        if buf is None:
            buf = local.buf = np.empty((rows, width, k), dtype=code_dtype)
        codes = buf[: block.shape[0]]
        np.add(block, base, out=codes, casting="unsafe")
        return _bincount(codes)

    total = np.zeros(top, dtype=np.int64)
    for part in _map_chunks(count, list(_chunks(arr.shape[0], rows, sel))):
        total[: part.size] += part
    counts = total[: nl * e].reshape(nl, e)
    # Each router layer gets exactly K ids per token; an id >= E spills into a later
    # layer's (or the discard) range, so the lowest layer with one comes up short.
    if np.any(counts.sum(axis=1) != k * ntok):  # unsigned ids only: signed ones were checked above
        sub = arr[:, layers, :]
        raise _range_error(sub if sel is None else sub[sel], e, layers, "routes")
    return ExpertCounts(spec.router_layers, counts.copy(), ntok)


# ================================================================ agreement
@dataclasses.dataclass(frozen=True, eq=False)
class RouteAgreement:
    """Exact agreement counts between two route sets for the same tokens (order within top-k ignored).

    ``identical[i]``: tokens whose top-k *set* on layer ``layers[i]`` is the same
    in both; ``overlap[i]``: sum over tokens of ``|A ∩ B|`` on that layer;
    ``all_identical``: tokens identical on every router layer. Adds (``a + b``).
    Fractions are NaN when ``tokens == 0``.
    """

    layers: tuple[int, ...]
    topk: int
    tokens: int
    identical: np.ndarray
    overlap: np.ndarray
    all_identical: int

    def __post_init__(self) -> None:
        for name in ("identical", "overlap"):
            v = np.asarray(getattr(self, name), dtype=np.int64)
            if v.shape != (len(self.layers),):
                raise RouteShapeError(
                    f"RouteAgreement.{name}: expected [{len(self.layers)}], found {list(v.shape)}"
                )
            object.__setattr__(self, name, v)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RouteAgreement):
            return NotImplemented
        return (
            (self.layers, self.topk, self.tokens, self.all_identical)
            == (other.layers, other.topk, other.tokens, other.all_identical)
            and np.array_equal(self.identical, other.identical)
            and np.array_equal(self.overlap, other.overlap)
        )

    def __add__(self, other: RouteAgreement) -> RouteAgreement:
        if not isinstance(other, RouteAgreement):
            return NotImplemented
        if (other.layers, other.topk) != (self.layers, self.topk):
            raise RouteShapeError(
                f"RouteAgreement: expected layers {list(self.layers)} and topk {self.topk}, "
                f"found {list(other.layers)} and {other.topk}"
            )
        return RouteAgreement(
            self.layers,
            self.topk,
            self.tokens + other.tokens,
            self.identical + other.identical,
            self.overlap + other.overlap,
            self.all_identical + other.all_identical,
        )

    @classmethod
    def empty(cls, spec: RouteSpec) -> RouteAgreement:
        n = len(spec.router_layers)
        return cls(
            spec.router_layers, spec.topk, 0, np.zeros(n, np.int64), np.zeros(n, np.int64), 0
        )

    def _frac(self, num: Any, den: float) -> Any:
        with np.errstate(invalid="ignore", divide="ignore"):
            return (
                np.asarray(num, dtype=np.float64) / den if den else np.full(np.shape(num), np.nan)
            )

    @property
    def identical_fraction(self) -> np.ndarray:
        """float64 ``[n_layers]``: fraction of tokens whose top-k set is identical on each layer."""
        return np.asarray(self._frac(self.identical, self.tokens))

    @property
    def mean_overlap(self) -> np.ndarray:
        """float64 ``[n_layers]``: mean ``|A ∩ B| / K`` on each layer."""
        return np.asarray(self._frac(self.overlap, self.tokens * self.topk))

    @property
    def differing_fraction(self) -> float:
        """Fraction of tokens whose top-k set differs on at least one router layer."""
        return float(self._frac(self.tokens - self.all_identical, self.tokens))

    def per_layer(self) -> pl.DataFrame:
        """``layer`` (Int32), ``tokens`` (Int64), ``identical``, ``overlap`` (Float64 fractions)."""
        return pl.DataFrame(
            {
                "layer": pl.Series(np.asarray(self.layers, np.int32), dtype=pl.Int32),
                "tokens": pl.Series(
                    np.full(len(self.layers), self.tokens, np.int64), dtype=pl.Int64
                ),
                "identical": pl.Series(self.identical_fraction, dtype=pl.Float64),
                "overlap": pl.Series(self.mean_overlap, dtype=pl.Float64),
            }
        )

    def summary(self) -> dict[str, float]:
        """Scalars: tokens, identical (mean over layers), identical_min (worst layer), overlap, differing."""
        ident = self.identical_fraction
        return {
            "tokens": float(self.tokens),
            "identical": float(self._frac(self.identical.sum(), self.tokens * len(self.layers))),
            "identical_min": float(ident.min()) if ident.size else math.nan,
            "overlap": float(
                self._frac(self.overlap.sum(), self.tokens * self.topk * len(self.layers))
            ),
            "differing": self.differing_fraction,
        }

    def to_vector(self) -> np.ndarray:
        """Flat int64 encoding (inverse: `from_vector`)."""
        head = np.array(
            [len(self.layers), self.topk, self.tokens, self.all_identical], dtype=np.int64
        )
        return np.concatenate(
            [head, np.asarray(self.layers, np.int64), self.identical, self.overlap]
        )

    @classmethod
    def from_vector(cls, vec: Any) -> RouteAgreement:
        v = np.asarray(vec, dtype=np.int64)
        n = int(v[0])
        if v.size != 4 + 3 * n:
            raise SchemaError(f"RouteAgreement vector: expected {4 + 3 * n} values, found {v.size}")
        return cls(
            tuple(int(x) for x in v[4 : 4 + n]),
            int(v[1]),
            int(v[2]),
            v[4 + n : 4 + 2 * n].copy(),
            v[4 + 2 * n :].copy(),
            int(v[3]),
        )


def compare_routes(
    a: Any, b: Any, spec: RouteSpec, *, select: np.ndarray | None = None
) -> RouteAgreement:
    """Agreement of two aligned route arrays ``[T, L, K]`` (any integer dtypes) on the router layers.

    Row ``t`` of ``a`` and of ``b`` must route the same token. Raises
    `RouteShapeError` on a shape mismatch, `DuplicateExpertError` if a top-k
    set repeats an expert (set overlap would be ill-defined), `ExpertRangeError`
    for ids outside ``[0, num_experts)`` when ``spec.num_experts`` is known.
    """
    x = as_route_rows(a, spec, what="routes a")
    y = as_route_rows(b, spec, what="routes b")
    if x.shape != y.shape:
        raise RouteShapeError(
            f"expected two route arrays of one shape, found {list(x.shape)} and {list(y.shape)}"
        )
    sel = _check_selection(select, x.shape[0])
    layers = list(spec.router_layers)
    pick = None if spec.moe_layers is None else layers
    nl, k = len(layers), spec.topk
    rows = max(1, _CHUNK_IDS // (nl * k * 4))  # bool temporaries per id: keep them in cache

    def agree(chunk: np.ndarray | slice) -> tuple[np.ndarray, np.ndarray, int, int]:
        ba = _router_block(x, pick, chunk)
        bb = _router_block(y, pick, chunk)
        if ba.shape[0] == 0:
            return np.zeros(nl, np.int64), np.zeros(nl, np.int64), 0, 0
        for block, what in ((ba, "routes a"), (bb, "routes b")):
            _check_block(block, spec, layers, what)
        # Sets of distinct ids: each a_i matches at most one b_j, so |A∩B| = #a_i found in B.
        found = ba == bb[..., :1]
        for j in range(1, k):
            found |= ba == bb[..., j : j + 1]
        ov = np.count_nonzero(found, axis=-1)  # [c, nl]
        same = ov == k
        return (
            np.count_nonzero(same, axis=0).astype(np.int64),
            ov.sum(axis=0, dtype=np.int64),
            int(np.count_nonzero(same.all(axis=1))),
            int(ba.shape[0]),
        )

    identical = np.zeros(nl, dtype=np.int64)
    overlap = np.zeros(nl, dtype=np.int64)
    all_identical = ntok = 0
    for ident, ov_sum, all_same, n in _map_chunks(agree, list(_chunks(x.shape[0], rows, sel))):
        identical += ident
        overlap += ov_sum
        all_identical += all_same
        ntok += n
    return RouteAgreement(spec.router_layers, k, ntok, identical, overlap, all_identical)


def _check_block(block: np.ndarray, spec: RouteSpec, layers: Sequence[int], what: str) -> None:
    e = spec.num_experts
    if block.dtype.kind == "i" and int(block.min()) < 0:
        raise _range_error(
            block, e if e is not None else int(np.iinfo(block.dtype).max), layers, what
        )
    if e is not None and int(block.max()) >= e:
        raise _range_error(block, e, layers, what)
    k = block.shape[-1]
    if k > 1:
        dup = np.zeros(block.shape[:2], dtype=bool)
        for i in range(k - 1):
            dup |= (block[..., i : i + 1] == block[..., i + 1 :]).any(axis=-1)
        if dup.any():
            t, layer = np.argwhere(dup)[0]
            raise DuplicateExpertError(
                f"{what}: expected {k} distinct experts per token and layer, found "
                f"{block[t, layer].tolist()} on layer {layers[int(layer)]}"
            )


# ============================================================ table plumbing
def _route_rows(
    col: pa.Array | pa.ChunkedArray, spec: RouteSpec, name: str
) -> tuple[np.ndarray, np.ndarray]:
    """(rows ``[T, L, K]``, lengths ``[B]``) of a ragged routes column, nested or fixed_size_binary storage."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    if not (pa.types.is_large_list(col.type) or pa.types.is_list(col.type)):
        raise SchemaError(
            f"column {name!r}: expected a large_list of per-token routes, found {col.type}"
        )
    lengths = list_lengths(col)
    values = col.flatten()
    if pa.types.is_fixed_size_binary(values.type):
        per = spec.num_layers * spec.topk
        width = values.type.byte_width
        dtype = (
            {1: np.uint8, 2: np.uint16, 4: np.int32}.get(width // per) if width % per == 0 else None
        )
        if dtype is None:
            raise SchemaError(
                f"column {name!r}: expected fixed_size_binary of {per} ids (1, 2 or 4 bytes each), found {values.type}"
            )
        buf = np.frombuffer(values.buffers()[1], dtype=np.uint8)
        raw = buf[values.offset * width : (values.offset + len(values)) * width]
        return raw.view(dtype).reshape(len(values), spec.num_layers, spec.topk), lengths
    return routes_to_numpy(values, spec), lengths


def _batches(table: pa.Table | pa.RecordBatch) -> Iterator[pa.Table | pa.RecordBatch]:
    if isinstance(table, pa.RecordBatch):
        yield table
        return
    batches = table.to_batches()
    if not batches:
        yield table
        return
    meta = table.schema.metadata
    for b in batches:
        yield b if b.schema.metadata == meta else b.replace_schema_metadata(meta)


def _columns_for(tokens: str, extra: Sequence[str] = ()) -> list[str]:
    cols = ["routes", *extra, *_SEL_COLUMNS[tokens]]
    return list(dict.fromkeys(cols))


def _is_path(source: Any) -> bool:
    return isinstance(source, str | os.PathLike)


def _iter_source(
    source: Source, columns: list[str], steps: Sequence[int] | None
) -> Iterator[tuple[int | None, pa.Table | pa.RecordBatch]]:
    """(step, batch) pairs: a table by its ``step`` column, a directory one step at a time."""
    if _is_path(source):
        from r3arrow.io import iter_rollouts, list_steps

        p = Path(cast("str | os.PathLike[str]", source))
        if p.is_dir():
            present = list_steps(p)
            if not present:
                raise SchemaError(f"{p}: expected step=N/ rollout partitions, found none")
            if steps is not None and (missing := sorted(set(int(s) for s in steps) - set(present))):
                raise SchemaError(f"{p}: expected steps {missing} to exist, found steps {present}")
        elif steps is not None:
            raise SchemaError(f"{p}: steps= needs a step=N/ directory, found a single file")
        for step, table in iter_rollouts(p, columns=columns, steps=steps):
            # Drop every reference to a step before the next one is read: one step resident.
            batches = list(_batches(table))[::-1]
            del table
            while batches:
                yield step, batches.pop()
        return
    if not isinstance(source, pa.Table | pa.RecordBatch):
        raise TypeError(
            f"expected a rollout table, record batch or Parquet path, found {type(source).__name__}"
        )
    missing_cols = [c for c in columns if c not in source.schema.names]
    if missing_cols:
        raise SchemaError(f"expected columns {missing_cols}, found {source.schema.names}")
    if "step" not in source.schema.names:
        if steps is not None:
            raise SchemaError(f"steps= needs a 'step' column, found {source.schema.names}")
        for batch in _batches(source):
            yield None, batch
        return
    step_col = source.column("step")
    if step_col.null_count:
        raise SchemaError(f"step: expected no nulls, found {step_col.null_count}")
    values = np.asarray(step_col.to_numpy(), dtype=np.int64)
    wanted = (
        np.unique(values)
        if steps is None
        else np.asarray(sorted({int(s) for s in steps}), np.int64)
    )
    table = source if isinstance(source, pa.Table) else pa.Table.from_batches([source])
    for s in wanted:
        rows = np.flatnonzero(values == s)
        if rows.size == values.size:
            sub = table
        elif rows.size and rows[-1] - rows[0] + 1 == rows.size:
            sub = table.slice(int(rows[0]), int(rows.size))  # contiguous: zero-copy
        else:
            sub = table.take(pa.array(rows)).replace_schema_metadata(table.schema.metadata)
        for batch in _batches(sub):
            yield int(s), batch


def batch_counts(batch: pa.Table | pa.RecordBatch, tokens: str = "all") -> ExpertCounts:
    """`ExpertCounts` of one rollout table or record batch (routes restored, spec in the metadata)."""
    spec = route_spec(batch)
    rows, _ = flat_routes(batch)
    return count_routes(rows, spec, select=token_selection(batch, tokens))


def _aligned_rows(
    batch: pa.Table | pa.RecordBatch, col: pa.Array | pa.ChunkedArray, spec: RouteSpec, other: str
) -> np.ndarray:
    """Rows of the ragged routes column ``col``, checked to route the same tokens as ``batch``'s routes."""
    rows_b, len_b = _route_rows(col, spec, other)
    len_a = list_lengths(batch.column("routes"))
    if not np.array_equal(len_a, len_b):
        i = int(np.flatnonzero(len_a != len_b)[0])
        raise RouteShapeError(
            f"row {i}: expected {other!r} to route the same {len_a[i]} tokens as 'routes', found {len_b[i]} rows"
        )
    return rows_b


def batch_agreement(
    batch: pa.Table | pa.RecordBatch, other: str, tokens: str = "all"
) -> RouteAgreement:
    """`RouteAgreement` of ``routes`` vs the routes column ``other`` of one table or record batch."""
    spec = route_spec(batch)
    rows_a, _ = flat_routes(batch)
    if other not in batch.schema.names:
        raise SchemaError(f"expected a second routes column {other!r}, found {batch.schema.names}")
    rows_b = _aligned_rows(batch, batch.column(other), spec, other)
    return compare_routes(rows_a, rows_b, spec, select=token_selection(batch, tokens))


def _source_spec(source: Source) -> RouteSpec | None:
    if isinstance(source, pa.Table | pa.RecordBatch):
        return route_spec(source)
    return None


# ============================================================== public API
_Part = TypeVar("_Part", ExpertCounts, RouteAgreement)


def _batch_parts(
    source: Source,
    tokens: str,
    steps: Sequence[int] | None,
    part_of: Callable[[pa.Table | pa.RecordBatch], _Part],
    extra: Sequence[str] = (),
) -> Iterator[tuple[int | None, _Part]]:
    """(step, partial) per batch of ``source``, reading only the columns ``tokens`` and ``extra`` need."""
    _check_subset(tokens)
    for step, batch in _iter_source(source, _columns_for(tokens, extra), steps):
        part = part_of(batch)
        del batch  # not resident while the next step is read
        yield step, part


def _sum_parts(
    parts: Iterator[tuple[int | None, _Part]],
    source: Any,
    spec: RouteSpec | None,
    empty: Callable[[RouteSpec], _Part],
) -> _Part:
    """Sum of the partials; ``empty(spec)`` of the source's spec when there are none."""
    total: _Part | None = None
    for _, part in parts:
        total = part if total is None else total + part
    if total is not None:
        return total
    s = spec or _source_spec(source)
    if s is None:
        raise SchemaError(f"{source}: expected rollout data, found none")
    return empty(s)


def _sum_by_step(parts: Iterator[tuple[int | None, _Part]]) -> dict[int, _Part]:
    """Partials summed per step, ascending; raises `SchemaError` if the source has no steps."""
    out: dict[int, _Part] = {}
    for step, part in parts:
        if step is None:
            raise SchemaError(
                "by step: expected a step=N/ directory or a table with a 'step' column, found neither"
            )
        out[step] = out[step] + part if step in out else part
    return dict(sorted(out.items()))


def expert_counts(
    source: Source, *, tokens: TokenSubset = "all", steps: Sequence[int] | None = None
) -> ExpertCounts:
    """Total `ExpertCounts` of a rollout table, a Parquet file or a ``step=N`` directory (streamed by step)."""
    parts = _batch_parts(source, tokens, steps, lambda batch: batch_counts(batch, tokens))
    return _sum_parts(parts, source, None, ExpertCounts.empty)


def expert_counts_by_step(
    source: Source, *, tokens: TokenSubset = "all", steps: Sequence[int] | None = None
) -> dict[int, ExpertCounts]:
    """`ExpertCounts` per step, ascending: a ``step=N`` directory or a table with a ``step`` column."""
    return _sum_by_step(
        _batch_parts(source, tokens, steps, lambda batch: batch_counts(batch, tokens))
    )


def expert_load(
    source: Source,
    *,
    tokens: TokenSubset = "all",
    steps: Sequence[int] | None = None,
    by_step: bool = False,
) -> pl.DataFrame:
    """Routed-token count per MoE layer and expert: columns ``layer``, ``expert``, ``tokens``.

    ``layer`` is the global layer id (Int32; dense layers are absent),
    ``expert`` the expert id (Int32), ``tokens`` how many selected tokens that
    layer routed to that expert (Int64; zero-count experts included, so each
    layer has ``num_experts`` rows and sums to ``topk × tokens``). Sorted by
    (layer, expert); with ``by_step=True`` a leading ``step`` (Int64) column.
    ``source``: a rollout table, a Parquet file, or a ``step=N`` directory
    (read one step at a time). ``tokens``: see the module docstring.
    """
    if not by_step:
        return expert_counts(source, tokens=tokens, steps=steps).to_polars()
    per = expert_counts_by_step(source, tokens=tokens, steps=steps)
    return stack_steps({s: c.to_polars() for s, c in per.items()})


def stack_steps(frames: Mapping[int, pl.DataFrame]) -> pl.DataFrame:
    """Per-step frames stacked with a leading ``step`` (Int64) column, in mapping order."""
    if not frames:
        raise SchemaError("by step: expected at least one step, found none")
    return pl.concat(
        [f.select(pl.lit(s, dtype=pl.Int64).alias("step"), pl.all()) for s, f in frames.items()],
        how="vertical",
    )


def _agreement_parts(
    a: Any, b: Any, spec: RouteSpec | None, tokens: Any, steps: Sequence[int] | None
) -> Iterator[tuple[int | None, RouteAgreement]]:
    if isinstance(a, pa.Table | pa.RecordBatch) or _is_path(a):
        if isinstance(tokens, np.ndarray):
            raise TypeError(
                "tokens: a bool mask is for numpy inputs; tables and paths take a subset name"
            )
        if isinstance(b, str):
            yield from _batch_parts(
                a, tokens, steps, lambda batch: batch_agreement(batch, b, tokens), (b,)
            )
            return
        _check_subset(tokens)
        if _is_path(a) or steps is not None:
            raise TypeError(
                "route_agreement: with a path or steps=, b must name a routes column of the same files"
            )
        ta = cast("pa.Table | pa.RecordBatch", a)
        sa = route_spec(ta) if spec is None else spec
        rows_a, _ = flat_routes(ta)
        if isinstance(b, pa.Table | pa.RecordBatch):
            if b.num_rows != ta.num_rows or not _same_ids(ta, b):
                raise RouteShapeError(
                    f"expected two tables of the same trajectories in one order, found {ta.num_rows} "
                    f"and {b.num_rows} rows with different trajectory ids"
                )
            rows_b = _aligned_rows(ta, b.column("routes"), sa, "routes of b")
        else:
            rows_b = as_route_rows(b, sa, what="routes b")
        yield None, compare_routes(rows_a, rows_b, sa, select=token_selection(ta, tokens))
        return
    if spec is None:
        arr = np.asarray(a)
        if arr.ndim != 3:
            raise RouteShapeError(f"routes a: expected [rows, L, K], found shape {list(arr.shape)}")
        spec = RouteSpec(num_layers=arr.shape[1], topk=arr.shape[2], num_experts=None)
    select = None
    if isinstance(tokens, np.ndarray):
        select = tokens
    elif tokens != "all":
        raise TypeError(f"tokens={tokens!r} needs a rollout table; numpy inputs take a bool mask")
    yield None, compare_routes(a, b, spec, select=select)


def _same_ids(a: pa.Table | pa.RecordBatch, b: pa.Table | pa.RecordBatch) -> bool:
    if a.num_rows == 0:
        return True
    return bool(pc.all(pc.equal(a.column("trajectory_id"), b.column("trajectory_id"))).as_py())


def route_agreement(
    a: Any,
    b: Any,
    spec: RouteSpec | None = None,
    *,
    tokens: TokenSubset | np.ndarray = "all",
    steps: Sequence[int] | None = None,
) -> RouteAgreement:
    """Agreement between two route sets for the same tokens, order within top-k ignored.

    ``a`` / ``b``: two numpy ``[T, L, K]`` arrays (``spec`` optional, ``tokens``
    an optional bool ``[T]``); a rollout table and another table of the same
    trajectories, an aligned ``[T, L, K]`` array, or the name of a second routes
    column in it (e.g. the trainer router's RECORD-mode routes); or a Parquet
    file / ``step=N`` directory and such a column name (streamed by step).
    Returns exact counts; see `RouteAgreement` for the per-layer fractions and
    `RouteAgreement.summary` for the R3 paper's quantities.
    """
    return _sum_parts(_agreement_parts(a, b, spec, tokens, steps), a, spec, RouteAgreement.empty)


def route_agreement_by_step(
    source: Source, other: str, *, tokens: TokenSubset = "all", steps: Sequence[int] | None = None
) -> dict[int, RouteAgreement]:
    """`RouteAgreement` of ``routes`` vs column ``other`` per step (directory or table with ``step``)."""
    return _sum_by_step(_agreement_parts(source, other, None, tokens, steps))


def agreement_over_steps(results: Mapping[int, RouteAgreement]) -> pl.DataFrame:
    """Long frame ``step``, ``layer``, ``tokens``, ``identical``, ``overlap``, ``differing`` per (step, layer).

    ``differing`` is the step's fraction of tokens that differ on at least one
    layer (the same value on each of the step's rows).
    """
    frames = {
        s: r.per_layer().with_columns(
            pl.lit(r.differing_fraction, dtype=pl.Float64).alias("differing")
        )
        for s, r in sorted(results.items())
    }
    return stack_steps(frames)


# ============================================================== summaries
def _keys(frame: pl.DataFrame | pl.LazyFrame) -> list[str]:
    names = frame.collect_schema().names()
    for need in ("layer", "expert", "tokens"):
        if need not in names:
            raise SchemaError(
                f"expected an expert_load frame (layer, expert, tokens), found columns {names}"
            )
    return ["step", "layer"] if "step" in names else ["layer"]


def load_summary(load: Frame, *, hot_factor: float = 2.0) -> Frame:
    """Per layer (and step): imbalance, entropy, dead and hot experts of an `expert_load` frame.

    Columns: ``[step,] layer``, ``experts``, ``routed`` (sum of ``tokens`` =
    topk × tokens), ``max_over_mean``, ``cv`` (population std / mean),
    ``entropy`` (bits, of the layer's load distribution), ``entropy_norm``
    (entropy / log2(experts); 1 = uniform), ``dead`` (experts with 0 tokens),
    ``hot`` (experts above ``hot_factor`` × mean). NaN where a layer routed nothing.
    """
    keys: list[str] = _keys(load)
    t = pl.col("tokens").cast(pl.Float64)
    p = t / t.sum()
    return (
        load.group_by(keys, maintain_order=True)
        .agg(
            pl.len().cast(pl.Int64).alias("experts"),
            pl.col("tokens").sum().cast(pl.Int64).alias("routed"),
            (t.max() / t.mean()).alias("max_over_mean"),
            (t.std(ddof=0) / t.mean()).alias("cv"),
            (-pl.when(t > 0).then(p * p.log(2)).otherwise(0.0).sum()).alias("entropy"),
            (pl.col("tokens") == 0).sum().cast(pl.Int64).alias("dead"),
            (t > hot_factor * t.mean()).sum().cast(pl.Int64).alias("hot"),
        )
        .with_columns(
            pl.when(pl.col("routed") > 0)
            .then(pl.col("entropy"))
            .otherwise(float("nan"))
            .alias("entropy")
        )
        .with_columns(
            (pl.col("entropy") / pl.col("experts").cast(pl.Float64).log(2)).alias("entropy_norm")
        )
        .sort(keys)
    )


def dead_experts(load: Frame) -> Frame:
    """Rows of ``load`` whose expert received no token: ``[step,] layer, expert``."""
    keys: list[str] = _keys(load)
    return load.filter(pl.col("tokens") == 0).select([*keys, "expert"])


def hot_experts(load: Frame, factor: float = 2.0) -> Frame:
    """Experts loaded above ``factor`` × their layer's mean: ``[step,] layer, expert, tokens, ratio``."""
    keys: list[str] = _keys(load)
    ratio = pl.col("tokens").cast(pl.Float64) / pl.col("tokens").cast(pl.Float64).mean().over(keys)
    return (
        load.with_columns(ratio.alias("ratio"))
        .filter(pl.col("ratio") > factor)
        .select([*keys, "expert", "tokens", "ratio"])
    )


def _drift(joined: Frame, keys: list[str]) -> Frame:
    """Per ``keys`` group of (tokens_a, tokens_b) rows: total variation, Jensen-Shannon (bits), max shift."""
    ta = pl.col("tokens_a").cast(pl.Float64)
    tb = pl.col("tokens_b").cast(pl.Float64)
    p = ta / ta.sum().over(keys)
    q = tb / tb.sum().over(keys)
    framed = joined.with_columns(p.alias("_p"), q.alias("_q")).with_columns(
        ((pl.col("_p") + pl.col("_q")) / 2).alias("_m")
    )

    def kl(x: str) -> pl.Expr:
        return (
            pl.when(pl.col(x) > 0)
            .then(pl.col(x) * (pl.col(x) / pl.col("_m")).log(2))
            .otherwise(0.0)
        )

    return (
        framed.group_by(keys, maintain_order=True)
        .agg(
            (0.5 * (pl.col("_p") - pl.col("_q")).abs().sum()).alias("tv"),
            (0.5 * kl("_p").sum() + 0.5 * kl("_q").sum()).alias("js"),
            (pl.col("_p") - pl.col("_q")).abs().max().alias("max_shift"),
        )
        .sort(keys)
    )


def load_drift(a: pl.DataFrame, b: pl.DataFrame) -> pl.DataFrame:
    """How layer load distributions moved from ``a`` to ``b`` (two `expert_load` frames without ``step``).

    Per ``layer``: ``tv`` (total variation distance of the expert shares, in
    [0, 1]), ``js`` (Jensen-Shannon divergence, bits, in [0, 1]), ``max_shift``
    (largest change of one expert's share). Experts missing on one side count 0.
    """
    for f in (a, b):
        if _keys(f) != ["layer"]:
            raise SchemaError(
                "load_drift: expected expert_load frames without a step column; use drift_over_steps"
            )
    layers_a, layers_b = set(a["layer"].unique().to_list()), set(b["layer"].unique().to_list())
    if layers_a != layers_b:
        raise SchemaError(
            f"load_drift: expected the same layers, found {sorted(layers_a)} and {sorted(layers_b)}"
        )
    joined = (
        a.select("layer", "expert", pl.col("tokens").alias("tokens_a"))
        .join(
            b.select("layer", "expert", pl.col("tokens").alias("tokens_b")),
            on=["layer", "expert"],
            how="full",
            coalesce=True,
        )
        .fill_null(0)
    )
    return _drift(joined, ["layer"])


def drift_over_steps(load: Frame) -> Frame:
    """`load_drift` between each step and the previous one of a by-step `expert_load` frame.

    Columns ``step``, ``prev_step``, ``layer``, ``tv``, ``js``, ``max_shift``; the first step has no row.
    """
    if _keys(load) != ["step", "layer"]:
        raise SchemaError(
            "drift_over_steps: expected an expert_load frame with a step column (by_step=True)"
        )
    steps = load.select(pl.col("step").unique().sort())
    order = steps.with_columns(pl.col("step").shift(-1).alias("next_step")).drop_nulls()
    prev = load.join(order, on="step").select(
        pl.col("next_step").alias("step"),
        pl.col("step").alias("prev_step"),
        "layer",
        "expert",
        pl.col("tokens").alias("tokens_a"),
    )
    cur = load.join(order.select(pl.col("next_step").alias("step")), on="step").select(
        "step", "layer", "expert", pl.col("tokens").alias("tokens_b")
    )
    joined = (
        prev.join(cur, on=["step", "layer", "expert"], how="full", coalesce=True)
        .with_columns(pl.col("tokens_a").fill_null(0), pl.col("tokens_b").fill_null(0))
        .with_columns(pl.col("prev_step").max().over("step"))
    )
    return _drift(joined, ["step", "prev_step", "layer"])


# ================================================================== interop
def to_polars(table: pa.Table) -> pl.DataFrame:
    """A rollout table as a Polars frame without copying (routes: ``List(Array(dtype, (L, K)))``).

    The spec is not carried (Polars has no schema metadata); keep the table or `route_spec` for it.
    """
    return cast(pl.DataFrame, pl.from_arrow(table, rechunk=False))


def routes_torch(table: pa.Table | pa.RecordBatch) -> tuple[torch.Tensor, torch.Tensor]:
    """(routes ``[T, L, K]``, offsets int64 ``[B+1]``) as torch tensors sharing the Arrow buffer (DLPack).

    The routes tensor aliases read-only Arrow memory: do not write to it. A
    multi-chunk routes column is combined first (one copy).
    """
    import torch

    spec = route_spec(table)
    col = table.column("routes")
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    offsets = np.asarray(col.offsets, dtype=np.int64)
    tokens = col.flatten()
    if tokens.null_count:
        raise RouteShapeError(f"expected no null tokens in routes, found {tokens.null_count}")
    leaf = tokens.flatten().flatten()
    if len(leaf) != len(tokens) * spec.num_layers * spec.topk:
        raise RouteShapeError(
            f"expected {len(tokens) * spec.num_layers * spec.topk} expert ids, found {len(leaf)}"
        )
    rows = torch.utils.dlpack.from_dlpack(leaf).view(len(tokens), spec.num_layers, spec.topk)
    return rows, torch.from_numpy((offsets - offsets[0]).copy())


__all__ = [
    "TOKEN_SUBSETS",
    "ExpertCounts",
    "RouteAgreement",
    "TokenSubset",
    "agreement_over_steps",
    "batch_agreement",
    "batch_counts",
    "compare_routes",
    "count_routes",
    "dead_experts",
    "drift_over_steps",
    "expert_counts",
    "expert_counts_by_step",
    "expert_load",
    "hot_experts",
    "load_drift",
    "load_summary",
    "route_agreement",
    "route_agreement_by_step",
    "routes_torch",
    "to_polars",
    "token_selection",
]
