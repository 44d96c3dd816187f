"""The embedded reference engine: model determinism and causality, vLLM's row semantics,
the HTTP schema (as observed on a real vLLM 0.32.0, see docs/vllm-schema.md),
fault injection and concurrency."""

from __future__ import annotations

import base64
import io
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from r3arrow.errors import EngineRequestError
from r3arrow.testing.engine import (
    EngineServer,
    Fault,
    FaultPlan,
    ReferenceEngine,
    TinyMoE,
    TinyMoEConfig,
    corrupt_routes,
    drift_prompt,
)

GEN = "/inference/v1/generate"
CMPL = "/v1/completions"
PROMPT = [(7 * i + 3) % 512 for i in range(20)]
START = "routed_experts_prompt_start"


@pytest.fixture(scope="module")
def engine() -> ReferenceEngine:
    return ReferenceEngine(TinyMoEConfig())


@pytest.fixture(scope="module")
def server(engine: ReferenceEngine) -> Iterator[EngineServer]:
    with EngineServer(engine) as srv:
        yield srv


@pytest.fixture
def client(server: EngineServer) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=30) as c:
        yield c


def decode(b64: str) -> np.ndarray:
    arr: np.ndarray = np.load(io.BytesIO(base64.b64decode(b64, validate=True)), allow_pickle=False)
    return arr


def gen_body(prompt: list[int], **sp: Any) -> dict[str, Any]:
    return {"token_ids": prompt, "sampling_params": {"temperature": 0.0, **sp}}


# ------------------------------------------------------------------ model
def test_config_route_spec_maps_dense_layers() -> None:
    cfg = TinyMoEConfig(num_layers=5, dense_layers=(0, 3))
    spec = cfg.route_spec()
    assert (spec.num_layers, spec.topk, spec.num_experts) == (5, 2, 8)
    assert spec.router_layers == (1, 2, 4)
    assert spec.dense_layers == (0, 3)
    assert spec.dtype == np.uint8
    with pytest.raises(ValueError, match="at least one MoE layer"):
        TinyMoEConfig(num_layers=2, dense_layers=(0, 1))
    with pytest.raises(ValueError, match="topk <= num_experts"):
        TinyMoEConfig(num_experts=2, topk=3)
    with pytest.raises(ValueError, match="dense_layers"):
        TinyMoEConfig(dense_layers=(4,))


def test_forward_shapes_dense_rows_zero_and_distinct_experts(engine: ReferenceEngine) -> None:
    ids = torch.arange(37, dtype=torch.int64) * 13 % 512
    logits, routes = engine.model(ids)
    assert logits.shape == (37, 512)
    assert routes.shape == (37, 4, 2) and routes.dtype == torch.int64
    assert isinstance(engine.model, TinyMoE)
    assert torch.all(routes[:, 0] == 0)  # dense layer 0 has no router
    moe = routes[:, 1:]
    assert torch.all((moe >= 0) & (moe < 8))
    assert torch.all(moe[..., 0] != moe[..., 1])
    # varied routing: every expert is used somewhere
    assert set(moe.flatten().tolist()) == set(range(8))
    np.testing.assert_array_equal(engine.routes_for(ids.tolist()), routes.numpy().astype(np.uint8))


def test_same_seed_same_model_other_seed_other_routes() -> None:
    a, b = ReferenceEngine(TinyMoEConfig(seed=3)), ReferenceEngine(TinyMoEConfig(seed=3))
    c = ReferenceEngine(TinyMoEConfig(seed=4))
    ra, rb = a.generate(PROMPT, max_tokens=6), b.generate(PROMPT, max_tokens=6)
    assert ra.token_ids == rb.token_ids
    assert ra.routed_experts is not None and rb.routed_experts is not None
    np.testing.assert_array_equal(ra.routed_experts, rb.routed_experts)
    assert not np.array_equal(a.routes_for(PROMPT), c.routes_for(PROMPT))


