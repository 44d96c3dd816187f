"""Multi-turn rollouts: an agent loop that grows a conversation and captures its routes, each
turn sending the whole conversation with the trajectory's `TurnStore` trace (``docs/design.md``,
"Rows and incremental capture"; ``docs/capture.md``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np
import pyarrow as pa

from r3arrow._checks import check_int, check_positive_int
from r3arrow._schema import ATTEMPT, POLICY_VERSION, ROLLOUT_LOGPROBS, list_lengths
from r3arrow.capture import OnShort, TurnStore
from r3arrow.client import EngineClient, GenerateOutput
from r3arrow.errors import RouteShapeError, SchemaError
from r3arrow.spec import RouteSpec
from r3arrow.table import rollout_table

_log = logging.getLogger(__name__)


@dataclasses.dataclass
class Conversation:
    """A trajectory in progress: ``response_ids``/``loss_mask`` follow the prompt (1 = generated,
    0 = observation); ``state`` is free per-trajectory storage for the environment.
    """

    trajectory_id: str
    group_id: str
    prompt_ids: list[int]
    response_ids: list[int] = dataclasses.field(default_factory=list)
    loss_mask: list[int] = dataclasses.field(default_factory=list)
    generated: list[list[int]] = dataclasses.field(default_factory=list)
    outputs: list[GenerateOutput] = dataclasses.field(default_factory=list)
    state: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def token_ids(self) -> list[int]:
        """The whole conversation: prompt + response."""
        return self.prompt_ids + self.response_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def num_turns(self) -> int:
        """Engine turns taken so far."""
        return len(self.generated)

    @property
    def last_generated(self) -> list[int]:
        """Tokens generated in the latest turn ([] before the first)."""
        return self.generated[-1] if self.generated else []

    def add_generated(self, tokens: Sequence[int]) -> None:
        self.generated.append(list(tokens))
        self.response_ids.extend(tokens)
        self.loss_mask.extend([1] * len(tokens))

    def add_observation(self, tokens: Sequence[int]) -> None:
        self.response_ids.extend(tokens)
        self.loss_mask.extend([0] * len(tokens))


@dataclasses.dataclass(frozen=True)
class Step:
    """An environment's answer to a turn: tokens to append (loss mask 0), a reward, done."""

    observation_tokens: Sequence[int] = ()
    reward: float = 0.0
    done: bool = False


class Environment(Protocol):
    """What a user plugs in: ``step(conversation) -> Step`` (plain or ``async``), after every
    engine turn; unless ``done`` the observation is appended and the next turn runs. One
    environment serves many trajectories at once: keep state in ``conversation.state``.
    """

    def step(self, conversation: Conversation) -> Step | Awaitable[Step]: ...


@dataclasses.dataclass(frozen=True)
class Trajectory:
    """A finished trajectory (routes in the store under ``trajectory_id``); ``reward`` sums the
    step rewards; ``stop`` is "done", "max_turns" or "max_total_tokens".
    """

    trajectory_id: str
    group_id: str
    prompt_ids: list[int]
    response_ids: list[int]
    loss_mask: list[int]
    reward: float
    num_turns: int
    num_routes: int
    finish_reasons: list[str | None]
    route_payload_bytes: int
    stop: str
    outputs: list[GenerateOutput] = dataclasses.field(default_factory=list, repr=False)


async def _call_step(env: Environment, conversation: Conversation) -> Step:
    result = env.step(conversation)
    if inspect.isawaitable(result):
        result = await result
    if not isinstance(result, Step):
        raise TypeError(f"Environment.step: expected a Step, found {type(result).__name__}")
    return result


def _check_tokens(tokens: Sequence[int], what: str) -> list[int]:
    out = tokens.tolist() if isinstance(tokens, np.ndarray) else list(tokens)
    if not all(isinstance(t, int | np.integer) and not isinstance(t, bool) and t >= 0 for t in out):
        raise ValueError(f"{what}: expected non-negative int token ids, found {out!r:.200}")
    return [int(t) for t in out]


