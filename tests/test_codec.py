"""Tests for ectier.codec (codecs: round trip, corruption, registry, config) and ectier.record (header).

Everything here is CPU-only and torch-free, like the module under test.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import pathlib
import pickle
import struct
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import xxhash
import zstandard
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from ectier import codec as codec_mod
from ectier import record as record_mod
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
from ectier.record import (
    MAX_HEADER_NBYTES,
    RECORD_FORMAT_VERSION,
    RECORD_MAGIC,
    RecordHeader,
    checksum,
    header_nbytes,
    pack_header,
    pack_record,
    split_record,
    unpack_header,
    verify_payload,
)
from ectier.errors import ConfigError, CorruptRecordError, EctierError, UnknownCodecError

GOLDEN_DIR = pathlib.Path(__file__).resolve().parent / "golden"
POISON = 0xAB
ITEMSIZES = (1, 2, 4, 8)
ALL_CODECS = (RawCodec(), ZstdCodec(), PlaneZstdCodec())
ZSTD_CODECS = (ZstdCodec(), PlaneZstdCodec())


def slow(max_examples: int) -> settings:
    return settings(
        max_examples=max_examples,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------


def bf16_like(numel: int, seed: int = 0) -> np.ndarray:
    """Realistic bf16 bytes without torch: float32 N(0, 1) truncated to the top 16 bits."""
    f32 = np.random.default_rng(seed).standard_normal(numel, dtype=np.float32)
    return (f32.view(np.uint32) >> 16).astype("<u2").view(np.uint8)


def make_bytes(kind: str, nbytes: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "random":
        return rng.integers(0, 256, nbytes, dtype=np.uint8)
    if kind == "zeros":
        return np.zeros(nbytes, dtype=np.uint8)
    if kind == "repeat":
        return np.resize(rng.integers(0, 256, 7, dtype=np.uint8), nbytes)
    if kind == "bf16":
        out = bf16_like((nbytes + 1) // 2, seed)
        return np.ascontiguousarray(out[:nbytes])
    raise AssertionError(kind)


def roundtrip(codec: Codec, raw: np.ndarray, itemsize: int) -> bytes:
    """Encode, decode into a poisoned buffer, check the bytes; the payload as bytes."""
    payload = codec.encode(raw, itemsize)
    out = np.full(len(raw), POISON, dtype=np.uint8)
    codec.decode_into(payload, out, itemsize)
    assert out.tobytes() == raw.tobytes()
    return bytes(payload)


def make_header(**overrides) -> RecordHeader:
    fields = dict(
        codec_id=1,
        dtype="bfloat16",
        shape=(64, 8192),
        namespace="qwen3_vl_moe/bf16",
        key="mm_hash:3f2a",
        raw_nbytes=64 * 8192 * 2,
        payload_nbytes=700_000,
        payload_checksum=0x0123456789ABCDEF,
        version=42,
        created_ns=1_795_000_000_123_456_789,
        codec_config={"level": 1, "threads": 0},
    )
    fields.update(overrides)
    return RecordHeader(**fields)


def reseal(buf: bytes | bytearray) -> bytes:
    """Recompute a header's trailing checksum, to forge well-sealed but invalid headers."""
    body = bytes(buf[:-8])
    return body + struct.pack("<Q", xxhash.xxh3_64_intdigest(body))


