"""Decode throughput of the route wire codecs vs nested JSON lists and vs memcpy.

Shape: 48 layers, top-8, 128 experts (uint8 ids; SGLang sends int32). For each payload size
every codec decodes one trajectory's routes with its `RouteSpec` (ids validated), and the
baseline does what frameworks do today: ``orjson.loads`` of nested lists then
``np.asarray(..., dtype=uint8)``. ``x JSON`` is the baseline's time over the codec's for the
same tokens; ``/ memcpy`` is the codec's GB/s over this run's warm-buffer copy speed.
Arrow IPC decoding is zero-copy, so its time does not grow with the payload.

A second table times `encode_packed` (it now checks ids and narrows to SkyRL's dtype) against
the previous implementation, kept here as the in-run baseline: it kept the input dtype and
checked nothing, and refused int64, so for int64 input the baseline is ``astype(int32)``
first (what callers had to do). The decode rows above include ``SkyRL packed``.

    .venv/bin/python benchmarks/bench_codec.py            # 1K, 8K, 32K tokens (~1 min)
    .venv/bin/python benchmarks/bench_codec.py --quick    # 1K, 4K tokens (seconds)
"""

from __future__ import annotations

import functools
import gc
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
from _common import (
    GB,
    arrow_peak_mb,
    best_of,
    machine_line,
    markdown_table,
    memcpy_gbps,
    parser,
    peak_rss_mb,
)

from r3arrow import codec
from r3arrow.codec._base64 import HAVE_PYBASE64, b64encode
from r3arrow.spec import RouteSpec

LAYERS, TOPK, EXPERTS = 48, 8, 128


def encode_packed_before(arr: np.ndarray) -> dict[str, Any]:
    """The previous `encode_packed`: dtype kept (uint8/uint16/int16/int32), no id checks."""
    name = arr.dtype.name
    a = np.ascontiguousarray(arr, dtype=np.dtype(name).newbyteorder("<"))
    return {"data": b64encode(a.reshape(-1).view(np.uint8)), "shape": list(a.shape), "dtype": name}


def encode_before_int64(arr: np.ndarray) -> dict[str, Any]:
    """Before, int64 was refused: callers narrowed to int32 themselves, unchecked."""
    return encode_packed_before(arr.astype(np.int32))


def encode_rows(sizes: list[int], repeat: int) -> list[list[Any]]:
    """`encode_packed` vs the previous implementation, same inputs, same run."""
    rng = np.random.default_rng(1)
    out: list[list[Any]] = []
    for n in sizes:
        ids = rng.integers(0, EXPERTS, size=(n, LAYERS, TOPK), dtype=np.uint8)
        copy_gbps = memcpy_gbps(ids.nbytes, repeat=repeat * 2)
        inputs: list[tuple[str, np.ndarray, Callable[[], Any]]] = [
            ("uint8", ids, functools.partial(encode_packed_before, ids)),
        ]
        wide = ids.astype(np.int64)
        inputs.append(("int64", wide, functools.partial(encode_before_int64, wide)))
        for label, arr, before in inputs:
            new = functools.partial(codec.encode_packed, arr)
            got = new()
            assert got["dtype"] == "uint8"
            assert np.array_equal(codec.decode_packed(got), ids)
            t_new, t_old = best_of(new, repeat), best_of(before, repeat)
            for name, t in (("encode_packed", t_new), ("before (in-run baseline)", t_old)):
                out.append(
                    [
                        n,
                        label,
                        name,
                        t * 1e3,
                        ids.nbytes / t / GB,
                        ids.nbytes / t / GB / copy_gbps,
                        f"{t_old / t:.2f}",
                        f"{len(before()['data']) / 1e6:.1f} -> {len(got['data']) / 1e6:.1f}"
                        if name == "encode_packed"
                        else "-",
                    ]
                )
        del ids, wide
        gc.collect()
    return out


JSON_MAX_ROWS = 8192  # above this the JSON baseline is timed on a slice and scaled linearly


def json_baseline(arr: np.ndarray, repeat: int) -> tuple[float, str]:
    """Seconds to decode ``arr`` from nested JSON lists (timed on a slice when large)."""
    rows = arr.shape[0]
    sub = arr[: min(rows, JSON_MAX_ROWS)]
    payload = orjson.dumps({"routed_experts": sub.tolist()})

    def decode() -> np.ndarray:
        return np.asarray(orjson.loads(payload)["routed_experts"], dtype=np.uint8)

    assert np.array_equal(decode(), sub)
    t = best_of(decode, repeat)
    if sub.shape[0] == rows:
        return t, "measured"
    return t * rows / sub.shape[0], f"scaled from {sub.shape[0]} rows"


