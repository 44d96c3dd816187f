"""SkyRL adapter: ``GeneratorOutput`` -> rollout table -> SkyRL's trainer inputs.

SkyRL's formats (``skyrl`` 0.3.0 nested lists; PR #1912 compact ``[N, L, K]`` arrays whose
terminal gap is padded with dummy rows, undone only with ``captured=``) and where each
call goes: ``docs/frameworks/skyrl.md``. numpy and pyarrow only at module level; torch is
imported only for ``tensors="torch"`` (torch inputs are duck-typed).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from r3arrow._checks import check_choice, check_int
from r3arrow._extras import require
from r3arrow._routes import dummy_route_row
from r3arrow._schema import list_lengths
from r3arrow.adapters._arrays import (
    check_unique,
    flat_values,
    host,
    id_strings,
    number,
    scatter,
    vector,
)
from r3arrow.errors import RouteShapeError, SchemaError
from r3arrow.spec import RouteSpec
from r3arrow.table import captured_lengths, flat_routes, input_ids, rollout_table, route_spec

__all__ = ["from_generator_output", "to_generator_output", "to_training_inputs"]

#: Extra columns this adapter writes (and `to_training_inputs` / `to_generator_output` read).
LOGPROBS_COLUMN = "rollout_logprobs"
TOKEN_REWARDS_COLUMN = "token_rewards"
STOP_REASON_COLUMN = "stop_reason"


def _routes_array(entry: Any, spec: RouteSpec, row: int) -> np.ndarray:
    """One trajectory's routes as an integer ``[rows, L, K]`` array (one ``np.asarray``)."""
    if entry is None or (isinstance(entry, list) and len(entry) == 0):
        return np.empty((0, *spec.row_shape), dtype=spec.dtype)
    try:
        arr = np.asarray(host(entry))
    except (TypeError, ValueError, OverflowError, RuntimeError) as exc:  # ragged lists, ...
        raise RouteShapeError(
            f"rollout_expert_indices[{row}]: expected a rectangular [seq, {spec.num_layers}, "
            f"{spec.topk}] integer array, found {exc}",
            row=row,
        ) from exc
    if arr.dtype.kind not in "iu" or arr.ndim != 3 or arr.shape[1:] != spec.row_shape:
        raise RouteShapeError(
            f"rollout_expert_indices[{row}]: expected integer [seq, {spec.num_layers}, "
            f"{spec.topk}], found {arr.dtype} {list(arr.shape)}",
            row=row,
        )
    return arr


def _entries(out: Mapping[str, Any], key: str, rows: int | None = None) -> list[Any]:
    """The per-trajectory entries of ``out[key]``, ``rows`` of them where given."""
    value = out.get(key)
    try:
        entries = list(value)  # type: ignore[arg-type]
    except TypeError:
        raise SchemaError(
            f"{key}: expected a list with one entry per trajectory, found {type(value).__name__}"
        ) from None
    if rows is not None and len(entries) != rows:
        raise SchemaError(
            f"{key}: expected {rows} entries (one per trajectory), found {len(entries)}"
        )
    return entries


def _trajectory_keys(
    out: Mapping[str, Any], rows: int, uids: Sequence[str] | None
) -> tuple[list[str], list[str]]:
    """(trajectory ids, group ids) from ``trajectory_ids`` and/or ``uids``."""
    if uids is not None and len(uids) != rows:
        raise ValueError(f"uids: expected {rows} entries (one per trajectory), found {len(uids)}")
    groups = None if uids is None else id_strings(uids, "uids")
    if out.get("trajectory_ids") is None:
        if groups is None:
            raise ValueError(
                "expected GeneratorOutput['trajectory_ids'] or uids= to name each trajectory's "
                "group, found neither"
            )
        return [str(i) for i in range(rows)], groups
    tids = _entries(out, "trajectory_ids", rows)
    for i, t in enumerate(tids):
        if not (hasattr(t, "instance_id") and hasattr(t, "repetition_id")):
            raise SchemaError(
                f"trajectory_ids[{i}]: expected a TrajectoryID, found {type(t).__name__}", row=i
            )
    instance = id_strings([t.instance_id for t in tids], "trajectory_ids.instance_id")
    repetition = [t.repetition_id for t in tids]
    id_strings(repetition, "trajectory_ids.repetition_id")
    names = [f"{i}_{r}" for i, r in zip(instance, repetition, strict=True)]
    check_unique(names, "trajectory_ids")
    return names, instance if groups is None else groups


