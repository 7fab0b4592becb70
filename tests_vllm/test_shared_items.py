"""One item needed by several requests of one step, through vLLM 0.33's real scheduler: vLLM calls
``update_state_after_alloc`` for the first of them only, so the connector itself must know every
request that runs on the item's load (``scheduler.py``, ``_add_sharers``)."""

from __future__ import annotations

import harness as H
from conftest import run_step
from ectier_vllm import testing as ct


def _inproc():
    return {"namespace": "shared", "host": {"capacity_bytes": "8MiB", "block_bytes": "64KiB", "pin_memory": False}}


def _finished(engine_out) -> set[str]:
    return {o.request_id for outs in engine_out.values() for o in outs.outputs if o.finish_reason is not None}


def test_a_failed_load_fails_every_request_of_the_step_that_shares_the_item(engine, monkeypatch):
    """Two requests of one step need one item and its load fails at the worker (here: the store
    answers one row short; in production a daemon restarted, a device out of memory). Only the
    first request was failed: the second ran its prefill on the zero placeholder and went on,
    its output silently wrong."""
    from vllm.v1.request import RequestStatus

    item = H.Item("s" * 64, 0, 40)
    sched, worker = engine("ec_consumer", _inproc())
    ct.store(sched.ec_connector).put(item.mm_hash, H.encoder_output(item.mm_hash, item.length))
    real_get = ct.store(worker.connector).get
    monkeypatch.setattr(ct.store(worker.connector), "get", lambda key, device: real_get(key, device)[:-1])
    sched.add_request(H.make_request("r1", [item], max_tokens=8))
    sched.add_request(H.make_request("r2", [item], max_tokens=8))
    so, out = run_step(sched, worker)
    assert {r.req_id for r in so.scheduled_new_reqs} == {"r1", "r2"}  # both prefilled over the placeholder
    assert sorted(so.ec_connector_metadata.loads[0].req_ids) == ["r1", "r2"]
    failed = _finished(out)
    for _ in range(3):
        so, out = run_step(sched, worker)
        failed |= _finished(out)
    assert failed >= {"r1", "r2"}, f"only {failed} failed; the other ran on a zero placeholder"
    for req_id in ("r1", "r2"):
        assert req_id not in sched.requests or sched.requests[req_id].status == RequestStatus.FINISHED_ERROR


def test_a_request_waiting_on_the_item_in_a_later_step_is_not_failed_with_it(engine, monkeypatch):
    """Only the requests scheduled in the failed load's step go with it: one that joins the item
    later loads it again, once the load works."""
    item = H.Item("t" * 64, 0, 40)
    sched, worker = engine("ec_consumer", _inproc())
    ref = H.encoder_output(item.mm_hash, item.length)
    ct.store(sched.ec_connector).put(item.mm_hash, ref)
    real_get = ct.store(worker.connector).get
    monkeypatch.setattr(ct.store(worker.connector), "get", lambda key, device: real_get(key, device)[:-1])
    sched.add_request(H.make_request("r1", [item], max_tokens=8))
    so, out = run_step(sched, worker)
    assert [it.req_ids for it in so.ec_connector_metadata.loads] == [["r1"]]
    monkeypatch.undo()
    sched.add_request(H.make_request("r3", [item], max_tokens=8))
    failed = _finished(out)
    for _ in range(3):
        so, out = run_step(sched, worker)
        failed |= _finished(out)
    assert "r1" in failed and "r3" not in failed, failed


def test_a_request_whose_chunk_stops_before_the_item_is_not_failed_with_its_load(engine, monkeypatch):
    """Chunked prefill: r1 holds the item's pin for a later chunk (the item at token 1200, 900
    tokens scheduled this step) while r2's load of the item fails. Only r2 ran on the
    placeholder; r1 reaches the item in a later chunk, which loads it again."""
    near, far = H.Item("a" * 64, 0, 40), H.Item("a" * 64, 1200, 40)
    sched, worker = engine("ec_consumer", _inproc(), max_num_batched_tokens=1000)
    ct.store(sched.ec_connector).put(near.mm_hash, H.encoder_output(near.mm_hash, 40))
    real_get = ct.store(worker.connector).get
    monkeypatch.setattr(ct.store(worker.connector), "get", lambda key, device: real_get(key, device)[:-1])
    sched.add_request(H.make_request("r2", [near], prompt_len=100, max_tokens=8))
    sched.add_request(H.make_request("r1", [far], prompt_len=1500, max_tokens=8))
    so, out = run_step(sched, worker)
    assert 0 < so.num_scheduled_tokens.get("r1", 0) < 1200  # r1's chunk stops before the item
    assert [it.req_ids for it in so.ec_connector_metadata.loads] == [["r2"]]
    monkeypatch.undo()
    failed = _finished(out)
    for _ in range(6):
        so, out = run_step(sched, worker)
        failed |= _finished(out)
    assert "r2" in failed and "r1" not in failed, failed
