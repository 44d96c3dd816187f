"""Rollout table: schema held to schemas/rollout.v1.json, building, padding mask, row selection.

validate_rollouts rule by rule: test_validate.py; dynamic sampling: test_sampling.py; R3 off:
test_r3off.py."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st

import r3arrow
from r3arrow import RouteSpec, RouteTrace, TurnStore
from r3arrow._schema import ROLLOUT_COLUMNS
from r3arrow.errors import (
    ExpertRangeError,
    R3ArrowError,
    RouteShapeError,
    SchemaError,
    TerminalGapError,
)
from r3arrow.table import (
    filter_rows,
    flat_routes,
    input_ids,
    rollout_schema,
    rollout_table,
    route_spec,
    router_padding_mask,
    sequence_loss_mask,
    take_rows,
    validate_rollouts,
)
from r3arrow.testing import random_routes

SCHEMA_FILE = Path(__file__).resolve().parents[2] / "schemas" / "rollout.v1.json"
SPEC = RouteSpec(num_layers=3, topk=2, num_experts=16, moe_layers=(0, 2))

# ------------------------------------------------------- the JSON schema file

_PRIMITIVES: dict[str, pa.DataType] = {
    "bool": pa.bool_(),
    "uint8": pa.uint8(),
    "uint16": pa.uint16(),
    "int32": pa.int32(),
    "int64": pa.int64(),
    "float64": pa.float64(),
    "large_string": pa.large_string(),
}


def pylist(arr: Any) -> list[Any]:
    """``arr.to_pylist()``, loosely typed (pyarrow-stubs refuse it on list arrays)."""
    out: list[Any] = arr.to_pylist()
    return out


def parse_type(text: str, env: dict[str, Any]) -> pa.DataType:
    """Parse the file's neutral type notation (placeholders ``{name}`` filled from ``env``)."""
    text = re.sub(r"\{(\w+)\}", lambda m: str(env[m.group(1)]), text)
    tokens = re.findall(r"\w+|[<>,]", text)
    pos = 0

    def take(expected: str | None = None) -> str:
        nonlocal pos
        tok = tokens[pos]
        if expected is not None and tok != expected:
            raise AssertionError(
                f"type {text!r}: expected {expected!r} at token {pos}, found {tok!r}"
            )
        pos += 1
        return str(tok)

    def parse() -> pa.DataType:
        name = take()
        if name == "large_list":
            take("<")
            inner = parse()
            take(">")
            return pa.large_list(inner)
        if name == "fixed_size_list":
            take("<")
            inner = parse()
            take(",")
            size = int(take())
            take(">")
            return pa.list_(inner, size)
        return _PRIMITIVES[name]

    out = parse()
    assert pos == len(tokens), f"type {text!r}: trailing tokens {tokens[pos:]}"
    return out


def schema_doc() -> dict[str, Any]:
    doc: dict[str, Any] = json.loads(SCHEMA_FILE.read_text())
    return doc


