"""NVMe tier damage, through TieredCache: checked reads quarantine a damaged record (found while open
or at open) and serve a miss, a record under another digest is never served, orphaned payload
space is reclaimed at open.

Fault injection edits the closed store (``tests/nvme_helpers.py``: the segment file at one
record's payload, or its LMDB index entry) or, for damage while the store is open, writes through
the tier's own environment."""

from __future__ import annotations

import dataclasses
import os

import pytest

from conftest import KiB, MiB, assert_same, check_quiescent, digest
from ectier import testing
from ectier.tiers.nvme_segment import BLOCK_BYTES

import nvme_helpers as nh
from nvme_helpers import normal_bf16, put_three, reopen


@pytest.mark.parametrize("codec", ["raw", "zstd-planes"])
@pytest.mark.parametrize("host_bytes", [0, 1 * MiB], ids=["nvme-only", "with-host"])
def test_bit_flip_in_payload_is_a_miss_and_quarantined(make_cache, tmp_path, codec, host_bytes):
    cfg, vals = put_three(make_cache, codec=codec)
    nh.flip_payload_byte(tmp_path / "nvme", nh.index_value(tmp_path / "nvme", "a"))
    cfg = cfg.replace(host=dataclasses.replace(cfg.host, capacity_bytes=host_bytes))
    cache = reopen(cfg)
    try:
        assert len(cache) == 3  # the open-time scan does not read payloads
        assert cache.get("a") is None
        st = cache.stats()["tiers"]["nvme"]
        assert st["checksum_failures"] == 1
        assert st["quarantined"] == 1
        q = testing.tier(cache, "nvme").quarantined()
        assert set(q) == {digest("a")}
        assert "checksum" in q[digest("a")]["reason"]
        assert not cache.contains("a") and len(cache) == 2
        assert cache.get("a") is None
        assert cache.stats()["tiers"]["nvme"]["checksum_failures"] == 1  # not read again
        for k in "bc":
            assert_same(cache.get(k), vals[k])
        check_quiescent(cache)
    finally:
        cache.close()
    cache = reopen(cfg)  # the quarantine persists; the record stays out of service
    try:
        assert len(cache) == 2 and cache.get("a") is None
        assert set(testing.tier(cache, "nvme").quarantined()) == {digest("a")}
        assert cache.stats()["tiers"]["nvme"]["checksum_failures"] == 0
    finally:
        cache.close()


