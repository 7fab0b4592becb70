"""What the connector's counters add up to inside vLLM's real scheduler (docs/vllm.md, Metrics):
``lookups``/``hits``/``misses`` count each item once per request, however often vLLM asks
``has_cache_item`` about it, and a pure ``ec_producer`` (which never loads) counts none."""

from __future__ import annotations

import harness as H
from conftest import run_step
from ectier_vllm import testing as ct

NS = "metrics-counts"
HOST = {"capacity_bytes": "8MiB", "block_bytes": "64KiB", "pin_memory": False}


def _total(sched, worker, steps: int) -> dict:
    total: dict = {}
    for _ in range(steps):
        _, out = run_step(sched, worker)
        stats = out[0].scheduler_stats.ec_connector_stats if out and out[0].scheduler_stats else None
        for key, value in (stats or {}).items():
            if isinstance(value, (int, float)):
                total[key] = total.get(key, 0) + value
    return total


def test_an_item_vllm_asks_about_again_while_it_cannot_place_the_request_is_one_lookup(engine):
    """Regression: vLLM asked has_cache_item again every step it could not place the request (no
    KV room); one item loaded once counted hits=4, loads=1."""
    sched, worker = engine("ec_consumer", {"namespace": NS, "host": HOST})
    stored, missing = H.Item("h" * 64, 0, 32), H.Item("m" * 64, 100, 32)
    ct.store(sched.ec_connector).put(stored.mm_hash, H.encoder_output(stored.mm_hash, 32)).wait()
    kv, allocate, refused = sched.kv_cache_manager, sched.kv_cache_manager.allocate_slots, []

    def no_room_three_times(*args, **kwargs):
        if len(refused) < 3:
            refused.append(1)
            return None  # no KV blocks: the request stays waiting, vLLM asks again next step
        return allocate(*args, **kwargs)

    kv.allocate_slots = no_room_three_times
    sched.add_request(H.make_request("c", [stored, missing], max_tokens=1))
    total = _total(sched, worker, 6)
    assert len(refused) == 3
    assert worker.encoded == [missing.mm_hash]
    assert (total.get("lookups"), total.get("hits"), total.get("misses"), total.get("loads")) == (2, 1, 1, 1), total


def test_a_pure_producer_counts_no_lookups_or_misses(engine):
    """Regression: an ec_producer counted every item it was about to encode as a lookup and a miss
    (a 0 % hit rate that diluted dashboards summed over engines)."""
    sched, worker = engine("ec_producer", {"namespace": NS, "host": HOST})
    for i in range(5):
        sched.add_request(H.make_request(f"p{i}", [H.Item(f"p{i}" * 32, 0, 32)], max_tokens=1))
    total = _total(sched, worker, 4)
    assert len(worker.encoded) == 5
    assert total.get("saves") == 5, total
    assert "lookups" not in total and "misses" not in total and "hits" not in total, total
