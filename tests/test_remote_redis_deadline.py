"""A Redis command ends by its call's deadline even when its reply trickles in: redis-py's
``socket_timeout`` bounds each ``recv`` alone, and a 1 MiB reply at ~80 KB/s held a ``get`` with
``remote.timeout_s: 1`` for 13 s (``ectier/tiers/remote/redis_deadline.py``). Through a proxy on
loopback that slows the server's replies when told to."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from ectier.config import RemoteTierConfig
from ectier.tiers.remote.backend import RemoteTimeout
from ectier.tiers.remote.redis import RedisBackend
from redis_cluster import redis_cluster, redis_cluster_fn, redis_single  # noqa: F401

MiB = 1 << 20


class SlowLink:
    """A TCP proxy on loopback to ``port``; once :attr:`slow` is set, the server's bytes go on
    in 16 KiB pieces every 0.2 s (~80 KB/s: every ``recv`` answers well within a second)."""

    def __init__(self, port: int) -> None:
        self.port, self.slow, self.closed = port, threading.Event(), threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.settimeout(0.2)
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed.is_set():
            try:
                client, _ = self.listener.accept()
            except (socket.timeout, OSError):
                continue
            server = socket.create_connection(("127.0.0.1", self.port))
            threading.Thread(target=self._pipe, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, True), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, replies: bool) -> None:
        try:
            while data := src.recv(MiB):
                slow = replies and self.slow.is_set()
                step = 16 << 10 if slow else len(data)
                for i in range(0, len(data), step):
                    dst.sendall(data[i:i + step])
                    if slow:
                        time.sleep(0.2)
        except OSError:
            pass
        finally:
            src.close()
            dst.close()

    def close(self) -> None:
        self.closed.set()
        self.listener.close()


@pytest.fixture
def link(redis_single):
    proxy = SlowLink(redis_single.nodes[0].port)
    yield proxy
    proxy.close()


def test_a_trickling_reply_ends_by_the_calls_deadline(link):
    be = RedisBackend(RemoteTierConfig(backend="redis", addresses=link.address, timeout_s=1.0))
    try:
        data = os.urandom(MiB)
        be.put("trickle", data, deadline_s=10.0)
        assert be.get("trickle", deadline_s=10.0) == data  # the link is fast
        link.slow.set()
        t0 = time.monotonic()
        with pytest.raises(RemoteTimeout):
            be.get("trickle", deadline_s=1.0)
        took = time.monotonic() - t0
        assert took < 1.6, f"a get with a 1 s deadline took {took:.1f} s over a slow link"
        link.slow.clear()
        assert be.get("trickle", deadline_s=10.0) == data  # a new connection: nothing half-read is left
    finally:
        be.close()


def test_a_slow_reply_that_fits_the_deadline_is_served(link):
    """Only what is left of the deadline cuts a reply: 128 KiB at ~80 KB/s (~1.6 s, every piece
    well within the 1 s socket timeout) inside a 10 s deadline is a hit."""
    be = RedisBackend(RemoteTierConfig(backend="redis", addresses=link.address, timeout_s=1.0))
    try:
        data = os.urandom(128 << 10)
        be.put("slow", data, deadline_s=10.0)
        link.slow.set()
        t0 = time.monotonic()
        assert be.get("slow", deadline_s=10.0) == data
        assert time.monotonic() - t0 > 1.0  # (it did go through the slow link)
    finally:
        be.close()


def test_a_reply_cut_by_the_calls_deadline_leaves_a_healthy_cluster_node_up(redis_cluster):
    """A call that runs out of its own deadline while a healthy node answers (a 48 MiB reply
    with a few ms to go) is the call's RemoteTimeout: it used to mark the node unreachable for
    ``remote.backoff_s``, every key with a part on it a miss meanwhile."""
    be = RedisBackend(RemoteTierConfig(backend="redis", addresses=redis_cluster.addresses, timeout_s=2.0,
                                       chunk_bytes=64 * MiB, backoff_s=30.0))
    try:
        big = os.urandom(48 * MiB)  # one chunk: one GET whose reply takes some ms on loopback
        be.put("big", big, deadline_s=30.0)
        small = {f"s{i}": os.urandom(100) for i in range(30)}  # keys on every node
        for k, v in small.items():
            be.put(k, v, deadline_s=10.0)
        cuts = 0
        for ms in (30, 20, 10, 5, 3, 2, 1):
            try:
                be.get("big", deadline_s=ms / 1000)
            except RemoteTimeout:
                cuts += 1
            assert be.describe()["nodes_down"] == [], (ms, be.describe()["nodes_down"])
        assert cuts
        assert all(be.get(k, deadline_s=10.0) == v for k, v in small.items())
    finally:
        be.close()


def test_a_hung_cluster_node_is_still_marked_unreachable(redis_cluster_fn):
    """A node that answers nothing while a command waits most of the deadline is failing, even
    though the deadline (not the socket's own timeout) ended the wait: it is backed off alone,
    the other nodes' keys keep being served."""
    servers = redis_cluster_fn
    be = RedisBackend(RemoteTierConfig(backend="redis", addresses=servers.addresses, timeout_s=1.0,
                                       backoff_s=30.0))
    try:
        keys = {f"k{i}": os.urandom(100) for i in range(12)}
        for k, v in keys.items():
            be.put(k, v, deadline_s=10.0)
        victim = servers.node_of("ectier:m:k0")
        servers.pause(victim)
        try:
            with pytest.raises(RemoteTimeout):
                be.get("k0", deadline_s=1.0)
            assert be.describe()["nodes_down"] == [victim.address]
        finally:
            servers.resume(victim)
    finally:
        be.close()


def test_close_closes_the_connections_to_one_server(redis_single):
    """The one-server client is built on a pool of the deadline connections; closing the backend
    closes that pool too (a pool handed to ``redis.Redis(connection_pool=)`` is left open)."""
    raw = redis_single.raw()
    try:
        before = len(raw.client_list())
        be = RedisBackend(RemoteTierConfig(backend="redis", addresses=redis_single.addresses, timeout_s=1.0))
        be.put("close-k", b"x" * 1000, deadline_s=5.0)
        assert be.get("close-k", deadline_s=5.0) == b"x" * 1000
        assert len(raw.client_list()) > before
        be.close()
        assert len(raw.client_list()) == before
    finally:
        raw.close()
