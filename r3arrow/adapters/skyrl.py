"""SkyRL adapter: ``GeneratorOutput`` -> rollout table -> SkyRL's trainer inputs.

SkyRL (``skyrl`` 0.3.0) hands the trainer a ``GeneratorOutput`` TypedDict
(``skyrl/train/generators/base.py``): per trajectory ``prompt_token_ids``,
``response_ids``, ``loss_masks`` (over the response), ``rewards`` (a scalar or one
value per response token), optional ``rollout_logprobs``, ``trajectory_ids``
(``TrajectoryID(instance_id, repetition_id)``) and ``rollout_expert_indices``.
The routes come in one of two layouts, both accepted here:

* **nested lists** (the released 0.3.0 type): ``[batch][seq][layers][topk]`` Python
  ints, each trajectory's rows starting at token 0;
* **compact arrays** (SkyRL PR #1912, ``RoutedExpertTrace.finalize``): one integer
  numpy array (or torch tensor) ``[N, L, K]`` per trajectory, where ``N`` is prompt +
  response and the terminal gap (the rows the engine never computed) has been
  **padded with dummy rows** ``[0, 1, ..., K-1]``.

**A padded terminal gap cannot be undone without the captured count.** Without
``captured``, padded dummy rows are indistinguishable from real routes, so r3arrow
treats every given row as captured: those trajectories keep ``N`` rows and the router
padding mask is False on the dummy rows (they are replayed and counted in
expert-bias accounting as if the engine had routed them). Pass ``captured`` (one
count per trajectory, e.g. ``RoutedExpertTrace.prompt_start`` read before
``finalize``) to keep exactly the captured prefix (``docs/design.md``, "Ragged routes
and the terminal gap" and "Router padding mask and dummy rows").

`to_training_inputs` produces what SkyRL's ``convert_prompts_responses_to_batch_tensors``
(``skyrl/train/dataset/preprocess.py``) gives ``RayPPOTrainer.convert_to_training_input``
(``skyrl/train/trainer.py``): sequences left-padded to the longest prompt + response,
per-action fields right-aligned in ``[B, max_response]``, and ``rollout_expert_indices``
``[B, S, L, K]`` aligned with ``sequences``.

Integration module: numpy and pyarrow only at module level; torch is imported only
for ``tensors="torch"`` (and torch inputs are duck-typed).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from r3arrow._checks import check_choice, check_int
from r3arrow._routes import dummy_route_row
from r3arrow._schema import list_lengths
from r3arrow.errors import RouteShapeError, SchemaError
from r3arrow.spec import RouteSpec
from r3arrow.table import captured_lengths, flat_routes, input_ids, rollout_table, route_spec

__all__ = ["from_generator_output", "to_generator_output", "to_training_inputs"]

#: Extra columns this adapter writes (and `to_training_inputs` / `to_generator_output` read).
LOGPROBS_COLUMN = "rollout_logprobs"
TOKEN_REWARDS_COLUMN = "token_rewards"
STOP_REASON_COLUMN = "stop_reason"


def _host(x: Any) -> Any:
    """A torch tensor as numpy (duck-typed: no torch import); anything else unchanged."""
    return x.detach().cpu().numpy() if hasattr(x, "detach") else x


def _routes_array(entry: Any, spec: RouteSpec, row: int) -> np.ndarray:
    """One trajectory's routes as an integer ``[rows, L, K]`` array (one ``np.asarray``)."""
    entry = _host(entry)
    if entry is None or (isinstance(entry, list) and len(entry) == 0):
        return np.empty((0, *spec.row_shape), dtype=spec.dtype)
    try:
        arr = np.asarray(entry)
    except ValueError as exc:  # ragged nested lists
        raise RouteShapeError(
            f"rollout_expert_indices[{row}]: expected a rectangular [seq, {spec.num_layers}, "
            f"{spec.topk}] array, found ragged nested lists ({exc})",
            row=row,
        ) from exc
    if arr.dtype.kind not in "iu" or arr.ndim != 3 or arr.shape[1:] != spec.row_shape:
        raise RouteShapeError(
            f"rollout_expert_indices[{row}]: expected integer [seq, {spec.num_layers}, "
            f"{spec.topk}], found {arr.dtype} {list(arr.shape)}",
            row=row,
        )
    return arr


