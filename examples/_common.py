"""What the framework loops in this folder share (``verl_loop.py``, ``skyrl_loop.py``,
``slime_loop.py``): the command line, rollouts on the embedded engine, and the Parquet, routing
stats, collation and replay stages. Each loop keeps its framework's own stages.

Not an example on its own; the loops import it as ``from _common import ...``.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import orjson
import pyarrow as pa

if TYPE_CHECKING:
    from r3arrow.collate import Microbatch
    from r3arrow.spec import RouteSpec

VOCAB = 512  # the embedded engine's vocabulary size


def say(msg: str) -> None:
    print(msg, flush=True)


def parse_args(doc: str, out: str, argv: list[str] | None) -> argparse.Namespace:
    """The options every loop takes; ``out`` names the default output folder, made under the
    system's temp directory (never in the working tree)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--groups", type=int, default=3)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(tempfile.gettempdir()) / out)
    return parser.parse_args(argv)


async def _rollouts(url: str, spec: RouteSpec, args: argparse.Namespace) -> pa.Table:
    from r3arrow.client import EngineClient
    from r3arrow.rollout import run_rollouts
    from r3arrow.testing.rollout import ArithmeticEnv

    rng = np.random.default_rng(args.seed)
    prompts = [
        rng.integers(1, VOCAB, size=int(rng.integers(6, 17))).tolist() for _ in range(args.groups)
    ]
    async with EngineClient(url, spec, vocab_size=VOCAB) as client:
        return await run_rollouts(
            client,
            ArithmeticEnv(vocab_size=VOCAB, turns=args.turns),
            prompts,
            group_size=args.samples,
            max_turns=args.turns,
            sampling_params={"max_tokens": args.max_tokens, "temperature": 0.7, "ignore_eos": True},
            seed=args.seed,
            reward_fn=lambda _conv, summed: float(summed >= args.turns),
        )


def rollout_stage(args: argparse.Namespace, stage: str) -> tuple[pa.Table, RouteSpec]:
    """Start the embedded MoE engine, run the rollouts over HTTP, print the ``stage`` line."""
    from r3arrow.table import captured_lengths, route_spec
    from r3arrow.testing.engine import EngineServer, ReferenceEngine, TinyMoEConfig

    engine = ReferenceEngine(TinyMoEConfig(seed=args.seed, vocab_size=VOCAB))
    with EngineServer(engine) as server:
        table = asyncio.run(_rollouts(server.url, engine.config.route_spec(), args))
    spec = route_spec(table)
    say(
        f"[{stage}] rollouts: {table.num_rows} trajectories ({args.groups} groups x "
        f"{args.samples}), {int(captured_lengths(table).sum())} route rows, {spec.num_layers} "
        f"layers x top-{spec.topk} of {spec.num_experts} experts"
    )
    return table, spec


def keep_varied_groups(table: pa.Table) -> tuple[pa.Table, str]:
    """Dynamic sampling: the groups with varied rewards, or all of them (and a note) if none."""
    from r3arrow.table import filter_groups

    kept = filter_groups(table)
    if kept.num_rows == 0:
        return table, "; every group was uniform: continuing with all"
    return kept, ""


def parquet_stage(table: pa.Table, out: Path, stage: str) -> tuple[pa.Table, bool]:
    """Write ``out/rollouts.parquet``, read it back; returns the table read and whether it is
    exactly ``table``."""
    from r3arrow.io import read_rollouts, write_rollouts

    out.mkdir(parents=True, exist_ok=True)
    path = write_rollouts(table, out / "rollouts.parquet")
    disk = read_rollouts(path)
    same = bool(disk.equals(table))
    say(f"[{stage}] parquet: {path} ({path.stat().st_size / 1e3:.1f} kB), round trip exact: {same}")
    return disk, same


def stats_stage(table: pa.Table, stage: str) -> None:
    from r3arrow.stats import expert_load, load_summary, r3_metrics, route_fallback
    from r3arrow.table import captured_lengths

    summary = load_summary(expert_load(table, tokens="loss"))
    worst = summary.sort("max_over_mean", descending=True).row(0, named=True)
    say(
        f"[{stage}] routing stats: {summary.height} MoE layers, most imbalanced layer "
        f"{worst['layer']} (max/mean {worst['max_over_mean']:.2f})"
    )
    # what a training loop hands its logger each step (wandb.log, SummaryWriter, mlflow)
    captured = max(1, int(captured_lengths(table).sum()))
    metrics = r3_metrics(
        route_bytes_per_token=table.column("routes").nbytes / captured,
        fallback_token_route_fraction=route_fallback(table).fraction,
    )
    say(f"  logged metrics: {orjson.dumps(metrics).decode()}")


def collate(spec: RouteSpec, table: pa.Table) -> tuple[list[pa.Table], list[Microbatch]]:
    """Packed microbatches of every router layer (align 8), with the parts they came from."""
    from r3arrow.collate import MegatronCollator
    from r3arrow.microbatch import split_microbatches

    collator = MegatronCollator(spec, layers=spec.router_layers, packed=True, align=8)
    parts = split_microbatches(table, max_tokens=1024, multiple=collator.multiple)
    return parts, [collator(part) for part in parts]


def replay(
    spec: RouteSpec, parts: list[pa.Table], batches: list[Microbatch]
) -> tuple[int, int, ImportError | None]:
    """Replay ``batches`` into real megatron-core TopKRouters on this CPU: (tokens checked,
    tokens routed differently, the ImportError if megatron-core is absent)."""
    checked = differ = 0
    with warnings.catch_warnings():
        # megatron-core's import and CPU routers warn (TE/Apex absent, torch.jit deprecations)
        warnings.simplefilter("ignore", UserWarning)
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            import megatron.core  # noqa: F401

            from r3arrow.testing.megatron import build_routers, cpu_router_harness, replay_check
        except ImportError as exc:
            return 0, 0, exc
        with cpu_router_harness():
            routers = build_routers(spec, batches[0].layers)
            for part, mb in zip(parts, batches, strict=True):
                n, d = replay_check(routers, mb, part)
                checked, differ = checked + n, differ + d
    return checked, differ, None


def verdict(differ: int) -> str:
    return "identical" if differ == 0 else f"DIFFERENT on {differ} tokens"


def collate_replay_stage(spec: RouteSpec, table: pa.Table, stage: str) -> bool:
    """Collation and replay as one stage line; False if the replay routed any token differently."""
    parts, batches = collate(spec, table)
    checked, differ, skipped = replay(spec, parts, batches)
    if skipped is not None:
        say(
            f"[{stage}] collation: {len(batches)} packed microbatch(es); replay skipped ({skipped})"
        )
        return True
    say(
        f"[{stage}] collation + replay: {len(batches)} packed microbatch(es) into "
        f"{len(batches[0].layers)} real megatron-core TopKRouters: {checked} tokens, routing "
        f"{verdict(differ)} to the engine's"
    )
    return differ == 0


def done(t0: float, ok: bool) -> int:
    """Print the last line; the exit status."""
    say(f"done in {time.perf_counter() - t0:.1f} s: {'ok' if ok else 'FAILED'}")
    return 0 if ok else 1
