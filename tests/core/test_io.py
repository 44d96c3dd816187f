"""Persistence (r3arrow.io): Parquet and Arrow IPC round trips, step directories, atomicity, errors.

Everything runs on real files in temporary directories; the crash test really SIGKILLs a
writer process mid-write.
"""

from __future__ import annotations

import decimal
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st

import r3arrow
from r3arrow.errors import SchemaError, TerminalGapError
from r3arrow.io import (
    iter_rollouts,
    read_rollouts,
    rollout_files,
    write_ipc,
    write_rollouts,
)
from r3arrow.io import route_rows as io_route_rows
from r3arrow.io._storage import restore, to_storage
from r3arrow.spec import RouteSpec, routes_to_numpy
from r3arrow.table import rollout_schema, route_spec

REPO = Path(__file__).resolve().parents[2]


# ------------------------------------------------------------------- builders
def make_routes(rng: np.random.Generator, rows: int, spec: RouteSpec) -> np.ndarray:
    """Valid routes ``[rows, L, K]``: K distinct ids in ``[0, E)`` on router layers, 0 on dense."""
    e = spec.num_experts or 256
    out = np.zeros((rows, spec.num_layers, spec.topk), dtype=spec.dtype)
    layers = list(spec.router_layers)
    starts = rng.integers(0, e, size=(rows, len(layers), 1), dtype=np.int64)
    out[:, layers, :] = ((starts + np.arange(spec.topk)) % e).astype(spec.dtype)
    if rows:  # the largest ids must survive too
        out[rng.integers(rows), layers[-1], :] = ((e - 1 - np.arange(spec.topk)) % e).astype(
            spec.dtype
        )
    return out


def make_table(
    rng: np.random.Generator,
    spec: RouteSpec,
    shapes: list[tuple[int, int, int]],
    *,
    extras: tuple[str, ...] = (),
    tag: str = "t",
) -> pa.Table:
    """A valid rollout table; ``shapes``: (prompt length, response length, captured rows) per row.

    Response tokens whose route row is missing (terminal gap) get loss mask 0, the others random.
    """
    b = len(shapes)
    prompts = [rng.integers(0, 50_000, p).astype(np.int32) for p, _, _ in shapes]
    responses = [rng.integers(0, 50_000, r).astype(np.int32) for _, r, _ in shapes]
    masks = []
    for p, r, c in shapes:
        m = rng.integers(0, 2, r).astype(np.uint8)
        m[p + np.arange(r) > c] = 0  # target p+j needs row p+j-1 < c
        masks.append(m)
    routes = [make_routes(rng, c, spec) for _, _, c in shapes]
    cols: dict[str, Any] = {name: EXTRA_KINDS[name](rng, shapes) for name in extras}
    return r3arrow.rollout_table(
        trajectory_id=[f"{tag}-{i}" for i in range(b)],
        group_id=[f"g{i // 2}" for i in range(b)],
        prompt_ids=[p.tolist() for p in prompts],
        response_ids=[r.tolist() for r in responses],
        loss_mask=[m.tolist() for m in masks],
        reward=rng.random(b),
        routes=routes,
        spec=spec,
        **cols,
    )


