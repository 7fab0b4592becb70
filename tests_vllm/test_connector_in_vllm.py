"""ECTierConnector driven by vLLM 0.33's real Scheduler and model-runner EC mixin (CPU tensors):
items saved by a producer and loaded by a consumer, missing, damaged or refused items encoded
instead, failed loads and their retries, items shared between requests or prefill chunks.

Each scenario is a sequence of engine steps: ``Scheduler.schedule()`` (which calls the connector's
``ensure_cache_available``, ``has_cache_item``, ``update_state_after_alloc``,
``build_connector_meta``), the worker (``ECConnectorModelRunnerMixin``: ``start_load_caches``,
``save_caches``, ``build_connector_worker_meta``), ``Scheduler.update_from_output`` (which calls
``take_unavailable_requests`` and ``update_connector_output``). Also: test_connector_copies.py
(deferred copies, prefetches, the GPU tier), test_connector_config.py (refused configs, encoder
widths), test_connector_metrics.py. Helpers: connector_helpers.py."""

from __future__ import annotations

import lmdb
import torch

import harness as H
from conftest import run_step
from connector_helpers import NS, errors_of, host_pins, inproc, produce, run_step_loading, same_bytes, wait_prefetches
from ectier_vllm import testing as ct


def test_factory_loads_connector_through_module_path(engine, tmp_path, monkeypatch):
    """The long form (ec_connector_module_path) works without ectier's vLLM plugin registered
    (the short form: test_plugin.py)."""
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    from ectier_vllm.connector import ECTierConnector

    registry = {k: v for k, v in ECConnectorFactory._registry.items() if k != "ECTierConnector"}
    monkeypatch.setattr(ECConnectorFactory, "_registry", registry)  # as if the plugin were not installed
    sched, worker = engine("ec_both", inproc(tmp_path))
    assert "ECTierConnector" not in ECConnectorFactory._registry  # not a built-in name
    assert type(sched.ec_connector) is ECTierConnector
    assert type(worker.connector) is ECTierConnector
    assert sched.ec_connector.settings.namespace == NS


def test_producer_then_fresh_consumer_loads_byte_identical(engine, tmp_path):
    items = [H.Item("a" * 64, 10, 100), H.Item("lora:" + "b" * 64, 200, 37)]
    produced = produce(engine, inproc(tmp_path), items)
    from ectier_vllm import store

    assert store.open_stores() == 0  # the producer's store is closed; the consumer reopens NVMe
    sched, worker = engine("ec_consumer", inproc(tmp_path, admit_wait_s=0.25))
    sched.add_request(H.make_request("c", items))
    so, out = run_step(sched, worker)  # the items are on NVMe only: the connector prefetches them
    assert so.num_scheduled_tokens == {}  # the request waits for the NVMe → host promotion
    assert out[0].scheduler_stats.ec_connector_stats["deferrals"] == 1
    wait_prefetches(sched.ec_connector)
    so, out = run_step(sched, worker)
    assert so.scheduled_encoder_inputs == {}  # no encoder work: both items come from ectier
    assert [it.mm_hash for it in so.ec_connector_metadata.loads] == [i.mm_hash for i in items]
    assert worker.encoded == []
    for h, t in produced.items():
        assert same_bytes(worker.encoder_cache[h], t)
        assert worker.encoder_cache[h].device.type == "cpu"
    assert errors_of(out) == {}
    stats = out[0].scheduler_stats.ec_connector_stats
    assert stats["hits"] == 2 and stats["loads"] == 2 and stats["load_bytes"] == (100 + 37) * H.WIDTH * 2
    assert not ct.pinned(sched.ec_connector)  # pins dropped once the worker reported the loads
    assert store.open_stores() == 1


def test_ec_both_shares_one_store_between_scheduler_and_worker(engine, tmp_path, monkeypatch):
    monkeypatch.setattr(H.FixedBudget, "cache_size", 64)  # vLLM's encoder cache holds one item
    sched, worker = engine("ec_both", inproc(tmp_path))
    assert ct.cache(sched.ec_connector) is ct.cache(worker.connector)
    item, filler = H.Item("c" * 64, 0, 64), H.Item("f" * 64, 0, 64)
    sched.add_request(H.make_request("r1", [item], max_tokens=1))
    so, _ = run_step(sched, worker)
    assert so.scheduled_encoder_inputs == {"r1": [0]}
    first = worker.encoder_cache[item.mm_hash].clone()
    # another request's item evicts it from vLLM's encoder cache; a new request loads it back
    sched.add_request(H.make_request("rf", [filler], max_tokens=1))
    so, _ = run_step(sched, worker)
    assert so.free_encoder_mm_hashes == [item.mm_hash]
    worker.encoder_cache.pop(item.mm_hash)  # (the model runner drops what vLLM freed)
    sched.add_request(H.make_request("r2", [item], max_tokens=1))
    so, out = run_step(sched, worker)
    assert so.scheduled_encoder_inputs == {}
    assert worker.encoded == [item.mm_hash, filler.mm_hash]  # the item encoded once, in the first step only
    assert same_bytes(worker.encoder_cache[item.mm_hash], first)


