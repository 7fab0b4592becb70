"""The ``ectier demo`` replay: serve a request stream from ectier and the baseline, verify every hit.

Each request is served by both stores back to back, in alternating order (:func:`replay`); each
side (:class:`EctierSide`, :class:`BaselineSide`) counts hits, bytes and the seconds spent inside
its store's calls, and every hit is compared byte for byte with a fresh recomputation by the
stand-in encoder (:func:`same_bytes`). :func:`speedup` compares the two sides per byte moved, and
:func:`by_size` per entry size.

A load is what each store's consumer does, then the consumer's read of every byte:

- ectier, as its vLLM connector loads on the CPU: ``acquire`` (a lease on the host-arena slot;
  an NVMe hit is first decoded straight into the host slot it is promoted into), ``load(lease,
  view=True)`` (a zero-copy read-only view, pinned while it lives), ``release``; an entry that
  cannot be leased (larger than the host budget) is read with ``get``;
- the baseline, as ``ECExampleConnector`` loads: ``os.path.exists`` + ``safetensors.torch.load_file``
  (on the CPU a lazy map of the file, which is in the page cache);
- then on both sides :class:`Touch`: every byte copied into one warm destination buffer (what
  vLLM's embedding gather does with a loaded tensor), inside the timed load.
"""

from __future__ import annotations

import time
from typing import Any, Optional, Sequence

import torch
from rich.progress import Progress

from .cache import TieredCache
from .demo_baseline import SafetensorsPerItemStore
from .demo_encoder import StandInEncoder
from .demo_workload import DemoImage
from .errors import EntryTooLargeError, TierWriteError

__all__ = ["BaselineSide", "EctierSide", "Touch", "by_size", "replay", "same_bytes", "speedup"]


