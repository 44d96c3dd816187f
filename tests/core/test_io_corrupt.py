"""Readers as a trust boundary: corrupt, lying and foreign Parquet files (real files on disk).

Every way of reading (`read_rollouts`, `iter_rollouts` in batches, `iter_rollouts` over the
`rollout_files` of a path, `read_rollouts` one row group at a time) either raises an
`R3ArrowError` whose ``path`` names the file or returns exactly the rows that were written.
`Outcomes` counts what happened over many corruptions; the tests assert 0 crashes
(non-r3arrow exceptions) and 0 invalid tables returned.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from r3arrow._schema import VERSION_KEY
from r3arrow._validated import is_validated
from r3arrow.errors import R3ArrowError, SchemaError
from r3arrow.io import iter_rollouts, read_rollouts, rollout_files, write_rollouts
from r3arrow.io._portable import to_portable
from r3arrow.io._storage import to_storage
from r3arrow.io._verify import META_SHA_KEY, sealed
from r3arrow.spec import SPEC_METADATA_KEY, RouteSpec
from r3arrow.table import captured_lengths, rollout_table
from r3arrow.testing import assert_rollouts_equal, random_rollouts

SPEC = RouteSpec(num_layers=4, topk=2, num_experts=16, moe_layers=(1, 2, 3))
SHAPES = [(6, 5, 11), (4, 3, 6), (5, 2, 0), (3, 4, 7), (2, 6, 8)]


def make_table() -> pa.Table:
    return random_rollouts(np.random.default_rng(7), SPEC, SHAPES)


def _row_groups(p: Path) -> pa.Table:
    (file,) = rollout_files(p)
    parts = [read_rollouts(p, row_groups=[g]) for g in range(file.num_row_groups)]
    return pa.concat_tables(parts)


READERS: dict[str, Callable[[Path], pa.Table]] = {
    "read_rollouts": lambda p: read_rollouts(p),
    "iter_rollouts": lambda p: pa.concat_tables(iter_rollouts(p, batch_rows=2)),
    "iter_rollouts_files": lambda p: pa.concat_tables(
        iter_rollouts(rollout_files(p), max_memory=None)
    ),
    "row_groups": _row_groups,
}


@dataclasses.dataclass
class Outcomes:
    """What the readers did with spoiled files: raised r3arrow errors, returned the original
    rows, returned other rows (invalid) or raised something else (crash)."""

    errors: int = 0
    equal: int = 0
    invalid: list[str] = dataclasses.field(default_factory=list)
    crashes: list[str] = dataclasses.field(default_factory=list)

    def run(self, path: Path, want: pa.Table, what: str) -> None:
        for name, reader in READERS.items():
            try:
                got = reader(path)
            except R3ArrowError as exc:
                if exc.path != str(path) or str(path) not in str(exc):
                    self.crashes.append(f"{what} {name}: error without the path: {exc!r}")
                self.errors += 1
            except Exception as exc:
                self.crashes.append(f"{what} {name}: {type(exc).__name__}: {exc}")
            else:
                try:
                    assert_rollouts_equal(got, want)
                except AssertionError as exc:
                    self.invalid.append(f"{what} {name}: {exc}")
                else:
                    self.equal += 1

    def assert_safe(self) -> None:
        assert not self.crashes, self.crashes[:5]
        assert not self.invalid, self.invalid[:5]


@pytest.fixture(scope="module")
def original(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, pa.Table]:
    table = make_table()
    path = write_rollouts(table, tmp_path_factory.mktemp("orig") / "r.parquet", row_group_rows=2)
    return path.read_bytes(), table


VARIANTS: dict[str, dict[str, Any]] = {
    "plain": {},
    "zstd": {"compression": "zstd"},
    "portable": {"portable": True},
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[bytes, pa.Table]:
    """A file of each storage variant (plain, zstd-compressed, portable routes) and its rows."""
    table = make_table()
    directory = tmp_path_factory.mktemp(request.param)
    path = write_rollouts(
        table, directory / "r.parquet", row_group_rows=2, **VARIANTS[request.param]
    )
    return path.read_bytes(), table


def _spoiled(directory: Path, data: bytes, name: str = "r.parquet") -> Path:
    p = directory / name
    p.write_bytes(data)
    return p


def _footer_range(data: bytes) -> tuple[int, int]:
    n = int.from_bytes(data[-8:-4], "little")
    return len(data) - 8 - n, len(data)


def _routes_chunks(path: Path) -> list[tuple[int, int]]:
    """Byte range of each row group's ``routes`` column chunk (page headers included)."""
    md = pq.ParquetFile(path).metadata
    out = []
    for g in range(md.num_row_groups):
        rg = md.row_group(g)
        for c in range(rg.num_columns):
            col = rg.column(c)
            if col.path_in_schema.startswith("routes"):
                out.append((col.data_page_offset, col.data_page_offset + col.total_compressed_size))
    return out


