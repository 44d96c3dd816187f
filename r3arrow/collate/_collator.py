"""`MegatronCollator`: a rollout table → one `Microbatch` for this rank's routers.

Checks the table, lays it out (`_layout`), and fills one pooled, 64-byte aligned buffer in a
single pass over the segments (at most two per trajectory); routes by the fused pass of
`r3arrow.ids.gather_router_ids` once per chunk of the routes column, split over threads when
large; for a CUDA device the compact ids are shipped from page-locked memory.
``docs/collation.md``.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import sys
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple, cast

import numpy as np
import pyarrow as pa
import torch

from r3arrow._checks import check_int, check_positive_int
from r3arrow._routes import validate_layers
from r3arrow._schema import (
    MISSING_KEY,
    ROUTE_LAYERS_KEY,
    ROUTES_MISSING,
    list_lengths,
    missing_routes,
    trajectory_id_at,
)
from r3arrow._typing import ArrowArray
from r3arrow._validated import is_validated
from r3arrow.collate._layout import _Layout, _layout, alignment_multiple
from r3arrow.collate._microbatch import Microbatch
from r3arrow.errors import (
    DuplicateExpertError,
    ExpertRangeError,
    R3ArrowError,
    RouteShapeError,
    SchemaError,
)
from r3arrow.ids import check_routes, gather_router_ids
from r3arrow.microbatch import is_padding_table, split_microbatches
from r3arrow.spec import RouteSpec
from r3arrow.table import flat_routes, route_layers, route_spec, validate_rollouts

#: Output bytes from which route copies are split over worker threads.
_PARALLEL_BYTES = 8 << 20

#: torch dtype the compact ids travel as, by itemsize (bit patterns; widened on the device).
_SHIP_DTYPE: dict[int, np.dtype[Any]] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.int16),
    4: np.dtype(np.int32),
}
_TOKEN_COLUMNS = ("prompt_ids", "response_ids", "loss_mask")


_ALIGN = 64


class _BufferPool:
    """Byte buffers reused once no array or tensor views them (their refcount), thread-safe."""

    def __init__(self, max_buffers: int = 32) -> None:
        self.max_buffers = max_buffers
        self._buffers: list[np.ndarray] = []
        self._lock = threading.Lock()

    def _free(self) -> list[bool]:
        # References: the list slot and getrefcount's argument.
        return [sys.getrefcount(self._buffers[i]) <= 2 for i in range(len(self._buffers))]

    def take(self, nbytes: int) -> np.ndarray:
        nbytes = max(int(nbytes), 1)
        with self._lock:
            free = self._free()
            fits = [i for i, f in enumerate(free) if f and self._buffers[i].nbytes >= nbytes]
            if fits:
                return self._buffers[min(fits, key=lambda i: self._buffers[i].nbytes)]
            # free buffers that are too small go rather than stay
            self._buffers = [b for b, f in zip(self._buffers, free, strict=True) if not f]
            buf = np.empty(nbytes + nbytes // 8, dtype=np.uint8)  # headroom for the next batch
            if len(self._buffers) < self.max_buffers:
                self._buffers.append(buf)
            return buf

    def clear(self) -> None:
        """Drop every free buffer."""
        with self._lock:
            free = self._free()
            self._buffers = [b for b, f in zip(self._buffers, free, strict=True) if not f]

    def __len__(self) -> int:
        return len(self._buffers)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._buffers)


def _carve(
    parts: Sequence[tuple[tuple[int, ...], Any]], pool: _BufferPool | None
) -> list[np.ndarray]:
    """One ``shape``/``dtype`` view per part, 64-byte aligned, out of one (pooled) buffer."""
    sizes = [math.prod(shape) * np.dtype(dtype).itemsize for shape, dtype in parts]
    starts = [0, *itertools.accumulate(-(-n // _ALIGN) * _ALIGN for n in sizes)]
    buf = pool.take(starts[-1]) if pool is not None else np.empty(starts[-1], np.uint8)
    return [
        buf[at : at + n].view(dtype).reshape(shape)
        for (shape, dtype), at, n in zip(parts, starts[:-1], sizes, strict=True)
    ]


class _PinnedStage:
    """A reusable page-locked buffer for ids shipped to CUDA; `take` first waits for the last
    copy out of it (`ship`), so the next collation never overwrites bytes in flight."""

    def __init__(self) -> None:
        self._buf: torch.Tensor | None = None
        self._event: Any = None

    def take(self, shape: tuple[int, ...], dtype: np.dtype[Any]) -> np.ndarray:
        """A writable ``shape``/``dtype`` numpy view of the pinned buffer (grown as needed)."""
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        n = max(1, math.prod(shape) * dtype.itemsize)
        if self._buf is None or int(self._buf.numel()) < n:
            self._buf = torch.empty(n + n // 8, dtype=torch.uint8, pin_memory=True)
        arr: np.ndarray = self._buf[:n].numpy().view(dtype).reshape(shape)
        return arr

    def ship(self, nbytes: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The first ``nbytes`` as ``dtype``, copied to ``device`` on its current stream."""
        assert self._buf is not None
        shipped = self._buf[:nbytes].view(dtype).to(device, non_blocking=True)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record(torch.cuda.current_stream(device))
        self._event = event
        return shipped


