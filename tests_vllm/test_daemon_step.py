"""Daemon mode, one scheduler step (``ectier_vllm.daemon_lookups.StepLookups`` over a real
``DaemonClient``): what a step costs in system calls and waits when the daemon's answer is not in,
and that a step never connects in its own thread (issue 14: the scheduler never waits on the
daemon). The daemons are real processes, or a listening socket nobody answers (a stopped one)."""

from __future__ import annotations

import os
import signal
import socket
import time

import pytest

from daemon_helpers import MiB, host_daemon_process, make_tensor, remove_dir, short_tmpdir, stop_process
from ectier.daemon.client import DaemonClient, DaemonUnavailableError
from ectier_vllm.daemon_lookups import PENDING, READY, StepLookups
from ectier_vllm.daemon_store import HeldLease
from ectier_vllm.store import Pin

KEYS = [f"item-{i}" for i in range(8)]


def _held_pin(fields: dict, instance: str) -> Pin:
    return Pin(tuple(fields["shape"]), str(fields["dtype"]), HeldLease(fields["lease"], instance))


@pytest.fixture
def proc():
    with host_daemon_process(16 * MiB) as p:  # 8 pins of 1 MiB within daemon.view_pin_bytes (half)
        yield p


class CountingClient(DaemonClient):
    """A DaemonClient that counts the socket reads the lookups ask for (``poll``)."""

    polls = 0

    def poll(self, rid, timeout=0.0):
        self.polls += 1
        return super().poll(rid, timeout)


def _ask_all(lookups: StepLookups) -> list[str]:
    lookups.expect(KEYS)
    return [lookups.answer(k) for k in KEYS]


def test_a_step_reads_the_socket_once_while_its_answer_is_not_in(proc):
    """The daemon is stopped once the step's request is sent: the eight questions of the step
    read the socket at most once between them (not once per question), return "pending" at
    once, and the answers (pinned) arrive a later step once the daemon runs again."""
    with DaemonClient(proc.socket_path) as c:
        for i, k in enumerate(KEYS):
            c.put(k, make_tensor(i, "bfloat16", (64, 8192)), namespace="test")
    client = CountingClient(proc.socket_path, timeout_s=30)
    lookups = StepLookups(client, "test", 0.0, _held_pin)
    try:
        client.connect()
        stop_process(proc.pid)
        lookups.new_step()
        assert _ask_all(lookups) == [PENDING] * 8
        assert lookups.sent["prefetch"] == 1 and client.polls <= 1, client.polls
        os.kill(proc.pid, signal.SIGCONT)
        deadline = time.monotonic() + 10
        while True:
            lookups.new_step()
            states = _ask_all(lookups)
            if states == [READY] * 8:
                break
            assert time.monotonic() < deadline, states
            time.sleep(0.01)
        pins = [lookups.take_pin(k) for k in KEYS]
        assert all(p is not None for p in pins)
        for pin in pins:
            lookups.release_later(pin.lease)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
        lookups.close()
        client.close()
    with DaemonClient(proc.socket_path) as c:  # nothing stays pinned after the release
        deadline = time.monotonic() + 10
        while (views := c.stats()["daemon"]["views"])["leases"]:
            assert time.monotonic() < deadline, views
            time.sleep(0.02)


