"""ECTierConnector driven by vLLM 0.33's real Scheduler and model-runner EC mixin (CPU tensors).

Each scenario is a sequence of engine steps: ``Scheduler.schedule()`` (which calls the connector's
``ensure_cache_available``, ``has_cache_item``, ``update_state_after_alloc``,
``build_connector_meta``), the worker (``ECConnectorModelRunnerMixin``: ``start_load_caches``,
``save_caches``, ``build_connector_worker_meta``), ``Scheduler.update_from_output`` (which calls
``take_unavailable_requests`` and ``update_connector_output``).
"""

from __future__ import annotations

import functools
import threading
import time

import lmdb
import pytest
import torch

import harness as H
from conftest import run_step
from ectier.cache import LoadHandle, PutHandle
from ectier.copy import InlineCopyEngine
from ectier.testing import DeferredCopyEngine
from ectier import testing

NS = "test-ns"
GPU = {"capacity_bytes": "2MiB", "block_bytes": "64KiB"}  # the GPU tier, CPU-faked (cache_hooks)


class Engine(DeferredCopyEngine):
    """ectier's DeferredCopyEngine (copies run at ``complete()``), which the fixture switches to
    completing every copy at once (``auto``) before the connectors shut down."""

    auto = False

    def copy(self, pairs, *, lane):
        handle = super().copy(pairs, lane=lane)
        if self.auto:
            self.complete()
        return handle


@pytest.fixture
def cache_hooks(monkeypatch):
    """``cache_hooks(engine, gpu=False)``: every in-process TieredCache opened afterwards routes its
    copies through ``engine`` (``ectier.testing.make_cache``); ``gpu=True`` also puts the GPU
    tier's arena in CPU memory (``gpu_device="cpu"``), so the worker's device ("cpu" here)
    is the GPU tier's device. Request this fixture after ``engine``: it completes deferred copies
    before the connectors shut down (shutdown waits for them)."""
    from ectier_vllm import store

    engines = []

    def set_hooks(copy_engine, gpu=False):
        engines.append(copy_engine)
        factory = functools.partial(testing.make_cache, copy_engine=copy_engine, gpu_device="cpu" if gpu else None)
        monkeypatch.setattr(store, "_CACHE_FACTORY", factory)
        return copy_engine

    yield set_hooks
    for e in engines:
        if isinstance(e, Engine):
            e.auto = True
            e.complete()


def wait_until(predicate, timeout_s: float = 10.0) -> None:
    """Wait for ``predicate()`` (e.g. the connector's background put thread reaching the cache)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def host_pins(cache) -> int:
    """Readers' pins on host-arena entries (scheduler pins not yet released)."""
    return testing.pins(cache, "host")


def wait_prefetches(conn):
    """Let the promotions the connector started finish (its real TieredCache LoadHandles)."""
    for pf in list(conn._prefetching.values()):
        for h in pf.handles:
            assert isinstance(h, LoadHandle)
            h.wait(10)
            assert h.done()


def run_step_loading(sched, worker):
    """Engine steps until the new requests are scheduled: a request whose stored items must be
    promoted first (NVMe → host, TieredCache.prefetch in its own threads) is deferred by
    ensure_cache_available until the LoadHandles are done. Returns (so, out) of the scheduling step."""
    for _ in range(5):
        so, out = run_step(sched, worker)
        if so.num_scheduled_tokens or not sched.ec_connector._prefetching:
            return so, out
        wait_prefetches(sched.ec_connector)
    raise AssertionError("requests still deferred after 5 steps")


def inproc(tmp_path, **host):
    return {
        "namespace": NS,
        "host": {"capacity_bytes": "8MiB", "block_bytes": "64KiB", "pin_memory": False, **host},
        "nvme": {"path": str(tmp_path / "nvme"), "capacity_bytes": "64MiB", "sync": False,
                 "map_initial_bytes": "4MiB"},
    }


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


def errors_of(engine_out):
    return {o.request_id: o for outs in engine_out.values() for o in outs.outputs if o.finish_reason is not None}


def produce(engine, extra, items):
    """An encoder instance (ec_producer) encodes ``items`` and saves them; then shuts down."""
    sched, worker = engine("ec_producer", extra)
    sched.add_request(H.make_request("p", items))
    so, _ = run_step(sched, worker)
    assert sorted(so.scheduled_encoder_inputs["p"]) == list(range(len(items)))  # the producer encodes
    assert sorted(worker.encoded) == sorted(i.mm_hash for i in items)
    produced = {h: t.clone() for h, t in worker.encoder_cache.items()}
    # the encoder instance stops: its connectors wait for the saves and flush to NVMe
    worker.connector.shutdown()
    sched.ec_connector.shutdown()
    return produced


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
    assert not sched.ec_connector._pins  # pins dropped once the worker reported the loads
    assert store.open_stores() == 1


