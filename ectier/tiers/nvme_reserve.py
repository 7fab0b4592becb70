"""Disk space held for LMDB, so that a full filesystem cannot stall the NVMe tier (issue 12, item 4).

On a full filesystem the tier frees room by evicting its own records (``moves/nvme.py``). Each
eviction is an LMDB delete, and a write transaction may need new pages at the end of
``data.mdb``; with no free block left on the filesystem that commit fails too, and so did every
later put, although older records held the space. :class:`LmdbReserve` keeps blocks allocated
past the end of ``data.mdb`` (``fallocate`` with ``FALLOC_FL_KEEP_SIZE``: the file's size does
not change, LMDB sees nothing): when LMDB grows the file it writes into those blocks, which need
no new space. The reserve is topped up after commits while the filesystem has room for it.
Where ``fallocate`` is missing (not Linux, or a filesystem without it) there is no reserve and
the tier behaves as before.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
from pathlib import Path

log = logging.getLogger("ectier.nvme")

#: blocks held past the end of ``data.mdb`` at most (256 LMDB pages: many evictions' commits)
RESERVE_BYTES = 1 << 20


def reserve_bytes(capacity_bytes: int) -> int:
    """The reserve of a tier of ``capacity_bytes``: 1/64 of it, 64 KiB to :data:`RESERVE_BYTES`
    (disk usage stays within 1.1 x ``nvme.capacity_bytes``, docs/operations.md)."""
    return min(RESERVE_BYTES, max(64 << 10, capacity_bytes // 64))
_FALLOC_FL_KEEP_SIZE = 1
_fallocate = None


def _libc_fallocate():
    global _fallocate
    if _fallocate is None:
        try:
            fn = ctypes.CDLL(None, use_errno=True).fallocate
            fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64]
            fn.restype = ctypes.c_int
            _fallocate = fn
        except (OSError, AttributeError):  # pragma: no cover - not Linux
            _fallocate = False
    return _fallocate


class LmdbReserve:
    """Blocks allocated past the end of ``data_file`` (see the module docstring).

    Args:
        data_file: LMDB's ``data.mdb``.
        nbytes: how much to hold (bytes).
    """

    def __init__(self, data_file: Path, nbytes: int = RESERVE_BYTES) -> None:
        self.nbytes = nbytes
        self._fd = -1
        if _libc_fallocate():
            try:
                self._fd = os.open(data_file, os.O_RDWR | os.O_CLOEXEC)
            except OSError as exc:  # pragma: no cover - LMDB just opened it
                log.debug("nvme tier: no LMDB space reserve (%s)", exc)

    def held_bytes(self) -> int:
        """Bytes allocated past the end of the file now (0 without a reserve)."""
        if self._fd < 0:
            return 0
        st = os.fstat(self._fd)
        return max(0, st.st_blocks * 512 - st.st_size)

    def keep(self) -> bool:
        """Top the reserve up to ``nbytes`` if it fell below half of that. False if the
        filesystem has no room for it now (tried again after the next commit) or there is none."""
        if self._fd < 0:
            return False
        st = os.fstat(self._fd)
        if st.st_blocks * 512 - st.st_size >= self.nbytes // 2:
            return True
        if _libc_fallocate()(self._fd, _FALLOC_FL_KEEP_SIZE, st.st_size, self.nbytes) == 0:
            return True
        err = ctypes.get_errno()
        if err in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):  # this filesystem: never
            self.close()
        return False

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
