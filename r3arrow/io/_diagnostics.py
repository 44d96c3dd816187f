"""Replay diagnostics on disk: per-step route agreement beside the rollouts it measures.

``docs/diagnostics.md``: `write_diagnostics` stores one `r3arrow.stats.RouteAgreement`
(duck-typed: the core imports no integration) of one step as
``root/_diagnostics/step=N/<source>.parquet``, one row per router layer
(`DIAGNOSTICS_SCHEMA`), atomically, sealed and page-checksummed; the rollout readers never
look there (Arrow skips ``_`` names too). `read_diagnostics` reads them all back, checking
the seal, the schema, the counts' invariants and that a file's step and source match its
path; a violation is a `SchemaError` whose ``path`` names the file. A log-prob mismatch
(an `r3arrow.stats.logprob_mismatch` dict, ``docs/mismatch.md``) is stored the same way,
one row (`MISMATCH_SCHEMA`, tag ``mismatch.v1``), read back with ``kind="mismatch"``, and
so is a route fallback (an `r3arrow.stats.RouteFallback`, ``docs/fallback.md``: one row,
`FALLBACK_SCHEMA`, tag ``fallback.v1``, its ``fraction`` beside the exact counts), read
back with ``kind="fallback"``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, cast

import pyarrow as pa
import pyarrow.parquet as pq

from r3arrow._checks import check_int, check_regular
from r3arrow._schema import MISMATCH_FLOATS, TRAIN_VS_ROLLOUT
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

MISMATCH_VERSION = b"mismatch.v1"
#: One row per step and source: tokens and the mismatch metrics (NaN when tokens is 0).
MISMATCH_SCHEMA = pa.schema(
    [pa.field("step", pa.int64(), nullable=False), pa.field("tokens", pa.int64(), nullable=False)]
    + [pa.field(name, pa.float64(), nullable=False) for name in MISMATCH_FLOATS]
    + [pa.field("source", pa.string(), nullable=False)]
)

#: Default ``source`` of a route fallback: the rollout routes the engine did not deliver.
ROLLOUT_ROUTES = "rollout_routes"
FALLBACK_VERSION = b"fallback.v1"
#: One row per step and source: the counts of `r3arrow.stats.RouteFallback` and its fraction.
FALLBACK_SCHEMA = pa.schema(
    [
        pa.field(name, typ, nullable=False)
        for name, typ in (
            ("step", pa.int64()),
            ("trajectories", pa.int64()),
            ("fallback_trajectories", pa.int64()),
            ("route_rows", pa.int64()),
            ("missing_rows", pa.int64()),
            ("fraction", pa.float64()),
            ("source", pa.string()),
        )
    ]
)
_FALLBACK_COUNTS = ("trajectories", "fallback_trajectories", "route_rows", "missing_rows")

_SOURCE = re.compile(r"^[a-z0-9][a-z0-9_]{0,63}$")
_INT32_MAX, _INT64_MAX = 2**31 - 1, 2**63 - 1
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


def _ints(values: Any, name: str, maximum: int) -> list[int]:
    """``values`` as Python ints in ``[0, maximum]`` (``TypeError`` / ``ValueError``)."""
    return [check_int(v, name, minimum=0, maximum=maximum) for v in values]


def _agreement_table(step: int, agreement: Any, source: str) -> pa.Table:
    """The rows of one agreement (duck-typed `RouteAgreement`), every count an exact int of
    its column's type; `TypeError` if it is not one, `ValueError` for a count out of range."""
    try:
        layers = _ints(agreement.layers, "agreement.layers", _INT32_MAX)
        identical = _ints(agreement.identical, "agreement.identical", _INT64_MAX)
        overlap = _ints(agreement.overlap, "agreement.overlap", _INT64_MAX)
        tokens = check_int(agreement.tokens, "agreement.tokens", minimum=0, maximum=_INT64_MAX)
        topk = check_int(agreement.topk, "agreement.topk", minimum=1, maximum=_INT32_MAX)
        all_identical = check_int(
            agreement.all_identical, "agreement.all_identical", minimum=0, maximum=_INT64_MAX
        )
    except AttributeError as exc:
        raise TypeError(
            f"agreement: expected an r3arrow.stats.RouteAgreement (layers, topk, tokens, "
            f"identical, overlap, all_identical), found {type(agreement).__name__} ({exc})"
        ) from None
    n = len(layers)
    if len(identical) != n or len(overlap) != n:
        raise ValueError(
            f"agreement: expected layers, identical and overlap of one length, found lengths "
            f"{n}, {len(identical)}, {len(overlap)}"
        )
    columns: dict[str, Any] = {
        "step": [step] * n,
        "layer": layers,
        "tokens": [tokens] * n,
        "identical": identical,
        "overlap": overlap,
        "all_identical": [all_identical] * n,
        "topk": [topk] * n,
        "source": [source] * n,
    }
    meta = sealed({DIAGNOSTICS_KEY: DIAGNOSTICS_VERSION})
    return pa.Table.from_pydict(columns, schema=DIAGNOSTICS_SCHEMA.with_metadata(meta))


