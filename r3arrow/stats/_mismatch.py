"""Train-vs-rollout log-prob mismatch over loss-masked response tokens (``docs/mismatch.md``).

Δ = ``train_logprobs`` − ``rollout_logprobs`` per response token, kept where ``loss_mask``
is 1. Each block of rows gives exact-shape partial sums (`_Partial`) that add up per step
and overall; the metrics are derived from them at the end, so a table, a file and a
streamed root give the same values up to float summation order.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any, Literal, cast, overload

import numpy as np
import pyarrow as pa

from r3arrow._schema import (
    MISMATCH_FLOATS,
    POLICY_VERSION,
    ROLLOUT_LOGPROBS,
    TRAIN_LOGPROBS,
    list_lengths,
    trajectory_id_at,
)
from r3arrow._typing import TableLike
from r3arrow.errors import SchemaError
from r3arrow.stats._sources import Group, check_budget, iter_groups

_COLUMNS = ["response_ids", "loss_mask", ROLLOUT_LOGPROBS, TRAIN_LOGPROBS]
_LN2 = math.log(2.0)

#: The keys of a mismatch dict, in order (``docs/mismatch.md`` defines each).
MISMATCH_KEYS: tuple[str, ...] = ("tokens", *MISMATCH_FLOATS)


@dataclasses.dataclass
class _Partial:
    """Sums over the loss-masked tokens of some rows (``max_abs``: a max)."""

    tokens: int = 0
    k1: float = 0.0
    k2: float = 0.0
    k3: float = 0.0
    abs_sum: float = 0.0
    abs_max: float = 0.0
    over_ln2: int = 0
    mult: float = 0.0
    js: float = 0.0

    def add(self, other: _Partial) -> None:
        for f in dataclasses.fields(self):
            name = f.name
            if name == "abs_max":
                self.abs_max = max(self.abs_max, other.abs_max)
            else:
                setattr(self, name, getattr(self, name) + getattr(other, name))

    def result(self) -> dict[str, float]:
        n = self.tokens
        if n == 0:
            return {k: (0.0 if k == "tokens" else math.nan) for k in MISMATCH_KEYS}
        return {
            "tokens": float(n),
            "k1": self.k1 / n,
            "k2": self.k2 / n,
            "k3": self.k3 / n,
            "abs_mean": self.abs_sum / n,
            "abs_max": self.abs_max,
            "frac_abs_gt_ln2": self.over_ln2 / n,
            "token_mult_prob_error": self.mult / n,
            "js_divergence": self.js / n,
        }


def _flat(col: pa.Array[Any] | pa.ChunkedArray[Any], dtype: Any) -> np.ndarray:
    """The values of a list column, flattened (slices respected), as ``dtype``."""
    chunks = col.chunks if isinstance(col, pa.ChunkedArray) else [col]
    parts = [
        np.asarray(cast(Any, c).flatten().to_numpy(zero_copy_only=False), dtype=dtype)
        for c in chunks
    ]
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


def _partial(batch: TableLike) -> _Partial:
    """The partial of one block: checks the columns' shapes and finiteness (`SchemaError`)."""
    names = batch.schema.names
    missing = [c for c in _COLUMNS if c not in names]
    if missing:
        raise SchemaError(
            f"logprob_mismatch: expected columns {_COLUMNS}, missing {missing} (columns {names})"
        )
    want = list_lengths(batch.column("response_ids"))
    for name in ("loss_mask", ROLLOUT_LOGPROBS, TRAIN_LOGPROBS):
        got = list_lengths(batch.column(name))
        bad = np.flatnonzero(got != want)
        if bad.size:
            row = int(bad[0])
            raise SchemaError(
                f"column {name!r}: expected one value per response token "
                f"({int(want[row])}) in row {row}, found {int(got[row])}",
                row=row,
                trajectory_id=trajectory_id_at(batch, row),
            )
    mask = _flat(batch.column("loss_mask"), np.uint8) != 0
    rollout = _flat(batch.column(ROLLOUT_LOGPROBS), np.float64)[mask]
    train = _flat(batch.column(TRAIN_LOGPROBS), np.float64)[mask]
    for name, values in ((ROLLOUT_LOGPROBS, rollout), (TRAIN_LOGPROBS, train)):
        finite = np.isfinite(values)
        if not finite.all():
            at = int(np.flatnonzero(mask)[np.flatnonzero(~finite)[0]])
            offsets = np.concatenate([[0], np.cumsum(want)])
            row = int(np.searchsorted(offsets, at, side="right") - 1)
            raise SchemaError(
                f"column {name!r}: expected finite log-probs on loss-masked tokens, found "
                f"{float(values[~finite][0])} at row {row}, token {at - int(offsets[row])}",
                row=row,
                token=at - int(offsets[row]),
                trajectory_id=trajectory_id_at(batch, row),
            )
    delta = train - rollout
    if not delta.size:
        return _Partial()
    absd = np.abs(delta)
    with np.errstate(over="ignore"):
        ratio = np.exp(delta)
        # NeMo-RL's JS on sampled tokens: M = (p_train + p_rollout) / 2, in log space from Δ
        log_m_minus_rollout = np.logaddexp(delta, 0.0) - _LN2
        a = delta - log_m_minus_rollout  # log p_train − log M
        b = -log_m_minus_rollout  # log p_rollout − log M
        js = 0.5 * (np.expm1(a) - a) + 0.5 * (np.expm1(b) - b)
        return _Partial(
            tokens=int(delta.size),
            k1=float(-delta.sum()),
            k2=float(0.5 * np.square(delta).sum()),
            k3=float((ratio - 1.0 - delta).sum()),
            abs_sum=float(absd.sum()),
            abs_max=float(absd.max()),
            over_ln2=int(np.count_nonzero(absd > _LN2)),
            mult=float(np.exp(absd).sum()),
            js=float(js.sum()),
        )


