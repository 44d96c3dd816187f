"""Ray Data scale-out of rollout Parquet roots (the ``ray`` extra, imported lazily).

- `rollout_dataset`: a root or file → ``ray.data.Dataset`` of Arrow blocks (routes
  restored, ``step`` int64; one read task per row group). Ray drops schema metadata, so
  `rollout_spec` reads the `RouteSpec` from the footers.
- `RayExecutor`: runs the `r3arrow.stats` statistics on Ray
  (``stats.expert_load(path, executor=RayExecutor())``), exactly equal to the local path.
- `shard_microbatches`: one streaming Dataset per (DP rank, PP stage) with exactly that
  rank's trajectories and that stage's layers; a worker iterates its `Shard` with
  `Shard.iter_tables` and collates each microbatch (``docs/ray.md``).
"""

from __future__ import annotations

from r3arrow._public import set_homes
from r3arrow.ray._core import RayExecutor, rollout_dataset, rollout_spec
from r3arrow.ray._shards import Shard, shard_microbatches

__all__ = ["RayExecutor", "Shard", "rollout_dataset", "rollout_spec", "shard_microbatches"]

set_homes(globals(), __all__)
