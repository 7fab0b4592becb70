"""Daemon mode: an encoder instance and a prefill/decode instance (two engines, each with its own
scheduler and worker connectors) share one `ectier serve` process on this node."""

from __future__ import annotations

import gc
import logging
import os
import threading
import time

import pytest
import torch

import harness as H
from conftest import run_step
from daemon_helpers import DaemonProcess, short_tmpdir
from ectier_vllm import testing as ct


def _wait_released(client) -> None:
    """Wait until the daemon holds no lease of this process (views freed, pins released)."""
    from ectier.daemon.client_views import releaser_for

    gc.collect()
    assert releaser_for(client.socket_path, client.timeout_s).flush(10.0)
    deadline = time.monotonic() + 10
    while (s := client.stats()["daemon"])["leases"]["get"] or s["views"]["leases"]:
        assert time.monotonic() < deadline, s
        time.sleep(0.02)


def _until_scheduled(sched, worker, req_id: str, max_steps: int = 500, per_step_s: float = 1.0):
    """Run engine steps until ``req_id`` is scheduled (a daemon-mode lookup is answered in a
    later step when the daemon's reply is not in within the step's wait); returns the last
    step's outputs. Every ``schedule()`` returns within ``per_step_s``."""
    for _ in range(max_steps):
        t0 = time.monotonic()
        so = sched.schedule()
        assert time.monotonic() - t0 < per_step_s, "schedule() waited on the daemon"
        out = sched.update_from_output(so, worker.execute(so))
        if req_id in {r.req_id for r in so.scheduled_new_reqs}:
            return so, out
        time.sleep(0.002)
    raise AssertionError(f"{req_id} never scheduled")


def test_encoder_instance_to_pd_instance_through_the_daemon(engine, daemon):
    extra = {"mode": "daemon", "socket_path": daemon.socket_path, "namespace": "qwen-test"}
    items = [H.Item("m" * 64, 0, 64), H.Item("n" * 64, 100, 33)]

    enc_sched, enc_worker = engine("ec_producer", extra)
    enc_sched.add_request(H.make_request("p", items))
    so, _ = run_step(enc_sched, enc_worker)
    assert sorted(so.scheduled_encoder_inputs["p"]) == [0, 1]
    produced = {h: t.clone() for h, t in enc_worker.encoder_cache.items()}

    pd_sched, pd_worker = engine("ec_consumer", extra)
    assert ct.daemon_client(pd_sched.ec_connector) is not ct.daemon_client(pd_worker.connector)
    pd_sched.add_request(H.make_request("c", items + [H.Item("absent", 200, 10)]))
    so, out = _until_scheduled(pd_sched, pd_worker, "c")
    assert so.scheduled_encoder_inputs == {"c": [2]}  # only the item nobody produced is encoded
    for h, t in produced.items():
        got = pd_worker.encoder_cache[h]
        assert got.dtype == t.dtype and torch.equal(got.view(torch.int16), t.view(torch.int16))
    stats = out[0].scheduler_stats.ec_connector_stats
    assert stats["hits"] == 2 and stats["misses"] == 1 and stats["loads"] == 2
    # the scheduler's pins (process-held daemon leases) are released after the worker's report,
    # by the background releaser; the worker's loads are zero-copy views, released once freed
    assert ct.pinned(pd_sched.ec_connector) == set()
    client = ct.daemon_client(pd_sched.ec_connector)
    views = client.stats()["daemon"]["views"]
    # 2 pins; the worker (same process) viewed them without asking the daemon again
    assert views["granted"] == 2 and views["refused"] == 0 and views["leases"] == 2
    del got, t
    pd_worker.encoder_cache.clear()
    _wait_released(client)


def test_daemon_down_is_a_miss_not_a_crash(engine, daemon):
    extra = {"mode": "daemon", "socket_path": daemon.socket_path, "daemon_timeout_s": 1}
    sched, worker = engine("ec_consumer", extra)
    daemon.stop()
    sched.add_request(H.make_request("c", [H.Item("o" * 64, 0, 20)]))
    t0 = time.monotonic()
    so, out = run_step(sched, worker)
    # a daemon that went away costs one reconnect wait, bounded by daemon_timeout_s (1 s), not 5 s
    assert time.monotonic() - t0 < 3.0
    assert so.scheduled_encoder_inputs == {"c": [0]}  # store unreachable => encoded locally
    assert worker.encoded == ["o" * 64]
    t0 = time.monotonic()
    sched.add_request(H.make_request("d", [H.Item("q" * 64, 0, 20)]))
    so, out = run_step(sched, worker)
    assert time.monotonic() - t0 < 0.5  # and then fails fast: a miss at once
    assert so.scheduled_encoder_inputs == {"d": [0]}


