"""Agreement during replay (``replay_schedule(measure_agreement=True)``) with real routers.

megatron-core ``TopKRouter``s on the CPU (gloo world of one) whose weights are permutation
matrices, fed hidden states whose entries are distinct: every token's native top-k on every
layer is known exactly. The rollout routes equal the native choice except at chosen
(trajectory, token, layer) cells, where some experts are swapped for others (or only the
order within top-k changes, which must still count as identical). The probe must report
exactly the expected counts, on non-padding tokens only, for packed and unpacked
microbatches, while replay keeps applying the targets bit for bit.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch

pytest.importorskip("megatron.core")
pytestmark = [
    pytest.mark.megatron,
    pytest.mark.filterwarnings("ignore:full scope is deprecated:UserWarning"),
]

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from r3arrow import RouteSpec  # noqa: E402
from r3arrow.collate import MegatronCollator, Microbatch  # noqa: E402
from r3arrow.errors import ReplayError  # noqa: E402
from r3arrow.megatron import (  # noqa: E402
    ReplayProbe,
    install_replay,
    model_inputs,
    record_schedule,
    replay_backward,
    replay_schedule,
)
from r3arrow.stats import RouteAgreement  # noqa: E402
from r3arrow.table import rollout_table  # noqa: E402
from r3arrow.testing import use_backend  # noqa: E402
from r3arrow.testing.megatron import CpuMegatron, build_routers, cpu_router_harness  # noqa: E402

EXPERTS, TOPK = 8, 3
SPEC = RouteSpec(num_layers=4, topk=TOPK, num_experts=EXPERTS, moe_layers=(1, 2, 3))
MOE = [1, 2, 3]
Change = tuple[int, int, int, int]  # (trajectory, token, index into MOE, experts swapped; 0: order)


@pytest.fixture(scope="module")
def megatron() -> Iterator[CpuMegatron]:
    with cpu_router_harness() as meg:
        yield meg


@pytest.fixture(params=["numba", "torch"], autouse=True)
def backend(request: pytest.FixtureRequest) -> Iterator[str]:
    """Every test on both CPU paths of the probe: the numba kernel (the ``fast`` extra) and
    the torch fallback (the numpy backend, `r3arrow.testing.use_backend`)."""
    if request.param == "numba":
        pytest.importorskip("numba")
    with use_backend("numba" if request.param == "numba" else "numpy"):
        yield str(request.param)


def _routers(meg: CpuMegatron, seed: int = 0) -> list[Any]:
    """Routers for MOE whose gate is a permutation: logits[e] = hidden[perm[e]] (exact)."""
    meg.RouterReplay.clear_global_router_replay_instances()
    routers = build_routers(SPEC, MOE, hidden=EXPERTS)
    rng = np.random.default_rng(seed)
    for r in routers:
        perm = rng.permutation(EXPERTS)
        with torch.no_grad():
            r.weight.copy_(torch.eye(EXPERTS)[torch.from_numpy(perm)])
        r._r3arrow_test_perm = perm
    return routers


@dataclasses.dataclass
class Case:
    table: pa.Table
    scores: list[np.ndarray]  # per trajectory [n, E] float32 hidden states (= gate input)
    native: list[np.ndarray]  # per trajectory [c, len(MOE), K]: the routers' own top-k
    targets: list[np.ndarray]  # per trajectory [c, len(MOE), K]: the routes replayed


def _case(
    routers: list[Any], lengths: list[int], captured: list[int], changes: list[Change], seed: int
) -> Case:
    rng = np.random.default_rng(seed)
    scores = [
        np.stack([rng.permutation(EXPERTS) for _ in range(n)]).astype(np.float32) * 0.25
        for n in lengths
    ]
    native, targets = [], []
    for x, c in zip(scores, captured, strict=True):
        per_layer = [np.argsort(-x[:c, r._r3arrow_test_perm], axis=1)[:, :TOPK] for r in routers]
        nat = np.stack(per_layer, axis=1) if c else np.zeros((0, len(MOE), TOPK), np.int64)
        native.append(nat)
        targets.append(nat[:, :, ::-1].copy())  # reversed order: still the same set
    for i, t, j, m in changes:
        row = targets[i][t, j]
        if m == 0:
            row[:] = np.roll(row, 1)
            continue
        others = np.setdiff1d(np.arange(EXPERTS), row)
        row[TOPK - m :] = rng.choice(others, m, replace=False)
    routes = []
    for tgt in targets:
        r = np.zeros((tgt.shape[0], SPEC.num_layers, TOPK), dtype=np.uint8)  # dense layer 0: 0
        r[:, MOE] = tgt
        routes.append(r)
    table = rollout_table(
        trajectory_id=[f"t{i}" for i in range(len(lengths))],
        group_id=["g"] * len(lengths),
        prompt_ids=[[1, 2] for _ in lengths],
        response_ids=[list(range(3, n + 1)) for n in lengths],
        loss_mask=[
            [int(2 + j <= c) for j in range(n - 2)] for n, c in zip(lengths, captured, strict=True)
        ],
        reward=[0.0] * len(lengths),
        routes=routes,
        spec=SPEC,
    )
    return Case(table, scores, native, targets)


def _expected(case: Case) -> RouteAgreement:
    """Oracle: set comparison per captured token and layer (order within top-k ignored)."""
    identical = np.zeros(len(MOE), np.int64)
    overlap = np.zeros(len(MOE), np.int64)
    tokens = all_identical = 0
    for nat, tgt in zip(case.native, case.targets, strict=True):
        for t in range(nat.shape[0]):
            same = [set(nat[t, j].tolist()) == set(tgt[t, j].tolist()) for j in range(len(MOE))]
            overlap += [len(set(nat[t, j].tolist()) & set(tgt[t, j].tolist())) for j in range(3)]
            identical += same
            tokens += 1
            all_identical += all(same)
    return RouteAgreement(tuple(MOE), TOPK, tokens, identical, overlap, all_identical)


def _positions(mb: Microbatch) -> list[tuple[int, int, int, int]]:
    """(trajectory, t, s, b) of every token of every trajectory in the router's [s, b] grid."""
    out = []
    for i, n in enumerate(mb.seq_lens.tolist()):
        for t in range(n):
            if mb.packed:
                assert mb.cu_seqlens_padded is not None
                out.append((i, t, int(mb.cu_seqlens_padded[i]) + t, 0))
            else:
                out.append((i, t, t, i))
    return out


