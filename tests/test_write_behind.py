"""The host tier's write-behind (``host.write_behind_fraction``, ``ectier/moves/writeback.py``).

A background thread writes the dirty host entries nearest eviction to NVMe, so that an eviction
drops a copy NVMe holds. The races: a new version or a delete while an entry is written behind,
an eviction of the entry being written, close() with a write in flight, a failed write; and the
same overwrite/delete ordering for a demotion by an eviction in another thread. Each NVMe write
is held at a gate (``testing.hold_writes``) to make the interleaving exact.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import threading

import pytest
import torch

from ectier import CacheConfig, ConfigError, TieredCache
from ectier import testing
from ectier.testing import WRITE_BEHIND_THREAD, hold_writes, record_of, version_of, where, write_behind_idle

from conftest import filled

KiB = 1 << 10
ENTRY = 64 * KiB  # one block; the host holds 4


def config(path, *, fraction: float = 1.0, flush_on_close: bool = False) -> dict:
    return {"namespace": "test",
            "host": {"capacity_bytes": 4 * ENTRY, "block_bytes": ENTRY, "write_behind_fraction": fraction},
            "nvme": {"path": str(path), "capacity_bytes": 4 << 20, "sync": False,
                     "flush_on_close": flush_on_close}}


def host_stats(cache: TieredCache) -> dict:
    return cache.stats()["tiers"]["host"]


def same(t, value: int) -> bool:
    return t is not None and torch.equal(t, filled(ENTRY, value))


def test_write_behind_keeps_the_lru_end_clean_and_evictions_drop(tmp_path):
    """The window is half the host: its two oldest entries are written, the two newest are not;
    the next put evicts the oldest without a write."""
    with TieredCache(config(tmp_path, fraction=0.5)) as c:
        for i in range(4):
            c.put(f"k{i}", filled(ENTRY, i))
        assert write_behind_idle(c)
        assert [sorted(where(c, f"k{i}")) for i in range(4)] == [["host", "nvme"]] * 2 + [["host"]] * 2
        s = host_stats(c)
        assert (s["write_behind_writes"], s["write_behind_bytes"]) == (2, 2 * ENTRY)
        c.put("k4", filled(ENTRY, 4))
        assert write_behind_idle(c)
        s = host_stats(c)
        assert (s["clean_evictions"], s["dirty_evictions"], s["eviction_write_s"]) == (1, 0, 0)
        assert where(c, "k0") == {"nvme"} and same(c.get("k0"), 0)
        testing.check_invariants(c)


def test_without_write_behind_an_eviction_writes_in_the_call(tmp_path):
    with TieredCache(config(tmp_path, fraction=0.0)) as c:
        assert not testing.write_behind_enabled(c)
        for i in range(5):
            c.put(f"k{i}", filled(ENTRY, i))
        s = host_stats(c)
        assert (s["clean_evictions"], s["dirty_evictions"], s["write_behind_writes"]) == (0, 1, 0)
        assert s["eviction_write_s"] > 0
        assert same(c.get("k0"), 0)


def waits_for_the_write(call, gate) -> None:
    """``call`` (an overwrite or a delete of the key being written behind) returns only once the
    held write-behind has finished: the record it may commit is then already deleted as stale, so
    a crash after ``call`` returned can never bring the older bytes back."""
    t = threading.Thread(target=call)
    t.start()
    t.join(0.5)
    alive = t.is_alive()
    gate.release(1)
    t.join(10)
    assert not t.is_alive()
    assert alive, "returned while an NVMe write of the older version could still commit its record"


@contextlib.contextmanager
def k_written_behind(tmp_path, after: bool):
    """A cache whose write-behind of ``k`` (version 1) is held, before its write or after its
    record: yields ``(cache, gate)``; the cache is checked and closed afterwards."""
    c = TieredCache(config(tmp_path))
    try:
        with hold_writes(c, "nvme", thread_name=WRITE_BEHIND_THREAD, after=after) as gate:
            c.put("k", filled(ENTRY, 1))
            assert gate.wait_held(1)
            yield c, gate
        assert write_behind_idle(c)
        testing.check_invariants(c)
    finally:
        c.close()


AFTER = pytest.mark.parametrize("after", [False, True], ids=["before-its-write", "after-its-record"])


@AFTER
def test_a_new_version_put_while_the_old_is_written_behind(tmp_path, after):
    """NVMe ends with the new version or none, never the old one under the key."""
    with k_written_behind(tmp_path, after) as (c, gate):
        waits_for_the_write(lambda: c.put("k", filled(ENTRY, 2)), gate)
        new = version_of(c, "k")
        assert gate.wait_held(2)  # the old version's write is finished: the new one's is held
        rec = record_of(c, "k")
        assert rec is None or rec.version == new, f"NVMe holds version {rec.version} of k, not {new}"
        assert same(c.get("k"), 2)
    with TieredCache(config(tmp_path)) as c:
        assert same(c.get("k"), 2) and record_of(c, "k").version == new


@AFTER
def test_a_delete_while_the_entry_is_written_behind(tmp_path, after):
    with k_written_behind(tmp_path, after) as (c, gate):
        waits_for_the_write(lambda: c.delete("k"), gate)
    with TieredCache(config(tmp_path)) as c:
        assert record_of(c, "k") is None and c.get("k") is None


EVICTOR = "evictor"


@contextlib.contextmanager
def k_demoted_by_an_eviction(tmp_path, after: bool):
    """No write-behind: ``k`` (version 1) is the host's LRU entry, and a put of four other keys
    in the thread ``evictor`` evicts it; that demotion's write is held (before its write, or
    after its record). Yields ``(cache, gate)``; the evictor is joined, the cache checked and
    closed afterwards."""
    c = TieredCache(config(tmp_path, fraction=0.0))
    try:
        with hold_writes(c, "nvme", thread_name=EVICTOR, after=after) as gate:
            c.put("k", filled(ENTRY, 1))
            evictor = threading.Thread(name=EVICTOR, target=lambda: [c.put(f"o{i}", filled(ENTRY, 10 + i))
                                                                      for i in range(4)])
            evictor.start()
            assert gate.wait_held(1)
            try:
                yield c, gate
            finally:
                gate.open()
                evictor.join(10)
        assert not evictor.is_alive()
        testing.check_invariants(c)
    finally:
        c.close()


@AFTER
def test_a_new_version_put_while_the_old_is_demoted_by_an_eviction(tmp_path, after):
    """The same ordering as the write-behind's, for an eviction-time demotion in another
    thread's put: the overwrite returns only once the demotion's record is gone as stale."""
    with k_demoted_by_an_eviction(tmp_path, after) as (c, gate):
        waits_for_the_write(lambda: c.put("k", filled(ENTRY, 2)), gate)
        new = version_of(c, "k")
        rec = record_of(c, "k")
        assert rec is None or rec.version == new, f"NVMe holds version {rec.version} of k, not {new}"
        assert same(c.get("k"), 2)
    with TieredCache(config(tmp_path, fraction=0.0)) as c:
        got = c.get("k")
        assert got is None or same(got, 2)


@AFTER
def test_a_delete_while_the_entry_is_demoted_by_an_eviction(tmp_path, after):
    with k_demoted_by_an_eviction(tmp_path, after) as (c, gate):
        waits_for_the_write(lambda: c.delete("k"), gate)
        assert record_of(c, "k") is None
    with TieredCache(config(tmp_path, fraction=0.0)) as c:
        assert record_of(c, "k") is None and c.get("k") is None


def test_an_eviction_passes_over_the_entry_being_written(tmp_path):
    """The entry written behind is pinned: a put that needs room evicts the next one (written in
    the put), never frees the blocks under the write; the record written holds the entry's bytes."""
    with TieredCache(config(tmp_path)) as c:
        with hold_writes(c, "nvme", thread_name=WRITE_BEHIND_THREAD) as gate:
            for i in range(4):
                c.put(f"k{i}", filled(ENTRY, i))
            assert gate.wait_held(1)  # k0's write, the least recently used
            done = threading.Event()
            t = threading.Thread(target=lambda: (c.put("k4", filled(ENTRY, 4)), done.set()))
            t.start()
            t.join(10)
            assert done.is_set(), "a put waited for the write-behind"
            assert where(c, "k0") == {"host"} and where(c, "k1") == {"nvme"}
            assert host_stats(c)["dirty_evictions"] == 1
        assert write_behind_idle(c)
        assert testing.drop_copy(c, "host", "k0")  # k0 now only as NVMe's record
        assert same(c.get("k0"), 0) and same(c.get("k1"), 1) and same(c.get("k4"), 4)
        testing.check_invariants(c)


