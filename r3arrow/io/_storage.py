"""Routes storage dispatcher, the only module that knows both stored forms:
``layer_groups/v1`` (`r3arrow.io._groups`) and ``nested_list/v1`` (`r3arrow.io._portable`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import pyarrow as pa

from r3arrow._schema import list_lengths
from r3arrow._typing import ArrowArray
from r3arrow.errors import SchemaError
from r3arrow.io._groups import (
    GROUP_FORMAT,
    group_leaves,
    plan_groups,
    restore_groups,
    to_group_storage,
    token_rows,
)
from r3arrow.io._portable import (
    PORTABLE_FORMAT,
    from_portable,
    is_portable_type,
    portable_tokens,
    to_portable,
)
from r3arrow.io._project import STORAGE_KEY, project_layers, storage_info
from r3arrow.spec import SPEC_METADATA_KEY, RouteSpec, routes_to_numpy


def to_storage(
    table: pa.Table, *, portable: bool = False, layer_group: int | Sequence[int] | None = None
) -> pa.Table:
    """What Parquet stores: routes in layer groups (``layer_group`` as `plan_groups`) or
    portable lists; an R3-off table as is.
    """
    if SPEC_METADATA_KEY not in (table.schema.metadata or {}):
        return table
    if portable:
        return to_portable(table)
    spec = RouteSpec.from_schema(table.schema)
    return to_group_storage(table, plan_groups(spec.num_layers, layer_group))


def restore(table: pa.Table, layers: Sequence[int] | None = None) -> pa.Table:
    """A storage-form table restored and projected to the global ``layers`` (a layer-group
    table decodes only their groups), the storage key dropped.
    """
    meta = cast("dict[bytes, bytes]", dict(table.schema.metadata or {}))
    if SPEC_METADATA_KEY not in meta:
        return table
    info = storage_info(meta)
    spec = RouteSpec.from_schema(table.schema)
    if info is not None and info["format"] == GROUP_FORMAT:
        return restore_groups(table, spec, info, layers)
    if info is not None:
        if info["format"] != PORTABLE_FORMAT:
            raise SchemaError(
                f"routes storage: expected format {GROUP_FORMAT!r} or {PORTABLE_FORMAT!r}, "
                f"found {info['format']!r}"
            )
        meta.pop(STORAGE_KEY)
        table = from_portable(table, info["columns"]).replace_schema_metadata(meta)
    return table if layers is None else project_layers(table, layers)


def read_leaves(
    schema: pa.Schema, columns: Sequence[str] | None, layers: Sequence[int] | None
) -> list[str] | None:
    """The Parquet column paths to read for ``columns`` and ``layers`` (``None``: all; names
    the file lacks, a root's ``step``, are skipped; a layer-group file reads only the groups
    holding ``layers``).
    """
    names = None if columns is None else [c for c in columns if c in schema.names]
    info = storage_info(cast("dict[bytes, bytes] | None", schema.metadata))
    if layers is None or info is None or info["format"] != GROUP_FORMAT:
        return names
    return group_leaves(schema, info, names, layers)


def route_rows(col: ArrowArray, spec: RouteSpec, name: str) -> tuple[np.ndarray, np.ndarray]:
    """(rows ``[T, L, K]``, lengths int64 ``[B]``) of a ragged routes column, nested, portable
    or layer-group storage: a view for one chunk and group, else one copy. `SchemaError`
    naming column ``name`` for another column or one that does not fit ``spec``.
    """
    arr: pa.Array[Any]
    if isinstance(col, pa.ChunkedArray):
        arr = cast("pa.Array[Any]", col.combine_chunks() if col.num_chunks != 1 else col.chunk(0))
    else:
        arr = col
    if not (pa.types.is_large_list(arr.type) or pa.types.is_list(arr.type)):
        raise SchemaError(
            f"column {name!r}: expected a large_list of per-token routes, found {arr.type}"
        )
    values = cast("pa.LargeListArray[Any]", arr).flatten()
    if pa.types.is_struct(values.type):
        return token_rows(values, spec, name), list_lengths(arr)
    if is_portable_type(values.type):
        values = portable_tokens(values, spec, name)
    return routes_to_numpy(values, spec), list_lengths(arr)
