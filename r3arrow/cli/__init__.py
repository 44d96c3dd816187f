"""The ``r3arrow`` command line: demo, inspect, stats, diagnose, convert, export, gc.

Exit codes: 0 success, 1 data or runtime error (one line on stderr starting with
``r3arrow: error:``), 2 usage error (argparse's message), 130 interrupted, 141 stdout
closed early (nothing printed). No traceback reaches the user. Inputs are opened only if
they are regular files or directories (a FIFO would block, a device never ends).
``demo`` runs the embedded reference engine of `r3arrow.testing.demo`.
"""

from __future__ import annotations

import argparse
import os
import sys
import urllib.parse
from collections.abc import Sequence
from pathlib import Path

import orjson
import pyarrow as pa
from pyarrow import ArrowException

from r3arrow.cli._convert import convert_jsonl
from r3arrow.cli._inspect import (
    check_input,
    human_bytes,
    inspect_summary,
    is_ipc,
    rollout_input,
)
from r3arrow.errors import R3ArrowError, SchemaError
from r3arrow.spec import RouteSpec

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2


def _read_any(path: Path) -> pa.Table:
    """A rollout Parquet file, root, demo folder or Arrow IPC file; `SchemaError` without
    ``routes``."""
    from r3arrow.io import read_rollouts

    path = rollout_input(path)
    table = read_rollouts(path)  # Parquet or Arrow IPC (by its magic bytes)
    if "routes" not in table.schema.names:
        raise SchemaError(
            f"{path}: expected a 'routes' column in the rollout file (R3 on), found columns "
            f"{table.schema.names}",
            path=path,
        )
    return table


def _print_json(obj: object) -> int:
    sys.stdout.write(orjson.dumps(obj, option=orjson.OPT_INDENT_2).decode() + "\n")
    return EXIT_OK


# --------------------------------------------------------------------- inspect
def _cmd_inspect(args: argparse.Namespace) -> int:
    info = inspect_summary(Path(args.path))
    if args.json:
        return _print_json(info)
    spec = info["spec"]
    print(f"{info['path']}")
    print(f"  rows (trajectories): {info['rows']}")
    print(f"  tokens:              {info['tokens']}")
    fraction = f"{info['captured_fraction']:.1%} of tokens"
    print(f"  captured rows:       {info['captured_rows']} ({fraction})")
    if spec is None:
        print("  spec:                none (R3 off: no routes column)")
    else:
        print(
            f"  spec:                {spec['num_layers']} layers x top-{spec['topk']}, "
            f"{spec['num_experts']} experts, ids {spec['dtype']}, router layers "
            f"{spec['moe_layers'] if spec['moe_layers'] is not None else 'all'}"
        )
    print(f"  route bytes:         {human_bytes(info['route_bytes'])}")
    print(f"  size on disk:        {human_bytes(info['size_on_disk'])}")
    if info["temp_files"]:
        print(
            f"  leftover temps:      {info['temp_files']} files, "
            f"{human_bytes(info['temp_bytes'])} "
            f"({human_bytes(info['stale_temp_bytes'])} of dead writers: r3arrow gc)"
        )
    if "steps" in info:
        print(f"  steps:               {info['steps']}")
    print("  columns:")
    for name, typ in info["columns"].items():
        print(f"    {name}: {typ}")
    return EXIT_OK


# ----------------------------------------------------------------------- stats
def _cmd_stats(args: argparse.Namespace) -> int:
    from r3arrow import stats

    path = rollout_input(Path(args.path))
    load = stats.expert_load(_read_any(path) if is_ipc(path) else path, tokens=args.tokens)
    summary = stats.load_summary(load)
    if args.plot:
        from r3arrow.plot import plot_expert_load

        plot_expert_load(load, args.plot, title=f"expert load ({args.tokens} tokens): {path.name}")
    if args.json:
        out = {"tokens": args.tokens, "load": load.to_dicts(), "layers": summary.to_dicts()}
        return _print_json(out)
    import polars as pl

    with pl.Config(tbl_rows=64, tbl_cols=16, float_precision=3):
        print(f"per-layer routing ({args.tokens} tokens) of {path}")
        print(summary)
    if args.plot:
        print(f"heatmap written to {args.plot}")
    return EXIT_OK


