"""`MegatronCollator`: a rollout table → one `Microbatch` for this rank's routers.

Checks the table, lays it out (`_layout`), and fills one pooled buffer in a single pass
over the segments (at most two per trajectory); routes by the fused pass per routes chunk
(`_kernels`), split over threads when large. ``docs/collation.md``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple, cast

import numpy as np
import pyarrow as pa
import torch

from r3arrow._checks import check_int, check_positive_int
from r3arrow._routes import validate_layers
from r3arrow._schema import ROUTE_LAYERS_KEY, list_lengths
from r3arrow._typing import ArrowArray
from r3arrow._validated import is_validated
from r3arrow.collate._buffers import _Arena, _BufferPool, _PinnedStage
from r3arrow.collate._kernels import _put, _RouteSource, _run_gathers
from r3arrow.collate._layout import _Layout, _layout, alignment_multiple, layer_positions
from r3arrow.collate._microbatch import Microbatch
from r3arrow.errors import SchemaError
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


class _Tokens(NamedTuple):
    """The token arrays of a microbatch (its field names), ``[C, P]`` each (packed: C = 1)."""

    input_ids: np.ndarray
    position_ids: np.ndarray
    labels: np.ndarray
    loss_mask: np.ndarray
    label_mask: np.ndarray
    padding_mask: np.ndarray


_TOKEN_DTYPES = (np.int64, np.int64, np.int64, np.float32, np.float32, np.bool_)


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

    Raises `TypeError`/`ValueError` for argument misuse (``spec`` not a `RouteSpec` or
    None, layers not distinct ints or given with R3 off) and `RouteShapeError` for layers
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
    ) -> None:
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
        self._pinned = _PinnedStage() if self.device is not None else None
        self._arange = np.arange(0, dtype=np.int64)

    def __call__(self, table: pa.Table | pa.RecordBatch) -> Microbatch:
        """Collate every trajectory of ``table`` into one microbatch (see `Microbatch`).

        Raises `TypeError` unless ``table`` is a ``pa.Table``/``pa.RecordBatch``; `SchemaError`
        for a table off the rollout schema or another spec (or without routes while the
        collator has a spec), an empty table, or a row whose lengths disagree (``row`` set);
        the rollout checks' errors when ``validate`` is on (R3 off: lengths only).
        """
        batches, spec, layer_index = self._check_table(table)
        padding = is_padding_table(table)

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
        lay = _layout(
            n,
            packed=self.packed,
            multiple=self.multiple,
            cp_size=self.parallel.cp_size,
            cp_rank=self.parallel.cp_rank,
        )
        return self._fill(batches, spec, layer_index, lay, plen, n, cap, padding)

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
            layer_index = layer_positions(present, self.layers)
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
        if None not in (self.spec.num_experts, spec.num_experts) and (
            self.spec.num_experts != spec.num_experts
        ):
            raise SchemaError(
                f"num_experts: expected {self.spec.num_experts}, found {spec.num_experts}"
            )
        if projected:  # the microbatch describes this collator's routers, not the slice
            experts = spec.num_experts if spec.num_experts is not None else self.spec.num_experts
            spec = dataclasses.replace(self.spec, num_experts=experts)
        return batches, spec, layer_index

    def _blank(self, out: _Tokens) -> None:
        out.input_ids.fill(self.pad_token_id)
        out.labels.fill(self.pad_token_id)
        out.loss_mask.fill(0)
        out.label_mask.fill(0)

    def _fill(
        self,
        batches: list[pa.RecordBatch],
        spec: RouteSpec | None,
        layer_index: np.ndarray,
        lay: _Layout,
        plen: np.ndarray,
        n: np.ndarray,
        cap: np.ndarray,
        padding: bool,
    ) -> Microbatch:
        # R3 off: an empty replay buffer, never exposed (Microbatch.layer_major is None).
        k, n_local = (spec.topk, len(self.layers)) if spec is not None else (1, 0)
        cp = self.parallel.cp_size > 1
        if spec is not None and spec.num_experts is None and self.spec is not None:
            spec = dataclasses.replace(spec, num_experts=self.spec.num_experts)
        lm_shape = (n_local, lay.positions, lay.columns, k)
        # With a device the replay buffer is not the pool's: it stays compact on the host
        # (pinned for CUDA), is shipped as is and widened to int32 on the device.
        parts: list[tuple[tuple[int, ...], Any]] = [
            ((n_local if self.device is None else 0, *lm_shape[1:]), np.int32),
            *(((lay.columns, lay.positions), dt) for dt in _TOKEN_DTYPES),
        ]
        if cp:
            parts.append(((lay.positions,), np.int64))
        nbytes = _Arena.size(parts)
        arena = _Arena(
            self._pool.take(nbytes) if self._pool is not None else np.empty(nbytes, np.uint8)
        )
        lm, *arrays = (arena.take(*p) for p in parts)
        out = _Tokens(*arrays[:6])
        tok_index = arrays[6] if cp else None
        if self.device is not None and spec is not None:
            compact = np.dtype(spec.dtype)
            if self._pinned is not None and self.device.type != "cpu":
                lm = self._pinned.take(lm_shape, compact)
            else:
                lm = np.empty(lm_shape, dtype=compact)
        self._blank(out)
        need = lay.max_seqlen if not cp else int(lay.seg_global.max() + lay.seg_len.max())
        if self._arange.shape[0] < need:
            self._arange = np.arange(max(need, 2 * self._arange.shape[0]), dtype=np.int64)
        experts = spec.num_experts if spec is not None else None
        self._write(batches, layer_index, experts, lay, plen, n, cap, lm, out, tok_index)
        if padding:  # no real token in a padding microbatch
            self._blank(out)

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
            **dataclasses.asdict(self.parallel),
            layer_major=replay,
            is_padding=padding,
            validated_version=(
                int(replay._version) if replay is not None and self.validate else None
            ),
        )
        return mb if self.device is None else mb.to(self.device, non_blocking=True)

    def _widen(self, lm: np.ndarray) -> torch.Tensor:
        """The replay buffer as int32: itself on the host, else shipped compact and widened."""
        if self.device is None:
            return torch.from_numpy(lm)
        host = torch.from_numpy(lm.view(_SHIP_DTYPE[lm.dtype.itemsize]))
        pinned = self._pinned if self.device.type != "cpu" else None
        if pinned is not None:
            host = pinned.tensor(lm.nbytes).view(host.dtype)  # the same bytes, pinned
        shipped = host.to(self.device, non_blocking=True)
        if pinned is not None:
            pinned.shipped(self.device)
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
    ) -> None:
        """One pass over the segments (≤ 2 per trajectory): slices, no per-token work."""
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
        # per record batch (a chunk of the routes column, never joined).
        pos_row = np.empty((lay.positions, lay.columns), dtype=np.int64) if r3 else None
        sources: list[_RouteSource] = []
        for batch, segs in zip(batches, seg_rows, strict=True):
            prompt, p_off = _flat_list(batch.column("prompt_ids"))
            resp, r_off = _flat_list(batch.column("response_ids"))
            mask, _ = _flat_list(batch.column("loss_mask"))
            if r3:
                routes, rt_off = flat_routes(batch)
                src = _RouteSource(routes, rt_off, row0, batch)
                sources.append(src)
            for s in segs.tolist():
                g = int(tr[s])
                i = g - row0
                a, length, at, c = int(st[s]), int(ln[s]), int(lay.seg_at[s]), seg_cols[s]
                p = int(plen[g])
                row = 0 if self.packed else c
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
                if pos_row is not None:
                    np.add(ar[a : a + nr], int(rt_off[i]), out=pos_row[at : at + nr, row])
                    pos_row[at + nr : at + length, row] = -1
                    src.cover(at, at + length, c)
                if tok_index is not None and (self.packed or c == 0):
                    g0 = int(lay.seg_global[s])
                    tok_index[at : at + length] = ar[g0 : g0 + length]
            row0 += batch.num_rows
        if pos_row is not None:
            self._gather_routes(sources, pos_row, lm, layer_index, num_experts)

    def _gather_routes(
        self,
        sources: list[_RouteSource],
        pos_row: np.ndarray,
        lm: np.ndarray,
        layer_index: np.ndarray,
        num_experts: int | None,
    ) -> None:
        """The fused pass per route source, split over worker threads when large."""
        workers = self.num_threads if lm.size * 4 >= _PARALLEL_BYTES else 1
        positions = int(pos_row.shape[0])
        pieces = [
            piece
            for src in sources
            for piece in src.pieces(positions, packed=self.packed, split=workers)
        ]
        args = (pos_row, lm, layer_index, num_experts, self.layers, self.validate)
        if workers <= 1:
            _run_gathers(pieces, *args)
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                max_workers=self.num_threads, thread_name_prefix="r3arrow-collate"
            )
        futures = [
            self._executor.submit(_run_gathers, pieces[w::workers], *args) for w in range(workers)
        ]
        for f in futures:
            f.result()
