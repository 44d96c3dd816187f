"""A tiny, deterministic Mixture-of-Experts language model that records its own routing.

`TinyMoE` is a real causal transformer (embeddings, causal multi-head attention,
dense MLP or softmax-top-k MoE per layer, LM head) with random weights drawn from
a seed; nothing is downloaded. `ReferenceEngine` generates with it and returns
routed experts with exactly vLLM's row semantics (see `ReferenceEngine.generate`).
`TinyMoE.trainer_logprobs` is a trainer's forward of the same weights: bfloat16, with the
routers' own top-k or with replayed routes (``docs/mismatch.md``, "The demo").
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import math
from collections.abc import Iterator, Sequence
from typing import Any, Literal

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from r3arrow._checks import check_positive_int
from r3arrow.errors import EngineRequestError
from r3arrow.ids import check_routes
from r3arrow.spec import RouteSpec

FinishReason = Literal["length", "stop"]


def _bad(param: str, message: str, value: object) -> EngineRequestError:
    # vLLM's VLLMValidationError wording: "<message> (parameter=<name>, value=<value>)"
    return EngineRequestError(f"{message} (parameter={param}, value={value!r})", param=param)


@dataclasses.dataclass(frozen=True)
class TinyMoEConfig:
    """Shape of `TinyMoE`. Layers in ``dense_layers`` have a dense MLP and no router.

    ``dtype`` is the compute dtype. float64 is the default because routing must be
    *causal to the bit*: the routes of token i may not change when later tokens are
    appended, yet BLAS picks different kernels (different summation orders) for
    different row counts; in float64 those last-bit differences cannot flip a top-k.
    """

    vocab_size: int = 512
    hidden_size: int = 64
    num_layers: int = 4
    dense_layers: tuple[int, ...] = (0,)
    num_experts: int = 8
    topk: int = 2
    seed: int = 0
    eos_token_id: int | None = None
    max_model_len: int = 4096
    num_heads: int = 2
    intermediate_size: int = 128
    moe_intermediate_size: int = 32
    dtype: Literal["float32", "float64"] = "float64"

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "hidden_size",
            "num_layers",
            "num_experts",
            "topk",
            "max_model_len",
            "num_heads",
            "intermediate_size",
            "moe_intermediate_size",
        ):
            value = check_positive_int(getattr(self, name), f"TinyMoEConfig.{name}")
            object.__setattr__(self, name, value)
        dense = tuple(sorted({int(i) for i in self.dense_layers}))
        if len(dense) != len(tuple(self.dense_layers)) or any(
            not 0 <= i < self.num_layers for i in dense
        ):
            raise ValueError(
                f"TinyMoEConfig.dense_layers: expected unique ids in [0, {self.num_layers}), "
                f"found {list(self.dense_layers)}"
            )
        if len(dense) == self.num_layers:
            raise ValueError(
                f"TinyMoEConfig.dense_layers: expected at least one MoE layer, found all "
                f"{self.num_layers} layers dense"
            )
        object.__setattr__(self, "dense_layers", dense)
        if self.topk > self.num_experts:
            raise ValueError(
                f"TinyMoEConfig: expected topk <= num_experts={self.num_experts}, found {self.topk}"
            )
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"TinyMoEConfig: expected hidden_size divisible by num_heads={self.num_heads}, "
                f"found {self.hidden_size}"
            )
        if self.eos_token_id is not None and not 0 <= self.eos_token_id < self.vocab_size:
            raise ValueError(
                f"TinyMoEConfig.eos_token_id: expected None or an id in [0, {self.vocab_size}), "
                f"found {self.eos_token_id}"
            )
        if self.dtype not in ("float32", "float64"):
            raise ValueError(
                f"TinyMoEConfig.dtype: expected 'float32' or 'float64', found {self.dtype!r}"
            )

    @property
    def moe_layers(self) -> tuple[int, ...]:
        """Global ids of the layers that have a router."""
        return tuple(i for i in range(self.num_layers) if i not in self.dense_layers)

    def route_spec(self) -> RouteSpec:
        """The `RouteSpec` of this model's routes (all layers, dense ones zero)."""
        return RouteSpec(
            num_layers=self.num_layers,
            topk=self.topk,
            num_experts=self.num_experts,
            moe_layers=self.moe_layers,
        )

    @property
    def torch_dtype(self) -> torch.dtype:
        return torch.float64 if self.dtype == "float64" else torch.float32


