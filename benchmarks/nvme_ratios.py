"""NVMe tier vs raw file I/O of the same bytes, same directory, interleaved rounds, one run: ratios.

::

    python benchmarks/nvme_ratios.py --dir /var/tmp/ectier-ratios --rounds 7 [--sizes 1,16,64] [--reopen 100000]
        [--read-threads 2] [--cpu 40] [--warmup 2]

An NVMe-only ``TieredCache`` (``host.capacity_bytes=0``: every put goes to the NVMe tier, every get
reads it) against, per size (MiB):

- ``put`` (``nvme.sync``) vs ``write+fsync``: ``pwrite`` into an existing file + ``fdatasync``,
  after ``--warmup`` untimed rounds (default 2: a put's blocks are then reused segment space, as
  the raw write's are an existing file's); ``fresh put/raw``: the store's first put (never-written
  segment space) vs a write into a new file + ``fdatasync``, one sample each;
- ``get(out=)`` warm vs ``readinto`` warm: ``preadv`` of the file just written into one buffer;
- ``get(out=)`` cold vs a cold buffered read: both files' pages dropped first
  (``POSIX_FADV_DONTNEED`` after a sync: clean pages go) — what the disk gives to buffered reads.

Ratios are (raw time / ectier time) of the medians: 1.0 = as fast as raw I/O; ``paired`` is the
median of the per-round ratios (each round's raw and ectier reads run back to back, so a burst of
load on a shared machine hits both), with its spread (min-max over the rounds). ``--cpu B`` also
times warm gets against warm reads in a steady loop, ``B`` interleaved batches, in CPU time of the
thread (robust to other processes' load; a second thread's work, ``--read-threads 2``, is not in
it). ``--reopen N`` also
times opening a store of N small entries (index scan only). Prints one table; ``--json`` writes it.
Results and their machine: docs/benchmarks.md ("NVMe tier").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import time
from pathlib import Path

import torch

from ectier import TieredCache
from ectier.config import CacheConfig, HostTierConfig, NvmeTierConfig

MiB = 1 << 20


def _drop(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _cache(path: Path, nbytes: int, read_threads: int = 1) -> TieredCache:
    more = {"read_threads": read_threads} if read_threads != 1 else {}  # (runs against older ectier too)
    return TieredCache(CacheConfig(
        namespace="bench", host=HostTierConfig(capacity_bytes=0),
        nvme=NvmeTierConfig(path=str(path), sync=True, capacity_bytes=4 * nbytes + 64 * MiB, flush_on_close=False,
                            **more)))


def _cpu_batches(cache: TieredCache, out: torch.Tensor, raw_path: str, batches: int) -> dict:
    """Warm ``get(out=)`` vs warm open+``preadv``+close in a steady loop, interleaved batch by batch,
    timed in CPU seconds of this thread (``time.thread_time``: other processes' load does not
    stretch it); per call: medians and the median of the per-batch ratios."""
    dst, calls = memoryview(out.numpy()), max(2, (32 * MiB) // max(1, out.numel()))
    raw_s, get_s = [], []
    for _ in range(batches):
        t0 = time.thread_time()
        for _ in range(calls):
            fd = os.open(raw_path, os.O_RDONLY)
            os.preadv(fd, [dst], 0)
            os.close(fd)
        t1 = time.thread_time()
        for _ in range(calls):
            cache.get("k", out=out)
        raw_s.append((t1 - t0) / calls)
        get_s.append((time.thread_time() - t1) / calls)
    med_r, med_g = statistics.median(raw_s), statistics.median(get_s)
    return {"cpu raw_us": med_r * 1e6, "cpu get_us": med_g * 1e6, "cpu get/raw": med_r / med_g,
            "cpu get/raw paired": statistics.median([r / g for r, g in zip(raw_s, get_s)])}


def _fresh_write(path: str, buf: memoryview) -> float:
    """Seconds to write ``buf`` into a new file + ``fdatasync`` (blocks never written before)."""
    t0 = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.pwrite(fd, buf, 0)
        os.fdatasync(fd)
    finally:
        os.close(fd)
    return time.perf_counter() - t0


def measure(d: Path, mib: int, rounds: int, read_threads: int = 1, cpu_batches: int = 0, warmup: int = 2) -> dict:
    nbytes = mib * MiB
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    buf = memoryview(src.numpy())
    out = torch.empty(nbytes, dtype=torch.uint8)
    dst = memoryview(out.numpy())
    raw_path = str(d / f"raw-{mib}.bin")
    with open(raw_path, "wb") as f:
        f.write(buf)
    store = d / f"store-{mib}"
    shutil.rmtree(store, ignore_errors=True)
    cache = _cache(store, nbytes, read_threads)
    seg = str(store / "segment.0")
    t: dict[str, list[float]] = {k: [] for k in ("put", "raw_w", "get", "raw_r", "get_cold", "raw_cold")}
    try:
        # the first put writes never-written segment space: against a write into a new file, apart
        fresh_path = str(d / f"raw-fresh-{mib}.bin")
        raw_fresh = _fresh_write(fresh_path, buf)
        os.unlink(fresh_path)
        t0 = time.perf_counter()
        cache.put("k", src)
        put_fresh = time.perf_counter() - t0
        for r in range(warmup + rounds):  # the first ``warmup`` rounds are not timed (steady state)
            if r == warmup:
                t = {k: [] for k in t}
            t0 = time.perf_counter()
            fd = os.open(raw_path, os.O_WRONLY)
            os.pwrite(fd, buf, 0)
            os.fdatasync(fd)
            os.close(fd)
            t["raw_w"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            cache.put("k", src)
            t["put"].append(time.perf_counter() - t0)
            for _ in range(2):  # warm: the second of two reads
                t0 = time.perf_counter()
                fd = os.open(raw_path, os.O_RDONLY)
                os.preadv(fd, [dst], 0)
                os.close(fd)
                raw_r = time.perf_counter() - t0
                t0 = time.perf_counter()
                got = cache.get("k", out=out)
                get = time.perf_counter() - t0
            assert got is not None and torch.equal(got, src)
            t["raw_r"].append(raw_r)
            t["get"].append(get)
            _drop(raw_path)
            _drop(seg)
            t0 = time.perf_counter()
            fd = os.open(raw_path, os.O_RDONLY)
            os.preadv(fd, [dst], 0)
            os.close(fd)
            t["raw_cold"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            cache.get("k", out=out)
            t["get_cold"].append(time.perf_counter() - t0)
        cpu = _cpu_batches(cache, out, raw_path, cpu_batches) if cpu_batches else {}
    finally:
        cache.close()
        shutil.rmtree(store, ignore_errors=True)
        os.unlink(raw_path)
    med = {k: statistics.median(v) for k, v in t.items()}
    gbs = {k: nbytes / v / 1e9 for k, v in med.items()}
    paired = [r / g for r, g in zip(t["raw_r"], t["get"])]
    return {"mib": mib, "GB/s": gbs, "put/raw": med["raw_w"] / med["put"], "get/raw": med["raw_r"] / med["get"],
            "cold get/raw": med["raw_cold"] / med["get_cold"], "get/raw paired": statistics.median(paired),
            "get/raw paired spread": (min(paired), max(paired)), "fresh put/raw": raw_fresh / put_fresh, **cpu}


def reopen(d: Path, n: int) -> float:
    store = d / "store-reopen"
    shutil.rmtree(store, ignore_errors=True)
    cfg = CacheConfig(namespace="bench", host=HostTierConfig(capacity_bytes=0),
                      nvme=NvmeTierConfig(path=str(store), sync=False, capacity_bytes=n * (80 << 10) + 64 * MiB,
                                          flush_on_close=False))
    x = torch.zeros(16, dtype=torch.uint8)
    with TieredCache(cfg) as cache:
        for i in range(n):
            cache.put(f"mm_hash-{i:08d}", x)
    t0 = time.perf_counter()
    with TieredCache(cfg) as cache:
        elapsed = time.perf_counter() - t0
        assert len(cache) == n
    shutil.rmtree(store, ignore_errors=True)
    return elapsed


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/var/tmp/ectier-ratios")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--warmup", type=int, default=2, help="untimed rounds first (steady state: reused segment space; 0 times the store's second "
                         "put, into never-written space, too)")
    ap.add_argument("--sizes", default="1,16,64")
    ap.add_argument("--reopen", type=int, default=0, help="also time reopening a store of this many entries")
    ap.add_argument("--read-threads", type=int, default=1, help="nvme.read_threads of the cache (1 or 2)")
    ap.add_argument("--cpu", type=int, default=0, metavar="BATCHES",
                    help="also time warm gets vs warm reads in a steady loop, CPU time, this many batches")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    d = Path(args.dir)
    d.mkdir(parents=True, exist_ok=True)
    rows = [measure(d, int(s), args.rounds, args.read_threads, args.cpu, args.warmup) for s in args.sizes.split(",")]
    print(f"{'MiB':>4} {'put/raw':>8} {'get/raw':>8} {'cold/raw':>9}   GB/s: put raw_w get raw_r get_cold raw_cold"
          "   get/raw paired (min-max)   fresh put/raw")
    for r in rows:
        g, (lo, hi) = r["GB/s"], r["get/raw paired spread"]
        print(f"{r['mib']:>4} {r['put/raw']:8.2f} {r['get/raw']:8.2f} {r['cold get/raw']:9.2f}   "
              f"{g['put']:.2f} {g['raw_w']:.2f} {g['get']:.2f} {g['raw_r']:.2f} {g['get_cold']:.2f} {g['raw_cold']:.2f}"
              f"   {r['get/raw paired']:.2f} ({lo:.2f}-{hi:.2f})   {r['fresh put/raw']:.2f}")
    for r in rows:
        if "cpu get/raw" in r:
            print(f"{r['mib']:>4} MiB steady loop, CPU per call: get {r['cpu get_us']:.0f} us, read {r['cpu raw_us']:.0f} us, "
                  f"get/raw {r['cpu get/raw']:.2f} (paired {r['cpu get/raw paired']:.2f})")
    result = {"rows": rows}
    if args.reopen:
        result["reopen_s"] = reopen(d, args.reopen)
        print(f"reopen of {args.reopen} entries: {result['reopen_s']:.2f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
