"""A long run through vLLM 0.33's real scheduler: a few hundred requests sharing a small pool of
items, with random aborts, preemptions (``reset_prefix_cache(reset_running_requests=True)``, the
path vLLM preempts every running request by) and failed worker loads, on an ``ec_both`` engine
whose host arena is small enough that items keep being promoted from NVMe. At the end, with every
request finished, the connector holds nothing (``ectier_vllm.testing.leftovers``), no host-arena
pin survives the worker's encoder cache, and every step's embedding gather found its items."""

from __future__ import annotations

import gc
import random
import time

import harness as H
from ectier import testing
from ectier_vllm import testing as ct

NS = "long-run"


def _extra(tmp_path, **more) -> dict:
    return {"namespace": NS,
            "host": {"capacity_bytes": "512KiB", "block_bytes": "64KiB", "pin_memory": False},
            "nvme": {"path": str(tmp_path / "nvme"), "capacity_bytes": "64MiB", "sync": False,
                     "write_through": True},
            **more}


def _step(sched, worker):
    """One engine step as the real runner does it: the encoder-cache entries vLLM freed are dropped
    first (``_update_states``), and every item a scheduled token range reaches must be in the
    worker's encoder cache (``_gather_mm_embeddings``)."""
    so = sched.schedule()
    for mm_hash in so.free_encoder_mm_hashes:
        worker.encoder_cache.pop(mm_hash, None)
    out = worker.execute(so)
    meta = out.ec_connector_output.ec_connector_worker_meta if out.ec_connector_output else None
    failed = meta.failed if meta is not None else {}  # gathered over a placeholder, then removed
    starts = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
    starts.update(zip(so.scheduled_cached_reqs.req_ids, so.scheduled_cached_reqs.num_computed_tokens))
    for req_id, n in so.num_scheduled_tokens.items():
        lo, hi = starts[req_id], starts[req_id] + n
        for f in sched.requests[req_id].mm_features:
            pos = f.mm_position
            if pos.offset < hi and pos.offset + pos.length > lo and f.identifier not in failed:
                assert f.identifier in worker.encoder_cache, f"encoder cache miss: {f.identifier} for {req_id}"
    return so, sched.update_from_output(so, out)


def _request(rng, n, pool):
    items, offset = [], rng.randrange(0, 40)
    for mm_hash, length in rng.sample(pool, rng.randint(1, 3)):
        items.append(H.Item(mm_hash, offset, length))
        offset += length + rng.randrange(8, 64)
    return H.make_request(f"r{n}", items, prompt_len=offset + rng.randrange(16, 200), max_tokens=rng.randint(1, 6))


def _flaky_gets(monkeypatch, worker, rng, rate):
    """The worker's store loses an item now and then (a daemon restart, an eviction race)."""
    store = ct.store(worker.connector)
    real = store.get
    monkeypatch.setattr(store, "get", lambda key, device: None if rng.random() < rate else real(key, device))


def _churn(sched, worker, rng, pool, n: int):
    """Add ``n`` requests, 0-2 a step, aborting one in ten steps and preempting every running
    request (``reset_prefix_cache``) one in twenty, until all finished; yields each step's
    ``(scheduler output, engine core outputs)``."""
    from vllm.v1.request import RequestStatus

    added = 0
    while added < n or sched.requests:
        for _ in range(rng.randint(0, 2) if added < n else 0):
            sched.add_request(_request(rng, added, pool))
            added += 1
        live = [r for r in sched.requests.values() if not r.is_finished()]
        if live and rng.random() < 0.1:
            sched.finish_requests([rng.choice(live).request_id], RequestStatus.FINISHED_ABORTED)
        if sched.running and rng.random() < 0.05:
            sched.reset_prefix_cache(reset_running_requests=True)
        yield _step(sched, worker)


def test_a_long_run_with_aborts_preemptions_and_failed_loads_leaves_nothing_behind(engine, tmp_path, monkeypatch):
    rng = random.Random(1234)
    pool = [(f"{i:02d}" * 32, rng.choice([120, 250, 400, 500])) for i in range(24)]
    sched, worker = engine("ec_both", _extra(tmp_path))
    conn = sched.ec_connector
    _flaky_gets(monkeypatch, worker, rng, 0.15)
    failed, stats = 0, {}
    for _, out in _churn(sched, worker, rng, pool, 300):
        for o in out.values():
            for k, v in (o.scheduler_stats.ec_connector_stats or {}).items() if o.scheduler_stats else ():
                if not isinstance(v, list):
                    stats[k] = stats.get(k, 0) + v
        failed += sum(o.finish_reason is not None and str(o.finish_reason) == "error"
                      for outs in out.values() for o in outs.outputs)
        if rng.random() < 0.3:
            for handles in ct.promoting(conn).values():
                for h in handles:
                    h.wait(5)
    for _ in range(3):  # the last reports
        _step(sched, worker)
    # the run went through loads, failed loads and misses; recompute_chosen items are misses
    assert stats.get("loads", 0) > 5 and stats.get("load_failures", 0) > 0 and failed > 0, stats
    assert stats["lookups"] == stats["hits"] + stats["misses"], stats
    assert stats.get("recompute_chosen", 0) <= stats["misses"], stats
    assert ct.leftovers(conn) == {}
    worker.encoder_cache.clear()  # vLLM drops its encoder outputs: their views' pins go with them
    gc.collect()
    assert testing.pins(ct.cache(conn), "host") == 0


def test_daemon_a_long_run_with_aborts_and_preemptions_leaves_nothing_behind(engine, daemon, monkeypatch):
    """The same in daemon mode (an ``ectier serve`` with an 8 MiB arena over NVMe): no pin, staged
    pin or unanswered lookup is left once every request finished."""
    rng = random.Random(99)
    pool = [(f"{i:02d}" * 32, rng.choice([120, 250, 400, 500])) for i in range(24)]
    extra = {"mode": "daemon", "socket_path": daemon.socket_path, "namespace": NS}
    sched, worker = engine("ec_both", extra)
    conn = sched.ec_connector
    _flaky_gets(monkeypatch, worker, rng, 0.1)
    loads = 0
    for so, _ in _churn(sched, worker, rng, pool, 150):
        loads += len(so.ec_connector_metadata.loads)
    deadline = time.monotonic() + 10.0
    while True:  # the daemon's last answers come in at the next steps (later on a loaded machine)
        _step(sched, worker)
        if not ct.leftovers(conn) or time.monotonic() > deadline:
            break
        time.sleep(0.01)
    assert loads > 5
    assert ct.leftovers(conn) == {}
    worker.encoder_cache.clear()
