"""The public statistics: a source streamed in this process, or handed to an executor.

``executor=None`` (default) streams the source here (`r3arrow.stats._sources`: a table
batch by batch, a path by row group under ``max_memory``). An `Executor` (e.g.
`r3arrow.ray.RayExecutor`) is handed the statistic's per-block partial function
(`r3arrow.stats._sources.BlockPartials`) and the exact combine of two partials, and
runs them over its own workers (`Executor.map_reduce`); the integers are identical.
Stats knows no executor's code: `Executor` is a structural `typing.Protocol`.
"""

from __future__ import annotations

import functools
import operator
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol, cast, runtime_checkable

import numpy as np
import polars as pl
import pyarrow as pa

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

#: A block of rollout rows (spec in its schema metadata) → ``{step or None: int64 partial}``.
BlockFn = Callable[[pa.Table], Mapping[int | None, np.ndarray]]
#: The exact sum of two partial vectors (an empty vector is zero).
CombineFn = Callable[[Any, Any], np.ndarray]


@runtime_checkable
class Executor(Protocol):
    """Runs a statistic's per-block partials on other workers and sums them exactly.

    `map_reduce` reads ``source`` (a rollout path, only ``columns``; or a dataset of
    rollout rows of the executor's own kind, with ``spec``; ``steps``: the steps kept),
    maps every block (a ``pyarrow.Table``, the spec restored in its schema metadata)
    through ``block_fn`` to ``{step or None: int64 vector}`` and adds the vectors with
    ``combine_fn`` (exact integer sums: the order does not matter). Both functions are
    picklable. Returns (``{None: total}``, spec), or with ``by_step`` (``{step: total}``,
    spec) with a ``None`` key for rows without a step; no blocks: an empty dict or an
    empty vector. Raises ``TypeError`` for a source it cannot read (e.g. an in-memory
    table) or a dataset without ``spec``. Implemented by `r3arrow.ray.RayExecutor`.
    """

    def map_reduce(
        self,
        source: Any,
        block_fn: BlockFn,
        combine_fn: CombineFn,
        *,
        columns: Sequence[str],
        spec: RouteSpec | None,
        steps: Sequence[int] | None,
        by_step: bool,
    ) -> tuple[dict[int | None, np.ndarray], RouteSpec]: ...


def _check_executor(
    executor: object, spec: object, max_memory: object, validate: object, layers: object
) -> Executor | None:
    """The executor (None: local streaming) after checking the arguments that go with it."""
    if executor is None:
        check_budget(max_memory)
        if spec is not None:
            raise TypeError(
                "spec: applies to an executor's dataset source (executor=...), "
                "found a spec with executor=None"
            )
        return None
    if not isinstance(executor, Executor):
        raise TypeError(
            "executor: expected None or an Executor with map_reduce "
            f"(e.g. r3arrow.ray.RayExecutor()), found {type(executor).__name__}"
        )
    local = {"max_memory": max_memory, "validate": validate, "layers": layers}
    used = {k: v for k, v in local.items() if v is not None and v is not False}
    if used:
        raise ValueError(
            f"{', '.join(used)}: local streaming settings, apply to executor=None only, "
            f"found {used} with {type(executor).__name__}"
        )
    return executor


def _mapped(
    executor: Executor,
    source: Any,
    kind: Kind,
    tokens: object,
    other: str | None,
    spec: RouteSpec | None,
    steps: Sequence[int] | None,
    by_step: bool,
    column: object = "routes",
) -> ExpertCounts | RouteAgreement | dict[int, ExpertCounts | RouteAgreement]:
    """The statistic computed by ``executor``: the total, or per step with ``by_step``."""
    block = BlockPartials(kind, check_subset(tokens), other, column=check_column(column))
    parts, spec = executor.map_reduce(
        source,
        block,
        combiner(kind),
        columns=block.columns(),
        spec=spec,
        steps=steps,
        by_step=by_step,
    )
    if not by_step:
        vec = parts.get(None, np.zeros(0, np.int64))
        if vec.size:
            return decode(kind, vec)
        return ExpertCounts.empty(spec) if kind == "counts" else RouteAgreement.empty(spec)
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


def expert_counts(
    source: Any,
    *,
    tokens: TokenSubset = "all",
    steps: Sequence[int] | None = None,
    executor: Executor | None = None,
    spec: RouteSpec | None = None,
    max_memory: int | None = None,
    validate: bool = False,
    column: str = "routes",
    layers: Sequence[int] | None = None,
) -> ExpertCounts:
    """Total `ExpertCounts` of a rollout table, a Parquet file or a step-partitioned root.

    ``source``: a table or record batch, a file, a root (streamed by step), or with an
    ``executor`` a path or the executor's dataset (e.g. `r3arrow.ray.rollout_dataset`;
    then ``spec`` is required: Ray blocks carry no schema metadata).
    ``tokens``: the subset (`r3arrow.stats.TokenSubset`); ``steps``: the steps
    to include. ``executor``: None streams in this process; an `Executor` (e.g.
    `r3arrow.ray.RayExecutor()`) runs the same partials on its workers, same integers.
    Local streaming settings (``executor=None`` only; with an executor ``ValueError``):
    ``max_memory``, the memory budget (bytes) of a path streamed by row group (default
    1 GiB, `r3arrow.stats._stream`; the counts do not depend on it); ``validate=True``
    adds every row check of `r3arrow.io.read_rollouts` (distinct ids, lengths, nulls;
    slower) to what is always done (a path's footers and page checksums verified, every
    counted id checked against ``num_experts``: `ExpertRangeError`); ``layers``: global
    layer ids to count (None: every router layer); a path then reads only those layers
    (layer projection, ``docs/storage.md``), a table is projected in memory; dense
    layers among them are skipped.
    ``column``: the routes column to count (default ``routes``; e.g. ``"train_routes"``,
    the trainer routers' own choices, ``docs/train-routes.md``): the token subsets
    still come from ``prompt_ids`` / ``response_ids`` / ``loss_mask``, with the
    column's list lengths. Raises ``ValueError`` / ``TypeError`` for bad arguments
    (``layers`` outside ``[0, num_layers)`` or of dense layers only: ``ValueError``;
    ``executor`` not an `Executor`, ``spec`` without one: ``TypeError``),
    `RouteShapeError` for layers a projected source does not hold, `SchemaError` for
    missing columns, steps or files.
    """
    if ex := _check_executor(executor, spec, max_memory, validate, layers):
        return cast(
            ExpertCounts, _mapped(ex, source, "counts", tokens, None, spec, steps, False, column)
        )
    parts = _local_counts(source, tokens, steps, max_memory, validate, column, layers)
    if isinstance(parts, dict):
        return functools.reduce(operator.add, parts.values())
    return sum_parts(parts, source, None, ExpertCounts.empty)


