"""The host arena's API for another party: the two-phase put and the pinned read (the daemon's).

A daemon client writes an entry straight into the shared host arena (:meth:`~HostArenaAPI.reserve`
→ write the extents → :meth:`~HostArenaAPI.commit`) and reads one in place (:meth:`~HostArenaAPI.acquire`
→ map the extents or :meth:`~HostArenaAPI.load` → :meth:`~HostArenaAPI.release`). These methods are
:class:`~ectier.cache.TieredCache`'s (its base class); they work on the host tier only, because
shared memory is the host arena by definition. See ``docs/architecture.md``.
"""

from __future__ import annotations

import contextlib

import torch

from .entry import entry_digest, next_version, validate_key
from .errors import EntryTooLargeError, InvalidArgumentError, TierWriteError
from .handles import ReadLease, WriteLease, check_lease, end_lease
from .tensors import meta_from_spec, parse_device

__all__ = ["HostArenaAPI"]


class HostArenaAPI:
    """Base class of :class:`~ectier.cache.TieredCache`: reserve/commit/abort, acquire/release/load.

    It uses the cache's host tier, mover and read path (set up by ``TieredCache``); on its own it
    is nothing.
    """
    # ------------------------------------------------------------ two-phase API (the daemon's)

    def reserve(self, key: str, *, dtype: str, shape: tuple[int, ...] | list[int],
                namespace: str | None = None) -> WriteLease:
        """Phase 1 of a put by another party (a daemon client writing through shared memory):
        reserve host-arena bytes for an entry of ``dtype`` and ``shape``, evicting as needed. The
        entry stays invisible until :meth:`commit`; :meth:`abort` returns the bytes.

        Returns a :class:`WriteLease` whose ``extents`` are ``(arena byte offset, length)`` runs
        that together hold the entry's bytes in C order.

        Raises:
            InvalidKeyError, InvalidTensorError: bad key/namespace, unknown dtype, bad shape.
            EntryTooLargeError: larger than ``host.capacity_bytes`` (or there is no host tier).
            TierWriteError: no room could be made within ``host.admit_wait_s``. EctierError: closed.
        """
        ns, key = self._identity(key, namespace)
        meta = meta_from_spec(ns, key, dtype, shape)
        self._check_open()
        host = self._host
        if host is None or not host.fits(meta.nbytes):
            raise EntryTooLargeError(
                f"entry of {meta.nbytes} bytes does not fit the host arena (host.capacity_bytes="
                f"{host.capacity_bytes if host is not None else 0}), through which shared-memory puts go")
        slot = self._mover.admit(host, entry_digest(ns, key), meta, next_version(), promotion=False)
        if slot is None:
            raise TierWriteError(
                "host tier: no room could be made (entries pinned by readers for longer than host.admit_wait_s)")
        return WriteLease(meta, tuple(host.byte_extents(slot)), slot, self)

    def commit(self, lease: WriteLease) -> None:
        """Phase 2: make a reserved entry visible, replacing any older entry of its key atomically
        (written through to NVMe first when ``nvme.write_through``).

        Raises:
            InvalidArgumentError: the lease was already committed or aborted. InvalidLeaseError (a
                TypeError): not a :class:`WriteLease` of this cache. EctierError: closed (the entry is not stored).
        """
        self._check_open()
        end_lease(lease, WriteLease, "commit", self)
        result = self._mover.commit(self._host, lease.slot, promotion=False,
                                    keep_older_record=self._mover.write_through)
        if result.stands:
            self._mover.after_put(self._host, lease.slot.digest, lease.slot.version, lease.meta.nbytes)

    def abort(self, lease: WriteLease) -> None:
        """Give up a reservation: its bytes return to the arena, nothing becomes visible.

        After :meth:`close`, or in a process forked after the cache was opened, it only ends the
        lease (the arena is gone, or the parent's).

        Raises:
            InvalidArgumentError: the lease was already committed or aborted. InvalidLeaseError (a
                TypeError): not a :class:`WriteLease` of this cache.
        """
        end_lease(lease, WriteLease, "abort", self)
        if not self._fork.forked:  # (in a forked child: the parent's arena and locks, never touched)
            self._mover.abort(self._host, lease.slot)

    def background_read(self) -> "contextlib.AbstractContextManager[None]":
        """Hold one of the ``prefetch_threads`` slots that this cache's background reads share,
        around a read done in the background outside :meth:`prefetch` (the daemon's direct reads
        of entries larger than the arena): with the prefetch pool's promotions, at most
        ``prefetch_threads`` run at once. Blocks until a slot is free."""
        return self._reads.background

    def acquire(self, key: str, *, namespace: str | None = None, promote: bool = True,
                count: bool = True) -> ReadLease | None:
        """Pin an entry in the host arena for another party to copy out; ``None`` on a miss.

        An NVMe hit is promoted into the host arena first; if it cannot be placed there (larger
        than the host budget, or no clean room), the result is ``None``. ``promote=False``: only
        an entry already in the host arena is pinned (no I/O; anything else is ``None``, not
        counted as a miss). The entry is neither evicted nor freed until :meth:`release`.
        ``count=False``: a read ahead of a get that may never come (the daemon's ``prefetch``):
        no hit or miss is counted now (a tier's own read still is, e.g. NVMe's); count the get
        once it takes the lease, with :meth:`count_served`.

        Raises:
            InvalidKeyError: bad ``key``/``namespace``. EctierError: the cache is closed.
        """
        ns, key = self._identity(key, namespace)
        self._check_open()
        if self._host is None:
            return None
        slot = self._reads.acquire(self._host, entry_digest(ns, key), ns, key, promote, count)
        return ReadLease(slot.meta, tuple(self._host.byte_extents(slot)), slot, self) if slot is not None else None

    def count_served(self, lease: ReadLease) -> None:
        """Count one get served by ``lease`` (taken with ``acquire(count=False)``): a hit of the
        cache and of the host tier, ``lease.meta.nbytes`` bytes. Raises nothing."""
        self._counters.count("host", hits=1, hit_bytes=lease.meta.nbytes)
        self._counters.count("cache", hits=1)

    def acquire_many(self, keys: list[str], *, namespace: str | None = None) -> list[ReadLease | None]:
        """:meth:`acquire` with ``promote=False`` of each of ``keys`` (those in the host arena pinned
        under one hold of its lock): in order, a lease per key in the arena now, else ``None``.
        Raises InvalidKeyError (a bad key or ``namespace``; nothing pinned), EctierError (closed)."""
        ns, keys = self._identity("-", namespace)[0], [validate_key(k) for k in keys]
        self._check_open()
        h = self._host
        slots = self._reads.acquire_resident(h, [entry_digest(ns, k) for k in keys], ns, keys) if h else ()
        return [ReadLease(s.meta, tuple(h.byte_extents(s)), s, self) if s is not None else None
                for s in slots] or [None] * len(keys)

    def release(self, lease: ReadLease) -> None:
        """End an :meth:`acquire`: the entry may be evicted again. A second release of the same
        lease is a no-op (it never touches another reader's pin), and so is one after :meth:`close`
        (the pin went with the arena), or one in a process forked after the cache was opened (the
        parent's pin and locks are not the child's to touch). Anything but a :class:`ReadLease` of
        this cache: InvalidLeaseError."""
        if check_lease(lease, ReadLease, self).end() and not self._fork.forked:
            self._mover.unpin(self._host, lease.slot)

    def load(self, lease: ReadLease, *, device: str | torch.device | None = None,
             view: bool = False) -> torch.Tensor:
        """The leased entry on ``device``: a copy through the copy engine (H2D lane for CUDA:
        ready on the caller's current stream, no host sync), or, with ``view=True`` on the CPU,
        a zero-copy view of the host arena, **to be read only**: in-process it is the arena's own
        memory, not write-protected (a daemon client's views are read-only mappings). The lease
        stays held either way.

        A view holds a pin of its own for as long as its storage lives (any slice or reshape of it
        included), however long that is after the lease is released: the entry's bytes are neither
        evicted nor reused meanwhile, and count against ``host.capacity_bytes`` until the last view
        is gone; an overwrite or delete of the key goes to other bytes. Writing into a view changes
        the stored entry for every later hit (the host tier keeps no checksum to notice): don't.
        After :meth:`close` live views stay valid (the arena's memory is freed with the last one).
        An entry whose bytes are not one run of the arena is copied.

        Raises:
            InvalidArgumentError: ``lease`` was released. InvalidLeaseError: not a :class:`ReadLease` of this cache.
            InvalidDeviceError: bad ``device``. EctierError: the cache is closed.
        """
        dev = parse_device(device)
        self._check_open()
        if check_lease(lease, ReadLease, self).ended:
            raise InvalidArgumentError("lease: already released; load a lease between acquire and release")
        if view and dev.type == "cpu":
            result = self._mover.arena.view_out(self._host, lease.slot)
            if result is not None:
                return result
        return self._mover.arena.copy_out(self._host, lease.slot, dev)

    @property
    def host_arena_bytes(self) -> int:
        """Size of the host arena in bytes (0 without a host tier)."""
        return self._host.capacity_bytes if self._host is not None else 0

    @property
    def host_arena(self) -> torch.Tensor | None:
        """The host arena as a flat ``uint8`` tensor (``None`` without a host tier); the daemon
        maps it by file; in-process callers read a lease through :meth:`load`.

        Raises:
            EctierError: the cache is closed (its arena is freed).
        """
        self._check_open()
        return self._host.buffer if self._host is not None else None
