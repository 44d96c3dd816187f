"""Trust boundary of the rollout readers (``docs/design.md``, "Persistence").

Footer (`footer_spec`, `file_spec`), storage before restoring (`check_storage`: a null
token in binary storage would come back as zeros) and restored rows (`check_table`); what
Arrow or the OS raise becomes a `SchemaError` naming the file (`reading`).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from r3arrow._schema import (
    ROLLOUT_COLUMNS,
    SCHEMA_VERSION,
    VERSION_KEY,
    list_lengths,
    missing_routes,
)
from r3arrow._validated import mark_validated
from r3arrow.errors import R3ArrowError, RouteShapeError, SchemaError
from r3arrow.ids import check_routes
from r3arrow.io._groups import check_group_schema
from r3arrow.spec import SPEC_METADATA_KEY, RouteSpec, routes_to_numpy
from r3arrow.table import rollout_schema, validate_rollouts

#: Versions this reader understands.
KNOWN_VERSIONS: tuple[str, ...] = (SCHEMA_VERSION,)
#: Schema metadata key of the hex SHA-256 over every other ``r3arrow.*`` metadata value.
META_SHA_KEY = b"r3arrow.meta_sha256"
_PREFIX = b"r3arrow."

#: What Arrow, the OS and metadata decoding raise for a file that is not what it claims.
READ_ERRORS: tuple[type[BaseException], ...] = (
    pa.ArrowException,
    OSError,
    ValueError,
    TypeError,
    KeyError,
    IndexError,
    OverflowError,
    MemoryError,
)

# Types of the non-routes core columns (they do not depend on the spec).
_CORE_TYPES: dict[str, pa.DataType] = {f.name: f.type for f in rollout_schema(None)}


@contextlib.contextmanager
def reading(path: Path, kind: str = "rollout") -> Iterator[None]:
    """Re-raise r3arrow errors with ``path`` set, what Arrow/OS raise as `SchemaError`
    ("expected an r3arrow ``kind`` Parquet file").
    """
    try:
        yield
    except R3ArrowError as exc:
        if exc.path is not None:
            raise
        out = copy.copy(exc)  # same type and fields, the path set and prefixed
        out.path = str(path)
        out.message = f"{path}: {exc.message}"
        out.args = (out.message,)
        raise out from exc
    except READ_ERRORS as exc:
        raise SchemaError(
            f"{path}: expected an r3arrow {kind} Parquet file, found an unreadable or corrupt "
            f"file ({type(exc).__name__}: {exc})",
            path=path,
        ) from exc


def meta_digest(meta: dict[bytes, bytes]) -> bytes:
    """Hex SHA-256 over every ``r3arrow.*`` key and value but its own, sorted, length-prefixed."""
    h = hashlib.sha256()
    for key in sorted(k for k in meta if k.startswith(_PREFIX) and k != META_SHA_KEY):
        for part in (key, meta[key]):
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)
    return h.hexdigest().encode()


def sealed(meta: dict[bytes, bytes]) -> dict[bytes, bytes]:
    """``meta`` with ``r3arrow.meta_sha256`` set to its `meta_digest` (what writers store)."""
    return {**meta, META_SHA_KEY: meta_digest(meta)}


def unsealed(table: pa.Table) -> pa.Table:
    """``table`` without the ``r3arrow.meta_sha256`` key (a property of the file, not the rows)."""
    meta = table.schema.metadata
    if not meta or META_SHA_KEY not in meta:
        return table
    return table.replace_schema_metadata({k: v for k, v in meta.items() if k != META_SHA_KEY})


def table_spec(table: pa.Table) -> RouteSpec | None:
    """The spec in ``table``'s metadata, ``None`` without one (R3 off)."""
    meta = table.schema.metadata or {}
    return RouteSpec.from_schema(table.schema) if SPEC_METADATA_KEY in meta else None


def _metadata(schema: pa.Schema) -> dict[bytes, bytes]:
    raw = schema.metadata or {}
    return {bytes(k): bytes(v) for k, v in raw.items()}


