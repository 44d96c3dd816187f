"""Inverse collation: what the trainer's routers saw → a routes column aligned to trajectories.

Contract and the layout rules it inverts: ``docs/train-routes.md``. Index arithmetic over all
captured tokens at once: one gather per microbatch, no loop per token.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from r3arrow._checks import check_int
from r3arrow._routes import chunk
from r3arrow.collate._microbatch import Microbatch
from r3arrow.errors import DuplicateExpertError, ExpertRangeError, RouteDTypeError, RouteShapeError
from r3arrow.ids import check_routes
from r3arrow.spec import RouteSpec


def _as_numpy(x: Any) -> np.ndarray:
    """A numpy view of a tensor (any device: copied to the host) or array-like."""
    if hasattr(x, "detach"):
        return np.asarray(x.detach().cpu().numpy())
    return np.asarray(x)


def _pieces(mb: Microbatch, routes: Any) -> list[Mapping[int, Any]]:
    """The per-rank mappings, in rank order (CP-major, then TP under sequence parallelism)."""
    tp_pieces = mb.tp_size if mb.sequence_parallel else 1
    count = mb.cp_size * tp_pieces
    if isinstance(routes, Mapping):
        pieces: list[Any] = [routes]
    elif isinstance(routes, Sequence) and not isinstance(routes, str | bytes):
        pieces = list(routes)
    else:
        raise TypeError(
            "per_layer_routes: expected a mapping {global layer id: [tokens, K] tensor} or a "
            f"list of them (one per rank), found {type(routes).__name__}"
        )
    if len(pieces) != count:
        how = f"one per CP rank ({mb.cp_size}) times TP rank ({tp_pieces}, sequence parallel)"
        raise ValueError(
            f"per_layer_routes: expected {count} rank piece(s), "
            f"{how + ', CP-major' if count > 1 else 'one mapping (no CP or SP split)'}; "
            f"found {len(pieces)}"
        )
    for i, p in enumerate(pieces):
        if not isinstance(p, Mapping):
            raise TypeError(
                f"per_layer_routes[{i}]: expected a mapping {{global layer id: tensor}}, "
                f"found {type(p).__name__}"
            )
    return pieces


def _recorded(piece: Mapping[int, Any], r: int, need: list[int], tokens: int, k: int) -> list[Any]:
    """Rank ``r``'s ids of each layer of ``need``, checked: exactly those layers, integer
    ``[tokens, K]`` arrays."""
    keys = {check_int(g, f"per_layer_routes[{r}] key") for g in piece}
    missing, extra = sorted(set(need) - keys), sorted(keys - set(need))
    if missing or extra:
        why = f"per_layer_routes[{r}]: expected routes of router layers {need} (the spec's "
        why += f"router rows), found layers {sorted(keys)}"
        if missing:
            why += f"; missing {missing} (gather them from every pipeline stage, or project "
            why += "the table to the recorded layers)"
        if extra:
            why += f"; unexpected {extra}"
        if missing and extra:
            why += " (a layer-projected table: pass layers=r3arrow.table.route_layers(table))"
        raise RouteShapeError(why, layer=(missing or extra)[0])
    out = []
    for g in need:
        a = _as_numpy(piece[g])
        what = f"per_layer_routes[{r}][{g}]: expected"
        if a.dtype.kind not in "iu":
            raise RouteDTypeError(f"{what} integer expert ids, found {a.dtype}", layer=g)
        if a.shape != (tokens, k):
            raise RouteShapeError(
                f"{what} [{tokens}, {k}] (the router tokens of one rank, top-k), found "
                f"{list(a.shape)}",
                layer=g,
            )
        out.append(a)
    return out


def _source(pieces: list[Mapping[int, Any]], need: list[int], tokens: int, k: int) -> np.ndarray:
    """``[L_router, ranks * tokens, K]``: every rank's recorded ids, rank after rank."""
    arrays = [_recorded(piece, r, need, tokens, k) for r, piece in enumerate(pieces)]
    dtype = np.result_type(*(a.dtype for row in arrays for a in row))
    src = np.empty((len(need), len(pieces) * tokens, k), dtype=dtype)
    for r, row in enumerate(arrays):  # one block copy per (rank, layer): inputs are separate
        np.stack(row, out=src[:, r * tokens : (r + 1) * tokens])
    return src


