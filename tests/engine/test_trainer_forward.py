"""`TinyMoE.trainer_logprobs`: the embedded model's trainer-side bfloat16 forward, with its own
routing or with replayed routes (the demo's stage 7, ``docs/mismatch.md`` "The demo")."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from r3arrow.errors import DuplicateExpertError, ExpertRangeError
from r3arrow.testing.engine import ReferenceEngine, TinyMoEConfig

SEQ = np.random.default_rng(11).integers(0, 512, 240)


@pytest.fixture(scope="module")
def engine() -> ReferenceEngine:
    return ReferenceEngine(TinyMoEConfig())


def engine_logprobs(engine: ReferenceEngine, seq: torch.Tensor) -> torch.Tensor:
    """The engine's own (float64) log-prob of every next token of ``seq``."""
    logits, _ = engine.model(seq[:-1])
    out: torch.Tensor = logits.log_softmax(-1).gather(-1, seq[1:, None])[:, 0]
    return out


def differing(a: torch.Tensor, b: torch.Tensor, layers: list[int]) -> np.ndarray:
    """Per token: whether the top-k sets (order ignored) differ on any of ``layers``."""
    sa = np.sort(a[:, layers].numpy(), axis=-1)
    sb = np.sort(b[:, layers].numpy(), axis=-1)
    return np.asarray((sa != sb).any(axis=(1, 2)))


def test_replayed_routes_are_used_and_native_bfloat16_routing_flips_some(
    engine: ReferenceEngine,
) -> None:
    seq = torch.from_numpy(SEQ)
    moe = list(engine.config.moe_layers)
    rollout = torch.from_numpy(engine.routes_for(SEQ)[:-1].astype(np.int64))
    want = engine_logprobs(engine, seq)
    lp_n, native = engine.model.trainer_logprobs(seq[:-1], seq[1:])
    lp_r, replayed = engine.model.trainer_logprobs(seq[:-1], seq[1:], routes=rollout)
    assert lp_n.dtype == lp_r.dtype == torch.float32 and lp_n.shape == (239,)
    assert native.dtype == torch.int64 and native.shape == (239, 4, 2)
    # replay: exactly the forced experts, in their order; dense layer 0 routes nothing
    assert torch.equal(replayed[:, moe], rollout[:, moe])
    assert not replayed[:, 0].any() and not native[:, 0].any()
    # bfloat16 routers pick other experts where the top-k boundary is near-tied, not often
    flips = differing(native, rollout, moe).mean()
    assert 0 < flips < 0.1
    # both close to the engine's float64 log-probs: bfloat16 rounding (8 mantissa bits), and
    # a few flipped experts natively (which pass is closer on a random sequence is not fixed;
    # on the demo's rollouts replay is, tests/integrations/test_demo.py)
    for lp in (lp_n, lp_r):
        err = (lp.double() - want).abs()
        assert float(err.max()) < 0.2 and float(err.mean()) < 0.02
    assert not torch.equal(lp_n, lp_r)


def test_forcing_the_native_choice_reproduces_the_native_pass(engine: ReferenceEngine) -> None:
    """Replay gathers the router's own scores at the forced experts, so forcing the experts
    the routers chose themselves changes nothing, to the bit."""
    seq = torch.from_numpy(SEQ[:90])
    lp_n, native = engine.model.trainer_logprobs(seq[:-1], seq[1:])
    lp_f, forced = engine.model.trainer_logprobs(seq[:-1], seq[1:], routes=native)
    assert torch.equal(lp_f, lp_n) and torch.equal(forced, native)


def test_other_forced_experts_change_the_log_probs(engine: ReferenceEngine) -> None:
    seq = torch.from_numpy(SEQ[:40])
    moe = list(engine.config.moe_layers)
    routes = torch.zeros(39, 4, 2, dtype=torch.int32)
    routes[:, moe] = torch.tensor([5, 3], dtype=torch.int32)  # dense layer 0: ignored
    lp_n, _ = engine.model.trainer_logprobs(seq[:-1], seq[1:])
    lp_f, used = engine.model.trainer_logprobs(seq[:-1], seq[1:], routes=routes)
    assert (used[:, moe] == torch.tensor([5, 3])).all()
    assert float((lp_f - lp_n).abs().max()) > 0.01


def test_the_engine_stays_float64_and_the_bfloat16_copy_is_no_submodule() -> None:
    engine = ReferenceEngine(TinyMoEConfig())  # fresh: no trainer pass ran on it yet
    before = engine.generate(SEQ[:12].tolist(), max_tokens=5, logprobs=True)
    names = [n for n, _ in engine.model.named_parameters()]
    seq = torch.from_numpy(SEQ[:20])
    engine.model.trainer_logprobs(seq[:-1], seq[1:])
    assert [n for n, _ in engine.model.named_parameters()] == names
    assert all(p.dtype == torch.float64 for p in engine.model.parameters())
    assert set(engine.model.state_dict()) == set(names)
    after = engine.generate(SEQ[:12].tolist(), max_tokens=5, logprobs=True)
    assert after.token_ids == before.token_ids and after.logprobs == before.logprobs
    assert before.routed_experts is not None and after.routed_experts is not None
    np.testing.assert_array_equal(after.routed_experts, before.routed_experts)


def test_misuse_and_bad_replayed_ids(engine: ReferenceEngine) -> None:
    model = engine.model
    seq = torch.from_numpy(SEQ[:10])
    ok = torch.zeros(9, 4, 2, dtype=torch.int64)
    ok[:, 1:] = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="one length"):
        model.trainer_logprobs(seq[:-1], seq[2:])
    with pytest.raises(ValueError, match="labels: expected a 1-D int64"):
        model.trainer_logprobs(seq[:-1], seq[1:].float())
    with pytest.raises(ValueError, match=r"token_ids: expected ids in \[0, 512\)"):
        model.trainer_logprobs(seq[:-1] + 600, seq[1:])
    with pytest.raises(
        ValueError, match=r"routes: expected an integer tensor of shape \[9, 4, 2\]"
    ):
        model.trainer_logprobs(seq[:-1], seq[1:], routes=ok[:8])
    with pytest.raises(ValueError, match="routes: expected an integer tensor"):
        model.trainer_logprobs(seq[:-1], seq[1:], routes=ok.float())
    bad = ok.clone()
    bad[4, 2, 1] = 8
    with pytest.raises(ExpertRangeError) as rng_err:
        model.trainer_logprobs(seq[:-1], seq[1:], routes=bad)
    assert (rng_err.value.token, rng_err.value.layer) == (4, 2)
    dup = ok.clone()
    dup[6, 3] = torch.tensor([2, 2])
    with pytest.raises(DuplicateExpertError) as dup_err:
        model.trainer_logprobs(seq[:-1], seq[1:], routes=dup)
    assert (dup_err.value.token, dup_err.value.layer) == (6, 3)
