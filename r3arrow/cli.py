"""The ``r3arrow`` command line: demo, inspect, stats, convert, bench.

Exit codes a script can rely on: 0 success, 1 data or runtime error (one line on
stderr, starting with ``r3arrow: error:``), 2 usage error (argparse's message), 130
interrupted.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow as pa

from r3arrow.errors import PayloadError, R3ArrowError, SchemaError
from r3arrow.ids import check_route_ids
from r3arrow.spec import RouteSpec, as_route_rows

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2


_IPC_MAGIC = b"ARROW1"


def _is_ipc(path: Path) -> bool:
    """An Arrow IPC (Feather v2) file, by its magic bytes (any suffix)."""
    if not path.is_file():
        return False
    with open(path, "rb") as fh:
        return fh.read(len(_IPC_MAGIC)) == _IPC_MAGIC


def _read_any(path: Path) -> pa.Table:
    """Read a rollout Parquet file, a ``step=N`` directory or an Arrow IPC file."""
    from r3arrow.io import read_ipc, read_rollouts

    return read_ipc(path) if _is_ipc(path) else read_rollouts(path)


def _size_on_disk(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(
        p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.name.startswith(".")
    )


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


# --------------------------------------------------------------------- inspect
def inspect_summary(path: Path) -> dict[str, Any]:
    """Schema, spec, rows, tokens, captured fraction and size on disk of a rollout file or dir."""
    from r3arrow.table import captured_lengths, route_spec, sequence_lengths

    table = _read_any(path)
    spec = route_spec(table)
    tokens = sequence_lengths(table)
    captured = captured_lengths(table)
    total_tokens = int(tokens.sum())
    info: dict[str, Any] = {
        "path": str(path),
        "rows": table.num_rows,
        "columns": {f.name: str(f.type) for f in table.schema},
        "spec": orjson.loads(spec.to_json()),
        "tokens": total_tokens,
        "captured_rows": int(captured.sum()),
        "captured_fraction": float(captured.sum() / total_tokens) if total_tokens else 0.0,
        "route_bytes": int(captured.sum()) * spec.row_nbytes,
        "size_on_disk": _size_on_disk(path),
    }
    if "step" in table.schema.names:
        info["steps"] = [int(s) for s in np.unique(table.column("step").to_numpy())]
    return info


def _cmd_inspect(args: argparse.Namespace) -> int:
    info = inspect_summary(Path(args.path))
    if args.json:
        sys.stdout.write(orjson.dumps(info, option=orjson.OPT_INDENT_2).decode() + "\n")
        return EXIT_OK
    spec = info["spec"]
    print(f"{info['path']}")
    print(f"  rows (trajectories): {info['rows']}")
    print(f"  tokens:              {info['tokens']}")
    fraction = f"{info['captured_fraction']:.1%} of tokens"
    print(f"  captured rows:       {info['captured_rows']} ({fraction})")
    print(
        f"  spec:                {spec['num_layers']} layers x top-{spec['topk']}, "
        f"{spec['num_experts']} experts, ids {spec['dtype']}, router layers "
        f"{spec['moe_layers'] if spec['moe_layers'] is not None else 'all'}"
    )
    print(f"  route bytes:         {_human_bytes(info['route_bytes'])}")
    print(f"  size on disk:        {_human_bytes(info['size_on_disk'])}")
    if "steps" in info:
        print(f"  steps:               {info['steps']}")
    print("  columns:")
    for name, typ in info["columns"].items():
        print(f"    {name}: {typ}")
    return EXIT_OK


# ----------------------------------------------------------------------- stats
def _cmd_stats(args: argparse.Namespace) -> int:
    from r3arrow import stats

    path = Path(args.path)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such rollout file or directory")
    load = stats.expert_load(_read_any(path) if _is_ipc(path) else path, tokens=args.tokens)
    summary = stats.load_summary(load)
    if args.plot:
        from r3arrow.plot import plot_expert_load

        plot_expert_load(load, args.plot, title=f"expert load ({args.tokens} tokens): {path.name}")
    if args.json:
        out = {"tokens": args.tokens, "load": load.to_dicts(), "layers": summary.to_dicts()}
        sys.stdout.write(orjson.dumps(out, option=orjson.OPT_INDENT_2).decode() + "\n")
        return EXIT_OK
    import polars as pl

    with pl.Config(tbl_rows=64, tbl_cols=16, float_precision=3):
        print(f"per-layer routing ({args.tokens} tokens) of {path}")
        print(summary)
    if args.plot:
        print(f"heatmap written to {args.plot}")
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


def _read_npy(name: object, spec: RouteSpec, base: Path) -> np.ndarray:
    """The ``.npy`` routes file a record names (relative to ``base`` unless absolute), checked."""
    if not isinstance(name, str) or not name:
        raise SchemaError(f"expected routes_npy to be an .npy file path, found {name!r}")
    path = base / name
    try:
        with open(path, "rb") as fh:
            arr: np.ndarray = np.lib.format.read_array(fh, allow_pickle=False)
    except FileNotFoundError:
        raise FileNotFoundError(f"routes_npy {path}: no such file") from None
    except ValueError as exc:  # bad magic, truncated data, object dtype
        raise PayloadError(
            f"routes_npy {path}: expected an .npy file without pickle, found: {exc}"
        ) from None
    arr = as_route_rows(arr, spec, what=f"routes_npy {path}")
    check_route_ids(arr, spec, what=f"routes_npy {path}")
    return arr


def _decode_record(rec: dict[str, Any], fmt: str, spec: RouteSpec, base: Path) -> np.ndarray:
    from r3arrow import codec

    if "routes_npy" in rec:
        return _read_npy(rec["routes_npy"], spec, base)
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
    paths: Sequence[Path], spec: RouteSpec, fmt: str, *, progress: bool = False
) -> pa.Table:
    """Build a rollout table from JSON-lines payload dumps (one trajectory per line).

    Each record: ``prompt_ids``, ``response_ids``, and ``routed_experts`` (payload
    in ``fmt``) or ``routes_npy`` (a ``.npy`` path relative to the file);
    optional ``trajectory_id``, ``group_id``, ``loss_mask`` (default all 1), ``reward``.
    Errors name the file and line. ``progress``: a byte progress bar on stderr.
    """
    from tqdm.auto import tqdm

    from r3arrow.table import rollout_table

    for path in paths:
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
                        row["routes"] = _decode_record(rec, fmt, spec, path.parent)
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


def _cmd_convert(args: argparse.Namespace) -> int:
    from r3arrow.io import write_rollouts

    spec = RouteSpec(
        num_layers=args.num_layers,
        topk=args.topk,
        num_experts=args.num_experts,
        moe_layers=tuple(args.moe_layers) if args.moe_layers else None,
    )
    paths = [Path(p) for p in args.inputs]
    table = convert_jsonl(paths, spec, args.format, progress=not args.no_progress)
    dest = write_rollouts(table, args.out, compression=args.compression)
    print(f"wrote {table.num_rows} trajectories to {dest}")
    return EXIT_OK


# ----------------------------------------------------------------------- bench
def _benchmarks_dir() -> Path:
    here = Path(__file__).resolve().parent.parent / "benchmarks"
    if not here.is_dir():
        raise R3ArrowError(
            f"expected the benchmark suite at {here} (a source checkout), found nothing"
        )
    return here


def _cmd_bench(args: argparse.Namespace) -> int:
    bench_dir = _benchmarks_dir()
    available = {p.stem.removeprefix("bench_"): p for p in sorted(bench_dir.glob("bench_*.py"))}
    unknown = sorted(set(args.only or ()) - set(available))
    if unknown:
        raise R3ArrowError(
            f"no benchmark matched {unknown}: expected names from {sorted(available)}"
        )
    scripts = [p for name, p in available.items() if not args.only or name in args.only]
    if not scripts:
        raise R3ArrowError(f"expected bench_*.py scripts in {bench_dir}, found none")
    failed = 0
    for script in scripts:
        print(f"\n## {script.stem}\n", flush=True)
        cmd = [sys.executable, str(script), *(["--quick"] if args.quick else [])]
        failed += subprocess.call(cmd, cwd=bench_dir) != 0
    return EXIT_ERROR if failed else EXIT_OK


# ------------------------------------------------------------------------ demo
def _cmd_demo(args: argparse.Namespace) -> int:
    from r3arrow.demo import DemoConfig, run_demo

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
def _spec_args(p: argparse.ArgumentParser, *, required: bool, moe_default: str = "all") -> None:
    p.add_argument(
        "--num-layers",
        type=int,
        required=required,
        metavar="L",
        help="layers the engine reports, dense ones included",
    )
    p.add_argument("--topk", type=int, required=required, metavar="K", help="experts per token")
    p.add_argument(
        "--num-experts", type=int, required=required, metavar="E", help="experts per MoE layer"
    )
    p.add_argument(
        "--moe-layers",
        type=int,
        nargs="+",
        metavar="ID",
        help=f"global ids of the router layers (default: {moe_default})",
    )


def _png_path(value: str) -> str:
    if not value.lower().endswith(".png"):
        raise argparse.ArgumentTypeError(f"expected a .png path, found {value!r}")
    return value


_EPILOG = """\
exit codes: 0 success, 1 data or runtime error (one line on stderr starting
'r3arrow: error:'), 2 usage error, 130 interrupted.

