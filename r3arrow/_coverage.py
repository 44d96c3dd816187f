"""The coverage rules of a trajectory's routes: which rows an engine returns, the terminal gap.

Route row ``i`` predicts token ``i + 1``; a trajectory that captured ``c`` rows covers the
targets ``1 .. c`` (``docs/design.md``, "Ragged routes and the terminal gap"). Capture
(`r3arrow.capture`), the client's protocol and table validation (`r3arrow.table`) share
these functions; they raise `TerminalGapError` / `RouteShapeError` with fields set.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from r3arrow.errors import RouteShapeError, TerminalGapError


def expected_rows(*, prompt_tokens: int, generated_tokens: int, prompt_start: int) -> int:
    """Rows an engine returns for prompt length P, G generated tokens and prompt start s."""
    return prompt_tokens - prompt_start + generated_tokens - 1


# ---------------------------------------------------------------- terminal gap
def first_terminal_gap(loss_mask: np.ndarray, positions: np.ndarray, captured: Any) -> int:
    """Index into ``loss_mask`` of the first loss-active token without a route row, or -1.

    The terminal-gap rule (``docs/design.md``, "Ragged routes and the terminal gap"):
    route row ``i`` predicts token ``i + 1``, so a trajectory that captured ``c`` rows
    covers the targets ``1 .. c``; a loss-active token at position ``t > c`` has no row.

    Parameters
    ----------
    loss_mask:
        ``[T]`` mask values (nonzero = the loss trains on that token).
    positions:
        ``[T]`` token position of each mask value within its trajectory.
    captured:
        Captured rows: a scalar, or ``[T]`` (the value's trajectory's count).
    """
    viol = np.flatnonzero((loss_mask != 0) & (positions > captured))
    return int(viol[0]) if viol.size else -1


def first_terminal_gap_rows(
    mask: np.ndarray, mask_lengths: np.ndarray, prompt_lengths: np.ndarray, captured: np.ndarray
) -> tuple[int, int] | None:
    """The terminal-gap rule over many trajectories: (row, token) of the first violation, or None.

    ``mask`` is the flat response loss mask of all rows, row ``i`` holding
    ``mask_lengths[i]`` values for response positions ``P_i .. P_i + R_i - 1``; ``captured``
    is each row's route rows. Row ``i``'s response token ``j`` needs a row iff
    ``P_i + j > captured_i`` (`first_terminal_gap`). Only the uncovered tails are looked at:
    O(rows + uncovered tokens), not O(tokens) (usually one token per row: the last sampled).
    """
    lens = np.asarray(mask_lengths, dtype=np.int64)
    plen = np.asarray(prompt_lengths, dtype=np.int64)
    first = np.clip(np.asarray(captured, dtype=np.int64) - plen + 1, 0, lens)
    tail = lens - first
    rows = np.flatnonzero(tail)
    if not rows.size:
        return None
    ends = np.cumsum(lens)
    starts = ends - lens
    counts = tail[rows]
    # flat indices of every uncovered token, row by row
    base = np.repeat(starts[rows] + first[rows] - np.cumsum(counts) + counts, counts)
    idx = base + np.arange(int(counts.sum()), dtype=np.int64)
    hit = np.flatnonzero(mask[idx] != 0)
    if not hit.size:
        return None
    k = int(idx[hit[0]])
    row = int(np.searchsorted(ends, k, side="right"))
    return row, int(plen[row]) + k - int(starts[row])


def terminal_gap_error(
    *,
    token: int,
    captured: int,
    num_tokens: int,
    trajectory_id: str | None = None,
    row: int | None = None,
) -> TerminalGapError:
    """The `TerminalGapError` for a loss-active ``token`` without a route row (fields set)."""
    where = ""
    if trajectory_id is not None:
        where = f"trajectory {trajectory_id!r}" + (f" (row {row})" if row is not None else "")
        where += ": "
    return TerminalGapError(
        f"{where}missing routed-expert row for loss-active target at token {token} "
        f"(captured {captured} of {num_tokens} tokens; rows >= {captured} are missing)",
        token=token,
        trajectory_id=trajectory_id,
        row=row,
    )


def check_terminal_gap(
    captured: int, loss_mask: Any, *, num_tokens: int, trajectory_id: str | None = None
) -> np.ndarray:
    """Validate the uncaptured suffix of one trajectory; return the mask as a numpy bool array.

    ``loss_mask`` covers all ``num_tokens`` tokens (prompt included). Rows
    ``[captured, num_tokens-1)`` may be missing only where ``loss_mask[i+1] == 0``.

    Raises
    ------
    TerminalGapError
        naming (``token``, ``trajectory_id``) the first loss-active token without a row.
    RouteShapeError
        a mask of the wrong length, or more captured rows than tokens.
    """
    mask = np.asarray(loss_mask)
    if mask.ndim != 1 or mask.shape[0] != num_tokens:
        raise RouteShapeError(
            f"loss_mask: expected a 1-D mask over all {num_tokens} tokens, "
            f"found shape {list(mask.shape)}",
            trajectory_id=trajectory_id,
        )
    if captured > num_tokens:
        raise RouteShapeError(
            f"expected at most num_tokens={num_tokens} captured rows, found {captured}",
            trajectory_id=trajectory_id,
        )
    tail = mask[captured + 1 :]
    k = first_terminal_gap(tail, np.arange(captured + 1, num_tokens), captured)
    if k >= 0:
        raise terminal_gap_error(
            token=captured + 1 + k,
            captured=captured,
            num_tokens=num_tokens,
            trajectory_id=trajectory_id,
        )
    return mask.astype(bool, copy=False)
