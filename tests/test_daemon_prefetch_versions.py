"""Daemon prefetch vs puts and deletes of the same keys: a ``get`` after a put (or a delete) has
returned serves that put's bytes (or a miss), never an older version a prefetch had pinned.

Before: ``Prefetcher.forget`` (run by a put's commit and by a delete) dropped only the pins
already held; a worker (or a request's host hit) that pinned the older version just before kept
it afterwards, and the next ``get`` took it. Writers own their keys (put, overwrite, delete, get
checked against what they last did); readers prefetch and get the same keys beside them, over
a small arena and an NVMe tier, so that promotions, pins and evictions interleave."""

from __future__ import annotations

import random
import shutil
import threading
import time
import traceback
import zlib

import torch

from daemon_helpers import daemon_config, serve_in_thread, short_tmpdir
from ectier.config import CacheConfig
from ectier.daemon.client import DaemonClient

KiB, MiB = 1 << 10, 1 << 20
SIZES = (100 * KiB, 700 * KiB, 1500 * KiB, 2500 * KiB, 5 * MiB)
KEYS = [f"w{w}k{i}" for w in range(2) for i in range(4)]
SECONDS = 6.0


def _value(key: str, seq: int) -> torch.Tensor:
    base = zlib.crc32(f"{key}:{seq}".encode()) & 0x3FFFFFFF
    return torch.arange(base, base + SIZES[KEYS.index(key) % len(SIZES)] // 4, dtype=torch.int32)


class _Run:
    def __init__(self, sock: str) -> None:
        self.sock, self.stop, self.errors = sock, threading.Event(), []
        self.last: dict[str, int | None] = {}  # key -> the seq its writer put last (None: deleted)

    def check(self, key: str, got: torch.Tensor | None, what: str) -> None:
        want = self.last.get(key, None)
        if want is None and got is not None:
            self.errors.append(f"{what} {key}: deleted (or never put), got a value")
        elif want is not None and (got is None or not torch.equal(got.view(torch.int32).flatten(), _value(key, want))):
            self.errors.append(f"{what} {key}: expected seq {want}, got {'a miss' if got is None else 'other bytes'}")

    def writer(self, w: int) -> None:
        rng, seq, mine = random.Random(w), 0, [k for k in KEYS if k.startswith(f"w{w}")]
        with DaemonClient(self.sock) as c:
            while not self.stop.is_set():
                key, r = rng.choice(mine), rng.random()
                try:
                    if r < 0.5:
                        seq += 1
                        c.put(key, _value(key, seq))
                        self.last[key] = seq
                    elif r < 0.65:
                        c.delete(key)
                        self.last[key] = None
                    else:
                        self.check(key, c.get(key), "get")
                except Exception:  # noqa: BLE001 - every exception is a failure here
                    self.errors.append(traceback.format_exc())

    def reader(self, i: int) -> None:
        rng = random.Random(100 + i)
        with DaemonClient(self.sock) as c:
            while not self.stop.is_set():
                keys = rng.sample(KEYS, 2)
                try:
                    c.prefetch(keys)
                    time.sleep(rng.random() * 0.01)
                    for key in keys:
                        c.get(key)
                except Exception:  # noqa: BLE001
                    self.errors.append(traceback.format_exc())


def test_a_get_after_a_put_or_delete_never_serves_an_older_prefetched_version():
    d = short_tmpdir()
    try:
        raw = daemon_config(d, host_bytes=4 * MiB, nvme_bytes=256 * MiB, lease_s=2)
        server, thread = serve_in_thread(CacheConfig.from_dict(raw))
        try:
            run = _Run(raw["daemon"]["socket_path"])
            threads = [threading.Thread(target=run.writer, args=(w,)) for w in range(2)]
            threads += [threading.Thread(target=run.reader, args=(i,)) for i in range(2)]
            for t in threads:
                t.start()
            time.sleep(SECONDS)
            run.stop.set()
            for t in threads:
                t.join(60)
            with DaemonClient(run.sock) as c:
                for key in KEYS:
                    run.check(key, c.get(key), "final get")
                prefetch = c.stats()["daemon"]["prefetch"]
            assert prefetch["started"] > 50  # the readers' prefetches raced the writers
            assert not run.errors, "\n".join(run.errors[:5])
        finally:
            server.stop()
            thread.join(10)
    finally:
        shutil.rmtree(d, ignore_errors=True)
