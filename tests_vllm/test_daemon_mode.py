"""Daemon mode: an encoder instance and a prefill/decode instance (two engines, each with its own
scheduler and worker connectors) share one `ectier serve` process on this node."""

from __future__ import annotations

import os

import pytest
import torch

import harness as H
from conftest import run_step
from daemon_helpers import DaemonProcess, daemon_config, short_tmpdir, write_config


@pytest.fixture
def daemon():
    d = short_tmpdir()
    cfg = daemon_config(d, host_bytes=8 << 20, namespace="unused-default")
    proc = DaemonProcess(write_config(os.path.join(d, "daemon.json"), cfg), cfg["daemon"]["socket_path"])
    proc.launch().wait_ready()
    try:
        yield proc
    finally:
        proc.stop()


def test_encoder_instance_to_pd_instance_through_the_daemon(engine, daemon):
    extra = {"mode": "daemon", "socket_path": daemon.socket_path, "namespace": "qwen-test"}
    items = [H.Item("m" * 64, 0, 64), H.Item("n" * 64, 100, 33)]

    enc_sched, enc_worker = engine("ec_producer", extra)
    enc_sched.add_request(H.make_request("p", items))
    so, _ = run_step(enc_sched, enc_worker)
    assert sorted(so.scheduled_encoder_inputs["p"]) == [0, 1]
    produced = {h: t.clone() for h, t in enc_worker.encoder_cache.items()}

    pd_sched, pd_worker = engine("ec_consumer", extra)
    assert pd_sched.ec_connector._store.client is not pd_worker.connector._store.client
    pd_sched.add_request(H.make_request("c", items + [H.Item("absent", 200, 10)]))
    so, out = run_step(pd_sched, pd_worker)
    assert so.scheduled_encoder_inputs == {"c": [2]}  # only the item nobody produced is encoded
    for h, t in produced.items():
        got = pd_worker.encoder_cache[h]
        assert got.dtype == t.dtype and torch.equal(got.view(torch.int16), t.view(torch.int16))
    stats = out[0].scheduler_stats.ec_connector_stats
    assert stats["hits"] == 2 and stats["misses"] == 1 and stats["loads"] == 2
    # the scheduler's pins (daemon get-leases) were released after the worker's report
    assert pd_sched.ec_connector._pins == {}
    assert pd_sched.ec_connector._store.client.stats()["daemon"]["leases"]["get"] == 0


def test_daemon_down_is_a_miss_not_a_crash(engine, daemon):
    extra = {"mode": "daemon", "socket_path": daemon.socket_path, "daemon_timeout_s": 1}
    sched, worker = engine("ec_consumer", extra)
    daemon.stop()
    sched.ec_connector._store.client.connect_retry_s = 0.2
    sched.add_request(H.make_request("c", [H.Item("o" * 64, 0, 20)]))
    so, out = run_step(sched, worker)
    assert so.scheduled_encoder_inputs == {"c": [0]}  # store unreachable => encoded locally
    assert worker.encoded == ["o" * 64]
