"""Cutting a grown segment file back: the records that lie past the region's base are moved into
free blocks below it.

The segment region is ``nvme.capacity_bytes`` of blocks (its *base*); it grows past that only
while a write needs more (a write replacing a record holds both copies until it commits), and it
shrinks back only when its end is free. A replaced record lies low and its replacement at the end,
so without a move the file would keep the grown size (1.75x the budget after overwriting an entry of
7/8 of it); so would a store reopened with a lower ``nvme.capacity_bytes``, whose newest records lie
past the new base. :class:`TailCompaction` moves them, one record at a time, by the NVMe tier's two
ordering rules (docs/reliability.md, "Power loss"): the copy goes into free blocks and is synced
before the index entry naming it commits, and the old blocks are freed only after that commit (and
after the reads that began before it). A record replaced or deleted meanwhile is not moved.
"""

from __future__ import annotations

import logging
import threading
import time
import lmdb

from ..errors import CacheClosedError, CorruptRecordError, EctierError
from ..logutil import RateLimitedLogger
from .nvme_index import NvmeRecord
from .nvme_record import pack_index_value, parse_index_value
from .nvme_segment import BLOCK_BYTES, Location

__all__ = ["TailCompaction", "split_at", "moved_bytes", "merged"]

log = logging.getLogger(__name__)

MOVED, SKIPPED, DAMAGED, NO_ROOM = "moved", "skipped", "damaged", "no room"
#: seconds without another move after one failed (an I/O error: a failing disk is not read and
#: written again on every call)
RETRY_S = 10.0


class TailCompaction:
    """Mixin of :class:`~ectier.tiers.nvme.NvmeTier` (uses its ``_store``, ``_rw``, ``_write_lock``,
    ``_env``, ``_meta``, ``index``, ``_segment_io``, ``_free``, ``_set_record``, ``_check_open``).

    The records a write placed past the base are noted (:meth:`note_placement`), so a compaction
    after a write looks at those only, never at every record; at open every record is looked at.
    """

    def _init_compaction(self) -> None:
        self._past_base: set[bytes] = set()  # digests a write placed (in part) past the base
        self._compact_lock = threading.Lock()
        self._compact_retry_at = 0.0  # time.monotonic() before which a failed move is not tried again
        self._compact_log = RateLimitedLogger(log, RETRY_S)

    def note_placement(self, digest: bytes, loc: Location) -> None:
        """A write placed ``digest``'s payload at ``loc``: noted when it reaches past the base."""
        if _reaches_past(loc, self._store.space.base_blocks):
            self._past_base.add(digest)

    def compact_tail(self, *, every_record: bool = False) -> int:
        """Move the records lying (in part) past the region's base into free blocks below it, until
        the region is back at its base or no more fit; the segment file is cut as its end frees up.
        Looks at the records noted by :meth:`note_placement`, or (``every_record``, at open) at all.
        Called after every write, and after a read while a record noted has not been moved (its
        move found no room: blocks freed under reads come back when those reads end).
        One compaction at a time (another caller returns at once). Never raises for a failed move:
        it is logged (one line per ``RETRY_S``), the record stays where it was, and no move is tried
        for ``RETRY_S`` seconds. A record whose bytes fail their checksum is not moved (a read
        quarantines it). Returns the records moved."""
        space, noted = self._store.space, self._past_base
        base = space.base_blocks
        if space.nblocks <= base:
            for digest in list(noted):  # none lies past the base (unless a write placed it just now)
                self._forget_unless_past(digest, base)
            return 0
        if not every_record and (not noted or time.monotonic() < self._compact_retry_at):
            return 0
        if not self._compact_lock.acquire(blocking=False):
            return 0
        try:
            return self._compact([d for d, _ in self.index.records()] if every_record else list(noted), base)
        finally:
            self._compact_lock.release()

    def _compact(self, digests: list[bytes], base: int) -> int:
        """Move the records of ``digests`` that lie past block ``base`` (read again here: each may
        have changed since the list was made)."""
        space, moved = self._store.space, 0
        for digest in digests:
            if space.nblocks <= base:
                break
            rec = self.index.record(digest)
            if rec is None or not _reaches_past(rec.location, base):
                self._forget_unless_past(digest, base)
                continue
            try:
                outcome = self._relocate(digest, rec, base)
            except CacheClosedError:  # close() raced it: the next open looks again
                break
            except (EctierError, OSError, lmdb.Error) as exc:
                self._compact_retry_at = time.monotonic() + RETRY_S
                self._compact_log.warning(("move", type(exc).__name__), "nvme tier: moving a record below "
                                          "nvme.capacity_bytes failed (%s: %s); the segment file stays %d bytes over "
                                          "its budget, tried again in %g s", type(exc).__name__, exc,
                                          (space.nblocks - base) * BLOCK_BYTES, RETRY_S)
                break
            if outcome == NO_ROOM:
                break
            if outcome == DAMAGED:
                self._past_base.discard(digest)  # not moved: its first read quarantines it
            else:  # moved, or changed meanwhile (a write past the base notes its record again)
                self._forget_unless_past(digest, base)
                moved += outcome == MOVED
        return moved

    def _forget_unless_past(self, digest: bytes, base: int) -> None:
        """Drop ``digest`` from the records noted, unless its record (read after the drop: a write
        that notes it meanwhile has set its record before) lies past block ``base``."""
        self._past_base.discard(digest)
        rec = self.index.record(digest)
        if rec is not None and _reaches_past(rec.location, base):
            self._past_base.add(digest)

    def _relocate(self, digest: bytes, rec: NvmeRecord, limit: int) -> str:
        """Move the blocks of one record's payload at or past block ``limit`` into free blocks
        under it (those below stay): ``MOVED``, ``SKIPPED`` (the record changed meanwhile),
        ``DAMAGED`` (its bytes fail their checksum: left to a read to quarantine), or ``NO_ROOM``."""
        header, old = rec.header, rec.location
        pieces = split_at(old.extents, limit)
        moving = Location(tuple((start, n) for start, n, moves in pieces if moves))
        runs = self._store.space.allocate_within(moving.alloc_bytes, limit)
        if runs is None:
            return NO_ROOM
        committed = False
        try:
            buf = memoryview(bytearray(header.payload_nbytes))
            with self._rw.shared():
                self._check_open()
                with self._store.space.reading():  # old's blocks stay unreused if it is dropped meanwhile
                    if self.index.record(digest) is not rec:
                        return SKIPPED
                    try:
                        csum = self._store.segment.read_into(old, buf)
                    except CorruptRecordError:
                        return DAMAGED
            if header.payload_checksum and csum != header.payload_checksum:
                return DAMAGED
            self._segment_io("write", runs, moved_bytes(buf, pieces), need=runs.alloc_bytes)
            self._segment_io("flush")  # synced before the entry naming it commits
            committed = self._commit_move(digest, rec, old, merged(pieces, runs))
            return MOVED if committed else SKIPPED
        finally:
            self._free(moving if committed else runs)

    def _commit_move(self, digest: bytes, rec: NvmeRecord, old: Location, new: Location) -> bool:
        """Point the index entry of ``digest`` at ``new`` if it still names ``rec``'s version at
        ``old``; True if it was committed."""
        value = pack_index_value(rec.header, new)
        with self._rw.shared(), self._write_lock:
            self._check_open()
            with self._env.begin(write=True) as txn:
                current = txn.get(digest, db=self._meta)
                try:
                    header, loc = parse_index_value(current) if current is not None else (None, None)
                except CorruptRecordError:
                    header, loc = None, None
                unchanged = header is not None and header.version == rec.header.version and loc == old
                if unchanged:
                    txn.put(digest, value, db=self._meta)
            if unchanged:
                self._set_record(digest, NvmeRecord(rec.header, rec.stored_bytes, new, value))
        return unchanged



