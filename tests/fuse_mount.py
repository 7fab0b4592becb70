"""A real FUSE mount for tests, with no FUSE library: ``/dev/fuse`` and ``mount(2)`` through ctypes,
and a server thread that answers the kernel's requests for an empty, read-only directory.

It serves ``INIT``, ``GETATTR`` (the root directory), ``LOOKUP`` (every name: ``ENOENT``) and
``ENOSYS`` to everything else (so ``mkdir`` inside it fails). Enough for ``/proc/self/mountinfo``
to list a ``fuse.<subtype>`` mount and for path resolution inside it. Needs root and
``/dev/fuse``; :func:`fuse_mount` raises ``OSError`` otherwise (callers skip).

Kernel ABI: ``include/uapi/linux/fuse.h`` (protocol 7.22 replies: the kernel accepts older minors).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import struct
import threading
from typing import Iterator

_IN_HEADER = struct.Struct("<IIQQIIII")  # len, opcode, unique, nodeid, uid, gid, pid, padding
_OUT_HEADER = struct.Struct("<IiQ")  # len, error, unique
FUSE_LOOKUP, FUSE_FORGET, FUSE_GETATTR, FUSE_INIT, FUSE_INTERRUPT, FUSE_DESTROY, FUSE_BATCH_FORGET = (
    1, 2, 3, 26, 36, 38, 42)
_NO_REPLY = {FUSE_FORGET, FUSE_INTERRUPT, FUSE_BATCH_FORGET}
MNT_DETACH = 2


def _attr_out() -> bytes:
    # fuse_attr_out: attr_valid, attr_valid_nsec, dummy, then fuse_attr (88 bytes)
    attr = struct.pack("<QQQQQQIIIIIIIIII", 1, 0, 0, 0, 0, 0, 0, 0, 0, 0o40555, 2, 0, 0, 0, 4096, 0)
    return struct.pack("<QII", 0, 0, 0) + attr


def _serve(fd: int) -> None:
    while True:
        try:
            buf = os.read(fd, 1 << 17)
        except OSError as exc:
            if exc.errno == errno.EINTR:
                continue
            return  # ENODEV: unmounted
        if len(buf) < _IN_HEADER.size:
            return
        _, opcode, unique, *_rest = _IN_HEADER.unpack_from(buf)
        if opcode in _NO_REPLY:
            continue
        body, err = b"", -errno.ENOSYS
        if opcode == FUSE_INIT:
            _major, _minor, max_readahead, _flags = struct.unpack_from("<IIII", buf, _IN_HEADER.size)
            body, err = struct.pack("<IIIIHHI", 7, 22, max_readahead, 0, 0, 0, 4096), 0
        elif opcode == FUSE_GETATTR:
            body, err = _attr_out(), 0
        elif opcode == FUSE_LOOKUP:
            err = -errno.ENOENT
        try:
            os.write(fd, _OUT_HEADER.pack(_OUT_HEADER.size + len(body), err, unique) + body)
        except OSError:
            if opcode == FUSE_DESTROY:
                return


@contextlib.contextmanager
def fuse_mount(mountpoint: str, subtype: str = "ectiertest") -> Iterator[str]:
    """Mount an empty FUSE filesystem (type ``fuse.<subtype>``) on ``mountpoint`` for the block."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open("/dev/fuse", os.O_RDWR)
    opts = f"fd={fd},rootmode=40000,user_id={os.getuid()},group_id={os.getgid()}".encode()
    if libc.mount(subtype.encode(), os.fsencode(mountpoint), f"fuse.{subtype}".encode(), 0, opts) != 0:
        e = ctypes.get_errno()
        os.close(fd)
        raise OSError(e, f"mount fuse.{subtype} on {mountpoint}: {os.strerror(e)}")
    thread = threading.Thread(target=_serve, args=(fd,), name="fuse-test-server", daemon=True)
    thread.start()
    try:
        yield mountpoint
    finally:
        libc.umount2(os.fsencode(mountpoint), MNT_DETACH)
        thread.join(timeout=10)
        os.close(fd)
