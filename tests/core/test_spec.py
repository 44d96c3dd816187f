"""RouteSpec: storage dtype, Arrow types, validation, metadata, numpy<->Arrow, id checks."""

from __future__ import annotations

from typing import cast

import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

from r3arrow._routes import as_route_rows, dummy_route_row, validate_layers
from r3arrow.errors import (
    DuplicateExpertError,
    ExpertRangeError,
    R3ArrowError,
    RouteDTypeError,
    RouteShapeError,
    SchemaError,
)
from r3arrow.ids import check_routes
from r3arrow.spec import (
    SPEC_METADATA_KEY,
    RouteSpec,
    numpy_to_routes,
    routes_to_numpy,
    storage_dtype_for,
)
from r3arrow.testing import random_routes

# ------------------------------------------------------------------- dtype


@pytest.mark.parametrize(
    ("num_experts", "dtype"),
    [
        (1, np.uint8),
        (8, np.uint8),
        (128, np.uint8),
        (256, np.uint8),
        (257, np.uint16),
        (300, np.uint16),
        (65536, np.uint16),
        (65537, np.int32),
    ],
)
def test_storage_dtype_is_smallest_that_holds_all_ids(num_experts: int, dtype: type) -> None:
    assert storage_dtype_for(num_experts) == np.dtype(dtype)
    spec = RouteSpec(num_layers=2, topk=1, num_experts=num_experts)
    assert spec.dtype == np.dtype(dtype)
    assert np.iinfo(spec.dtype).max >= num_experts - 1


def test_storage_dtype_too_many_experts() -> None:
    with pytest.raises(ExpertRangeError):
        storage_dtype_for(2**31 + 1)


def test_int32_bound_both_sides() -> None:
    # int32 storage holds ids 0 .. 2**31 - 1, so 2**31 experts fit and 2**31 + 1 do not.
    assert storage_dtype_for(2**31) == np.dtype(np.int32)
    spec = RouteSpec(num_layers=1, topk=2, num_experts=2**31)
    assert spec.dtype == np.dtype(np.int32)
    top = np.array([[[2**31 - 2, 2**31 - 1]]], dtype=np.int64)
    assert check_routes(top, spec, rules="range") == (2**31 - 2, 2**31 - 1)
    np.testing.assert_array_equal(routes_to_numpy(numpy_to_routes(top.astype(np.int32))), top)
    with pytest.raises(ExpertRangeError, match="2147483648"):
        check_routes(np.array([[[0, 2**31]]], dtype=np.int64), spec, rules="range")
    with pytest.raises(ValueError, match=r"RouteSpec\.num_experts"):
        RouteSpec(num_layers=1, topk=2, num_experts=2**31 + 1)
    # Unknown num_experts widens up to the largest int32 id, and no further.
    unknown = RouteSpec(num_layers=1, topk=2, num_experts=None)
    assert unknown.widened_for(2**31 - 1).dtype == np.dtype(np.int32)
    with pytest.raises(ExpertRangeError):
        unknown.widened_for(2**31)
    assert RouteSpec.from_json(spec.to_json()) == spec


def test_unknown_num_experts_starts_at_uint8() -> None:
    assert RouteSpec(num_layers=4, topk=2, num_experts=None).dtype == np.dtype(np.uint8)


def test_arrow_types_and_sizes() -> None:
    spec = RouteSpec(num_layers=48, topk=8, num_experts=128)
    assert spec.arrow_type == pa.list_(pa.list_(pa.uint8(), 8), 48)
    assert spec.routes_type == pa.large_list(spec.arrow_type)
    assert spec.row_shape == (48, 8)
    assert spec.row_nbytes == 48 * 8
    wide = RouteSpec(num_layers=3, topk=2, num_experts=300)
    assert wide.arrow_value_type == pa.uint16()
    assert wide.row_nbytes == 3 * 2 * 2


