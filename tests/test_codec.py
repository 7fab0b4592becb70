"""Tests for ectier.codec (codecs: round trip, corruption, registry, config).

Everything here is CPU-only and torch-free, like the module under test. The record header,
checksums, whole records and the golden files: test_record.py. Shared helpers:
tests/codec_helpers.py.
"""

from __future__ import annotations

import json
import pickle
import struct
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import zstandard
from hypothesis import given
from hypothesis import strategies as st

from codec_helpers import ALL_CODECS, ITEMSIZES, POISON, ZSTD_CODECS, bf16_like, make_bytes, make_header, slow
from ectier import codec as codec_mod
from ectier import testing_internals
from ectier.codec import (
    Codec,
    PlaneZstdCodec,
    RawCodec,
    ZstdCodec,
    codec_from_config,
    get_codec,
    register_codec,
    registered_codecs,
)
from ectier.record import checksum, verify_payload
from ectier.errors import ConfigError, CorruptRecordError, EctierError, UnknownCodecError


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------


def roundtrip(codec: Codec, raw: np.ndarray, itemsize: int) -> bytes:
    """Encode, decode into a poisoned buffer, check the bytes; the payload as bytes."""
    payload = codec.encode(raw, itemsize)
    out = np.full(len(raw), POISON, dtype=np.uint8)
    codec.decode_into(payload, out, itemsize)
    assert out.tobytes() == raw.tobytes()
    return bytes(payload)


# ------------------------------------------------------------------------------------------------
# codecs: round trips
# ------------------------------------------------------------------------------------------------


@slow(150)
@given(
    codec=st.sampled_from(ALL_CODECS + (ZstdCodec(level=-7), PlaneZstdCodec(level=5))),
    itemsize=st.sampled_from(ITEMSIZES),
    numel=st.one_of(st.sampled_from([0, 1, 2, 3, 7, 255, 257, 4097]), st.integers(0, 20_000)),
    kind=st.sampled_from(["random", "zeros", "repeat", "bf16"]),
    seed=st.integers(0, 2**32 - 1),
)
def test_roundtrip_is_byte_exact(codec, itemsize, numel, kind, seed):
    roundtrip(codec, make_bytes(kind, numel * itemsize, seed), itemsize)


@pytest.mark.parametrize("itemsize", ITEMSIZES)
@pytest.mark.parametrize("codec", ALL_CODECS, ids=lambda c: c.name)
def test_roundtrip_one_mebibyte(codec, itemsize):
    # ~1 MiB with an odd element count, so the plane split's last chunk is ragged.
    numel = (1 << 20) // itemsize - 3
    roundtrip(codec, make_bytes("bf16", numel * itemsize, itemsize), itemsize)


@pytest.mark.parametrize("codec", ALL_CODECS, ids=lambda c: c.name)
def test_roundtrip_larger_than_one_plane_chunk(codec):
    # More rows than the plane split's scratch chunk, so several chunks per plane are exercised.
    itemsize = 2
    numel = codec_mod.PLANE_CHUNK_ROWS + 12_345
    roundtrip(codec, make_bytes("bf16", numel * itemsize, 7), itemsize)


@pytest.mark.parametrize("codec", ALL_CODECS, ids=lambda c: c.name)
def test_accepts_every_bytes_like_input_and_output(codec):
    raw = make_bytes("bf16", 4096, 3)
    as_f16 = raw.view(np.float16)  # a numpy array of another dtype: its bytes are the data
    for data in (raw.tobytes(), bytearray(raw.tobytes()), memoryview(raw.tobytes()), raw, as_f16):
        payload = codec.encode(data, 2)
        for out in (bytearray(len(raw)), np.empty(len(raw), np.uint8), memoryview(bytearray(len(raw)))):
            codec.decode_into(payload, out, 2)
            assert bytes(out) == raw.tobytes()
        # the payload may also come back as any buffer (an LMDB memoryview, bytes, numpy)
        out = np.empty(len(raw), np.uint8)
        codec.decode_into(np.frombuffer(bytes(payload), np.uint8), out, 2)
        assert out.tobytes() == raw.tobytes()


def test_raw_encode_is_zero_copy_and_decode_copies():
    raw = make_bytes("random", 1000, 1)
    payload = RawCodec().encode(raw, 1)
    assert isinstance(payload, memoryview)
    assert np.shares_memory(np.frombuffer(payload, np.uint8), raw)
    out = np.full(1000, POISON, np.uint8)
    RawCodec().decode_into(payload, out, 1)
    assert not np.shares_memory(out, raw)
    assert np.array_equal(out, raw)


