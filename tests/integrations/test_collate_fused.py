"""The fused collation pass: gather + id check + widening, both backends, chunks, projection.

`r3arrow.ids.gather_router_ids` against a numpy reference (property-based, numba and numpy
backends); the collator on multi-chunk routes columns (chunked routes) and layer-projected
tables (layer projection); `install_replay` skipping the id scan the fused pass already ran.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import r3arrow
import r3arrow.ids
from r3arrow import RouteSpec
from r3arrow.collate import MegatronCollator, Microbatch, Parallelism
from r3arrow.errors import DuplicateExpertError, ExpertRangeError, RouteShapeError
from r3arrow.ids import gather_router_ids
from r3arrow.testing import random_rollouts, use_backend
from r3arrow.testing.strategies import specs

try:  # megatron-core (extra "megatron"): the install test needs real RouterReplay instances
    with warnings.catch_warnings():  # its import warns (no TE/Apex), as importorskip hides
        warnings.simplefilter("ignore")
        import megatron.core  # noqa: F401

    from r3arrow.megatron import _schedule, install_replay, replay_schedule
    from r3arrow.testing.megatron import build_routers, cpu_router_harness
except ImportError:  # pragma: no cover - the CI image has it
    _schedule = None  # type: ignore[assignment]

BACKENDS = ["numba", "numpy"]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run the test on the numba kernel and on the numpy fallback (`use_backend`)."""
    if request.param == "numba":
        pytest.importorskip("numba")
    with use_backend(request.param):
        yield str(request.param)


def _reference(src: np.ndarray, layer_index: np.ndarray, pos_row: np.ndarray) -> np.ndarray:
    """[n_local, P, C, K] int32: row pos_row[p, c] of src at each local layer, dummy at -1."""
    k = src.shape[2]
    rows = (
        src[np.where(pos_row < 0, 0, pos_row)]
        if src.shape[0]
        else np.zeros((*pos_row.shape, src.shape[1], k), src.dtype)
    )
    g = rows[:, :, layer_index].astype(np.int32)
    g[pos_row < 0] = np.arange(k, dtype=np.int32)
    return np.ascontiguousarray(g.transpose(2, 0, 1, 3))


def _distinct(rng: np.random.Generator, rows: int, layers: int, k: int, e: int, dt: Any) -> Any:
    starts = rng.integers(0, e, (rows, layers, 1))
    offs = rng.permutation(e)[:k]
    return ((starts + offs) % e).astype(dt)


@settings(max_examples=40, deadline=None)
@given(
    spec=specs(max_layers=5, max_topk=8, dense_layers=False),
    seed=st.integers(0, 2**32 - 1),
    columns=st.integers(1, 3),
    positions=st.integers(1, 40),
    numba_backend=st.booleans(),
)
def test_gather_matches_reference(
    spec: RouteSpec, seed: int, columns: int, positions: int, numba_backend: bool
) -> None:
    rng = np.random.default_rng(seed)
    assert spec.num_experts is not None
    src = r3arrow.testing.random_routes(rng, int(rng.integers(0, 30)), spec)
    n_local = int(rng.integers(1, spec.num_layers + 1))
    layer_index = np.sort(rng.permutation(spec.num_layers)[:n_local]).astype(np.int64)
    hi = max(1, src.shape[0])
    pos_row = rng.integers(-1, hi, (positions, columns)).astype(np.int64)
    if src.shape[0] == 0:
        pos_row[:] = -1
    out = np.zeros((n_local, positions, columns, spec.topk), dtype=np.int32)
    with use_backend("numba" if numba_backend else "numpy"):
        gather_router_ids(src, layer_index, pos_row, out, spec.num_experts, list(layer_index))
    np.testing.assert_array_equal(out, _reference(src, layer_index, pos_row))


