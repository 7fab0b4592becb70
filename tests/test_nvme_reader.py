"""The NVMe tier's payload reads (ectier/tiers/nvme_reader.py): chunk plans, the one-pass read and
checksum on one thread and on two (``nvme.read_threads=2``), the views a read lands in, and the
checks of every read with a helper thread copying part of the payload."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import xxhash

import nvme_helpers as nh
from conftest import MiB
from ectier import testing
from ectier.config import NvmeTierConfig
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
