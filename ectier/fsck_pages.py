"""``ectier fsck``'s page scan: salvage the records of a ``data.mdb`` that LMDB cannot read, page
by page (:mod:`ectier.tiers.lmdbpages`), matching each index value or header found to its payload
(layout v2: in ``segment.0``; layout v1: in overflow pages, also runs whose leaf was destroyed).
Called by :mod:`ectier.fsck`, whose :class:`~ectier.fsck.FsckReport` it fills."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable

from .codec import RECORD_MAGIC, RecordHeader, checksum, header_nbytes, unpack_header
from .entry import entry_digest
from .errors import CorruptRecordError, StoreOpenError
from .fsck_segment import Segment
from .tiers.lmdbpages import LeafValue, PageFile
from .tiers.nvme import check_record
from .tiers.nvme_record import parse_index_value

if TYPE_CHECKING:
    from .fsck import FsckReport, Sink

__all__ = ["page_pass"]

_MAX_HEADER_GUESS = 64 * 1024  # values up to this size are tried as headers
_KEPT_SETTINGS = (b"format", b"created")  # the settings read back from the pages


def page_pass(data_file: Path, report: FsckReport, sink: Sink | None = None) -> None:
    """Salvage by reading ``data.mdb`` page by page: per digest, the newest header whose payload
    (among the values found under that digest) passes every check."""
    try:
        pf = PageFile(data_file)
    except OSError as exc:
        raise StoreOpenError(f"--path: cannot read {str(data_file)!r}: {exc.strerror}") from None
    with pf:
        headers: dict[bytes, dict[bytes, RecordHeader]] = {}
        payloads: dict[bytes, dict[tuple, LeafValue]] = {}
        v2: dict[bytes, dict[bytes, None]] = {}  # digest -> layout-v2 index values found (in order)
        for value in pf.iter_leaf_values():
            if len(value.key) != 32:
                if value.key in _KEPT_SETTINGS and value.inline is not None:
                    report.settings[value.key.decode()] = value.inline.decode(errors="replace")
                continue
            index_value = _as_record(pf, value, _index_header)
            if index_value is not None:
                v2.setdefault(value.key, {})[index_value[0]] = None
                continue
            header_raw = _as_record(pf, value, unpack_header)
            if header_raw is not None:
                headers.setdefault(value.key, {})[header_raw[0]] = header_raw[1]
                continue
            ident = ("o", value.overflow_pgno, value.size) if value.inline is None else ("i", value.inline)
            payloads.setdefault(value.key, {})[ident] = value
        report.damaged_pages = pf.damaged_pages
        with Segment(data_file.parent.parent) as segment:
            for digest, values in v2.items():
                _salvage_v2(report, digest, list(values), segment, sink)
        unmatched: dict[bytes, tuple[dict[bytes, RecordHeader], str | None]] = {}
        for digest, found in headers.items():
            report.entries += 1
            matched, error = _salvage_one(report, pf, digest, found, list(payloads.get(digest, {}).values()), sink)
            if not matched:
                unmatched[digest] = (found, error)
        _salvage_from_runs(report, pf, unmatched, sink)


def _as_record(pf: PageFile, value: LeafValue, parse: Callable[[bytes], RecordHeader]) -> tuple[bytes, RecordHeader] | None:
    """``(raw, header)`` if the value found in a page parses with ``parse`` (a layout-v1 header, or
    a layout-v2 index value's) as a record of this very digest, else None."""
    if value.size > _MAX_HEADER_GUESS:
        return None
    raw = pf.read_value(value)
    if raw is None or raw[:4] != RECORD_MAGIC:
        return None
    try:
        header = parse(raw)
    except CorruptRecordError:
        return None
    return (raw, header) if entry_digest(header.namespace, header.key) == value.key else None


def _index_header(raw: bytes) -> RecordHeader:
    return parse_index_value(raw)[0]


def _first_intact(report: FsckReport, digest: bytes, candidates: Iterable[tuple[bytes, RecordHeader, bytes | None]],
                  sink: Sink | None) -> tuple[bool, str | None]:
    """Salvage the first of ``candidates`` (raw header, header, payload or None: unreadable), given
    newest first, that passes every check; returns (salvaged?, the last check error)."""
    error = None
    for raw, header, payload in candidates:
        if payload is None:
            continue
        try:
            check_record(digest, raw, payload, decode=True)
        except CorruptRecordError as exc:
            error = str(exc)
            continue
        _salvaged(report, raw, header, payload, digest, sink)
        return True, None
    return False, error


def _salvage_v2(report: FsckReport, digest: bytes, values: list[bytes], segment: "Segment", sink: Sink | None) -> None:
    """Page scan, layout v2: the newest index value of ``digest`` whose payload passes every check."""
    report.entries += 1
    parsed = sorted(((parse_index_value(v), v) for v in values), key=lambda x: -x[0][0].version)
    ok, error = _first_intact(report, digest, ((v[:header_nbytes(v)], h, segment.payload(loc, h.payload_nbytes))
                                               for (h, loc), v in parsed), sink)
    if not ok:
        report._problem(digest, parsed[0][0][0], error or "payload not readable from the segment file",
                        unreadable=error is None)


def _salvage_one(report: FsckReport, pf: PageFile, digest: bytes, found: dict[bytes, RecordHeader],
                 candidates: list[LeafValue], sink: Sink | None) -> tuple[bool, str | None]:
    """Page scan, layout v1: the values found under ``digest``, newest header first; (salvaged?, last check error)."""
    return _first_intact(report, digest, ((raw, header, pf.read_value(cand))
                                          for raw, header in sorted(found.items(), key=lambda kv: -kv[1].version)
                                          for cand in candidates if cand.size == header.payload_nbytes), sink)


def _salvaged(report: FsckReport, raw: bytes, header: RecordHeader, payload: bytes, digest: bytes,
              sink: Sink | None) -> None:
    report.intact += 1
    report.intact_bytes += len(raw) + header.payload_nbytes
    if sink is not None:
        sink(digest, raw, memoryview(payload))


def _salvage_from_runs(report: FsckReport, pf: PageFile, unmatched: dict, sink: Sink | None) -> None:
    """Headers whose payload's leaf was destroyed: look for the payload among the overflow runs of
    its exact page count, by its checksum (each run is read once per payload size wanted); per
    digest the newest header that matches wins."""
    by_size: dict[int, dict[int, list[tuple[bytes, bytes, RecordHeader]]]] = {}
    for digest, (found, _) in unmatched.items():
        for raw, header in found.items():
            by_size.setdefault(header.payload_nbytes, {}).setdefault(header.payload_checksum, []).append(
                (digest, raw, header))
    best: dict[bytes, tuple[bytes, RecordHeader, int]] = {}
    for size, wanted in by_size.items():
        if size <= 0:
            continue
        pages = pf.overflow_pages(size)
        for pgno, n in pf.overflow_runs:
            payload = pf.read_value(LeafValue(b"", size, overflow_pgno=pgno)) if n == pages else None
            if payload is None:
                continue
            for digest, raw, header in wanted.get(checksum(payload), []):
                if digest in best and best[digest][1].version >= header.version:
                    continue
                try:
                    check_record(digest, raw, payload, decode=True)
                except CorruptRecordError:
                    continue
                best[digest] = (raw, header, pgno)
    for digest, (found, error) in unmatched.items():
        if digest in best:
            raw, header, pgno = best[digest]
            payload = pf.read_value(LeafValue(b"", header.payload_nbytes, overflow_pgno=pgno))
            _salvaged(report, raw, header, payload, digest, sink)
            continue
        newest = max(found.values(), key=lambda h: h.version)
        if error is not None:
            report._problem(digest, newest, error, unreadable=False)
        else:
            report._problem(digest, newest, "payload not found in any readable page", unreadable=True)
