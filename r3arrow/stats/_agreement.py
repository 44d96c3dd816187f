"""Route agreement: exact counts of how two route sets for the same tokens agree.

Order within a top-k row is ignored: two rows agree on a layer when their expert *sets*
are equal, and overlap by ``|A ∩ B|`` (the R3 paper's quantities, ``docs/design.md``).
With numba and a known ``num_experts`` `compare_routes` is one compiled pass; on bad
input it re-runs the numpy reference, which raises the documented error.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable
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
    check_ids,
    check_selection,
    chunks,
    exact_sum,
    map_chunks,
    router_block,
)


@dataclasses.dataclass(frozen=True, eq=False)
class RouteAgreement:
    """Exact agreement counts of two route sets for the same tokens (order within top-k ignored).

    ``identical[i]``: tokens whose top-k *set* on layer ``layers[i]`` is the same in both;
    ``overlap[i]``: sum over tokens of ``|A ∩ B|`` on that layer; ``all_identical``: tokens
    identical on every router layer; ``missing``: selected route rows left out because
    their rollout route never arrived (``routes_missing``, ``docs/fallback.md``), not in
    ``tokens``. Adds (``a + b``, exact: `SchemaError` past int64); fractions are NaN when
    ``tokens == 0``.
    """

    layers: tuple[int, ...]
    topk: int
    tokens: int
    identical: np.ndarray
    overlap: np.ndarray
    all_identical: int
    missing: int = 0

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
            (self.layers, self.topk, self.tokens, self.all_identical, self.missing)
            == (other.layers, other.topk, other.tokens, other.all_identical, other.missing)
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

        def add(name: str) -> np.ndarray:
            return exact_sum(f"RouteAgreement.{name}", getattr(self, name), getattr(other, name))

        return RouteAgreement(
            self.layers,
            self.topk,
            int(add("tokens")),
            add("identical"),
            add("overlap"),
            int(add("all_identical")),
            int(add("missing")),
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
        """Scalars: tokens, identical (layer mean), identical_min, overlap, differing."""
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
            [len(self.layers), self.topk, self.tokens, self.all_identical, self.missing],
            dtype=np.int64,
        )
        return np.concatenate(
            [head, np.asarray(self.layers, np.int64), self.identical, self.overlap]
        )

    @classmethod
    def from_vector(cls, vec: Any) -> RouteAgreement:
        v = np.asarray(vec, dtype=np.int64)
        n = int(v[0])
        if v.size != 5 + 3 * n:
            raise SchemaError(f"RouteAgreement vector: expected {5 + 3 * n} values, found {v.size}")
        return cls(
            tuple(int(x) for x in v[5 : 5 + n]),
            int(v[1]),
            int(v[2]),
            v[5 + n : 5 + 2 * n].copy(),
            v[5 + 2 * n :].copy(),
            int(v[3]),
            int(v[4]),
        )


def compare_routes(
    a: Any, b: Any, spec: RouteSpec, *, select: np.ndarray | None = None
) -> RouteAgreement:
    """Agreement of two aligned route arrays ``[T, L, K]`` (any integer dtypes), router layers.

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
    sel = check_selection(select, x.shape[0])
    nb = compiled()
    if nb is not None and spec.num_experts is not None and _small_ints(x):
        fast = _agree_numba(nb, x, y, spec, spec.num_experts, sel)
        if fast is not None:
            return fast
    layers = list(spec.router_layers)
    pick = None if spec.moe_layers is None else layers
    nl, k = len(layers), spec.topk
    rows = max(1, CHUNK_IDS // (nl * k * 4))  # bool temporaries per id: keep them in cache

    def agree(chunk: Chunk) -> tuple[np.ndarray, np.ndarray, int, int]:
        ba = router_block(x, pick, chunk)
        bb = router_block(y, pick, chunk)
        if ba.shape[0] == 0:
            return np.zeros(nl, np.int64), np.zeros(nl, np.int64), 0, 0
        for block, what in ((ba, "routes a"), (bb, "routes b")):
            check_ids(block, spec.num_experts, layers, what, chunk)
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

    return _summed(spec, map_chunks(agree, list(chunks(x.shape[0], rows, sel))))


def _summed(
    spec: RouteSpec, parts: Iterable[tuple[np.ndarray, np.ndarray, int, int]]
) -> RouteAgreement:
    """The `RouteAgreement` of per-chunk (identical, overlap, all identical, tokens) sums."""
    nl = len(spec.router_layers)
    identical, overlap = np.zeros(nl, np.int64), np.zeros(nl, np.int64)
    all_identical = ntok = 0
    for ident, ov, same, n in parts:
        identical += ident
        overlap += ov
        all_identical += same
        ntok += n
    return RouteAgreement(spec.router_layers, spec.topk, ntok, identical, overlap, all_identical)


def _small_ints(arr: np.ndarray) -> bool:
    """Integer ids of at most 4 bytes (the kernels' types; int64 ids take the numpy path)."""
    return arr.dtype.kind in "iu" and arr.dtype.itemsize <= 4


def _agree_numba(
    nb: ModuleType, x: np.ndarray, y: np.ndarray, spec: RouteSpec, e: int, sel: np.ndarray | None
) -> RouteAgreement | None:
    """`compare_routes` by the numba kernel; None on bad input (the numpy reference raises)."""
    if not _small_ints(y):
        return None
    pick = np.asarray(spec.router_layers, dtype=np.int64)
    nl = pick.size
    rows = max(1, NUMBA_CHUNK_IDS // max(1, x.shape[1] * spec.topk))
    sel_b = nb.selection_bytes(sel)

    def agree(chunk: Chunk) -> tuple[np.ndarray, np.ndarray, int, int, int]:
        assert isinstance(chunk, slice)
        ident, ov = np.zeros(nl, np.int64), np.zeros(nl, np.int64)
        part_sel = sel_b if sel is None else sel_b[chunk]
        same, ntok, bad = nb.agree(x[chunk], y[chunk], part_sel, pick, e, ident, ov)
        return ident, ov, int(same), int(ntok), int(bad)

    results = list(map_chunks(agree, list(chunks(x.shape[0], rows, None))))
    if any(bad for *_, bad in results):
        return None
    return _summed(spec, (r[:4] for r in results))


__all__ = ["RouteAgreement", "compare_routes"]