_GATHER_SHAPES = [
    (np.uint8, 8, 128),  # the rows: 8 lanes of 8 bits, bound <= half the range
    (np.uint8, 8, 200),  # bound above half
    (np.uint8, 8, 256),  # no bound needed
    (np.uint16, 4, 1000),
    (np.int32, 2, 50),  # signed
    (np.uint8, 2, 8),  # rows of 16 bits
    (np.uint8, 4, 60),  # rows of 32 bits
    (np.uint16, 2, 512),
    (np.int8, 4, 100),  # signed, 32-bit rows
    (np.int16, 2, 300),
    (np.uint8, 6, 64),  # 6 lanes: not a power of two
    (np.uint16, 8, 512),  # 128-bit rows
    (np.uint16, 3, 3),
]


@pytest.mark.parametrize(
    ("dtype", "k", "experts", "kind"),
    [(*shape, "duplicate") for shape in _GATHER_SHAPES]
    # a range error needs a value of the dtype at or above num_experts
    + [(*s, "range") for s in _GATHER_SHAPES if s[2] < 1 << (8 * np.dtype(s[0]).itemsize)],
)
def test_gather_errors_name_the_first_bad_row(
    backend: str, dtype: Any, k: int, experts: int, kind: str
) -> None:
    rng = np.random.default_rng(1)
    src = _distinct(rng, 60, 6, k, experts, dtype)
    layer_index = np.array([1, 2, 4], dtype=np.int64)
    pos_row = np.arange(50, dtype=np.int64).reshape(25, 2)
    pos_row[3, 1] = -1
    out = np.zeros((3, 25, 2, k), dtype=np.int32)
    gather_router_ids(src, layer_index, pos_row, out, experts, [10, 20, 40])
    np.testing.assert_array_equal(out, _reference(src, layer_index, pos_row))
    bad = src.copy()
    if kind == "duplicate":
        bad[37, 2, k - 1] = bad[37, 2, 0]
        bad[44, 4, 1] = bad[44, 4, 0]  # a later one: not reported
        err: type[Exception] = DuplicateExpertError
    else:
        bad[37, 2, k - 1] = experts
        err = ExpertRangeError
    bad[5, 0, 0] = bad[5, 0, 1]  # layer 0 is not gathered: never checked
    with pytest.raises(err) as info:
        gather_router_ids(bad, layer_index, pos_row, out, experts, [10, 20, 40])
    assert (info.value.token, info.value.layer) == (37, 20)  # type: ignore[attr-defined]
    # Without the check the same rows are gathered as they are.
    gather_router_ids(bad, layer_index, pos_row, out, experts, [10, 20, 40], check=False)
    np.testing.assert_array_equal(out, _reference(bad, layer_index, pos_row))


def test_gather_span_signed_and_compact_out(backend: str) -> None:
    rng = np.random.default_rng(2)
    src = _distinct(rng, 20, 3, 4, 30, np.int32)
    layer_index = np.array([0, 2], dtype=np.int64)
    pos_row = rng.integers(-1, 20, (10, 3)).astype(np.int64)
    out = np.zeros((2, 10, 3, 4), dtype=np.int32)
    gather_router_ids(src, layer_index, pos_row, out, 30, [0, 2], span=(2, 7, 1, 3))
    ref = _reference(src, layer_index, pos_row)
    np.testing.assert_array_equal(out[:, 2:7, 1:3], ref[:, 2:7, 1:3])
    assert not out[:, :2].any() and not out[:, 7:].any() and not out[:, :, 0].any()
    neg = src.copy()
    neg[int(pos_row[4, 2]) if pos_row[4, 2] >= 0 else 0, 2, 1] = -3
    pos_row[4, 2] = max(0, int(pos_row[4, 2]))
    with pytest.raises(ExpertRangeError, match="found -3"):
        gather_router_ids(neg, layer_index, pos_row, out, None, [0, 2])
    compact = np.zeros((2, 10, 3, 4), dtype=np.int32)  # src's own dtype: no widening
    gather_router_ids(src, layer_index, pos_row, compact, 30, [0, 2])
    np.testing.assert_array_equal(compact, _reference(src, layer_index, pos_row))
    small = _distinct(rng, 20, 3, 4, 30, np.uint8)
    compact8 = np.zeros((2, 10, 3, 4), dtype=np.uint8)
    gather_router_ids(small, layer_index, pos_row, compact8, 30, [0, 2])
    np.testing.assert_array_equal(compact8, _reference(small, layer_index, pos_row))
    with pytest.raises(ValueError, match="C-contiguous out"):
        gather_router_ids(src, layer_index, pos_row, out[:, :, :2], 30, [0, 2])
    with pytest.raises(ValueError, match="span"):
        gather_router_ids(src, layer_index, pos_row, out, 30, [0, 2], span=(0, 11, 0, 3))
    with pytest.raises(ExpertRangeError, match="dummy row"):
        gather_router_ids(src, layer_index, np.full((1, 1), -1), out[:, :1, :1].copy(), 3, [0, 2])