def test_missing_item_is_encoded(engine, tmp_path):
    produce(engine, inproc(tmp_path), [H.Item("d" * 64, 0, 50)])
    sched, worker = engine("ec_consumer", inproc(tmp_path, admit_wait_s=0.25))
    sched.add_request(H.make_request("c", [H.Item("d" * 64, 0, 50), H.Item("never-stored", 100, 20)]))
    so, out = run_step_loading(sched, worker)
    assert so.scheduled_encoder_inputs == {"c": [1]}  # only the missing one is encoded
    assert worker.encoded == ["never-stored"]
    assert errors_of(out) == {}


def test_corrupted_item_fails_checksum_and_is_encoded(engine, tmp_path, monkeypatch):
    from ectier.entry import entry_digest

    item = H.Item("e" * 64, 0, 80)
    produce(engine, inproc(tmp_path), [item])
    # the producer flushed to NVMe on shutdown: flip a bit of the stored payload (layout v2: in
    # segment.0, at the first block the index entry names)
    from ectier.tiers.nvme_record import parse_index_value
    from ectier.tiers.nvme_segment import BLOCK_BYTES

    env = lmdb.open(str(tmp_path / "nvme" / "lmdb"), subdir=True, max_dbs=4, map_size=1 << 30)
    try:
        meta = env.open_db(b"meta")
        with env.begin() as txn:
            _, loc = parse_index_value(txn.get(entry_digest(NS, item.mm_hash), db=meta))
    finally:
        env.close()
    with open(tmp_path / "nvme" / "segment.0", "r+b") as f:
        f.seek(loc.extents[0][0] * BLOCK_BYTES + 100)
        b = f.read(1)[0]
        f.seek(-1, 1)
        f.write(bytes([b ^ 0x10]))
    sched, worker = engine("ec_consumer", inproc(tmp_path, admit_wait_s=0.25, capacity_bytes="4MiB"))
    sched.add_request(H.make_request("c", [item]))
    so, out = run_step_loading(sched, worker)  # the prefetch reads the record: checksum fails
    assert so.scheduled_encoder_inputs == {"c": [0]}  # corrupt => miss => re-encoded
    assert worker.encoded == [item.mm_hash]
    assert errors_of(out) == {}
    assert not ct.store(sched.ec_connector).contains(item.mm_hash)  # quarantined


def test_wrong_shape_in_store_is_rejected_and_encoded(engine, tmp_path):
    sched, worker = engine("ec_both", inproc(tmp_path))
    ct.store(sched.ec_connector).put("f" * 64, torch.zeros(10, H.WIDTH, dtype=H.DTYPE))  # request wants 30
    ct.store(sched.ec_connector).put("g" * 64, torch.zeros(30, H.WIDTH, dtype=torch.float16))  # wrong dtype
    sched.add_request(H.make_request("c", [H.Item("f" * 64, 0, 30), H.Item("g" * 64, 40, 30)]))
    so, out = run_step(sched, worker)
    assert so.scheduled_encoder_inputs == {"c": [0, 1]}
    assert out[0].scheduler_stats.ec_connector_stats["rejected"] == 2
    assert worker.encoder_cache["f" * 64].shape == (30, H.WIDTH)


def test_an_item_refused_once_is_settled_for_the_rest_of_its_request(engine, tmp_path):
    """The same image twice in one prompt, stored with the wrong shape: refused (and warned about)
    once, not once per occurrence in the same scheduler step."""
    sched, worker = engine("ec_both", inproc(tmp_path))
    ct.store(sched.ec_connector).put("r" * 64, torch.zeros(10, H.WIDTH, dtype=H.DTYPE))  # the request wants 30
    sched.add_request(H.make_request("c", [H.Item("r" * 64, 0, 30), H.Item("r" * 64, 40, 30)]))
    so, out = run_step(sched, worker)
    assert out[0].scheduler_stats.ec_connector_stats["rejected"] == 1
    assert worker.encoder_cache["r" * 64].shape == (30, H.WIDTH)


def test_pinned_item_survives_delete_before_the_load(engine, tmp_path):
    item = H.Item("h" * 64, 0, 40)
    sched, worker = engine("ec_both", inproc(tmp_path))
    ref = H.encoder_output(item.mm_hash, 40)
    ct.store(sched.ec_connector).put(item.mm_hash, ref)
    sched.add_request(H.make_request("c", [item]))
    so = sched.schedule()  # pins it
    assert so.scheduled_encoder_inputs == {}
    ct.cache(sched.ec_connector).delete(item.mm_hash)  # evicted/deleted between schedule and load
    out = worker.execute(so)
    sched.update_from_output(so, out)
    assert same_bytes(worker.encoder_cache[item.mm_hash], ref)


