"""Moves into and out of the NVMe tier: store (put, demotion, write-through, flush), read
(the bottom of every promotion), delete, and the budget bookkeeping around them.

Every function here runs on behalf of :class:`~ectier.mover.Mover` (``m``), takes the cache lock
(``m.cond``) only for bookkeeping, and does LMDB I/O outside it.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from ..entry import EntryMeta
from ..errors import EctierError, TierWriteError
from ..index import Slot
from ..logutil import RateLimitedLogger, failure_kind
from ..tensors import byte_view, output_for, torch_dtype
from ..tiers.nvme import NvmeDiskFullError, NvmeTier
from ..tiers.nvme_scan import gc_paused

if TYPE_CHECKING:
    from ..mover import Mover

__all__ = ["NvmeMoves", "RETRY"]

log = logging.getLogger(__name__)
#: one line per 10 s (with the count of those left out) while the disk stays full
_DISK_FULL_LOG = RateLimitedLogger(log, 10.0)


class _Retry:
    """The record read belongs to another version than the one looked up: look again."""

    def __repr__(self) -> str:
        return "RETRY"


RETRY = _Retry()


class NvmeMoves:
    """The NVMe tier's side of every move (``m``: the mover; ``tier``: the NVMe tier)."""

    def __init__(self, m: "Mover", tier: NvmeTier) -> None:
        self.m = m
        self._warn = RateLimitedLogger(log)  # per-entry failures: one line per kind per 10 s
        self.tier = tier
        self.index = tier.index
        # digest -> versions being copied to NVMe by store(register=False) now; guarded by m.cond
        self._writing: dict[bytes, list[int]] = {}
        # digest -> {version committed into the host whose write-through has not ended: the oldest
        # version of the key that may stay on NVMe until it lands (see expect_write_through_locked)}; m.cond
        self._through: dict[bytes, dict[int, int]] = {}

    # ------------------------------------------------------------------------- open
    def adopt_records(self) -> None:
        """At open: every stored record becomes a current entry, oldest first, then trim to budget."""
        from ..entry import advance_version

        with gc_paused():  # a few objects per record, none in a cycle (ectier.tiers.nvme_scan)
            records = self.tier.records()
            if records:
                advance_version(records[-1][1].version)
            with self.m.cond:  # oldest write first = least recently used; one call each
                self.m.catalog.set_current_many([(d, rec.version) for d, rec in records])
                self.index.track_many([(d, rec.stored_bytes) for d, rec in records])
            del records
        evicted, over = self.trim_to_budget()
        if evicted:  # a lowered budget (or a typo in it) costs stored entries: say so, once
            log.warning("nvme tier: %s held %d bytes more than nvme.capacity_bytes=%d: evicted the %d least "
                        "recently used record(s) at open (docs/operations.md, NVMe tier)", self.tier.path, over,
                        self.index.capacity_bytes, evicted)
        self.tier.compact_tail(every_record=True)  # records past a lowered budget's end: moved down, the file cut

    def trim_to_budget(self) -> tuple[int, int]:
        """Evict the least valuable records until the tier is within its budget; returns
        ``(records evicted, bytes the tier was over its budget)``."""
        over = self.index.over_budget_bytes()
        if over <= 0:
            return 0, 0
        with self.m.cond:
            victims = self.index.victims(over)
            doomed = self._claim_victims_locked(victims)
        return self._delete_victims(doomed), over

    # ------------------------------------------------------------------------- store
    def store(self, digest: bytes, meta: EntryMeta, version: int, src: torch.Tensor, *, register: bool,
              protect: bytes | None = None) -> bool:
        """Encode and write an entry, evicting NVMe victims to stay within budget.

        ``register`` makes the write the key's current version (a put that skipped the memory
        tiers); otherwise (a demotion, a flush) NVMe becomes a second copy of the current version.
        ``protect``: a digest whose record must not be evicted (an entry being promoted).
        Returns True if NVMe now holds ``version`` as the key's current bytes. A write that fails
        after its record committed (the clean-up raising) is logged and finished like any stored
        write: registered, or deleted as stale — never left stored but unaccounted for.

        Raises:
            TierWriteError: the write failed, or (``register``) the budget is held by writes in
                flight; nothing changed.
        """
        if register:  # a put's own write (concurrent with any overwrite): nobody waits for it
            return self._store(digest, meta, version, src, register=register, protect=protect)
        with self.m.cond:
            self._writing.setdefault(digest, []).append(version)
        try:
            return self._store(digest, meta, version, src, register=register, protect=protect)
        finally:
            with self.m.cond:
                versions = self._writing[digest]
                versions.remove(version)
                if not versions:
                    del self._writing[digest]
                self.m.cond.notify_all()  # an overwrite or a delete of the key may return now

    def _store(self, digest: bytes, meta: EntryMeta, version: int, src: torch.Tensor, *, register: bool,
               protect: bytes | None) -> bool:
        record = self.tier.encode(meta, src, version)
        size = self.tier.stored_bytes(record)
        doomed = self._reserve(digest, version, size, register=register, protect=protect)
        if doomed is None:
            return False
        try:
            self._delete_victims(doomed)
            try:
                written = self._write_or_make_room(digest, record, size, protect)
            except TierWriteError:
                self.m.counters.count("nvme", write_failures=1)
                raise
        except BaseException as exc:
            if self.tier.holds(digest, version):
                # the record committed before the failure (e.g. freeing the replaced record's
                # blocks raised): it is stored, so it is this key's newest NVMe version and must be
                # registered or dropped like any finished write, never left unaccounted for
                self._warn.warning(("failed after commit", *failure_kind(exc)), "nvme tier: a write failed "
                                   "after its record committed (%r); the record is kept", exc)
                return self._finish_store(digest, meta, version, size, True, register=register)
            with self.m.cond:
                self.index.end_write(digest, size)
                self.m.cond.notify_all()
            raise
        return self._finish_store(digest, meta, version, size, written, register=register)

    def _write_or_make_room(self, digest: bytes, record, size: int, protect: bytes | None) -> bool:
        """Write ``record``; on a full filesystem evict this tier's least valuable records (at
        least ``size`` bytes of them when there are) and retry once: a new entry is never refused
        while older ones hold the space.

        Raises:
            NvmeDiskFullError: still full after the evictions (or nothing to evict).
            TierWriteError: another write failure.
        """
        try:
            return self.tier.write(digest, record)
        except NvmeDiskFullError as exc:
            with self.m.cond:
                victims = self.index.victims_for_space(size, digest, protect)
                doomed = self._claim_victims_locked(victims)
            if not doomed:
                raise NvmeDiskFullError(f"{exc}; no record of this tier could be evicted to make room") from None
            evicted = self._delete_victims(doomed)
            self.m.counters.count("nvme", disk_full_evictions=evicted)
            _DISK_FULL_LOG.warning("disk full", "nvme tier: filesystem full; evicted %d records (least valuable "
                                   "first) and retrying the write once", evicted)
        try:  # into the evicted records' blocks (already on disk), not past the file's end
            return self.tier.write(digest, record, on_disk=True)
        except NvmeDiskFullError as exc:
            raise NvmeDiskFullError(f"{exc}; still full after evicting {len(doomed)} records of this tier") from None

    def _delete_victims(self, doomed: list[tuple[bytes, int]]) -> int:
        """Delete claimed victims (each one deleted counts an eviction); returns how many. One whose
        delete failed (LMDB error, e.g. a full disk) is still stored: it becomes its key's entry
        again (tracked), so nothing stored is lost or leaked."""
        evicted = 0
        for d, v in doomed:
            if self.tier.delete(d, only_version=v):
                self.m.counters.count("nvme", evictions=1)
                evicted += 1
                self.after_delete(d, v)
                continue
            with self.m.cond:
                rec = self.tier.record(d)
                current = self.m.catalog.version(d)
                if rec is not None and rec.version == v and (current is None or current == v):
                    self.m.catalog.set_current(d, v)
                    if not self.index.tracked(d):
                        self.index.track(d, rec.stored_bytes, self.m.catalog.cost(d))
        return evicted

    def _reserve(self, digest: bytes, version: int, size: int, *, register: bool,
                 protect: bytes | None) -> list[tuple[bytes, int]] | None:
        """Reserve ``size`` bytes of budget (claiming victims); ``None``: nothing to do."""
        m = self.m
        deadline = time.monotonic() + m.config.host.admit_wait_s
        with m.cond:
            while True:
                current = m.catalog.version(digest)
                if not register and current != version:
                    return None  # deleted or replaced meanwhile: nothing to demote
                if register and current is not None and current > version:
                    return None  # a newer put of this key won the race: this put is ordered before it
                victims = self.index.plan_write(digest, size, version, protect)
                if victims is not None:
                    break
                remaining = deadline - time.monotonic()
                if self.index.busy() and remaining > 0:
                    m.cond.wait(timeout=min(remaining, 0.05))  # budget held by writes/deletes in flight
                    continue
                m.counters.count("nvme", skipped_too_large=1)
                if register:
                    raise TierWriteError("nvme tier: budget nvme.capacity_bytes is held by in-flight writes")
                return None
            doomed = self._claim_victims_locked(victims)
            self.index.begin_write(digest, size)
        return doomed

    def _finish_store(self, digest: bytes, meta: EntryMeta, version: int, size: int, written: bool, *,
                      register: bool) -> bool:
        m = self.m
        stale = None
        with m.cond:
            # the reservation ends only once the record is tracked (or marked stale), so a
            # concurrent admission never sees its bytes as used but unevictable
            self.index.end_write(digest, size)
            m.cond.notify_all()
            current = m.catalog.version(digest)
            if written:
                m.counters.count("nvme", puts=1, put_bytes=meta.nbytes)
            rec = self.tier.record(digest)
            ours = rec is not None and rec.version == version
            # register only while NVMe still holds this write (a delete after it leaves the key absent)
            if register and ours and (current is None or current < version):
                m.catalog.set_current(digest, version)
                current = version
                m.drop_older_locked(digest, version)
            if ours:
                if current == version:
                    self.index.track(digest, rec.stored_bytes, m.catalog.cost(digest))
                    return True
                floor = self._through.get(digest, {}).get(current) if current is not None else None
                if floor is not None and floor <= version < current:
                    # the current version's write-through replaces this record (or, failing, deletes
                    # it): until then it is the key's only durable copy (a kill keeps an older value).
                    # Not when the key was deleted or a put that is not written through (GPU tier)
                    # came since this version (below the floor): nothing older than those may be
                    # left on NVMe once they return, though a later put's write-through is under way
                    self.index.track(digest, rec.stored_bytes, m.catalog.cost(digest))
                    return False
                # a newer version was committed (or the key deleted) while this write ran: this
                # record is stale, and goes even with nvme.write_through
                stale = version
                self.index.begin_delete()
                self.index.untrack(digest)
        if stale is not None:
            self.delete_claimed(digest, stale)
        return False

    def _claim_victims_locked(self, victims: list[bytes]) -> list[tuple[bytes, int]]:
        """Take NVMe victims out of the policy; returns ``(digest, version)`` to delete (evictions
        are counted by the deletes that succeed)."""
        doomed = []
        for d in victims:
            self.index.untrack(d)
            rec = self.tier.record(d)
            if rec is None:
                continue
            doomed.append((d, rec.version))  # (an eviction is counted once its delete succeeds)
            kept = False
            for t in self.m.stack.arenas():
                slot = t.current(d, rec.version)
                if slot is not None:
                    slot.lower_copy = False  # that memory copy is now the only one
                    kept = True
            if not kept:
                self.m.catalog.forget(d, rec.version)
        return doomed

    # ------------------------------------------------------------------------- deletes
    def claim_locked(self, digest: bytes, *, older_than: int | None = None) -> int | None:
        """Claim the record of ``digest`` (older than ``older_than``, when given) for deletion:
        untracked at once; returns its version for :meth:`delete_claimed`, or ``None``."""
        rec = self.tier.record(digest)
        if rec is None or (older_than is not None and rec.version >= older_than):
            return None
        self.index.untrack(digest)
        self.index.begin_delete()
        return rec.version

    def delete_claimed(self, digest: bytes, version: int) -> None:
        """Delete a record claimed by :meth:`claim_locked` (outside the lock)."""
        try:
            if self.tier.delete(digest, only_version=version):
                self.after_delete(digest, version)
        finally:
            with self.m.cond:
                self.index.end_delete()
                self.m.cond.notify_all()

    def after_delete(self, digest: bytes, version: int) -> None:
        """Bookkeeping after record ``version`` was deleted outside the lock: a concurrent write
        may have tracked that very record meanwhile; the key is gone unless memory holds it."""
        m = self.m
        with m.cond:
            if self.tier.closed or self.tier.record(digest) is not None:
                return
            self.index.untrack(digest)
            if m.catalog.version(digest) == version:
                kept = False
                for t in m.stack.arenas():
                    slot = t.current(digest, version)
                    if slot is not None:
                        kept = True
                        slot.lower_copy = False
                if not kept:
                    m.catalog.forget(digest, version)

    # ------------------------------------------------------------------------- reads
    def read(self, digest: bytes, ns: str, key: str, version: int, out: torch.Tensor | None = None, *,
             into: torch.Tensor | list[torch.Tensor] | None = None):
        """Read and check the record of ``version``: ``(meta, data)`` (``data`` a flat ``uint8``
        CPU tensor, or ``None`` when ``into`` was a list of runs and they were filled), ``None`` on
        a miss (failed check: the key is forgotten), or :data:`RETRY`.

        ``out``: the caller's ``get(out=)`` tensor; when it is a CPU tensor of the record's shape
        and dtype the payload is decoded straight into it (``data`` is then its bytes; on a miss its
        contents are undefined). ``into``: flat ``uint8`` CPU bytes of the record's raw size to
        decode into instead (a host slot reserved for a promotion), or a list of such runs (a slot
        in several runs of the arena: filled in order); takes precedence over ``out``."""
        m = self.m
        rec = self.tier.record(digest)
        if into is None:
            into = self._into(rec, out)
        try:
            if into is None:
                result = self.tier.read(digest, ns, key)
            elif isinstance(into, list):
                result = self.tier.read(digest, ns, key, runs=into)
            else:
                result = self.tier.read(digest, ns, key, out=into)
        except OSError as exc:  # the disk failed the read (EIO, ...): a miss; the record is kept (may be transient)
            m.counters.count("nvme", read_failures=1)
            self._warn.warning(("read", *failure_kind(exc)), "nvme tier: reading %r failed (%s); served as a miss",
                               key, exc)
            return None
        if result is None:
            m.counters.count("nvme", read_failures=1)
            with m.cond:
                if not any(t.lookup(digest) is not None for t in m.stack.arenas()):
                    m.catalog.forget(digest, version)
                if self.tier.record(digest) is None:  # a newer record written meanwhile stays evictable
                    self.index.untrack(digest)
            return None
        header, data = result
        if header.version != version:
            return RETRY
        if rec is not None and rec.header is header:  # the record this tier holds: its meta is made
            return rec.meta, data
        return EntryMeta(header.namespace, header.key, header.dtype, tuple(header.shape), header.raw_nbytes), data

    @staticmethod
    def _into(rec, out: torch.Tensor | None) -> torch.Tensor | None:
        """The bytes of ``out`` if the record ``rec`` can be decoded straight into them."""
        if rec is None or not isinstance(out, torch.Tensor) or not out.is_cpu:
            return None
        try:
            meta = rec.meta
            if (meta.dtype == "uint8" and out.dtype is torch.uint8 and out.dim() == 1 and len(meta.shape) == 1
                    and out.numel() == meta.nbytes and out.is_contiguous()):
                return out  # an entry of flat bytes, and out= of its size: no views to make
            if (out.shape == meta.shape and out.dtype is torch_dtype(meta.dtype) and out.is_contiguous()
                    and not out.requires_grad and out.numel() > 1):
                return out.view(-1).view(torch.uint8)  # out= of the entry's own shape and dtype: its bytes
            return byte_view(output_for(meta, out))
        except EctierError:
            return None  # unsuitable: tensor_from_bytes raises for it after the read, as before

    # ------------------------------------------------------------------------- memory -> NVMe
    def demote_slot(self, src_tier, slot: Slot, *, write_through: bool = False, write_behind: bool = False,
                    protect: bytes | None = None) -> bool:
        """Write a pinned memory slot of ``src_tier`` to NVMe (a demotion, a flush, a put's
        write-through, or a write-behind: ``moves/writeback.py``, which logs its own failures).
        True if NVMe now holds this version."""
        if not self.tier.fits(slot.meta.nbytes):
            self.m.counters.count("nvme", skipped_too_large=1)
            return False
        view = self.m.arena.cpu_bytes(src_tier, slot)
        if view is None:
            return False
        try:
            ok = self.store(slot.digest, slot.meta, slot.version, view, register=False, protect=protect)
        except TierWriteError as exc:
            if write_behind:
                log.debug("write-behind of an entry to NVMe failed (%s); the entry stays in host memory", exc)
            elif write_through:
                self._warn.warning(("write-through", *failure_kind(exc)), "write-through of an entry to NVMe "
                                   "failed (%s); the entry stays in host memory only (not durable)", exc)
            else:
                self._warn.warning(("demotion", *failure_kind(exc)), "demotion of an entry to NVMe failed (%s); "
                                   "entry dropped", exc)
            return False
        if ok:
            with self.m.cond:  # (unless an NVMe eviction took the record since: then it is the only copy)
                slot.lower_copy = self.tier.holds(slot.digest, slot.version)
        return ok

    def wait_not_writing_locked(self, digest: bytes, older_than: int | None = None) -> None:
        """Under ``m.cond``: wait until no copy of ``digest`` to NVMe (``store(register=False)``,
        of a version older than ``older_than``, when given) is in flight — a demotion by an
        eviction in any thread, a flush, a write-through, a write-behind. (A put's or a remote
        fetch's own write, ``register=True``, is concurrent with the overwrite: either order is
        a valid outcome, and its stale record is deleted when it lands.) An overwrite or a delete of the key
        returns only then: the older record such a write may commit is deleted as stale before,
        so a restart never serves bytes older than the put or the delete (docs/reliability.md)."""
        while any(older_than is None or v < older_than for v in self._writing.get(digest, ())):
            self.m.cond.wait()

    def expect_write_through_locked(self, digest: bytes, version: int, replaced: int | None) -> None:
        """Under ``m.cond``: a put of ``version`` committed into the host, replacing the key's
        current version ``replaced`` (``None``: the key was absent — deleted, evicted or never
        stored), its :meth:`write_through` to follow. Until that ends, a record of the key that
        lands meanwhile is kept (not deleted as stale) if it is no older than ``replaced`` — or
        than the oldest version an overlapping write-through of ``replaced`` keeps: such a record
        is what this write replaces in one transaction. An older one (a delete or a GPU-tier put
        came between it and this put) goes at once."""
        through = self._through.setdefault(digest, {})
        floor = version if replaced is None else through.get(replaced, replaced)
        through[version] = min(floor, version)

    def write_through(self, host, digest: bytes, version: int) -> None:
        """Write the host entry ``version`` of ``digest`` (just committed by a put) to NVMe.

        Its write replaces the key's older record, if any, in one LMDB transaction (a crash leaves
        the old record or the new one, never neither). Where it does not land (a newer put of the
        key committed meanwhile, or the write failed), this waits (:meth:`await_newer_locked`),
        then deletes the records older than ``version``: no bytes older than this put are served
        after it returns, in-process or after a restart, and until a version at least as new as
        this one is on NVMe the older record stays (a kill between never leaves the key without one).
        """
        landed = False
        try:
            with self.m.cond:
                slot = host.current(digest, version)
                if slot is not None:
                    host.pin(slot)
            if slot is not None:
                try:
                    landed = self.demote_slot(host, slot, write_through=True)
                finally:
                    self.m.unpin(host, slot)
        finally:
            self._end_write_through(digest, version, landed)

    def _end_write_through(self, digest: bytes, version: int, landed: bool) -> None:
        stale = None
        with self.m.cond:
            versions = self._through.get(digest, {})
            versions.pop(version, None)
            if not versions:
                self._through.pop(digest, None)
            self.m.cond.notify_all()
            if not landed:  # (the wait and the claim in one hold of the lock: nothing registers between)
                self.await_newer_locked(digest, version)
                stale = self.claim_locked(digest, older_than=version)
        if stale is not None:
            self.delete_claimed(digest, stale)

    def await_newer_locked(self, digest: bytes, version: int) -> None:
        """Under ``m.cond``: the write-through of ``version`` did not land; wait while NVMe holds
        no record of ``digest`` at least as new as ``version`` and a write-through of a newer
        version is under way — registered now, not only when the wait began (one that ends without
        landing may have been overtaken by a later one). That one replaces the older record in one
        transaction, or deletes it on failure. It ends: the newest write-through under way waits
        for nothing, and a put waiting here puts nothing more (n threads: at most n - 1 wait)."""
        def durable() -> bool:
            rec = self.tier.record(digest)
            return rec is not None and rec.version >= version

        while not durable() and any(v > version for v in self._through.get(digest, ())):
            self.m.cond.wait()
