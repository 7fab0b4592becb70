"""Remote-tier read rows for ``ectier bench crossover --remote-config FILE``.

For each N, ``reps`` distinct ``(N, 8192)`` bf16 entries are put through a :class:`TieredCache` on the
config's remote tier (write-through) with a host tier big enough for them and no NVMe tier, flushed,
and the cache closed; a fresh cache on the same config then ``get`` s each entry once: every get is a
remote hit (fetch, checksum, copy into the host tier and out), timed. Each get is checked bitwise.
Rows have the shape of :func:`ectier.bench.tiers.measure_tiers` rows (``tier="remote"``,
``op="get"``, ``impl="ectier"``), so :func:`ectier.bench.crossover.crossover` reads them like the others.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch

from ..cache import TieredCache
from ..config import CacheConfig, HostTierConfig, NvmeTierConfig
from ..errors import ConfigError
from .tiers import _row, reps_for

__all__ = ["measure_remote", "RemoteUnreachable"]

MiB = 1 << 20


class RemoteUnreachable(RuntimeError):
    """No write-through reached the remote store (it is down, or refuses): nothing to measure."""


def _check_reached(cache: TieredCache, config: CacheConfig, n_puts: int) -> None:
    """Raise :class:`RemoteUnreachable` (naming the store) when none of ``n_puts`` reached it."""
    st = cache.stats()["tiers"].get("remote", {})
    if st.get("puts", 0) == 0 and n_puts:
        failed = {k: st.get(k, 0) for k in ("errors", "timeouts", "skipped_degraded", "skipped_node_down")}
        raise RemoteUnreachable(
            f"remote store {config.remote.backend} at {config.remote.addresses or '-'} is unreachable: none of "
            f"{n_puts} puts reached it ({', '.join(f'{k} {v}' for k, v in failed.items())})")


def measure_remote(config: CacheConfig, tokens: Sequence[int], *, budget_bytes: int = 256 * MiB,
                   open_cache: Callable[[CacheConfig], TieredCache] = TieredCache) -> list[dict[str, Any]]:
    """Remote ``get`` rows, one per N in ``tokens`` (see the module docstring).

    Args:
        config: a config whose ``remote.backend`` is not ``"none"``; its host and NVMe tiers are
            replaced (host: room for one N's entries, unpinned; NVMe: off).
        tokens: entry sizes N.
        budget_bytes: about how many bytes each N moves (3..30 entries).
        open_cache: opens a cache on a config (tests pass one on an in-memory backend).

    Raises:
        ConfigError: no remote tier configured. RemoteUnreachable: no put reached the store.
        RuntimeError: an entry did not come back from the remote tier, or came back different.
    """
    if config.remote.backend == "none":
        raise ConfigError("remote.backend: is \"none\"; the remote rows need a configured remote tier")
    rows = []
    for n in tokens:
        nbytes = n * 8192 * 2
        reps = reps_for(nbytes, budget_bytes)
        cfg = config.replace(host=HostTierConfig(capacity_bytes=(reps + 1) * nbytes + 4 * MiB, pin_memory=False),
                             nvme=NvmeTierConfig())
        base = torch.randn(n, 8192, generator=torch.Generator().manual_seed(n)).to(torch.bfloat16)
        keys = [f"bench-remote-{n}-{i}-{time.time_ns()}" for i in range(reps)]
        cache = open_cache(cfg)
        try:
            for i, key in enumerate(keys):
                t = base.clone()
                t[0, 0] = float(i)
                cache.put(key, t).wait()
            cache.flush()
            _check_reached(cache, cfg, len(keys))
        finally:
            cache.close()
        cache = open_cache(cfg)
        times = []
        try:
            for i, key in enumerate(keys):
                t0 = time.perf_counter()
                got = cache.get(key)
                times.append(time.perf_counter() - t0)
                want = base.clone()
                want[0, 0] = float(i)
                if got is None or not torch.equal(got.view(torch.int16), want.view(torch.int16)):
                    raise RuntimeError(f"remote tier: {key} {'missing' if got is None else 'differs'} after a put")
            for key in keys:
                cache.delete(key)
        finally:
            cache.close()
        rows.append(_row("remote", "get", "ectier", n, nbytes, times))
    return rows
