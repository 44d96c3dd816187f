"""Test support for r3arrow and for code built on it.

Route generators, table builders and assertions here are plain numpy/pyarrow (no test
framework needed); hypothesis strategies live in :mod:`r3arrow.testing.strategies`
(needs ``hypothesis``, imported only there).

* `random_routes`: valid ``[rows, L, K]`` routes for a spec.
* `random_rollouts`: a valid rollout table from per-trajectory shapes.
* `assert_rollouts_equal`: schema, spec and every column exactly equal.
* `use_backend`: run a block on the numba or the numpy kernels (the one test seam).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import pyarrow as pa

from r3arrow import _kernels
from r3arrow._checks import check_positive_int
from r3arrow._typing import TableLike
from r3arrow.spec import SPEC_METADATA_KEY, RouteSpec
from r3arrow.table import rollout_table


def random_routes(
    rng: np.random.Generator,
    rows: int,
    spec: RouteSpec,
    *,
    num_experts: int | None = None,
    dtype: Any = None,
) -> np.ndarray:
    """Valid routes ``[rows, L, K]``: distinct ids in ``[0, E)`` on router layers, zeros elsewhere.

    ``E`` is ``num_experts`` if given, else ``spec.num_experts`` (else 256); the dtype is
    ``dtype`` if given, else ``spec.dtype`` (it must hold ``E - 1``).
    """
    e = num_experts if num_experts is not None else (spec.num_experts or 256)
    dt = np.dtype(dtype) if dtype is not None else spec.dtype
    out = np.zeros((rows, spec.num_layers, spec.topk), dtype=dt)
    layers = list(spec.router_layers)
    if rows == 0:
        return out
    if rows * len(layers) * e <= 4_000_000:
        # K distinct ids per (token, layer): the first K of a random permutation.
        ids = np.argsort(rng.random((rows, len(layers), e)), axis=-1)[..., : spec.topk]
    else:
        # Large sizes: a random start plus K fixed distinct offsets, modulo E (offsets drawn
        # without a full permutation when E is huge: int32 specs allow E near 2**31).
        starts = rng.integers(0, e, size=(rows, len(layers), 1))
        offsets = (
            rng.permutation(e)[: spec.topk]
            if e <= 1 << 20
            else rng.choice(e, size=spec.topk, replace=False)
        )
        ids = (starts + offsets) % e
    out[:, layers, :] = ids.astype(dt)
    return out


def random_rollouts(
    rng: np.random.Generator,
    spec: RouteSpec,
    shapes: Sequence[tuple[int, int, int]],
    *,
    tag: str = "t",
    group_size: int = 2,
    **extra: Any,
) -> pa.Table:
    """A valid rollout table, one row per ``(prompt_len, response_len, captured)`` in ``shapes``.

    ``captured`` must be at most ``prompt_len + response_len``. Response tokens whose
    predicting row is missing (the terminal gap, docs/design.md §2) get loss mask 0, the
    others a random 0/1; trajectory ``i`` is ``{tag}-{i}`` in group ``g{i // group_size}``;
    ``reward`` is uniform in ``[0, 1)``. Extra keyword columns are passed to
    `r3arrow.rollout_table`. Raises ValueError on an impossible shape.
    """
    check_positive_int(group_size, "group_size")
    masks = []
    for i, (p, r, c) in enumerate(shapes):
        if min(p, r, c) < 0 or c > p + r:
            raise ValueError(
                f"shapes[{i}]: expected 0 <= captured <= prompt + response, found {(p, r, c)}"
            )
        m = rng.integers(0, 2, r).astype(np.uint8)
        m[p + np.arange(r) > c] = 0  # target p+j needs row p+j-1 < captured
        masks.append(m)
    b = len(shapes)
    return rollout_table(
        trajectory_id=[f"{tag}-{i}" for i in range(b)],
        group_id=[f"g{i // group_size}" for i in range(b)],
        prompt_ids=[rng.integers(0, 50_000, p).astype(np.int32).tolist() for p, _, _ in shapes],
        response_ids=[rng.integers(0, 50_000, r).astype(np.int32).tolist() for _, r, _ in shapes],
        loss_mask=[m.tolist() for m in masks],
        reward=rng.random(b),
        routes=[random_routes(rng, c, spec) for _, _, c in shapes],
        spec=spec,
        **extra,
    )


def _as_table(t: TableLike) -> pa.Table:
    return pa.Table.from_batches([t]) if isinstance(t, pa.RecordBatch) else t


def _first_difference(a: pa.ChunkedArray[Any], b: pa.ChunkedArray[Any]) -> str:
    for i, (x, y) in enumerate(zip(a.to_pylist(), b.to_pylist(), strict=True)):
        if x != y:
            return f"first difference at row {i}: {x!r:.200} != {y!r:.200}"
    return "values compare equal as Python objects but differ in Arrow (e.g. NaN or nulls)"


def assert_rollouts_equal(a: TableLike, b: TableLike) -> None:
    """Assert two rollout tables are exactly equal; raise AssertionError saying where not.

    Checks, in order: the `RouteSpec` stored in the metadata, the schema (names, types,
    nullability, field and schema metadata), the row count, and every column value by value
    (chunk layout does not matter). Record batches are compared as one-batch tables.
    """
    ta, tb = _as_table(a), _as_table(b)
    has_a = SPEC_METADATA_KEY in (ta.schema.metadata or {})
    has_b = SPEC_METADATA_KEY in (tb.schema.metadata or {})
    if has_a != has_b:
        raise AssertionError(f"only one table carries a spec: {has_a} != {has_b}")
    if has_a:
        spec_a, spec_b = RouteSpec.from_schema(ta.schema), RouteSpec.from_schema(tb.schema)
        if spec_a != spec_b:
            raise AssertionError(f"specs differ: {spec_a} != {spec_b}")
    if not ta.schema.equals(tb.schema, check_metadata=True):
        raise AssertionError(f"schemas differ:\n{ta.schema}\n!=\n{tb.schema}")
    if ta.num_rows != tb.num_rows:
        raise AssertionError(f"row counts differ: {ta.num_rows} != {tb.num_rows}")
    for name in ta.schema.names:
        col_a, col_b = ta.column(name), tb.column(name)
        if not col_a.equals(col_b):
            raise AssertionError(f"column {name!r} differs: {_first_difference(col_a, col_b)}")


@contextmanager
def use_backend(name: _kernels.Backend) -> Iterator[None]:
    """Run the block with r3arrow's kernels on ``name``: ``"numba"`` or ``"numpy"``.

    The one test seam for the backend (`r3arrow._kernels`): every accelerated path (id
    checks, fused collation, statistics, interleave, replay probe) follows it; the previous
    choice comes back on exit. Outside tests the documented switch is the environment variable
    ``R3ARROW_NO_NUMBA=1`` (read once per process). ``"numba"`` raises ImportError when numba
    is not installed (tests: ``pytest.importorskip("numba")`` first).
    """
    if name not in ("numba", "numpy"):
        raise ValueError(f"use_backend: expected 'numba' or 'numpy', found {name!r}")
    try:
        previous = _kernels.set_backend(name)
    except ImportError as exc:
        raise ImportError(f"use_backend('numba'): numba is not installed ({exc})") from exc
    try:
        yield
    finally:
        _kernels.restore(previous)


__all__ = ["assert_rollouts_equal", "random_rollouts", "random_routes", "use_backend"]
