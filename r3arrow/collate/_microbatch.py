"""`Microbatch`, the collator's output, and the scatter of per-position model outputs
back to batch order (``docs/design.md`` §5, *Labels and outputs*)."""

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
    whole packed row before context-parallel slicing (Megatron's ``PackedSeqParams``).
    R3 off: ``spec``, ``routes`` and ``layer_major`` are None, ``layers`` is empty and
    ``captured`` equals ``seq_lens``; `replay_tensor`/`replay_targets` raise `ReplayError`.
    Route-local fallback (``docs/fallback.md``): `fallback_mask`, `fallback_routes` and
    `token_routes`.
    A stage of dense layers only: ``layers`` is empty, `replay_targets` is ``[]`` and the
    masks are those of the stages with routers.
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
    #: int32 ``[L_local, P, C, K]`` (C = b unpacked, 1 packed); flattened over (P, C) it is
    #: Megatron's token order. None with R3 off.
    layer_major: torch.Tensor | None
    #: bool ``[b, S]`` (packed ``[1, T]``), like `padding_mask`: True where the rollout
    #: delivered no route (``routes_missing``; `layer_major` holds a placeholder there) and
    #: ``install_replay(..., missing="native")`` lets the router choose; False at padding.
    #: None when the table has no ``routes_missing`` column (``docs/fallback.md``).
    fallback_mask: torch.Tensor | None = None
    #: Fallback token routes of this rank's routers: marked non-padding router tokens
    #: (after CP and SP slicing) times ``len(layers)``; 0 without marks.
    fallback_routes: int = 0
    #: Token routes of this rank's routers: non-padding router tokens times ``len(layers)``
    #: (the denominator of the fallback fraction, ``sum(fallback_routes) /
    #: sum(token_routes)`` over a schedule's microbatches).
    token_routes: int = 0
    #: A DP padding microbatch (`r3arrow.microbatch.padding_table`): all padding, loss mask 0.
    is_padding: bool = False
    #: `layer_major`'s torch version counter when the collator's fused pass checked its ids
    #: (None: not checked); see `ids_validated`.
    validated_version: int | None = None

    @property
    def ids_validated(self) -> bool:
        """Whether `layer_major` still holds the ids the collator checked (`install_replay`
        then skips its scan for ``spec.num_experts``). In-place torch writes void it; writes
        through ``.numpy()`` are not seen."""
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
        """int32 ``[b, S, L_local, K]`` (packed ``[1, T, ...]``), a view; None with R3 off."""
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
        """int32 ``[L_local, num_router_tokens, K]`` view of `layer_major` in Megatron's token
        order (flat ``s * b + b_idx``), this TP rank's slice under sequence parallelism.
        Raises `ReplayError` with R3 off."""
        if self.layer_major is None:
            raise ReplayError(
                "replay targets: expected a microbatch collated with routes, found one collated "
                "with R3 off (MegatronCollator(spec=None), a table without routes); routers "
                "route freely, install no replay targets"
            )
        n_layers, positions, columns, k = self.layer_major.shape
        flat = self.layer_major.reshape(n_layers, positions * columns, k)
        if self.sequence_parallel:
            n = self.num_router_tokens
            flat = flat[:, self.tp_rank * n : (self.tp_rank + 1) * n]
        return flat

    def replay_targets(self) -> list[torch.Tensor]:
        """The rows of `replay_tensor`, one contiguous int32 ``[num_router_tokens, K]`` view per
        local router. Raises `ReplayError` with R3 off."""
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
        """Per-position outputs over the full (pre-CP) layout → ``[B, max(seq_lens) - 1]``
        (`packed_to_batch` / `unpacked_to_batch`). With CP, gather the ranks' outputs first
        and place them with `token_index`."""
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
            f"{f'fallback_routes={self.fallback_routes}, ' if self.fallback_routes else ''}"
            f"tp={self.tp_rank}/{self.tp_size}{' sp' if self.sequence_parallel else ''}, "
            f"cp={self.cp_rank}/{self.cp_size})"
        )


def _as_index(x: torch.Tensor | np.ndarray | Sequence[int]) -> torch.Tensor:
    t = x if isinstance(x, torch.Tensor) else torch.as_tensor(np.asarray(x))
    return t.to(torch.int64).reshape(-1)


def _packed_positions(
    cu_seqlens: torch.Tensor, cu_padded: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sequence, offset, packed position) of positions ``0 .. len-2`` of each sequence."""
    lens = (cu_seqlens[1:] - cu_seqlens[:-1] - 1).clamp(min=0)
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
    """``out[t] = values[t+1]`` within each packed sequence (``[T]`` or ``[1, T, ...]``, full
    layout); the last real position and all padding get ``fill``."""
    cu, cup = _as_index(cu_seqlens), _as_index(cu_seqlens_padded)
    flat = (
        values.reshape(-1, *values.shape[2:])
        if values.dim() >= 2 and values.shape[0] == 1
        else values
    )
    if flat.shape[0] != int(cup[-1]):
        raise RouteShapeError(f"expected {int(cup[-1])} packed positions, found {flat.shape[0]}")
    out = torch.full_like(flat, fill)
    _, _, where = _packed_positions(cu.to(flat.device), cup.to(flat.device))
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
    """Packed outputs ``[1, T]``/``[T]`` → ``[B, width]``: row i holds positions
    ``0 .. len_i - 2`` of sequence i, then ``fill``; ``width`` defaults to ``max(len) - 1``."""
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
    seq, off, where = _packed_positions(cu.to(flat.device), cup.to(flat.device))
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
