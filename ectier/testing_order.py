"""A checker, for tests, of the write order a power loss relies on in the NVMe tier (layout v2).

With ``nvme.sync`` a put is durable when it returns; a power cut at any instant must leave every
committed index entry over payload bytes that are on disk, and never over bytes being rewritten
(docs/reliability.md, "Power loss"). A killed process cannot test this (its writes stay in the
page cache), so :func:`check_sync_order` watches the segment file's writes and syncs and the index's
commits and, at each of them, compares with what LMDB has committed (with ``sync`` a committed transaction is durable):

1. *synced before committed*: no committed entry points at a block written since the last
   ``fdatasync`` (a cut would leave the entry over bytes that never reached the disk);
2. *never rewritten while committed*: no write goes into a block a committed entry points at (a
   cut during it would leave the entry over torn bytes: a lost entry).

Not for production: it opens a read transaction at every write and sync.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Iterator

from .cache import TieredCache
from .errors import CorruptRecordError
from .tiers.nvme_record import parse_index_value
from .tiers.nvme_segment import Location

__all__ = ["SyncOrderCheck", "check_sync_order", "Location"]


class SyncOrderCheck:
    """What :func:`check_sync_order` saw: ``writes``, ``syncs`` (counts) and ``violations`` (one
    line each, naming the rule, the blocks and the entry)."""

    def __init__(self, env, meta_db) -> None:
        self._env, self._meta = env, meta_db
        self._lock = threading.Lock()
        self._seq = 0
        self._unsynced: dict[int, int] = {}  # block -> sequence number of the write that completed last
        self._writing: dict[int, int] = {}  # block -> writes into it in progress now
        self.writes = 0
        self.syncs = 0
        self.violations: list[str] = []

    def committed(self) -> dict[bytes, set[int]]:
        """The blocks each committed index entry points at (digest -> blocks)."""
        out: dict[bytes, set[int]] = {}
        with self._env.begin() as txn:
            for digest, raw in txn.cursor(db=self._meta):
                try:
                    _, loc = parse_index_value(raw)
                except CorruptRecordError:
                    continue  # (a damaged entry is never served; its blocks are not its own)
                out[bytes(digest)] = _blocks(loc)
        return out

    def check(self, where: str) -> None:
        """Rule 1 against what is committed now (also run at every write and sync). The snapshot
        and the unsynced blocks are read under one hold of the lock that writes and syncs take when
        they complete, so they describe one instant (a block freed, rewritten and not yet synced
        is never matched against an entry the snapshot still shows)."""
        with self._lock:
            committed = self.committed()
            unsynced = set(self._unsynced)
        for digest, blocks in committed.items():
            bad = blocks & unsynced
            if bad:
                self._violation(f"{where}: entry {digest.hex()[:16]} committed over blocks {sorted(bad)[:8]} "
                                "written since the last sync")

    def committing(self, values: list[bytes]) -> None:
        """Rule 1 at the commit itself: the index entries ``values`` about to commit point at no
        block written since the last sync, nor at one being written now."""
        with self._lock:
            unsynced = set(self._unsynced) | set(self._writing)
        for raw in values:
            try:
                _, loc = parse_index_value(raw)
            except CorruptRecordError:
                continue
            bad = _blocks(loc) & unsynced
            if bad:
                self._violation(f"commit: an entry commits over blocks {sorted(bad)[:8]} written since the last sync")

    def before_write(self, loc: Location) -> None:
        self.check("write")
        blocks = _blocks(loc)
        with self._lock:
            for b in blocks:
                self._writing[b] = self._writing.get(b, 0) + 1
        for digest, held in self.committed().items():
            bad = blocks & held
            if bad:
                self._violation(f"write: blocks {sorted(bad)[:8]} rewritten while entry {digest.hex()[:16]} "
                                "is committed over them")

    def after_write(self, loc: Location) -> None:
        """A write into ``loc`` ended (also when it raised: its blocks count as written)."""
        with self._lock:
            self._seq += 1
            self.writes += 1
            for b in _blocks(loc):
                self._unsynced[b] = self._seq
                if self._writing.get(b, 0) > 1:
                    self._writing[b] -= 1
                else:
                    self._writing.pop(b, None)

    def before_sync(self) -> int:
        self.check("sync")
        with self._lock:
            return self._seq

    def after_sync(self, seq: int) -> None:
        """The sync covered every write completed before it began (sequence ``<= seq``)."""
        with self._lock:
            self.syncs += 1
            self._unsynced = {b: s for b, s in self._unsynced.items() if s > seq}

    def truncating(self, nblocks: int) -> None:
        """Rule 2 for a truncation: no committed entry points at a block past ``nblocks``."""
        for digest, held in self.committed().items():
            cut = sorted(b for b in held if b >= nblocks)
            if cut:
                self._violation(f"truncate: blocks {cut[:8]} cut off while entry {digest.hex()[:16]} "
                                "is committed over them")

    def truncated(self, nblocks: int) -> None:
        with self._lock:
            self._unsynced = {b: s for b, s in self._unsynced.items() if b < nblocks}

    def _violation(self, text: str) -> None:
        with self._lock:
            self.violations.append(text)


def _blocks(loc: Location) -> set[int]:
    return {b for start, n in loc.extents for b in range(start, start + n)}


class _Env:
    """The tier's LMDB environment, its write transactions watched (:meth:`SyncOrderCheck.committing`)."""

    def __init__(self, env, check: SyncOrderCheck, meta_db) -> None:
        self._env, self._check, self._meta = env, check, meta_db

    def begin(self, *args, **kwargs):
        txn = self._env.begin(*args, **kwargs)
        return _Txn(txn, self._check, self._meta) if kwargs.get("write") else txn

    def __getattr__(self, name):
        return getattr(self._env, name)


