"""Zero-copy views of arena bytes whose pin lives exactly as long as the view's storage.

:func:`pinned_view` hands out a CPU tensor over bytes another owner keeps (a pinned host-arena
slot, a daemon's shared arena) without copying them. The tensor gets a storage of its own
(``torch.from_numpy`` over an object exporting the address), so every view, slice or reshape of it
keeps that one storage, and ``release`` runs once, when the last of them is gone — never earlier,
so no view can outlive its pin, and the bytes cannot be evicted or reused under it.

``release`` runs wherever the storage dies: in any thread, possibly inside a garbage collection
that interrupted code holding the owner's lock. :class:`Releaser` makes that safe: it tries the
lock without blocking and, when that fails, hands the release to one background thread (queued
through :class:`queue.SimpleQueue`, which may be used from finalizers). In a child of ``fork()`` a
release does nothing (the parent's pins are the parent's; its lock may be held by a thread that
does not exist in the child).
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Callable

import numpy as np
import torch

from ..forks import ForkMark

__all__ = ["pinned_view", "Releaser"]

log = logging.getLogger(__name__)


class _Exporter:
    """The address of ``nbytes`` bytes, for numpy (``__array_interface__``); runs ``release`` when
    numpy's array over it (and so the tensor storage over that) is freed."""

    __slots__ = ("__array_interface__", "_keep", "_release")

    def __init__(self, address: int, nbytes: int, keep: object, release: Callable[[], None]) -> None:
        self.__array_interface__ = {"data": (address, False), "shape": (nbytes,), "typestr": "|u1", "version": 3}
        self._keep = keep  # the owner's buffer: its memory outlives every view, even past a close
        self._release = release

    def __del__(self) -> None:
        release, self._release = self._release, None
        if release is not None:
            release()


def pinned_view(buffer: torch.Tensor, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...],
                release: Callable[[], None]) -> torch.Tensor:
    """A tensor of ``dtype`` and ``shape`` over ``buffer[offset : offset + nbytes]`` (a flat CPU
    ``uint8`` tensor, bytes), with a storage of its own: ``release()`` is called once, when that
    storage is freed (the last view of the result gone). ``buffer`` is kept alive until then.

    Raises:
        ValueError: the range is outside ``buffer``, or ``nbytes`` is not ``shape`` x ``dtype``.
        When this raises, ``release`` has not run and never will (the caller still owns its pin).
    """
    if offset < 0 or nbytes < 0 or offset + nbytes > buffer.numel():
        raise ValueError(f"pinned_view: bytes [{offset}, {offset + nbytes}) outside a buffer of {buffer.numel()}")
    count = 1
    for d in shape:
        count *= d
    if count * dtype.itemsize != nbytes:
        raise ValueError(f"pinned_view: {nbytes} bytes are not {tuple(shape)} x {dtype}")
    if nbytes == 0:
        release()
        return torch.empty(shape, dtype=dtype)
    exporter = _Exporter(buffer.data_ptr() + offset, nbytes, buffer, release)
    try:
        return torch.from_numpy(np.asarray(exporter)).view(dtype).view(shape)
    except BaseException:
        exporter._release = None  # failed: the caller still owns its pin
        raise


class Releaser:
    """Runs releases that need ``lock`` from finalizers without ever blocking on it (module docstring).

    Args:
        lock: the owner's lock (a non-reentrant ``threading.Lock`` or a ``Condition`` over one).
    """

    def __init__(self, lock) -> None:
        self._lock = lock
        self._fork = ForkMark()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._started = False
        self._start = threading.Lock()

    def call(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` (which expects ``lock`` held) now if the lock is free, else in the
        background thread. Nothing in a forked child. Errors are logged, never raised."""
        if self._fork.forked:
            return
        if self._lock.acquire(blocking=False):
            try:
                fn()
            except Exception:  # noqa: BLE001 - a finalizer must not raise
                log.exception("releasing a view's pin failed")
            finally:
                self._lock.release()
            return
        self._queue.put(fn)  # SimpleQueue.put is safe in finalizers
        if not self._started and self._start.acquire(blocking=False):  # never blocks a finalizer
            try:
                if not self._started:
                    threading.Thread(target=self._run, daemon=True, name="ectier-view-release").start()
                    self._started = True
            finally:
                self._start.release()

    def _run(self) -> None:
        while True:
            fn = self._queue.get()
            try:
                with self._lock:
                    fn()
            except Exception:  # noqa: BLE001 - keep serving releases
                log.exception("releasing a view's pin failed")
