"""Tests for ectier.entry: key / namespace validation, digests, EntryMeta, dtypes, versions."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import sys
import threading

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ectier import testing_internals
from ectier.entry import (
    DTYPE_ITEMSIZE,
    MAX_KEY_BYTES,
    EntryMeta,
    EntryState,
    dtype_itemsize,
    entry_digest,
    next_version,
    validate_key,
    validate_namespace,
)
from ectier.errors import EctierError, InvalidKeyError, InvalidTensorError

# ------------------------------------------------------------------------------------ keys


def test_max_key_bytes_is_64_kib():
    assert MAX_KEY_BYTES == 64 * 1024


@pytest.mark.parametrize(
    "key",
    ["a", "0123456789abcdef" * 4, "lora:abc", " ", "\0", "a/../../etc/passwd"],
    ids=["one-char", "mm_hash", "lora", "space", "nul", "path-like"],
)
def test_valid_keys_are_returned_unchanged(key):
    assert validate_key(key) is key


@pytest.mark.parametrize("bad", [b"abc", 123, None, ["a"], 1.0])
def test_non_str_key(bad):
    with pytest.raises(InvalidKeyError, match="^mm_hash: expected str") as info:
        validate_key(bad, arg="mm_hash")
    assert isinstance(info.value, ValueError) and isinstance(info.value, EctierError)


@pytest.mark.parametrize("bad", ["\ud800", "abc\udfffdef"])
def test_lone_surrogates_refused(bad):
    with pytest.raises(InvalidKeyError, match="^key: not encodable as UTF-8"):
        validate_key(bad)
    with pytest.raises(InvalidKeyError, match="^namespace: not encodable as UTF-8"):
        validate_namespace(bad)


def test_empty_key():
    with pytest.raises(InvalidKeyError, match="^key: must be a non-empty"):
        validate_key("")


@pytest.mark.parametrize(
    "char, nbytes",
    [("a", 1), ("é", 2), ("€", 3), ("😀", 4)],
    ids=["ascii", "2-byte", "3-byte", "4-byte"],
)
def test_key_limit_is_in_utf8_bytes(char, nbytes):
    assert len(char.encode("utf-8", "surrogatepass")) == nbytes
    fits = MAX_KEY_BYTES // nbytes
    validate_key(char * fits)  # at or just under the limit
    with pytest.raises(InvalidKeyError, match="longer than 65536"):
        validate_key(char * (fits + 1))


def test_key_just_over_limit_by_one_byte_with_mixed_widths():
    key = "😀" * (MAX_KEY_BYTES // 4) + "a"  # 65537 bytes in 16385 chars
    with pytest.raises(InvalidKeyError):
        validate_key(key)
    validate_key("😀" * (MAX_KEY_BYTES // 4 - 1) + "abcd")  # exactly 65536 bytes


@pytest.mark.parametrize("bad", ["", None, 5, b"ns"])
def test_bad_namespace(bad):
    with pytest.raises(InvalidKeyError, match="^ns:"):
        validate_namespace(bad, arg="ns")


def test_namespace_limit_in_bytes():
    assert validate_namespace("é" * 2048) == "é" * 2048
    with pytest.raises(InvalidKeyError, match="4096"):
        validate_namespace("é" * 2049)


# --------------------------------------------------------------------------------- digests


def test_digest_format_is_stable():
    """The digest is stored on disk (LMDB keys): changing it orphans every existing store."""
    assert entry_digest("ns", "key").hex() == "7967b16fdcc7eb3d94e7b2b163ff7d342d78c7440c9540bc836d80fa7b55d9db"
    assert (
        entry_digest("Qwen/Qwen3-VL-30B-A3B-Instruct@main:bfloat16", "0123456789abcdef" * 4).hex()
        == "2aa981807a4b27c1a93985b661ed47518d8c5f547108135b06cb7815648faf54"
    )


def test_digest_matches_documented_construction():
    ns, key = "model", "k€y"
    h = hashlib.blake2b(digest_size=32, person=b"ectier-entry")
    for part in (ns.encode(), key.encode()):
        h.update(len(part).to_bytes(8, "little") + part)
    assert entry_digest(ns, key) == h.digest()


def test_digest_length_prefix_separates_boundaries():
    assert entry_digest("a", "bc") != entry_digest("ab", "c")
    assert entry_digest("", "abc") != entry_digest("abc", "")
    assert entry_digest("ns", "key") != entry_digest("key", "ns")


def test_digest_keeps_lone_surrogates_distinct():
    assert entry_digest("ns", "\ud800") != entry_digest("ns", "\ufffd")
    assert entry_digest("ns", "\ud800") != entry_digest("ns", "?")


@given(st.text(), st.text(), st.text(), st.text())
def test_digest_distinct_for_distinct_identities(ns1, k1, ns2, k2):
    d1, d2 = entry_digest(ns1, k1), entry_digest(ns2, k2)
    assert len(d1) == 32 and isinstance(d1, bytes)
    assert (d1 == d2) == ((ns1, k1) == (ns2, k2))
    assert entry_digest(ns1, k1) == d1  # deterministic


# ---------------------------------------------------------------------------------- dtypes


def test_dtype_itemsize_table():
    expected = {
        "bool": 1, "uint8": 1, "int8": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
        "int16": 2, "float16": 2, "bfloat16": 2, "int32": 4, "float32": 4,
        "int64": 8, "float64": 8, "complex64": 8, "complex128": 16,
    }
    for name, size in expected.items():
        assert dtype_itemsize(name) == size
        assert DTYPE_ITEMSIZE[name] == size


@pytest.mark.parametrize("bad", ["torch.bfloat16", "float", "qint8", "", "BFLOAT16"])
def test_unknown_dtype(bad):
    with pytest.raises(InvalidTensorError, match="not supported"):
        dtype_itemsize(bad)


# ------------------------------------------------------------------------------- EntryMeta


def test_entry_meta_valid():
    m = EntryMeta("ns", "k", "bfloat16", (2040, 8192), 2040 * 8192 * 2)
    assert m.itemsize == 2 and m.nbytes == 33423360
    assert EntryMeta("ns", "k", "float32", (), 4).nbytes == 4  # 0-dim
    assert EntryMeta("ns", "k", "float32", (0, 7), 0).nbytes == 0  # zero-size
    assert EntryMeta("ns", "k", "complex128", (3,), 48).itemsize == 16


def test_entry_meta_is_frozen_and_hashable():
    m = EntryMeta("ns", "k", "uint8", (4,), 4)
    with pytest.raises(AttributeError):
        m.nbytes = 5  # type: ignore[misc]
    assert {m: 1}[EntryMeta("ns", "k", "uint8", (4,), 4)] == 1


@pytest.mark.parametrize(
    "dtype, shape, nbytes, match",
    [
        ("bfloat16", (4,), 4, "nbytes"),
        ("float32", (), 1, "nbytes"),
        ("float32", (2, 3), 23, "nbytes"),
        ("uint8", (4,), 4.0, "nbytes"),
        ("bool", (), True, "nbytes"),
        ("uint8", (4,), "4", "nbytes"),
        ("uint8", (-1,), -1, "shape"),
        ("uint8", (2, -2), 4, "shape"),
        ("uint8", [4], 4, "shape"),
        ("uint8", (4.0,), 4, "shape"),
        ("uint8", (True,), 1, "shape"),
        ("float", (4,), 16, "not supported"),
    ],
)
def test_entry_meta_rejects_inconsistent_fields(dtype, shape, nbytes, match):
    with pytest.raises(InvalidTensorError, match=match):
        EntryMeta("ns", "k", dtype, shape, nbytes)


def test_entry_state_values():
    assert [s.value for s in EntryState] == ["reserved", "committed", "leaving"]


# -------------------------------------------------------------------------------- versions


def test_next_version_strictly_increasing():
    vs = [next_version() for _ in range(1000)]
    assert all(b > a for a, b in zip(vs, vs[1:]))
    assert all(isinstance(v, int) and 0 < v < 2**64 for v in vs)


@pytest.fixture
def fake_clock():
    """``install(values)`` replaces entry's clock by one reading ``values``; the clock and the
    module's last version (as it was when the test began) are restored afterwards."""
    with contextlib.ExitStack() as stack:
        stack.enter_context(testing_internals.version_clock())  # the last version, put back after

        def install(values):
            it = iter(values)
            stack.enter_context(testing_internals.version_clock(lambda: next(it)))

        yield install


