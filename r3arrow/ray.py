"""Ray Data scale-out: rollout Parquet directories as Ray Datasets of Arrow blocks.

- `read_rollouts`: a ``step=N`` directory (or a file) → ``ray.data.Dataset`` of
  Arrow blocks with routes restored to the nested per-token type and ``step``
  as int64; one read task per Parquet row group.
- `expert_counts` / `expert_load` / `route_agreement` (and ``*_by_step``): the
  statistics of `r3arrow.stats` as a distributed aggregation — each block is
  reduced to exact integer partial counts in ``map_batches`` (in parallel, only
  the small partials move), then combined: streamed to the driver and summed
  (``reduce="driver"``, default) or with a Ray ``AggregateFnV2`` hash aggregate
  (``reduce="ray"``, grouped by ``step`` for the by-step variants). Integer sums
  are order-independent, so every path equals the single-process one exactly.
- `collate`: a collator (e.g. `r3arrow.collate.MegatronCollator`) run as
  ``map_batches``; each microbatch becomes one row of plain Arrow columns
  (values + shape per tensor) that ``Dataset.write_parquet`` writes back and
  `microbatch_arrays` decodes.

Ray drops Arrow schema metadata from blocks, so the `RouteSpec` is read once
from the Parquet footers on the driver (`rollout_spec`) and shipped to the
workers with the functions. ``ray`` is imported lazily (the ``ray`` extra).
"""

from __future__ import annotations

import dataclasses
import itertools
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq

from r3arrow import stats as _stats
from r3arrow.errors import SchemaError
from r3arrow.spec import SPEC_METADATA_KEY, RouteSpec
from r3arrow.stats import TOKEN_SUBSETS, ExpertCounts, RouteAgreement, TokenSubset, stack_steps

if TYPE_CHECKING:
    import ray.data

PathLike = str | os.PathLike[str]
_Kind = Literal["counts", "agreement"]
_NO_STEP = -1  # partial rows of data without a step column
#: Final combine of the partials: "driver" streams them to the driver and sums there (cheap: a
#: few KB per block); "ray" uses a Ray ``AggregateFnV2`` (hash-shuffle aggregate; seconds of
#: fixed overhead on a small cluster). Both are exact.
Reduce = Literal["driver", "ray"]


# ================================================================== reading
def _step_dirs(root: Path, steps: Sequence[int] | None) -> list[tuple[int, Path]]:
    from r3arrow.io import list_steps

    present = list_steps(root)
    if not present:
        raise SchemaError(f"{root}: expected step=N/ rollout partitions, found none")
    if steps is not None:
        wanted = {int(s) for s in steps}
        missing = sorted(wanted - set(present))
        if missing:
            raise SchemaError(f"{root}: expected steps {missing} to exist, found steps {present}")
        present = [s for s in present if s in wanted]
    return [(s, root / f"step={s}") for s in present]


