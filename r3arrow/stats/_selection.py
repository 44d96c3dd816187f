"""Token subsets (``tokens=``) over the route rows of a rollout table.

Row ``i`` of a trajectory's routes is the forward pass whose logits predict token
``i + 1`` (``docs/design.md``, "Ragged routes and the terminal gap"): ``"all"`` every
captured row; ``"prompt"`` rows ``i < P``; ``"response"`` rows ``i >= P``; ``"loss"`` rows
whose *next* token is loss-active (row ``P - 1`` when the first response token is
trained; the last response token's row never).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
import pyarrow.compute as pc

from r3arrow._checks import check_choice
from r3arrow._schema import list_lengths
from r3arrow._typing import TableLike
from r3arrow.errors import SchemaError

TokenSubset = Literal["all", "prompt", "response", "loss"]
TOKEN_SUBSETS: tuple[str, ...] = ("all", "prompt", "response", "loss")
SEL_COLUMNS: dict[str, tuple[str, ...]] = {
    "all": (),
    "prompt": ("prompt_ids",),
    "response": ("prompt_ids",),
    "loss": ("prompt_ids", "response_ids", "loss_mask"),
}


def check_subset(tokens: object) -> str:
    """``tokens`` if it names a subset; ``ValueError`` otherwise."""
    return check_choice(tokens, "tokens", TOKEN_SUBSETS)


def columns_for(tokens: str, extra: Sequence[str] = (), *, column: str = "routes") -> list[str]:
    """The columns a statistic over subset ``tokens`` reads: ``column``, ``extra``, the subset's."""
    return list(dict.fromkeys([column, *extra, *SEL_COLUMNS[tokens]]))


def check_column(column: object) -> str:
    """``column`` (the routes column a statistic counts) if it is a non-empty ``str``."""
    if not isinstance(column, str):
        raise TypeError(f"column: expected a column name (str), found {type(column).__name__}")
    if not column:
        raise ValueError("column: expected a column name, found ''")
    return column


def check_layers(layers: object) -> list[int] | None:
    """``layers`` (global layer ids) as a sorted list without duplicates; None passes.

    Raises ``TypeError`` for a non-sequence, a string or a non-int, ``ValueError`` for an
    empty selection or a negative id.
    """
    if layers is None:
        return None
    if isinstance(layers, str | bytes) or not isinstance(layers, Sequence | range | set):
        raise TypeError(f"layers: expected a sequence of ints, found {type(layers).__name__}")
    out = set()
    for i in layers:
        if isinstance(i, bool) or not isinstance(i, int | np.integer):
            raise TypeError(f"layers: expected ints, found {type(i).__name__}")
        if i < 0:
            raise ValueError(f"layers: expected ids >= 0, found {int(i)}")
        out.add(int(i))
    if not out:
        raise ValueError("layers: expected at least one layer id, found none")
    return sorted(out)


def use_column(table: TableLike, column: str) -> TableLike:
    """``table`` with the routes column ``column`` as its ``routes`` (zero-copy; the
    original ``routes``, if any, dropped). Raises `SchemaError` if ``column`` is missing."""
    if column == "routes":
        return table
    names = table.schema.names
    if column not in names:
        raise SchemaError(f"expected a routes column {column!r}, found {names}")
    keep = [n for n in names if n != "routes"]
    cols: Any = [table.column(n) for n in keep]
    out_names = ["routes" if n == column else n for n in keep]
    return type(table).from_arrays(cols, names=out_names, metadata=table.schema.metadata)


def token_selection(table: TableLike, tokens: str) -> np.ndarray | None:
    """Bool ``[sum(captured)]`` over the route rows of `flat_routes` (``None`` for ``"all"``).

    Raises `SchemaError` if a needed column is missing, ``ValueError`` for an unknown subset.
    """
    check_subset(tokens)
    if tokens == "all":
        return None
    for name in SEL_COLUMNS[tokens]:
        if name not in table.schema.names:
            raise SchemaError(
                f"tokens={tokens!r}: expected column {name!r}, found {table.schema.names}"
            )
    cap = list_lengths(table.column("routes"))
    plen = list_lengths(table.column("prompt_ids"))
    starts = np.zeros(cap.size + 1, dtype=np.int64)
    np.cumsum(cap, out=starts[1:])
    parent = np.repeat(np.arange(cap.size, dtype=np.int64), cap)
    pos = np.arange(starts[-1], dtype=np.int64) - starts[:-1][parent]
    if tokens == "prompt":
        return np.asarray(pos < plen[parent])
    if tokens == "response":
        return np.asarray(pos >= plen[parent])
    rlen = list_lengths(table.column("response_ids"))
    mlen = list_lengths(table.column("loss_mask"))
    if not np.array_equal(mlen, rlen):
        i = int(np.flatnonzero(mlen != rlen)[0])
        raise SchemaError(
            f"row {i}: expected loss_mask over the {rlen[i]} response tokens, found {mlen[i]}",
            row=i,
        )
    mask = np.asarray(pc.list_flatten(table.column("loss_mask")).to_numpy(zero_copy_only=False))
    rstart = np.zeros(rlen.size + 1, dtype=np.int64)
    np.cumsum(rlen, out=rstart[1:])
    nxt = pos + 1 - plen[parent]  # response index of the token row i predicts
    ok = (nxt >= 0) & (nxt < rlen[parent])
    if mask.size == 0:
        return np.zeros(pos.size, dtype=bool)
    idx = rstart[:-1][parent] + np.where(ok, nxt, 0)
    np.minimum(idx, mask.size - 1, out=idx)  # rows with ok=False may point one past the end
    return np.asarray(ok & (mask[idx] != 0))


__all__ = [
    "TOKEN_SUBSETS",
    "TokenSubset",
    "check_column",
    "check_layers",
    "check_subset",
    "columns_for",
    "token_selection",
    "use_column",
]
