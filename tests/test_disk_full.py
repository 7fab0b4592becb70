"""A real full disk: the NVMe tier on a small tmpfs mounted by the test (root only; skipped with the
reason otherwise), and the LMDB map ceiling (``nvme.map_max_bytes``) next to a working host tier.

Promise (``docs/operations.md``, "Full map, full disk"): that one write fails with
``TierWriteError`` saying what is full and naming the knob; nothing stored changes; reads, deletes
and the host tier keep working; once space is freed (a file removed, entries deleted) puts succeed
again; a restart serves everything that was stored, nothing quarantined.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
import torch

from ectier import TieredCache, TierWriteError

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


def _fill_until_full(cache, prefix, nbytes, limit=200):
    """Put ``nbytes`` entries until one fails; returns (stored values, the error)."""
    stored = {}
    for i in range(limit):
        t = filled(nbytes, len(stored) + 17 * len(prefix))
        try:
            cache.put(f"{prefix}{i}", t)
        except TierWriteError as exc:
            return stored, exc, f"{prefix}{i}"
        stored[f"{prefix}{i}"] = t
    raise AssertionError(f"the file system never filled up after {limit} puts")


def _snapshot(cache):
    st = cache.stats()["tiers"]
    return len(cache), st["nvme"]["used_bytes"], st["nvme"]["entries"]


@pytest.mark.parametrize("sync", [True, False])
def test_disk_full_fails_that_put_clearly_and_recovers_when_space_frees(small_fs, sync):
    # a budget above the small filesystem's size, on purpose (thin provisioning): the disk fills first
    cfg = make_config(small_fs / "store", host_bytes=0, nvme_bytes=64 * MiB, map_initial_bytes=1 * MiB, sync=sync,
                      thin_provisioning=True)
    filler = small_fs / "filler"
    filler.write_bytes(b"\0" * (3 * MiB))
    cache = TieredCache(cfg)
    try:
        stored, exc, failed = _fill_until_full(cache, "a", 256 * KiB)
        assert len(stored) >= 4
        text = str(exc)
        assert "disk full" in text and str(small_fs / "store") in text and "nvme.capacity_bytes" in text, text
        before = _snapshot(cache)
        with pytest.raises(TierWriteError, match="disk full"):  # again: still a clean error, nothing changes
            cache.put(failed, filled(256 * KiB, 999))
        assert _snapshot(cache) == before
        assert not cache.contains(failed) and cache.get(failed) is None
        st = cache.stats()["tiers"]["nvme"]
        assert st["write_failures"] == 2 and st["write_errors"] == 2
        for k, t in stored.items():  # reads keep working
            assert_same(cache.get(k), t)
        check_quiescent(cache)

        filler.unlink()  # space freed by someone else: puts succeed again
        cache.put(failed, filled(256 * KiB, 5))
        stored[failed] = filled(256 * KiB, 5)
        more, exc2, _ = _fill_until_full(cache, "b", 256 * KiB)
        assert len(more) >= 4 and "disk full" in str(exc2)
        stored.update(more)

        for k in list(stored)[:6]:  # space freed by deleting entries: LMDB reuses their pages
            assert cache.delete(k)
            del stored[k]
        for i in range(4):
            t = filled(256 * KiB, 500 + i)
            cache.put(f"c{i}", t)
            stored[f"c{i}"] = t
        check_quiescent(cache)
    finally:
        cache.close()
    with TieredCache(cfg) as again:  # a restart serves all of it, nothing torn by the failed commits
        st = again.stats()["tiers"]["nvme"]
        assert st["quarantined"] == 0 and len(again) == len(stored)
        for k, t in stored.items():
            assert_same(again.get(k), t)
        check_quiescent(again)


def test_disk_full_keeps_the_host_tier_working(small_fs):
    """With a host tier: entries too large for host fail; host entries keep going in and out;
    a write-through that hits the full disk leaves the entry in host (served, counted, logged)."""
    cfg = make_config(small_fs / "store", host_bytes=1 * MiB, nvme_bytes=64 * MiB, map_initial_bytes=1 * MiB,
                      write_through=True, thin_provisioning=True)
    (small_fs / "filler").write_bytes(b"\0" * (5 * MiB))
    with TieredCache(cfg) as cache:
        big_stored, exc, _ = _fill_until_full(cache, "big", 1280 * KiB)  # larger than host: NVMe only
        assert "disk full" in str(exc)
        failures = cache.stats()["tiers"]["nvme"]["write_failures"]
        small = {f"s{i}": filled(100 * KiB, 300 + i) for i in range(6)}
        for k, t in small.items():
            cache.put(k, t)  # host admits it; the write-through to the full disk fails
        assert cache.stats()["tiers"]["nvme"]["write_failures"] > failures
        assert any(not nvme_holds(cache, k) for k in small)  # (the first ones may fit in free pages)
        for k, t in small.items():
            assert host_holds(cache, k)
            assert_same(cache.get(k), t)
        for k, t in big_stored.items():
            assert_same(cache.get(k), t)
        check_quiescent(cache)
        (small_fs / "filler").unlink()
        cache.put("s-after", filled(100 * KiB, 400))
        assert nvme_holds(cache, "s-after")  # write-through works again


def test_map_ceiling_keeps_the_host_tier_working_and_recovers(make_cache):
    cache, _ = make_cache(host_bytes=256 * KiB, nvme_bytes=16 * MiB, map_initial_bytes=1 * MiB,
                          map_max_bytes=1 * MiB)
    stored, exc, failed = _fill_until_full(cache, "big", 300 * KiB)  # larger than host: NVMe only
    assert "map full" in str(exc) and "nvme.map_max_bytes" in str(exc), str(exc)
    assert 2 <= len(stored) <= 3 and not cache.contains(failed)
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


@pytest.mark.parametrize("nbytes", [200 * KiB, 300 * KiB])
def test_map_ceiling_a_put_after_a_delete_of_the_same_size_succeeds(make_cache, nbytes):
    """Issue 16, item 2: at the map ceiling, the space of a deleted record is reused by the next put
    of the same size. LMDB reuses pages freed by a transaction only after a later one committed, and
    an aborted write does not move that point: the old code failed every such put with
    TierWriteError until some unrelated write committed."""
    cache, cfg = make_cache(host_bytes=0, nvme_bytes=16 * MiB, map_initial_bytes=1 * MiB, map_max_bytes=1 * MiB)
    stored, exc, failed = _fill_until_full(cache, "k", nbytes)
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


def test_short_write_eio_is_named_disk_full_only_when_the_disk_is_full(tmp_path, monkeypatch):
    """LMDB turns a short page write (a file system filling up mid-commit) into EIO: the tier tells
    a full disk from another I/O error by the free space (regression: it said 'write failed ...
    Input/output error' on a full disk, naming neither the cause nor a knob)."""
    import lmdb

    from ectier.config import NvmeTierConfig
    from ectier.tiers.nvme import NvmeTier

    tier = NvmeTier(NvmeTierConfig(path=str(tmp_path / "t"), capacity_bytes=1 * MiB, sync=False))
    try:
        exc = lmdb.Error("mdb_txn_commit: Input/output error")
        monkeypatch.setattr(tier, "_free_disk_bytes", lambda: 4096)
        text = tier._write_error_text(exc, 100 * KiB)
        assert "disk full" in text and "nvme.capacity_bytes" in text and "4096 bytes free" in text
        monkeypatch.setattr(tier, "_free_disk_bytes", lambda: 10 * 1 << 30)
        text = tier._write_error_text(exc, 100 * KiB)
        assert "disk full" not in text and "Input/output error" in text
    finally:
        tier.close()
