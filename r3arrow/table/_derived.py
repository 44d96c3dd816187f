"""Columns derived from a rollout table, and row selection that keeps every column attached.

``docs/design.md``, "Router padding mask and dummy rows". Selection keeps the schema
metadata and, for a validated source, marks the result validated.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from r3arrow._schema import (
    captured_lengths,
    list_lengths,
    require_routes,
    route_spec,
    sequence_lengths,
)
from r3arrow._validated import is_validated, mark_validated
from r3arrow.spec import routes_to_numpy


def _ragged_positions(lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(offsets [B+1], parent [T], position-in-row [T]) for rows of the given lengths."""
    offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
    parent = np.repeat(np.arange(lengths.size, dtype=np.int64), lengths)
    pos = np.arange(offsets[-1], dtype=np.int64) - offsets[:-1][parent]
    return offsets, parent, pos


def router_padding_mask(table: pa.Table | pa.RecordBatch) -> pa.LargeListArray[Any]:
    """``large_list<bool>`` over prompt+response: True where no route was captured.

    Raises `SchemaError` for an R3-off table (a mask there would only hide a replay mistake).
    """
    require_routes(table, "router_padding_mask")
    total = sequence_lengths(table)
    offsets, parent, pos = _ragged_positions(total)
    flags = pos >= captured_lengths(table)[parent]
    return pa.LargeListArray.from_arrays(
        pa.array(offsets, type=pa.int64()), pa.array(flags, type=pa.bool_())
    )


def _join_prompt_response(
    table: pa.Table | pa.RecordBatch,
    prompt: np.ndarray | None,
    response: str,
    dtype: Any,
    typ: pa.DataType,
) -> pa.LargeListArray[Any]:
    """Per trajectory, ``prompt`` values (None = zeros) then the ``response`` column's values."""
    plen = list_lengths(table.column("prompt_ids"))
    offsets, parent, pos = _ragged_positions(plen + list_lengths(table.column("response_ids")))
    out = np.zeros(offsets[-1], dtype=dtype)
    is_prompt = pos < plen[parent]
    if prompt is not None:
        out[is_prompt] = prompt
    out[~is_prompt] = np.asarray(
        pc.list_flatten(table.column(response)).to_numpy(zero_copy_only=False)
    )
    return pa.LargeListArray.from_arrays(
        pa.array(offsets, type=pa.int64()), pa.array(out, type=typ)
    )


def sequence_loss_mask(table: pa.Table | pa.RecordBatch) -> pa.LargeListArray[Any]:
    """``large_list<uint8>`` over prompt+response: 0 on the prompt, the response mask after."""
    return _join_prompt_response(table, None, "loss_mask", np.uint8, pa.uint8())


def input_ids(table: pa.Table | pa.RecordBatch) -> pa.LargeListArray[Any]:
    """``large_list<int32>``: prompt_ids followed by response_ids, per trajectory."""
    prompt = np.asarray(pc.list_flatten(table.column("prompt_ids")).to_numpy(zero_copy_only=False))
    return _join_prompt_response(table, prompt, "response_ids", np.int32, pa.int32())


def flat_routes(table: pa.Table | pa.RecordBatch) -> tuple[np.ndarray, np.ndarray]:
    """(routes ``[sum(captured), L, K]``, offsets ``[B+1]``), zero-copy for one chunk;
    `SchemaError` for an R3-off table."""
    require_routes(table, "flat_routes")
    raw = table.column("routes")
    if isinstance(raw, pa.ChunkedArray):
        raw = raw.combine_chunks() if raw.num_chunks != 1 else raw.chunk(0)
    col = cast("pa.LargeListArray[Any]", raw)
    spec = route_spec(table)
    offsets = np.asarray(col.offsets, dtype=np.int64)
    values = routes_to_numpy(col.flatten(), spec)
    return values, offsets - offsets[0]


def _keep_metadata(result: pa.Table, source: pa.Table) -> pa.Table:
    return (
        result
        if result.schema.metadata == source.schema.metadata
        else result.replace_schema_metadata(source.schema.metadata)
    )


def _selected(result: pa.Table, source: pa.Table) -> pa.Table:
    """``result`` (rows of ``source``, metadata kept), marked validated if ``source`` was."""
    out = _keep_metadata(result, source)
    if is_validated(source):
        mark_validated(out)
    return out


def take_rows(table: pa.Table, indices: Any) -> pa.Table:
    """Rows at ``indices`` (every column, schema metadata kept); R3 on or off."""
    idx = np.asarray(
        indices.to_numpy(zero_copy_only=False) if isinstance(indices, pa.Array) else indices
    )
    if idx.size and idx.dtype.kind not in "iu":
        raise TypeError(f"take_rows: expected integer row indices, found dtype {idx.dtype}")
    if idx.ndim != 1:
        raise ValueError(f"take_rows: expected a 1-D index array, found shape {list(idx.shape)}")
    return _selected(table.take(pa.array(idx, type=pa.int64())), table)


def filter_rows(table: pa.Table, mask: Any) -> pa.Table:
    """Rows where ``mask`` is true (every column, schema metadata kept); R3 on or off."""
    m = (
        mask
        if isinstance(mask, pa.Array | pa.ChunkedArray)
        else pa.array(np.asarray(mask, dtype=bool))
    )
    if len(m) != table.num_rows:
        raise ValueError(f"filter mask: expected {table.num_rows} values, found {len(m)}")
    return _selected(table.filter(m), table)


def with_columns(table: pa.Table, columns: Mapping[str, pa.Array[Any]]) -> pa.Table:
    """Append or replace columns, keeping schema metadata."""
    out = table
    for name, col in columns.items():
        if name in out.schema.names:
            out = out.set_column(out.schema.get_field_index(name), name, col)
        else:
            out = out.append_column(name, col)
    return _keep_metadata(out, table)
