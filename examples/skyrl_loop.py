"""R3 through SkyRL's batch types, end to end on the embedded engine (docs/frameworks/skyrl.md).

rollouts (embedded MoE engine over HTTP) -> SkyRL ``GeneratorOutput`` (the #1912 compact
layout: one ``[N, L, K]`` array per trajectory, terminal gap padded with dummy rows) ->
rollout table (with the captured counts) -> dynamic sampling -> Parquet -> routing stats ->
SkyRL's trainer batch (``to_training_inputs``) -> ``MegatronCollator`` -> replay into real
megatron-core ``TopKRouters`` on this CPU.

Needs the ``all`` extra (SkyRL itself is not imported: its types are plain dicts and lists).
The replay stage runs real routers on this CPU with `r3arrow.testing.megatron` (the harness
for tests, demos and examples, not for training); without megatron-core it stops after
collation. Prints one line per
stage and exits 1 if a check fails::

    python examples/skyrl_loop.py --groups 3 --samples 2 --out /tmp/skyrl-loop
"""

from __future__ import annotations

import sys
import time

import numpy as np
import pyarrow as pa

# `python examples/skyrl_loop.py` puts examples/ on sys.path, so the shared stages import as _common
from _common import (
    collate_replay_stage,
    done,
    keep_varied_groups,
    parquet_stage,
    parse_args,
    rollout_stage,
    say,
    stats_stage,
)

PAD = 0  # the embedded engine's vocabulary has no pad token; SkyRL pads with the tokenizer's


def _same(a: pa.Table, b: pa.Table) -> bool:
    names = ("group_id", "prompt_ids", "response_ids", "loss_mask", "reward", "routes")
    return all(a.column(n).equals(b.column(n)) for n in names)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__, "skyrl-loop", argv)

    from r3arrow.adapters.skyrl import (
        from_generator_output,
        to_generator_output,
        to_training_inputs,
    )
    from r3arrow.table import captured_lengths, flat_routes, sequence_lengths

    t0 = time.perf_counter()
    ok = True
    table, spec = rollout_stage(args, "1/8")
    captured = captured_lengths(table)

    # What a SkyRL generator with #1912's RoutedExpertTrace hands the trainer.
    out, cap, uids = to_generator_output(table, layout="compact")
    gap = int((sequence_lengths(table) - cap).sum())
    say(
        f"[2/8] SkyRL GeneratorOutput: {len(out['response_ids'])} trajectories, "
        f"rollout_expert_indices {len(out['rollout_expert_indices'])} arrays [N, L, K] "
        f"{out['rollout_expert_indices'][0].dtype}, {gap} terminal-gap rows padded with dummies"
    )

    back = from_generator_output(out, spec, captured=cap, uids=uids)
    exact = _same(back, table)
    blind = from_generator_output(out, spec, uids=uids)  # no captured: padding looks real
    lost = int((captured_lengths(blind) - captured).sum())
    ok = ok and exact and lost == gap
    say(
        f"[3/8] back to a rollout table with captured=: exact: {exact}; without it {lost} "
        f"dummy rows would count as routes (cannot be undone)"
    )

    # SkyRL's zero-variance filter (singleton groups are kept)
    kept, note = keep_varied_groups(back)
    say(
        f"[4/8] dynamic sampling: kept {kept.num_rows}/{back.num_rows} trajectories of groups "
        f"with varied rewards (routes travel with their rows){note}"
    )

    disk, same = parquet_stage(kept, args.out, "5/8")
    ok = ok and same

    stats_stage(disk, "6/8")

    batch = to_training_inputs(disk, pad_token_id=PAD, tensors="torch")
    rei, pad_mask = batch["rollout_expert_indices"], batch["router_padding_mask"]
    aligned = bool(np.array_equal(rei[~pad_mask].numpy(), flat_routes(disk)[0]))
    ok = ok and aligned
    say(
        f"[7/8] SkyRL trainer batch: sequences {tuple(batch['sequences'].shape)} left-padded, "
        f"loss_mask {tuple(batch['loss_mask'].shape)} right-aligned, rollout_expert_indices "
        f"{tuple(rei.shape)} {str(rei.dtype).removeprefix('torch.')}; captured rows aligned: "
        f"{aligned}"
    )

    ok = collate_replay_stage(spec, disk, "8/8") and ok
    return done(t0, ok)


if __name__ == "__main__":
    sys.exit(main())
