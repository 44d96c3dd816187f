"""The public statistics: a source streamed in this process, or handed to an `Executor`.

``executor=None`` streams here (`r3arrow.stats._sources`); an `Executor` runs the
statistic's per-block partials (`r3arrow.stats._sources.BlockPartials`) and their exact
combine on its own workers; the integers are identical (``docs/scale.md``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, Protocol, cast, overload, runtime_checkable

import numpy as np
import polars as pl
import pyarrow as pa

from r3arrow._schema import POLICY_VERSION
from r3arrow.errors import SchemaError
from r3arrow.spec import RouteSpec
from r3arrow.stats._agreement import RouteAgreement
from r3arrow.stats._counts import ExpertCounts
from r3arrow.stats._selection import TokenSubset, check_column, check_layers, check_subset
from r3arrow.stats._sources import (
    _NO_STEPS,
    BlockPartials,
    Group,
    Kind,
    agreement_parts,
    check_budget,
    combiner,
    count_parts,
    decode,
    sum_by_step,
    sum_parts,
)
from r3arrow.stats._summaries import stack_steps

#: A block of rollout rows (spec in its schema metadata) → ``{step or None: int64 partial}``.
BlockFn = Callable[[pa.Table], Mapping[int | None, np.ndarray]]
#: The exact sum of two partial vectors (an empty vector is zero).
CombineFn = Callable[[Any, Any], np.ndarray]


@runtime_checkable
class Executor(Protocol):
    """Runs a statistic's per-block partials on other workers and sums them exactly.

    `map_reduce` reads ``source`` (a rollout path, only ``columns``; or a dataset of its
    own kind, with ``spec``; ``steps``: the steps kept), maps every block (a
    ``pyarrow.Table``, spec in its schema metadata) through the picklable ``block_fn``
    and adds the vectors with the picklable ``combine_fn`` (order does not matter).
    Returns (``{None: total}``, spec), or with ``by_step`` (``{step: total}``, spec), a
    ``None`` key for rows without a step; no blocks: an empty dict or vector. Raises
    ``TypeError`` for a source it cannot read or a dataset without ``spec``.
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
    column: object,
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
    if None in parts:
        raise SchemaError(_NO_STEPS)
    return {step: decode(kind, parts[step]) for step in sorted(cast(list[int], list(parts)))}


def _check_by(by_step: object, by_version: object) -> Group | None:
    """The grouping of ``by_step`` / ``by_version`` (None: the total); ``TypeError`` for a
    non-bool, ``ValueError`` for both."""
    for name, flag in (("by_step", by_step), ("by_version", by_version)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name}: expected a bool, found {type(flag).__name__}")
    if by_step and by_version:
        raise ValueError("by_step, by_version: expected one grouping, found both True")
    return "step" if by_step else POLICY_VERSION if by_version else None


def _local_only(by: Group | None, executor: object) -> None:
    """``ValueError`` for a version grouping with an executor (whose map groups by step)."""
    if by == POLICY_VERSION and executor is not None:
        raise ValueError(
            "by_version: groups local sources (executor=None), found an executor; an "
            "executor's partials are per step"
        )


def _counts(
    by: Group | None,
    source: Any,
    tokens: Any,
    steps: Sequence[int] | None,
    executor: object,
    spec: RouteSpec | None,
    max_memory: int | None,
    validate: bool,
    column: object,
    layers: Sequence[int] | None,
) -> Any:
    """`expert_counts`, or per step (`expert_counts_by_step`) or policy version: one path."""
    _local_only(by, executor)
    if ex := _check_executor(executor, spec, max_memory, validate, layers):
        return _mapped(ex, source, "counts", tokens, None, spec, steps, by == "step", column)
    parts = count_parts(source, tokens, steps, max_memory, validate, column, layers, by or "step")
    if by is None:
        return sum_parts(parts, source, None, ExpertCounts.empty)
    return sum_by_step(parts)


