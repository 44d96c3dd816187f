"""Fitting a pipeline stage: which routers it builds (``docs/design.md`` §6 PP-local
layers); `collator_for`, the one way to build a collator from a Megatron config or model; and
`model_inputs`, ``GPTModel.forward``'s keyword arguments with the router padding mask the
stage needs and, packed, ``PackedSeqParams`` (§5, *Sequence parallelism*)."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from r3arrow._checks import check_int
from r3arrow.collate import MegatronCollator, Microbatch, Parallelism
from r3arrow.errors import ReplayError
from r3arrow.megatron._routers import (
    _check_spec_fits,
    _model_router_layers,
    _parallel_state,
    _routers,
)
from r3arrow.spec import RouteSpec

_UNEVEN = (
    "pipeline_model_parallel_layout",
    "num_layers_in_first_pipeline_stage",
    "num_layers_in_last_pipeline_stage",
    "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split",
)


def _moe_layer_pattern(config: Any) -> list[bool]:
    """Per global decoder layer: True where it has a router (``moe_layer_freq``; MTP excluded)."""
    n = int(config.num_layers)
    if not getattr(config, "num_moe_experts", None):
        return [False] * n
    freq = getattr(config, "moe_layer_freq", 1)
    if isinstance(freq, int | np.integer) and not isinstance(freq, bool):
        if freq < 1:
            raise ReplayError(
                f"moe_layer_freq: expected a positive int or a 0/1 list, found {freq}"
            )
        return [i % int(freq) == 0 for i in range(n)]
    pattern = [int(x) for x in freq]
    if len(pattern) != n or any(x not in (0, 1) for x in pattern):
        raise ReplayError(
            f"moe_layer_freq: expected {n} entries of 0/1 (one per layer), found {pattern}"
        )
    return [x == 1 for x in pattern]


def _megatron_available() -> bool:
    try:
        import megatron.core.transformer.transformer_block  # noqa: F401
    except ImportError:
        return False
    return True


def _stage_range(config: Any, pp_rank: int, vp_stage: int | None, use_megatron: bool) -> range:
    if use_megatron:
        from megatron.core.transformer.transformer_block import get_num_layers_to_build
        from megatron.core.transformer.transformer_layer import get_transformer_layer_offset

        offset = int(get_transformer_layer_offset(config, vp_stage=vp_stage, pp_rank=pp_rank))
        count = int(get_num_layers_to_build(config, vp_stage=vp_stage, pp_rank=pp_rank))
        return range(offset, offset + count)
    uneven = [a for a in _UNEVEN if getattr(config, a, None)]
    if uneven:
        raise ReplayError(
            f"stage layers: uneven pipeline settings {uneven} need megatron-core installed"
        )
    n = int(config.num_layers)
    pp = int(getattr(config, "pipeline_model_parallel_size", 1) or 1)
    vp = getattr(config, "virtual_pipeline_model_parallel_size", None)
    chunks, chunk = (1, 0) if vp is None else (int(vp), int(vp_stage or 0))
    if pp == 1:
        return range(n)
    if n % pp:
        raise ReplayError(
            f"stage layers: expected num_layers divisible by pipeline size {pp}, found {n}"
        )
    per_chunk, rest = divmod(n // pp, chunks)
    if rest:
        raise ReplayError(
            f"stage layers: expected {n // pp} layers per rank divisible by vpp size {vp}"
        )
    start = chunk * (n // chunks) + pp_rank * per_chunk
    return range(start, start + per_chunk)


def router_layers(
    source: Any,
    *,
    pp_rank: int | None = None,
    vp_stage: int | None = None,
    use_megatron: bool | None = None,
) -> list[int]:
    """Global 0-based ids of the routers a pipeline rank builds, in build (RouterReplay) order.

    ``source``: a model, a router or a list of either (``layer_number - 1`` of its routers,
    MTP excluded; the keywords raise `TypeError`), or a Megatron ``TransformerConfig``: the
    MoE layers (``moe_layer_freq``) of rank ``pp_rank``'s split (default: Megatron's current
    rank, 0 without pipelining), every model chunk in order when ``vp_stage`` is None under
    virtual pipelining; by megatron-core's own layer split when ``use_megatron`` (default:
    when importable), else uniform-split arithmetic.

    Raises `TypeError`/`ValueError` for a ``pp_rank`` not an int in ``[0, pp)`` (or missing
    under pipelining without megatron-core) and `ReplayError` for a router without
    ``layer_number`` or config values that cannot be split (``moe_layer_freq`` not a
    positive int or one 0/1 per layer, non-divisible sizes, uneven settings without
    megatron-core).
    """
    if (
        isinstance(source, torch.nn.Module | list | tuple)
        or getattr(source, "router_replay", None) is not None
    ):
        if pp_rank is not None or vp_stage is not None or use_megatron is not None:
            raise TypeError(
                "router_layers: expected pp_rank/vp_stage/use_megatron with a config only, "
                "found them with a model or routers (their layer_number decides)"
            )
        return _model_router_layers(source)
    config = source
    mega = _megatron_available() if use_megatron is None else bool(use_megatron)
    pp = int(getattr(config, "pipeline_model_parallel_size", 1) or 1)
    if pp_rank is None:
        if pp == 1:
            pp_rank = 0
        elif mega:
            from megatron.core import parallel_state

            pp_rank = int(parallel_state.get_pipeline_model_parallel_rank())
        else:
            raise ValueError(
                "router_layers: expected pp_rank with pipeline parallelism, found None"
            )
    pp_rank = check_int(pp_rank, "pp_rank", minimum=0, maximum=pp - 1)
    vp = getattr(config, "virtual_pipeline_model_parallel_size", None)
    stages: list[int | None] = (
        [vp_stage] if vp_stage is not None or vp is None or pp == 1 else list(range(int(vp)))
    )
    moe = _moe_layer_pattern(config)
    return [i for stage in stages for i in _stage_range(config, pp_rank, stage, mega) if moe[i]]


def collator_for(
    spec: RouteSpec | None,
    config: Any = None,
    *,
    model: Any = None,
    pp_rank: int | None = None,
    vp_stage: int | None = None,
    tp_rank: int | None = None,
    cp_rank: int | None = None,
    **kwargs: Any,
) -> MegatronCollator:
    """A `MegatronCollator` for this rank: layers from ``model``'s routers or from ``config``
    and the PP/VPP rank (none on a stage of dense layers only: its microbatches carry no
    routes); TP/CP sizes, sequence parallelism and FP8 from ``config``; ranks from Megatron's
    ``parallel_state`` when initialised (else 0). Extra keywords go to the collator and win
    (``parallel=`` replaces the whole `Parallelism`). ``spec=None``: R3 off (no layers).
    `TypeError` without a config or a model; `ReplayError` for a spec whose layer count is
    not the model's (``num_layers``, or plus ``mtp_num_layers``)."""
    if config is None and model is None:
        raise TypeError("collator_for: expected a config or a model, found neither")
    layers = None
    if spec is not None:
        routers = [] if model is None else _routers(model)
        _check_spec_fits(spec, [config, *(getattr(r, "config", None) for r in routers)])
        if model is not None:
            layers = _model_router_layers(routers)
        else:
            layers = router_layers(config, pp_rank=pp_rank, vp_stage=vp_stage)
    ps = _parallel_state()  # (getattr of a None config: the defaults)
    if tp_rank is None:
        tp_rank = 0 if ps is None else int(ps.get_tensor_model_parallel_rank())
    if cp_rank is None:
        cp_rank = 0 if ps is None else int(ps.get_context_parallel_rank())
    parallel = Parallelism(
        tp_size=int(getattr(config, "tensor_model_parallel_size", 1) or 1),
        tp_rank=tp_rank,
        cp_size=int(getattr(config, "context_parallel_size", 1) or 1),
        cp_rank=cp_rank,
        sequence_parallel=bool(getattr(config, "sequence_parallel", False)),
    )
    params: dict[str, Any] = {"fp8": bool(getattr(config, "fp8", None)), "parallel": parallel}
    return MegatronCollator(spec, layers=layers, **(params | kwargs))


