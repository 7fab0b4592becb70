"""GPU tier copies, run on the CPU (no CUDA needed): the copy engines, copies in flight, threads.

``ectier.testing.make_cache(config, copy_engine=..., gpu_device="cpu")`` puts the GPU
tier's arena in CPU memory and routes every copy through the given engine:

- :class:`~ectier.copy.InlineCopyEngine` copies at once;
- :class:`~ectier.copy.DeferredCopyEngine` runs copies only when the test says so (in submission
  order, as one CUDA stream would): in-flight visibility, overwrite and delete while in flight,
  failed copies — deterministically, without sleeps;
- :class:`~ectier.copy.CudaCopyEngine` against a fake ``torch.cuda`` (the order of its calls).

With the hook a CPU tensor stands for a tensor on the GPU tier's device. Puts, evictions,
promotions and prefetch: test_gpu_tier_cpu.py. Helpers: tests/gpu_tier_helpers.py.
"""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from conftest import MiB, check_quiescent, filled, raw_bytes
from gpu_tier_helpers import BLOCK, cache_opener, cfg, pumping, where
from ectier import GpuTierConfig, InvalidDeviceError
from ectier.copy import Completer, CopyHandle, CudaCopyEngine, InlineCopyEngine
from ectier.testing import DeferredCopyEngine
from ectier.entry import entry_digest
from ectier import testing, testing_internals


@pytest.fixture
def open_cache():
    with cache_opener() as make:
        yield make


# ------------------------------------------------------------------------------ copy engines


def _until_queued(e: DeferredCopyEngine, n: int, timeout_s: float = 10.0) -> None:
    """Wait until ``n`` batches are pending on ``e`` (a reader thread has queued its copy): a
    fixed join(0.1) let ``e.complete()`` run before a late-scheduled reader queued it."""
    deadline = time.monotonic() + timeout_s
    while e.pending < n:
        assert time.monotonic() < deadline, f"{e.pending} copies queued after {timeout_s} s, expected {n}"
        time.sleep(0.002)


def test_inline_engine_copies_at_once_and_reports_errors_in_the_handle():
    e = InlineCopyEngine()
    dst, src = torch.zeros(8, dtype=torch.uint8), torch.arange(8, dtype=torch.uint8)
    h = e.copy([(dst, src)], lane="d2h")
    assert h.done() and h.wait(0) and h.error is None and dst.tolist() == list(range(8))
    bad = e.copy([(torch.zeros(4, dtype=torch.uint8).expand(2, 4)[0], torch.zeros(4, dtype=torch.uint8))],
                 lane="h2d")
    assert bad.done()
    with pytest.raises(ValueError, match="lane"):
        e.copy([(dst, src)], lane="sideways")
    with pytest.raises(ValueError, match="destination of 4 bytes, source of 8"):
        e.copy([(dst[:4], src)], lane="d2h")


def test_deferred_engine_runs_in_order_only_when_told_and_poisons_failures():
    e = DeferredCopyEngine()
    a, b = torch.zeros(4, dtype=torch.uint8), torch.zeros(4, dtype=torch.uint8)
    h1 = e.copy([(a, torch.full((4,), 1, dtype=torch.uint8))], lane="arena")
    h2 = e.copy([(a, torch.full((4,), 2, dtype=torch.uint8))], lane="arena")
    assert not h1.done() and not h1.wait(0.01) and a.sum() == 0 and e.pending == 2
    assert e.complete(1) == 1 and h1.done() and not h2.done() and a.tolist() == [1] * 4
    e.complete()
    assert a.tolist() == [2] * 4
    e.fail_with = RuntimeError("boom")
    h3 = e.copy([(b, torch.full((4,), 7, dtype=torch.uint8))], lane="d2h")
    e.complete()
    assert h3.done() and isinstance(h3.error, RuntimeError) and b.tolist() == [0xA5] * 4


def test_cuda_engine_refuses_cpu_and_missing_devices():
    with pytest.raises(InvalidDeviceError, match="cuda:<index>"):
        CudaCopyEngine("cpu")
    with pytest.raises(InvalidDeviceError):
        CudaCopyEngine("cuda:99")


