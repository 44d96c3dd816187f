"""Shared benchmark helpers: timing, the machine's memory-copy speed, peak memory, tables.

Every benchmark measures its baseline and `memcpy_gbps` in the same run and reports ratios;
`peak_rss_mb` (this process's own VmHWM; `reset_peak_rss` restarts it) and `arrow_peak_mb`
(Arrow's pool peak, which tracemalloc misses) report peak memory; `run_isolated` runs a case
in its own process so its peak is its own.
A benchmark script imports it as ``from _common import ...`` with no ``sys.path`` edit:
Python puts a script's own directory first on ``sys.path`` (``python benchmarks/bench_x.py``
and ``benchmarks/report.py``, which runs the scripts from ``benchmarks/``, both work), and r3arrow
itself comes from the installed (editable) package. From the repository root, use
``from benchmarks._common import ...``. This module never edits ``sys.path``.
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
    """Memory-copy speed in GB/s: numpy copy of ``nbytes`` into a warm preallocated buffer,
    best of ``repeat``."""
    nbytes = max(1, int(nbytes))
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    dst[:] = 0  # first touch outside the timing: page faults are not copy speed
    t = best_of(lambda: np.copyto(dst, src), repeat)
    return nbytes / t / GB


def proc_status_mb(field: str) -> float:
    """A memory line of ``/proc/self/status`` (``VmRSS``, ``VmHWM``, ...) in MiB; NaN where
    ``/proc`` is unavailable (not Linux) or the field is missing."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024  # the kernel reports kB (KiB)
    except OSError:
        pass
    return float("nan")


def reset_peak_rss() -> bool:
    """Reset this process's peak RSS (VmHWM) to its current RSS by writing ``5`` to
    ``/proc/self/clear_refs`` (Linux ≥ 4.0); True on success, False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def peak_rss_mb() -> float:
    """This process's own peak RSS in MiB: ``VmHWM`` (since start or the last `reset_peak_rss`).

    Not ``ru_maxrss`` on Linux: a child's ``ru_maxrss`` starts at its parent's RSS at
    fork/vfork and survives exec, so it overstates a child's peak. Off Linux (no ``/proc``) it
    falls back to ``ru_maxrss`` (KiB on Linux, bytes on macOS), with that caveat.
    """
    hwm = proc_status_mb("VmHWM")
    if hwm == hwm:
        return hwm
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return maxrss / 2**20 if sys.platform == "darwin" else maxrss / 1024


def arrow_peak_mb() -> float:
    """Peak bytes held by pyarrow's default memory pool in this process, in MB."""
    import pyarrow as pa

    peak = pa.default_memory_pool().max_memory()  # None where the pool does not track it
    return float("nan") if peak is None else float(peak) / 2**20


def run_isolated(
    module_path: str, args: Sequence[str] = (), *, timeout: float = 600
) -> dict[str, Any]:
    """Run ``python module_path *args`` in a fresh process; return its last stdout line parsed as
    JSON. Raises RuntimeError on a non-zero exit or timeout.

    ``peak_rss_mb`` is the child's own peak when it reports one (a child should print
    ``peak_rss_mb()``, i.e. its VmHWM). Otherwise the ``os.wait4`` rusage is used only where it
    is provably the child's own: a child's ``ru_maxrss`` starts at the parent's RSS (at most
    this process's VmHWM at launch) and survives exec, so a value at or below that bound says
    nothing and ``peak_rss_mb`` is NaN. ``rusage_maxrss_mb`` always carries the raw rusage
    value (child and its waited-for descendants), an upper bound.
    """
    inherited_bound = peak_rss_mb()
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
    maxrss = usage.ru_maxrss / (2**20 if sys.platform == "darwin" else 1024)
    result["rusage_maxrss_mb"] = maxrss
    result.setdefault("peak_rss_mb", maxrss if maxrss > inherited_bound else float("nan"))
    return result


def markdown_table(rows: Sequence[Sequence[Any]], headers: Sequence[str]) -> str:
    """A GitHub markdown table of ``rows``; floats get 3 significant digits (1 decimal if ≥100)."""

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
    """One line describing the machine (CPUs, Python, numpy/pyarrow versions) for the report."""
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
    "proc_status_mb",
    "reset_peak_rss",
    "run_isolated",
]
