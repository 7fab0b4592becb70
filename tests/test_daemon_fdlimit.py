"""The daemon and RLIMIT_NOFILE: out of descriptors at accept it keeps serving (it used to exit
with a traceback, leaving its socket file); at start-up it raises the soft limit that
``daemon.max_clients`` needs, or warns once when the hard limit is too low. Real daemon
processes started with a low limit (tests/daemon_helpers.py, ``nofile``)."""

from __future__ import annotations

import os
import resource
import socket
import subprocess
import sys
import textwrap

from daemon_helpers import (
    MiB,
    daemon_process,
    make_tensor,
    remove_dir,
    short_tmpdir,
    tensor_digest,
    wait_for,
)
from ectier.daemon.client import DaemonClient
from ectier.daemon.connections import Connection, admission
from ectier.daemon.fdlimit import FD_MARGIN, client_cap


def _limited_daemon(nofile: tuple[int, int], *, nvme: bool = False, **daemon):
    """A daemon launched with ``RLIMIT_NOFILE`` ``nofile`` (a fresh ``python -m ectier.daemon``)."""
    return daemon_process("cfg.yaml", via="exec", nofile=nofile, host_bytes=8 * MiB, nvme=nvme, **daemon)


def _soft_nofile(pid: int) -> int:
    with open(f"/proc/{pid}/limits") as f:
        for line in f:
            if line.startswith("Max open files"):
                return int(line.split()[3])
    raise AssertionError("no 'Max open files' line")


def test_out_of_descriptors_at_accept_the_daemon_keeps_serving():
    """More raw connections than the daemon has descriptors for (its soft limit lowered to 40
    from outside after the start, so the cap it computed at start, 4096 - FD_MARGIN, no longer
    keeps any back): it warned (naming daemon.max_clients and LimitNOFILE) at start, logs the
    failed accept, closes idle connections to make room instead of exiting; once they are gone a
    fresh client is served."""
    with _limited_daemon((4096, 4096), max_clients=5000) as proc:
        log = proc.log()
        assert "daemon.max_clients=5000" in log and "LimitNOFILE=" in log and "ulimit -n" in log, log
        resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (40, 4096))
        socks = []
        try:
            socks += _connect_many(proc.socket_path, 150)
            wait_for(lambda: proc.proc.poll() is not None or "cannot accept a connection" in proc.log(),
                     timeout=20, what="the daemon to run out of descriptors")
            assert proc.proc.poll() is None, f"the daemon exited:\n{proc.log()}"
            assert "Too many open files" in proc.log()
        finally:
            for s in socks:
                s.close()
        t = make_tensor(7, "float32", (256,))
        with DaemonClient(proc.socket_path, client_name="after-emfile", connect_retry_s=10) as c:
            c.put("k", t)
            got = c.get("k")
        assert got is not None and tensor_digest(got) == tensor_digest(t)
        assert proc.terminate() == 0, proc.log()
        assert not os.path.exists(proc.socket_path)


def test_start_up_raises_the_soft_limit_to_what_max_clients_needs():
    """A soft limit of 64 under a hard limit of 4096: raised to max_clients + the margin, no warning."""
    with _limited_daemon((64, 4096), max_clients=500) as proc:
        assert _soft_nofile(proc.pid) == 500 + FD_MARGIN
        assert "LimitNOFILE" not in proc.log(), proc.log()


def _connect_many(path: str, n: int) -> list[socket.socket]:
    """``n`` plain connects to ``path`` (no hello); those a full backlog refused are left out."""
    socks = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(2.0)
        try:
            s.connect(path)
        except OSError:  # a full backlog: the daemon is not accepting this fast
            s.close()
            continue
        socks.append(s)
    return socks


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_connections_leave_the_daemon_descriptors_for_its_scratch_files():
    """A soft limit of 96 (hard 96) and daemon.max_clients=5000: the daemon admits at most
    96 - FD_MARGIN connections (said once in the log), so 150 plain connects held open never take
    the descriptors of its own files: a put and a get of an entry larger than the arena (through
    scratch files) succeed, nothing is logged at ERROR, and the daemon's stats (asked on the
    client's own connection) never list more than the cap. The old code let connections take all
    96 descriptors: the scratch file's open failed (an InternalError with a traceback)."""
    soft = 96
    cap = soft - FD_MARGIN
    with _limited_daemon((soft, soft), nvme=True, max_clients=5000) as proc:
        socks = []
        try:
            socks += _connect_many(proc.socket_path, 150)
            assert len(socks) > soft, len(socks)
            t = make_tensor(11, "uint8", (12_000_000,))  # larger than the 8 MiB arena: a scratch file
            # accepted after every raw connection (the listen queue is in order): stats then see them all
            with DaemonClient(proc.socket_path, client_name="big-put", connect_retry_s=10) as c:
                daemon = c.stats()["daemon"]
                assert len(daemon["clients"]) <= cap, (len(daemon["clients"]), proc.log())
                assert daemon["evicted"] >= len(socks) + 1 - cap, daemon
                assert _open_fds(proc.pid) < soft
                c.put("big", t)
                got = c.get("big")
                assert got is not None and tensor_digest(got) == tensor_digest(t)
                del got
                assert len(c.stats()["daemon"]["clients"]) <= cap
            live = 0
            for s in socks:  # the ones the daemon did not close to make room
                s.setblocking(False)
                try:
                    live += s.recv(1) != b""
                except BlockingIOError:
                    live += 1
                except OSError:
                    pass
            assert live <= cap, live
        finally:
            for s in socks:
                s.close()
        log = proc.log()
        assert " ERROR " not in log and "Traceback" not in log, log
        assert f"admitting at most {cap} client connections, not daemon.max_clients=5000" in log, log
        assert proc.terminate() == 0, log
        assert not [n for n in os.listdir(os.path.dirname(proc.socket_path)) if ".scratch-" in n]