examples:
  r3arrow demo --out ./demo
  r3arrow inspect rollouts/ --json
  r3arrow stats rollouts/step=3/part-0.parquet --tokens loss --plot load.png
  r3arrow convert dump.jsonl --out r.parquet --num-layers 48 --topk 8 --num-experts 128
  r3arrow bench --quick --only codec io

'r3arrow COMMAND --help' describes each command."""


def build_parser() -> argparse.ArgumentParser:
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
        "stats and heatmap, Megatron collation and (with megatron-core) replay into real routers. "
        "Writes rollouts.parquet and expert_load.png to --out. --num-layers, --topk, "
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
        "path", help="rollout .parquet file, step=N/ directory root, or Arrow IPC file"
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
        "path", help="rollout .parquet file, step=N/ directory root (all steps), or Arrow IPC file"
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
    conv.add_argument(
        "--compression", default="none", help="Parquet codec: none (default), zstd, lz4, snappy"
    )
    conv.add_argument("--no-progress", action="store_true", help="no progress bar")
    _spec_args(conv, required=True)
    conv.set_defaults(func=_cmd_convert)

    bench = sub.add_parser(
        "bench",
        help="run the benchmark suite and print the ratio tables",
        description="Run benchmarks/bench_*.py (a source checkout) one after the "
        "other; each prints a markdown table of ratios against its baseline and "
        "the machine's memory-copy speed. Exit 1 if any benchmark fails.",
    )
    bench.add_argument("--quick", action="store_true", help="small sizes, seconds per benchmark")
    bench.add_argument(
        "--only",
        nargs="+",
        metavar="NAME",
        help="run only these (codec io capture collate stats multiturn)",
    )
    bench.set_defaults(func=_cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.func(args)
    except (R3ArrowError, OSError, ValueError, ImportError) as exc:  # ImportError: a missing extra
        print(f"r3arrow: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("r3arrow: interrupted", file=sys.stderr)
        return 130
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
