"""Shard-aware delivery on Ray (``docs/ray.md``, "Ray: shard_microbatches"): each (DP rank,
PP stage) gets its trajectories and its layers, one read task per step (`read_share`).
Ray drops schema metadata, so each delivered row carries its microbatch's step, index, row
count and metadata (an Arrow IPC schema) in the `_INTERNAL` columns, which
`Shard.iter_tables` strips again while reassembling the microbatches.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator, Sequence
from typing import Any, cast

import numpy as np
import pyarrow as pa

from r3arrow._checks import check_int, check_optional_int, check_positive_int
from r3arrow._extras import require
from r3arrow._plan import DpAssign, StepPlan, plan_steps, read_share
from r3arrow._typing import PathLike
from r3arrow._validated import mark_validated
from r3arrow.errors import SchemaError
from r3arrow.io import DEFAULT_MAX_MEMORY
from r3arrow.spec import RouteSpec

#: Columns added to every delivered row (`Shard.iter_tables` drops them).
STEP_COLUMN = "_r3arrow_step"
MICROBATCH_COLUMN = "_r3arrow_microbatch"
ROWS_COLUMN = "_r3arrow_rows"
METADATA_COLUMN = "_r3arrow_metadata"
_INTERNAL = (STEP_COLUMN, MICROBATCH_COLUMN, ROWS_COLUMN, METADATA_COLUMN)


def _tagged(table: pa.Table, step: int | None, j: int) -> pa.Table:
    """``table`` with the delivery columns (step, microbatch, rows, metadata) appended."""
    n = table.num_rows
    metadata = cast("dict[bytes | str, bytes | str]", table.schema.metadata or {})
    meta = pa.schema([], metadata=metadata).serialize().to_pybytes()
    cols: dict[str, pa.Array[Any]] = {
        STEP_COLUMN: pa.array([step] * n, type=pa.int64()),
        MICROBATCH_COLUMN: pa.array(np.full(n, j, dtype=np.int64)),
        ROWS_COLUMN: pa.array(np.full(n, n, dtype=np.int64)),
        METADATA_COLUMN: pa.array([meta] * n, type=pa.large_binary()),
    }
    out = table.replace_schema_metadata(None)
    for name, col in cols.items():
        out = out.append_column(name, col)
    return out


def _read_shard(
    plans: list[StepPlan],
    dp_rank: int,
    layers: tuple[int, ...],
    spec_json: bytes,
    max_memory: int,
    validate: bool,
    batch: pa.Table,
) -> Iterator[pa.Table]:
    """Read task: step units → the microbatch tables of one (DP rank, PP stage), in order."""
    spec = RouteSpec.from_json(spec_json)
    for unit in batch.column("unit").to_pylist():  # one step each: not a hot loop
        plan = plans[int(cast(int, unit))]
        share = read_share(
            plan, dp_rank, layers=layers, spec=spec, max_memory=max_memory, validate=validate
        )
        for j, table in share:
            yield _tagged(table, plan.step, j)


@dataclasses.dataclass(frozen=True)
class Shard:
    """What one (DP rank, PP stage) consumes: a lazy Ray Dataset and its plan.

    ``layers``: the stage's global layer ids; ``steps`` and ``num_microbatches``: the steps
    in order and each one's microbatch count; ``dataset``: the streaming Ray Dataset of the
    shard's rows (pass the `Shard` to the worker; iterate it there with `iter_tables`).
    """

    dp_rank: int
    pp_stage: int
    layers: tuple[int, ...]
    steps: tuple[int | None, ...]
    num_microbatches: tuple[int, ...]
    dataset: Any
    validate: bool = True

    def iter_tables(self) -> Iterator[tuple[int | None, int, pa.Table]]:
        """Yield ``(step, j, table)`` for every microbatch of the shard, in plan order.

        ``table``: the microbatch's trajectories with only the stage's layers (a projected
        table), its schema metadata restored, marked validated when read validating.
        Raises `SchemaError` if the stream does not deliver the plan.
        """
        plan = zip(self.steps, self.num_microbatches, strict=True)
        keys = ((step, j) for step, count in plan for j in range(count))
        where = f"shard (dp {self.dp_rank}, pp {self.pp_stage}): expected"
        key: tuple[int | None, int] | None = None
        pending: list[pa.Table] = []
        have = 0
        for batch in self.dataset.iter_batches(batch_format="pyarrow", batch_size=None):
            if not batch.num_rows:
                continue
            steps = np.asarray(batch.column(STEP_COLUMN).fill_null(-1).to_numpy(), dtype=np.int64)
            mbs = np.asarray(batch.column(MICROBATCH_COLUMN).to_numpy(), dtype=np.int64)
            cut = (np.flatnonzero((np.diff(steps) != 0) | (np.diff(mbs) != 0)) + 1).tolist()
            for a, b in zip([0, *cut], [*cut, batch.num_rows], strict=True):
                if not pending:  # per microbatch piece: not a hot loop
                    key = next(keys, None)
                found = (batch.column(STEP_COLUMN)[a].as_py(), int(mbs[a]))
                if key is None or key != found:
                    raise SchemaError(
                        f"{where} microbatch {key}, found step {found[0]} microbatch {found[1]}"
                    )
                pending.append(batch.slice(a, b - a))
                have += b - a
                want = int(batch.column(ROWS_COLUMN)[a].as_py())
                if have > want:
                    raise SchemaError(
                        f"{where} {want} rows in a microbatch, found {have} (blocks out of order)"
                    )
                if have == want:
                    meta = pa.ipc.read_schema(
                        pa.py_buffer(batch.column(METADATA_COLUMN)[a].as_py())
                    )
                    table = pa.concat_tables(pending).drop_columns(list(_INTERNAL))
                    out = table.replace_schema_metadata(meta.metadata)
                    if self.validate:
                        mark_validated(out)  # read validated by the shard's read task
                    yield *key, out
                    pending, have = [], 0
        left = next(keys, None) if not pending else key
        if left is not None:
            raise SchemaError(
                f"{where} every microbatch of the plan, found the stream ended before step "
                f"{left[0]} microbatch {left[1]}"
            )


def shard_microbatches(
    path: PathLike,
    *,
    dp_size: int,
    pp_layers: Sequence[Sequence[int]],
    steps: Sequence[int] | None = None,
    max_tokens: int | None = None,
    num_microbatches: int | None = None,
    multiple: int = 1,
    packed: bool = True,
    max_memory: int | None = None,
    read_tasks: int = 1,
    object_store_memory: int | None = None,
    dp_assign: DpAssign = "contiguous",
    validate: bool = True,
) -> dict[tuple[int, int], Shard]:
    """One `Shard` per ``(dp_rank, pp_stage)`` of a rollout file or step root.

    Shard ``(d, p)`` holds DP rank ``d``'s microbatches (``max_tokens``,
    ``num_microbatches``, the collator's ``multiple`` and ``packed``; padding microbatches
    last, the same count on every rank) with the layers ``pp_layers[p]`` (global ids).
    ``dp_assign="contiguous"`` (default): each rank a contiguous row range snapped to
    row-group starts, balanced to within one trajectory's cost (its own row groups only);
    ``"balanced"``: the microbatches of ``split_microbatches(step, dp_size=..., dp_rank=d)``
    (`r3arrow.microbatch.plan_dp_microbatches`), each rank reading nearly every row group.
    A read task holds at most ``max_memory`` bytes of rows (default 1 GiB) plus one row
    group; at most ``read_tasks`` run per shard; ``object_store_memory`` caps each shard
    dataset's object store use. Needs the ``ray`` extra. Raises ``TypeError`` /
    ``ValueError`` for argument misuse (sizes not positive ints, an empty stage, layers
    not ints or in two stages), `SchemaError` (``path`` set) for foreign, corrupt or mixed
    files, and the readers' errors (of the token columns while planning, of the routes
    while a worker iterates).
    """
    with require(extra="ray", feature="r3arrow.ray"):
        import ray.data

    dp = check_positive_int(dp_size, "dp_size")
    stages = [tuple(check_int(i, "pp_layers") for i in stage) for stage in pp_layers]
    if not stages or not all(stages):
        raise ValueError(f"pp_layers: expected one non-empty layer list per stage, found {stages}")
    flat = [i for stage in stages for i in stage]
    if len(set(flat)) != len(flat):
        raise ValueError(f"pp_layers: expected each layer in one stage only, found {stages}")
    tasks = check_positive_int(read_tasks, "read_tasks")
    store = check_optional_int(object_store_memory, "object_store_memory", minimum=1)
    budget = check_positive_int(
        DEFAULT_MAX_MEMORY if max_memory is None else max_memory, "max_memory"
    )
    spec, plan_iter = plan_steps(
        path,
        steps=steps,
        dp_size=dp,
        max_tokens=max_tokens,
        num_microbatches=num_microbatches,
        multiple=multiple,
        packed=packed,
        dp_assign=dp_assign,
        validate=validate,
    )
    missing = sorted(set(flat) - set(range(spec.num_layers)))
    if missing:
        raise ValueError(f"pp_layers: expected layers in 0..{spec.num_layers - 1}, found {missing}")
    plans = list(plan_iter)
    shards: dict[tuple[int, int], Shard] = {}
    for d in range(dp):
        for p, stage in enumerate(stages):
            read = functools.partial(_read_shard, plans, d, stage, spec.to_json(), budget, validate)
            units = ray.data.from_items(
                [{"unit": i} for i in range(len(plans))], override_num_blocks=max(1, len(plans))
            )
            ds = units.map_batches(
                read,
                batch_format="pyarrow",
                batch_size=1,
                # At most one task per step (Ray warns when the limit exceeds the inputs).
                compute=ray.data.TaskPoolStrategy(size=min(tasks, max(1, len(plans)))),
            )
            options = ds.context.execution_options
            options.preserve_order = True  # microbatches arrive in plan order
            if store is not None:
                options.resource_limits = options.resource_limits.copy(object_store_memory=store)
            shards[d, p] = Shard(
                dp_rank=d,
                pp_stage=p,
                layers=stage,
                steps=tuple(plan.step for plan in plans),
                num_microbatches=tuple(plan.num_microbatches for plan in plans),
                dataset=ds,
                validate=validate,
            )
    return shards


__all__ = ["Shard", "shard_microbatches"]
