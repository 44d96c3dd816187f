"""The collation chain of issue 13, side by side: r3arrow vs an independent SkyRL-style path.

Both start from the same finalized per-trajectory routes (r3arrow: `RouteTrace.finalize`
output; the baseline: the same rows as numpy arrays) and end with int32 per-layer targets
installed into real megatron-core ``RouterReplay`` instances (CPU harness):

* **r3arrow**: ``rollout_table`` (from the finalized traces) -> ``MegatronCollator`` (packed,
  the fused gather + id check + int32 widening) -> validated ``install_replay`` (it skips the
  id scan the fused pass already ran). The collator also builds every model input tensor.
* **baseline** (SkyRL #1912's approach, written here from its description, not imported):
  a dense left-padded ``[B, S_max, L, K]`` uint8 tensor, ``index_select`` of the stage's
  layers, removal of the left padding with per-sequence alignment into one packed
  ``[1, T, L_local, K]`` row, a per-layer int32 split and ``RouterReplay.set_replay_data``.
  Routes only (no model inputs) and no id checks (SkyRL installs what it got): both favour
  the baseline, whose padding rows (zeros) would fail the duplicate-expert rule anyway.
* **skyrl** (SkyRL PR #1912's own functions, imported from a checkout of the PR head:
  ``_skyrl_real.py``): the trainer's ``convert_prompts_responses_to_batch_tensors`` (the dense
  left-padded batch) and ``make_router_padding_mask``, then the worker's
  ``build_token_metadata_layout`` and ``setup_per_microbatch_replay_forward`` (packed) into the
  same real instances, the stage picked by SkyRL's ``patch_topk_router_layer_number`` numbers
  (13..24); its installed targets are checked equal to r3arrow's (and to the rollout's ids)
  on every captured token before the timing. Without a checkout (``--skyrl-checkout DIR``, or
  the mirror to extract one from) the side returns ``{"na": reason}``.

`run_chain` returns a JSON-able dict of timings; ``bench_collate.py`` runs each side in its
own process (peak memory above the input is the side's own) and prints the table.
"""

from __future__ import annotations

import gc
import time
import warnings
from typing import Any

import _skyrl_real
import numpy as np
from _common import best_of, proc_status_mb, reset_peak_rss


