"""Zero-copy reads of the daemon's arena: read-only views whose pin lives as long as the view.

A :meth:`~ectier.daemon.client.DaemonClient.get_view` takes a *process-held* lease
(:mod:`ectier.daemon.holders`: no deadline, survives the connection) and returns a CPU tensor
over the leased bytes of the arena, mapped **read-only** in this process (:class:`ArenaView`;
a write through the view faults instead of changing an entry every client shares). The view is
made with :func:`ectier.moves.views.pinned_view`, so its pin ends when its storage is freed (the
last view, slice or reshape of it gone) and never earlier.

Releases never block: the storage's finalizer only queues ``(daemon run, lease id)`` on a
:class:`queue.SimpleQueue` (safe in finalizers and in any thread); one background thread per
process and socket (:class:`ViewReleaser`, started with the first view) sends the queued ids in
batches (``release`` with ``leases``) over a connection of its own, so it never waits on the
model step's client lock and the model step never waits on it. A release that cannot be sent
(daemon hung or away) is retried every :data:`RETRY_S`; one for an earlier daemon run (the
daemon restarted: its pins went with it) is dropped: the request names the run (``instance``)
and the daemon ignores ids of another. In a child of ``fork()`` the inherited views release
nothing (their pins are the parent's).

Imports torch and numpy only when a view is made.
"""

from __future__ import annotations

import logging
import mmap
import os
import queue
import threading
import time
import warnings
from typing import Any

from ..tiers.populate import MADV_POPULATE_READ, populate_mapping_later

__all__ = ["ArenaView", "ViewCalls", "ViewReleaser", "releaser_for"]

log = logging.getLogger(__name__)

#: seconds between attempts to send releases the daemon did not take (unreachable)
RETRY_S = 1.0
#: seconds the releaser waits after the first queued release before it sends; 0: it sends what
#: is queued when it wakes (a 2 ms wait measured slower on the 2-core machine: the waiting
#: thread then competes for the GIL during the next lookup instead of the model step)
GATHER_S = 0.0
#: most lease ids one ``release`` carries (the protocol's batch cap)
BATCH = 1024


class ArenaView:
    """This process's read-only mapping of one daemon run's arena (``path``, ``nbytes``).

    ``instance``: the daemon run (``hello``'s ``instance``) whose arena it is. The mapping stays
    alive while any view over it does, even after the client maps a newer run's arena.
    """

    def __init__(self, path: str, nbytes: int, instance: str) -> None:
        import numpy as np
        import torch

        fd = os.open(path, os.O_RDONLY)
        try:
            self._mmap = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        self.instance = instance
        self._array = np.frombuffer(self._mmap, dtype=np.uint8)
        with warnings.catch_warnings():  # torch warns that numpy's array is not writable: it is not
            warnings.simplefilter("ignore")
            self.tensor = torch.from_numpy(self._array)
        self._registered: bool | None = None  # page-locked? (None: not tried; page_locked)
        self._register_lock = threading.Lock()
        if hasattr(self._mmap, "madvise"):
            # the whole mapping once, off the load path: populating a range when a view of it is
            # made cost more than its page faults (64 MiB of /dev/shm: 10.6 ms + 10.3 ms copy vs
            # 13.5 ms faulting; 10.5 ms once populated) — docs/benchmarks.md, daemon views
            populate_mapping_later(self._mmap, chunk_bytes=32 << 20, advice=MADV_POPULATE_READ)

    def page_locked(self, device) -> bool:
        """Whether the mapping is page-locked for copies onto CUDA ``device``. The first ask starts
        its registration (read-only, under ``device``) in a background thread and answers False
        until it is done (~0.45 s per GiB: never inside a model step; copies meanwhile are from
        pageable memory); it is unregistered, under that device, when the last tensor over the
        mapping is freed, before the mapping goes. A refusal only costs speed (ectier/pinning.py)."""
        with self._register_lock:
            if self._registered is None:
                self._registered = False
                threading.Thread(target=self._register, args=(device,), daemon=True,
                                 name="ectier-arena-register").start()
            return self._registered

    def _register(self, device) -> None:
        import weakref

        from ..pinning import register_host, unregister_host

        ok = register_host(self.tensor, device=device, what="the daemon's arena (read-only)", read_only=True)
        if ok:
            weakref.finalize(self._array, unregister_host, self.tensor.data_ptr(), device=device)
        with self._register_lock:
            self._registered = ok

    def view(self, reply: dict[str, Any], release) -> Any:
        """A tensor of the reply's dtype and shape over its extents (one contiguous extent:
        zero-copy, ``release`` runs when its storage dies; several: copied into one tensor and
        ``release`` runs at once). Raises ValueError for extents outside the mapping (then
        ``release`` has not run)."""
        import torch

        from ..moves.views import pinned_view
        from ..tensors import torch_dtype

        dtype, shape = torch_dtype(reply["dtype"]), tuple(reply["shape"])
        extents = reply["extents"]
        if len(extents) == 1:
            start, length = extents[0]
            return pinned_view(self.tensor, start, length, dtype, shape, release)
        out = torch.empty(reply["nbytes"], dtype=torch.uint8)
        off = 0
        for start, length in extents:
            if start < 0 or start + length > self.tensor.numel():
                raise ValueError(f"extent [{start}, {start + length}) outside the {self.tensor.numel()}-byte arena")
            out[off:off + length].copy_(self.tensor[start:start + length])
            off += length
        release()
        return out.view(dtype).view(shape) if reply["nbytes"] else torch.empty(shape, dtype=dtype)


