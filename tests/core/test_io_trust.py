"""What a reader may trust and what a writer may leave: adversarial cases of r3arrow.io.

Real Parquet files throughout: projected layers across parts, a file replaced between its
footer and its rows, reserved column names, argument misuse of ``layers=`` / ``columns=`` /
``row_groups=``, the step bound, the memory budget against what pyarrow holds, exact
diagnostics counts, temp ownership across PID namespaces, and the Arrow stream that
generic tools read (``docs/portable.md``).
"""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import sys
import types
from pathlib import Path
from typing import Any, cast

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from r3arrow.errors import RouteShapeError, SchemaError
from r3arrow.io import (
    find_temps,
    iter_rollouts,
    read_diagnostics,
    read_rollouts,
    remove_stale_temps,
    rollout_files,
    rollout_reader,
    write_diagnostics,
    write_ipc,
    write_rollouts,
)
from r3arrow.io._diagnostics import DIAGNOSTICS_DIR, _agreement_table
from r3arrow.io._layout import MAX_STEP, temp_name
from r3arrow.spec import RouteSpec, routes_to_numpy
from r3arrow.table import route_layers
from r3arrow.testing import assert_rollouts_equal, random_rollouts

REPO = Path(__file__).resolve().parents[2]
# uint16 ids: a tool that reads bytes cannot pass by accident.
SPEC = RouteSpec(num_layers=4, topk=2, num_experts=300, moe_layers=(1, 2, 3))
SHAPES = [(5, 4, 9), (3, 6, 8), (4, 2, 0), (2, 5, 5)]


def _table(seed: int = 0, tag: str = "t") -> pa.Table:
    return random_rollouts(np.random.default_rng(seed), SPEC, SHAPES, tag=tag)


@pytest.fixture
def file(tmp_path: Path) -> Path:
    return write_rollouts(_table(), tmp_path / "f.parquet")


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()  # reaped: the pid names no process now
    return proc.pid


def _argument_error(exc: BaseException) -> bool:
    """A documented argument error: a builtin, never an R3ArrowError (data) in disguise."""
    return type(exc) in (ValueError, TypeError)


# --------------------------------------------------------- N1: projected layers
def test_parts_of_different_projected_layers_are_refused(tmp_path: Path, file: Path) -> None:
    root = tmp_path / "root"
    a = write_rollouts(read_rollouts(file, layers=[0, 1]), root, step=0)
    b = write_rollouts(read_rollouts(file, layers=[2, 3]), root, step=1)
    for read in (read_rollouts, rollout_files, lambda p: list(iter_rollouts(p))):
        with pytest.raises(SchemaError) as info:
            read(root)
        msg = str(info.value)
        assert "layers [0, 1]" in msg and "layers [2, 3]" in msg
        assert str(a) in msg and str(b) in msg and info.value.path == str(b)
    # the same projection in every part reads as one table with its labels
    same = tmp_path / "same"
    write_rollouts(read_rollouts(file, layers=[2, 3]), same, step=0)
    write_rollouts(read_rollouts(file, layers=[2, 3]), same, step=1)
    assert route_layers(read_rollouts(same)) == (2, 3)


def test_rollout_files_of_two_projections_passed_together_are_refused(
    tmp_path: Path, file: Path
) -> None:
    one = write_rollouts(read_rollouts(file, layers=[0, 1]), tmp_path / "a.parquet")
    two = write_rollouts(read_rollouts(file, layers=[1, 2]), tmp_path / "b.parquet")
    files = rollout_files(one) + rollout_files(two)
    with pytest.raises(SchemaError, match=r"layers \[0, 1\].*layers \[1, 2\]"):
        read_rollouts(files)


# ------------------------------------------- N2: one footer per file's bytes
def test_a_file_replaced_after_its_footer_was_read_is_never_decoded_with_it(
    tmp_path: Path,
) -> None:
    path = write_rollouts(_table(0, "old"), tmp_path / "f.parquet")
    files = rollout_files(path)  # footers read: the hook between footer and rows
    new = _table(1, "new")  # same shapes, other ids and values
    write_rollouts(new, path)  # atomic replace
    for read in (read_rollouts, lambda f: list(iter_rollouts(f)), lambda f: rollout_reader(f)):
        with pytest.raises(SchemaError, match="replaced or rewritten") as info:
            out = read(files)
            if isinstance(out, pa.RecordBatchReader):
                out.read_all()
        assert info.value.path == str(path)
    assert_rollouts_equal(read_rollouts(path), new)  # read again: the new file


