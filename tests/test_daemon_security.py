"""Who may use the daemon: the socket and arena are private to the daemon's user (mode 0600)
unless ``daemon.allowed_group`` / ``daemon.socket_mode`` open them; peers are checked by
``SO_PEERCRED`` even when the socket is opened up by mistake; at ``daemon.max_clients`` an idle
connection makes room. Helpers: tests/daemon_helpers.py.

The tests that run a peer as another user need root (and /usr/bin/python3); they skip otherwise.

Daemons:
- ``main``: 32 MiB host, NVMe, metrics on an ephemeral port, 64 KiB frame cap, lease 30 s.
- ``restricted``: lease_s 0.5, max_clients 4, socket mode 0660 (group ``nogroup`` when run as root).
"""

from __future__ import annotations

import os
import stat
import struct
import subprocess

import msgpack
import pytest

from daemon_helpers import (
    MiB,
    IS_ROOT,
    DaemonProcess,
    RawConn,
    daemon_config,
    daemon_stats,
    nogroup,
    remove_dir,
    short_tmpdir,
    wait_for,
    write_config,
)
from ectier import CacheConfig
from ectier.daemon.client import DaemonClient
from ectier.daemon.protocol import PROTOCOL_VERSION, encode_frame
from ectier.daemon.server import DaemonServer
from ectier.errors import EctierError

SYSTEM_PYTHON = "/usr/bin/python3"


# ==================================================================== socket and arena modes


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


def test_restricted_socket_mode(restricted):
    assert stat.S_IMODE(os.stat(restricted.socket_path).st_mode) == 0o660


# ========================================================================== peer credentials


def test_peer_allowed_rules(monkeypatch):
    import types

    import ectier.daemon.server as srv
    import ectier.daemon.serving as serving  # the connections' admission lives there

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
    monkeypatch.setattr(serving.pwd, "getpwuid", getpwuid)
    me = os.getuid()
    base = daemon_config("/tmp/unused", nvme=False, host_bytes=1 * MiB)

    plain = DaemonServer(CacheConfig.from_dict(base))
    assert plain.peer_allowed(me, 12345)
    assert not plain.peer_allowed(1001, 4242)  # no allowed_group: only the daemon's own user
    assert not plain.peer_allowed(me + 1 if me != 1001 else 1003, os.getgid())

    base["daemon"]["allowed_group"] = "encoders"
    grouped = DaemonServer(CacheConfig.from_dict(base))
    assert grouped.peer_allowed(me, 12345)
    assert grouped.peer_allowed(1002, 4242)  # primary group
    assert grouped.peer_allowed(1001, 100)  # supplementary member
    assert not grouped.peer_allowed(1002, 100)  # neither
    assert not grouped.peer_allowed(31337, 100)  # unknown user
    assert grouped.peer_allowed(31337, 4242)  # unknown user whose primary group is allowed

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


needs_root = pytest.mark.skipif(not IS_ROOT or not os.path.exists(SYSTEM_PYTHON) or nogroup() is None,
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


@needs_root
def test_allowed_group_alone_opens_the_socket_to_the_group():
    """``daemon.allowed_group`` with ``socket_mode`` left at its default ``"0600"``: the socket
    becomes ``0660`` and group-owned (docs/operations.md, Security), so a member can connect; it
    stayed ``0600`` before (every member refused with EACCES)."""
    if nogroup() is None:
        pytest.skip("no group 65534 on this machine")
    d = short_tmpdir()
    os.chmod(d, 0o711)
    try:
        cfg = daemon_config(d, host_bytes=8 * MiB, nvme=False, allowed_group=nogroup())
        proc = DaemonProcess(write_config(os.path.join(d, "cfg.json"), cfg), cfg["daemon"]["socket_path"])
        proc.start()
        try:
            st = os.stat(proc.socket_path)
            assert stat.S_IMODE(st.st_mode) == 0o660 and st.st_gid == 65534
            r = _as_nobody(proc.socket_path)
            assert r is not None and r["ok"], r
        finally:
            proc.stop()
    finally:
        remove_dir(d)


# ==================================================================================== limits


def test_max_clients_makes_room_by_closing_the_least_recently_used_idle_connection(restricted):
    """At daemon.max_clients a new client is not refused while some connection is idle: the least
    recently used idle one is closed for it (refusal, when every connection holds a lease, is in
    test_daemon_connection_caps.py)."""
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
