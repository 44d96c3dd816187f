"""The `r3arrow` command line on files the tests write: exit codes, output, errors."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pytest

import r3arrow
from r3arrow import codec
from r3arrow.cli import EXIT_ERROR, EXIT_OK, EXIT_USAGE, main
from r3arrow.spec import RouteSpec
from r3arrow.testing import random_routes

SPEC = RouteSpec(num_layers=4, topk=2, num_experts=8, moe_layers=(1, 2, 3))


def pylist(arr: Any) -> list[Any]:
    """``arr.to_pylist()``, loosely typed (pyarrow-stubs refuse it on list arrays)."""
    out: list[Any] = arr.to_pylist()
    return out


def _table(rng: np.random.Generator, rows: int = 5) -> pa.Table:
    prompts = [rng.integers(0, 100, size=int(rng.integers(2, 6))).tolist() for _ in range(rows)]
    responses = [rng.integers(0, 100, size=int(rng.integers(1, 6))).tolist() for _ in range(rows)]
    routes = [
        random_routes(rng, len(p) + len(r) - 1, SPEC)
        for p, r in zip(prompts, responses, strict=True)
    ]
    return r3arrow.rollout_table(
        trajectory_id=[f"t{i}" for i in range(rows)],
        group_id=[f"g{i // 2}" for i in range(rows)],
        prompt_ids=prompts,
        response_ids=responses,
        loss_mask=[[1] * len(r) for r in responses],
        reward=rng.random(rows).tolist(),
        routes=routes,
        spec=SPEC,
    )


@pytest.fixture
def rollout_file(tmp_path: Path, rng: np.random.Generator) -> Path:
    return r3arrow.write_rollouts(_table(rng), tmp_path / "r.parquet")


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for command in ("demo", "inspect", "stats", "convert"):
        assert command in out


def test_usage_error_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["inspect"])
    assert exc.value.code == EXIT_USAGE
    assert "path" in capsys.readouterr().err


def test_console_script_entry_point(rollout_file: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "r3arrow", "inspect", str(rollout_file), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert orjson.loads(proc.stdout)["rows"] == 5


def test_inspect_reports_rows_tokens_captured_and_size(
    rollout_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    table = r3arrow.read_rollouts(rollout_file)
    assert main(["inspect", str(rollout_file), "--json"]) == EXIT_OK
    info = orjson.loads(capsys.readouterr().out)
    tokens = sum(
        len(p) + len(r)
        for p, r in zip(
            pylist(table.column("prompt_ids")),
            pylist(table.column("response_ids")),
            strict=True,
        )
    )
    captured = sum(len(r) for r in pylist(table.column("routes")))
    assert info["rows"] == 5 and info["tokens"] == tokens and info["captured_rows"] == captured
    assert info["captured_fraction"] == pytest.approx(captured / tokens)
    assert info["size_on_disk"] == rollout_file.stat().st_size
    assert info["spec"]["moe_layers"] == [1, 2, 3]
    assert main(["inspect", str(rollout_file)]) == EXIT_OK
    text = capsys.readouterr().out
    assert "rows (trajectories): 5" in text and "of tokens" in text


def test_inspect_step_directory_and_ipc(
    tmp_path: Path, rng: np.random.Generator, capsys: pytest.CaptureFixture[str]
) -> None:
    for step in (0, 3):
        r3arrow.write_rollouts(_table(rng), tmp_path / "run", step=step)
    assert main(["inspect", str(tmp_path / "run"), "--json"]) == EXIT_OK
    info = orjson.loads(capsys.readouterr().out)
    assert info["rows"] == 10 and info["steps"] == [0, 3]
    ipc = r3arrow.io.write_ipc(_table(rng), tmp_path / "r.arrow")
    assert main(["inspect", str(ipc), "--json"]) == EXIT_OK
    assert orjson.loads(capsys.readouterr().out)["rows"] == 5


@pytest.mark.parametrize("content", [b"", b"PAR1 not really parquet", b"\x00" * 100])
def test_inspect_corrupt_file_fails_clearly(
    tmp_path: Path, content: bytes, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(content)
    assert main(["inspect", str(bad)]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert err.startswith("r3arrow: error:") and str(bad) in err


def test_inspect_missing_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["inspect", str(tmp_path / "nope.parquet")]) == EXIT_ERROR
    assert "nope.parquet" in capsys.readouterr().err


def test_stats_json_and_plot(
    rollout_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    png = tmp_path / "load.png"
    assert main(["stats", str(rollout_file), "--json", "--plot", str(png)]) == EXIT_OK
    out = orjson.loads(capsys.readouterr().out)
    table = r3arrow.read_rollouts(rollout_file)
    want = r3arrow.stats.expert_load(table).to_dicts()
    assert out["load"] == want
    assert {row["layer"] for row in out["layers"]} == {1, 2, 3}
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["stats", str(rollout_file), "--tokens", "loss"]) == EXIT_OK
    assert "per-layer routing (loss tokens)" in capsys.readouterr().out


def _dump(path: Path, records: list[dict[str, object]]) -> Path:
    path.write_bytes(b"\n".join(orjson.dumps(r) for r in records) + b"\n")
    return path


@pytest.mark.parametrize("fmt", ["vllm", "packed", "sglang", "npy"])
def test_convert_payload_dumps_round_trip(
    tmp_path: Path, rng: np.random.Generator, fmt: str, capsys: pytest.CaptureFixture[str]
) -> None:
    records, expected = [], []
    for i in range(3):
        prompt, response = list(range(1, 4 + i)), list(range(10, 12 + i))
        routes = random_routes(rng, len(prompt) + len(response) - 1, SPEC)
        expected.append(routes)
        rec: dict[str, object] = {
            "trajectory_id": f"x{i}",
            "prompt_ids": prompt,
            "response_ids": response,
            "reward": float(i),
        }
        if fmt == "vllm":
            rec["routed_experts"] = codec.encode_vllm(routes)
        elif fmt == "packed":
            rec["routed_experts"] = codec.encode_packed(routes)
        elif fmt == "sglang":
            rec["routed_experts"] = codec.encode_sglang(routes.astype(np.int32))
        else:
            np.save(tmp_path / f"x{i}.npy", routes, allow_pickle=False)
            rec["routes_npy"] = f"x{i}.npy"
        records.append(rec)
    src = _dump(tmp_path / "dump.jsonl", records)
    out = tmp_path / "out.parquet"
    args = [
        "convert",
        str(src),
        "--out",
        str(out),
        *_SPEC_ARGS,
        "3",
        "--format",
        fmt,
    ]
    assert main(args) == EXIT_OK, capsys.readouterr().err
    table = r3arrow.read_rollouts(out)
    assert table.column("trajectory_id").to_pylist() == ["x0", "x1", "x2"]
    assert table.column("reward").to_pylist() == [0.0, 1.0, 2.0]
    values, offsets = r3arrow.table.flat_routes(table)
    for i, want in enumerate(expected):
        np.testing.assert_array_equal(values[offsets[i] : offsets[i + 1]], want)


def test_convert_bad_payload_names_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = codec.encode_vllm(np.zeros((3, 4, 2), np.uint8) + np.array([0, 1], np.uint8))
    src = _dump(
        tmp_path / "d.jsonl",
        [
            {"prompt_ids": [1, 2], "response_ids": [3, 4], "routed_experts": good},
            {"prompt_ids": [1, 2], "response_ids": [3, 4], "routed_experts": "!!not base64!!"},
        ],
    )
    out = tmp_path / "o.parquet"
    code = main(
        [
            "convert",
            str(src),
            "--out",
            str(out),
            *_SHAPE_ARGS,
        ]
    )
    assert code == EXIT_ERROR
    err = capsys.readouterr().err
    assert "d.jsonl:2" in err
    assert not out.exists()


def test_convert_ids_out_of_range_rejected(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    routes = np.full((3, 4, 2), 9, np.uint8)
    src = _dump(
        tmp_path / "d.jsonl",
        [
            {
                "prompt_ids": [1, 2],
                "response_ids": [3, 4],
                "routed_experts": codec.encode_vllm(routes),
            }
        ],
    )
    code = main(
        [
            "convert",
            str(src),
            "--out",
            str(tmp_path / "o.parquet"),
            *_SHAPE_ARGS,
        ]
    )
    assert code == EXIT_ERROR
    assert "num_experts=8" in capsys.readouterr().err


def test_convert_npy_paths_resolve_against_the_dump_not_the_cwd(
    tmp_path: Path,
    rng: np.random.Generator,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    dump_dir = tmp_path / "dumps"
    dump_dir.mkdir()
    routes = random_routes(rng, 4, SPEC)
    np.save(dump_dir / "a.npy", routes, allow_pickle=False)
    np.save(tmp_path / "abs.npy", routes, allow_pickle=False)
    src = _dump(
        dump_dir / "d.jsonl",
        [
            {"prompt_ids": [1, 2, 3], "response_ids": [4, 5], "routes_npy": "a.npy"},
            {
                "prompt_ids": [1, 2, 3],
                "response_ids": [4, 5],
                "routes_npy": str(tmp_path / "abs.npy"),
            },
        ],
    )
    monkeypatch.chdir(tmp_path)  # a.npy is not in the cwd
    spec_args = [
        *_SPEC_ARGS,
        "3",
    ]
    convert = ["convert", "dumps/d.jsonl", "--out", "o.parquet", "--format", "npy", *spec_args]
    # an absolute routes_npy is outside the dump's folder: refused unless --allow-outside
    assert main(convert) == EXIT_ERROR
    assert "abs.npy" in capsys.readouterr().err
    assert main([*convert, "--allow-outside"]) == EXIT_OK
    values, _ = r3arrow.table.flat_routes(r3arrow.read_rollouts(tmp_path / "o.parquet"))
    np.testing.assert_array_equal(values, np.concatenate([routes, routes]))
    capsys.readouterr()
    # a missing file, a non-.npy file and a non-integer array each name the line and exit 1
    np.savez(dump_dir / "z.npz", a=routes)
    np.save(dump_dir / "f.npy", routes.astype(np.float32), allow_pickle=False)
    for name, needle in (
        ("gone.npy", "no such file"),
        ("z.npz", "expected an .npy file"),
        ("f.npy", "expected an integer array"),
    ):
        _dump(
            src,
            [
                {"prompt_ids": [1, 2, 3], "response_ids": [4, 5], "routes_npy": "a.npy"},
                {"prompt_ids": [1, 2, 3], "response_ids": [4, 5], "routes_npy": name},
            ],
        )
        assert main(["convert", str(src), "--out", "x.parquet", *spec_args]) == EXIT_ERROR
        err = capsys.readouterr().err
        assert err.startswith(f"r3arrow: error: {src}:2: ") and needle in err, err
    assert not (tmp_path / "x.parquet").exists()


def test_convert_table_errors_name_the_record(
    tmp_path: Path, rng: np.random.Generator, capsys: pytest.CaptureFixture[str]
) -> None:
    good = codec.encode_vllm(random_routes(rng, 4, SPEC))
    too_many = codec.encode_vllm(random_routes(rng, 9, SPEC))  # 9 rows for 5 tokens
    src = _dump(
        tmp_path / "d.jsonl",
        [
            {"prompt_ids": [1, 2, 3], "response_ids": [4, 5], "routed_experts": good},
            {"prompt_ids": [1, 2, 3], "response_ids": [4, 5], "routed_experts": too_many},
        ],
    )
    code = main(
        [
            "convert",
            str(src),
            "--out",
            str(tmp_path / "o.parquet"),
            *_SHAPE_ARGS,
        ]
    )
    assert code == EXIT_ERROR
    err = capsys.readouterr().err
    assert f"{src}:2: row 1:" in err and "found 9" in err


def test_stats_exit_codes_and_ipc_input(
    rollout_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["stats", str(tmp_path / "missing.parquet")]) == EXIT_ERROR
    assert "missing.parquet" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:  # checked before any work
        main(["stats", str(rollout_file), "--plot", str(tmp_path / "load.jpg")])
    assert exc.value.code == EXIT_USAGE
    assert not (tmp_path / "load.jpg").exists()
    capsys.readouterr()
    # an Arrow IPC file is recognised by its magic bytes, whatever its suffix
    ipc = r3arrow.io.write_ipc(r3arrow.read_rollouts(rollout_file), tmp_path / "rollouts.bin")
    assert main(["stats", str(ipc), "--json"]) == EXIT_OK
    assert (
        orjson.loads(capsys.readouterr().out)["load"]
        == r3arrow.stats.expert_load(r3arrow.read_rollouts(rollout_file)).to_dicts()
    )
    assert main(["inspect", str(ipc), "--json"]) == EXIT_OK
    assert orjson.loads(capsys.readouterr().out)["rows"] == 5


# ----------------------------------------------------- files, gc, export, failures
_SHAPE_ARGS = ["--num-layers", "4", "--topk", "2", "--num-experts", "8"]
_SPEC_ARGS = [*_SHAPE_ARGS, "--moe-layers", "1", "2"]


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def _dead_temp(directory: Path, size: int) -> Path:
    """A temp file named as if a writer on this host, now dead, had left it."""
    from r3arrow.io._layout import temp_name

    name = temp_name("part-00000.parquet").replace(f"-{os.getpid()}-", f"-{_dead_pid()}-")
    path = directory / name
    path.write_bytes(b"\0" * size)
    return path


def test_gc_removes_dead_writers_temps_and_inspect_reports_them(
    tmp_path: Path, rng: np.random.Generator, capsys: pytest.CaptureFixture[str]
) -> None:
    from r3arrow.io._layout import temp_name

    root = tmp_path / "run"
    r3arrow.write_rollouts(_table(rng), root, step=0)
    dead = _dead_temp(root / "step=0", 1000)
    live = root / "step=0" / temp_name("part-00001.parquet")  # this process: alive
    live.write_bytes(b"x" * 10)
    other = root / "step=0" / f".part-00002.parquet.tmp-otherhost-1-{'0' * 32}"
    other.write_bytes(b"y" * 7)
    assert main(["inspect", str(root), "--json"]) == EXIT_OK
    info = orjson.loads(capsys.readouterr().out)
    assert (info["temp_files"], info["temp_bytes"], info["stale_temp_bytes"]) == (3, 1017, 1000)
    assert main(["gc", str(root), "--dry-run"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "would remove 1 temp files" in out and "1000 B" in out and dead.exists()
    assert main(["gc", str(root)]) == EXIT_OK
    out = capsys.readouterr().out
    assert str(dead) in out and "removed 1 temp files" in out and "kept 2" in out
    assert not dead.exists() and live.exists() and other.exists()
    assert main(["inspect", str(root)]) == EXIT_OK
    assert "leftover temps:      2 files" in capsys.readouterr().out


def test_export_portable_round_trips(
    rollout_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import pyarrow.parquet as pq

    out = tmp_path / "p.parquet"
    assert main(["export", str(rollout_file), str(out), "--portable"]) == EXIT_OK
    assert "portable" in capsys.readouterr().out
    assert pq.read_schema(out).field("routes").type == pa.large_list(pa.list_(pa.list_(pa.uint8())))
    r3arrow.testing.assert_rollouts_equal(
        r3arrow.read_rollouts(out), r3arrow.read_rollouts(rollout_file)
    )


def test_unknown_compression_is_a_usage_error_listing_choices(
    rollout_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(
            ["export", str(rollout_file), str(tmp_path / "o"), "--portable", "--compression", "xz"]
        )
    assert exc.value.code == EXIT_USAGE
    err = capsys.readouterr().err
    assert "xz" in err and "zstd" in err and "snappy" in err


@pytest.mark.parametrize("value", ["2147483648", "-1", "1.5", "4e9"])
def test_spec_overflow_is_a_usage_error(
    value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "d.jsonl"
    src.write_text("")
    args = ["convert", str(src), "--out", str(tmp_path / "o.parquet"), *_SPEC_ARGS]
    args[args.index("--num-experts") + 1] = value
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == EXIT_USAGE
    assert value in capsys.readouterr().err


def test_fifo_is_refused_not_opened(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    fifo = tmp_path / "f.parquet"
    os.mkfifo(fifo)
    for argv in (
        ["inspect", str(fifo)],
        ["stats", str(fifo)],
        ["convert", str(fifo), "--out", str(tmp_path / "o.parquet"), *_SPEC_ARGS],
    ):
        assert main(argv) == EXIT_ERROR
        err = capsys.readouterr().err
        assert err.startswith("r3arrow: error:") and "FIFO" in err and str(fifo) in err


def test_rollout_file_without_routes_fails_cleanly(
    rollout_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import pyarrow.parquet as pq

    table = pq.read_table(rollout_file)
    bad = tmp_path / "noroutes.parquet"
    pq.write_table(table.drop_columns(["routes"]), bad)
    assert main(["inspect", str(bad)]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert err.startswith("r3arrow: error:") and "routes" in err and "Traceback" not in err


def test_non_canonical_step_directory_fails_cleanly(
    tmp_path: Path, rng: np.random.Generator, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "run"
    r3arrow.write_rollouts(_table(rng), root, step=1)
    (root / "step=1").rename(root / "step=01")
    assert main(["inspect", str(root)]) == EXIT_ERROR
    assert "step=01" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["../a.npy", "sub/../../a.npy"])
def test_convert_refuses_npy_outside_the_dump_folder(
    name: str, tmp_path: Path, rng: np.random.Generator, capsys: pytest.CaptureFixture[str]
) -> None:
    np.save(tmp_path / "a.npy", random_routes(rng, 4, SPEC), allow_pickle=False)
    (tmp_path / "dumps" / "sub").mkdir(parents=True)
    rec = {"prompt_ids": [1, 2, 3], "response_ids": [4, 5], "routes_npy": name}
    src = tmp_path / "dumps" / "d.jsonl"
    src.write_bytes(orjson.dumps(rec) + b"\n")
    argv = ["convert", str(src), "--out", str(tmp_path / "o.parquet"), "--format", "npy"]
    argv += [
        *_SPEC_ARGS,
        "3",
    ]
    assert main(argv) == EXIT_ERROR
    err = capsys.readouterr().err
    assert name in err and "--allow-outside" in err
    assert main([*argv, "--allow-outside"]) == EXIT_OK


def test_convert_checks_npy_declared_size_before_allocating(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    header = "{'descr': '|u1', 'fortran_order': False, 'shape': (1099511627776, 4, 2), }"
    header += " " * (63 - len(header) % 64) + "\n"
    raw = b"\x93NUMPY\x01\x00" + len(header).to_bytes(2, "little") + header.encode() + b"\0" * 8
    (tmp_path / "big.npy").write_bytes(raw)
    rec = {"prompt_ids": [1, 2, 3], "response_ids": [4, 5], "routes_npy": "big.npy"}
    src = tmp_path / "d.jsonl"
    src.write_bytes(orjson.dumps(rec) + b"\n")
    argv = ["convert", str(src), "--out", str(tmp_path / "o.parquet"), "--format", "npy"]
    assert main([*argv, *_SPEC_ARGS]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert "big.npy" in err and "8796093022208" in err


def test_keyboard_interrupt_exits_130(
    monkeypatch: pytest.MonkeyPatch, rollout_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import r3arrow.cli as cli

    def interrupted(path: Path) -> dict[str, Any]:
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "inspect_summary", interrupted)
    assert main(["inspect", str(rollout_file)]) == 130
    assert "interrupted" in capsys.readouterr().err


def test_closed_stdout_exits_quietly(rollout_file: Path) -> None:
    """``r3arrow inspect f --json | head -c 10``: no traceback, exit 0 or 141."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "r3arrow", "inspect", str(rollout_file), "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader went away before the first write
    with proc.stderr:
        err = proc.stderr.read()
    assert proc.wait(timeout=120) in (0, 141)
    assert err == b""


