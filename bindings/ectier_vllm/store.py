"""The two stores the connector talks to, behind one small interface.

- :class:`InProcessStore`: a :class:`~ectier.cache.TieredCache` shared by every connector of the
  process (vLLM 0.33 with the uniproc executor runs the scheduler and the worker in the same
  engine-core process: both connectors must see one store, and an NVMe directory can be opened
  once per process). :func:`open_inprocess` hands out reference-counted handles from a per-process
  registry keyed by the resolved config; the last ``close`` flushes and closes the cache.
  Pins taken by the scheduler (``acquire``) are handed to the worker through the same object
  (:meth:`InProcessStore.stage` / :meth:`take_staged`), so the worker copies exactly the bytes the
  scheduler verified, and nothing can evict or delete them in between.
- :class:`~ectier_vllm.daemon_store.DaemonStore` (its own module): a
  :class:`~ectier.daemon.client.DaemonClient` per connector; the scheduler
  pins a step's ready items in the step's one ``prefetch`` request, sent without waiting for the
  reply (process-held leases, released in one request once the worker reported the load); the
  worker reads a
  read-only zero-copy view of the daemon's arena (``DaemonClient.get_view``): from the pin its
  scheduler staged when both run in one process, else with a ``get`` of its own. For scheduler and
  workers in different processes (multiprocess executor, several engines on one node) too.

The in-process store speaks :class:`TieredCache`'s asynchronous API: ``put`` returns a
``PutHandle`` (a CUDA tensor is copied by the cache's copy engine: into the GPU tier when it is on
``gpu.device``, else device-to-host into the pinned host arena; the copy stream first waits for the
work already on the caller's current stream), ``prefetch(keys, device=)`` returns ``LoadHandle`` s.
The daemon client's ``put`` copies and commits before it returns ``None``, so
:attr:`DaemonStore.async_put` is False and the connector puts from a background thread
(:mod:`ectier_vllm.saves`, :meth:`DaemonStore.for_saves`). Its
``lookup`` returns handles of the same shape (``done()``, ``wait(timeout)``, ``error``) answered
by the daemon's batched ``prefetch`` op: the daemon promotes NVMe → its arena in its own threads,
and the store asks it about all of a scheduler step's items in **one request per step**, read when
its reply has arrived (:mod:`ectier_vllm.daemon_lookups`)
(:meth:`DaemonStore.new_step`, :meth:`DaemonStore.expect`); an answer, a miss included, holds for
the rest of the step. The scheduler never waits for the daemon: an item not answered yet waits
for a later step, and the ready ones come pinned in the same reply.
Errors are ectier's (``EctierError``); the connector turns them into misses.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from typing import Any

from ectier.config import CacheConfig

log = logging.getLogger("vllm.ectier." + __name__.rsplit(".", 1)[-1])  # (under vLLM's logger: common.py)


@dataclass(frozen=True)
class Pin:
    """An entry pinned for a coming load: its stored shape and dtype, and the store's lease.

    ``lease`` is a host-arena :class:`~ectier.cache.ReadLease` (in-process), a daemon lease id, or
    ``None`` for an entry held in the GPU tier: then ``tensor`` is the scheduler's own copy of it
    on the worker's device (read from the GPU tier, so nothing can evict or delete it before the
    load), handed to the worker as is.
    """

    shape: tuple[int, ...]
    dtype: str
    lease: Any
    tensor: Any = None
    #: for a CUDA ``tensor``: an event recorded on the scheduler's current stream right after the
    #: read that made it (:func:`ready_event`); the worker's stream waits on it (:func:`use_on_current_stream`)
    ready: Any = None


class _NotStored:
    __slots__ = ()

    def __repr__(self) -> str:
        return "NOT_STORED"


#: :meth:`InProcessStore.lookup` / ``DaemonStore.lookup``: the entry is not stored (a miss)
NOT_STORED = _NotStored()

#: opens every in-process cache (``None``: ``TieredCache(config)``); tests put
#: ``ectier.testing.make_cache`` with their copy engine here
_CACHE_FACTORY: Any = None


class InProcessStore:
    """A handle on a process-wide :class:`TieredCache` (see module docstring)."""

    mode = "inprocess"
    #: ``put`` returns a ``PutHandle`` and enqueues device copies on the cache's copy engine
    async_put = True

    def __init__(self, entry: "_Shared") -> None:
        self._entry = entry
        self.cache = entry.cache
        self._closed = False
        #: the cache has a remote tier: a local miss may still be found there (``contains`` is
        #: local only), so the scheduler's ``lookup`` asks ``prefetch``, which fetches it asynchronously
        self.remote = "remote" in self.cache.stats()["tiers"]
        config = self.cache.config
        #: only a host tier: whatever ``contains`` finds is in the host arena, nothing to promote
        self._host_only = not (self.remote or config.nvme.enabled or config.gpu.enabled)
        self._gpu = config.gpu.enabled

    # --------------------------------------------------------------------- index / pins
    def contains(self, key: str) -> bool:
        return self.cache.contains(key)

    def stored_now(self, keys: list[str]) -> dict[str, bool | None]:
        """Whether the cache stores each of ``keys`` (from memory, no I/O; the producer's save
        confirmation)."""
        return {key: self.cache.contains(key) for key in keys}

    def prefetch(self, keys: list[str], device: str) -> list[Any] | None:
        """``TieredCache.prefetch``: NVMe → host, and on into the GPU tier when ``device`` is its
        device. ``None`` for a cache of a host tier only: an entry it holds is in the host arena
        already, so the connector pins it at once (``acquire`` does no I/O there). One whose put
        is still in flight then is a miss (encoded again) instead of a wait: only an ``ec_both``
        engine can ask for an item its own worker is still saving, after vLLM dropped its copy."""
        if self._host_only:
            return None
        return list(self.cache.prefetch(keys, device=device))

    def lookup(self, key: str, device: str) -> Any:
        """The scheduler's one question about ``key``: :data:`NOT_STORED` (a miss: not in this
        cache, and no remote tier may hold it), ``None`` (pin at once: :meth:`prefetch`), or the
        handles of its promotion towards ``device`` (:meth:`prefetch`).

        Raises:
            InvalidKeyError: a bad ``key``. EctierError: the cache is closed.
        """
        if not self.cache.contains(key) and not self.remote:
            return NOT_STORED
        return self.prefetch([key], device)

    def new_step(self) -> None:  # lookups are from memory: nothing to batch
        return None

    def expect(self, keys: list[str]) -> None:
        return None

    def acquire(self, key: str, device: str) -> Pin | None:
        """Pin ``key`` for a load onto ``device`` (the worker's; with a GPU tier, its device:
        the connector checks ``gpu.device`` against the worker's at start-up). Never reads NVMe
        or the remote tier (the scheduler's thread calls it): an entry that left the host arena
        (and the GPU tier) since its promotion finished is ``None``, a miss.

        With a GPU tier, the GPU tier is read first, where :meth:`prefetch` promoted the entry
        (or the worker's own put left it): a copy read from it onto ``device`` (device-to-device,
        ready on the current stream), which the worker places as is; no host lease and no second
        host-to-device copy. Should the GPU tier not hold it (evicted meanwhile, larger than its
        budget), it is pinned in the host arena as without one: a host-arena lease, loaded by
        the worker straight onto its device on the copy engine (:meth:`get`).
        """
        if self._gpu and self.cache.prefetch([key], device=device)[0].done():
            # settled in the GPU tier (or stored nowhere): ``get`` reads no NVMe
            tensor = self.cache.get(key, device=device)
            if tensor is not None:
                from ectier.tensors import dtype_name

                return Pin(tuple(tensor.shape), dtype_name(tensor.dtype), None, tensor, ready_event(tensor))
        lease = self.cache.acquire(key, promote=False)  # the host arena only: no I/O
        return None if lease is None else Pin(tuple(lease.meta.shape), str(lease.meta.dtype), lease)

    def release(self, pin: Pin, staged_as: str | None = None) -> None:
        """End ``pin`` (``staged_as``: the key it was staged under, unstaged first)."""
        if staged_as is not None:
            self.unstage(staged_as)
        if pin.lease is not None:
            self.cache.release(pin.lease)

    def send_releases(self) -> None:  # release() released already
        return None

    def stage(self, key: str, pin: Pin) -> None:
        with self._entry.lock:
            self._entry.staged[key] = pin

    def unstage(self, key: str) -> None:
        with self._entry.lock:
            self._entry.staged.pop(key, None)

    def take_staged(self, key: str) -> Pin | None:
        with self._entry.lock:
            return self._entry.staged.get(key)

    # --------------------------------------------------------------------- data
    def put(self, key: str, tensor: Any) -> Any:
        """``TieredCache.put``: returns its ``PutHandle`` (done at once for a synchronous put)."""
        return self.cache.put(key, tensor)

    def for_saves(self) -> "InProcessStore":
        """The store a background save thread puts through: this one (``TieredCache`` is thread-safe)."""
        return self

    def get(self, key: str, device: str) -> Any:
        """Read ``key`` onto ``device``: from the scheduler's pin when there is one (same process)."""
        pin = self.take_staged(key)
        if pin is not None and pin.tensor is not None:
            # read from the GPU tier by the scheduler onto this device, ready on the scheduler's
            # stream: the worker's waits for it (they differ when the two run on other threads)
            use_on_current_stream(pin.tensor, pin.ready)
            return pin.tensor
        if pin is not None:
            # straight from the pinned host arena to the destination, on the copy engine (the
            # scheduler releases the pin once the worker has reported the load); None is the CPU
            # without parsing a device string
            return self.cache.load(pin.lease, device=None if device == "cpu" else device, view=True)
        return self.cache.get(key, device=device)

    def flush(self) -> None:
        self.cache.flush()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        _release(self._entry)


def ready_event(tensor: Any) -> Any:
    """For a CUDA ``tensor`` (a read ordered on the calling thread's current stream, docs/
    architecture.md, CUDA ordering rule 4): a ``torch.cuda.Event`` recorded on that stream now;
    ``None`` for any other device (nothing to order)."""
    if tensor.device.type != "cuda":
        return None
    import torch

    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(tensor.device))
    return event


def use_on_current_stream(tensor: Any, ready: Any) -> None:
    """Make the calling thread's current stream on ``tensor``'s device wait for ``ready`` (from
    :func:`ready_event`; ``None``: nothing to do), and ``record_stream`` it there, so that the
    caching allocator does not reuse ``tensor``'s memory before this stream's work on it ended.
    No host synchronisation."""
    if ready is None:
        return
    import torch

    stream = torch.cuda.current_stream(tensor.device)
    stream.wait_event(ready)
    tensor.record_stream(stream)


@dataclass
class _Shared:
    key: str
    cache: Any
    refs: int
    lock: threading.Lock
    staged: dict


_REGISTRY: dict[str, _Shared] = {}
_REGISTRY_LOCK = threading.Lock()


def open_inprocess(config: CacheConfig, before_create: Any = None) -> InProcessStore:
    """A handle on this process's :class:`TieredCache` for ``config`` (created on first use;
    ``before_create()`` runs first then, and may raise to refuse it)."""
    from ectier.cache import TieredCache

    key = json.dumps(config.to_dict(), sort_keys=True, default=str)
    with _REGISTRY_LOCK:
        entry = _REGISTRY.get(key)
        if entry is None:
            if before_create is not None:
                before_create()
            entry = _Shared(key=key, cache=(_CACHE_FACTORY or TieredCache)(config), refs=0, lock=threading.Lock(), staged={})
            _REGISTRY[key] = entry
        entry.refs += 1
    return InProcessStore(entry)


def _release(entry: _Shared) -> None:
    with _REGISTRY_LOCK:
        entry.refs -= 1
        if entry.refs > 0:
            return
        _REGISTRY.pop(entry.key, None)
    try:
        entry.cache.flush()
    finally:
        entry.cache.close()


def open_stores() -> int:
    """Number of in-process caches currently open in this process (for tests and diagnostics)."""
    with _REGISTRY_LOCK:
        return len(_REGISTRY)
