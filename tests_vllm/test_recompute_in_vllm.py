"""Load or recompute inside vLLM's real scheduler (bindings/ectier_vllm/recompute.py hooked into the
scheduler-side lookup): items on a slow NVMe are re-encoded once the connector has measured that
loading them takes longer than the encoder (host hits are never recomputed: tests/test_recompute.py)."""

from __future__ import annotations

import os
import time

import pytest
import torch

import harness as H
from conftest import run_step
from daemon_helpers import DaemonProcess, daemon_config, short_tmpdir, write_config
from ectier.daemon.client import DaemonClient

DELAY_S = 0.3  # each NVMe read of the restarted daemon


@pytest.fixture
def daemon():
    d = short_tmpdir()
    cfg = daemon_config(d, host_bytes=8 << 20, namespace="unused-default")
    proc = DaemonProcess(write_config(os.path.join(d, "daemon.json"), cfg), cfg["daemon"]["socket_path"])
    proc.launch().wait_ready()
    procs = [proc]
    try:
        yield procs
    finally:
        for p in procs:
            p.stop()


def _until_scheduled(sched, worker, req_id: str, *, pause_s: float = 0.1):
    """Steps (one every ``pause_s``, like a busy engine) until ``req_id`` is scheduled; its output."""
    deadline = time.monotonic() + 60
    while True:
        assert time.monotonic() < deadline, f"{req_id} never scheduled"
        so = sched.schedule()
        out = sched.update_from_output(so, worker.execute(so))
        if req_id in {r.req_id for r in so.scheduled_new_reqs}:
            return so, out
        time.sleep(pause_s)


def test_slow_nvme_items_are_recomputed_once_measured(engine, daemon):
    items = [H.Item(f"{c}" * 64, 0, 64) for c in "abcd"]
    extra = {"mode": "daemon", "socket_path": daemon[0].socket_path, "namespace": "qwen-test",
             "encoder_seconds_per_token": 1e-6}  # 64 us for a 64-token item: far below one NVMe read
    prod_sched, prod_worker = engine("ec_producer", extra)
    for i, it in enumerate(items):
        prod_sched.add_request(H.make_request(f"p{i}", [it]))
    run_step(prod_sched, prod_worker)
    produced = {h: t.clone() for h, t in prod_worker.encoder_cache.items()}
    assert set(produced) == {it.mm_hash for it in items}
    assert daemon[0].terminate() == 0  # host entries flushed to NVMe
    slow = DaemonProcess(daemon[0].config_path, daemon[0].socket_path, via="slow-nvme", nvme_read_delay_s=DELAY_S)
    daemon.append(slow.launch().wait_ready())

    sched, worker = engine("ec_consumer", extra)
    for i, it in enumerate(items[:3]):  # estimates unknown: each promotion (>= DELAY_S) is waited for
        sched.add_request(H.make_request(f"c{i}", [it]))
        so, _ = _until_scheduled(sched, worker, f"c{i}")
        assert so.scheduled_encoder_inputs == {}, "loaded, not encoded"
        got = worker.encoder_cache[it.mm_hash]
        assert torch.equal(got.view(torch.int16), produced[it.mm_hash].view(torch.int16))

    # now measured: loading the 4th item (>= DELAY_S) is slower than encoding it (64 us): a miss
    # (daemon mode answers a lookup a step later: the scheduler never waits for the daemon)
    sched.add_request(H.make_request("c3", [items[3]]))
    stats: dict = {}
    for step in range(int(DELAY_S / 0.01)):  # waiting for the >= DELAY_S promotion would take them all
        so = sched.schedule()
        out = sched.update_from_output(so, worker.execute(so))
        for k, v in ((out[0].scheduler_stats.ec_connector_stats or {}) if out else {}).items():
            stats[k] = stats.get(k, [] if isinstance(v, list) else 0) + v
        if so.scheduled_new_reqs:
            break
        time.sleep(0.01)
    assert so.scheduled_encoder_inputs == {"c3": [0]}, f"recomputed once answered, not waited for (step {step})"
    assert items[3].mm_hash in worker.encoded
    assert stats["recompute_chosen"] == 1 and stats["misses"] == 1 and stats.get("hits", 0) == 0

    # a host hit of the same daemon is loaded, never recomputed, though promotions were measured
    # slow: its first step has no answer yet (daemon_answer_wait_s 0), and nothing is known of it
    host_item, value = H.Item("e" * 64, 0, 64), produced[items[0].mm_hash]
    with DaemonClient(slow.socket_path) as c:
        c.put(host_item.mm_hash, value, namespace="qwen-test")
    sched.add_request(H.make_request("c4", [host_item]))
    so, _ = _until_scheduled(sched, worker, "c4", pause_s=0.01)
    assert so.scheduled_encoder_inputs == {}, "a host hit was recomputed"
    assert torch.equal(worker.encoder_cache[host_item.mm_hash].view(torch.int16), value.view(torch.int16))
