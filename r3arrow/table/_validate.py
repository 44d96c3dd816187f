"""`validate_rollouts`: the table-level rules every trust boundary checks.

The rules (``docs/design.md``, "Ragged routes and the terminal gap", "Expert ids" and "The
Arrow data model"), all vectorised over the whole table, checked in this order so that
the first message names the real problem:

1. Columns and types of schema rollout.v1. With a ``routes`` column the schema must carry
   the spec (``r3arrow.spec``); without one (R3 off) it must not.
2. No nulls: ``trajectory_id``, ``group_id``, ``reward``; no null list and no null value
   in ``prompt_ids``, ``response_ids`` and ``loss_mask``; no null at any nesting level of
   ``routes`` (trajectory, token, layer row, expert id). Checked with ``null_count`` per
   level and chunk; locating the first null runs only on failure.
3. ``len(loss_mask) == len(response_ids)`` and ``len(routes) <= len(prompt_ids) +
   len(response_ids)`` per trajectory.
4. Expert ids (`r3arrow.ids.check_routes`, on the flat routes of each chunk): in range on
   router layers, within the storage dtype everywhere, distinct on router layers.
5. The terminal gap: every loss-active response token has its predicting route row.

Every error is an `R3ArrowError` (`SchemaError`, `RouteShapeError`, `ExpertRangeError`,
`DuplicateExpertError`, `TerminalGapError`) with ``row`` and ``trajectory_id`` set when a
trajectory is at fault, and ``token`` / ``layer`` where they apply.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, NoReturn, overload

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from r3arrow._coverage import first_terminal_gap_rows, terminal_gap_error
from r3arrow._schema import (
    has_routes,
    list_lengths,
    rollout_schema,
    route_spec,
    trajectory_id_at,
)
from r3arrow._typing import TableLike
from r3arrow.errors import R3ArrowError, RouteShapeError, SchemaError
from r3arrow.ids import check_routes
from r3arrow.spec import SPEC_METADATA_KEY, RouteSpec, routes_to_numpy

_SCALARS = ("trajectory_id", "group_id", "reward")
_LISTS = {"prompt_ids": "token ids", "response_ids": "token ids", "loss_mask": "mask values"}
_ROUTE_LEVELS = ("trajectory rows", "tokens", "layer rows", "expert ids")


def _chunks(col: pa.Array[Any] | pa.ChunkedArray[Any]) -> list[pa.Array[Any]]:
    return list(col.chunks) if isinstance(col, pa.ChunkedArray) else [col]


def _first_null(arr: pa.Array[Any]) -> int:
    return int(np.flatnonzero(pc.is_null(arr).to_numpy(zero_copy_only=False))[0])


def _row_of(list_chunk: pa.Array[Any], value_index: int) -> tuple[int, int]:
    """(row in the chunk, position in that row) of flattened value ``value_index``."""
    offsets = np.asarray(list_chunk.offsets, dtype=np.int64)  # type: ignore[attr-defined]
    offsets = offsets - offsets[0]
    row = int(np.searchsorted(offsets, value_index, side="right")) - 1
    return row, value_index - int(offsets[row])


def _null_error(
    table: TableLike, name: str, what: str, count: int, row: int, **at: int
) -> NoReturn:
    """Raise the `SchemaError` for ``count`` nulls in ``name``, the first in ``row``."""
    where = ", ".join([f"row {row}", *(f"{k} {v}" for k, v in at.items())])
    raise SchemaError(
        f"{name}: expected no null {what}, found {count} (first: {where})",
        row=row,
        trajectory_id=trajectory_id_at(table, row) if name != "trajectory_id" else None,
        **at,
    )


def _check_nulls(table: TableLike, spec: RouteSpec | None, *, routes: bool = True) -> None:
    for name in _SCALARS:
        base = 0
        for ch in _chunks(table.column(name)):
            if ch.null_count:
                count = table.column(name).null_count
                _null_error(table, name, "values", count, base + _first_null(ch))
            base += len(ch)
    for name, what in _LISTS.items():
        base = 0
        for ch in _chunks(table.column(name)):
            if ch.null_count:
                _null_error(table, name, "rows", ch.null_count, base + _first_null(ch))
            values = pc.list_flatten(ch)
            if values.null_count:
                row, pos = _row_of(ch, _first_null(values))
                # The token field is the position in prompt + response (prompts are checked first).
                shift = 0 if name == "prompt_ids" else _prompt_length(table, base + row)
                _null_error(table, name, what, values.null_count, base + row, token=shift + pos)
            base += len(ch)
    if spec is not None and routes:
        _check_route_nulls(table, spec)


def _prompt_length(table: TableLike, row: int) -> int:
    value = pc.list_value_length(table.column("prompt_ids").slice(row, 1))[0].as_py()
    return int(value) if value is not None else 0


def _check_route_nulls(table: TableLike, spec: RouteSpec) -> None:
    """No null at any level of ``routes``: a null there would shift every later value."""
    num_layers, topk = spec.row_shape
    base = 0
    for ch in _chunks(table.column("routes")):
        level: pa.Array[Any] = ch
        for depth, what in enumerate(_ROUTE_LEVELS):
            if level.null_count:
                i = _first_null(level)
                if depth == 0:
                    _null_error(table, "routes", what, level.null_count, base + i)
                # Level 1 indexes tokens, 2 token * L + layer, 3 (token * L + layer) * K + k.
                inner = i // topk if depth == 3 else i
                flat_token = inner if depth == 1 else inner // num_layers
                row, token = _row_of(ch, flat_token)
                at = (
                    {"token": token}
                    if depth == 1
                    else {"token": token, "layer": inner % num_layers}
                )
                _null_error(table, "routes", what, level.null_count, base + row, **at)
            if depth < len(_ROUTE_LEVELS) - 1:  # flatten only a null-free level: exact
                level = pc.list_flatten(level)
        base += len(ch)


def _check_ids(table: TableLike, spec: RouteSpec, *, ids: Literal["all", "distinct"]) -> None:
    """`check_routes` (or only the distinct rule) per chunk; errors name row and trajectory."""
    base = 0
    for ch in _chunks(table.column("routes")):
        flat = routes_to_numpy(pc.list_flatten(ch), spec)
        try:
            check_routes(flat, spec, what="routes", rules=ids)
        except R3ArrowError as exc:  # failure path: re-check the trajectory for its own token
            row, _ = _row_of(ch, exc.token or 0)
            offsets = np.asarray(ch.offsets, dtype=np.int64)  # type: ignore[attr-defined]
            start, end = int(offsets[row] - offsets[0]), int(offsets[row + 1] - offsets[0])
            recheck_row(exc, table, flat[start:end], spec, base + row, rules=ids)
        base += len(ch)


def recheck_row(
    exc: R3ArrowError,
    table: TableLike,
    routes: np.ndarray,
    spec: RouteSpec,
    row: int,
    *,
    rules: Literal["all", "distinct"],
) -> NoReturn:
    """Re-check row ``row``'s ``routes`` after ``exc`` failed its chunk; raise for that row.

    The error raised names the trajectory's own token and carries ``row`` and its
    ``trajectory_id``.
    """
    tid = trajectory_id_at(table, row)
    try:
        check_routes(routes, spec, what=f"routes[{row}] (trajectory {tid!r})", rules=rules)
    except R3ArrowError as own:
        own.row, own.trajectory_id = row, tid
        raise own from None
    exc.row, exc.trajectory_id = row, tid  # pragma: no cover - re-check raises
    raise exc  # pragma: no cover


def raise_at_first(
    table: TableLike, bad: np.ndarray, error: type[R3ArrowError], message: Callable[[int], str]
) -> None:
    """Raise ``error(message(row), row=row, trajectory_id=...)`` at the first True of ``bad``.

    ``bad`` is a bool per row; nothing is raised when it holds no True.
    """
    rows = np.flatnonzero(bad)
    if rows.size:
        i = int(rows[0])
        raise error(message(i), row=i, trajectory_id=trajectory_id_at(table, i))


@overload
def validate_rollouts(table: TableLike, *, require_routes: Literal[True]) -> RouteSpec: ...
@overload
def validate_rollouts(table: TableLike, *, require_routes: bool = False) -> RouteSpec | None: ...
def validate_rollouts(table: TableLike, *, require_routes: bool = False) -> RouteSpec | None:
    """Check a rollout table against every rule of the module docstring; return its spec.

    Returns the table's `RouteSpec`, or ``None`` for an R3-off table (no ``routes``
    column, no spec metadata). With ``require_routes=True`` an R3-off table raises
    `SchemaError` instead (for consumers that replay routes). Raises the errors listed in
    the module docstring.
    """
    return validate_table(table, ids="all", require_routes=require_routes)


def validate_table(
    table: TableLike,
    *,
    ids: Literal["all", "distinct", "none"],
    require_routes: bool = False,
) -> RouteSpec | None:
    """`validate_rollouts` with a choice of id checks.

    ``ids``: ``"all"`` (range and distinct experts), ``"distinct"`` (the range was
    checked), ``"none"``: the routes were built by r3arrow from checked rows
    (`r3arrow.rollout_table`): neither the ids nor the routes' nulls are read (its routes
    column has no null at any level by construction); every other rule still runs.
    """
    meta = table.schema.metadata or {}
    if has_routes(table):
        spec: RouteSpec | None = route_spec(table)
    elif SPEC_METADATA_KEY in meta:
        raise SchemaError(
            f"expected column 'routes' (the schema carries r3arrow.spec; an R3-off table has "
            f"neither), found columns {table.schema.names}"
        )
    elif require_routes:
        raise SchemaError(
            f"expected a 'routes' column, found no routes column (R3 off; columns "
            f"{table.schema.names})"
        )
    else:
        spec = None
    for f in rollout_schema(spec):
        if f.name not in table.schema.names:
            raise SchemaError(
                f"expected column {f.name!r} ({f.type}), found columns {table.schema.names}"
            )
        found = table.schema.field(f.name).type
        if found != f.type:
            raise SchemaError(f"column {f.name!r}: expected {f.type}, found {found}")
    _check_nulls(table, spec, routes=ids != "none")
    plen = list_lengths(table.column("prompt_ids"))
    rlen = list_lengths(table.column("response_ids"))
    mlen = list_lengths(table.column("loss_mask"))
    raise_at_first(
        table,
        mlen != rlen,
        SchemaError,
        lambda i: (
            f"row {i}: expected loss_mask over the {rlen[i]} response tokens, found {mlen[i]}"
        ),
    )
    if spec is None:
        return None  # R3 off: nothing is replayed, so no route rule applies
    cap = list_lengths(table.column("routes"))
    raise_at_first(
        table,
        cap > plen + rlen,
        RouteShapeError,
        lambda i: (
            f"row {i}: expected at most {plen[i] + rlen[i]} route rows (tokens), found {cap[i]}"
        ),
    )
    if ids != "none":
        _check_ids(table, spec, ids=ids)
    _check_terminal_gap(table, plen, rlen, mlen, cap)
    return spec


def _check_terminal_gap(
    table: TableLike, plen: np.ndarray, rlen: np.ndarray, mlen: np.ndarray, cap: np.ndarray
) -> None:
    """A loss-active response token t (absolute position P + j) needs route row t - 1.

    `first_terminal_gap_rows` looks only at each row's uncovered tail (usually one token).
    """
    mask = table.column("loss_mask")
    flat = np.asarray(pc.list_flatten(mask).to_numpy(zero_copy_only=False))
    gap = first_terminal_gap_rows(flat, mlen, plen, cap) if flat.size else None
    if gap is not None:
        row, token = gap
        raise terminal_gap_error(
            token=token,
            captured=int(cap[row]),
            num_tokens=int(plen[row] + rlen[row]),
            trajectory_id=trajectory_id_at(table, row),
            row=row,
        )
