"""TieredCache overwrite and eviction across host -> NVMe: an overwrite replaces the old value in
every tier, LRU eviction by bytes, demotion and promotion, entries too large for a tier, NVMe
budgets, failed demotions. CPU only; small budgets (64 KiB blocks)."""

from __future__ import annotations

import dataclasses
import errno

import pytest
import torch

from ectier import EntryTooLargeError, TieredCache

from conftest import (
    KiB,
    MiB,
    NVME_SLACK,
    assert_same,
    check_budgets,
    check_quiescent,
    digest,
    filled,
    host_holds,
    nvme_holds,
    random_tensor,
)
from ectier import testing


# ============================================================================ overwrite


def test_overwrite_in_host_replaces(make_cache):
    cache, _ = make_cache()
    old, new = random_tensor((4, 8192), torch.bfloat16, 1), random_tensor((3, 5), torch.float32, 2)
    cache.put("k", old)
    cache.put("k", new)
    assert len(cache) == 1
    assert_same(cache.get("k"), new)
    st = cache.stats()["tiers"]["host"]
    assert st["entries"] == 1 and st["used_bytes"] == 64 * KiB
    check_quiescent(cache)


def test_overwrite_then_demote_serves_new_and_nvme_holds_new(make_cache):
    cache, cfg = make_cache(host_bytes=128 * KiB)
    old, new = random_tensor((2, 8192), torch.bfloat16, 1), random_tensor((3, 40), torch.int64, 2)
    cache.put("k", old)
    cache.put("k", new)
    cache.put("f1", filled(64 * KiB, 1))
    assert testing.write_behind_idle(cache)  # else its pin on k (a write in flight) turns f2's eviction to f1
    cache.put("f2", filled(64 * KiB, 2))  # k (LRU) is demoted
    assert not host_holds(cache, "k") and nvme_holds(cache, "k")
    hdr = testing.tier(cache, "nvme").record(digest("k")).header
    assert (hdr.dtype, tuple(hdr.shape)) == ("int64", (3, 40))
    assert hdr.version == testing.version_of(cache, "k")  # the NVMe record is the current version
    assert_same(cache.get("k"), new)
    cache.close()
    reopened = TieredCache(cfg)
    try:
        assert_same(reopened.get("k"), new)
    finally:
        reopened.close()


@pytest.mark.parametrize("flush_on_close", [True, False])
def test_overwrite_of_nvme_entry_removes_old_record(make_cache, flush_on_close):
    """Old bytes in NVMe, new bytes put to host: the NVMe record is removed at once, so a restart
    never serves the old version (without flush, the key is simply gone)."""
    cache, cfg = make_cache(host_bytes=128 * KiB, flush_on_close=flush_on_close)
    old, new = filled(64 * KiB, 1), random_tensor((5, 7), torch.float16, 3)
    cache.put("k", old)
    cache.put("f1", filled(64 * KiB, 2))
    assert testing.write_behind_idle(cache)  # else its pin on k (a write in flight) turns f2's eviction to f1
    cache.put("f2", filled(64 * KiB, 3))
    assert nvme_holds(cache, "k") and not host_holds(cache, "k")
    cache.put("k", new)
    assert host_holds(cache, "k")
    assert not nvme_holds(cache, "k")
    assert_same(cache.get("k"), new)
    cache.close()
    reopened = TieredCache(cfg)
    try:
        got = reopened.get("k")
        if flush_on_close:
            assert_same(got, new)
            assert testing.tier(reopened, "nvme").record(digest("k")).header.dtype == "float16"
        else:
            assert got is None
    finally:
        reopened.close()


def test_overwrite_host_entry_with_entry_too_large_for_host(make_cache):
    cache, cfg = make_cache(host_bytes=256 * KiB, nvme_bytes=2 * MiB)
    old, new = filled(64 * KiB, 1), filled(320 * KiB, 2)
    cache.put("k", old)
    cache.put("other", filled(64 * KiB, 3))
    cache.put("k", new)  # skips host, goes to NVMe; the host copy must go
    assert not host_holds(cache, "k")
    assert nvme_holds(cache, "k")
    assert_same(cache.get("k"), new)
    assert cache.stats()["tiers"]["host"]["entries"] == 1
    cache.close()
    reopened = TieredCache(cfg)
    try:
        assert_same(reopened.get("k"), new)
        assert_same(reopened.get("other"), filled(64 * KiB, 3))
    finally:
        reopened.close()