def assert_follows_schema_file(schema: pa.Schema, spec: RouteSpec | None) -> None:
    """``schema`` follows the file; ``spec=None``: the R3-off form (no routes, no spec)."""
    doc = schema_doc()
    meta = schema.metadata or {}
    core = [f for f in doc["fields"] if spec is not None or not f.get("optional", False)]
    assert schema.names[: len(core)] == [f["name"] for f in core]  # names and order
    assert doc["extra_columns"]["allowed"] is True
    required = {k for k, v in doc["metadata"].items() if not v.get("optional", False)}
    # Metadata: exactly the documented keys (the optional spec only with R3 on), the schema name.
    assert {k.decode() for k in meta} == (set(doc["metadata"]) if spec is not None else required)
    assert meta[b"r3arrow.schema"].decode() == doc["metadata"]["r3arrow.schema"]["value"]
    assert doc["metadata"]["r3arrow.schema"]["value"] == doc["schema"]
    if spec is None:
        assert "routes" not in schema.names
        for f in core:
            assert schema.field(f["name"]).type == parse_type(f["type"], {}), f["name"]
        return
    spec_json = json.loads(meta[b"r3arrow.spec"])
    env = {
        "id": spec_json["dtype"],
        "num_layers": spec_json["num_layers"],
        "topk": spec_json["topk"],
    }
    for f in core:
        field = schema.field(f["name"])
        assert field.type == parse_type(f["type"], env), f["name"]
        assert field.nullable == f["nullable"], f["name"]
    spec_fields = doc["metadata"]["r3arrow.spec"]["fields"]
    assert set(spec_json) == set(spec_fields)
    assert spec_json["dtype"] in spec_fields["dtype"]["enum"]
    assert spec_json["id_dtype"] in spec_fields["id_dtype"]["enum"]
    assert spec_json["dtype"] == spec.dtype.name
    assert (spec_json["num_layers"], spec_json["topk"], spec_json["num_experts"]) == (
        spec.num_layers,
        spec.topk,
        spec.num_experts,
    )
    assert spec_json["moe_layers"] == (
        list(spec.moe_layers) if spec.moe_layers is not None else None
    )


def test_only_routes_and_the_spec_are_optional_in_the_file() -> None:
    doc = schema_doc()
    assert [f["name"] for f in doc["fields"] if f.get("optional")] == ["routes"]
    assert [k for k, v in doc["metadata"].items() if v.get("optional")] == ["r3arrow.spec"]
    off = rollout_schema(None, [pa.field("advantage", pa.float32())])
    assert off.names == [*ROLLOUT_COLUMNS[:-1], "advantage"]
    assert_follows_schema_file(off, None)


@pytest.mark.parametrize(
    "spec",
    [
        RouteSpec(num_layers=48, topk=8, num_experts=128),
        RouteSpec(num_layers=4, topk=2, num_experts=300, moe_layers=(1, 3)),
        RouteSpec(num_layers=2, topk=1, num_experts=70000),
        RouteSpec(num_layers=5, topk=3, num_experts=None),
        RouteSpec(num_layers=5, topk=3, num_experts=None).widened_for(999),
    ],
)
def test_rollout_schema_follows_the_json_file(spec: RouteSpec) -> None:
    schema = rollout_schema(spec)
    assert tuple(schema.names) == ROLLOUT_COLUMNS
    assert len(schema_doc()["fields"]) == len(schema.names)
    assert_follows_schema_file(schema, spec)
    with_extra = rollout_schema(spec, [pa.field("advantage", pa.float32())])
    assert with_extra.names[-1] == "advantage"
    assert_follows_schema_file(with_extra, spec)


def test_type_parser_is_strict() -> None:
    env = {"id": "uint8", "num_layers": 4, "topk": 2}
    assert parse_type(
        "large_list<fixed_size_list<fixed_size_list<{id}, {topk}>, {num_layers}>>", env
    ) == (RouteSpec(num_layers=4, topk=2, num_experts=8).routes_type)
    with pytest.raises(AssertionError):
        parse_type("large_list<int32> int32", env)
    with pytest.raises(KeyError):
        parse_type("list<int32>", env)


# ------------------------------------------------------------------ helpers


def pad_rows(n: int) -> np.ndarray:
    """``n`` valid route rows for SPEC: experts [0, 1] on every layer."""
    return np.tile(np.array([0, 1], dtype=np.uint8), (n, 3, 1))