@overload
def logprob_mismatch(
    source: Any,
    *,
    by_step: Literal[False] = False,
    by_version: Literal[False] = False,
    steps: Sequence[int] | None = None,
    max_memory: int | None = None,
) -> dict[str, float]: ...


@overload
def logprob_mismatch(
    source: Any,
    *,
    by_step: Literal[True],
    by_version: Literal[False] = False,
    steps: Sequence[int] | None = None,
    max_memory: int | None = None,
) -> dict[int, dict[str, float]]: ...


@overload
def logprob_mismatch(
    source: Any,
    *,
    by_step: Literal[False] = False,
    by_version: Literal[True],
    steps: Sequence[int] | None = None,
    max_memory: int | None = None,
) -> dict[int, dict[str, float]]: ...


def logprob_mismatch(
    source: Any,
    *,
    by_step: bool = False,
    by_version: bool = False,
    steps: Sequence[int] | None = None,
    max_memory: int | None = None,
) -> dict[str, float] | dict[int, dict[str, float]]:
    """Train-vs-rollout log-prob mismatch over the loss-masked response tokens.

    ``source``: a rollout table or record batch, a Parquet file or a step-partitioned
    root holding ``rollout_logprobs`` and ``train_logprobs`` (``list<float32>``, one per
    response token). With Δ = log π_train − log π_rollout over the N tokens where
    ``loss_mask`` is 1, returns a dict with the keys `MISMATCH_KEYS` in that order:

    * ``tokens``: N (a float);
    * ``k1`` = mean(−Δ) (verl's ``kl``, KL(π_rollout ‖ π_train) sampled from the rollout);
    * ``k2`` = mean(Δ² / 2);
    * ``k3`` = mean(e^Δ − 1 − Δ) (verl's ``k3_kl``; AReaL #1207);
    * ``abs_mean`` = mean |Δ|, ``abs_max`` = max |Δ|;
    * ``frac_abs_gt_ln2``: the fraction of tokens with |Δ| > ln 2 (probability off by
      more than a factor of two either way);
    * ``token_mult_prob_error`` = mean(e^|Δ|) (NeMo-RL's; 1.0 when the two agree);
    * ``js_divergence`` = mean(½ k3(log p_t − log m) + ½ k3(log p_r − log m)) with
      m = (p_t + p_r) / 2 and k3(x) = e^x − 1 − x (NeMo-RL's ``js_divergence_error``).

    N = 0 gives ``tokens`` 0.0 and NaN elsewhere. ``by_step=True``: ``{step: dict}``
    ascending (a root, or a table with a ``step`` column; else `SchemaError`).
    ``by_version=True`` (not with ``by_step``: ``ValueError``): ``{policy_version: dict}``
    ascending (a source with a ``policy_version`` column, else `SchemaError`;
    ``docs/versions.md``).
    ``steps``: the steps kept; ``max_memory``: a streamed path's budget in bytes (default
    1 GiB). Raises ``TypeError`` / ``ValueError`` for bad arguments, `SchemaError` for
    missing columns, a row whose log-probs are not one per response token, or a
    non-finite log-prob on a loss-masked token (``row``, ``token``, ``trajectory_id``).
    """
    for name, flag in (("by_step", by_step), ("by_version", by_version)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name}: expected a bool, found {type(flag).__name__}")
    if by_step and by_version:
        raise ValueError("by_step, by_version: expected one grouping, found both True")
    budget = check_budget(max_memory)
    per: dict[int | None, _Partial] = {}
    by: Group = POLICY_VERSION if by_version else "step"
    for step, batch in iter_groups(source, list(_COLUMNS), steps, budget, by=by):
        part = per.setdefault(step, _Partial())
        part.add(_partial(batch))
    if not (by_step or by_version):
        total = _Partial()
        for part in per.values():
            total.add(part)
        return total.result()
    if None in per:
        raise SchemaError(
            "by step: expected a step-partitioned directory or a table with a 'step' column, "
            "found neither"
        )
    return {int(s): per[s].result() for s in sorted(s for s in per if s is not None)}


__all__ = ["MISMATCH_KEYS", "logprob_mismatch"]