# ------------------------------------------------------ every folder r3arrow writes
@pytest.fixture(scope="module")
def demo_out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's own output folder (rollouts.parquet, expert_load.png), small."""
    out = tmp_path_factory.mktemp("demo")
    args = ["demo", "--out", str(out), "--no-replay", "--no-progress", "--groups", "2"]
    assert main([*args, "--samples", "2", "--turns", "1", "--max-tokens", "4"]) == EXIT_OK
    return out


def test_every_folder_r3arrow_writes_is_read(
    demo_out: Path, rollout_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    table = r3arrow.read_rollouts(rollout_file)
    root = tmp_path / "run"
    r3arrow.write_rollouts(table, root, step=3)
    capsys.readouterr()
    for source in (demo_out, rollout_file, root, root / "step=3"):
        assert main(["inspect", str(source), "--json"]) == EXIT_OK, capsys.readouterr().err
        assert orjson.loads(capsys.readouterr().out)["rows"] > 0
        assert main(["stats", str(source), "--json"]) == EXIT_OK, capsys.readouterr().err
        assert orjson.loads(capsys.readouterr().out)["load"]
        dest = tmp_path / f"p-{source.name}.parquet"
        assert main(["export", str(source), str(dest), "--portable"]) == EXIT_OK
        assert r3arrow.read_rollouts(dest).num_rows > 0
        capsys.readouterr()
    demo_rows = r3arrow.read_rollouts(demo_out / "rollouts.parquet").num_rows
    assert main(["inspect", str(demo_out), "--json"]) == EXIT_OK
    assert orjson.loads(capsys.readouterr().out)["rows"] == demo_rows


def test_a_folder_of_several_files_names_them(
    rollout_file: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    r3arrow.write_rollouts(r3arrow.read_rollouts(rollout_file), rollout_file.parent / "b.parquet")
    assert main(["stats", str(rollout_file.parent)]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert "r.parquet" in err and "b.parquet" in err and "\n" not in err.rstrip("\n")


def test_demo_help_names_the_diagnose_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "diagnose --out" not in text and "r3arrow diagnose DIR" in text


@pytest.mark.parametrize("url", ["foo", "ftp://x", "http://", "localhost:8000"])
def test_a_bad_engine_url_is_a_usage_error_naming_the_flag(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--engine-url", url])
    assert exc.value.code == EXIT_USAGE
    err = capsys.readouterr().err
    assert "--engine-url" in err and "urls" not in err and "base_url" not in err


def test_an_html_error_page_is_capped_in_the_one_line_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import http.server
    import threading

    page = b"<html><body>" + b"<p>not found</p>\n" * 2000 + b"</body></html>"

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.send_response(404)
            self.send_header("Content-Type", "text/html")
            self.send_header("Content-Length", str(len(page)))
            self.end_headers()
            self.wfile.write(page)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        args = ["demo", "--engine-url", url, "--out", str(tmp_path), "--no-progress"]
        code = main([*args, "--no-replay", *_SHAPE_ARGS, "--groups", "1", "--samples", "1"])
    finally:
        server.shutdown()
        server.server_close()
    assert code == EXIT_ERROR
    err = capsys.readouterr().err
    assert err.startswith("r3arrow: error:") and err.count("\n") == 1
    assert "HTTP 404" in err and "<html><body><p>not found</p>" in err
    assert len(err) < 600 and f"{len(page)} bytes" in err
