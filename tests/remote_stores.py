"""Real remote stores for tests, as the ``remote:`` section of a config that reaches them.

Fixture (import it into a test module: ``from remote_stores import remote_store  # noqa: F401``):

- ``remote_store``: a running store for the session, one per backend in :data:`BACKENDS`
  (parametrized: a test that takes it runs once per backend). Today ``"redis"``: a 3-node Redis
  Cluster on loopback (``tests/redis_cluster.py``). A second backend (Mooncake Store) joins by
  adding its name to :data:`BACKENDS` and a branch to :func:`running_store` that starts its
  servers and returns their :class:`RemoteStore`.

A :class:`RemoteStore` gives :meth:`RemoteStore.section`: the ``remote:`` mapping of a config
(``backend``, ``addresses``, short ``timeout_s`` / ``backoff_s``, and a ``prefix`` of its own per
call unless one is given, so tests sharing one store never see each other's objects).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import os
from typing import Any, Iterator

import pytest

#: the backends every test taking ``remote_store`` runs against
BACKENDS = ("redis",)

_prefixes = itertools.count()


@dataclasses.dataclass
class RemoteStore:
    """A running store: ``backend`` (as ``remote.backend`` names it), ``addresses`` (as
    ``remote.addresses`` takes them) and the backend's own handle on its servers (``servers``)."""

    backend: str
    addresses: str
    servers: Any

    def section(self, **overrides: Any) -> dict[str, Any]:
        """The ``remote:`` section of a config using this store (``overrides`` win)."""
        out: dict[str, Any] = {"backend": self.backend, "addresses": self.addresses, "timeout_s": 2.0,
                               "backoff_s": 0.5, "prefix": f"t{os.getpid()}-{next(_prefixes)}"}
        out.update(overrides)
        return out


@contextlib.contextmanager
def running_store(backend: str) -> Iterator[RemoteStore]:
    """Start the servers of ``backend`` for the block (skipped, or on CI failed, when they cannot
    be had: the backend's own helper decides), then stop them."""
    if backend == "redis":
        from redis_cluster import running_servers

        with running_servers(3) as servers:
            yield RemoteStore("redis", servers.addresses, servers)
        return
    raise ValueError(f"no test servers for remote backend {backend!r}")


@pytest.fixture(scope="session", params=BACKENDS)
def remote_store(request) -> Iterator[RemoteStore]:
    """A running remote store for the session, once per backend of :data:`BACKENDS`."""
    with running_store(request.param) as store:
        yield store