def _nulls(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.random(n) < 0.3


EXTRA_KINDS: dict[str, Any] = {
    "x_int64": lambda rng, s: pa.array(
        rng.integers(-(2**62), 2**62, len(s)), type=pa.int64(), mask=_nulls(rng, len(s))
    ),
    "x_uint16": lambda rng, s: pa.array(rng.integers(0, 2**16, len(s)).astype(np.uint16)),
    "x_float32": lambda rng, s: pa.array(rng.standard_normal(len(s)).astype(np.float32)),
    "x_bool": lambda rng, s: pa.array(rng.random(len(s)) < 0.5),
    "x_string": lambda rng, s: pa.array(
        [f"ünï-{i}-{'x' * int(k)}" for i, k in enumerate(rng.integers(0, 5, len(s)))]
    ),
    "x_large_string": lambda rng, s: pa.array(
        [None if k == 0 else "é" * int(k) for k in rng.integers(0, 4, len(s))],
        type=pa.large_string(),
    ),
    # a per-token column beside the routes (sampled logprobs), ragged like them
    "x_logprobs": lambda rng, s: pa.array(
        [rng.standard_normal(c).astype(np.float32) for _, _, c in s],
        type=pa.large_list(pa.float32()),
    ),
    "x_list_int": lambda rng, s: pa.array(
        [list(range(int(k))) for k in rng.integers(0, 4, len(s))], type=pa.list_(pa.int16())
    ),
    # a fixed_size_list that is not the routes column must not be touched by the routes storage
    "x_fsl": lambda rng, s: pa.FixedSizeListArray.from_arrays(
        pa.array(rng.integers(0, 255, 3 * len(s)).astype(np.uint8)), 3
    ),
    "x_struct": lambda rng, s: pa.StructArray.from_arrays(
        [
            pa.array(rng.integers(0, 9, len(s)).astype(np.int32)),
            pa.array([f"s{i}" for i in range(len(s))]),
        ],
        names=["a", "b"],
    ),
    "x_timestamp": lambda rng, s: pa.array(
        rng.integers(0, 2**40, len(s)), type=pa.timestamp("us", tz="UTC")
    ),
    "x_binary": lambda rng, s: pa.array(
        [bytes(rng.integers(0, 256, int(k)).astype(np.uint8)) for k in rng.integers(0, 6, len(s))]
    ),
    "x_decimal": lambda rng, s: pa.array(
        [decimal.Decimal(int(v)) / 100 for v in rng.integers(-(10**6), 10**6, len(s))],
        type=pa.decimal128(12, 2),
    ),
}


def assert_same_table(got: pa.Table, want: pa.Table) -> None:
    """Same columns, types (up to list child names), nullability, values and schema metadata."""
    assert got.schema.names == want.schema.names
    assert got.schema.metadata == want.schema.metadata
    for name in want.schema.names:
        gf, wf = got.schema.field(name), want.schema.field(name)
        assert gf.type == wf.type, (name, gf.type, wf.type)
        assert gf.nullable == wf.nullable, name
        assert got.column(name).equals(want.column(name)), name


def route_rows(table: pa.Table) -> np.ndarray:
    col: Any = table.column("routes").combine_chunks()
    return routes_to_numpy(col.flatten()).copy()


def _chunk(col: pa.ChunkedArray[Any]) -> Any:
    """The first chunk of a list column (typed loosely: the list accessors vary by type)."""
    return col.chunk(0)


def steps_of(root: Path) -> list[int]:
    """The steps of a root's partitions, ascending (what ``rollout_files`` finds)."""
    return sorted({f.step for f in rollout_files(root) if f.step is not None})


def piece_step(piece: pa.Table) -> int | None:
    """The step of a piece of ``iter_rollouts`` (its ``step`` column), ``None`` without one."""
    if "step" not in piece.schema.names or piece.num_rows == 0:
        return None
    steps = {int(s) for s in piece.column("step").to_numpy()}
    assert len(steps) == 1, f"a piece spans steps {sorted(steps)}"
    return steps.pop()


def pieces(source: Any, **kwargs: Any) -> list[tuple[int | None, pa.Table]]:
    """``(step, piece)`` of every piece ``iter_rollouts`` yields."""
    return [(piece_step(t), t) for t in iter_rollouts(source, **kwargs)]


def temp_leftovers(directory: Path) -> list[Path]:
    return [p for p in directory.rglob("*") if ".tmp-" in p.name]


# ------------------------------------------------------------- hypothesis cases
@st.composite
def specs(draw: st.DrawFn) -> RouteSpec:
    topk = draw(st.integers(1, 4))
    width = draw(st.sampled_from(["uint8", "uint16", "int32"]))
    lo, hi = {"uint8": (topk, 256), "uint16": (257, 65_536), "int32": (65_537, 2**31 - 1)}[width]
    num_experts = draw(st.integers(max(lo, topk), hi))
    num_layers = draw(st.integers(1, 6))
    moe = draw(st.none() | st.sets(st.integers(0, num_layers - 1), min_size=1))
    spec = RouteSpec(
        num_layers=num_layers,
        topk=topk,
        num_experts=num_experts,
        moe_layers=tuple(moe) if moe else None,
    )
    assert spec.dtype == np.dtype(width)
    return spec


@st.composite
def row_shapes(draw: st.DrawFn) -> list[tuple[int, int, int]]:
    out = []
    for _ in range(draw(st.integers(0, 6))):
        p = draw(st.integers(0, 8))
        r = draw(st.integers(0, 8))
        c = draw(st.integers(0, p + r) | st.just(0))  # zero-row trajectories often
        out.append((p, r, c))
    return out


@st.composite
def rollout_tables(draw: st.DrawFn) -> pa.Table:
    spec = draw(specs())
    shapes = draw(row_shapes())
    extras = tuple(draw(st.lists(st.sampled_from(sorted(EXTRA_KINDS)), unique=True, max_size=5)))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    table = make_table(rng, spec, shapes, extras=extras)
    # slices and multi-chunk columns are what filtering and concatenation produce
    layout = draw(st.sampled_from(["plain", "slice", "chunks"]))
    n = table.num_rows
    if layout == "slice" and n:
        start = draw(st.integers(0, n))
        table = table.slice(start, draw(st.integers(0, n - start)))
    elif layout == "chunks" and n:
        k = draw(st.integers(0, n))
        table = pa.concat_tables([table.slice(0, k), table.slice(k)])
    if draw(st.booleans()):
        meta = {**(table.schema.metadata or {}), b"user.note": "über".encode(), b"user.run": b"42"}
        table = table.replace_schema_metadata(meta)
    return table


@given(
    table=rollout_tables(),
    compression=st.sampled_from(["none", "zstd"]),
    row_group_rows=st.none() | st.integers(1, 3),
)
def test_parquet_round_trip_is_exact(
    table: pa.Table, compression: str, row_group_rows: int | None
) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "r.parquet"
        written = write_rollouts(
            table, path, compression=compression, row_group_rows=row_group_rows
        )
        assert written == path
        got = read_rollouts(path)
    assert_same_table(got, table)
    assert route_spec(got) == route_spec(table)
    np.testing.assert_array_equal(route_rows(got), route_rows(table))
    assert route_rows(got).dtype == route_spec(table).dtype


@given(table=rollout_tables())
def test_ipc_round_trip_is_exact(table: pa.Table) -> None:
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "r.arrow"
        assert write_ipc(table, path) == path
        got = read_rollouts(path)
        # IPC keeps the Arrow schema verbatim: field names of list children included
        assert got.schema.equals(table.schema, check_metadata=True)
        assert got.equals(table, check_metadata=True)
        np.testing.assert_array_equal(route_rows(got), route_rows(table))
        del got  # the memory map must be released before the directory goes


@pytest.mark.parametrize("num_experts", [8, 300, 70_000])
def test_parquet_schema_exact_including_list_field_names(tmp_path: Path, num_experts: int) -> None:
    """The Arrow schema read back equals the one written (Table.equals with metadata), not just
    the values."""
    spec = RouteSpec(num_layers=3, topk=2, num_experts=num_experts)
    table = make_table(
        np.random.default_rng(5), spec, [(3, 4, 6), (2, 2, 0)], extras=("x_logprobs",)
    )
    table = table.replace_schema_metadata({**table.schema.metadata, b"user.note": b"kept"})
    write_rollouts(table, tmp_path / "r.parquet")
    got = read_rollouts(tmp_path / "r.parquet")
    assert got.schema.equals(table.schema, check_metadata=True), (
        f"schema changed in the round trip:\n{got.schema}\n!=\n{table.schema}"
    )
    assert got.equals(table, check_metadata=True)


def test_zero_row_trajectories_and_empty_table_round_trip(tmp_path: Path) -> None:
    spec = RouteSpec(num_layers=2, topk=2, num_experts=300)
    rng = np.random.default_rng(0)
    table = make_table(rng, spec, [(3, 0, 0), (0, 2, 0), (2, 3, 4), (1, 1, 0)])
    assert list(r3arrow.table.captured_lengths(table)) == [0, 0, 4, 0]
    write_rollouts(table, tmp_path / "a.parquet")
    assert_same_table(read_rollouts(tmp_path / "a.parquet"), table)
    empty = table.slice(0, 0)
    write_rollouts(empty, tmp_path / "e.parquet")
    got = read_rollouts(tmp_path / "e.parquet")
    assert got.num_rows == 0
    assert_same_table(got, empty)
    write_ipc(empty, tmp_path / "e.arrow")
    assert read_rollouts(tmp_path / "e.arrow").equals(empty, check_metadata=True)


# ------------------------------------------------------------- storage layout
@pytest.mark.parametrize(("num_experts", "itemsize"), [(128, 1), (1000, 2), (100_000, 4)])
def test_routes_stored_as_fixed_size_binary_layer_groups(
    tmp_path: Path, num_experts: int, itemsize: int
) -> None:
    """Layer-group storage (docs/storage.md): one fixed_size_binary leaf per group of layers."""
    spec = RouteSpec(num_layers=5, topk=3, num_experts=num_experts)
    table = make_table(
        np.random.default_rng(1), spec, [(200, 100, 299), (50, 400, 300), (10, 10, 0)]
    )
    path = write_rollouts(table, tmp_path / "r.parquet", layer_group=2)
    pf = pq.ParquetFile(path)
    leaves = {c.path: c for c in (pf.schema.column(i) for i in range(len(pf.schema)))}
    routes_leaf = [c for p, c in leaves.items() if p.split(".")[0] == "routes"]
    assert [c.path for c in routes_leaf] == [
        "routes.list.item.l0_2",
        "routes.list.item.l2_4",
        "routes.list.item.l4_5",
    ]
    assert all(c.physical_type == "FIXED_LEN_BYTE_ARRAY" for c in routes_leaf)
    assert [c.length for c in routes_leaf] == [2 * 3 * itemsize, 2 * 3 * itemsize, 3 * itemsize]
    # stored bytes of the routes column ≈ raw bytes (no per-value levels, no widening)
    idx = [i for i in range(len(pf.schema)) if pf.schema.column(i).path.startswith("routes.")]
    stored = sum(
        pf.metadata.row_group(g).column(i).total_uncompressed_size
        for g in range(pf.num_row_groups)
        for i in idx
    )
    raw = 599 * spec.row_nbytes
    assert stored <= 1.05 * raw + 3 * 1024, (stored, raw)
    # the file describes itself: the spec is in the Parquet key-value metadata
    assert RouteSpec.from_json((pf.metadata.metadata or {})[b"r3arrow.spec"]) == route_spec(table)


def test_restore_from_storage_is_zero_copy(tmp_path: Path) -> None:
    spec = RouteSpec(num_layers=4, topk=2, num_experts=1000)
    table = make_table(np.random.default_rng(2), spec, [(30, 20, 49), (5, 5, 0), (10, 40, 50)])
    path = write_rollouts(table, tmp_path / "r.parquet", layer_group=4)  # one layer group
    raw = pq.read_table(path)  # the storage form: large_list<struct<l0_4: fixed_size_binary>>
    binary = _chunk(raw.column("routes")).values.field(0)
    assert binary.type == pa.binary(spec.row_nbytes)
    restored = restore(raw)
    assert restored.column("routes").type == spec.routes_type
    view = routes_to_numpy(_chunk(restored.column("routes")).flatten())
    data = binary.buffers()[1]
    assert view.ctypes.data == data.address + binary.offset * spec.row_nbytes
    assert view.nbytes <= data.size
    np.testing.assert_array_equal(view, route_rows(table))


def test_to_storage_is_zero_copy_and_inverse_of_restore() -> None:
    spec = RouteSpec(num_layers=3, topk=4, num_experts=64)
    table = make_table(np.random.default_rng(3), spec, [(4, 4, 7), (6, 2, 8), (3, 3, 1)]).slice(1)
    storage = to_storage(table, layer_group=3)  # one layer group: the rows as they are
    binary = _chunk(storage.column("routes")).values.field(0)
    assert binary.type == pa.binary(spec.row_nbytes)
    src = routes_to_numpy(_chunk(table.column("routes")).flatten())
    assert binary.buffers()[1].address + binary.offset * spec.row_nbytes == src.ctypes.data
    assert_same_table(restore(storage), table)


_READ_PEAK = """
import json, sys
import pyarrow as pa
import pyarrow.parquet as pq
import r3arrow
if sys.argv[2] == "storage":
    t = pq.ParquetFile(sys.argv[1]).read()  # what Parquet itself needs for the stored columns
else:
    t = r3arrow.read_rollouts(sys.argv[1])
print(json.dumps({"peak": pa.default_memory_pool().max_memory(), "rows": t.num_rows}))
"""


def _read_peak(path: Path, mode: str) -> int:
    out = subprocess.run(
        [sys.executable, "-c", _READ_PEAK, str(path), mode],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
        env=_child_env(),
    )
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["rows"] == 3
    return int(res["peak"])


@pytest.mark.parametrize(("layer_group", "copies"), [(48, 0), (None, 1)])
def test_read_rollouts_copies_routes_at_most_once(
    tmp_path: Path, layer_group: int | None, copies: int
) -> None:
    """Peak Arrow memory of read_rollouts ≈ reading the stored columns + the interleave copy.

    One stored group restores zero-copy; several groups cost exactly one copy of the
    routes (the interleave output is allocated from Arrow's pool, so it is counted).
    """
    spec = RouteSpec(num_layers=48, topk=8, num_experts=128)
    table = make_table(
        np.random.default_rng(4), spec, [(6000, 10, 6009), (1, 8000, 8000), (2, 2, 0)]
    )
    routes_bytes = 14009 * spec.row_nbytes  # ~5.4 MB
    path = write_rollouts(table, tmp_path / "r.parquet", layer_group=layer_group)
    storage_peak = _read_peak(path, "storage")
    rollouts_peak = _read_peak(path, "rollouts")
    assert storage_peak >= routes_bytes  # the measurement sees the routes
    assert rollouts_peak < storage_peak + (copies + 0.25) * routes_bytes, (
        rollouts_peak,
        storage_peak,
        routes_bytes,
    )


# ------------------------------------------------------------------------ IPC
def test_read_ipc_is_memory_mapped(tmp_path: Path) -> None:
    spec = RouteSpec(num_layers=16, topk=4, num_experts=256)
    table = make_table(np.random.default_rng(6), spec, [(8000, 100, 8099), (100, 8000, 8000)])
    routes_bytes = 16099 * spec.row_nbytes  # ~1 MB
    path = write_ipc(table, tmp_path / "r.arrow")
    before = pa.total_allocated_bytes()
    mapped = read_rollouts(path)
    grown_mapped = pa.total_allocated_bytes() - before
    assert grown_mapped < routes_bytes / 10, grown_mapped
    assert mapped.equals(table, check_metadata=True)
    # the measurement can tell: a plain read does allocate the routes
    before = pa.total_allocated_bytes()
    with pa.OSFile(str(path), "rb") as source:
        copied = pa.ipc.open_file(source).read_all()
    assert pa.total_allocated_bytes() - before >= routes_bytes
    assert copied.equals(table, check_metadata=True)


# ------------------------------------------------------------ step directories
@pytest.fixture
def steps_root(tmp_path: Path) -> tuple[Path, dict[int, pa.Table]]:
    """Steps 0..3 under ``tmp_path/run``, step 1 in two parts. Returns root and rows per step."""
    spec = RouteSpec(num_layers=3, topk=2, num_experts=40)
    rng = np.random.default_rng(7)
    root = tmp_path / "run"
    per_step: dict[int, pa.Table] = {}
    for step in range(4):
        parts = 2 if step == 1 else 1
        tables = []
        for part in range(parts):
            t = make_table(
                rng,
                spec,
                [(3, 4, 5), (2, 2, 0), (1, 5, 6)][: 2 + part],
                extras=("x_logprobs",),
                tag=f"s{step}p{part}",
            )
            path = write_rollouts(t, root, step=step)
            assert path == root / f"step={step}" / f"part-{part:05d}.parquet"
            tables.append(t)
        per_step[step] = pa.concat_tables(tables)
    return root, per_step


def with_step(table: pa.Table, step: int) -> pa.Table:
    return table.append_column("step", pa.array(np.full(table.num_rows, step, dtype=np.int64)))


def test_step_directory_reads_as_one_table(steps_root: tuple[Path, dict[int, pa.Table]]) -> None:
    root, per_step = steps_root
    got = read_rollouts(root)
    assert got.schema.field("step").type == pa.int64()
    want = pa.concat_tables([with_step(per_step[s], s) for s in range(4)])
    assert_same_table(got, want)
    assert steps_of(root) == [0, 1, 2, 3]


def test_step_directory_select_steps(steps_root: tuple[Path, dict[int, pa.Table]]) -> None:
    root, per_step = steps_root
    got = read_rollouts(root, steps=[1, 3])
    assert_same_table(got, pa.concat_tables([with_step(per_step[1], 1), with_step(per_step[3], 3)]))
    assert read_rollouts(root, steps=[]).num_rows == 0


def test_step_directory_column_projection(steps_root: tuple[Path, dict[int, pa.Table]]) -> None:
    root, per_step = steps_root
    full = pa.concat_tables([with_step(per_step[s], s) for s in range(4)])
    with_routes = read_rollouts(root, columns=["trajectory_id", "routes", "step"], steps=[0, 2])
    assert with_routes.schema.names == ["trajectory_id", "routes", "step"]
    sub = pa.concat_tables([with_step(per_step[0], 0), with_step(per_step[2], 2)])
    assert with_routes.column("routes").type == route_spec(full).routes_type
    assert with_routes.column("routes").equals(sub.column("routes"))
    assert with_routes.column("step").equals(sub.column("step"))
    without = read_rollouts(root, columns=["trajectory_id", "reward"])
    assert "routes" not in without.schema.names
    assert without.column("trajectory_id").equals(full.column("trajectory_id"))
    assert without.column("reward").equals(full.column("reward"))
    assert route_spec(without) == route_spec(full)  # the spec still travels


def test_single_file_column_projection(tmp_path: Path) -> None:
    spec = RouteSpec(num_layers=2, topk=2, num_experts=500)
    table = make_table(np.random.default_rng(8), spec, [(3, 3, 5), (2, 2, 0)])
    path = write_rollouts(table, tmp_path / "r.parquet")
    only_routes = read_rollouts(path, columns=["routes"])
    assert only_routes.schema.names == ["routes"]
    assert only_routes.column("routes").equals(table.column("routes"))
    no_routes = read_rollouts(path, columns=["reward", "trajectory_id"])
    assert no_routes.schema.names == ["reward", "trajectory_id"]
    assert no_routes.column("reward").equals(table.column("reward"))


def test_step_directory_read_in_numeric_step_order(tmp_path: Path) -> None:
    """Steps 2 and 10: the one-table read follows step order (as rollout_files), not path order."""
    spec = RouteSpec(num_layers=2, topk=1, num_experts=4)
    rng = np.random.default_rng(9)
    tables = {s: make_table(rng, spec, [(2, 2, 3)], tag=f"s{s}") for s in (2, 10, 9)}
    for s, t in tables.items():
        write_rollouts(t, tmp_path, step=s)
    assert steps_of(tmp_path) == [2, 9, 10]
    got = read_rollouts(tmp_path)
    assert got.column("step").to_pylist() == [2, 9, 10]
    assert got.column("trajectory_id").to_pylist() == ["s2-0", "s9-0", "s10-0"]
    assert [s for s, _ in pieces(tmp_path)] == [2, 9, 10]


def test_iter_rollouts_yields_one_step_at_a_time(
    steps_root: tuple[Path, dict[int, pa.Table]],
) -> None:
    root, per_step = steps_root
    it = iter_rollouts(root)
    assert isinstance(it, Iterator)
    first = next(it)  # lazy: the first step arrives before the rest are read
    assert piece_step(first) == 0
    assert_same_table(first, with_step(per_step[0], 0))
    rest = [(piece_step(t), t) for t in it]
    assert [s for s, _ in rest] == [1, 2, 3]
    for s, t in rest:
        assert s is not None
        assert_same_table(t, with_step(per_step[s], s))
    picked = pieces(root, steps=[3, 1], columns=["trajectory_id", "step"])
    assert [s for s, _ in picked] == [1, 3]
    assert all(t.schema.names == ["trajectory_id", "step"] for _, t in picked)
    assert picked[0][1].column("trajectory_id").equals(per_step[1].column("trajectory_id"))


def test_iter_rollouts_over_a_file_in_batches(tmp_path: Path) -> None:
    spec = RouteSpec(num_layers=2, topk=2, num_experts=16)
    table = make_table(
        np.random.default_rng(10), spec, [(2, 3, 4), (1, 1, 0), (3, 3, 6), (2, 2, 1), (1, 4, 5)]
    )
    path = write_rollouts(table, tmp_path / "r.parquet")
    batches = pieces(path, batch_rows=2)
    assert [s for s, _ in batches] == [None, None, None]
    assert [t.num_rows for _, t in batches] == [2, 2, 1]
    assert_same_table(pa.concat_tables([t for _, t in batches]), table)
    (whole,) = list(iter_rollouts(path))
    assert "step" not in whole.schema.names  # a file outside a root has no step column
    assert_same_table(whole, table)


def test_rollout_files_ignores_other_entries(steps_root: tuple[Path, dict[int, pa.Table]]) -> None:
    root, _ = steps_root
    (root / "step=x").mkdir()
    (root / "notes").mkdir()
    (root / "step=7").write_bytes(b"a file, not a partition")
    assert steps_of(root) == [0, 1, 2, 3]


def test_step_directory_with_mixed_specs_is_rejected(tmp_path: Path) -> None:
    """Steps written with different route shapes of equal byte width must not be reinterpreted."""
    a = RouteSpec(num_layers=2, topk=2, num_experts=8)
    b = RouteSpec(num_layers=4, topk=1, num_experts=8)
    assert a.row_nbytes == b.row_nbytes
    rng = np.random.default_rng(11)
    write_rollouts(make_table(rng, a, [(2, 2, 3)]), tmp_path, step=0)
    write_rollouts(make_table(rng, b, [(2, 2, 3)]), tmp_path, step=1)
    with pytest.raises(SchemaError, match="spec"):
        read_rollouts(tmp_path)


def test_step_directory_with_different_widths_is_rejected(tmp_path: Path) -> None:
    rng = np.random.default_rng(12)
    write_rollouts(
        make_table(rng, RouteSpec(num_layers=2, topk=2, num_experts=8), [(2, 2, 3)]),
        tmp_path,
        step=0,
    )
    write_rollouts(
        make_table(rng, RouteSpec(num_layers=2, topk=2, num_experts=800), [(2, 2, 3)]),
        tmp_path,
        step=1,
    )
    with pytest.raises(SchemaError):
        read_rollouts(tmp_path)


# --------------------------------------------------------- corrupt and foreign
def _valid_parquet(path: Path) -> tuple[Path, pa.Table]:
    spec = RouteSpec(num_layers=4, topk=2, num_experts=32)
    table = make_table(np.random.default_rng(13), spec, [(50, 50, 99), (10, 10, 0)])
    return write_rollouts(table, path), table


def _truncate_half(p: Path) -> None:
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])


