"""The NVMe tier's payload reads (ectier/tiers/nvme_reader.py): chunk plans, the one-pass read and
checksum on one thread and on two (``nvme.read_threads=2``), the views a read lands in, and the
checks of every read with a helper thread copying part of the payload."""

from __future__ import annotations

import dataclasses
import os
import threading
import time

import numpy as np
import pytest
import torch
import xxhash

import nvme_helpers as nh
from conftest import MiB, make_config
from ectier import TieredCache, testing
from ectier.config import CacheConfig, NvmeTierConfig
from ectier.errors import ConfigError, CorruptRecordError
from ectier.tiers.nvme_reader import PARALLEL_MIN_BYTES, ByteViews, ReadHelper, plan_chunks, read_hashed

KiB = 1 << 10
BLOCK = 64 * KiB


def _file(tmp_path, nbytes: int, seed: int = 0) -> tuple[int, np.ndarray]:
    data = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    path = tmp_path / f"seg-{seed}"
    path.write_bytes(data.tobytes())
    fd = os.open(path, os.O_RDONLY)
    return fd, data


def test_plan_chunks_follow_extents_and_buffers():
    a, b = bytearray(100 * KiB), bytearray(92 * KiB)
    chunks = plan_chunks(((2, 1), (10, 2)), [memoryview(a), memoryview(b)], BLOCK, 48 * KiB)
    assert [(off, len(mv)) for off, mv in chunks] == [
        (2 * BLOCK, 48 * KiB), (2 * BLOCK + 48 * KiB, 16 * KiB),  # extent 1 (64 KiB) ends inside a
        (10 * BLOCK, 36 * KiB),  # the rest of a
        (10 * BLOCK + 36 * KiB, 48 * KiB), (10 * BLOCK + 84 * KiB, 44 * KiB),  # b
    ]
    with pytest.raises(CorruptRecordError, match="fewer bytes"):
        plan_chunks(((2, 1),), [memoryview(a)], BLOCK, 48 * KiB)


@pytest.mark.parametrize("nbytes", [512 * KiB, 1 * MiB + 3, 5 * MiB])
def test_two_thread_read_lands_every_byte_and_hashes_in_order(tmp_path, nbytes):
    fd, data = _file(tmp_path, 7 * MiB)
    helper = ReadHelper()
    try:
        want = xxhash.xxh3_64_intdigest(data[BLOCK:BLOCK + nbytes])
        for i in range(30):  # the helper takes a different share each time
            out = np.zeros(nbytes, dtype=np.uint8)
            chunks = plan_chunks(((1, 100),), [memoryview(out)], BLOCK, 128 * KiB)
            assert read_hashed(fd, chunks, helper if i % 3 else None) == want
            assert np.array_equal(out, data[BLOCK:BLOCK + nbytes])
    finally:
        helper.close()
        os.close(fd)


def test_two_thread_read_of_a_truncated_file_raises_after_the_helper_is_done(tmp_path):
    fd, data = _file(tmp_path, 2 * MiB)
    helper = ReadHelper()
    try:
        for _ in range(10):
            out = np.zeros(3 * MiB, dtype=np.uint8)
            chunks = plan_chunks(((0, 48),), [memoryview(out)], BLOCK, 256 * KiB)
            with pytest.raises(CorruptRecordError, match="truncated"):
                read_hashed(fd, chunks, helper)
            out2 = out.copy()
            assert np.array_equal(out, out2)  # nothing writes into out after the call returned
        out = np.zeros(2 * MiB, dtype=np.uint8)  # the helper still serves reads
        chunks = plan_chunks(((0, 32),), [memoryview(out)], BLOCK, 256 * KiB)
        assert read_hashed(fd, chunks, helper) == xxhash.xxh3_64_intdigest(data)
    finally:
        helper.close()
        os.close(fd)


def test_byte_views_are_the_tensors_bytes_and_follow_a_new_tensor():
    views = ByteViews()
    t = torch.zeros(4096, dtype=torch.uint8)
    mv = views.of(t)
    mv[7] = 9
    assert t[7] == 9 and views.of(t) is mv
    u = torch.zeros(2048, dtype=torch.uint8)
    views.of(u)[0] = 1
    assert u[0] == 1 and t[0] == 0
    for _ in range(ByteViews.LIMIT + 5):  # bounded
        views.of(torch.empty(64, dtype=torch.uint8))
    assert views.of(t)[7] == 9


def test_read_threads_is_checked():
    assert NvmeTierConfig(path="/tmp/x", read_threads=2).read_threads == 2
    for bad in (0, 3, "2", 1.5):
        with pytest.raises(ConfigError, match="nvme.read_threads"):
            NvmeTierConfig(path="/tmp/x", read_threads=bad)


