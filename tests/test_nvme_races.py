"""Races on one key of the NVMe tier, staged deterministically (a put held in ``NvmeTier.write``
before its write, or after its record committed and before the put registers it), each ending in
a checked state that is the same in memory and after a reopen: a delete racing an NVMe put, and
two NVMe puts of one key racing (the later-started one stands, whichever finishes last), an NVMe
eviction of a record that a host victim's demotion has just written, and write-through overwrites,
deletes and demotions of one key (what LMDB holds at each step: what a kill would leave).

Complements ``tests/test_races.py`` (host/NVMe puts of one key, delete vs promotion) and
``tests/test_nvme_layout.py`` (a record replaced in one step; a write failing after its commit).
"""

from __future__ import annotations

import threading
import time

import pytest

from ectier import TieredCache, testing
from ectier.errors import TierWriteError
from ectier.testing_internals import before_write_through_wait, nvme_headers_in_lmdb
from ectier.moves.nvme import NvmeMoves
from ectier.tiers.nvme import NvmeTier

from conftest import KiB, MiB, assert_same, check_quiescent, digest, filled
from staged_threads import join, start


class HeldWrite:
    """Holds the first ``NvmeTier.write`` of ``key`` until released: before it writes anything
    (``stage="before-write"``) or once its record has committed (``stage="after-commit"``)."""

    def __init__(self, monkeypatch, key: str, stage: str) -> None:
        self.entered, self.release = threading.Event(), threading.Event()
        self.used = False
        original, kd = NvmeTier.write, digest(key)

        def write(tier, d, record):
            staged = not self.used and d == kd
            self.used = self.used or staged
            if staged and stage == "before-write":
                self._hold()
            done = original(tier, d, record)
            if staged and stage == "after-commit":
                self._hold()
            return done

        monkeypatch.setattr(NvmeTier, "write", write)

    def _hold(self) -> None:
        self.entered.set()
        assert self.release.wait(30), "held write never released"

    def wait(self) -> None:
        assert self.entered.wait(10), "the staged write never came"


def _same_after_reopen(cache, cfg, key, expected):
    """``key`` reads ``expected`` (``None``: a miss) now and after a reopen; both states checked."""
    def check(c):
        got = c.get(key)
        if expected is None:
            assert got is None
        else:
            assert_same(got, expected)
        check_quiescent(c)

    check(cache)
    cache.close()
    with TieredCache(cfg) as again:
        check(again)


@pytest.mark.parametrize("stage", ["before-write", "after-commit"])
def test_delete_racing_an_nvme_put_of_the_key(make_cache, monkeypatch, stage):
    """K v0 is stored; put(K, v1) is held in its NVMe write; delete(K) runs. Held before its
    write, the put comes after the delete (K = v1); held after its commit, the delete removes v1
    (K absent). Never v0, never a record the catalog does not know, same after a reopen."""
    cache, cfg = make_cache(host_bytes=0, nvme_bytes=2 * MiB)
    v0, v1 = filled(100 * KiB, 0), filled(150 * KiB, 1)
    cache.put("K", v0)
    held = HeldWrite(monkeypatch, "K", stage)
    t, box = start(cache.put, "K", v1)
    held.wait()
    assert cache.delete("K")
    held.release.set()
    join(t, box)
    _same_after_reopen(cache, cfg, "K", v1 if stage == "before-write" else None)


@pytest.mark.parametrize("stage", ["before-write", "after-commit"])
def test_two_nvme_puts_of_one_key_the_later_started_stands(make_cache, monkeypatch, stage):
    """put(K, va) starts first and is held in its NVMe write; put(K, vb) starts later and
    completes; then va's write goes on. vb stands, in memory and after a reopen; va's record is
    refused (before-write) or replaced and forgotten (after-commit)."""
    cache, cfg = make_cache(host_bytes=0, nvme_bytes=2 * MiB)
    va, vb = filled(100 * KiB, 1), filled(150 * KiB, 2)
    cache.put("K", filled(64 * KiB, 0))
    held = HeldWrite(monkeypatch, "K", stage)
    t, box = start(cache.put, "K", va)
    held.wait()
    cache.put("K", vb)
    held.release.set()
    join(t, box)
    _same_after_reopen(cache, cfg, "K", vb)


