"""Helpers of the connector tests in vLLM's real scheduler (test_connector_*.py): the in-process
config, a copy engine whose copies run when the test says, waits for the connector's background
work, the engine steps until a request is scheduled, byte comparisons and a producer instance.
The ``cache_hooks`` fixture that installs :class:`Engine`: conftest.py."""

from __future__ import annotations

import time

import torch

import harness as H
from conftest import run_step
from ectier.cache import LoadHandle
from ectier.testing import DeferredCopyEngine
from ectier import testing
from ectier_vllm import testing as ct

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
    for handles in list(ct.promoting(conn).values()):
        for h in handles:
            assert isinstance(h, LoadHandle)
            h.wait(10)
            assert h.done()


def run_step_loading(sched, worker):
    """Engine steps until the new requests are scheduled: a request whose stored items must be
    promoted first (NVMe → host, TieredCache.prefetch in its own threads) is deferred by
    ensure_cache_available until the LoadHandles are done. Returns (so, out) of the scheduling step."""
    for _ in range(5):
        so, out = run_step(sched, worker)
        if so.num_scheduled_tokens or not ct.promoting(sched.ec_connector):
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