def test_a_file_rewritten_in_place_after_its_footer_was_read_is_refused(tmp_path: Path) -> None:
    path = write_rollouts(_table(), tmp_path / "f.parquet")
    files = rollout_files(path)
    data = bytearray(path.read_bytes())
    with open(path, "r+b") as fh:  # same inode, same size, new bytes
        fh.write(bytes(data))
    os.utime(path, ns=(files[0].identity[3] + 1, files[0].identity[3] + 1))
    with pytest.raises(SchemaError, match="replaced or rewritten"):
        read_rollouts(files)


# ---------------------------------------------------------- N3: reserved names
@pytest.mark.parametrize(
    ("name", "step"), [("step", 5), ("__r3arrow_rows", 5), ("__r3arrow_rows", None), ("__r3x", 1)]
)
def test_reserved_columns_are_refused_at_write(tmp_path: Path, name: str, step: int | None) -> None:
    if name == "__r3x":
        name = "__r3arrow"
    table = _table().append_column(name, pa.array([7] * 4, pa.int64()))
    with pytest.raises(SchemaError, match=rf"reserved column.*\['{name}'\]"):
        write_rollouts(table, tmp_path / "out", step=step)
    assert not (tmp_path / "out").exists()


def test_a_step_column_outside_a_root_is_data(tmp_path: Path) -> None:
    table = _table().append_column("step", pa.array([7] * 4, pa.int64()))
    path = write_rollouts(table, tmp_path / "f.parquet")
    assert read_rollouts(path).column("step").to_pylist() == [7] * 4


def test_a_file_column_never_overrides_the_partition_step(tmp_path: Path) -> None:
    root = tmp_path / "root"
    write_rollouts(_table(), root, step=4)
    table = _table(1, "x").append_column("step", pa.array([7] * 4, pa.int64()))
    foreign = write_rollouts(table, root / "step=5" / "part-00000.parquet")  # not via step=
    with pytest.raises(SchemaError, match=r"reserved column.*'step'") as info:
        read_rollouts(root)
    assert info.value.path == str(foreign)


def test_a_foreign_file_with_the_rows_placeholder_is_refused(tmp_path: Path, file: Path) -> None:
    stored = pq.read_table(file)  # storage form, r3arrow metadata sealed
    column = pa.array([None] * stored.num_rows, pa.null())
    bad = stored.append_column("__r3arrow_rows", column)
    path = tmp_path / "bad.parquet"
    pq.write_table(bad, path, use_compliant_nested_type=False)
    with pytest.raises(SchemaError, match="__r3arrow_rows") as info:
        read_rollouts(path)
    assert info.value.path == str(path)


def test_reading_a_root_adds_its_step_column(tmp_path: Path) -> None:
    table = _table()
    write_rollouts(table, tmp_path, step=3)
    back = read_rollouts(tmp_path)
    assert back.schema.names == [*table.schema.names, "step"]
    assert_rollouts_equal(back.drop_columns(["step"]), table)


# ------------------------------------------------------ N4: layers= misuse
@pytest.mark.parametrize(
    ("layers", "error", "match"),
    [
        ([4], ValueError, r"layers: expected ids in \[0, 4\), found \[4\]"),
        ([], ValueError, "layers: expected at least one layer id"),
        ([-1], ValueError, r"layers: expected an int in \[0, inf\], found -1"),
        ("1", TypeError, "layers: expected a sequence of ints, found str"),
        ([True], TypeError, "layers: expected an int, found True"),
        ([0], ValueError, "layers: expected at least one router layer of"),
    ],
)
def test_layers_misuse_is_an_argument_error_before_any_read(
    tmp_path: Path, file: Path, layers: Any, error: type[Exception], match: str
) -> None:
    root = tmp_path / "root"
    write_rollouts(_table(), root, step=0)
    ipc = write_ipc(_table(), tmp_path / "t.arrow")
    for path in (file, root, ipc):
        for read in (read_rollouts, iter_rollouts, rollout_reader):  # raised at the call
            with pytest.raises(error, match=match) as info:
                read(path, layers=layers)
            assert _argument_error(info.value), info.value


def test_layers_a_projected_file_lacks_name_the_file(tmp_path: Path, file: Path) -> None:
    part = write_rollouts(read_rollouts(file, layers=[1, 2]), tmp_path / "p.parquet")
    with pytest.raises(RouteShapeError, match=r"expected layers \[3\]") as info:
        read_rollouts(part, layers=[2, 3])
    assert info.value.path == str(part)


