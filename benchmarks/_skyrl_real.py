"""SkyRL's own collation chain, run from the installed ``skyrl`` package (nothing copied).

The third side of issue 13's chain (``_chain.run_chain(args, "skyrl")``): from the same
per-trajectory routes to per-layer int32 targets in real megatron-core ``RouterReplay``
instances, through SkyRL's functions, called as its trainer and Megatron worker call them:

1. ``skyrl.train.dataset.preprocess.convert_prompts_responses_to_batch_tensors``: the
   trainer's batch build (``RayPPOTrainer.convert_to_training_input``): left-padded
   sequences, attention mask, response-aligned masks and rewards, and the dense left-padded
   ``[B, S_max, L, K]`` routes tensor (built int32, scanned for its max, downcast to uint8);
2. the int32 widening SkyRL's Megatron worker applies to each micro-batch before the forward
   (``megatron_worker.py``: ``rollout_expert_indices.to(torch.int32)``; one line inline in a
   method, so the one line is here);
3. ``skyrl.backends.skyrl_train.utils.replay_utils.setup_per_microbatch_replay_forward``
   with ``remove_microbatch_padding=True`` (packed): ``_pack_replay_indices`` (left padding
   removed, per-sequence alignment, all ``L`` layers), ``_split_replay_indices`` (``[L, T, K]``
   contiguous, one ``[T, K]`` view per layer) and ``set_target_indices`` on each of the stage's
   instances, then ``REPLAY_FORWARD``; SkyRL's ``clear_router_replay`` after reading the
   targets back (r3arrow's ``replay_schedule`` clears too).

How the run is set up, the only departures from a SkyRL training run:

* **PP stage.** The harness is a gloo world of one with model parallel 1 x 1, so SkyRL's
  ``_get_current_pp_stage_layer_range`` returns all ``L`` layers for PP rank 0, not the 12
  instances of the stage: SkyRL takes its dense-mismatch path, which maps each instance
  through its ``layer_number``. ``patch_topk_router_layer_number`` (SkyRL's patch, applied
  before the routers are built, as its worker does) gives the stage's instances the global
  1-based numbers ``13..24`` from ``TopKRouter.set_layer_number``; `check_layer_numbers`
  asserts it. On a real PP=4 rank 1, SkyRL would take ``per_layer_data[12:24]`` instead: the
  same targets, after the same all-layer pack and split, so the same cost.
* **Alignment.** SkyRL aligns packed sequences to ``get_packed_seq_align_size(tp, cp, fp8)``
  (``tp`` here, 1). For the chain's ``align`` (8), ``replay_utils``' name is wrapped for the
  call to return ``lcm(SkyRL's own value, align)``; no sequence split (TP stays 1).
* **Routes as numpy rows.** SkyRL's generator hands over nested Python lists; its converter
  tests each trajectory's truth (``if x``), reads ``len(x[0])``, ``len(x[0][0])`` and calls
  ``torch.tensor(x[:n], dtype=torch.int32)``. Each trajectory's uint8 ``[n - 1, L, K]`` array
  goes in through `Rows`, a three-method sequence view (truth = non-empty, as a list's;
  indexing = the array's), so that call converts the array: much faster than nested lists
  (favours SkyRL). Prompts, responses, loss masks and per-token rewards are Python lists,
  built outside the timing, as SkyRL's generator output holds them.
* **Import.** On Python 3.11 with ``skyrl`` installed without its dependencies, two parent
  packages' ``__init__`` fail (``skyrl.backends`` imports the Tinker backend, whose pydantic
  models need ``typing_extensions.TypedDict`` on Python < 3.12; ``skyrl.train.dataset``
  imports ``loguru``/``datasets``), though the modules used import only torch, megatron-core,
  jaxtyping and transformers. `load` imports every package normally and, where a parent's
  ``__init__`` raises, registers that package bare (its real directory, its ``__init__`` not
  run) so the installed module files below it import unchanged; the note says which.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import math
import sys
import types
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

PREPROCESS = "skyrl.train.dataset.preprocess"
REPLAY_UTILS = "skyrl.backends.skyrl_train.utils.replay_utils"
_NEEDED = {
    PREPROCESS: ("convert_prompts_responses_to_batch_tensors",),
    REPLAY_UTILS: (
        "setup_per_microbatch_replay_forward",
        "patch_topk_router_layer_number",
        "clear_router_replay",
        "get_packed_seq_align_size",
        "_pack_replay_indices",
        "_split_replay_indices",
        "_get_current_pp_stage_layer_range",
    ),
}


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


def load() -> tuple[types.SimpleNamespace | None, str]:
    """SkyRL's two modules as ``(namespace(preprocess, replay_utils, version), note)``, or
    ``(None, reason)`` when skyrl or a dependency of those modules is unavailable."""
    bypassed: list[str] = []
    try:
        for leaf in _NEEDED:
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
        mods = {leaf: importlib.import_module(leaf) for leaf in _NEEDED}
    except Exception as exc:
        return None, f"skyrl not importable: {type(exc).__name__}: {str(exc).splitlines()[0]}"
    for leaf, names in _NEEDED.items():
        missing = [n for n in names if not hasattr(mods[leaf], n)]
        if missing:
            return None, f"skyrl {leaf} lacks {', '.join(missing)}"
    version = str(getattr(sys.modules["skyrl"], "__version__", "?"))
    note = f"skyrl {version} from {sys.modules['skyrl'].__path__[0]}"
    if bypassed:
        note += "; parent __init__ not run: " + ", ".join(bypassed)
    ns = types.SimpleNamespace(
        preprocess=mods[PREPROCESS], replay_utils=mods[REPLAY_UTILS], version=version
    )
    return ns, note


def patch_layer_numbers(sk: types.SimpleNamespace) -> None:
    """SkyRL's ``patch_topk_router_layer_number``: call before the routers are built."""
    sk.replay_utils.patch_topk_router_layer_number()


