"""The NVMe tier when a call fails under it: a read the disk fails (EIO) is a miss, not an
``OSError``, and the record stays for a later read (docs/reliability.md, promise 3); an exception
from a signal handler in a writer waiting for its group commit neither wedges later writes nor
leaves an index entry over blocks given back."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import threading
import time

import pytest

from ectier import TieredCache, testing, testing_internals

from conftest import KiB, MiB, assert_same, filled
from nvme_helpers import io_held


@pytest.mark.parametrize("host_bytes", [0, 4 * MiB])
@pytest.mark.parametrize("nbytes", [1000, 6 * MiB])  # (6 MiB: read in chunks, partly by a helper thread)
def test_a_read_the_disk_fails_is_a_miss_and_the_record_stays(make_cache, monkeypatch, host_bytes, nbytes):
    cache, _ = make_cache(host_bytes=host_bytes, nvme_bytes=32 * MiB, write_through=True)
    value = filled(nbytes, 5)
    cache.put("x", value)
    if "host" in testing.where(cache, "x"):
        assert testing.drop_copy(cache, "host", "x")
    assert testing.where(cache, "x") == {"nvme"}
    before = cache.stats()["tiers"]["nvme"]["read_failures"]

    def eio(*args, **kwargs):
        raise OSError(errno.EIO, "Input/output error")

    with monkeypatch.context() as patched:
        patched.setattr(os, "preadv", eio)
        assert cache.get("x") is None
    assert cache.stats()["tiers"]["nvme"]["read_failures"] == before + 1
    assert_same(cache.get("x"), value)  # the disk reads again: the record was kept


class _Interrupt(Exception):
    """Raised by a signal handler, as KeyboardInterrupt or a timeout library's exception is."""


@contextlib.contextmanager
def _interrupt_after(seconds: float):
    """Raise ``_Interrupt`` in the main thread after ``seconds`` (SIGALRM)."""
    def handler(signum, frame):
        raise _Interrupt()

    old = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)


def _in_thread(fn, name: str) -> threading.Thread:
    t = threading.Thread(target=fn, name=name, daemon=True)
    t.start()
    return t


def test_an_exception_in_a_group_commit_leader_that_waits_leaves_writes_working(make_cache, monkeypatch):
    """The main thread's put leads a group and waits for writer B, still copying; an exception
    from a signal handler ends its wait. B's put and every later one still complete, and the
    interrupted entry is not stored."""
    cache, cfg = make_cache(host_bytes=0, nvme_bytes=16 * MiB, group_commit_s=5.0)
    cache.put("warm", filled(1000, 0))
    with io_held(monkeypatch, "pwrite", "B") as (in_copy, go):
        b = _in_thread(lambda: cache.put("b", filled(2 * MiB, 1)), "B")
        assert in_copy.wait(10)
        with _interrupt_after(0.3), pytest.raises(_Interrupt):
            cache.put("a", filled(1000, 2))  # the leader: waits up to 5 s for B's copy
        go.set()
        b.join(8)
        assert not b.is_alive(), "the put of 'b' hangs after the interrupted leader"
    later = _in_thread(lambda: cache.put("c", filled(1000, 3)), "C")
    later.join(8)
    assert not later.is_alive(), "a later NVMe write hangs"
    assert cache.get("a") is None
    for key, value in (("b", 1), ("c", 3)):
        assert_same(cache.get(key), filled(2 * MiB if key == "b" else 1000, value))
    cache.close()
    with TieredCache(cfg) as again:
        assert_same(again.get("b"), filled(2 * MiB, 1))
        assert again.stats()["tiers"]["nvme"]["quarantined"] == 0


def test_an_exception_in_a_group_commit_follower_leaves_no_entry_over_free_blocks(make_cache, monkeypatch):
    """A follower's put ends on an exception from a signal handler while its entry waits in the
    queue: the entry is withdrawn with its blocks, so no committed index entry names blocks the
    next put reuses (reopen: nothing quarantined)."""
    cache, cfg = make_cache(host_bytes=0, nvme_bytes=16 * MiB, group_commit_s=5.0)
    cache.put("warm", filled(1000, 0))
    with io_held(monkeypatch, "pwrite", "B") as (in_copy, go):
        b = _in_thread(lambda: cache.put("b", filled(2 * MiB, 1)), "B")
        assert in_copy.wait(10)
        leader = _in_thread(lambda: cache.put("l", filled(1000, 2)), "L")  # waits for B's copy
        time.sleep(0.3)
        with _interrupt_after(0.3), pytest.raises(_Interrupt):
            cache.put("f", filled(100 * KiB, 3))  # queued behind the leader
        go.set()
        b.join(10)
        leader.join(10)
    cache.put("g", filled(100 * KiB, 4))  # takes the lowest free blocks
    assert_same(cache.get("g"), filled(100 * KiB, 4))
    assert cache.get("f") is None
    cache.close()
    with TieredCache(cfg) as again:
        for key in ("warm", "b", "l", "g", "f"):
            again.get(key)
        st = again.stats()["tiers"]["nvme"]
        assert (st["quarantined"], st["checksum_failures"]) == (0, 0), "an index entry over reused blocks"
        assert_same(again.get("g"), filled(100 * KiB, 4))