def _truncate_tail(p: Path) -> None:
    data = p.read_bytes()
    p.write_bytes(data[:-9])


def _random_bytes(p: Path) -> None:
    p.write_bytes(np.random.default_rng(0).integers(0, 256, 4096).astype(np.uint8).tobytes())


def _empty(p: Path) -> None:
    p.write_bytes(b"")


def _plain_parquet(p: Path) -> None:
    pq.write_table(pa.table({"a": [1, 2, 3], "routes": [b"x", b"y", b"z"]}), p)


def _ipc_rollout(p: Path) -> None:
    spec = RouteSpec(num_layers=2, topk=2, num_experts=8)
    write_ipc(make_table(np.random.default_rng(0), spec, [(2, 2, 3)]), p)


def _bad_spec_json(p: Path) -> None:
    storage = to_storage(read_rollouts(p))
    meta = {**storage.schema.metadata, b"r3arrow.spec": b"{not json"}
    pq.write_table(storage.replace_schema_metadata(meta), p)


def _spec_of_other_width(p: Path) -> None:
    storage = to_storage(read_rollouts(p))
    other = RouteSpec(num_layers=4, topk=2, num_experts=1000)  # 16 bytes per token, file has 8
    meta = {**storage.schema.metadata, b"r3arrow.spec": other.to_json()}
    pq.write_table(storage.replace_schema_metadata(meta), p)


