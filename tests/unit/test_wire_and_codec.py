"""ChunkData codec against protobuf, manifest stream round trips, stale generated stubs."""

from __future__ import annotations

import filecmp
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.unit.helpers import make_part, row_shards, sample_arrays
from weightsync._proto import coordinator_pb2 as cpb
from weightsync._proto import trainer_agent_pb2 as tpb
from weightsync.errors import DataLoss, DigestMismatch
from weightsync.manifest import Manifest
from weightsync.transports.grpc import decode_chunk, encode_chunk
from weightsync.wire import ManifestUnchecked, manifest_from_pieces, manifest_to_pieces, part_to_proto

ROOT = Path(__file__).resolve().parents[2]


@settings(max_examples=300, deadline=None)
@given(index=st.integers(0, 2**32 - 1), offset=st.integers(0, 2**64 - 1), data=st.binary(max_size=5000))
def test_encoded_chunk_is_valid_protobuf(index: int, offset: int, data: bytes) -> None:
    raw = encode_chunk(index, offset, memoryview(data))
    msg = tpb.ChunkData.FromString(raw)
    assert (msg.index, msg.offset, msg.data) == (index, offset, data)
    got = decode_chunk(raw)
    assert (got.index, got.offset, bytes(got.data)) == (index, offset, data)
    # and the decoder reads what protobuf itself writes
    ref = decode_chunk(tpb.ChunkData(index=index, offset=offset, data=data).SerializeToString())
    assert (ref.index, ref.offset, bytes(ref.data)) == (index, offset, data)


@settings(max_examples=500, deadline=None)
@given(st.binary(min_size=1, max_size=64))
def test_garbage_chunks_raise_data_loss_or_parse_as_protobuf_does(raw: bytes) -> None:
    # Only DataLoss escapes; what the hand decoder accepts, protobuf reads the same way
    # (where protobuf parses it too: it is stricter about truncated fixed-width fields,
    # and it silently truncates an index wider than uint32, which ours refuses).
    try:
        got = decode_chunk(raw)
    except DataLoss:
        return
    try:
        ref = tpb.ChunkData.FromString(raw)
    except DecodeError:
        return
    assert (got.index, got.offset, bytes(got.data)) == (ref.index, ref.offset, ref.data)


def test_a_chunk_index_wider_than_uint32_is_refused_not_truncated() -> None:
    raw = b"\x08\x80\x80\x80\x80\x10"  # field 1 = 2^32: protobuf reads it as chunk 0
    assert tpb.ChunkData.FromString(raw).index == 0
    with pytest.raises(DataLoss, match="does not fit uint32"):
        decode_chunk(raw)


def test_truncated_payload_is_data_loss() -> None:
    raw = encode_chunk(1, 2, b"x" * 100)
    with pytest.raises(DataLoss):
        decode_chunk(raw[:-10])


def test_manifest_stream_round_trip_keeps_digest() -> None:
    arrays = sample_arrays()
    parts = tuple(make_part(row_shards(arrays, r, 2), rank=r)[0] for r in range(2))
    m = Manifest("job", 3, 1, parts[0].chunk_bytes, parts)
    header = cpb.ManifestHeader(chunk_bytes=m.chunk_bytes, parts=[part_to_proto(p) for p in parts])
    header.version.session, header.version.version, header.version.generation = "job", 3, 1
    header.version.manifest_digest = m.digest()
    _, back = manifest_from_pieces(manifest_to_pieces(header, m))
    assert back.digest() == m.digest()
    assert back.tensor_digests() == m.tensor_digests()
    # a stream whose descriptors do not hash to the header's digest is refused where it is read
    header.version.manifest_digest = "0" * 64
    with pytest.raises(ManifestUnchecked, match="manifest of version 3 does not check: it hashes to") as e:
        manifest_from_pieces(manifest_to_pieces(header, m))
    assert isinstance(e.value, DigestMismatch) and e.value.header.version.version == 3  # a rollout reports it
    # so is one whose body does not build: it names the version its header gave
    pieces = list(manifest_to_pieces(header, m))
    pieces[1].batch.rank = 7
    with pytest.raises(ManifestUnchecked, match="version 3 does not check: manifest.batch.rank: unknown rank 7"):
        manifest_from_pieces(pieces)


