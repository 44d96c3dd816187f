"""Regenerate ``docs/benchmarks.md``: run every ``benchmarks/bench_*.py`` and collect its tables.

Each benchmark runs as its own subprocess from the ``benchmarks/`` folder (so its
``from _common import ...`` works), with this interpreter. Its standard output (markdown
tables and the lines around them) goes into the report beside the exact command that
produced it, under a header with the date, the machine (CPU model, cores, memory, load) and
the Python / numpy / pyarrow versions. A benchmark that exits non-zero or runs past
``--timeout`` is reported as failed in the file (with the tail of its stderr), and the command
then exits 1; the file is written either way.

    .venv/bin/python benchmarks/report.py                 # full sizes (minutes to hours)
    .venv/bin/python benchmarks/report.py --quick         # small sizes (~15 min on 2 busy cores)
    .venv/bin/python benchmarks/report.py --only codec io --out /tmp/b.md
    .venv/bin/python benchmarks/report.py --against 888451f   # the previous main (default HEAD~1)

``docs/benchmarks.md`` is only ever written by this script: edit the scripts, not the file.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import datetime as dt
import importlib.metadata
import os
import platform
import re
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from _common import checkout

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
DEFAULT_OUT = REPO_ROOT / "docs" / "benchmarks.md"
STDERR_TAIL_LINES = 40
OPTIONAL_PACKAGES = ("torch", "polars", "numba", "megatron-core", "ray")
# The report cites no tracker numbers (the benchmarks' own texts still may): these patterns
# drop "(issue 14, ...)", "issue 13's ", "issue 3", "-#1912-" and " #1912" from what goes in.
_TRACKER_REFS = (
    (re.compile(r"\s*\((?:issues?\s+\d+(?:[–-]\d+)?)[^()]*\)", re.IGNORECASE), ""),
    (re.compile(r"\bissues?\s+\d+(?:[–-]\d+)?'s\s+", re.IGNORECASE), ""),
    (re.compile(r"\s*\bissues?\s+\d+(?:[–-]\d+)?\b", re.IGNORECASE), ""),
    (re.compile(r"-#\d+(?=-)"), ""),
    (re.compile(r"\s+#\d+\b"), ""),
)


@dataclass(frozen=True)
class Result:
    """One benchmark's run: its name, the command shown in the report, and what it printed."""

    name: str
    summary: str
    command: str
    returncode: int | None  # None: killed at the timeout
    seconds: float
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0


def without_tracker_refs(text: str) -> str:
    """``text`` without issue / pull-request numbers."""
    for pattern, repl in _TRACKER_REFS:
        text = pattern.sub(repl, text)
    return text


def available_benchmarks() -> dict[str, Path]:
    """``{name: path}`` of ``benchmarks/bench_NAME.py``, sorted by name."""
    return {p.stem.removeprefix("bench_"): p for p in sorted(BENCH_DIR.glob("bench_*.py"))}


def summary_line(path: Path) -> str:
    """The first line of a script's module docstring (read without importing it)."""
    doc = ast.get_docstring(ast.parse(path.read_text(encoding="utf-8")))
    return without_tracker_refs(doc.splitlines()[0].strip()) if doc else ""


def shown_python() -> str:
    """This interpreter as a user would type it from ``benchmarks/``."""
    exe = Path(sys.executable)
    try:
        return os.path.relpath(exe, BENCH_DIR) if exe.is_relative_to(REPO_ROOT) else str(exe)
    except ValueError:  # another drive (Windows)
        return str(exe)


def run_benchmark(
    name: str, path: Path, *, quick: bool, timeout: float, against: tuple[str, Path] | None = None
) -> Result:
    """Run one benchmark script from ``benchmarks/`` and capture its output; ``against``:
    (the revision as shown, its checkout) for the script's ``--against``."""
    args = [path.name, *(["--quick"] if quick else [])]
    shown = [*args, *(["--against", against[0]] if against else [])]
    command = "cd benchmarks && " + " ".join([shown_python(), *shown])
    if against is not None:
        args += ["--against", str(against[1])]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    t0 = time.perf_counter()
    # Its own session, so a timeout also ends the processes the benchmark started itself.
    proc = subprocess.Popen(
        [sys.executable, *args],
        cwd=BENCH_DIR,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        errors="replace",
        start_new_session=True,
    )
    returncode: int | None
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        returncode = proc.returncode
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        returncode = None
        stderr += f"\nkilled after the {timeout:g} s timeout\n"
    return Result(
        name=name,
        summary=summary_line(path),
        command=command,
        returncode=returncode,
        seconds=time.perf_counter() - t0,
        stdout=without_tracker_refs(stdout),
        stderr=without_tracker_refs(stderr),
    )


