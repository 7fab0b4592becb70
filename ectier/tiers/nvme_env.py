"""The LMDB index and the segment file of one NVMe store directory, for :class:`~ectier.tiers.nvme.NvmeTier`.

:class:`NvmeEnv` takes the directory lock, opens the environment (file size, store format — a
layout-v1 store is migrated, :mod:`ectier.tiers.nvme_migrate` — scan of the index entries into the
tier's index and of their extents into the free-space map), handles a damaged store
(``nvme.on_damaged``; a repair's swap a kill cut is finished first: :mod:`ectier.tiers.repairswap`), grows the map, and closes it all again. The layout and the contract are in
:mod:`ectier.tiers.nvme`.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import lmdb
import numpy as np

from ..config import NvmeTierConfig
from ..entry import entry_digest
from ..errors import (CacheClosedError, ConfigError, CorruptRecordError, StoreDamagedError, StoreLockedError,
                      StoreOpenError, TierWriteError)
from .lmdbcheck import check_tree, lost_index
from .nvme_index import NvmeIndex, NvmeRecord
from .nvme_errors import NvmeDiskFullError, lmdb_write_error, write_error, write_error_text  # noqa: F401 (re-exported)
from .nvme_migrate import migrate_v1
from .nvme_reserve import LmdbReserve, reserve_bytes
from .nvme_scan import gc_paused, scan_index
from .repairswap import finish_pending
from .nvme_segment import BLOCK_BYTES, SEGMENT_NAME, ExtentSpace, SegmentFile, blocks_for, check_capacity
from .storedir import (check_local_filesystem, check_space, drop_store_lock, missing_dirs, move_aside, remove_created,
                       sync_dirs, take_store_lock)
from .storedir import free_bytes as free_disk_bytes

__all__ = ["NvmeEnv", "RWLock", "STORE_FORMAT", "RELEASE_MARKER", "write_error_text", "lmdb_write_error", "free_disk_bytes",
           "NvmeDiskFullError", "write_error"]

log = logging.getLogger("ectier.tiers.nvme")  # the tier's logger: where these messages always came from

#: Version of the directory layout (bumped only for incompatible changes). 2: payloads in the
#: segment file, LMDB holds the index only; a store of format 1 is migrated at open.
STORE_FORMAT = 2

#: ``settings`` key rewritten by a write that found the map full, so that LMDB reuses freed pages.
RELEASE_MARKER = b"freed_pages_released"

#: LMDB errors at open that mean the environment itself is damaged (others, such as a permission
#: error or a library of another version, are not: ``nvme.on_damaged: reset`` never moves those).
# (at open, MDB_BAD_VALSIZE can only come from a key or value read from the file)
_DAMAGE_ERRORS = (lmdb.InvalidError, lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.BadTxnError,
                  lmdb.IncompatibleError, lmdb.BadChecksumError, lmdb.BadValsizeError)


def _damaged_hint(path: Path) -> str:
    return (f"run `ectier fsck --path {str(path)!r} --repair` to keep its intact records, or set "
            "nvme.on_damaged: reset to start with an empty store (the damaged one is moved aside)")


#: what to do about a store whose index is gone (:func:`lost_index`): nothing can be repaired
LOST_INDEX_HINT = ("its payloads carry no keys, so nothing can be salvaged: remove the directory, or set "
                   "nvme.on_damaged: reset to start with an empty store (the damaged one is moved aside)")


class RWLock:
    """Many shared holders or one exclusive holder: every transaction and every segment file read
    or write holds it shared; a map resize and close hold it exclusively.

    ``with rw.shared():`` is on every read's path, so taking and releasing it shared is one
    :class:`threading.Lock` each (C level: no :class:`threading.Condition` method, no ``notify_all``
    unless an exclusive holder waits for the shared ones to leave).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cond = threading.Condition(self._lock)
        self._shared = 0
        self._exclusive = False
        self._shared_ctx = _Shared(self)

    def shared(self) -> "_Shared":
        """A context manager holding the lock shared (waits while an exclusive holder has it)."""
        return self._shared_ctx

    def acquire_shared(self) -> None:
        with self._lock:
            if not self._exclusive:
                self._shared += 1
                return
            while self._exclusive:
                self._cond.wait()
            self._shared += 1

    def release_shared(self) -> None:
        with self._lock:
            self._shared -= 1
            if self._exclusive and self._shared == 0:
                self._cond.notify_all()  # the exclusive holder waits for the last shared one

    @contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            while self._exclusive:
                self._cond.wait()
            self._exclusive = True
            while self._shared:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()


