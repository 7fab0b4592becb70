"""Scratch files: the daemon's direct path for entries the host arena cannot take.

A put whose entry finds no room in the arena (larger than ``host.capacity_bytes``, or the rest of
the arena held by other clients' reservations and leases) and a get of an entry that cannot be
leased through the arena (on NVMe and larger than the arena) move their bytes through a scratch
file instead: a new file in ``daemon.shm_dir``, named ``ectier-<uid>-<pid>.scratch-<n>``, sized to
the entry, that the daemon and the one client map. Only clients that ask for it (``direct: true``,
see ``docs/protocol.md``) get one; the file is removed when its lease ends (commit, abort,
release, expiry, disconnect) and, after a crash, by the next daemon's start
(:func:`~ectier.daemon.files.reclaim_stale_arenas`).
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import threading
from typing import Iterator

import torch

from ..errors import TierWriteError
from .fdlimit import descriptor_shortage

__all__ = ["Scratch", "DirectPut", "DirectRead", "mapped"]

_NEXT = itertools.count(1)
_NEXT_LOCK = threading.Lock()


class Scratch:
    """One scratch file of ``nbytes`` bytes, mapped shared; :meth:`close` unmaps and removes it.

    Args:
        directory: ``daemon.shm_dir``.
        nbytes: the entry's size in bytes (0 allowed).
        gid: group to give the file (``daemon.allowed_group``; mode 0660), or ``None`` (mode 0600).

    Raises:
        TierWriteError: the file cannot be created or its space reserved (``daemon.shm_dir`` full),
            naming ``daemon.shm_dir``; or the daemon is out of file descriptors (EMFILE, ENFILE),
            naming ``RLIMIT_NOFILE`` and ``daemon.max_clients``. Nothing is left behind.
    """

    def __init__(self, directory: str, nbytes: int, *, gid: int | None = None) -> None:
        with _NEXT_LOCK:
            n = next(_NEXT)
        self.path = os.path.join(os.path.abspath(directory), f"ectier-{os.getuid()}-{os.getpid()}.scratch-{n}")
        self.nbytes = nbytes
        self._mmap: mmap.mmap | None = None
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        except OSError as exc:  # nothing created (O_EXCL: the name is this process's own)
            raise self._error(exc, directory) from None
        try:
            if gid is not None:
                os.fchown(fd, -1, gid)
                os.fchmod(fd, 0o660)
            if nbytes:
                os.posix_fallocate(fd, 0, nbytes)  # never a SIGBUS on a full tmpfs later
                # (mmap dups fd: out of descriptors here, too)
                self._mmap = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            os.close(fd)
            self._unlink()
            raise self._error(exc, directory) from None
        os.close(fd)

    def _error(self, exc: OSError, directory: str) -> TierWriteError:
        """The TierWriteError of a scratch file that could not be made: out of descriptors names
        RLIMIT_NOFILE and daemon.max_clients; anything else is no room in ``daemon.shm_dir``."""
        shortage = descriptor_shortage(exc, f"daemon.shm_dir: cannot create a {self.nbytes}-byte scratch file in "
                                            f"{directory!r}")
        if shortage is not None:
            return TierWriteError(shortage)
        return TierWriteError(f"daemon.shm_dir: no room for a {self.nbytes}-byte scratch file in "
                              f"{directory!r} ({exc.strerror or exc})")

    def view(self) -> torch.Tensor:
        """The file's bytes as a flat ``uint8`` tensor (valid until :meth:`close`)."""
        if self._mmap is None:
            return torch.empty(0, dtype=torch.uint8)
        return torch.frombuffer(self._mmap, dtype=torch.uint8)

    def close(self) -> None:
        """Unmap and remove the file. Idempotent."""
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                pass  # a tensor view still exists; the mapping goes with it
            self._mmap = None
        self._unlink()

    def _unlink(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    @property
    def extents(self) -> list[list[int]]:
        """``[[0, nbytes]]``: the whole file, as a reply's ``extents``."""
        return [[0, self.nbytes]] if self.nbytes else []

    def __repr__(self) -> str:
        return f"<Scratch {self.path} {self.nbytes} B>"


@contextlib.contextmanager
def mapped(path: str, nbytes: int) -> Iterator[torch.Tensor]:
    """The client's side: the scratch file at ``path`` (``nbytes`` long) as a flat ``uint8``
    tensor, mapped shared for the duration of the ``with`` block (drop the tensor before it ends).

    Raises:
        OSError: the file cannot be opened or mapped (the daemon removed it: its lease ended).
    """
    if nbytes == 0:
        yield torch.empty(0, dtype=torch.uint8)
        return
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
    try:
        m = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)
    view = torch.frombuffer(m, dtype=torch.uint8)
    try:
        yield view
    finally:
        del view
        try:
            m.close()
        except BufferError:
            pass  # a view escaped; the mapping goes with it


class DirectPut:
    """A put through a scratch file (a ``put`` lease's handle): :meth:`commit` stores the file's
    bytes with :meth:`TieredCache.put <ectier.cache.TieredCache.put>` (host arena if room was made
    meanwhile, else NVMe, as any put), then removes the file."""

    __slots__ = ("scratch", "key", "namespace", "dtype", "shape")

    def __init__(self, scratch: Scratch, key: str, namespace: str | None, dtype: str, shape: tuple) -> None:
        self.scratch, self.key, self.namespace, self.dtype, self.shape = scratch, key, namespace, dtype, shape

    @property
    def nbytes(self) -> int:
        return self.scratch.nbytes

    def commit(self, cache) -> None:
        """Store the entry. Raises what ``TieredCache.put`` raises (TierWriteError, ...)."""
        from ..tensors import torch_dtype

        try:
            dtype = torch_dtype(self.dtype)
            tensor = (self.scratch.view().view(dtype).view(self.shape) if self.scratch.nbytes
                      else torch.empty(self.shape, dtype=dtype))
            cache.put(self.key, tensor, namespace=self.namespace)
            del tensor
        finally:
            self.scratch.close()

    def abort(self) -> None:
        self.scratch.close()


class DirectRead:
    """A get through a scratch file (a ``get`` lease's handle): the entry's bytes, ``dtype`` (a
    dtype name) and ``shape``; :meth:`release` removes the file."""

    __slots__ = ("scratch", "dtype", "shape")

    def __init__(self, scratch: Scratch, dtype: str, shape: tuple) -> None:
        self.scratch, self.dtype, self.shape = scratch, dtype, shape

    @property
    def nbytes(self) -> int:
        return self.scratch.nbytes

    @classmethod
    def of(cls, tensor: torch.Tensor, directory: str, *, gid: int | None = None) -> "DirectRead":
        """Copy ``tensor`` (a CPU tensor read from the cache) into a new scratch file."""
        from ..tensors import byte_view, dtype_name

        src = byte_view(tensor)
        scratch = Scratch(directory, src.numel(), gid=gid)
        try:
            if src.numel():
                view = scratch.view()
                view.copy_(src)
                del view
        except BaseException:
            scratch.close()
            raise
        return cls(scratch, dtype_name(tensor.dtype), tuple(tensor.shape))

    def release(self) -> None:
        self.scratch.close()
