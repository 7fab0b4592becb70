"""Layout v2 probe: segment file + extents vs one file per entry, against raw I/O, in one directory.

::

    python benchmarks/nvme_layout_probe.py --dir /var/tmp/probe --rounds 5

For 1, 16 and 64 MiB payloads, interleaved rounds, medians in MB/s:

- ``raw``: ``write`` + ``fdatasync`` into an existing file (the floor both layouts pay);
- ``segment``: ``pwrite`` at an extent of a preallocated 1 GiB segment file + ``fdatasync``;
- ``file``: create ``<digest>.<version>`` + ``write`` + ``fdatasync`` + ``fsync`` of its directory,
  unlink the one of the previous round (an overwrite);
- reads: ``readinto`` of a warm file / extent into one preallocated buffer; ``O_DIRECT`` reads of the
  same (aligned buffer) — whether the filesystem takes ``O_DIRECT`` at all is printed.

The result and the choice it led to: docs/benchmarks.md ("Layout v2: why one file per entry").
"""

from __future__ import annotations

import argparse
import mmap
import os
import statistics
import time


def _sync_write(fd: int, buf: memoryview, offset: int | None = None) -> None:
    n = 0
    while n < len(buf):
        n += os.pwrite(fd, buf[n:], (offset or 0) + n) if offset is not None else os.write(fd, buf[n:])
    os.fdatasync(fd)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/var/tmp/ectier-probe")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    seg_path = os.path.join(args.dir, "segment.0")
    seg = os.open(seg_path, os.O_RDWR | os.O_CREAT, 0o644)
    os.posix_fallocate(seg, 0, 1 << 30)
    dfd = os.open(args.dir, os.O_RDONLY | os.O_DIRECTORY)
    try:
        odirect = os.open(seg_path, os.O_RDONLY | os.O_DIRECT)
        os.close(odirect)
        print("O_DIRECT: supported here")
    except OSError as exc:
        print("O_DIRECT: refused here:", exc)
    for mib in (1, 16, 64):
        n = mib << 20
        src = memoryview(bytearray(os.urandom(1 << 20)) * mib)
        dst = mmap.mmap(-1, n)  # page-aligned: usable for O_DIRECT too
        times: dict[str, list[float]] = {k: [] for k in ("raw_w", "seg_w", "file_w", "raw_r", "seg_r", "file_r", "seg_r_direct")}
        raw_path = os.path.join(args.dir, "raw.bin")
        prev = None
        for r in range(args.rounds):
            t = time.perf_counter()
            fd = os.open(raw_path, os.O_WRONLY | os.O_CREAT, 0o644)
            _sync_write(fd, src, 0)
            os.close(fd)
            times["raw_w"].append(time.perf_counter() - t)
            t = time.perf_counter()
            _sync_write(seg, src, (r % 8) * n)
            times["seg_w"].append(time.perf_counter() - t)
            t = time.perf_counter()
            name = os.path.join(args.dir, f"{r:08x}.payload")
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            _sync_write(fd, src)
            os.close(fd)
            os.fsync(dfd)
            if prev:
                os.unlink(prev)
            prev = name
            times["file_w"].append(time.perf_counter() - t)
            for k, path, off in (("raw_r", raw_path, 0), ("file_r", name, 0)):
                t = time.perf_counter()
                fd = os.open(path, os.O_RDONLY)
                os.preadv(fd, [dst], off)
                os.close(fd)
                times[k].append(time.perf_counter() - t)
            t = time.perf_counter()
            os.preadv(seg, [dst], (r % 8) * n)
            times["seg_r"].append(time.perf_counter() - t)
            t = time.perf_counter()
            fd = os.open(seg_path, os.O_RDONLY | os.O_DIRECT)
            os.preadv(fd, [dst], (r % 8) * n)
            os.close(fd)
            times["seg_r_direct"].append(time.perf_counter() - t)
        if prev:
            os.unlink(prev)
        line = " ".join(f"{k}={n / statistics.median(v) / 1e6:7.0f}" for k, v in times.items())
        print(f"{mib:3d} MiB MB/s: {line}")
    os.close(seg)
    os.unlink(seg_path)
    os.unlink(os.path.join(args.dir, "raw.bin"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
