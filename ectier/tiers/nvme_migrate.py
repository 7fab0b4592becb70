"""Migration of a layout-v1 NVMe store (header and payload both in LMDB) to layout v2, at open.

Layout v1 (ectier before issue 12): ``lmdb/data.mdb`` with databases ``meta`` (digest -> packed
header), ``data`` (digest -> payload), ``quarantine``, ``settings`` (``format`` = ``1``). Layout v2
keeps ``meta`` (each value now the header followed by the payload's location), moves every payload
into ``segment.0`` and drops ``data``.

The migration is crash-safe and idempotent: it first copies every payload into the segment file
(checking each against its header's xxh3-64 checksum; a record that fails is quarantined, as a read
would) and ``fdatasync``\\ s it, then one LMDB transaction rewrites every index entry, drops ``data``
and sets the format to 2. A crash before that commit leaves a format-1 store whose payloads are
all still in ``data`` (the next open migrates again, from block 0: no v2 entry names any block yet);
after it, a v2 store. The LMDB file keeps its size (its freed pages hold later index entries).

Decision (docs/operations.md, "Upgrading a store from layout v1"): migrate at open rather than refuse,
because the copy is bounded by the store's own bytes, needs no second directory, and a refusal would
make every engine restart after an upgrade an outage.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from ..codec import header_nbytes, unpack_header, verify_payload
from ..errors import CorruptRecordError
from .nvme_record import pack_index_value, parse_index_value

if TYPE_CHECKING:
    from .nvme_env import NvmeEnv

__all__ = ["migrate_v1"]

log = logging.getLogger("ectier.tiers.nvme")


def migrate_v1(store: "NvmeEnv") -> int:
    """Migrate the open format-1 store of ``store`` to layout v2 (see the module docstring).

    Returns the number of records migrated.

    Raises:
        OSError: the segment file cannot be written (disk full: free space, then open again; the
            store is left in format 1, unchanged).
        lmdb.Error: from LMDB (the caller turns it into a StoreOpenError / StoreDamagedError).
    """
    env, space, segment = store.env, store.space, store.segment
    assert env is not None and segment is not None
    t0 = time.monotonic()
    data_db = env.open_db(b"data")
    values: list[tuple[bytes, bytes]] = []
    bad: list[tuple[bytes, bytes, str]] = []
    with env.begin(buffers=True) as txn:
        kept = []  # entries already in layout v2 (a store whose format was set back by hand): left as they are
        for _, raw in txn.cursor(db=store.meta_db):
            try:
                kept.extend(parse_index_value(raw)[1].extents)
            except CorruptRecordError:
                pass
        space.rebuild(kept)
        for digest, raw in txn.cursor(db=store.meta_db):
            digest, raw = bytes(digest), bytes(raw)
            payload = txn.get(digest, db=data_db)
            try:
                if payload is None and len(raw) > header_nbytes(raw):
                    continue  # layout v2 already
                header = unpack_header(raw)
                if payload is None:
                    raise CorruptRecordError("payload missing")
                verify_payload(header, payload)
            except CorruptRecordError as exc:
                bad.append((digest, raw, str(exc)))
                continue
            loc = space.allocate(len(payload))
            segment.write(loc, memoryview(payload))
            values.append((digest, pack_index_value(header, loc)))
    segment.flush()
    with env.begin(write=True) as txn:
        for digest, value in values:
            txn.put(digest, value, db=store.meta_db)
        for digest, raw, reason in bad:
            store.quarantine_in(txn, digest, raw, reason)
        txn.drop(data_db, delete=True)
        txn.put(b"format", b"2", db=store.settings_db)
        txn.put(b"migrated", f'{{"from": 1, "time": {time.time()}}}'.encode(), db=store.settings_db)
    if store.config.sync:
        env.sync(True)
    log.warning("nvme tier: migrated the layout-v1 store in %s to layout v2 (%d records, %d quarantined, "
                "%.1f s)", store.path, len(values), len(bad), time.monotonic() - t0)
    return len(values)
