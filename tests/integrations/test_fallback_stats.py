"""Route-local fallback, the statistics and the rollout loop (``docs/fallback.md``): missing
route rows left out of agreement and expert counts and counted, `route_fallback`, the stored
``fallback`` diagnostics and `r3_metrics`; ``on_short="mark"`` through `run_rollouts` against
the embedded engine over real HTTP with injected faults."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from r3arrow import RouteSpec, validate_rollouts
from r3arrow._schema import ROUTES_MISSING, placeholder_rows
from r3arrow.capture import TurnStore
from r3arrow.client import EngineClient, Protocol
from r3arrow.errors import EngineHTTPError, RouteShapeError
from r3arrow.io import read_diagnostics, write_diagnostics, write_rollouts
from r3arrow.rollout import run_rollouts, run_trajectory
from r3arrow.stats import (
    RouteAgreement,
    RouteFallback,
    expert_counts,
    r3_metrics,
    route_agreement,
    route_fallback,
)
from r3arrow.stats._metrics import FALLBACK_KEY
from r3arrow.table import flat_routes, input_ids, rollout_table
from r3arrow.testing.engine import EngineServer, Fault, FaultPlan, ReferenceEngine, TinyMoEConfig
from r3arrow.testing.engine.faults import MALFORMED_MODES
from r3arrow.testing.rollout import ArithmeticEnv

SPEC = RouteSpec(num_layers=2, topk=2, num_experts=4)
P = [[0, 1], [0, 1]]  # the placeholder row of SPEC

# Trajectory a: 3 prompt + 2 response tokens, 4 route rows, row 2 missing; b: 2 rows, none.
ROUTES_A = [[[0, 1], [2, 3]], [[1, 2], [0, 3]], P, [[2, 3], [1, 2]]]
TRAIN_A = [[[0, 1], [2, 3]], [[1, 3], [0, 3]], [[2, 3], [2, 3]], [[2, 3], [1, 2]]]
ROUTES_B = [[[0, 3], [1, 2]], [[0, 3], [1, 2]]]


MARKS = [[0, 0, 1, 0], [0, 0]]


def _table(marks: list[list[int]] | None = MARKS) -> pa.Table:
    def arr(rows: list[Any]) -> np.ndarray:
        return np.asarray(rows, dtype=np.uint8)

    train = pa.array([TRAIN_A, ROUTES_B], type=SPEC.routes_type)
    return rollout_table(
        trajectory_id=["a", "b"],
        group_id=["g", "g"],
        prompt_ids=[[5, 6, 7], [5, 6]],
        response_ids=[[1, 2], [1]],
        loss_mask=[[1, 1], [1]],
        reward=[1.0, 0.0],
        routes=[arr(ROUTES_A), arr(ROUTES_B)],
        spec=SPEC,
        routes_missing=marks,
        train_routes=train,
    )


# ------------------------------------------------------------------ statistics


def test_agreement_leaves_missing_rows_out_and_counts_them() -> None:
    table = _table()
    agree = route_agreement(table, "train_routes")
    # Delivered rows a0, a1, a3, b0, b1: a1 differs on layer 0 ({1,2} vs {1,3}).
    assert (agree.tokens, agree.missing, agree.all_identical) == (5, 1, 4)
    assert agree.identical.tolist() == [4, 5]
    assert agree.overlap.tolist() == [2 + 1 + 2 + 2 + 2, 10]
    # Without the marks the placeholder a2 is compared with the trainer's routing: 0 overlap.
    plain = route_agreement(_table(None), "train_routes")
    assert (plain.tokens, plain.missing, plain.all_identical) == (6, 0, 4)
    assert plain.identical.tolist() == [4, 5] and plain.overlap.tolist() == [9, 10]
    # tokens="loss": the rows predicting a loss token are a2, a3 and b1; a2 is missing.
    loss = route_agreement(table, "train_routes", tokens="loss")
    assert (loss.tokens, loss.missing) == (2, 1)


def test_expert_counts_leave_missing_rows_out() -> None:
    table = _table()
    counts = expert_counts(table)
    assert counts.tokens == 5
    # layer 0: a0 {0,1}, a1 {1,2}, a3 {2,3}, b0 b1 {0,3}; layer 1: {2,3} {0,3} {1,2} {1,2} {1,2}
    assert counts.counts.tolist() == [[3, 2, 2, 3], [1, 3, 4, 2]]
    # The trainer's own routes are real on every row: column="train_routes" counts them all.
    assert expert_counts(table, column="train_routes").tokens == 6


@pytest.mark.parametrize("layer_group", [None, 1])
def test_parquet_statistics_read_the_marks(tmp_path: Path, layer_group: int | None) -> None:
    table = _table()
    path = write_rollouts(table, tmp_path / "r.parquet", layer_group=layer_group)
    assert expert_counts(path) == expert_counts(table)
    assert expert_counts(path, layers=[1]).counts.tolist() == [[1, 3, 4, 2]]
    assert route_agreement(path, "train_routes") == route_agreement(table, "train_routes")


def test_agreement_vector_and_sum_carry_missing() -> None:
    a = RouteAgreement((0, 1), 2, 5, np.array([4, 5]), np.array([9, 10]), 4, missing=1)
    assert RouteAgreement.from_vector(a.to_vector()) == a
    assert (a + a).missing == 2 and (a + a).tokens == 10
    assert a != RouteAgreement((0, 1), 2, 5, np.array([4, 5]), np.array([9, 10]), 4)


def test_route_fallback_counts_literal() -> None:
    fb = route_fallback(_table())
    assert fb == RouteFallback(
        trajectories=2, fallback_trajectories=1, route_rows=6, missing_rows=1
    )
    assert fb.fraction == pytest.approx(1 / 6)
    assert route_fallback(_table(None)) == RouteFallback(2, 0, 6, 0)
    assert route_fallback(_table(None)).fraction == 0.0
    every = route_fallback(_table([[1, 1, 1, 1], [0, 1]]))
    assert every == RouteFallback(2, 2, 6, 5) and every.fraction == pytest.approx(5 / 6)
    assert (fb + every) == RouteFallback(4, 3, 12, 6)
    assert RouteFallback(0, 0, 0, 0).fraction == 0.0


def test_fallback_diagnostics_round_trip_into_r3_metrics(tmp_path: Path) -> None:
    for step, marks in ((1, [[0, 0, 1, 0], [0, 0]]), (2, [[0, 0, 0, 0], [1, 1]])):
        write_diagnostics(tmp_path, step, route_fallback(_table(marks)))
    rows = read_diagnostics(tmp_path, kind="fallback").to_pylist()
    assert [(r["step"], r["missing_rows"], r["route_rows"], r["source"]) for r in rows] == [
        (1, 1, 6, "rollout_routes"),
        (2, 2, 6, "rollout_routes"),
    ]
    assert [r["fallback_trajectories"] for r in rows] == [1, 1]
    assert [r["fraction"] for r in rows] == pytest.approx([1 / 6, 2 / 6])
    metrics = r3_metrics(fallback_token_route_fraction=rows[1]["fraction"])
    assert metrics[FALLBACK_KEY] == pytest.approx(1 / 3)
    assert read_diagnostics(tmp_path).num_rows == 0  # no agreement file among them
    with pytest.raises(ValueError, match="missing_rows"):
        write_diagnostics(tmp_path, 3, RouteFallback(1, 1, 2, 3))
    with pytest.raises(ValueError, match="fallback_trajectories"):
        write_diagnostics(tmp_path, 3, RouteFallback(1, 0, 2, 1))


# ------------------------------------------------------------------ the rollout loop

SP: dict[str, dict[str, Any]] = {
    "vllm": {"max_tokens": 3, "temperature": 0.0, "ignore_eos": True},
    "sglang": {"max_new_tokens": 3, "temperature": 0.0, "ignore_eos": True},
}


@pytest.fixture(scope="module")
def engine() -> ReferenceEngine:
    return ReferenceEngine(TinyMoEConfig(seed=5))


def _one(
    server: EngineServer,
    engine: ReferenceEngine,
    protocol: Protocol = "vllm",
    on_short: Any = "mark",
) -> pa.Table:
    env = ArithmeticEnv(vocab_size=512, turns=3, observation_len=2)

    async def main() -> pa.Table:
        async with EngineClient(server.url, engine.spec, protocol=protocol) as client:
            return await run_rollouts(
                client,
                env,
                [[3, 4, 5, 6]],
                max_turns=3,
                sampling_params=SP[protocol],
                on_short=on_short,
            )

    table: pa.Table = asyncio.run(main())
    return table


def _check_rows(table: pa.Table, engine: ReferenceEngine, want_marks: list[int]) -> None:
    """Delivered rows are the engine's own routing; marked rows hold placeholders."""
    validate_rollouts(table)
    ids: Any = input_ids(table)
    tokens: list[int] = ids.to_pylist()[0]
    rows, _ = flat_routes(table)
    assert table.column(ROUTES_MISSING).to_pylist() == [want_marks]
    marked = np.asarray(want_marks, bool)
    np.testing.assert_array_equal(rows[~marked], engine.routes_for(tokens)[:-1][~marked])
    np.testing.assert_array_equal(rows[marked], placeholder_rows(engine.spec, int(marked.sum())))


