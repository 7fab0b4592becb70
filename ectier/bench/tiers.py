"""Per-tier put/get throughput and latency, each against its physical reference in the same run.

For every entry size N (tokens; an entry is ``(N, 8192)`` bfloat16 = ``N * 16 KiB``):

- **host**: ``TieredCache`` with only a host arena: ``put`` / ``get(out=...)`` vs the reference,
  ``copy_`` into a preallocated buffer (memcpy).
- **nvme**: ``TieredCache`` with no host tier, NVMe on LMDB (``sync`` as asked): ``put`` / ``get``
  vs the reference, a raw file ``write`` (+ ``fsync`` when sync) / ``read`` into a preallocated
  buffer (page cache warm), and the same with ``O_DIRECT`` where the filesystem supports it
  (skipped with the reason otherwise).
- **gpu** (only when CUDA is available): host-tier ``get(device="cuda:0")`` and ``put`` of a
  CUDA tensor vs the reference, raw pinned ``copy_`` H2D / D2H. Skipped with a reason otherwise.

Each row: ``tier, op, impl ("ectier" | "reference" | "reference-odirect"), num_tokens, nbytes,
gbps (bytes / median seconds / 1e9), p50_s, p99_s, reps``, plus noise detection
(:mod:`ectier.bench.noise`): ``noisy`` (bool), ``attempts`` (a noisy measurement is repeated up to
``retries`` times, the cleanest kept) and ``noise`` (spread p90/p50, p50/min, other processes'
CPU share, reasons). The host memcpy reference must beat ``min_reference_gbps``: slower is noise.
"""

from __future__ import annotations

import mmap
import os
import shutil
import tempfile
import time
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..cache import TieredCache
from ..config import CacheConfig, HostTierConfig, NvmeTierConfig
from ..errors import ConfigError
from ..tiers.storedir import free_bytes
from .noise import CpuProbe, NoiseThresholds, measure_until_quiet

__all__ = ["DEFAULT_TOKENS", "FULL_TOKENS", "measure_tiers", "reps_for"]

DEFAULT_TOKENS = (64, 1024, 4096)
FULL_TOKENS = (64, 256, 1024, 4096, 16384)
WIDTH = 8192
MiB = 1 << 20


