"""NVMe tier contract, through TieredCache: restart, flush/write-through, checked reads with
quarantine, orphans, codecs, map growth and ceiling, directory locking and open errors.

Fault injection opens the closed store's LMDB environment directly (``conftest.open_lmdb``) or, for
damage while the store is open, writes through the tier's own environment.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from ectier import StoreLockedError, StoreOpenError, TieredCache, TierWriteError
from ectier.codec import registered_codecs

from conftest import (
    KiB,
    MiB,
    assert_same,
    check_budgets,
    check_quiescent,
    digest,
    filled,
    host_holds,
    make_config,
    nvme_holds,
    open_lmdb,
    random_tensor,
)
from ectier import testing
from ectier.tiers.nvme_segment import BLOCK_BYTES

import nvme_helpers as nh

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def normal_bf16(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(torch.bfloat16)


def reopen(cfg, **nvme_changes):
    if nvme_changes:
        cfg = cfg.replace(nvme=dataclasses.replace(cfg.nvme, **nvme_changes))
    return TieredCache(cfg)


def run_child(code: str, *args: str, **kw) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], env=env, cwd=REPO,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **kw)


# ============================================================================ restart


@pytest.mark.parametrize("sync", [True, False])
def test_restart_serves_everything_committed(make_cache, sync):
    cache, cfg = make_cache(host_bytes=0, nvme_bytes=2 * MiB, sync=sync)
    vals = {f"k{i}": random_tensor((i + 1, 1000), torch.float16, i) for i in range(8)}
    for k, t in vals.items():
        cache.put(k, t)
    cache.delete("k3")
    del vals["k3"]
    used = cache.stats()["tiers"]["nvme"]["used_bytes"]
    cache.close()
    again = reopen(cfg)
    try:
        st = again.stats()["tiers"]["nvme"]
        assert st["entries"] == len(vals) == len(again)
        assert st["used_bytes"] == used
        assert again.get("k3") is None
        for k, t in vals.items():
            assert_same(again.get(k), t)
        check_quiescent(again)
    finally:
        again.close()


@pytest.mark.parametrize("flush_on_close", [True, False])
def test_flush_on_close(make_cache, flush_on_close):
    cache, cfg = make_cache(host_bytes=256 * KiB, nvme_bytes=2 * MiB, flush_on_close=flush_on_close)
    a, b, big = filled(64 * KiB, 1), filled(64 * KiB, 2), filled(320 * KiB, 3)
    cache.put("a", a)
    cache.put("b", b)
    cache.put("big", big)  # too large for host: NVMe at once
    assert host_holds(cache, "a") and not nvme_holds(cache, "a")
    cache.close()
    again = reopen(cfg)
    try:
        assert_same(again.get("big"), big)
        if flush_on_close:
            assert len(again) == 3
            assert_same(again.get("a"), a)
            assert_same(again.get("b"), b)
        else:
            assert len(again) == 1
            assert again.get("a") is None and again.get("b") is None
    finally:
        again.close()


def test_explicit_flush_writes_host_only_entries_once(make_cache):
    cache, _ = make_cache(host_bytes=1 * MiB)
    for i in range(3):
        cache.put(f"k{i}", filled(64 * KiB, i))
    assert cache.flush() == 3
    assert all(nvme_holds(cache, f"k{i}") and host_holds(cache, f"k{i}") for i in range(3))
    assert cache.flush() == 0
    cache.put("k1", filled(64 * KiB, 11))  # overwrite: the NVMe copy is stale and goes
    assert not nvme_holds(cache, "k1")
    assert cache.flush() == 1
    assert cache.stats()["tiers"]["nvme"]["puts"] == 4


def test_write_through_in_process(make_cache):
    cache, _ = make_cache(host_bytes=2 * 64 * KiB, write_through=True)
    for i in range(3):
        cache.put(f"k{i}", filled(64 * KiB, i))
        assert nvme_holds(cache, f"k{i}")
    st = cache.stats()["tiers"]
    # k0 was evicted from host for k2, but NVMe already held it: no second write
    assert st["nvme"]["puts"] == 3
    assert st["host"]["evictions"] == 1 and st["host"]["demotions"] == 1
    for i in range(3):
        assert_same(cache.get(f"k{i}"), filled(64 * KiB, i))


def test_write_through_overwrite_keeps_the_old_record_until_the_new_one_replaces_it(make_cache, monkeypatch):
    """With write_through the older NVMe record of an overwritten key is the last durable value: it
    stays until the new record replaces it in one LMDB transaction (a crash in between leaves the
    old value, never a miss), and is never served meanwhile."""
    from ectier.tiers.nvme import NvmeTier

    cache, _ = make_cache(host_bytes=4 * 64 * KiB, write_through=True)
    old, new = filled(64 * KiB, 1), random_tensor((5, 7), torch.float16, 3)
    cache.put("k", old)
    v_old = testing.tier(cache, "nvme").record(digest("k")).version
    seen = []
    original = NvmeTier.write

    def write(self, d, record):
        if d == digest("k"):
            rec = self.record(d)
            seen.append((rec.version if rec is not None else None, record.header.version))
            assert testing.versions(cache)[d] == record.header.version != rec.version
            assert_same(cache.get("k"), new)  # the old record is not served meanwhile
        return original(self, d, record)

    monkeypatch.setattr(NvmeTier, "write", write)
    cache.put("k", new)
    assert len(seen) == 1 and seen[0][0] == v_old and seen[0][1] > v_old  # old record still there
    assert testing.tier(cache, "nvme").record(digest("k")).version == seen[0][1]
    assert testing.tier(cache, "nvme").record(digest("k")).header.dtype == "float16"
    assert_same(cache.get("k"), new)
    st = cache.stats()["tiers"]["nvme"]
    assert st["puts"] == 2 and st["entries"] == 1 and st["write_failures"] == 0
    assert testing.tier(cache, "nvme").index.quiet()
    check_quiescent(cache)


@pytest.mark.parametrize("failure", ["write-error", "too-large-for-nvme", "exception", "slot-evicted"])
def test_failed_write_through_of_an_overwrite_leaves_no_old_record(make_cache, monkeypatch, failure):
    """Every path where the write-through of an overwrite does not land deletes the older NVMe
    record before put returns: in-process the key is its new value (host) or a miss, after a
    restart a miss — never the old value."""
    from ectier.tiers.nvme import NvmeTier

    nvme_bytes = 256 * KiB if failure == "too-large-for-nvme" else 1 * MiB
    cache, cfg = make_cache(host_bytes=1 * MiB, nvme_bytes=nvme_bytes, write_through=True, flush_on_close=False)
    old = filled(16 * KiB, 1)
    new = filled(320 * KiB, 2) if failure == "too-large-for-nvme" else random_tensor((5, 7), torch.float16, 3)
    cache.put("k", old)
    cache.put("other", filled(16 * KiB, 4))
    assert nvme_holds(cache, "k")
    if failure == "write-error":
        def fail(self, d, record):
            raise TierWriteError("nvme tier: injected write failure")
        monkeypatch.setattr(NvmeTier, "write", fail)
    elif failure == "exception":
        def boom(self, d, record):
            raise RuntimeError("injected")
        monkeypatch.setattr(NvmeTier, "write", boom)
    elif failure == "slot-evicted":
        from ectier.moves.nvme import NvmeMoves

        original = NvmeMoves.write_through

        def evicted_first(self, host, d, version):  # the slot is gone (evicted, its demotion failed)
            testing.drop_copy(cache, "host", "k")
            return original(self, host, d, version)
        monkeypatch.setattr(NvmeMoves, "write_through", evicted_first)
    if failure == "exception":
        with pytest.raises(RuntimeError):
            cache.put("k", new)
    else:
        cache.put("k", new)
    monkeypatch.undo()
    assert not nvme_holds(cache, "k")  # the old record went before put returned
    got = cache.get("k")
    assert got is None or torch.equal(got.view(torch.uint8).flatten(), new.view(torch.uint8).flatten())
    if failure != "slot-evicted":
        assert_same(got, new)  # served from host memory (not durable)
    st = cache.stats()["tiers"]["nvme"]
    assert st["write_failures"] == (1 if failure == "write-error" else 0)
    assert st["entries"] == 1 and testing.tier(cache, "nvme").index.quiet()
    check_quiescent(cache)
    cache.close()
    with TieredCache(cfg) as reopened:  # no flush on close: a restart must not find the old value
        assert reopened.get("k") is None
        assert_same(reopened.get("other"), filled(16 * KiB, 4))
        check_quiescent(reopened)


CHILD_PUT_AND_DIE = """
import os, sys, torch
from ectier import CacheConfig, HostTierConfig, NvmeTierConfig, TieredCache
def cfg(path, write_through):
    return CacheConfig(namespace="test",
        host=HostTierConfig(capacity_bytes=1 << 20, block_bytes=65536, pin_memory=False),
        nvme=NvmeTierConfig(path=path, capacity_bytes=1 << 20, sync=False, write_through=write_through,
                            map_initial_bytes=4 << 20))
