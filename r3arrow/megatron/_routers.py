"""Access to megatron-core's ``RouterReplay`` (imported in the functions only) and to the
MoE routers of a model."""

from __future__ import annotations

import sys
import types
from collections.abc import Iterable
from typing import Any

import torch

from r3arrow.errors import ReplayError
from r3arrow.spec import RouteSpec


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


def _parallel_state() -> Any:
    """Megatron's ``parallel_state`` once initialised (so imported already), else None."""
    ps = sys.modules.get("megatron.core.parallel_state")
    return ps if ps is not None and ps.model_parallel_is_initialized() else None


def _instances() -> list[Any]:
    """Every ``RouterReplay`` instance of this process, in creation (build) order."""
    return list(_router_replay().RouterReplay.global_router_replay_instances)


def _routers(obj: Any) -> list[Any]:
    """Routers with a ``RouterReplay`` (``router_replay``) of a model or a list, in order;
    else `TypeError`."""
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
    """Whether a router is MTP: ``is_mtp_layer`` (0.19) or numbered past the decoder (0.16)."""
    if getattr(router, "is_mtp_layer", False):
        return True
    number, cfg = getattr(router, "layer_number", None), getattr(router, "config", None)
    return number is not None and cfg is not None and int(number) > int(cfg.num_layers)


def _global_layer(router: Any) -> int:
    """0-based global layer id of a router: ``layer_number - 1``; MTP depth d (numbered
    ``num_layers + d`` by 0.16, ``d`` with ``is_mtp_layer`` by 0.19) -> ``num_layers + d - 1``."""
    number = int(router.layer_number)
    cfg = getattr(router, "config", None)
    if getattr(router, "is_mtp_layer", False) and cfg is not None and number <= int(cfg.num_layers):
        return int(cfg.num_layers) + number - 1  # numbered within the MTP block (0.19)
    return number - 1


def _numbered(routers: list[Any], other: str = "") -> list[int]:
    """`_global_layer` of each router; `ReplayError` for one without a ``layer_number``."""
    if bad := [type(r).__name__ for r in routers if getattr(r, "layer_number", None) is None]:
        raise ReplayError(
            f"expected routers with a layer_number (1-based, global){other}, found "
            f"{len(bad)} without one ({bad[0]})"
        )
    return [_global_layer(r) for r in routers]


def _model_router_layers(model_or_routers: Any) -> list[int]:
    """Global layer ids of a model's routers, MTP excluded."""
    routers = _routers(model_or_routers)
    return [g for g, r in zip(_numbered(routers), routers, strict=True) if not _is_mtp(r)]


def _check_spec_fits(spec: RouteSpec, configs: Iterable[Any]) -> None:
    """`ReplayError` unless ``spec`` has the layers of each config's model: ``num_layers``,
    or ``num_layers + mtp_num_layers`` (routes of the MTP layers too)."""
    for cfg in {id(c): c for c in configs if getattr(c, "num_layers", None) is not None}.values():
        n, mtp = int(cfg.num_layers), int(getattr(cfg, "mtp_num_layers", None) or 0)
        if spec.num_layers not in (n, n + mtp):
            also = f" or {n + mtp} (with its {mtp} MTP layers)" if mtp else ""
            raise ReplayError(
                f"route spec: expected {n} layers (the model's num_layers){also}, found "
                f"{spec.num_layers} (routes of another model?)"
            )
