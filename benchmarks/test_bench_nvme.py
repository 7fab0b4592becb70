"""NVMe tier: ``cache.put`` / ``cache.get`` on an NVMe-only cache vs raw file I/O of the same bytes.

The cache has ``host.capacity_bytes=0`` (allowed when ``nvme.path`` is set: every put goes straight
to the LMDB store, every get reads it). Like is compared with like:

============================  ===================================================================
ectier                        reference (same bytes, same directory, same run)
============================  ===================================================================
``put``, ``nvme.sync=True``   ``file write+fsync``: open / write / fsync / close, one file per entry
                              (overwritten in place, no ``O_TRUNC``); also ``O_DIRECT write+fsync``
``put``, ``nvme.sync=False``  ``file write (no fsync)``: open / write / close into the page cache
``get``, ``get(out=)``        ``file read (page cache)``: open / read into a preallocated buffer /
                              close, the file just written so the page cache is warm (as the LMDB
                              pages are); also ``O_DIRECT read (disk)``, cold, what the disk gives
============================  ===================================================================

The O_DIRECT variants need a filesystem that supports it (ext4, xfs: yes; tmpfs: no, skipped) and
page-aligned buffers (an anonymous mmap). Each ectier ``put`` overwrites the same key, so LMDB frees
and reuses pages as a steady stream of puts would; the raw side overwrites the same file. Files are
not truncated between writes: ext4's ``auto_da_alloc`` starts writeback on ``close`` of a file
that was truncated and rewritten, which would make "no fsync" pay for a flush.

GB/s = entry bytes / median time.
"""

from __future__ import annotations

import errno
import inspect
import mmap
import os
import shutil
from pathlib import Path

import pytest
import torch

from ectier import TieredCache
from ectier.config import CacheConfig, HostTierConfig, NvmeTierConfig

MiB = 1 << 20
GiB = 1 << 30

REF_WRITE_SYNC = "file write+fsync"
REF_WRITE_NOSYNC = "file write (no fsync)"
REF_WRITE_DIRECT = "O_DIRECT write+fsync"
REF_READ = "file read (page cache)"
REF_READ_DIRECT = "O_DIRECT read (disk)"

HAS_GET_OUT = "out" in inspect.signature(TieredCache.get).parameters
needs_out = pytest.mark.skipif(not HAS_GET_OUT, reason="TieredCache.get has no out= parameter")


def _bytes(x: torch.Tensor) -> memoryview:
    return memoryview(x.reshape(-1).view(torch.uint8).numpy())


@pytest.fixture
def nvme_cache(request, bench_dir, tokens):
    """An NVMe-only TieredCache in a fresh directory; ``request.param`` is ``nvme.sync``."""
    nbytes = tokens * 8192 * 2
    path = bench_dir / f"store-{tokens}-{'sync' if request.param else 'nosync'}"
    cfg = CacheConfig(
        host=HostTierConfig(capacity_bytes=0),
        nvme=NvmeTierConfig(path=str(path), sync=request.param, capacity_bytes=8 * nbytes + GiB,
                            map_initial_bytes=4 * nbytes + 64 * MiB, flush_on_close=False),
    )
    cache = TieredCache(cfg)
    yield cache
    cache.close()
    shutil.rmtree(path, ignore_errors=True)


# ------------------------------------------------------------------------------ raw file I/O


def write_file(path: str, data: memoryview, *, sync: bool, flags: int = 0) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | flags, 0o644)
    try:
        done = 0
        while done < len(data):
            done += os.write(fd, data[done:])
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def read_file(path: str, buf: memoryview, *, flags: int = 0) -> None:
    fd = os.open(path, os.O_RDONLY | flags)
    try:
        got = 0
        while got < len(buf):
            n = os.readv(fd, [buf[got:]])
            if n == 0:
                raise EOFError(f"{path}: {got} of {len(buf)} bytes")
            got += n
    finally:
        os.close(fd)


def _aligned_copy(data: memoryview) -> mmap.mmap:
    """``data`` in a page-aligned anonymous mapping (what O_DIRECT needs)."""
    buf = mmap.mmap(-1, len(data))
    memoryview(buf)[:] = data
    return buf