def _read_first(path: str, key: str) -> str:
    """The value of the first ``key: value`` line of a ``/proc`` file, or ``""``."""
    try:
        with open(path, encoding="utf-8") as fh:
            for line in fh:
                k, sep, v = line.partition(":")
                if sep and k.strip() == key:
                    return v.strip()
    except OSError:
        pass
    return ""


def load_average() -> float | None:
    """The 1-minute load average, or None where the platform has none."""
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_lines() -> list[str]:
    """Markdown bullet lines describing this machine and the software versions."""
    import numpy as np
    import pyarrow as pa

    cpu = _read_first("/proc/cpuinfo", "model name") or platform.processor() or "unknown CPU"
    logical = os.cpu_count()
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else logical
    mem_kb = _read_first("/proc/meminfo", "MemTotal").removesuffix("kB").strip()
    memory = f"{int(mem_kb) / 2**20:.1f} GiB" if mem_kb.isdigit() else "unknown"
    optional = ", ".join(f"{d} {v}" for d in OPTIONAL_PACKAGES if (v := _version(d)) is not None)
    return [
        f"* CPU: {cpu} ({platform.machine()}), {logical} logical cores ({usable} usable here)",
        f"* memory: {memory}; OS: {platform.system()} {platform.release()}",
        f"* Python {platform.python_version()}, numpy {np.__version__}, "
        f"pyarrow {pa.__version__}, r3arrow {_version('r3arrow') or 'unknown'}",
        f"* optional packages: {optional or 'none installed'}",
    ]


def git_commit() -> str:
    """The checkout's commit, with ``+ uncommitted changes`` where the tree differs from it, or
    ``""`` outside git. Read-only: ``GIT_OPTIONAL_LOCKS=0`` keeps git from refreshing the index."""
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}

    def git(*args: str) -> subprocess.CompletedProcess[str] | None:
        try:
            return subprocess.run(
                ["git", *args],
                cwd=REPO_ROOT,
                env=env,
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            )
        except (OSError, subprocess.TimeoutExpired):
            return None

    head = git("rev-parse", "--short=12", "HEAD")
    if head is None or head.returncode != 0:
        return ""
    diff = git("diff", "--quiet", "HEAD", "--")
    dirty = diff is not None and diff.returncode == 1
    return f"`{head.stdout.strip()}`" + (" + uncommitted changes" if dirty else "")


def output_blocks(text: str) -> list[str]:
    """A benchmark's stdout as markdown: table rows as tables, other lines as text blocks."""
    blocks: list[str] = []
    table: list[str] = []
    plain: list[str] = []

    def flush() -> None:
        if table:
            blocks.append("\n".join(table))
            table.clear()
        if plain:
            while plain and not plain[-1].strip():
                plain.pop()
            if plain:
                blocks.append("```text\n" + "\n".join(plain) + "\n```")
            plain.clear()

    for raw in text.splitlines():
        line = raw.rstrip()
        is_row = line.lstrip().startswith("|")
        if (is_row and plain) or (not is_row and table):
            flush()
        if is_row:
            table.append(line.strip())
        elif line or plain:
            plain.append(line)
    flush()
    return blocks


