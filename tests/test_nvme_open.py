"""Opening an NVMe store, through TieredCache: directory locking (in this process and another),
paths that cannot be a store, a store of another format, a truncated ``data.mdb``; and the tier's
record versions (an older record never replaces or removes a newer one)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from ectier import StoreLockedError, StoreOpenError, TieredCache, testing_internals

from conftest import MiB, assert_same, digest, filled, make_config, open_lmdb

from nvme_helpers import put_three, run_child


# ============================================================================ opening


def test_second_cache_on_same_directory_in_process_is_locked(make_cache, tmp_path):
    cache, cfg = make_cache()
    cache.put("k", torch.ones(3))
    with pytest.raises(StoreLockedError, match="nvme.path: .* in use by another TieredCache in this process"):
        TieredCache(cfg)
    assert_same(cache.get("k"), torch.ones(3))  # the failed open did not disturb the owner
    cache.put("k2", torch.zeros(2))
    cache.close()
    with TieredCache(cfg) as again:
        assert_same(again.get("k"), torch.ones(3))
        assert_same(again.get("k2"), torch.zeros(2))


CHILD_HOLD = """
import sys
from ectier import CacheConfig, HostTierConfig, NvmeTierConfig, TieredCache
cache = TieredCache(CacheConfig(namespace="test", host=HostTierConfig(capacity_bytes=0),
                                nvme=NvmeTierConfig(path=sys.argv[1], capacity_bytes=1 << 20, sync=False)))
print("ready", flush=True)
sys.stdin.read()
cache.close()
"""


def test_directory_held_by_another_process_is_locked(tmp_path):
    path = tmp_path / "held"
    child = run_child(CHILD_HOLD, str(path))
    try:
        line = child.stdout.readline()
        assert line.strip() == "ready", child.stderr.read()
        with pytest.raises(StoreLockedError, match="nvme.path: .* in use by another process;"):
            TieredCache(make_config(path))
    finally:
        child.stdin.close()
        child.wait(timeout=60)
    assert child.returncode == 0
    with TieredCache(make_config(path)) as cache:  # released when the owner closed
        cache.put("k", torch.ones(1))


def test_path_is_a_regular_file(tmp_path):
    f = tmp_path / "file"
    f.write_bytes(b"x")
    with pytest.raises(StoreOpenError, match="nvme.path"):
        TieredCache(make_config(f))
    with pytest.raises(StoreOpenError, match="nvme.path"):
        TieredCache(make_config(f / "sub"))
    assert f.read_bytes() == b"x"


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root ignores permissions")
def test_unwritable_directory(tmp_path):
    d = tmp_path / "ro"
    d.mkdir()
    d.chmod(0o500)
    try:
        with pytest.raises(StoreOpenError, match="nvme.path"):
            TieredCache(make_config(d))
        with pytest.raises(StoreOpenError, match="nvme.path"):
            TieredCache(make_config(d / "sub"))
    finally:
        d.chmod(0o700)


def test_uncreatable_directory():
    with pytest.raises(StoreOpenError, match="nvme.path"):
        TieredCache(make_config("/proc/ectier-cannot-exist/store"))


def _set_format(store_dir, value: bytes) -> None:
    env, meta, data, quarantine, settings = open_lmdb(store_dir)
    try:
        with env.begin(write=True) as txn:
            txn.put(b"format", value, db=settings)
    finally:
        env.close()


def test_store_of_another_format_is_refused_and_released(make_cache, tmp_path):
    cfg, vals = put_three(make_cache)
    _set_format(tmp_path / "nvme", b"99")
    with pytest.raises(StoreOpenError, match="format"):
        TieredCache(cfg)
    _set_format(tmp_path / "nvme", b"2")
    with TieredCache(cfg) as again:  # the failed open released the directory lock
        assert_same(again.get("a"), vals["a"])


# ============================================================================ tier level


def test_quarantine_of_an_old_header_keeps_a_newer_record(tmp_path):
    """A reader that found version 1 damaged quarantines it after version 2 was written: version 2
    stays in service (LMDB and the tier's in-memory index agree)."""
    from ectier.config import NvmeTierConfig
    from ectier.entry import EntryMeta, next_version
    from ectier.tiers.nvme import NvmeTier

    tier = NvmeTier(NvmeTierConfig(path=str(tmp_path / "t"), capacity_bytes=1 * MiB, sync=False))
    try:
        d = digest("k")
        meta = EntryMeta("test", "k", "uint8", (4096,), 4096)
        r1 = tier.encode(meta, filled(4096, 1), next_version())
        assert tier.write(d, r1)
        r2 = tier.encode(meta, filled(4096, 2), next_version())
        assert tier.write(d, r2)
        tier.quarantine(d, r1.header_bytes, "test: stale reader")
        assert tier.record(d) is not None and tier.record(d).version == r2.header.version
        assert tier.used_bytes == tier.stored_bytes(r2)
        assert tier.quarantined() == {}
        header, data = tier.read(d, "test", "k")
        assert header.version == r2.header.version
        assert bytes(data.numpy()) == bytes(filled(4096, 2).numpy())
        # an older write never replaces a newer record
        assert tier.write(d, r1) is False
        assert tier.record(d).version == r2.header.version
        # deleting by an old version leaves the newer record alone
        assert tier.delete(d, only_version=r1.header.version) is False
        assert tier.record(d) is not None
        assert tier.delete(d, only_version=r2.header.version) is True
        assert tier.record(d) is None and tier.used_bytes == 0
    finally:
        tier.close()


def test_overwrite_after_restart_with_the_clock_behind(make_cache, tmp_path):
    import time

    cache, cfg = make_cache(host_bytes=0)
    cache.put("k", filled(4096, 1))
    cache.close()
    # a new process (fresh version counter) on a host whose wall clock is now one hour behind
    with testing_internals.version_clock(lambda: time.time_ns() - 3600 * 10**9, last=0):
        with TieredCache(cfg) as again:
            again.put("k", filled(4096, 2))
            assert_same(again.get("k"), filled(4096, 2))


_TRUNCATE_SCRIPT = """
import os, sys, torch
from ectier import CacheConfig, HostTierConfig, NvmeTierConfig, StoreOpenError, TieredCache
cfg = CacheConfig(host=HostTierConfig(capacity_bytes=0), nvme=NvmeTierConfig(path=sys.argv[1], sync=False))
with TieredCache(cfg) as c:
    for i in range(24):
        c.put(f"k{i}", torch.full((64 * 1024,), i, dtype=torch.uint8))
data = os.path.join(sys.argv[1], "lmdb", "data.mdb")
os.truncate(data, os.path.getsize(data) // int(sys.argv[2]))
try:
    TieredCache(cfg)
except StoreOpenError as exc:
    assert "truncated" in str(exc) and "nvme.path" in str(exc), exc
    print("REFUSED")
else:
    print("OPENED")
"""


@pytest.mark.parametrize("fraction", [2, 3])
def test_truncated_data_file_is_refused_at_open_not_a_sigbus(tmp_path, fraction):
    """A data.mdb shorter than LMDB's last page would SIGBUS on the first read through the map;
    the tier must refuse it at open with a clear error (run in a child so a SIGBUS cannot take
    pytest down)."""
    proc = subprocess.run([sys.executable, "-c", _TRUNCATE_SCRIPT, str(tmp_path / "store"), str(fraction)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert proc.stdout.strip() == "REFUSED"