def test_sampling_is_deterministic_per_seed(engine: ReferenceEngine) -> None:
    runs = [engine.generate(PROMPT, max_tokens=12, temperature=1.0, seed=s) for s in (5, 5, 6)]
    assert runs[0].token_ids == runs[1].token_ids
    assert runs[0].token_ids != runs[2].token_ids
    assert runs[0].routed_experts is not None and runs[1].routed_experts is not None
    np.testing.assert_array_equal(runs[0].routed_experts, runs[1].routed_experts)


@settings(max_examples=15)
@given(
    tokens=st.lists(st.integers(0, 511), min_size=2, max_size=160),
    cut=st.floats(0.0, 1.0, exclude_max=True),
)
def test_routing_is_causal(engine: ReferenceEngine, tokens: list[int], cut: float) -> None:
    n = 1 + int(cut * (len(tokens) - 1))
    np.testing.assert_array_equal(engine.routes_for(tokens[:n]), engine.routes_for(tokens)[:n])


def test_float32_model_is_supported_and_causal() -> None:
    eng = ReferenceEngine(TinyMoEConfig(dtype="float32", seed=1))
    assert eng.model.embed.dtype == torch.float32
    toks = [(11 * i) % 512 for i in range(64)]
    np.testing.assert_array_equal(eng.routes_for(toks[:40]), eng.routes_for(toks)[:40])


# --------------------------------------------------------- row semantics
def test_generate_rows_literal_prompt_start_zero(engine: ReferenceEngine) -> None:
    prompt = [5, 17, 300, 42, 9]  # P = 5
    res = engine.generate(prompt, max_tokens=3, routed_experts_prompt_start=0)
    assert len(res.token_ids) == 3 and res.finish_reason == "length"
    assert res.routed_experts is not None
    assert res.routed_experts.shape == (7, 4, 2)  # P - 0 + G - 1
    assert res.routed_experts.dtype == np.uint8
    full = engine.routes_for(prompt + res.token_ids)  # 8 rows; the last token never ran
    np.testing.assert_array_equal(res.routed_experts, full[:7])


@pytest.mark.parametrize("start", [1, 3, 4])
def test_generate_rows_literal_prompt_start_k(engine: ReferenceEngine, start: int) -> None:
    prompt = [5, 17, 300, 42, 9]
    res = engine.generate(prompt, max_tokens=3, routed_experts_prompt_start=start)
    full = engine.routes_for(prompt + res.token_ids)
    assert res.routed_experts is not None
    assert res.routed_experts.shape[0] == 5 - start + 3 - 1
    np.testing.assert_array_equal(res.routed_experts, full[start:7])


def test_prompt_start_equal_to_prompt_length_returns_generated_rows_like_vllm(
    engine: ReferenceEngine,
) -> None:
    # vLLM 0.32.0 accepts start == P ("between 0 and the prompt length, inclusive").
    prompt = [5, 17, 300, 42, 9]
    res = engine.generate(prompt, max_tokens=3, routed_experts_prompt_start=5)
    assert res.routed_experts is not None and res.routed_experts.shape == (2, 4, 2)
    np.testing.assert_array_equal(
        res.routed_experts, engine.routes_for(prompt + res.token_ids)[5:7]
    )
    one = engine.generate(prompt, max_tokens=1, routed_experts_prompt_start=5)
    assert one.routed_experts is not None and one.routed_experts.shape == (0, 4, 2)


@pytest.mark.parametrize("start", [6, -1, 2.0, True])
def test_prompt_start_out_of_range_is_rejected(engine: ReferenceEngine, start: Any) -> None:
    with pytest.raises(EngineRequestError, match="routed_experts_prompt_start") as info:
        engine.generate([5, 17, 300, 42, 9], max_tokens=2, routed_experts_prompt_start=start)
    assert info.value.param == "routed_experts_prompt_start"


def test_single_token_generation_and_no_routes(engine: ReferenceEngine) -> None:
    res = engine.generate([7], max_tokens=1)  # P + G - 1 = 1
    assert res.routed_experts is not None and res.routed_experts.shape == (1, 4, 2)
    assert engine.generate([7, 8], max_tokens=2, return_routed_experts=False).routed_experts is None


