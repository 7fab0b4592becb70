"""A host arena is faulted in once, in the background from open on, so no put pays first-touch
page faults (``ectier.tiers.populate.populate_later``; a daemon client's mapping:
``populate_mapping_later``).

Residency is read from ``/proc/self/smaps`` (the ``Rss`` of the mapping holding the arena): pages
this process has mapped in. Linux only.
"""

from __future__ import annotations

import mmap
import os
import sys
import time
import weakref

import pytest
import numpy as np
import torch

from ectier.config import HostTierConfig
from ectier.tiers.populate import MADV_POPULATE_READ, populate_later, populate_mapping_later
from ectier.tiers.host import HostTier

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc/self/smaps is Linux's")

MiB = 1 << 20
#: above glibc's largest mmap threshold (32 MiB): the arena is a fresh mapping of its own, never
#: heap pages an earlier test touched
ARENA = 64 * MiB


def _rss_bytes(address: int, nbytes: int) -> int:
    """Resident bytes of the mappings (VMAs) overlapping ``[address, address + nbytes)`` (an
    ``madvise`` of part of a mapping splits it)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split(maxsplit=1)[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo < address + nbytes and address < hi
            elif inside and head == "Rss:":
                total += int(line.split()[1]) * 1024
    return total


def _resident_within(address: int, nbytes: int, limit_s: float = 60.0) -> int:
    """The mapping's resident bytes once they reach ``nbytes`` (or whatever they are after ``limit_s``)."""
    deadline = time.monotonic() + limit_s
    while (rss := _rss_bytes(address, nbytes)) < nbytes - MiB and time.monotonic() < deadline:
        time.sleep(0.01)
    return rss


def test_an_unpinned_host_arena_becomes_resident_without_a_put():
    tier = HostTier(HostTierConfig(capacity_bytes=ARENA, block_bytes=MiB, pin_memory=False))
    try:
        assert not tier.pinned
        # today: only the pages a put wrote ever become resident
        assert _resident_within(tier.buffer.data_ptr(), ARENA) > ARENA - MiB
    finally:
        tier.close()


def test_a_shared_host_arena_becomes_resident_in_its_mapping_without_a_put(tmp_path):
    """The daemon's arena (a file in ``daemon.shm_dir`` mapped shared): its pages exist from
    ``posix_fallocate`` on, but each first touch through the mapping still faults. Unpopulated,
    a 32 MiB NVMe promotion into it took ~12 ms instead of ~5 (docs/benchmarks.md)."""
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else str(tmp_path)
    path = os.path.join(shm, f"ectier-test-shared-arena-{os.getpid()}")
    tier = HostTier(HostTierConfig(capacity_bytes=ARENA, block_bytes=MiB, pin_memory=False), shm_path=path)
    try:
        assert not tier.pinned
        # before: only the pages a put or a promotion wrote were mapped in
        assert _resident_within(tier.buffer.data_ptr(), ARENA) > ARENA - MiB
        assert int(tier.buffer.sum()) == 0  # nothing written
    finally:
        tier.close()
    assert not os.path.exists(path)


def test_a_shared_arena_on_a_disk_filesystem_is_not_populated(tmp_path):
    """Populating a shared file mapping write-faults every page: on a disk filesystem that made
    the whole arena dirty, to be written back to the disk (1 GiB empty arena: +1 GiB ``Dirty``).
    There the pages fault on first touch, as before (the daemon warns about such a shm_dir)."""
    from ectier.tiers.storedir import in_memory

    if in_memory(tmp_path) is not False:
        pytest.skip(f"{tmp_path} is not known to be on a disk filesystem")
    tier = HostTier(HostTierConfig(capacity_bytes=ARENA, block_bytes=MiB, pin_memory=False),
                    shm_path=str(tmp_path / "arena"))
    try:
        time.sleep(0.5)  # (populated, a 64 MiB mapping would be resident in ~0.05 s)
        assert _rss_bytes(tier.buffer.data_ptr(), ARENA) < ARENA // 2
    finally:
        tier.close()


def test_populating_keeps_what_the_arena_holds_and_lets_it_go():
    buf = torch.empty(ARENA, dtype=torch.uint8)
    buf[: 3 * MiB].fill_(7)
    buf[-MiB:].fill_(9)
    thread = populate_later(buf, chunk_bytes=8 * MiB)
    assert thread is not None
    thread.join(60)
    assert not thread.is_alive()
    assert _rss_bytes(buf.data_ptr(), ARENA) > ARENA - MiB
    assert int(buf[: 3 * MiB].min()) == 7 == int(buf[: 3 * MiB].max())
    assert int(buf[-MiB:].min()) == 9 == int(buf[-MiB:].max())
    # an arena dropped while it is populated is freed, not kept alive by the thread
    other = torch.empty(ARENA, dtype=torch.uint8)
    ref = weakref.ref(other)
    thread = populate_later(other, chunk_bytes=MiB)
    del other
    thread.join(60)
    assert ref() is None and not thread.is_alive()


def test_nothing_to_populate_in_an_empty_buffer():
    assert populate_later(torch.empty(0, dtype=torch.uint8)) is None


def test_a_shared_mapping_is_populated_in_the_background_without_changing_it(tmp_path):
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else str(tmp_path)
    path = os.path.join(shm, f"ectier-test-populate-{os.getpid()}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, ARENA)
        writer = mmap.mmap(fd, ARENA, mmap.MAP_SHARED)  # another process's view of the arena
        writer[:4] = b"abcd"
        writer[ARENA - 4:] = b"wxyz"
        mapping = mmap.mmap(fd, ARENA, mmap.MAP_SHARED)
        address = torch.frombuffer(mapping, dtype=torch.uint8).data_ptr()
        before = _rss_bytes(address, ARENA)
        thread = populate_mapping_later(mapping, chunk_bytes=8 * MiB)
        assert thread is not None
        thread.join(60)
        assert not thread.is_alive()
        assert before < ARENA // 2  # a fresh mapping maps pages as they are touched
        assert _rss_bytes(address, ARENA) >= ARENA
        assert mapping[:4] == b"abcd" and mapping[ARENA - 4:] == b"wxyz"
        writer.close()
    finally:
        os.close(fd)
        os.unlink(path)


def test_populating_a_mapping_lets_other_threads_run_during_each_call(tmp_path):
    """One ``madvise`` over the whole mapping: the main thread keeps running Python while it
    is in the kernel (``mmap.madvise`` held the GIL for the call: the main thread got no turn
    until the population was over)."""
    nbytes = 256 * MiB
    shm = "/dev/shm" if os.access("/dev/shm", os.W_OK) else str(tmp_path)
    path = os.path.join(shm, f"ectier-test-populate-gil-{os.getpid()}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        mapping = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ)
        address = int(np.frombuffer(mapping, dtype=np.uint8, count=1).ctypes.data)
        turns = 0
        thread = populate_mapping_later(mapping, chunk_bytes=nbytes, advice=MADV_POPULATE_READ)
        assert thread is not None
        while thread.is_alive():
            turns += 1  # Python on this thread while the populating call runs
            time.sleep(0)
        if _rss_bytes(address, nbytes) < nbytes // 2:
            pytest.skip("MADV_POPULATE_READ refused here (Linux < 5.14)")
        assert turns >= 20, f"the main thread ran {turns} times while the mapping was populated"
        del mapping
    finally:
        os.close(fd)
        os.unlink(path)