def test_completer_runs_callbacks_in_order_after_their_copies_and_survives_a_failing_one():
    e = DeferredCopyEngine()
    comp = Completer()
    ran = []
    hs = [e.copy([], lane="d2h") for _ in range(3)]
    comp.submit(hs[0], lambda: ran.append(0))
    comp.submit(hs[1], lambda: 1 / 0)
    comp.submit(hs[2], lambda: ran.append(2))
    assert not comp.drain(0.05) and ran == [] and comp.outstanding == 3
    e.complete()
    assert comp.drain(5) and ran == [0, 2]
    assert comp.close(5)
    comp.close(5)  # idempotent


def test_completer_turns_a_failing_wait_into_a_failed_copy():
    class Broken(CopyHandle):
        def wait(self, timeout_s=None):
            raise RuntimeError("CUDA error: an illegal memory access (injected)")

    comp, seen = Completer(), []
    h = Broken()
    comp.submit(h, lambda: seen.append(h.error))
    assert comp.close(5)
    assert len(seen) == 1 and isinstance(seen[0], RuntimeError) and h.done()


# ---------------------------------------------------------------------- in flight (deferred)


def test_async_host_put_is_invisible_until_its_copy_completes_and_get_waits_for_it(open_cache):
    e = DeferredCopyEngine()
    config = cfg(gpu_blocks=1)
    c = testing.make_cache(config.replace(gpu=GpuTierConfig()), copy_engine=e)  # no GPU tier: async host puts
    try:
        t = filled(2 * BLOCK, 3)
        h = c.put("k", t)
        assert not h.done() and not h.wait(0.01)
        assert "k" in c and c.stats()["in_flight"] == 1
        assert testing.tier(c, "host").index.lookup(entry_digest("test", "k")) is None  # not committed
        testing.tier(c, "host").buffer.fill_(0xEE)  # poison the arena: a premature read would show it
        got = []
        reader = threading.Thread(target=lambda: got.append(c.get("k")))
        reader.start()
        reader.join(0.1)
        assert reader.is_alive() and not got, "get returned before the copy completed"
        e.complete()
        reader.join(5)
        assert h.wait(5) and h.error is None
        assert raw_bytes(got[0]) == raw_bytes(t)
        assert c.stats()["in_flight"] == 0 and c.stats()["tiers"]["host"]["puts"] == 1
        check_quiescent(c)
    finally:
        e.complete()
        c.close()


def test_overwrite_and_delete_while_in_flight_never_resurrect_old_bytes(open_cache):
    e = DeferredCopyEngine()
    c = testing.make_cache(cfg().replace(gpu=GpuTierConfig()), copy_engine=e)
    try:
        v1, v2 = filled(BLOCK, 1), filled(BLOCK, 2)
        h1, h2 = c.put("k", v1), c.put("k", v2)
        e.complete()
        assert h1.wait(5) and h2.wait(5)
        assert raw_bytes(c.get("k")) == raw_bytes(v2)
        # a put in flight, then a delete: the delete wins
        h3 = c.put("k", filled(BLOCK, 3))
        assert c.delete("k")
        e.complete()
        assert h3.wait(5)
        assert c.get("k") is None and "k" not in c
        check_quiescent(c)
    finally:
        e.complete()
        c.close()


def test_failed_copy_is_a_miss_and_keeps_the_previous_version(open_cache):
    e = DeferredCopyEngine()
    c = testing.make_cache(cfg().replace(gpu=GpuTierConfig()), copy_engine=e)
    try:
        v1 = filled(BLOCK, 1)
        c.put("k", v1)
        e.complete()
        e.fail_with = RuntimeError("copy failed (injected)")
        h = c.put("k", filled(BLOCK, 2))
        e.complete()
        assert h.wait(5) is False and isinstance(h.error, RuntimeError) and "failed" in repr(h)
        assert raw_bytes(c.get("k")) == raw_bytes(v1)
        e.fail_with = RuntimeError("again")
        h = c.put("new", filled(BLOCK, 3))
        e.complete()
        assert not h.wait(5) and c.get("new") is None and "new" not in c
        assert c.stats()["copy_failures"] == 2
        check_quiescent(c)
    finally:
        e.complete()
        c.close()


