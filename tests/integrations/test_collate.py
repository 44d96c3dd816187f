"""MegatronCollator: layouts as small literals, a per-token reference for random tables
(packed/unpacked, alignment, TP/SP, CP, PP-local layers, storage dtypes), buffer reuse,
token-budget microbatching and the packed-output helpers."""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import r3arrow
from r3arrow import RouteSpec
from r3arrow.collate import (
    MegatronCollator,
    Microbatch,
    Parallelism,
    alignment_multiple,
)
from r3arrow.collate._microbatch import next_token_shift, packed_to_batch, unpacked_to_batch
from r3arrow.errors import RouteShapeError, SchemaError
from r3arrow.microbatch import is_padding_table, split_microbatches
from r3arrow.table import rollout_table


def _routes(mb: Microbatch) -> torch.Tensor:
    """``mb.routes`` of a microbatch collated with routes (never None here)."""
    assert mb.routes is not None
    return mb.routes


def _lm(mb: Microbatch) -> torch.Tensor:
    assert mb.layer_major is not None
    return mb.layer_major


def _table(spec: RouteSpec, trajs: list[dict[str, Any]]) -> pa.Table:
    return rollout_table(
        trajectory_id=[f"t{i}" for i in range(len(trajs))],
        group_id=[t.get("group", "g") for t in trajs],
        prompt_ids=[t["prompt"] for t in trajs],
        response_ids=[t["response"] for t in trajs],
        loss_mask=[t["mask"] for t in trajs],
        reward=[float(t.get("reward", 0.0)) for t in trajs],
        routes=[
            np.asarray(t["routes"], dtype=spec.dtype).reshape(-1, spec.num_layers, spec.topk)
            for t in trajs
        ],
        spec=spec,
    )


def _rows(n: int, base: int, spec: RouteSpec) -> np.ndarray:
    """n route rows whose ids encode (token, layer): ids base+10*t+layer and +1, distinct."""
    out = np.zeros((n, spec.num_layers, spec.topk), dtype=np.int64)
    assert spec.num_experts is not None
    experts = spec.num_experts
    for t in range(n):
        for layer in spec.router_layers:
            out[t, layer] = [(base + 10 * t + layer + j) % experts for j in range(spec.topk)]
    return out


SPEC = RouteSpec(num_layers=3, topk=2, num_experts=100, moe_layers=(1, 2))
A = {"prompt": [1, 2], "response": [3, 4, 5], "mask": [1, 1, 0], "routes": _rows(3, 0, SPEC)}
B = {"prompt": [6], "response": [7], "mask": [1], "routes": _rows(1, 50, SPEC)}


# -------------------------------------------------------------------- literals
def test_unpacked_layout_literal() -> None:
    mb = MegatronCollator(SPEC, layers=[1, 2])(_table(SPEC, [A, B]))
    assert mb.input_ids.tolist() == [[1, 2, 3, 4, 5], [6, 7, 0, 0, 0]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4]] * 2
    assert mb.loss_mask.tolist() == [[0, 0, 1, 1, 0], [0, 1, 0, 0, 0]]  # input-aligned, prompt 0
    assert mb.labels.tolist() == [[2, 3, 4, 5, 0], [7, 0, 0, 0, 0]]
    assert mb.label_mask.tolist() == [[0, 1, 1, 0, 0], [1, 0, 0, 0, 0]]
    assert mb.padding_mask.tolist() == [
        [False, False, False, True, True],
        [False, True, True, True, True],
    ]
    assert mb.cu_seqlens is None and mb.cu_seqlens_padded is None
    assert _routes(mb).shape == (2, 5, 2, 2) and _routes(mb).dtype == torch.int32
    assert _routes(mb)[0, :3, 0].tolist() == [[1, 2], [11, 12], [21, 22]]  # layer 1 rows
    assert _routes(mb)[0, :3, 1].tolist() == [[2, 3], [12, 13], [22, 23]]  # layer 2 rows
    assert _routes(mb)[0, 3:].reshape(-1, 2).tolist() == [[0, 1]] * 4  # dummies where not captured
    assert (
        _routes(mb)[1, 0, 0].tolist() == [51, 52]
        and _routes(mb)[1, 1:].reshape(-1, 2).tolist() == [[0, 1]] * 8
    )
    targets = mb.replay_targets()
    assert len(targets) == 2 and all(t.shape == (10, 2) and t.is_contiguous() for t in targets)
    for s in range(5):  # sequence-major: s * b + b_idx
        for bi in range(2):
            assert targets[0][s * 2 + bi].tolist() == _routes(mb)[bi, s, 0].tolist()


