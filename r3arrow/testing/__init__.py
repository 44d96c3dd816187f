"""Test support for r3arrow and for code built on it.

Route generators and table builders here are plain numpy/pyarrow; hypothesis
strategies live in :mod:`r3arrow.testing.strategies` (needs ``hypothesis``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from r3arrow.spec import RouteSpec


def random_routes(
    rng: np.random.Generator,
    rows: int,
    spec: RouteSpec,
    *,
    num_experts: int | None = None,
    dtype: Any = None,
) -> np.ndarray:
    """Valid routes ``[rows, L, K]``: distinct ids in ``[0, E)`` on router layers, zeros on dense ones.

    ``E`` is ``num_experts`` if given, else ``spec.num_experts`` (else 256); the dtype is
    ``dtype`` if given, else ``spec.dtype`` (it must hold ``E - 1``).
    """
    e = num_experts if num_experts is not None else (spec.num_experts or 256)
    dt = np.dtype(dtype) if dtype is not None else spec.dtype
    out = np.zeros((rows, spec.num_layers, spec.topk), dtype=dt)
    layers = list(spec.router_layers)
    if rows == 0:
        return out
    if rows * len(layers) * e <= 4_000_000:
        # K distinct ids per (token, layer): the first K of a random permutation.
        ids = np.argsort(rng.random((rows, len(layers), e)), axis=-1)[..., : spec.topk]
    else:
        # Large sizes: a random start plus K fixed distinct offsets, modulo E.
        starts = rng.integers(0, e, size=(rows, len(layers), 1))
        ids = (starts + rng.permutation(e)[: spec.topk]) % e
    out[:, layers, :] = ids.astype(dt)
    return out


__all__ = ["random_routes"]