@pytest.mark.parametrize("damage", ["flip", "truncate", "drop-meta-tail"])
def test_damage_while_open_is_a_miss(make_cache, damage):
    """Bit rot after the store was opened: caught by the per-read checks (the segment file
    truncated under the last record's payload: a short read)."""
    cache, _ = make_cache(host_bytes=0, codec="zstd")
    vals = {k: normal_bf16((4, 4096), i) for i, k in enumerate("abc")}
    for k, t in vals.items():
        cache.put(k, t)
    env, nv = testing.lmdb_of(cache).env, testing.tier(cache, "nvme")
    store = nv.path
    bad = "c" if damage == "truncate" else "b"
    value = nh.index_value(store, bad, env=env)
    if damage == "flip":
        nh.flip_payload_byte(store, value, pos=-3)
    elif damage == "truncate":
        off, n = nh.payload_spans(value)[-1]
        os.truncate(nh.segment_path(store), off + n // 2)
    else:
        with env.begin(write=True) as txn:
            txn.put(digest("b"), value[:-5], db=testing.lmdb_of(nv).meta)
    assert cache.get(bad) is None
    st = cache.stats()["tiers"]["nvme"]
    assert st["checksum_failures"] == 1 and st["quarantined"] == 1
    assert digest(bad) in nv.quarantined()
    for k in set("abc") - {bad}:
        assert_same(cache.get(k), vals[k])
    check_quiescent(cache)


@pytest.mark.parametrize("damage", ["truncate-payload", "truncate-header", "flip-header", "missing-payload",
                                    "flip-location"])
def test_damage_found_at_open_is_quarantined(make_cache, tmp_path, damage):
    cfg, vals = put_three(make_cache)
    store = tmp_path / "nvme"
    bad = "c" if damage in ("truncate-payload", "missing-payload") else "a"
    value = nh.index_value(store, bad)
    if damage == "truncate-payload":  # the segment file cut inside the last payload
        off, n = nh.payload_spans(value)[-1]
        os.truncate(nh.segment_path(store), off + n // 2)
    elif damage == "missing-payload":  # cut before it: its blocks are past the end of the file
        os.truncate(nh.segment_path(store), nh.payload_spans(value)[0][0])
    elif damage == "truncate-header":
        nh.set_index_value(store, bad, value[:40])
    elif damage == "flip-header":
        v = bytearray(value)
        v[30] ^= 0x10
        nh.set_index_value(store, bad, bytes(v))
    else:
        v = bytearray(value)
        v[-12] ^= 0x01  # inside the location's extent list
        nh.set_index_value(store, bad, bytes(v))
    cache = reopen(cfg)
    try:
        if damage == "truncate-payload":
            # payloads are not read at open (that would read the whole store): a damaged one is
            # found, quarantined and served as a miss at its first read
            assert cache.stats()["tiers"]["nvme"]["quarantined"] == 0
            assert cache.get(bad) is None
            assert cache.stats()["tiers"]["nvme"]["checksum_failures"] == 1
        st = cache.stats()["tiers"]["nvme"]
        assert st["quarantined"] == 1 and st["entries"] == 2
        assert set(testing.tier(cache, "nvme").quarantined()) == {digest(bad)}
        assert not cache.contains(bad) and cache.get(bad) is None
        for k in set("abc") - {bad}:
            assert_same(cache.get(k), vals[k])
        check_quiescent(cache)
    finally:
        cache.close()


def test_record_under_another_digest_is_never_served(make_cache, tmp_path):
    """A header whose (namespace, key) does not hash to its LMDB key (a copied or misplaced record)
    is quarantined; it is never served as the other key's bytes."""
    cfg, vals = put_three(make_cache)

    nh.set_index_value(tmp_path / "nvme", "evil", nh.index_value(tmp_path / "nvme", "a"))
    cache = reopen(cfg)
    try:
        assert cache.get("evil") is None
        assert set(testing.tier(cache, "nvme").quarantined()) == {digest("evil")}
        for k in "abc":
            assert_same(cache.get(k), vals[k])
    finally:
        cache.close()


def test_orphaned_payload_space_is_reclaimed_at_open(make_cache, tmp_path):
    """Payload blocks no index entry names (a crash between the payload write and the index commit;
    here: an index entry removed by hand, and bytes written past the last record) are free after a
    reopen: the next puts reuse them and the segment file does not grow."""
    cfg, vals = put_three(make_cache)
    store = tmp_path / "nvme"
    c_spans = nh.payload_spans(nh.index_value(store, "c"))
    nh.set_index_value(store, "c", None)  # "c"'s payload is now an orphan
    with open(nh.segment_path(store), "r+b") as f:
        f.seek(0, os.SEEK_END)
        f.write(b"\x01" * (300 * KiB))  # an orphan past the end
    cache = reopen(cfg)
    try:
        st = cache.stats()["tiers"]["nvme"]
        assert st["entries"] == 2 and st["quarantined"] == 0
        env = testing.lmdb_of(cache).env
        assert st["segment_used_bytes"] == sum(-(-n // BLOCK_BYTES) * BLOCK_BYTES for k in "ab"
                                               for _, n in nh.payload_spans(nh.index_value(store, k, env=env)))
        assert st["segment_bytes"] <= c_spans[-1][0] + c_spans[-1][1]  # the orphan past the end is cut off
        assert cache.get("c") is None and not cache.contains("c")
        for k in "ab":
            assert_same(cache.get(k), vals[k])
        cache.put("d", vals["c"])  # takes the orphaned blocks of "c"
        assert nh.payload_spans(nh.index_value(store, "d", env=testing.lmdb_of(cache).env)) == c_spans
        assert cache.stats()["tiers"]["nvme"]["segment_bytes"] == c_spans[-1][0] + c_spans[-1][1]
        check_quiescent(cache)
    finally:
        cache.close()


@pytest.mark.parametrize("when", ["at-open", "while-open"])
def test_a_header_claiming_more_raw_bytes_than_the_budget_is_a_miss_not_an_allocation(make_cache, tmp_path, when):
    """A compressed record whose header (checksum intact: forged, or a decompression bomb) claims
    16 PiB of raw bytes: a miss, quarantined — no write stores a record larger than
    ``nvme.capacity_bytes`` — never a ``RuntimeError`` from allocating them (it was)."""
    from ectier.tiers.nvme_record import pack_index_value, parse_index_value

    cfg, vals = put_three(make_cache, codec="zstd")
    store = tmp_path / "nvme"
    header, loc = parse_index_value(nh.index_value(store, "b"))
    huge = dataclasses.replace(header, shape=(1 << 40, 8192), raw_nbytes=(1 << 40) * 8192 * 2)
    cache = reopen(cfg)
    try:
        if when == "at-open":
            cache.close()
            nh.set_index_value(store, "b", pack_index_value(huge, loc))
            cache = reopen(cfg)
        else:
            env = testing.lmdb_of(cache).env
            with env.begin(write=True) as txn:
                txn.put(digest("b"), pack_index_value(huge, loc), db=testing.lmdb_of(cache).meta)
        assert cache.get("b") is None
        st = cache.stats()["tiers"]["nvme"]
        assert st["checksum_failures"] == 1 and st["quarantined"] == 1
        assert "nvme.capacity_bytes" in testing.tier(cache, "nvme").quarantined()[digest("b")]["reason"]
        for k in "ac":
            assert_same(cache.get(k), vals[k])
    finally:
        cache.close()


def test_a_header_with_a_write_version_past_2_63_is_quarantined_at_open_and_puts_go_on(make_cache, tmp_path):
    """A header (its checksum intact) whose write version is 2**64 - 1: quarantined at open, and
    the process's version clock is not pushed to it — before, every later put, of any key and any
    store of the process, raised ``ValueError`` (version 2**64 does not fit the record's u64)."""
    from ectier.tiers.nvme_record import pack_index_value, parse_index_value

    cfg, vals = put_three(make_cache)
    store = tmp_path / "nvme"
    header, loc = parse_index_value(nh.index_value(store, "b"))
    nh.set_index_value(store, "b", pack_index_value(dataclasses.replace(header, version=(1 << 64) - 1), loc))
    with reopen(cfg) as cache:
        assert set(testing.tier(cache, "nvme").quarantined()) == {digest("b")}
        assert cache.get("b") is None
        cache.put("b", vals["a"])
        cache.put("d", vals["c"])
        assert_same(cache.get("b"), vals["a"])
        assert_same(cache.get("d"), vals["c"])
        check_quiescent(cache)
