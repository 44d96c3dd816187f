"""SkyRL PR #1912's own functions, imported from a checkout of the PR head (nothing copied).

Two benchmarks put r3arrow beside SkyRL's code at ``refs/pull/1912/head`` (commit
`SKYRL_COMMIT`), never the ``skyrl`` 0.3.0 package of the virtual environment:

* the collation chain (``_chain.run_chain(args, "skyrl")``, `SkyrlChain`): from the same
  per-trajectory routes to per-layer int32 targets in real megatron-core ``RouterReplay``
  instances, called as the PR head's trainer (``skyrl/train/trainer.py``,
  ``convert_to_training_input``) and Megatron model wrapper
  (``skyrl/backends/skyrl_train/workers/megatron/megatron_model_wrapper.py``, the forward of a
  micro-batch) call them:

  1. trainer: ``skyrl.train.dataset.preprocess.convert_prompts_responses_to_batch_tensors``
     (left-padded sequences, attention mask, response-aligned masks and rewards, and the
     left-padded ``[B, S_max, L, K]`` routes in the rows' own dtype, uint8 here, padded with
     ``arange(K)`` rows), then ``make_router_padding_mask(attention_mask, [len(r) ...])``;
  2. worker: ``skyrl...megatron.token_metadata.build_token_metadata_layout(attention_mask,
     device, packed=True, fp8_enabled=False)``, then ``skyrl...utils.replay_utils.
     setup_per_microbatch_replay_forward(routes, router_padding_mask, attention_mask, model=,
     model_config=, metadata_layout=, remove_microbatch_padding=True)``: the stage's layers
     selected, the packed ``[1, T, L_local, K]`` layout, the per-layer int32 split and
     ``set_replay_data`` into the instances, then ``REPLAY_FORWARD``; SkyRL's
     ``clear_router_replay`` after the targets are read back (r3arrow's ``replay_schedule``
     clears too).

  Each trajectory's routes are what the PR head's generator hands the trainer: SkyRL's own
  ``RoutedExpertTrace`` (``record_generation`` of the captured ``n - 1`` rows, then
  ``finalize(token_count=n)``, which appends the one ``arange(K)`` row of the last token),
  built outside the timing, as are the prompt, response, reward and loss-mask lists.

* the wire capture (``bench_capture.py``, ``wire_skyrl``): the PR head's client-side decode
  of its packed payload (``skyrl...inference_servers.generate_wire.decode_packed_routed_experts``;
  the payloads made by its ``pack_routed_experts``) and its accumulation
  (``skyrl...utils.routed_experts.RoutedExpertTrace``).

How the chain run departs from a SkyRL training run:

* **PP stage.** The harness is a gloo world of one with model parallel 1 x 1, so SkyRL's
  ``_get_current_pp_stage_layer_range`` returns all ``L`` layers for PP rank 0, not the 12
  instances of the stage: SkyRL takes its dense-mismatch path, which maps each instance
  through its ``layer_number``. ``patch_topk_router_layer_number`` (SkyRL's patch, applied
  before the routers are built, as its worker does) gives the stage's instances the global
  1-based numbers ``13..24``; `check_layer_numbers` asserts it. On a real PP=4 rank 1 SkyRL
  takes the same 12 layers by offset: the same ``index_select``, so the same cost.
* **Alignment.** ``build_token_metadata_layout`` aligns packed sequences to
  ``get_packed_seq_align_size(tp, cp, fp8)`` (``tp`` here, 1). For the chain's ``align`` (8),
  ``token_metadata``'s name is wrapped for the call to return ``lcm(SkyRL's own value,
  align)``; no sequence split (TP stays 1).
* **Model.** ``model=None``: the PR head reads ``model`` only to scatter the padding mask for
  sequence parallelism, which TP = 1 does not use.

**Where the code comes from** (`checkout_dir`): ``--skyrl-checkout DIR`` (a directory holding
the ``skyrl`` package of the PR head), else the tree of `SKYRL_COMMIT` extracted once from the
bare mirror at ``$SKYRL_MIRROR`` (default `DEFAULT_MIRROR`) into a cache directory under the
system temp dir, else the SkyRL side is skipped with the reason. `load` puts the checkout
first on ``sys.path``, drops any ``skyrl`` module already imported from elsewhere, imports
every package normally and, where a parent package's ``__init__`` needs more than the leaf
modules do (``skyrl.backends`` imports its Tinker backend, which needs ``cloudpathlib``;
``skyrl.train.dataset`` needs ``datasets``), registers that package bare (its directory in the
checkout, its ``__init__`` not run); it then asserts every module used lies in the checkout.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import math
import os
import subprocess
import sys
import tempfile
import types
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

SKYRL_REF = "refs/pull/1912/head"
SKYRL_COMMIT = "4bb8674956eb75fc53d8cd397ffdbe3980539012"
DEFAULT_MIRROR = "/work/.mirror/NovaSky-AI+SkyRL/repo"
_MARKER = ".r3arrow-skyrl-commit"

PREPROCESS = "skyrl.train.dataset.preprocess"
TOKEN_METADATA = "skyrl.backends.skyrl_train.distributed.megatron.token_metadata"
REPLAY_UTILS = "skyrl.backends.skyrl_train.utils.replay_utils"
ROUTED_EXPERTS = "skyrl.backends.skyrl_train.utils.routed_experts"
GENERATE_WIRE = "skyrl.backends.skyrl_train.inference_servers.generate_wire"
#: What each benchmark calls, by module (`load`'s ``modules``).
CHAIN: dict[str, tuple[str, ...]] = {
    PREPROCESS: ("convert_prompts_responses_to_batch_tensors", "make_router_padding_mask"),
    TOKEN_METADATA: ("build_token_metadata_layout", "get_packed_seq_align_size"),
    REPLAY_UTILS: (
        "setup_per_microbatch_replay_forward",
        "patch_topk_router_layer_number",
        "clear_router_replay",
    ),
    ROUTED_EXPERTS: ("RoutedExpertTrace",),
}
WIRE: dict[str, tuple[str, ...]] = {
    GENERATE_WIRE: ("pack_routed_experts", "decode_packed_routed_experts"),
    ROUTED_EXPERTS: ("RoutedExpertTrace",),
}


def checkout_dir(given: str | None) -> tuple[Path | None, str]:
    """(directory holding the PR head's ``skyrl`` package, how it was found), or ``(None,
    reason)``: ``given`` if set, else the mirror's `SKYRL_COMMIT` extracted (cached)."""
    if given:
        path = Path(given).resolve()
        if not (path / "skyrl" / "__init__.py").is_file():
            return None, f"--skyrl-checkout {given}: no skyrl/__init__.py there"
        return path, f"SkyRL checkout {path}"
    mirror = Path(os.environ.get("SKYRL_MIRROR", DEFAULT_MIRROR))
    if not mirror.is_dir():
        return None, f"no --skyrl-checkout and no SkyRL mirror at {mirror} (set SKYRL_MIRROR)"
    cache = Path(tempfile.gettempdir()) / f"r3arrow-skyrl-{SKYRL_COMMIT[:12]}"
    if (cache / _MARKER).is_file():
        return cache, f"SkyRL {SKYRL_REF} ({SKYRL_COMMIT[:9]}) extracted from {mirror}"
    work = Path(tempfile.mkdtemp(prefix="r3arrow-skyrl-", dir=tempfile.gettempdir()))
    archive = subprocess.run(
        ["git", f"--git-dir={mirror}", "archive", SKYRL_COMMIT, "skyrl"],
        capture_output=True,
        check=False,
    )
    if archive.returncode != 0:
        err = archive.stderr.decode(errors="replace").strip().splitlines()[-1:]
        return None, f"git archive {SKYRL_COMMIT[:9]} from {mirror} failed: {' '.join(err)}"
    subprocess.run(["tar", "-x", "-C", str(work)], input=archive.stdout, check=True)
    (work / _MARKER).write_text(SKYRL_COMMIT + "\n")
    try:
        work.rename(cache)  # atomic: a concurrent extraction's rename wins, this copy stays
    except OSError:
        return work, f"SkyRL {SKYRL_REF} ({SKYRL_COMMIT[:9]}) extracted from {mirror}"
    return cache, f"SkyRL {SKYRL_REF} ({SKYRL_COMMIT[:9]}) extracted from {mirror}"


