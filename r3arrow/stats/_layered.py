"""Expert counts of a path one stored layer group at a time (zero-copy restores).

Counts are per layer, so they need no whole token: for files in layer-group storage
(``docs/storage.md``) `layered_counts` reads each stored group of router layers in
its own streamed pass (`r3arrow.io.iter_rollouts` with ``layers=``, a layer
projection: one group wanted whole restores without the interleave copy of a full read)
and stacks the per-group counts, mapping each projected table's layers to global
ids through `r3arrow.table.route_layers`. Every route byte is still read once; the
small selection columns are read once per group. The integers equal a one-pass
count's.

Why the passes run concurrently: pyarrow decodes (and checksums) one column chunk on
one thread, and a pass reads one chunk per row group, so one pass at a time keeps a
single core busy reading. ``PASS_THREADS`` passes run at once (each reading ahead on
its own thread, counting on the shared kernel pool), each with an equal share of the
memory budget, so reads, checksums and counts fill every core and the disk sees
several sequential streams at once (``docs/scale.md``).

Files in another form (older single-value storage, portable) or with one group take
the one-pass path (`layered_counts` returns None).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from r3arrow._typing import PathLike
from r3arrow.errors import RouteShapeError
from r3arrow.io import rollout_files
from r3arrow.spec import RouteSpec
from r3arrow.stats._counts import ExpertCounts
from r3arrow.stats._selection import columns_for
from r3arrow.stats._sources import batch_counts, iter_source
from r3arrow.stats._stream import check_budget

#: Layer-group passes read at once (at most; never more than the CPUs).
PASS_THREADS = 2


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


def stored_groups(
    path: PathLike, steps: Sequence[int] | None, layers: Sequence[int] | None = None
) -> list[list[int]] | None:
    """The router layers of each stored layer group of ``path``'s files, or None.

    ``layers``: keep only these global layers (None: every router layer). None unless
    every file is in layer-group storage with the same groups
    (`r3arrow.io.RolloutFile.layer_groups`) and at least two groups hold wanted
    router layers. Files are checked by `r3arrow.io.rollout_files` (its errors).
    """
    files = rollout_files(path, steps=steps, require_routes=True)
    spec = files[0].spec
    assert spec is not None  # require_routes
    groups = {f.layer_groups for f in files}
    if len(groups) != 1:
        return None
    (seen,) = groups
    if seen is None:
        return None
    wanted = set(spec.router_layers)
    if layers is not None:
        present = {i for g in seen for i in g}
        missing = sorted(set(layers) - present)
        if missing:  # as layer projection (io's layer projection) for a full table
            raise ValueError(f"layers: expected ids in [0, {len(present)}), found {missing}")
        wanted &= set(layers)
        if not wanted:
            raise ValueError(
                f"layers: expected at least one router layer, found dense layers {list(layers)}"
            )
    passes = [[i for i in g if i in wanted] for g in seen]
    passes = [p for p in passes if p]
    return passes if len(passes) > 1 else None


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
    for p in sorted(parts, key=lambda p: p.layers[0]):
        counts[len(layers) : len(layers) + len(p.layers), : p.num_experts] = p.counts
        layers += p.layers
    return ExpertCounts(tuple(layers), counts, parts[0].tokens)


def layered_counts(
    path: PathLike,
    tokens: str,
    steps: Sequence[int] | None,
    max_memory: int | None,
    validate: bool,
    *,
    column: str = "routes",
    layers: Sequence[int] | None = None,
) -> dict[int | None, ExpertCounts] | None:
    """Per-step `ExpertCounts` of routes column ``column`` of ``path``, a pass per stored
    layer group (``layers``: only those global layers); None (one-pass path) where the
    files are not in multi-group layer storage or hold no rows."""
    passes = stored_groups(path, steps, layers)
    if passes is None:
        return None
    spec = rollout_files(path, steps=steps, require_routes=True)[0].spec
    assert spec is not None  # require_routes
    threads = max(1, min(PASS_THREADS, _cpus(), len(passes)))
    share = max(1, check_budget(max_memory) // threads)  # the passes at once share the budget
    columns = columns_for(tokens, column=column)

    def one_pass(group: list[int]) -> dict[int | None, ExpertCounts]:
        sums: dict[int | None, ExpertCounts] = {}
        for step, batch in iter_source(path, columns, steps, share, validate, group):
            part = batch_counts(batch, tokens, column)  # global layer ids
            sums[step] = sums[step] + part if step in sums else part
        return sums

    per: dict[int | None, list[ExpertCounts]] = {}
    # A pool of its own: the passes wait on the kernels' shared pool, so they cannot run in it.
    with ThreadPoolExecutor(threads, thread_name_prefix="r3arrow-pass") as pool:
        for sums in pool.map(one_pass, passes):
            for step, total in sums.items():
                per.setdefault(step, []).append(total)
    if not per:
        return None
    return {step: _stack(parts, spec) for step, parts in per.items()}


__all__ = ["PASS_THREADS", "layered_counts", "stored_groups"]
