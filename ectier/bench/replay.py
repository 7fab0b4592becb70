"""Replay a request stream through a :class:`~ectier.cache.TieredCache` and count what it saved.

Per request: ``get(mm_hash)``; on a hit the bytes are checked (shape + three 256-byte windows
against the entry's known bytes) and the encoder time of that image is *saved*; on a miss the
encoder would run (its cost is *spent*, from the :class:`~ectier.bench.costmodel.CostModel`)
and the output is ``put`` with ``cost_s`` = that cost (used by GDSF, ignored by LRU).

Entries are synthetic bytes of the right shape, ``(N, embed_dim / width_scale)`` bfloat16:
a view into one random byte pool at an offset derived from ``mm_hash`` (so making an entry costs
no copy, and a hit is verified cheaply). Gets copy into a preallocated buffer (``get(out=...)``)
so that page-faulting fresh memory is not counted as cache time.

``width_scale > 1`` divides every entry's width *and* both budgets (and the host block size) by
the same factor: the token counts, the cost model and therefore every eviction decision stay the
same (up to block rounding), while the bytes copied shrink. The hit-rate-vs-capacity curve uses
it to stay fast; its latencies are not reported.
"""

from __future__ import annotations

import hashlib
import shutil
import dataclasses
import tempfile
import time
from typing import Any, Callable, Sequence

import numpy as np
import torch

from ..cache import TieredCache
from ..config import CacheConfig, HostTierConfig, NvmeTierConfig
from ..errors import ConfigError, EntryTooLargeError, TierWriteError
from .costmodel import CostModel
from .workload import Request

__all__ = ["EntryFactory", "replay_stream", "percentile", "default_budgets", "CURVE_FRACTIONS"]

MiB = 1 << 20
#: Total (host + NVMe) budgets of the capacity curve, as fractions of the stream's unique bytes.
CURVE_FRACTIONS = (0.05, 0.1, 0.2, 0.35, 0.6)
#: Host share of a total budget (the rest is NVMe).
HOST_SHARE = 0.25
_WINDOW = 256
_OFFSETS = 1 << 15


def percentile(values: Sequence[float], q: float) -> float | None:
    """``q``-th percentile (0..100) of ``values`` (linear interpolation); None if empty."""
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else None