@settings(max_examples=40, deadline=None)
@given(
    ranks=st.integers(1, 3),
    session=st.from_regex(r"[a-z0-9]([a-z0-9._-]{0,20}[a-z0-9])?", fullmatch=True),
    version=st.integers(1, 2**63 - 1),
    stage_seconds=st.sampled_from([0.0, 0.25, 1e-9, 12345.678]),
    address=st.sampled_from(["127.0.0.1:1", "[::1]:7001", "höst:9"]),
)
def test_digests_and_stored_json_made_from_canonical_parts_equal_the_whole_encoding(
    ranks: int, session: str, version: int, stage_seconds: float, address: str
) -> None:
    """Manifest.digest splices each part's canonical encoding into the manifest's, and
    Part.to_json builds the stored body around it: both equal encoding the whole again."""
    import dataclasses
    import json

    from weightsync.digests import DIGEST_ALGORITHM, canonical_json, sha256_hex

    arrays = sample_arrays(seed=version % 7)
    parts = tuple(
        dataclasses.replace(
            make_part(row_shards(arrays, r, ranks), rank=r, address=address)[0], stage_seconds=stage_seconds
        )
        for r in range(ranks)
    )
    m = Manifest(session, version, 1, parts[0].chunk_bytes, parts)
    whole = {
        "session": session,
        "version": version,
        "chunk_bytes": m.chunk_bytes,
        "digest_algorithm": DIGEST_ALGORITHM,
        "parts": [p.content_dict() for p in parts],
    }
    assert m.digest() == sha256_hex(canonical_json(whole))
    for p in parts:
        assert json.loads(p.to_json()) == json.loads(json.dumps(p.to_dict()))


JSON_LEAVES = st.one_of(st.integers(-(2**63), 2**64), st.floats(allow_nan=False), st.text(max_size=8), st.booleans())


@settings(max_examples=200, deadline=None)
@given(
    obj=st.dictionaries(
        st.text(max_size=6),
        st.one_of(JSON_LEAVES, st.lists(st.one_of(JSON_LEAVES, st.dictionaries(st.text(max_size=3), JSON_LEAVES)))),
        max_size=6,
    ),
    items=st.integers(1, 4),
)
def test_canonical_json_sliced_equals_canonical_json(obj: dict, items: int, monkeypatch_module: None) -> None:
    from weightsync import digests

    digests.SLICE_ITEMS = items  # short slices: every list is cut at every boundary
    assert digests.canonical_json_sliced(obj) == digests.canonical_json(obj)


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[None]:
    from weightsync import digests

    kept = digests.SLICE_ITEMS
    yield
    digests.SLICE_ITEMS = kept


def test_generated_stubs_are_fresh(tmp_path: Path) -> None:
    """`make protos` output must equal what is committed (regenerate and commit if not)."""
    pytest.importorskip("grpc_tools", reason="regenerating the stubs needs grpcio-tools (the dev extra)")
    sys.path.insert(0, str(ROOT / "protos"))
    try:
        import generate  # type: ignore[import-not-found]
    finally:
        sys.path.pop(0)
    generate.generate(tmp_path)
    committed = ROOT / "weightsync" / "_proto"
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == sorted(p.name for p in committed.iterdir() if p.is_file() and not p.name.endswith(".pyc")), (
        "run `make protos`"
    )
    _, mismatch, errors = filecmp.cmpfiles(tmp_path, committed, names, shallow=False)
    assert not mismatch and not errors, f"stale generated stubs {mismatch or errors}: run `make protos` and commit"