def _source_index(mb: Microbatch) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(trajectory, token, index into `_source`'s token axis) of every captured token."""
    cap = np.asarray(mb.captured, dtype=np.int64)
    n = np.asarray(mb.seq_lens, dtype=np.int64)
    if cap.shape != n.shape or cap.ndim != 1 or bool((cap > n).any()) or bool((cap < 0).any()):
        raise RouteShapeError(
            f"microbatch: expected 0 <= captured <= seq_lens per sequence, found captured "
            f"{cap.tolist()} for seq_lens {n.tolist()}"
        )
    b = int(cap.shape[0])
    traj = np.repeat(np.arange(b, dtype=np.int64), cap)
    starts = np.cumsum(cap) - cap
    tok = np.arange(int(cap.sum()), dtype=np.int64) - np.repeat(starts, cap)
    cols, pos_local = (int(d) for d in mb.padding_mask.shape)
    cp = mb.cp_size
    if mb.packed:
        if mb.cu_seqlens_padded is None:
            raise RouteShapeError("microbatch: expected cu_seqlens_padded on a packed microbatch")
        cup = _as_numpy(mb.cu_seqlens_padded).astype(np.int64)
        seg = np.diff(cup)
        if (
            cup.shape[0] != b + 1
            or int(cup[-1]) != pos_local * cp
            or (cp > 1 and bool((seg % (2 * cp)).any()))
        ):
            raise RouteShapeError(
                f"microbatch: expected cu_seqlens_padded of {b + 1} offsets ending at "
                f"{pos_local * cp} (segments divisible by {2 * cp} under CP), "
                f"found {cup.tolist()}"
            )
        base, width = cup[:-1][traj], seg[traj]
    else:
        if cols != b or (cp > 1 and pos_local % 2):
            raise RouteShapeError(
                f"microbatch: expected padding_mask [{b}, S] (S even with CP), found "
                f"{list(mb.padding_mask.shape)}"
            )
        base, width = np.zeros_like(traj), np.full_like(traj, pos_local * cp)
    # CP rank r holds chunks r and 2cp-1-r of each sequence; without CP, one chunk: all of it
    chunk = width // (2 * cp) if cp > 1 else width
    j, o = tok // chunk, tok % chunk
    late = j >= cp
    rank = np.where(late, 2 * cp - 1 - j, j)
    local = np.where(late, chunk, 0) + o
    flat = base // cp + local if mb.packed else local * cols + traj
    per_rank = pos_local * cols  # router tokens of one CP rank before the SP split
    tp_pieces = mb.tp_size if mb.sequence_parallel else 1
    per = per_rank // tp_pieces
    src = (rank * tp_pieces + flat // per) * per + flat % per
    return traj, tok, src


def uncollate_routes(
    microbatch: Microbatch,
    per_layer_routes: Mapping[int, Any] | Sequence[Mapping[int, Any]],
    *,
    spec: RouteSpec | None = None,
    layers: Sequence[int] | None = None,
) -> pa.LargeListArray[Any]:
    """The trainer routers' routes as a ``spec.routes_type`` column aligned to ``microbatch``.

    ``per_layer_routes``: ``RouteRecorder.take()``, ``{global layer id: [tokens, K] integer
    tensor or array}`` (``tokens = microbatch.num_router_tokens``), or with CP or SP the
    list of every rank's, CP-major then TP. ``spec``: the table's (default
    ``microbatch.spec``); ``layers``: the global layer of each route row (default
    ``range(spec.num_layers)``). Row i holds ``microbatch.captured[i]`` route rows; dense
    rows are zeros.

    Raises, before allocating the output, `TypeError`/`ValueError` for misuse (argument
    types, the number of rank pieces, ``layers`` of the wrong length), `RouteShapeError`
    for missing or extra layers, a wrong shape or an inconsistent microbatch,
    `RouteDTypeError` for non-integer ids, and `ExpertRangeError`/`DuplicateExpertError`
    (``row``, ``token``, ``layer`` set) for ids out of range or repeated. The contract in
    full: ``docs/train-routes.md``.
    """
    if not isinstance(microbatch, Microbatch):
        raise TypeError(f"microbatch: expected a Microbatch, found {type(microbatch).__name__}")
    if spec is None:
        spec = microbatch.spec
        if spec is None:
            raise ValueError(
                "spec: expected the table's RouteSpec (the microbatch was collated with R3 off "
                "and carries none), found None"
            )
    elif not isinstance(spec, RouteSpec):
        raise TypeError(f"spec: expected a RouteSpec, found {type(spec).__name__}")
    if layers is None:
        ids: Sequence[int] = range(spec.num_layers)
    elif isinstance(layers, str | bytes) or not isinstance(layers, Sequence):
        raise TypeError(f"layers: expected a sequence of ints, found {type(layers).__name__}")
    else:
        ids = [check_int(g, "layers[i]", minimum=0) for g in layers]
        if len(ids) != spec.num_layers:
            raise ValueError(
                f"layers: expected one global id per route row of the spec ({spec.num_layers}), "
                f"found {len(ids)}"
            )
        if len(set(ids)) != len(ids):
            raise ValueError(f"layers: expected distinct global layer ids, found {ids}")
    pieces = _pieces(microbatch, per_layer_routes)
    rows = list(spec.router_layers)
    need = [ids[j] for j in rows]
    src = _source(pieces, need, microbatch.num_router_tokens, spec.topk)
    traj, tok, index = _source_index(microbatch)
    picked = src[:, index, :]  # [L_router, captured tokens, K]: the one gather
    try:  # the id rules on the captured tokens, errors located in the table
        bound = spec.num_experts
        check_routes(
            picked,
            num_experts=int(np.iinfo(spec.dtype).max) + 1 if bound is None else bound,
            layer_ids=need,
            layers_first=True,
            what="recorded routes",
        )
    except (ExpertRangeError, DuplicateExpertError) as exc:
        at = exc.token
        if at is None:
            raise
        hint = "" if bound is not None else f" (spec storage {spec.dtype}, num_experts unknown)"
        raise type(exc)(
            f"{exc.message}{hint}; trajectory row {int(traj[at])}, token {int(tok[at])}",
            row=int(traj[at]),
            token=int(tok[at]),
            layer=exc.layer,
        ) from None
    out = np.zeros((index.shape[0], spec.num_layers, spec.topk), dtype=spec.dtype)
    out[:, rows, :] = picked.transpose(1, 0, 2)
    out.flags.writeable = False  # referenced by the column, not copied
    return chunk([out], np.asarray(microbatch.captured, dtype=np.int64).tolist(), spec)