# ------------------------------------------------------------- the collator
SPEC = RouteSpec(num_layers=6, topk=4, num_experts=40, moe_layers=(1, 2, 3, 5))


def _rollouts(seed: int, spec: RouteSpec = SPEC, rows: int = 6) -> pa.Table:
    rng = np.random.default_rng(seed)
    shapes = []
    for _ in range(rows):
        p, r = int(rng.integers(1, 9)), int(rng.integers(1, 12))
        shapes.append((p, r, p + r - int(rng.integers(0, 2))))
    return random_rollouts(rng, spec, shapes)


def _chunked(table: pa.Table) -> pa.Table:
    """One chunk per trajectory (as a zero-copy capture builds it: chunked routes)."""
    out = pa.concat_tables([table.slice(i, 1) for i in range(table.num_rows)])
    assert out.column("routes").num_chunks == table.num_rows
    return out


def _same(a: Microbatch, b: Microbatch) -> None:
    assert a.layer_major is not None and b.layer_major is not None
    assert torch.equal(a.layer_major, b.layer_major)
    for name in ("input_ids", "position_ids", "labels", "loss_mask", "padding_mask"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


@pytest.mark.parametrize(
    "kw",
    [
        {"packed": True, "align": 4},
        {"packed": False, "align": 2},
        {"packed": True, "parallel": Parallelism(cp_size=2, cp_rank=1)},
        {"packed": False, "parallel": Parallelism(cp_size=2, cp_rank=0)},
    ],
)
def test_multi_chunk_routes_equal_one_chunk(backend: str, kw: dict[str, Any]) -> None:
    table = _rollouts(3)
    layers = [2, 3, 5]
    one = MegatronCollator(SPEC, layers=layers, **kw)(table)
    many = MegatronCollator(SPEC, layers=layers, **kw)(_chunked(table))
    _same(one, many)
    assert one.ids_validated and many.ids_validated


def test_threaded_chunks_equal_single(monkeypatch: pytest.MonkeyPatch, backend: str) -> None:
    table = _chunked(_rollouts(4, rows=7))
    single = MegatronCollator(SPEC, packed=True, num_threads=1)(table)
    monkeypatch.setattr(r3arrow.collate._collator, "_PARALLEL_BYTES", 0)
    for packed in (True, False):
        ref = MegatronCollator(SPEC, packed=packed, num_threads=1)(table)
        _same(ref, MegatronCollator(SPEC, packed=packed, num_threads=3)(table))
    _same(single, MegatronCollator(SPEC, packed=True, num_threads=2)(table))


def _project(table: pa.Table, spec: RouteSpec, layers: list[int]) -> pa.Table:
    """A layer-projected table (what read_rollouts(layers=) returns):
    routes of ``layers`` only, their spec, the global ids under ``r3arrow.route_layers``."""
    routes, offsets = r3arrow.table.flat_routes(table)
    moe = tuple(i for i, g in enumerate(layers) if g in spec.router_layers)
    pspec = RouteSpec(
        num_layers=len(layers), topk=spec.topk, num_experts=spec.num_experts, moe_layers=moe
    )
    sub = routes[:, layers]
    out = r3arrow.rollout_table(
        trajectory_id=table.column("trajectory_id"),
        group_id=table.column("group_id"),
        prompt_ids=table.column("prompt_ids"),
        response_ids=table.column("response_ids"),
        loss_mask=table.column("loss_mask"),
        reward=table.column("reward"),
        routes=[sub[offsets[i] : offsets[i + 1]] for i in range(table.num_rows)],
        spec=pspec,
    )
    meta = {
        **(out.schema.metadata or {}),
        b"r3arrow.route_layers": json.dumps(layers).encode(),
    }
    return out.replace_schema_metadata(meta)


@pytest.mark.parametrize("packed", [True, False])
def test_projected_table_equals_full(backend: str, packed: bool) -> None:
    table = _rollouts(5)
    layers = [2, 3, 5]
    full = MegatronCollator(SPEC, layers=layers, packed=packed)(table)
    projected = _project(table, SPEC, [1, 2, 3, 5])
    assert r3arrow.table.route_spec(projected).num_layers == 4
    mb = MegatronCollator(SPEC, layers=layers, packed=packed)(projected)
    _same(full, mb)
    assert mb.spec is not None and mb.spec.num_layers == SPEC.num_layers
    with pytest.raises(RouteShapeError, match=r"missing \[5\]"):
        MegatronCollator(SPEC, layers=layers, packed=packed)(_project(table, SPEC, [2, 3]))


def test_fused_check_names_trajectory_row_and_token(backend: str) -> None:
    # The table's spec has no expert count (checked only >= 0 at build); the collator's has 30.
    loose = RouteSpec(num_layers=3, topk=2, num_experts=None)
    rng = np.random.default_rng(7)
    rows = [_distinct(rng, n, 3, 2, 30, np.uint8) for n in (5, 6, 4)]
    rows[1][4, 1, 1] = 31 if rows[1][4, 1, 0] != 31 else 32
    table = r3arrow.rollout_table(
        trajectory_id=["a", "b", "c"],
        group_id=["g"] * 3,
        prompt_ids=[[1, 2]] * 3,
        response_ids=[list(range(3, 3 + n)) for n in (4, 5, 3)],
        loss_mask=[[1] * n for n in (4, 5, 3)],
        reward=[0.0] * 3,
        routes=rows,
        spec=loose,
    )
    strict = RouteSpec(num_layers=3, topk=2, num_experts=30)
    for chunks in (table, _chunked(table)):
        with pytest.raises(ExpertRangeError, match="routes of row 1") as info:
            MegatronCollator(strict, packed=True)(chunks)
        err = info.value
        assert (err.row, err.token, err.layer, err.trajectory_id) == (1, 4, 1, "b")
    # validate=False: no fused check, and the microbatch is not marked
    mb = MegatronCollator(strict, packed=True, validate=False)(table)
    assert not mb.ids_validated


@pytest.mark.filterwarnings("ignore:full scope is deprecated:UserWarning")
@pytest.mark.filterwarnings("ignore:Using a large number of experts:UserWarning")
def test_install_skips_what_collation_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    if _schedule is None:  # pragma: no cover
        pytest.skip("megatron-core is not installed")
    table = _rollouts(9)
    layers = [1, 2, 3]
    calls: list[int] = []
    real = _schedule._check_target_ids

    def counting(arr: torch.Tensor, experts: int | None, ids: Any) -> None:
        calls.append(int(arr.shape[0]))
        real(arr, experts, ids)

    monkeypatch.setattr(_schedule, "_check_target_ids", counting)
    with cpu_router_harness():
        routers = build_routers(SPEC, layers)
        mb = MegatronCollator(SPEC, layers=layers, packed=True)(table)
        assert mb.ids_validated
        with replay_schedule():
            install_replay(mb, routers)
        assert calls == []  # validated by the fused pass: no second scan
        moved = mb.to("cpu")
        assert moved.ids_validated
        assert mb.layer_major is not None
        mb.layer_major[0, 0, 0, 1] = mb.layer_major[0, 0, 0, 0]  # a torch write voids the mark
        assert not mb.ids_validated
        with replay_schedule(), pytest.raises(DuplicateExpertError):
            install_replay(mb, routers)
        assert calls == [len(layers)]
        unchecked = MegatronCollator(SPEC, layers=layers, packed=True, validate=False)(table)
        with replay_schedule():
            install_replay(unchecked, routers)
        assert calls == [len(layers), len(layers)]
