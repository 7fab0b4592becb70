"""The NVMe tier's read path (issue 12's speed goals): scatter reads into a host slot's runs, the
fused read + xxh3 over several buffers, and that none of it weakens the checks of a read."""

from __future__ import annotations

import pytest
import torch

from ectier import InvalidTensorError, TieredCache, testing, testing_internals
from ectier.tiers.host import HostTier
from ectier.tiers.nvme_segment import BLOCK_BYTES

from conftest import KiB, MiB, assert_same, check_quiescent, digest, filled, host_holds, make_config, nvme_holds

import nvme_helpers as nh


def _split(nbytes: int, cuts: list[int]) -> list[torch.Tensor]:
    """Flat uint8 buffers of the lengths between ``cuts`` (0 < cut < nbytes), filled with junk."""
    edges = [0, *cuts, nbytes]
    return [torch.full((b - a,), 0xEE, dtype=torch.uint8) for a, b in zip(edges, edges[1:])]


@pytest.mark.parametrize("codec", ["raw", "zstd"])
@pytest.mark.parametrize("cuts", [[1], [BLOCK_BYTES], [1000, 3 * BLOCK_BYTES + 7, 3 * BLOCK_BYTES + 8]])
def test_read_into_runs_fills_them_in_order(make_cache, codec, cuts):
    """``NvmeTier.read(runs=)`` fills buffers whose lengths sum to the entry with its bytes, in
    order (runs that cut through 64 KiB blocks and 1 MiB chunks alike), and returns no tensor."""
    cache, _ = make_cache(host_bytes=0, nvme_bytes=8 * MiB, codec=codec)
    k = filled(5 * BLOCK_BYTES + 123, 3)
    cache.put("K", k)
    runs = _split(k.numel(), cuts)
    header, data = testing.tier(cache, "nvme").read(digest("K"), "test", "K", runs=runs)
    assert data is None and header.raw_nbytes == k.numel()
    assert_same(torch.cat(runs), k)
    check_quiescent(cache)


def test_read_into_runs_of_another_size_reads_a_new_tensor(make_cache):
    """Runs that do not add up to the entry are not written; the bytes come back in a new tensor."""
    cache, _ = make_cache(host_bytes=0, nvme_bytes=4 * MiB)
    k = filled(3 * BLOCK_BYTES, 5)
    cache.put("K", k)
    runs = _split(k.numel() - 1, [BLOCK_BYTES])
    _, data = testing.tier(cache, "nvme").read(digest("K"), "test", "K", runs=runs)
    assert_same(data, k)
    assert all(bool((r == 0xEE).all()) for r in runs)


def test_damaged_payload_read_into_runs_is_a_miss_and_quarantined(make_cache, tmp_path):
    """The scatter read checks the payload's xxh3 like every read: a flipped byte is a miss."""
    cache, _ = make_cache(host_bytes=0, nvme_bytes=4 * MiB)
    k = filled(3 * BLOCK_BYTES, 7)
    cache.put("K", k)
    nv = testing.tier(cache, "nvme")
    nh.flip_payload_byte(tmp_path / "nvme", nh.index_value(tmp_path / "nvme", "K", env=testing.lmdb_of(nv).env),
                         2 * BLOCK_BYTES + 5)
    assert nv.read(digest("K"), "test", "K", runs=_split(k.numel(), [BLOCK_BYTES])) is None
    assert set(cache.quarantined()) == {digest("K")}
    assert nv.counters["checksum_failures"] == 1


def test_acquire_of_an_nvme_hit_into_a_slot_of_several_runs_reads_straight_into_them(make_cache, monkeypatch):
    """An NVMe hit promoted into a host slot that is not one run of the arena is read straight into
    its runs (one scatter read, checksum checked), not decoded into a tensor and then copied in."""
    cache, _ = make_cache(host_bytes=4 * 64 * KiB, nvme_bytes=4 * MiB)
    k = filled(2 * 64 * KiB, 1)
    cache.put("K", k)  # host blocks 0-1
    cache.put("A", filled(64 * KiB, 2))
    cache.put("B", filled(64 * KiB, 3))  # host full
    assert testing.write_behind_idle(cache)  # else its pin on K (a write in flight) turns C's eviction to A
    cache.put("C", filled(64 * KiB, 4))  # evicts K (demoted to NVMe): C takes one of its blocks
    assert nvme_holds(cache, "K") and not host_holds(cache, "K")
    cache.delete("B")  # two free blocks, not next to each other
    writes = []
    original = HostTier.write
    monkeypatch.setattr(HostTier, "write", lambda tier, slot, src: (writes.append(slot), original(tier, slot, src)))
    lease = cache.acquire("K")
    assert lease is not None
    try:
        assert len(lease.extents) > 1, "the scenario needs a slot of several runs"
        assert writes == []  # no intermediate tensor copied into the slot
        assert_same(cache.load(lease), k)
    finally:
        cache.release(lease)
    assert cache.stats()["tiers"]["host"]["promotions"] == 1
    check_quiescent(cache)


