"""Keyword arguments for ``GPTModel.forward`` from a `Microbatch`.

The router padding mask travels with the model inputs (``docs/design.md``, "Router
padding mask and dummy rows"), and packed microbatches carry ``PackedSeqParams`` (THD).
"""

from __future__ import annotations

from typing import Any

from r3arrow.collate import Microbatch


def packed_seq_params(mb: Microbatch) -> Any:
    """``PackedSeqParams`` (THD) of a packed microbatch: real and padded cu_seqlens, max length."""
    from megatron.core.packed_seq_params import PackedSeqParams

    if not mb.packed or mb.cu_seqlens is None or mb.cu_seqlens_padded is None:
        raise ValueError("packed_seq_params: expected a packed microbatch, found an unpacked one")
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=mb.cu_seqlens,
        cu_seqlens_kv=mb.cu_seqlens,
        cu_seqlens_q_padded=mb.cu_seqlens_padded,
        cu_seqlens_kv_padded=mb.cu_seqlens_padded,
        max_seqlen_q=mb.max_seqlen,
        max_seqlen_kv=mb.max_seqlen,
    )


def model_inputs(mb: Microbatch, *, labels: bool = True) -> dict[str, Any]:
    """Keyword arguments for ``GPTModel.forward``: tokens, positions, the router padding mask
    (``[b, S]``, True = padding), labels and ``PackedSeqParams`` when packed."""
    out: dict[str, Any] = {
        "input_ids": mb.input_ids,
        "position_ids": mb.position_ids,
        "attention_mask": None,
        "padding_mask": mb.padding_mask,
    }
    if labels:
        out["labels"] = mb.labels
    if mb.packed:
        out["packed_seq_params"] = packed_seq_params(mb)
    return out
