"""What tests use instead of private state: a deferred copy engine, a CPU stand-in for the GPU
tier, views of where an entry lives, fault injection, and an invariant checker.

Everything here goes through the tiers' own methods; nothing in ``tests/`` reads ``cache._*``.
Not for production: these helpers make in-flight states reproducible and look inside tiers.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator, NamedTuple

import torch

from .cache import TieredCache
from .copy import CopyEngine, CopyHandle, Engines, InlineCopyEngine, Pairs
from .entry import entry_digest
from .tiers.arena import ArenaTier
from .tiers.base import Tier
from .testing_order import SyncOrderCheck, check_sync_order
from .testing_remote import MemoryBackend, versions_from_another_clock

__all__ = ["MemoryBackend", "DeferredCopyEngine", "make_cache", "tier", "where", "holds", "version_of", "versions", "drop_copy", "record_of",
           "pins", "drain", "check_invariants", "fail_writes", "fail_after_writes", "watch_nvme_records", "lmdb_of", "set_lmdb_env", "NvmeLmdb", "copy_engine_of",
           "write_behind_idle", "write_behind_enabled", "hold_writes", "WriteGate", "WRITE_BEHIND_THREAD",
           "versions_from_another_clock", "check_sync_order", "SyncOrderCheck"]


class DeferredCopyEngine(CopyEngine):
    """For tests: copies wait until :meth:`complete`; they then run in submission order.

    Attributes:
        submitted: number of batches enqueued so far.
        fail_with: when set, the next batch run by :meth:`complete` fails with this exception
            (its destination is filled with ``poison`` instead), then ``fail_with`` clears.
        poison: byte written into a failed batch's destinations (default 0xA5).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[tuple[Pairs, CopyHandle]] = []
        self.submitted = 0
        self.fail_with: BaseException | None = None
        self.poison = 0xA5

    def copy(self, pairs: Pairs, *, lane: str) -> CopyHandle:
        self._check(pairs, lane)
        handle = CopyHandle(list(pairs))
        with self._lock:
            self._pending.append((list(pairs), handle))
            self.submitted += 1
        return handle

    @property
    def pending(self) -> int:
        """Batches enqueued and not yet run."""
        with self._lock:
            return len(self._pending)

    def complete(self, n: int | None = None) -> int:
        """Run the ``n`` oldest pending batches (all when ``None``); returns how many ran."""
        ran = 0
        while n is None or ran < n:
            with self._lock:
                if not self._pending:
                    break
                pairs, handle = self._pending.pop(0)
                fail, self.fail_with = self.fail_with, None
            if fail is not None:
                for dst, _ in pairs:
                    dst.fill_(self.poison)
                handle._finish(fail)
            else:
                for dst, src in pairs:
                    dst.copy_(src)
                handle._finish()
            ran += 1
        return ran


def make_cache(config: Any = None, *, copy_engine: CopyEngine | None = None, gpu_device: str | None = None,
               host_shm_path: str | None = None, remote_backend: Any = None) -> TieredCache:
    """A :class:`TieredCache` whose copies all go through ``copy_engine`` (CPU tensors then take
    the asynchronous path too); with ``gpu_device="cpu"`` the GPU tier's arena lives in CPU memory,
    so all GPU-tier logic runs without CUDA (``copy_engine`` defaults to an inline engine then).
    ``remote_backend`` (e.g. :class:`MemoryBackend`) gives the cache a remote tier on it.

    Raises:
        ConfigError: as :class:`TieredCache`.
    """
    if gpu_device is not None and copy_engine is None:
        copy_engine = InlineCopyEngine()
    cache = TieredCache.__new__(TieredCache)
    cache._open(config, host_shm_path, Engines(copy_engine, gpu_device), remote_backend)
    return cache


def tier(cache: TieredCache, name: str) -> Tier | None:
    """The cache's tier named ``name`` (``"gpu"``, ``"host"``, ``"nvme"``), ``None`` if not configured."""
    return cache._stack.get(name)


def copy_engine_of(cache: TieredCache, device: str | torch.device) -> CopyEngine | None:
    """The copy engine the cache uses for ``device``."""
    return cache._engine_for(torch.device(device))


def _digest(cache: TieredCache, key: str, namespace: str | None) -> bytes:
    return entry_digest(cache.config.namespace if namespace is None else namespace, key)


def where(cache: TieredCache, key: str, namespace: str | None = None) -> set[str]:
    """Names of the tiers holding some visible copy of ``key`` (any version)."""
    d = _digest(cache, key, namespace)
    with cache._cond:
        return {t.name for t in cache._stack if t.stored_version(d) is not None}


def holds(cache: TieredCache, tier_name: str, key: str, namespace: str | None = None) -> bool:
    """Whether tier ``tier_name`` holds a visible copy of ``key``."""
    return tier_name in where(cache, key, namespace)