def make_rows(
    rng: np.random.Generator,
    n: int,
    spec: RouteSpec = SPEC,
    *,
    groups: int = 3,
    rewards: tuple[float, ...] = (0.0, 1.0),
) -> dict[str, Any]:
    """Random valid per-trajectory fields: P, R >= 1, captured <= P + R - 1, gap loss-masked."""
    cols: dict[str, Any] = {
        k: []
        for k in (
            "trajectory_id",
            "group_id",
            "prompt_ids",
            "response_ids",
            "loss_mask",
            "reward",
            "routes",
        )
    }
    for i in range(n):
        p, r = int(rng.integers(1, 6)), int(rng.integers(1, 8))
        cap = int(rng.integers(0, p + r))
        mask = rng.integers(0, 2, size=r).astype(np.uint8)
        mask[np.arange(p, p + r) > cap] = 0  # token t needs row t-1
        cols["trajectory_id"].append(f"traj-{i}")
        cols["group_id"].append(f"g{int(rng.integers(0, groups))}")
        cols["prompt_ids"].append(rng.integers(0, 1000, size=p).tolist())
        cols["response_ids"].append(rng.integers(0, 1000, size=r).tolist())
        cols["loss_mask"].append(mask.tolist())
        cols["reward"].append(float(rng.choice(rewards)))
        cols["routes"].append(random_routes(rng, cap, spec))
    return cols


def make_table(rng: np.random.Generator, n: int, spec: RouteSpec = SPEC, **kw: Any) -> pa.Table:
    cols = make_rows(rng, n, spec, **kw)
    return rollout_table(
        **cols, spec=spec, step=np.arange(n, dtype=np.int64), tag=[f"x{i}" for i in range(n)]
    )


def rows_by_id(table: pa.Table) -> dict[str, dict[str, Any]]:
    return {r["trajectory_id"]: r for r in table.to_pylist()}


def assert_rows_intact(result: pa.Table, source: pa.Table) -> None:
    """Every row of ``result`` equals the source row of its trajectory (all columns attached)."""
    assert result.schema.equals(source.schema, check_metadata=True)
    src = rows_by_id(source)
    for row in result.to_pylist():
        assert row == src[row["trajectory_id"]]


# ------------------------------------------------------------------ building


def test_rollout_table_builds_with_spec_metadata_and_extra_columns() -> None:
    rng = np.random.default_rng(0)
    cols = make_rows(rng, 4)
    table = rollout_table(
        **cols,
        spec=SPEC,
        advantage=np.array([0.5, -0.5, 1.0, 0.0], dtype=np.float32),
        source=["a", "b", "c", "d"],
    )
    assert table.num_rows == 4
    assert table.schema.names == [*ROLLOUT_COLUMNS, "advantage", "source"]
    assert table.schema.field("advantage").type == pa.float32()
    assert_follows_schema_file(table.schema, SPEC)
    assert route_spec(table).arrow_type == SPEC.arrow_type
    assert route_spec(table).router_layers == SPEC.router_layers
    assert table.column("trajectory_id").to_pylist() == cols["trajectory_id"]
    assert table.column("prompt_ids").to_pylist() == cols["prompt_ids"]
    assert table.column("loss_mask").to_pylist() == cols["loss_mask"]
    assert table.column("reward").to_pylist() == cols["reward"]
    flat, offsets = flat_routes(table)
    assert offsets.tolist() == np.cumsum([0, *(len(r) for r in cols["routes"])]).tolist()
    for i, r in enumerate(cols["routes"]):
        np.testing.assert_array_equal(flat[offsets[i] : offsets[i + 1]], r)
    assert validate_rollouts(table, require_routes=True).arrow_type == SPEC.arrow_type


def test_rollout_table_accepts_arrow_routes_and_a_routes_column() -> None:
    rng = np.random.default_rng(1)
    cols = make_rows(rng, 3)
    as_arrow = dict(cols, routes=[r3arrow.spec.numpy_to_routes(r, SPEC) for r in cols["routes"]])
    t1 = rollout_table(**as_arrow, spec=SPEC)
    t2 = rollout_table(**dict(cols, routes=t1.column("routes")), spec=SPEC)
    t3 = rollout_table(**cols, spec=SPEC)
    assert t1.equals(t2) and t1.equals(t3)


