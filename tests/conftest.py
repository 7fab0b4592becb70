"""Shared helpers for the TieredCache / NVMe tier tests (CPU only, small budgets).

Sizes: host arenas of a few hundred KiB to a few MiB in 64 KiB blocks, NVMe budgets of about 1 MiB,
so evictions happen after a handful of puts and the whole suite stays fast on 2 cores.

Byte-exact comparisons go through :func:`raw_bytes`, which reads a tensor's logical C-order content
as ``uint8`` (so NaN payloads, negative zeros and fp8 bit patterns all count).
"""

from __future__ import annotations

import math

import lmdb

from ectier import testing
import pytest
import torch

from ectier import CacheConfig, HostTierConfig, NvmeTierConfig, TieredCache
from ectier.entry import entry_digest
from ectier.tiers.nvme_index import HEADER_ALLOWANCE_BYTES

KiB = 1 << 10
MiB = 1 << 20

#: the NVMe tier's header allowance (``NvmeIndex.fits``): an entry of ``n`` bytes
#: is admitted only when ``n + NVME_SLACK <= nvme.capacity_bytes``.
NVME_SLACK = HEADER_ALLOWANCE_BYTES


def float8_dtypes() -> list[torch.dtype]:
    return [getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n)]


ALL_DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.int8, torch.uint8, torch.bool,
              torch.int64, *float8_dtypes()]


def raw_bytes(t: torch.Tensor) -> bytes:
    """The tensor's logical content in C order as raw bytes (independent of its strides)."""
    flat = torch.empty(t.shape, dtype=t.dtype)
    flat.copy_(t)  # element-wise copy into a fresh C-contiguous tensor
    return flat.reshape(-1).view(torch.uint8).numpy().tobytes() if flat.numel() else b""


def random_tensor(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """A tensor whose bytes are random (all bit patterns, NaN payloads included; bool is 0/1)."""
    g = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    itemsize = torch.empty((), dtype=dtype).element_size()
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=g, dtype=torch.uint8).bool()
    b = torch.randint(0, 256, (n * itemsize,), generator=g, dtype=torch.uint8)
    return b.view(dtype).reshape(shape)


def filled(nbytes: int, value: int) -> torch.Tensor:
    """A uint8 tensor of ``nbytes`` bytes, byte i = (value * 7 + i) % 251 (distinct per value)."""
    return ((torch.arange(nbytes, dtype=torch.int64) + value * 7) % 251).to(torch.uint8)


def assert_same(got: torch.Tensor | None, expected: torch.Tensor) -> None:
    """``got`` has ``expected``'s dtype and shape and the same bytes."""
    assert got is not None, "expected a tensor, got a miss"
    assert isinstance(got, torch.Tensor)
    assert got.dtype == expected.dtype
    assert tuple(got.shape) == tuple(expected.shape)
    assert got.device.type == "cpu"
    assert raw_bytes(got) == raw_bytes(expected)


def digest(key: str, namespace: str = "test") -> bytes:
    return entry_digest(namespace, key)


def make_config(path, *, host_bytes: int = 1 * MiB, nvme_bytes: int = 1 * MiB, block_bytes: int = 64 * KiB,
                namespace: str = "test", nvme: bool = True, admit_wait_s: float = 1.0,
                write_behind_fraction: float = HostTierConfig.write_behind_fraction, **nvme_kw) -> CacheConfig:
    nvme_kw.setdefault("sync", False)
    nvme_kw.setdefault("map_initial_bytes", 4 * MiB)
    return CacheConfig(
        namespace=namespace,
        host=HostTierConfig(capacity_bytes=host_bytes, block_bytes=block_bytes, pin_memory=False,
                            admit_wait_s=admit_wait_s, write_behind_fraction=write_behind_fraction),
        nvme=NvmeTierConfig(path=str(path), capacity_bytes=nvme_bytes, **nvme_kw) if nvme else NvmeTierConfig(),
    )


@pytest.fixture
def make_cache(tmp_path):
    """``make_cache(**make_config kwargs, path=None) -> (cache, config)``; caches closed at teardown."""
    caches: list[TieredCache] = []

    def make(path=None, **kw):
        cfg = make_config(path if path is not None else tmp_path / "nvme", **kw)
        cache = TieredCache(cfg)
        caches.append(cache)
        return cache, cfg

    yield make
    for c in caches:
        c.close()


