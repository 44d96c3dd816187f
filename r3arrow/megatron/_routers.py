"""Access to megatron-core's ``RouterReplay`` and to the MoE routers of a model.

megatron-core is imported inside the functions only, so importing r3arrow.megatron never
needs it.
"""

from __future__ import annotations

import types
from typing import Any

import torch

from r3arrow.errors import ReplayError


def _router_replay() -> types.ModuleType:
    """megatron-core's ``router_replay`` module; ImportError with an install hint without it."""
    try:
        from megatron.core.transformer.moe import router_replay
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "r3arrow.megatron needs megatron-core >= 0.16 with router replay "
            "(pip install 'r3arrow[megatron]')"
        ) from exc
    mod: types.ModuleType = router_replay
    return mod


def _instances() -> list[Any]:
    """Every ``RouterReplay`` instance of this process, in creation (build) order."""
    return list(_router_replay().RouterReplay.global_router_replay_instances)


def _replay_of(router: Any) -> Any:
    """The ``RouterReplay`` of a router (or the instance itself)."""
    rr = _router_replay().RouterReplay
    if isinstance(router, rr):
        return router
    inst = getattr(router, "router_replay", None)
    if inst is None:
        raise ReplayError(
            f"expected a MoE router built with moe_enable_routing_replay=True, found "
            f"{type(router).__name__} without a RouterReplay"
        )
    return inst


def _routers(obj: Any) -> list[Any]:
    """Routers (modules with a ``router_replay``) of a model, module list or sequence, in module
    order. Raises `TypeError` for an item that is neither a module nor a router."""
    items = obj if isinstance(obj, list | tuple) else [obj]
    out: list[Any] = []
    for item in items:
        if isinstance(item, torch.nn.Module):
            out.extend(m for m in item.modules() if getattr(m, "router_replay", None) is not None)
        elif getattr(item, "router_replay", None) is not None:
            out.append(item)
        else:
            raise TypeError(
                f"expected MoE routers or a model containing them, found {type(item).__name__}"
            )
    return list({id(r): r for r in out}.values())  # first occurrence order


def _is_mtp(router: Any) -> bool:
    """Whether a router belongs to a multi-token-prediction (MTP) layer.

    megatron-core 0.19 flags such routers (``is_mtp_layer``); 0.16 numbers them past the
    decoder (``layer_number > config.num_layers``).
    """
    if getattr(router, "is_mtp_layer", False):
        return True
    number, cfg = getattr(router, "layer_number", None), getattr(router, "config", None)
    return number is not None and cfg is not None and int(number) > int(cfg.num_layers)


def _global_layer(router: Any) -> int:
    """0-based global layer id of a router: ``layer_number - 1``, MTP depth d -> ``L + d - 1``.

    megatron-core 0.16 numbers the router at MTP depth d ``num_layers + d``; 0.19 numbers it
    within the MTP block (``d``) and flags it ``is_mtp_layer``: both map to ``num_layers + d - 1``.
    """
    number = int(router.layer_number)
    cfg = getattr(router, "config", None)
    decoder_layers = int(cfg.num_layers) if cfg is not None else None
    in_block = getattr(router, "is_mtp_layer", False) and decoder_layers is not None
    if in_block and decoder_layers is not None and number <= decoder_layers:
        return decoder_layers + number - 1  # numbered within the MTP block (0.19)
    return number - 1


def _model_router_layers(model_or_routers: Any) -> list[int]:
    """Global 0-based layer ids of a model's routers (``layer_number - 1``), MTP excluded;
    `ReplayError` if a router has no ``layer_number``."""
    out = []
    for r in _routers(model_or_routers):
        number = getattr(r, "layer_number", None)
        if number is None:
            raise ReplayError(
                "expected routers with a layer_number (1-based, global), found None on "
                f"{type(r).__name__}"
            )
        if not _is_mtp(r):
            out.append(int(number) - 1)
    return out