def _inputs(case: Case, mb: Microbatch, seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    """Hidden states [s, b, E] and the router padding mask [s, b] (MoELayer transposes the
    ``[b, s]`` mask the model gets); padded positions get random distinct scores too."""
    b, s = (int(d) for d in mb.input_ids.shape)
    rng = np.random.default_rng(seed)
    hidden = np.stack([rng.permutation(EXPERTS) for _ in range(s * b)]).astype(np.float32)
    hidden = hidden.reshape(s, b, EXPERTS) * 0.25
    for i, t, q, col in _positions(mb):
        hidden[q, col] = case.scores[i][t]
    pad = model_inputs(mb, pre_process=True)["padding_mask"].transpose(0, 1).bool()
    return torch.from_numpy(hidden), pad


def _forward(routers: list[Any], hidden: torch.Tensor, pad: torch.Tensor | None) -> list[Any]:
    with torch.no_grad():
        return [r(hidden, padding_mask=pad) for r in routers]


def _collate(case: Case, packed: bool, **kw: Any) -> Microbatch:
    return MegatronCollator(SPEC, layers=MOE, packed=packed, align=4, **kw)(case.table)


LENGTHS, CAPTURED = [5, 9, 7], [4, 8, 5]  # ragged; each trajectory ends in padding rows
CHANGES: list[Change] = [
    (0, 0, 0, 1),  # one expert swapped on layer 1
    (0, 0, 2, 3),  # same token, all experts swapped on layer 3
    (1, 7, 1, 2),  # last captured token of trajectory 1, layer 2
    (2, 3, 0, 0),  # order only: identical
    (2, 4, 2, 1),
]


@pytest.mark.parametrize("chunks", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_known_disagreement_counts_exactly(
    megatron: CpuMegatron, packed: bool, chunks: bool
) -> None:
    routers = _routers(megatron)
    case = _case(routers, LENGTHS, CAPTURED, CHANGES, seed=1)
    if chunks:  # chunked routes: a routes column of many chunks
        case.table = pa.concat_tables([case.table.slice(0, 1), case.table.slice(1)])
    mb = _collate(case, packed)
    hidden, pad = _inputs(case, mb)
    with replay_schedule(measure_agreement=True) as probe:
        assert isinstance(probe, ReplayProbe)
        install_replay(mb, routers)
        probed = _forward(routers, hidden, pad)
    got = probe.agreement
    want = _expected(case)
    assert got == want
    # the literal counts, so the oracle itself is pinned
    assert got.tokens == sum(CAPTURED) == 17
    assert got.identical.tolist() == [16, 16, 15]
    assert got.overlap.tolist() == [17 * 3 - 1, 17 * 3 - 2, 17 * 3 - 3 - 1]
    assert got.all_identical == 17 - 3
    # replay is undisturbed: bit-identical to the same schedule without the probe
    with replay_schedule() as none:
        assert none is None
        install_replay(mb, routers)
        plain = _forward(routers, hidden, pad)
    for (p1, m1), (p2, m2) in zip(probed, plain, strict=True):
        assert torch.equal(p1, p2) and torch.equal(m1, m2)
    # ... and applies the targets, not the native choice, on every captured token
    for j, (_, rmap) in enumerate(probed):
        for i, t, q, col in _positions(mb):
            if t < CAPTURED[i]:
                chosen = torch.nonzero(rmap.reshape(-1, EXPERTS)[q * hidden.shape[1] + col])
                assert sorted(chosen.reshape(-1).tolist()) == sorted(case.targets[i][t, j])


@pytest.mark.parametrize("packed", [False, True])
def test_padding_is_excluded_with_or_without_a_router_mask(
    megatron: CpuMegatron, packed: bool
) -> None:
    """Padding rows replay dummy experts 0..K-1, which differ from the native choice here:
    excluded by the router's padding mask or, without one, by the installed microbatch's."""
    routers = _routers(megatron)
    case = _case(routers, LENGTHS, CAPTURED, [], seed=2)
    mb = _collate(case, packed=packed)
    hidden, pad = _inputs(case, mb)
    assert hidden.shape[0] * hidden.shape[1] > sum(CAPTURED)
    for mask in (pad, None):
        with replay_schedule(measure_agreement=True) as probe:
            install_replay(mb, routers)
            _forward(routers, hidden, mask)
        assert probe is not None and probe.agreement == _expected(case)
        assert probe.agreement.all_identical == probe.agreement.tokens == sum(CAPTURED)
    with replay_schedule(measure_agreement=True) as raw:  # raw targets: no padding known
        install_replay(mb.replay_targets(), routers, num_tokens=mb.num_router_tokens, layers=MOE)
        _forward(routers, hidden, None)
    assert raw is not None and raw.agreement.tokens == hidden.shape[0] * hidden.shape[1]
    assert raw.agreement.all_identical < raw.agreement.tokens


def test_microbatches_sum_and_recompute_counts_once(megatron: CpuMegatron) -> None:
    routers = _routers(megatron)
    a = _case(routers, [6, 4], [5, 3], [(0, 1, 0, 2), (1, 2, 1, 1)], seed=3)
    b = _case(routers, [7, 5, 3], [6, 4, 2], [(2, 1, 2, 3), (0, 5, 0, 1), (0, 5, 1, 1)], seed=4)
    mb_a = _collate(a, packed=True, reuse_buffers=False)
    mb_b = _collate(b, packed=False, reuse_buffers=False)
    in_a, in_b = _inputs(a, mb_a), _inputs(b, mb_b)
    with replay_schedule(measure_agreement=True) as probe:
        install_replay(mb_a, routers)
        first_a = _forward(routers, *in_a)
        install_replay(mb_b, routers)
        _forward(routers, *in_b)
        with replay_backward():  # activation recompute: pops the targets, not counted again
            again_a = _forward(routers, *in_a)
            _forward(routers, *in_b)
    assert probe is not None
    assert probe.agreement == _expected(a) + _expected(b)
    assert probe.agreement.all_identical == (8 - 2) + (12 - 2)
    for (_, m1), (_, m2) in zip(first_a, again_a, strict=True):
        assert torch.equal(m1, m2)


def test_two_schedules_count_independently_and_errors_clear(megatron: CpuMegatron) -> None:
    from megatron.core.transformer.moe.router import TopKRouter

    routers = _routers(megatron)
    a = _case(routers, [6, 4], [5, 3], [(0, 0, 0, 1)], seed=5)
    b = _case(routers, [5, 5], [4, 4], [(1, 3, 2, 2), (0, 0, 1, 3)], seed=6)
    mb_a = _collate(a, packed=True, reuse_buffers=False)
    mb_b = _collate(b, packed=True, reuse_buffers=False)
    with replay_schedule(measure_agreement=True) as pa_:
        install_replay(mb_a, routers)
        _forward(routers, *_inputs(a, mb_a))
    with replay_schedule(measure_agreement=True) as pb:
        install_replay(mb_b, routers)
        _forward(routers, *_inputs(b, mb_b))
    assert pa_ is not None and pb is not None
    assert pa_.agreement == _expected(a) and pb.agreement == _expected(b)
    with (
        pytest.raises(RuntimeError, match="boom"),
        replay_schedule(measure_agreement=True) as broken,
    ):
        install_replay(mb_a, routers)
        _forward(routers, *_inputs(a, mb_a))
        with pytest.raises(ReplayError, match="open"):
            _ = broken.agreement if broken is not None else None
        raise RuntimeError("boom")
    assert broken is not None
    with pytest.raises(ReplayError, match="raised"):
        _ = broken.agreement
    # nothing stays patched or queued; the next schedule sees only its own calls
    assert not hasattr(megatron.RouterReplay.__dict__["get_replay_topk"], "_r3arrow_probe")
    assert not hasattr(TopKRouter.__dict__["routing"], "_r3arrow_probe")
    for inst in megatron.RouterReplay.global_router_replay_instances:
        assert inst.target_topk_idx is None and inst.replay_backward_list == []
    with replay_schedule(measure_agreement=True) as pc:
        install_replay(mb_b, routers)
        _forward(routers, *_inputs(b, mb_b))
    assert pc is not None and pc.agreement == _expected(b)


def test_off_by_default_patches_nothing(megatron: CpuMegatron) -> None:
    from megatron.core.transformer.moe.router import TopKRouter

    routers = _routers(megatron)
    case = _case(routers, [4], [3], [], seed=8)
    mb = _collate(case, packed=True)
    before = (megatron.RouterReplay.__dict__["get_replay_topk"], TopKRouter.__dict__["routing"])
    with replay_schedule() as probe:
        assert probe is None
        assert (
            megatron.RouterReplay.__dict__["get_replay_topk"],
            TopKRouter.__dict__["routing"],
        ) == before
        install_replay(mb, routers)
        _forward(routers, *_inputs(case, mb))
    with (
        pytest.raises(TypeError, match="measure_agreement"),
        replay_schedule(measure_agreement=1),  # type: ignore[arg-type]
    ):
        pass


def test_routers_without_layer_number_use_instance_order(megatron: CpuMegatron) -> None:
    """Routers built outside a TransformerLayer (0.16: layer_number None): layers are the
    instances' build positions; counts are unchanged."""
    routers = _routers(megatron)
    case = _case(routers, LENGTHS, CAPTURED, CHANGES, seed=1)
    for r in routers:
        r.layer_number = None
        if hasattr(r.router_replay, "layer_number"):  # 0.19 copies it onto RouterReplay
            r.router_replay.layer_number = None
    mb = _collate(case, packed=True)
    with replay_schedule(measure_agreement=True) as probe:
        install_replay(mb.replay_targets(), num_tokens=mb.num_router_tokens)
        _forward(routers, *_inputs(case, mb))
    assert probe is not None
    want = _expected(case)
    got = probe.agreement
    assert got.layers == (0, 1, 2)
    assert (got.tokens, got.all_identical) == (want.tokens, want.all_identical)
    assert np.array_equal(got.identical, want.identical)
    assert np.array_equal(got.overlap, want.overlap)


def test_schedule_without_router_calls_is_empty(megatron: CpuMegatron) -> None:
    _routers(megatron)
    with replay_schedule(measure_agreement=True) as probe:
        pass
    assert probe is not None
    got = probe.agreement
    assert (got.layers, got.tokens, got.all_identical) == ((), 0, 0)


@st.composite
def _batches(draw: st.DrawFn) -> tuple[list[int], list[int], list[Change], bool]:
    n = draw(st.integers(1, 4))
    lengths = [draw(st.integers(3, 9)) for _ in range(n)]
    captured = [draw(st.integers(1, m - 1)) for m in lengths]
    cells = [(i, t, j) for i, c in enumerate(captured) for t in range(c) for j in range(3)]
    picked = draw(st.lists(st.sampled_from(cells), unique=True, max_size=8))
    changes = [(i, t, j, draw(st.integers(0, TOPK))) for i, t, j in picked]
    return lengths, captured, changes, draw(st.booleans())


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(batch=_batches(), seed=st.integers(0, 2**16))
def test_counts_match_a_set_oracle(
    megatron: CpuMegatron, batch: tuple[list[int], list[int], list[Change], bool], seed: int
) -> None:
    lengths, captured, changes, packed = batch
    routers = _routers(megatron, seed)
    case = _case(routers, lengths, captured, changes, seed)
    mb = _collate(case, packed)
    with replay_schedule(measure_agreement=True) as probe:
        install_replay(mb, routers)
        _forward(routers, *_inputs(case, mb, seed))
    assert probe is not None and probe.agreement == _expected(case)


def _native_by_record(routers: list[Any], hidden: torch.Tensor) -> list[torch.Tensor]:
    """megatron-core's own choice (``RECORD``): the oracle the probe must reproduce."""
    with record_schedule(routers) as rec:
        _forward(routers, hidden, None)
        return list(rec.take().values())


@pytest.mark.parametrize(
    "config",
    [
        {},  # tie-heavy scores: the CPU shortcut must defer ties to the native top-k
        {"moe_router_num_groups": 4, "moe_router_group_topk": 2},  # group-limited top-k
        {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True},
    ],
    ids=["ties", "group_limited", "sigmoid_bias"],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_matches_megatron_native_choice(
    megatron: CpuMegatron, config: dict[str, Any], dtype: torch.dtype
) -> None:
    """Scores in the router's dtype: float32 and bfloat16 take the CPU shortcut's one-scatter
    check as they are, float16 (too narrow for its marks) in float32; all must match
    megatron's choice."""
    megatron.RouterReplay.clear_global_router_replay_instances()
    routers = build_routers(SPEC, MOE, hidden=EXPERTS, seed=3, **config)
    gen = torch.Generator().manual_seed(11)
    tokens = 64
    hidden = torch.randn(tokens, 1, EXPERTS, generator=gen).to(dtype)
    if not config:  # few distinct values: many tied logits
        hidden = torch.randint(0, 3, (tokens, 1, EXPERTS), generator=gen).to(dtype)
        for r in routers:
            with torch.no_grad():
                r.weight.copy_(torch.eye(EXPERTS))
    if "moe_router_enable_expert_bias" in config:
        for r in routers:
            r.expert_bias.copy_(torch.linspace(-0.5, 0.5, EXPERTS))
    native = _native_by_record(routers, hidden)
    targets = [t.clone() for t in native]
    rng = np.random.default_rng(0)
    for j, t in enumerate(targets):
        for row in rng.choice(tokens, 9, replace=False):
            free = np.setdiff1d(np.arange(EXPERTS), t[row].numpy())
            t[row, j % TOPK] = int(rng.choice(free))
        t[rng.integers(tokens)] = t[0].flip(0)  # order only, maybe another row's set
    with replay_schedule(measure_agreement=True) as probe:
        install_replay(targets, num_tokens=tokens)
        out = _forward(routers, hidden, None)
    assert probe is not None
    sets = [
        [(set(n[q].tolist()), set(t[q].tolist())) for q in range(tokens)]
        for n, t in zip(native, targets, strict=True)
    ]
    same = np.array([[a == b for a, b in layer] for layer in sets])
    overlap = np.array([sum(len(a & b) for a, b in layer) for layer in sets])
    want = RouteAgreement(tuple(MOE), TOPK, tokens, same.sum(1), overlap, int(same.all(0).sum()))
    assert probe.agreement == want
    assert probe.agreement.all_identical < tokens
    for (_, rmap), t in zip(out, targets, strict=True):  # replay applied the targets
        assert torch.equal(rmap, torch.zeros_like(rmap).scatter(1, t.long(), True))


def test_unchecked_duplicate_target_is_not_identical(megatron: CpuMegatron) -> None:
    """A target row repeating an expert (only possible with ``check=False``) never equals the
    router's K distinct experts, even when its weakest id ranks exactly K-th."""
    megatron.RouterReplay.clear_global_router_replay_instances()
    routers = build_routers(SPEC, MOE[:1], hidden=EXPERTS)
    with torch.no_grad():
        routers[0].weight.copy_(torch.eye(EXPERTS))
    hidden = torch.arange(EXPERTS, dtype=torch.float32).flip(0).repeat(2, 1, 1)  # top: 0, 1, 2
    targets = [torch.tensor([[0, 0, 2], [2, 1, 0]], dtype=torch.int32)]
    with replay_schedule(measure_agreement=True) as probe:
        install_replay(targets, num_tokens=2, check=False)
        _forward(routers, hidden.reshape(2, 1, EXPERTS), None)
    assert probe is not None
    got = probe.agreement
    assert (got.tokens, got.identical.tolist(), got.overlap.tolist()) == (2, [1], [2 + 3])


def test_calls_that_cannot_be_aligned_raise_on_read(megatron: CpuMegatron) -> None:
    """Layers whose n-th calls route different token counts, or layers replaying different
    numbers of calls, cannot give ``all_identical``: replay runs, reading the agreement raises."""
    megatron.RouterReplay.clear_global_router_replay_instances()
    routers = build_routers(SPEC, MOE[:2], hidden=EXPERTS)
    short, long = torch.randn(4, 1, EXPERTS), torch.randn(6, 1, EXPERTS)
    ids = torch.tensor([[0, 1, 2]], dtype=torch.int32)
    with replay_schedule(measure_agreement=True) as probe:
        install_replay([ids.repeat(4, 1)], routers[:1], num_tokens=4, layers=MOE[:1])
        install_replay([ids.repeat(6, 1)], routers[1:], num_tokens=6, layers=MOE[1:2])
        (_, m0), (_, m1) = _forward(routers[:1], short, None) + _forward(routers[1:], long, None)
    assert m0.shape == (4, EXPERTS) and m1.shape == (6, EXPERTS)  # replay itself ran
    assert probe is not None
    with pytest.raises(ReplayError, match="call 0 to route the 4 tokens"):
        _ = probe.agreement
    with replay_schedule(measure_agreement=True) as uneven:
        install_replay([ids.repeat(4, 1)] * 2, num_tokens=4)
        _forward(routers, short, None)
        _forward(routers[:1], short, None)
    assert uneven is not None
    with pytest.raises(ReplayError, match=r"same number of calls.*calls \[2, 1\]"):
        _ = uneven.agreement


@st.composite
def _score_rows(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Scores (few distinct values: ties across the K-th place; sometimes a NaN), targets
    (the native choice, reordered, partly or wholly replaced, repeating ids) and a mask."""
    tokens, experts = draw(st.integers(1, 40)), draw(st.integers(2, 24))
    k = draw(st.integers(1, experts - 1))
    levels = draw(st.integers(2, 40))
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.bfloat16, torch.float16]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    scores = (torch.randint(0, levels, (tokens, experts), generator=gen) / levels - 0.5).to(dtype)
    if draw(st.booleans()):
        scores[draw(st.integers(0, tokens - 1)), draw(st.integers(0, experts - 1))] = float("nan")
    target = torch.topk(scores, k, dim=1).indices
    kind = draw(st.sampled_from(["native", "order", "swap", "some", "random"]))
    if kind == "order":
        target = target[:, torch.randperm(k, generator=gen)]
    elif kind == "swap":  # a few of the native experts replaced by others (any rank)
        for row in range(tokens):
            others = torch.randperm(experts, generator=gen)
            others = others[~torch.isin(others, target[row])]
            n = min(int(torch.randint(0, 4, (1,), generator=gen)), len(others), k)
            slots = torch.randperm(k, generator=gen)[:n]
            target[row, slots] = others[:n]
    elif kind != "native":
        rows = torch.rand(tokens, generator=gen) < (0.3 if kind == "some" else 1.0)
        target[rows] = torch.randint(0, experts, (int(rows.sum()), k), generator=gen)
    pad = torch.rand(tokens, generator=gen) < 0.2 if draw(st.booleans()) else None
    return scores, target.to(draw(st.sampled_from([torch.int32, torch.int64]))), pad


@settings(max_examples=150, deadline=None)
@given(case=_score_rows())
def test_overlap_rows_match_megatron_topk(
    case: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
) -> None:
    """The probe's per-token ``|N ∩ R|`` row (numba kernel or torch path, ties and NaN left
    to the native top-k) equals a direct set comparison with the native top-k (megatron's
    ``compute_topk`` without groups is ``torch.topk(scores, k, dim=1)``, its tie-breaking)."""
    from r3arrow.megatron import _probe

    def _compute_topk(
        s: torch.Tensor, k: int, num_groups: int | None = None, group_topk: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        values, indices = torch.topk(s, k=k, dim=1)
        return values, indices

    scores, target, pad = case
    k = int(target.shape[1])
    native = _compute_topk(scores, k)[1]
    want = torch.tensor(
        [len(set(n.tolist()) & set(t.tolist())) for n, t in zip(native, target, strict=True)],
        dtype=torch.int8,
    )
    if pad is not None:
        want.masked_fill_(pad, -1)
    replayed = (scores.gather(1, target.long()), target)
    row = _probe._overlap_row(scores, replayed, k, (None, None), _compute_topk, pad)
    assert torch.equal(row, want)
