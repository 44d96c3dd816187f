"""Cost of the portable routes layout (`write_rollouts(portable=True)`) vs the default storage.

The default stores each trajectory's routes as layer groups of binary columns
(docs/storage.md); the portable layout stores plain nested integer lists that pandas, Polars,
DuckDB and HF ``datasets`` read as integers (docs/portable.md). Both are written and read
through r3arrow in the same run, with the machine's memory-copy speed, and reported as ratios
(portable / default, and each / memcpy of the route bytes), file sizes and the Arrow pool's
peak.

    python benchmarks/bench_portable.py [--quick] [--json]
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
from _common import best_of, memcpy_gbps, parser

from r3arrow import RouteSpec, read_rollouts, write_rollouts
from r3arrow.testing import random_rollouts


def main() -> None:
    ap = parser(__doc__.splitlines()[0] + " (--quick: 8 x 1K tokens instead of 32 x 2K)")
    ap.add_argument("--json", action="store_true", help="print one JSON line")
    args = ap.parse_args()
    rows, tokens = (8, 1024) if args.quick else (32, 2048)
    spec = RouteSpec(num_layers=48, topk=8, num_experts=128)
    rng = np.random.default_rng(0)
    table = random_rollouts(rng, spec, [(tokens // 2, tokens // 2, tokens - 1)] * rows)
    route_bytes = rows * (tokens - 1) * spec.row_nbytes
    copy_s = route_bytes / (memcpy_gbps(route_bytes) * 1e9)
    result: dict[str, float] = {"route_mib": route_bytes / 2**20, "memcpy_ms": copy_s * 1e3}
    with tempfile.TemporaryDirectory() as tmp:
        for name, portable in (("default", False), ("portable", True)):
            path = Path(tmp) / f"{name}.parquet"
            pool = pa.default_memory_pool()
            write_s = best_of(lambda p=path, q=portable: write_rollouts(table, p, portable=q), 3)
            read_s = best_of(lambda p=path: read_rollouts(p), 3)
            result[f"{name}_write_ms"] = write_s * 1e3
            result[f"{name}_read_ms"] = read_s * 1e3
            result[f"{name}_file_mib"] = path.stat().st_size / 2**20
            result[f"{name}_read_x_memcpy"] = read_s / copy_s
            result[f"{name}_arrow_peak_mib"] = pool.max_memory() / 2**20
    for what in ("write_ms", "read_ms", "file_mib"):
        result[f"portable_over_default_{what}"] = (
            result[f"portable_{what}"] / result[f"default_{what}"]
        )
    if args.json:
        print(json.dumps(result))
        return
    print(
        f"routes: {rows} x {tokens} tokens, 48 layers x top-8 uint8, {result['route_mib']:.1f} MiB"
    )
    print(f"memcpy of the route bytes: {result['memcpy_ms']:.2f} ms")
    print("| layout | write ms | read ms | read / memcpy | file MiB | Arrow peak so far MiB |")
    print("|---|---|---|---|---|---|")
    for name in ("default", "portable"):
        print(
            f"| {name} | {result[f'{name}_write_ms']:.1f} | {result[f'{name}_read_ms']:.1f} | "
            f"{result[f'{name}_read_x_memcpy']:.1f}x | {result[f'{name}_file_mib']:.1f} | "
            f"{result[f'{name}_arrow_peak_mib']:.0f} |"
        )
    print(
        f"portable / default: write {result['portable_over_default_write_ms']:.1f}x, read "
        f"{result['portable_over_default_read_ms']:.1f}x, size "
        f"{result['portable_over_default_file_mib']:.2f}x"
    )


if __name__ == "__main__":
    main()
