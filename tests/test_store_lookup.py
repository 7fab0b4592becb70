"""The connector's one question per item (``lookup``) and the handle it polls (``DaemonLoad``),
called directly: the in-process store over a real ``TieredCache`` and the daemon store over a
real daemon process. (The vLLM suite drives the same calls through vLLM's scheduler.)"""

from __future__ import annotations

import time

import pytest
import torch

from daemon_helpers import MiB, host_daemon_process, make_tensor
from ectier.config import CacheConfig, HostTierConfig, NvmeTierConfig
from ectier.daemon.client import DaemonClient
from ectier.errors import InvalidKeyError
from ectier_vllm.daemon_lookups import ABSENT, PENDING, READY, DaemonLoad
from ectier_vllm.daemon_store import DaemonStore, HeldLease
from ectier_vllm.store import NOT_STORED, open_inprocess

SHAPE = (64, 8192)


# ------------------------------------------------------------------------------ in-process


def _inprocess(tmp_path, nvme: bool):
    nvme_cfg = NvmeTierConfig(path=str(tmp_path / "nvme"), capacity_bytes=64 * MiB, sync=False) if nvme \
        else NvmeTierConfig()
    return open_inprocess(CacheConfig(namespace=f"lookup-{nvme}-{tmp_path.name}",
                                      host=HostTierConfig(capacity_bytes=8 * MiB, pin_memory=False),
                                      nvme=nvme_cfg))


def test_inprocess_lookup_host_only_is_not_stored_or_pin_now(tmp_path):
    store = _inprocess(tmp_path, nvme=False)
    try:
        assert store.lookup("missing", "cpu") is NOT_STORED
        x = make_tensor(1, "bfloat16", SHAPE)
        store.cache.put("k", x)
        assert store.lookup("k", "cpu") is None  # in the host arena already: pin at once
        pin = store.acquire("k", "cpu")
        assert pin is not None and pin.shape == SHAPE and pin.dtype == "bfloat16"
        store.release(pin)
        with pytest.raises(InvalidKeyError):
            store.lookup("", "cpu")
    finally:
        store.close()


def test_inprocess_lookup_of_an_nvme_entry_is_its_promotion(tmp_path):
    store = _inprocess(tmp_path, nvme=True)
    try:
        x = make_tensor(2, "bfloat16", SHAPE)
        store.cache.put("k", x)
        store.cache.flush()
        # push it out of the host arena (8 MiB) with other entries: it then lies on NVMe only
        for i in range(8):
            store.cache.put(f"other-{i}", make_tensor(10 + i, "bfloat16", SHAPE))
        store.cache.flush()
        assert store.cache.stats()["tiers"]["nvme"]["entries"] >= 1
        assert store.lookup("missing", "cpu") is NOT_STORED
        handles = store.lookup("k", "cpu")
        assert isinstance(handles, list) and len(handles) == 1
        assert handles[0].wait(10.0) is True
        pin = store.acquire("k", "cpu")
        assert pin is not None and pin.shape == SHAPE
        store.release(pin)
        assert store.cache.get("k").view(torch.int16).equal(x.view(torch.int16))  # bitwise (NaN bits too)
    finally:
        store.close()


# ---------------------------------------------------------------------------------- daemon


@pytest.fixture
def daemon():
    with host_daemon_process(16 * MiB) as p:
        with DaemonClient(p.socket_path) as c:
            c.put("k", make_tensor(3, "bfloat16", SHAPE), namespace="test")
        yield p


class CountingClient(DaemonClient):
    """Counts the socket reads (``poll``) and the requests sent (``submit``)."""

    polls = 0
    submits = 0

    def poll(self, rid, timeout=0.0):
        self.polls += 1
        return super().poll(rid, timeout)

    def submit(self, *args, **kwargs):
        self.submits += 1
        return super().submit(*args, **kwargs)


def test_daemon_lookup_answers_stored_and_absent_keys_from_one_request(daemon):
    store = DaemonStore(daemon.socket_path, "test", timeout_s=5.0, answer_wait_s=2.0)
    try:
        store.new_step()
        store.expect(["k", "missing"])
        got = store.lookup("k", "cpu")
        assert isinstance(got, list) and len(got) == 1 and isinstance(got[0], DaemonLoad)
        assert got[0].done() and got[0].wait(0) is True and not got[0].pending
        assert store.lookup("missing", "cpu") is NOT_STORED
        assert store.lookups.sent["prefetch"] == 1  # both keys in the step's one request
        pin = store.acquire("k", "cpu")  # pinned by that request: no round trip
        assert pin is not None and isinstance(pin.lease, HeldLease) and pin.shape == SHAPE
        store.release(pin)
        store.send_releases()
        assert store.lookups.sent["release"] == 1
    finally:
        store.close()


def test_daemon_lookup_that_cannot_wait_is_pending_then_done_a_later_step(daemon):
    store = DaemonStore(daemon.socket_path, "test", timeout_s=5.0, answer_wait_s=0.0)
    try:
        deadline = time.monotonic() + 10
        while not store.client.connect_in_background():  # connected in a background thread
            assert time.monotonic() < deadline, "never connected"
            time.sleep(0.01)
        store.new_step()
        (load,) = store.lookup("k", "cpu")
        if not load.done():  # (the reply may be in already)
            assert load.pending  # nothing known of the key yet: no load-or-recompute estimate
        steps = 0
        while not load.done():
            assert steps < 500, "no answer in 500 steps"
            time.sleep(0.01)
            store.new_step()
            steps += 1
        assert load.wait(0) is True and not load.pending
    finally:
        store.close()


def test_daemon_load_given_its_answer_reads_nothing(daemon):
    client = CountingClient(daemon.socket_path, timeout_s=5.0)
    store = DaemonStore(daemon.socket_path, "test", timeout_s=5.0)
    store.client.close()
    store.client = store.lookups.client = client
    try:
        client.connect()
        lookups = store.lookups
        ready, absent = DaemonLoad(lookups, "k", READY), DaemonLoad(lookups, "missing", ABSENT)
        assert ready.done() and ready.wait(0) is True and not ready.pending
        assert absent.done() and absent.wait(0) is False
        assert (client.polls, client.submits) == (0, 0)  # answered: no question, no socket read
        assert "k" not in lookups.tracked and "missing" not in lookups.tracked
        waiting = DaemonLoad(lookups, "k", PENDING)
        assert waiting.pending and lookups.tracked["k"] == lookups.step  # asked again while polled
        assert waiting.wait(5.0) is True  # asks the daemon now
        assert client.submits >= 1 and "k" not in lookups.tracked
    finally:
        store.close()
