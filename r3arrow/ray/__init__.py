"""Ray Data scale-out: rollout Parquet roots as Ray Datasets of Arrow blocks.

- `read_rollouts`: a step-partitioned root (or a file) → ``ray.data.Dataset`` of
  Arrow blocks with routes restored to the nested per-token type and ``step``
  as int64; one read task per Parquet row group. Files, steps and the spec come
  from `r3arrow.io` (`scan_rollout_files`, `read_row_group`).
- `partials`: the Ray engine of `r3arrow.stats` (``engine="ray"``) — each block
  is reduced to exact integer partials in ``map_batches`` (in parallel, only the
  small partials move), then combined: streamed to the driver and summed
  (``reduce="driver"``, default) or with a Ray ``AggregateFnV2`` hash aggregate
  (``reduce="ray"``, grouped by ``step`` for the by-step statistics). Integer
  sums are order-independent, so every path equals the single-process one
  exactly. Call it through ``r3arrow.stats.expert_load(..., engine="ray")`` and
  friends; ``r3arrow.ray.expert_load`` etc. are deprecated aliases of those.
- `collate`: a collator (e.g. `r3arrow.collate.MegatronCollator`) run as
  ``map_batches``; each microbatch becomes one row of plain Arrow columns
  (values + shape per tensor) that ``Dataset.write_parquet`` writes back and
  `microbatch_arrays` decodes.
- `shard_microbatches`: shard-aware delivery — one streaming Ray Dataset per
  (DP rank, PP stage) holding exactly that rank's trajectories (the DP plan of
  `r3arrow.microbatch.split_microbatches`, the same microbatch count on every DP
  rank) and that stage's layers, read under a memory budget; a worker consumes
  its `Shard` with `Shard.iter_tables` (``docs/ray.md``).

Ray drops Arrow schema metadata from blocks, so the `RouteSpec` is read once
from the Parquet footers on the driver (`rollout_spec`) and shipped to the
workers with the functions. ``ray`` is imported lazily (the ``ray`` extra).

Modules: `_core` (reading, partials, collation), `_shards` (shard-aware delivery).
"""

from __future__ import annotations

from r3arrow.ray._core import (
    BlockFn,
    CombineFn,
    Reduce,
    collate,
    expert_counts,
    expert_counts_by_step,
    expert_load,
    microbatch_arrays,
    microbatch_row,
    partials,
    read_rollouts,
    rollout_spec,
    route_agreement,
    route_agreement_by_step,
)
from r3arrow.ray._shards import Shard, shard_microbatches

__all__ = [
    "BlockFn",
    "CombineFn",
    "Reduce",
    "Shard",
    "collate",
    "expert_counts",
    "expert_counts_by_step",
    "expert_load",
    "microbatch_arrays",
    "microbatch_row",
    "partials",
    "read_rollouts",
    "rollout_spec",
    "route_agreement",
    "route_agreement_by_step",
    "shard_microbatches",
]