def test_delete_and_put_racing_an_overwrite_that_committed(make_cache, monkeypatch):
    """put(K, v1) is held after its commit; delete(K), then put(K, v2), complete; then v1's put
    finishes. v2 stands (the held write's record was deleted, then replaced), same after reopen."""
    cache, cfg = make_cache(host_bytes=0, nvme_bytes=2 * MiB)
    v1, v2 = filled(100 * KiB, 1), filled(150 * KiB, 2)
    cache.put("K", filled(64 * KiB, 0))
    held = HeldWrite(monkeypatch, "K", "after-commit")
    t, box = start(cache.put, "K", v1)
    held.wait()
    assert cache.delete("K")
    cache.put("K", v2)
    held.release.set()
    join(t, box)
    _same_after_reopen(cache, cfg, "K", v2)


def _committed_records(cache) -> int:
    """Index entries LMDB holds now: what a process killed at this moment would find at restart."""
    lm = testing.lmdb_of(cache)
    with lm.env.begin() as txn:
        return txn.stat(lm.meta)["entries"]


def test_two_write_through_overwrites_cut_by_a_kill_leave_an_older_value_on_nvme(make_cache, monkeypatch):
    """Write-through (the daemon's mode in the crash campaign): K v0 is on NVMe; put(K, va)'s
    write-through is held once its record committed (va replaced v0); put(K, vb) commits in the host
    and waits for it; va's write goes on (stale: vb is current) and vb's write-through is held before
    it writes. A kill now must find va (or v0) on NVMe: vb's put has not returned. Deleting va's
    record as stale before vb's landed left nothing (the crash campaign's 'lost committed entry',
    2026-12-07: daemon round 70 of `--seed 20261207`)."""
    cache, cfg = make_cache(host_bytes=4 * MiB, nvme_bytes=4 * MiB, write_through=True)
    va, vb = filled(100 * KiB, 1), filled(150 * KiB, 2)
    cache.put("K", filled(64 * KiB, 0))
    held_a = HeldWrite(monkeypatch, "K", "after-commit")
    ta, box_a = start(cache.put, "K", va)
    held_a.wait()
    tb, box_b = start(cache.put, "K", vb)  # commits into the host, then waits for va's write
    time.sleep(0.2)
    held_b = HeldWrite(monkeypatch, "K", "before-write")  # vb's write-through, once va's is over
    held_a.release.set()
    held_b.wait()
    assert _committed_records(cache) == 1, "no record of K on NVMe while vb's write-through is in flight"
    held_b.release.set()
    join(ta, box_a)  # (va's put returns once vb's write landed: nothing older than va is left then)
    join(tb, box_b)
    _same_after_reopen(cache, cfg, "K", vb)


def test_a_delete_racing_a_demotion_and_a_write_through_leaves_no_record(make_cache, monkeypatch):
    """Write-through: K v0 lives in the host only (its write-through failed); flush() writes it
    and is held before its write; put(K, vb) commits in the host (its write-through registered)
    and waits for that write; delete(K) runs and waits for it too. The write lands after the
    delete forgot K: v0's record is stale and goes before delete returns — it was kept because
    vb's write-through was registered, so a kill after delete returned (vb's put not yet over)
    found v0, a value the completed delete had removed, on NVMe."""
    cache, cfg = make_cache(host_bytes=4 * MiB, nvme_bytes=4 * MiB, write_through=True)
    with testing.fail_writes(cache, "nvme", TierWriteError("injected")):
        cache.put("K", filled(64 * KiB, 0))
    assert testing.where(cache, "K") == {"host"}
    overwriter_deletes = threading.Event()
    real_delete = NvmeTier.delete

    def delete(tier, d, **kw):  # vb's own clean-up (its write-through did not land) waits for the check
        if threading.current_thread().name == "overwriter":
            overwriter_deletes.wait(10)
        return real_delete(tier, d, **kw)

    monkeypatch.setattr(NvmeTier, "delete", delete)
    with testing.hold_writes(cache, "nvme", thread_name="flusher") as gate:
        tf, box_f = start(cache.flush, name="flusher")
        assert gate.wait_held()
        tb, box_b = start(cache.put, "K", filled(100 * KiB, 2), name="overwriter")
        time.sleep(0.2)  # (vb committed in the host; its commit waits for v0's write)
        td, box_d = start(cache.delete, "K")
        time.sleep(0.2)  # (the delete waits for v0's write too)
        gate.release()
        assert join(td, box_d) is True
        assert not nvme_headers_in_lmdb(cache), "a completed delete left an older value on NVMe"
    overwriter_deletes.set()
    join(tf, box_f)
    join(tb, box_b)
    _same_after_reopen(cache, cfg, "K", None)