def test_rollout_table_from_traces_and_store() -> None:
    # End to end: multi-turn traces finalized into the table, and the same turns through a
    # TurnStore.
    rng = np.random.default_rng(2)
    store = TurnStore(SPEC)
    cols: dict[str, list[Any]] = {
        k: []
        for k in (
            "trajectory_id",
            "group_id",
            "prompt_ids",
            "response_ids",
            "loss_mask",
            "reward",
            "routes",
        )
    }
    for i in range(3):
        tid = f"t{i}"
        trace = RouteTrace(SPEC)
        prompt = rng.integers(0, 100, size=4).tolist()
        tokens, mask = list(prompt), [0] * 4
        for turn in range(3):
            if turn:
                obs = rng.integers(0, 100, size=2).tolist()  # tool output: not trained
                tokens += obs
                mask += [0, 0]
            gen = rng.integers(0, 100, size=3).tolist()
            chunk = random_routes(rng, len(tokens) - trace.captured + len(gen) - 1, SPEC)
            start = trace.record(chunk, prompt_tokens=len(tokens), generated_tokens=len(gen))
            store.append(tid, start, chunk)
            tokens += gen
            mask += [1, 1, 1]
        tokens += [7, 7]  # a final observation after the last generation: the terminal gap
        mask += [0, 0]
        cols["trajectory_id"].append(tid)
        cols["group_id"].append("g")
        cols["prompt_ids"].append(prompt)
        cols["response_ids"].append(tokens[4:])
        cols["loss_mask"].append(mask[4:])
        cols["reward"].append(float(i))
        cols["routes"].append(trace.finalize(num_tokens=len(tokens), loss_mask=mask))
    table = rollout_table(**cols, spec=SPEC)
    store_cols: dict[str, Any] = {**cols, "routes": store.routes(cols["trajectory_id"])}
    from_store = rollout_table(**store_cols, spec=SPEC)
    assert table.equals(from_store)
    # Captured = all tokens but the last generated one and the 2 final observation tokens.
    assert r3arrow.table.captured_lengths(table).tolist() == [
        len(t) - 3 for t in pylist(input_ids(table))
    ]
    pad = pylist(router_padding_mask(table))
    assert all(row[-3:] == [True] * 3 and not any(row[:-3]) for row in pad)


def test_router_padding_mask_literal() -> None:
    spec = RouteSpec(num_layers=1, topk=1, num_experts=4)
    table = rollout_table(
        trajectory_id=["a", "b", "c"],
        group_id=["g", "g", "g"],
        prompt_ids=[[1, 2, 3], [1], [5, 6]],
        response_ids=[[4, 5, 6, 7], [2, 3], [7]],
        loss_mask=[[1, 1, 0, 0], [1, 1], [0]],
        reward=[1.0, 0.0, 0.5],
        routes=[
            np.zeros((5, 1, 1), np.uint8),
            np.zeros((2, 1, 1), np.uint8),
            np.zeros((0, 1, 1), np.uint8),
        ],
        spec=spec,
    )
    mask = router_padding_mask(table)
    assert mask.type == pa.large_list(pa.bool_())
    assert pylist(mask) == [
        [
            False,
            False,
            False,
            False,
            False,
            True,
            True,
        ],  # captured prompt (loss-masked) tokens are False
        [False, False, True],
        [True, True, True],
    ]
    assert pylist(sequence_loss_mask(table)) == [[0, 0, 0, 1, 1, 0, 0], [0, 1, 1], [0, 0, 0]]
    assert pylist(input_ids(table)) == [[1, 2, 3, 4, 5, 6, 7], [1, 2, 3], [5, 6, 7]]


