"""Ray Data scale-out: rollout Parquet roots as Ray Datasets of Arrow blocks.

- `rollout_dataset`: a step-partitioned root (or a file) → ``ray.data.Dataset`` of
  Arrow blocks with routes restored to the nested per-token type and ``step``
  as int64; one read task per Parquet row group. Files, steps and the spec come
  from `r3arrow.io` (`rollout_files`, `read_rollouts` with ``row_groups=``). Ray drops Arrow
  schema metadata from blocks, so the `RouteSpec` is read once from the Parquet
  footers on the driver (`rollout_spec`) and shipped to the workers.
- `RayExecutor`: the Ray executor of the `r3arrow.stats` statistics
  (``stats.expert_load(path, executor=RayExecutor())``; it implements
  `r3arrow.stats.Executor` structurally, without importing stats): the statistic
  hands it its per-block partial function, each block is reduced to exact integer
  partials in ``map_batches`` (in parallel, only the small partials move), then
  combined: streamed to the driver and summed (``reduce="driver"``, default) or with
  a Ray ``AggregateFnV2`` hash aggregate (``reduce="ray"``, grouped by ``step`` for
  the by-step statistics). Integer sums are order-independent, so every path equals
  the single-process one exactly.
- `shard_microbatches`: shard-aware delivery, the one collation path at scale — one
  streaming Ray Dataset per (DP rank, PP stage) holding exactly that rank's
  trajectories (the DP plan of `r3arrow.microbatch.split_microbatches`, the same
  microbatch count on every DP rank) and that stage's layers, read under a memory
  budget; a worker consumes its `Shard` with `Shard.iter_tables` and collates each
  microbatch with its rank's collator (``docs/ray.md``).

``ray`` is imported lazily (the ``ray`` extra). Modules: `_core` (reading, the
executor), `_shards` (shard-aware delivery).
"""

from __future__ import annotations

from r3arrow._public import set_homes
from r3arrow.ray._core import RayExecutor, rollout_dataset, rollout_spec
from r3arrow.ray._shards import Shard, shard_microbatches

__all__ = ["RayExecutor", "Shard", "rollout_dataset", "rollout_spec", "shard_microbatches"]

set_homes(globals(), __all__)