class _Shared:
    """``RWLock.shared()``: one object per lock, re-entered by every holder (it keeps no state)."""

    __slots__ = ("_rw",)

    def __init__(self, rw: RWLock) -> None:
        self._rw = rw

    def __enter__(self) -> None:
        self._rw.acquire_shared()

    def __exit__(self, *exc: object) -> None:
        self._rw.release_shared()


class NvmeEnv:
    """The directory lock and the LMDB environment under ``config.path``, and their life cycle.

    Args:
        config: :class:`~ectier.config.NvmeTierConfig` with ``path`` set.
        index: the tier's index; :meth:`open` loads every stored header into it.
        counters: the tier's counters (``quarantined``, ``orphans_reclaimed``, ``write_errors``,
            ``map_growths``, ``damaged_resets`` are counted here).

    Attributes ``env``, ``meta_db``, ``quarantine_db`` and ``settings_db`` are the
    environment and its four databases once open (``env`` is ``None`` when closed). ``rw`` is
    held shared by every transaction and segment file access, exclusively by a map resize or close; ``write_lock``
    serialises the writers.
    """

    def __init__(self, config: NvmeTierConfig, index: NvmeIndex, counters: dict[str, int]) -> None:
        self.config = config
        self.path = Path(os.path.abspath(config.path))
        self.index = index
        self.counters = counters
        self.env: lmdb.Environment | None = None
        self.meta_db = self.quarantine_db = self.settings_db = None
        self.segment: SegmentFile | None = None
        self.reserve: LmdbReserve | None = None  # disk space held for LMDB (nvme_reserve.py)
        self.space = ExtentSpace(blocks_for(config.capacity_bytes), self._cut_segment)
        self.rw = RWLock()
        self.write_lock = threading.Lock()
        self._lock_file = None

    # ------------------------------------------------------------------------------- opening

    def open(self) -> None:
        """Lock the directory, open the environment and load the headers into the index.

        Raises:
            StoreOpenError, StoreDamagedError, StoreLockedError, ConfigError: as
                :class:`~ectier.tiers.nvme.NvmeTier`; nothing stays open or locked then.
        """
        check_capacity(self.config.capacity_bytes)  # (before anything is created)
        check_local_filesystem(self.path, allow=self.config.allow_network_fs)
        created = missing_dirs(self.path)
        try:
            self._lock_directory()
            if finish_pending(self.path, "nvme.path") is not None:  # (repairswap.py: why roll forward here)
                log.warning("nvme tier: finished the swap of an `ectier fsck --repair` killed during it in %s", self.path)
            try:
                self._open_env()
            except StoreDamagedError as exc:
                if self.config.on_damaged != "reset":
                    raise
                self._reset_damaged(exc)
            self._check_space()
            if self.config.sync:
                sync_dirs(self.path, created)
        except BaseException:
            self.close()
            remove_created(created)  # a refused open leaves no directory it made
            raise

    def _check_space(self) -> None:
        """:func:`check_space`, except that a budget accepted at an earlier open of this store (then
        the disk filled up: the tier evicts its own records on a full disk) is only a WARNING."""
        cap = self.config.capacity_bytes
        with self.env.begin(write=False) as txn:
            accepted = int(txn.get(b"capacity_accepted", b"0", db=self.settings_db))
        try:
            check_space(self.path, cap, self.index.used_bytes, thin=self.config.thin_provisioning)
        except ConfigError as exc:
            if not (self.index.used_bytes and cap <= accepted):
                raise
            log.warning("%s; opened anyway: this budget was accepted at an earlier open of the store "
                        "(on a full disk the tier evicts its own least valuable records)", exc)
            return
        if cap != accepted:
            with self.env.begin(write=True) as txn:
                txn.put(b"capacity_accepted", str(cap).encode(), db=self.settings_db)

    def _lock_directory(self) -> None:
        """Create ``nvme.path`` if needed and take its ``flock`` (StoreOpenError / StoreLockedError)."""
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except FileExistsError:
            raise StoreOpenError(f"nvme.path: {str(self.path)!r} exists and is not a directory") from None
        except OSError as exc:
            raise StoreOpenError(f"nvme.path: cannot create {str(self.path)!r}: {exc.strerror}") from None
        if not self.path.is_dir():
            raise StoreOpenError(f"nvme.path: {str(self.path)!r} is not a directory")
        try:
            self._lock_file = open(self.path / "ectier.lock", "a+")
        except OSError as exc:
            raise StoreOpenError(f"nvme.path: cannot write in {str(self.path)!r}: {exc.strerror}") from None
        holder = take_store_lock(self._lock_file)
        if holder is not None:
            self._lock_file.close()
            self._lock_file = None
            raise StoreLockedError(
                f"nvme.path: {str(self.path)!r} is in use by {holder}; give each cache its own "
                "directory, or share one store through the ectier daemon")

    def _open_env(self) -> None:
        """Open LMDB under the held lock and load the headers.

        Raises:
            StoreDamagedError: a page of the live B-trees is malformed or lies past the end of
                ``data.mdb`` (:func:`check_tree`, run before LMDB reads one: LMDB aborts the
                process on a malformed page, and a page past the end is a SIGBUS through its map),
                or LMDB reports the environment damaged (the environment is closed again; the
                lock stays held). A file that ends before LMDB's last page number is not damage by
                itself: pages allocated and freed in one transaction are never written.
            StoreOpenError: another LMDB error, or a store of another format.
        """
        lost = lost_index(self.path, SEGMENT_NAME)
        if lost is not None:
            raise StoreDamagedError(f"nvme.path: the store in {str(self.path)!r} lost its index ({lost}); "
                                    + LOST_INDEX_HINT)
        try:  # before LMDB walks a page: it aborts the process on a malformed one
            problem = check_tree(self.path / "lmdb" / "data.mdb")
        except OSError as exc:
            raise StoreOpenError(f"nvme.path: cannot read {str(self.path / 'lmdb' / 'data.mdb')!r}: "
                                 f"{exc.strerror or exc}") from None
        if problem is not None:
            raise StoreDamagedError(f"nvme.path: the LMDB store in {str(self.path)!r} is damaged ({problem}); "
                                    + _damaged_hint(self.path))
        try:
            self.env = lmdb.open(
                str(self.path / "lmdb"),
                map_size=self.config.map_initial_bytes,
                subdir=True,
                max_dbs=4,
                sync=self.config.sync,
                metasync=self.config.sync,
                writemap=False,  # with writemap a full disk is SIGBUS; without it, ENOSPC
                readahead=True,  # payloads are read whole and in order: let the kernel read ahead
                meminit=False,
                max_readers=1024,
                lock=True,
            )
            self.reserve = LmdbReserve(self.path / "lmdb" / "data.mdb", reserve_bytes(self.config.capacity_bytes))
            self.reserve.keep()
            self.meta_db = self.env.open_db(b"meta")
            self.quarantine_db = self.env.open_db(b"quarantine")
            self.settings_db = self.env.open_db(b"settings")
            self.segment = SegmentFile(str(self.path / SEGMENT_NAME), sync=self.config.sync,
                                       read_threads=self.config.read_threads)
            if self._check_settings() == b"1":
                migrate_v1(self)
            self._scan()
        except lmdb.Error as exc:
            self._close_env()
            if isinstance(exc, _DAMAGE_ERRORS):
                raise StoreDamagedError(
                    f"nvme.path: cannot open LMDB store in {str(self.path)!r}: {exc}; {_damaged_hint(self.path)}") from None
            raise StoreOpenError(f"nvme.path: cannot open LMDB store in {str(self.path)!r}: {exc}") from None
        except OSError as exc:  # e.g. segment.0 a directory, or unreadable
            self._close_env()
            raise StoreOpenError(f"nvme.path: cannot open the store in {str(self.path)!r}: {exc}") from None
        except BaseException:
            self._close_env()
            raise

    def _cut_segment(self, nblocks: int) -> None:
        """The region shrank to ``nblocks``: give the free end of the segment file back."""
        seg = self.segment
        if seg is not None and os.fstat(seg.fd).st_size > nblocks * BLOCK_BYTES:
            seg.truncate_blocks(nblocks)

    def _close_env(self) -> None:
        if self.env is not None:
            with self.rw.exclusive():
                self.env.close()
                self.env = None
                if self.reserve is not None:
                    self.reserve.close()
                    self.reserve = None
                if self.segment is not None:
                    self.segment.close()
                    self.segment = None

    def _reset_damaged(self, exc: StoreDamagedError) -> None:
        """``nvme.on_damaged: reset``: move the damaged environment aside, open an empty one."""
        try:
            moved = move_aside(self.path)
        except OSError as err:
            raise StoreOpenError(
                f"{exc}; nvme.on_damaged is 'reset' but the store cannot be moved aside: {err}") from None
        self.index.load({})
        log.warning(
            "nvme tier: the store in %s is damaged (%s); nvme.on_damaged is 'reset': moved it to %s and "
            "started with an empty store (salvage or inspect it with `ectier fsck --path %s`, then delete it)",
            self.path, str(exc).split("; ")[0], moved, moved)
        self._open_env()
        self.counters["damaged_resets"] += 1

    def _check_settings(self) -> bytes:
        """The store format (written on a new store); a format this ectier does not read is refused.

        Raises:
            StoreOpenError: a format other than 1 (migrated by the caller) or :data:`STORE_FORMAT`.
        """
        assert self.env is not None
        with self.env.begin(write=True) as txn:
            fmt = txn.get(b"format", db=self.settings_db)
            if fmt is None:
                txn.put(b"format", str(STORE_FORMAT).encode(), db=self.settings_db)
                txn.put(b"created", json.dumps({"time": time.time()}).encode(), db=self.settings_db)
                return str(STORE_FORMAT).encode()
            if fmt not in (b"1", str(STORE_FORMAT).encode()):
                raise StoreOpenError(
                    f"nvme.path: {str(self.path)!r} holds store format {fmt.decode(errors='replace')}, "
                    f"this ectier reads formats 1 (migrated at open) and {STORE_FORMAT}"
                )
            return bytes(fmt)

    def _scan(self) -> None:
        """Load every index entry into the index and its extents into the free-space map;
        quarantine bad entries. Reads no payload byte (:func:`~ectier.tiers.nvme_scan.scan_index`).

        Blocks no entry names are free (the space of a payload whose index entry never committed
        is reclaimed so). Entries whose blocks overlap (possible only after a lost commit of a
        delete: ``nvme.sync`` off and a power loss) keep the newest; the older are quarantined.
        """
        assert self.env is not None and self.segment is not None
        with gc_paused():
            self._scan_records()

    def _scan_records(self) -> None:
        assert self.env is not None and self.segment is not None
        with self.env.begin(buffers=True) as txn:
            r = scan_index(txn, self.meta_db, self.segment.size_blocks())
        bad = r.bad
        versions = np.array(r.versions, dtype=np.uint64)
        order = np.argsort(versions, kind="stable").tolist()  # oldest write first: the policy order
        digests, values, stored, ver = r.digests, r.values, r.stored, r.versions
        found = {digests[i]: NvmeRecord(None, stored[i], None, values[i], ver[i]) for i in order}
        st = np.array(r.starts, dtype=np.int64)
        ln = np.array(r.lens, dtype=np.int64)
        by_start = np.argsort(st, kind="stable")
        st, ln = st[by_start], ln[by_start]
        if len(st) and (st[1:] < np.maximum.accumulate(st + ln)[:-1]).any():  # never in a healthy store
            clashes, used = self._overlaps(found)
            bad.extend(clashes)
            st = np.array([s for s, _ in used], dtype=np.int64)
            ln = np.array([n for _, n in used], dtype=np.int64)
        self.index.load(found)
        self.space.rebuild_arrays(st, ln)
        end = int((st + ln).max()) if len(st) else 0
        if self.segment.size_blocks() > end:  # nothing past the last record's blocks is in use
            self.segment.truncate_blocks(end)
        if bad:
            with self.env.begin(write=True) as txn:
                for digest, raw, reason in bad:
                    self.quarantine_in(txn, digest, raw, reason)
            by_reason: dict[str, list[str]] = {}
            for digest, _, reason in bad:
                by_reason.setdefault(reason, []).append(digest.hex()[:16])
            for reason, digests in by_reason.items():  # one line per reason, however many records
                log.warning("nvme tier: quarantined %d record(s) at open in %s: %s (%s%s)", len(digests), self.path,
                            reason, ", ".join(digests[:3]), ", ..." if len(digests) > 3 else "")
        log.info("nvme tier: opened %s with %d records, %d bytes", self.path, len(self.index), self.index.used_bytes)

    def _overlaps(self, found: dict[bytes, NvmeRecord]) -> tuple[list[tuple[bytes, bytes, str]], list[tuple[int, int]]]:
        """Remove from ``found`` every record whose blocks overlap another's and that does not own
        them: the payloads of overlapping records are read and checked (their checksums decide;
        of two that both pass, the newer keeps the blocks). Returns them as ``(digest, index
        value, reason)`` to quarantine, and the extents of the records kept, sorted by start.
        Called only when some blocks overlap: never in a healthy store."""
        runs = sorted((s, s + n, d) for d, rec in found.items() for s, n in rec.location.extents)
        clash: set[bytes] = set()
        reach, holder = -1, None
        for start, end, digest in runs:
            if holder is not None and start < reach and holder != digest:
                clash.update((digest, holder))
            if end > reach:
                reach, holder = end, digest
        good = {d for d in clash if self._payload_ok(d, found[d])}
        owner: dict[int, bytes] = {}  # block -> the newest good record holding it
        for d in sorted(good, key=lambda d: found[d].version):
            for s, n in found[d].location.extents:
                for blk in range(s, s + n):
                    owner[blk] = d
        out = []
        for d in clash:
            rec = found[d]
            if d in good and all(owner.get(blk) == d for s, n in rec.location.extents for blk in range(s, s + n)):
                continue
            del found[d]
            reason = ("payload blocks overlap another record's (reused extent)" if d in good
                      else "payload checksum mismatch (its blocks overlap another record's: reused extent)")
            out.append((d, rec.value, reason))
        return out, sorted(e for rec in found.values() for e in rec.location.extents)

    def _payload_ok(self, digest: bytes, rec: NvmeRecord) -> bool:
        """Whether ``rec`` is stored under its own identity and its payload reads back with its
        checksum (the open-time check of records whose blocks clash)."""
        assert self.segment is not None
        try:
            h = rec.header
            if entry_digest(h.namespace, h.key) != digest:
                return False
            buf = bytearray(h.payload_nbytes)
            return self.segment.read_into(rec.location, memoryview(buf)) == h.payload_checksum
        except (CorruptRecordError, OSError):
            return False

    # ------------------------------------------------------------------------------- in service

    def quarantine_in(self, txn: lmdb.Transaction, digest: bytes, raw_header: bytes, reason: str) -> None:
        """In write transaction ``txn``: move the index entry of ``digest`` out of ``meta`` and note
        ``reason`` (and the entry) under ``quarantine``. Its blocks are not freed here (a damaged
        location may name another record's blocks); the next open rebuilds the free-space map."""
        note = {"reason": reason, "time": time.time(), "header": raw_header[:4096].hex()}
        txn.put(digest, json.dumps(note).encode(), db=self.quarantine_db)
        txn.delete(digest, db=self.meta_db)
        self.counters["quarantined"] += 1

    def release_freed_pages(self) -> bool:
        """Commit a tiny marker write so that pages freed by earlier transactions become reusable.

        LMDB hands out pages freed by transaction T only to a write transaction that starts after
        a later one (T+1) committed; an aborted write does not move that point. Without this, at the
        map ceiling a put after a delete of the same size failed until some unrelated write
        committed. Called with the write lock held; returns False if even the marker did not fit.
        """
        assert self.env is not None
        try:
            with self.env.begin(write=True) as txn:
                txn.put(RELEASE_MARKER, str(time.time_ns()).encode(), db=self.settings_db)
        except lmdb.Error:
            return False
        return True

    def grow(self, need_bytes: int) -> None:
        """Grow the map (doubling, at least ``need_bytes`` of room), excluding every transaction.

        Raises:
            TierWriteError: the map is already at ``nvme.map_ceiling_bytes``.
        """
        ceiling = self.config.map_ceiling_bytes
        with self.rw.exclusive():
            if self.env is None:
                raise CacheClosedError("cache is closed")
            current = self.env.info()["map_size"]
            if current >= ceiling:
                self.counters["write_errors"] += 1
                raise TierWriteError(
                    f"nvme tier: LMDB map full at its ceiling of {ceiling} bytes; raise nvme.map_max_bytes "
                    f"or lower nvme.capacity_bytes"
                )
            new = min(ceiling, max(2 * current, current + 2 * need_bytes + (16 << 20)))
            self.env.set_mapsize(new)
            self.counters["map_growths"] += 1
            log.info("nvme tier: LMDB map grown from %d to %d bytes", current, new)

    # ------------------------------------------------------------------------------- closing

    def close(self) -> None:
        """Close LMDB (committed data is already durable) and release the directory lock. Idempotent."""
        self._close_env()
        if self._lock_file is not None:
            try:
                drop_store_lock(self._lock_file)
            finally:
                self._lock_file.close()
                self._lock_file = None