def _rewards(rewards: list[Any], rlen: np.ndarray) -> tuple[np.ndarray, list[np.ndarray] | None]:
    """(scalar reward per trajectory, per-token rewards or None)."""
    if not any(isinstance(r, list | tuple) or getattr(r, "ndim", 0) > 0 for r in rewards):
        return np.array([number(r, f"rewards[{i}]", i) for i, r in enumerate(rewards)]), None
    tokens = [vector(r, f"rewards[{i}]", i, "float") for i, r in enumerate(rewards)]
    for i, r in enumerate(tokens):
        if len(r) != rlen[i]:
            raise SchemaError(
                f"rewards[{i}]: expected one reward per response token ({rlen[i]}), found {len(r)}",
                row=i,
            )
    total = np.fromiter((r.sum() for r in tokens), dtype=np.float64, count=len(tokens))
    return total, tokens


def from_generator_output(
    out: Mapping[str, Any],
    spec: RouteSpec,
    *,
    captured: Sequence[int] | np.ndarray | None = None,
    uids: Sequence[str] | None = None,
) -> pa.Table:
    """Build a validated rollout table from a SkyRL ``GeneratorOutput`` (any mapping).

    ``rollout_expert_indices`` is required: per trajectory nested lists ``[seq][L][K]``
    (0.3.0) or an integer numpy array / torch tensor ``[seq, L, K]`` (#1912), rows from
    token 0 (an empty entry: no captured rows). ``captured``: rows kept per trajectory
    (the rest are a #1912 ``finalize``'s dummy rows); **without it every given row is
    treated as captured**, so the padding mask is False on padded dummy rows. ``uids``:
    group ids (default ``trajectory_ids[i].instance_id``).

    Columns: the rollout schema (``trajectory_id`` = ``TrajectoryID.to_string()``,
    unique; ``reward`` = the scalar reward or the sum of per-token rewards), plus
    ``rollout_logprobs``, ``token_rewards`` and ``stop_reason`` when given. Raises
    `ValueError` (no group ids, bad ``captured`` / ``uids`` length), `SchemaError` (a
    missing field, bad lengths, ids or values), `RouteShapeError` (shape, more rows than
    tokens or than ``captured`` allows), `ExpertRangeError`, `DuplicateExpertError`,
    `TerminalGapError`, each with ``row`` set.
    """
    if not isinstance(spec, RouteSpec):
        raise TypeError(f"spec: expected a RouteSpec, found {type(spec).__name__}")
    if not isinstance(out, Mapping):
        raise TypeError(f"out: expected a GeneratorOutput mapping, found {type(out).__name__}")
    if out.get("rollout_expert_indices") is None:
        raise SchemaError("rollout_expert_indices: expected routes for R3, found None")
    prompts_in = _entries(out, "prompt_token_ids")
    rows = len(prompts_in)
    prompts = [vector(p, f"prompt_token_ids[{i}]", i, "int") for i, p in enumerate(prompts_in)]
    responses = [
        vector(r, f"response_ids[{i}]", i, "int")
        for i, r in enumerate(_entries(out, "response_ids", rows))
    ]
    masks = [
        vector(m, f"loss_masks[{i}]", i, "mask")
        for i, m in enumerate(_entries(out, "loss_masks", rows))
    ]
    routes_in = _entries(out, "rollout_expert_indices", rows)
    routes = [_routes_array(entry, spec, i) for i, entry in enumerate(routes_in)]
    if captured is not None:
        cap = np.asarray(captured)
        if cap.size == 0:
            cap = cap.astype(np.int64)
        if cap.shape != (rows,) or cap.dtype.kind not in "iu" or (cap < 0).any():
            raise ValueError(
                f"captured: expected {rows} non-negative integers, found {cap.dtype} "
                f"{list(cap.shape)}"
            )
        for i, (arr, c) in enumerate(zip(routes, cap.tolist(), strict=True)):
            if c > arr.shape[0]:
                raise RouteShapeError(
                    f"rollout_expert_indices[{i}]: captured={c} rows, but only "
                    f"{arr.shape[0]} rows were given",
                    row=i,
                )
        routes = [arr[:c] for arr, c in zip(routes, cap.tolist(), strict=True)]
    tids, groups = _trajectory_keys(out, rows, uids)
    rlen = np.fromiter((len(r) for r in responses), dtype=np.int64, count=rows)
    reward, per_token = _rewards(_entries(out, "rewards", rows), rlen)
    extra: dict[str, Any] = {}
    if out.get("rollout_logprobs") is not None:
        logprobs = [
            vector(x, f"rollout_logprobs[{i}]", i, "float").astype(np.float32)
            for i, x in enumerate(_entries(out, "rollout_logprobs", rows))
        ]
        bad = np.flatnonzero(np.array([len(x) for x in logprobs], dtype=np.int64) != rlen)
        if len(bad):
            i = int(bad[0])
            raise SchemaError(
                f"rollout_logprobs: expected one log-prob per response token for each of {rows} "
                f"trajectories, found a mismatch at trajectory {i}",
                row=i,
            )
        extra[LOGPROBS_COLUMN] = pa.array(logprobs, type=pa.large_list(pa.float32()))
    if per_token is not None:
        extra[TOKEN_REWARDS_COLUMN] = pa.array(per_token, type=pa.large_list(pa.float64()))
    if out.get("stop_reasons") is not None:
        reasons = _entries(out, "stop_reasons", rows)
        bad_reason = [i for i, r in enumerate(reasons) if r is not None and not isinstance(r, str)]
        if bad_reason:
            i = bad_reason[0]
            raise SchemaError(
                f"stop_reasons[{i}]: expected a string, found {reasons[i]!r:.80}", row=i
            )
        extra[STOP_REASON_COLUMN] = pa.array(reasons, type=pa.large_string())
    return rollout_table(
        trajectory_id=tids,
        group_id=groups,
        prompt_ids=prompts,
        response_ids=responses,
        loss_mask=masks,
        reward=reward,
        routes=routes,
        spec=spec,
        **extra,
    )


