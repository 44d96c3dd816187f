"""The public statistics, one API for both engines: ``engine="local"`` (default) or ``"ray"``.

``engine="local"`` streams the source in this process (`r3arrow.stats._sources`).
``engine="ray"`` hands the same per-block partials to `r3arrow.ray.partials`
(a Ray Data ``map_batches`` and an exact sum); the results are identical.
"""

from __future__ import annotations

import functools
import importlib
import operator
from collections.abc import Iterator, Sequence
from typing import Any, Literal, cast

import numpy as np
import polars as pl
import pyarrow as pa

from r3arrow._checks import check_choice
from r3arrow.errors import SchemaError
from r3arrow.io import project_layers
from r3arrow.spec import RouteSpec
from r3arrow.stats._agreement import RouteAgreement
from r3arrow.stats._counts import ExpertCounts
from r3arrow.stats._layered import layered_counts
from r3arrow.stats._selection import TokenSubset, check_column, check_layers, check_subset
from r3arrow.stats._sources import (
    _NO_STEPS,
    BlockPartials,
    Kind,
    agreement_parts,
    batch_counts,
    batch_parts,
    combiner,
    decode,
    is_path,
    sum_by_step,
    sum_parts,
)
from r3arrow.stats._stream import check_budget
from r3arrow.stats._summaries import stack_steps

Engine = Literal["local", "ray"]
ENGINES: tuple[str, ...] = ("local", "ray")
#: Final combine of the Ray engine's partials: "driver" streams them to the driver and sums
#: there (cheap: a few KB per block); "ray" uses a Ray ``AggregateFnV2`` (hash-shuffle
#: aggregate; seconds of fixed overhead on a small cluster). Both are exact.
Reduce = Literal["driver", "ray"]
REDUCES: tuple[str, ...] = ("driver", "ray")


def _check_engine(
    engine: object,
    reduce: object,
    spec: RouteSpec | None,
    max_memory: object = None,
    validate: object = False,
) -> str:
    check_choice(reduce, "reduce", REDUCES)
    out = check_choice(engine, "engine", ENGINES)
    if out == "ray" and (max_memory is not None or validate):
        raise ValueError(
            "max_memory, validate: apply to engine='local' only, found "
            f"max_memory={max_memory!r}, validate={validate!r} with 'ray'"
        )
    if out == "local":
        check_budget(max_memory)
    if out == "local" and reduce != "driver":
        raise ValueError(f"reduce: applies to engine='ray' only, found {reduce!r} with 'local'")
    if out == "local" and spec is not None:
        raise TypeError("spec: applies to engine='ray' with a Ray Dataset source, found a spec")
    return out


def _ray_partials(
    source: Any,
    kind: Kind,
    tokens: str,
    other: str | None,
    *,
    spec: RouteSpec | None,
    steps: Sequence[int] | None,
    grouped: bool,
    reduce: str,
    column: str = "routes",
) -> tuple[dict[int | None, np.ndarray], RouteSpec]:
    """Encoded partials from the Ray engine (not ``grouped``: one total under ``None``)."""
    block = BlockPartials(kind, tokens, other, column=column)
    # Imported by name at call time: r3arrow.ray sits above stats in the layers and
    # needs the ray extra; stats never imports it at module import time.
    ray_module = importlib.import_module("r3arrow.ray")
    parts, spec = ray_module.partials(
        source,
        block,
        combiner(kind),
        columns=block.columns(),
        spec=spec,
        steps=steps,
        grouped=grouped,
        reduce=reduce,
    )
    return parts, spec


def _ray_total(
    source: Any,
    kind: Kind,
    tokens: str,
    other: str | None,
    spec: RouteSpec | None,
    steps: Sequence[int] | None,
    reduce: str,
    column: str = "routes",
) -> ExpertCounts | RouteAgreement:
    parts, spec = _ray_partials(
        source,
        kind,
        tokens,
        other,
        spec=spec,
        steps=steps,
        grouped=False,
        reduce=reduce,
        column=column,
    )
    vec = parts.get(None, np.zeros(0, np.int64))
    if vec.size:
        return decode(kind, vec)
    return ExpertCounts.empty(spec) if kind == "counts" else RouteAgreement.empty(spec)