def _mismatch_table(step: int, mismatch: Mapping[Any, Any], source: str) -> pa.Table:
    """The one row of a mismatch dict; ``TypeError`` for a foreign one, ``ValueError`` for
    NaN where tokens > 0 (or a number where tokens is 0)."""
    want = {"tokens", *MISMATCH_FLOATS}
    if set(mismatch) != want:
        raise TypeError(
            f"agreement: expected an r3arrow.stats.RouteAgreement or a logprob_mismatch dict "
            f"with the keys {sorted(want)}, "
            f"found {sorted(map(str, mismatch))[:12]}"
        )
    tokens = mismatch["tokens"]
    if isinstance(tokens, float) and tokens.is_integer():
        tokens = int(tokens)
    columns: dict[str, Any] = {
        "step": [step],
        "tokens": [check_int(tokens, "mismatch['tokens']", minimum=0, maximum=_INT64_MAX)],
    }
    for name in MISMATCH_FLOATS:
        value = mismatch[name]
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise TypeError(f"mismatch[{name!r}]: expected a float, found {value!r:.40}")
        if math.isnan(value) != (columns["tokens"][0] == 0):
            raise ValueError(f"mismatch[{name!r}]: expected NaN exactly when tokens is 0")
        columns[name] = [float(value)]
    columns["source"] = [source]
    meta = sealed({DIAGNOSTICS_KEY: MISMATCH_VERSION})
    return pa.Table.from_pydict(columns, schema=MISMATCH_SCHEMA.with_metadata(meta))


def _fallback_table(step: int, fallback: Any, source: str) -> pa.Table:
    """The one row of a (duck-typed) `RouteFallback`; ``ValueError`` for counts off its
    invariants (``fallback_trajectories <= trajectories``, ``missing_rows <= route_rows``)."""
    counts = {
        name: check_int(getattr(fallback, name), f"fallback.{name}", minimum=0, maximum=_INT64_MAX)
        for name in _FALLBACK_COUNTS
    }
    columns: dict[str, Any] = {"step": [step], **{k: [v] for k, v in counts.items()}}
    columns["fraction"] = [_fraction(counts)]
    columns["source"] = [source]
    table = pa.Table.from_pydict(
        columns, schema=FALLBACK_SCHEMA.with_metadata(sealed({DIAGNOSTICS_KEY: FALLBACK_VERSION}))
    )
    try:
        _check_fallback(table)
    except SchemaError as exc:
        raise ValueError(f"fallback: {exc.message}") from None
    return table


def _fraction(counts: Mapping[str, int]) -> float:
    """``missing_rows / route_rows`` (0.0 without route rows), as `RouteFallback.fraction`."""
    rows = counts["route_rows"]
    return counts["missing_rows"] / rows if rows else 0.0


def _check_fallback(table: pa.Table) -> None:
    """A fallback row's invariants; `SchemaError` without a path."""
    if table.num_rows != 1:
        raise SchemaError(f"expected one fallback row, found {table.num_rows}")
    counts = {c: cast(int, table.column(c)[0].as_py()) for c in _FALLBACK_COUNTS}
    if min(counts.values()) < 0:
        raise SchemaError(f"expected counts >= 0, found {counts}")
    for part, whole in (("fallback_trajectories", "trajectories"), ("missing_rows", "route_rows")):
        if counts[part] > counts[whole]:
            raise SchemaError(
                f"column {part!r}: expected at most {whole}={counts[whole]}, found {counts[part]}"
            )
    if counts["fallback_trajectories"] > counts["missing_rows"] or (
        counts["missing_rows"] and not counts["fallback_trajectories"]
    ):
        raise SchemaError(
            "column 'fallback_trajectories': expected one per trajectory with a missing row "
            f"(at least 1 and at most missing_rows when rows are missing), found {counts}"
        )
    found = table.column("fraction")[0].as_py()
    if found != _fraction(counts):
        raise SchemaError(
            f"column 'fraction': expected missing_rows / route_rows = {_fraction(counts)!r}, "
            f"found {found!r}"
        )


def _check_counts(table: pa.Table) -> None:
    """The counts' invariants (``docs/diagnostics.md``), in exact (Python) integers;
    `SchemaError` without a path."""
    if table.num_rows == 0:
        raise SchemaError("expected one row per router layer, found no rows")
    cols = {c: cast("list[int]", table.column(c).to_pylist()) for c in _INT_COLUMNS}
    layer = cols["layer"]
    if min(layer) < 0 or len(set(layer)) != len(layer):
        raise SchemaError(f"column 'layer': expected distinct ids >= 0, found {layer[:16]}")
    for name in ("step", "tokens", "topk", "all_identical", "source"):
        values = table.column(name).unique()
        if len(values) != 1:
            raise SchemaError(
                f"column {name!r}: expected one value per file, found {values.to_pylist()[:8]}"
            )
    tokens, topk, every = cols["tokens"][0], cols["topk"][0], cols["all_identical"][0]
    identical, overlap = cols["identical"], cols["overlap"]
    pairs = list(zip(identical, overlap, strict=True))
    checks = (
        ("tokens", tokens >= 0, f">= 0, found {tokens}"),
        ("topk", topk >= 1, f">= 1, found {topk}"),
        ("identical", all(0 <= i <= tokens for i in identical), f"in [0, {tokens}]"),
        (
            "overlap",
            all(i * topk <= o <= tokens * topk for i, o in pairs),
            f"in [identical * topk, tokens * topk = {tokens * topk}]",
        ),
        (
            "all_identical",
            0 <= every <= min(identical),
            f"in [0, min(identical) = {min(identical)}]",
        ),
    )
    for name, ok, want in checks:
        if not ok:
            raise SchemaError(f"column {name!r}: expected values {want}")


