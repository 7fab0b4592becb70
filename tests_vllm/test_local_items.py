"""Items vLLM's own encoder cache already holds (``EncoderCacheManager``: another request of the
engine encoded or loaded them, and vLLM has not evicted them). vLLM serves those itself and never
asks ``has_cache_item`` about them, so the connector must neither pin nor promote them, nor hold
the request back for them, nor count them (``recompute_chosen``, ``deferrals``)."""

from __future__ import annotations

import harness as H
from conftest import run_step
from ectier_vllm import testing as ct

NS = "local-items"
HOST = {"capacity_bytes": "8MiB", "block_bytes": "64KiB", "pin_memory": False}


def _stats(out) -> dict:
    stats = out[0].scheduler_stats.ec_connector_stats if out and out[0].scheduler_stats else None
    return {k: v for k, v in (stats or {}).items() if isinstance(v, (int, float))}


def test_an_item_in_vllms_encoder_cache_is_not_pinned_for_a_request_that_reuses_it(engine):
    """r1 loads the item; r2 (same image, arriving while r1 decodes) is served by vLLM's encoder
    cache. Before: the connector pinned the item again for r2 and held the pin, never loaded,
    until r2 finished (a host-arena pin per live request reusing an image)."""
    sched, worker = engine("ec_consumer", {"namespace": NS, "host": HOST})
    conn = sched.ec_connector
    item = H.Item("i" * 64, 0, 32)
    ct.store(conn).put(item.mm_hash, H.encoder_output(item.mm_hash, 32)).wait()
    sched.add_request(H.make_request("r1", [item], max_tokens=50))
    so, _ = run_step(sched, worker)
    assert [it.mm_hash for it in so.ec_connector_metadata.loads] == [item.mm_hash]
    run_step(sched, worker)  # the load is reported: its pin goes
    assert ct.pinned(conn) == set()
    sched.add_request(H.make_request("r2", [item], max_tokens=50))
    so, _ = run_step(sched, worker)
    assert "r2" in so.num_scheduled_tokens and so.ec_connector_metadata.loads == []  # vLLM's own copy
    run_step(sched, worker)
    assert ct.pinned(conn) == set(), "a pin nobody will load, held until r2 finishes"
    assert ct.leftovers(conn).get("pins") is None


def test_an_item_in_vllms_encoder_cache_is_neither_promoted_nor_counted(engine, tmp_path):
    """With an NVMe tier and the load-or-recompute rule deciding: r2 reuses the item r1 encoded.
    Before: the connector promoted it for r2, and counted a recompute_chosen (or a deferral) for
    an item vLLM never asked about."""
    extra = {"namespace": NS, "host": HOST, "encoder_seconds_per_token": 1e-12,
             "nvme": {"path": str(tmp_path / "nvme"), "capacity_bytes": "64MiB", "sync": False}}
    sched, worker = engine("ec_both", extra)
    conn = sched.ec_connector
    item = H.Item("j" * 64, 0, 32)
    sched.add_request(H.make_request("r1", [item], max_tokens=50))
    run_step(sched, worker)
    assert worker.encoded == [item.mm_hash]
    total: dict = {}
    sched.add_request(H.make_request("r2", [item], max_tokens=50))
    for _ in range(3):
        so, out = run_step(sched, worker)
        for k, v in _stats(out).items():
            total[k] = total.get(k, 0) + v
    assert worker.encoded == [item.mm_hash]  # r2 used vLLM's copy
    assert ct.promoting(conn) == {} and ct.pinned(conn) == set()
    assert total.get("deferrals", 0) == 0 and total.get("recompute_chosen", 0) == 0, total
    assert total.get("lookups", 0) == 0, total


def test_a_preempted_request_gets_its_item_loaded_again_once_vllm_evicted_it(engine, monkeypatch):
    """r1 loaded its item, then vLLM preempted r1 (KV pressure: ``_preempt_request``, which frees
    r1's encoder-cache references) and another request's item evicted it from vLLM's encoder
    cache before r1 resumed. Before: the item stayed "settled" for r1, so the connector never
    looked it up again and vLLM re-encoded an item ectier held."""
    import time

    monkeypatch.setattr(H.FixedBudget, "cache_size", 64)  # room for the item (32) or r2's (48), not both
    sched, worker = engine("ec_consumer", {"namespace": NS, "host": HOST}, max_num_batched_tokens=80)
    conn = sched.ec_connector
    item, other = H.Item("k" * 64, 0, 32), H.Item("o" * 64, 60, 48)
    ct.store(conn).put(item.mm_hash, H.encoder_output(item.mm_hash, 32)).wait()
    sched.add_request(H.make_request("r1", [item], prompt_len=40, max_tokens=50))
    sched.add_request(H.make_request("r2", [other], prompt_len=200, max_tokens=50))
    so, _ = run_step(sched, worker)
    assert [it.mm_hash for it in so.ec_connector_metadata.loads] == [item.mm_hash]
    # r1's prompt is past the item, so vLLM dropped r1's reference: r2's item evicts it
    so, _ = run_step(sched, worker)
    assert so.scheduled_encoder_inputs == {"r2": [0]} and so.free_encoder_mm_hashes == [item.mm_hash]
    r1 = sched.requests["r1"]
    sched.running.remove(r1)
    sched._preempt_request(r1, time.monotonic())  # what schedule() does when KV blocks run out
    loads = []
    for _ in range(4):
        so, _ = run_step(sched, worker)
        loads += [it.mm_hash for it in so.ec_connector_metadata.loads]
        if "r1" in so.num_scheduled_tokens:
            break
    assert "r1" in so.num_scheduled_tokens  # resumed
    assert worker.encoded == [other.mm_hash] and loads == [item.mm_hash], (worker.encoded, loads)