@pytest.mark.parametrize(
    "spoil",
    [
        _truncate_half,
        _truncate_tail,
        _random_bytes,
        _empty,
        _plain_parquet,
        _bad_spec_json,
        _spec_of_other_width,
    ],
    ids=lambda f: f.__name__.strip("_"),
)
def test_corrupt_or_foreign_parquet_raises_schema_error_naming_path(
    tmp_path: Path, spoil: Any
) -> None:
    path, _ = _valid_parquet(tmp_path / "bad.parquet")
    spoil(path)
    with pytest.raises(SchemaError) as info:
        read_rollouts(path)
    assert str(path) in str(info.value)
    with pytest.raises(SchemaError) as info:
        list(iter_rollouts(path, batch_rows=1))
    assert str(path) in str(info.value)


def _plain_ipc(p: Path) -> None:
    t = pa.table({"a": [1, 2], "b": ["x", "y"]})
    with pa.OSFile(str(p), "wb") as sink, pa.ipc.new_file(sink, t.schema) as w:
        w.write_table(t)


def _parquet_instead(p: Path) -> None:
    _valid_parquet(p)


def _truncated_ipc(p: Path) -> None:
    _ipc_rollout(p)
    _truncate_half(p)


@pytest.mark.parametrize(
    "spoil",
    [_plain_ipc, _random_bytes, _empty, _truncated_ipc],
    ids=lambda f: f.__name__.strip("_"),
)
def test_corrupt_or_foreign_ipc_raises_schema_error_naming_path(tmp_path: Path, spoil: Any) -> None:
    path = tmp_path / "bad.arrow"
    spoil(path)
    with pytest.raises(SchemaError) as info:
        read_rollouts(path)
    assert str(path) in str(info.value)
    with pytest.raises(SchemaError) as info:
        list(iter_rollouts(path))
    assert str(path) in str(info.value)


