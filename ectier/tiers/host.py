"""Host-memory tier: one arena allocated once, pinned when CUDA is available.

What the host tier adds to :class:`~ectier.tiers.arena.ArenaTier`: the allocation (private,
pinned when CUDA is available, or a shared file mapping registered with the driver) and
synchronous copies in and out. Which entries live here, and when they leave, is the mover's
business.
"""

from __future__ import annotations

import errno
import logging
import os
import threading

import torch

from ..config import HostTierConfig
from ..errors import ConfigError, StoreOpenError
from ..index import Slot
from ..pinning import register_host, unregister_host
from ..policy import EvictionPolicy
from ..tensors import byte_view, cuda_available, output_for, torch_dtype
from .arena import ArenaTier
from .populate import populate_later
from .storedir import free_bytes, in_memory

__all__ = ["HostTier"]

log = logging.getLogger(__name__)


class HostTier(ArenaTier):
    """A ``capacity_bytes`` arena of host memory in ``block_bytes`` blocks.

    Args:
        config: :class:`~ectier.config.HostTierConfig`.
        shm_path: when given, the arena is this new file (created with mode 0600, e.g. under
            ``/dev/shm``) mapped ``MAP_SHARED`` so other processes can map it too; on a CUDA machine
            the mapping is page-locked with ``cudaHostRegister``. Removed by :meth:`close`. Its
            ``capacity_bytes`` are reserved at once (``posix_fallocate``; on tmpfs that commits
            the pages), so a write into the mapping can never fail with SIGBUS later.
        policy: the eviction policy of the tier's index (default LRU).

    Attributes:
        index: the tier's :class:`~ectier.index.ArenaIndex`.
        pinned: whether the arena is page-locked (fast, async-capable H2D/D2H DMA).
        buffer: the arena, a flat ``uint8`` CPU tensor of ``index.capacity_bytes`` bytes.

    Raises:
        ConfigError: the arena cannot be allocated (e.g. pinning more memory than the OS allows),
            or a shared arena does not fit in the free space of ``shm_path``'s filesystem (the
            message names ``host.capacity_bytes``, ``daemon.shm_dir`` and the free bytes).
    """

    name = "host"

    def __init__(self, config: HostTierConfig, *, shm_path: str | None = None,
                 policy: EvictionPolicy | None = None) -> None:
        super().__init__(config.capacity_bytes, config.block_bytes, policy)
        self.config = config
        # the index's own methods where the tier's only pass a call on (one Python call less on
        # every put and get: these run after a bulk copy, on cold caches)
        idx = self.index
        self.reserve, self.commit, self.lookup = idx.reserve, idx.commit, idx.lookup
        self.pin, self.unpin, self.touch = idx.pin, idx.unpin, idx.touch
        if config.pin_memory and not cuda_available():  # (the daemon's arena would go unpinned silently)
            raise ConfigError("host.pin_memory: true needs CUDA (page-locked memory comes from the CUDA driver) "
                              "and this process has none; leave it unset (pinned where CUDA is) or set false")
        want_pin = cuda_available() if config.pin_memory is None else config.pin_memory
        nbytes = self.index.capacity_bytes
        self.shm_path = shm_path
        self._registered = False
        self._typed: dict[str, torch.Tensor] = {}  # the arena viewed as each dtype (typed_view)
        self._views: dict[tuple, torch.Tensor] = {}  # typed views made, for reuse (typed_view)
        if shm_path is None:
            self.pinned = bool(want_pin)
            try:
                self.buffer = torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pinned)
            except RuntimeError as exc:
                raise ConfigError(
                    f"host.capacity_bytes: cannot allocate a host arena of {nbytes} bytes "
                    f"(pin_memory={self.pinned}): {str(exc).splitlines()[0]}"
                ) from None
        else:
            self.buffer = self._map_shared(shm_path, nbytes)
            # a shared mapping cannot come from the pinned allocator: register it with the driver
            self.pinned = bool(want_pin) and self._register(self.buffer)
        self._populate_stop = threading.Event()
        self._populating = None
        # faulted in now, not by each first put or promotion (tiers/populate.py); not a shared
        # arena on a disk filesystem: every page would be made dirty, and written back to the disk
        if not self.pinned and (shm_path is None or in_memory(shm_path) is not False):
            self._populating = populate_later(self.buffer, stop=self._populate_stop)
        log.info("host tier: %d bytes in %d-byte blocks, pinned=%s, shared=%s",
                 nbytes, config.block_bytes, self.pinned, shm_path or "no")

    @staticmethod
    def _map_shared(path: str, nbytes: int) -> torch.Tensor:
        """Create ``path`` (mode 0600, must not exist) of ``nbytes`` and map it shared.

        The file's blocks are reserved up front (``posix_fallocate``): a sparse file on a tmpfs
        smaller than the arena would be created fine and later kill whichever process first
        writes past the filesystem's free space with SIGBUS (a vLLM worker, in daemon mode).
        An arena that does not fit raises :class:`ConfigError` naming ``host.capacity_bytes``
        and ``daemon.shm_dir``, and leaves no file behind.
        """
        shm_dir = os.path.dirname(os.path.abspath(path))
        free = free_bytes(shm_dir)
        if free is not None and nbytes > free:
            raise ConfigError(_no_room(nbytes, shm_dir, free))
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise StoreOpenError(f"daemon.shm_dir: cannot create the host arena {path!r}: {exc.strerror}") from None
        try:
            try:
                if nbytes > 0:
                    os.posix_fallocate(fd, 0, nbytes)
                os.ftruncate(fd, nbytes)
            except OSError as exc:
                os.close(fd)
                fd = -1
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
                if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
                    raise ConfigError(_no_room(nbytes, shm_dir, free_bytes(shm_dir))) from None
                raise StoreOpenError(f"host arena: cannot reserve {nbytes} bytes for {path!r}: "
                                     f"{exc.strerror}") from None
        finally:
            if fd >= 0:
                os.close(fd)
        if nbytes == 0:
            return torch.empty(0, dtype=torch.uint8)
        return torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)

    def _register(self, buffer: torch.Tensor) -> bool:
        """Page-lock a shared mapping with ``cudaHostRegister`` (True on success; ectier/pinning.py)."""
        self._registered = register_host(buffer, what="the host tier's shared arena")
        return self._registered

    def close(self) -> None:
        """End the populating thread, unregister a registered mapping and remove the shared arena
        file (if any)."""
        self._populate_stop.set()
        if self._populating is not None:
            self._populating.join(5.0)  # (one madvise of 256 KiB at most)
            self._populating = None
        if self._registered:
            unregister_host(self.buffer)
            self._registered = False
        if self.shm_path is not None:
            try:
                os.unlink(self.shm_path)
            except FileNotFoundError:
                pass

    def describe(self) -> dict:
        return {**super().describe(), "pinned": self.pinned}

    def reserve(self, digest: bytes, meta, version: int, cost_s: float | None = None) -> Slot | None:
        """Reserve blocks for an entry that fits the budget (``fits``, checked by the caller) from the
        free blocks alone: the reserved (invisible) slot, or ``None`` when they do not suffice now
        (then :meth:`admit` names victims). The first step of a host put (``Mover.put_host``);
        under the cache lock. (Each instance calls its index's ``reserve`` directly.)"""
        return self.index.reserve(digest, meta, version, cost_s)

    def write(self, slot: Slot, src: torch.Tensor) -> None:
        """Copy an entry into the slot's blocks. Synchronous: on return the bytes are in the arena.

        ``src``: the entry's flat ``uint8`` bytes (``slot.meta.nbytes`` long, any device), or a
        tensor of the entry's own dtype and shape (any strides; stored in C order, as
        :func:`~ectier.tensors.byte_view` gives its bytes) — the caller's tensor of a put, copied
        with one ``copy_`` when the slot lies in one run.
        """
        meta = slot.meta
        if src.dtype is not torch.uint8 or src.dim() != 1 or src.numel() != meta.nbytes:
            view = self.typed_view(slot)
            if view is not None:
                view.copy_(src.detach() if src.requires_grad else src)
                return
            src = byte_view(src)
        if len(slot.extents) == 1:
            first = slot.extents[0][0] * self.index.block_bytes
            self.buffer[first : first + meta.nbytes].copy_(src)
            return
        for arena_off, off, length in self.runs(slot):
            self.buffer[arena_off : arena_off + length].copy_(src[off : off + length])

    def read_into(self, slot: Slot, dst: torch.Tensor) -> None:
        """Copy the slot's bytes into ``dst``: flat ``uint8`` (``slot.meta.nbytes`` long), or a
        contiguous CPU tensor of the entry's dtype and shape (one ``copy_`` when the slot lies in
        one run). Synchronous."""
        if dst.dtype is not torch.uint8 or dst.dim() != 1 or dst.numel() != slot.meta.nbytes:
            view = self.typed_view(slot)
            if view is not None:
                dst.copy_(view)
                return
            dst = byte_view(dst)
        for arena_off, off, length in self.runs(slot):
            dst[off : off + length].copy_(self.buffer[arena_off : arena_off + length])

    def read_tensor(self, slot: Slot, out: torch.Tensor | None = None) -> torch.Tensor:
        """A copy of the pinned slot's entry, of its dtype and shape: a new CPU tensor, or ``out``
        (checked as :func:`~ectier.tensors.output_for` checks it). Synchronous.

        Raises:
            InvalidTensorError: ``out`` is not a contiguous CPU tensor of the entry's dtype and size.
        """
        result = output_for(slot.meta, out)
        self.read_into(slot, result)
        return result

    def typed_view(self, slot: Slot) -> torch.Tensor | None:
        """The slot's bytes as a zero-copy view of the entry's dtype and shape (C order), or
        ``None`` (bytes in several runs, an empty entry, or an arena offset the dtype cannot be
        viewed at). Made once per slot (``slot.view``); valid only while the slot is pinned or
        reserved by the caller."""
        view = slot.view
        if view is None and len(slot.extents) == 1 and slot.meta.nbytes:
            meta = slot.meta
            where = (slot.extents[0][0], meta.dtype, meta.shape)
            view = self._views.get(where)
            if view is None:
                view = self._make_view(where[0] * self.index.block_bytes, meta)
                if view is None:
                    return None
                if len(self._views) >= _VIEWS:
                    self._views.clear()
                self._views[where] = view
            slot.view = view
        return view

    def _make_view(self, offset: int, meta) -> torch.Tensor | None:
        """The arena bytes at ``offset`` as a C-order tensor of ``meta``'s dtype and shape (None:
        ``offset`` is no multiple of the item size)."""
        itemsize = meta.itemsize
        if offset % itemsize:
            return None
        typed = self._typed.get(meta.dtype)
        if typed is None:
            usable = self.buffer.numel() - self.buffer.numel() % itemsize
            typed = self._typed[meta.dtype] = self.buffer[:usable].view(torch_dtype(meta.dtype))
        return typed.as_strided(meta.shape, _c_strides(meta.shape), offset // itemsize)

    def contiguous_view(self, slot: Slot) -> torch.Tensor | None:
        """The slot's bytes as one zero-copy ``uint8`` view when they lie in a single run, else ``None``.

        Valid only while the slot is pinned.
        """
        runs = list(self.runs(slot))
        if len(runs) > 1:
            return None
        if not runs:
            return self.buffer[:0]
        arena_off, _, length = runs[0]
        return self.buffer[arena_off : arena_off + length]


#: typed views a host tier keeps for reuse, by (first block, dtype, shape): entries come in few
#: shapes (one per image size) and land on the same blocks again; making one costs ~1.5-3 us
_VIEWS = 4096


def _c_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Element strides of a C-contiguous tensor of ``shape``."""
    strides = []
    step = 1
    for d in reversed(shape):
        strides.append(step)
        step *= d
    return tuple(reversed(strides))


def _no_room(nbytes: int, shm_dir: str, free: int | None) -> str:
    have = "an unknown number of bytes" if free is None else f"{free} bytes ({free / 2**30:.2f} GiB)"
    return (
        f"host.capacity_bytes: the shared host arena needs {nbytes} bytes ({nbytes / 2**30:.2f} GiB) "
        f"but daemon.shm_dir {shm_dir!r} has only {have} free; lower host.capacity_bytes, "
        f"point daemon.shm_dir at a filesystem with room, or enlarge it (Docker --shm-size, "
        f"Kubernetes emptyDir medium: Memory with sizeLimit; see docs/operations.md). Restarting "
        f"while engines are connected? Each client still maps the previous daemon's arena until its "
        f"next call; retry the start, or give daemon.shm_dir room for two arenas"
    )
