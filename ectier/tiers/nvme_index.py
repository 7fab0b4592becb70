"""The NVMe tier's one index: its records, the policy order, writes and deletes in flight, the budget.

Two kinds of state, two guards:

- **records** (what is on disk: digest -> :class:`NvmeRecord`, and their bytes) change when a write
  or delete transaction commits, under the index's own small lock (the tier updates them from the
  thread doing the I/O);
- **policy order and reservations** (which records are evictable and in which order, bytes
  reserved by writes in flight, deletes in flight) change under the cache's lock, because
  admission decisions span tiers.

A record is *tracked* (in the policy) once the cache has accounted for it; a record that a delete
or a newer write has already claimed is untracked, so no other admission can count on its bytes.
"""

from __future__ import annotations

import threading
from collections import Counter
from typing import Iterator

from ..codec import RecordHeader, header_nbytes, unpack_header
from ..entry import EntryMeta
from ..policy import EvictionPolicy
from .nvme_segment import Location, unpack_location

__all__ = ["NvmeIndex", "NvmeRecord", "HEADER_ALLOWANCE_BYTES"]

#: Upper bound of what a record adds to its payload: the packed header with a key and a namespace of
#: up to 64 KiB each (``ectier.entry``'s limits) plus a page for the fixed fields. Used to decide,
#: before encoding, whether an entry can ever fit ``nvme.capacity_bytes``.
HEADER_ALLOWANCE_BYTES = 4096 + 2 * 65536


class NvmeRecord:
    """What the tier knows, in memory, of one stored record.

    Fields: ``header`` (:class:`~ectier.codec.RecordHeader`; a record scanned at open keeps only
    its checked bytes and parses them at first use), ``stored_bytes`` (header + the whole segment
    blocks of its payload, what the record costs the ``nvme.capacity_bytes`` budget),
    ``location`` (:class:`~ectier.tiers.nvme_segment.Location` of its payload; parsed from
    ``value`` at first use for a record scanned at open), ``value`` (its
    index entry's bytes as committed: a read whose entry is byte-equal skips parsing it again),
    ``version`` (its write version).
    """

    __slots__ = ("_header", "stored_bytes", "_location", "value", "version", "_meta")

    def __init__(self, header: RecordHeader | None, stored_bytes: int, location: Location | None = None,
                 value: bytes | None = None, version: int | None = None) -> None:
        if header is None and (value is None or version is None):
            raise ValueError("NvmeRecord: a header, or its value and version")
        self._header = header
        self.stored_bytes = stored_bytes
        if location is None and value is None:
            raise ValueError("NvmeRecord: a location, or the value that holds it")
        self._location = location
        self.value = value
        self.version = header.version if header is not None else version
        self._meta: EntryMeta | None = None

    @property
    def header(self) -> RecordHeader:
        if self._header is None:
            assert self.value is not None
            self._header = unpack_header(memoryview(self.value)[: header_nbytes(self.value)])
        return self._header

    @property
    def meta(self) -> EntryMeta:
        """The entry's :class:`~ectier.entry.EntryMeta` (from its header; made once: every hit needs it)."""
        if self._meta is None:
            h = self.header
            self._meta = EntryMeta(h.namespace, h.key, h.dtype, tuple(h.shape), h.raw_nbytes)
        return self._meta

    @property
    def location(self) -> Location:
        """Where the payload lives; a record scanned at open parses it from ``value`` at first use."""
        if self._location is None:
            assert self.value is not None
            self._location = unpack_location(memoryview(self.value)[header_nbytes(self.value):])
        return self._location

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, NvmeRecord) and self.version == other.version
                and self.stored_bytes == other.stored_bytes and self.location == other.location)

    def __repr__(self) -> str:
        return f"NvmeRecord(version={self.version}, stored_bytes={self.stored_bytes}, location={self.location})"


def _version_of(item: tuple[bytes, NvmeRecord]) -> int:
    return item[1].version


