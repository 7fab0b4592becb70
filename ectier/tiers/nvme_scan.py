"""The open-time scan of a layout-v2 index (:class:`~ectier.tiers.nvme_env.NvmeEnv` calls it).

:func:`scan_index` walks every ``meta`` entry once and makes only the cheap checks open needs —
the header's prefix, length, write version (at most 2**63 - 1) and own xxh3-64 checksum, the
location's magic, block size, length and own checksum, that the location holds the payload and lies inside the segment file — reading no
payload byte. The usual record (one extent) is checked by two ``struct.unpack_from`` over fixed
offsets and two checksum calls; anything else (several extents, or a value that fails a fast
check) goes through :func:`~ectier.record.peek_header` and
:func:`~ectier.tiers.nvme_segment.unpack_location`, which name what is wrong. The full parse of a
header, and the identity check, happen at the record's first use (docs/operations.md).
"""

from __future__ import annotations

import gc
import struct
from contextlib import contextmanager
from typing import Iterable, Iterator, NamedTuple

import lmdb
import xxhash

from ..entry import MAX_VERSION
from ..errors import CorruptRecordError
from .nvme_record import parse_index_value
from ..record import MAX_HEADER_NBYTES, RECORD_FORMAT_VERSION, RECORD_MAGIC, peek_header
from .nvme_segment import BLOCK_BYTES, LOCATION_MAGIC, blocks_for, unpack_location

__all__ = ["ScanResult", "scan_index", "gc_paused", "placed_entries"]

# The header's fixed prefix up to its write version (layout in ectier.record's module docstring):
# magic, format, codec id, header length H, raw_nbytes, payload_nbytes, payload checksum, version.
_HEAD = struct.Struct("<4sHHIQQQQ")
_MIN_HEADER = 76  # the fixed fields (68 bytes) and the trailing checksum
_TRAILER = struct.Struct("<Q")
# A one-extent location: magic, block bytes, extent count, first block, blocks, its checksum.
_LOC1 = struct.Struct("<4sIIQIQ")
_LOC1_BODY = _LOC1.size - 8


class ScanResult(NamedTuple):
    """What :func:`scan_index` found. Per good entry, in the cursor's (digest) order: ``digests``
    (32-byte keys), ``values`` (the index values, copied out of the map), ``versions`` (write
    versions), ``stored`` (header + whole payload blocks, bytes); per extent of them, ``owners``
    (position in those lists), ``starts`` and ``lens`` (blocks). ``bad``: ``(digest, value,
    reason)`` of every entry that failed a check."""

    digests: list
    values: list
    versions: list
    stored: list
    owners: list
    starts: list
    lens: list
    bad: list


def _slow(raw: memoryview, seg_blocks: int) -> tuple[int, int, tuple[tuple[int, int], ...]]:
    """``(header length, version, extents)`` of one value, by the general parsers.

    Raises:
        CorruptRecordError: naming the check that failed.
    """
    hn, version, payload_nbytes = peek_header(raw)
    if version > MAX_VERSION:
        raise CorruptRecordError(f"write version {version} is past 2**63 (the year 2262): a forged or damaged header")
    loc = unpack_location(raw[hn:])
    blocks = end = 0
    for s, n in loc.extents:
        blocks += n
        end = max(end, s + n)
    if -(-payload_nbytes // BLOCK_BYTES) > blocks:
        raise CorruptRecordError("payload location is smaller than the payload")
    if end > seg_blocks:
        raise CorruptRecordError("payload past the end of the segment file (truncated)")
    return hn, version, loc.extents


def scan_index(txn: lmdb.Transaction, db: object, seg_blocks: int) -> ScanResult:
    """Check every entry of ``db`` in ``txn`` (opened with ``buffers=True``) against a segment
    file of ``seg_blocks`` blocks. Reads no payload byte; raises nothing for a bad entry (it is
    listed in ``bad``)."""
    r = ScanResult([], [], [], [], [], [], [], [])
    digests, values, versions, stored = r.digests.append, r.values.append, r.versions.append, r.stored.append
    owners, starts, lens = r.owners.append, r.starts.append, r.lens.append
    head, head_size, trailer, loc1 = _HEAD.unpack_from, _HEAD.size, _TRAILER.unpack_from, _LOC1.unpack_from
    h64 = xxhash.xxh3_64_intdigest
    magic_ok, fmt_ok, loc_magic, max_v = RECORD_MAGIC, RECORD_FORMAT_VERSION, LOCATION_MAGIC, MAX_VERSION
    i = 0
    for digest, raw in txn.cursor(db=db):
        size = len(raw)
        hn = 0
        if size >= head_size:
            magic, fmt, _codec, hn, _raw_nbytes, pnb, _checksum, version = head(raw)
            if (magic != magic_ok or fmt != fmt_ok or hn < _MIN_HEADER or hn > MAX_HEADER_NBYTES or version > max_v
                    or size != hn + _LOC1.size or trailer(raw, hn - 8)[0] != h64(raw[:hn - 8])):
                hn = 0
            else:
                lmagic, lblock, count, s, n, lsum = loc1(raw, hn)
                if (lmagic != loc_magic or lblock != BLOCK_BYTES or count != 1 or n <= 0
                        or s + n > seg_blocks or -(-pnb // BLOCK_BYTES) > n or lsum != h64(raw[hn:hn + _LOC1_BODY])):
                    hn = 0
        if hn:
            owners(i)
            starts(s)
            lens(n)
        else:  # not the usual shape, or damaged: the general parsers say which
            try:
                hn, version, extents = _slow(raw, seg_blocks)
            except CorruptRecordError as exc:
                r.bad.append((bytes(digest), bytes(raw), str(exc)))
                continue
            n = 0
            for s, k in extents:
                owners(i)
                starts(s)
                lens(k)
                n += k
        digests(bytes(digest))
        values(bytes(raw))
        versions(version)
        stored(hn + n * BLOCK_BYTES)
        i += 1
    return r


@contextmanager
def gc_paused() -> Iterator[None]:
    """No automatic cyclic garbage collection while the body runs (re-enabled after, if it was on).

    Opening a store makes a few objects per record (100,000 records: ~300,000, none in a cycle);
    the collector's passes over them while they are made took more than half of the open
    (docs/benchmarks.md, "Reopen"). Reference counting still frees everything as usual.
    """
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def placed_entries(entries: Iterable[tuple[bytes, bytes]], seg_blocks: int) -> tuple[set[bytes], set[bytes]]:
    """:meth:`NvmeTier.stored_keys <ectier.tiers.nvme.NvmeTier.stored_keys>` over the index
    entries ``(digest, value)`` and a segment file of ``seg_blocks`` blocks: every digest, and those
    whose location holds the payload inside the file without overlapping an earlier entry's blocks."""
    meta, placed, taken = set(), set(), set()
    for k, v in entries:
        k = bytes(k)
        meta.add(k)
        try:
            header, loc = parse_index_value(v)
        except CorruptRecordError:
            continue
        blocks = {b for s, n in loc.extents for b in range(s, s + n)}
        if (blocks_for(header.payload_nbytes) <= loc.blocks and not blocks & taken
                and max((s + n for s, n in loc.extents), default=0) <= seg_blocks):
            placed.add(k)
        taken |= blocks
    return meta, placed
