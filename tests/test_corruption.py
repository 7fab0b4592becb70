"""Corruption, Hypothesis-driven: random bit flips, truncations, swaps and misplaced locations of
records, made in the segment file at the bytes of a record's payload, in its LMDB index entry
(header + location), or straight into ``data.mdb`` at the bytes of a header, while the store is
closed or open, for every codec.

Promise (``docs/operations.md``, "Corruption"): every damaged entry is detected on read (or at
open, for index entries), quarantined, counted and served as a miss; every undamaged entry is still
served byte-exact; the key can be stored again afterwards. ``tests/test_nvme_damage.py`` covers
the fixed cases (a flip at one position, truncations, a record under another digest, orphaned
space; a truncated data file: ``tests/test_nvme_open.py``); this file draws the damage at random.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ectier import TieredCache

from conftest import KiB, MiB, assert_same, check_quiescent, digest, make_config, open_lmdb, random_tensor
from ectier import testing
from ectier.tiers.nvme_record import parse_index_value

import nvme_helpers as nh

N_ENTRIES = 6
# payload kinds act on the segment file; header/location kinds on the LMDB index entry
KINDS = ["flip-payload", "flip-header", "truncate-payload", "truncate-header", "flip-location", "swap-payloads",
         "missing-payload", "foreign-payload", "reused-extent"]
FILE_KINDS = {"flip-header"}  # also done in place in data.mdb


def _values():
    out = {}
    for i in range(N_ENTRIES):
        if i % 2:
            out[f"e{i}"] = random_tensor((1 + 37 * i, 64), torch.float16, i)  # incompressible
        else:
            g = torch.Generator().manual_seed(i)
            out[f"e{i}"] = torch.randn((8 * (i + 1), 512), generator=g).to(torch.bfloat16)  # compressible
    return out


def _flip_in_file(store: Path, needle: bytes, pos: int, bit: int) -> int:
    """Flip bit ``bit`` of byte ``pos % len(needle)`` of every copy of ``needle`` in data.mdb
    (stale copies sit in free pages; the live one is among them). Returns how many copies."""
    path = store / "lmdb" / "data.mdb"
    blob = path.read_bytes()
    offsets = []
    at = blob.find(needle)
    while at >= 0:
        offsets.append(at)
        at = blob.find(needle, at + 1)
    fd = os.open(path, os.O_RDWR)
    try:
        for off in offsets:
            p = off + pos % len(needle)
            os.pwrite(fd, bytes([blob[p] ^ (1 << bit)]), p)
    finally:
        os.close(fd)
    return len(offsets)


def _damage(store: Path, put_value, values: dict[str, bytes], kind: str, k: str, other: str, pos: int,
            bit: int) -> set[str]:
    """Damage key ``k`` (``other``: a second key some kinds involve); returns the keys damaged.
    ``values``: key -> index value (as stored now); ``put_value(key, value)`` rewrites one."""
    v = values[k]
    hn = _header_len(v)
    if kind == "flip-payload":
        nh.flip_payload_byte(store, v, pos, 1 << bit)
        return {k}
    if kind == "truncate-payload":  # the segment file cut inside k's payload: later payloads go too
        spans = nh.payload_spans(v)
        total = sum(n for _, n in spans)
        p = pos % total
        for off, n in spans:
            if p < n:
                cut = off + p
                break
            p -= n
        os.truncate(nh.segment_path(store), cut)
        return {key for key, val in values.items() if any(o + n > cut for o, n in nh.payload_spans(val))}
    if kind == "swap-payloads":
        a, b = nh.read_payload(store, v), nh.read_payload(store, values[other])
        if a == b:
            return set()
        nh.write_payload(store, v, b)
        nh.write_payload(store, values[other], a)
        return {k, other}
    if kind in ("flip-header", "flip-location"):
        b = bytearray(v)
        at = pos % hn if kind == "flip-header" else hn + pos % (len(v) - hn)
        b[at] ^= 1 << bit
        put_value(k, bytes(b))
        return {k}
    if kind == "truncate-header":
        put_value(k, v[: pos % len(v)])
        return {k}
    if kind == "missing-payload":  # its blocks lie past the end of the segment file
        put_value(k, nh.with_location(v, [(1 << 24, 1)]))
        return {k}
    # "foreign-payload": k's entry names the blocks of another record's payload (k is newer: the
    # other's bytes stay good); "reused-extent": the other record names k's blocks
    a, b = (k, other) if kind == "foreign-payload" else (other, k)
    put_value(a, nh.with_location(values[a], parse_index_value(values[b])[1].extents))
    return {a}


def _header_len(v: bytes) -> int:
    from ectier.codec import header_nbytes

    return header_nbytes(v)


damage_st = st.lists(
    st.tuples(st.integers(0, N_ENTRIES - 1), st.sampled_from(KINDS), st.integers(0, 1 << 31), st.integers(0, 7)),
    min_size=1, max_size=4, unique_by=lambda d: d[0],  # one damage per key: two flips of one bit would undo
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(codec=st.sampled_from(["raw", "zstd", "zstd-planes"]), damage=damage_st,
       via=st.sampled_from(["lmdb", "file"]), when=st.sampled_from(["closed", "open"]))
def test_random_damage_is_detected_quarantined_and_a_miss(codec, damage, via, when):
    values = _values()
    keys = list(values)
    with tempfile.TemporaryDirectory(prefix="ectier-corrupt-") as tmp:
        store = Path(tmp) / "nvme"
        cfg = make_config(store, host_bytes=0, nvme_bytes=4 * MiB, codec=codec)
        cache = TieredCache(cfg)
        try:
            for k, t in values.items():
                cache.put(k, t)
            nv = testing.tier(cache, "nvme")
            env = testing.lmdb_of(nv).env
            stored = {k: nh.index_value(store, k, env=env) for k in keys}
            if when == "closed":
                cache.close()
                env, meta_db = open_lmdb(store)[:2]
            else:
                meta_db = testing.lmdb_of(nv).meta

            def put_value(key: str, value: bytes) -> None:
                with env.begin(write=True) as txn:
                    txn.put(digest(key), value, db=meta_db)

            damaged: set[str] = set()
            try:
                for idx, kind, pos, bit in damage:
                    k, other = keys[idx], keys[(idx + 1) % N_ENTRIES]
                    if k in damaged or (kind in ("swap-payloads", "foreign-payload", "reused-extent")
                                        and other in damaged):
                        continue  # one damage per record (a second could undo the first)
                    if via == "file" and kind in FILE_KINDS:
                        env.sync(True)  # the live page in the file, not only in memory
                        assert _flip_in_file(store, stored[k], pos, bit) >= 1, f"{k}: entry not found in data.mdb"
                        damaged.add(k)
                        continue
                    damaged |= _damage(store, put_value, stored, kind, k, other, pos, bit)
            finally:
                if when == "closed":
                    env.close()
            if when == "closed":
                cache = TieredCache(cfg)
            for k in keys:
                got = cache.get(k)
                if k in damaged:
                    assert got is None, f"damaged {k} ({damage}) was served"
                else:
                    assert_same(got, values[k])
            st_ = cache.stats()["tiers"]["nvme"]
            quarantined = cache.quarantined()
            assert {digest(k) for k in damaged} == set(quarantined), (damage, via, when)
            assert st_["quarantined"] == len(damaged)
            assert st_["checksum_failures"] <= len(damaged)
            assert len(cache) == N_ENTRIES - len(damaged) == st_["entries"]
            for q in quarantined.values():
                assert q["reason"]
            check_quiescent(cache)
            for k in damaged:  # a quarantined key can be stored again
                cache.put(k, values[k])
                assert_same(cache.get(k), values[k])
        finally:
            cache.close()


def test_flip_in_every_byte_of_one_header_is_caught():
    """Exhaustive over one header: each of its bytes flipped in turn (through LMDB, store open)."""
    with tempfile.TemporaryDirectory(prefix="ectier-corrupt-") as tmp:
        with TieredCache(make_config(Path(tmp) / "nvme", host_bytes=0, nvme_bytes=1 * MiB)) as cache:
            t = random_tensor((3, 5), torch.float32, 1)
            nv = testing.tier(cache, "nvme")
            cache.put("k", t)
            with testing.lmdb_of(nv).env.begin() as txn:
                header = bytes(txn.get(digest("k"), db=testing.lmdb_of(nv).meta))
            for pos in range(len(header)):
                b = bytearray(header)
                b[pos] ^= 0x01
                cache.put("k", t)  # a fresh good record (new version) ...
                with testing.lmdb_of(nv).env.begin() as txn:
                    current = bytearray(txn.get(digest("k"), db=testing.lmdb_of(nv).meta))
                current[pos] ^= 0x01  # ... whose byte pos is flipped
                with testing.lmdb_of(nv).env.begin(write=True) as txn:
                    txn.put(digest("k"), bytes(current), db=testing.lmdb_of(nv).meta)
                assert cache.get("k") is None, f"header byte {pos} flipped and still served"
            st_ = cache.stats()["tiers"]["nvme"]
            assert st_["checksum_failures"] == len(header) and st_["entries"] == 0
