"""Array helpers shared by the adapters (numpy and pyarrow only)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow.compute as pc


def host(x: Any) -> Any:
    """A torch tensor as numpy (duck-typed: no torch import); anything else unchanged."""
    return x.detach().cpu().numpy() if hasattr(x, "detach") else x


def flat_values(col: Any) -> np.ndarray:
    """The flattened values of an Arrow list column as numpy."""
    return np.asarray(pc.list_flatten(col).to_numpy(zero_copy_only=False))


def scatter(
    values: np.ndarray,
    lengths: np.ndarray,
    start: np.ndarray,
    shape: tuple[int, ...],
    fill: Any,
    dtype: Any = None,
) -> np.ndarray:
    """Ragged rows into a dense ``shape`` array, ``fill`` elsewhere.

    ``values``: the rows' items concatenated (``[sum(lengths), ...]``); row ``i``'s items
    land at ``out[i, start[i] : start[i] + lengths[i]]``. ``dtype``: default ``values``'.
    """
    rows = np.repeat(np.arange(lengths.size), lengths)
    shift = np.repeat(start - (np.cumsum(lengths) - lengths), lengths)
    out = np.full(shape, fill, dtype=values.dtype if dtype is None else dtype)
    out[rows, np.arange(values.shape[0]) + shift] = values
    return out


__all__ = ["flat_values", "host", "scatter"]
