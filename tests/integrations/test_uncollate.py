"""uncollate_routes: collate -> uncollate is the identity on the captured routes (random tables,
packed/unpacked, alignment, CP 1/2, SP TP 1/2, multi-chunk columns, dense layers), small
hand-laid CP and SP layouts, layer projection, and the errors for bad input."""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from r3arrow import RouteSpec
from r3arrow.collate import MegatronCollator, Microbatch, Parallelism, uncollate_routes
from r3arrow.errors import (
    DuplicateExpertError,
    ExpertRangeError,
    RouteDTypeError,
    RouteShapeError,
)
from r3arrow.microbatch import padding_table
from r3arrow.table import rollout_table
from r3arrow.testing import random_rollouts
from r3arrow.testing.strategies import specs


def _py(col: Any) -> list[Any]:
    """Python lists of an Arrow column (typed Any: the stubs do not type nested lists)."""
    return list(col.to_pylist())


def _pieces(mb: Microbatch) -> dict[int, torch.Tensor]:
    """What this rank's routers see when they replay: one [tokens, K] target per layer."""
    return dict(zip(mb.layers, mb.replay_targets(), strict=True))


def _ranks(
    table: pa.Table, spec: RouteSpec, *, cp: int, tp: int, sp: bool, **kw: Any
) -> tuple[list[Microbatch], list[dict[int, torch.Tensor]]]:
    """Microbatches of every (CP, TP) rank and their pieces, CP-major (TP only under SP)."""
    mbs = [
        MegatronCollator(
            spec,
            parallel=Parallelism(
                cp_size=cp, cp_rank=c, tp_size=tp, tp_rank=t, sequence_parallel=sp
            ),
            **kw,
        )(table)
        for c in range(cp)
        for t in range(tp if sp else 1)
    ]
    return mbs, [_pieces(mb) for mb in mbs]


def _chunked(table: pa.Table, how: str) -> pa.Table:
    if how == "per_row":  # one chunk per trajectory (chunked routes)
        return pa.Table.from_batches(table.to_batches(max_chunksize=1), schema=table.schema)
    if how == "two" and table.num_rows > 1:
        k = table.num_rows // 2
        return pa.concat_tables([table.slice(0, k), table.slice(k)])
    return table


@st.composite
def _tables(draw: st.DrawFn) -> tuple[pa.Table, RouteSpec]:
    spec = draw(specs(max_layers=4, max_topk=3, widths=("uint8", "uint16")))
    shapes = []
    for _ in range(draw(st.integers(1, 4))):
        p = draw(st.integers(0, 7))
        r = draw(st.integers(0 if p else 1, 7))
        c = draw(st.integers(0, p + r))
        shapes.append((p, r, c))
    seed = draw(st.integers(0, 2**32 - 1))
    table = random_rollouts(np.random.default_rng(seed), spec, shapes)
    return _chunked(table, draw(st.sampled_from(["one", "two", "per_row"]))), spec


@given(
    data=_tables(),
    packed=st.booleans(),
    align=st.sampled_from([1, 3, 4]),
    cp=st.sampled_from([1, 2]),
    tp=st.sampled_from([1, 2]),
    sp=st.booleans(),
    which=st.integers(0, 3),
)
def test_round_trip(
    data: tuple[pa.Table, RouteSpec],
    packed: bool,
    align: int,
    cp: int,
    tp: int,
    sp: bool,
    which: int,
) -> None:
    table, spec = data
    mbs, pieces = _ranks(table, spec, cp=cp, tp=tp, sp=sp, packed=packed, align=align)
    mb = mbs[which % len(mbs)]  # any rank's microbatch describes the whole layout
    col = uncollate_routes(mb, pieces if len(pieces) > 1 else pieces[0], spec=spec)
    assert col.type == spec.routes_type == table.schema.field("routes").type
    assert col.equals(cast("pa.LargeListArray[Any]", table.column("routes").combine_chunks()))


