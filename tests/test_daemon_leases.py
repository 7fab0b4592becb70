"""Daemon leases, end to end: every reservation and read pin belongs to one connection, is
reclaimed when its client dies (even by ``kill -9``), and expires after ``daemon.lease_s``
(its connection is then closed; ``contains`` never renews it). A pinned entry's bytes stay put
while the key is overwritten and the arena churns. Helpers: tests/daemon_helpers.py.

Daemons:
- ``main``: 32 MiB host, NVMe, metrics on an ephemeral port, 64 KiB frame cap, lease 30 s.
- ``restricted``: lease_s 0.5, max_clients 4, socket mode 0660 (group ``nogroup`` when run as root).
- one in a thread of this process, for the churn test.
"""

from __future__ import annotations

import os
import time

import pytest

from daemon_helpers import (
    KiB,
    MiB,
    SPAWN,
    RawConn,
    assert_same,
    daemon_config,
    daemon_stats,
    die_holding_get_lease,
    die_holding_reservation,
    idle,
    make_tensor,
    raw_bytes,
    remove_dir,
    serve_in_thread,
    short_tmpdir,
    wait_for,
    write_arena,
)
from ectier import CacheConfig, testing_daemon
from ectier.daemon.client import DaemonClient, DaemonUnavailableError
from ectier.daemon.protocol import encode_frame
from ectier.errors import LeaseExpiredError


# ================================================================================= ownership


def test_leases_belong_to_their_connection(main_daemon, client):
    client.put("owned", make_tensor(41, "uint8", (1000,)))
    with RawConn(main_daemon.socket_path) as a, RawConn(main_daemon.socket_path) as b:
        put = a.request({"id": 1, "op": "reserve", "key": "owned-put", "dtype": "uint8", "shape": [10]})
        get = a.request({"id": 2, "op": "get", "key": "owned"})
        assert put["ok"] and get["ok"] and get["hit"]
        # another connection can neither commit, abort nor release them (lease ids are guessable)
        r = b.request({"id": 3, "op": "commit", "lease": put["lease"]})
        assert not r["ok"] and "unknown or expired" in r["error"]["message"]
        assert b.request({"id": 4, "op": "abort", "lease": put["lease"]})["aborted"] is False
        assert b.request({"id": 5, "op": "release", "lease": get["lease"]})["valid"] is False
        # a get lease is not a put lease and vice versa
        assert a.request({"id": 6, "op": "abort", "lease": get["lease"]})["aborted"] is False
        assert a.request({"id": 7, "op": "release", "lease": put["lease"]})["valid"] is False
        # the owner still can
        assert a.request({"id": 8, "op": "commit", "lease": put["lease"]})["ok"]
        assert a.request({"id": 9, "op": "release", "lease": get["lease"]})["valid"] is True
    assert client.contains("owned-put")


def test_killed_clients_leases_are_reclaimed(main_daemon, client):
    held = make_tensor(61, "bfloat16", (64, 8192))  # 1 MiB
    client.put("held-by-doomed", held)
    base = idle(main_daemon.socket_path)
    used = base["tiers"]["host"]["used_bytes"]
    ready_put, ready_get = SPAWN.Event(), SPAWN.Event()
    kids = [SPAWN.Process(target=die_holding_reservation,
                          args=(main_daemon.socket_path, "doomed-put", 2 * MiB, ready_put)),
            SPAWN.Process(target=die_holding_get_lease, args=(main_daemon.socket_path, "held-by-doomed", ready_get))]
    try:
        for k in kids:
            k.start()
        # while they hold their leases, the daemon sees them (and a bystander keeps working)
        assert ready_put.wait(60) and ready_get.wait(60)
        bystander = make_tensor(62, "float32", (1000,))
        client.put("bystander", bystander)
        for k in kids:
            k.join(30)
            assert k.exitcode == -9
    finally:
        for k in kids:
            if k.is_alive():
                k.kill()
                k.join(5)
    s = idle(main_daemon.socket_path, absent=("doomed-put", "doomed-get"))
    assert s["daemon"]["leases"] == {"put": 0, "get": 0}
    bystander_bytes = 64 * KiB  # 4000 bytes take one 64 KiB block
    # the daemon takes a dead client's leases out of its book (what idle() waits for), then ends
    # them after its lock: the blocks come back a moment later (on a loaded machine, later still)
    wait_for(lambda: daemon_stats(main_daemon.socket_path)["tiers"]["host"]["used_bytes"] == used + bystander_bytes,
             what="the 2 MiB reservation to come back")
    assert not client.contains("doomed-put")
    assert client.get("doomed-put") is None
    assert_same(client.get("held-by-doomed"), held)
    assert_same(client.get("bystander"), bystander)
    # the get lease's pin goes too (ended after the daemon's lock as well): deleting the entry frees
    # its bytes; a pin left behind would keep them
    assert client.delete("held-by-doomed")
    wait_for(lambda: client.stats()["tiers"]["host"]["used_bytes"] == used + bystander_bytes - MiB,
             what="the deleted entry's bytes to be freed (no pin left)")


