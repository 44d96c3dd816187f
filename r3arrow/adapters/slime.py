"""slime adapter: ``Sample`` objects <-> rollout table.

slime's ``Sample`` fields and its strict ``len(tokens) - 1`` route rows (no captured
count, no padding mask): ``docs/frameworks/slime.md``. numpy and pyarrow only at module
level; slime (and torch) are imported only by `to_samples` for slime's own type.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from r3arrow._checks import check_choice
from r3arrow._routes import dummy_route_row
from r3arrow._schema import list_lengths
from r3arrow.adapters._arrays import host
from r3arrow.errors import RouteShapeError, SchemaError
from r3arrow.spec import RouteSpec
from r3arrow.table import captured_lengths, flat_routes, rollout_table, route_spec

__all__ = ["from_samples", "to_samples"]

#: Extra column for ``Sample.rollout_log_probs``.
LOGPROBS_COLUMN = "rollout_log_probs"


def _get(sample: Any, name: str) -> Any:
    """A field of a ``Sample`` or of its ``to_dict()`` form."""
    if isinstance(sample, Mapping):
        return sample.get(name)
    return getattr(sample, name, None)


def _reward(value: Any, key: str | None, row: int) -> float:
    if isinstance(value, Mapping):
        if key is None or key not in value:
            raise SchemaError(
                f"samples[{row}].reward: expected a float (or reward_key= naming one of "
                f"{sorted(value)}), found a dict",
                row=row,
            )
        value = value[key]
    if value is None:
        raise SchemaError(f"samples[{row}].reward: expected a float, found None", row=row)
    return float(host(value))


def from_samples(
    samples: Sequence[Any], spec: RouteSpec, *, reward_key: str | None = None
) -> pa.Table:
    """Build a validated rollout table from slime ``Sample`` objects (or their dicts).

    ``trajectory_id`` is ``str(index)`` (the position in ``samples`` when ``index`` is
    None), ``group_id`` is ``str(group_index)`` (required). The prompt is
    ``tokens[:len(tokens) - response_length]``. Every ``rollout_routed_experts`` row is
    captured (slime gives ``len(tokens) - 1`` rows). ``rollout_log_probs`` becomes an
    extra column when every sample has it.
    Raises `TypeError` for a bad spec, `SchemaError` (missing group, bad lengths, dict
    reward without ``reward_key``), `RouteShapeError` (no routes, wrong shape, more rows
    than tokens), `ExpertRangeError`, `DuplicateExpertError`, `TerminalGapError`, each
    with ``row`` set.
    """
    if not isinstance(spec, RouteSpec):
        raise TypeError(f"spec: expected a RouteSpec, found {type(spec).__name__}")
    rows = len(samples)
    tids: list[str] = []
    gids: list[str] = []
    prompts: list[np.ndarray] = []
    responses: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    rewards = np.empty(rows, dtype=np.float64)
    routes: list[np.ndarray] = []
    logprobs: list[np.ndarray] = []
    for i, s in enumerate(samples):  # one iteration per trajectory; tokens stay vectorised
        tokens = np.asarray(host(_get(s, "tokens")), dtype=np.int64).reshape(-1)
        rlen = int(_get(s, "response_length") or 0)
        if not 0 <= rlen <= len(tokens):
            raise SchemaError(
                f"samples[{i}]: expected 0 <= response_length <= len(tokens)={len(tokens)}, "
                f"found {rlen}",
                row=i,
            )
        group = _get(s, "group_index")
        if group is None:
            raise SchemaError(f"samples[{i}].group_index: expected an int, found None", row=i)
        index = _get(s, "index")
        tids.append(str(i if index is None else index))
        gids.append(str(group))
        split = len(tokens) - rlen
        prompts.append(tokens[:split])
        responses.append(tokens[split:])
        mask = _get(s, "loss_mask")
        masks.append(
            np.ones(rlen, dtype=np.uint8) if mask is None else np.asarray(mask, dtype=np.uint8)
        )
        rewards[i] = _reward(_get(s, "reward"), reward_key, i)
        experts = _get(s, "rollout_routed_experts")
        if experts is None:
            raise RouteShapeError(
                f"samples[{i}].rollout_routed_experts: expected [len(tokens) - 1, "
                f"{spec.num_layers}, {spec.topk}] routes, found None",
                row=i,
            )
        arr = np.asarray(host(experts))
        if arr.size == 0:
            arr = arr.reshape(0, *spec.row_shape).astype(spec.dtype)
        routes.append(arr)
        lp = _get(s, "rollout_log_probs")
        if lp is not None:
            logprobs.append(np.asarray(host(lp), dtype=np.float32).reshape(-1))
    extra: dict[str, Any] = {}
    if rows and len(logprobs) == rows:
        extra[LOGPROBS_COLUMN] = pa.array(logprobs, type=pa.large_list(pa.float32()))
    return rollout_table(
        trajectory_id=tids,
        group_id=gids,
        prompt_ids=prompts,
        response_ids=responses,
        loss_mask=masks,
        reward=rewards,
        routes=routes,
        spec=spec,
        **extra,
    )


def _group_index(value: str) -> int | str:
    return int(value) if value.lstrip("-").isdigit() else value


def to_samples(table: pa.Table, *, fill_gap: bool = False, as_dataclass: str = "auto") -> list[Any]:
    """slime samples from a rollout table, one per trajectory, in table order.

    Each carries ``tokens`` (prompt + response, list[int]), ``response_length``,
    ``loss_mask`` (list[int]), ``reward`` (float), ``index`` and ``group_index`` (int
    when the id is an integer string, else the string), ``rollout_log_probs`` (when the
    table has that column, else None) and ``rollout_routed_experts``: int32
    ``[len(tokens) - 1, L, K]`` (numpy in a dict, a torch tensor in slime's ``Sample``).

    ``as_dataclass``: ``"auto"`` returns ``slime.utils.types.Sample`` objects when slime
    imports and dicts with those field names otherwise; ``"dict"`` always dicts;
    ``"slime"`` requires slime. A trajectory with fewer than ``len(tokens) - 1`` captured
    rows raises `RouteShapeError` (``row``, ``trajectory_id`` set) unless ``fill_gap``
    fills the gap with dummy rows; one with ``len(tokens)`` rows (the last token routed)
    always raises, since slime cannot hold it.
    """
    check_choice(as_dataclass, "as_dataclass", ("auto", "dict", "slime"))
    spec: RouteSpec = route_spec(table)
    sample_type: Any = None
    if as_dataclass != "dict":
        try:  # optional: slime is not on PyPI
            sample_type = importlib.import_module("slime.utils.types").Sample
        except ImportError:
            if as_dataclass == "slime":
                raise
    plen = list_lengths(table.column("prompt_ids"))
    rlen = list_lengths(table.column("response_ids"))
    n = plen + rlen
    cap = captured_lengths(table)
    want = np.maximum(n - 1, 0)
    tids: list[Any] = table.column("trajectory_id").to_pylist()
    bad = np.flatnonzero((cap > want) | ((cap < want) & (not fill_gap)))
    if bad.size:
        i = int(bad[0])
        hint = "" if cap[i] > want[i] else " (fill_gap=True fills the gap with dummy rows)"
        raise RouteShapeError(
            f"routes[{i}]: slime expects len(tokens) - 1 = {want[i]} route rows, found "
            f"{cap[i]}{hint}",
            row=i,
            trajectory_id=tids[i],
        )
    values, offsets = flat_routes(table)
    # One int32 buffer [sum(N - 1), L, K]: captured rows, then dummy rows for any gap.
    out_offsets = np.zeros(len(n) + 1, dtype=np.int64)
    np.cumsum(want, out=out_offsets[1:])
    full = np.full((int(want.sum()), *spec.row_shape), dummy_route_row(spec), dtype=np.int32)
    dst = (
        np.repeat(out_offsets[:-1], cap) + np.arange(int(cap.sum())) - np.repeat(offsets[:-1], cap)
    )
    full[dst] = values
    prompts: list[Any] = table.column("prompt_ids").to_pylist()
    responses = table.column("response_ids").to_pylist()
    masks = table.column("loss_mask").to_pylist()
    rewards = table.column("reward").to_pylist()
    groups: list[Any] = table.column("group_id").to_pylist()
    logprobs = (
        table.column(LOGPROBS_COLUMN).to_pylist()
        if LOGPROBS_COLUMN in table.column_names
        else [None] * table.num_rows
    )
    samples: list[Any] = []
    for i in range(table.num_rows):  # per trajectory: Python objects are slime's format
        experts: Any = full[out_offsets[i] : out_offsets[i + 1]]
        fields: dict[str, Any] = {
            "group_index": _group_index(groups[i]),
            "index": _group_index(tids[i]),
            "tokens": prompts[i] + responses[i],
            "response_length": int(rlen[i]),
            "loss_mask": masks[i],
            "reward": rewards[i],
            "rollout_log_probs": logprobs[i],
            "rollout_routed_experts": experts,
        }
        if sample_type is not None:
            import torch

            fields["rollout_routed_experts"] = torch.from_numpy(experts)
            samples.append(sample_type(**fields))
        else:
            samples.append(fields)
    return samples
