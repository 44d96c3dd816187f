"""verl 0.9.1 ``DataProto`` <-> r3arrow rollout table.

verl's padded layout (``prompts``, ``responses``, ``attention_mask``, ``response_mask``,
``rm_scores``, int16 ``routed_experts`` ``[b, S, L, K]`` aligned with ``input_ids``; the
``uid`` group; no captured count) and how each key maps: ``docs/frameworks/verl.md``.
`to_dataproto` writes exactly that layout plus ``trajectory_id``, `CAPTURED_KEY` and the
table's schema in ``meta_info`` (`SCHEMA_KEY`), so both round trips are exact. Vectorised
over tokens; verl and tensordict are imported inside the functions; torch is required.
Argument misuse raises ``ValueError`` / ``TypeError``; bad data in a ``DataProto`` (its
tensors, non-tensor keys and ``meta_info``) raises `SchemaError` / `RouteShapeError`
(``row`` set where a trajectory is at fault), plus the checks of `rollout_table`.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable, Collection, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import orjson
import pyarrow as pa

from r3arrow._extras import require

with require(extra="torch", feature="r3arrow.adapters.verl"):
    import torch

from r3arrow._schema import ROLLOUT_COLUMNS, ROLLOUT_LOGPROBS, TRAIN_LOGPROBS, list_lengths
from r3arrow._validated import is_validated, mark_validated
from r3arrow.adapters._arrays import check_unique, flat_values, id_strings, scatter
from r3arrow.errors import RouteShapeError, SchemaError
from r3arrow.spec import RouteSpec
from r3arrow.table import (
    captured_lengths,
    flat_routes,
    rollout_table,
    route_spec,
    validate_rollouts,
)

#: Non-tensor key of each trajectory's captured route rows (int64), for exact round trips.
CAPTURED_KEY = "r3_captured"
#: ``meta_info`` key of the table's Arrow schema (IPC bytes).
SCHEMA_KEY = "r3arrow.schema"
#: Non-tensor key of the trajectory ids written by `to_dataproto`.
TRAJECTORY_KEY = "trajectory_id"
#: Non-tensor key of the GRPO group (verl's ``uid``).
GROUP_KEY = "uid"
#: Batch keys of verl's layout, rebuilt by `to_dataproto` (never extra columns).
LAYOUT_KEYS: tuple[str, ...] = (
    "prompts",
    "responses",
    "input_ids",
    "attention_mask",
    "position_ids",
    "response_mask",
    "rm_scores",
    "routed_experts",
)
# verl's log-prob batch keys and the rollout-table columns they are (both ways).
_LOGPROB_COLUMNS = {"rollout_log_probs": ROLLOUT_LOGPROBS, "old_log_probs": TRAIN_LOGPROBS}
_LOGPROB_KEYS = {column: key for key, column in _LOGPROB_COLUMNS.items()}

# Schema metadata: each extra column's kind and dtype in a DataProto, for the way back.
_META_KEY = b"r3arrow.verl.keys"
_ROUTES_DTYPE = torch.int16
_INSTALL = (
    "verl is not installed: pip install verl (DataProto alone: pip install --no-deps "
    "verl==0.9.1 'tensordict>=0.8,<=0.10,!=0.9.0' omegaconf)"
)


def _np(value: Any, name: str) -> np.ndarray:
    if not isinstance(value, torch.Tensor):
        found = type(value).__name__
        raise SchemaError(f"batch[{name!r}]: expected a torch.Tensor, found {found}")
    if value.is_nested:
        raise SchemaError(f"batch[{name!r}]: expected a padded tensor, found a nested one")
    if value.dtype == torch.bfloat16:
        raise SchemaError(f"batch[{name!r}]: bfloat16 has no numpy dtype; cast it first")
    return np.asarray(value.detach().cpu().numpy())


def _shape(arr: np.ndarray, want: tuple[int, ...], name: str, kind: str) -> None:
    if arr.shape != want or arr.dtype.kind not in kind:
        kinds = {"iu": "integer", "iub": "integer", "f": "float"}.get(kind, kind)
        raise SchemaError(
            f"batch[{name!r}]: expected {kinds} {list(want)}, found {arr.dtype} {list(arr.shape)}"
        )


def _first(mask: np.ndarray) -> tuple[int, int]:
    r, c = np.argwhere(mask)[0]
    return int(r), int(c)


def _none_bad(bad: np.ndarray, message: Callable[[int, int], str]) -> None:
    """`SchemaError` ``message(r, c)`` (``row=r``) at the first True ``[r, c]`` of ``bad``."""
    if bad.any():
        r, c = _first(bad)
        raise SchemaError(message(r, c), row=r)


def _binary(arr: np.ndarray, name: str) -> np.ndarray:
    _none_bad(
        (arr != 0) & (arr != 1),
        lambda r, c: f"batch[{name!r}]: expected 0/1, found {arr[r, c]} at row {r}, token {c}",
    )
    return arr.astype(bool)


def _padding(mask: np.ndarray, side: str, name: str) -> None:
    """``mask`` rows are 0..0 1..1 (left padding) or 1..1 0..0 (right padding)."""
    step = np.diff(mask.astype(np.int8), axis=1)
    _none_bad(
        step < 0 if side == "left" else step > 0,
        lambda r, c: (
            f"attention_mask over {name}: expected {side}-padding (a {side} run of zeros), "
            f"found a gap at row {r}, token {c + 1}"
        ),
    )


def _ragged(values: np.ndarray, lengths: np.ndarray) -> pa.LargeListArray[Any]:
    """Ragged rows of ``values``' own Arrow type (`rollout_table` casts, checked)."""
    offsets = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    return pa.LargeListArray.from_arrays(pa.array(offsets, type=pa.int64()), pa.array(values))


