"""The daemon's request handlers: one function per protocol op (:mod:`ectier.daemon.protocol`).

:func:`handle` answers one decoded request of a connection with a reply dict; it never raises.
Errors become error replies: :class:`ProtocolError` (also counted in the server's
``protocol_errors``), any :class:`~ectier.errors.EctierError` by its class name, ``ValueError`` /
``TypeError`` from the cache's input checks, an ``OSError`` by its class name (one rate-limited
WARNING per op and errno), and anything else as ``InternalError`` (logged with its traceback).

``hello`` must be a connection's first request; any other op before it is a ``ProtocolError``.

``direct: true`` (``reserve``, ``get``, ``prefetch``; the client's word that it maps scratch
files): an entry the host arena cannot take or lease moves through a scratch file
(:mod:`ectier.daemon.scratch`) whose ``path`` the reply names; without it the daemon answers as
protocol 1 always did (``EntryTooLargeError``/``TierWriteError``, a miss).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable

from .. import __version__
from ..cache import ReadLease
from ..errors import EctierError, EntryTooLargeError, LeaseExpiredError, TierWriteError
from ..logutil import RateLimitedLogger
from ..tensors import meta_from_spec
from .connections import Connection
from .leases import arena_footprint, end_lease
from .protocol import FEATURES, PROTOCOL_VERSION, ProtocolError, error_reply, ok_reply, parse_request
from .scratch import DirectPut, DirectRead, Scratch

if TYPE_CHECKING:
    from .server import DaemonServer

__all__ = ["HANDLERS", "handle"]

log = logging.getLogger("ectier.daemon")
#: a system error on the request path (EMFILE, ENOSPC in /dev/shm, ...) repeats for every client
#: until the operator acts: one WARNING per op and errno per 10 s, with a count, and no traceback
_OS_ERRORS = RateLimitedLogger(log, 10.0)


def handle(server: DaemonServer, conn: Connection, msg: dict[str, Any] | ProtocolError) -> dict[str, Any]:
    """The reply to ``msg`` (a decoded request, or the per-message error the decoder gave)."""
    rid = msg.get("id") if isinstance(msg, dict) and isinstance(msg.get("id"), int) else None
    try:
        if isinstance(msg, ProtocolError):
            raise msg
        req = parse_request(msg)
        conn.requests += 1
        if not conn.greeted and req.op != "hello":
            raise ProtocolError(f"{req.op}: the first request on a connection must be 'hello' "
                                f"(version {PROTOCOL_VERSION}); send it before anything else")
        return ok_reply(req.id, **HANDLERS[req.op](server, conn, **req.args))
    except ProtocolError as exc:
        server.count("protocol_errors")
        return error_reply(rid, "ProtocolError", str(exc))
    except EctierError as exc:
        return error_reply(rid, type(exc).__name__, str(exc))
    except (ValueError, TypeError) as exc:  # validation errors from the cache's inputs
        return error_reply(rid, type(exc).__name__, str(exc))
    except OSError as exc:  # out of descriptors or memory for a scratch file, /dev/shm full, ...
        _OS_ERRORS.log(logging.WARNING, (msg.get("op") if isinstance(msg, dict) else None, exc.errno),
                       "request %r failed: %s", msg.get("op") if isinstance(msg, dict) else None, exc)
        return error_reply(rid, "OSError", str(exc))
    except Exception as exc:  # keep serving everyone else; this request failed
        log.exception("request %r failed", msg if isinstance(msg, dict) else None)
        return error_reply(rid, "InternalError", f"{type(exc).__name__}: {exc}")


def _op_hello(server: DaemonServer, conn: Connection, version: int, client: str = "") -> dict[str, Any]:
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"hello: client speaks protocol {version}, daemon speaks {PROTOCOL_VERSION}")
    conn.name = client[:200] or "(unnamed)"
    conn.greeted = True
    return {
        "version": PROTOCOL_VERSION,
        "server": f"ectier {__version__}",
        "namespace": server.config.namespace,
        "arena": {"path": server.arena_path, "nbytes": server.cache.host_arena_bytes,
                  "block_bytes": server.config.host.block_bytes},
        "lease_s": server.config.daemon.lease_s,
        "max_frame_bytes": server.config.daemon.max_frame_bytes,  # the cap of one request's frame
        "features": list(FEATURES),
        "instance": server.instance,
    }


def _op_ping(server: DaemonServer, conn: Connection) -> dict[str, Any]:
    return {}


def _op_reserve(server: DaemonServer, conn: Connection, key: str, dtype: str, shape: tuple,
                namespace: str | None = None, direct: bool = False) -> dict[str, Any]:
    assert server.cache is not None
    to_nvme = direct and server.config.nvme.enabled
    nbytes = _spec_nbytes(dtype, shape)
    if nbytes is not None and _arena_shortfall(server, nbytes) > 0:
        _make_room(server, nbytes)
        if to_nvme and _arena_shortfall(server, nbytes) > 0:
            return _direct_put(server, conn, key, dtype, shape, namespace)
    try:
        handle = server.cache.reserve(key, dtype=dtype, shape=shape, namespace=namespace)
    except (EntryTooLargeError, TierWriteError) as exc:
        if to_nvme:
            return _direct_put(server, conn, key, dtype, shape, namespace)
        if isinstance(exc, TierWriteError):
            raise TierWriteError(
                f"{exc}: {_held_arena_bytes(server)} bytes of the {server.cache.host_arena_bytes}-byte "
                f"arena are held by daemon clients' open put reservations, get leases and zero-copy view pins "
                f"(view pins: at most daemon.view_pin_bytes={server.holders.limit_bytes} per process), and the orphaned "
                f"reservations of live clients whose puts were cut ({server.stats_orphans()['bytes']} bytes)"
                + ("" if server.config.nvme.enabled else ", and there is no NVMe tier (nvme.path) to store it on")
            ) from None
        raise
    lease_id = server.leases.grant(conn, "put", handle)
    conn.granted_now.append(lease_id)  # (a reply that never reaches the client ends it: no orphan)
    return {"lease": lease_id, "nbytes": handle.meta.nbytes, "extents": [list(e) for e in handle.extents]}


def _spec_nbytes(dtype: str, shape: tuple) -> int | None:
    """The bytes of an entry of ``dtype`` and ``shape``; None when they are invalid (the cache's
    ``reserve`` then says why, in its own order of checks)."""
    try:
        return meta_from_spec("-", "-", dtype, shape).nbytes
    except (EctierError, ValueError, TypeError):
        return None


def _held_arena_bytes(server: DaemonServer) -> int:
    """Arena bytes (whole ``host.block_bytes`` blocks) that no eviction can free: the entries the
    clients' leases (connection leases, zero-copy view pins, open and orphaned reservations) and
    the held prefetch pins hold, each entry once however many pins it has."""
    block = server.config.host.block_bytes
    places = {**server.prefetcher.held_places(), **server.leases.arena_places()}
    return sum(arena_footprint(n, block) for n in places.values())


def _arena_shortfall(server: DaemonServer, nbytes: int) -> int:
    """Arena bytes (whole blocks) an entry of ``nbytes`` lacks even after evicting everything
    unpinned (:func:`_held_arena_bytes`): 0 or less, it fits; more, a reserve would only wait
    ``host.admit_wait_s``."""
    block = server.config.host.block_bytes
    return arena_footprint(nbytes, block) - (server.cache.host_arena_bytes // block * block - _held_arena_bytes(server))


def _make_room(server: DaemonServer, nbytes: int) -> None:
    """Prefetch pins give way to a put: end held prefetch pins (their entries stay in the arena,
    unpinned) until an entry of ``nbytes`` fits beside the other pins, when it can fit at all;
    a pin whose entry a client's lease also holds frees nothing and is kept. Views are never
    taken back; what they and the connection leases pin stays."""
    short = _arena_shortfall(server, nbytes)
    if short > 0 and arena_footprint(nbytes, server.config.host.block_bytes) <= server.cache.host_arena_bytes:
        server.prefetcher.give_way(short, keep=set(server.leases.arena_places()))


def _direct_put(server: DaemonServer, conn: Connection, key: str, dtype: str, shape: tuple,
                namespace: str | None) -> dict[str, Any]:
    """A put through a scratch file: committed with ``TieredCache.put`` (NVMe when the arena has
    no room), so a client never waits on other clients' reservations to fail."""
    nbytes = meta_from_spec("-", key, dtype, shape).nbytes
    if nbytes > server.config.nvme.capacity_bytes:
        raise EntryTooLargeError(f"entry of {nbytes} bytes is larger than the host arena and nvme.capacity_bytes="
                                 f"{server.config.nvme.capacity_bytes}")
    scratch = Scratch(server.config.daemon.shm_dir, nbytes, gid=server.allowed_gid)
    lease_id = server.leases.grant(conn, "put", DirectPut(scratch, key, namespace, dtype, tuple(shape)))
    return {"lease": lease_id, "nbytes": nbytes, "extents": scratch.extents, "path": scratch.path}