def test_get_lease_bytes_stay_put_while_the_key_is_overwritten_and_the_arena_churns():
    d = short_tmpdir()
    server = thread = a = b = None
    try:
        cfg = CacheConfig.from_dict(daemon_config(d, nvme=False, host_bytes=4 * MiB))
        server, thread = serve_in_thread(cfg)
        a = DaemonClient(cfg.daemon.socket_path, client_name="reader")
        b = DaemonClient(cfg.daemon.socket_path, client_name="writer")
        v1, v2 = make_tensor(1, "uint8", (MiB,)), make_tensor(2, "uint8", (MiB,))
        a.put("k", v1)
        g = a.call("get", key="k")  # v1 pinned under a's lease
        b.put("k", v2)
        assert_same(b.get("k"), v2)  # the overwrite is visible at once
        for i in range(12):  # 6 MiB through a 4 MiB arena of which 1 MiB is pinned
            b.put(f"churn-{i}", make_tensor(10 + i, "uint8", (512 * KiB,)))
        with open(a.server_info["arena"]["path"], "rb") as f:
            held = b"".join(os.pread(f.fileno(), n, off) for off, n in g["extents"])
        assert held == raw_bytes(v1)  # the pinned blocks were neither reused nor freed
        assert a.call("release", lease=g["lease"]) == {"valid": True}
        s = b.stats()["tiers"]["host"]
        assert s["used_bytes"] <= s["capacity_bytes"]
    finally:
        for x in (a, b):
            if x is not None:
                x.close()
        if server is not None:
            server.stop()
            thread.join(10)
        remove_dir(d)


# ============================================================================== lease expiry


def test_overrun_put_lease_closes_the_connection(restricted):
    sock = restricted.socket_path
    before = idle(sock)
    with RawConn(sock, timeout=5) as raw:
        # timed from before the request: the lease starts once the daemon has it, so a correct daemon
        # cannot close the connection within lease_s of t0 however late the reply is read here
        t0 = time.monotonic()
        r = raw.request({"id": 1, "op": "reserve", "key": "slow-put", "dtype": "uint8", "shape": [256 * KiB]})
        assert r["ok"]
        assert raw.reply() is None  # the daemon closed the connection when the lease expired
        elapsed = time.monotonic() - t0
        run = raw.hello_reply["instance"]
    assert 0.4 <= elapsed <= 3.0, elapsed
    after = idle(sock, orphans=1)
    assert after["daemon"]["leases_expired"] == before["daemon"]["leases_expired"] + 1
    # this process lives on: the reservation's blocks stay reserved (an orphan) until it says its
    # copy is over (test_daemon_orphans.py), then the bytes used are what they were
    assert after["daemon"]["orphaned_puts"] == {"leases": 1, "bytes": 256 * KiB}
    with RawConn(sock, timeout=5) as raw:
        assert raw.request({"id": 2, "op": "abort", "lease": r["lease"], "instance": run})["aborted"]
    after = idle(sock)
    assert after["tiers"]["host"]["used_bytes"] == before["tiers"]["host"]["used_bytes"]
    assert after["daemon"]["orphaned_puts"] == {"leases": 0, "bytes": 0}


