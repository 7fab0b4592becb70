"""Serving reads and read-ahead: find the highest tier holding a key's current version, read from
it, promote on the way; prefetch (promotion in the background).

One lookup for ``get`` and ``acquire`` (:meth:`Reads.locate`), one retry loop (a concurrent
overwrite between lookup and read: look again, :data:`~ectier.mover.RETRIES` times), and the one
promotion sequence of the mover for store-tier hits.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..cpus import background_threads
from ..errors import EctierError
from ..index import Slot
from ..logutil import RateLimitedLogger, failure_kind
from ..tensors import output_for, tensor_from_bytes, torch_dtype
from ..tiers.arena import ArenaTier
from ..tiers.base import Tier
from ..tiers.nvme_reader import mark_background
from .nvme import RETRY

if TYPE_CHECKING:
    from ..handles import LoadHandle
    from ..mover import Mover

__all__ = ["Reads", "Located"]

log = logging.getLogger(__name__)

#: how long a lookup waits for a put straight to NVMe whose record replaced the older one to
#: become the key's current version (seconds; the put's clean-up after its commit, normally µs)
LANDING_WAIT_S = 2.0


@dataclass
class Located:
    """Where a key's current version is: ``tier``, and for a memory tier its ``slot``, pinned."""

    tier: Tier
    version: int
    slot: Slot | None = None


