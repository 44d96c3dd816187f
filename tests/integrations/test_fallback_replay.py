"""Route-local fallback on the trainer side with real megatron-core routers (CPU, gloo).

A rollout table whose ``routes_missing`` marks some tokens (their route rows hold
placeholders, ids ``0..K-1``) is collated: `Microbatch.fallback_mask` marks exactly those
tokens in every layout (packed, unpacked, context parallel, sequence parallel), with counts
of fallback token routes. ``install_replay(..., missing="native")`` lets each router choose
exactly the marked tokens itself (the native top-k of a pass without replay, incl.
group-limited routing and the expert bias) while every other token replays its target; the
aux loss stays finite and the ``REPLAY_BACKWARD`` recompute routes as the forward did.
``missing="error"`` (the default) refuses such a microbatch; a table without marks takes
exactly today's path.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
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

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from r3arrow import RouteSpec, write_rollouts  # noqa: E402
from r3arrow._schema import MISSING_KEY, ROUTES_MISSING, placeholder_rows  # noqa: E402
from r3arrow.collate import (  # noqa: E402
    MegatronCollator,
    Microbatch,
    Parallelism,
    collate_directory,
)
from r3arrow.errors import ReplayError  # noqa: E402
from r3arrow.megatron import (  # noqa: E402
    install_replay,
    replay_backward,
    replay_schedule,
)
from r3arrow.microbatch import padding_table  # noqa: E402
from r3arrow.stats import r3_metrics, route_fallback  # noqa: E402
from r3arrow.table import rollout_table  # noqa: E402
from r3arrow.testing.megatron import (  # noqa: E402
    CpuMegatron,
    aux_loss_values,
    build_routers,
    cpu_router_harness,
)

HIDDEN, EXPERTS, TOPK, COEFF = 16, 8, 2, 0.01
SPEC = RouteSpec(num_layers=3, topk=TOPK, num_experts=EXPERTS, moe_layers=(0, 2))
MOE = [0, 2]
LENGTHS = [9, 6, 7]  # prompt 2 + response
CAPTURED = [8, 6, 4]
#: the marked (missing) token positions of each trajectory, within its captured rows
MARKED = [[1, 6], [], [0, 1, 3]]


@pytest.fixture(scope="module")
def megatron() -> Iterator[CpuMegatron]:
    with cpu_router_harness() as meg:
        yield meg


def _clear_aux(moe_utils: Any) -> None:
    if hasattr(moe_utils, "get_moe_metrics_tracker"):
        moe_utils.get_moe_metrics_tracker().clear()
    else:
        moe_utils.clear_aux_losses_tracker()


def _routers(meg: CpuMegatron, seed: int = 0, **config: Any) -> list[Any]:
    meg.RouterReplay.clear_global_router_replay_instances()
    return build_routers(SPEC, MOE, hidden=HIDDEN, seed=seed, **config)


def _routes(rng: np.random.Generator, n: int) -> np.ndarray:
    """[n, L, K] routes whose first id on every router layer is >= K: never a placeholder."""
    r = np.zeros((n, SPEC.num_layers, TOPK), dtype=np.uint8)
    for g in MOE:
        for t in range(n):
            first = rng.integers(TOPK, EXPERTS)
            rest = rng.choice(np.setdiff1d(np.arange(EXPERTS), [first]), TOPK - 1, replace=False)
            r[t, g] = [first, *rest]
    return r


def _table(
    marked: Sequence[Sequence[int]] | None = MARKED,
    lengths: Sequence[int] = LENGTHS,
    captured: Sequence[int] = CAPTURED,
    seed: int = 0,
) -> pa.Table:
    """A rollout table; ``marked``: each trajectory's missing tokens (placeholder rows and a
    ``routes_missing`` column with the metadata key), None: no marks column."""
    rng = np.random.default_rng(seed)
    routes = [_routes(rng, c) for c in captured]
    marks = []
    for i, c in enumerate(captured):
        m = np.zeros(c, dtype=np.uint8)
        if marked is not None and marked[i]:
            m[list(marked[i])] = 1
            routes[i][m == 1] = placeholder_rows(SPEC, int(m.sum()))
        marks.append(m.tolist())
    table = rollout_table(
        trajectory_id=[f"t{i}" for i in range(len(lengths))],
        group_id=["g"] * len(lengths),
        prompt_ids=[[1, 2] for _ in lengths],
        response_ids=[rng.integers(3, 50, n - 2).tolist() for n in lengths],
        loss_mask=[
            [int(2 + j <= c) for j in range(n - 2)] for n, c in zip(lengths, captured, strict=True)
        ],
        reward=[0.0] * len(lengths),
        routes=routes,
        spec=SPEC,
    )
    if marked is None:
        return table
    col = pa.array(marks, type=pa.large_list(pa.uint8()))
    table = table.append_column(pa.field(ROUTES_MISSING, col.type), col)
    return table.replace_schema_metadata({**(table.schema.metadata or {}), MISSING_KEY: b"1"})


def _rows(mb: Microbatch, mask: torch.Tensor) -> torch.Tensor:
    """A ``[b, S]`` mask in the routers' token order (flat ``s * b + b_idx``), this TP rank's
    slice under sequence parallelism."""
    rows = mask.transpose(0, 1).reshape(-1)
    n = mb.num_router_tokens
    return rows[mb.tp_rank * n : (mb.tp_rank + 1) * n] if mb.sequence_parallel else rows


def _hidden(mb: Microbatch, seed: int = 1) -> torch.Tensor:
    """Random ``[s, b, H]`` hidden states of this rank's routers (its SP slice)."""
    gen = torch.Generator().manual_seed(seed)
    b, s = (int(d) for d in mb.input_ids.shape)
    if mb.sequence_parallel:
        s //= mb.tp_size
    return torch.randn(s, b, HIDDEN, generator=gen)


