"""The standalone cache daemon, end to end: real daemon processes, real client processes.

Daemons are started as subprocesses (``ectier serve`` / ``python -m ectier.daemon``) on sockets in
short temporary directories under /tmp, with their host arena and NVMe store in the same
directory; client processes use a ``spawn`` multiprocessing context and receive seeds, never
tensors. Every daemon is stopped in a ``finally`` (SIGTERM, then SIGKILL).

Daemons:
- ``main``: 32 MiB host, NVMe, metrics on an ephemeral port, 64 KiB frame cap, lease 30 s.
- ``restricted``: lease_s 0.5, max_clients 4, socket mode 0660 (group ``nogroup`` when run as root).
- one-off daemons for kill -9 / SIGTERM restarts.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import socket
import stat
import struct
import subprocess
import threading
import time
import urllib.request
import zlib

import msgpack
import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from daemon_helpers import (
    KiB,
    MiB,
    PYTHON,
    DaemonProcess,
    RawConn,
    clean_env,
    consumer,
    daemon_config,
    daemon_stats,
    die_holding_get_lease,
    die_holding_reservation,
    idle,
    make_tensor,
    producer,
    raw_bytes,
    remove_dir,
    short_tmpdir,
    spec_digest,
    tensor_digest,
    wait_for,
    write_arena,
    write_config,
)
from ectier import CacheConfig
from ectier.cli import main as cli_main
from ectier.daemon.client import DaemonClient, DaemonUnavailableError
from ectier.daemon.protocol import PROTOCOL_VERSION, ProtocolError, encode_frame
from ectier.daemon.server import DaemonServer
from ectier.errors import EctierError, EntryTooLargeError, InvalidKeyError

SPAWN = multiprocessing.get_context("spawn")
IS_ROOT = os.geteuid() == 0
SYSTEM_PYTHON = "/usr/bin/python3"


def _nogroup() -> str | None:
    import grp

    try:
        return grp.getgrgid(65534).gr_name
    except KeyError:
        return None


# ================================================================================== fixtures


@pytest.fixture(scope="module")
def main_daemon():
    d = short_tmpdir()
    try:
        cfg = daemon_config(d, host_bytes=32 * MiB, nvme_bytes=64 * MiB, metrics_port=0, max_frame_bytes=64 * KiB)
        proc = DaemonProcess(write_config(os.path.join(d, "cfg.yaml"), cfg), cfg["daemon"]["socket_path"],
                             via="script")
        proc.dir, proc.cfg = d, cfg
        try:
            proc.start()
            yield proc
        finally:
            proc.stop()
    finally:
        remove_dir(d)


@pytest.fixture(scope="module")
def client(main_daemon):
    c = DaemonClient(main_daemon.socket_path, client_name="pytest-main")
    try:
        yield c
    finally:
        c.close()


@pytest.fixture(scope="module")
def restricted():
    d = short_tmpdir()
    os.chmod(d, 0o711)  # other users may traverse (not list) it: the socket's own mode decides
    group = _nogroup() if IS_ROOT else None
    try:
        cfg = daemon_config(d, host_bytes=8 * MiB, nvme=False, lease_s=0.5, max_clients=4, socket_mode="0660",
                            allowed_group=group)
        proc = DaemonProcess(write_config(os.path.join(d, "cfg.json"), cfg), cfg["daemon"]["socket_path"])
        proc.dir, proc.cfg, proc.group = d, cfg, group
        try:
            proc.start()
            yield proc
        finally:
            proc.stop()
    finally:
        remove_dir(d)


def _same(got, expected) -> None:
    assert got is not None, "miss"
    assert got.dtype == expected.dtype
    assert tuple(got.shape) == tuple(expected.shape)
    assert raw_bytes(got) == raw_bytes(expected)


# ============================================================================ basic behaviour


def test_socket_and_arena_are_private(main_daemon, client):
    st_sock = os.stat(main_daemon.socket_path)
    assert stat.S_ISSOCK(st_sock.st_mode)
    assert stat.S_IMODE(st_sock.st_mode) == 0o600
    client.connect()
    arena = client.server_info["arena"]["path"]
    assert os.path.dirname(arena) == main_daemon.dir  # daemon.shm_dir, not /dev/shm
    assert stat.S_IMODE(os.stat(arena).st_mode) == 0o600
    assert os.stat(arena).st_size == client.server_info["arena"]["nbytes"] == 32 * MiB
    assert client.server_info["version"] == PROTOCOL_VERSION
    assert client.server_info["namespace"] == "test"


CASES = [
    ("bf16-1", torch.bfloat16, (1, 8192)),
    ("bf16-7", torch.bfloat16, (7, 8192)),
    ("bf16-64", torch.bfloat16, (64, 8192)),  # 1 MiB, exactly 16 blocks
    ("fp32", torch.float32, (129, 33)),
    ("int8", torch.int8, (1000, 1000)),
    ("uint8-odd", torch.uint8, (65537,)),  # one byte into a second block
    ("fp16", torch.float16, (3, 5, 7)),
    ("bool", torch.bool, (4097,)),
    ("int64-scalar", torch.int64, ()),
    ("bf16-empty", torch.bfloat16, (0, 8192)),
    ("fp32-empty", torch.float32, (5, 0)),
]


@pytest.mark.parametrize("name, dtype, shape", CASES, ids=[c[0] for c in CASES])
def test_put_get_byte_exact(client, name, dtype, shape):
    t = make_tensor(zlib.crc32(name.encode()), str(dtype).removeprefix("torch."), shape)
    key = f"rt-{name}"
    client.put(key, t)
    assert client.contains(key)
    _same(client.get(key), t)
    _same(client.get(key), t)  # a second read sees the same bytes


def test_non_contiguous_tensor_is_stored_in_c_order(client):
    t = make_tensor(11, "float32", (64, 48)).t()  # transposed view
    assert not t.is_contiguous()
    client.put("rt-transposed", t)
    _same(client.get("rt-transposed"), t)


def test_overwrite_with_another_shape_and_dtype(client):
    a = make_tensor(1, "bfloat16", (16, 8192))
    b = make_tensor(2, "float32", (3, 5))
    client.put("ow", a)
    before = client.stats()
    client.put("ow", b)
    _same(client.get("ow"), b)
    after = client.stats()
    assert after["entries"] == before["entries"]  # replaced, not added
    assert after["tiers"]["host"]["used_bytes"] == before["tiers"]["host"]["used_bytes"] - 3 * 64 * KiB  # 4 blocks -> 1
    client.put("ow", a)
    _same(client.get("ow"), a)


def test_namespaces_are_separate(client):
    a = make_tensor(21, "bfloat16", (2, 8192))
    b = make_tensor(22, "bfloat16", (2, 8192))
    client.put("shared-key", a, namespace="model-a")
    client.put("shared-key", b, namespace="model-b")
    _same(client.get("shared-key", namespace="model-a"), a)
    _same(client.get("shared-key", namespace="model-b"), b)
    assert not client.contains("shared-key")  # the daemon's namespace is "test"
    assert client.get("shared-key") is None
    assert client.delete("shared-key", namespace="model-a")
    assert not client.contains("shared-key", namespace="model-a")
    _same(client.get("shared-key", namespace="model-b"), b)


def test_delete_and_misses(client):
    t = make_tensor(31, "int8", (100,))
    client.put("del-me", t)
    misses = client.stats()["misses"]
    assert client.delete("del-me") is True
    assert client.delete("del-me") is False
    assert not client.contains("del-me")
    assert client.get("del-me") is None
    assert client.get("never-put") is None
    assert client.stats()["misses"] == misses + 2


def test_reserved_entry_is_invisible_until_commit(main_daemon, client):
    other = DaemonClient(main_daemon.socket_path, client_name="observer")
    try:
        payload = bytes(range(256)) * 1024  # 256 KiB
        r = client.call("reserve", key="two-phase", dtype="uint8", shape=[len(payload)])
        assert r["nbytes"] == len(payload)
        assert sum(length for _, length in r["extents"]) == len(payload)
        assert not other.contains("two-phase")
        assert other.get("two-phase") is None
        write_arena(client.server_info["arena"]["path"], r["extents"], payload)
        assert not other.contains("two-phase")
        assert client.call("commit", lease=r["lease"]) == {}
        got = other.get("two-phase")
        assert got is not None and got.numpy().tobytes() == payload
        # a second commit of the same lease is refused
        with pytest.raises(EctierError, match="unknown or expired"):
            client.call("commit", lease=r["lease"])
    finally:
        other.close()


def test_abort_returns_the_bytes(main_daemon, client):
    used = client.stats()["tiers"]["host"]["used_bytes"]
    r = client.call("reserve", key="aborted", dtype="uint8", shape=[3 * 64 * KiB])
    assert client.stats()["tiers"]["host"]["used_bytes"] >= used  # reserved bytes may count as used
    assert client.call("abort", lease=r["lease"]) == {"aborted": True}
    assert client.call("abort", lease=r["lease"]) == {"aborted": False}
    assert client.stats()["tiers"]["host"]["used_bytes"] == used
    assert not client.contains("aborted")


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


def test_typed_errors_map_back_to_ectier_errors(client):
    with pytest.raises(EntryTooLargeError, match="host.capacity_bytes"):
        client.call("reserve", key="too-big", dtype="uint8", shape=[64 * MiB])
    with pytest.raises(InvalidKeyError):
        client.contains("")
    with pytest.raises(InvalidKeyError):
        client.put("", make_tensor(1, "uint8", (4,)))
    with pytest.raises(ProtocolError, match="'dtype'"):
        client.call("reserve", key="k", dtype="float128", shape=[1])
    with pytest.raises(ProtocolError, match="'op'"):
        client.call("explode")
    with pytest.raises(EntryTooLargeError):  # 2**1500 bytes: refused, not an internal error
        client.call("reserve", key="k", dtype="float64", shape=[(1 << 48) - 1] * 32)
    with pytest.raises(InvalidKeyError):  # a lone surrogate cannot be sent; the cache refuses it too
        client.contains("\ud800")
    assert client.ping() < 1.0  # the connection is still fine


def test_hello_with_a_wrong_version_is_a_protocol_error(main_daemon, client):
    with pytest.raises(ProtocolError, match="protocol"):
        client.call("hello", version=PROTOCOL_VERSION + 1)
    client.ping()
    c = DaemonClient(main_daemon.socket_path)
    try:
        import ectier.daemon.client as client_mod

        orig = client_mod.PROTOCOL_VERSION
        client_mod.PROTOCOL_VERSION = PROTOCOL_VERSION + 41
        try:
            with pytest.raises(ProtocolError, match="protocol"):
                c.connect()
        finally:
            client_mod.PROTOCOL_VERSION = orig
        c.connect()
    finally:
        c.close()


def test_stats_report_clients_and_leases(main_daemon, client):
    client.put("stat-me", make_tensor(51, "uint8", (10,)))
    g = client.call("get", key="stat-me")
    try:
        s = client.stats()
        d = s["daemon"]
        assert d["socket"] == main_daemon.socket_path
        assert d["leases"]["get"] >= 1
        me = [c for c in d["clients"] if c["name"] == "pytest-main"]
        assert len(me) == 1 and me[0]["pid"] == os.getpid() and me[0]["leases"] == 1
        assert set(s["tiers"]) == {"host", "nvme"}
    finally:
        assert client.call("release", lease=g["lease"])["valid"]
    assert client.stats()["daemon"]["leases"]["get"] == 0


# ======================================================================= several processes


PC_SPECS = [
    ("pc-bf16-4", 101, "bfloat16", (4, 8192)),  # 64 KiB
    ("pc-bf16-37", 102, "bfloat16", (37, 8192)),
    ("pc-bf16-256", 103, "bfloat16", (256, 8192)),  # 4 MiB
    ("pc-fp32", 104, "float32", (129, 33)),
    ("pc-int8", 105, "int8", (1000, 1000)),
    ("pc-empty", 106, "bfloat16", (0, 8192)),
]


HOT = [("pc-hot", 111, "bfloat16", (64, 8192)), ("pc-hot", 112, "bfloat16", (64, 8192))]  # 1 MiB each


def test_producer_and_two_concurrent_consumers(main_daemon):
    """A producer puts entries, then keeps overwriting one hot key with two versions while two
    consumers read everything concurrently: every read is byte-exact, a hot read is one whole
    version (never a mix), nothing misses."""
    expected = {spec[0]: spec_digest(spec) for spec in PC_SPECS}
    hot_versions = {spec_digest(s) for s in HOT}
    keys = list(expected) + ["pc-hot"]
    done, stop = SPAWN.Event(), SPAWN.Event()
    barrier = SPAWN.Barrier(2)
    results = SPAWN.Queue()
    procs = [SPAWN.Process(target=producer, args=(main_daemon.socket_path, PC_SPECS, done, HOT, stop))]
    procs += [SPAWN.Process(target=consumer, args=(main_daemon.socket_path, keys, 4, done, barrier, results))
              for _ in range(2)]
    try:
        for p in procs:
            p.start()
        got = [results.get(timeout=60) for _ in range(2)]
        stop.set()
        for p in procs:
            p.join(30)
            assert p.exitcode == 0
    finally:
        stop.set()
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    for status, seen in got:
        assert status == "ok", seen
        hot = seen.pop("pc-hot")
        assert seen == {k: [v] for k, v in expected.items()}  # every read, byte-exact, no miss
        assert hot and set(hot) <= hot_versions, hot  # whole versions only


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
    assert s["tiers"]["host"]["used_bytes"] == used + bystander_bytes  # the 2 MiB reservation came back
    assert not client.contains("doomed-put")
    assert client.get("doomed-put") is None
    _same(client.get("held-by-doomed"), held)
    _same(client.get("bystander"), bystander)
    # the get lease's pin is gone: deleting the entry frees its bytes at once
    assert client.delete("held-by-doomed")
    assert client.stats()["tiers"]["host"]["used_bytes"] == used + bystander_bytes - MiB


# ============================================================================= lease expiry


def test_overrun_put_lease_closes_the_connection(restricted):
    sock = restricted.socket_path
    before = idle(sock)
    with RawConn(sock, timeout=5) as raw:
        r = raw.request({"id": 1, "op": "reserve", "key": "slow-put", "dtype": "uint8", "shape": [256 * KiB]})
        assert r["ok"]
        t0 = time.monotonic()
        assert raw.reply() is None  # the daemon closed the connection when the lease expired
        elapsed = time.monotonic() - t0
    assert 0.4 <= elapsed <= 3.0, elapsed
    after = idle(sock)
    assert after["tiers"]["host"]["used_bytes"] == before["tiers"]["host"]["used_bytes"]
    assert after["daemon"]["leases_expired"] == before["daemon"]["leases_expired"] + 1


def test_commit_after_the_lease_expired_fails(restricted):
    c = DaemonClient(restricted.socket_path, client_name="slow-writer")
    try:
        r = c.call("reserve", key="late-commit", dtype="uint8", shape=[64 * KiB])
        write_arena(c.server_info["arena"]["path"], r["extents"], b"\x01" * (64 * KiB))
        time.sleep(1.2)
        with pytest.raises(DaemonUnavailableError):  # its connection was closed
            c.call("commit", retry=False, lease=r["lease"])
        with pytest.raises(EctierError, match="unknown or expired"):  # and the lease is gone
            c.call("commit", lease=r["lease"])
        assert not c.contains("late-commit")
        c.put("late-commit", make_tensor(3, "uint8", (10,)))  # the client object still works
        assert c.contains("late-commit")
    finally:
        c.close()


def test_get_whose_copy_outlives_the_lease_is_a_miss(restricted, monkeypatch):
    c = DaemonClient(restricted.socket_path, client_name="slow-reader")
    try:
        t = make_tensor(71, "bfloat16", (8, 8192))
        c.put("slow-get", t)
        c.get("slow-get")  # maps the arena
        real = c._arena_tensor

        def stalled():
            time.sleep(1.2)  # the copy takes longer than daemon.lease_s
            return real()

        monkeypatch.setattr(c, "_arena_tensor", stalled)
        assert c.get("slow-get") is None  # release said valid: false -> the copy is discarded
        monkeypatch.undo()
        _same(c.get("slow-get"), t)  # the entry itself is intact
    finally:
        c.close()
    # the low-level view: a release after expiry answers valid: false
    c = DaemonClient(restricted.socket_path)
    try:
        g = c.call("get", key="slow-get")
        time.sleep(1.2)
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
        g = raw.request({"id": 1, "op": "get", "key": "renew?"})
        assert g["ok"] and g["hit"]
        t0 = time.monotonic()
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


def test_max_clients_makes_room_by_closing_the_least_recently_used_idle_connection(restricted):
    """At daemon.max_clients a new client is not refused while some connection is idle: the least
    recently used idle one is closed for it (refusal, when every connection holds a lease, is in
    test_daemon_connections.py)."""
    sock = restricted.socket_path
    conns = []
    try:
        conns.append(RawConn(sock))
        wait_for(lambda: len(conns[0].request({"id": 1, "op": "stats"})["stats"]["daemon"]["clients"]) == 1,
                 what="other connections to go")
        before = conns[0].request({"id": 2, "op": "stats"})["stats"]["daemon"]
        for i in range(3):
            conns.append(RawConn(sock))
            assert conns[-1].request({"id": 1, "op": "ping"})["ok"]
        with RawConn(sock) as fifth:
            assert fifth.hello_reply is not None, fifth.reply()
            assert conns[0].reply() is None  # the least recently used one made room
            assert fifth.request({"id": 1, "op": "ping"})["ok"]
            with DaemonClient(sock, connect_retry_s=0.2) as sixth:
                after = sixth.stats()["daemon"]  # in conns[1]'s place
            assert conns[1].reply() is None
        assert after["refused"] == before["refused"]
        assert after["evicted"] == before["evicted"] + 2
        assert len(after["clients"]) == 4
    finally:
        for c in conns:
            c.close()


# ======================================================================== daemon crash/restart


DURABLE = [
    ("d-bf16", 201, "bfloat16", (37, 8192)),
    ("d-fp32", 202, "float32", (1000, 3)),
    ("d-int8", 203, "int8", (4 * MiB,)),
    ("d-empty", 204, "bfloat16", (0, 8192)),
]


def test_daemon_killed_mid_put_serves_committed_entries_after_restart():
    d = short_tmpdir()
    daemons: list[DaemonProcess] = []
    c = fresh = None
    try:
        cfg = daemon_config(d, write_through=True, host_bytes=16 * MiB)
        path = write_config(os.path.join(d, "cfg.json"), cfg)
        sock = cfg["daemon"]["socket_path"]
        daemons.append(DaemonProcess(path, sock).start())
        c = DaemonClient(sock, connect_retry_s=10)
        for key, seed, dtype, shape in DURABLE:
            c.put(key, make_tensor(seed, dtype, shape))
        assert c.stats()["tiers"]["nvme"]["entries"] == len(DURABLE)  # written through
        r = c.call("reserve", key="uncommitted", dtype="uint8", shape=[MiB])
        old_arena = c.server_info["arena"]["path"]
        write_arena(old_arena, r["extents"], b"\xcd" * (MiB // 2))  # half written
        daemons[0].kill9()
        assert stat.S_ISSOCK(os.stat(sock).st_mode)  # a stale socket file is left behind

        daemons.append(DaemonProcess(path, sock).start())  # same socket path, same NVMe store
        fresh = DaemonClient(sock)
        for spec in DURABLE:
            got = fresh.get(spec[0])
            assert got is not None and tensor_digest(got) == spec_digest(spec), spec[0]
        assert not fresh.contains("uncommitted")
        assert fresh.get("uncommitted") is None
        # the client that lost its daemon reconnects by itself
        assert tensor_digest(c.get("d-bf16")) == spec_digest(DURABLE[0])
        # the dead daemon's arena file does not leak (it would hold host.capacity_bytes of RAM in /dev/shm)
        assert not os.path.exists(old_arena)
        arenas = [f for f in os.listdir(d) if f.endswith(".arena")]
        assert arenas == [os.path.basename(fresh.server_info["arena"]["path"])]
    finally:
        for x in (c, fresh):
            if x is not None:
                x.close()
        for dp in daemons:
            dp.stop()
        remove_dir(d)


def test_sigterm_flushes_and_the_same_client_reconnects():
    d = short_tmpdir()
    daemons: list[DaemonProcess] = []
    c = None
    try:
        cfg = daemon_config(d, write_through=False, flush_on_close=True)
        path = write_config(os.path.join(d, "cfg.yaml"), cfg)
        sock = cfg["daemon"]["socket_path"]
        daemons.append(DaemonProcess(path, sock).start())
        c = DaemonClient(sock, connect_retry_s=30)
        for key, seed, dtype, shape in DURABLE:
            c.put(key, make_tensor(seed, dtype, shape))
        assert c.stats()["tiers"]["nvme"]["entries"] == 0  # host only: only the flush saves them
        arena = c.server_info["arena"]["path"]

        assert daemons[0].terminate() == 0
        assert not os.path.exists(sock)
        assert not os.path.exists(arena)
        assert "Traceback" not in daemons[0].log()

        # the next call waits for the new daemon (connect_retry_s) and goes on with the same object
        daemons.append(DaemonProcess(path, sock).launch())
        assert c.contains("d-bf16")
        for spec in DURABLE:
            got = c.get(spec[0])
            assert got is not None and tensor_digest(got) == spec_digest(spec), spec[0]
        assert c.server_info["arena"]["path"] != arena
        t = make_tensor(205, "float16", (33, 77))
        c.put("after-restart", t)
        _same(c.get("after-restart"), t)
        assert daemons[1].terminate() == 0
    finally:
        if c is not None:
            c.close()
        for dp in daemons:
            dp.stop()
        remove_dir(d)


def _serve_in_thread(cfg: CacheConfig):
    server = DaemonServer(cfg)
    server.start()
    t = threading.Thread(target=server.serve_forever, daemon=True)
    t.start()
    return server, t


def test_client_of_an_unreachable_daemon_fails_fast_then_reconnects():
    """A daemon that is down (or a wrong socket path) costs one connect_retry_s wait, not one per
    call: after a failed attempt calls raise at once for backoff_s, then each makes one immediate
    attempt; a daemon that comes up is used by the first call after the window."""
    d = short_tmpdir()
    server = t = None
    c = DaemonClient(os.path.join(d, "d.sock"), connect_retry_s=0.5, backoff_s=1.0)
    try:
        t0 = time.monotonic()
        with pytest.raises(DaemonUnavailableError, match="cannot reach"):
            c.contains("k")
        assert 0.4 <= time.monotonic() - t0 < 3.0  # the one wait
        assert c.unreachable
        t0 = time.monotonic()
        for i in range(50):
            with pytest.raises(DaemonUnavailableError, match="cannot reach"):
                c.contains(f"k{i}") if i % 2 else c.put(f"k{i}", torch.zeros(4, dtype=torch.uint8))
        assert time.monotonic() - t0 < 0.5  # no waits, no attempts
        time.sleep(1.1)
        c.backoff_s = 60.0  # the next window outlasts the daemon's start below, however slow
        t0 = time.monotonic()
        with pytest.raises(DaemonUnavailableError):
            c.stats()  # window over: one immediate attempt, no connect_retry_s wait
        assert time.monotonic() - t0 < 0.3

        # a start-up probe: one attempt, no wait; a failure opens the window too
        probe = DaemonClient(os.path.join(d, "d.sock"), connect_retry_s=5.0)
        t0 = time.monotonic()
        with pytest.raises(DaemonUnavailableError):
            probe.connect(wait=False)
        with pytest.raises(DaemonUnavailableError):
            probe.contains("k")
        assert time.monotonic() - t0 < 0.5 and probe.unreachable
        probe.close()

        server, t = _serve_in_thread(CacheConfig.from_dict(daemon_config(d, nvme=False, host_bytes=4 * MiB)))
        with pytest.raises(DaemonUnavailableError):
            c.contains("k")  # still inside the window opened by the last failure
        c.backoff_s = 0.2
        time.sleep(0.3)
        c.put("k", torch.ones(8, dtype=torch.uint8))  # the first call after the window connects
        assert not c.unreachable and c.contains("k")
    finally:
        c.close()
        if server is not None:
            server.stop()
            t.join(10)
        remove_dir(d)


def test_client_lets_go_of_a_stopped_daemons_arena_at_its_next_call():
    """A client idle across a daemon stop keeps the old (unlinked) arena mapped, so its pages stay
    allocated in daemon.shm_dir; at its next call, which cannot reach the daemon, it unmaps it, so
    a restarted daemon finds room for its own arena."""
    d = short_tmpdir()
    server = t = c = None
    try:
        cfg = CacheConfig.from_dict(daemon_config(d, nvme=False, host_bytes=4 * MiB))
        server, t = _serve_in_thread(cfg)
        c = DaemonClient(cfg.daemon.socket_path, connect_retry_s=0.2, backoff_s=0.1)
        c.put("a", make_tensor(1, "uint8", (64 * KiB,)))
        assert c._arena_mmap is not None
        old_arena = server.arena_path
        server.stop()
        t.join(10)
        server = None
        assert not os.path.exists(old_arena)
        with pytest.raises(DaemonUnavailableError):
            c.contains("a")
        assert c._arena is None and c._arena_mmap is None, "the stopped daemon's arena is still mapped"
        server, t = _serve_in_thread(cfg)
        time.sleep(0.15)
        b = make_tensor(2, "uint8", (64 * KiB,))
        c.put("b", b)  # maps the new arena
        _same(c.get("b"), b)
    finally:
        if c is not None:
            c.close()
        if server is not None:
            server.stop()
            t.join(10)
        remove_dir(d)


def test_a_relative_shm_dir_reaches_clients_as_an_absolute_arena_path(monkeypatch):
    """daemon.shm_dir given relative to the daemon's working directory: a client running elsewhere
    must still map the arena (the daemon sends it an absolute path)."""
    d = short_tmpdir()
    os.mkdir(os.path.join(d, "shm"))
    server = t = c = None
    try:
        monkeypatch.chdir(d)
        cfg = CacheConfig.from_dict(daemon_config(d, nvme=False, host_bytes=4 * MiB, shm_dir="shm"))
        server, t = _serve_in_thread(cfg)
        assert os.path.isabs(server.arena_path) and os.path.dirname(server.arena_path) == os.path.join(d, "shm")
        monkeypatch.chdir("/")
        c = DaemonClient(cfg.daemon.socket_path)
        x = make_tensor(3, "uint8", (4 * KiB,))
        c.put("x", x)
        _same(c.get("x"), x)
    finally:
        if c is not None:
            c.close()
        if server is not None:
            server.stop()
            t.join(10)
        remove_dir(d)


def test_client_remaps_the_arena_when_a_restarted_daemon_reuses_its_path():
    """A daemon that restarts with the same pid (PID 1 of a container) creates its arena under the
    same file name: the client must map the new file, not keep writing into the old one."""
    d = short_tmpdir()
    servers = []
    c = other = None
    try:
        cfg = CacheConfig.from_dict(daemon_config(d, nvme=False, host_bytes=4 * MiB))
        s1, t1 = _serve_in_thread(cfg)
        servers.append((s1, t1))
        c = DaemonClient(cfg.daemon.socket_path, connect_retry_s=5)
        c.put("a", make_tensor(1, "uint8", (1000,)))
        s1.stop()
        t1.join(10)
        s2, t2 = _serve_in_thread(cfg)
        servers.append((s2, t2))
        assert s2.arena_path == s1.arena_path  # same process, same name
        b = make_tensor(2, "uint8", (64 * KiB,))
        c.put("b", b)  # through a reconnect
        lease = s2.cache.acquire("b")
        try:
            arena = s2.cache.host_arena
            stored = b"".join(arena[o:o + n].numpy().tobytes() for o, n in lease.extents)
        finally:
            s2.cache.release(lease)
        assert stored == raw_bytes(b)
        other = DaemonClient(cfg.daemon.socket_path)
        _same(other.get("b"), b)
        _same(c.get("b"), b)
    finally:
        for x in (c, other):
            if x is not None:
                x.close()
        for s, t in servers:
            s.stop()
            t.join(10)
        remove_dir(d)


def test_get_lease_bytes_stay_put_while_the_key_is_overwritten_and_the_arena_churns():
    d = short_tmpdir()
    server = thread = a = b = None
    try:
        cfg = CacheConfig.from_dict(daemon_config(d, nvme=False, host_bytes=4 * MiB))
        server, thread = _serve_in_thread(cfg)
        a = DaemonClient(cfg.daemon.socket_path, client_name="reader")
        b = DaemonClient(cfg.daemon.socket_path, client_name="writer")
        v1, v2 = make_tensor(1, "uint8", (MiB,)), make_tensor(2, "uint8", (MiB,))
        a.put("k", v1)
        g = a.call("get", key="k")  # v1 pinned under a's lease
        b.put("k", v2)
        _same(b.get("k"), v2)  # the overwrite is visible at once
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


def test_a_file_that_is_not_a_socket_is_never_deleted():
    d = short_tmpdir()
    try:
        precious = os.path.join(d, "precious.txt")
        with open(precious, "w") as f:
            f.write("keep me")
        cfg = CacheConfig.from_dict(daemon_config(d, nvme=False, host_bytes=1 * MiB, socket_path=precious))
        server = DaemonServer(cfg)
        try:
            with pytest.raises(EctierError, match="socket_path"):
                server.start()
        finally:
            if server._listener is not None:  # started after all: clean up
                server.stop()
                server._shutdown()
        with open(precious) as f:
            assert f.read() == "keep me"
    finally:
        remove_dir(d)


def test_stale_arenas_are_reclaimed_and_live_ones_kept():
    d = short_tmpdir()
    server = thread = None
    held = None
    try:
        uid = os.getuid()
        gone = [subprocess.Popen(["true"]) for _ in range(2)]
        for g in gone:
            g.wait()
        dead, dead2 = (g.pid for g in gone)  # pids that no longer run
        paths = {
            # a crashed earlier incarnation with this very name (a PID-1 daemon restarted)
            "mine": os.path.join(d, f"ectier-{uid}-{os.getpid()}.arena"),
            "dead": os.path.join(d, f"ectier-{uid}-{dead}.arena"),
            "dead-but-locked": os.path.join(d, f"ectier-{uid}-{dead2}.arena"),
            "live-pid": os.path.join(d, f"ectier-{uid}-1.arena"),  # pid 1 runs: never touched
            "other-user": os.path.join(d, f"ectier-{uid + 1}-{dead}.arena"),
            "unrelated": os.path.join(d, "ectier-notes.txt"),
        }
        for p in paths.values():
            with open(p, "wb") as f:
                f.write(b"old")
        import fcntl

        held = os.open(paths["dead-but-locked"], os.O_RDONLY)
        fcntl.flock(held, fcntl.LOCK_EX)  # as a live daemon holds its arena
        cfg = CacheConfig.from_dict(daemon_config(d, nvme=False, host_bytes=1 * MiB))
        server, thread = _serve_in_thread(cfg)
        assert server.arena_path == paths["mine"]
        assert os.path.getsize(paths["mine"]) == 1 * MiB  # created afresh
        assert not os.path.exists(paths["dead"])
        for name in ("dead-but-locked", "live-pid", "other-user", "unrelated"):
            assert os.path.exists(paths[name]), name
    finally:
        if held is not None:
            os.close(held)
        if server is not None:
            server.stop()
            thread.join(10)
        remove_dir(d)


def test_sigterm_right_after_the_socket_appears_still_cleans_up():
    d = short_tmpdir()
    proc = None
    try:
        cfg = daemon_config(d, nvme=False, host_bytes=4 * MiB, metrics_port=0)
        sock = cfg["daemon"]["socket_path"]
        proc = DaemonProcess(write_config(os.path.join(d, "cfg.json"), cfg), sock).launch()
        wait_for(lambda: os.path.exists(sock) or proc.proc.poll() is not None, timeout=30, interval=0.001,
                 what="the socket file")
        assert proc.terminate() == 0, proc.log()
        assert not os.path.exists(sock)
        assert [f for f in os.listdir(d) if f.endswith(".arena")] == []
    finally:
        if proc is not None:
            proc.stop()
        remove_dir(d)


def test_second_daemon_on_a_live_socket_exits_cleanly(main_daemon):
    r = subprocess.run([PYTHON, "-m", "ectier.daemon", "--config", main_daemon.config_path],
                       capture_output=True, text=True, timeout=60, env=clean_env())
    assert r.returncode == 1, r.stderr
    assert "already listening" in r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    assert daemon_stats(main_daemon.socket_path)["namespace"] == "test"  # the first one is untouched


# ====================================================================== security & robustness


def test_peer_allowed_rules(monkeypatch):
    import types

    import ectier.daemon.server as srv

    group = types.SimpleNamespace(gr_name="encoders", gr_gid=4242, gr_mem=["alice"])
    users = {1001: "alice", 1002: "bob"}

    def getgrnam(name):
        if name == "encoders":
            return group
        raise KeyError(name)

    def getgrgid(gid):
        if gid == 4242:
            return group
        raise KeyError(gid)

    def getpwuid(uid):
        if uid in users:
            return types.SimpleNamespace(pw_name=users[uid])
        raise KeyError(uid)

    monkeypatch.setattr(srv.grp, "getgrnam", getgrnam)
    monkeypatch.setattr(srv.grp, "getgrgid", getgrgid)
    monkeypatch.setattr(srv.pwd, "getpwuid", getpwuid)
    me = os.getuid()
    base = daemon_config("/tmp/unused", nvme=False, host_bytes=1 * MiB)

    plain = DaemonServer(CacheConfig.from_dict(base))
    assert plain._peer_allowed(me, 12345)
    assert not plain._peer_allowed(1001, 4242)  # no allowed_group: only the daemon's own user
    assert not plain._peer_allowed(me + 1 if me != 1001 else 1003, os.getgid())

    base["daemon"]["allowed_group"] = "encoders"
    grouped = DaemonServer(CacheConfig.from_dict(base))
    assert grouped._peer_allowed(me, 12345)
    assert grouped._peer_allowed(1002, 4242)  # primary group
    assert grouped._peer_allowed(1001, 100)  # supplementary member
    assert not grouped._peer_allowed(1002, 100)  # neither
    assert not grouped._peer_allowed(31337, 100)  # unknown user
    assert grouped._peer_allowed(31337, 4242)  # unknown user whose primary group is allowed

    base["daemon"]["allowed_group"] = "nosuchgroup"
    with pytest.raises(EctierError, match="daemon.allowed_group"):
        DaemonServer(CacheConfig.from_dict(base))


_PEER_SCRIPT = r"""
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(5)
s.connect(sys.argv[1])
try:
    s.sendall(bytes.fromhex(sys.argv[2]))