def test_overwrite_large_nvme_entry_when_nvme_fits_only_one(make_cache):
    """Replacing a key whose old record fills most of the NVMe budget: the old record is replaced,
    so the new one fits; the put must not fail."""
    size = 300 * KiB
    cache, cfg = make_cache(host_bytes=0, nvme_bytes=size + NVME_SLACK)
    cache.put("k", filled(size, 1))
    cache.put("k", filled(size, 2))
    assert_same(cache.get("k"), filled(size, 2))
    check_budgets(cache)
    check_quiescent(cache)


# ============================================================================ eviction

BLK = 64 * KiB


def test_host_lru_get_touches(make_cache):
    cache, _ = make_cache(host_bytes=4 * 2 * BLK, nvme=False)  # room for 4 entries of 2 blocks
    for k in "abcd":
        cache.put(k, filled(2 * BLK, ord(k)))
    assert cache.get("a") is not None  # a becomes most recently used; b is now the LRU
    cache.put("e", filled(2 * BLK, ord("e")))
    assert [cache.contains(k) for k in "abcde"] == [True, False, True, True, True]
    st = cache.stats()["tiers"]["host"]
    assert (st["evictions"], st["drops"], st["demotions"]) == (1, 1, 0)
    assert st["used_bytes"] == 8 * BLK


def test_host_lru_evicts_by_bytes_from_the_lru_end(make_cache):
    cache, _ = make_cache(host_bytes=8 * BLK, nvme=False)
    for k, blocks in (("a", 1), ("b", 1), ("c", 4), ("d", 2)):
        cache.put(k, filled(blocks * BLK, ord(k)))
    assert cache.stats()["tiers"]["host"]["used_bytes"] == 8 * BLK
    cache.put("e", filled(3 * BLK, ord("e")))  # needs 3 blocks: a(1) + b(1) is short, + c(4) covers it
    assert [cache.contains(k) for k in "abcde"] == [False, False, False, True, True]
    st = cache.stats()["tiers"]["host"]
    assert st["evictions"] == 3 and st["used_bytes"] == 5 * BLK
    cache.put("f", filled(3 * BLK, ord("f")))  # 3 blocks free: no eviction
    assert cache.stats()["tiers"]["host"]["evictions"] == 3
    assert all(cache.contains(k) for k in "def")


def test_overwrite_in_full_host(make_cache):
    cache, _ = make_cache(host_bytes=4 * BLK, nvme=False)
    for k in "abcd":
        cache.put(k, filled(BLK, ord(k)))
    cache.put("d", filled(BLK, 99))
    assert_same(cache.get("d"), filled(BLK, 99))
    assert len(cache) >= 3  # at most one other entry may be dropped to make room
    for k in "abc":
        if cache.contains(k):
            assert_same(cache.get(k), filled(BLK, ord(k)))
    assert cache.stats()["tiers"]["host"]["used_bytes"] == len(cache) * BLK  # the old d's block is free
    check_quiescent(cache)


def test_demotion_and_promotion(make_cache):
    cache, _ = make_cache(host_bytes=2 * 2 * BLK, nvme_bytes=2 * MiB,  # host: 2 entries of 2 blocks
                          write_behind_fraction=0)  # victims written on eviction
    vals = {k: filled(2 * BLK, i) for i, k in enumerate("abc")}
    for k in "abc":
        cache.put(k, vals[k])
    # a was the LRU: demoted to NVMe, not lost
    assert not host_holds(cache, "a") and nvme_holds(cache, "a")
    assert host_holds(cache, "b") and host_holds(cache, "c")
    st = cache.stats()["tiers"]
    assert (st["host"]["evictions"], st["host"]["demotions"], st["host"]["drops"]) == (1, 1, 0)
    assert st["nvme"]["puts"] == 1 and st["nvme"]["entries"] == 1
    assert len(cache) == 3

    assert_same(cache.get("a"), vals["a"])  # NVMe hit, promoted; b (LRU) demoted to make room
    st = cache.stats()["tiers"]
    assert st["nvme"]["hits"] == 1 and st["nvme"]["hit_bytes"] == 2 * BLK
    assert st["host"]["promotions"] == 1
    assert host_holds(cache, "a") and host_holds(cache, "c") and not host_holds(cache, "b")
    assert nvme_holds(cache, "b")
    assert_same(cache.get("a"), vals["a"])  # now a host hit
    assert cache.stats()["tiers"]["host"]["hits"] == 1
    for k in "abc":
        assert_same(cache.get(k), vals[k])
    check_budgets(cache)
    check_quiescent(cache)