def test_ec_both_shares_one_store_between_scheduler_and_worker(engine, tmp_path):
    sched, worker = engine("ec_both", inproc(tmp_path))
    assert sched.ec_connector._store.cache is worker.connector._store.cache
    item = H.Item("c" * 64, 0, 64)
    sched.add_request(H.make_request("r1", [item], max_tokens=1))
    so, _ = run_step(sched, worker)
    assert so.scheduled_encoder_inputs == {"r1": [0]}
    first = worker.encoder_cache[item.mm_hash].clone()
    # the worker's encoder cache forgets it (as after vLLM frees it); a new request loads it back
    worker.encoder_cache.clear()
    sched.encoder_cache_manager.reset()
    sched.add_request(H.make_request("r2", [item], max_tokens=1))
    so, out = run_step(sched, worker)
    assert so.scheduled_encoder_inputs == {}
    assert worker.encoded == [item.mm_hash]  # encoded once, in the first step only
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
    assert not sched.ec_connector._store.contains(item.mm_hash)  # quarantined


def test_wrong_shape_in_store_is_rejected_and_encoded(engine, tmp_path):
    sched, worker = engine("ec_both", inproc(tmp_path))
    sched.ec_connector._store.put("f" * 64, torch.zeros(10, H.WIDTH, dtype=H.DTYPE))  # request wants 30
    sched.ec_connector._store.put("g" * 64, torch.zeros(30, H.WIDTH, dtype=torch.float16))  # wrong dtype
    sched.add_request(H.make_request("c", [H.Item("f" * 64, 0, 30), H.Item("g" * 64, 40, 30)]))
    so, out = run_step(sched, worker)
    assert so.scheduled_encoder_inputs == {"c": [0, 1]}
    assert out[0].scheduler_stats.ec_connector_stats["rejected"] == 2
    assert worker.encoder_cache["f" * 64].shape == (30, H.WIDTH)


def test_an_item_refused_once_is_settled_for_the_rest_of_its_request(engine, tmp_path):
    """The same image twice in one prompt, stored with the wrong shape: refused (and warned about)
    once, not once per occurrence in the same scheduler step."""
    sched, worker = engine("ec_both", inproc(tmp_path))
    sched.ec_connector._store.put("r" * 64, torch.zeros(10, H.WIDTH, dtype=H.DTYPE))  # the request wants 30
    sched.add_request(H.make_request("c", [H.Item("r" * 64, 0, 30), H.Item("r" * 64, 40, 30)]))
    so, out = run_step(sched, worker)
    assert out[0].scheduler_stats.ec_connector_stats["rejected"] == 1
    assert worker.encoder_cache["r" * 64].shape == (30, H.WIDTH)


def test_pinned_item_survives_delete_before_the_load(engine, tmp_path):
    item = H.Item("h" * 64, 0, 40)
    sched, worker = engine("ec_both", inproc(tmp_path))
    ref = H.encoder_output(item.mm_hash, 40)
    sched.ec_connector._store.put(item.mm_hash, ref)
    sched.add_request(H.make_request("c", [item]))
    so = sched.schedule()  # pins it
    assert so.scheduled_encoder_inputs == {}
    sched.ec_connector._store.cache.delete(item.mm_hash)  # evicted/deleted between schedule and load
    out = worker.execute(so)
    sched.update_from_output(so, out)
    assert same_bytes(worker.encoder_cache[item.mm_hash], ref)


def _fail_first_load(engine, tmp_path, monkeypatch, item, **config):
    """An ec_both engine whose first load of ``item`` fails at the worker (the store answers with
    a tensor one row short), run until vLLM has failed the request. Returns (sched, worker)."""
    from vllm.v1.request import RequestStatus

    sched, worker = engine("ec_both", inproc(tmp_path), **config)
    sched.ec_connector._store.put(item.mm_hash, H.encoder_output(item.mm_hash, item.length))
    real_get = worker.connector._store.get
    monkeypatch.setattr(worker.connector._store, "get", lambda key, device: real_get(key, device)[:-1])
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
    assert sched.ec_connector._poisoned == set()