def test_packed_layout_literal_with_alignment() -> None:
    mb = MegatronCollator(SPEC, layers=[2], packed=True, align=4)(_table(SPEC, [A, B]))
    assert mb.cu_seqlens is not None and mb.cu_seqlens_padded is not None
    assert mb.cu_seqlens.tolist() == [0, 5, 7] and mb.cu_seqlens.dtype == torch.int32
    assert mb.cu_seqlens_padded.tolist() == [0, 8, 12] and mb.max_seqlen == 8
    assert mb.input_ids.tolist() == [[1, 2, 3, 4, 5, 0, 0, 0, 6, 7, 0, 0]]
    assert mb.position_ids.tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]]
    assert mb.loss_mask.tolist() == [[0, 0, 1, 1, 0, 0, 0, 0, 0, 1, 0, 0]]
    assert mb.labels.tolist() == [[2, 3, 4, 5, 0, 0, 0, 0, 7, 0, 0, 0]]  # never crosses a segment
    assert mb.label_mask.tolist() == [[0, 1, 1, 0, 0, 0, 0, 0, 1, 0, 0, 0]]
    assert mb.padding_mask.tolist() == [[False] * 3 + [True] * 5 + [False] + [True] * 3]
    assert _routes(mb).shape == (1, 12, 1, 2)
    assert (
        _routes(mb)[0, :, 0].tolist()
        == [[2, 3], [12, 13], [22, 23]] + [[0, 1]] * 5 + [[52, 53]] + [[0, 1]] * 3
    )
    (target,) = mb.replay_targets()
    assert target.tolist() == _routes(mb)[0, :, 0].tolist()


def test_next_token_shift_and_scatter_back_literal() -> None:
    cu, cup = [0, 5, 7], [0, 8, 12]
    values = torch.arange(12, dtype=torch.float32).reshape(1, 12)
    shifted = next_token_shift(values, cu, cup, fill=-1)
    assert shifted.tolist() == [[1, 2, 3, 4, -1, -1, -1, -1, 9, -1, -1, -1]]
    back = packed_to_batch(values, cu, cup, fill=-1)
    assert back.tolist() == [[0, 1, 2, 3], [8, -1, -1, -1]]  # [B, max_len - 1]
    mb = MegatronCollator(SPEC, packed=True, align=4)(_table(SPEC, [A, B]))
    assert mb.cu_seqlens is not None and mb.cu_seqlens_padded is not None
    assert torch.equal(
        next_token_shift(mb.input_ids, mb.cu_seqlens, mb.cu_seqlens_padded), mb.labels
    )
    assert mb.to_batch(values, fill=-1).tolist() == back.tolist()
    un = MegatronCollator(SPEC)(_table(SPEC, [A, B]))
    out = un.to_batch(torch.arange(10.0).reshape(2, 5), fill=-1)
    assert out.tolist() == [[0, 1, 2, 3], [5, -1, -1, -1]]
    assert unpacked_to_batch(torch.zeros(2, 5), [5, 2]).shape == (2, 4)
    with pytest.raises(RouteShapeError, match="expected 12 packed positions"):
        next_token_shift(torch.zeros(11), cu, cup)