def test_an_nvme_eviction_of_a_record_just_demoted_forgets_the_key(make_cache, monkeypatch):
    """A (host only: its write-through failed) is the victim of put(C)'s host admission: its
    demotion writes it to NVMe and is held once that write is done, before the host slot is let go.
    put(E) (larger than the host: NVMe directly) evicts A's record meanwhile — the host slot still
    held A then, so the key stayed. Then the demotion reported success and the slot went: A was a
    key of the catalog held by no tier (``contains``/``len`` counted it, ``get`` missed; the stress
    test's ``check_invariants``, ~1 in 500 seed-runs)."""
    cache, _ = make_cache(host_bytes=128 * KiB, nvme_bytes=288 * KiB, write_through=True)
    with testing.fail_writes(cache, "nvme", TierWriteError("injected")):
        cache.put("A", filled(128 * KiB, 1))
    assert testing.where(cache, "A") == {"host"}
    demoted, go = threading.Event(), threading.Event()
    real_demote = NvmeMoves.demote_slot

    def demote_slot(moves, *args, **kw):
        ok = real_demote(moves, *args, **kw)
        if threading.current_thread().name == "evictor" and not kw.get("write_through"):
            demoted.set()
            assert go.wait(10)
        return ok

    monkeypatch.setattr(NvmeMoves, "demote_slot", demote_slot)
    tc, box_c = start(cache.put, "C", filled(64 * KiB, 2), name="evictor")
    assert demoted.wait(10), "A was never demoted"
    assert testing.where(cache, "A") == {"host", "nvme"}
    cache.put("E", filled(129 * KiB, 3))  # NVMe directly: A's record is its victim
    assert testing.where(cache, "A") == {"host"}
    go.set()
    join(tc, box_c)
    assert cache.get("A") is None  # (evicted from both tiers: a cache may drop it)
    assert not cache.contains("A"), "a key held by no tier is still counted"
    assert len(cache) == 2
    testing.check_invariants(cache)


