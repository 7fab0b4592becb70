"""The tier order as data: the configured tiers from fastest to slowest.

The only place that knows which tier is above or below another. A cache with any subset of
tiers (GPU only, host only, NVMe only, host + NVMe, all three) is the same stack code; the
mover asks the stack, never a fixed attribute per tier.
"""

from __future__ import annotations

from typing import Iterator, Sequence

import torch

from .config import CacheConfig
from .copy import Engines
from .errors import ConfigError
from .policy import make_policy
from .tensors import cuda_available
from .tiers.arena import ArenaTier
from .tiers.base import Tier
from .tiers.gpu import GpuTier
from .tiers.host import HostTier
from .tiers.nvme import NvmeTier
from .tiers.remote import open_backend
from .tiers.remote.backend import RemoteBackend
from .tiers.remote.tier import RemoteTier

__all__ = ["TierStack", "open_tiers"]


class TierStack:
    """Tiers top (fastest) to bottom, each named once.

    Args:
        tiers: the configured tiers in order; ``None`` entries (disabled tiers) are skipped.
    """

    def __init__(self, tiers: Sequence[Tier | None]) -> None:
        self._tiers = [t for t in tiers if t is not None]
        names = [t.name for t in self._tiers]
        if len(set(names)) != len(names):
            raise ValueError(f"tiers: each tier name once, got {names}")
        self._by_name = {t.name: t for t in self._tiers}
        self._arenas = [t for t in self._tiers if isinstance(t, ArenaTier)]
        self._stores = [t for t in self._tiers if not isinstance(t, ArenaTier)]
        self._device_tier = next((t for t in self._tiers if getattr(t, "device", None) is not None), None)
        self._first_off_device = next((t for t in self._tiers if getattr(t, "device", None) is None), None)
        local = [t for t in self._tiers if t.local]
        self._from = {id(t): local[i:] for i, t in enumerate(local)}
        self._remote = next((t for t in self._tiers if not t.local), None)

    def __iter__(self) -> Iterator[Tier]:
        return iter(self._tiers)

    def __len__(self) -> int:
        return len(self._tiers)

    def get(self, name: str) -> Tier | None:
        """The tier named ``name`` (``"gpu"``, ``"host"``, ``"nvme"``), ``None`` if not configured."""
        return self._by_name.get(name)

    def below(self, tier: Tier) -> list[Tier]:
        """Tiers under ``tier``, nearest first."""
        return self._tiers[self._tiers.index(tier) + 1 :]

    def between(self, low: Tier, high: Tier) -> list[Tier]:
        """Tiers from just above ``low`` up to ``high`` included, bottom-up (a promotion's path)."""
        lo, hi = self._tiers.index(low), self._tiers.index(high)
        return self._tiers[hi:lo][::-1]

    def arenas(self) -> list[ArenaTier]:
        """The memory tiers (GPU, host), top first."""
        return self._arenas

    def stores(self) -> list[Tier]:
        """The tiers that are not memory arenas (NVMe), top first."""
        return self._stores

    def entry_tier(self, device: torch.device) -> Tier | None:
        """The tier a put of a tensor on ``device`` starts at: the tier of that very device if
        there is one (the GPU tier), else the first tier that is on no device (host, NVMe)."""
        if self._device_tier is not None and self._device_tier.device == device:
            return self._device_tier
        return self._first_off_device

    def device_tier(self) -> Tier | None:
        """The tier on a device (the GPU tier), if configured."""
        return self._device_tier

    def remote(self) -> Tier | None:
        """The remote tier (shared by every node; never a put's or a lookup's tier), if configured."""
        return self._remote

    def from_(self, tier: Tier) -> list[Tier]:
        """``tier`` and every local tier under it (the tiers a put may land in)."""
        return self._from[id(tier)]

    def holder(self, digest: bytes, version: int) -> Tier | None:
        """The highest tier holding ``version`` of ``digest``."""
        return next((t for t in self._tiers if t.holds(digest, version)), None)

    def holds(self, digest: bytes, version: int, *, besides: Tier | None = None) -> bool:
        """Whether some tier (other than ``besides``) holds ``version`` of ``digest``."""
        return any(t.holds(digest, version) for t in self._tiers if t is not besides)

    def lower_holds(self, tier: Tier, digest: bytes, version: int) -> bool:
        """Whether a tier under ``tier`` holds ``version`` of ``digest``."""
        return any(t.holds(digest, version) for t in self.below(tier))

    @classmethod
    def open(cls, config: CacheConfig, host_shm_path: str | None, engines: Engines,
             remote_backend: "RemoteBackend | None" = None) -> "TierStack":
        """Open the tiers ``config`` enables, top first (GPU, host, NVMe, remote).

        Raises:
            ConfigError, StoreOpenError, StoreLockedError: as the tiers raise them; what was opened
            before the failure is closed again.
        """
        return cls(open_tiers(config, host_shm_path, engines, remote_backend))


def open_tiers(config: CacheConfig, host_shm_path: str | None, engines: Engines,
               remote_backend: "RemoteBackend | None" = None) -> list:
    """Open the configured tiers, top first; on a failure close what was opened and re-raise.

    ``remote_backend``: the remote tier's client (``None``: built from ``config.remote``).
    """
    opened: list = []
    try:
        opened.append(_open_gpu(config, engines) if config.gpu.enabled else None)
        opened.append(HostTier(config.host, shm_path=host_shm_path, policy=make_policy(config.host.policy))
                      if config.host.capacity_bytes > 0 else None)
        opened.append(NvmeTier(config.nvme) if config.nvme.enabled else None)
        if config.remote.enabled or remote_backend is not None:
            opened.append(RemoteTier(config.remote, remote_backend or open_backend(config.remote)))
    except BaseException:
        for t in opened:
            if t is not None:
                t.close()  # removes a shared arena file (the daemon's): it would leak otherwise
        raise
    return opened


def _open_gpu(config: CacheConfig, engines: Engines) -> GpuTier:
    """Validate ``gpu.device`` against this machine and allocate the device arena.

    Raises:
        ConfigError: CUDA is absent, the device index does not exist, or the budget does not fit
            the device's free memory (names the ``gpu.*`` field).
    """
    cfg = config.gpu
    if engines.gpu_device is not None:
        dev = torch.device(engines.gpu_device)
    else:
        if not cuda_available():
            raise ConfigError(
                f"gpu.capacity_bytes: is {cfg.capacity_bytes} but CUDA is not available on this machine; "
                "set gpu.capacity_bytes to 0 (the default) to run without a GPU tier")
        count = torch.cuda.device_count()
        if cfg.device_index >= count:
            raise ConfigError(f"gpu.device: {cfg.device!r} does not exist; this machine has {count} CUDA device(s)")
        dev = torch.device(cfg.device)
    engine = engines.engine_for(dev, cfg.copy_streams)
    if engine is None:
        raise ConfigError("gpu.device: a CPU stand-in for the GPU tier needs a copy engine (ectier.testing)")
    return GpuTier(cfg, device=dev, engine=engine, policy=make_policy(cfg.policy))