def test_plane_split_layout_is_byte_planes_in_memory_order():
    # The stored stream is byte 0 of every element, then byte 1, ...: pin it, it is a format.
    raw = np.arange(12, dtype=np.uint8)  # three 4-byte elements
    payload = PlaneZstdCodec().encode(raw, 4)
    planes = zstandard.ZstdDecompressor().decompress(payload)
    assert planes == bytes([0, 4, 8, 1, 5, 9, 2, 6, 10, 3, 7, 11])


def test_plane_codec_with_itemsize_1_writes_the_same_payload_as_zstd():
    raw = make_bytes("bf16", 10_000, 2)
    assert bytes(PlaneZstdCodec().encode(raw, 1)) == bytes(ZstdCodec().encode(raw, 1))


def test_zstd_frames_carry_content_size_and_checksum():
    for codec in ZSTD_CODECS:
        payload = codec.encode(make_bytes("bf16", 5000, 4), 2)
        params = zstandard.get_frame_parameters(payload)
        assert params.content_size == 5000
        assert params.has_checksum


def test_multithreaded_compression_round_trips_and_matches_single_threaded_ratio():
    raw = make_bytes("bf16", 4 << 20, 5)
    for cls in (ZstdCodec, PlaneZstdCodec):
        single = roundtrip(cls(), raw, 2)
        multi = roundtrip(cls(threads=2), raw, 2)
        assert abs(len(single) - len(multi)) < 0.02 * len(single)


def test_codecs_are_safe_to_share_between_threads():
    datas = [make_bytes("bf16", 200_000 + 2 * i, i) for i in range(16)]
    errors: list[BaseException] = []

    def work(i: int) -> None:
        codec = ALL_CODECS[i % 3]
        try:
            roundtrip(codec, datas[i], 2)
        except BaseException as exc:  # noqa: BLE001 - collected and re-raised below
            errors.append(exc)

    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(work, range(len(datas))))
    assert not errors, errors


def test_plane_split_compresses_bf16_better_than_plain_zstd():
    # Measured, not assumed: 1 MiB of realistic bf16 (float32 normals truncated to 16 bits).
    raw = bf16_like(1 << 19)
    assert raw.nbytes == 1 << 20
    plain = len(roundtrip(ZstdCodec(level=1), raw, 2))
    planes = len(roundtrip(PlaneZstdCodec(level=1), raw, 2))
    plain_ratio, plane_ratio = raw.nbytes / plain, raw.nbytes / planes
    print(f"zstd level 1 on bf16 N(0,1): plain {plain_ratio:.3f}, byte planes {plane_ratio:.3f}")
    assert plane_ratio > plain_ratio


def test_multidimensional_and_empty_inputs():
    for codec in ALL_CODECS:
        raw2d = make_bytes("bf16", 6 * 64, 12).reshape(6, 64)
        out = np.empty((6, 64), np.uint8)  # the caller's buffer may be 2-D too
        codec.decode_into(codec.encode(raw2d, 2), out, 2)
        assert np.array_equal(out, raw2d)
        empty = np.empty((0, 8192), np.uint8)
        codec.decode_into(codec.encode(empty, 2), np.empty((0, 8192), np.uint8), 2)


# ------------------------------------------------------------------------------------------------
# codecs: corruption and bad arguments
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("codec", ALL_CODECS, ids=lambda c: c.name)
def test_decode_into_a_wrong_length_buffer_is_corrupt(codec):
    raw = make_bytes("bf16", 4096, 6)
    payload = codec.encode(raw, 2)
    for wrong in (4094, 4098, 0):
        with pytest.raises(CorruptRecordError):
            codec.decode_into(payload, np.empty(wrong, np.uint8), 2)


@pytest.mark.parametrize("codec", ALL_CODECS, ids=lambda c: c.name)
def test_bad_arguments_raise_value_or_type_error(codec):
    raw = make_bytes("bf16", 64, 0)
    payload = codec.encode(raw, 2)
    with pytest.raises(ValueError, match="writable"):
        codec.decode_into(payload, bytes(64), 2)
    for itemsize in (0, -2, 2.0, True):
        with pytest.raises(ValueError, match="itemsize"):
            codec.encode(raw, itemsize)
        with pytest.raises(ValueError, match="itemsize"):
            codec.decode_into(payload, bytearray(64), itemsize)
    with pytest.raises(ValueError, match="contiguous"):
        codec.encode(np.zeros((8, 8), np.uint8)[:, ::2], 1)
    with pytest.raises(TypeError):
        codec.encode("not bytes", 1)