def test_terminal_gap_violation_names_trajectory_and_token() -> None:
    base: dict[str, Any] = {
        "trajectory_id": ["ok", "bad-traj"],
        "group_id": ["g", "g"],
        "prompt_ids": [[1, 2, 3], [1, 2, 3]],
        "response_ids": [[4, 5, 6, 7], [4, 5, 6, 7]],
        "loss_mask": [[1, 1, 1, 0], [1, 1, 1, 0]],
        "reward": [0.0, 1.0],
        "routes": [pad_rows(5), pad_rows(5)],
    }
    rollout_table(**base, spec=SPEC)  # token 5 is the last one covered by captured row 4
    bad = dict(base, loss_mask=[[1, 1, 1, 0], [1, 0, 0, 1]])  # token 6 needs row 5: missing
    with pytest.raises(TerminalGapError, match=r"'bad-traj'.*loss-active target at token 6"):
        rollout_table(**bad, spec=SPEC)


def test_widening_in_table_with_unknown_num_experts() -> None:
    spec = RouteSpec(num_layers=2, topk=2, num_experts=None)
    small = np.array([[[0, 1], [2, 3]]], dtype=np.uint8)
    trace = RouteTrace(spec)
    trace.record(np.array([[[256, 1], [0, 300]]] * 2), prompt_tokens=2, generated_tokens=1)
    wide = trace.finalize(num_tokens=3, loss_mask=[0, 0, 0])
    table = rollout_table(
        trajectory_id=["s", "w"],
        group_id=["g", "g"],
        prompt_ids=[[1], [1, 2]],
        response_ids=[[2], [3]],
        loss_mask=[[0], [0]],
        reward=[0, 1],
        routes=[r3arrow.spec.numpy_to_routes(small), wide],
        spec=spec,
    )
    assert route_spec(table).dtype == np.uint16
    assert_follows_schema_file(table.schema, route_spec(table))
    flat, offsets = flat_routes(table)
    np.testing.assert_array_equal(flat[: offsets[1]], small)
    np.testing.assert_array_equal(flat[offsets[1] :], [[[256, 1], [0, 300]]] * 2)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"group_id": ["g"]}, SchemaError, "group_id"),
        ({"reward": [1.0]}, SchemaError, "reward"),
        ({"prompt_ids": [[1]]}, SchemaError, "prompt_ids"),
        ({"loss_mask": [[1, 0], [1, 0]]}, SchemaError, "loss_mask"),
        ({"prompt_ids": [[1], ["x"]]}, SchemaError, "prompt_ids"),
        ({"prompt_ids": [[1], [2**40]]}, SchemaError, "prompt_ids"),
        ({"routes": [np.zeros((1, 3, 2), np.uint8)]}, SchemaError, "routes"),
        ({"routes": [pad_rows(1), pad_rows(5)]}, RouteShapeError, "at most 4"),
        (
            {"routes": [np.zeros((1, 4, 2), np.uint8), np.zeros((1, 3, 2), np.uint8)]},
            RouteShapeError,
            "routes",
        ),
        ({"routes": [np.zeros((1, 3, 2)), np.zeros((1, 3, 2))]}, RouteShapeError, "integer"),
        (
            {"routes": [np.full((1, 3, 2), 16), np.zeros((1, 3, 2), np.uint8)]},
            ExpertRangeError,
            "num_experts=16",
        ),
        ({"trajectory_id": ["a", None]}, SchemaError, "trajectory_id"),
        ({"reward": [1.0, None]}, SchemaError, "reward"),
        ({"response_ids": [[1, 2], None]}, SchemaError, "response_ids"),
    ],
)
def test_invalid_build_raises_typed_error(
    change: dict[str, Any], error: type[Exception], match: str
) -> None:
    base: dict[str, Any] = {
        "trajectory_id": ["a", "b"],
        "group_id": ["g", "g"],
        "prompt_ids": [[1], [2]],
        "response_ids": [[1, 2], [3, 4, 5]],
        "loss_mask": [[1, 0], [1, 0, 0]],
        "reward": [0.0, 1.0],
        "routes": [pad_rows(1), pad_rows(2)],
    }
    rollout_table(**base, spec=SPEC)
    with pytest.raises(error, match=match):
        rollout_table(**dict(base, **change), spec=SPEC)