# -------------------------------------------------------------------- diagnose
def _cmd_diagnose(args: argparse.Namespace) -> int:
    from r3arrow.cli import _diagnose as diag

    path = Path(args.path)
    check_input(path)
    source, per_step = diag.load_agreements(path, args.source)
    mismatch = diag.load_mismatch(path, source, per_step)
    info = diag.report(source, per_step, mismatch, diag.load_fallback(path))
    png = None
    if args.png:
        png = diag.plot(Path(args.png), path.name, per_step, mismatch)
    if args.json:
        out = {**info, "png": str(png) if png is not None else None}
        return _print_json(out)
    diag.print_report(path, info)
    if png is not None:
        print(f"plot written to {png}")
    return EXIT_OK


# --------------------------------------------------------------------- convert
_FORMATS = ("vllm", "packed", "sglang", "npy")
_CONVERT_HELP = """\
Build a rollout Parquet from JSON-lines dumps, one trajectory per line:

  {"prompt_ids": [...], "response_ids": [...], "routed_experts": PAYLOAD}
  {"prompt_ids": [...], "response_ids": [...], "routes_npy": "t0.npy"}

PAYLOAD is the engine's routes in --format: vllm (base64 of an .npy file),
packed (SkyRL {"data", "shape", "dtype"}), sglang (base64 of raw int32).
routes_npy names an .npy file [rows, L, K] (no pickle), relative to the
JSON-lines file; it is read whatever --format says (--format npy requires it).
Optional keys: trajectory_id (default FILE-LINE), group_id (default the
trajectory id), loss_mask (default all 1), reward (default 0)."""


def _cmd_convert(args: argparse.Namespace) -> int:
    from r3arrow.io import write_rollouts

    spec = RouteSpec(
        num_layers=args.num_layers,
        topk=args.topk,
        num_experts=args.num_experts,
        moe_layers=tuple(args.moe_layers) if args.moe_layers else None,
    )
    paths = [Path(p) for p in args.inputs]
    table = convert_jsonl(
        paths,
        spec,
        args.format,
        progress=not args.no_progress,
        allow_outside=args.allow_outside,
    )
    dest = write_rollouts(table, args.out, compression=args.compression)
    print(f"wrote {table.num_rows} trajectories to {dest}")
    return EXIT_OK


# -------------------------------------------------------------------- export
def _cmd_export(args: argparse.Namespace) -> int:
    from r3arrow.io import write_rollouts

    src, dest = Path(args.input), Path(args.out)
    table = _read_any(src)
    if not args.portable:
        raise SchemaError("expected --portable (the only export format so far)")
    written = write_rollouts(table, dest, compression=args.compression, portable=True)
    print(f"wrote {table.num_rows} trajectories (portable routes) to {written}")
    return EXIT_OK


# ------------------------------------------------------------------------ gc
def _cmd_gc(args: argparse.Namespace) -> int:
    from r3arrow.io import find_temps, remove_stale_temps

    path = Path(args.path)
    check_input(path)
    removed = remove_stale_temps(path, dry_run=args.dry_run)
    verb = "would remove" if args.dry_run else "removed"
    for p, size in removed:
        print(f"{verb} {p} ({human_bytes(size)})")
    kept = [t for t in find_temps(path) if not t.stale]
    total = sum(size for _, size in removed)
    print(f"{verb} {len(removed)} temp files of dead writers, {human_bytes(total)} ({total} B)")
    if kept:
        print(
            f"kept {len(kept)} temp files of live, unknown or other-host writers "
            f"({human_bytes(sum(t.size for t in kept))})"
        )
    return EXIT_OK