def _agreement(
    by: Group | None,
    a: Any,
    b: Any,
    local_spec: RouteSpec | None,
    tokens: Any,
    steps: Sequence[int] | None,
    executor: object,
    spec: RouteSpec | None,
    max_memory: int | None,
    validate: bool,
    layers: Sequence[int] | None,
) -> Any:
    """`route_agreement`, or with ``by_step`` `route_agreement_by_step`: one code path.

    ``spec``: an executor's dataset spec; ``local_spec``: the spec of local numpy inputs.
    """
    _local_only(by, executor)
    if ex := _check_executor(executor, spec, max_memory, validate, layers):
        if not isinstance(b, str):
            raise TypeError(
                f"route_agreement with an executor: expected b to name a routes column, "
                f"found {type(b).__name__}"
            )
        return _mapped(ex, a, "agreement", tokens, b, spec, steps, by == "step", "routes")
    wanted = check_layers(layers)
    parts = agreement_parts(
        a, b, local_spec, tokens, steps, max_memory, validate, wanted, by or "step"
    )
    if by is None:
        return sum_parts(parts, a, local_spec, RouteAgreement.empty)
    return sum_by_step(parts)


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

    ``source``: a table or record batch, a file or a root; with an ``executor`` (e.g.
    `r3arrow.ray.RayExecutor()`, same integers) a path or the executor's dataset (e.g.
    `r3arrow.ray.rollout_dataset`, then ``spec`` is required). ``tokens``: the subset
    (`TokenSubset`); ``steps``: the steps to include. Local streaming settings
    (``executor=None`` only, else ``ValueError``): ``max_memory``, the budget in bytes of
    a streamed path (default 1 GiB; the counts do not depend on it); ``validate=True``
    adds the row checks of `r3arrow.io.read_rollouts` (footers, row-group digests or
    page checksums, and the ``num_experts`` range, `ExpertRangeError`, are always
    checked); ``layers``: the
    global layer ids to count (None: every router layer; a path reads only those, a
    table is projected in memory; dense ones are skipped). ``column``: the routes column
    counted (e.g. ``"train_routes"``, ``docs/train-routes.md``); the token subsets still
    come from ``prompt_ids`` / ``response_ids`` / ``loss_mask``.

    Raises ``ValueError`` for ``layers`` outside ``[0, num_layers)`` or only dense,
    ``TypeError`` for an ``executor`` that is not an `Executor` or a ``spec`` without
    one, `RouteShapeError` for layers a projected source lacks, `SchemaError` for
    missing columns, steps or files.
    """
    total = _counts(
        None, source, tokens, steps, executor, spec, max_memory, validate, column, layers
    )
    return cast(ExpertCounts, total)


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
    per = _counts(
        "step", source, tokens, steps, executor, spec, max_memory, validate, column, layers
    )
    return cast(dict[int, ExpertCounts], per)


def expert_load(
    source: Any,
    *,
    tokens: TokenSubset = "all",
    steps: Sequence[int] | None = None,
    by_step: bool = False,
    by_version: bool = False,
    executor: Executor | None = None,
    spec: RouteSpec | None = None,
    max_memory: int | None = None,
    validate: bool = False,
    column: str = "routes",
    layers: Sequence[int] | None = None,
) -> pl.DataFrame:
    """Routed-token count per MoE layer and expert: columns ``layer``, ``expert``, ``tokens``.

    ``layer`` (Int32, global id; dense layers absent), ``expert`` (Int32), ``tokens``
    (Int64; zero-count experts included, so each layer has ``num_experts`` rows summing to
    ``topk × tokens``), sorted by (layer, expert); with ``by_step``, a leading ``step``
    (Int64) column; with ``by_version`` (``executor=None`` only, else ``ValueError``; not
    with ``by_step``), a leading ``policy_version`` (Int64) column, versions ascending
    (`SchemaError` for a source without the column; ``docs/versions.md``). Other arguments
    as `expert_counts`.
    """
    by = _check_by(by_step, by_version)
    args = (tokens, steps, executor, spec, max_memory, validate, column, layers)
    counts = _counts(by, source, *args)
    if by is None:
        return cast(ExpertCounts, counts).to_polars()
    if by == POLICY_VERSION and not counts:
        raise SchemaError("by version: expected at least one row, found none")
    stacked = stack_steps({s: c.to_polars() for s, c in counts.items()})
    return stacked if by == "step" else stacked.rename({"step": POLICY_VERSION})


@overload
def route_agreement(
    a: Any,
    b: Any,
    spec: RouteSpec | None = None,
    *,
    tokens: TokenSubset | np.ndarray = "all",
    steps: Sequence[int] | None = None,
    by_version: Literal[False] = False,
    executor: Executor | None = None,
    max_memory: int | None = None,
    validate: bool = False,
    layers: Sequence[int] | None = None,
) -> RouteAgreement: ...
@overload
def route_agreement(
    a: Any,
    b: Any,
    spec: RouteSpec | None = None,
    *,
    tokens: TokenSubset | np.ndarray = "all",
    steps: Sequence[int] | None = None,
    by_version: Literal[True],
    executor: Executor | None = None,
    max_memory: int | None = None,
    validate: bool = False,
    layers: Sequence[int] | None = None,
) -> dict[int, RouteAgreement]: ...
def route_agreement(
    a: Any,
    b: Any,
    spec: RouteSpec | None = None,
    *,
    tokens: TokenSubset | np.ndarray = "all",
    steps: Sequence[int] | None = None,
    by_version: bool = False,
    executor: Executor | None = None,
    max_memory: int | None = None,
    validate: bool = False,
    layers: Sequence[int] | None = None,
) -> RouteAgreement | dict[int, RouteAgreement]:
    """Agreement between two route sets for the same tokens, order within top-k ignored.

    ``a`` / ``b``: two numpy ``[T, L, K]`` arrays (``spec`` optional, ``tokens`` an
    optional bool ``[T]``); a rollout table and a table of the same trajectories, an
    aligned ``[T, L, K]`` array, or the name of a second routes column in it; or a Parquet
    file / step root and such a column name. With an ``executor`` (as `expert_counts`):
    a path or the executor's dataset (with ``spec``) and a column name. ``max_memory``,
    ``validate``: as `expert_counts` (repeated ids within a top-k set always raise);
    ``layers``: the global layer ids compared (a table or path ``a`` and a column name
    ``b``), ``all_identical`` then over those. Returns exact counts (`RouteAgreement`;
    `RouteAgreement.summary` gives the R3 paper's quantities). ``by_version=True``:
    ``{policy_version: RouteAgreement}`` ascending, for a table or path ``a`` with a
    ``policy_version`` column (else `SchemaError`) and a column name ``b`` (else
    ``TypeError``), ``executor=None`` only (else ``ValueError``; ``docs/versions.md``).
    """
    by = _check_by(False, by_version)
    local, mapped = (spec, None) if executor is None else (None, spec)
    per = _agreement(by, a, b, local, tokens, steps, executor, mapped, max_memory, validate, layers)
    return cast("RouteAgreement | dict[int, RouteAgreement]", per)


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
    per = _agreement(
        "step", source, other, None, tokens, steps, executor, spec, max_memory, validate, layers
    )
    return cast(dict[int, RouteAgreement], per)


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
