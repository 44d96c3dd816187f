"""Rollout tables → the tensors Megatron-core trains on, with replay targets for this rank's routers.

`MegatronCollator` turns a rollout table (or record batch) into one `Microbatch`:
``input_ids``/``position_ids``/``loss_mask``/``padding_mask`` ``[b, S]`` (unpacked) or
``[1, T]`` (packed THD), int32 routes for this pipeline stage's routers only, and
``replay_targets()`` in Megatron's token order. Layout rules (DESIGN §2):

* sequences start at position 0 of their row (unpacked) or segment (packed); alignment
  and batch padding follow them;
* every position without a captured route (alignment padding, batch padding, the
  uncaptured suffix) has ``padding_mask`` True and the dummy route ``[0, 1, …, K-1]``;
* context parallel rank r keeps chunks r and 2·cp−1−r of every sequence (unpacked: of
  every row) split into 2·cp chunks; sequence parallelism slices the router tokens by
  TP rank (the model inputs stay whole: Megatron scatters them itself).

Routes are never materialised for all layers nor left-padded. The output is one
layer-major int32 buffer ``[L_local, P, C, K]`` whose per-layer slices are the replay
targets (contiguous, no copy); it is written once, in cache-sized blocks: gather the
local layers of a block of tokens from the compact Arrow buffer, transpose in cache,
widen into place (packed: per trajectory chunk; unpacked: per block of positions over
all rows, so the sequence-major output is written contiguously too). Python loops run
per trajectory chunk or per block, never per token or per layer. Output buffers come
from a pool and are reused once nothing references them (first touch of fresh pages
costs more than the copy, DESIGN §6); large copies are split over threads.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import sys
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from r3arrow.errors import ReplayError, RouteShapeError, SchemaError
from r3arrow.spec import RouteSpec, validate_layers
from r3arrow.table import flat_routes, list_lengths, route_spec, validate_rollouts

#: Bytes of compact routes transposed per block (fits in L2 next to its int32 output).
_BLOCK_BYTES = 1 << 17
#: Output bytes from which route copies are split over worker threads.
_PARALLEL_BYTES = 8 << 20
_ALIGN = 64


# ------------------------------------------------------------------- alignment
def alignment_multiple(
    *, align: int = 1, tp_size: int = 1, cp_size: int = 1, fp8: bool = False
) -> int:
    """Length multiple of a sequence (packed) or of the row length (unpacked).

    ``tp``; ``tp*cp*2`` with context parallelism; combined by lcm with ``16*cp``
    under FP8 and with the user's ``align``.
    """
    for name, value in (("align", align), ("tp_size", tp_size), ("cp_size", cp_size)):
        if not isinstance(value, int | np.integer) or isinstance(value, bool) or value < 1:
            raise ReplayError(f"{name}: expected a positive int, found {value!r}")
    base = tp_size * cp_size * 2 if cp_size > 1 else tp_size
    if fp8:
        base = math.lcm(base, 16 * cp_size)
    return math.lcm(int(align), base)


def _round_up(x: np.ndarray, m: int) -> np.ndarray:
    return np.asarray(-(-x // m) * m, dtype=np.int64)


# ------------------------------------------------------------------ buffer pool
class _BufferPool:
    """Reuses byte buffers once no array or tensor views them any more.

    A buffer is free when the pool holds the only reference to it: every numpy view
    and every tensor made by ``torch.from_numpy`` keeps the base array alive, so the
    reference count is exact. Thread-safe.
    """

    def __init__(self, max_buffers: int = 32) -> None:
        self.max_buffers = max_buffers
        self._buffers: list[np.ndarray] = []
        self._lock = threading.Lock()

    def _is_free(self, i: int) -> bool:
        # References: the list slot and getrefcount's argument.
        return sys.getrefcount(self._buffers[i]) <= 2

    def take(self, nbytes: int) -> np.ndarray:
        nbytes = max(int(nbytes), 1)
        with self._lock:
            best = -1
            for i in range(len(self._buffers)):
                size = self._buffers[i].nbytes
                if (
                    size >= nbytes
                    and self._is_free(i)
                    and (best < 0 or size < self._buffers[best].nbytes)
                ):
                    best = i
            if best >= 0:
                return self._buffers[best]
            # Replace free buffers that are too small rather than keeping them around.
            self._drop_free()
            # 1/8 headroom so the next, slightly larger batch fits.
            buf = np.empty(nbytes + nbytes // 8, dtype=np.uint8)
            if len(self._buffers) < self.max_buffers:
                self._buffers.append(buf)
            return buf

    def _drop_free(self) -> None:
        busy = [not self._is_free(i) for i in range(len(self._buffers))]
        self._buffers = [self._buffers[i] for i in range(len(busy)) if busy[i]]

    def clear(self) -> None:
        """Drop every free buffer."""
        with self._lock:
            self._drop_free()

    def __len__(self) -> int:
        return len(self._buffers)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self._buffers)


class _Arena:
    """Carves 64-byte aligned typed views out of one byte buffer."""

    def __init__(self, buf: np.ndarray) -> None:
        self.buf = buf
        self.offset = 0

    @staticmethod
    def size(parts: Iterable[tuple[tuple[int, ...], Any]]) -> int:
        total = 0
        for shape, dtype in parts:
            total += -(-math.prod(shape) * np.dtype(dtype).itemsize // _ALIGN) * _ALIGN
        return total

    def take(self, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
        dt = np.dtype(dtype)
        n = math.prod(shape) * dt.itemsize
        out: np.ndarray = self.buf[self.offset : self.offset + n].view(dt).reshape(shape)
        self.offset += -(-n // _ALIGN) * _ALIGN
        return out


# ------------------------------------------------------------------ microbatch
@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class Microbatch:
    """One microbatch for Megatron-core, local to this rank's CP chunk and pipeline stage.

    ``input_ids``/``position_ids``/``labels`` int64, ``loss_mask``/``label_mask`` float32,
    ``padding_mask`` bool (True = not a replayed route), all ``[b, S]`` (packed: ``[1, T]``).
    ``loss_mask`` is aligned with the input tokens (0 on the prompt); ``labels[t]`` is
    token t+1 of the same sequence and ``label_mask[t] = loss_mask[t+1]`` (0 where there is
    no next token). ``cu_seqlens``/``cu_seqlens_padded`` (int32, packed only) describe the
    whole packed row before context-parallel slicing, as Megatron's ``PackedSeqParams`` wants.
    """

    spec: RouteSpec
    layers: tuple[int, ...]
    packed: bool
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    label_mask: torch.Tensor
    padding_mask: torch.Tensor
    cu_seqlens: torch.Tensor | None
    cu_seqlens_padded: torch.Tensor | None
    max_seqlen: int
    seq_lens: np.ndarray
    captured: np.ndarray
    #: Position in the full (pre-CP) layout of each local token: ``[T_local]`` into the
    #: packed row, or ``[S_local]`` into each unpacked row; None without context parallelism.
    token_index: torch.Tensor | None
    tp_size: int
    tp_rank: int
    cp_size: int
    cp_rank: int
    sequence_parallel: bool
    #: int32 ``[L_local, P, C, K]``: P positions per column, C = b columns (unpacked) or 1.
    #: Flattened over (P, C) this is Megatron's token order (sequence-major for ``[s, b]``).
    layer_major: torch.Tensor

    # -------------------------------------------------------------- derived
    @property
    def routes(self) -> torch.Tensor:
        """int32 ``[b, S, L_local, K]`` (packed: ``[1, T, L_local, K]``), a view of the targets."""
        return self.layer_major.permute(2, 1, 0, 3)  # [C, P, L, K]; packed C == 1

    @property
    def num_sequences(self) -> int:
        return int(self.seq_lens.shape[0])

    @property
    def num_tokens(self) -> int:
        """Positions in this rank's ``input_ids`` (padding included)."""
        return int(self.input_ids.numel())

    @property
    def num_router_tokens(self) -> int:
        """Tokens each local router sees on this rank (after CP and SP slicing)."""
        _, positions, columns, _ = self.layer_major.shape
        if self.sequence_parallel:
            positions //= self.tp_size
        return int(positions * columns)

    def replay_tensor(self) -> torch.Tensor:
        """int32 ``[L_local, num_router_tokens, K]`` view of `layer_major`: this rank's targets.

        Token order is Megatron's: flat index ``s * b + b_idx`` of the ``[s, b]`` hidden
        states (packed ``[1, T]``: T order), sliced to this TP rank under sequence
        parallelism.
        """
        n_layers, positions, columns, k = self.layer_major.shape
        flat = self.layer_major.reshape(n_layers, positions * columns, k)
        if self.sequence_parallel and self.tp_size > 1:
            per = positions // self.tp_size * columns
            flat = flat[:, self.tp_rank * per : (self.tp_rank + 1) * per]
        return flat

    def replay_targets(self) -> list[torch.Tensor]:
        """One contiguous int32 ``[num_router_tokens, K]`` tensor per local router, in layer
        order: the rows of `replay_tensor` (views, no copy)."""
        return list(self.replay_tensor().unbind(0))

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> Microbatch:
        """This microbatch with every tensor on ``device``."""

        moved: dict[str, Any] = {
            f.name: v.to(device, non_blocking=non_blocking)
            for f in dataclasses.fields(self)
            if isinstance(v := getattr(self, f.name), torch.Tensor)
        }
        return dataclasses.replace(self, **moved)

    def to_batch(self, values: torch.Tensor, *, fill: float = 0.0) -> torch.Tensor:
        """Per-position model outputs (e.g. next-token logprobs) → ``[B, max(seq_lens) - 1]``.

        ``values`` covers the full (pre-CP) layout: ``[1, T]``/``[T]`` packed or ``[b, S]``
        unpacked; position t of a sequence predicts token t+1, so each row keeps its first
        ``len - 1`` values and ``fill`` after. With context parallelism, gather the ranks'
        outputs first and place them with `token_index`.
        """
        if self.packed:
            assert self.cu_seqlens is not None and self.cu_seqlens_padded is not None
            return packed_to_batch(values, self.cu_seqlens, self.cu_seqlens_padded, fill=fill)
        return unpacked_to_batch(values, self.seq_lens, fill=fill)

    def __repr__(self) -> str:
        shape = "x".join(str(d) for d in self.input_ids.shape)
        return (
            f"Microbatch({'packed' if self.packed else 'unpacked'} {shape}, sequences={self.num_sequences}, "
            f"layers={list(self.layers)}, router_tokens={self.num_router_tokens}, "
            f"tp={self.tp_rank}/{self.tp_size}{' sp' if self.sequence_parallel else ''}, "
            f"cp={self.cp_rank}/{self.cp_size})"
        )