def test_context_parallel_chunks_literal() -> None:
    """cp=2: rank r keeps chunks r and 3-r of every sequence split into 4 chunks."""
    long = {
        "prompt": [1, 2, 3],
        "response": [4, 5, 6, 7, 8],
        "mask": [1] * 5,
        "routes": _rows(7, 0, SPEC),
    }
    short = {"prompt": [9, 10], "response": [11, 12], "mask": [1, 1], "routes": _rows(3, 50, SPEC)}
    table = _table(SPEC, [long, short])
    # packed: multiple tp*cp*2 = 4 -> segments of 8 and 4 tokens, chunks of 2 and 1
    r0 = MegatronCollator(SPEC, packed=True, parallel=Parallelism(cp_size=2, cp_rank=0))(table)
    r1 = MegatronCollator(SPEC, packed=True, parallel=Parallelism(cp_size=2, cp_rank=1))(table)
    assert r0.input_ids.tolist() == [[1, 2, 7, 8, 9, 12]]
    assert r1.input_ids.tolist() == [[3, 4, 5, 6, 10, 11]]
    assert r0.token_index is not None and r0.token_index.tolist() == [0, 1, 6, 7, 8, 11]
    assert r0.labels.tolist() == [
        [2, 3, 8, 0, 10, 0]
    ]  # label of position 1 comes from rank 1's chunk
    assert r0.position_ids.tolist() == [[0, 1, 6, 7, 0, 3]]
    assert r0.padding_mask.tolist() == [[False, False, False, True, False, True]]
    assert r0.cu_seqlens_padded is not None and r0.cu_seqlens_padded.tolist() == [
        0,
        8,
        12,
    ]  # global, as PackedSeqParams wants
    full = MegatronCollator(SPEC, packed=True, align=4)(table)
    for r in (r0, r1):
        assert r.token_index is not None
        assert torch.equal(_routes(full)[0, r.token_index], _routes(r)[0])
        assert torch.equal(full.input_ids[0, r.token_index], r.input_ids[0])
    # unpacked: rows of 8 (multiple 4), chunks of 2 per row
    u0 = MegatronCollator(SPEC, parallel=Parallelism(cp_size=2, cp_rank=0))(table)
    assert u0.input_ids.tolist() == [[1, 2, 7, 8], [9, 10, 0, 0]]
    assert u0.token_index is not None and u0.token_index.tolist() == [0, 1, 6, 7]
    assert u0.num_router_tokens == 8


def test_sequence_parallel_slices_router_tokens_by_tp_rank() -> None:
    table = _table(SPEC, [A, B])
    whole = MegatronCollator(SPEC, parallel=Parallelism(tp_size=2, tp_rank=1))(
        table
    )  # no SP: router sees all tokens
    assert whole.input_ids.shape == (2, 6) and whole.num_router_tokens == 12
    parts = [
        MegatronCollator(SPEC, parallel=Parallelism(tp_size=2, tp_rank=r, sequence_parallel=True))(
            table
        )
        for r in (0, 1)
    ]
    for p in parts:
        assert p.input_ids.shape == (2, 6)  # model inputs stay whole; Megatron scatters them
        assert p.num_router_tokens == 6 and all(t.shape == (6, 2) for t in p.replay_targets())
    for layer in range(2):
        joined = torch.cat([p.replay_targets()[layer] for p in parts])
        assert torch.equal(joined, whole.replay_targets()[layer])
    for p in parts:  # the per-router targets are the rows of one [L_local, tokens, K] view
        assert p.replay_tensor().shape == (2, 6, 2)
        assert p.replay_tensor().data_ptr() == p.replay_targets()[0].data_ptr()
        assert all(
            torch.equal(a, b) for a, b in zip(p.replay_tensor(), p.replay_targets(), strict=True)
        )
    packed = MegatronCollator(
        SPEC, packed=True, parallel=Parallelism(tp_size=2, tp_rank=1, sequence_parallel=True)
    )(table)
    assert packed.cu_seqlens_padded is not None and packed.cu_seqlens_padded.tolist() == [0, 6, 8]
    assert packed.replay_targets()[0].tolist() == _routes(packed)[0, 4:, 0].tolist()


