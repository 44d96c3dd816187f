"""The ``r3arrow`` command line: demo, inspect, stats, convert, bench.

Exit codes a script can rely on: 0 success, 1 data or runtime error (message on
stderr, starting with ``r3arrow: error:``), 2 usage error.
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

from r3arrow.errors import R3ArrowError, SchemaError
from r3arrow.spec import RouteSpec

EXIT_OK, EXIT_ERROR, EXIT_USAGE = 0, 1, 2


def _read_any(path: Path, columns: Sequence[str] | None = None) -> pa.Table:
    """Read a rollout Parquet file/step directory or an Arrow IPC file."""
    from r3arrow.io import read_ipc, read_rollouts

    if path.is_file() and path.suffix in (".arrow", ".feather", ".ipc"):
        table = read_ipc(path)
        return table.select(list(columns)) if columns else table
    return read_rollouts(path, columns=columns)


def _size_on_disk(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file() and not p.name.startswith("."))


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover


# --------------------------------------------------------------------- inspect
def inspect_summary(path: Path) -> dict[str, Any]:
    """Schema, spec, rows, tokens, captured fraction and size on disk of a rollout file or directory."""
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
        info["steps"] = sorted({int(s) for s in np.unique(table.column("step").to_numpy())})
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
    print(f"  captured rows:       {info['captured_rows']} ({info['captured_fraction']:.1%} of tokens)")
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
    load = stats.expert_load(path, tokens=args.tokens)
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


def _decode_record(rec: dict[str, Any], fmt: str, spec: RouteSpec, base: Path) -> np.ndarray:
    from r3arrow import codec

    if "routes_npy" in rec:
        with open(base / rec["routes_npy"], "rb") as fh:
            arr: np.ndarray = np.load(fh, allow_pickle=False)
        return arr
    payload = rec.get("routed_experts")
    if payload is None:
        raise SchemaError("convert: expected 'routed_experts' or 'routes_npy' in every record")
    if fmt == "vllm":
        return codec.decode_vllm(payload, spec)
    if fmt == "packed":
        return codec.decode_packed(payload, spec)
    if fmt == "sglang":
        return codec.decode_sglang(payload, spec)
    raise SchemaError(f"convert: expected --format in {_FORMATS} for inline payloads, found {fmt!r}")


def convert_jsonl(paths: Sequence[Path], spec: RouteSpec, fmt: str) -> pa.Table:
    """Build a rollout table from JSON-lines payload dumps (one trajectory per line).

    Each record: ``prompt_ids``, ``response_ids``, and ``routed_experts`` (payload
    in ``fmt``) or ``routes_npy`` (a ``.npy`` path relative to the file);
    optional ``trajectory_id``, ``group_id``, ``loss_mask`` (default all 1), ``reward``.
    """
    from r3arrow.table import rollout_table

    cols: dict[str, list[Any]] = {k: [] for k in ("trajectory_id", "group_id", "prompt_ids", "response_ids", "loss_mask", "reward", "routes")}
    for path in paths:
        with open(path, "rb") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    rec = orjson.loads(line)
                    prompt, response = rec["prompt_ids"], rec["response_ids"]
                except (orjson.JSONDecodeError, KeyError, TypeError) as exc:
                    raise SchemaError(f"{path}:{lineno}: expected a JSON object with prompt_ids and response_ids ({exc})") from exc
                cols["trajectory_id"].append(str(rec.get("trajectory_id", f"{path.stem}-{lineno}")))
                cols["group_id"].append(str(rec.get("group_id", cols["trajectory_id"][-1])))
                cols["prompt_ids"].append(prompt)
                cols["response_ids"].append(response)
                cols["loss_mask"].append(rec.get("loss_mask", [1] * len(response)))
                cols["reward"].append(float(rec.get("reward", 0.0)))
                try:
                    cols["routes"].append(_decode_record(rec, fmt, spec, path.parent))
                except R3ArrowError as exc:
                    raise type(exc)(f"{path}:{lineno}: {exc}") from exc
    return rollout_table(spec=spec, **cols)


def _cmd_convert(args: argparse.Namespace) -> int:
    from r3arrow.io import write_rollouts

    spec = RouteSpec(
        num_layers=args.num_layers,
        topk=args.topk,
        num_experts=args.num_experts,
        moe_layers=tuple(args.moe_layers) if args.moe_layers else None,
    )
    table = convert_jsonl([Path(p) for p in args.inputs], spec, args.format)
    dest = write_rollouts(table, args.out, compression=args.compression)
    print(f"wrote {table.num_rows} trajectories to {dest}")
    return EXIT_OK


# ----------------------------------------------------------------------- bench
def _benchmarks_dir() -> Path:
    here = Path(__file__).resolve().parent.parent / "benchmarks"
    if not here.is_dir():
        raise R3ArrowError(f"expected the benchmark suite at {here} (a source checkout), found nothing")
    return here


def _cmd_bench(args: argparse.Namespace) -> int:
    bench_dir = _benchmarks_dir()
    scripts = sorted(p for p in bench_dir.glob("bench_*.py") if not args.only or p.stem.removeprefix("bench_") in args.only)
    if not scripts:
        raise R3ArrowError(f"no benchmark matched {args.only} in {bench_dir}")
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
def _spec_args(p: argparse.ArgumentParser, *, required: bool) -> None:
    p.add_argument("--num-layers", type=int, required=required, help="layers the engine reports (dense included)")
    p.add_argument("--topk", type=int, required=required, help="experts per token")
    p.add_argument("--num-experts", type=int, required=required, help="experts per MoE layer")
    p.add_argument("--moe-layers", type=int, nargs="+", help="global ids of router layers (default: all)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="r3arrow",
        description="Arrow data plane for Rollout Routing Replay (R3): capture, store, analyse and replay MoE routes.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    demo = sub.add_parser(
        "demo",
        help="run the end-to-end pipeline on the embedded engine (or a vLLM URL)",
        description="Start the embedded MoE engine, run multi-turn rollouts with route capture, "
        "dynamic sampling, Parquet, stats/heatmap, Megatron collation and (with megatron-core) replay.",
    )
    demo.add_argument("--groups", type=int, default=8, help="prompt groups (default 8)")
    demo.add_argument("--samples", type=int, default=4, help="samples per group (default 4)")
    demo.add_argument("--turns", type=int, default=3, help="max turns per conversation (default 3)")
    demo.add_argument("--max-tokens", type=int, default=16, help="tokens generated per turn (default 16)")
    demo.add_argument("--out", default="r3arrow-demo", help="output directory (default ./r3arrow-demo)")
    demo.add_argument("--engine-url", help="use an external vLLM server instead of the embedded engine "
                      "(needs --num-layers/--topk/--num-experts)")
    _spec_args(demo, required=False)
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    demo.add_argument("--no-replay", action="store_true", help="skip the megatron-core replay check")
    demo.set_defaults(func=_cmd_demo)

    insp = sub.add_parser("inspect", help="summarise a rollout file or step directory",
                          description="Schema, spec, rows, tokens, captured fraction and size on disk.")
    insp.add_argument("path", help="rollout .parquet file, step=N directory root, or .arrow IPC file")
    insp.add_argument("--json", action="store_true", help="machine-readable output")
    insp.set_defaults(func=_cmd_inspect)

    st = sub.add_parser("stats", help="routing statistics of a rollout file or directory",
                        description="Expert load, imbalance, entropy, dead/hot experts; optional heatmap PNG.")
    st.add_argument("path")
    st.add_argument("--plot", metavar="PNG", help="write an expert-load heatmap (layer x expert)")
    st.add_argument("--json", action="store_true", help="machine-readable output")
    st.add_argument("--tokens", choices=("all", "prompt", "response", "loss"), default="all",
                    help="which route rows to count; loss = rows whose next token is trained (default all)")
    st.set_defaults(func=_cmd_stats)

    conv = sub.add_parser("convert", help="payload dumps (JSON lines, .npy) to a rollout Parquet",
                          description=convert_jsonl.__doc__)
    conv.add_argument("inputs", nargs="+", help="JSON-lines files, one trajectory per line")
    conv.add_argument("--format", choices=_FORMATS, default="vllm", help="inline payload format (default vllm)")
    conv.add_argument("--out", required=True, help="destination .parquet file")
    conv.add_argument("--compression", default="none", help="Parquet codec (none, zstd, lz4, snappy)")
    _spec_args(conv, required=True)
    conv.set_defaults(func=_cmd_convert)

    bench = sub.add_parser("bench", help="run the benchmark suite and print the ratio tables")
    bench.add_argument("--quick", action="store_true", help="small sizes, seconds per benchmark")
    bench.add_argument("--only", nargs="+", metavar="NAME", help="e.g. codec io capture collate stats multiturn")
    bench.set_defaults(func=_cmd_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        code: int = args.func(args)
    except (R3ArrowError, FileNotFoundError, ValueError) as exc:
        print(f"r3arrow: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        print("r3arrow: interrupted", file=sys.stderr)
        return 130
    return code


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
