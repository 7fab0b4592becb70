"""A prefetch of an NVMe entry into the host tier reads the record straight into the host slot
it reserves (checksummed while read): no intermediate tensor and no copy through the host tier's
``write`` (docs/architecture.md, "Promotion"). Whole slots and slots split over several runs of
the arena, a prefetch that cannot make room (the entry stays on NVMe), an ``acquire`` of the key
while the prefetch reads it (it waits for that read rather than missing), and evictions counted
as drops only when an entry is lost."""

from __future__ import annotations

import threading
import time

import torch

from ectier import testing
from ectier.config import CacheConfig, HostTierConfig, NvmeTierConfig

MiB = 1 << 20


def _entry(seed: int, mib: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(-(1 << 15), 1 << 15, (mib * MiB // 2,), dtype=torch.int16, generator=g)


def _cache(tmp_path, host_mib: int, **host):
    return testing.make_cache(CacheConfig(
        namespace="prefetch-into-host",
        host=HostTierConfig(capacity_bytes=host_mib * MiB, pin_memory=False, **host),
        nvme=NvmeTierConfig(path=str(tmp_path / "nvme"), capacity_bytes=64 * MiB, sync=False)))


def _on_nvme_only(cache, key: str, x: torch.Tensor) -> None:
    cache.put(key, x)
    cache.flush()
    assert testing.drop_copy(cache, "host", key)
    assert testing.where(cache, key) == {"nvme"}


def _prefetch(cache, key: str) -> bool:
    (handle,) = cache.prefetch([key])
    return handle.wait(10.0)


def _prefetch_without_host_writes(cache, key: str) -> None:
    """Prefetch ``key`` with the host tier's ``write`` (a copy into a slot) failing: it succeeds
    only if the record is read straight into the slot."""
    with testing.fail_writes(cache, "host", RuntimeError("copied through the host tier")) as calls:
        assert _prefetch(cache, key)
    assert calls == []


def _leased_bytes_equal(cache, key: str, x: torch.Tensor) -> bool:
    lease = cache.acquire(key, promote=False)
    assert lease is not None, "the prefetch left nothing in the host arena"
    try:
        return torch.equal(cache.load(lease).view(torch.int16).flatten(), x)
    finally:
        cache.release(lease)


def test_prefetch_reads_an_nvme_entry_straight_into_its_host_slot(tmp_path):
    cache = _cache(tmp_path, host_mib=8)
    try:
        x = _entry(1, 2)
        _on_nvme_only(cache, "k", x)
        _prefetch_without_host_writes(cache, "k")
        assert testing.holds(cache, "host", "k")
        assert _leased_bytes_equal(cache, "k", x)
        assert cache.stats()["tiers"]["host"]["promotions"] == 1
        testing.check_invariants(cache)
    finally:
        cache.close()


def test_prefetch_into_a_slot_split_over_arena_runs(tmp_path):
    cache = _cache(tmp_path, host_mib=4)
    try:
        for i in range(4):  # the arena full of 1 MiB entries, then every other one deleted
            cache.put(f"small-{i}", _entry(10 + i, 1))
        cache.flush()
        assert cache.delete("small-0") and cache.delete("small-2")
        x = _entry(2, 2)  # fits only in both free runs together
        _on_nvme_only(cache, "big", x)
        _prefetch_without_host_writes(cache, "big")
        # the arena fills free runs before it evicts: the slot is split, the others stay
        assert all(testing.holds(cache, "host", k) for k in ("big", "small-1", "small-3"))
        assert _leased_bytes_equal(cache, "big", x)
        for i in (1, 3):
            assert torch.equal(cache.get(f"small-{i}").view(torch.int16).flatten(), _entry(10 + i, 1))
        testing.check_invariants(cache)
    finally:
        cache.close()


def test_prefetch_that_cannot_make_room_leaves_the_entry_on_nvme(tmp_path):
    cache = _cache(tmp_path, host_mib=4)
    try:
        x = _entry(3, 2)
        _on_nvme_only(cache, "k", x)
        pins = []
        for i in range(2):  # the rest of the arena pinned by readers: nothing can be evicted
            cache.put(f"pinned-{i}", _entry(20 + i, 1))
            pins.append(cache.acquire(f"pinned-{i}", promote=False))
        cache.put("filler", _entry(30, 1))
        filler = cache.acquire("filler", promote=False)
        assert all(p is not None for p in pins) and filler is not None
        try:
            assert _prefetch(cache, "k")  # still stored (on NVMe): the prefetch says so
            assert testing.where(cache, "k") == {"nvme"}
        finally:
            for lease in (*pins, filler):
                cache.release(lease)
        assert torch.equal(cache.get("k").view(torch.int16).flatten(), x)
        testing.check_invariants(cache)
    finally:
        cache.close()


def test_acquire_waits_for_a_prefetch_reading_the_same_key(tmp_path):
    # the entry takes most of the arena: while the prefetch's reservation holds the room, a
    # second copy cannot be admitted; the acquire waits for that read instead of missing
    from slow_nvme_daemon import SlowReads

    cache = _cache(tmp_path, host_mib=4)
    try:
        x = _entry(4, 3)
        _on_nvme_only(cache, "k", x)
        env = testing.lmdb_of(cache).env
        testing.set_lmdb_env(cache, SlowReads(env, 0.5))
        try:
            (handle,) = cache.prefetch(["k"])
            time.sleep(0.2)  # the prefetch is inside its (slow) NVMe read now
            lease = cache.acquire("k")
            assert lease is not None, "acquire missed while a prefetch read the key"
            try:
                assert torch.equal(cache.load(lease).view(torch.int16).flatten(), x)
            finally:
                cache.release(lease)
            assert handle.wait(10.0) and handle.error is None
        finally:
            testing.set_lmdb_env(cache, env)
        assert cache.stats()["tiers"]["nvme"]["hits"] == 1  # read once, by the prefetch
        assert cache.stats()["tiers"]["host"]["admission_timeouts"] == 0  # the acquire waited, admitted nothing
        testing.check_invariants(cache)
    finally:
        cache.close()


def test_evictions_of_replaced_versions_are_not_counted_as_drops(tmp_path):
    # threads overwrite and read keys over a small arena: a victim whose key was overwritten
    # meanwhile is no lost entry (it was counted as a drop: "drops (lost)" without a failure)
    cache = _cache(tmp_path, host_mib=2)
    keys = [f"k{i}" for i in range(12)]
    stop = time.monotonic() + 1.5
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        try:
            while time.monotonic() < stop:
                k = keys[int(torch.randint(len(keys), (1,), generator=g))]
                if torch.rand(1, generator=g).item() < 0.5:
                    cache.put(k, torch.full((int(torch.randint(16, 128, (1,), generator=g)) * 1024,), seed))
                else:
                    cache.get(k)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    try:
        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors
        host, nvme = cache.stats()["tiers"]["host"], cache.stats()["tiers"]["nvme"]
        assert host["evictions"] > 100  # the arena churned
        assert nvme["write_failures"] == 0 and host["drops"] == 0
        assert host["evictions"] == host["demotions"] + host["drops"]
        assert host["evictions"] == host["clean_evictions"] + host["dirty_evictions"]
        testing.check_invariants(cache)
    finally:
        cache.close()


def test_a_prefetch_read_counts_as_a_tier_hit_but_not_as_a_get(tmp_path):
    # what docs/operations.md says of the tiers' hits against the cache's: the NVMe read of a
    # prefetch is an NVMe hit, the get that follows a host hit and the only lookup
    cache = _cache(tmp_path, host_mib=4)
    try:
        x = _entry(7, 1)
        _on_nvme_only(cache, "k", x)
        assert _prefetch(cache, "k")
        assert torch.equal(cache.get("k").view(torch.int16).flatten(), x)
        st = cache.stats()
        assert (st["hits"], st["misses"]) == (1, 0)
        assert st["tiers"]["nvme"]["hits"] == 1 and st["tiers"]["host"]["hits"] == 1
        assert st["tiers"]["host"]["promotions"] == 1
    finally:
        cache.close()
