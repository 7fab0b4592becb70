"""Daemon connections, admission: hello comes first, a full daemon makes room for a new client by
closing an idle connection (never one holding leases), per-uid caps, the knobs and the admission
rule itself. Real daemon processes (tests/daemon_helpers.py).

Daemons:
- ``capped``: max_clients 4 (the default idle timeout, 300 s, outlasts every test), lease 30 s.
- ``per_uid``: max_clients 8, max_clients_per_uid 2."""

from __future__ import annotations

import os
import time

import pytest

from daemon_helpers import (
    MiB,
    RawConn,
    daemon_config,
    daemon_stats,
    host_daemon_process,
    make_tensor,
    wait_for,
    write_config,
)
from ectier import CacheConfig
from ectier.config import ConfigError
from ectier.daemon.client import DaemonClient
from ectier.daemon.protocol import PROTOCOL_VERSION


@pytest.fixture(scope="module")
def capped():
    with host_daemon_process(8 * MiB, "cfg.yaml", max_clients=4) as proc:
        yield proc


@pytest.fixture(scope="module")
def per_uid():
    with host_daemon_process(8 * MiB, "cfg.yaml", max_clients=8, max_clients_per_uid=2) as proc:
        yield proc


# ==================================================================================== hello


def test_every_request_before_hello_is_refused(capped):
    with RawConn(capped.socket_path, hello=False) as raw:
        for i, msg in enumerate([
            {"op": "get", "key": "k"},
            {"op": "contains", "key": "k"},
            {"op": "ping"},
            {"op": "stats"},
            {"op": "reserve", "key": "k", "dtype": "uint8", "shape": [8]},
            {"op": "hello", "version": PROTOCOL_VERSION + 1},  # a failed hello does not count
            {"op": "delete", "key": "k"},
        ]):
            r = raw.request({"id": i + 1, **msg})
            assert r["ok"] is False and r["id"] == i + 1, r
            assert r["error"]["type"] == "ProtocolError"
            if msg["op"] != "hello":
                assert "'hello'" in r["error"]["message"] and msg["op"] in r["error"]["message"], r
        r = raw.request({"id": 20, "op": "hello", "version": PROTOCOL_VERSION, "client": "late"})
        assert r["ok"] and r["version"] == PROTOCOL_VERSION
        assert raw.request({"id": 21, "op": "get", "key": "k"}) == {"id": 21, "ok": True, "hit": False}
        assert raw.request({"id": 22, "op": "ping"})["ok"]


# ======================================================================== connection caps


def _wait_alone(sock: str) -> None:
    wait_for(lambda: len(daemon_stats(sock)["daemon"]["clients"]) == 1, timeout=10, what="other clients to go")


def test_idle_connections_make_room_for_a_new_client(capped):
    """max_clients idle connections of one uid used to lock every new client out: now the least
    recently used idle one is closed for the newcomer, and its own client reconnects by itself."""
    sock = capped.socket_path
    first = DaemonClient(sock, client_name="first")
    raws: list[RawConn] = []
    newcomer = None
    try:
        # asked on first's own connection: once it is alone, no closed connection the daemon has
        # not noticed yet (an idle one, older than first) is left to be closed in first's place
        wait_for(lambda: len(first.stats()["daemon"]["clients"]) == 1, timeout=10, what="other clients to go")
        assert not first.contains("x")
        raws = [RawConn(sock, name=f"idle-{i}") for i in range(3)]  # 4 connections = max_clients
        newcomer = DaemonClient(sock, client_name="newcomer", connect_retry_s=0.2)
        assert not newcomer.contains("x")  # got in
        assert first.contains("x") is False  # was closed (least recently used); reconnects
        first.ping()  # (a miss may leave the reconnect to the background: this call waits for it)
        assert raws[0].reply() is None  # ... which closed the next least recently used one
        for r in raws[1:]:
            assert r.request({"id": 5, "op": "ping"})["ok"]
        s = newcomer.stats()["daemon"]
        assert s["evicted"] >= 2 and len(s["clients"]) == 4
    finally:
        for x in (first, newcomer):
            if x is not None:
                x.close()
        for r in raws:
            r.close()