def test_device_out_of_memory_at_the_worker_load_is_a_failed_request_not_a_crash(engine, tmp_path, monkeypatch):
    import torch

    item = H.Item("o" * 64, 0, 40)
    sched, worker = engine("ec_both", inproc(tmp_path))
    sched.ec_connector._store.put(item.mm_hash, H.encoder_output(item.mm_hash, item.length))

    def oom(key, device):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    monkeypatch.setattr(worker.connector._store, "get", oom)
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
    sched.ec_connector._store.put(item.mm_hash, H.encoder_output(item.mm_hash, item.length))

    def oom(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory (injected)")

    monkeypatch.setattr(sched.ec_connector._store, "acquire", oom)
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
    sched.ec_connector._store.cache.delete(item.mm_hash)
    sched.add_request(H.make_request("c-retry", [item]))
    so, out = run_step(sched, worker)
    assert "c-retry" not in so.num_scheduled_tokens
    assert errors_of(out)["c-retry"].finish_reason is not None
    # another image fills the encoder cache: vLLM evicts the stale entry (free_encoder_mm_hashes)
    sched.add_request(H.make_request("other", [H.Item("w" * 64, 0, 80)]))
    so, out = run_step(sched, worker)
    assert item.mm_hash in so.free_encoder_mm_hashes
    assert sched.ec_connector._poisoned == set()
    sched.add_request(H.make_request("c-retry-2", [item], prompt_len=100))
    so, out = run_step(sched, worker)
    assert so.scheduled_encoder_inputs.get("c-retry-2") == [0]  # encoded again, as vLLM would
    assert "c-retry-2" not in errors_of(out)
    assert item.mm_hash in worker.encoded
    assert same_bytes(worker.encoder_cache[item.mm_hash], H.encoder_output(item.mm_hash, 40))


def test_request_finished_returns_no_delay_and_releases_pins(engine, tmp_path):
    item = H.Item("l" * 64, 0, 40)
    sched, worker = engine("ec_both", inproc(tmp_path))
    sched.ec_connector._store.put(item.mm_hash, H.encoder_output(item.mm_hash, 40))
    req = H.make_request("c", [item])
    assert sched.ec_connector.ensure_cache_available(req, 0) is True
    assert item.mm_hash in sched.ec_connector._pins
    assert host_pins(sched.ec_connector._store.cache) == 1
    assert sched.ec_connector.request_finished(req) == (False, None)
    assert sched.ec_connector._pins == {}
    assert host_pins(sched.ec_connector._store.cache) == 0


def test_prometheus_metrics_through_vllms_ec_connector_prom(engine, tmp_path):
    """vLLM's ECConnectorProm finds the connector class through the factory and calls
    build_prom_metrics; observe() of a stats dict moves the counters and the histogram."""
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
    from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorProm

    from ectier_vllm.connector import ECTierConnector

    reg = CollectorRegistry()

    def bound(cls):
        return type(cls.__name__, (cls,), {"__init__": lambda self, *a, **k: cls.__init__(self, *a, registry=reg, **k)})

    class Prom(ECConnectorProm):  # vLLM's class, with metrics in a registry of this test
        _gauge_cls, _counter_cls, _histogram_cls = bound(Gauge), bound(Counter), bound(Histogram)

    sched, _ = engine("ec_both", inproc(tmp_path))
    prom = Prom(sched.vllm_config, ["model_name", "engine"], {0: ["m", "0"]})
    stats = ECTierConnector.build_ec_connector_stats(
        {"lookups": 4, "hits": 3, "misses": 1, "loads": 3, "load_bytes": 300, "load_seconds": [0.001, 0.002, 0.004]})
    assert stats.reduce()["hit_rate"] == 0.75 and not stats.is_empty()
    prom.observe(stats.data, 0)
    labels = {"model_name": "m", "engine": "0"}
    assert reg.get_sample_value("vllm:ectier_hits_total", labels) == 3
    assert reg.get_sample_value("vllm:ectier_misses_total", labels) == 1
    assert reg.get_sample_value("vllm:ectier_load_bytes_total", labels) == 300
    assert reg.get_sample_value("vllm:ectier_load_seconds_count", labels) == 3
    assert reg.get_sample_value("vllm:ectier_load_seconds_bucket", {**labels, "le": "0.002"}) == 2


def test_worker_reports_aggregate_across_workers():
    """vLLM aggregates the worker metadata of all workers (tensor parallel) before the scheduler
    sees it: a failure on any worker fails the request; counters add up."""
    from ectier_vllm.metadata import ECTierWorkerMetadata

    a = ECTierWorkerMetadata(loaded=["x", "y"], stats={"loads": 2, "load_seconds": [0.1, 0.2]})
    b = ECTierWorkerMetadata(loaded=["x"], failed={"y": ["r1", "r2"]}, saved=["z"],
                             stats={"loads": 1, "load_failures": 1, "load_seconds": [0.3]})
    m = a.aggregate(b)
    assert m.loaded == ["x", "y"] and m.failed == {"y": ["r1", "r2"]} and m.saved == ["z"]
    assert m.stats["loads"] == 3 and m.stats["load_failures"] == 1
    assert sorted(m.stats["load_seconds"]) == [0.1, 0.2, 0.3]


def test_two_requests_sharing_an_item_in_one_step_load_it_once(engine, tmp_path):
    item = H.Item("u" * 64, 0, 40)
    sched, worker = engine("ec_both", inproc(tmp_path))
    ref = H.encoder_output(item.mm_hash, 40)
    sched.ec_connector._store.put(item.mm_hash, ref)
    sched.add_request(H.make_request("c1", [item]))
    sched.add_request(H.make_request("c2", [item]))
    so, out = run_step(sched, worker)
    assert so.scheduled_encoder_inputs == {}
    assert set(so.num_scheduled_tokens) == {"c1", "c2"}
    assert [it.mm_hash for it in so.ec_connector_metadata.loads] == [item.mm_hash]
    assert errors_of(out) == {}
    assert same_bytes(worker.encoder_cache[item.mm_hash], ref)
    assert sched.ec_connector._pins == {}
    _assert_view_pin_ends_with_the_tensor(sched, worker, item.mm_hash)


def test_chunked_prefill_loads_once_and_pins_nothing_afterwards(engine, tmp_path):
    """An item whose placeholder spans several prefill chunks is loaded in the first chunk's step;
    the later chunks neither pin nor load it again."""
    item = H.Item("q" * 64, 10, 200)
    sched, worker = engine("ec_both", inproc(tmp_path), max_num_batched_tokens=128)
    ref = H.encoder_output(item.mm_hash, 200)
    sched.ec_connector._store.put(item.mm_hash, ref)
    sched.add_request(H.make_request("c", [item], prompt_len=400))
    loads = []
    for _ in range(4):  # 400 prompt tokens in chunks of 128
        so, out = run_step(sched, worker)
        loads += [it.mm_hash for it in so.ec_connector_metadata.loads]
        assert so.scheduled_encoder_inputs == {}
        assert sched.ec_connector._pins == {}  # released after the load, never taken again
    assert loads == [item.mm_hash]
    assert worker.encoded == []
    assert same_bytes(worker.encoder_cache[item.mm_hash], ref)
    _assert_view_pin_ends_with_the_tensor(sched, worker, item.mm_hash)


def _assert_view_pin_ends_with_the_tensor(sched, worker, mm_hash):
    """A CPU load is a zero-copy view of the host arena: its own pin lasts while vLLM's encoder
    cache holds the tensor, and ends with it (the scheduler's pin is already gone)."""
    import gc

    cache = sched.ec_connector._store.cache
    assert host_pins(cache) == 1
    del worker.encoder_cache[mm_hash]
    gc.collect()
    assert host_pins(cache) == 0


def test_stats_reach_vllms_ec_connector_logging(engine, tmp_path):
    """The scheduler's stats dict (SchedulerStats.ec_connector_stats) is what vLLM's logger process
    feeds to ECConnectorLogging, which rebuilds our stats class through the connector factory."""
    from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorLogging

    item = H.Item("r" * 64, 0, 40)
    sched, worker = engine("ec_both", inproc(tmp_path))
    sched.ec_connector._store.put(item.mm_hash, H.encoder_output(item.mm_hash, 40))
    sched.add_request(H.make_request("c", [item, H.Item("s" * 64, 50, 10)]))
    _, out = run_step(sched, worker)
    logging = ECConnectorLogging(sched.vllm_config.ec_transfer_config)
    logging.observe(out[0].scheduler_stats.ec_connector_stats)
    lines = []
    logging.log(lambda fmt, *args: lines.append(fmt % args))
    assert len(lines) == 1
    assert "hits=1" in lines[0] and "misses=1" in lines[0] and "loads=1" in lines[0]
    assert f"load_bytes={40 * H.WIDTH * 2}" in lines[0] and "hit_rate=0.5" in lines[0]


def test_inprocess_mode_is_refused_when_workers_are_other_processes(model_dir, tmp_path):
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

    from ectier.errors import ConfigError
    from ectier_vllm.connector import ECTierConnector

    cfg = H.make_vllm_config(model_dir, "ec_consumer", inproc(tmp_path))
    assert cfg.parallel_config.distributed_executor_backend == "uni"
    cfg.parallel_config.distributed_executor_backend = "mp"  # as with --tensor-parallel-size 2
    with pytest.raises(ConfigError, match=r'ec_connector_extra_config\.mode: "inprocess" \(the default\) needs .* '
                                          r'"mode": "daemon", .*VLLM_ENABLE_V1_MULTIPROCESSING=0'):
        ECTierConnector(cfg, ECConnectorRole.SCHEDULER)
    from ectier_vllm.store import open_stores

    assert open_stores() == 0


def test_bad_extra_config_stops_the_engine_with_the_key_named(model_dir, monkeypatch):
    from ectier.errors import ConfigError

    cfg = H.make_vllm_config(model_dir, "ec_consumer", {"mode": "daemon", "host": {"capacity_bytes": "1GiB"}})
    with pytest.raises(ConfigError, match=r"ec_connector_extra_config\.host: not used in daemon mode"):
        H.make_scheduler(cfg, monkeypatch)


def test_request_waits_for_a_real_prefetch_then_loads(engine, tmp_path, cache_hooks):
    """ensure_cache_available defers the request while TieredCache.prefetch's LoadHandle is not
    done (here: the item's put is still in flight in the copy engine), then pins and loads it."""
    copies = cache_hooks(Engine())
    item = H.Item("j" * 64, 0, 40)
    sched, worker = engine("ec_both", inproc(tmp_path))
    ref = H.encoder_output(item.mm_hash, 40)
    put = sched.ec_connector._store.put(item.mm_hash, ref)
    assert isinstance(put, PutHandle) and not put.done() and copies.pending == 1
    sched.add_request(H.make_request("c", [item]))
    for _ in range(2):  # deferred as long as the copy has not run
        so, out = run_step(sched, worker)
        assert so.num_scheduled_tokens == {}
        assert out[0].scheduler_stats.ec_connector_stats["deferrals"] == 1
    [pf] = sched.ec_connector._prefetching.values()
    [handle] = pf.handles
    assert isinstance(handle, LoadHandle) and not handle.done()
    copies.complete()
    assert handle.wait(10) is True
    so, out = run_step(sched, worker)
    assert so.num_scheduled_tokens.get("c") and so.scheduled_encoder_inputs == {}
    assert [it.mm_hash for it in so.ec_connector_metadata.loads] == [item.mm_hash]
    assert worker.encoded == []
    assert same_bytes(worker.encoder_cache[item.mm_hash], ref)
    assert errors_of(out) == {}


def test_promotion_past_load_timeout_is_reencoded(engine, tmp_path, cache_hooks, monkeypatch):
    """A promotion that does not complete stops deferring the request after load_timeout_s: the
    item is re-encoded (no synchronous read on the scheduler's path)."""
    copies = cache_hooks(Engine())
    item = H.Item("t" * 64, 0, 40)
    sched, worker = engine("ec_both", {**inproc(tmp_path), "load_timeout_s": 0.05})
    worker.settle_saves = False  # the re-encoded item's save waits behind the copy that never runs
    store = sched.ec_connector._store
    store.put(item.mm_hash, H.encoder_output(item.mm_hash, 40))  # its copy never runs in this test
    acquired = []
    real_acquire = store.acquire
    monkeypatch.setattr(store, "acquire", lambda key, device: acquired.append(key) or real_acquire(key, device))
    sched.add_request(H.make_request("c", [item]))
    so, _ = run_step(sched, worker)
    assert so.num_scheduled_tokens == {}  # waiting for the promotion
    [pf] = sched.ec_connector._prefetching.values()
    assert not pf.handles[0].done()
    import time

    time.sleep(0.1)
    so, out = run_step(sched, worker)
    assert so.scheduled_encoder_inputs == {"c": [0]}
    assert acquired == []
    assert out[0].scheduler_stats.ec_connector_stats["rejected"] == 1
    assert copies.pending >= 1  # still in flight: the timeout, not the copy, ended the wait


@pytest.mark.parametrize("gpu", [False, True], ids=["host-tier", "gpu-tier"])
def test_async_put_is_reported_once_its_copy_completed(engine, tmp_path, cache_hooks, gpu):
    """save_caches hands the tensor to the connector's background put thread, which calls
    TieredCache.put and waits for its PutHandle: the save is not reported while the copy engine has
    not run the copy (into the pinned host arena, or into the GPU tier), and is once it has;
    shutdown waits for a put still in flight."""
    copies = cache_hooks(Engine(), gpu=gpu)
    extra = {**inproc(tmp_path), **({"gpu": GPU} if gpu else {})}
    sched, worker = engine("ec_producer", extra)
    worker.settle_saves = False  # the put thread waits for copies this test runs
    cache = worker.connector._store.cache
    item = H.Item("k" * 64, 0, 30)
    sched.add_request(H.make_request("p", [item]))
    so = sched.schedule()
    out = worker.execute(so)
    assert worker.encoded == [item.mm_hash]
    # save still in flight: nothing to report (the V1 runner's producer output carries no report)
    assert out.ec_connector_output is None or out.ec_connector_output.ec_connector_worker_meta is None
    saves = worker.connector.saves
    wait_until(lambda: copies.pending == 1)  # the background put thread enqueued the copy
    assert saves.pending() == 1
    assert worker.connector.build_connector_worker_meta() is None  # polled again: still in flight
    copies.complete()
    assert saves.wait(10) is True
    meta = worker.connector.build_connector_worker_meta()
    assert meta.saved == [item.mm_hash] and meta.save_failed == []
    assert meta.stats["saves"] == 1 and meta.stats["save_bytes"] == 30 * H.WIDTH * 2
    tiers = cache.stats()["tiers"]
    assert (tiers.get("gpu", {}).get("puts", 0), tiers["host"]["puts"]) == ((1, 0) if gpu else (0, 1))
    copies.auto = True  # reads out of the GPU tier go through the engine too
    assert same_bytes(cache.get(item.mm_hash), worker.encoder_cache[item.mm_hash])
    copies.auto = False
    # shutdown waits for puts still in flight
    late = torch.randn(2, H.WIDTH).to(H.DTYPE)
    worker.connector.save_caches({"x" * 64: late}, "x" * 64)
    wait_until(lambda: copies.pending == 1)
    assert saves.pending() == 1

    def finish():
        copies.auto = True  # the flush after the wait reads the GPU tier through the engine
        copies.complete()

    timer = threading.Timer(0.2, finish)
    timer.start()
    worker.connector.shutdown()  # returns only after the timer ran the copy
    timer.join()
    assert saves.pending() == 0
    assert same_bytes(sched.ec_connector._store.cache.get("x" * 64), late)


@pytest.mark.parametrize("gpu", [False, True], ids=["host-tier", "gpu-tier"])
def test_failed_put_copy_is_a_logged_save_failure_then_a_miss(engine, tmp_path, cache_hooks, monkeypatch, gpu):
    """A copy that fails in the engine (e.g. a CUDA error) finishes the PutHandle with an error:
    the connector logs and reports a save failure (never raises into the step), the store does not
    hold the item, and the next request that needs it encodes it again."""
    import ectier_vllm.connector as conn_mod

    copies = cache_hooks(Engine(), gpu=gpu)
    warnings = []
    monkeypatch.setattr(conn_mod.logger, "warning", lambda fmt, *a: warnings.append(fmt % a))
    extra = {**inproc(tmp_path), **({"gpu": GPU} if gpu else {})}
    sched, worker = engine("ec_both", extra)
    worker.settle_saves = False  # the put thread waits for copies this test runs
    item = H.Item("x" * 64, 0, 30)
    sched.add_request(H.make_request("p", [item], max_tokens=1))
    so, out = run_step(sched, worker)
    assert so.scheduled_encoder_inputs == {"p": [0]}
    wait_until(lambda: copies.pending == 1)  # the background put thread enqueued the copy
    copies.fail_with = RuntimeError("CUDA error: an illegal memory access was encountered")
    copies.complete()
    assert worker.connector.saves.wait(10) is True
    meta = worker.connector.build_connector_worker_meta()
    assert meta.save_failed == [item.mm_hash] and meta.saved == []
    assert meta.stats["save_failures"] == 1 and "saves" not in meta.stats
    assert any(f"saving {item.mm_hash} failed (RuntimeError" in w for w in warnings)
    assert not sched.ec_connector._store.contains(item.mm_hash)
    # vLLM forgets its copy; a new request needs the item: a miss, encoded again
    worker.encoder_cache.clear()
    sched.encoder_cache_manager.reset()
    sched.add_request(H.make_request("c", [item]))
    so, out = run_step(sched, worker)
    assert so.scheduled_encoder_inputs == {"c": [0]}
    assert worker.encoded == [item.mm_hash, item.mm_hash]
    assert errors_of(out) == {}


def test_consumer_entries_in_the_gpu_tier_are_pinned_and_loaded(engine, tmp_path, cache_hooks):
    """ec_both with a GPU tier (CPU-faked): what the worker put lives only in the GPU tier, where a
    host-arena lease cannot pin it. prefetch(device=worker device) finds it there at once, the
    scheduler pins it by reading it from the GPU tier onto the worker's device, and the worker
    places that copy; a delete between schedule and load changes nothing."""
    cache_hooks(InlineCopyEngine(), gpu=True)
    sched, worker = engine("ec_both", {**inproc(tmp_path), "gpu": GPU})
    cache = sched.ec_connector._store.cache
    items = [H.Item("y" * 64, 0, 40), H.Item("z" * 64, 100, 24)]
    refs = {it.mm_hash: H.encoder_output(it.mm_hash, it.length) for it in items}
    for h, ref in refs.items():
        assert cache.put(h, ref).wait(10) is True
    tiers = cache.stats()["tiers"]
    assert tiers["gpu"]["entries"] == 2 and tiers["host"]["entries"] == 0
    assert cache.acquire(items[0].mm_hash) is None  # no host copy to lease
    sched.add_request(H.make_request("c", items))
    so = sched.schedule()
    assert so.scheduled_encoder_inputs == {}  # both pinned: nothing to encode, no deferral
    assert [it.mm_hash for it in so.ec_connector_metadata.loads] == [it.mm_hash for it in items]
    cache.delete(items[1].mm_hash)  # deleted between schedule and load: the pin still serves it
    out = sched.update_from_output(so, worker.execute(so))
    assert worker.encoded == []
    for h, ref in refs.items():
        assert same_bytes(worker.encoder_cache[h], ref)
    assert errors_of(out) == {}
    stats = out[0].scheduler_stats.ec_connector_stats
    assert stats["hits"] == 2 and stats["loads"] == 2
    assert cache.stats()["tiers"]["gpu"]["hits"] == 2  # read out of the GPU tier
    assert sched.ec_connector._pins == {}


def test_with_a_gpu_tier_the_load_reads_the_tier_the_prefetch_filled(engine, tmp_path, cache_hooks):
    """ec_consumer with a GPU tier (CPU-faked: the worker's device is gpu.device): an entry on the
    host tier only is promoted into the GPU tier by the scheduler's prefetch, and the pin and the
    load read it from there (a GPU hit), not from a host lease (before: the prefetch copied it into
    the GPU tier, then the pin leased the host copy and the worker copied that again)."""
    cache_hooks(InlineCopyEngine(), gpu=True)
    sched, worker = engine("ec_consumer", {**inproc(tmp_path), "gpu": GPU})
    cache = sched.ec_connector._store.cache
    item = H.Item("h" * 64, 0, 40)
    ref = H.encoder_output(item.mm_hash, item.length)
    assert cache.put(item.mm_hash, ref).wait(10) is True  # into the GPU tier (its device is "cpu")
    for i in range(40):  # push it down to the host tier (2 MiB GPU tier of 64 KiB blocks)
        assert cache.put(f"filler{i}", H.encoder_output(f"f{i}", 40)).wait(10) is True
    assert testing.where(cache, item.mm_hash) == {"host"}
    before = cache.stats()["tiers"]
    sched.add_request(H.make_request("c", [item]))
    so, out = run_step(sched, worker)
    if so.num_scheduled_tokens == {}:  # deferred while the promotion ran
        wait_prefetches(sched.ec_connector)
        so, out = run_step(sched, worker)
    assert worker.encoded == [] and so.scheduled_encoder_inputs == {}
    assert same_bytes(worker.encoder_cache[item.mm_hash], ref)
    after = cache.stats()["tiers"]
    assert after["gpu"]["promotions"] == before["gpu"]["promotions"] + 1  # the prefetch
    assert after["gpu"]["hits"] == before["gpu"]["hits"] + 1  # the pin read the GPU tier ...
    assert after["host"]["hits"] == before["host"]["hits"]  # ... and no host lease
    assert host_pins(cache) == 0
    assert errors_of(out) == {}


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_gpu_tier_without_cuda_stops_the_engine_naming_the_key(model_dir, tmp_path):
    """The gpu key reaches TieredCache: on a machine without CUDA the store refuses to open, and
    the error names the extra-config key (nothing is left open)."""
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

    from ectier.errors import ConfigError
    from ectier_vllm.connector import ECTierConnector
    from ectier_vllm.store import open_stores

    cfg = H.make_vllm_config(model_dir, "ec_consumer", {**inproc(tmp_path), "gpu": GPU})
    with pytest.raises(ConfigError, match=r"ec_connector_extra_config\.gpu\.capacity_bytes: .*CUDA is not available"):
        ECTierConnector(cfg, ECConnectorRole.SCHEDULER)
    assert open_stores() == 0


def warnings_of(monkeypatch):
    """The connector module's logger.warning calls, formatted (vLLM's loggers need not propagate)."""
    import ectier_vllm.connector as conn_mod

    lines: list[str] = []
    monkeypatch.setattr(conn_mod.logger, "warning", lambda fmt, *args, **kw: lines.append(fmt % args))
    return lines


def test_encoder_output_width_is_the_models(engine, tmp_path):
    """The tiny Qwen2-Audio's encoder outputs have the text hidden size (64); Qwen3-VL's deepstack
    encoders concatenate 1 + len(deepstack_visual_indexes) outputs of out_hidden_size; Qwen3-Omni
    (vision config under thinker_config) has both widths (images, audio)."""
    from types import SimpleNamespace as NS_

    from ectier_vllm.connector import encoder_output_widths

    sched, worker = engine("ec_consumer", inproc(tmp_path))
    assert sched.ec_connector._widths == worker.connector._widths == {H.WIDTH} == {64}
    deep = NS_(out_hidden_size=2048, deepstack_visual_indexes=[8, 16, 24])
    qwen3_vl_30b = NS_(hf_config=NS_(vision_config=deep), get_inputs_embeds_size=lambda: 2048)
    assert encoder_output_widths(qwen3_vl_30b) == {8192}
    omni = NS_(hf_config=NS_(thinker_config=NS_(vision_config=deep)), get_inputs_embeds_size=lambda: 2048)
    assert encoder_output_widths(omni) == {2048, 8192}

    def broken():
        raise AttributeError("no text config")

    assert encoder_output_widths(NS_(hf_config=NS_(), get_inputs_embeds_size=broken)) is None


def test_namespace_clash_with_another_width_is_a_miss_never_loaded(engine, tmp_path, monkeypatch):
    """Another model's (40, 7) bf16 entry under the same namespace: same rows and dtype as this
    request expects, but not this encoder's width: a miss with one warning naming the namespace."""
    warned = warnings_of(monkeypatch)
    sched, worker = engine("ec_both", {**inproc(tmp_path), "namespace": "shared"})
    item = H.Item("w" * 64, 0, 40)
    sched.ec_connector._store.put(item.mm_hash, torch.ones(40, 7, dtype=H.DTYPE))
    sched.add_request(H.make_request("c", [item]))
    so, out = run_step(sched, worker)
    assert so.scheduled_encoder_inputs == {"c": [0]}  # re-encoded, not loaded
    assert worker.encoded == [item.mm_hash]
    assert same_bytes(worker.encoder_cache[item.mm_hash], H.encoder_output(item.mm_hash, 40))
    stats = out[0].scheduler_stats.ec_connector_stats
    assert stats["rejected"] == 1 and stats.get("hits", 0) == 0 and stats.get("loads", 0) == 0
    clash = [w for w in warned if "namespace clash" in w]
    assert len(clash) == 1 and "'shared'" in clash[0] and "(40, 7)" in clash[0] and "(40, 64)" in clash[0]
    assert errors_of(out) == {}


def test_unknown_encoder_width_falls_back_to_rows_and_dtype_and_says_so(model_dir, tmp_path, monkeypatch):
    from vllm.config import ModelConfig
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

    from ectier_vllm.connector import ECTierConnector

    warned = warnings_of(monkeypatch)
    cfg = H.make_vllm_config(model_dir, "ec_consumer", inproc(tmp_path))

    def broken(self):
        raise AttributeError("no text config")

    monkeypatch.setattr(ModelConfig, "get_inputs_embeds_size", broken)
    conn = ECTierConnector(cfg, ECConnectorRole.SCHEDULER)
    try:
        assert conn._widths is None
        assert len([w for w in warned if "cannot determine the encoder output width" in w]) == 1
    finally:
        conn.shutdown()


def test_nvme_path_that_cannot_be_created_names_the_key(model_dir, tmp_path):
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

    from ectier.errors import StoreOpenError
    from ectier_vllm.connector import ECTierConnector
    from ectier_vllm.store import open_stores

    (tmp_path / "file").write_text("x")
    extra = inproc(tmp_path)
    extra["nvme"]["path"] = str(tmp_path / "file" / "nvme")  # under a regular file
    cfg = H.make_vllm_config(model_dir, "ec_consumer", extra)
    with pytest.raises(StoreOpenError, match=r"^ec_connector_extra_config\.nvme\.path: cannot create"):
        ECTierConnector(cfg, ECConnectorRole.SCHEDULER)
    assert open_stores() == 0


def test_nvme_path_in_use_names_the_key_and_the_config_file(model_dir, tmp_path):
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

    from ectier.cache import TieredCache
    from ectier.config import CacheConfig
    from ectier.errors import StoreLockedError
    from ectier_vllm.connector import ECTierConnector

    nvme = inproc(tmp_path)["nvme"]
    other = TieredCache(CacheConfig.from_dict({"host": {"capacity_bytes": "1MiB", "pin_memory": False}, "nvme": nvme}))
    try:
        path = tmp_path / "ectier.yaml"
        path.write_text(f"host:\n  capacity_bytes: 2MiB\n  pin_memory: false\nnvme:\n  path: {nvme['path']}\n"
                        "  capacity_bytes: 64MiB\n  sync: false\n  map_initial_bytes: 4MiB\n")
        cfg = H.make_vllm_config(model_dir, "ec_consumer", {"config_path": str(path)})
        with pytest.raises(StoreLockedError) as info:
            ECTierConnector(cfg, ECConnectorRole.SCHEDULER)
        assert str(info.value).startswith(f"ec_connector_extra_config.config_path ({str(path)!r}): nvme.path: ")
        assert "in use by another TieredCache in this process" in str(info.value)
    finally:
        other.close()
