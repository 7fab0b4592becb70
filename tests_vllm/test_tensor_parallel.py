"""Tensor parallelism and the producer's counters (docs/vllm.md, "Tensor parallelism" and "Metrics").

A TP=2 engine here is one real vLLM ``Scheduler`` and two worker connectors, one per rank, each
built while a fake of vLLM's parallel state (:func:`parallel_state`: the functions of
``vllm.distributed.parallel_state`` that the connector reads, answering for the rank being built)
says which rank this process is. Both workers run every step through the real model-runner EC
code (V1 mixin or V2 ``ActiveECConnector``), each with its own ``encoder_cache``, and their
outputs are merged by vLLM's own ``ECOutputAggregator`` before ``update_from_output``, as
vLLM's multiprocess executor does. Saves: only rank 0 puts; loads: every rank; counters once.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

import harness as H
from conftest import run_step
from ectier_vllm import testing as ct

NS = "tp-test"


def inproc(tmp_path):
    return {"namespace": NS, "host": {"capacity_bytes": "8MiB", "block_bytes": "64KiB", "pin_memory": False}}


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.fixture
def parallel_state(monkeypatch):
    """``at(tp=, pp=, pcp=)``: what vLLM's parallel state answers from now on in this process
    (``model_parallel_is_initialized`` True; ranks within the TP, PP and PCP groups)."""
    from vllm.distributed import parallel_state as ps

    now = {"tp": 0, "pp": 0, "pcp": 0}
    monkeypatch.setattr(ps, "model_parallel_is_initialized", lambda: True)
    monkeypatch.setattr(ps, "get_tensor_model_parallel_rank", lambda: now["tp"])
    monkeypatch.setattr(ps, "get_pipeline_model_parallel_rank", lambda: now["pp"])
    monkeypatch.setattr(ps, "get_pcp_group", lambda: SimpleNamespace(rank_in_group=now["pcp"], world_size=2))

    def at(**ranks):
        now.update(ranks)

    return at


@pytest.fixture
def tp_engine(model_dir, monkeypatch, parallel_state, request):
    """``tp_engine(role, extra, runner)`` -> (scheduler, [worker per TP rank]) of one TP=2 engine."""
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    made = []

    def make(role, extra, runner, tp=2):
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "1" if runner == "v2" else "0")
        cfg = H.make_vllm_config(model_dir, role, extra)
        sched = H.make_scheduler(cfg, monkeypatch)
        workers = []
        for rank in range(tp):
            parallel_state(tp=rank)
            workers.append(H.Worker(cfg, runner, connector=ECConnectorFactory.create_connector(cfg, ECConnectorRole.WORKER)))
        parallel_state(tp=0)
        made.append((sched, workers))
        return sched, workers

    yield make
    for sched, workers in made:
        for w in workers:
            w.connector.shutdown()
        sched.ec_connector.shutdown()


def run_tp_step(sched, workers):
    """One engine step with every rank executing it; their outputs merged as vLLM's executor does."""
    from vllm.distributed.ec_transfer.ec_connector.utils import ECOutputAggregator

    so = sched.schedule()
    outs = [w.execute(so) for w in workers]
    return so, sched.update_from_output(so, ECOutputAggregator().aggregate(outs, output_rank=0))


@pytest.mark.parametrize(("tp", "pp", "pcp", "lead"), [
    (0, 0, 0, True), (1, 0, 0, False), (0, 1, 0, False), (0, 0, 1, False), (3, 2, 0, False)])
def test_the_lead_worker_is_tp_rank_0_of_the_first_stage(parallel_state, tp, pp, pcp, lead):
    from ectier_vllm.ranks import is_lead_worker

    parallel_state(tp=tp, pp=pp, pcp=pcp)
    assert is_lead_worker() is lead


