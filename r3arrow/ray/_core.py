"""Ray Data reading, the distributed partials of `r3arrow.stats`, collation as map_batches.

See the package docstring of `r3arrow.ray`.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import warnings
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import numpy as np
import polars as pl
import pyarrow as pa

from r3arrow import stats as _stats
from r3arrow._checks import check_choice, check_int
from r3arrow._typing import PathLike
from r3arrow.errors import SchemaError
from r3arrow.io import read_row_group, scan_rollout_files
from r3arrow.spec import SPEC_METADATA_KEY, RouteSpec
from r3arrow.stats import REDUCES, ExpertCounts, Reduce, RouteAgreement, TokenSubset

if TYPE_CHECKING:
    import ray.data

_NO_STEP = -1  # partial rows of data without a step column
#: A block of rollout rows (spec in its metadata) → ``{step or None: int64 partial vector}``.
BlockFn = Callable[[pa.Table], Mapping[int | None, np.ndarray]]
#: The exact sum of two partial vectors (an empty vector is zero).
CombineFn = Callable[[Any, Any], np.ndarray]


# ================================================================== reading
def _units(path: PathLike, steps: Sequence[int] | None) -> tuple[RouteSpec, list[dict[str, Any]]]:
    """The shared spec and the read units (path, row group, step); one footer read per file."""
    spec, files = scan_rollout_files(path, steps=steps)
    units = [
        {"path": str(f.path), "row_group": g, "step": f.step}
        for f in files
        for g in range(f.num_row_groups)
    ]
    return spec, units


def rollout_spec(path: PathLike, *, steps: Sequence[int] | None = None) -> RouteSpec:
    """The `RouteSpec` shared by every rollout file under ``path`` (footers only).

    Raises `SchemaError` (``path`` set) if a file lacks the spec or two files
    disagree on it; see `r3arrow.io.scan_rollout_files`.
    """
    return scan_rollout_files(path, steps=steps)[0]


class _ReadUnits:
    """Batch of read units (path, row group, step) → rollout rows (routes restored, ``step``)."""

    def __init__(self, columns: list[str] | None) -> None:
        self.columns = columns

    def __call__(self, batch: pa.Table) -> pa.Table:
        paths: list[Any] = batch.column("path").to_pylist()
        groups: list[Any] = batch.column("row_group").to_pylist()
        steps: list[Any] = batch.column("step").to_pylist()
        units = zip(paths, groups, steps, strict=True)
        parts = [  # one Parquet row group each: not a hot loop
            read_row_group(path, group, self.columns, step).replace_schema_metadata(None)
            for path, group, step in units
        ]
        return pa.concat_tables(parts)


def read_rollouts(
    path: PathLike,
    *,
    columns: Sequence[str] | None = None,
    steps: Sequence[int] | None = None,
) -> ray.data.Dataset:
    """A lazy Ray Dataset over a rollout file or step root, routes restored, ``step`` int64.

    One read task per Parquet row group, with r3arrow's reader (storage routes
    restored to the nested type without a copy). ``columns`` projects (``step``
    is added for a root); ``steps`` selects partitions (each must exist).
    Blocks carry no schema metadata: keep ``rollout_spec(path)`` for the spec.
    """
    return _read(path, columns, steps)[0]


def _read(
    path: PathLike, columns: Sequence[str] | None, steps: Sequence[int] | None
) -> tuple[ray.data.Dataset, RouteSpec]:
    import ray.data

    # Not ray.data.read_parquet: its Parquet reader (Ray 2.60) bin-packs small files into
    # one read task (no parallelism below ~128 MB), and a list of paths is resolved on
    # parallel threads that race on an optional fsspec import when aiohttp is absent.
    spec, units = _units(path, steps)  # fails early on foreign files or mixed specs
    if not units:
        raise SchemaError(f"{path}: expected rollout row groups, found none", path=path)
    cols = None if columns is None else list(dict.fromkeys(c for c in columns if c != "step"))
    ds = ray.data.from_items(units, override_num_blocks=len(units))
    read: Any = _ReadUnits(cols)  # a callable instance (Ray's stubs expect a function or class)
    return ds.map_batches(read, batch_format="pyarrow", batch_size=1), spec


# =========================================================== aggregation
class _Partials:
    """Block → one row per step present: ``step`` int64, ``partial`` large_list<int64>."""

    def __init__(self, spec_json: bytes, block_fn: BlockFn) -> None:
        self.spec_json = spec_json
        self.block_fn = block_fn

    def __call__(self, batch: pa.Table) -> pa.Table:
        table = batch.replace_schema_metadata({SPEC_METADATA_KEY: self.spec_json})
        parts = self.block_fn(table)
        return pa.table(
            {
                "step": pa.array([_NO_STEP if s is None else s for s in parts], type=pa.int64()),
                "partial": pa.array(list(parts.values()), type=pa.large_list(pa.int64())),
            }
        )


def _sum_aggregate(combine: CombineFn) -> Any:
    """A Ray ``AggregateFnV2`` summing the ``partial`` vectors exactly (empty vector = zero)."""
    from ray.data.aggregate import AggregateFnV2
    from ray.data.block import BlockAccessor

    class SumPartials(AggregateFnV2[np.ndarray, np.ndarray]):
        def __init__(self) -> None:
            super().__init__(
                "partial", zero_factory=lambda: np.zeros(0, np.int64), on=None, ignore_nulls=False
            )

        def aggregate_block(self, block: Any) -> np.ndarray:
            col = BlockAccessor.for_block(block).to_arrow().column("partial")
            acc = np.zeros(0, np.int64)
            for chunk in cast(Any, col).chunks:  # large_list<int64> chunks
                offsets = np.asarray(chunk.offsets, dtype=np.int64)
                flat = np.asarray(chunk.values.to_numpy(zero_copy_only=False), dtype=np.int64)
                for i in range(len(chunk)):  # one row per (block, step): not a hot loop
                    acc = combine(acc, flat[offsets[i] : offsets[i + 1]])
            return acc

        def combine(self, current_accumulator: Any, new: Any) -> np.ndarray:
            return combine(current_accumulator, new)

    return SumPartials()


class _KeepSteps:
    """Block filter: rows whose ``step`` is in ``steps``."""

    def __init__(self, steps: list[int]) -> None:
        self.steps = steps

    def __call__(self, batch: pa.Table) -> pa.Table:
        import pyarrow.compute as pc

        if "step" not in batch.schema.names:
            raise SchemaError(f"steps= needs a 'step' column, found {batch.schema.names}")
        return batch.filter(pc.is_in(batch.column("step"), pa.array(self.steps, type=pa.int64())))


def _as_dataset(
    source: Any, spec: RouteSpec | None, columns: list[str], steps: Sequence[int] | None
) -> tuple[Any, RouteSpec]:
    if isinstance(source, str | os.PathLike):
        return _read(source, columns, steps)
    if isinstance(source, pa.Table | pa.RecordBatch):
        raise TypeError(
            "engine='ray': expected a rollout path or a Ray Dataset, found an in-memory "
            f"{type(source).__name__} (use engine='local')"
        )
    if spec is None:
        raise TypeError(
            "expected spec= with a Ray Dataset (Ray blocks carry no schema metadata), found None"
        )
    if steps is not None:
        source = source.map_batches(
            _KeepSteps([check_int(s, "steps") for s in steps]),
            batch_format="pyarrow",
            batch_size=None,
            zero_copy_batch=True,
        )
    return source, spec


def _drain(parts: Any, combine: CombineFn) -> dict[int, np.ndarray]:
    """Sum partial rows per step on the driver as they stream in (each row is a few KB)."""
    acc: dict[int, np.ndarray] = {}
    for batch in parts.iter_batches(batch_format="pyarrow", batch_size=None):
        steps = batch.column("step").to_pylist()
        vectors = batch.column("partial")
        for i, step in enumerate(steps):  # one row per (block, step): not a hot loop
            vec = np.asarray(vectors[i].values.to_numpy(zero_copy_only=False), dtype=np.int64)
            acc[int(step)] = combine(acc.get(int(step), np.zeros(0, np.int64)), vec)
    return acc


def partials(
    source: Any,
    block_fn: BlockFn,
    combine: CombineFn,
    *,
    columns: Sequence[str],
    spec: RouteSpec | None = None,
    steps: Sequence[int] | None = None,
    grouped: bool = False,
    reduce: Reduce = "driver",
) -> tuple[dict[int | None, np.ndarray], RouteSpec]:
    """Exact partial vectors of ``source`` computed on Ray: the engine of ``stats(engine="ray")``.

    ``source``: a rollout path (read with `read_rollouts`, only ``columns``) or a
    `read_rollouts` Dataset (``spec`` required; ``steps`` filters its rows).
    ``block_fn`` (picklable) maps each block, spec restored in its metadata, to
    ``{step or None: vector}``; ``combine`` (picklable) adds two vectors. Returns
    (``{None: total}``, spec), or with ``grouped`` (``{step: total}``, spec) with
    a ``None`` key for rows without a step. ``reduce``: `Reduce`.
    """
    check_choice(reduce, "reduce", REDUCES)
    ds, spec = _as_dataset(source, spec, list(columns), steps)
    fn = _Partials(spec.to_json(), block_fn)
    parts = ds.map_batches(fn, batch_format="pyarrow", batch_size=None, zero_copy_batch=True)
    out: dict[int | None, np.ndarray]
    if reduce == "ray":
        if grouped:
            rows = parts.groupby("step").aggregate(_sum_aggregate(combine)).take_all()
            per = {int(r["step"]): np.asarray(r["partial"], dtype=np.int64) for r in rows}
        else:
            result = parts.aggregate(_sum_aggregate(combine))
            vec = result["partial"] if isinstance(result, dict) else result
            total = np.asarray(vec if vec is not None else np.zeros(0), dtype=np.int64)
            return {None: total}, spec
    else:
        per = _drain(parts, combine)
    if not grouped:
        total = np.zeros(0, np.int64)
        for vec in per.values():
            total = combine(total, vec)
        return {None: total}, spec
    out = {None if s == _NO_STEP else s: v for s, v in per.items()}
    return out, spec


# ============================================== deprecated statistics aliases
def _deprecated(name: str) -> None:
    warnings.warn(
        f"r3arrow.ray.{name} is deprecated: use r3arrow.stats.{name}(..., engine='ray')",
        DeprecationWarning,
        stacklevel=3,
    )


def expert_counts(
    source: PathLike | ray.data.Dataset,
    *,
    spec: RouteSpec | None = None,
    tokens: TokenSubset = "all",
    steps: Sequence[int] | None = None,
    reduce: Reduce = "driver",
) -> ExpertCounts:
    """Deprecated: ``r3arrow.stats.expert_counts(source, engine="ray", ...)``."""
    _deprecated("expert_counts")
    return _stats.expert_counts(
        source, tokens=tokens, steps=steps, engine="ray", spec=spec, reduce=reduce
    )


def expert_counts_by_step(
    source: PathLike | ray.data.Dataset,
    *,
    spec: RouteSpec | None = None,
    tokens: TokenSubset = "all",
    steps: Sequence[int] | None = None,
    reduce: Reduce = "driver",
) -> dict[int, ExpertCounts]:
    """Deprecated: ``r3arrow.stats.expert_counts_by_step(source, engine="ray", ...)``."""
    _deprecated("expert_counts_by_step")
    return _stats.expert_counts_by_step(
        source, tokens=tokens, steps=steps, engine="ray", spec=spec, reduce=reduce
    )


def expert_load(
    source: PathLike | ray.data.Dataset,
    *,
    spec: RouteSpec | None = None,
    tokens: TokenSubset = "all",
    steps: Sequence[int] | None = None,
    by_step: bool = False,
    reduce: Reduce = "driver",
) -> pl.DataFrame:
    """Deprecated: ``r3arrow.stats.expert_load(source, engine="ray", ...)``."""
    _deprecated("expert_load")
    options: dict[str, Any] = {"tokens": tokens, "steps": steps, "by_step": by_step}
    return _stats.expert_load(source, engine="ray", spec=spec, reduce=reduce, **options)


def route_agreement(
    source: PathLike | ray.data.Dataset,
    other: str,
    *,
    spec: RouteSpec | None = None,
    tokens: TokenSubset = "all",
    steps: Sequence[int] | None = None,
    reduce: Reduce = "driver",
) -> RouteAgreement:
    """Deprecated: ``r3arrow.stats.route_agreement(source, other, engine="ray", ...)``."""
    _deprecated("route_agreement")
    return _stats.route_agreement(
        source, other, spec, tokens=tokens, steps=steps, engine="ray", reduce=reduce
    )


def route_agreement_by_step(
    source: PathLike | ray.data.Dataset,
    other: str,
    *,
    spec: RouteSpec | None = None,
    tokens: TokenSubset = "all",
    steps: Sequence[int] | None = None,
    reduce: Reduce = "driver",
) -> dict[int, RouteAgreement]:
    """Deprecated: ``r3arrow.stats.route_agreement_by_step(source, other, engine="ray", ...)``."""
    _deprecated("route_agreement_by_step")
    return _stats.route_agreement_by_step(
        source, other, tokens=tokens, steps=steps, engine="ray", spec=spec, reduce=reduce
    )


# ================================================================ collation
def _tensor_fields(mb: Any) -> Iterable[tuple[str, Any]]:
    if isinstance(mb, Mapping):
        return mb.items()
    if dataclasses.is_dataclass(mb) and not isinstance(mb, type):
        return ((f.name, getattr(mb, f.name)) for f in dataclasses.fields(mb))
    raise TypeError(
        f"collator: expected a dataclass or mapping of arrays, found {type(mb).__name__}"
    )


def _as_numpy(value: Any) -> np.ndarray | None:
    if isinstance(value, np.ndarray):
        return value
    if type(value).__module__.startswith("torch") and hasattr(value, "detach"):
        return np.asarray(value.detach().cpu().numpy())
    return None


def microbatch_row(mb: Any, trajectory_ids: Sequence[str], step: int | None) -> pa.Table:
    """One-row Arrow table of a microbatch: per array field ``name`` (flat) and ``name.shape``.

    Also ``trajectory_ids`` and ``step`` (null without steps); ints, floats and
    bools are kept as scalar columns, other fields (spec, None) are dropped.
    """
    cols: dict[str, pa.Array[Any]] = {
        "step": pa.array([step], type=pa.int64()),
        "trajectory_ids": pa.array([list(trajectory_ids)], type=pa.large_list(pa.large_string())),
    }
    for name, value in _tensor_fields(mb):
        arr = _as_numpy(value)
        if arr is not None:
            flat = pa.array(np.ascontiguousarray(arr).reshape(-1))
            cols[name] = pa.LargeListArray.from_arrays(
                pa.array([0, len(flat)], type=pa.int64()), flat
            )
            cols[f"{name}.shape"] = pa.array([list(arr.shape)], type=pa.list_(pa.int64()))
        elif isinstance(value, bool | int | float | np.integer | np.floating):
            cols[name] = pa.array([value.item() if isinstance(value, np.generic) else value])
        elif isinstance(value, tuple) and all(isinstance(v, int) for v in value):
            cols[name] = pa.array([list(value)], type=pa.list_(pa.int64()))
    return pa.table(cols)


def microbatch_arrays(rows: pa.Table) -> list[dict[str, Any]]:
    """Decode `collate` output rows: arrays reshaped by their ``.shape`` columns, and scalars."""
    out: list[dict[str, Any]] = []
    shapes = [n[: -len(".shape")] for n in rows.column_names if n.endswith(".shape")]
    for i in range(rows.num_rows):
        row: dict[str, Any] = {}
        for name in rows.column_names:
            if name.endswith(".shape"):
                continue
            col = rows.column(name)
            if name in shapes:
                cell = col[i].values
                shape = rows.column(f"{name}.shape")[i].as_py()
                row[name] = np.asarray(cell.to_numpy(zero_copy_only=False)).reshape(shape)
            else:
                row[name] = col[i].as_py()
        out.append(row)
    return out


def _ids(part: pa.Table) -> list[str]:
    return cast(list[str], part.column("trajectory_id").to_pylist())


class _Collate:
    """Batch → one microbatch row per step present (a microbatch never mixes steps)."""

    def __init__(
        self, make_collator: Callable[[], Callable[[pa.Table], Any]], spec_json: bytes
    ) -> None:
        self.make_collator = make_collator
        self.spec_json = spec_json
        self._collator: Callable[[pa.Table], Any] | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"make_collator": self.make_collator, "spec_json": self.spec_json, "_collator": None}

    def __call__(self, batch: pa.Table) -> pa.Table:
        if self._collator is None:  # built in the worker: collators hold locks and buffer pools
            self._collator = self.make_collator()
        table = batch.replace_schema_metadata({SPEC_METADATA_KEY: self.spec_json})
        if "step" not in table.schema.names:
            groups: list[tuple[int | None, pa.Table]] = [(None, table)]
        else:
            steps = np.asarray(table.column("step").to_numpy(), dtype=np.int64)
            cuts = np.flatnonzero(np.diff(steps)) + 1
            bounds = [0, *cuts.tolist(), len(steps)]
            groups = [(int(steps[a]), table.slice(a, b - a)) for a, b in itertools.pairwise(bounds)]
        rows = [
            microbatch_row(self._collator(part), _ids(part), step)
            for step, part in groups
            if part.num_rows
        ]
        return pa.concat_tables(rows, promote_options="permissive")


def collate(
    dataset: ray.data.Dataset,
    make_collator: Callable[[], Callable[[pa.Table], Any]],
    *,
    spec: RouteSpec,
    batch_size: int | None = None,
) -> ray.data.Dataset:
    """Collate ``dataset`` (from `read_rollouts`) as ``map_batches``; one output row per microbatch.

    ``make_collator``: a picklable zero-argument factory, called once per
    worker, e.g. ``functools.partial(MegatronCollator, spec, packed=True)``.
    Each Ray batch (``batch_size`` trajectories, or a block when None) is split
    at step boundaries and each part collated. Rows are plain Arrow (see
    `microbatch_row`), so ``.write_parquet(dir)`` writes them back and
    `microbatch_arrays` decodes them; ``trajectory_ids`` names each row's inputs.
    """
    return dataset.map_batches(
        cast(Any, _Collate(make_collator, spec.to_json())),  # a callable instance
        batch_format="pyarrow",
        batch_size=batch_size,
        zero_copy_batch=True,
    )


__all__ = [
    "BlockFn",
    "CombineFn",
    "Reduce",
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
]
