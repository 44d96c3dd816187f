"""Layer-group routes storage (docs/storage.md): full reads, stage reads, reader cost, memcpy.

One file of ``rows`` trajectories × 4096 tokens, 48 layers × top-8 of 128 experts (uint8),
written in three layouts: the default layer groups (8 groups of 6 layers), 4 groups of
12 (one per stage of a 4-stage pipeline) and one group (``layer_group=48``, restored
without a copy). Every case is measured in this process,
best of ``--repeat``, with the numba kernels warmed up first:

* ``memcpy``: numpy copy of the route bytes into a fresh array (page faults included,
  like a restore's output) and into a warm one (the machine's reference);
* ``raw``: pyarrow alone reading the routes column(s) (``ParquetFile.read_row_group``
  over every row group), without and with page-checksum verification (r3arrow checks
  its files' row-group digests instead, docs/storage.md "Integrity"); the baselines of
  the ``× raw`` ratios (raw: the same columns, not verified);
* ``read_rollouts(validate=False)`` full and for a stage (layers 12-23), per layout;
* ``iter_rollouts(rollout_files(path), columns=["routes"], validate=False)``, the statistics
  reader:
  target >= 0.9 × the raw read of the same columns;
* ``cold``: the same reads after ``posix_fadvise(DONTNEED)`` of the file, with
  ``/proc/self/io`` ``rchar`` / ``read_bytes`` over the route bytes (stage of 4:
  target <= 0.3);
* ``fresh process``: its first full read against its second, then the cost of importing
  numba and loading the cached interleave kernels (`r3arrow.io._interleave.warm_up`).

GB/s counts route bytes (tokens × 48 × 8). Uncompressed files, as `write_rollouts` writes
by default.

    .venv/bin/python benchmarks/bench_storage.py            # 128 trajectories (~200 MB)
    .venv/bin/python benchmarks/bench_storage.py --quick    # 16 trajectories (~25 MB)
    [--rows N] [--repeat N] [--dir DIR]
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
from _common import GB, machine_line, markdown_table, memcpy_gbps, parser

import r3arrow
from r3arrow.io import iter_rollouts, read_rollouts, rollout_files, write_rollouts
from r3arrow.io._interleave import warm_up
from r3arrow.spec import RouteSpec
from r3arrow.testing import random_rollouts

L, K, E, TOKENS = 48, 8, 128, 4096
SPEC = RouteSpec(num_layers=L, topk=K, num_experts=E)
STAGE = list(range(12, 24))  # stage 2 of 4


def _drop(path: Path) -> None:
    """Drop ``path`` from the page cache (written data is flushed first)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _io() -> tuple[int, int]:
    """(rchar, read_bytes) of this process from /proc/self/io; zeros off Linux."""
    try:
        with open("/proc/self/io") as fh:
            f = dict(line.split(":") for line in fh)
        return int(f["rchar"]), int(f["read_bytes"])
    except OSError:
        return 0, 0


def _best(fn: Callable[[], Any], repeat: int, cold: Path | None = None) -> tuple[float, int, int]:
    """(best seconds, rchar, read_bytes of the last run); ``cold``: drop that file first."""
    best, rchar, rbytes = float("inf"), 0, 0
    for _ in range(repeat):
        if cold is not None:
            _drop(cold)
        r0, b0 = _io()
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        r1, b1 = _io()
        best, rchar, rbytes = min(best, dt), r1 - r0, b1 - b0
    return best, rchar, rbytes


def _raw(path: Path, checksums: bool) -> None:
    with pq.ParquetFile(path, page_checksum_verification=checksums) as pf:
        for g in range(pf.metadata.num_row_groups):
            pf.read_row_group(g, columns=["routes"])


def _iterate(path: Path) -> None:
    for _ in iter_rollouts(rollout_files(path), columns=["routes"], validate=False):
        pass


_CHILD = """
import json, sys, time
import r3arrow
t0 = time.perf_counter(); r3arrow.read_rollouts(sys.argv[1], validate=False)
t1 = time.perf_counter(); r3arrow.read_rollouts(sys.argv[1], validate=False)
t2 = time.perf_counter()
import numba
t3 = time.perf_counter()
from r3arrow.io._interleave import warm_up
warm_up()
t4 = time.perf_counter()
out = {"first": t1 - t0, "second": t2 - t1, "numba_import": t3 - t2, "warm_up": t4 - t3}
print(json.dumps(out))
"""