def test_next_version_increases_even_if_the_clock_stalls_or_goes_back(fake_clock):
    start = next_version() + 10**9
    fake_clock([start, start, start, start - 10**9, 1])
    vs = [next_version() for _ in range(5)]
    assert vs == [start + i for i in range(5)]


def test_next_version_follows_the_clock_when_it_is_ahead(fake_clock):
    last = next_version()
    fake_clock([last + 1000, last + 5000])
    assert next_version() == last + 1000
    assert next_version() == last + 5000


@pytest.fixture
def fast_thread_switching():
    """Switch threads every microsecond so that an unlocked read-modify-write races visibly."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


@pytest.mark.parametrize("clock", ["real", "stalled"])
def test_next_version_unique_and_increasing_across_threads(fast_thread_switching, fake_clock, clock):
    if clock == "stalled":  # every version then comes from the counter: last + 1 under the lock
        now = next_version()
        fake_clock(itertools.repeat(now))
    nthreads, per_thread = 8, (20000 if clock == "stalled" else 2000)
    results: list[list[int]] = [[] for _ in range(nthreads)]
    barrier = threading.Barrier(nthreads)

    def work(i):
        barrier.wait()
        out = results[i]
        for _ in range(per_thread):
            out.append(next_version())

    threads = [threading.Thread(target=work, args=(i,)) for i in range(nthreads)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    flat = [v for r in results for v in r]
    assert len(flat) == nthreads * per_thread
    assert len(set(flat)) == len(flat), "two writes got the same version"
    for r in results:
        assert all(b > a for a, b in zip(r, r[1:]))
    assert next_version() > max(flat)
