"""Moves into and out of the memory tiers (GPU and host arenas): puts, GPU ↔ host edges, serving hits.

Every function here runs on behalf of :class:`~ectier.mover.Mover` (``m``). Copies run outside the
cache lock on the copy engine; their completions come back through ``m.when_done`` (the completer
thread) and end in :meth:`Mover.commit` — never in the facade.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from ..catalog import PendingWrite
from ..copy import CopyEngine, CopyHandle
from ..entry import EntryMeta
from ..handles import PutHandle
from ..index import Slot
from ..logutil import RateLimitedLogger, failure_kind
from ..tensors import byte_view, empty_for, output_for, torch_dtype
from ..tiers.arena import ArenaTier, run_pairs
from .views import Releaser, pinned_view

if TYPE_CHECKING:
    from ..mover import Commit, Mover

__all__ = ["ArenaMoves", "copy_error"]

log = logging.getLogger(__name__)


def copy_error(h: CopyHandle, source: Slot | None = None) -> BaseException | None:
    """The error of copy ``h`` (complete), or of the write that filled ``source`` (a GPU slot read by
    ``h``): a slot whose write failed holds poison, never bytes to pass on."""
    if h.error is not None:
        return h.error
    w = source.pending_write if source is not None else None
    return w.error if isinstance(w, CopyHandle) else None


class ArenaMoves:
    """The memory tiers' side of every move."""

    def __init__(self, m: "Mover") -> None:
        self.m = m
        self._warn = RateLimitedLogger(log)  # per-entry failures: one line per kind per 10 s
        self.releaser = Releaser(m.cond)  # view pins released from finalizers, never blocking

    # ------------------------------------------------------------------------- host puts
    def store(self, tier: ArenaTier, digest: bytes, meta: EntryMeta, version: int, src: torch.Tensor, *,
              promotion: bool, protect: bytes | None = None, reserved: Slot | None = None,
              wait: bool | None = None, written_through: bool = True) -> "Commit | None":
        """Admit an entry into a host-like tier synchronously: reserve (evicting), copy, commit.

        For a promotion nothing happens unless ``version`` is still current and the tier does not
        hold the key. ``reserved``: a slot the caller reserved already (``Mover.put_host``), or
        ``None``: admitted here (``wait``: as :meth:`Mover.admit`). ``written_through`` False: no
        write-through follows this non-promotion's commit (a remote fetch placed in the host), so
        the key's older NVMe record goes at the commit, as in write-back mode. Returns the
        :class:`~ectier.mover.Commit` outcome, ``None`` if no room.
        """
        m = self.m
        slot = reserved if reserved is not None else m.admit(
            tier, digest, meta, version, promotion=promotion, protect=protect if promotion else None, wait=wait)
        if slot is None:
            return None
        try:
            tier.write(slot, src)
        except BaseException:
            m.abort(tier, slot)
            raise
        # (keep_older_record registers the write-through that the caller's after_put runs)
        through = not promotion and written_through and m.write_through
        return m.commit(tier, slot, promotion=promotion, keep_older_record=through)

    def put_async(self, tier: ArenaTier, digest: bytes, meta: EntryMeta, version: int, src: torch.Tensor,
                  engine: CopyEngine, handle: PutHandle) -> bool:
        """Reserve blocks and enqueue the D2H copy into them; commit when it completes.
        False when no room could be made (nothing enqueued)."""
        m = self.m
        slot = m.admit(tier, digest, meta, version, promotion=False)
        if slot is None:
            return False
        pending = PendingWrite(digest, version, handle)
        with m.cond:
            m.catalog.add_pending(pending)
        try:
            h = engine.copy(tier.pairs_with(slot, src, into_arena=True), lane="d2h")
        except BaseException:
            m.abort(tier, slot)
            m.end_pending(pending, False, None)
            raise
        m.when_done(h, lambda: self.finish_write(tier, slot, h, pending, promotion=False))
        return True

    def finish_write(self, tier: ArenaTier, slot: Slot, h: CopyHandle, pending: PendingWrite, *,
                     promotion: bool, source: Slot | None = None) -> None:
        """Completion of an asynchronous write into a host-like tier (a put, or a GPU demotion of
        ``source`` when ``promotion``): commit it, or give the blocks back if the copy failed."""
        m = self.m
        ok = False
        error = copy_error(h, source)
        try:
            if error is not None:
                self._warn.warning(("copy into", tier.name, *failure_kind(error)),
                                   "copy into the %s tier failed (%s); entry not stored", tier.name, error)
                m.counters.count("cache", copy_failures=1)
                m.abort(tier, slot)
            else:
                result = m.commit(tier, slot, promotion=promotion, pending=pending,
                                  keep_older_record=not promotion and m.write_through)
                ok = result.stands
                if result.committed and not promotion:
                    m.after_put(tier, slot.digest, slot.version, slot.meta.nbytes)
        finally:
            if source is not None and (ok or error is not None):  # (a replaced version: no entry lost)
                m.counters.count("gpu", **{"demotions" if ok else "drops": 1})
            m.end_pending(pending, ok, error)

    # ------------------------------------------------------------------------- GPU puts
    def put_device(self, gpu, digest: bytes, meta: EntryMeta, version: int, src: torch.Tensor,
                   handle: PutHandle) -> bool:
        """Enqueue ``src`` (on the GPU tier's device) into the device arena. False if no room.

        A put into the GPU tier is not written through (it reaches NVMe when demoted, or at
        flush): write-back even with ``nvme.write_through``, so the key's older NVMe record goes
        before put returns and a restart never serves bytes older than this put.
        """
        m = self.m
        slot = m.admit(gpu, digest, meta, version, promotion=False)
        if slot is None:
            return False
        try:
            h = gpu.write(slot, src)
        except BaseException:
            m.abort(gpu, slot)
            raise
        slot.pending_write = h
        if m.commit(gpu, slot, promotion=False).committed:
            m.counters.count("gpu", puts=1, put_bytes=meta.nbytes)
            if m.remote is not None:  # read on the arena lane, after this write
                m.remote.write_later(gpu, digest, version, meta.nbytes)
        m.when_done(h, lambda: self.after_device_write(gpu, slot, h, handle))
        return True

    def after_device_write(self, gpu, slot: Slot, h: CopyHandle, handle: PutHandle | None) -> None:
        m = self.m
        if h.error is not None:
            self._warn.warning(("copy into gpu", *failure_kind(h.error)),
                               "copy into the GPU tier failed (%s); entry dropped from it", h.error)
            m.counters.count("gpu", copy_failures=1)
            m.drop_slot(gpu, slot)
        if handle is not None:
            handle.finish(h.error is None, h.error)

    def promote_device(self, gpu, digest: bytes, meta: EntryMeta, version: int, *,
                       data: torch.Tensor | None = None, src_tier: ArenaTier | None = None,
                       src_slot: Slot | None = None) -> Slot | None:
        """Copy an entry into the GPU tier from CPU ``data`` or from ``src_slot`` of ``src_tier``
        (pinned by the caller; this takes its own pin until the copy completes). Returns the
        committed GPU slot, pinned for the caller, or ``None`` (no room, key changed, copy could not
        start: a CUDA out-of-memory error leaves the entry served from the lower tier)."""
        m = self.m
        if not gpu.fits(meta.nbytes):
            m.counters.count("gpu", skipped_too_large=1)
            return None
        slot = m.admit(gpu, digest, meta, version, promotion=True, protect=digest)
        if slot is None:
            return None
        if src_slot is not None:
            with m.cond:
                src_tier.pin(src_slot)
        try:
            if src_slot is not None:
                h = gpu.engine.copy(run_pairs(gpu, slot, src_tier, src_slot), lane="arena")
            else:
                h = gpu.write(slot, data)
        except RuntimeError as exc:  # torch.cuda.OutOfMemoryError and other device errors
            self._warn.warning(("promotion to gpu", *failure_kind(exc)), "promotion of an entry to the GPU tier "
                               "failed (%s); served from the lower tier", exc)
            m.counters.count("gpu", promotion_failures=1)
            m.abort(gpu, slot)
            if src_slot is not None:
                m.unpin(src_tier, src_slot)
            return None
        slot.pending_write = h
        ok = m.commit(gpu, slot, promotion=True, keep_older_record=True, pin_after=True).committed
        if ok:
            m.counters.count("gpu", promotions=1)

        def done() -> None:
            if src_slot is not None:
                m.unpin(src_tier, src_slot)  # rule 3: the pinned source bytes stay until the copy completed
            self.after_device_write(gpu, slot, h, None)

        m.when_done(h, done)
        return slot if ok else None

    # ------------------------------------------------------------------------- GPU -> host
    def demote_device(self, gpu, host: ArenaTier, v: Slot, protect: bytes | None = None) -> bool:
        """Start moving a pinned GPU victim into the host tier (async D2H on the arena lane, after
        every earlier arena write). True once enqueued: the host slot commits when it completes."""
        m = self.m
        digest, version, meta = v.digest, v.version, v.meta
        if not host.fits(meta.nbytes):
            return False
        hslot = m.admit(host, digest, meta, version, promotion=True, protect=protect)
        if hslot is None:
            return False
        pending = PendingWrite(digest, version, PutHandle(meta.key))
        with m.cond:
            m.catalog.add_pending(pending)
        try:
            h = gpu.engine.copy(run_pairs(host, hslot, gpu, v), lane="arena")
        except BaseException:
            m.abort(host, hslot)
            m.end_pending(pending, False, None)
            raise
        m.when_done(h, lambda: self.finish_write(host, hslot, h, pending, promotion=True, source=v))
        return True

    def cpu_bytes(self, tier: ArenaTier, slot: Slot) -> torch.Tensor | None:
        """A pinned slot's bytes as a flat ``uint8`` CPU tensor (zero-copy where the tier allows);
        ``None`` if copying them out failed (counted)."""
        view = tier.contiguous_view(slot) if tier.device is None else None
        if view is not None:
            return view
        buf = torch.empty(slot.meta.nbytes, dtype=torch.uint8)
        h = tier.read_into(slot, buf)
        if h is None:
            return buf
        h.wait()
        if copy_error(h, slot) is not None:
            self.m.counters.count(tier.name, copy_failures=1)
            return None
        return buf

    def copy_out(self, host: ArenaTier, slot: Slot, dev: torch.device) -> torch.Tensor:
        """A copy of a slot its caller keeps pinned (a lease) on ``dev``: to a CUDA device on the
        copy engine's h2d lane, ready on the caller's current stream, no host sync (rule 4), the
        slot pinned by the copy itself until it completes (rule 3: the lease may be released at
        once); to the CPU a plain copy before this returns."""
        if dev.type != "cuda":  # a host-to-host copy: done here, now
            result = empty_for(slot.meta, dev)
            for dst, src in host.pairs_with(slot, byte_view(result), into_arena=False):
                dst.copy_(src)
            return result
        with self.m.cond:
            host.pin(slot)
        return self.h2d(host, slot, dev)

    def h2d(self, host: ArenaTier, slot: Slot, dev: torch.device) -> torch.Tensor:
        """A host slot pinned for this copy (the pin is this call's: released when the copy
        completes, or at once if it cannot be enqueued) copied to the CUDA device ``dev`` on the
        h2d lane; the result is ready on the caller's current stream, no host sync (rules 3-4)."""
        m = self.m
        try:
            result = empty_for(slot.meta, dev)
            h = m.engine_for(dev).copy(host.pairs_with(slot, byte_view(result), into_arena=False), lane="h2d")
        except BaseException:
            m.unpin(host, slot)
            raise
        h.wait_stream(dev)  # rule 4: the caller's stream waits; no host sync
        m.when_done(h, lambda: m.unpin(host, slot))  # rule 3
        return result

    def view_out(self, host: ArenaTier, slot: Slot) -> torch.Tensor | None:
        """A zero-copy CPU view of a host slot its caller keeps pinned (a lease), holding a pin of
        its own until the view's storage is freed (:func:`~ectier.moves.views.pinned_view`): the
        slot is neither evicted nor freed, nor its blocks reused, while any view of it lives; an
        overwrite or delete of the key meanwhile goes to other blocks. ``None`` when the slot's
        bytes are not one run of the arena (the caller copies instead)."""
        extents = host.byte_extents(slot) if host.device is None else None
        if extents is None or len(extents) > 1:
            return None
        m, meta = self.m, slot.meta
        offset, nbytes = extents[0] if extents else (0, 0)
        with m.cond:
            host.pin(slot)

        def release() -> None:  # run by the releaser with m.cond held
            if host.unpin(slot):
                m.cond.notify_all()

        try:
            return pinned_view(host.buffer, offset, nbytes, torch_dtype(meta.dtype), tuple(meta.shape),
                               lambda: self.releaser.call(release))
        except BaseException:
            m.unpin(host, slot)
            raise

    # ------------------------------------------------------------------------- serving hits
    def read_device_slot(self, gpu, slot: Slot, dev: torch.device, out: torch.Tensor | None):
        """Copy a pinned GPU slot out. To the tier's own device: ready on the caller's current
        stream, no host wait. Elsewhere: through host memory, waited for. A failed copy (of this
        read or of the write that filled the slot) drops the slot and returns ``None``."""
        m = self.m
        meta = slot.meta
        if dev == gpu.device and out is None:
            result = empty_for(meta, dev)
            h = gpu.read_into(slot, byte_view(result))
            if dev.type == "cuda":
                h.wait_stream(dev)  # rule 4
                return result
        else:
            result = output_for(meta, out)
            h = gpu.read_into(slot, byte_view(result))
        h.wait()
        err = copy_error(h, slot)
        if err is not None:
            self._warn.warning(("copy out of gpu", *failure_kind(err)),
                               "copy out of the GPU tier failed (%s); read as a miss there", err)
            m.counters.count("gpu", copy_failures=1)
            m.drop_slot(gpu, slot)
            return None
        return result if result.device == dev else result.to(dev)

    def serve_device_hit(self, gpu, slot: Slot, dev: torch.device, out: torch.Tensor | None):
        """Serve a GPU hit (pinned by the caller, unpinned here); ``None`` if its copy failed."""
        try:
            result = self.read_device_slot(gpu, slot, dev, out)
        finally:
            self.m.unpin(gpu, slot)
        if result is not None:
            self.m.counters.count_hit("gpu", slot.meta.nbytes)
        return result

    def serve_host_hit(self, host: ArenaTier, slot: Slot, dev: torch.device, out: torch.Tensor | None,
                       target) -> torch.Tensor:
        """Serve a host hit (pinned by the caller; unpinned here, at once or when the copy that
        reads it completes) to ``dev``, promoting it into ``target`` (the GPU tier) first when given."""
        m = self.m
        if target is not None and out is None:
            try:
                result = self._via_device(host, slot, dev, target)
            except BaseException:
                m.unpin(host, slot)
                raise
            if result is not None:
                return result
        if out is not None or dev.type != "cuda":
            try:
                result = host.read_tensor(slot, out)
            finally:
                m.unpin(host, slot)
            return result if dev.type == "cpu" else result.to(dev)
        return self.h2d(host, slot, dev)

    def _via_device(self, host: ArenaTier, slot: Slot, dev: torch.device, gpu) -> torch.Tensor | None:
        """Promote a pinned host slot into the GPU tier and read it from there; ``None``: serve
        from the host (no room there, or the GPU copy failed). The host pin stays the caller's."""
        m = self.m
        g = self.promote_device(gpu, slot.digest, slot.meta, slot.version, src_tier=host, src_slot=slot)
        if g is None:
            return None
        try:
            result = self.read_device_slot(gpu, g, dev, None)
        finally:
            m.unpin(gpu, g)
        if result is not None:
            m.unpin(host, slot)  # the promotion holds its own pin until its copy completes
        return result