def test_a_step_never_connects_to_a_daemon_that_does_not_answer():
    """A socket that accepts connections but never answers ``hello`` (a stopped daemon): the
    step's question returns at once ("pending" while the attempt runs in the background,
    far below the 3 s probe bound), and once the attempt failed the next questions are misses
    at once (DaemonUnavailableError) without a new attempt until the back-off ends."""
    d = short_tmpdir()
    path = os.path.join(d, "stopped.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(8)
    client = DaemonClient(path, timeout_s=30, probe_timeout_s=3.0, backoff_s=30.0)
    lookups = StepLookups(client, "test", 0.0005, _held_pin)
    try:
        lookups.new_step()
        t0 = time.monotonic()
        assert _ask_all(lookups) == [PENDING] * 8
        assert time.monotonic() - t0 < 1.0, "the step waited on the connection attempt"
        assert client.connecting and lookups.sent["prefetch"] == 0
        deadline = time.monotonic() + 10
        while client.connecting:  # the background attempt gives up after probe_timeout_s
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert client.unreachable
        lookups.new_step()
        t0 = time.monotonic()
        with pytest.raises(DaemonUnavailableError, match="not connected"):
            lookups.answer(KEYS[0])
        assert time.monotonic() - t0 < 1.0 and not client.connecting  # the back-off: no attempt
    finally:
        lookups.close()
        client.close()
        listener.close()
        remove_dir(d)


def test_a_step_connects_in_the_background_and_the_next_steps_are_answered(proc):
    """A client not connected yet (the daemon restarted, or came up after the engine): the first
    step's questions are "pending" while the connection is made in the background, then a
    later step sends the one request and gets the answers."""
    with DaemonClient(proc.socket_path) as c:
        c.put(KEYS[0], make_tensor(1, "bfloat16", (64, 8192)), namespace="test")
    client = DaemonClient(proc.socket_path, timeout_s=30)
    lookups = StepLookups(client, "test", 0.0, _held_pin)
    try:
        deadline = time.monotonic() + 10
        states = []
        while states[-1:] != [READY]:
            assert time.monotonic() < deadline, states
            lookups.new_step()
            lookups.expect(KEYS[:1])
            states.append(lookups.answer(KEYS[0]))
            time.sleep(0.01)
        assert states[0] == PENDING and lookups.sent["prefetch"] >= 1
        lookups.release_later(lookups.take_pin(KEYS[0]).lease)
    finally:
        lookups.close()
        client.close()


def test_a_promotion_in_flight_is_asked_again_when_the_step_ends():
    """An NVMe-only entry behind a slow disk (0.3 s per read): a step that used the daemon's
    "promoting" answer and sent nothing sends the next step's one request as it ends, so its
    answer can come in during the model step (not a step later); the promotion ends ready."""
    from daemon_helpers import DaemonProcess, daemon_config, write_config
    from ectier_vllm.daemon_lookups import DaemonLoad

    d = short_tmpdir()
    cfg = daemon_config(d, host_bytes=16 * MiB)
    path = write_config(os.path.join(d, "daemon.json"), cfg)
    fast = DaemonProcess(path, cfg["daemon"]["socket_path"]).start()
    slow = None
    try:
        with DaemonClient(fast.socket_path) as c:
            c.put(KEYS[0], make_tensor(3, "bfloat16", (64, 8192)), namespace="test")
        assert fast.terminate() == 0  # its host entries go to NVMe
        slow = DaemonProcess(path, cfg["daemon"]["socket_path"], via="slow-nvme", nvme_read_delay_s=0.3).start()
        client = DaemonClient(slow.socket_path, timeout_s=30)
        client.connect()
        lookups = StepLookups(client, "test", 0.0, _held_pin)
        try:
            lookups.new_step()
            handle, early, deadline = DaemonLoad(lookups, KEYS[0]), 0, time.monotonic() + 20
            while not handle.done():
                assert time.monotonic() < deadline, "the promotion never finished"
                answered = client.in_flight == 0  # this step used the daemon's answer: "promoting"
                sent = lookups.sent["prefetch"]
                lookups.new_step()
                if answered:
                    assert lookups.sent["prefetch"] == sent + 1, "asked again only a step later"
                    early += 1
                time.sleep(0.02)
            assert early >= 1 and handle.wait(0)
            lookups.release_later(lookups.take_pin(KEYS[0]).lease)
        finally:
            lookups.close()
            client.close()
    finally:
        for p in (fast, slow):
            if p is not None:
                p.stop()
        remove_dir(d)


def test_a_connection_the_daemon_closed_is_remade_in_the_background():
    """A connected client whose daemon went away (an idle timeout, a restart): the step notices
    the closed connection and reconnects in the background — even when what now listens at the
    socket never answers ``hello`` (a daemon restarting, or stopped), the step's questions
    return at once ("pending"), never after the 3 s probe bound."""
    with host_daemon_process(16 * MiB) as p:
        client = DaemonClient(p.socket_path, timeout_s=30, probe_timeout_s=3.0, backoff_s=30.0)
        lookups = StepLookups(client, "test", 0.0, _held_pin)
        listener = None
        try:
            deadline, states = time.monotonic() + 10, [PENDING]
            while PENDING in states:  # connected and answered ("absent": nothing is stored)
                assert time.monotonic() < deadline, states
                lookups.new_step()
                states = _ask_all(lookups)
                time.sleep(0.01)
            p.kill9()
            os.unlink(p.socket_path)
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(p.socket_path)
            listener.listen(8)
            for _ in range(3):
                lookups.new_step()
                t0 = time.monotonic()
                states = _ask_all(lookups)
                assert time.monotonic() - t0 < 1.0, "the step connected in its own thread"
                assert states == [PENDING] * 8
            assert client.connecting
        finally:
            lookups.close()
            client.close()
            if listener is not None:
                listener.close()
