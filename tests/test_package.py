"""The package surface: what ``import r3arrow`` loads, ``__all__``, ``dir``, lazy names."""

from __future__ import annotations

import importlib
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

import r3arrow
from r3arrow.ids import check_routes
from r3arrow.spec import SPEC_METADATA_KEY, RouteSpec
from r3arrow.testing import assert_rollouts_equal, random_rollouts
from r3arrow.testing.strategies import rollout_tables, routes, specs

# Optional third-party packages that the core (and r3arrow.testing) must never load.
HEAVY = ("torch", "polars", "httpx", "megatron", "ray", "matplotlib", "tqdm", "hypothesis")

# The eager public API, pinned: adding or removing a name is a deliberate change here.
EXPECTED_ALL = [
    "R3ArrowError",
    "RouteSpec",
    "RouteTrace",
    "TurnStore",
    "iter_rollouts",
    "read_rollouts",
    "rollout_table",
    "validate_rollouts",
    "write_rollouts",
]

# Names loaded on first access, and the module that defines each.
LAZY_NAMES = {
    "EngineClient": "r3arrow.client",
    "MegatronCollator": "r3arrow.collate",
}
LAZY_MODULES = (
    "adapters",
    "cli",
    "client",
    "collate",
    "megatron",
    "plot",
    "ray",
    "rollout",
    "stats",
)


def _run(code: str) -> str:
    """Run ``code`` in a fresh interpreter; return its stdout (fails the test on an error)."""
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


_LOADED = f"import sys; print(sorted(m for m in {HEAVY!r} if m in sys.modules))"


@pytest.mark.parametrize(
    "statement", ["import r3arrow", "from r3arrow import *"], ids=["import", "star"]
)
def test_import_loads_no_heavy_dependency(statement: str) -> None:
    assert _run(f"{statement}\n{_LOADED}") == "[]"


_CORE_WORKFLOW = """
import sys, tempfile, pathlib
for name in {heavy!r}:
    sys.modules[name] = None  # as if not installed: importing it raises ModuleNotFoundError
import numpy as np
import r3arrow
from r3arrow import codec
from r3arrow.testing import assert_rollouts_equal, random_routes

spec = r3arrow.RouteSpec(num_layers=3, topk=2, num_experts=8, moe_layers=(1, 2))
rng = np.random.default_rng(0)
trace = r3arrow.RouteTrace(spec)
rows = random_routes(rng, 5 - 0 + 3 - 1, spec)
trace.record(codec.decode_vllm(codec.encode_vllm(rows), spec), prompt_tokens=5, generated_tokens=3)
routes = trace.finalize(num_tokens=8, loss_mask=[0] * 5 + [1, 1, 0])
table = r3arrow.rollout_table(
    trajectory_id=["a", "b"], group_id=["g", "g"], prompt_ids=[[1] * 5, [1] * 5],
    response_ids=[[2] * 3, [2] * 3], loss_mask=[[1, 1, 0], [1, 1, 0]], reward=[0.0, 1.0],
    routes=[routes, routes], spec=spec,
)
assert r3arrow.table.filter_groups(table).num_rows == 2
assert len(r3arrow.microbatch.split_microbatches(table, max_tokens=8)) == 2
with tempfile.TemporaryDirectory() as d:
    path = r3arrow.write_rollouts(table, pathlib.Path(d) / "r.parquet")
    assert_rollouts_equal(r3arrow.read_rollouts(path), table)
print("ok")
"""


def test_core_works_without_optional_dependencies() -> None:
    """Capture, codec, table, sampling, microbatching and Parquet with every optional
    package made unimportable: the inference-side install (README, "Dependencies")."""
    assert _run(_CORE_WORKFLOW.format(heavy=HEAVY)) == "ok"


def test_star_import_binds_exactly_all() -> None:
    code = (
        "before = set(globals())\n"
        "from r3arrow import *\n"
        "import r3arrow\n"
        "new = sorted(set(globals()) - before - {'before', 'r3arrow'})\n"
        "print(new == sorted(r3arrow.__all__))"
    )
    assert _run(code) == "True"


def test_all_is_pinned_and_sorted() -> None:
    assert r3arrow.__all__ == EXPECTED_ALL
    assert sorted(EXPECTED_ALL) == EXPECTED_ALL
    assert not set(EXPECTED_ALL) & set(LAZY_NAMES)


def test_every_name_in_all_resolves() -> None:
    for name in r3arrow.__all__:
        assert getattr(r3arrow, name) is not None, name


def test_dir_lists_lazy_names_and_modules() -> None:
    names = dir(r3arrow)
    assert set(EXPECTED_ALL) <= set(names)
    assert set(LAZY_NAMES) <= set(names)
    assert set(LAZY_MODULES) <= set(names)
    assert names == sorted(names)


def test_dir_does_not_import_integrations() -> None:
    assert _run(f"import r3arrow\ndir(r3arrow)\n{_LOADED}") == "[]"


@pytest.mark.parametrize("name", sorted(LAZY_NAMES))
def test_lazy_name_resolves_to_its_module(name: str) -> None:
    value = getattr(r3arrow, name)
    module = sys.modules[LAZY_NAMES[name]]
    assert getattr(module, name) is value


@pytest.mark.parametrize("name", LAZY_MODULES)
def test_lazy_module_attribute(name: str) -> None:
    assert getattr(r3arrow, name) is sys.modules[f"r3arrow.{name}"]


def test_unknown_attribute_raises_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        _ = r3arrow.nope


