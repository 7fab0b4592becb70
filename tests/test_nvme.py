"""NVMe tier contract, through TieredCache: restart, flush and write-through. Damage and quarantine:
test_nvme_damage.py; codecs and the LMDB map: test_nvme_codecs.py; opening, locking and the
tier's versions: test_nvme_open.py. Helpers: tests/nvme_helpers.py."""

from __future__ import annotations

import pytest
import torch

from ectier import TieredCache, TierWriteError

from conftest import (
    KiB,
    MiB,
    assert_same,
    check_quiescent,
    digest,
    filled,
    host_holds,
    make_config,
    nvme_holds,
    random_tensor,
)
from ectier import testing

from nvme_helpers import reopen, run_child


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
