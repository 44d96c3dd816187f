"""``column=`` and ``layers=`` of the expert-count statistics.

``column="train_routes"`` counts a second routes column (the trainer routers' own choices,
docs/train-routes.md) exactly as if it were ``routes``; ``layers=`` counts only those global
layers, and a path then reads only them (layer projection). Both work for tables (one or many
chunks), files and step roots in every storage layout, with the numba and numpy kernels.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

import r3arrow.io
from r3arrow import stats
from r3arrow.errors import SchemaError
from r3arrow.io import project_layers, write_rollouts
from r3arrow.ray import RayExecutor  # an executor object: constructing one needs no ray
from r3arrow.spec import RouteSpec, numpy_to_routes
from r3arrow.stats import _sources as stats_sources
from r3arrow.table import flat_routes, rollout_table
from r3arrow.testing import random_routes, use_backend

SPEC = RouteSpec(num_layers=6, topk=2, num_experts=10, moe_layers=(0, 1, 3, 4, 5))
BACKENDS = ["numba", "numpy"] if importlib.util.find_spec("numba") else ["numpy"]
SUBSETS: tuple[stats.TokenSubset, ...] = ("all", "prompt", "loss")


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Iterator[str]:
    with use_backend(request.param):
        yield str(request.param)


def _table(seed: int, n: int = 5, tag: str = "t") -> pa.Table:
    """``n`` trajectories (4 prompt, 12 response, 15 route rows) with ``train_routes``:
    independently drawn routes, so its counts differ from ``routes``' ones."""
    rng = np.random.default_rng(seed)
    routes = [random_routes(rng, 15, SPEC) for _ in range(n)]
    train = np.concatenate([random_routes(rng, 15, SPEC) for _ in range(n)])
    column = pa.LargeListArray.from_arrays(
        pa.array(np.arange(n + 1, dtype=np.int64) * 15, type=pa.int64()),
        numpy_to_routes(train, SPEC),
    )
    return rollout_table(
        trajectory_id=[f"{tag}{i}" for i in range(n)],
        group_id=[f"g{i}" for i in range(n)],
        prompt_ids=[list(range(4))] * n,
        response_ids=[list(range(12))] * n,
        loss_mask=[[1] * 6 + [0] * 6] * n,
        reward=rng.random(n),
        routes=routes,
        spec=SPEC,
        train_routes=column,
    )


def _swapped(table: pa.Table) -> pa.Table:
    """``table`` with ``train_routes`` as its ``routes`` (what ``column=`` replaces)."""
    i = table.schema.get_field_index("routes")
    return table.set_column(i, "routes", table.column("train_routes")).drop_columns(
        ["train_routes"]
    )


def _only(counts: stats.ExpertCounts, layers: Sequence[int]) -> stats.ExpertCounts:
    """The rows of ``counts`` of the router layers among ``layers``."""
    keep = [i for i, g in enumerate(counts.layers) if g in set(layers)]
    return stats.ExpertCounts(
        tuple(counts.layers[i] for i in keep), counts.counts[keep], counts.tokens
    )


def _write(root: Path, tables: list[pa.Table], layout: str) -> None:
    for step, t in enumerate(tables):
        for piece in (t.slice(0, 2), t.slice(2)):
            if layout == "portable":
                write_rollouts(piece, root, step=step, portable=True)
            else:
                group = 2 if layout == "groups" else SPEC.num_layers
                write_rollouts(piece, root, step=step, layer_group=group, row_group_rows=2)


# ------------------------------------------------------------------ column=
@pytest.mark.parametrize("tokens", SUBSETS)
def test_column_counts_a_second_routes_column_of_a_table(backend: str, tokens: str) -> None:
    table = pa.concat_tables([_table(1, tag="a"), _table(2, tag="b")])  # two chunks
    assert table.column("train_routes").num_chunks == 2
    want = stats.expert_counts(_swapped(table), tokens=tokens)  # type: ignore[arg-type]
    got = stats.expert_counts(table, tokens=tokens, column="train_routes")  # type: ignore[arg-type]
    assert got == want
    assert got != stats.expert_counts(table, tokens=tokens)  # type: ignore[arg-type]
    batch = table.to_batches()[0]
    assert stats.expert_counts(batch, column="train_routes") == stats.expert_counts(
        _swapped(pa.Table.from_batches([batch]))
    )
    frame = stats.expert_load(table, column="train_routes")
    if tokens == "all":
        assert frame.equals(want.to_polars())


