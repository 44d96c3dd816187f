"""collate_directory: a step root collated per (DP rank, PP stage), streamed by row group.

Every case compares with the in-memory path: each step read whole with read_rollouts,
split with split_microbatches (same DP plan) and collated by the same collator.
"""

from __future__ import annotations

import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from r3arrow.errors import R3ArrowError, SchemaError
from r3arrow.io import read_rollouts, write_rollouts
from r3arrow.microbatch import padding_table, split_microbatches
from r3arrow.spec import RouteSpec
from r3arrow.table import route_layers, take_rows
from r3arrow.testing import random_rollouts

collate = pytest.importorskip("r3arrow.collate", reason="torch is not installed")
import r3arrow._plan as _plan  # noqa: E402
from r3arrow._plan import plan_contiguous, plan_steps, read_share  # noqa: E402
from r3arrow.collate import MegatronCollator, Microbatch, collate_directory  # noqa: E402

SPEC = RouteSpec(num_layers=8, topk=2, num_experts=16, moe_layers=tuple(range(1, 8)))
STAGE = (3, 4, 5)  # PP stage 2 of 3 of the router layers 1..7 (not contiguous with 0)
FIELDS = ("input_ids", "position_ids", "labels", "loss_mask", "padding_mask", "layer_major")


def _shapes(rng: np.random.Generator, n: int) -> list[tuple[int, int, int]]:
    out = []
    for _ in range(n):
        p, r = int(rng.integers(1, 12)), int(rng.integers(1, 30))
        out.append((p, r, int(rng.integers(0, p + r + 1))))
    return out


def _write_root(root: Path, seed: int, steps: Sequence[int], rows: int, group_rows: int) -> None:
    """Each step in two parts, small row groups; the second part from a multi-chunk table."""
    rng = np.random.default_rng(seed)
    for step in steps:
        t = random_rollouts(rng, SPEC, _shapes(rng, rows), tag=f"s{step}")
        half = rows // 2
        write_rollouts(t.slice(0, half), root, step=step, row_group_rows=group_rows)
        chunked = pa.concat_tables(
            [t.slice(half, 2), t.slice(half + 2)]
        )  # multi-chunk routes column
        assert chunked.column("routes").num_chunks == 2
        write_rollouts(chunked, root, step=step, row_group_rows=group_rows)


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("collate_dir")
    _write_root(path, 7, (0, 3, 4), rows=11, group_rows=3)
    return path


def _expected(
    root: Path, collator: MegatronCollator, dp_size: int, dp_rank: int, **plan: int
) -> list[tuple[int, Microbatch]]:
    out = []
    steps: list[int] = read_rollouts(root, columns=["trajectory_id", "step"])["step"].to_pylist()  # type: ignore[assignment]
    for step in sorted(set(steps)):
        table = read_rollouts(root, steps=[step])
        parts = split_microbatches(
            table,
            multiple=collator.multiple,
            packed=collator.packed,
            dp_size=dp_size,
            dp_rank=dp_rank if dp_size > 1 else None,
            **plan,
        )
        out += [(step, collator(part)) for part in parts]
    return out


def _assert_same(got: list[tuple[int | None, Microbatch]], want: list[tuple[int, Microbatch]]):  # type: ignore[no-untyped-def]
    assert [s for s, _ in got] == [s for s, _ in want]
    for (_, a), (_, b) in zip(got, want, strict=True):
        assert a.is_padding == b.is_padding
        assert a.layers == b.layers
        np.testing.assert_array_equal(a.seq_lens, b.seq_lens)
        np.testing.assert_array_equal(a.captured, b.captured)
        for name in FIELDS:
            x, y = getattr(a, name), getattr(b, name)
            np.testing.assert_array_equal(x.numpy(), y.numpy(), err_msg=name)


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize(("dp_size", "max_memory"), [(1, 1 << 30), (3, 1 << 30), (3, 1)])
def test_equals_in_memory_split_and_collate(
    root: Path, packed: bool, dp_size: int, max_memory: int
) -> None:
    """dp_assign="balanced": every rank's microbatches == collator(split_microbatches(step)),
    tiny budgets too."""
    collator = MegatronCollator(SPEC, layers=STAGE, packed=packed, align=4)
    for rank in range(dp_size):
        got = list(
            collate_directory(
                root,
                collator,
                dp_size=dp_size,
                dp_rank=rank,
                max_tokens=96,
                max_memory=max_memory,
                dp_assign="balanced",
            )
        )
        _assert_same(got, _expected(root, collator, dp_size, rank, max_tokens=96))