def test_the_format_is_told_by_content_not_by_name(tmp_path: Path) -> None:
    """An IPC file named .parquet reads as IPC (ARROW1 magic), a Parquet file named .arrow as
    Parquet."""
    ipc = tmp_path / "ipc.parquet"
    _ipc_rollout(ipc)
    spec = RouteSpec(num_layers=2, topk=2, num_experts=8)
    want = make_table(np.random.default_rng(0), spec, [(2, 2, 3)])
    assert read_rollouts(ipc).equals(want, check_metadata=True)
    assert pa.concat_tables(iter_rollouts(ipc)).equals(want, check_metadata=True)
    parquet = tmp_path / "parquet.arrow"
    _parquet_instead(parquet)
    _, table = _valid_parquet(tmp_path / "same.parquet")
    assert_same_table(read_rollouts(parquet), table)


def test_corrupt_part_in_step_directory_raises_schema_error(
    steps_root: tuple[Path, dict[int, pa.Table]],
) -> None:
    root, _ = steps_root
    _truncate_half(root / "step=2" / "part-00000.parquet")
    with pytest.raises(SchemaError) as info:
        read_rollouts(root)
    assert str(root) in str(info.value)


def test_empty_directory_raises_schema_error(tmp_path: Path) -> None:
    with pytest.raises(SchemaError, match=re.escape(str(tmp_path))):
        read_rollouts(tmp_path)


