"""GPU tests (``pytest -m gpu``): each CUDA trap (docs/architecture.md, CUDA ordering rules), reproduced against the cache.

Skipped cleanly without CUDA. Every test poisons what a wrong ordering would expose (destination
memory, a reused pinned slot, a freed source block) and compares bytes afterwards, and delays the
copy streams with ``torch.cuda._sleep`` where a race would otherwise be too short to see.
Run them with ``benchmarks/gpu_suite.py`` (one call: tests, benchmarks, table).
"""

from __future__ import annotations

import os

import pytest
import torch

from ectier import (
    CacheConfig,
    ConfigError,
    EctierError,
    GpuTierConfig,
    HostTierConfig,
    InvalidDeviceError,
    InvalidTensorError,
    TieredCache,
)
from ectier.copy import LANES, CudaCopyEngine
from ectier import testing

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

MiB = 1 << 20
DEV = "cuda:0"
SPIN = 50_000_000  # GPU clock cycles of torch.cuda._sleep: tens of ms, longer than any copy here


def source(nbytes: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device=DEV).manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=DEV, generator=g)


def host_cache(host_bytes=256 * MiB, **gpu) -> TieredCache:
    return TieredCache(CacheConfig(
        namespace="gpu-test",
        host=HostTierConfig(capacity_bytes=host_bytes, block_bytes=1 * MiB, pin_memory=True, admit_wait_s=5),
        gpu=GpuTierConfig(device=DEV, **gpu) if gpu else GpuTierConfig(),
    ))


def delay_lanes(cache: TieredCache, *lanes: str) -> None:
    """Make the engine's streams of ``lanes`` busy for a while (a copy enqueued now runs late)."""
    engine = testing.copy_engine_of(cache, DEV)
    for lane in lanes:
        for stream in engine.streams(lane):
            with torch.cuda.stream(stream):
                torch.cuda._sleep(SPIN)


# ------------------------------------------------------------------- trap 1: D2H read early


def test_put_then_get_never_reads_a_d2h_copy_before_its_event():
    cache = host_cache()
    try:
        testing.tier(cache, "host").buffer.fill_(0xEE)  # poison the pinned arena
        src = source(64 * MiB, 1)
        expected = src.cpu()
        delay_lanes(cache, "d2h")
        h = cache.put("k", src)
        assert not h.done()  # the copy is still queued behind the delay
        got = cache.get("k")  # waits for the in-flight put
        assert torch.equal(got.view(torch.uint8), expected)
        assert h.wait() and h.done()
    finally:
        cache.close()


# ------------------------------------------- trap 2: a side stream that does not wait its producer


def test_put_copies_what_the_producer_stream_wrote_last():
    cache = host_cache()
    try:
        src = torch.zeros(32 * MiB, dtype=torch.uint8, device=DEV)
        torch.cuda.synchronize()
        torch.cuda._sleep(SPIN)  # the producer is busy ...
        src.fill_(7)  # ... then writes the value that must be stored
        h = cache.put("k", src)
        assert h.wait()
        assert bool((cache.get("k") == 7).all())
    finally:
        cache.close()


# --------------------------------------------- trap 3: freeing the source during the copy


def test_source_freed_right_after_put_is_not_reused_before_the_copy_read_it():
    cache = host_cache()
    try:
        src = source(64 * MiB, 2)
        expected = src.cpu()
        delay_lanes(cache, "d2h")
        h = cache.put("k", src)
        del src  # the caching allocator would hand this block out again at once ...
        junk = torch.full((64 * MiB,), 0x55, dtype=torch.uint8, device=DEV)  # ... and this writes it
        assert h.wait()
        assert torch.equal(cache.get("k").view(torch.uint8), expected)
        del junk
    finally:
        cache.close()


# ---------------------------------------- trap 4: a pinned slot reused right after an H2D


def test_host_slot_is_not_reused_before_its_h2d_completed():
    cache = host_cache(host_bytes=64 * MiB)
    try:
        a = source(48 * MiB, 3)
        cache.put("a", a).wait()
        delay_lanes(cache, "h2d")
        got = cache.get("a", device=DEV)  # H2D enqueued behind the delay; the host slot stays pinned
        # a put that needs a's host blocks at once: it must wait for the H2D, not overwrite them
        assert cache.put("b", source(48 * MiB, 4)).wait()
        assert torch.equal(got, a)
    finally:
        cache.close()


