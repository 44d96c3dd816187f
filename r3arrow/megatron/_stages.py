"""Which routers a pipeline rank builds (``docs/design.md`` §6 PP-local layers), and
`collator_for`, the one way to build a collator from a Megatron config or model."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from r3arrow._checks import check_int
from r3arrow.collate import MegatronCollator, Parallelism
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
    if pp == 1:
        return range(n)
    if n % pp:
        raise ReplayError(
            f"stage layers: expected num_layers divisible by pipeline size {pp}, found {n}"
        )
    per_rank = n // pp
    if vp is None:
        return range(pp_rank * per_rank, (pp_rank + 1) * per_rank)
    if per_rank % vp:
        raise ReplayError(
            f"stage layers: expected {per_rank} layers per rank divisible by vpp size {vp}"
        )
    per_chunk = per_rank // vp
    start = int(vp_stage or 0) * (n // vp) + pp_rank * per_chunk
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
    params: dict[str, Any] = {}
    sizes: dict[str, Any] = {}
    if config is not None:
        sizes = {
            "tp_size": int(getattr(config, "tensor_model_parallel_size", 1) or 1),
            "cp_size": int(getattr(config, "context_parallel_size", 1) or 1),
            "sequence_parallel": bool(getattr(config, "sequence_parallel", False)),
        }
        params["fp8"] = bool(getattr(config, "fp8", None))
    ps = _parallel_state()
    if tp_rank is None:
        tp_rank = 0 if ps is None else int(ps.get_tensor_model_parallel_rank())
    if cp_rank is None:
        cp_rank = 0 if ps is None else int(ps.get_context_parallel_rank())
    params["parallel"] = Parallelism(tp_rank=tp_rank, cp_rank=cp_rank, **sizes)
    return MegatronCollator(spec, layers=layers, **(params | kwargs))
