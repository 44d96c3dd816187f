"""R2 replay with real megatron-core routers (CPU, gloo): record, then replay that column.

The old-log-prob forward runs under `record_schedule`; its routes come back into the table as
``train_routes`` (`uncollate_routes`); ``MegatronCollator(..., column="train_routes")``
collates replay targets from that column, and the update's forward, after the router weights
moved (an optimizer step), routes every captured token exactly as the recording forward did,
in every layout (packed, unpacked, CP 2, SP over TP 2). Misuse of ``column`` raises naming it.
"""

from __future__ import annotations

from collections.abc import Iterator
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

from r3arrow import RouteSpec  # noqa: E402
from r3arrow._schema import MISSING_KEY, ROUTES_MISSING  # noqa: E402
from r3arrow.collate import MegatronCollator, Microbatch, Parallelism, uncollate_routes  # noqa: E402
from r3arrow.errors import SchemaError  # noqa: E402
from r3arrow.megatron import install_replay, record_schedule, replay_schedule  # noqa: E402
from r3arrow.microbatch import padding_table  # noqa: E402
from r3arrow.table import flat_routes, rollout_table, with_columns  # noqa: E402
from r3arrow.testing.megatron import CpuMegatron, build_routers, cpu_router_harness  # noqa: E402

HIDDEN, EXPERTS, TOPK = 16, 8, 2
SPEC = RouteSpec(num_layers=3, topk=TOPK, num_experts=EXPERTS, moe_layers=(0, 2))
MOE = [0, 2]
LENGTHS, CAPTURED = [9, 6, 7, 5], [8, 6, 4, 5]
WIDTH = 16  # positions per trajectory in the embedding: more than any padded layout


@pytest.fixture(scope="module")
def megatron() -> Iterator[CpuMegatron]:
    with cpu_router_harness() as meg:
        yield meg


@pytest.fixture
def routers(megatron: CpuMegatron) -> list[Any]:
    megatron.RouterReplay.clear_global_router_replay_instances()
    return build_routers(SPEC, MOE, hidden=HIDDEN, seed=7)


def _table(seed: int = 0) -> pa.Table:
    """Engine routes drawn at random (not what the trainer's routers would choose)."""
    rng = np.random.default_rng(seed)
    routes = []
    for c in CAPTURED:
        r = np.zeros((c, SPEC.num_layers, TOPK), dtype=np.uint8)
        for g in MOE:
            r[:, g] = np.stack([rng.choice(EXPERTS, TOPK, replace=False) for _ in range(c)])
        routes.append(r)
    return rollout_table(
        trajectory_id=[f"t{i}" for i in range(len(LENGTHS))],
        group_id=["g"] * len(LENGTHS),
        prompt_ids=[[1, 2] for _ in LENGTHS],
        response_ids=[rng.integers(3, 50, n - 2).tolist() for n in LENGTHS],
        loss_mask=[
            [int(2 + j <= c) for j in range(n - 2)] for n, c in zip(LENGTHS, CAPTURED, strict=True)
        ],
        reward=[0.0] * len(LENGTHS),
        routes=routes,
        spec=SPEC,
    )


def _embedding() -> torch.Tensor:
    """[B, WIDTH, H]: token t of trajectory i enters every router as ``emb[i, t]``."""
    return torch.randn(len(LENGTHS), WIDTH, HIDDEN, generator=torch.Generator().manual_seed(3))


def _hidden(mb: Microbatch, emb: torch.Tensor) -> torch.Tensor:
    """[s, b, H] hidden states of this CP rank's positions, before the SP split."""
    pos = mb.position_ids.to(torch.int64)
    if mb.packed:
        assert mb.cu_seqlens_padded is not None
        where = mb.token_index if mb.token_index is not None else torch.arange(pos.shape[1])
        seq = torch.searchsorted(mb.cu_seqlens_padded[1:].to(torch.int64), where, right=True)
        traj = seq.reshape(1, -1)
    else:
        traj = torch.arange(pos.shape[0])[:, None].expand_as(pos)
    return emb[traj, pos.clamp(max=WIDTH - 1)].transpose(0, 1)


def _forward(routers: list[Any], mb: Microbatch, emb: torch.Tensor) -> dict[int, Any]:
    """This rank's forward (its SP slice under sequence parallelism): ``{layer: [tokens, K]
    ids}``, read from the routing maps (ascending)."""
    hidden = _hidden(mb, emb)
    if mb.sequence_parallel:
        s = hidden.shape[0] // mb.tp_size
        hidden = hidden[mb.tp_rank * s : (mb.tp_rank + 1) * s]
    with torch.no_grad():
        maps = [r(hidden.contiguous())[1] for r in routers]
    return {g: m.nonzero()[:, 1].reshape(-1, TOPK) for g, m in zip(MOE, maps, strict=True)}


def _sorted_rows(col: pa.Array[Any] | pa.ChunkedArray[Any]) -> np.ndarray:
    """Route rows of a routes column on the router layers, ids ascending per row."""
    table = pa.table({"routes": col}).replace_schema_metadata(SPEC.to_metadata())
    rows, _ = flat_routes(table)
    return np.sort(rows[:, MOE, :], axis=-1)