def test_packed_cp2_literal() -> None:
    """Packed, CP 2: lengths 3 and 5 padded to 4 and 8 (multiple 4), chunks of 1 and 2."""
    spec = RouteSpec(num_layers=1, topk=1, num_experts=100)
    routes = [np.arange(3).reshape(3, 1, 1), (10 + np.arange(5)).reshape(5, 1, 1)]
    table = rollout_table(
        trajectory_id=["a", "b"],
        group_id=["g", "g"],
        prompt_ids=[[1, 2], [1, 2, 3]],
        response_ids=[[3], [4, 5]],
        loss_mask=[[1], [1, 1]],
        reward=[0.0, 1.0],
        routes=[r.astype(np.uint8) for r in routes],
        spec=spec,
    )
    mb = MegatronCollator(spec, packed=True, parallel=Parallelism(cp_size=2, cp_rank=1))(table)
    assert mb.num_router_tokens == 6
    # rank 0 holds chunks 0, 3: a[0], a[3]=pad | b[0:2], b[6:8]=pad; rank 1 chunks 1, 2.
    r0 = torch.tensor([0, 99, 10, 11, 99, 99]).reshape(6, 1)
    r1 = torch.tensor([1, 2, 12, 13, 14, 99]).reshape(6, 1)
    col = uncollate_routes(mb, [{0: r0}, {0: r1}], spec=spec)
    assert _py(col) == [[[[0]], [[1]], [[2]]], [[[10]], [[11]], [[12]], [[13]], [[14]]]]


def test_unpacked_sp_literal() -> None:
    """Unpacked, SP over TP 2: the flat [s, b] order s*b + b is split in two halves."""
    spec = RouteSpec(num_layers=2, topk=1, num_experts=100, moe_layers=(1,))
    table = rollout_table(
        trajectory_id=["a", "b"],
        group_id=["g", "g"],
        prompt_ids=[[1, 2], [1, 2]],
        response_ids=[[3], [4, 5]],
        loss_mask=[[1], [1, 1]],
        reward=[0.0, 1.0],
        routes=[np.zeros((2, 2, 1), np.uint8), np.zeros((3, 2, 1), np.uint8)],
        spec=spec,
    )
    mb = MegatronCollator(spec, parallel=Parallelism(tp_size=2, tp_rank=1, sequence_parallel=True))(
        table
    )
    assert tuple(mb.padding_mask.shape) == (2, 4)
    ids = np.array([[10 * b + s for b in range(2)] for s in range(4)]).reshape(8, 1)  # s-major
    pieces = [{1: torch.from_numpy(ids[:4])}, {1: torch.from_numpy(ids[4:])}]
    col = uncollate_routes(mb, pieces, spec=spec)
    assert _py(col) == [
        [[[0], [0]], [[0], [1]]],
        [[[0], [10]], [[0], [11]], [[0], [12]]],
    ]


def test_projected_layers_and_numpy_input() -> None:
    """A layer-projected spec (L' = 2 of 4) with global ``layers``; numpy arrays accepted."""
    full = RouteSpec(num_layers=4, topk=2, num_experts=8)
    table = random_rollouts(np.random.default_rng(0), full, [(3, 2, 4), (2, 2, 3)])
    mb = MegatronCollator(full, layers=[1, 3], packed=True)(table)
    pieces = {g: t.numpy() for g, t in _pieces(mb).items()}
    proj = RouteSpec(num_layers=2, topk=2, num_experts=8)
    col = uncollate_routes(mb, pieces, spec=proj, layers=[1, 3])
    want = [[row[1::2] for row in traj] for traj in _py(table.column("routes"))]
    assert col.type == proj.routes_type
    assert _py(col) == want


def test_padding_microbatch_gives_empty_row() -> None:
    spec = RouteSpec(num_layers=2, topk=2, num_experts=4)
    table = random_rollouts(np.random.default_rng(1), spec, [(2, 2, 3)])
    mb = MegatronCollator(spec)(padding_table(table))
    col = uncollate_routes(mb, _pieces(mb))
    assert _py(col) == [[]]


