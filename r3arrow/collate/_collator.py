"""`MegatronCollator`: a rollout table → one `Microbatch` for this rank's routers.

The collator checks the table, computes the layout (`_layout`), takes one output buffer
from its pool and fills it in a single pass over the segments (at most two per
trajectory): token columns by slices, routes by the copy kernels (`_kernels`), split over
threads when large (numpy releases the GIL while copying).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import numpy as np
import pyarrow as pa
import torch

from r3arrow._checks import check_int, check_positive_int
from r3arrow._typing import ArrowArray
from r3arrow._validated import is_validated
from r3arrow.collate._buffers import _Arena, _BufferPool
from r3arrow.collate._kernels import _put, _RowGatherer, _run_copies
from r3arrow.collate._layout import _layer_selector, _Layout, _layout, alignment_multiple
from r3arrow.collate._microbatch import Microbatch
from r3arrow.errors import SchemaError
from r3arrow.microbatch import is_padding_table, split_microbatches
from r3arrow.spec import RouteSpec, validate_layers
from r3arrow.table import flat_routes, list_lengths, route_spec, validate_rollouts

#: Output bytes from which route copies are split over worker threads.
_PARALLEL_BYTES = 8 << 20


def _flat_list(arr: ArrowArray) -> tuple[np.ndarray, np.ndarray]:
    """(values, offsets from 0) of a list array, zero-copy where Arrow allows it."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks() if arr.num_chunks != 1 else arr.chunk(0)
    lists = cast("pa.ListArray[Any] | pa.LargeListArray[Any]", arr)
    offsets = np.asarray(lists.offsets, dtype=np.int64)
    values = lists.flatten().to_numpy(zero_copy_only=False)
    return np.asarray(values), offsets - offsets[0]