# -------------------------------------------------------------------- layout
@dataclasses.dataclass(frozen=True)
class _Layout:
    """Where each trajectory's chunks go on this rank (vectorised over segments)."""

    positions: int  # P: positions per column
    columns: int  # C: b (unpacked) or 1 (packed)
    seg_traj: np.ndarray  # trajectory of each segment
    seg_start: np.ndarray  # first token position (in its sequence) of the segment
    seg_len: np.ndarray  # positions in the segment (padding included)
    seg_at: np.ndarray  # first local position
    seg_col: np.ndarray  # column (row of the unpacked batch, 0 packed)
    seg_global: np.ndarray  # first position in the full pre-CP layout (token_index)
    cu_seqlens: np.ndarray | None
    cu_seqlens_padded: np.ndarray | None
    max_seqlen: int


def _layout(n: np.ndarray, *, packed: bool, multiple: int, cp_size: int, cp_rank: int) -> _Layout:
    b = n.shape[0]
    traj = np.arange(b, dtype=np.int64)
    if packed:
        padded = _round_up(n, multiple)
        cu_pad = np.zeros(b + 1, dtype=np.int64)
        np.cumsum(padded, out=cu_pad[1:])
        cu = np.zeros(b + 1, dtype=np.int64)
        np.cumsum(n, out=cu[1:])
        positions, columns = int(cu_pad[-1]) // cp_size, 1
        col = np.zeros(b, dtype=np.int64)
        full, base, gbase = padded, cu_pad[:-1] // cp_size, cu_pad[:-1]
        cu_out, cu_pad_out, max_len = cu, cu_pad, int(padded.max())
    else:
        width = int(_round_up(n.max(keepdims=True), multiple)[0])
        positions, columns = width // cp_size, b
        col = traj
        full = np.full(b, width, dtype=np.int64)
        base, gbase = np.zeros(b, dtype=np.int64), np.zeros(b, dtype=np.int64)
        cu_out, cu_pad_out, max_len = None, None, width
    if cp_size == 1:
        return _Layout(
            positions,
            columns,
            traj,
            np.zeros(b, np.int64),
            full,
            base,
            col,
            gbase,
            cu_out,
            cu_pad_out,
            max_len,
        )
    # Chunk r then chunk 2cp-1-r of each sequence (row), back to back; lengths divide by 2cp.
    chunk = full // (2 * cp_size)
    first, second = cp_rank * chunk, (2 * cp_size - 1 - cp_rank) * chunk
    return _Layout(
        positions,
        columns,
        np.repeat(traj, 2),
        np.stack([first, second], axis=1).reshape(-1),
        np.repeat(chunk, 2),
        np.stack([base, base + chunk], axis=1).reshape(-1),
        np.repeat(col, 2),
        np.stack([gbase + first, gbase + second], axis=1).reshape(-1),
        cu_out,
        cu_pad_out,
        max_len,
    )


