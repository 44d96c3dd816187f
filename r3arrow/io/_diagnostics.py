"""Replay diagnostics on disk: per-step route agreement beside the rollouts it measures.

``docs/diagnostics.md``: `write_diagnostics` stores one `r3arrow.stats.RouteAgreement`
(duck-typed: the core imports no integration) of one step as
``root/_diagnostics/step=N/<source>.parquet``, one row per router layer
(`DIAGNOSTICS_SCHEMA`), atomically, sealed and page-checksummed; the rollout readers never
look there (Arrow skips ``_`` names too). `read_diagnostics` reads them all back, checking
the seal, the schema, the counts' invariants and that a file's step and source match its
path; a violation is a `SchemaError` whose ``path`` names the file.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from r3arrow._checks import check_int, check_regular
from r3arrow._typing import PathLike
from r3arrow.errors import SchemaError
from r3arrow.io._layout import atomic_path, check_step, dir_step
from r3arrow.io._verify import META_SHA_KEY, meta_digest, reading, sealed

#: Directory under a rollout root that holds the diagnostics (skipped by rollout readers).
DIAGNOSTICS_DIR = "_diagnostics"
#: Default ``source``: the trainer's native top-k compared with the replayed routes.
NATIVE_VS_REPLAY = "native_vs_replay"
#: Schema metadata key and value tagging a diagnostics file (and its format version).
DIAGNOSTICS_KEY = b"r3arrow.diagnostics"
DIAGNOSTICS_VERSION = b"agreement.v1"

#: One row per router layer of one step and source.
DIAGNOSTICS_SCHEMA = pa.schema(
    [
        pa.field(name, typ, nullable=False)
        for name, typ in (
            ("step", pa.int64()),
            ("layer", pa.int32()),
            ("tokens", pa.int64()),
            ("identical", pa.int64()),
            ("overlap", pa.int64()),
            ("all_identical", pa.int64()),
            ("topk", pa.int32()),
            ("source", pa.string()),
        )
    ]
)

_SOURCE = re.compile(r"^[a-z0-9][a-z0-9_]{0,63}$")
_INT_COLUMNS = ("step", "layer", "tokens", "identical", "overlap", "all_identical", "topk")


def _check_source(source: Any) -> str:
    if not isinstance(source, str):
        raise TypeError(f"source: expected a str, found {type(source).__name__}")
    if not _SOURCE.match(source):
        raise ValueError(
            f"source: expected 1-64 characters of [a-z0-9_] starting with a letter or digit "
            f"(it names a file), found {source!r}"
        )
    return source


def _agreement_table(step: int, agreement: Any, source: str) -> pa.Table:
    """The rows of one agreement (duck-typed `RouteAgreement`); `TypeError` if it is not one."""
    try:
        layers = np.asarray(tuple(agreement.layers), dtype=np.int64)
        identical = np.asarray(agreement.identical, dtype=np.int64)
        overlap = np.asarray(agreement.overlap, dtype=np.int64)
        tokens = check_int(agreement.tokens, "agreement.tokens", minimum=0)
        topk = check_int(agreement.topk, "agreement.topk", minimum=1)
        all_identical = check_int(agreement.all_identical, "agreement.all_identical", minimum=0)
    except AttributeError as exc:
        raise TypeError(
            f"agreement: expected an r3arrow.stats.RouteAgreement (layers, topk, tokens, "
            f"identical, overlap, all_identical), found {type(agreement).__name__} ({exc})"
        ) from None
    n = layers.shape[0]
    if layers.ndim != 1 or identical.shape != (n,) or overlap.shape != (n,):
        raise ValueError(
            f"agreement: expected layers, identical and overlap of one length, found shapes "
            f"{list(layers.shape)}, {list(identical.shape)}, {list(overlap.shape)}"
        )
    columns: dict[str, Any] = {
        "step": np.full(n, step, np.int64),
        "layer": layers.astype(np.int32),
        "tokens": np.full(n, tokens, np.int64),
        "identical": identical,
        "overlap": overlap,
        "all_identical": np.full(n, all_identical, np.int64),
        "topk": np.full(n, topk, np.int32),
        "source": pa.array([source] * n, pa.string()),
    }
    meta = sealed({DIAGNOSTICS_KEY: DIAGNOSTICS_VERSION})
    return pa.Table.from_pydict(columns, schema=DIAGNOSTICS_SCHEMA.with_metadata(meta))


def _check_counts(table: pa.Table) -> None:
    """The counts' invariants (``docs/diagnostics.md``); `SchemaError` without a path."""
    cols = {c: table.column(c).to_numpy() for c in _INT_COLUMNS}
    if table.num_rows == 0:
        raise SchemaError("expected one row per router layer, found no rows")
    layer = cols["layer"]
    if (layer < 0).any() or np.unique(layer).size != layer.size:
        raise SchemaError(f"column 'layer': expected distinct ids >= 0, found {layer.tolist()}")
    for name in ("step", "tokens", "topk", "all_identical", "source"):
        values = table.column(name).unique()
        if len(values) != 1:
            raise SchemaError(
                f"column {name!r}: expected one value per file, found {values.to_pylist()[:8]}"
            )
    tokens, topk = int(cols["tokens"][0]), int(cols["topk"][0])
    identical, overlap = cols["identical"], cols["overlap"]
    checks = (
        ("tokens", tokens >= 0, f">= 0, found {tokens}"),
        ("topk", topk >= 1, f">= 1, found {topk}"),
        ("identical", bool(((identical >= 0) & (identical <= tokens)).all()), f"in [0, {tokens}]"),
        (
            "overlap",
            bool(((overlap >= identical * topk) & (overlap <= tokens * topk)).all()),
            f"in [identical * topk, tokens * topk = {tokens * topk}]",
        ),
        (
            "all_identical",
            0 <= int(cols["all_identical"][0]) <= int(identical.min()),
            f"in [0, min(identical) = {int(identical.min())}]",
        ),
    )
    for name, ok, want in checks:
        if not ok:
            raise SchemaError(f"column {name!r}: expected values {want}")


