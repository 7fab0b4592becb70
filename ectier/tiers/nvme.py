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

Code: this module is the tier (the Tier protocol, record I/O, quarantine);
:mod:`ectier.tiers.nvme_env` opens, locks, scans, grows and closes the LMDB environment;
:mod:`ectier.tiers.nvme_record` encodes records and holds the checks of every read (also used by
``ectier fsck``); :mod:`ectier.tiers.nvme_index` is the in-memory index (records, policy, budget).

Threads: the tier is safe to share between threads. Writes are serialised (LMDB has one writer);
reads run in parallel with each other and with the writer (MVCC snapshots), so a record deleted or
replaced while it is read is still read whole and consistent. Map growth briefly excludes everyone.
Fork: do not use a tier across ``fork()``; open it in the child (LMDB's rule).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import lmdb
import torch

from ..codec import Codec, RecordHeader, get_codec, unpack_header
from ..config import NvmeTierConfig
from ..entry import EntryMeta
from ..errors import CorruptRecordError, StoreOpenError, TierWriteError
from ..policy import make_policy
from .base import Tier
from .nvme_env import RELEASE_MARKER, STORE_FORMAT, NvmeEnv, free_disk_bytes, write_error_text
from .nvme_index import NvmeIndex, NvmeRecord
from .nvme_record import EncodedRecord, check_record, encode_record, verify_record

__all__ = ["NvmeTier", "NvmeRecord", "EncodedRecord", "STORE_FORMAT", "RELEASE_MARKER", "check_record"]

log = logging.getLogger(__name__)


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
        self.index = NvmeIndex(config.capacity_bytes, make_policy(config.policy))
        self.counters = {"checksum_failures": 0, "quarantined": 0, "orphans_reclaimed": 0,
                         "write_errors": 0, "map_growths": 0, "damaged_resets": 0}
        self._store = NvmeEnv(config, self.index, self.counters)
        self._rw = self._store.rw
        self._write_lock = self._store.write_lock
        self._store.open()

    @staticmethod
    def _make_codec(config: NvmeTierConfig) -> Codec:
        if config.codec == "raw":
            return get_codec("raw")
        return get_codec(config.codec, level=config.zstd_level)

    # The environment and its databases under the names ectier.testing's fault injection uses
    # (``lmdb_of``, ``set_lmdb_env``): whatever is set here is what every transaction begins on.

    @property
    def _env(self) -> lmdb.Environment | None:
        return self._store.env

    @_env.setter
    def _env(self, env: lmdb.Environment | None) -> None:
        self._store.env = env

    @property
    def _meta(self) -> object:
        return self._store.meta_db

    @property
    def _data(self) -> object:
        return self._store.data_db

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
        return encode_record(self.codec, meta, src, version)

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
                        if self._store.release_freed_pages():
                            continue  # retry once before growing: the freed pages may be enough
                    # else grow below, outside the write lock
                except lmdb.Error as exc:
                    self.counters["write_errors"] += 1
                    raise TierWriteError(self._write_error_text(exc, record.stored_bytes)) from None
                else:
                    self._set_record(digest, NvmeRecord(record.header, record.stored_bytes))
                    return True
            self._store.grow(record.stored_bytes)
        raise TierWriteError("nvme tier: map still full after growing")  # pragma: no cover

    def _write_error_text(self, exc: lmdb.Error, need_bytes: int) -> str:
        return write_error_text(self.path, exc, need_bytes, self._free_disk_bytes())

    def _free_disk_bytes(self) -> int | None:
        return free_disk_bytes(self.path)

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
                        payload = txn.get(digest, db=self._data)
                        rec = verify_record((namespace, key), raw, payload, codec=self.codec)
                        out = torch.empty(rec.header.raw_nbytes, dtype=torch.uint8)
                        rec.codec.decode_into(payload, out.numpy(), rec.itemsize)
                        return rec.header, out
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
                        self._store.quarantine_in(txn, digest, raw_header, reason)
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
            return {bytes(k): json.loads(v) for k, v in txn.cursor(db=self._store.quarantine_db)}

    # ------------------------------------------------------------------------------- closing

    def close(self) -> None:
        """Close LMDB (committed data is already durable) and release the directory lock. Idempotent."""
        self._store.close()

    @property
    def closed(self) -> bool:
        return self._env is None