def alloc_peak_mb(fn: Callable[[], Any]) -> float:
    """Peak bytes allocated (tracemalloc: numpy, bytearray) plus Arrow pool growth in one call."""
    gc.collect()
    pool = pa.total_allocated_bytes()
    tracemalloc.start()
    out = fn()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    arrow = pa.total_allocated_bytes() - pool
    del out
    return float(peak + max(int(arrow), 0)) / 2**20


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    sizes = [1024, 4096] if args.quick else [1024, 8192, 32768]
    repeat = 3 if args.quick else 5
    spec = RouteSpec(LAYERS, TOPK, EXPERTS)
    rng = np.random.default_rng(0)
    print(f"# codec decode: [tokens, {LAYERS}, {TOPK}] ids < {EXPERTS}, {machine_line()}")
    print(f"pybase64 SIMD backend: {HAVE_PYBASE64}\n")
    rows_out: list[list[Any]] = []
    ipc_times: dict[int, float] = {}
    for n in sizes:
        arr = rng.integers(0, EXPERTS, size=(n, LAYERS, TOPK), dtype=np.uint8)
        route_bytes = arr.nbytes
        copy_gbps = memcpy_gbps(route_bytes, repeat=repeat * 2)
        t_json, how = json_baseline(arr, 2 if args.quick else 3)
        json_mb = len(orjson.dumps(arr[: min(n, 256)].tolist())) * n / min(n, 256) / 1e6
        rows_out.append(
            [
                n,
                "JSON nested lists (orjson+asarray)",
                f"{json_mb:.1f}",
                t_json * 1e3,
                route_bytes / t_json / GB,
                1.0,
                route_bytes / t_json / GB / copy_gbps,
                "-",
                how,
            ]
        )
        sglang_arr = arr.astype(np.int32)
        ipc_raw = codec.encode_ipc(arr, spec).to_pybytes()
        cases: list[tuple[str, Any, Callable[[Any], np.ndarray], np.ndarray]] = [
            ("vLLM .npy base64", codec.encode_vllm(arr), lambda p: codec.decode_vllm(p, spec), arr),
            ("SkyRL packed", codec.encode_packed(arr), lambda p: codec.decode_packed(p, spec), arr),
            (
                "SGLang int32 base64",
                codec.encode_sglang(arr),
                lambda p: codec.decode_sglang(p, spec),
                sglang_arr,
            ),
            ("Arrow IPC (no spec)", ipc_raw, lambda p: codec.decode_ipc_routes(p), arr),
            ("Arrow IPC (+spec ids)", ipc_raw, lambda p: codec.decode_ipc_routes(p, spec), arr),
        ]
        for name, payload, decode, expect in cases:
            assert np.array_equal(decode(payload), expect)
            call = functools.partial(decode, payload)
            t = best_of(call, repeat)
            size_mb = (len(payload["data"]) if isinstance(payload, dict) else len(payload)) / 1e6
            gbps = route_bytes / t / GB
            if name.startswith("Arrow IPC (no"):
                ipc_times[n] = t
            rows_out.append(
                [
                    n,
                    name,
                    f"{size_mb:.1f}",
                    t * 1e3,
                    gbps,
                    t_json / t,
                    gbps / copy_gbps,
                    f"{alloc_peak_mb(call):.2f}",
                    f"memcpy {copy_gbps:.1f} GB/s",
                ]
            )
        del arr, sglang_arr, ipc_raw, cases
        gc.collect()

    print(
        markdown_table(
            rows_out,
            [
                "tokens",
                "decoder",
                "payload MB",
                "ms",
                "GB/s (uint8 routes)",
                "x JSON",
                "/ memcpy",
                "alloc peak MB",
                "note",
            ],
        )
    )
    lo, hi = min(ipc_times), max(ipc_times)
    print(
        f"\nArrow IPC decode, {lo} vs {hi} tokens: {ipc_times[lo] * 1e6:.0f} us vs "
        f"{ipc_times[hi] * 1e6:.0f} us ({ipc_times[hi] / ipc_times[lo]:.2f}x time for "
        f"{hi // lo}x data: zero-copy, constant in size)."
    )
    print(
        "GB/s counts the uint8 [tokens, 48, 8] routes decoded "
        "(SGLang's int32 payload is 4x larger);"
    )
    print(
        "'x JSON' = JSON time / codec time for the same tokens; "
        "alloc peak = tracemalloc + Arrow pool in one decode."
    )
    print("\n# encode_packed (ids checked, narrowest SkyRL dtype) vs the previous implementation\n")
    print(
        markdown_table(
            encode_rows(sizes, repeat),
            [
                "tokens",
                "input",
                "encoder",
                "ms",
                "GB/s (uint8 routes)",
                "/ memcpy",
                "x before",
                "payload MB before -> now",
            ],
        )
    )
    print(f"process peak RSS {peak_rss_mb():.0f} MB, Arrow pool peak {arrow_peak_mb():.1f} MB")


if __name__ == "__main__":
    main()
