"""The R3 table against a real vLLM: its captured routes vs a float32 recompute of the weights.

vLLM (``--dtype float32``, CPU build; see ``tests/engine/test_vllm_real.py`` for the server)
serves the tiny Qwen3-MoE of ``scripts/vllm/make_tinymoe.py``. The same checkpoint, loaded
with transformers (``Qwen3MoeForCausalLM``, ``output_router_logits=True``), gives each
layer's router logits for the same token sequences; their top-k is the "trainer" side. Both
route sets go into one rollout table (``routes`` and ``recompute_routes``) and
`r3arrow.stats.route_agreement` gives the R3 paper's quantities (``docs/diagnostics.md``).

Marked ``vllm``; skipped without ``R3ARROW_VLLM_URL`` unless ``R3ARROW_REQUIRE_VLLM=1``.
The model directory is ``R3ARROW_VLLM_MODEL_DIR`` or the model id the server reports
(``/v1/models``: the path it was started with, relative to the repository root).
"""

from __future__ import annotations

import asyncio
import json
import os
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

import r3arrow
import r3arrow.stats
from r3arrow.client import EngineClient, RetryPolicy
from r3arrow.spec import RouteSpec, numpy_to_routes

URL = os.environ.get("R3ARROW_VLLM_URL")
REPO = Path(__file__).resolve().parents[2]

# Skipped without R3ARROW_VLLM_URL, a failure under R3ARROW_REQUIRE_VLLM=1 (tests/conftest.py).
pytestmark = pytest.mark.vllm


def _model_dir(url: str) -> Path:
    """The checkpoint the server serves (see the module docstring); skip if not on disk."""
    env = os.environ.get("R3ARROW_VLLM_MODEL_DIR")
    if env:
        path = Path(env)
    else:
        with urllib.request.urlopen(f"{url.rstrip('/')}/v1/models", timeout=30) as resp:
            models = json.loads(resp.read())
        path = Path(str(models["data"][0]["id"]))
        path = path if path.is_absolute() else REPO / path
    if not (path / "config.json").is_file():
        if os.environ.get("R3ARROW_REQUIRE_VLLM") == "1":
            pytest.fail(f"expected the served checkpoint at {path}, found no config.json")
        pytest.skip(f"the served checkpoint is not on this machine ({path})")
    return path


def _recompute(model_dir: Path, seqs: list[list[int]], topk: int, dtype: str) -> list[np.ndarray]:
    """Top-k expert ids ``[T, L, K]`` per sequence from a transformers forward in ``dtype``."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    model: Any = transformers.Qwen3MoeForCausalLM.from_pretrained(
        model_dir, dtype=getattr(torch, dtype)
    )
    model.eval()
    out = []
    with torch.no_grad():
        for seq in seqs:
            ids = torch.tensor([seq], dtype=torch.int64)
            logits = model(input_ids=ids, output_router_logits=True).router_logits
            per_layer = torch.stack([lg.reshape(len(seq), -1) for lg in logits], dim=1)
            out.append(torch.topk(per_layer, topk, dim=-1).indices.numpy())
    return out


async def _vllm_routes(url: str, seqs: list[list[int]]) -> tuple[RouteSpec, list[np.ndarray]]:
    """vLLM's routes of every token of each sequence (prompt start 0, one sampled token)."""
    async with EngineClient(
        url, timeout=300, retry=RetryPolicy(max_retries=1), vocab_size=512
    ) as client:
        spec = await client.probe_spec()
        client.spec = spec
        rows = []
        for seq in seqs:
            res = await client.generate(
                seq,
                sampling_params={"max_tokens": 1, "temperature": 0.0, "ignore_eos": True},
                prompt_start=0,
            )
            assert res.routed_experts is not None
            rows.append(np.asarray(res.routed_experts))
    return spec, rows


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_vllm_routing_vs_recompute_r3_table(dtype: str, capsys: pytest.CaptureFixture[str]) -> None:
    """float32: the same weights at the same precision agree (only near-ties could flip);
    bfloat16, as a trainer often runs: the table measures the precision's disagreement."""
    assert URL is not None
    model_dir = _model_dir(URL)
    rng = np.random.default_rng(7)
    seqs = [rng.integers(3, 512, int(n)).tolist() for n in rng.integers(40, 120, 12)]
    spec, engine = asyncio.run(_vllm_routes(URL, seqs))
    trainer = _recompute(model_dir, seqs, spec.topk, dtype)
    for seq, e, t in zip(seqs, engine, trainer, strict=True):
        assert e.shape == t.shape == (len(seq), spec.num_layers, spec.topk)
    config = json.loads((model_dir / "config.json").read_text())
    experts = int(config.get("num_experts") or config["num_local_experts"])  # vLLM omits it
    spec = RouteSpec(spec.num_layers, spec.topk, experts, moe_layers=spec.moe_layers)
    n = [len(s) for s in seqs]
    offsets = pa.array(np.concatenate([[0], np.cumsum(n)]), pa.int64())
    trained = numpy_to_routes(np.concatenate(trainer).astype(spec.dtype), spec)
    table = r3arrow.rollout_table(
        trajectory_id=[f"t{i}" for i in range(len(seqs))],
        group_id=[f"g{i}" for i in range(len(seqs))],
        prompt_ids=[s[:-1] for s in seqs],
        response_ids=[s[-1:] for s in seqs],
        loss_mask=[[1] for _ in seqs],
        reward=[0.0] * len(seqs),
        routes=[e.astype(spec.dtype) for e in engine],
        spec=spec,
        recompute_routes=pa.LargeListArray.from_arrays(offsets, trained),
    )
    agreement = r3arrow.stats.route_agreement(table, "recompute_routes")
    assert agreement.tokens == sum(n)
    s = agreement.summary()
    with capsys.disabled():
        print(
            f"\nvLLM (float32) vs transformers {dtype} recompute: {agreement.tokens} tokens x "
            f"{len(agreement.layers)} layers, top-{agreement.topk}: router decisions that "
            f"differ {1 - s['overlap']:.3%}, tokens differing on >= 1 layer "
            f"{s['differing']:.3%}"
        )
        for layer, ident, ov in zip(
            agreement.layers, agreement.identical_fraction, agreement.mean_overlap, strict=True
        ):
            print(
                f"  layer {layer}: decisions differ {1 - ov:.3%}, top-k set differs {1 - ident:.3%}"
            )
    if dtype == "float32":  # same weights and precision, other kernels: near-ties at most
        assert 1 - s["overlap"] < 0.02
        assert s["differing"] < 0.1
    else:  # bfloat16 rounding flips close top-k boundaries (2.7 % of tokens when written)
        assert s["differing"] > 0