def _cold_start(path: Path) -> dict[str, float]:
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path)], capture_output=True, text=True, check=True
    )
    result: dict[str, float] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=None, help="trajectories of 4096 tokens")
    p.add_argument("--repeat", type=int, default=None, help="best of N (default 5; quick 3)")
    p.add_argument("--dir", default=None, help="where to write the files (default: TMPDIR)")
    args = p.parse_args()
    rows = args.rows or (16 if args.quick else 128)
    repeat = args.repeat or (3 if args.quick else 5)
    route_bytes = rows * TOKENS * SPEC.row_nbytes
    table = random_rollouts(np.random.default_rng(0), SPEC, [(256, TOKENS - 256, TOKENS)] * rows)
    warm_up()
    d = Path(tempfile.mkdtemp(prefix="bench_storage_", dir=args.dir))
    try:
        files = {
            "groups of 6 (default)": write_rollouts(table, d / "g8.parquet"),
            "groups of 12 (4 stages)": write_rollouts(table, d / "g4.parquet", layer_group=12),
            "one group": write_rollouts(table, d / "g1.parquet", layer_group=L),
        }
        del table
        print(machine_line())
        src = np.ones(route_bytes, dtype=np.uint8)
        fresh, _, _ = _best(src.copy, repeat)
        del src
        warm = memcpy_gbps(route_bytes)
        print(
            f"routes {route_bytes / 1e6:.0f} MB ({rows} x {TOKENS} tokens, L={L} K={K} uint8); "
            f"memcpy {warm:.2f} GB/s into a warm buffer, {route_bytes / fresh / GB:.2f} GB/s "
            f"into a fresh one"
        )
        table_rows: list[list[Any]] = []
        for name, path in files.items():
            full_read = functools.partial(read_rollouts, path, validate=False)
            stage_read = functools.partial(read_rollouts, path, layers=STAGE, validate=False)
            raw, _, _ = _best(functools.partial(_raw, path, False), repeat)
            raw_crc, _, _ = _best(functools.partial(_raw, path, True), repeat)
            it, _, _ = _best(functools.partial(_iterate, path), repeat)
            full, _, _ = _best(full_read, repeat)
            stage, _, _ = _best(stage_read, repeat)
            cold_full, rc_full, _ = _best(full_read, repeat, cold=path)
            cold_stage, rc_stage, rb_stage = _best(stage_read, repeat, cold=path)
            table_rows.append(
                [
                    name,
                    raw * 1e3,
                    raw_crc * 1e3,
                    it * 1e3,
                    raw / it,
                    raw_crc / it,
                    full * 1e3,
                    route_bytes / full / GB,
                    stage * 1e3,
                    cold_full * 1e3,
                    rc_full / route_bytes,
                    cold_stage * 1e3,
                    rc_stage / route_bytes,
                    rb_stage / route_bytes,
                ]
            )
        headers = [
            "layout",
            "raw ms",
            "raw+crc ms",
            "iter ms",
            "iter × raw",
            "iter × raw+crc",
            "full ms",
            "full GB/s",
            "stage ms",
            "cold full ms",
            "full rchar ×",
            "cold stage ms",
            "stage rchar ×",
            "stage read_bytes ×",
        ]
        print(markdown_table(table_rows, headers))
        base = {r[0]: r[6] for r in table_rows}
        one = base["one group"]
        print(
            "full read vs one group (zero-copy restore, warm): "
            + ", ".join(f"{k} {v / one:.2f}x" for k, v in base.items())
        )
        cold = _cold_start(files["groups of 6 (default)"])
        print(
            f"fresh process, default layout: first full read {cold['first'] * 1e3:.1f} ms, "
            f"second {cold['second'] * 1e3:.1f} ms (validate=False does not import numba: "
            f"numpy interleave; r3arrow {r3arrow.__version__}); numba import + cached "
            f"kernels: {cold['numba_import']:.2f} s + {cold['warm_up']:.2f} s"
        )
    finally:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
