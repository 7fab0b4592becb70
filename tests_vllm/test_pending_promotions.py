"""Promotions a request waits for (scheduler side, ``SchedulerSide._promotion``): a request that
finishes (is aborted) while it waits leaves nothing behind that a later request for the same item
would trip over, and the scheduler's own thread never reads NVMe for an item, even one evicted
from the host arena after its promotion finished."""

from __future__ import annotations

import time

import torch

import harness as H
from conftest import run_step
from ectier import testing
from ectier_vllm import testing as ct

NS = "pending-ns"
DELAY_S = 0.2  # each NVMe read once slowed (tests/slow_nvme_daemon.py's SlowReads)


def inproc(tmp_path, host_bytes: str = "8MiB") -> dict:
    return {"namespace": NS,
            "host": {"capacity_bytes": host_bytes, "block_bytes": "64KiB", "pin_memory": False},
            "nvme": {"path": str(tmp_path / "nvme"), "capacity_bytes": "64MiB", "sync": False}}


def produce(engine, extra, items) -> None:
    """An encoder instance saves ``items`` and shuts down: in-process, they are then on NVMe only."""
    sched, worker = engine("ec_producer", extra)
    sched.add_request(H.make_request("p", items))
    run_step(sched, worker)
    worker.connector.shutdown()
    sched.ec_connector.shutdown()


def slow_nvme(sched, delay_s: float):
    """Slow every NVMe read of the scheduler's in-process cache down to ``delay_s``; returns the cache."""
    from slow_nvme_daemon import SlowReads

    cache = ct.cache(sched.ec_connector)
    testing.set_lmdb_env(cache, SlowReads(testing.lmdb_of(cache).env, delay_s))
    return cache


def abort(sched, req_ids) -> None:
    from vllm.v1.request import RequestStatus

    sched.finish_requests(list(req_ids), RequestStatus.FINISHED_ABORTED)


def test_a_request_aborted_while_its_item_promotes_leaves_no_promotion_behind(engine, tmp_path):
    """Requests aborted while they wait for their items' promotions: the connector forgets those
    promotions, except the one another live request still waits for, which then loads."""
    items = [H.Item(f"{i}" * 64, 0, 32) for i in range(3)]
    produce(engine, inproc(tmp_path), items)
    sched, worker = engine("ec_consumer", inproc(tmp_path))
    slow_nvme(sched, DELAY_S)
    for i, it in enumerate(items):
        sched.add_request(H.make_request(f"a{i}", [it]))
    sched.add_request(H.make_request("stays", [items[0]]))
    so, _ = run_step(sched, worker)
    conn = sched.ec_connector
    assert so.scheduled_new_reqs == [] and set(ct.promoting(conn)) == {it.mm_hash for it in items}
    abort(sched, [f"a{i}" for i in range(3)])
    assert set(ct.promoting(conn)) == {items[0].mm_hash}  # "stays" still waits for it
    assert ct.recompute_waiting(conn) <= {items[0].mm_hash}
    deadline = time.monotonic() + 10
    while not so.scheduled_new_reqs:
        assert time.monotonic() < deadline, "the request that stayed was never scheduled"
        time.sleep(0.02)
        so, _ = run_step(sched, worker)
    assert [r.req_id for r in so.scheduled_new_reqs] == ["stays"] and so.scheduled_encoder_inputs == {}
    assert worker.encoded == [] and ct.promoting(conn) == {}


def test_the_scheduler_never_reads_nvme_for_an_item_evicted_after_its_promotion(engine, tmp_path):
    """The item's promotion finished, then other entries evicted it from the host arena before the
    request's next step: pinning it must not read NVMe on the scheduler's thread (here a read
    takes 1 s); it is a miss (encoded) instead."""
    item = H.Item("e" * 64, 0, 32)
    produce(engine, inproc(tmp_path, "1MiB"), [item])
    sched, worker = engine("ec_consumer", inproc(tmp_path, "1MiB"))
    conn = sched.ec_connector
    cache = ct.cache(conn)
    sched.add_request(H.make_request("c", [item]))
    so, _ = run_step(sched, worker)
    assert so.scheduled_new_reqs == [], "the promotion beat the first step's check"
    for handles in ct.promoting(conn).values():
        assert all(h.wait(10) for h in handles)  # promoted into the host arena
    for i in range(12):  # other entries fill the 1 MiB arena: the item is evicted (still on NVMe)
        cache.put(f"filler-{i}", torch.zeros(1024, 64, dtype=torch.bfloat16)).wait()
    lease = cache.acquire(item.mm_hash, promote=False)
    assert lease is None and cache.contains(item.mm_hash), "the item was not evicted to NVMe only"
    slow_nvme(sched, 1.0)
    t0 = time.monotonic()
    so = sched.schedule()
    assert time.monotonic() - t0 < 0.5, "schedule() read NVMe on the scheduler's thread"
    sched.update_from_output(so, worker.execute(so))
    assert so.scheduled_encoder_inputs == {"c": [0]} and worker.encoded == [item.mm_hash]  # a miss


def test_daemon_a_request_aborted_while_its_lookup_is_pending_leaves_nothing_stale(engine, daemon):
    """Daemon mode: a request aborted while the daemon's answer about its item is not in yet.
    A request for the same item long after (past load_timeout_s) loads it: no stale promotion of
    the aborted request makes it time out at once (re-encoded, counted as rejected)."""
    extra = {"mode": "daemon", "socket_path": daemon.socket_path, "namespace": NS, "load_timeout_s": 0.3}
    item = H.Item("d" * 64, 0, 32)
    psched, pworker = engine("ec_producer", extra)
    psched.add_request(H.make_request("p", [item]))
    run_step(psched, pworker)  # stored in the daemon's host arena
    sched, worker = engine("ec_consumer", extra)
    conn = sched.ec_connector
    sched.add_request(H.make_request("a", [item]))
    so, _ = run_step(sched, worker)
    assert so.scheduled_new_reqs == [] and set(ct.promoting(conn)) == {item.mm_hash}  # no answer yet
    abort(sched, ["a"])
    assert ct.promoting(conn) == {}
    deadline = time.monotonic() + 0.5  # other traffic meanwhile, for longer than load_timeout_s
    while time.monotonic() < deadline:
        run_step(sched, worker)
        time.sleep(0.02)
    sched.add_request(H.make_request("b", [item]))
    stats: dict = {}
    for _ in range(500):
        so, out = run_step(sched, worker)
        for k, v in ((out[0].scheduler_stats.ec_connector_stats or {}) if out else {}).items():
            stats[k] = stats.get(k, [] if isinstance(v, list) else 0) + v
        if so.scheduled_new_reqs:
            break
        time.sleep(0.005)
    assert [r.req_id for r in so.scheduled_new_reqs] == ["b"]
    assert so.scheduled_encoder_inputs == {} and worker.encoded == []  # loaded, not re-encoded
    assert stats.get("rejected", 0) == 0 and stats["hits"] == 1
    worker.encoder_cache.clear()