def _fail_first_load(engine, tmp_path, monkeypatch, item, **config):
    """An ec_both engine whose first load of ``item`` fails at the worker (the store answers with
    a tensor one row short), run until vLLM has failed the request. Returns (sched, worker)."""
    from vllm.v1.request import RequestStatus

    sched, worker = engine("ec_both", inproc(tmp_path), **config)
    ct.store(sched.ec_connector).put(item.mm_hash, H.encoder_output(item.mm_hash, item.length))
    real_get = ct.store(worker.connector).get
    monkeypatch.setattr(ct.store(worker.connector), "get", lambda key, device: real_get(key, device)[:-1])
    sched.add_request(H.make_request("c", [item]))
    so, out = run_step(sched, worker)  # the step runs (no crash) on a zero placeholder
    assert so.scheduled_encoder_inputs == {}
    assert item.mm_hash not in worker.encoder_cache  # the placeholder is gone after the step
    assert out[0].scheduler_stats.ec_connector_stats["load_failures"] == 1
    # vLLM 0.33 asks take_unavailable_requests before update_connector_output: the request is
    # held back (not scheduled) in the next step and failed at its end
    so, out = run_step(sched, worker)
    assert "c" not in so.num_scheduled_tokens
    assert errors_of(out)["c"].finish_reason is not None
    assert "c" not in sched.requests or sched.requests["c"].status == RequestStatus.FINISHED_ERROR
    monkeypatch.undo()
    # vLLM's encoder-cache manager still lists the item (freeable): it would neither encode nor
    # load it for a new request; the worker has no copy
    assert item.mm_hash in sched.encoder_cache_manager.cached
    return sched, worker


def test_failed_load_fails_request_then_retry_loads_from_store(engine, tmp_path, monkeypatch):
    item = H.Item("i" * 64, 0, 40)
    sched, worker = _fail_first_load(engine, tmp_path, monkeypatch, item)
    sched.add_request(H.make_request("c-retry", [item]))
    so, out = run_step(sched, worker)
    assert so.scheduled_encoder_inputs == {}  # vLLM thinks it is cached...
    assert [it.mm_hash for it in so.ec_connector_metadata.loads] == [item.mm_hash]  # ...we reload it
    assert errors_of(out) == {}
    assert worker.encoded == []
    assert same_bytes(worker.encoder_cache[item.mm_hash], H.encoder_output(item.mm_hash, 40))
    assert ct.poisoned(sched.ec_connector) == set()


def test_device_out_of_memory_at_the_worker_load_is_a_failed_request_not_a_crash(engine, tmp_path, monkeypatch):
    import torch

    item = H.Item("o" * 64, 0, 40)
    sched, worker = engine("ec_both", inproc(tmp_path))
    ct.store(sched.ec_connector).put(item.mm_hash, H.encoder_output(item.mm_hash, item.length))

    def oom(key, device):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    monkeypatch.setattr(ct.store(worker.connector), "get", oom)
    sched.add_request(H.make_request("c", [item]))
    so, out = run_step(sched, worker)  # the step runs on a placeholder, no exception escapes
    assert item.mm_hash not in worker.encoder_cache
    assert out[0].scheduler_stats.ec_connector_stats["load_failures"] == 1
    so, out = run_step(sched, worker)
    assert errors_of(out)["c"].finish_reason is not None


def test_device_out_of_memory_while_the_scheduler_pins_is_a_miss(engine, tmp_path, monkeypatch):
    import torch

    item = H.Item("p" * 64, 0, 40)
    sched, worker = engine("ec_both", inproc(tmp_path))
    ct.store(sched.ec_connector).put(item.mm_hash, H.encoder_output(item.mm_hash, item.length))

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    monkeypatch.setattr(ct.store(sched.ec_connector), "acquire", oom)
    sched.add_request(H.make_request("c", [item]))
    so, out = run_step(sched, worker)
    assert so.scheduled_encoder_inputs.get("c") == [0]  # a miss: encoded locally
    assert errors_of(out) == {}
    assert same_bytes(worker.encoder_cache[item.mm_hash], H.encoder_output(item.mm_hash, 40))