PER_CALL_S = 0.5  # generous: a lookup or save against a missing daemon takes about a millisecond


def test_no_daemon_lookups_and_saves_are_fast_misses_with_one_warning(engine, caplog):
    """No daemon at socket_path (not started, or a wrong path): the engine starts with ONE warning
    naming ec_connector_extra_config.socket_path, and every lookup and save is a miss at once, not
    a DaemonClient connect_retry_s wait (5 s) per call. Default daemon_timeout_s (10 s)."""
    d = short_tmpdir()
    sock = os.path.join(d, "nobody-listens.sock")
    with caplog.at_level(logging.WARNING):
        prod_sched, prod_worker = engine("ec_producer", {"mode": "daemon", "socket_path": sock})
        cons_sched, cons_worker = engine("ec_consumer", {"mode": "daemon", "socket_path": sock})
    warned = [r for r in caplog.records if "ec_connector_extra_config.socket_path" in r.getMessage()
              and sock in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]

    n = 6
    for i in range(n):  # saves: the producer's worker puts each encoded item
        prod_sched.add_request(H.make_request(f"p{i}", [H.Item(f"s{i}" * 32, 0, 20)]))
        t0 = time.monotonic()
        so, _ = run_step(prod_sched, prod_worker)
        assert time.monotonic() - t0 < PER_CALL_S, f"save {i}"
        assert so.scheduled_encoder_inputs == {f"p{i}": [0]}
    assert len(prod_worker.encoded) == n

    misses = 0
    for i in range(n):  # lookups: every item is a miss, encoded locally
        cons_sched.add_request(H.make_request(f"c{i}", [H.Item(f"l{i}" * 32, 0, 20)]))
        t0 = time.monotonic()
        so, out = run_step(cons_sched, cons_worker)
        assert time.monotonic() - t0 < PER_CALL_S, f"lookup {i}"
        assert so.scheduled_encoder_inputs == {f"c{i}": [0]}
        stats = out[0].scheduler_stats.ec_connector_stats if out else None
        misses += (stats or {}).get("misses", 0)
    assert cons_worker.encoded == [f"l{i}" * 32 for i in range(n)]
    assert misses == n


# ------------------------------------------------------------------ the scheduler never waits on I/O


def test_a_hung_daemon_is_a_miss_or_a_failed_load_never_an_exception(engine, daemon):
    """A daemon that stops answering (SIGSTOP): a lookup is a miss after daemon_timeout_s (then
    fast misses: the back-off), no exception reaches the engine; an item pinned before it hung
    still loads (the worker views the scheduler's pin, same process); once it answers again the
    releases queued meanwhile reach it (the background releaser retries) and nothing stays pinned."""
    import signal

    from daemon_helpers import daemon_stats

    extra = {"mode": "daemon", "socket_path": daemon.socket_path, "namespace": "qwen-test", "daemon_timeout_s": 1}
    item, other = H.Item("h" * 64, 0, 20), H.Item("i" * 64, 0, 20)
    _produce(engine, extra, [item, other])
    sched, worker = engine("ec_consumer", extra)
    sched.add_request(H.make_request("pinned", [item]))
    for _ in range(500):  # until pinned for a load (answered within a step or a later one)
        so = sched.schedule()
        if "pinned" in {r.req_id for r in so.scheduled_new_reqs}:
            break
        sched.update_from_output(so, worker.execute(so))
        time.sleep(0.002)
    assert so.scheduled_encoder_inputs == {}  # pinned for a load
    os.kill(daemon.pid, signal.SIGSTOP)
    try:
        out = worker.execute(so)  # read from the pin the scheduler staged (same process): no request
        sched.update_from_output(so, out)
        assert worker.encoded == []
        t0 = time.monotonic()
        sched.add_request(H.make_request("later", [other]))
        # deferred while the daemon does not answer; a miss once daemon_timeout_s (1 s) is past
        so, out = _until_scheduled(sched, worker, "later", max_steps=1000, per_step_s=0.5)
        assert time.monotonic() - t0 < 3.0
        assert so.scheduled_encoder_inputs.get("later") == [0]  # a miss: encoded locally
        assert worker.encoded == ["i" * 64]
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
    worker.encoder_cache.clear()  # the loaded views
    gc.collect()
    deadline = time.monotonic() + 15
    while (s := daemon_stats(daemon.socket_path)["daemon"])["views"]["leases"] or s["leases"]["get"]:
        assert time.monotonic() < deadline, (s["views"], s["leases"])  # a lease granted for a lost reply leaks
        time.sleep(0.05)