def _ray_by_step(
    source: Any,
    kind: Kind,
    tokens: str,
    other: str | None,
    spec: RouteSpec | None,
    steps: Sequence[int] | None,
    reduce: str,
    column: str = "routes",
) -> dict[int, ExpertCounts | RouteAgreement]:
    parts, _ = _ray_partials(
        source,
        kind,
        tokens,
        other,
        spec=spec,
        steps=steps,
        grouped=True,
        reduce=reduce,
        column=column,
    )
    out: dict[int, ExpertCounts | RouteAgreement] = {}
    for step, vec in parts.items():
        if step is None:
            raise SchemaError(_NO_STEPS)
        out[step] = decode(kind, vec)
    return dict(sorted(out.items()))


def _layered(
    source: Any,
    tokens: str,
    steps: Sequence[int] | None,
    max_memory: int | None,
    validate: bool,
    column: str,
    layers: list[int] | None,
) -> dict[int | None, ExpertCounts] | None:
    """Per-step counts of a path in layer-group storage, a pass per group; else None."""
    if not is_path(source):
        return None
    check_subset(tokens)
    return layered_counts(source, tokens, steps, max_memory, validate, column=column, layers=layers)


def _local_counts(
    source: Any,
    tokens: str,
    steps: Sequence[int] | None,
    max_memory: int | None,
    validate: bool,
    column: Any,
    layers: Any,
) -> Iterator[tuple[int | None, ExpertCounts]] | dict[int | None, ExpertCounts]:
    """``(step, ExpertCounts)`` partials of a local source, or a dict of per-step totals
    (the layer-group passes of a path). ``layers`` of a table: projected in memory."""
    column = check_column(column)
    wanted = check_layers(layers)
    layered = _layered(source, tokens, steps, max_memory, validate, column, wanted)
    if layered is not None:
        return layered
    if wanted is not None and isinstance(source, pa.Table | pa.RecordBatch):
        table = source if isinstance(source, pa.Table) else pa.Table.from_batches([source])
        source, wanted = project_layers(table, wanted), None
    return batch_parts(
        source,
        tokens,
        steps,
        lambda batch: batch_counts(batch, tokens, column),
        (),
        max_memory,
        validate,
        column=column,
        layers=wanted,
    )


def _local_only_layers(layers: object) -> None:
    if layers is not None:
        raise ValueError(f"layers: applies to engine='local' only, found {layers!r} with 'ray'")