def test_incremental_capture_over_turns_matches_full_sequence(engine: ReferenceEngine) -> None:
    """The R3 protocol: each turn sends the whole conversation with start = rows held."""
    tokens = list(PROMPT)
    captured: list[np.ndarray] = []
    held = 0
    for turn in range(4):
        res = engine.generate(tokens, max_tokens=3 + turn, routed_experts_prompt_start=held)
        assert res.routed_experts is not None
        assert res.routed_experts.shape[0] == len(tokens) - held + len(res.token_ids) - 1
        captured.append(res.routed_experts)
        held += res.routed_experts.shape[0]
        tokens += [*res.token_ids, 100 + turn, 200 + turn]  # observation tokens
    rows = np.concatenate(captured)
    assert rows.shape[0] == held < len(tokens)
    np.testing.assert_array_equal(rows, engine.routes_for(tokens)[:held])


def test_stop_tokens_eos_and_min_tokens() -> None:
    free = ReferenceEngine(TinyMoEConfig())
    greedy = free.generate(PROMPT, max_tokens=6)
    stop = greedy.token_ids[2]
    first = greedy.token_ids.index(stop)  # the first time the greedy path samples it
    res = free.generate(PROMPT, max_tokens=6, stop_token_ids=[stop])
    assert res.finish_reason == "stop" and res.stop_reason == stop
    assert res.token_ids == greedy.token_ids[: first + 1]  # the stop token is kept
    assert res.routed_experts is not None
    assert res.routed_experts.shape[0] == len(PROMPT) + len(res.token_ids) - 1

    with_eos = ReferenceEngine(TinyMoEConfig(eos_token_id=stop))
    assert with_eos.generate(PROMPT, max_tokens=6).token_ids == res.token_ids
    ignored = with_eos.generate(PROMPT, max_tokens=6, ignore_eos=True)
    assert ignored.token_ids == greedy.token_ids and ignored.finish_reason == "length"

    late = free.generate(PROMPT, max_tokens=6, stop_token_ids=[stop], min_tokens=first + 2)
    assert stop not in late.token_ids[: first + 2]


def test_logprobs_are_raw_model_logprobs(engine: ReferenceEngine) -> None:
    res = engine.generate(PROMPT, max_tokens=3, logprobs=True, top_logprobs=3)
    assert res.logprobs is not None and res.logprob_ranks == [1, 1, 1]
    assert res.top_logprobs is not None and [t[0][0] for t in res.top_logprobs] == res.token_ids
    logits, _ = engine.model(torch.tensor(PROMPT + res.token_ids[:-1]))
    expect = logits[len(PROMPT) - 1 :].log_softmax(-1)
    for i, tok in enumerate(res.token_ids):
        assert res.logprobs[i] == pytest.approx(float(expect[i, tok]), abs=1e-9)
        assert [lp for _, lp in res.top_logprobs[i]] == pytest.approx(
            torch.topk(expect[i], 3).values.tolist(), abs=1e-9
        )


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 5000}, "max_tokens"),
        ({"max_tokens": 4090}, "max_tokens"),  # P + max_tokens > max_model_len
        ({"max_tokens": 2, "temperature": -0.5}, "temperature"),
        ({"max_tokens": 2, "min_tokens": 3}, "min_tokens"),
        ({"max_tokens": 2, "stop_token_ids": [512]}, "stop_token_ids"),
    ],
)
def test_invalid_requests_raise_before_compute(
    engine: ReferenceEngine, kwargs: dict[str, Any], param: str
) -> None:
    with pytest.raises(EngineRequestError) as info:
        engine.generate(PROMPT, **kwargs)
    assert info.value.param == param


@pytest.mark.parametrize("prompt", [[], [512], [-1, 3], [[1, 2]], [1.5]])
def test_invalid_prompts_are_rejected(engine: ReferenceEngine, prompt: Any) -> None:
    with pytest.raises(EngineRequestError, match="token"):
        engine.generate(prompt, max_tokens=1)


