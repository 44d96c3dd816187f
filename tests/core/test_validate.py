"""validate_rollouts, rule by rule: nulls at every level, lengths, expert ids, R3 on or off.

Each rule of r3arrow/table/_validate.py gets a literal case that breaks only that rule, on a
table built without rollout_table (what a reader hands over), and checks the error's type,
message and structured fields (row, trajectory_id, token, layer).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pytest

import r3arrow
from r3arrow._schema import ROLLOUT_COLUMNS
from r3arrow.errors import (
    DuplicateExpertError,
    ExpertRangeError,
    R3ArrowError,
    RouteShapeError,
    SchemaError,
)
from r3arrow.spec import RouteSpec
from r3arrow.table import rollout_table, route_spec, validate_rollouts

SPEC = RouteSpec(num_layers=3, topk=2, num_experts=16, moe_layers=(0, 2))


def pad_rows(n: int) -> np.ndarray:
    """``n`` valid route rows for SPEC: experts [0, 1] on every layer."""
    return np.tile(np.array([0, 1], dtype=np.uint8), (n, 3, 1))


def base_table() -> pa.Table:
    """Two valid trajectories for SPEC (router layers 0 and 2), 3 tokens each, 2 routed."""
    return rollout_table(
        trajectory_id=["a", "b"],
        group_id=["g", "g"],
        prompt_ids=[[1], [2]],
        response_ids=[[1, 2], [3, 4]],
        loss_mask=[[1, 0], [1, 1]],
        reward=[0.0, 1.0],
        routes=[pad_rows(2), pad_rows(3)],
        spec=SPEC,
    )


def with_column(table: pa.Table, name: str, values: Any) -> pa.Table:
    """``table`` with column ``name`` replaced by ``values`` (same type), metadata kept."""
    field = table.schema.field(name)
    arr = values if isinstance(values, pa.Array) else pa.array(values, type=field.type)
    return table.set_column(table.schema.get_field_index(name), field, arr)


def test_base_table_is_valid() -> None:
    table = base_table()
    assert validate_rollouts(table) == route_spec(table)
    fresh = pa.Table.from_batches(table.to_batches())  # not marked validated
    assert validate_rollouts(fresh) == route_spec(table)


@pytest.mark.parametrize(
    ("name", "values", "match", "fields"),
    [
        (
            "trajectory_id",
            ["a", None],
            r"trajectory_id: expected no null values.*row 1",
            {"row": 1},
        ),
        ("group_id", [None, "g"], r"group_id: expected no null values.*row 0", {"row": 0}),
        ("reward", [0.0, None], r"reward: expected no null values.*row 1", {"row": 1}),
        (
            "prompt_ids",
            [[1], None],
            r"prompt_ids: expected no null rows, found 1 \(first: row 1\)",
            {"row": 1, "trajectory_id": "b"},
        ),
        (
            "prompt_ids",
            [[1], [None]],
            r"prompt_ids: expected no null token ids.*row 1, token 0",
            {"row": 1, "token": 0},
        ),
        ("response_ids", [None, [3, 4]], r"response_ids: expected no null rows", {"row": 0}),
        (
            "response_ids",
            [[1, 2], [3, None]],
            r"response_ids: expected no null token ids.*row 1, token 2",  # after the prompt
            {"row": 1, "token": 2, "trajectory_id": "b"},
        ),
        ("loss_mask", [[1, 0], None], r"loss_mask: expected no null rows", {"row": 1}),
        (
            "loss_mask",
            [[1, None], [1, 1]],
            r"loss_mask: expected no null mask values.*row 0, token 2",
            {"row": 0, "token": 2},
        ),
    ],
)
def test_validate_rejects_nulls_with_row_and_token(
    name: str, values: list[Any], match: str, fields: dict[str, Any]
) -> None:
    bad = with_column(base_table(), name, values)
    with pytest.raises(SchemaError, match=match) as info:
        validate_rollouts(bad)
    for key, value in fields.items():
        assert getattr(info.value, key) == value, key


def test_null_prompt_row_message_is_sensible() -> None:
    # Used to report "expected at most <nonsense> route rows": a null list's length is undefined.
    bad = with_column(base_table(), "prompt_ids", [None, [2]])
    with pytest.raises(SchemaError) as info:
        validate_rollouts(bad)
    assert "prompt_ids: expected no null rows" in str(info.value)
    assert "route rows" not in str(info.value)


def _routes_with(values: list[Any]) -> pa.Array[Any]:
    return pa.array(values, type=SPEC.routes_type)


_OK_TOKEN = [[0, 1], [0, 1], [0, 1]]


@pytest.mark.parametrize(
    ("routes", "what", "fields"),
    [
        ([[_OK_TOKEN], None], "trajectory rows", {"row": 1}),
        ([[_OK_TOKEN], [_OK_TOKEN, None]], "tokens", {"row": 1, "token": 1}),
        (
            [[_OK_TOKEN], [_OK_TOKEN, [[0, 1], None, [0, 1]]]],
            "layer rows",
            {"token": 1, "layer": 1},
        ),
        ([[[[0, 1], [0, 1], [0, None]]], [_OK_TOKEN]], "expert ids", {"row": 0, "layer": 2}),
        ([[_OK_TOKEN, [[0, 1], [None, 1], [0, 1]]], [_OK_TOKEN]], "expert ids", {"token": 1}),
    ],
)
def test_validate_rejects_nulls_at_every_routes_level(
    routes: list[Any], what: str, fields: dict[str, Any]
) -> None:
    bad = with_column(base_table(), "routes", _routes_with(routes))
    with pytest.raises(SchemaError, match=f"routes: expected no null {what}") as info:
        validate_rollouts(bad)
    for key, value in fields.items():
        assert getattr(info.value, key) == value, key
    assert info.value.trajectory_id == ("a", "b")[info.value.row or 0]


def test_validate_finds_route_nulls_in_a_later_chunk() -> None:
    table = base_table()
    bad = with_column(
        table, "routes", _routes_with([[_OK_TOKEN], [_OK_TOKEN, [[0, 1], None, [0, 1]]]])
    )
    both = pa.concat_tables([table, bad])  # the null is in chunk 2, row 3 overall
    with pytest.raises(SchemaError, match="null layer rows") as info:
        validate_rollouts(both)
    assert (info.value.row, info.value.token, info.value.layer) == (3, 1, 1)


@pytest.mark.parametrize(
    ("routes", "error", "match", "fields"),
    [
        (
            [pad_rows(2), np.array([[[0, 1]] * 3, [[0, 1], [5, 5], [16, 1]]], np.uint8)],
            ExpertRangeError,
            r"routes\[1\] \(trajectory 'b'\): expected expert ids < num_experts=16, "
            r"found 16 \(token 1, layer 2\)",
            {"row": 1, "token": 1, "layer": 2, "trajectory_id": "b"},
        ),
        (  # layer 1 is dense: 5, 5 there is no duplicate; layer 2 repeats expert 3
            [np.array([[[0, 1]] * 3, [[0, 1], [5, 5], [3, 3]]], np.uint8), pad_rows(3)],
            DuplicateExpertError,
            r"routes\[0\] \(trajectory 'a'\): expected 2 distinct experts.*\(token 1, layer 2\)",
            {"row": 0, "token": 1, "layer": 2, "trajectory_id": "a"},
        ),
    ],
)
def test_validate_checks_expert_ids_per_trajectory(
    routes: list[np.ndarray], error: type[Exception], match: str, fields: dict[str, Any]
) -> None:
    # Built as an Arrow column without rollout_table: what a reader hands to validate_rollouts.
    col = pa.LargeListArray.from_arrays(
        pa.array(np.cumsum([0, *(len(r) for r in routes)]), type=pa.int64()),
        r3arrow.spec.numpy_to_routes(np.concatenate(routes), SPEC),
    )
    table = with_column(base_table(), "routes", col)
    with pytest.raises(error, match=match) as info:
        validate_rollouts(table)
    assert isinstance(info.value, R3ArrowError)
    for key, value in fields.items():
        assert getattr(info.value, key) == value, key
    with pytest.raises(error):  # rollout_table checks the same rule
        rollout_table(
            **{n: table.column(n) for n in ROLLOUT_COLUMNS if n != "routes"},
            routes=routes,
            spec=SPEC,
        )


def test_validate_ids_in_a_later_chunk_name_the_overall_row() -> None:
    table = base_table()
    dup = np.array([[[0, 1]] * 3, [[0, 1], [0, 1], [2, 2]]], np.uint8)
    col = pa.LargeListArray.from_arrays(
        pa.array([0, 2, 4], type=pa.int64()),
        r3arrow.spec.numpy_to_routes(np.concatenate([dup, dup])),
    )
    both = pa.concat_tables([table, with_column(table, "routes", col)])
    with pytest.raises(DuplicateExpertError) as info:
        validate_rollouts(both)
    assert (info.value.row, info.value.token, info.value.layer) == (2, 1, 2)


def test_validate_length_rules() -> None:
    table = base_table()
    short_mask = with_column(table, "loss_mask", [[1, 0], [1]])
    with pytest.raises(SchemaError, match="loss_mask over the 2 response tokens, found 1") as info:
        validate_rollouts(short_mask)
    assert (info.value.row, info.value.trajectory_id) == (1, "b")
    too_many = with_column(table, "routes", _routes_with([[_OK_TOKEN] * 4, [_OK_TOKEN]]))
    with pytest.raises(RouteShapeError, match="at most 3 route rows") as shape:
        validate_rollouts(too_many)
    assert (shape.value.row, shape.value.trajectory_id) == (0, "a")


def test_validate_requires_routes_only_when_asked() -> None:
    table = base_table()
    off = table.drop_columns(["routes"]).replace_schema_metadata({b"r3arrow.schema": b"rollout.v1"})
    assert validate_rollouts(off) is None
    with pytest.raises(SchemaError, match=r"no routes column \(R3 off"):
        validate_rollouts(off, require_routes=True)
    with pytest.raises(SchemaError, match=r"'routes'.*r3arrow\.spec"):
        validate_rollouts(table.drop_columns(["routes"]))  # spec without routes: a lost column
