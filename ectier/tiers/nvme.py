"""NVMe tier: self-describing, checksummed records — an LMDB index and a segment file of payloads.

Layout v2 under ``nvme.path`` (store format 2)::

    ectier.lock        flock'ed by the one process that owns the store (StoreLockedError otherwise)
    lmdb/data.mdb      the LMDB index, three named databases:
        meta           digest (32 B) -> packed RecordHeader (magic, version, codec, dtype, shape,
                       namespace, key, sizes, payload checksum, write version; own checksum),
                       then the payload's location (extents of 64 KiB blocks; own checksum)
        quarantine     digest -> JSON {reason, time, header hex} of records that failed a check
        settings       store format and creation facts, checked on reopen
    segment.0          the payloads (:mod:`ectier.tiers.nvme_segment`)

Contract (docs/operations.md, "The NVMe tier on disk"):

- **Atomic writes.** The payload is written into free blocks (xxh3-64 computed while it is copied)
  and synced before the index entry naming it commits in one LMDB transaction (group commit:
  :mod:`ectier.tiers.nvme_commit`); a record it replaces keeps its blocks until then. After a crash
  at any point a record is either wholly there (old or new) or absent, never torn.
- **Checked reads.** Every read checks the index entry (magic, format, checksums, location), the
  identity (namespace and key), and the payload's xxh3-64 computed while it is read straight into
  its destination, and the decoded length. Any failure quarantines the record (its index entry
  moved to ``quarantine``), counts it, and reads as a miss. A read holds the blocks its snapshot
  names: a record deleted or replaced meanwhile is still read whole.
- **Restart.** Opening the directory scans the index only, never a payload byte; the free-space map
  is rebuilt from it (space of a write cut by a crash is free again). A layout-v1 store is migrated
  (:mod:`ectier.tiers.nvme_migrate`).
- **Map growth.** The map starts at ``nvme.map_initial_bytes`` and doubles when LMDB reports it full,
  up to ``nvme.map_ceiling_bytes``; beyond that a write fails with :class:`TierWriteError`. Before
  growing, a write that found the map full commits a marker (``settings``) and retries once, so
  that pages freed by earlier deletes become reusable (LMDB reuses them only after a later commit).
- **Disk full** fails that one write with :class:`NvmeDiskFullError` (the mover then evicts and
  retries once: :mod:`ectier.moves.nvme`); I/O errors fail it with :class:`TierWriteError`; reads
  and the other tiers keep working.

Code: this module is the tier (the Tier protocol, record I/O, quarantine);
:mod:`ectier.tiers.nvme_env` opens, locks, scans, grows and closes the store;
:mod:`ectier.tiers.nvme_record` encodes records and index values and holds the checks of every read
(also used by ``ectier fsck``); :mod:`ectier.tiers.nvme_index` is the in-memory index (records,
policy, budget); :mod:`ectier.tiers.nvme_segment` the segment file and its free-space map;
:mod:`ectier.tiers.nvme_commit` group commit and the commit a group's leader runs;
:mod:`ectier.tiers.nvme_compact` moves the records past the budget's end of a grown segment file.

Threads: the tier is safe to share between threads. Index commits are serialised (LMDB has one
writer; concurrent writes share a group commit); reads run in parallel with each other and with
writers. Map growth and close briefly exclude everyone (every use of LMDB or the segment file holds
the store's ``rw`` lock shared): close waits for the operations in flight; one that comes after it
raises :class:`~ectier.errors.EctierError` ("cache is closed"). Fork: do not use a tier across
``fork()``; open it in the child (LMDB's rule).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from pathlib import Path

import lmdb
import torch

import numpy as np

from ..codec import Codec, RecordHeader, checksum, get_codec
from ..config import NvmeTierConfig
from ..entry import EntryMeta
from ..errors import CacheClosedError, CorruptRecordError, StoreOpenError, TierWriteError
from ..policy import make_policy
from .base import Tier
from .nvme_env import RELEASE_MARKER, STORE_FORMAT, NvmeDiskFullError, NvmeEnv, free_disk_bytes, write_error
from .nvme_commit import GroupCommit, IndexCommits
from .nvme_compact import TailCompaction
from .nvme_index import NvmeIndex, NvmeRecord
from .nvme_reader import ByteViews, flat_cpu_bytes
from .nvme_record import (CheckedRecord, EncodedRecord, check_header, check_index_value, check_record,
                          encode_record, parse_index_value)
from .nvme_scan import placed_entries
from .nvme_segment import BLOCK_BYTES, Location, blocks_for

__all__ = ["NvmeTier", "NvmeRecord", "EncodedRecord", "STORE_FORMAT", "RELEASE_MARKER", "check_record",
           "NvmeDiskFullError"]

RAW_CODEC_ID = get_codec("raw").codec_id

log = logging.getLogger(__name__)


class NvmeTier(IndexCommits, TailCompaction, Tier):
    """An LMDB-backed record store under ``config.path`` (see the module docstring).

    Args:
        config: :class:`~ectier.config.NvmeTierConfig` with ``path`` set.

    Raises:
        StoreOpenError: the path cannot be created or is not a directory, is not writable, or holds
            an LMDB store of another format.
        StoreDamagedError: the LMDB environment is damaged and ``nvme.on_damaged`` is ``"fail"``
            (with ``"reset"`` it is moved aside, one warning is logged, and the tier starts empty).
        StoreLockedError: another process, or another TieredCache of this process, has the store open.
        ConfigError: the path is on a network or FUSE filesystem and ``nvme.allow_network_fs`` is off.
    """

    name = "nvme"

    def __init__(self, config: NvmeTierConfig) -> None:
        if config.path is None:
            raise StoreOpenError("nvme.path: not set; the NVMe tier needs a directory")
        self.config = config
        self.path = Path(os.path.abspath(config.path))  # (logs, stats: whole; a later chdir changes nothing)
        self.codec: Codec = self._make_codec(config)
        self.index = NvmeIndex(config.capacity_bytes, make_policy(config.policy))
        self.counters = {"checksum_failures": 0, "quarantined": 0, "orphans_reclaimed": 0,
                         "write_errors": 0, "map_growths": 0, "damaged_resets": 0}
        self._store = NvmeEnv(config, self.index, self.counters)
        self._group = GroupCommit(self._commit_group, config.group_commit_s)
        self._rw = self._store.rw
        self._views = ByteViews()
        self._write_lock = self._store.write_lock
        self._init_compaction()
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
        return None  # layout v2: payloads live in the segment file, not in LMDB

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
                "entries": len(self.index), "map_size_bytes": self.map_size_bytes,
                "commit_groups": self._group.groups, "committed_entries": self._group.entries, **self.space()}

    @property
    def map_size_bytes(self) -> int:
        """Current LMDB map size in bytes."""
        with self._rw.shared():
            return self._env.info()["map_size"] if self._env is not None else 0

    # ------------------------------------------------------------------------------- writing

    def encode(self, meta: EntryMeta, src: torch.Tensor, version: int) -> EncodedRecord:
        """Encode ``src`` (flat ``uint8`` CPU tensor of ``meta.nbytes``) into a record. No disk I/O;
        the payload checksum is computed by :meth:`write`, while it copies the bytes."""
        return encode_record(self.codec, meta, src, version, with_checksum=False)

    @staticmethod
    def stored_bytes(record: EncodedRecord) -> int:
        """What ``record`` will cost the budget: its header plus the whole segment blocks of its payload."""
        return len(record.header_bytes) + blocks_for(record.header.payload_nbytes) * BLOCK_BYTES

    def write(self, digest: bytes, record: EncodedRecord, *, on_disk: bool = False) -> bool:
        """Store ``record`` under ``digest``, unless a record of an equal or newer write version is
        already there (then nothing is written and ``False`` is returned). ``on_disk``: into free
        blocks the segment file already holds first (a retry on a full filesystem).

        The payload goes to free blocks of the segment file (its checksum computed as it is
        copied) and is made durable (``fdatasync`` with ``nvme.sync``) before the index entry that
        points at it commits; a record it replaces keeps its blocks until then.

        Raises:
            NvmeDiskFullError: the filesystem is full (``ENOSPC``); nothing stored is changed.
            TierWriteError: map at ``nvme.map_ceiling_bytes``, an I/O or another LMDB error;
                nothing stored is changed.
        """
        payload = memoryview(record.payload)
        if payload.ndim != 1 or payload.format != "B":
            payload = payload.cast("B")
        loc = self._store.space.allocate(len(payload), below=self._store.segment.size_blocks() if on_disk else None)
        try:
            with self._group.copying():
                csum = self._segment_io("write", loc, payload, need=len(payload))
            if record.header.payload_checksum and record.header.payload_checksum != csum:
                raise TierWriteError("nvme tier: payload changed while it was written (checksum differs)")
            header = dataclasses.replace(record.header, payload_checksum=csum)
        except BaseException:
            self._free(loc)
            raise
        done, old = self._group.submit((digest, header, loc), abandon=lambda: self._free(loc),
                                       stands=self._free_replaced)
        if not done:
            self._free(loc)
            return False
        if old is not None:
            self._free(old)
        self.note_placement(digest, loc)
        self.compact_tail()  # (a no-op unless a write went past the base: a large record's replacement)
        return True

    def _check_open(self) -> None:
        """With ``rw`` held shared (close takes it exclusively): raise once the store is closed."""
        if self._store.env is None:
            raise CacheClosedError("cache is closed")

    def _segment_io(self, op: str, *args: object, need: int = 0) -> int | None:
        """``segment.<op>(*args)`` (``write``, ``flush``) with the store held open; an OSError is a write error."""
        with self._rw.shared():
            self._check_open()
            try:
                return getattr(self._store.segment, op)(*args)
            except OSError as exc:
                self.counters["write_errors"] += 1
                raise write_error(self.path, exc, need, self._free_disk_bytes()) from None

    def _free_replaced(self, result: tuple[bool, Location | None]) -> None:
        """A committed write's ``(written, location it replaced)``: give that location's blocks back."""
        if result[1] is not None:
            self._free(result[1])

    def _free(self, loc: Location) -> None:
        """Return ``loc``'s blocks (the segment file is cut when a grown region shrinks back). On a
        closed store nothing: the next open rebuilds the free-space map from the index."""
        with self._rw.shared():
            if self._store.env is not None:
                self._store.space.free(loc)

    def _free_disk_bytes(self) -> int | None:
        return free_disk_bytes(self.path)

    def _set_record(self, digest: bytes, rec: NvmeRecord | None) -> None:
        self.index.set_record(digest, rec)

    def delete(self, digest: bytes, *, only_version: int | None = None) -> bool:  # noqa: D417
        """Remove the record for ``digest`` (only if its write version is ``only_version``, when given).

        Returns True if a record was removed (its blocks are free once the index entry is gone).
        LMDB errors are logged and return False (the record stays; a later delete or overwrite
        removes it).
        """
        with self._rw.shared(), self._write_lock:
            self._check_open()
            loc = None
            try:
                with self._env.begin(write=True) as txn:
                    current = txn.get(digest, db=self._meta)
                    if current is None:
                        removed = False
                    else:
                        try:
                            cur_header, loc = parse_index_value(current)
                            if only_version is not None and cur_header.version != only_version:
                                return False
                        except CorruptRecordError:
                            loc = None  # its blocks come back at the next open
                        txn.delete(digest, db=self._meta)
                        removed = True
            except lmdb.Error as exc:
                log.error("nvme tier: delete failed: %s", exc)
                return False
            # under the write lock: a write of a newer version cannot slip in between check and drop
            rec = self.index.record(digest)
            if rec is not None and (only_version is None or rec.version == only_version):
                self._set_record(digest, None)
        if loc is not None:
            self._free(loc)
        return removed

    # ------------------------------------------------------------------------------- reading

    def read(self, digest: bytes, namespace: str, key: str, *, out: torch.Tensor | None = None,
             runs: list[torch.Tensor] | None = None) -> tuple[RecordHeader, torch.Tensor | None] | None:
        """Read, check and decode the record for ``(namespace, key)``.

        Args:
            out: a flat ``uint8`` CPU tensor of the entry's raw bytes to decode into (e.g. the
                caller's ``get(out=)``; a raw payload is read straight into it; on a miss its
                contents are undefined); ``None``, or one of another size: a new tensor.
            runs: instead, flat ``uint8`` CPU tensors whose lengths sum to the raw bytes (a host
                slot's runs), filled in order (a raw payload: one scatter read). Another total: ignored.

        Returns ``(header, data)`` — ``data`` (``out``, or a new flat ``uint8`` CPU tensor) of
        ``header.raw_nbytes`` bytes, ``None`` when ``runs`` were filled — or ``None`` for a miss: a
        record failing any check (header, location, payload length, xxh3-64 computed while the
        bytes are read, decoding) is quarantined and counted in ``counters["checksum_failures"]``.
        """
        rw, space, failure = self._rw, self._store.space, None
        rw.acquire_shared()
        epoch = space.begin_read()  # before the lookup: the blocks it finds stay unreused until the end
        try:
            self._check_open()
            txn = self._env.begin()  # read-only: begin, get (bytes: the header and location), abort
            try:
                raw = txn.get(digest, db=self._meta)
            finally:
                txn.abort()
            if raw is not None:
                try:
                    rec, loc = self._checked(digest, (namespace, key), raw)
                    return rec.header, self._read_payload(rec, loc, out, runs)
                except CorruptRecordError as exc:
                    failure = (raw, str(exc))
        finally:
            space.end_read(epoch)
            rw.release_shared()
            if self._past_base:  # a move found no room while reads held freed blocks: look again
                self.compact_tail()
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

    def _checked(self, digest: bytes, identity: tuple[str, str], raw: bytes) -> tuple[CheckedRecord, Location]:
        """The checks of index entry ``raw``; for an entry byte-equal to the one this tier committed or
        scanned, the header already parsed (and its location) are used, not parsed again.

        Raises:
            CorruptRecordError: a check failed (an unknown codec or dtype too: a miss, quarantined).
        """
        known = self.index.record(digest)
        if known is not None and known.value == raw and known.location is not None:
            # (a record scanned at open had only its checksums checked: dtype, sizes and codec here)
            return check_header(identity, known.header, self.codec), known.location
        return check_index_value(identity, raw, codec=self.codec)

    def _read_payload(self, rec: CheckedRecord, loc: Location, out: torch.Tensor | None,
                      runs: list[torch.Tensor] | None = None) -> torch.Tensor | None:
        """The payload of ``rec`` at ``loc``, checked and decoded into ``runs`` (then ``None``), ``out``
        or a new tensor."""
        h = rec.header
        if h.raw_nbytes > self.index.capacity_bytes:  # (no write stores one: forged, or a decompression bomb)
            raise CorruptRecordError(f"header claims {h.raw_nbytes} raw bytes, more than nvme.capacity_bytes="
                                     f"{self.index.capacity_bytes}")
        raw = h.codec_id == RAW_CODEC_ID
        if runs is not None and sum(r.numel() for r in runs) == h.raw_nbytes and all(flat_cpu_bytes(r) for r in runs):
            if raw:
                self._check_payload(h, loc, [memoryview(r.numpy()) for r in runs])
                return None
            for r, part in zip(runs, self._read_payload(rec, loc, None).split([r.numel() for r in runs])):
                r.copy_(part)  # a compressed payload: decoded first, then copied into the runs
            return None
        if out is None or out.numel() != h.raw_nbytes or not flat_cpu_bytes(out):
            out = torch.empty(h.raw_nbytes, dtype=torch.uint8)  # (an unsuitable out= is not used)
        if raw:
            self._check_payload(h, loc, self._views.of(out) if h.raw_nbytes else memoryview(b""))
            return out
        buf = np.empty(h.payload_nbytes, dtype=np.uint8)
        self._check_payload(h, loc, memoryview(buf))
        rec.codec.decode_into(buf, out.numpy(), rec.itemsize)
        return out

    def _check_payload(self, h: RecordHeader, loc: Location, dst: memoryview | list[memoryview]) -> None:
        """Read the payload at ``loc`` into ``dst`` and compare its xxh3-64 with the header's."""
        csum = self._store.segment.read_into(loc, dst) if h.payload_nbytes else checksum(b"")
        if csum != h.payload_checksum:
            raise CorruptRecordError(f"payload checksum mismatch: header {h.payload_checksum:#018x}, "
                                     f"computed {csum:#018x}")

    def quarantine(self, digest: bytes, raw_header: bytes, reason: str) -> None:
        """Move a damaged record out of service (header kept in ``quarantine`` for inspection).

        Only the record with exactly ``raw_header`` is affected: a record written meanwhile under
        the same digest stays in service.
        """
        with self._rw.shared(), self._write_lock:
            self._check_open()
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
        """The digests the index holds entries for, and those whose entry names a payload location
        inside the segment file, not overlapping another's (a consistency check: both equal the
        in-memory records when the tier is idle)."""
        with self._rw.shared():
            self._check_open()
            with self._env.begin() as txn:
                return placed_entries(txn.cursor(db=self._meta), self._store.segment.size_blocks())

    def space(self) -> dict[str, int]:
        """Segment file figures, bytes: ``segment_bytes`` (its length), ``segment_used_bytes``
        (blocks held by records or reads), ``segment_disk_bytes`` (allocated on disk)."""
        with self._rw.shared():
            self._check_open()
            st = os.fstat(self._store.segment.fd)
        sp = self._store.space
        return {"segment_bytes": st.st_size, "segment_used_bytes": (sp.nblocks - sp.free_blocks) * BLOCK_BYTES,
                "segment_disk_bytes": st.st_blocks * 512}

    def quarantined(self) -> dict[bytes, dict]:
        """Digest -> ``{"reason", "time", "header"}`` of every quarantined record."""
        with self._rw.shared():
            self._check_open()
            with self._env.begin() as txn:
                return {bytes(k): json.loads(v) for k, v in txn.cursor(db=self._store.quarantine_db)}

    # ------------------------------------------------------------------------------- closing

    def close(self) -> None:
        """Close LMDB (committed data is already durable) and release the directory lock. Idempotent."""
        self._store.close()

    @property
    def closed(self) -> bool:
        return self._env is None
