"""Streaming reads under a memory budget (r3arrow.io._stream, memory budget; docs/storage.md).

Real Parquet files larger than a tiny budget: the pieces stay within it, the Arrow
allocations at every yield stay bounded, and the pieces put together are exactly
what `read_rollouts` returns. Writers cut row groups by bytes.
"""

from __future__ import annotations

import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from r3arrow.io import (
    DEFAULT_MAX_MEMORY,
    iter_rollouts,
    read_rollouts,
    rollout_files,
    write_rollouts,
)
from r3arrow.io._stream import row_group_bounds
from r3arrow.spec import RouteSpec
from r3arrow.testing import assert_rollouts_equal, random_rollouts

SPEC = RouteSpec(num_layers=16, topk=8, num_experts=128, moe_layers=tuple(range(1, 16)))
MB = 1 << 20


def _big(seed: int, rows: int = 40, tokens: int = 512) -> pa.Table:
    """About rows × tokens × 128 bytes of routes (40 × 512: 2.6 MB)."""
    shapes = [(64, tokens - 64, tokens)] * rows
    return random_rollouts(np.random.default_rng(seed), SPEC, shapes, tag=f"s{seed}")


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[int, pa.Table]]:
    """Three steps of ~5 MB routes each (two parts), row groups of ~256 KiB."""
    base = tmp_path_factory.mktemp("root")
    per_step = {}
    for s in (0, 1, 2):
        a, b = _big(10 * s), _big(10 * s + 1)
        write_rollouts(a, base, step=s, row_group_bytes=256 << 10)
        write_rollouts(b, base, step=s, row_group_bytes=256 << 10)
        per_step[s] = pa.concat_tables([a, b])
    return base, per_step


def test_default_budget_is_laptop_sized() -> None:
    assert DEFAULT_MAX_MEMORY == 1 << 30


def test_row_groups_are_cut_by_bytes_and_rows_still_win(tmp_path: Path) -> None:
    table = _big(1)  # ~2.6 MB of routes in 40 rows of ~66 KB
    path = write_rollouts(table, tmp_path / "a.parquet", row_group_bytes=512 << 10)
    md = pq.ParquetFile(path).metadata
    sizes = [md.row_group(g).num_rows for g in range(md.num_row_groups)]
    assert sum(sizes) == 40 and 4 <= len(sizes) <= 6, sizes  # ~2.7 MB / 512 KiB
    assert all(md.row_group(g).total_byte_size <= (512 << 10) + 80_000 for g in range(len(sizes)))
    path = write_rollouts(table, tmp_path / "b.parquet", row_group_rows=7, row_group_bytes=1)
    md = pq.ParquetFile(path).metadata
    assert [md.row_group(g).num_rows for g in range(md.num_row_groups)] == [7] * 5 + [5]
    assert_rollouts_equal(read_rollouts(path), table)
    assert row_group_bounds(table.slice(0, 0), 1) == []
    bounds = row_group_bounds(table, 1)  # a group per row, never empty
    assert bounds == [(i, i + 1) for i in range(40)]


def _step(piece: pa.Table) -> int | None:
    """The one step of a piece (its ``step`` column); ``None`` for a file outside a root."""
    if "step" not in piece.schema.names:
        return None
    steps = {int(s) for s in piece.column("step").to_numpy()}
    assert len(steps) == 1, f"a piece spans steps {sorted(steps)}"
    return steps.pop()


def _pieces(it: Iterator[pa.Table]) -> tuple[list[tuple[int | None, pa.Table]], int]:
    """``(step, piece)`` of the pieces, and the most Arrow memory allocated at any yield."""
    out: list[tuple[int | None, pa.Table]] = []
    peak = 0
    for table in it:
        peak = max(peak, pa.total_allocated_bytes())
        out.append((_step(table), table))
        del table
    return out, peak


def test_streamed_pieces_stay_within_a_tiny_budget(root: tuple[Path, dict[int, pa.Table]]) -> None:
    path, _per_step = root
    budget = 2 * MB  # each step holds ~5.3 MB of routes: more than twice the budget
    base = pa.total_allocated_bytes()
    tracemalloc.start()
    try:
        peak_arrow = 0
        n = 0
        sizes = []
        steps = []
        for table in iter_rollouts(path, max_memory=budget):
            step = _step(table)
            peak_arrow = max(peak_arrow, pa.total_allocated_bytes() - base)
            sizes.append(table.nbytes)
            steps.append(step)
            n += table.num_rows
            del table  # hold one piece at a time, as a streaming consumer does
        _, peak_py = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert n == 3 * 80
    assert steps == sorted(int(s or 0) for s in steps) and set(steps) == {0, 1, 2}
    assert len(sizes) >= 3 * 10  # many pieces per step, never a whole step
    assert max(sizes) <= budget // 4 + 80_000, max(sizes)  # a quarter, + at most one row
    assert peak_arrow <= budget + (256 << 10), peak_arrow  # the budget plus one row group
    assert peak_py <= budget, peak_py  # numpy temporaries (restore, validation) too


def test_streamed_pieces_equal_the_full_read(root: tuple[Path, dict[int, pa.Table]]) -> None:
    path, per_step = root
    pieces = [(_step(t), t) for t in iter_rollouts(path, max_memory=2 * MB)]
    whole = read_rollouts(path)
    assert_rollouts_equal(pa.concat_tables(t for _, t in pieces), whole)
    for s, want in per_step.items():
        got = pa.concat_tables(t for step, t in pieces if step == s)
        assert got.column("step").to_pylist() == [s] * want.num_rows
        assert_rollouts_equal(got.drop_columns(["step"]), want)
    # a step's pieces are consecutive and never span two steps
    order = [s for s, _ in pieces]
    assert order == sorted(int(s or 0) for s in order)
    assert all(set(t.column("step").to_pylist()) == {s} for s, t in pieces)