def open_lmdb(store_dir):
    """Open a closed store's LMDB environment directly (for fault injection)."""
    env = lmdb.open(str(store_dir / "lmdb"), subdir=True, max_dbs=4, map_size=1 << 30)
    return env, env.open_db(b"meta"), env.open_db(b"data"), env.open_db(b"quarantine"), env.open_db(b"settings")


def host_holds(cache: TieredCache, key: str, namespace: str = "test") -> bool:
    return testing.holds(cache, "host", key, namespace)


def nvme_holds(cache: TieredCache, key: str, namespace: str = "test") -> bool:
    return testing.holds(cache, "nvme", key, namespace)


def check_budgets(cache: TieredCache) -> None:
    st = cache.stats()["tiers"]
    if "host" in st:
        assert 0 <= st["host"]["used_bytes"] <= st["host"]["capacity_bytes"]
    if "nvme" in st:
        assert 0 <= st["nvme"]["used_bytes"] <= st["nvme"]["capacity_bytes"]


def check_quiescent(cache: TieredCache) -> None:
    """Internal consistency of an idle cache (``ectier.testing.check_invariants``)."""
    testing.check_invariants(cache)


# ------------------------------------------------------------------ daemon fixtures (per module)


@pytest.fixture(scope="module")
def main_daemon():
    """The ``main`` daemon process (daemon_helpers.main_daemon_process), one per test module."""
    from daemon_helpers import main_daemon_process

    with main_daemon_process() as proc:
        yield proc


@pytest.fixture(scope="module")
def client(main_daemon):
    """A DaemonClient of :func:`main_daemon`, one per test module."""
    from ectier.daemon.client import DaemonClient

    with DaemonClient(main_daemon.socket_path, client_name="pytest-main") as c:
        yield c


@pytest.fixture
def short_lease_daemon():
    """A daemon server in this process, one per test: 16 MiB arena, no NVMe, ``daemon.lease_s``
    0.5 s (orphan and ``bye`` tests let leases expire)."""
    from daemon_helpers import daemon_config, remove_dir, serve_in_thread, short_tmpdir

    d = short_tmpdir()
    server, t = serve_in_thread(CacheConfig.from_dict(daemon_config(d, nvme=False, host_bytes=16 * MiB, lease_s=0.5)))
    try:
        yield server
    finally:
        server.stop()
        t.join(10)
        remove_dir(d)


@pytest.fixture(scope="module")
def restricted():
    """The ``restricted`` daemon process (daemon_helpers.restricted_daemon_process), one per module."""
    from daemon_helpers import restricted_daemon_process

    with restricted_daemon_process() as proc:
        yield proc


# ------------------------------------------------------------------- daemon fixtures (per test)


@pytest.fixture
def daemon_dir():
    """A fresh short directory under ``/tmp`` (daemon_helpers.short_tmpdir: room for a socket
    path), removed after the test, once the daemons of :func:`thread_daemon` and
    :func:`process_daemon` are stopped."""
    from daemon_helpers import remove_dir, short_tmpdir

    d = short_tmpdir()
    yield d
    remove_dir(d)


@pytest.fixture
def thread_daemon(daemon_dir):
    """``thread_daemon(cfg) -> (server, thread)``: a daemon server for ``cfg`` (a ``CacheConfig``)
    serving in a thread of this process (daemon_helpers.serve_in_thread). Each one started is
    stopped and its thread joined after the test (one the test stopped already, too: harmless)."""
    from daemon_helpers import serve_in_thread

    started = []

    def start(cfg):
        started.append(serve_in_thread(cfg))
        return started[-1]

    yield start
    for server, t in started:
        server.stop()
        t.join(10)


@pytest.fixture
def process_daemon(daemon_dir):
    """``process_daemon(config_path, socket_path, **kw) -> DaemonProcess`` (not launched yet: call
    ``.start()`` or ``.launch()``). Each one made is stopped after the test."""
    from daemon_helpers import DaemonProcess

    made = []

    def make(*args, **kw):
        made.append(DaemonProcess(*args, **kw))
        return made[-1]

    yield make
    for proc in made:
        proc.stop()