def test_pp_local_layers_with_dense_first_layers() -> None:
    spec = RouteSpec(num_layers=6, topk=2, num_experts=100, moe_layers=(2, 3, 4, 5))
    t = {"prompt": [1], "response": [2, 3], "mask": [1, 1], "routes": _rows(2, 0, spec)}
    table = _table(spec, [t])
    mb = MegatronCollator(spec, layers=[4, 5])(table)
    assert _routes(mb)[0, :2].tolist() == [[[4, 5], [5, 6]], [[14, 15], [15, 16]]]
    assert _routes(MegatronCollator(spec, layers=[5, 3])(table))[0, 0].tolist() == [
        [5, 6],
        [3, 4],
    ]  # order kept
    assert _routes(MegatronCollator(spec, layers=[2, 5])(table))[0, 1].tolist() == [
        [12, 13],
        [15, 16],
    ]
    assert MegatronCollator(spec).layers == (2, 3, 4, 5)
    with pytest.raises(RouteShapeError, match=r"router layers from \[2, 3, 4, 5\], found \[0\]"):
        MegatronCollator(spec, layers=[0, 2])
    with pytest.raises(ValueError, match="layers: expected distinct router layers"):
        MegatronCollator(spec, layers=[2, 2])
    with pytest.raises(TypeError, match="layers: expected an int"):
        MegatronCollator(spec, layers=[2.0])  # type: ignore[list-item]


def test_alignment_multiple() -> None:
    assert alignment_multiple() == 1
    assert alignment_multiple(align=3, tp_size=2) == 6
    assert alignment_multiple(tp_size=2, fp8=True) == 16
    assert alignment_multiple(tp_size=2, cp_size=2) == 8
    assert alignment_multiple(tp_size=2, cp_size=2, fp8=True) == 32
    assert alignment_multiple(align=6, tp_size=4, cp_size=3) == 24
    mb = MegatronCollator(SPEC, align=3, parallel=Parallelism(tp_size=2))(_table(SPEC, [A, B]))
    assert mb.input_ids.shape == (2, 6)
    mb = MegatronCollator(SPEC, packed=True, fp8=True)(_table(SPEC, [A, B]))
    assert mb.cu_seqlens_padded is not None and mb.cu_seqlens_padded.tolist() == [0, 16, 32]
    with pytest.raises(ValueError, match=r"tp_rank: expected an int in \[0, 1\], found 2"):
        MegatronCollator(SPEC, parallel=Parallelism(tp_size=2, tp_rank=2))
    with pytest.raises(ValueError, match=r"align: expected an int in \[1, inf\], found 0"):
        MegatronCollator(SPEC, align=0)
    with pytest.raises(TypeError, match="tp_size: expected an int"):
        alignment_multiple(tp_size=True)


def test_bad_tables_are_rejected() -> None:
    table = _table(SPEC, [A, B])
    other = RouteSpec(num_layers=4, topk=2, num_experts=100)
    with pytest.raises(SchemaError, match="expected \\[L=4, K=2\\]"):
        MegatronCollator(other)(table)
    with pytest.raises(SchemaError, match="num_experts: expected 64, found 100"):
        MegatronCollator(RouteSpec(num_layers=3, topk=2, num_experts=64, moe_layers=(1, 2)))(table)
    with pytest.raises(SchemaError, match="empty"):
        MegatronCollator(SPEC)(table.slice(0, 0))
    with pytest.raises(TypeError, match="Table or RecordBatch"):
        MegatronCollator(SPEC)({"routes": []})  # type: ignore[arg-type]
    short = pa.array([[1, 1], [1]], type=table.schema.field("loss_mask").type)
    bad = table.set_column(table.schema.get_field_index("loss_mask"), "loss_mask", short)
    with pytest.raises(SchemaError, match="row 0: expected") as info:
        MegatronCollator(SPEC, validate=False)(bad)
    assert info.value.row == 0
    batch = table.to_batches()[0]
    assert (
        MegatronCollator(SPEC)(batch).input_ids.tolist()
        == MegatronCollator(SPEC)(table).input_ids.tolist()
    )


def test_multi_chunk_table_equals_single_chunk() -> None:
    c = _table(SPEC, [B, A])
    joined = pa.concat_tables([_table(SPEC, [A, B]), c])
    assert joined.column("routes").num_chunks == 2
    single = joined.combine_chunks()
    for kw in (
        {},
        {"layers": [2, 1]},
        {"packed": True, "align": 4},
        {"packed": True, "parallel": Parallelism(cp_size=2, cp_rank=1)},
    ):
        a, b = MegatronCollator(SPEC, **kw)(joined), MegatronCollator(SPEC, **kw)(single)
        assert torch.equal(_lm(a), _lm(b)) and torch.equal(a.input_ids, b.input_ids)