# ------------------------------------------------------------------ HTTP
# Keys of real vLLM 0.32.0 responses (docs/vllm-schema.md), in vLLM's order.
GEN_KEYS = [
    "request_id", "model", "created", "usage", "prompt_logprobs", "prompt_token_id_logprobs",
    "prompt_token_ids", "mm_placeholders", "metrics", "kv_transfer_params", "ec_transfer_params",
    "output_mode", "choices",
]  # fmt: skip
GEN_CHOICE_KEYS = [
    "index", "finish_reason", "stop_reason", "token_ids", "routed_experts", "sampling_mask",
    "weight_versions", "logprobs",
]  # fmt: skip
CMPL_KEYS = [
    "id", "object", "created", "model", "choices", "service_tier", "system_fingerprint", "usage",
    "kv_transfer_params", "ec_transfer_params", "metrics",
]  # fmt: skip
CMPL_CHOICE_KEYS = [
    "index", "text", "logprobs", "finish_reason", "stop_reason", "token_ids", "prompt_logprobs",
    "prompt_token_ids", "routed_experts",
]  # fmt: skip
USAGE_KEYS = [
    "prompt_tokens", "total_tokens", "completion_tokens", "prompt_tokens_details",
    "completion_tokens_details",
]  # fmt: skip


def test_generate_endpoint_schema_and_rows(client: httpx.Client, engine: ReferenceEngine) -> None:
    r = client.post(GEN, json={**gen_body(PROMPT, max_tokens=4), "request_id": "abc"})
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    body = r.json()
    assert list(body) == GEN_KEYS
    assert body["request_id"] == "generate-tokens-abc"
    assert body["output_mode"] == "tokens" and body["prompt_token_ids"] is None
    assert list(body["usage"]) == USAGE_KEYS
    assert (body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"]) == (20, 4)
    (choice,) = body["choices"]
    assert list(choice) == GEN_CHOICE_KEYS
    assert choice["finish_reason"] == "length" and choice["stop_reason"] is None
    assert choice["weight_versions"] == [{"version": "default", "start": 0, "end": 4}]
    assert choice["logprobs"] is None and choice["sampling_mask"] is None
    routes = decode(choice["routed_experts"])
    assert routes.dtype == np.uint8 and routes.shape == (23, 4, 2)
    np.testing.assert_array_equal(routes, engine.routes_for(PROMPT + choice["token_ids"])[:23])

    r5 = client.post(GEN, json=gen_body(PROMPT, max_tokens=4, routed_experts_prompt_start=5))
    np.testing.assert_array_equal(decode(r5.json()["choices"][0]["routed_experts"]), routes[5:])


def test_generate_logprobs_and_return_token_ids(client: httpx.Client) -> None:
    body = gen_body(PROMPT, max_tokens=2, temperature=1.0, seed=7, logprobs=2)
    r = client.post(GEN, json={**body, "return_token_ids": True}).json()
    assert r["prompt_token_ids"] == PROMPT
    content = r["choices"][0]["logprobs"]["content"]
    assert [c["token_id"] for c in content] == r["choices"][0]["token_ids"]
    for c in content:
        assert set(c) == {"token_id", "logprob", "rank", "top_logprobs"}
        # vLLM: top_logprobs = first max(n, 1) of {sampled, top-1, top-2, ...}
        assert len(c["top_logprobs"]) == 2
        assert c["top_logprobs"][0] == {k: c[k] for k in ("token_id", "logprob", "rank")}
        if c["rank"] != 1:
            assert c["top_logprobs"][1]["rank"] == 1


def test_n_samples_use_consecutive_seeds_like_vllm(client: httpx.Client) -> None:
    two = client.post(GEN, json=gen_body(PROMPT, max_tokens=3, temperature=1.0, seed=3, n=2)).json()
    one = client.post(GEN, json=gen_body(PROMPT, max_tokens=3, temperature=1.0, seed=4)).json()
    assert [c["index"] for c in two["choices"]] == [0, 1]
    assert two["choices"][1]["token_ids"] == one["choices"][0]["token_ids"]
    assert two["usage"]["completion_tokens"] == 6


def test_completions_endpoint_schema(client: httpx.Client, engine: ReferenceEngine) -> None:
    req = {"prompt": PROMPT, "max_tokens": 4, "temperature": 0.0, "routed_experts_prompt_start": 5}
    plain = client.post(CMPL, json=req).json()
    assert list(plain) == CMPL_KEYS and plain["object"] == "text_completion"
    assert plain["id"].startswith("cmpl-") and plain["model"] == "r3arrow-tiny-moe"
    (choice,) = plain["choices"]
    assert list(choice) == CMPL_CHOICE_KEYS
    assert (
        choice["token_ids"] is None and choice["text"] == ""
    )  # like vLLM without return_token_ids
    with_ids = client.post(
        CMPL, json={**req, "return_token_ids": True, "model": "r3arrow-tiny-moe"}
    )
    choice = with_ids.json()["choices"][0]
    assert choice["prompt_token_ids"] == PROMPT and len(choice["token_ids"]) == 4
    full = engine.routes_for(PROMPT + choice["token_ids"])
    np.testing.assert_array_equal(decode(choice["routed_experts"]), full[5:23])
    # a batch of prompts: one choice each, in order
    batch = client.post(
        CMPL, json={"prompt": [PROMPT, PROMPT[:3]], "max_tokens": 2, "temperature": 0.0}
    ).json()
    assert [decode(c["routed_experts"]).shape[0] for c in batch["choices"]] == [21, 4]
    assert batch["usage"]["prompt_tokens"] == 23


def test_health_models_404_405(client: httpx.Client) -> None:
    h = client.get("/health")
    assert h.status_code == 200 and h.content == b""
    models = client.get("/v1/models").json()
    assert models["object"] == "list"
    assert [m["id"] for m in models["data"]] == ["r3arrow-tiny-moe"]
    assert models["data"][0]["max_model_len"] == 4096
    assert client.get("/nope").json() == {"detail": "Not Found"}
    r = client.get(GEN)
    assert r.status_code == 405 and r.json() == {"detail": "Method Not Allowed"}


def _error(r: httpx.Response, status: int = 400) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == status
    return dict(err)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (GEN, gen_body(PROMPT, max_tokens=2, routed_experts_prompt_start=21), START),
        (GEN, {"token_ids": PROMPT}, "body.sampling_params"),
        (GEN, {"sampling_params": {}}, "body.token_ids"),
        (GEN, gen_body([], max_tokens=1), "body.token_ids"),
        (GEN, gen_body([-1, 2], max_tokens=1), "body.token_ids"),
        (GEN, gen_body([512], max_tokens=1), "token_ids"),  # vLLM's engine dies on this one
        (GEN, gen_body(PROMPT, max_tokens=0), "max_tokens"),
        (GEN, gen_body(PROMPT, max_tokens="x"), "body.sampling_params.max_tokens"),
        (GEN, gen_body(PROMPT, max_tokens=1, top_p=0.5), "top_p"),
        (GEN, {**gen_body(PROMPT, max_tokens=1), "stream": True}, "stream"),
        (GEN, [1, 2], "body"),
        (CMPL, {"prompt": PROMPT, "max_tokens": 2, START: 25}, START),
        (CMPL, {"prompt": PROMPT, "max_tokens": 2, START: -2}, f"body.{START}"),
        (CMPL, {"prompt": "hello", "max_tokens": 2}, "prompt"),
        (CMPL, {"max_tokens": 2}, "prompt"),
        (CMPL, {"prompt": PROMPT, "max_tokens": 2, "logprobs": 1}, "logprobs"),
        (CMPL, {"prompt": PROMPT, "max_tokens": 2, "temperature": -1}, "temperature"),
    ],
)  # fmt: skip
def test_bad_requests_get_vllm_error_json(
    client: httpx.Client, path: str, body: Any, param: str
) -> None:
    err = _error(client.post(path, json=body))
    assert err["param"] == param
    assert err["type"] in ("BadRequestError", "Bad Request")


