"""The daemon-mode store of the connector (:class:`DaemonStore`): a
:class:`~ectier.daemon.client.DaemonClient` per connector behind the interface of
:mod:`ectier_vllm.store` (which describes both stores and their calls).

The scheduler pins a step's ready items in the step's one ``prefetch`` request, never waiting for
the daemon's reply beyond ``daemon_answer_wait_s`` (process-held leases, released in one request
once the worker reported the load: :mod:`ectier_vllm.daemon_lookups`); the worker reads a
read-only zero-copy view of the daemon's arena (``DaemonClient.get_view``): from the pin its
scheduler staged when both run in one process (:class:`_SharedPins`), else with a ``get`` of its
own. Errors are ectier's (``EctierError``); the connector turns them into misses.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from .config import DEFAULT_ANSWER_WAIT_S
from .daemon_lookups import ABSENT, DaemonLoad, StepLookups, StoredQueries
from .store import NOT_STORED, Pin

log = logging.getLogger("vllm.ectier." + __name__.rsplit(".", 1)[-1])  # (under vLLM's logger: common.py)

#: longest a daemon-mode call waits for a daemon that went away (a restart) before it is a miss;
#: bounded further by the connector's ``daemon_timeout_s``
DAEMON_CONNECT_RETRY_S = 5.0
#: after a failed connection attempt, calls are misses at once (no attempt) for this long
DAEMON_BACKOFF_S = 1.0
#: longest wait for ``hello`` when (re)connecting after a failure or at start-up: a healthy daemon
#: answers at once, and a stopped one then costs a scheduler step at most this per back-off window
DAEMON_PROBE_S = 0.25

# socket paths this process has already warned about (one warning, not one per connector)
_WARNED_UNREACHABLE: set[str] = set()


class DaemonStore:
    """A :class:`DaemonClient` of one connector, with the namespace on every call."""

    mode = "daemon"
    #: ``DaemonClient.put`` copies and commits before it returns ``None``
    async_put = False
    #: a remote tier of the daemon is the daemon's business: its ``prefetch`` answers for it
    remote = False

    def __init__(self, socket_path: str | None, namespace: str, timeout_s: float,
                 answer_wait_s: float = DEFAULT_ANSWER_WAIT_S) -> None:
        from ectier.daemon.client import DaemonClient, DaemonUnavailableError

        self._args = (socket_path, namespace, timeout_s, answer_wait_s)

        # the connector's daemon_timeout_s bounds every wait of a call, the reconnect wait too;
        # a client whose daemon is unreachable fails fast (DAEMON_BACKOFF_S) so calls are misses
        self.client = DaemonClient(socket_path, timeout_s=timeout_s,
                                   connect_retry_s=min(DAEMON_CONNECT_RETRY_S, timeout_s),
                                   backoff_s=DAEMON_BACKOFF_S,
                                   probe_timeout_s=min(DAEMON_PROBE_S, timeout_s))
        self.namespace = namespace
        #: the scheduler's step-batched, non-blocking lookups and its pins' releases
        self.lookups = StepLookups(self.client, namespace, answer_wait_s, _held_pin)
        self._stored = StoredQueries(self.client, namespace)  # the producer's save confirmation
        self._batched: bool | None = None  # the daemon has the prefetch op (None: not known yet)
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

    # --------------------------------------------------------------------- step-batched lookups
    def new_step(self) -> None:
        """A scheduler step begins (:meth:`StepLookups.new_step`: no wait, no error)."""
        self.lookups.new_step()

    def expect(self, keys: list[str]) -> None:
        """Keys the scheduler is about to ask about this step: asked in the same request."""
        self.lookups.expect(keys)

    def _legacy(self) -> bool:
        """True for a daemon without the ``prefetch`` op (older than this binding)."""
        if self._batched is None:
            if not self.client.connect_in_background():  # never a connect in a scheduler step
                if self.client.connecting:
                    return False  # the lookups wait for the connection (StepLookups)
                raise self.lookups.unreachable_error()
            self._batched = "prefetch" in self.client.features
        return not self._batched

    def contains(self, key: str) -> bool:
        """True unless the daemon answered ``key`` absent this step."""
        if self._legacy():
            return self.client.contains(key, namespace=self.namespace)
        return self.lookups.answer(key) != ABSENT

    def stored_now(self, keys: list[str]) -> dict[str, bool | None]:
        """Whether the daemon stores each of ``keys`` (the producer's save confirmation, never the
        consumer's lookups): its ``contains``, sent without waiting (:class:`StoredQueries`);
        None while the answer is not in (a later call has it), False when it was lost."""
        return self._stored.ask(keys)

    def lookup(self, key: str, device: str) -> Any:
        """The scheduler's one question about ``key`` this step (``device`` is ignored: the worker
        reads from the daemon's arena): :data:`~ectier_vllm.store.NOT_STORED` when the daemon
        answered it absent, else the handle of the daemon's promotion into its arena (one
        :class:`DaemonLoad` holding the answer already in: a ``"ready"`` one is done, a pending or
        promoting one is asked again as it is polled). An older daemon (no ``prefetch`` op):
        ``contains``, then ``None`` (pin at once; its ``get`` promotes synchronously).

        Raises:
            EctierError (DaemonUnavailableError, ...): as :meth:`StepLookups.answer`.
        """
        if self._legacy():
            return None if self.client.contains(key, namespace=self.namespace) else NOT_STORED
        state = self.lookups.answer(key)
        if state == ABSENT:
            return NOT_STORED
        return [DaemonLoad(self.lookups, key, state)]

    def acquire(self, key: str, device: str) -> Pin | None:
        """Pin ``key``: a daemon ``get`` lease, which takes over the pin (or, for an entry larger
        than the daemon's arena, the scratch file) the daemon's finished promotion holds."""
        pin = self.lookups.take_pin(key)
        if pin is not None:
            return pin  # pinned by the step's prefetch request
        if "view" in self.client.features:
            # answered ready but not pinned (over daemon.view_pin_bytes, or evicted in between):
            # a miss, never a blocking get in the scheduler
            return None
        direct = {"direct": True} if "direct" in self.client.features else {}
        hold = {"hold": True} if "view" in self.client.features else {}
        reply = self.client.call("get", key=key, namespace=self.namespace, **direct, **hold)
        if not reply.get("hit"):
            return None
        if reply.get("view"):
            return _held_pin(reply, self.client.server_info.get("instance", ""))
        return Pin(tuple(reply["shape"]), str(reply["dtype"]), reply["lease"])

    def release(self, pin: Pin, staged_as: str | None = None) -> None:
        """End ``pin`` (``staged_as``: the key it was :meth:`stage` d under, unstaged with it): a
        process-held lease is queued for :meth:`send_releases` (no round trip here; once no view
        of this process's worker still reads it, see :meth:`stage`), an older daemon's
        connection lease with a ``release`` call."""
        if isinstance(pin.lease, HeldLease):
            ident = None if staged_as is None else self._ident(staged_as)
            _SHARED.drop(pin.lease, self.lookups, unstage=ident)  # queued: sent by send_releases
        else:
            if staged_as is not None:
                self.unstage(staged_as)
            self.client.call("release", retry=False, lease=pin.lease)

    def stage(self, key: str, pin: Pin) -> None:
        """Offer a process-held pin to a worker connector of this process (vLLM's uniproc
        executor runs scheduler and worker in one process): its :meth:`get` then views the
        pinned bytes with no round trip, and the lease ends once both the scheduler released it
        and the view is freed. A worker in another process asks the daemon itself."""
        if isinstance(pin.lease, HeldLease):
            _SHARED.stage(self._ident(key), pin)

    def _ident(self, key: str) -> tuple:
        """``key``'s name among this process's staged pins: (daemon socket, namespace, key)."""
        return (self.client.socket_path, self.namespace, key)

    def unstage(self, key: str) -> None:
        _SHARED.unstage(self._ident(key))

    def put(self, key: str, tensor: Any, *, after: Any = None) -> Any:
        """``DaemonClient.put`` (returns ``None`` once committed); ``after``: a CUDA event the
        copy of a device ``tensor`` waits for."""
        return self.client.put(key, tensor, namespace=self.namespace, after=after)

    def for_saves(self) -> "DaemonStore":
        """A store with a daemon client of its own, for a background save thread (its puts never
        hold the lock of this store's client)."""
        return DaemonStore(*self._args)

    def get(self, key: str, device: str) -> Any:
        """Read ``key``: onto the CPU, a read-only zero-copy view of the daemon's arena
        (:meth:`DaemonClient.get_view`: pinned until the tensor is freed); onto a GPU, one copy
        from that view to ``device`` on the copy engine's h2d lane, ready on the worker's current
        stream with no host sync (:meth:`DaemonClient.view_to_device`: the view, and its pin,
        held until the copy completed)."""
        view = _SHARED.view(self._ident(key), self.client)
        if view is None:
            view = self.client.get_view(key, namespace=self.namespace)
        if view is None or device == "cpu":
            return view
        return self.client.view_to_device(view, device)

    def flush(self) -> None:
        return None  # the daemon flushes on its own shutdown

    def send_releases(self) -> None:
        """Send the releases queued by :meth:`release` (one request, no wait for its reply)."""
        self.lookups.send_releases()

    def close(self) -> None:
        self.lookups.close()
        self.client.close()


class HeldLease:
    """A daemon lease held by this process (no deadline; released from a background thread):
    its ``id`` and the daemon run (``instance``) that granted it; ``fields``: the ``get``-reply
    fields of the pinned bytes (``dtype``, ``shape``, ``nbytes``, ``extents``). Equal and hashed
    by ``(id, instance)``; read-only by convention (a plain class with its hash kept: one is
    made for every pin of every scheduler step, and hashed at each staging and release)."""

    __slots__ = ("id", "instance", "fields", "_hash")

    def __init__(self, id: int, instance: str, fields: dict | None = None) -> None:  # noqa: A002 - the lease's id
        self.id, self.instance = id, instance
        self.fields = {} if fields is None else fields
        self._hash = hash((id, instance))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, HeldLease):
            return NotImplemented
        return self.id == other.id and self.instance == other.instance

    def __repr__(self) -> str:
        return f"HeldLease(id={self.id!r}, instance={self.instance!r})"


def _held_pin(reply: dict[str, Any], instance: str) -> Pin:
    fields = {k: reply[k] for k in ("dtype", "shape", "nbytes", "extents")}
    return Pin(tuple(reply["shape"]), str(reply["dtype"]), HeldLease(reply["lease"], instance, fields))


class _SharedPins:
    """Process-held pins a scheduler connector staged for a worker connector of the same
    process, reference-counted: the scheduler's hold plus one per live view made from it; the
    lease is released (background releaser) when the count reaches 0. A view's finalizer drops
    its reference through :class:`ectier.moves.views.Releaser` (never blocks on the lock)."""

    def __init__(self) -> None:
        from ectier.moves.views import Releaser

        self._lock = threading.Lock()
        self._staged: dict[tuple, HeldLease] = {}
        self._refs: dict[HeldLease, int] = {}  # lease -> references
        self._releaser = Releaser(self._lock)

    def stage(self, ident: tuple, pin: Pin) -> None:
        with self._lock:
            self._staged[ident] = pin.lease
            self._refs[pin.lease] = self._refs.get(pin.lease, 0) + 1

    def unstage(self, ident: tuple) -> None:
        with self._lock:
            self._staged.pop(ident, None)

    def drop(self, lease: HeldLease, client: Any, unstage: tuple | None = None) -> None:
        """The scheduler's release of ``lease`` (released at once unless a view holds it), and
        the end of its staging as ``unstage`` (an ident of :meth:`stage`; None: none)."""
        with self._lock:
            if unstage is not None:
                self._staged.pop(unstage, None)
            self._drop_locked(lease, client)

    def _drop_locked(self, lease: HeldLease, client: Any) -> None:
        refs = self._refs.get(lease)
        if refs is not None:
            if refs > 1:
                self._refs[lease] = refs - 1
                return
            del self._refs[lease]
        client.release_held(lease.id, lease.instance)  # never blocks

    def view(self, ident: tuple, client: Any) -> Any:
        """A view of the staged pin of ``ident`` (None: none staged, or of another daemon run)."""
        with self._lock:
            lease = self._staged.get(ident)
            if lease is None or lease not in self._refs or not lease.fields:
                return None
            if lease.instance != client.server_info.get("instance"):
                return None  # the daemon restarted since: its pins went with it
            self._refs[lease] += 1
        try:
            return client.view_of(lease.fields, lambda: self._releaser.call(lambda: self._drop_locked(lease, client)))
        except BaseException:
            self.drop(lease, client)
            raise


_SHARED = _SharedPins()