def _compact_dtype(max_id: int) -> np.dtype[Any]:
    """SkyRL's route dtype rule (``compact_routed_expert_indices``): uint8, int16, int32."""
    if max_id < 2**8:
        return np.dtype(np.uint8)
    if max_id < 2**15:
        return np.dtype(np.int16)
    return np.dtype(np.int32)


def to_training_inputs(
    table: pa.Table, *, pad_token_id: int = 0, tensors: str = "numpy"
) -> dict[str, Any]:
    """The batch SkyRL's trainer builds from a ``GeneratorOutput``, from a rollout table.

    With ``S = max(prompt + response)`` and ``R = max(response)`` (SkyRL's
    ``convert_prompts_responses_to_batch_tensors``): ``sequences`` int64 ``[B, S]``
    left-padded with ``pad_token_id``; ``attention_mask`` int64 ``[B, S]``; right-aligned
    ``[B, R]`` ``response_mask`` (int64), ``loss_mask``, ``rewards`` (the ``token_rewards``
    column, else the reward at the last response token) and ``rollout_logprobs`` (None
    without the column), float32; ``rollout_expert_indices`` ``[B, S, L, K]`` aligned with
    ``sequences``, the dummy row ``[0, ..., K-1]`` where no row was captured, uint8 / int16
    / int32 (the smallest holding the largest id); ``router_padding_mask`` bool ``[B, S]``
    (True on left padding and the uncaptured suffix); ``uids``, the group ids.
    ``tensors="torch"``: torch tensors (no copy). Raises `ValueError` on an empty table or
    a bad option, `SchemaError` off the rollout schema.
    """
    check_choice(tensors, "tensors", ("numpy", "torch"))
    pad = check_int(pad_token_id, "pad_token_id")
    if not isinstance(table, pa.Table):
        raise TypeError(f"table: expected a pyarrow.Table, found {type(table).__name__}")
    if table.num_rows == 0:
        raise ValueError("table: expected at least one trajectory, found none")
    spec = route_spec(table)
    plen = list_lengths(table.column("prompt_ids"))
    rlen = list_lengths(table.column("response_ids"))
    n = plen + rlen
    b, s, r = table.num_rows, int(n.max()), int(rlen.max())
    left = s - n
    sequences = scatter(flat_values(input_ids(table)), n, left, (b, s), pad, np.int64)
    attention = (np.arange(s)[None, :] >= left[:, None]).astype(np.int64)

    response_mask = (np.arange(r)[None, :] >= (r - rlen)[:, None]).astype(np.int64)

    def right_aligned(name: str) -> np.ndarray:
        return scatter(flat_values(table.column(name)), rlen, r - rlen, (b, r), 0, np.float32)

    loss_mask = right_aligned("loss_mask")
    if TOKEN_REWARDS_COLUMN in table.column_names:
        rewards = right_aligned(TOKEN_REWARDS_COLUMN)
    else:
        rewards = np.zeros((b, r), dtype=np.float32)
        has = rlen > 0
        if r:
            rewards[np.flatnonzero(has), r - 1] = table.column("reward").to_numpy()[has]
    logprobs = None
    if LOGPROBS_COLUMN in table.column_names:
        logprobs = right_aligned(LOGPROBS_COLUMN)

    values, offsets = flat_routes(table)
    cap = np.diff(offsets)
    max_id = int(values.max()) if values.size else 0
    dtype = _compact_dtype(max(max_id, spec.topk - 1))
    dummy = dummy_route_row(spec).astype(dtype)
    routes = scatter(values, cap, left, (b, s, *spec.row_shape), dummy, dtype)
    positions = np.arange(s)[None, :]
    padding = (positions < left[:, None]) | (positions >= (left + cap)[:, None])

    result: dict[str, Any] = {
        "sequences": sequences,
        "attention_mask": attention,
        "response_mask": response_mask,
        "rewards": rewards,
        "loss_mask": loss_mask,
        "rollout_logprobs": logprobs,
        "rollout_expert_indices": routes,
        "router_padding_mask": padding,
    }
    if tensors == "torch":
        with require(extra="torch", feature="r3arrow.adapters.skyrl"):
            import torch

        result = {k: None if v is None else torch.from_numpy(v) for k, v in result.items()}
    result["uids"] = table.column("group_id").to_pylist()
    return result