class Reads:
    """``get`` and ``acquire`` on behalf of the facade (``m``: the mover)."""

    def __init__(self, m: "Mover") -> None:
        self.m = m
        self._warn = RateLimitedLogger(log)  # per-key failures: one line per kind per 10 s
        self._prefetch_pool: ThreadPoolExecutor | None = None
        # prefetches of keys stored nowhere here (a remote fetch: network-bound, maybe hung until
        # remote.timeout_s): threads of their own, so they never hold a background slot or the
        # pool's threads that NVMe promotions need
        self._fetch_pool: ThreadPoolExecutor | None = None
        self._closing = False  # quiesce(closing=True) ran: no new pool
        #: the ``prefetch_threads`` slots every background read of this cache holds one of
        self.background_n = background_threads(m.config.prefetch_threads)
        self.background = threading.BoundedSemaphore(self.background_n)
        self._tiers, self._gpu = tuple(m.stack), m.stack.device_tier()  # fixed once open (every get)

    def locate(self, digest: bytes, *, start: Tier | None = None, wait: bool = True):
        """The highest tier (from ``start`` down) holding ``digest``'s current version, its slot
        pinned and touched; ``None`` on a miss; ``RETRY`` if a write of the key is in flight.

        A put that went straight to NVMe (too large for the memory tiers, or no host tier) replaces
        the older record before it becomes the key's current version: in that instant no tier
        holds the current version, and this waits (at most :data:`LANDING_WAIT_S`) for the put to
        finish instead of answering a miss for a key that is stored all along. ``wait=False``
        (callers that take only what a memory tier holds, and never wait: the entry lands on NVMe
        anyway): ``None`` then."""
        m = self.m
        deadline = None
        with m.lock:
            while True:
                v = m.catalog.versions.get(digest)
                if v is None:
                    return None
                for t in (m.stack.from_(start) if start is not None else self._tiers):
                    if t.is_arena:
                        s = t.current(digest, v)
                        if s is not None:
                            t.pin(s)
                            t.touch(s)
                            return Located(t, v, s)
                    elif t.holds(digest, v):
                        m.nvme.index.touch(digest)
                        return Located(t, v)
                if m.catalog.has_pending(digest):
                    return RETRY  # a demotion to host started meanwhile
                stored = m.nvme.tier.stored_version(digest) if wait and m.nvme is not None else None
                if stored is None or stored <= v:
                    return None
                deadline = deadline or time.monotonic() + LANDING_WAIT_S  # (the put's own clean-up is next)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                m.cond.wait(remaining)  # NvmeMoves._finish_store notifies once the version is current

    def get(self, digest: bytes, ns: str, key: str, dev: torch.device, out: torch.Tensor | None):
        """A copy of the entry on ``dev`` (or in ``out``), or ``None`` on a miss."""
        m = self.m
        gpu = self._gpu
        target = gpu if gpu is not None and dev == gpu.device else None
        inflight = m.catalog.inflight
        for _ in range(m.RETRIES):
            if digest in inflight:  # (wait_inflight's own first check, without the call)
                m.catalog.wait_inflight(digest)
            loc = self.locate(digest)
            if loc is RETRY:
                continue
            if loc is None:
                break
            result = self._serve(loc, digest, ns, key, dev, out, target)
            if result is RETRY:
                continue
            if result is None and loc.tier is not gpu:
                break
            if result is not None:
                return result
        if m.remote is not None and loc is None:
            got = m.remote.fetch(digest, ns, key, target if out is None else None)
            if got is not None:
                m.counters.count("cache", hits=1)
                result = tensor_from_bytes(got[0], got[1], out)
                return result if dev.type == "cpu" else result.to(dev)
        m.counters.count("cache", misses=1)
        return None

    def _serve(self, loc: Located, digest: bytes, ns: str, key: str, dev: torch.device,
               out: torch.Tensor | None, target: Tier | None):
        m = self.m
        tier = loc.tier
        if tier.is_arena and tier.device is not None:
            return m.arena.serve_device_hit(tier, loc.slot, dev, out)  # None: its copy failed
        if tier.is_arena:
            result = m.arena.serve_host_hit(tier, loc.slot, dev, out, target)
            m.counters.count_hit(tier.name, loc.slot.meta.nbytes)
            return result
        if out is not None:
            rec = tier.record(digest)
            if rec is not None and rec.version == loc.version:
                output_for(rec.meta, out)  # an unsuitable out= raises before any read or promotion
        upto = target if (target is not None and out is None) else m.stack.get("host")
        got = m.promote.from_store(digest, ns, key, loc.version, upto, out)
        if got is None or got is RETRY:
            return got
        meta, data, _ = got
        m.counters.count("cache", hits=1)
        if (out is not None and out.shape == meta.shape and out.is_cpu and out.numel()
                and data.data_ptr() == out.data_ptr() and out.dtype is torch_dtype(meta.dtype)):
            return out  # read straight into the caller's out= (NvmeMoves._into): nothing to check or copy
        result = tensor_from_bytes(meta, data, out)
        return result if dev.type == "cpu" else result.to(dev)

    def acquire(self, host: ArenaTier, digest: bytes, ns: str, key: str, promote: bool = True,
                count: bool = True):
        """Pin the entry in ``host`` for another party (an NVMe hit is promoted there first,
        unless ``promote`` is False: then only an entry already in ``host`` is pinned, no I/O,
        nothing counted otherwise): the pinned slot, or ``None``. ``count`` False: no hit or
        miss is counted (a tier's read, e.g. NVMe's, still is)."""
        m = self.m
        for _ in range(m.RETRIES):
            loc = self.locate(digest, start=host, wait=promote)  # (promote=False never waits)
            if loc is RETRY:
                continue
            if loc is None:
                break
            if loc.tier is host:
                if count:
                    m.counters.count("host", hits=1, hit_bytes=loc.slot.meta.nbytes)
                    m.counters.count("cache", hits=1)
                return loc.slot
            if not promote:
                return None
            rec = m.nvme.tier.record(digest)
            if rec is None or not host.fits(rec.header.raw_nbytes):
                break  # an entry larger than the host arena cannot be leased through it
            # decoded straight into the host slot it is promoted into, committed pinned for the lease
            slot = m.promote.into_host(host, digest, ns, key, loc.version)
            if slot is RETRY:
                continue
            if slot is None:
                break
            m.counters.count("cache", hits=int(count))
            return slot
        else:
            loc = None
        if not promote:
            return None
        if loc is None and m.remote is not None and m.remote.fetch(digest, ns, key, None) is not None:
            loc = self.locate(digest, start=host)
            if loc is not None and loc.tier is host:
                m.counters.count("cache", hits=int(count))
                return loc.slot
            if loc is not None and loc.slot is not None:
                m.unpin(loc.tier, loc.slot)
        m.counters.count("cache", misses=int(count))
        return None

    def acquire_resident(self, host: ArenaTier, digests: list[bytes], ns: str, keys: list[str]) -> list:
        """:meth:`acquire` with ``promote=False`` of each of ``digests`` (the entries of ``keys``
        in ``ns``): the entries in ``host`` are pinned under one hold of the mover's lock and
        counted once; any other key (elsewhere, absent, a write in flight) is asked on its own.
        A pinned slot or ``None`` per digest, in order."""
        m = self.m
        slots: list = []
        nbytes = 0
        with m.lock:
            versions = m.catalog.versions
            for digest in digests:
                v = versions.get(digest)
                s = host.current(digest, v) if v is not None else None
                if s is not None:
                    host.pin(s)
                    host.touch(s)
                    nbytes += s.meta.nbytes
                slots.append(s)
        found = len(slots) - slots.count(None)
        if found:
            m.counters.count("host", hits=found, hit_bytes=nbytes)
            m.counters.count("cache", hits=found)
        if found < len(slots):
            slots = [s if s is not None else self.acquire(host, d, ns, k, False)
                     for s, d, k in zip(slots, digests, keys)]
        return slots

    def promote(self, digest: bytes, ns: str, key: str, target: Tier | None) -> bool:
        """Move ``digest`` up to ``target`` (the GPU tier, or the host tier) — a prefetch.

        True if the key is present afterwards (promoted as far as room allowed)."""
        m = self.m
        gpu = m.stack.device_tier()
        want_gpu = target is not None and target is gpu
        host = m.stack.get("host")
        for _ in range(m.RETRIES):
            hslot, host_fits = None, False
            with m.cond:
                v = m.catalog.version(digest)
                if v is not None:  # else stored nowhere here: maybe remote (I/O, outside the lock)
                    if gpu is not None and gpu.holds(digest, v) and (
                            want_gpu or not m.stack.lower_holds(gpu, digest, v)):
                        return True
                    s = host.current(digest, v) if host is not None else None
                    if s is not None:
                        host.touch(s)
                        if not want_gpu:
                            return True
                        hslot = s
                        host.pin(s)
                    else:
                        if m.nvme is None or not m.nvme.tier.holds(digest, v):
                            return digest in m.catalog
                        m.nvme.index.touch(digest)
                        host_fits = host is not None and host.fits(m.nvme.tier.record(digest).header.raw_nbytes)
                        if not want_gpu and not host_fits:
                            return True  # it stays where it is: NVMe is the highest tier it fits
            if v is None:
                return m.remote is not None and m.remote.fetch(digest, ns, key, target if want_gpu else None) is not None
            via_host = True
            if hslot is None and host_fits and target is not None:
                # decoded straight into a host slot (no intermediate tensor), then up from it
                hslot = m.promote.into_host(host, digest, ns, key, v)
                if hslot is RETRY:
                    continue
                if hslot is None and not want_gpu:  # no clean room, or the read failed (logged)
                    with m.cond:
                        return digest in m.catalog  # present if still stored
                via_host = hslot is not None  # (None towards the GPU tier: straight there, below)
            if hslot is not None:
                try:
                    if want_gpu:
                        m.promote.from_slot(host, hslot, gpu)
                finally:
                    m.unpin(host, hslot)
                return True
            result = m.promote.from_store(digest, ns, key, v, target, via_host=via_host)
            if result is RETRY:
                continue
            return result is not None
        with m.cond:
            return digest in m.catalog

    def settled(self, digest: bytes, v: int | None, target: Tier | None) -> bool:
        """Under ``m.cond``: nothing for a prefetch of ``digest`` (version ``v``) towards ``target``
        to do: stored nowhere and no remote tier, already in ``target`` (touched: a prefetch is a
        use), or on NVMe and larger than the host arena when ``target`` is the host tier (NVMe is
        the highest tier it fits; touched there)."""
        m = self.m
        if m.catalog.has_pending(digest):
            return False
        if v is None:
            return m.remote is None
        if target is None:
            return False
        slot = target.current(digest, v)  # (target: the host or the GPU tier)
        if slot is not None:
            target.touch(slot)  # asked for: recently used, as promote() counts it
            return True
        if target is not m.stack.get("host") or m.nvme is None or not m.nvme.tier.holds(digest, v):
            return False
        rec = m.nvme.tier.record(digest)
        if rec is None or target.fits(rec.header.raw_nbytes):
            return False
        m.nvme.index.touch(digest)  # asked for: recently used, as promote() counts it
        return True

    def prefetch_later(self, handle: "LoadHandle", digest: bytes, ns: str, key: str, target: Tier | None) -> None:
        """Run :meth:`promote` in the background and finish ``handle`` with its result (an
        unexpected error: False, in ``handle.error``). A key stored here is promoted in the
        prefetch pool (``prefetch_threads`` threads, :func:`ectier.cpus.background_threads`),
        holding one of the cache's background slots; a key stored nowhere here (a remote
        fetch) in a pool of as many threads of its own, without a slot, so that a slow or hung
        remote store never holds up promotions from NVMe. Pools start at their first call."""
        m = self.m
        with m.cond:
            remote = m.remote is not None and m.catalog.version(digest) is None
        self._submit(remote, handle, digest, ns, key, target)

    def _submit(self, remote: bool, handle: "LoadHandle", digest: bytes, ns: str, key: str, target: Tier | None) -> None:
        with self.m.cond:
            if self._closing:  # (a prefetch that came while the cache closes: no new pool)
                handle.finish(False, EctierError("cache is closed"))
                return
            name = "_fetch_pool" if remote else "_prefetch_pool"
            pool = getattr(self, name)
            if pool is None:
                pool = ThreadPoolExecutor(self.background_n, thread_name_prefix="ectier-fetch" if remote else
                                          "ectier-prefetch", initializer=mark_background)
                setattr(self, name, pool)
            # (submitted under the lock: a quiesce that took the pool runs it before it returns)
            pool.submit(self._prefetch_one, remote, handle, digest, ns, key, target)

    def _prefetch_one(self, fetching: bool, handle: "LoadHandle", digest: bytes, ns: str, key: str,
                      target: Tier | None) -> None:
        try:
            with self.m.cond:
                closing = self._closing
            if closing:  # queued when close() began: not run (each could take remote.timeout_s)
                handle.finish(False, EctierError("cache is closed"))
                return
            self.m.catalog.wait_inflight(digest)
            with self.m.cond:
                local = self.m.catalog.version(digest) is not None  # (stored here since it was asked)
            if not local and not fetching and self.m.remote is not None:
                # evicted or deleted here since it was asked: a remote fetch, in the fetch pool
                self._submit(True, handle, digest, ns, key, target)
                return
            with self.background if local else contextlib.nullcontext():
                done = self.promote(digest, ns, key, target)
            handle.finish(done)
        except Exception as exc:  # noqa: BLE001 - reported through the handle, and logged
            self._warn.warning(("prefetch", *failure_kind(exc)), "prefetch of a key failed: %s", exc)
            handle.finish(False, exc)

    def quiesce(self, timeout_s: float | None = None, *, closing: bool = False) -> bool:
        """Wait for prefetches and copy completions in flight (the pool restarts on the next
        prefetch; with ``closing`` it does not: later prefetches, and those queued but not
        started, finish at once, not found, with ``EctierError``). False if the completions did
        not all run within ``timeout_s``."""
        if closing:
            with self.m.cond:
                self._closing = True
        while True:  # a promotion handed from one pool to the other starts that pool again
            with self.m.cond:
                pools = [p for p in (self._prefetch_pool, self._fetch_pool) if p is not None]
                self._prefetch_pool = self._fetch_pool = None
            if not pools:
                break
            for pool in pools:
                pool.shutdown(wait=True)
        return self.m.completer.drain(timeout_s)
