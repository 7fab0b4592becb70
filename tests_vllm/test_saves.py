"""Saves off the model step (#14 item 2): ``save_caches`` hands each item to the connector's
background put thread and returns; a slow store (a daemon put behind a write-through NVMe
commit, an in-process write-through to a slow disk) delays the save's completion, never the
model step. A full queue drops the save (counted, one warning); the save is reported only once
the store holds the item."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import harness as H
from ectier import testing
from ectier_vllm import testing as ct

NS = "test-ns"
STALL_S = 5.0  # how long the stand-in slow store holds each put
STEP_BOUND_S = STALL_S / 5  # a model step that waited for the put would take at least STALL_S


@pytest.fixture
def gated_puts(monkeypatch):
    """``DaemonClient.put`` held until the test opens the gate (at most STALL_S): a daemon whose
    puts are slow (reserve, copy, a write-through commit). ``entered`` is set once a put waits."""
    from ectier.daemon.client import DaemonClient

    gate, entered = threading.Event(), threading.Event()
    original = DaemonClient.put

    def slow_put(self, key, tensor, **kw):
        entered.set()
        gate.wait(STALL_S)
        return original(self, key, tensor, **kw)

    monkeypatch.setattr(DaemonClient, "put", slow_put)
    yield gate, entered
    gate.set()


def saved_of(worker) -> list[str]:
    meta = worker.connector.build_connector_worker_meta()
    return [] if meta is None else list(meta.saved)


def test_a_slow_daemon_put_never_blocks_the_model_step(engine, daemon, gated_puts):
    """The daemon's put takes STALL_S; the producer's step (encode + save_caches + the report)
    returns far sooner, the save is not reported while the put runs, and is once it committed."""
    gate, entered = gated_puts
    extra = {"mode": "daemon", "socket_path": daemon.socket_path, "namespace": NS}
    sched, worker = engine("ec_producer", extra)
    worker.settle_saves = False
    item = H.Item("s" * 64, 0, 64)
    sched.add_request(H.make_request("p", [item]))
    so = sched.schedule()
    t0 = time.monotonic()
    out = worker.execute(so)
    step_s = time.monotonic() - t0
    assert step_s < STEP_BOUND_S, f"the model step took {step_s:.2f} s: it waited for the daemon's put"
    assert worker.encoded == [item.mm_hash]
    assert entered.wait(STALL_S)  # the put is running, in the background
    sched.update_from_output(so, out)
    assert saved_of(worker) == []  # not committed yet: not reported
    assert not ct.daemon_client(sched.ec_connector).contains(item.mm_hash, namespace=NS)
    gate.set()
    assert worker.connector.saves.wait(30)
    assert saved_of(worker) == [item.mm_hash]
    assert ct.daemon_client(sched.ec_connector).contains(item.mm_hash, namespace=NS)


def test_a_full_save_queue_drops_the_save_counted_with_one_warning(engine, daemon, gated_puts, monkeypatch):
    """save_queue_depth=1 and a put that hangs: the first save runs, the second waits in the
    queue, the third and fourth are dropped at once (save failures, one warning line), and the
    two accepted ones are stored once the put goes on."""
    import ectier_vllm.connector as conn_mod

    lines: list[str] = []
    monkeypatch.setattr(conn_mod.logger, "warning", lambda fmt, *a, **kw: lines.append(fmt % a))
    gate, entered = gated_puts
    extra = {"mode": "daemon", "socket_path": daemon.socket_path, "namespace": NS, "save_queue_depth": 1}
    _, worker = engine("ec_producer", extra)
    conn = worker.connector
    keys = [f"{i}" * 64 for i in range(4)]
    cache = {k: H.encoder_output(k, 16) for k in keys}
    conn.save_caches(cache, keys[0])
    assert entered.wait(STALL_S)  # the thread holds the first
    t0 = time.monotonic()
    for k in keys[1:]:
        conn.save_caches(cache, k)
    assert time.monotonic() - t0 < STEP_BOUND_S
    meta = conn.build_connector_worker_meta()
    assert meta.save_failed == keys[2:] and meta.stats["save_failures"] == 2
    dropped = [ln for ln in lines if "save_queue_depth" in ln]
    assert len(dropped) == 1, lines  # rate-limited: one line for both
    gate.set()
    assert conn.saves.wait(30)
    assert sorted(saved_of(worker)) == sorted(keys[:2])


class SlowWrites:
    """An LMDB environment whose write transactions start ``delay_s`` late (a slow disk)."""

    def __init__(self, env, delay_s: float) -> None:
        self._env, self._delay_s = env, delay_s

    def begin(self, **kw):
        if kw.get("write"):
            time.sleep(self._delay_s)
        return self._env.begin(**kw)

    def __getattr__(self, name):
        return getattr(self._env, name)


def test_inprocess_write_through_to_a_slow_disk_is_off_the_model_step(engine, tmp_path):
    """In-process, nvme.write_through: TieredCache.put of a CPU tensor writes NVMe before it
    returns; behind a disk taking STALL_S per write the step still returns at once, and the entry
    is stored (host and NVMe) and reported afterwards."""
    extra = {"namespace": NS, "host": {"capacity_bytes": "4MiB", "block_bytes": "64KiB", "pin_memory": False},
             "nvme": {"path": str(tmp_path / "nvme"), "capacity_bytes": "64MiB", "sync": False,
                      "write_through": True}}
    sched, worker = engine("ec_both", extra)
    worker.settle_saves = False
    cache = ct.cache(worker.connector)
    env = testing.lmdb_of(cache).env
    testing.set_lmdb_env(cache, SlowWrites(env, STALL_S))
    item = H.Item("w" * 64, 0, 40)
    sched.add_request(H.make_request("p", [item], max_tokens=1))
    so = sched.schedule()
    t0 = time.monotonic()
    out = worker.execute(so)
    step_s = time.monotonic() - t0
    assert step_s < STEP_BOUND_S, f"the model step took {step_s:.2f} s: it waited for the NVMe write"
    sched.update_from_output(so, out)
    assert worker.connector.saves.wait(30)
    testing.set_lmdb_env(cache, env)  # the disk is fast again (for the flush at shutdown)
    assert saved_of(worker) == [item.mm_hash]
    assert testing.holds(cache, "nvme", item.mm_hash)
    got = cache.get(item.mm_hash)
    assert torch.equal(got.view(torch.int16), worker.encoder_cache[item.mm_hash].view(torch.int16))


@pytest.fixture
def gated_inprocess_puts(monkeypatch):
    """``TieredCache.put`` held until the test opens the gate (at most STALL_S): an in-process
    store whose copy cannot finish (a blocked arena, a write-through behind a stuck disk)."""
    from ectier.cache import TieredCache

    gate, entered = threading.Event(), threading.Event()
    original = TieredCache.put

    def blocked_put(self, key, tensor, **kw):
        entered.set()
        gate.wait(STALL_S)
        return original(self, key, tensor, **kw)

    monkeypatch.setattr(TieredCache, "put", blocked_put)
    yield gate, entered
    gate.set()


def call_in_thread(fn, *args):
    """Run ``fn(*args)`` in a thread; returns the thread, joined for at most STALL_S (a call that
    waited for the blocked store would still be running then)."""
    t = threading.Thread(target=fn, args=args, daemon=True)
    t.start()
    t.join(STALL_S / 2)
    return t


def test_inprocess_save_of_a_cpu_tensor_never_waits_for_a_blocked_store(engine, gated_inprocess_puts):
    """In-process, a CPU encoder output: save_caches and the step's completion calls return while
    the store's put cannot finish (the tensor is handed to the put thread, not copied on the model
    step); the save is reported only once the store holds the item, with its bytes."""
    gate, entered = gated_inprocess_puts
    extra = {"namespace": NS, "host": {"capacity_bytes": "4MiB", "block_bytes": "64KiB", "pin_memory": False}}
    _, worker = engine("ec_producer", extra)
    conn = worker.connector
    key = "c" * 64
    cache = {key: H.encoder_output(key, 24)}
    t = call_in_thread(conn.save_caches, cache, key)
    assert not t.is_alive(), "save_caches waited for the store's put"
    assert entered.wait(STALL_S)  # the put runs, in the background, and cannot finish
    for _ in range(3):  # completion calls while the put is held: return, report nothing
        t = call_in_thread(conn.start_save_caches)
        assert not t.is_alive(), "start_save_caches waited for the store's put"
        assert conn.build_connector_worker_meta() is None
    from ectier_vllm.store import open_inprocess

    store = open_inprocess(conn.settings.cache)  # a handle on the connector's own in-process cache
    try:
        assert not store.contains(key) and conn.saves.pending() == 1
        gate.set()
        assert conn.saves.wait(30)
        meta = conn.build_connector_worker_meta()
        assert meta.saved == [key] and meta.stats["saves"] == 1 and meta.stats["save_bytes"] == 24 * H.WIDTH * 2
        got = store.cache.get(key)
        assert torch.equal(got.view(torch.int16), cache[key].view(torch.int16))
    finally:
        store.close()


def test_shutdown_with_saves_in_flight_stores_every_one(engine, daemon, gated_puts):
    """Daemon mode: three saves submitted while the daemon's put is held; shutdown, called while
    they wait, returns only once every one is committed (counted, none dropped): nothing lost."""
    gate, entered = gated_puts
    extra = {"mode": "daemon", "socket_path": daemon.socket_path, "namespace": NS}
    sched, worker = engine("ec_producer", extra)
    conn = worker.connector
    keys = [f"{i}" * 64 for i in range(3)]
    cache = {k: H.encoder_output(k, 8) for k in keys}
    for k in keys:
        conn.save_caches(cache, k)
    assert entered.wait(STALL_S)
    closing = threading.Thread(target=conn.shutdown, daemon=True)
    closing.start()
    closing.join(0.2)
    assert closing.is_alive(), "shutdown returned with saves still in flight"
    gate.set()
    closing.join(60)
    assert not closing.is_alive()
    assert conn.saves.pending() == 0
    from ectier.daemon.client import DaemonClient

    with DaemonClient(daemon.socket_path) as client:
        for k in keys:
            assert client.contains(k, namespace=NS), f"{k[:4]}... lost across shutdown"
            got = client.get(k, namespace=NS)
            assert torch.equal(got.view(torch.int16), cache[k].view(torch.int16))


class _Tripwire:
    """Stands in for the connector's save queue: any look into it fails the test."""

    def __getattr__(self, name):
        raise AssertionError(f"a completion call with nothing due looked into the save queue ({name})")


def test_a_completion_call_with_nothing_due_does_not_look_into_the_save_queue(engine):
    """Once a save is reported, the next steps' completion calls (``start_save_caches``,
    ``build_connector_worker_meta``) return after the connector's own flag (on the worker's
    thread every step, each look costs cold-cache time); a later save is reported as before."""
    extra = {"namespace": NS, "host": {"capacity_bytes": "4MiB", "block_bytes": "64KiB", "pin_memory": False}}
    _, worker = engine("ec_producer", extra)
    conn = worker.connector
    keys = ["d" * 64, "e" * 64]
    cache = {k: H.encoder_output(k, 8) for k in keys}

    def reported(key) -> bool:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            conn.start_save_caches()
            meta = conn.build_connector_worker_meta()
            if meta is not None and key in meta.saved:
                return True
            time.sleep(0.001)
        return False

    conn.save_caches(cache, keys[0])
    assert reported(keys[0])
    queue, conn.saves = conn.saves, _Tripwire()
    try:
        for _ in range(3):
            conn.start_save_caches()
            assert conn.build_connector_worker_meta() is None
    finally:
        conn.saves = queue
    conn.save_caches(cache, keys[1])
    assert reported(keys[1])
