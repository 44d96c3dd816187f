"""Keyword arguments for ``GPTModel.forward`` from a `Microbatch`: the router padding mask
each pipeline stage needs and, packed, ``PackedSeqParams`` (``docs/design.md`` §5,
*Sequence parallelism*)."""

from __future__ import annotations

from typing import Any

from r3arrow.collate import Microbatch
from r3arrow.megatron._routers import _parallel_state


def _packed_seq_params(mb: Microbatch) -> Any:
    """``PackedSeqParams`` (THD) of a packed microbatch."""
    from megatron.core.packed_seq_params import PackedSeqParams

    if not mb.packed or mb.cu_seqlens is None or mb.cu_seqlens_padded is None:
        raise ValueError("model_inputs: expected a packed microbatch, found an unpacked one")
    return PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=mb.cu_seqlens,
        cu_seqlens_kv=mb.cu_seqlens,
        cu_seqlens_q_padded=mb.cu_seqlens_padded,
        cu_seqlens_kv_padded=mb.cu_seqlens_padded,
        max_seqlen_q=mb.max_seqlen,
        max_seqlen_kv=mb.max_seqlen,
    )


def _unwrapped_model(model: Any) -> Any:
    """The module with ``pre_process`` under ``.module`` wrappers, else `TypeError`."""
    if isinstance(model, list | tuple):
        raise TypeError(
            f"model: expected one model chunk (the one this microbatch enters), found a "
            f"{type(model).__name__} of {len(model)}"
        )
    m, depth = model, 0
    while not hasattr(m, "pre_process") and hasattr(m, "module") and depth < 8:
        m, depth = m.module, depth + 1
    if not hasattr(m, "pre_process"):
        raise TypeError(
            f"model: expected a GPTModel (or a wrapper of one) with a pre_process attribute, "
            f"found {type(model).__name__}"
        )
    return m


def _check_model_parallel(mb: Microbatch, model: Any) -> None:
    """The model's TP size and sequence parallelism must be the microbatch's."""
    config = getattr(model, "config", None)
    if config is None:
        return
    sp = bool(getattr(config, "sequence_parallel", False))
    tp = int(getattr(config, "tensor_model_parallel_size", 1) or 1)
    if sp != mb.sequence_parallel or (sp and tp != mb.tp_size):
        raise ValueError(
            f"model_inputs: expected a microbatch collated for the model's "
            f"tensor_model_parallel_size={tp}, sequence_parallel={sp}; found tp_size="
            f"{mb.tp_size}, sequence_parallel={mb.sequence_parallel}"
        )


def _is_first_stage(vp_stage: int | None) -> bool:
    """Megatron's ``pre_process`` of model chunk ``vp_stage``; True before model parallelism."""
    parallel_state = _parallel_state()
    if parallel_state is None:
        return True
    if parallel_state.get_virtual_pipeline_model_parallel_world_size() is not None:
        if vp_stage is None:
            raise ValueError(
                "model_inputs: expected vp_stage (the model chunk) or pre_process with virtual "
                "pipeline parallelism, found neither"
            )
        if vp_stage != 0:
            return False
    return bool(parallel_state.get_pipeline_model_parallel_rank() == 0)


def _stage_padding_mask(mb: Microbatch, *, pre_process: bool) -> Any:
    """The whole mask, or this TP rank's ``[b, S/tp]`` slice where Megatron scatters none."""
    pad = mb.padding_mask
    if pre_process or not mb.sequence_parallel or mb.tp_size == 1:
        return pad
    per = int(pad.shape[1]) // mb.tp_size  # the collator aligns positions to tp
    return pad[:, mb.tp_rank * per : (mb.tp_rank + 1) * per].contiguous()


def model_inputs(
    mb: Microbatch,
    *,
    labels: bool = True,
    pre_process: bool | None = None,
    model: Any = None,
    vp_stage: int | None = None,
) -> dict[str, Any]:
    """Keyword arguments for ``GPTModel.forward``: tokens, positions, the router padding mask
    (True = padding) this stage's routers need, labels and, packed, ``PackedSeqParams``.

    The stage embeds tokens (whole mask) or not (this TP rank's sequence-parallel slice)
    according to, first found: ``pre_process``; ``model.pre_process`` (``model``: the chunk
    the microbatch enters, its TP size and sequence parallelism checked against the
    microbatch's); Megatron's ``parallel_state`` (pipeline rank 0 and, virtual pipelining,
    ``vp_stage == 0``); else the first stage.

    Raises `TypeError` for a ``model`` that is a list of chunks or has no ``pre_process``,
    `ValueError` for a model whose TP size or sequence parallelism differ from the
    microbatch's, or for virtual pipelining without ``vp_stage`` or ``pre_process``.
    """
    chunk = None if model is None else _unwrapped_model(model)
    if chunk is not None:
        _check_model_parallel(mb, chunk)
    if pre_process is None:
        pre_process = bool(chunk.pre_process) if chunk is not None else _is_first_stage(vp_stage)
    out: dict[str, Any] = {
        "input_ids": mb.input_ids,
        "position_ids": mb.position_ids,
        "attention_mask": None,
        "padding_mask": _stage_padding_mask(mb, pre_process=bool(pre_process)),
    }
    if labels:
        out["labels"] = mb.labels
    if mb.packed:
        out["packed_seq_params"] = _packed_seq_params(mb)
    return out