def test_get_out_of_an_nvme_hit_fills_out_and_refuses_another_dtype(make_cache):
    """get(out=) of an NVMe hit fills the caller's tensor (a flat byte entry: read straight into it);
    an out= of the right byte size but another dtype raises and is left untouched."""
    cache, _ = make_cache(host_bytes=0, nvme_bytes=4 * MiB)
    k = filled(2 * BLOCK_BYTES, 9)
    cache.put("K", k)
    out = torch.zeros_like(k)
    assert cache.get("K", out=out) is out
    assert_same(out, k)
    cache.put("F", torch.arange(BLOCK_BYTES // 4, dtype=torch.float32))
    wrong = torch.zeros(BLOCK_BYTES, dtype=torch.uint8)
    with pytest.raises(Exception, match="out"):
        cache.get("F", out=wrong)
    assert bool((wrong == 0).all())
    check_quiescent(cache)


def test_shared_holds_of_the_rw_lock_exclude_an_exclusive_one(make_cache):
    """``RWLock.shared()`` (every read's guard) still keeps map growth (exclusive) out while held."""
    import threading

    cache, _ = make_cache(host_bytes=0, nvme_bytes=4 * MiB)
    rw = testing_internals.nvme_rw_lock(cache)
    entered = threading.Event()

    def grow():
        with rw.exclusive():
            entered.set()

    with rw.shared():
        with rw.shared():  # shared holds nest
            t = threading.Thread(target=grow)
            t.start()
            assert not entered.wait(0.2)
        assert not entered.wait(0.1)
    assert entered.wait(5)
    t.join(5)


def test_cache_serves_the_scatter_read_after_restart(tmp_path):
    """A promoted entry read through its runs is the key's bytes after a restart too (nothing
    written back by the read)."""
    cfg = make_config(tmp_path / "nvme", host_bytes=4 * 64 * KiB, nvme_bytes=4 * MiB)
    k = filled(2 * 64 * KiB, 11)
    with TieredCache(cfg) as cache:
        cache.put("K", k)
        for i, key in enumerate("ABC"):
            cache.put(key, filled(64 * KiB, 20 + i))
        cache.delete("B")
        lease = cache.acquire("K")
        assert lease is not None
        cache.release(lease)
    with TieredCache(cfg) as again:
        assert_same(again.get("K"), k)


def test_read_into_runs_of_a_payload_in_several_extents(make_cache):
    """A payload the segment file holds in two extents (a hole, then the tail), read into runs that
    cut across both the extent boundary and the 1 MiB checksum chunk: the entry's bytes, in order."""
    cache, _ = make_cache(host_bytes=0, nvme_bytes=4 * MiB)
    cache.put("A", filled(20 * BLOCK_BYTES, 1))
    cache.put("B", filled(4 * BLOCK_BYTES, 2))
    cache.put("C", filled(24 * BLOCK_BYTES, 3))
    cache.delete("B")  # a hole of 4 blocks; 16 free blocks at the end
    k = filled(18 * BLOCK_BYTES - 5, 4)
    cache.put("K", k)
    loc = testing.record_of(cache, "K").location
    assert len(loc.extents) == 2, loc  # the scenario: a hole, then the tail
    runs = _split(k.numel(), [4 * BLOCK_BYTES - 1, 4 * BLOCK_BYTES + 1, MiB + 3])
    _, data = testing.tier(cache, "nvme").read(digest("K"), "test", "K", runs=runs)
    assert data is None
    assert_same(torch.cat(runs), k)
    assert_same(cache.get("K"), k)
    check_quiescent(cache)


def test_get_out_of_a_typed_nvme_hit_is_read_straight_into_out(make_cache):
    """get(out=) of a bf16 entry from NVMe: an out= of its shape and dtype is filled and returned
    itself; one of another shape with as many elements is refused, untouched."""
    cache, _ = make_cache(host_bytes=0, nvme_bytes=4 * MiB)
    t = filled(64 * 1024 * 2, 5).view(torch.bfloat16).view(64, 1024)
    cache.put("T", t)
    out = torch.zeros(64, 1024, dtype=torch.bfloat16)
    got = cache.get("T", out=out)
    assert got is out
    assert_same(out, t)
    flat = torch.zeros(64 * 1024, dtype=torch.bfloat16)
    with pytest.raises(InvalidTensorError, match="out"):
        cache.get("T", out=flat)
    assert not flat.any()
    check_quiescent(cache)
