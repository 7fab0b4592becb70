"""A put whose lease ends without a commit while its client process lives on (its deadline passed
while the client stalled, or its connection closed) keeps its arena blocks reserved: the client
still holds a writable mapping of the arena and the extents, and a late copy into blocks given to
another entry would hand that entry's readers foreign bytes (docs/protocol.md, ``abort``; found by
a probe, 2026-12-07: a client stalled past ``daemon.lease_s`` overwrote another client's entry).
The blocks come back when the process aborts the lease (any connection, naming the daemon run) or
exits.
"""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from daemon_helpers import MiB, daemon_config, daemon_stats, remove_dir, serve_in_thread, short_tmpdir, wait_for
from ectier import CacheConfig, testing_daemon
from ectier.daemon.client import DaemonClient

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENTRY = 6 * MiB


@pytest.fixture
def daemon(short_lease_daemon):
    """conftest.py's: 16 MiB arena, no NVMe, leases of 0.5 s."""
    return short_lease_daemon


def _orphans(sock: str) -> dict:
    return daemon_stats(sock)["daemon"]["orphaned_puts"]


def _expired(sock: str) -> int:
    return daemon_stats(sock)["daemon"]["leases_expired"]


def _scribble(arena_path: str, extents) -> None:
    """What a stalled client's late copy does: write into its reservation's extents."""
    with open(arena_path, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        for start, length in extents:
            m[start:start + length] = b"\xff" * length


def test_a_put_stalled_past_its_lease_never_lands_on_another_entry(daemon):
    sock = daemon.socket_path
    stalled, other = DaemonClient(sock), DaemonClient(sock)
    try:
        r = stalled.call("reserve", key="stalled", dtype="uint8", shape=[ENTRY])
        wait_for(lambda: daemon_stats(sock)["daemon"]["leases_expired"] >= 1, what="the lease to expire")
        assert _orphans(sock) == {"leases": 1, "bytes": ENTRY}  # its blocks stay reserved
        good = torch.arange(ENTRY // 8, dtype=torch.int64)
        other.put("good", good)
        _scribble(stalled.server_info["arena"]["path"], r["extents"])  # the stalled client resumes
        assert torch.equal(other.get("good"), good)  # on the old code: 0xff from the other client
        # the stalled client says its copy is over (a new connection: its old one was closed)
        assert stalled.call("abort", lease=r["lease"], instance=stalled.server_info["instance"]) == {"aborted": True}
        assert _orphans(sock) == {"leases": 0, "bytes": 0}
        assert not stalled.contains("stalled") and torch.equal(other.get("good"), good)
        other.put("after", torch.ones(ENTRY, dtype=torch.uint8))  # the blocks are usable again
    finally:
        stalled.close()
        other.close()


def test_an_abort_of_another_run_or_process_ends_no_orphan(daemon):
    sock = daemon.socket_path
    c = DaemonClient(sock)
    try:
        r = c.call("reserve", key="stalled", dtype="uint8", shape=[ENTRY])
        wait_for(lambda: _orphans(sock)["leases"] == 1, what="the orphan")
        assert c.call("abort", lease=r["lease"], instance="another-run") == {"aborted": False}
        assert c.call("abort", lease=r["lease"]) == {"aborted": False}  # (no run named: an old client)
        child = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
            from ectier.daemon.client import DaemonClient
            c = DaemonClient({sock!r})
            c.connect()
            print(c.call("abort", lease={r["lease"]}, instance=c.server_info["instance"])["aborted"])
        """)], capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": REPO})
        assert child.stdout.strip() == "False", child.stderr  # another process's abort
        assert _orphans(sock)["leases"] == 1
    finally:
        c.close()


def test_a_client_stalled_mid_put_retries_and_gives_its_orphan_back(daemon):
    """``DaemonClient.put`` whose copy starts after its lease expired: the commit fails, the client
    reconnects, aborts the orphan (its copy is over) and puts again; nothing stays reserved."""
    sock = daemon.socket_path
    c = DaemonClient(sock)
    try:
        t = torch.arange(ENTRY // 8, dtype=torch.int64)
        # the copy starts once the lease (0.5 s) expired, however late the reaper runs (at most 10 s)
        with testing_daemon.stall_daemon_copy(c, 10.0, until=lambda n: _expired(sock) >= 1):
            c.put("k", t)
        st = daemon_stats(sock)["daemon"]
        assert st["leases_expired"] == 1 and st["orphans"] == 1 and st["orphans_ended"] == 1
        assert st["orphaned_puts"] == {"leases": 0, "bytes": 0}
        assert torch.equal(c.get("k"), t)
    finally:
        c.close()


def _orphan_in_a_child(sock: str, nbytes: int = ENTRY) -> None:
    """Run a child process that reserves ``nbytes`` and exits once its lease became an orphan."""
    before = _orphans(sock)["leases"]
    code = textwrap.dedent(f"""
        from daemon_helpers import wait_for, daemon_stats
        from ectier.daemon.client import DaemonClient
        c = DaemonClient({sock!r})
        c.call("reserve", key="dies", dtype="uint8", shape=[{nbytes}])
        wait_for(lambda: daemon_stats({sock!r})["daemon"]["orphaned_puts"]["leases"] == {before + 1},
                 what="the orphan")
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.path.join(REPO, "tests")])}
    child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert child.returncode == 0, child.stderr