def version_of(cache: TieredCache, key: str, namespace: str | None = None) -> int | None:
    """The key's current write version (``None``: not stored)."""
    with cache._cond:
        return cache._catalog.version(_digest(cache, key, namespace))


def versions(cache: TieredCache) -> dict[bytes, int]:
    """Digest -> current write version of every stored key (a snapshot)."""
    with cache._cond:
        return dict(cache._catalog.items())


def record_of(cache: TieredCache, key: str, namespace: str | None = None):
    """The NVMe tier's in-memory record of ``key`` (``.header``, ``.version``, ``.stored_bytes``) or ``None``."""
    nvme = cache._stack.get("nvme")
    return nvme.record(_digest(cache, key, namespace)) if nvme is not None else None


def drop_copy(cache: TieredCache, tier_name: str, key: str, namespace: str | None = None) -> bool:
    """Remove ``key``'s copy from memory tier ``tier_name`` as an eviction that could not demote
    would (the key is forgotten unless another tier holds it). True if a copy was there."""
    t = cache._stack.get(tier_name)
    d = _digest(cache, key, namespace)
    with cache._cond:
        s = t.lookup(d)
        if s is None:
            return False
        t.remove(s)
        cache._mover.forget_if_unheld_locked(d, s.version)
        cache._cond.notify_all()
        return True


def pins(cache: TieredCache, tier_name: str = "host", *, settle_s: float = 10.0) -> int:
    """Pins held on the tier's slots (readers, leases, demoters) once the host tier's write-behind
    has finished its write in flight (its pin is transient; waits at most ``settle_s`` seconds)."""
    write_behind_idle(cache, settle_s)
    t = cache._stack.get(tier_name)
    with cache._cond:
        return t.total_pins() if isinstance(t, ArenaTier) else 0


def drain(cache: TieredCache, timeout_s: float | None = 10.0) -> bool:
    """Wait until every copy completion and prefetch in flight has run; False on timeout."""
    ok = cache._reads.quiesce(timeout_s)
    ok = write_behind_idle(cache, timeout_s) and ok
    if cache._mover.remote is not None:
        ok = cache._mover.remote.drain(timeout_s) and ok
    return ok


def write_behind_idle(cache: TieredCache, timeout_s: float | None = 10.0) -> bool:
    """Wait until the host tier's write-behind has no write in flight and no round pending (True
    at once without one); False on timeout (seconds)."""
    wb = cache._mover.write_behind
    return True if wb is None else wb.wait_idle(timeout_s)


def write_behind_enabled(cache: TieredCache) -> bool:
    """Whether the cache runs a write-behind of host entries to NVMe (``host.write_behind_fraction``)."""
    return cache._mover.write_behind is not None


@contextlib.contextmanager
def fail_writes(cache: TieredCache, tier_name: str, exc: BaseException) -> Iterator[list]:
    """Make every write into tier ``tier_name`` raise ``exc`` while the context is open (fault
    injection from outside the tier's library, e.g. ``OSError(EIO)``). Yields the list of calls."""
    t = cache._stack.get(tier_name)
    calls: list = []

    def failing(*args, **kw):
        calls.append(args)
        raise exc

    t.write = failing
    try:
        yield calls
    finally:
        del t.write


@contextlib.contextmanager
def fail_after_writes(cache: TieredCache, tier_name: str, exc: BaseException) -> Iterator[list]:
    """Make every write into tier ``tier_name`` raise ``exc`` *after* it has stored its record (an
    error reported once the write's work is done, e.g. by the clean-up after an NVMe commit).
    Yields the list of the real writes' results."""
    t = cache._stack.get(tier_name)
    real = t.write
    results: list = []

    def failing(*args, **kw):
        results.append(real(*args, **kw))
        raise exc

    t.write = failing
    try:
        yield results
    finally:
        del t.write


#: the name of the write-behind's thread (``hold_writes(thread_name=)``)
WRITE_BEHIND_THREAD = "ectier-write-behind"


