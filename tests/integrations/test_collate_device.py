"""`MegatronCollator(device=...)`: compact ids shipped to the device, widened there.

On CPU, ``device="cpu"`` runs the ship-compact-then-widen path (a compact host buffer,
``torch`` widening) and must equal the default path (int32 written on the host) exactly;
with CUDA, the same comparison runs on the GPU (pinned host memory, ``non_blocking``).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch

from r3arrow import RouteSpec
from r3arrow.collate import MegatronCollator, Microbatch, Parallelism
from r3arrow.testing import random_rollouts

SPECS = [
    RouteSpec(num_layers=5, topk=4, num_experts=60, moe_layers=(0, 2, 3, 4)),  # uint8
    RouteSpec(num_layers=3, topk=2, num_experts=40_000),  # uint16: shipped as int16
    RouteSpec(num_layers=3, topk=3, num_experts=70_000),  # int32: no widening
]

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _table(spec: RouteSpec, seed: int = 0) -> Any:
    rng = np.random.default_rng(seed)
    shapes = [(int(p), int(r), int(p + r - 1)) for p, r in rng.integers(1, 9, (5, 2))]
    return random_rollouts(rng, spec, shapes)


def _equal(host: Microbatch, dev: Microbatch) -> None:
    assert host.layer_major is not None and dev.layer_major is not None
    assert dev.layer_major.dtype == torch.int32
    assert torch.equal(host.layer_major, dev.layer_major.cpu())
    for name in ("input_ids", "position_ids", "labels", "loss_mask", "label_mask"):
        assert torch.equal(getattr(host, name), getattr(dev, name).cpu()), name
    assert [t.cpu().tolist() for t in host.replay_targets()] == [
        t.cpu().tolist() for t in dev.replay_targets()
    ]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("spec", SPECS, ids=["uint8", "uint16", "int32"])
@pytest.mark.parametrize(
    "kw",
    [
        {"packed": True, "align": 4},
        {"packed": False},
        {"packed": True, "parallel": Parallelism(cp_size=2)},
    ],
)
def test_device_path_equals_host_path(device: str, spec: RouteSpec, kw: dict[str, Any]) -> None:
    table = _table(spec)
    layers = list(spec.router_layers)[-2:]
    host = MegatronCollator(spec, layers=layers, **kw)(table)
    collate = MegatronCollator(spec, layers=layers, device=device, **kw)
    for _ in range(2):  # the second call reuses the (pinned) staging buffer
        dev = collate(table)
        assert dev.layer_major is not None and dev.layer_major.device.type == device
        assert dev.input_ids.device.type == device
        _equal(host, dev)
        assert dev.ids_validated


@pytest.mark.parametrize("device", DEVICES)
def test_device_path_with_r3_off_and_chunks(device: str) -> None:
    spec = SPECS[0]
    table = _table(spec, 3)
    chunked = pa.concat_tables([table.slice(0, 2), table.slice(2)])
    _equal(
        MegatronCollator(spec, packed=True)(table),
        MegatronCollator(spec, packed=True, device=device)(chunked),
    )
    off = table.drop_columns(["routes"]).replace_schema_metadata(None)
    mb = MegatronCollator(None, packed=True, device=device)(off)
    assert mb.layer_major is None and mb.input_ids.device.type == device
    assert torch.equal(mb.input_ids.cpu(), MegatronCollator(None, packed=True)(off).input_ids)
