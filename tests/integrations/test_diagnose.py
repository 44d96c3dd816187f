"""Replay diagnostics: persistence (`r3arrow.io.write_diagnostics`), ``r3arrow diagnose``,
and ``r3arrow inspect`` streaming by row group.

Real Parquet files under ``tmp_path``; expected counts are built by hand from routes whose
differences are planted at known tokens and layers.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st

import r3arrow
from r3arrow.cli import EXIT_ERROR, EXIT_OK, main
from r3arrow.errors import SchemaError
from r3arrow.io import (
    read_diagnostics,
    read_rollouts,
    rollout_files,
    write_diagnostics,
    write_rollouts,
)
from r3arrow.io._diagnostics import DIAGNOSTICS_SCHEMA
from r3arrow.spec import RouteSpec, numpy_to_routes
from r3arrow.stats import RouteAgreement, route_agreement
from r3arrow.table import flat_routes
from r3arrow.testing import random_rollouts

SPEC = RouteSpec(num_layers=4, topk=2, num_experts=8, moe_layers=(1, 2, 3))
SHAPES = [(5, 4, 9), (3, 6, 8), (4, 2, 0), (2, 5, 5)]


def agreement(tokens: int = 10, all_identical: int = 6) -> RouteAgreement:
    return RouteAgreement(
        (1, 2, 3), 2, tokens, np.array([9, 8, 10]), np.array([19, 18, 20]), all_identical
    )


def with_train_routes(table: pa.Table, changes: list[tuple[int, int]]) -> pa.Table:
    """``table`` plus ``train_routes``: the routes with expert slot 0 of each (token, layer)
    in ``changes`` replaced by an expert outside that row's top-k set."""
    rows, offsets = flat_routes(table)
    train = rows.copy()
    for tok, layer in changes:
        used = set(train[tok, layer].tolist())
        train[tok, layer, 0] = next(e for e in range(SPEC.num_experts or 8) if e not in used)
    col = pa.LargeListArray.from_arrays(pa.array(offsets), numpy_to_routes(train, SPEC))
    out = table.append_column(pa.field("train_routes", SPEC.routes_type), col)
    return out.replace_schema_metadata(table.schema.metadata)


def expected(tokens: int, changes: list[tuple[int, int]]) -> RouteAgreement:
    layers = SPEC.router_layers
    per = np.array([sum(1 for _, la in changes if la == g) for g in layers], np.int64)
    bad_tokens = len({t for t, la in changes if la in layers})
    return RouteAgreement(
        layers, SPEC.topk, tokens, tokens - per, tokens * SPEC.topk - per, tokens - bad_tokens
    )


# ---------------------------------------------------------------- persistence
def test_write_read_round_trip_by_step_and_source(tmp_path: Path) -> None:
    a, b = agreement(), agreement(tokens=12, all_identical=7)
    p = write_diagnostics(tmp_path, 3, a)
    assert p == tmp_path / "_diagnostics" / "step=3" / "native_vs_replay.parquet"
    write_diagnostics(tmp_path, 1, b)
    write_diagnostics(tmp_path, 1, a, source="train_vs_engine")
    table = read_diagnostics(tmp_path)
    assert table.schema.equals(DIAGNOSTICS_SCHEMA.remove_metadata())
    assert table.column("step").to_pylist() == [1] * 6 + [3] * 3
    assert (
        table.column("source").to_pylist()[:6] == ["native_vs_replay"] * 3 + ["train_vs_engine"] * 3
    )
    assert table.column("layer").to_pylist() == [1, 2, 3] * 3
    assert table.column("tokens").to_pylist()[:3] == [12] * 3
    assert table.column("identical").to_pylist()[:3] == [9, 8, 10]
    assert table.column("overlap").to_pylist()[:3] == [19, 18, 20]
    assert table.column("all_identical").to_pylist()[:3] == [7] * 3
    assert read_diagnostics(tmp_path, source="train_vs_engine").num_rows == 3
    # the same (step, source) again replaces the file: a rerun step
    write_diagnostics(tmp_path, 3, b)
    again = read_diagnostics(tmp_path, source="native_vs_replay")
    steps, tokens = again.column("step").to_pylist(), again.column("tokens").to_pylist()
    assert dict(zip(steps, tokens, strict=True)) == {1: 12, 3: 12}
    assert not [p for p in tmp_path.rglob(".*")]  # no temp left behind


