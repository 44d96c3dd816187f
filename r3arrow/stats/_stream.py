"""Streaming a rollout file or root: bounded pieces, read ahead on a thread.

A statistic over a path never materialises a step: `iter_pieces` yields the
bounded ``(step, table)`` pieces of `r3arrow.io.iter_rollouts` (memory
budget: each piece at most a quarter of ``max_memory``, row groups merged or split
to fit; every requested step must exist and all files share one spec) with only
the columns the statistic needs. `prefetch` reads the next piece on a
background thread while the caller counts the current one (Parquet decoding and
the numba / torch kernels release the GIL), so the read and the count overlap
and at most two pieces are resident: the budget bounds memory whatever the step
size (``docs/scale.md``).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import pyarrow as pa

from r3arrow._checks import check_int
from r3arrow._typing import PathLike
from r3arrow.io import iter_rollouts, rollout_files

#: Default memory budget of a streamed statistic (bytes): a laptop's share.
DEFAULT_MAX_MEMORY = 1 << 30
_T = TypeVar("_T")
_END = object()


def check_budget(max_memory: object) -> int:
    """``max_memory`` (an int ``>= 1`` or None for the default) as bytes."""
    if max_memory is None:
        return DEFAULT_MAX_MEMORY
    return check_int(max_memory, "max_memory", minimum=1)


def prefetch(items: Iterator[_T]) -> Iterator[_T]:
    """The items of ``items``, the next one produced on a worker thread meanwhile.

    At most two items are alive at once (the caller's and the one being read). An
    exception of ``items`` is raised here, in order; closing this generator waits for
    the read in flight and stops.
    """
    with ThreadPoolExecutor(1, thread_name_prefix="r3arrow-prefetch") as pool:
        ahead = pool.submit(next, items, _END)
        while True:
            item = ahead.result()
            if item is _END:
                return
            ahead = pool.submit(next, items, _END)
            yield item  # type: ignore[misc]  # _END is handled above
            del item  # not kept alive while the next one is read


def iter_pieces(
    path: PathLike,
    columns: Sequence[str],
    steps: Sequence[int] | None = None,
    max_memory: int | None = None,
    *,
    validate: bool = False,
    layers: Sequence[int] | None = None,
) -> Iterator[tuple[int | None, pa.Table]]:
    """``(step, table)`` pieces of the rollout file or root ``path``, read ahead on a thread.

    ``columns``: the columns to read (``routes`` restored, spec in the metadata);
    ``steps``: the steps (each must exist); ``max_memory``: the budget in bytes
    (default `DEFAULT_MAX_MEMORY`; io's pieces are at most a quarter of it, and this
    reader holds two). ``step`` is None for a file outside a root. The footers
    (version, metadata checksum, one spec) and the page checksums are always
    verified; ``validate=True`` adds the row checks of `read_rollouts` (the statistics
    check the expert-id range they count themselves, see `r3arrow.stats.expert_counts`).
    Raises what `r3arrow.io.rollout_files` / `r3arrow.io.iter_rollouts` raise (`SchemaError`,
    ``path``
    for corrupt, foreign or mismatched files, missing steps; the validation errors for
    bad rows), ``TypeError`` / ``ValueError`` for a bad ``max_memory``. ``layers``:
    global layer ids to read (a projected table, layer projection; None: all).
    """
    budget = check_budget(max_memory)
    files = rollout_files(path, steps=steps)  # every requested step must exist
    pieces = iter_rollouts(
        files,
        columns=[*columns, "step"],
        layers=None if layers is None else list(layers),
        max_memory=budget,
        validate=bool(validate),
    )
    yield from prefetch(_stepped(pieces, [f.step for f in files], "step" in columns))


def _stepped(
    pieces: Iterator[pa.Table], steps: list[int | None], keep: bool
) -> Iterator[tuple[int | None, pa.Table]]:
    """``(step, piece)`` of `r3arrow.io.iter_rollouts` pieces (a root's carry ``step``).

    Pieces come in step order and never span two steps; an empty piece is the only
    piece of a step without rows, the next step of ``steps`` (the files' steps).
    """
    order = list(dict.fromkeys(steps))
    at = -1
    for piece in pieces:
        if piece.num_rows and "step" in piece.schema.names:
            at = order.index(int(piece.column("step")[0].as_py()), max(at, 0))
        elif not piece.num_rows:
            at += 1
        else:
            at = 0
        if "step" in piece.schema.names and not keep:
            piece = piece.drop_columns(["step"])
        yield order[min(at, len(order) - 1)], piece


__all__ = ["DEFAULT_MAX_MEMORY", "check_budget", "iter_pieces", "prefetch"]
