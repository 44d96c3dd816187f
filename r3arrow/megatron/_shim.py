"""Expert-bias padding-mask shim for ``TopKRouter._apply_expert_bias`` (Megatron-LM #6114).

Releases without the fix broadcast a ``[tokens]`` padding mask wrongly in expert-bias
accounting; `apply_padding_mask_shim` patches the method once, unless the installed
release already counts masks right (decided by behaviour, `padding_mask_fix_present`).
"""

from __future__ import annotations

import inspect
import threading
import types
from collections.abc import Callable
from typing import Any

import torch

_shim_lock = threading.Lock()
_shim: dict[str, Any] = {}


def _unwrapped(fn: Any) -> Callable[..., Any]:
    """The Python body under ``torch.compile`` / ``functools.wraps`` layers."""
    seen = 0
    while seen < 8:
        inner = getattr(fn, "_torchdynamo_orig_callable", None) or getattr(fn, "__wrapped__", None)
        if inner is None:
            break
        fn, seen = inner, seen + 1
    return fn  # type: ignore[no-any-return]


def _masked_count_is_right(fn: Callable[..., Any]) -> bool | None:
    """Run ``fn`` (an ``_apply_expert_bias`` body) on 3 tokens × 4 experts with a ``[tokens]``
    mask; True if it counts the 2 unpadded tokens per expert, False if wrong or raises,
    None if it needs more of a router than the probe has."""
    probe = types.SimpleNamespace(enable_expert_bias=True, local_tokens_per_expert=torch.zeros(4))
    routing_map = torch.ones(3, 4, dtype=torch.bool)
    padding = torch.tensor([True, False, False])
    with torch.enable_grad():
        try:
            fn(probe, routing_map, padding_mask=padding)
        except AttributeError:
            return None
        except (RuntimeError, ValueError, TypeError):
            return False
    return bool(torch.equal(probe.local_tokens_per_expert, torch.full((4,), 2.0)))


def padding_mask_fix_present() -> bool:
    """Whether the installed ``TopKRouter`` counts a ``[tokens]`` padding mask correctly.

    By behaviour: the uncompiled body of ``TopKRouter._apply_expert_bias`` runs on a probe
    (3 tokens × 4 experts, one padded); 0.16.1–0.19.2 raise a broadcast error there. If the
    body needs more than the probe offers, fall back to the source: a ``[tokens, 1]``
    broadcast (``unsqueeze(-1)``, ``[:, None]``, ``view/reshape(-1, 1)``) counts as fixed.
    """
    from megatron.core.transformer.moe.router import TopKRouter

    fn = getattr(TopKRouter, "_apply_expert_bias", None)
    if fn is None or getattr(fn, "_r3arrow_shim", False):
        return True
    verdict = _masked_count_is_right(_unwrapped(fn))
    if verdict is not None:
        return verdict
    try:
        src = inspect.getsource(_unwrapped(fn)).replace(" ", "")
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


def apply_padding_mask_shim() -> bool:
    """Patch ``TopKRouter._apply_expert_bias`` once (idempotent) unless the release is fixed.

    Returns True when the shim is in place (now or earlier), False when skipped because the
    installed release already counts ``[tokens]`` masks right (`padding_mask_fix_present`).
    The replacement is eager (not ``torch.compile``-d): two tensor ops under ``no_grad``.
    """
    from megatron.core.transformer.moe.router import TopKRouter

    with _shim_lock:
        if getattr(TopKRouter.__dict__.get("_apply_expert_bias"), "_r3arrow_shim", False):
            return True
        if padding_mask_fix_present():
            return False
        _shim["original"] = TopKRouter.__dict__.get("_apply_expert_bias")
        TopKRouter._apply_expert_bias = _apply_expert_bias
        return True


def remove_padding_mask_shim() -> None:
    """Undo `apply_padding_mask_shim` (tests, or after upgrading in place)."""
    from megatron.core.transformer.moe.router import TopKRouter

    with _shim_lock:
        if "original" not in _shim:
            return
        original = _shim.pop("original")
        if original is None:  # inherited before the shim: drop the override
            del TopKRouter._apply_expert_bias
        else:
            TopKRouter._apply_expert_bias = original
