"""A host arena is faulted in once at open, so no put pays first-touch page faults
(``ectier.tiers.arena.populate``; a daemon client's mapping: ``populate_mapping_later``).

Residency is read from ``/proc/self/smaps`` (the ``Rss`` of the mapping holding the arena): pages
this process has mapped in. Linux only.
"""

from __future__ import annotations

import mmap
import os
import sys

import pytest
import torch

from ectier.config import HostTierConfig
from ectier.tiers.arena import populate, populate_mapping_later
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


def test_an_unpinned_host_arena_is_resident_from_open():
    tier = HostTier(HostTierConfig(capacity_bytes=ARENA, block_bytes=MiB, pin_memory=False))
    try:
        assert not tier.pinned
        assert _rss_bytes(tier.buffer.data_ptr(), ARENA) > ARENA - MiB  # today: only the pages written so far
    finally:
        tier.close()


def test_populate_keeps_what_the_arena_holds():
    buf = torch.empty(ARENA, dtype=torch.uint8)
    buf[: 3 * MiB].fill_(7)
    buf[-MiB:].fill_(9)
    seconds = populate(buf, private=True)
    assert seconds >= 0.0
    assert _rss_bytes(buf.data_ptr(), ARENA) > ARENA - MiB
    assert int(buf[: 3 * MiB].min()) == 7 == int(buf[: 3 * MiB].max())
    assert int(buf[-MiB:].min()) == 9 == int(buf[-MiB:].max())


def test_populate_of_an_empty_buffer_does_nothing():
    assert populate(torch.empty(0, dtype=torch.uint8), private=True) == 0.0


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