def test_a_promotion_blocked_only_by_the_write_behind_waits_for_its_write(tmp_path):
    """Every host entry is leased but the one being written behind: an NVMe hit's promotion waits
    for that one write (then evicts the entry, clean) instead of being served without a lease."""
    with TieredCache(config(tmp_path)) as c:
        c.put("y", filled(ENTRY, 9))
        assert write_behind_idle(c) and testing.drop_copy(c, "host", "y")  # y: NVMe only
        with hold_writes(c, "nvme", thread_name=WRITE_BEHIND_THREAD) as gate:
            for i in range(4):
                c.put(f"k{i}", filled(ENTRY, i))
            assert gate.wait_held(1)  # k0's write
            leases = [c.acquire(f"k{i}") for i in (1, 2, 3)]
            threading.Timer(0.3, gate.release, (10,)).start()
            lease = c.acquire("y")
            assert lease is not None, "the NVMe hit was not promoted"
            assert same(c.load(lease), 9)
            c.release(lease)
            for held in leases:
                c.release(held)
        assert where(c, "k0") == {"nvme"} and host_stats(c)["clean_evictions"] >= 1
        testing.check_invariants(c)


@pytest.mark.parametrize("flush_on_close", [True, False])
def test_close_with_a_write_behind_in_flight(tmp_path, caplog, flush_on_close):
    """close() waits for the write in flight (never writes into a closed tier), then flushes if
    configured; a restart serves every entry it has, each with its own bytes."""
    c = TieredCache(config(tmp_path, flush_on_close=flush_on_close))
    with caplog.at_level(logging.WARNING, logger="ectier"):
        with hold_writes(c, "nvme", thread_name=WRITE_BEHIND_THREAD) as gate:
            for i in range(3):
                c.put(f"k{i}", filled(ENTRY, i))
            assert gate.wait_held(1)
            closer = threading.Thread(target=c.close)
            closer.start()
            closer.join(0.5)
            assert closer.is_alive(), "close() returned with a write-behind in flight"
            gate.release(1)
            closer.join(10)
            assert not closer.is_alive()
    assert not [r for r in caplog.records if "failed" in r.getMessage()], caplog.text
    with TieredCache(config(tmp_path)) as c:
        assert same(c.get("k0"), 0)  # the write in flight landed
        for i in (1, 2):
            got = c.get(f"k{i}")
            assert same(got, i) if flush_on_close else (got is None or same(got, i))


def test_a_failed_write_behind_leaves_the_entry_dirty_in_the_host(tmp_path):
    with TieredCache(config(tmp_path, fraction=0.5)) as c:
        with testing.fail_writes(c, "nvme", OSError(errno.EIO, "injected I/O error")) as calls:
            for i in range(4):
                c.put(f"k{i}", filled(ENTRY, i))
            assert write_behind_idle(c)
            assert calls, "the write-behind did not try"
            assert host_stats(c)["write_behind_failures"] >= 1
            assert where(c, "k0") == {"host"} and same(c.get("k1"), 1)
        c.put("k4", filled(ENTRY, 4))  # evicts k0, still dirty: written in the put
        assert write_behind_idle(c)
        assert where(c, "k0") == {"nvme"} and same(c.get("k0"), 0)
        testing.check_invariants(c)


@pytest.mark.parametrize("bad", [-0.1, 1.5, "half", True, float("nan")])
def test_a_bad_fraction_is_a_config_error_naming_the_field(bad):
    with pytest.raises(ConfigError, match="host.write_behind_fraction"):
        CacheConfig.from_dict({"host": {"write_behind_fraction": bad}})
