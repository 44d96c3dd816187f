"""Training-side routes with real megatron-core routers (0.16.1, CPU, gloo world of one).

`record_schedule` -> `uncollate_routes` -> ``with_columns(table, {"train_routes": col})`` ->
`route_agreement` gives exactly the counts computed here from the routers' own top-k, for
packed and unpacked layouts, CP 2 and SP over TP 2 (every rank's forward run in this one
process), several microbatches (a multi-chunk table) and a write/read round trip; the record
scope's state rules (cleared on exit and on errors, one take per forward, no nesting).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = [
    pytest.mark.megatron,
    pytest.mark.filterwarnings("ignore:full scope is deprecated:UserWarning"),
]

from r3arrow import RouteSpec, read_rollouts, write_rollouts  # noqa: E402
from r3arrow.collate import (  # noqa: E402
    MegatronCollator,
    Microbatch,
    Parallelism,
    uncollate_routes,
)
from r3arrow.errors import ReplayError, RouteShapeError  # noqa: E402
from r3arrow.megatron import (  # noqa: E402
    RouteRecorder,
    record_schedule,
    replay_schedule,
)
from r3arrow.stats import RouteAgreement, expert_load, load_drift, route_agreement  # noqa: E402
from r3arrow.table import rollout_table, route_layers, route_spec, with_columns  # noqa: E402
from r3arrow.testing import random_rollouts  # noqa: E402
from r3arrow.testing.megatron import CpuMegatron, build_routers, cpu_router_harness  # noqa: E402

HIDDEN, EXPERTS, TOPK = 16, 8, 2
SPEC = RouteSpec(num_layers=4, topk=TOPK, num_experts=EXPERTS, moe_layers=(0, 1, 3))
MOE = [0, 1, 3]
SHAPES = [(3, 4, 7), (2, 5, 5), (4, 1, 4), (1, 6, 2)]  # (prompt, response, captured)
WIDTH = 32  # positions per trajectory in the embedding: more than any padded layout


@pytest.fixture(scope="module")
def megatron() -> Iterator[CpuMegatron]:
    with cpu_router_harness() as meg:
        yield meg


@pytest.fixture
def routers(megatron: CpuMegatron) -> list[Any]:
    megatron.RouterReplay.clear_global_router_replay_instances()
    return build_routers(SPEC, MOE, hidden=HIDDEN, seed=3)


def _native(routers: list[Any], x: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each router's own choice, routing freely: bool [tokens, E] maps (no recorder involved)."""
    with torch.no_grad():
        return [r(h[:, None, :])[1] for r, h in zip(routers, x, strict=True)]


def _ids(maps: torch.Tensor) -> np.ndarray:
    """[tokens, E] bool with K set per row -> [tokens, K] ids (ascending)."""
    return np.asarray(maps.nonzero()[:, 1].reshape(-1, TOPK).numpy())


def _case(
    routers: list[Any], flips: set[tuple[int, int, int]]
) -> tuple[pa.Table, torch.Tensor, RouteAgreement]:
    """(table, embedding [L_router, B, WIDTH, H], expected agreement).

    Token t of trajectory i enters router l as ``emb[l, i, t]``. The table's routes are each
    router's own choice on those states, except at ``flips`` {(traj, token, router index)}:
    there the first id is replaced by the lowest expert the router did not choose (overlap
    K - 1, not identical).
    """
    gen = torch.Generator().manual_seed(11)
    emb = torch.randn(len(MOE), len(SHAPES), WIDTH, HIDDEN, generator=gen)
    caps = [c for _, _, c in SHAPES]
    flat = [torch.cat([emb[j, i, :c] for i, c in enumerate(caps)]) for j in range(len(MOE))]
    native = [_ids(m) for m in _native(routers, flat)]
    starts = np.cumsum([0, *caps])
    per_traj = []
    for i, c in enumerate(caps):
        r = np.zeros((c, SPEC.num_layers, TOPK), np.uint8)  # dense layer 2 stays 0
        for j, g in enumerate(MOE):
            r[:, g] = native[j][starts[i] : starts[i] + c]
        per_traj.append(r)
    tokens = int(starts[-1])
    identical = np.full(len(MOE), tokens, np.int64)
    overlap = np.full(len(MOE), tokens * TOPK, np.int64)
    for i, t, j in flips:
        row = per_traj[i][t, MOE[j]]
        row[0] = min(set(range(EXPERTS)) - set(row.tolist()))
        identical[j] -= 1
        overlap[j] -= 1
    differing = {(i, t) for i, t, _ in flips}
    want = RouteAgreement(tuple(MOE), TOPK, tokens, identical, overlap, tokens - len(differing))
    base = random_rollouts(np.random.default_rng(4), SPEC, SHAPES)
    table = rollout_table(
        trajectory_id=base.column("trajectory_id"),
        group_id=base.column("group_id"),
        prompt_ids=base.column("prompt_ids"),
        response_ids=base.column("response_ids"),
        loss_mask=base.column("loss_mask"),
        reward=base.column("reward"),
        routes=per_traj,
        spec=SPEC,
    )
    return table, emb, want