def _op_commit(server: DaemonServer, conn: Connection, lease: int) -> dict[str, Any]:
    held = server.leases.take(conn, lease, "put")
    if held is None:
        raise LeaseExpiredError(f"commit: lease {lease} is unknown or expired; the put was not stored, retry it")
    assert server.cache is not None
    h = held.handle
    key, ns = (h.key, h.namespace) if isinstance(h, DirectPut) else (h.meta.key, h.meta.namespace)
    end_lease(server.cache, held, commit=True)
    server.prefetcher.forget(ns, key)
    return {}


def _op_abort(server: DaemonServer, conn: Connection, lease: int, instance: str | None = None) -> dict[str, Any]:
    held = server.leases.take(conn, lease, "put")
    if held is None:  # an orphan of this process (this daemon run's): its copy is over
        return {"aborted": instance == server.instance and server.end_orphan(conn, lease)}
    assert server.cache is not None
    end_lease(server.cache, held, commit=False)
    return {"aborted": True}


def _op_bye(server: DaemonServer, conn: Connection) -> dict[str, Any]:
    server.writes_over(conn)
    return {}


def _op_get(server: DaemonServer, conn: Connection, key: str, namespace: str | None = None,
            direct: bool = False, hold: bool = False) -> dict[str, Any]:
    assert server.cache is not None
    held = server.prefetcher.take(namespace, key, direct=direct)  # a finished prefetch's pin: no I/O
    handle = held.handle if held is not None else server.cache.acquire(key, namespace=namespace)
    if held is not None and isinstance(handle, ReadLease):
        server.cache.count_served(handle)  # the prefetch's pin counted no lookup: this get is one
    if handle is None and server.cache.contains(key, namespace=namespace):
        # stored, but the arena cannot lease it (larger than host.capacity_bytes, or no room)
        tensor = server.cache.get(key, namespace=namespace) if direct else None
        if tensor is not None:
            handle = DirectRead.of(tensor, server.config.daemon.shm_dir, gid=server.allowed_gid)
        elif not direct:
            server.prefetcher.unleasable(namespace, key)
    if handle is None:
        return {"hit": False}
    extra: dict[str, Any] = {}
    lease_id = None
    if hold and isinstance(handle, ReadLease):
        # a process-held lease for a zero-copy view (holders.py); refused: an ordinary lease
        lease_id, refused = server.grant_view(conn, handle)
        extra = {"view": True} if lease_id is not None else {"view_refused": refused}
    if lease_id is None:
        lease_id = server.leases.grant(conn, "get", handle)
    if isinstance(handle, ReadLease):
        return {"hit": True, "lease": lease_id, **_read_fields(handle), **extra}
    return {"hit": True, "lease": lease_id, "dtype": handle.dtype, "shape": list(handle.shape),
            "nbytes": handle.nbytes, "extents": handle.scratch.extents, "path": handle.scratch.path}


