"""Layer-projected storage (r3arrow.io._groups, docs/storage.md): layer projection on real files.

Routes are stored as layer-group columns; a reader of some layers reads about that
fraction of the route bytes and gets a projected table (spec of L' layers, global ids
under ``r3arrow.route_layers``) equal to the in-memory projection of the full read.
Old files (one ``fixed_size_binary`` per token) still read, whole and projected.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, cast

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import r3arrow
from r3arrow._schema import ROUTE_LAYERS_KEY
from r3arrow.errors import R3ArrowError, RouteShapeError, SchemaError
from r3arrow.io import (
    iter_rollouts,
    project_layers,
    read_rollouts,
    route_rows,
    write_rollouts,
)
from r3arrow.io._groups import GROUP_FORMAT, plan_groups
from r3arrow.io._project import STORAGE_KEY
from r3arrow.io._verify import sealed
from r3arrow.spec import SPEC_METADATA_KEY, RouteSpec, routes_to_numpy
from r3arrow.table import route_layers, route_spec, validate_rollouts
from r3arrow.testing import assert_rollouts_equal, random_rollouts
from r3arrow.testing.strategies import rollout_tables

SPEC = RouteSpec(num_layers=8, topk=2, num_experts=300, moe_layers=(1, 2, 3, 5, 6, 7))
SHAPES = [(6, 5, 11), (4, 3, 6), (5, 2, 0), (3, 4, 7), (2, 6, 8)]


def _table(seed: int = 7) -> pa.Table:
    return random_rollouts(np.random.default_rng(seed), SPEC, SHAPES)


def _lists(col: pa.ChunkedArray[Any]) -> pa.LargeListArray[Any]:
    return cast("pa.LargeListArray[Any]", col.combine_chunks())


def _rows(table: pa.Table) -> np.ndarray:
    return routes_to_numpy(_lists(table.column("routes")).flatten())


def _want(table: pa.Table, layers: list[int]) -> np.ndarray:
    """The projection computed independently: numpy fancy index of the full rows."""
    return _rows(table)[:, sorted(set(layers))]


# ---------------------------------------------------------------- grouping
def test_plan_groups_default_int_and_stage_sizes() -> None:
    assert plan_groups(48) == tuple((a, a + 6) for a in range(0, 48, 6))
    assert plan_groups(5) == tuple((i, i + 1) for i in range(5))  # L < 8: one layer each
    assert plan_groups(10, 4) == ((0, 4), (4, 8), (8, 10))
    assert plan_groups(6, [1, 3, 2]) == ((0, 1), (1, 4), (4, 6))
    with pytest.raises(ValueError, match="summing to num_layers=6"):
        plan_groups(6, [1, 2])
    with pytest.raises(ValueError, match="layer_group"):
        plan_groups(6, 0)
    with pytest.raises(TypeError, match="layer_group"):
        plan_groups(6, "2")  # type: ignore[arg-type]


def test_grouping_is_recorded_and_sealed(tmp_path: Path) -> None:
    path = write_rollouts(_table(), tmp_path / "r.parquet", layer_group=[3, 5])
    meta = pq.ParquetFile(path).schema_arrow.metadata or {}
    info = orjson.loads(meta[STORAGE_KEY])
    assert info == {"format": GROUP_FORMAT, "columns": ["routes"], "groups": [[0, 3], [3, 8]]}
    assert_rollouts_equal(read_rollouts(path), _table())
    with pytest.raises(ValueError, match="portable"):
        write_rollouts(_table(), tmp_path / "p.parquet", layer_group=2, portable=True)


# --------------------------------------------------------------- projection
@settings(max_examples=25, deadline=None)
@given(
    layers=st.lists(st.integers(0, 7), min_size=1, max_size=8).filter(
        lambda ls: bool(set(ls) & set(SPEC.router_layers))
    ),
    group=st.sampled_from([None, 1, 3, 8, [2, 2, 4]]),
)
def test_projected_read_equals_projection_of_the_full_read(
    tmp_path_factory: pytest.TempPathFactory, layers: list[int], group: int | list[int] | None
) -> None:
    table = _table()
    path = write_rollouts(table, tmp_path_factory.mktemp("p") / "r.parquet", layer_group=group)
    full = read_rollouts(path)
    want = sorted(set(layers))
    got = read_rollouts(path, layers=layers)
    np.testing.assert_array_equal(_rows(got), _want(full, layers))
    assert route_layers(got) == tuple(want)
    spec = route_spec(got)
    assert (spec.num_layers, spec.topk, spec.num_experts) == (len(want), 2, 300)
    local_router = [i for i, g in enumerate(want) if g in SPEC.router_layers]
    assert spec.router_layers == tuple(local_router)
    validate_rollouts(got)  # a projected table is a valid rollout table of its own spec
    assert_rollouts_equal(got, project_layers(full, layers))  # in-memory == on-disk projection
    streamed = pa.concat_tables(iter_rollouts(path, layers=layers, batch_rows=2))
    assert_rollouts_equal(streamed, got)
    one = read_rollouts(path, row_groups=[0], layers=layers)
    assert_rollouts_equal(one, got)
    # the other columns are untouched
    assert got.drop_columns(["routes"]).equals(full.drop_columns(["routes"]))


@settings(max_examples=15, deadline=None)
@given(table=rollout_tables(), data=st.data())
def test_projection_of_random_tables_and_layouts(
    tmp_path_factory: pytest.TempPathFactory, table: pa.Table, data: st.DataObject
) -> None:
    spec = route_spec(table)
    layers = data.draw(
        st.lists(st.sampled_from(spec.router_layers), min_size=1, max_size=spec.num_layers)
    )
    path = write_rollouts(table, tmp_path_factory.mktemp("r") / "r.parquet")
    got = read_rollouts(path, layers=layers)
    rows = routes_to_numpy(_lists(table.column("routes")).flatten(), spec)
    np.testing.assert_array_equal(_rows(got), rows[:, sorted(set(layers))])
    assert (
        got.column("routes").to_pylist()
        == project_layers(table, layers).column("routes").to_pylist()
    )


def test_projected_root_read_and_columns(tmp_path: Path) -> None:
    for s in (0, 1):
        write_rollouts(_table(s), tmp_path, step=s, layer_group=2)
    got = read_rollouts(tmp_path, layers=[2, 3], columns=["trajectory_id", "routes", "step"])
    assert got.schema.names == ["trajectory_id", "routes", "step"]
    assert got.column("step").to_pylist() == [0] * 5 + [1] * 5
    full = pa.concat_tables([_table(0), _table(1)])
    np.testing.assert_array_equal(_rows(got), _rows(full)[:, [2, 3]])
    assert route_layers(got) == (2, 3)


def test_a_written_projection_reads_back_and_maps_global_layers(tmp_path: Path) -> None:
    path = write_rollouts(_table(), tmp_path / "r.parquet")
    stage = read_rollouts(path, layers=[4, 5, 6, 7])
    again = write_rollouts(stage, tmp_path / "stage.parquet")
    back = read_rollouts(again)
    assert_rollouts_equal(back, stage)
    two = read_rollouts(again, layers=[6, 7])  # global ids, mapped through route_layers
    np.testing.assert_array_equal(_rows(two), _rows(_table())[:, [6, 7]])
    assert route_layers(two) == (6, 7)
    with pytest.raises(RouteShapeError, match=r"\[1\]"):  # C2: name the missing layers
        read_rollouts(again, layers=[1, 6])


def test_full_tables_report_every_layer_and_bad_metadata_is_refused() -> None:
    table = _table()
    assert route_layers(table) == tuple(range(8))
    assert r3arrow.table.route_layers(table) == tuple(range(8))
    meta = {**(table.schema.metadata or {}), ROUTE_LAYERS_KEY: b"[3, 1]"}
    with pytest.raises(SchemaError, match=r"r3arrow\.route_layers"):
        route_layers(table.replace_schema_metadata(meta))
    off = pa.table({"a": [1]})
    with pytest.raises(SchemaError, match="R3 off"):
        route_layers(off)


def test_layers_argument_misuse() -> None:
    table = _table()
    with pytest.raises(ValueError, match=r"\[0, 8\)"):
        project_layers(table, [8])
    with pytest.raises(ValueError, match="at least one layer"):
        project_layers(table, [])
    with pytest.raises(TypeError, match="layers"):
        project_layers(table, "12")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="router layer"):
        project_layers(table, [0, 4])  # dense layers only


# ------------------------------------------------------------- raw storage
def test_a_tiny_budget_streams_a_row_at_a_time(tmp_path: Path) -> None:
    table = _table()
    path = write_rollouts(table, tmp_path / "r.parquet", layer_group=3, row_group_rows=2)
    streamed = list(iter_rollouts(path, max_memory=1))  # a row at a time
    assert [t.num_rows for t in streamed] == [1] * 5
    assert_rollouts_equal(pa.concat_tables(streamed), table)
    projected = list(iter_rollouts(path, layers=[1, 6], max_memory=1))
    assert [t.num_rows for t in projected] == [1] * 5
    np.testing.assert_array_equal(_rows(pa.concat_tables(projected)), _rows(table)[:, [1, 6]])


def test_route_rows_reads_raw_layer_group_storage(tmp_path: Path) -> None:
    path = write_rollouts(_table(), tmp_path / "r.parquet", layer_group=3)
    rows, _ = route_rows(pq.read_table(path).column("routes"), SPEC, "routes")
    np.testing.assert_array_equal(rows, _rows(_table()))


def test_multi_chunk_routes_are_written_chunk_by_chunk(tmp_path: Path) -> None:
    a, b = _table(1), _table(2)
    both = pa.concat_tables([a, b])  # two chunks (chunked routes): never combined on write
    assert both.column("routes").num_chunks == 2
    path = write_rollouts(both, tmp_path / "r.parquet")
    assert_rollouts_equal(read_rollouts(path), both)
    got = read_rollouts(path, layers=[5])
    np.testing.assert_array_equal(_rows(got), _rows(both)[:, [5]])


# ----------------------------------------------------------- bytes from disk
def _rchar() -> int:
    with open("/proc/self/io") as fh:
        return int(next(line for line in fh if line.startswith("rchar:")).split()[1])


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="needs Linux /proc/self/io")
def test_a_stage_of_four_reads_a_quarter_of_the_route_bytes(tmp_path: Path) -> None:
    spec = RouteSpec(num_layers=16, topk=8, num_experts=128)
    table = random_rollouts(np.random.default_rng(3), spec, [(64, 448, 512)] * 32)
    path = write_rollouts(table, tmp_path / "r.parquet")  # default: 8 groups of 2 layers
    route_bytes = 32 * 512 * spec.row_nbytes

    def read_bytes(**kw: Any) -> int:
        before = _rchar()
        read_rollouts(path, validate=False, **kw)
        return _rchar() - before

    # fixed costs (footers: every open reads 64 KiB) and a small column, read alike
    overhead = read_bytes(columns=["trajectory_id"])
    full = read_bytes(columns=["trajectory_id", "routes"]) - overhead
    stage = read_bytes(columns=["trajectory_id", "routes"], layers=range(4, 8)) - overhead
    assert full >= 0.99 * route_bytes, (full, route_bytes)
    assert stage <= 0.3 * route_bytes, (stage, route_bytes)  # 2 of 8 groups: ~0.25


# ------------------------------------------------------------- corruption
def _rewrite(path: Path, meta: dict[bytes, bytes], *, seal: bool = True) -> None:
    table = pq.read_table(path)
    pq.write_table(
        table.replace_schema_metadata(sealed(meta) if seal else meta),
        path,
        use_compliant_nested_type=False,
    )


@pytest.mark.parametrize(
    "groups",
    [[[0, 4], [4, 8]], [[0, 2], [2, 4], [4, 6]], [[0, 3], [2, 8]], "x", [[0, 2.5]]],
    ids=["other-split", "short", "overlap", "not-a-list", "float"],
)
def test_storage_groups_that_disagree_with_the_columns_raise_with_path(
    tmp_path: Path, groups: object
) -> None:
    path = write_rollouts(_table(), tmp_path / "r.parquet", layer_group=2)
    meta = dict(pq.ParquetFile(path).schema_arrow.metadata or {})
    info = orjson.loads(meta[STORAGE_KEY])
    meta[STORAGE_KEY] = orjson.dumps({**info, "groups": groups})
    _rewrite(path, meta)
    for read in (
        lambda: read_rollouts(path),
        lambda: read_rollouts(path, layers=[1]),
        lambda: list(iter_rollouts(path)),
        lambda: read_rollouts(path, row_groups=[0]),
    ):
        with pytest.raises(R3ArrowError) as info_:
            read()
        assert info_.value.path == str(path)


def test_unsealed_group_metadata_edit_is_caught(tmp_path: Path) -> None:
    path = write_rollouts(_table(), tmp_path / "r.parquet", layer_group=2)
    meta = dict(pq.ParquetFile(path).schema_arrow.metadata or {})
    meta[STORAGE_KEY] = meta[STORAGE_KEY].replace(b"[0,2]", b"[0,1]")
    _rewrite(path, meta, seal=False)
    with pytest.raises(SchemaError, match="meta_sha256") as info:
        read_rollouts(path, layers=[1])
    assert info.value.path == str(path)


def test_a_group_column_of_the_wrong_width_raises_with_path(tmp_path: Path) -> None:
    """A file whose group leaf does not match its recorded group (a forged file)."""
    table = _table()
    path = write_rollouts(table, tmp_path / "r.parquet", layer_group=4)
    raw = pq.read_table(path)
    meta = dict(raw.schema.metadata or {})
    # rebuild the struct with a narrower second field (3 layers instead of 4)
    lists = _lists(raw.column("routes"))
    struct = cast("pa.StructArray", lists.values)
    first = struct.field(0)
    values = cast("list[bytes]", struct.field(1).to_pylist())
    narrow = pa.array([v[: 3 * 2 * 2] for v in values], pa.binary(12))
    bad = pa.StructArray.from_arrays([first, narrow], names=["l0_4", "l4_8"])
    col = pa.LargeListArray.from_arrays(lists.offsets, bad)
    forged = raw.set_column(raw.schema.get_field_index("routes"), "routes", col)
    pq.write_table(
        forged.replace_schema_metadata(sealed(meta)), path, use_compliant_nested_type=False
    )
    with pytest.raises(SchemaError, match="layer-group") as info:
        read_rollouts(path)
    assert info.value.path == str(path)
    assert SPEC_METADATA_KEY in meta


# ----------------------------------------------------- stored layer groups
def test_scanned_files_expose_their_stored_layer_groups(tmp_path: Path) -> None:
    """`RolloutFile.layer_groups`: global ids per stored group; None for other layouts."""
    write_rollouts(_table(0), tmp_path, step=0, layer_group=[3, 5])
    write_rollouts(_table(1), tmp_path, step=1)  # default: max(1, 8 // 8) = 1 layer each
    files = r3arrow.io.rollout_files(tmp_path)
    assert files[0].layer_groups == ((0, 1, 2), (3, 4, 5, 6, 7))
    assert files[1].layer_groups == tuple((i,) for i in range(8))
    portable = write_rollouts(_table(), tmp_path / "p.parquet", portable=True)
    assert r3arrow.io.rollout_files(portable)[0].layer_groups is None
    stage = read_rollouts(files[0].path, layers=[2, 4, 6])  # projected: global ids
    again = write_rollouts(stage, tmp_path / "stage.parquet", layer_group=[1, 2])
    assert r3arrow.io.rollout_files(again)[0].layer_groups == ((2,), (4, 6))


def test_an_empty_routes_chunk_encodes_and_reads_back(tmp_path: Path) -> None:
    table = _table()
    empty = table.slice(0, 0)
    path = write_rollouts(empty, tmp_path / "e.parquet")
    assert read_rollouts(path).num_rows == 0
    assert read_rollouts(path, layers=[1, 2]).num_rows == 0
    # a chunk of trajectories without route rows (all lists empty), beside a full chunk
    none = random_rollouts(np.random.default_rng(1), SPEC, [(2, 2, 0), (1, 3, 0)])
    both = pa.concat_tables([none, table])
    back = read_rollouts(write_rollouts(both, tmp_path / "b.parquet"))
    assert_rollouts_equal(back, both)