def test_output_buffers_reused_only_when_unreferenced() -> None:
    table = _table(SPEC, [A, B])
    collate = MegatronCollator(SPEC, packed=True)
    first = collate(table)
    ptr = _lm(first).data_ptr()
    snapshot = _routes(first).clone()
    second = collate(table)
    assert _lm(second).data_ptr() != ptr  # first is alive: never overwritten
    _lm(second).fill_(-7)
    assert torch.equal(_routes(first), snapshot)
    del first
    gc.collect()
    third = collate(table)
    assert _routes(third).data_ptr() == ptr and torch.equal(_routes(third), snapshot)
    kept = third.replay_targets()[0]  # a view handed to Megatron keeps the buffer busy
    del third
    gc.collect()
    fourth = collate(table)
    assert _lm(fourth).data_ptr() != ptr
    assert kept.tolist() == snapshot[0, :, 0].tolist()
    del second, fourth, kept
    gc.collect()
    big = _table(SPEC, [A, B] * 40)
    held = collate(big)  # needs more than any pooled buffer: the small free ones are replaced
    assert collate._pool is not None
    assert len(collate._pool) == 1 and collate.pooled_bytes >= _lm(held).nbytes
    collate.release_buffers()
    assert collate.pooled_bytes > 0  # held is still in use
    del held
    gc.collect()
    collate.release_buffers()
    assert collate.pooled_bytes == 0
    fresh = MegatronCollator(SPEC, packed=True, reuse_buffers=False)
    assert fresh.pooled_bytes == 0 and torch.equal(_routes(fresh(table)), snapshot)


@pytest.mark.parametrize(
    "kw",
    [
        {"packed": True},
        {"packed": False},
        {"packed": True, "parallel": Parallelism(cp_size=2, cp_rank=1), "align": 3},
    ],
)
def test_threaded_route_copies_equal_single_thread(
    monkeypatch: pytest.MonkeyPatch, kw: dict[str, Any]
) -> None:
    rng = np.random.default_rng(3)
    spec = RouteSpec(num_layers=4, topk=2, num_experts=100, moe_layers=(1, 2, 3))
    trajs = []
    for i in range(7):
        n = int(rng.integers(3, 40))
        c = n - 1 if i % 2 else n // 2
        trajs.append(
            {
                "prompt": [1],
                "response": list(range(2, n + 1)),
                "mask": [int(1 + j <= c) for j in range(n - 1)],
                "routes": _rows(c, i, spec),
            }
        )
    table = _table(spec, trajs)
    single = MegatronCollator(spec, num_threads=1, **kw)(table)
    monkeypatch.setattr(r3arrow.collate._collator, "_PARALLEL_BYTES", 0)
    monkeypatch.setattr(r3arrow.ids, "_BLOCK_IDS", 16)  # many small blocks (numpy backend)
    threaded = MegatronCollator(spec, num_threads=3, **kw)(table)
    assert torch.equal(_lm(single), _lm(threaded))
    assert torch.equal(single.padding_mask, threaded.padding_mask)
    with pytest.raises(ValueError, match="num_threads"):
        MegatronCollator(spec, num_threads=0)


def test_microbatch_to_device_and_repr() -> None:
    mb = MegatronCollator(SPEC, packed=True, align=4)(_table(SPEC, [A, B]))
    moved = mb.to("cpu")
    assert torch.equal(_routes(moved), _routes(mb)) and moved.cu_seqlens is not None
    assert "packed 1x12" in repr(mb) and "layers=[1, 2]" in repr(mb)
    assert (
        r3arrow.MegatronCollator is MegatronCollator
        and r3arrow.microbatch.split_microbatches is split_microbatches
    )