# 4 prompt tokens, 3 generated + 2 observed per turn: turn rows 6, 5, 5 (16 rows, 17 tokens).
TURN_ROWS = (6, 5, 5)


def _marks(turn2: list[int]) -> list[int]:
    return [0] * TURN_ROWS[0] + turn2 + [0] * TURN_ROWS[2]


@pytest.mark.parametrize("protocol", ["vllm", "sglang"])
@pytest.mark.parametrize("n", [1, 3])
def test_short_delivery_marks_the_tail_and_the_trajectory_goes_on(
    engine: ReferenceEngine,
    plan: FaultPlan,
    server: EngineServer,
    protocol: Protocol,
    n: int,
    caplog: pytest.LogCaptureFixture,
) -> None:
    plan.then(Fault.delay(0)).then(Fault.short_routes(n))  # turn 2 comes n rows short
    with caplog.at_level(logging.WARNING, logger="r3arrow.rollout"):
        table = _one(server, engine, protocol)
    assert table.column("num_turns").to_pylist() == [3]
    _check_rows(table, engine, _marks([0] * (5 - n) + [1] * n))
    fb = route_fallback(table)
    assert fb == RouteFallback(1, 1, 16, n) and fb.fraction == pytest.approx(n / 16)
    (record,) = [r for r in caplog.records if "route fallback" in r.getMessage()]
    assert f"'g0-0' turn 1: {n} of 5 route rows missing" in record.getMessage()


