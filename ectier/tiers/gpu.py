"""GPU tier: one arena of device memory on one explicit CUDA device, allocated once.

What the GPU tier adds to :class:`~ectier.tiers.arena.ArenaTier`: the device allocation (checked
against the device's free memory) and copies enqueued on the copy engine. Which entries live here,
and when they leave, is the mover's business. Every read and write of the arena is enqueued on the copy engine's ``"arena"``
lane, so the GPU runs them in submission order: a block freed after its demotion copy was enqueued
can be rewritten at once (the rewrite runs after the demotion), and a reader enqueued after a
writer sees the writer's bytes, with no host wait.
"""

from __future__ import annotations

import logging

import torch

from ..config import GpuTierConfig
from ..copy import CopyEngine, CopyHandle
from ..errors import ConfigError
from ..index import Slot
from ..policy import EvictionPolicy
from .arena import ArenaTier

__all__ = ["GpuTier"]

log = logging.getLogger(__name__)


class GpuTier(ArenaTier):
    """A ``capacity_bytes`` arena of device memory in ``block_bytes`` blocks.

    Args:
        config: :class:`~ectier.config.GpuTierConfig`.
        device: the validated ``torch.device`` of the arena (``cuda:<i>``; the cache passes
            ``cpu`` only through its test hook).
        engine: the :class:`~ectier.copy.CopyEngine` of ``device``.
        policy: eviction policy of the tier's index (default LRU).

    Attributes:
        index: the tier's :class:`~ectier.index.ArenaIndex`.
        buffer: the arena, a flat ``uint8`` tensor of ``index.capacity_bytes`` bytes on ``device``.

    Raises:
        ConfigError: naming ``gpu.capacity_bytes`` when the budget exceeds the device's free
            memory or cannot be allocated.
    """

    name = "gpu"

    def __init__(self, config: GpuTierConfig, *, device: torch.device, engine: CopyEngine,
                 policy: EvictionPolicy | None = None) -> None:
        super().__init__(config.capacity_bytes, config.block_bytes, policy)
        self.config = config
        self.device = device
        self.engine = engine
        nbytes = self.index.capacity_bytes
        if device.type == "cuda":
            free, total = torch.cuda.mem_get_info(device)
            if nbytes > free:
                raise ConfigError(
                    f"gpu.capacity_bytes: {nbytes} bytes asked on {device}, which has {free} of {total} bytes "
                    "free; lower gpu.capacity_bytes (leave room for the model and vLLM's KV cache)"
                )
        try:
            self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        except RuntimeError as exc:  # torch.cuda.OutOfMemoryError is a RuntimeError
            raise ConfigError(
                f"gpu.capacity_bytes: cannot allocate a device arena of {nbytes} bytes on {device}: "
                f"{str(exc).splitlines()[0]}"
            ) from None
        log.info("gpu tier: %d bytes on %s in %d-byte blocks", nbytes, device, config.block_bytes)

    def describe(self) -> dict:
        return {**super().describe(), "device": str(self.device)}

    def write(self, slot: Slot, src: torch.Tensor) -> CopyHandle:
        """Enqueue ``src`` (flat ``uint8``, ``slot.meta.nbytes`` long, on the device or pinned host)
        into the slot's blocks on the arena lane."""
        return self.engine.copy(self.pairs_with(slot, src, into_arena=True), lane="arena")

    def read_into(self, slot: Slot, dst: torch.Tensor) -> CopyHandle:
        """Enqueue a copy of the slot's bytes into ``dst`` (flat ``uint8``) on the arena lane."""
        return self.engine.copy(self.pairs_with(slot, dst, into_arena=False), lane="arena")

    def close(self) -> None:
        """Drop the arena (its memory returns to torch's caching allocator)."""
        self.buffer = torch.empty(0, dtype=torch.uint8, device=self.device)
