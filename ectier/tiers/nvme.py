"""NVMe tier: self-describing, checksummed records in an LMDB environment under one directory.

Layout under ``nvme.path``::

    ectier.lock        flock'ed by the one process that owns the store (StoreLockedError otherwise)
    lmdb/data.mdb      the LMDB environment, four named databases:
        meta           digest (32 B) -> packed RecordHeader (magic, version, codec, dtype, shape,
                       namespace, key, sizes, payload checksum, write version; own checksum)
        data           digest -> stored payload (raw or compressed bytes)
        quarantine     digest -> JSON {reason, time, header hex} of records that failed a check
        settings       store format and creation facts, checked on reopen

Contract (docs/operations.md, "The NVMe tier on disk"):

- **Atomic writes.** Header and payload go in one LMDB write transaction: after a crash at any
  point a record is either wholly there (old or new) or absent, never torn.
- **Checked reads.** Every read checks the header (magic, format, its own checksum), the identity
  (namespace and key), the payload length and its xxh3-64 checksum, and the decoded length. Any
  failure quarantines the record (moved out of ``meta``/``data``), counts it, and reads as a miss.
- **Restart.** Opening the directory again scans ``meta`` (headers) and the payload keys, never
  the payload bytes, and serves every committed record; headers that fail to parse or lack a
  payload are quarantined, payloads without a header are reclaimed as orphans; a damaged payload
  is caught by the checks of its first read.
- **Map growth.** The map starts at ``nvme.map_initial_bytes`` and doubles when LMDB reports it full,
  up to ``nvme.map_ceiling_bytes``; beyond that a write fails with :class:`TierWriteError`. Before
  growing, a write that found the map full commits a marker (``settings``) and retries once, so
  that pages freed by earlier deletes become reusable (LMDB reuses them only after a later commit).
- **Disk full / I/O errors** fail that one write with :class:`TierWriteError`; reads and the other
  tiers keep working.

Threads: the tier is safe to share between threads. Writes are serialised (LMDB has one writer);
reads run in parallel with each other and with the writer (MVCC snapshots), so a record deleted or
replaced while it is read is still read whole and consistent. Map growth briefly excludes everyone.
Fork: do not use a tier across ``fork()``; open it in the child (LMDB's rule).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import lmdb
import numpy as np
import torch

from ..codec import (
    Codec,
    RecordHeader,
    get_codec,
    pack_header,
    unpack_header,
    verify_payload,
    checksum,
)
from ..config import NvmeTierConfig
from ..entry import DTYPE_ITEMSIZE, EntryMeta, entry_digest
from ..errors import (
    CorruptRecordError,
    StoreDamagedError,
    StoreLockedError,
    StoreOpenError,
    TierWriteError,
    UnknownCodecError,
)
from ..policy import make_policy
from .base import Tier
from .nvme_index import NvmeIndex, NvmeRecord
from .storedir import check_local_filesystem, move_aside

__all__ = ["NvmeTier", "NvmeRecord", "EncodedRecord", "STORE_FORMAT", "check_record"]

log = logging.getLogger(__name__)

#: Version of the directory layout (bumped only for incompatible changes).
STORE_FORMAT = 1

#: LMDB errors at open that mean the environment itself is damaged (others, such as a permission
#: error or a library of another version, are not: ``nvme.on_damaged: reset`` never moves those).
_DAMAGE_ERRORS = (lmdb.InvalidError, lmdb.CorruptedError, lmdb.PageNotFoundError, lmdb.BadTxnError,
                  lmdb.IncompatibleError, lmdb.BadChecksumError)


def _damaged_hint(path: Path) -> str:
    return (f"the store is damaged: run `ectier fsck --path {str(path)!r} --repair` to keep its intact "
            "records, or set nvme.on_damaged: reset to start with an empty store (the damaged one is "
            "moved aside)")


#: ``settings`` key rewritten by a write that found the map full, so that LMDB reuses freed pages.
RELEASE_MARKER = b"freed_pages_released"


@dataclass(frozen=True)
class EncodedRecord:
    """A record ready to write: packed header, payload (zero-copy for the raw codec), sizes."""

    header: RecordHeader
    header_bytes: bytes
    payload: object  # bytes-like
    keepalive: object  # the source the payload may point into

    @property
    def stored_bytes(self) -> int:
        return len(self.header_bytes) + self.header.payload_nbytes


def check_record(digest: bytes, raw_header: object, payload: object | None, *, decode: bool = False) -> RecordHeader:
    """Make the checks a read makes on one stored record, outside a tier (``ectier fsck``).

    Args:
        digest: the 32-byte key the record is stored under.
        raw_header: the stored header bytes (bytes-like).
        payload: the stored payload bytes (bytes-like), or ``None`` if none was found.
        decode: also decode the payload into a scratch buffer (catches a damaged zstd frame whose
            checksum still matches: never seen, but a read would catch it too).

    Returns:
        The parsed :class:`~ectier.codec.RecordHeader`.

    Raises:
        CorruptRecordError: the header fails its own checks or does not belong to ``digest``, its
            dtype/shape/size disagree, its codec is unknown, the payload is missing, or the payload's
            length or xxh3-64 checksum (or its decoding) fails.
    """
    header = unpack_header(raw_header)
    if entry_digest(header.namespace, header.key) != digest:
        raise CorruptRecordError("header identity does not match its digest")
    itemsize = DTYPE_ITEMSIZE.get(header.dtype)
    if itemsize is None:
        raise CorruptRecordError(f"unknown dtype {header.dtype!r}")
    expected = itemsize
    for d in header.shape:
        expected *= d
    if expected != header.raw_nbytes:
        raise CorruptRecordError("raw size does not match dtype and shape")
    try:
        codec = get_codec(header.codec_id)
    except UnknownCodecError as exc:
        raise CorruptRecordError(str(exc)) from None
    if payload is None:
        raise CorruptRecordError("payload missing")
    verify_payload(header, payload)
    if decode:
        codec.decode_into(payload, np.empty(header.raw_nbytes, dtype=np.uint8), itemsize)
    return header


class _RWLock:
    """Many shared holders or one exclusive holder (used only around LMDB map resizes)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._shared = 0
        self._exclusive = False

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            while self._exclusive:
                self._cond.wait()
            self._shared += 1
        try:
            yield
        finally:
            with self._cond:
                self._shared -= 1
                if self._shared == 0:
                    self._cond.notify_all()

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


