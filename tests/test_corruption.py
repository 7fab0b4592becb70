"""Corruption, Hypothesis-driven: random bit flips, truncations, extensions and swaps of records,
made through LMDB (value rewrites) or straight into ``data.mdb`` at the bytes of a record's
payload or header, while the store is closed or open, for every codec.

Promise (``docs/operations.md``, "Corruption"): every damaged entry is detected on read (or at
open, for headers), quarantined, counted and served as a miss; every undamaged entry is still
served byte-exact; the key can be stored again afterwards. ``tests/test_nvme.py`` covers the fixed
cases (a flip at one position, truncations, a record under another digest, orphans, a truncated
data file); this file draws the damage at random.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ectier import TieredCache

from conftest import KiB, MiB, assert_same, check_quiescent, digest, make_config, random_tensor
from ectier import testing

N_ENTRIES = 6
KINDS = ["flip-payload", "flip-header", "truncate-payload", "truncate-header", "extend-payload", "swap-payloads",
         "empty-payload"]
FILE_KINDS = {"flip-payload", "flip-header"}  # what can be done in place in data.mdb


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


def _damage_lmdb(txn, meta_db, data_db, kind, d, other, pos, bit):
    db = meta_db if kind.endswith("header") else data_db
    v = bytes(txn.get(d, db=db))
    if kind.startswith("flip"):
        b = bytearray(v)
        b[pos % len(b)] ^= 1 << bit
        txn.put(d, bytes(b), db=db)
    elif kind.startswith("truncate"):
        txn.put(d, v[: pos % len(v)], db=db)
    elif kind == "extend-payload":
        txn.put(d, v + bytes([bit]) * (1 + pos % 64), db=db)
    elif kind == "empty-payload":
        txn.put(d, b"", db=db)
    elif kind == "swap-payloads":
        w = bytes(txn.get(other, db=data_db))
        txn.put(d, w, db=data_db)
        txn.put(other, v, db=data_db)


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
            with testing.lmdb_of(nv).env.begin() as txn:
                stored = {k: (bytes(txn.get(digest(k), db=testing.lmdb_of(nv).meta)), bytes(txn.get(digest(k), db=testing.lmdb_of(nv).data)))
                          for k in keys}
            damaged: set[str] = set()
            if when == "closed":
                cache.close()
            for idx, kind, pos, bit in damage:
                k = keys[idx]
                if via == "file" and kind in FILE_KINDS:
                    header, payload = stored[k]
                    needle = header if kind == "flip-header" else payload
                    if not needle:
                        continue  # an empty payload has no bytes to flip
                    if when == "open":
                        testing.lmdb_of(nv).env.sync(True)  # make sure the live page is in the file, not only in memory
                    assert _flip_in_file(store, needle, pos, bit) >= 1, f"{k}: record bytes not found in data.mdb"
                    damaged.add(k)
                    stored[k] = (None, None)  # damaged again below: only through LMDB
                    continue
                if kind == "swap-payloads":
                    other = keys[(idx + 1) % N_ENTRIES]
                    if stored[k][1] == stored[other][1]:
                        continue
                    damaged.update({k, other})
                else:
                    damaged.add(k)
                    other = None
                if when == "closed":
                    from conftest import open_lmdb

                    env, meta_db, data_db, _, _ = open_lmdb(store)
                    try:
                        with env.begin(write=True) as txn:
                            if txn.get(digest(k), db=meta_db) is not None and (
                                    other is None or txn.get(digest(other), db=data_db) is not None):
                                _damage_lmdb(txn, meta_db, data_db, kind, digest(k), other and digest(other), pos, bit)
                    finally:
                        env.close()
                else:
                    with testing.lmdb_of(nv).env.begin(write=True) as txn:
                        if txn.get(digest(k), db=testing.lmdb_of(nv).meta) is not None and (
                                other is None or txn.get(digest(other), db=testing.lmdb_of(nv).data) is not None):
                            _damage_lmdb(txn, testing.lmdb_of(nv).meta, testing.lmdb_of(nv).data, kind, digest(k), other and digest(other), pos, bit)
            if when == "closed":
                cache = TieredCache(cfg)
            # a truncation to the full length or an "extension" by nothing cannot happen (>= 1 byte)
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
