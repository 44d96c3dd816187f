"""Padding shims for megatron-core's routers, each decided by behaviour: `apply_shims` /
`remove_shims` (``docs/design.md`` §3 *The shim*, §5 *All-padding aux loss*)."""

from __future__ import annotations

import functools
import inspect
import threading
import types
from collections.abc import Callable
from typing import Any

import torch

_shim_lock = threading.Lock()
_originals: dict[str, Any] = {}  # shim name -> what it replaced (None: inherited)


def _unwrapped(fn: Any) -> Callable[..., Any]:
    """The Python body under ``torch.compile`` / ``functools.wraps`` layers."""
    for _ in range(8):
        inner = getattr(fn, "_torchdynamo_orig_callable", None) or getattr(fn, "__wrapped__", None)
        if inner is None:
            break
        fn = inner
    return fn  # type: ignore[no-any-return]


def _is_shim(fn: Any) -> bool:
    return bool(getattr(fn, "_r3arrow_shim", False))


def _padding_mask_fix_present() -> bool:
    """Whether ``TopKRouter._apply_expert_bias`` counts a ``[tokens]`` mask right (by running
    it on a probe, else by its source's ``[tokens, 1]`` broadcast)."""
    from megatron.core.transformer.moe.router import TopKRouter

    fn = getattr(TopKRouter, "_apply_expert_bias", None)
    if fn is None or _is_shim(fn):
        return True
    fn = _unwrapped(fn)
    probe = types.SimpleNamespace(enable_expert_bias=True, local_tokens_per_expert=torch.zeros(4))
    padding = torch.tensor([True, False, False])
    with torch.enable_grad():  # right: 2 of 3 tokens per expert counted, one padded
        try:
            fn(probe, torch.ones(3, 4, dtype=torch.bool), padding_mask=padding)
            return bool(torch.equal(probe.local_tokens_per_expert, torch.full((4,), 2.0)))
        except AttributeError:  # it needs a real router: read the source instead
            pass
        except (RuntimeError, ValueError, TypeError):
            return False
    try:
        src = inspect.getsource(fn).replace(" ", "")
    except (OSError, TypeError):
        return False
    return any(s in src for s in ("unsqueeze(-1)", "unsqueeze(1)", "[:,None]", "(-1,1)"))


def _apply_expert_bias(
    self: Any, routing_map: torch.Tensor, padding_mask: torch.Tensor | None = None
) -> None:
    """``TopKRouter._apply_expert_bias``, padding mask broadcast as ``[tokens, 1]`` (#6114)."""
    if self.enable_expert_bias and torch.is_grad_enabled():
        with torch.no_grad():
            if padding_mask is not None:
                routing_map = routing_map & ~padding_mask.reshape(routing_map.shape[0], 1)
            self.local_tokens_per_expert += routing_map.sum(dim=0)


_apply_expert_bias._r3arrow_shim = True  # type: ignore[attr-defined]


def _at_least_one(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return torch.clamp(x, min=1)
    return max(x, 1)


def _guard_token_count(original: Callable[..., Any]) -> Callable[..., Any]:
    """``original`` with ``total_num_tokens`` (a count) clamped to 1: 0 gives loss 0, not NaN."""

    @functools.wraps(original)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        if "total_num_tokens" in kwargs:
            kwargs["total_num_tokens"] = _at_least_one(kwargs["total_num_tokens"])
        elif len(args) > 2:
            args = (*args[:2], _at_least_one(args[2]), *args[3:])
        return original(*args, **kwargs)

    guarded._r3arrow_shim = True  # type: ignore[attr-defined]
    return guarded


def _all_padding_aux_loss_fix_present() -> bool:
    """Whether the load-balancing loss is finite on all-padding tokens (0.16.1: 0 / 0)."""
    from megatron.core.transformer.moe import router

    fn = router.switch_load_balancing_loss_func
    if _is_shim(fn):
        return True
    loss = fn(
        probs=torch.zeros(2, 4),
        tokens_per_expert=torch.zeros(4),
        total_num_tokens=torch.tensor(0.0),
        topk=2,
        num_experts=4,
        moe_aux_loss_coeff=0.01,
    )
    return bool(torch.isfinite(torch.as_tensor(loss)).all())


def apply_shims() -> dict[str, bool]:
    """Install the padding shims the installed megatron-core needs; which are in place.

    Idempotent and thread-safe; each decided by behaviour, not version:
    ``"padding_mask"``, ``TopKRouter._apply_expert_bias`` broadcasting a ``[tokens]`` mask
    as ``[tokens, 1]`` (Megatron-LM #6114); ``"all_padding_aux_loss"``, the router module's
    ``switch_load_balancing_loss_func`` with its token count clamped to at least 1, so an
    all-padding (DP padding) microbatch has loss 0, not NaN. Returns ``{"padding_mask":
    bool, "all_padding_aux_loss": bool}``: True where the shim is in place (now or
    earlier), False where the release needs none.
    """
    from megatron.core.transformer.moe import router

    with _shim_lock:
        bias = router.TopKRouter.__dict__.get("_apply_expert_bias")
        if not _is_shim(bias) and not _padding_mask_fix_present():
            _originals["padding_mask"] = bias
            router.TopKRouter._apply_expert_bias = _apply_expert_bias
        loss = router.switch_load_balancing_loss_func
        if not _is_shim(loss) and not _all_padding_aux_loss_fix_present():
            _originals["all_padding_aux_loss"] = loss
            router.switch_load_balancing_loss_func = _guard_token_count(loss)
        return {
            "padding_mask": _is_shim(router.TopKRouter.__dict__.get("_apply_expert_bias")),
            "all_padding_aux_loss": _is_shim(router.switch_load_balancing_loss_func),
        }


def remove_shims() -> None:
    """Undo `apply_shims` (tests, or after upgrading in place); a no-op for shims not in place."""
    from megatron.core.transformer.moe import router

    with _shim_lock:
        if "padding_mask" in _originals:
            original = _originals.pop("padding_mask")
            if original is None:  # inherited before the shim: drop the override
                del router.TopKRouter._apply_expert_bias
            else:
                router.TopKRouter._apply_expert_bias = original
        if "all_padding_aux_loss" in _originals:
            router.switch_load_balancing_loss_func = _originals.pop("all_padding_aux_loss")
