"""`collate_directory`: a rollout directory collated for one (DP rank, PP stage).

Built from the torch-free planner and share reader of `r3arrow._plan` (shared with
`r3arrow.ray.shard_microbatches`); ``docs/ray.md``, "Local: collate_directory".
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from r3arrow._checks import check_int, check_positive_int
from r3arrow._plan import DpAssign, _wave_loaders, plan_steps, read_ahead
from r3arrow._typing import PathLike
from r3arrow.collate._collator import MegatronCollator
from r3arrow.collate._microbatch import Microbatch
from r3arrow.io import DEFAULT_MAX_MEMORY


def collate_directory(
    path: PathLike,
    collator: MegatronCollator,
    *,
    steps: Sequence[int] | None = None,
    dp_size: int = 1,
    dp_rank: int = 0,
    max_tokens: int | None = None,
    num_microbatches: int | None = None,
    max_memory: int = DEFAULT_MAX_MEMORY,
    dp_assign: DpAssign = "contiguous",
    validate: bool = True,
) -> Iterator[tuple[int | None, Microbatch]]:
    """Yield ``(step, microbatch)`` of DP rank ``dp_rank`` over a rollout file or step root.

    Steps in numeric order (``steps`` selects; each must exist); the same microbatch count
    on every DP rank, padding microbatches last. ``dp_assign="contiguous"`` (default): each
    DP rank a contiguous row range whose boundaries snap to row-group starts, balanced to
    within one trajectory's cost, so a rank reads only its own row groups
    (`r3arrow._plan.plan_contiguous`; ``docs/scale.md``, "Per-rank reads").
    ``dp_assign="balanced"``: equal to collating `r3arrow.microbatch.split_microbatches`
    (these ``dp_size``, ``max_tokens``, ``num_microbatches``; the collator's
    ``multiple``/``packed``) of each step read whole, at the cost of each rank reading the
    stage's layers of nearly every row group. Only this rank's rows and ``collator.layers``
    are kept, with at most ``max_memory`` bytes (default 1 GiB) of taken rows plus one row
    group resident; the next wave is read while this one is collated when both fit.

    Raises ``TypeError``/``ValueError`` at call time for argument misuse (a collator
    without a spec or of a ``column`` other than ``"routes"``: the reader reads the
    rollout columns only, sizes not positive ints, ``dp_rank`` outside ``[0, dp_size)``, neither
    ``max_tokens`` nor ``num_microbatches``), `SchemaError` (``path`` set) for missing,
    foreign or corrupt files or mixed specs, and while iterating the readers' and the
    collator's errors.
    """
    if not isinstance(collator, MegatronCollator):
        raise TypeError(f"collator: expected a MegatronCollator, found {type(collator).__name__}")
    if collator.spec is None:
        raise ValueError(
            "collator: expected one with a spec (a rollout directory with routes), found "
            "spec=None (R3 off)"
        )
    if collator.column != "routes":
        raise ValueError(
            f"collator: expected one of column 'routes' (collate_directory reads the rollout "
            f"columns only), found column={collator.column!r}; read the step with "
            f"read_rollouts and collate its microbatches (collator.split) instead"
        )
    dp = check_positive_int(dp_size, "dp_size")
    rank = check_int(dp_rank, "dp_rank", minimum=0, maximum=dp - 1)
    budget = check_positive_int(max_memory, "max_memory")
    spec, plans = plan_steps(
        path,
        steps=steps,
        dp_size=dp,
        max_tokens=max_tokens,
        num_microbatches=num_microbatches,
        multiple=collator.multiple,
        packed=collator.packed,
        dp_assign=dp_assign,
        validate=validate,
    )
    layers = list(collator.layers)
    # planned on the caller's thread (token columns only), as read_ahead advances them
    loaders = (
        w for plan in plans for w in _wave_loaders(plan, rank, layers, spec, budget, validate)
    )

    def run() -> Iterator[tuple[int | None, Microbatch]]:
        for wave in read_ahead(loaders, budget):
            step, tables = wave.step, iter(wave.tables)
            del wave  # nothing but ``tables`` holds the pieces: dropped once it is done
            for _, table in tables:
                microbatch = collator(table)
                del table
                yield step, microbatch
            del tables

    return run()
