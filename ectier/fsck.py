"""``ectier fsck``: check an NVMe store directory, and salvage its intact records into a fresh store.

:func:`check` reads every record of a store that no process has open (it takes the store's
``ectier.lock``) and makes the checks a read makes (:func:`ectier.tiers.nvme.check_record`: the
header's own checksum, the identity, the sizes, the payload's xxh3-64 checksum, decoding). It
reads the index through LMDB when LMDB can open and walk the whole store ("lmdb" mode). When it
cannot — meta pages zeroed, garbage in B-tree pages, a truncated ``data.mdb`` — it reads the file's
pages directly (:mod:`ectier.tiers.lmdbpages`, "page-scan" mode) and keeps, per key, the newest
record whose checksums hold.

Both layouts are understood: layout v2 (format 2: the index entry is the header and the payload's
location; the payload is read from ``segment.0``; entries whose blocks overlap keep the newest,
the older is reported as a reused extent) and layout v1 (format 1: header and payload both in LMDB;
a cache migrates such a store when it opens it).

:func:`repair` writes every intact, checksum-valid record (with its header as it was: codec,
write version, creation time) into a fresh LMDB environment built next to the damaged one, keeps
the ``settings`` (store format, creation facts, plus a ``repaired`` note), moves the damaged
environment aside to ``<dir>/damaged-<UTC time>/lmdb`` (a store directory ``check`` can read
again) and puts the fresh one in its place. The directory lock is held throughout, so no cache
can open the store half-way. A healthy store is left alone.

The swap is journaled (:mod:`ectier.tiers.repairswap`): once the fresh store is complete and
synced, ``<dir>/repair-swap.json`` names it and the ``damaged-*`` directory, and every step after
is idempotent. A repair killed during the swap is finished — rolled forward, never undone — by
whatever takes the store's lock next: :func:`check`, :func:`repair` (both say so:
``FsckReport.finished_swap``) or a cache's open. A repair killed before the journal leaves the
damaged store as it was and a ``.repair-*`` directory that the next repair removes; one a journal
names is never removed before its swap is finished.

In page-scan mode the file no longer says which pages were live: a record deleted or evicted
shortly before the damage may come back (its bytes are the bytes once put under its key, and its
checksums hold), and an overwritten key comes back with its newest surviving version.

See docs/operations.md ("Damaged store: ectier fsck") and docs/reliability.md.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import lmdb

from .codec import RecordHeader, header_nbytes, unpack_header
from .config import GiB, MiB, NvmeTierConfig
from .errors import CorruptRecordError, StoreDamagedError, StoreLockedError, StoreOpenError
from .tiers.lmdbcheck import check_tree, lost_index
from .tiers.nvme import RELEASE_MARKER, STORE_FORMAT, EncodedRecord, NvmeTier, check_record
from .tiers.nvme_record import parse_index_value
from .fsck_pages import page_pass
from .fsck_segment import Segment, reused_extents
from .tiers.nvme_segment import SEGMENT_NAME, Location
from .tiers import repairswap as swap
from .tiers.storedir import damaged_copies

__all__ = ["FsckReport", "RepairResult", "check", "repair"]

#: Problems listed by name in a report (the counts cover all).
MAX_LISTED = 50

# (digest, raw header, payload) of one intact record
Sink = Callable[[bytes, bytes, memoryview], None]


@dataclass
class FsckReport:
    """What :func:`check` found in one store directory.

    Fields: ``path``; ``mode`` (``"lmdb"`` or ``"page-scan"``); ``lmdb_error`` (why LMDB could
    not read the whole store, or ``None``); ``entries`` (records found: headers), ``intact``
    (records that pass every check), ``intact_bytes`` (their header + payload bytes),
    ``checksum_failed`` (a header or payload present but failing its checks), ``unreadable``
    (a header whose payload could not be read at all); ``orphans`` (payloads without a header,
    reclaimed at open: not damage), ``quarantined`` (records already in quarantine),
    ``damaged_pages`` (page scan: pages that are neither an LMDB page of their number nor overflow
    data); ``problems`` (the first :data:`MAX_LISTED`: ``{digest, namespace, key, problem}``);
    ``settings`` (the store's ``settings`` database, decoded); ``damaged_copies`` (``damaged-*``
    directories left in the store directory earlier); ``stale_repairs`` (``.repair-*`` staging
    directories of killed repairs: the next repair removes them); ``segment_bytes`` (the payload
    file's size: with no entry found, bytes no key can be matched to); ``finished_swap`` (the
    ``damaged-*`` directory of a repair killed during its swap, which this run finished first:
    the store checked is the rebuilt one; else ``None``).
    """

    path: str
    mode: str = "lmdb"
    lmdb_error: str | None = None
    entries: int = 0
    intact: int = 0
    intact_bytes: int = 0
    checksum_failed: int = 0
    unreadable: int = 0
    orphans: int = 0
    quarantined: int = 0
    damaged_pages: int = 0
    problems: list[dict] = field(default_factory=list)
    settings: dict[str, str] = field(default_factory=dict)
    damaged_copies: list[str] = field(default_factory=list)
    stale_repairs: list[str] = field(default_factory=list)
    segment_bytes: int = 0
    finished_swap: str | None = None

    @property
    def damaged(self) -> bool:
        """True when LMDB cannot read the store whole, or a record fails its checks."""
        return self.lmdb_error is not None or self.checksum_failed > 0 or self.unreadable > 0

    def to_dict(self) -> dict:
        return dict(asdict(self), damaged=self.damaged)

    def _problem(self, digest: bytes, header: RecordHeader | None, problem: str, *, unreadable: bool) -> None:
        if unreadable:
            self.unreadable += 1
        else:
            self.checksum_failed += 1
        if len(self.problems) < MAX_LISTED:
            self.problems.append({"digest": digest.hex(), "namespace": header.namespace if header else None,
                                  "key": header.key if header else None, "problem": problem})


@dataclass
class RepairResult:
    """What :func:`repair` did: the ``report`` of the check before it; ``repaired`` (False when the
    store was healthy: nothing changed); ``salvaged`` records (``salvaged_bytes``) in the fresh
    store; ``lost`` (records found but not salvaged: a page scan does not find, so cannot count,
    records whose index entries were on destroyed pages); ``moved_to`` (the ``damaged-*`` directory
    now holding the old environment, or ``None``); ``removed_stale`` (``.repair-*`` directories of
    a repair that was killed, removed, healthy store or not)."""

    report: FsckReport
    repaired: bool = False
    salvaged: int = 0
    salvaged_bytes: int = 0
    lost: int = 0
    moved_to: str | None = None
    removed_stale: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return dict(asdict(self), report=self.report.to_dict())


# =============================================================================== entry points


def check(path: str | os.PathLike) -> FsckReport:
    """Check the store in ``path`` (an ``nvme.path`` directory); changes nothing.

    Changes nothing, but for finishing the swap of a repair that was killed during it (as any open
    of the store would: ``FsckReport.finished_swap``).

    Raises:
        StoreOpenError: ``path`` is not a store directory (no ``lmdb/data.mdb``), cannot be read, or
            holds a store format this ectier does not read (a newer one's); or a killed repair's
            swap cannot be finished (the message says where the damaged and rebuilt stores are).
        StoreLockedError: a process has the store open (stop it first).
    """
    store = Path(path)
    with _locked(store) as finished:
        report = _check(store)
        report.finished_swap = finished
        return report


def repair(path: str | os.PathLike) -> RepairResult:
    """Check the store in ``path`` and, if it is damaged, rebuild it from its intact records (see
    the module docstring). Needs free space for the salvaged records on the store's filesystem.

    Raises:
        StoreOpenError: as :func:`check`; or the store holds another store format; or the fresh
            store cannot be written (the damaged store is then left as it was) or its journaled
            swap stopped (the message says where both stores are; the next fsck or open finishes
            it); or a swap a killed repair left cannot be finished.
        StoreLockedError: a process has the store open.
        TierWriteError: the fresh store ran out of disk space (nothing changed).
    """
    store = Path(path)
    with _locked(store) as finished:
        report = _check(store)
        report.finished_swap = finished
        result = RepairResult(report)
        if not report.damaged:  # (a healthy store: a repair killed after its swap left only staging)
            result.removed_stale = _remove_stale_repairs(store)
            return result
        fmt = report.settings.get("format")
        if fmt is not None and fmt not in ("1", str(STORE_FORMAT)):
            raise StoreOpenError(f"--path: {str(store)!r} holds store format {fmt}; this ectier repairs "
                                 f"formats 1 and {STORE_FORMAT} only")
        result.removed_stale = _remove_stale_repairs(store)
        staging = store / f".repair-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{os.getpid()}"
        try:
            result.salvaged, result.salvaged_bytes = _build(store, staging, report)
            journal = swap.begin(store, staging)  # from here on the swap is only ever rolled forward
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        result.moved_to = str(store / journal.damaged)
        try:
            swap.finish(store, journal)
        except OSError as exc:
            raise StoreOpenError(f"--path: the swap of the repaired store stopped ({exc}); the damaged store is in "
                                 f"{result.moved_to!r}, the repaired one in {str(staging)!r} (what is not in place "
                                 f"yet); once the cause is fixed, `ectier fsck --path {str(store)!r}` finishes "
                                 "it") from None
        result.repaired = True
        result.lost = report.entries - result.salvaged
        return result


def _remove_stale_repairs(store: Path) -> list[str]:
    """Remove the ``.repair-*`` staging directories a killed repair left (the caller holds the
    store's lock, so no repair runs) but the one a pending swap journal names; returns their paths."""
    stale = _stale_repairs(store)
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return [str(p) for p in stale]


def _stale_repairs(store: Path) -> list[Path]:
    """The ``.repair-*`` directories of killed repairs: all but the staging a swap journal names."""
    journal = swap.pending(store)
    return [p for p in damaged_copies(store, ".repair-") if journal is None or p.name != journal.staging]


# =============================================================================== checking


@contextmanager
def _locked(store: Path) -> Iterator[str | None]:
    """Hold the store's lock, after finishing the swap of a repair killed during it; yields that
    repair's ``damaged-*`` directory, or ``None``."""
    if not (store / swap.JOURNAL_NAME).exists():  # (a half-swapped store looks damaged until finished)
        _refuse_no_store(store)
    try:
        lock = open(store / "ectier.lock", "a+")
    except OSError as exc:
        raise StoreOpenError(f"--path: cannot lock {str(store)!r}: {exc.strerror}") from None
    try:
        try:
            fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise StoreLockedError(f"--path: {str(store)!r} is in use by another process (a cache or the "
                                   "daemon); stop it before running ectier fsck") from None
        journal = swap.finish_pending(store)
        _refuse_no_store(store)
        yield None if journal is None else str(store / journal.damaged)
    finally:
        lock.close()


def _refuse_no_store(store: Path) -> None:
    """Raise unless ``store`` is a store directory whose index is there (StoreDamagedError: it
    lost its index; StoreOpenError: not a store directory)."""
    data_file = store / "lmdb" / "data.mdb"
    lost = lost_index(store, SEGMENT_NAME)  # (missing or empty beside payloads)
    if lost is not None:
        copies = [str(p) for p in damaged_copies(store) if (p / "lmdb").is_dir()]
        where = (f"; the index of a store moved aside may be in {', '.join(copies)} (check it with ectier "
                 "fsck --path)" if copies else "; remove the directory (or set nvme.on_damaged: reset) to "
                 "start afresh")
        raise StoreDamagedError(f"--path: the store in {str(store)!r} lost its index ({lost}): its payloads "
                                f"cannot be matched to keys without it, so nothing can be salvaged here{where}")
    if not store.is_dir():
        raise StoreOpenError(f"--path: {str(store)!r} does not exist" if not store.exists() else
                             f"--path: {str(store)!r} is not a directory")
    if not data_file.is_file():
        raise StoreOpenError(f"--path: {str(store)!r} is not an ectier store directory (no lmdb/data.mdb in it)")


def _check(store: Path) -> FsckReport:
    seg = store / SEGMENT_NAME
    found = {"damaged_copies": [str(p) for p in damaged_copies(store)],
             "stale_repairs": [str(p) for p in _stale_repairs(store)],
             "segment_bytes": seg.stat().st_size if seg.is_file() else 0}
    report = FsckReport(path=str(store), **found)
    error = _lmdb_pass(store / "lmdb", report)
    fmt = report.settings.get("format", "1")
    if fmt not in ("1", str(STORE_FORMAT)):  # (its records may be laid out otherwise: nothing to vouch for)
        raise StoreOpenError(f"--path: {str(store)!r} holds store format {fmt}, which this ectier does not read "
                             f"(formats 1 and {STORE_FORMAT}); check it with the ectier that wrote it")
    if error is not None:
        report = FsckReport(path=report.path, mode="page-scan", lmdb_error=error, **found)
        page_pass(store / "lmdb" / "data.mdb", report)
    return report


def _open_readonly(lmdb_dir: Path) -> lmdb.Environment:
    problem = lost_index(lmdb_dir.parent, SEGMENT_NAME) or check_tree(lmdb_dir / "data.mdb")  # (LMDB would
    # abort the process on a malformed page, and take a lost index for a new store)
    if problem is not None:
        raise lmdb.CorruptedError(problem)
    # (a live page past the end of data.mdb, a SIGBUS through LMDB's map, is found by the walk)
    return lmdb.open(str(lmdb_dir), readonly=True, lock=False, subdir=True, max_dbs=4)


def _lmdb_pass(lmdb_dir: Path, report: FsckReport, sink: Sink | None = None) -> str | None:
    """Walk the store through LMDB, filling ``report`` (and feeding ``sink`` every intact record).
    Returns LMDB's error when it cannot read the store whole, else ``None``."""
    try:
        env = _open_readonly(lmdb_dir)
    except (lmdb.Error, OSError) as exc:
        return str(exc)
    try:
        with env.begin() as txn:
            names = {bytes(k) for k in txn.cursor().iternext(values=False)}
        meta, quarantine, settings = (env.open_db(name) for name in (b"meta", b"quarantine", b"settings"))
        data = env.open_db(b"data") if b"data" in names else None
        segment = Segment(lmdb_dir.parent)
        with env.begin(buffers=True) as txn, segment:
            report.settings = {bytes(k).decode(errors="replace"): bytes(v).decode(errors="replace")
                               for k, v in txn.cursor(db=settings)}
            report.quarantined = sum(1 for _ in txn.cursor(db=quarantine).iternext(values=False))
            if report.settings.get("format", "1") == "1" and data is not None:  # layout v1
                headers = set()
                for digest, raw in txn.cursor(db=meta):
                    digest = bytes(digest)
                    headers.add(digest)
                    _check_one(report, digest, raw, txn.get(digest, db=data), sink)
                report.orphans = sum(1 for k in txn.cursor(db=data).iternext(values=False) if bytes(k) not in headers)
            else:
                _check_v2(report, [(bytes(d), bytes(v)) for d, v in txn.cursor(db=meta)], segment, sink)
    except lmdb.Error as exc:
        return str(exc)
    finally:
        env.close()
    return None


def _check_v2(report: FsckReport, entries: list[tuple[bytes, bytes]], segment: Segment, sink: Sink | None) -> None:
    """Check layout-v2 index entries ``(digest, value)``: each payload read from the segment file;
    of entries whose blocks overlap, the older is reported (a reused extent)."""
    parsed: list[tuple[bytes, bytes, RecordHeader, Location]] = []
    for digest, value in entries:
        try:
            header, loc = parse_index_value(value)
        except CorruptRecordError as exc:
            report.entries += 1
            report._problem(digest, None, str(exc), unreadable=False)
            continue
        parsed.append((digest, value, header, loc))
    reused = reused_extents([(d, h.version, loc) for d, _, h, loc in parsed])
    for digest, value, header, loc in parsed:
        if digest in reused:
            report.entries += 1
            report._problem(digest, header, "payload blocks overlap a newer record's (reused extent)", unreadable=False)
            continue
        raw = value[:header_nbytes(value)]
        _check_one(report, digest, raw, segment.payload(loc, header.payload_nbytes), sink)


def _check_one(report: FsckReport, digest: bytes, raw: object, payload: object | None, sink: Sink | None) -> None:
    report.entries += 1
    try:
        header = check_record(digest, raw, payload, decode=True)
    except CorruptRecordError as exc:
        try:
            header = unpack_header(raw)
        except CorruptRecordError:
            header = None
        report._problem(digest, header, str(exc), unreadable=payload is None)
        return
    report.intact += 1
    report.intact_bytes += len(raw) + header.payload_nbytes
    if sink is not None:
        sink(digest, bytes(raw), memoryview(payload))


# =============================================================================== repairing


def _build(store: Path, staging: Path, report: FsckReport) -> tuple[int, int]:
    """Write the intact records into a fresh store under ``staging`` (its ``lmdb`` is swapped in
    later); returns (records, bytes)."""
    capacity = max(16 * GiB, report.intact_bytes)
    tier = NvmeTier(NvmeTierConfig(path=str(staging), capacity_bytes=capacity, sync=False,
                                   map_initial_bytes=max(64 * MiB, min(capacity, report.intact_bytes * 2)),
                                   allow_network_fs=True,  # only fsck has this directory open
                                   thin_provisioning=True))  # a budget for the copy; the disk bounds it
    written = [0, 0]

    def sink(digest: bytes, raw: bytes, payload: memoryview) -> None:
        header = unpack_header(raw)
        if tier.write(digest, EncodedRecord(header, raw, payload, payload)):
            written[0] += 1
            written[1] += len(raw) + header.payload_nbytes

    try:
        if report.mode == "lmdb":
            error = _lmdb_pass(store / "lmdb", FsckReport(path=str(store)), sink)
            if error is not None:
                raise StoreOpenError(f"--path: LMDB failed while copying {str(store)!r}: {error}")
        else:
            page_pass(store / "lmdb" / "data.mdb", FsckReport(path=str(store)), sink)
    finally:
        tier.close()
    _write_settings(staging / "lmdb", report, written[0])
    return written[0], written[1]


def _write_settings(lmdb_dir: Path, report: FsckReport, salvaged: int) -> None:
    map_size = (lmdb_dir / "data.mdb").stat().st_size + 64 * MiB  # room for the settings write
    env = lmdb.open(str(lmdb_dir), subdir=True, max_dbs=4, sync=True, map_size=map_size)
    try:
        settings = env.open_db(b"settings")
        with env.begin(write=True) as txn:
            for name, value in report.settings.items():
                if name.encode() != RELEASE_MARKER and name != "format":
                    txn.put(name.encode(), value.encode(), db=settings)
            note = {"time": time.time(), "mode": report.mode, "lmdb_error": report.lmdb_error,
                    "found": report.entries, "salvaged": salvaged}
            txn.put(b"repaired", json.dumps(note).encode(), db=settings)
        env.sync(True)
    finally:
        env.close()