def test_missing_paths_raise_file_not_found(tmp_path: Path) -> None:
    missing = tmp_path / "nope.parquet"
    with pytest.raises(FileNotFoundError, match="nope"):
        read_rollouts(missing)
    with pytest.raises(FileNotFoundError, match="nope"):
        read_rollouts(tmp_path / "nope.arrow")
    with pytest.raises(FileNotFoundError):
        list(iter_rollouts(missing))
    with pytest.raises(FileNotFoundError):
        rollout_files(tmp_path / "nope")


# ------------------------------------------------------------------ validation
def _hand_table(captured: int, loss_mask: list[int]) -> pa.Table:
    """One trajectory of 3 prompt + 2 response tokens built by hand (no validation on the way)."""
    spec = RouteSpec(num_layers=2, topk=2, num_experts=8)
    rows = (np.arange(captured * 4, dtype=np.uint8) % 8).reshape(captured, 2, 2)
    leaf = pa.array(rows.reshape(-1), type=pa.uint8())
    tokens = pa.FixedSizeListArray.from_arrays(pa.FixedSizeListArray.from_arrays(leaf, 2), 2)
    arrays = [
        pa.array(["t0"], type=pa.large_string()),
        pa.array(["g0"], type=pa.large_string()),
        pa.array([[1, 2, 3]], type=pa.large_list(pa.int32())),
        pa.array([[4, 5]], type=pa.large_list(pa.int32())),
        pa.array([loss_mask], type=pa.large_list(pa.uint8())),
        pa.array([1.0]),
        pa.LargeListArray.from_arrays(pa.array([0, captured], type=pa.int64()), tokens),
    ]
    return pa.Table.from_arrays(arrays, schema=rollout_schema(spec))


@pytest.mark.parametrize(
    ("captured", "loss_mask", "bad_token"),
    [(2, [0, 1], 4), (3, [0, 1], 4), (2, [1, 0], 3), (0, [1, 1], 3)],
)
def test_write_rejects_terminal_gap_violation(
    tmp_path: Path, captured: int, loss_mask: list[int], bad_token: int
) -> None:
    """Target token t needs route row t-1; writers validate before touching the disk."""
    bad = _hand_table(captured, loss_mask)
    with pytest.raises(TerminalGapError, match=f"token {bad_token}"):
        write_rollouts(bad, tmp_path / "bad.parquet")
    with pytest.raises(TerminalGapError):
        write_rollouts(bad, tmp_path / "run", step=0)
    with pytest.raises(TerminalGapError):
        write_ipc(bad, tmp_path / "bad.arrow")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    ("captured", "loss_mask"), [(3, [1, 0]), (4, [1, 1]), (2, [0, 0]), (0, [0, 0])]
)
def test_write_accepts_uncaptured_rows_without_loss(
    tmp_path: Path, captured: int, loss_mask: list[int]
) -> None:
    ok = _hand_table(captured, loss_mask)
    assert_same_table(read_rollouts(write_rollouts(ok, tmp_path / "ok.parquet")), ok)
    assert read_rollouts(write_ipc(ok, tmp_path / "ok.arrow")).equals(ok, check_metadata=True)


def test_write_rejects_table_without_spec(tmp_path: Path) -> None:
    no_spec = _hand_table(4, [1, 1]).replace_schema_metadata(None)
    with pytest.raises(SchemaError, match=r"r3arrow\.spec"):
        write_rollouts(no_spec, tmp_path / "nospec.parquet")
    with pytest.raises(SchemaError, match=r"r3arrow\.spec"):
        write_ipc(no_spec, tmp_path / "nospec.arrow")
    assert list(tmp_path.iterdir()) == []


def test_negative_step_is_rejected(tmp_path: Path) -> None:
    _, table = _valid_parquet(tmp_path / "x.parquet")
    with pytest.raises(ValueError, match="step"):
        write_rollouts(table, tmp_path / "run", step=-1)


# ----------------------------------------------------------------- compression
def test_zstd_compression_round_trips_and_is_used(tmp_path: Path) -> None:
    spec = RouteSpec(num_layers=8, topk=2, num_experts=4)  # low-entropy ids: compressible
    table = make_table(np.random.default_rng(14), spec, [(2000, 500, 2499), (100, 1000, 1100)])
    plain = write_rollouts(table, tmp_path / "none.parquet", compression="none")
    packed = write_rollouts(
        table, tmp_path / "zstd.parquet", compression="zstd", compression_level=3
    )
    assert_same_table(read_rollouts(packed), table)
    codecs = {
        pq.ParquetFile(p).metadata.row_group(0).column(i).compression
        for p in [packed]
        for i in range(7)
    }
    assert codecs == {"ZSTD"}
    assert {
        pq.ParquetFile(plain).metadata.row_group(0).column(i).compression for i in range(7)
    } == {"UNCOMPRESSED"}
    assert packed.stat().st_size < 0.7 * plain.stat().st_size


def test_unknown_compression_fails_without_leaving_files(tmp_path: Path) -> None:
    _, table = _valid_parquet(tmp_path / "keep.parquet")
    with pytest.raises((ValueError, pa.ArrowException)):
        write_rollouts(table, tmp_path / "x.parquet", compression="no-such-codec")
    assert not (tmp_path / "x.parquet").exists()
    assert temp_leftovers(tmp_path) == []


# ------------------------------------------------------------------ atomicity
def _write_then_raise(cls: Any) -> Any:
    """A ParquetWriter.write_table that writes a row group to the target, then fails."""
    real = cls.write_table

    def broken(self: Any, table: pa.Table, *args: Any, **kwargs: Any) -> None:
        real(self, table, *args, **kwargs)
        raise OSError("injected: disk full halfway through the write")

    return broken