def _bare_package(name: str) -> None:
    """Register package ``name`` (its parent already imported) without running its __init__."""
    parent, _, _ = name.rpartition(".")
    spec = importlib.machinery.PathFinder.find_spec(name, list(sys.modules[parent].__path__))
    if spec is None or spec.submodule_search_locations is None:
        raise ImportError(f"no package {name} under {parent}")
    module = types.ModuleType(name)
    module.__path__ = list(spec.submodule_search_locations)
    module.__spec__ = spec
    module.__file__ = spec.origin
    sys.modules[name] = module
    setattr(sys.modules[parent], name.rpartition(".")[2], module)


def load(
    checkout: Path | None, note: str, modules: dict[str, tuple[str, ...]]
) -> tuple[types.SimpleNamespace | None, str]:
    """``modules`` (name -> attributes it must have) imported from ``checkout``, as a namespace
    by leaf name (``ns.preprocess`` ...) and a note; ``(None, reason)`` when ``checkout`` is
    None, a module does not import or lacks an attribute. ``note``: `checkout_dir`'s."""
    if checkout is None:
        return None, note
    root = str(checkout)
    for name in [m for m in sys.modules if m == "skyrl" or m.startswith("skyrl.")]:
        file = getattr(sys.modules[name], "__file__", None) or ""
        if not file.startswith(root + os.sep):
            del sys.modules[name]  # 0.3.0 (or another tree) imported first: not this code
    if sys.path[:1] != [root]:
        sys.path.insert(0, root)
    importlib.invalidate_caches()
    bypassed: list[str] = []
    try:
        for leaf in modules:
            parts = leaf.split(".")
            for i in range(1, len(parts)):
                pkg = ".".join(parts[:i])
                if pkg in sys.modules:
                    continue
                try:
                    importlib.import_module(pkg)
                except Exception as exc:  # a parent __init__ that needs more than the leaf
                    if i == 1:
                        raise
                    sys.modules.pop(pkg, None)
                    _bare_package(pkg)
                    bypassed.append(f"{pkg} ({type(exc).__name__})")
        mods = {leaf: importlib.import_module(leaf) for leaf in modules}
    except Exception as exc:
        return None, f"SkyRL not importable: {type(exc).__name__}: {str(exc).splitlines()[0]}"
    for leaf, names in modules.items():
        where = str(getattr(mods[leaf], "__file__", ""))
        if not where.startswith(root + os.sep):
            return None, f"{leaf} imported from {where}, not from {root}"
        missing = [n for n in names if not hasattr(mods[leaf], n)]
        if missing:
            return None, f"SkyRL {leaf} at {root} lacks {', '.join(missing)}"
    if bypassed:
        note += "; parent __init__ not run: " + ", ".join(sorted(set(bypassed)))
    ns = types.SimpleNamespace(**{leaf.rpartition(".")[2]: m for leaf, m in mods.items()})
    return ns, note