def test_gpu_put_in_flight_is_served_after_its_write_and_a_failed_write_is_a_miss(open_cache):
    e = DeferredCopyEngine()
    c = open_cache(cfg(gpu_blocks=2, host_blocks=4), e)
    t = filled(BLOCK, 7)
    h = c.put("k", t)
    assert not h.done()
    got = []
    reader = threading.Thread(target=lambda: got.append(c.get("k")))
    reader.start()
    _until_queued(e, 2)  # its read is queued behind the write on the arena lane
    reader.join(0.1)
    assert reader.is_alive()
    e.complete()
    reader.join(5)
    assert h.wait(5) and raw_bytes(got[0]) == raw_bytes(t)
    # a failed write into the GPU arena: the entry is dropped, never served as garbage
    e.fail_with = RuntimeError("injected")
    h = c.put("bad", filled(BLOCK, 8))
    e.complete()
    assert not h.wait(5)
    with pumping(e):
        assert c.get("bad") is None
    assert c.stats()["tiers"]["gpu"]["copy_failures"] >= 1
    check_quiescent(c)


def test_gpu_demotion_in_flight_is_waited_for_by_get(open_cache):
    e = DeferredCopyEngine()
    c = open_cache(cfg(gpu_blocks=1, host_blocks=4), e)
    a, b = filled(BLOCK, 1), filled(BLOCK, 2)
    c.put("a", a)
    c.put("b", b)  # a's D2H demotion is queued behind a's write; b's write behind it
    assert c.stats()["in_flight"] == 1 and "a" in c
    got = []
    reader = threading.Thread(target=lambda: got.append(c.get("a")))
    reader.start()
    reader.join(0.1)
    assert reader.is_alive()
    while reader.is_alive():
        e.complete()
        reader.join(0.01)
    assert raw_bytes(got[0]) == raw_bytes(a)
    with pumping(e):
        assert raw_bytes(c.get("b", device="cpu")) == raw_bytes(b)


@pytest.mark.parametrize("copy", ["completes", "fails"])
def test_a_gpu_demotion_is_counted_when_its_copy_completes_as_what_it_became(open_cache, copy):
    """A GPU victim's D2H demotion counts an eviction when it is enqueued, and a demotion (its
    copy completed) or a drop (its copy failed: the entry is gone) only when the copy ends. It
    used to count a demotion at once, also for an entry its failed copy then lost."""
    e = DeferredCopyEngine()
    c = open_cache(cfg(gpu_blocks=1, host_blocks=4), e)
    c.put("a", filled(BLOCK, 1))
    e.complete()
    c.put("b", filled(BLOCK, 2))  # a's demotion is enqueued behind nothing; b's write behind it
    gpu = c.stats()["tiers"]["gpu"]
    assert (gpu["evictions"], gpu["demotions"], gpu["drops"]) == (1, 0, 0)
    if copy == "fails":
        e.fail_with = RuntimeError("injected D2H failure")
    e.complete()
    deadline = time.monotonic() + 10  # the completer thread commits (or drops) the copy's entry
    while c.stats()["in_flight"] and time.monotonic() < deadline:
        time.sleep(0.002)
    gpu = c.stats()["tiers"]["gpu"]
    want = (1, 0) if copy == "completes" else (0, 1)
    assert (gpu["demotions"], gpu["drops"]) == want, gpu
    assert ("a" in c) == (copy == "completes")
    check_quiescent(c)


def test_close_waits_for_copies_in_flight(tmp_path):
    e = DeferredCopyEngine()
    c = testing.make_cache(cfg().replace(gpu=GpuTierConfig()), copy_engine=e)
    h = c.put("k", filled(BLOCK, 1))
    closer = threading.Thread(target=c.close)
    closer.start()
    closer.join(0.1)
    assert closer.is_alive() and not h.done()
    e.complete()
    closer.join(5)
    assert not closer.is_alive() and h.wait(0)