def _read_fields(handle: ReadLease) -> dict[str, Any]:
    meta = handle.meta  # (tuples go out as msgpack arrays, as lists would)
    return {"dtype": meta.dtype, "shape": meta.shape, "nbytes": meta.nbytes, "extents": handle.extents}


def _op_prefetch(server: DaemonServer, conn: Connection, keys: list, namespace: str | None = None,
                 direct: bool = False, pin: list | None = None) -> dict[str, Any]:
    if pin is None:
        return {"states": server.prefetcher.states(keys, namespace, direct=direct)}
    # keys to pin that are in the arena now are pinned at once (one acquire, no I/O); the rest
    # go through the prefetcher, and those it then answers ready are pinned as well
    wanted = list(dict.fromkeys(pin))
    pins = _pin_many(server, conn, wanted, namespace)
    rest = [k for k in keys if k not in pins]
    states = dict(zip(rest, server.prefetcher.states(rest, namespace, direct=direct)))
    late = [key for key in wanted if key not in pins and states.get(key) == "ready"]
    if late:
        pins.update(_pin_many(server, conn, late, namespace))
    out, seen = [], set()  # a key named twice in pin is pinned once: one lease, one release (the repeat: null)
    for k in pin:
        out.append(None if k in seen else pins.get(k))
        seen.add(k)
    return {"states": ["ready" if k in pins else states[k] for k in keys], "pins": out}


