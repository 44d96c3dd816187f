"""R3 through slime's ``Sample``, end to end on the embedded engine (docs/frameworks/slime.md).

rollouts (embedded MoE engine over HTTP) -> slime ``Sample`` fields (``tokens``,
``response_length``, ``loss_mask``, ``rollout_routed_experts`` int32 ``[len(tokens) - 1, L,
K]``) -> rollout table -> dynamic sampling -> Parquet -> routing stats -> slime's replay
layout (one pad row per sample, concatenated, as ``prepare_routed_experts_for_routing_replay``
builds it without CP/TP) checked against ``MegatronCollator`` -> replay into real
megatron-core ``TopKRouters`` on this CPU.

Needs the ``all`` extra; slime is not on PyPI, so samples are dicts with ``Sample``'s field
names (``to_samples`` returns slime's own ``Sample`` when slime imports). The replay stage
runs real routers on this CPU with `r3arrow.testing.megatron` (the harness for tests, demos and
examples, not for training); without megatron-core it stops after collation. Prints one
line per stage and exits 1 if a check fails::

    python examples/slime_loop.py --groups 3 --samples 2 --out /tmp/slime-loop
"""

from __future__ import annotations

import sys
import time
from typing import Any

import numpy as np

# `python examples/slime_loop.py` puts examples/ on sys.path, so the shared stages import as _common
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
    args = parse_args(__doc__, "slime-loop", argv)

    from r3arrow.adapters.slime import from_samples, to_samples
    from r3arrow.collate import MegatronCollator
    from r3arrow.table import captured_lengths

    t0 = time.perf_counter()
    ok = True
    table, spec = rollout_stage(args, "1/8")
    assert spec.num_experts is not None

    # fill_gap: a final observation after the last generation has no rows; slime needs them.
    samples = to_samples(table, fill_gap=True)
    first_experts = np.asarray(samples[0]["rollout_routed_experts"])
    fits = all(
        np.asarray(s["rollout_routed_experts"]).shape[0] == len(s["tokens"]) - 1 for s in samples
    )
    ok = ok and fits
    say(
        f"[2/8] slime samples: {len(samples)} {type(samples[0]).__name__}s, "
        f"rollout_routed_experts {first_experts.dtype} [len(tokens) - 1, L, K] for all: {fits}"
    )

    back = from_samples(samples, spec)
    filled = int((captured_lengths(back) - captured_lengths(table)).sum())
    names = ["group_id", "prompt_ids", "response_ids", "loss_mask", "reward"]
    names += ["routes"] if filled == 0 else []  # filled gap rows are dummies, now "captured"
    exact = all(back.column(n).equals(table.column(n)) for n in names)
    ok = ok and exact
    say(
        f"[3/8] back to a rollout table: {back.num_rows} rows, exact: {exact}; every slime row "
        f"counts as captured ({filled} gap rows were filled with dummies)"
    )

    kept, note = keep_varied_groups(back)  # groups with varied rewards (index / group_index kept)
    say(f"[4/8] dynamic sampling: kept {kept.num_rows}/{back.num_rows} trajectories{note}")

    disk, same = parquet_stage(kept, args.out, "5/8")
    ok = ok and same

    stats_stage(disk, "6/8")

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
    say(
        f"[7/8] slime replay layout: {slime_rows.shape[0]} rows (one pad row per sample); "
        f"equals r3arrow's packed collation on every captured row: {agree}"
    )

    ok = collate_replay_stage(spec, disk, "8/8") and ok
    return done(t0, ok)


if __name__ == "__main__":
    sys.exit(main())