@pytest.fixture(scope="session")
def o_direct(bench_dir):
    """``os.O_DIRECT`` if the bench directory's filesystem accepts it, else skip."""
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        pytest.skip("O_DIRECT: not available on this platform")
    probe = str(bench_dir / "o_direct.probe")
    buf = mmap.mmap(-1, 4096)
    try:
        write_file(probe, memoryview(buf), sync=False, flags=flag)
        read_file(probe, memoryview(buf), flags=flag)
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP):
            pytest.skip(f"O_DIRECT: not supported by the filesystem of {bench_dir} ({exc.strerror})")
        raise
    finally:
        buf.close()
        if os.path.exists(probe):
            os.unlink(probe)
    return flag


# ------------------------------------------------------------------------------ writes


@pytest.mark.parametrize("nvme_cache", [True, False], ids=["sync", "nosync"], indirect=True)
def test_nvme_put_ectier(measure, payloads, tokens, nvme_cache):
    x = payloads(tokens)
    sync = nvme_cache.config.nvme.sync
    nvme_cache.put("img", x)
    nvme_cache.put("img", x)  # warm: map growth, LMDB freelist in steady state
    ref = REF_WRITE_SYNC if sync else REF_WRITE_NOSYNC
    compare = (ref, REF_WRITE_DIRECT) if sync else (ref,)
    measure(lambda: nvme_cache.put("img", x), suite="nvme", tokens=tokens,
            op=f"put sync={sync}", impl=f"ectier put (sync={sync})", role="ectier",
            bytes_per_call=x.nbytes, compare=compare, goal=True)
    assert nvme_cache.stats()["tiers"]["nvme"]["puts"] >= 3


@pytest.mark.parametrize("sync", [True, False], ids=["fsync", "nofsync"])
def test_nvme_write_ref_file(measure, payloads, tokens, bench_dir, sync):
    data = _bytes(payloads(tokens))
    path = str(bench_dir / f"raw-{tokens}-{sync}.bin")
    write_file(path, data, sync=sync)
    measure(lambda: write_file(path, data, sync=sync), suite="nvme", tokens=tokens,
            op=f"write sync={sync}", impl=REF_WRITE_SYNC if sync else REF_WRITE_NOSYNC, role="reference",
            bytes_per_call=len(data))
    os.unlink(path)


def test_nvme_write_ref_odirect(measure, payloads, tokens, bench_dir, o_direct):
    buf = _aligned_copy(_bytes(payloads(tokens)))
    data = memoryview(buf)
    path = str(bench_dir / f"direct-{tokens}.bin")
    write_file(path, data, sync=True, flags=o_direct)
    measure(lambda: write_file(path, data, sync=True, flags=o_direct), suite="nvme", tokens=tokens,
            op="write sync=True", impl=REF_WRITE_DIRECT, role="reference", bytes_per_call=len(data))
    os.unlink(path)
    data.release()
    buf.close()


# ------------------------------------------------------------------------------ reads


@pytest.mark.parametrize("nvme_cache", [False], ids=["store"], indirect=True)
def test_nvme_get_ectier(measure, payloads, tokens, nvme_cache):
    x = payloads(tokens)
    nvme_cache.put("img", x)
    got = nvme_cache.get("img")
    assert got is not None and torch.equal(got.view(torch.uint8), x.view(torch.uint8))
    measure(lambda: nvme_cache.get("img"), suite="nvme", tokens=tokens, op="get", impl="ectier get",
            role="ectier", bytes_per_call=x.nbytes, compare=(REF_READ, REF_READ_DIRECT), goal=True)
    assert nvme_cache.stats()["tiers"]["nvme"]["read_failures"] == 0


@needs_out
@pytest.mark.parametrize("nvme_cache", [False], ids=["store"], indirect=True)
def test_nvme_get_out_ectier(measure, payloads, tokens, nvme_cache):
    """``get(key, out=buffer)``: the result lands in the caller's buffer."""
    x = payloads(tokens)
    o = torch.empty_like(x)
    nvme_cache.put("img", x)
    assert nvme_cache.get("img", out=o) is not None and torch.equal(o.view(torch.uint8), x.view(torch.uint8))
    measure(lambda: nvme_cache.get("img", out=o), suite="nvme", tokens=tokens, op="get", impl="ectier get(out=)",
            role="ectier", bytes_per_call=x.nbytes, compare=(REF_READ, REF_READ_DIRECT), goal=True)