_SCRATCH_OUT_OF_FDS = textwrap.dedent("""
    import os, resource, sys
    from ectier.daemon.scratch import Scratch
    from ectier.errors import TierWriteError
    
    directory = sys.argv[1]
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    Scratch(directory, 4096).close()  # a first mmap: its module and pages are in before the limit bites

    def fill(spare):
        held = []
        while True:
            try:
                held.append(os.open("/dev/null", os.O_RDONLY))
            except OSError:
                break
        for _ in range(spare):
            os.close(held.pop())
        return held

    fds = len(os.listdir("/proc/self/fd"))
    for spare in (0, 1):  # 0: the open fails; 1: the open succeeds and the mapping's dup fails
        held = fill(spare)
        try:
            Scratch(directory, 1 << 20)
        except TierWriteError as exc:
            print(f"{spare} TierWriteError {exc}")
        except BaseException as exc:
            print(f"{spare} {type(exc).__name__} {exc}")
        else:
            print(f"{spare} no error")
        for fd in held:
            os.close(fd)
    print("leaked fds", len(os.listdir("/proc/self/fd")) - fds)
    print("left", sorted(n for n in os.listdir(directory) if ".scratch-" in n))
""")


def test_scratch_file_out_of_descriptors_is_a_typed_error_naming_the_limit():
    """Out of descriptors (EMFILE) at a scratch file's open, or at its mapping (mmap dups the
    descriptor), Scratch raises TierWriteError naming RLIMIT_NOFILE and daemon.max_clients, not
    "no room" in daemon.shm_dir, and leaves no file behind. The old code let the open's OSError
    through (a daemon answered InternalError with a traceback at ERROR) and called the failed dup
    "no room"."""
    d = short_tmpdir()
    try:
        out = subprocess.run([sys.executable, "-c", _SCRATCH_OUT_OF_FDS, d], capture_output=True, text=True,
                             timeout=120, check=True).stdout
        lines = out.splitlines()
        assert len(lines) == 4, out
        for spare, line in enumerate(lines[:2]):
            assert line.startswith(f"{spare} TierWriteError "), out
            assert "RLIMIT_NOFILE" in line and "daemon.max_clients" in line, out
            assert "no room" not in line and "Too many open files" in line, out
        assert lines[2:] == ["leaked fds 0", "left []"], out
    finally:
        remove_dir(d)


def test_the_cap_the_limit_lowers_is_the_admission_rule_s_and_its_refusal_names_both():
    """client_cap: min(daemon.max_clients, soft - FD_MARGIN), at least 1, max_clients itself with
    room or no limit; a refusal at the lowered cap names daemon.max_clients and RLIMIT_NOFILE."""
    assert client_cap(5000, (96, 96)).limit == 96 - FD_MARGIN
    assert client_cap(10, (96, 96)).limit == 10 and not client_cap(10, (96, 96)).lowered
    assert client_cap(5000, (FD_MARGIN, FD_MARGIN)).limit == 1
    assert client_cap(5000, None).limit == 5000
    cap = client_cap(5000, (96, 96))
    working = [Connection(i, None, 100 + i, 0, 0, busy=True) for i in range(cap.limit)]
    victim, refusal = admission(working, 0, max_clients=cap.limit, max_per_uid=5000, cap_note=cap.note)
    assert victim is None and "daemon.max_clients=5000" in refusal and "RLIMIT_NOFILE=96" in refusal, refusal
    working[3].busy = False
    victim, refusal = admission(working, 0, max_clients=cap.limit, max_per_uid=5000, cap_note=cap.note)
    assert victim is working[3] and refusal is None