def _restart_slow(daemon: DaemonProcess, delay_s: float) -> DaemonProcess:
    """Stop ``daemon`` (SIGTERM: its host entries are flushed to NVMe) and start one on the same
    config whose NVMe reads take ``delay_s`` each (tests/slow_nvme_daemon.py): every entry is now
    on NVMe only, behind a slow disk."""
    assert daemon.terminate() == 0, daemon.log()
    slow = DaemonProcess(daemon.config_path, daemon.socket_path, via="slow-nvme", nvme_read_delay_s=delay_s)
    return slow.launch().wait_ready()


def _produce(engine, extra, items) -> dict[str, torch.Tensor]:
    """Encode ``items`` on a producer engine (saved to the daemon); returns what it encoded."""
    sched, worker = engine("ec_producer", extra)
    sched.add_request(H.make_request("p", items))
    run_step(sched, worker)
    return {h: t.clone() for h, t in worker.encoder_cache.items()}


@pytest.fixture
def counted_calls(monkeypatch):
    """Every DaemonClient request (``call``) made while this fixture is active, by op name."""
    from ectier.daemon.client import DaemonClient

    ops: list[str] = []
    original, original_submit = DaemonClient.call, DaemonClient.submit

    def counting(self, op, **kw):
        if threading.current_thread() is threading.main_thread():  # not the background releaser's
            ops.append(op)
        return original(self, op, **kw)

    def counting_submit(self, op, **kw):  # requests sent without waiting for the reply
        if threading.current_thread() is threading.main_thread():
            ops.append(op)
        return original_submit(self, op, **kw)

    monkeypatch.setattr(DaemonClient, "call", counting)
    monkeypatch.setattr(DaemonClient, "submit", counting_submit)
    return ops


STALL_S = 3.0  # each NVMe read of the slowed daemon


def test_an_nvme_only_entry_never_stalls_the_scheduler(engine, daemon):
    """After a daemon restart the entry is on NVMe only, behind a disk that takes STALL_S per
    read: every schedule() returns in well under that (the daemon promotes in its own threads),
    the request waits for the promotion instead of the scheduler, and then loads the entry."""
    extra = {"mode": "daemon", "socket_path": daemon.socket_path, "namespace": "qwen-test"}
    item = H.Item("s" * 64, 0, 64)
    produced = _produce(engine, extra, [item])
    slow = _restart_slow(daemon, STALL_S)
    try:
        sched, worker = engine("ec_consumer", extra)
        sched.add_request(H.make_request("c", [item]))
        scheduled, deadline = False, time.monotonic() + 6 * STALL_S + 20
        while not scheduled:
            assert time.monotonic() < deadline, "the promotion never finished"
            t0 = time.monotonic()
            so = sched.schedule()
            assert time.monotonic() - t0 < STALL_S / 2, "schedule() waited on the daemon's NVMe read"
            scheduled = "c" in {r.req_id for r in so.scheduled_new_reqs}
            sched.update_from_output(so, worker.execute(so))
            time.sleep(0.05)
        assert worker.encoded == []  # loaded, not encoded
        got = worker.encoder_cache[item.mm_hash]
        assert torch.equal(got.view(torch.int16), produced[item.mm_hash].view(torch.int16))
    finally:
        slow.stop()