_Span = tuple[int, int, int, int]  # positions [p0, p1) x columns [c0, c1), as gather_router_ids


def _put(
    out: np.ndarray,
    at: int,
    a: int,
    b: int,
    p: int,
    prompt: np.ndarray,
    po: int,
    resp: np.ndarray,
    ro: int,
) -> None:
    """out[at : at+b-a] = tokens [a, b) of a sequence whose first ``p`` tokens are its prompt."""
    if a < p:
        e = min(b, p)
        out[at : at + e - a] = prompt[po + a : po + e]
    if b > p:
        s = max(a, p)
        out[at + s - a : at + b - a] = resp[ro + s - p : ro + b - p]


class _RouteSource(NamedTuple):
    """A record batch's compact routes ``[T, L, K]``, their offsets and its first row."""

    routes: np.ndarray
    offsets: np.ndarray
    row0: int
    batch: pa.RecordBatch


def _located(
    src: _RouteSource,
    exc: ExpertRangeError | DuplicateExpertError,
    layer_index: np.ndarray,
    num_experts: int | None,
    layers: Sequence[int],
) -> R3ArrowError:
    """``exc`` (its token: a route row of ``src``) restated with ``row`` (table row),
    ``trajectory_id`` and ``token`` within the trajectory."""
    if exc.token is None:
        return exc
    i = int(np.searchsorted(src.offsets, exc.token, side="right")) - 1
    g = src.row0 + i
    a, b = int(src.offsets[i]), int(src.offsets[i + 1])
    try:  # the reference check on this trajectory: its token positions and layers
        check_routes(
            src.routes[a:b][:, layer_index],
            num_experts=num_experts,
            layer_ids=layers,
            what=f"routes of row {g}",
        )
    except (ExpertRangeError, DuplicateExpertError) as found:
        tid = trajectory_id_at(src.batch, i)
        return type(found)(
            found.message, trajectory_id=tid, row=g, token=found.token, layer=found.layer
        )
    return exc  # pragma: no cover - the same rows failed the fused pass


class _Tokens(NamedTuple):
    """The token arrays of a microbatch (its field names), ``[C, P]`` each (packed: C = 1)."""

    input_ids: np.ndarray
    position_ids: np.ndarray
    labels: np.ndarray
    loss_mask: np.ndarray
    label_mask: np.ndarray
    padding_mask: np.ndarray


_TOKEN_DTYPES = (np.int64, np.int64, np.int64, np.float32, np.float32, np.bool_)