def _rows(non_tensor: Mapping[str, Any], key: str, rows: int, hint: str = "") -> np.ndarray:
    """``non_tensor_batch[key]`` as a ``[rows]`` array."""
    try:
        arr = np.asarray(non_tensor[key])
    except ValueError as exc:  # ragged
        raise SchemaError(
            f"non_tensor_batch[{key!r}]: expected [{rows}], found {exc}{hint}"
        ) from exc
    if arr.shape != (rows,):
        raise SchemaError(
            f"non_tensor_batch[{key!r}]: expected [{rows}], found {list(arr.shape)}{hint}"
        )
    return arr


def _ids(non_tensor: Mapping[str, Any], key: str | None, rows: int) -> list[str] | None:
    if key is None or key not in non_tensor:
        return None
    return id_strings(_rows(non_tensor, key, rows).tolist(), f"non_tensor_batch[{key!r}]")


def _captured(
    captured: Any, non_tensor: Mapping[str, Any], routes: np.ndarray, window: np.ndarray
) -> np.ndarray:
    """Captured rows per trajectory: the argument, `CAPTURED_KEY`, or verl's rule."""
    attended = window.sum(axis=1)
    name: str = "captured"
    error: type[ValueError] = ValueError
    if captured is None and CAPTURED_KEY in non_tensor:
        captured, name, error = (
            non_tensor[CAPTURED_KEY],
            f"non_tensor_batch[{CAPTURED_KEY!r}]",
            SchemaError,
        )
    if isinstance(captured, str):
        if captured != "nonzero":
            raise ValueError(f"captured: expected None, 'nonzero' or counts, found {captured!r}")
        # The engine never writes an all-zero row where topk > 1 (experts are distinct).
        row_width = routes.shape[2] * routes.shape[3]
        written = routes.reshape(*routes.shape[:2], row_width).any(axis=2) & window
        pos = np.arange(window.shape[1])
        last = np.where(written, pos, -1).max(axis=1, initial=-1)
        first = np.argmax(window, axis=1)
        return np.where(last >= 0, last - first + 1, 0).astype(np.int64)
    if captured is None:  # verl replays every attended row but the last
        rule: np.ndarray = np.maximum(attended - 1, 0).astype(np.int64)
        return rule
    try:
        counts = np.asarray(captured)
    except ValueError:  # ragged
        counts = np.asarray(None)
    if counts.shape != attended.shape or counts.dtype.kind not in "iu":
        raise error(
            f"{name}: expected {attended.size} integer counts, found "
            f"{counts.dtype} {list(counts.shape)}"
        )
    bad = np.flatnonzero((counts < 0) | (counts > attended))
    if bad.size:
        i = int(bad[0])
        raise error(f"{name}[{i}]: expected 0..{attended[i]} (attended), found {counts[i]}")
    return counts.astype(np.int64)