def expert_counts_by_step(
    source: Any,
    *,
    tokens: TokenSubset = "all",
    steps: Sequence[int] | None = None,
    executor: Executor | None = None,
    spec: RouteSpec | None = None,
    max_memory: int | None = None,
    validate: bool = False,
    column: str = "routes",
    layers: Sequence[int] | None = None,
) -> dict[int, ExpertCounts]:
    """`ExpertCounts` per step, ascending: a step-partitioned root or a table with ``step``.

    Arguments as `expert_counts`. Raises `SchemaError` if the source has no steps.
    """
    if ex := _check_executor(executor, spec, max_memory, validate, layers):
        per = _mapped(ex, source, "counts", tokens, None, spec, steps, True, column)
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
    executor: Executor | None = None,
    spec: RouteSpec | None = None,
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
    ``source``, ``tokens``, ``steps``, ``executor``, ``spec``, ``max_memory``,
    ``validate``, ``column``, ``layers``: as `expert_counts` (with ``layers``, only
    those router layers have rows); every executor returns the same frame.
    """
    kw: dict[str, Any] = {
        "tokens": tokens,
        "steps": steps,
        "executor": executor,
        "spec": spec,
        "max_memory": max_memory,
        "validate": validate,
        "column": column,
        "layers": layers,
    }
    if not by_step:
        return expert_counts(source, **kw).to_polars()
    per = expert_counts_by_step(source, **kw)
    return stack_steps({s: c.to_polars() for s, c in per.items()})


def route_agreement(
    a: Any,
    b: Any,
    spec: RouteSpec | None = None,
    *,
    tokens: TokenSubset | np.ndarray = "all",
    steps: Sequence[int] | None = None,
    executor: Executor | None = None,
    max_memory: int | None = None,
    validate: bool = False,
    layers: Sequence[int] | None = None,
) -> RouteAgreement:
    """Agreement between two route sets for the same tokens, order within top-k ignored.

    ``a`` / ``b``: two numpy ``[T, L, K]`` arrays (``spec`` optional, ``tokens``
    an optional bool ``[T]``); a rollout table and another table of the same
    trajectories, an aligned ``[T, L, K]`` array, or the name of a second routes
    column in it (e.g. the trainer router's RECORD-mode routes); or a Parquet
    file / step-partitioned root and such a column name (streamed by step). With an
    ``executor`` (as `expert_counts`): a path or the executor's dataset (with
    ``spec``) and a column name.
    ``max_memory``, ``validate``: how a path is streamed (as `expert_counts`;
    the agreement kernels also refuse repeated ids within a top-k set).
    ``layers``: global layer ids to compare (with a table or path ``a`` and a column
    name ``b``; a path then reads only those layers, layer projection); ``all_identical``
    then counts tokens identical on every selected router layer. Returns exact
    counts; see `RouteAgreement` for the per-layer fractions and
    `RouteAgreement.summary` for the R3 paper's quantities.
    """
    if ex := _check_executor(executor, None, max_memory, validate, layers):
        if not isinstance(b, str):
            raise TypeError(
                f"route_agreement with an executor: expected b to name a routes column, "
                f"found {type(b).__name__}"
            )
        return cast(RouteAgreement, _mapped(ex, a, "agreement", tokens, b, spec, steps, False))
    wanted = check_layers(layers)
    parts = agreement_parts(a, b, spec, tokens, steps, max_memory, validate, wanted)
    return sum_parts(parts, a, spec, RouteAgreement.empty)


def route_agreement_by_step(
    source: Any,
    other: str,
    *,
    tokens: TokenSubset = "all",
    steps: Sequence[int] | None = None,
    executor: Executor | None = None,
    spec: RouteSpec | None = None,
    max_memory: int | None = None,
    validate: bool = False,
    layers: Sequence[int] | None = None,
) -> dict[int, RouteAgreement]:
    """`RouteAgreement` of ``routes`` vs column ``other`` per step (root or table with ``step``).

    Arguments as `expert_counts` (``layers`` as `route_agreement`); raises `SchemaError`
    if the source has no steps.
    """
    if ex := _check_executor(executor, spec, max_memory, validate, layers):
        per = _mapped(ex, source, "agreement", tokens, other, spec, steps, True)
        return cast(dict[int, RouteAgreement], per)
    wanted = check_layers(layers)
    parts = agreement_parts(source, other, None, tokens, steps, max_memory, validate, wanted)
    return sum_by_step(parts)


__all__ = [
    "BlockFn",
    "CombineFn",
    "Executor",
    "expert_counts",
    "expert_counts_by_step",
    "expert_load",
    "route_agreement",
    "route_agreement_by_step",
]
