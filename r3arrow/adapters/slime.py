"""slime adapter: ``Sample`` objects <-> rollout table.

slime's ``Sample`` fields and its strict ``len(tokens) - 1`` route rows (no captured
count, no padding mask): ``docs/frameworks/slime.md``. The fields without a rollout column
(``status``, ``prompt``, ``metadata``, ...) travel as extra columns, both ways. numpy and
pyarrow only at module level; slime (and torch) are imported only by `to_samples`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import importlib
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import numpy as np
import orjson
import pyarrow as pa

from r3arrow._checks import check_choice
from r3arrow._routes import dummy_route_row
from r3arrow._schema import ROLLOUT_COLUMNS, ROLLOUT_LOGPROBS, list_lengths
from r3arrow.adapters._arrays import check_unique, host, id_strings, number, vector
from r3arrow.errors import RouteShapeError, SchemaError
from r3arrow.spec import RouteSpec
from r3arrow.table import captured_lengths, flat_routes, rollout_table, route_spec

__all__ = ["from_samples", "to_samples"]

#: The ``Sample`` field of the engine's log-probs (column ``rollout_logprobs``).
LOGPROBS_FIELD = "rollout_log_probs"
#: The ``Sample`` fields the rollout columns hold (every other field is an extra column).
MAPPED_FIELDS = (
    "group_index",
    "index",
    "tokens",
    "response_length",
    "loss_mask",
    "reward",
    LOGPROBS_FIELD,
    "rollout_routed_experts",
)
# Schema metadata: the extra columns holding their field as JSON text (orjson).
_JSON_KEY = b"r3arrow.slime.json"


def _fields(sample: Any, row: int) -> Mapping[str, Any]:
    """A ``Sample``'s fields (its ``__dict__``) or its ``to_dict()`` form as is."""
    if isinstance(sample, Mapping):
        return sample
    try:
        fields: dict[str, Any] = vars(sample)
    except TypeError:
        raise SchemaError(
            f"samples[{row}]: expected a Sample or its to_dict() form, found "
            f"{type(sample).__name__}",
            row=row,
        ) from None
    return fields


def _reward(value: Any, key: str | None, row: int) -> float:
    if isinstance(value, Mapping):
        if key is None or key not in value:
            raise SchemaError(
                f"samples[{row}].reward: expected a float (or reward_key= naming one of "
                f"{sorted(map(str, value))}), found a dict",
                row=row,
            )
        value = value[key]
    return number(value, f"samples[{row}].reward", row)


def _plain(value: Any) -> Any:
    """slime's ``to_dict`` form of a field value (enums by value, dataclasses as dicts),
    numpy values and tensors (bfloat16 too) as Python ones."""
    if hasattr(value, "tolist"):
        return value.tolist()
    if isinstance(value, enum.Enum):
        return value.value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.asdict(value)
    return value


def _has_struct(typ: pa.DataType) -> bool:
    return pa.types.is_struct(typ) or (
        (pa.types.is_list(typ) or pa.types.is_large_list(typ)) and _has_struct(typ.value_type)
    )


def _carried(name: str, values: list[Any]) -> tuple[pa.Array[Any], bool]:
    """A column giving ``values`` back unchanged: Arrow's own type, else (dicts: their keys
    vary, and Parquet holds no empty struct) JSON text (True)."""
    with contextlib.suppress(pa.ArrowException, TypeError, ValueError, OverflowError):
        arr = pa.array(values)
        if not _has_struct(arr.type) and arr.to_pylist() == values:
            return arr, False
    with contextlib.suppress(TypeError, ValueError):
        text = [orjson.dumps(v).decode() for v in values]
        if [orjson.loads(t) for t in text] == values:
            return pa.array(text, type=pa.large_string()), True
    raise SchemaError(
        f"samples: field {name!r} holds values that neither Arrow nor JSON gives back "
        f"unchanged (pass ignore=[{name!r}] to leave it out)"
    )


