"""Reading one payload of the segment file into its destination with its xxh3-64, in one pass.

A warm read is a copy (page cache -> destination, ``os.preadv``) and an xxh3-64 over the bytes
copied. :func:`read_hashed` reads the payload in chunks, each hashed right after it is read (while
it is in the CPU cache), on the calling thread; with a :class:`ReadHelper` a second thread reads
chunks of the same payload at the same time (``preadv`` releases the GIL): each thread claims the
next unread chunk, and the caller hashes every chunk in payload order as soon as it is read (the
helper's while they are still in the shared cache), reading another chunk while the next in order
is still being read. The checksum stays one xxh3-64 stream over the payload in order (the record
format's), computed while the bytes are copied; only the copies overlap.

A helper that is busy with another read, or not scheduled (a loaded machine), takes nothing: the
caller reads every chunk itself, the serial path. The caller returns only after every chunk the
helper took is read, so no write into the destination outlives the call. :class:`ByteViews` gives
the destination's bytes of a caller's ``out=`` tensor without a ``Tensor.numpy()`` per read.
A thread marked with :func:`mark_background` (the cache's prefetch pool) never uses the helper:
a background promotion keeps to one core, so that ``prefetch_threads`` bounds the cores they use.
Measured in docs/benchmarks.md ("NVMe tier").
"""

from __future__ import annotations

import ctypes
import os
import queue
import threading
from typing import TYPE_CHECKING

import xxhash

from ..errors import CorruptRecordError

if TYPE_CHECKING:
    import torch

__all__ = ["ByteViews", "flat_cpu_bytes", "Chunk", "plan_chunks", "read_hashed", "ReadHelper", "CHUNK_BYTES",
           "PARALLEL_MIN_BYTES", "mark_background", "in_background"]

#: Chunk of a read, bytes: 1 MiB measured fastest at 1-64 MiB (docs/benchmarks.md, "NVMe tier").
CHUNK_BYTES = 1 << 20
#: Payloads of at least this many bytes are read on two threads when a helper is given (below it
#: the helper's wake-up, ~10-25 µs on this VM, is not paid back; measured slower at 1 MiB).
PARALLEL_MIN_BYTES = 4 << 20

_THREAD = threading.local()


def mark_background() -> None:
    """Mark the calling thread a background reader (a ``ThreadPoolExecutor`` initializer): its
    reads never use a :class:`ReadHelper`."""
    _THREAD.background = True


def in_background() -> bool:
    """Whether the calling thread was marked with :func:`mark_background`."""
    return getattr(_THREAD, "background", False)

Chunk = tuple[int, memoryview]  # (file offset in bytes, destination bytes)


def plan_chunks(extents: tuple[tuple[int, int], ...], bufs: list[memoryview], block_bytes: int,
                chunk_bytes: int) -> list[Chunk]:
    """The reads of a payload stored in ``extents`` (``(first block, blocks)`` of ``block_bytes``)
    into ``bufs`` (filled in order): chunks of at most ``chunk_bytes``, none crossing an extent.

    Raises:
        CorruptRecordError: the extents hold fewer bytes than ``bufs``.
    """
    chunks: list[Chunk] = []
    it = iter(extents)
    off = left = 0  # file offset and bytes left of the current extent
    for buf in bufs:
        pos, total = 0, len(buf)
        while pos < total:
            if not left:
                start, count = next(it, (None, 0))
                if start is None:
                    raise CorruptRecordError("payload location holds fewer bytes than the header says")
                off, left = start * block_bytes, count * block_bytes
            n = min(total - pos, left, chunk_bytes)
            chunks.append((off, buf[pos:pos + n]))
            pos += n
            off += n
            left -= n
    return chunks


def _pread_full(fd: int, mv: memoryview, off: int) -> None:
    """Fill ``mv`` from file offset ``off``; a read past the end of the file is a truncated segment."""
    got = os.preadv(fd, [mv], off)
    while got < len(mv):
        if got <= 0:
            raise CorruptRecordError("payload extends past the end of the segment file (truncated)")
        mv, off = mv[got:], off + got
        got = os.preadv(fd, [mv], off)


class _Job:
    """One payload read shared by the caller and the helper: each claims the next unread chunk."""

    __slots__ = ("fd", "chunks", "next", "lock", "done", "error")

    def __init__(self, fd: int, chunks: list[Chunk]) -> None:
        self.fd, self.chunks = fd, chunks
        self.next = 0  # chunks [next, len) are unclaimed
        self.lock = threading.Lock()
        self.done: dict[int, threading.Lock] = {}  # chunk taken by the helper -> released once read
        self.error: BaseException | None = None

    def claim(self) -> int | None:
        """The next unclaimed chunk's index, or ``None``."""
        with self.lock:
            i = self.next
            if i >= len(self.chunks):
                return None
            self.next = i + 1
            return i