def test_no_diagnostics_is_an_empty_table(tmp_path: Path) -> None:
    assert read_diagnostics(tmp_path).num_rows == 0
    with pytest.raises(FileNotFoundError):
        read_diagnostics(tmp_path / "absent")


def test_rollout_readers_ignore_the_diagnostics(tmp_path: Path, rng: np.random.Generator) -> None:
    root = tmp_path / "run"
    for step in (0, 2):
        write_rollouts(random_rollouts(rng, SPEC, SHAPES, tag=f"s{step}"), root, step=step)
    before = read_rollouts(root)
    write_diagnostics(root, 0, agreement())
    write_diagnostics(root, 7, agreement())  # a step with no rollouts
    files = rollout_files(root)
    assert [f.step for f in files] == [0, 2]
    after = read_rollouts(root)
    r3arrow.testing.assert_rollouts_equal(after, before)
    assert sum(f.num_rows for f in files) == before.num_rows
    assert files[0].schema.names == before.drop_columns(["step"]).schema.names
    assert [t.column("step")[0].as_py() for t in r3arrow.iter_rollouts(root)] == [0, 2]
    assert main(["inspect", str(root), "--json"]) == EXIT_OK


@pytest.mark.parametrize(
    ("bad", "match"),
    [
        (agreement(tokens=8), "identical"),  # identical 9 > tokens 8
        (agreement(all_identical=9), "all_identical"),  # > min(identical) = 8
        (
            RouteAgreement((1, 2), 2, 10, np.array([9, 8]), np.array([17, 20]), 5),
            "overlap",  # 17 < identical * topk = 18
        ),
    ],
)
def test_inconsistent_counts_are_refused_before_writing(
    tmp_path: Path, bad: RouteAgreement, match: str
) -> None:
    with pytest.raises(SchemaError, match=match):
        write_diagnostics(tmp_path, 0, bad)
    assert not (tmp_path / "_diagnostics").exists()


def test_argument_misuse(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="step"):
        write_diagnostics(tmp_path, -1, agreement())
    with pytest.raises(TypeError, match="step"):
        write_diagnostics(tmp_path, 1.0, agreement())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="source"):
        write_diagnostics(tmp_path, 0, agreement(), source="../x")
    with pytest.raises(TypeError, match="RouteAgreement"):
        write_diagnostics(tmp_path, 0, {"tokens": 3})