async def run_trajectory(
    client: EngineClient,
    env: Environment,
    prompt_ids: Sequence[int],
    *,
    trajectory_id: str,
    store: TurnStore,
    group_id: str = "",
    max_turns: int = 8,
    sampling_params: Mapping[str, Any] | None = None,
    max_total_tokens: int | None = None,
    seed: int | None = None,
    reward_fn: Callable[[Conversation, float], float] | None = None,
    on_short: OnShort = "error",
) -> Trajectory:
    """Run one multi-turn trajectory; its routes go to ``store`` one record batch per turn.

    Stops when the environment is done, after ``max_turns``, or before a turn that would start
    at ``max_total_tokens`` (that observation is dropped). Turn ``t`` samples with seed ``seed +
    t``; ``reward_fn(conversation, summed rewards)`` overrides the reward; a ``group_id`` (else
    the trajectory) is pinned to one server. On the client's errors the store keeps the turns
    completed so far. ``on_short="mark"`` (``docs/fallback.md``): a turn whose route payload
    is short, undecodable, refused by the quality guard or null keeps its tokens, its missing
    route rows are marked in the store (a `logging` warning names the trajectory and the
    counts) and the trajectory goes on; lost tokens and HTTP failures still raise.
    """
    check_positive_int(max_turns, "max_turns")
    spec = store.spec
    if client.spec is not None and not client.spec.same_shape(spec):
        raise RouteShapeError(
            f"store: expected routes shaped like the client's {client.spec}, found {spec}"
        )
    conv = Conversation(
        trajectory_id=trajectory_id,
        group_id=group_id,
        prompt_ids=_check_tokens(prompt_ids, "prompt_ids"),
    )
    if not conv.prompt_ids:
        raise ValueError("prompt_ids: expected at least one token, found none")
    trace = store.trace(trajectory_id)  # each recorded turn lands in the store, checked once
    # a group shares its prompt: pin the whole group to one server so the prefix cache serves it
    session = group_id or trajectory_id
    reward = 0.0
    stop = "max_turns"
    sp = dict(sampling_params or {})
    for turn in range(max_turns):
        if seed is not None:
            sp["seed"] = seed + turn
        out = await client.generate(
            conv.token_ids, sampling_params=sp, trace=trace, session_id=session, on_short=on_short
        )
        if out.missing_rows:
            _log.warning(
                "R3 route fallback: trajectory %r turn %d: %d of %d route rows missing (%s); "
                "the trainer's router computes those tokens' experts",
                trajectory_id,
                turn,
                out.missing_rows,
                trace.captured - (out.token_start or 0),
                out.fallback,
            )
        conv.outputs.append(out)
        conv.add_generated(out.token_ids)
        step = await _call_step(env, conv)
        reward += float(step.reward)
        if step.done:
            stop = "done"
            break
        if turn + 1 == max_turns:
            break
        obs = _check_tokens(step.observation_tokens, "Step.observation_tokens")
        if max_total_tokens is not None and conv.num_tokens + len(obs) >= max_total_tokens:
            stop = "max_total_tokens"
            break
        conv.add_observation(obs)
    if reward_fn is not None:
        reward = float(reward_fn(conv, reward))
    full_mask = np.concatenate(
        [np.zeros(len(conv.prompt_ids), np.uint8), np.asarray(conv.loss_mask, np.uint8)]
    )
    trace.finalize(num_tokens=conv.num_tokens, loss_mask=full_mask)
    return Trajectory(
        trajectory_id=trajectory_id,
        group_id=group_id,
        prompt_ids=conv.prompt_ids,
        response_ids=conv.response_ids,
        loss_mask=conv.loss_mask,
        reward=reward,
        num_turns=conv.num_turns,
        num_routes=trace.captured,
        finish_reasons=[o.finish_reason for o in conv.outputs],
        route_payload_bytes=sum(o.payload_bytes for o in conv.outputs),
        stop=stop,
        outputs=conv.outputs,
    )


