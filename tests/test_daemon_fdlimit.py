"""The daemon and RLIMIT_NOFILE: out of descriptors at accept it keeps serving (it used to exit
with a traceback, leaving its socket file); at start-up it raises the soft limit that
``daemon.max_clients`` needs, or warns once when the hard limit is too low. Real daemon
processes started with a low limit (tests/daemon_helpers.py, ``nofile``)."""

from __future__ import annotations

import contextlib
import os
import socket

from daemon_helpers import (
    MiB,
    DaemonProcess,
    daemon_config,
    make_tensor,
    remove_dir,
    short_tmpdir,
    tensor_digest,
    wait_for,
    write_config,
)
from ectier.daemon.client import DaemonClient
from ectier.daemon.fdlimit import FD_MARGIN


@contextlib.contextmanager
def _limited_daemon(nofile: tuple[int, int], **daemon):
    d = short_tmpdir()
    cfg = daemon_config(d, host_bytes=8 * MiB, nvme=False, **daemon)
    proc = DaemonProcess(write_config(os.path.join(d, "cfg.yaml"), cfg), cfg["daemon"]["socket_path"],
                         via="exec", nofile=nofile)
    try:
        proc.start()
        yield proc
    finally:
        proc.stop()
        remove_dir(d)


def _soft_nofile(pid: int) -> int:
    with open(f"/proc/{pid}/limits") as f:
        for line in f:
            if line.startswith("Max open files"):
                return int(line.split()[3])
    raise AssertionError("no 'Max open files' line")


def test_out_of_descriptors_at_accept_the_daemon_keeps_serving():
    """More raw connections than a 64-descriptor daemon can hold: it warns (naming
    daemon.max_clients and LimitNOFILE) at start, logs the failed accept, closes idle connections
    to make room instead of exiting; once they are gone a fresh client is served."""
    with _limited_daemon((64, 64), max_clients=5000) as proc:
        log = proc.log()
        assert "daemon.max_clients=5000" in log and "LimitNOFILE=" in log and "ulimit -n" in log, log
        socks = []
        try:
            for _ in range(150):
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.settimeout(2.0)
                try:
                    s.connect(proc.socket_path)
                except OSError:  # a full backlog: the daemon is not accepting this fast
                    s.close()
                    continue
                socks.append(s)
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
