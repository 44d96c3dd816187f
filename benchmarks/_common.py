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
import contextlib
import json
import os
import resource
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
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


class _BenchParser(argparse.ArgumentParser):
    """Every benchmark's parser: ``--quick``, and ``--against REV`` handled here, once.

    With ``--against REV`` (a git revision, or the path of another checkout) the script is not
    run in this process: `run_against` runs it twice in fresh processes, with this tree's
    r3arrow and with REV's, and prints both outputs and the ratios of their tables.
    """

    def parse_args(self, *args: Any, **kwargs: Any) -> Any:  # type: ignore[override]
        ns = super().parse_args(*args, **kwargs)
        if ns.against is not None:
            argv = list(args[0]) if args and args[0] is not None else sys.argv[1:]
            sys.exit(run_against(ns.against, _without_against(argv)))
        return ns


def parser(description: str) -> argparse.ArgumentParser:
    """The benchmark ArgumentParser: ``--quick`` (small sizes, seconds) and ``--against REV``."""
    p = _BenchParser(description=description)
    p.add_argument("--quick", action="store_true", help="small sizes; runs in a few seconds")
    p.add_argument(
        "--against",
        metavar="REV",
        help="also run on git revision REV (a temporary worktree) or the checkout at path REV, "
        "in the same run, and print this tree's figures over REV's",
    )
    return p


def _without_against(argv: Sequence[str]) -> list[str]:
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a == "--against":
            skip = True
        elif not a.startswith("--against="):
            out.append(a)
    return out


def checkout(rev: str, stack: contextlib.ExitStack) -> Path:
    """``rev`` as a directory: an existing checkout as is, else a temporary git worktree."""
    if Path(rev).is_dir():
        return Path(rev).resolve()
    root = Path(__file__).resolve().parent.parent
    tree = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="r3arrow-against-")))
    tree = tree / "tree"
    subprocess.run(
        ["git", "-C", str(root), "worktree", "add", "--detach", "-q", str(tree), rev], check=True
    )
    stack.callback(
        subprocess.run, ["git", "-C", str(root), "worktree", "remove", "--force", str(tree)]
    )
    return tree


def _run_script(script: Path, argv: Sequence[str], r3arrow_root: Path) -> tuple[int, str]:
    """Run ``script`` with ``r3arrow`` imported from ``r3arrow_root``; (exit code, stdout)."""
    env = {**os.environ, "PYTHONPATH": str(r3arrow_root), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, str(script), *argv],
        cwd=script.parent,
        env=env,
        stdout=subprocess.PIPE,
        text=True,
        errors="replace",
    )
    return proc.returncode, proc.stdout


def markdown_tables(text: str) -> list[tuple[list[str], list[list[str]]]]:
    """The markdown tables in ``text``: (headers, rows of cells), in order."""
    tables: list[tuple[list[str], list[list[str]]]] = []
    block: list[list[str]] = []
    for line in [*text.splitlines(), ""]:
        if line.startswith("|"):
            block.append([c.strip() for c in line.strip().strip("|").split("|")])
            continue
        if len(block) >= 2 and set("".join(block[1])) <= set("-: "):
            tables.append((block[0], block[2:]))
        block = []
    return tables


def _number(cell: str) -> float | None:
    try:
        return float(cell.replace(",", "").rstrip("x×%").strip())
    except ValueError:
        return None


def ratio_tables(this: str, other: str) -> str:
    """Markdown tables of this run's numbers over the other's: each table of ``this`` matched
    by position and headers, rows by their first cell; other cells are kept as text."""
    out = []
    theirs = markdown_tables(other)
    for i, (headers, rows) in enumerate(markdown_tables(this)):
        if i >= len(theirs) or theirs[i][0] != headers:
            continue
        by_label = {r[0]: r for r in theirs[i][1] if r}
        cells = []
        for r in rows:
            o = by_label.get(r[0])
            if o is None or len(o) != len(r):
                continue
            row: list[Any] = [r[0]]
            for a, b in zip(r[1:], o[1:], strict=True):
                x, y = _number(a), _number(b)
                row.append(f"{x / y:.2f}" if x is not None and y else a if a == b else f"{a} / {b}")
            cells.append(row)
        if cells:
            out.append(markdown_table(cells, headers))
    return "\n\n".join(out)


def run_against(rev: str, argv: Sequence[str]) -> int:
    """Run the calling benchmark on this tree and on ``rev`` and print both and their ratios.

    The same script (this tree's) runs against both packages; where it fails on ``rev``
    (an API that changed), ``rev``'s own copy of the script runs instead, if it has one.
    Returns the exit code: non-zero when this tree's run failed.
    """
    script = Path(sys.argv[0]).resolve()
    here = script.parent.parent
    with contextlib.ExitStack() as stack:
        tree = checkout(rev, stack)
        code, mine = _run_script(script, argv, here)
        print(f"### this tree ({here})\n\n{mine}", flush=True)
        if code != 0:
            return code
        other_code, theirs = _run_script(script, argv, tree)
        how = "this tree's script"
        own = tree / "benchmarks" / script.name
        if other_code != 0 and own.exists():
            other_code, theirs = _run_script(own, argv, tree)
            how = "its own script"
        print(f"### --against {rev} ({how})\n\n{theirs}", flush=True)
        if other_code != 0:
            print(f"(the run against {rev} failed with exit code {other_code})")
            return 0
        ratios = ratio_tables(mine, theirs)
        title = f"### this tree / {rev} (each number over its counterpart)"
        print(f"{title}\n\n{ratios or '(no tables to compare)'}")
    return 0


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
    "arrow_peak_mb",
    "best_of",
    "checkout",
    "machine_line",
    "markdown_table",
    "markdown_tables",
    "memcpy_gbps",
    "parser",
    "peak_rss_mb",
    "proc_status_mb",
    "ratio_tables",
    "reset_peak_rss",
    "run_against",
    "run_isolated",
]