@pytest.mark.parametrize(
    ("attribute", "blocked", "extra"),
    [
        ("stats", "polars", "stats"),
        ("EngineClient", "httpx", "client"),
        ("MegatronCollator", "torch", "torch"),
        ("plot", "polars", "plot"),
    ],
)
def test_missing_optional_dependency_names_the_extra(
    attribute: str, blocked: str, extra: str
) -> None:
    # ``None`` in sys.modules makes ``import blocked`` fail as if it were not installed.
    code = (
        "import sys\n"
        f"sys.modules[{blocked!r}] = None\n"
        "import r3arrow\n"
        "try:\n"
        f"    getattr(r3arrow, {attribute!r})\n"
        "except ImportError as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    out = _run(code)
    assert out.startswith("ImportError ")
    assert out.endswith(f" needs {blocked}: pip install 'r3arrow[{extra}]'")


# ------------------------------------------------------------------ r3arrow.testing
def test_small_rollouts_fixture_is_valid(small_rollouts: pa.Table, small_spec: RouteSpec) -> None:
    assert r3arrow.validate_rollouts(small_rollouts) == small_spec
    assert small_rollouts.num_rows == 4


def test_assert_rollouts_equal_ignores_chunking(small_rollouts: pa.Table) -> None:
    t = small_rollouts
    assert_rollouts_equal(t, pa.concat_tables([t.slice(0, 1), t.slice(1)]))
    assert_rollouts_equal(t.to_batches()[0], t)


def test_assert_rollouts_equal_names_what_differs(small_rollouts: pa.Table) -> None:
    t = small_rollouts
    i = t.schema.get_field_index("reward")
    other = t.set_column(i, t.schema.field(i), pa.array([0.5] * t.num_rows))
    with pytest.raises(AssertionError, match="column 'reward' differs: first difference at row 0"):
        assert_rollouts_equal(t, other)
    wider = RouteSpec(num_layers=4, topk=2, num_experts=9, moe_layers=(1, 2, 3))
    meta = {**(t.schema.metadata or {}), SPEC_METADATA_KEY: wider.to_json()}
    with pytest.raises(AssertionError, match="specs differ"):
        assert_rollouts_equal(t, t.replace_schema_metadata(meta))
    with pytest.raises(AssertionError, match="schemas differ"):
        assert_rollouts_equal(t, t.drop_columns(["reward"]))
    with pytest.raises(AssertionError, match="row counts differ"):
        assert_rollouts_equal(t, t.slice(1))


def test_random_rollouts_rejects_impossible_shapes(small_spec: RouteSpec) -> None:
    rng = np.random.default_rng(0)
    with pytest.raises(ValueError, match=r"shapes\[0\]: expected 0 <= captured"):
        random_rollouts(rng, small_spec, [(2, 2, 5)])


@given(table=rollout_tables())
def test_rollout_tables_strategy_draws_valid_tables(table: pa.Table) -> None:
    r3arrow.validate_rollouts(table)


@given(data=st.data(), spec=st.from_type(RouteSpec))
def test_routes_strategy_draws_valid_routes(data: st.DataObject, spec: RouteSpec) -> None:
    arr = data.draw(routes(spec, min_rows=1))
    assert arr.dtype == spec.dtype
    assert arr.shape[1:] == (spec.num_layers, spec.topk)
    check_routes(arr, spec, rules="range")


@given(spec=specs(widths=("uint16",), dense_layers=False))
def test_specs_strategy_honours_its_options(spec: RouteSpec) -> None:
    assert spec.dtype == np.dtype(np.uint16)
    assert spec.moe_layers is None or len(spec.moe_layers) == spec.num_layers


# ------------------------------------------------------------------ one home per public name
def _public_modules() -> list[str]:
    """Every module of the data plane without a private part in its name (not the lab)."""
    root = Path(r3arrow.__file__).parent
    out = []
    for p in sorted(root.rglob("*.py")):
        parts = p.relative_to(root.parent).with_suffix("").parts
        if any(x.startswith("_") and x != "__init__" for x in parts) or parts[1:2] == ("testing",):
            continue
        out.append(".".join(x for x in parts if x != "__init__"))
    return out


def _faces() -> dict[str, list[str]]:
    return {m: list(importlib.import_module(m).__all__) for m in _public_modules()}


def test_every_public_module_declares_its_face() -> None:
    for module in _public_modules():
        assert hasattr(importlib.import_module(module), "__all__"), module


def test_every_public_name_has_one_home() -> None:
    """A name is exported by exactly one public module, plus the short list of `r3arrow`."""
    homes: dict[str, list[str]] = {}
    for module, names in _faces().items():
        if module == "r3arrow":
            continue
        for name in names:
            homes.setdefault(name, []).append(module)
    assert {n: m for n, m in homes.items() if len(m) > 1} == {}
    assert set(r3arrow.__all__) <= set(homes)


def test_public_objects_report_their_home() -> None:
    """Reprs, tracebacks and docs show ``r3arrow.collate.MegatronCollator``, never the private
    module that defines it."""
    for module, names in _faces().items():
        namespace = importlib.import_module(module)
        for name in names:
            obj = getattr(namespace, name)
            if not isinstance(obj, type | types.FunctionType):
                continue
            if module == "r3arrow":
                assert not obj.__module__.split(".")[-1].startswith("_"), (name, obj.__module__)
                continue
            assert obj.__module__ == module, (module, name, obj.__module__)