def check_layer_numbers(rr: Any, layers: Sequence[int]) -> None:
    """The stage's instances carry SkyRL's global 1-based layer numbers, in order."""
    got = [getattr(inst, "layer_number", None) for inst in rr.global_router_replay_instances]
    want = [g + 1 for g in layers]
    assert got == want, f"SkyRL layer_number patch: expected {want}, found {got}"


class Rows:
    """One trajectory's ``[n - 1, L, K]`` array as the list SkyRL's converter expects."""

    def __init__(self, rows: np.ndarray) -> None:
        self.rows = rows

    def __len__(self) -> int:
        return int(self.rows.shape[0])

    def __bool__(self) -> bool:
        return int(self.rows.shape[0]) > 0

    def __getitem__(self, key: Any) -> Any:
        return self.rows[key]


def prepare(data: dict[str, Any]) -> dict[str, Any]:
    """SkyRL generator-output-shaped inputs (see the module docstring), built untimed."""
    responses = [r.tolist() for r in data["responses"]]
    return {
        "prompts": [p.tolist() for p in data["prompts"]],
        "responses": responses,
        "rewards": [[0.0] * (len(r) - 1) + [1.0] for r in responses],
        "loss_masks": [[1] * len(r) for r in responses],
        "routes": [Rows(r) for r in data["rows"]],
    }


class SkyrlChain:
    """SkyRL's steps 1-3 (module docstring) on ``inputs``; calling it runs all three and
    returns the targets installed in ``rr``'s instances (then cleared, as SkyRL does)."""

    def __init__(
        self, sk: types.SimpleNamespace, inputs: dict[str, Any], model_config: Any, align: int
    ) -> None:
        self.sk, self.inputs, self.model_config = sk, inputs, model_config
        self.tokenizer = types.SimpleNamespace(pad_token_id=0)  # all the converter reads
        real: Callable[..., int] = sk.replay_utils.get_packed_seq_align_size

        def align_size(tp_size: int, cp_size: int, fp8_enabled: bool = False) -> int:
            return math.lcm(int(real(tp_size, cp_size, fp8_enabled=fp8_enabled)), align)

        self.real_align, self.align_size = real, align_size
        from megatron.core.transformer.moe.router_replay import RouterReplay

        self.rr = RouterReplay

    def convert(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 1: SkyRL's batch tensors; returns (dense routes uint8, attention mask)."""
        i = self.inputs
        out = self.sk.preprocess.convert_prompts_responses_to_batch_tensors(
            self.tokenizer, i["prompts"], i["responses"], i["rewards"], i["loss_masks"],
            None, i["routes"],
        )  # fmt: skip
        return out[6], out[1]

    def setup(self, dense_int32: torch.Tensor, attention_mask: torch.Tensor) -> None:
        """Step 3: SkyRL's per-microbatch replay setup (packed), alignment as documented."""
        ru = self.sk.replay_utils
        ru.get_packed_seq_align_size = self.align_size
        try:
            ru.setup_per_microbatch_replay_forward(
                dense_int32, attention_mask, self.model_config, remove_microbatch_padding=True
            )
        finally:
            ru.get_packed_seq_align_size = self.real_align

    def installed(self) -> list[torch.Tensor]:
        return [inst.target_topk_idx for inst in self.rr.global_router_replay_instances]

    def __call__(self) -> list[torch.Tensor]:
        dense, mask = self.convert()
        self.setup(dense.to(torch.int32), mask)  # step 2: the worker's widening
        targets = self.installed()
        self.sk.replay_utils.clear_router_replay()
        return targets


def held_bytes(targets: Sequence[torch.Tensor]) -> int:
    """Bytes of the distinct storages behind ``targets`` (SkyRL's are views of one
    all-layer buffer)."""
    seen: dict[int, int] = {}
    for t in targets:
        s = t.untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def verify(
    got: Sequence[torch.Tensor],
    r3arrow_targets: Sequence[torch.Tensor],
    data: dict[str, Any],
    layers: Sequence[int],
    align: int,
) -> int:
    """SkyRL's installed targets equal r3arrow's, and the rollout's ids, on every captured
    token of every stage layer (same packed layout, int32); returns the tokens checked."""
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
