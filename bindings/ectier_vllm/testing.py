"""What a test may look at, or break, inside an :class:`~ectier_vllm.connector.ECTierConnector`.

Tests (ectier's own vLLM suite, or a user's) use these functions instead of the connector's
private attributes, so that its inside can change without touching them; the counterpart of
:mod:`ectier.testing` for the core. Nothing here is used by the connector itself.

Every function takes the connector vLLM built (``scheduler.ec_connector`` or the worker's
connector) and raises ``TypeError`` where the connector's mode has no such thing (e.g.
:func:`cache` of a daemon-mode connector).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, Iterator

from . import store as store_mod
from .daemon_store import DaemonStore
from .store import InProcessStore

if TYPE_CHECKING:
    from ectier.cache import TieredCache
    from ectier.daemon.client import DaemonClient

    from .connector import ECTierConnector

__all__ = ["cache_factory", "store", "cache", "daemon_client", "pinned", "promoting", "poisoned", "widths", "saves_to_confirm",
           "recompute_waiting", "leftovers"]


@contextlib.contextmanager
def cache_factory(factory: "Callable[[Any], TieredCache]") -> Iterator[None]:
    """Within the block, an in-process store that is opened (the first connector of a process, for
    a config) builds its cache with ``factory(config)`` instead of ``TieredCache(config)``, e.g.
    ``functools.partial(ectier.testing.make_cache, copy_engine=...)``. Caches already open are
    not changed."""
    before = store_mod._CACHE_FACTORY
    store_mod._CACHE_FACTORY = factory
    try:
        yield
    finally:
        store_mod._CACHE_FACTORY = before


def store(conn: "ECTierConnector") -> InProcessStore | DaemonStore:
    """The connector's store handle (opened at first use where the connector defers it). Its
    methods (``put``, ``get``, ``acquire``, ``contains``, ...) are what the connector calls; a test
    may wrap one with ``monkeypatch.setattr`` to inject a failure."""
    return conn._store


def cache(conn: "ECTierConnector") -> "TieredCache":
    """The in-process :class:`~ectier.cache.TieredCache` the connector shares with the others of its
    process. Raises ``TypeError`` in daemon mode."""
    handle = store(conn)
    if not isinstance(handle, InProcessStore):
        raise TypeError("cache(): the connector runs in daemon mode; use daemon_client()")
    return handle.cache


def daemon_client(conn: "ECTierConnector") -> "DaemonClient":
    """The connector's own :class:`~ectier.daemon.client.DaemonClient`. Raises ``TypeError`` in
    in-process mode."""
    handle = store(conn)
    if not isinstance(handle, DaemonStore):
        raise TypeError("daemon_client(): the connector runs in-process; use cache()")
    return handle.client


def pinned(conn: "ECTierConnector") -> set[str]:
    """``mm_hash`` es the scheduler side holds a pin on (found, not yet loaded by the worker)."""
    return set(conn._pins)


def promoting(conn: "ECTierConnector") -> dict[str, list[Any]]:
    """Promotions the scheduler side started and still waits for: ``mm_hash`` → the handles it
    polls (in-process: :class:`~ectier.cache.LoadHandle` s)."""
    return {mm_hash: list(pf.handles) for mm_hash, pf in conn._prefetching.items()}


def poisoned(conn: "ECTierConnector") -> set[str]:
    """``mm_hash`` es whose load failed on the worker and that vLLM's encoder cache still lists
    (every later request needing one is failed, retryable, until vLLM frees it)."""
    return set(conn._poisoned)


def widths(conn: "ECTierConnector") -> frozenset[int] | None:
    """Encoder output widths the connector accepts for its model (None: unknown)."""
    return conn._widths


def saves_to_confirm(conn: "ECTierConnector") -> int | None:
    """Saves the scheduler side still expects to see in the store (it counts a producer's saves
    where vLLM drops the workers' report, :mod:`ectier_vllm.confirm`); None where it does not
    confirm saves (the workers' reports reach it, or it is not a producer's scheduler)."""
    confirm = conn._confirm
    return None if confirm is None else len(confirm)


def recompute_waiting(conn: "ECTierConnector") -> set[str]:
    """``mm_hash`` es whose promotion the load-or-recompute rule is timing (started, not yet done)."""
    return set(conn._recompute._pending)


def leftovers(conn: "ECTierConnector") -> dict[str, Any]:
    """Everything the scheduler side still holds for requests or items, by kind, leaving out
    the empty kinds: ``{}`` once every request finished and every load was reported. Kinds:
    ``pins`` (scheduler pins), ``promotions`` (promotions waited for), ``to_load`` (loads not yet
    sent to the workers), ``unavailable`` (requests to fail), ``settled`` / ``requests`` /
    ``counted`` (per-request bookkeeping), ``recompute_waiting`` (promotions being timed),
    ``staged`` (pins offered to a worker of this process), ``daemon_pins`` (daemon-mode pins
    received and not taken). ``poisoned`` items are not listed: they last until vLLM's encoder
    cache frees them (:func:`poisoned`)."""
    out: dict[str, Any] = {
        "pins": set(conn._pins), "promotions": set(conn._prefetching), "to_load": set(conn._to_load),
        "unavailable": set(conn._unavailable), "settled": dict(conn._settled), "requests": set(conn._requests),
        "counted": dict(conn._counted), "recompute_waiting": recompute_waiting(conn),
    }
    handle = conn._store_obj
    if isinstance(handle, InProcessStore):
        with handle._entry.lock:
            out["staged"] = set(handle._entry.staged)
    elif isinstance(handle, DaemonStore):
        from .daemon_store import _SHARED

        with _SHARED._lock:
            out["staged"] = {ident[2] for ident in _SHARED._staged if ident[:2] == handle._ident("")[:2]}
        out["daemon_pins"] = set(handle.lookups._pinned)
    return {k: v for k, v in out.items() if v}
