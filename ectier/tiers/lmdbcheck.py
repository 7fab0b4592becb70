"""Check the live B-trees of an LMDB data file before LMDB reads them.

LMDB trusts the pages it reads: a damaged page header on a path its cursor walks trips an
``assert`` in ``mdb.c`` (e.g. ``IS_LEAF(mp)`` in ``mdb_cursor_next``) and **aborts the process**
(SIGABRT) — no error a caller could turn into a miss or a ``StoreDamagedError``. So before the
NVMe tier (or ``ectier fsck``) lets LMDB walk a store, :func:`check_tree` walks every page that
the current meta page reaches, with plain reads, and says what is wrong if anything is: the
caller then treats the store as damaged (docs/reliability.md, "Damage to LMDB's own pages").

What is checked, page by page from each database's root (the free-page database, the main one,
and every named database the main one lists): the page lies inside the file and below the meta
page's last page number, carries its own number, is of the kind its depth requires (branch above
the tree's depth, leaf at it), its node offsets and sizes lie inside it, no page is reached twice,
a key is never empty, an overflow value's run is an overflow page of that number and long enough,
no node claims sorted duplicates (ectier's databases have none), and each free-page list (what
LMDB's page allocator hands out on a later write, trusting it) fits its value and names only
pages in range that no tree uses. Layout: see
:mod:`ectier.tiers.lmdbpages` (LMDB 0.9, 64-bit little-endian). Costs one read per live page
(0.15 s of a 0.97 s reopen of 100,000 records on the 2-core development VM: docs/benchmarks.md).
"""

from __future__ import annotations

import os
import stat
import struct

from .lmdbpages import (_NODE, _OVERFLOW_HEAD, _PAGE_HEAD, _PAGE_SIZES, _PAGEHDRSZ, F_BIGDATA, F_DUPDATA, F_SUBDATA,
                        MDB_MAGIC, P_BRANCH, P_LEAF, P_LEAF2, P_META, P_OVERFLOW, P_SUBP)

__all__ = ["check_tree", "lost_index"]

#: ``MDB_db``: pad (the page size, in the free database's record of a meta page), flags, depth,
#: branch pages, leaf pages, overflow pages, entries, root
_DB = struct.Struct("<IHHQQQQQ")
_META_DBS = 24  # offset of the two MDB_db records in MDB_meta (free, main; at byte 40 of the page)
_META_LAST_PG = _META_DBS + 2 * _DB.size  # then mm_last_pg, mm_txnid
P_INVALID = (1 << 64) - 1
_KINDS = P_BRANCH | P_LEAF | P_OVERFLOW | P_META | P_LEAF2 | P_SUBP
FREE_DB = "the free-page database"


class _Damaged(Exception):
    """What the walk found wrong (the message says where)."""


def check_tree(path: str | os.PathLike) -> str | None:
    """What is wrong with the pages the current meta page of LMDB data file ``path`` reaches, or
    ``None`` when they are well formed (or the file is missing or empty: a new store).

    Raises:
        OSError: the file cannot be read.
    """
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            return None
        try:
            _Walk(fd, size).run()
        except _Damaged as exc:
            return str(exc)
        return None
    finally:
        os.close(fd)


def lost_index(store: str | os.PathLike, segment_name: str = "segment.0") -> str | None:
    """Why the store in directory ``store`` lost its index, or ``None``: ``lmdb/data.mdb`` is
    missing or empty (what :func:`check_tree` takes for a new store) while the payload segment
    holds bytes, which only a store that had an index can have (payloads are written before the
    index entries that point at them, docs/reliability.md). Opening it as new would drop them all."""
    store = os.fspath(store)
    try:
        st = os.stat(os.path.join(store, segment_name))
    except OSError:
        return None
    seg_bytes = st.st_size
    if not stat.S_ISREG(st.st_mode) or seg_bytes == 0:  # (not a file: the open says so itself)
        return None
    try:
        size = os.stat(os.path.join(store, "lmdb", "data.mdb")).st_size
    except FileNotFoundError:
        return f"lmdb/data.mdb is missing while {segment_name} holds {seg_bytes} bytes of payloads"
    except OSError:  # (``lmdb`` a file, no permission: the open says so itself)
        return None
    if size == 0:
        return f"lmdb/data.mdb is empty while {segment_name} holds {seg_bytes} bytes of payloads"
    return None


