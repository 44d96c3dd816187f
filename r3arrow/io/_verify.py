"""Trust boundary of the rollout readers: what a Parquet file claims and what it holds.

A rollout file is read data from outside the process (another job, another
version, a disk): nothing in it is trusted. This module holds the checks the
readers of `r3arrow.io._parquet` run (see ``docs/design.md``, "Persistence"):

* **Footer** (`footer_spec`, `file_spec`): the file carries r3arrow metadata (else "not a
  rollout file"), a known schema version (``r3arrow.schema``), a spec that
  parses, and — when present — a SHA-256 over every ``r3arrow.*`` metadata value
  (``r3arrow.meta_sha256``) that matches, so a flipped or edited spec (a smaller
  ``num_experts``, ``L``/``K`` swapped with the same bytes per token) is caught.
  Files written before the checksum existed have no such key and are not
  checked for it. A file without ``routes`` and without ``r3arrow.spec`` is an
  R3-off file (spec ``None``); a spec without a ``routes`` column is an error.
  A layer-group file's routes columns must have exactly the groups its storage
  metadata records (`r3arrow.io._groups.check_group_schema`).
  The footer's two copies of the metadata (key-value pairs, Arrow schema) must
  agree and its row groups must add up to its row count; `check_rows` holds
  each row group read to that count (page checksums do not cover page headers).
* **Storage** (`check_storage`): core columns free of nulls, checked before the
  routes are restored (a null token inside ``fixed_size_binary`` storage would
  otherwise come back as zeros).
* **Table** (`check_table`): `r3arrow.table.validate_rollouts` when every core
  column is present, the per-column rules otherwise (types, loss-mask lengths,
  routes ``<=`` tokens), and the expert-id rules of :mod:`r3arrow.ids` on every
  routes column (ids in range and distinct experts on router layers).

Everything raised is an `R3ArrowError` (mostly `SchemaError`) whose ``path``
names the file and whose message starts with it; `reading` turns whatever
Arrow or the OS raise while opening or decoding a file into such a
`SchemaError`. All checks are vectorised (column null counts, list lengths, one
pass of the id rules over the routes buffer).
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

from r3arrow._schema import ROLLOUT_COLUMNS, SCHEMA_VERSION, list_lengths
from r3arrow._validated import mark_validated
from r3arrow.errors import R3ArrowError, RouteShapeError, SchemaError
from r3arrow.ids import check_routes
from r3arrow.io._groups import check_group_schema
from r3arrow.spec import SPEC_METADATA_KEY, RouteSpec, routes_to_numpy
from r3arrow.table import rollout_schema, validate_rollouts

#: Schema metadata key of the rollout schema version (``rollout.v1``).
VERSION_KEY = b"r3arrow.schema"
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
    UnicodeDecodeError,
    MemoryError,
)

# Types of the non-routes core columns (they do not depend on the spec).
_CORE_TYPES: dict[str, pa.DataType] = {
    f.name: f.type
    for f in rollout_schema(RouteSpec(num_layers=1, topk=1, num_experts=1))
    if f.name != "routes"
}


# ------------------------------------------------------------------ errors
def at_path(exc: R3ArrowError, path: Path) -> R3ArrowError:
    """``exc`` (same type and fields) with ``path`` set and the message prefixed by it."""
    if exc.path is not None:
        return exc
    out = copy.copy(exc)
    out.path = str(path)
    out.message = f"{path}: {exc.message}"
    out.args = (out.message,)
    return out


def open_error(path: Path, exc: BaseException) -> SchemaError:
    """The `SchemaError` for a file that Arrow cannot open or decode as rollout Parquet."""
    return SchemaError(
        f"{path}: expected an r3arrow rollout Parquet file, found an unreadable or corrupt "
        f"file ({type(exc).__name__}: {exc})",
        path=path,
    )


@contextlib.contextmanager
def reading(path: Path) -> Iterator[None]:
    """Re-raise r3arrow errors with ``path`` set, anything Arrow/OS raise as `SchemaError`."""
    try:
        yield
    except R3ArrowError as exc:
        raise at_path(exc, path) from exc
    except READ_ERRORS as exc:
        raise open_error(path, exc) from exc


# ---------------------------------------------------------------- metadata
def meta_digest(meta: dict[bytes, bytes]) -> bytes:
    """Hex SHA-256 over every ``r3arrow.*`` key and value except the digest's own key.

    Keys are taken in sorted order, each key and value length-prefixed, so no
    two different metadata sets hash alike by concatenation.
    """
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


def _metadata(schema: pa.Schema) -> dict[bytes, bytes]:
    raw = schema.metadata or {}
    return {bytes(k): bytes(v) for k, v in raw.items()}


def file_spec(schema: pa.Schema, path: Path) -> RouteSpec | None:
    """Check a rollout file's Arrow schema (footer); return its spec, ``None`` for R3-off.

    Raises `SchemaError` (``path`` set) for a file without r3arrow metadata ("not
    a rollout file"), an unknown ``r3arrow.schema`` version, a metadata checksum
    that does not match, a spec that does not parse or does not fit the stored
    routes width, a spec without a ``routes`` column, or ``routes`` without a spec.
    """
    meta = _metadata(schema)
    if not any(k.startswith(_PREFIX) for k in meta):
        raise SchemaError(
            f"{path}: not a rollout file: expected r3arrow metadata "
            f"({VERSION_KEY.decode()!r}, {SPEC_METADATA_KEY.decode()!r}), found a file "
            f"without it (columns {schema.names})",
            path=path,
        )
    want = meta.get(META_SHA_KEY)
    if want is not None and want != meta_digest(meta):
        raise SchemaError(
            f"{path}: metadata key {META_SHA_KEY.decode()!r}: expected the SHA-256 of the "
            f"r3arrow metadata, found a mismatch (the spec or storage metadata is corrupt)",
            path=path,
        )
    version = meta.get(VERSION_KEY)
    if version is not None and version.decode(errors="replace") not in KNOWN_VERSIONS:
        raise SchemaError(
            f"{path}: metadata key {VERSION_KEY.decode()!r}: expected one of "
            f"{list(KNOWN_VERSIONS)}, found {version.decode(errors='replace')!r:.80}",
            path=path,
        )
    has_routes = "routes" in schema.names
    if SPEC_METADATA_KEY not in meta:
        if version is None:  # r3arrow.* keys, but neither a version nor a spec
            raise SchemaError(
                f"{path}: not a rollout file: expected metadata key "
                f"{SPEC_METADATA_KEY.decode()!r} or {VERSION_KEY.decode()!r}, found keys "
                f"{sorted(k.decode(errors='replace') for k in meta)}",
                path=path,
            )
        if has_routes:
            raise SchemaError(
                f"{path}: column 'routes': expected metadata key "
                f"{SPEC_METADATA_KEY.decode()!r} beside it, found none",
                path=path,
            )
        return None  # R3 off: no routes, no spec
    with reading(path):
        spec = RouteSpec.from_schema(schema)
        if not has_routes:
            raise SchemaError(
                f"expected column 'routes' ({SPEC_METADATA_KEY.decode()!r} is set), "
                f"found columns {schema.names}"
            )
        check_group_schema(schema, spec)
    return spec


def footer_spec(pf: pq.ParquetFile, path: Path) -> RouteSpec | None:
    """`file_spec` of an open Parquet file, whose two copies of the metadata must agree.

    Parquet keeps the schema metadata twice (the footer's key-value pairs and the
    serialized Arrow schema); readers use one or the other, so a corruption of
    either is a `SchemaError` naming the file.
    """
    schema = pf.schema_arrow
    spec = file_spec(schema, path)
    md = pf.metadata
    groups = sum(md.row_group(g).num_rows for g in range(md.num_row_groups))
    if groups != md.num_rows:
        raise SchemaError(
            f"{path}: expected the row groups to hold the file's {md.num_rows} rows, found "
            f"{groups} (corrupt footer)",
            path=path,
        )
    kv = {bytes(k): bytes(v) for k, v in (pf.metadata.metadata or {}).items()}
    kv.pop(b"ARROW:schema", None)
    arrow = _metadata(schema)
    if kv != arrow:
        keys = sorted(k.decode(errors="replace") for k in set(kv) ^ set(arrow)) or sorted(
            k.decode(errors="replace") for k in kv if kv[k] != arrow.get(k)
        )
        raise SchemaError(
            f"{path}: expected the footer key-value metadata to match the Arrow schema's, "
            f"found a difference in {keys} (corrupt footer)",
            path=path,
        )
    return spec


def check_rows(table: pa.Table, want: int, path: Path, what: str = "the file") -> None:
    """`SchemaError` unless ``table`` has the ``want`` rows the footer promised for ``what``."""
    if table.num_rows != want:
        raise SchemaError(
            f"{path}: expected {want} rows in {what} (footer), read {table.num_rows} "
            f"(corrupt file)",
            path=path,
        )


# ------------------------------------------------------------------- data
def _null_counts(col: pa.ChunkedArray[Any]) -> tuple[int, int]:
    """(null rows, null values at any nested list level) of a (chunked) column."""
    rows = col.null_count
    items = 0
    for chunk in col.chunks:
        level: pa.Array[Any] = chunk
        while pa.types.is_large_list(level.type) or pa.types.is_list(level.type):
            level = cast("pa.LargeListArray[Any]", level).flatten()
            items += level.null_count
    return rows, items


def check_storage(table: pa.Table) -> None:
    """Core columns (and routes tokens, in storage form) free of nulls; before restoring routes.

    Raises `SchemaError` naming the column (the caller adds the path).
    """
    for name in ROLLOUT_COLUMNS:
        if name not in table.schema.names:
            continue
        rows, items = _null_counts(table.column(name))
        if rows:
            raise SchemaError(f"column {name!r}: expected no null rows, found {rows}")
        if items:
            what = "tokens" if name == "routes" else "values"
            raise SchemaError(f"column {name!r}: expected no null {what}, found {items}")


def _same_type(found: pa.DataType, want: pa.DataType) -> bool:
    """Equal types with equal list child names (Arrow's ``==`` ignores those names)."""
    return found == want and str(found) == str(want)


def _check_types(table: pa.Table, spec: RouteSpec | None) -> None:
    for name, typ in _CORE_TYPES.items():
        if name in table.schema.names and not _same_type(
            found := table.schema.field(name).type, typ
        ):
            raise SchemaError(f"column {name!r}: expected {typ}, found {found}")
    if spec is not None and "routes" in table.schema.names:
        found = table.schema.field("routes").type
        if not _same_type(found, spec.routes_type):
            raise SchemaError(f"column 'routes': expected {spec.routes_type}, found {found}")


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
    rlen = list_lengths(table.column("response_ids")) if "response_ids" in names else None
    if rlen is not None and "loss_mask" in names:
        mlen = list_lengths(table.column("loss_mask"))
        if (bad := np.flatnonzero(mlen != rlen)).size:
            i = int(bad[0])
            raise SchemaError(
                f"row {i}: column 'loss_mask': expected {rlen[i]} values (one per response "
                f"token), found {mlen[i]}",
                row=i,
            )
    if rlen is not None and "prompt_ids" in names and "routes" in names:
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
    """Validate a restored rollout table (or a projection of one); return it marked validated.

    A whole table (``projected=False``) must have every core column (``routes``
    only with a spec) and goes through `validate_rollouts` (R3 on or off); a
    projection gets the per-column rules on what it kept (types, lengths, ids of
    the routes). Other routes-typed columns (a trainer's routes) get the id
    rules too. Raises the r3arrow error of the first violation (the caller adds
    the path).
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
    if spec is not None:
        _check_ids(table, spec, skip=("routes",) if whole else ())
    return mark_validated(_not_null_core(table))


__all__ = [
    "KNOWN_VERSIONS",
    "META_SHA_KEY",
    "READ_ERRORS",
    "VERSION_KEY",
    "at_path",
    "check_rows",
    "check_storage",
    "check_table",
    "file_spec",
    "footer_spec",
    "meta_digest",
    "open_error",
    "reading",
    "sealed",
    "unsealed",
]