class NvmeTier(Tier):
    """An LMDB-backed record store under ``config.path`` (see the module docstring).

    Args:
        config: :class:`~ectier.config.NvmeTierConfig` with ``path`` set.

    Raises:
        StoreOpenError: the path cannot be created or is not a directory, is not writable, or holds
            an LMDB store of another format.
        StoreDamagedError: the LMDB environment is damaged and ``nvme.on_damaged`` is ``"fail"``
            (with ``"reset"`` it is moved aside, one warning is logged, and the tier starts empty).
        StoreLockedError: another process has the store open.
        ConfigError: the path is on a network or FUSE filesystem and ``nvme.allow_network_fs`` is off.
    """

    name = "nvme"

    def __init__(self, config: NvmeTierConfig) -> None:
        if config.path is None:
            raise StoreOpenError("nvme.path: not set; the NVMe tier needs a directory")
        self.config = config
        self.path = Path(config.path)
        self.codec: Codec = self._make_codec(config)
        self._lock_file = None
        self._env: lmdb.Environment | None = None
        self._rw = _RWLock()
        self._write_lock = threading.Lock()
        self.index = NvmeIndex(config.capacity_bytes, make_policy(config.policy))
        self.counters = {"checksum_failures": 0, "quarantined": 0, "orphans_reclaimed": 0,
                         "write_errors": 0, "map_growths": 0, "damaged_resets": 0}
        self._open()

    # ------------------------------------------------------------------------------- opening

    @staticmethod
    def _make_codec(config: NvmeTierConfig) -> Codec:
        if config.codec == "raw":
            return get_codec("raw")
        return get_codec(config.codec, level=config.zstd_level)

    def _open(self) -> None:
        check_local_filesystem(self.path, allow=self.config.allow_network_fs)
        try:
            self._lock_directory()
            try:
                self._open_env()
            except StoreDamagedError as exc:
                if self.config.on_damaged != "reset":
                    raise
                self._reset_damaged(exc)
        except BaseException:
            self.close()
            raise

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
        try:
            fcntl.flock(self._lock_file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock_file.close()
            self._lock_file = None
            raise StoreLockedError(
                f"nvme.path: {str(self.path)!r} is in use by another process; give each cache its own "
                "directory, or share one store through the ectier daemon"
            ) from None

    def _open_env(self) -> None:
        """Open LMDB under the held lock and load the headers.

        Raises:
            StoreDamagedError: LMDB reports the environment damaged, or ``data.mdb`` is truncated
                (the environment is closed again; the lock stays held).
            StoreOpenError: another LMDB error, or a store of another format.
        """
        try:
            self._env = lmdb.open(
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
            self._check_file_size()
            self._meta = self._env.open_db(b"meta")
            self._data = self._env.open_db(b"data")
            self._quarantine = self._env.open_db(b"quarantine")
            self._settings = self._env.open_db(b"settings")
            self._check_settings()
            self._scan()
        except lmdb.Error as exc:
            self._close_env()
            if isinstance(exc, _DAMAGE_ERRORS):
                raise StoreDamagedError(
                    f"nvme.path: cannot open LMDB store in {str(self.path)!r}: {exc}; {_damaged_hint(self.path)}") from None
            raise StoreOpenError(f"nvme.path: cannot open LMDB store in {str(self.path)!r}: {exc}") from None
        except BaseException:
            self._close_env()
            raise

    def _close_env(self) -> None:
        if self._env is not None:
            with self._rw.exclusive():
                self._env.close()
                self._env = None

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

    def _check_file_size(self) -> None:
        """Refuse a data file shorter than the pages LMDB says it holds: reading such a page
        through the map would kill the process with SIGBUS instead of raising an error."""
        assert self._env is not None
        info = self._env.info()
        needed = (info["last_pgno"] + 1) * self._env.stat()["psize"]
        data_file = self.path / "lmdb" / "data.mdb"
        size = data_file.stat().st_size
        if size < needed:
            raise StoreDamagedError(
                f"nvme.path: {str(data_file)!r} is truncated ({size} bytes, LMDB needs {needed}); "
                + _damaged_hint(self.path)
            )

    def _check_settings(self) -> None:
        assert self._env is not None
        with self._env.begin(write=True) as txn:
            fmt = txn.get(b"format", db=self._settings)
            if fmt is None:
                txn.put(b"format", str(STORE_FORMAT).encode(), db=self._settings)
                txn.put(b"created", json.dumps({"time": time.time()}).encode(), db=self._settings)
            elif fmt != str(STORE_FORMAT).encode():
                raise StoreOpenError(
                    f"nvme.path: {str(self.path)!r} holds store format {fmt.decode(errors='replace')}, "
                    f"this ectier reads format {STORE_FORMAT}"
                )

    def _scan(self) -> None:
        """Load every header into memory; quarantine bad ones; reclaim orphans."""
        assert self._env is not None
        bad: list[tuple[bytes, bytes, str]] = []
        orphans: list[bytes] = []
        found: dict[bytes, NvmeRecord] = {}
        with self._env.begin(buffers=True) as txn:
            # keys only: fetching a payload would touch every one of its pages (a full read of the
            # store at open); its length and checksum are checked on every read instead
            payload_keys = {bytes(k) for k in txn.cursor(db=self._data).iternext(keys=True, values=False)}
            for digest, raw in txn.cursor(db=self._meta):
                digest = bytes(digest)
                try:
                    header = unpack_header(raw)
                    if entry_digest(header.namespace, header.key) != digest:
                        raise CorruptRecordError("header identity does not match its digest")
                    if digest not in payload_keys:
                        raise CorruptRecordError("payload missing")
                except CorruptRecordError as exc:
                    bad.append((digest, bytes(raw), str(exc)))
                    continue
                found[digest] = NvmeRecord(header, len(raw) + header.payload_nbytes)
            bad_digests = {b[0] for b in bad}
            orphans = [d for d in payload_keys if d not in found and d not in bad_digests]
        self.index.load(found)
        if bad or orphans:
            with self._env.begin(write=True) as txn:
                for digest, raw, reason in bad:
                    self._quarantine_in(txn, digest, raw, reason)
                for digest in orphans:
                    txn.delete(digest, db=self._data)
            self.counters["orphans_reclaimed"] += len(orphans)
            for digest, _, reason in bad:
                log.warning("nvme tier: quarantined record %s at open: %s", digest.hex()[:16], reason)
        log.info("nvme tier: opened %s with %d records, %d bytes", self.path, len(self.index), self.used_bytes)

    # ------------------------------------------------------------------------------- queries

    def record(self, digest: bytes) -> NvmeRecord | None:
        """The in-memory record for ``digest`` (no disk access), or ``None``."""
        return self.index.record(digest)

    def records(self) -> list[tuple[bytes, NvmeRecord]]:
        """All records, oldest write version first."""
        return self.index.records()

    def __len__(self) -> int:
        return len(self.index)

    # ------------------------------------------------------------------- the Tier protocol
    @property
    def capacity_bytes(self) -> int:
        return self.index.capacity_bytes

    @property
    def used_bytes(self) -> int:
        """Bytes of the stored records (headers + payloads)."""
        return self.index.used_bytes

    def fits(self, nbytes: int) -> bool:
        return self.index.fits(nbytes)

    def holds(self, digest: bytes, version: int) -> bool:
        rec = self.index.record(digest)
        return rec is not None and rec.version == version

    def stored_version(self, digest: bytes) -> int | None:
        rec = self.index.record(digest)
        return rec.version if rec is not None else None

    def describe(self) -> dict:
        return {**self.counters, "path": str(self.path), "codec": self.config.codec,
                "capacity_bytes": self.index.capacity_bytes, "used_bytes": self.index.used_bytes,
                "entries": len(self.index), "map_size_bytes": self.map_size_bytes}

    @property
    def map_size_bytes(self) -> int:
        """Current LMDB map size in bytes."""
        return self._env.info()["map_size"] if self._env is not None else 0

    # ------------------------------------------------------------------------------- writing

    def encode(self, meta: EntryMeta, src: torch.Tensor, version: int) -> EncodedRecord:
        """Encode ``src`` (flat ``uint8`` CPU tensor of ``meta.nbytes``) into a record. No disk I/O."""
        data = src.numpy() if src.numel() else np.empty(0, dtype=np.uint8)
        payload = self.codec.encode(data, meta.itemsize)
        view = memoryview(payload)
        header = RecordHeader(
            codec_id=self.codec.codec_id,
            dtype=meta.dtype,
            shape=tuple(meta.shape),
            namespace=meta.namespace,
            key=meta.key,
            raw_nbytes=meta.nbytes,
            payload_nbytes=view.nbytes,
            payload_checksum=checksum(view),
            version=version,
            created_ns=time.time_ns(),
            codec_config={k: v for k, v in self.codec.get_config().items() if k != "name"},
        )
        return EncodedRecord(header, pack_header(header), view, src)

    def write(self, digest: bytes, record: EncodedRecord) -> bool:
        """Store ``record`` under ``digest`` atomically, unless a record of an equal or newer write
        version is already there (then nothing is written and ``False`` is returned).

        Raises:
            TierWriteError: disk full, map at ``nvme.map_ceiling_bytes``, or another LMDB error;
                nothing stored is changed.
        """
        version = record.header.version
        released = False  # one commit per write may make pages freed by earlier deletes reusable
        for _ in range(64):
            with self._rw.shared(), self._write_lock:
                assert self._env is not None
                try:
                    with self._env.begin(write=True) as txn:
                        current = txn.get(digest, db=self._meta)
                        if current is not None:
                            try:
                                if unpack_header(current).version >= version:
                                    return False
                            except CorruptRecordError:
                                pass  # replaced below; the bad header goes away with it
                        txn.put(digest, record.payload, db=self._data)
                        txn.put(digest, record.header_bytes, db=self._meta)
                except lmdb.MapFullError:
                    if not released:
                        released = True
                        if self._release_freed_pages():
                            continue  # retry once before growing: the freed pages may be enough
                    # else grow below, outside the write lock
                except lmdb.Error as exc:
                    self.counters["write_errors"] += 1
                    raise TierWriteError(self._write_error_text(exc, record.stored_bytes)) from None
                else:
                    self._set_record(digest, NvmeRecord(record.header, record.stored_bytes))
                    return True
            self._grow(record.stored_bytes)
        raise TierWriteError("nvme tier: map still full after growing")  # pragma: no cover

    def _release_freed_pages(self) -> bool:
        """Commit a tiny marker write so that pages freed by earlier transactions become reusable.

        LMDB hands out pages freed by transaction T only to a write transaction that starts after
        a later one (T+1) committed; an aborted write does not move that point. Without this, at the
        map ceiling a put after a delete of the same size failed until some unrelated write
        committed. Called with the write lock held; returns False if even the marker did not fit.
        """
        assert self._env is not None
        try:
            with self._env.begin(write=True) as txn:
                txn.put(RELEASE_MARKER, str(time.time_ns()).encode(), db=self._settings)
        except lmdb.Error:
            return False
        return True

    def _write_error_text(self, exc: lmdb.Error, need_bytes: int) -> str:
        text = str(exc)
        free = self._free_disk_bytes()
        # LMDB reports a short write of its pages (a file system filling up mid-commit, as tmpfs
        # and most file systems do) as EIO, not ENOSPC: look at the free space to tell them apart
        if ("No space" in text or getattr(exc, "errno", None) == errno.ENOSPC
                or (free is not None and free < need_bytes + (1 << 20))):
            return (f"nvme tier: disk full under {str(self.path)!r} ({text}; {free} bytes free, the record "
                    f"needs {need_bytes}); free space on that file system or lower nvme.capacity_bytes")
        return f"nvme tier: write failed under {str(self.path)!r}: {text}"

    def _free_disk_bytes(self) -> int | None:
        try:
            st = os.statvfs(self.path)
        except OSError:
            return None
        return st.f_bavail * st.f_frsize

    def _grow(self, need_bytes: int) -> None:
        ceiling = self.config.map_ceiling_bytes
        with self._rw.exclusive():
            assert self._env is not None
            current = self._env.info()["map_size"]
            if current >= ceiling:
                self.counters["write_errors"] += 1
                raise TierWriteError(
                    f"nvme tier: LMDB map full at its ceiling of {ceiling} bytes; raise nvme.map_max_bytes "
                    f"or lower nvme.capacity_bytes"
                )
            new = min(ceiling, max(2 * current, current + 2 * need_bytes + (16 << 20)))
            self._env.set_mapsize(new)
            self.counters["map_growths"] += 1
            log.info("nvme tier: LMDB map grown from %d to %d bytes", current, new)

    def _set_record(self, digest: bytes, rec: NvmeRecord | None) -> None:
        self.index.set_record(digest, rec)

    def delete(self, digest: bytes, *, only_version: int | None = None) -> bool:  # noqa: D417
        """Remove the record for ``digest`` (only if its write version is ``only_version``, when given).

        Returns True if a record was removed. LMDB errors are logged and return False (the record
        stays; a later delete or overwrite removes it).
        """
        with self._rw.shared(), self._write_lock:
            assert self._env is not None
            try:
                with self._env.begin(write=True) as txn:
                    current = txn.get(digest, db=self._meta)
                    if current is None:
                        removed = False
                    else:
                        if only_version is not None:
                            try:
                                if unpack_header(current).version != only_version:
                                    return False
                            except CorruptRecordError:
                                pass
                        txn.delete(digest, db=self._meta)
                        txn.delete(digest, db=self._data)
                        removed = True
            except lmdb.Error as exc:
                log.error("nvme tier: delete failed: %s", exc)
                return False
            # under the write lock: a write of a newer version cannot slip in between check and drop
            rec = self.index.record(digest)
            if rec is not None and (only_version is None or rec.version == only_version):
                self._set_record(digest, None)
        return removed

    # ------------------------------------------------------------------------------- reading

    def read(self, digest: bytes, namespace: str, key: str) -> tuple[RecordHeader, torch.Tensor] | None:
        """Read, check and decode the record for ``(namespace, key)``.

        Returns ``(header, data)`` with ``data`` a new flat ``uint8`` CPU tensor of
        ``header.raw_nbytes`` bytes, or ``None`` for a miss. A record that fails any check is
        quarantined, counted in ``counters["checksum_failures"]`` and read as ``None``.
        """
        with self._rw.shared():
            assert self._env is not None
            failure: tuple[bytes, str] | None = None
            with self._env.begin(buffers=True) as txn:
                raw = txn.get(digest, db=self._meta)
                if raw is not None:
                    try:
                        header = unpack_header(raw)
                        if header.namespace != namespace or header.key != key:
                            raise CorruptRecordError("record identity does not match the requested key")
                        itemsize = DTYPE_ITEMSIZE.get(header.dtype)
                        if itemsize is None:
                            raise CorruptRecordError(f"unknown dtype {header.dtype!r}")
                        expected = itemsize
                        for d in header.shape:
                            expected *= d
                        if expected != header.raw_nbytes:
                            raise CorruptRecordError("raw size does not match dtype and shape")
                        payload = txn.get(digest, db=self._data)
                        if payload is None:
                            raise CorruptRecordError("payload missing")
                        verify_payload(header, payload)
                        out = torch.empty(header.raw_nbytes, dtype=torch.uint8)
                        try:
                            codec = self.codec if header.codec_id == self.codec.codec_id else get_codec(header.codec_id)
                        except UnknownCodecError as exc:
                            raise CorruptRecordError(str(exc)) from None
                        codec.decode_into(payload, out.numpy(), itemsize)
                        return header, out
                    except CorruptRecordError as exc:
                        failure = (bytes(raw), str(exc))
        if failure is None:
            # No record in this read's snapshot. Forget the in-memory record only if LMDB still has
            # none under the write lock: a write that committed after the snapshot began is kept.
            self._forget_if_absent(digest)
            return None
        self.counters["checksum_failures"] += 1
        log.warning("nvme tier: record %s failed its check (%s); quarantined, served as a miss",
                    digest.hex()[:16], failure[1])
        self.quarantine(digest, failure[0], failure[1])
        return None

    def quarantine(self, digest: bytes, raw_header: bytes, reason: str) -> None:
        """Move a damaged record out of service (header kept in ``quarantine`` for inspection).

        Only the record with exactly ``raw_header`` is affected: a record written meanwhile under
        the same digest stays in service.
        """
        with self._rw.shared(), self._write_lock:
            assert self._env is not None
            try:
                with self._env.begin(write=True) as txn:
                    current = txn.get(digest, db=self._meta)
                    replaced = current is not None and bytes(current) != raw_header
                    if current is not None and not replaced:
                        self._quarantine_in(txn, digest, raw_header, reason)
            except lmdb.Error as exc:
                log.error("nvme tier: quarantine failed: %s", exc)
                replaced = False
            if not replaced:
                self._set_record(digest, None)

    def _forget_if_absent(self, digest: bytes) -> None:
        """Drop the in-memory record of ``digest`` if LMDB holds no header for it (under the write lock)."""
        with self._rw.shared(), self._write_lock:
            if digest not in self.index or self._env is None:
                return
            with self._env.begin() as txn:
                if txn.get(digest, db=self._meta) is None:
                    self._set_record(digest, None)

    def _quarantine_in(self, txn: lmdb.Transaction, digest: bytes, raw_header: bytes, reason: str) -> None:
        note = {"reason": reason, "time": time.time(), "header": raw_header[:4096].hex()}
        txn.put(digest, json.dumps(note).encode(), db=self._quarantine)
        txn.delete(digest, db=self._meta)
        txn.delete(digest, db=self._data)
        self.counters["quarantined"] += 1

    def stored_keys(self) -> tuple[set[bytes], set[bytes]]:
        """The digests LMDB holds headers for, and those it holds payloads for (a consistency
        check: both equal the in-memory records when the tier is idle)."""
        assert self._env is not None
        with self._env.begin() as txn:
            meta = {bytes(k) for k in txn.cursor(db=self._meta).iternext(keys=True, values=False)}
            data = {bytes(k) for k in txn.cursor(db=self._data).iternext(keys=True, values=False)}
        return meta, data

    def quarantined(self) -> dict[bytes, dict]:
        """Digest -> ``{"reason", "time", "header"}`` of every quarantined record."""
        assert self._env is not None
        with self._env.begin() as txn:
            return {bytes(k): json.loads(v) for k, v in txn.cursor(db=self._quarantine)}

    # ------------------------------------------------------------------------------- closing

    def close(self) -> None:
        """Close LMDB (committed data is already durable) and release the directory lock. Idempotent."""
        if self._env is not None:
            with self._rw.exclusive():
                self._env.close()
                self._env = None
        if self._lock_file is not None:
            try:
                fcntl.flock(self._lock_file.fileno(), fcntl.LOCK_UN)
            finally:
                self._lock_file.close()
                self._lock_file = None

    @property
    def closed(self) -> bool:
        return self._env is None