def split_at(extents: tuple[tuple[int, int], ...], limit: int) -> list[tuple[int, int, bool]]:
    """``extents`` in payload order as ``(first block, blocks, moves)``: an extent across block
    ``limit`` is split there; ``moves`` for the pieces at or past it."""
    out = []
    for start, n in extents:
        if start + n <= limit:
            out.append((start, n, False))
        elif start >= limit:
            out.append((start, n, True))
        else:
            out += [(start, limit - start, False), (limit, start + n - limit, True)]
    return out


def moved_bytes(payload: memoryview, pieces: list[tuple[int, int, bool]]) -> memoryview:
    """The bytes of ``payload`` that the moving pieces hold, in payload order."""
    parts, pos = [], 0
    for _, n, moves in pieces:
        if moves:
            parts.append(payload[pos:pos + n * BLOCK_BYTES])
        pos += n * BLOCK_BYTES
    return memoryview(b"".join(parts))


def merged(pieces: list[tuple[int, int, bool]], runs: Location) -> Location:
    """The payload's new location: the pieces that stay, and the moving ones replaced in order by
    the blocks of ``runs``."""
    free = list(runs.extents)
    out = []
    for start, n, moves in pieces:
        if not moves:
            out.append((start, n))
            continue
        while n:
            first, count = free[0]
            take = min(n, count)
            out.append((first, take))
            free[0] = (first + take, count - take)
            if free[0][1] == 0:
                free.pop(0)
            n -= take
    return Location(tuple(out))


def _reaches_past(loc: Location, base: int) -> bool:
    return bool(loc.extents) and max(start + n for start, n in loc.extents) > base
