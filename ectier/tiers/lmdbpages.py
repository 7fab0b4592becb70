"""Read the key/value pairs of an LMDB data file page by page, without LMDB (salvage for ``ectier fsck``).

When LMDB cannot open a store (its two meta pages zeroed, garbage in B-tree pages), the records
are usually still in ``data.mdb``: every leaf page that survived holds whole key/value pairs, and
large values sit in overflow pages that the leaf points to. This module walks the file with plain
reads (never a memory map: a short file cannot ``SIGBUS``), bounds-checks everything, and yields
what it finds, and the overflow runs it saw (a value whose leaf was destroyed is still in one);
the caller decides what is genuine (ectier records carry their own checksums).

It also finds pairs from pages LMDB had freed (older versions, deleted records) — the file does
not say which pages were live once the meta pages are gone.

LMDB 0.9 page layout, 64-bit little-endian builds (``mdb.c``: ``MDB_page``, ``MDB_node``): a
16-byte page header ``pgno u64, pad u16, flags u16, lower u16, upper u16`` (an overflow page has
``pages u32`` in place of lower/upper). A leaf page holds ``(lower - 16) / 2`` node offsets
(``u16``, from the page start); a node is ``lo u16, hi u16, flags u16, ksize u16`` (value size
``lo | hi << 16``), the key, then the value — or, with ``F_BIGDATA``, the ``u64`` number of the
overflow page whose value starts 16 bytes in. Page 0 and 1 are meta pages (magic ``0xBEEFC0DE``
at offset 16, the page size at offset 40).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from typing import BinaryIO, Iterator

__all__ = ["LeafValue", "PageFile"]

_PAGE_HEAD = struct.Struct("<QHHHH")  # pgno, pad, flags, lower, upper
_OVERFLOW_HEAD = struct.Struct("<QHHI")  # pgno, pad, flags, pages
_NODE = struct.Struct("<HHHH")  # lo, hi, flags, ksize
_PAGEHDRSZ = 16
P_BRANCH, P_LEAF, P_OVERFLOW, P_META, P_LEAF2, P_SUBP = 0x01, 0x02, 0x04, 0x08, 0x20, 0x40
F_BIGDATA, F_SUBDATA, F_DUPDATA = 0x01, 0x02, 0x04
MDB_MAGIC = 0xBEEFC0DE
_PAGE_SIZES = (4096, 8192, 16384, 32768, 65536)
_CHUNK_BYTES = 8 << 20


@dataclass(frozen=True)
class LeafValue:
    """One key/value pair found in a leaf page: ``key``, the value ``size`` in bytes, and either
    ``inline`` (the value, stored in the leaf) or ``overflow_pgno`` (read it with
    :meth:`PageFile.read_value`)."""

    key: bytes
    size: int
    inline: bytes | None = None
    overflow_pgno: int | None = None


class PageFile:
    """A ``data.mdb`` opened for page-by-page reading.

    Args:
        path: the data file.

    Raises:
        OSError: the file cannot be opened.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self._f: BinaryIO = open(path, "rb")
        self.size = os.fstat(self._f.fileno()).st_size
        self.page_size = self._detect_page_size()
        self.pages = self.size // self.page_size
        self.damaged_pages = 0  # pages that are neither a page of their number nor data of an overflow run
        self.overflow_runs: list[tuple[int, int]] = []  # (first page, pages) of every overflow run seen

    def close(self) -> None:
        self._f.close()

    def __enter__(self) -> "PageFile":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _pread(self, offset: int, n: int) -> bytes:
        return os.pread(self._f.fileno(), n, offset)

    def _detect_page_size(self) -> int:
        """The page size a meta page states, else the candidate size at which most pages carry
        their own number (both meta pages destroyed)."""
        for ps in (0,) + _PAGE_SIZES:  # meta page 0, then meta page 1 at each candidate size
            head = self._pread(ps, 48)
            if len(head) == 48 and struct.unpack_from("<I", head, 16)[0] == MDB_MAGIC:
                stated = struct.unpack_from("<I", head, 40)[0]
                if stated in _PAGE_SIZES and (ps == 0 or ps == stated):
                    return stated
        best, best_score = 4096, -1
        for ps in _PAGE_SIZES:
            score = 0
            for pgno in range(2, min(self.size // ps, 512)):
                head = self._pread(pgno * ps, 8)
                if len(head) == 8 and struct.unpack("<Q", head)[0] == pgno:
                    score += 1
            if score > best_score:
                best, best_score = ps, score
        return best

    def iter_leaf_values(self) -> Iterator[LeafValue]:
        """Every key/value pair of every intact-looking leaf page, in file order (duplicates
        included: LMDB copies pages on write). Named-database records and sorted duplicates are
        skipped."""
        ps = self.page_size
        per_chunk = max(1, _CHUNK_BYTES // ps)
        self.damaged_pages = 0
        self.overflow_runs = []
        overflow_until = 0  # pages up to here may be the data of an overflow run
        for first in range(2, self.pages, per_chunk):
            chunk = self._pread(first * ps, min(per_chunk, self.pages - first) * ps)
            for i in range(len(chunk) // ps):
                pgno = first + i
                page = memoryview(chunk)[i * ps:(i + 1) * ps]
                own, _, flags, lower, upper = _PAGE_HEAD.unpack_from(page)
                if own != pgno:
                    if pgno >= overflow_until:
                        self.damaged_pages += 1
                    continue
                if flags & P_OVERFLOW:
                    pages = _OVERFLOW_HEAD.unpack_from(page)[3]
                    self.overflow_runs.append((pgno, pages))
                    overflow_until = max(overflow_until, pgno + pages)
                    continue
                if flags & P_LEAF and not flags & (P_LEAF2 | P_SUBP):
                    yield from self._leaf_values(page, lower, upper)
                elif not flags & (P_BRANCH | P_META | P_LEAF) and pgno >= overflow_until:
                    self.damaged_pages += 1

    def _leaf_values(self, page: memoryview, lower: int, upper: int) -> Iterator[LeafValue]:
        ps = len(page)
        if not _PAGEHDRSZ <= lower <= upper <= ps:
            self.damaged_pages += 1
            return
        for k in range((lower - _PAGEHDRSZ) // 2):
            (off,) = struct.unpack_from("<H", page, _PAGEHDRSZ + 2 * k)
            if off < upper or off + _NODE.size > ps:
                continue
            lo, hi, nflags, ksize = _NODE.unpack_from(page, off)
            size = lo | (hi << 16)
            kstart = off + _NODE.size
            kend = kstart + ksize
            if nflags & (F_SUBDATA | F_DUPDATA) or kend > ps:
                continue
            key = bytes(page[kstart:kend])
            if nflags & F_BIGDATA:
                if kend + 8 <= ps:
                    yield LeafValue(key, size, overflow_pgno=struct.unpack_from("<Q", page, kend)[0])
            elif kend + size <= ps:
                yield LeafValue(key, size, inline=bytes(page[kend:kend + size]))

    def overflow_pages(self, size: int) -> int:
        """Pages LMDB allocates for an overflow value of ``size`` bytes."""
        return (_PAGEHDRSZ - 1 + size) // self.page_size + 1

    def read_value(self, value: LeafValue) -> bytes | None:
        """The bytes of ``value``: its inline bytes, or those of its overflow run — ``None`` when
        the run is outside the file, is not an overflow page of that number, or is too short."""
        if value.inline is not None:
            return value.inline
        pgno, ps = value.overflow_pgno, self.page_size
        if pgno is None or pgno < 2 or (pgno + 1) * ps > self.size:
            return None
        head = self._pread(pgno * ps, _OVERFLOW_HEAD.size)
        own, _, flags, pages = _OVERFLOW_HEAD.unpack_from(head)
        if own != pgno or not flags & P_OVERFLOW or pages * ps - _PAGEHDRSZ < value.size:
            return None
        data = self._pread(pgno * ps + _PAGEHDRSZ, value.size)
        return data if len(data) == value.size else None
