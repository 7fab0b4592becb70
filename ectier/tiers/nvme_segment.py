"""Layout v2 of the NVMe tier: payload bytes in one segment file, apart from the LMDB index.

- :class:`Location` — where a payload lives: extents (first block, block count) of
  :data:`BLOCK_BYTES` blocks in ``segment.0``; packed after the record header in the index value
  (:func:`pack_location` / :func:`unpack_location`, with its own xxh3 checksum).
- :class:`ExtentSpace` — which blocks are free: a :class:`~ectier.arena.BlockAllocator` rebuilt at
  open from the index (blocks no index entry points to are free: the space of a payload written
  before a crash and never committed is reclaimed by construction). A block run freed while a
  reader holds it is returned only when the last reader lets go, so a payload is never overwritten
  under a read. The space grows (the file too) when a write finds no room — a write replacing an
  older record needs both until it commits.
- :class:`SegmentFile` — the file: writes (``pwrite`` in chunks, xxh3 computed over each chunk as it
  is written: one pass over the bytes) and reads straight into the caller's buffer (``preadv`` in
  chunks, xxh3 over each chunk while it is in the CPU cache; with ``nvme.read_threads=2`` a helper
  thread copies chunks of large payloads meanwhile: :mod:`ectier.tiers.nvme_reader`). Buffered I/O with
  ``POSIX_FADV_SEQUENTIAL`` (``O_DIRECT`` measured slower here: docs/benchmarks.md, "Layout v2").

See docs/operations.md ("The NVMe tier on disk") for the whole layout.
"""

from __future__ import annotations

import errno
import os
import struct
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np
import xxhash

from ..arena import BlockAllocator
from ..cpus import usable_cpus
from ..errors import ConfigError, CorruptRecordError
from .nvme_reader import CHUNK_BYTES, PARALLEL_MIN_BYTES, ReadHelper, in_background, plan_chunks, read_hashed

__all__ = ["BLOCK_BYTES", "SEGMENT_NAME", "LOCATION_MAGIC", "Location", "pack_location", "unpack_location",
           "ExtentSpace", "SegmentFile", "blocks_for", "check_capacity"]

#: Allocation unit of the segment file, bytes (a multiple of 4 KiB: aligned for ``O_DIRECT``).
BLOCK_BYTES = 64 << 10
SEGMENT_NAME = "segment.0"
_LOC_MAGIC = b"ECLX"
LOCATION_MAGIC = _LOC_MAGIC  #: first bytes of a packed location (the open-time scan checks them)
_LOC_HEAD = struct.Struct("<4sII")  # magic, block bytes, extent count
_EXTENT = struct.Struct("<QI")  # first block, block count
_TRAILER = struct.Struct("<Q")