wt = TieredCache(cfg(sys.argv[1], True))
wb = TieredCache(cfg(sys.argv[2], False))
for i in range(4):
    t = ((torch.arange(65536, dtype=torch.int64) + i * 7) % 251).to(torch.uint8)
    wt.put(f"k{i}", t)
    wb.put(f"k{i}", t)
print("done", flush=True)
os._exit(0)  # no close, no flush: as if the process were killed
"""


def test_write_through_survives_a_process_that_never_closes(tmp_path):
    wt_dir, wb_dir = tmp_path / "wt", tmp_path / "wb"
    child = run_child(CHILD_PUT_AND_DIE, str(wt_dir), str(wb_dir))
    out, err = child.communicate(timeout=120)
    assert child.returncode == 0, err
    assert "done" in out
    with TieredCache(make_config(wt_dir, write_through=True)) as wt:
        assert len(wt) == 4
        for i in range(4):
            assert_same(wt.get(f"k{i}"), filled(64 * KiB, i))
    with TieredCache(make_config(wb_dir)) as wb:  # write-back without close: host contents lost
        assert len(wb) == 0


# ============================================================================ corruption


def _put_three(make_cache, **kw):
    cache, cfg = make_cache(host_bytes=0, nvme_bytes=2 * MiB, **kw)
    vals = {k: random_tensor((4, 8192), torch.bfloat16, i) for i, k in enumerate("abc")}
    for k, t in vals.items():
        cache.put(k, t)
    cache.close()
    return cfg, vals


def _edit(store_dir, fn):
    env, meta, data, quarantine, settings = open_lmdb(store_dir)
    try:
        with env.begin(write=True) as txn:
            fn(txn, meta, data)
    finally:
        env.close()


def _flip(db, key, pos=None, bit=0x10):
    def fn(txn, meta, data):
        d = meta if db == "meta" else data
        v = bytearray(txn.get(key, db=d))
        p = len(v) // 2 if pos is None else pos
        v[p] ^= bit
        txn.put(key, bytes(v), db=d)
    return fn


@pytest.mark.parametrize("codec", ["raw", "zstd-planes"])
@pytest.mark.parametrize("host_bytes", [0, 1 * MiB], ids=["nvme-only", "with-host"])
def test_bit_flip_in_payload_is_a_miss_and_quarantined(make_cache, tmp_path, codec, host_bytes):
    cfg, vals = _put_three(make_cache, codec=codec)
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
    cfg, vals = _put_three(make_cache)
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
    cfg, vals = _put_three(make_cache)

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
    cfg, vals = _put_three(make_cache)
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


# ============================================================================ codecs


@pytest.mark.parametrize("codec", ["raw", "zstd", "zstd-planes"])
def test_codecs_round_trip_with_restart(make_cache, codec):
    cache, cfg = make_cache(host_bytes=0, nvme_bytes=4 * MiB, codec=codec)
    vals = {
        "normal": normal_bf16((16, 8192), 1),  # 256 KiB, compressible after the plane split
        "random": random_tensor((8, 8192), torch.bfloat16, 2),
        "int64": torch.arange(5000, dtype=torch.int64) * 3,
        "bool": random_tensor((33, 7), torch.bool, 3),
        "f32": random_tensor((3, 5, 7), torch.float32, 4),
        "scalar": torch.tensor(2.5, dtype=torch.float16),
        "empty": torch.empty(0, 8192, dtype=torch.bfloat16),
    }
    for t in (random_tensor((77,), dt, 5) for dt in (torch.float8_e4m3fn,) if hasattr(torch, "float8_e4m3fn")):
        vals["fp8"] = t
    for k, t in vals.items():
        cache.put(k, t)
    cid = registered_codecs()[codec]
    for k in vals:
        assert testing.tier(cache, "nvme").record(digest(k)).header.codec_id == cid
    for k, t in vals.items():
        assert_same(cache.get(k), t)
    if codec == "zstd-planes":
        hdr = testing.tier(cache, "nvme").record(digest("normal")).header
        assert hdr.payload_nbytes < 0.8 * hdr.raw_nbytes
    if codec == "raw":
        hdr = testing.tier(cache, "nvme").record(digest("normal")).header
        assert hdr.payload_nbytes == hdr.raw_nbytes
    cache.close()
    again = reopen(cfg)
    try:
        for k, t in vals.items():
            assert_same(again.get(k), t)
    finally:
        again.close()


def test_mixed_codecs_in_one_store(make_cache):
    cache, cfg = make_cache(host_bytes=0, nvme_bytes=4 * MiB, codec="zstd")
    z = normal_bf16((8, 8192), 1)
    cache.put("z", z)
    cache.close()
    raw = reopen(cfg, codec="raw")  # reads records written with zstd
    try:
        assert_same(raw.get("z"), z)
        r = normal_bf16((8, 8192), 2)
        raw.put("r", r)
        assert testing.tier(raw, "nvme").record(digest("r")).header.codec_id == registered_codecs()["raw"]
    finally:
        raw.close()
    planes = reopen(cfg, codec="zstd-planes")
    try:
        assert_same(planes.get("z"), z)
        assert_same(planes.get("r"), r)
        p = normal_bf16((8, 8192), 3)
        planes.put("p", p)
        ids = {k: testing.tier(planes, "nvme").record(digest(k)).header.codec_id for k in "zrp"}
        assert ids == {"z": registered_codecs()["zstd"], "r": registered_codecs()["raw"],
                       "p": registered_codecs()["zstd-planes"]}
        assert_same(planes.get("p"), p)
    finally:
        planes.close()


def test_promotion_from_compressed_record(make_cache):
    cache, _ = make_cache(host_bytes=2 * 64 * KiB, codec="zstd-planes")
    vals = {f"k{i}": normal_bf16((4, 8192), i) for i in range(4)}
    for k, t in vals.items():
        cache.put(k, t)
    # the write-behind may still be writing k0 (pinned in the host meanwhile, so the evictions took
    # the others): k0 is on NVMe once it is done
    assert testing.write_behind_idle(cache)
    assert nvme_holds(cache, "k0")
    for k, t in vals.items():
        assert_same(cache.get(k), t)
    assert cache.stats()["tiers"]["host"]["promotions"] >= 2


# ============================================================================ map size


def test_map_grows_from_a_tiny_initial_map(make_cache):
    cache, cfg = make_cache(host_bytes=0, nvme_bytes=8 * MiB, map_initial_bytes=1 * MiB)
    # layout v2: the map holds index entries only; 60 KiB keys make 12 of them ~720 KiB of headers
    vals = {f"k{i}".ljust(60 * KiB, "x"): filled(4 * KiB, i) for i in range(24)}  # 1.4 MiB in a 1 MiB map
    for k, t in vals.items():
        cache.put(k, t)
    st = cache.stats()["tiers"]["nvme"]
    assert st["map_growths"] > 0
    assert st["map_size_bytes"] > 1 * MiB
    assert st["entries"] == 24 and st["write_failures"] == 0
    for k, t in vals.items():
        assert_same(cache.get(k), t)
    cache.close()
    again = reopen(cfg)
    try:
        for k, t in vals.items():
            assert_same(again.get(k), t)
    finally:
        again.close()


def test_map_ceiling_fails_that_put_only(make_cache):
    cache, _ = make_cache(host_bytes=0, nvme_bytes=8 * MiB, map_initial_bytes=1 * MiB, map_max_bytes=2 * MiB)
    stored = {}
    key = lambda i: f"k{i}".ljust(60 * KiB, "x")  # noqa: E731 - the index entry is ~60 KiB
    with pytest.raises(TierWriteError, match="map"):
        for i in range(64):  # 3.8 MiB of index entries into a map capped at 2 MiB
            t = filled(4 * KiB, i)
            cache.put(key(i), t)
            stored[key(i)] = t
    failed = key(len(stored))
    assert 8 <= len(stored) < 40
    assert not cache.contains(failed) and cache.get(failed) is None
    assert len(cache) == len(stored)
    st = cache.stats()["tiers"]["nvme"]
    assert st["write_failures"] == 1 and st["write_errors"] >= 1
    assert st["map_size_bytes"] <= 2 * MiB
    for k, t in stored.items():
        assert_same(cache.get(k), t)
    # the store keeps working: free a record, then a smaller write fits
    assert cache.delete(key(0))
    cache.put("small", filled(64 * KiB, 99))
    assert_same(cache.get("small"), filled(64 * KiB, 99))
    check_quiescent(cache)


def test_map_ceiling_during_demotion_drops_the_victim_not_the_put(make_cache):
    cache, _ = make_cache(host_bytes=2 * 128 * KiB, nvme_bytes=8 * MiB, map_initial_bytes=1 * MiB,
                          map_max_bytes=1 * MiB)
    key = lambda i: f"k{i}".ljust(60 * KiB, "x")  # noqa: E731 - the index entry is ~60 KiB
    for i in range(40):
        cache.put(key(i), filled(64 * KiB, i))  # never raises: a failed demotion drops the victim
        check_budgets(cache)
    st = cache.stats()["tiers"]
    assert st["nvme"]["write_failures"] >= 1
    assert st["host"]["drops"] >= 1
    assert cache.contains(key(38)) and cache.contains(key(39))
    for i in range(40):
        got = cache.get(key(i))
        if got is not None:
            assert_same(got, filled(64 * KiB, i))
    check_quiescent(cache)


# ============================================================================ opening


def test_second_cache_on_same_directory_in_process_is_locked(make_cache, tmp_path):
    cache, cfg = make_cache()
    cache.put("k", torch.ones(3))
    with pytest.raises(StoreLockedError, match="nvme.path: .* in use by another TieredCache in this process"):
        TieredCache(cfg)
    assert_same(cache.get("k"), torch.ones(3))  # the failed open did not disturb the owner
    cache.put("k2", torch.zeros(2))
    cache.close()
    with TieredCache(cfg) as again:
        assert_same(again.get("k"), torch.ones(3))
        assert_same(again.get("k2"), torch.zeros(2))


CHILD_HOLD = """
import sys
from ectier import CacheConfig, HostTierConfig, NvmeTierConfig, TieredCache
cache = TieredCache(CacheConfig(namespace="test", host=HostTierConfig(capacity_bytes=0),
                                nvme=NvmeTierConfig(path=sys.argv[1], capacity_bytes=1 << 20, sync=False)))
