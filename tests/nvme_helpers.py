"""Helpers of the NVMe tier tests (tests/test_nvme*.py, the corruption tests).

Stores: reopen a closed store with changed ``nvme`` settings (:func:`reopen`) or to check what it
serves (:func:`assert_reopened_serves`), three entries put and closed (:func:`put_three`), a
child interpreter (:func:`run_child`). A thread's reads or writes held mid-call
(:func:`io_held`). Damage: a closed (or open) NVMe store of layout v2 damaged
the way a disk would, in the segment file at the bytes of one record's payload, or in its LMDB
index entry."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Iterator

import torch

from ectier import TieredCache
from ectier.entry import entry_digest
from ectier.tiers.nvme_record import pack_index_value, parse_index_value
from ectier.tiers.nvme_segment import BLOCK_BYTES, SEGMENT_NAME, Location

from conftest import MiB, assert_same, open_lmdb, random_tensor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ------------------------------------------------------------------------------------ stores


def normal_bf16(shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(torch.bfloat16)


def reopen(cfg, **nvme_changes):
    if nvme_changes:
        cfg = cfg.replace(nvme=dataclasses.replace(cfg.nvme, **nvme_changes))
    return TieredCache(cfg)


def assert_reopened_serves(cfg, vals) -> None:
    """Reopen the closed store of ``cfg``: every ``key -> tensor`` of ``vals`` comes back byte-exact."""
    with reopen(cfg) as again:
        for k, t in vals.items():
            assert_same(again.get(k), t)


def run_child(code: str, *args: str, **kw) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], env=env, cwd=REPO,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, **kw)


def put_three(make_cache, **kw):
    cache, cfg = make_cache(host_bytes=0, nvme_bytes=2 * MiB, **kw)
    vals = {k: random_tensor((4, 8192), torch.bfloat16, i) for i, k in enumerate("abc")}
    for k, t in vals.items():
        cache.put(k, t)
    cache.close()
    return cfg, vals


# ------------------------------------------------------------------------------------ damage


def digest(key: str, namespace: str = "test") -> bytes:
    return entry_digest(namespace, key)


def segment_path(store_dir) -> Path:
    return Path(store_dir) / SEGMENT_NAME


def index_value(store_dir, key: str, namespace: str = "test", env=None) -> bytes | None:
    """The LMDB index value of ``key`` (``env``: an already open environment, e.g. ``lmdb_of(tier).env``)."""
    own = env is None
    if own:
        env, meta, *_ = open_lmdb(Path(store_dir))
    else:
        meta = env.open_db(b"meta")
    try:
        with env.begin() as txn:
            v = txn.get(digest(key, namespace), db=meta)
            return bytes(v) if v is not None else None
    finally:
        if own:
            env.close()


def set_index_value(store_dir, key: str, value: bytes | None, namespace: str = "test") -> None:
    env, meta, *_ = open_lmdb(Path(store_dir))
    try:
        with env.begin(write=True) as txn:
            if value is None:
                txn.delete(digest(key, namespace), db=meta)
            else:
                txn.put(digest(key, namespace), value, db=meta)
    finally:
        env.close()


def payload_spans(value: bytes) -> list[tuple[int, int]]:
    """``(offset, nbytes)`` byte ranges of the segment file holding the payload of index ``value``."""
    header, loc = parse_index_value(value)
    spans, left = [], header.payload_nbytes
    for start, count in loc.extents:
        n = min(left, count * BLOCK_BYTES)
        spans.append((start * BLOCK_BYTES, n))
        left -= n
    return spans


def flip_payload_byte(store_dir, value: bytes, pos: int | None = None, bit: int = 0x10) -> None:
    """Flip bit ``bit`` of payload byte ``pos`` (default: the middle; negative: from the end) in the file."""
    spans = payload_spans(value)
    total = sum(n for _, n in spans)
    p = total // 2 if pos is None else pos % total
    for off, n in spans:
        if p < n:
            with open(segment_path(store_dir), "r+b") as f:
                f.seek(off + p)
                b = f.read(1)[0]
                f.seek(off + p)
                f.write(bytes([b ^ bit]))
                f.flush()
                os.fsync(f.fileno())
            return
        p -= n


def read_payload(store_dir, value: bytes) -> bytes:
    """The payload bytes of index ``value`` as they are in the segment file."""
    with open(segment_path(store_dir), "rb") as f:
        return b"".join(os.pread(f.fileno(), n, off) for off, n in payload_spans(value))


def write_payload(store_dir, value: bytes, data: bytes) -> None:
    """Write ``data`` over the payload bytes of index ``value`` (as many as fit, zero-padded)."""
    with open(segment_path(store_dir), "r+b") as f:
        pos = 0
        for off, n in payload_spans(value):
            os.pwrite(f.fileno(), data[pos:pos + n].ljust(n, b"\0"), off)
            pos += n


def copy_payload(store_dir, src_value: bytes, dst_value: bytes) -> None:
    """Overwrite the payload bytes of ``dst_value`` with those of ``src_value`` (as many as fit)."""
    with open(segment_path(store_dir), "r+b") as f:
        data = b"".join(os.pread(f.fileno(), n, off) for off, n in payload_spans(src_value))
        pos = 0
        for off, n in payload_spans(dst_value):
            chunk = data[pos:pos + n]
            os.pwrite(f.fileno(), chunk, off)
            pos += len(chunk)


def with_location(value: bytes, extents) -> bytes:
    """``value`` with its payload location replaced by ``extents`` (``(first block, blocks)``)."""
    header, _ = parse_index_value(value)
    return pack_index_value(header, Location(tuple(extents)))


@contextlib.contextmanager
def io_held(monkeypatch, call: str, thread_name: str) -> Iterator[tuple[threading.Event, threading.Event]]:
    """``os.<call>`` (``"preadv"``, ``"pwrite"``) in the thread named ``thread_name`` waits until
    the yielded ``go`` is set (a slow disk for that one thread); yields ``(reached, go)``, ``reached``
    set once that thread is in the call. ``go`` is set on the way out."""
    real, reached, go = getattr(os, call), threading.Event(), threading.Event()

    def held(*args, **kwargs):
        if threading.current_thread().name == thread_name:
            reached.set()
            go.wait(10)
        return real(*args, **kwargs)

    with monkeypatch.context() as patched:
        patched.setattr(os, call, held)
        try:
            yield reached, go
        finally:
            go.set()


def lmdb_page_bytes(store_dir: Path) -> int:
    """The LMDB page size, bytes, of the closed store in ``store_dir``."""
    env = open_lmdb(store_dir)[0]
    try:
        return env.stat()["psize"]
    finally:
        env.close()


@contextlib.contextmanager
def overwrite_during_a_read(monkeypatch, cache: TieredCache, key: str, new: torch.Tensor) -> Iterator[dict]:
    """``put(key, new)`` while a ``get(key)`` on thread ``"R"`` is held inside its read of the old
    copy (the old blocks stay held for it); the body runs with the read still held, then it ends.
    Yields the dict the reader's result lands in (``got[key]``, after the block)."""
    got: dict = {}
    with io_held(monkeypatch, "preadv", "R") as (in_read, go):
        reader = threading.Thread(target=lambda: got.setdefault(key, cache.get(key)), name="R", daemon=True)
        reader.start()
        assert in_read.wait(10)
        cache.put(key, new)
        yield got
        go.set()
        reader.join(10)
