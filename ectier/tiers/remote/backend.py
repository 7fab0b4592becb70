"""The seam under the remote tier: one small interface per distributed store.

A backend moves whole objects (bytes) under string keys with a deadline per call; it knows
nothing of records, versions or tiers (``ectier/tiers/remote/tier.py`` does). Every failure is a
:class:`RemoteError` (or :class:`RemoteTimeout`): the tier turns it into a miss and backs off.
"""

from __future__ import annotations

import abc
from typing import Any

from ...errors import EctierError
from ...record import pack_record

__all__ = ["RemoteBackend", "RemoteError", "RemoteTimeout", "RemoteNodeError", "RemoteNodeTimeout", "byte_view"]


class RemoteError(EctierError):
    """A remote store call failed (connection refused or lost, server error, bad reply)."""


class RemoteTimeout(RemoteError):
    """A remote store call ran past its deadline."""


class RemoteRefused(RemoteError):
    """The store answered and refused this call (Redis: out of memory under ``maxmemory`` with
    ``noeviction``; Mooncake: no segment has room for the object). The store is up: the tier counts the failure and warns (once per
    ``remote.backoff_s``), but backs nothing off, so reads of what it holds go on."""


class RemoteNodeError(RemoteError):
    """A call failed because one node of a clustered store is unreachable; the other nodes keep
    serving their keys, so the tier counts it and backs off nothing (the backend itself fails
    the calls that need that node at once for ``remote.backoff_s``, ``skipped`` set).

    Attributes:
        node: the node's ``host:port``.
        skipped: True when the call was not sent (the node is in its own back-off).
    """

    def __init__(self, message: str, *, node: str, skipped: bool = False) -> None:
        super().__init__(message)
        self.node = node
        self.skipped = skipped


class RemoteNodeTimeout(RemoteNodeError, RemoteTimeout):
    """A call to one node of a clustered store ran past its deadline (the node hangs)."""


class RemoteBackend(abc.ABC):
    """Objects (bytes) under string keys on a remote store.

    Implementations must be thread-safe (the tier calls them from a small pool of threads) and
    must never block longer than ``deadline_s`` per call (connect included).
    """

    #: the name in ``remote.backend``
    name: str = ""
    #: True: :meth:`put_record` computes ``header.payload_checksum`` from the payload itself (while
    #: it copies it), so the tier passes the header without one and makes no pass of its own
    computes_checksum: bool = False

    @abc.abstractmethod
    def put(self, key: str, data: bytes | memoryview, *, deadline_s: float) -> None:
        """Store ``data`` under ``key``, replacing what was there; a reader never sees a partly
        written object (write the parts, then what makes them visible, last).

        Raises:
            RemoteError, RemoteTimeout.
        """

    def put_record(self, key: str, header: Any, payload: Any, *, deadline_s: float,
                   checksum_known: bool = False) -> None:
        """Store one record (``header``: a :class:`~ectier.record.RecordHeader`; ``payload``: its
        bytes) as the object under ``key``, as :meth:`put` does. The default joins both with
        :func:`~ectier.record.pack_record` (one copy of the payload); a backend may write them
        without that buffer. A backend with :attr:`computes_checksum` stores the header with
        ``payload_checksum`` set to the payload's xxh3-64, whatever ``header`` says — unless
        ``checksum_known``: the caller knew the payload's xxh3-64, ``header`` carries it and is
        stored as given (no pass over the payload for it).

        Raises:
            RemoteError, RemoteTimeout.
        """
        self.put(key, pack_record(header, payload), deadline_s=deadline_s)

    @abc.abstractmethod
    def get(self, key: str, *, deadline_s: float) -> bytes | None:
        """The whole object under ``key``, or ``None`` if there is none (or only a partial one).

        Raises:
            RemoteError, RemoteTimeout.
        """

    @abc.abstractmethod
    def exists(self, key: str, *, deadline_s: float) -> bool:
        """Whether a whole object is stored under ``key``.

        Raises:
            RemoteError, RemoteTimeout.
        """

    @abc.abstractmethod
    def delete(self, key: str, *, deadline_s: float) -> None:
        """Remove the object under ``key`` (no error if absent).

        Raises:
            RemoteError, RemoteTimeout.
        """

    def describe(self) -> dict[str, Any]:
        """Facts for ``stats()`` (addresses, ...); no secrets."""
        return {"backend": self.name}

    def close(self) -> None:
        """Close connections. Idempotent."""


def byte_view(data: Any) -> memoryview:
    """``data`` as a 1-D byte memoryview. Raises TypeError (not bytes-like), ValueError (not C-contiguous)."""
    try:
        view = memoryview(data)
    except TypeError:
        raise TypeError(f"data: expected bytes, bytearray or memoryview, got {type(data).__name__}") from None
    if not view.c_contiguous:
        raise ValueError("data: the buffer must be C-contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view