class WriteGate:
    """The writes held by :func:`hold_writes`, one at a time, in order.

    ``wait_held(n)``: until the ``n``-th write (counted from the first) is held. ``release(n)``:
    let ``n`` more writes go on. ``open()``: let every write go on from now (done at the end of
    the context)."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._held = 0  # writes that reached the gate
        self._allowed = 0  # writes let go
        self._open = False

    def hold(self) -> None:
        with self._cv:
            self._held += 1
            me = self._held
            self._cv.notify_all()
            while not self._open and self._allowed < me:
                self._cv.wait()

    def wait_held(self, n: int = 1, timeout_s: float = 10.0) -> bool:
        """Wait until ``n`` writes have reached the gate; False on timeout (seconds)."""
        with self._cv:
            return self._cv.wait_for(lambda: self._held >= n, timeout_s)

    def release(self, n: int = 1) -> None:
        with self._cv:
            self._allowed += n
            self._cv.notify_all()

    def open(self) -> None:
        with self._cv:
            self._open = True
            self._cv.notify_all()


@contextlib.contextmanager
def hold_writes(cache: TieredCache, tier_name: str, *, thread_name: str | None = None,
                after: bool = False) -> Iterator[WriteGate]:
    """Hold every write into tier ``tier_name`` (from the thread named ``thread_name``, when
    given; other writes pass) at the yielded gate: before the write starts, or with ``after`` once
    it has stored its record. The gate opens when the context ends."""
    t = cache._stack.get(tier_name)
    real = t.write
    gate = WriteGate()

    def held(*args, **kw):
        if thread_name is not None and threading.current_thread().name != thread_name:
            return real(*args, **kw)
        if not after:
            gate.hold()
            return real(*args, **kw)
        try:
            return real(*args, **kw)
        finally:
            gate.hold()

    t.write = held
    try:
        yield gate
    finally:
        gate.open()
        del t.write


class _WatchedRecords(dict):
    """The NVMe index's record table, calling ``fn(digest)`` after each change of it."""

    def __init__(self, data: dict, fn) -> None:
        super().__init__(data)
        self._fn = fn

    def pop(self, key, *default):
        got = super().pop(key, *default)
        self._fn(key)
        return got

    def __setitem__(self, key, value) -> None:
        super().__setitem__(key, value)
        self._fn(key)

    def __delitem__(self, key) -> None:
        super().__delitem__(key)
        self._fn(key)


@contextlib.contextmanager
def watch_nvme_records(cache: TieredCache, fn) -> Iterator[None]:
    """Call ``fn(digest)`` after every change of the NVMe tier's in-memory record table while the
    context is open (from the thread making the change, its lock held: ``fn`` may look records up,
    e.g. :func:`record_of`, but must not write). Install it on an idle cache."""
    index = cache._stack.get("nvme").index
    index._records = _WatchedRecords(index._records, fn)
    try:
        yield
    finally:
        index._records = dict(index._records)


class NvmeLmdb(NamedTuple):
    """The NVMe tier's LMDB environment and its ``meta`` and ``data`` databases."""

    env: Any
    meta: Any
    data: Any


def lmdb_of(target: "TieredCache | Tier") -> NvmeLmdb:
    """The LMDB handles of a cache's (or an NVMe tier's) store, for fault injection in tests."""
    nvme = target._stack.get("nvme") if isinstance(target, TieredCache) else target
    return NvmeLmdb(nvme._env, nvme._meta, nvme._data)


def set_lmdb_env(target: "TieredCache | Tier", env: Any) -> None:
    """Make the NVMe tier use ``env`` (a wrapper of its own environment that injects delays,
    failures or crash points at the LMDB boundary)."""
    nvme = target._stack.get("nvme") if isinstance(target, TieredCache) else target
    nvme._env = env


def check_invariants(cache: TieredCache) -> None:
    """Internal consistency of an idle cache (no copy in flight), raising AssertionError:

    no pins or reservations; each memory tier's bytes add up and stay within budget; every memory
    copy is its key's current version; the NVMe records in memory equal what LMDB holds and are
    all current and tracked by the NVMe policy; no write-through registered; every key of the
    catalog is held by some tier.
    """
    assert write_behind_idle(cache), "the write-behind did not settle within 10 s"
    with cache._cond:
        cat = cache._catalog
        assert cat.pending_count() == 0, "copies still in flight"
        current = dict(cat.items())
        for t in cache._stack.arenas():
            slots = t.slots()
            assert t.index.reserved_bytes == 0, f"{t.name}: reservations left"
            assert all(s.pins == 0 for s in slots), f"{t.name}: pins left"
            assert t.used_bytes == sum(s.alloc_bytes for s in slots), f"{t.name}: bytes do not add up"
            assert t.used_bytes <= t.capacity_bytes
            for s in slots:
                assert current.get(s.digest) == s.version, f"stale {t.name} entry left behind"
        nvme = cache._stack.get("nvme")
        if nvme is not None:
            recs = dict(nvme.records())
            assert nvme.used_bytes == sum(r.stored_bytes for r in recs.values())
            assert nvme.used_bytes <= nvme.capacity_bytes
            meta_keys, data_keys = nvme.stored_keys()
            assert meta_keys == set(recs), "NVMe records in memory differ from LMDB"
            assert data_keys == meta_keys
            assert set(nvme.index) == set(recs), "NVMe policy differs from the NVMe records"
            assert nvme.index.quiet(), "NVMe writes or deletes left in flight"
            assert not cache._mover.nvme._through, "write-throughs left registered (a later one would wait on them)"
            for d, rec in recs.items():
                assert current.get(d) == rec.version, "stale NVMe record left behind"
        for d, v in current.items():
            assert cache._stack.holds(d, v), "a key of the catalog is held by no tier"