def test_a_full_daemon_whose_clients_all_hold_leases_still_refuses(capped):
    sock = capped.socket_path
    _wait_alone(sock)
    seed = DaemonClient(sock, client_name="seed")
    seed.put("pinned", make_tensor(5, "uint8", (100,)))
    seed.close()
    _wait_alone(sock)
    raws = []
    try:
        for i in range(4):
            raws.append(RawConn(sock, name=f"holder-{i}"))
            assert raws[-1].request({"id": 1, "op": "get", "key": "pinned"})["hit"]
        with RawConn(sock, hello=False) as fifth:
            r = fifth.reply()
            assert r is not None and r["ok"] is False and r["error"]["type"] == "PermissionError", r
            assert "daemon.max_clients=4" in r["error"]["message"]
            assert fifth.reply() is None
        for raw in raws:  # nobody was closed
            assert raw.request({"id": 2, "op": "ping"})["ok"]
    finally:
        for raw in raws:
            raw.close()


def test_per_uid_cap(per_uid):
    """At daemon.max_clients_per_uid (below max_clients) a uid's new connection is refused when
    all of its connections hold leases, and takes the place of an idle one otherwise."""
    sock = per_uid.socket_path
    seed = DaemonClient(sock, client_name="seed")
    seed.put("pinned", make_tensor(6, "uint8", (100,)))
    seed.close()
    wait_for(lambda: len(daemon_stats(sock)["daemon"]["clients"]) == 1, timeout=10, what="the seed to go")
    raws, leases = [], []
    try:
        for i in range(2):  # this uid's cap, with leases: nothing to close
            raws.append(RawConn(sock, name=f"holder-{i}"))
            g = raws[-1].request({"id": 1, "op": "get", "key": "pinned"})
            assert g["hit"]
            leases.append(g["lease"])
        with RawConn(sock, hello=False) as third:
            r = third.reply()
            assert r is not None and r["ok"] is False and r["error"]["type"] == "PermissionError", r
            assert "daemon.max_clients_per_uid=2" in r["error"]["message"]
            assert third.reply() is None
        assert raws[0].request({"id": 2, "op": "release", "lease": leases[0]})["valid"]  # now idle
        with RawConn(sock, name="newcomer") as newcomer:
            assert newcomer.hello_reply is not None
            assert raws[0].reply() is None  # closed to make room
            assert raws[1].request({"id": 3, "op": "release", "lease": leases[1]})["valid"]  # untouched
            assert newcomer.request({"id": 4, "op": "contains", "key": "pinned"})["found"]
    finally:
        for raw in raws:
            raw.close()


@pytest.mark.parametrize("daemon, words", [
    ({"idle_timeout_s": -1}, "daemon.idle_timeout_s"),
    ({"idle_timeout_s": "soon"}, "daemon.idle_timeout_s"),
    ({"max_clients_per_uid": 0}, "daemon.max_clients_per_uid"),
    ({"max_clients": 4, "max_clients_per_uid": 5}, "daemon.max_clients_per_uid"),
])
def test_connection_knobs_are_validated(daemon, words):
    with pytest.raises(ConfigError, match=words):
        CacheConfig.from_dict({"daemon": daemon})


def test_connection_knob_defaults():
    d = CacheConfig().daemon
    assert d.idle_timeout_s == 300.0 and d.max_clients_per_uid is None


