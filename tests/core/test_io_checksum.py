"""End-to-end integrity of the decoded bytes: each row group's XXH3-128 digests.

Files written now carry `DIGEST_KEY` (per row group, per column stream: list lengths and
leaf values, one stream per routes layer group) sealed by the metadata digest; r3arrow's
readers decode those files without pyarrow's page-CRC pass and check the digests before
any row is used. Files without the key are read as before (page CRCs verified). Bit flips
in route pages, token pages and the metadata itself: 0 silent acceptances, also with
``validate=False`` (the digest alone stands between a flipped byte and the caller).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from r3arrow.errors import R3ArrowError, SchemaError
from r3arrow.io import (
    iter_rollouts,
    project_layers,
    read_rollouts,
    rollout_files,
    write_rollouts,
)
from r3arrow.io._verify import DIGEST_KEY, META_SHA_KEY, row_digests, sealed
from r3arrow.spec import RouteSpec
from r3arrow.table import captured_lengths
from r3arrow.testing import assert_rollouts_equal, random_rollouts

SPEC = RouteSpec(num_layers=4, topk=2, num_experts=16, moe_layers=(1, 2, 3))
SHAPES = [(6, 5, 11), (4, 3, 6), (5, 2, 0), (3, 4, 7), (2, 6, 8)]


def make_table() -> pa.Table:
    return random_rollouts(np.random.default_rng(7), SPEC, SHAPES)


@pytest.fixture(scope="module")
def written(tmp_path_factory: pytest.TempPathFactory) -> tuple[bytes, pa.Table]:
    table = make_table()
    path = write_rollouts(
        table, tmp_path_factory.mktemp("d") / "r.parquet", row_group_rows=2, layer_group=2
    )
    return path.read_bytes(), table


def _put(directory: Path, data: bytes) -> Path:
    p = directory / "r.parquet"
    p.write_bytes(data)
    return p


def _chunks(path: Path, prefix: str) -> list[tuple[int, int]]:
    """Byte range of each row group's column chunks whose leaf path starts with ``prefix``."""
    md = pq.ParquetFile(path).metadata
    out = []
    for g in range(md.num_row_groups):
        rg = md.row_group(g)
        for c in range(rg.num_columns):
            col = rg.column(c)
            if col.path_in_schema.startswith(prefix):
                lo = col.dictionary_page_offset or col.data_page_offset
                out.append((lo, col.data_page_offset + col.total_compressed_size))
    return out


def _value_ranges(path: Path, prefix: str, width: int, counts: list[int]) -> list[tuple[int, int]]:
    """The trailing ``counts[g] * width`` value bytes of each row group's plain page."""
    return [(hi - n * width, hi) for (_, hi), n in zip(_chunks(path, prefix), counts, strict=True)]


STAGE = [2, 3]
READERS: dict[str, Callable[[Path], pa.Table]] = {
    "read_rollouts": lambda p: read_rollouts(p),
    "read_rollouts_unvalidated": lambda p: read_rollouts(p, validate=False),
    "iter_rollouts_batches": lambda p: pa.concat_tables(
        iter_rollouts(p, batch_rows=1, validate=False)
    ),
    "row_group_0": lambda p: read_rollouts(p, row_groups=[0], validate=False),
    "stage": lambda p: read_rollouts(p, layers=STAGE, validate=False),
}


def _want(table: pa.Table, reader: str) -> pa.Table:
    if reader == "row_group_0":
        return table.slice(0, 2)
    if reader == "stage":
        return read_rollouts_of(table, layers=STAGE)
    return table


def read_rollouts_of(table: pa.Table, *, layers: list[int]) -> pa.Table:
    return project_layers(table, layers)


def _outcome(path: Path, table: pa.Table) -> Iterator[tuple[str, str]]:
    """(reader, "error" | "equal") of each reader; AssertionError for a silent acceptance
    (other rows returned) or a non-r3arrow exception."""
    for name, reader in READERS.items():
        try:
            got = reader(path)
        except R3ArrowError as exc:
            assert exc.path == str(path), (name, exc)
            yield name, "error"
        else:
            assert_rollouts_equal(got, _want(table, name))
            yield name, "equal"


def test_written_files_carry_row_group_digests(
    written: tuple[bytes, pa.Table], tmp_path: Path
) -> None:
    data, table = written
    p = _put(tmp_path, data)
    (file,) = rollout_files(p)
    record = row_digests(pq.read_schema(p), file.num_row_groups)
    assert record is not None
    columns, groups = record
    assert columns == set(pq.read_schema(p).names)
    assert len(groups) == file.num_row_groups == 3
    # one stream per layer group (a projected read checks only the groups it decodes)
    assert {k for k in groups[0] if k.startswith("routes")} == {
        "routes#len",
        "routes[].l0_2",
        "routes[].l2_4",
    }
    got = read_rollouts(p)
    assert_rollouts_equal(got, table)
    assert DIGEST_KEY not in (got.schema.metadata or {})  # a file property, not the rows'
    assert DIGEST_KEY not in (file.schema.metadata or {})