# ------------------------------------------------------------------------ demo
def _cmd_demo(args: argparse.Namespace) -> int:
    from r3arrow.testing.demo import DemoConfig, run_demo

    cfg = DemoConfig(
        groups=args.groups,
        samples=args.samples,
        turns=args.turns,
        max_tokens=args.max_tokens,
        out_dir=Path(args.out),
        engine_url=args.engine_url,
        num_layers=args.num_layers,
        topk=args.topk,
        num_experts=args.num_experts,
        moe_layers=tuple(args.moe_layers) if args.moe_layers else None,
        seed=args.seed,
        progress=not args.no_progress,
        replay=not args.no_replay,
    )
    result = run_demo(cfg)
    return EXIT_OK if result.ok else EXIT_ERROR


# ---------------------------------------------------------------------- parser
_INT32_MAX = 2**31 - 1


def _spec_int(value: str) -> int:
    """A spec number: a decimal int in ``[0, 2**31 - 1]`` (Arrow list sizes are int32)."""
    try:
        n = int(value, 10)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, found {value!r}") from None
    if not 0 <= n <= _INT32_MAX:
        raise argparse.ArgumentTypeError(f"expected an integer in [0, {_INT32_MAX}], found {n}")
    return n


def _spec_args(p: argparse.ArgumentParser, *, required: bool, moe_default: str = "all") -> None:
    for flag, metavar, text in (
        ("--num-layers", "L", "layers the engine reports, dense ones included"),
        ("--topk", "K", "experts per token"),
        ("--num-experts", "E", "experts per MoE layer"),
    ):
        p.add_argument(flag, type=_spec_int, required=required, metavar=metavar, help=text)
    p.add_argument(
        "--moe-layers",
        type=_spec_int,
        nargs="+",
        metavar="ID",
        help=f"global ids of the router layers (default: {moe_default})",
    )


_COMPRESSIONS = ("none", "snappy", "zstd", "lz4", "gzip", "brotli")


def _compression_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--compression", default="none", choices=_COMPRESSIONS, help="Parquet codec (default none)"
    )


def _http_url(value: str) -> str:
    parts = urllib.parse.urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise argparse.ArgumentTypeError(
            f"expected an http(s) URL like http://HOST:PORT, found {value!r}"
        )
    return value


def _png_path(value: str) -> str:
    if not value.lower().endswith(".png"):
        raise argparse.ArgumentTypeError(f"expected a .png path, found {value!r}")
    return value


_EPILOG = """\
exit codes: 0 success, 1 data or runtime error (one line on stderr starting
'r3arrow: error:'), 2 usage error, 130 interrupted, 141 stdout closed early.

examples:
  r3arrow demo --out ./demo
  r3arrow inspect rollouts/ --json
  r3arrow stats rollouts/step=3/part-0.parquet --tokens loss --plot load.png
  r3arrow diagnose rollouts/ --png disagreement.png
  r3arrow convert dump.jsonl --out r.parquet --num-layers 48 --topk 8 --num-experts 128
  r3arrow export r.parquet r-portable.parquet --portable
  r3arrow gc rollouts/ --dry-run

'r3arrow COMMAND --help' describes each command."""


