"""The remote tier: encoder outputs shared by every engine on every node, on a distributed store
the deployment already runs (Redis / Valkey Cluster; Mooncake Store). See docs/operations.md."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ...config import RemoteTierConfig
    from .backend import RemoteBackend


def open_backend(config: "RemoteTierConfig") -> "RemoteBackend":
    """The client of ``config.backend`` (imported only when configured).

    Raises:
        ConfigError: naming ``remote.backend`` when its client library is not installed.
    """
    from ...errors import ConfigError

    if config.backend == "redis":
        try:
            from .redis import RedisBackend
        except ImportError as exc:
            raise ConfigError(f"remote.backend: 'redis' needs the redis package (pip install 'ectier[remote]'): "
                              f"{exc}") from None
        return RedisBackend(config)
    if config.backend == "mooncake":
        from .mooncake import MooncakeBackend  # says how to install the client when it is missing
        return MooncakeBackend(config)
    raise ConfigError(f"remote.backend: {config.backend!r} has no client here")
