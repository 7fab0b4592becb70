"""NVMe layout v2 (issue 12): a layout-v1 store is migrated at open (the golden stores written by the
v1 code), the free-space map of the segment file, group commit, reopen without reading payloads.

``tests/golden/store_v1_*`` were written once by the v1 code (``tests/golden/make_golden_store.py``);
they hold three records each (keys ``golden-0..2``, the bytes of ``make_golden.golden_raw_bytes``).
"""

from __future__ import annotations

import importlib.util
import pathlib
import shutil
import threading
import time
import traceback

import pytest
import torch

from ectier import TieredCache, testing
from ectier.fsck import check
from ectier.tiers.nvme_segment import BLOCK_BYTES, ExtentSpace, Location

from conftest import KiB, MiB, assert_same, check_quiescent, filled, make_config

GOLDEN = pathlib.Path(__file__).resolve().parent / "golden"


def _make_golden():
    spec = importlib.util.spec_from_file_location("make_golden", GOLDEN / "make_golden.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("codec,shape", [("raw", (4, 512)), ("zstd-planes", (16, 512))])
def test_golden_layout_v1_store_is_migrated_at_open(tmp_path, codec, shape, caplog):
    """Today's code opens a store the v1 code wrote: every record is served byte-exact, the store
    is format 2 afterwards (payloads in segment.0, LMDB's data database gone), one warning says so;
    fsck calls it healthy."""
    mg = _make_golden()
    store = tmp_path / "store"
    shutil.copytree(GOLDEN / f"store_v1_{codec}", store)
    assert check(store).settings["format"] == "1" and check(store).intact == 3  # fsck reads v1 too
    cfg = make_config(store, host_bytes=0, nvme_bytes=64 * MiB, namespace=mg.NAMESPACE)
    with caplog.at_level("WARNING", logger="ectier"):
        cache = TieredCache(cfg)
    try:
        assert any("migrated the layout-v1 store" in r.getMessage() and str(store) in r.getMessage()
                   for r in caplog.records)
        for i in range(3):
            raw = mg.golden_raw_bytes(shape[0] * shape[1] * (i + 1))
            got = cache.get(f"golden-{i}")
            assert got is not None and got.dtype == torch.bfloat16 and tuple(got.shape) == (shape[0] * (i + 1), shape[1])
            assert bytes(got.view(torch.uint8).numpy()) == raw
        st = cache.stats()["tiers"]["nvme"]
        assert st["entries"] == 3 and st["quarantined"] == 0 and st["checksum_failures"] == 0
        check_quiescent(cache)
    finally:
        cache.close()
    report = check(store)
    assert report.settings["format"] == "2" and not report.damaged and report.intact == 3
    assert "migrated" in report.settings
    import lmdb

    env = lmdb.open(str(store / "lmdb"), readonly=True, lock=False, max_dbs=4)  # (open_lmdb would create "data")
    try:
        with env.begin() as txn:
            names = {bytes(k) for k, _ in txn.cursor()}
    finally:
        env.close()
    assert b"data" not in names and (store / "segment.0").stat().st_size > 0
    with TieredCache(cfg) as again:  # and opens as a v2 store from then on
        assert again.get("golden-2") is not None


def test_migration_cut_before_its_commit_is_redone(tmp_path, monkeypatch):
    """A kill during the migration (here: an error right before its one commit) leaves the v1 store
    as it was; the next open migrates it."""
    import ectier.tiers.nvme_migrate as nm

    store = tmp_path / "store"
    shutil.copytree(GOLDEN / "store_v1_raw", store)
    cfg = make_config(store, host_bytes=0, nvme_bytes=64 * MiB, namespace=_make_golden().NAMESPACE)
    real = nm.pack_index_value
    calls = []

    def failing(*a):
        calls.append(1)
        if len(calls) == 3:
            raise OSError(5, "injected failure during the migration")
        return real(*a)

    monkeypatch.setattr(nm, "pack_index_value", failing)
    with pytest.raises(Exception):
        TieredCache(cfg)
    assert check(store).settings["format"] == "1" and check(store).intact == 3
    monkeypatch.setattr(nm, "pack_index_value", real)
    with TieredCache(cfg) as cache:
        assert len(cache) == 3 and all(cache.get(f"golden-{i}") is not None for i in range(3))


def test_extent_space_hands_out_lowest_blocks_and_holds_blocks_under_reads():
    space = ExtentSpace(8)
    a = space.allocate(2 * BLOCK_BYTES)
    b = space.allocate(1)
    assert a == Location(((0, 2),)) and b == Location(((2, 1),))
    with space.reading():  # a read that began before the free still sees a's blocks
        space.free(a)
        c = space.allocate(BLOCK_BYTES)
        assert c.extents[0][0] >= 3  # not a's blocks
    d = space.allocate(2 * BLOCK_BYTES)  # after the read: a's blocks are free again
    assert d == Location(((0, 2),))
    big = space.allocate(10 * BLOCK_BYTES)  # more than the region: it grows
    assert space.nblocks > 8 and sum(n for _, n in big.extents) == 10
    space.free(big)
    assert space.nblocks == 8  # and shrinks back once its end is free


def test_reads_racing_writes_never_see_reused_blocks(make_cache):
    """Readers of keys that are overwritten and deleted all the time: every hit is exact (a read
    holds the blocks of its snapshot), nothing fails its checksum. An exception in a thread, or a
    thread still running, fails the test with its traceback (it was a warning only before: a
    writer dying between its commit and its registration left exactly a stale record)."""
    cache, _ = make_cache(host_bytes=0, nvme_bytes=2 * MiB)
    vals = {i: filled(100 * KiB, i) for i in range(40)}
    stop = threading.Event()
    bad, errors = [], []

    def guarded(body):
        def run():
            try:
                body()
            except BaseException:  # noqa: BLE001 - reported by the test
                errors.append(traceback.format_exc())
        return run

    def writer():
        n = 0
        while not stop.is_set():
            k = f"k{n % 6}"
            cache.put(k, vals[n % 40])
            if n % 7 == 0:
                cache.delete(f"k{(n + 3) % 6}")
            n += 1

    def reader():
        while not stop.is_set():
            for i in range(6):
                got = cache.get(f"k{i}")
                if got is not None and not any(torch.equal(got, v) for v in vals.values()):
                    bad.append(i)

    threads = [threading.Thread(target=guarded(writer))] + [threading.Thread(target=guarded(reader)) for _ in range(2)]
    for t in threads:
        t.start()
    threading.Event().wait(3)
    stop.set()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads), "a thread is still running"
    assert not errors, errors[0]
    assert not bad
    assert cache.stats()["tiers"]["nvme"]["checksum_failures"] == 0
    check_quiescent(cache)