class NvmeIndex:
    """Records, policy order and byte budget of one NVMe tier.

    Args:
        capacity_bytes: the budget (``nvme.capacity_bytes``).
        policy: the eviction policy (``nvme.policy``).
    """

    def __init__(self, capacity_bytes: int, policy: EvictionPolicy) -> None:
        self.capacity_bytes = capacity_bytes
        self.policy = policy
        self._records_lock = threading.Lock()
        self._records: dict[bytes, NvmeRecord] = {}
        self.used_bytes = 0
        self.reserved_bytes = 0  # encoded bytes of writes in flight
        self.deleting = 0  # deletes of untracked records, still counted in used_bytes
        self._writing: Counter = Counter()  # digest -> writes in flight

    # ------------------------------------------------------------------ records (own lock)
    def record(self, digest: bytes) -> NvmeRecord | None:
        return self._records.get(digest)

    def records(self) -> list[tuple[bytes, NvmeRecord]]:
        """All records, oldest write version first."""
        with self._records_lock:
            items = list(self._records.items())
        items.sort(key=_version_of)  # loaded in version order at open: a linear pass then
        return items

    def __len__(self) -> int:
        return len(self._records)

    def __contains__(self, digest: object) -> bool:
        return digest in self._records

    def set_record(self, digest: bytes, rec: NvmeRecord | None) -> None:
        """Replace (``None``: remove) the record of ``digest``, keeping ``used_bytes`` exact."""
        with self._records_lock:
            # a replacement is one assignment: a lock-free record()/``in`` never sees the key absent
            # while its record is replaced (a commit rule would then take the new record for none)
            old = self._records.get(digest)
            if rec is not None:
                self._records[digest] = rec
                self.used_bytes += rec.stored_bytes
            elif old is not None:
                del self._records[digest]
            if old is not None:
                self.used_bytes -= old.stored_bytes

    def load(self, records: dict[bytes, NvmeRecord]) -> None:
        """Set every record at open (replaces what was there)."""
        with self._records_lock:
            self._records = dict(records)
            self.used_bytes = sum(r.stored_bytes for r in self._records.values())

    # ------------------------------------------------------------------ budget (cache lock)
    def fits(self, nbytes: int) -> bool:
        """Whether an entry of ``nbytes`` raw bytes can ever fit the budget (header allowance included)."""
        return nbytes + HEADER_ALLOWANCE_BYTES <= self.capacity_bytes

    def track(self, digest: bytes, stored_bytes: int, cost_s: float | None = None) -> None:
        self.policy.add(digest, stored_bytes, cost_s)

    def track_many(self, items: list[tuple[bytes, int]]) -> None:
        """:meth:`track` of every ``(digest, stored bytes)``, in order (first = least recently used)."""
        self.policy.add_many(items)

    def touch(self, digest: bytes) -> None:
        self.policy.touch(digest)

    def untrack(self, digest: bytes) -> None:
        self.policy.remove(digest)

    def tracked(self, digest: bytes) -> bool:
        return digest in self.policy

    def __iter__(self) -> Iterator[bytes]:
        """Tracked digests, least valuable first."""
        return iter(self.policy)

    def writing(self, digest: bytes) -> bool:
        return self._writing[digest] > 0 if digest in self._writing else False

    def plan_write(self, digest: bytes, size: int, version: int, protect: bytes | None) -> list[bytes] | None:
        """Victims whose eviction lets a record of ``size`` stored bytes in (``[]``: it fits now),
        or ``None`` if no set of evictable records covers it.

        Never chosen: ``digest`` itself, ``protect`` (an entry being promoted: its record is its
        only copy until the promotion commits), digests with writes in flight, and records already
        gone. An older tracked record of ``digest`` is replaced by this write: its bytes count as free.
        """
        old = self.record(digest)
        replaced = old.stored_bytes if (old is not None and old.version < version and digest in self.policy) else 0
        need = self.used_bytes + self.reserved_bytes + size - replaced - self.capacity_bytes
        if need <= 0:
            return []
        return self.policy.victims(
            need, protected=lambda d: d == digest or d == protect or d in self._writing or d not in self._records)

    def victims(self, need_bytes: int) -> list[bytes]:
        """Tracked digests covering ``need_bytes`` (least valuable first; all of them if they do
        not cover it) — to trim the tier back within budget."""
        return self.policy.victims(need_bytes) or list(self.policy)

    def victims_for_space(self, need_bytes: int, digest: bytes, protect: bytes | None) -> list[bytes]:
        """Tracked records covering ``need_bytes`` (least valuable first; as many as there are when
        they do not cover it) to free disk space after ``ENOSPC`` — never ``digest``, ``protect`` or
        a record with a write in flight."""
        def protected(d: bytes) -> bool:
            return d == digest or d == protect or d in self._writing or d not in self._records

        got = self.policy.victims(need_bytes, protected=protected)
        return got if got is not None else [d for d in self.policy if not protected(d)]

    def begin_delete(self) -> None:
        """A delete of an untracked record starts: its bytes still count in ``used_bytes``."""
        self.deleting += 1

    def end_delete(self) -> None:
        self.deleting -= 1

    def begin_write(self, digest: bytes, size: int) -> None:
        self.reserved_bytes += size
        self._writing[digest] += 1

    def end_write(self, digest: bytes, size: int) -> None:
        self.reserved_bytes -= size
        self._writing[digest] -= 1
        if self._writing[digest] <= 0:
            del self._writing[digest]

    def busy(self) -> bool:
        """Whether writes or deletes in flight hold budget that will come back."""
        return self.reserved_bytes > 0 or self.deleting > 0

    def over_budget_bytes(self) -> int:
        return self.used_bytes - self.capacity_bytes

    def quiet(self) -> bool:
        """No write or delete in flight (what an invariant check expects between calls)."""
        return self.reserved_bytes == 0 and self.deleting == 0 and not self._writing