def _rollout_logprobs(trajectories: Sequence[Trajectory]) -> dict[str, pa.Array[Any]]:
    """``{"rollout_logprobs": list<float32>}`` when every turn of every trajectory carried the
    engine's log-probs (0.0 on observation tokens, loss mask 0), ``{}`` when none did;
    `SchemaError` (``trajectory_id``, ``row``) for a mix."""
    has = [[o.logprobs is not None for o in t.outputs] for t in trajectories]
    flat = [h for row in has for h in row]
    if not flat or not any(flat):
        return {}
    if not all(flat):
        row = next(i for i, h in enumerate(has) if not all(h))
        raise SchemaError(
            f"trajectory {trajectories[row].trajectory_id!r}: expected log-probs on every "
            f"engine turn or on none (column {ROLLOUT_LOGPROBS!r}), found turns without",
            trajectory_id=trajectories[row].trajectory_id,
            row=row,
        )
    values: list[np.ndarray] = []
    lengths: list[int] = []
    for t in trajectories:
        mask = np.asarray(t.loss_mask, np.uint8).astype(bool)
        lps = [np.asarray(o.logprobs, np.float32) for o in t.outputs]
        sampled = np.concatenate(lps) if lps else np.zeros(0, np.float32)
        row_values = np.zeros(mask.size, np.float32)
        if sampled.size != int(mask.sum()):
            raise SchemaError(
                f"trajectory {t.trajectory_id!r}: expected one log-prob per generated token "
                f"({int(mask.sum())}), found {sampled.size}",
                trajectory_id=t.trajectory_id,
            )
        row_values[mask] = sampled
        values.append(row_values)
        lengths.append(mask.size)
    offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    flat_values = np.concatenate(values) if values else np.zeros(0, np.float32)
    arr = pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(flat_values, pa.float32()))
    return {ROLLOUT_LOGPROBS: arr}


def trajectories_table(
    trajectories: Sequence[Trajectory],
    store: TurnStore,
    *,
    policy_version: int | None = None,
    attempt: int = 0,
) -> pa.Table:
    """The rollout table of ``trajectories`` in order, routes from ``store``, plus ``num_turns``,
    ``stop`` and, when every engine turn returned log-probs (``sampling_params`` asking for
    them), ``rollout_logprobs`` (``docs/mismatch.md``); `RouteShapeError` (``trajectory_id``,
    ``row``) where the store disagrees. ``attempt`` (int64 column, on every row: 0 for first
    tries; a framework's retry of these trajectories passes the next) and ``policy_version``
    (int64 column when given: the weight version that generated them) are stamped as given
    (``docs/versions.md``); ``TypeError`` / ``ValueError`` for one that is not an int ``>= 0``.
    """
    stamps = {ATTEMPT: check_int(attempt, "attempt", minimum=0)}
    if policy_version is not None:
        stamps[POLICY_VERSION] = check_int(policy_version, "policy_version", minimum=0)
    ids = [t.trajectory_id for t in trajectories]
    routes = store.routes_chunked(ids)
    lens = list_lengths(routes)
    want = np.array([t.num_routes for t in trajectories], dtype=np.int64)
    bad = np.flatnonzero(lens != want)
    if bad.size:
        k = int(bad[0])
        raise RouteShapeError(
            f"trajectory {ids[k]!r}: expected {int(want[k])} route rows in the store, "
            f"found {int(lens[k])}",
            trajectory_id=ids[k],
            row=k,
        )
    return rollout_table(
        routes_missing=store.routes_missing(ids),
        trajectory_id=ids,
        group_id=[t.group_id for t in trajectories],
        prompt_ids=[t.prompt_ids for t in trajectories],
        response_ids=[t.response_ids for t in trajectories],
        loss_mask=[t.loss_mask for t in trajectories],
        reward=[t.reward for t in trajectories],
        routes=routes,
        spec=store.spec,
        num_turns=pa.array([t.num_turns for t in trajectories], type=pa.int32()),
        stop=pa.array([t.stop for t in trajectories], type=pa.large_string()),
        **{k: pa.array(np.full(len(ids), v, np.int64)) for k, v in stamps.items()},
        **_rollout_logprobs(trajectories),
    )


