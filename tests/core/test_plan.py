"""r3arrow._plan without torch: the share planner/reader and its budgeted read-ahead.

The collated equality with the in-memory path is in
tests/integrations/test_collate_directory.py; here: the core pieces a Ray read task uses
(no torch import), the share of a rank equals the plan's rows read whole, and
`read_ahead` overlaps a read only when both items fit the budget.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from r3arrow._plan import DpAssign, plan_contiguous, plan_steps, read_ahead, read_share
from r3arrow.io import read_rollouts, write_rollouts
from r3arrow.microbatch import is_padding_table
from r3arrow.spec import RouteSpec
from r3arrow.table import route_layers, take_rows
from r3arrow.testing import random_rollouts

SPEC = RouteSpec(num_layers=6, topk=2, num_experts=8)
STAGE = (2, 3)


def test_planner_and_ray_import_no_torch() -> None:
    code = (
        "import sys, r3arrow._plan, r3arrow.ray; "
        "bad = [m for m in ('torch', 'ray') if m in sys.modules]; "
        "assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("plan")
    rng = np.random.default_rng(3)
    for step in (1, 2):
        shapes = [(int(p), int(r), int(p + r - 1)) for p, r in rng.integers(1, 20, size=(9, 2))]
        t = random_rollouts(rng, SPEC, shapes, tag=f"s{step}")
        write_rollouts(t.slice(0, 4), path, step=step, row_group_rows=2)
        chunked = pa.concat_tables([t.slice(4, 2), t.slice(6)])  # multi-chunk routes
        write_rollouts(chunked, path, step=step, row_group_rows=2)
    return path


@pytest.mark.parametrize("assign", ["balanced", "contiguous"])
@pytest.mark.parametrize("budget", [1, 1 << 30])
def test_share_is_the_planned_rows_of_the_stage(root: Path, assign: DpAssign, budget: int) -> None:
    spec, plans = plan_steps(root, dp_size=2, max_tokens=64, multiple=4, dp_assign=assign)
    assert spec == SPEC
    for plan in plans:
        assert plan.step is not None
        whole = read_rollouts(root, steps=[plan.step], layers=list(STAGE))
        for rank in range(2):
            share = list(read_share(plan, rank, layers=STAGE, spec=spec, max_memory=budget))
            assert [j for j, _ in share] == list(range(plan.num_microbatches))
            for (_, table), rows in zip(share, plan.microbatches[rank], strict=True):
                if not rows.size:
                    assert is_padding_table(table)
                    continue
                assert route_layers(table) == STAGE
                want = take_rows(whole, rows)
                assert table.column("routes").to_pylist() == want.column("routes").to_pylist()
                ids = table.column("trajectory_id").to_pylist()
                assert ids == want.column("trajectory_id").to_pylist()


def _loaders(
    sizes: list[int], log: list[tuple[str, int]], lock: threading.Lock
) -> Iterator[tuple[int, Callable[[], int]]]:
    def load(i: int) -> int:
        with lock:
            log.append(("load", i))
        return i

    for i, size in enumerate(sizes):
        yield size, lambda i=i: load(i)  # type: ignore[misc]


@pytest.mark.parametrize("sizes", [[4, 4, 4], [6, 6, 6], [2, 9, 2, 2], [11, 1]])
def test_read_ahead_overlaps_only_within_the_budget(sizes: list[int]) -> None:
    budget = 10
    log: list[tuple[str, int]] = []
    lock = threading.Lock()
    got = []
    for item in read_ahead(_loaders(sizes, log, lock), budget):
        time.sleep(0.01)  # a read wrongly started beside this item would log first
        with lock:
            log.append(("done", item))
        got.append(item)
    assert got == list(range(len(sizes)))
    for i in range(len(sizes) - 1):
        if sizes[i] + sizes[i + 1] > budget:  # never both resident: read after the first went
            assert log.index(("load", i + 1)) > log.index(("done", i))


def test_read_ahead_reads_the_next_while_the_caller_works() -> None:
    started = threading.Event()

    def second() -> int:
        started.set()
        return 1

    def loaders() -> Iterator[tuple[int, Callable[[], int]]]:
        yield 1, lambda: 0
        yield 1, second

    it = read_ahead(loaders(), 10)
    assert next(it) == 0
    assert started.wait(10)  # the second read ran while the first item was held
    assert list(it) == [1]


def test_read_ahead_surfaces_errors_in_order() -> None:
    def boom() -> int:
        raise ValueError("bad wave")

    it = read_ahead(iter([(1, lambda: 0), (1, boom)]), 10)
    assert next(it) == 0
    with pytest.raises(ValueError, match="bad wave"):
        next(it)


def test_contiguous_boundaries_move_to_row_group_starts_within_the_balance_bound() -> None:
    # costs 4 1 1 | 4 4 (ideal 7 each): the midpoint rule cuts before row 3, inside the row
    # group of rows 2..4; its start (5 before it, 2 from 7 = half the largest cost) is taken
    n = np.asarray([4, 1, 1, 4, 4])
    plain = plan_contiguous(n, dp_size=2, num_microbatches=1)
    assert [r[0].tolist() for r in plain] == [[0, 1, 2], [3, 4]]
    snapped = plan_contiguous(n, dp_size=2, num_microbatches=1, group_starts=[0, 2])
    assert [r[0].tolist() for r in snapped] == [[0, 1], [2, 3, 4]]
    # a start too far from the even share (1 before it) is not taken
    far = plan_contiguous(n, dp_size=2, num_microbatches=1, group_starts=[0, 1])
    assert [r[0].tolist() for r in far] == [[0, 1, 2], [3, 4]]
    with pytest.raises(ValueError, match="group_starts"):
        plan_contiguous(n, dp_size=2, num_microbatches=1, group_starts=[6])


@settings(max_examples=200, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 50), min_size=1, max_size=40),
    dp_size=st.integers(1, 5),
    cuts=st.lists(st.integers(0, 40), max_size=10),
)
def test_snapped_contiguous_plan_stays_balanced_and_contiguous(
    lengths: list[int], dp_size: int, cuts: list[int]
) -> None:
    n = np.asarray(lengths, dtype=np.int64)
    starts = sorted({0, *(c for c in cuts if c <= n.size)})
    plan = plan_contiguous(n, dp_size=dp_size, num_microbatches=1, group_starts=starts)
    ranks = [np.sort(np.concatenate([m for m in rank])) for rank in plan]
    np.testing.assert_array_equal(np.sort(np.concatenate(ranks)), np.arange(n.size))
    for rank, rows in enumerate(ranks):
        if rows.size:
            np.testing.assert_array_equal(rows, np.arange(rows[0], rows[-1] + 1))
            assert all(r.size == 0 or r[0] > rows[-1] for r in ranks[rank + 1 :])
        assert abs(int(n[rows].sum()) - n.sum() / dp_size) <= int(n.max())