def patch_layer_numbers(sk: types.SimpleNamespace) -> None:
    """SkyRL's ``patch_topk_router_layer_number``: call before the routers are built."""
    sk.replay_utils.patch_topk_router_layer_number()


def check_layer_numbers(rr: Any, layers: Sequence[int]) -> None:
    """The stage's instances carry SkyRL's global 1-based layer numbers, in order."""
    got = [getattr(inst, "layer_number", None) for inst in rr.global_router_replay_instances]
    want = [g + 1 for g in layers]
    assert got == want, f"SkyRL layer_number patch: expected {want}, found {got}"


def prepare(sk: types.SimpleNamespace, data: dict[str, Any]) -> dict[str, Any]:
    """The PR head's generator output for ``data`` (see the module docstring), built untimed."""
    responses = [r.tolist() for r in data["responses"]]
    routes = []
    for rows, p, n in zip(data["rows"], data["plen"].tolist(), data["n"].tolist(), strict=True):
        trace = sk.routed_experts.RoutedExpertTrace()
        trace.record_generation(
            prompt_token_count=p, generated_token_count=n - p, routed_experts=rows.copy()
        )
        routes.append(trace.finalize(token_count=n, loss_mask=[0] * p + [1] * (n - p)))
    return {
        "prompts": [p.tolist() for p in data["prompts"]],
        "responses": responses,
        "rewards": [[0.0] * (len(r) - 1) + [1.0] for r in responses],
        "loss_masks": [[1] * len(r) for r in responses],
        "routes": routes,
    }