def test_bad_json_content_type_and_unknown_model(client: httpx.Client) -> None:
    headers = {"content-type": "application/json"}
    assert _error(client.post(GEN, content=b"{not json", headers=headers))["param"] == "body"
    text = client.post(GEN, content=b"{}", headers={"content-type": "text/plain"})
    assert "application/json" in _error(text)["message"]
    missing = client.post(CMPL, json={"model": "other", "prompt": PROMPT, "max_tokens": 1})
    err = _error(missing, 404)
    assert (err["type"], err["param"]) == ("NotFoundError", "model")
    assert client.post(GEN, json=gen_body(PROMPT, max_tokens=1)).status_code == 200  # still serving


def test_n_and_max_tokens_are_capped_with_a_400_naming_limit_and_value(
    engine: ReferenceEngine,
) -> None:
    with (
        EngineServer(engine, max_n=2, max_tokens_limit=5) as srv,
        httpx.Client(base_url=srv.url, timeout=30) as c,
    ):
        n = _error(c.post(GEN, json=gen_body(PROMPT, max_tokens=1, n=3)))
        assert n["param"] == "n" and n["type"] == "BadRequestError"
        assert "at most 2" in n["message"] and "value=3" in n["message"]
        cmpl = _error(c.post(CMPL, json={"prompt": [PROMPT, PROMPT], "max_tokens": 6}))
        assert cmpl["param"] == "max_tokens"
        assert "at most 5" in cmpl["message"] and "value=6" in cmpl["message"]
        ok = c.post(GEN, json=gen_body(PROMPT, max_tokens=5, n=2, ignore_eos=True))
        assert ok.status_code == 200 and [len(ch["token_ids"]) for ch in ok.json()["choices"]] == [
            5,
            5,
        ]
        # no max_tokens: up to the remaining context, bounded by the limit
        dflt = c.post(GEN, json=gen_body(PROMPT, ignore_eos=True)).json()
        assert len(dflt["choices"][0]["token_ids"]) == 5
    assert srv.log.count(GEN) == 3
    with pytest.raises(ValueError, match="max_n"):
        EngineServer(engine, max_n=0)
    with pytest.raises(ValueError, match="max_tokens_limit"):
        EngineServer(engine, max_tokens_limit=0)


