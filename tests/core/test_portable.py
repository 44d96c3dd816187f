"""Portable routes storage (r3arrow.io._portable): generic tools read integers, r3arrow reads exact.

Every third-party reader runs on a real Parquet file written from `to_portable`.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any, cast

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given

from r3arrow.errors import SchemaError
from r3arrow.io import read_rollouts, route_rows
from r3arrow.io._portable import PORTABLE_FORMAT, portable_type, to_portable
from r3arrow.io._project import STORAGE_KEY
from r3arrow.io._storage import restore
from r3arrow.spec import SPEC_METADATA_KEY, RouteSpec, routes_to_numpy
from r3arrow.testing import assert_rollouts_equal, random_rollouts
from r3arrow.testing.strategies import rollout_tables

# uint16 ids: wider than a byte, so a tool that reads bytes cannot pass by accident.
SPEC = RouteSpec(num_layers=4, topk=2, num_experts=300, moe_layers=(1, 2, 3))


def _write(table: pa.Table, path: Path) -> Path:
    """A portable rollout file, written the way `write_rollouts(portable=True)` does."""
    pq.write_table(to_portable(table), path, use_compliant_nested_type=False)
    return path


def _expected(table: pa.Table) -> list[np.ndarray]:
    """Per trajectory, its routes ``[T, L, K]`` (storage dtype)."""
    col = cast("pa.LargeListArray[Any]", table.column("routes").combine_chunks())
    rows = routes_to_numpy(col.flatten(), SPEC)
    return [rows[a:b] for a, b in itertools.pairwise(np.asarray(col.offsets))]


@pytest.fixture
def table(rng: np.random.Generator) -> pa.Table:
    return random_rollouts(rng, SPEC, [(5, 4, 9), (3, 6, 8), (4, 2, 0), (2, 5, 5)])


@pytest.fixture
def portable_file(tmp_path: Path, table: pa.Table) -> Path:
    return _write(table, tmp_path / "p.parquet")


def _check_ints(got: list[Any], want: list[np.ndarray]) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        arr = np.asarray(g, dtype=np.int64).reshape(w.shape)
        np.testing.assert_array_equal(arr, w.astype(np.int64))


def test_to_portable_type_and_metadata(table: pa.Table) -> None:
    out = to_portable(table)
    assert out.schema.field("routes").type == portable_type(SPEC)
    assert out.schema.field("routes").type == pa.large_list(pa.list_(pa.list_(pa.uint16())))
    assert PORTABLE_FORMAT.encode() in (out.schema.metadata or {})[STORAGE_KEY]
    assert_rollouts_equal(restore(out), table)


def test_r3arrow_round_trip_is_exact(portable_file: Path, table: pa.Table) -> None:
    back = read_rollouts(portable_file)
    assert back.schema.field("routes").type == SPEC.routes_type
    assert_rollouts_equal(back, table)
    rows, lengths = route_rows(pq.read_table(portable_file).column("routes"), SPEC, "routes")
    np.testing.assert_array_equal(rows, np.concatenate(_expected(table)))
    assert lengths.tolist() == [9, 8, 0, 5]


@given(rollout_tables())
def test_round_trip_any_spec_and_layout(t: pa.Table) -> None:
    assert_rollouts_equal(restore(to_portable(t)), t)


def test_pandas_reads_integers(portable_file: Path, table: pa.Table) -> None:
    pd = pytest.importorskip("pandas")

    df = pd.read_parquet(portable_file)
    cells = [np.array([np.stack(tok) for tok in row]) for row in df["routes"]]
    for c in cells:
        assert c.size == 0 or c.dtype == np.uint16
    _check_ints(cells, _expected(table))


def test_polars_reads_integers(portable_file: Path, table: pa.Table) -> None:
    pl = pytest.importorskip("polars")

    df = pl.read_parquet(portable_file)
    assert df.schema["routes"] == pl.List(pl.List(pl.List(pl.UInt16)))
    _check_ints(df["routes"].to_list(), _expected(table))


def test_duckdb_reads_integers(portable_file: Path, table: pa.Table) -> None:
    duckdb = pytest.importorskip("duckdb")
    rel = duckdb.sql(f"SELECT routes FROM read_parquet('{portable_file}')")
    assert str(rel.types[0]) == "USMALLINT[][][]"
    _check_ints([r[0] for r in rel.fetchall()], _expected(table))
    # and SQL sees the ids: the first expert of layer 1 of token 0 of trajectory 0
    first = duckdb.sql(f"SELECT routes[1][2][1] FROM read_parquet('{portable_file}')").fetchall()
    assert first[0][0] == int(_expected(table)[0][0, 1, 0])


def test_datasets_reads_integers(portable_file: Path, table: pa.Table, tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    d = datasets.Dataset.from_parquet(str(portable_file), cache_dir=str(tmp_path / "hf"))
    got = [d.with_format("numpy")[i]["routes"] for i in range(d.num_rows)]
    for g in got:
        assert g.size == 0 or np.issubdtype(g.dtype, np.integer)  # an empty row is dtype object
    _check_ints(got, _expected(table))
    frame = d.to_pandas()
    _check_ints([[np.stack(tok) for tok in row] for row in frame["routes"]], _expected(table))


def test_wrong_shape_portable_column_is_refused(table: pa.Table) -> None:
    out = to_portable(table)
    bad_spec = RouteSpec(num_layers=4, topk=3, num_experts=300, moe_layers=(1, 2, 3))
    meta = {**(out.schema.metadata or {})}
    meta[SPEC_METADATA_KEY] = bad_spec.to_json()
    with pytest.raises(SchemaError, match=r"routes.*ids per layer"):
        restore(out.replace_schema_metadata(meta))


def test_portable_slices_and_chunks(table: pa.Table) -> None:
    t = pa.concat_tables([table.slice(1, 2), table.slice(0, 1)])
    assert_rollouts_equal(restore(to_portable(t)), t)