def render(
    results: Sequence[Result],
    *,
    quick: bool,
    only: Sequence[str] | None,
    note: str,
    started: dt.datetime,
    load: tuple[float | None, float | None],
) -> str:
    """The whole report as markdown."""
    cores = os.cpu_count() or 1
    mode = "quick mode (`--quick`: small sizes)" if quick else "full sizes"
    load_start, load_end = load
    busy = [x for x in load if x is not None and x > 0.5 * cores]
    load_text = ""
    if load_start is not None and load_end is not None:
        load_text = f"; load average {load_start:.2f} at start, {load_end:.2f} at end"
        if busy:
            load_text += (
                f" on {cores} cores: the machine was shared with other jobs, so expect noise"
            )
    failed = [r.name for r in results if not r.ok]
    commit = git_commit()
    cmd = " ".join(
        [
            "benchmarks/report.py",
            *(["--quick"] if quick else []),
            *(["--only", *only] if only else []),
        ]
    )
    lines = [
        "# Benchmarks",
        "",
        f"{started:%Y-%m-%d %H:%M} UTC, {mode}{load_text}."
        + (f" {note.strip()}" if note.strip() else ""),
        "",
        f"Generated by `.venv/bin/python {cmd}` from the repository root (`--only NAME ...` runs",
        "some, `--out PATH` writes elsewhere); do not edit by hand. Every benchmark measures its",
        "baseline and this machine's memory-copy speed in the same run and reports ratios, so",
        "compare ratios, not absolute times, across machines. Each section shows the exact command",
        "(run from `benchmarks/`) that printed its tables.",
        "",
        "Machine" + (f" (checkout {commit})" if commit else "") + ":",
        "",
        *machine_lines(),
        "",
        f"{len(results) - len(failed)} of {len(results)} benchmarks ran"
        + (f"; failed: {', '.join(failed)}." if failed else "."),
        "",
        "| benchmark | status | seconds |",
        "|---|---|---|",
        *(f"| [{r.name}](#{r.name}) | {_status(r)} | {r.seconds:.1f} |" for r in results),
    ]
    for r in results:
        lines += [*([""] if lines[-1] else []), f"## {r.name}", ""]
        if r.summary:
            lines += [r.summary, ""]
        lines += ["```bash", r.command, "```", ""]
        if not r.ok:
            lines += [
                f"**Failed** ({_status(r).removeprefix('failed: ')}). The end of its stderr:",
                "",
            ]
            tail = r.stderr.strip().splitlines()[-STDERR_TAIL_LINES:]
            lines += ["```text", *tail, "```", ""]
            if r.stdout.strip():
                lines += ["What it printed before failing:", ""]
        blocks = output_blocks(r.stdout)
        for block in blocks:
            lines += [block, ""]
        if r.ok and not blocks:
            lines += ["(no output)", ""]
    return "\n".join(lines).rstrip() + "\n"


def _status(r: Result) -> str:
    if r.returncode is None:
        return "failed: timeout"
    return "ok" if r.returncode == 0 else f"failed: exit {r.returncode}"


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file in the same folder."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def parse_args(argv: Sequence[str] | None, names: Sequence[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="pass --quick to each: small sizes")
    p.add_argument(
        "--only", nargs="+", metavar="NAME", choices=names, help=f"only these: {' '.join(names)}"
    )
    p.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="where to write (docs/benchmarks.md)"
    )
    p.add_argument(
        "--timeout", type=float, default=3600.0, help="seconds per benchmark (default 3600)"
    )
    p.add_argument("--note", default="", help="a sentence added to the header line")
    p.add_argument(
        "--against",
        default="HEAD~1",
        metavar="REV",
        help="the previous main, run beside this tree by every benchmark (a git worktree; "
        "default HEAD~1; 'none' to skip)",
    )
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    available = available_benchmarks()
    args = parse_args(argv, list(available))
    selected: list[str] = args.only or list(available)
    started = dt.datetime.now(dt.UTC)
    load_start = load_average()
    results: list[Result] = []
    with contextlib.ExitStack() as stack:
        against = None
        if args.against != "none":
            rev = subprocess.run(
                ["git", "-C", str(REPO_ROOT), "rev-parse", "--short", args.against],
                check=True,
                capture_output=True,
                text=True,
            ).stdout.strip()
            against = (rev, checkout(rev, stack))
        for name in selected:
            print(f"report: {name} ...", file=sys.stderr, flush=True)
            r = run_benchmark(
                name, available[name], quick=args.quick, timeout=args.timeout, against=against
            )
            print(f"report: {name} {_status(r)} in {r.seconds:.1f} s", file=sys.stderr, flush=True)
            results.append(r)
    out: Path = args.out
    text = render(
        results,
        quick=args.quick,
        only=args.only,
        note=args.note,
        started=started,
        load=(load_start, load_average()),
    )
    write_atomic(out, text)
    failed = [r.name for r in results if not r.ok]
    print(
        f"report: wrote {out}; {len(results) - len(failed)}/{len(results)} ran"
        + (f", failed: {' '.join(failed)}" if failed else ""),
        file=sys.stderr,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