def test_router_and_dense_layers() -> None:
    spec = RouteSpec(num_layers=5, topk=2, num_experts=8, moe_layers=(4, 1, 2))
    assert spec.router_layers == (1, 2, 4)
    assert spec.dense_layers == (0, 3)
    everything = RouteSpec(num_layers=3, topk=2, num_experts=8, moe_layers=(0, 1, 2))
    assert everything.moe_layers is None
    assert everything.router_layers == (0, 1, 2)
    assert everything.dense_layers == ()
    assert everything == RouteSpec(num_layers=3, topk=2, num_experts=8)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        # Argument misuse raises builtins, never an R3ArrowError (docs/design.md, "Error policy").
        ({"num_layers": 0, "topk": 2, "num_experts": 8}, ValueError),
        ({"num_layers": True, "topk": 2, "num_experts": 8}, TypeError),
        ({"num_layers": 2.0, "topk": 2, "num_experts": 8}, TypeError),
        ({"num_layers": 2, "topk": 0, "num_experts": 8}, ValueError),
        ({"num_layers": 2, "topk": 9, "num_experts": 8}, ValueError),
        ({"num_layers": 2, "topk": 2, "num_experts": 0}, ValueError),
        ({"num_layers": 2, "topk": 2, "num_experts": -3}, ValueError),
        ({"num_layers": 2, "topk": 2, "num_experts": 2**31 + 1}, ValueError),
        ({"num_layers": 2**31, "topk": 2, "num_experts": 8}, ValueError),
        ({"num_layers": 2, "topk": 2**31, "num_experts": 2**31}, ValueError),
        ({"num_layers": 2, "topk": 2, "num_experts": 8.0}, TypeError),
        ({"num_layers": 4, "topk": 2, "num_experts": 8, "moe_layers": [1, 1]}, ValueError),
        ({"num_layers": 4, "topk": 2, "num_experts": 8, "moe_layers": [4]}, ValueError),
        ({"num_layers": 4, "topk": 2, "num_experts": 8, "moe_layers": [-1]}, ValueError),
        ({"num_layers": 4, "topk": 2, "num_experts": 8, "moe_layers": []}, ValueError),
        ({"num_layers": 4, "topk": 2, "num_experts": 8, "moe_layers": [1.5]}, TypeError),
        ({"num_layers": 4, "topk": 2, "num_experts": 8, "id_dtype": "int64"}, ValueError),
        ({"num_layers": 4, "topk": 2, "num_experts": 300, "id_dtype": "uint8"}, ValueError),
    ],
)
def test_invalid_spec_raises_builtin_error(
    kwargs: dict[str, object], error: type[Exception]
) -> None:
    with pytest.raises(error) as info:
        RouteSpec(**kwargs)  # type: ignore[arg-type]
    assert not isinstance(info.value, R3ArrowError)


def test_numpy_integer_fields_are_normalised() -> None:
    spec = RouteSpec(num_layers=np.int64(4), topk=np.int32(2), num_experts=np.uint16(8))  # type: ignore[arg-type]
    assert spec == RouteSpec(num_layers=4, topk=2, num_experts=8)
    assert type(spec.num_layers) is int


def test_widened_for() -> None:
    spec = RouteSpec(num_layers=2, topk=2, num_experts=None)
    assert spec.widened_for(255) is spec
    wide = spec.widened_for(256)
    assert wide.dtype == np.dtype(np.uint16)
    assert wide.same_shape(spec)
    assert wide.widened_for(70000).dtype == np.dtype(np.int32)
    assert wide.widened_for(3) is wide  # never narrows


# ----------------------------------------------------------------- metadata


@pytest.mark.parametrize(
    "spec",
    [
        RouteSpec(num_layers=48, topk=8, num_experts=128),
        RouteSpec(num_layers=4, topk=2, num_experts=300, moe_layers=(1, 3)),
        RouteSpec(num_layers=4, topk=2, num_experts=None),
        RouteSpec(num_layers=4, topk=2, num_experts=None).widened_for(1000),
    ],
)
def test_spec_json_round_trip(spec: RouteSpec) -> None:
    back = RouteSpec.from_json(spec.to_json())
    assert (back.num_layers, back.topk, back.num_experts, back.router_layers) == (
        spec.num_layers,
        spec.topk,
        spec.num_experts,
        spec.router_layers,
    )
    assert back.dtype == spec.dtype
    assert back.arrow_type == spec.arrow_type
    meta = cast("dict[bytes | str, bytes | str]", spec.to_metadata())
    schema = pa.schema([pa.field("routes", spec.routes_type)], metadata=meta)
    assert RouteSpec.from_schema(schema).arrow_type == spec.arrow_type