def _route(routers: list[Any], hidden: torch.Tensor, pad: torch.Tensor) -> list[Any]:
    return [r(hidden, padding_mask=pad) for r in routers]


def _target_map(target: torch.Tensor) -> torch.Tensor:
    return torch.zeros(target.shape[0], EXPERTS, dtype=torch.bool).scatter(1, target.long(), True)


LAYOUTS = [
    pytest.param({"packed": True}, id="packed"),
    pytest.param({"packed": False}, id="unpacked"),
    pytest.param({"packed": True, "cp": 2}, id="packed-cp2"),
    pytest.param({"packed": False, "cp": 2, "align": 3}, id="unpacked-cp2-align3"),
    pytest.param({"packed": True, "tp": 2}, id="packed-sp2"),
    pytest.param({"packed": False, "cp": 2, "tp": 2}, id="unpacked-cp2-sp2"),
]


@st.composite
def _cases(draw: st.DrawFn) -> tuple[list[int], list[int], list[list[int]]]:
    """(lengths, captured, marked tokens) of 1..4 trajectories."""
    n = draw(st.integers(1, 4))
    lengths = draw(st.lists(st.integers(3, 12), min_size=n, max_size=n))
    captured = [draw(st.integers(1, length)) for length in lengths]
    marked = [sorted(draw(st.sets(st.integers(0, c - 1)))) for c in captured]
    return lengths, captured, marked