def test_failed_parquet_write_leaves_nothing_or_the_previous_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old_path, old = _valid_parquet(tmp_path / "r.parquet")
    new = make_table(np.random.default_rng(15), route_spec(old), [(5, 5, 9)], tag="new")
    write_rollouts(old, tmp_path / "run", step=0)
    monkeypatch.setattr(pq.ParquetWriter, "write_table", _write_then_raise(pq.ParquetWriter))
    with pytest.raises(OSError, match="injected"):
        write_rollouts(new, tmp_path / "fresh.parquet")
    with pytest.raises(OSError, match="injected"):
        write_rollouts(new, old_path)
    with pytest.raises(OSError, match="injected"):
        write_rollouts(new, tmp_path / "run", step=0)
    with pytest.raises(OSError, match="injected"):
        write_rollouts(new, tmp_path / "run", step=1)
    monkeypatch.undo()
    assert not (tmp_path / "fresh.parquet").exists()
    assert_same_table(read_rollouts(old_path), old)
    assert_same_table(read_rollouts(tmp_path / "run"), with_step(old, 0))
    assert sorted(p.name for p in (tmp_path / "run" / "step=0").iterdir()) == ["part-00000.parquet"]
    assert temp_leftovers(tmp_path) == []


def test_failed_ipc_write_leaves_nothing_or_the_previous_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, old = _valid_parquet(tmp_path / "x.parquet")
    path = write_ipc(old, tmp_path / "r.arrow")
    real_new_file = pa.ipc.new_file

    class Broken:
        def __init__(self, sink: Any, schema: pa.Schema) -> None:
            self.writer = real_new_file(sink, schema)

        def __enter__(self) -> Broken:
            return self

        def __exit__(self, *exc: object) -> None:
            return None  # a crash: no footer

        def write_table(self, table: pa.Table) -> None:
            self.writer.write_batch(table.to_batches()[0])
            raise OSError("injected: failure after the first batch")

    monkeypatch.setattr(pa.ipc, "new_file", Broken)
    with pytest.raises(OSError, match="injected"):
        write_ipc(old.slice(1), path)
    with pytest.raises(OSError, match="injected"):
        write_ipc(old, tmp_path / "fresh.arrow")
    monkeypatch.undo()
    assert read_rollouts(path).equals(old, check_metadata=True)
    assert not (tmp_path / "fresh.arrow").exists()
    assert temp_leftovers(tmp_path) == []


_KILLED_WRITER = """
import sys
import numpy as np
import r3arrow
spec = r3arrow.RouteSpec(num_layers=48, topk=8, num_experts=128)
rng = np.random.default_rng(0)
n, tokens = 4, 4000
routes = [
    rng.integers(0, 16, (tokens, 48, 1)).astype(np.uint8) * 8 + np.arange(8, dtype=np.uint8)
    for _ in range(n)
]
table = r3arrow.rollout_table(
    trajectory_id=[f"big-{i}" for i in range(n)], group_id=["g"] * n,
    prompt_ids=[np.arange(tokens, dtype=np.int32)] * n, response_ids=[np.ones(1, np.int32)] * n,
    loss_mask=[np.zeros(1, np.uint8)] * n, reward=np.zeros(n), routes=routes, spec=spec,
)
print("ready", flush=True)
step = None if sys.argv[2] == "-" else int(sys.argv[2])
# zstd at its slowest level keeps the writer busy long enough to be killed mid-file
r3arrow.write_rollouts(table, sys.argv[1], step=step, compression="zstd", compression_level=22)
print("done", flush=True)
"""


def _child_env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


def _kill_mid_write(target: str, step: int | None, watch: Path) -> list[Path]:
    """Run the writer, SIGKILL it once its temp file holds data; return the temp files left."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, target, "-" if step is None else str(step)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_child_env(),
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read() if proc.stderr else ""
        deadline = time.monotonic() + 60
        partial: list[Path] = []
        while time.monotonic() < deadline and proc.poll() is None:
            partial = [p for p in temp_leftovers(watch) if p.stat().st_size > 4]
            if partial:
                break
            time.sleep(0.002)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
    assert proc.returncode == -signal.SIGKILL, (
        f"writer was not killed mid-write (rc {proc.returncode})"
    )
    assert partial, "the writer never produced a temp file"
    return temp_leftovers(watch)


@pytest.mark.slow
def test_sigkill_mid_write_keeps_previous_file(tmp_path: Path) -> None:
    dest, old = _valid_parquet(tmp_path / "r.parquet")
    before = dest.read_bytes()
    left = _kill_mid_write(str(dest), None, tmp_path)
    assert left and all(p.parent == tmp_path and p.name.startswith(".") for p in left)
    assert dest.read_bytes() == before
    assert_same_table(read_rollouts(dest), old)
    fresh = tmp_path / "sub" / "fresh.parquet"
    _kill_mid_write(str(fresh), None, tmp_path / "sub")
    assert not fresh.exists()


@pytest.mark.slow
def test_sigkill_mid_step_write_is_ignored_by_readers(tmp_path: Path) -> None:
    root = tmp_path / "run"
    _, old = _valid_parquet(tmp_path / "x.parquet")
    write_rollouts(old, root, step=0)
    left = _kill_mid_write(str(root), 0, root)
    assert left and all(p.parent == root / "step=0" for p in left)
    assert steps_of(root) == [0]
    assert_same_table(read_rollouts(root), with_step(old, 0))
    assert [s for s, _ in pieces(root)] == [0]
    # the next writer takes the next part; the leftover stays invisible
    new = make_table(np.random.default_rng(16), route_spec(old), [(3, 3, 5)], tag="new")
    assert write_rollouts(new, root, step=0) == root / "step=0" / "part-00001.parquet"
    assert_same_table(read_rollouts(root), with_step(pa.concat_tables([old, new]), 0))


def test_leftover_temp_files_are_ignored_by_step_readers(
    steps_root: tuple[Path, dict[int, pa.Table]],
) -> None:
    root, per_step = steps_root
    junk = np.random.default_rng(0).integers(0, 256, 1000).astype(np.uint8).tobytes()
    (root / "step=1" / ".part-00002.parquet.tmp-0123abcd").write_bytes(b"PAR1" + junk)
    (root / "step=3" / ".part-00001.parquet.tmp-feed").write_bytes(b"")
    assert_same_table(
        read_rollouts(root), pa.concat_tables([with_step(per_step[s], s) for s in range(4)])
    )
    assert [s for s, _ in pieces(root)] == [0, 1, 2, 3]


def test_concurrent_writers_to_one_step_keep_both_parts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two writers that pick a part name at the same time must not replace each other's file."""
    spec = RouteSpec(num_layers=2, topk=2, num_experts=16)
    rng = np.random.default_rng(17)
    a = make_table(rng, spec, [(2, 2, 3)], tag="a")
    b = make_table(rng, spec, [(3, 1, 4)], tag="b")
    real = pq.write_table
    both_started = threading.Barrier(2, timeout=30)

    def in_step(table: pa.Table, where: Any, **kwargs: Any) -> None:
        both_started.wait()  # both writers have chosen their destination by now
        real(table, where, **kwargs)

    monkeypatch.setattr(pq, "write_table", in_step)
    errors: list[BaseException] = []

    def write(t: pa.Table) -> None:
        try:
            write_rollouts(t, tmp_path, step=0)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(t,)) for t in (a, b)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=60)
    monkeypatch.undo()
    assert errors == []
    got = read_rollouts(tmp_path)
    assert sorted(map(str, got.column("trajectory_id").to_pylist())) == ["a-0", "b-0"]
    assert len(list((tmp_path / "step=0").glob("part-*.parquet"))) == 2