class ViewReleaser:
    """The background sender of one process's view releases to one daemon (module docstring).

    Args:
        socket_path: the daemon's socket.
        timeout_s: the release connection's ``DaemonClient`` timeout, seconds.
    """

    def __init__(self, socket_path: str, timeout_s: float) -> None:
        self.socket_path = socket_path
        self._timeout_s = timeout_s
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._pid = os.getpid()
        self.sent = 0  # lease ids the daemon took
        self.dropped = 0  # lease ids of an earlier daemon run, or that the daemon no longer knew
        self._queued = 0  # releases queued so far
        self._done = 0  # of them sent or dropped
        threading.Thread(target=self._run, daemon=True, name="ectier-daemon-view-release").start()

    def release(self, instance: str, lease: int) -> None:
        """Queue the release of ``lease`` granted by daemon run ``instance``. Never blocks, never
        raises; safe in finalizers. Nothing in a forked child."""
        if os.getpid() != self._pid:
            return
        self._queued += 1
        self._queue.put((instance, lease))

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every release queued so far was sent (or dropped); True if so within ``timeout_s``."""
        target, deadline = self._queued, time.monotonic() + timeout_s
        while self._done < target:
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.005)
        return True

    def _run(self) -> None:
        from .client import DaemonClient
        from ..errors import EctierError
        from .protocol import ProtocolError

        client = DaemonClient(self.socket_path, client_name=f"view-release:{os.getpid()}", timeout_s=self._timeout_s,
                              connect_retry_s=min(1.0, self._timeout_s), backoff_s=RETRY_S)
        pending: dict[str, list[int]] = {}
        while True:
            try:
                item = self._queue.get(timeout=RETRY_S if pending else None)
                if GATHER_S:
                    time.sleep(GATHER_S)  # let a burst of releases gather into one request
            except queue.Empty:
                item = None
            while item is not None:
                pending.setdefault(item[0], []).append(item[1])
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    item = None
            for instance, ids in list(pending.items()):
                try:
                    while ids:
                        # within the daemon's frame cap (daemon.max_frame_bytes: 4 KiB holds ~400 ids)
                        per = max(1, min(BATCH, (client.max_frame_bytes - 512) // 9))
                        batch = ids[:per]
                        n = client.call("release", leases=batch, instance=instance)["released"]
                        self.sent += n
                        self.dropped += len(batch) - n
                        del ids[:per]
                        self._done += len(batch)
                    del pending[instance]
                except ProtocolError:  # the request itself is refused: sending it again cannot help
                    log.exception("sending view releases failed; dropping them (the daemon ends them after lease_s)")
                    self.dropped += len(ids)
                    self._done += len(ids)
                    del pending[instance]
                except EctierError as exc:  # unreachable, hung: retried in RETRY_S
                    log.debug("sending %d view release(s) failed (%s); retrying", len(ids), exc)
                except Exception:  # noqa: BLE001 - keep serving releases
                    log.exception("sending view releases failed; dropping them")
                    self.dropped += len(ids)
                    self._done += len(ids)
                    del pending[instance]


class ViewCalls:
    """The view calls of :class:`~ectier.daemon.client.DaemonClient` (a mixin: they use its
    connection, lock and ``server_info``)."""

    def get_view(self, key: str, *, namespace: str | None = None):
        """A **read-only, zero-copy** CPU tensor over the entry's bytes in the daemon's arena, or
        ``None`` on a miss (shape and dtype as put; do not write to it: the mapping is read-only
        and a write faults). The daemon pins the entry for this process until the tensor's
        storage is freed (the last view of it gone), however long that is and whether or not
        this connection survives (:mod:`ectier.daemon.client_views`; the release is sent by a
        background thread). One round trip.

        Copies instead (as :meth:`get`) where a view cannot serve: a daemon without views, an
        entry read through a scratch file, or one the daemon refused to pin for this process
        (over ``daemon.view_pin_bytes``; counted in :attr:`view_refusals`).

        Raises: as :meth:`get`.
        """
        with self._lock:
            if self._sock is None:
                self.connect()
            if "view" not in self.features:
                return self.get(key, namespace=namespace)
            reply = self.call("get", key=key, **_ns(namespace), **self._direct(), hold=True)
            if not reply["hit"]:
                return None
            if not reply.get("view"):
                self.view_refusals += "view_refused" in reply
                return self._copy_out(reply)
            instance = self.server_info.get("instance", "")
            mapping = self._view_mapping()
        releaser = self._view_releaser()
        lease = reply["lease"]
        try:
            return mapping.view(reply, lambda: releaser.release(instance, lease))
        except BaseException:
            releaser.release(instance, lease)
            raise

    def view_of(self, fields: dict[str, Any], release):
        """A read-only view over bytes this process already holds a process-held lease on
        (``fields``: a ``get`` reply's ``dtype``, ``shape``, ``nbytes``, ``extents``, of the
        current daemon run); ``release()`` runs when its storage is freed (from a finalizer:
        it must not block). Raises ValueError for extents outside the arena."""
        with self._lock:
            if self._sock is None:
                self.connect()
            mapping = self._view_mapping()
        self._view_releaser()  # made here, never first inside a finalizer
        return mapping.view(fields, release)

    def view_to_device(self, view, device):
        """A copy of ``view`` (a :meth:`get_view` tensor) on CUDA ``device`` without a host sync:
        on the copy engine's h2d lane from the page-locked read-only mapping, ready on the caller's
        current stream; ``view`` (and the daemon's pin under it) is held until the copy completed
        (:mod:`ectier.daemon.client_device`). On the CPU, a plain copy."""
        with self._lock:
            mapping = self._ro
        if mapping is not None and str(device) != "cpu":
            mapping.page_locked(device)
        from .client_device import device_loads

        return device_loads().to_device(view, device)

    def _view_mapping(self):
        """The read-only mapping of the current daemon run's arena (made on first use)."""
        instance = self.server_info.get("instance", "")
        if self._ro is None or self._ro.instance != instance:
            arena = self.server_info["arena"]
            self._ro = ArenaView(arena["path"], arena["nbytes"], instance)
        return self._ro

    def prefetch_and_pin(self, keys: list[str], pin: list[str], *, namespace: str | None = None):
        """:meth:`prefetch` of ``keys`` that also pins, for this process, those of ``pin`` (a
        subset) that are ready, in the same round trip: returns ``(states, pins, instance)``,
        ``pins[i]`` the ``get``-reply fields (``lease``, ``dtype``, ``shape``, ``nbytes``,
        ``extents``) of ``pin[i]`` or ``None`` (not ready, or refused by ``daemon.view_pin_bytes``).
        Release a pin with :meth:`release_held` (``instance`` names the daemon run that granted it).

        Raises: as :meth:`prefetch` (``keys`` or ``pin`` one str: InvalidKeyError, nothing sent);
        DaemonFeatureError for a daemon without views.
        """
        from ..entry import validate_keys

        keys, pin = validate_keys(keys), validate_keys(pin, arg="pin")
        with self._lock:
            if self._sock is None:
                self.connect()
            if "view" not in self.features:
                raise _feature_error(f"the ectier daemon at {self.socket_path!r} has no views; upgrade it")
            reply = self.call("prefetch", keys=keys, pin=pin, **_ns(namespace), **self._direct())
            return list(reply["states"]), list(reply["pins"]), self.server_info.get("instance", "")

    def release_held(self, lease: int, instance: str) -> None:
        """Release process-held lease ``lease`` of daemon run ``instance`` from the background
        releaser (never blocks, never raises)."""
        self._view_releaser().release(instance, lease)

    def _view_releaser(self) -> "ViewReleaser":
        if self._releaser is None:
            self._releaser = releaser_for(self.socket_path, self.timeout_s)
        return self._releaser


def _feature_error(message: str):
    from .client_errors import DaemonFeatureError  # client_errors imports nothing of ours

    return DaemonFeatureError(message)


def _ns(namespace: str | None) -> dict[str, str]:
    return {} if namespace is None else {"namespace": namespace}


_RELEASERS: dict[str, ViewReleaser] = {}
_RELEASERS_LOCK = threading.Lock()
os.register_at_fork(after_in_child=_RELEASERS.clear)


def releaser_for(socket_path: str, timeout_s: float) -> ViewReleaser:
    """This process's :class:`ViewReleaser` for ``socket_path`` (made, and its thread started, on
    first use; call it outside finalizers)."""
    with _RELEASERS_LOCK:
        releaser = _RELEASERS.get(socket_path)
        if releaser is None:
            releaser = _RELEASERS[socket_path] = ViewReleaser(socket_path, timeout_s)
        return releaser
