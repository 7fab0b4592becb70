"""Faulting a CPU arena's pages in ahead of its copies: :func:`populate_later` (an unpinned
host arena, private or the daemon's shared one) and :func:`populate_mapping_later` (a daemon
client's mapping of the daemon's arena file), each in a background thread.

A fresh pageable arena is only reserved address space: without this, the first write into each
4 KiB page (a save) faults and the kernel zeroes the page, and a 64 MiB save ran 2.5-20x slower
(docs/benchmarks.md, "Saves into a populated arena"). Pinned arenas need none of it: page-locking
faults every page in.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import threading
import time
import weakref
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # a daemon client (``ectier stats``) imports this module without torch
    import torch

__all__ = ["populate_later", "populate_mapping_later", "MADV_POPULATE_READ"]

log = logging.getLogger(__name__)

_MADV_POPULATE_WRITE = 23  # Linux >= 5.14: fault every page in, writable, contents untouched
#: Linux >= 5.14: map every page of a read-only mapping in (a daemon client's views)
MADV_POPULATE_READ = 22
_PAGE = mmap.PAGESIZE
#: bytes per populating ``madvise``: each call holds the process's memory-map lock (read) while
#: it faults its range in, and every ``mmap``/``munmap`` of the process (large tensors, Python's
#: own arenas) waits behind it; 256 KiB (~0.05-0.3 ms) keeps that wait short. Measured: with 32 MiB
#: calls, puts and saves beside a populating 2.5 GiB arena had p90s of 35-62 ms (1 ms without one)
_CHUNK = 256 << 10
_libc: Any = None


def _madvise(address: int, length: int, advice: int) -> int:
    """``madvise(2)``; 0 on success, else the ``errno`` (``ENOSYS`` where libc has none)."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            _libc.madvise.restype = ctypes.c_int
        except (OSError, AttributeError):
            _libc = False
    if not _libc:
        return errno.ENOSYS
    return 0 if _libc.madvise(address, length, advice) == 0 else (ctypes.get_errno() or errno.EINVAL)


def populate_later(buffer: torch.Tensor, *, chunk_bytes: int = _CHUNK,
                   stop: threading.Event | None = None) -> threading.Thread | None:
    """Fault in every page of an unpinned CPU arena, in a background thread, so copies into it
    (saves, NVMe promotions) pay no first-touch page faults.

    Why: a fresh private arena is only reserved address space; the first write to each 4 KiB
    page faults and the kernel zeroes it. Measured on the 2-core dev VM: a 64 MiB ``copy_`` into
    fresh pages ran at ~0.4-1.8 GB/s, into faulted-in pages at ~2.5-7 GB/s (load-dependent).
    The daemon's shared arena (a file in ``daemon.shm_dir``) has its pages from
    ``posix_fallocate`` on, but each first touch through the mapping still faults to map one
    page: a 32 MiB NVMe promotion into it took ~12 ms p50, ~5 ms populated (~0.3 s per GiB to
    populate; docs/benchmarks.md, "Daemon over NVMe").
    ``MADV_POPULATE_WRITE`` (Linux >= 5.14), 256 KiB per call: contents are never changed, so puts
    racing the thread are safe. Off the opening thread because it costs ~0.6 s per GiB (quiet) to
    ~1.5 s per GiB (loaded VM). Not at a lower priority: a thread descheduled inside a call
    holds the lock above for as long (measured: 1 MiB daemon puts 265 ms p50 at nice 19). No
    transparent huge pages (``MADV_HUGEPAGE``): populating them is ~3x faster, but a put that reaches a page before the
    thread does then compacts memory in its fault (measured: slower puts, docs/benchmarks.md),
    and reads were not faster. Memory: the arena's whole capacity becomes resident within that
    time (as a pinned arena's is at once). The thread holds the buffer only during each call (a
    weak reference otherwise), so an arena closed meanwhile is freed as before; it stops at the first
    refusal (an older kernel: the pages then fault on first write, as before).

    ``buffer``: a flat CPU tensor whose bytes are the arena. ``stop``: set it to end the thread
    before its next call (the arena's ``close``, which then joins it: a process that exits while
    the thread still runs is aborted in its finalization). Returns the thread (``None`` for an
    empty or non-CPU buffer). Never raises.
    """
    nbytes = buffer.numel() * buffer.element_size()
    if nbytes == 0 or buffer.device.type != "cpu":
        return None
    start = (buffer.data_ptr() + _PAGE - 1) & ~(_PAGE - 1)
    length = (buffer.data_ptr() + nbytes - start) & ~(_PAGE - 1)
    if length <= 0:
        return None
    ref = weakref.ref(buffer)

    def run() -> None:
        t0 = time.perf_counter()
        for lo in range(0, length, chunk_bytes):
            held = ref()
            if held is None or (stop is not None and stop.is_set()):
                return
            rc = _madvise(start + lo, min(chunk_bytes, length - lo), _MADV_POPULATE_WRITE)
            del held
            if rc != 0:
                log.debug("arena: MADV_POPULATE_WRITE refused (errno %d); pages fault on first write", rc)
                return
        log.debug("arena: %d bytes populated in %.3f s", length, time.perf_counter() - t0)

    thread = threading.Thread(target=run, daemon=True, name="ectier-arena-populate")
    thread.start()
    return thread


def populate_mapping_later(mapping: mmap.mmap, *, chunk_bytes: int = _CHUNK,
                           advice: int = _MADV_POPULATE_WRITE) -> threading.Thread | None:
    """Fault in a shared mapping of an arena file in a background thread, ``chunk_bytes`` (256
    KiB) per ``madvise(advice)`` (``MADV_POPULATE_WRITE`` for a writable mapping,
    :data:`MADV_POPULATE_READ` for a read-only one): page-table entries only (the file's pages
    exist already, their contents are untouched), so a client's accesses take no fault per 4 KiB
    page.

    Each call goes through ctypes, which releases the GIL for the call, as :func:`populate_later`
    does: ``mmap.madvise`` holds it for the whole system call (CPython's ``mmap_madvise_method``
    has no ``Py_BEGIN_ALLOW_THREADS``), so every other thread of the process, the model runner's
    included, waited for each call (measured: a thread sleeping 0.5 ms in a loop beside a 512 MiB
    mapping populated 256 KiB per ``mmap.madvise`` overshot by 0.15-15 ms p50 in two runs; by
    0.07 ms with ctypes).

    Off the caller's path because it costs ~0.3-1.2 s per GiB of mapping (measured on the dev
    VM); writes racing it are safe (as :func:`populate_later`). The thread keeps the mapping
    object alive while it runs and checks it is not closed before each call. Stops at the first
    refusal (a closed mapping, a kernel before Linux 5.14). Returns the thread (``None`` for an
    empty mapping). Never raises.
    """
    length = len(mapping)
    if length == 0:
        return None
    view = np.frombuffer(mapping, dtype=np.uint8, count=1)  # the mapping's address (either protection)
    start = view.ctypes.data
    del view  # no buffer export outlives this line: ``mapping.close()`` stays possible

    def run() -> None:
        for lo in range(0, length, chunk_bytes):
            if mapping.closed:
                return
            rc = _madvise(start + lo, min(chunk_bytes, length - lo), advice)
            if rc != 0:  # unmapped meanwhile, or not supported: the faults stay
                log.debug("arena mapping: madvise(%d) refused (errno %d); pages fault on first access", advice, rc)
                return

    thread = threading.Thread(target=run, daemon=True, name="ectier-arena-populate")
    thread.start()
    return thread
