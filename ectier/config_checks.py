"""Checks and parsing of config values, for :mod:`ectier.config` (and :mod:`ectier.config_sources`).

- :func:`parse_bytes` / :func:`format_bytes`: byte counts as ``int`` or ``"4GiB"``-style strings;
- :class:`Problems`: collects every bad field of a section, a mapping or a file, so that all are
  reported at once (one line each, in ``ConfigError.problems``);
- one check per kind of value (:func:`check_int`, :func:`check_seconds`, :func:`check_text`, ...),
  each raising :class:`~ectier.errors.ConfigError` whose message starts with the dotted field name;
- :func:`check_host`, :func:`check_gpu`, :func:`check_nvme`, :func:`check_daemon`: the checks of
  each section's fields, run by its ``__post_init__``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from fractions import Fraction
from typing import TYPE_CHECKING, Any, Iterator

from .config_modes import check_socket_mode
from .errors import ConfigError

if TYPE_CHECKING:
    from .config import DaemonConfig, GpuTierConfig, HostTierConfig, NvmeTierConfig

__all__ = [
    "KiB", "MiB", "GiB", "ON_DAMAGED", "parse_bytes", "format_bytes", "Problems",
    "check_int", "check_bool", "coerce_bytes", "check_seconds", "check_policy", "check_text", "fspath",
    "check_namespace", "check_host", "check_gpu", "check_nvme", "check_daemon",
]

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4, "p": 1000**5, "pb": 1000**5, "e": 1000**6, "eb": 1000**6,
    "kib": KiB, "mib": MiB, "gib": GiB, "tib": 1 << 40, "pib": 1 << 50, "eib": 1 << 60,
    # Kubernetes' quantities ("64Gi"): IEC too
    "ki": KiB, "mi": MiB, "gi": GiB, "ti": 1 << 40, "pi": 1 << 50, "ei": 1 << 60,
}
#: the largest byte count a config takes (what a signed 64-bit size holds: 8 EiB, past any machine)
MAX_BYTES = (1 << 63) - 1
_BYTES_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | str, *, field_name: str = "value") -> int:
    """Parse a byte count: an ``int`` or a string such as ``"64GiB"``, ``"512 MB"``, ``"1048576"``.

    IEC suffixes (KiB, MiB, GiB, TiB, PiB, EiB, or Kubernetes' Ki/Mi/Gi/Ti/Pi/Ei) are powers of
    1024; SI suffixes (KB, MB, GB, TB, PB, EB, or K/M/G/T/P/E) are powers of 1000; units are read
    case-insensitively, except that an upper-case prefix with a lower-case ``b`` (``"10Mb"``,
    ``"1Gib"``) is the usual spelling of bits and is refused. Returns bytes as ``int``.

    Raises:
        ConfigError: naming ``field_name`` when the value is negative, above :data:`MAX_BYTES`,
            fractional in bytes, of the wrong type, or has an unknown unit.
    """
    if isinstance(value, bool):
        raise ConfigError(f"{field_name}: expected a byte count, got bool {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ConfigError(f"{field_name}: must be >= 0 bytes, got {value}")
        return _at_most_max(value, field_name)
    if isinstance(value, str):
        m = _BYTES_RE.match(value)
        neg = _BYTES_RE.match(value.strip()[1:]) if m is None and value.strip().startswith("-") else None
        if neg is not None and neg.group(2).lower() in _UNITS and Fraction(neg.group(1)) > 0:
            raise ConfigError(f"{field_name}: must be >= 0 bytes, got {value!r}")
        if m is None or m.group(2).lower() not in _UNITS:
            raise ConfigError(
                f"{field_name}: cannot read {value!r} as bytes; use an int or e.g. '512MiB', '4GiB', '2GB'"
            )
        unit = m.group(2)
        if len(unit) > 1 and unit.endswith("b") and unit != unit.lower():  # "10Mb": megabits, by convention
            raise ConfigError(
                f"{field_name}: {value!r} reads as bits (lower-case b after an upper-case prefix); "
                f"write bytes, e.g. '{m.group(1)}{unit[0].upper()}iB' or '{m.group(1)}{unit[0].upper()}B'"
            )
        number = Fraction(m.group(1)) * _UNITS[unit.lower()]  # exact: float loses bytes past 2**53
        if number.denominator != 1:
            raise ConfigError(f"{field_name}: {value!r} is not a whole number of bytes")
        return _at_most_max(int(number), field_name)
    raise ConfigError(f"{field_name}: expected int or str byte count, got {type(value).__name__}")


def _at_most_max(n: int, field_name: str) -> int:
    if n > MAX_BYTES:
        raise ConfigError(f"{field_name}: {n} bytes is more than any machine has; at most {MAX_BYTES} (2**63 - 1)")
    return n


def format_bytes(n: int | float) -> str:
    """Render a byte count with IEC units, e.g. ``33423360 -> '31.9 MiB'``."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


class Problems:
    """Runs the independent checks of a config and collects their errors, so that every bad field
    is reported at once. ``with problems.check(field): ...`` records a :class:`ConfigError` raised
    in the block under ``field`` (only the first one per field: a value that failed to parse is not
    reported again by the type check after it)."""

    def __init__(self) -> None:
        self.messages: list[str] = []
        self.failed: set[str] = set()

    @contextlib.contextmanager
    def check(self, name: str) -> Iterator[None]:
        try:
            yield
        except ConfigError as exc:
            if name not in self.failed:
                self.failed.add(name)
                self.messages.extend(exc.problems)

    def ok(self, *names: str) -> bool:
        """True when none of ``names`` failed (cross-field checks run only on good values)."""
        return not self.failed.intersection(names)

    def raise_if_any(self) -> None:
        if self.messages:
            raise ConfigError(problems=self.messages)


def check_int(name: str, value: Any, *, minimum: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name}: expected int, got {type(value).__name__} {value!r}")
    if minimum is not None and value < minimum:
        raise ConfigError(f"{name}: must be >= {minimum}, got {value}")


def check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ConfigError(f"{name}: expected true/false, got {type(value).__name__} {value!r}")


def coerce_bytes(obj: Any, section: str, problems: Problems) -> None:
    """Let ``*_bytes`` fields of a frozen config take strings such as ``"4GiB"`` too; refuse any
    above :data:`MAX_BYTES` (a torch or OS call would overflow on it later)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if f.name.endswith("_bytes") and (isinstance(value, str) or isinstance(value, int) and value > MAX_BYTES):
            with problems.check(f"{section}.{f.name}"):
                object.__setattr__(obj, f.name, parse_bytes(value, field_name=f"{section}.{f.name}"))


def check_seconds(name: str, value: Any, *, positive: bool = False) -> None:
    """A finite number of seconds, >= 0 (``positive``: > 0)."""
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < float("inf")
            or (positive and value == 0)):
        raise ConfigError(f"{name}: expected a finite number of seconds {'>' if positive else '>='} 0, got {value!r}")


def check_policy(name: str, value: Any) -> None:
    from .policy import POLICY_NAMES  # pure Python, imports nothing of ours

    if value not in POLICY_NAMES:
        raise ConfigError(f"{name}: expected one of {', '.join(POLICY_NAMES)}, got {value!r}")


def check_text(name: str, value: Any, what: str) -> None:
    """A non-empty string that can reach the operating system: no NUL byte (every path and name
    of the C library ends at one; Python raises a bare ValueError), encodable to bytes."""
    if not isinstance(value, str) or not value:
        raise ConfigError(f"{name}: expected {what}, got {value!r}")
    if "\0" in value:
        raise ConfigError(f"{name}: contains a NUL byte (\\0), which no path or name may hold: {value!r}")
    try:
        os.fsencode(value)
    except UnicodeEncodeError:
        raise ConfigError(f"{name}: cannot be encoded for the file system: {value!r}") from None


def fspath(obj: Any, name: str) -> None:
    """Turn an ``os.PathLike`` value of field ``name`` into its ``str``, and a leading ``~`` or
    ``~user`` into that home directory (as a shell would; it was a directory named ``~``)."""
    value = getattr(obj, name)
    if isinstance(value, os.PathLike):
        value = os.fspath(value)
        object.__setattr__(obj, name, value)
    if isinstance(value, str) and value.startswith("~"):
        object.__setattr__(obj, name, os.path.expanduser(value))


def check_namespace(value: Any) -> None:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"namespace: expected a non-empty string, got {value!r}")
    if len(value.encode("utf-8", "surrogatepass")) > 4096:
        raise ConfigError("namespace: longer than 4096 bytes of UTF-8")


CUDA_DEVICE_RE = re.compile(r"^cuda:(0|[1-9][0-9]{0,3})$")

#: Values of ``nvme.on_damaged``.
ON_DAMAGED = ("fail", "reset")


def check_host(cfg: HostTierConfig) -> None:
    """The checks of :class:`~ectier.config.HostTierConfig` (``*_bytes`` strings are parsed in place).

    Raises:
        ConfigError: every bad ``host.*`` field at once.
    """
    p = Problems()
    coerce_bytes(cfg, "host", p)
    with p.check("host.capacity_bytes"):
        check_int("host.capacity_bytes", cfg.capacity_bytes, minimum=0)
    with p.check("host.block_bytes"):
        check_int("host.block_bytes", cfg.block_bytes, minimum=4 * KiB)
        if cfg.block_bytes & (cfg.block_bytes - 1) or cfg.block_bytes > 64 * MiB:
            raise ConfigError(
                f"host.block_bytes: must be a power of two between 4 KiB and 64 MiB, got {cfg.block_bytes}"
            )
    if p.ok("host.capacity_bytes", "host.block_bytes") and 0 < cfg.capacity_bytes < cfg.block_bytes:
        with p.check("host.capacity_bytes"):
            raise ConfigError(
                f"host.capacity_bytes: {cfg.capacity_bytes} is less than one block "
                f"(host.block_bytes={cfg.block_bytes}); use 0 to disable the host tier"
            )
    if cfg.pin_memory is not None:
        with p.check("host.pin_memory"):
            check_bool("host.pin_memory", cfg.pin_memory)
    with p.check("host.admit_wait_s"):
        check_seconds("host.admit_wait_s", cfg.admit_wait_s)
    with p.check("host.promote_clean_only"):
        check_bool("host.promote_clean_only", cfg.promote_clean_only)
    with p.check("host.write_behind_fraction"):
        v = cfg.write_behind_fraction
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
            raise ConfigError(f"host.write_behind_fraction: expected a number between 0 and 1 (a share of "
                              f"host.capacity_bytes; 0 disables the write-behind), got {v!r}")
    with p.check("host.policy"):
        check_policy("host.policy", cfg.policy)
    p.raise_if_any()


def check_gpu(cfg: GpuTierConfig) -> None:
    """The checks of :class:`~ectier.config.GpuTierConfig` (``*_bytes`` strings are parsed in place).

    Raises:
        ConfigError: every bad ``gpu.*`` field at once.
    """
    p = Problems()
    coerce_bytes(cfg, "gpu", p)
    if not isinstance(cfg.device, str) or not CUDA_DEVICE_RE.match(cfg.device):
        with p.check("gpu.device"):
            raise ConfigError(
                f"gpu.device: expected an explicit 'cuda:<index>' (the worker's device), got {cfg.device!r}"
            )
    with p.check("gpu.capacity_bytes"):
        check_int("gpu.capacity_bytes", cfg.capacity_bytes, minimum=0)
    with p.check("gpu.block_bytes"):
        check_int("gpu.block_bytes", cfg.block_bytes, minimum=64 * KiB)
        if cfg.block_bytes & (cfg.block_bytes - 1) or cfg.block_bytes > 64 * MiB:
            raise ConfigError(
                f"gpu.block_bytes: must be a power of two between 64 KiB and 64 MiB, got {cfg.block_bytes}"
            )
    if p.ok("gpu.capacity_bytes", "gpu.block_bytes") and 0 < cfg.capacity_bytes < cfg.block_bytes:
        with p.check("gpu.capacity_bytes"):
            raise ConfigError(
                f"gpu.capacity_bytes: {cfg.capacity_bytes} is less than one block "
                f"(gpu.block_bytes={cfg.block_bytes}); use 0 to disable the GPU tier"
            )
    with p.check("gpu.policy"):
        check_policy("gpu.policy", cfg.policy)
    with p.check("gpu.copy_streams"):
        check_int("gpu.copy_streams", cfg.copy_streams, minimum=1)
        if cfg.copy_streams > 8:
            raise ConfigError(f"gpu.copy_streams: must be <= 8, got {cfg.copy_streams}")
    p.raise_if_any()


def check_nvme(cfg: NvmeTierConfig) -> None:
    """The checks of :class:`~ectier.config.NvmeTierConfig` (``*_bytes`` strings are parsed and a
    path-like ``path`` made a ``str``, in place).

    Raises:
        ConfigError: every bad ``nvme.*`` field at once.
    """
    p = Problems()
    coerce_bytes(cfg, "nvme", p)
    if cfg.path is not None:
        fspath(cfg, "path")
        with p.check("nvme.path"):
            check_text("nvme.path", cfg.path, "a directory path or null")
    with p.check("nvme.capacity_bytes"):
        check_int("nvme.capacity_bytes", cfg.capacity_bytes, minimum=0)
    with p.check("nvme.codec"):
        if not isinstance(cfg.codec, str):
            raise ConfigError(f"nvme.codec: expected a codec name, got {cfg.codec!r}")
        from . import codec as _codec  # pure Python, imports nothing of ours but errors

        known = sorted(_codec.registered_codecs())
        if cfg.codec not in known:
            raise ConfigError(f"nvme.codec: unknown codec {cfg.codec!r}; known: {', '.join(known)}")
    with p.check("nvme.group_commit_s"):
        check_seconds("nvme.group_commit_s", cfg.group_commit_s)
    with p.check("nvme.read_threads"):
        check_int("nvme.read_threads", cfg.read_threads, minimum=1)
        if cfg.read_threads > 2:
            raise ConfigError(f"nvme.read_threads: 1 or 2 (a helper thread reads beside the caller), got {cfg.read_threads}")
    with p.check("nvme.zstd_level"):
        check_int("nvme.zstd_level", cfg.zstd_level)
        if not -7 <= cfg.zstd_level <= 22:
            raise ConfigError(f"nvme.zstd_level: must be in -7..22, got {cfg.zstd_level}")
    for name in ("sync", "write_through", "flush_on_close", "allow_network_fs", "thin_provisioning"):
        with p.check(f"nvme.{name}"):
            check_bool(f"nvme.{name}", getattr(cfg, name))
    with p.check("nvme.on_damaged"):
        if cfg.on_damaged not in ON_DAMAGED:
            raise ConfigError(f"nvme.on_damaged: expected one of {', '.join(ON_DAMAGED)}, got {cfg.on_damaged!r}")
    with p.check("nvme.policy"):
        check_policy("nvme.policy", cfg.policy)
    with p.check("nvme.map_initial_bytes"):
        check_int("nvme.map_initial_bytes", cfg.map_initial_bytes, minimum=1 * MiB)
    if cfg.map_max_bytes is not None:
        with p.check("nvme.map_max_bytes"):
            check_int("nvme.map_max_bytes", cfg.map_max_bytes, minimum=1 * MiB)
            if p.ok("nvme.map_initial_bytes") and cfg.map_max_bytes < cfg.map_initial_bytes:
                raise ConfigError(
                    f"nvme.map_max_bytes: {cfg.map_max_bytes} is below nvme.map_initial_bytes "
                    f"{cfg.map_initial_bytes}"
                )
    p.raise_if_any()


def check_daemon(cfg: DaemonConfig) -> None:
    """The checks of :class:`~ectier.config.DaemonConfig` (path-like paths made ``str``, an int
    ``socket_mode`` made its octal string, ``*_bytes`` strings parsed, in place).

    Raises:
        ConfigError: every bad ``daemon.*`` field at once.
    """
    p = Problems()
    if cfg.socket_path is not None:
        fspath(cfg, "socket_path")
        with p.check("daemon.socket_path"):
            check_text("daemon.socket_path", cfg.socket_path, "a path or null")
            if len(os.fsencode(cfg.socket_path)) > 107:
                raise ConfigError("daemon.socket_path: longer than the 107 bytes a Unix socket path may have")
    with p.check("daemon.socket_mode"):
        check_socket_mode(cfg)
    if cfg.allowed_group is not None:
        with p.check("daemon.allowed_group"):
            check_text("daemon.allowed_group", cfg.allowed_group, "a group name or null")
    fspath(cfg, "shm_dir")
    with p.check("daemon.shm_dir"):
        check_text("daemon.shm_dir", cfg.shm_dir, "a directory path")
    coerce_bytes(cfg, "daemon", p)
    with p.check("daemon.lease_s"):
        check_seconds("daemon.lease_s", cfg.lease_s, positive=True)
    with p.check("daemon.max_frame_bytes"):
        check_int("daemon.max_frame_bytes", cfg.max_frame_bytes, minimum=4 * KiB)
    with p.check("daemon.max_clients"):
        check_int("daemon.max_clients", cfg.max_clients, minimum=1)
    if cfg.max_clients_per_uid is not None:
        with p.check("daemon.max_clients_per_uid"):
            check_int("daemon.max_clients_per_uid", cfg.max_clients_per_uid, minimum=1)
            if cfg.max_clients_per_uid > cfg.max_clients:
                raise ConfigError(f"daemon.max_clients_per_uid: must be <= daemon.max_clients "
                                  f"({cfg.max_clients}), got {cfg.max_clients_per_uid}")
    with p.check("daemon.idle_timeout_s"):
        check_seconds("daemon.idle_timeout_s", cfg.idle_timeout_s)
    if cfg.metrics_port is not None:
        with p.check("daemon.metrics_port"):
            check_int("daemon.metrics_port", cfg.metrics_port, minimum=0)
            if cfg.metrics_port > 65535:
                raise ConfigError(f"daemon.metrics_port: must be <= 65535, got {cfg.metrics_port}")
    with p.check("daemon.metrics_host"):
        check_text("daemon.metrics_host", cfg.metrics_host, "an address")
    for name in ("view_pin_bytes", "view_pin_total_bytes"):
        if getattr(cfg, name) is not None:
            with p.check(f"daemon.{name}"):
                check_int(f"daemon.{name}", getattr(cfg, name), minimum=0)
    p.raise_if_any()


REMOTE_BACKENDS = ("none", "redis", "mooncake")


def check_across(cfg: Any) -> None:
    """The checks of a :class:`~ectier.config.CacheConfig` across its sections: the daemon's
    view-pin bounds against the host arena (:func:`view_pin_bounds`), and some tier able to store.

    Raises:
        ConfigError: naming the fields at fault.
    """
    view_pin_bounds(cfg)
    if cfg.gpu.enabled:
        return  # a GPU-only cache is valid (victims are then dropped)
    if cfg.host.capacity_bytes == 0 and not cfg.nvme.enabled:
        raise ConfigError("host.capacity_bytes: is 0 and nvme.path is not set, so no tier could store anything")
    if cfg.host.capacity_bytes == 0 and cfg.nvme.capacity_bytes == 0:
        raise ConfigError("host.capacity_bytes and nvme.capacity_bytes: both 0, so no tier could store anything")


def view_pin_bounds(config: Any) -> tuple[int, int]:
    """``(daemon.view_pin_bytes, daemon.view_pin_total_bytes)`` resolved against the arena
    (``host.capacity_bytes``): the per-process default is half the arena, the total's default
    half the arena or the per-process bound when that is larger.

    Raises:
        ConfigError: a bound larger than ``host.capacity_bytes``, or a total below the
        per-process bound (naming the field). ``CacheConfig`` runs it when it is built; the daemon
        sizes its bounds with it.
    """
    arena, d = config.host.capacity_bytes, config.daemon
    per = arena // 2 if d.view_pin_bytes is None else d.view_pin_bytes
    total = max(per, arena // 2) if d.view_pin_total_bytes is None else d.view_pin_total_bytes
    for name, value in (("view_pin_bytes", d.view_pin_bytes), ("view_pin_total_bytes", d.view_pin_total_bytes)):
        if value is not None and value > arena:
            raise ConfigError(f"daemon.{name}: {value} bytes is larger than the host arena (host.capacity_bytes="
                              f"{arena}); views can pin at most the whole arena, lower it (or leave it unset)")
    if total < per:
        raise ConfigError(f"daemon.view_pin_total_bytes: {total} bytes is below daemon.view_pin_bytes={per} "
                          "(the bound of one process); raise it or lower daemon.view_pin_bytes")
    return per, total
