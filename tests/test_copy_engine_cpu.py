"""``CudaCopyEngine``'s own logic on a machine without CUDA (tests/cuda_fakes.py stands in for
``torch.cuda``; the copies run on the CPU): what a CUDA error does to a handle and to the cache
that waits on it. The orderings themselves are checked on a GPU by tests/test_gpu.py."""

from __future__ import annotations

import threading

import pytest
import torch

from conftest import MiB, filled
from cuda_fakes import FakeCuda
from ectier import CacheConfig, HostTierConfig, testing
from ectier.copy import CudaCopyEngine

CUDA_ERROR = RuntimeError("CUDA error: an illegal memory access was encountered")


@pytest.fixture
def cuda(monkeypatch):
    return FakeCuda(monkeypatch)


def pairs(n=2, nbytes=1024):
    return [(torch.zeros(nbytes, dtype=torch.uint8), torch.full((nbytes,), i + 1, dtype=torch.uint8)) for i in range(n)]


@pytest.mark.parametrize("observe", ["done", "wait", "wait_timeout"])
def test_a_cuda_error_seen_when_a_copy_completes_is_the_handles_error_never_raised(cuda, observe):
    """Before: ``done()`` / ``wait()`` raised the error of ``event.query()`` / ``synchronize()``
    and left the handle unfinished (and its buffers referenced) for ever."""
    engine = CudaCopyEngine("cuda:0")
    h = engine.copy(pairs(), lane="d2h")
    cuda.query_error = cuda.synchronize_error = CUDA_ERROR
    finished = {"done": h.done, "wait": h.wait, "wait_timeout": lambda: h.wait(1.0)}[observe]()
    assert finished is True and h.done() and h.error is CUDA_ERROR


def test_a_put_whose_copy_completion_raises_is_a_failed_put_and_gets_do_not_hang(cuda):
    """Before: the put raised out of ``Mover.when_done`` after registering its write in flight,
    which then never ended: every later ``get`` of the key waited for ever."""
    engine = CudaCopyEngine("cuda:0")
    cache = testing.make_cache(CacheConfig(namespace="t", host=HostTierConfig(capacity_bytes=4 * MiB, pin_memory=False)),
                               copy_engine=engine)
    try:
        cuda.query_error = cuda.synchronize_error = CUDA_ERROR
        h = cache.put("k", filled(64 * 1024, 3))
        assert h.wait(5) is False and h.error is CUDA_ERROR
        got = {}
        reader = threading.Thread(target=lambda: got.setdefault("v", cache.get("k")), daemon=True)
        reader.start()
        reader.join(5)
        assert not reader.is_alive(), "get of a key whose put failed hangs"
        assert got["v"] is None
        assert cache.stats()["copy_failures"] == 1
        cuda.query_error = cuda.synchronize_error = None
        assert cache.put("k", filled(64 * 1024, 4)).wait(5) and testing.drain(cache, 5)
        assert bool((cache.get("k") == filled(64 * 1024, 4)).all())
    finally:
        cuda.query_error = cuda.synchronize_error = None
        cache.close()


def test_a_batch_that_fails_midway_has_nothing_in_flight_when_the_error_reaches_the_caller(cuda):
    """The caller of a copy that raises gives the batch's blocks back at once (an aborted host
    slot, an unpinned source) and frees its tensors. Before: the copies enqueued before the
    failing one were still running then, into (or out of) blocks already handed to others."""
    engine = CudaCopyEngine("cuda:0")
    ok_dst, src = torch.zeros(1024, dtype=torch.uint8), torch.ones(1024, dtype=torch.uint8)
    overlapping = torch.zeros(1, dtype=torch.uint8).expand(1024)  # copy_ into it raises
    lane = engine.streams("d2h")[0]
    with pytest.raises(RuntimeError):
        engine.copy([(ok_dst, src), (overlapping, src)], lane="d2h")
    assert ("synchronize", lane) in cuda.log