def test_nvme_read_ref_file(measure, payloads, tokens, bench_dir):
    data = _bytes(payloads(tokens))
    path = str(bench_dir / f"read-{tokens}.bin")
    write_file(path, data, sync=False)
    buf = bytearray(len(data))
    out = memoryview(buf)
    read_file(path, out)
    assert out == data
    measure(lambda: read_file(path, out), suite="nvme", tokens=tokens, op="read", impl=REF_READ,
            role="reference", bytes_per_call=len(data))
    os.unlink(path)


def test_nvme_read_ref_odirect(measure, payloads, tokens, bench_dir, o_direct):
    data = _bytes(payloads(tokens))
    path = str(bench_dir / f"read-direct-{tokens}.bin")
    write_file(path, data, sync=True)
    buf = mmap.mmap(-1, len(data))
    out = memoryview(buf)
    read_file(path, out, flags=o_direct)
    assert out == data
    measure(lambda: read_file(path, out, flags=o_direct), suite="nvme", tokens=tokens, op="read",
            impl=REF_READ_DIRECT, role="reference", bytes_per_call=len(data))
    os.unlink(path)
    out.release()
    buf.close()


# ------------------------------------------------------------------------------ interleaved


@pytest.mark.parametrize("nvme_cache", [True, False], ids=["sync", "nosync"], indirect=True)
def test_nvme_put_paired(paired, payloads, tokens, bench_dir, nvme_cache):
    """ectier put and the same-durability file write interleaved round by round."""
    x = payloads(tokens)
    data = _bytes(x)
    sync = nvme_cache.config.nvme.sync
    path = str(bench_dir / f"paired-{tokens}-{sync}.bin")
    ectier = lambda: nvme_cache.put("img", x)  # noqa: E731
    ref = lambda: write_file(path, data, sync=sync)  # noqa: E731
    for f in (ectier, ectier, ref):
        f()
    paired({f"ectier put (sync={sync})": ectier, REF_WRITE_SYNC if sync else REF_WRITE_NOSYNC: ref},
           suite="nvme", tokens=tokens, op=f"put sync={sync}", bytes_per_call=len(data))
    os.unlink(path)


@pytest.mark.parametrize("nvme_cache", [False], ids=["store"], indirect=True)
def test_nvme_get_paired(paired, payloads, tokens, bench_dir, nvme_cache):
    """ectier get and the page-cache file read interleaved round by round."""
    x = payloads(tokens)
    data = _bytes(x)
    path = str(bench_dir / f"paired-read-{tokens}.bin")
    write_file(path, data, sync=False)
    nvme_cache.put("img", x)
    out = memoryview(bytearray(len(data)))
    ectier = lambda: nvme_cache.get("img")  # noqa: E731
    ref = lambda: read_file(path, out)  # noqa: E731
    for f in (ectier, ref):
        f()
    paired({"ectier get": ectier, REF_READ: ref}, suite="nvme", tokens=tokens, op="get", bytes_per_call=len(data))
    os.unlink(path)


# ------------------------------------------------------------------------------ cold page cache

REF_READ_COLD = "file read (cold)"


def evict_page_cache(path) -> None:
    """Drop the page-cache pages of ``path`` that no process maps (fsync first: dirty pages stay)."""
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _store_files(path) -> list:
    """Every regular file of a store (LMDB files and whatever payload files a layout adds)."""
    return [p for p in path.rglob("*") if p.is_file()]


def _cold_rounds(tokens: int) -> int:
    return 5 if tokens <= 1024 else 3