def expert_counts(
    source: Any,
    *,
    tokens: TokenSubset = "all",
    steps: Sequence[int] | None = None,
    engine: Engine = "local",
    spec: RouteSpec | None = None,
    reduce: Reduce = "driver",
    max_memory: int | None = None,
    validate: bool = False,
    column: str = "routes",
    layers: Sequence[int] | None = None,
) -> ExpertCounts:
    """Total `ExpertCounts` of a rollout table, a Parquet file or a step-partitioned root.

    ``source``: a table or record batch, a file, a root (streamed by step), or
    with ``engine="ray"`` also a Ray Dataset from `r3arrow.ray.read_rollouts`
    (then ``spec`` is required: Ray blocks carry no schema metadata).
    ``tokens``: the subset (`r3arrow.stats.TOKEN_SUBSETS`); ``steps``: the steps
    to include. ``reduce``: the Ray engine's final combine (`Reduce`).
    ``max_memory``: with ``engine="local"``, the memory budget (bytes) of a path
    streamed by row group (default 1 GiB, `r3arrow.stats._stream`); the
    counts do not depend on it. A path's footers and page checksums are always
    verified and every counted id is checked against ``num_experts``
    (`ExpertRangeError`); ``validate=True`` adds every row check of
    `r3arrow.io.read_rollouts` (distinct ids, lengths, nulls; slower).
    ``column``: the routes column to count (default ``routes``; e.g. ``"train_routes"``,
    the trainer routers' own choices, ``docs/train-routes.md``): the token subsets
    still come from ``prompt_ids`` / ``response_ids`` / ``loss_mask``, with the
    column's list lengths. ``layers``: global layer ids to count (None: every router
    layer); a path then reads only those layers (layer projection, ``docs/storage.md``),
    a table is projected in memory; dense layers among them are skipped. Raises
    ``ValueError`` / ``TypeError`` for bad arguments (``layers`` outside
    ``[0, num_layers)`` or of dense layers only: ``ValueError``; ``layers`` with
    ``engine="ray"``: ``ValueError``), `RouteShapeError` for layers a projected
    source does not hold, `SchemaError` for missing columns, steps or files.
    """
    if _check_engine(engine, reduce, spec, max_memory, validate) == "ray":
        check_subset(tokens)
        _local_only_layers(layers)
        total = _ray_total(
            source, "counts", tokens, None, spec, steps, reduce, check_column(column)
        )
        return cast(ExpertCounts, total)
    parts = _local_counts(source, tokens, steps, max_memory, validate, column, layers)
    if isinstance(parts, dict):
        return functools.reduce(operator.add, parts.values())
    return sum_parts(parts, source, None, ExpertCounts.empty)


def expert_counts_by_step(
    source: Any,
    *,
    tokens: TokenSubset = "all",
    steps: Sequence[int] | None = None,
    engine: Engine = "local",
    spec: RouteSpec | None = None,
    reduce: Reduce = "driver",
    max_memory: int | None = None,
    validate: bool = False,
    column: str = "routes",
    layers: Sequence[int] | None = None,
) -> dict[int, ExpertCounts]:
    """`ExpertCounts` per step, ascending: a step-partitioned root or a table with ``step``.

    Arguments as `expert_counts` (``reduce="ray"``: Ray ``groupby("step")``).
    Raises `SchemaError` if the source has no steps.
    """
    if _check_engine(engine, reduce, spec, max_memory, validate) == "ray":
        check_subset(tokens)
        _local_only_layers(layers)
        per = _ray_by_step(
            source, "counts", tokens, None, spec, steps, reduce, check_column(column)
        )
        return cast(dict[int, ExpertCounts], per)
    parts = _local_counts(source, tokens, steps, max_memory, validate, column, layers)
    if isinstance(parts, dict):
        return sum_by_step(iter(parts.items()))
    return sum_by_step(parts)


def expert_load(
    source: Any,
    *,
    tokens: TokenSubset = "all",
    steps: Sequence[int] | None = None,
    by_step: bool = False,
    engine: Engine = "local",
    spec: RouteSpec | None = None,
    reduce: Reduce = "driver",
    max_memory: int | None = None,
    validate: bool = False,
    column: str = "routes",
    layers: Sequence[int] | None = None,
) -> pl.DataFrame:
    """Routed-token count per MoE layer and expert: columns ``layer``, ``expert``, ``tokens``.

    ``layer`` is the global layer id (Int32; dense layers are absent),
    ``expert`` the expert id (Int32), ``tokens`` how many selected tokens that
    layer routed to that expert (Int64; zero-count experts included, so each
    layer has ``num_experts`` rows and sums to ``topk × tokens``). Sorted by
    (layer, expert); with ``by_step`` true, a leading ``step`` (Int64) column.
    ``source``, ``tokens``, ``steps``, ``engine``, ``spec``, ``reduce``,
    ``max_memory``, ``validate``, ``column``, ``layers``: as `expert_counts` (with
    ``layers``, only those router layers have rows); both engines return the same frame.
    """
    kw: dict[str, Any] = {
        "tokens": tokens,
        "steps": steps,
        "engine": engine,
        "spec": spec,
        "max_memory": max_memory,
        "validate": validate,
        "column": column,
        "layers": layers,
    }
    if not by_step:
        return expert_counts(source, reduce=reduce, **kw).to_polars()
    per = expert_counts_by_step(source, reduce=reduce, **kw)
    return stack_steps({s: c.to_polars() for s, c in per.items()})


