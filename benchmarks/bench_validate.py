"""Benchmark: the expert-id rules (`r3arrow.ids`) and the route-quality guard against memcpy.

Cases: 48 layers, top-8, 128 experts (uint8 ids); 48 layers, top-8, 512 experts (uint16);
48 layers, top-2, 128 experts (uint8). Routes are valid (distinct ids per token and layer,
drawn uniformly), so every check runs its full valid-case path. Per case, in one process:

* ``memcpy``: a warm-buffer copy of the same bytes (the machine's speed, same run);
* ``distinct, before``: the algorithm the router-layer check used before the fast path (kept
  here as the baseline: a transposed copy of each block, then ``K - 1`` shifted
  comparisons), ``num_experts=None`` as ``check_routes(rules="distinct")`` calls it;
* ``distinct, after``: `r3arrow.ids.check_routes` without a spec, same arguments, numpy backend
  (`_Scratch` per block; what runs without numba or with ``R3ARROW_NO_NUMBA=1``);
* ``distinct, numba``: the same call on the numba backend (`r3arrow._kernels._numba`; the
  row is left out where numba is not installed). Kernels are compiled before timing;
* ``check_routes``: both id rules as table validation and capture run them (the default
  backend: numba where installed);
* ``quality``: `r3arrow.capture._quality.check_route_quality` on the same rows.

GB/s counts route bytes; "x memcpy" is the case's time over the memcpy time (1.0 = as fast
as copying the routes once). Run from the repository root::

    .venv/bin/python benchmarks/bench_validate.py            # 16K tokens per case
    .venv/bin/python benchmarks/bench_validate.py --quick    # 2K tokens, seconds
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from _common import best_of, machine_line, markdown_table, parser

from r3arrow.capture import check_route_quality
from r3arrow.ids import check_routes
from r3arrow.spec import RouteSpec
from r3arrow.testing import use_backend

LAYERS = 48
CASES = [(8, 128), (8, 512), (2, 128)]  # (top-k, experts)
_BLOCK_IDS = 1 << 17


def distinct_before(arr: np.ndarray, layer_ids: Sequence[int]) -> None:
    """The pre-fast-path router-layer check's valid-case work on ``[tokens, layers, K]`` (baseline).

    Same blocks, same min/max and duplicate tests; raises AssertionError instead of
    locating an offender (the benchmark's routes are valid).
    """
    tokens, n_layers, k = arr.shape
    assert len(layer_ids) == n_layers
    step = max(1, _BLOCK_IDS // max(1, n_layers * k))
    signed = arr.dtype.kind == "i"
    for a in range(0, tokens, step):
        xt = np.ascontiguousarray(arr[a : a + step].transpose(2, 1, 0))
        lo = int(xt.min()) if signed else 0
        int(xt.max())
        assert lo >= 0
        for r in range(1, k):
            assert not bool((xt[: k - r] == xt[r:]).any())


def on_backend(kernels: Any, fn: Callable[[], Any]) -> Callable[[], Any]:
    """``fn`` run on one backend (`r3arrow.testing.use_backend`): the kernels module
    (numba), or False (numpy)."""

    def run() -> Any:
        with use_backend("numpy" if kernels is False else "numba"):
            return fn()

    return run


def numba_kernels() -> Any:
    """`r3arrow._kernels._numba`, compiled for the benchmark's dtypes, or None without numba."""
    try:
        from r3arrow._kernels import _numba
    except ImportError:
        return None
    _numba.warm_up()
    return _numba


def valid_routes(tokens: int, spec: RouteSpec, seed: int = 0) -> np.ndarray:
    """``[tokens, L, K]`` ids, K distinct uniform experts per token and layer, storage dtype."""
    rng = np.random.default_rng(seed)
    e = spec.num_experts
    assert e is not None
    out = np.empty((tokens, spec.num_layers, spec.topk), dtype=spec.dtype)
    for a in range(0, tokens, 1024):  # argsort of random keys: K distinct of E, per row
        keys = rng.random((min(1024, tokens - a), spec.num_layers, e), dtype=np.float32)
        out[a : a + 1024] = np.argpartition(keys, spec.topk, axis=-1)[..., : spec.topk]
    return out


def run_case(tokens: int, k: int, experts: int, repeat: int) -> dict[str, Any]:
    spec = RouteSpec(num_layers=LAYERS, topk=k, num_experts=experts)
    arr = valid_routes(tokens, spec)
    layers = list(range(LAYERS))
    dst = np.empty_like(arr)
    dst[...] = 0  # first touch outside the timing
    fns: dict[str, Callable[[], Any]] = {
        "memcpy": lambda: np.copyto(dst, arr),
        "distinct, before": lambda: distinct_before(arr, layers),
        "distinct, after": on_backend(False, lambda: check_routes(arr, layer_ids=layers)),
        "check_routes": lambda: check_routes(arr, spec),
        "quality": lambda: check_route_quality(arr, spec),
    }
    kernels = numba_kernels()
    if kernels is not None:
        numba_fn = on_backend(kernels, lambda: check_routes(arr, layer_ids=layers))
        fns = {
            **dict(list(fns.items())[:3]),
            "distinct, numba": numba_fn,
            **dict(list(fns.items())[3:]),
        }
    for fn in fns.values():  # compile (JIT) and first-touch outside the timing
        fn()
    best = {name: float("inf") for name in fns}
    for _ in range(repeat):  # interleaved rounds: shared-machine noise spreads evenly
        for name, fn in fns.items():
            best[name] = min(best[name], best_of(fn, 1, warmup=0))
    return {"spec": spec, "nbytes": arr.nbytes, "best_s": best}


def main() -> None:
    args = parser(__doc__.splitlines()[0]).parse_args()
    tokens, repeat = (2048, 5) if args.quick else (16384, 9)
    print(machine_line())
    print(f"{tokens} tokens per case, best of {repeat} interleaved rounds\n")
    rows: list[list[Any]] = []
    for k, experts in CASES:
        res = run_case(tokens, k, experts, repeat)
        spec, nbytes, best = res["spec"], res["nbytes"], res["best_s"]
        label = f"{LAYERS}x top-{k}, E={experts} ({spec.dtype})"
        for name, t in best.items():
            rows.append(
                [label, name, nbytes / t / 1e9, t / best["memcpy"], best["distinct, before"] / t]
            )
    print(markdown_table(rows, ["case", "check", "GB/s", "x memcpy", "speedup vs before"]))


if __name__ == "__main__":
    main()
