"""Configuration: one frozen dataclass tree, units in every field name, validated at construction.

::

    CacheConfig
    ├── namespace: str                 model / encoder identity, part of every entry's identity
    ├── gpu: GpuTierConfig             device-memory arena on one explicit CUDA device (off by default)
    │     device, capacity_bytes, block_bytes, policy, copy_streams
    ├── host: HostTierConfig           pinned (or ordinary) host memory arena
    │     capacity_bytes, block_bytes, pin_memory, admit_wait_s, promote_clean_only, write_behind_fraction,
    │     policy
    ├── nvme: NvmeTierConfig           LMDB store under a directory (disabled when path is None)
    │     path, capacity_bytes, codec, zstd_level, sync, write_through, flush_on_close,
    │     map_initial_bytes, map_max_bytes, policy, group_commit_s, read_threads,
    │     allow_network_fs, on_damaged, thin_provisioning
    ├── remote: RemoteTierConfig       a distributed store shared by every node (off by default)
    │     backend, addresses, prefix, timeout_s, backoff_s, write_through, max_entry_bytes,
    │     chunk_bytes, username, password, tls, tls_ca_path, mooncake_metadata_server,
    │     mooncake_local_hostname, mooncake_global_segment_bytes, mooncake_local_buffer_bytes,
    │     mooncake_buffer_pool_bytes, mooncake_protocol, mooncake_device_name
    ├── daemon: DaemonConfig           the standalone daemon (``ectier serve``) only (config_daemon.py)
    │     socket_path, socket_mode, allowed_group, shm_dir, lease_s, max_frame_bytes,
    │     max_clients, max_clients_per_uid, idle_timeout_s, metrics_port, metrics_host,
    │     view_pin_bytes, view_pin_total_bytes
    └── prefetch_threads: int | None   background promotions at once (ectier.cpus)

Every field is checked in ``__post_init__`` (the checks are in :mod:`ectier.config_checks`); a bad
value raises :class:`~ectier.errors.ConfigError` whose message starts with the dotted field name
(``host.capacity_bytes: ...``). Every bad field of a section, a mapping or a file is reported at
once (one line each, in ``ConfigError.problems``).
The field reference in docs/operations.md is generated from the docstrings below
(:mod:`ectier.configdoc`).

Sources, all producing the same tree:

- :meth:`CacheConfig.from_dict` — nested mapping; byte fields also take strings such as
  ``"4GiB"`` / ``"512MB"`` (IEC units are powers of 1024, SI units powers of 1000);
- :meth:`CacheConfig.from_json` / :meth:`CacheConfig.from_yaml` / :meth:`CacheConfig.load` — files;
- :meth:`CacheConfig.from_env` — ``ECTIER_NAMESPACE``, ``ECTIER_HOST__CAPACITY_BYTES``,
  ``ECTIER_NVME__PATH``, ... (double underscore separates levels), layered over a base config.

Unknown keys are errors (with a "did you mean" hint), never silently ignored.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Mapping

from .config_checks import (
    ON_DAMAGED,
    GiB,
    KiB,
    MiB,
    Problems,
    check_across,
    check_gpu,
    check_host,
    check_int,
    check_namespace,
    check_nvme,
    format_bytes,
    parse_bytes,
)
from .config_daemon import DaemonConfig
from .config_remote import check_remote
from .errors import ConfigError

__all__ = [
    "CacheConfig",
    "GpuTierConfig",
    "HostTierConfig",
    "NvmeTierConfig",
    "RemoteTierConfig",
    "DaemonConfig",
    "parse_bytes",
    "format_bytes",
]

# KiB, MiB, GiB, ON_DAMAGED, parse_bytes and format_bytes live in ectier.config_checks and are
# importable from here too.


@dataclass(frozen=True)
class HostTierConfig:
    """Host-memory tier: one arena allocated once at start-up, carved into fixed blocks.

    Fields:
        capacity_bytes: byte budget of the arena (0 disables the tier), used in whole
            ``block_bytes`` blocks: a budget that is no multiple of it is rounded down
            (``stats()["tiers"]["host"]["capacity_bytes"]`` says what is used). Default 1 GiB.
        block_bytes: allocation unit; an entry occupies ``ceil(nbytes / block_bytes)`` blocks,
            possibly in several runs, so the arena never fragments. Power of two, 4 KiB..64 MiB.
            Default 256 KiB (< 25 % waste at the smallest Qwen3-VL entry, 1 MiB).
        pin_memory: ``True`` page-locks the arena (needs CUDA: without it the cache refuses to
            open, naming this knob), ``False`` never, ``None`` (default) pins exactly when CUDA is
            available. Pinning costs ~0.45 s per GiB at start-up (measured on an H200 host). Not
            used by the daemon (`ectier serve`): it never page-locks its shared arena, each
            client on a CUDA machine page-locks its own mapping of it.
        admit_wait_s: how long a put may wait for readers to release pinned entries before it
            gives up on this tier (the entry then goes to the NVMe tier). Default 5 s.
        promote_clean_only: when an NVMe hit is promoted, evict only host entries that NVMe already
            holds (no demotion write on the get path); if they do not cover the entry, it is served
            without promotion. Default ``False`` (LRU-faithful: promotion demotes what it must).
        write_behind_fraction: share of ``capacity_bytes`` (0..1), counted from the
            least-recently-used end of the tier (free bytes first), that a background thread keeps
            written to the NVMe tier ahead of need ("write-behind"): evicting such an entry is then
            a drop of a copy NVMe already holds, not a write inside the put or get that needs the
            room. 0 disables it (host victims are written on eviction). Has no effect without an
            NVMe tier or with ``nvme.write_through``. Default 0.5 (docs/benchmarks.md, write-behind).
        policy: eviction policy of the tier, ``"lru"`` (default) or ``"gdsf"`` (Greedy-Dual-Size-
            Frequency: keeps the entries that save the most recompute seconds per byte, using the
            ``cost_s`` given to ``TieredCache.put``; see :mod:`ectier.policy`).
    """

    capacity_bytes: int = 1 * GiB
    block_bytes: int = 256 * KiB
    pin_memory: bool | None = None
    admit_wait_s: float = 5.0
    promote_clean_only: bool = False
    write_behind_fraction: float = 0.5
    policy: str = "lru"

    def __post_init__(self) -> None:
        check_host(self)


@dataclass(frozen=True)
class GpuTierConfig:
    """GPU tier: one arena of device memory on one explicit CUDA device, allocated once.

    Fields:
        device: ``"cuda:<index>"`` of the worker that owns the cache (never a bare ``"cuda"``:
            CUDA ordering rule 6 of docs/architecture.md). Whether the index exists is checked
            when the cache opens. Default ``"cuda:0"``.
        capacity_bytes: byte budget of the device arena, in whole ``block_bytes`` blocks (rounded
            down); 0 (default) disables the tier. Checked
            against the device's free memory when the cache opens (``ConfigError`` naming this field).
        block_bytes: allocation unit, a power of two between 64 KiB and 64 MiB. Default 1 MiB
            (the smallest Qwen3-VL entry, N=64 tokens x 8192 x bf16).
        policy: eviction policy, ``"lru"`` (default) or ``"gdsf"`` (as ``host.policy``). Victims
            demote to the host tier by an asynchronous device-to-host copy.
        copy_streams: dedicated CUDA streams per direction (device-to-host, host-to-device) of the
            copy engine, 1..8. Default 2.
    """

    device: str = "cuda:0"
    capacity_bytes: int = 0
    block_bytes: int = 1 * MiB
    policy: str = "lru"
    copy_streams: int = 2

    def __post_init__(self) -> None:
        check_gpu(self)

    @property
    def enabled(self) -> bool:
        """True when the tier has a budget."""
        return self.capacity_bytes > 0

    @property
    def device_index(self) -> int:
        """The ``<index>`` of ``device``."""
        return int(self.device.split(":")[1])


@dataclass(frozen=True)
class NvmeTierConfig:
    """NVMe tier: an LMDB environment under ``path``; records are self-describing and checksummed.

    Fields:
        path: directory of the store (created if missing; a leading ``~`` is the home directory).
            ``None`` (default) disables the tier.
        capacity_bytes: byte budget of stored records: each counts its header plus the whole
            64 KiB blocks of the segment file its payload (after compression) takes, so a tiny
            entry costs one block. Default 16 GiB. 0 with a ``path`` opens a tier that stores
            nothing (every put too large for it; drop ``path`` to have no NVMe tier). A budget below one 64 KiB block of the segment file (the least an
            entry takes on disk), but not 0, is a ``ConfigError`` at open.
        codec: ``"raw"`` (default), ``"zstd"`` or ``"zstd-planes"`` (byte planes split before zstd;
            ~1.46x on bf16 encoder outputs vs ~1.29x for plain zstd at level 1, docs/benchmarks.md).
        zstd_level: zstd level for the zstd codecs, -7..22. Default 1.
        sync: fsync every commit (durable across power loss). ``False`` keeps crash safety against
            a killed process but may lose the last commits on a system crash. Default ``True``.
        write_through: also write every put into the host tier (and every daemon put) to this tier
            at once (inclusive tiers: evicting from host then costs nothing, and such a put survives
            a crash). A put into the GPU tier is not written through: it reaches this tier when
            demoted or flushed. Default ``False`` (write-back: host victims are demoted on eviction).
        flush_on_close: on ``TieredCache.close()``, write host-only entries here so that a restart
            serves them. Default ``True``.
        map_initial_bytes: LMDB map size at first open; grows by doubling when full. Default 256 MiB.
        map_max_bytes: ceiling of map growth. Default ``None`` = ``2 * capacity_bytes + 256 MiB``
            (a ceiling of the sparse map, not disk taken). The map holds the index only (layout v2:
            one header and location per entry, a few hundred bytes; the payloads live in the
            segment file), so even 1 MiB holds thousands of entries; a map too small for the index
            fails the writes that do not fit with ``TierWriteError`` (map full).
        policy: eviction policy of the tier, ``"lru"`` (default) or ``"gdsf"`` (as ``host.policy``).
        group_commit_s: group commit: how long a write whose payload is on disk waits, at most, for
            other writes still copying theirs, so that they share one ``fdatasync`` and one LMDB
            commit (seconds, >= 0). A lone write never waits; every write still returns once its
            own entry is durable. Default 0.002.
        read_threads: threads that copy one payload out of the page cache on a read: ``1``: the
            reading thread alone, each chunk hashed right after it is copied; ``2`` (default): a
            helper thread also copies chunks of payloads of 4 MiB and more (the caller hashes them
            in order). On a quiet 2-vCPU machine a 64 MiB warm get went from 0.89 to 1.04-1.10 of
            a raw read; on one whose cores are all busy it was slower: set ``1`` there
            (docs/benchmarks.md, "NVMe tier").
        allow_network_fs: open a store on a network or FUSE filesystem (NFS, CIFS/SMB, 9p, Ceph,
            GlusterFS, Lustre, GPFS, ``fuse.*``, ...). Default ``False``: such a ``path`` is refused
            with ``ConfigError`` at open, because LMDB's locks and shared memory map are unsafe there.
        on_damaged: what opening a damaged store (LMDB refuses it, or ``data.mdb`` is truncated)
            does. ``"fail"`` (default): ``StoreDamagedError``; repair it with ``ectier fsck --repair``.
            ``"reset"``: move it aside to ``<path>/damaged-<time>/`` with one warning and start with
            an empty store (an engine always starts; the records are lost to it).
        thin_provisioning: accept a ``capacity_bytes`` above what the filesystem of ``path`` can
            hold (its free bytes plus what the store's records already take). Default ``False``:
            such a budget is a ``ConfigError`` at open, naming the free bytes (a WARNING only for a
            budget this store was opened with before, the disk filled since); with ``True`` writes
            past the free space fail with disk full instead.
    """

    path: str | None = None
    capacity_bytes: int = 16 * GiB
    codec: str = "raw"
    zstd_level: int = 1
    sync: bool = True
    write_through: bool = False
    flush_on_close: bool = True
    map_initial_bytes: int = 256 * MiB
    map_max_bytes: int | None = None
    policy: str = "lru"
    group_commit_s: float = 0.002
    read_threads: int = 2
    allow_network_fs: bool = False
    on_damaged: str = "fail"
    thin_provisioning: bool = False

    def __post_init__(self) -> None:
        check_nvme(self)

    @property
    def enabled(self) -> bool:
        """True when a directory is configured."""
        return self.path is not None

    @property
    def map_ceiling_bytes(self) -> int:
        """The largest LMDB map size this tier will grow to, in bytes."""
        if self.map_max_bytes is not None:
            return self.map_max_bytes
        return max(self.map_initial_bytes, 2 * self.capacity_bytes + 256 * MiB)


@dataclass(frozen=True)
class RemoteTierConfig:
    """Remote tier: entries shared by every engine on every node, on a distributed store.

    Fields:
        backend: ``"none"`` (default: no remote tier), ``"redis"`` (a Redis / Valkey Cluster,
            or one server) or ``"mooncake"`` (a Mooncake Store: its ``mooncake_master``).
        addresses: ``"host:port[,host:port...]"``: seed nodes of the cluster (one is enough; the
            others are found from it; each seed gets a share of a connect's ``timeout_s``, so a
            hung one leaves time for the next); for ``mooncake`` the master's RPC address (one).
            No scheme (``redis://``); an IPv6 host in brackets (``[::1]:6379``). Required when
            ``backend`` is not ``"none"``.
        prefix: first part of every object's key (Redis: ``<prefix>:m:<digest of namespace and
            key>`` and its chunks ``<prefix>:c:...``), so that several deployments can share one
            store. Default ``"ectier"``.
        timeout_s: deadline of one remote call (connect included); a call past it is a miss and
            starts the back-off. Default 2 s.
        backoff_s: after a failed or timed-out call, remote calls are skipped (misses, no I/O)
            for this long, then tried again. Default 5 s.
        write_through: write every put to the remote tier in the background (never on the
            caller's path), so that other nodes find it. Default ``True``.
        max_entry_bytes: entries larger than this are not written remotely (a value of a Redis
            server is capped at 512 MiB), nor read: a Redis manifest or a Mooncake object
            declaring more is a counted checksum failure, so hosts sharing a store use one
            value. Default 256 MiB.
        chunk_bytes: objects larger than this are stored in chunks of this size with a manifest
            written last (a reader never assembles a half-written entry). Default 2 MiB (measured:
            docs/benchmarks.md, "Remote tier: Redis Cluster").
        username: ACL user name for AUTH; ``None`` (default): none.
        password: password for AUTH; ``None`` (default): none. Never logged or reported.
        tls: connect with TLS. Default ``False``.
        tls_ca_path: CA bundle that signed the servers' certificates (a file; only with
            ``tls: true``); ``None`` (default): the system's.
        mooncake_metadata_server: Mooncake: the transfer engine's metadata server,
            ``"http://host:port/metadata"`` (the master's own with
            ``--enable_http_metadata_server=true``), or ``"etcd://host:port"``; ``""`` (default):
            ``http://<master host>:8080/metadata``.
        mooncake_local_hostname: Mooncake: this node's address as the other nodes reach it
            (``"host"`` or ``"host:port"``); ``""`` (default): the local address of the route to
            the master.
        mooncake_global_segment_bytes: Mooncake: memory this process lends to the store for
            everyone's objects (0: none, a client only; objects then live on other nodes'
            segments). Default 512 MiB.
        mooncake_local_buffer_bytes: Mooncake: the client's own transfer buffer; a remote write of
            an entry up to half of it goes through it (measured faster than from the entry's own
            memory), larger ones from registered memory. Default 128 MiB.
        mooncake_buffer_pool_bytes: Mooncake: the most memory kept registered with the client for
            remote reads and writes, registered once and reused (a fetched entry is handed out
            over it and returns to the pool when the last tensor over it dies); an object that
            finds no room uses memory registered for its one call. 0: no pool. Default 256 MiB.
        mooncake_protocol: Mooncake transport: ``"tcp"`` (default) or ``"rdma"``.
        mooncake_device_name: Mooncake: RDMA device(s), e.g. ``"mlx5_0"`` or
            ``"mlx5_0,mlx5_1"``; ``""`` (default): none (``tcp``) or auto-detected.
    """

    backend: str = "none"
    addresses: str = ""
    prefix: str = "ectier"
    timeout_s: float = 2.0
    backoff_s: float = 5.0
    write_through: bool = True
    max_entry_bytes: int = 256 * MiB
    chunk_bytes: int = 2 * MiB
    username: str | None = None
    password: str | None = None
    tls: bool = False
    tls_ca_path: str | None = None
    mooncake_metadata_server: str = ""
    mooncake_local_hostname: str = ""
    mooncake_global_segment_bytes: int = 512 * MiB
    mooncake_local_buffer_bytes: int = 128 * MiB
    mooncake_buffer_pool_bytes: int = 256 * MiB
    mooncake_protocol: str = "tcp"
    mooncake_device_name: str = ""

    def __post_init__(self) -> None:
        check_remote(self)

    @property
    def enabled(self) -> bool:
        """True when a backend is configured."""
        return self.backend != "none"

    @property
    def address_list(self) -> list[tuple[str, int]]:
        """``addresses`` as ``(host, port)`` pairs."""
        out = []
        for item in filter(None, (a.strip() for a in self.addresses.split(","))):
            host, _, port = item.rpartition(":")
            out.append((host.strip("[]"), int(port)))
        return out


@dataclass(frozen=True)
class CacheConfig:
    """Root configuration of a :class:`~ectier.cache.TieredCache`.

    Fields:
        namespace: model / encoder identity (e.g. ``"Qwen/Qwen3-VL-30B-A3B-Instruct@main:bfloat16"``).
            Part of every entry's identity: the same key under two namespaces is two entries.
        host: :class:`HostTierConfig`.
        nvme: :class:`NvmeTierConfig`.
        gpu: :class:`GpuTierConfig` (disabled by default).
        remote: :class:`RemoteTierConfig` (disabled by default).
        daemon: :class:`DaemonConfig` (used only by ``ectier serve`` and its clients).
        prefetch_threads: background promotions (``TieredCache.prefetch``, the daemon's
            ``prefetch``) that run at once, at most (1-64), each on one core (no read helper). ``None``:
            1 where the process may use 4 CPUs or fewer (affinity and cgroup quota; the rest are
            the engine's), else 2.
            Two at once on a 2-vCPU machine raised a co-located vLLM scheduler's step p99 from
            ~0.6 to 2.6-5.7 ms in most runs (docs/benchmarks.md, "Daemon mode: background
            promotions keep to one core on a small machine"). Prefetches of keys stored only
            in the remote tier run apart, up to ``prefetch_threads`` more, in threads of their own
            that take no slot (a slow remote store never holds up promotions from NVMe); their
            checksum, decode and copy into the arena run there too, beside the promotions.
    """

    namespace: str = "default"
    host: HostTierConfig = field(default_factory=HostTierConfig)
    nvme: NvmeTierConfig = field(default_factory=NvmeTierConfig)
    daemon: DaemonConfig = field(default_factory=DaemonConfig)
    gpu: GpuTierConfig = field(default_factory=GpuTierConfig)
    remote: RemoteTierConfig = field(default_factory=RemoteTierConfig)
    prefetch_threads: int | None = None

    def __post_init__(self) -> None:
        p = Problems()
        with p.check("namespace"):
            check_namespace(self.namespace)
        with p.check("prefetch_threads"):
            if self.prefetch_threads is not None:
                check_int("prefetch_threads", self.prefetch_threads, minimum=1)
                if self.prefetch_threads > 64:
                    raise ConfigError(f"prefetch_threads: at most 64, got {self.prefetch_threads}")
        for name, cls in (("host", HostTierConfig), ("nvme", NvmeTierConfig), ("daemon", DaemonConfig),
                          ("gpu", GpuTierConfig), ("remote", RemoteTierConfig)):
            if not isinstance(getattr(self, name), cls):
                with p.check(name):
                    raise ConfigError(f"{name}: expected {cls.__name__}, got {type(getattr(self, name)).__name__}")
        p.raise_if_any()
        check_across(self)

    # ----------------------------------------------------------------------------------- loaders
    # (implemented in ectier.config_sources, which imports this module)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "CacheConfig":
        """Build from a nested mapping (``{"host": {"capacity_bytes": "4GiB"}, ...}``).

        Raises:
            ConfigError: unknown keys (with a close match), wrong types, invalid values: every one
                of them at once, one line each, each naming its dotted field.
        """
        from .config_sources import config_from_dict

        return config_from_dict(cls, data)

    def to_dict(self) -> dict[str, Any]:
        """The config as plain nested dicts (round-trips through :meth:`from_dict`)."""
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> "CacheConfig":
        """A copy with top-level fields replaced (validated again).

        Raises:
            ConfigError: a name that is no field of CacheConfig (the message lists the fields), or
                a replaced value that fails validation.
        """
        fields = [f.name for f in dataclasses.fields(self) if f.init]
        unknown = sorted(set(changes) - set(fields))
        if unknown:
            raise ConfigError(f"CacheConfig.replace: unknown field(s) {', '.join(unknown)}; "
                              f"the fields are {', '.join(fields)}")
        return dataclasses.replace(self, **changes)

    @classmethod
    def from_json(cls, source: str | os.PathLike) -> "CacheConfig":
        """Build from a JSON file path (or a JSON text that starts with ``{``).

        Raises:
            ConfigError: the file cannot be read or parsed (``config: ...``), or as :meth:`from_dict`.
        """
        from .config_sources import config_from_json

        return config_from_json(cls, source)

    @classmethod
    def from_yaml(cls, source: str | os.PathLike) -> "CacheConfig":
        """Build from a YAML file path (or a YAML text containing a newline); errors as :meth:`from_json`."""
        from .config_sources import config_from_yaml

        return config_from_yaml(cls, source)

    @classmethod
    def load(cls, path: str | os.PathLike) -> "CacheConfig":
        """Build from a ``.json``, ``.yaml`` or ``.yml`` file, chosen by suffix; errors as :meth:`from_json`."""
        from .config_sources import load_config

        return load_config(cls, path)

    @classmethod
    def from_env(
        cls,
        environ: Mapping[str, str] | None = None,
        *,
        prefix: str = "ECTIER_",
        base: "CacheConfig | None" = None,
    ) -> "CacheConfig":
        """Overlay environment variables on ``base`` (default: defaults).

        ``ECTIER_NAMESPACE=m``, ``ECTIER_HOST__CAPACITY_BYTES=4GiB``, ``ECTIER_NVME__PATH=/nvme/ec``,
        ``ECTIER_NVME__SYNC=false``, ``ECTIER_NVME__MAP_MAX_BYTES=none``. Booleans take
        true/false/1/0/yes/no; ``none``/``null`` sets an optional field to ``None``.
        ``ECTIER_CONFIG=/path/file.yaml`` loads that file first (when ``base`` is not given).

        Raises:
            ConfigError: unknown variables under the prefix (named) and invalid values, all at once;
                its ``env_vars`` names the variables at fault (``ECTIER_CONFIG`` for a bad file).
        """
        from .config_sources import config_from_env

        return config_from_env(cls, os.environ if environ is None else environ, prefix, base)