def from_samples(
    samples: Sequence[Any],
    spec: RouteSpec,
    *,
    reward_key: str | None = None,
    ignore: Collection[str] = (),
) -> pa.Table:
    """Build a validated rollout table from slime ``Sample`` objects (or their ``to_dict()``).

    ``trajectory_id`` is ``str(index)`` (the position in ``samples`` when ``index`` is
    None; unique), ``group_id`` is ``str(group_index)`` (required). The prompt is
    ``tokens[:len(tokens) - response_length]``. Every ``rollout_routed_experts`` row is
    captured (slime gives ``len(tokens) - 1`` rows). ``rollout_log_probs`` (one per
    response token) becomes the float32 column ``rollout_logprobs`` when a sample has
    it. Every other
    field not None in some sample becomes an extra column of its ``to_dict()`` values,
    as JSON text where Arrow would not give them back unchanged (dicts with differing
    keys, say); ``ignore`` leaves fields out. Raises `TypeError` for a bad spec,
    `SchemaError` (bad ids, lengths, values or a field neither carries, dict reward
    without ``reward_key``), `RouteShapeError` (no routes, wrong shape, more rows than
    tokens), `ExpertRangeError`, `DuplicateExpertError`, `TerminalGapError`, each with
    ``row`` set.
    """
    if not isinstance(spec, RouteSpec):
        raise TypeError(f"spec: expected a RouteSpec, found {type(spec).__name__}")
    rows = len(samples)
    fields = [_fields(s, i) for i, s in enumerate(samples)]
    index = [f.get("index") for f in fields]
    tids = id_strings([i if v is None else v for i, v in enumerate(index)], "samples.index")
    check_unique(tids, "samples.index")
    gids = id_strings([f.get("group_index") for f in fields], "samples.group_index")
    prompts: list[np.ndarray] = []
    responses: list[np.ndarray] = []
    masks: list[np.ndarray] = []
    rewards = np.empty(rows, dtype=np.float64)
    routes: list[np.ndarray] = []
    logprobs: list[np.ndarray | None] = []
    for i, f in enumerate(fields):  # one iteration per trajectory; tokens stay vectorised
        tokens = vector(f.get("tokens"), f"samples[{i}].tokens", i, "int")
        rlen = f.get("response_length")
        if isinstance(rlen, bool) or not isinstance(rlen, int) or not 0 <= rlen <= len(tokens):
            raise SchemaError(
                f"samples[{i}]: expected 0 <= response_length <= len(tokens)={len(tokens)}, "
                f"found {rlen!r:.80}",
                row=i,
            )
        split = len(tokens) - rlen
        prompts.append(tokens[:split])
        responses.append(tokens[split:])
        mask = f.get("loss_mask")
        masks.append(
            np.ones(rlen, dtype=np.uint8)
            if mask is None
            else vector(mask, f"samples[{i}].loss_mask", i, "mask")
        )
        rewards[i] = _reward(f.get("reward"), reward_key, i)
        experts = f.get("rollout_routed_experts")
        if experts is None:
            raise RouteShapeError(
                f"samples[{i}].rollout_routed_experts: expected [len(tokens) - 1, "
                f"{spec.num_layers}, {spec.topk}] routes, found None",
                row=i,
            )
        try:
            arr = np.asarray(host(experts))
        except (TypeError, ValueError, OverflowError, RuntimeError) as exc:
            raise RouteShapeError(
                f"samples[{i}].rollout_routed_experts: expected an integer array, found {exc}",
                row=i,
            ) from exc
        routes.append(arr.reshape(0, *spec.row_shape).astype(spec.dtype) if not arr.size else arr)
        lp = f.get(LOGPROBS_FIELD)
        if lp is not None:
            lp = vector(lp, f"samples[{i}].{LOGPROBS_FIELD}", i, "float").astype(np.float32)
            if len(lp) != rlen:
                raise SchemaError(
                    f"samples[{i}].{LOGPROBS_FIELD}: expected one per response token "
                    f"({rlen}), found {len(lp)}",
                    row=i,
                )
        logprobs.append(lp)
    extra: dict[str, Any] = {}
    if any(lp is not None for lp in logprobs):
        extra[ROLLOUT_LOGPROBS] = pa.array(logprobs, type=pa.large_list(pa.float32()))
    as_json: list[str] = []
    names = dict.fromkeys(n for f in fields for n in f)
    for name in [n for n in names if n not in MAPPED_FIELDS and n not in ignore]:
        if not isinstance(name, str):
            raise SchemaError(f"samples: expected field names as strings, found {name!r:.80}")
        values = [_plain(f.get(name)) for f in fields]
        if all(v is None for v in values):
            continue  # slime's default for every optional field: nothing to carry
        extra[name], is_json = _carried(name, values)
        if is_json:
            as_json.append(name)
    table = rollout_table(
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
    if not as_json:
        return table
    meta = {**(table.schema.metadata or {}), _JSON_KEY: orjson.dumps(as_json)}
    out: pa.Table = table.replace_schema_metadata(meta)
    return out


def _group_index(value: str) -> int | str:
    return int(value) if value.lstrip("-").isdigit() else value


def _extras(table: pa.Table) -> dict[str, list[Any]]:
    """Each extra column's values as the ``Sample`` field it came from."""
    try:
        as_json = orjson.loads((table.schema.metadata or {}).get(_JSON_KEY, b"[]"))
    except orjson.JSONDecodeError as exc:
        raise SchemaError(f"metadata {_JSON_KEY.decode()!r}: expected a JSON list") from exc
    out: dict[str, list[Any]] = {}
    for name in table.schema.names:
        if name in ROLLOUT_COLUMNS or name == ROLLOUT_LOGPROBS:
            continue
        if name in MAPPED_FIELDS:
            raise ValueError(
                f"extra column {name!r}: collides with the Sample field to_samples writes "
                f"from the rollout columns; rename it"
            )
        values = table.column(name).to_pylist()
        if name in as_json:
            try:
                values = [None if v is None else orjson.loads(v) for v in values]
            except (orjson.JSONDecodeError, TypeError) as exc:
                raise SchemaError(f"column {name!r}: expected JSON text, found {exc}") from exc
        out[name] = values
    return out


def to_samples(table: pa.Table, *, fill_gap: bool = False, as_dataclass: str = "auto") -> list[Any]:
    """slime samples from a rollout table, one per trajectory, in table order.

    Each carries ``tokens`` (prompt + response, list[int]), ``response_length``,
    ``loss_mask`` (list[int]), ``reward`` (float), ``index`` and ``group_index`` (int
    when the id is an integer string, else the string), ``rollout_log_probs`` (from the
    table's ``rollout_logprobs`` column, else None), ``rollout_routed_experts``: int32
    ``[len(tokens) - 1, L, K]`` (numpy in a dict, a torch tensor in slime's ``Sample``),
    and one field per other extra column (`from_samples`' unmapped fields; one named like
    a field above raises ``ValueError``).

    ``as_dataclass``: ``"auto"`` returns ``slime.utils.types.Sample`` objects (through
    ``Sample.from_dict``, slime's defaults for fields not carried) when slime imports and
    its ``to_dict()`` form otherwise; ``"dict"`` always dicts; ``"slime"`` requires slime.
    A trajectory with fewer than ``len(tokens) - 1`` captured rows raises
    `RouteShapeError` (``row``, ``trajectory_id`` set) unless ``fill_gap`` fills the gap
    with dummy rows; one with ``len(tokens)`` rows (the last token routed) always raises,
    since slime cannot hold it.
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
    extras = _extras(table)
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
        table.column(ROLLOUT_LOGPROBS).to_pylist()
        if ROLLOUT_LOGPROBS in table.column_names
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
            LOGPROBS_FIELD: logprobs[i],
            "rollout_routed_experts": experts,
            **{name: column[i] for name, column in extras.items()},
        }
        if sample_type is not None:
            import torch

            fields["rollout_routed_experts"] = torch.from_numpy(experts)
            samples.append(sample_type.from_dict({**sample_type().to_dict(), **fields}))
        else:
            samples.append(fields)
    return samples
