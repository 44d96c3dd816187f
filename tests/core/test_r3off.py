"""R3 off: a rollout table without routes (no routes column, no spec metadata).

Build, validate, derive masks and input ids, select rows and sample groups without routes;
route-only operations raise `SchemaError` naming R3 off.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import r3arrow
from r3arrow._schema import ROLLOUT_COLUMNS
from r3arrow._validated import is_validated
from r3arrow.errors import SchemaError
from r3arrow.spec import SPEC_METADATA_KEY, RouteSpec
from r3arrow.table import (
    captured_lengths,
    filter_groups,
    filter_rows,
    flat_routes,
    has_routes,
    input_ids,
    replace_groups,
    rollout_schema,
    rollout_table,
    route_spec,
    router_padding_mask,
    sequence_loss_mask,
    take_rows,
    validate_rollouts,
    with_columns,
)
from r3arrow.table._sampling import varied_groups
from r3arrow.testing.strategies import rollout_tables

SPEC = RouteSpec(num_layers=2, topk=2, num_experts=8)


def pylist(arr: Any) -> list[Any]:
    out: list[Any] = arr.to_pylist()
    return out


def off_table(**extra: Any) -> pa.Table:
    return rollout_table(
        trajectory_id=["a", "b", "c", "d"],
        group_id=["g", "g", "h", "h"],
        prompt_ids=[[1, 2], [3], [4, 5], [6]],
        response_ids=[[7, 8, 9], [10], [11], [12, 13]],
        loss_mask=[[1, 1, 1], [1], [0], [1, 0]],  # loss on the last token: no route rule
        reward=[0.0, 1.0, 1.0, 1.0],
        **extra,
    )


def without_routes(table: pa.Table) -> pa.Table:
    """The R3-off form of an R3-on table: routes and spec dropped, the rest kept."""
    meta = {k: v for k, v in (table.schema.metadata or {}).items() if k != SPEC_METADATA_KEY}
    return table.drop_columns(["routes"]).replace_schema_metadata(meta)


def test_build_without_routes() -> None:
    table = off_table(advantage=[0.5, -0.5, 0.0, 0.0])
    assert table.schema.names == [*ROLLOUT_COLUMNS[:-1], "advantage"]
    assert not has_routes(table)
    assert SPEC_METADATA_KEY not in (table.schema.metadata or {})
    assert table.schema.metadata == {b"r3arrow.schema": b"rollout.v1"}
    assert table.schema.equals(
        rollout_schema(None, [pa.field("advantage", pa.float64())]), check_metadata=True
    )
    assert is_validated(table)
    assert validate_rollouts(table) is None
    assert validate_rollouts(pa.Table.from_batches(table.to_batches())) is None


def test_routes_and_spec_go_together() -> None:
    with pytest.raises(TypeError, match="found spec= without routes="):
        off_table(spec=SPEC)
    with pytest.raises(TypeError, match="found routes= without spec="):
        off_table(routes=[np.zeros((0, 2, 2), np.uint8)] * 4)
    with pytest.raises(TypeError, match="RouteSpec"):
        off_table(routes=[np.zeros((0, 2, 2), np.uint8)] * 4, spec="spec")


def test_validation_without_routes_still_checks_everything_else() -> None:
    table = off_table()
    bad_mask = table.set_column(
        4, "loss_mask", pa.array([[1], [1], [0], [1, 0]], pa.large_list(pa.uint8()))
    )
    with pytest.raises(SchemaError, match="loss_mask over the 3 response tokens") as info:
        validate_rollouts(bad_mask)
    assert (info.value.row, info.value.trajectory_id) == (0, "a")
    null_prompt = table.set_column(
        2, "prompt_ids", pa.array([[1], None, [4], [6]], pa.large_list(pa.int32()))
    )
    with pytest.raises(SchemaError, match="prompt_ids: expected no null rows"):
        validate_rollouts(null_prompt)
    null_reward = table.set_column(5, "reward", pa.array([0.0, None, 1.0, 1.0]))
    with pytest.raises(SchemaError, match="reward: expected no null values"):
        validate_rollouts(null_reward)
    with pytest.raises(SchemaError, match="R3 off"):
        validate_rollouts(table, require_routes=True)


def test_derived_columns_without_routes() -> None:
    table = off_table()
    assert pylist(input_ids(table)) == [[1, 2, 7, 8, 9], [3, 10], [4, 5, 11], [6, 12, 13]]
    assert pylist(sequence_loss_mask(table)) == [[0, 0, 1, 1, 1], [0, 1], [0, 0, 0], [0, 1, 0]]
    # Nothing is replayed with R3 off: the route-only views refuse, naming it.
    for fn in (router_padding_mask, flat_routes, captured_lengths, route_spec):
        with pytest.raises(SchemaError, match=r"R3 off"):
            fn(table)


def test_selection_and_sampling_without_routes() -> None:
    table = off_table()
    taken = take_rows(table, [3, 0, 3])
    assert pylist(taken.column("trajectory_id")) == ["d", "a", "d"]
    assert taken.schema.equals(table.schema, check_metadata=True) and is_validated(taken)
    kept = filter_rows(table, [True, False, True, False])
    assert pylist(kept.column("trajectory_id")) == ["a", "c"]
    # g varies (0, 1); h: c is all-masked, so one live member: kept.
    assert filter_groups(table).num_rows == 4
    assert pylist(filter_groups(table, ignore_masked=False).column("trajectory_id")) == ["a", "b"]
    info = replace_groups(table, ignore_masked=False, seed=0)
    assert info.enough and info.replaced_groups == 1
    assert pylist(info.table.column("trajectory_id")) == ["a", "b", "a", "b"]
    assert not has_routes(info.table) and validate_rollouts(info.table) is None
    assert replace_groups(table, ignore_masked=False, seed=0).table.equals(info.table)


def test_validate_refuses_a_lost_routes_column() -> None:
    # Spec metadata without a routes column is not R3 off: the column was lost.
    on = rollout_table(
        trajectory_id=["a"],
        group_id=["g"],
        prompt_ids=[[1]],
        response_ids=[[2]],
        loss_mask=[[1]],
        reward=[0.0],
        routes=[np.array([[[0, 1], [2, 3]]], np.uint8)],
        spec=SPEC,
    )
    with pytest.raises(SchemaError, match="'routes'"):
        validate_rollouts(on.drop_columns(["routes"]))
    assert validate_rollouts(without_routes(on)) is None
    assert route_spec(on.drop_columns(["routes"])) == route_spec(on)  # a projection keeps it


@settings(max_examples=40, deadline=None)
@given(table=rollout_tables(max_rows=8), data=st.data())
def test_r3_off_operations_match_r3_on(table: pa.Table, data: st.DataObject) -> None:
    # Dropping the routes changes nothing else: same rows selected, same derived columns.
    n = table.num_rows
    rewards = data.draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=n, max_size=n))
    on = with_columns(table, {"reward": pa.array(rewards, pa.float64())})
    off = without_routes(on)
    assert validate_rollouts(off) is None
    assert not has_routes(off)
    assert input_ids(off).equals(input_ids(on))
    assert sequence_loss_mask(off).equals(sequence_loss_mask(on))
    assert without_routes(filter_groups(on)).equals(filter_groups(off))
    idx = data.draw(st.lists(st.integers(0, max(n - 1, 0)), max_size=6)) if n else []
    assert without_routes(take_rows(on, idx)).equals(take_rows(off, idx))
    if n and varied_any(on):
        assert without_routes(replace_groups(on, seed=1).table).equals(
            replace_groups(off, seed=1).table
        )
    assert r3arrow.validate_rollouts is validate_rollouts


def varied_any(table: pa.Table) -> bool:
    return bool(varied_groups(table).any())
