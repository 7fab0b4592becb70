"""The Redis-protocol backend of the remote tier: a Redis / Valkey Cluster, or one server.

Layout of one object ``key`` (``P`` = ``remote.prefix``, ``G`` = a random 128-bit generation in
hex, new on every put)::

    P:c:<key>:G:0 ... P:c:<key>:G:<n-1>   the chunks, remote.chunk_bytes each (the last shorter)
    P:m:<key>                             the manifest (52 bytes), written LAST

The manifest holds the generation, the chunk count and size, the total length and an xxh3-64 of
the whole object. A reader fetches the manifest, then the chunks of that generation, and checks
count, sizes, length and hash: anything missing or different (a writer that died between chunks
and manifest, a chunk evicted by the server's ``maxmemory`` policy, a concurrent overwrite that
already dropped the chunks being read) is a miss (``None``), never wrong bytes. A put writes the
chunks, then the manifest with ``SET ... GET`` (Redis >= 6.2 / Valkey), which returns the manifest
it replaced, and then unlinks exactly that generation's chunks (so two writers racing on one key
leave no orphans); a put that fails (refused, a node down) unlinks the chunks it wrote on the
nodes that answer. Chunks of a writer that died before its manifest stay until the server's
eviction policy removes them (run the store with ``maxmemory`` and ``allkeys-lru``).

No hash tags: the chunks of one object spread over the cluster's nodes (their memory stays
balanced and a large object does not fill one node); docs/benchmarks.md ("Remote tier: Redis
Cluster") has the measurement.

Deadlines: every socket operation is bounded by ``remote.timeout_s`` (``socket_timeout`` and
``socket_connect_timeout``; redis-py's retries off), and each command, and each of its reads and
sends, by the call's ``deadline_s`` (``redis_deadline``: a trickling reply is cut off), so a call
ends within ``deadline_s`` (a connect within at most one socket timeout more). Commands go one at
a time (one chunk each), not in redis-py's cluster pipelines: a cluster pipeline resends every command that failed on a dead node one by one, each waiting its
own socket timeout, which no deadline bounds. At chunks of a few MiB a round trip per chunk costs
little (docs/benchmarks.md).

A dead node (cluster mode): a command on a key of that node that fails to connect or times out
marks the node unreachable for ``remote.backoff_s``; while it is, every command that needs it
fails at once (:class:`~ectier.tiers.remote.backend.RemoteNodeError`, ``skipped``) and the other
nodes keep serving their keys: the tier counts these and backs off nothing. An entry is readable
while its manifest and all its chunks are on live nodes. Only when every node is unreachable, or
no node answers at connect, is the error one for the whole store (the tier's back-off).

Thread-safe: redis-py's clients keep a connection pool (one per node in a cluster); the client is
made on first use (under a lock) and again after a failed connect, so a store that is down at start
is reached once it is up.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any, Callable, Sequence

import xxhash

try:  # the ``remote`` extra; RedisBackend() says how to install it when it is missing
    import redis
    from redis.backoff import NoBackoff
    from redis.cluster import ClusterNode, RedisCluster
    from redis.exceptions import AuthenticationError, RedisClusterException, RedisError
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import ResponseError
    from redis.exceptions import TimeoutError as RedisTimeoutError
    from redis.retry import Retry

    from .redis_deadline import command_deadline, connection_class
except ImportError as _exc:  # pragma: no cover - exercised only without the extra
    redis = None
    _IMPORT_ERROR: ImportError | None = _exc
else:
    _IMPORT_ERROR = None

from ...errors import ConfigError, CorruptRecordError
from ...record import pack_header, pack_record
from .backend import RemoteBackend, RemoteError, RemoteNodeError, RemoteRefused, RemoteTimeout, byte_view
from .redis_manifest import MANIFEST, Manifest
from .redis_nodes import NodeBackoff, is_cluster

__all__ = ["RedisBackend", "MANIFEST"]

log = logging.getLogger(__name__)

class _Deadline:
    def __init__(self, seconds: float) -> None:
        if isinstance(seconds, bool) or not isinstance(seconds, (int, float)) or not seconds > 0:
            raise ValueError(f"deadline_s: expected seconds > 0, got {seconds!r}")
        self.seconds = float(seconds)
        self.end = time.monotonic() + self.seconds

    def check(self, what: str) -> None:
        if time.monotonic() >= self.end:
            raise RemoteTimeout(f"redis {what}: past its deadline of {self.seconds:g} s")


def _check_key(key: Any) -> str:
    if not isinstance(key, str) or not key:
        raise ValueError(f"key: expected a non-empty str, got {key!r}")
    return key


if redis is not None:
    class _OneNodeCommandCluster(RedisCluster):
        """RedisCluster with ``COMMAND`` (the key-position table it reads once) asked of the node
        ``first`` (``host:port``, one that answered) only (see :meth:`RedisBackend._cluster_client`)."""

        def __init__(self, *, first: str, **kwargs: Any) -> None:
            self._first = first
            super().__init__(**kwargs)

        def command(self, **kwargs: Any) -> Any:
            node = self.get_node(node_name=self._first) or self.get_default_node()
            return self.execute_command("COMMAND", target_nodes=node, **kwargs)


class RedisBackend(NodeBackoff, RemoteBackend):
    """Objects on a Redis / Valkey Cluster or one server (``remote.backend: redis``).

    Args:
        cfg: a :class:`~ectier.config.RemoteTierConfig`: ``addresses`` (seed nodes; a server with
            ``cluster_enabled:0`` is used as one plain server), ``prefix``, ``timeout_s`` (every
            socket operation), ``chunk_bytes``, ``username`` / ``password`` (AUTH / ACL), ``tls`` /
            ``tls_ca_path``.

    No I/O happens here: the first call connects.

    Raises:
        ConfigError: the ``redis`` package is not installed (``pip install 'ectier[remote]'``).
    """

    name = "redis"

    def __init__(self, cfg: Any) -> None:
        if _IMPORT_ERROR is not None:
            raise ConfigError("remote.backend: 'redis' needs the redis package: pip install 'ectier[remote]' "
                              f"({_IMPORT_ERROR})")
        self._cfg = cfg
        self._addresses = cfg.address_list
        self._prefix = cfg.prefix
        self._chunk_bytes = int(cfg.chunk_bytes)
        self._max_total = int(cfg.max_entry_bytes)  # no object of ours is larger (see RemoteTier)
        self._lock = threading.Lock()
        self._client: Any = None
        self._mode = "not connected"
        self._closed = False
        self._backoff_s = float(cfg.backoff_s)
        self._down: dict[str, float] = {}  # cluster node "host:port" -> monotonic end of its back-off
        self._down_lock = threading.Lock()
        self._auth_logged = False

    # ------------------------------------------------------------------ connection

    def _client_kwargs(self) -> dict[str, Any]:
        cfg = self._cfg
        kw: dict[str, Any] = dict(socket_timeout=cfg.timeout_s, socket_connect_timeout=cfg.timeout_s,
                                  username=cfg.username, password=cfg.password, retry=Retry(NoBackoff(), 0))
        if cfg.tls:
            kw.update(ssl=True, ssl_ca_certs=cfg.tls_ca_path)
        return kw

    def _probe(self, dl: _Deadline) -> tuple[tuple[str, int], bool]:
        """The first address that answers, and whether it is a cluster node (``INFO cluster``
        says ``cluster_enabled:1``; where an ACL forbids INFO, ``CLUSTER INFO`` answers). Each
        seed gets an equal share of what is left of the deadline: a seed that accepts the
        connection and never answers (a hung node) does not use it all."""
        error: Exception | None = None
        for i, (host, port) in enumerate(self._addresses):
            dl.check("connect")
            share = max(0.05, (dl.end - time.monotonic()) / (len(self._addresses) - i))
            client = redis.Redis(host, port, **{**self._client_kwargs(), "socket_timeout": share,
                                                "socket_connect_timeout": share})
            try:
                return (host, port), is_cluster(client)
            except Exception as exc:
                error = exc
            finally:
                client.close()
        assert error is not None
        raise error

    def _connect(self, dl: _Deadline) -> Any:
        """The client, made on first use and again after a failed connect (one thread at a time;
        the others wait for it while their deadline lasts)."""
        if not self._lock.acquire(timeout=max(0.0, dl.end - time.monotonic())):
            raise RemoteTimeout(f"redis connect to {self._cfg.addresses}: past its deadline of {dl.seconds:g} s")
        try:
            if self._closed:
                raise RemoteError("redis: the backend is closed")
            if self._client is None:
                first, is_cluster = self._probe(dl)
                if is_cluster:  # the node that answered first, then the other seeds
                    seeds = [first] + [a for a in self._addresses if a != first]
                    self._client = self._cluster_client(seeds)
                else:
                    self._client = self._single_client(first)
                self._mode = "cluster" if is_cluster else "single"
            return self._client
        finally:
            self._lock.release()

    def _cluster_client(self, seeds: list[tuple[str, int]]) -> Any:
        """A RedisCluster client whose ``COMMAND`` (sent once, while it is made) goes to the node
        that answered first (``seeds[0]``): redis-py sends it to its default node, which may be a
        dead one, and then no client could be made while that node is down."""
        return _OneNodeCommandCluster(first=f"{seeds[0][0]}:{seeds[0][1]}", startup_nodes=[ClusterNode(h, p) for h, p in seeds],
                                      require_full_coverage=False, connection_class=connection_class(self._cfg.tls),
                                      **self._client_kwargs())

    def _single_client(self, address: tuple[str, int]) -> Any:
        """A client of one server on the deadline connections (``Redis(ssl=True)`` would not be)."""
        kw = {k: v for k, v in self._client_kwargs().items() if k != "ssl"}
        return redis.Redis.from_pool(redis.ConnectionPool(  # (from_pool: close() closes the pool too)
            host=address[0], port=address[1], connection_class=connection_class(self._cfg.tls), **kw))

    def _call(self, what: str, dl: _Deadline, fn: Callable[[Any], Any]) -> Any:
        """``fn(client)`` with redis-py's errors mapped to RemoteTimeout / RemoteError, or to
        CorruptRecordError for a key of another type than a string (``WRONGTYPE``: a miss of that
        key, not an outage of the store)."""
        try:
            return fn(self._connect(dl))
        except RemoteError:
            raise
        except AuthenticationError as exc:
            raise self._auth_failed(what, exc) from exc
        except (RedisTimeoutError, TimeoutError) as exc:
            raise RemoteTimeout(f"redis {what} on {self._cfg.addresses}: timed out ({exc})") from exc
        except ResponseError as exc:
            if str(exc).startswith("WRONGTYPE"):  # another writer's key under the prefix: this key's fault
                raise CorruptRecordError(f"redis {what}: a key under prefix {self._prefix!r} is not a string "
                                         f"({exc}); is another tool writing under remote.prefix?") from exc
            if type(exc).__name__ == "OutOfMemoryError" or "maxmemory" in str(exc):  # noeviction: refused, not down
                raise RemoteRefused(f"redis {what} on {self._cfg.addresses}: {exc} (maxmemory; "
                                    "docs/remote-redis.md recommends maxmemory-policy allkeys-lru)") from exc
            raise RemoteError(f"redis {what} on {self._cfg.addresses}: {type(exc).__name__}: {exc}") from exc
        except (RedisError, RedisClusterException, OSError) as exc:
            raise RemoteError(f"redis {what} on {self._cfg.addresses}: {type(exc).__name__}: {exc}") from exc

    def _auth_failed(self, what: str, exc: Exception) -> RemoteError:
        """The error for refused credentials, logged once (not an outage: a setting is wrong)."""
        user = self._cfg.username or "default"
        msg = (f"redis {what} on {self._cfg.addresses}: authentication failed for user {user!r} ({exc}); "
               "check remote.username / remote.password")
        if not self._auth_logged:
            self._auth_logged = True
            log.error("remote tier: %s", msg)
        return RemoteError(msg)

    def _cmd(self, client: Any, method: str, args: tuple, dl: _Deadline, what: str, **kw: Any) -> Any:
        """One command on the key ``args[0]``, the deadline and (in a cluster) the key's node checked
        first; a node that fails to connect or times out is marked unreachable (not one whose
        reply the call's deadline cut: that is the call's RemoteTimeout)."""
        dl.check(what)
        node = self._node_of(client, args[0])
        if node is None:
            with command_deadline(dl.end):
                return getattr(client, method)(*args, **kw)
        self._check_node(client, node, what)
        try:
            with command_deadline(dl.end) as cmd:
                out = getattr(client, method)(*args, **kw)
        except AuthenticationError:
            raise
        except (RedisConnectionError, RedisTimeoutError, TimeoutError, OSError) as exc:
            if not cmd.blames_node(self._cfg.timeout_s / 2):  # the call ran out of time: as dl.check
                raise RemoteTimeout(f"redis {what}: past its deadline of {dl.seconds:g} s") from exc
            raise self._node_failed(client, node, exc, what) from exc
        if self._down:
            self._node_ok(node)
        return out

    # ------------------------------------------------------------------ keys

    def _manifest_key(self, key: str) -> str:
        return f"{self._prefix}:m:{key}"

    def _chunk_keys(self, key: str, m: Manifest) -> list[str]:
        gen = m.generation.hex()
        return [f"{self._prefix}:c:{key}:{gen}:{i}" for i in range(m.n_chunks)]

    # ------------------------------------------------------------------ commands, one at a time

    def _run(self, client: Any, cmds: Sequence[tuple[str, tuple]], dl: _Deadline, what: str) -> list[Any]:
        """Commands ``(method, args)`` one after the other, each through :meth:`_cmd`."""
        return [self._cmd(client, method, args, dl, what) for method, args in cmds]

    # ------------------------------------------------------------------ the interface

    def put(self, key: str, data: bytes | memoryview, *, deadline_s: float) -> None:
        """Store ``data`` (bytes-like, C-contiguous) under ``key``: chunks, then the manifest.

        Raises:
            ValueError / TypeError: a bad key, data or deadline_s.
            RemoteError, RemoteTimeout: the store failed or the deadline passed (the old object, if
                any, is then still the one readers see, or the new one if only the clean-up failed).
        """
        _check_key(key)
        dl = _Deadline(deadline_s)
        view = byte_view(data)
        cb = self._chunk_bytes
        chunks = [view[i * cb:(i + 1) * cb] for i in range(-(-len(view) // cb))]
        self._put_chunks(key, chunks, len(view), xxhash.xxh3_64_intdigest(view), dl)

    def put_record(self, key: str, header: Any, payload: Any, *, deadline_s: float,
                   checksum_known: bool = False) -> None:
        """Store one record (``header``: a :class:`~ectier.record.RecordHeader`, stored as given
        whatever ``checksum_known`` says; then ``payload``)
        as :meth:`put` stores their concatenation, without building it: only the first chunk
        (the header and the payload's first bytes) is copied, every other chunk is a view of
        ``payload`` (docs/benchmarks.md, "Remote tier": the join cost a 64 MiB put ~40 %).

        Raises:
            ValueError / TypeError: a bad key, payload or deadline_s.
            RemoteError, RemoteTimeout: as :meth:`put`.
        """
        _check_key(key)
        head = pack_header(header)
        body = byte_view(payload)
        if len(body) != header.payload_nbytes:
            raise ValueError(f"payload: {len(body)} bytes, header.payload_nbytes is {header.payload_nbytes}")
        cb = self._chunk_bytes
        if len(head) >= cb:
            self.put(key, pack_record(header, payload), deadline_s=deadline_s)
            return
        dl = _Deadline(deadline_s)
        first = cb - len(head)
        chunks: list[Any] = [b"".join((head, body[:first]))]
        chunks += [body[i:i + cb] for i in range(first, len(body), cb)]
        digest = xxhash.xxh3_64(head)
        digest.update(body)
        self._put_chunks(key, chunks, len(head) + len(body), digest.intdigest(), dl)

    def _put_chunks(self, key: str, chunks: list[Any], total: int, digest: int, dl: "_Deadline") -> None:
        """Write ``chunks`` (each ``chunk_bytes`` but the last) and then the manifest over them."""
        m = Manifest(len(chunks), self._chunk_bytes, total, digest, os.urandom(16))
        ckeys = self._chunk_keys(key, m)
        cmds = [("set", (k, chunk)) for k, chunk in zip(ckeys, chunks)]

        def write(client: Any) -> tuple[Any, bytes | None]:
            try:
                self._run(client, cmds, dl, "put")
            except (ResponseError, RemoteNodeError):  # refused (out of memory, ...), or a node down:
                self._forget(client, ckeys, dl)  # the chunks written have no manifest and no TTL
                raise
            try:
                return client, self._cmd(client, "set", (self._manifest_key(key), m.pack()), dl, "put", get=True)
            except ResponseError:  # refused: not set (a node error may have set it: its chunks stay)
                self._forget(client, ckeys, dl)
                raise

        client, replaced = self._call("put", dl, write)
        old = Manifest.parse(replaced, self._max_total, cleanup=True)
        if old is not None and old.generation != m.generation:
            self._forget(client, self._chunk_keys(key, old), dl)

    def _forget(self, client: Any, keys: list[str], dl: _Deadline) -> None:
        """Unlink chunks nobody reads any more, each one while the deadline lasts (best effort: a
        chunk on a node that is down, or past the deadline, is garbage for the eviction policy)."""
        for i, k in enumerate(keys):
            try:
                self._cmd(client, "unlink", (k,), dl, "unlink")
            except RemoteNodeError:
                continue  # (that node's chunks: maybe none were written there)
            except Exception as exc:
                log.debug("redis: left %d unreadable chunks to eviction: %s", len(keys) - i, exc)
                return

    def get(self, key: str, *, deadline_s: float) -> bytes | None:
        """The object under ``key``; ``None`` when absent or not whole (a chunk missing).

        Raises:
            ValueError: a bad key or deadline_s.
            CorruptRecordError: a manifest that is not one, a chunk of the wrong size, a wrong hash.
            RemoteError, RemoteTimeout.
        """
        _check_key(key)
        dl = _Deadline(deadline_s)

        def read(client: Any) -> bytes | None:
            m = Manifest.parse(self._cmd(client, "get", (self._manifest_key(key),), dl, "get"), self._max_total,
                                strict=True)
            if m is None:
                return None
            chunks = self._run(client, [("get", (k,)) for k in self._chunk_keys(key, m)], dl, "get")
            return self._assemble(key, m, chunks)

        return self._call("get", dl, read)

    def _assemble(self, key: str, m: Manifest, chunks: list[Any]) -> bytes | None:
        """The object's bytes; ``None`` if a chunk is missing (evicted by the server, or removed
        by an overwrite or delete since the manifest was read: a plain miss).

        Raises:
            CorruptRecordError: a chunk of the wrong size, or bytes whose xxh3 is not the manifest's.
        """
        last = m.total - (m.n_chunks - 1) * m.chunk_bytes
        for i, c in enumerate(chunks):
            if c is None:
                log.debug("redis get %r: chunk %d of %d missing: a miss", key, i, m.n_chunks)
                return None
            if len(c) != (last if i == m.n_chunks - 1 else m.chunk_bytes):
                raise CorruptRecordError(f"chunk {i} of {m.n_chunks} has {len(c)} bytes, not what its manifest says")
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        if xxhash.xxh3_64_intdigest(data) != m.digest:
            raise CorruptRecordError("the chunks' xxh3 is not the manifest's")
        return data

    def exists(self, key: str, *, deadline_s: float) -> bool:
        """Whether the manifest of ``key`` and every chunk it names are stored (contents unchecked).

        Raises:
            ValueError: a bad key or deadline_s.
            RemoteError, RemoteTimeout.
        """
        _check_key(key)
        dl = _Deadline(deadline_s)

        def check(client: Any) -> bool:
            m = Manifest.parse(self._cmd(client, "get", (self._manifest_key(key),), dl, "exists"), self._max_total)
            if m is None:
                return False
            keys = self._chunk_keys(key, m)
            return not keys or sum(self._run(client, [("exists", (k,)) for k in keys], dl, "exists")) == len(keys)

        return self._call("exists", dl, check)

    def delete(self, key: str, *, deadline_s: float) -> None:
        """Remove the object under ``key`` (manifest first, atomically with ``GETDEL``; then its
        chunks). No error if absent.

        Raises:
            ValueError: a bad key or deadline_s.
            RemoteError, RemoteTimeout.
        """
        _check_key(key)
        dl = _Deadline(deadline_s)

        def drop(client: Any) -> None:
            m = Manifest.parse(self._cmd(client, "getdel", (self._manifest_key(key),), dl, "delete"), self._max_total,
                                cleanup=True)
            if m is not None:
                self._run(client, [("unlink", (k,)) for k in self._chunk_keys(key, m)], dl, "delete")

        self._call("delete", dl, drop)

    def describe(self) -> dict[str, Any]:
        """``backend``, ``addresses``, ``mode`` (``cluster``, ``single`` or ``not connected``),
        ``prefix``, ``chunk_bytes``, ``tls``, ``auth`` (whether a password is set), ``nodes_down``
        (the cluster nodes now in their back-off, ``host:port``). Never the password."""
        now = time.monotonic()
        with self._down_lock:
            down = sorted(n for n, until in self._down.items() if until > now)
        return {"backend": self.name, "addresses": self._cfg.addresses, "mode": self._mode,
                "prefix": self._prefix, "chunk_bytes": self._chunk_bytes, "tls": bool(self._cfg.tls),
                "auth": self._cfg.password is not None, "nodes_down": down}

    def close(self) -> None:
        """Close every connection. Idempotent; calls after it raise RemoteError."""
        with self._lock:
            client, self._client, self._closed = self._client, None, True
        if client is not None:
            try:
                client.close()
            except Exception as exc:
                log.debug("redis: close: %s", exc)