def test_one_round_trip_per_step_for_eight_items(engine, daemon, counted_calls):
    """Eight NVMe-only items of one request, promoted over several steps: each step asks the
    daemon about all of them in at most ONE request (``prefetch``; none while the last one is
    unanswered), which also pins those that are ready; the scheduler's only other request is the
    batched ``release`` of its pins once the worker reported the loads."""
    extra = {"mode": "daemon", "socket_path": daemon.socket_path, "namespace": "qwen-test"}
    items = [H.Item(f"{i}" * 64, 40 * i, 32) for i in range(8)]
    produced = _produce(engine, extra, items)
    slow = _restart_slow(daemon, 0.3)  # 8 reads through the daemon cache's 2 prefetch threads
    try:
        sched, worker = engine("ec_consumer", extra)
        sched.add_request(H.make_request("c", items))
        steps, scheduled = [], False
        while not scheduled:
            assert len(steps) < 2000, "the promotions never finished"
            del counted_calls[:]
            so = sched.schedule()
            steps.append(list(counted_calls))
            scheduled = "c" in {r.req_id for r in so.scheduled_new_reqs}
            sched.update_from_output(so, worker.execute(so))
            time.sleep(0.02)
        for ops in steps:
            assert ops.count("prefetch") <= 1 and set(ops) <= {"prefetch", "release"}, ops
        assert sum(ops.count("release") for ops in steps) <= 1  # one request for the 8 pins
        assert len(steps) > 1  # the promotions took several steps
        sched_store = ct.store(sched.ec_connector)
        assert sched_store.client.stats()["daemon"]["views"]["granted"] >= 8
        assert worker.encoded == []
        for h, t in produced.items():
            assert torch.equal(worker.encoder_cache[h].view(torch.int16), t.view(torch.int16))
    finally:
        slow.stop()


def test_a_miss_is_asked_once_per_step(engine, daemon, counted_calls):
    """Two requests of one step need the same item, which nobody stored: one daemon request for
    both (the first request's ``prefetch`` answer holds for the rest of the step)."""
    extra = {"mode": "daemon", "socket_path": daemon.socket_path, "namespace": "qwen-test"}
    sched, worker = engine("ec_consumer", extra)
    shared = H.Item("x" * 64, 0, 20)
    sched.add_request(H.make_request("c1", [shared, H.Item("y" * 64, 100, 20)]))
    sched.add_request(H.make_request("c2", [shared]))
    del counted_calls[:]
    scheduled: set[str] = set()
    for _ in range(500):  # the answer may come a step later: both requests wait for it
        so = sched.schedule()
        scheduled |= {r.req_id for r in so.scheduled_new_reqs}
        sched.update_from_output(so, worker.execute(so))
        if scheduled == {"c1", "c2"}:
            break
        time.sleep(0.002)
    assert counted_calls == ["prefetch"]
    assert scheduled == {"c1", "c2"}  # misses: encoded locally


def test_a_daemon_without_prefetch_is_asked_as_before(engine, daemon, monkeypatch, counted_calls):
    """Against a daemon that lists no features (older than this connector) the connector falls
    back to a ``contains`` per item and a synchronous pin, and still loads what was saved."""
    from ectier.daemon.client import DaemonClient

    monkeypatch.setattr(DaemonClient, "features", property(lambda self: frozenset()))
    extra = {"mode": "daemon", "socket_path": daemon.socket_path, "namespace": "qwen-test"}
    item = H.Item("m" * 64, 0, 64)
    produced = _produce(engine, extra, [item])
    sched, worker = engine("ec_consumer", extra)
    sched.add_request(H.make_request("c", [item]))
    del counted_calls[:]
    so = sched.schedule()
    assert counted_calls == ["contains", "get"]
    sched.update_from_output(so, worker.execute(so))
    assert worker.encoded == []
    assert torch.equal(worker.encoder_cache[item.mm_hash].view(torch.int16), produced[item.mm_hash].view(torch.int16))


def test_a_stopped_daemon_never_blocks_the_scheduler_and_the_item_loads_a_later_step(engine, daemon):
    """SIGSTOP of the daemon once the consumer is connected: ``schedule()`` (and so
    ``ensure_cache_available``) returns at once, far below daemon_timeout_s (10 s), with the
    request deferred; after SIGCONT the daemon's answer arrives, the item loads a later step
    (not encoded), and once the worker reported the load and vLLM dropped it nothing stays
    pinned. Before issue 14, the step's ``prefetch`` round trip blocked ``schedule()`` until the
    daemon answered."""
    import signal

    from daemon_helpers import daemon_stats, stop_process

    extra = {"mode": "daemon", "socket_path": daemon.socket_path, "namespace": "qwen-test"}
    item = H.Item("w" * 64, 0, 32)
    produced = _produce(engine, extra, [item])
    sched, worker = engine("ec_consumer", extra)
    sched.add_request(H.make_request("c", [item]))
    stop_process(daemon.pid)
    resumed = threading.Timer(3.0, os.kill, (daemon.pid, signal.SIGCONT))
    resumed.start()
    try:
        t0 = time.monotonic()
        so = sched.schedule()
        assert time.monotonic() - t0 < 1.0, "schedule() waited for the stopped daemon"
        assert so.scheduled_new_reqs == [] and so.scheduled_encoder_inputs == {}  # deferred, not a miss
        sched.update_from_output(so, worker.execute(so))
        so, _ = _until_scheduled(sched, worker, "c", max_steps=5000, per_step_s=1.0)
    finally:
        resumed.cancel()
        os.kill(daemon.pid, signal.SIGCONT)
    assert so.scheduled_encoder_inputs == {} and worker.encoded == []  # loaded, not encoded
    got = worker.encoder_cache[item.mm_hash]
    assert torch.equal(got.view(torch.int16), produced[item.mm_hash].view(torch.int16))
    assert ct.pinned(sched.ec_connector) == set()
    del got
    worker.encoder_cache.clear()
    gc.collect()
    deadline = time.monotonic() + 10
    while (s := daemon_stats(daemon.socket_path)["daemon"])["views"]["leases"] or s["leases"]["get"]:
        assert time.monotonic() < deadline, (s["views"], s["leases"])
        time.sleep(0.02)


