"""GPU check (issue 13): collation with ``device="cuda"`` and replay on CUDA vs the CPU result.

Run ``benchmarks/gpu_check.sh`` (or ``.venv/bin/python benchmarks/gpu_check.py``) when a GPU
is lent; it finishes in well under 3 minutes. Without CUDA it prints a skip and exits 0.

1. Collation: ``MegatronCollator(..., device="cuda")`` (compact ids shipped from pinned host
   memory with ``non_blocking``, widened to int32 on the GPU) must equal the CPU collator's
   microbatch exactly (replay targets and model inputs), packed and unpacked; prints the
   host->device bytes against int32's and the times of both paths and of a plain int32
   upload (``ratio`` columns).
2. Replay: real megatron-core ``TopKRouter``s on CUDA (random weights) replay the GPU
   microbatch; every captured token must select exactly the table's experts, as on CPU.

Exit status: 0 when everything matches (or no CUDA), 1 on a mismatch.
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from typing import Any

import numpy as np


def _best(fn: Any, repeat: int, sync: Any) -> float:
    fn()
    sync()
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def _table(n_traj: int, tokens: int, layers: int, topk: int, experts: int) -> Any:
    import r3arrow

    rng = np.random.default_rng(0)
    n = np.full(n_traj, tokens)
    plen = np.minimum(rng.integers(16, 512, n_traj), tokens // 2)
    offs = rng.permutation(experts)[:topk]
    routes = [
        ((rng.integers(0, experts, (m - 1, layers, 1)) + offs) % experts).astype(np.uint8)
        for m in n.tolist()
    ]
    return r3arrow.rollout_table(
        trajectory_id=[f"t{i}" for i in range(n_traj)],
        group_id=["g"] * n_traj,
        prompt_ids=[rng.integers(0, 32000, int(p)) for p in plen],
        response_ids=[rng.integers(0, 32000, int(m - p)) for m, p in zip(n, plen, strict=True)],
        loss_mask=[np.ones(int(m - p), np.uint8) for m, p in zip(n, plen, strict=True)],
        reward=np.zeros(n_traj),
        routes=routes,
        spec=r3arrow.RouteSpec(num_layers=layers, topk=topk, num_experts=experts),
    )


def _collation(table: Any, layers: list[int], repeat: int) -> tuple[bool, Any]:
    import torch

    import r3arrow

    spec = r3arrow.table.route_spec(table)
    ok = True
    sync = torch.cuda.synchronize
    mb_gpu = None
    for packed in (True, False):
        cpu = r3arrow.MegatronCollator(spec, layers=layers, packed=packed, align=8)
        gpu = r3arrow.MegatronCollator(spec, layers=layers, packed=packed, align=8, device="cuda")
        want, got = cpu(table), gpu(table)
        sync()
        names = ("layer_major", "input_ids", "position_ids", "labels", "loss_mask", "padding_mask")
        bad = [n for n in names if not torch.equal(getattr(want, n), getattr(got, n).cpu())]
        ok = ok and not bad and got.layer_major is not None and got.layer_major.is_cuda
        assert want.layer_major is not None
        wide = want.layer_major.numel() * 4
        t_cpu = _best(lambda c=cpu: c(table), repeat, sync)
        t_gpu = _best(lambda g=gpu: g(table), repeat, sync)
        host = want.layer_major.pin_memory()
        t_up = _best(lambda h=host: h.to("cuda", non_blocking=True), repeat, sync)
        print(
            f"collate {'packed  ' if packed else 'unpacked'}: {'OK' if not bad else 'MISMATCH'} "
            f"{bad or ''}| host->device route bytes {wide // 4:,} (int32 would be {wide:,}: "
            f"ratio 0.25) | CPU collator {t_cpu * 1e3:.2f} ms, device='cuda' {t_gpu * 1e3:.2f} ms "
            f"(ratio {t_gpu / t_cpu:.2f}), int32 upload alone {t_up * 1e3:.2f} ms"
        )
        if packed:
            mb_gpu = got
    return ok, mb_gpu


def _replay(table: Any, mb: Any, layers: list[int]) -> bool:
    import torch

    import r3arrow
    from r3arrow.megatron import install_replay, replay_schedule
    from r3arrow.table import flat_routes
    from r3arrow.testing.megatron import build_routers, cpu_router_harness

    spec = r3arrow.table.route_spec(table)
    with cpu_router_harness(), torch.no_grad():  # gloo world of one; routers moved to CUDA
        routers = [r.cuda() for r in build_routers(spec, layers, hidden=64)]
        hidden = torch.randn(mb.num_tokens, 1, 64, device="cuda")
        t0 = time.perf_counter()
        with replay_schedule():
            install_replay(mb, routers)
            maps = [r(hidden, padding_mask=mb.padding_mask.reshape(-1))[1] for r in routers]
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
    chosen = torch.stack(maps, dim=1)[~mb.padding_mask.reshape(-1)].cpu().numpy()
    rows, _ = flat_routes(table)
    want = np.zeros(chosen.shape, dtype=bool)
    np.put_along_axis(want, rows[:, layers, :].astype(np.int64), True, axis=-1)
    differ = int((chosen != want).any(axis=(1, 2)).sum())
    print(
        f"replay on CUDA: {'OK' if differ == 0 else 'MISMATCH'} | {chosen.shape[0]:,} tokens x "
        f"{len(layers)} routers, {differ} tokens differ from the rollout | install + forward "
        f"{dt * 1e3:.1f} ms"
    )
    return differ == 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trajectories", type=int, default=32)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: SKIP (no CUDA device: torch.cuda.is_available() is False)")
        return 0
    warnings.filterwarnings("ignore")  # megatron-core's import notices
    print(f"gpu_check on {torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    table = _table(args.trajectories, args.tokens, 48, 8, 128)
    layers = list(range(12, 24))  # PP stage 1 of 4
    ok, mb = _collation(table, layers, args.repeat)
    ok = _replay(table, mb, layers) and ok
    print("gpu_check:", "PASS" if ok else "FAIL (mismatch above)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