@pytest.mark.parametrize("read_threads", [1, 2])
def test_reads_with_a_helper_thread_round_trip_and_catch_a_flipped_byte(make_cache, tmp_path, read_threads):
    cache, _ = make_cache(host_bytes=0, nvme_bytes=48 * MiB, read_threads=read_threads)
    big = PARALLEL_MIN_BYTES  # read on two threads with read_threads=2
    vals = {k: torch.randint(0, 256, (n,), dtype=torch.uint8) for k, n in
            (("a", big + 3 * MiB + 17), ("b", 700 * KiB), ("c", 100 * KiB), ("d", big))}
    for k, t in vals.items():
        cache.put(k, t)
    for _ in range(3):
        for k, t in vals.items():
            assert torch.equal(cache.get(k), t)
            out = torch.empty_like(t)
            assert cache.get(k, out=out) is out and torch.equal(out, t)
    store, env = testing.tier(cache, "nvme").path, testing.lmdb_of(cache).env
    for pos in (5, -5):  # a byte of the first chunk (the caller's) and of the last (either thread's)
        nh.flip_payload_byte(store, nh.index_value(store, "a" if pos > 0 else "d", env=env), pos=pos)
    assert cache.get("a") is None and cache.get("d") is None
    assert cache.stats()["tiers"]["nvme"]["checksum_failures"] == 2
    assert torch.equal(cache.get("b"), vals["b"]) and torch.equal(cache.get("c"), vals["c"])


def test_prefetch_threads_is_checked():
    assert CacheConfig(prefetch_threads=3).prefetch_threads == 3
    assert CacheConfig.from_dict({"prefetch_threads": None}).prefetch_threads is None
    for bad in (0, -1, "2", 1.5, True, 65, 10**9):
        with pytest.raises(ConfigError, match="prefetch_threads"):
            CacheConfig(prefetch_threads=bad)


@pytest.mark.parametrize("configured", [1, 2])
def test_background_promotions_keep_to_prefetch_threads_cores(tmp_path, monkeypatch, configured):
    """At most ``prefetch_threads`` promotions read at once, each on its own thread (no helper even
    with ``nvme.read_threads=2``), so a co-located engine keeps the other cores; a caller's own
    get of a large NVMe entry still reads with the helper."""
    import ectier.tiers.nvme_segment as seg

    lock, running, seen = threading.Lock(), [0], []  # seen: (thread name, helper given, reads at once)
    real = seg.read_hashed

    def watched(fd, chunks, helper=None):
        with lock:
            running[0] += 1
            seen.append((threading.current_thread().name, helper is not None, running[0]))
        try:
            time.sleep(0.05)  # long enough that a second pool thread would start its read meanwhile
            return real(fd, chunks, helper)
        finally:
            with lock:
                running[0] -= 1

    cfg = dataclasses.replace(make_config(tmp_path / "nvme", host_bytes=64 * MiB, nvme_bytes=64 * MiB, read_threads=2,
                                          write_through=True),
                              prefetch_threads=configured)
    vals = {f"k{i}": torch.randint(0, 256, (PARALLEL_MIN_BYTES,), dtype=torch.uint8) for i in range(4)}
    with TieredCache(cfg) as cache:
        for k, t in vals.items():
            cache.put(k, t)
        assert testing.drain(cache)
        for k in vals:
            assert testing.drop_copy(cache, "host", k) and testing.where(cache, k) == {"nvme"}
        monkeypatch.setattr(seg, "read_hashed", watched)
        for h in cache.prefetch(list(vals)):
            assert h.wait(30)
        background = [s for s in seen if s[0].startswith("ectier-prefetch")]
        assert len(background) == 4 and not any(helper for _, helper, _ in background)
        assert max(n for _, _, n in background) <= configured
        assert len({name for name, _, _ in background}) <= configured
        assert testing.drop_copy(cache, "host", "k0")
        seen.clear()
        assert torch.equal(cache.get("k0"), vals["k0"])
        assert [s[0] for s in seen] == [threading.current_thread().name]
        assert seen[0][1] == (len(os.sched_getaffinity(0)) >= 2)


@pytest.mark.parametrize("cpu_max,cap", [("200000 100000\n", 2), ("50000 100000\n", 1), ("150000 100000\n", 2),
                                         ("max 100000\n", None), ("garbage\n", None), (None, None)])
def test_usable_cpus_is_the_affinity_capped_by_a_cgroup_quota(tmp_path, cpu_max, cap):
    """A container limited to 2 CPUs on a larger machine gets the background threads of 2 CPUs."""
    from ectier.cpus import background_threads, usable_cpus

    path = tmp_path / "cpu.max"
    if cpu_max is not None:
        path.write_text(cpu_max)
    affinity = len(os.sched_getaffinity(0))
    assert usable_cpus(str(path)) == (affinity if cap is None else min(affinity, cap))
    assert background_threads(3) == 3 and background_threads(None) in (1, 2)