def test_ranks_partition_each_step_with_equal_counts(root: Path) -> None:
    spec, plans = plan_steps(root, dp_size=4, num_microbatches=2, multiple=4)
    assert spec == SPEC
    whole = read_rollouts(root)
    for plan in plans:
        ids: list[Any] = []
        counts = set()
        for rank in range(4):
            share = list(read_share(plan, rank, layers=STAGE, spec=spec, max_memory=256))
            assert [j for j, _ in share] == list(range(plan.num_microbatches))
            counts.add(len(share))
            ids += [i for _, t in share for i in t.column("trajectory_id").to_pylist()]
            assert {route_layers(t) for _, t in share} == {STAGE}  # only the stage was read
        tids: list[Any] = whole.column("trajectory_id").to_pylist()
        step_ids = [
            i for i, s in zip(tids, whole.column("step").to_pylist(), strict=True) if s == plan.step
        ]
        padding = [i for i in ids if i == "__r3arrow_padding__"]
        real = [i for i in ids if i != "__r3arrow_padding__"]
        assert sorted(real) == sorted(step_ids)  # every trajectory once, no duplicates
        assert len(counts) == 1 and plan.num_microbatches >= 2
        assert len(padding) == 4 * plan.num_microbatches - sum(
            1 for rank in plan.microbatches for m in rank if m.size
        )


def test_steps_and_single_file(root: Path) -> None:
    collator = MegatronCollator(SPEC, packed=True)
    got = list(collate_directory(root, collator, steps=[3], num_microbatches=2))
    assert [s for s, _ in got] == [3, 3]
    one = sorted((root / "step=4").glob("*.parquet"))[1]
    got_file = list(collate_directory(one, collator, num_microbatches=1))
    want = collator(read_rollouts(one))
    assert [s for s, _ in got_file] == [None]
    np.testing.assert_array_equal(got_file[0][1].layer_major.numpy(), want.layer_major.numpy())  # type: ignore[union-attr]


def test_argument_misuse_raises_at_call_time(root: Path) -> None:
    collator = MegatronCollator(SPEC, packed=True)
    with pytest.raises(TypeError, match="MegatronCollator"):
        collate_directory(root, object(), max_tokens=64)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="spec"):
        collate_directory(root, MegatronCollator(None), max_tokens=64)
    with pytest.raises(ValueError, match="dp_rank"):
        collate_directory(root, collator, dp_size=2, dp_rank=2, max_tokens=64)
    with pytest.raises(ValueError, match="neither"):
        collate_directory(root, collator)
    with pytest.raises(ValueError, match="max_memory"):
        collate_directory(root, collator, max_tokens=64, max_memory=0)
    with pytest.raises(FileNotFoundError):
        collate_directory(root / "missing", collator, max_tokens=64)


def test_bad_data_raises_structured_errors(root: Path, tmp_path: Path) -> None:
    collator = MegatronCollator(SPEC, packed=True)
    with pytest.raises(SchemaError, match="budget"):  # a trajectory alone over max_tokens
        list(collate_directory(root, collator, max_tokens=4))
    bad = tmp_path / "bad"
    _write_root(bad, 3, (1,), rows=4, group_rows=2)
    part = sorted((bad / "step=1").glob("*.parquet"))[0]
    data = bytearray(part.read_bytes())
    group = pq.ParquetFile(part).metadata.row_group(0)
    chunk = [  # the last routes column chunk: layer 7, read by every collator here
        group.column(c)
        for c in range(group.num_columns)
        if group.column(c).path_in_schema.startswith("routes")
    ][-1]
    data[chunk.data_page_offset + chunk.total_compressed_size - 3] ^= 0xFF  # page checksum
    part.write_bytes(bytes(data))
    with pytest.raises(R3ArrowError) as info:
        list(collate_directory(bad, collator, max_tokens=256))
    assert info.value.path is not None


