"""``r3arrow convert``: JSON-lines payload dumps (and the ``.npy`` files they name) to a table.

Every error names the file and line; ``.npy`` files are read only inside the dump's folder
unless allowed, only if regular, and only after their header's declared size was checked
against the file and `r3arrow.codec.DEFAULT_MAX_BYTES`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow as pa

from r3arrow._extras import require
from r3arrow._routes import as_route_rows
from r3arrow.errors import PayloadError, R3ArrowError, SchemaError
from r3arrow.ids import check_routes
from r3arrow.spec import RouteSpec


def _npy_path(name: object, base: Path, allow_outside: bool) -> Path:
    """The ``.npy`` file a record names, relative to ``base``; refused outside it unless allowed."""
    if not isinstance(name, str) or not name:
        raise SchemaError(f"expected routes_npy to be an .npy file path, found {name!r:.80}")
    rel = Path(name)
    if not allow_outside:
        if rel.is_absolute():
            raise SchemaError(
                f"routes_npy {name!r}: expected a path relative to {base}, found an absolute "
                "path (pass --allow-outside to read it)"
            )
        resolved, root = (base / rel).resolve(), base.resolve()
        if ".." in rel.parts or not resolved.is_relative_to(root):
            raise SchemaError(
                f"routes_npy {name!r}: expected a file inside {base}, found one outside it "
                f"({resolved}; pass --allow-outside to read it)"
            )
    return base / rel


def read_npy_file(path: Path) -> np.ndarray:
    """A C-order integer ``.npy`` file, its header's declared size checked before allocating."""
    from r3arrow._checks import check_regular
    from r3arrow.codec import DEFAULT_MAX_BYTES

    check_regular(path)
    with open(path, "rb") as fh:
        try:
            version = np.lib.format.read_magic(fh)
            read_header = (
                np.lib.format.read_array_header_1_0
                if version == (1, 0)
                else np.lib.format.read_array_header_2_0
            )
            # numpy's header reader: literals only (no pickle, no code), header size bounded
            shape, fortran, dtype = read_header(fh, max_header_size=10_000)
        except (ValueError, SyntaxError, TypeError) as exc:  # bad magic, version or header
            raise PayloadError(
                f"routes_npy {path}: expected an .npy file without pickle, found: {exc}"
            ) from None
        if dtype.kind not in "iu" or fortran:
            raise PayloadError(
                f"routes_npy {path}: expected an integer array in C order, found dtype {dtype}"
                f"{' in Fortran order' if fortran else ''}"
            )
        declared = math.prod(shape) * dtype.itemsize
        available = path.stat().st_size - fh.tell()
        if declared > DEFAULT_MAX_BYTES:
            raise PayloadError(
                f"routes_npy {path}: expected at most {DEFAULT_MAX_BYTES} bytes of routes, "
                f"found a header declaring {declared} (shape {shape})"
            )
        if declared != available:
            raise PayloadError(
                f"routes_npy {path}: header declares {declared} bytes (shape {shape}, {dtype}), "
                f"found {available} bytes of data"
            )
        data = fh.read(declared)
    return np.frombuffer(data, dtype=dtype).reshape(shape)


def _read_npy(name: object, spec: RouteSpec, base: Path, allow_outside: bool = False) -> np.ndarray:
    """The ``.npy`` routes file a record names (relative to ``base``), checked."""
    path = _npy_path(name, base, allow_outside)
    try:
        arr = read_npy_file(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"routes_npy {path}: no such file") from None
    arr = as_route_rows(arr, spec, what=f"routes_npy {path}")
    check_routes(arr, spec, what=f"routes_npy {path}", rules="range")
    return arr


def _decode_record(
    rec: dict[str, Any], fmt: str, spec: RouteSpec, base: Path, allow_outside: bool = False
) -> np.ndarray:
    from r3arrow import codec

    if "routes_npy" in rec:
        return _read_npy(rec["routes_npy"], spec, base, allow_outside)
    if fmt == "npy":
        raise SchemaError("expected 'routes_npy' in every record (--format npy)")
    payload = rec.get("routed_experts")
    if payload is None:
        raise SchemaError(
            f"expected 'routed_experts' (a {fmt} payload) or 'routes_npy' in every record"
        )
    if fmt == "vllm":
        return codec.decode_vllm(payload, spec)
    if fmt == "packed":
        return codec.decode_packed(payload, spec)
    return codec.decode_sglang(payload, spec)


