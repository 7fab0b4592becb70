"""ECTierConnector in vLLM's real scheduler with copies that complete when the test says
(``cache_hooks`` and connector_helpers.Engine): a request waits for a real prefetch, a promotion
past the load timeout is encoded again, a put is reported only once its copy completed (a failed
copy is a logged save failure, then a miss), and the GPU tier (its arena faked in CPU memory)
pins, loads and is filled by prefetches."""

from __future__ import annotations

import threading

import pytest
import torch

import harness as H
from conftest import run_step
from ectier.cache import LoadHandle, PutHandle
from ectier.copy import InlineCopyEngine
from ectier import testing
from connector_helpers import Engine, GPU, errors_of, host_pins, inproc, same_bytes, wait_prefetches, wait_until
from ectier_vllm import testing as ct


def test_request_waits_for_a_real_prefetch_then_loads(engine, tmp_path, cache_hooks):
    """ensure_cache_available defers the request while TieredCache.prefetch's LoadHandle is not
    done (here: the item's put is still in flight in the copy engine), then pins and loads it."""
    copies = cache_hooks(Engine())
    item = H.Item("j" * 64, 0, 40)
    sched, worker = engine("ec_both", inproc(tmp_path))
    ref = H.encoder_output(item.mm_hash, 40)
    put = ct.store(sched.ec_connector).put(item.mm_hash, ref)
    assert isinstance(put, PutHandle) and not put.done() and copies.pending == 1
    sched.add_request(H.make_request("c", [item]))
    for _ in range(2):  # deferred as long as the copy has not run
        so, out = run_step(sched, worker)
        assert so.num_scheduled_tokens == {}
        assert out[0].scheduler_stats.ec_connector_stats["deferrals"] == 1
    [handles] = ct.promoting(sched.ec_connector).values()
    [handle] = handles
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
    store = ct.store(sched.ec_connector)
    store.put(item.mm_hash, H.encoder_output(item.mm_hash, 40))  # its copy never runs in this test
    acquired = []
    real_acquire = store.acquire
    monkeypatch.setattr(store, "acquire", lambda key, device: acquired.append(key) or real_acquire(key, device))
    sched.add_request(H.make_request("c", [item]))
    so, _ = run_step(sched, worker)
    assert so.num_scheduled_tokens == {}  # waiting for the promotion
    [handles] = ct.promoting(sched.ec_connector).values()
    assert not handles[0].done()
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
    cache = ct.cache(worker.connector)
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
    assert same_bytes(ct.cache(sched.ec_connector).get("x" * 64), late)


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
    assert not ct.store(sched.ec_connector).contains(item.mm_hash)
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
    cache = ct.cache(sched.ec_connector)
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
    assert ct.pinned(sched.ec_connector) == set()


def test_with_a_gpu_tier_the_load_reads_the_tier_the_prefetch_filled(engine, tmp_path, cache_hooks):
    """ec_consumer with a GPU tier (CPU-faked: the worker's device is gpu.device): an entry on the
    host tier only is promoted into the GPU tier by the scheduler's prefetch, and the pin and the
    load read it from there (a GPU hit), not from a host lease (before: the prefetch copied it into
    the GPU tier, then the pin leased the host copy and the worker copied that again)."""
    cache_hooks(InlineCopyEngine(), gpu=True)
    sched, worker = engine("ec_consumer", {**inproc(tmp_path), "gpu": GPU})
    cache = ct.cache(sched.ec_connector)
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