def test_every_routes_typed_column_is_stored_compactly(tmp_path: Path) -> None:
    """A second routes column (e.g. the trainer router's picks) gets the same compact storage."""
    spec = RouteSpec(num_layers=3, topk=2, num_experts=8, moe_layers=(1, 2))
    base = make_table(np.random.default_rng(3), spec, [(4, 3, 6), (2, 5, 6)])
    trainer = base.column("routes").combine_chunks()
    table = r3arrow.table.with_columns(base, {"trainer_routes": trainer})
    path = write_rollouts(table, tmp_path / "r.parquet")
    pf = pq.ParquetFile(path)
    kinds = {
        pf.schema.column(i).path.split(".")[0]: pf.schema.column(i).physical_type
        for i in range(len(pf.schema))
    }
    assert kinds["routes"] == kinds["trainer_routes"] == "FIXED_LEN_BYTE_ARRAY"
    back = read_rollouts(path)
    assert back.equals(table) and back.schema.metadata == table.schema.metadata
    only = read_rollouts(path, columns=["trainer_routes"])
    assert only.column("trainer_routes").type == spec.routes_type


# ------------------------------------------------------ discovery for integrations
def test_rollout_files_file_root_and_partition(
    steps_root: tuple[Path, dict[int, pa.Table]], tmp_path: Path
) -> None:
    """One discovery for stats and ray: the files of a file, a root or one partition."""
    root, _ = steps_root
    got = rollout_files(root)
    assert [(f.step, f.path.relative_to(root).as_posix()) for f in got] == [
        (0, "step=0/part-00000.parquet"),
        (1, "step=1/part-00000.parquet"),
        (1, "step=1/part-00001.parquet"),
        (2, "step=2/part-00000.parquet"),
        (3, "step=3/part-00000.parquet"),
    ]
    assert [f.step for f in rollout_files(root, steps=[3, 1])] == [1, 1, 3]
    assert rollout_files(root / "step=1") == got[1:3]
    one = got[0].path
    ((only,),) = [rollout_files(one)]
    assert (only.step, only.path) == (None, one)
    with pytest.raises(SchemaError, match=r"steps \[7\] to exist") as info:
        rollout_files(root, steps=[1, 7])
    assert info.value.path == str(root)
    with pytest.raises(SchemaError, match="single file"):
        rollout_files(one, steps=[0])
    (tmp_path / "empty").mkdir()
    with pytest.raises(SchemaError, match="partitions"):
        rollout_files(tmp_path / "empty")
    with pytest.raises(TypeError, match="steps"):
        rollout_files(root, steps=["1"])  # type: ignore[list-item]
    with pytest.raises(FileNotFoundError):
        rollout_files(tmp_path / "nope")


def test_iter_rollouts_over_files_and_row_groups(
    steps_root: tuple[Path, dict[int, pa.Table]],
) -> None:
    root, per_step = steps_root
    cols = ["trajectory_id", "routes", "step"]
    got = pieces(rollout_files(root, steps=[1, 2]), columns=cols)
    assert [s for s, _ in got] == [1, 2]  # one piece per step at the default budget
    for s, t in got:
        assert s is not None
        want = with_step(per_step[s], s).select(cols)
        assert t.column("routes").type == route_spec(want).routes_type
        assert t.equals(want)
    files = rollout_files(root, steps=[1])
    spec = files[0].spec
    assert spec == route_spec(per_step[1])
    assert [(f.step, f.path.name, f.num_row_groups) for f in files] == [
        (1, "part-00000.parquet", 1),
        (1, "part-00001.parquet", 1),
    ]
    assert files[0].schema.equals(per_step[1].schema, check_metadata=True)
    assert files[1].num_rows == 3
    part = read_rollouts([files[1]], row_groups=[0], columns=["routes", "step"])
    assert part.schema.names == ["routes", "step"]
    assert part.column("routes").type == spec.routes_type
    assert part.column("step").to_pylist() == [1] * part.num_rows
    assert route_spec(part) == spec


def test_route_rows_reads_nested_and_stored_columns(tmp_path: Path) -> None:
    spec = RouteSpec(num_layers=3, topk=2, num_experts=300)
    table = make_table(np.random.default_rng(18), spec, [(3, 4, 6), (2, 2, 0), (1, 3, 4)]).slice(1)
    stored = pq.read_table(write_rollouts(table, tmp_path / "r.parquet"))  # storage form
    want = route_rows(table)
    for col in (table.column("routes"), stored.column("routes")):
        rows, lengths = io_route_rows(col, spec, "routes")
        np.testing.assert_array_equal(rows, want)
        assert lengths.tolist() == [0, 4]
    with pytest.raises(SchemaError, match="'reward'"):
        io_route_rows(table.column("reward"), spec, "reward")


def test_errors_carry_the_path_and_step_is_checked(tmp_path: Path) -> None:
    path, table = _valid_parquet(tmp_path / "r.parquet")
    _truncate_half(path)
    with pytest.raises(SchemaError) as info:
        read_rollouts(path)
    assert info.value.path == str(path)
    with pytest.raises(TypeError, match="step"):
        write_rollouts(table, tmp_path / "run", step=1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="steps"):
        read_rollouts(tmp_path, steps=[0.5])  # type: ignore[list-item]