def _files(path: PathLike, steps: Sequence[int] | None) -> list[tuple[str, int | None]]:
    """Parquet files to read, each with its step (None for a single file)."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such rollout file or directory")
    if not p.is_dir():
        if steps is not None:
            raise SchemaError(f"{p}: steps= needs a step=N/ directory, found a single file")
        return [(str(p), None)]
    files: list[tuple[str, int | None]] = [
        (str(f), s) for s, d in _step_dirs(p, steps) for f in sorted(d.glob("*.parquet"))
    ]
    if not files:
        raise SchemaError(f"{p}: expected step=N/*.parquet rollout files, found none")
    return files


def _scan(path: PathLike, steps: Sequence[int] | None) -> tuple[RouteSpec, list[dict[str, Any]]]:
    """The spec shared by every file and the read units (path, row group, step); one footer
    read per file. Raises `SchemaError` if a file lacks the spec or two files disagree on it."""
    spec: RouteSpec | None = None
    first = ""
    units: list[dict[str, Any]] = []
    for f, step in _files(path, steps):
        try:
            with pq.ParquetFile(f) as pf:
                schema, row_groups = pf.schema_arrow, pf.metadata.num_row_groups
        except (pa.ArrowInvalid, OSError) as exc:
            raise SchemaError(
                f"{f}: expected an r3arrow rollout Parquet file, found an unreadable file ({exc})"
            ) from exc
        if SPEC_METADATA_KEY not in (schema.metadata or {}):
            raise SchemaError(
                f"{f}: expected an r3arrow rollout file (metadata {SPEC_METADATA_KEY.decode()!r}), found none"
            )
        s = RouteSpec.from_schema(schema)
        if spec is None:
            spec, first = s, f
        elif s != spec:
            raise SchemaError(
                f"expected one RouteSpec under {path}, found {spec} in {first} and {s} in {f}"
            )
        units.extend({"path": f, "row_group": g, "step": step} for g in range(row_groups))
    assert spec is not None  # _files returns at least one file
    return spec, units


def rollout_spec(path: PathLike, *, steps: Sequence[int] | None = None) -> RouteSpec:
    """The `RouteSpec` shared by every rollout file under ``path`` (footers only).

    Raises `SchemaError` if a file lacks the spec or two files disagree on it.
    """
    return _scan(path, steps)[0]


class _ReadUnits:
    """Batch of read units (path, row group, step) → the rollout rows, routes restored, ``step`` int64."""

    def __init__(self, columns: list[str] | None) -> None:
        self.columns = columns

    def __call__(self, batch: pa.Table) -> pa.Table:
        from r3arrow.io import from_storage

        parts = []
        units = zip(
            batch.column("path").to_pylist(),
            batch.column("row_group").to_pylist(),
            batch.column("step").to_pylist(),
            strict=True,
        )
        for path, row_group, step in units:  # one Parquet row group each: not a hot loop
            pf = pq.ParquetFile(path)
            table = pf.read_row_group(row_group, columns=self.columns)
            table = from_storage(table.replace_schema_metadata(pf.schema_arrow.metadata))
            if step is not None:
                steps = pa.array(np.full(table.num_rows, step, np.int64))
                table = table.append_column(pa.field("step", pa.int64()), steps)
            parts.append(table.replace_schema_metadata(None))
        return pa.concat_tables(parts)


def read_rollouts(
    path: PathLike,
    *,
    columns: Sequence[str] | None = None,
    steps: Sequence[int] | None = None,
) -> ray.data.Dataset:
    """A lazy Ray Dataset over a rollout file or ``step=N`` directory, routes restored, ``step`` int64.

    One read task per Parquet row group, with r3arrow's reader (storage routes
    restored to the nested type without a copy). ``columns`` projects (``step``
    is added for a directory); ``steps`` selects partitions. Blocks carry no
    schema metadata: keep ``rollout_spec(path)`` for the spec.
    """
    return _read(path, columns, steps)[0]


def _read(
    path: PathLike, columns: Sequence[str] | None, steps: Sequence[int] | None
) -> tuple[ray.data.Dataset, RouteSpec]:
    import ray.data

    # Not ray.data.read_parquet: its Parquet reader (Ray 2.60) bin-packs small files into
    # one read task (no parallelism below ~128 MB), and a list of paths is resolved on
    # parallel threads that race on an optional fsspec import when aiohttp is absent.
    spec, units = _scan(path, steps)  # fails early on foreign files or mixed specs
    if not units:
        raise SchemaError(f"{path}: expected rollout row groups, found none")
    cols = None if columns is None else list(dict.fromkeys(c for c in columns if c != "step"))
    ds = ray.data.from_items(units, override_num_blocks=len(units))
    return ds.map_batches(_ReadUnits(cols), batch_format="pyarrow", batch_size=1), spec


# =========================================================== aggregation
class _Partials:
    """Block → one row per step present: ``step`` int64, ``partial`` large_list<int64> (exact counts)."""

    def __init__(self, spec_json: bytes, kind: _Kind, tokens: str, other: str | None) -> None:
        self.spec_json = spec_json
        self.kind = kind
        self.tokens = tokens
        self.other = other

    def __call__(self, batch: pa.Table) -> pa.Table:
        table = batch.replace_schema_metadata({SPEC_METADATA_KEY: self.spec_json})
        parts: Mapping[int, ExpertCounts | RouteAgreement]
        if "step" not in table.schema.names:
            table = table.append_column(
                "step", pa.array(np.full(table.num_rows, _NO_STEP, np.int64))
            )
        tok: Any = self.tokens
        if self.kind == "counts":
            parts = _stats.expert_counts_by_step(table, tokens=tok)
        else:
            assert self.other is not None
            parts = _stats.route_agreement_by_step(table, self.other, tokens=tok)
        return pa.table(
            {
                "step": pa.array(list(parts), type=pa.int64()),
                "partial": pa.array(
                    [p.to_vector() for p in parts.values()], type=pa.large_list(pa.int64())
                ),
            }
        )


def _sum_vectors(kind: _Kind, a: Any, b: Any) -> np.ndarray:
    """Sum of two encoded partials (decoded: headers differ, e.g. in width); empty = zero."""
    va, vb = np.asarray(a, dtype=np.int64), np.asarray(b, dtype=np.int64)
    if va.size == 0:
        return vb
    if vb.size == 0:
        return va
    if kind == "counts":
        return (ExpertCounts.from_vector(va) + ExpertCounts.from_vector(vb)).to_vector()
    return (RouteAgreement.from_vector(va) + RouteAgreement.from_vector(vb)).to_vector()


def _sum_aggregate(kind: _Kind) -> Any:
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
            for chunk in col.chunks:
                offsets = np.asarray(chunk.offsets, dtype=np.int64)
                flat = np.asarray(chunk.values.to_numpy(zero_copy_only=False), dtype=np.int64)
                for i in range(len(chunk)):  # one row per (block, step): not a hot loop
                    acc = _sum_vectors(kind, acc, flat[offsets[i] : offsets[i + 1]])
            return acc

        def combine(self, current_accumulator: Any, new: Any) -> np.ndarray:
            return _sum_vectors(kind, current_accumulator, new)

    return SumPartials()


def _as_dataset(
    source: Any, spec: RouteSpec | None, columns: list[str], steps: Sequence[int] | None
) -> tuple[Any, RouteSpec]:
    if isinstance(source, str | os.PathLike):
        return _read(source, columns, steps)
    if spec is None:
        raise SchemaError(
            "expected spec= with a Ray Dataset (Ray blocks carry no schema metadata), found None"
        )
    if steps is not None:
        source = source.map_batches(
            _KeepSteps([int(s) for s in steps]),
            batch_format="pyarrow",
            batch_size=None,
            zero_copy_batch=True,
        )
    return source, spec


class _KeepSteps:
    """Block filter: rows whose ``step`` is in ``steps``."""

    def __init__(self, steps: list[int]) -> None:
        self.steps = steps

    def __call__(self, batch: pa.Table) -> pa.Table:
        import pyarrow.compute as pc

        if "step" not in batch.schema.names:
            raise SchemaError(f"steps= needs a 'step' column, found {batch.schema.names}")
        return batch.filter(pc.is_in(batch.column("step"), pa.array(self.steps, type=pa.int64())))


def _columns(tokens: str, other: str | None) -> list[str]:
    if tokens not in TOKEN_SUBSETS:
        raise SchemaError(f"tokens: expected one of {list(TOKEN_SUBSETS)}, found {tokens!r}")
    need = {
        "all": [],
        "prompt": ["prompt_ids"],
        "response": ["prompt_ids"],
        "loss": ["prompt_ids", "response_ids", "loss_mask"],
    }[tokens]
    return list(dict.fromkeys(["routes", *([other] if other else []), *need]))


def _check_reduce(reduce: str) -> None:
    if reduce not in ("driver", "ray"):
        raise SchemaError(f"reduce: expected 'driver' or 'ray', found {reduce!r}")


def _partials(
    source: Any,
    spec: RouteSpec | None,
    kind: _Kind,
    tokens: str,
    other: str | None,
    steps: Sequence[int] | None,
) -> tuple[Any, RouteSpec]:
    ds, spec = _as_dataset(source, spec, _columns(tokens, other), steps)
    fn = _Partials(spec.to_json(), kind, tokens, other)
    return ds.map_batches(fn, batch_format="pyarrow", batch_size=None, zero_copy_batch=True), spec


def _drain(parts: Any, kind: _Kind) -> dict[int, np.ndarray]:
    """Sum partial rows per step on the driver as they stream in (each row is a few KB)."""
    acc: dict[int, np.ndarray] = {}
    for batch in parts.iter_batches(batch_format="pyarrow", batch_size=None):
        steps = batch.column("step").to_pylist()
        vectors = batch.column("partial")
        for i, step in enumerate(steps):  # one row per (block, step): not a hot loop
            vec = np.asarray(vectors[i].values.to_numpy(zero_copy_only=False), dtype=np.int64)
            acc[int(step)] = _sum_vectors(kind, acc.get(int(step), np.zeros(0, np.int64)), vec)
    return acc


def _reduce(
    source: Any,
    spec: RouteSpec | None,
    kind: _Kind,
    tokens: str,
    other: str | None,
    steps: Sequence[int] | None,
    reduce: Reduce,
) -> tuple[np.ndarray, RouteSpec]:
    _check_reduce(reduce)
    parts, spec = _partials(source, spec, kind, tokens, other, steps)
    if reduce == "ray":
        result = parts.aggregate(_sum_aggregate(kind))
        vec = result["partial"] if isinstance(result, dict) else result
        return np.asarray(vec if vec is not None else np.zeros(0), dtype=np.int64), spec
    total = np.zeros(0, np.int64)
    for vec in _drain(parts, kind).values():
        total = _sum_vectors(kind, total, vec)
    return total, spec


def _reduce_by_step(
    source: Any,
    spec: RouteSpec | None,
    kind: _Kind,
    tokens: str,
    other: str | None,
    steps: Sequence[int] | None,
    reduce: Reduce,
) -> dict[int, np.ndarray]:
    _check_reduce(reduce)
    parts, _ = _partials(source, spec, kind, tokens, other, steps)
    if reduce == "ray":
        rows = parts.groupby("step").aggregate(_sum_aggregate(kind)).take_all()
        out = {int(r["step"]): np.asarray(r["partial"], dtype=np.int64) for r in rows}
    else:
        out = _drain(parts, kind)
    if _NO_STEP in out:
        raise SchemaError("by step: expected a step=N/ directory or a 'step' column, found neither")
    return dict(sorted(out.items()))


def expert_counts(
    source: PathLike | ray.data.Dataset,
    *,
    spec: RouteSpec | None = None,
    tokens: TokenSubset = "all",
    steps: Sequence[int] | None = None,
    reduce: Reduce = "driver",
) -> ExpertCounts:
    """`r3arrow.stats.expert_counts` as a Ray aggregation over a path or a `read_rollouts` Dataset.

    Each block becomes exact partial counts in parallel ``map_batches`` tasks;
    ``reduce`` picks the final combine (see `Reduce`). A Dataset needs ``spec``.
    """
    vec, spec = _reduce(source, spec, "counts", tokens, None, steps, reduce)
    return ExpertCounts.from_vector(vec) if vec.size else ExpertCounts.empty(spec)


def expert_counts_by_step(
    source: PathLike | ray.data.Dataset,
    *,
    spec: RouteSpec | None = None,
    tokens: TokenSubset = "all",
    steps: Sequence[int] | None = None,
    reduce: Reduce = "driver",
) -> dict[int, ExpertCounts]:
    """Per-step `ExpertCounts`, ascending (``reduce="ray"``: Ray ``groupby("step")`` over the partials)."""
    per = _reduce_by_step(source, spec, "counts", tokens, None, steps, reduce)
    return {s: ExpertCounts.from_vector(v) for s, v in per.items()}


def expert_load(
    source: PathLike | ray.data.Dataset,
    *,
    spec: RouteSpec | None = None,
    tokens: TokenSubset = "all",
    steps: Sequence[int] | None = None,
    by_step: bool = False,
    reduce: Reduce = "driver",
) -> pl.DataFrame:
    """`r3arrow.stats.expert_load` computed on Ray: same columns, dtypes, order and values."""
    if not by_step:
        return expert_counts(
            source, spec=spec, tokens=tokens, steps=steps, reduce=reduce
        ).to_polars()
    per = expert_counts_by_step(source, spec=spec, tokens=tokens, steps=steps, reduce=reduce)
    return stack_steps({s: c.to_polars() for s, c in per.items()})


def route_agreement(
    source: PathLike | ray.data.Dataset,
    other: str,
    *,
    spec: RouteSpec | None = None,
    tokens: TokenSubset = "all",
    steps: Sequence[int] | None = None,
    reduce: Reduce = "driver",
) -> RouteAgreement:
    """`r3arrow.stats.route_agreement` of ``routes`` vs the routes column ``other``, on Ray."""
    vec, spec = _reduce(source, spec, "agreement", tokens, other, steps, reduce)
    return RouteAgreement.from_vector(vec) if vec.size else RouteAgreement.empty(spec)


def route_agreement_by_step(
    source: PathLike | ray.data.Dataset,
    other: str,
    *,
    spec: RouteSpec | None = None,
    tokens: TokenSubset = "all",
    steps: Sequence[int] | None = None,
    reduce: Reduce = "driver",
) -> dict[int, RouteAgreement]:
    """Per-step `RouteAgreement` on Ray, ascending."""
    per = _reduce_by_step(source, spec, "agreement", tokens, other, steps, reduce)
    return {s: RouteAgreement.from_vector(v) for s, v in per.items()}


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
    """One-row Arrow table of a microbatch: per array field ``name`` (flat values) and ``name.shape``.

    Also ``trajectory_ids`` and ``step`` (null without steps); ints, floats and
    bools are kept as scalar columns, other fields (spec, None) are dropped.
    """
    cols: dict[str, pa.Array] = {
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
    """Decode `collate` output rows: per row, arrays reshaped by their ``.shape`` columns and the scalars."""
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
            microbatch_row(self._collator(part), part.column("trajectory_id").to_pylist(), step)
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
        _Collate(make_collator, spec.to_json()),
        batch_format="pyarrow",
        batch_size=batch_size,
        zero_copy_batch=True,
    )


__all__ = [
    "Reduce",
    "collate",
    "expert_counts",
    "expert_counts_by_step",
    "expert_load",
    "microbatch_arrays",
    "microbatch_row",
    "read_rollouts",
    "rollout_spec",
    "route_agreement",
    "route_agreement_by_step",
]