@contextlib.contextmanager
def _arrow_values(where: str, hint: str) -> Iterator[None]:
    """`SchemaError` for values Arrow cannot hold (a complex dtype, mixed objects, ...)."""
    try:
        yield
    except (pa.ArrowException, TypeError, OverflowError) as exc:
        raise SchemaError(f"{where}: expected values Arrow can hold, found {exc}{hint}") from exc


def _extras(
    batch: Any,
    non_tensor: Mapping[str, Any],
    rows: int,
    resp: np.ndarray,
    rlen: np.ndarray,
    skip: Collection[str | None],
) -> tuple[dict[str, pa.Array[Any]], dict[str, dict[str, str]]]:
    """Extra columns from the remaining keys, and how each travels back."""
    cols: dict[str, pa.Array[Any]] = {}
    meta: dict[str, dict[str, str]] = {}
    keys = [
        (f"batch[{n!r}]", n, True)
        for n in batch.keys()  # noqa: SIM118 - iterating a TensorDict walks its rows
        if n not in LAYOUT_KEYS and n not in skip
    ]
    keys += [(f"non_tensor_batch[{n!r}]", n, False) for n in non_tensor if n not in skip]
    for where, name, is_tensor in keys:
        hint = f" (pass ignore=[{name!r}] to leave it out)"
        if name in cols or name in ROLLOUT_COLUMNS:
            raise SchemaError(f"{where}: collides with a column of that name{hint}")
        if not is_tensor:
            arr = _rows(non_tensor, name, rows, hint)
            with _arrow_values(where, hint):
                cols[name] = pa.array(arr.tolist() if arr.dtype == object else arr)
            meta[name] = {
                "kind": "non_tensor",
                "dtype": "O" if arr.dtype == object else arr.dtype.str,
            }
            continue
        tensor = batch[name]
        arr = _np(tensor, name)
        if arr.shape not in ((rows,), resp.shape):
            raise SchemaError(
                f"{where}: expected [{rows}] or {list(resp.shape)} for an extra column, "
                f"found {list(arr.shape)}{hint}"
            )
        with _arrow_values(where, hint):
            cols[name] = pa.array(arr) if arr.ndim == 1 else _ragged(arr[resp], rlen)
        meta[name] = {"kind": "scalar" if arr.ndim == 1 else "response", "dtype": str(tensor.dtype)}
    return cols, meta