def _cold_keys(nvme_cache, x: torch.Tensor):
    """``(setup, key)``: ``setup()`` puts ``x`` under a new key (its pages mapped by no reader yet)
    and drops the store's unmapped page-cache pages; ``key()`` is the key put last."""
    store = Path(nvme_cache.config.nvme.path)
    state = {"i": 0}

    def setup():
        state["i"] += 1
        nvme_cache.put(f"cold-{state['i']}", x)
        for f in _store_files(store):
            evict_page_cache(f)

    return setup, lambda: f"cold-{state['i']}"


@pytest.mark.parametrize("nvme_cache", [True], ids=["sync"], indirect=True)
def test_nvme_cold_get_ectier(measure, payloads, tokens, bench_dir, nvme_cache):
    """get of a record whose pages left the page cache (written earlier, evicted).

    Each round puts a new key (its pages are not mapped by any reader yet), drops the store's
    unmapped page-cache pages, then times ``get`` of that key: what serving from the NVMe tier
    costs once memory pressure has evicted the record.
    """
    x = payloads(tokens)
    setup, key = _cold_keys(nvme_cache, x)

    def get():
        return nvme_cache.get(key())

    setup()
    assert torch.equal(get().view(torch.uint8), x.view(torch.uint8))
    measure(get, setup=setup, rounds=_cold_rounds(tokens), suite="nvme", tokens=tokens, op="cold get",
            impl="ectier get (cold)", role="ectier", bytes_per_call=x.nbytes,
            compare=(REF_READ_COLD, REF_READ_DIRECT))


@needs_out
@pytest.mark.parametrize("nvme_cache", [True], ids=["sync"], indirect=True)
def test_nvme_cold_get_out_ectier(measure, payloads, tokens, bench_dir, nvme_cache):
    """The same cold get with ``get(key, out=buffer)``: like the reference, the bytes land in a
    buffer already faulted in (``get`` also pays a fresh tensor's page faults, which
    ``file read (cold)`` does not)."""
    x = payloads(tokens)
    o = torch.empty_like(x)
    setup, key = _cold_keys(nvme_cache, x)

    def get():
        return nvme_cache.get(key(), out=o)

    setup()
    assert get() is o and torch.equal(o.view(torch.uint8), x.view(torch.uint8))
    measure(get, setup=setup, rounds=_cold_rounds(tokens), suite="nvme", tokens=tokens, op="cold get",
            impl="ectier get(out=) (cold)", role="ectier", bytes_per_call=x.nbytes,
            compare=(REF_READ_COLD, REF_READ_DIRECT))


@pytest.mark.parametrize("nvme_cache", [True], ids=["sync"], indirect=True)
def test_nvme_cold_reopen_ectier(measure, payloads, tokens, nvme_cache):
    """Opening the store (as after a restart) holding one record, page cache cold.

    Only headers should be read; a time close to a cold read of the payload means the open reads
    the payload too. GB/s here = record bytes / open time, so the ratio to ``file read (cold)`` is
    the share of the payload read that the open costs.
    """
    x = payloads(tokens)
    nvme_cache.put("img", x)
    cfg = nvme_cache.config
    nvme_cache.close()
    store = Path(cfg.nvme.path)
    state = {}

    def setup():
        if "cache" in state:
            state.pop("cache").close()
        for f in _store_files(store):
            evict_page_cache(f)

    def reopen():
        state["cache"] = TieredCache(cfg)

    setup()
    reopen()
    assert "img" in state["cache"]
    measure(reopen, setup=setup, rounds=_cold_rounds(tokens), suite="nvme", tokens=tokens, op="cold open",
            impl="ectier reopen (cold)", role="ectier", bytes_per_call=x.nbytes, compare=(REF_READ_COLD,))
    state.pop("cache").close()
    if "cache" in state:
        state["cache"].close()


def test_nvme_cold_read_ref_file(measure, payloads, tokens, bench_dir):
    data = _bytes(payloads(tokens))
    path = str(bench_dir / f"read-cold-{tokens}.bin")
    write_file(path, data, sync=True)
    out = memoryview(bytearray(len(data)))
    measure(lambda: read_file(path, out), setup=lambda: evict_page_cache(path), rounds=_cold_rounds(tokens),
            suite="nvme", tokens=tokens, op="cold read", impl=REF_READ_COLD, role="reference",
            bytes_per_call=len(data))
    os.unlink(path)