def _inputs(n_traj: int, tokens: int, layers: int, topk: int, experts: int) -> dict[str, Any]:
    """Per-trajectory rows ``[n - 1, L, K]`` uint8 with distinct ids, prompts, responses."""
    rng = np.random.default_rng(0)
    n = np.full(n_traj, tokens, dtype=np.int64)
    plen = np.minimum(rng.integers(64, 1024, n_traj), tokens // 2)
    offs = rng.permutation(experts)[:topk].astype(np.int64)
    rows = []
    for m in n.tolist():
        starts = rng.integers(0, experts, (m - 1, layers, 1))
        rows.append(((starts + offs) % experts).astype(np.uint8))
    prompts = [rng.integers(0, 32000, int(p), dtype=np.int32) for p in plen]
    resps = [
        rng.integers(0, 32000, int(m - p), dtype=np.int32) for m, p in zip(n, plen, strict=True)
    ]
    return {"n": n, "plen": plen, "rows": rows, "prompts": prompts, "responses": resps}


def _traces(spec: Any, data: dict[str, Any]) -> list[Any]:
    """Finalized RouteTraces' Arrow arrays (one recorded turn each, handed over)."""
    import r3arrow

    out = []
    for rows, p, m in zip(data["rows"], data["plen"].tolist(), data["n"].tolist(), strict=True):
        trace = r3arrow.RouteTrace(spec)
        trace.record(rows.copy(), prompt_tokens=p, generated_tokens=m - p, copy=False)
        mask = np.concatenate([np.zeros(p, np.uint8), np.ones(m - p, np.uint8)])
        out.append(trace.finalize(num_tokens=m, loss_mask=mask))
    return out


def _skyrl_style(
    rows: list[np.ndarray], n: np.ndarray, layers: list[int], align: int, rr: Any
) -> list[Any]:
    """The dense baseline described in the module docstring; returns the installed targets."""
    import torch

    b, s_max = len(rows), int(n.max())
    n_layers, k = rows[0].shape[1], rows[0].shape[2]
    dense = torch.zeros((b, s_max, n_layers, k), dtype=torch.uint8)
    mask = torch.zeros((b, s_max), dtype=torch.bool)
    for i, r in enumerate(rows):  # left padding: the sequence ends at s_max
        start = s_max - int(n[i])
        dense[i, start : start + r.shape[0]] = torch.from_numpy(r)
        mask[i, start:] = True
    local = dense.index_select(2, torch.tensor(layers))  # this PP stage's layers
    seq = mask.sum(dim=1)
    padded = (seq + align - 1) // align * align
    packed = torch.zeros((1, int(padded.sum()), len(layers), k), dtype=torch.uint8)
    at = 0
    for i in range(b):  # remove the left padding, one aligned segment per sequence
        m = int(seq[i])
        packed[0, at : at + m] = local[i, s_max - m :]
        at += int(padded[i])
    targets = [packed[0, :, j, :].to(torch.int32) for j in range(len(layers))]
    rr.set_replay_data(targets)
    return targets


def run_chain(args: Any, side: str) -> dict[str, Any]:
    """One side (``"r3arrow"``, ``"baseline"`` or ``"skyrl"``) of the chain; timings in
    seconds (``{"side", "na"}`` when skyrl is unavailable)."""
    import torch

    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")  # megatron-core's import-time notices
    sk, note = None, ""
    if side == "skyrl":
        sk, note = _skyrl_real.load(
            *_skyrl_real.checkout_dir(args.skyrl_checkout), _skyrl_real.CHAIN
        )
    if side == "skyrl" and sk is None:
        return {"side": side, "na": note}
    import r3arrow
    from r3arrow.megatron import install_replay, replay_schedule
    from r3arrow.testing.megatron import build_routers, cpu_router_harness

    spec = r3arrow.RouteSpec(num_layers=args.layers, topk=args.topk, num_experts=args.experts)
    per_stage = args.layers // args.pp
    layers = list(range(args.stage * per_stage, (args.stage + 1) * per_stage))
    data = _inputs(args.trajectories, args.tokens, args.layers, args.topk, args.experts)
    collate = r3arrow.MegatronCollator(
        spec, layers=layers, packed=True, align=args.align, num_threads=args.threads
    )
    finals = _traces(spec, data) if side != "baseline" else []

    def build() -> Any:
        return r3arrow.rollout_table(
            trajectory_id=[f"t{i}" for i in range(args.trajectories)],
            group_id=[f"g{i // 8}" for i in range(args.trajectories)],
            prompt_ids=data["prompts"],
            response_ids=data["responses"],
            loss_mask=[np.ones(len(r), dtype=np.uint8) for r in data["responses"]],
            reward=np.zeros(args.trajectories),
            routes=finals,
            spec=spec,
        )

    times: dict[str, float] = {}
    extra: dict[str, Any] = {}
    with cpu_router_harness() as mc, torch.no_grad():
        if sk is not None:  # SkyRL's worker patches TopKRouter before it builds the model
            _skyrl_real.patch_layer_numbers(sk)
        routers = build_routers(spec, layers)
        rr = mc.RouterReplay
        skyrl_chain = None
        if sk is not None:
            _skyrl_real.check_layer_numbers(rr, layers)
            inputs = _skyrl_real.prepare(sk, data)
            skyrl_chain = _skyrl_real.SkyrlChain(sk, inputs, routers[0].config, args.align)

        def r3arrow_chain() -> list[Any]:
            with replay_schedule():
                return install_replay(collate(build()), routers)

        def chain() -> list[Any]:
            if side == "baseline":
                return _skyrl_style(data["rows"], data["n"], layers, args.align, rr)
            if skyrl_chain is not None:
                return skyrl_chain()
            return r3arrow_chain()

        first = chain()  # warm: imports, kernel caches, pools
        out_bytes = sum(int(t.numel()) * t.element_size() for t in first)
        if skyrl_chain is not None:  # SkyRL's targets == r3arrow's == the rollout's ids
            extra["checked_tokens"] = _skyrl_real.verify(
                first, r3arrow_chain(), data, layers, args.align
            )
            extra["held_bytes"] = _skyrl_real.held_bytes(first)
            extra["note"] = note
        if side == "r3arrow":  # the same targets as the baseline's on every captured token
            ref = _skyrl_style(data["rows"], data["n"], layers, args.align, rr)
            mb = collate(build())
            real = ~mb.padding_mask.reshape(-1)
            for got, want in zip(mb.replay_targets(), ref, strict=True):
                assert torch.equal(got[real], want[real]), "r3arrow != baseline targets"
            del ref, mb
        del first
        gc.collect()
        rss = proc_status_mb("VmRSS")
        reset = reset_peak_rss()
        t0 = time.perf_counter()
        kept = chain()
        cold = time.perf_counter() - t0
        peak = proc_status_mb("VmHWM") - rss if reset else float("nan")
        del kept
        src = np.ones(out_bytes, dtype=np.uint8)
        dst = np.zeros_like(src)
        copy = warm = float("inf")
        for _ in range(args.repeat):  # interleaved: the same machine state for both
            copy = min(copy, best_of(lambda: np.copyto(dst, src), 1, warmup=0))
            warm = min(warm, best_of(chain, 1, warmup=0))
        if side == "r3arrow":
            table = build()
            times["table_s"] = best_of(build, args.repeat)
            times["collate_s"] = best_of(lambda: collate(table), args.repeat)
            mb = collate(table)

            def install() -> None:
                with replay_schedule():
                    install_replay(mb, routers)

            times["install_s"] = best_of(install, args.repeat)
        if skyrl_chain is not None:
            routes, attention, padding = skyrl_chain.convert()
            times["convert_s"] = best_of(skyrl_chain.convert, args.repeat)

            def setup() -> None:
                skyrl_chain.setup(routes, attention, padding)
                skyrl_chain.sk.replay_utils.clear_router_replay()

            times["setup_s"] = best_of(setup, args.repeat)
    return {
        "side": side,
        "warm_s": warm,
        "cold_s": cold,
        "copy_s": copy,
        "out_bytes": out_bytes,
        "peak_extra_mb": peak,
        "tokens": int(data["n"].sum()),
        **times,
        **extra,
    }