def test_the_orphan_of_a_process_that_exits_is_reclaimed(daemon):
    sock = daemon.socket_path
    _orphan_in_a_child(sock)
    wait_for(lambda: _orphans(sock)["leases"] == 0, what="the reaper to end the dead process's orphan")
    assert daemon_stats(sock)["daemon"]["orphans_ended"] == 1
    c = DaemonClient(sock)
    try:
        c.put("room", torch.ones(2 * ENTRY, dtype=torch.uint8))  # 12 of 16 MiB: the blocks came back
    finally:
        c.close()


def test_a_reservation_whose_reply_never_reached_its_client_is_no_orphan(daemon):
    """The client gave up waiting for ``reserve``'s reply (its ``timeout_s``) and closed the
    connection: it never learnt the extents, so it writes nothing there, and the reservation is
    ended at once (it stayed an orphan for the life of the client process)."""
    sock = daemon.socket_path
    c = DaemonClient(sock, timeout_s=0.3, client_name="gives-up")
    try:
        with testing_daemon.slow_daemon_reserve(daemon, 0.6) as granted:
            with pytest.raises(Exception, match="did not answer"):
                c.put("slow", torch.ones(ENTRY, dtype=torch.uint8))
            assert granted.wait(10)
            wait_for(lambda: not [x for x in daemon_stats(sock)["daemon"]["clients"] if x["name"] == "gives-up"],
                     what="the daemon to close the connection whose reply failed")
        st = daemon_stats(sock)["daemon"]
        assert st["leases"] == {"put": 0, "get": 0} and st["orphaned_puts"] == {"leases": 0, "bytes": 0}
    finally:
        c.close()


def test_a_put_that_loses_its_connection_twice_gives_both_reservations_back(daemon):
    sock = daemon.socket_path
    c = DaemonClient(sock)
    try:
        # both attempts outlive their lease (0.5 s): each copy starts once the daemon expired it
        with testing_daemon.stall_daemon_copy(c, 10.0, times=2, until=lambda n: _expired(sock) >= n):
            with pytest.raises(Exception):
                c.put("k", torch.ones(ENTRY, dtype=torch.uint8))
        st = daemon_stats(sock)["daemon"]
        assert st["orphans"] == 2 and st["orphans_ended"] == 2 and st["orphaned_puts"] == {"leases": 0, "bytes": 0}
    finally:
        c.close()


def test_an_orphan_is_watched_only_while_its_pid_names_the_client_that_connected():
    """A client that exits just before its reservation is orphaned may have its pid reused by
    another process: the start time read at connect tells them apart, so the reservation ends
    (blocks back) instead of waiting on the stranger's exit."""
    from ectier.daemon.holders import Holders, process_start

    holders, me = Holders(0), os.getpid()
    assert process_start(me) is not None and process_start(2**22 + 12345) is None
    assert not holders.watch_locked(me, process_start(me) + 1)  # the pid now names a later process
    assert holders.watched_pids_locked() == []
    assert holders.watch_locked(me, process_start(me)) and holders.watched_pids_locked() == [me]
    assert holders.watch_locked(me) and not holders.watch_locked(0)
    holders.close_locked()


def test_leases_still_expire_when_the_daemon_has_descriptors_past_1024():
    """A daemon with many clients has descriptor numbers past ``select``'s 1024: watching an
    orphan's process there killed the lease reaper (ValueError), and no lease expired again, nor
    was an exited process's orphan ended."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard < 1200:
        pytest.skip(f"RLIMIT_NOFILE hard limit {hard} < 1200")
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, 1200), hard))
    d = short_tmpdir()
    server, t = serve_in_thread(CacheConfig.from_dict(daemon_config(d, nvme=False, host_bytes=16 * MiB, lease_s=0.4)))
    filler = []
    try:
        while not filler or filler[-1] < 1030:
            filler.append(os.open("/dev/null", os.O_RDONLY))
        a = DaemonClient(server.socket_path)
        a.call("reserve", key="x", dtype="uint8", shape=[MiB])  # expires: an orphan of this (live)
        wait_for(lambda: _orphans(server.socket_path)["leases"] == 1, 5)  # process, watched by a pidfd > 1024
        a.close()
        b = DaemonClient(server.socket_path)
        b.call("reserve", key="y", dtype="uint8", shape=[MiB])
        wait_for(lambda: daemon_stats(server.socket_path)["daemon"]["leases_expired"] >= 2, 5)
        assert daemon_stats(server.socket_path)["daemon"]["leases"]["put"] == 0
        b.close()
        assert _orphans(server.socket_path)["leases"] == 2  # a's and b's: this process lives
        _orphan_in_a_child(server.socket_path, MiB)
        wait_for(lambda: _orphans(server.socket_path)["leases"] == 2, 5, what="the exited child's orphan ended")
        assert daemon_stats(server.socket_path)["daemon"]["orphans_ended"] == 1
    finally:
        for fd in filler:
            os.close(fd)
        server.stop()
        t.join(10)
        remove_dir(d)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_without_pidfds_an_exited_child_not_yet_reaped_counts_as_dead(monkeypatch):
    """Where ``pidfd_open`` is missing (Linux < 5.3) the reaper falls back to ``kill(pid, 0)``,
    which a zombie passes: an exited client whose parent has not waited for it kept its orphans."""
    from ectier.daemon.holders import Holders

    monkeypatch.delattr(os, "pidfd_open", raising=False)
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    holders = Holders(0)
    try:
        assert holders.watch_locked(child.pid)
        wait_for(lambda: open(f"/proc/{child.pid}/stat").read().rsplit(")", 1)[1].split()[0] == "Z", 10,
                 what="the child to exit (a zombie: not waited for)")
        assert holders.dead_locked() == [child.pid]
    finally:
        child.wait()
        holders.close_locked()
