"""The fast id checks of r3arrow/ids.py against an independent reference.

Both CPU backends run every property (the ``backend`` fixture): numba (the kernels of
`r3arrow._kernels._numba` find the first failing token; skipped where numba is not installed)
and numpy (`_Scratch.has_duplicate` per block). The fast path (the reference check only on
the failing block) must accept and reject exactly what ``np.sort`` + adjacent compare does,
for every dtype, top-k 1..9, both layouts, non-contiguous inputs and router-layer subsets, and must
report the same offender as before the fast path. "First" is, as before: the first failing
block of ``_BLOCK_IDS // (layers * K)`` tokens; within it an out-of-range id first (the
first in ``(k, layer, token)`` order), else the duplicate pair at the smallest distance
``r`` between positions, first in ``(k, layer, token)`` order. `_reference_first` restates
that rule independently; small ``_BLOCK_IDS`` values make multi-block cases small.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from r3arrow import _kernels, ids
from r3arrow.errors import DuplicateExpertError, ExpertRangeError
from r3arrow.ids import check_routes
from r3arrow.spec import RouteSpec
from r3arrow.testing import random_routes, use_backend
from r3arrow.testing.strategies import routes, specs

# The backend fixture is function-scoped but constant across a test's examples.
FAST = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
DTYPES = ["uint8", "int8", "uint16", "int16", "int32", "uint32", "int64", "uint64"]


def check_router_ids(arr: Any, num_experts: int | None, layer_ids: Any, **kw: Any) -> None:
    """`check_routes` without a spec: the router-layer rules."""
    check_routes(arr, num_experts=num_experts, layer_ids=layer_ids, **kw)


def check_distinct_experts(arr: np.ndarray, spec: RouteSpec) -> None:
    """`check_routes` with only the distinct rule."""
    check_routes(arr, spec, rules="distinct")


def _numba_kernels() -> Any:
    """The numba kernels module (`r3arrow._kernels._numba`); skips without numba."""
    pytest.importorskip("numba")
    return importlib.import_module("r3arrow._kernels._numba")


@pytest.fixture(params=["numba", "numpy"])
def backend(request: pytest.FixtureRequest) -> Iterator[str]:
    """Run the test on one CPU backend of the id checks (`r3arrow.testing.use_backend`)."""
    if request.param == "numba":
        pytest.importorskip("numba")
    with use_backend(request.param):
        if request.param == "numba":
            kernels = _kernels.compiled()
            assert kernels is not None
            kernels.warm_up()  # compile (or load the cache) outside the examples
        yield str(request.param)


def _has_duplicate_reference(arr: np.ndarray) -> bool:
    """Some row of ``arr`` ``[..., K]`` repeats an id: sort each row, compare neighbours."""
    if arr.shape[-1] < 2 or arr.size == 0:
        return False
    s = np.sort(arr, axis=-1)
    return bool((s[..., 1:] == s[..., :-1]).any())


def _reference_first(
    arr: np.ndarray, num_experts: int | None, block: int
) -> tuple[str, int, int] | None:
    """``(kind, token, layer index)`` of the offender ``check_router_ids`` reports, or None.

    ``arr`` is ``[tokens, layers, K]``; written with plain loops over positions, not with the
    library's vector code, so it is an independent statement of the rule.
    """
    tokens, n_layers, k = arr.shape
    step = max(1, block // max(1, n_layers * k))
    for a in range(0, tokens, step):
        b = arr[a : a + step].astype(np.int64)
        t_n = b.shape[0]
        bad = [
            (kk, layer, t)
            for kk in range(k)
            for layer in range(n_layers)
            for t in range(t_n)
            if b[t, layer, kk] < 0 or (num_experts is not None and b[t, layer, kk] >= num_experts)
        ]
        if bad:
            _, layer, t = bad[0]
            return "range", a + t, layer
        for r in range(1, k):
            dup = [
                (kk, layer, t)
                for kk in range(k - r)
                for layer in range(n_layers)
                for t in range(t_n)
                if b[t, layer, kk] == b[t, layer, kk + r]
            ]
            if dup:
                _, layer, t = dup[0]
                return "duplicate", a + t, layer
    return None


@st.composite
def id_arrays(draw: st.DrawFn) -> tuple[np.ndarray, int]:
    """``([tokens, layers, K] ids, num_experts)``: distinct rows, then planted duplicates."""
    dtype: np.dtype[Any] = np.dtype(draw(st.sampled_from(DTYPES)))
    k = draw(st.integers(1, 9))
    tokens = draw(st.integers(0, 40))
    n_layers = draw(st.integers(1, 5))
    cap = min(int(np.iinfo(dtype).max), 2**40)
    e = draw(st.integers(k, min(cap, k + draw(st.sampled_from([0, 3, 200, cap])))))
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    if e <= 256:
        keys = rng.random((tokens, n_layers, e))
        arr = np.argsort(keys, axis=-1)[..., :k].astype(dtype)
    else:  # wide id space: random draws (accidental duplicates are cases too)
        arr = rng.integers(0, e, (tokens, n_layers, k), dtype=np.int64).astype(dtype)
    if tokens and k > 1:
        for _ in range(draw(st.integers(0, 3))):
            t = draw(st.integers(0, tokens - 1))
            layer = draw(st.integers(0, n_layers - 1))
            i, j = draw(st.lists(st.integers(0, k - 1), min_size=2, max_size=2, unique=True))
            arr[t, layer, j] = arr[t, layer, i]
    return arr, e


def _raised(fn: Any) -> tuple[str, int, int] | None:
    try:
        fn()
    except ExpertRangeError as exc:
        assert exc.token is not None and exc.layer is not None
        return "range", exc.token, exc.layer
    except DuplicateExpertError as exc:
        assert exc.token is not None and exc.layer is not None
        return "duplicate", exc.token, exc.layer
    return None


@FAST
@given(case=id_arrays(), block=st.sampled_from([16, 64, 1 << 17]), bound=st.booleans())
def test_fast_path_matches_reference(
    case: tuple[np.ndarray, int], block: int, bound: bool, backend: str
) -> None:
    arr, e = case
    num_experts = e if bound else None
    layer_ids = [3 * i + 1 for i in range(arr.shape[1])]  # global ids differ from indices
    with mock.patch.object(ids, "_BLOCK_IDS", block):
        got = _raised(lambda: check_router_ids(arr, num_experts, layer_ids))
        want = _reference_first(arr, num_experts, block)
        if want is not None:
            want = (want[0], want[1], layer_ids[want[2]])
        assert got == want
        out_of_range = _raised(lambda: _range_only(arr, num_experts)) is not None
        assert (got is not None) == (_has_duplicate_reference(arr) or out_of_range)
        # layers first, as the replay boundary passes them: the same offender (both layouts
        # test [K, layers, tokens] per block of tokens)
        lf = _raised(
            lambda: check_router_ids(
                np.ascontiguousarray(arr.transpose(1, 0, 2)),
                num_experts,
                layer_ids,
                layers_first=True,
            )
        )
        assert lf == got
        # read-only and strided inputs (Arrow buffers, sliced tensors): the same offender
        ro = arr.copy()
        ro.setflags(write=False)
        assert _raised(lambda: check_router_ids(ro, num_experts, layer_ids)) == got
        strided = np.repeat(arr, 2, axis=0)[::2]
        assert _raised(lambda: check_router_ids(strided, num_experts, layer_ids)) == got
        lf_view = _raised(
            lambda: check_router_ids(
                arr.transpose(1, 0, 2), num_experts, layer_ids, layers_first=True
            )
        )
        assert lf_view == got


def _range_only(arr: np.ndarray, num_experts: int | None) -> None:
    if num_experts is not None and arr.size and int(arr.max()) >= num_experts:
        raise ExpertRangeError("out of range", token=0, layer=0)


@FAST
@given(case=id_arrays(), offset=st.integers(0, 3), stride=st.integers(1, 3))
def test_has_duplicate_any_layout(case: tuple[np.ndarray, int], offset: int, stride: int) -> None:
    """The block test itself, on contiguous, sliced, strided and layers-first blocks."""
    arr, _ = case
    if arr.shape[2] < 2 or arr.shape[0] == 0:
        return
    views = [
        arr,
        arr[offset::stride],
        arr.transpose(1, 0, 2),
        np.asfortranarray(arr),
    ]
    for v in views:
        if v.shape[0] == 0:
            continue
        scratch = ids._Scratch(v.shape[2], v.shape[0] * v.shape[1], v.dtype)
        assert scratch.has_duplicate(v) == _has_duplicate_reference(v)
        assert scratch.has_duplicate(v) == _has_duplicate_reference(v)  # buffers reused


def _first_duplicate_token_reference(arr: np.ndarray, layers_first: bool) -> int:
    """Smallest token whose row repeats an id (sort + neighbours), -1 for none."""
    s = np.sort(arr, axis=-1)
    bad = (s[..., 1:] == s[..., :-1]).any(axis=-1)
    per_token = bad.any(axis=0) if layers_first else bad.any(axis=1)
    hits = np.flatnonzero(per_token)
    return int(hits[0]) if hits.size else -1


@FAST
@given(case=id_arrays(), offset=st.integers(0, 3), stride=st.integers(1, 3))
def test_numba_first_duplicate_token_any_layout(
    case: tuple[np.ndarray, int], offset: int, stride: int
) -> None:
    """The numba kernel itself: word rows (2/4/8 bytes) and the general path, every layout."""
    kernels = _numba_kernels()
    arr, _ = case
    if arr.shape[0] == 0:
        return
    views = [
        (arr, False),
        (arr[offset::stride], False),
        (arr.transpose(1, 0, 2), True),
        (np.ascontiguousarray(arr.transpose(1, 0, 2)), True),
        (np.asfortranarray(arr), False),
    ]
    for v, layers_first in views:
        if v.size == 0:
            continue
        want = _first_duplicate_token_reference(v, layers_first) if v.shape[2] > 1 else -1
        assert kernels.first_duplicate_token(v, layers_first) == want


@pytest.mark.parametrize("layers_first", [False, True])
@pytest.mark.parametrize(("k", "dtype"), [(8, "uint8"), (4, "uint16"), (2, "int32"), (6, "uint8")])
def test_numba_kernel_across_chunks(k: int, dtype: str, layers_first: bool) -> None:
    """Many chunks of rows (1024 per chunk): the first duplicate in a late chunk, exactly."""
    kernels = _numba_kernels()
    rng = np.random.default_rng(k)
    arr = np.argsort(rng.random((3000, 3, 16)), axis=-1)[..., :k].astype(dtype)
    assert kernels.first_duplicate_token(arr, False) == -1
    arr[2999, 0, 1] = arr[2999, 0, 0]
    arr[2500, 2, k - 1] = arr[2500, 2, 0]
    x = np.ascontiguousarray(arr.transpose(1, 0, 2)) if layers_first else arr
    assert kernels.first_duplicate_token(x, layers_first) == 2500


def test_backend_choice_env_and_missing_numba(monkeypatch: pytest.MonkeyPatch) -> None:
    """``R3ARROW_NO_NUMBA=1`` forces numpy; without numba, numpy; else the numba kernels.

    The loader decides once (cached); ``set_backend(None)`` makes it decide again here."""
    saved = _kernels.set_backend(None)
    try:
        monkeypatch.setenv("R3ARROW_NO_NUMBA", "1")
        assert _kernels.compiled() is None and _kernels.backend() == "numpy"
        _kernels.set_backend(None)
        monkeypatch.delenv("R3ARROW_NO_NUMBA")
        monkeypatch.setitem(sys.modules, "r3arrow._kernels._numba", None)  # as if numba absent
        assert _kernels.compiled() is None
        monkeypatch.undo()
        _kernels.set_backend(None)
        monkeypatch.delenv("R3ARROW_NO_NUMBA", raising=False)
        pytest.importorskip("numba")
        kernels = _kernels.compiled()
        assert kernels is not None and kernels.__name__ == "r3arrow._kernels._numba"
        assert _kernels.backend() == "numba"
        with use_backend("numpy"):
            assert _kernels.compiled() is None
        assert _kernels.compiled() is kernels
        with pytest.raises(ValueError, match="backend"), use_backend("cuda"):  # type: ignore[arg-type]
            pass
    finally:
        _kernels.restore(saved)


def test_import_r3arrow_does_not_import_numba() -> None:
    """numba loads on the first CPU check, not with ``import r3arrow`` (nor ``r3arrow.ids``)."""
    code = "import sys, r3arrow, r3arrow.ids; print('numba' in sys.modules)"
    env = {k: v for k, v in os.environ.items() if k != "R3ARROW_NO_NUMBA"}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("k", [2, 3, 8])
def test_duplicate_in_last_block_only(dtype: str, k: int, backend: str) -> None:
    """A duplicate far from the start is found, in the right block, with the message as before."""
    rng = np.random.default_rng(k)
    arr = np.argsort(rng.random((300, 4, 16)), axis=-1)[..., :k].astype(dtype)
    arr[297, 2, k - 1] = arr[297, 2, 0]
    with mock.patch.object(ids, "_BLOCK_IDS", 64), pytest.raises(DuplicateExpertError) as info:
        check_router_ids(arr, 16, [0, 1, 5, 7], what="replay target", token_offset=10)
    row = arr[297, 2].tolist()
    assert info.value.message == (
        f"replay target: expected {k} distinct experts per token and layer, found {row} "
        f"(token 307, layer 5)"
    )
    assert (info.value.token, info.value.layer) == (307, 5)


def test_first_offender_is_today_rule_not_row_major(backend: str) -> None:
    """Two duplicates in one block: the smaller distance wins, then (k, layer, token) order."""
    arr = np.tile(np.arange(4, dtype=np.uint8), (6, 3, 1))
    arr[1, 2] = [0, 1, 2, 0]  # distance 3, earlier token
    arr[4, 0] = [0, 0, 2, 3]  # distance 1, later token: reported first
    with pytest.raises(DuplicateExpertError, match=r"found \[0, 0, 2, 3\] \(token 4, layer 0\)"):
        check_router_ids(arr, None, [0, 1, 2])
    arr[4, 0] = [0, 1, 2, 3]
    arr[5, 1] = [3, 1, 2, 3]  # distance 3 as well, k position 0 like token 1: layer 1 < 2
    with pytest.raises(DuplicateExpertError, match=r"\(token 5, layer 1\)"):
        check_router_ids(arr, None, [0, 1, 2])


def test_range_before_duplicate_in_a_block(backend: str) -> None:
    arr = np.tile(np.arange(3, dtype=np.int16), (5, 2, 1))
    arr[0, 0] = [1, 1, 2]
    arr[3, 1, 2] = -4
    with pytest.raises(ExpertRangeError, match=r"found -4 \(token 3, layer 1\)"):
        check_router_ids(arr, 8, [0, 1])


@FAST
@given(data=st.data(), spec=specs(max_layers=5, max_topk=9))
def test_check_distinct_experts_on_router_layer_subsets(
    data: st.DataObject, spec: Any, backend: str
) -> None:
    """Router-layer subsets: dense layers never count, planted router duplicates always do."""
    arr = data.draw(routes(spec, min_rows=1, max_rows=20))
    check_distinct_experts(arr, spec)
    dense = spec.dense_layers
    if dense and spec.topk > 1:
        bad = arr.copy()
        bad[:, dense[0]] = 0  # zeros on a dense layer: fine
        check_distinct_experts(bad, spec)
    if spec.topk > 1:
        t = data.draw(st.integers(0, arr.shape[0] - 1))
        layer = data.draw(st.sampled_from(spec.router_layers))
        arr[t, layer, 1] = arr[t, layer, 0]
        with pytest.raises(DuplicateExpertError) as info:
            check_distinct_experts(arr, spec)
        assert info.value.layer == layer and info.value.token == t


def test_torch_cpu_tensor_same_as_numpy(backend: str) -> None:
    torch = pytest.importorskip("torch")
    spec = RouteSpec(num_layers=3, topk=4, num_experts=32)
    arr = random_routes(np.random.default_rng(0), 50, spec).astype(np.int64)
    arr[17, 1, 3] = arr[17, 1, 1]
    for x in (arr, torch.from_numpy(arr)):
        with pytest.raises(DuplicateExpertError, match=r"\(token 17, layer 1\)"):
            check_router_ids(x, 32, [0, 1, 2])


# ------------------------------------------------------- the fused collation pass
@pytest.mark.parametrize(
    ("dtype", "k", "experts"),
    [("uint8", 8, 128), ("uint8", 8, 130), ("uint16", 4, 999), ("int32", 2, 7), ("uint8", 3, 9)],
)
def test_gather_router_ids_literal(backend: str, dtype: str, k: int, experts: int) -> None:
    """Rows 2 and 0 at two local layers, a dummy position; then one bad id per rule."""
    src = np.zeros((3, 3, k), dtype=dtype)
    for t in range(3):
        for layer in range(3):
            src[t, layer] = (np.arange(k) + t + 2 * layer) % experts
    pos = np.array([[2], [-1], [0]], dtype=np.int64)
    out = np.full((2, 3, 1, k), -7, dtype=np.int32)
    ids.gather_router_ids(src, np.array([2, 0]), pos, out, experts, [20, 0])
    assert out[:, :, 0].tolist() == [
        [src[2, 2].tolist(), list(range(k)), src[0, 2].tolist()],
        [src[2, 0].tolist(), list(range(k)), src[0, 0].tolist()],
    ]
    dup = src.copy()
    dup[0, 0, k - 1] = dup[0, 0, 0]
    with pytest.raises(DuplicateExpertError) as info:
        ids.gather_router_ids(dup, np.array([2, 0]), pos, out, experts, [20, 0])
    assert (info.value.token, info.value.layer) == (0, 0)
    high = src.copy()
    high[2, 2, 1] = experts
    with pytest.raises(ExpertRangeError, match=f"found {experts}") as rinfo:
        ids.gather_router_ids(high, np.array([2, 0]), pos, out, experts, [20, 0])
    assert (rinfo.value.token, rinfo.value.layer) == (2, 20)
    ids.gather_router_ids(high, np.array([0]), pos, out[:1].copy(), experts, [0])  # not gathered


# ------------------------------------------------- the lean per-turn check (capture)
def _reference_routes(arr: np.ndarray, spec: RouteSpec) -> tuple[int, int]:
    """`check_routes` without its lean path: the two rules as written."""
    lo_hi = check_routes(arr, spec, rules="range")
    check_distinct_experts(arr, spec)
    return lo_hi


@FAST
@given(
    data=st.data(),
    shape=st.sampled_from([("uint8", 8, 128), ("uint8", 8, 200), ("uint8", 8, 256)]),
    edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), max_size=3),
    tokens=st.integers(1, 40),
)
def test_lean_checks_match_the_reference(
    backend: str,
    data: st.DataObject,
    shape: tuple[str, int, int],
    edits: list[tuple[int, int]],
    tokens: int,
) -> None:
    """`check_routes` and its ``exact=False`` form (fused `scan_top8` for top-8 uint8) raise what
    the reference raises, token and layer included; valid: the exact max / an upper bound of it
    below num_experts (exact without num_experts)."""
    _, k, experts = shape
    spec = RouteSpec(num_layers=3, topk=k, num_experts=experts)
    seed = data.draw(st.integers(0, 2**32 - 1))
    arr = random_routes(np.random.default_rng(seed), tokens, spec)
    flat = arr.reshape(-1)
    for where, value in edits:  # may break the range or the distinct rule, or neither
        flat[where % flat.size] = value
    want = _raised(lambda: _reference_routes(arr, spec))
    assert _raised(lambda: ids.check_routes(arr, spec)) == want
    assert _raised(lambda: check_routes(arr, spec, exact=False)[1]) == want
    if want is None:
        hi = int(arr.max())
        assert ids.check_routes(arr, spec) == (0, hi)
        assert hi <= check_routes(arr, spec, exact=False)[1] < experts
        open_spec = RouteSpec(num_layers=3, topk=k, num_experts=None)
        assert check_routes(arr, open_spec, exact=False)[1] == hi


def test_scan_top8_literal() -> None:
    """The fused pass on literal rows: a duplicate, an id at the bound, the OR bound."""
    kernels = _numba_kernels()
    rows = np.array([[0, 1, 2, 3, 4, 5, 6, 7], [64, 9, 10, 11, 12, 13, 14, 15]], dtype=np.uint8)
    assert kernels.scan_top8(rows, 128) == 64  # per lane OR, the largest: 0 | 64
    rows[0, 1] = 66  # lane 1: 66 | 9 = 75, above every id
    assert kernels.scan_top8(rows, 128) == 75
    assert kernels.scan_top8(rows, 70) == 69  # capped: every id passed < 70
    assert kernels.scan_top8(rows, 66) is None  # 66 is out of range
    assert kernels.scan_top8(rows, None) == 75
    dup = rows.copy()
    dup[1, 7] = 64  # lanes 0 and 7: distance 1 the other way round
    assert kernels.scan_top8(dup, 256) is None
    assert kernels.scan_top8(rows.astype(np.uint16), 128) is None  # not top-8 uint8


def test_scan_top8_every_lane_pair() -> None:
    """A repeat at each of the 28 lane pairs, in a row of the 64-byte vector loop and in the
    remainder row, is caught; the rows without one pass (their OR's largest lane: 15)."""
    kernels = _numba_kernels()
    clean = np.tile(np.arange(8, dtype=np.uint8), (9, 1))
    clean[1::2] += 8  # rows 8..15 and 0..7 alternate: the OR is 15 in every lane
    assert kernels.scan_top8(clean, None) == 15
    for row in (3, 8):  # 8: the remainder after the 8-row vector
        for a in range(8):
            for b in range(a + 1, 8):
                rows = clean.copy()
                rows[row, b] = rows[row, a]
                assert kernels.scan_top8(rows, None) is None, (row, a, b)
                assert kernels.scan_top8(rows, 100) is None, (row, a, b)


def _scan_top8_reference(rows: np.ndarray, bound: int | None) -> int | None:
    """`scan_top8`'s contract in numpy: None when an id is ``>= bound`` or a row repeats an id,
    else the largest lane of the OR of all rows, capped at ``bound - 1``."""
    flat = rows.reshape(-1, 8)
    s = np.sort(flat, axis=1)
    if (bound is not None and (flat >= bound).any()) or (s[:, 1:] == s[:, :-1]).any():
        return None
    top = int(np.bitwise_or.reduce(flat, axis=0).max()) if flat.size else 0
    return top if bound is None else min(top, bound - 1)


@FAST
@given(
    n_rows=st.integers(0, 70),
    lead=st.sampled_from([(), (1,), (3,)]),
    bound=st.sampled_from([None, 1, 9, 66, 100, 128, 200, 255, 256, 300]),
    dup=st.none() | st.tuples(st.integers(0, 10**6), st.integers(0, 7), st.integers(1, 7)),
    highs=st.lists(
        st.tuples(st.integers(0, 10**6), st.integers(0, 7), st.integers(0, 255)), max_size=2
    ),
    seed=st.integers(0, 2**32 - 1),
    readonly=st.booleans(),
)
def test_scan_top8_matches_numpy(
    n_rows: int,
    lead: tuple[int, ...],
    bound: int | None,
    dup: tuple[int, int, int] | None,
    highs: list[tuple[int, int, int]],
    seed: int,
    readonly: bool,
) -> None:
    """The vector scan against numpy on random distinct rows (row counts on both sides of the
    8-row vectors, so main loop and remainder), with a duplicate planted at any lane pair
    in any row and ids set anywhere in 0..255 (in or out of range)."""
    kernels = _numba_kernels()
    rng = np.random.default_rng(seed)
    rows = np.argsort(rng.random((max((1, *lead)) * n_rows, 256)), axis=1)[:, :8]
    rows = rows.astype(np.uint8)
    if rows.shape[0]:
        if dup is not None:  # lanes a and a + d (mod 8): every distance the rotations cover
            row, a, d = dup
            rows[row % rows.shape[0], (a + d) % 8] = rows[row % rows.shape[0], a]
        for row, lane, value in highs:
            rows[row % rows.shape[0], lane] = value
    x = rows.reshape(*lead, -1, 8) if lead else rows
    x.setflags(write=not readonly)
    assert kernels.scan_top8(x, bound) == _scan_top8_reference(x, bound)