class _Txn:
    def __init__(self, txn, check: SyncOrderCheck, meta_db) -> None:
        self._txn, self._check, self._meta, self._values = txn, check, meta_db, []

    def put(self, key, value, *args, **kwargs):
        if kwargs.get("db") is self._meta:
            self._values.append(bytes(value))
        return self._txn.put(key, value, *args, **kwargs)

    def commit(self):
        self._check.committing(self._values)
        return self._txn.commit()

    def __enter__(self):
        self._txn.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self._check.committing(self._values)
        return self._txn.__exit__(exc_type, exc, tb)

    def __getattr__(self, name):
        return getattr(self._txn, name)


@contextlib.contextmanager
def check_sync_order(cache: TieredCache) -> Iterator[SyncOrderCheck]:
    """Watch the NVMe tier's segment writes and syncs while the context is open (the store must
    be opened with ``nvme.sync: true``; closing it inside the context is fine); yields the :class:`SyncOrderCheck`, whose
    ``violations`` the test asserts empty. Checks rule 1 once more at the end.

    Raises:
        ValueError: the cache has no NVMe tier, or ``nvme.sync`` is off (no order to check).
    """
    nvme = cache._stack.get("nvme")
    if nvme is None or not nvme.config.sync:
        raise ValueError("check_sync_order: needs an NVMe tier with nvme.sync: true")
    store = nvme._store
    seg = store.segment
    check = SyncOrderCheck(store.env, store.meta_db)
    real_write, real_flush, real_truncate = seg.write, seg.flush, seg.truncate_blocks

    def write(loc, src):
        check.before_write(loc)
        try:
            return real_write(loc, src)
        finally:
            check.after_write(loc)

    def flush():
        seq = check.before_sync()
        real_flush()
        check.after_sync(seq)

    def truncate_blocks(nblocks):
        check.truncating(nblocks)
        real_truncate(nblocks)
        check.truncated(nblocks)

    seg.write, seg.flush, seg.truncate_blocks = write, flush, truncate_blocks
    real_env = nvme._env
    nvme._env = _Env(real_env, check, store.meta_db)  # the index commits of puts (_commit_group)
    try:
        yield check
        with store.rw.shared():
            if store.env is not None:  # (closed inside the context: checked at each sync before)
                check.check("end")
    finally:
        for name in ("write", "flush", "truncate_blocks"):
            seg.__dict__.pop(name, None)
        if isinstance(nvme._env, _Env):
            nvme._env = real_env