@given(case=_cases(), layout=st.sampled_from(LAYOUTS), seed=st.integers(0, 2**16))
@settings(max_examples=40, deadline=None)
def test_mask_marks_exactly_the_placeholder_rows(
    case: tuple[list[int], list[int], list[list[int]]], layout: Any, seed: int
) -> None:
    """Unmarked routes never start with id 0 and marked ones hold placeholders: the mask is
    exactly where layer_major holds a placeholder off padding, in every layout, and the
    ranks' counts add up to the marked tokens times the router layers."""
    lengths, captured, marked = case
    options = layout.values[0]
    table = _table(marked, lengths, captured, seed=seed)
    cp, tp = int(options.get("cp", 1)), int(options.get("tp", 1))
    total_fb = total_tok = 0
    for c in range(cp):
        for t in range(tp):
            par = Parallelism(
                cp_size=cp, cp_rank=c, tp_size=tp, tp_rank=t, sequence_parallel=tp > 1
            )
            mb = MegatronCollator(
                SPEC, packed=options["packed"], align=options.get("align", 1), parallel=par
            )(table)
            assert mb.fallback_mask is not None and mb.layer_major is not None
            assert mb.fallback_mask.dtype == torch.bool
            assert mb.fallback_mask.shape == mb.padding_mask.shape
            placeholder = (mb.layer_major[0] == torch.arange(TOPK, dtype=torch.int32)).all(-1)
            want = placeholder.transpose(0, 1) & ~mb.padding_mask  # [C, P]
            assert torch.equal(mb.fallback_mask, want)
            total_fb += mb.fallback_routes
            total_tok += mb.token_routes  # SP: each TP rank counts its slice only
    assert total_fb == sum(map(len, marked)) * len(MOE)
    assert total_tok == sum(captured) * len(MOE)


def test_padding_microbatch_marks_nothing() -> None:
    """A DP padding table of a marked table collates (its marks are empty, not null)."""
    mb = MegatronCollator(SPEC, packed=True)(padding_table(_table()))
    assert mb.is_padding and mb.fallback_mask is not None and not mb.fallback_mask.any()
    assert (mb.fallback_routes, mb.token_routes) == (0, 0)


def test_fraction_hand_computed() -> None:
    """Literal counts: 5 marked of 18 captured tokens, 2 router layers; a second microbatch
    without marks (4 + 3 captured tokens) adds to the denominator only."""
    marked = MegatronCollator(SPEC, packed=True)(_table())
    plain = MegatronCollator(SPEC, packed=False)(_table(None, [5, 4], [4, 3]))
    assert (marked.fallback_routes, marked.token_routes) == (10, 36)
    assert (plain.fallback_routes, plain.token_routes) == (0, 14)
    assert plain.fallback_mask is None
    fraction = (marked.fallback_routes + plain.fallback_routes) / (
        marked.token_routes + plain.token_routes
    )
    assert fraction == pytest.approx(10 / 50)
    assert route_fallback(_table()).fraction == pytest.approx(marked.fallback_routes / 36)
    metrics = r3_metrics(fallback_token_route_fraction=fraction)
    assert metrics["r3/fallback_token_route_fraction"] == pytest.approx(0.2)
    # a dense-only stage has no routers: nothing falls back there
    dense = MegatronCollator(SPEC, layers=[], packed=True)(_table())
    assert (dense.fallback_routes, dense.token_routes) == (0, 0)


CONFIGS = [
    pytest.param({}, id="softmax"),
    pytest.param({"moe_router_num_groups": 4, "moe_router_group_topk": 2}, id="group_limited"),
    pytest.param(
        {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True},
        id="sigmoid_bias",
    ),
    pytest.param({"moe_router_pre_softmax": True}, id="pre_softmax"),
]


RANKS = [
    pytest.param(True, Parallelism(), id="packed"),
    pytest.param(False, Parallelism(), id="unpacked"),
    pytest.param(True, Parallelism(cp_size=2, cp_rank=1), id="packed-cp2-rank1"),
    pytest.param(
        False, Parallelism(tp_size=2, tp_rank=1, sequence_parallel=True), id="unpacked-sp2-rank1"
    ),
]