@pytest.mark.parametrize(
    "spec",
    [
        RouteSpec(num_layers=48, topk=8, num_experts=128),
        RouteSpec(num_layers=4, topk=2, num_experts=300, moe_layers=(1, 3)),
        RouteSpec(num_layers=4, topk=2, num_experts=None),
    ],
)
def test_spec_json_round_trip_is_equal(spec: RouteSpec) -> None:
    # The spec read back from metadata (files, IPC, tables) must compare equal to the one written.
    assert RouteSpec.from_json(spec.to_json()) == spec


def test_spec_json_fields() -> None:
    import json

    obj = json.loads(RouteSpec(num_layers=4, topk=2, num_experts=300, moe_layers=(0, 2)).to_json())
    assert obj == {
        "version": 1,
        "num_layers": 4,
        "topk": 2,
        "num_experts": 300,
        "moe_layers": [0, 2],
        "dtype": "uint16",
        "id_dtype": None,
    }


@pytest.mark.parametrize(
    "data", [b"not json", b"[1, 2]", b"{}", b'{"num_layers": 2}', b'{"num_layers": 2, "topk": 2}']
)
def test_spec_from_bad_json_raises_schema_error(data: bytes) -> None:
    with pytest.raises(SchemaError, match="RouteSpec"):
        RouteSpec.from_json(data)


@pytest.mark.parametrize(
    "data",
    [
        b'{"num_layers": 2147483648, "topk": 2, "num_experts": 8}',
        b'{"num_layers": 2, "topk": 2147483648, "num_experts": 2147483648}',
        b'{"num_layers": 2, "topk": 2, "num_experts": 2147483649}',
        b'{"num_layers": 2, "topk": 2, "num_experts": 99999999999999999999999}',
        b'{"num_layers": 2, "topk": 2, "num_experts": 8, "moe_layers": [99999999999999999999]}',
        b'{"num_layers": 2, "topk": 2, "num_experts": 8, "moe_layers": [2147483648]}',
        b'{"num_layers": 2.0, "topk": 2, "num_experts": 8}',
        b'{"num_layers": "2", "topk": 2, "num_experts": 8}',
        b'{"num_layers": true, "topk": 2, "num_experts": 8}',
        b'{"num_layers": 2, "topk": 2, "num_experts": 8.5}',
        b'{"num_layers": 2, "topk": 2, "num_experts": 8, "moe_layers": 1}',
        b'{"num_layers": 2, "topk": 2, "num_experts": 8, "moe_layers": ["a"]}',
        b'{"num_layers": 2, "topk": 2, "num_experts": 8, "id_dtype": 5}',
        b'{"num_layers": 2, "topk": 2, "num_experts": 8, "id_dtype": "int64"}',
        b'{"version": 2, "num_layers": 2, "topk": 2, "num_experts": 8}',
        b'{"version": true, "num_layers": 2, "topk": 2, "num_experts": 8}',
    ],
)
def test_spec_from_json_out_of_range_or_non_int_is_schema_error(data: bytes) -> None:
    with pytest.raises(SchemaError, match="RouteSpec") as info:
        RouteSpec.from_json(data)
    assert not isinstance(info.value, OverflowError)


def test_spec_from_json_accepts_the_largest_values() -> None:
    data = b'{"version": 1, "num_layers": 2147483647, "topk": 2, "num_experts": 2147483648}'
    spec = RouteSpec.from_json(data)
    assert (spec.num_layers, spec.num_experts) == (2**31 - 1, 2**31)
    assert spec.dtype == np.dtype(np.int32)


def test_routes_with_a_null_layer_row_are_refused() -> None:
    # A null [K] row inside a token would be dropped by flatten and shift every later id.
    typ = RouteSpec(num_layers=2, topk=2, num_experts=8).arrow_type
    arr = pa.array([[[0, 1], None], [[2, 3], [4, 5]]], type=typ)
    with pytest.raises(RouteShapeError, match="null layer rows"):
        routes_to_numpy(arr)


def test_spec_from_schema_without_key() -> None:
    with pytest.raises(SchemaError, match=r"r3arrow\.spec"):
        RouteSpec.from_schema(pa.schema([pa.field("x", pa.int32())], metadata={b"other": b"1"}))
    with pytest.raises(SchemaError):
        RouteSpec.from_schema(pa.schema([pa.field("x", pa.int32())]))
    assert SPEC_METADATA_KEY == b"r3arrow.spec"


# -------------------------------------------------------------- conversions

_SHAPES = st.tuples(st.integers(0, 40), st.integers(1, 6), st.integers(1, 4))
_DTYPES = st.sampled_from([np.uint8, np.uint16, np.int32])