def _route_counts(
    pad: np.ndarray, fallback: np.ndarray | None, n_layers: int, par: Parallelism
) -> tuple[int, int]:
    """(fallback token routes, token routes) of this rank's routers: marked and all
    non-padding tokens of their slice (``s * b + b_idx`` order, SP: this TP rank's share),
    times ``n_layers``."""
    if n_layers == 0:
        return 0, 0
    positions = pad.shape[1]
    lo, hi = 0, positions
    if par.sequence_parallel:
        share = positions // par.tp_size
        lo, hi = par.tp_rank * share, (par.tp_rank + 1) * share
    # [C, P] positions lo..hi: the same tokens as the flat slice, counted in any order
    tokens = int(pad[:, lo:hi].size - np.count_nonzero(pad[:, lo:hi]))
    marked = 0 if fallback is None else int(np.count_nonzero(fallback[:, lo:hi]))
    return marked * n_layers, tokens * n_layers


def _flat_list(arr: ArrowArray) -> tuple[np.ndarray, np.ndarray]:
    """(values, offsets from 0) of a list array, zero-copy where Arrow allows it."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks() if arr.num_chunks != 1 else arr.chunk(0)
    lists = cast("pa.ListArray[Any] | pa.LargeListArray[Any]", arr)
    offsets = np.asarray(lists.offsets, dtype=np.int64)
    values = lists.flatten().to_numpy(zero_copy_only=False)
    return np.asarray(values), offsets - offsets[0]


@dataclasses.dataclass(frozen=True)
class Parallelism:
    """This rank's place in Megatron's tensor and context parallelism (a collator's ``parallel``).

    ``tp_size``/``tp_rank``, ``cp_size``/``cp_rank``: positive sizes, ranks in
    ``[0, size)``; ``sequence_parallel``: each TP rank's routers see its slice of the
    positions. Anything else raises `ValueError`/`TypeError`.
    """

    tp_size: int = 1
    tp_rank: int = 0
    cp_size: int = 1
    cp_rank: int = 0
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        tp = check_positive_int(self.tp_size, "tp_size")
        check_int(self.tp_rank, "tp_rank", minimum=0, maximum=tp - 1)
        cp = check_positive_int(self.cp_size, "cp_size")
        check_int(self.cp_rank, "cp_rank", minimum=0, maximum=cp - 1)
        if not isinstance(self.sequence_parallel, bool):
            raise TypeError(f"sequence_parallel: expected a bool, found {self.sequence_parallel!r}")


#: No tensor or context parallelism.
_SINGLE = Parallelism()


class MegatronCollator:
    """Rollout table (or record batch) → `Microbatch` for this rank's routers.

    ``layers``: global ids of this stage's routers in Megatron's build order (default:
    every router layer of ``spec``; ``[]`` for a stage of dense layers only: no routes); a
    layer-projected table must hold them all.
    ``parallel``: this rank's `Parallelism`. ``align`` combines by lcm with the TP/CP/FP8
    multiples (`alignment_multiple`) to round the row length (unpacked) or every sequence
    (packed). ``pad_token_id`` fills ``input_ids``/``labels`` at padding. ``validate``
    runs the rollout-table checks and the id checks of the fused pass (the microbatch is
    then marked so `install_replay` does not scan again); shapes and lengths are always
    checked. ``reuse_buffers`` recycles output memory once nothing references it.
    ``num_threads`` (default: torch's intra-op threads, at most 8) split large route
    copies. ``device`` (e.g. ``"cuda"``): the ids travel compact (pinned for CUDA,
    ``non_blocking``), are widened there and every tensor is returned there; None writes
    int32 on the host. ``spec=None``: R3 off (``docs/design.md`` §5, *R3 off*; ``layers``
    must be None). A DP padding table collates to a microbatch with ``is_padding`` set.
    ``column``: the routes-typed column the replay targets come from (default
    ``"routes"``, the engine's; ``"train_routes"``: R2, the routes a trainer forward
    recorded, ``docs/train-routes.md``); only ``"routes"`` carries ``routes_missing``
    marks (`Microbatch.fallback_mask`, ``docs/fallback.md``).

    Raises `TypeError`/`ValueError` for argument misuse (``spec`` not a `RouteSpec` or
    None, layers not distinct ints or given with R3 off, ``column`` not a str or not
    ``"routes"`` with R3 off) and `RouteShapeError` for layers
    that are not router layers of ``spec``. For a Megatron rank: ``collator_for``.
    """

    def __init__(
        self,
        spec: RouteSpec | None,
        layers: Sequence[int] | None = None,
        *,
        packed: bool = False,
        align: int = 1,
        parallel: Parallelism = _SINGLE,
        fp8: bool = False,
        pad_token_id: int = 0,
        validate: bool = True,
        reuse_buffers: bool = True,
        num_threads: int | None = None,
        device: torch.device | str | None = None,
        column: str = "routes",
    ) -> None:
        if not isinstance(column, str):
            raise TypeError(f"column: expected a str, found {type(column).__name__}")
        if spec is None and column != "routes":
            raise ValueError(
                f"column: expected 'routes' with R3 off (spec=None: no replay targets), found "
                f"{column!r}"
            )
        self.column = column
        if spec is not None and not isinstance(spec, RouteSpec):
            raise TypeError(
                f"spec: expected a RouteSpec (or None for R3 off), found {type(spec).__name__}"
            )
        self.spec = spec
        if spec is None:
            if layers is not None:
                raise ValueError(
                    f"layers: expected None with R3 off (spec=None), found {list(layers)}"
                )
            chosen: list[int] = []
        elif layers is None:
            chosen = list(spec.router_layers)
        else:
            chosen = validate_layers([check_int(i, "layers") for i in layers], spec)
        if len(set(chosen)) != len(chosen):
            raise ValueError(f"layers: expected distinct router layers, found {chosen}")
        self.layers: tuple[int, ...] = tuple(chosen)
        if not isinstance(parallel, Parallelism):
            raise TypeError(f"parallel: expected a Parallelism, found {type(parallel).__name__}")
        self.parallel = parallel
        self.multiple = alignment_multiple(
            align=align, tp_size=parallel.tp_size, cp_size=parallel.cp_size, fp8=fp8
        )
        self.packed = bool(packed)
        self.align = int(align)
        self.fp8 = bool(fp8)
        self.pad_token_id = check_int(pad_token_id, "pad_token_id")
        self.validate = bool(validate)
        self._pool = _BufferPool() if reuse_buffers else None
        threads = min(8, torch.get_num_threads()) if num_threads is None else num_threads
        self.num_threads = check_positive_int(threads, "num_threads")
        self._executor: ThreadPoolExecutor | None = None
        self.device = None if device is None else torch.device(device)
        cuda = self.device is not None and self.device.type != "cpu"
        self._pinned = _PinnedStage() if cuda else None
        self._arange = np.arange(0, dtype=np.int64)

    def __call__(self, table: pa.Table | pa.RecordBatch) -> Microbatch:
        """Collate every trajectory of ``table`` into one microbatch (see `Microbatch`).

        Raises `TypeError` unless ``table`` is a ``pa.Table``/``pa.RecordBatch``; `SchemaError`
        for a table off the rollout schema or another spec (or without routes while the
        collator has a spec), an empty table, or a row whose lengths disagree (``row`` set);
        the rollout checks' errors when ``validate`` is on (R3 off: lengths only); with
        ``column`` other than ``"routes"``, `SchemaError` naming it when the table lacks it
        or it is not of the table's routes type. Route rows marked in ``routes_missing``
        keep their placeholders in `Microbatch.layer_major`; `Microbatch.fallback_mask`
        says which tokens they are (bad marks raise as `r3arrow.table.validate_rollouts`).
        """
        if self.column != "routes" and isinstance(table, pa.Table | pa.RecordBatch):
            table = self._use_column(table)
        batches, spec, layer_index = self._check_table(table)
        padding = is_padding_table(table)
        marked = spec is not None and ROUTES_MISSING in table.schema.names

        def lengths(name: str) -> np.ndarray:
            return np.concatenate([list_lengths(b.column(name)) for b in batches])

        plen, rlen = lengths("prompt_ids"), lengths("response_ids")
        n = plen + rlen
        if padding:
            cap = np.zeros_like(n)  # every position is padding
        elif spec is None:
            cap = n  # R3 off: routers route every real token freely
        else:
            cap = lengths("routes")
        mlen = lengths("loss_mask")
        bad = np.flatnonzero((mlen != rlen) | (cap > n) | (n < 1))
        if bad.size:
            i = int(bad[0])
            raise SchemaError(
                f"row {i}: expected at least one token, a loss_mask over the {rlen[i]} response "
                f"tokens and at most {n[i]} route rows; found {n[i]} tokens, loss_mask of "
                f"{mlen[i]}, {cap[i]} route rows",
                row=i,
            )
        par = self.parallel
        lay = _layout(
            n, packed=self.packed, multiple=self.multiple, cp_size=par.cp_size, cp_rank=par.cp_rank
        )
        # R3 off: an empty replay buffer, never exposed (Microbatch.layer_major is None).
        k, n_local = (spec.topk, len(self.layers)) if spec is not None else (1, 0)
        cp = par.cp_size > 1
        lm_shape = (n_local, lay.positions, lay.columns, k)
        # With a device the replay buffer is not the pool's: it stays compact on the host
        # (pinned for CUDA), is shipped as is and widened to int32 on the device.
        parts: list[tuple[tuple[int, ...], Any]] = [
            ((n_local if self.device is None else 0, *lm_shape[1:]), np.int32),
            *(((lay.columns, lay.positions), dt) for dt in _TOKEN_DTYPES),
        ]
        if cp:
            parts.append(((lay.positions,), np.int64))
        if marked:
            parts.append(((lay.columns, lay.positions), np.bool_))
        lm, *arrays = _carve(parts, self._pool)
        out = _Tokens(*arrays[:6])
        tok_index = arrays[6] if cp else None
        fallback = arrays[-1] if marked else None
        marks = None
        if fallback is not None:
            fallback.fill(False)
            if not padding:  # a padding table has no route rows: nothing is marked
                marks = []
                for b in batches:
                    got = missing_routes(b)
                    assert got is not None  # the column is there
                    marks.append(got)
        if self.device is not None and spec is not None:
            compact = np.dtype(spec.dtype)
            if self._pinned is not None:
                lm = self._pinned.take(lm_shape, compact)
            else:
                lm = np.empty(lm_shape, dtype=compact)
        self._blank(out)
        need = lay.max_seqlen if not cp else int(lay.seg_global.max() + lay.seg_len.max())
        if self._arange.shape[0] < need:
            self._arange = np.arange(max(need, 2 * self._arange.shape[0]), dtype=np.int64)
        experts = spec.num_experts if spec is not None else None
        self._write(
            batches, layer_index, experts, lay, plen, n, cap, lm, out, tok_index, marks, fallback
        )
        if padding:  # no real token in a padding microbatch
            self._blank(out)
        fallback_routes, token_routes = _route_counts(
            out.padding_mask, fallback, len(self.layers), par
        )

        def t32(a: np.ndarray | None) -> torch.Tensor | None:
            return None if a is None else torch.from_numpy(a.astype(np.int32))

        replay = self._widen(lm) if spec is not None else None
        tensors: dict[str, Any] = {f: torch.from_numpy(a) for f, a in out._asdict().items()}
        mb = Microbatch(
            spec=spec,
            layers=self.layers,
            packed=self.packed,
            **tensors,
            cu_seqlens=t32(lay.cu_seqlens),
            cu_seqlens_padded=t32(lay.cu_seqlens_padded),
            max_seqlen=lay.max_seqlen,
            seq_lens=n,
            captured=cap,
            token_index=None if tok_index is None else torch.from_numpy(tok_index),
            **dataclasses.asdict(par),
            layer_major=replay,
            fallback_mask=None if fallback is None else torch.from_numpy(fallback),
            fallback_routes=fallback_routes,
            token_routes=token_routes,
            is_padding=padding,
            validated_version=(
                int(replay._version) if replay is not None and self.validate else None
            ),
        )
        return mb if self.device is None else mb.to(self.device, non_blocking=True)

    def split(
        self,
        table: pa.Table,
        *,
        max_tokens: int | None = None,
        num_microbatches: int | None = None,
        dp_size: int = 1,
        dp_rank: int | None = None,
    ) -> list[pa.Table]:
        """`split_microbatches` with this collator's ``multiple`` and ``packed``."""
        return split_microbatches(
            table,
            max_tokens=max_tokens,
            num_microbatches=num_microbatches,
            multiple=self.multiple,
            packed=self.packed,
            dp_size=dp_size,
            dp_rank=dp_rank,
        )

    def release_buffers(self) -> None:
        """Free pooled output buffers that no microbatch uses any more."""
        if self._pool is not None:
            self._pool.clear()

    @property
    def pooled_bytes(self) -> int:
        return 0 if self._pool is None else self._pool.nbytes

    def _use_column(self, table: pa.Table | pa.RecordBatch) -> pa.Table | pa.RecordBatch:
        """``table`` with routes column `column` as its ``routes`` (zero-copy), the engine's
        ``routes`` and its ``routes_missing`` marks dropped: a recorded column holds a
        route for every captured token."""
        name, names = self.column, table.schema.names
        if name not in names:
            raise SchemaError(
                f"expected the routes column {name!r} (MegatronCollator(column={name!r})), found "
                f"columns {names}"
            )
        typ = table.schema.field(name).type
        want = table.schema.field("routes").type if "routes" in names else None
        if want is None:
            want = route_spec(table).routes_type
        if typ != want:
            raise SchemaError(
                f"column {name!r}: expected a routes column of the table's routes type "
                f"{want}, found {typ}"
            )
        keep = [c for c in names if c not in ("routes", ROUTES_MISSING)]
        meta = {k: v for k, v in (table.schema.metadata or {}).items() if k != MISSING_KEY}
        cols: Any = [table.column(c) for c in keep]
        out_names = ["routes" if c == name else c for c in keep]
        return type(table).from_arrays(cols, names=out_names, metadata=meta)

    def _check_table(
        self, table: pa.Table | pa.RecordBatch
    ) -> tuple[list[pa.RecordBatch], RouteSpec | None, np.ndarray]:
        """(non-empty record batches, the microbatch's spec, route row of each layer)."""
        if not isinstance(table, pa.Table | pa.RecordBatch):
            raise TypeError(
                f"table: expected a pyarrow Table or RecordBatch, found {type(table).__name__}"
            )
        for name in _TOKEN_COLUMNS:
            if name not in table.schema.names:
                raise SchemaError(f"expected column {name!r}, found columns {table.schema.names}")
        if table.num_rows == 0:
            raise SchemaError("expected at least one trajectory, found an empty table")
        chunks = table.to_batches() if isinstance(table, pa.Table) else [table]
        batches = [b for b in chunks if b.num_rows]
        if self.spec is None:
            # R3 off: token columns must be integer lists even without validation.
            for name in _TOKEN_COLUMNS:
                typ = table.schema.field(name).type
                if not (
                    (pa.types.is_list(typ) or pa.types.is_large_list(typ))
                    and pa.types.is_integer(typ.value_type)
                ):
                    raise SchemaError(f"column {name!r}: expected a list of integers, found {typ}")
            if self.validate and not is_validated(table):
                validate_rollouts(table)  # R3-off rules (and the routes' if a column is there)
            return batches, None, np.zeros(0, dtype=np.int64)
        if "routes" not in table.schema.names:
            raise SchemaError(
                f"expected column 'routes' (this collator replays routes of spec {self.spec}), "
                f"found columns {table.schema.names}; collate a table without routes with "
                f"MegatronCollator(spec=None) (R3 off)"
            )
        full = self.validate and not is_validated(table)
        spec = validate_rollouts(table, require_routes=True) if full else route_spec(table)
        projected = ROUTE_LAYERS_KEY in (table.schema.metadata or {})
        if projected:  # holds a subset of the layers, which must include ours, as routers
            present = route_layers(table)
            where = {g: i for i, g in enumerate(present)}
            if missing := [g for g in self.layers if g not in where]:
                raise RouteShapeError(
                    f"routes: expected global layers {list(self.layers)} (this collator's "
                    f"routers), found a table holding layers {list(present)}; missing "
                    f"{missing} (read the table with layers= including them)"
                )
            layer_index = np.asarray([where[g] for g in self.layers], dtype=np.int64)
            local = set(spec.router_layers)
            dense = [
                g for g, i in zip(self.layers, layer_index.tolist(), strict=True) if i not in local
            ]
            if spec.topk != self.spec.topk or dense:
                raise SchemaError(
                    f"routes: expected top-k {self.spec.topk} with router layers "
                    f"{list(self.layers)}, found a projected table of layers {list(present)}, "
                    f"top-k {spec.topk}, where layers {dense} are not router layers"
                )
        elif not self.spec.same_shape(spec):
            raise SchemaError(
                f"routes: expected [L={self.spec.num_layers}, K={self.spec.topk}] with router "
                f"layers {list(self.spec.router_layers)}, found [L={spec.num_layers}, "
                f"K={spec.topk}] with router layers {list(spec.router_layers)}"
            )
        else:
            layer_index = np.asarray(self.layers, dtype=np.int64)
        experts = spec.num_experts if spec.num_experts is not None else self.spec.num_experts
        if self.spec.num_experts not in (None, experts):
            raise SchemaError(
                f"num_experts: expected {self.spec.num_experts}, found {spec.num_experts}"
            )
        if projected or spec.num_experts is None:  # projected: this collator's routers
            spec = dataclasses.replace(self.spec if projected else spec, num_experts=experts)
        return batches, spec, layer_index

    def _blank(self, out: _Tokens) -> None:
        out.input_ids.fill(self.pad_token_id)
        out.labels.fill(self.pad_token_id)
        out.loss_mask.fill(0)
        out.label_mask.fill(0)

    def _widen(self, lm: np.ndarray) -> torch.Tensor:
        """The replay buffer as int32: itself on the host, else shipped compact and widened."""
        if self.device is None:
            return torch.from_numpy(lm)
        host = torch.from_numpy(lm.view(_SHIP_DTYPE[lm.dtype.itemsize]))
        if self._pinned is not None:  # the same bytes, pinned
            shipped = self._pinned.ship(lm.nbytes, host.dtype, self.device)
        else:
            shipped = host.to(self.device, non_blocking=True)
        if lm.dtype == np.dtype(np.int32):
            return shipped
        wide = shipped.to(torch.int32)
        # uint16 travels as int16 (torch's unsigned 16-bit support is partial): undo the sign.
        return wide & 0xFFFF if lm.dtype == np.dtype(np.uint16) else wide

    def _write(
        self,
        batches: list[pa.RecordBatch],
        layer_index: np.ndarray,
        num_experts: int | None,
        lay: _Layout,
        plen: np.ndarray,
        n: np.ndarray,
        cap: np.ndarray,
        lm: np.ndarray,
        out: _Tokens,
        tok_index: np.ndarray | None,
        marks: list[np.ndarray] | None,
        fallback: np.ndarray | None,
    ) -> None:
        """One pass over the segments (≤ 2 per trajectory): slices, no per-token work; then
        the fused pass over the routes. ``marks``: each batch's flat ``routes_missing``,
        copied into ``fallback`` (``[C, P]``) where the route rows land."""
        ar = self._arange
        ids, pos, labels, loss, lab_mask, pad = out
        r3 = self.spec is not None and lm.shape[0] > 0
        # Per-segment clipped counts, vectorised: tokens, next tokens, captured route rows.
        st, ln, tr = lay.seg_start, lay.seg_len, lay.seg_traj
        cnt_tok = np.clip(n[tr] - st, 0, ln)
        cnt_lab = np.clip(n[tr] - 1 - st, 0, ln)
        cnt_rt = np.clip(cap[tr] - st, 0, ln)
        seg_rows = np.split(
            np.arange(tr.shape[0]),
            np.searchsorted(tr, np.cumsum([b.num_rows for b in batches])[:-1]),
        )
        seg_cols = lay.seg_col.tolist()
        row0 = 0
        # Routes: the source row of every output position (-1: dummy row), one route source
        # per record batch (a chunk of the routes column, never joined), its output span cut
        # into a piece per worker thread when large.
        pos_row = np.empty((lay.positions, lay.columns), dtype=np.int64) if r3 else None
        workers = self.num_threads if lm.size * 4 >= _PARALLEL_BYTES else 1
        pieces: list[tuple[_RouteSource, _Span]] = []
        for bi, (batch, segs) in enumerate(zip(batches, seg_rows, strict=True)):
            prompt, p_off = _flat_list(batch.column("prompt_ids"))
            resp, r_off = _flat_list(batch.column("response_ids"))
            mask, _ = _flat_list(batch.column("loss_mask"))
            if marks is not None:  # the batch's marks and their row offsets
                b_marks = marks[bi]
                m_off = np.zeros(batch.num_rows + 1, dtype=np.int64)
                np.cumsum(cap[row0 : row0 + batch.num_rows], out=m_off[1:])
            if r3:
                routes, rt_off = flat_routes(batch)
                src = _RouteSource(routes, rt_off, row0, batch)
                at0 = lay.seg_at[segs]
                if self.packed:  # the positions of its segments, in the one column
                    p_lo, p_hi, c_lo, c_hi = int(at0.min()), int((at0 + ln[segs]).max()), 0, 1
                else:  # every position of its rows
                    p_lo, p_hi, c_lo, c_hi = 0, lay.positions, row0, row0 + batch.num_rows
                per = max(1, -(-(p_hi - p_lo) // workers))
                pieces += [
                    (src, (p0, min(p_hi, p0 + per), c_lo, c_hi)) for p0 in range(p_lo, p_hi, per)
                ]
            for s in segs.tolist():
                g = int(tr[s])
                i = g - row0
                # row: the column (0 packed, the trajectory unpacked)
                a, length, at, row = int(st[s]), int(ln[s]), int(lay.seg_at[s]), seg_cols[s]
                p = int(plen[g])
                po, ro = int(p_off[i]), int(r_off[i])
                nt, nl, nr = int(cnt_tok[s]), int(cnt_lab[s]), int(cnt_rt[s])
                # tokens [a, a+nt) and next tokens [a+1, a+1+nl)
                for dst, first, count in ((ids, a, nt), (labels, a + 1, nl)):
                    if count:
                        _put(dst[row], at, first, first + count, p, prompt, po, resp, ro)
                for dst, first, count in ((loss, a, nt), (lab_mask, a + 1, nl)):
                    lo = max(first, p)
                    if first + count > lo:
                        dst[row, at + lo - first : at + count] = mask[
                            ro + lo - p : ro + first + count - p
                        ]
                pos[row, at : at + length] = ar[a : a + length]
                pad[row, at : at + nr] = False
                pad[row, at + nr : at + length] = True
                if marks is not None and fallback is not None and nr:
                    m0 = int(m_off[i]) + a
                    fallback[row, at : at + nr] = b_marks[m0 : m0 + nr]
                if pos_row is not None:
                    np.add(ar[a : a + nr], int(rt_off[i]), out=pos_row[at : at + nr, row])
                    pos_row[at + nr : at + length, row] = -1
                if tok_index is not None and (self.packed or row == 0):
                    g0 = int(lay.seg_global[s])
                    tok_index[at : at + length] = ar[g0 : g0 + length]
            row0 += batch.num_rows
        if pos_row is None:
            return

        def gather(share: list[tuple[_RouteSource, _Span]]) -> None:  # one worker's share
            for src, span in share:
                try:
                    gather_router_ids(
                        src.routes,
                        layer_index,
                        pos_row,
                        lm,
                        num_experts,
                        self.layers,
                        span=span,
                        check=self.validate,
                    )
                except (ExpertRangeError, DuplicateExpertError) as exc:
                    raise _located(src, exc, layer_index, num_experts, self.layers) from None

        if workers == 1:
            gather(pieces)
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                max_workers=self.num_threads, thread_name_prefix="r3arrow-collate"
            )
        futures = [self._executor.submit(gather, pieces[w::workers]) for w in range(workers)]
        for f in futures:
            f.result()
