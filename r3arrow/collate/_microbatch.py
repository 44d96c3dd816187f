"""`Microbatch`, the collator's output, and the scatter of per-position model outputs.

A microbatch holds Megatron's model inputs and one layer-major int32 replay buffer whose
per-layer slices are the replay targets (views, no copy). `next_token_shift`,
`packed_to_batch` and `unpacked_to_batch` bring per-position outputs (e.g. logprobs)
from the packed or padded layout back to batch order.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from r3arrow.errors import ReplayError, RouteShapeError
from r3arrow.spec import RouteSpec


@dataclasses.dataclass(frozen=True, eq=False, repr=False)
class Microbatch:
    """One microbatch for Megatron-core, local to this rank's CP chunk and pipeline stage.

    ``input_ids``/``position_ids``/``labels`` int64, ``loss_mask``/``label_mask`` float32,
    ``padding_mask`` bool (True = not a replayed route), all ``[b, S]`` (packed: ``[1, T]``).
    ``loss_mask`` is aligned with the input tokens (0 on the prompt); ``labels[t]`` is
    token t+1 of the same sequence and ``label_mask[t] = loss_mask[t+1]`` (0 where there is
    no next token). ``cu_seqlens``/``cu_seqlens_padded`` (int32, packed only) describe the
    whole packed row before context-parallel slicing, as Megatron's ``PackedSeqParams`` wants.

    R3 off (collated by ``MegatronCollator(spec=None)`` from a table without routes):
    ``spec``, ``routes`` and ``layer_major`` are None, ``layers`` is empty, ``captured``
    equals ``seq_lens`` (routers route every real token freely) and ``padding_mask`` is True
    at alignment and batch padding only; `replay_tensor`/`replay_targets` raise `ReplayError`.
    Padding microbatches (see `is_padding`) hold only dummy rows and loss mask 0.
    """

    spec: RouteSpec | None
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
    #: None with R3 off.
    layer_major: torch.Tensor | None
    #: True for a DP padding microbatch (`r3arrow.microbatch.padding_table`): every
    #: position is padding, the loss mask is 0; it only keeps DP ranks' schedules in step.
    is_padding: bool = False
    #: Set by the collator when its fused pass checked the router-id rules on `layer_major`
    #: (ids in ``[0, spec.num_experts)``, no expert twice per row; ``docs/collation.md``):
    #: `layer_major`'s torch version counter at that time (None: not checked). See
    #: `ids_validated`.
    validated_version: int | None = None

    # -------------------------------------------------------------- derived
    @property
    def ids_validated(self) -> bool:
        """Whether `layer_major` still holds the ids the collator checked: `install_replay`
        then skips its own id scan for ``spec.num_experts``. Any in-place torch write into
        `layer_major` (or a view of it) bumps its version counter and voids this; writes that
        bypass torch (through ``.numpy()``) are not seen: build a new microbatch instead."""
        lm = self.layer_major
        return (
            lm is not None
            and self.validated_version is not None
            and int(lm._version) == self.validated_version
        )

    @property
    def r3(self) -> bool:
        """Whether the microbatch carries replay targets (False: collated with R3 off)."""
        return self.layer_major is not None

    @property
    def routes(self) -> torch.Tensor | None:
        """int32 ``[b, S, L_local, K]`` (packed: ``[1, T, L_local, K]``), a view of the targets;
        None with R3 off."""
        if self.layer_major is None:
            return None
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
        columns, positions = (int(d) for d in self.padding_mask.shape)  # packed: columns 1
        if self.sequence_parallel:
            positions //= self.tp_size
        return int(positions * columns)

    def replay_tensor(self) -> torch.Tensor:
        """int32 ``[L_local, num_router_tokens, K]`` view of `layer_major`: this rank's targets.

        Token order is Megatron's: flat index ``s * b + b_idx`` of the ``[s, b]`` hidden
        states (packed ``[1, T]``: T order), sliced to this TP rank under sequence
        parallelism. Raises `ReplayError` with R3 off (no routes were collated).
        """
        if self.layer_major is None:
            raise ReplayError(
                "replay targets: expected a microbatch collated with routes, found one collated "
                "with R3 off (MegatronCollator(spec=None), a table without routes); routers "
                "route freely, install no replay targets"
            )
        n_layers, positions, columns, k = self.layer_major.shape
        flat = self.layer_major.reshape(n_layers, positions * columns, k)
        if self.sequence_parallel and self.tp_size > 1:
            per = positions // self.tp_size * columns
            flat = flat[:, self.tp_rank * per : (self.tp_rank + 1) * per]
        return flat

    def replay_targets(self) -> list[torch.Tensor]:
        """One contiguous int32 ``[num_router_tokens, K]`` tensor per local router, in layer
        order: the rows of `replay_tensor` (views, no copy). Raises `ReplayError` with R3 off."""
        return list(self.replay_tensor().unbind(0))

    def to(self, device: torch.device | str, *, non_blocking: bool = False) -> Microbatch:
        """This microbatch with every tensor on ``device``."""

        moved: dict[str, Any] = {
            f.name: v.to(device, non_blocking=non_blocking)
            for f in dataclasses.fields(self)
            if isinstance(v := getattr(self, f.name), torch.Tensor)
        }
        lm = moved.get("layer_major")
        moved["validated_version"] = (
            int(lm._version) if lm is not None and self.ids_validated else None
        )
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
        kind = "packed" if self.packed else "unpacked"
        return (
            f"Microbatch({kind} {shape}, sequences={self.num_sequences}, "
            f"layers={list(self.layers) if self.r3 else 'r3 off'}, "
            f"router_tokens={self.num_router_tokens}, "
            f"{'padding, ' if self.is_padding else ''}"
            f"tp={self.tp_rank}/{self.tp_size}{' sp' if self.sequence_parallel else ''}, "
            f"cp={self.cp_rank}/{self.cp_size})"
        )


def _as_index(x: torch.Tensor | np.ndarray | Sequence[int]) -> torch.Tensor:
    t = x if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))
    return t.to(torch.int64).reshape(-1)


def _packed_positions(
    cu_seqlens: torch.Tensor, cu_padded: torch.Tensor, shift: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sequence, offset, packed position) of positions ``0 .. len-1-shift`` of each sequence."""
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
            f"expected packed values [1, {int(cup[-1])}] or [{int(cup[-1])}], "
            f"found {list(values.shape)}"
        )
    lens = cu[1:] - cu[:-1]
    w = int(lens.max()) - 1 if width is None else int(width)
    if w < int(lens.max()) - 1:
        raise ValueError(f"width: expected at least {int(lens.max()) - 1}, found {w}")
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
