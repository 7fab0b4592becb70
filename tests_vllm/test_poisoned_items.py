"""Items whose load failed at a worker after vLLM's encoder-cache manager had counted them as
present ("poisoned"): vLLM neither encodes nor loads them again until it evicts them, so every
request that needs one gets it reloaded by the connector (or is failed), never scheduled onto a
worker whose encoder cache lacks it (``_gather_mm_embeddings``: "Encoder cache miss", an engine
crash)."""

from __future__ import annotations

import time

import harness as H
from ectier import testing
from ectier_vllm import testing as ct
from test_pending_promotions import inproc, produce, slow_nvme

DELAY_S = 0.3


def _misses(so, sched, worker, failed) -> list[str]:
    """The items this step's scheduled tokens reach that the worker's encoder cache lacks (and
    no load of this step reported failed): what ``_gather_mm_embeddings`` raises on."""
    starts = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
    starts.update(zip(so.scheduled_cached_reqs.req_ids, so.scheduled_cached_reqs.num_computed_tokens))
    out = []
    for req_id, n in so.num_scheduled_tokens.items():
        lo, hi = starts[req_id], starts[req_id] + n
        for f in sched.requests[req_id].mm_features:
            pos = f.mm_position
            if pos.offset < hi and pos.offset + pos.length > lo and f.identifier not in failed:
                if f.identifier not in worker.encoder_cache:
                    out.append(f"{f.identifier[:8]} for {req_id}")
    return out


def _step(sched, worker):
    so = sched.schedule()
    for mm_hash in so.free_encoder_mm_hashes:  # as the runner's _update_states
        worker.encoder_cache.pop(mm_hash, None)
    out = worker.execute(so)
    meta = out.ec_connector_output.ec_connector_worker_meta if out.ec_connector_output else None
    misses = _misses(so, sched, worker, meta.failed if meta is not None else {})
    sched.update_from_output(so, out)
    return so, misses


def test_an_item_settled_ahead_of_a_chunk_is_reloaded_once_another_requests_load_of_it_failed(
        engine, tmp_path, monkeypatch):
    """r1's item (ahead of its first chunk) timed out promoting: settled for r1, vLLM would encode
    it when r1's tokens reach it. Meanwhile r2 loads the item and the load fails: vLLM's encoder
    cache counts it as present, the worker has no copy. When r1's chunk reaches it vLLM neither
    encodes nor loads it. Before: the connector skipped it for r1 (settled) instead of reloading
    it (poisoned): r1 ran on an item the worker lacked."""
    item = H.Item("s" * 64, 150, 32)
    produce(engine, inproc(tmp_path), [H.Item(item.mm_hash, 0, 32)])  # on NVMe only
    extra = {**inproc(tmp_path), "load_timeout_s": 0.001, "recompute": False}
    sched, worker = engine("ec_consumer", extra, max_num_batched_tokens=64,
                          long_prefill_token_threshold=32)  # r1's chunks: 64 tokens alone, 32 beside r2
    conn = sched.ec_connector
    cache = slow_nvme(sched, DELAY_S)
    sched.add_request(H.make_request("r1", [item], prompt_len=300, max_tokens=50))
    so, misses = _step(sched, worker)  # r1 waits for its item's promotion
    assert so.num_scheduled_tokens == {} and ct.promoting(conn)
    time.sleep(0.01)
    so, misses = _step(sched, worker)  # which timed out: the item is settled for r1
    assert so.num_scheduled_tokens == {"r1": 64} and misses == [] and not ct.promoting(conn)
    deadline = time.monotonic() + 10
    while not testing.holds(cache, "host", item.mm_hash, extra["namespace"]):  # the promotion goes on
        assert time.monotonic() < deadline, testing.where(cache, item.mm_hash, extra["namespace"])
        time.sleep(0.02)
    store = ct.store(worker.connector)
    real_get, fail = store.get, {item.mm_hash}
    monkeypatch.setattr(store, "get", lambda key, device: None if fail and key == fail.pop() else real_get(key, device))
    sched.add_request(H.make_request("r2", [H.Item(item.mm_hash, 0, 32)], prompt_len=40, max_tokens=2))
    so, misses = _step(sched, worker)
    assert [it.mm_hash for it in so.ec_connector_metadata.loads] == [item.mm_hash] and not fail, "r2's load, failed"
    assert misses == [] and ct.poisoned(conn) == {item.mm_hash}
    for _ in range(8):  # r1's chunks reach the item
        so, misses = _step(sched, worker)
        assert misses == [], f"scheduled onto a missing encoder output: {misses}"
        if "r1" not in sched.requests:
            break
    assert "r1" in so.num_scheduled_tokens and item.mm_hash in worker.encoder_cache
    assert item.mm_hash not in worker.encoded  # reloaded by the connector