def _model_chunk(mb: Microbatch, model: Any) -> Any:
    """The module with ``pre_process`` under ``.module`` wrappers (else `TypeError`), its TP
    size and sequence parallelism checked against the microbatch's."""
    if isinstance(model, list | tuple):
        raise TypeError(
            f"model: expected one model chunk (the one this microbatch enters), found a "
            f"{type(model).__name__} of {len(model)}"
        )
    m = model
    for _ in range(8):
        if hasattr(m, "pre_process") or not hasattr(m, "module"):
            break
        m = m.module
    if not hasattr(m, "pre_process"):
        raise TypeError(
            f"model: expected a GPTModel (or a wrapper of one) with a pre_process attribute, "
            f"found {type(model).__name__}"
        )
    config = getattr(m, "config", None)
    sp = bool(getattr(config, "sequence_parallel", False))
    tp = int(getattr(config, "tensor_model_parallel_size", 1) or 1)
    if config is not None and (sp != mb.sequence_parallel or (sp and tp != mb.tp_size)):
        raise ValueError(
            f"model_inputs: expected a microbatch collated for the model's "
            f"tensor_model_parallel_size={tp}, sequence_parallel={sp}; found tp_size="
            f"{mb.tp_size}, sequence_parallel={mb.sequence_parallel}"
        )
    return m


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
    chunk = None if model is None else _model_chunk(mb, model)
    if pre_process is None and chunk is not None:
        pre_process = bool(chunk.pre_process)
    elif pre_process is None:  # Megatron's pre_process of chunk vp_stage (none: the first)
        ps = _parallel_state()
        virtual = ps is not None and ps.get_virtual_pipeline_model_parallel_world_size() is not None
        if virtual and vp_stage is None:
            raise ValueError(
                "model_inputs: expected vp_stage (the model chunk) or pre_process with virtual "
                "pipeline parallelism, found neither"
            )
        first = ps is None or ps.get_pipeline_model_parallel_rank() == 0
        pre_process = bool(first and (not virtual or vp_stage == 0))
    out: dict[str, Any] = {
        "input_ids": mb.input_ids,
        "position_ids": mb.position_ids,
        "attention_mask": None,
        "padding_mask": _stage_padding_mask(mb, pre_process=bool(pre_process)),
    }
    if labels:
        out["labels"] = mb.labels
    if mb.packed:  # THD
        from megatron.core.packed_seq_params import PackedSeqParams

        if mb.cu_seqlens is None or mb.cu_seqlens_padded is None:
            raise ValueError("model_inputs: expected cu_seqlens on a packed microbatch, found None")
        out["packed_seq_params"] = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=mb.cu_seqlens,
            cu_seqlens_kv=mb.cu_seqlens,
            cu_seqlens_q_padded=mb.cu_seqlens_padded,
            cu_seqlens_kv_padded=mb.cu_seqlens_padded,
            max_seqlen_q=mb.max_seqlen,
            max_seqlen_kv=mb.max_seqlen,
        )
    return out