# ---------------------------------------------------------------- faults
def test_layer_faults_corrupt_one_router_layer() -> None:
    rows = np.zeros((5, 3, 2), dtype=np.uint8)
    rows[:, 1:] = np.array([2, 5], dtype=np.uint8)  # layer 0 dense (zeros), 1 and 2 route
    dup = decode(str(corrupt_routes(rows, Fault.duplicate_experts())))
    changed = np.argwhere(dup != rows)
    assert changed.tolist() == [[2, 1, 1]] and dup[2, 1].tolist() == [2, 2]
    on2 = decode(str(corrupt_routes(rows, Fault.duplicate_experts(layer=2))))
    assert on2[2, 2].tolist() == [2, 2] and on2[2, 1].tolist() == [2, 5]
    zero = decode(str(corrupt_routes(rows, Fault.zero_router_layer())))
    assert not zero[:, :2].any() and (zero[:, 2] == rows[:, 2]).all()
    with pytest.raises(ValueError, match="K >= 2"):
        corrupt_routes(rows[..., :1], Fault.duplicate_experts())
    with pytest.raises(ValueError, match=r"layer in \[0, 3\)"):
        corrupt_routes(rows, Fault.zero_router_layer(layer=3))
    with pytest.raises(ValueError, match="router layer"):
        corrupt_routes(np.zeros_like(rows), Fault.duplicate_experts())
    with pytest.raises(ValueError, match="layer"):
        Fault.duplicate_experts(layer=-1)


def test_drift_prompt_splits_one_token() -> None:
    conv = [10, 20, 30, 511]
    assert drift_prompt(conv, 1, 512) == [10, 21, 22, 30, 511]
    assert drift_prompt(conv, 3, 512) == [10, 20, 30, 0, 1]  # wraps in the vocabulary
    with pytest.raises(ValueError, match="position < 4"):
        drift_prompt(conv, 4, 512)