def _corrupt(path: Path, how: str) -> None:
    if how == "bytes":
        data = bytearray(path.read_bytes())
        data[len(data) // 3] ^= 0xFF
        path.write_bytes(bytes(data))
    elif how == "truncated":
        path.write_bytes(path.read_bytes()[:40])
    elif how == "foreign":
        pq.write_table(pa.table({"x": [1]}), path)
    elif how == "edited":  # plausible data, metadata checksum no longer matches
        t = pq.read_table(path)
        meta = dict(t.schema.metadata or {})
        meta[b"r3arrow.note"] = b"edited"
        pq.write_table(t.replace_schema_metadata(meta), path)
    elif how == "wrong_step":
        t = pq.read_table(path)
        t = t.set_column(0, t.schema.field(0), pa.array([5] * t.num_rows, pa.int64()))
        pq.write_table(t, path)  # metadata (and its checksum) kept: the step is the lie


@pytest.mark.parametrize("how", ["bytes", "truncated", "foreign", "edited", "wrong_step"])
def test_bad_files_raise_with_their_path(tmp_path: Path, how: str) -> None:
    p = write_diagnostics(tmp_path, 4, agreement())
    _corrupt(p, how)
    with pytest.raises(SchemaError) as exc:
        read_diagnostics(tmp_path)
    assert exc.value.path == str(p) and str(p) in str(exc.value)


def test_stray_entries_in_the_diagnostics_directory(tmp_path: Path) -> None:
    write_diagnostics(tmp_path, 0, agreement())
    (tmp_path / "_diagnostics" / "notes.txt").write_text("x")
    with pytest.raises(SchemaError, match="step=N"):
        read_diagnostics(tmp_path)
    (tmp_path / "_diagnostics" / "notes.txt").unlink()
    (tmp_path / "_diagnostics" / "step=01").mkdir()
    with pytest.raises(SchemaError, match="step=01"):
        read_diagnostics(tmp_path)


@given(
    tokens=st.integers(0, 10_000),
    layers=st.lists(st.integers(0, 200), min_size=1, max_size=12, unique=True),
    topk=st.integers(1, 8),
    data=st.data(),
)
def test_any_consistent_agreement_round_trips(
    tmp_path_factory: pytest.TempPathFactory,
    tokens: int,
    layers: list[int],
    topk: int,
    data: st.DataObject,
) -> None:
    identical = np.array(
        data.draw(st.lists(st.integers(0, tokens), min_size=len(layers), max_size=len(layers)))
    )
    overlap = np.array(
        [data.draw(st.integers(int(i) * topk, tokens * topk)) for i in identical], np.int64
    )
    all_id = data.draw(st.integers(0, int(identical.min())))
    a = RouteAgreement(tuple(layers), topk, tokens, identical, overlap, all_id)
    root = tmp_path_factory.mktemp("d")
    step = data.draw(st.integers(0, 2**40))
    write_diagnostics(root, step, a)
    from r3arrow.cli._diagnose import agreements_from_table

    back = agreements_from_table(read_diagnostics(root))["native_vs_replay"][step]
    order = np.argsort(layers)  # read back by ascending layer
    assert back == RouteAgreement(
        tuple(sorted(layers)), topk, tokens, identical[order], overlap[order], all_id
    )


# ------------------------------------------------------------------- diagnose
def test_diagnose_prints_the_r3_quantities_from_diagnostics(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_diagnostics(tmp_path, 0, agreement())
    assert main(["diagnose", str(tmp_path), "--json"]) == EXIT_OK
    info = orjson.loads(capsys.readouterr().out)
    assert info["source"] == "native_vs_replay" and info["topk"] == 2
    # 1 - overlap / (tokens * K) over all layers; 1 - all_identical / tokens
    assert info["total"]["decisions_differ"] == pytest.approx(1 - 57 / 60)
    assert info["total"]["tokens_differ_any_layer"] == pytest.approx(0.4)
    assert [r["layer"] for r in info["layers"]] == [1, 2, 3]
    assert info["layers"][1]["decisions_differ"] == pytest.approx(0.1)
    assert info["layers"][1]["top_k_set_differs"] == pytest.approx(0.2)
    assert main(["diagnose", str(tmp_path)]) == EXIT_OK
    text = capsys.readouterr().out
    assert "router decisions that differ:            5.00%" in text
    assert "tokens differing on at least one layer:  40.00%" in text


def test_diagnose_shows_the_stored_route_fallback_per_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from r3arrow.stats import RouteFallback

    write_diagnostics(tmp_path, 0, agreement())
    write_diagnostics(tmp_path, 2, RouteFallback(4, 1, 200, 10))  # 10 / 200 = 5%
    write_diagnostics(tmp_path, 0, RouteFallback(3, 0, 90, 0))
    assert main(["diagnose", str(tmp_path), "--json"]) == EXIT_OK
    rows = orjson.loads(capsys.readouterr().out)["fallback"]
    assert [(r["step"], r["source"], r["missing_rows"], r["fraction"]) for r in rows] == [
        (0, "rollout_routes", 0, 0.0),
        (2, "rollout_routes", 10, 0.05),
    ]
    assert main(["diagnose", str(tmp_path)]) == EXIT_OK
    text = capsys.readouterr().out.splitlines()
    assert "     2  rollout_routes        1 of 4            200        10      5.00%" in text
    assert "     0  rollout_routes        0 of 3             90         0      0.00%" in text


def test_diagnose_over_steps_writes_a_png(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for s in (0, 5, 9):
        write_diagnostics(tmp_path, s, agreement(tokens=10 + s, all_identical=6))
    png = tmp_path / "out" / "d.png"
    assert main(["diagnose", str(tmp_path), "--png", str(png)]) == EXIT_OK
    text = capsys.readouterr().out
    assert "3 steps" in text and f"plot written to {png}" in text
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    one = tmp_path / "one"
    write_diagnostics(one, 2, agreement())
    assert main(["diagnose", str(one), "--png", str(tmp_path / "one.png")]) == EXIT_OK
    assert (tmp_path / "one.png").stat().st_size > 5_000


def mismatch(k3: float, tokens: int = 5) -> dict[str, float]:
    """A stored-mismatch dict with hand-picked values (only k3 varies)."""
    return {
        "tokens": float(tokens),
        "k1": 0.01,
        "k2": 0.02,
        "k3": k3,
        "abs_mean": 0.1,
        "abs_max": 0.5,
        "frac_abs_gt_ln2": 0.2,
        "token_mult_prob_error": 1.25,
        "js_divergence": 0.003,
    }


def test_diagnose_shows_each_mismatch_beside_its_routing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Mismatch source S sits beside the agreement stored as S + "_routing" (the demo's
    layout), else beside the report's source at that step, else beside nothing."""
    write_diagnostics(tmp_path, 0, agreement())  # native_vs_replay: 4 of 10 tokens differ
    same = RouteAgreement((1, 2, 3), 2, 10, np.full(3, 10), np.full(3, 20), 10)
    write_diagnostics(tmp_path, 0, same, source="a_routing")
    write_diagnostics(tmp_path, 0, mismatch(0.004), source="a")
    write_diagnostics(tmp_path, 0, mismatch(0.125), source="b")
    write_diagnostics(tmp_path, 1, mismatch(0.5, tokens=7), source="b")
    assert main(["diagnose", str(tmp_path), "--json"]) == EXIT_OK
    info = orjson.loads(capsys.readouterr().out)
    assert info["source"] == "native_vs_replay"
    got = [
        (r["step"], r["source"], r["routing"] and r["routing"]["source"], r["k3"])
        for r in info["logprob_mismatch"]
    ]
    assert got == [
        (0, "a", "a_routing", 0.004),
        (0, "b", "native_vs_replay", 0.125),
        (1, "b", None, 0.5),
    ]
    assert info["logprob_mismatch"][0]["routing"]["tokens_differ_any_layer"] == 0.0
    assert info["logprob_mismatch"][1]["routing"]["tokens_differ_any_layer"] == pytest.approx(0.4)
    # several mismatch sources, none named like the report's nor train_vs_rollout: no pick
    assert [s["mismatch"] for s in info["steps"]] == [None]
    assert main(["diagnose", str(tmp_path)]) == EXIT_OK
    lines = capsys.readouterr().out.splitlines()
    head = lines.index(
        "log-prob mismatch beside routing disagreement (routing: tokens whose top-k set "
        "differs on >= 1 layer; log-probs: loss tokens)"
    )
    cells = "      0.125        0.2       1.25      0.003        0.5"
    assert lines[head + 1].split() == [
        "step", "source", "routing", "of", "differs", "loss", "tokens",
        "k3", "|Δ|>ln2", "mult_err", "js_div", "|Δ|", "max",
    ]  # fmt: skip
    assert lines[head + 3] == f"     0  b       native_vs_replay    40.00%            5{cells}"
    assert lines[head + 2].startswith("     0  a       a_routing            0.00%            5")
    assert lines[head + 4].startswith("     1  b       -                      n/a            7")
    assert len(lines) == head + 5


@pytest.mark.parametrize("chunked", [False, True])
def test_diagnose_computes_from_train_routes_when_no_diagnostics(
    tmp_path: Path, rng: np.random.Generator, capsys: pytest.CaptureFixture[str], chunked: bool
) -> None:
    root = tmp_path / "run"
    plans = {0: [(0, 1), (3, 1), (3, 2), (20, 3)], 4: [(1, 3), (2, 0)]}  # layer 0 is dense
    want = {}
    for step, changes in plans.items():
        table = with_train_routes(random_rollouts(rng, SPEC, SHAPES, tag=f"s{step}"), changes)
        if chunked:  # chunked routes: a routes column in several chunks
            table = pa.concat_tables([table.slice(0, 2), table.slice(2)])
            assert table.column("train_routes").num_chunks == 2
        write_rollouts(table, root, step=step)
        want[step] = expected(int(flat_routes(table)[0].shape[0]), changes)
        assert route_agreement(table, "train_routes") == want[step]
    assert main(["diagnose", str(root), "--json"]) == EXIT_OK
    info = orjson.loads(capsys.readouterr().out)
    assert info["source"] == "routes_vs_train_routes"
    total = want[0] + want[4]
    assert info["total"]["tokens"] == total.tokens
    assert info["total"]["tokens_differ_any_layer"] == pytest.approx(total.differing_fraction)
    assert [s["step"] for s in info["steps"]] == [0, 4]
    assert info["steps"][1]["tokens_differ_any_layer"] == pytest.approx(1 / 22)
    one = root / "step=0" / "part-00000.parquet"
    assert main(["diagnose", str(one), "--json"]) == EXIT_OK
    assert orjson.loads(capsys.readouterr().out)["total"]["tokens"] == want[0].tokens
    folder = tmp_path / "demo-like"  # one rollout file beside other outputs, as the demo writes
    folder.mkdir()
    (folder / "expert_load.png").write_bytes(b"")
    write_rollouts(read_rollouts(one), folder / "rollouts.parquet")
    assert main(["diagnose", str(folder), "--json"]) == EXIT_OK
    assert orjson.loads(capsys.readouterr().out)["total"]["tokens"] == want[0].tokens


def test_diagnose_errors_reach_the_user_as_one_line(
    tmp_path: Path, rng: np.random.Generator, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "plain"
    write_rollouts(random_rollouts(rng, SPEC, SHAPES), root, step=0)
    cases: list[tuple[list[str], str]] = [
        (["diagnose", str(root)], "train_routes"),
        (["diagnose", str(tmp_path / "absent")], "absent"),
        (["diagnose", str(tmp_path / "empty")], "neither"),
    ]
    (tmp_path / "empty").mkdir()
    diag = tmp_path / "diag"  # two sources, neither the default native_vs_replay
    p = write_diagnostics(diag, 0, agreement(), source="first")
    write_diagnostics(diag, 0, agreement(), source="other")
    cases.append((["diagnose", str(diag)], "--source"))
    cases.append((["diagnose", str(diag), "--source", "absent"], "'absent'"))
    bad = tmp_path / "bad"
    q = write_diagnostics(bad, 0, agreement())
    _corrupt(q, "truncated")
    cases.append((["diagnose", str(bad)], str(q)))
    for argv, needle in cases:
        assert main(argv) == EXIT_ERROR, argv
        err = capsys.readouterr().err
        assert err.startswith("r3arrow: error:") and needle in err, (argv, err)
        assert "Traceback" not in err and err.count("\n") == 1
    assert main(["diagnose", str(diag), "--source", "other", "--json"]) == EXIT_OK
    assert orjson.loads(capsys.readouterr().out)["source"] == "other"
    write_diagnostics(diag, 0, agreement(tokens=12))  # the default source wins when present
    assert main(["diagnose", str(diag), "--json"]) == EXIT_OK
    info = orjson.loads(capsys.readouterr().out)
    assert (info["source"], info["total"]["tokens"]) == ("native_vs_replay", 12)
    assert p.exists()


# ------------------------------------------------------------ inspect streams
def test_inspect_streams_row_groups_and_never_reads_a_whole_step(
    tmp_path: Path, rng: np.random.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    import r3arrow.io._parquet as parquet_io

    root = tmp_path / "run"
    tables = [random_rollouts(rng, SPEC, SHAPES * 3, tag=f"s{s}") for s in (0, 1)]
    for s, t in enumerate(tables):
        write_rollouts(t, root, step=s, row_group_rows=3)
    groups = [pq.ParquetFile(f).metadata.num_row_groups for f in sorted(root.rglob("*.parquet"))]
    assert groups == [4, 4]
    seen: list[int] = []
    real = parquet_io.read_rollouts

    def spy(*args: Any, **kwargs: Any) -> pa.Table:
        groups = kwargs.get("row_groups")
        if groups is None or len(groups) != 1:
            raise AssertionError("inspect must not read a whole step or file")
        out = real(*args, **kwargs)
        seen.append(out.num_rows)
        return out

    def refuse(*_: Any, **__: Any) -> Any:
        raise AssertionError("inspect must not read a whole step or file")

    monkeypatch.setattr("r3arrow.io.read_rollouts", spy)
    monkeypatch.setattr("r3arrow.io.iter_rollouts", refuse)
    from r3arrow.cli._inspect import inspect_summary

    info = inspect_summary(root)
    assert seen == [3] * 8
    assert info["rows"] == 24 and info["steps"] == [0, 1]
    tokens = sum(p + r for p, r, _ in SHAPES) * 6
    captured = sum(c for _, _, c in SHAPES) * 6
    assert (info["tokens"], info["captured_rows"]) == (tokens, captured)
    assert info["route_bytes"] == captured * SPEC.row_nbytes
    assert info["columns"]["routes"] == str(SPEC.routes_type)
    assert list(info["columns"])[-1] == "step"


def test_inspect_refuses_files_that_disagree_on_the_spec(
    tmp_path: Path, rng: np.random.Generator, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "run"
    write_rollouts(random_rollouts(rng, SPEC, SHAPES), root, step=0)
    other = RouteSpec(num_layers=4, topk=2, num_experts=16, moe_layers=(1, 2, 3))
    write_rollouts(random_rollouts(rng, other, SHAPES), root, step=1)
    assert main(["inspect", str(root)]) == EXIT_ERROR
    err = capsys.readouterr().err
    assert "step=1" in err and "expected the spec" in err


# ------------------------------------------------------- engine router inputs
def test_engine_router_inputs_reproduce_its_routing() -> None:
    """What each router scored, times its weights, gives the engine's top-k (float64)."""
    from r3arrow.errors import EngineRequestError
    from r3arrow.testing.engine import ReferenceEngine, TinyMoEConfig

    engine = ReferenceEngine(TinyMoEConfig(num_layers=4, dense_layers=(0, 2), num_experts=16))
    seq = np.random.default_rng(3).integers(0, 512, 70)
    inputs = engine.router_inputs(seq)
    moe = engine.config.moe_layers
    assert inputs.shape == (70, len(moe), engine.config.hidden_size)
    assert inputs.dtype == np.float64
    logits = np.einsum("tlh,lhe->tle", inputs, engine.model.router_weights().numpy())
    k = engine.config.topk
    top = np.sort(np.argsort(-logits, axis=-1)[..., :k], axis=-1)
    routes = engine.routes_for(seq)
    # another BLAS may move a logit by a few ulps: rows whose k-th and (k+1)-th logits are
    # that close may rank either way, every other row must match exactly
    ranked = -np.sort(-logits, axis=-1)
    clear = (ranked[..., k - 1] - ranked[..., k]) > 1e-9
    assert clear.mean() > 0.95
    np.testing.assert_array_equal(top[clear], np.sort(routes[:, list(moe)], axis=-1)[clear])
    # causal: a prefix sees the same inputs as the first rows of the whole sequence (to the
    # last bits: BLAS may pick another kernel for another length)
    np.testing.assert_allclose(engine.router_inputs(seq[:30]), inputs[:30], rtol=1e-12, atol=1e-12)
    with pytest.raises(EngineRequestError, match="token_ids"):
        engine.router_inputs([])