def test_failed_load_of_a_vanished_item_fails_retries_until_vllm_drops_it(engine, tmp_path, monkeypatch):
    """Worst case: the load failed and the store lost the item too. Retries fail cleanly
    (retryable errors, no worker crash) until vLLM's encoder-cache manager evicts the entry; then
    the retry is encoded."""
    monkeypatch.setattr(H.FixedBudget, "cache_size", 100)
    item = H.Item("v" * 64, 0, 40)
    sched, worker = _fail_first_load(engine, tmp_path, monkeypatch, item)
    ct.cache(sched.ec_connector).delete(item.mm_hash)
    sched.add_request(H.make_request("c-retry", [item]))
    so, out = run_step(sched, worker)
    assert "c-retry" not in so.num_scheduled_tokens
    assert errors_of(out)["c-retry"].finish_reason is not None
    # another image fills the encoder cache: vLLM evicts the stale entry (free_encoder_mm_hashes)
    sched.add_request(H.make_request("other", [H.Item("w" * 64, 0, 80)]))
    so, out = run_step(sched, worker)
    assert item.mm_hash in so.free_encoder_mm_hashes
    assert ct.poisoned(sched.ec_connector) == set()
    sched.add_request(H.make_request("c-retry-2", [item], prompt_len=100))
    so, out = run_step(sched, worker)
    assert so.scheduled_encoder_inputs.get("c-retry-2") == [0]  # encoded again, as vLLM would
    assert "c-retry-2" not in errors_of(out)
    assert item.mm_hash in worker.encoded
    assert same_bytes(worker.encoder_cache[item.mm_hash], H.encoder_output(item.mm_hash, 40))


def test_request_finished_returns_no_delay_and_releases_pins(engine, tmp_path):
    item = H.Item("l" * 64, 0, 40)
    sched, worker = engine("ec_both", inproc(tmp_path))
    ct.store(sched.ec_connector).put(item.mm_hash, H.encoder_output(item.mm_hash, 40))
    req = H.make_request("c", [item])
    assert sched.ec_connector.ensure_cache_available(req, 0) is True
    assert item.mm_hash in ct.pinned(sched.ec_connector)
    assert host_pins(ct.cache(sched.ec_connector)) == 1
    assert sched.ec_connector.request_finished(req) == (False, None)
    assert ct.pinned(sched.ec_connector) == set()
    assert host_pins(ct.cache(sched.ec_connector)) == 0


def test_two_requests_sharing_an_item_in_one_step_load_it_once(engine, tmp_path):
    item = H.Item("u" * 64, 0, 40)
    sched, worker = engine("ec_both", inproc(tmp_path))
    ref = H.encoder_output(item.mm_hash, 40)
    ct.store(sched.ec_connector).put(item.mm_hash, ref)
    sched.add_request(H.make_request("c1", [item]))
    sched.add_request(H.make_request("c2", [item]))
    so, out = run_step(sched, worker)
    assert so.scheduled_encoder_inputs == {}
    assert set(so.num_scheduled_tokens) == {"c1", "c2"}
    assert [it.mm_hash for it in so.ec_connector_metadata.loads] == [item.mm_hash]
    assert errors_of(out) == {}
    assert same_bytes(worker.encoder_cache[item.mm_hash], ref)
    assert ct.pinned(sched.ec_connector) == set()
    _assert_view_pin_ends_with_the_tensor(sched, worker, item.mm_hash)


def test_chunked_prefill_loads_once_and_pins_nothing_afterwards(engine, tmp_path):
    """An item whose placeholder spans several prefill chunks is loaded in the first chunk's step;
    the later chunks neither pin nor load it again."""
    item = H.Item("q" * 64, 10, 200)
    sched, worker = engine("ec_both", inproc(tmp_path), max_num_batched_tokens=128)
    ref = H.encoder_output(item.mm_hash, 200)
    ct.store(sched.ec_connector).put(item.mm_hash, ref)
    sched.add_request(H.make_request("c", [item], prompt_len=400))
    loads = []
    for _ in range(4):  # 400 prompt tokens in chunks of 128
        so, out = run_step(sched, worker)
        loads += [it.mm_hash for it in so.ec_connector_metadata.loads]
        assert so.scheduled_encoder_inputs == {}
        assert ct.pinned(sched.ec_connector) == set()  # released after the load, never taken again
    assert loads == [item.mm_hash]
    assert worker.encoded == []
    assert same_bytes(worker.encoder_cache[item.mm_hash], ref)
    _assert_view_pin_ends_with_the_tensor(sched, worker, item.mm_hash)


def _assert_view_pin_ends_with_the_tensor(sched, worker, mm_hash):
    """A CPU load is a zero-copy view of the host arena: its own pin lasts while vLLM's encoder
    cache holds the tensor, and ends with it (the scheduler's pin is already gone)."""
    import gc

    cache = ct.cache(sched.ec_connector)
    assert host_pins(cache) == 1
    del worker.encoder_cache[mm_hash]
    gc.collect()
    assert host_pins(cache) == 0