def _v1_producer(model_dir, monkeypatch, extra):
    """A pure producer on vLLM's V1 model runner: its scheduler confirms the saves itself."""
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    cfg = H.make_vllm_config(model_dir, "ec_producer", extra)
    worker = H.Worker(cfg, "v1")
    worker.settle_saves = False  # the saves are never waited for here: the daemon may be stopped
    return H.make_scheduler(cfg, monkeypatch), worker


def _saves_counted(sched, worker, tag: str, max_s: float = 10.0) -> int:
    """Run steps, with a request for a fresh item every 0.2 s (a save right after the daemon
    came back may fail: its client's back-off), until the scheduler counted a save (its own
    confirmation); returns the saves counted. Each step's ``update_from_output`` stays fast."""
    deadline, saves, n, next_item = time.monotonic() + max_s, 0, 0, 0.0
    while not saves:
        assert time.monotonic() < deadline, "no save was ever counted"
        if time.monotonic() >= next_item:
            sched.add_request(H.make_request(f"{tag}{n}", [H.Item(f"{tag}{n:03d}" * 16, 0, 20)], max_tokens=1))
            n, next_item = n + 1, time.monotonic() + 0.2
        so = sched.schedule()
        out = worker.execute(so)
        t0 = time.monotonic()
        eo = sched.update_from_output(so, out)
        assert time.monotonic() - t0 < 0.25, "update_from_output waited on the daemon"
        stats = eo[0].scheduler_stats.ec_connector_stats if eo else None
        saves = (stats or {}).get("saves", 0)
        time.sleep(0.005)
    return saves


def test_v1_producer_save_confirmation_never_waits_on_a_stopped_daemon(model_dir, monkeypatch, daemon):
    """A pure producer on the V1 runner confirms its saves with the daemon's ``contains``, sent
    without waiting: with the daemon stopped (SIGSTOP) past daemon_timeout_s every
    ``update_from_output`` returns at once (the confirmation stays pending, then is absent for
    now), never a wait of daemon_timeout_s; once the daemon runs again saves are counted again."""
    import signal

    extra = {"mode": "daemon", "socket_path": daemon.socket_path, "namespace": "qwen-test", "daemon_timeout_s": 1}
    sched, worker = _v1_producer(model_dir, monkeypatch, extra)
    try:
        assert ct.saves_to_confirm(sched.ec_connector) is not None
        assert _saves_counted(sched, worker, "a") >= 1
        os.kill(daemon.pid, signal.SIGSTOP)
        try:
            sched.add_request(H.make_request("p1", [H.Item("c1" * 32, 0, 20)], max_tokens=1))
            stopped_until = time.monotonic() + 1.5  # past daemon_timeout_s
            while time.monotonic() < stopped_until:
                so = sched.schedule()
                out = worker.execute(so)
                t0 = time.monotonic()
                sched.update_from_output(so, out)
                assert time.monotonic() - t0 < 0.25, "update_from_output waited on the stopped daemon"
                time.sleep(0.01)
            assert ct.saves_to_confirm(sched.ec_connector) == 1  # still expected: pending, not given up
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
        assert _saves_counted(sched, worker, "b") >= 1
    finally:
        os.kill(daemon.pid, signal.SIGCONT)
        worker.connector.shutdown()
        sched.ec_connector.shutdown()
