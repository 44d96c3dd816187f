"""The demo's replay-diagnostics stage: a trainer's routers that disagree with the engine's.

See `r3arrow.testing.demo` (stage 7) and ``docs/diagnostics.md``. Real megatron-core ``TopKRouter``s
(`r3arrow.testing.megatron`) get the embedded engine's router weights and see the hidden states
the engine's routers scored (`r3arrow.testing.engine.ReferenceEngine.router_inputs`), but compute in
bfloat16 where the engine computes in float64: like a trainer against an inference engine,
their native top-k differs at the tokens whose top-k boundary is closer than bfloat16 can
tell apart. The rollout routes are replayed under
``replay_schedule(measure_agreement=True)`` (the probe of `r3arrow.megatron`), and

* the probe's `RouteAgreement` (native vs replayed = engine) is the R3 paper's table;
* the replayed routing maps must equal the engine's routes on every captured token;
* an independent native pass (no replay) must give the same agreement as the probe;
* float32 routers on the same weights and inputs are the control (expected: no or almost
  no difference), so the disagreement is the precision's.

Both agreements are persisted (`r3arrow.io.write_diagnostics`, step 0) in the demo's output
directory: ``native_vs_replay`` (bfloat16) and ``native_fp32_vs_replay`` (the control).

Then R3's effect on the log-probs (`trainer_mismatch`, ``docs/mismatch.md`` "The demo"): the
whole model runs trainer-side in bfloat16 (`r3arrow.testing.engine.TinyMoE.trainer_logprobs`)
over every kept trajectory twice, with its own routing (``trainer_native``) and with the
rollout's captured routes replayed (``trainer_replay``). Each pass gives a ``train_logprobs``
and a ``train_routes`` column beside the engine's ``rollout_logprobs`` and ``routes``, so
`r3arrow.stats.logprob_mismatch` and `r3arrow.stats.route_agreement` measure it; both are
persisted at step 0, the mismatch as source ``trainer_<mode>`` and the agreement as
``trainer_<mode>_routing``, which is how ``r3arrow diagnose`` pairs them. Needs megatron-core
and torch; imported by `r3arrow.testing.demo` only when they are present.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from r3arrow.spec import RouteSpec

#: Source label of the float32 control in the diagnostics files.
CONTROL_SOURCE = "native_fp32_vs_replay"
#: Mismatch sources of the trainer-side bfloat16 forward, by mode (its agreement: + "_routing").
TRAINER_SOURCES = {"native": "trainer_native", "replay": "trainer_replay"}


@dataclasses.dataclass(frozen=True)
class Diagnosis:
    """What the stage measured; ``ok`` is False if a check failed (see the module docstring)."""

    ok: bool
    native: Any  # RouteAgreement, bfloat16 routers
    control: Any  # RouteAgreement, float32 routers
    replay_mismatches: int
    path: Path
    #: mode ("native", "replay") -> `RouteAgreement`: the trainer forward's routes vs the rollout's
    trainer_agreement: dict[str, Any] = dataclasses.field(default_factory=dict)
    #: mode -> `r3arrow.stats.logprob_mismatch` of its train_logprobs vs rollout_logprobs
    mismatch: dict[str, dict[str, float]] = dataclasses.field(default_factory=dict)


def _router_inputs(engine: Any, part: pa.Table) -> np.ndarray:
    """``[sum(captured), n_moe, hidden]``: the engine's router inputs of every captured row,
    trajectory after trajectory (the order of `r3arrow.table.flat_routes`)."""
    from r3arrow.table import captured_lengths, input_ids

    seqs = input_ids(part)
    offsets = np.asarray(seqs.offsets, dtype=np.int64)
    tokens = seqs.values.to_numpy()
    captured = captured_lengths(part)
    blocks = [
        engine.router_inputs(tokens[offsets[i] : offsets[i] + n])[:n]
        for i, n in enumerate(captured.tolist())
        if n
    ]
    cfg = engine.config
    if not blocks:
        return np.zeros((0, len(cfg.moe_layers), cfg.hidden_size))
    return np.concatenate(blocks)


def _hidden(mb: Any, rows: np.ndarray, slot: int, dtype: torch.dtype) -> torch.Tensor:
    """Packed ``[T, 1, hidden]`` input of router ``slot``: the rows at non-padding positions."""
    keep = ~mb.padding_mask.reshape(-1)
    out = torch.zeros(mb.num_tokens, 1, rows.shape[-1], dtype=dtype)
    out[keep, 0] = torch.from_numpy(np.ascontiguousarray(rows[:, slot])).to(dtype)
    return out


def _routers(engine: Any, spec: RouteSpec, layers: Sequence[int], dtype: torch.dtype) -> list[Any]:
    """megatron-core routers for ``layers`` carrying the engine's gate weights in ``dtype``."""
    from r3arrow.testing.megatron import build_routers

    cfg = engine.config
    routers = build_routers(
        spec, layers, hidden=cfg.hidden_size, num_experts=cfg.num_experts, params_dtype=dtype
    )
    weights = engine.model.router_weights()  # [n_moe, hidden, E]: logits = x @ w
    for router, g in zip(routers, layers, strict=True):
        router.weight.data.copy_(weights[cfg.moe_layers.index(g)].T.to(dtype))
        if router.bias is not None:  # megatron-core adds a (random) gate bias; the engine has none
            router.bias.data.zero_()
    return routers