async def run_rollouts(
    client: EngineClient,
    env: Environment,
    prompts: Sequence[Sequence[int]],
    *,
    spec: RouteSpec | None = None,
    group_size: int = 1,
    max_turns: int = 8,
    sampling_params: Mapping[str, Any] | None = None,
    max_total_tokens: int | None = None,
    seed: int | None = None,
    store: TurnStore | None = None,
    reward_fn: Callable[[Conversation, float], float] | None = None,
    progress: bool = False,
    id_prefix: str = "",
    on_short: OnShort = "error",
    policy_version: int | None = None,
    attempt: int = 0,
) -> pa.Table:
    """Run ``group_size`` trajectories per prompt concurrently; return their rollout table.

    Trajectory ``j`` of prompt ``i`` is ``"{id_prefix}g{i}-{j}"`` in group ``"{id_prefix}g{i}"``,
    rows in that order; with ``seed`` its seeds start at ``seed + (i * group_size + j) *
    max_turns``. ``spec`` defaults to the client's (with ``store``: must be the store's, else
    `RouteShapeError`). The first failure is raised after the others are cancelled.
    ``on_short``: as `run_trajectory`; marked rows come back in a ``routes_missing`` column.
    ``policy_version`` / ``attempt``: stamped on every row as `trajectories_table` does
    (``docs/versions.md``); this loop does not retry, so a framework that reruns the batch
    passes the next ``attempt`` (both checked before any request).
    """
    check_positive_int(group_size, "group_size")
    check_int(attempt, "attempt", minimum=0)
    if policy_version is not None:
        check_int(policy_version, "policy_version", minimum=0)
    if store is not None and spec is not None and not spec.same_shape(store.spec):
        raise RouteShapeError(f"spec: expected the store's {store.spec} (or None), found {spec}")
    if store is None:
        spec = spec if spec is not None else client.spec
        if spec is None:
            raise ValueError(
                "spec: expected a RouteSpec (or a client or store that has one), found None"
            )
        store = TurnStore(spec)
    jobs = [(i, j, prompt) for i, prompt in enumerate(prompts) for j in range(group_size)]
    bar: Any = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(jobs), desc="rollouts", unit="traj")

    async def one(i: int, j: int, prompt: Sequence[int]) -> Trajectory:
        k = i * group_size + j
        traj = await run_trajectory(
            client,
            env,
            prompt,
            trajectory_id=f"{id_prefix}g{i}-{j}",
            group_id=f"{id_prefix}g{i}",
            store=store,
            max_turns=max_turns,
            sampling_params=sampling_params,
            max_total_tokens=max_total_tokens,
            seed=None if seed is None else seed + k * max_turns,
            reward_fn=reward_fn,
            on_short=on_short,
        )
        if bar is not None:
            bar.update(1)
        return traj

    tasks = [asyncio.ensure_future(one(i, j, p)) for i, j, p in jobs]
    try:
        trajectories = await asyncio.gather(*tasks)
    except BaseException:
        # one failure fails the batch: stop the other trajectories instead of leaving them running
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    finally:
        if bar is not None:
            bar.close()
    return trajectories_table(trajectories, store, policy_version=policy_version, attempt=attempt)


__all__ = [
    "Conversation",
    "Environment",
    "Step",
    "Trajectory",
    "run_rollouts",
    "run_trajectory",
    "trajectories_table",
]
