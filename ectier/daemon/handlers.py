"""The daemon's request handlers: one function per protocol op (:mod:`ectier.daemon.protocol`).

:func:`handle` answers one decoded request of a connection with a reply dict; it never raises.
Errors become error replies: :class:`ProtocolError` (also counted in the server's
``protocol_errors``), any :class:`~ectier.errors.EctierError` by its class name, ``ValueError`` /
``TypeError`` from the cache's input checks, and anything else as ``InternalError`` (logged).

``hello`` must be a connection's first request; any other op before it is a ``ProtocolError``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable

from .. import __version__
from ..errors import EctierError
from .connections import Connection
from .leases import end_lease
from .protocol import PROTOCOL_VERSION, ProtocolError, error_reply, ok_reply, parse_request

if TYPE_CHECKING:
    from .server import DaemonServer

__all__ = ["HANDLERS", "handle"]

log = logging.getLogger("ectier.daemon")


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
        server.counters["protocol_errors"] += 1
        return error_reply(rid, "ProtocolError", str(exc))
    except EctierError as exc:
        return error_reply(rid, type(exc).__name__, str(exc))
    except (ValueError, TypeError) as exc:  # validation errors from the cache's inputs
        return error_reply(rid, type(exc).__name__, str(exc))
    except Exception as exc:  # keep serving everyone else; this request failed
        log.exception("request %r failed", msg if isinstance(msg, dict) else None)
        return error_reply(rid, "InternalError", f"{type(exc).__name__}: {exc}")


def _op_hello(server: DaemonServer, conn: Connection, version: int, client: str = "") -> dict[str, Any]:
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"hello: client speaks protocol {version}, daemon speaks {PROTOCOL_VERSION}")
    conn.name = client[:200]
    conn.greeted = True
    return {
        "version": PROTOCOL_VERSION,
        "server": f"ectier {__version__}",
        "namespace": server.config.namespace,
        "arena": {"path": server.arena_path, "nbytes": server.cache.host_arena_bytes,
                  "block_bytes": server.config.host.block_bytes},
        "lease_s": server.config.daemon.lease_s,
    }


def _op_ping(server: DaemonServer, conn: Connection) -> dict[str, Any]:
    return {}


def _op_reserve(server: DaemonServer, conn: Connection, key: str, dtype: str, shape: tuple,
                namespace: str | None = None) -> dict[str, Any]:
    assert server.cache is not None
    handle = server.cache.reserve(key, dtype=dtype, shape=shape, namespace=namespace)
    lease_id = server.leases.grant(conn, "put", handle)
    return {"lease": lease_id, "nbytes": handle.meta.nbytes, "extents": [list(e) for e in handle.extents]}


def _op_commit(server: DaemonServer, conn: Connection, lease: int) -> dict[str, Any]:
    held = server.leases.take(conn, lease, "put")
    if held is None:
        raise EctierError(f"commit: lease {lease} is unknown or expired; the put was aborted, retry it")
    assert server.cache is not None
    end_lease(server.cache, held, commit=True)
    return {}


def _op_abort(server: DaemonServer, conn: Connection, lease: int) -> dict[str, Any]:
    held = server.leases.take(conn, lease, "put")
    if held is not None:
        assert server.cache is not None
        end_lease(server.cache, held, commit=False)
    return {"aborted": held is not None}


def _op_get(server: DaemonServer, conn: Connection, key: str, namespace: str | None = None) -> dict[str, Any]:
    assert server.cache is not None
    handle = server.cache.acquire(key, namespace=namespace)
    if handle is None:
        return {"hit": False}
    lease_id = server.leases.grant(conn, "get", handle)
    meta = handle.meta
    return {"hit": True, "lease": lease_id, "dtype": meta.dtype, "shape": list(meta.shape),
            "nbytes": meta.nbytes, "extents": [list(e) for e in handle.extents]}


def _op_release(server: DaemonServer, conn: Connection, lease: int) -> dict[str, Any]:
    held = server.leases.take(conn, lease, "get")
    if held is not None:
        assert server.cache is not None
        end_lease(server.cache, held, commit=False)
    # valid=False: the lease expired before release, so the bytes copied may be foreign
    return {"valid": held is not None}


def _op_contains(server: DaemonServer, conn: Connection, key: str, namespace: str | None = None) -> dict[str, Any]:
    assert server.cache is not None
    return {"found": server.cache.contains(key, namespace=namespace)}


def _op_delete(server: DaemonServer, conn: Connection, key: str, namespace: str | None = None) -> dict[str, Any]:
    assert server.cache is not None
    return {"deleted": server.cache.delete(key, namespace=namespace)}


def _op_stats(server: DaemonServer, conn: Connection) -> dict[str, Any]:
    return {"stats": server.stats()}


#: op name (as :func:`~ectier.daemon.protocol.parse_request` accepts it) -> handler
HANDLERS: dict[str, Callable[..., dict[str, Any]]] = {
    "hello": _op_hello,
    "ping": _op_ping,
    "reserve": _op_reserve,
    "commit": _op_commit,
    "abort": _op_abort,
    "get": _op_get,
    "release": _op_release,
    "contains": _op_contains,
    "delete": _op_delete,
    "stats": _op_stats,
}