def to_generator_output(
    table: pa.Table, *, layout: str = "compact", pad_terminal_gap: bool = True
) -> tuple[dict[str, Any], np.ndarray, list[str]]:
    """A ``GeneratorOutput``-shaped dict, the captured counts and the uids of a rollout table.

    ``layout="compact"``: one numpy ``[rows, L, K]`` array per trajectory (#1912);
    ``"nested"``: nested lists (0.3.0). ``pad_terminal_gap``: every trajectory gets ``N``
    rows, the gap filled with dummy rows like #1912's ``finalize``; the captured counts
    (int64 ``[B]``) undo it in `from_generator_output`. ``trajectory_ids`` is None (the
    group ids come back as the uids). Raises `ValueError` on a bad option.
    """
    check_choice(layout, "layout", ("compact", "nested"))
    spec = route_spec(table)
    values, offsets = flat_routes(table)
    cap = captured_lengths(table)
    n = list_lengths(table.column("prompt_ids")) + list_lengths(table.column("response_ids"))
    per_traj: list[Any] = []
    dummy = dummy_route_row(spec)
    for i in range(table.num_rows):  # one slice per trajectory, never per token
        part = values[offsets[i] : offsets[i + 1]]
        if pad_terminal_gap and n[i] > cap[i]:
            gap = np.broadcast_to(dummy, (int(n[i] - cap[i]), *spec.row_shape))
            part = np.concatenate([part, gap], axis=0)
        per_traj.append(part.tolist() if layout == "nested" else np.array(part))
    out: dict[str, Any] = {
        "prompt_token_ids": table.column("prompt_ids").to_pylist(),
        "response_ids": table.column("response_ids").to_pylist(),
        "rewards": table.column("reward").to_pylist(),
        "loss_masks": table.column("loss_mask").to_pylist(),
        "stop_reasons": None,
        "rollout_metrics": None,
        "rollout_logprobs": (
            table.column(LOGPROBS_COLUMN).to_pylist()
            if LOGPROBS_COLUMN in table.column_names
            else None
        ),
        "trajectory_ids": None,
        "trajectory_generation_times": None,
        "rollout_expert_indices": per_traj,
        "is_last_step": None,
        "env_metrics": None,
        "pixel_values": None,
        "image_grid_thw": None,
    }
    uids: list[str] = [str(u) for u in table.column("group_id").to_pylist()]
    return out, cap, uids
