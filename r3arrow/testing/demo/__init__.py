"""`r3arrow demo`: the whole pipeline, end to end, on the embedded engine (or a vLLM URL).

engine → multi-turn rollouts with incremental route capture → rollout table →
dynamic sampling → Parquet → routing statistics + heatmap → Megatron
microbatches → (with megatron-core) replay into real routers, checked against
what the engine routed (`r3arrow.testing.megatron`) → replay diagnostics. Against an external
engine without shape flags the spec is probed; vLLM does not report ``num_experts``, so the
replay routers are then sized from the routes observed
(`r3arrow.testing.megatron.experts_from_routes`), and the demo says so.

Replay diagnostics (stage 7, embedded engine and megatron-core only; ``docs/diagnostics.md``):
real megatron-core routers get the *engine's* router weights but run in bfloat16 (the
engine computes in float64) on the very hidden states the engine's routers scored
(`r3arrow.testing.engine.ReferenceEngine.router_inputs`). Their native top-k therefore differs from
the engine's at a few tokens, as a trainer's does from an inference engine's. The rollout
routes are replayed under ``replay_schedule(measure_agreement=True)``: the probe's
`RouteAgreement` (native vs replayed) is printed as the R3 paper's table, the replayed
routing is checked identical to the engine's, the probe is checked against an independent
native pass, and a float32 control shows the disagreement comes from the precision. Then
R3's effect on the log-probs (``docs/mismatch.md``, "The demo"): the whole model runs
trainer-side in bfloat16 (`r3arrow.testing.engine.TinyMoE.trainer_logprobs`) over the kept
trajectories twice, with its own routing and with the rollout's routes replayed, and the
mismatch of each against the engine's log-probs (the rollouts ask for them:
``rollout_logprobs``) is printed beside its routing disagreement, rows native / replay.
Everything is persisted with `r3arrow.io.write_diagnostics` into the output directory, so
``r3arrow diagnose OUT`` reads it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import signal
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from r3arrow._extras import require

with require(extra="all", feature="r3arrow demo"):
    import torch  # noqa: F401 - the extra's message before the engine and collation need it

from r3arrow.errors import R3ArrowError
from r3arrow.spec import RouteSpec


@dataclasses.dataclass(frozen=True)
class DemoConfig:
    """Sizes and endpoints of one demo run (CLI flags map 1:1)."""

    groups: int = 8
    samples: int = 4
    turns: int = 3
    max_tokens: int = 16
    out_dir: Path = Path("r3arrow-demo")
    engine_url: str | None = None
    num_layers: int | None = None
    topk: int | None = None
    num_experts: int | None = None
    moe_layers: tuple[int, ...] | None = None
    vocab_size: int = 512
    seed: int = 0
    progress: bool = True
    replay: bool = True
    microbatch_tokens: int = 2048
    temperature: float = 0.5


@dataclasses.dataclass
class DemoResult:
    """What the demo produced and checked; ``ok`` is False if any check failed."""

    ok: bool
    table: pa.Table
    kept: pa.Table
    parquet: Path
    heatmap: Path | None
    microbatches: int
    replay_tokens: int | None = None
    replay_mismatches: int | None = None
    #: Stage 7: bfloat16 routers' native routing vs the replayed (engine) routes.
    native_agreement: Any = None
    #: Stage 7: the float32 control (same weights and inputs).
    control_agreement: Any = None
    #: Stage 7: the diagnostics file written under ``out_dir``.
    diagnostics: Path | None = None
    #: Stage 7: mode ("native", "replay") -> `RouteAgreement` of the bfloat16 trainer-side
    #: forward's routing vs the rollout's.
    trainer_agreement: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: Stage 7: mode -> `r3arrow.stats.logprob_mismatch` of that forward vs the engine.
    mismatch: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)
    timings: dict[str, float] = dataclasses.field(default_factory=dict)


# Set by the demo's SIGINT handler: the next stage boundary (`_say`) stops the demo.
_STOP = threading.Event()


def _say(msg: str) -> None:
    if _STOP.is_set():
        raise KeyboardInterrupt
    print(msg, flush=True)


def _on_sigint(signum: int, frame: Any) -> None:
    """First Ctrl-C: stop at the next stage boundary; the second: stop now. Raising from the
    handler at an arbitrary point would land in whatever runs then, e.g. a weakref callback,
    where Python prints the traceback and drops the exception."""
    if _STOP.is_set():
        raise KeyboardInterrupt
    _STOP.set()
    print("r3arrow demo: stopping after this stage (Ctrl-C again to stop now)", file=sys.stderr)


@contextlib.contextmanager
def _stop_between_stages() -> Iterator[None]:
    """`_on_sigint` as the SIGINT handler while the demo runs (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _STOP.clear()
    previous = signal.signal(signal.SIGINT, _on_sigint)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        _STOP.clear()


def _shape(cfg: DemoConfig) -> dict[str, Any]:
    """The embedded engine's shape overrides from ``cfg`` (its defaults where unset)."""
    from r3arrow.testing.engine import TinyMoEConfig

    shape: dict[str, Any] = {
        name: value
        for name, value in (
            ("num_layers", cfg.num_layers),
            ("topk", cfg.topk),
            ("num_experts", cfg.num_experts),
        )
        if value is not None
    }
    if cfg.moe_layers is not None:
        num_layers = int(shape.get("num_layers", TinyMoEConfig.num_layers))
        # RouteSpec validates the ids against the layer count (unique, in range, non-empty).
        moe = RouteSpec(num_layers, 1, None, moe_layers=cfg.moe_layers).router_layers
        shape["dense_layers"] = tuple(i for i in range(num_layers) if i not in moe)
    return shape


@contextlib.contextmanager
def _engine(cfg: DemoConfig) -> Iterator[tuple[str, RouteSpec | None, Any]]:
    """Yield (url, spec, engine): the embedded engine on 127.0.0.1, or the external URL
    (engine None)."""
    if cfg.engine_url is not None:
        spec = None
        if cfg.num_layers is not None and cfg.topk is not None:
            spec = RouteSpec(cfg.num_layers, cfg.topk, cfg.num_experts, moe_layers=cfg.moe_layers)
        yield cfg.engine_url, spec, None
        return
    from r3arrow.testing.engine import EngineServer, ReferenceEngine, TinyMoEConfig

    engine = ReferenceEngine(TinyMoEConfig(seed=cfg.seed, vocab_size=cfg.vocab_size, **_shape(cfg)))
    with EngineServer(engine) as server:
        yield server.url, engine.config.route_spec(), engine


async def _rollouts(cfg: DemoConfig, url: str, spec: RouteSpec | None) -> pa.Table:
    from r3arrow.client import EngineClient
    from r3arrow.rollout import run_rollouts
    from r3arrow.testing.rollout import ArithmeticEnv

    rng = np.random.default_rng(cfg.seed)
    prompts = [
        rng.integers(1, cfg.vocab_size, size=int(rng.integers(8, 33))).tolist()
        for _ in range(cfg.groups)
    ]
    async with EngineClient(url, spec, vocab_size=cfg.vocab_size) as client:
        if client.spec is None:
            client.spec = await client.probe_spec(num_experts=cfg.num_experts)
        table = await run_rollouts(
            client,
            ArithmeticEnv(vocab_size=cfg.vocab_size, turns=cfg.turns),
            prompts,
            group_size=cfg.samples,
            max_turns=cfg.turns,
            sampling_params={
                "max_tokens": cfg.max_tokens,
                "temperature": cfg.temperature,
                "ignore_eos": True,
                "logprobs": 0,  # the sampled token's log-prob: rollout_logprobs (stage 7)
            },
            seed=cfg.seed,
            progress=cfg.progress,
            # Binary outcome reward (every turn solved), as in RLVR: some groups come out uniform.
            reward_fn=lambda _conv, summed: float(summed >= cfg.turns),
        )
        stats = client.stats
    _say(
        f"  {stats['requests']} requests, {stats['retries']} retries, "
        f"{stats['payload_bytes'] / 1e3:.1f} kB of route payload, {stats['route_rows']} route rows"
    )
    return table


def _megatron_available() -> bool:
    import importlib.util

    return (
        importlib.util.find_spec("megatron") is not None
        and importlib.util.find_spec("megatron.core") is not None
    )


def run_demo(cfg: DemoConfig) -> DemoResult:
    """Run the pipeline, printing what each stage did.

    Errors of any stage propagate; the checks (Parquet round trip, replay) are reported in the
    result, and `R3ArrowError` is raised at the end if one failed. Ctrl-C (in the main
    thread) stops the demo at the next stage boundary with `KeyboardInterrupt`; a second
    Ctrl-C stops it at once.
    """
    with _stop_between_stages():
        return _run(cfg)


def _run(cfg: DemoConfig) -> DemoResult:
    from r3arrow.collate import MegatronCollator
    from r3arrow.io import read_rollouts, write_rollouts
    from r3arrow.microbatch import split_microbatches
    from r3arrow.table import (
        captured_lengths,
        filter_groups,
        replace_groups,
        route_spec,
        sequence_lengths,
    )

    timings: dict[str, float] = {}
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with _engine(cfg) as (url, spec, engine):
        where = "embedded engine" if cfg.engine_url is None else "external engine"
        _say(
            f"[1/7] rollouts: {cfg.groups} groups x {cfg.samples} samples, "
            f"up to {cfg.turns} turns, {where} at {url}"
        )
        table = asyncio.run(_rollouts(cfg, url, spec))
    timings["rollouts"] = time.perf_counter() - t0
    spec = route_spec(table)
    tokens, captured = sequence_lengths(table), captured_lengths(table)
    experts = "an unreported number of" if spec.num_experts is None else str(spec.num_experts)
    _say(
        f"  {table.num_rows} trajectories, {int(tokens.sum())} tokens, "
        f"{int(captured.sum())} route rows ({spec.num_layers} layers x top-{spec.topk} of "
        f"{experts} experts, ids {spec.dtype}), "
        f"{table.nbytes / 1e3:.1f} kB in Arrow"
    )

    t = time.perf_counter()
    kept = filter_groups(table)
    timings["dynamic_sampling"] = time.perf_counter() - t
    groups = pc.count_distinct(table.column("group_id")).as_py()
    kept_groups = pc.count_distinct(kept.column("group_id")).as_py()
    _say(
        f"[2/7] dynamic sampling: kept {kept_groups}/{groups} groups with varied rewards "
        f"({kept.num_rows} trajectories, routes travel with their rows)"
    )
    if kept.num_rows == 0:
        _say("  every group had uniform rewards; continuing with the unfiltered table")
        kept = table
    elif kept_groups < groups:
        replaced = replace_groups(table, seed=cfg.seed).table
        _say(
            f"  or, with replacement: {replaced.num_rows} rows, uniform groups redrawn from "
            f"kept ones (seed {cfg.seed})"
        )

    t = time.perf_counter()
    parquet = write_rollouts(kept, cfg.out_dir / "rollouts.parquet")
    back = read_rollouts(parquet)
    timings["parquet"] = time.perf_counter() - t
    exact = bool(back.equals(kept)) and back.schema.metadata == kept.schema.metadata
    _say(
        f"[3/7] parquet: {parquet} ({parquet.stat().st_size / 1e3:.1f} kB), "
        f"round trip exact: {exact}"
    )

    t = time.perf_counter()
    heatmap: Path | None = None
    from r3arrow import stats

    load = stats.expert_load(kept)
    summary = stats.load_summary(load)
    worst = summary.sort("max_over_mean", descending=True).row(0, named=True)
    _say(
        f"[4/7] routing stats: {summary.height} MoE layers; most imbalanced layer {worst['layer']} "
        f"(max/mean {worst['max_over_mean']:.2f}, entropy {worst['entropy_norm']:.2f} of uniform, "
        f"{worst['dead']} dead experts)"
    )
    try:
        from r3arrow.plot import plot_expert_load

        heatmap = plot_expert_load(
            load, cfg.out_dir / "expert_load.png", title="expert load (demo rollouts)"
        )
        _say(f"  heatmap: {heatmap}")
    except ImportError as exc:  # matplotlib is an optional extra
        _say(f"  heatmap skipped ({exc})")
    timings["stats"] = time.perf_counter() - t

    t = time.perf_counter()
    collate = MegatronCollator(spec, layers=spec.router_layers, packed=True, align=8)
    parts = split_microbatches(kept, max_tokens=cfg.microbatch_tokens, multiple=collate.multiple)
    batches = [collate(part) for part in parts]
    timings["collate"] = time.perf_counter() - t
    mb0 = batches[0]
    targets = mb0.replay_targets()
    routes = mb0.routes
    if routes is None:  # collated with R3 on: the collator always carries targets here
        raise RuntimeError("demo: expected replay targets in the collated microbatch")
    _say(
        f"[5/7] megatron collation: {len(batches)} packed "
        f"microbatch{'' if len(batches) == 1 else 'es'} (<= {cfg.microbatch_tokens} tokens); "
        f"first: routes {tuple(routes.shape)} int32, "
        f"{int(mb0.padding_mask.sum())} padded positions, "
        f"{len(targets)} replay targets of {tuple(targets[0].shape)}"
    )

    result = DemoResult(
        ok=exact,
        table=table,
        kept=kept,
        parquet=parquet,
        heatmap=heatmap,
        microbatches=len(batches),
        timings=timings,
    )
    if not cfg.replay:
        _say("[6/7] replay: skipped (--no-replay)")
    elif not _megatron_available():
        _say("[6/7] replay: skipped (megatron-core not installed: pip install 'r3arrow[megatron]')")
    else:
        from r3arrow.testing.megatron import (
            build_routers,
            cpu_router_harness,
            experts_from_routes,
            replay_check,
        )

        t = time.perf_counter()
        checked = differ = 0
        num_experts = spec.num_experts
        if num_experts is None:  # probed from an engine that does not report it (vLLM)
            num_experts = experts_from_routes(kept, spec)
            _say(
                f"  num_experts not reported by the engine: routers sized from the routes "
                f"observed ({num_experts} = max id + 1 over the router layers, at least top-k)"
            )
        with warnings.catch_warnings():
            warnings.simplefilter(
                "ignore", UserWarning
            )  # megatron-core: TE/Apex absent, config notes
            with cpu_router_harness():
                routers = build_routers(spec, mb0.layers, num_experts=num_experts)
                for part, mb in zip(parts, batches, strict=True):
                    n, d = replay_check(routers, mb, part)
                    checked, differ = checked + n, differ + d
        timings["replay"] = time.perf_counter() - t
        result.replay_tokens, result.replay_mismatches = checked, differ
        result.ok = result.ok and differ == 0
        verdict = "identical" if differ == 0 else f"DIFFERENT on {differ} tokens"
        _say(
            f"[6/7] replay into {len(mb0.layers)} real megatron-core TopKRouters: "
            f"{checked} tokens, routing {verdict} to the engine's"
        )
    if not cfg.replay:
        _say("[7/7] replay diagnostics: skipped (--no-replay)")
    elif not _megatron_available():
        _say("[7/7] replay diagnostics: skipped (megatron-core not installed)")
    elif engine is None:
        _say("[7/7] replay diagnostics: skipped (needs the embedded engine's router weights)")
    else:
        from r3arrow.testing.demo._diagnostics import diagnose_replay

        t = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # megatron-core: TE/Apex absent
            found = diagnose_replay(engine, parts, batches, cfg.out_dir, say=_say)
        timings["diagnostics"] = time.perf_counter() - t
        result.native_agreement, result.control_agreement = found.native, found.control
        result.diagnostics = found.path
        result.trainer_agreement, result.mismatch = found.trainer_agreement, found.mismatch
        result.ok = result.ok and found.ok
    total = sum(timings.values())
    _say(f"done in {total:.1f} s: " + ", ".join(f"{k} {v:.2f}s" for k, v in timings.items()))
    if not result.ok:
        raise R3ArrowError("demo checks failed (see above)")
    return result


__all__ = ["DemoConfig", "DemoResult", "run_demo"]