@given(shape=_SHAPES, dtype=_DTYPES, seed=st.integers(0, 2**32 - 1))
def test_numpy_arrow_round_trip_is_exact_and_zero_copy(
    shape: tuple[int, int, int], dtype: type, seed: int
) -> None:
    rng = np.random.default_rng(seed)
    info = np.iinfo(dtype)
    arr = rng.integers(0, info.max, size=shape, dtype=dtype, endpoint=True)
    spec = RouteSpec(
        num_layers=shape[1], topk=shape[2], num_experts=None, id_dtype=np.dtype(dtype).name
    )
    routes = numpy_to_routes(arr, spec)
    assert routes.type == spec.arrow_type
    assert len(routes) == shape[0]
    back = routes_to_numpy(routes, spec)
    assert back.dtype == arr.dtype
    np.testing.assert_array_equal(back, arr)
    if arr.size:
        assert np.shares_memory(
            back, arr
        )  # numpy -> Arrow -> numpy never copies a contiguous array


@given(shape=_SHAPES, seed=st.integers(0, 2**32 - 1), data=st.data())
def test_routes_to_numpy_respects_slices(
    shape: tuple[int, int, int], seed: int, data: st.DataObject
) -> None:
    rng = np.random.default_rng(seed)
    arr = rng.integers(0, 255, size=shape, dtype=np.uint8)
    routes = numpy_to_routes(arr)
    lo = data.draw(st.integers(0, shape[0]))
    hi = data.draw(st.integers(lo, shape[0]))
    np.testing.assert_array_equal(routes_to_numpy(routes.slice(lo, hi - lo)), arr[lo:hi])
    chunked = pa.chunked_array([routes.slice(0, lo), routes.slice(lo)])
    np.testing.assert_array_equal(routes_to_numpy(chunked), arr)


def test_numpy_to_routes_non_contiguous_input_is_copied_correctly() -> None:
    base = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    view = base[:, :, ::2]
    np.testing.assert_array_equal(routes_to_numpy(numpy_to_routes(view)), view)


def test_numpy_to_routes_rejects() -> None:
    with pytest.raises(RouteShapeError):
        numpy_to_routes(np.zeros((3, 4), dtype=np.uint8))
    with pytest.raises(RouteShapeError):
        numpy_to_routes(
            np.zeros((3, 4, 2), dtype=np.uint8), RouteSpec(num_layers=4, topk=3, num_experts=8)
        )
    with pytest.raises(RouteDTypeError):
        numpy_to_routes(np.zeros((3, 4, 2), dtype=np.int64))
    with pytest.raises(RouteDTypeError):
        numpy_to_routes(np.zeros((3, 4, 2), dtype=np.float32))


def test_routes_to_numpy_rejects() -> None:
    spec = RouteSpec(num_layers=2, topk=2, num_experts=8)
    with pytest.raises(RouteShapeError):
        routes_to_numpy(pa.array([1, 2, 3], type=pa.uint8()))
    with pytest.raises(RouteShapeError):
        routes_to_numpy(pa.array([[1.0, 2.0]], type=pa.list_(pa.float32(), 2)))
    wrong = numpy_to_routes(np.zeros((2, 3, 2), dtype=np.uint8))
    with pytest.raises(RouteShapeError, match=r"\[rows, 2, 2\]"):
        routes_to_numpy(wrong, spec)
    nulls = pa.array([[[0, 1], [0, 1]], None], type=spec.arrow_type)
    with pytest.raises(RouteShapeError, match="null"):
        routes_to_numpy(nulls, spec)
    null_leaf = pa.array([[[0, None], [0, 1]]], type=spec.arrow_type)
    with pytest.raises(RouteShapeError, match="null"):
        routes_to_numpy(null_leaf, spec)


def test_as_route_rows() -> None:
    spec = RouteSpec(num_layers=2, topk=2, num_experts=8)
    arr = np.array([[[0, 1], [2, 3]]], dtype=np.int64)
    assert as_route_rows(arr, spec) is arr  # any integer dtype, no copy
    np.testing.assert_array_equal(as_route_rows(numpy_to_routes(arr.astype(np.uint8)), spec), arr)
    assert as_route_rows([[[0, 1], [2, 3]]], spec).shape == (1, 2, 2)
    empty = as_route_rows(np.empty((0, 2, 2)), spec)  # an empty float array is an empty response
    assert empty.shape == (0, 2, 2) and empty.dtype.kind in "iu"
    with pytest.raises(RouteDTypeError):
        as_route_rows(arr.astype(np.float64), spec)
    with pytest.raises(RouteDTypeError):
        as_route_rows(np.array([[["a", "b"], ["c", "d"]]]), spec)
    with pytest.raises(RouteShapeError):
        as_route_rows(arr.reshape(1, 4), spec)
    with pytest.raises(RouteShapeError):
        as_route_rows(np.zeros((1, 2, 3), dtype=np.uint8), spec)