@pytest.mark.parametrize(("packed", "parallel"), RANKS)
@pytest.mark.parametrize("config", CONFIGS)
def test_native_on_marked_tokens_targets_elsewhere(
    megatron: CpuMegatron, config: dict[str, Any], packed: bool, parallel: Parallelism
) -> None:
    routers = _routers(megatron, seed=2, **config)
    if "moe_router_enable_expert_bias" in config:
        for r in routers:
            r.expert_bias.copy_(torch.linspace(-0.5, 0.5, EXPERTS))
    mb = MegatronCollator(SPEC, packed=packed, align=4, parallel=parallel)(_table())
    hidden, pad = _hidden(mb), _rows(mb, mb.padding_mask)
    with torch.no_grad():
        native = _route(routers, hidden, pad)  # no schedule: megatron routes freely
        with replay_schedule():
            targets = install_replay(mb, routers, missing="native")
            got = _route(routers, hidden, pad)
    assert mb.fallback_mask is not None
    fb = _rows(mb, mb.fallback_mask)
    assert int(fb.sum()) * len(MOE) == mb.fallback_routes > 0
    differs = 0
    for (n_probs, n_map), (probs, rmap), t in zip(native, got, targets, strict=True):
        assert torch.equal(rmap[fb], n_map[fb])  # the router's own top-k
        assert torch.equal(probs[fb], n_probs[fb])
        assert torch.equal(rmap[~fb], _target_map(t)[~fb])  # every other token replays
        differs += int((n_map[fb] != _target_map(t)[fb]).any(-1).sum())
    assert differs > 0  # the placeholders would have routed those tokens elsewhere


def test_recompute_and_aux_loss(megatron: CpuMegatron) -> None:
    """Two microbatches with different marks, training mode, aux loss: the forward and the
    REPLAY_BACKWARD recompute route identically (each target keeps its own fallback rows),
    the aux loss is finite and gradients flow."""
    routers = _routers(
        megatron, seed=5, moe_router_load_balancing_type="aux_loss", moe_aux_loss_coeff=COEFF
    )
    for r in routers:
        r.train()
    _clear_aux(megatron.moe_utils)
    mb_a = MegatronCollator(SPEC, packed=True, reuse_buffers=False)(_table())
    mb_b = MegatronCollator(SPEC, packed=False, reuse_buffers=False)(
        _table([[0], [2, 3], []], seed=3)
    )
    in_a = (_hidden(mb_a, 1).requires_grad_(), _rows(mb_a, mb_a.padding_mask))
    in_b = (_hidden(mb_b, 2).requires_grad_(), _rows(mb_b, mb_b.padding_mask))
    with replay_schedule():
        install_replay(mb_a, routers, missing="native")
        first_a = _route(routers, *in_a)
        install_replay(mb_b, routers, missing="native")
        first_b = _route(routers, *in_b)
        with replay_backward():
            again_a = _route(routers, *in_a)
            again_b = _route(routers, *in_b)
        loss = sum(p.sum() for p, _ in first_a + first_b)
        assert isinstance(loss, torch.Tensor)
        loss.backward()  # type: ignore[no-untyped-call]
    for first, again in ((first_a, again_a), (first_b, again_b)):
        for (p1, m1), (p2, m2) in zip(first, again, strict=True):
            assert torch.equal(m1, m2)
            assert torch.equal(p1, p2)
    assert in_a[0].grad is not None and torch.isfinite(in_a[0].grad).all()
    values = aux_loss_values(megatron.moe_utils)
    assert torch.isfinite(values).all() and float(values[MOE].sum()) > 0
    # the fallback rows really route natively: recomputing without replay agrees there
    with torch.no_grad():
        native_b = _route(routers, in_b[0].detach(), in_b[1])
    assert mb_b.fallback_mask is not None
    fb = _rows(mb_b, mb_b.fallback_mask)
    for (_, n_map), (_, m) in zip(native_b, first_b, strict=True):
        assert torch.equal(m[fb], n_map[fb])


def test_recompute_replays_the_forward_choice(megatron: CpuMegatron) -> None:
    """The recompute replays what the forward chose on the fallback rows even when its
    scores differ (here: other hidden states, under which the native choice moves)."""
    routers = _routers(megatron, seed=8)
    mb = MegatronCollator(SPEC, packed=True)(_table())
    hidden, pad = _hidden(mb, 1), _rows(mb, mb.padding_mask)
    other = _hidden(mb, 2)
    assert mb.fallback_mask is not None
    fb = _rows(mb, mb.fallback_mask)
    with torch.no_grad():
        moved = _route(routers, other, pad)  # the native choice under the other states
        with replay_schedule():
            install_replay(mb, routers, missing="native")
            first = _route(routers, hidden, pad)
            with replay_backward():
                again = _route(routers, other, pad)
    changed = 0
    for (_, m1), (_, m2), (_, n) in zip(first, again, moved, strict=True):
        assert torch.equal(m1, m2)
        changed += int((n[fb] != m1[fb]).any(-1).sum())
    assert changed > 0  # a recomputed native top-k would have routed otherwise