def test_null_routes_row_is_rejected_not_turned_into_empty() -> None:
    col = pa.array([[[[0, 1]] * 3], None], type=SPEC.routes_type)
    with pytest.raises(R3ArrowError):
        rollout_table(
            trajectory_id=["a", "b"],
            group_id=["g", "g"],
            prompt_ids=[[1], [2]],
            response_ids=[[1], [3]],
            loss_mask=[[0], [0]],
            reward=[0.0, 1.0],
            routes=col,
            spec=SPEC,
        )


def test_extra_column_errors() -> None:
    cols = make_rows(np.random.default_rng(3), 2)
    with pytest.raises(SchemaError, match="advantage: expected 2 rows"):
        rollout_table(**cols, spec=SPEC, advantage=[1.0, 2.0, 3.0])


def test_validate_rollouts_rejects_foreign_tables() -> None:
    table = make_table(np.random.default_rng(4), 3)
    with pytest.raises(SchemaError, match=r"r3arrow\.spec"):
        validate_rollouts(table.replace_schema_metadata(None))
    with pytest.raises(SchemaError, match="'reward'"):
        validate_rollouts(table.drop_columns(["reward"]))
    cast = table.set_column(
        table.schema.get_field_index("reward"), "reward", table.column("reward").cast(pa.float32())
    )
    with pytest.raises(SchemaError, match="float"):
        validate_rollouts(cast)


def test_table_ipc_round_trip_keeps_spec_and_routes() -> None:
    table = make_table(np.random.default_rng(5), 6)
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    back = pa.ipc.open_stream(sink.getvalue()).read_all()
    assert back.equals(table) and back.schema.equals(table.schema, check_metadata=True)
    assert route_spec(back).arrow_type == SPEC.arrow_type
    validate_rollouts(back)


# ------------------------------------------------------------- row selection


def test_take_and_filter_keep_every_column_attached() -> None:
    table = make_table(np.random.default_rng(6), 8)
    taken = take_rows(table, [5, 0, 5, 3])
    assert taken.column("trajectory_id").to_pylist() == ["traj-5", "traj-0", "traj-5", "traj-3"]
    assert_rows_intact(taken, table)
    assert taken.column("step").to_pylist() == [5, 0, 5, 3]
    kept = filter_rows(table, [i % 3 == 0 for i in range(8)])
    assert kept.column("trajectory_id").to_pylist() == ["traj-0", "traj-3", "traj-6"]
    assert_rows_intact(kept, table)
    assert filter_rows(table, pa.array([True] * 8)).equals(table)
    validate_rollouts(taken)
    validate_rollouts(kept)
    with pytest.raises(ValueError, match="8 values") as info:  # argument misuse: a builtin
        filter_rows(table, [True, False])
    assert not isinstance(info.value, R3ArrowError)


def test_take_rows_rejects_non_integer_indices() -> None:
    # Floats must not be truncated to indices, and a boolean mask must not be read as indices 0/1.
    table = make_table(np.random.default_rng(7), 3)
    # Indices are arguments: misuse raises builtins.
    with pytest.raises(TypeError, match="integer row indices"):
        take_rows(table, [0.7, 1.2])
    with pytest.raises(TypeError, match="integer row indices"):
        take_rows(table, [True, False, True])
    with pytest.raises(ValueError, match="1-D"):
        take_rows(table, [[0], [1]])
    with pytest.raises(IndexError):
        take_rows(table, [3])


