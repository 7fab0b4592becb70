"""A real full disk: the NVMe tier on a small tmpfs mounted by the test (root only; skipped with the
reason otherwise), and the LMDB map ceiling (``nvme.map_max_bytes``) next to a working host tier.

Promise (``docs/operations.md``, "Full map, full disk"): on a full filesystem the tier evicts its
own least valuable records and retries the write once (new entries are never dropped while old
ones hold the space); with nothing to evict, that one write fails with ``TierWriteError`` saying
what is full and naming the knob, and nothing stored changes. A full LMDB map (index entries) fails
that one write. Reads, deletes and the host tier keep working; once space is freed puts succeed
again; a restart serves everything that was stored, nothing quarantined. Disk usage stays within
1.1 x ``nvme.capacity_bytes`` under churn.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess

import pytest
import torch

from ectier import TieredCache, TierWriteError, testing

from conftest import KiB, MiB, assert_same, check_quiescent, filled, host_holds, make_config, nvme_holds

FS_BYTES = 8 * MiB


@pytest.fixture
def small_fs(tmp_path):
    """An 8 MiB tmpfs mounted on a fresh directory, unmounted after the test."""
    d = tmp_path / "fs"
    d.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root (CI runs as root)")
    if shutil.which("mount") is None or shutil.which("umount") is None:
        pytest.skip("no mount/umount command on this machine")
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={FS_BYTES}", "tmpfs", str(d)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"mount -t tmpfs is not permitted here: {r.stderr.strip() or r.returncode}")
    try:
        yield d
    finally:
        if subprocess.run(["umount", str(d)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(d)], capture_output=True)


def _fill_until_full(cache, prefix, nbytes, limit=200, key_bytes=0):
    """Put ``nbytes`` entries until one fails; returns (stored values, the error). ``key_bytes``
    pads the keys (layout v2: the LMDB map holds the index entries, and a key is part of its entry)."""
    stored = {}
    for i in range(limit):
        t = filled(nbytes, len(stored) + 17 * len(prefix))
        try:
            cache.put(f"{prefix}{i}".ljust(key_bytes, "x"), t)
        except TierWriteError as exc:
            return stored, exc, f"{prefix}{i}".ljust(key_bytes, "x")
        stored[f"{prefix}{i}".ljust(key_bytes, "x")] = t
    raise AssertionError(f"the file system never filled up after {limit} puts")


def _take_the_free_space(path, chunk_bytes: int) -> None:
    """Write ``path`` in ``chunk_bytes`` pieces until the filesystem is full (what fits stays)."""
    try:
        with open(path, "wb") as f:
            while True:
                f.write(b"\0" * chunk_bytes)
                f.flush()
    except OSError:
        pass


def _snapshot(cache):
    st = cache.stats()["tiers"]
    return len(cache), st["nvme"]["used_bytes"], st["nvme"]["entries"]


def _disk_bytes(path) -> int:
    """Bytes allocated on disk under ``path`` (st_blocks, so sparse files count what they hold)."""
    return sum(os.lstat(os.path.join(d, f)).st_blocks * 512 for d, _, fs in os.walk(path) for f in fs)


@pytest.mark.parametrize("sync,entry_bytes", [(True, 256 * KiB), (False, 256 * KiB), (False, 192 * KiB + 7)])
def test_disk_full_evicts_old_entries_for_new_ones(small_fs, sync, entry_bytes):
    """nvme.capacity_bytes above what the filesystem holds (thin provisioning): when the disk fills
    up, the tier evicts its own least recently used records and retries, so every put succeeds and
    the newest entries are kept — it never drops new entries while old ones hold the space. The old
    code failed every put from then on (TierWriteError) and kept the old entries. Entries that end
    inside a block (``192 KiB + 7``) too: a hole left at a block's end would need new space when
    the block is reused, so freed blocks of a full disk would refuse writes."""
    cfg = make_config(small_fs / "store", host_bytes=0, nvme_bytes=64 * MiB, map_initial_bytes=1 * MiB, sync=sync,
                      thin_provisioning=True)
    (small_fs / "filler").write_bytes(b"\0" * (3 * MiB))
    stored = {}
    with TieredCache(cfg) as cache:
        # with sync, the evict-and-retry keeps the write order a power loss relies on (test_sync_order.py)
        with testing.check_sync_order(cache) if sync else contextlib.nullcontext() as order:
            for i in range(60):  # 11-15 MiB of puts into ~4.5 MiB of free space
                t = filled(entry_bytes, i)
                cache.put(f"a{i}", t)  # TierWriteError("disk full") here on the old code
                stored[f"a{i}"] = t
        assert order is None or (order.violations == [] and order.writes >= 60)
        st = cache.stats()["tiers"]["nvme"]
        assert st["disk_full_evictions"] > 0 and st["write_failures"] == 0
        held = [k for k in stored if cache.contains(k)]
        assert len(held) >= 4 and held == list(stored)[-len(held):]  # the newest, in order
        for k in held:
            assert_same(cache.get(k), stored[k])
        assert _disk_bytes(small_fs / "store") <= FS_BYTES
        check_quiescent(cache)
    with TieredCache(cfg) as again:  # a restart serves all of it, nothing torn by the failed writes
        st = again.stats()["tiers"]["nvme"]
        assert st["quarantined"] == 0 and sorted(k for k in stored if again.contains(k)) == sorted(held)
        for k in held:
            assert_same(again.get(k), stored[k])
        check_quiescent(again)


def test_a_disk_filled_by_another_program_after_a_reopen_still_makes_room(small_fs):
    """The store filled the disk, some of it was deleted, the cache restarted, and another program
    took the free space: an eviction is itself an LMDB commit, which may need new pages at the end
    of data.mdb. On the old code those commits failed too (``delete failed: mdb_txn_commit``) and
    some puts were refused while older records held the space; the tier keeps disk
    space for LMDB (nvme_reserve.py), so every put succeeds by evicting."""
    cfg = make_config(small_fs / "store", host_bytes=0, nvme_bytes=64 * MiB, map_initial_bytes=1 * MiB,
                      thin_provisioning=True)
    with TieredCache(cfg) as cache:
        for i in range(120):  # 15 MiB into the 8 MiB filesystem: it fills, evictions start
            cache.put(f"a{i}", filled(128 * KiB, i))
        assert cache.stats()["tiers"]["nvme"]["disk_full_evictions"] > 0
        held = [f"a{i}" for i in range(120) if cache.contains(f"a{i}")]
        for k in held[:40:2]:
            assert cache.delete(k)
    _take_the_free_space(small_fs / "filler", 64 * KiB)  # another program takes what is free
    stored = {}
    with TieredCache(cfg) as cache:
        for i in range(60):
            t = filled(128 * KiB, 200 + i)
            cache.put(f"b{i}", t)  # TierWriteError("disk full ... still full after evicting") on the old code
            stored[f"b{i}"] = t
        st = cache.stats()["tiers"]["nvme"]
        assert st["write_failures"] == 0 and st["disk_full_evictions"] > 0
        held = [k for k in stored if cache.contains(k)]
        assert len(held) >= 10 and held == list(stored)[-len(held):]  # the newest b's, in order
        for k in held:
            assert_same(cache.get(k), stored[k])
        check_quiescent(cache)
    with TieredCache(cfg) as again:  # a restart serves all of it, nothing quarantined
        assert again.stats()["tiers"]["nvme"]["quarantined"] == 0
        for k in held:
            assert_same(again.get(k), stored[k])


@pytest.mark.parametrize("thin", [True, False])
def test_a_full_disk_takes_puts_of_mixed_sizes_into_the_evicted_blocks(small_fs, thin):
    """After evicting at least what a put needs, its retry took the lowest free run that held the
    whole payload: with the evicted blocks scattered, that run lay past the segment file's end,
    which needs new disk space, and the put was refused ("still full after evicting 3 records";
    a newcomer saw 15 of 400 puts refused). The retry writes into blocks the file already holds."""
    import random

    cap = 64 * MiB if thin else 6 * MiB
    cfg = make_config(small_fs / "store", host_bytes=0, nvme_bytes=cap, map_initial_bytes=1 * MiB,
                      thin_provisioning=thin)
    rng = random.Random(1)
    with TieredCache(cfg) as cache:
        for i in range(20):
            cache.put(f"a{i}", filled(256 * KiB, i))
        for i in range(0, 20, 3):
            cache.delete(f"a{i}")
        _take_the_free_space(small_fs / "filler", 16 * KiB)  # another program takes what is free
        stored = {}
        for i in range(120):
            t = filled(rng.choice([32, 64, 128, 256, 512]) * KiB + rng.randint(0, 1000), 50 + i)
            cache.put(f"b{i}", t)  # NvmeDiskFullError("still full after evicting ...") on the old code
            stored[f"b{i}"] = t
        st = cache.stats()["tiers"]["nvme"]
        assert st["write_failures"] == 0 and st["disk_full_evictions"] > 0
        held = [k for k in stored if cache.contains(k)]
        assert held and held == list(stored)[-len(held):]
        for k in held:
            assert_same(cache.get(k), stored[k])
        check_quiescent(cache)


def test_a_store_whose_disk_filled_up_since_still_opens_with_its_budget(small_fs, caplog):
    """The budget fitted when the store was made; another program filled the disk since. The
    open-time check refused the restart (a ConfigError: an engine that could not start, in the
    state the full-disk handling is for); now the budget accepted before opens with a WARNING,
    and only a larger one is refused."""
    import logging

    from ectier import ConfigError

    cfg = make_config(small_fs / "store", host_bytes=0, nvme_bytes=6 * MiB, map_initial_bytes=1 * MiB)
    with TieredCache(cfg) as cache:
        cache.put("k", filled(256 * KiB, 7))
    free = os.statvfs(small_fs).f_bavail * os.statvfs(small_fs).f_frsize
    (small_fs / "filler").write_bytes(b"\0" * (free - 256 * KiB))
    with caplog.at_level(logging.WARNING, logger="ectier"):
        with TieredCache(cfg) as cache:  # ConfigError("nvme.capacity_bytes ... do not fit") on the old code
            assert_same(cache.get("k"), filled(256 * KiB, 7))
    assert any("accepted at an earlier open" in r.getMessage() for r in caplog.records), caplog.text
    with pytest.raises(ConfigError, match="nvme.capacity_bytes"):
        TieredCache(make_config(small_fs / "store", host_bytes=0, nvme_bytes=7 * MiB, map_initial_bytes=1 * MiB))


def test_disk_full_with_nothing_to_evict_fails_that_put_clearly(small_fs):
    """Someone else filled the disk and the tier holds nothing to evict: that one put fails with
    TierWriteError naming the directory, the cause and the knob; nothing stored changes; once space
    frees up, puts succeed again."""
    cfg = make_config(small_fs / "store", host_bytes=0, nvme_bytes=64 * MiB, map_initial_bytes=1 * MiB,
                      thin_provisioning=True)
    filler = small_fs / "filler"
    with TieredCache(cfg) as cache:
        cache.put("first", filled(64 * KiB, 1))
        free = os.statvfs(small_fs).f_bavail * os.statvfs(small_fs).f_frsize
        filler.write_bytes(b"\0" * (free - 64 * KiB))
        with pytest.raises(TierWriteError) as exc:  # needs 256 KiB: evicting "first" frees only 64 KiB
            cache.put("big", filled(256 * KiB, 2))
        text = str(exc.value)
        assert "disk full" in text and str(small_fs / "store") in text and "nvme.capacity_bytes" in text, text
        assert "evict" in text
        assert not cache.contains("big") and cache.get("big") is None
        assert cache.stats()["tiers"]["nvme"]["write_failures"] == 1
        filler.unlink()
        cache.put("big", filled(256 * KiB, 3))
        assert_same(cache.get("big"), filled(256 * KiB, 3))
        check_quiescent(cache)


def test_disk_full_keeps_the_host_tier_working(small_fs):
    """With a host tier and write-through, the disk filled by someone else: the write-through fails
    (nothing of the tier's to evict), the entry stays in host (served, counted, logged); once
    space frees, write-through works again."""
    cfg = make_config(small_fs / "store", host_bytes=1 * MiB, nvme_bytes=64 * MiB, map_initial_bytes=1 * MiB,
                      write_through=True, thin_provisioning=True)
    with TieredCache(cfg) as cache:
        free = os.statvfs(small_fs).f_bavail * os.statvfs(small_fs).f_frsize
        (small_fs / "filler").write_bytes(b"\0" * (free - 32 * KiB))
        small = {f"s{i}": filled(100 * KiB, 300 + i) for i in range(6)}
        for k, t in small.items():
            cache.put(k, t)  # host admits it; the write-through to the full disk fails
        assert cache.stats()["tiers"]["nvme"]["write_failures"] > 0
        assert any(not nvme_holds(cache, k) for k in small)
        for k, t in small.items():
            assert host_holds(cache, k)
            assert_same(cache.get(k), t)
        check_quiescent(cache)
        (small_fs / "filler").unlink()
        cache.put("s-after", filled(100 * KiB, 400))
        assert nvme_holds(cache, "s-after")  # write-through works again


def test_disk_usage_stays_within_the_budget_under_churn(make_cache, tmp_path):
    """Issue 12, item 4: after a steady churn of overwrites, deletes and evictions the store takes
    at most 1.1 x nvme.capacity_bytes on disk (layout v1 grew data.mdb to ~1.9x)."""
    import random

    capacity = 16 * MiB
    cache, cfg = make_cache(host_bytes=0, nvme_bytes=capacity)
    rng = random.Random(7)
    for i in range(400):
        key = f"k{rng.randrange(60)}"
        if rng.random() < 0.1:
            cache.delete(key)
        else:
            cache.put(key, filled(rng.choice([64, 200, 512, 1024, 1500]) * KiB, i))
    check_quiescent(cache)
    assert cache.stats()["tiers"]["nvme"]["evictions"] > 0
    assert _disk_bytes(tmp_path / "nvme") <= 1.1 * capacity, _disk_bytes(tmp_path / "nvme")
    cache.close()


def test_map_ceiling_keeps_the_host_tier_working_and_recovers(make_cache):
    cache, _ = make_cache(host_bytes=256 * KiB, nvme_bytes=16 * MiB, map_initial_bytes=1 * MiB,
                          map_max_bytes=1 * MiB)
    # larger than host: NVMe only; 60 KiB keys fill the 1 MiB map of index entries
    stored, exc, failed = _fill_until_full(cache, "big", 300 * KiB, key_bytes=60 * KiB)
    assert "map full" in str(exc) and "nvme.map_max_bytes" in str(exc), str(exc)
    assert 4 <= len(stored) <= 16 and not cache.contains(failed)
    before = _snapshot(cache)
    small = filled(64 * KiB, 1)
    cache.put("small", small)  # the host tier keeps working
    assert host_holds(cache, "small")
    assert_same(cache.get("small"), small)
    assert _snapshot(cache)[1:] == before[1:]
    for k, t in stored.items():
        assert_same(cache.get(k), t)
    # a delete frees map pages; the next big put reuses them (see the test below)
    assert cache.delete(list(stored)[0])
    cache.put(failed, filled(300 * KiB, 2))
    assert_same(cache.get(failed), filled(300 * KiB, 2))
    check_quiescent(cache)


@pytest.mark.parametrize("key_bytes", [30 * KiB, 60 * KiB])
def test_map_ceiling_a_put_after_a_delete_of_the_same_size_succeeds(make_cache, key_bytes):
    """Issue 16, item 2: at the map ceiling, the space of a deleted record is reused by the next put
    of the same size. LMDB reuses pages freed by a transaction only after a later one committed, and
    an aborted write does not move that point: the old code failed every such put with
    TierWriteError until some unrelated write committed."""
    cache, cfg = make_cache(host_bytes=0, nvme_bytes=16 * MiB, map_initial_bytes=1 * MiB, map_max_bytes=1 * MiB)
    nbytes = 64 * KiB  # layout v2: the map holds index entries, sized by their keys
    stored, exc, failed = _fill_until_full(cache, "k", nbytes, key_bytes=key_bytes)
    assert "map full" in str(exc) and len(stored) >= 2
    keys = list(stored)
    for rnd in range(2 * len(keys)):  # delete one, put one of the same size, over and over
        key = keys[rnd % len(keys)]
        assert cache.delete(key)
        value = filled(nbytes, 1000 + rnd)
        cache.put(key, value)  # TierWriteError here on the old code
        stored[key] = value
        assert len(cache) == len(keys)
    for k, t in stored.items():
        assert_same(cache.get(k), t)
    st = cache.stats()["tiers"]["nvme"]
    assert st["write_failures"] == 1 and st["map_size_bytes"] <= 1 * MiB
    check_quiescent(cache)
    cache.close()
    with TieredCache(cfg) as again:  # what the reused pages hold is served after a restart
        for k, t in stored.items():
            assert_same(again.get(k), t)
        assert again.stats()["tiers"]["nvme"]["quarantined"] == 0


def test_short_write_eio_is_named_disk_full_only_when_the_disk_is_full(tmp_path):
    """LMDB turns a short page write (a file system filling up mid-commit) into EIO: the tier tells
    a full disk from another I/O error by the free space (regression: it said 'write failed ...
    Input/output error' on a full disk, naming neither the cause nor a knob)."""
    import lmdb

    from ectier.tiers.nvme_env import NvmeDiskFullError, lmdb_write_error

    exc = lmdb.Error("mdb_txn_commit: Input/output error")
    err = lmdb_write_error(tmp_path, exc, 100 * KiB, 4096)
    text = str(err)
    assert isinstance(err, NvmeDiskFullError)  # the mover evicts and retries on this one
    assert "disk full" in text and "nvme.capacity_bytes" in text and "4096 bytes free" in text
    err = lmdb_write_error(tmp_path, exc, 100 * KiB, 10 * 1 << 30)
    assert isinstance(err, TierWriteError) and not isinstance(err, NvmeDiskFullError)
    assert "disk full" not in str(err) and "Input/output error" in str(err)