def _serve(engine: ReferenceEngine, plan: FaultPlan) -> EngineServer:
    return EngineServer(engine, faults=plan)


def test_status_faults_then_recovery(engine: ReferenceEngine) -> None:
    plan = FaultPlan().then(Fault.status(503), times=2).then(Fault.status(429, retry_after=1.5))
    with _serve(engine, plan) as srv, httpx.Client(base_url=srv.url) as c:
        codes = [c.post(GEN, json=gen_body(PROMPT, max_tokens=1)) for _ in range(4)]
        assert [r.status_code for r in codes] == [503, 503, 429, 200]
        assert _error(codes[0], 503)["type"] == "ServiceUnavailableError"
        assert codes[2].headers["retry-after"] == "1.5" and "retry-after" not in codes[0].headers
        assert c.get("/health").status_code == 200  # non-generation paths never take faults
    assert plan.seen(GEN) == 4 and plan.seen("/health") == 1 and plan.seen() == 5
    assert [f.status_code for _, f in plan.injected] == [503, 503, 429]
    assert plan.pending == 0


def test_drop_connection_then_recovery(engine: ReferenceEngine) -> None:
    plan = FaultPlan().then(Fault.drop_connection())
    with _serve(engine, plan) as srv, httpx.Client(base_url=srv.url) as c:
        with pytest.raises(httpx.RemoteProtocolError):
            c.post(GEN, json=gen_body(PROMPT, max_tokens=1))
        assert c.post(GEN, json=gen_body(PROMPT, max_tokens=1)).status_code == 200
    assert plan.seen(GEN) == 2


def test_delay_fault(engine: ReferenceEngine) -> None:
    plan = FaultPlan().then(Fault.delay(0.3))
    with _serve(engine, plan) as srv, httpx.Client(base_url=srv.url) as c:
        t0 = time.perf_counter()
        slow = c.post(GEN, json=gen_body(PROMPT, max_tokens=1))
        assert time.perf_counter() - t0 >= 0.3 and slow.status_code == 200
        with pytest.raises(httpx.ReadTimeout):
            plan.then(Fault.delay(1.0))
            c.post(GEN, json=gen_body(PROMPT, max_tokens=1), timeout=0.2)


@pytest.mark.parametrize("mode", ["base64", "not_npy", "object", "float", "truncated", "shape"])
def test_malformed_routes_fail_strict_decoding(engine: ReferenceEngine, mode: Any) -> None:
    plan = FaultPlan().then(Fault.malformed_routes(mode))
    with _serve(engine, plan) as srv, httpx.Client(base_url=srv.url) as c:
        bad = c.post(GEN, json=gen_body(PROMPT, max_tokens=2)).json()["choices"][0]
        good = c.post(GEN, json=gen_body(PROMPT, max_tokens=2)).json()["choices"][0]
    assert bad["token_ids"] == good["token_ids"]
    assert decode(good["routed_experts"]).shape == (21, 4, 2)
    try:
        arr = decode(bad["routed_experts"])
    except ValueError:  # binascii.Error, bad .npy header, object arrays without pickle, short data
        return
    assert arr.dtype != np.uint8 or arr.shape != (21, 4, 2)  # float / shape: wrong but decodable


@pytest.mark.parametrize(
    ("fault", "rows"),
    [(Fault.short_routes(2), 19), (Fault.extra_routes(1), 22), (Fault.no_routes(), None)],
)
def test_route_count_faults(engine: ReferenceEngine, fault: Fault, rows: int | None) -> None:
    plan = FaultPlan().then(fault, endpoint=CMPL)
    with _serve(engine, plan) as srv, httpx.Client(base_url=srv.url) as c:
        untouched = c.post(GEN, json=gen_body(PROMPT, max_tokens=2)).json()["choices"][0]
        assert decode(untouched["routed_experts"]).shape[0] == 21  # endpoint-scoped fault
        req = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0.0}
        payload = c.post(CMPL, json=req).json()["choices"][0]["routed_experts"]
        assert (None if payload is None else decode(payload).shape[0]) == rows
        again = c.post(CMPL, json=req).json()["choices"][0]["routed_experts"]
        assert decode(again).shape[0] == 21