def test_selection_on_a_multi_chunk_table() -> None:
    rng = np.random.default_rng(8)
    a, b = make_table(rng, 4), make_table(rng, 4)
    b = b.set_column(
        0, b.schema.field(0), pa.chunked_array([[f"b-{i}" for i in range(4)]], pa.large_string())
    )
    both = pa.concat_tables([a, b])
    assert both.column("routes").num_chunks == 2
    out = take_rows(both, [7, 0])
    assert out.column("trajectory_id").to_pylist() == ["b-3", "traj-0"]
    assert_rows_intact(out, both)


@pytest.mark.parametrize("value", [-1, 1000])
def test_dense_layer_value_outside_storage_dtype_is_never_silently_wrapped(value: int) -> None:
    # Dense-layer ids are not range-checked, but narrowing must not wrap them
    # (-1 -> 255, 1000 -> 232).
    spec = RouteSpec(num_layers=2, topk=2, num_experts=None, moe_layers=(1,))
    data = np.array([[[value, 0], [0, 1]]], dtype=np.int64)
    try:
        table = rollout_table(
            trajectory_id=["t"],
            group_id=["g"],
            prompt_ids=[[1]],
            response_ids=[[2]],
            loss_mask=[[0]],
            reward=[0.0],
            routes=[data],
            spec=spec,
        )
    except R3ArrowError:
        return
    np.testing.assert_array_equal(flat_routes(table)[0].astype(np.int64), data)


@given(
    layers=st.integers(1, 4),
    topk=st.integers(1, 3),
    num_experts=st.sampled_from([None, 4, 300, 70000]),
    in_dtype=st.sampled_from([np.uint8, np.int16, np.uint16, np.int32, np.int64]),
    lengths=st.lists(st.integers(0, 6), min_size=0, max_size=6),
    arrow_input=st.booleans(),
    seed=st.integers(0, 2**32 - 1),
)
def test_rollout_table_routes_round_trip_for_random_shapes_and_dtypes(
    layers: int,
    topk: int,
    num_experts: int | None,
    in_dtype: type,
    lengths: list[int],
    arrow_input: bool,
    seed: int,
) -> None:
    spec = RouteSpec(
        num_layers=layers, topk=max(1, min(topk, num_experts or topk)), num_experts=num_experts
    )
    rng = np.random.default_rng(seed)
    max_id = min(int(np.iinfo(in_dtype).max) + 1, num_experts or 600)
    routes = [random_routes(rng, n, spec, num_experts=max_id, dtype=in_dtype) for n in lengths]
    n = len(lengths)
    arg: list[Any] = routes
    if arrow_input:
        arg = [
            r3arrow.spec.numpy_to_routes(r.astype(spec.widened_for(max_id - 1).dtype))
            for r in routes
        ]
    table = rollout_table(
        trajectory_id=[f"t{i}" for i in range(n)],
        group_id=["g"] * n,
        prompt_ids=[[1]] * n,
        response_ids=[list(range(k)) for k in lengths],
        loss_mask=[[0] * k for k in lengths],
        reward=[0.0] * n,
        routes=arg,
        spec=spec,
    )
    out_spec = route_spec(table)
    assert out_spec.same_shape(spec)
    if num_experts is not None:
        assert out_spec.dtype == spec.dtype
    assert table.schema.field("routes").type == out_spec.routes_type
    flat, offsets = flat_routes(table)
    assert np.diff(offsets).tolist() == lengths
    want = np.concatenate(routes) if routes else np.empty((0, layers, spec.topk), np.int64)
    np.testing.assert_array_equal(flat.astype(np.int64), want.astype(np.int64))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    back = pa.ipc.open_file(sink.getvalue()).read_all()
    assert back.equals(table) and route_spec(back).dtype == out_spec.dtype


# ------------------------------------------- token ids and masks: never cast lossily
def _r3off(**change: Any) -> pa.Table:
    base: dict[str, Any] = {
        "trajectory_id": ["a", "b"],
        "group_id": ["g", "g"],
        "prompt_ids": [[1], [2]],
        "response_ids": [[1, 2], [3]],
        "loss_mask": [[1, 0], [1]],
        "reward": [0.0, 1.0],
    }
    return rollout_table(**{**base, **change})