class _Walk:
    def __init__(self, fd: int, size: int) -> None:
        self.fd, self.size = fd, size
        self.seen: set[int] = set()
        self.free_lists: list[tuple[bytes | int, int]] = []  # (inline value | overflow page, bytes)

    def _read(self, offset: int, n: int) -> bytes:
        data = os.pread(self.fd, n, offset)
        if len(data) != n:
            raise _Damaged(f"data.mdb is truncated ({self.size} bytes, inside a page LMDB would read at {offset})")
        return data

    def run(self) -> None:
        head = self._read(0, _PAGEHDRSZ + _META_LAST_PG + 16)
        self.ps = _DB.unpack_from(head, _PAGEHDRSZ + _META_DBS)[0]
        if self.ps not in _PAGE_SIZES:
            raise _Damaged(f"meta page 0 states a page size of {self.ps}")
        metas = [self._meta(0, head)]
        metas.append(self._meta(1, self._read(self.ps, _PAGEHDRSZ + _META_LAST_PG + 16)))
        # LMDB uses the newer meta page. The file may end before its last page number (pages
        # allocated and freed in one transaction are never written): only a live page past the
        # end is damage, found when it is read (_read)
        free, main, self.last_pg = max(metas, key=lambda m: m[3])[:3]
        self._tree(free, FREE_DB)
        for name, db in self._tree(main, "the main database"):
            self._tree(db, f"database {name!r}")
        for value, size in self.free_lists:
            self._free_list(value, size)

    def _free_list(self, value: bytes | int, size: int) -> None:
        """A free-page list (``MDB_IDL``: a u64 count, then that many page numbers; LMDB's page
        allocator hands them out on a later write, trusting each): the count fits the value, and
        every page lies in 2..last_pg and is no live page."""
        data = value if isinstance(value, bytes) else self._read(value * self.ps + _PAGEHDRSZ, size)
        count = struct.unpack_from("<Q", data)[0] if size >= 8 else -1
        if size % 8 or not 0 <= count < size // 8:
            raise _Damaged(f"{FREE_DB}: a free-page list of {size} bytes says it holds {count} pages")
        ids = struct.unpack_from(f"<{count}Q", data, 8)
        bad = next((i for i in ids if not 2 <= i <= self.last_pg or i in self.seen), None)
        if bad is not None:
            raise _Damaged(f"{FREE_DB}: page {bad} is listed free but is {'live' if bad in self.seen else 'no page'}")

    def _meta(self, n: int, page: bytes) -> tuple:
        pgno, _, flags = _PAGE_HEAD.unpack_from(page)[:3]
        magic = struct.unpack_from("<I", page, _PAGEHDRSZ)[0]
        if pgno != n or not flags & P_META or magic != MDB_MAGIC:
            raise _Damaged(f"meta page {n} is not a meta page")
        free = _DB.unpack_from(page, _PAGEHDRSZ + _META_DBS)
        main = _DB.unpack_from(page, _PAGEHDRSZ + _META_DBS + _DB.size)
        last_pg, txnid = struct.unpack_from("<QQ", page, _PAGEHDRSZ + _META_LAST_PG)
        return free, main, last_pg, txnid

    def _tree(self, db: tuple, what: str) -> list[tuple[bytes, tuple]]:
        """Check the tree of MDB_db record ``db``; returns the named databases its leaves list."""
        depth, root = db[2], db[7]
        if root == P_INVALID:
            if depth:
                raise _Damaged(f"{what}: no root page but a depth of {depth}")
            return []
        named: list[tuple[bytes, tuple]] = []
        stack = [(root, 1)]
        while stack:
            pgno, level = stack.pop()
            page = self._page(pgno, what)
            want = P_LEAF if level == depth else P_BRANCH
            flags = _PAGE_HEAD.unpack_from(page)[2]
            if level > depth or flags & _KINDS != want:
                raise _Damaged(f"{what}: page {pgno} at level {level} of {depth} has flags {flags:#x}")
            for off in self._nodes(page, pgno, what):
                lo, hi, nflags, ksize = _NODE.unpack_from(page, off)
                kend = off + _NODE.size + ksize
                if kend > self.ps:
                    raise _Damaged(f"{what}: a key of page {pgno} runs past the page")
                if want == P_BRANCH:
                    stack.append((self._pgno(lo | hi << 16 | nflags << 32, what), level + 1))
                else:
                    named.extend(self._leaf_node(page, pgno, off, kend, ksize, lo | hi << 16, nflags, what))
        return named

    def _page(self, pgno: int, what: str) -> bytes:
        self._pgno(pgno, what)
        if pgno in self.seen:
            raise _Damaged(f"{what}: page {pgno} is reached twice")
        self.seen.add(pgno)
        page = self._read(pgno * self.ps, self.ps)
        if _PAGE_HEAD.unpack_from(page)[0] != pgno:
            raise _Damaged(f"{what}: page {pgno} does not carry its own number")
        return page

    def _pgno(self, pgno: int, what: str) -> int:
        if not 2 <= pgno <= self.last_pg:
            raise _Damaged(f"{what}: a page number {pgno} outside 2..{self.last_pg}")
        return pgno

    def _nodes(self, page: bytes, pgno: int, what: str) -> list[int]:
        lower, upper = _PAGE_HEAD.unpack_from(page)[3:5]
        if not _PAGEHDRSZ <= lower <= upper <= self.ps or (lower - _PAGEHDRSZ) % 2:
            raise _Damaged(f"{what}: page {pgno} has bounds {lower}..{upper}")
        offsets = struct.unpack_from(f"<{(lower - _PAGEHDRSZ) // 2}H", page, _PAGEHDRSZ)
        if not offsets or any(not upper <= o <= self.ps - _NODE.size or o % 2 for o in offsets):
            raise _Damaged(f"{what}: page {pgno} has a node outside {upper}..{self.ps} (or none)")
        return list(offsets)

    def _leaf_node(self, page: bytes, pgno: int, off: int, kend: int, ksize: int, size: int, nflags: int,
                   what: str) -> list[tuple[bytes, tuple]]:
        if ksize == 0:
            raise _Damaged(f"{what}: an empty key in page {pgno}")
        if nflags & F_DUPDATA:
            raise _Damaged(f"{what}: a node of page {pgno} claims sorted duplicates")
        if nflags & F_BIGDATA:
            if kend + 8 > self.ps:
                raise _Damaged(f"{what}: an overflow reference of page {pgno} runs past the page")
            first = struct.unpack_from("<Q", page, kend)[0]
            self._overflow(first, size, what)
            if what == FREE_DB:
                self.free_lists.append((first, size))
            return []
        if kend + size > self.ps:
            raise _Damaged(f"{what}: a value of page {pgno} runs past the page")
        if what == FREE_DB:
            self.free_lists.append((bytes(page[kend:kend + size]), size))
        if nflags & F_SUBDATA:
            if size != _DB.size:
                raise _Damaged(f"{what}: a named database record of {size} bytes in page {pgno}")
            return [(page[off + _NODE.size:kend], _DB.unpack_from(page, kend))]
        return []

    def _overflow(self, pgno: int, size: int, what: str) -> None:
        head = self._page(pgno, what)
        flags, pages = _OVERFLOW_HEAD.unpack_from(head)[2:4]
        if flags & _KINDS != P_OVERFLOW or pages < 1 or pgno + pages - 1 > self.last_pg \
                or pages * self.ps - _PAGEHDRSZ < size:
            raise _Damaged(f"{what}: the overflow run at page {pgno} ({pages} pages, flags {flags:#x}) "
                           f"cannot hold a {size}-byte value")
        self.seen.update(range(pgno + 1, pgno + pages))
