"""Errors of NVMe-tier writes: a full filesystem (:class:`NvmeDiskFullError`, on which the mover
evicts and retries) told apart from other write failures, with the knob to turn."""

from __future__ import annotations

import errno
from pathlib import Path

import lmdb

from ..errors import TierWriteError

__all__ = ["NvmeDiskFullError", "lmdb_write_error", "write_error", "write_error_text"]


def lmdb_write_error(path: Path, exc: lmdb.Error, need_bytes: int, free: int | None) -> TierWriteError:
    """The error of an LMDB write that failed with ``exc``: :class:`NvmeDiskFullError` when the
    filesystem is (nearly) full (the mover then evicts and retries), else :class:`TierWriteError`."""
    text = write_error_text(path, exc, need_bytes, free)
    return NvmeDiskFullError(text) if text.startswith("nvme tier: disk full") else TierWriteError(text)


def write_error_text(path: Path, exc: lmdb.Error, need_bytes: int, free: int | None) -> str:
    """The message of the :class:`TierWriteError` for a write of ``need_bytes`` under ``path`` that
    failed with ``exc`` while ``free`` bytes were free there: "disk full" with the knob to turn
    when the disk is (nearly) full, else LMDB's error."""
    text = str(exc)
    # LMDB reports a short write of its pages (a file system filling up mid-commit, as tmpfs
    # and most file systems do) as EIO, not ENOSPC: look at the free space to tell them apart
    if ("No space" in text or getattr(exc, "errno", None) == errno.ENOSPC
            or (free is not None and free < need_bytes + (1 << 20))):
        return (f"nvme tier: disk full under {str(path)!r} ({text}; {free} bytes free, the record "
                f"needs {need_bytes}); free space on that file system or lower nvme.capacity_bytes")
    return f"nvme tier: write failed under {str(path)!r}: {text}"


class NvmeDiskFullError(TierWriteError):
    """A write found the filesystem of ``nvme.path`` full (``ENOSPC``); nothing stored changed."""


def write_error(path: Path, exc: OSError, need_bytes: int, free: int | None) -> TierWriteError:
    """The error of a payload write of ``need_bytes`` under ``path`` that failed with ``exc``:
    :class:`NvmeDiskFullError` for ``ENOSPC``, else :class:`TierWriteError` (EIO, ...)."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return NvmeDiskFullError(
            f"nvme tier: disk full under {str(path)!r} ({exc.strerror}; {free} bytes free, the payload "
            f"needs {need_bytes}); free space on that file system or lower nvme.capacity_bytes")
    return TierWriteError(f"nvme tier: payload write failed under {str(path)!r}: {exc}")