def _hidden(mb: Microbatch, emb: torch.Tensor, rows: np.ndarray) -> torch.Tensor:
    """[L_router, s, b, H] hidden states of this rank's positions (``rows``: table row of each
    microbatch sequence), in Megatron's [s, b] layout, before the SP split."""
    pos = mb.position_ids.to(torch.int64)  # [b, S] (packed [1, T]): position in its sequence
    if mb.packed:
        assert mb.cu_seqlens_padded is not None
        where = mb.token_index if mb.token_index is not None else torch.arange(pos.shape[1])
        seq = torch.searchsorted(mb.cu_seqlens_padded[1:].to(torch.int64), where, right=True)
        traj = seq.reshape(1, -1)
    else:
        traj = torch.arange(pos.shape[0])[:, None].expand_as(pos)
    table_row = torch.from_numpy(rows)[traj]
    return emb[:, table_row, pos.clamp(max=WIDTH - 1)].transpose(1, 2)  # [L, s, b, H]


def _record(
    routers: list[Any], rec: RouteRecorder, mb: Microbatch, hidden: torch.Tensor
) -> list[dict[int, torch.Tensor]]:
    """Every TP rank's forward on its SP slice (one piece without SP); one take per forward."""
    tp = mb.tp_size if mb.sequence_parallel else 1
    s = hidden.shape[1] // tp
    pieces = []
    for t in range(tp):
        with torch.no_grad():
            for j, r in enumerate(routers):
                r(hidden[j, t * s : (t + 1) * s].contiguous())
        pieces.append(rec.take())
    return pieces


LAYOUTS = [
    pytest.param({"packed": True}, id="packed"),
    pytest.param({"packed": False}, id="unpacked"),
    pytest.param({"packed": True, "cp_size": 2}, id="packed-cp2"),
    pytest.param({"packed": False, "cp_size": 2, "align": 3}, id="unpacked-cp2-align3"),
    pytest.param({"packed": True, "tp_size": 2, "sequence_parallel": True}, id="packed-sp2"),
    pytest.param(
        {"packed": False, "tp_size": 2, "sequence_parallel": True, "cp_size": 2},
        id="unpacked-cp2-sp2",
    ),
]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_record_uncollate_agreement(
    routers: list[Any], layout: dict[str, Any], tmp_path: Path
) -> None:
    flips = {(0, 2, 0), (0, 2, 2), (1, 0, 1), (3, 1, 2), (2, 3, 0), (0, 6, 1)}
    table, emb, want = _case(routers, flips)
    cp = int(layout.get("cp_size", 1))
    rest = {k: v for k, v in layout.items() if k in ("packed", "align")}
    par = {k: v for k, v in layout.items() if k not in rest}  # the collator's Parallelism
    parts = []
    # two microbatches of whole trajectories: the result is a multi-chunk table (chunked routes)
    for rows in (np.array([0, 1]), np.array([2, 3])):
        sub = table.take(pa.array(rows))
        mbs = [
            MegatronCollator(SPEC, parallel=Parallelism(cp_rank=c, **par), **rest)(sub)
            for c in range(cp)
        ]
        pieces = []
        with record_schedule(routers) as rec:
            assert rec.layers == tuple(MOE)
            for mb in mbs:  # each CP rank's forward, in turn
                pieces += _record(routers, rec, mb, _hidden(mb, emb, rows))
        col = uncollate_routes(mbs[-1], pieces if len(pieces) > 1 else pieces[0])
        parts.append(with_columns(sub, {"train_routes": col}))
    joined = pa.concat_tables(parts)
    assert joined.column("train_routes").num_chunks == 2
    assert route_agreement(joined, "train_routes") == want
    write_rollouts(joined, tmp_path, step=0)
    back = read_rollouts(tmp_path)
    assert back.column("train_routes").equals(joined.column("train_routes"))
    assert route_agreement(back, "train_routes") == want


def test_unflipped_table_agrees_fully(routers: list[Any]) -> None:
    table, emb, want = _case(routers, set())
    mb = MegatronCollator(SPEC, packed=True)(table)
    with record_schedule(routers) as rec:
        (piece,) = _record(routers, rec, mb, _hidden(mb, emb, np.arange(table.num_rows)))
    col = uncollate_routes(mb, piece)
    with_train = with_columns(table, {"train_routes": col})
    got = route_agreement(with_train, "train_routes")
    assert got == want and got.all_identical == got.tokens == sum(c for _, _, c in SHAPES)
    # load_drift reads `routes`: swap the column in (same type); identical routes, no drift
    trained = with_columns(table, {"routes": col})
    drift = load_drift(expert_load(table), expert_load(trained))
    assert drift["layer"].to_list() == MOE and drift["tv"].to_list() == [0.0] * 3