@dataclasses.dataclass
class _KVCache:
    """Keys and values ``[L, heads, capacity, head_dim]``; ``length`` tokens are filled."""

    k: torch.Tensor
    v: torch.Tensor
    length: int = 0

    @property
    def capacity(self) -> int:
        return int(self.k.shape[2])


@contextlib.contextmanager
def _single_threaded() -> Iterator[None]:
    # The ops are tiny: intra-op threads only add fork/join waits, and on a loaded machine
    # (busy cores, other processes) those waits made a forward pass 15x slower.
    prev = torch.get_num_threads()
    if prev == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


def _rms_norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class TinyMoE(nn.Module):
    """Causal MoE transformer on CPU; weights drawn from ``config.seed``.

    ``forward(token_ids [T] int64) -> (logits [T, V], routes [T, L, K] int64)``:
    router layers hold the top-k expert ids in `torch.topk` order (softmax over
    experts, top-k, renormalised, like Qwen3-MoE); dense layers hold zeros.
    Token i's outputs depend on tokens ``0..i`` only.
    """

    pos_embed: torch.Tensor

    def __init__(self, config: TinyMoEConfig) -> None:
        super().__init__()
        self.config = config
        c = config
        gen = torch.Generator().manual_seed(c.seed)
        dt = c.torch_dtype

        def rand(*shape: int, fan_in: int) -> nn.Parameter:
            w = torch.randn(*shape, generator=gen, dtype=torch.float64) / math.sqrt(fan_in)
            return nn.Parameter(w.to(dt), requires_grad=False)

        h, nl, e = c.hidden_size, c.num_layers, c.num_experts
        n_dense = len(c.dense_layers)
        n_moe = nl - n_dense
        self.embed = rand(c.vocab_size, h, fan_in=1)
        self.wqkv = rand(nl, h, 3 * h, fan_in=h)
        self.wo = rand(nl, h, h, fan_in=h)
        self.dense_up = rand(max(n_dense, 1), h, c.intermediate_size, fan_in=h)
        self.dense_down = rand(max(n_dense, 1), c.intermediate_size, h, fan_in=c.intermediate_size)
        # Router logits are scaled up: routing is confident and varied, like a trained router's.
        self.router = rand(max(n_moe, 1), h, e, fan_in=1)
        self.expert_up = rand(max(n_moe, 1), e, h, c.moe_intermediate_size, fan_in=h)
        self.expert_down = rand(
            max(n_moe, 1), e, c.moe_intermediate_size, h, fan_in=c.moe_intermediate_size
        )
        self.lm_head = rand(h, c.vocab_size, fan_in=h)
        pos = torch.arange(c.max_model_len, dtype=torch.float64)[:, None]
        freq = torch.exp(-math.log(10000.0) * torch.arange(0, h, 2, dtype=torch.float64) / h)
        pe = torch.zeros(c.max_model_len, h, dtype=torch.float64)
        pe[:, 0::2] = torch.sin(pos * freq)
        pe[:, 1::2] = torch.cos(pos * freq)
        self.register_buffer("pos_embed", pe.to(dt), persistent=False)
        # index of each layer within the dense or the MoE weight stacks
        self._slot = [
            (c.dense_layers.index(i) if i in c.dense_layers else c.moe_layers.index(i))
            for i in range(nl)
        ]
        self.eval()

    # ----------------------------------------------------------------- blocks
    def _attention(self, x: torch.Tensor, layer: int, cache: _KVCache) -> torch.Tensor:
        t, h = x.shape
        nh = self.config.num_heads
        hd = h // nh
        start = cache.length
        end = start + t
        qkv: torch.Tensor = (x @ self.wqkv[layer]).view(t, 3, nh, hd).permute(1, 2, 0, 3)
        q, k, v = qkv[0], qkv[1], qkv[2]  # [nh, t, hd] each
        cache.k[layer, :, start:end] = k
        cache.v[layer, :, start:end] = v
        keys, values = cache.k[layer, :, :end], cache.v[layer, :, :end]
        scores = (q * (1.0 / math.sqrt(hd))) @ keys.transpose(1, 2)  # [nh, t, end]
        if t > 1:
            future = torch.arange(end)[None, :] > torch.arange(start, end)[:, None]
            scores.masked_fill_(future, float("-inf"))
        mixed: torch.Tensor = (scores.softmax(-1) @ values).transpose(0, 1).reshape(t, h)
        return mixed @ self.wo[layer]

    def _dense(self, x: torch.Tensor, slot: int) -> torch.Tensor:
        return F.silu(x @ self.dense_up[slot]) @ self.dense_down[slot]

    def _moe(
        self, x: torch.Tensor, slot: int, forced: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        k, e = self.config.topk, self.config.num_experts
        probs = (x @ self.router[slot]).softmax(-1)
        if forced is None:
            weights, ids = torch.topk(probs, k, dim=-1)
        else:  # replay, as megatron-core's RouterReplay: forced experts, this router's scores
            ids = forced
            weights = probs.gather(-1, ids)
        weights = weights / weights.sum(-1, keepdim=True)
        # Dispatch: group the (token, slot) pairs by expert, one matmul pair per expert.
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=e).tolist()
        src = order // k
        xs = x[src]
        outs = []
        for ex, chunk in enumerate(torch.split(xs, counts)):
            if chunk.shape[0]:
                outs.append(F.silu(chunk @ self.expert_up[slot, ex]) @ self.expert_down[slot, ex])
        ys = torch.cat(outs) * weights.reshape(-1)[order, None]
        out = torch.zeros_like(x).index_add_(0, src, ys)
        return out, ids

    # ---------------------------------------------------------------- forward
    def new_cache(self, capacity: int) -> _KVCache:
        """An empty KV cache for up to ``capacity`` tokens (at most ``max_model_len``)."""
        c = self.config
        if not 0 < capacity <= c.max_model_len:
            raise ValueError(
                f"expected a cache capacity in [1, max_model_len={c.max_model_len}], "
                f"found {capacity}"
            )
        shape = (c.num_layers, c.num_heads, capacity, c.hidden_size // c.num_heads)
        return _KVCache(
            torch.empty(shape, dtype=self.embed.dtype), torch.empty(shape, dtype=self.embed.dtype)
        )

    def extend(
        self,
        token_ids: torch.Tensor,
        cache: _KVCache,
        *,
        logits_from: int | None = 0,
        router_inputs: torch.Tensor | None = None,
        replay: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Run ``token_ids`` [t] after the ``cache.length`` tokens already in ``cache``.

        Returns logits for chunk rows ``logits_from:`` (``None``: no logits) and routes
        ``[t, L, K]`` int64; the cache then holds the chunk too. A prefill is an extend of
        an empty cache; a decode step is an extend by one token. ``router_inputs``: a
        ``[t, n_moe, hidden]`` tensor filled with what each router layer's gate saw (see
        `router_inputs`). ``replay``: ``[t, L, K]`` int64 expert ids the router layers use
        instead of their own top-k (checked by the caller, `trainer_logprobs`).
        """
        c = self.config
        if token_ids.ndim != 1 or token_ids.dtype != torch.int64:
            raise ValueError(
                f"expected token_ids as a 1-D int64 tensor, found {token_ids.ndim}-D "
                f"{token_ids.dtype}"
            )
        t = token_ids.shape[0]
        start = cache.length
        if start + t > cache.capacity:
            raise ValueError(
                f"expected at most {cache.capacity - start} more tokens in the KV cache, found {t}"
            )
        routes = torch.zeros(t, c.num_layers, c.topk, dtype=torch.int64)
        with torch.inference_mode(), _single_threaded():
            x = self.embed[token_ids] + self.pos_embed[start : start + t]
            for layer in range(c.num_layers):
                x = x + self._attention(_rms_norm(x), layer, cache)
                slot = self._slot[layer]
                if layer in c.dense_layers:
                    x = x + self._dense(_rms_norm(x), slot)
                else:
                    h = _rms_norm(x)
                    if router_inputs is not None:
                        router_inputs[:, slot] = h
                    y, ids = self._moe(h, slot, None if replay is None else replay[:, layer])
                    x = x + y
                    routes[:, layer] = ids
            logits = None if logits_from is None else _rms_norm(x[logits_from:]) @ self.lm_head
        cache.length = start + t
        return logits, routes

    def run(
        self, token_ids: torch.Tensor, *, logits_from: int | None = 0
    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """Like `forward` on a fresh cache; logits only for rows ``logits_from:`` (None: none)."""
        if token_ids.ndim != 1 or token_ids.shape[0] == 0:
            raise ValueError(
                f"expected a non-empty 1-D token_ids tensor, found shape {list(token_ids.shape)}"
            )
        return self.extend(token_ids, self.new_cache(token_ids.shape[0]), logits_from=logits_from)

    def router_inputs(self, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs ``[T, n_moe, hidden]``, routes ``[T, L, K]`` int64) of one forward pass.

        ``inputs[t, i]`` is the normalised hidden state the router of MoE layer
        ``config.moe_layers[i]`` scored for token ``t`` (its logits are
        ``inputs[t, i] @ router_weights()[i]``), in the model's dtype; ``routes`` is what
        `forward` returns. One pass for the whole sequence (causal to the bit, see
        `TinyMoEConfig`: the same values as the prefill and decode steps that generated
        it). Raises ``ValueError`` for an empty or non-1-D ``token_ids``.
        """
        if token_ids.ndim != 1 or token_ids.shape[0] == 0:
            raise ValueError(
                f"expected a non-empty 1-D token_ids tensor, found shape {list(token_ids.shape)}"
            )
        c = self.config
        t = token_ids.shape[0]
        out = torch.empty(t, len(c.moe_layers), c.hidden_size, dtype=c.torch_dtype)
        _, routes = self.extend(token_ids, self.new_cache(t), logits_from=None, router_inputs=out)
        return out, routes

    def router_weights(self) -> torch.Tensor:
        """The routers' gate weights ``[n_moe, hidden, num_experts]`` (layer order of
        ``config.moe_layers``), in the model's dtype; router logits are ``input @ weight``."""
        return self.router[: len(self.config.moe_layers)]

    def forward(self, token_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``token_ids [T] int64 -> (logits [T, V], routes [T, L, K] int64)``."""
        logits, routes = self.run(token_ids, logits_from=0)
        assert logits is not None
        return logits, routes

    def trainer_logprobs(
        self, token_ids: torch.Tensor, labels: torch.Tensor, *, routes: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A trainer's forward of this model: bfloat16, native or replayed routing.

        ``token_ids`` and ``labels``: ``[T]`` int64 (``labels[t]``: the token scored at
        position ``t``, usually ``token_ids[t + 1]``). The weights are this model's, cast to
        bfloat16, and every op runs in bfloat16 except the final log-softmax (float32, as
        trainers compute it); the engine computes in ``config.dtype``. ``routes=None``: the
        routers choose their own top-k (in bfloat16, so near-tied scores can flip it);
        ``routes`` ``[T, L, K]`` integer: router layers use those experts (R3 replay; the gate
        weights are this router's scores at them, renormalised; dense layers ignore theirs).
        Returns ``(logprobs [T] float32, routes [T, L, K] int64)``: ``log p(labels[t] |
        token_ids[:t+1])`` and the routing used. ``ValueError`` for shapes, dtypes or ids
        out of the vocab; `r3arrow.errors.ExpertRangeError` / `DuplicateExpertError`
        (``token``, ``layer`` set) for replayed ids out of ``[0, num_experts)`` or repeated in
        a row.
        """
        c = self.config
        for name, ids in (("token_ids", token_ids), ("labels", labels)):
            if ids.ndim != 1 or ids.dtype != torch.int64:
                raise ValueError(
                    f"{name}: expected a 1-D int64 tensor, found {ids.ndim}-D {ids.dtype}"
                )
            if ids.numel() and not 0 <= int(ids.min()) <= int(ids.max()) < c.vocab_size:
                raise ValueError(
                    f"{name}: expected ids in [0, {c.vocab_size}), found "
                    f"[{int(ids.min())}, {int(ids.max())}]"
                )
        t = token_ids.shape[0]
        if not 0 < t <= c.max_model_len or labels.shape[0] != t:
            raise ValueError(
                f"expected token_ids and labels of one length in [1, max_model_len="
                f"{c.max_model_len}], found {t} and {labels.shape[0]}"
            )
        forced = None
        if routes is not None:
            want = (t, c.num_layers, c.topk)
            integer = not (
                routes.dtype.is_floating_point or routes.is_complex() or routes.dtype == torch.bool
            )
            if tuple(routes.shape) != want or not integer:
                raise ValueError(
                    f"routes: expected an integer tensor of shape {list(want)}, found "
                    f"{routes.dtype} of shape {list(routes.shape)}"
                )
            moe = list(c.moe_layers)
            check_routes(routes[:, moe], num_experts=c.num_experts, layer_ids=moe)
            forced = routes.to(torch.int64)
        twin = self._bfloat16()
        logits, used = twin.extend(token_ids, twin.new_cache(t), logits_from=0, replay=forced)
        assert logits is not None
        with torch.inference_mode():
            lp = logits.float().log_softmax(-1).gather(-1, labels[:, None])[:, 0]
        return lp, used

    def _bfloat16(self) -> TinyMoE:
        """This model with every weight and buffer in bfloat16 (built once)."""
        twin: TinyMoE | None = self.__dict__.get("_bf16_twin")
        if twin is None:
            twin = copy.deepcopy(self).to(torch.bfloat16)
            # object.__setattr__: a plain attribute, not a submodule (no state_dict entry,
            # no recursion into it from .to() or deepcopy)
            object.__setattr__(self, "_bf16_twin", twin)
        return twin


@dataclasses.dataclass(frozen=True)
class GenerateResult:
    """One finished generation of G >= 1 tokens.

    ``routed_experts``: ``[P - start + G - 1, L, K]`` in the spec's dtype (None if not asked).
    ``logprobs``: log-probability of each sampled token under the raw model distribution
    (before temperature), with ``logprob_ranks`` (1 = most likely) and, when
    ``top_logprobs=n > 0`` was asked, the ``n`` most likely ``(token_id, logprob)`` per step.
    ``stop_reason`` is the stop token that ended generation (None for "length").
    """

    token_ids: list[int]
    finish_reason: FinishReason
    routed_experts: np.ndarray | None
    logprobs: list[float] | None
    logprob_ranks: list[int] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    stop_reason: int | None = None


def _is_int(value: object) -> bool:
    return isinstance(value, int | np.integer) and not isinstance(value, bool)


class ReferenceEngine:
    """Generates with a `TinyMoE` and reports routed experts exactly like vLLM.

    Not thread-safe: callers serialise `generate` (the HTTP server runs it on one thread).
    """

    def __init__(self, config: TinyMoEConfig | None = None) -> None:
        self.config = config if config is not None else TinyMoEConfig()
        self.spec = self.config.route_spec()
        self.model = TinyMoE(self.config)

    # ------------------------------------------------------------- validation
    def check_token_ids(self, token_ids: object, param: str = "token_ids") -> np.ndarray:
        """``token_ids`` as int64 ``[N >= 1]``; `EngineRequestError` unless all are in the vocab."""
        if isinstance(token_ids, np.ndarray):
            arr = token_ids
        elif isinstance(token_ids, list | tuple) and all(_is_int(t) for t in token_ids):
            arr = np.asarray(token_ids, dtype=np.int64) if token_ids else np.zeros(0, np.int64)
        else:
            raise EngineRequestError(
                f"{param}: expected a list of integer token ids, found {token_ids!r:.120}",
                param=param,
            )
        if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
            raise EngineRequestError(
                f"{param}: expected a flat list of integer token ids, found shape "
                f"{list(arr.shape)} dtype {arr.dtype}",
                param=param,
            )
        if arr.size == 0:
            raise EngineRequestError(
                f"{param}: expected at least one token id, found none", param=param
            )
        v = self.config.vocab_size
        bad = np.flatnonzero((arr < 0) | (arr >= v))
        if bad.size:
            raise EngineRequestError(
                f"{param}: expected token ids in [0, {v}), found {int(arr[bad[0]])} at position "
                f"{int(bad[0])}",
                param=param,
            )
        return arr.astype(np.int64, copy=False)

    def routes_for(self, token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Routes of every token of a full sequence: ``[N, L, K]`` in the spec's dtype.

        Row i routes token i: what a request with prompt ``token_ids`` and prompt start 0
        returns for those tokens. Raises `EngineRequestError` for ids outside the vocab.
        """
        ids = self._full_sequence(token_ids)
        _, routes = self.model.run(torch.from_numpy(ids), logits_from=None)
        return routes.numpy().astype(self.spec.dtype)

    def _full_sequence(self, token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """`check_token_ids`, and at most ``max_model_len`` tokens (`EngineRequestError`)."""
        ids = self.check_token_ids(token_ids)
        if ids.shape[0] > self.config.max_model_len:
            raise EngineRequestError(
                f"token_ids: expected at most max_model_len={self.config.max_model_len} tokens, "
                f"found {ids.shape[0]}",
                param="token_ids",
            )
        return ids

    def router_inputs(self, token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """What each MoE layer's router scored for every token of a full sequence.

        ``[N, n_moe, hidden]`` in the model's dtype (`TinyMoE.router_inputs`); with
        `TinyMoE.router_weights` it recomputes the engine's routing outside the engine
        (e.g. in a trainer's router at another precision). Same checks as `routes_for`.
        """
        ids = self._full_sequence(token_ids)
        inputs, _ = self.model.router_inputs(torch.from_numpy(ids))
        return inputs.numpy()

    def generate(
        self,
        prompt_token_ids: Sequence[int] | np.ndarray,
        *,
        max_tokens: int,
        temperature: float = 0.0,
        seed: int | None = None,
        routed_experts_prompt_start: int = 0,
        return_routed_experts: bool = True,
        stop_token_ids: Sequence[int] | None = None,
        ignore_eos: bool = False,
        logprobs: bool = False,
        top_logprobs: int = 0,
        min_tokens: int = 0,
    ) -> GenerateResult:
        """Generate G tokens (1 <= G <= ``max_tokens``) after the P prompt tokens.

        ``routed_experts`` has ``P - start + G - 1`` rows; row j routes token ``start + j``
        of ``prompt + generated`` (the last sampled token never went through the model).
        Like vLLM, ``start`` may equal P (then only the G - 1 generated rows come back).
        Temperature 0 is greedy; otherwise sampling from a generator seeded by ``seed``
        (``None``: fresh entropy). A sampled stop token (``stop_token_ids``, or EOS unless
        ``ignore_eos``) ends generation with "stop" and is kept; stop tokens cannot be
        sampled before ``min_tokens``. Raises `EngineRequestError` before any compute.
        """
        c = self.config
        prompt = self.check_token_ids(prompt_token_ids)
        p = prompt.shape[0]
        if not _is_int(max_tokens) or max_tokens < 1:
            raise _bad(
                "max_tokens", f"max_tokens must be at least 1, got {max_tokens}.", max_tokens
            )
        if max_tokens > c.max_model_len:
            raise _bad(
                "max_tokens",
                f"max_tokens={max_tokens} cannot be greater than max_model_len={c.max_model_len}. "
                "Please request fewer output tokens.",
                max_tokens,
            )
        if p + max_tokens > c.max_model_len:
            # vLLM silently lowers max_tokens here; r3arrow never truncates silently.
            raise _bad(
                "max_tokens",
                f"This model's maximum context length is {c.max_model_len} tokens. However, you "
                f"requested {p + max_tokens} tokens ({p} in the prompt, {max_tokens} in the "
                "completion). Please reduce the length of the prompt or completion.",
                max_tokens,
            )
        start = routed_experts_prompt_start
        if not _is_int(start) or not 0 <= start <= p:
            raise _bad(
                "routed_experts_prompt_start",
                "routed_experts_prompt_start must be between 0 and the prompt length "
                f"({p}), inclusive.",
                start,
            )
        if (
            not isinstance(temperature, int | float)
            or isinstance(temperature, bool)
            or not math.isfinite(temperature)
            or temperature < 0
        ):
            raise _bad(
                "temperature", f"temperature must be non-negative, got {temperature}.", temperature
            )
        if not _is_int(min_tokens) or not 0 <= min_tokens <= max_tokens:
            raise _bad(
                "min_tokens",
                f"min_tokens must be between 0 and max_tokens={max_tokens}, got {min_tokens}.",
                min_tokens,
            )
        if not _is_int(top_logprobs) or top_logprobs < 0:
            raise _bad(
                "logprobs", f"logprobs must be non-negative, got {top_logprobs}.", top_logprobs
            )
        if seed is not None and not _is_int(seed):
            raise _bad("seed", f"seed must be an integer or None, got {seed!r}.", seed)
        stops: list[int] = []
        if stop_token_ids:
            stops = self.check_token_ids(list(stop_token_ids), "stop_token_ids").tolist()
        if c.eos_token_id is not None and not ignore_eos:
            stops.append(c.eos_token_id)
        stop_set = set(stops)

        gen: torch.Generator | None = None
        if temperature > 0:
            gen = torch.Generator()
            if seed is None:
                gen.seed()
            else:
                gen.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)

        cap = p + max_tokens
        seq = torch.empty(cap, dtype=torch.int64)
        seq[:p] = torch.from_numpy(prompt)
        routes = torch.empty(cap, c.num_layers, c.topk, dtype=torch.int64)
        cache = self.model.new_cache(cap)
        want_lp = logprobs or top_logprobs > 0
        lps: list[float] = []
        ranks: list[int] = []
        tops: list[list[tuple[int, float]]] = []
        finish: FinishReason = "length"
        stop_reason: int | None = None
        n = 0  # tokens that went through the model (they have a routes row)
        total = p  # tokens in seq
        while True:
            # Prefill on the first pass, then one decode step per sampled token (KV cache).
            logits, chunk_routes = self.model.extend(seq[n:total], cache, logits_from=-1)
            assert logits is not None
            routes[n:total] = chunk_routes
            n = total
            raw = logits[0]
            row = raw
            if stops and total - p < min_tokens:
                row = raw.clone()
                row[stops] = float("-inf")
            if temperature > 0:
                probs = (row / temperature).softmax(-1)
                tok = int(torch.multinomial(probs, 1, generator=gen).item())
            else:
                tok = int(torch.argmax(row).item())
            if want_lp:
                lp = raw.log_softmax(-1)
                lps.append(float(lp[tok]))
                ranks.append(int((lp > lp[tok]).sum()) + 1)
                if top_logprobs:
                    vals, ids = torch.topk(lp, min(top_logprobs, c.vocab_size))
                    tops.append(list(zip(ids.tolist(), vals.tolist(), strict=True)))
            seq[total] = tok
            total += 1
            if tok in stop_set:
                finish, stop_reason = "stop", tok
                break
            if total - p == max_tokens:
                break
        routed: np.ndarray | None = None
        if return_routed_experts:
            # The last sampled token never went through the model: P + G - 1 rows in all.
            routed = routes[start:n].numpy().astype(self.spec.dtype)
        return GenerateResult(
            token_ids=seq[p:total].tolist(),
            finish_reason=finish,
            routed_experts=routed,
            logprobs=lps if want_lp else None,
            logprob_ranks=ranks if want_lp else None,
            top_logprobs=tops if top_logprobs else None,
            stop_reason=stop_reason,
        )

    def info(self) -> dict[str, Any]:
        """The model's configuration, as JSON-ready values."""
        return dataclasses.asdict(self.config)
