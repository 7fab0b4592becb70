"""A daemon whose NVMe reads are slow: ``python tests/slow_nvme_daemon.py CONFIG DELAY_S``.

The real :class:`~ectier.daemon.server.DaemonServer` on ``CONFIG``, with every NVMe payload read
(the LMDB read transaction of a get, a promotion, a prefetch) delayed by ``DELAY_S`` seconds
through :func:`ectier.testing.set_lmdb_env`. A test-only stand-in for a slow or busy disk: a
request that waits on NVMe I/O takes at least ``DELAY_S``, one that does not returns at once.
Stops on SIGTERM/SIGINT like ``ectier serve``.
"""

from __future__ import annotations

import logging
import signal
import sys
import time

from ectier import testing
from ectier.config import CacheConfig
from ectier.daemon.server import DaemonServer


class SlowReads:
    """An LMDB environment whose read-only transactions (a payload read's index lookup: the tier
    keeps its index in memory, so these are the reads) start ``delay_s`` late; everything else is
    the environment's own."""

    def __init__(self, env, delay_s: float) -> None:
        self._env = env
        self._delay_s = delay_s

    def begin(self, **kw):
        if not kw.get("write"):
            time.sleep(self._delay_s)
        return self._env.begin(**kw)

    def __getattr__(self, name):
        return getattr(self._env, name)


def main(config_path: str, delay_s: str) -> int:
    logging.basicConfig(level="INFO", format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    server = DaemonServer(CacheConfig.load(config_path))
    signal.signal(signal.SIGTERM, lambda *_: server.stop())
    signal.signal(signal.SIGINT, lambda *_: server.stop())
    server.start()
    testing.set_lmdb_env(server.cache, SlowReads(testing.lmdb_of(server.cache).env, float(delay_s)))
    server.serve_forever()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