def reps_for(nbytes: int, budget_bytes: int = 512 * MiB, lo: int = 3, hi: int = 30) -> int:
    """Repetitions for an entry of ``nbytes``: about ``budget_bytes`` moved, within [lo, hi]."""
    return int(min(hi, max(lo, budget_bytes // max(nbytes, 1))))


def _row(tier: str, op: str, impl: str, n: int, nbytes: int, times: list[float]) -> dict[str, Any]:
    arr = np.asarray(times)
    med = float(np.median(arr))
    return {"tier": tier, "op": op, "impl": impl, "num_tokens": n, "nbytes": nbytes,
            "gbps": nbytes / med / 1e9 if med > 0 else None,
            "p50_s": med, "p99_s": float(np.percentile(arr, 99)), "reps": len(times)}


def _timeit(fn: Callable[[int], None], reps: int, sync: Callable[[], None], clock: Callable[[], float]) -> list[float]:
    fn(-1)  # warm-up
    sync()
    out = []
    for i in range(reps):
        t0 = clock()
        fn(i)
        sync()
        out.append(clock() - t0)
    return out


class _Timer:
    """Times one (tier, op, impl, N) measurement into a row, repeating it while it is noisy."""

    def __init__(self, clock: Callable[[], float], probe: CpuProbe | None, thresholds: NoiseThresholds,
                 retries: int) -> None:
        self.clock, self.probe, self.thresholds, self.retries = clock, probe, thresholds, retries

    def row(self, tier: str, op: str, impl: str, n: int, nbytes: int, fn: Callable[[int], None], reps: int,
            sync: Callable[[], None] = lambda: None) -> dict[str, Any]:
        floor = None
        if tier == "host" and impl == "reference":  # memcpy: the hardware beats this for sure
            floor = nbytes / (self.thresholds.min_reference_gbps * 1e9)
        times, noise = measure_until_quiet(lambda: _timeit(fn, reps, sync, self.clock), probe=self.probe,
                                           thresholds=self.thresholds, retries=self.retries, max_p50_s=floor)
        return {**_row(tier, op, impl, n, nbytes, times), "noisy": noise["noisy"], "attempts": noise["attempts"],
                "noise": noise}


def _aligned(nbytes: int) -> tuple[mmap.mmap, memoryview]:
    m = mmap.mmap(-1, max(nbytes, mmap.PAGESIZE))
    return m, memoryview(m)[:nbytes]


def _odirect_probe(directory: str) -> str | None:
    """None if O_DIRECT works in ``directory``, else the reason."""
    if not hasattr(os, "O_DIRECT"):
        return "os.O_DIRECT not available on this platform"
    path = os.path.join(directory, "probe")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError as exc:
        return f"O_DIRECT open failed: {exc.strerror}"
    try:
        m, view = _aligned(4096)
        os.write(fd, view)
        del view
        m.close()
    except OSError as exc:
        return f"O_DIRECT write failed: {exc.strerror}"
    finally:
        os.close(fd)
        os.unlink(path)
    return None


def measure_tiers(
    tokens: Sequence[int] = DEFAULT_TOKENS,
    *,
    sync: bool = True,
    workdir: str | None = None,
    budget_bytes: int = 512 * MiB,
    advance: Callable[[int], None] | None = None,
    retries: int = 2,
    thresholds: NoiseThresholds = NoiseThresholds(),
    clock: Callable[[], float] = time.perf_counter,
    probe: CpuProbe | None = None,
) -> dict[str, Any]:
    """Measure every tier at every N in ``tokens``; see the module docstring.

    Args:
        tokens: entry sizes in tokens (each >= 1); bytes = N * 8192 * 2.
        sync: ``nvme.sync`` and ``fsync`` after the raw write.
        workdir: where the NVMe store and the raw files go (default: system temp dir). Put it on
            the disk you want to measure.
        budget_bytes: about how many bytes each (tier, op, N) moves (sets the repetitions).
        advance: called with 1 after each (N, tier) step.
        retries: extra attempts of a measurement that came out noisy (>= 0).
        thresholds: what counts as noisy (:class:`~ectier.bench.noise.NoiseThresholds`).
        clock: seconds, monotonic (injectable for tests).
        probe: other processes' CPU share (default: a ``/proc/stat`` :class:`~ectier.bench.noise.CpuProbe`).

    Returns:
        ``{"rows": [...], "skipped": [{"what", "reason"}], "sync": bool, "workdir": str,
        "noise": {"noisy_rows", "retries", "thresholds", "other_cpu" (whole run; None if unknown)}}``.

    Raises:
        ValueError: a token count < 1, or ``retries`` < 0.
        ConfigError: ``workdir``'s filesystem has too few free bytes for the NVMe rows.
        Errors from torch / LMDB / the OS propagate.
    """
    if any(n < 1 for n in tokens):
        raise ValueError(f"tokens: each must be >= 1, got {list(tokens)}")
    if retries < 0:
        raise ValueError(f"retries: must be >= 0, got {retries}")
    _check_room(workdir, tokens, budget_bytes)
    probe = probe if probe is not None else CpuProbe()
    timer = _Timer(clock, probe, thresholds, retries)
    run_probe = CpuProbe()
    run_probe.start()
    rows: list[dict[str, Any]] = []
    skipped: list[dict[str, str]] = []
    tmp = tempfile.mkdtemp(prefix="ectier-tiers-", dir=workdir)
    odirect = _odirect_probe(tmp)
    if odirect is not None:
        skipped.append({"what": "nvme reference-odirect", "reason": odirect})
    cuda = torch.cuda.is_available()
    if not cuda:
        skipped.append({"what": "gpu rows", "reason": "CUDA is not available"})
    try:
        for n in tokens:
            nbytes = n * WIDTH * 2
            reps = reps_for(nbytes, budget_bytes)
            keys = [f"k{i}" for i in range(reps + 1)]
            src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8).view(torch.bfloat16).view(n, WIDTH)
            rows.extend(_host_rows(timer, keys, src, n, nbytes, reps, cuda))
            if advance:
                advance(1)
            rows.extend(_nvme_rows(timer, tmp, keys, src, n, nbytes, reps, sync, odirect is None))
            if advance:
                advance(1)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    noise = {"noisy_rows": sum(r["noisy"] for r in rows), "retries": retries, "thresholds": thresholds.to_dict(),
             "other_cpu": run_probe.stop()}
    return {"rows": rows, "skipped": skipped, "sync": sync, "workdir": workdir or tempfile.gettempdir(), "noise": noise}


def _nvme_store_bytes(nbytes: int, reps: int) -> int:
    """The budget of the NVMe store :func:`_nvme_rows` opens (the most it writes under ``workdir``)."""
    return (reps + 2) * (nbytes + MiB)


def _check_room(workdir: str | None, tokens: Sequence[int], budget_bytes: int) -> None:
    """Refuse a run whose NVMe rows cannot fit under ``workdir``: on a small filesystem the raw
    reference write came out short (timed on fewer bytes) and the store's open failed naming
    ``nvme.capacity_bytes``, which no bench option sets."""
    where = workdir or tempfile.gettempdir()
    free = free_bytes(where)
    if free is None:
        return
    need, n = max((_nvme_store_bytes(n * WIDTH * 2, reps_for(n * WIDTH * 2, budget_bytes)), n) for n in tokens)
    if need > free:
        raise ConfigError(f"workdir (--workdir): the NVMe rows at N={n} need {need} bytes but {where!r} has "
                          f"{free} bytes free; choose a --workdir with room, or lower --budget-bytes or --tokens")


def _host_rows(timer: _Timer, keys: list[str], src: torch.Tensor, n: int, nbytes: int, reps: int,
               cuda: bool) -> list[dict[str, Any]]:
    """Host rows of one N: reference memcpy, then the host tier (and the GPU rows where CUDA is)."""
    dst = torch.empty_like(src)
    rows = [timer.row("host", "put", "reference", n, nbytes, lambda i: dst.copy_(src), reps),
            timer.row("host", "get", "reference", n, nbytes, lambda i: dst.copy_(src), reps)]
    cap = max(4 * MiB, 2 * nbytes + MiB)
    with TieredCache(CacheConfig(host=HostTierConfig(capacity_bytes=-(-cap // MiB) * MiB))) as c:
        rows.append(timer.row("host", "put", "ectier", n, nbytes, lambda i: c.put(keys[i + 1], src), reps))
        rows.append(timer.row("host", "get", "ectier", n, nbytes, lambda i: c.get(keys[reps], out=dst), reps))
        if cuda:
            rows.extend(_gpu_rows(timer, c, keys, src, n, nbytes, reps))
    return rows


def _nvme_rows(timer: _Timer, tmp: str, keys: list[str], src: torch.Tensor, n: int, nbytes: int, reps: int,
               sync: bool, odirect: bool) -> list[dict[str, Any]]:
    """NVMe rows of one N: raw file write (+ fsync when ``sync``) and read, O_DIRECT where
    ``odirect``, then the NVMe tier alone, every file under ``tmp``."""
    dst = torch.empty_like(src)
    path = os.path.join(tmp, "raw.bin")
    buf = src.view(-1).view(torch.uint8).numpy()
    rbuf = bytearray(nbytes)

    def raw_write(i: int) -> None:
        with open(path, "wb", buffering=0) as f:
            f.write(buf)
            if sync:
                os.fsync(f.fileno())

    def raw_read(i: int) -> None:
        with open(path, "rb", buffering=0) as f:
            f.readinto(rbuf)

    rows = [timer.row("nvme", "put", "reference", n, nbytes, raw_write, reps),
            timer.row("nvme", "get", "reference", n, nbytes, raw_read, reps)]
    if odirect:
        rows.extend(_odirect_rows(timer, path, buf, n, nbytes, reps, sync))
    os.unlink(path)
    store = os.path.join(tmp, f"lmdb-{n}")
    cfg = CacheConfig(host=HostTierConfig(capacity_bytes=0),
                      nvme=NvmeTierConfig(path=store, capacity_bytes=_nvme_store_bytes(nbytes, reps),
                                          sync=sync, flush_on_close=False))
    with TieredCache(cfg) as c:
        rows.append(timer.row("nvme", "put", "ectier", n, nbytes, lambda i: c.put(keys[i + 1], src), reps))
        rows.append(timer.row("nvme", "get", "ectier", n, nbytes, lambda i: c.get(keys[reps], out=dst), reps))
    shutil.rmtree(store, ignore_errors=True)
    return rows


def _odirect_rows(timer: _Timer, path: str, buf: np.ndarray, n: int, nbytes: int, reps: int,
                  sync: bool) -> list[dict[str, Any]]:
    size = -(-nbytes // 4096) * 4096  # O_DIRECT moves whole aligned blocks
    m, view = _aligned(size)
    view[:nbytes] = buf.tobytes() if nbytes < 1 << 20 else memoryview(buf)

    def w(i: int, view: memoryview = view) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o600)
        try:
            os.write(fd, view)
            if sync:
                os.fsync(fd)
        finally:
            os.close(fd)

    def r(i: int, view: memoryview = view) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
        try:
            os.readv(fd, [view])
        finally:
            os.close(fd)

    out = [timer.row("nvme", "put", "reference-odirect", n, nbytes, w, reps),
           timer.row("nvme", "get", "reference-odirect", n, nbytes, r, reps)]
    del w, r, view  # the buffer's exports go before the map closes
    m.close()
    return out


def _gpu_rows(timer: _Timer, c: TieredCache, keys: list[str], src: torch.Tensor, n: int, nbytes: int,
              reps: int) -> list[dict]:
    dev = torch.device("cuda:0")
    sync = lambda: torch.cuda.synchronize(dev)  # noqa: E731
    pinned = src.pin_memory()
    gsrc = src.to(dev)
    gdst = torch.empty_like(gsrc)
    rows = [
        timer.row("gpu", "h2d", "reference", n, nbytes, lambda i: gdst.copy_(pinned, non_blocking=True), reps, sync),
        timer.row("gpu", "d2h", "reference", n, nbytes, lambda i: pinned.copy_(gsrc, non_blocking=True), reps, sync),
        timer.row("gpu", "h2d", "ectier", n, nbytes, lambda i: c.get(keys[reps], device="cuda:0"), reps, sync),
        timer.row("gpu", "d2h", "ectier", n, nbytes, lambda i: c.put(keys[i + 1], gsrc), reps, sync),
    ]
    return rows
