"""The standalone ectier cache daemon and its client.

- :mod:`ectier.daemon.protocol` — sans-I/O framing and message schemas (msgpack over a Unix socket).
- :mod:`ectier.daemon.server` — ``ectier serve``: owns the host arena (in ``/dev/shm``) and NVMe tier.
- :mod:`ectier.daemon.client` — :class:`DaemonClient` for engines.

Run it with ``ectier serve --config FILE`` or ``python -m ectier.daemon --config FILE``.
"""