@pytest.mark.parametrize(
    "fault",
    [
        *[Fault.malformed_routes(m) for m in MALFORMED_MODES],
        Fault.no_routes(),
        Fault.duplicate_experts(),
        Fault.zero_router_layer(),
    ],
    ids=lambda f: f.kind if f.kind != "malformed_routes" else f"malformed-{f.mode}",
)
def test_refused_payload_marks_the_whole_turn(
    engine: ReferenceEngine, plan: FaultPlan, server: EngineServer, fault: Fault
) -> None:
    plan.then(Fault.delay(0)).then(fault)
    table = _one(server, engine)
    _check_rows(table, engine, _marks([1] * 5))
    assert route_fallback(table) == RouteFallback(1, 1, 16, 5)


def test_without_marks_the_table_has_no_column(
    engine: ReferenceEngine, server: EngineServer
) -> None:
    table = _one(server, engine)
    assert ROUTES_MISSING not in table.schema.names
    assert route_fallback(table) == RouteFallback(1, 0, 16, 0)


@pytest.mark.parametrize(
    ("fault", "error"),
    [(Fault.extra_routes(1), RouteShapeError), (Fault.status(400), EngineHTTPError)],
)
def test_extra_rows_and_lost_tokens_still_fail(
    engine: ReferenceEngine,
    plan: FaultPlan,
    server: EngineServer,
    fault: Fault,
    error: type[Exception],
) -> None:
    plan.then(fault)
    with pytest.raises(error):
        _one(server, engine)


def test_error_policy_still_raises_on_a_short_delivery(
    engine: ReferenceEngine, plan: FaultPlan, server: EngineServer
) -> None:
    plan.then(Fault.short_routes(1))
    with pytest.raises(RouteShapeError, match="rows"):
        _one(server, engine, on_short="error")


def test_client_marks_need_a_trace(engine: ReferenceEngine, server: EngineServer) -> None:
    async def main() -> None:
        async with EngineClient(server.url, engine.spec) as client:
            await client.generate([1, 2], on_short="mark")

    with pytest.raises(ValueError, match="expected a trace"):
        asyncio.run(main())

    store = TurnStore(engine.spec)

    async def one() -> None:
        async with EngineClient(server.url, engine.spec) as client:
            await run_trajectory(
                client,
                ArithmeticEnv(vocab_size=512, turns=1),
                [1, 2],
                trajectory_id="t",
                store=store,
                on_short="pad",  # type: ignore[arg-type]
            )

    with pytest.raises(ValueError, match="on_short"):
        asyncio.run(one())


@pytest.mark.parametrize(
    ("fault", "missing", "why"),
    [
        (Fault.short_routes(2), 2, "short route payload (3 of 5 rows)"),
        (Fault.zero_router_layer(), 5, "route payload refused"),
        (Fault.malformed_routes("base64"), 5, "route payload refused (PayloadError"),
        (Fault.no_routes(), 5, "no routed_experts"),
    ],
)
def test_generate_reports_what_it_marked(
    engine: ReferenceEngine,
    plan: FaultPlan,
    server: EngineServer,
    fault: Fault,
    missing: int,
    why: str,
) -> None:
    store = TurnStore(engine.spec)
    trace = store.trace("t")
    plan.then(fault)

    async def main() -> Any:
        async with EngineClient(server.url, engine.spec) as client:
            # P=4, G=2: 4 + 2 - 1 = 5 rows.
            sp = {"max_tokens": 2, "ignore_eos": True}
            out = await client.generate(
                [3, 4, 5, 6], sampling_params=sp, trace=trace, on_short="mark"
            )
            return out, dict(client.stats)

    out, stats = asyncio.run(main())
    assert out.missing_rows == missing == stats["missing_rows"] and why in (out.fallback or "")
    assert out.token_start == 0 and trace.captured == 5 and len(out.token_ids) == 2
    assert out.num_route_rows == 5 - missing
    assert (out.routed_experts is None) == (missing == 5)
    marks = trace.missing
    assert marks is not None and marks.tolist() == [0] * (5 - missing) + [1] * missing
