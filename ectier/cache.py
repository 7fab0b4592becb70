"""TieredCache: the encoder cache over host memory and NVMe — the only module that knows tier order.

::

    put(key, tensor) ──> host arena (LRU by bytes) ──evict: demote──> NVMe / LMDB (LRU by bytes) ──evict──> dropped
    get(key)         <── host hit                  <──promote on hit── NVMe hit (checked, decoded)

Rules this class keeps (``design.md``):

- Entry lifecycle ``reserve → write → commit`` (or ``abort``); a key becomes visible only at commit,
  so a half-written entry is never served. Copies run outside the cache lock; only bookkeeping
  runs under it.
- Readers pin the slot they copy from; pinned slots are never evicted or freed.
- Admission evicts least-recently-used entries by bytes, all or nothing. Victims demote to NVMe
  (unless NVMe already holds the same version, then eviction is free), else they are dropped.
- An entry larger than a tier's whole budget skips that tier (counted as ``skipped_too_large``);
  it never empties the tier.
- Every committed write carries a version; a tier copy is served only if it is the current
  version of its key, so a late demotion or promotion can never resurrect old bytes.
- A failure inside the NVMe tier (checksum, I/O) is a miss for that key, never an exception from
  :meth:`get`.
"""

from __future__ import annotations

import logging
import math
import operator
import os
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from .config import CacheConfig
from .copy import Completer, CopyEngine, CopyHandle, CudaCopyEngine
from .entry import (
    EntryMeta,
    advance_version,
    dtype_itemsize,
    entry_digest,
    next_version,
    validate_key,
    validate_namespace,
)
from .errors import (
    ConfigError,
    EctierError,
    EntryTooLargeError,
    InvalidDeviceError,
    InvalidKeyError,
    InvalidTensorError,
    TierWriteError,
)
from .index import Slot
from .policy import make_policy
from .tensors import byte_view, cuda_available, empty_for, meta_for, parse_device, torch_dtype
from .tiers.gpu import GpuTier
from .tiers.host import HostTier
from .tiers.nvme import NvmeTier

__all__ = ["TieredCache", "WriteLease", "ReadLease", "PutHandle", "LoadHandle"]

log = logging.getLogger(__name__)

_HOST_COUNTERS = ("hits", "hit_bytes", "puts", "put_bytes", "promotions", "evictions", "demotions",
                  "drops", "skipped_too_large", "admission_timeouts")
_GPU_COUNTERS = ("hits", "hit_bytes", "puts", "put_bytes", "promotions", "promotion_failures", "evictions",
                 "demotions", "drops", "skipped_too_large", "admission_timeouts", "copy_failures")
_NVME_COUNTERS = ("hits", "hit_bytes", "puts", "put_bytes", "evictions", "skipped_too_large",
                  "write_failures", "read_failures")