# ------------------------------------------------------------------ integrity
def test_written_files_carry_page_checksums_and_metadata_digest(
    original: tuple[bytes, pa.Table], tmp_path: Path
) -> None:
    data, table = original
    p = _spoiled(tmp_path, data)
    meta = pq.read_schema(p).metadata
    assert META_SHA_KEY in meta and VERSION_KEY in meta
    got = read_rollouts(p)
    assert_rollouts_equal(got, table)
    assert META_SHA_KEY not in (got.schema.metadata or {})  # a file property, not the rows'
    assert is_validated(got)


def test_truncation_at_many_offsets_always_raises(
    variant: tuple[bytes, pa.Table], tmp_path: Path
) -> None:
    data, table = variant
    offsets = sorted(
        {*range(0, len(data), max(1, len(data) // 60)), *range(len(data) - 40, len(data))}
    )
    out = Outcomes()
    for off in offsets:
        out.run(_spoiled(tmp_path, data[:off]), table, f"truncated at {off}")
    out.assert_safe()
    assert out.errors == len(offsets) * len(READERS) and out.equal == 0


@settings(max_examples=60)
@given(st.data())
def test_byte_flips_anywhere_raise_or_return_the_original(
    variant: tuple[bytes, pa.Table], tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    raw, table = variant
    off = data.draw(st.integers(0, len(raw) - 1), label="offset")
    bit = data.draw(st.sampled_from([1, 2, 4, 8, 16, 32, 64, 128]), label="bit")
    spoiled = bytearray(raw)
    spoiled[off] ^= bit
    out = Outcomes()
    out.run(_spoiled(tmp_path_factory.mktemp("flip"), bytes(spoiled)), table, f"flip {off}^{bit}")
    out.assert_safe()


def _route_values(path: Path, table: pa.Table) -> list[tuple[int, int]]:
    """Byte range of the route values in each layer group's page of each row group.

    Plain encoding ends the page with the values: ``tokens × group width`` bytes, the
    group width that of its ``l{a}_{b}`` leaf (docs/storage.md, layer-group storage).
    """
    md = pq.ParquetFile(path).metadata
    rows = md.row_group(0).num_rows
    tokens = np.add.reduceat(captured_lengths(table), np.arange(0, table.num_rows, rows))
    assert md.num_row_groups == len(tokens)
    width = SPEC.topk * SPEC.dtype.itemsize
    out = []
    for g in range(md.num_row_groups):
        rg = md.row_group(g)
        for c in range(rg.num_columns):
            col = rg.column(c)
            if not col.path_in_schema.startswith("routes"):
                continue
            a, b = (int(x) for x in col.path_in_schema.rsplit(".", 1)[1][1:].split("_"))
            hi = col.data_page_offset + col.total_compressed_size
            out.append((hi - int(tokens[g]) * (b - a) * width, hi))
    return out


@settings(max_examples=40)
@given(st.data())
def test_byte_flips_in_route_pages_raise(
    original: tuple[bytes, pa.Table], tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    raw, table = original
    directory = tmp_path_factory.mktemp("routes")
    ranges = [r for r in _route_values(_spoiled(directory, raw), table) if r[1] > r[0]]
    lo, hi = data.draw(st.sampled_from(ranges), label="page")
    off = data.draw(st.integers(lo, hi - 1), label="offset")
    spoiled = bytearray(raw)
    spoiled[off] ^= data.draw(st.integers(1, 255), label="xor")
    out = Outcomes()
    out.run(_spoiled(directory, bytes(spoiled)), table, f"flip {off}")
    out.assert_safe()
    assert out.errors == len(READERS), f"flip at {off} in a route page was not caught"


def test_every_footer_byte_flip_is_caught_or_harmless(
    original: tuple[bytes, pa.Table], tmp_path: Path
) -> None:
    data, table = original
    lo, hi = _footer_range(data)
    out = Outcomes()
    for off in range(lo, hi):
        spoiled = bytearray(data)
        spoiled[off] ^= 0x5A
        out.run(_spoiled(tmp_path, bytes(spoiled)), table, f"footer flip {off}")
    out.assert_safe()
    assert out.errors > 0


# ----------------------------------------------------------- lying footers
def _rewrite(path: Path, table: pa.Table, meta: dict[bytes, bytes] | None = None) -> Path:
    """Write ``table`` (storage form) with plain pyarrow, as a foreign writer would."""
    out = table if meta is None else table.replace_schema_metadata(meta)
    pq.write_table(out, path, use_compliant_nested_type=False)
    return path


def _storage_meta() -> tuple[pa.Table, dict[bytes, bytes]]:
    storage = to_storage(make_table())
    return storage, dict(storage.schema.metadata or {})


LIES = {
    "fewer_experts_than_ids": RouteSpec(num_layers=4, topk=2, num_experts=4, moe_layers=(1, 2, 3)),
    "layers_and_topk_swapped": RouteSpec(num_layers=2, topk=4, num_experts=16),
}


@pytest.mark.parametrize("lie", sorted(LIES))
def test_lying_spec_with_stale_digest_names_file_and_key(tmp_path: Path, lie: str) -> None:
    storage, meta = _storage_meta()
    honest = sealed(meta)
    p = _rewrite(
        tmp_path / "lie.parquet", storage, {**honest, SPEC_METADATA_KEY: LIES[lie].to_json()}
    )
    for name, reader in READERS.items():
        with pytest.raises(SchemaError, match=r"r3arrow\.meta_sha256") as info:
            reader(p)
        assert info.value.path == str(p), name


@pytest.mark.parametrize("lie", sorted(LIES))
def test_lying_spec_in_an_old_file_without_digest_is_caught_by_the_data(
    tmp_path: Path, lie: str
) -> None:
    storage, meta = _storage_meta()
    p = _rewrite(
        tmp_path / "old.parquet", storage, {**meta, SPEC_METADATA_KEY: LIES[lie].to_json()}
    )
    for reader in READERS.values():
        with pytest.raises(R3ArrowError) as info:
            reader(p)
        assert info.value.path == str(p)
    if LIES[lie].num_layers == SPEC.num_layers:
        assert read_rollouts(p, validate=False).num_rows == len(SHAPES)  # validate=False trusts it
    else:  # the stored layer groups name the layers: the footer check catches the lie
        with pytest.raises(SchemaError, match="layer groups") as info:
            read_rollouts(p, validate=False)
        assert info.value.path == str(p)


@pytest.mark.parametrize(
    "spec_json",
    [
        b'{"num_layers": 2147483648, "topk": 2, "num_experts": 16}',
        b'{"num_layers": 4, "topk": 2, "num_experts": 8589934592}',
        b'{"num_layers": 4294967296, "topk": 4294967296, "num_experts": null}',
        b'{"num_layers": -1, "topk": 2, "num_experts": 16}',
        b'{"num_layers": 4, "topk": 2, "num_experts": 16, "moe_layers": [9]}',
        b"[]",
        b"\xff\xfe",
    ],
)
@pytest.mark.parametrize("seal", [True, False])
def test_out_of_range_spec_values_raise_schema_error(
    tmp_path: Path, spec_json: bytes, seal: bool
) -> None:
    storage, meta = _storage_meta()
    lie = {**meta, SPEC_METADATA_KEY: spec_json}
    p = _rewrite(tmp_path / "huge.parquet", storage, sealed(lie) if seal else lie)
    out = Outcomes()
    out.run(p, make_table(), spec_json.decode(errors="replace"))
    out.assert_safe()
    assert out.errors == len(READERS)


def test_old_files_without_checksums_still_read(tmp_path: Path) -> None:
    storage, _ = _storage_meta()
    p = _rewrite(tmp_path / "old.parquet", storage)
    for reader in READERS.values():
        assert_rollouts_equal(reader(p), make_table())


def test_unknown_schema_version_raises(tmp_path: Path) -> None:
    storage, meta = _storage_meta()
    p = _rewrite(tmp_path / "v9.parquet", storage, sealed({**meta, VERSION_KEY: b"rollout.v9"}))
    with pytest.raises(SchemaError, match=r"r3arrow\.schema.*rollout\.v9") as info:
        read_rollouts(p)
    assert info.value.path == str(p)


def test_foreign_parquet_is_not_a_rollout_file(tmp_path: Path) -> None:
    p = tmp_path / "plain.parquet"
    pq.write_table(pa.table({"a": [1, 2, 3]}), p)
    for reader in READERS.values():
        with pytest.raises(SchemaError, match="not a rollout file") as info:
            reader(p)
        assert info.value.path == str(p)


# ------------------------------------------------------------------ bad rows
def _set(storage: pa.Table, name: str, col: pa.Array[Any]) -> pa.Table:
    i = storage.schema.get_field_index(name)
    field = storage.schema.field(i).with_type(col.type).with_nullable(col.null_count > 0)
    return storage.set_column(i, field, col)


def _routes_storage(
    storage: pa.Table,
) -> tuple[np.ndarray, list[dict[str, bytes] | None], pa.DataType]:
    """The offsets, per-token values (layer-group structs) and token type of stored routes."""
    col = cast("pa.LargeListArray[Any]", storage.column("routes").combine_chunks())
    offsets = np.asarray(col.offsets, dtype=np.int64)
    return offsets, col.flatten().to_pylist(), col.type.value_type


def _null_token(storage: pa.Table) -> pa.Table:
    offsets, values, token_type = _routes_storage(storage)
    values[3] = None
    tokens = pa.array(values, type=token_type)
    return _set(storage, "routes", pa.LargeListArray.from_arrays(pa.array(offsets), tokens))


def _null_route_list(storage: pa.Table) -> pa.Table:
    offsets, values, token_type = _routes_storage(storage)
    tokens = pa.array(values, type=token_type)
    mask = pa.array([i == 1 for i in range(len(offsets) - 1)])
    lists = pa.LargeListArray.from_arrays(pa.array(offsets), tokens, mask=mask)
    return _set(storage, "routes", lists)


def _null_token_id(storage: pa.Table) -> pa.Table:
    ids = cast("list[list[int | None]]", storage.column("prompt_ids").to_pylist())
    ids[0][1] = None
    return _set(storage, "prompt_ids", pa.array(ids, type=pa.large_list(pa.int32())))


def _null_reward(storage: pa.Table) -> pa.Table:
    rewards = storage.column("reward").to_pylist()
    rewards[2] = None
    return _set(storage, "reward", pa.array(rewards, type=pa.float64()))


def _missing(name: str) -> Callable[[pa.Table], pa.Table]:
    def drop(storage: pa.Table) -> pa.Table:
        return storage.drop_columns([name])

    drop.__name__ = f"missing_{name}"
    return drop


def _short_loss_mask(storage: pa.Table) -> pa.Table:
    masks = cast("list[list[int]]", storage.column("loss_mask").to_pylist())
    masks[1] = masks[1][:-1]
    return _set(storage, "loss_mask", pa.array(masks, type=pa.large_list(pa.uint8())))


def _more_routes_than_tokens(storage: pa.Table) -> pa.Table:
    prompts = cast("list[list[int]]", storage.column("prompt_ids").to_pylist())
    prompts[0] = prompts[0][:1]  # 1 + 5 tokens, 11 route rows
    return _set(storage, "prompt_ids", pa.array(prompts, type=pa.large_list(pa.int32())))


BAD_ROWS = [
    (_null_token, "routes"),
    (_null_route_list, "routes"),
    (_null_token_id, "prompt_ids"),
    (_null_reward, "reward"),
    (_missing("routes"), "routes"),
    (_missing("reward"), "reward"),
    (_short_loss_mask, "loss_mask"),
    (_more_routes_than_tokens, "route rows"),
]


@pytest.mark.parametrize(("spoil", "word"), BAD_ROWS, ids=lambda v: getattr(v, "__name__", ""))
def test_bad_rows_raise_naming_file_and_column(
    tmp_path: Path, spoil: Callable[[pa.Table], pa.Table], word: str
) -> None:
    storage, meta = _storage_meta()
    bad = spoil(storage)
    p = _rewrite(tmp_path / "bad.parquet", bad, sealed(meta))
    out = Outcomes()
    out.run(p, make_table(), spoil.__name__)
    out.assert_safe()
    assert out.errors == len(READERS)
    with pytest.raises(R3ArrowError, match=word) as info:
        read_rollouts(p)
    assert info.value.path == str(p) and str(p) in str(info.value)


def test_projection_is_checked_too(tmp_path: Path) -> None:
    storage, meta = _storage_meta()
    p = _rewrite(tmp_path / "bad.parquet", _null_token(storage), sealed(meta))
    with pytest.raises(SchemaError, match="routes"):
        read_rollouts(p, columns=["trajectory_id", "routes"])
    assert read_rollouts(p, columns=["trajectory_id", "reward"]).num_rows == len(SHAPES)


def test_validate_false_skips_data_checks_not_footer_checks(tmp_path: Path) -> None:
    storage, meta = _storage_meta()
    p = _rewrite(tmp_path / "bad.parquet", _short_loss_mask(storage), sealed(meta))
    with pytest.raises(SchemaError):
        read_rollouts(p)
    got = read_rollouts(p, validate=False)
    assert got.num_rows == len(SHAPES) and not is_validated(got)
    q = _rewrite(tmp_path / "v9.parquet", storage, sealed({**meta, VERSION_KEY: b"rollout.v9"}))
    with pytest.raises(SchemaError):
        read_rollouts(q, validate=False)


# --------------------------------------------------------------- directories
def test_mixed_directory_names_the_foreign_part(tmp_path: Path) -> None:
    write_rollouts(make_table(), tmp_path, step=0)
    foreign = tmp_path / "step=1" / "part-00000.parquet"
    foreign.parent.mkdir()
    pq.write_table(pa.table({"a": [1]}), foreign)
    for read in (
        read_rollouts,
        lambda p: list(iter_rollouts(p)),
        lambda p: list(iter_rollouts(rollout_files(p))),
    ):
        with pytest.raises(SchemaError, match="not a rollout file") as info:
            read(tmp_path)
        assert info.value.path == str(foreign)


def test_directory_with_a_corrupt_page_raises_with_the_root(tmp_path: Path) -> None:
    write_rollouts(make_table(), tmp_path, step=0)
    part = write_rollouts(make_table(), tmp_path, step=1)
    data = bytearray(part.read_bytes())
    _, hi = _routes_chunks(part)[0]
    data[hi - 3] ^= 0xFF
    part.write_bytes(bytes(data))
    with pytest.raises(SchemaError) as info:
        read_rollouts(tmp_path)
    assert info.value.path is not None


# -------------------------------------------------------------------- R3 off
def r3off_table() -> pa.Table:
    t = make_table()
    cols = {n: t.column(n) for n in t.schema.names if n != "routes"}
    return rollout_table(**cols, routes=None, spec=None)


def test_r3off_table_round_trips_exactly(tmp_path: Path) -> None:
    table = r3off_table()
    p = write_rollouts(table, tmp_path / "off.parquet")
    meta = pq.read_schema(p).metadata
    assert SPEC_METADATA_KEY not in meta and VERSION_KEY in meta
    got = read_rollouts(p)
    assert got.equals(table, check_metadata=True)
    assert is_validated(got)
    batches = pa.concat_tables(iter_rollouts(p, batch_rows=2))
    assert batches.equals(table)
    assert pa.concat_tables(iter_rollouts(rollout_files(p))).equals(table)
    assert read_rollouts(p, row_groups=[0]).equals(table)


def test_r3off_step_directory_and_mixing(tmp_path: Path) -> None:
    table = r3off_table()
    write_rollouts(table, tmp_path / "off", step=0)
    write_rollouts(table, tmp_path / "off", step=3)
    steps = [t.column("step")[0].as_py() for t in iter_rollouts(tmp_path / "off")]
    assert steps == [0, 3]
    assert read_rollouts(tmp_path / "off").num_rows == 2 * table.num_rows
    with pytest.raises(SchemaError, match="R3-off"):
        rollout_files(tmp_path / "off", require_routes=True)  # the Ray reader replays routes
    write_rollouts(make_table(), tmp_path / "off", step=4)
    with pytest.raises(SchemaError, match="R3 off"):
        read_rollouts(tmp_path / "off")


def test_spec_without_routes_column_is_not_r3off(tmp_path: Path) -> None:
    storage, meta = _storage_meta()
    p = _rewrite(tmp_path / "x.parquet", storage.drop_columns(["routes"]), sealed(meta))
    with pytest.raises(SchemaError, match="routes") as info:
        read_rollouts(p, columns=["trajectory_id"])
    assert info.value.path == str(p)


# ------------------------------------------------------------------ portable
def test_portable_files_read_back_exactly(tmp_path: Path) -> None:
    table = make_table()
    p = write_rollouts(table, tmp_path / "portable.parquet", portable=True)
    routes = pq.read_table(p).column("routes")
    assert not pa.types.is_fixed_size_binary(routes.type.value_type)
    assert_rollouts_equal(read_rollouts(p), table)


def test_portable_null_expert_id_is_refused(tmp_path: Path) -> None:
    portable = to_portable(make_table())
    col = cast("pa.LargeListArray[Any]", portable.column("routes").combine_chunks())
    tokens = col.flatten()
    layers = cast("pa.ListArray[Any]", tokens).flatten()
    ids = cast("pa.ListArray[Any]", layers).flatten().to_pylist()
    ids[5] = None
    rebuilt = pa.ListArray.from_arrays(
        cast("pa.ListArray[Any]", tokens).offsets,
        pa.ListArray.from_arrays(
            cast("pa.ListArray[Any]", layers).offsets, pa.array(ids, type=pa.uint8())
        ),
    )
    routes = pa.LargeListArray.from_arrays(col.offsets, rebuilt)
    bad = _set(portable, "routes", routes)
    field = bad.schema.field("routes").with_nullable(True)
    bad = bad.set_column(bad.schema.get_field_index("routes"), field, bad.column("routes"))
    p = _rewrite(tmp_path / "p.parquet", bad, sealed(dict(portable.schema.metadata or {})))
    out = Outcomes()
    out.run(p, make_table(), "null id")
    out.assert_safe()
    assert out.errors == len(READERS)


def test_row_groups_out_of_range_is_argument_misuse(
    original: tuple[bytes, pa.Table], tmp_path: Path
) -> None:
    p = _spoiled(tmp_path, original[0])
    with pytest.raises(ValueError, match="row_group") as info:
        read_rollouts(p, row_groups=[99])
    assert not isinstance(info.value, R3ArrowError)
    with pytest.raises(ValueError, match="row_group") as info:
        list(iter_rollouts(p, row_groups=[99]))
    assert not isinstance(info.value, R3ArrowError)
    with pytest.raises(TypeError):
        read_rollouts(p, row_groups=[1.0])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        read_rollouts(p, row_groups=0)  # type: ignore[arg-type]