@pytest.mark.parametrize("layout", ["groups", "one group", "portable"])
def test_column_over_a_root_equals_the_swapped_tables(tmp_path: Path, layout: str) -> None:
    tables = [_table(10 + s, tag=f"s{s}") for s in range(2)]
    _write(tmp_path, tables, layout)
    subsets: tuple[stats.TokenSubset, ...] = ("all", "loss")
    for tokens in subsets:
        per = stats.expert_counts_by_step(
            tmp_path, tokens=tokens, column="train_routes", max_memory=4096
        )
        assert per == {
            s: stats.expert_counts(_swapped(t), tokens=tokens) for s, t in enumerate(tables)
        }
    whole = stats.expert_load(tmp_path, column="train_routes", by_step=True)
    assert whole.height == 2 * len(SPEC.router_layers) * 10


def test_column_errors(tmp_path: Path) -> None:
    table = _table(3)
    with pytest.raises(SchemaError, match="nope"):
        stats.expert_counts(table, column="nope")
    write_rollouts(table, tmp_path, step=0)
    # on disk the reader refuses the unknown column name as an argument, before any read
    with pytest.raises(ValueError, match="nope"):
        stats.expert_counts(tmp_path, column="nope")
    with pytest.raises(TypeError, match="column"):
        stats.expert_counts(table, column=3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="column"):
        stats.expert_counts(table, column="")


