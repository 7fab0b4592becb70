"""ECTierConnector's metrics as vLLM consumes them: Prometheus through vLLM's ECConnectorProm, the
stats log line through ECConnectorLogging, worker reports aggregated across workers. (What the
counters add up to in the real scheduler: test_metrics_counts.py.)"""

from __future__ import annotations

import harness as H
from conftest import run_step
from connector_helpers import inproc
from ectier_vllm import testing as ct


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


def test_stats_reach_vllms_ec_connector_logging(engine, tmp_path):
    """The scheduler's stats dict (SchedulerStats.ec_connector_stats) is what vLLM's logger process
    feeds to ECConnectorLogging, which rebuilds our stats class through the connector factory."""
    from vllm.distributed.ec_transfer.ec_connector.metrics import ECConnectorLogging

    item = H.Item("r" * 64, 0, 40)
    sched, worker = engine("ec_both", inproc(tmp_path))
    ct.store(sched.ec_connector).put(item.mm_hash, H.encoder_output(item.mm_hash, 40))
    sched.add_request(H.make_request("c", [item, H.Item("s" * 64, 50, 10)]))
    _, out = run_step(sched, worker)
    logging = ECConnectorLogging(sched.vllm_config.ec_transfer_config)
    logging.observe(out[0].scheduler_stats.ec_connector_stats)
    lines = []
    logging.log(lambda fmt, *args: lines.append(fmt % args))
    assert len(lines) == 1
    assert "hits=1" in lines[0] and "misses=1" in lines[0] and "loads=1" in lines[0]
    assert f"load_bytes={40 * H.WIDTH * 2}" in lines[0] and "hit_rate=0.5" in lines[0]
