"""Seconds to reopen an NVMe store of N small entries (issue 12 item 6: ≤ 2 s for 100,000).

::

    python benchmarks/reopen_bench.py --store /var/tmp/ectier-reopen --entries 100000 --rounds 3

Fills ``--store`` with N 16-byte entries once (``nvme.sync`` off; kept for the next run when it
holds N already — filling 100,000 takes ~100 s here), then times ``TieredCache(cfg)`` (wall and CPU seconds of this process — CPU time is steadier on a
shared machine; lock, LMDB
open, index scan, free-space map, adopting the records into the catalog and the policy) ``--rounds``
times, and checks that no open read a payload byte (``SegmentFile.read_into`` is counted). Prints
the median and best seconds; ``--json`` writes them. Results: docs/benchmarks.md ("Reopen").
Run it with another ``PYTHONPATH`` on the same store to compare two versions in one session.
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

import ectier.tiers.nvme_segment as segment
from ectier import TieredCache
from ectier.config import CacheConfig, HostTierConfig, NvmeTierConfig

MiB = 1 << 20


def config(store: Path, n: int) -> CacheConfig:
    return CacheConfig(namespace="bench", host=HostTierConfig(capacity_bytes=0),
                       nvme=NvmeTierConfig(path=str(store), sync=False, capacity_bytes=n * (80 << 10) + 64 * MiB,
                                           flush_on_close=False))


def fill(store: Path, n: int) -> None:
    """Make ``store`` hold exactly ``n`` small entries (kept when it does already)."""
    cfg = config(store, n)
    if store.exists():
        with TieredCache(cfg) as cache:
            if len(cache) == n:
                return
        shutil.rmtree(store)
    x = torch.zeros(16, dtype=torch.uint8)
    with TieredCache(cfg) as cache:
        for i in range(n):
            cache.put(f"mm_hash-{i:08d}", x)


def time_reopen(store: Path, n: int, rounds: int) -> dict:
    """Open ``rounds`` times; seconds (median, best) and payload reads seen (must be 0)."""
    cfg = config(store, n)
    reads = [0]
    real = segment.SegmentFile.read_into

    def counting(self, *a):
        reads[0] += 1
        return real(self, *a)

    segment.SegmentFile.read_into = counting
    times, cpu = [], []
    try:
        for _ in range(rounds):
            t0, c0 = time.perf_counter(), time.process_time()
            with TieredCache(cfg) as cache:
                times.append(time.perf_counter() - t0)
                cpu.append(time.process_time() - c0)
                if len(cache) != n:
                    raise SystemExit(f"reopened {len(cache)} entries, expected {n}")
    finally:
        segment.SegmentFile.read_into = real
    return {"entries": n, "rounds": rounds, "median_s": statistics.median(times), "best_s": min(times),
            "cpu_median_s": statistics.median(cpu),
            "times_s": times, "payload_reads": reads[0], "loadavg": os.getloadavg()[0]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--store", default="/var/tmp/ectier-reopen")
    ap.add_argument("--entries", type=int, default=100_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    store = Path(args.store)
    fill(store, args.entries)
    r = time_reopen(store, args.entries, args.rounds)
    print(f"reopen of {r['entries']} entries: median {r['median_s']:.2f} s, best {r['best_s']:.2f} s "
          f"(CPU {r['cpu_median_s']:.2f} s; {r['rounds']} rounds; payload reads {r['payload_reads']}; load average {r['loadavg']:.1f})")
    if args.json:
        Path(args.json).write_text(json.dumps(r, indent=1))
    return 0 if r["payload_reads"] == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