# ------------------------------------------------------------------ layers=
@pytest.fixture
def read_layers(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The ``layers`` argument of every streamed read of the statistics."""
    seen: list[Any] = []
    real = r3arrow.io.iter_rollouts

    def spy(*args: Any, **kwargs: Any) -> Iterator[Any]:
        seen.append(kwargs.get("layers"))
        return real(*args, **kwargs)

    monkeypatch.setattr(stats_sources, "iter_rollouts", spy)
    return seen


@pytest.mark.parametrize("layout", ["groups", "one group", "portable"])
def test_layers_read_and_count_only_those_layers(
    tmp_path: Path, layout: str, backend: str, read_layers: list[Any]
) -> None:
    tables = [_table(20 + s, tag=f"s{s}") for s in range(2)]
    _write(tmp_path, tables, layout)
    wanted = [5, 1, 2, 1]  # 2 is dense: skipped; duplicates merged
    full = {s: stats.expert_counts(t) for s, t in enumerate(tables)}
    per = stats.expert_counts_by_step(tmp_path, layers=wanted)
    assert per == {s: _only(c, wanted) for s, c in full.items()}
    assert per[0].layers == (1, 5)
    assert read_layers, "expected streamed reads"
    assert all(r is not None and set(r) <= {1, 2, 5} for r in read_layers), read_layers
    if layout == "groups":  # one pass per stored group holding a wanted router layer
        assert sorted(map(tuple, read_layers)) == [(1,), (5,)]
    tot = stats.expert_counts(tmp_path, layers=range(3, 6), column="train_routes")
    assert tot == _only(stats.expert_counts(_swapped(pa.concat_tables(tables))), [3, 4, 5])
    frame = stats.expert_load(tmp_path, layers=[4])
    assert frame["layer"].unique().to_list() == [4] and frame["tokens"].sum() == 2 * 5 * 15 * 2


def test_layers_of_tables_and_projected_tables(backend: str) -> None:
    table = pa.concat_tables([_table(30, tag="a"), _table(31, tag="b")])
    full = stats.expert_counts(table, tokens="loss")
    got = stats.expert_counts(table, tokens="loss", layers=[0, 4])
    assert got == _only(full, [0, 4])
    projected = project_layers(table, [1, 3, 4])
    assert stats.expert_counts(projected) == _only(stats.expert_counts(table), [1, 3, 4])
    assert stats.expert_counts(projected, layers=[3], tokens="loss") == _only(full, [3])


def test_layer_passes_at_once_give_the_same_integers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tables = [_table(40 + s, n=7, tag=f"s{s}") for s in range(3)]
    _write(tmp_path, tables, "groups")
    results = []
    for threads in (1, 2, 4):
        monkeypatch.setattr(stats_sources, "PASS_THREADS", threads)
        results.append(stats.expert_counts_by_step(tmp_path, tokens="loss", max_memory=2048))
    assert results[0] == results[1] == results[2]
    assert results[0] == {s: stats.expert_counts(t, tokens="loss") for s, t in enumerate(tables)}


def test_layers_errors(tmp_path: Path) -> None:
    table = _table(5)
    write_rollouts(table, tmp_path / "groups", step=0, layer_group=2)
    write_rollouts(table, tmp_path / "one", step=0, layer_group=SPEC.num_layers)
    for source in (table, tmp_path / "groups", tmp_path / "one"):
        with pytest.raises(ValueError, match="layers"):
            stats.expert_counts(source, layers=[6])
        with pytest.raises(ValueError, match="layers"):
            stats.expert_counts(source, layers=[2])  # dense only
        with pytest.raises(ValueError, match="layers"):
            stats.expert_counts(source, layers=[])
        with pytest.raises(TypeError, match="layers"):
            stats.expert_counts(source, layers="1")  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="layers"):
            stats.expert_counts(source, layers=[1.0])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="executor=None only"):
        stats.expert_counts(tmp_path / "groups", layers=[1], executor=RayExecutor())


def test_block_partials_count_the_column() -> None:
    """An executor's per-block map (no cluster needed) reads and counts ``column``."""
    from r3arrow.stats._sources import BlockPartials, decode

    table = _table(6).append_column("step", pa.array([0, 0, 1, 1, 1], pa.int64()))
    block = BlockPartials("counts", "loss", None, column="train_routes")
    assert block.columns()[0] == "train_routes" and "routes" not in block.columns()
    parts = block(table.select([*block.columns(), "step"]))
    swapped = _swapped(table)
    assert {s: decode("counts", v) for s, v in parts.items()} == {
        s: stats.expert_counts(swapped.slice(a, n), tokens="loss")
        for s, (a, n) in {0: (0, 2), 1: (2, 3)}.items()
    }


@pytest.mark.parametrize("layout", ["groups", "one group", "table"])
def test_agreement_over_some_layers(tmp_path: Path, layout: str, read_layers: list[Any]) -> None:
    """Per-layer agreement of ``routes`` vs ``train_routes`` on layers 1 and 4 only."""
    tables = [_table(50 + s, tag=f"s{s}") for s in range(2)]
    whole = pa.concat_tables(tables)
    source: Any = whole
    if layout != "table":
        _write(tmp_path, tables, layout)
        source = tmp_path
    full = stats.route_agreement(whole, "train_routes")
    got = stats.route_agreement(source, "train_routes", layers=[4, 1, 2])  # 2: dense
    keep = [full.layers.index(g) for g in (1, 4)]
    assert got.layers == (1, 4) and got.tokens == full.tokens
    assert np.array_equal(got.identical, full.identical[keep])
    assert np.array_equal(got.overlap, full.overlap[keep])
    a, b = (np.sort(flat_routes(_swapped(whole) if i else whole)[0], axis=2) for i in (0, 1))
    assert got.all_identical == int((a == b).all(axis=2)[:, [1, 4]].all(axis=1).sum())
    if layout != "table":
        assert read_layers and all(r == [1, 2, 4] for r in read_layers), read_layers
        per = stats.route_agreement_by_step(tmp_path, "train_routes", layers=[1, 4])
        assert per[0] + per[1] == got
    with pytest.raises(TypeError, match="layers"):
        stats.route_agreement(whole, whole, layers=[1])
    with pytest.raises(ValueError, match="executor=None only"):
        stats.route_agreement(tmp_path, "train_routes", executor=RayExecutor(), layers=[1])
