"""The checks of :class:`~ectier.config.RemoteTierConfig` (``remote.*``): its addresses, TLS files
and the Mooncake fields, on top of the value checks of :mod:`ectier.config_checks`."""

from __future__ import annotations

import os
import re
from typing import Any

from .config_checks import (REMOTE_BACKENDS, Problems, check_bool, check_int, check_seconds, check_text,
                            coerce_bytes, fspath)
from .errors import ConfigError

__all__ = ["check_remote", "check_address", "check_remote_mooncake"]


def check_remote(cfg: Any) -> None:
    """The checks of :class:`~ectier.config.RemoteTierConfig` (``*_bytes`` strings parsed, in place).

    Raises:
        ConfigError: every bad ``remote.*`` field at once.
    """
    p = Problems()
    with p.check("remote.backend"):
        if cfg.backend not in REMOTE_BACKENDS:
            raise ConfigError(f"remote.backend: expected one of {', '.join(REMOTE_BACKENDS)}, got {cfg.backend!r}")
    with p.check("remote.addresses"):
        if cfg.addresses:
            check_text("remote.addresses", cfg.addresses, "'host:port[,host:port...]'")
            if not isinstance(cfg.addresses, str):
                raise ConfigError(f"remote.addresses: expected 'host:port[,host:port...]', got {cfg.addresses!r}")
        if cfg.backend != "none" and cfg.backend in REMOTE_BACKENDS and not cfg.addresses.strip(" ,"):
            raise ConfigError("remote.addresses: required with remote.backend "
                              f"{cfg.backend!r}: 'host:port[,host:port...]' of the store's nodes")
        for item in filter(None, (a.strip() for a in cfg.addresses.split(","))):
            check_address(item)
    with p.check("remote.prefix"):
        check_text("remote.prefix", cfg.prefix, "a key prefix")
    for name in ("timeout_s", "backoff_s"):
        with p.check(f"remote.{name}"):
            v = getattr(cfg, name)
            check_seconds(f"remote.{name}", v, positive=name == "timeout_s")
    for name in ("write_through", "tls"):
        with p.check(f"remote.{name}"):
            check_bool(f"remote.{name}", getattr(cfg, name))
    coerce_bytes(cfg, "remote", p)
    with p.check("remote.max_entry_bytes"):
        check_int("remote.max_entry_bytes", cfg.max_entry_bytes, minimum=1)
    with p.check("remote.chunk_bytes"):
        check_int("remote.chunk_bytes", cfg.chunk_bytes, minimum=64 * 1024)
        if cfg.chunk_bytes > 512 * 1024 * 1024:
            raise ConfigError(f"remote.chunk_bytes: at most 512 MiB (a Redis value's cap), got {cfg.chunk_bytes}")
    fspath(cfg, "tls_ca_path")  # (a Path, or a leading ~)
    for name in ("username", "password", "tls_ca_path"):
        if getattr(cfg, name) is not None:
            with p.check(f"remote.{name}"):
                check_text(f"remote.{name}", getattr(cfg, name), "a string or null")
    if isinstance(cfg.tls_ca_path, str) and cfg.tls_ca_path:
        with p.check("remote.tls_ca_path"):
            if cfg.tls is not True:
                raise ConfigError("remote.tls_ca_path: only used with remote.tls: true (set it, or drop the CA)")
            if not os.path.isfile(cfg.tls_ca_path):
                raise ConfigError(f"remote.tls_ca_path: no file at {cfg.tls_ca_path!r}")
    check_remote_mooncake(cfg, p)
    p.raise_if_any()


def check_address(item: str) -> None:
    """One entry of ``remote.addresses``: ``host:port`` (an IPv6 host in brackets).

    Raises:
        ConfigError: naming ``remote.addresses`` and what is wrong with ``item``.
    """
    words = item.split()
    if len(words) > 1:
        raise ConfigError(f"remote.addresses: {item!r}: " + (
            "separate addresses with commas" if all(":" in w for w in words) else "no spaces inside an address"))
    if "/" in item:
        raise ConfigError(f"remote.addresses: {item!r}: 'host:port' without a scheme or path "
                          "(TLS is remote.tls: true)")
    if item.startswith("["):
        m = re.fullmatch(r"\[([0-9A-Fa-f:.]+)\]:(\d+)", item)
        if m is None:
            raise ConfigError(f"remote.addresses: {item!r}: an IPv6 address is '[address]:port', e.g. '[::1]:6379'")
        host, port = m.groups()
    else:
        host, _, port = item.rpartition(":")
        if ":" in host:
            raise ConfigError(f"remote.addresses: {item!r}: an IPv6 host goes in brackets, e.g. '[::1]:6379'")
    if not host or not port.isascii() or not port.isdigit():
        raise ConfigError(f"remote.addresses: {item!r}: expected 'host:port' (a host, a colon, a port number)")
    if not 0 < int(port) < 65536:
        raise ConfigError(f"remote.addresses: {item!r}: port {int(port)} is outside 1..65535")


def check_remote_mooncake(cfg: Any, p: Problems) -> None:
    """The ``remote.mooncake_*`` checks (into ``p``)."""
    with p.check("remote.addresses"):
        if cfg.backend == "mooncake" and len([a for a in cfg.addresses.split(",") if a.strip()]) > 1:
            raise ConfigError(f"remote.addresses: one master address with remote.backend 'mooncake', "
                              f"got {cfg.addresses!r}")
    for name in ("mooncake_metadata_server", "mooncake_local_hostname", "mooncake_device_name"):
        with p.check(f"remote.{name}"):
            value = getattr(cfg, name)
            if not isinstance(value, str) or "\0" in value or any(c.isspace() for c in value.strip(" ")):
                raise ConfigError(f"remote.{name}: expected a string without whitespace or NUL, got {value!r}")
    with p.check("remote.mooncake_metadata_server"):
        ms = cfg.mooncake_metadata_server
        if isinstance(ms, str) and ms and not ms.startswith(("http://", "https://", "etcd://", "redis://")) \
                and ms != "P2PHANDSHAKE":
            raise ConfigError("remote.mooncake_metadata_server: expected 'http://host:port/metadata', "
                              f"'etcd://host:port' or '' (the master's), got {ms!r}")
    with p.check("remote.mooncake_protocol"):
        if cfg.mooncake_protocol not in ("tcp", "rdma"):
            raise ConfigError(f"remote.mooncake_protocol: expected 'tcp' or 'rdma', got {cfg.mooncake_protocol!r}")
    with p.check("remote.mooncake_global_segment_bytes"):
        check_int("remote.mooncake_global_segment_bytes", cfg.mooncake_global_segment_bytes, minimum=0)
    with p.check("remote.mooncake_local_buffer_bytes"):
        check_int("remote.mooncake_local_buffer_bytes", cfg.mooncake_local_buffer_bytes, minimum=0)
    with p.check("remote.mooncake_buffer_pool_bytes"):
        check_int("remote.mooncake_buffer_pool_bytes", cfg.mooncake_buffer_pool_bytes, minimum=0)