LAYOUTS = [
    pytest.param({"packed": True}, id="packed"),
    pytest.param({"packed": False}, id="unpacked"),
    pytest.param({"packed": True, "cp_size": 2}, id="packed-cp2"),
    pytest.param({"packed": False, "cp_size": 2, "align": 3}, id="unpacked-cp2-align3"),
    pytest.param({"packed": True, "tp_size": 2, "sequence_parallel": True}, id="packed-sp2"),
]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_update_routes_as_the_recording_forward(routers: list[Any], layout: dict[str, Any]) -> None:
    table, emb = _table(), _embedding()
    # the old-log-prob forward: routers route natively and record
    rec_mb = MegatronCollator(SPEC, packed=True)(table)
    with record_schedule(routers) as rec:
        taken = _forward(routers, rec_mb, emb)
        recorded = rec.take()
    assert all(torch.equal(torch.sort(recorded[g], dim=1).values, taken[g]) for g in MOE)
    train = with_columns(table, {"train_routes": uncollate_routes(rec_mb, recorded)})
    want = _sorted_rows(train.column("train_routes"))
    assert (want != _sorted_rows(table.column("routes"))).any()  # the engine routed otherwise
    # an optimizer step moves the router weights: native routing changes
    with torch.no_grad():
        for r in routers:
            r.weight.add_(torch.randn(r.weight.shape, generator=torch.Generator().manual_seed(9)))
    rest = {k: v for k, v in layout.items() if k in ("packed", "align")}
    par = {k: v for k, v in layout.items() if k not in rest}
    cp = int(par.get("cp_size", 1))
    tp = int(par.get("tp_size", 1))
    mbs = [  # every rank's microbatch, CP-major then TP (uncollate_routes' order)
        MegatronCollator(
            SPEC, column="train_routes", parallel=Parallelism(cp_rank=c, tp_rank=t, **par), **rest
        )(train)
        for c in range(cp)
        for t in range(tp)
    ]
    native: list[dict[int, Any]] = []
    replayed: list[dict[int, Any]] = []
    for mb in mbs:
        native.append(_forward(routers, mb, emb))
        with replay_schedule():
            install_replay(mb, routers)
            replayed.append(_forward(routers, mb, emb))
    got = _sorted_rows(uncollate_routes(mbs[-1], replayed if len(replayed) > 1 else replayed[0]))
    drifted = _sorted_rows(uncollate_routes(mbs[-1], native if len(native) > 1 else native[0]))
    assert np.array_equal(got, want)  # exactly as recorded, every captured token
    assert (drifted != want).any()  # without replay the update would have routed otherwise


def test_probe_agrees_fully_on_the_recording_weights(routers: list[Any]) -> None:
    table, emb = _table(seed=1), _embedding()
    rec_mb = MegatronCollator(SPEC, packed=True)(table)
    with record_schedule(routers) as rec:
        _forward(routers, rec_mb, emb)
        train = with_columns(table, {"train_routes": uncollate_routes(rec_mb, rec.take())})
    for column, full in (("train_routes", True), ("routes", False)):
        mb = MegatronCollator(SPEC, packed=False, column=column)(train)
        with replay_schedule(measure_agreement=True) as probe:
            install_replay(mb, routers)
            with torch.no_grad():
                hidden = _hidden(mb, emb).contiguous()
                for r in routers:
                    r(hidden, padding_mask=mb.padding_mask.transpose(0, 1))
        assert probe is not None
        agreement = probe.agreement
        assert agreement.tokens == sum(CAPTURED)
        assert (agreement.all_identical == agreement.tokens) is full


def test_column_misuse(routers: list[Any]) -> None:
    table = _table()
    rec_mb = MegatronCollator(SPEC, packed=True)(table)
    with record_schedule(routers) as rec:
        _forward(routers, rec_mb, _embedding())
        train = with_columns(table, {"train_routes": uncollate_routes(rec_mb, rec.take())})
    with pytest.raises(SchemaError, match="'old_routes'"):
        MegatronCollator(SPEC, column="old_routes")(train)
    with pytest.raises(SchemaError, match=r"column 'loss_mask': expected a routes column"):
        MegatronCollator(SPEC, column="loss_mask")(train)
    with pytest.raises(TypeError, match="column"):
        MegatronCollator(SPEC, column=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="column: expected 'routes' with R3 off"):
        MegatronCollator(None, column="train_routes")
    # the engine's routes_missing marks belong to 'routes': a recorded column has none
    marks = pa.array([[0] * c for c in CAPTURED], type=pa.large_list(pa.uint8()))
    marked = train.append_column(pa.field(ROUTES_MISSING, marks.type), marks)
    marked = marked.replace_schema_metadata({**(marked.schema.metadata or {}), MISSING_KEY: b"1"})
    assert MegatronCollator(SPEC, column="train_routes")(marked).fallback_mask is None
    assert MegatronCollator(SPEC)(marked).fallback_mask is not None
    # a DP padding table keeps the column, with no rows
    pad = MegatronCollator(SPEC, column="train_routes")(padding_table(marked))
    assert pad.is_padding and pad.padding_mask.all()