def test_sticky_fault_and_plan_validation(engine: ReferenceEngine) -> None:
    plan = FaultPlan().then(Fault.status(500), times=None)
    with _serve(engine, plan) as srv, httpx.Client(base_url=srv.url) as c:
        assert {c.post(GEN, json=gen_body(PROMPT, max_tokens=1)).status_code for _ in range(3)} == {
            500
        }
    with pytest.raises(ValueError, match="endpoint"):
        FaultPlan().then(Fault.no_routes(), endpoint="/health")
    with pytest.raises(ValueError, match="HTTP error code"):
        Fault.status(200)
    with pytest.raises(ValueError, match="mode"):
        Fault.malformed_routes("nope")  # type: ignore[arg-type]


# ----------------------------------------------------------- concurrency
def test_64_concurrent_clients_each_get_their_own_answer(
    server: EngineServer, engine: ReferenceEngine
) -> None:
    prompts = [[(31 * i + 7 * j) % 512 for j in range(8 + i % 13)] for i in range(64)]
    answers: list[dict[str, Any] | None] = [None] * 64
    barrier = threading.Barrier(64)
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)

    with httpx.Client(base_url=server.url, timeout=60, limits=limits) as c:  # thread-safe pool

        def worker(i: int) -> None:
            barrier.wait()
            body = gen_body(prompts[i], max_tokens=4, routed_experts_prompt_start=i % 5)
            answers[i] = c.post(GEN, json=body).json()["choices"][0]

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(64)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert server.peak_connections > 8  # the requests really overlapped
    for i, ans in enumerate(answers):
        assert ans is not None
        expect = engine.generate(prompts[i], max_tokens=4, routed_experts_prompt_start=i % 5)
        assert ans["token_ids"] == expect.token_ids
        np.testing.assert_array_equal(decode(ans["routed_experts"]), expect.routed_experts)


def test_keep_alive_connection_is_reused(server: EngineServer) -> None:
    before, accepted = server.log.count(GEN), server.connections_accepted
    with httpx.Client(base_url=server.url) as c:
        for _ in range(3):
            assert c.post(GEN, json=gen_body(PROMPT, max_tokens=1)).status_code == 200
        assert c.get("/health").status_code == 200
    assert server.connections_accepted == accepted + 1  # HTTP/1.1 keep-alive: one connection
    assert server.log.count(GEN) == before + 3
    assert server.log.bodies(GEN)[-1]["token_ids"] == PROMPT


def test_raw_http_edge_cases(server: EngineServer) -> None:
    with socket.create_connection((server.host, server.port), timeout=10) as sock:
        sock.sendall(
            b"POST /inference/v1/generate HTTP/1.1\r\nHost: x\r\n"
            b"Transfer-Encoding: chunked\r\nContent-Type: application/json\r\n\r\n0\r\n\r\n"
        )
        assert sock.recv(4096).startswith(b"HTTP/1.1 411")
    with socket.create_connection((server.host, server.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n")
        assert sock.recv(4096).startswith(b"HTTP/1.1 400")


def test_server_lifecycle() -> None:
    with pytest.raises(ValueError, match=r"port: expected an int in \[0, 65535\]"):
        EngineServer(port=70000)
    with pytest.raises(TypeError, match="faults: expected a FaultPlan"):
        EngineServer(faults=[Fault.no_routes()])  # type: ignore[arg-type]
    srv = EngineServer(ReferenceEngine(TinyMoEConfig(num_layers=2, dense_layers=())))
    with pytest.raises(RuntimeError, match="not running"):
        _ = srv.url
    with srv:
        url = srv.url
        assert url.startswith("http://127.0.0.1:")
        r = httpx.post(url + GEN, json=gen_body([1, 2, 3], max_tokens=2))
        assert decode(r.json()["choices"][0]["routed_experts"]).shape == (4, 2, 2)
    srv.stop()  # idempotent
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health")
