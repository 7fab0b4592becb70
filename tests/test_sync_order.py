"""The write order a power loss relies on, with ``nvme.sync: true`` (docs/reliability.md, "Power
loss"): payload blocks are synced before an index entry pointing at them commits, and never
rewritten while a committed entry points at them; the store's directory entries are synced at open.

A killed process cannot show this (its writes stay in the page cache); ``testing.check_sync_order``
watches every segment write and sync and compares with what LMDB has committed at that instant.
"""

from __future__ import annotations

import os
import random
import threading

import pytest

from ectier import testing
from ectier.testing_order import Location  # (where a payload lies: what the checker is driven with)

from conftest import KiB, MiB, assert_same, filled


def _churn(cache, rng: random.Random, ops: int, keys: int, max_bytes: int, prefix: str = "k") -> dict:
    """Random puts (overwrites included), deletes and gets; returns what should be stored."""
    want = {}
    for i in range(ops):
        k = f"{prefix}{rng.randrange(keys)}"
        r = rng.random()
        if r < 0.15:
            cache.delete(k)
            want.pop(k, None)
        elif r < 0.3:
            got = cache.get(k)
            if got is not None:
                assert_same(got, want[k])
        else:
            t = filled(rng.randrange(1, max_bytes // 2) * 2, i)
            cache.put(k, t)
            want[k] = t
    return want


def _served_correctly(cache, want: dict) -> None:
    """Whatever is served is the latest put (an entry may have been evicted: a miss)."""
    for k, t in want.items():
        got = cache.get(k)
        if got is not None:
            assert_same(got, t)


@pytest.mark.parametrize("host_bytes", [0, 256 * KiB], ids=["nvme-only", "host-write-back"])
def test_churn_keeps_the_sync_order(make_cache, host_bytes):
    """Overwrites, deletes and evictions in a 1 MiB store (blocks are reused all the time)."""
    cache, _ = make_cache(host_bytes=host_bytes, nvme_bytes=1 * MiB, sync=True)
    with testing.check_sync_order(cache) as check:
        want = _churn(cache, random.Random(7), 300, 12, 200 * KiB)
        cache.flush()
    assert check.violations == []
    assert check.writes > 50 and check.syncs > 10  # (the churn did reuse blocks: see the test below)
    assert cache.stats()["tiers"]["nvme"]["evictions"] > 0
    _served_correctly(cache, want)


def test_write_through_keeps_the_sync_order(make_cache):
    """Write-through overwrites: the older record stays until the new one replaces it."""
    cache, _ = make_cache(host_bytes=256 * KiB, nvme_bytes=1 * MiB, sync=True, write_through=True)
    with testing.check_sync_order(cache) as check:
        want = _churn(cache, random.Random(11), 200, 8, 150 * KiB)
    assert check.violations == []
    assert check.writes > 50
    _served_correctly(cache, want)


def test_group_commit_keeps_the_sync_order(make_cache):
    """Writers in four threads sharing group commits (one sync, one LMDB commit for several)."""
    cache, _ = make_cache(host_bytes=0, nvme_bytes=2 * MiB, sync=True, group_commit_s=0.02)
    errors = []

    def writer(t):
        try:
            _churn(cache, random.Random(t), 60, 6, 64 * KiB, prefix=f"t{t}-")
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    with testing.check_sync_order(cache) as check:
        threads = [threading.Thread(target=writer, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(60)
    assert errors == []
    assert check.violations == []
    assert check.writes > 100


def test_the_checker_catches_each_rule(make_cache):
    """The checker itself: a write into a committed entry's blocks, and a committed entry over
    blocks written after the last sync, are each reported."""
    cache, _ = make_cache(host_bytes=0, nvme_bytes=1 * MiB, sync=True)
    cache.put("a", filled(100 * KiB, 1))
    with testing.check_sync_order(cache) as check:
        (digest, blocks), = check.committed().items()
        loc = Location(((min(blocks), len(blocks)),))
        check.before_write(loc)
        assert len(check.violations) == 1 and "rewritten while entry" in check.violations[0]
        check.after_write(loc)  # written again, not synced: rule 1 now fails for the entry
        check.check("test")
        assert len(check.violations) == 2 and "written since the last sync" in check.violations[1]
        lm = testing.lmdb_of(cache)
        with lm.env.begin() as txn:
            raw = bytes(txn.get(digest, db=lm.meta))
        check.committing([raw])  # an index entry committing over those blocks: caught at the commit
        assert len(check.violations) == 3 and check.violations[2].startswith("commit:")
        check.after_sync(check.before_sync())
        n = len(check.violations)
        check.check("test")
        assert len(check.violations) == n  # synced: nothing more
        check.before_write(loc)  # a write in progress: an entry committing over it is caught
        check.committing([raw])
        assert check.violations[-1].startswith("commit:")
        check.after_write(loc)
        check.after_sync(check.before_sync())
        n = len(check.violations)
        check.truncating(min(blocks))  # cutting the segment under a committed entry
        assert len(check.violations) == n + 1 and check.violations[-1].startswith("truncate:")
        check.truncating(max(blocks) + 1)
        assert len(check.violations) == n + 1
        check.violations.clear()


def test_sync_off_has_no_order_to_check(make_cache):
    cache, _ = make_cache(host_bytes=0, nvme_bytes=1 * MiB, sync=False)
    with pytest.raises(ValueError, match="nvme.sync"):
        with testing.check_sync_order(cache):
            pass


@pytest.mark.parametrize("sync", [True, False])
def test_open_syncs_the_directory_entries(make_cache, tmp_path, monkeypatch, sync):
    """With ``nvme.sync`` the open makes the names of the store's files durable: ``lmdb/``, the
    store directory and the parent of every directory it created (a put durable on return would
    otherwise be lost with a file name still in the page cache)."""
    synced = []
    real = os.fsync

    def fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        if os.path.isdir(path):
            synced.append(path)
        return real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    store = tmp_path / "a" / "b" / "store"
    make_cache(path=store, host_bytes=0, nvme_bytes=1 * MiB, sync=sync)
    expected = {str(store / "lmdb"), str(store), str(store.parent), str(tmp_path / "a"), str(tmp_path)}
    if sync:
        assert expected <= set(synced)
    else:
        assert not expected & set(synced)
