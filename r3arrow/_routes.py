"""Routes arrays: coercion to ``[rows, L, K]`` (`as_route_rows`), the padding row
(`dummy_route_row`), router-layer checks (`validate_layers`), and routes columns that
reference per-trajectory buffers instead of copying them (`chunked_routes`,
``docs/capture.md``). Private to the package.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from r3arrow.errors import RouteDTypeError, RouteShapeError
from r3arrow.spec import RouteSpec, numpy_to_routes, routes_to_numpy

#: A trajectory's rows become their own chunk (referenced, not copied) from this size on:
#: a chunk costs a few microseconds in every consumer, about a memcpy of this many bytes.
MIN_CHUNK_BYTES = 128 << 10


def _root(arr: np.ndarray) -> np.ndarray:
    """The outermost numpy array ``arr`` views (itself if it owns its data)."""
    while isinstance(arr.base, np.ndarray):
        arr = arr.base
    return arr


def _span(parts: Sequence[np.ndarray], spec: RouteSpec) -> np.ndarray | None:
    """``parts`` as one read-only view if they are back-to-back read-only C-contiguous slices
    of one buffer in ``spec.dtype`` (no parts: an empty array), else None.
    """
    if not parts:
        return np.empty((0, *spec.row_shape), dtype=spec.dtype)
    if any(p.flags.writeable or not p.flags.c_contiguous or p.dtype != spec.dtype for p in parts):
        return None
    if len(parts) == 1:
        return parts[0]
    root = _root(parts[0])
    if not root.flags.c_contiguous or any(_root(p) is not root for p in parts[1:]):
        return None
    ptr = [p.__array_interface__["data"][0] for p in parts]
    if any(ptr[i] + parts[i].nbytes != ptr[i + 1] for i in range(len(parts) - 1)):
        return None
    first = (ptr[0] - root.__array_interface__["data"][0]) // spec.dtype.itemsize
    rows = sum(p.shape[0] for p in parts)
    view = root.reshape(-1)[first : first + rows * spec.num_layers * spec.topk]
    view = view.reshape(rows, *spec.row_shape)
    view.flags.writeable = False
    return view


def chunk(parts: list[np.ndarray], lens: list[int], spec: RouteSpec) -> pa.LargeListArray[Any]:
    """One ``large_list`` chunk of trajectories of ``lens`` rows; one read-only part in
    ``spec.dtype`` is referenced, anything else joined.
    """
    offsets = np.cumsum([0, *lens], dtype=np.int64)
    if len(parts) == 1 and parts[0].dtype == spec.dtype and not parts[0].flags.writeable:
        flat = parts[0]
    else:  # ids were range-checked for the storage dtype: the narrowing cast is exact
        flat = np.empty((int(offsets[-1]), *spec.row_shape), dtype=spec.dtype)
        if parts:
            np.concatenate(parts, axis=0, out=flat, casting="unsafe")
    return pa.LargeListArray.from_arrays(
        pa.array(offsets, type=pa.int64()), numpy_to_routes(flat, spec)
    )


def chunked(chunks: Sequence[pa.Array[Any]], type: pa.DataType) -> pa.ChunkedArray[Any]:
    make: Any = pa.chunked_array  # the stubs' overloads do not cover a nested list type
    out: pa.ChunkedArray[Any] = make(list(chunks), type=type)
    return out


def chunked_routes(
    trajectories: Sequence[Sequence[np.ndarray] | pa.Array[Any]], spec: RouteSpec
) -> pa.ChunkedArray[Any]:
    """A routes column, a row per trajectory (``[n, L, K]`` integer parts in order, or one
    checked Arrow array), referencing buffers: a trajectory of `MIN_CHUNK_BYTES` or more (an
    Arrow array or one read-only span) is its own chunk, runs of the others are joined.
    """
    chunks: list[pa.Array[Any]] = []
    run: list[np.ndarray] = []
    run_lens: list[int] = []

    def own(piece: pa.Array[Any]) -> None:
        nonlocal run, run_lens
        if run_lens:
            chunks.append(chunk(run, run_lens, spec))
            run, run_lens = [], []
        chunks.append(piece)

    for parts in trajectories:
        if isinstance(parts, pa.Array):
            if len(parts) * spec.row_nbytes >= MIN_CHUNK_BYTES:  # no numpy round trip
                own(pa.LargeListArray.from_arrays(pa.array([0, len(parts)], pa.int64()), parts))
                continue
            parts = [routes_to_numpy(parts, spec)]
        view = _span(parts, spec)
        if view is not None and view.nbytes >= MIN_CHUNK_BYTES:
            own(chunk([view], [view.shape[0]], spec))
        else:
            run.extend(parts)
            run_lens.append(sum(p.shape[0] for p in parts))
    if run_lens or not chunks:
        chunks.append(chunk(run, run_lens, spec))
    return chunked(chunks, type=spec.routes_type)


def rectangular(rows: Any, expected: str) -> np.ndarray:
    """``np.asarray(rows)``; `RouteShapeError` (``"{expected}, found {why}"``) if numpy refuses."""
    try:
        return np.asarray(rows)
    except (ValueError, TypeError) as exc:
        raise RouteShapeError(f"{expected}, found {exc}") from exc


def as_route_rows(routes: Any, spec: RouteSpec, *, what: str = "routes") -> np.ndarray:
    """Numpy or Arrow per-token routes as numpy ``[rows, L, K]``, shape and dtype checked
    (ids: `r3arrow.ids.check_routes`).
    """
    if isinstance(routes, pa.Array | pa.ChunkedArray):
        return routes_to_numpy(routes, spec)
    arr = rectangular(routes, f"{what}: expected a rectangular [rows, L, K] integer array")
    if arr.dtype.kind not in "iu":
        if arr.size == 0 and arr.dtype.kind == "f":
            arr = arr.astype(spec.dtype)
        else:
            raise RouteDTypeError(f"{what}: expected an integer array, found dtype {arr.dtype}")
    if arr.ndim != 3 or arr.shape[1:] != spec.row_shape:
        raise RouteShapeError(
            f"{what}: expected shape [rows, {spec.num_layers}, {spec.topk}], "
            f"found {list(arr.shape)}"
        )
    return arr


def dummy_route_row(spec: RouteSpec) -> np.ndarray:
    """The padding row ``[0, 1, ..., K-1]`` on every layer, shape ``[L, K]``, storage dtype."""
    return np.broadcast_to(np.arange(spec.topk, dtype=spec.dtype), spec.row_shape)


def validate_layers(layers: Iterable[int], spec: RouteSpec) -> list[int]:
    """``layers`` as a list; `RouteShapeError` unless each is a router layer of ``spec``."""
    out = [int(i) for i in layers]
    known = set(spec.router_layers)
    if bad := [i for i in out if i not in known]:
        raise RouteShapeError(
            f"expected router layers from {list(spec.router_layers)}, found {bad}"
        )
    return out