def _spy(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """The ``page_checksum_verification`` of every ParquetFile the readers open."""
    seen: list[bool] = []
    real = pq.ParquetFile

    def spy(*args: Any, **kw: Any) -> pq.ParquetFile:
        seen.append(bool(kw.get("page_checksum_verification", False)))
        return real(*args, **kw)

    monkeypatch.setattr(pq, "ParquetFile", spy)
    return seen


def test_digested_files_read_without_page_crcs_old_files_with_them(
    written: tuple[bytes, pa.Table], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data, table = written
    p = _put(tmp_path, data)
    files = rollout_files(p)
    seen = _spy(monkeypatch)
    read_rollouts(files, layers=STAGE)
    # the footer's file streams page by page (page CRCs on); the one read whole does not
    assert seen == [True, False]
    old = tmp_path / "old.parquet"
    stored = pq.read_table(p)
    meta = {k: v for k, v in (stored.schema.metadata or {}).items() if k != DIGEST_KEY}
    pq.write_table(
        stored.replace_schema_metadata(sealed(meta)),
        old,
        use_compliant_nested_type=False,
        write_page_checksum=True,
        row_group_size=2,
    )
    old_files = rollout_files(old)
    seen.clear()
    assert_rollouts_equal(read_rollouts(old_files), table)
    assert seen == [True, True]


def test_a_file_without_digests_still_catches_a_route_flip_by_page_crc(
    written: tuple[bytes, pa.Table], tmp_path: Path
) -> None:
    data, _ = written
    stored = pq.read_table(_put(tmp_path, data))
    meta = {k: v for k, v in (stored.schema.metadata or {}).items() if k != DIGEST_KEY}
    old = tmp_path / "old.parquet"
    pq.write_table(
        stored.replace_schema_metadata(sealed(meta)),
        old,
        use_compliant_nested_type=False,
        write_page_checksum=True,
        use_dictionary=False,
        row_group_size=2,
    )
    _, hi = _chunks(old, "routes.list.item.l2_4")[0]
    raw = bytearray(old.read_bytes())
    raw[hi - 1] ^= 0x01  # the last route byte of row group 0
    old.write_bytes(bytes(raw))
    with pytest.raises(SchemaError) as info:
        read_rollouts(old, validate=False)
    assert info.value.path == str(old)


def _captured(table: pa.Table) -> list[int]:
    n = captured_lengths(table)
    return [int(n[a : a + 2].sum()) for a in range(0, table.num_rows, 2)]


@pytest.mark.parametrize("leaf", ["l0_2", "l2_4"])
def test_a_route_flip_is_a_digest_mismatch_naming_path_and_row_group(
    written: tuple[bytes, pa.Table], tmp_path: Path, leaf: str
) -> None:
    data, table = written
    p = _put(tmp_path, data)
    width = 2 * SPEC.topk * SPEC.dtype.itemsize
    ranges = _value_ranges(p, f"routes.list.item.{leaf}", width, _captured(table))
    lo, hi = ranges[1]
    raw = bytearray(data)
    raw[(lo + hi) // 2] ^= 0x10
    p.write_bytes(bytes(raw))
    with pytest.raises(SchemaError, match=rf"row group 1: stream 'routes\[\]\.{leaf}'") as info:
        read_rollouts(p, validate=False)
    assert info.value.path == str(p) and "XXH3-128" in str(info.value)
    other = [0, 1] if leaf == "l2_4" else [2, 3]  # a stage without the flipped group reads
    got = read_rollouts(p, layers=other, validate=False)
    assert_rollouts_equal(got, read_rollouts_of(table, layers=other))


def test_a_token_flip_is_a_digest_mismatch(written: tuple[bytes, pa.Table], tmp_path: Path) -> None:
    data, _ = written
    p = _put(tmp_path, data)
    _, hi = _chunks(p, "response_ids")[2]
    raw = bytearray(data)
    raw[hi - 2] ^= 0x04  # a dictionary index or value of row group 2's response tokens
    p.write_bytes(bytes(raw))
    with pytest.raises(R3ArrowError) as info:
        read_rollouts(p, validate=False)
    assert info.value.path == str(p)


def test_a_flip_in_the_digest_metadata_is_caught_by_the_seal(
    written: tuple[bytes, pa.Table], tmp_path: Path
) -> None:
    data, _ = written
    at = data.rindex(b'"row_groups"')
    raw = bytearray(data)
    raw[at + 20] ^= 0x01  # inside the first digest (a hex character)
    p = _put(tmp_path, bytes(raw))
    # the footer's key-value copy differs from the Arrow schema's (or, both, the seal)
    with pytest.raises(SchemaError, match=r"r3arrow\.(meta_sha256|row_group_xxh3)") as info:
        read_rollouts(p, validate=False)
    assert info.value.path == str(p)


def test_resealed_lying_digests_are_a_mismatch(
    written: tuple[bytes, pa.Table], tmp_path: Path
) -> None:
    """A writer that seals digests of other rows: the decoded bytes are the arbiter."""
    data, _ = written
    stored = pq.read_table(_put(tmp_path, data))
    meta = dict(stored.schema.metadata or {})
    info = orjson.loads(meta[DIGEST_KEY])
    info["row_groups"][0]["prompt_ids[]"] = "0" * 32
    meta[DIGEST_KEY] = orjson.dumps(info)
    meta.pop(META_SHA_KEY)
    lie = tmp_path / "lie.parquet"
    pq.write_table(
        stored.replace_schema_metadata(sealed(meta)),
        lie,
        use_compliant_nested_type=False,
        row_group_size=2,
    )
    with pytest.raises(SchemaError, match=r"row group 0: stream 'prompt_ids\[\]'") as err:
        read_rollouts(lie, validate=False)
    assert err.value.path == str(lie)
    info["row_groups"].pop()  # one digest map short of the row groups
    meta[DIGEST_KEY] = orjson.dumps(info)
    pq.write_table(
        stored.replace_schema_metadata(sealed(meta)),
        lie,
        use_compliant_nested_type=False,
        row_group_size=2,
    )
    with pytest.raises(SchemaError, match="digests of 3 row groups, found 'xxh3_128' digests of 2"):
        read_rollouts(lie, validate=False)


def test_a_column_with_nulls_is_not_digested_and_reads_verify_page_crcs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    table = make_table()
    table = table.append_column("note", pa.array(["a", None, "c", None, "e"], pa.large_string()))
    p = write_rollouts(table, tmp_path / "n.parquet", row_group_rows=2)
    record = row_digests(pq.read_schema(p), 3)
    assert record is not None and "note" not in record[0] and "routes" in record[0]
    files = rollout_files(p)
    seen = _spy(monkeypatch)
    assert_rollouts_equal(read_rollouts(files), table)
    assert seen == [True, True]  # a read column without digests: page CRCs on
    seen.clear()
    got = read_rollouts(files, columns=["trajectory_id", "routes"], validate=False)
    assert got.column("trajectory_id").equals(table.column("trajectory_id"))
    assert seen == [True, False]


def test_an_empty_table_round_trips(tmp_path: Path) -> None:
    p = write_rollouts(make_table().slice(0, 0), tmp_path / "e.parquet")
    assert row_digests(pq.read_schema(p), 1) is not None  # one empty row group, digested
    assert read_rollouts(p).num_rows == 0


def _data_page_ranges(path: Path) -> list[tuple[int, int]]:
    return _chunks(path, "")


@settings(max_examples=120, deadline=None)
@given(st.data())
def test_byte_flips_in_data_pages_are_rejected_or_harmless(
    written: tuple[bytes, pa.Table], tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    """Any flip inside a column chunk (page headers, levels, dictionaries, values): every
    reader, validating or not, raises naming the file or returns exactly the rows written."""
    raw, table = written
    directory = tmp_path_factory.mktemp("flip")
    ranges = _data_page_ranges(_put(directory, raw))
    lo, hi = data.draw(st.sampled_from(ranges), label="chunk")
    off = data.draw(st.integers(lo, hi - 1), label="offset")
    spoiled = bytearray(raw)
    spoiled[off] ^= data.draw(st.integers(1, 255), label="xor")
    outcomes = dict(_outcome(_put(directory, bytes(spoiled)), table))
    assert set(outcomes) == set(READERS)


def test_a_renamed_field_in_the_footer_is_caught_without_validation(
    written: tuple[bytes, pa.Table], tmp_path: Path
) -> None:
    """A flip in a Parquet schema name decodes fine (the page CRCs and the data digests
    hold): the record of the fields written catches it, with ``validate=False`` too."""
    data, _ = written
    footer = len(data) - 8 - int.from_bytes(data[-8:-4], "little")
    at = data.index(b"prompt_ids", footer)  # the schema element, first in the footer
    raw = bytearray(data)
    raw[at + 1] ^= ord("r") ^ ord("9")
    p = _put(tmp_path, bytes(raw))
    with pytest.raises(SchemaError, match="expected the fields written") as info:
        read_rollouts(p, validate=False)
    assert info.value.path == str(p) and "p9ompt_ids" in str(info.value)


def test_a_renamed_list_level_in_the_footer_is_not_a_missing_column(
    written: tuple[bytes, pa.Table], tmp_path: Path
) -> None:
    """``routes.list`` renamed in the Parquet schema: the Arrow fields are unchanged, and
    pyarrow skips the leaf paths it no longer finds; the reader names the column lost."""
    data, table = written
    footer = len(data) - 8 - int.from_bytes(data[-8:-4], "little")
    at = data.index(b"list", data.index(b"routes", footer))
    raw = bytearray(data)
    raw[at] ^= 0x64
    p = _put(tmp_path, bytes(raw))
    with pytest.raises(SchemaError, match=r"expected columns \['routes'\]") as info:
        read_rollouts(p, layers=STAGE, validate=False)
    assert info.value.path == str(p)
    # a whole read finds its chunks by position: the rows written (the flip is harmless)
    assert_rollouts_equal(read_rollouts(p, validate=False), table)