class MegatronCollator:
    """Rollout table (or record batch) → `Microbatch` for this rank's routers.

    ``layers``: global ids of this stage's routers, in Megatron's build order (default:
    every router layer of ``spec``); they must be router layers of ``spec``. ``align``
    combines by lcm with the TP/CP/FP8 multiples (`alignment_multiple`): unpacked, the row
    length is rounded up to it; packed, every sequence is. ``pad_token_id`` fills
    ``input_ids``/``labels`` at padding. ``validate`` runs the full rollout-table check
    (terminal-gap rule) first; shapes and lengths are always checked. ``reuse_buffers``
    recycles output memory once a microbatch and every tensor taken from it are gone.
    ``num_threads`` (default: torch's intra-op threads, at most 8) split large route copies;
    numpy releases the GIL while copying.

    ``spec=None`` collates with R3 off: tables without a ``routes`` column (one is ignored
    if present), the same ``input_ids``/``position_ids``/masks/``cu_seqlens`` as with routes
    captured on every token, no replay buffer (`Microbatch.routes` is None); ``layers`` must
    then be None. A DP padding table (`r3arrow.microbatch.padding_table`) collates to a
    microbatch with ``is_padding`` set, every position padding and dummy rows.

    Raises `TypeError`/`ValueError` for argument misuse (``spec`` not a `RouteSpec` or None,
    layers not distinct ints or given with R3 off, sizes not positive ints, ranks outside
    ``[0, size)``) and
    `RouteShapeError` for layers that are not router layers of ``spec``. Build one for a
    Megatron rank with ``collator_for`` of the Megatron integration.
    """

    def __init__(
        self,
        spec: RouteSpec | None,
        layers: Sequence[int] | None = None,
        *,
        packed: bool = False,
        align: int = 1,
        tp_size: int = 1,
        tp_rank: int = 0,
        cp_size: int = 1,
        cp_rank: int = 0,
        sequence_parallel: bool = False,
        fp8: bool = False,
        pad_token_id: int = 0,
        validate: bool = True,
        reuse_buffers: bool = True,
        num_threads: int | None = None,
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
        if spec is not None and not chosen:
            raise ValueError(f"layers: expected at least one router layer, found {chosen}")
        if len(set(chosen)) != len(chosen):
            raise ValueError(f"layers: expected distinct router layers, found {chosen}")
        self.layers: tuple[int, ...] = tuple(chosen)
        self.multiple = alignment_multiple(align=align, tp_size=tp_size, cp_size=cp_size, fp8=fp8)
        self.packed = bool(packed)
        self.align = int(align)
        self.tp_size = int(tp_size)
        self.tp_rank = check_int(tp_rank, "tp_rank", minimum=0, maximum=self.tp_size - 1)
        self.cp_size = int(cp_size)
        self.cp_rank = check_int(cp_rank, "cp_rank", minimum=0, maximum=self.cp_size - 1)
        self.sequence_parallel = bool(sequence_parallel)
        self.fp8 = bool(fp8)
        self.pad_token_id = check_int(pad_token_id, "pad_token_id")
        self.validate = bool(validate)
        self._pool = _BufferPool() if reuse_buffers else None
        threads = min(8, torch.get_num_threads()) if num_threads is None else num_threads
        self.num_threads = check_positive_int(threads, "num_threads")
        self._executor: ThreadPoolExecutor | None = None
        self._select = _layer_selector(self.layers) if self.layers else slice(0, 0)
        self._arange = np.arange(0, dtype=np.int64)

    # ---------------------------------------------------------------- public
    def __call__(self, table: pa.Table | pa.RecordBatch) -> Microbatch:
        """Collate every trajectory of ``table`` into one microbatch (see `Microbatch`).

        Raises `TypeError` unless ``table`` is a ``pa.Table``/``pa.RecordBatch``; `SchemaError`
        for a table off the rollout schema or another spec (or without routes while the
        collator has a spec), an empty table, or a row whose lengths disagree (``row`` set);
        the rollout checks' errors when ``validate`` is on (R3 off: lengths only).
        """
        batches, spec = self._check_table(table)
        padding = is_padding_table(table)
        plen = np.concatenate([list_lengths(b.column("prompt_ids")) for b in batches])
        rlen = np.concatenate([list_lengths(b.column("response_ids")) for b in batches])
        n = plen + rlen
        if padding:
            cap = np.zeros_like(n)  # every position is padding
        elif spec is None:
            cap = n  # R3 off: routers route every real token freely
        else:
            cap = np.concatenate([list_lengths(b.column("routes")) for b in batches])
        self._check_lengths(batches, rlen, n, cap)
        lay = _layout(
            n,
            packed=self.packed,
            multiple=self.multiple,
            cp_size=self.cp_size,
            cp_rank=self.cp_rank,
        )
        return self._fill(batches, spec, lay, plen, n, cap, padding)

    def split(
        self,
        table: pa.Table,
        *,
        max_tokens: int | None = None,
        num_microbatches: int | None = None,
        dp_size: int = 1,
        dp_rank: int | None = None,
    ) -> list[pa.Table]:
        """`split_microbatches` with this collator's layout and alignment (DP padding
        microbatches included with ``dp_size > 1``)."""
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

    # ---------------------------------------------------------------- checks
    def _check_table(
        self, table: pa.Table | pa.RecordBatch
    ) -> tuple[list[pa.RecordBatch], RouteSpec | None]:
        if not isinstance(table, pa.Table | pa.RecordBatch):
            raise TypeError(
                f"table: expected a pyarrow Table or RecordBatch, found {type(table).__name__}"
            )
        for name in ("prompt_ids", "response_ids", "loss_mask"):
            if name not in table.schema.names:
                raise SchemaError(f"expected column {name!r}, found columns {table.schema.names}")
        if table.num_rows == 0:
            raise SchemaError("expected at least one trajectory, found an empty table")
        batches = [
            b
            for b in (table.to_batches() if isinstance(table, pa.Table) else [table])
            if b.num_rows
        ]
        if self.spec is None:
            # R3 off: token columns must be integer lists even without validation.
            for name in ("prompt_ids", "response_ids", "loss_mask"):
                typ = table.schema.field(name).type
                if not (
                    (pa.types.is_list(typ) or pa.types.is_large_list(typ))
                    and pa.types.is_integer(typ.value_type)
                ):
                    raise SchemaError(f"column {name!r}: expected a list of integers, found {typ}")
            if self.validate and not is_validated(table):
                validate_rollouts(table)  # R3-off rules (and the routes' if a column is there)
            return batches, None
        if "routes" not in table.schema.names:
            raise SchemaError(
                f"expected column 'routes' (this collator replays routes of spec {self.spec}), "
                f"found columns {table.schema.names}; collate a table without routes with "
                f"MegatronCollator(spec=None) (R3 off)"
            )
        # A table r3arrow built or validated already passed the rollout checks.
        full = self.validate and not is_validated(table)
        spec = validate_rollouts(table, require_routes=True) if full else route_spec(table)
        if not self.spec.same_shape(spec):
            raise SchemaError(
                f"routes: expected [L={self.spec.num_layers}, K={self.spec.topk}] with router "
                f"layers {list(self.spec.router_layers)}, found [L={spec.num_layers}, "
                f"K={spec.topk}] with router layers {list(spec.router_layers)}"
            )
        if (
            None not in (self.spec.num_experts, spec.num_experts)
            and self.spec.num_experts != spec.num_experts
        ):
            raise SchemaError(
                f"num_experts: expected {self.spec.num_experts}, found {spec.num_experts}"
            )
        return batches, spec

    def _check_lengths(
        self, batches: list[pa.RecordBatch], rlen: np.ndarray, n: np.ndarray, cap: np.ndarray
    ) -> None:
        mlen = np.concatenate([list_lengths(b.column("loss_mask")) for b in batches])
        bad = np.flatnonzero((mlen != rlen) | (cap > n) | (n < 1))
        if bad.size:
            i = int(bad[0])
            raise SchemaError(
                f"row {i}: expected at least one token, a loss_mask over the {rlen[i]} response "
                f"tokens and at most {n[i]} route rows; found {n[i]} tokens, loss_mask of "
                f"{mlen[i]}, {cap[i]} route rows",
                row=i,
            )

    # ------------------------------------------------------------------ fill
    def _fill(
        self,
        batches: list[pa.RecordBatch],
        spec: RouteSpec | None,
        lay: _Layout,
        plen: np.ndarray,
        n: np.ndarray,
        cap: np.ndarray,
        padding: bool,
    ) -> Microbatch:
        # R3 off: an empty replay buffer, never exposed (Microbatch.layer_major is None).
        k, n_local = (spec.topk, len(self.layers)) if spec is not None else (1, 0)
        tok_shape = (lay.columns, lay.positions)  # packed: columns == 1
        cp = self.cp_size > 1
        parts: list[tuple[tuple[int, ...], Any]] = [
            ((n_local, lay.positions, lay.columns, k), np.int32),
            (tok_shape, np.int64),
            (tok_shape, np.int64),
            (tok_shape, np.int64),
            (tok_shape, np.float32),
            (tok_shape, np.float32),
            (tok_shape, np.bool_),
        ]
        if cp:
            parts.append(((lay.positions,), np.int64))
        nbytes = _Arena.size(parts)
        buf = (
            self._pool.take(nbytes) if self._pool is not None else np.empty(nbytes, dtype=np.uint8)
        )
        arena = _Arena(buf)
        lm = arena.take(*parts[0])
        ids, pos, labels = arena.take(*parts[1]), arena.take(*parts[2]), arena.take(*parts[3])
        loss, lab_mask, pad = arena.take(*parts[4]), arena.take(*parts[5]), arena.take(*parts[6])
        tok_index = arena.take(*parts[7]) if cp else None
        ids.fill(self.pad_token_id)
        labels.fill(self.pad_token_id)
        loss.fill(0)
        lab_mask.fill(0)
        need = lay.max_seqlen if not cp else int(lay.seg_global.max() + lay.seg_len.max())
        if self._arange.shape[0] < need:
            self._arange = np.arange(max(need, 2 * self._arange.shape[0]), dtype=np.int64)
        self._write(
            batches, lay, plen, n, cap, lm, ids, pos, labels, loss, lab_mask, pad, tok_index
        )
        if padding:  # no real token in a padding microbatch
            ids.fill(self.pad_token_id)
            labels.fill(self.pad_token_id)
            loss.fill(0)
            lab_mask.fill(0)

        def t(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a)

        def t32(a: np.ndarray | None) -> torch.Tensor | None:
            return None if a is None else torch.from_numpy(a.astype(np.int32))

        if spec is not None and spec.num_experts is None and self.spec is not None:
            spec = dataclasses.replace(spec, num_experts=self.spec.num_experts)
        return Microbatch(
            spec=spec,
            layers=self.layers,
            packed=self.packed,
            input_ids=t(ids),
            position_ids=t(pos),
            labels=t(labels),
            loss_mask=t(loss),
            label_mask=t(lab_mask),
            padding_mask=t(pad),
            cu_seqlens=t32(lay.cu_seqlens),
            cu_seqlens_padded=t32(lay.cu_seqlens_padded),
            max_seqlen=lay.max_seqlen,
            seq_lens=n,
            captured=cap,
            token_index=None if tok_index is None else t(tok_index),
            tp_size=self.tp_size,
            tp_rank=self.tp_rank,
            cp_size=self.cp_size,
            cp_rank=self.cp_rank,
            sequence_parallel=self.sequence_parallel,
            layer_major=t(lm) if spec is not None else None,
            is_padding=padding,
        )

    def _write(
        self,
        batches: list[pa.RecordBatch],
        lay: _Layout,
        plen: np.ndarray,
        n: np.ndarray,
        cap: np.ndarray,
        lm: np.ndarray,
        ids: np.ndarray,
        pos: np.ndarray,
        labels: np.ndarray,
        loss: np.ndarray,
        lab_mask: np.ndarray,
        pad: np.ndarray,
        tok_index: np.ndarray | None,
    ) -> None:
        """One pass over the segments (≤ 2 per trajectory): slices only, no per-token work.
        Routes only when the collator replays them and the table has some (not padding)."""
        ar = self._arange
        r3 = self.spec is not None and lm.shape[0] > 0
        # Per-segment clipped counts, vectorised: tokens, next tokens, captured route rows.
        st, ln = lay.seg_start, lay.seg_len
        tr = lay.seg_traj
        cnt_tok = np.clip(n[tr] - st, 0, ln)
        cnt_lab = np.clip(n[tr] - 1 - st, 0, ln)
        cnt_rt = np.clip(cap[tr] - st, 0, ln)
        seg_rows = np.split(
            np.arange(tr.shape[0]),
            np.searchsorted(tr, np.cumsum([b.num_rows for b in batches])[:-1]),
        )
        seg_cols = lay.seg_col.tolist()
        row0 = 0
        sources: list[np.ndarray] = []
        jobs: list[tuple[int, int, int, int]] = []  # packed: (source, first row, rows, at)
        pads: list[tuple[int, int]] = []  # packed: (at, positions)
        route_base: list[np.ndarray] = []  # first route row of each trajectory, all sources joined
        for batch, segs in zip(batches, seg_rows, strict=True):
            prompt, p_off = _flat_list(batch.column("prompt_ids"))
            resp, r_off = _flat_list(batch.column("response_ids"))
            mask, _ = _flat_list(batch.column("loss_mask"))
            if r3:
                routes, rt_off = flat_routes(batch)
                route_base.append(rt_off[:-1] + sum(x.shape[0] for x in sources))
                sources.append(routes)
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
                if r3 and self.packed and nr:
                    jobs.append((len(sources) - 1, int(rt_off[i]) + a, nr, at))
                if r3 and self.packed and nr < length:
                    pads.append((at + nr, length - nr))
                if tok_index is not None and (self.packed or c == 0):
                    g0 = int(lay.seg_global[s])
                    tok_index[at : at + length] = ar[g0 : g0 + length]
            row0 += batch.num_rows
        if not r3:
            return
        if self.packed:
            self._copy_routes(sources, jobs, pads, lm)
        else:
            self._copy_unpacked(sources, np.concatenate(route_base), cap, lay, lm)

    def _threads(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(
                max_workers=self.num_threads, thread_name_prefix="r3arrow-collate"
            )
        return self._executor

    def _copy_unpacked(
        self,
        sources: list[np.ndarray],
        first_row: np.ndarray,
        cap: np.ndarray,
        lay: _Layout,
        lm: np.ndarray,
    ) -> None:
        """Sequence-major ``[s, b]`` routes, block by block of positions over all rows at once:
        each block of the output is contiguous per layer, so no write is strided."""
        select: slice | np.ndarray = self._select
        source = sources[0]
        if len(sources) > 1:  # several record batches: join their local layers, compact dtype
            source = np.concatenate([src[:, select] for src in sources])
            select = slice(0, len(self.layers))
        col0 = lay.seg_col == 0
        t_of_p = np.concatenate(
            [
                self._arange[a : a + n]
                for a, n in zip(
                    lay.seg_start[col0].tolist(), lay.seg_len[col0].tolist(), strict=True
                )
            ]
        )
        gather = _RowGatherer(source, select, lm, first_row, cap)
        positions, step = lay.positions, gather.block_positions
        starts = list(range(0, positions, step))
        total = positions * lay.columns * lm.shape[0] * lm.shape[3] * 4
        workers = min(self.num_threads, len(starts)) if total >= _PARALLEL_BYTES else 1
        if workers <= 1:
            for p0 in starts:
                gather.run(t_of_p, p0, min(positions, p0 + step))
            return
        executor = self._threads()

        def share(w: int) -> None:
            g = gather if w == 0 else _RowGatherer(source, select, lm, first_row, cap)
            for p0 in starts[w::workers]:
                g.run(t_of_p, p0, min(positions, p0 + step))

        for f in [executor.submit(share, w) for w in range(workers)]:
            f.result()

    def _copy_routes(
        self,
        sources: list[np.ndarray],
        jobs: list[tuple[int, int, int, int]],
        pads: list[tuple[int, int]],
        lm: np.ndarray,
    ) -> None:
        """Run the packed route copies, split evenly by rows over worker threads when large."""
        rows = sum(j[2] for j in jobs)
        row_bytes = lm.shape[0] * lm.shape[3] * 4
        workers = self.num_threads if rows * row_bytes >= _PARALLEL_BYTES else 1
        if workers <= 1:
            _run_copies(sources, self._select, lm, jobs, pads)
            return
        groups: list[list[tuple[int, int, int, int]]] = [[] for _ in range(workers)]
        per, filled, w = -(-rows // workers), 0, 0
        for src, s0, count, at in jobs:
            done = 0
            while done < count:
                take = min(count - done, per - filled)
                groups[w].append((src, s0 + done, take, at + done))
                done, filled = done + take, filled + take
                if filled == per and w < workers - 1:
                    w, filled = w + 1, 0
        executor = self._threads()
        futures = [
            executor.submit(_run_copies, sources, self._select, lm, g, pads if i == 0 else [])
            for i, g in enumerate(groups)
        ]
        for f in futures:
            f.result()
