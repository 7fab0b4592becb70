"""Daemon benchmark: ``contains`` round-trip latency and put/get GB/s through shared memory,
against an in-process :class:`~ectier.TieredCache` with the same tiers, in the same run.

    .venv/bin/python benchmarks/daemon_bench.py [--calls 5000] [--tokens 64,1024,4096] [--repeat 5]

Starts ``python -m ectier.daemon`` in a temporary directory (socket and arena there, host tier
only so both sides measure memory copies, not the disk), prints a markdown table and exits.
Goals (issue 5): contains p50 <= 50 us, p99 <= 200 us on the CPU machine; get/put GB/s through
the daemon >= 80 % of in-process.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import torch

from ectier import CacheConfig, HostTierConfig, TieredCache
from ectier.daemon.client import DaemonClient

ROW_BYTES = 8192 * 2  # Qwen3-VL: one token of (N, 8192) bfloat16


def _percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def _time_ops(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=5000, help="contains round trips to time")
    ap.add_argument("--tokens", default="64,1024,4096", help="entry sizes as N tokens of (N, 8192) bf16")
    ap.add_argument("--repeat", type=int, default=5, help="repeats per size (best is reported)")
    args = ap.parse_args(argv)
    sizes = [int(t) for t in args.tokens.split(",")]
    host_bytes = max(256 << 20, 3 * max(sizes) * ROW_BYTES)

    tmp = tempfile.mkdtemp(prefix="ectb", dir="/tmp")
    sock = os.path.join(tmp, "d.sock")
    cfg = os.path.join(tmp, "cfg.yaml")
    with open(cfg, "w") as f:
        f.write(f"host: {{capacity_bytes: {host_bytes}}}\n"
                f"daemon: {{socket_path: {sock}, shm_dir: {tmp}}}\n")
    proc = subprocess.Popen([sys.executable, "-m", "ectier.daemon", "--config", cfg, "--log-level", "warning"])
    rows = []
    try:
        client = DaemonClient(sock, client_name="daemon-bench", connect_retry_s=30)
        client.connect()
        client.put("probe", torch.zeros(1, 8192, dtype=torch.bfloat16))
        lat = []
        for _ in range(args.calls):
            t0 = time.perf_counter()
            client.contains("probe")
            lat.append(time.perf_counter() - t0)
        p50, p99 = _percentile(lat, 0.50) * 1e6, _percentile(lat, 0.99) * 1e6

        local = TieredCache(CacheConfig(host=HostTierConfig(capacity_bytes=host_bytes)))
        for n in sizes:
            t = torch.randn(n, 8192).to(torch.bfloat16)
            nbytes = t.numel() * 2
            d_put = _time_ops(lambda: client.put(f"k{n}", t), args.repeat)
            l_put = _time_ops(lambda: local.put(f"k{n}", t), args.repeat)
            d_get = _time_ops(lambda: client.get(f"k{n}"), args.repeat)
            l_get = _time_ops(lambda: local.get(f"k{n}"), args.repeat)
            assert torch.equal(client.get(f"k{n}"), t)
            rows.append((n, nbytes, nbytes / d_put / 1e9, nbytes / l_put / 1e9, nbytes / d_get / 1e9, nbytes / l_get / 1e9))
        local.close()
        client.close()
    finally:
        proc.terminate()
        proc.wait(timeout=60)
        shutil.rmtree(tmp, ignore_errors=True)

    print(f"\ncontains round trip over the socket ({args.calls} calls): p50 {p50:.1f} us, p99 {p99:.1f} us "
          f"(goal p50 <= 50 us, p99 <= 200 us); mean {statistics.fmean(lat) * 1e6:.1f} us\n")
    print("| N tokens | bytes | daemon put GB/s | in-process put GB/s | put ratio | daemon get GB/s | in-process get GB/s | get ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for n, nbytes, dp, lp, dg, lg in rows:
        print(f"| {n} | {nbytes} | {dp:.2f} | {lp:.2f} | {dp / lp:.0%} | {dg:.2f} | {lg:.2f} | {dg / lg:.0%} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