# ------------------------------------------------------------ reference check
def _reference(
    trajs: list[dict[str, Any]], spec: RouteSpec, layers: list[int], kw: dict[str, Any]
) -> dict[str, Any]:
    """Per-token reference of the layout rules (docs/design.md, "Layouts for Megatron"),
    written for clarity, not speed."""
    par: Parallelism = kw["parallel"]
    m = alignment_multiple(
        align=kw["align"], tp_size=par.tp_size, cp_size=par.cp_size, fp8=kw["fp8"]
    )
    k, cp, r = spec.topk, par.cp_size, par.cp_rank
    dummy = list(range(k))

    def token(tr: dict[str, Any], t: int) -> dict[str, Any]:
        seq = tr["prompt"] + tr["response"]
        mask = [0] * len(tr["prompt"]) + tr["mask"]
        n, c = len(seq), len(tr["routes"])
        return {
            "id": seq[t] if t < n else 0,
            "pos": t,
            "loss": mask[t] if t < n else 0,
            "label": seq[t + 1] if t + 1 < n else 0,
            "label_mask": mask[t + 1] if t + 1 < n else 0,
            "pad": t >= c,
            "route": [list(map(int, tr["routes"][t][g])) if t < c else dummy for g in layers],
        }

    def cp_order(length: int) -> list[int]:
        if cp == 1:
            return list(range(length))
        ch = length // (2 * cp)
        return [*range(r * ch, (r + 1) * ch), *range((2 * cp - 1 - r) * ch, (2 * cp - r) * ch)]

    lens = [len(t["prompt"]) + len(t["response"]) for t in trajs]
    if kw["packed"]:
        rows = [
            [token(tr, t) for i, tr in enumerate(trajs) for t in cp_order(-(-lens[i] // m) * m)]
        ]
    else:
        width = -(-max(lens) // m) * m
        rows = [[token(tr, t) for t in cp_order(width)] for tr in trajs]
    # Megatron token order: [s, b] flattened sequence-major (packed: one row)
    order = [rows[b][s] for s in range(len(rows[0])) for b in range(len(rows))]
    if par.sequence_parallel and par.tp_size > 1:
        per = len(rows[0]) // par.tp_size * len(rows)
        order = order[par.tp_rank * per : (par.tp_rank + 1) * per]
    field = {
        f: [[tok[f] for tok in row] for row in rows]
        for f in ("id", "pos", "loss", "label", "label_mask", "pad")
    }
    field["routes"] = [[tok["route"] for tok in row] for row in rows]
    field["targets"] = [[tok["route"][j] for tok in order] for j in range(len(layers))]
    return field


@st.composite
def _cases(draw: st.DrawFn) -> tuple[RouteSpec, list[dict[str, Any]], list[int], dict[str, Any]]:
    n_layers = draw(st.integers(1, 4))
    k = draw(st.integers(1, 3))
    experts = draw(st.sampled_from([6, 300, 70_000]))  # uint8, uint16, int32 storage
    moe = draw(st.lists(st.integers(0, n_layers - 1), min_size=1, max_size=n_layers, unique=True))
    spec = RouteSpec(num_layers=n_layers, topk=k, num_experts=experts, moe_layers=tuple(moe))
    trajs = []
    for _ in range(draw(st.integers(1, 4))):
        p, g = draw(st.integers(1, 5)), draw(st.integers(1, 6))
        n = p + g
        c = draw(st.integers(0, n))
        mask = [draw(st.integers(0, 1)) if p + j <= c else 0 for j in range(g)]  # terminal-gap rule
        routes = np.zeros((c, n_layers, k), dtype=np.int64)
        for t in range(c):
            for layer in moe:
                routes[t, layer] = draw(st.permutations(range(min(experts, 8))))[:k]
        trajs.append(
            {
                "prompt": draw(st.lists(st.integers(1, 999), min_size=p, max_size=p)),
                "response": list(range(100, 100 + g)),
                "mask": mask,
                "routes": routes,
            }
        )
    layers = draw(
        st.lists(st.sampled_from(sorted(moe)), min_size=1, max_size=len(moe), unique=True)
    )
    tp, cp = draw(st.sampled_from([1, 2])), draw(st.sampled_from([1, 2]))
    kw = {
        "packed": draw(st.booleans()),
        "align": draw(st.sampled_from([1, 2, 3])),
        "parallel": Parallelism(
            tp_size=tp,
            tp_rank=draw(st.integers(0, tp - 1)),
            cp_size=cp,
            cp_rank=draw(st.integers(0, cp - 1)),
            sequence_parallel=draw(st.booleans()),
        ),
        "fp8": draw(st.booleans()) and draw(st.booleans()),
    }
    return spec, trajs, layers, kw


@given(_cases())
def test_collate_matches_per_token_reference(
    case: tuple[RouteSpec, list[dict[str, Any]], list[int], dict[str, Any]],
) -> None:
    spec, trajs, layers, kw = case
    mb = MegatronCollator(spec, layers=layers, **kw)(_table(spec, trajs))
    ref = _reference(trajs, spec, layers, kw)
    assert mb.input_ids.tolist() == ref["id"]
    assert mb.position_ids.tolist() == ref["pos"]
    assert mb.loss_mask.tolist() == ref["loss"]
    assert mb.labels.tolist() == ref["label"]
    assert mb.label_mask.tolist() == ref["label_mask"]
    assert mb.padding_mask.tolist() == ref["pad"]
    assert _routes(mb).tolist() == ref["routes"]
    assert [t.tolist() for t in mb.replay_targets()] == ref["targets"]
    assert all(t.is_contiguous() and t.dtype == torch.int32 for t in mb.replay_targets())
    assert mb.num_router_tokens == len(ref["targets"][0])
    lens = [len(t["prompt"]) + len(t["response"]) for t in trajs]
    if kw["packed"] and mb.cu_seqlens is not None:
        assert mb.cu_seqlens.tolist() == np.concatenate([[0], np.cumsum(lens)]).tolist()


# -------------------------------------------------------------- microbatching
# Planning itself (r3arrow.microbatch) is tested in tests/core/test_microbatch.py.
def test_split_microbatches_keeps_columns_and_routes_with_their_trajectory() -> None:
    trajs = [dict(A, group=f"g{i}", reward=i) for i in range(3)] + [dict(B, reward=9)]
    table = _table(SPEC, trajs)
    parts = split_microbatches(table, max_tokens=12)
    assert sum(p.num_rows for p in parts) == 4
    assert all(r3arrow.table.route_spec(p) == r3arrow.table.route_spec(table) for p in parts)
    for p in parts:
        for i, tid in enumerate(p.column("trajectory_id").to_pylist()):
            row = int(str(tid)[1:])
            assert p.column("routes")[i].as_py() == table.column("routes")[row].as_py()
            assert p.column("reward")[i].as_py() == table.column("reward")[row].as_py()
    collate = MegatronCollator(SPEC, packed=True, align=4)
    assert [p.num_rows for p in collate.split(table, num_microbatches=2)] in (
        [2, 2],
        [3, 1],
        [1, 3],
    )


@pytest.mark.parametrize(
    "kw",
    [
        {},
        {"packed": True, "align": 4},
        {
            "parallel": Parallelism(
                tp_size=2, tp_rank=1, cp_size=2, cp_rank=1, sequence_parallel=True
            )
        },
        {"packed": True, "parallel": Parallelism(cp_size=2, cp_rank=0)},
    ],
)
def test_dp_padding_microbatch_collates_to_dummy_rows_only(kw: dict[str, Any]) -> None:
    """A rank short of microbatches gets a padding table; it collates like any other."""
    table = _table(SPEC, [A, B, dict(A, group="g2")])
    ranks = [split_microbatches(table, num_microbatches=2, dp_size=2, dp_rank=r) for r in (0, 1)]
    assert [len(parts) for parts in ranks] == [2, 2]
    collate = MegatronCollator(SPEC, pad_token_id=-1, **kw)
    padding = [collate(p) for parts in ranks for p in parts if is_padding_table(p)]
    real = [collate(p) for parts in ranks for p in parts if not is_padding_table(p)]
    assert len(padding) == 1 and len(real) == 3 and not any(mb.is_padding for mb in real)
    (mb,) = padding
    assert mb.is_padding and bool(mb.padding_mask.all()) and "padding" in repr(mb)
    assert float(mb.loss_mask.sum()) == 0 and float(mb.label_mask.sum()) == 0
    assert bool((mb.input_ids == -1).all()) and bool((mb.labels == -1).all())
    assert mb.num_sequences == 1 and mb.captured.tolist() == [0]
    dummy = torch.arange(SPEC.topk, dtype=torch.int32)
    targets = mb.replay_tensor()
    assert targets.shape[:2] == (len(SPEC.router_layers), mb.num_router_tokens)
    assert bool((targets == dummy).all())  # every row is [0 .. K-1]
