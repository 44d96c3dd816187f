"""R3 through verl's batch type, end to end on the embedded engine (docs/frameworks/verl.md).

rollouts (embedded MoE engine over HTTP) -> rollout table -> verl ``DataProto`` (the layout
verl's agent loop hands the trainer) -> back to a table -> Parquet -> routing stats ->
``MegatronCollator`` -> replay into real megatron-core ``TopKRouters`` on this CPU.

Needs the ``all`` extra plus verl (``pip install --no-deps verl==0.9.1`` and
``-r ci/verl-requirements.txt``). The replay stage runs real routers on this CPU
with `r3arrow.megatron.cpu` (the harness for tests, demos and examples, not for training);
without megatron-core it stops after collation. Prints one line per stage and
exits 1 if a check fails::

    python examples/verl_loop.py --groups 3 --samples 2 --out /tmp/verl-loop
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

PAD = 0  # the embedded engine's vocabulary has no pad token; verl pads with the tokenizer's


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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--groups", type=int, default=3)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("verl-loop"))
    args = parser.parse_args(argv)

    from r3arrow.adapters.verl import CAPTURED_KEY, from_dataproto, to_dataproto
    from r3arrow.collate import MegatronCollator, split_microbatches
    from r3arrow.engine import EngineServer, ReferenceEngine, TinyMoEConfig
    from r3arrow.io import read_rollouts, write_rollouts
    from r3arrow.stats import expert_load, load_summary
    from r3arrow.table import captured_lengths, route_spec, sequence_lengths
    from r3arrow.testing import assert_rollouts_equal

    t0 = time.perf_counter()
    ok = True
    engine = ReferenceEngine(TinyMoEConfig(seed=args.seed, vocab_size=512))
    with EngineServer(engine) as server:
        table = asyncio.run(_rollouts(server.url, engine.config.route_spec(), args))
    spec = route_spec(table)
    _say(
        f"[1/7] rollouts: {table.num_rows} trajectories ({args.groups} groups x {args.samples}), "
        f"{int(captured_lengths(table).sum())} route rows, {spec.num_layers} layers x "
        f"top-{spec.topk} of {spec.num_experts} experts"
    )

    data = to_dataproto(table, pad_token_id=PAD)
    b = data.batch
    routed = b["routed_experts"]
    _say(
        f"[2/7] verl DataProto: prompts {tuple(b['prompts'].shape)} left-padded, responses "
        f"{tuple(b['responses'].shape)} right-padded, routed_experts {tuple(routed.shape)} "
        f"{str(routed.dtype).removeprefix('torch.')}, uid + {CAPTURED_KEY} in non_tensor_batch"
    )

    back = from_dataproto(data, spec, pad_token_id=PAD)
    try:
        assert_rollouts_equal(back, table)
        exact = True
    except AssertionError as exc:
        _say(f"  mismatch: {exc}")
        exact = False
    ok = ok and exact
    # verl keeps no captured count: its trainer replays every attended row but the last
    rule = bool(np.array_equal(captured_lengths(table), sequence_lengths(table) - 1))
    _say(
        f"[3/7] back to a rollout table: {back.num_rows} rows, round trip exact: {exact}; "
        f"verl's rule (all attended rows but the last) = the engine's rows: {rule}"
    )

    args.out.mkdir(parents=True, exist_ok=True)
    path = write_rollouts(back, args.out / "rollouts.parquet")
    disk = read_rollouts(path)
    same = bool(disk.equals(back))
    ok = ok and same
    _say(f"[4/7] parquet: {path} ({path.stat().st_size / 1e3:.1f} kB), round trip exact: {same}")

    summary = load_summary(expert_load(disk, tokens="loss"))
    worst = summary.sort("max_over_mean", descending=True).row(0, named=True)
    _say(
        f"[5/7] routing stats: {summary.height} MoE layers, most imbalanced layer "
        f"{worst['layer']} (max/mean {worst['max_over_mean']:.2f})"
    )

    collate = MegatronCollator(spec, layers=spec.router_layers, packed=True, align=8)
    parts = split_microbatches(disk, max_tokens=1024, multiple=collate.multiple)
    batches = [collate(part) for part in parts]
    first = batches[0]
    targets = first.replay_targets()
    assert first.routes is not None  # collated with a spec: R3 is on
    _say(
        f"[6/7] megatron collation: {len(batches)} packed microbatch(es), first routes "
        f"{tuple(first.routes.shape)}, {len(targets)} replay targets"
    )

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
        _say(f"[7/7] replay: skipped ({skipped})")
    else:
        ok = ok and differ == 0
        verdict = "identical" if differ == 0 else f"DIFFERENT on {differ} tokens"
        _say(
            f"[7/7] replay into {len(first.layers)} real megatron-core TopKRouters: "
            f"{checked} tokens, routing {verdict} to the engine's"
        )
    _say(f"done in {time.perf_counter() - t0:.1f} s: {'ok' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
