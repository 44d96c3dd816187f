"""`RouteSpec` and zero-copy numpy ``[rows, L, K]`` <-> Arrow per-token routes conversions
(``docs/design.md``, "The Arrow data model"; the id rules are `r3arrow.ids.check_routes`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, cast

import numpy as np
import orjson
import pyarrow as pa

from r3arrow._checks import check_int
from r3arrow.errors import ExpertRangeError, RouteDTypeError, RouteShapeError, SchemaError

#: Schema/file metadata key under which the spec travels (JSON).
SPEC_METADATA_KEY = b"r3arrow.spec"

_STORAGE_DTYPES = tuple(np.dtype(t) for t in ("uint8", "uint16", "int32"))
_ARROW_OF = {dt: pa.from_numpy_dtype(dt) for dt in _STORAGE_DTYPES}
# Arrow's fixed_size_list length is an int32: the bound of num_layers and topk.
_MAX_LIST_SIZE = int(np.iinfo(np.int32).max)
# The widest storage, int32, holds ids 0 .. 2**31 - 1: that is 2**31 experts.
_MAX_EXPERTS = _MAX_LIST_SIZE + 1
_ID_LIMITS = tuple((dt, int(np.iinfo(dt).max) + 1) for dt in _STORAGE_DTYPES)  # ids they hold


def storage_dtype_for(num_ids: int) -> np.dtype[Any]:
    """Smallest of uint8, uint16, int32 for ids ``0 .. num_ids-1`` (`ExpertRangeError` > 2**31)."""
    for dt, limit in _ID_LIMITS:
        if num_ids <= limit:
            return dt
    raise ExpertRangeError(f"expected at most 2**31 expert ids (int32), found {num_ids}")


@dataclasses.dataclass(frozen=True)
class RouteSpec:
    """Shape and dtype of one token's routes: ``[num_layers, topk]`` expert ids.

    ``num_layers`` counts every reported layer; ``moe_layers`` the ones with a router (None:
    all); ``num_experts=None``: unknown (uint8, widened by traces); ``id_dtype`` overrides the
    storage dtype. ``1 <= num_layers, topk < 2**31``, ``topk <= num_experts <= 2**31``; other
    values raise ``ValueError`` / ``TypeError``.
    """

    num_layers: int
    topk: int
    num_experts: int | None
    moe_layers: tuple[int, ...] | None = None
    id_dtype: str | None = None

    def __post_init__(self) -> None:
        for name in ("num_layers", "topk"):
            value = check_int(
                getattr(self, name), f"RouteSpec.{name}", minimum=1, maximum=_MAX_LIST_SIZE
            )
            object.__setattr__(self, name, value)
        if self.num_experts is not None:
            e = check_int(
                self.num_experts, "RouteSpec.num_experts", minimum=1, maximum=_MAX_EXPERTS
            )
            object.__setattr__(self, "num_experts", e)
            if self.topk > e:
                raise ValueError(
                    f"RouteSpec: expected topk <= num_experts={e}, found topk={self.topk}"
                )
        if self.moe_layers is not None:
            given = [check_int(i, "RouteSpec.moe_layers") for i in self.moe_layers]
            layers = tuple(sorted(set(given)))
            if len(layers) != len(given):
                raise ValueError(f"RouteSpec.moe_layers: expected unique layer ids, found {given}")
            if not layers or layers[0] < 0 or layers[-1] >= self.num_layers:
                raise ValueError(
                    f"RouteSpec.moe_layers: expected non-empty ids in [0, {self.num_layers}), "
                    f"found {list(layers)}"
                )
            object.__setattr__(
                self, "moe_layers", None if len(layers) == self.num_layers else layers
            )
        if self.id_dtype is not None:
            dt = np.dtype(self.id_dtype)
            if dt not in _STORAGE_DTYPES:
                raise ValueError(f"RouteSpec.id_dtype: expected uint8, uint16 or int32, found {dt}")
            if storage_dtype_for(self.num_experts or 1).itemsize > dt.itemsize:
                raise ValueError(
                    f"RouteSpec.id_dtype: expected a dtype that holds {self.num_experts} "
                    f"expert ids, found {dt}"
                )
            object.__setattr__(self, "id_dtype", dt.name)

    @property
    def dtype(self) -> np.dtype[Any]:
        """Storage dtype of expert ids."""
        if self.id_dtype is not None:
            return np.dtype(self.id_dtype)
        return storage_dtype_for(self.num_experts or 1)

    @property
    def storage_cap(self) -> int:
        """Largest value the storage holds (int32's when ``num_experts`` is unknown)."""
        return int(np.iinfo(self.dtype if self.num_experts is not None else np.int32).max)

    @property
    def arrow_value_type(self) -> pa.DataType:
        return _ARROW_OF[self.dtype]

    @property
    def arrow_type(self) -> pa.DataType:
        """Per-token Arrow type: ``fixed_size_list<fixed_size_list<dtype, K>, L>``."""
        return pa.list_(pa.list_(self.arrow_value_type, self.topk), self.num_layers)

    @property
    def routes_type(self) -> pa.DataType:
        """Per-trajectory Arrow type: ``large_list<arrow_type>``."""
        return pa.large_list(self.arrow_type)

    @property
    def row_shape(self) -> tuple[int, int]:
        return (self.num_layers, self.topk)

    @property
    def row_nbytes(self) -> int:
        """Bytes of one token's routes in storage dtype."""
        return self.num_layers * self.topk * self.dtype.itemsize

    @property
    def router_layers(self) -> tuple[int, ...]:
        """Global indices of the layers that have a router."""
        return self.moe_layers if self.moe_layers is not None else tuple(range(self.num_layers))

    @property
    def dense_layers(self) -> tuple[int, ...]:
        moe = set(self.router_layers)
        return tuple(i for i in range(self.num_layers) if i not in moe)

    def widened_for(self, max_id: int) -> RouteSpec:
        """This spec with a storage dtype for ``max_id`` (self if it already holds it)."""
        need = storage_dtype_for(int(max_id) + 1)
        if need.itemsize <= self.dtype.itemsize:
            return self
        return dataclasses.replace(self, id_dtype=need.name)

    def same_shape(self, other: RouteSpec) -> bool:
        return self.row_shape == other.row_shape and self.router_layers == other.router_layers

    def to_json(self) -> bytes:
        return orjson.dumps(
            {
                "version": 1,
                "num_layers": self.num_layers,
                "topk": self.topk,
                "num_experts": self.num_experts,
                "moe_layers": self.moe_layers,  # orjson writes a tuple as an array
                "dtype": self.dtype.name,
                "id_dtype": self.id_dtype,
            }
        )

    @classmethod
    def from_json(cls, data: bytes | str) -> RouteSpec:
        """The spec of `to_json` output; anything else raises `SchemaError` (not OverflowError)."""
        try:
            obj = orjson.loads(data)
            if obj.get("version", 1) != 1 or isinstance(obj.get("version"), bool):
                raise ValueError(f"expected version 1, found {obj.get('version')!r}")
            return cls(
                num_layers=obj["num_layers"],
                topk=obj["topk"],
                num_experts=obj["num_experts"],
                moe_layers=tuple(obj["moe_layers"]) if obj.get("moe_layers") is not None else None,
                id_dtype=obj["id_dtype"] if "id_dtype" in obj else obj.get("dtype"),
            )
        except (AttributeError, KeyError, TypeError, ValueError, OverflowError) as exc:
            raise SchemaError(
                "invalid r3arrow.spec metadata: expected a RouteSpec JSON object, "
                f"found {data!r:.200} ({exc})"
            ) from exc

    def to_metadata(self) -> dict[bytes, bytes]:
        return {SPEC_METADATA_KEY: self.to_json()}

    @classmethod
    def from_schema(cls, schema: pa.Schema) -> RouteSpec:
        """The spec in Arrow schema metadata; `SchemaError` if absent."""
        meta = schema.metadata or {}
        if SPEC_METADATA_KEY not in meta:
            raise SchemaError(
                f"expected schema metadata key {SPEC_METADATA_KEY.decode()!r}, found keys "
                f"{sorted(k.decode(errors='replace') for k in meta)}"
            )
        return cls.from_json(meta[SPEC_METADATA_KEY])


def routes_to_numpy(
    routes: pa.Array[Any] | pa.ChunkedArray[Any], spec: RouteSpec | None = None
) -> np.ndarray:
    """Arrow per-token routes as a numpy ``[rows, L, K]`` view (one chunk: zero-copy).

    `RouteShapeError` for another type or ``spec`` shape, or any null.
    """
    if isinstance(routes, pa.ChunkedArray):
        routes = routes.combine_chunks() if routes.num_chunks != 1 else routes.chunk(0)
    t = routes.type
    if not (
        pa.types.is_fixed_size_list(t)
        and pa.types.is_fixed_size_list(t.value_type)
        and pa.types.is_integer(t.value_type.value_type)
    ):
        raise RouteShapeError(
            f"expected routes of type fixed_size_list<fixed_size_list<int, K>, L>, found {t}"
        )
    num_layers, topk = t.list_size, t.value_type.list_size
    if spec is not None and (num_layers, topk) != spec.row_shape:
        raise RouteShapeError(
            f"expected routes [rows, {spec.num_layers}, {spec.topk}], "
            f"found [rows, {num_layers}, {topk}]"
        )
    if routes.null_count:
        raise RouteShapeError(f"expected no null tokens in routes, found {routes.null_count}")
    per_token = cast("pa.FixedSizeListArray[Any, Any]", routes)
    inner = cast("pa.FixedSizeListArray[Any, Any]", per_token.flatten())
    if inner.null_count:  # flatten would drop a null layer row's ids and shift the rest
        raise RouteShapeError(f"expected no null layer rows in routes, found {inner.null_count}")
    leaf = inner.flatten()
    if leaf.null_count:
        raise RouteShapeError(f"expected no null expert ids, found {leaf.null_count}")
    flat: np.ndarray = leaf.to_numpy(zero_copy_only=True)
    return flat.reshape(len(routes), num_layers, topk)


def numpy_to_routes(
    arr: np.ndarray, spec: RouteSpec | None = None
) -> pa.FixedSizeListArray[Any, Any]:
    """A C-contiguous ``[rows, L, K]`` array as the per-token Arrow type, zero-copy."""
    if arr.ndim != 3:
        raise RouteShapeError(f"expected routes [rows, L, K], found shape {arr.shape}")
    if spec is not None and arr.shape[1:] != spec.row_shape:
        raise RouteShapeError(
            f"expected routes [rows, {spec.num_layers}, {spec.topk}], found {list(arr.shape)}"
        )
    if arr.dtype not in _ARROW_OF:
        raise RouteDTypeError(
            f"expected routes stored as uint8, uint16 or int32, found {arr.dtype}"
        )
    arr = np.ascontiguousarray(arr)
    leaf = pa.array(arr.reshape(-1), type=_ARROW_OF[arr.dtype])
    inner = pa.FixedSizeListArray.from_arrays(leaf, arr.shape[2])
    return pa.FixedSizeListArray.from_arrays(inner, arr.shape[1])


__all__: Sequence[str] = [
    "SPEC_METADATA_KEY",
    "RouteSpec",
    "numpy_to_routes",
    "routes_to_numpy",
    "storage_dtype_for",
]