def test_plane_codec_rejects_length_not_a_multiple_of_itemsize():
    with pytest.raises(ValueError, match="multiple of itemsize 2"):
        PlaneZstdCodec().encode(bytes(7), 2)
    payload = PlaneZstdCodec().encode(bytes(8), 2)
    with pytest.raises(ValueError, match="multiple of itemsize 4"):
        PlaneZstdCodec().decode_into(payload, bytearray(6), 4)


@pytest.mark.parametrize("codec", ZSTD_CODECS, ids=lambda c: c.name)
def test_every_truncation_of_a_zstd_payload_is_corrupt(codec):
    raw = make_bytes("bf16", 2048, 8)
    payload = bytes(codec.encode(raw, 2))
    for cut in range(len(payload)):
        out = np.full(len(raw), POISON, np.uint8)
        with pytest.raises(CorruptRecordError):
            codec.decode_into(payload[:cut], out, 2)


@pytest.mark.parametrize("codec", ZSTD_CODECS, ids=lambda c: c.name)
def test_trailing_bytes_after_a_zstd_frame_are_corrupt(codec):
    raw = make_bytes("bf16", 2048, 9)
    payload = bytes(codec.encode(raw, 2))
    empty_frame = zstandard.ZstdCompressor(write_content_size=True).compress(b"")
    for tail in (b"\x00", b"garbage", empty_frame, bytes(codec.encode(raw, 2))):
        with pytest.raises(CorruptRecordError):
            codec.decode_into(payload + tail, np.empty(len(raw), np.uint8), 2)


