"""Statistics grouped by ``policy_version`` (``docs/versions.md``): expert load, route
agreement and the log-prob mismatch per version, hand-computed, on tables and paths."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from r3arrow.errors import SchemaError
from r3arrow.io import write_rollouts
from r3arrow.spec import RouteSpec
from r3arrow.stats import expert_load, logprob_mismatch, route_agreement
from r3arrow.table import rollout_table

SPEC = RouteSpec(num_layers=2, topk=2, num_experts=4)
IDS = ["a", "b", "c"]
VERSIONS = [1, 2, 1]
# One route row per trajectory ([layer][k]); train routes differ from the rollout's on
# b's layer 1 ({1,3} vs {1,2}) and c's layer 0 ({0,1} vs {0,3}).
ROUTES = [[[0, 1], [2, 3]], [[0, 2], [1, 3]], [[0, 1], [3, 2]]]
TRAIN = [[[1, 0], [2, 3]], [[0, 2], [1, 2]], [[0, 3], [3, 2]]]
# Δ = train - rollout per response token: a 0, b -1, c +1 (exact float32 values).
ROLLOUT_LP = [[-1.0], [-1.0], [-2.0]]
TRAIN_LP = [[-1.0], [-2.0], [-1.0]]


def table(**extra: Any) -> pa.Table:
    n = len(IDS)
    base: dict[str, Any] = {
        "trajectory_id": IDS,
        "group_id": ["g"] * n,
        "prompt_ids": [[1]] * n,
        "response_ids": [[2]] * n,
        "loss_mask": [[1]] * n,
        "reward": [0.0] * n,
        "spec": SPEC,
    }
    train = rollout_table(**base, routes=[np.array([r], np.uint8) for r in TRAIN])
    return rollout_table(
        **base,
        routes=[np.array([r], np.uint8) for r in ROUTES],
        train_routes=train.column("routes"),
        rollout_logprobs=pa.array(ROLLOUT_LP, pa.large_list(pa.float32())),
        train_logprobs=pa.array(TRAIN_LP, pa.large_list(pa.float32())),
        **extra,
    )


VERSIONED = {"policy_version": VERSIONS, "attempt": [0, 0, 0]}


def load_rows(frame: Any) -> list[tuple[int, ...]]:
    return [tuple(r) for r in frame.rows()]


def test_expert_load_by_version_by_hand() -> None:
    got = expert_load(table(**VERSIONED), by_version=True)
    assert got.columns == ["policy_version", "layer", "expert", "tokens"]
    # v1: a and c. Layer 0: {0,1} twice; layer 1: {2,3} and {3,2}. v2: b alone.
    want_v1 = [
        (0, 0, 2),
        (0, 1, 2),
        (0, 2, 0),
        (0, 3, 0),
        (1, 0, 0),
        (1, 1, 0),
        (1, 2, 2),
        (1, 3, 2),
    ]
    want_v2 = [
        (0, 0, 1),
        (0, 1, 0),
        (0, 2, 1),
        (0, 3, 0),
        (1, 0, 0),
        (1, 1, 1),
        (1, 2, 0),
        (1, 3, 1),
    ]
    assert load_rows(got) == [(1, *r) for r in want_v1] + [(2, *r) for r in want_v2]


def test_route_agreement_by_version_by_hand() -> None:
    got = route_agreement(table(**VERSIONED), "train_routes", by_version=True)
    assert list(got) == [1, 2]
    v1, v2 = got[1], got[2]
    # v1: a identical on both layers; c differs on layer 0 (overlap 1 of 2).
    assert (v1.tokens, v1.identical.tolist(), v1.overlap.tolist(), v1.all_identical) == (
        2,
        [1, 2],
        [3, 4],
        1,
    )
    # v2: b differs on layer 1 ({1,3} vs {1,2}: overlap 1).
    assert (v2.tokens, v2.identical.tolist(), v2.overlap.tolist(), v2.all_identical) == (
        1,
        [1, 0],
        [2, 1],
        0,
    )
    assert v1 + v2 == route_agreement(table(**VERSIONED), "train_routes")


def test_logprob_mismatch_by_version_by_hand() -> None:
    got = logprob_mismatch(table(**VERSIONED), by_version=True)
    assert list(got) == [1, 2]
    # v1: Δ = [0, +1]; v2: Δ = [-1].
    assert got[1]["tokens"] == 2.0
    assert got[1]["k1"] == pytest.approx(-0.5)
    assert got[1]["abs_mean"] == pytest.approx(0.5)
    assert got[1]["abs_max"] == pytest.approx(1.0)
    assert got[2]["tokens"] == 1.0
    assert got[2]["k1"] == pytest.approx(1.0)
    assert got[2]["k2"] == pytest.approx(0.5)


def test_a_root_groups_by_version_across_steps(tmp_path: Path) -> None:
    t = table(**VERSIONED)
    write_rollouts(t.slice(0, 2), tmp_path, step=0)  # a (v1), b (v2)
    write_rollouts(t.slice(2, 1), tmp_path, step=1)  # c (v1)
    assert load_rows(expert_load(tmp_path, by_version=True)) == load_rows(
        expert_load(t, by_version=True)
    )
    by_version = route_agreement(tmp_path, "train_routes", by_version=True)
    assert by_version == route_agreement(t, "train_routes", by_version=True)
    assert logprob_mismatch(tmp_path, by_version=True)[1]["tokens"] == 2.0


def test_one_version_and_a_multi_version_batch_agree_with_the_totals() -> None:
    one = table(policy_version=[4, 4, 4])
    assert list(route_agreement(one, "train_routes", by_version=True)) == [4]
    assert route_agreement(one, "train_routes", by_version=True)[4] == route_agreement(
        one, "train_routes"
    )


class _NoExecutor:
    def map_reduce(self, *args: Any, **kwargs: Any) -> Any:
        raise AssertionError("not called")


def test_by_version_errors(tmp_path: Path) -> None:
    plain = table()
    with pytest.raises(SchemaError, match=r"by version: expected a 'policy_version' column"):
        expert_load(plain, by_version=True)
    with pytest.raises(SchemaError, match=r"by version: expected a 'policy_version' column"):
        logprob_mismatch(plain, by_version=True)
    path = write_rollouts(plain, tmp_path / "r.parquet")
    with pytest.raises(SchemaError, match=r"r.parquet: by version: expected") as info:
        route_agreement(path, "train_routes", by_version=True)
    assert info.value.path == str(path)
    with pytest.raises(ValueError, match=r"expected one grouping, found both True"):
        expert_load(table(**VERSIONED), by_step=True, by_version=True)
    with pytest.raises(ValueError, match=r"expected one grouping, found both True"):
        logprob_mismatch(table(**VERSIONED), by_step=True, by_version=True)  # type: ignore[call-overload]
    with pytest.raises(ValueError, match=r"by_version: groups local sources"):
        expert_load(path, by_version=True, executor=_NoExecutor())
    with pytest.raises(TypeError, match=r"by_version: expected a bool"):
        expert_load(plain, by_version=1)  # type: ignore[arg-type]
    arr = np.zeros((1, 2, 2), np.uint8)
    with pytest.raises(TypeError, match=r"by_version: expected a rollout table or path a"):
        route_agreement(arr, arr, by_version=True)


# ------------------------------------------------------------ the rollout loop stamps
@pytest.fixture(scope="module")
def engine() -> Any:
    from r3arrow.testing.engine import ReferenceEngine, TinyMoEConfig

    return ReferenceEngine(TinyMoEConfig(seed=3))


def test_run_rollouts_stamps_version_and_attempt_and_a_retry_appends(
    engine: Any, server: Any, tmp_path: Path
) -> None:
    import asyncio

    from r3arrow.client import EngineClient
    from r3arrow.io import read_rollouts
    from r3arrow.rollout import run_rollouts
    from r3arrow.table import drop_stale
    from r3arrow.testing.rollout import ArithmeticEnv

    env = ArithmeticEnv(vocab_size=512, turns=2)
    sp = {"max_tokens": 2, "temperature": 0.0}

    async def batch(**kw: Any) -> pa.Table:
        async with EngineClient(server.url, engine.spec) as client:
            return await run_rollouts(
                client, env, [[1, 2, 3], [4, 5]], max_turns=2, sampling_params=sp, **kw
            )

    first = asyncio.run(batch(policy_version=7))
    assert first.column("attempt").to_pylist() == [0, 0]
    assert first.column("policy_version").to_pylist() == [7, 7]
    assert "policy_version" not in asyncio.run(batch()).schema.names  # stamped only when given
    retry = asyncio.run(batch(policy_version=9, attempt=1))  # the framework's retry of the batch
    assert retry.column("attempt").to_pylist() == [1, 1]
    write_rollouts(first, tmp_path, step=0)
    write_rollouts(retry, tmp_path, step=0)
    with pytest.raises(SchemaError, match=r"\('g0-0', 1\) \(row 0\) already in this part"):
        write_rollouts(retry, tmp_path, step=0)
    both = read_rollouts(tmp_path)
    assert both.column("attempt").to_pylist() == [0, 0, 1, 1]
    fresh = drop_stale(both.drop_columns(["step"]), current_version=10, max_lag=1)
    assert fresh.column("policy_version").to_pylist() == [9, 9]
    with pytest.raises(ValueError, match=r"attempt: expected an int in \[0, inf\], found -1"):
        asyncio.run(batch(attempt=-1))
    assert server.log.count("/inference/v1/generate") == 3 * 2 * 2  # the bad call sent nothing