def test_a_read_queued_behind_a_failing_gpu_write_is_a_miss_not_garbage(open_cache):
    e = DeferredCopyEngine()
    c = open_cache(cfg(gpu_blocks=2, host_blocks=4), e)
    h = c.put("k", filled(BLOCK, 1))
    got = []
    reader = threading.Thread(target=lambda: got.append(c.get("k")))
    reader.start()
    _until_queued(e, 2)  # the write, then the read behind it
    reader.join(0.1)
    assert reader.is_alive() and e.pending == 2
    e.fail_with = RuntimeError("injected")  # the write fails and poisons its destination
    e.complete()
    reader.join(5)
    assert got == [None] and not h.wait(5)
    check_quiescent(c)


def test_a_gpu_entry_whose_write_failed_is_not_demoted_as_poison(open_cache):
    """The GPU write of "a" fails (its blocks hold poison) after "a" was already chosen as a victim
    and its demotion copy queued behind the write: the host tier must not commit those bytes."""
    e = DeferredCopyEngine()
    c = open_cache(cfg(gpu_blocks=2, host_blocks=4), e)
    ha = c.put("a", filled(BLOCK, 1))
    hb = c.put("b", filled(2 * BLOCK, 2))  # needs the whole GPU budget: "a" is demoted
    assert e.pending >= 3  # a's write, a's demotion copy, b's write
    e.fail_with = RuntimeError("injected")
    e.complete(1)  # a's write fails, poisoning its blocks
    e.complete()
    assert hb.wait(5) and not ha.wait(5)
    assert "host" not in where(c, "a"), "the poisoned GPU blocks were committed to the host tier"
    with pumping(e):
        got = c.get("a")
    assert got is None or raw_bytes(got) == raw_bytes(filled(BLOCK, 1)), "poison was served"
    check_quiescent(c)


def test_a_failed_promotion_copy_is_served_from_the_host_copy(open_cache):
    class FailArenaWrites(InlineCopyEngine):
        armed = False
        gpu_arena = -1

        def copy(self, pairs, *, lane):
            into_gpu = bool(pairs) and pairs[0][0].untyped_storage().data_ptr() == self.gpu_arena
            if self.armed and into_gpu:
                self.armed = False
                for dst, _ in pairs:
                    dst.fill_(0xA5)  # what a failed copy may leave behind
                return testing_internals.failed_copy(RuntimeError("injected copy failure"))
            return super().copy(pairs, lane=lane)

    e = FailArenaWrites()
    c = open_cache(cfg(gpu_blocks=1, host_blocks=4), e)
    a = filled(BLOCK, 1)
    c.put("a", a)
    c.put("b", filled(BLOCK, 2))  # a -> host
    assert where(c, "a") == {"host"}
    e.gpu_arena = testing.tier(c, "gpu").buffer.untyped_storage().data_ptr()
    e.armed = True  # the promotion's host -> arena copy fails (not the demotion it causes)
    assert raw_bytes(c.get("a")) == raw_bytes(a)
    assert c.stats()["tiers"]["gpu"]["copy_failures"] >= 1 and "host" in where(c, "a")
    check_quiescent(c)


# --------------------------------------------------------------------------- threads at once