# ------------------------------------------- N5: columns= / row_groups= misuse
def test_unknown_column_names_the_available_ones(tmp_path: Path, file: Path) -> None:
    root = tmp_path / "root"
    write_rollouts(_table(), root, step=0)
    for path in (file, root, write_ipc(_table(), tmp_path / "t.arrow")):
        with pytest.raises(ValueError, match=r"\['rewrd'\]") as info:
            read_rollouts(path, columns=["rewrd"])
        assert _argument_error(info.value) and "'reward'" in str(info.value)
    with pytest.raises(ValueError, match="'step'"):  # a root names its step column too
        iter_rollouts(root, columns=["stp"])


def test_columns_as_a_string_or_empty_is_refused(file: Path) -> None:
    with pytest.raises(TypeError, match="columns: expected a sequence of column names"):
        read_rollouts(file, columns="reward")
    with pytest.raises(TypeError, match="column names"):
        read_rollouts(file, columns=[1])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="at least one column name"):
        read_rollouts(file, columns=[])
    with pytest.raises(ValueError, match="at least one column name"):
        read_rollouts(file, columns=[], row_groups=[0])
    with pytest.raises(ValueError, match="row_groups: expected at least one index"):
        read_rollouts(file, row_groups=[])


def test_step_column_is_a_roots_and_columns_select_in_order(tmp_path: Path, file: Path) -> None:
    write_rollouts(_table(), tmp_path / "root", step=2)
    got = read_rollouts(tmp_path / "root", columns=["reward", "step", "reward"])
    assert got.schema.names == ["reward", "step"] and got.column("step").to_pylist() == [2] * 4
    assert read_rollouts(file, columns=["reward", "step"]).schema.names == ["reward"]


def test_a_column_only_some_parts_have_names_the_part(tmp_path: Path) -> None:
    root = tmp_path / "root"
    write_rollouts(_table().append_column("score", pa.array([1.0] * 4)), root, step=0)
    lacking = write_rollouts(_table(1, "b"), root, step=1)
    with pytest.raises(SchemaError, match=r"expected columns \['score'\]") as info:
        read_rollouts(root, columns=["score"])
    assert info.value.path == str(lacking)
    assert read_rollouts(root, columns=["score"], steps=[0]).num_rows == 4


# ------------------------------------------------------------- N6: step bound
def test_step_bound_is_shared_by_writer_and_readers(tmp_path: Path) -> None:
    assert MAX_STEP == 2**63 - 1
    table = _table()
    for step in (2**63, 2**70):
        with pytest.raises(
            ValueError, match=r"step: expected an int in \[0, 9223372036854775807\]"
        ):
            write_rollouts(table, tmp_path / "root", step=step)
    assert not (tmp_path / "root").exists()
    write_rollouts(table, tmp_path / "root", step=MAX_STEP)
    assert read_rollouts(tmp_path / "root").column("step").to_pylist() == [MAX_STEP] * 4
    with pytest.raises(ValueError, match="steps"):
        read_rollouts(tmp_path / "root", steps=[2**63])
    with pytest.raises(ValueError, match="step"):
        write_diagnostics(tmp_path / "root", 2**63, _agreement())


@pytest.mark.parametrize("name", ["step=9223372036854775808", "step=1180591620717411303424"])
def test_a_foreign_step_folder_beyond_the_bound_is_a_clear_error(tmp_path: Path, name: str) -> None:
    root = tmp_path / "root"
    part = write_rollouts(_table(), root, step=1)
    (root / name).mkdir()
    (root / name / part.name).write_bytes(part.read_bytes())
    for read in (read_rollouts, rollout_files, iter_rollouts):
        with pytest.raises(SchemaError, match=rf"\['{name}'\]") as info:
            read(root)
        assert info.value.path == str(root)
    (tmp_path / "diag" / DIAGNOSTICS_DIR / name).mkdir(parents=True)
    with pytest.raises(SchemaError, match=name):
        read_diagnostics(tmp_path / "diag")


# ------------------------------------------------ N14: what pyarrow holds
_PEAK = """
import sys
import pyarrow as pa
from r3arrow.io import iter_rollouts
pool = pa.default_memory_pool()
rows = 0
for piece in iter_rollouts(sys.argv[1], max_memory=int(sys.argv[2])):
    rows += piece.num_rows
    del piece
print(rows, pool.max_memory())
"""