def test_load_drift_on_train_routes(routers: list[Any]) -> None:
    """One flipped id moves one assignment from one expert to another: on that layer the
    total variation distance is 1 / (tokens * K), elsewhere 0."""
    table, emb, _ = _case(routers, {(1, 3, 0)})
    mb = MegatronCollator(SPEC)(table)
    with record_schedule(routers) as rec:
        (piece,) = _record(routers, rec, mb, _hidden(mb, emb, np.arange(table.num_rows)))
    trained = with_columns(table, {"routes": uncollate_routes(mb, piece)})
    drift = load_drift(expert_load(table), expert_load(trained))
    tv = dict(zip(drift["layer"].to_list(), drift["tv"].to_list(), strict=True))
    tokens = sum(c for _, _, c in SHAPES)
    assert tv[1] == tv[3] == 0.0
    assert tv[0] == pytest.approx(1 / (tokens * TOPK))


def _state(meg: CpuMegatron) -> list[tuple[Any, Any]]:
    return [
        (i.router_replay_action, i.get_recorded_indices())
        for i in meg.RouterReplay.global_router_replay_instances
    ]


def test_state_cleared_on_exit_and_error(megatron: CpuMegatron, routers: list[Any]) -> None:
    x = torch.randn(5, 1, HIDDEN)
    with record_schedule(routers) as rec:
        assert all(a == megatron.RouterReplayAction.RECORD for a, _ in _state(megatron))
        with torch.no_grad():
            routers[0](x)
        with pytest.raises(ReplayError, match=r"layers \[1, 3\]"):
            rec.take()  # routers 1 and 3 did not run
    assert _state(megatron) == [(None, None)] * 3
    with pytest.raises(ReplayError, match="ended"):
        rec.take()
    with pytest.raises(RuntimeError, match="boom"), record_schedule(routers):
        with torch.no_grad():
            routers[0](x)
        raise RuntimeError("boom")
    assert _state(megatron) == [(None, None)] * 3


def test_take_once_per_forward(routers: list[Any]) -> None:
    x = torch.randn(6, 1, HIDDEN)
    with record_schedule(routers) as rec, torch.no_grad():
        for r in routers:
            r(x)
        got = rec.take()
        with pytest.raises(ReplayError, match="since the last take"):
            rec.take()
    assert sorted(got) == MOE
    assert all(t.shape == (6, TOPK) and t.dtype == torch.int64 for t in got.values())
    want = [_ids(m) for m in _native(routers, [x[:, 0]] * 3)]  # routing freely now
    for g, w in zip(MOE, want, strict=True):
        assert np.array_equal(np.sort(got[g].numpy(), axis=1), w)


def test_no_nesting(routers: list[Any]) -> None:
    with (
        record_schedule(routers),
        pytest.raises(ReplayError, match="found an open record_schedule"),
        record_schedule(routers),
    ):
        pass
    with (
        replay_schedule(),
        pytest.raises(ReplayError, match="found an open replay_schedule"),
        record_schedule(routers),
    ):
        pass


def test_layers_argument_and_selection(megatron: CpuMegatron, routers: list[Any]) -> None:
    """``layers=`` names routers' global ids; only the given routers record."""
    x = torch.randn(4, 1, HIDDEN)
    with record_schedule(routers[1:], layers=[10, 11]) as rec, torch.no_grad():
        assert megatron.RouterReplay.global_router_replay_instances[0].router_replay_action is None
        for r in routers:
            r(x)
        assert sorted(rec.take()) == [10, 11]
    with (
        pytest.raises(ValueError, match="one global layer id per recorded router"),
        record_schedule(routers, layers=[1]),
    ):
        pass
    with pytest.raises(TypeError, match="MoE routers"), record_schedule([3]):
        pass


def test_pipeline_stage_on_projected_table(routers: list[Any], tmp_path: Path) -> None:
    """A PP stage holding layers 0 and 1 reads a layer-projected table (layer projection), records
    its two routers and uncollates with the table's global ``route_layers``."""
    flips = {(0, 1, 0), (2, 0, 1), (3, 1, 2)}  # the last one is on layer 3: not on this stage
    table, emb, want = _case(routers, flips)
    write_rollouts(table, tmp_path, step=0)
    proj = read_rollouts(tmp_path, layers=[0, 1])
    assert route_layers(proj) == (0, 1)
    mb = MegatronCollator(route_spec(proj), packed=True)(proj)
    with record_schedule(routers[:2]) as rec:
        (piece,) = _record(routers[:2], rec, mb, _hidden(mb, emb, np.arange(table.num_rows))[:2])
    with pytest.raises(RouteShapeError, match="route_layers"):
        uncollate_routes(mb, {g + 5: t for g, t in piece.items()})
    col = uncollate_routes(mb, piece, layers=route_layers(proj))
    got = route_agreement(with_columns(proj, {"train_routes": col}), "train_routes")
    assert got.tokens == want.tokens
    assert got.identical.tolist() == want.identical[:2].tolist()
    assert got.overlap.tolist() == want.overlap[:2].tolist()
    assert got.all_identical == want.tokens - 2
