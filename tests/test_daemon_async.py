"""Requests sent without waiting for their reply (``DaemonClient.submit`` / ``poll``): what the
vLLM connector's scheduler asks the daemon with, so that a slow or stopped daemon never blocks a
scheduler step (issue 14). Every daemon is a real process (tests/daemon_helpers.py)."""

from __future__ import annotations

import os
import signal
import time

import pytest

from daemon_helpers import MiB, host_daemon_process, make_tensor, stop_process
from ectier.daemon.client import DaemonClient, DaemonUnavailableError

ITEM = (64, 8192)  # bfloat16: 1 MiB


@pytest.fixture
def proc():
    with host_daemon_process(8 * MiB) as p:
        yield p


def _poll_until(client: DaemonClient, rid: int, timeout: float = 10.0) -> dict:
    deadline = time.monotonic() + timeout
    while (reply := client.poll(rid, 0.05)) is None:
        assert time.monotonic() < deadline, "no reply"
    return reply


def test_a_request_to_a_stopped_daemon_returns_at_once_and_is_answered_once_it_runs(proc):
    with DaemonClient(proc.socket_path, timeout_s=30) as c:
        c.put("a", make_tensor(1, "bfloat16", ITEM))
        stop_process(proc.pid)
        try:
            t0 = time.monotonic()
            rid = c.submit("prefetch", keys=["a", "nobody"], namespace="test")
            assert c.poll(rid, 0.0) is None
            assert c.poll(rid, 0.1) is None  # waits at most what it is given
            assert time.monotonic() - t0 < 5.0  # not daemon_timeout_s (10 s)
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        assert _poll_until(c, rid)["states"] == ["ready", "absent"]
        with pytest.raises(KeyError):
            c.poll(rid)  # a reply is taken once


def test_a_call_made_meanwhile_keeps_the_reply_of_a_submitted_request(proc):
    with DaemonClient(proc.socket_path) as c:
        c.put("b", make_tensor(2, "bfloat16", ITEM))
        rid = c.submit("prefetch", keys=["b"], namespace="test")
        assert c.ping() < 5.0  # reads the prefetch's reply before its own
        assert c.contains("b", namespace="test")
        assert _poll_until(c, rid)["states"] == ["ready"]
        assert c.in_flight == 0


def test_a_submitted_request_unanswered_past_timeout_s_is_a_hung_daemon(proc):
    with DaemonClient(proc.socket_path, timeout_s=0.3, backoff_s=1.0) as c:
        c.ping()
        stop_process(proc.pid)
        try:
            rid = c.submit("ping")
            time.sleep(0.4)
            with pytest.raises(DaemonUnavailableError, match="did not answer 'ping' within 0.3 s"):
                c.poll(rid)
            assert c.unreachable
            with pytest.raises(DaemonUnavailableError):  # the back-off: at once, no attempt
                c.submit("ping")
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        time.sleep(1.1)
        assert c.ping() < 5.0  # after the back-off: a new connection


def test_an_error_reply_of_a_submitted_request_is_its_typed_error(proc):
    from ectier.daemon.protocol import ProtocolError

    with DaemonClient(proc.socket_path) as c:
        rid = c.submit("release")  # neither 'lease' nor 'leases'
        with pytest.raises(ProtocolError, match="exactly one of"):
            _poll_until(c, rid)
        assert c.ping() < 5.0


def test_the_daemon_serves_each_connection_from_a_thread_under_sched_batch(proc):
    """A connection's thread runs under SCHED_BATCH, so a request's arrival never preempts the
    client that sent it (a vLLM scheduler step): the daemon has such a thread per connection."""
    def batch_threads() -> int:
        tids = os.listdir(f"/proc/{proc.pid}/task")
        return sum(os.sched_getscheduler(int(t)) == os.SCHED_BATCH for t in tids)

    with DaemonClient(proc.socket_path) as c, DaemonClient(proc.socket_path) as d:
        c.ping()
        d.ping()  # answered: both connection threads run
        assert batch_threads() >= 2
