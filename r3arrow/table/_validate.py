"""`validate_rollouts`: the table-level rules every trust boundary checks, vectorised.

In this order, so the first message names the real problem (``docs/design.md``, "The
Arrow data model", "Ragged routes and the terminal gap", "Expert ids"): columns and types
of rollout.v1 (a ``routes`` column iff the spec is in the metadata); no nulls at any level
(located only on failure); ``policy_version`` / ``attempt`` and the (``trajectory_id``,
``attempt``) key where present (``docs/versions.md``); ``len(loss_mask) ==
len(response_ids)``, mask values 0 or 1 and routes ``<=`` tokens; the expert-id rules per
chunk; the terminal gap; the ``routes_missing``
marks (``docs/fallback.md``: 0/1, one per route row, no nulls, only beside ``routes``, and
present wherever `MISSING_KEY` is). Errors set ``row`` and
``trajectory_id`` when a trajectory is at fault, ``token`` / ``layer`` where they apply.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal, NoReturn, overload

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from r3arrow._coverage import first_terminal_gap_rows, terminal_gap_error
from r3arrow._schema import (
    MISSING_KEY,
    ROUTES_MISSING,
    has_routes,
    list_lengths,
    missing_routes,
    rollout_schema,
    route_spec,
    trajectory_id_at,
)
from r3arrow._typing import TableLike
from r3arrow._versions import check_versions
from r3arrow.errors import R3ArrowError, RouteShapeError, SchemaError
from r3arrow.ids import check_routes
from r3arrow.spec import SPEC_METADATA_KEY, RouteSpec, routes_to_numpy

_SCALARS = ("trajectory_id", "group_id", "reward")
_LISTS = {"prompt_ids": "token ids", "response_ids": "token ids", "loss_mask": "mask values"}
_ROUTE_LEVELS = ("trajectory rows", "tokens", "layer rows", "expert ids")


def _chunks(col: pa.Array[Any] | pa.ChunkedArray[Any]) -> list[pa.Array[Any]]:
    return list(col.chunks) if isinstance(col, pa.ChunkedArray) else [col]


def _first_null(arr: pa.Array[Any] | pa.ChunkedArray[Any]) -> int:
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
        if (col := table.column(name)).null_count:
            _null_error(table, name, "values", col.null_count, _first_null(col))
    for name, what in _LISTS.items():
        base = 0
        for ch in _chunks(table.column(name)):
            if ch.null_count:
                _null_error(table, name, "rows", ch.null_count, base + _first_null(ch))
            values = pc.list_flatten(ch)
            if values.null_count:
                row, pos = _row_of(ch, _first_null(values))
                # The token field is the position in prompt + response (prompts are checked first).
                shift = 0 if name == "prompt_ids" else len(table.column("prompt_ids")[base + row])
                _null_error(table, name, what, values.null_count, base + row, token=shift + pos)
            base += len(ch)
    if spec is not None and routes:
        _check_route_nulls(table, spec)


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
                at = {"token": token} | ({} if depth == 1 else {"layer": inner % num_layers})
                _null_error(table, "routes", what, level.null_count, base + row, **at)
            if depth < len(_ROUTE_LEVELS) - 1:  # flatten only a null-free level: exact
                level = pc.list_flatten(level)
        base += len(ch)


def check_chunk_ids(
    table: TableLike,
    flat: np.ndarray,
    lens: np.ndarray | pa.Array[Any],
    spec: RouteSpec,
    base: int,
    rules: Literal["all", "range", "distinct"],
) -> int:
    """`check_routes` on the flat rows of trajectories ``base ..`` of ``lens`` rows each (or of
    the list chunk ``lens``, read on failure); the largest id. The trajectory at fault is
    re-checked alone, so the error names its own token, ``row`` and ``trajectory_id``.
    """
    try:
        return check_routes(flat, spec, what="routes", rules=rules)[1]
    except R3ArrowError as exc:
        lens = list_lengths(lens) if isinstance(lens, pa.Array) else lens
        ends = np.cumsum(lens)
        i = int(np.searchsorted(ends, exc.token or 0, side="right"))
        row, tid = base + i, trajectory_id_at(table, base + i)
        try:
            part = flat[int(ends[i] - lens[i]) : int(ends[i])]
            check_routes(part, spec, what=f"routes[{row}] (trajectory {tid!r})", rules=rules)
        except R3ArrowError as own:
            own.row, own.trajectory_id = row, tid
            raise own from None
        exc.row, exc.trajectory_id = row, tid  # pragma: no cover - re-check raises
        raise  # pragma: no cover


def raise_at_first(
    table: TableLike, bad: np.ndarray, error: type[R3ArrowError], message: Callable[[int], str]
) -> None:
    """Raise ``error(message(row), row=row, trajectory_id=...)`` at the first True of ``bad``
    (a bool per row), if any."""
    rows = np.flatnonzero(bad)
    if rows.size:
        i = int(rows[0])
        raise error(message(i), row=i, trajectory_id=trajectory_id_at(table, i))


def check_missing(table: TableLike) -> None:
    """The ``routes_missing`` rules (`r3arrow._schema.missing_routes`, and no null mark);
    nothing to check on a table with neither the column nor `MISSING_KEY`."""
    names = table.schema.names
    if ROUTES_MISSING not in names and MISSING_KEY not in (table.schema.metadata or {}):
        return
    typ = table.schema.field(ROUTES_MISSING).type if ROUTES_MISSING in names else None
    if typ is not None and (pa.types.is_large_list(typ) or pa.types.is_list(typ)):
        base = 0
        for ch in _chunks(table.column(ROUTES_MISSING)):
            if ch.null_count:
                _null_error(table, ROUTES_MISSING, "rows", ch.null_count, base + _first_null(ch))
            if (values := pc.list_flatten(ch)).null_count:
                row, pos = _row_of(ch, _first_null(values))
                _null_error(
                    table, ROUTES_MISSING, "marks", values.null_count, base + row, token=pos
                )
            base += len(ch)
    missing_routes(table)


@overload
def validate_rollouts(table: TableLike, *, require_routes: Literal[True]) -> RouteSpec: ...
@overload
def validate_rollouts(table: TableLike, *, require_routes: bool = False) -> RouteSpec | None: ...
def validate_rollouts(table: TableLike, *, require_routes: bool = False) -> RouteSpec | None:
    """Check a rollout table against every rule above; return its spec (``None``: R3 off).

    ``require_routes=True``: an R3-off table raises `SchemaError`.
    """
    return validate_table(table, ids="all", require_routes=require_routes)


def validate_table(
    table: TableLike,
    *,
    ids: Literal["all", "distinct", "none"],
    require_routes: bool = False,
) -> RouteSpec | None:
    """`validate_rollouts` with a choice of id checks: ``"all"``, ``"distinct"`` (the range
    was checked) or ``"none"`` (routes built by `rollout_table` from checked rows: neither
    their ids nor their nulls are read)."""
    if not has_routes(table) and SPEC_METADATA_KEY in (table.schema.metadata or {}):
        raise SchemaError(
            f"expected column 'routes' (the schema carries r3arrow.spec; an R3-off table has "
            f"neither), found columns {table.schema.names}"
        )
    if not has_routes(table) and require_routes:
        raise SchemaError(
            f"expected a 'routes' column, found no routes column (R3 off; columns "
            f"{table.schema.names})"
        )
    spec = route_spec(table) if has_routes(table) else None
    for f in rollout_schema(spec):
        if f.name not in table.schema.names:
            raise SchemaError(
                f"expected column {f.name!r} ({f.type}), found columns {table.schema.names}"
            )
        found = table.schema.field(f.name).type
        if found != f.type:
            raise SchemaError(f"column {f.name!r}: expected {f.type}, found {found}")
    _check_nulls(table, spec, routes=ids != "none")
    check_versions(table)  # policy_version / attempt where present (docs/versions.md)
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
    mask = np.asarray(pc.list_flatten(table.column("loss_mask")).to_numpy(zero_copy_only=False))
    if (bad := np.flatnonzero(mask > 1)).size:
        row = int(np.searchsorted(np.cumsum(mlen), bad[0], side="right"))
        raise SchemaError(
            f"row {row}: loss_mask: expected values 0 or 1, found {int(mask[bad[0]])}",
            row=row,
            trajectory_id=trajectory_id_at(table, row),
        )
    if spec is None:
        check_missing(table)  # marks without routes: refused
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
        base = 0
        for ch in _chunks(table.column("routes")):
            flat = routes_to_numpy(pc.list_flatten(ch), spec)
            check_chunk_ids(table, flat, ch, spec, base, ids)
            base += len(ch)
    check_missing(table)
    # The terminal gap: a loss-active response token t needs route row t - 1.
    if mask.size and (gap := first_terminal_gap_rows(mask, mlen, plen, cap)) is not None:
        row, token = gap
        raise terminal_gap_error(
            token=token,
            captured=int(cap[row]),
            num_tokens=int(plen[row] + rlen[row]),
            trajectory_id=trajectory_id_at(table, row),
            row=row,
        )
    return spec
