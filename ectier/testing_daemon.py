"""What tests use instead of a daemon client's private state: its mapping of the daemon's arena
(map it, page-lock it, whether it is mapped).

Like :mod:`ectier.testing` (whose :func:`~ectier.testing.stall_daemon_copy` and
:func:`~ectier.testing.slow_daemon_reserve` delay a client's copies and a daemon's reservations),
this module may look inside a :class:`~ectier.daemon.client.DaemonClient`, so that tests need not.
Not for production.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .daemon.client import DaemonClient

__all__ = ["map_arena", "page_lock_arena", "arena_mapped"]


def map_arena(client: "DaemonClient") -> Any:
    """Map the daemon's arena into this process as ``client``'s data calls do (once: later calls
    return the same mapping) and return it: a ``torch.uint8`` tensor over the whole arena file
    named by ``client.server_info["arena"]`` (``path``, ``nbytes``). Page-locks nothing.

    Raises:
        KeyError: ``server_info`` names no arena (the client never connected).
        OSError: the arena file cannot be opened or mapped."""
    return client._arena_tensor()


def page_lock_arena(client: "DaemonClient", device: Any) -> bool:
    """What ``client`` does at its first put of a CUDA tensor on ``device``: page-lock its mapping
    of the arena (``cudaHostRegister``, under ``device``) unless that was tried already; returns
    whether the mapping is page-locked (False without CUDA, or when the registration was refused).
    Call :func:`map_arena` first."""
    return client._page_locked(device)


def arena_mapped(client: "DaemonClient") -> bool:
    """Whether ``client`` maps a daemon's arena now (from its first data call until it lets go of
    it: at close, or at the first call after its daemon went away)."""
    return client._arena_mmap is not None or client._arena is not None