def test_without_model_parallelism_the_only_worker_is_the_lead():
    from ectier_vllm.ranks import is_lead_worker

    assert is_lead_worker() is True


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_tp2_producer_saves_each_item_once_and_counts_it_once(tp_engine, daemon, runner):
    """Both ranks encode the same items; only rank 0 puts them into the daemon (one put per item,
    not two), the saves are counted once, and a TP=2 consumer loads them on both ranks."""
    extra = {"mode": "daemon", "socket_path": daemon.socket_path, "namespace": NS}
    items = [H.Item("t" * 64, 0, 64), H.Item("u" * 64, 100, 33)]
    sched, workers = tp_engine("ec_producer", extra, runner)
    sched.add_request(H.make_request("p", items))
    so, out = run_tp_step(sched, workers)
    assert sorted(so.scheduled_encoder_inputs["p"]) == [0, 1]
    assert all(sorted(w.encoded) == sorted(i.mm_hash for i in items) for w in workers)  # both ranks encode
    stats = ct.daemon_client(sched.ec_connector).stats()
    assert stats["tiers"]["host"]["puts"] == 2  # one per item: rank 1 saved nothing
    # reported once committed: the V1 runner's scheduler sees them in the store (its contains,
    # never waited for, is answered a step or so later), the V2 runner's lead worker reports
    # them in its next step's report
    outs = [out]
    for _ in range(200):
        _, later = run_tp_step(sched, workers)
        outs.append(later)
        if summed_stats(*outs).get("saves", 0) >= 2:
            break
        time.sleep(0.005)
    counted = summed_stats(*outs)
    assert counted["saves"] == 2 and counted["save_bytes"] == (64 + 33) * H.WIDTH * 2
    assert "save_failures" not in counted

    cons, cworkers = tp_engine("ec_consumer", extra, runner)
    cons.add_request(H.make_request("c", items))
    outs = []
    for _ in range(200):  # daemon mode answers a lookup a step or so later (never waited for)
        so, out = run_tp_step(cons, cworkers)
        outs.append(out)
        if so.scheduled_new_reqs:
            break
        time.sleep(0.005)
    assert [r.req_id for r in so.scheduled_new_reqs] == ["c"] and so.scheduled_encoder_inputs == {}
    for w in cworkers:  # every rank loads into its own encoder cache
        for i in items:
            assert same_bytes(w.encoder_cache[i.mm_hash], workers[0].encoder_cache[i.mm_hash])
    counted = summed_stats(*outs)
    assert counted["loads"] == 2 and counted["load_bytes"] == (64 + 33) * H.WIDTH * 2
    assert len(counted["load_seconds"]) == 2
    assert ct.pinned(cons.ec_connector) == set()


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_tp2_failed_loads_fail_the_request_and_count_once(tp_engine, tmp_path, monkeypatch, runner):
    """A load that fails on both ranks is one failed item (not one per rank); the request fails."""
    from ectier.errors import EctierError

    item = H.Item("v" * 64, 0, 40)
    sched, workers = tp_engine("ec_consumer", inproc(tmp_path), runner)
    ct.store(sched.ec_connector).put(item.mm_hash, H.encoder_output(item.mm_hash, 40))

    def broken(key, device):
        raise EctierError("injected read failure")

    for w in workers:
        monkeypatch.setattr(ct.store(w.connector), "get", broken)
    sched.add_request(H.make_request("c", [item]))
    so, out = run_tp_step(sched, workers)
    assert [it.mm_hash for it in so.ec_connector_metadata.loads] == [item.mm_hash]
    counted = out[0].scheduler_stats.ec_connector_stats
    assert counted["load_failures"] == 1 and "loads" not in counted
    _, out = run_tp_step(sched, workers)  # vLLM fails the request at the end of the next step
    assert {o.request_id for outs in out.values() for o in outs.outputs if o.finish_reason is not None} == {"c"}


def test_producer_saves_are_counted_on_both_runners(engine, tmp_path):
    """The V1 runner's producer output carries no connector report; the saves are counted anyway,
    and exactly once on the V2 runner, whose report does arrive."""
    items = [H.Item("w" * 64, 0, 50), H.Item("x" * 64, 100, 20)]
    sched, worker = engine("ec_producer", inproc(tmp_path))
    sched.add_request(H.make_request("p", items))
    so, out = run_step(sched, worker)
    assert sorted(worker.encoded) == sorted(i.mm_hash for i in items)
    _, nxt = run_step(sched, worker)  # the V2 runner reports a committed save in the next step
    counted = summed_stats(out, nxt)
    assert counted, "producer saves were not counted"
    assert counted["saves"] == 2 and counted["save_bytes"] == (50 + 20) * H.WIDTH * 2
    assert all(ct.store(sched.ec_connector).contains(i.mm_hash) for i in items)
    _, out = run_step(sched, worker)  # nothing counted twice in a later step
    later = out[0].scheduler_stats.ec_connector_stats if out else None
    assert not (later or {}).get("saves")


def summed_stats(*outs) -> dict:
    """The connector's counters of several steps' engine outputs, added up."""
    total: dict = {}
    for out in outs:
        stats = out[0].scheduler_stats.ec_connector_stats if out else None
        for k, v in (stats or {}).items():
            total[k] = total.get(k, 0 if not isinstance(v, list) else []) + v
    return total