def _pin_many(server: DaemonServer, conn: Connection, keys: list[str], namespace: str | None) -> dict[str, Any]:
    """Process-held leases on ``keys`` (distinct) for ``prefetch``'s ``pin``: key -> the fields of
    a ``get`` reply, for the keys in the arena (never waits on I/O) that the view bounds allowed,
    granted in order under one hold of the lease lock."""
    assert server.cache is not None
    taken = server.prefetcher.take_many(namespace, keys)
    need = [k for k in keys if k not in taken]
    try:
        got = dict(zip(need, server.cache.acquire_many(need, namespace=namespace))) if need else {}
    except BaseException:
        for held in taken.values():
            server.cache.release(held.handle)
        raise
    for held in taken.values():
        server.cache.count_served(held.handle)  # (take_many hands out arena leases only)
    handles = [(k, taken[k].handle if k in taken else got[k]) for k in keys]
    handles = [(k, h) for k, h in handles if h is not None]
    pins = {}
    for (key, handle), (lease_id, _) in zip(handles, server.grant_views(conn, [h for _, h in handles])):
        if lease_id is None:
            server.cache.release(handle)
        else:
            pins[key] = {"lease": lease_id, **_read_fields(handle)}
    return pins


def _op_release(server: DaemonServer, conn: Connection, lease: int | None = None,
                leases: list | None = None, instance: str | None = None) -> dict[str, Any]:
    if (lease is None) == (leases is None):
        raise ProtocolError("release: give exactly one of 'lease' (an int) or 'leases' (a list of ints)")
    assert server.cache is not None
    if instance is not None and instance != server.instance:
        # ids an earlier daemon run granted (this one may have given the same ids to others)
        return {"released": 0} if leases is not None else {"valid": False}
    taken = server.leases.take_many(conn, [lease] if leases is None else leases, "get")
    for held in taken:
        end_lease(server.cache, held, commit=False)
    released = len(taken)
    server.count("released", sum(1 for held in taken if held.conn is None), of=server.holders.counters)
    if leases is not None:
        return {"released": released}
    # valid=False: the lease expired before release, so the bytes copied may be foreign
    return {"valid": released == 1}


def _op_contains(server: DaemonServer, conn: Connection, key: str, namespace: str | None = None) -> dict[str, Any]:
    assert server.cache is not None
    return {"found": server.cache.contains(key, namespace=namespace)}


def _op_delete(server: DaemonServer, conn: Connection, key: str, namespace: str | None = None) -> dict[str, Any]:
    assert server.cache is not None
    deleted = server.cache.delete(key, namespace=namespace)
    server.prefetcher.forget(namespace, key)
    return {"deleted": deleted}


def _op_stats(server: DaemonServer, conn: Connection) -> dict[str, Any]:
    return {"stats": server.stats()}


#: op name (as :func:`~ectier.daemon.protocol.parse_request` accepts it) -> handler
HANDLERS: dict[str, Callable[..., dict[str, Any]]] = {
    "hello": _op_hello,
    "ping": _op_ping,
    "reserve": _op_reserve,
    "commit": _op_commit,
    "abort": _op_abort,
    "bye": _op_bye,
    "get": _op_get,
    "prefetch": _op_prefetch,
    "release": _op_release,
    "contains": _op_contains,
    "delete": _op_delete,
    "stats": _op_stats,
}
