"""Megatron-core side of R3: schedule-scoped replay state and validated replay targets.

* `replay_schedule` clears Megatron's global ``RouterReplay`` state before a pipeline
  schedule and in ``finally`` (forward-only log-prob passes included), and sets the action.
* `install_replay` checks every target (one per router instance, row count = tokens this
  rank's router sees, ids in ``[0, num_experts)``, no expert twice in a row) and only then
  calls ``RouterReplay.set_replay_data``: Megatron itself accepts wrong targets silently.
* `replay_backward` switches to ``REPLAY_BACKWARD`` for activation recomputation.
* `model_inputs` passes the router padding mask (and ``PackedSeqParams``) to ``GPTModel``.
* `apply_padding_mask_shim` makes a ``[tokens]`` padding mask broadcast as ``[tokens, 1]``
  in expert-bias accounting on releases without Megatron-LM #6114.
* `stage_router_layers` / `router_layers` give the global ids of a stage's routers.

megatron-core is imported inside the functions only (tested with 0.16.1; routers of 0.17+
carry ``layer_number`` as 0.16 routers built inside a ``TransformerLayer`` already do).
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import types
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from r3arrow.collate import MegatronCollator, Microbatch
from r3arrow.errors import ReplayDuplicateError, ReplayError, ReplayRangeError
from r3arrow.spec import RouteSpec


# --------------------------------------------------------------- megatron access
def _router_replay() -> types.ModuleType:
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
    return list(_router_replay().RouterReplay.global_router_replay_instances)


def _as_action(action: Any) -> Any:
    enum = _router_replay().RouterReplayAction
    if action is None or isinstance(action, enum):
        return action
    try:
        return enum(str(action).lower())
    except ValueError:
        raise ReplayError(
            f"expected a RouterReplayAction or one of {[a.value for a in enum]}, found {action!r}"
        ) from None


# ------------------------------------------------------------ schedule scope
_scope = threading.local()


def clear_replay_state() -> None:
    """Drop every router's recorded/target indices, backward FIFO and action."""
    rr = _router_replay().RouterReplay
    rr.clear_global_indices()
    rr.clear_global_router_replay_action()


def set_replay_action(action: Any, routers: Iterable[Any] | None = None) -> None:
    """Set ``action`` ("record", "replay_forward", "replay_backward", an enum or None) on every
    router instance, or on the ``RouterReplay`` instances of ``routers`` only."""
    act = _as_action(action)
    targets = _instances() if routers is None else [_replay_of(r) for r in routers]
    for inst in targets:
        if act is None:
            inst.clear_router_replay_action()
        else:
            inst.set_router_replay_action(act)


@contextlib.contextmanager
def replay_schedule(action: Any = "replay_forward") -> Iterator[None]:
    """Scope of one pipeline schedule: replay state cleared on entry and in ``finally``.

    ``action`` is set on every router after the clear (None leaves routers free). Install
    each microbatch's targets inside, in schedule order; never clear between microbatches
    (``REPLAY_BACKWARD`` consumes them first-in first-out). Not reentrant.
    """
    if getattr(_scope, "active", False):
        raise ReplayError(
            "replay_schedule: expected no schedule in progress, found one (nested call)"
        )
    clear_replay_state()
    _scope.active = True
    try:
        set_replay_action(action)
        yield
    finally:
        _scope.active = False
        clear_replay_state()


@contextlib.contextmanager
def replay_backward() -> Iterator[None]:
    """Switch every router to ``REPLAY_BACKWARD`` (recompute pops targets in install order),
    restoring each router's previous action on exit."""
    insts = _instances()
    before = [inst.router_replay_action for inst in insts]
    set_replay_action("replay_backward")
    try:
        yield
    finally:
        for inst, act in zip(insts, before, strict=True):
            if act is None:
                inst.clear_router_replay_action()
            else:
                inst.set_router_replay_action(act)