def _trajectory_keys(
    out: Mapping[str, Any], rows: int, uids: Sequence[str] | None
) -> tuple[list[str], list[str]]:
    """(trajectory ids, group ids) from ``trajectory_ids`` and/or ``uids``."""
    tids = out.get("trajectory_ids")
    if tids is not None and len(tids) != rows:
        raise SchemaError(f"trajectory_ids: expected {rows} entries, found {len(tids)}")
    if uids is not None and len(uids) != rows:
        raise ValueError(f"uids: expected {rows} entries (one per trajectory), found {len(uids)}")
    if tids is None:
        if uids is None:
            raise ValueError(
                "expected GeneratorOutput['trajectory_ids'] or uids= to name each trajectory's "
                "group, found neither"
            )
        return [str(i) for i in range(rows)], [str(u) for u in uids]
    names = [f"{t.instance_id}_{t.repetition_id}" for t in tids]
    groups = [str(u) for u in uids] if uids is not None else [str(t.instance_id) for t in tids]
    return names, groups


def _rewards(rewards: Any, response_lengths: np.ndarray) -> tuple[np.ndarray, list[Any] | None]:
    """(scalar reward per trajectory, per-token rewards or None)."""
    rows = len(response_lengths)
    if rewards is None or len(rewards) != rows:
        found = "None" if rewards is None else f"{len(rewards)} entries"
        raise SchemaError(f"rewards: expected {rows} entries, found {found}")
    if rows == 0 or np.ndim(_host(rewards[0])) == 0:
        return np.asarray([float(_host(r)) for r in rewards], dtype=np.float64), None
    per_token = [np.asarray(_host(r), dtype=np.float64).reshape(-1) for r in rewards]
    lens = np.fromiter((len(r) for r in per_token), dtype=np.int64, count=rows)
    bad = np.flatnonzero(lens != response_lengths)
    if bad.size:
        i = int(bad[0])
        raise SchemaError(
            f"rewards[{i}]: expected one reward per response token ({response_lengths[i]}), "
            f"found {lens[i]}",
            row=i,
        )
    total = np.fromiter((r.sum() for r in per_token), dtype=np.float64, count=rows)
    return total, per_token


