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
from dataclasses import dataclass, field
from typing import Any, Mapping

import torch

from .config import CacheConfig
from .entry import (
    EntryMeta,
    advance_version,
    dtype_itemsize,
    entry_digest,
    next_version,
    validate_key,
    validate_namespace,
)
from .errors import ConfigError, EctierError, EntryTooLargeError, InvalidTensorError, TierWriteError
from .index import Slot
from .policy import make_policy
from .tensors import byte_view, meta_for, parse_device, torch_dtype
from .tiers.host import HostTier
from .tiers.nvme import NvmeTier

__all__ = ["TieredCache", "WriteLease", "ReadLease"]

log = logging.getLogger(__name__)

_HOST_COUNTERS = ("hits", "hit_bytes", "puts", "put_bytes", "promotions", "evictions", "demotions",
                  "drops", "skipped_too_large", "admission_timeouts")
_NVME_COUNTERS = ("hits", "hit_bytes", "puts", "put_bytes", "evictions", "skipped_too_large",
                  "write_failures", "read_failures")


class TieredCache:
    """An in-process encoder cache keyed by ``mm_hash`` over a host tier and an NVMe tier.

    Args:
        config: :class:`~ectier.config.CacheConfig` (default: 1 GiB host arena, no NVMe tier), or a
            mapping (:meth:`CacheConfig.from_dict`) or a ``.json``/``.yaml`` path (:meth:`CacheConfig.load`).
        host_shm_path: put the host arena in this new file (e.g. under ``/dev/shm``) mapped shared,
            so that other processes can map it (the daemon does this); default: private memory.

    Thread-safe: any number of threads may call ``put``/``get``/``contains``/``delete`` at once.

    Raises:
        ConfigError: an invalid config, or a host arena that cannot be allocated.
        StoreOpenError, StoreLockedError: the NVMe directory cannot be opened / is in use.
    """

    def __init__(
        self, config: CacheConfig | Mapping[str, Any] | str | os.PathLike | None = None, *, host_shm_path: str | None = None
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
        self._host = (
            HostTier(self.config.host, shm_path=host_shm_path, policy=make_policy(self.config.host.policy))
            if self.config.host.capacity_bytes > 0
            else None
        )
        try:
            self._nvme = NvmeTier(self.config.nvme) if self.config.nvme.enabled else None
        except BaseException:
            if self._host is not None:
                self._host.close()  # removes a shared arena file (the daemon's): it would leak otherwise
            self._host = None
            raise
        self._counters: dict[str, Counter] = {"host": Counter(), "nvme": Counter(), "cache": Counter()}
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

    # ================================================================================ public API

    def put(
        self, key: str, tensor: torch.Tensor, *, namespace: str | None = None, cost_s: float | None = None
    ) -> None:
        """Store ``tensor`` under ``key`` (an ``mm_hash``), replacing any previous entry atomically.

        Any dtype torch has (bfloat16, float16, float32, int8, fp8, ...) and any shape, including
        zero-size tensors (stored and returned as such) and non-contiguous views (stored in C order).
        The entry goes to the host tier; if it is larger than the host budget it goes to NVMe.
        On return the bytes are owned by the cache: the caller may reuse ``tensor``.

        Args:
            key: non-empty ``str`` (up to 64 KiB of UTF-8).
            tensor: the encoder output, e.g. ``(N, 8192)`` bfloat16 for Qwen3-VL.
            namespace: override of ``config.namespace`` for this entry.
            cost_s: seconds recomputing this entry would cost (encoder time), for cost-aware
                eviction policies (``host.policy``/``nvme.policy`` = ``"gdsf"``); ignored by LRU.
                ``None``: unknown.

        Raises:
            ValueError: ``cost_s`` is negative or not finite.
            InvalidKeyError, InvalidTensorError: bad ``key``/``namespace``/``tensor``.
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
        with self._cond:
            if cost_s is None:
                self._cost_s.pop(digest, None)
            else:
                self._cost_s[digest] = float(cost_s)
                if len(self._cost_s) > 2 * len(self._current) + 1024:  # forget keys no longer stored
                    self._cost_s = {d: c for d, c in self._cost_s.items() if d in self._current or d == digest}
        version = next_version()
        src = byte_view(tensor)
        host_ok = self._host is not None and self._host.index.fits(meta.nbytes)
        nvme_ok = self._nvme is not None and self._nvme_fits(meta.nbytes)
        if not host_ok and not nvme_ok:
            raise EntryTooLargeError(self._too_large_text(meta.nbytes))
        if self._host is not None and not host_ok:
            self._count("host", skipped_too_large=1)
        if host_ok:
            stored = self._host_store(digest, meta, version, src, promotion=False)
            if stored:
                self._count("host", puts=1, put_bytes=meta.nbytes)
                if self._nvme is not None and self.config.nvme.write_through:
                    self._write_through(digest, meta, version)
                return
            if self._nvme is None:
                raise TierWriteError(
                    "host tier: no room could be made (entries pinned by readers for longer than "
                    "host.admit_wait_s) and no NVMe tier is configured; raise host.capacity_bytes"
                )
        if not nvme_ok:
            raise EntryTooLargeError(self._too_large_text(meta.nbytes))
        self._nvme_store(digest, meta, version, src if src.device.type == "cpu" else src.cpu(), register=True)

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
        is promoted to the host tier. A record that fails its checksum is quarantined and read as a
        miss (counted in ``stats()["tiers"]["nvme"]["checksum_failures"]``).

        Args:
            key: the ``mm_hash``.
            device: ``None``/``"cpu"`` (default) or an explicit ``"cuda:<index>"``.
            namespace: override of ``config.namespace``.
            out: a contiguous CPU tensor to copy into (saves allocating fresh memory on every hit);
                on a hit whose shape and dtype match, ``out`` itself is returned. A hit of another
                shape or dtype raises ``InvalidTensorError`` and leaves ``out`` untouched.

        Raises:
            InvalidKeyError: bad ``key``/``namespace``. InvalidDeviceError: bad ``device``.
            InvalidTensorError: ``out`` is not contiguous, not on the CPU, or does not match the entry.
            EctierError: the cache is closed.
        """
        ns, key = self._identity(key, namespace)
        dev = parse_device(device)
        self._check_open()
        digest = entry_digest(ns, key)
        for _ in range(3):  # a concurrent overwrite between lookup and read → look again
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
                        self._counters["cache"]["misses"] += 1
                        return None
                    nvme_version = v
                    self._nvme_lru.touch(digest)
            if slot is not None:
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
        """True if ``key`` is stored in some tier (answered from memory, no I/O).

        Raises:
            InvalidKeyError: bad ``key``/``namespace``. EctierError: the cache is closed.
        """
        ns, key = self._identity(key, namespace)
        self._check_open()
        with self._cond:
            return entry_digest(ns, key) in self._current

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

            {"namespace", "entries", "hits", "misses",
             "tiers": {"host": {capacity_bytes, used_bytes, entries, pinned, hits, hit_bytes, puts,
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
                "tiers": {},
            }
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
        """Write every host entry that NVMe does not hold yet to NVMe (host copies stay).

        Returns the number of entries written. A no-op without an NVMe tier. Used by ``close()``
        when ``nvme.flush_on_close`` so that a restart serves what was in host memory.

        Raises:
            EctierError: the cache is closed.
        """
        self._check_open()
        if self._host is None or self._nvme is None:
            return 0
        with self._cond:
            dirty = [s for s in self._host.index.slots() if not s.lower_copy and s.visible]
            for s in dirty:
                self._host.index.pin(s)
        written = 0
        for s in dirty:
            try:
                if self._demote_one(s):
                    written += 1
            finally:
                self._unpin(s)
        return written

    def close(self) -> None:
        """Flush (if ``nvme.flush_on_close``), close the NVMe tier and free the host arena. Idempotent.

        After ``close`` every operation raises :class:`~ectier.errors.EctierError`.
        """
        if self._closed:
            return
        try:
            if self.config.nvme.flush_on_close:
                try:
                    self.flush()
                except EctierError as exc:
                    log.error("close: flush to NVMe failed: %s", exc)
        finally:
            self._closed = True
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

    def _host_commit(self, slot: Slot, *, promotion: bool) -> bool:
        """Make a written slot visible (or drop it if a newer version won). True if this write
        stands: committed, or a put ordered before a newer one."""
        idx = self._host.index
        digest, version = slot.digest, slot.version
        stale_nvme = None
        with self._cond:
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
            self._current[digest] = version
            if rec is not None and rec.version == version:
                slot.lower_copy = True
            elif rec is not None:
                stale_nvme = rec.version
                self._forget_nvme_locked(digest)
                self._nvme_busy += 1
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
                if self._current.get(v.digest) == v.version:
                    del self._current[v.digest]
            if self._host is not None:
                self._host.index.remove(v)
                self._host.index.unpin(v)
            self._cond.notify_all()

    def _demote_one(self, slot: Slot) -> bool:
        """Write a pinned host slot to NVMe. True if NVMe now holds this version."""
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
            log.warning("demotion of an entry to NVMe failed (%s); entry dropped", exc)
            return False
        if ok:
            with self._cond:
                slot.lower_copy = True
        return ok

    def _write_through(self, digest: bytes, meta: EntryMeta, version: int) -> None:
        assert self._host is not None
        with self._cond:
            slot = self._host.index.lookup(digest)
            if slot is None or slot.version != version:
                return
            self._host.index.pin(slot)
        try:
            self._demote_one(slot)
        finally:
            self._unpin(slot)

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
            elif self._current.get(d) == rec.version:
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
            if ours:
                if current == version:
                    self._nvme_lru.add(digest, rec.stored_bytes, self._cost_s.get(digest))
                    return True
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
                else:
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
                ):
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