def from_dataproto(
    data: Any,
    spec: RouteSpec,
    *,
    captured: Sequence[int] | np.ndarray | str | None = None,
    pad_token_id: int | None = None,
    trajectory_key: str | None = TRAJECTORY_KEY,
    group_key: str | None = GROUP_KEY,
    ignore: Collection[str] = (),
) -> pa.Table:
    """Rollout table (one row per trajectory) from a ``DataProto`` in verl's layout.

    ``data.batch`` must hold ``prompts``, ``responses``, ``attention_mask``,
    ``response_mask``, ``rm_scores`` and ``routed_experts`` (``(L, K) == spec.row_shape``);
    ``input_ids`` / ``position_ids``, where present, must follow verl's rules; with
    ``pad_token_id`` the padding must hold it. ``reward`` is ``rm_scores`` summed (a score
    anywhere but the last response token raises); ``trajectory_id`` /  ``group_id`` come
    from ``non_tensor_batch[trajectory_key]`` (else the row index) / ``[group_key]`` (else
    the trajectory id). ``routes``: the first ``captured[i]`` attended rows, with
    ``captured`` counts, ``"nonzero"`` (up to the last row the engine wrote) or ``None``
    (`CAPTURED_KEY` if present, else every attended row but the last); a nonzero row
    outside them raises `RouteShapeError`. Other batch keys ``[b]`` or ``[b, R]`` and 1-d
    non-tensor keys become extra columns (anything else raises ``ValueError`` unless in
    ``ignore``); `SCHEMA_KEY` in ``meta_info`` restores their types, order and user schema
    metadata (the rest of ``meta_info`` is not carried).
    """
    if not hasattr(data, "batch") or not isinstance(
        getattr(data, "non_tensor_batch", None), Mapping
    ):
        raise TypeError(f"data: expected a verl DataProto, found {type(data).__name__}")
    batch, non_tensor = data.batch, data.non_tensor_batch
    if batch is None:
        raise SchemaError("data.batch: expected verl's tensors, found None")
    keys = set(batch.keys())
    need = ("prompts", "responses", "attention_mask", "response_mask", "rm_scores")
    missing = [k for k in (*need, "routed_experts") if k not in keys]
    if missing:
        raise SchemaError(
            f"batch: expected keys {list(need)} and 'routed_experts', missing {missing}"
        )
    prompts = _np(batch["prompts"], "prompts")
    if prompts.ndim != 2:
        raise SchemaError(f"batch['prompts']: expected [b, P], found {list(prompts.shape)}")
    rows, plen_max = prompts.shape
    responses = _np(batch["responses"], "responses")
    if responses.ndim != 2 or responses.shape[0] != rows:
        raise SchemaError(
            f"batch['responses']: expected [{rows}, R], found {list(responses.shape)}"
        )
    rlen_max = responses.shape[1]
    seq = plen_max + rlen_max
    _shape(prompts, (rows, plen_max), "prompts", "iu")
    _shape(responses, (rows, rlen_max), "responses", "iu")
    att = _np(batch["attention_mask"], "attention_mask")
    _shape(att, (rows, seq), "attention_mask", "iub")
    rmask = _np(batch["response_mask"], "response_mask")
    _shape(rmask, (rows, rlen_max), "response_mask", "iub")
    scores = _np(batch["rm_scores"], "rm_scores")
    _shape(scores, (rows, rlen_max), "rm_scores", "f")
    routes = _np(batch["routed_experts"], "routed_experts")
    _shape(routes, (rows, seq, *spec.row_shape), "routed_experts", "iu")

    attended = _binary(att, "attention_mask")
    prompt_att, resp_att = attended[:, :plen_max], attended[:, plen_max:]
    _padding(prompt_att, "left", "prompts")
    _padding(resp_att, "right", "responses")
    loss = _binary(rmask, "response_mask")
    _none_bad(
        loss & ~resp_att,
        lambda r, c: (
            f"batch['response_mask']: expected 0 on response padding, found 1 at row {r}, "
            f"response token {c}"
        ),
    )
    tokens = np.concatenate([prompts, responses], axis=1)
    if "input_ids" in keys:
        ids = _np(batch["input_ids"], "input_ids")
        if ids.shape != tokens.shape or not np.array_equal(ids, tokens):
            raise SchemaError("batch['input_ids']: expected the concatenation prompts + responses")
    if "position_ids" in keys:
        pos = _np(batch["position_ids"], "position_ids")
        want = np.maximum(np.cumsum(att.astype(np.int64), axis=1) - 1, 0)
        if pos.shape != want.shape:
            raise SchemaError(
                f"batch['position_ids']: expected [{rows}, {seq}] (text-only positions), "
                f"found {list(pos.shape)}"
            )
        if not np.array_equal(pos, want):
            raise SchemaError("batch['position_ids']: expected clip(cumsum(attention_mask) - 1, 0)")
    if pad_token_id is not None:
        _none_bad(
            ~attended & (tokens != pad_token_id),
            lambda r, c: (
                f"padding: expected pad id {pad_token_id}, found {tokens[r, c]} at row {r}, "
                f"token {c}"
            ),
        )
    plen, rlen = prompt_att.sum(axis=1), resp_att.sum(axis=1)
    # The score sits at the last response token (index rlen - 1, wrapping like verl's).
    last = np.zeros_like(resp_att)
    if rlen_max:
        last[np.arange(rows), (rlen - 1) % rlen_max] = True
    _none_bad(
        (scores != 0) & ~last,
        lambda r, c: (
            f"batch['rm_scores']: expected the score at the last response token only, found "
            f"{scores[r, c]} at row {r}, response token {c}"
        ),
    )
    counts = _captured(captured, non_tensor, routes, attended)
    pos_in_seq = np.arange(seq) - (plen_max - plen)[:, None]
    window = attended & (pos_in_seq < counts[:, None])
    stray = ~window & routes.reshape(rows, seq, routes.shape[2] * routes.shape[3]).any(axis=2)
    if stray.any():
        r, c = _first(stray)
        raise RouteShapeError(
            f"routed_experts: row {r} has a nonzero route at token {int(pos_in_seq[r, c])} "
            f"outside its {counts[r]} captured rows (pass captured= to keep it)",
            row=r,
            token=int(pos_in_seq[r, c]),
        )
    flat = routes[window]
    if spec.topk > 1 and flat.size:  # distinct experts: a real row is never all zero
        blank = ~flat.reshape(flat.shape[0], -1).any(axis=1)
        if blank.any():
            k = int(np.flatnonzero(blank)[0])
            r = int(np.searchsorted(np.cumsum(counts), k, side="right"))
            token = k - int(np.cumsum(counts)[r] - counts[r])
            raise RouteShapeError(
                f"routed_experts: row {r} has no route at token {token}, inside its {counts[r]} "
                f"captured rows (verl's rule replays all attended rows but the last; pass "
                f"captured='nonzero' when the engine stopped earlier, e.g. on observations)",
                row=r,
                token=token,
            )
    parts = np.split(flat, np.cumsum(counts)[:-1]) if rows else []
    # the keys the core columns came from are no extras
    skip = {*ignore, CAPTURED_KEY, trajectory_key, group_key}
    extra, meta = _extras(batch, non_tensor, rows, resp_att, rlen, skip - {None})
    for key, column in _LOGPROB_COLUMNS.items():
        if key in extra and column in extra:
            raise SchemaError(f"batch[{key!r}] and batch[{column!r}]: both would be {column!r}")
    extra = {_LOGPROB_COLUMNS.get(k, k): v for k, v in extra.items()}
    meta = {_LOGPROB_COLUMNS.get(k, k): v for k, v in meta.items()}
    stored = _stored_schema(getattr(data, "meta_info", None))
    extra, user_meta = _restore(extra, stored)
    tid = _ids(non_tensor, trajectory_key, rows) or [str(i) for i in range(rows)]
    check_unique(tid, f"non_tensor_batch[{trajectory_key!r}]")
    gid = _ids(non_tensor, group_key, rows) or tid
    table = rollout_table(
        trajectory_id=tid,
        group_id=gid,
        prompt_ids=_ragged(prompts[prompt_att], plen),
        response_ids=_ragged(responses[resp_att], rlen),
        loss_mask=_ragged(loss[resp_att].astype(np.uint8), rlen),
        reward=scores.sum(axis=1, dtype=np.float64),
        routes=parts,
        spec=spec,
        **extra,
    )
    metadata = {**(table.schema.metadata or {}), **user_meta}
    # The kinds travel only where they matter: a table whose extras were all non-tensor
    # keys (built by rollout_table, say) reads back without them, exactly as it was.
    tensor_kinds = any(how["kind"] != "non_tensor" for how in meta.values())
    if meta and (tensor_kinds or stored is None or _META_KEY in (stored.metadata or {})):
        metadata[_META_KEY] = orjson.dumps(meta)
    if metadata == table.schema.metadata:
        return table
    out: pa.Table = mark_validated(table.replace_schema_metadata(metadata))
    return out