def test_threads_with_copies_completing_asynchronously_stay_consistent(open_cache, tmp_path):
    """Four threads put/get/delete/prefetch overlapping keys while a pump thread completes the
    copies late and in order (a live GPU): every hit is bytes of some put of that key, nothing
    deadlocks, and the idle cache is consistent."""
    e = DeferredCopyEngine()
    c = open_cache(cfg(tmp_path, gpu_blocks=3, host_blocks=4, nvme_bytes=4 * MiB), e)
    written: dict[str, set[bytes]] = {f"k{i}": set() for i in range(6)}
    lock = threading.Lock()
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for step in range(60):
                k = f"k{rng.randrange(6)}"
                op = rng.random()
                if op < 0.4:
                    t = filled(rng.choice([100, BLOCK, BLOCK + 9]), seed * 1000 + step)
                    with lock:
                        written[k].add(raw_bytes(t))
                    c.put(k, t)
                elif op < 0.8:
                    got = c.get(k)
                    if got is not None:
                        with lock:
                            assert raw_bytes(got) in written[k], (seed, step, k)
                elif op < 0.9:
                    c.prefetch([k], device="cpu")[0].wait(10)
                else:
                    c.delete(k)
        except BaseException as exc:  # noqa: BLE001 - re-raised in the test thread
            errors.append(exc)

    with pumping(e):
        threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads), "deadlock"
        testing.drain(c, 10)
    assert not errors, errors[0]
    check_quiescent(c)


# -------------------------------------- the CUDA engine's call order, with a fake torch.cuda


class _FakeCuda:
    """Records the order of the stream/event calls CudaCopyEngine makes (copies run on CPU)."""

    def __init__(self, log):
        self.log = log
        fake = self

        class Event:
            n = 0

            def __init__(self, enable_timing=False, blocking=False):
                Event.n += 1
                self.name, self.blocking, self.recorded = f"E{Event.n}", blocking, False

            def record(self, stream=None):
                fake.log.append(("record", self.name, (stream or fake.current).name))
                self.recorded = True

            def query(self):
                return self.recorded

            def synchronize(self):
                fake.log.append(("synchronize", self.name))

        class Stream:
            n = 0

            def __init__(self, device=None, priority=0):
                Stream.n += 1
                self.name = f"S{Stream.n}"

            def wait_event(self, ev):
                fake.log.append(("wait_event", self.name, ev.name))

        class _Ctx:
            def __init__(self, stream=None):
                self.stream, self.prev = stream, None

            def __enter__(self):
                if self.stream is not None:
                    self.prev, fake.current = fake.current, self.stream
                return self

            def __exit__(self, *exc):
                if self.stream is not None:
                    fake.current = self.prev

        self.Event, self.Stream = Event, Stream
        self.current = Stream()
        self.current.name = "producer"
        self.stream = _Ctx
        self.device = lambda dev: _Ctx()
        self.current_stream = lambda dev=None: fake.current


def test_cuda_engine_orders_copies_after_the_producer_and_before_the_consumer(monkeypatch):
    log: list = []
    fake = _FakeCuda(log)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    for name in ("Event", "Stream", "stream", "device", "current_stream"):
        monkeypatch.setattr(torch.cuda, name, getattr(fake, name))
    orig_copy = torch.Tensor.copy_

    def spy_copy(dst, src, non_blocking=False):
        log.append(("copy", fake.current.name, non_blocking))
        return orig_copy(dst, src)

    monkeypatch.setattr(torch.Tensor, "copy_", spy_copy)
    engine = CudaCopyEngine("cuda:0", streams_per_direction=2)
    d2h = [s.name for s in engine.streams("d2h")]
    dst, src = torch.zeros(8, dtype=torch.uint8), torch.arange(8, dtype=torch.uint8)
    log.clear()
    h = engine.copy([(dst, src)], lane="d2h")
    ready, lane = log[0][1], log[1][1]
    assert log[0] == ("record", ready, "producer")  # rule 1: an event on the producer's stream ...
    assert log[1] == ("wait_event", lane, ready) and lane in d2h  # ... waited on by the lane
    assert log[2] == ("copy", lane, True)  # the copy runs on the lane, asynchronously
    assert log[3][0] == "record" and log[3][2] == lane  # completion event on the lane
    done_event = log[3][1]
    h.wait_stream(torch.device("cuda:0"))
    assert log[4] == ("wait_event", "producer", done_event)  # rule 4: consumer waits, no host sync
    assert h.done() and dst.tolist() == list(range(8))
    engine.copy([(dst, src)], lane="d2h")
    assert log[6][1] != lane  # round robin over the lane's streams
    assert ("synchronize", done_event) not in log
