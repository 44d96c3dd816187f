"""Collate a rollout directory for one (DP rank, PP stage), streamed by row group.

`collate_directory` is the local path (one process per rank). It is built from the
torch-free planner and share reader of the core, `r3arrow._plan` (`plan_steps`,
`read_share`, `plan_contiguous`; re-exported here), shared with
`r3arrow.ray.shard_microbatches`. Per step the plan is computed from the token columns,
the rank's share is read in waves (only its row groups, only the collator's layers) and
each microbatch table is collated; the next wave is read on a background thread while
the current one is collated (Arrow's Parquet reader and the collator's copies release
the GIL), so two waves of half the budget are in flight (``docs/ray.md``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from r3arrow._checks import check_int, check_positive_int
from r3arrow._plan import (
    COLLATE_COLUMNS,
    DEFAULT_MAX_MEMORY,
    DP_ASSIGNMENTS,
    RowGroupRef,
    StepPlan,
    _per_token,
    _Wave,
    _wave_loaders,
    plan_contiguous,
    plan_steps,
    read_ahead,
    read_share,
)
from r3arrow._typing import PathLike
from r3arrow.collate._collator import MegatronCollator
from r3arrow.collate._microbatch import Microbatch


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
    dp_assign: str = "balanced",
    validate: bool = True,
) -> Iterator[tuple[int | None, Microbatch]]:
    """Yield ``(step, microbatch)`` of DP rank ``dp_rank`` over a rollout file or step root.

    Steps in numeric order (``steps`` selects; each must exist); per step the
    microbatches of `r3arrow.microbatch.split_microbatches` with these ``dp_size``,
    ``max_tokens``, ``num_microbatches`` and the collator's ``multiple``/``packed``, in
    that order: the same count on every DP rank, padding microbatches
    (``Microbatch.is_padding``) last. Only the rows of this rank and only
    ``collator.layers`` (a layer-projected read, ``docs/storage.md``) are read, row group by
    row group, with at most ``max_memory`` bytes (default 1 GiB) of taken rows plus one
    row group resident; see the module docstring for the waves. Equal to collating
    ``split_microbatches`` of each step read whole with `r3arrow.read_rollouts`;
    ``dp_assign="contiguous"`` plans with `plan_contiguous` instead (each DP rank a
    contiguous row range that reads only its row groups; see `plan_steps`).

    Raises ``TypeError``/``ValueError`` for argument misuse (at call time: a collator
    without a spec, sizes not positive ints, ``dp_rank`` outside ``[0, dp_size)``, neither
    ``max_tokens`` nor ``num_microbatches``), `SchemaError` (``path`` set) for missing,
    foreign or corrupt files or mixed specs, and while iterating the readers' validation
    errors and the collator's errors.
    """
    if not isinstance(collator, MegatronCollator):
        raise TypeError(f"collator: expected a MegatronCollator, found {type(collator).__name__}")
    if collator.spec is None:
        raise ValueError(
            "collator: expected one with a spec (a rollout directory with routes), found "
            "spec=None (R3 off)"
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

    per_token = _per_token(spec, collator.layers)
    columns = [*COLLATE_COLUMNS, "routes"]
    layers = list(collator.layers)

    def loaders() -> Iterator[tuple[int, Callable[[], _Wave]]]:
        for plan in plans:  # planned on the caller's thread (token columns only)
            yield from _wave_loaders(plan, rank, layers, columns, budget, per_token, validate)

    def run() -> Iterator[tuple[int | None, Microbatch]]:
        # Waves of the whole budget (a step that fits is read once); the next one is read
        # while this one is collated when both fit the budget (`read_ahead`).
        for wave in read_ahead(loaders(), budget):
            step, tables = wave.step, wave.tables()
            del wave  # nothing but ``tables`` holds the pieces: dropped once it is done
            for _, table in tables:
                microbatch = collator(table)
                del table
                yield step, microbatch
            del tables

    return run()


__all__ = [
    "COLLATE_COLUMNS",
    "DEFAULT_MAX_MEMORY",
    "DP_ASSIGNMENTS",
    "RowGroupRef",
    "StepPlan",
    "collate_directory",
    "plan_contiguous",
    "plan_steps",
    "read_share",
]