def _stored_schema(meta_info: Any) -> pa.Schema | None:
    """The table schema `to_dataproto` left in ``meta_info`` (None if absent)."""
    if not isinstance(meta_info, Mapping) or SCHEMA_KEY not in meta_info:
        return None
    raw = meta_info[SCHEMA_KEY]
    if not isinstance(raw, bytes):
        raise SchemaError(f"meta_info[{SCHEMA_KEY!r}]: expected bytes, found {type(raw).__name__}")
    try:
        schema = pa.ipc.read_schema(pa.py_buffer(raw))
        _ = schema.names  # names that are no UTF-8 raise here, not later
    except (pa.ArrowException, OSError, UnicodeDecodeError) as exc:
        raise SchemaError(
            f"meta_info[{SCHEMA_KEY!r}]: expected an Arrow schema, found {exc}"
        ) from exc
    return schema


def _restore(
    extra: dict[str, pa.Array[Any]], stored: pa.Schema | None
) -> tuple[dict[str, pa.Array[Any]], dict[bytes, bytes]]:
    """Extras in the stored schema's order and types; its user metadata (``{}`` if none)."""
    if stored is None:
        return extra, {}
    types = {f.name: f.type for f in stored}
    ordered: dict[str, pa.Array[Any]] = {}
    for name in [n for n in types if n in extra] + [n for n in extra if n not in types]:
        arr = extra[name]
        if name in types and arr.type != types[name]:
            # Arrow types numpy cannot tell apart (large_string vs string, ...); a column
            # whose data changed since no longer casts: it keeps what it holds now
            with contextlib.suppress(pa.ArrowException):
                arr = arr.cast(types[name])
        ordered[name] = arr
    # r3arrow's own keys (spec, schema version, key kinds) are rebuilt, not copied
    user = {k: v for k, v in (stored.metadata or {}).items() if not k.startswith(b"r3arrow.")}
    return ordered, user


