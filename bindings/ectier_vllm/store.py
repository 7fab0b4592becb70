"""The two stores the connector talks to, behind one small interface.

- :class:`InProcessStore`: a :class:`~ectier.cache.TieredCache` shared by every connector of the
  process (vLLM 0.33 with the uniproc executor runs the scheduler and the worker in the same
  engine-core process: both connectors must see one store, and an NVMe directory can be opened
  once per process). :func:`open_inprocess` hands out reference-counted handles from a per-process
  registry keyed by the resolved config; the last ``close`` flushes and closes the cache.
  Pins taken by the scheduler (``acquire``) are handed to the worker through the same object
  (:meth:`InProcessStore.stage` / :meth:`take_staged`), so the worker copies exactly the bytes the
  scheduler verified, and nothing can evict or delete them in between.
- :class:`DaemonStore`: a :class:`~ectier.daemon.client.DaemonClient` per connector; the scheduler
  pins with a daemon ``get`` lease (released when the worker reports the load), the worker reads
  with its own ``get``. For scheduler and workers in different processes (multiprocess executor,
  several engines on one node).

The in-process store speaks :class:`TieredCache`'s asynchronous API: ``put`` returns a
``PutHandle`` (a CUDA tensor is copied by the cache's copy engine: into the GPU tier when it is on
``gpu.device``, else device-to-host into the pinned host arena; the copy stream first waits for the
work already on the caller's current stream), ``prefetch(keys, device=)`` returns ``LoadHandle`` s.
The daemon client has neither: its ``put`` copies to the CPU inline and returns ``None``, and it
has no ``prefetch`` (a daemon ``get`` lease promotes NVMe → host synchronously), so
:attr:`DaemonStore.async_put` is False and the connector stages device tensors itself.
Errors are ectier's (``EctierError``); the connector turns them into misses.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass
from typing import Any

from ectier.config import CacheConfig

log = logging.getLogger(__name__)

#: longest a daemon-mode call waits for a daemon that went away (a restart) before it is a miss;
#: bounded further by the connector's ``daemon_timeout_s``
DAEMON_CONNECT_RETRY_S = 5.0
#: after a failed connection attempt, calls are misses at once (no attempt) for this long
DAEMON_BACKOFF_S = 1.0

# socket paths this process has already warned about (one warning, not one per connector)
_WARNED_UNREACHABLE: set[str] = set()


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

    # --------------------------------------------------------------------- index / pins
    def contains(self, key: str) -> bool:
        return self.cache.contains(key)

    def prefetch(self, keys: list[str], device: str) -> list[Any]:
        """``TieredCache.prefetch``: NVMe → host, and on into the GPU tier when ``device`` is its device."""
        return list(self.cache.prefetch(keys, device=device))

    def acquire(self, key: str, device: str) -> Pin | None:
        """Pin ``key`` for a load onto ``device``: a host-arena lease, or, for an entry that only
        the GPU tier holds (put there by this process's worker and not yet demoted), a copy read
        from the GPU tier onto ``device`` (a device-to-device copy ready on the current stream)."""
        lease = self.cache.acquire(key)
        if lease is not None:
            return Pin(tuple(lease.meta.shape), str(lease.meta.dtype), lease)
        if not self.cache.config.gpu.enabled or not self.cache.contains(key):
            return None
        tensor = self.cache.get(key, device=device)
        if tensor is None:
            return None
        from ectier.tensors import dtype_name

        return Pin(tuple(tensor.shape), dtype_name(tensor.dtype), None, tensor)

    def release(self, pin: Pin) -> None:
        if pin.lease is not None:
            self.cache.release(pin.lease)

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

    def get(self, key: str, device: str) -> Any:
        """Read ``key`` onto ``device``: from the scheduler's pin when there is one (same process)."""
        pin = self.take_staged(key)
        if pin is not None and pin.tensor is not None:
            return pin.tensor  # read from the GPU tier by the scheduler onto this device
        if pin is not None:
            # straight from the pinned host arena to the destination, on the copy engine (the
            # scheduler releases the pin once the worker has reported the load)
            return self.cache.load(pin.lease, device=device)
        return self.cache.get(key, device=device)

    def flush(self) -> None:
        self.cache.flush()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        _release(self._entry)


class DaemonStore:
    """A :class:`DaemonClient` of one connector, with the namespace on every call."""

    mode = "daemon"
    #: ``DaemonClient.put`` copies a device tensor to the CPU inline and returns ``None``
    async_put = False

    def __init__(self, socket_path: str | None, namespace: str, timeout_s: float) -> None:
        from ectier.daemon.client import DaemonClient, DaemonUnavailableError

        # the connector's daemon_timeout_s bounds every wait of a call, the reconnect wait too;
        # a client whose daemon is unreachable fails fast (DAEMON_BACKOFF_S) so calls are misses
        self.client = DaemonClient(socket_path, timeout_s=timeout_s,
                                   connect_retry_s=min(DAEMON_CONNECT_RETRY_S, timeout_s),
                                   backoff_s=DAEMON_BACKOFF_S)
        self.namespace = namespace
        # one connection attempt now, no wait: an unreachable daemon is reported loudly here, not
        # discovered as slow misses later; never fatal (the daemon may start after the engine)
        try:
            self.client.connect(wait=False)
        except DaemonUnavailableError as exc:
            path = self.client.socket_path
            if path not in _WARNED_UNREACHABLE:
                _WARNED_UNREACHABLE.add(path)
                log.warning(
                    "ectier: the daemon is UNREACHABLE at ec_connector_extra_config.socket_path=%r (%s). "
                    "Encoder outputs will be neither saved nor loaded (every lookup is a miss) until "
                    "`ectier serve` listens there; check that the daemon runs and that socket_path "
                    "matches its daemon.socket_path.", path, exc)
        except Exception as exc:  # a refusal (max_clients, group) or protocol trouble: calls report it
            log.warning("ectier: connecting to the daemon at ec_connector_extra_config.socket_path=%r "
                        "failed: %s", self.client.socket_path, exc)

    def contains(self, key: str) -> bool:
        return self.client.contains(key, namespace=self.namespace)

    def prefetch(self, keys: list[str], device: str) -> None:
        """The daemon has no prefetch: ``None`` (the connector pins at once; the daemon's ``get``
        lease promotes an NVMe hit to its host arena synchronously)."""
        return None

    def acquire(self, key: str, device: str) -> Pin | None:
        reply = self.client.call("get", key=key, namespace=self.namespace)
        if not reply.get("hit"):
            return None
        return Pin(tuple(reply["shape"]), str(reply["dtype"]), reply["lease"])

    def release(self, pin: Pin) -> None:
        self.client.call("release", retry=False, lease=pin.lease)

    def stage(self, key: str, pin: Pin) -> None:  # the worker is another client: nothing to share
        return None

    def unstage(self, key: str) -> None:
        return None

    def put(self, key: str, tensor: Any) -> Any:
        return self.client.put(key, tensor, namespace=self.namespace)

    def get(self, key: str, device: str) -> Any:
        return self.client.get(key, namespace=self.namespace, device=None if device == "cpu" else device)

    def flush(self) -> None:
        return None  # the daemon flushes on its own shutdown

    def close(self) -> None:
        self.client.close()


# ------------------------------------------------------------------ per-process registry


@dataclass
class _Shared:
    key: str
    cache: Any
    refs: int
    lock: threading.Lock
    staged: dict


_REGISTRY: dict[str, _Shared] = {}
_REGISTRY_LOCK = threading.Lock()


def open_inprocess(config: CacheConfig) -> InProcessStore:
    """A handle on this process's :class:`TieredCache` for ``config`` (created on first use)."""
    from ectier.cache import TieredCache

    key = json.dumps(config.to_dict(), sort_keys=True, default=str)
    with _REGISTRY_LOCK:
        entry = _REGISTRY.get(key)
        if entry is None:
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