# ------------------------------------------------------------------- routers
def _replay_of(router: Any) -> Any:
    rr = _router_replay().RouterReplay
    if isinstance(router, rr):
        return router
    inst = getattr(router, "router_replay", None)
    if inst is None:
        raise ReplayError(
            f"expected a MoE router built with moe_enable_routing_replay=True, found {type(router).__name__} "
            "without a RouterReplay"
        )
    return inst


def _routers(obj: Any) -> list[Any]:
    """Routers (modules with a ``router_replay``) of a model, module list or sequence, in module order."""
    items = obj if isinstance(obj, list | tuple) else [obj]
    out: list[Any] = []
    for item in items:
        if isinstance(item, torch.nn.Module):
            out.extend(m for m in item.modules() if getattr(m, "router_replay", None) is not None)
        elif getattr(item, "router_replay", None) is not None:
            out.append(item)
        else:
            raise ReplayError(
                f"expected MoE routers or a model containing them, found {type(item).__name__}"
            )
    return list({id(r): r for r in out}.values())  # first occurrence order


def _is_mtp(router: Any) -> bool:
    number, cfg = getattr(router, "layer_number", None), getattr(router, "config", None)
    return number is not None and cfg is not None and int(number) > int(cfg.num_layers)


def router_layers(model_or_routers: Any) -> list[int]:
    """Global 0-based layer ids of the routers of a model (``layer_number - 1``), MTP excluded.

    Raises `ReplayError` if a router has no ``layer_number``.
    """
    out = []
    for r in _routers(model_or_routers):
        number = getattr(r, "layer_number", None)
        if number is None:
            raise ReplayError(
                f"expected routers with a layer_number (1-based, global), found None on {type(r).__name__}"
            )
        if not _is_mtp(r):
            out.append(int(number) - 1)
    return out