def test_error_refuses_and_names_the_sequences(megatron: CpuMegatron) -> None:
    routers = _routers(megatron)
    mb = MegatronCollator(SPEC, packed=True)(_table())
    with replay_schedule():
        with pytest.raises(
            ReplayError,
            match=r"found 5 tokens whose rollout route is missing .* sequences \[0, 2\].*"
            r"missing='native'",
        ):
            install_replay(mb, routers)
        assert all(r.router_replay.target_topk_idx is None for r in routers)
    cp1 = MegatronCollator(SPEC, packed=True, parallel=Parallelism(cp_size=2, cp_rank=1))(_table())
    # CP rank 1 holds chunks 1 and 2 of 4: tokens 3..8 of sequence 0 (12 padded, marked 6)
    # and 2..5 of sequence 2 (8 padded, marked 3)
    with replay_schedule(), pytest.raises(ReplayError, match=r"found 2 tokens .*\[0, 2\]"):
        install_replay(cp1, routers)
    with replay_schedule(), pytest.raises(ValueError, match="missing"):
        install_replay(mb, routers, missing="skip")  # type: ignore[arg-type]


def test_no_marks_is_todays_path(megatron: CpuMegatron) -> None:
    """No marks column, or one with no mark: the same targets and routing under both
    policies, and the classes are never patched."""
    routers = _routers(megatron, seed=4)
    rr = megatron.RouterReplay
    original = rr.__dict__["get_replay_topk"]
    plain = MegatronCollator(SPEC, packed=True)(_table(None))
    zero = MegatronCollator(SPEC, packed=True)(_table([[], [], []]))
    assert plain.fallback_mask is None and zero.fallback_mask is not None
    assert zero.fallback_routes == 0 and not zero.fallback_mask.any()
    hidden, pad = _hidden(plain), _rows(plain, plain.padding_mask)
    maps = []
    with torch.no_grad():
        for mb in (plain, zero):
            for missing in ("error", "native"):
                with replay_schedule():
                    install_replay(mb, routers, missing=missing)
                    assert rr.__dict__["get_replay_topk"] is original
                    maps.append([m for _, m in _route(routers, hidden, pad)])
    for other in maps[1:]:
        for a, b in zip(maps[0], other, strict=True):
            assert torch.equal(a, b)


def test_probe_leaves_fallback_tokens_out(megatron: CpuMegatron) -> None:
    """With the probe open too, fallback tokens are neither replayed nor counted; the class
    patch is gone after the schedule."""
    routers = _routers(megatron, seed=6)
    rr = megatron.RouterReplay
    original = rr.__dict__["get_replay_topk"]
    mb = MegatronCollator(SPEC, packed=True)(_table())
    hidden, pad = _hidden(mb), _rows(mb, mb.padding_mask)
    with torch.no_grad(), replay_schedule(measure_agreement=True) as probe:
        install_replay(mb, routers, missing="native")
        assert rr.__dict__["get_replay_topk"] is not original
        _route(routers, hidden, pad)
    assert rr.__dict__["get_replay_topk"] is original
    assert probe is not None
    assert probe.agreement.tokens == sum(CAPTURED) - 5


def test_marks_survive_parquet_and_collate_directory(tmp_path: Path) -> None:
    """A marked table written and streamed back by `collate_directory` gives the mask and
    the counts of collating it in memory."""
    table = _table()
    write_rollouts(table, tmp_path, step=0)
    collator = MegatronCollator(SPEC, packed=True)
    want = collator(table)
    ((step, got),) = list(collate_directory(tmp_path, collator, num_microbatches=1))
    assert step == 0 and got.fallback_mask is not None and want.fallback_mask is not None
    assert torch.equal(got.fallback_mask, want.fallback_mask)
    assert (got.fallback_routes, got.token_routes) == (want.fallback_routes, want.token_routes)