def route_agreement(
    a: Any,
    b: Any,
    spec: RouteSpec | None = None,
    *,
    tokens: TokenSubset | np.ndarray = "all",
    steps: Sequence[int] | None = None,
    engine: Engine = "local",
    reduce: Reduce = "driver",
    max_memory: int | None = None,
    validate: bool = False,
    layers: Sequence[int] | None = None,
) -> RouteAgreement:
    """Agreement between two route sets for the same tokens, order within top-k ignored.

    ``a`` / ``b``: two numpy ``[T, L, K]`` arrays (``spec`` optional, ``tokens``
    an optional bool ``[T]``); a rollout table and another table of the same
    trajectories, an aligned ``[T, L, K]`` array, or the name of a second routes
    column in it (e.g. the trainer router's RECORD-mode routes); or a Parquet
    file / step-partitioned root and such a column name (streamed by step). With
    ``engine="ray"``: a path or Ray Dataset (with ``spec``) and a column name.
    ``max_memory``, ``validate``: how a path is streamed (as `expert_counts`;
    the agreement kernels also refuse repeated ids within a top-k set).
    ``layers``: global layer ids to compare (with a table or path ``a`` and a column
    name ``b``; a path then reads only those layers, layer projection); ``all_identical``
    then counts tokens identical on every selected router layer. Returns exact
    counts; see `RouteAgreement` for the per-layer fractions and
    `RouteAgreement.summary` for the R3 paper's quantities.
    """
    check_choice(reduce, "reduce", REDUCES)
    if check_choice(engine, "engine", ENGINES) == "ray":
        _check_engine(engine, reduce, None, max_memory, validate)
        if not isinstance(b, str):
            raise TypeError(
                f"route_agreement(engine='ray'): expected b to name a routes column, "
                f"found {type(b).__name__}"
            )
        subset = check_subset(tokens)
        _local_only_layers(layers)
        return cast(RouteAgreement, _ray_total(a, "agreement", subset, b, spec, steps, reduce))
    if reduce != "driver":
        raise ValueError(f"reduce: applies to engine='ray' only, found {reduce!r} with 'local'")
    check_budget(max_memory)
    wanted = check_layers(layers)
    parts = agreement_parts(a, b, spec, tokens, steps, max_memory, validate, wanted)
    return sum_parts(parts, a, spec, RouteAgreement.empty)


def route_agreement_by_step(
    source: Any,
    other: str,
    *,
    tokens: TokenSubset = "all",
    steps: Sequence[int] | None = None,
    engine: Engine = "local",
    spec: RouteSpec | None = None,
    reduce: Reduce = "driver",
    max_memory: int | None = None,
    validate: bool = False,
    layers: Sequence[int] | None = None,
) -> dict[int, RouteAgreement]:
    """`RouteAgreement` of ``routes`` vs column ``other`` per step (root or table with ``step``).

    Arguments as `expert_counts` (``layers`` as `route_agreement`); raises `SchemaError`
    if the source has no steps.
    """
    if _check_engine(engine, reduce, spec, max_memory, validate) == "ray":
        check_subset(tokens)
        _local_only_layers(layers)
        per = _ray_by_step(source, "agreement", tokens, other, spec, steps, reduce)
        return cast(dict[int, RouteAgreement], per)
    wanted = check_layers(layers)
    parts = agreement_parts(source, other, None, tokens, steps, max_memory, validate, wanted)
    return sum_by_step(parts)


__all__ = [
    "ENGINES",
    "REDUCES",
    "Engine",
    "Reduce",
    "expert_counts",
    "expert_counts_by_step",
    "expert_load",
    "route_agreement",
    "route_agreement_by_step",
]