def test_a_lease_released_right_after_its_load_keeps_the_slot_until_the_h2d_completed():
    cache = host_cache(host_bytes=64 * MiB)
    try:
        a = source(48 * MiB, 6)
        cache.put("a", a).wait()
        lease = cache.acquire("a")
        delay_lanes(cache, "h2d")
        got = cache.load(lease, device=DEV)  # H2D enqueued behind the delay
        cache.release(lease)  # acquire -> load -> release back to back, as documented
        # a put that needs a's host blocks at once: it must wait for the H2D, not overwrite them
        assert cache.put("b", source(48 * MiB, 7)).wait()
        assert torch.equal(got, a)
    finally:
        cache.close()


# ------------------------------------ trap 5: consuming on another stream than the load's


def test_result_is_ready_on_the_callers_current_stream_whatever_it_is():
    cache = host_cache()
    try:
        a = source(64 * MiB, 5)
        cache.put("a", a).wait()
        consumer = torch.cuda.Stream(DEV)
        with torch.cuda.stream(consumer):
            poison = torch.full((64 * MiB,), 0xEE, dtype=torch.uint8, device=DEV)
            del poison  # the next allocation on this stream gets the poisoned block
            delay_lanes(cache, "h2d")
            got = cache.get("a", device=DEV)
            copy = got.clone()  # runs on the consumer stream: must come after the load
        consumer.synchronize()
        assert torch.equal(copy, a)
    finally:
        cache.close()


# ------------------------------------------------------------------------------ the GPU tier


def test_gpu_tier_put_get_demote_promote_bytes_exact():
    cache = host_cache(capacity_bytes=64 * MiB, block_bytes=1 * MiB)
    try:
        testing.tier(cache, "host").buffer.fill_(0xEE)
        srcs = {f"k{i}": source(24 * MiB + i, 10 + i) for i in range(4)}  # 4 x 24 MiB > 64 MiB
        hs = [cache.put(k, t) for k, t in srcs.items()]
        assert all(h.wait() for h in hs)
        st = cache.stats()["tiers"]["gpu"]
        assert st["puts"] == 4 and st["demotions"] >= 1
        for k, t in srcs.items():  # host hits promote back, GPU victims demote again
            got = cache.get(k, device=DEV)
            assert got.device == torch.device(DEV) and torch.equal(got, t), k
            assert torch.equal(cache.get(k).to(DEV), t), k
        assert cache.stats()["tiers"]["gpu"]["promotions"] >= 1
    finally:
        cache.close()


def test_gpu_tier_read_is_ordered_after_its_write_without_host_sync():
    cache = host_cache(capacity_bytes=64 * MiB)
    try:
        src = source(32 * MiB, 20)
        delay_lanes(cache, "arena")
        cache.put("k", src)
        got = cache.get("k", device=DEV)  # a GPU hit: read enqueued behind the write
        assert torch.equal(got, src)
    finally:
        cache.close()


def test_prefetch_to_the_gpu_then_get_is_a_gpu_hit():
    cache = host_cache(capacity_bytes=64 * MiB)
    try:
        a, b, c = (source(30 * MiB, 30 + i) for i in range(3))
        for k, t in (("a", a), ("b", b), ("c", c)):
            cache.put(k, t).wait()
        (h,) = cache.prefetch(["a"], device=DEV)
        assert h.wait(10)
        hits = cache.stats()["tiers"]["gpu"]["hits"]
        assert torch.equal(cache.get("a", device=DEV), a)
        assert cache.stats()["tiers"]["gpu"]["hits"] == hits + 1
    finally:
        cache.close()


def test_a_connector_pin_read_on_the_schedulers_stream_is_waited_for_on_the_workers():
    """The connector's scheduler pins a GPU-tier entry (a device-to-device read ordered on its
    current stream); the worker then uses the pinned tensor on another stream (another thread's):
    the worker's stream waits for the pin's event, so it never reads the poisoned block before the
    delayed read filled it (ectier_vllm.store: ready_event, use_on_current_stream)."""
    from ectier_vllm.store import open_inprocess

    store = open_inprocess(CacheConfig(
        namespace="gpu-test-pin-streams",
        host=HostTierConfig(capacity_bytes=128 * MiB, block_bytes=1 * MiB, pin_memory=True, admit_wait_s=5),
        gpu=GpuTierConfig(device=DEV, capacity_bytes=128 * MiB),
    ))
    try:
        src = source(32 * MiB, 40)
        assert store.put("k", src).wait()
        scheduler, worker = torch.cuda.Stream(DEV), torch.cuda.Stream(DEV)
        with torch.cuda.stream(scheduler):
            poison = torch.full((32 * MiB,), 0xEE, dtype=torch.uint8, device=DEV)
            del poison  # the pin's read allocates this block on this stream
            delay_lanes(store.cache, "arena")
            pin = store.acquire("k", DEV)
            assert pin is not None and pin.tensor is not None, "not read from the GPU tier"
            store.stage("k", pin)
        with torch.cuda.stream(worker):
            got = store.get("k", DEV)
            copy = got.clone()  # on the worker's stream: must come after the delayed read
        worker.synchronize()
        assert torch.equal(copy, src)
        store.release(pin, staged_as="k")
    finally:
        store.close()