def file_spec(schema: pa.Schema) -> RouteSpec | None:
    """A rollout file's spec (``None``: R3 off) once its Arrow schema is checked: r3arrow
    metadata, version, checksum (if present), spec and ``routes`` together, layer groups.
    `SchemaError` without a path (the caller's `reading` adds it).
    """
    meta = _metadata(schema)
    if not any(k.startswith(_PREFIX) for k in meta):
        raise SchemaError(
            f"not a rollout file: expected r3arrow metadata ({VERSION_KEY.decode()!r}, "
            f"{SPEC_METADATA_KEY.decode()!r}), found a file without it (columns {schema.names})"
        )
    want = meta.get(META_SHA_KEY)
    if want is not None and want != meta_digest(meta):
        raise SchemaError(
            f"metadata key {META_SHA_KEY.decode()!r}: expected the SHA-256 of the r3arrow "
            f"metadata, found a mismatch (the spec or storage metadata is corrupt)"
        )
    version = meta.get(VERSION_KEY)
    if version is not None and version.decode(errors="replace") not in KNOWN_VERSIONS:
        raise SchemaError(
            f"metadata key {VERSION_KEY.decode()!r}: expected one of {list(KNOWN_VERSIONS)}, "
            f"found {version.decode(errors='replace')!r:.80}"
        )
    has_routes = "routes" in schema.names
    if SPEC_METADATA_KEY not in meta:
        if version is None:  # r3arrow.* keys, but neither a version nor a spec
            raise SchemaError(
                f"not a rollout file: expected metadata key {SPEC_METADATA_KEY.decode()!r} or "
                f"{VERSION_KEY.decode()!r}, found keys "
                f"{sorted(k.decode(errors='replace') for k in meta)}"
            )
        if has_routes:
            raise SchemaError(
                f"column 'routes': expected metadata key {SPEC_METADATA_KEY.decode()!r} "
                f"beside it, found none"
            )
        return None  # R3 off: no routes, no spec
    spec = RouteSpec.from_schema(schema)
    if not has_routes:
        raise SchemaError(
            f"expected column 'routes' ({SPEC_METADATA_KEY.decode()!r} is set), "
            f"found columns {schema.names}"
        )
    check_group_schema(schema, spec)
    return spec


def footer_spec(pf: pq.ParquetFile) -> RouteSpec | None:
    """`file_spec` of an open file whose two metadata copies (key-value pairs, Arrow schema)
    agree and whose row groups add up to its rows; else `SchemaError` (path: `reading`)."""
    schema = pf.schema_arrow
    spec = file_spec(schema)
    md = pf.metadata
    groups = sum(md.row_group(g).num_rows for g in range(md.num_row_groups))
    if groups != md.num_rows:
        raise SchemaError(
            f"expected the row groups to hold the file's {md.num_rows} rows, found {groups} "
            f"(corrupt footer)"
        )
    kv = {bytes(k): bytes(v) for k, v in (md.metadata or {}).items()}
    kv.pop(b"ARROW:schema", None)
    arrow = _metadata(schema)
    if kv != arrow:
        keys = sorted(k.decode(errors="replace") for k in set(kv) ^ set(arrow)) or sorted(
            k.decode(errors="replace") for k in kv if kv[k] != arrow.get(k)
        )
        raise SchemaError(
            f"expected the footer key-value metadata to match the Arrow schema's, found a "
            f"difference in {keys} (corrupt footer)"
        )
    return spec


def check_rows(found: int, want: int, what: str) -> None:
    """`SchemaError` unless ``found`` is the ``want`` rows the footer promised for ``what``."""
    if found != want:
        raise SchemaError(f"expected {want} rows in {what} (footer), read {found} (corrupt file)")


def check_storage(table: pa.Table) -> None:
    """Core columns (routes tokens in storage form) free of nulls at any list level, else
    `SchemaError`."""
    for name in ROLLOUT_COLUMNS:
        if name not in table.schema.names:
            continue
        if rows := table.column(name).null_count:
            raise SchemaError(f"column {name!r}: expected no null rows, found {rows}")
        items = 0
        for level in table.column(name).chunks:
            while pa.types.is_large_list(level.type) or pa.types.is_list(level.type):
                level = cast("pa.LargeListArray[Any]", level).flatten()
                items += level.null_count
        if items:
            what = "tokens" if name == "routes" else "values"
            raise SchemaError(f"column {name!r}: expected no null {what}, found {items}")