@pytest.mark.slow
def test_memory_budget_bounds_what_pyarrow_holds_for_one_big_row_group(tmp_path: Path) -> None:
    spec = RouteSpec(num_layers=16, topk=8, num_experts=128, moe_layers=tuple(range(1, 16)))
    table = random_rollouts(np.random.default_rng(3), spec, [(64, 448, 512)] * 400)
    path = write_rollouts(table, tmp_path / "big.parquet", row_group_rows=400)
    md = pq.ParquetFile(path).metadata
    assert md.num_row_groups == 1 and md.row_group(0).total_byte_size > 25 << 20
    budget = 256 << 10
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", _PEAK, str(path), str(budget)],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    rows, peak = map(int, out.stdout.split())
    assert rows == 400
    # a page (64 KiB) and a read buffer (64 KiB) per column chunk, beside the budget
    leaves = md.num_columns
    assert peak <= budget + leaves * (256 << 10), (peak, leaves)
    assert peak < md.row_group(0).total_byte_size // 8


# ------------------------------------------------- N15: exact diagnostics
def _agreement(
    *, tokens: int = 10, topk: int = 2, identical: tuple[int, ...] = (9, 8), **kw: Any
) -> Any:
    """A duck-typed `r3arrow.stats.RouteAgreement` (the core imports no integration)."""
    fields = {
        "layers": (1, 2),
        "topk": topk,
        "tokens": tokens,
        "identical": list(identical),
        "overlap": [2 * i for i in identical],
        "all_identical": 0,
    }
    return types.SimpleNamespace(**{**fields, **kw})


def test_diagnostics_counts_are_checked_exactly_near_2_62(tmp_path: Path) -> None:
    big = 2**62
    # identical * topk = 2**65: no overlap in int64 reaches it (it wrapped to 0 before)
    wraps = _agreement(tokens=big, topk=8, identical=(big, big), overlap=(big, big))
    with pytest.raises(SchemaError, match="overlap"):
        write_diagnostics(tmp_path, 0, wraps)
    # tokens * topk = 2**65 bounds overlap from above: 2**62 is within it
    fine = _agreement(tokens=big, topk=8, identical=(0, 0), overlap=(big, big))
    write_diagnostics(tmp_path, 0, fine)
    back = read_diagnostics(tmp_path)
    assert back.column("overlap").to_pylist() == [big, big]
    with pytest.raises(ValueError, match=r"agreement\.identical"):
        write_diagnostics(tmp_path, 0, _agreement(identical=(2**63, 1)))
    with pytest.raises(ValueError, match=r"agreement\.tokens"):
        write_diagnostics(tmp_path, 0, _agreement(tokens=2**64))


def test_diagnostics_reader_checks_counts_exactly(tmp_path: Path) -> None:
    big = 2**62
    bad = _agreement(tokens=big, topk=8, identical=(big, big), overlap=(big, big))
    path = tmp_path / DIAGNOSTICS_DIR / "step=0" / "native_vs_replay.parquet"
    path.parent.mkdir(parents=True)
    pq.write_table(_agreement_table(0, bad, "native_vs_replay"), path, write_page_checksum=True)
    with pytest.raises(SchemaError, match="overlap") as info:
        read_diagnostics(tmp_path)
    assert info.value.path == str(path)


# ------------------------------------------ N16: temps across PID namespaces
_HOLDER = """
import os, sys, time
from pathlib import Path
dead = int(sys.argv[2])
os.getpid = lambda: dead  # its pid as another PID namespace would see it: dead here
from r3arrow.io._layout import atomic_path
with atomic_path(Path(sys.argv[1]) / "r.parquet") as paths:
    paths[0].write_bytes(b"x" * 100)
    print(paths[0], flush=True)
    time.sleep(120)
"""