def from_generator_output(
    out: Mapping[str, Any],
    spec: RouteSpec,
    *,
    captured: Sequence[int] | np.ndarray | None = None,
    uids: Sequence[str] | None = None,
) -> pa.Table:
    """Build a validated rollout table from a SkyRL ``GeneratorOutput``.

    Parameters
    ----------
    out:
        A ``GeneratorOutput`` (any mapping with its keys). ``rollout_expert_indices`` is
        required: per trajectory nested lists ``[seq][L][K]`` (0.3.0) or an integer
        numpy array / torch tensor ``[seq, L, K]`` (#1912), rows starting at token 0.
        An empty entry means no captured rows.
    spec:
        The model's `RouteSpec`.
    captured:
        Captured rows per trajectory. Rows past it are dropped (they are the dummy rows
        a #1912 ``finalize`` appended). **Without it, every given row is treated as
        captured**: a finalize that padded the terminal gap cannot be undone, padded
        dummy rows are indistinguishable from routes, and the padding mask will be
        False on them.
    uids:
        Group ids (SkyRL's ``uids``); default: ``trajectory_ids[i].instance_id``.

    Columns: the rollout schema (``trajectory_id`` = ``TrajectoryID.to_string()``,
    ``reward`` = the scalar reward or the sum of per-token rewards), plus
    ``rollout_logprobs``, ``token_rewards`` and ``stop_reason`` when given.
    Raises `ValueError` (no group ids, bad ``captured``), `SchemaError` (field lengths),
    `RouteShapeError` (shape, more rows than tokens or than ``captured`` allows),
    `ExpertRangeError`, `DuplicateExpertError`, `TerminalGapError` (a trained token
    whose row is missing), each with ``row`` set.
    """
    if not isinstance(spec, RouteSpec):
        raise TypeError(f"spec: expected a RouteSpec, found {type(spec).__name__}")
    prompts, responses = out["prompt_token_ids"], out["response_ids"]
    rows = len(prompts)
    routes_in = out.get("rollout_expert_indices")
    if routes_in is None:
        raise SchemaError("rollout_expert_indices: expected routes for R3, found None")
    if len(responses) != rows or len(out["loss_masks"]) != rows or len(routes_in) != rows:
        raise SchemaError(
            f"expected prompt_token_ids, response_ids, loss_masks and rollout_expert_indices "
            f"of {rows} trajectories, found {len(responses)}, {len(out['loss_masks'])} and "
            f"{len(routes_in)}"
        )
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
    reward, per_token = _rewards(out.get("rewards"), rlen)
    extra: dict[str, Any] = {}
    if out.get("rollout_logprobs") is not None:
        logprobs = pa.array(
            [np.asarray(_host(x), dtype=np.float32).reshape(-1) for x in out["rollout_logprobs"]],
            type=pa.large_list(pa.float32()),
        )
        bad = np.flatnonzero(list_lengths(logprobs) != rlen) if len(logprobs) == rows else [0]
        if len(bad):
            i = int(bad[0])
            raise SchemaError(
                f"rollout_logprobs: expected one log-prob per response token for each of {rows} "
                f"trajectories, found a mismatch at trajectory {i}",
                row=i,
            )
        extra[LOGPROBS_COLUMN] = logprobs
    if per_token is not None:
        extra[TOKEN_REWARDS_COLUMN] = pa.array(per_token, type=pa.large_list(pa.float64()))
    if out.get("stop_reasons") is not None:
        extra[STOP_REASON_COLUMN] = pa.array(out["stop_reasons"], type=pa.large_string())
    return rollout_table(
        trajectory_id=tids,
        group_id=groups,
        prompt_ids=prompts,
        response_ids=responses,
        loss_mask=out["loss_masks"],
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


def _flat(col: Any) -> np.ndarray:
    return np.asarray(pc.list_flatten(col).to_numpy(zero_copy_only=False))


def _right_aligned(
    table: pa.Table, name: str, lengths: np.ndarray, width: int, dtype: Any
) -> np.ndarray:
    """A per-response-token list column as ``[B, width]``, right-aligned, zeros before."""
    out = np.zeros((len(lengths), width), dtype=dtype)
    rows = np.repeat(np.arange(len(lengths)), lengths)
    starts = np.cumsum(lengths) - lengths
    cols = (
        np.arange(int(lengths.sum()))
        - np.repeat(starts, lengths)
        + np.repeat(width - lengths, lengths)
    )
    out[rows, cols] = _flat(table.column(name))
    return out


def to_training_inputs(
    table: pa.Table, *, pad_token_id: int = 0, tensors: str = "numpy"
) -> dict[str, Any]:
    """The batch SkyRL's trainer builds from a ``GeneratorOutput``, from a rollout table.

    With ``B`` trajectories, ``S = max(prompt + response)`` and ``R = max(response)``
    (the layout of ``convert_prompts_responses_to_batch_tensors``):

    * ``sequences`` int64 ``[B, S]``: left-padded with ``pad_token_id``, then prompt, response;
    * ``attention_mask`` int64 ``[B, S]``: 1 on real tokens;
    * ``response_mask`` int64 ``[B, R]``: 1 on the last ``response_i`` positions (right-aligned);
    * ``loss_mask`` float32 ``[B, R]``, right-aligned;
    * ``rewards`` float32 ``[B, R]``, right-aligned: the ``token_rewards`` column if present,
      else the scalar reward on the last response token (SkyRL's own placement);
    * ``rollout_logprobs`` float32 ``[B, R]`` right-aligned, or None without that column;
    * ``rollout_expert_indices`` ``[B, S, L, K]`` aligned with ``sequences``; positions without
      a captured row (left padding, the uncaptured suffix) carry the dummy row
      ``[0, ..., K-1]``; dtype uint8 / int16 / int32, the smallest that holds the largest id
      (SkyRL's compaction rule);
    * ``router_padding_mask`` bool ``[B, S]``: True on left padding and the uncaptured suffix
      (SkyRL #1912's ``make_router_padding_mask``);
    * ``uids`` list[str]: the group ids, for ``convert_to_training_input(..., uids)``.

    ``tensors="torch"`` returns torch tensors (``torch.from_numpy``, no copy). Raises
    `ValueError` on an empty table or a bad option, `SchemaError` off the rollout schema.
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
    # Column of every flat token of `input_ids`: its left padding plus its index in the row.
    starts = np.cumsum(n) - n
    tok_rows = np.repeat(np.arange(b), n)
    tok_cols = np.arange(int(n.sum())) - np.repeat(starts, n) + np.repeat(left, n)
    sequences = np.full((b, s), pad, dtype=np.int64)
    sequences[tok_rows, tok_cols] = _flat(input_ids(table))
    attention = np.zeros((b, s), dtype=np.int64)
    attention[tok_rows, tok_cols] = 1

    response_mask = (np.arange(r)[None, :] >= (r - rlen)[:, None]).astype(np.int64)
    loss_mask = _right_aligned(table, "loss_mask", rlen, r, np.float32)
    if TOKEN_REWARDS_COLUMN in table.column_names:
        rewards = _right_aligned(table, TOKEN_REWARDS_COLUMN, rlen, r, np.float32)
    else:
        rewards = np.zeros((b, r), dtype=np.float32)
        has = rlen > 0
        if r:
            rewards[np.flatnonzero(has), r - 1] = table.column("reward").to_numpy()[has]
    logprobs = None
    if LOGPROBS_COLUMN in table.column_names:
        logprobs = _right_aligned(table, LOGPROBS_COLUMN, rlen, r, np.float32)

    values, offsets = flat_routes(table)
    cap = np.diff(offsets)
    max_id = int(values.max()) if values.size else 0
    dtype = _compact_dtype(max(max_id, spec.topk - 1))
    routes = np.empty((b, s, *spec.row_shape), dtype=dtype)
    routes[...] = dummy_route_row(spec).astype(dtype)
    route_rows = np.repeat(np.arange(b), cap)
    route_cols = np.arange(int(cap.sum())) - np.repeat(offsets[:-1], cap) + np.repeat(left, cap)
    routes[route_rows, route_cols] = values
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
        import torch

        result = {k: None if v is None else torch.from_numpy(v) for k, v in result.items()}
    result["uids"] = table.column("group_id").to_pylist()
    return result


def to_generator_output(
    table: pa.Table, *, layout: str = "compact", pad_terminal_gap: bool = True
) -> tuple[dict[str, Any], np.ndarray, list[str]]:
    """A ``GeneratorOutput``-shaped dict, the captured counts and the uids of a rollout table.

    ``layout="compact"`` gives one numpy ``[rows, L, K]`` array per trajectory (#1912);
    ``"nested"`` gives nested lists (0.3.0; ``.tolist()`` per trajectory). With
    ``pad_terminal_gap`` every trajectory gets ``N`` rows, the gap filled with dummy rows
    the way #1912's ``RoutedExpertTrace.finalize`` does; the returned captured counts
    (int64 ``[B]``) are what `from_generator_output` needs to undo it.
    ``trajectory_ids`` is None (SkyRL's ``TrajectoryID`` is not imported): the group ids
    come back as the third value, SkyRL's ``uids``. Raises `ValueError` on a bad option.
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