def _as(kind: str, rows: list[list[Any]]) -> Any:
    """``rows`` as Python lists, numpy arrays or an Arrow column (types as inferred)."""
    if kind == "numpy":
        return [np.asarray(r) for r in rows]
    return pa.array(rows) if kind == "arrow" else rows


@pytest.mark.parametrize("kind", ["list", "numpy", "arrow"])
@pytest.mark.parametrize(
    ("column", "rows", "match"),
    [
        ("prompt_ids", [[1], [1.5, 2.7]], r"row 1: prompt_ids: expected integral int32.*1\.5"),
        ("prompt_ids", [[1], [2**40]], "row 1: prompt_ids: expected integral int32"),
        ("prompt_ids", [[float("nan")], [1]], "row 0: prompt_ids.*nan"),
        ("prompt_ids", [[True], [False]], "prompt_ids: expected integral int32.*bool"),
        ("response_ids", [[1, 2], [3.5]], r"row 1: response_ids.*3\.5"),
        ("loss_mask", [[0.6, 2], [1]], r"row 0: loss_mask: expected 0 or 1.*0\.6"),
        ("loss_mask", [[1, 0], [2]], "row 1: loss_mask: expected values 0 or 1, found 2"),
        ("loss_mask", [[1, 0], [-1]], "row 1: loss_mask: expected 0 or 1.*-1"),
    ],
)
def test_token_ids_and_masks_are_refused_on_every_path_rather_than_cast(
    kind: str, column: str, rows: list[list[Any]], match: str
) -> None:
    with pytest.raises(SchemaError, match=match) as info:
        _r3off(**{column: _as(kind, rows)})
    if "row" in match:
        assert info.value.row == int(match.split("row ")[1][0])
        assert info.value.trajectory_id == "ab"[info.value.row]


@pytest.mark.parametrize("kind", ["list", "numpy", "arrow"])
def test_integral_floats_and_bool_masks_are_held_exactly(kind: str) -> None:
    table = _r3off(
        prompt_ids=_as(kind, [[1.0], [2**31 - 1.0]]), loss_mask=_as(kind, [[True, False], [True]])
    )
    assert table.column("prompt_ids").to_pylist() == [[1], [2**31 - 1]]
    assert table.column("loss_mask").to_pylist() == [[1, 0], [1]]
    assert table.schema.field("loss_mask").type == pa.large_list(pa.uint8())


@given(st.lists(st.lists(st.floats(allow_nan=True) | st.integers(-(2**40), 2**40), max_size=4)))
def test_token_ids_are_stored_exactly_or_refused(values: list[list[float | int]]) -> None:
    n = len(values)
    try:
        table = rollout_table(
            trajectory_id=[f"t{i}" for i in range(n)],
            group_id=["g"] * n,
            prompt_ids=values,
            response_ids=[[]] * n,
            loss_mask=[[]] * n,
            reward=[0.0] * n,
        )
    except SchemaError:
        return
    assert table.column("prompt_ids").to_pylist() == values  # never truncated or wrapped


def test_validation_refuses_a_mask_value_other_than_0_or_1(tmp_path: Path) -> None:
    table = _r3off()
    mask = pa.array([[1, 0], [3]], pa.large_list(pa.uint8()))
    bad = table.set_column(table.schema.get_field_index("loss_mask"), "loss_mask", mask)
    with pytest.raises(SchemaError, match="row 1: loss_mask: expected values 0 or 1, found 3"):
        validate_rollouts(bad)
    path = tmp_path / "bad.parquet"
    pq.write_table(bad, path, use_compliant_nested_type=False)  # a foreign writer's file
    with pytest.raises(SchemaError, match="loss_mask: expected values 0 or 1") as info:
        r3arrow.read_rollouts(path)
    assert info.value.path == str(path) and info.value.row == 1
