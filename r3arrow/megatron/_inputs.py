"""Keyword arguments for ``GPTModel.forward`` from a `Microbatch`.

The router padding mask travels with the model inputs (``docs/design.md``, "Router
padding mask and dummy rows"), and packed microbatches carry ``PackedSeqParams`` (THD).

Sequence parallelism and pipeline stages: megatron-core (0.16.1) scatters the padding mask
to the TP rank's sequence-parallel slice in ``GPTModel._preprocess`` only on the stage that
embeds tokens (``pre_process``, the first model chunk of the first pipeline rank, and only
when ``decoder_input`` is None). Every later stage passes the mask through unchanged, while
its routers see the ``S/tp`` hidden states received from the previous stage; a whole
``[b, S]`` mask then fails in the routers' padding-aware aux-loss and z-loss arithmetic.
`model_inputs` hands those stages the slice Megatron's scatter would have produced.
"""

from __future__ import annotations

import sys
from typing import Any

from r3arrow.collate import Microbatch


def _packed_seq_params(mb: Microbatch) -> Any:
    """``PackedSeqParams`` (THD) of a packed microbatch: real and padded cu_seqlens, max length."""
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
    """The module under DDP / ``Float16Module`` wrappers (``.module`` chains) with a
    ``pre_process`` attribute. Raises `TypeError` for a list of model chunks or a model
    without ``pre_process``."""
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
    """Megatron's ``pre_process`` of this rank's model chunk ``vp_stage``, from parallel_state
    (True when megatron-core is not imported or model parallelism is not initialised)."""
    # Model parallelism cannot be initialised before megatron-core is imported: never import
    # it (heavy, warns on import) only to learn that.
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is None or not parallel_state.model_parallel_is_initialized():
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
    """The router padding mask a stage passes to ``GPTModel.forward``.

    ``pre_process=True`` (the stage embeds tokens and scatters the mask itself): the whole
    ``mb.padding_mask`` ``[b, S]`` (packed ``[1, T]``). Otherwise, under sequence parallelism
    with ``tp_size > 1``: this TP rank's slice ``[b, S/tp]`` of the local positions,
    ``[tp_rank*S/tp, (tp_rank+1)*S/tp)``, contiguous (a copy of ``b*S/tp`` bools), which
    is exactly ``scatter_to_sequence_parallel_region`` of the ``[S, b]`` mask transposed
    back, so the routers' flat token order matches `Microbatch.replay_targets`. Without
    sequence parallelism every stage gets the whole mask.
    """
    pad = mb.padding_mask
    if pre_process or not mb.sequence_parallel or mb.tp_size == 1:
        return pad
    positions = int(pad.shape[1])
    # The collator aligns local positions to a multiple of tp (alignment_multiple).
    per = positions // mb.tp_size
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
    (True = padding), labels and ``PackedSeqParams`` when packed.

    The padding mask is what this pipeline stage's routers need (`_stage_padding_mask`):
    the whole ``[b, S]`` on the stage that embeds tokens, which scatters it itself; this TP
    rank's sequence-parallel slice ``[b, S/tp]`` on every later stage. The stage is, first
    found: ``pre_process`` as given; ``model.pre_process`` (``model``: the ``GPTModel`` chunk
    the microbatch enters, wrappers with ``.module`` unwrapped; its config's TP size and
    sequence parallelism are checked against the microbatch); Megatron's ``parallel_state``
    when imported and initialised (pipeline rank 0, and model chunk ``vp_stage == 0`` under
    virtual pipelining); else the first stage (no pipeline).

    Raises `TypeError` for a ``model`` that is a list of chunks or has no ``pre_process``,
    `ValueError` for a model whose TP size or sequence parallelism differ from the
    microbatch's, or for virtual pipelining without ``vp_stage`` or ``pre_process``.
    """
    if pre_process is None:
        if model is not None:
            chunk = _unwrapped_model(model)
            _check_model_parallel(mb, chunk)
            pre_process = bool(chunk.pre_process)
        else:
            pre_process = _is_first_stage(vp_stage)
    elif model is not None:
        _check_model_parallel(mb, _unwrapped_model(model))
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
