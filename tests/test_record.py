"""Tests for ectier.record: the record header, checksums and payload verification, whole
records, the golden files (new code reads old bytes), and which modules codec and record import.

Everything here is CPU-only and torch-free, like the module under test. The codecs themselves:
test_codec.py. Shared helpers: tests/codec_helpers.py.
"""

from __future__ import annotations

import ast
import importlib.util
import pathlib
import struct
import sys

import numpy as np
import pytest
import xxhash
from hypothesis import assume, given
from hypothesis import strategies as st

from codec_helpers import ALL_CODECS, ITEMSIZES, POISON, bf16_like, make_bytes, make_header, slow
from ectier import codec as codec_mod
from ectier import record as record_mod
from ectier import zstd_frames as zstd_frames_mod
from ectier.codec import PlaneZstdCodec, RawCodec, registered_codecs
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
from ectier.errors import CorruptRecordError, UnknownCodecError


# ------------------------------------------------------------------------------------------------
# helpers
# ------------------------------------------------------------------------------------------------


GOLDEN_DIR = pathlib.Path(__file__).resolve().parent / "golden"


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
        (codec_mod, {"numpy", "zstandard"}, {"ectier.errors", "ectier.record", "ectier.zstd_frames"}),
        (zstd_frames_mod, {"numpy", "zstandard"}, {"ectier.errors"}),
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