def test_default_budget_reads_a_small_step_as_one_piece(
    root: tuple[Path, dict[int, pa.Table]],
) -> None:
    path, _per_step = root
    got = [
        (_step(t), t)
        for t in iter_rollouts(path, steps=[1], columns=["trajectory_id", "routes", "step"])
    ]
    assert [s for s, _ in got] == [1]
    assert got[0][1].schema.names == ["trajectory_id", "routes", "step"]
    assert got[0][1].column("routes").num_chunks > 1  # row groups kept as chunks


def test_batch_rows_and_layers_bound_the_pieces(root: tuple[Path, dict[int, pa.Table]]) -> None:
    path, _per_step = root
    got = [(_step(t), t) for t in iter_rollouts(path, steps=[2], batch_rows=7, layers=[0, 1, 2, 3])]
    assert all(t.num_rows <= 7 for _, t in got)
    assert sum(t.num_rows for _, t in got) == 80
    whole = read_rollouts(path, steps=[2], layers=[0, 1, 2, 3])
    assert_rollouts_equal(pa.concat_tables(t for _, t in got), whole)


def test_a_row_group_over_the_budget_is_split(tmp_path: Path) -> None:
    table = _big(5)
    path = write_rollouts(table, tmp_path / "one.parquet", row_group_rows=40)  # one 2.6 MB group
    got = [(_step(t), t) for t in iter_rollouts(path, max_memory=1 * MB)]
    assert len(got) >= 10 and all(s is None for s, _ in got)
    assert max(t.nbytes for _, t in got) <= MB // 4 + 80_000
    assert_rollouts_equal(pa.concat_tables(t for _, t in got), table)


def test_iter_rollouts_over_files_streams_under_the_budget(
    root: tuple[Path, dict[int, pa.Table]],
) -> None:
    path, per_step = root
    files = rollout_files(path, steps=[0, 2])
    got, _ = _pieces(iter_rollouts(files, max_memory=2 * MB, columns=["routes", "step"]))
    assert {s for s, _ in got} == {0, 2} and len(got) > 2
    routes = pa.concat_tables(t for s, t in got if s == 0).column("routes")
    assert routes.to_pylist() == per_step[0].column("routes").to_pylist()


def test_budget_argument_misuse(root: tuple[Path, dict[int, pa.Table]]) -> None:
    path, _ = root
    with pytest.raises(ValueError, match="max_memory"):
        list(iter_rollouts(path, max_memory=0))
    with pytest.raises(TypeError, match="max_memory"):
        list(iter_rollouts(path, max_memory=1.5))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="batch_rows"):
        list(iter_rollouts(path, batch_rows=0))


def test_unbounded_budget_yields_one_piece_per_step(
    root: tuple[Path, dict[int, pa.Table]],
) -> None:
    path, _per_step = root
    got, _ = _pieces(iter_rollouts(path, max_memory=None))
    assert [s for s, _ in got] == [0, 1, 2]


# ------------------------------------------------------------ step alone
def test_reading_only_the_step_column_keeps_every_row(tmp_path: Path) -> None:
    """``columns=["step"]`` reads no file column, yet every row comes back (issue 14, "ray")."""
    tables = {
        s: random_rollouts(np.random.default_rng(s), SPEC, [(3, 2, 4)] * (s + 2)) for s in (0, 2)
    }
    for s, t in tables.items():
        write_rollouts(t, tmp_path, step=s, row_group_rows=1)
    got = read_rollouts(tmp_path, columns=["step"])
    assert got.schema.names == ["step"]
    assert got.column("step").to_pylist() == [0, 0, 2, 2, 2, 2]
    pieces = [(_step(t), t) for t in iter_rollouts(tmp_path, columns=["step"], batch_rows=2)]
    assert [(s, t.column("step").to_pylist()) for s, t in pieces] == [
        (0, [0, 0]),
        (2, [2, 2]),
        (2, [2, 2]),
    ]
    both = read_rollouts(tmp_path, columns=["step", "reward"], steps=[2])
    assert both.schema.names == ["step", "reward"]
    assert both.num_rows == 4
    assert read_rollouts(tmp_path, columns=["step"], steps=[5]).num_rows == 0


def test_default_max_memory_is_exported() -> None:
    assert DEFAULT_MAX_MEMORY == 1 << 30  # imported from r3arrow.io above


def test_read_rollouts_is_the_concatenation_of_iter_rollouts(tmp_path: Path) -> None:
    """Same arguments, same rows: budgeted pieces concatenated equal the whole read."""
    spec = RouteSpec(num_layers=4, topk=2, num_experts=8)
    table = random_rollouts(np.random.default_rng(3), spec, [(5, 4, 9)] * 40)
    write_rollouts(table, tmp_path, step=1)
    write_rollouts(table.slice(0, 7), tmp_path, step=2)
    kw: dict[str, Any] = {"max_memory": 64 << 10, "batch_rows": 7}
    pieces = list(iter_rollouts(tmp_path, **kw))
    assert len(pieces) > 2
    whole = read_rollouts(tmp_path, **kw)
    assert whole.equals(pa.concat_tables(pieces))
    assert whole.equals(read_rollouts(tmp_path))
    assert whole.num_rows == 47
