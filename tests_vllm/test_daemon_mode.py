"""Daemon mode: an encoder instance and a prefill/decode instance (two engines, each with its own
scheduler and worker connectors) share one `ectier serve` process on this node."""

from __future__ import annotations

import logging
import os
import time

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
    a DaemonClient connect_retry_s wait (5 s) per call. Default daemon_timeout_s (30 s)."""
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
