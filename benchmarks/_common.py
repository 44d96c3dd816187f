"""Shared benchmark helpers: timing, the machine's memory-copy speed, peak memory, tables.

Every benchmark measures its baseline and `memcpy_gbps` in the same run and reports ratios;
`peak_memory` reports the process peak RSS and Arrow's pool peak (which tracemalloc misses).
Import from a benchmark script as ``from _common import ...`` (the scripts run from
``benchmarks/``) or ``from benchmarks._common import ...`` from the repository root.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

GB = 1e9


def best_of(fn: Callable[[], Any], repeat: int = 5, *, warmup: int = 1) -> float:
    """Best wall time of ``fn()`` in seconds over ``repeat`` runs after ``warmup`` untimed runs."""
    for _ in range(warmup):
        fn()
    best = float("inf")
    for _ in range(max(1, repeat)):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


class Timer:
    """Context manager: ``with Timer() as t: ...; t.seconds``."""

    seconds: float = 0.0

    def __enter__(self) -> Timer:
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self._t0


def memcpy_gbps(nbytes: int, repeat: int = 5) -> float:
    """Memory-copy speed in GB/s: numpy copy of ``nbytes`` into a warm preallocated buffer, best of ``repeat``."""
    nbytes = max(1, int(nbytes))
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    dst[:] = 0  # first touch outside the timing: page faults are not copy speed
    t = best_of(lambda: np.copyto(dst, src), repeat)
    return nbytes / t / GB


def peak_rss_mb() -> float:
    """Peak resident set size of this process so far, in MB (Linux ru_maxrss is KiB)."""
    kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kib / 1024 if sys.platform != "darwin" else kib / 2**20


def arrow_peak_mb() -> float:
    """Peak bytes held by pyarrow's default memory pool in this process, in MB."""
    import pyarrow as pa

    return float(pa.default_memory_pool().max_memory()) / 2**20


def run_isolated(
    module_path: str, args: Sequence[str] = (), *, timeout: float = 600
) -> dict[str, Any]:
    """Run ``python module_path *args`` in a fresh process; return its last stdout line parsed as
    JSON, plus ``peak_rss_mb``: that child's own peak RSS (``os.wait4`` rusage), so each case's
    peak memory is measured alone. Raises RuntimeError on a non-zero exit or timeout."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen([sys.executable, module_path, *args], stdout=out, stderr=err)
        killer = threading.Timer(timeout, proc.kill)
        killer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            killer.cancel()
        proc.returncode = os.waitstatus_to_exitcode(status)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    if proc.returncode != 0:
        raise RuntimeError(
            f"{module_path} {list(args)} failed ({proc.returncode}):\n{stderr[-4000:]}"
        )
    lines = [ln for ln in stdout.splitlines() if ln.strip()]
    result: dict[str, Any] = json.loads(lines[-1]) if lines else {}
    result.setdefault("peak_rss_mb", usage.ru_maxrss / 1024)
    return result


def markdown_table(rows: Sequence[Sequence[Any]], headers: Sequence[str]) -> str:
    """Render rows as a GitHub markdown table; floats get 3 significant digits (or 1 decimal if ≥100)."""

    def fmt(v: Any) -> str:
        if isinstance(v, float):
            if v != v or v in (float("inf"), float("-inf")):
                return str(v)
            return f"{v:,.1f}" if abs(v) >= 100 else f"{v:.3g}"
        return str(v)

    cells = [[fmt(v) for v in r] for r in rows]
    widths = [
        max(len(h), *(len(c[i]) for c in cells)) if cells else len(h) for i, h in enumerate(headers)
    ]
    line = "| " + " | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)) + " |"
    sep = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    body = [
        "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |" for r in cells
    ]
    return "\n".join([line, sep, *body])


def parser(description: str) -> argparse.ArgumentParser:
    """An ArgumentParser with the common ``--quick`` flag (small sizes, runs in seconds)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="small sizes; runs in a few seconds")
    return p


def add_quick(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add ``--quick`` to an existing parser."""
    p.add_argument("--quick", action="store_true", help="small sizes; runs in a few seconds")
    return p


def machine_line() -> str:
    """One line describing the machine (CPU count, Python, numpy/pyarrow versions) for the report."""
    import platform

    import pyarrow as pa

    return (
        f"{platform.machine()} cpus={os.cpu_count()} python={platform.python_version()} "
        f"numpy={np.__version__} pyarrow={pa.__version__}"
    )


__all__ = [
    "GB",
    "Timer",
    "add_quick",
    "arrow_peak_mb",
    "best_of",
    "machine_line",
    "markdown_table",
    "memcpy_gbps",
    "parser",
    "peak_rss_mb",
    "run_isolated",
]