def _maps(routers: Sequence[Any], mb: Any, rows: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
    """Routing maps ``[T_captured, L_local, E]`` bool of one forward of every router."""
    keep = ~mb.padding_mask.reshape(-1)
    pad = mb.padding_mask.reshape(-1)
    out = []
    for slot, router in enumerate(routers):
        _, routing_map = router(_hidden(mb, rows, slot, dtype), padding_mask=pad)
        out.append(routing_map[keep])
    return torch.stack(out, dim=1)


def _ids(maps: torch.Tensor, topk: int) -> np.ndarray:
    """Expert ids ``[T, L, K]`` (ascending) of routing maps with K experts per row."""
    ranked = torch.sort(maps.to(torch.int8), dim=-1, descending=True, stable=True).indices
    return np.sort(ranked[..., :topk].numpy(), axis=-1)


def _engine_ids(part: pa.Table, layers: Sequence[int]) -> np.ndarray:
    from r3arrow.table import flat_routes

    rows, _ = flat_routes(part)
    return rows[:, list(layers), :].astype(np.int64)


def _pass(
    engine: Any,
    spec: RouteSpec,
    parts: Sequence[pa.Table],
    batches: Sequence[Any],
    inputs: Sequence[np.ndarray],
    dtype: torch.dtype,
) -> tuple[Any, Any, int]:
    """(probe agreement, independent native agreement, replay mismatches) at ``dtype``."""
    from r3arrow.megatron import install_replay, replay_schedule
    from r3arrow.stats import compare_routes
    from r3arrow.testing.megatron import cpu_router_harness

    layers = list(batches[0].layers)
    sub = RouteSpec(len(layers), spec.topk, spec.num_experts)
    probed = native = None
    mismatches = 0
    with cpu_router_harness(), torch.no_grad():
        routers = _routers(engine, spec, layers, dtype)
        for part, mb, rows in zip(parts, batches, inputs, strict=True):
            want = _engine_ids(part, layers)
            with replay_schedule(measure_agreement=True) as probe:
                install_replay(mb, routers)
                replayed = _ids(_maps(routers, mb, rows, dtype), spec.topk)
            assert probe is not None
            one = probe.agreement
            probed = one if probed is None else probed + one
            mismatches += int((replayed != np.sort(want, axis=-1)).any(axis=(1, 2)).sum())
            with replay_schedule(action=None):  # the routers' own choice, nothing replayed
                free = _ids(_maps(routers, mb, rows, dtype), spec.topk)
            mine = compare_routes(want, free, sub)
            native = mine if native is None else native + mine
    return probed, native, mismatches


def _relabel(agreement: Any, layers: Sequence[int]) -> Any:
    """``agreement`` with its local layer indices replaced by the global ``layers``."""
    return dataclasses.replace(agreement, layers=tuple(int(g) for g in layers))


def print_table(agreement: Any, say: Callable[[str], None], indent: str = "    ") -> None:
    """The R3 paper's quantities and the per-layer table of one `RouteAgreement`."""
    s = agreement.summary()
    say(
        f"{indent}{agreement.tokens} tokens: router decisions that differ "
        f"{1 - s['overlap']:.2%}, tokens differing on >= 1 layer {s['differing']:.2%}"
    )
    say(f"{indent}layer  decisions differ  top-k set differs")
    with np.errstate(all="ignore"):
        decisions = 1 - agreement.mean_overlap
        sets = 1 - agreement.identical_fraction
    for i, layer in enumerate(agreement.layers):
        say(f"{indent}{layer:>5}  {decisions[i]:>16.2%}  {sets[i]:>17.2%}")


def _trainer_columns(
    engine: Any, table: pa.Table, replay: bool
) -> tuple[pa.Array[Any], pa.Array[Any]]:
    """(``train_logprobs``, ``train_routes``) of one trainer-side bfloat16 pass over ``table``.

    Trajectory i runs its captured positions ``0 .. c_i - 1`` (``c_i = captured``, at most
    ``N_i - 1``): row t scores token ``t + 1``. Response token j (position ``P_i + j``) gets
    row ``P_i + j - 1``'s log-prob; a token past the captured rows (the terminal gap, never
    a loss token, ``docs/design.md`` §2) gets 0.0. ``train_routes`` holds the routing the
    pass used, one row per captured row (the ``routes`` column's type).
    """
    from r3arrow._schema import list_lengths
    from r3arrow.table import captured_lengths, flat_routes, input_ids, route_spec

    spec = route_spec(table)
    seqs = input_ids(table)
    offsets = np.asarray(seqs.offsets, dtype=np.int64)
    tokens = torch.from_numpy(seqs.values.to_numpy().astype(np.int64))
    rows, route_offsets = flat_routes(table)
    captured = captured_lengths(table)
    prompt = list_lengths(table.column("prompt_ids"))
    response = list_lengths(table.column("response_ids"))
    lps = np.zeros(int(response.sum()), dtype=np.float32)
    used = np.zeros_like(rows)
    at = 0
    for i, n in enumerate(captured.tolist()):  # one forward per sequence: the model's loop
        if n:
            seq = tokens[offsets[i] : offsets[i] + n + 1]
            a, b = int(route_offsets[i]), int(route_offsets[i + 1])
            forced = torch.from_numpy(rows[a:b].astype(np.int64)) if replay else None
            lp, routes = engine.model.trainer_logprobs(seq[:-1], seq[1:], routes=forced)
            used[a:b] = routes.numpy()
            # rows P-1 .. n-1 score response tokens 0 .. n-P (no row scores token 0)
            first = max(int(prompt[i]) - 1, 0)
            skip = first - (int(prompt[i]) - 1)
            scored = lp.numpy()[first:]
            lps[at + skip : at + skip + scored.shape[0]] = scored
        at += int(response[i])
    resp_offsets = pa.array(np.r_[0, np.cumsum(response)], pa.int64())
    train_lp = pa.LargeListArray.from_arrays(resp_offsets, pa.array(lps, pa.float32()))
    inner = pa.FixedSizeListArray.from_arrays(
        pa.FixedSizeListArray.from_arrays(pa.array(used.reshape(-1)), spec.topk),
        spec.num_layers,
    )
    train_routes = pa.LargeListArray.from_arrays(pa.array(route_offsets, pa.int64()), inner)
    return train_lp, train_routes.cast(spec.routes_type)


def trainer_mismatch(
    engine: Any, table: pa.Table, out_dir: Path
) -> tuple[dict[str, Any], dict[str, dict[str, float]]]:
    """The trainer-side forward twice (module docstring): ``(mode -> RouteAgreement, mode ->
    logprob_mismatch dict)`` for the modes ``native`` and ``replay``, persisted at step 0:
    the mismatch as source ``TRAINER_SOURCES[mode]``, the agreement as that name plus
    ``_routing`` (what ``r3arrow diagnose`` pairs). ``table``: rollouts of ``engine`` with
    ``rollout_logprobs`` (`SchemaError` without them)."""
    from r3arrow import stats
    from r3arrow._schema import ROUTING_SUFFIX
    from r3arrow.io import write_diagnostics
    from r3arrow.table import with_columns

    agreements: dict[str, Any] = {}
    mismatches: dict[str, dict[str, float]] = {}
    for mode, source in TRAINER_SOURCES.items():
        train_lp, train_routes = _trainer_columns(engine, table, replay=mode == "replay")
        scored = with_columns(table, {"train_logprobs": train_lp, "train_routes": train_routes})
        agreements[mode] = stats.route_agreement(scored, "train_routes")
        mismatches[mode] = stats.logprob_mismatch(scored)
        write_diagnostics(out_dir, 0, agreements[mode], source=source + ROUTING_SUFFIX)
        write_diagnostics(out_dir, 0, mismatches[mode], source=source)
    return agreements, mismatches


#: The mismatch table's metric columns: (key, header).
MISMATCH_COLUMNS = (
    ("k3", "k3"),
    ("frac_abs_gt_ln2", "|Δ|>ln2"),
    ("token_mult_prob_error", "mult_err"),
    ("js_divergence", "js_div"),
    ("abs_max", "|Δ| max"),
)


def print_mismatch(
    agreements: Any, mismatches: Any, say: Callable[[str], None], indent: str = "    "
) -> None:
    """Rows ``native`` / ``replay``: routing disagreement (tokens whose top-k set differs from
    the rollout's on >= 1 layer) beside the log-prob mismatch over the loss tokens."""
    head = f"{indent}{'mode':<8}{'routing differs':>16}{'loss tokens':>12}"
    say(head + "".join(h.rjust(11) for _, h in MISMATCH_COLUMNS))
    for mode, lp in mismatches.items():
        cells = "".join(f"{lp[k]:>11.4g}" for k, _ in MISMATCH_COLUMNS)
        differ = agreements[mode].differing_fraction
        say(f"{indent}{mode:<8}{differ:>16.2%}{int(lp['tokens']):>12}{cells}")


def diagnose_replay(
    engine: Any,
    parts: Sequence[pa.Table],
    batches: Sequence[Any],
    out_dir: Path,
    *,
    say: Callable[[str], None] = print,
) -> Diagnosis:
    """Run the stage (module docstring) on the demo's microbatches; print and persist it.

    ``engine``: the embedded `r3arrow.testing.engine.ReferenceEngine` that generated ``parts``;
    ``batches``: their packed `r3arrow.collate.Microbatch`es for the engine's router layers.
    Raises what megatron-core and r3arrow raise; failed checks give ``ok=False``.
    """
    from r3arrow.io import write_diagnostics
    from r3arrow.table import route_spec

    spec = route_spec(parts[0])
    layers = list(batches[0].layers)
    inputs = [_router_inputs(engine, part) for part in parts]
    probed, native, mismatches = _pass(engine, spec, parts, batches, inputs, torch.bfloat16)
    control_probe, control, control_mismatches = _pass(
        engine, spec, parts, batches, inputs, torch.float32
    )
    native = _relabel(native, layers)
    control = _relabel(control, layers)
    probe_ok = probed == native and control_probe == control
    ok = probe_ok and mismatches == 0 and control_mismatches == 0
    path = write_diagnostics(out_dir, 0, probed)
    write_diagnostics(out_dir, 0, control_probe, source=CONTROL_SOURCE)
    say(
        f"[7/7] replay diagnostics: {len(layers)} megatron-core TopKRouters with the engine's "
        f"router weights in bfloat16 (engine: {engine.config.dtype}), on the engine's router "
        f"inputs"
    )
    say("  native (bfloat16) vs replayed routing, R3-paper quantities:")
    print_table(probed, say)
    cs = control.summary()
    say(
        f"  control, float32 routers: decisions differ {1 - cs['overlap']:.2%}, tokens "
        f"differing on >= 1 layer {cs['differing']:.2%}"
    )
    verdict = "identical" if mismatches == 0 else f"DIFFERENT on {mismatches} tokens"
    say(
        f"  replayed routing {verdict} to the engine's; probe "
        f"{'matches' if probe_ok else 'DIFFERS FROM'} an independent native pass"
    )
    table = pa.concat_tables(parts)
    agreements, lp = trainer_mismatch(engine, table, out_dir)
    say(
        "  R3 on the log-probs: the whole model trainer-side in bfloat16, native routing vs "
        "the rollout's routes replayed, against the engine's log-probs:"
    )
    print_mismatch(agreements, lp, say)
    replay_ok = agreements["replay"].all_identical == agreements["replay"].tokens
    if not replay_ok:
        say("  trainer-side replay DIFFERS FROM the rollout's routes")
    say(f"  diagnostics: {path} (r3arrow diagnose {out_dir})")
    return Diagnosis(ok and replay_ok, probed, control_probe, mismatches, path, agreements, lp)


__all__ = [
    "CONTROL_SOURCE",
    "MISMATCH_COLUMNS",
    "TRAINER_SOURCES",
    "Diagnosis",
    "diagnose_replay",
    "print_mismatch",
    "print_table",
    "trainer_mismatch",
]