def _build_parser() -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(
        prog="r3arrow",
        description="Arrow data plane for Rollout Routing Replay (R3): capture, store,\n"
        "analyse and replay the routed experts of MoE language models.",
        epilog=_EPILOG,
        formatter_class=raw,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser(
        "demo",
        help="run the whole pipeline end to end on an embedded engine (or a vLLM URL)",
        description="Start the embedded MoE engine (or use --engine-url), run multi-turn rollouts "
        "with incremental route capture, then dynamic sampling, Parquet round trip, routing "
        "stats and heatmap, Megatron collation and (with megatron-core) replay into real routers, "
        "then replay diagnostics (bfloat16 routers with the engine's weights vs the replayed "
        "routes, and the log-prob mismatch of a bfloat16 trainer-side forward with native vs "
        "replayed routing; r3arrow diagnose DIR reads them). Writes rollouts.parquet, "
        "expert_load.png "
        "and _diagnostics/ to --out. --num-layers, --topk, "
        "--num-experts and --moe-layers set the embedded engine's shape; with --engine-url they "
        "describe the server's routes (probed from it when omitted).",
    )
    demo.add_argument("--groups", type=int, default=8, help="prompt groups (default 8)")
    demo.add_argument("--samples", type=int, default=4, help="samples per group (default 4)")
    demo.add_argument("--turns", type=int, default=3, help="max turns per conversation (default 3)")
    demo.add_argument(
        "--max-tokens", type=int, default=16, help="tokens generated per turn (default 16)"
    )
    demo.add_argument(
        "--out",
        default="r3arrow-demo",
        metavar="DIR",
        help="output directory (default ./r3arrow-demo)",
    )
    demo.add_argument(
        "--engine-url",
        type=_http_url,
        metavar="URL",
        help="an external vLLM server started with --enable-return-routed-experts "
        "instead of the embedded engine",
    )
    _spec_args(demo, required=False, moe_default="all; embedded engine: all but layer 0")
    demo.add_argument(
        "--seed", type=int, default=0, help="prompts, sampling and group redraws (default 0)"
    )
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    demo.add_argument(
        "--no-replay", action="store_true", help="skip the megatron-core replay check"
    )
    demo.set_defaults(func=_cmd_demo)

    insp = sub.add_parser(
        "inspect",
        help="summarise a rollout file or step directory",
        description="Print the schema, route spec, rows, tokens, captured "
        "fraction, route bytes and size on disk of a rollout file.",
    )
    insp.add_argument(
        "path", help="rollout .parquet file, step=N/ root, demo output folder or Arrow IPC file"
    )
    insp.add_argument("--json", action="store_true", help="machine-readable output")
    insp.set_defaults(func=_cmd_inspect)

    st = sub.add_parser(
        "stats",
        help="routing statistics of a rollout file or directory",
        description="Per MoE layer: expert load imbalance (max/mean, CV), routing "
        "entropy, dead and hot experts; optionally a layer x expert heatmap PNG.",
    )
    st.add_argument(
        "path",
        help="rollout .parquet file, step=N/ root (all steps), demo output folder or IPC file",
    )
    st.add_argument(
        "--plot",
        metavar="PNG",
        type=_png_path,
        help="write an expert-load heatmap (layer x expert)",
    )
    st.add_argument(
        "--json", action="store_true", help="machine-readable output: load and per-layer summary"
    )
    st.add_argument(
        "--tokens",
        choices=("all", "prompt", "response", "loss"),
        default="all",
        help="which route rows to count; loss = rows whose next token is trained (default all)",
    )
    st.set_defaults(func=_cmd_stats)

    dg = sub.add_parser(
        "diagnose",
        help="routing disagreement (R3 paper's quantities) of a run's diagnostics",
        description="Print the fraction of router decisions that differ (1 - overlap / "
        "(tokens * K)), the fraction of tokens differing on at least one layer and a per-layer "
        "table, from the replay diagnostics under PATH/_diagnostics (r3arrow.io."
        "write_diagnostics: a trainer's measure_agreement probe, the demo) or, without them, "
        "from rollouts with a 'train_routes' column (streamed by step). docs/diagnostics.md.",
    )
    dg.add_argument(
        "path", metavar="PATH", help="rollout root or demo output directory, or a rollout file"
    )
    dg.add_argument(
        "--png",
        metavar="OUT",
        type=_png_path,
        help="write the routing disagreement beside the log-prob mismatch (with mismatch "
        "diagnostics), else per layer and over steps",
    )
    dg.add_argument(
        "--source",
        metavar="NAME",
        help="diagnostics source when PATH has several (default: native_vs_replay)",
    )
    dg.add_argument("--json", action="store_true", help="machine-readable output")
    dg.set_defaults(func=_cmd_diagnose)

    conv = sub.add_parser(
        "convert",
        help="payload dumps (JSON lines, .npy) to a rollout Parquet",
        description=_CONVERT_HELP,
        formatter_class=raw,
    )
    conv.add_argument("inputs", nargs="+", metavar="JSONL", help="JSON-lines dump files")
    conv.add_argument(
        "--format",
        choices=_FORMATS,
        default="vllm",
        help="format of routed_experts payloads (default vllm)",
    )
    conv.add_argument("--out", required=True, metavar="PARQUET", help="destination .parquet file")
    _compression_arg(conv)
    conv.add_argument("--no-progress", action="store_true", help="no progress bar")
    conv.add_argument(
        "--allow-outside",
        action="store_true",
        help="read routes_npy files that are absolute or outside the JSON-lines file's folder",
    )
    _spec_args(conv, required=True)
    conv.set_defaults(func=_cmd_convert)

    exp = sub.add_parser(
        "export",
        help="rewrite a rollout file with routes as plain integer lists (pandas, Polars, DuckDB)",
        description="Read a rollout file, step=N/ root or Arrow IPC file with r3arrow and write "
        "one Parquet file whose routes are large_list<list<list<int>>> (trajectory, token, "
        "layer, top-k), readable as integers by generic tools (docs/portable.md); r3arrow "
        "reads it back exactly.",
    )
    exp.add_argument("input", metavar="IN", help="rollout .parquet, step=N/ root or IPC file")
    exp.add_argument("out", metavar="OUT", help="destination .parquet file")
    exp.add_argument(
        "--portable", action="store_true", required=True, help="plain integer lists (required)"
    )
    _compression_arg(exp)
    exp.set_defaults(func=_cmd_export)

    gc = sub.add_parser(
        "gc",
        help="remove temp files left by dead writers",
        description="Remove the .NAME.tmp-HOST-PID-UUID files that writers on this host left "
        "behind when killed (their process no longer runs) in PATH, its step=N/ partitions, "
        "or beside a file. A live writer's temp and another host's are kept.",
    )
    gc.add_argument("path", metavar="PATH", help="rollout root, partition directory or file")
    gc.add_argument("--dry-run", action="store_true", help="list what would be removed")
    gc.set_defaults(func=_cmd_gc)

    return parser


EXIT_INTERRUPTED, EXIT_PIPE = 130, 141
# ImportError: a missing extra; MemoryError: a table too large for this host;
# ArrowException: ArrowIOError etc., none of the builtins
_USER_ERRORS = (
    R3ArrowError,
    ArrowException,
    OSError,
    ValueError,
    TypeError,
    ImportError,
    MemoryError,
)


def _quiet_stdout() -> None:
    """Point stdout at devnull so the final flush cannot raise again (Python's ``signal`` docs)."""
    with_fd = getattr(sys.stdout, "fileno", None)
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        if with_fd is not None:
            os.dup2(devnull, with_fd())
    except (OSError, ValueError):  # stdout without a file descriptor (captured in tests)
        pass


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; return the exit code (module docstring). Usage errors raise
    argparse's ``SystemExit(2)``, ``--help`` ``SystemExit(0)``."""
    parser = _build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.func(args)
        sys.stdout.flush()
    except BrokenPipeError:
        _quiet_stdout()
        return EXIT_PIPE
    except KeyboardInterrupt:
        print("r3arrow: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except _USER_ERRORS as exc:
        text = " ".join(str(exc).split()) or type(exc).__name__
        print(f"r3arrow: error: {text}", file=sys.stderr)
        return EXIT_ERROR
    return code


__all__ = ["main"]

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