def write_diagnostics(
    root: PathLike, step: int, agreement: Any, *, source: str | None = None
) -> Path:
    """Write ``agreement`` (a `r3arrow.stats.RouteAgreement`, a log-prob mismatch dict of
    `r3arrow.stats.logprob_mismatch` or a `r3arrow.stats.RouteFallback`) of step ``step``,
    replacing that step and source (default ``native_vs_replay``, for a mismatch
    ``train_vs_rollout``, for a fallback ``rollout_routes``); return the path.
    ``TypeError`` / ``ValueError`` for bad arguments, `SchemaError` for counts off the
    invariants, before touching the disk.
    """
    step = check_step(step)
    if isinstance(agreement, Mapping):
        source = _check_source(TRAIN_VS_ROLLOUT if source is None else source)
        table = _mismatch_table(step, agreement, source)
    elif hasattr(agreement, "missing_rows"):
        source = _check_source(ROLLOUT_ROUTES if source is None else source)
        table = _fallback_table(step, agreement, source)
    else:
        source = _check_source(NATIVE_VS_REPLAY if source is None else source)
        table = _agreement_table(step, agreement, source)
        _check_counts(table)
    dest = Path(root) / DIAGNOSTICS_DIR / f"step={step}" / f"{source}.parquet"
    with atomic_path(dest) as paths:
        pq.write_table(
            table, paths[0], compression="zstd", write_page_checksum=True, write_statistics=False
        )
    return paths[-1]


_KINDS = {
    "agreement": (DIAGNOSTICS_VERSION, DIAGNOSTICS_SCHEMA),
    "mismatch": (MISMATCH_VERSION, MISMATCH_SCHEMA),
    "fallback": (FALLBACK_VERSION, FALLBACK_SCHEMA),
}


def _read_file(path: Path, step: int, version: bytes = DIAGNOSTICS_VERSION) -> pa.Table | None:
    """The file's rows, or None for a file of another kind (agreement / mismatch / fallback)."""
    schema = next(sch for v, sch in _KINDS.values() if v == version)
    with reading(path, "diagnostics"):
        check_regular(path)
        with pq.ParquetFile(path, page_checksum_verification=True) as pf:
            meta = {bytes(k): bytes(v) for k, v in (pf.schema_arrow.metadata or {}).items()}
            tag = meta.get(DIAGNOSTICS_KEY)
            if tag in [v for v, _ in _KINDS.values()] and tag != version:
                return None
            if tag != version:
                found = meta.get(DIAGNOSTICS_KEY, b"no such key").decode(errors="replace")
                raise SchemaError(
                    f"metadata key {DIAGNOSTICS_KEY.decode()!r}: expected "
                    f"{version.decode()!r}, found {found!r:.80}"
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
        if not table.schema.equals(schema):
            raise SchemaError(f"expected the diagnostics schema {schema}, found {table.schema}")
        if schema is DIAGNOSTICS_SCHEMA:
            _check_counts(table)
        elif schema is FALLBACK_SCHEMA:
            _check_fallback(table)
        elif table.num_rows != 1:
            raise SchemaError(f"expected one mismatch row, found {table.num_rows}")
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


def read_diagnostics(
    root: PathLike,
    *,
    source: str | None = None,
    kind: Literal["agreement", "mismatch", "fallback"] = "agreement",
) -> pa.Table:
    """Every diagnostics row of ``kind`` under ``root`` by step, source, layer: route
    agreement (`DIAGNOSTICS_SCHEMA`), log-prob mismatch (`MISMATCH_SCHEMA`) or route
    fallback (`FALLBACK_SCHEMA`; both one row per step and source); ``source``: that one
    only. ``FileNotFoundError`` without ``root``, `SchemaError` (``path`` set) for a bad
    file, ``ValueError`` for another ``kind``.
    """
    if kind not in _KINDS:
        raise ValueError(
            f"kind: expected 'agreement', 'mismatch' or 'fallback', found {kind!r:.40}"
        )
    version, schema = _KINDS[kind]
    wanted = None if source is None else _check_source(source)
    read = [
        _read_file(f, step, version)
        for step, f in diagnostics_files(root)
        if wanted is None or f.stem == wanted
    ]
    parts = [t for t in read if t is not None]
    if not parts:
        return schema.empty_table()
    table = pa.concat_tables(parts)
    order: list[tuple[str, Literal["ascending", "descending"]]] = [
        ("step", "ascending"),
        ("source", "ascending"),
    ]
    if kind == "agreement":
        order.append(("layer", "ascending"))
    return table.sort_by(order).cast(schema)
