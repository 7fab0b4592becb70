"""A client that will write into none of its connection's put reservations any more says ``bye``
before it closes: the daemon then ends those reservations at the close instead of keeping them as
orphans for the life of the client process (docs/protocol.md, ``bye``). ``DaemonClient`` says it
whenever it drops a connection, also when an exception (a signal's, say) interrupts its wait for
``reserve``'s reply: the reply, and the reservation it granted, would reach nobody (found by a
review, 2026-12-07: such a reservation stayed reserved until the process exited).
"""

from __future__ import annotations

import signal
import socket
import threading
import time

import pytest
import torch

from daemon_helpers import MiB, daemon_stats, wait_for
from ectier import testing_daemon
from ectier.daemon.client import DaemonClient
from ectier.daemon.protocol import PROTOCOL_VERSION, FrameDecoder, encode_frame

ENTRY = 6 * MiB
LEASE_S = 0.5  # the daemon.lease_s of conftest.py's short_lease_daemon


@pytest.fixture
def daemon(short_lease_daemon):
    """conftest.py's: 16 MiB arena, no NVMe, leases of LEASE_S."""
    return short_lease_daemon


def _held(sock: str) -> tuple[dict, dict]:
    st = daemon_stats(sock)["daemon"]
    return st["leases"], st["orphaned_puts"]


class Interrupted(Exception):
    pass


def test_a_put_interrupted_while_waiting_for_its_reservation_leaves_nothing_reserved(daemon):
    sock = daemon.socket_path

    def interrupt(signum, frame):
        raise Interrupted("the engine was told to stop")

    old = signal.signal(signal.SIGUSR1, interrupt)
    c = DaemonClient(sock)
    try:
        c.connect()
        with testing_daemon.slow_daemon_reserve(daemon, 0.4) as granted:
            main = threading.main_thread().ident
            threading.Timer(0.1, lambda: signal.pthread_kill(main, signal.SIGUSR1)).start()
            with pytest.raises(Interrupted):
                c.put("k", torch.ones(ENTRY, dtype=torch.uint8))
            assert granted.wait(10)
        time.sleep(3 * LEASE_S)  # past the lease's deadline: on the old code, an orphan until exit
        assert _held(sock) == ({"put": 0, "get": 0}, {"leases": 0, "bytes": 0})
        t = torch.arange(2 * ENTRY // 8, dtype=torch.int64)  # 12 of 16 MiB: the blocks came back
        c.put("after", t)
        assert torch.equal(c.get("after"), t)
    finally:
        signal.signal(signal.SIGUSR1, old)
        c.close()


def _raw(sock_path: str) -> tuple[socket.socket, FrameDecoder]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(sock_path)
    dec = FrameDecoder()
    assert "bye" in _ask(s, dec, 1, "hello", version=PROTOCOL_VERSION, client="raw")["features"]
    return s, dec


def _ask(s: socket.socket, dec: FrameDecoder, rid: int, op: str, **args) -> dict:
    s.sendall(encode_frame({"id": rid, "op": op, **args}))
    while True:
        for msg in dec.feed(s.recv(65536)):
            assert msg["id"] == rid and msg.get("ok"), msg
            return msg


@pytest.mark.parametrize("says_bye", [True, False])
def test_a_connection_closed_after_bye_keeps_no_orphan(daemon, says_bye):
    """The control case (no ``bye``) keeps the orphan: the client may still be copying."""
    sock = daemon.socket_path
    s, dec = _raw(sock)
    _ask(s, dec, 2, "reserve", key="k", dtype="uint8", shape=[ENTRY])
    if says_bye:
        _ask(s, dec, 3, "bye")
    s.close()
    wait_for(lambda: _held(sock)[0]["put"] == 0, what="the reservation to leave its closed connection")
    assert _held(sock)[1] == ({"leases": 0, "bytes": 0} if says_bye else {"leases": 1, "bytes": ENTRY})


def test_close_after_a_low_level_reserve_keeps_no_orphan(daemon):
    sock = daemon.socket_path
    c = DaemonClient(sock)
    c.call("reserve", key="k", dtype="uint8", shape=[ENTRY])
    c.close()
    wait_for(lambda: _held(sock)[0]["put"] == 0, what="the reservation to end")
    assert _held(sock)[1] == {"leases": 0, "bytes": 0}


def test_a_forked_child_closing_the_client_says_no_bye_for_its_parent(daemon):
    """The child shares the parent's socket but not its copies: its ``close()`` must not tell the
    daemon that the parent's reservations are done with (review, 2026-12-07)."""
    import os

    sock = daemon.socket_path
    c = DaemonClient(sock)
    try:
        c.call("reserve", key="parent", dtype="uint8", shape=[ENTRY])
        pid = os.fork()
        if pid == 0:  # the child: close, and leave at once
            try:
                c.close()
            finally:
                os._exit(0)
        os.waitpid(pid, 0)
        time.sleep(3 * LEASE_S)  # the parent stalls past its lease: an orphan, kept for it
        assert _held(sock)[1] == {"leases": 1, "bytes": ENTRY}
    finally:
        c.close()


def test_close_from_a_signal_handler_during_a_put_waits_for_its_copy(daemon):
    """An engine's signal handler that shuts its client down while a put of the same thread is
    between its reservation and the end of its copy: closing at once would unmap the arena under
    the copy (a crash) and say ``bye`` while the copy still writes (the daemon frees the blocks;
    the late bytes land in another entry). The close waits for the put; the put completes."""
    import os
    import subprocess
    import sys
    import textwrap

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = textwrap.dedent(f"""
        import os, signal, threading, torch
        from ectier import testing_daemon
        from ectier.daemon.client import DaemonClient
        c = DaemonClient({daemon.socket_path!r})
        c.connect()
        signal.signal(signal.SIGUSR1, lambda *a: c.close())
        main = threading.main_thread().ident
        threading.Timer(0.1, lambda: signal.pthread_kill(main, signal.SIGUSR1)).start()
        t = torch.arange({ENTRY} // 8, dtype=torch.int64)
        with testing_daemon.stall_daemon_copy(c, 0.3):  # (within daemon.lease_s: no expiry)
            c.put("k", t)
        other = DaemonClient({daemon.socket_path!r})
        print("stored", torch.equal(other.get("k"), t))
        other.close()
    """)
    env = {**os.environ, "PYTHONPATH": repo}
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert child.returncode == 0 and "stored True" in child.stdout, (child.returncode, child.stdout, child.stderr[-2000:])
    wait_for(lambda: _held(daemon.socket_path) == ({"put": 0, "get": 0}, {"leases": 0, "bytes": 0}), 5,
             what="nothing held once the child is gone")