def _until(predicate, timeout_s: float = 10.0) -> None:
    """Poll ``predicate()`` until it holds (AssertionError after ``timeout_s`` seconds)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "the staged state never came"
        time.sleep(0.001)


def test_a_demotion_landing_after_a_delete_and_a_newer_put_leaves_no_record(make_cache, monkeypatch):
    """Write-through: K v0 lives in the host only (its write-through failed); flush() writes it
    and is held before its write; delete(K) forgets K and waits for that write; then put(K, vb)
    commits in the host (its write-through registered, K was absent) and waits for it too. v0's
    write lands: it is stale and goes before delete returns, though vb's write-through is under
    way — that write-through does not replace v0 (K was deleted in between), so keeping v0 until
    it lands (the stress test's watcher, ~1 in 500 seed-runs) let a kill after the delete returned
    find v0, a value the completed delete had removed, on NVMe."""
    cache, cfg = make_cache(host_bytes=4 * MiB, nvme_bytes=4 * MiB, write_through=True)
    vb = filled(100 * KiB, 2)
    with testing.fail_writes(cache, "nvme", TierWriteError("injected")):
        cache.put("K", filled(64 * KiB, 0))
    assert testing.where(cache, "K") == {"host"}
    deleted = threading.Event()
    real_fits = NvmeTier.fits

    def fits(tier, nbytes):  # vb's write-through starts once the delete returned (else it waits for it)
        if threading.current_thread().name == "overwriter":
            assert deleted.wait(10)
        return real_fits(tier, nbytes)

    monkeypatch.setattr(NvmeTier, "fits", fits)
    with testing.hold_writes(cache, "nvme") as gate:
        tf, box_f = start(cache.flush, name="flusher")
        assert gate.wait_held(1)  # v0's write, past its admission
        td, box_d = start(cache.delete, "K")
        _until(lambda: testing.version_of(cache, "K") is None)  # forgotten; the delete waits for v0's write
        tb, box_b = start(cache.put, "K", vb, name="overwriter")
        _until(lambda: testing.version_of(cache, "K") is not None)  # vb committed; it waits for v0's write too
        gate.release(1)
        assert join(td, box_d) is True
        deleted.set()
        assert gate.wait_held(2)  # vb's write-through, before it writes
        assert not nvme_headers_in_lmdb(cache), "a completed delete left an older value on NVMe"
    join(tf, box_f)
    join(tb, box_b)
    _same_after_reopen(cache, cfg, "K", vb)



def test_a_write_behind_whose_record_an_nvme_eviction_took_leaves_the_entry_dirty(make_cache, monkeypatch):
    """Write-back with a write-behind over the whole host: the write-behind writes A to NVMe and is
    held once its store returned, before it marks A's host slot clean; put(E) (larger than the
    host: NVMe directly) evicts A's record meanwhile (the host slot is then A's only copy). The
    write-behind used to mark the slot clean anyway, so its next rounds skipped A for good: A
    stayed in host memory only, never written again. It stays dirty, and is written again."""
    cache, _ = make_cache(host_bytes=3 * MiB // 2, nvme_bytes=2 * MiB, write_behind_fraction=1.0)
    assert testing.write_behind_enabled(cache)
    stored, go = threading.Event(), threading.Event()
    real_store = NvmeMoves.store

    def store(moves, *args, **kw):
        ok = real_store(moves, *args, **kw)
        if threading.current_thread().name == testing.WRITE_BEHIND_THREAD and not stored.is_set():
            stored.set()
            assert go.wait(10)
        return ok

    monkeypatch.setattr(NvmeMoves, "store", store)
    cache.put("A", filled(MiB, 1))
    assert stored.wait(10), "the write-behind never wrote A"
    assert testing.where(cache, "A") == {"host", "nvme"}
    cache.put("E", filled(3 * MiB // 2 + KiB, 3))  # NVMe directly: A's record is its victim
    assert testing.where(cache, "A") == {"host"}
    go.set()
    assert testing.write_behind_idle(cache)
    cache.put("B", filled(4 * KiB, 2))  # a host put: the write-behind's next round
    assert testing.write_behind_idle(cache)
    assert "nvme" in testing.where(cache, "A"), "A was marked clean with no copy on NVMe: never written again"
    assert_same(cache.get("A"), filled(MiB, 1))


class _PausedWriteThroughs:
    """Holds the write-through of the put run on each thread named in ``names`` as it starts (its
    host slot found current and pinned, before its write's admission) until :meth:`release`."""

    def __init__(self, monkeypatch, *names: str) -> None:
        self.entered = {n: threading.Event() for n in names}
        self.go = {n: threading.Event() for n in names}
        real_fits = NvmeTier.fits

        def fits(tier, nbytes):  # (the first step of a write-through's demote_slot)
            name = threading.current_thread().name
            if name in self.entered and not self.entered[name].is_set():
                self.entered[name].set()
                assert self.go[name].wait(30), f"{name}'s write-through never released"
            return real_fits(tier, nbytes)

        monkeypatch.setattr(NvmeTier, "fits", fits)

    def wait(self, name: str) -> None:
        assert self.entered[name].wait(10), f"{name}'s write-through never started"

    def release(self, name: str) -> None:
        self.go[name].set()


def test_a_write_through_overtaken_twice_keeps_the_older_record_until_a_newer_one_lands(make_cache, monkeypatch):
    """Write-through: K v0 is on NVMe. put(K, vb) commits in the host, its write-through held as it
    starts; put(K, vc) commits and is held likewise; vb's write-through goes on — vb is not current,
    nothing is written — and waits for vc's. Only then put(K, vd) commits (held likewise), and vc's
    write-through goes on: not current either, nothing written; it waits for vd's. vb waited only
    for the newer write-throughs under way when its wait began ({vc}): once vc's ended it deleted
    v0 as older than vb, and LMDB held no record of K until vd's landed — a kill then lost K though
    put(K, v0) had completed (the stress test's watcher, nvme-roomy, ~1 in 500 seed-runs). vb now
    waits while a newer write-through is under way and NVMe holds nothing as new as vb."""
    cache, cfg = make_cache(host_bytes=4 * MiB, nvme_bytes=4 * MiB, write_through=True)
    vd = filled(120 * KiB, 4)
    cache.put("K", filled(64 * KiB, 0))
    paused = _PausedWriteThroughs(monkeypatch, "b", "c", "d")
    waiting: list[str] = []
    with before_write_through_wait(cache, lambda d, v: waiting.append(threading.current_thread().name)):
        tb, box_b = start(cache.put, "K", filled(100 * KiB, 1), name="b")
        paused.wait("b")  # vb committed in the host
        tc, box_c = start(cache.put, "K", filled(110 * KiB, 2), name="c")
        paused.wait("c")  # vc committed: vb is not current
        paused.release("b")
        _until(lambda: "b" in waiting)  # vb wrote nothing and waits (a commit from now on comes after)
        td, box_d = start(cache.put, "K", vd, name="d")
        paused.wait("d")  # vd committed: vc is not current
        paused.release("c")
        _until(lambda: "c" in waiting)  # vc wrote nothing and waits for vd's write-through
        tb.join(1.0)
        headers = nvme_headers_in_lmdb(cache)
        assert [h.shape[0] for h in headers.values()] == [64 * KiB], (
            "LMDB held no record of K while vd's write-through was under way, though put(K, v0) completed")
        assert tb.is_alive(), "put(K, vb) returned with only an older record on NVMe"
        paused.release("d")
        join(td, box_d)
        join(tc, box_c)
        join(tb, box_b)
    _same_after_reopen(cache, cfg, "K", vd)