def load_make_golden():
    spec = importlib.util.spec_from_file_location("make_golden", GOLDEN_DIR / "make_golden.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
    numel = codec_mod._PLANE_CHUNK_ROWS + 12_345
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


# ------------------------------------------------------------------------------------------------
# codecs: bad input and corrupt payloads
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
# codecs: registry and config
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


def test_register_codec(monkeypatch):
    # Work on copies of the registry so the new codec does not leak into other tests.
    monkeypatch.setattr(codec_mod, "_BY_ID", dict(codec_mod._BY_ID))
    monkeypatch.setattr(codec_mod, "_BY_NAME", dict(codec_mod._BY_NAME))

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


# ------------------------------------------------------------------------------------------------
# record header
# ------------------------------------------------------------------------------------------------

keys = st.one_of(
    st.text(max_size=300),
    st.text(alphabet=st.sampled_from("\x00a\u00e9\u4e2d\U0001f389\U0001f600"), max_size=300),
    st.sampled_from(["", "\x00", "\x00" * 16, "🎉" * 1024, "k" * 4096, "é" * 32768, "🎉" * 16384]),
)
u64 = st.integers(0, 2**64 - 1)
json_scalars = st.one_of(st.integers(-(2**53), 2**53), st.booleans(), st.none(), st.text(max_size=20))
configs = st.dictionaries(st.text(max_size=10), json_scalars, max_size=4)


@st.composite
def headers(draw) -> RecordHeader:
    shape = tuple(draw(st.lists(st.integers(0, 2**16), max_size=6)))
    numel = int(np.prod(shape, dtype=object)) if shape else 1
    raw_nbytes = numel * draw(st.sampled_from(ITEMSIZES))
    assume(raw_nbytes < 2**64)
    codec_id = draw(st.sampled_from([0, 1, 2, 7, 65535]))
    return RecordHeader(
        codec_id=codec_id,
        dtype=draw(st.sampled_from(["bfloat16", "float8_e4m3fn", "float32", "uint8"]) | st.text(min_size=1, max_size=40)),
        shape=shape,
        namespace=draw(keys),
        key=draw(keys),
        raw_nbytes=raw_nbytes,
        payload_nbytes=raw_nbytes if codec_id == 0 else draw(u64),
        payload_checksum=draw(u64),
        version=draw(u64),
        created_ns=draw(u64),
        codec_config=draw(configs),
    )


@slow(300)
@given(h=headers())
def test_header_round_trip(h):
    packed = pack_header(h)
    assert packed[:4] == RECORD_MAGIC
    assert header_nbytes(packed) == len(packed)
    back = unpack_header(packed)
    assert back == h
    assert back.key == h.key and back.namespace == h.namespace and back.shape == h.shape
    assert pack_header(back) == packed  # deterministic: same header, same bytes
    assert unpack_header(memoryview(packed)) == h
    assert unpack_header(np.frombuffer(packed, np.uint8)) == h


@pytest.mark.parametrize("key", ["\x00", "a\x00b", "🎉", "k" * 4096, "🎉" * 16384, "\x00" * 65536, "é" * 40000])
def test_header_round_trip_of_special_keys(key):
    h = make_header(key=key, namespace=key[:100])
    assert unpack_header(pack_header(h)) == h


def test_header_layout_matches_the_documented_table():
    h = make_header(shape=(3, 5), raw_nbytes=30, key="ké", namespace="ns", codec_config={"level": 1})
    b = pack_header(h)
    assert b[0:4] == b"ECTR" == RECORD_MAGIC
    assert struct.unpack_from("<HHI", b, 4) == (RECORD_FORMAT_VERSION, 1, len(b))
    assert RECORD_FORMAT_VERSION == 1
    assert struct.unpack_from("<5Q", b, 12) == (30, 700_000, 0x0123456789ABCDEF, 42, 1_795_000_000_123_456_789)
    assert struct.unpack_from("<HHIII", b, 52) == (2, 8, 2, 3, 11)
    assert b[68:76] == b"bfloat16"
    assert struct.unpack_from("<2Q", b, 76) == (3, 5)
    assert b[92:94] == b"ns"
    assert b[94:97] == "ké".encode()
    assert b[97:108] == b'{"level":1}'
    assert struct.unpack_from("<Q", b, 108) == (xxhash.xxh3_64_intdigest(b[:108]),)
    assert len(b) == 116


def test_every_single_bit_flip_of_a_header_is_corrupt():
    packed = pack_header(make_header(key="mm\x00hash/🎉", codec_config={"level": 1}))
    for bit in range(len(packed) * 8):
        flipped = bytearray(packed)
        flipped[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(CorruptRecordError):
            unpack_header(flipped)


@slow(200)
@given(h=headers(), data=st.data())
def test_random_bit_flips_of_any_header_are_corrupt(h, data):
    packed = pack_header(h)
    flipped = bytearray(packed)
    for bit in data.draw(st.sets(st.integers(0, len(packed) * 8 - 1), min_size=1, max_size=3)):
        flipped[bit // 8] ^= 1 << (bit % 8)
    with pytest.raises(CorruptRecordError):
        unpack_header(flipped)


def test_every_truncation_and_extension_of_a_header_is_corrupt():
    packed = pack_header(make_header(key="k" * 300))
    for cut in range(len(packed)):
        with pytest.raises(CorruptRecordError):
            unpack_header(packed[:cut])
    for tail in (b"\x00", b"x" * 100):
        with pytest.raises(CorruptRecordError, match="length mismatch"):
            unpack_header(packed + tail)


def test_header_error_messages_are_specific():
    packed = pack_header(make_header())
    cases = [
        (packed[:10], "too short"),
        (b"XCTR" + packed[4:], "magic"),
        (packed[:4] + struct.pack("<H", 2) + packed[6:], "format version 2"),
        (packed[:8] + struct.pack("<I", 10**7) + packed[12:], "header length"),
        (packed + b"\x00", "length mismatch"),
        (packed[:-1] + bytes([packed[-1] ^ 1]), "checksum mismatch"),
    ]
    for buf, message in cases:
        with pytest.raises(CorruptRecordError, match=message):
            unpack_header(buf)


def _forge(h: RecordHeader, **patch) -> bytes:
    """Pack ``h`` then overwrite fields at their documented offsets and reseal the checksum."""
    b = bytearray(pack_header(h))
    for offset, (fmt, value) in patch.items():
        struct.pack_into(fmt, b, int(offset.lstrip("o")), value)
    return reseal(b)


def test_well_sealed_but_inconsistent_headers_are_corrupt():
    h = make_header(key="abc", namespace="ns", codec_config={"level": 1})
    packed = pack_header(h)
    key_at = 68 + 8 + 16 + 2  # dtype "bfloat16", two shape dims, namespace "ns"
    cfg_at = key_at + 3

    def patched(at: int, new: bytes) -> bytes:
        return reseal(packed[:at] + new + packed[at + len(new):])

    cases = [
        (patched(key_at, b"\xff\xfe\x00"), "UTF-8"),
        (patched(cfg_at, b"["), "JSON"),
        (reseal(packed[:cfg_at] + b'[1,2,3,456]' + packed[-8:]), "not a JSON object"),
        (_forge(h, o60=("<I", 4)), "do not add up"),  # key length one too long
        (_forge(h, o52=("<H", 3)), "do not add up"),  # ndim one too many
        (_forge(h, o12=("<Q", 7)), "inconsistent"),  # raw_nbytes not a multiple of numel
        (_forge(h, o6=("<H", 0)), "inconsistent"),  # raw codec but payload != raw bytes
    ]
    for buf, message in cases:
        with pytest.raises(CorruptRecordError, match=message):
            unpack_header(buf)


def test_record_header_validates_its_fields():
    with pytest.raises(ValueError, match="version"):
        make_header(version=-1)
    with pytest.raises(ValueError, match="created_ns"):
        make_header(created_ns=2**64)
    with pytest.raises(TypeError, match="payload_nbytes"):
        make_header(payload_nbytes=1.5)
    with pytest.raises(TypeError, match="version"):
        make_header(version=True)
    with pytest.raises(ValueError, match="codec_id"):
        make_header(codec_id=65536)
    with pytest.raises(TypeError, match="key"):
        make_header(key=b"bytes")
    with pytest.raises(ValueError, match="dtype"):
        make_header(dtype="")
    with pytest.raises(ValueError, match="shape"):
        make_header(shape=(-1, 8192))
    with pytest.raises(ValueError, match="no elements"):
        make_header(shape=(0, 8192), raw_nbytes=2)
    with pytest.raises(ValueError, match="per element"):
        make_header(shape=(3,), raw_nbytes=7)
    with pytest.raises(ValueError, match="raw"):
        make_header(codec_id=0, raw_nbytes=16, shape=(8,), payload_nbytes=15)
    with pytest.raises(TypeError, match="codec_config"):
        make_header(codec_config={1: 2})
    # normalisation: shape to a tuple of ints, codec_config copied
    config = {"level": 1}
    h = make_header(shape=[np.int64(2), 3], raw_nbytes=12, codec_config=config)
    config["level"] = 9
    assert h.shape == (2, 3) and type(h.shape[0]) is int and h.codec_config == {"level": 1}
    assert h.itemsize == 2 and make_header(shape=(0,), raw_nbytes=0).itemsize is None
    assert hash(h) == hash(make_header(shape=(2, 3), raw_nbytes=12, codec_config={"level": 1}))


def test_pack_header_refuses_what_it_cannot_store():
    with pytest.raises(ValueError, match="utf-8"):
        pack_header(make_header(key="lone \ud800 surrogate"))
    with pytest.raises(ValueError, match="JSON"):
        pack_header(make_header(codec_config={"level": object()}))
    with pytest.raises(ValueError, match="JSON"):
        pack_header(make_header(codec_config={"x": float("nan")}))
    with pytest.raises(ValueError, match="MAX_HEADER_NBYTES"):
        pack_header(make_header(key="k" * MAX_HEADER_NBYTES))
    with pytest.raises(TypeError):
        pack_header({"key": "k"})


def test_header_codec_helper():
    assert make_header(codec_id=2, codec_config={"level": 3}).codec() == PlaneZstdCodec(level=3)
    with pytest.raises(UnknownCodecError):
        make_header(codec_id=7).codec()


# ------------------------------------------------------------------------------------------------
# checksum, payload verification, whole records
# ------------------------------------------------------------------------------------------------


def test_checksum_is_xxh3_64_of_the_bytes_for_any_buffer():
    data = make_bytes("random", 1000, 11)
    expected = xxhash.xxh3_64_intdigest(data.tobytes())
    assert checksum(data) == checksum(data.tobytes()) == checksum(memoryview(data)) == expected
    assert checksum(data.view(np.uint32)) == expected
    assert checksum(b"") == xxhash.xxh3_64_intdigest(b"")


def test_verify_payload():
    payload = b"payload bytes" * 10
    h = make_header(payload_nbytes=len(payload), payload_checksum=checksum(payload), key="k" * 5000)
    verify_payload(h, payload)
    verify_payload(h, memoryview(payload))
    with pytest.raises(CorruptRecordError, match="129 bytes, header says 130"):
        verify_payload(h, payload[:-1])
    with pytest.raises(CorruptRecordError, match="checksum mismatch") as info:
        verify_payload(h, payload[:-1] + b"X")
    assert len(str(info.value)) < 400  # a 5000-byte key is trimmed in the message


@pytest.mark.parametrize("codec", ALL_CODECS, ids=lambda c: c.name)
def test_record_round_trip(codec):
    raw = bf16_like(3000)
    payload = codec.encode(raw, 2)
    h = make_header(
        codec_id=codec.codec_id, shape=(3, 1000), raw_nbytes=raw.nbytes, payload_nbytes=len(payload),
        payload_checksum=checksum(payload), codec_config=codec.get_params(),
    )
    record = pack_record(h, payload)
    back, body = split_record(record)
    assert back == h and bytes(body) == bytes(payload)
    out = np.full(raw.nbytes, POISON, np.uint8)
    back.codec().decode_into(body, out, back.itemsize)
    assert np.array_equal(out, raw)
    with pytest.raises(CorruptRecordError, match="payload is"):
        split_record(bytes(record) + b"\x00")
    with pytest.raises(CorruptRecordError):
        split_record(bytes(record)[:-1], verify=False)
    flipped = bytearray(record)
    flipped[-1] ^= 0x80
    with pytest.raises(CorruptRecordError, match="checksum mismatch"):
        split_record(flipped)
    split_record(flipped, verify=False)  # length only: the caller chose to skip the checksum
    with pytest.raises(ValueError, match="payload_nbytes"):
        pack_record(h, bytes(payload)[:-1])


# ------------------------------------------------------------------------------------------------
# golden files: new code reads old bytes
# ------------------------------------------------------------------------------------------------

# xxh3_64 of make_golden.golden_raw_bytes(2048), the tensor in the checked-in records.
GOLDEN_RAW_XXH3 = 0x9FB6094BF52BA815


def test_golden_files_are_all_present_and_small():
    make_golden = load_make_golden()
    files = sorted(GOLDEN_DIR.glob("*.bin"))
    assert {f.stem for f in files} == set(make_golden.RECORDS)
    assert sum(f.stat().st_size for f in files) < 100_000


@pytest.mark.parametrize("stem", sorted(load_make_golden().RECORDS))
def test_golden_record_decodes_to_the_expected_bytes(stem):
    make_golden = load_make_golden()
    spec = make_golden.RECORDS[stem]
    record = (GOLDEN_DIR / f"{stem}.bin").read_bytes()

    header, payload = split_record(record)
    numel = int(np.prod(spec["shape"]))
    expected = make_golden.golden_raw_bytes(numel)
    assert header == RecordHeader(
        codec_id=registered_codecs()[spec["codec"]],
        dtype=make_golden.DTYPE,
        shape=tuple(spec["shape"]),
        namespace=make_golden.NAMESPACE,
        key=make_golden.KEY,
        raw_nbytes=len(expected),
        payload_nbytes=len(payload),
        payload_checksum=checksum(payload),
        version=spec["version"],
        created_ns=make_golden.CREATED_NS,
        codec_config=spec["params"],
    )
    out = np.full(header.raw_nbytes, POISON, np.uint8)
    header.codec().decode_into(payload, out, make_golden.ITEMSIZE)
    assert out.tobytes() == expected
    # the header encoding itself is a fixed function of its fields
    assert pack_header(header) == record[: header_nbytes(record)]


def test_golden_generator_is_unchanged():
    # If this fails, make_golden.golden_raw_bytes changed: the checked-in files no longer match
    # what the test regenerates. Restore the generator; never rewrite old golden files.
    make_golden = load_make_golden()
    assert checksum(make_golden.golden_raw_bytes(2048)) == GOLDEN_RAW_XXH3
    assert make_golden.golden_raw_bytes(4) == bytes.fromhex("2fbd743f4f3e6cbe")


# ------------------------------------------------------------------------------------------------
# layering
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "module, allowed_third_party, allowed_ours",
    [
        (codec_mod, {"numpy", "zstandard"}, {"ectier.errors", "ectier.record"}),
        (record_mod, {"numpy", "xxhash"}, {"ectier.errors", "ectier.codec"}),  # codec: lazily
    ],
)
def test_codec_and_record_modules_import_no_torch_and_only_each_other_and_errors(
    module, allowed_third_party, allowed_ours
):
    # Parsed, not imported: importing the package may pull torch in through ectier/__init__.
    source = pathlib.Path(module.__file__).read_text()
    imported = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            imported.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            imported.add(("." * node.level) + (node.module or ""))
    ours = {name for name in imported if name.startswith(("ectier", "."))}
    assert ours <= allowed_ours | {"." + name.split(".")[-1] for name in allowed_ours}, ours
    third_party = {n.split(".")[0] for n in imported - ours} - set(sys.stdlib_module_names)
    assert third_party <= allowed_third_party, third_party


def test_codec_module_still_exports_every_record_name():
    # Callers that import record names from ectier.codec (the NVMe tier) keep working.
    for name in record_mod.__all__:
        assert name in codec_mod.__all__, name
        assert getattr(codec_mod, name) is getattr(record_mod, name), name
    assert RawCodec.codec_id == 0  # the id the record header checks raw payload lengths by


def test_multidimensional_and_empty_inputs():
    for codec in ALL_CODECS:
        raw2d = make_bytes("bf16", 6 * 64, 12).reshape(6, 64)
        out = np.empty((6, 64), np.uint8)  # the caller's buffer may be 2-D too
        codec.decode_into(codec.encode(raw2d, 2), out, 2)
        assert np.array_equal(out, raw2d)
        empty = np.empty((0, 8192), np.uint8)
        codec.decode_into(codec.encode(empty, 2), np.empty((0, 8192), np.uint8), 2)
