"""The standalone ectier cache daemon and its client.

- :mod:`ectier.daemon.protocol` — sans-I/O framing and message schemas (msgpack over a Unix socket).
- :mod:`ectier.daemon.server` — ``ectier serve``: owns the host arena (in ``/dev/shm``) and NVMe tier.
  Its parts: :mod:`~ectier.daemon.connections` (client connections, admission when full),
  :mod:`~ectier.daemon.handlers` (one function per op), :mod:`~ectier.daemon.leases` (the lease
  records), :mod:`~ectier.daemon.prefetch` (the ``prefetch`` op's promotions),
  :mod:`~ectier.daemon.scratch` (scratch files for entries the arena cannot take),
  :mod:`~ectier.daemon.files` (socket path, stale arenas), :mod:`~ectier.daemon.metrics`.
- :mod:`ectier.daemon.client` — :class:`DaemonClient` for engines.

Run it with ``ectier serve --config FILE`` or ``python -m ectier.daemon --config FILE``.
"""