def _gbps(nbytes: float, seconds: float) -> Optional[float]:
    return nbytes / seconds / 1e9 if seconds > 0 and nbytes > 0 else None


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Byte-exact equality, including dtype and shape (NaN payloads and -0.0 compared as bits)."""
    if a.dtype != b.dtype or tuple(a.shape) != tuple(b.shape):
        return False
    if a.numel() == 0:
        return True
    a8 = a.contiguous().reshape(-1).view(torch.uint8)
    b8 = b.contiguous().reshape(-1).view(torch.uint8)
    for wide in (torch.int64, torch.int32):  # same bits, fewer elements: several times faster
        if a8.numel() % wide.itemsize == 0:
            try:
                return torch.equal(a8.view(wide), b8.view(wide))
            except RuntimeError:  # storage offset not aligned to the wider type
                break
    return torch.equal(a8, b8)


class Touch:
    """The consumer's read of a loaded tensor: every byte copied into one warm destination.

    Args:
        nbytes: the largest entry in bytes; the destination (a flat ``uint8`` CPU tensor) is
            allocated and faulted in once, here, so no load pays its page faults.
    """

    def __init__(self, nbytes: int) -> None:
        self.dst = torch.ones(max(int(nbytes), 1), dtype=torch.uint8)

    def __call__(self, t: torch.Tensor) -> None:
        """Copy every byte of the contiguous CPU tensor ``t`` (at most ``nbytes``) into the destination."""
        flat = t.reshape(-1).view(torch.uint8)
        self.dst[: flat.numel()].copy_(flat)


class _BySize:
    """Load seconds and bytes per entry size (bytes)."""

    def __init__(self) -> None:
        self.rows: dict[int, list[float]] = {}  # nbytes -> [loads, bytes, seconds]

    def add(self, nbytes: int, seconds: float) -> None:
        row = self.rows.setdefault(nbytes, [0, 0, 0.0])
        row[0] += 1
        row[1] += nbytes
        row[2] += seconds


class EctierSide:
    """The ectier half of the replay: lease + view + touch; on a miss ``put`` (counts, bytes,
    seconds in the calls).

    Args:
        cache: the cache under test. touch: the consumer's read (:class:`Touch`), timed inside
            the load.
    """

    def __init__(self, cache: TieredCache, touch: Touch) -> None:
        self.cache = cache
        self.touch = touch
        self.sizes = _BySize()
        self.tier_sizes = {"host": _BySize(), "nvme": _BySize()}  # the same loads, by the tier that served them
        self.n = dict(hits=0, misses=0, host_hits=0, nvme_hits=0, mismatches=0, puts=0, put_refused=0)
        self.b = dict(requested=0, hit=0, host_hit=0, nvme_hit=0, put=0)
        self.t = dict(get=0.0, get_host=0.0, get_nvme=0.0, get_miss=0.0, put=0.0, encode_miss=0.0, encode_saved=0.0)
        self.refusals: dict[str, str] = {}  # error class -> first message
        self.mismatched: list[dict[str, Any]] = []

    def _load(self, key: str) -> Optional[torch.Tensor]:
        """What ectier's connector does on the CPU: a lease, a view of it, the lease released (the
        view keeps its own pin while it lives); ``get`` where no lease can be had; then the touch."""
        cache = self.cache
        lease = cache.acquire(key)
        if lease is not None:
            try:
                out = cache.load(lease, view=True)
            finally:
                cache.release(lease)
        elif cache.contains(key):  # stored, yet not leasable (larger than the host budget)
            out = cache.get(key)  # a copy straight from NVMe
        else:
            return None
        if out is not None:
            self.touch(out)
        return out

    def load(self, key: str) -> tuple[Optional[torch.Tensor], str]:
        """Lease + view + touch: ``(tensor, "host" | "nvme")`` on a hit, ``(None, "")`` on a miss.

        The tensor is a read-only view of the host arena, pinned until it is freed."""
        host_before = self.cache.stats()["tiers"].get("host", {}).get("hits", 0)
        t0 = time.perf_counter()
        out = self._load(key)
        dt = time.perf_counter() - t0
        self.t["get"] += dt
        if out is None:
            self.n["misses"] += 1
            self.t["get_miss"] += dt
            return None, ""
        nbytes = out.numel() * out.element_size()
        tier = "host" if self.cache.stats()["tiers"].get("host", {}).get("hits", 0) > host_before else "nvme"
        self.n["hits"] += 1
        self.n[f"{tier}_hits"] += 1
        self.b["hit"] += nbytes
        self.b[f"{tier}_hit"] += nbytes
        self.t[f"get_{tier}"] += dt
        self.sizes.add(nbytes, dt)
        self.tier_sizes[tier].add(nbytes, dt)
        return out, tier

    def save(self, key: str, tensor: torch.Tensor) -> None:
        """``cache.put(key, tensor)``; a put the cache refuses is counted, not raised."""
        t0 = time.perf_counter()
        try:
            self.cache.put(key, tensor)
        except (EntryTooLargeError, TierWriteError) as exc:
            # what a connector does: the entry is not cached, the request goes on
            self.t["put"] += time.perf_counter() - t0
            self.n["put_refused"] += 1
            self.refusals.setdefault(type(exc).__name__, str(exc))
            return
        self.t["put"] += time.perf_counter() - t0
        self.n["puts"] += 1
        self.b["put"] += tensor.numel() * tensor.element_size()

    def summary(self, requests: int) -> dict[str, Any]:
        """Counts, bytes, seconds and GB/s (1e9 bytes; ``None`` without bytes or time) of ``requests``."""
        n, b, t = self.n, self.b, self.t
        return {
            "requests": requests,
            "hits": n["hits"],
            "misses": n["misses"],
            "host_hits": n["host_hits"],
            "nvme_hits": n["nvme_hits"],
            "hit_rate": n["hits"] / requests,
            "requested_bytes": b["requested"],
            "hit_bytes": b["hit"],
            "byte_hit_rate": b["hit"] / b["requested"] if b["requested"] else 0.0,
            "host_hit_bytes": b["host_hit"],
            "nvme_hit_bytes": b["nvme_hit"],
            "puts": n["puts"],
            "put_bytes": b["put"],
            "put_refused": n["put_refused"],
            "put_refusal_reasons": self.refusals,
            "get_s": t["get"],
            "get_host_s": t["get_host"],
            "get_nvme_s": t["get_nvme"],
            "get_miss_s": t["get_miss"],
            "put_s": t["put"],
            "cache_s": t["get"] + t["put"],
            "get_gbps": _gbps(b["hit"], t["get"]),
            "get_host_gbps": _gbps(b["host_hit"], t["get_host"]),
            "get_nvme_gbps": _gbps(b["nvme_hit"], t["get_nvme"]),
            "put_gbps": _gbps(b["put"], t["put"]),
            "encoder_s": t["encode_miss"],
            "encoder_saved_s": t["encode_saved"],
            "mismatches": n["mismatches"],
            "mismatch_examples": self.mismatched,
        }


class BaselineSide:
    """The safetensors-per-item half of the replay: ``has`` + ``load`` + touch; on a miss ``save``.

    Args:
        store: the baseline store. touch: the consumer's read (:class:`Touch`, the same object
            as ectier's), timed inside the load.
    """

    def __init__(self, store: SafetensorsPerItemStore, touch: Touch) -> None:
        self.store = store
        self.touch = touch
        self.sizes = _BySize()
        self.hits = self.misses = self.mismatches = 0
        self.hit_bytes = self.save_bytes = 0
        self.load_s = self.save_s = self.encode_s = 0.0

    def load(self, key: str) -> Optional[torch.Tensor]:
        """``store.has`` + ``store.load`` (the lazy map, as the connector gets it) + touch: the
        tensor, or ``None`` on a miss."""
        t0 = time.perf_counter()
        out = self.store.load(key, materialize=False) if self.store.has(key) else None
        if out is not None:
            self.touch(out)
        dt = time.perf_counter() - t0
        self.load_s += dt
        if out is None:
            self.misses += 1
        else:
            nbytes = out.numel() * out.element_size()
            self.hits += 1
            self.hit_bytes += nbytes
            self.sizes.add(nbytes, dt)
        return out

    def save(self, key: str, tensor: torch.Tensor) -> None:
        """``store.save(key, tensor)`` (errors propagate)."""
        t0 = time.perf_counter()
        self.store.save(key, tensor)
        self.save_s += time.perf_counter() - t0
        self.save_bytes += tensor.numel() * tensor.element_size()

    def summary(self, requests: int) -> dict[str, Any]:
        """Counts, bytes, seconds and GB/s (1e9 bytes; ``None`` without bytes or time) of ``requests``."""
        return {
            "requests": requests,
            "hits": self.hits,
            "misses": self.misses,
            "hit_bytes": self.hit_bytes,
            "save_bytes": self.save_bytes,
            "load_s": self.load_s,
            "save_s": self.save_s,
            "cache_s": self.load_s + self.save_s,
            "load_gbps": _gbps(self.hit_bytes, self.load_s),
            "save_gbps": _gbps(self.save_bytes, self.save_s),
            "encoder_s": self.encode_s,
            "mismatches": self.mismatches,
        }


def replay(stream: Sequence[int], images: Sequence[DemoImage], encoder: StandInEncoder, ect: EctierSide,
           base: Optional[BaselineSide], progress: Progress) -> float:
    """Replay ``stream`` through ectier (and the baseline, request by request); returns wall seconds.

    Each request is served by both stores back to back, in alternating order, so that both see
    the same machine state (allocator, page cache, other load) and neither always goes first. The
    encoder runs once per request: on an ectier miss to produce the entry, on an ectier hit to
    recompute it for verification; the baseline reuses that tensor for its save or its check.
    """
    wall0 = time.perf_counter()
    what = "ectier + safetensors" if base is not None else "ectier (host → NVMe)"
    task = progress.add_task(what, total=len(stream), info="")
    for step, idx in enumerate(stream):
        img = images[idx]
        base_first = base is not None and step % 2 == 1
        base_out = base.load(img.mm_hash) if base_first else None
        out, tier = ect.load(img.mm_hash)
        if base is not None and not base_first:
            base_out = base.load(img.mm_hash)
        ect_missed, base_missed = out is None, base is not None and base_out is None
        t0 = time.perf_counter()
        ref = encoder.encode(img.pixels)  # a miss computes it; a hit saved exactly this work
        encode_s = time.perf_counter() - t0
        ect.b["requested"] += ref.numel() * ref.element_size()
        if ect_missed:
            ect.t["encode_miss"] += encode_s
        else:
            ect.t["encode_saved"] += encode_s
            if not same_bytes(out, ref):
                ect.n["mismatches"] += 1
                if len(ect.mismatched) < 10:
                    ect.mismatched.append({"request": step, "image": img.name, "mm_hash": img.mm_hash, "tier": tier})
        if base is not None:
            if base_missed:
                base.encode_s += encode_s
            elif not same_bytes(base_out, ref):
                base.mismatches += 1
        del out, base_out
        if base_first and base_missed:
            base.save(img.mm_hash, ref)
        if ect_missed:
            ect.save(img.mm_hash, ref)
        if base_missed and not base_first:
            base.save(img.mm_hash, ref)
        progress.update(task, advance=1, info=f"hits {ect.n['hits']}  mismatches {ect.n['mismatches']}")
    return time.perf_counter() - wall0


def _ratio(baseline_s: float, baseline_bytes: int, ectier_s: float, ectier_bytes: int) -> Optional[float]:
    """How many times faster ectier moves a byte than the baseline (seconds per byte ratio)."""
    if min(baseline_s, ectier_s) <= 0 or min(baseline_bytes, ectier_bytes) <= 0:
        return None
    return (baseline_s / baseline_bytes) / (ectier_s / ectier_bytes)


def speedup(ect: dict[str, Any], base: Optional[dict[str, Any]]) -> Optional[dict[str, Optional[float]]]:
    """Baseline seconds per byte / ectier seconds per byte for ``load``, ``save`` and ``total``.

    ``ect`` and ``base`` are :meth:`EctierSide.summary` and :meth:`BaselineSide.summary`; ``None``
    without a baseline, and a ratio is ``None`` where either side moved no byte or took no time.
    """
    if base is None:
        return None
    return {
        "load": _ratio(base["load_s"], base["hit_bytes"], ect["get_s"], ect["hit_bytes"]),
        "save": _ratio(base["save_s"], base["save_bytes"], ect["put_s"], ect["put_bytes"]),
        "total": _ratio(base["cache_s"], base["hit_bytes"] + base["save_bytes"],
                        ect["cache_s"], ect["hit_bytes"] + ect["put_bytes"]),
    }


def by_size(ect: EctierSide, base: Optional[BaselineSide]) -> list[dict[str, Any]]:
    """Loads per entry size, smallest first: ``nbytes``, ``ectier_loads``, ``ectier_s``,
    ``ectier_gbps``, ``host_loads``/``host_gbps`` and ``nvme_loads``/``nvme_gbps`` (the same
    loads by the tier that served them), ``baseline_loads``, ``baseline_s``, ``baseline_gbps``
    (``None`` without a baseline or a load) and ``speedup`` (baseline seconds per byte / ectier's;
    ``None`` where either side loaded nothing of that size). Seconds include the touch."""
    rows = []
    sizes = set(ect.sizes.rows) | (set(base.sizes.rows) if base is not None else set())
    for nb in sorted(sizes):
        e = ect.sizes.rows.get(nb, [0, 0, 0.0])
        b = base.sizes.rows.get(nb, [0, 0, 0.0]) if base is not None else [0, 0, 0.0]
        by_tier = {}
        for tier, tier_rows in ect.tier_sizes.items():
            t = tier_rows.rows.get(nb, [0, 0, 0.0])
            by_tier[f"{tier}_loads"], by_tier[f"{tier}_gbps"] = int(t[0]), _gbps(t[1], t[2])
        rows.append({"nbytes": nb, "ectier_loads": int(e[0]), "ectier_s": e[2], "ectier_gbps": _gbps(e[1], e[2]), **by_tier,
                     "baseline_loads": int(b[0]), "baseline_s": b[2], "baseline_gbps": _gbps(b[1], b[2]),
                     "speedup": _ratio(b[2], int(b[1]), e[2], int(e[1])) if base is not None else None})
    return rows
