"""Policy versions and attempts (``docs/versions.md``): the column rules, the
(trajectory_id, attempt) key in a table and across the parts of a step, and `drop_stale`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st

from r3arrow.errors import SchemaError
from r3arrow.io import read_rollouts, write_rollouts
from r3arrow.spec import RouteSpec
from r3arrow.table import drop_stale, filter_rows, rollout_table, validate_rollouts

SPEC = RouteSpec(num_layers=2, topk=2, num_experts=4)


def table(ids: list[str], **extra: Any) -> pa.Table:
    """One-token rollouts of ``ids`` with routes, ``extra`` columns as given."""
    n = len(ids)
    routes = [np.array([[[0, 1], [2, 3]]], np.uint8)] * n
    return rollout_table(
        trajectory_id=ids,
        group_id=["g"] * n,
        prompt_ids=[[1]] * n,
        response_ids=[[2]] * n,
        loss_mask=[[1]] * n,
        reward=[0.0] * n,
        routes=routes,
        spec=SPEC,
        **extra,
    )


def ids_of(t: pa.Table) -> list[str]:
    return [str(v) for v in t.column("trajectory_id").to_pylist()]


# ------------------------------------------------------------------ the table key
def test_two_attempts_of_one_trajectory_coexist() -> None:
    t = table(["a", "a", "b"], attempt=[0, 1, 0], policy_version=[3, 4, 4])
    assert t.column("attempt").type == pa.int64()
    assert t.column("attempt").to_pylist() == [0, 1, 0]
    assert t.column("policy_version").to_pylist() == [3, 4, 4]


def test_the_same_key_twice_names_both_rows() -> None:
    with pytest.raises(SchemaError, match=r"rows 1 and 3: .*\('a', 1\) twice") as info:
        table(["a", "a", "b", "a"], attempt=[0, 1, 0, 1])
    assert (info.value.row, info.value.trajectory_id) == (3, "a")


def test_the_same_key_under_two_versions_is_still_one_attempt() -> None:
    with pytest.raises(SchemaError, match=r"rows 0 and 1: .*\('a', 0\) twice"):
        table(["a", "a"], attempt=[0, 0], policy_version=[1, 2])


def test_without_attempt_repeated_ids_are_not_checked() -> None:
    # Today's rule, unchanged: only the attempt column makes a key.
    assert table(["a", "a"], policy_version=[1, 1]).num_rows == 2


def test_the_first_repeat_is_found_across_chunks() -> None:
    t = pa.concat_tables([table(["x", "y"], attempt=[0, 0]), table(["z", "y"], attempt=[1, 0])])
    with pytest.raises(SchemaError, match=r"rows 1 and 3: .*\('y', 0\) twice") as info:
        validate_rollouts(t)
    assert info.value.row == 3


@given(st.lists(st.tuples(st.sampled_from("abc"), st.integers(0, 2)), min_size=1, max_size=12))
def test_the_key_rule_matches_a_reference(keys: list[tuple[str, int]]) -> None:
    seen: dict[tuple[str, int], int] = {}
    want = None
    for j, k in enumerate(keys):
        if k in seen:
            want = (seen[k], j)
            break
        seen[k] = j
    try:
        table([k[0] for k in keys], attempt=[k[1] for k in keys])
    except SchemaError as exc:
        assert want is not None and exc.row == want[1]
        assert f"rows {want[0]} and {want[1]}:" in str(exc)
    else:
        assert want is None


@pytest.mark.parametrize(
    ("column", "values", "match", "row"),
    [
        ("attempt", pa.array([0, None], pa.int64()), r"'attempt': expected no nulls, found 1", 1),
        ("attempt", pa.array([0, -1], pa.int64()), r"row 1: column 'attempt': .*found -1", 1),
        ("policy_version", pa.array([-2, 0], pa.int64()), r"'policy_version'.*found -2", 0),
        ("attempt", pa.array([0, 1], pa.int32()), r"'attempt': expected int64.*found int32", None),
        ("policy_version", pa.array([0.0, 1.0]), r"expected int64.*found double", None),
    ],
)
def test_column_rules(column: str, values: pa.Array[Any], match: str, row: int | None) -> None:
    with pytest.raises(SchemaError, match=match) as info:
        table(["a", "b"], **{column: values})
    assert info.value.row == row


# ------------------------------------------------------------------- on disk
def test_a_retry_is_a_new_part_and_an_earlier_attempt_is_never_replaced(tmp_path: Path) -> None:
    first = write_rollouts(table(["a", "b"], attempt=[0, 0]), tmp_path, step=3)
    retry = write_rollouts(table(["a"], attempt=[1]), tmp_path, step=3)
    assert (first.name, retry.name) == ("part-00000.parquet", "part-00001.parquet")
    before = first.read_bytes()
    with pytest.raises(SchemaError, match=r"\('b', 0\) \(row 1\) already in this part") as info:
        write_rollouts(table(["c", "b"], attempt=[0, 0]), tmp_path, step=3)
    assert info.value.fields() == {"trajectory_id": "b", "row": 1, "path": str(first)}
    assert first.read_bytes() == before
    assert sorted(p.name for p in (tmp_path / "step=3").iterdir()) == [first.name, retry.name]
    got = read_rollouts(tmp_path)
    assert list(zip(ids_of(got), got.column("attempt").to_pylist(), strict=True)) == [
        ("a", 0),
        ("b", 0),
        ("a", 1),
    ]


def test_the_same_key_in_two_steps_is_two_rows(tmp_path: Path) -> None:
    write_rollouts(table(["a"], attempt=[0]), tmp_path, step=0)
    write_rollouts(table(["a"], attempt=[0]), tmp_path, step=1)
    got = read_rollouts(tmp_path)
    assert got.column("step").to_pylist() == [0, 1]
    # The step is part of a read root's key: one step holding the key twice is refused.
    twice = got.set_column(got.schema.get_field_index("step"), "step", pa.array([1, 1]))
    with pytest.raises(SchemaError, match=r"rows 0 and 1: .* of step 1, found \('a', 0\)"):
        validate_rollouts(twice)


def test_a_step_is_keyed_or_not(tmp_path: Path) -> None:
    old = write_rollouts(table(["a"]), tmp_path, step=0)
    with pytest.raises(SchemaError, match=r"an 'attempt' column or none") as info:
        write_rollouts(table(["b"], attempt=[0]), tmp_path, step=0)
    assert info.value.path == str(old)
    assert len(list((tmp_path / "step=0").iterdir())) == 1


def test_an_existing_part_with_another_attempt_type_is_refused(tmp_path: Path) -> None:
    foreign = tmp_path / "step=0" / "part-00000.parquet"
    foreign.parent.mkdir()
    pq.write_table(
        pa.table({"trajectory_id": ["a"], "attempt": pa.array([0], pa.int32())}), foreign
    )
    with pytest.raises(SchemaError, match=r"'attempt': expected int64, found int32") as info:
        write_rollouts(table(["a"], attempt=[1]), tmp_path, step=0)
    assert info.value.path == str(foreign)


def test_single_files_and_unkeyed_roots_are_unchanged(tmp_path: Path) -> None:
    write_rollouts(table(["a"]), tmp_path, step=0)
    write_rollouts(table(["a"]), tmp_path, step=0)  # no attempt column: no key rule
    assert ids_of(read_rollouts(tmp_path)) == ["a", "a"]


# ---------------------------------------------------------------- drop_stale
def test_drop_stale_keeps_the_age_window() -> None:
    t = table(["a", "b", "c", "d"], policy_version=[7, 5, 10, 8])
    # current 10, max_lag 2: ages 3, 5, 0, 2 -> keep c (0) and d (2), a (3) and b (5) go.
    got = drop_stale(t, current_version=10, max_lag=2)
    assert ids_of(got) == ["c", "d"]
    assert got.schema == t.schema  # every column and the metadata kept
    assert ids_of(drop_stale(t, current_version=10, max_lag=0)) == ["c"]
    validate_rollouts(got)


def test_drop_stale_returns_the_table_itself_when_nothing_is_stale() -> None:
    t = table(["a", "b"], policy_version=[4, 5])
    assert drop_stale(t, current_version=5, max_lag=1) is t
    empty = filter_rows(t, [False, False])
    assert drop_stale(empty, current_version=5, max_lag=0) is empty


def test_drop_stale_errors() -> None:
    t = table(["a", "b"], policy_version=[4, 6])
    with pytest.raises(SchemaError, match=r"row 1: policy_version: expected at most .*5, found 6"):
        drop_stale(t, current_version=5, max_lag=1)
    with pytest.raises(SchemaError, match=r"expected a 'policy_version' column"):
        drop_stale(table(["a"]), current_version=1, max_lag=1)
    with pytest.raises(ValueError, match=r"max_lag: expected an int in \[0, inf\], found -1"):
        drop_stale(t, current_version=6, max_lag=-1)
    with pytest.raises(TypeError, match=r"current_version: expected an int"):
        drop_stale(t, current_version=6.0, max_lag=1)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"expected a pyarrow.Table, found RecordBatch"):
        drop_stale(t.to_batches()[0], current_version=6, max_lag=1)  # type: ignore[arg-type]
