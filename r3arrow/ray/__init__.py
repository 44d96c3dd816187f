"""Ray Data scale-out of rollout Parquet roots (the ``ray`` extra, imported lazily):
`rollout_dataset`, a ``ray.data.Dataset`` of Arrow blocks (Ray drops schema metadata:
`rollout_spec` reads the `RouteSpec` from the footers); `RayExecutor`, the `r3arrow.stats`
statistics on Ray, exactly equal to the local path; `shard_microbatches`, one streaming
`Shard` per (DP rank, PP stage) with exactly that rank's trajectories and that stage's
layers, which a worker iterates with `Shard.iter_tables` (``docs/ray.md``).
"""

from __future__ import annotations

from r3arrow._public import set_homes
from r3arrow.ray._core import RayExecutor, rollout_dataset, rollout_spec
from r3arrow.ray._shards import Shard, shard_microbatches

__all__ = ["RayExecutor", "Shard", "rollout_dataset", "rollout_spec", "shard_microbatches"]

set_homes(globals(), __all__)
