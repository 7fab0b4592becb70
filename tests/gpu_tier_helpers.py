"""Helpers of the CPU-run GPU-tier tests (test_gpu_tier_cpu.py, test_gpu_tier_copies.py).

``ectier.testing.make_cache(config, copy_engine=..., gpu_device="cpu")`` puts the GPU tier's arena
in CPU memory and routes every copy through the given engine; with it a CPU tensor stands for a
tensor on the GPU tier's device. :func:`cache_opener` makes such caches and closes them after the
test (running the copies that closing enqueues).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator

from conftest import KiB, MiB
from ectier import CacheConfig, GpuTierConfig, HostTierConfig, NvmeTierConfig, TieredCache, testing
from ectier.copy import InlineCopyEngine
from ectier.testing import DeferredCopyEngine

BLOCK = 64 * KiB


def cfg(tmp_path=None, *, gpu_blocks=4, host_blocks=4, nvme_bytes=0, gpu_block=BLOCK, host_block=BLOCK, **gpu_kw):
    """A config with a GPU tier of ``gpu_blocks`` blocks, a host tier of ``host_blocks`` and, with
    ``nvme_bytes`` (then ``tmp_path`` is needed), an NVMe tier under ``tmp_path / "nvme"``."""
    return CacheConfig(
        namespace="test",
        gpu=GpuTierConfig(capacity_bytes=gpu_blocks * gpu_block, block_bytes=gpu_block, **gpu_kw),
        host=HostTierConfig(capacity_bytes=host_blocks * host_block, block_bytes=host_block, pin_memory=False,
                            admit_wait_s=0.2),
        nvme=NvmeTierConfig(path=str(tmp_path / "nvme"), capacity_bytes=nvme_bytes, sync=False,
                            map_initial_bytes=4 * MiB) if nvme_bytes else NvmeTierConfig(),
    )


class pumping:
    """Context manager: a thread runs the deferred engine's copies as they come (a live GPU)."""

    def __init__(self, engine: DeferredCopyEngine) -> None:
        self.engine, self.stop = engine, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            self.engine.complete()
            self.stop.wait(0.002)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


@contextlib.contextmanager
def cache_opener() -> Iterator[Callable[..., TieredCache]]:
    """Yields ``make(config, engine=None)``: a cache on device "cpu" copying through ``engine``
    (default: an :class:`InlineCopyEngine`). Every cache made is closed on exit; a deferred
    engine's failure injection is turned off and its copies pumped meanwhile."""
    caches = []

    def make(config, engine=None):
        c = testing.make_cache(config, copy_engine=engine or InlineCopyEngine(), gpu_device="cpu")
        caches.append((c, engine))
        return c

    yield make
    for c, engine in caches:
        if isinstance(engine, DeferredCopyEngine):
            engine.fail_with = None
            with pumping(engine):  # copies enqueued by close() itself (flush) must run too
                c.close()
        else:
            c.close()


def where(cache, key):
    """The tiers holding ``key`` (namespace "test"): a subset of {"gpu", "host", "nvme"}."""
    return testing.where(cache, key, "test")