print("ready", flush=True)
sys.stdin.read()
cache.close()
"""


def test_directory_held_by_another_process_is_locked(tmp_path):
    path = tmp_path / "held"
    child = run_child(CHILD_HOLD, str(path))
    try:
        line = child.stdout.readline()
        assert line.strip() == "ready", child.stderr.read()
        with pytest.raises(StoreLockedError, match="nvme.path: .* in use by another process;"):
            TieredCache(make_config(path))
    finally:
        child.stdin.close()
        child.wait(timeout=60)
    assert child.returncode == 0
    with TieredCache(make_config(path)) as cache:  # released when the owner closed
        cache.put("k", torch.ones(1))


def test_path_is_a_regular_file(tmp_path):
    f = tmp_path / "file"
    f.write_bytes(b"x")
    with pytest.raises(StoreOpenError, match="nvme.path"):
        TieredCache(make_config(f))
    with pytest.raises(StoreOpenError, match="nvme.path"):
        TieredCache(make_config(f / "sub"))
    assert f.read_bytes() == b"x"


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root ignores permissions")
def test_unwritable_directory(tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o500)
    try:
        with pytest.raises(StoreOpenError, match="nvme.path"):
            TieredCache(make_config(d))
        with pytest.raises(StoreOpenError, match="nvme.path"):
            TieredCache(make_config(d / "sub"))
    finally:
        d.chmod(0o700)


def test_uncreatable_directory():
    with pytest.raises(StoreOpenError, match="nvme.path"):
        TieredCache(make_config("/proc/ectier-cannot-exist/store"))


def _set_format(store_dir, value: bytes) -> None:
    env, meta, data, quarantine, settings = open_lmdb(store_dir)
    try:
        with env.begin(write=True) as txn:
            txn.put(b"format", value, db=settings)
    finally:
        env.close()


def test_store_of_another_format_is_refused_and_released(make_cache, tmp_path):
    cfg, vals = _put_three(make_cache)
    _set_format(tmp_path / "nvme", b"99")
    with pytest.raises(StoreOpenError, match="format"):
        TieredCache(cfg)
    _set_format(tmp_path / "nvme", b"2")
    with TieredCache(cfg) as again:  # the failed open released the directory lock
        assert_same(again.get("a"), vals["a"])


# ============================================================================ tier level


def test_quarantine_of_an_old_header_keeps_a_newer_record(tmp_path):
    """A reader that found version 1 damaged quarantines it after version 2 was written: version 2
    stays in service (LMDB and the tier's in-memory index agree)."""
    from ectier.config import NvmeTierConfig
    from ectier.entry import EntryMeta, next_version
    from ectier.tiers.nvme import NvmeTier

    tier = NvmeTier(NvmeTierConfig(path=str(tmp_path / "t"), capacity_bytes=1 * MiB, sync=False))
    try:
        d = digest("k")
        meta = EntryMeta("test", "k", "uint8", (4096,), 4096)
        r1 = tier.encode(meta, filled(4096, 1), next_version())
        assert tier.write(d, r1)
        r2 = tier.encode(meta, filled(4096, 2), next_version())
        assert tier.write(d, r2)
        tier.quarantine(d, r1.header_bytes, "test: stale reader")
        assert tier.record(d) is not None and tier.record(d).version == r2.header.version
        assert tier.used_bytes == tier.stored_bytes(r2)
        assert tier.quarantined() == {}
        header, data = tier.read(d, "test", "k")
        assert header.version == r2.header.version
        assert bytes(data.numpy()) == bytes(filled(4096, 2).numpy())
        # an older write never replaces a newer record
        assert tier.write(d, r1) is False
        assert tier.record(d).version == r2.header.version
        # deleting by an old version leaves the newer record alone
        assert tier.delete(d, only_version=r1.header.version) is False
        assert tier.record(d) is not None
        assert tier.delete(d, only_version=r2.header.version) is True
        assert tier.record(d) is None and tier.used_bytes == 0
    finally:
        tier.close()


def test_overwrite_after_restart_with_the_clock_behind(make_cache, tmp_path, monkeypatch):
    import types

    import ectier.entry as entry_mod

    cache, cfg = make_cache(host_bytes=0)
    cache.put("k", filled(4096, 1))
    cache.close()
    # a new process (fresh version counter) on a host whose wall clock is now one hour behind
    real_ns = entry_mod.time.time_ns
    monkeypatch.setattr(entry_mod, "_last_version", 0)
    monkeypatch.setattr(entry_mod, "time", types.SimpleNamespace(time_ns=lambda: real_ns() - 3600 * 10**9))
    with TieredCache(cfg) as again:
        again.put("k", filled(4096, 2))
        assert_same(again.get("k"), filled(4096, 2))


_TRUNCATE_SCRIPT = """
import os, sys, torch
from ectier import CacheConfig, HostTierConfig, NvmeTierConfig, StoreOpenError, TieredCache
cfg = CacheConfig(host=HostTierConfig(capacity_bytes=0), nvme=NvmeTierConfig(path=sys.argv[1], sync=False))
with TieredCache(cfg) as c:
    for i in range(24):
        c.put(f"k{i}", torch.full((64 * 1024,), i, dtype=torch.uint8))
data = os.path.join(sys.argv[1], "lmdb", "data.mdb")
os.truncate(data, os.path.getsize(data) // int(sys.argv[2]))
try:
    TieredCache(cfg)
except StoreOpenError as exc:
    assert "truncated" in str(exc) and "nvme.path" in str(exc), exc
    print("REFUSED")
else:
    print("OPENED")
"""


@pytest.mark.parametrize("fraction", [2, 3])
def test_truncated_data_file_is_refused_at_open_not_a_sigbus(tmp_path, fraction):
    """A data.mdb shorter than LMDB's last page would SIGBUS on the first read through the map;
    the tier must refuse it at open with a clear error (run in a child so a SIGBUS cannot take
    pytest down)."""
    proc = subprocess.run([sys.executable, "-c", _TRUNCATE_SCRIPT, str(tmp_path / "store"), str(fraction)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert proc.stdout.strip() == "REFUSED"
