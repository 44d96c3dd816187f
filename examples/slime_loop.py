"""R3 through slime's ``Sample``, end to end on the embedded engine (docs/frameworks/slime.md).

rollouts (embedded MoE engine over HTTP) -> slime ``Sample`` fields (``tokens``,
``response_length``, ``loss_mask``, ``rollout_routed_experts`` int32 ``[len(tokens) - 1, L,
K]``) -> rollout table -> dynamic sampling -> Parquet -> routing stats -> slime's replay
layout (one pad row per sample, concatenated, as ``prepare_routed_experts_for_routing_replay``
builds it without CP/TP) checked against ``MegatronCollator`` -> replay into real
megatron-core ``TopKRouters`` on this CPU.

Needs the ``all`` extra; slime is not on PyPI, so samples are dicts with ``Sample``'s field
names (``to_samples`` returns slime's own ``Sample`` when slime imports). The replay stage
runs real routers on this CPU with `r3arrow.megatron.cpu` (the harness for tests, demos and
examples, not for training); without megatron-core it stops after collation. Prints one
line per stage and exits 1 if a check fails::

    python examples/slime_loop.py --groups 3 --samples 2 --out /tmp/slime-loop
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


def _slime_replay_rows(samples: list[Any], num_experts: int) -> np.ndarray:
    """slime's routing-replay rows without CP or TP padding (``cp_utils.py``): each sample's
    ``[len(tokens) - 1, L, K]`` routes plus one pad row ``arange(L * K) % E``, concatenated."""
    parts = []
    for s in samples:
        experts = np.asarray(s["rollout_routed_experts"])
        _, num_layers, topk = experts.shape
        pad = (np.arange(num_layers * topk) % num_experts).reshape(1, num_layers, topk)
        parts += [experts, pad.astype(experts.dtype)]
    return np.concatenate(parts, axis=0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=3)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("slime-loop"))
    args = parser.parse_args(argv)

    from r3arrow.adapters.slime import from_samples, to_samples
    from r3arrow.collate import MegatronCollator, split_microbatches
    from r3arrow.engine import EngineServer, ReferenceEngine, TinyMoEConfig
    from r3arrow.io import read_rollouts, write_rollouts
    from r3arrow.stats import expert_load, load_summary
    from r3arrow.table import captured_lengths, filter_groups, route_spec

    t0 = time.perf_counter()
    ok = True
    engine = ReferenceEngine(TinyMoEConfig(seed=args.seed, vocab_size=512))
    with EngineServer(engine) as server:
        table = asyncio.run(_rollouts(server.url, engine.config.route_spec(), args))
    spec = route_spec(table)
    assert spec.num_experts is not None
    _say(
        f"[1/8] rollouts: {table.num_rows} trajectories ({args.groups} groups x {args.samples}), "
        f"{int(captured_lengths(table).sum())} route rows, {spec.num_layers} layers x "
        f"top-{spec.topk} of {spec.num_experts} experts"
    )

    # fill_gap: a final observation after the last generation has no rows; slime needs them.
    samples = to_samples(table, fill_gap=True)
    first_experts = np.asarray(samples[0]["rollout_routed_experts"])
    fits = all(
        np.asarray(s["rollout_routed_experts"]).shape[0] == len(s["tokens"]) - 1 for s in samples
    )
    ok = ok and fits
    _say(
        f"[2/8] slime samples: {len(samples)} {type(samples[0]).__name__}s, "
        f"rollout_routed_experts {first_experts.dtype} [len(tokens) - 1, L, K] for all: {fits}"
    )

    back = from_samples(samples, spec)
    filled = int((captured_lengths(back) - captured_lengths(table)).sum())
    names = ["group_id", "prompt_ids", "response_ids", "loss_mask", "reward"]
    names += ["routes"] if filled == 0 else []  # filled gap rows are dummies, now "captured"
    exact = all(back.column(n).equals(table.column(n)) for n in names)
    ok = ok and exact
    _say(
        f"[3/8] back to a rollout table: {back.num_rows} rows, exact: {exact}; every slime row "
        f"counts as captured ({filled} gap rows were filled with dummies)"
    )

    kept = filter_groups(back)  # groups with varied rewards (index / group_index kept)
    note = ""
    if kept.num_rows == 0:
        kept, note = back, "; every group was uniform: continuing with all"
    _say(f"[4/8] dynamic sampling: kept {kept.num_rows}/{back.num_rows} trajectories{note}")

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

    # slime's packed replay rows vs r3arrow's packed collation (align 1: no CP/TP padding).
    layers = list(spec.router_layers)
    slime_rows = _slime_replay_rows(to_samples(disk, as_dataclass="dict"), spec.num_experts)
    mb = MegatronCollator(spec, layers=layers, packed=True)(disk)
    assert mb.routes is not None
    mine = mb.routes[0].numpy()  # [T, L_local, K]
    real = ~mb.padding_mask[0].numpy()
    agree = mine.shape[0] == slime_rows.shape[0] and bool(
        np.array_equal(mine[real], slime_rows[real][:, layers])
    )
    ok = ok and agree
    _say(
        f"[7/8] slime replay layout: {slime_rows.shape[0]} rows (one pad row per sample); "
        f"equals r3arrow's packed collation on every captured row: {agree}"
    )

    collate = MegatronCollator(spec, layers=layers, packed=True, align=8)
    parts = split_microbatches(disk, max_tokens=1024, multiple=collate.multiple)
    batches = [collate(part) for part in parts]
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
                routers = build_routers(spec, batches[0].layers)
                for part, b in zip(parts, batches, strict=True):
                    n, d = replay_check(routers, b, part)
                    checked, differ = checked + n, differ + d
    if skipped is not None:
        _say(f"[8/8] collation: {len(batches)} packed microbatch(es); replay skipped ({skipped})")
    else:
        ok = ok and differ == 0
        verdict = "identical" if differ == 0 else f"DIFFERENT on {differ} tokens"
        _say(
            f"[8/8] collation + replay: {len(batches)} packed microbatch(es) into "
            f"{len(layers)} real megatron-core TopKRouters: {checked} tokens, routing "
            f"{verdict} to the engine's"
        )
    _say(f"done in {time.perf_counter() - t0:.1f} s: {'ok' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