@pytest.mark.parametrize("codec", ZSTD_CODECS, ids=lambda c: c.name)
def test_every_bit_flip_of_a_zstd_payload_fails_or_decodes_exactly(codec):
    # A flipped payload must never decode silently to wrong bytes: zstd's content checksum (and
    # the frame walk) catches almost every flip; a flip in a field that does not change the
    # output (e.g. the window size) may decode, but only to the exact original bytes. The
    # record's xxh3 catches every one of them.
    raw = make_bytes("bf16", 1024, 10)
    payload = bytes(codec.encode(raw, 2))
    header = make_header(
        codec_id=codec.codec_id, shape=(512,), raw_nbytes=1024, payload_nbytes=len(payload),
        payload_checksum=checksum(payload),
    )
    verify_payload(header, payload)
    caught = 0
    for bit in range(len(payload) * 8):
        flipped = bytearray(payload)
        flipped[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(CorruptRecordError):
            verify_payload(header, flipped)
        out = np.full(len(raw), POISON, np.uint8)
        try:
            codec.decode_into(flipped, out, 2)
        except CorruptRecordError:
            caught += 1
        else:
            assert out.tobytes() == raw.tobytes(), f"bit {bit} decoded silently to wrong bytes"
    assert caught > 0.95 * len(payload) * 8


@pytest.mark.parametrize("codec", ZSTD_CODECS, ids=lambda c: c.name)
def test_non_zstd_or_unsized_payloads_are_corrupt(codec):
    raw = b"\x01\x02" * 100
    no_size = zstandard.ZstdCompressor(write_content_size=False).compressobj()
    unsized = no_size.compress(raw) + no_size.flush()
    assert zstandard.frame_content_size(unsized) == -1  # python-zstandard's "unknown"
    skippable = struct.pack("<II", 0x184D2A50, 4) + b"skip"
    for payload in (b"", b"\x28\xb5\x2f", b"not a zstd frame at all", raw, unsized, skippable):
        with pytest.raises(CorruptRecordError):
            codec.decode_into(payload, bytearray(len(raw)), 2)


def test_raw_codec_length_mismatch_is_corrupt():
    with pytest.raises(CorruptRecordError, match="raw payload is 3 bytes, expected 4"):
        RawCodec().decode_into(b"abc", bytearray(4), 1)


# ------------------------------------------------------------------------------------------------
# registry and config
# ------------------------------------------------------------------------------------------------


def test_registry_knows_the_three_codecs_by_name_and_id():
    assert registered_codecs() == {"raw": 0, "zstd": 1, "zstd-planes": 2}
    for name, cls in (("raw", RawCodec), ("zstd", ZstdCodec), ("zstd-planes", PlaneZstdCodec)):
        assert type(get_codec(name)) is cls
        assert type(get_codec(cls.codec_id)) is cls
        assert get_codec(name).name == name


@pytest.mark.parametrize("value", ["lz4", "ZSTD", "", 3, 99, -1, True, None, 1.0])
def test_get_codec_unknown_names_the_value_and_the_known_codecs(value):
    with pytest.raises(UnknownCodecError) as info:
        get_codec(value)
    message = str(info.value)
    assert repr(value) in message
    for name in ("raw", "zstd", "zstd-planes"):
        assert repr(name) in message
    assert isinstance(info.value, ValueError) and isinstance(info.value, EctierError)


@pytest.mark.parametrize("name", ["zstd", "zstd-planes", 1, 2])
@pytest.mark.parametrize(
    "params, field",
    [
        ({"level": 23}, "level"),
        ({"level": -8}, "level"),
        ({"level": "1"}, "level"),
        ({"level": True}, "level"),
        ({"level": 1.0}, "level"),
        ({"threads": -2}, "threads"),
        ({"threads": "4"}, "threads"),
        ({"threads": 10_000}, "threads"),
        ({"lvl": 1}, "lvl"),
    ],
)
def test_get_codec_bad_parameters_name_the_parameter(name, params, field):
    with pytest.raises(ConfigError, match=field) as info:
        get_codec(name, **params)
    assert isinstance(info.value, ValueError)


def test_raw_codec_takes_no_parameters():
    with pytest.raises(ConfigError, match="'level'"):
        get_codec("raw", level=1)


def test_level_range_ends_are_accepted():
    for level in (-7, 0, 1, 22):
        assert get_codec("zstd", level=level).level == level


@pytest.mark.parametrize(
    "codec",
    [RawCodec(), ZstdCodec(), ZstdCodec(level=19, threads=4), PlaneZstdCodec(), PlaneZstdCodec(level=-3)],
    ids=repr,
)
def test_config_round_trip(codec):
    config = codec.get_config()
    assert config["name"] == codec.name
    assert codec_from_config(config) == codec
    assert codec_from_config(json.loads(json.dumps(config))) == codec
    assert type(codec).from_config(config) == codec
    assert get_codec(codec.codec_id, **codec.get_params()) == codec
    assert pickle.loads(pickle.dumps(codec)) == codec
    assert hash(codec_from_config(config)) == hash(codec)


def test_codec_equality_depends_on_type_and_parameters():
    assert ZstdCodec() == ZstdCodec(level=1, threads=0)
    assert ZstdCodec() != ZstdCodec(level=3)
    assert ZstdCodec() != PlaneZstdCodec()
    assert RawCodec() != ZstdCodec()


def test_codec_from_config_errors():
    with pytest.raises(ConfigError, match="name"):
        codec_from_config({"level": 1})
    with pytest.raises(ConfigError, match="name"):
        codec_from_config("zstd")
    with pytest.raises(UnknownCodecError, match="'brotli'"):
        codec_from_config({"name": "brotli"})
    with pytest.raises(ConfigError, match="'zstd-planes'"):
        ZstdCodec.from_config({"name": "zstd-planes"})


@pytest.fixture
def isolated_codecs():
    """The codec registry as it was after the test, so that a test's codecs do not leak into others."""
    with testing_internals.isolated_codec_registry():
        yield


def test_register_codec(isolated_codecs):
    @register_codec
    class XorCodec(Codec):
        codec_id = 60_000
        name = "test-xor"

        def encode(self, data, itemsize):
            return (np.frombuffer(data, np.uint8) ^ 0x5A).tobytes()

        def decode_into(self, payload, out, itemsize):
            np.bitwise_xor(np.frombuffer(payload, np.uint8), 0x5A, out=np.frombuffer(out, np.uint8))

    assert register_codec(XorCodec) is XorCodec  # idempotent
    assert type(get_codec("test-xor")) is XorCodec
    assert type(codec_from_config({"name": "test-xor"})) is XorCodec
    roundtrip(get_codec(60_000), make_bytes("random", 100, 0), 1)

    class Clash(XorCodec):
        name = "other-name"  # same id 60_000

    with pytest.raises(ValueError, match="60000"):
        register_codec(Clash)

    class NameClash(XorCodec):
        codec_id = 60_001
        name = "zstd"

    with pytest.raises(ValueError, match="'zstd'"):
        register_codec(NameClash)

    class BadId(XorCodec):
        codec_id = 70_000
        name = "bad-id"

    with pytest.raises(TypeError, match="codec_id"):
        register_codec(BadId)
    with pytest.raises(TypeError):
        register_codec(dict)