def blocks_for(nbytes: int) -> int:
    """Blocks of :data:`BLOCK_BYTES` a payload of ``nbytes`` bytes takes."""
    return -(-nbytes // BLOCK_BYTES)


@dataclass(frozen=True)
class Location:
    """Where one payload lives: ``extents`` of ``(first block, blocks)`` in the segment file, in
    payload order; ``nbytes`` of them hold the payload (the rest of the last block is slack)."""

    extents: tuple[tuple[int, int], ...]

    @property
    def blocks(self) -> int:
        return sum(n for _, n in self.extents)

    @property
    def alloc_bytes(self) -> int:
        """Bytes of the segment this payload holds (whole blocks)."""
        return self.blocks * BLOCK_BYTES


def pack_location(loc: Location) -> bytes:
    """The bytes stored after the record header in an index value."""
    body = _LOC_HEAD.pack(_LOC_MAGIC, BLOCK_BYTES, len(loc.extents)) + b"".join(
        _EXTENT.pack(s, n) for s, n in loc.extents)
    return body + _TRAILER.pack(xxhash.xxh3_64_intdigest(body))


def unpack_location(buf: memoryview | bytes) -> Location:
    """Parse :func:`pack_location`'s bytes (exactly those).

    Raises:
        CorruptRecordError: too short, bad magic, another block size, a count that does not match
            the length, a checksum mismatch, or an empty/negative extent.
    """
    mv = buf if isinstance(buf, memoryview) else memoryview(buf)
    if len(mv) < _LOC_HEAD.size + _TRAILER.size:
        raise CorruptRecordError("payload location missing or too short")
    magic, block, count = _LOC_HEAD.unpack_from(mv)
    if magic != _LOC_MAGIC:
        raise CorruptRecordError("payload location: bad magic")
    if len(mv) != _LOC_HEAD.size + count * _EXTENT.size + _TRAILER.size:
        raise CorruptRecordError("payload location: length does not match its extent count")
    (stored,) = _TRAILER.unpack_from(mv, len(mv) - _TRAILER.size)
    if stored != xxhash.xxh3_64_intdigest(mv[: len(mv) - _TRAILER.size]):
        raise CorruptRecordError("payload location checksum mismatch")
    if block != BLOCK_BYTES:
        raise CorruptRecordError(f"payload location in blocks of {block} bytes, this ectier uses {BLOCK_BYTES}")
    if count == 1:
        extents = (_EXTENT.unpack_from(mv, _LOC_HEAD.size),)
    else:
        extents = tuple(_EXTENT.unpack_from(mv, _LOC_HEAD.size + i * _EXTENT.size) for i in range(count))
    for _, n in extents:
        if n <= 0:
            raise CorruptRecordError("payload location: empty extent")
    return Location(extents)


class _Blocks(BlockAllocator):
    """A :class:`~ectier.arena.BlockAllocator` that allocates from the lowest address up (first fit),
    and grows or shrinks at its end: the used blocks stay packed at the start of the file."""

    def alloc_low(self, count: int) -> list[tuple[int, int]] | None:
        """``count`` blocks: the lowest run that holds them all, else runs from the lowest up;
        ``None`` if fewer are free."""
        if count > self.free_blocks:
            return None
        if count == 0:
            return []
        for start in self._starts:
            if self._runs[start] >= count:
                self._take(start, count)
                return [(start, count)]
        got, left = [], count
        while left:
            start = self._starts[0]
            take = min(self._runs[start], left)
            self._take(start, take)
            got.append((start, take))
            left -= take
        return got

    def alloc_below(self, count: int, limit: int) -> list[tuple[int, int]] | None:
        """``count`` blocks from the runs below block ``limit`` only, lowest first (scattered);
        ``None`` if those do not hold them (nothing taken then)."""
        plan, left = [], count
        for start in self._starts:
            if start >= limit or not left:
                break
            take = min(self._runs[start], limit - start, left)
            plan.append((start, take))
            left -= take
        if left:
            return None
        for start, take in plan:
            self._take(start, take)
        return plan

    @classmethod
    def with_used(cls, nblocks: int, used: list[tuple[int, int]]) -> "_Blocks":
        """A region of ``nblocks`` with exactly ``used`` (non-overlapping) allocated, built in
        O(n log n) (freeing the gaps one by one would be quadratic in the number of runs)."""
        alloc = cls(0)
        alloc.nblocks = nblocks
        free = _complement(used, nblocks)
        alloc._starts = [s for s, _ in free]
        alloc._runs = dict(free)
        alloc.free_blocks = sum(n for _, n in free)
        return alloc

    @classmethod
    def with_used_arrays(cls, nblocks: int, starts: np.ndarray, lens: np.ndarray) -> "_Blocks":
        """:meth:`with_used` for extents given as two ``int64`` arrays sorted by start (vectorised:
        the free runs are the positive gaps between one extent's end and the next's start)."""
        alloc = cls(0)
        alloc.nblocks = nblocks
        gap_starts = np.concatenate(([0], starts + lens))
        gap_ends = np.concatenate((starts, [nblocks]))
        keep = gap_ends > gap_starts
        gs, gl = gap_starts[keep].tolist(), (gap_ends - gap_starts)[keep].tolist()
        alloc._starts = gs
        alloc._runs = dict(zip(gs, gl))
        alloc.free_blocks = int(sum(gl))
        return alloc

    def grow(self, extra: int) -> None:
        """Add ``extra`` free blocks at the end."""
        old = self.nblocks
        self.nblocks += extra
        self.free([(old, extra)])

    def shrink_to(self, floor: int) -> bool:
        """Drop the free blocks at the end down to ``floor`` blocks (never a used one); True if any."""
        if not self._starts or self.nblocks <= floor:
            return False
        start = self._starts[-1]
        length = self._runs[start]
        if start + length != self.nblocks:
            return False
        cut = min(length, self.nblocks - max(floor, start))
        if cut <= 0:
            return False
        if cut == length:
            self._starts.pop()
            del self._runs[start]
        else:
            self._runs[start] = length - cut
        self.nblocks -= cut
        self.free_blocks -= cut
        return True


class ExtentSpace:
    """Free and used blocks of the segment file; thread-safe.

    Args:
        nblocks: blocks of the region (``ceil(nvme.capacity_bytes / BLOCK_BYTES)``); the extents of
            the committed records are marked used with :meth:`rebuild` at open. Blocks are handed
            out lowest first; the region grows past ``nblocks`` only while a write needs more (a
            write replacing a record holds both until it commits) and shrinks back when the end is free.
        on_shrink: called with the region's new size in blocks when it shrank, under the lock (no
            block past that size can be handed out meanwhile: the file may be cut there).

    Reads and reuse: every read runs inside :meth:`reading`, entered *before* it looks the record up
    in the index. Blocks freed while reads that started earlier are still running wait (in limbo)
    until those reads end, so a read that found a record in its LMDB snapshot reads that record's
    bytes whole even if the record is deleted or replaced meanwhile — the snapshot semantics of
    layout v1, where payloads lived in LMDB's MVCC pages.
    """

    def __init__(self, nblocks: int, on_shrink: Callable[[int], None] | None = None) -> None:
        self._lock = threading.Lock()
        self.base_blocks = nblocks
        self.on_shrink = on_shrink
        self._alloc = _Blocks(nblocks)
        self._epoch = 0
        self._active: dict[int, int] = {}  # epoch -> reads in progress that began in it
        self._limbo: list[tuple[int, tuple[tuple[int, int], ...]]] = []  # (epoch freed, extents)

    @property
    def nblocks(self) -> int:
        return self._alloc.nblocks

    @property
    def free_blocks(self) -> int:
        return self._alloc.free_blocks

    def rebuild(self, used: list[tuple[int, int]], *, presorted: bool = False) -> None:
        """Mark exactly ``used`` (non-overlapping extents; ``presorted``: sorted by start already)
        as allocated, everything else free."""
        used = used if presorted else sorted(used)
        end = max(self.base_blocks, used[-1][0] + used[-1][1] if used else 0)
        alloc = _Blocks.with_used(end, used)
        with self._lock:
            self._alloc = alloc
            self._limbo = []

    def rebuild_arrays(self, starts: np.ndarray, lens: np.ndarray) -> None:
        """:meth:`rebuild` from the used extents as two ``int64`` arrays (first block, blocks),
        sorted by start and non-overlapping."""
        end = max(self.base_blocks, int((starts + lens).max()) if len(starts) else 0)
        alloc = _Blocks.with_used_arrays(end, starts, lens)
        with self._lock:
            self._alloc = alloc
            self._limbo = []

    def allocate(self, nbytes: int, *, below: int | None = None) -> Location:
        """Blocks for a payload of ``nbytes`` bytes; grows the region when it is short. ``below``:
        from the free blocks under that block first (the file's size: blocks already on disk, which
        a full filesystem can still write into), scattered if they must be."""
        count = blocks_for(nbytes)
        with self._lock:
            got = self._alloc.alloc_below(count, below) if below is not None else None
            if got is None:
                got = self._alloc.alloc_low(count)
            if got is None:
                self._alloc.grow(count - self._alloc.free_blocks)
                got = self._alloc.alloc_low(count)
                assert got is not None
        return Location(tuple(got))

    def allocate_within(self, nbytes: int, limit: int) -> Location | None:
        """Blocks for a payload of ``nbytes`` bytes from the free ones under block ``limit`` only
        (scattered if they must be); ``None`` if those are too few (nothing taken, no growth)."""
        with self._lock:
            got = self._alloc.alloc_below(blocks_for(nbytes), limit)
        return None if got is None else Location(tuple(got))

    def free(self, loc: Location) -> None:
        """Return ``loc``'s blocks: at once when no read is running, else once every read that
        began before this call has ended."""
        if not loc.extents:
            return
        with self._lock:
            self._epoch += 1
            if self._active:
                self._limbo.append((self._epoch, loc.extents))
            else:
                self._return(list(loc.extents))

    def _return(self, extents: list[tuple[int, int]]) -> None:
        self._alloc.free(extents)
        if self._alloc.shrink_to(self.base_blocks) and self.on_shrink is not None:
            self.on_shrink(self._alloc.nblocks)

    @contextmanager
    def reading(self) -> Iterator[None]:
        """Hold every block that is in use now against reuse while the body runs."""
        epoch = self.begin_read()
        try:
            yield
        finally:
            self.end_read(epoch)

    def begin_read(self) -> int:
        """:meth:`reading` without a generator (every NVMe read's path): hold every block in use
        now against reuse until :meth:`end_read` with the returned epoch."""
        with self._lock:
            epoch = self._epoch
            active = self._active
            active[epoch] = active.get(epoch, 0) + 1
        return epoch

    def end_read(self, epoch: int) -> None:
        """End a read begun with :meth:`begin_read`: blocks freed since are returned once no
        older read holds them."""
        with self._lock:
            active = self._active
            n = active[epoch] - 1
            if n > 0:
                active[epoch] = n
            else:
                del active[epoch]
            if self._limbo:
                oldest = min(active) if active else None
                ready = [ext for e, ext in self._limbo if oldest is None or e <= oldest]
                if ready:
                    self._limbo = [(e, ext) for e, ext in self._limbo if not (oldest is None or e <= oldest)]
                    self._return([x for ext in ready for x in ext])


def _complement(runs: list[tuple[int, int]], nblocks: int) -> list[tuple[int, int]]:
    """The runs of ``[0, nblocks)`` not in ``runs`` (sorted by start, non-overlapping)."""
    used, pos = [], 0
    for s, n in runs:
        if s > pos:
            used.append((pos, s - pos))
        pos = s + n
    if pos < nblocks:
        used.append((pos, nblocks - pos))
    return used


def check_capacity(capacity_bytes: int) -> None:
    """Refuse an NVMe budget (other than 0) below one block: no entry could ever be stored (a
    unit left out, e.g. ``1`` for 1 GiB).

    Raises:
        ConfigError: naming ``nvme.capacity_bytes``, the bytes and the block size.
    """
    if 0 < capacity_bytes < BLOCK_BYTES:
        raise ConfigError(f"nvme.capacity_bytes: {capacity_bytes} bytes is below one {BLOCK_BYTES // 1024} KiB "
                          "block of the segment file, the least one entry takes on disk; give a unit, e.g. '64GiB'")


class SegmentFile:
    """The segment file of one store (``<nvme.path>/segment.0``), opened read-write.

    Args:
        path: the file (created if missing).
        sync: ``fdatasync`` after writes (``nvme.sync``).

    Raises:
        OSError: the file cannot be opened or created.
    """

    def __init__(self, path: str, *, sync: bool, read_threads: int = 1) -> None:
        self.path = path
        self.sync = sync
        self._helper = ReadHelper() if read_threads >= 2 and usable_cpus() >= 2 else None
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        except (OSError, AttributeError):  # pragma: no cover - not Linux
            pass

    def size_blocks(self) -> int:
        """Blocks the file reaches into now (a last block may be partly there)."""
        return blocks_for(os.fstat(self.fd).st_size)

    def write(self, loc: Location, src: memoryview) -> int:
        """Write ``src`` (bytes) into ``loc``'s blocks in order; returns the xxh3-64 of ``src``,
        computed chunk by chunk as it is written.

        Raises:
            OSError: the write failed (``ENOSPC``: the filesystem is full; a short write is one too).
        """
        h = xxhash.xxh3_64()
        pos, total, off = 0, len(src), 0
        for start, count in loc.extents:
            off = start * BLOCK_BYTES
            end = min(total, pos + count * BLOCK_BYTES)
            while pos < end:
                chunk = src[pos:min(end, pos + CHUNK_BYTES)]
                n = os.pwrite(self.fd, chunk, off)
                if n <= 0:
                    raise OSError(errno.ENOSPC, "short write to the segment file")
                h.update(chunk[:n])
                pos += n
                off += n
        tail = off % BLOCK_BYTES if total else 0  # (no extents at all for an empty payload)
        if tail and pos == total:
            # allocate the rest of the last block too: a hole there would need new disk space
            # when the block is reused, so a full disk could refuse writes into freed blocks
            os.posix_fallocate(self.fd, off, BLOCK_BYTES - tail)
        return h.intdigest()

    def flush(self) -> None:
        """Make every write so far durable (``fdatasync``) when ``sync`` is on."""
        if self.sync:
            os.fdatasync(self.fd)

    def read_into(self, loc: Location, dst: memoryview | list[memoryview]) -> int:
        """Read the payload from ``loc`` straight into ``dst`` — one buffer of the payload's
        length, or several (a scatter read: filled in order, their lengths summing to it) — and
        return its xxh3-64, computed over each chunk of at most 1 MiB right after it is read
        (while it is in the CPU cache).

        Raises:
            CorruptRecordError: a read past the end of the file (a truncated segment; the rest of
                ``dst`` is left unread), or ``loc`` holds fewer bytes than ``dst``.
        """
        fd, extents, helper = self.fd, loc.extents, self._helper
        if isinstance(dst, memoryview) and len(extents) == 1 and 0 < len(dst) <= CHUNK_BYTES:
            # the usual small read (one buffer, one extent, one chunk): no hasher object, no plan
            if len(dst) > extents[0][1] * BLOCK_BYTES:
                raise CorruptRecordError("payload location holds fewer bytes than the header says")
            n = os.preadv(fd, [dst], extents[0][0] * BLOCK_BYTES)
            if n == len(dst):
                return xxhash.xxh3_64_intdigest(dst)
            # a short read (not seen from a regular file): the general path reads it again
        bufs = [dst] if isinstance(dst, memoryview) else dst
        total = sum(len(b) for b in bufs)
        chunks = plan_chunks(extents, bufs, BLOCK_BYTES, CHUNK_BYTES)
        return read_hashed(fd, chunks, helper if total >= PARALLEL_MIN_BYTES and not in_background() else None)

    def truncate_blocks(self, nblocks: int) -> None:
        """Cut the file to ``nblocks`` blocks (nothing past them is in use)."""
        os.ftruncate(self.fd, nblocks * BLOCK_BYTES)

    def close(self) -> None:
        if self._helper is not None:
            self._helper.close()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