def test_promotion_keeps_the_entry_just_read(make_cache):
    """Promoting an NVMe hit demotes host victims, which may need NVMe room. The entry just read
    (the most recently used one) must not be what gets dropped to make that room."""
    a, h = filled(3 * BLK, 1), filled(4 * BLK, 2)
    cache, _ = make_cache(host_bytes=4 * BLK, nvme_bytes=4 * BLK + NVME_SLACK, write_behind_fraction=0)
    cache.put("A", a)
    cache.put("H", h)  # A demoted to NVMe; NVMe cannot hold A and H together
    assert nvme_holds(cache, "A") and host_holds(cache, "H")
    assert_same(cache.get("A"), a)
    assert cache.contains("A"), "the entry just returned by get was lost"
    assert_same(cache.get("A"), a)
    check_budgets(cache)
    check_quiescent(cache)


def test_entry_larger_than_host_skips_host_without_evicting(make_cache):
    cache, _ = make_cache(host_bytes=4 * BLK, nvme_bytes=2 * MiB)
    small = {k: filled(BLK, i) for i, k in enumerate("abcd")}
    for k, t in small.items():
        cache.put(k, t)
    big = filled(5 * BLK, 9)
    cache.put("big", big)
    st = cache.stats()["tiers"]
    assert st["host"]["skipped_too_large"] == 1
    assert st["host"]["evictions"] == 0 and st["host"]["entries"] == 4
    assert nvme_holds(cache, "big") and not host_holds(cache, "big")
    assert_same(cache.get("big"), big)
    st = cache.stats()["tiers"]
    assert st["host"]["promotions"] == 0 and st["host"]["evictions"] == 0
    for k, t in small.items():
        assert host_holds(cache, k)
        assert_same(cache.get(k), t)


@pytest.mark.parametrize("nvme", [True, False])
def test_entry_larger_than_every_tier_is_refused_before_evicting(make_cache, nvme):
    cache, _ = make_cache(host_bytes=4 * BLK, nvme_bytes=8 * BLK + NVME_SLACK, nvme=nvme)
    small = {k: filled(BLK, i) for i, k in enumerate("abcdef")}
    for k, t in small.items():
        cache.put(k, t)
    testing.drain(cache)  # the write-behind settles first
    before = cache.stats()
    with pytest.raises(EntryTooLargeError) as info:
        cache.put("huge", filled(16 * BLK, 1))
    assert "host.capacity_bytes" in str(info.value)
    if nvme:
        assert "nvme.capacity_bytes" in str(info.value)
    assert cache.stats() == before
    assert not cache.contains("huge")
    for k, t in small.items():
        if cache.contains(k):
            assert_same(cache.get(k), t)
    assert sum(cache.contains(k) for k in small) == (6 if nvme else 4)


def test_nvme_lru_eviction_keeps_budget(make_cache):
    cap = 1 * MiB
    cache, _ = make_cache(host_bytes=0, nvme_bytes=cap)
    size = 128 * KiB  # 7 records fit in 1 MiB (131072 + header each), 8 do not
    for i in range(7):
        cache.put(f"k{i}", filled(size, i))
        check_budgets(cache)
    assert cache.stats()["tiers"]["nvme"]["evictions"] == 0
    assert cache.get("k0") is not None  # touch k0: k1 is now the NVMe LRU
    for i in range(7, 12):
        cache.put(f"k{i}", filled(size, i))
        check_budgets(cache)
    st = cache.stats()["tiers"]["nvme"]
    assert st["evictions"] == 5
    assert st["used_bytes"] <= cap
    assert [cache.contains(f"k{i}") for i in range(12)] == [True] + [False] * 5 + [True] * 6
    for i in [0, *range(6, 12)]:
        assert_same(cache.get(f"k{i}"), filled(size, i))
    check_quiescent(cache)


def test_demotion_chain_drops_when_nvme_full(make_cache):
    """host -> NVMe -> dropped: after many puts only the most recent fit, budgets always hold."""
    cache, _ = make_cache(host_bytes=4 * BLK, nvme_bytes=4 * BLK + NVME_SLACK)
    for i in range(20):
        cache.put(f"k{i}", filled(BLK, i))
        check_budgets(cache)
        # the write-behind's pin on an old entry (a write in flight) would keep it past the next puts
        assert testing.write_behind_idle(cache)
    assert all(cache.contains(f"k{i}") for i in range(16, 20))  # host holds the last 4
    assert not any(cache.contains(f"k{i}") for i in range(8))
    for i in range(20):
        got = cache.get(f"k{i}")
        if got is not None:
            assert_same(got, filled(BLK, i))
    check_quiescent(cache)


