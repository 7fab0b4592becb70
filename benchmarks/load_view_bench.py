"""The in-process consumer's load, step by step: copy vs zero-copy view, against a safetensors file.

What the connector's consumer does per item, on a host-only :class:`~ectier.TieredCache`:
``acquire`` (the scheduler's pin), ``load(lease)`` (the worker: a copy into a fresh tensor, or
with ``view=True`` a view of the arena), touching every byte (``dst.copy_``, what vLLM's
embedding gather does), ``release``. The reference is what ``ECExampleConnector`` does with the
same bytes: ``safetensors.torch.load_file`` of a file in the page cache (it maps the file), then the
same ``dst.copy_``. Medians over ``--reps`` items, milliseconds, one run; ratio = reference /
ectier (> 1: ectier faster).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/load_view_bench.py --sizes 64,1024,4096 --reps 9
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

from ectier import TieredCache

WIDTH = 8192


def _ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def bench_size(n: int, reps: int, directory: str) -> dict[str, float]:
    nbytes = n * WIDTH * 2
    items = [torch.randn(n, WIDTH, generator=torch.Generator().manual_seed(i)).to(torch.bfloat16)
             for i in range(reps)]
    dst = torch.zeros(n, WIDTH, dtype=torch.bfloat16)
    out: dict[str, list[float]] = {k: [] for k in ("acquire", "load copy", "touch after copy", "load view",
                                                   "touch after view", "release", "example load+touch")}
    cache = TieredCache({"host": {"capacity_bytes": (reps + 1) * nbytes + (1 << 20), "block_bytes": 256 * 1024}})
    try:
        for i, x in enumerate(items):
            cache.put(f"k{i}", x)
        for i in range(reps):
            for view in (False, True):
                t0 = time.perf_counter()
                lease = cache.acquire(f"k{i}")
                t1 = time.perf_counter()
                got = cache.load(lease, view=view)
                t2 = time.perf_counter()
                dst.copy_(got)
                t3 = time.perf_counter()
                cache.release(lease)
                del got
                t4 = time.perf_counter()
                kind = "view" if view else "copy"
                out["acquire"].append(t1 - t0)
                out[f"load {kind}"].append(t2 - t1)
                out[f"touch after {kind}"].append(t3 - t2)
                out["release"].append(t4 - t3)
    finally:
        cache.close()
    from safetensors.torch import load_file, save_file

    for i, x in enumerate(items):
        path = os.path.join(directory, f"{n}-{i}.safetensors")
        save_file({"ec_cache": x}, path)
        t0 = time.perf_counter()
        got = load_file(path)["ec_cache"]
        dst.copy_(got)
        out["example load+touch"].append(time.perf_counter() - t0)
        del got
        os.unlink(path)
    med = {k: _ms(v) for k, v in out.items()}
    med["ectier copy path"] = med["acquire"] + med["load copy"] + med["touch after copy"] + med["release"]
    med["ectier view path"] = med["acquire"] + med["load view"] + med["touch after view"] + med["release"]
    return med


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="64,1024,4096", help="comma-separated N (N x 8192 bf16)")
    ap.add_argument("--reps", type=int, default=9)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="ectier-view-bench-") as d:
        for n in (int(s) for s in args.sizes.split(",")):
            m = bench_size(n, args.reps, d)
            ref = m["example load+touch"]
            print(f"N={n} ({n * WIDTH * 2 / (1 << 20):.0f} MiB), ms p50: " +
                  ", ".join(f"{k} {v:.2f}" for k, v in m.items()) +
                  f"; example/copy {ref / m['ectier copy path']:.2f}x, example/view {ref / m['ectier view path']:.2f}x")


if __name__ == "__main__":
    main()
