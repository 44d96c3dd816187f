"""R3 off end to end on files: IPC and Parquet round trips and `r3arrow inspect` without routes."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest

import r3arrow
from r3arrow.cli import main


def _r3off_table() -> pa.Table:
    return r3arrow.rollout_table(
        trajectory_id=["a", "b"],
        group_id=["g", "g"],
        prompt_ids=[[1, 2], [1, 2, 3]],
        response_ids=[[3], [4, 5]],
        loss_mask=[[1], [1, 0]],
        reward=[1.0, 0.0],
    )


def test_ipc_round_trip_without_routes(tmp_path: Path) -> None:
    table = _r3off_table()
    path = r3arrow.io.write_ipc(table, tmp_path / "r.arrow")
    back = r3arrow.read_rollouts(path)
    assert back.equals(table)
    assert "routes" not in back.schema.names


def test_ipc_reader_validates_rows(tmp_path: Path) -> None:
    table = _r3off_table()
    bad = table.set_column(
        table.schema.get_field_index("loss_mask"),
        "loss_mask",
        pa.array([[1, 1], [1, 0]], type=pa.large_list(pa.uint8())),
    )
    path = tmp_path / "bad.arrow"
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, bad.schema) as writer:
        writer.write_table(bad)
    with pytest.raises(r3arrow.errors.SchemaError) as info:
        r3arrow.read_rollouts(path)
    assert info.value.path == str(path)
    assert r3arrow.read_rollouts(path, validate=False).num_rows == 2


@pytest.mark.parametrize("name", ["r.parquet", "r.arrow"])
def test_inspect_summarises_an_r3off_file(
    tmp_path: Path, name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    table = _r3off_table()
    path = tmp_path / name
    if name.endswith(".arrow"):
        r3arrow.io.write_ipc(table, path)
    else:
        r3arrow.write_rollouts(table, path)
    assert main(["inspect", str(path), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["spec"] is None
    assert info["rows"] == 2
    assert info["tokens"] == 8
    assert info["captured_rows"] == 0
    assert main(["inspect", str(path)]) == 0
    assert "R3 off" in capsys.readouterr().out