@pytest.fixture
def case() -> tuple[Microbatch, dict[int, torch.Tensor]]:
    spec = RouteSpec(num_layers=3, topk=2, num_experts=6, moe_layers=(0, 2))
    table = random_rollouts(np.random.default_rng(2), spec, [(3, 3, 5), (2, 1, 3)])
    mb = MegatronCollator(spec, packed=True)(table)
    return mb, _pieces(mb)


def test_misuse_raises_builtins(
    case: tuple[Microbatch, dict[int, torch.Tensor]],
) -> None:
    mb, pieces = case
    with pytest.raises(TypeError, match="Microbatch"):
        uncollate_routes("mb", pieces)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="mapping"):
        uncollate_routes(mb, 3)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="expected 1 rank piece"):
        uncollate_routes(mb, [pieces, pieces])
    with pytest.raises(ValueError, match="one global id per route row"):
        uncollate_routes(mb, pieces, layers=[0, 2])
    with pytest.raises(TypeError, match="RouteSpec"):
        uncollate_routes(mb, pieces, spec="spec")  # type: ignore[arg-type]


def test_bad_data_raises_r3arrow_errors(
    case: tuple[Microbatch, dict[int, torch.Tensor]],
) -> None:
    mb, pieces = case
    with pytest.raises(RouteShapeError, match=r"missing \[2\]") as exc:
        uncollate_routes(mb, {0: pieces[0]})
    assert exc.value.layer == 2
    with pytest.raises(RouteShapeError, match=r"unexpected \[1\]"):
        uncollate_routes(mb, {**pieces, 1: pieces[0]})
    with pytest.raises(RouteShapeError, match=r"expected \[\d+, 2\]"):
        uncollate_routes(mb, {0: pieces[0][:-1], 2: pieces[2]})
    with pytest.raises(RouteDTypeError, match="integer"):
        uncollate_routes(mb, {0: pieces[0].float(), 2: pieces[2]})
    bad = pieces[2].clone()
    # token 1 of trajectory 1 sits at packed position 6 (trajectory 0: 6 tokens, multiple 1)
    bad[7] = torch.tensor([6, 0])
    with pytest.raises(ExpertRangeError, match="num_experts") as rng_exc:
        uncollate_routes(mb, {0: pieces[0], 2: bad})
    assert (rng_exc.value.row, rng_exc.value.token, rng_exc.value.layer) == (1, 1, 2)
    dup = pieces[0].clone()
    dup[4] = torch.tensor([3, 3])
    with pytest.raises(DuplicateExpertError) as dup_exc:
        uncollate_routes(mb, {0: dup, 2: pieces[2]})
    assert (dup_exc.value.row, dup_exc.value.token, dup_exc.value.layer) == (0, 4, 0)


def test_uncaptured_positions_are_not_checked(
    case: tuple[Microbatch, dict[int, torch.Tensor]],
) -> None:
    """Ids at padding and past the captured rows never reach the column: not checked."""
    mb, pieces = case
    free = pieces[0].clone()
    free[5] = torch.tensor([9, 9])  # trajectory 0, token 5: past its 5 captured rows
    col = uncollate_routes(mb, {0: free, 2: pieces[2]})
    assert [len(r) for r in _py(col)] == [5, 3]


def test_spec_required_with_r3_off() -> None:
    spec = RouteSpec(num_layers=1, topk=1, num_experts=4)
    table = rollout_table(
        trajectory_id=["a"],
        group_id=["g"],
        prompt_ids=[[1, 2]],
        response_ids=[[3]],
        loss_mask=[[1]],
        reward=[0.0],
        routes=None,
        spec=None,
    )
    mb = MegatronCollator(None)(table)
    ids = torch.tensor([[1], [2], [3]])
    with pytest.raises(ValueError, match="R3 off"):
        uncollate_routes(mb, {0: ids})
    col = uncollate_routes(mb, {0: ids}, spec=spec)  # R3 off: every token is routed
    assert _py(col) == [[[[1]], [[2]], [[3]]]]