def test_reopen_with_smaller_nvme_budget_trims_oldest(make_cache, tmp_path):
    cache, cfg = make_cache(host_bytes=0, nvme_bytes=2 * MiB)
    for i in range(10):
        cache.put(f"k{i}", filled(128 * KiB, i))
    cache.close()
    small = cfg.replace(nvme=dataclasses.replace(cfg.nvme, capacity_bytes=700 * KiB))
    reopened = TieredCache(small)
    try:
        st = reopened.stats()["tiers"]["nvme"]
        assert st["used_bytes"] <= 700 * KiB
        present = [reopened.contains(f"k{i}") for i in range(10)]
        assert present == [False] * 5 + [True] * 5  # 5 records of 128 KiB + header fit in 700 KiB
        for i in range(5, 10):
            assert_same(reopened.get(f"k{i}"), filled(128 * KiB, i))
        check_quiescent(reopened)
    finally:
        reopened.close()


# ============================================================================ failed demotions


@pytest.mark.parametrize("exc", [RuntimeError("injected encode failure"), OSError(errno.EIO, "injected EIO")],
                         ids=["runtime-error", "oserror-eio"])
def test_failed_demotion_is_a_counted_drop_never_an_error_of_the_put(make_cache, monkeypatch, exc):
    """An unexpected error while demoting a victim (raised from outside LMDB, e.g. EIO) is a failed
    move: the put that triggered it succeeds, the victim is dropped and counted, nothing else is
    lost, and no host blocks stay pinned (issue #16, item 4)."""
    from ectier.tiers.nvme import NvmeTier

    cache, _ = make_cache(host_bytes=2 * BLK, write_behind_fraction=0)  # the write at eviction
    cache.put("a", filled(BLK, 1))
    cache.put("b", filled(BLK, 2))
    original = NvmeTier.encode
    calls = []

    def failing_encode(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise exc
        return original(self, *args, **kwargs)

    monkeypatch.setattr(NvmeTier, "encode", failing_encode)
    cache.put("c", filled(BLK, 3))  # evicts a: its demotion fails, the put does not
    assert calls, "the demotion was not attempted"
    check_quiescent(cache)
    assert_same(cache.get("c"), filled(BLK, 3))
    assert_same(cache.get("b"), filled(BLK, 2))
    assert cache.get("a") is None  # the counted victim, and nothing else
    host = cache.stats()["tiers"]["host"]
    assert host["drops"] == 1 and host["demotions"] == 0
    for i in range(3, 7):  # the arena is fully usable again
        cache.put(f"n{i}", filled(BLK, i))
        assert_same(cache.get(f"n{i}"), filled(BLK, i))
    check_quiescent(cache)


def test_eio_from_a_tier_write_during_demotion_keeps_the_put_typed(make_cache):
    """``OSError(EIO)`` from the NVMe tier's write itself (outside LMDB) during a demotion: the
    triggering put of another key succeeds; the victim is a counted drop."""
    cache, _ = make_cache(host_bytes=2 * BLK, write_behind_fraction=0)  # the write at eviction
    cache.put("a", filled(BLK, 1))
    cache.put("b", filled(BLK, 2))
    with testing.fail_writes(cache, "nvme", OSError(errno.EIO, "injected EIO")) as calls:
        cache.put("c", filled(BLK, 3))
    assert calls
    assert cache.get("a") is None and cache.stats()["tiers"]["host"]["drops"] == 1
    assert_same(cache.get("c"), filled(BLK, 3))
    check_quiescent(cache)


def test_a_prefetch_of_a_key_already_in_host_memory_counts_as_a_use():
    """A prefetch is a use in LRU order wherever the key lies: one already in the host tier is
    touched too (it was left the next victim), as one promoted from NVMe is."""
    cfg = {"host": {"capacity_bytes": 4 * 64 * KiB, "block_bytes": 64 * KiB, "pin_memory": False}}
    with TieredCache(cfg) as cache:
        for i, key in enumerate("abcd"):
            cache.put(key, torch.full((16 * KiB,), i, dtype=torch.int32))  # one block each: the arena is full
        assert all(h.wait(5) for h in cache.prefetch(["a"]))
        cache.put("e", torch.full((16 * KiB,), 9, dtype=torch.int32))  # one block of room: the LRU entry goes
        assert cache.contains("a") and not cache.contains("b")
