"""The coverage rules of a trajectory's routes: which rows an engine returns, the terminal gap.

Route row ``i`` predicts token ``i + 1``, so ``c`` captured rows cover the targets
``1 .. c`` (``docs/design.md``, "Ragged routes and the terminal gap"). Shared by capture,
the client's protocol and table validation.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from r3arrow.errors import RouteShapeError, TerminalGapError


def expected_rows(*, prompt_tokens: int, generated_tokens: int, prompt_start: int) -> int:
    """Rows an engine returns for prompt length P, G generated tokens and prompt start s."""
    return prompt_tokens - prompt_start + generated_tokens - 1


def first_terminal_gap(loss_mask: np.ndarray, positions: np.ndarray, captured: Any) -> int:
    """Index of the first loss-active token at ``positions > captured`` (a scalar or ``[T]``),
    or -1.
    """
    viol = np.flatnonzero((loss_mask != 0) & (positions > captured))
    return int(viol[0]) if viol.size else -1


def first_terminal_gap_rows(
    mask: np.ndarray, mask_lengths: np.ndarray, prompt_lengths: np.ndarray, captured: np.ndarray
) -> tuple[int, int] | None:
    """(row, token) of the first terminal gap in the flat response mask of many rows (row
    ``i``: ``mask_lengths[i]`` values from position ``P_i``), reading only uncovered tails.
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
    at_row = "" if row is None else f" (row {row})"
    where = "" if trajectory_id is None else f"trajectory {trajectory_id!r}{at_row}: "
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
    """``loss_mask`` (over all ``num_tokens``) as bool once its uncaptured suffix is checked:
    `TerminalGapError` for a loss-active token without a row, `RouteShapeError` for a bad
    mask length or more rows than tokens.
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