def test_file_changed_after_planning(tmp_path: Path) -> None:
    _write_root(tmp_path, 5, (2,), rows=6, group_rows=2)
    spec, plans = plan_steps(tmp_path, num_microbatches=1)
    plan = next(plans)
    first = Path(plan.groups[0].path)
    rng = np.random.default_rng(0)
    write_rollouts(random_rollouts(rng, SPEC, _shapes(rng, 5)), first, row_group_rows=5)
    with pytest.raises(SchemaError, match="planned") as info:
        list(read_share(plan, 0, spec=spec))
    assert info.value.path is not None


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**16),
    rows=st.integers(1, 9),
    group_rows=st.integers(1, 4),
    dp_size=st.integers(1, 4),
    microbatches=st.integers(1, 3),
    budget=st.sampled_from([1, 300, 1 << 20]),
)
def test_property_equals_in_memory(
    seed: int, rows: int, group_rows: int, dp_size: int, microbatches: int, budget: int
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp)
        _write_root(path, seed, (0,), rows=max(rows, 3), group_rows=group_rows)
        collator = MegatronCollator(SPEC, layers=(1, 7), packed=True, align=2)
        n = min(microbatches, max(rows, 3))
        for rank in range(dp_size):
            got = list(
                collate_directory(
                    path,
                    collator,
                    dp_size=dp_size,
                    dp_rank=rank,
                    num_microbatches=n,
                    max_memory=budget,
                    dp_assign="balanced",
                )
            )
            _assert_same(got, _expected(path, collator, dp_size, rank, num_microbatches=n))


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(1, 50), min_size=1, max_size=30),
    dp_size=st.integers(1, 5),
    microbatches=st.integers(1, 4),
    multiple=st.sampled_from([1, 4]),
)
def test_plan_contiguous_partitions_rows_in_ranges(
    lengths: list[int], dp_size: int, microbatches: int, multiple: int
) -> None:
    n = np.asarray(lengths, dtype=np.int64)
    bins = min(microbatches, n.size)
    plan = plan_contiguous(n, dp_size=dp_size, num_microbatches=bins, multiple=multiple)
    assert len(plan) == dp_size
    assert len({len(rank) for rank in plan}) == 1 and len(plan[0]) >= bins
    ranks = [np.sort(np.concatenate([m for m in rank] or [np.zeros(0, np.int64)])) for rank in plan]
    np.testing.assert_array_equal(np.sort(np.concatenate(ranks)), np.arange(n.size))
    cost = -(-n // multiple) * multiple
    for rank, rows in enumerate(ranks):
        if rows.size:  # a contiguous range, ranks in row order
            np.testing.assert_array_equal(rows, np.arange(rows[0], rows[-1] + 1))
            assert all(r.size == 0 or r[0] > rows[-1] for r in ranks[rank + 1 :])
        # balanced to within one trajectory's cost
        assert abs(int(cost[rows].sum()) - cost.sum() / dp_size) <= int(cost.max())
        real = [m for m in plan[rank] if m.size]
        assert all(not m.size for m in plan[rank][len(real) :])  # padding last


def test_contiguous_ranks_read_only_their_row_groups(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads: list[tuple[str, int]] = []
    real_read = _plan._read

    def counting(ref: Any, *args: Any) -> Any:
        reads.append((ref.path, ref.row_group))
        return real_read(ref, *args)

    monkeypatch.setattr(_plan, "_read", counting)
    collator = MegatronCollator(SPEC, layers=STAGE, packed=True, align=4)
    _, plans = plan_steps(root, steps=[0], dp_size=2, max_tokens=96, multiple=4)
    groups = len(next(plans).groups)
    for rank in range(2):
        reads.clear()
        got = list(
            collate_directory(
                root,
                collator,
                steps=[0],
                dp_size=2,
                dp_rank=rank,
                max_tokens=96,
            )  # the default: dp_assign="contiguous"
        )
        assert len(set(reads)) < groups  # not every row group: only the rank's range
        table = read_rollouts(root, steps=[0])
        _, plans = plan_steps(
            root, steps=[0], dp_size=2, max_tokens=96, multiple=4, dp_assign="contiguous"
        )
        mine = next(plans).microbatches[rank]
        assert len(got) == len(mine)
        for (_, mb), rows in zip(got, mine, strict=True):
            want = collator(take_rows(table, rows) if rows.size else padding_table(table))
            _assert_same([(0, mb)], [(0, want)])
    with pytest.raises(ValueError, match="dp_assign"):
        collate_directory(root, collator, max_tokens=96, dp_assign="random")  # type: ignore[arg-type]


@pytest.mark.parametrize("budget", [1, 3000, 1 << 30])
def test_waves_hold_at_most_the_budget(root: Path, budget: int) -> None:
    """A wave of several microbatches holds at most ``budget`` bytes of taken rows."""
    spec, plans = plan_steps(root, dp_size=2, max_tokens=40, multiple=4, dp_assign="balanced")
    shared = 0  # waves of several microbatches seen
    for plan in plans:
        for rank in range(2):
            loaders = _plan._wave_loaders(plan, rank, list(STAGE), spec, budget, True)
            waves = [load() for _, load in loaders]
            assert [j for w in waves for j in w.js] == list(range(plan.num_microbatches))
            for wave in waves:
                held = sum(p.nbytes for p in wave.pieces)
                if budget == 1:
                    assert len(wave.js) == 1  # every microbatch its own wave
                elif len(wave.js) > 1:
                    assert held <= budget
                    shared += 1
            if budget == 1 << 30:
                assert len(waves) == 1  # a step's share fits: one read of each row group
    assert budget == 1 or shared > 0
