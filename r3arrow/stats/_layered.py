"""Expert counts of a path one stored layer group at a time (zero-copy restores).

Counts are per layer, so they need no whole token: for files in layer-group storage
(``docs/storage.md``) `layered_counts` reads each stored group of router layers in
its own streamed pass (`r3arrow.io.iter_rollout_tables` with ``layers=``, contract
C2: one group wanted whole restores without the interleave copy of a full read)
and stacks the per-group counts, mapping each projected table's layers to global
ids through `r3arrow.table.route_layers`. Every route byte is still read once; the
small selection columns are read once per group. The integers equal a one-pass
count's. Files in another form (older single-value storage, portable) or with one
group take the one-pass path (`layered_counts` returns None).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import orjson
import pyarrow.parquet as pq

from r3arrow._typing import PathLike, TableLike
from r3arrow.errors import RouteShapeError
from r3arrow.io import scan_rollout_files
from r3arrow.spec import RouteSpec
from r3arrow.stats._counts import ExpertCounts, count_routes
from r3arrow.stats._selection import columns_for, token_selection
from r3arrow.stats._sources import iter_source
from r3arrow.table import flat_routes, route_layers, route_spec

_STORAGE_KEY = b"r3arrow.routes_storage"  # io's storage metadata (format, columns, groups)
_GROUP_FORMAT = "layer_groups/v1"


def stored_groups(path: PathLike, steps: Sequence[int] | None) -> list[list[int]] | None:
    """The router layers of each stored layer group of ``path``'s files, or None.

    None unless every file is in layer-group storage with the same groups and there
    are at least two groups holding router layers. Files are checked by
    `r3arrow.io.scan_rollout_files` (its errors).
    """
    spec, files = scan_rollout_files(path, steps=steps)
    seen: Any = None
    for f in files:
        meta = pq.read_schema(f.path).metadata or {}
        try:
            info = orjson.loads(meta[_STORAGE_KEY])
            groups = [(int(a), int(b)) for a, b in info["groups"]]
            ok = info["format"] == _GROUP_FORMAT
        except (KeyError, TypeError, ValueError, orjson.JSONDecodeError):
            return None
        if not ok or (seen is not None and groups != seen):
            return None
        seen = groups
    router = set(spec.router_layers)
    passes = [[i for i in range(a, b) if i in router] for a, b in seen or []]
    passes = [p for p in passes if p]
    return passes if len(passes) > 1 else None


def _global_counts(batch: TableLike, tokens: str) -> ExpertCounts:
    """`ExpertCounts` of a (projected) batch, its layers as global ids."""
    spec = route_spec(batch)
    rows, _ = flat_routes(batch)
    local = count_routes(rows, spec, select=token_selection(batch, tokens))
    ids = route_layers(batch)
    return ExpertCounts(tuple(ids[i] for i in local.layers), local.counts, local.tokens)


def _stack(parts: list[ExpertCounts], spec: RouteSpec) -> ExpertCounts:
    """Counts of disjoint layer sets of the same tokens, stacked in layer order."""
    if len({p.tokens for p in parts}) != 1:
        raise RouteShapeError(  # pragma: no cover - the passes read the same rows
            f"layered counts: expected the same tokens in every pass, found "
            f"{[p.tokens for p in parts]}"
        )
    width = max([p.num_experts for p in parts] + [spec.num_experts or 0])
    counts = np.zeros((sum(len(p.layers) for p in parts), width), dtype=np.int64)
    layers: list[int] = []
    for p in parts:
        counts[len(layers) : len(layers) + len(p.layers), : p.num_experts] = p.counts
        layers += p.layers
    return ExpertCounts(tuple(layers), counts, parts[0].tokens)


def layered_counts(
    path: PathLike,
    tokens: str,
    steps: Sequence[int] | None,
    max_memory: int | None,
    validate: bool,
) -> dict[int | None, ExpertCounts] | None:
    """Per-step `ExpertCounts` of ``path``, one pass per stored layer group; None (one-pass
    path) where the files are not in multi-group layer storage or hold no rows."""
    passes = stored_groups(path, steps)
    if passes is None:
        return None
    spec, _ = scan_rollout_files(path, steps=steps)
    per: dict[int | None, list[ExpertCounts]] = {}
    for layers in passes:
        sums: dict[int | None, ExpertCounts] = {}
        pieces = iter_source(path, columns_for(tokens), steps, max_memory, validate, layers)
        for step, batch in pieces:
            part = _global_counts(batch, tokens)
            sums[step] = sums[step] + part if step in sums else part
        for step, total in sums.items():
            per.setdefault(step, []).append(total)
    if not per:
        return None
    return {step: _stack(parts, spec) for step, parts in per.items()}


__all__ = ["layered_counts", "stored_groups"]