# ---------------------------------------------------------------- validation
def _check_ids(
    arr: torch.Tensor,
    num_experts: int | None,
    layer_ids: Sequence[int],
    *,
    block_rows: int = 1 << 15,
) -> None:
    """Ids in ``[0, num_experts)`` and distinct within each row; ``arr`` is ``[layers, tokens, K]``.

    Blockwise over tokens, all layers at once: each block is transposed to ``[K, layers, c]``
    (in cache) so the range check and the K-1 shifted equality tests are contiguous vector
    ops. CPU tensors go through numpy (zero-copy), others stay in torch on their device.
    """
    n_layers, tokens, k = arr.shape
    if tokens == 0:
        return
    step = max(1, block_rows // max(1, n_layers))
    on_cpu = arr.device.type == "cpu"
    data: Any = arr.numpy() if on_cpu else arr
    for a in range(0, tokens, step):
        blk = data[:, a : a + step]
        xt = (
            np.ascontiguousarray(blk.transpose(2, 0, 1))
            if on_cpu
            else blk.permute(2, 0, 1).contiguous()
        )
        lo, hi = int(xt.min()), int(xt.max())
        if lo < 0 or (num_experts is not None and hi >= num_experts):
            bad = (blk < 0) | (blk >= (num_experts if num_experts is not None else hi + 1))
            layer, tok, _ = (
                int(v) for v in (np.argwhere(bad)[0] if on_cpu else torch.nonzero(bad)[0])
            )
            raise ReplayRangeError(
                f"replay target of layer {layer_ids[layer]}: expected expert ids in [0, {num_experts}), "
                f"found {blk[layer, tok].tolist()} at token {a + tok}"
            )
        for r in range(1, k):
            eq = xt[: k - r] == xt[r:]
            if bool(eq.any()):
                _, layer, tok = (
                    int(v) for v in (np.argwhere(eq)[0] if on_cpu else torch.nonzero(eq)[0])
                )
                raise ReplayDuplicateError(
                    f"replay target of layer {layer_ids[layer]}: expected {k} distinct experts per token, "
                    f"found {blk[layer, tok].tolist()} at token {a + tok}"
                )


def validate_targets(
    targets: Sequence[torch.Tensor],
    *,
    num_tokens: int,
    topk: int | None = None,
    num_experts: int | None = None,
    layers: Sequence[int] | None = None,
    check_ids: bool = True,
) -> None:
    """Raise `ReplayError` unless every target is an int32/int64 ``[num_tokens, topk]`` tensor
    (top-k: the first target's when None) and, with ``check_ids``, has ids in
    ``[0, num_experts)`` and no expert twice in a row. ``layers`` names the targets in errors."""
    names = list(layers) if layers is not None else list(range(len(targets)))
    if len(names) != len(targets):
        raise ReplayError(f"expected one layer id per target ({len(targets)}), found {len(names)}")
    for name, t in zip(names, targets, strict=True):
        if not isinstance(t, torch.Tensor):
            raise ReplayError(
                f"replay target of layer {name}: expected a torch.Tensor, found {type(t).__name__}"
            )
        if t.dtype not in (torch.int32, torch.int64):
            raise ReplayError(
                f"replay target of layer {name}: expected int32 or int64, found {t.dtype}"
            )
        if topk is None and t.dim() == 2:
            topk = int(t.shape[1])
        if t.dim() != 2 or t.shape[0] != num_tokens or t.shape[1] != topk:
            raise ReplayError(
                f"replay target of layer {name}: expected [{num_tokens}, {topk}] (tokens this rank's "
                f"router sees, top-k), found {list(t.shape)}"
            )
    if check_ids:
        for name, t in zip(names, targets, strict=True):
            _check_ids(t.unsqueeze(0), num_experts, [name])


def _check_microbatch_ids(mb: Microbatch, num_experts: int | None) -> None:
    _check_ids(mb.replay_tensor(), num_experts, mb.layers)


def install_replay(
    mb: Microbatch | Sequence[torch.Tensor],
    routers: Any = None,
    *,
    num_tokens: int | None = None,
    num_experts: int | None = None,
    layers: Sequence[int] | None = None,
    check: bool = True,
) -> list[torch.Tensor]:
    """Validate replay targets, then hand them to ``RouterReplay.set_replay_data``; return them.

    ``mb``: a `Microbatch` (targets, token count, layers and ``num_experts`` from it) or a list
    of ``[tokens, K]`` tensors in router-instance order (then ``num_tokens`` is required).
    ``routers`` (a model, modules or routers): targets go to routers by ``layer_number``
    (1-based global), which must match the microbatch's layers; ``num_experts`` and top-k are
    checked against each router. Without ``routers`` targets follow instance order and their
    number must equal the router instances of this process. ``check=False`` skips the id
    scan (shapes are always checked). Raises `ReplayError` (subclasses `ReplayRangeError`,
    `ReplayDuplicateError`) before anything reaches Megatron.
    """
    rr = _router_replay().RouterReplay
    instances = list(rr.global_router_replay_instances)
    if isinstance(mb, Microbatch):
        targets = mb.replay_targets()
        tokens = mb.num_router_tokens
        ids = list(mb.layers)
        experts = num_experts if num_experts is not None else mb.spec.num_experts
        topk: int | None = mb.spec.topk
    else:
        targets = list(mb)
        if num_tokens is None:
            raise ReplayError(
                "install_replay: expected num_tokens (the router's local token count) with raw targets"
            )
        tokens, experts, topk = int(num_tokens), num_experts, None
        ids = list(layers) if layers is not None else list(range(len(targets)))
    if len(ids) != len(targets):
        raise ReplayError(f"expected one layer id per target ({len(targets)}), found {ids}")
    ordered = targets
    if routers is not None:
        ordered, experts, topk = _order_by_routers(
            targets, ids, _routers(routers), instances, experts, topk
        )
    elif len(targets) != len(instances):
        raise ReplayError(
            f"expected one target per RouterReplay instance of this process ({len(instances)} routers), found "
            f"{len(targets)} targets for layers {ids}"
        )
    # A microbatch's targets share one buffer: scan all its layers in one blockwise pass.
    fast = isinstance(mb, Microbatch)
    validate_targets(
        targets,
        num_tokens=tokens,
        topk=topk,
        num_experts=experts,
        layers=ids,
        check_ids=check and not fast,
    )
    if check and isinstance(mb, Microbatch):
        _check_microbatch_ids(mb, experts)
    rr.set_replay_data(ordered)
    return ordered


def _order_by_routers(
    targets: list[torch.Tensor],
    ids: list[int],
    routers: list[Any],
    instances: list[Any],
    experts: int | None,
    topk: int | None,
) -> tuple[list[torch.Tensor], int | None, int | None]:
    """Targets in instance order, mapped through each router's ``layer_number``."""
    decoder = [r for r in routers if not _is_mtp(r)]
    if any(getattr(r, "layer_number", None) is None for r in decoder):
        if len(decoder) != len(ids):
            raise ReplayError(f"expected {len(ids)} routers for layers {ids}, found {len(decoder)}")
        by_layer = dict(zip(ids, decoder, strict=True))
    else:
        by_layer = {int(r.layer_number) - 1: r for r in decoder}
    if sorted(by_layer) != sorted(ids):
        raise ReplayError(
            f"expected routers for global layers {sorted(ids)}, found routers for {sorted(by_layer)}"
        )
    target_of = {id(_replay_of(by_layer[g])): t for g, t in zip(ids, targets, strict=True)}
    missing = [i for i, inst in enumerate(instances) if id(inst) not in target_of]
    if missing or len(target_of) != len(instances):
        raise ReplayError(
            f"expected targets for every RouterReplay instance of this process ({len(instances)}), found "
            f"{len(instances) - len(missing)} covered by layers {ids} (uncovered instances {missing}, e.g. MTP "
            "or another model's routers)"
        )
    for g in ids:
        r = by_layer[g]
        e = getattr(r, "num_experts", None)
        if e is not None and experts is not None and int(e) != int(experts):
            raise ReplayError(
                f"router of layer {g}: expected num_experts={experts} (routes), found {e}"
            )
        experts = int(e) if e is not None and experts is None else experts
        k = getattr(r, "topk", None)
        if k is not None and topk is not None and int(k) != int(topk):
            raise ReplayError(f"router of layer {g}: expected top-k {topk} (routes), found {k}")
        topk = int(k) if k is not None and topk is None else topk
    return [target_of[id(inst)] for inst in instances], experts, topk


# ------------------------------------------------------------- model inputs
def packed_seq_params(mb: Microbatch) -> Any:
    """``PackedSeqParams`` (THD) of a packed microbatch: real and padded cu_seqlens, max length."""
    from megatron.core.packed_seq_params import PackedSeqParams

    if not mb.packed or mb.cu_seqlens is None or mb.cu_seqlens_padded is None:
        raise ReplayError("packed_seq_params: expected a packed microbatch, found an unpacked one")
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


# --------------------------------------------------------- expert-bias shim
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
    """``TopKRouter._apply_expert_bias`` with the padding mask broadcast as ``[tokens, 1]`` (#6114)."""
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


# --------------------------------------------------------------- stage layers
_UNEVEN = (
    "pipeline_model_parallel_layout",
    "num_layers_in_first_pipeline_stage",
    "num_layers_in_last_pipeline_stage",
    "account_for_embedding_in_pipeline_split",
    "account_for_loss_in_pipeline_split",
)


def moe_layer_pattern(config: Any) -> list[bool]:
    """Per global decoder layer: True where it has a router (``moe_layer_freq``; MTP not included)."""
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


def stage_router_layers(
    config: Any,
    *,
    pp_rank: int | None = None,
    vp_stage: int | None = None,
    use_megatron: bool | None = None,
) -> list[int]:
    """Global ids of the routers a pipeline rank builds, in build order (RouterReplay order).

    ``config``: a Megatron ``TransformerConfig`` (or any object with its fields). Dense
    layers (``moe_layer_freq``) have no router; MTP layers are not counted. With virtual
    pipelining and ``vp_stage=None``, every model chunk of the rank, chunk by chunk.
    ``pp_rank`` defaults to Megatron's current rank (0 without pipelining). Uses
    ``get_transformer_layer_offset``/``get_num_layers_to_build`` when megatron-core is
    importable (``use_megatron=None``), else the uniform-split arithmetic.
    """
    mega = _megatron_available() if use_megatron is None else bool(use_megatron)
    pp = int(getattr(config, "pipeline_model_parallel_size", 1) or 1)
    if pp_rank is None:
        if pp == 1:
            pp_rank = 0
        elif mega:
            from megatron.core import parallel_state

            pp_rank = int(parallel_state.get_pipeline_model_parallel_rank())
        else:
            raise ReplayError(
                "stage_router_layers: expected pp_rank with pipeline parallelism, found None"
            )
    if not 0 <= pp_rank < pp:
        raise ReplayError(f"pp_rank: expected an int in [0, {pp}), found {pp_rank}")
    vp = getattr(config, "virtual_pipeline_model_parallel_size", None)
    stages: list[int | None] = (
        [vp_stage] if vp_stage is not None or vp is None or pp == 1 else list(range(int(vp)))
    )
    moe = moe_layer_pattern(config)
    out: list[int] = []
    for stage in stages:
        out.extend(i for i in _stage_range(config, pp_rank, stage, mega) if moe[i])
    return out


def collator_for(
    spec: RouteSpec,
    config: Any = None,
    *,
    model: Any = None,
    pp_rank: int | None = None,
    vp_stage: int | None = None,
    tp_rank: int | None = None,
    cp_rank: int | None = None,
    **kwargs: Any,
) -> MegatronCollator:
    """A `MegatronCollator` for this rank: layers from ``model``'s routers (``layer_number``) or
    from ``config`` and the PP/VPP rank; TP/CP sizes, sequence parallelism and FP8 from
    ``config``; ranks from Megatron's ``parallel_state`` when initialised (else 0). Extra
    keywords go to the collator and win over the config."""
    if model is not None:
        layers = router_layers(model)
    elif config is not None:
        layers = stage_router_layers(config, pp_rank=pp_rank, vp_stage=vp_stage)
    else:
        raise ReplayError("collator_for: expected a config or a model, found neither")
    params: dict[str, Any] = {}
    if config is not None:
        params = {
            "tp_size": int(getattr(config, "tensor_model_parallel_size", 1) or 1),
            "cp_size": int(getattr(config, "context_parallel_size", 1) or 1),
            "sequence_parallel": bool(getattr(config, "sequence_parallel", False)),
            "fp8": bool(getattr(config, "fp8", None)),
        }
    ranks = _parallel_ranks()
    params["tp_rank"] = tp_rank if tp_rank is not None else ranks[0]
    params["cp_rank"] = cp_rank if cp_rank is not None else ranks[1]
    params.update(kwargs)
    return MegatronCollator(spec, layers=layers, **params)


def _parallel_ranks() -> tuple[int, int]:
    try:
        from megatron.core import parallel_state
    except ImportError:
        return 0, 0
    if not parallel_state.model_parallel_is_initialized():
        return 0, 0
    return (
        int(parallel_state.get_tensor_model_parallel_rank()),
        int(parallel_state.get_context_parallel_rank()),
    )


__all__ = [
    "ReplayDuplicateError",
    "ReplayRangeError",
    "apply_padding_mask_shim",
    "clear_replay_state",
    "collator_for",
    "install_replay",
    "model_inputs",
    "moe_layer_pattern",
    "packed_seq_params",
    "padding_mask_fix_present",
    "remove_padding_mask_shim",
    "replay_backward",
    "replay_schedule",
    "router_layers",
    "set_replay_action",
    "stage_router_layers",
    "validate_targets",
]
