"""TieredCache: the encoder cache's public face — validate, build the tier stack, delegate.

::

    put(key, tensor) ──> first tier that takes it (GPU for tensors on gpu.device, else host, else NVMe)
                          └─ victims demote down the stack (mover) ──> ... ──> dropped
    get(key)         <── highest tier holding the current version <── promoted up on the way

The facade holds no per-tier logic: the order of tiers is :class:`~ectier.stack.TierStack`, every
move is :class:`~ectier.mover.Mover`'s, versions and writes in flight are
:class:`~ectier.catalog.Catalog`'s. The host arena's API for another party (two-phase put, pinned
read) is the base class :class:`~ectier.cache_arena.HostArenaAPI`. See ``docs/architecture.md``.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Mapping

import torch

from .cache_arena import HostArenaAPI
from .catalog import Catalog
from .config import CacheConfig
from .config_sources import as_config
from .copy import CopyEngine, Engines
from .entry import entry_digest, next_version, validate_cost, validate_key, validate_keys, validate_namespace
from .errors import (CacheClosedError, EctierError, EntryTooLargeError, InvalidDeviceError,
                     InvalidTensorError, TierWriteError)
from .forks import ForkMark
from .handles import LoadHandle, PutHandle, ReadLease, WriteLease
from .moves.serve import Reads
from .mover import Mover
from .stack import TierStack
from .stats import Counters, cache_stats
from .tensors import check_out_kind, meta_for, parse_device

__all__ = ["TieredCache", "WriteLease", "ReadLease", "PutHandle", "LoadHandle"]

log = logging.getLogger(__name__)

_CPU = torch.device("cpu")


class TieredCache(HostArenaAPI):
    """An in-process encoder cache keyed by ``mm_hash`` over a GPU, a host and an NVMe tier.

    Args:
        config: :class:`~ectier.config.CacheConfig` (default: 1 GiB host arena, no NVMe tier), or a
            mapping (:meth:`CacheConfig.from_dict`) or a ``.json``/``.yaml`` path (:meth:`CacheConfig.load`).
        host_shm_path: put the host arena in this new file (e.g. under ``/dev/shm``) mapped shared,
            so that other processes can map it (the daemon does this); default: private memory.

    With ``gpu.capacity_bytes > 0`` the cache holds a device arena on ``gpu.device`` and moves
    bytes on dedicated CUDA streams (:mod:`ectier.copy`); ``put`` of a CUDA tensor returns a
    :class:`PutHandle` after enqueueing, ``get(device=)`` returns a tensor ready on the caller's
    current stream, ``prefetch`` returns :class:`LoadHandle` s.

    Thread-safe: any number of threads may call any method at once. Not fork-safe: a cache used
    in a process forked after it was opened raises :class:`~ectier.errors.ProcessForkedError`
    (open a new cache in the child; LMDB's and CUDA's rule).

    Raises:
        ConfigError: an invalid config, a host or device arena that cannot be allocated, a GPU
            tier on a machine without CUDA or on a device index it lacks (names ``gpu.*``).
        StoreOpenError, StoreLockedError: the NVMe directory cannot be opened / is in use (by another
            process or another TieredCache of this process).
    """

    def __init__(self, config: CacheConfig | Mapping[str, Any] | str | os.PathLike | None = None, *,
                 host_shm_path: str | None = None) -> None:
        self._open(config, host_shm_path, Engines())

    def _open(self, config: Any, host_shm_path: str | None, runtime: Engines, remote_backend: Any = None) -> None:
        self.config = as_config(config)
        self._runtime = runtime
        self._closed = False
        self._fork = ForkMark()
        self._catalog = Catalog()
        self._cond = self._catalog.cond
        self._counters = Counters()
        self._stack = TierStack.open(self.config, host_shm_path, runtime, remote_backend)
        self._mover = Mover(self.config, self._stack, self._catalog, self._counters, self._engine_for)
        self._reads = Reads(self._mover)
        self._host = self._stack.get("host")
        self._gpu = self._stack.device_tier()
        self._cpu_entry = self._stack.entry_tier(torch.device("cpu"))  # where a CPU tensor's put starts
        # a CPU tensor's put with synchronous copies into the host tier takes Mover.put_host
        sync = self._host is not None and self._cpu_entry is self._host and self._mover.sync_cpu_copies and (
            self._gpu is None or self._gpu.device.type == "cuda")
        self._sync_host = self._host if sync else None
        self._sync_host_bytes = self._host.capacity_bytes if sync else -1  # host.fits(n) is n <= this
        self._namespace = self.config.namespace
        if self._mover.nvme is not None:
            self._mover.nvme.adopt_records()

    def _engine_for(self, dev: torch.device) -> CopyEngine | None:
        return self._runtime.engine_for(dev, self.config.gpu.copy_streams)

    # ================================================================================ public API

    def put(self, key: str, tensor: torch.Tensor, *, namespace: str | None = None,
            cost_s: float | None = None) -> PutHandle:
        """Store ``tensor`` under ``key`` (an ``mm_hash``), replacing any previous entry atomically.

        Any dtype and shape torch has (zero-size and non-contiguous tensors too, stored in C order).
        A tensor on ``gpu.device`` goes to the GPU tier (copy enqueued on the arena stream); another
        CUDA tensor (no GPU tier) to the pinned host arena by an async D2H; a CPU tensor to the host
        arena synchronously; an entry larger than a tier's budget skips that tier. A CUDA put returns
        after enqueueing: the source stays referenced (``record_stream``) until copied; the caller
        must not *write into* it before ``handle.done()``. A :meth:`get` of a key in flight waits.

        Args:
            key: non-empty ``str`` (up to 64 KiB of UTF-8).
            tensor: the encoder output, e.g. ``(N, 8192)`` bfloat16 for Qwen3-VL.
            namespace: override of ``config.namespace`` for this entry.
            cost_s: seconds recomputing this entry would cost, for ``policy="gdsf"``; ``None``: unknown.

        Returns:
            a :class:`PutHandle` (done at once for synchronous puts).

        Raises:
            InvalidArgumentError: ``cost_s`` negative or not finite. InvalidKeyError, InvalidTensorError: bad
                key/namespace/tensor (a CPU tensor to a GPU-only cache). InvalidDeviceError: a CUDA
                tensor on another device than ``gpu.device``. EntryTooLargeError: larger than every
                tier's whole budget. TierWriteError: no tier could store it. EctierError: closed.
            In every error case nothing already stored is changed.
        """
        ns = self._namespace if namespace is None else validate_namespace(namespace)
        key = validate_key(key)
        meta = meta_for(ns, key, tensor)
        if self._closed or self._fork.forked:
            self._check_open()  # raises
        validate_cost(cost_s)
        digest = entry_digest(ns, key)
        nbytes = meta.nbytes
        host = self._sync_host
        if nbytes <= self._sync_host_bytes and not tensor.is_cuda:  # the host put's short path
            handle = self._mover.put_host(host, digest, meta, tensor, cost_s)
            if handle is not None:
                return handle
            start = host  # no room in the host tier: on to the tiers under it
        else:
            start = self._cpu_entry if self._gpu is None and not tensor.is_cuda else self._entry_tier(tensor.device)
            if start is None:
                start = self._entry_tier(tensor.device)  # raises: a CPU tensor to a GPU-only cache
            host = None
        tiers = self._stack.from_(start)
        fit = [t.fits(nbytes) for t in tiers]
        if True not in fit:
            raise EntryTooLargeError.for_put(nbytes, [(t.name, t.capacity_bytes) for t in tiers])
        self._catalog.update_cost(digest, cost_s)
        version, handle = next_version(), PutHandle(key)
        for t, fits in zip(tiers, fit):
            if t is host:
                continue  # tried by the short path
            if not fits:
                self._counters.count(t.name, skipped_too_large=1)
            elif self._mover.put_into(t, digest, meta, version, tensor, handle):
                return handle
        raise TierWriteError(
            f"{tiers[-1].name} tier: no room could be made (entries pinned by readers for longer than "
            f"host.admit_wait_s) and no lower tier takes it; raise {tiers[-1].name}.capacity_bytes")

    def _entry_tier(self, dev: torch.device):
        gpu = self._gpu
        if gpu is not None and dev.type == "cuda" and dev != gpu.device:
            raise InvalidDeviceError(
                f"tensor: is on {dev}, but the GPU tier is on gpu.device={self.config.gpu.device}; "
                "put tensors of the worker's own device (one cache per device)")
        start = self._stack.entry_tier(dev)
        if start is None:
            raise InvalidTensorError(
                f"tensor: is a CPU tensor, but this cache has only a GPU tier (gpu.device={self.config.gpu.device}, "
                "host.capacity_bytes=0, no nvme.path); put device tensors, or configure a host tier")
        return start

    def get(self, key: str, *, device: str | torch.device | None = None, namespace: str | None = None,
            out: torch.Tensor | None = None) -> torch.Tensor | None:
        """Return a copy of the entry stored under ``key``, or ``None`` on a miss.

        Byte-identical, with the shape and dtype it was put with. An NVMe hit is promoted to the
        host tier; a hit asked for ``gpu.device`` into the GPU tier. A record failing its checksum
        is quarantined and read as a miss; a put in flight is waited for; a failed copy is a miss.
        With ``device="cuda:<i>"`` the result is **ready on the caller's current stream** (the copy
        stream's event is waited on by it; no host sync for host and GPU hits).

        Args:
            key: the ``mm_hash``. device: ``None``/``"cpu"`` or an explicit ``"cuda:<index>"``.
            namespace: override of ``config.namespace``.
            out: a contiguous CPU tensor of the entry's shape and dtype to copy into; on a hit ``out``
                itself is returned. Another shape (even with as many bytes) or dtype raises, before
                any read: ``out`` is left untouched and nothing stored changes (a key held only by
                the remote tier is known only once fetched: the fetched entry is then placed here,
                as a hit's is, before the error). A key stored nowhere leaves ``out`` untouched;
                after any other miss its contents are **undefined**: an NVMe payload is read
                straight into ``out`` while its checksum is computed (one pass, no second buffer),
                so a record that then fails the check has already overwritten it.

        Raises:
            InvalidKeyError; InvalidDeviceError (bare ``"cuda"``, an index this machine lacks);
            InvalidTensorError (``out`` unsuitable: not a contiguous CPU tensor, a conjugate or
            negative view, or another shape or dtype than the entry's; names ``out`` and both); torch.cuda.OutOfMemoryError (no device memory
            for the result; a failed *promotion* is no error); EctierError: the cache is closed.
        """
        ns = self._namespace if namespace is None else validate_namespace(namespace)
        key = validate_key(key)
        dev = _CPU if device is None else parse_device(device)
        if out is not None:  # (before any read: nothing changes)
            check_out_kind(out)
        if self._closed or self._fork.forked:
            self._check_open()  # raises
        return self._reads.get(entry_digest(ns, key), ns, key, dev, out)

    def prefetch(self, keys: "list[str] | tuple[str, ...]", *, device: str | torch.device | None = None,
                 namespace: str | None = None) -> list[LoadHandle]:
        """Start promoting ``keys`` towards ``device`` in the background; one :class:`LoadHandle` each.

        NVMe hits go up to the host tier; with ``device`` equal to ``gpu.device`` on into the GPU
        tier. Keys already there (or, unless ``device`` is ``gpu.device``, on NVMe and larger than
        the host arena), and keys stored nowhere, give handles done at once. Promotions run in a
        pool of ``prefetch_threads`` threads (default: 1 on 4 CPUs or fewer, else 2) started at the
        first call, each reading on its own thread (no ``nvme.read_threads`` helper); fetches of
        keys stored only remotely in a pool of as many threads of their own.

        Raises:
            InvalidKeyError, InvalidDeviceError: bad key/namespace/device (nothing started).
            EctierError: the cache is closed.
        """
        keys = validate_keys(keys)
        dev = parse_device(device)
        idents = [self._identity(k, namespace) for k in keys]
        self._check_open()
        target = self._gpu if self._gpu is not None and dev == self._gpu.device else self._host
        handles = []
        for ns, key in idents:
            digest, handle = entry_digest(ns, key), LoadHandle(key)
            with self._cond:
                v = self._catalog.version(digest)
                done = self._reads.settled(digest, v, target)
            if done:
                handle.finish(v is not None)
            else:
                self._reads.prefetch_later(handle, digest, ns, key, target)
            handles.append(handle)
        return handles

    def contains(self, key: str, *, namespace: str | None = None) -> bool:
        """True if ``key`` is stored in some tier, or its put is in flight (from memory, no I/O).

        Raises:
            InvalidKeyError: bad ``key``/``namespace``. EctierError: the cache is closed.
        """
        ns, key = self._identity(key, namespace)
        self._check_open()
        digest = entry_digest(ns, key)
        with self._cond:
            return digest in self._catalog or self._catalog.has_pending(digest)

    __contains__ = contains

    def delete(self, key: str, *, namespace: str | None = None) -> bool:
        """Remove ``key`` from every tier. Returns True if it was stored (or in flight).

        Raises:
            InvalidKeyError: bad ``key``/``namespace``. EctierError: the cache is closed.
        """
        ns, key = self._identity(key, namespace)
        self._check_open()
        return self._mover.delete(entry_digest(ns, key))

    def __len__(self) -> int:
        """Number of entries stored (all tiers, counted once; every namespace of the store, as
        ``stats()["entries"]``). Raises EctierError once the cache is closed."""
        self._check_open()
        with self._cond:
            return len(self._catalog)

    def stats(self) -> dict[str, Any]:
        """Counters and occupancy, in items and bytes (keys documented in ``docs/operations.md``).

        Returns ``{"namespace", "entries", "hits", "misses", "in_flight", "copy_failures",
        "tiers": {name: {capacity_bytes, used_bytes, entries, <tier facts>, <tier counters>}}}``;
        a disabled tier is absent from ``tiers``. ``entries`` (and each tier's ``entries``) counts
        the store's entries of **every namespace**, not only ``namespace`` (the cache's default):
        a store shared by several namespaces counts them all, while :meth:`contains` and
        :meth:`get` look in one. There is no per-namespace count.

        Raises:
            EctierError: the cache is closed.
        """
        self._check_open()
        with self._cond:
            return cache_stats(self.config.namespace, self._counters, self._catalog, self._stack)

    def quarantined(self) -> dict[bytes, dict[str, Any]]:
        """NVMe records taken out of service after failing a check: digest -> ``{"reason", "time",
        "header"}`` (kept across restarts for inspection). Empty without an NVMe tier.

        Raises:
            EctierError: the cache is closed.
        """
        self._check_open()
        nvme = self._stack.get("nvme")
        return nvme.quarantined() if nvme is not None else {}

    def flush(self) -> int:
        """Wait for copies in flight, then write every GPU and host entry that NVMe does not hold
        yet to NVMe (the copies above stay). Returns the number written; 0 without an NVMe tier.

        Raises:
            EctierError: the cache is closed.
        """
        self._check_open()
        self._mover.completer.drain()  # copies in flight land first
        return self._mover.flush()

    def wait_remote(self, timeout_s: float | None = None) -> bool:
        """Wait until every write-through to the remote tier asked for so far has run (written,
        or given up on and counted: ``stats()["tiers"]["remote"]``). True once none is left,
        False if ``timeout_s`` seconds passed first (``None``: no limit); True at once without a
        remote tier or with ``remote.write_through`` off. Puts never wait for the remote tier;
        this is for a producer that must know its entries are in the store before it tells a
        consumer on another node (or exits).

        Raises:
            EctierError: the cache is closed.
        """
        self._check_open()
        remote = self._mover.remote
        return True if remote is None else remote.drain(timeout_s)

    def close(self) -> None:
        """Wait for copies and prefetches in flight (a prefetch queued but not started finishes
        False with ``EctierError``, unrun), flush (if ``nvme.flush_on_close``), close the
        NVMe tier and free the arenas. Idempotent. In a forked child it only marks the cache closed
        (the parent's files and memory are the parent's). Afterwards every call raises EctierError,
        except ``close`` itself, :meth:`release` and :meth:`abort` (they end the lease, nothing
        else), :meth:`background_read` and :attr:`host_arena_bytes` (the configured size).
        """
        if self._closed:
            return
        if self._fork.forked:
            self._closed = True
            return
        try:
            self._reads.quiesce(closing=True)  # a prefetch from now on finishes at once
            self._mover.close_write_behind()  # its write in flight lands before the flush
            if self.config.nvme.flush_on_close:
                try:
                    self.flush()
                except EctierError as exc:
                    log.error("close: flush to NVMe failed: %s", exc)
        finally:
            self._closed = True
            self._mover.close_write_behind()  # never a write into a closed tier
            self._mover.completer.close()
            if self._mover.remote is not None:
                self._mover.remote.close()  # queued write-throughs run first, within their deadline
            for t in self._stack:
                t.close()

    def __enter__(self) -> "TieredCache":
        self._check_open()  # (a closed cache entered without a word before)
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ================================================================================ internals

    def _identity(self, key: object, namespace: object) -> tuple[str, str]:
        ns = self.config.namespace if namespace is None else validate_namespace(namespace)
        return ns, validate_key(key)

    def _check_open(self) -> None:
        if self._closed:
            raise CacheClosedError("cache is closed")
        self._fork.check("TieredCache")