def test_an_exception_in_a_group_commit_leader_after_its_commit_keeps_the_entry(make_cache):
    """The exception lands in the leader right after LMDB's commit (as one from a signal that
    arrived during its fsync would), before the tier's bookkeeping: the entry is committed, so it
    stands and its blocks are not given back (no index entry over blocks the next put reuses)."""
    cache, cfg = make_cache(host_bytes=0, nvme_bytes=16 * MiB)
    cache.put("warm", filled(1000, 0))
    main = threading.main_thread()

    def slow_bookkeeping(digest, record):
        if threading.current_thread() is main and record is not None:
            time.sleep(2.0)  # the signal lands here

    with testing_internals.before_nvme_record(cache, slow_bookkeeping), _interrupt_after(0.3):
        try:
            cache.put("a", filled(256 * KiB, 2))
        except _Interrupt:
            pass  # (raised, or logged by the move as a write that failed after its commit)
    cache.put("g", filled(256 * KiB, 4))  # the lowest free blocks: a's, had they been given back
    assert_same(cache.get("g"), filled(256 * KiB, 4))
    cache.close()
    with TieredCache(cfg) as again:
        assert_same(again.get("a"), filled(256 * KiB, 2))
        assert_same(again.get("g"), filled(256 * KiB, 4))
        st = again.stats()["tiers"]["nvme"]
        assert (st["quarantined"], st["checksum_failures"]) == (0, 0), "an index entry over reused blocks"


@pytest.mark.parametrize("cut", ["in the commit", "after the commit"])
def test_an_overwrite_whose_commit_an_exception_cuts_gives_back_the_replaced_blocks(make_cache, monkeypatch, cut):
    """The leader overwrites "a"; an exception reaches it when LMDB's commit is done (inside the
    commit call, or in the bookkeeping after it). The new record stands, and the blocks of the
    record it replaced are free again at once: the segment holds just what the index names."""
    cache, _ = make_cache(host_bytes=0, nvme_bytes=16 * MiB)
    cache.put("warm", filled(1000, 0))
    cache.put("a", filled(256 * KiB, 1))
    used = cache.stats()["tiers"]["nvme"]["segment_used_bytes"]
    main = threading.main_thread()

    def slow(*args):
        if threading.current_thread() is main:
            time.sleep(2.0)  # the signal lands here

    if cut == "in the commit":
        hook = _write_txns(cache, after_commit=slow)
    else:
        hook = testing_internals.before_nvme_record(cache, lambda digest, record: record is not None and slow())
    with hook, _interrupt_after(0.3):
        try:
            cache.put("a", filled(256 * KiB, 2))
        except _Interrupt:
            pass
    assert_same(cache.get("a"), filled(256 * KiB, 2))
    assert cache.stats()["tiers"]["nvme"]["segment_used_bytes"] == used, "the replaced record's blocks leaked"


@contextlib.contextmanager
def _write_txns(cache, *, after_commit=None, delete=None):
    """While open, the write transactions of the cache's NVMe store call ``after_commit()`` right
    after LMDB committed them, inside the ``with`` block's exit (where a signal during the commit's
    fsync raises), and ``delete(*args)`` instead of their ``delete`` (e.g. to raise)."""
    env = testing.lmdb_of(cache).env

    class Txn:
        def __init__(self, txn):
            self._txn = txn

        def __enter__(self):
            self._txn.__enter__()
            return self

        def __exit__(self, *exc):
            out = self._txn.__exit__(*exc)
            if after_commit is not None:
                after_commit()
            return out

        def __getattr__(self, name):
            if name == "delete" and delete is not None:
                return delete
            return getattr(self._txn, name)

    class Env:
        def begin(self, *args, **kwargs):
            txn = env.begin(*args, **kwargs)
            return Txn(txn) if kwargs.get("write") else txn

        def __getattr__(self, name):
            return getattr(env, name)

    testing.set_lmdb_env(cache, Env())
    try:
        yield
    finally:
        testing.set_lmdb_env(cache, env)


def test_an_eviction_whose_delete_fails_is_not_counted(make_cache):
    """A put evicts the least recently used record, but LMDB refuses that delete: the record stays
    stored and readable, so ``evictions`` does not count it (it counts records removed)."""
    import lmdb

    cache, _ = make_cache(host_bytes=0, nvme_bytes=3 * MiB + 512 * KiB)
    for i, key in enumerate("abc"):
        cache.put(key, filled(MiB, i))

    def refused(*args, **kwargs):
        raise lmdb.Error("injected: delete refused")

    with _write_txns(cache, delete=refused), contextlib.suppress(Exception):
        cache.put("d", filled(MiB, 3))
    for i, key in enumerate("abc"):  # every delete failed: all still stored
        assert_same(cache.get(key), filled(MiB, i))
    assert cache.stats()["tiers"]["nvme"]["evictions"] == 0, "an eviction whose delete failed was counted"