def _located(exc: R3ArrowError, where: str, path: Path) -> R3ArrowError:
    """A copy of ``exc`` (same type and fields) whose message starts with ``where``."""
    new = type(exc).__new__(type(exc))
    message = f"{where}: {exc}"
    Exception.__init__(new, message)
    new.__dict__.update(exc.__dict__)
    new.message = message
    if new.path is None:
        new.path = str(path)
    return new


def _record_columns(rec: Any, default_id: str) -> dict[str, Any]:
    """The non-route columns of one record, with defaults; raises `SchemaError` on a wrong type."""
    if not isinstance(rec, dict):
        raise SchemaError(f"expected a JSON object, found {type(rec).__name__}")
    for key in ("prompt_ids", "response_ids"):
        if not isinstance(rec.get(key), list):
            raise SchemaError(f"expected {key} as a list of token ids, found {rec.get(key)!r:.80}")
    response = rec["response_ids"]
    reward = rec.get("reward", 0.0)
    if isinstance(reward, bool) or not isinstance(reward, int | float):
        raise SchemaError(f"expected reward as a number, found {reward!r:.80}")
    tid = str(rec.get("trajectory_id", default_id))
    return {
        "trajectory_id": tid,
        "group_id": str(rec.get("group_id", tid)),
        "prompt_ids": rec["prompt_ids"],
        "response_ids": response,
        "loss_mask": rec.get("loss_mask", [1] * len(response)),
        "reward": float(reward),
    }


def convert_jsonl(
    paths: Sequence[Path],
    spec: RouteSpec,
    fmt: str,
    *,
    progress: bool = False,
    allow_outside: bool = False,
) -> pa.Table:
    """Build a rollout table from JSON-lines payload dumps (one trajectory per line).

    Each record: ``prompt_ids``, ``response_ids``, and ``routed_experts`` (payload in
    ``fmt``) or ``routes_npy`` (a ``.npy`` path relative to the file); optional
    ``trajectory_id``, ``group_id``, ``loss_mask`` (default all 1), ``reward``. Errors name
    the file and line. ``progress``: a byte progress bar on stderr. ``allow_outside``: also
    read ``routes_npy`` files absolute or outside the dump's folder (else `SchemaError`).
    """
    with require(extra="cli", feature="r3arrow convert"):
        from tqdm.auto import tqdm

    from r3arrow._checks import check_regular
    from r3arrow.table import rollout_table

    for path in paths:
        check_regular(path)
        if path.suffix.lower() in (".npy", ".npz", ".parquet"):
            raise SchemaError(
                f"{path}: expected a JSON-lines dump "
                "(.npy routes are named by a record's routes_npy)"
            )
    names = ("trajectory_id", "group_id", "prompt_ids", "response_ids", "loss_mask", "reward")
    cols: dict[str, list[Any]] = {k: [] for k in (*names, "routes")}
    where: list[tuple[str, Path]] = []  # (file:line, file) of each record
    total = sum(p.stat().st_size for p in paths)
    # disable=None: no bar when stderr is not a terminal (logs, pipes)
    with tqdm(
        total=total, unit="B", unit_scale=True, desc="convert", disable=None if progress else True
    ) as bar:
        for path in paths:
            with open(path, "rb") as fh:
                for lineno, line in enumerate(fh, 1):
                    bar.update(len(line))
                    if not line.strip():
                        continue
                    loc = f"{path}:{lineno}"
                    try:
                        try:
                            rec = orjson.loads(line)
                        except orjson.JSONDecodeError as exc:
                            raise SchemaError(
                                f"expected a JSON object, found invalid JSON ({exc})"
                            ) from exc
                        row = _record_columns(rec, f"{path.stem}-{lineno}")
                        row["routes"] = _decode_record(rec, fmt, spec, path.parent, allow_outside)
                    except R3ArrowError as exc:
                        raise _located(exc, loc, path) from exc
                    except OSError as exc:
                        raise type(exc)(f"{loc}: {exc}") from exc
                    for k, v in row.items():
                        cols[k].append(v)
                    where.append((loc, path))
    try:
        return rollout_table(spec=spec, **cols)
    except R3ArrowError as exc:  # row N is the N-th record: name its file and line
        i = exc.row
        if i is not None and 0 <= i < len(where):
            raise _located(exc, *where[i]) from exc
        raise


__all__ = ["convert_jsonl", "read_npy_file"]
