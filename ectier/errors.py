"""Errors raised by ectier.

Every error ectier raises on purpose derives from :class:`EctierError`, so a caller (the vLLM
connector, the daemon) can catch the whole family in one place. Errors that are also a kind of
standard error (a bad argument is a ``ValueError``, a wrong type a ``TypeError``) derive from that
standard class as well, so ordinary ``except ValueError`` code keeps working.

::

    EctierError
    ├── ConfigError(ValueError)          a config field is missing, unknown or out of range
    ├── InvalidKeyError(ValueError)      a key or namespace is empty, not a str, or too long
    ├── InvalidTensorError(TypeError)    put() got something that is not a storable tensor
    ├── InvalidDeviceError(ValueError)   a device string that does not exist on this machine
    ├── EntryTooLargeError(ValueError)   an entry larger than every tier's whole budget
    ├── InvalidArgumentError(ValueError) another argument out of range or in the wrong state
    │   │                                (a negative ``cost_s``, a lease already ended)
    │   └── InvalidLeaseError(TypeError) a lease argument that is not a lease of the right kind and cache
    ├── StoreLockedError                 the NVMe directory is held by another process or cache
    ├── StoreOpenError                   the NVMe directory cannot be created, opened or read
    │   └── StoreDamagedError            its LMDB environment is damaged (``ectier fsck``)
    ├── TierWriteError                   a tier could not store an entry (disk full, map full)
    ├── CorruptRecordError               a stored record failed its checks (read as a miss)
    └── UnknownCodecError(ValueError)    a codec name or id that is not registered

Messages name the argument or config field at fault (``host.capacity_bytes``, ``nvme.path``) and,
where there is one, the knob that fixes it.
"""

from __future__ import annotations

from typing import Sequence

__all__ = [
    "EctierError",
    "ConfigError",
    "InvalidKeyError",
    "InvalidTensorError",
    "InvalidDeviceError",
    "EntryTooLargeError",
    "InvalidArgumentError",
    "InvalidLeaseError",
    "LeaseExpiredError",
    "CacheClosedError",
    "StoreLockedError",
    "StoreOpenError",
    "StoreDamagedError",
    "TierWriteError",
    "CorruptRecordError",
    "UnknownCodecError",
    "ProcessForkedError",
]


class EctierError(Exception):
    """Root of every error ectier raises on purpose."""


class ConfigError(EctierError, ValueError):
    """A configuration value is invalid. The message names the field, e.g. ``nvme.capacity_bytes``.

    A config with several bad fields is reported at once: :attr:`problems` holds one message per
    bad field (each starting with its dotted name), first found first, and the error's message is
    them one a line. :attr:`env_vars` names the environment variables (``ECTIER_*``) that the bad
    values came from when :meth:`~ectier.config.CacheConfig.from_env` built the config (empty
    otherwise), so a command line can say which input to fix.
    """

    def __init__(self, message: str = "", *, problems: Sequence[str] = (), env_vars: Sequence[str] = ()) -> None:
        problems = tuple(problems) or (message,)
        super().__init__(message or "\n".join(problems))
        #: one message per bad field, in the order found
        self.problems: tuple[str, ...] = problems
        #: the ``ECTIER_*`` variables the bad values came from (``CacheConfig.from_env``), else ``()``
        self.env_vars: tuple[str, ...] = tuple(env_vars)


class InvalidKeyError(EctierError, ValueError):
    """A key (``mm_hash``) or namespace is not a non-empty ``str`` within the length limit."""


class InvalidTensorError(EctierError, TypeError):
    """``put`` was given a value that is not a storable ``torch.Tensor``."""


class InvalidDeviceError(EctierError, ValueError):
    """A device string names a device that is malformed or absent on this machine."""


class EntryTooLargeError(EctierError, ValueError):
    """An entry is larger than the whole byte budget of every tier that could hold it."""

    @classmethod
    def for_put(cls, nbytes: int, budgets: Sequence[tuple[str, int]]) -> "EntryTooLargeError":
        """The error of a put of ``nbytes`` bytes that no tier takes; ``budgets``: ``(tier name,
        capacity_bytes)`` of each tier the put could place it in (the local tiers from its entry
        tier down: the remote tier is written through from them, never put into)."""
        listed = ", ".join(f"{name}.capacity_bytes={capacity}" for name, capacity in budgets)
        return cls(f"entry of {nbytes} bytes is larger than the whole budget of every tier a put can place it "
                   f"in ({listed}); raise one of them")


class InvalidArgumentError(EctierError, ValueError):
    """An argument that no more specific class covers is out of range or in the wrong state: a
    negative or non-finite ``cost_s``, a lease committed, aborted or released already. The message
    names the argument."""


class InvalidLeaseError(InvalidArgumentError, TypeError):
    """A lease argument is not a lease of the kind the call takes: ``commit``/``abort`` take the
    :class:`~ectier.handles.WriteLease` of a ``reserve``, ``release``/``load`` the
    :class:`~ectier.handles.ReadLease` of an ``acquire``, each of the same cache (another
    cache's lease is refused too, and neither cache changes). An :class:`InvalidArgumentError`
    (so a ``ValueError``) and a ``TypeError`` too, as such a wrong type was before. The message
    names the argument and the type given."""


class CacheClosedError(EctierError):
    """The cache was closed (``close()``, or the end of its ``with`` block): a call made after it,
    or a move (demotion, promotion) still under way in another thread, fails with this. An
    :class:`EctierError`, as before."""


class LeaseExpiredError(EctierError):
    """The daemon answered ``commit`` for a lease it no longer holds: it passed ``daemon.lease_s``
    (or its connection closed) before the commit arrived, so the put was not stored. Retry the put
    (``DaemonClient.put`` does, once, giving the old reservation back)."""


class StoreLockedError(EctierError):
    """The NVMe tier's directory is locked by another process (another cache or the daemon), or
    by another :class:`~ectier.TieredCache` of this process."""


class StoreOpenError(EctierError):
    """The NVMe tier's directory is missing, not a directory, not writable, or not an ectier store."""


class StoreDamagedError(StoreOpenError):
    """The NVMe tier's LMDB environment is damaged: LMDB refuses it (meta or B-tree pages
    destroyed) or ``data.mdb`` is truncated. ``ectier fsck --path DIR --repair`` salvages the intact
    records; ``nvme.on_damaged: reset`` lets the cache start with an empty store instead."""


class TierWriteError(EctierError):
    """A tier failed to store an entry (disk full, LMDB map at its ceiling, I/O error).

    Nothing already stored is changed by the failed write.
    """


class CorruptRecordError(EctierError):
    """A stored record failed a check (magic, format version, header, checksum, length).

    Raised inside the NVMe tier; the cache turns it into a miss and quarantines the record.
    """


class UnknownCodecError(EctierError, ValueError):
    """A codec name or numeric id that is not in :mod:`ectier.codec`'s registry."""


class ProcessForkedError(EctierError):
    """A cache opened before ``fork()`` was used in the child: open a new cache in the child
    (an LMDB environment, a host arena and a lock do not survive a fork)."""
