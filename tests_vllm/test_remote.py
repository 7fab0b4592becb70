"""The connector owns a remote tier (#13 item 6): ``ec_connector_extra_config.remote`` takes the
YAML config's ``remote:`` fields; an encoder engine's saves are written through to it, and a
prefill/decode engine on another node (here: another TieredCache on the same
``ectier.testing.MemoryBackend``) that misses locally fetches the entry from it without blocking
its scheduler: the request waits ("not yet") until the fetch landed, then loads it."""

from __future__ import annotations

import functools
import time

import pytest
import torch

import harness as H
from conftest import run_step
from ectier import testing
from ectier_vllm import testing as ct

NS = "remote-ns"
REMOTE = {"backend": "redis", "addresses": "127.0.0.1:1", "timeout_s": 10}  # the backend is replaced below
DELAY_S = 1.5  # each remote call of the slowed store


@pytest.fixture
def remote_store():
    """One remote store shared by every in-process cache opened afterwards (the nodes)."""
    backend = testing.MemoryBackend()
    with ct.cache_factory(functools.partial(testing.make_cache, remote_backend=backend)):
        yield backend


def node(host_mib: int) -> dict:
    return {"namespace": NS, "host": {"capacity_bytes": f"{host_mib}MiB", "block_bytes": "64KiB", "pin_memory": False},
            "remote": dict(REMOTE)}


def produce(engine, items) -> dict[str, torch.Tensor]:
    sched, worker = engine("ec_producer", node(4))
    sched.add_request(H.make_request("p", items))
    run_step(sched, worker)
    ct.cache(worker.connector).flush()  # the remote write-throughs ran
    return {h: t.clone() for h, t in worker.encoder_cache.items()}


def test_a_local_miss_is_fetched_from_the_remote_tier_without_blocking_the_scheduler(engine, remote_store):
    items = [H.Item("r" * 64, 0, 48), H.Item("q" * 64, 100, 20)]
    produced = produce(engine, items)
    assert remote_store.objects, "the producer's saves were not written through"
    remote_store.delay_s = DELAY_S  # a slow remote store (another node, a busy network)
    sched, worker = engine("ec_consumer", node(8))
    cache = ct.cache(sched.ec_connector)
    assert not any(cache.contains(i.mm_hash) for i in items)  # a local miss on this node
    sched.add_request(H.make_request("c", items + [H.Item("nobody" * 8, 200, 10)]))
    steps, scheduled, deadline = 0, False, time.monotonic() + 20 * DELAY_S
    while not scheduled:
        assert time.monotonic() < deadline, "the remote fetch never finished"
        t0 = time.monotonic()
        so = sched.schedule()
        assert time.monotonic() - t0 < DELAY_S / 3, "schedule() waited on the remote store"
        scheduled = "c" in {r.req_id for r in so.scheduled_new_reqs}
        sched.update_from_output(so, worker.execute(so))
        steps += 1
        time.sleep(0.05)
    assert steps > 1  # "not yet" while the fetch was in flight
    assert so.scheduled_encoder_inputs == {"c": [2]}  # only the item no node stored is encoded
    for h, t in produced.items():
        got = worker.encoder_cache[h]
        assert torch.equal(got.view(torch.int16), t.view(torch.int16))
        assert cache.contains(h)  # promoted into this node's host tier


def test_remote_key_is_refused_in_daemon_mode_and_checked_in_process(model_dir):
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

    from ectier.errors import ConfigError
    from ectier_vllm.connector import ECTierConnector

    cfg = H.make_vllm_config(model_dir, "ec_consumer", {"mode": "daemon", "remote": dict(REMOTE)})
    with pytest.raises(ConfigError, match=r"ec_connector_extra_config\.remote: not used in daemon mode"):
        ECTierConnector(cfg, ECConnectorRole.SCHEDULER)
    cfg = H.make_vllm_config(model_dir, "ec_consumer", {"remote": {"backend": "redis"}})
    with pytest.raises(ConfigError, match=r"ec_connector_extra_config\.remote\.addresses"):
        ECTierConnector(cfg, ECConnectorRole.SCHEDULER)