def test_commit_after_the_lease_expired_fails(restricted):
    c = DaemonClient(restricted.socket_path, client_name="slow-writer")
    try:
        r = c.call("reserve", key="late-commit", dtype="uint8", shape=[64 * KiB])
        write_arena(c.server_info["arena"]["path"], r["extents"], b"\x01" * (64 * KiB))
        time.sleep(1.2)  # past daemon.lease_s; then until the reaper closed the connection, however late
        _wait_closed(restricted.socket_path, "slow-writer")
        with pytest.raises(DaemonUnavailableError):  # its connection was closed
            c.call("commit", retry=False, lease=r["lease"])
        with pytest.raises(LeaseExpiredError, match="unknown or expired"):  # and the lease is gone
            c.call("commit", lease=r["lease"])
        assert not c.contains("late-commit")
        # its blocks stay reserved for this process until it says its copy is over
        assert c.call("abort", lease=r["lease"], instance=c.server_info["instance"]) == {"aborted": True}
        c.put("late-commit", make_tensor(3, "uint8", (10,)))  # the client object still works
        assert c.contains("late-commit")
    finally:
        c.close()


def _wait_closed(sock: str, name: str) -> None:
    """Wait until the daemon closed the connection of client ``name`` (its lease expired: the
    reaper runs every lease_s / 4, later on a loaded machine)."""
    wait_for(lambda: name not in {x["name"] for x in daemon_stats(sock)["daemon"]["clients"]}, timeout=10,
             what=f"the daemon to expire the lease of {name} and close its connection")


def test_get_whose_copy_outlives_the_lease_is_a_miss(restricted):
    sock = restricted.socket_path
    c = DaemonClient(sock, client_name="slow-reader")
    try:
        t = make_tensor(71, "bfloat16", (8, 8192))
        c.put("slow-get", t)
        c.get("slow-get")  # maps the arena
        expired = daemon_stats(sock)["daemon"]["leases_expired"]
        # the copy takes longer than daemon.lease_s: it starts once the daemon counted the lease
        # expired (at most 10 s), however late the reaper runs
        with testing_daemon.stall_daemon_copy(c, 10.0, until=lambda n: daemon_stats(sock)["daemon"]["leases_expired"] > expired):
            assert c.get("slow-get") is None  # release said valid: false -> the copy is discarded
        assert_same(c.get("slow-get"), t)  # the entry itself is intact
    finally:
        c.close()
    # the low-level view: a release after expiry answers valid: false
    c = DaemonClient(sock, client_name="late-release")
    try:
        g = c.call("get", key="slow-get")
        time.sleep(1.2)  # past daemon.lease_s
        _wait_closed(sock, "late-release")
        assert c.call("release", lease=g["lease"]) == {"valid": False}
    finally:
        c.close()


def test_contains_does_not_renew_a_lease(restricted):
    sock = restricted.socket_path
    c = DaemonClient(sock)
    try:
        c.put("renew?", make_tensor(81, "uint8", (100,)))
    finally:
        c.close()
    expired = idle(sock)["daemon"]["leases_expired"]
    with RawConn(sock, timeout=5) as raw:
        t0 = time.monotonic()  # before the request: the lease cannot start earlier (as above)
        g = raw.request({"id": 1, "op": "get", "key": "renew?"})
        assert g["ok"] and g["hit"]
        n, closed = 0, False
        while time.monotonic() - t0 < 5:
            try:
                raw.send(encode_frame({"id": 100 + n, "op": "contains", "key": "renew?"}))
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            rep = raw.reply()
            if rep is None:
                closed = True
                break
            assert rep["ok"] and rep["found"] and rep["id"] == 100 + n
            n += 1
            time.sleep(0.005)
        elapsed = time.monotonic() - t0
    assert closed, f"{n} contains calls in {elapsed:.1f} s kept the lease alive"
    assert n >= 10 and 0.4 <= elapsed <= 3.0, (n, elapsed)
    assert idle(sock)["daemon"]["leases_expired"] == expired + 1