except OSError:
    pass
buf = b""
try:
    while len(buf) < 4 or len(buf) < 4 + int.from_bytes(buf[:4], "big"):
        d = s.recv(65536)
        if not d:
            break
        buf += d
except OSError:
    pass
print(buf.hex())
"""


def _as_nobody(sock_path: str) -> dict | None:
    """Say hello to the daemon from uid/gid 65534 (no ectier, no msgpack there); the first reply
    (the hello's, or a refusal) or None."""
    hello = encode_frame({"id": 1, "op": "hello", "version": PROTOCOL_VERSION, "client": "nobody"})
    r = subprocess.run([SYSTEM_PYTHON, "-c", _PEER_SCRIPT, sock_path, hello.hex()],
                       user=65534, group=65534, extra_groups=[], capture_output=True, text=True, timeout=30,
                       cwd="/", env={"PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr
    data = bytes.fromhex(r.stdout.strip())
    if not data:
        return None
    (n,) = struct.unpack(">I", data[:4])
    return msgpack.unpackb(data[4:4 + n])


needs_root = pytest.mark.skipif(not IS_ROOT or not os.path.exists(SYSTEM_PYTHON) or _nogroup() is None,
                                reason="needs root (to run a peer as another user) and /usr/bin/python3")


@needs_root
def test_foreign_user_is_refused_even_if_the_socket_is_opened_up(main_daemon):
    refused = daemon_stats(main_daemon.socket_path)["daemon"]["refused"]
    os.chmod(main_daemon.dir, 0o711)
    os.chmod(main_daemon.socket_path, 0o666)  # a mistake by an operator: SO_PEERCRED still guards
    try:
        r = _as_nobody(main_daemon.socket_path)
    finally:
        os.chmod(main_daemon.socket_path, 0o600)
        os.chmod(main_daemon.dir, 0o700)
    assert r is not None and r["ok"] is False and r["error"]["type"] == "PermissionError", r
    assert "allowed_group" in r["error"]["message"]
    assert daemon_stats(main_daemon.socket_path)["daemon"]["refused"] == refused + 1


@needs_root
def test_allowed_group_lets_its_members_in(restricted):
    gid = 65534
    st_sock = os.stat(restricted.socket_path)
    assert stat.S_IMODE(st_sock.st_mode) == 0o660 and st_sock.st_gid == gid
    c = DaemonClient(restricted.socket_path)
    try:
        c.connect()
        arena = os.stat(c.server_info["arena"]["path"])
    finally:
        c.close()
    assert stat.S_IMODE(arena.st_mode) == 0o660 and arena.st_gid == gid
    r = _as_nobody(restricted.socket_path)
    assert r is not None and r["ok"] and r["id"] == 1 and r["version"] == PROTOCOL_VERSION, r


def test_restricted_socket_mode(restricted):
    assert stat.S_IMODE(os.stat(restricted.socket_path).st_mode) == 0o660


def _frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


MALFORMED = [
    ("garbage-body", _frame(b"\xc1\xc1\xc1"), None, "undecodable"),
    ("non-map", _frame(msgpack.packb([1, 2, 3])), None, "map"),
    ("bin-blob", _frame(msgpack.packb({"id": 3, "op": "ping", "x": b"\0" * 100}, use_bin_type=True)), None,
     "undecodable"),
    ("no-id", _frame(msgpack.packb({"op": "ping"})), None, "'id'"),
    ("unknown-op", _frame(msgpack.packb({"id": 5, "op": "explode"})), 5, "'op'"),
    ("wrong-type", _frame(msgpack.packb({"id": 6, "op": "get", "key": 7})), 6, "'key'"),
    ("bool-lease", _frame(msgpack.packb({"id": 7, "op": "release", "lease": True})), 7, "'lease'"),
    ("bad-shape", _frame(msgpack.packb({"id": 8, "op": "reserve", "key": "k", "dtype": "uint8", "shape": [-1]})),
     8, "'shape'"),
    ("extra-arg", _frame(msgpack.packb({"id": 9, "op": "stats", "verbose": 1})), 9, "'verbose'"),
]


@pytest.mark.parametrize("name, data, rid, words", MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_frame_gets_an_error_reply_and_the_connection_survives(main_daemon, name, data, rid, words):
    with RawConn(main_daemon.socket_path) as raw:
        raw.send(data)
        r = raw.reply()
        assert r is not None, "the daemon hung up on a non-fatal error"
        assert r["ok"] is False and r["id"] == rid
        assert r["error"]["type"] == "ProtocolError"
        assert words in r["error"]["message"]
        assert raw.request({"id": 42, "op": "ping"}) == {"id": 42, "ok": True}


def test_invalid_key_is_a_typed_error_reply(main_daemon):
    with RawConn(main_daemon.socket_path) as raw:
        r = raw.request({"id": 1, "op": "get", "key": ""})
        assert r["ok"] is False and r["error"]["type"] == "InvalidKeyError"


@pytest.mark.parametrize("data", [
    b"\xff\xff\xff\xff",
    struct.pack(">I", 64 * KiB + 1) + b"\0" * 100,  # one byte over daemon.max_frame_bytes
    b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n",  # 'GET ' read as a length prefix
], ids=["max-prefix", "cap+1", "http"])
def test_fatal_framing_error_closes_only_that_connection(main_daemon, client, data):
    with RawConn(main_daemon.socket_path) as bystander, RawConn(main_daemon.socket_path) as raw:
        raw.send(data)
        replies = raw.replies_until_eof()
        assert len(replies) == 1
        assert replies[0]["ok"] is False and replies[0]["error"]["type"] == "ProtocolError"
        assert "exceeds" in replies[0]["error"]["message"]
        assert bystander.request({"id": 1, "op": "ping"})["ok"]
    client.ping()


_fuzz = st.one_of(
    st.binary(max_size=300),
    st.lists(st.one_of(st.binary(max_size=80).map(_frame),
                       st.binary(max_size=40),
                       st.dictionaries(st.sampled_from(["id", "op", "key", "lease", "shape", "dtype", "version"]),
                                       st.one_of(st.integers(-5, 1 << 40), st.text(max_size=8), st.booleans(),
                                                 st.lists(st.integers(-2, 9), max_size=3), st.none()),
                                       max_size=5).map(lambda m: _frame(msgpack.packb(m)))),
             max_size=5).map(b"".join),
)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=_fuzz)
def test_random_bytes_never_kill_the_daemon(main_daemon, client, data):
    with RawConn(main_daemon.socket_path, timeout=10) as raw:
        try:
            raw.send(data)
            raw.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the daemon hung up first (fatal framing error)
        replies = raw.replies_until_eof()
    for r in replies:
        assert isinstance(r, dict) and "ok" in r and "id" in r
        if not r["ok"]:
            assert r["error"]["type"] in ("ProtocolError", "InvalidKeyError", "EntryTooLargeError",
                                          "InvalidTensorError", "EctierError"), r
    assert client.ping() < 1.0


# ========================================================================== CLI and metrics


def test_stats_command_prints_tiers_and_clients(main_daemon, client):
    client.put("cli-visible", make_tensor(91, "uint8", (10,)))
    runner = CliRunner(env={"COLUMNS": "200"})
    r = runner.invoke(cli_main, ["stats", "--socket", main_daemon.socket_path])
    assert r.exit_code == 0, r.output
    for words in ("tiers", "host", "nvme", "used / capacity", "clients", "pytest-main", "ectier-stats",
                  main_daemon.socket_path):
        assert words in r.output, words
    r = runner.invoke(cli_main, ["stats", "--socket", main_daemon.socket_path, "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.output)
    assert data["tiers"]["host"]["capacity_bytes"] == 32 * MiB
    assert data["entries"] >= 1
    assert any(c["name"] == "ectier-stats" for c in data["daemon"]["clients"])


def test_stats_command_without_a_daemon_is_a_clean_error():
    d = short_tmpdir()
    try:
        r = CliRunner().invoke(cli_main, ["stats", "--socket", os.path.join(d, "nobody.sock")])
        assert r.exit_code != 0
        assert isinstance(r.exception, SystemExit)
        assert "Traceback" not in r.output
        assert "cannot reach" in r.output and "nobody.sock" in r.output
    finally:
        remove_dir(d)


def test_serve_with_a_bad_config_is_a_usage_error():
    d = short_tmpdir()
    try:
        path = write_config(os.path.join(d, "bad.json"), {"daemon": {"lease_s": -1}})
        r = CliRunner().invoke(cli_main, ["serve", "--config", path])
        assert r.exit_code == 2
        assert "daemon.lease_s" in r.output and "Traceback" not in r.output
    finally:
        remove_dir(d)


def test_serve_errors_are_clean(monkeypatch):
    """Start-up failures of `ectier serve` are one line naming the field, exit 1, no traceback,
    and leave no signal handler behind (run_daemon installs them before start())."""
    import signal

    d = short_tmpdir()
    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    try:
        runner = CliRunner()
        cfg = daemon_config(d, nvme=False, host_bytes=1 * MiB, shm_dir=os.path.join(d, "no", "such", "dir"))
        r = runner.invoke(cli_main, ["serve", "--config", write_config(os.path.join(d, "a.json"), cfg)])
        assert r.exit_code == 1, r.output
        assert "daemon.shm_dir" in r.output and "Traceback" not in r.output
        assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
        with open(os.path.join(d, "afile"), "w") as f:
            f.write("x")
        cfg = daemon_config(d, nvme=False, host_bytes=1 * MiB, socket_path=os.path.join(d, "afile", "s", "d.sock"))
        r = runner.invoke(cli_main, ["serve", "--config", write_config(os.path.join(d, "b.json"), cfg)])
        assert r.exit_code == 1, r.output
        assert "daemon.socket_path" in r.output and "Traceback" not in r.output
        assert [f for f in os.listdir(d) if f.endswith(".arena")] == []
    finally:
        remove_dir(d)


def test_serve_with_its_metrics_port_taken_is_one_line_and_leaves_nothing_behind():
    """A metrics port already in use: exit 1 naming daemon.metrics_port, no traceback, and no
    arena file or socket left in the directory (the arena holds RAM in /dev/shm)."""
    import socket as socket_mod

    d = short_tmpdir()
    taken = socket_mod.socket(socket_mod.AF_INET, socket_mod.SOCK_STREAM)
    try:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        cfg = daemon_config(d, nvme=False, host_bytes=1 * MiB, metrics_port=port)
        r = CliRunner().invoke(cli_main, ["serve", "--config", write_config(os.path.join(d, "m.json"), cfg)])
        assert r.exit_code == 1, r.output
        assert "daemon.metrics_port" in r.output and str(port) in r.output
        assert "Traceback" not in r.output
        assert sorted(os.listdir(d)) == ["m.json"], "a failed start left files behind"
    finally:
        taken.close()
        remove_dir(d)


def _metrics(port: int) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def _listening_addresses(port: int) -> list[str]:
    """Local addresses of TCP sockets listening on ``port`` (from /proc/net/tcp{,6})."""
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = open(table).read().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            addr, p = fields[1].split(":")
            if int(p, 16) == port and fields[3] == "0A":
                found.append(addr)
    return found


def test_metrics_endpoint(main_daemon, client):
    t = make_tensor(95, "bfloat16", (4, 8192))
    client.put("metric-me", t)
    client.get("metric-me")
    s = client.stats()
    metrics = s["daemon"].get("metrics")
    assert metrics is not None, "stats must say where the metrics endpoint listens (metrics_port: 0)"
    port = metrics["port"]
    assert metrics["host"] == "127.0.0.1" and port > 0
    m = _metrics(port)
    host = s["tiers"]["host"]
    assert m['ectier_tier_used_bytes{tier="host"}'] == host["used_bytes"]
    assert m['ectier_tier_capacity_bytes{tier="host"}'] == 32 * MiB
    assert m['ectier_tier_entries{tier="host"}'] == host["entries"]
    assert 'ectier_tier_used_bytes{tier="nvme"}' in m
    assert m['ectier_lookups_total{result="hit"}'] >= 1
    assert m["ectier_clients"] >= 1
    assert m['ectier_leases{kind="get"}'] == 0
    assert "ectier_leases_expired_total" in m
    for reason in ("idle", "evicted"):
        assert m[f'ectier_connections_closed_total{{reason="{reason}"}}'] == s["daemon"][
            "idle_closed" if reason == "idle" else "evicted"]
    assert m["ectier_connections_refused_total"] >= s["daemon"]["refused"]
    assert _listening_addresses(port) == ["0100007F"]  # 127.0.0.1 only


def test_client_registers_its_arena_mapping_with_cuda_when_present(tmp_path, monkeypatch):
    """On a GPU machine the client page-locks its mapping of the arena (cudaHostRegister) and
    unregisters it when it unmaps; emulated here with a fake cudart, since CI has no GPU."""
    import torch

    from ectier.daemon.client import DaemonClient

    calls = []

    class FakeCudart:
        def cudaHostRegister(self, ptr, size, flags):
            calls.append(("register", ptr, size, flags))
            return 0

        def cudaHostUnregister(self, ptr):
            calls.append(("unregister", ptr))
            return 0

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart())
    arena = tmp_path / "arena"
    arena.write_bytes(b"\0" * 65536)
    client = DaemonClient(str(tmp_path / "no.sock"))
    client.server_info = {"arena": {"path": str(arena), "nbytes": 65536, "block_bytes": 4096}}
    view = client._arena_tensor()
    assert calls == [("register", view.data_ptr(), 65536, 0)]
    ptr = view.data_ptr()
    del view
    client.close()
    assert calls[-1] == ("unregister", ptr)