def test_a_replaced_nvme_record_is_never_absent_meanwhile(make_cache):
    """An overwrite swaps the key's NVMe record in one step: a lookup at any moment of the swap
    (lookups take no lock) finds the old record or the new one, never none. Before, the old one
    was removed first: a commit rule looking then saw no record, and could claim the new one for
    deletion as if it were the old (a put then lost, or older bytes served)."""
    cache, _ = make_cache(host_bytes=0, nvme_bytes=2 * MiB)
    cache.put("k", filled(100 * KiB, 1))
    seen = []
    with testing.watch_nvme_records(cache, lambda d: seen.append(testing.record_of(cache, "k"))):
        cache.put("k", filled(100 * KiB, 2))
    assert seen and all(r is not None for r in seen)
    assert_same(cache.get("k"), filled(100 * KiB, 2))
    check_quiescent(cache)


def test_a_write_failing_after_its_commit_leaves_the_newest_record_registered(make_cache):
    """A write whose record committed but which failed afterwards (clean-up of the replaced
    record's blocks raising) is a stored write: the newest version is the key's current one, in
    memory and after reopen. Before, the put raised and the older version stayed current while
    NVMe held the newer record ("stale NVMe record left behind", a miss for a stored key)."""
    cache, cfg = make_cache(host_bytes=0, nvme_bytes=2 * MiB)
    cache.put("k", filled(100 * KiB, 1))
    with testing.fail_after_writes(cache, "nvme", ValueError("extent lies outside the region")) as done:
        cache.put("k", filled(100 * KiB, 2))
    assert done == [True]
    assert_same(cache.get("k"), filled(100 * KiB, 2))
    check_quiescent(cache)
    cache.close()
    with TieredCache(cfg) as again:
        assert_same(again.get("k"), filled(100 * KiB, 2))


