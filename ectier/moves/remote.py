"""Moves to and from the remote tier: write-through after a put (in the background, never on the
caller's path) and fetch after a local miss (the entry then lands in the host tier, or NVMe).

Every function here runs on behalf of :class:`~ectier.mover.Mover` (``m``); remote I/O runs
outside the cache lock, bounded by ``remote.timeout_s`` per call.

Ordering (docs/reliability.md, remote tier): the store's calls for one key run one at a time, in
the order of the puts and deletes that asked for them (:class:`_KeyQueue`: the one running, and
the latest asked for since; an older one not yet started is obsolete, a delete always replaces
it). A write whose version is no longer the key's current one when it lands (a newer put, or a
delete, came meanwhile) removes its object again; a put that is not written (too large for the
store, store down, a failed write, evicted before its turn; skipped for the backlog while another
call of the key is queued) removes the key's older object, so no node reads bytes older than this
node's latest put (a put skipped for a full backlog while no call of its key is queued leaves the
older one). A fetch is not kept locally when a delete (of any key) or a put of the key ran since
it began, or a delete of the key has not run its store call yet; the local version counter moves
past every fetched version (a node whose clock runs ahead never wins over a later put made here).
Between nodes there is no order: the store keeps the write that reaches it last, and another
node's fetched copy is not invalidated (docs/operations.md, remote tier: an ``mm_hash`` names
fixed bytes, so vLLM never notices).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from ..entry import EntryMeta, advance_version
from ..errors import TierWriteError
from ..logutil import RateLimitedLogger, failure_kind
from ..tiers.nvme import RAW_CODEC_ID
from ..tiers.nvme_reader import mark_background
from ..tiers.remote.tier import RemoteTier
from .nvme import RETRY

if TYPE_CHECKING:
    from ..mover import Mover
    from ..tiers.arena import ArenaTier
    from ..tiers.base import Tier

__all__ = ["RemoteMoves", "MAX_BACKLOG"]

log = logging.getLogger(__name__)

#: write-throughs queued at most; more are skipped (counted ``skipped_backlog``) rather than let a
#: slow store hold memory without bound
MAX_BACKLOG = 256


class _KeyQueue:
    """The store calls of one key: whether one runs, and the latest one asked for since
    (``("write", src, version)``, ``("delete", version)``: remove the older object if ``version``
    is still current, or ``("delete-now", event)``: a :meth:`RemoteMoves.delete`; ``None``:
    nothing more)."""

    __slots__ = ("next",)

    def __init__(self) -> None:
        self.next: tuple | None = None


def _version(call: tuple) -> int:
    """The version a queued call is about; -1 for a delete() (whatever is asked after it, even
    of a version drawn before it, replaces it: ``_write`` removes what is stale when it lands)."""
    if call[0] == "delete-now":
        return -1
    return call[2] if call[0] == "write" else call[1]


class RemoteMoves:
    """The remote tier's side of every move (``m``: the mover; ``tier``: the remote tier)."""

    def __init__(self, m: "Mover", tier: RemoteTier) -> None:
        self.m = m
        self._warn = RateLimitedLogger(log)  # per-entry failures: one line per kind per 10 s
        self.tier = tier
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()
        self._queued = 0
        self._idle = threading.Condition(self._lock)
        self._keys: dict[bytes, _KeyQueue] = {}  # keys with a store call running; guarded by _lock
        self._deletes: dict[bytes, int] = {}  # keys with a delete() not run yet: fetches not kept
        self._closed = False

    # ------------------------------------------------------------------------- write-through
    def write_later(self, src: "ArenaTier | Tier", digest: bytes, version: int, nbytes: int) -> None:
        """Queue the write of ``version`` of ``digest`` (committed in ``src``: a memory tier, or the
        NVMe tier for a put that went straight there) to the remote tier; when it cannot be
        written (too large for ``remote.max_entry_bytes``; backlog full while a call of the key is
        queued), queue the removal of the key's older object instead. Never waits on the store."""
        if not self.tier.config.write_through:
            return
        if not self.tier.fits(nbytes):
            self.m.counters.count("remote", skipped_too_large=1)
            self._ask(digest, ("delete", version))
            return
        with self._lock:
            full = self._queued >= MAX_BACKLOG
            queued = digest in self._keys
        if full:
            self.m.counters.count("remote", skipped_backlog=1)
            if queued:  # (bounded: a key already queued only changes its next call)
                self._ask(digest, ("delete", version))
            return
        self._ask(digest, ("write", src, version))

    def _ask(self, digest: bytes, call: tuple) -> None:
        """Run ``call`` for ``digest`` after the one running for it, if any, replacing the call
        asked for meanwhile (obsolete) unless that one is of a newer version (a put superseded by
        a newer one still asks for its write: it is ignored); a delete() always replaces it. A
        replaced delete() is told it is done: what replaces it was asked after it."""
        with self._lock:
            if self._closed:
                if call[0] == "delete-now":
                    self._delete_done_locked(digest, call)
                return
            q = self._keys.get(digest)
            if q is None:
                self._keys[digest] = _KeyQueue()
                self._queued += 1
                self._submit_locked(digest, call)
                return
            old = q.next
            if old is not None and call[0] != "delete-now" and _version(call) < _version(old):
                return  # (a delete() always takes the place: what was asked before it is obsolete)
            if old is None:
                self._queued += 1
            elif old[0] == "delete-now":
                self._delete_done_locked(digest, old)
            q.next = call

    def _submit_locked(self, digest: bytes, call: tuple) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(2, thread_name_prefix="ectier-remote", initializer=mark_background)
        self._pool.submit(self._run, digest, call)

    def _run(self, digest: bytes, call: tuple) -> None:
        """One store call of ``digest``, then the next one asked for (module docstring, Ordering)."""
        try:
            if call[0] == "write":
                self._write(call[1], digest, call[2])
            elif call[0] == "delete":
                self._remove_if_current(digest, call[1])
            else:  # "delete-now": a delete() waits for it
                self.tier.delete(digest)
        except Exception as exc:  # noqa: BLE001 - a background move: logged, never raised into anyone
            self._warn.warning(("write-through", *failure_kind(exc)), "remote write-through failed: %s", exc)
        finally:
            self._next(digest, call)

    def _next(self, digest: bytes, call: tuple) -> None:
        """``call`` of ``digest`` ended: start the next one asked for, if any."""
        with self._lock:
            if call[0] == "delete-now":
                self._delete_done_locked(digest, call)
            q = self._keys.get(digest)
            if q is None:  # closed meanwhile: close() dropped the bookkeeping
                return
            self._queued -= 1
            nxt, q.next = q.next, None
            if nxt is None:
                del self._keys[digest]
                self._idle.notify_all()
            elif self._pool is None:  # closed meanwhile: the rest is dropped
                del self._keys[digest]
                self._queued -= 1
                if nxt[0] == "delete-now":
                    self._delete_done_locked(digest, nxt)
                self._idle.notify_all()
            else:
                self._submit_locked(digest, nxt)

    def _delete_done_locked(self, digest: bytes, call: tuple) -> None:
        """A delete() call ran, or was replaced by a later call (or dropped at close)."""
        call[1].set()
        left = self._deletes.get(digest, 0) - 1
        if left > 0:
            self._deletes[digest] = left
        else:
            self._deletes.pop(digest, None)

    def _write(self, src: "ArenaTier | Tier", digest: bytes, version: int) -> None:
        m = self.m
        slot = None
        if src.is_arena:
            with m.cond:
                slot = src.current(digest, version)
                if slot is not None:
                    src.pin(slot)
        if slot is None:  # NVMe holds it (a put straight there, or evicted from memory meanwhile)
            done = self._write_stored(digest, version) if m.nvme is not None else False
        else:
            try:
                data = m.arena.cpu_bytes(src, slot)
                done = data is not None and self.tier.write(
                    slot.meta, data, version, digest, payload_checksum=self._known_checksum(digest, version))
                if done:
                    m.counters.count("remote", puts=1, put_bytes=slot.meta.nbytes)
            finally:
                m.unpin(src, slot)
        with m.cond:
            now = m.catalog.version(digest)
        if done and now == version:
            return
        if not done and now is not None and now > version:
            return  # a newer put: it asks for its own write (maybe already made: leave it)
        # landed after a newer put or a delete, or not written (deleted, evicted everywhere, a
        # failure): this object, or the key's older one, goes
        self.tier.delete(digest)
        if done and now is not None and now > version:
            self._rewrite(digest, now)  # this write may have landed over the newer one's

    def _rewrite(self, digest: bytes, version: int) -> None:
        """Ask again for the write of ``version`` of ``digest`` (current, held here), from the
        tier that holds it."""
        m = self.m
        with m.cond:
            src = next((t for t in m.stack.arenas() if t.current(digest, version) is not None), None)
            if src is None and m.nvme is not None and m.nvme.tier.holds(digest, version):
                src = m.nvme.tier
        if src is not None:
            self._ask(digest, ("write", src, version))

    def _remove_if_current(self, digest: bytes, version: int) -> None:
        """A put of ``version`` was not written to the store: remove the key's older object there,
        unless a newer put (which writes its own) or a delete (which removed it) came since."""
        with self.m.cond:
            current = self.m.catalog.is_current(digest, version)
        if current:
            self.tier.delete(digest)

    def _write_stored(self, digest: bytes, version: int) -> bool:
        """Write through an entry that only NVMe holds: read its record back (checked), unless a
        newer version replaced it meanwhile. True if written; False if not (a failure, or nothing
        to write: replaced, deleted or evicted meanwhile)."""
        m = self.m
        rec = m.nvme.tier.record(digest)
        if rec is None or rec.version != version:
            return False
        got = m.nvme.read(digest, rec.header.namespace, rec.header.key, version)
        if got is None or got is RETRY:
            return False
        meta, data = got
        if self.tier.write(meta, data, version, digest, payload_checksum=self._known_checksum(digest, version)):
            m.counters.count("remote", puts=1, put_bytes=meta.nbytes)
            return True
        return False

    def _known_checksum(self, digest: bytes, version: int) -> int | None:
        """The xxh3-64 of the raw bytes of ``version`` of ``digest`` when the NVMe tier's record of
        that version stores them uncompressed (its header's payload checksum, computed while those
        bytes were written; every read checks it), else ``None`` (the remote put computes it)."""
        nvme = self.m.nvme
        rec = nvme.tier.record(digest) if nvme is not None else None
        if rec is None or rec.version != version:
            return None
        h = rec.header
        if h.codec_id != RAW_CODEC_ID or h.payload_nbytes != h.raw_nbytes:
            return None  # a compressed payload: its checksum is not that of the raw bytes
        return h.payload_checksum

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued write-through ran; False on timeout."""
        with self._lock:
            return self._idle.wait_for(lambda: self._queued == 0, timeout_s)

    def close(self) -> None:
        """Let the queued calls run (bounded), then drop the rest: a later ``drain`` returns."""
        self.drain(timeout_s=2 * self.tier.config.timeout_s + 1)
        with self._lock:
            pool, self._pool, self._closed = self._pool, None, True
            for digest, q in self._keys.items():  # (their calls are cancelled below, or end and stop)
                if q.next is not None and q.next[0] == "delete-now":
                    self._delete_done_locked(digest, q.next)
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        with self._lock:
            self._queued, self._keys = 0, {}
            self._idle.notify_all()

    # ------------------------------------------------------------------------- fetch
    def fetch(self, digest: bytes, ns: str, key: str, target) -> tuple[EntryMeta, torch.Tensor] | None:
        """After a local miss: read the entry from the remote tier, place it locally (the host
        tier if it fits, else NVMe; on into ``target``, the GPU tier, when given) as the key's
        current version unless a newer one appeared, or a delete ran, meanwhile. ``(meta, data)``
        or ``None``."""
        m = self.m
        cat = m.catalog
        with m.cond:
            deletes, before = cat.deletes, cat.version(digest)
        got = self.tier.fetch(digest, ns, key)
        if got is None:
            m.counters.count("remote", misses=1)
            return None
        header, data = got
        advance_version(header.version)  # a later put here wins over this version, whatever the clocks
        meta = EntryMeta(header.namespace, header.key, header.dtype, tuple(header.shape), header.raw_nbytes)
        m.counters.count("remote", hits=1, hit_bytes=meta.nbytes)
        with m.cond:  # a delete ran, or runs, or a put here came, since the fetch began: not placed
            stale = (cat.deletes != deletes or digest in cat.deleting or cat.version(digest) != before
                     or self._delete_pending(digest))
        if not stale:
            self._place(digest, meta, header.version, data, target)
            with m.cond:
                deleted = cat.deletes != deletes or digest in cat.deleting or self._delete_pending(digest)
            if deleted:  # a delete ran while it was placed
                self._unplace(digest, header.version)
        return meta, data

    def _delete_pending(self, digest: bytes) -> bool:
        """A delete() of ``digest`` whose store call has not run yet (it may have timed out)."""
        with self._lock:
            return digest in self._deletes

    def _place(self, digest: bytes, meta: EntryMeta, version: int, data: torch.Tensor, target) -> None:
        m = self.m
        host = m.stack.get("host")
        placed = False
        if host is not None and host.fits(meta.nbytes):
            # no wait for readers' pins: the caller has its bytes already (a full host goes to NVMe)
            c = m.run_move("promotion remote -> host", m.arena.store, host, digest, meta, version, data,
                           promotion=False, wait=False, written_through=False)  # (not written to NVMe)
            placed = c is not None and c.committed
        if not placed and m.nvme is not None and m.nvme.tier.fits(meta.nbytes):
            try:
                placed = m.nvme.store(digest, meta, version, data, register=True)
            except TierWriteError as exc:
                self._warn.warning(("to nvme", *failure_kind(exc)), "promotion remote -> nvme failed: %s", exc)
        if placed and target is not None:
            m.promote.from_data(target, digest, meta, version, data)

    def _unplace(self, digest: bytes, version: int) -> None:
        """Take a fetched entry placed locally out again, unless a newer version is current."""
        m = self.m
        stale = None
        with m.cond:
            if not m.catalog.forget(digest, version):
                return
            m.drop_older_locked(digest, version + 1)
            if m.nvme is not None:
                stale = m.nvme.claim_locked(digest, older_than=version + 1)
        if stale is not None:
            m.nvme.delete_claimed(digest, stale)

    def delete(self, digest: bytes) -> None:
        """Remove the remote copy, in the key's order of store calls (after a write of it that
        runs now, which would otherwise land after): returns once done, or after the running call
        and this one had their deadlines (``2 * remote.timeout_s``). Best effort: a store that is
        down keeps the object until overwritten."""
        call = ("delete-now", threading.Event())
        with self._lock:
            self._deletes[digest] = self._deletes.get(digest, 0) + 1
            inline = not self._closed and digest not in self._keys
            if inline:  # no call of the key runs: this one, on the caller's thread
                self._keys[digest] = _KeyQueue()
                self._queued += 1
        if not inline:
            self._ask(digest, call)
            call[1].wait(2 * self.tier.config.timeout_s + 1)  # (fetches meanwhile stay misses)
            return
        try:
            self.tier.delete(digest)
        finally:
            self._next(digest, call)