def test_a_live_writers_temp_survives_a_pid_that_is_dead_here(tmp_path: Path) -> None:
    directory = tmp_path / "step=0"
    directory.mkdir()
    dead = _dead_pid()
    abandoned = directory / temp_name("part-00000.parquet").replace(f"-{os.getpid()}-", f"-{dead}-")
    abandoned.write_bytes(b"y" * 10)  # a killed writer's: no lock held
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(directory), str(dead)],
        stdout=subprocess.PIPE,
        env=env,
    )
    try:
        assert proc.stdout is not None
        live = Path(proc.stdout.readline().decode().strip())
        assert live.exists() and f"-{dead}-" in live.name
        by_path = {t.path: t for t in find_temps(tmp_path)}
        assert by_path[live].alive is True and by_path[abandoned].alive is False
        assert remove_stale_temps(tmp_path) == [(abandoned, 10)]
        write_rollouts(_table(), tmp_path, step=0)  # a write's housekeeping spares it too
        assert live.exists() and not abandoned.exists()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    assert remove_stale_temps(tmp_path) == [(live, 100)]  # its lock died with it
    assert find_temps(tmp_path) == []


# ------------------------------------------------ generic tools: one stream
@pytest.fixture(params=["default", "portable"])
def stored(request: pytest.FixtureRequest, tmp_path: Path) -> tuple[Path, pa.Table]:
    """A step root of two steps, in default or portable storage, and its rows."""
    portable = request.param == "portable"
    table = _table()
    write_rollouts(table.slice(0, 2), tmp_path, step=0, portable=portable)
    write_rollouts(table.slice(2), tmp_path, step=1, portable=portable)
    return tmp_path, table


def _routes(table: pa.Table) -> list[np.ndarray]:
    """Per trajectory, its routes ``[T, L, K]`` as int64."""
    col = cast("pa.LargeListArray[Any]", table.column("routes").combine_chunks())
    rows = routes_to_numpy(col.flatten(), SPEC).astype(np.int64)
    offsets = np.asarray(col.offsets)
    return [rows[a:b] for a, b in itertools.pairwise(offsets)]


def _check(got: list[Any], table: pa.Table) -> None:
    want = _routes(table)
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g, dtype=np.int64).reshape(w.shape), w)


def test_rollout_reader_streams_the_rows_read_rollouts_returns(
    stored: tuple[Path, pa.Table],
) -> None:
    root, _ = stored
    reader = rollout_reader(root, max_memory=1)  # a row at a time
    assert reader.schema.field("routes").type == SPEC.routes_type
    got = reader.read_all()
    assert got.equals(read_rollouts(root))
    assert got.column("step").to_pylist() == [0, 0, 1, 1]
    assert rollout_reader(root, steps=[5]).read_all().num_rows == 0


def test_rollout_reader_raises_a_rows_error_as_it_is_read(tmp_path: Path) -> None:
    path = write_rollouts(_table(), tmp_path / "f.parquet")
    reader = rollout_reader(rollout_files(path))
    write_rollouts(_table(1, "n"), path)
    with pytest.raises(SchemaError, match="replaced"):
        reader.read_all()


def test_duckdb_recipe(stored: tuple[Path, pa.Table]) -> None:
    duckdb = pytest.importorskip("duckdb")
    root, table = stored
    con = duckdb.connect()
    con.register("rollouts", rollout_reader(root))
    rel = con.sql("SELECT trajectory_id, step, routes FROM rollouts")
    assert str(rel.types[2]) == "USMALLINT[2][4][]"
    _check([r[2] for r in rel.fetchall()], table)
    con.register("rollouts", rollout_reader(root))  # a stream is read once
    first = con.sql("SELECT routes[1][2][1] FROM rollouts").fetchall()
    assert first[0][0] == int(_routes(table)[0][0, 1, 0])


def test_polars_recipe(stored: tuple[Path, pa.Table]) -> None:
    pl = pytest.importorskip("polars")
    root, table = stored
    df = pl.from_arrow(rollout_reader(root))
    assert isinstance(df, pl.DataFrame)
    assert df.schema["routes"] == pl.List(pl.Array(pl.UInt16, (4, 2)))
    _check([df["routes"][i].to_numpy() for i in range(df.height)], table)


def test_pandas_recipe(stored: tuple[Path, pa.Table]) -> None:
    pytest.importorskip("pandas")
    root, table = stored
    df = rollout_reader(root).read_pandas()
    cells = [np.stack([np.stack(tok) for tok in row]) if len(row) else row for row in df.routes]
    for c in cells:
        assert c.size == 0 or c.dtype == np.uint16
    _check(cells, table)


def test_datasets_recipe(stored: tuple[Path, pa.Table]) -> None:
    datasets = pytest.importorskip("datasets")
    root, table = stored
    ds = datasets.Dataset(rollout_reader(root).read_all())
    got = [ds.with_format("numpy")[i]["routes"] for i in range(ds.num_rows)]
    _check(got, table)
