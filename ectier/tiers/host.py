"""Host-memory tier: one arena allocated once, pinned when CUDA is available.

The tier stores and fetches bytes at extents handed out by its :class:`~ectier.index.ArenaIndex`;
which entries live here, and when they leave, is the cache's business.
"""

from __future__ import annotations

import logging

import torch

from ..config import HostTierConfig
from ..index import ArenaIndex, Slot
from ..tensors import cuda_available

__all__ = ["HostTier"]

log = logging.getLogger(__name__)


class HostTier:
    """A ``capacity_bytes`` arena of host memory in ``block_bytes`` blocks.

    Args:
        config: :class:`~ectier.config.HostTierConfig`.

    Attributes:
        index: the tier's :class:`~ectier.index.ArenaIndex`.
        pinned: whether the arena is page-locked (fast, async-capable H2D/D2H DMA).
        buffer: the arena, a flat ``uint8`` CPU tensor of ``index.capacity_bytes`` bytes.

    Raises:
        ConfigError: never here — the config validated itself; ``RuntimeError`` from torch if the
            arena cannot be allocated (e.g. pinning more memory than the OS allows).
    """

    name = "host"

    def __init__(self, config: HostTierConfig) -> None:
        self.config = config
        self.index = ArenaIndex(config.capacity_bytes, config.block_bytes)
        want_pin = cuda_available() if config.pin_memory is None else config.pin_memory
        self.pinned = bool(want_pin)
        self.buffer = torch.empty(self.index.capacity_bytes, dtype=torch.uint8, pin_memory=self.pinned)
        log.info(
            "host tier: %d bytes in %d-byte blocks, pinned=%s",
            self.index.capacity_bytes, config.block_bytes, self.pinned,
        )

    def _runs(self, slot: Slot):
        """Yield ``(arena_offset, entry_offset, length)`` byte runs of ``slot``."""
        done = 0
        block = self.index.block_bytes
        total = slot.meta.nbytes
        for first, count in slot.extents:
            length = min(count * block, total - done)
            if length <= 0:
                break
            yield first * block, done, length
            done += length

    def write(self, slot: Slot, src: torch.Tensor) -> None:
        """Copy ``src`` (flat ``uint8``, ``slot.meta.nbytes`` long, any device) into the slot's blocks.

        Synchronous: on return the bytes are in the arena.
        """
        for arena_off, off, length in self._runs(slot):
            self.buffer[arena_off : arena_off + length].copy_(src[off : off + length])

    def read_into(self, slot: Slot, dst: torch.Tensor) -> None:
        """Copy the slot's bytes into ``dst`` (flat ``uint8``, ``slot.meta.nbytes`` long). Synchronous."""
        for arena_off, off, length in self._runs(slot):
            dst[off : off + length].copy_(self.buffer[arena_off : arena_off + length])

    def contiguous_view(self, slot: Slot) -> torch.Tensor | None:
        """The slot's bytes as one zero-copy ``uint8`` view when they lie in a single run, else ``None``.

        Valid only while the slot is pinned.
        """
        runs = list(self._runs(slot))
        if len(runs) > 1:
            return None
        if not runs:
            return self.buffer[:0]
        arena_off, _, length = runs[0]
        return self.buffer[arena_off : arena_off + length]