class TieredCache:
    """An in-process encoder cache keyed by ``mm_hash`` over a host tier and an NVMe tier.

    Args:
        config: :class:`~ectier.config.CacheConfig` (default: 1 GiB host arena, no NVMe tier), or a
            mapping (:meth:`CacheConfig.from_dict`) or a ``.json``/``.yaml`` path (:meth:`CacheConfig.load`).
        host_shm_path: put the host arena in this new file (e.g. under ``/dev/shm``) mapped shared,
            so that other processes can map it (the daemon does this); default: private memory.
        _copy_engine, _gpu_device: test hooks only. ``_copy_engine`` routes every copy through the
            given :class:`~ectier.copy.CopyEngine` (CPU tensors then take the asynchronous path);
            ``_gpu_device="cpu"`` (needs ``_copy_engine``) puts the GPU tier's arena in CPU memory
            so that the GPU tier's logic runs without CUDA.

    With ``gpu.capacity_bytes > 0`` the cache holds a device arena on ``gpu.device`` and moves
    bytes on dedicated CUDA streams (:mod:`ectier.copy`); ``put`` of a CUDA tensor returns a
    :class:`PutHandle` after enqueueing, ``get(device=)`` returns a tensor ready on the caller's
    current stream, ``prefetch`` returns :class:`LoadHandle` s. Never fork a process after it used
    the cache on CUDA (design rule 5).

    Thread-safe: any number of threads may call ``put``/``get``/``contains``/``delete`` at once.

    Raises:
        ConfigError: an invalid config, a host or device arena that cannot be allocated, a GPU
            tier on a machine without CUDA or on a device index it lacks (names ``gpu.*``).
        StoreOpenError, StoreLockedError: the NVMe directory cannot be opened / is in use.
    """

    def __init__(
        self, config: CacheConfig | Mapping[str, Any] | str | os.PathLike | None = None, *,
        host_shm_path: str | None = None, _copy_engine: CopyEngine | None = None, _gpu_device: str | None = None,
    ) -> None:
        if config is None:
            config = CacheConfig()
        elif isinstance(config, Mapping):
            config = CacheConfig.from_dict(config)
        elif isinstance(config, (str, os.PathLike)):
            config = CacheConfig.load(config)
        elif not isinstance(config, CacheConfig):
            raise ConfigError(
                f"config: expected a CacheConfig, a mapping or a .json/.yaml path, got {type(config).__name__}"
            )
        self.config = config
        self._cond = threading.Condition(threading.Lock())
        self._closed = False
        # test hook: one engine for every device, and (with _gpu_device="cpu") a GPU tier whose
        # arena lives in CPU memory, so all tier logic runs without CUDA
        self._test_engine = _copy_engine
        self._engines: dict[int, CopyEngine] = {}
        self._completer = Completer()
        self._prefetch_pool: ThreadPoolExecutor | None = None
        # digest -> host writes in flight (puts of device tensors, GPU demotions), oldest first
        self._inflight: dict[bytes, list[_Pending]] = {}
        self._gpu: GpuTier | None = self._open_gpu(_gpu_device) if self.config.gpu.enabled else None
        try:
            self._host = (
                HostTier(self.config.host, shm_path=host_shm_path, policy=make_policy(self.config.host.policy))
                if self.config.host.capacity_bytes > 0
                else None
            )
        except BaseException:
            self._gpu = None
            raise
        try:
            self._nvme = NvmeTier(self.config.nvme) if self.config.nvme.enabled else None
        except BaseException:
            if self._host is not None:
                self._host.close()  # removes a shared arena file (the daemon's): it would leak otherwise
            self._host = None
            self._gpu = None
            raise
        self._counters: dict[str, Counter] = {"gpu": Counter(), "host": Counter(), "nvme": Counter(),
                                              "cache": Counter()}
        # digest -> write version of the key's current bytes, wherever they are
        self._current: dict[bytes, int] = {}
        self._nvme_lru = make_policy(self.config.nvme.policy)  # named for history; any policy
        # digest -> recompute seconds given to put(cost_s=...), handed to the tiers' policies
        self._cost_s: dict[bytes, float] = {}
        self._nvme_reserved = 0
        # deletes of records already taken out of the NVMe LRU, still counted in nvme.used_bytes
        self._nvme_busy = 0
        # digest -> NVMe writes in flight for it: the record they replace was credited to them, so
        # no other admission may take it as a victim
        self._nvme_writing: Counter = Counter()
        # thread ident -> digest that thread is promoting to host: until the promotion commits its
        # NVMe copy is the only one, so the demotions that the promotion itself causes (in the
        # same thread) must not evict it
        self._promoting: dict[int, bytes] = {}
        if self._nvme is not None:
            records = self._nvme.records()
            if records:
                advance_version(records[-1][1].version)
            for digest, rec in records:  # oldest write first = least recently used
                self._current[digest] = rec.version
                self._nvme_lru.add(digest, rec.stored_bytes)
            self._trim_nvme_to_budget()

    def _open_gpu(self, override: str | None) -> GpuTier:
        """Validate ``gpu.device`` against this machine and allocate the device arena.

        Raises:
            ConfigError: CUDA is absent, the device index does not exist, or the budget does not
                fit the device's free memory (names the ``gpu.*`` field).
        """
        cfg = self.config.gpu
        if override is not None:
            if self._test_engine is None:
                raise ConfigError("_gpu_device: a test hook that needs _copy_engine")
            dev = torch.device(override)
        else:
            if not cuda_available():
                raise ConfigError(
                    f"gpu.capacity_bytes: is {cfg.capacity_bytes} but CUDA is not available on this machine; "
                    "set gpu.capacity_bytes to 0 (the default) to run without a GPU tier"
                )
            count = torch.cuda.device_count()
            if cfg.device_index >= count:
                raise ConfigError(f"gpu.device: {cfg.device!r} does not exist; this machine has {count} CUDA device(s)")
            dev = torch.device(cfg.device)
        engine = self._engine_for(dev)
        assert engine is not None
        return GpuTier(cfg, device=dev, engine=engine, policy=make_policy(cfg.policy))

    def _engine_for(self, dev: torch.device) -> CopyEngine | None:
        """The copy engine of ``dev``: the test engine if one was given, a :class:`CudaCopyEngine`
        per CUDA device (created at first use), ``None`` for the CPU (plain synchronous copies)."""
        if self._test_engine is not None:
            return self._test_engine
        if dev.type != "cuda":
            return None
        with self._cond:
            engine = self._engines.get(dev.index)
            if engine is None:
                engine = CudaCopyEngine(dev, streams_per_direction=self.config.gpu.copy_streams)
                self._engines[dev.index] = engine
            return engine

    # ================================================================================ public API

    def put(
        self, key: str, tensor: torch.Tensor, *, namespace: str | None = None, cost_s: float | None = None
    ) -> "PutHandle":
        """Store ``tensor`` under ``key`` (an ``mm_hash``), replacing any previous entry atomically.

        Any dtype torch has (bfloat16, float16, float32, int8, fp8, ...) and any shape, including
        zero-size tensors (stored and returned as such) and non-contiguous views (stored in C order).

        Where it goes:

        - a tensor on the GPU tier's device (``gpu.device``): into the device arena by a copy on
          the engine's arena stream; GPU victims demote to the host tier by asynchronous D2H;
        - another CUDA tensor (no GPU tier): into the pinned host arena by an asynchronous D2H on a
          dedicated stream; the entry becomes visible when the copy completes;
        - a CPU tensor: into the host arena, synchronously (as before);
        - larger than the host budget (or no host tier): to NVMe, synchronously.

        A CUDA put returns after enqueueing the copy (the copy stream first waits for the work
        already enqueued on the caller's current stream): the source is referenced and
        ``record_stream``-ed until the copy completes, so the caller may drop it at once and its
        memory is not reused before the copy read it. The caller must not *write into* the source
        before ``handle.done()`` (vLLM never writes into an encoder output). A CPU tensor is copied
        before ``put`` returns; the caller may reuse it at once. A :meth:`get` of a key whose put
        is in flight waits for that copy; :meth:`flush` and :meth:`close` wait for all of them.

        Args:
            key: non-empty ``str`` (up to 64 KiB of UTF-8).
            tensor: the encoder output, e.g. ``(N, 8192)`` bfloat16 for Qwen3-VL.
            namespace: override of ``config.namespace`` for this entry.
            cost_s: seconds recomputing this entry would cost (encoder time), for cost-aware
                eviction policies (``host.policy``/``nvme.policy`` = ``"gdsf"``); ignored by LRU.
                ``None``: unknown.

        Returns:
            a :class:`PutHandle`: already done for synchronous puts; ``wait()`` is True once the
            entry is stored (or was superseded/deleted by a later call), False if the copy failed.

        Raises:
            ValueError: ``cost_s`` is negative or not finite.
            InvalidKeyError, InvalidTensorError: bad ``key``/``namespace``/``tensor`` (a CPU
                tensor given to a cache with only a GPU tier).
            InvalidDeviceError: a CUDA tensor on another device than ``gpu.device``.
            EntryTooLargeError: larger than every enabled tier's whole budget (names the knobs).
            TierWriteError: no tier could store it (NVMe write failed, host held by pinned readers).
            EctierError: the cache is closed.
        In every error case nothing already stored is changed.
        """
        ns, key = self._identity(key, namespace)
        meta = meta_for(ns, key, tensor)
        self._check_open()
        digest = entry_digest(ns, key)
        if cost_s is not None:
            if isinstance(cost_s, bool) or not isinstance(cost_s, (int, float)) or not 0 <= cost_s < math.inf:
                raise ValueError(f"cost_s: expected a finite number of seconds >= 0, got {cost_s!r}")
        dev = tensor.device
        gpu = self._gpu
        on_gpu_tier = gpu is not None and dev == gpu.device
        if gpu is not None and dev.type == "cuda" and not on_gpu_tier:
            raise InvalidDeviceError(
                f"tensor: is on {dev}, but the GPU tier is on gpu.device={self.config.gpu.device}; "
                "put tensors of the worker's own device (one cache per device)"
            )
        if dev.type == "cpu" and not on_gpu_tier and self._host is None and self._nvme is None:
            raise InvalidTensorError(
                f"tensor: is a CPU tensor, but this cache has only a GPU tier (gpu.device={self.config.gpu.device}, "
                "host.capacity_bytes=0, no nvme.path); put device tensors, or configure a host tier"
            )
        with self._cond:
            if cost_s is None:
                self._cost_s.pop(digest, None)
            else:
                self._cost_s[digest] = float(cost_s)
                if len(self._cost_s) > 2 * len(self._current) + 1024:  # forget keys no longer stored
                    self._cost_s = {d: c for d, c in self._cost_s.items() if d in self._current or d == digest}
        version = next_version()
        src = byte_view(tensor)
        handle = PutHandle(key)
        if on_gpu_tier:
            if gpu.index.fits(meta.nbytes):
                if self._gpu_put(digest, meta, version, src, handle):
                    return handle
            else:
                self._count("gpu", skipped_too_large=1)
            if self._host is None and self._nvme is None:
                if not gpu.index.fits(meta.nbytes):
                    raise EntryTooLargeError(self._too_large_text(meta.nbytes))
                raise TierWriteError("gpu tier: no room could be made (entries pinned by readers) and no lower tier")
        host_ok = self._host is not None and self._host.index.fits(meta.nbytes)
        nvme_ok = self._nvme is not None and self._nvme_fits(meta.nbytes)
        if not host_ok and not nvme_ok:
            raise EntryTooLargeError(self._too_large_text(meta.nbytes))
        if self._host is not None and not host_ok:
            self._count("host", skipped_too_large=1)
        engine = self._engine_for(dev) if (dev.type == "cuda" or self._test_engine is not None) else None
        if host_ok:
            if engine is not None:
                if self._host_put_async(digest, meta, version, src, engine, handle):
                    return handle
            else:
                stored = self._host_store(digest, meta, version, src, promotion=False)
                if stored:
                    self._count("host", puts=1, put_bytes=meta.nbytes)
                    if self._nvme is not None and self.config.nvme.write_through:
                        self._write_through(digest, meta, version)
                    handle._finish(True)
                    return handle
            if self._nvme is None:
                raise TierWriteError(
                    "host tier: no room could be made (entries pinned by readers for longer than "
                    "host.admit_wait_s) and no NVMe tier is configured; raise host.capacity_bytes"
                )
        if not nvme_ok:
            raise EntryTooLargeError(self._too_large_text(meta.nbytes))
        self._nvme_store(digest, meta, version, src if src.device.type == "cpu" else src.cpu(), register=True)
        handle._finish(True)
        return handle

    def get(
        self,
        key: str,
        *,
        device: str | torch.device | None = None,
        namespace: str | None = None,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Return a copy of the entry stored under ``key``, or ``None`` on a miss.

        The tensor has the shape and dtype it was put with and is byte-identical to it. An NVMe hit
        is promoted to the host tier; a hit asked for the GPU tier's device is promoted to the GPU
        tier. A record that fails its checksum is quarantined and read as a miss (counted in
        ``stats()["tiers"]["nvme"]["checksum_failures"]``). A put of ``key`` still in flight is
        waited for (never an older version). A failed copy is a miss, never a wrong tensor.

        With ``device="cuda:<i>"`` the result is a fresh tensor on that device, **ready on the
        caller's current stream**: the copy runs on a copy stream and the current stream waits on
        its event (no host synchronisation for host and GPU hits).

        Args:
            key: the ``mm_hash``.
            device: ``None``/``"cpu"`` (default) or an explicit ``"cuda:<index>"``.
            namespace: override of ``config.namespace``.
            out: a contiguous CPU tensor to copy into (saves allocating fresh memory on every hit);
                on a hit whose shape and dtype match, ``out`` itself is returned. A hit of another
                shape or dtype raises ``InvalidTensorError`` and leaves ``out`` untouched.

        Raises:
            InvalidKeyError: bad ``key``/``namespace``. InvalidDeviceError: bad ``device`` (bare
                ``"cuda"``, an index this machine lacks, no CUDA).
            InvalidTensorError: ``out`` is not contiguous, not on the CPU, or does not match the entry.
            torch.cuda.OutOfMemoryError: no device memory for the result tensor (nothing stored
                changes; a failed *promotion* is not an error: the entry is served from below).
            EctierError: the cache is closed.
        """
        ns, key = self._identity(key, namespace)
        dev = parse_device(device)
        self._check_open()
        digest = entry_digest(ns, key)
        want_gpu = self._gpu is not None and dev == self._gpu.device
        for _ in range(3):  # a concurrent overwrite between lookup and read → look again
            self._wait_inflight(digest)
            if self._gpu is not None:
                got = self._gpu_get(digest, dev, out)
                if got is not _MISS:
                    self._counters["cache"]["hits"] += 1
                    return got
            slot = None
            nvme_version = None
            with self._cond:
                if self._host is not None:
                    slot = self._host.index.lookup(digest)
                    if slot is not None:
                        self._host.index.pin(slot)
                        self._host.index.touch(slot)
                if slot is None:
                    v = self._current.get(digest)
                    rec = self._nvme.record(digest) if self._nvme is not None and v is not None else None
                    if rec is None or rec.version != v:
                        if v is not None and (self._gpu_holds_locked(digest, v) or self._inflight.get(digest)):
                            continue  # put on the GPU, or a demotion to host started, meanwhile
                        self._counters["cache"]["misses"] += 1
                        return None
                    nvme_version = v
                    self._nvme_lru.touch(digest)
            if slot is not None:
                if out is None and (want_gpu or dev.type == "cuda"):
                    result = self._serve_host_hit(slot, dev, want_gpu)  # owns the pin
                    self._count("host", hits=1, hit_bytes=slot.meta.nbytes)
                    self._counters["cache"]["hits"] += 1
                    return result
                try:
                    out = self._output_for(slot.meta, out)
                    self._host.read_into(slot, byte_view(out))
                finally:
                    self._unpin(slot)
                self._count("host", hits=1, hit_bytes=slot.meta.nbytes)
                self._counters["cache"]["hits"] += 1
                return out if dev.type == "cpu" else out.to(dev)
            result = self._nvme_read(digest, ns, key, nvme_version)
            if result is _RETRY:
                continue
            if result is None:
                self._counters["cache"]["misses"] += 1
                return None
            meta, data = result
            self._count("nvme", hits=1, hit_bytes=meta.nbytes)
            self._counters["cache"]["hits"] += 1
            if self._host is not None and self._host.index.fits(meta.nbytes):
                if self._host_store(digest, meta, nvme_version, data, promotion=True):
                    self._count("host", promotions=1)
            if want_gpu and out is None:
                g = self._gpu_promote(digest, meta, nvme_version, data=data)
                if g is not None:
                    self._gpu_unpin(g)
            if out is not None:
                out = self._output_for(meta, out)
                byte_view(out).copy_(data)
            elif meta.nbytes:
                out = data.view(torch_dtype(meta.dtype)).view(meta.shape)
            else:
                out = torch.empty(meta.shape, dtype=torch_dtype(meta.dtype))
            return out if dev.type == "cpu" else out.to(dev)
        self._counters["cache"]["misses"] += 1
        return None

    def prefetch(
        self, keys: "list[str] | tuple[str, ...]", *, device: str | torch.device | None = None,
        namespace: str | None = None,
    ) -> list["LoadHandle"]:
        """Start promoting ``keys`` towards ``device`` in the background; one :class:`LoadHandle` each.

        NVMe hits are promoted to the host tier; with ``device`` equal to ``gpu.device`` host (and
        NVMe) hits are promoted on into the GPU tier, so a later ``get(key, device=...)`` is a GPU
        hit. Without a GPU tier (or for another device) prefetch stops at the host tier. Keys
        already where they are wanted, and keys stored nowhere, give handles that are done at once.
        Runs in a small pool of threads (started at the first call).

        Returns:
            ``[LoadHandle]`` in the order of ``keys``: ``wait()`` is True when the key is present
            (ready for a ``get``), False on a miss.

        Raises:
            InvalidKeyError, InvalidDeviceError: bad key/namespace/device (nothing started).
            EctierError: the cache is closed.
        """
        if isinstance(keys, str):
            raise InvalidKeyError("keys: expected a list of keys, got one str")
        dev = parse_device(device)
        idents = [self._identity(k, namespace) for k in keys]
        self._check_open()
        want_gpu = self._gpu is not None and dev == self._gpu.device
        handles = []
        for ns, key in idents:
            digest = entry_digest(ns, key)
            handle = LoadHandle(key)
            with self._cond:
                inflight = bool(self._inflight.get(digest))
                present = digest in self._current
                v = self._current.get(digest)
                gpu_hit = want_gpu and v is not None and self._gpu_holds_locked(digest, v)
                host_slot = self._host.index.lookup(digest) if self._host is not None else None
                host_hit = v is not None and host_slot is not None and host_slot.version == v
            if not inflight and (not present or gpu_hit or (host_hit and not want_gpu)):
                handle._finish(present)
            else:
                if self._prefetch_pool is None:
                    with self._cond:
                        if self._prefetch_pool is None:
                            self._prefetch_pool = ThreadPoolExecutor(2, thread_name_prefix="ectier-prefetch")
                self._prefetch_pool.submit(self._prefetch_one, handle, digest, ns, key, want_gpu)
            handles.append(handle)
        return handles

    # ------------------------------------------------------------ two-phase API (the daemon's)

    def reserve(self, key: str, *, dtype: str, shape: tuple[int, ...] | list[int], namespace: str | None = None) -> "WriteLease":
        """Phase 1 of a put by another party (e.g. a daemon client writing through shared memory):
        reserve host-arena bytes for an entry of ``dtype`` and ``shape``, evicting LRU entries as
        needed. The entry stays invisible until :meth:`commit`; :meth:`abort` returns the bytes.

        Returns a :class:`WriteLease` whose ``extents`` are ``(arena byte offset, length)`` runs
        that together hold the entry's bytes in C order.

        Raises:
            InvalidKeyError, InvalidTensorError: bad key/namespace, unknown dtype, bad shape.
            EntryTooLargeError: larger than ``host.capacity_bytes`` (or there is no host tier).
            TierWriteError: no room could be made within ``host.admit_wait_s``.
        """
        ns, key = self._identity(key, namespace)
        try:  # ints (numpy's too); a float or a bool is refused, never truncated
            if any(isinstance(d, bool) for d in shape):
                raise TypeError
            dims = tuple(operator.index(d) for d in shape)
        except (TypeError, ValueError):
            raise InvalidTensorError(f"shape: expected a sequence of ints, got {shape!r}") from None
        meta = EntryMeta(ns, key, dtype, dims, math.prod(dims) * dtype_itemsize(dtype))
        self._check_open()
        if self._host is None or not self._host.index.fits(meta.nbytes):
            cap = self._host.index.capacity_bytes if self._host is not None else 0
            raise EntryTooLargeError(
                f"entry of {meta.nbytes} bytes does not fit the host arena (host.capacity_bytes={cap}), "
                "through which shared-memory puts go"
            )
        slot = self._host_reserve(entry_digest(ns, key), meta, next_version(), promotion=False)
        if slot is None:
            raise TierWriteError(
                "host tier: no room could be made (entries pinned by readers for longer than host.admit_wait_s)"
            )
        return WriteLease(meta, tuple(self._host.byte_extents(slot)), slot)

    def commit(self, lease: "WriteLease") -> None:
        """Phase 2: make a reserved entry visible, replacing any older entry of its key atomically
        (written through to NVMe first when ``nvme.write_through``).

        Raises:
            ValueError: the lease was already committed or aborted.
        """
        slot = lease._slot
        if self._host_commit(slot, promotion=False):
            self._count("host", puts=1, put_bytes=slot.meta.nbytes)
            if self._nvme is not None and self.config.nvme.write_through:
                self._write_through(slot.digest, slot.meta, slot.version)

    def abort(self, lease: "WriteLease") -> None:
        """Give up a reservation: its bytes return to the arena, nothing becomes visible.

        Raises:
            ValueError: the lease was already committed or aborted.
        """
        self._host_abort(lease._slot)

    def acquire(self, key: str, *, namespace: str | None = None) -> "ReadLease | None":
        """Pin an entry in the host arena for another party to copy out; ``None`` on a miss.

        An NVMe hit is promoted into the host arena first; if it cannot be placed there (larger
        than the host budget, or no clean room), the result is ``None``. The entry is neither
        evicted nor freed until :meth:`release`.
        """
        ns, key = self._identity(key, namespace)
        self._check_open()
        if self._host is None:
            return None
        digest = entry_digest(ns, key)
        promoted = False  # an NVMe hit already counted, now looked up again in the host arena
        for _ in range(3):
            with self._cond:
                slot = self._host.index.lookup(digest)
                if slot is not None:
                    self._host.index.pin(slot)
                    self._host.index.touch(slot)
                    if not promoted:
                        self._counters["host"]["hits"] += 1
                        self._counters["host"]["hit_bytes"] += slot.meta.nbytes
                    self._counters["cache"]["hits"] += 1
                    return ReadLease(slot.meta, tuple(self._host.byte_extents(slot)), slot)
                v = self._current.get(digest)
                rec = self._nvme.record(digest) if self._nvme is not None and v is not None else None
                if rec is None or rec.version != v:
                    break
                self._nvme_lru.touch(digest)
            result = self._nvme_read(digest, ns, key, v)
            if result is _RETRY:
                continue
            if result is None or not self._host.index.fits(result[0].nbytes):
                break
            meta, data = result
            self._count("nvme", hits=1, hit_bytes=meta.nbytes)
            if self._host_store(digest, meta, v, data, promotion=True):
                self._count("host", promotions=1)
                promoted = True
                continue
            break
        self._count("cache", misses=1)
        return None

    def release(self, lease: "ReadLease") -> None:
        """End an :meth:`acquire`: the entry may be evicted again."""
        self._unpin(lease._slot)

    @property
    def host_arena_bytes(self) -> int:
        """Size of the host arena in bytes (0 without a host tier)."""
        return self._host.index.capacity_bytes if self._host is not None else 0

    @property
    def host_arena(self) -> torch.Tensor | None:
        """The host arena as a flat ``uint8`` tensor (``None`` without a host tier)."""
        return self._host.buffer if self._host is not None else None

    def contains(self, key: str, *, namespace: str | None = None) -> bool:
        """True if ``key`` is stored in some tier, or its put is in flight (answered from memory, no I/O).

        Raises:
            InvalidKeyError: bad ``key``/``namespace``. EctierError: the cache is closed.
        """
        ns, key = self._identity(key, namespace)
        self._check_open()
        with self._cond:
            digest = entry_digest(ns, key)
            return digest in self._current or bool(self._inflight.get(digest))

    __contains__ = contains

    def delete(self, key: str, *, namespace: str | None = None) -> bool:
        """Remove ``key`` from every tier. Returns True if it was stored.

        Raises:
            InvalidKeyError: bad ``key``/``namespace``. EctierError: the cache is closed.
        """
        ns, key = self._identity(key, namespace)
        self._check_open()
        digest = entry_digest(ns, key)
        with self._cond:
            existed = self._current.pop(digest, None) is not None
            for p in self._inflight.get(digest, ()):
                p.cancelled = True  # its commit becomes an abort: the put is ordered before this delete
                existed = True
            if self._gpu is not None:
                gs = self._gpu.index.lookup(digest)
                if gs is not None and self._gpu.index.remove(gs):
                    self._cond.notify_all()
            self._cost_s.pop(digest, None)
            if self._host is not None:
                slot = self._host.index.lookup(digest)
                if slot is not None:
                    if self._host.index.remove(slot):
                        self._cond.notify_all()
            self._forget_nvme_locked(digest)
            rec = self._nvme.record(digest) if self._nvme is not None else None
            if rec is not None:
                self._nvme_busy += 1
        if rec is not None:
            self._nvme_delete_pending(digest, rec.version)
        return existed

    def __len__(self) -> int:
        """Number of entries stored (all tiers, counted once)."""
        with self._cond:
            return len(self._current)

    def stats(self) -> dict[str, Any]:
        """Counters and occupancy, in items and bytes.

        Returns a dict::

            {"namespace", "entries", "hits", "misses", "in_flight", "copy_failures",
             "tiers": {"gpu": {device, capacity_bytes, used_bytes, entries, hits, hit_bytes, puts,
                               put_bytes, promotions, promotion_failures, evictions, demotions,
                               drops, skipped_too_large, admission_timeouts, copy_failures},
                       "host": {capacity_bytes, used_bytes, entries, pinned, hits, hit_bytes, puts,
                                put_bytes, promotions, evictions, demotions, drops,
                                skipped_too_large, admission_timeouts},
                       "nvme": {path, codec, capacity_bytes, used_bytes, entries, map_size_bytes,
                                hits, hit_bytes, puts, put_bytes, evictions, skipped_too_large,
                                write_failures, read_failures, checksum_failures, quarantined,
                                orphans_reclaimed, write_errors, map_growths}}}

        A disabled tier is absent from ``tiers``.
        """
        with self._cond:
            out: dict[str, Any] = {
                "namespace": self.config.namespace,
                "entries": len(self._current),
                "hits": self._counters["cache"]["hits"],
                "misses": self._counters["cache"]["misses"],
                "in_flight": sum(len(v) for v in self._inflight.values()),
                "copy_failures": self._counters["cache"]["copy_failures"],
                "tiers": {},
            }
            if self._gpu is not None:
                gidx = self._gpu.index
                gpu = {name: self._counters["gpu"][name] for name in _GPU_COUNTERS}
                gpu.update(device=str(self._gpu.device), capacity_bytes=gidx.capacity_bytes,
                           used_bytes=gidx.used_bytes, entries=len(gidx))
                out["tiers"]["gpu"] = gpu
            if self._host is not None:
                idx = self._host.index
                host = {name: self._counters["host"][name] for name in _HOST_COUNTERS}
                host.update(capacity_bytes=idx.capacity_bytes, used_bytes=idx.used_bytes,
                            entries=len(idx), pinned=self._host.pinned)
                out["tiers"]["host"] = host
            if self._nvme is not None:
                nv = {name: self._counters["nvme"][name] for name in _NVME_COUNTERS}
                nv.update(self._nvme.counters)
                nv.update(path=str(self._nvme.path), codec=self.config.nvme.codec,
                          capacity_bytes=self.config.nvme.capacity_bytes, used_bytes=self._nvme.used_bytes,
                          entries=len(self._nvme), map_size_bytes=self._nvme.map_size_bytes)
                out["tiers"]["nvme"] = nv
            return out

    def quarantined(self) -> dict[bytes, dict[str, Any]]:
        """NVMe records taken out of service after failing a check: digest -> ``{"reason", "time",
        "header"}`` (kept across restarts for inspection). Empty without an NVMe tier."""
        self._check_open()
        return self._nvme.quarantined() if self._nvme is not None else {}

    def flush(self) -> int:
        """Wait for copies in flight, then write every GPU and host entry that NVMe does not hold
        yet to NVMe (the copies above stay).

        Returns the number of entries written. A no-op without an NVMe tier. Used by ``close()``
        when ``nvme.flush_on_close`` so that a restart serves what was in host memory.

        Raises:
            EctierError: the cache is closed.
        """
        self._check_open()
        self._completer.drain()  # copies in flight land first
        if self._nvme is None:
            return 0
        written = self._flush_gpu()
        if self._host is None:
            return written
        with self._cond:
            dirty = [s for s in self._host.index.slots() if not s.lower_copy and s.visible]
            for s in dirty:
                self._host.index.pin(s)
        for s in dirty:
            try:
                if self._demote_one(s):
                    written += 1
            finally:
                self._unpin(s)
        return written

    def close(self) -> None:
        """Wait for copies and prefetches in flight, flush (if ``nvme.flush_on_close``), close the
        NVMe tier and free the GPU and host arenas. Idempotent.

        After ``close`` every operation raises :class:`~ectier.errors.EctierError`.
        """
        if self._closed:
            return
        try:
            if self._prefetch_pool is not None:
                self._prefetch_pool.shutdown(wait=True)
            self._completer.drain()
            if self.config.nvme.flush_on_close:
                try:
                    self.flush()
                except EctierError as exc:
                    log.error("close: flush to NVMe failed: %s", exc)
        finally:
            self._closed = True
            self._completer.close()
            if self._gpu is not None:
                self._gpu.close()
            self._gpu = None
            if self._nvme is not None:
                self._nvme.close()
            if self._host is not None:
                self._host.close()
            self._host = None

    def __enter__(self) -> "TieredCache":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ================================================================================ internals

    def _identity(self, key: object, namespace: object) -> tuple[str, str]:
        ns = self.config.namespace if namespace is None else validate_namespace(namespace)
        return ns, validate_key(key)

    def _check_open(self) -> None:
        if self._closed:
            raise EctierError("cache is closed")

    def _count(self, tier: str, **amounts: int) -> None:
        with self._cond:
            self._counters[tier].update(amounts)

    def _too_large_text(self, nbytes: int) -> str:
        parts = []
        if self._gpu is not None:
            parts.append(f"gpu.capacity_bytes={self._gpu.index.capacity_bytes}")
        if self._host is not None:
            parts.append(f"host.capacity_bytes={self._host.index.capacity_bytes}")
        if self._nvme is not None:
            parts.append(f"nvme.capacity_bytes={self.config.nvme.capacity_bytes}")
        return f"entry of {nbytes} bytes is larger than every tier's whole budget ({', '.join(parts)})"

    @staticmethod
    def _output_for(meta: EntryMeta, out: torch.Tensor | None) -> torch.Tensor:
        dtype = torch_dtype(meta.dtype)
        if out is None:
            return torch.empty(meta.shape, dtype=dtype)
        if not isinstance(out, torch.Tensor) or out.device.type != "cpu" or not out.is_contiguous():
            raise InvalidTensorError("out: expected a contiguous CPU tensor")
        if out.dtype != dtype or out.numel() * out.element_size() != meta.nbytes:
            raise InvalidTensorError(
                f"out: the entry is {meta.dtype} {meta.shape}, out is {dtype_name_of(out)} {tuple(out.shape)}"
            )
        return out.view(meta.shape) if tuple(out.shape) != meta.shape else out

    def _unpin(self, slot: Slot) -> None:
        with self._cond:
            if self._host is not None and self._host.index.unpin(slot):
                self._cond.notify_all()

    # ---------------------------------------------------------------------------- in-flight copies

    def _when_done(self, h: CopyHandle, callback) -> None:
        """Run ``callback`` once ``h`` completes: now if it already has (CPU engines), else in the
        completer thread."""
        if h.done():
            callback()
        else:
            self._completer.submit(h, callback)

    def _wait_inflight(self, digest: bytes) -> None:
        """Wait for the host writes of ``digest`` in flight now (so a get never sees older bytes)."""
        with self._cond:
            pend = list(self._inflight.get(digest, ()))
        for p in pend:
            p.handle.wait()

    def _end_pending(self, pending: "_Pending", ok: bool, error: BaseException | None) -> None:
        with self._cond:
            lst = self._inflight.get(pending.digest)
            if lst is not None and pending in lst:
                lst.remove(pending)
                if not lst:
                    del self._inflight[pending.digest]
            pending.finished = True
            if not ok:
                self._forget_if_unheld_locked(pending.digest, pending.version)
            self._cond.notify_all()
        pending.handle._finish(ok and error is None, error)

    def _host_put_async(self, digest: bytes, meta: EntryMeta, version: int, src: torch.Tensor,
                        engine: CopyEngine, handle: "PutHandle") -> bool:
        """Reserve host blocks and enqueue the D2H copy into them; commit when it completes.

        False when no room could be made (nothing enqueued)."""
        host = self._host
        assert host is not None
        slot = self._host_reserve(digest, meta, version, promotion=False)
        if slot is None:
            return False
        pending = _Pending(digest, version, handle)
        pairs = [(host.buffer[a : a + n], src[o : o + n]) for a, o, n in host.runs(slot)]
        with self._cond:
            self._inflight.setdefault(digest, []).append(pending)
        try:
            h = engine.copy(pairs, lane="d2h")
        except BaseException:
            self._host_abort(slot)
            self._end_pending(pending, False, None)
            raise
        self._when_done(h, lambda: self._finish_host_write(slot, h, pending, promotion=False))
        return True

    def _finish_host_write(self, slot: Slot, h: CopyHandle, pending: "_Pending", *, promotion: bool,
                           source: Slot | None = None) -> None:
        """Completion of an asynchronous write into the host arena (a put, or a GPU demotion of
        ``source`` when ``promotion``): commit it, or give the blocks back if the copy failed."""
        ok = False
        error = _copy_error(h, source)
        try:
            if error is not None:
                log.warning("copy into the host tier failed (%s); entry not stored", error)
                self._count("cache", copy_failures=1)
                self._host_abort(slot)
            else:
                ok = self._host_commit(slot, promotion=promotion, pending=pending)
                if ok and not promotion and not pending.cancelled:
                    self._count("host", puts=1, put_bytes=slot.meta.nbytes)
                    if self._nvme is not None and self.config.nvme.write_through:
                        self._write_through(slot.digest, slot.meta, slot.version)
        finally:
            self._end_pending(pending, ok, error)

    # ---------------------------------------------------------------------------- GPU tier

    def _gpu_holds_locked(self, digest: bytes, version: int) -> bool:
        if self._gpu is None:
            return False
        s = self._gpu.index.lookup(digest)
        return s is not None and s.version == version

    def _lower_holds_locked(self, digest: bytes, version: int) -> bool:
        """Whether the host or the NVMe tier holds ``version`` of ``digest``."""
        s = self._host.index.lookup(digest) if self._host is not None else None
        if s is not None and s.version == version:
            return True
        rec = self._nvme.record(digest) if self._nvme is not None else None
        return rec is not None and rec.version == version

    def _forget_if_unheld_locked(self, digest: bytes, version: int) -> None:
        """Drop ``digest`` from the stored keys if ``version`` is current and no tier (nor a copy in
        flight) holds it any more."""
        if self._current.get(digest) != version:
            return
        if self._gpu_holds_locked(digest, version) or self._lower_holds_locked(digest, version):
            return
        if any(p.version == version and not p.finished for p in self._inflight.get(digest, ())):
            return
        del self._current[digest]

    def _gpu_drop_older_locked(self, digest: bytes, version: int) -> None:
        """A newer version of ``digest`` was committed below: the GPU copy is stale."""
        if self._gpu is None:
            return
        s = self._gpu.index.lookup(digest)
        if s is not None and s.version < version and self._gpu.index.remove(s):
            self._cond.notify_all()

    def _gpu_unpin(self, slot: Slot) -> None:
        with self._cond:
            if self._gpu is not None and self._gpu.index.unpin(slot):
                self._cond.notify_all()

    def _gpu_reserve(self, digest: bytes, meta: EntryMeta, version: int, *, promotion: bool) -> Slot | None:
        """Reserve GPU blocks, evicting (demoting) LRU victims as needed; ``None`` if no room
        (at once for a promotion, else after ``host.admit_wait_s``) or a promotion is pointless."""
        gpu = self._gpu
        assert gpu is not None
        idx = gpu.index
        deadline = time.monotonic() + self.config.host.admit_wait_s
        while True:
            with self._cond:
                if promotion and (self._current.get(digest) != version or idx.lookup(digest) is not None):
                    return None
                slot = idx.reserve(digest, meta, version)
                if slot is not None:
                    slot.cost_s = self._cost_s.get(digest)
                    return slot
                found = idx.victims(idx.alloc_bytes(meta.nbytes) - idx.free_bytes)
                if found is None:
                    remaining = deadline - time.monotonic()
                    if promotion or remaining <= 0:
                        self._counters["gpu"]["admission_timeouts"] += 1
                        return None
                    self._cond.wait(timeout=min(remaining, 0.01))
                    continue
                for v in found:
                    idx.pin(v)
            self._gpu_evict(found)

    def _gpu_commit_locked(self, slot: Slot, *, promotion: bool) -> bool:
        """Make a GPU slot visible: the write into it is enqueued on the arena lane, and every
        reader's copy is enqueued after it there, so no reader can see the bytes before they land.
        Aborts (False) when a newer version exists or, for a promotion, the key changed."""
        idx = self._gpu.index
        digest, version = slot.digest, slot.version
        current = self._current.get(digest)
        rec = self._nvme.record(digest) if self._nvme is not None else None
        if promotion:
            stale = current != version or idx.lookup(digest) is not None
        else:
            stale = (current is not None and current > version) or (rec is not None and rec.version > version)
        if stale:
            idx.abort(slot)
            self._cond.notify_all()
            return False
        if idx.commit(slot) is not None:
            self._cond.notify_all()
        self._current[digest] = version
        if not promotion and self._host is not None:
            hs = self._host.index.lookup(digest)
            if hs is not None and hs.version < version and self._host.index.remove(hs):
                self._cond.notify_all()
        return True

    def _gpu_put(self, digest: bytes, meta: EntryMeta, version: int, src: torch.Tensor, handle: "PutHandle") -> bool:
        """Enqueue ``src`` (on the GPU tier's device) into the device arena. False if no room."""
        gpu = self._gpu
        assert gpu is not None
        slot = self._gpu_reserve(digest, meta, version, promotion=False)
        if slot is None:
            return False
        try:
            h = gpu.write(slot, src)
        except BaseException:
            with self._cond:
                gpu.index.abort(slot)
                self._cond.notify_all()
            raise
        slot.pending_write = h
        stale = None
        with self._cond:
            ok = self._gpu_commit_locked(slot, promotion=False)
            if ok:
                self._counters["gpu"]["puts"] += 1
                self._counters["gpu"]["put_bytes"] += meta.nbytes
                rec = self._nvme.record(digest) if self._nvme is not None else None
                if rec is not None and rec.version != version:
                    stale = rec.version
                    self._forget_nvme_locked(digest)
                    self._nvme_busy += 1
        if stale is not None:
            # a put into the GPU tier is not written through (it reaches NVMe when demoted, or at
            # flush): write-back semantics even with nvme.write_through, so the older NVMe record
            # goes before put returns and a restart never serves bytes older than this put
            self._nvme_delete_pending(digest, stale)
        self._when_done(h, lambda: self._after_gpu_write(slot, h, handle))
        return True

    def _after_gpu_write(self, slot: Slot, h: CopyHandle, handle: "PutHandle | None") -> None:
        if h.error is not None:
            log.warning("copy into the GPU tier failed (%s); entry dropped from it", h.error)
            with self._cond:
                self._counters["gpu"]["copy_failures"] += 1
                gpu = self._gpu
                if gpu is not None and gpu.index.lookup(slot.digest) is slot and gpu.index.remove(slot):
                    self._cond.notify_all()
                self._forget_if_unheld_locked(slot.digest, slot.version)
        if handle is not None:
            handle._finish(h.error is None, h.error)

    def _gpu_promote(self, digest: bytes, meta: EntryMeta, version: int, *, data: torch.Tensor | None = None,
                     hslot: Slot | None = None) -> Slot | None:
        """Copy an entry into the GPU tier from CPU ``data`` or from host slot ``hslot`` (which the
        caller pins; this takes its own pin until the copy completes). Returns the committed GPU
        slot, pinned for the caller, or ``None`` (no room, key changed, copy could not start: a
        CUDA out-of-memory error leaves the entry served from the lower tier)."""
        gpu = self._gpu
        assert gpu is not None
        if not gpu.index.fits(meta.nbytes):
            self._count("gpu", skipped_too_large=1)
            return None
        slot = self._gpu_reserve(digest, meta, version, promotion=True)
        if slot is None:
            return None
        if hslot is not None:
            with self._cond:
                self._host.index.pin(hslot)
        try:
            if hslot is not None:
                pairs = _run_pairs(gpu.buffer, gpu.runs(slot), self._host.buffer, self._host.runs(hslot))
                h = gpu.engine.copy(pairs, lane="arena")
            else:
                h = gpu.write(slot, data)
        except RuntimeError as exc:  # torch.cuda.OutOfMemoryError and other device errors
            log.warning("promotion of an entry to the GPU tier failed (%s); served from the lower tier", exc)
            with self._cond:
                self._counters["gpu"]["promotion_failures"] += 1
                gpu.index.abort(slot)
                self._cond.notify_all()
            if hslot is not None:
                self._unpin(hslot)
            return None
        slot.pending_write = h
        with self._cond:
            ok = self._gpu_commit_locked(slot, promotion=True)
            if ok:
                gpu.index.pin(slot)
                self._counters["gpu"]["promotions"] += 1

        def done() -> None:
            if hslot is not None:
                self._unpin(hslot)  # rule 3: the pinned source bytes stay until the copy completed
            self._after_gpu_write(slot, h, None)

        self._when_done(h, done)
        return slot if ok else None

    def _gpu_evict(self, victims: list[Slot]) -> None:
        """Demote (or drop) GPU victims that this thread pinned, then remove them from the GPU.

        The blocks of a victim are free as soon as its demotion copy is enqueued: every later write
        into them is enqueued on the same arena lane, after it."""
        pending = list(victims)
        try:
            while pending:
                v = pending[0]
                demoted = False
                try:
                    demoted = self._gpu_demote(v)
                except (EctierError, RuntimeError) as exc:
                    log.warning("demotion of a GPU entry failed (%s); entry dropped", exc)
                finally:
                    pending.pop(0)
                    self._gpu_release_victim(v, demoted)
        finally:
            for v in pending:
                self._gpu_release_victim(v, False)

    def _gpu_release_victim(self, v: Slot, demoted: bool) -> None:
        with self._cond:
            gpu = self._gpu
            if gpu is not None:
                gpu.index.remove(v)
                gpu.index.unpin(v)
            self._counters["gpu"]["evictions"] += 1
            self._counters["gpu"]["demotions" if demoted else "drops"] += 1
            if not demoted:
                self._forget_if_unheld_locked(v.digest, v.version)
            self._cond.notify_all()

    def _gpu_demote(self, v: Slot) -> bool:
        """Start moving a pinned GPU victim down. True if a lower tier holds (or, once its copy
        completes, will hold) its version."""
        gpu = self._gpu
        assert gpu is not None
        digest, version, meta = v.digest, v.version, v.meta
        with self._cond:
            if self._current.get(digest) != version:
                return False  # replaced or deleted: nothing to keep
            if self._lower_holds_locked(digest, version):
                return True
        host = self._host
        if host is not None and host.index.fits(meta.nbytes):
            hslot = self._host_reserve(digest, meta, version, promotion=True)
            if hslot is not None:
                pending = _Pending(digest, version, PutHandle(meta.key))
                with self._cond:
                    self._inflight.setdefault(digest, []).append(pending)
                try:
                    pairs = _run_pairs(host.buffer, host.runs(hslot), gpu.buffer, gpu.runs(v))
                    h = gpu.engine.copy(pairs, lane="arena")  # D2H after every earlier arena write
                except BaseException:
                    self._host_abort(hslot)
                    self._end_pending(pending, False, None)
                    raise
                self._when_done(h, lambda: self._finish_host_write(hslot, h, pending, promotion=True, source=v))
                return True
        if self._nvme is not None and self._nvme_fits(meta.nbytes):
            buf = torch.empty(meta.nbytes, dtype=torch.uint8)
            h = gpu.read_into(v, buf)
            h.wait()
            if _copy_error(h, v) is not None:
                self._count("gpu", copy_failures=1)
                return False
            return self._nvme_store(digest, meta, version, buf, register=False)
        return False

    def _gpu_get(self, digest: bytes, dev: torch.device, out: torch.Tensor | None):
        """Serve a GPU-tier hit, or ``_MISS``."""
        gpu = self._gpu
        assert gpu is not None
        with self._cond:
            slot = gpu.index.lookup(digest)
            if slot is None or slot.version != self._current.get(digest):
                return _MISS
            gpu.index.pin(slot)
            gpu.index.touch(slot)
        try:
            result = self._read_gpu_slot(slot, dev, out)
        finally:
            self._gpu_unpin(slot)
        if result is not _MISS:
            self._count("gpu", hits=1, hit_bytes=slot.meta.nbytes)
        return result

    def _read_gpu_slot(self, slot: Slot, dev: torch.device, out: torch.Tensor | None):
        """Copy a pinned GPU slot out. To the tier's own device: ready on the caller's current
        stream, no host wait. Elsewhere: through host memory, waited for; a failed copy (of this
        read or of the write that filled the slot) drops the slot and returns ``_MISS``."""
        gpu = self._gpu
        meta = slot.meta
        if dev == gpu.device and out is None:
            result = empty_for(meta, dev)
            h = gpu.read_into(slot, byte_view(result))
            if dev.type == "cuda":
                h.wait_stream(dev)  # rule 4
                return result
        else:
            result = self._output_for(meta, out)
            h = gpu.read_into(slot, byte_view(result))
        h.wait()
        err = _copy_error(h, slot)
        if err is not None:
            log.warning("copy out of the GPU tier failed (%s); read as a miss there", err)
            with self._cond:
                self._counters["gpu"]["copy_failures"] += 1
                if gpu.index.lookup(slot.digest) is slot and gpu.index.remove(slot):
                    self._cond.notify_all()
                self._forget_if_unheld_locked(slot.digest, slot.version)
            return _MISS
        return result if result.device == dev else result.to(dev)

    def _serve_host_hit(self, slot: Slot, dev: torch.device, want_gpu: bool) -> torch.Tensor:
        """Serve a host hit (pinned by the caller; unpinned here, at once or when the copy that
        reads it completes) to ``dev``, promoting it into the GPU tier when ``want_gpu``."""
        host = self._host
        meta = slot.meta
        if want_gpu:
            try:
                g = self._gpu_promote(slot.digest, meta, slot.version, hslot=slot)
            except BaseException:
                self._unpin(slot)
                raise
            if g is not None:
                try:
                    result = self._read_gpu_slot(g, dev, None)
                except BaseException:
                    self._unpin(slot)
                    raise
                finally:
                    self._gpu_unpin(g)
                if result is not _MISS:
                    self._unpin(slot)  # the promotion holds its own pin until its copy completes
                    return result
                # the GPU copy failed: serve the host copy (still pinned by us)
        if dev.type != "cuda":
            try:
                out = self._output_for(meta, None)
                host.read_into(slot, byte_view(out))
            finally:
                self._unpin(slot)
            return out
        try:
            engine = self._engine_for(dev)
            result = empty_for(meta, dev)
            flat = byte_view(result)
            h = engine.copy([(flat[o : o + n], host.buffer[a : a + n]) for a, o, n in host.runs(slot)], lane="h2d")
        except BaseException:
            self._unpin(slot)
            raise
        h.wait_stream(dev)  # rule 4: the caller's stream waits; no host sync
        self._when_done(h, lambda: self._unpin(slot))  # rule 3
        return result

    # ---------------------------------------------------------------------------- prefetch

    def _prefetch_one(self, handle: "LoadHandle", digest: bytes, ns: str, key: str, want_gpu: bool) -> None:
        try:
            self._wait_inflight(digest)
            handle._finish(self._promote(digest, ns, key, want_gpu))
        except Exception as exc:  # noqa: BLE001 - reported through the handle, and logged
            log.warning("prefetch of a key failed: %s", exc)
            handle._finish(False, exc)

    def _promote(self, digest: bytes, ns: str, key: str, want_gpu: bool) -> bool:
        """Move ``digest`` up: NVMe → host, and host → GPU when ``want_gpu``. True if present."""
        for _ in range(3):
            hslot = None
            with self._cond:
                v = self._current.get(digest)
                if v is None:
                    return False
                if self._gpu_holds_locked(digest, v) and (want_gpu or not self._lower_holds_locked(digest, v)):
                    return True
                s = self._host.index.lookup(digest) if self._host is not None else None
                if s is not None and s.version == v:
                    self._host.index.touch(s)
                    if not want_gpu:
                        return True
                    hslot = s
                    self._host.index.pin(s)
                else:
                    rec = self._nvme.record(digest) if self._nvme is not None else None
                    if rec is None or rec.version != v:
                        return digest in self._current
                    self._nvme_lru.touch(digest)
                    host_fits = self._host is not None and self._host.index.fits(rec.header.raw_nbytes)
                    if not want_gpu and not host_fits:
                        return True  # it stays where it is: NVMe is the highest tier it fits
            if hslot is not None:
                try:
                    g = self._gpu_promote(digest, hslot.meta, v, hslot=hslot)
                finally:
                    self._unpin(hslot)
                if g is not None:
                    self._gpu_unpin(g)
                return True
            result = self._nvme_read(digest, ns, key, v)
            if result is _RETRY:
                continue
            if result is None:
                return False
            meta, data = result
            self._count("nvme", hits=1, hit_bytes=meta.nbytes)
            if self._host is not None and self._host.index.fits(meta.nbytes):
                if self._host_store(digest, meta, v, data, promotion=True):
                    self._count("host", promotions=1)
            if want_gpu:
                g = self._gpu_promote(digest, meta, v, data=data)
                if g is not None:
                    self._gpu_unpin(g)
            return True
        with self._cond:
            return digest in self._current

    # ---------------------------------------------------------------------------- host tier

    def _host_store(self, digest: bytes, meta: EntryMeta, version: int, src: torch.Tensor, *, promotion: bool) -> bool:
        """Admit an entry into the host tier: reserve (evicting LRU victims), copy, commit.

        For a promotion, nothing happens unless ``version`` is still the key's current version and
        the host does not hold the key. Returns True if committed.
        """
        if promotion:
            me = threading.get_ident()
            with self._cond:
                self._promoting[me] = digest
            try:
                return self._host_admit(digest, meta, version, src, promotion=True)
            finally:
                with self._cond:
                    self._promoting.pop(me, None)
        return self._host_admit(digest, meta, version, src, promotion=False)

    def _host_admit(self, digest: bytes, meta: EntryMeta, version: int, src: torch.Tensor, *, promotion: bool) -> bool:
        slot = self._host_reserve(digest, meta, version, promotion=promotion)
        if slot is None:
            return False
        try:
            self._host.write(slot, src)
        except BaseException:
            self._host_abort(slot)
            raise
        return self._host_commit(slot, promotion=promotion)

    def _host_reserve(self, digest: bytes, meta: EntryMeta, version: int, *, promotion: bool) -> Slot | None:
        """Reserve host blocks for an entry, evicting (demoting) LRU victims as needed.

        Returns the RESERVED slot, or ``None`` when no room could be made within
        ``host.admit_wait_s`` (at once for a promotion) or a promotion became pointless.
        """
        host = self._host
        assert host is not None
        idx = host.index
        deadline = time.monotonic() + self.config.host.admit_wait_s
        while True:
            victims: list[Slot] = []
            with self._cond:
                if promotion and (self._current.get(digest) != version or idx.lookup(digest) is not None):
                    return None
                slot = idx.reserve(digest, meta, version)
                if slot is not None:
                    slot.cost_s = self._cost_s.get(digest)
                    return slot
                # with host.promote_clean_only a promotion evicts only entries NVMe already holds,
                # so a get never waits on demotion writes
                found = idx.victims(idx.alloc_bytes(meta.nbytes) - idx.free_bytes,
                                    clean_only=promotion and self.config.host.promote_clean_only)
                if found is None:
                    remaining = deadline - time.monotonic()
                    if remaining <= 0 or promotion:
                        self._counters["host"]["admission_timeouts"] += 1
                        return None
                    self._cond.wait(timeout=min(remaining, 0.05))
                    continue
                victims = found
                for v in victims:
                    idx.pin(v)  # the demoter's pin: bytes stay valid until demoted
            self._evict(victims)

    def _host_abort(self, slot: Slot) -> None:
        with self._cond:
            if self._host is not None:
                self._host.index.abort(slot)
            self._cond.notify_all()

    def _host_commit(self, slot: Slot, *, promotion: bool, pending: "_Pending | None" = None) -> bool:
        """Make a written slot visible (or drop it if a newer version won). True if this write
        stands: committed, or a put ordered before a newer one."""
        idx = self._host.index
        digest, version = slot.digest, slot.version
        stale_nvme = None
        with self._cond:
            if pending is not None and pending.cancelled:  # deleted (or closed) while the copy ran
                idx.abort(slot)
                self._cond.notify_all()
                return True
            current = self._current.get(digest)
            superseded = (current is not None and current > version) if not promotion else current != version
            # a newer put written to NVMe whose bookkeeping has not run yet also supersedes this one
            rec = self._nvme.record(digest) if self._nvme is not None else None
            superseded = superseded or (rec is not None and rec.version > version)
            if superseded or (promotion and idx.lookup(digest) is not None):
                idx.abort(slot)
                self._cond.notify_all()
                return not promotion  # a newer put won the race: this put is ordered before it
            replaced = idx.commit(slot)
            if replaced is not None:
                self._cond.notify_all()
            self._gpu_drop_older_locked(digest, version)
            self._current[digest] = version
            if rec is not None and rec.version == version:
                slot.lower_copy = True
            elif rec is not None and (promotion or not self.config.nvme.write_through):
                stale_nvme = rec.version
                self._forget_nvme_locked(digest)
                self._nvme_busy += 1
            # with nvme.write_through a put's older NVMe record stays (it is the last durable
            # value) until the write-through replaces it in one LMDB transaction; _write_through
            # deletes it before put returns if that write does not land. It is never served
            # meanwhile: _current names the new version.
        if stale_nvme is not None:
            # the NVMe copy is an older version of this key: remove it before put returns, so a
            # restart never serves it
            self._nvme_delete_pending(digest, stale_nvme)
        return True

    def _evict(self, victims: list[Slot]) -> None:
        """Demote (or drop) host victims that this thread pinned, then remove them from the host.

        Every victim is removed and unpinned even if a demotion raises (the rest are then dropped
        without demotion), so an unexpected error never leaks pinned host blocks.
        """
        pending = list(victims)
        try:
            while pending:
                v = pending[0]
                try:
                    if self._nvme is not None and not v.lower_copy:
                        self._demote_one(v)
                finally:
                    pending.pop(0)
                    self._release_victim(v)
        finally:
            for v in pending:
                self._release_victim(v)

    def _release_victim(self, v: Slot) -> None:
        """Remove an evicted host slot (counted as a demotion if NVMe holds its version, else a drop)."""
        with self._cond:
            rec = self._nvme.record(v.digest) if self._nvme is not None else None
            demoted = v.lower_copy and rec is not None and rec.version == v.version
            if demoted:
                self._nvme_lru.touch(v.digest)
            self._counters["host"]["evictions"] += 1
            if demoted:
                self._counters["host"]["demotions"] += 1
            else:
                self._counters["host"]["drops"] += 1
                if self._current.get(v.digest) == v.version and not self._gpu_holds_locked(v.digest, v.version):
                    del self._current[v.digest]
            if self._host is not None:
                self._host.index.remove(v)
                self._host.index.unpin(v)
            self._cond.notify_all()

    def _flush_gpu(self) -> int:
        """Write GPU entries that no lower tier holds to NVMe; returns how many."""
        gpu = self._gpu
        if gpu is None or self._nvme is None:
            return 0
        with self._cond:
            dirty = [s for s in gpu.index.slots() if s.visible and not self._lower_holds_locked(s.digest, s.version)
                     and self._current.get(s.digest) == s.version]
            for s in dirty:
                gpu.index.pin(s)
        written = 0
        for s in dirty:
            try:
                if not self._nvme_fits(s.meta.nbytes):
                    continue
                buf = torch.empty(s.meta.nbytes, dtype=torch.uint8)
                h = gpu.read_into(s, buf)
                h.wait()
                if _copy_error(h, s) is None and self._nvme_store(s.digest, s.meta, s.version, buf, register=False):
                    written += 1
            except TierWriteError as exc:
                log.warning("flush of a GPU entry to NVMe failed: %s", exc)
            finally:
                self._gpu_unpin(s)
        return written

    def _demote_one(self, slot: Slot, *, write_through: bool = False) -> bool:
        """Write a pinned host slot to NVMe (a demotion, or a put's ``write_through``). True if
        NVMe now holds this version."""
        assert self._host is not None and self._nvme is not None
        if not self._nvme_fits(slot.meta.nbytes):
            self._count("nvme", skipped_too_large=1)
            return False
        view = self._host.contiguous_view(slot)
        if view is None:
            view = torch.empty(slot.meta.nbytes, dtype=torch.uint8)
            self._host.read_into(slot, view)
        try:
            ok = self._nvme_store(slot.digest, slot.meta, slot.version, view, register=False)
        except TierWriteError as exc:
            if write_through:
                log.warning("write-through of an entry to NVMe failed (%s); the entry stays in host "
                            "memory only (not durable)", exc)
            else:
                log.warning("demotion of an entry to NVMe failed (%s); entry dropped", exc)
            return False
        if ok:
            with self._cond:
                slot.lower_copy = True
        return ok

    def _write_through(self, digest: bytes, meta: EntryMeta, version: int) -> None:
        """Write the host entry ``version`` of ``digest`` (just committed by a put) to NVMe.

        Its write replaces the key's older NVMe record, if any, in one LMDB transaction (so a crash
        leaves the old record or the new one, never neither). On every path where that write does
        not land (write failure, disk full, too large for NVMe, the slot already evicted or
        replaced, an exception), the older record is deleted before this returns, so no bytes older
        than this put are ever served, in-process or after a restart.
        """
        assert self._host is not None
        try:
            with self._cond:
                slot = self._host.index.lookup(digest)
                if slot is None or slot.version != version:
                    return
                self._host.index.pin(slot)
            try:
                self._demote_one(slot, write_through=True)
            finally:
                self._unpin(slot)
        finally:
            self._drop_older_nvme(digest, version)

    def _drop_older_nvme(self, digest: bytes, version: int) -> None:
        """Delete the NVMe record of ``digest`` if it is older than ``version`` (a committed write)."""
        with self._cond:
            rec = self._nvme.record(digest) if self._nvme is not None else None
            if rec is None or rec.version >= version:
                return
            self._forget_nvme_locked(digest)
            self._nvme_busy += 1
        self._nvme_delete_pending(digest, rec.version)

    # ---------------------------------------------------------------------------- NVMe tier

    def _nvme_fits(self, nbytes: int) -> bool:
        # an upper bound of the stored size: raw payload + a generous header allowance
        return nbytes + 4096 + 2 * 65536 <= self.config.nvme.capacity_bytes

    def _forget_nvme_locked(self, digest: bytes) -> None:
        self._nvme_lru.remove(digest)

    def _trim_nvme_to_budget(self) -> None:
        assert self._nvme is not None
        over = self._nvme.used_bytes - self.config.nvme.capacity_bytes
        if over > 0:
            with self._cond:
                victims = self._nvme_lru.victims(over) or list(self._nvme_lru)
                doomed = self._drop_nvme_victims_locked(victims)
            for digest, version in doomed:
                self._nvme.delete(digest, only_version=version)

    def _drop_nvme_victims_locked(self, victims: list[bytes]) -> list[tuple[bytes, int]]:
        assert self._nvme is not None
        doomed = []
        for d in victims:
            self._nvme_lru.remove(d)
            rec = self._nvme.record(d)
            if rec is None:
                continue
            doomed.append((d, rec.version))
            self._counters["nvme"]["evictions"] += 1
            slot = self._host.index.lookup(d) if self._host is not None else None
            if slot is not None and slot.version == rec.version:
                slot.lower_copy = False  # the host copy is now the only one
            elif self._current.get(d) == rec.version and not self._gpu_holds_locked(d, rec.version):
                del self._current[d]
        return doomed

    def _nvme_store(self, digest: bytes, meta: EntryMeta, version: int, src: torch.Tensor, *, register: bool) -> bool:
        """Encode and write an entry to NVMe, evicting NVMe LRU victims to stay within budget.

        ``register`` makes the write the key's current version (a put that skipped the host);
        otherwise (a demotion/flush) NVMe is only a second copy of the current version.
        Returns True if NVMe now holds ``version`` as the key's current bytes.

        Raises:
            TierWriteError: the write failed (nothing changed).
        """
        nvme = self._nvme
        assert nvme is not None
        record = nvme.encode(meta, src, version)
        size = record.stored_bytes
        deadline = time.monotonic() + self.config.host.admit_wait_s
        with self._cond:
            promoting = self._promoting.get(threading.get_ident())
            while True:
                if not register and self._current.get(digest) != version:
                    return False  # deleted or replaced meanwhile: nothing to demote
                current = self._current.get(digest)
                if register and current is not None and current > version:
                    return False  # a newer put of this key won the race: this put is ordered before it
                # an older record of this key is replaced by this write: its bytes come back (unless
                # it is out of the LRU already: then a delete or another admission counts on them)
                old = nvme.record(digest)
                replaced = old.stored_bytes if (
                    old is not None and old.version < version and digest in self._nvme_lru) else 0
                need = nvme.used_bytes + self._nvme_reserved + size - replaced - self.config.nvme.capacity_bytes
                # skipped: this key, the entry this thread is promoting, keys with writes in flight,
                # and entries whose record a delete in flight already removed (they free nothing)
                victims = self._nvme_lru.victims(
                    need, protected=lambda d: d == digest or d == promoting or d in self._nvme_writing
                    or nvme.record(d) is None
                ) if need > 0 else []
                if victims is not None:
                    break
                remaining = deadline - time.monotonic()
                if (self._nvme_reserved > 0 or self._nvme_busy > 0) and remaining > 0:
                    # the budget is held by writes or deletes in flight: wait for them to finish
                    self._cond.wait(timeout=min(remaining, 0.05))
                    continue
                self._counters["nvme"]["skipped_too_large"] += 1
                if register:
                    raise TierWriteError("nvme tier: budget nvme.capacity_bytes is held by in-flight writes")
                return False
            doomed = self._drop_nvme_victims_locked(victims)
            self._nvme_reserved += size
            self._nvme_writing[digest] += 1
        try:
            for d, v in doomed:
                if nvme.delete(d, only_version=v):
                    self._after_nvme_delete(d, v)
            try:
                written = nvme.write(digest, record)
            except TierWriteError:
                self._count("nvme", write_failures=1)
                raise
        except BaseException:
            with self._cond:
                self._end_nvme_write_locked(digest, size)
            raise
        stale = None
        with self._cond:
            # the reservation ends only once the record is in the NVMe LRU (or marked stale), so
            # a concurrent admission never sees its bytes as used but unevictable
            self._end_nvme_write_locked(digest, size)
            current = self._current.get(digest)
            if written:
                self._counters["nvme"]["puts"] += 1
                self._counters["nvme"]["put_bytes"] += meta.nbytes
            rec = nvme.record(digest)
            ours = rec is not None and rec.version == version
            # register only while NVMe still holds this write (a delete after it leaves the key absent)
            if register and ours and (current is None or current < version):
                self._current[digest] = version
                current = version
                slot = self._host.index.lookup(digest) if self._host is not None else None
                if slot is not None and slot.version != version:
                    if self._host.index.remove(slot):
                        self._cond.notify_all()
                self._gpu_drop_older_locked(digest, version)
            if ours:
                if current == version:
                    self._nvme_lru.add(digest, rec.stored_bytes, self._cost_s.get(digest))
                    return True
                # a newer version was committed (or the key deleted) while this write ran: this
                # record is stale, and goes even with nvme.write_through (the newer put's own
                # write-through may already have finished its check for older records)
                stale = version
                self._nvme_busy += 1
                # our write replaced whatever record the LRU entry of this digest stood for
                self._forget_nvme_locked(digest)
        if stale is not None:
            self._nvme_delete_pending(digest, stale)
        return False

    def _end_nvme_write_locked(self, digest: bytes, size: int) -> None:
        self._nvme_reserved -= size
        self._nvme_writing[digest] -= 1
        if self._nvme_writing[digest] <= 0:
            del self._nvme_writing[digest]
        self._cond.notify_all()

    def _nvme_delete_pending(self, digest: bytes, version: int) -> None:
        """Delete an NVMe record that is no longer in the NVMe LRU (``_nvme_busy`` was raised for it)."""
        assert self._nvme is not None
        try:
            if self._nvme.delete(digest, only_version=version):
                self._after_nvme_delete(digest, version)
        finally:
            with self._cond:
                self._nvme_busy -= 1
                self._cond.notify_all()

    def _after_nvme_delete(self, digest: bytes, version: int) -> None:
        """Bookkeeping after NVMe record ``version`` was deleted outside the lock.

        A concurrent write may have registered that very record between the decision to delete
        it and the delete: then it must leave the NVMe LRU, and the key is gone unless the host
        holds that version.
        """
        with self._cond:
            if self._nvme is None or self._nvme.record(digest) is not None:
                return
            self._nvme_lru.remove(digest)
            if self._current.get(digest) == version:
                slot = self._host.index.lookup(digest) if self._host is not None else None
                if slot is not None and slot.version == version:
                    slot.lower_copy = False
                elif not self._gpu_holds_locked(digest, version):
                    del self._current[digest]

    def _nvme_read(self, digest: bytes, ns: str, key: str, version: int):
        nvme = self._nvme
        assert nvme is not None
        result = nvme.read(digest, ns, key)
        if result is None:
            self._count("nvme", read_failures=1)
            with self._cond:
                if self._current.get(digest) == version and (
                    self._host is None or self._host.index.lookup(digest) is None
                ) and not self._gpu_holds_locked(digest, version):
                    del self._current[digest]
                if nvme.record(digest) is None:  # a newer record written meanwhile stays evictable
                    self._nvme_lru.remove(digest)
            return None
        header, data = result
        if header.version != version:
            return _RETRY
        meta = EntryMeta(header.namespace, header.key, header.dtype, tuple(header.shape), header.raw_nbytes)
        return meta, data


_RETRY = object()
_MISS = object()


def _run_pairs(dst_buf: torch.Tensor, dst_runs, src_buf: torch.Tensor, src_runs) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Pair up two arenas' ``(arena_offset, entry_offset, length)`` runs of one entry (their block
    sizes may differ) into ``(dst, src)`` byte views of equal length covering the entry."""
    dr, sr = list(dst_runs), list(src_runs)
    pairs = []
    i = j = 0
    while i < len(dr) and j < len(sr):
        da, do, dn = dr[i]
        sa, so, sn = sr[j]
        lo, hi = max(do, so), min(do + dn, so + sn)
        if hi > lo:
            pairs.append((dst_buf[da + lo - do : da + hi - do], src_buf[sa + lo - so : sa + hi - so]))
        if do + dn <= so + sn:
            i += 1
        else:
            j += 1
    return pairs


class _Handle:
    """Shared mechanics of :class:`PutHandle` and :class:`LoadHandle` (a result set once)."""

    __slots__ = ("key", "error", "_ok", "_event")

    def __init__(self, key: str) -> None:
        self.key = key
        self.error: BaseException | None = None
        self._ok = False
        self._event = threading.Event()

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout_s: float | None = None) -> bool:
        if not self._event.wait(timeout_s):
            return False
        return self._ok

    def _finish(self, ok: bool, error: BaseException | None = None) -> None:
        self._ok = bool(ok)
        self.error = error
        self._event.set()


class PutHandle(_Handle):
    """Completion of one :meth:`TieredCache.put`.

    Attributes:
        key: the key put.
        error: the exception of a failed copy, else ``None``.

    ``done()`` is True once the put has finished (at once for CPU tensors). ``wait(timeout_s=None)``
    blocks until then and returns True if the entry was stored (also when a later put or delete of
    the same key has already replaced it: this put is ordered before that call), False if the copy
    failed, or if ``timeout_s`` passed first (``done()`` then still False). Once done, the source
    tensor is no longer referenced by the cache.
    """

    __slots__ = ()

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("stored" if self._ok else f"failed: {self.error!r}")
        return f"<PutHandle {self.key!r} {state}>"


class LoadHandle(_Handle):
    """Completion of one key of :meth:`TieredCache.prefetch`.

    ``wait(timeout_s=None)`` is True when the key is present and was promoted as far towards the
    asked device as room allowed (the GPU tier for ``device=gpu.device``, else the host tier; an
    entry that fits no higher tier stays where it is): a following ``get`` serves it from there.
    False on a miss (or a timeout: ``done()`` still False).
    ``error`` holds an unexpected exception of the promotion, if one happened.
    """

    __slots__ = ()

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("ready" if self._ok else "miss")
        return f"<LoadHandle {self.key!r} {state}>"


@dataclass(eq=False)
class _Pending:
    """A host write in flight (a put of a device tensor, or a GPU demotion)."""

    digest: bytes
    version: int
    handle: PutHandle
    cancelled: bool = False
    finished: bool = False


def _copy_error(h: CopyHandle, source: Slot | None = None) -> BaseException | None:
    """The error of copy ``h`` (complete), or of the write that filled ``source`` (a GPU slot read by
    ``h``): a slot whose write failed holds poison, never bytes to pass on."""
    if h.error is not None:
        return h.error
    w = source.pending_write if source is not None else None
    return w.error if isinstance(w, CopyHandle) else None


def dtype_name_of(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


@dataclass(frozen=True, eq=False)
class WriteLease:
    """A host-arena reservation from :meth:`TieredCache.reserve`.

    Fields: ``meta`` (:class:`~ectier.entry.EntryMeta`), ``extents``: ``(arena byte offset,
    length)`` runs whose concatenation is the entry's bytes in C order.
    """

    meta: EntryMeta
    extents: tuple[tuple[int, int], ...]
    _slot: Slot = field(repr=False)


@dataclass(frozen=True, eq=False)
class ReadLease:
    """A pinned host-arena entry from :meth:`TieredCache.acquire`; fields as :class:`WriteLease`."""

    meta: EntryMeta
    extents: tuple[tuple[int, int], ...]
    _slot: Slot = field(repr=False)