# ------------------------------------------------------------------------------- bad input


def test_bad_devices_and_budgets_are_clear_errors():
    n = torch.cuda.device_count()
    cache = host_cache()
    try:
        with pytest.raises(InvalidDeviceError, match="explicit"):
            cache.get("k", device="cuda")
        with pytest.raises(InvalidDeviceError, match="does not exist"):
            cache.get("k", device=f"cuda:{n}")
    finally:
        cache.close()
    with pytest.raises(ConfigError, match=r"gpu\.device"):
        TieredCache(CacheConfig(gpu=GpuTierConfig(device=f"cuda:{n}", capacity_bytes=MiB)))
    free, _ = torch.cuda.mem_get_info(0)
    with pytest.raises(ConfigError, match=r"gpu\.capacity_bytes"):
        TieredCache(CacheConfig(gpu=GpuTierConfig(device=DEV, capacity_bytes=free + (1 << 30))))
    gpu_only = TieredCache(CacheConfig(host=HostTierConfig(capacity_bytes=0),
                                       gpu=GpuTierConfig(device=DEV, capacity_bytes=8 * MiB)))
    try:
        with pytest.raises(InvalidTensorError, match="only a GPU tier"):
            gpu_only.put("k", torch.zeros(10))
    finally:
        gpu_only.close()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_two_devices_tensor_of_the_other_device_is_refused_and_own_device_works():
    cache = TieredCache(CacheConfig(gpu=GpuTierConfig(device="cuda:1", capacity_bytes=16 * MiB),
                                    host=HostTierConfig(capacity_bytes=64 * MiB, pin_memory=True)))
    try:
        with pytest.raises(InvalidDeviceError, match=r"gpu\.device=cuda:1"):
            cache.put("k", torch.zeros(10, device="cuda:0"))
        t = torch.arange(1000, device="cuda:1")
        cache.put("k", t).wait()
        assert torch.equal(cache.get("k", device="cuda:1"), t)
        assert torch.equal(cache.get("k", device="cuda:0"), t.to("cuda:0"))
    finally:
        cache.close()


def test_engine_refuses_to_run_in_a_child_forked_after_cuda_init():
    engine = CudaCopyEngine(DEV)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: must refuse before touching CUDA
        code = 1
        try:
            engine.copy([], lane="d2h")
        except EctierError as exc:
            code = 0 if "spawn" in str(exc) else 2
        os.write(w, bytes([code]))
        os._exit(0)
    os.close(w)
    code = os.read(r, 1)
    os.waitpid(pid, 0)
    assert code == b"\x00"


def test_bf16_encoder_output_views_round_trip_through_every_tier():
    cache = host_cache(capacity_bytes=16 * MiB)
    try:
        full = torch.randn(1024, 8192, device=DEV).to(torch.bfloat16)  # 16 MiB, Qwen3-VL N=1024
        view = full[:, ::2]  # non-contiguous: stored in C order
        cache.put("view", view).wait()
        cache.put("full", full).wait()  # evicts "view" from the 16 MiB GPU tier into host
        for key, t in (("view", view), ("full", full)):
            got = cache.get(key, device=DEV)
            assert got.dtype == torch.bfloat16 and got.shape == t.shape
            assert torch.equal(got.view(torch.int16), t.contiguous().view(torch.int16)), key
    finally:
        cache.close()


def test_copy_lanes_are_never_one_of_the_streams_an_engine_like_vllm_creates():
    cache = host_cache()
    try:
        engine = testing.copy_engine_of(cache, DEV)
        lanes = {s.cuda_stream for lane in LANES for s in engine.streams(lane)}
        theirs = {torch.cuda.Stream(DEV).cuda_stream for _ in range(64)}  # twice torch's pool of 32
        assert lanes and not lanes & theirs
    finally:
        cache.close()
