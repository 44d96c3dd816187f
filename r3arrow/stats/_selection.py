"""Token subsets (``tokens=``) over the route rows of a rollout table.

Row ``i`` of a trajectory's routes routes token ``i``, i.e. the forward pass
whose logits predict token ``i + 1`` (see ``docs/design.md``, "Ragged routes and
the terminal gap"):

- ``"all"``: every captured row.
- ``"prompt"``: rows ``i < P`` (forward passes over prompt tokens, the prefill).
- ``"response"``: rows ``i >= P`` (forward passes over response tokens).
- ``"loss"``: rows ``i`` whose *next* token ``i + 1`` is loss-active — the
  forward passes whose logits the policy loss trains on (the same rule as the
  terminal-gap check). Row ``P - 1`` is in this set when the first response
  token is trained; the last response token's row never is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np
import pyarrow.compute as pc

from r3arrow._checks import check_choice
from r3arrow._typing import TableLike
from r3arrow.errors import SchemaError
from r3arrow.table import list_lengths

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


def columns_for(tokens: str, extra: Sequence[str] = ()) -> list[str]:
    """The columns a statistic over subset ``tokens`` reads: ``routes``, ``extra``, the subset's."""
    return list(dict.fromkeys(["routes", *extra, *SEL_COLUMNS[tokens]]))


def token_selection(table: TableLike, tokens: str) -> np.ndarray | None:
    """Bool ``[sum(captured)]`` over the route rows of `flat_routes` (``None`` for ``"all"``).

    See the module docstring for the subsets. Raises `SchemaError` if a needed
    column is missing, ``ValueError`` for an unknown subset.
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


__all__ = ["TOKEN_SUBSETS", "TokenSubset", "check_subset", "columns_for", "token_selection"]