class SkyrlChain:
    """The PR head's trainer and worker steps (module docstring) on ``inputs``; calling it
    runs both and returns the targets installed in the instances (then cleared, as SkyRL)."""

    def __init__(
        self, sk: types.SimpleNamespace, inputs: dict[str, Any], model_config: Any, align: int
    ) -> None:
        self.sk, self.inputs, self.model_config = sk, inputs, model_config
        real: Callable[..., int] = sk.token_metadata.get_packed_seq_align_size

        def align_size(tp_size: int, cp_size: int, fp8_enabled: bool = False) -> int:
            return math.lcm(int(real(tp_size, cp_size, fp8_enabled=fp8_enabled)), align)

        self.real_align, self.align_size = real, align_size
        from megatron.core.transformer.moe.router_replay import RouterReplay

        self.rr = RouterReplay

    def convert(self) -> tuple[Any, Any, Any]:
        """The trainer's step: (routes ``[B, S_max, L, K]``, attention mask, router padding
        mask), as ``convert_to_training_input`` builds them."""
        i, pre = self.inputs, self.sk.preprocess
        out = pre.convert_prompts_responses_to_batch_tensors(
            0, i["prompts"], i["responses"], i["rewards"], i["loss_masks"], None, i["routes"],
            max_seq_len=None,
        )  # fmt: skip
        mask = pre.make_router_padding_mask(out[1], [len(r) for r in i["routes"]])
        return out[6], out[1], mask

    def setup(self, routes: Any, attention_mask: Any, router_padding_mask: Any) -> None:
        """The worker's step (packed), alignment as the module docstring says."""
        tm = self.sk.token_metadata
        tm.get_packed_seq_align_size = self.align_size
        try:
            layout = tm.build_token_metadata_layout(
                attention_mask, attention_mask.device, packed=True, fp8_enabled=False
            )
        finally:
            tm.get_packed_seq_align_size = self.real_align
        self.sk.replay_utils.setup_per_microbatch_replay_forward(
            routes,
            router_padding_mask,
            attention_mask,
            model=None,
            model_config=self.model_config,
            metadata_layout=layout,
            remove_microbatch_padding=True,
        )

    def installed(self) -> list[Any]:
        return [inst.target_topk_idx for inst in self.rr.global_router_replay_instances]

    def __call__(self) -> list[Any]:
        routes, attention_mask, router_padding_mask = self.convert()
        self.setup(routes, attention_mask, router_padding_mask)
        targets = self.installed()
        self.sk.replay_utils.clear_router_replay()
        return targets


def held_bytes(targets: Sequence[Any]) -> int:
    """Bytes of the distinct storages behind ``targets`` (SkyRL's are views of one buffer of
    the stage's layers)."""
    seen: dict[int, int] = {}
    for t in targets:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def verify(
    got: Sequence[Any],
    r3arrow_targets: Sequence[Any],
    data: dict[str, Any],
    layers: Sequence[int],
    align: int,
) -> int:
    """SkyRL's installed targets equal r3arrow's, and the rollout's ids, on every captured
    token of every stage layer (same packed layout, int32); returns the tokens checked."""
    import torch

    n = np.asarray(data["n"], dtype=np.int64)
    padded = (n + align - 1) // align * align
    starts = np.concatenate([[0], np.cumsum(padded)[:-1]])
    captured = np.concatenate(
        [np.arange(s, s + r.shape[0]) for s, r in zip(starts, data["rows"], strict=True)]
    )
    idx = torch.from_numpy(captured)
    rows = torch.from_numpy(np.concatenate(data["rows"]))
    assert len(got) == len(r3arrow_targets) == len(layers), "SkyRL: instance count"
    for j, (g, w) in enumerate(zip(got, r3arrow_targets, strict=True)):
        assert g.dtype == w.dtype == torch.int32, f"SkyRL: dtypes {g.dtype}, {w.dtype}"
        assert g.shape == w.shape, f"SkyRL: layer {layers[j]} shape {g.shape} != {w.shape}"
        assert torch.equal(g[idx], w[idx]), f"SkyRL != r3arrow targets, layer {layers[j]}"
        assert torch.equal(g[idx], rows[:, layers[j], :].to(torch.int32)), "SkyRL != rollout"
    return int(captured.size)