def default_budgets(unique_bytes: int, fraction: float = 0.2) -> tuple[int, int]:
    """(host_bytes, nvme_bytes) for a total of ``fraction`` x ``unique_bytes`` (the working set),
    ``HOST_SHARE`` of it on the host; each rounded up to whole MiB, at least 4 MiB."""
    total = unique_bytes * fraction
    host = max(4 * MiB, -(-int(total * HOST_SHARE) // MiB) * MiB)
    nvme = max(4 * MiB, -(-int(total * (1 - HOST_SHARE)) // MiB) * MiB)
    return host, nvme


class EntryFactory:
    """Synthetic encoder outputs: ``(N, width)`` bfloat16 views into one random byte pool.

    Args:
        max_nbytes: the largest entry, in bytes (the pool is this plus 64 KiB).
        width: columns per token (8192 for Qwen3-VL; smaller when scaled).
        seed: pool contents.
    """

    def __init__(self, max_nbytes: int, width: int, seed: int = 0) -> None:
        self.width = width
        rng = np.random.default_rng(seed)
        self.pool = torch.from_numpy(np.frombuffer(bytearray(rng.bytes(max_nbytes + 2 * _OFFSETS)), dtype=np.uint8))
        self.scratch = torch.empty(max_nbytes, dtype=torch.uint8)

    @staticmethod
    def offset(mm_hash: str) -> int:
        """Even byte offset into the pool, a function of ``mm_hash`` only."""
        return 2 * (int.from_bytes(hashlib.blake2b(mm_hash.encode(), digest_size=8).digest(), "little") % _OFFSETS)

    def nbytes(self, num_tokens: int) -> int:
        """Bytes of an entry of ``num_tokens`` rows."""
        return num_tokens * self.width * 2

    def entry(self, mm_hash: str, num_tokens: int) -> torch.Tensor:
        """The entry of ``mm_hash``: ``(num_tokens, width)`` bfloat16, a view (do not write to it)."""
        off = self.offset(mm_hash)
        return self.pool[off: off + self.nbytes(num_tokens)].view(torch.bfloat16).view(num_tokens, self.width)

    def out(self, num_tokens: int) -> torch.Tensor:
        """A reusable ``(num_tokens, width)`` bfloat16 buffer for ``get(out=...)``."""
        return self.scratch[: self.nbytes(num_tokens)].view(torch.bfloat16).view(num_tokens, self.width)

    def check(self, mm_hash: str, num_tokens: int, got: torch.Tensor) -> bool:
        """True if ``got`` has the entry's shape and its first, middle and last 256 bytes match."""
        if got.dtype != torch.bfloat16 or tuple(got.shape) != (num_tokens, self.width):
            return False
        n = self.nbytes(num_tokens)
        if n == 0:
            return True
        b = got.reshape(-1).view(torch.uint8)
        off = self.offset(mm_hash)
        for start in {0, max(0, n // 2 - _WINDOW // 2), max(0, n - _WINDOW)}:
            end = min(n, start + _WINDOW)
            if not torch.equal(b[start:end], self.pool[off + start: off + end]):
                return False
        return True


def _host_block(width_scale: int) -> int:
    block = (256 * 1024) // width_scale
    return max(4096, 1 << (block.bit_length() - 1))


def _scaled_config(policy: str, host_bytes: int, nvme_bytes: int, width_scale: int, sync: bool,
                   codec: str) -> tuple[CacheConfig, int]:
    """The replay's cache config at ``1 / width_scale`` of the budgets, and the scaled NVMe budget.

    The host tier's write-behind is off (``write_behind_fraction=0``): its background writes
    would take NVMe budget at moments that vary from run to run (and, with ``admit_wait_s=0``, a
    put finding the budget held would be refused), so the same seed would not give the same
    decisions. The NVMe path is a placeholder (``"/nonexistent"``, or ``None`` when the scaled NVMe budget is
    not positive) so that the budgets are validated before anything is created on disk.

    Raises:
        ConfigError: budgets too small for a block.
    """
    block = _host_block(width_scale)
    hb = (host_bytes // width_scale) // block * block
    nb = nvme_bytes // width_scale
    cfg = CacheConfig(
        host=HostTierConfig(capacity_bytes=hb, block_bytes=block, policy=policy, admit_wait_s=0.0,
                            write_behind_fraction=0.0),
        nvme=NvmeTierConfig(path="/nonexistent" if nb > 0 else None, capacity_bytes=max(nb, 0), codec=codec,
                            sync=sync, flush_on_close=False, policy=policy, map_initial_bytes=64 * MiB),
    )
    return cfg, nb


class _Tally:
    """What one replay counted: ``n`` counts, ``b`` bytes (at full width), ``enc`` encoder seconds
    (from the cost model) and ``lat`` latency samples in seconds."""

    def __init__(self) -> None:
        self.n = dict(hits=0, host_hits=0, nvme_hits=0, misses=0, mismatches=0, put_refused=0)
        self.b = dict(requested=0, hit=0, host_hit=0, nvme_hit=0, put=0)
        self.enc = dict(total=0.0, saved=0.0, spent=0.0)
        self.lat: dict[str, list[float]] = dict(get=[], hit=[], host=[], nvme=[], put=[])


def _serve(cache: TieredCache, factory: EntryFactory, r: Request, width: int, cost: CostModel,
           tally: _Tally) -> None:
    """One request: ``get``; on a hit check the bytes, on a miss ``put`` the entry (refusals counted)."""
    n, b, enc, lat = tally.n, tally.b, tally.enc, tally.lat
    full = r.num_tokens * width * 2
    c = cost.seconds(r.num_tokens)
    enc["total"] += c
    b["requested"] += full
    before = cache.stats()["tiers"].get("host", {}).get("hits", 0)
    t0 = time.perf_counter()
    got = cache.get(r.mm_hash, out=factory.out(r.num_tokens))
    dt = time.perf_counter() - t0
    lat["get"].append(dt)
    if got is not None:
        tier = "host" if cache.stats()["tiers"].get("host", {}).get("hits", 0) > before else "nvme"
        if not factory.check(r.mm_hash, r.num_tokens, got):
            n["mismatches"] += 1
        n["hits"] += 1
        n[f"{tier}_hits"] += 1
        b["hit"] += full
        b[f"{tier}_hit"] += full
        lat["hit"].append(dt)
        lat[tier].append(dt)
        enc["saved"] += c
    else:
        n["misses"] += 1
        enc["spent"] += c
        t0 = time.perf_counter()
        try:
            cache.put(r.mm_hash, factory.entry(r.mm_hash, r.num_tokens), cost_s=c)
            b["put"] += full
        except (EntryTooLargeError, TierWriteError):
            n["put_refused"] += 1  # a connector logs and goes on: the entry is not cached
        lat["put"].append(time.perf_counter() - t0)


def _metrics(tally: _Tally, st: dict[str, Any], requests: int, wall: float, *, policy: str, host_bytes: int,
             nvme_bytes: int, width_scale: int) -> dict[str, Any]:
    """The dict :func:`replay_stream` returns, from its tally and the cache's final tier stats."""
    n, b, enc, lat = tally.n, tally.b, tally.enc, tally.lat
    rb = b["requested"] or 1
    nv = st.get("nvme", {})
    return {
        "policy": policy,
        "host_bytes": host_bytes,
        "nvme_bytes": nvme_bytes,
        "width_scale": width_scale,
        "held_host_bytes": int(st.get("host", {}).get("capacity_bytes", 0)),
        "held_nvme_bytes": int(st.get("nvme", {}).get("capacity_bytes", 0)),
        "requests": requests,
        **n,
        "requested_bytes": b["requested"],
        "hit_bytes": b["hit"],
        "host_hit_bytes": b["host_hit"],
        "nvme_hit_bytes": b["nvme_hit"],
        "put_bytes": b["put"],
        "demoted_bytes": int(nv.get("put_bytes", 0)) * width_scale,
        "promotions": int(st.get("host", {}).get("promotions", 0)),
        "bytes_moved": b["hit"] + b["put"] + int(nv.get("put_bytes", 0)) * width_scale,
        "hit_rate": n["hits"] / requests,
        "host_hit_rate": n["host_hits"] / requests,
        "nvme_hit_rate": n["nvme_hits"] / requests,
        "byte_hit_rate": b["hit"] / rb,
        "host_byte_hit_rate": b["host_hit"] / rb,
        "nvme_byte_hit_rate": b["nvme_hit"] / rb,
        "encoder_total_s": enc["total"],
        "encoder_saved_s": enc["saved"],
        "encoder_spent_s": enc["spent"],
        "saved_fraction": enc["saved"] / enc["total"] if enc["total"] else 0.0,
        "get_s": sum(lat["get"]),
        "put_s": sum(lat["put"]),
        "get_hit_p50_s": percentile(lat["hit"], 50),
        "get_hit_p99_s": percentile(lat["hit"], 99),
        "get_host_p50_s": percentile(lat["host"], 50),
        "get_nvme_p50_s": percentile(lat["nvme"], 50),
        "get_p99_s": percentile(lat["get"], 99),
        "put_p50_s": percentile(lat["put"], 50),
        "put_p99_s": percentile(lat["put"], 99),
        "wall_s": wall,
    }


def replay_stream(
    stream: Sequence[Request],
    cost: CostModel,
    *,
    policy: str = "lru",
    host_bytes: int,
    nvme_bytes: int,
    width: int = 8192,
    width_scale: int = 1,
    sync: bool = False,
    codec: str = "raw",
    workdir: str | None = None,
    factory: EntryFactory | None = None,
    advance: Callable[[int], None] | None = None,
) -> dict[str, Any]:
    """Replay ``stream`` through a fresh TieredCache (host + NVMe) and return its metrics.

    Args:
        stream: the requests (token counts decide the shapes; ``Request.nbytes`` is not used).
        cost: recompute seconds per image.
        policy: ``"lru"`` or ``"gdsf"``, for both tiers.
        host_bytes, nvme_bytes: budgets in bytes at full width (divided by ``width_scale`` here);
            ``nvme_bytes = 0`` disables the NVMe tier.
        width: full entry width (columns); entries are ``(N, width // width_scale)`` bfloat16.
        width_scale: see the module docstring (1 = real sizes).
        sync: ``nvme.sync`` (fsync each commit). Default False: page-cache speed, crash-safe but
            not power-loss durable, which is what a cache needs.
        codec: ``nvme.codec``.
        workdir: parent directory of the temporary NVMe store (default: the system temp dir).
        factory: reuse an :class:`EntryFactory` of the right width across calls.
        advance: called with 1 after each request (progress bars).

    Returns:
        A dict: the budgets (``host_bytes``, ``nvme_bytes`` as given, at full width;
        ``held_host_bytes``, ``held_nvme_bytes``: the capacities the cache had, 1 / ``width_scale``
        of them, the host's rounded down to its block), counts (``requests, hits, host_hits, nvme_hits, misses, mismatches,
        put_refused``), bytes (``requested_bytes, hit_bytes, host_hit_bytes, nvme_hit_bytes,
        put_bytes, demoted_bytes, promotions``, at full width), rates (``hit_rate,
        host_hit_rate, nvme_hit_rate, byte_hit_rate, host_byte_hit_rate, nvme_byte_hit_rate``
        in [0, 1]), seconds (``encoder_total_s`` = no cache, ``encoder_saved_s``,
        ``encoder_spent_s``, ``saved_fraction``, ``get_s``, ``put_s``, ``wall_s``) and latency
        percentiles in seconds (``get_hit_p50_s, get_hit_p99_s, get_host_p50_s, get_nvme_p50_s,
        get_p99_s``, ``put_p50_s, put_p99_s``; None without samples).

    Raises:
        ConfigError: budgets too small for a block. ValueError: an empty ``stream``, a ``width_scale``
            that does not divide ``width``. Errors from torch/LMDB propagate.
    """
    if width % width_scale:
        raise ValueError(f"width_scale: {width_scale} does not divide width {width}")
    if not stream:
        raise ValueError("stream: no request to replay")
    w = width // width_scale
    max_tokens = max(r.num_tokens for r in stream)
    if factory is None or factory.width != w or factory.scratch.numel() < max_tokens * w * 2:
        factory = EntryFactory(max_tokens * w * 2, w)
    cfg, nb = _scaled_config(policy, host_bytes, nvme_bytes, width_scale, sync, codec)
    tmp = tempfile.mkdtemp(prefix="ectier-bench-", dir=workdir)
    if nb > 0:
        cfg = cfg.replace(nvme=dataclasses.replace(cfg.nvme, path=tmp))
    tally = _Tally()
    t_start = time.perf_counter()
    try:
        cache = TieredCache(cfg)
    except ConfigError as exc:  # a budget this machine cannot hold: name the bench's own option
        shutil.rmtree(tmp, ignore_errors=True)
        raise ConfigError(_as_option(str(exc))) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    try:
        for r in stream:
            _serve(cache, factory, r, width, cost, tally)
            if advance is not None:
                advance(1)
        st = cache.stats()["tiers"]
    finally:
        cache.close()
        shutil.rmtree(tmp, ignore_errors=True)
    wall = time.perf_counter() - t_start
    return _metrics(tally, st, len(stream), wall, policy=policy, host_bytes=host_bytes, nvme_bytes=nvme_bytes,
                    width_scale=width_scale)


def _as_option(message: str) -> str:
    """A cache's refusal of a budget, restated for the bench's options (``--host-bytes``,
    ``--nvme-bytes``; the bench has no other config knob to point at)."""
    for knob, option in (("host.capacity_bytes", "--host-bytes"), ("nvme.capacity_bytes", "--nvme-bytes")):
        if message.startswith(knob):
            first = message.split("; lower ")[0].split(": [enforce fail")[0]
            return f"{option} ({knob}): {first.removeprefix(knob + ': ')}; lower {option}"
    return message