# ---------------------------------------------------------------- id checks


def test_check_route_ids_ranges_on_moe_layers_only() -> None:
    spec = RouteSpec(num_layers=3, topk=2, num_experts=4, moe_layers=(1,))
    ok = np.zeros((2, 3, 2), dtype=np.int64)
    ok[:, 1] = [0, 3]
    assert check_routes(ok, spec, rules="range") == (0, 3)
    ok[:, 0] = 0  # dense-layer zeros are fine (vLLM emits them)
    check_routes(ok, spec, rules="range")
    too_big = ok.copy()
    too_big[1, 1, 1] = 4
    with pytest.raises(ExpertRangeError, match=r"< num_experts=4, found 4 \(token 1, layer 1\)"):
        check_routes(too_big, spec, rules="range")
    negative = ok.copy()
    negative[0, 1, 0] = -2
    with pytest.raises(ExpertRangeError, match=r">= 0, found -2"):
        check_routes(negative, spec, rules="range")
    assert check_routes(np.zeros((0, 3, 2), dtype=np.uint8), spec, rules="range") == (0, -1)


def test_check_route_ids_unknown_num_experts_has_no_upper_bound() -> None:
    spec = RouteSpec(num_layers=1, topk=2, num_experts=None)
    assert check_routes(np.array([[[5, 70000]]]), spec, rules="range") == (5, 70000)
    with pytest.raises(ExpertRangeError):
        check_routes(np.array([[[-1, 3]]]), spec, rules="range")


def test_check_distinct_experts() -> None:
    spec = RouteSpec(num_layers=3, topk=3, num_experts=8, moe_layers=(0, 2))
    arr = np.zeros((2, 3, 3), dtype=np.uint8)
    arr[:, [0, 2]] = [5, 1, 7]
    check_routes(arr, spec, rules="distinct")  # dense layer 1 is all zeros: not a duplicate
    arr[1, 2] = [4, 6, 4]
    with pytest.raises(DuplicateExpertError, match=r"\[4, 6, 4\] \(token 1, layer 2\)"):
        check_routes(arr, spec, rules="distinct")
    check_routes(
        np.zeros((4, 3, 1), dtype=np.uint8),
        RouteSpec(num_layers=3, topk=1, num_experts=8),
        rules="distinct",
    )


@given(seed=st.integers(0, 2**32 - 1), rows=st.integers(0, 20))
def test_random_routes_pass_all_checks(seed: int, rows: int) -> None:
    spec = RouteSpec(num_layers=4, topk=3, num_experts=16, moe_layers=(0, 3))
    arr = random_routes(np.random.default_rng(seed), rows, spec)
    check_routes(arr, spec, rules="range")
    check_routes(arr, spec, rules="distinct")
    assert not arr[:, [1, 2]].any()


def test_dummy_route_row() -> None:
    spec = RouteSpec(num_layers=3, topk=4, num_experts=300)
    row = dummy_route_row(spec)
    assert row.shape == (3, 4) and row.dtype == spec.dtype
    np.testing.assert_array_equal(row, np.tile(np.arange(4), (3, 1)))
    check_routes(row[None], spec, rules="distinct")


def test_validate_layers() -> None:
    spec = RouteSpec(num_layers=4, topk=2, num_experts=8, moe_layers=(1, 3))
    assert validate_layers([3, 1], spec) == [3, 1]
    with pytest.raises(RouteShapeError, match=r"found \[0\]"):
        validate_layers([0, 1], spec)


def test_all_errors_are_r3arrow_errors() -> None:
    for err in (
        DuplicateExpertError,
        ExpertRangeError,
        RouteDTypeError,
        RouteShapeError,
        SchemaError,
    ):
        assert issubclass(err, R3ArrowError)
    assert issubclass(RouteShapeError, ValueError) and issubclass(RouteDTypeError, TypeError)