def v1_producer(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", "0")
    cfg = H.make_vllm_config(model_dir, "ec_producer", inproc(tmp_path))
    sched = H.make_scheduler(cfg, monkeypatch)
    return sched, H.Worker(cfg, "v1")


def test_v1_producer_save_that_never_lands_is_a_counted_failure(model_dir, tmp_path, monkeypatch):
    """On the V1 runner a save the store never shows counts as a failed save once the scheduler
    stops waiting for it (here at once), and not as a save."""
    from ectier.errors import EctierError
    from ectier_vllm import confirm

    monkeypatch.setattr(confirm, "CONFIRM_TIMEOUT_S", 0.0)
    sched, worker = v1_producer(model_dir, tmp_path, monkeypatch)
    try:
        def broken(key, tensor):
            raise EctierError("injected put failure")

        monkeypatch.setattr(ct.store(worker.connector), "put", broken)
        sched.add_request(H.make_request("p", [H.Item("y" * 64, 0, 30)]))
        _, out = run_step(sched, worker)
        counted = out[0].scheduler_stats.ec_connector_stats
        assert counted["save_failures"] == 1 and "saves" not in counted
    finally:
        worker.connector.shutdown()
        sched.ec_connector.shutdown()


def test_v1_producer_stops_counting_once_worker_reports_arrive(model_dir, tmp_path, monkeypatch):
    """Should the workers' reports reach the scheduler after all, their counts are used and the
    scheduler's own count stops: a save is never counted twice."""
    from vllm.v1.outputs import ECConnectorOutput

    from ectier_vllm.metadata import ECTierWorkerMetadata

    sched, worker = v1_producer(model_dir, tmp_path, monkeypatch)
    try:
        item = H.Item("z" * 64, 0, 30)
        sched.add_request(H.make_request("p", [item]))
        so = sched.schedule()
        assert so.scheduled_encoder_inputs == {"p": [0]}
        worker.execute(so)  # saved; vLLM's V1 runner drops the report ...
        report = ECTierWorkerMetadata(saved=[item.mm_hash], stats={"saves": 1, "save_bytes": 30 * H.WIDTH * 2})
        sched.ec_connector.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=report))  # ... not here
        counted = sched.ec_connector.get_ec_connector_stats().data
        assert counted["saves"] == 1 and counted["save_bytes"] == 30 * H.WIDTH * 2
    finally:
        worker.connector.shutdown()
        sched.ec_connector.shutdown()


@pytest.mark.parametrize("mode", ["inprocess", "daemon"])
def test_external_launcher_over_several_ranks_is_refused(model_dir, tmp_path, mode):
    """With ``external_launcher`` each rank runs a scheduler of its own. In-process, only the lead
    worker saves into its own store, so a later request was loaded on rank 0 and encoded on rank 1
    (shown with two rank processes): the ranks' schedules diverge. The connector refuses it."""
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

    from ectier.errors import ConfigError
    from ectier_vllm.connector import ECTierConnector
    from ectier_vllm.store import open_stores

    extra = inproc(tmp_path) if mode == "inprocess" else {"mode": "daemon", "socket_path": str(tmp_path / "d.sock")}
    cfg = H.make_vllm_config(model_dir, "ec_both", extra)
    cfg.parallel_config.distributed_executor_backend = "external_launcher"
    cfg.parallel_config.tensor_parallel_size = cfg.parallel_config.world_size = 2
    for role in (ECConnectorRole.SCHEDULER, ECConnectorRole.WORKER):
        with pytest.raises(ConfigError, match=r'"external_launcher" with a world size of 2 .* not supported.*'
                                              r'"mode": "daemon", or with one rank per engine'):
            ECTierConnector(cfg, role)
    assert open_stores() == 0
    cfg.parallel_config.tensor_parallel_size = cfg.parallel_config.world_size = 1  # one rank: accepted
    if mode == "inprocess":
        ECTierConnector(cfg, ECConnectorRole.SCHEDULER).shutdown()
        assert open_stores() == 0
        # a pure producer never loads: its ranks cannot answer differently, so it may run so
        producer = H.make_vllm_config(model_dir, "ec_producer", extra)
        producer.parallel_config.distributed_executor_backend = "external_launcher"
        producer.parallel_config.tensor_parallel_size = producer.parallel_config.world_size = 2
        ECTierConnector(producer, ECConnectorRole.SCHEDULER).shutdown()
        assert open_stores() == 0
