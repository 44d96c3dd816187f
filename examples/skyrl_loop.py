"""R3 through SkyRL's batch types, end to end on the embedded engine (docs/frameworks/skyrl.md).

rollouts (embedded MoE engine over HTTP) -> SkyRL ``GeneratorOutput`` (the #1912 compact
layout: one ``[N, L, K]`` array per trajectory, terminal gap padded with dummy rows) ->
rollout table (with the captured counts) -> dynamic sampling -> Parquet -> routing stats ->
SkyRL's trainer batch (``to_training_inputs``) -> ``MegatronCollator`` -> replay into real
megatron-core ``TopKRouters`` on this CPU.

Needs the ``all`` extra (SkyRL itself is not imported: its types are plain dicts and lists).
The replay stage runs real routers on this CPU with `r3arrow.megatron.cpu` (the harness
for tests, demos and examples, not for training); without megatron-core it stops after
collation. Prints one line per
stage and exits 1 if a check fails::

    python examples/skyrl_loop.py --groups 3 --samples 2 --out /tmp/skyrl-loop
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

PAD = 0  # the embedded engine's vocabulary has no pad token; SkyRL pads with the tokenizer's


def _say(msg: str) -> None:
    print(msg, flush=True)


async def _rollouts(url: str, spec: Any, args: argparse.Namespace) -> pa.Table:
    from r3arrow.client import EngineClient
    from r3arrow.rollout import ArithmeticEnv, run_rollouts

    rng = np.random.default_rng(args.seed)
    prompts = [
        rng.integers(1, 512, size=int(rng.integers(6, 17))).tolist() for _ in range(args.groups)
    ]
    async with EngineClient(url, spec, vocab_size=512) as client:
        return await run_rollouts(
            client,
            ArithmeticEnv(vocab_size=512, turns=args.turns),
            prompts,
            group_size=args.samples,
            max_turns=args.turns,
            sampling_params={"max_tokens": args.max_tokens, "temperature": 0.7, "ignore_eos": True},
            seed=args.seed,
            reward_fn=lambda _conv, summed: float(summed >= args.turns),
        )


def _same(a: pa.Table, b: pa.Table) -> bool:
    names = ("group_id", "prompt_ids", "response_ids", "loss_mask", "reward", "routes")
    return all(a.column(n).equals(b.column(n)) for n in names)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=3)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("skyrl-loop"))
    args = parser.parse_args(argv)

    from r3arrow.adapters.skyrl import (
        from_generator_output,
        to_generator_output,
        to_training_inputs,
    )
    from r3arrow.collate import MegatronCollator, split_microbatches
    from r3arrow.engine import EngineServer, ReferenceEngine, TinyMoEConfig
    from r3arrow.io import read_rollouts, write_rollouts
    from r3arrow.stats import expert_load, load_summary
    from r3arrow.table import (
        captured_lengths,
        filter_groups,
        flat_routes,
        route_spec,
        sequence_lengths,
    )

    t0 = time.perf_counter()
    ok = True
    engine = ReferenceEngine(TinyMoEConfig(seed=args.seed, vocab_size=512))
    with EngineServer(engine) as server:
        table = asyncio.run(_rollouts(server.url, engine.config.route_spec(), args))
    spec = route_spec(table)
    captured = captured_lengths(table)
    _say(
        f"[1/8] rollouts: {table.num_rows} trajectories ({args.groups} groups x {args.samples}), "
        f"{int(captured.sum())} route rows, {spec.num_layers} layers x "
        f"top-{spec.topk} of {spec.num_experts} experts"
    )

    # What a SkyRL generator with #1912's RoutedExpertTrace hands the trainer.
    out, cap, uids = to_generator_output(table, layout="compact")
    gap = int((sequence_lengths(table) - cap).sum())
    _say(
        f"[2/8] SkyRL GeneratorOutput: {len(out['response_ids'])} trajectories, "
        f"rollout_expert_indices {len(out['rollout_expert_indices'])} arrays [N, L, K] "
        f"{out['rollout_expert_indices'][0].dtype}, {gap} terminal-gap rows padded with dummies"
    )

    back = from_generator_output(out, spec, captured=cap, uids=uids)
    exact = _same(back, table)
    blind = from_generator_output(out, spec, uids=uids)  # no captured: padding looks real
    lost = int((captured_lengths(blind) - captured).sum())
    ok = ok and exact and lost == gap
    _say(
        f"[3/8] back to a rollout table with captured=: exact: {exact}; without it {lost} "
        f"dummy rows would count as routes (cannot be undone)"
    )

    kept = filter_groups(back)  # SkyRL's zero-variance filter (singleton groups are kept)
    note = ""
    if kept.num_rows == 0:
        kept, note = back, "; every group was uniform: continuing with all"
    _say(
        f"[4/8] dynamic sampling: kept {kept.num_rows}/{back.num_rows} trajectories of groups "
        f"with varied rewards (routes travel with their rows){note}"
    )

    args.out.mkdir(parents=True, exist_ok=True)
    path = write_rollouts(kept, args.out / "rollouts.parquet")
    disk = read_rollouts(path)
    same = bool(disk.equals(kept))
    ok = ok and same
    _say(f"[5/8] parquet: {path} ({path.stat().st_size / 1e3:.1f} kB), round trip exact: {same}")

    summary = load_summary(expert_load(disk, tokens="loss"))
    worst = summary.sort("max_over_mean", descending=True).row(0, named=True)
    _say(
        f"[6/8] routing stats: {summary.height} MoE layers, most imbalanced layer "
        f"{worst['layer']} (max/mean {worst['max_over_mean']:.2f})"
    )

    batch = to_training_inputs(disk, pad_token_id=PAD, tensors="torch")
    rei, pad_mask = batch["rollout_expert_indices"], batch["router_padding_mask"]
    aligned = bool(np.array_equal(rei[~pad_mask].numpy(), flat_routes(disk)[0]))
    ok = ok and aligned
    _say(
        f"[7/8] SkyRL trainer batch: sequences {tuple(batch['sequences'].shape)} left-padded, "
        f"loss_mask {tuple(batch['loss_mask'].shape)} right-aligned, rollout_expert_indices "
        f"{tuple(rei.shape)} {str(rei.dtype).removeprefix('torch.')}; captured rows aligned: "
        f"{aligned}"
    )

    collate = MegatronCollator(spec, layers=spec.router_layers, packed=True, align=8)
    parts = split_microbatches(disk, max_tokens=1024, multiple=collate.multiple)
    batches = [collate(part) for part in parts]
    first = batches[0]
    checked = differ = 0
    skipped: ImportError | None = None
    with warnings.catch_warnings():
        # megatron-core's import and CPU routers warn (TE/Apex absent, torch.jit deprecations)
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            import megatron.core  # noqa: F401

            from r3arrow.megatron.cpu import build_routers, cpu_router_harness, replay_check
        except ImportError as exc:
            skipped = exc
        else:
            with cpu_router_harness():
                routers = build_routers(spec, first.layers)
                for part, mb in zip(parts, batches, strict=True):
                    n, d = replay_check(routers, mb, part)
                    checked, differ = checked + n, differ + d
    if skipped is not None:
        _say(f"[8/8] collation: {len(batches)} packed microbatch(es); replay skipped ({skipped})")
    else:
        ok = ok and differ == 0
        verdict = "identical" if differ == 0 else f"DIFFERENT on {differ} tokens"
        _say(
            f"[8/8] collation + replay: {len(batches)} packed microbatch(es) into "
            f"{len(first.layers)} real megatron-core TopKRouters: {checked} tokens, routing "
            f"{verdict} to the engine's"
        )
    _say(f"done in {time.perf_counter() - t0:.1f} s: {'ok' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