class ReadHelper:
    """One daemon thread reading chunks of the reads handed to it (started at the first, again in a
    forked child). :meth:`close` stops it; a closed helper takes no more reads."""

    def __init__(self, name: str = "ectier-nvme-read") -> None:
        self._name = name
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._pid: int | None = None
        self._closed = False
        self._start_lock = threading.Lock()

    def submit(self, job: _Job) -> bool:
        """Offer ``job`` to the helper thread; False when closed."""
        if self._closed:
            return False
        if self._pid != os.getpid():
            with self._start_lock:
                if self._pid != os.getpid():
                    self._jobs = queue.SimpleQueue()
                    threading.Thread(target=self._run, args=(self._jobs,), name=self._name, daemon=True).start()
                    self._pid = os.getpid()
        self._jobs.put(job)
        return True

    def close(self) -> None:
        """Stop the thread once it has finished the reads handed to it (idempotent)."""
        if not self._closed:
            self._closed = True
            if self._pid == os.getpid():
                self._jobs.put(None)

    @staticmethod
    def _run(jobs: queue.SimpleQueue) -> None:
        while True:
            job = jobs.get()
            if job is None:
                return
            while True:
                with job.lock:
                    i = job.next
                    if i >= len(job.chunks):
                        break
                    job.next = i + 1
                    done = job.done[i] = threading.Lock()
                    done.acquire()
                try:
                    off, mv = job.chunks[i]
                    _pread_full(job.fd, mv, off)
                except BaseException as exc:  # handed to the caller, which raises it
                    job.error = exc
                finally:
                    done.release()


def read_hashed(fd: int, chunks: list[Chunk], helper: ReadHelper | None = None) -> int:
    """Read ``chunks`` (:func:`plan_chunks`) from ``fd`` into their buffers; the xxh3-64 of all
    their bytes in order. With ``helper``, its thread reads some of the chunks meanwhile: the caller
    hashes each chunk in order once it is read (its own right after reading it, the helper's as soon
    as they are done), and reads the next unclaimed chunk while the next in order is not.

    Raises:
        CorruptRecordError: a read past the end of the file (a truncated segment).
        OSError: a read failed (EIO).
    """
    h = xxhash.xxh3_64()
    update = h.update
    if helper is None or len(chunks) < 2:
        for off, mv in chunks:
            _pread_full(fd, mv, off)
            update(mv)
        return h.intdigest()
    job = _Job(fd, chunks)
    done, n = job.done, len(chunks)
    helper.submit(job)
    hashed = 0
    try:
        while True:
            i = job.claim()
            if i is None:
                break
            off, mv = chunks[i]
            _pread_full(fd, mv, off)
            while hashed <= i:  # hash, in order, every chunk read so far (the helper's if done)
                d = done.get(hashed)
                if d is not None and not d.acquire(blocking=False):
                    break  # the helper is still reading it: read another chunk meanwhile
                update(chunks[hashed][1])  # (a chunk the helper failed to read: raised below)
                hashed += 1
    finally:
        with job.lock:
            job.next = n  # after an error the helper takes no more chunks
        for j in range(hashed, n):
            d = done.get(j)
            if d is not None:
                d.acquire()  # wait until the helper's read of chunk j is over
    if job.error is not None:
        raise job.error
    for j in range(hashed, n):
        update(chunks[j][1])
    return h.intdigest()


def flat_cpu_bytes(t: "torch.Tensor") -> bool:
    """True for a contiguous ``uint8`` CPU tensor (bytes a read may land in)."""
    import torch

    return t.dtype is torch.uint8 and t.is_cpu and t.is_contiguous()


class ByteViews:
    """Writable memoryviews of flat ``uint8`` CPU tensors' bytes, remembered by address and length.

    ``Tensor.numpy()`` costs ~3-8 µs a call here (more after a 1 MiB copy has flushed the CPU
    caches); a caller that reads into the same ``out=`` again gets the view made the first time.
    A view is of the memory at an address (``PyMemoryView_FromMemory``), holding no reference to
    the tensor; it is only handed out for a tensor whose bytes are at that address and of that
    length now, i.e. memory that tensor holds while the read runs. At most :attr:`LIMIT` are kept.
    """

    LIMIT = 64

    def __init__(self) -> None:
        self._views: dict[tuple[int, int], memoryview] = {}

    def of(self, t: "torch.Tensor") -> memoryview:
        """The bytes of ``t`` (a contiguous ``uint8`` CPU tensor of at least one byte)."""
        key = (t.data_ptr(), t.numel())
        mv = self._views.get(key)
        if mv is None:
            if len(self._views) >= self.LIMIT:
                self._views.clear()
            mv = self._views[key] = _memory_view(key[0], key[1], _PYBUF_WRITE)
        return mv


# CPython's PyMemoryView_FromMemory: a writable 1-D "B" view of memory at an address (no ctypes
# array type per length, which ctypes would keep for good).
_memory_view = ctypes.pythonapi.PyMemoryView_FromMemory
_memory_view.restype = ctypes.py_object
_memory_view.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)
_PYBUF_WRITE = 0x200