def test_concurrent_writes_share_group_commits(make_cache, monkeypatch):
    """Writers in several threads: fewer commits than entries (one fdatasync and one LMDB commit
    serve several puts), every put durable and served after a restart.

    Each payload copy is slowed (10 ms) and the writers start together: on a fast filesystem one
    thread could otherwise finish all its puts before the next one starts (CI saw 48 groups of one)."""
    import ectier.tiers.nvme_segment as seg

    real_write = seg.SegmentFile.write
    monkeypatch.setattr(seg.SegmentFile, "write", lambda self, *a, **kw: time.sleep(0.01) or real_write(self, *a, **kw))
    cache, cfg = make_cache(host_bytes=0, nvme_bytes=64 * MiB, group_commit_s=0.5)
    vals = {f"t{t}-{i}": filled(64 * KiB, 100 * t + i) for t in range(4) for i in range(12)}
    start = threading.Barrier(4)

    def put_all(t):
        start.wait(30)
        for i in range(12):
            cache.put(f"t{t}-{i}", vals[f"t{t}-{i}"])

    threads = [threading.Thread(target=put_all, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    st = cache.stats()["tiers"]["nvme"]
    assert st["committed_entries"] == 48 and st["commit_groups"] < 48
    cache.close()
    with TieredCache(cfg) as again:
        for k, v in vals.items():
            assert_same(again.get(k), v)


def test_reopen_reads_no_payload_byte(make_cache, monkeypatch):
    """Opening a store scans the index only: no read of segment.0 at all."""
    cache, cfg = make_cache(host_bytes=0, nvme_bytes=16 * MiB)
    for i in range(50):
        cache.put(f"k{i}", filled(64 * KiB, i))
    cache.close()
    import ectier.tiers.nvme_segment as seg

    reads = []
    real = seg.SegmentFile.read_into
    monkeypatch.setattr(seg.SegmentFile, "read_into", lambda self, *a: reads.append(1) or real(self, *a))
    with TieredCache(cfg) as again:
        assert len(again) == 50 and not reads
        assert_same(again.get("k7"), filled(64 * KiB, 7))
        assert reads


def test_replace_that_grows_then_shrinks_the_segment(make_cache):
    """A replace needs the old and the new payload at once: the region grows past the budget, and
    shrinks (the segment file is cut back) once the old one is freed. This path raised NameError."""
    cache, cfg = make_cache(host_bytes=0, nvme_bytes=2 * MiB)
    seg = pathlib.Path(cfg.nvme.path) / "segment.0"
    for r in range(3):
        cache.put("k", filled(1536 * KiB, r))
    assert_same(cache.get("k"), filled(1536 * KiB, 2))
    assert seg.stat().st_size <= cfg.nvme.capacity_bytes
    check_quiescent(cache)
    cache.close()
    with TieredCache(cfg) as again:
        assert_same(again.get("k"), filled(1536 * KiB, 2))


def test_reopen_of_fragmented_store_keeps_every_record_and_exact_free_space(make_cache):
    """Records of several extents (a fragmented segment) take the general parse at open; the
    free-space map after reopen is exactly the blocks no record names, and eviction order is
    still oldest write first."""
    cache, cfg = make_cache(host_bytes=0, nvme_bytes=17 * BLOCK_BYTES)  # 16 records and one spare block
    for i in range(16):
        cache.put(f"s{i}", filled(BLOCK_BYTES, i))  # one block each
    for i in range(0, 16, 2):
        cache.delete(f"s{i}")
    cache.put("big", filled(4 * BLOCK_BYTES, 99))  # four one-block holes: several extents
    cache.close()
    with TieredCache(cfg) as again:
        nv = testing.tier(again, "nvme")
        keys = ["big"] + [f"s{i}" for i in range(1, 16, 2)]
        assert len(again) == len(keys)
        assert_same(again.get("big"), filled(4 * BLOCK_BYTES, 99))
        for i in range(1, 16, 2):
            assert_same(again.get(f"s{i}"), filled(BLOCK_BYTES, i))
        used = sum(rec.location.blocks for _, rec in nv.records())
        assert len(testing.record_of(again, "big").location.extents) > 1
        assert nv.space()["segment_used_bytes"] == used * BLOCK_BYTES
        check_quiescent(again)


@pytest.mark.parametrize("policy", ["lru", "gdsf"])
def test_policy_add_many_is_add_in_order(policy):
    """``add_many`` (one call for the whole store at open) leaves the policy as ``add`` one by one."""
    from ectier.policy import make_policy

    items = [(f"k{i}", 100 + i) for i in range(50)]
    one, many = make_policy(policy), make_policy(policy)
    one.add("k3", 7)
    many.add("k3", 7)  # an already tracked key moves to the end, as add does
    for k, n in items:
        one.add(k, n)
    many.add_many(items)
    assert list(one) == list(many)
    assert one.victims(1000) == many.victims(1000)
    with pytest.raises(ValueError, match="nbytes"):
        many.add_many([("bad", -1)])