def _flat_list(arr: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray]:
    """(values, offsets from 0) of a list array, zero-copy where Arrow allows it."""
    if isinstance(arr, pa.ChunkedArray):
        arr = arr.combine_chunks() if arr.num_chunks != 1 else arr.chunk(0)
    offsets = np.asarray(arr.offsets, dtype=np.int64)
    values = arr.flatten().to_numpy(zero_copy_only=False)
    return np.asarray(values), offsets - offsets[0]


def _layer_selector(layers: Sequence[int]) -> slice | np.ndarray:
    """A basic slice when the layers are an arithmetic progression (a view), else an index array."""
    if len(layers) == 1:
        return slice(layers[0], layers[0] + 1)
    step = layers[1] - layers[0]
    if step > 0 and all(b - a == step for a, b in itertools.pairwise(layers)):
        return slice(layers[0], layers[-1] + 1, step)
    return np.asarray(layers, dtype=np.intp)


_ROW_VIEW: dict[int, np.dtype[Any]] = {
    1: np.dtype(np.uint8),
    2: np.dtype(np.uint16),
    4: np.dtype(np.uint32),
    8: np.dtype(np.uint64),
}


# ------------------------------------------------------------------- collator
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
    """

    def __init__(
        self,
        spec: RouteSpec,
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
        if not isinstance(spec, RouteSpec):
            raise SchemaError(f"expected a RouteSpec, found {type(spec).__name__}")
        self.spec = spec
        chosen = list(spec.router_layers) if layers is None else validate_layers(layers, spec)
        if not chosen:
            raise RouteShapeError(f"expected at least one router layer, found {list(chosen)}")
        if len(set(chosen)) != len(chosen):
            raise RouteShapeError(f"expected distinct router layers, found {chosen}")
        self.layers: tuple[int, ...] = tuple(chosen)
        self.multiple = alignment_multiple(align=align, tp_size=tp_size, cp_size=cp_size, fp8=fp8)
        for name, rank, size in (("tp_rank", tp_rank, tp_size), ("cp_rank", cp_rank, cp_size)):
            if (
                not isinstance(rank, int | np.integer)
                or isinstance(rank, bool)
                or not 0 <= rank < size
            ):
                raise ReplayError(f"{name}: expected an int in [0, {size}), found {rank!r}")
        self.packed = bool(packed)
        self.align = int(align)
        self.tp_size, self.tp_rank = int(tp_size), int(tp_rank)
        self.cp_size, self.cp_rank = int(cp_size), int(cp_rank)
        self.sequence_parallel = bool(sequence_parallel)
        self.fp8 = bool(fp8)
        self.pad_token_id = int(pad_token_id)
        self.validate = bool(validate)
        self._pool = _BufferPool() if reuse_buffers else None
        threads = min(8, torch.get_num_threads()) if num_threads is None else num_threads
        if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
            raise ReplayError(f"num_threads: expected a positive int, found {num_threads!r}")
        self.num_threads = threads
        self._executor: ThreadPoolExecutor | None = None
        self._select = _layer_selector(self.layers)
        self._arange = np.arange(0, dtype=np.int64)

    @classmethod
    def from_megatron(cls, spec: RouteSpec, config: Any = None, **kwargs: Any) -> MegatronCollator:
        """This rank's collator from a Megatron config and/or model (see `r3arrow.megatron.collator_for`)."""
        from r3arrow.megatron import collator_for

        return collator_for(spec, config, **kwargs)

    # ---------------------------------------------------------------- public
    def __call__(self, table: pa.Table | pa.RecordBatch) -> Microbatch:
        """Collate every trajectory of ``table`` into one microbatch (see `Microbatch`)."""
        batches, spec = self._check_table(table)
        plen = np.concatenate([list_lengths(b.column("prompt_ids")) for b in batches])
        rlen = np.concatenate([list_lengths(b.column("response_ids")) for b in batches])
        cap = np.concatenate([list_lengths(b.column("routes")) for b in batches])
        n = plen + rlen
        self._check_lengths(batches, rlen, n, cap)
        lay = _layout(
            n,
            packed=self.packed,
            multiple=self.multiple,
            cp_size=self.cp_size,
            cp_rank=self.cp_rank,
        )
        return self._fill(batches, spec, lay, plen, n, cap)

    def split(
        self,
        table: pa.Table,
        *,
        max_tokens: int | None = None,
        num_microbatches: int | None = None,
    ) -> list[pa.Table]:
        """`split_microbatches` with this collator's layout and alignment."""
        return split_microbatches(
            table,
            max_tokens=max_tokens,
            num_microbatches=num_microbatches,
            multiple=self.multiple,
            packed=self.packed,
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
    ) -> tuple[list[pa.RecordBatch], RouteSpec]:
        if not isinstance(table, pa.Table | pa.RecordBatch):
            raise SchemaError(
                f"expected a pyarrow Table or RecordBatch, found {type(table).__name__}"
            )
        for name in ("prompt_ids", "response_ids", "loss_mask", "routes"):
            if name not in table.schema.names:
                raise SchemaError(f"expected column {name!r}, found columns {table.schema.names}")
        spec = validate_rollouts(table) if self.validate else route_spec(table)
        if not self.spec.same_shape(spec):
            raise SchemaError(
                f"routes: expected [L={self.spec.num_layers}, K={self.spec.topk}] with router layers "
                f"{list(self.spec.router_layers)}, found [L={spec.num_layers}, K={spec.topk}] with "
                f"router layers {list(spec.router_layers)}"
            )
        if (
            None not in (self.spec.num_experts, spec.num_experts)
            and self.spec.num_experts != spec.num_experts
        ):
            raise SchemaError(
                f"num_experts: expected {self.spec.num_experts}, found {spec.num_experts}"
            )
        if table.num_rows == 0:
            raise SchemaError("expected at least one trajectory, found an empty table")
        batches = [
            b
            for b in (table.to_batches() if isinstance(table, pa.Table) else [table])
            if b.num_rows
        ]
        return batches, spec

    def _check_lengths(
        self, batches: list[pa.RecordBatch], rlen: np.ndarray, n: np.ndarray, cap: np.ndarray
    ) -> None:
        mlen = np.concatenate([list_lengths(b.column("loss_mask")) for b in batches])
        bad = np.flatnonzero((mlen != rlen) | (cap > n) | (n < 1))
        if bad.size:
            i = int(bad[0])
            raise SchemaError(
                f"row {i}: expected at least one token, a loss_mask over the {rlen[i]} response tokens and at "
                f"most {n[i]} route rows; found {n[i]} tokens, loss_mask of {mlen[i]}, {cap[i]} route rows"
            )

    # ------------------------------------------------------------------ fill
    def _fill(
        self,
        batches: list[pa.RecordBatch],
        spec: RouteSpec,
        lay: _Layout,
        plen: np.ndarray,
        n: np.ndarray,
        cap: np.ndarray,
    ) -> Microbatch:
        k, n_local = spec.topk, len(self.layers)
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

        def t(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(a)

        def t32(a: np.ndarray | None) -> torch.Tensor | None:
            return None if a is None else torch.from_numpy(a.astype(np.int32))

        return Microbatch(
            spec=spec
            if spec.num_experts is not None
            else dataclasses.replace(spec, num_experts=self.spec.num_experts),
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
            layer_major=t(lm),
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
        """One pass over the segments (≤ 2 per trajectory): slices only, no per-token work."""
        ar = self._arange
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
                if self.packed and nr:
                    jobs.append((len(sources) - 1, int(rt_off[i]) + a, nr, at))
                if self.packed and nr < length:
                    pads.append((at + nr, length - nr))
                if tok_index is not None and (self.packed or c == 0):
                    g0 = int(lay.seg_global[s])
                    tok_index[at : at + length] = ar[g0 : g0 + length]
            row0 += batch.num_rows
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


class _RouteCopier:
    """Packed kernel: compact rows ``[s0, s0+count)`` of the local layers → ``lm[:, at:at+count, 0]``.

    Per cache-sized block: (1) gather the block's local layers into a contiguous buffer
    (one element per token when the layers are a contiguous range: a single strided loop
    instead of one call per token), (2) transpose it in cache, each token's ``[K]`` ids
    moving as one machine word (or a K·itemsize void), (3) widen into the int32 output,
    contiguous per layer.
    """

    def __init__(self, routes: np.ndarray, select: slice | np.ndarray, lm: np.ndarray) -> None:
        tokens, layers, k = routes.shape
        n_local = lm.shape[0]
        self.select, self.k, self.dtype, self.lm = select, k, routes.dtype, lm
        row_bytes = k * routes.dtype.itemsize
        self.row_dtype: np.dtype[Any] = _ROW_VIEW.get(row_bytes, np.dtype((np.void, row_bytes)))
        self.rows = routes.reshape(tokens, layers * k).view(self.row_dtype)
        contiguous = isinstance(select, slice) and select.step in (None, 1)
        self.span = np.dtype((np.void, n_local * row_bytes)) if contiguous else None
        self.block = max(64, _BLOCK_BYTES // max(1, n_local * row_bytes))
        self.gathered = np.empty((self.block, n_local), dtype=self.row_dtype)
        self.tmp = np.empty((n_local, self.block), dtype=self.row_dtype)
        # int32 storage needs no widening: copy whole 4·K-byte rows.
        self.out_row = np.dtype((np.void, 4 * k))
        self.lm_rows = lm.reshape(n_local, lm.shape[1] * lm.shape[2] * k).view(self.out_row)

    def copy(self, s0: int, count: int, at: int) -> None:
        n_local = self.lm.shape[0]
        for off in range(0, count, self.block):
            c = min(self.block, count - off)
            t = self.tmp[:, :c]
            src = self.rows[s0 + off : s0 + off + c, self.select]
            if self.span is not None:
                g = self.gathered[:c]
                np.copyto(g.view(self.span), src.view(self.span))
                np.copyto(t, g.T)
            else:
                np.copyto(t, src.T)
            a, b = at + off, at + off + c
            if self.dtype == np.dtype(np.int32):
                np.copyto(self.lm_rows[:, a:b], t.view(self.out_row))
            else:
                np.copyto(self.lm[:, a:b, 0, :], t.view(self.dtype).reshape(n_local, c, self.k))


class _RowGatherer:
    """Unpacked kernel: for positions ``[p0, p1)`` of every row, gather the local layers'
    routes (dummy rows where not captured) with one ``take``, transpose in cache, widen into
    the contiguous ``lm[:, p0:p1, :, :]``."""

    def __init__(
        self,
        routes: np.ndarray,
        select: slice | np.ndarray,
        lm: np.ndarray,
        first_row: np.ndarray,
        captured: np.ndarray,
    ) -> None:
        tokens, layers, k = routes.shape
        n_local, positions, columns, _ = lm.shape
        self.k, self.dtype, self.columns, self.select = k, routes.dtype, columns, select
        row_bytes = k * routes.dtype.itemsize
        self.row_dtype: np.dtype[Any] = _ROW_VIEW.get(row_bytes, np.dtype((np.void, row_bytes)))
        self.rows = routes.reshape(tokens, layers * k).view(self.row_dtype)
        self.layer_index = np.arange(layers)[select]
        self.first_row, self.captured = first_row, captured
        self.empty = tokens == 0
        self.block_positions = max(1, (4 * _BLOCK_BYTES) // max(1, columns * n_local * row_bytes))
        self.tmp = np.empty((n_local, self.block_positions * columns), dtype=self.row_dtype)
        dummy = np.tile(np.arange(k, dtype=routes.dtype), n_local)
        self.dummy = np.frombuffer(dummy.tobytes(), dtype=self.row_dtype)
        self.lm_flat = lm.reshape(n_local, positions * columns, k)
        self.lm_rows = self.lm_flat.reshape(n_local, positions * columns * k).view(
            np.dtype((np.void, 4 * k))
        )

    def run(self, t_of_p: np.ndarray, p0: int, p1: int) -> None:
        t = t_of_p[p0:p1]
        c = t.shape[0] * self.columns
        idx = self.first_row[None, :] + t[:, None]
        pad = (t[:, None] >= self.captured[None, :]).reshape(-1)
        flat = idx.reshape(-1)
        flat[pad] = 0
        if self.empty:
            stage = np.empty((c, self.tmp.shape[0]), dtype=self.row_dtype)
            stage[:] = self.dummy
        else:
            # Advanced index on tokens + basic slice on layers: one row copy per token.
            if isinstance(self.select, slice):
                stage = self.rows[flat, self.select]
            else:
                stage = self.rows[flat[:, None], self.layer_index[None, :]]
            stage[pad] = self.dummy
        tmp = self.tmp[:, :c]
        np.copyto(tmp, stage.T)
        q0, q1 = p0 * self.columns, p1 * self.columns
        if self.dtype == np.dtype(np.int32):
            np.copyto(self.lm_rows[:, q0:q1], tmp.view(self.lm_rows.dtype))
        else:
            np.copyto(self.lm_flat[:, q0:q1], tmp.view(self.dtype).reshape(tmp.shape[0], c, self.k))


def _run_copies(
    sources: list[np.ndarray],
    select: slice | np.ndarray,
    lm: np.ndarray,
    jobs: list[tuple[int, int, int, int]],
    pads: list[tuple[int, int]],
) -> None:
    """Packed route copies ``(source, first row, rows, at)`` and dummy rows ``[0 .. K-1]`` at
    ``(at, positions)``; one worker's share, with its own scratch buffers."""
    copiers: dict[int, _RouteCopier] = {}
    for src, s0, count, at in jobs:
        cp = copiers.get(src)
        if cp is None:
            cp = copiers[src] = _RouteCopier(sources[src], select, lm)
        cp.copy(s0, count, at)
    if pads:
        k = lm.shape[3]
        out_row = np.dtype((np.void, 4 * k))
        lm_rows = lm.reshape(lm.shape[0], lm.shape[1] * lm.shape[2] * k).view(out_row)
        dummy = np.arange(k, dtype=np.int32).view(out_row)[0]
        for at, count in pads:
            lm_rows[:, at : at + count] = dummy


# ---------------------------------------------------------------- microbatching
def _trajectory_lengths(table: pa.Table | pa.RecordBatch) -> np.ndarray:
    out: np.ndarray = list_lengths(table.column("prompt_ids")) + list_lengths(
        table.column("response_ids")
    )
    return out


def split_microbatch_indices(
    lengths: Sequence[int] | np.ndarray,
    *,
    max_tokens: int | None = None,
    num_microbatches: int | None = None,
    multiple: int = 1,
    packed: bool = True,
) -> list[np.ndarray]:
    """Row indices of each microbatch; every trajectory stays whole, rows ascending within each.

    Cost of a microbatch: the sum of lengths rounded up to ``multiple`` (packed) or
    ``rows × the longest rounded length`` (unpacked). ``max_tokens`` (dynamic batch size):
    the fewest microbatches, at least ``num_microbatches``, whose costs all fit the budget.
    ``num_microbatches`` alone: exactly that many, balanced by cost. Balancing is
    longest-first onto the least loaded microbatch. Raises `SchemaError` when a trajectory
    alone exceeds the budget, there are fewer trajectories than microbatches, or a length,
    ``multiple`` or ``max_tokens`` is not positive.
    """
    n = np.asarray(lengths, dtype=np.int64)
    if n.ndim != 1 or n.size == 0:
        raise SchemaError(
            f"expected a non-empty 1-D array of trajectory lengths, found shape {list(n.shape)}"
        )
    if int(n.min()) < 1:
        i = int(np.argmin(n))
        raise SchemaError(f"expected trajectory lengths >= 1, found {int(n[i])} at row {i}")
    for name, value in (("multiple", multiple), ("max_tokens", max_tokens)):
        if value is not None and (
            not isinstance(value, int | np.integer) or isinstance(value, bool) or value < 1
        ):
            raise SchemaError(f"{name}: expected a positive int, found {value!r}")
    if max_tokens is None and num_microbatches is None:
        raise SchemaError("expected max_tokens, num_microbatches or both, found neither")
    if num_microbatches is not None and not 1 <= num_microbatches <= n.size:
        raise SchemaError(
            f"num_microbatches: expected 1..{n.size} (one trajectory at least each), found {num_microbatches}"
        )
    cost = _round_up(n, multiple)
    if max_tokens is not None:
        worst = int(cost.max())
        if max_tokens < worst:
            i = int(np.argmax(cost))
            raise SchemaError(
                f"max_tokens: trajectory at row {i} needs {worst} tokens after alignment to {multiple}, "
                f"budget is {max_tokens}; trajectories are never split"
            )
    order = np.argsort(-cost, kind="stable")
    if max_tokens is None:
        return _balance(cost, order, int(num_microbatches or 1))
    # No fewer microbatches than the budget allows, nor than asked for.
    lo = max(int(num_microbatches or 1), -(-int(cost.sum()) // max_tokens))
    for bins in range(lo, n.size + 1):
        groups = _balance(cost, order, bins)
        if all(_cost(cost[g], packed) <= max_tokens for g in groups):
            return groups
    raise SchemaError(f"max_tokens={max_tokens}: no split of {n.size} trajectories fits the budget")


def _cost(costs: np.ndarray, packed: bool) -> int:
    return int(costs.sum()) if packed else int(costs.shape[0] * costs.max())


def _balance(cost: np.ndarray, order: np.ndarray, bins: int) -> list[np.ndarray]:
    load = np.zeros(bins, dtype=np.int64)
    assign = np.empty(cost.shape[0], dtype=np.int64)
    for i in order.tolist():  # per trajectory, on B-sized metadata only
        j = int(np.argmin(load))
        assign[i] = j
        load[j] += cost[i]
    groups = [np.flatnonzero(assign == j) for j in range(bins)]
    groups.sort(key=lambda g: int(g[0]))
    return groups


def split_microbatches(
    table: pa.Table,
    *,
    max_tokens: int | None = None,
    num_microbatches: int | None = None,
    multiple: int = 1,
    packed: bool = True,
) -> list[pa.Table]:
    """Split a rollout table into microbatches (whole trajectories; see `split_microbatch_indices`).

    Each part keeps every column and the schema metadata (the spec).
    """
    from r3arrow.table import take_rows

    groups = split_microbatch_indices(
        _trajectory_lengths(table),
        max_tokens=max_tokens,
        num_microbatches=num_microbatches,
        multiple=multiple,
        packed=packed,
    )
    return [take_rows(table, g) for g in groups]


# ------------------------------------------------------------ packed outputs
def _as_index(x: torch.Tensor | np.ndarray | Sequence[int]) -> torch.Tensor:
    t = x if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))
    return t.to(torch.int64).reshape(-1)


def _packed_positions(
    cu_seqlens: torch.Tensor, cu_padded: torch.Tensor, shift: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sequence, offset within it, packed position) of positions ``0 .. len-1-shift`` of every sequence."""
    lens = (cu_seqlens[1:] - cu_seqlens[:-1] - shift).clamp(min=0)
    seq = torch.repeat_interleave(torch.arange(lens.shape[0], device=lens.device), lens)
    starts = torch.cumsum(lens, 0) - lens
    off = torch.arange(int(lens.sum()), device=lens.device) - starts[seq]
    return seq, off, cu_padded[:-1][seq] + off


def next_token_shift(
    values: torch.Tensor,
    cu_seqlens: torch.Tensor | np.ndarray | Sequence[int],
    cu_seqlens_padded: torch.Tensor | np.ndarray | Sequence[int],
    *,
    fill: float | int = 0,
) -> torch.Tensor:
    """Shift every packed segment left by one: ``out[t] = values[t+1]`` within a sequence.

    ``values``: ``[T]`` or ``[1, T, ...]`` in the full packed layout. The last real
    position of each sequence and all padding get ``fill``. Same shape and dtype as
    ``values``.
    """
    cu, cup = _as_index(cu_seqlens), _as_index(cu_seqlens_padded)
    flat = (
        values.reshape(-1, *values.shape[2:])
        if values.dim() >= 2 and values.shape[0] == 1
        else values
    )
    if flat.shape[0] != int(cup[-1]):
        raise RouteShapeError(f"expected {int(cup[-1])} packed positions, found {flat.shape[0]}")
    out = torch.full_like(flat, fill)
    _, _, where = _packed_positions(cu.to(flat.device), cup.to(flat.device), 1)
    out[where] = flat[where + 1]
    return out.reshape(values.shape)


def packed_to_batch(
    values: torch.Tensor,
    cu_seqlens: torch.Tensor | np.ndarray | Sequence[int],
    cu_seqlens_padded: torch.Tensor | np.ndarray | Sequence[int],
    *,
    fill: float | int = 0,
    width: int | None = None,
) -> torch.Tensor:
    """Scatter per-position packed outputs ``[1, T]``/``[T]`` back to batch order ``[B, width]``.

    Row i holds positions ``0 .. len_i - 2`` of sequence i (position t predicts token t+1),
    then ``fill``; ``width`` defaults to ``max(len) - 1``.
    """
    cu, cup = _as_index(cu_seqlens), _as_index(cu_seqlens_padded)
    flat = values.reshape(-1) if values.dim() == 2 and values.shape[0] == 1 else values
    if flat.dim() != 1 or flat.shape[0] != int(cup[-1]):
        raise RouteShapeError(
            f"expected packed values [1, {int(cup[-1])}] or [{int(cup[-1])}], found {list(values.shape)}"
        )
    lens = cu[1:] - cu[:-1]
    w = int(lens.max()) - 1 if width is None else int(width)
    if w < int(lens.max()) - 1:
        raise RouteShapeError(f"width: expected at least {int(lens.max()) - 1}, found {w}")
    out = torch.full((lens.shape[0], max(w, 0)), fill, dtype=flat.dtype, device=flat.device)
    seq, off, where = _packed_positions(cu.to(flat.device), cup.to(flat.device), 1)
    out[seq, off] = flat[where]
    return out


def unpacked_to_batch(
    values: torch.Tensor, seq_lens: np.ndarray | Sequence[int], *, fill: float | int = 0
) -> torch.Tensor:
    """``[B, S]`` per-position outputs → ``[B, max(len) - 1]``, ``fill`` past ``len_i - 1``."""
    lens = torch.as_tensor(np.asarray(seq_lens, dtype=np.int64), device=values.device)
    w = int(lens.max()) - 1
    if values.dim() != 2 or values.shape[0] != lens.shape[0] or values.shape[1] < w:
        raise RouteShapeError(
            f"expected values [{lens.shape[0]}, >= {w}], found {list(values.shape)}"
        )
    out = values[:, :w].clone()
    out[torch.arange(w, device=values.device)[None, :] >= (lens - 1)[:, None]] = fill
    return out


__all__ = [
    "MegatronCollator",
    "Microbatch",
    "alignment_multiple",
    "next_token_shift",
    "packed_to_batch",
    "split_microbatch_indices",
    "split_microbatches",
    "unpacked_to_batch",
]
