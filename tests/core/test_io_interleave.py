"""The interleave copy of layer-group restores (r3arrow.io._interleave, docs/storage.md).

Both backends (the numba kernel, threads and passes of 8 groups included; the numpy
blocks) must give the bytes of an independent numpy fancy-index projection, for every
word size (ids of 1, 2 and 4 bytes, odd ``K``) and any selection of layers.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from r3arrow.io import _interleave, read_rollouts, write_rollouts
from r3arrow.io._interleave import word_size
from r3arrow.spec import RouteSpec, routes_to_numpy
from r3arrow.table import route_spec
from r3arrow.testing import random_rollouts, use_backend

_HAS_NUMBA = importlib.util.find_spec("numba") is not None


@pytest.fixture(params=["numba", "numpy"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """Force the numba kernel on every size (2 threads on tiny slices), or numpy."""
    if request.param == "numba":
        if not _HAS_NUMBA:
            pytest.skip("numba is not installed")
        monkeypatch.setattr(_interleave, "NUMBA_MIN_BYTES", 0)
        monkeypatch.setattr(_interleave, "_MIN_SLICE", 64)
        monkeypatch.setattr(_interleave, "THREADS", 2)
    with use_backend(request.param):
        yield str(request.param)


def _rows(table: pa.Table, spec: RouteSpec) -> np.ndarray:
    lists = cast("pa.LargeListArray[Any]", table.column("routes").combine_chunks())
    return routes_to_numpy(lists.flatten(), spec)


# The fixture only sets the backend (environment, module constants): the same for every input.
@settings(
    max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    dtype=st.sampled_from(["uint8", "uint16", "int32"]),
    topk=st.sampled_from([1, 2, 3, 8]),
    group=st.sampled_from([None, 1, 2, 5, [3, 1, 6, 2, 1, 1, 1, 1, 1, 1, 1, 1]]),
    data=st.data(),
)
def test_both_backends_restore_the_exact_bytes(
    backend: str,
    tmp_path_factory: pytest.TempPathFactory,
    dtype: str,
    topk: int,
    group: int | list[int] | None,
    data: st.DataObject,
) -> None:
    # 20 layers: layer_group=1 gives 20 groups, so the kernel runs in passes of 8 sources.
    spec = RouteSpec(num_layers=20, topk=topk, num_experts=200, id_dtype=dtype)
    shapes = [(5, 4, 9), (3, 2, 0), (4, 6, 10), (2, 2, 3)]
    table = random_rollouts(np.random.default_rng(topk), spec, shapes)
    layers = data.draw(st.lists(st.integers(0, 19), min_size=1, max_size=20))
    path = write_rollouts(table, tmp_path_factory.mktemp("i") / "r.parquet", layer_group=group)
    full = read_rollouts(path, validate=False)
    np.testing.assert_array_equal(_rows(full, spec), _rows(table, spec))
    got = read_rollouts(path, layers=layers)
    want = _rows(table, spec)[:, sorted(set(layers))]
    np.testing.assert_array_equal(_rows(got, route_spec(got)), want)


def test_interleave_runs_direct(backend: str) -> None:
    """Runs of one part in two pieces, a part used twice, three word sizes."""
    rng = np.random.default_rng(0)
    a = rng.integers(0, 255, (7, 16), dtype=np.uint8)
    b = rng.integers(0, 255, (7, 8), dtype=np.uint8)
    runs = [(0, 8, 0, 8), (1, 0, 8, 8), (0, 0, 16, 4)]
    out = np.frombuffer(cast("Any", _interleave.interleave([a, b], runs, 7, 20)), dtype=np.uint8)
    want = np.concatenate([a[:, 8:16], b, a[:, 0:4]], axis=1)
    np.testing.assert_array_equal(out.reshape(7, 20), want)
    assert word_size([16, 8], runs, 20) == 4
    assert word_size([16, 8], runs[:2], 16) == 8
    assert word_size([3], [(0, 0, 0, 3)], 3) == 1
    assert len(_interleave.interleave([a], [], 0, 20)) == 0


def test_warm_up_compiles_without_error() -> None:
    _interleave.warm_up()  # a no-op without numba


def test_a_large_read_takes_the_numba_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Above NUMBA_MIN_BYTES the kernel runs (when numba imports), and gives the same rows."""
    if not _HAS_NUMBA:
        pytest.skip("numba is not installed")
    monkeypatch.setattr(_interleave, "NUMBA_MIN_BYTES", 1 << 16)
    calls: list[int] = []
    real = _interleave._numba_copy

    def spy(*args: Any) -> None:
        calls.append(1)
        real(*args)

    monkeypatch.setattr(_interleave, "_numba_copy", spy)
    spec = RouteSpec(num_layers=16, topk=8, num_experts=64)
    table = random_rollouts(np.random.default_rng(1), spec, [(100, 500, 600)] * 2)
    path = write_rollouts(table, tmp_path / "r.parquet")
    with use_backend("numba"):
        got = read_rollouts(path, validate=False)
    assert calls
    np.testing.assert_array_equal(_rows(got, spec), _rows(table, spec))
