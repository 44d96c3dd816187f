"""Multi-turn rollouts through the client against the embedded engine over real HTTP."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

import r3arrow
from r3arrow.capture import TurnStore
from r3arrow.client import EngineClient
from r3arrow.rollout import (
    Conversation,
    Step,
    Trajectory,
    run_rollouts,
    run_trajectory,
    trajectories_table,
)
from r3arrow.spec import routes_to_numpy
from r3arrow.table import flat_routes, input_ids, sequence_loss_mask
from r3arrow.testing.engine import EngineServer, Fault, FaultPlan, ReferenceEngine, TinyMoEConfig
from r3arrow.testing.rollout import ArithmeticEnv

GEN = "/inference/v1/generate"
SP = {"max_tokens": 4, "temperature": 0.0}


def pylist(arr: Any) -> list[Any]:
    """``arr.to_pylist()``, loosely typed (pyarrow-stubs refuse it on list arrays)."""
    out: list[Any] = arr.to_pylist()
    return out


@pytest.fixture(scope="module")
def engine() -> ReferenceEngine:
    return ReferenceEngine(TinyMoEConfig(seed=3))


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def one_trajectory(
    url: str, spec: r3arrow.RouteSpec, env: Any, prompt: list[int], **kw: Any
) -> tuple[Trajectory, TurnStore]:
    store = TurnStore(spec)

    async def main() -> Trajectory:
        async with EngineClient(url, spec) as client:
            return await run_trajectory(
                client, env, prompt, trajectory_id="t", group_id="g", store=store, **kw
            )

    return run(main()), store


def test_trajectory_grows_conversation_masks_observations_and_captures_routes(
    engine: ReferenceEngine, server: EngineServer
) -> None:
    env = ArithmeticEnv(vocab_size=512, turns=3, observation_len=3)
    prompt = list(range(100, 110))
    traj, store = one_trajectory(
        server.url, engine.spec, env, prompt, max_turns=10, sampling_params=SP
    )
    g = [o.token_ids for o in traj.outputs]
    assert traj.num_turns == 3 and traj.stop == "done" and [len(x) for x in g] == [4, 4, 4]
    # response = gen1 + obs(gen1) + gen2 + obs(gen2) + gen3; observations are loss-masked
    assert traj.response_ids == g[0] + env.observation(g[0]) + g[1] + env.observation(g[1]) + g[2]
    assert traj.loss_mask == [1] * 4 + [0] * 3 + [1] * 4 + [0] * 3 + [1] * 4
    assert traj.reward == sum(1.0 if sum(x) % 2 == 0 else 0.0 for x in g)
    # each turn sent the whole conversation and prompt start = rows captured so far
    bodies = server.log.bodies(GEN)
    conv = prompt + traj.response_ids
    assert [b["token_ids"] for b in bodies] == [conv[:10], conv[:17], conv[:24]]
    assert [b["sampling_params"]["routed_experts_prompt_start"] for b in bodies] == [0, 13, 20]
    # the store holds one batch per turn at token_start = captured before the turn
    turns = store.to_table()
    assert turns.column("token_start").to_pylist() == [0, 13, 20]
    routes = routes_to_numpy(store.routes(["t"]).flatten(), store.spec)
    assert traj.num_routes == routes.shape[0] == len(conv) - 1
    np.testing.assert_array_equal(routes, engine.routes_for(conv)[:-1])


def test_environment_sees_each_turn_and_may_be_async(
    engine: ReferenceEngine, server: EngineServer
) -> None:
    seen: list[tuple[int, list[int], int]] = []

    class Echo:
        """Async env: echoes the last generated token twice, stops at a budget in state."""

        async def step(self, conversation: Conversation) -> Step:
            await asyncio.sleep(0)
            seen.append(
                (conversation.num_turns, conversation.last_generated, conversation.num_tokens)
            )
            conversation.state["n"] = conversation.state.get("n", 0) + 1
            last = conversation.last_generated[-1]
            return Step(
                observation_tokens=[last, last], reward=0.5, done=conversation.state["n"] == 2
            )

    traj, _ = one_trajectory(
        server.url, engine.spec, Echo(), [1, 2, 3], max_turns=5, sampling_params=SP
    )
    g = [o.token_ids for o in traj.outputs]
    assert seen == [(1, g[0], 3 + 4), (2, g[1], 3 + 4 + 2 + 4)]
    assert traj.response_ids == g[0] + [g[0][-1]] * 2 + g[1] and traj.reward == 1.0


def test_max_turns_max_total_tokens_and_reward_hook(
    engine: ReferenceEngine, server: EngineServer
) -> None:
    env = ArithmeticEnv(vocab_size=512, turns=100, observation_len=2)
    traj, _ = one_trajectory(server.url, engine.spec, env, [5] * 6, max_turns=2, sampling_params=SP)
    assert (traj.num_turns, traj.stop, len(traj.response_ids)) == (2, "max_turns", 4 + 2 + 4)
    # 6 prompt + 4 gen = 10; the next turn would start at 10 + 2 = 12 >= 12: stop, no observation
    traj, _ = one_trajectory(
        server.url,
        engine.spec,
        env,
        [5] * 6,
        max_turns=5,
        sampling_params=SP,
        max_total_tokens=12,
        reward_fn=lambda conv, r: float(len(conv.response_ids)) + r,
    )
    assert (traj.num_turns, traj.stop, traj.response_ids == traj.outputs[0].token_ids) == (
        1,
        "max_total_tokens",
        True,
    )
    assert traj.reward == 4.0 + (1.0 if sum(traj.response_ids) % 2 == 0 else 0.0)


def test_bad_environment_answers_are_clear_errors(
    engine: ReferenceEngine, server: EngineServer
) -> None:
    class Wrong:
        def step(self, conversation: Conversation) -> Any:
            return {"observation_tokens": [1]}

    class Negative:
        def step(self, conversation: Conversation) -> Step:
            return Step(observation_tokens=[3, -4])

    with pytest.raises(TypeError, match="expected a Step, found dict"):
        one_trajectory(server.url, engine.spec, Wrong(), [1, 2], sampling_params=SP)
    with pytest.raises(ValueError, match="observation_tokens: expected non-negative int token ids"):
        one_trajectory(server.url, engine.spec, Negative(), [1, 2], sampling_params=SP)


def test_rollouts_64_concurrent_trajectories_build_a_valid_table(
    engine: ReferenceEngine, server: EngineServer
) -> None:
    env = ArithmeticEnv(vocab_size=512, turns=3, observation_len=2)
    prompts = [[(7 * i + k) % 512 for k in range(4 + i % 5)] for i in range(16)]

    async def main() -> pa.Table:
        async with EngineClient(server.url, engine.spec, max_concurrency=64) as client:
            return await run_rollouts(
                client,
                env,
                prompts,
                group_size=4,
                max_turns=3,
                sampling_params={"max_tokens": 3, "temperature": 1.0},
                seed=11,
            )

    table = run(main())
    assert table.num_rows == 64 and server.log.count(GEN) == 64 * 3
    r3arrow.validate_rollouts(table)
    assert table.column("group_id").to_pylist() == [f"g{i}" for i in range(16) for _ in range(4)]
    assert table.column("trajectory_id").to_pylist() == [
        f"g{i}-{j}" for i in range(16) for j in range(4)
    ]
    assert table.column("num_turns").to_pylist() == [3] * 64
    ids = pylist(input_ids(table))
    values, offsets = flat_routes(table)
    mask = pylist(sequence_loss_mask(table))
    for row, tokens in enumerate(ids):
        assert tokens[: len(prompts[row // 4])] == prompts[row // 4]
        # no mixing: each row's routes are the engine's routing of that row's own tokens
        np.testing.assert_array_equal(
            values[offsets[row] : offsets[row + 1]], engine.routes_for(tokens)[:-1]
        )
        assert sum(mask[row]) == 9  # 3 turns x 3 generated tokens; observations and prompt masked
    # sampled members of a group differ, so dynamic sampling keeps some groups and drops others
    kept = r3arrow.table.filter_groups(table)
    assert 0 < kept.num_rows < 64 and kept.num_rows % 4 == 0
    assert (
        pylist(r3arrow.table.router_padding_mask(table))[0][-1] is True
    )  # last sampled token: no row


def test_failed_turn_propagates_and_completed_turns_stay_in_the_store(
    engine: ReferenceEngine, plan: FaultPlan, server: EngineServer
) -> None:
    env = ArithmeticEnv(vocab_size=512, turns=3, observation_len=2)
    store = TurnStore(engine.spec)

    async def main() -> None:
        async with EngineClient(server.url, engine.spec) as client:
            plan.then(Fault.delay(0)).then(
                Fault.short_routes(1)
            )  # turn 1 fine, turn 2 one row short
            await run_trajectory(
                client, env, [1, 2, 3], trajectory_id="t", store=store, sampling_params=SP
            )

    with pytest.raises(r3arrow.errors.RouteShapeError, match="rows"):
        run(main())
    assert store.num_turns == 1 and store.to_table().column("token_start").to_pylist() == [0]


def test_trajectories_table_checks_store_against_traces(
    engine: ReferenceEngine, server: EngineServer
) -> None:
    env = ArithmeticEnv(vocab_size=512, turns=2)
    traj, store = one_trajectory(server.url, engine.spec, env, [4, 5, 6], sampling_params=SP)
    table = trajectories_table([traj], store)
    assert table.column("stop").to_pylist() == ["done"]
    other = TurnStore(engine.spec)
    with pytest.raises(
        r3arrow.errors.RouteShapeError, match=r"expected \d+ route rows in the store, found 0"
    ):
        trajectories_table([traj], other)


def test_rollouts_reject_a_spec_that_contradicts_the_store(
    engine: ReferenceEngine, server: EngineServer
) -> None:
    other = r3arrow.RouteSpec(
        num_layers=engine.spec.num_layers, topk=engine.spec.topk + 1, num_experts=8
    )

    async def main() -> None:
        async with EngineClient(server.url) as client:
            await run_rollouts(
                client,
                ArithmeticEnv(vocab_size=512),
                [[1, 2]],
                spec=other,
                store=TurnStore(engine.spec),
            )

    before = server.log.count(GEN)
    with pytest.raises(r3arrow.errors.RouteShapeError, match="expected the store's"):
        run(main())
    assert server.log.count(GEN) == before  # rejected before any request


def test_one_failed_trajectory_fails_the_batch_and_stops_the_rest(
    engine: ReferenceEngine, plan: FaultPlan, server: EngineServer
) -> None:
    env = ArithmeticEnv(vocab_size=512, turns=3)
    plan.then(Fault.status(400))

    async def main() -> None:
        async with EngineClient(server.url, engine.spec, max_concurrency=2) as client:
            await run_rollouts(client, env, [[1, 2, 3]] * 8, max_turns=3, sampling_params=SP)

    with pytest.raises(r3arrow.errors.EngineError, match="HTTP 400"):
        run(main())
    assert server.log.count(GEN) < 8 * 3  # the other trajectories did not run to the end


def test_groups_stick_to_one_server_and_prefixes_share_a_store(engine: ReferenceEngine) -> None:
    env = ArithmeticEnv(vocab_size=512, turns=2)
    prompts = [[(i * 37 + k) % 512 for k in range(6)] for i in range(6)]
    store = TurnStore(engine.spec)
    with EngineServer(engine) as a, EngineServer(engine) as b:

        async def main() -> list[pa.Table]:
            async with EngineClient([a.url, b.url], engine.spec) as client:
                kw: dict[str, Any] = {
                    "group_size": 3,
                    "max_turns": 2,
                    "sampling_params": SP,
                    "store": store,
                }
                out = [await run_rollouts(client, env, prompts, id_prefix="s1/", **kw)]
                marks.extend([a.log.count(GEN), b.log.count(GEN)])
                out.append(await run_rollouts(client, env, prompts, id_prefix="s2/", **kw))
                return out

        marks: list[int] = []
        first, second = run(main())
        for batch in (0, 1):
            for i, prompt in enumerate(prompts):
                hits = []
                for s, mark in zip((a, b), marks, strict=True):
                    bodies = s.log.bodies(GEN)
                    bodies = bodies[:mark] if batch == 0 else bodies[mark:]
                    hits.append(sum(body["token_ids"][:6] == prompt for body in bodies))
                assert sorted(hits) == [0, 3 * 2], (
                    batch,
                    i,
                    hits,
                )  # 3 members x 2 turns on one server
        assert a.log.count(GEN) > 0 and b.log.count(GEN) > 0
    assert (
        first.column("trajectory_id")[0].as_py() == "s1/g0-0"
        and second.column("group_id")[-1].as_py() == "s2/g5"
    )
    # greedy: both batches are the same conversations, with the same routes, from one shared store
    assert first.column("routes").equals(second.column("routes"))
    assert store.num_turns == 2 * 18 * 2


def test_rollout_table_carries_the_engines_logprobs_when_asked(
    engine: ReferenceEngine, server: EngineServer
) -> None:
    env = ArithmeticEnv(vocab_size=512, turns=2, observation_len=3)
    prompts = [list(range(100, 108)), list(range(200, 206))]

    async def main(sp: dict[str, Any]) -> pa.Table:
        async with EngineClient(server.url, engine.spec) as client:
            return await run_rollouts(client, env, prompts, max_turns=4, sampling_params=sp)

    table = run(main({**SP, "logprobs": 0}))
    assert table.schema.field("rollout_logprobs").type == pa.large_list(pa.float32())
    lps, masks = pylist(table.column("rollout_logprobs")), pylist(table.column("loss_mask"))
    for lp, mask in zip(lps, masks, strict=True):
        assert len(lp) == len(mask)  # one per response token
        assert all(v == 0.0 for v, m in zip(lp, mask, strict=True) if m == 0)
        assert all(v <= 0.0 for v in lp) and any(v < 0.0 for v in lp)
    # the engine's own log-prob of each sampled token, turn by turn
    out = engine.generate(prompts[0], max_tokens=4, temperature=0.0, logprobs=True)
    first = [v for v, m in zip(lps[0], masks[0], strict=True) if m][:4]
    assert first == pytest.approx(out.logprobs, abs=1e-6)
    # without logprobs asked the column is absent
    assert "rollout_logprobs" not in run(main(SP)).schema.names