def test_admission_rule_across_users():
    """The rule of ectier.daemon.connections.admission, on connection records (no sockets): one
    user's idle connections never lock another user out; working ones are never closed."""
    from ectier.daemon.connections import Connection, admission

    def conns(spec):  # (uid, last_active, busy, leases)
        return [Connection(i, None, 100 + i, uid, uid, last_active=t, busy=busy, leases=set(range(leases)))
                for i, (uid, t, busy, leases) in enumerate(spec)]

    hog = conns([(1, 5.0, False, 0), (1, 3.0, False, 0), (1, 4.0, True, 0), (2, 1.0, False, 0)])
    victim, refusal = admission(hog, 3, max_clients=4, max_per_uid=4)
    assert refusal is None and victim is hog[1]  # the hog's least recently used idle one, not uid 2's older one
    working = conns([(1, 1.0, True, 0), (1, 2.0, False, 1), (2, 3.0, False, 0)])
    victim, refusal = admission(working, 3, max_clients=3, max_per_uid=3)
    assert refusal is None and victim is working[2]  # the hog has none idle: the next user's
    victim, refusal = admission(working[:2], 3, max_clients=2, max_per_uid=2)
    assert victim is None and "daemon.max_clients=2" in refusal
    mine = conns([(7, 1.0, False, 1), (7, 2.0, False, 0), (8, 0.5, False, 0)])
    victim, refusal = admission(mine, 7, max_clients=10, max_per_uid=2)
    assert refusal is None and victim is mine[1]  # per-user cap: only that user's own
    victim, refusal = admission(mine[:1] + mine[2:] + conns([(7, 9.0, True, 0)]), 7, max_clients=10, max_per_uid=2)
    assert victim is None and "daemon.max_clients_per_uid=2" in refusal and "uid 7" in refusal
    assert admission(mine, 9, max_clients=10, max_per_uid=2) == (None, None)
    mine[1].closed = True  # closed connections no longer count
    assert admission(mine, 7, max_clients=10, max_per_uid=2) == (None, None)


def test_a_connection_is_as_recent_as_its_last_request_not_its_last_reply(daemon_dir, process_daemon):
    """The idle victim is the connection whose last request arrived first. Its stamp used to be
    taken at the reply: a client whose slow get (an NVMe read, 2 s late) was answered after
    three other connections opened looked newer than they did, and one of them was closed for
    a newcomer instead of it."""
    d = daemon_dir
    cfg = daemon_config(d, host_bytes=8 * MiB, max_clients=4)
    path = write_config(os.path.join(d, "cfg.json"), cfg)
    sock = cfg["daemon"]["socket_path"]
    seed = process_daemon(path, sock).start()
    try:
        with DaemonClient(sock, client_name="seed") as c:
            c.put("k", make_tensor(4, "bfloat16", (64, 8192)))
    finally:
        assert seed.terminate() == 0, seed.log()  # flushed: "k" is on NVMe only after the restart
    process_daemon(path, sock, via="slow-nvme", nvme_read_delay_s=2.0).start()
    raws: list[RawConn] = []
    try:
        first = RawConn(sock, name="first")
        raws.append(first)
        # arrives now, answered ~2 s later; a process-held lease (hold): the connection holds none
        first.send_msg({"id": 1, "op": "get", "key": "k", "hold": True})
        time.sleep(1.0)  # (the daemon has read it, on a loaded machine too; its reply comes at ~2 s)
        raws += [RawConn(sock, name=f"idle-{i}") for i in range(3)]  # 4 = max_clients
        got = first.reply()
        assert got is not None and got.get("hit"), got
        # the daemon's thread marks the connection idle just after the reply goes out (it is
        # never a victim while busy); on a loaded machine that can come late
        time.sleep(0.5)
        newcomer = RawConn(sock, name="newcomer")
        raws.append(newcomer)
        assert newcomer.request({"id": 2, "op": "ping"})["ok"]
        assert first.reply() is None  # closed: its request came before the others connected
        for r in raws[1:4]:  # idle-1 and idle-2 connected after first's get: kept
            assert r.request({"id": 3, "op": "ping"})["ok"]
    finally:
        for r in raws:
            r.close()
