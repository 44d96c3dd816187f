"""Trust boundary of the rollout readers (``docs/design.md``, "Persistence").

Footer (`footer_spec`, `file_spec`), the decoded column buffers of each row group against
the digests the writer stored (`column_digests`, `row_digests`, `check_digests`;
``docs/storage.md``, "Integrity"), storage before restoring (`check_storage`: a null token
in binary storage would come back as zeros) and restored rows (`check_table`); what Arrow or
the OS raise becomes a `SchemaError` naming the file (`reading`).
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import xxhash

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
#: Schema metadata key of the XXH3-128 digests of each row group's decoded column buffers
#: and its fields (JSON ``{"algorithm", "fields", "columns", "row_groups": [{stream: hex}]}``,
#: sealed with the rest of the ``r3arrow.*`` metadata).
DIGEST_KEY = b"r3arrow.row_group_xxh3"
_ALGORITHM = "xxh3_128"

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
    """``table`` without the ``r3arrow.meta_sha256`` and `DIGEST_KEY` keys (properties of the
    file, not of the rows)."""
    meta = table.schema.metadata
    if not meta or not (META_SHA_KEY in meta or DIGEST_KEY in meta):
        return table
    keep = {k: v for k, v in meta.items() if k not in (META_SHA_KEY, DIGEST_KEY)}
    return table.replace_schema_metadata(keep)


def _fixed_width(typ: pa.DataType) -> int:
    """Bytes per value of a fixed-width, byte-aligned type; 0 for any other (booleans too)."""
    if (
        pa.types.is_boolean(typ)
        or pa.types.is_dictionary(typ)
        or pa.types.is_null(typ)
        or isinstance(typ, pa.ExtensionType)
    ):
        return 0
    try:
        bits = typ.bit_width
    except (ValueError, TypeError, NotImplementedError):  # variable width
        return 0
    return bits // 8 if bits % 8 == 0 else 0


def digestible(typ: pa.DataType) -> bool:
    """Whether `column_digests` covers a column of ``typ``: fixed-width (not boolean),
    binary/string, lists, fixed-size lists and structs of these."""
    if pa.types.is_list(typ) or pa.types.is_large_list(typ) or pa.types.is_fixed_size_list(typ):
        return digestible(typ.value_type)
    if pa.types.is_struct(typ):
        return typ.num_fields > 0 and all(digestible(f.type) for f in typ)
    if (
        pa.types.is_binary(typ)
        or pa.types.is_string(typ)
        or pa.types.is_large_binary(typ)
        or pa.types.is_large_string(typ)
    ):
        return True
    return _fixed_width(typ) > 0


def _span(buf: pa.Buffer | None, start: int, stop: int) -> memoryview:
    return memoryview(b"") if buf is None or stop <= start else memoryview(buf)[start:stop]


def _offsets(buf: Any, big: bool, n: int, off: int) -> np.ndarray:
    """The ``n + 1`` offsets of a (large) list or binary array sliced at ``off``."""
    if not n:
        return np.zeros(1, dtype=np.int64)
    dtype = np.int64 if big else np.int32
    return np.frombuffer(cast("Any", buf), dtype=dtype, count=n + 1, offset=off * (8 if big else 4))


def _feed(arr: pa.Array[Any], path: str, sink: dict[str, Any]) -> None:
    """Update the stream hashers of ``arr`` (no nulls; a `digestible` type): each list level's
    lengths (``path#len``) and each leaf's value bytes (``path``), slices honoured."""

    def update(name: str, data: Any) -> None:
        if (h := sink.get(name)) is None:
            h = sink[name] = xxhash.xxh3_128()
        h.update(data)

    if arr.null_count:
        update(path + "#null", np.int64(arr.null_count).tobytes())  # never written: a mismatch
        return
    typ = arr.type
    n, off = len(arr), arr.offset
    if (big := pa.types.is_large_list(typ)) or pa.types.is_list(typ):
        offs = _offsets(arr.buffers()[1], big, n, off)
        update(path + "#len", np.diff(offs).tobytes())
        _feed(cast("pa.LargeListArray[Any]", arr).flatten(), path + "[]", sink)
    elif pa.types.is_fixed_size_list(typ):
        _feed(cast("pa.FixedSizeListArray[Any]", arr).flatten(), path + "[]", sink)
    elif pa.types.is_struct(typ):
        for field, child in zip(typ, cast("pa.StructArray", arr).flatten(), strict=True):
            _feed(child, f"{path}.{field.name}", sink)
    elif (big := pa.types.is_large_binary(typ) or pa.types.is_large_string(typ)) or (
        pa.types.is_binary(typ) or pa.types.is_string(typ)
    ):
        bufs = arr.buffers()
        offs = _offsets(bufs[1], big, n, off)
        update(path + "#len", np.diff(offs).tobytes())
        update(path, _span(bufs[2], int(offs[0]), int(offs[-1])))
    else:
        width = _fixed_width(typ)
        update(path, _span(arr.buffers()[1], off * width, (off + n) * width))


def column_digests(table: pa.Table, columns: Sequence[str] | None = None) -> dict[str, str]:
    """``{stream: hex XXH3-128}`` of ``table``'s ``columns`` (default: all; `digestible`,
    else ``TypeError``), chunk by chunk: one pass over the buffers, at memory speed. A
    stream is a column's list lengths at one level or its values at one leaf (a layer-group
    routes column: one per group), so a projected read verifies what it decoded."""
    sink: dict[str, Any] = {}
    for name in table.schema.names if columns is None else columns:
        col = table.column(name)
        if not digestible(col.type):
            raise TypeError(f"column {name!r}: no digest for type {col.type}")
        for chunk in col.chunks:
            _feed(chunk, name, sink)
    return {k: h.hexdigest() for k, h in sink.items()}


def _shape(fields: Any, prefix: str = "") -> list[str]:
    """Each field of ``fields`` as ``path:type[:null]``, nested types by hand (their
    children follow), leaf types as Arrow prints them: what a footer flip could rename."""
    out: list[str] = []
    for f in fields:
        path, typ = prefix + f.name, f.type
        null = ":null" if f.nullable else ""
        if pa.types.is_large_list(typ) or pa.types.is_list(typ):
            kind = "large_list" if pa.types.is_large_list(typ) else "list"
            out += [f"{path}:{kind}{null}", *_shape([typ.value_field], path + ".")]
        elif pa.types.is_fixed_size_list(typ):
            out += [f"{path}:fixed_size_list[{typ.list_size}]{null}"]
            out += _shape([typ.value_field], path + ".")
        elif pa.types.is_struct(typ):
            out += [f"{path}:struct{null}", *_shape(list(typ), path + ".")]
        else:
            out.append(f"{path}:{typ}{null}")
    return out


def row_digests(
    schema: pa.Schema, num_row_groups: int
) -> tuple[frozenset[str], list[dict[str, str]]] | None:
    """(the columns digested, each row group's ``{stream: hex}``) of a checked file schema,
    ``None`` for a file without `DIGEST_KEY` (written before it: page checksums only);
    `SchemaError` for a record that is not one digest map per row group or whose fields
    (names, nesting, types, nullability) are not ``schema``'s (a flipped footer name)."""
    raw = (schema.metadata or {}).get(DIGEST_KEY)
    if raw is None:
        return None
    try:
        info = orjson.loads(raw)
        algorithm = info["algorithm"]
        columns = frozenset(str(c) for c in info["columns"])
        groups = [{str(k): str(v) for k, v in g.items()} for g in info["row_groups"]]
        shape = [str(f) for f in info["fields"]]
    except (orjson.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise SchemaError(
            f"metadata key {DIGEST_KEY.decode()!r}: expected {{algorithm, fields, columns, "
            f"row_groups}} JSON, found {raw!r:.120}"
        ) from exc
    if algorithm != _ALGORITHM or len(groups) != num_row_groups:
        raise SchemaError(
            f"metadata key {DIGEST_KEY.decode()!r}: expected {_ALGORITHM!r} digests of "
            f"{num_row_groups} row groups, found {algorithm!r:.40} digests of {len(groups)}"
        )
    if shape != (found := _shape(schema)):
        diff = sorted(set(shape) ^ set(found))
        raise SchemaError(
            f"expected the fields written (metadata key {DIGEST_KEY.decode()!r}), found "
            f"others: {diff[:4]!r:.200} (corrupt footer)"
        )
    return columns, groups


def digest_record(storage: pa.Table, bounds: Sequence[tuple[int, int]]) -> bytes:
    """The `DIGEST_KEY` value of ``storage`` written as row groups ``bounds`` (none: one
    empty row group): every `digestible` column without nulls, per row group."""
    columns = [
        f.name
        for f in storage.schema
        if digestible(f.type) and not _has_nulls(storage.column(f.name))
    ]
    spans = bounds or [(0, 0)]
    groups = [column_digests(storage.slice(a, b - a), columns) for a, b in spans]
    record = {
        "algorithm": _ALGORITHM,
        "fields": _shape(storage.schema),
        "columns": columns,
        "row_groups": groups,
    }
    return orjson.dumps(record)


def _has_nulls(col: pa.ChunkedArray[Any]) -> bool:
    """Nulls at any level of ``col`` (lists, fixed-size lists and struct children)."""

    def walk(arr: pa.Array[Any]) -> bool:
        if arr.null_count:
            return True
        typ = arr.type
        if pa.types.is_struct(typ):
            return any(walk(c) for c in cast("pa.StructArray", arr).flatten())
        if pa.types.is_list(typ) or pa.types.is_large_list(typ) or pa.types.is_fixed_size_list(typ):
            return walk(cast("pa.LargeListArray[Any]", arr).flatten())
        return False

    return any(walk(c) for c in col.chunks)


def check_digests(
    table: pa.Table, columns: frozenset[str], want: dict[str, str], what: str
) -> None:
    """`SchemaError` (no path: the caller's `reading` adds it) unless every stream of the
    decoded ``table``'s digested ``columns`` (one row group's, or fewer leaves) has the
    digest written in ``want``."""
    names = [n for n in table.schema.names if n in columns]
    for stream, found in column_digests(table, names).items():
        expected = want.get(stream)
        if expected != found:
            raise SchemaError(
                f"{what}: stream {stream!r}: expected the XXH3-128 written ({expected}), "
                f"found {found} (corrupt data)"
            )


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
