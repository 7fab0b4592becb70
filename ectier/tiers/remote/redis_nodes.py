"""Per-node back-off of the Redis backend in cluster mode (docs/remote-redis.md, "One dead node
is not an outage"): a node that refuses or times out is unreachable for ``remote.backoff_s``; the
calls that need it fail at once (:class:`~ectier.tiers.remote.backend.RemoteNodeError`,
``skipped``) while the other nodes serve; only when every node is unreachable is the error the
whole store's (a plain :class:`~ectier.tiers.remote.backend.RemoteError`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

try:  # the ``remote`` extra (redis.py says how to install it)
    from redis.exceptions import NoPermissionError, RedisClusterException, ResponseError
    from redis.exceptions import TimeoutError as RedisTimeoutError
except ImportError:  # pragma: no cover - exercised only without the extra
    NoPermissionError = RedisClusterException = ResponseError = RedisTimeoutError = Exception  # type: ignore[misc, assignment]

from .backend import RemoteError, RemoteNodeError, RemoteNodeTimeout

__all__ = ["NodeBackoff", "is_cluster"]

log = logging.getLogger("ectier.tiers.remote.redis")


def is_cluster(client: Any) -> bool:
    """Whether the server of ``client`` (a ``redis.Redis``) is a cluster node (``INFO cluster``;
    ``CLUSTER INFO`` where an ACL forbids INFO). Raises redis-py's errors (no answer, refused)."""
    try:
        return bool(int(client.info("cluster").get("cluster_enabled", 0)))
    except NoPermissionError:
        pass
    try:
        client.execute_command("CLUSTER INFO")
        return True
    except ResponseError:  # "cluster support disabled"
        return False


class NodeBackoff:
    """Mixin of :class:`~ectier.tiers.remote.redis.RedisBackend`: which cluster nodes are in their
    back-off. Needs ``_cfg`` (``addresses``), ``_mode``, ``_backoff_s`` (seconds), ``_down``
    (``{"host:port": monotonic end}``) and ``_down_lock`` (a lock) on the instance."""

    _cfg: Any
    _mode: str
    _backoff_s: float
    _down: dict[str, float]
    _down_lock: threading.Lock

    def _node_of(self, client: Any, key: str) -> str | None:
        """``host:port`` of the cluster node serving ``key`` (None for one server)."""
        if self._mode != "cluster":
            return None
        try:
            return client.get_node_from_key(key).name
        except RedisClusterException:  # a slot no node serves: the command says so
            return None

    def _every_node_down(self, client: Any, now: float) -> bool:
        with self._down_lock:
            down = {n for n, until in self._down.items() if until > now}
        try:
            return {n.name for n in client.get_primaries()} <= down
        except Exception:  # noqa: BLE001 - no topology: not known to be all down
            return False

    def _check_node(self, client: Any, node: str, what: str) -> None:
        """Raise at once when ``node`` is in its back-off (a store error when every node is)."""
        now = time.monotonic()
        with self._down_lock:
            until = self._down.get(node)
        if until is None or until <= now:
            return  # up, or its back-off is over: this command tries it again
        if self._every_node_down(client, now):
            raise RemoteError(f"redis {what} on {self._cfg.addresses}: every cluster node is unreachable")
        raise RemoteNodeError(f"redis {what}: node {node} is unreachable (retried after its back-off)",
                              node=node, skipped=True)

    def _node_failed(self, client: Any, node: str, exc: Exception, what: str) -> RemoteError:
        """Mark ``node`` unreachable for ``remote.backoff_s``; the error to raise."""
        now = time.monotonic()
        with self._down_lock:
            first = node not in self._down
            self._down[node] = now + self._backoff_s
        if first:  # one line per node outage
            log.warning("remote tier: redis node %s is unreachable (%s: %s); entries with a part on it are "
                        "misses, the other nodes keep serving; retried every %.1f s",
                        node, type(exc).__name__, exc, self._backoff_s)
        if self._every_node_down(client, now):
            return RemoteError(f"redis {what} on {self._cfg.addresses}: every cluster node is unreachable "
                               f"({type(exc).__name__}: {exc})")
        timed_out = isinstance(exc, (RedisTimeoutError, TimeoutError))
        cls = RemoteNodeTimeout if timed_out else RemoteNodeError
        return cls(f"redis {what} on node {node}: {type(exc).__name__}: {exc}", node=node)

    def _node_ok(self, node: str) -> None:
        with self._down_lock:
            back = self._down.pop(node, None) is not None
        if back:
            log.warning("remote tier: redis node %s is answering again", node)