def _check_types(table: pa.Table, spec: RouteSpec | None) -> None:
    want = _CORE_TYPES if spec is None else {**_CORE_TYPES, "routes": spec.routes_type}
    for name, typ in want.items():
        if name not in table.schema.names:
            continue
        found = table.schema.field(name).type
        if found != typ or str(found) != str(typ):  # ``==`` ignores list child names
            raise SchemaError(f"column {name!r}: expected {typ}, found {found}")


def _not_null_core(table: pa.Table) -> pa.Table:
    """Core fields declared not-null, as rollout.v1 has them (their nulls were counted: none)."""
    fields = [
        f.with_nullable(False) if f.nullable and f.name in ROLLOUT_COLUMNS else f
        for f in table.schema
    ]
    if fields == list(table.schema):
        return table
    schema = pa.schema(fields, metadata=cast("Any", table.schema.metadata))
    return pa.Table.from_arrays(table.columns, schema=schema)


def _check_lengths(table: pa.Table) -> None:
    """Loss-mask and route-row counts of whichever core columns a projection kept."""
    names = set(table.schema.names)
    if "response_ids" not in names:
        return
    rlen = list_lengths(table.column("response_ids"))
    if "loss_mask" in names:
        mlen = list_lengths(table.column("loss_mask"))
        if (bad := np.flatnonzero(mlen != rlen)).size:
            i = int(bad[0])
            raise SchemaError(
                f"row {i}: column 'loss_mask': expected {rlen[i]} values (one per response "
                f"token), found {mlen[i]}",
                row=i,
            )
    if "prompt_ids" in names and "routes" in names:
        tokens = rlen + list_lengths(table.column("prompt_ids"))
        cap = list_lengths(table.column("routes"))
        if (bad := np.flatnonzero(cap > tokens)).size:
            i = int(bad[0])
            raise RouteShapeError(
                f"row {i}: column 'routes': expected at most {tokens[i]} route rows (tokens), "
                f"found {cap[i]}",
                row=i,
            )


def _check_ids(table: pa.Table, spec: RouteSpec, skip: tuple[str, ...]) -> None:
    """The :mod:`r3arrow.ids` rules on every routes-typed column not in ``skip``, per chunk."""
    for field in table.schema:
        if field.type != spec.routes_type or field.name in skip:
            continue
        start = 0
        for chunk in table.column(field.name).chunks:
            lists = cast("pa.LargeListArray[Any]", chunk)
            flat = routes_to_numpy(lists.flatten(), spec)
            try:
                check_routes(flat, spec, what=f"column {field.name!r}")
            except R3ArrowError as exc:
                if exc.token is not None:  # name the trajectory the token belongs to
                    offsets = np.asarray(lists.offsets, dtype=np.int64)
                    rel = offsets - offsets[0]
                    exc.row = start + int(np.searchsorted(rel, exc.token, side="right")) - 1
                raise
            start += len(chunk)


def check_table(table: pa.Table, spec: RouteSpec | None, *, projected: bool = False) -> pa.Table:
    """A restored table (or projection) validated and marked so: `validate_rollouts`, or the
    rules of the columns a projection kept; other routes-typed columns get the id rules.
    """
    _check_types(table, spec)
    names = set(table.schema.names)
    core = [c for c in ROLLOUT_COLUMNS if spec is not None or c != "routes"]
    if not projected and (missing := [c for c in core if c not in names]):
        raise SchemaError(
            f"expected rollout columns {missing} (schema rollout.v1), found columns "
            f"{table.schema.names}"
        )
    whole = set(core) <= names
    if whole:
        validate_rollouts(table)
    else:
        _check_lengths(table)
        if "routes" in names:  # the marks of the rows read (a projection reads them with routes)
            missing_routes(table)
    if spec is not None:
        _check_ids(table, spec, skip=("routes",) if whole else ())
    return mark_validated(_not_null_core(table))