def _dense(
    col: Any, shape: tuple[int, ...], start: np.ndarray, fill: Any, dtype: Any = None
) -> np.ndarray:
    """The ragged column ``col`` into a ``shape`` array, row ``i`` from ``start[i]`` on."""
    return scatter(flat_values(col), list_lengths(col), start, shape, fill, dtype)


def _width(lengths: np.ndarray, given: int | None, name: str) -> int:
    longest = int(lengths.max(initial=0))
    if given is None:
        return longest
    if isinstance(given, bool) or not isinstance(given, int) or given < 0:
        raise ValueError(f"{name}: expected a non-negative int or None, found {given!r}")
    if longest > given:
        i = int(np.argmax(lengths))
        raise ValueError(f"{name}: row {i} has {longest} tokens, more than {name}={given}")
    return given


def to_dataproto(
    table: pa.Table,
    *,
    pad_token_id: int,
    max_prompt_length: int | None = None,
    max_response_length: int | None = None,
) -> Any:
    """A verl ``DataProto`` in the agent loop's layout (module docstring) from a rollout table.

    Prompts left-padded to ``max_prompt_length``, responses right-padded to
    ``max_response_length`` with ``pad_token_id`` (``None``: the longest; a longer row
    raises ``ValueError``, never truncated). ``routed_experts``: int16, the captured rows
    from the first attended token on, zeros elsewhere; ``rm_scores``: the reward as float32
    at the last response token. ``non_tensor_batch``: ``uid``, ``trajectory_id``,
    `CAPTURED_KEY`, and the extra columns (back to the batch keys they came from, as
    `from_dataproto` recorded; one named like a key written here raises ``ValueError``).
    ``meta_info[SCHEMA_KEY]``: the table's schema, so ``from_dataproto(to_dataproto(t))``
    equals ``t`` (verl's ``concat`` asserts equal ``meta_info``: one schema per batch).
    Requires verl and tensordict; the table is validated first unless r3arrow built it.
    """
    try:
        protocol = importlib.import_module("verl.protocol")
    except ImportError as exc:
        raise ImportError(_INSTALL) from exc
    tensordict = importlib.import_module("tensordict")
    if isinstance(pad_token_id, bool) or not isinstance(pad_token_id, int):
        raise TypeError(f"pad_token_id: expected an int, found {pad_token_id!r}")
    if not is_validated(table):
        validate_rollouts(table)
    spec = route_spec(table)
    if spec.num_experts is not None and spec.num_experts > torch.iinfo(_ROUTES_DTYPE).max + 1:
        raise ValueError(f"spec: verl stores expert ids as int16, found {spec.num_experts} experts")
    rows = table.num_rows
    plen = list_lengths(table.column("prompt_ids"))
    rlen = list_lengths(table.column("response_ids"))
    width_p = _width(plen, max_prompt_length, "max_prompt_length")
    width_r = _width(rlen, max_response_length, "max_response_length")
    if width_r == 0 and rows:
        raise ValueError("max_response_length: verl's rm_scores need at least one response column")
    start = (width_p - plen).astype(np.int64)
    zeros = np.zeros(rows, dtype=np.int64)
    prompts = _dense(table.column("prompt_ids"), (rows, width_p), start, pad_token_id, np.int64)
    responses = _dense(table.column("response_ids"), (rows, width_r), zeros, pad_token_id, np.int64)
    rmask = _dense(table.column("loss_mask"), (rows, width_r), zeros, 0, np.int64)
    resp_att = np.arange(width_r)[None, :] < rlen[:, None]
    prompt_att = np.arange(width_p)[None, :] >= start[:, None]
    att = np.concatenate([prompt_att, resp_att], axis=1).astype(np.int64)
    flat, offsets = flat_routes(table)
    shape = (rows, width_p + width_r, *spec.row_shape)
    routes = scatter(flat, np.diff(offsets), start, shape, 0, np.int16)
    scores = np.zeros((rows, width_r), dtype=np.float32)
    if rows:
        reward = table.column("reward").to_numpy().astype(np.float32)
        scores[np.arange(rows), (rlen - 1) % width_r] = reward
    tensors: dict[str, torch.Tensor] = {
        "prompts": torch.from_numpy(prompts),
        "responses": torch.from_numpy(responses),
        "response_mask": torch.from_numpy(rmask),
        "input_ids": torch.from_numpy(np.concatenate([prompts, responses], 1)),
        "attention_mask": torch.from_numpy(att),
        "position_ids": torch.from_numpy(np.maximum(np.cumsum(att, axis=1) - 1, 0)),
        "routed_experts": torch.from_numpy(routes),
        "rm_scores": torch.from_numpy(scores),
    }
    non_tensor: dict[str, np.ndarray] = {
        GROUP_KEY: _objects(table.column("group_id")),
        TRAJECTORY_KEY: _objects(table.column("trajectory_id")),
        CAPTURED_KEY: captured_lengths(table),
    }
    meta = orjson.loads((table.schema.metadata or {}).get(_META_KEY, b"{}"))
    for name in table.schema.names:
        if name in ROLLOUT_COLUMNS:
            continue
        if name in non_tensor:
            raise ValueError(
                f"extra column {name!r}: collides with the non-tensor key to_dataproto writes "
                f"{'the group ids' if name == GROUP_KEY else 'its own ids'} to; rename it"
            )
        how = meta.get(name, {"kind": "non_tensor", "dtype": None})
        column = table.column(name)
        key = _LOGPROB_KEYS.get(name, name)
        if how["kind"] == "non_tensor":
            non_tensor[key] = _non_tensor(column, how["dtype"])
            continue
        dtype = getattr(torch, how["dtype"].removeprefix("torch."))
        if how["kind"] == "scalar":
            # a copy: Arrow's buffers are read-only and torch wants writable memory
            tensors[key] = torch.from_numpy(np.array(column.to_numpy())).to(dtype)
        else:
            tensors[key] = torch.from_numpy(_dense(column, (rows, width_r), zeros, 0)).to(dtype)
    batch = tensordict.TensorDict(tensors, batch_size=[rows])
    # The schema rides in meta_info so from_dataproto restores extra column types and user
    # metadata exactly (Arrow IPC schema bytes: no pickle).
    schema = table.schema.serialize().to_pybytes()
    return protocol.DataProto(
        batch=batch, non_tensor_batch=non_tensor, meta_info={SCHEMA_KEY: schema}
    )


def _objects(column: pa.ChunkedArray[Any]) -> np.ndarray:
    out = np.empty(len(column), dtype=object)
    out[:] = column.to_pylist()
    return out


def _non_tensor(column: pa.ChunkedArray[Any], dtype: str | None) -> np.ndarray:
    if dtype is None:  # a column r3arrow did not read from a DataProto
        typ = column.type
        numeric = pa.types.is_integer(typ) or pa.types.is_floating(typ) or pa.types.is_boolean(typ)
        if numeric and not column.null_count:
            return np.array(column.to_numpy())
        return _objects(column)
    if dtype == "O":
        return _objects(column)
    return np.array(column.to_numpy(), dtype=np.dtype(dtype))


__all__ = ["CAPTURED_KEY", "from_dataproto", "to_dataproto"]