def write_diagnostics(
    root: PathLike, step: int, agreement: Any, *, source: str = NATIVE_VS_REPLAY
) -> Path:
    """Write ``agreement`` (a `r3arrow.stats.RouteAgreement`) of step ``step``, replacing that
    step and source; return the path. ``TypeError`` / ``ValueError`` for bad arguments,
    `SchemaError` for counts off the invariants, before touching the disk.
    """
    step = check_step(step)
    source = _check_source(source)
    table = _agreement_table(step, agreement, source)
    _check_counts(table)
    dest = Path(root) / DIAGNOSTICS_DIR / f"step={step}" / f"{source}.parquet"
    with atomic_path(dest) as paths:
        pq.write_table(
            table, paths[0], compression="zstd", write_page_checksum=True, write_statistics=False
        )
    return paths[-1]


def _read_file(path: Path, step: int) -> pa.Table:
    with reading(path, "diagnostics"):
        check_regular(path)
        with pq.ParquetFile(path, page_checksum_verification=True) as pf:
            meta = {bytes(k): bytes(v) for k, v in (pf.schema_arrow.metadata or {}).items()}
            if meta.get(DIAGNOSTICS_KEY) != DIAGNOSTICS_VERSION:
                found = meta.get(DIAGNOSTICS_KEY, b"no such key").decode(errors="replace")
                raise SchemaError(
                    f"metadata key {DIAGNOSTICS_KEY.decode()!r}: expected "
                    f"{DIAGNOSTICS_VERSION.decode()!r}, found {found!r:.80}"
                )
            if meta.get(META_SHA_KEY) != meta_digest(meta):
                raise SchemaError(
                    f"metadata key {META_SHA_KEY.decode()!r}: expected the SHA-256 of the "
                    "r3arrow metadata, found a mismatch or none"
                )
            table = pf.read()
        if table.num_rows != pf.metadata.num_rows:
            raise SchemaError(
                f"expected {pf.metadata.num_rows} rows (footer), read {table.num_rows}"
            )
        table = table.replace_schema_metadata(None)
        if not table.schema.equals(DIAGNOSTICS_SCHEMA):
            raise SchemaError(
                f"expected the diagnostics schema {DIAGNOSTICS_SCHEMA}, found {table.schema}"
            )
        _check_counts(table)
        for name, want, why in (
            ("step", step, "the path's"),
            ("source", path.stem, "the file name"),
        ):
            if (found := table.column(name)[0].as_py()) != want:
                raise SchemaError(f"column {name!r}: expected {want!r} ({why}), found {found!r}")
    return table


def diagnostics_files(root: PathLike) -> list[tuple[int, Path]]:
    """``(step, file)`` of every diagnostics file under ``root``, by step then source;
    ``FileNotFoundError`` without ``root``, `SchemaError` for a foreign entry.
    """
    base = Path(root)
    if not base.exists():
        raise FileNotFoundError(f"{base}: no such rollout directory")
    top = base / DIAGNOSTICS_DIR
    if not top.is_dir():
        return []
    out: list[tuple[int, Path]] = []
    for child in sorted(top.iterdir()):
        if child.name.startswith("."):  # writers' temps
            continue
        step = dir_step(child) if child.is_dir() else None
        if step is None:
            raise SchemaError(
                f"{child}: expected only step=N directories in {DIAGNOSTICS_DIR}/, found "
                f"{child.name!r}",
                path=child,
            )
        for f in sorted(child.iterdir()):
            if f.name.startswith("."):
                continue
            if f.suffix != ".parquet" or not _SOURCE.match(f.stem):
                raise SchemaError(
                    f"{f}: expected <source>.parquet files in {child.name}/, found {f.name!r}",
                    path=f,
                )
            out.append((step, f))
    return sorted(out, key=lambda sf: (sf[0], sf[1].name))


def read_diagnostics(root: PathLike, *, source: str | None = None) -> pa.Table:
    """Every diagnostics row under ``root`` (`DIAGNOSTICS_SCHEMA`) by step, source, layer
    (``source``: that one only); ``FileNotFoundError`` without ``root``, `SchemaError`
    (``path`` set) for a bad file.
    """
    wanted = None if source is None else _check_source(source)
    parts = [
        _read_file(f, step)
        for step, f in diagnostics_files(root)
        if wanted is None or f.stem == wanted
    ]
    if not parts:
        return DIAGNOSTICS_SCHEMA.empty_table()
    table = pa.concat_tables(parts)
    order: list[tuple[str, Literal["ascending", "descending"]]] = [
        ("step", "ascending"),
        ("source", "ascending"),
        ("layer", "ascending"),
    ]
    return table.sort_by(order).cast(DIAGNOSTICS_SCHEMA)
