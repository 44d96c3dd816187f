"""Cold start: a fresh process that validates, writes and reads one small rollout table.

What a CLI call or a new rollout worker pays before its first route is checked: imports,
the compiled kernels (numba's disk cache, or a compile), and one write and read of a
4-trajectory table of a 48 x top-8 spec. Baseline: a fresh process that imports pyarrow and
writes and reads the same table's columns with plain pyarrow. Each case runs in its own
process ``--repeat`` times; the first run may fill numba's cache, so the best of the later
runs is the steady cold start. ``--against REV`` runs the same against another revision.
"""

from __future__ import annotations

import subprocess
import sys
import time

from _common import markdown_table, parser

_R3ARROW = """
import tempfile, pathlib, numpy as np, r3arrow
from r3arrow.testing import random_rollouts
spec = r3arrow.RouteSpec(num_layers=48, topk=8, num_experts=128)
t = random_rollouts(np.random.default_rng(0), spec, [(64, 64, 128)] * 4)
d = pathlib.Path(tempfile.mkdtemp())
r3arrow.write_rollouts(t, d, step=0)
r3arrow.read_rollouts(d)
"""

_PYARROW = """
import tempfile, pathlib, numpy as np, pyarrow as pa, pyarrow.parquet as pq
n = 4 * 191
routes = np.random.default_rng(0).integers(0, 128, (n, 48 * 8), dtype=np.uint8)
t = pa.table({"routes": pa.FixedSizeListArray.from_arrays(pa.array(routes.reshape(-1)), 384)})
p = pathlib.Path(tempfile.mkdtemp()) / "r.parquet"
pq.write_table(t, p)
pq.read_table(p)
"""


def _run(code: str, repeat: int) -> tuple[float, float]:
    """(first, best of the rest) wall seconds of ``code`` in fresh processes (this process's
    environment: ``--against`` points ``PYTHONPATH`` at the other checkout)."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", code], check=True)
        times.append(time.perf_counter() - t0)
    return times[0], min(times[1:] or times)


def main() -> None:
    p = parser(__doc__ or "")
    p.add_argument("--repeat", type=int, default=0, help="runs per case (default 3, quick 2)")
    args = p.parse_args()
    repeat = args.repeat or (2 if args.quick else 3)
    base_first, base = _run(_PYARROW, repeat)
    first, best = _run(_R3ARROW, repeat)
    rows = [
        ["plain pyarrow (baseline)", base_first, base, 1.0],
        ["r3arrow", first, best, best / base],
    ]
    print(markdown_table(rows, ["process", "first s", "best later s", "x baseline"]))


if __name__ == "__main__":
    main()
