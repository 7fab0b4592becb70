"""Handles and leases the cache hands out: what a caller holds while a copy runs.

- :class:`PutHandle` — completion of one :meth:`TieredCache.put` (asynchronous for CUDA tensors).
- :class:`LoadHandle` — completion of one key of :meth:`TieredCache.prefetch`.
- :class:`WriteLease` — a host-arena reservation (phase 1 of a two-phase put, the daemon's).
- :class:`ReadLease` — a pinned host-arena entry (the daemon's get, the connector's pin).

A lease ends once: a second :meth:`TieredCache.release` / ``commit`` / ``abort`` of the same lease
is a no-op (release) or an :class:`~ectier.errors.InvalidArgumentError` (commit, abort; a
``ValueError`` too), never a change to another lease. Anything but a lease of the call's kind is an
:class:`~ectier.errors.InvalidLeaseError` (a ``TypeError`` too): :func:`check_lease`.
"""

from __future__ import annotations

import threading
from typing import Any

from .entry import EntryMeta
from .errors import InvalidArgumentError, InvalidLeaseError

__all__ = ["PutHandle", "LoadHandle", "WriteLease", "ReadLease", "check_lease", "end_lease"]


#: guards the lazy creation of a handle's event by waiters (see :class:`_Handle`)
_EVENT_LOCK = threading.Lock()


class _Handle:
    """A result set once: ``done()``, ``wait(timeout_s)``, ``error``.

    Most handles are finished before anyone waits (every put of a CPU tensor), so the
    :class:`threading.Event` a waiter blocks on is made only when someone waits first, and
    :meth:`finish` takes no lock: it sets ``_done`` and then reads ``_event``; a waiter publishes
    ``_event`` and then reads ``_done`` again, so one of the two always sees the other.
    """

    __slots__ = ("key", "error", "_ok", "_done", "_event")

    def __init__(self, key: str) -> None:
        self.key = key
        self.error: BaseException | None = None
        self._ok = False
        self._done = False
        self._event: threading.Event | None = None

    def done(self) -> bool:
        """True once the operation finished (successfully or not)."""
        return self._done

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block up to ``timeout_s`` seconds (``None``: no limit); True if it finished successfully."""
        if not self._done:
            with _EVENT_LOCK:
                if self._event is None:
                    self._event = threading.Event()
                event = self._event
            if not self._done and not event.wait(timeout_s):
                return False
        return self._ok

    def finish(self, ok: bool, error: BaseException | None = None) -> None:
        """Set the result (the cache's side; called once)."""
        self._ok = bool(ok)
        self.error = error
        self._done = True
        event = self._event
        if event is not None:
            event.set()


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

    @classmethod
    def stored(cls, key: str) -> "PutHandle":
        """A handle of a put already stored (done, successful): a synchronous put's, made in one call."""
        h = object.__new__(cls)
        h.key, h.error, h._ok, h._done, h._event = key, None, True, True, None
        return h

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


class _Lease:
    """A host-arena entry held by another party, ended exactly once."""

    __slots__ = ("meta", "extents", "slot", "owner", "_ended", "_lock")

    def __init__(self, meta: EntryMeta, extents: tuple[tuple[int, int], ...], slot: Any, owner: Any = None) -> None:
        self.meta = meta
        self.extents = extents
        self.slot = slot  # the tier's slot; only the cache looks at it
        self.owner = owner  # the cache that gave it (check_lease)
        self._ended = False
        self._lock = threading.Lock()

    @property
    def ended(self) -> bool:
        """True once the lease was committed, aborted or released."""
        return self._ended

    def end(self) -> bool:
        """Mark the lease ended; True the first time, False on every later call."""
        with self._lock:
            if self._ended:
                return False
            self._ended = True
            return True

    def __copy__(self) -> "_Lease":
        return self  # one lease, ended once: a copy would end the same slot twice

    def __deepcopy__(self, memo: dict) -> "_Lease":
        return self

    def __reduce__(self):
        raise TypeError(f"a {type(self).__name__} cannot be pickled: it holds a slot of this process's host arena")

    def __repr__(self) -> str:
        state = "ended" if self._ended else "held"
        return f"<{type(self).__name__} {self.meta.key!r} {self.meta.nbytes} B {state}>"


class WriteLease(_Lease):
    """A host-arena reservation from :meth:`TieredCache.reserve`.

    Fields: ``meta`` (:class:`~ectier.entry.EntryMeta`), ``extents``: ``(arena byte offset,
    length)`` runs whose concatenation is the entry's bytes in C order, ``owner``: the
    :class:`~ectier.cache.TieredCache` that gave it (the only one that takes it back).
    """

    __slots__ = ()


class ReadLease(_Lease):
    """A pinned host-arena entry from :meth:`TieredCache.acquire`; fields as :class:`WriteLease`."""

    __slots__ = ()


_MADE_BY = {"WriteLease": "reserve", "ReadLease": "acquire"}


def check_lease(lease: Any, kind: type, owner: Any = None) -> Any:
    """``lease``, checked to be a ``kind`` (:class:`WriteLease` or :class:`ReadLease`) given by
    ``owner`` (the cache checking it; ``None``: any).

    Raises:
        InvalidLeaseError: it is not (also a ``TypeError``); the message names the argument.
    """
    made_by = _MADE_BY.get(kind.__name__)
    if not isinstance(lease, kind):
        raise InvalidLeaseError(f"lease: expected a {kind.__name__}" + (f" (from {made_by})" if made_by else "")
                                + f", got {type(lease).__name__}")
    if owner is not None and lease.owner is not owner:
        raise InvalidLeaseError(f"lease: a {kind.__name__} of another cache; use a lease with the cache whose "
                                f"{made_by} gave it (nothing was changed)")
    return lease


def end_lease(lease: Any, kind: type, op: str, owner: Any = None) -> None:
    """End ``lease`` (a ``kind`` given by ``owner``, see :func:`check_lease`) for ``op``
    (``"commit"``, ``"abort"``).

    Raises:
        InvalidLeaseError: ``lease`` is not a ``kind`` of ``owner`` (also a ``TypeError``).
        InvalidArgumentError: it was already committed, aborted or released.
    """
    if not check_lease(lease, kind, owner).end():
        raise InvalidArgumentError(f"{op}: the lease was already committed, aborted or released")
