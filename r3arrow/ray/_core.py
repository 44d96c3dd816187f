"""Ray Data reading and `RayExecutor`, the Ray executor of the `r3arrow.stats` partials."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, cast, get_args

import numpy as np
import pyarrow as pa

from r3arrow._checks import check_choice, check_int
from r3arrow._extras import require
from r3arrow._typing import PathLike
from r3arrow.errors import SchemaError
from r3arrow.io import read_rollouts, rollout_files
from r3arrow.spec import SPEC_METADATA_KEY, RouteSpec

if TYPE_CHECKING:
    import ray.data

_NO_STEP = -1  # partial rows of data without a step column
# As r3arrow.stats' BlockFn and CombineFn (stats is not imported: a structural protocol).
_BlockFn = Callable[[pa.Table], Mapping[int | None, np.ndarray]]
_CombineFn = Callable[[Any, Any], np.ndarray]
#: Final combine of the partials: "driver" streams them to the driver and sums there
#: (a few KB per block); "ray", a Ray ``AggregateFnV2`` hash aggregate (seconds of fixed
#: overhead on a small cluster). Both are exact.
Reduce = Literal["driver", "ray"]


def _units(path: PathLike, steps: Sequence[int] | None) -> tuple[RouteSpec, list[dict[str, Any]]]:
    """The shared spec and the read units (path, row group, step); one footer read per file."""
    files = rollout_files(path, steps=steps, require_routes=True)
    spec = files[0].spec
    assert spec is not None  # require_routes
    units = [
        {"path": str(f.path), "row_group": g, "step": f.step}
        for f in files
        for g in range(f.num_row_groups)
    ]
    return spec, units


def rollout_spec(path: PathLike, *, steps: Sequence[int] | None = None) -> RouteSpec:
    """The `RouteSpec` shared by every rollout file under ``path`` (footers only).

    Raises `SchemaError` (``path`` set) for a file without the spec or mixed specs.
    """
    return _units(path, steps)[0]


def _read_units(columns: list[str] | None, batch: pa.Table) -> pa.Table:
    """Batch of read units (path, row group, step) → rollout rows (routes restored, ``step``)."""
    units = zip(*(batch.column(c).to_pylist() for c in ("path", "row_group", "step")), strict=True)
    parts = []
    for path, group, step in units:  # one Parquet row group each: not a hot loop
        table = read_rollouts(path, row_groups=[group], columns=columns)
        table = table.replace_schema_metadata(None)
        if step is not None:
            steps = pa.array(np.full(table.num_rows, step, dtype=np.int64))
            table = table.append_column("step", steps)
        parts.append(table)
    return pa.concat_tables(parts)


def rollout_dataset(
    path: PathLike,
    *,
    columns: Sequence[str] | None = None,
    steps: Sequence[int] | None = None,
) -> ray.data.Dataset:
    """A lazy Ray Dataset over a rollout file or step root, routes restored, ``step`` int64.

    One read task per Parquet row group (r3arrow's reader). ``columns`` projects (``step``
    is added for a root); ``steps`` selects partitions (each must exist). Blocks carry no
    schema metadata: keep ``rollout_spec(path)`` for the spec.
    """
    return _read(path, columns, steps)[0]


def _read(
    path: PathLike, columns: Sequence[str] | None, steps: Sequence[int] | None
) -> tuple[ray.data.Dataset, RouteSpec]:
    with require(extra="ray", feature="r3arrow.ray"):
        import ray.data

    # Not ray.data.read_parquet: its Parquet reader (Ray 2.60) bin-packs small files into
    # one read task (no parallelism below ~128 MB), and a list of paths is resolved on
    # parallel threads that race on an optional fsspec import when aiohttp is absent.
    spec, units = _units(path, steps)  # fails early on foreign files or mixed specs
    if not units:
        raise SchemaError(f"{path}: expected rollout row groups, found none", path=path)
    cols = None if columns is None else list(dict.fromkeys(c for c in columns if c != "step"))
    ds = ray.data.from_items(units, override_num_blocks=len(units))
    read = functools.partial(_read_units, cols)
    return ds.map_batches(read, batch_format="pyarrow", batch_size=1), spec


def _partials(spec_json: bytes, block_fn: _BlockFn, batch: pa.Table) -> pa.Table:
    """Block → one row per step present: ``step`` int64, ``partial`` large_list<int64>."""
    parts = block_fn(batch.replace_schema_metadata({SPEC_METADATA_KEY: spec_json}))
    return pa.table(
        {
            "step": pa.array([_NO_STEP if s is None else s for s in parts], type=pa.int64()),
            "partial": pa.array(list(parts.values()), type=pa.large_list(pa.int64())),
        }
    )


def _vectors(batch: pa.Table) -> Iterator[tuple[int, np.ndarray]]:
    """(step, int64 vector) of each partial row (one per block and step)."""
    col = cast(Any, batch.column("partial")).combine_chunks()  # large_list<int64>
    flat = np.asarray(col.values.to_numpy(zero_copy_only=False), dtype=np.int64)
    vectors = [flat[a:b] for a, b in itertools.pairwise(np.asarray(col.offsets).tolist())]
    steps: list[Any] = batch.column("step").to_pylist()
    return zip(steps, vectors, strict=True)


def _sum_aggregate(combine: _CombineFn) -> Any:
    """A Ray ``AggregateFnV2`` summing the ``partial`` vectors exactly (empty vector = zero)."""
    from ray.data.aggregate import AggregateFnV2
    from ray.data.block import BlockAccessor

    class SumPartials(AggregateFnV2[np.ndarray, np.ndarray]):
        def __init__(self) -> None:
            super().__init__(
                "partial", zero_factory=lambda: np.zeros(0, np.int64), on=None, ignore_nulls=False
            )

        def aggregate_block(self, block: Any) -> np.ndarray:
            rows = _vectors(BlockAccessor.for_block(block).to_arrow())
            return functools.reduce(combine, (v for _, v in rows), np.zeros(0, np.int64))

        def combine(self, current_accumulator: Any, new: Any) -> np.ndarray:
            return combine(current_accumulator, new)

    return SumPartials()


def _keep_steps(steps: list[int], batch: pa.Table) -> pa.Table:
    """Block filter: rows whose ``step`` is in ``steps``."""
    import pyarrow.compute as pc

    if "step" not in batch.schema.names:
        raise SchemaError(f"steps= needs a 'step' column, found {batch.schema.names}")
    return batch.filter(pc.is_in(batch.column("step"), pa.array(steps, type=pa.int64())))


@dataclasses.dataclass(frozen=True)
class RayExecutor:
    """The Ray executor of `r3arrow.stats`: ``stats.expert_load(path, executor=RayExecutor())``.

    Each block is reduced to the statistic's exact integer partials in ``map_batches`` (in
    parallel; only the small partials move), then combined as ``reduce`` says (`Reduce`;
    ``"ray"`` groups by ``step`` for the by-step statistics): the same integers as the
    single-process path. Raises ``ValueError`` for another ``reduce``.
    """

    reduce: Reduce = "driver"

    def __post_init__(self) -> None:
        check_choice(self.reduce, "reduce", get_args(Reduce))

    def map_reduce(
        self,
        source: Any,
        block_fn: _BlockFn,
        combine_fn: _CombineFn,
        *,
        columns: Sequence[str],
        spec: RouteSpec | None = None,
        steps: Sequence[int] | None = None,
        by_step: bool = False,
    ) -> tuple[dict[int | None, np.ndarray], RouteSpec]:
        """`r3arrow.stats.Executor.map_reduce` on Ray.

        ``source``: a rollout path (read with `rollout_dataset`, only ``columns``) or a
        `rollout_dataset` Dataset (``spec`` required; ``steps`` filters its rows). Raises
        ``TypeError`` for an in-memory table or a Dataset without ``spec``.
        """
        if isinstance(source, str | os.PathLike):
            ds, spec = _read(source, list(columns), steps)
        elif isinstance(source, pa.Table | pa.RecordBatch):
            raise TypeError(
                "RayExecutor: expected a rollout path or a Ray Dataset, found an in-memory "
                f"{type(source).__name__} (use executor=None)"
            )
        elif spec is None:
            raise TypeError(
                "expected spec= with a Ray Dataset (Ray blocks carry no schema metadata), "
                "found None"
            )
        elif steps is None:
            ds = source
        else:
            keep = functools.partial(_keep_steps, [check_int(s, "steps") for s in steps])
            ds = source.map_batches(
                keep, batch_format="pyarrow", batch_size=None, zero_copy_batch=True
            )
        fn = functools.partial(_partials, spec.to_json(), block_fn)
        parts: Any = ds.map_batches(
            fn, batch_format="pyarrow", batch_size=None, zero_copy_batch=True
        )
        per: dict[int, np.ndarray] = {}
        if self.reduce == "driver":  # summed as the partials stream in (a few KB each)
            for batch in parts.iter_batches(batch_format="pyarrow", batch_size=None):
                for step, vec in _vectors(batch):
                    per[step] = combine_fn(per.get(step, np.zeros(0, np.int64)), vec)
        elif by_step:
            rows = parts.groupby("step").aggregate(_sum_aggregate(combine_fn)).take_all()
            per = {int(r["step"]): np.asarray(r["partial"], dtype=np.int64) for r in rows}
        else:
            result = parts.aggregate(_sum_aggregate(combine_fn))
            vec = result["partial"] if isinstance(result, dict) else result
            per = {_NO_STEP: np.asarray(vec if vec is not None else np.zeros(0), dtype=np.int64)}
        if not by_step:
            return {None: functools.reduce(combine_fn, per.values(), np.zeros(0, np.int64))}, spec
        return {None if s == _NO_STEP else s: v for s, v in per.items()}, spec


__all__ = ["RayExecutor", "Reduce", "rollout_dataset", "rollout_spec"]
