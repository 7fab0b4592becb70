"""The mover: every move of an entry between two tiers, in one place.

Moves are registered per edge (source tier, destination tier), in the shape of vLLM's
``kv_offload`` worker (a transfer handler per medium pair; a handler's exception is a failed
transfer, never an error of an unrelated call):

==============  =======================================  =====================================
edge            handler                                  when
==============  =======================================  =====================================
gpu → host      ``ArenaMoves.demote_device`` (async D2H)  a GPU victim
gpu → nvme      ``NvmeMoves.demote_slot``                a GPU victim the host cannot take; flush
host → nvme     ``NvmeMoves.demote_slot``                a host victim; write-through; flush
nvme → host     ``ArenaMoves.store`` (promotion)         an NVMe hit (get, acquire, prefetch)
nvme → gpu      ``ArenaMoves.promote_device``            an NVMe hit asked for ``gpu.device``
host → gpu      ``ArenaMoves.promote_device``            a host hit asked for ``gpu.device``
==============  =======================================  =====================================

What the mover owns: admission with eviction (one loop for every tier), demotion of victims down
the stack, the commit rules (which version stands), the one promotion sequence (read from the
store tier, then up the stack towards the asked tier), write-through, flush, and the completion
of copies in flight. Tiers never call it; it never calls the facade.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import torch

from .catalog import Catalog, PendingWrite
from .config import CacheConfig
from .copy import Completer, CopyEngine, CopyHandle
from .entry import EntryMeta, next_version
from .errors import CacheClosedError, EctierError
from .handles import PutHandle
from .index import Slot
from .logutil import RateLimitedLogger, failure_kind
from .moves.arena import ArenaMoves
from .moves.nvme import NvmeMoves
from .moves.outcomes import IN_FLIGHT, Commit
from .moves.promote import Promotions
from .moves.remote import RemoteMoves
from .moves.writeback import WriteBehind
from .stack import TierStack
from .stats import Counters
from .tensors import byte_view
from .tiers.arena import ArenaTier
from .tiers.base import Tier

__all__ = ["Mover", "Commit", "RETRIES"]

log = logging.getLogger(__name__)

#: how often a lookup is tried again when a concurrent overwrite changes the key under it
RETRIES = 3

#: exceptions a move may raise that make it a failed move (counted, logged), never an error of
#: the call that triggered it: ectier's own, device errors (CUDA OOM is a RuntimeError), I/O errors
MOVE_ERRORS = (EctierError, RuntimeError, OSError)

class Mover:
    """Moves entries between the tiers of ``stack``.

    Attributes:
        RETRIES: lookups tried again after a concurrent overwrite (:data:`RETRIES`).

    Args:
        config: the cache's config (admission waits, write-through).
        stack: the configured tiers.
        catalog: versions and writes in flight; its ``cond`` is the cache's lock.
        counters: the cache's counters.
        engine_for: ``device -> CopyEngine | None`` (``None``: plain synchronous copies).
    """

    RETRIES = RETRIES

    def __init__(self, config: CacheConfig, stack: TierStack, catalog: Catalog, counters: Counters,
                 engine_for: Callable[[torch.device], CopyEngine | None]) -> None:
        self.config = config
        self._warn = RateLimitedLogger(log)  # failed moves: one line per kind per 10 s, with a count
        self.stack = stack
        self.catalog = catalog
        self.cond = catalog.cond
        self.lock = catalog.lock  # the same lock as cond (see Catalog.lock)
        self.counters = counters
        self.engine_for = engine_for
        self._cpu_engine = engine_for(torch.device("cpu"))  # the same for every device but CUDA
        #: True when copies of CPU tensors are plain synchronous ones (no copy engine for the CPU)
        self.sync_cpu_copies = self._cpu_engine is None
        self.completer = Completer()
        self.write_through = config.nvme.write_through
        self.arena = ArenaMoves(self)
        store = stack.get("nvme")
        self.nvme = NvmeMoves(self, store) if store is not None else None
        remote = stack.remote()
        self.remote = RemoteMoves(self, remote) if remote is not None else None
        self._arenas, self._stores = stack.arenas(), stack.stores()  # fixed once open (hot loops)
        self._other_arenas = len(self._arenas) > 1  # a commit may have older copies to drop elsewhere
        self._demotions: dict[tuple[str, str], Callable[..., bool]] = {}
        self._register()
        self.write_behind = self._make_write_behind()
        self._put_followups = self.remote is not None or (self.write_through and self.nvme is not None)
        self._waiters = catalog.waiters
        self.promote = Promotions(self)  # the promotion sequence and the upward edges (moves/promote.py)

    # ------------------------------------------------------------------------- the edges
    def _register(self) -> None:
        gpu, host, nvme = (self.stack.get(n) for n in ("gpu", "host", "nvme"))
        if gpu is not None and host is not None:
            self._demotions["gpu", "host"] = (  # counted when its copy completes (finish_write)
                lambda v, protect: self.arena.demote_device(gpu, host, v, protect) and IN_FLIGHT)
        if nvme is not None:
            for src in (gpu, host):
                if src is not None:
                    self._demotions[src.name, "nvme"] = (
                        lambda v, protect, src=src: self.nvme.demote_slot(src, v, protect=protect))

    def _make_write_behind(self) -> WriteBehind | None:
        """The host tier's write-behind (``host.write_behind_fraction``), or ``None``: off, no host or
        NVMe tier, or ``nvme.write_through`` (every host entry is written at its put already)."""
        host = self.stack.get("host")
        reserve = int(self.config.host.write_behind_fraction * host.capacity_bytes) if host is not None else 0
        if self.nvme is None or reserve <= 0 or self.write_through:
            return None
        return WriteBehind(self, host, reserve)

    def close_write_behind(self) -> None:
        """Stop the write-behind (its write in flight finishes first); before a flush and before
        the tiers close. Idempotent."""
        if self.write_behind is not None:
            self.write_behind.close()

    def edges(self) -> list[tuple[str, str]]:
        """Every registered edge ``(source tier, destination tier)``: demotions, then promotions."""
        return list(self._demotions) + self.promote.edges()

    def run_move(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """Run ``fn`` inside the error boundary of a move (see :meth:`_run`); ``None`` if it failed."""
        return self._run(what, fn, *args, **kwargs)

    def _run(self, what: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """The error boundary of a move: an exception is a failed move (logged), never raised."""
        try:
            return fn(*args, **kwargs)
        except MOVE_ERRORS as exc:
            level = logging.DEBUG if isinstance(exc, CacheClosedError) else logging.WARNING  # (close() raced it)
            self._warn.log(level, (what, *failure_kind(exc)), "%s failed (%s: %s); entry not moved",
                           what, type(exc).__name__, exc)
            return None

    # ------------------------------------------------------------------------- admission
    def admit(self, tier: ArenaTier, digest: bytes, meta: EntryMeta, version: int, *, promotion: bool,
              protect: bytes | None = None, wait: bool | None = None) -> Slot | None:
        """Reserve room for an entry in a memory tier, moving its victims down as needed.

        Returns the reserved (invisible) slot, or ``None``: no room within ``host.admit_wait_s``
        (at once with ``wait`` False, the default for a promotion, unless the host's write-behind
        holds a pin: one write, waited for), or a promotion became pointless. With
        ``host.promote_clean_only`` a promotion into the host evicts only entries a lower tier
        already holds, so a get never waits on demotion writes.
        """
        # waits only for readers' pins: room that open reservations hold (another party's put in
        # progress, e.g. a daemon client's) is not waited for, the caller tries the next tier
        started = time.monotonic()  # admit_wait_s counts from here, evictions included
        clean_only = promotion and tier.name == "host" and self.config.host.promote_clean_only
        wait = not promotion if wait is None else wait
        while True:
            with self.lock:
                if promotion and (self.catalog.version(digest) != version or tier.lookup(digest) is not None):
                    return None
                adm = tier.admit(digest, meta, version, cost_s=self.catalog.cost(digest), clean_only=clean_only)
                if adm.entry is not None:
                    return adm.entry
                if adm.too_large:
                    self.counters.count(tier.name, skipped_too_large=1)
                    return None
                if adm.blocked:
                    step = 0.01 if tier.device is not None else 0.05
                    remaining = started + self.config.host.admit_wait_s - time.monotonic()
                    # a promotion waits only for the write-behind's pin (one write), never for readers
                    wb = self.write_behind
                    writing = wb is not None and tier is wb.host and wb.writing is not None
                    if (not wait and not writing) or remaining <= 0 or _held_by_reservations(tier, meta.nbytes):
                        self.counters.count(tier.name, admission_timeouts=1)
                        return None
                    self.cond.wait(timeout=min(remaining, step))
                    continue
            self.evict(tier, adm.victims, protect=protect)

    def abort(self, tier: ArenaTier, slot: Slot) -> None:
        with self.cond:
            tier.abort(slot)
            self.cond.notify_all()

    def evict(self, tier: ArenaTier, victims: list[Slot], *, protect: bytes | None = None) -> None:
        """Move pinned victims of ``tier`` down (or drop them), then release them.

        Every victim is released even if a move raises something unexpected (the rest are then
        dropped), so an error never leaks pinned blocks.
        """
        pending = list(victims)
        try:
            while pending:
                v = pending[0]
                moved: bool | None = False
                try:
                    moved = self.demote(tier, v, protect=protect)
                finally:
                    pending.pop(0)
                    self._release_victim(tier, v, moved)
        finally:
            for v in pending:
                self._release_victim(tier, v, False)

    def demote(self, tier: ArenaTier, v: Slot, *, protect: bytes | None = None) -> bool | str | None:
        """Move a pinned victim to the nearest lower tier that takes it. True if a lower tier
        holds its version, ``IN_FLIGHT`` once its copy there is enqueued (a GPU victim); ``None``
        if its version was replaced or deleted meanwhile (nothing to keep, nothing lost)."""
        host = tier.name == "host"
        with self.cond:
            if not self.catalog.is_current(v.digest, v.version):
                return None
            for t in self.stack.below(tier):
                if t.holds(v.digest, v.version):
                    if self.nvme is not None and t is self.nvme.tier:
                        self.nvme.index.touch(v.digest)
                    if host:
                        self.counters.count("host", clean_evictions=1)
                    return True
        started = time.perf_counter()
        moved: bool | None = False
        try:
            for dst in self.stack.below(tier):
                handler = self._demotions.get((tier.name, dst.name))
                if handler is not None and (done := self._run(f"demotion {tier.name} -> {dst.name}", handler, v, protect)):
                    moved = done
                    return done
            with self.cond:  # a newer version or a delete during the write: nothing was lost
                rec = self.nvme.tier.record(v.digest) if self.nvme is not None else None
                newer = rec is not None and rec.version > v.version  # (a put whose record just landed)
                moved = None if newer or not self.catalog.is_current(v.digest, v.version) else False
                return moved
        finally:  # a write inside the call that needed the room (none counted for a replaced version)
            if host and self.nvme is not None and moved is not None:
                self.counters.count("host", dirty_evictions=1, eviction_write_s=time.perf_counter() - started)

    def _release_victim(self, tier: ArenaTier, v: Slot, moved: bool | str | None) -> None:
        with self.cond:
            tier.release_victim(v)
            if moved is IN_FLIGHT:  # a demotion or a drop once its copy completes (ArenaMoves.finish_write)
                self.counters.count(tier.name, evictions=1)
            elif moved is not None:  # (None: a replaced or deleted version, no entry evicted)
                self.counters.count(tier.name, evictions=1, **{"demotions" if moved else "drops": 1})
            # moved or not: an NVMe eviction since the demotion's write kept the key for this slot only
            self.forget_if_unheld_locked(v.digest, v.version)
            self.cond.notify_all()

    # ------------------------------------------------------------------------- commits
    def commit(self, tier: ArenaTier, slot: Slot, *, promotion: bool, pending: PendingWrite | None = None,
               keep_older_record: bool = False, pin_after: bool = False) -> Commit:
        """Make a written slot visible, or drop it if a newer version won.

        A put stands against older versions everywhere (they are removed; the store tier's older
        record is deleted before this returns unless ``keep_older_record``: a write-through will
        replace it in one transaction). A promotion stands only while its version is current and
        the tier does not hold the key. ``pin_after`` pins the committed slot for the caller.
        """
        digest, version = slot.digest, slot.version
        stale: list[tuple[bytes, int]] = []
        with self.lock:
            if pending is not None and pending.cancelled:  # deleted (or closed) while the copy ran
                tier.abort(slot)
                self.cond.notify_all()
                return Commit.CANCELLED
            versions = self.catalog.versions  # (version / set_current, without the calls)
            current = versions.get(digest)
            newer_below = False
            for t in self._stores:
                sv = t.stored_version(digest)
                if sv is not None and sv > version:
                    newer_below = True
            if promotion:
                superseded = current != version or tier.lookup(digest) is not None or newer_below
            else:
                superseded = (current is not None and current > version) or newer_below
            if superseded:
                tier.abort(slot)
                self.cond.notify_all()
                return Commit.DROPPED if promotion else Commit.SUPERSEDED
            if tier.commit(slot) is not None and self._waiters:  # (notify_all, when someone waits)
                self.cond.notify_all()
            if pin_after:
                tier.pin(slot)
            if self._other_arenas:
                self.drop_older_locked(digest, version, besides=tier)
            versions[digest] = version
            if self.nvme is not None:
                if keep_older_record and not promotion and tier.name == "host":  # after_put writes it through
                    self.nvme.expect_write_through_locked(digest, version, current)
                if self.nvme.tier.holds(digest, version):
                    slot.lower_copy = True
                elif not keep_older_record:
                    old = self.nvme.claim_locked(digest, older_than=version)  # never a newer record
                    if old is not None:
                        stale.append((digest, old))
                if self.write_behind is not None and tier is self.write_behind.host:
                    # after the admission (never during it: its pins would turn the admission's
                    # victims away): the window moved, and may hold dirty entries now
                    self.write_behind.poke()
        for d, v in stale:
            # the key's older record goes before put returns, so a restart never serves it
            self.nvme.delete_claimed(d, v)
        if not promotion and self.nvme is not None:
            with self.cond:  # likewise an older version being written to NVMe now (a demotion, a write-behind)
                self.nvme.wait_not_writing_locked(digest, older_than=version)
        return Commit.COMMITTED

    def delete(self, digest: bytes) -> bool:
        """Remove ``digest`` from every tier (a write in flight is cancelled: its commit becomes an
        abort, ordered before this delete). True if it was stored or in flight."""
        with self.cond:
            self.catalog.deletes += 1
            self.catalog.deleting[digest] = self.catalog.deleting.get(digest, 0) + 1
        try:
            return self._delete(digest)
        finally:
            with self.cond:  # (a remote fetch that began during it is not placed: moves/remote.py)
                self.catalog.deletes += 1
                left = self.catalog.deleting.pop(digest) - 1
                if left:
                    self.catalog.deleting[digest] = left

    def _delete(self, digest: bytes) -> bool:
        stale = None
        with self.cond:
            existed = self.catalog.forget(digest)
            existed = self.catalog.cancel_pending(digest) or existed
            for t in self.stack.arenas():
                if t.delete(digest):
                    self.cond.notify_all()
            self.catalog.set_cost(digest, None)
            if self.nvme is not None:
                stale = self.nvme.claim_locked(digest)
        if stale is not None:
            self.nvme.delete_claimed(digest, stale)
        if self.nvme is not None:
            with self.cond:  # an NVMe write of the key in flight deletes its record before this returns
                self.nvme.wait_not_writing_locked(digest)
        if self.remote is not None:
            self.remote.delete(digest)
        return existed

    def after_put(self, tier: ArenaTier, digest: bytes, version: int, nbytes: int) -> None:
        """A put committed into ``tier``: count it and write it through to NVMe if configured."""
        self.counters.count_put(tier.name, nbytes)
        if self.write_through and self.nvme is not None and tier.name == "host":
            self.nvme.write_through(tier, digest, version)
        if self.remote is not None:
            self.remote.write_later(tier, digest, version, nbytes)

    def drop_older_locked(self, digest: bytes, version: int, *, besides: Tier | None = None) -> None:
        """Remove memory copies of ``digest`` older than ``version`` (a newer one was committed)."""
        for t in self._arenas:
            if t is not besides and t.remove_older(digest, version):
                self.cond.notify_all()

    def drop_slot(self, tier: ArenaTier, slot: Slot) -> None:
        """Take a slot whose bytes are bad (a failed copy) out of ``tier``."""
        with self.cond:
            if tier.lookup(slot.digest) is slot and tier.remove(slot):
                self.cond.notify_all()
            self.forget_if_unheld_locked(slot.digest, slot.version)

    def forget_if_unheld_locked(self, digest: bytes, version: int) -> None:
        """Drop ``digest`` from the catalog if ``version`` is current and no tier (nor a copy in
        flight) holds it any more."""
        if not self.catalog.is_current(digest, version):
            return
        if self.stack.holds(digest, version) or self.catalog.has_pending(digest, version):
            return
        self.catalog.forget(digest)

    def unpin(self, tier: ArenaTier, slot: Slot) -> None:
        with self.lock:
            if tier.unpin(slot):
                self.cond.notify_all()

    # ------------------------------------------------------------------------- copies in flight
    def when_done(self, h: CopyHandle, callback: Callable[[], None]) -> None:
        """Run ``callback`` once ``h`` completes: now if it already has, else in the completer thread."""
        if h.done():
            callback()
        else:
            self.completer.submit(h, callback)

    def end_pending(self, pending: PendingWrite, ok: bool, error: BaseException | None) -> None:
        with self.cond:
            self.catalog.end_pending(pending)
            if not ok:
                self.forget_if_unheld_locked(pending.digest, pending.version)
            self.cond.notify_all()
        pending.handle.finish(ok and error is None, error)

    # ------------------------------------------------------------------------- puts
    def put_host(self, host: ArenaTier, digest: bytes, meta: EntryMeta, src: torch.Tensor,
                 cost_s: float | None) -> PutHandle | None:
        """A put of the CPU tensor ``src`` into the host tier with synchronous copies (no copy
        engine): the short path of :meth:`put_into` (``host.fits(meta.nbytes)`` checked by the
        caller). Versioned here; the key's recompute cost ``cost_s`` (seconds, ``None``: unknown)
        is recorded under the same lock as the blocks are reserved from the free ones; only when
        they do not suffice does :meth:`admit` evict. Then one copy, and :meth:`commit`.

        Returns the finished :class:`~ectier.handles.PutHandle`, or ``None``: no room could be made
        (nothing stored; the caller tries the next tier).
        """
        version, handle = next_version(), PutHandle.stored(meta.key)  # (made before the copy: warm caches)
        catalog = self.catalog
        with self.lock:
            cost = catalog.put_cost(digest, cost_s) if cost_s is not None or digest in catalog.costs else None
            slot = host.reserve(digest, meta, version, cost)
        if self.arena.store(host, digest, meta, version, src, promotion=False, reserved=slot) is None:
            return None
        if self._put_followups:
            self.after_put(host, digest, version, meta.nbytes)
        else:
            self.counters.count_put("host", meta.nbytes)  # after_put, when it has nothing else to do
        return handle

    def put_into(self, tier: Tier, digest: bytes, meta: EntryMeta, version: int, src: torch.Tensor,
                 handle: "PutHandle") -> bool:
        """Store a put's tensor ``src`` (the caller's: any strides, any device) in ``tier``; False
        if it has no room (the caller tries the next tier). ``handle`` is finished now, or when an
        async copy completes. The host tier copies ``src`` itself; other moves take its bytes
        (:func:`~ectier.tensors.byte_view`).

        Raises:
            TierWriteError: the NVMe write failed (nothing changed).
        """
        if tier.is_arena and tier.device is not None:
            return self.arena.put_device(tier, digest, meta, version, byte_view(src), handle)
        if tier.is_arena:
            engine = self.engine_for(src.device) if src.is_cuda else self._cpu_engine
            if engine is not None:
                return self.arena.put_async(tier, digest, meta, version, byte_view(src), engine, handle)
            c = self.arena.store(tier, digest, meta, version, src, promotion=False)
            if c is None:
                return False
            self.after_put(tier, digest, version, meta.nbytes)
            handle.finish(True)
            return True
        src = byte_view(src)
        if self.nvme.store(digest, meta, version, src if src.device.type == "cpu" else src.cpu(), register=True) \
                and self.remote is not None:
            self.remote.write_later(self.nvme.tier, digest, version, meta.nbytes)  # read back from NVMe
        handle.finish(True)
        return True

    # ------------------------------------------------------------------------- flush, close
    def flush(self) -> int:
        """Write every memory entry that no lower tier holds to NVMe (the copies above stay).
        Returns the number written."""
        if self.nvme is None:
            return 0
        written = 0
        for tier in self.stack.arenas():
            with self.cond:
                dirty = [s for s in tier.slots() if s.visible and self.catalog.is_current(s.digest, s.version)
                         and not self.stack.lower_holds(tier, s.digest, s.version)]
                for s in dirty:
                    tier.pin(s)
            for s in dirty:
                try:
                    if self._run(f"flush {tier.name} -> nvme", self.nvme.demote_slot, tier, s):
                        written += 1
                finally:
                    self.unpin(tier, s)
        return written


def _held_by_reservations(tier: ArenaTier, nbytes: int) -> bool:
    """True when ``tier``'s open reservations leave too little of its budget for ``nbytes`` even
    once every reader's pin is released: waiting would only wait for those puts to end."""
    idx = tier.index
    return idx.alloc_bytes(nbytes) > idx.capacity_bytes - idx.reserved_bytes
