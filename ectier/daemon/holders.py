"""Client processes that hold zero-copy views: what one may pin, and noticing when it dies.

A client reads an entry without copying by asking ``get`` for a *process-held* lease
(``hold: true``): the daemon pins the entry's arena blocks for the client **process** (its pid,
from ``SO_PEERCRED`` at connect), not for the connection. Such a lease has no ``daemon.lease_s``
deadline and survives the connection (a client-side timeout, the daemon's idle close, a
reconnect): the client's tensor view over the shared arena stays valid however long the model
keeps it. It ends when

- the client releases it (``release`` with ``leases``, sent by the client's background
  releaser once the view's storage is freed; any connection of the same process may send it), or
- the client process dies: :class:`Holders` opens a pidfd (``pidfd_open``) for every holding
  process and the lease reaper polls them (every ``min(1 s, daemon.lease_s / 4)``); a readable
  pidfd is an exited process, whose leases are all released. A pidfd names one process, so a
  recycled pid is never mistaken for the holder; an orphaned put is watched only if the pid's
  start time still matches the one read at connect (:func:`process_start`), as the client may
  have exited before the daemon opens the pidfd. Where ``pidfd_open`` is missing (Linux < 5.3)
  the reaper checks ``kill(pid, 0)`` instead.

A process may hold at most ``daemon.view_pin_bytes`` of the arena so (default: half of
``host.capacity_bytes``; each entry counted as the whole ``host.block_bytes`` blocks it occupies,
:func:`~ectier.daemon.leases.arena_footprint`): one that leaks views cannot pin the whole arena
for ever; and all
processes together at most ``daemon.view_pin_total_bytes`` (default: half of the arena, or
``view_pin_bytes`` when that is larger), so two processes at the default cannot fill it between
them. A ``get`` beyond either bound is answered with an ordinary connection lease and ``view_refused`` (the
reason, naming the knob; counted in the stats' ``daemon.views.refused``): the client copies, as
before. A holder whose pid the daemon cannot see (0: another pid namespace) is refused the same way.

The same watch serves *orphaned* put reservations (:mod:`ectier.daemon.leases`): a live client
process's reservation that ended uncommitted keeps its blocks until the process aborts it or the
reaper finds it exited.

Locking: every method expects the server's lock held (the one of the lease book).
"""

from __future__ import annotations

import logging
import os
import select

__all__ = ["Holders", "process_start"]

log = logging.getLogger("ectier.daemon")


class Holders:
    """The processes holding process-held leases (module docstring).

    Args:
        limit_bytes: ``daemon.view_pin_bytes`` resolved: the most arena bytes (whole blocks) one
            process may hold pinned through views; 0 refuses every view.
    """

    def __init__(self, limit_bytes: int, total_limit_bytes: int | None = None) -> None:
        self.limit_bytes = limit_bytes
        self.total_limit_bytes = limit_bytes if total_limit_bytes is None else total_limit_bytes
        self._fds: dict[int, int] = {}  # pid -> pidfd, or -1 (watched with kill(pid, 0))
        self.counters = {"granted": 0, "refused": 0, "released": 0, "released_dead": 0}

    def refusal_locked(self, pid: int, held_bytes: int, after_bytes: int, total_after: int = 0) -> str | None:
        """Why process ``pid``, holding ``held_bytes`` of the arena through views, may not hold
        ``after_bytes`` (with the one asked for), when all processes would then hold
        ``total_after`` (``None``: it may). Starts watching ``pid`` when it may."""
        if self.limit_bytes == 0:
            return "views are off (daemon.view_pin_bytes=0)"
        if after_bytes > self.limit_bytes:
            return (f"process {pid} holds {held_bytes} bytes of the arena through views; {after_bytes - held_bytes} "
                    f"more would pass daemon.view_pin_bytes={self.limit_bytes}")
        if total_after > self.total_limit_bytes:
            return (f"the client processes hold {total_after - (after_bytes - held_bytes)} bytes of the arena "
                    f"through views; {after_bytes - held_bytes} more would pass "
                    f"daemon.view_pin_total_bytes={self.total_limit_bytes}")
        if pid <= 0 or not self._watch(pid):
            return f"the daemon cannot watch client process {pid} (another pid namespace, or gone)"
        return None

    def watch_locked(self, pid: int, start: int | None = None) -> bool:
        """Start watching ``pid`` (a process that keeps arena blocks: views, an orphaned put);
        False when it cannot be watched (gone, or 0: another pid namespace), or when ``start``
        (:func:`process_start` read at connect) shows that ``pid`` now names another process
        (the client exited and its pid was reused before the daemon noticed)."""
        if pid <= 0:
            return False
        new = pid not in self._fds
        if not self._watch(pid):
            return False
        if start is not None and process_start(pid) != start:  # read after the pidfd: it names this one
            if new:
                self.forget_locked(pid)
            return False
        return True

    def _watch(self, pid: int) -> bool:
        if pid in self._fds:
            return True
        try:
            self._fds[pid] = os.pidfd_open(pid)
        except AttributeError:  # Python built without it
            self._fds[pid] = -1
        except OSError as exc:
            if exc.errno == 3:  # ESRCH: already gone
                return False
            self._fds[pid] = -1  # ENOSYS (old kernel), EPERM, ...: fall back to kill(pid, 0)
        return True

    def dead_locked(self) -> list[int]:
        """Watched processes that exited (each reported once, then no longer watched)."""
        readable = _readable([fd for fd in self._fds.values() if fd >= 0])
        dead = []
        for pid, fd in list(self._fds.items()):
            if fd >= 0 and fd in readable or fd < 0 and not _alive(pid):
                dead.append(pid)
                self.forget_locked(pid)
        return dead

    def forget_locked(self, pid: int) -> None:
        """Stop watching ``pid`` (it holds nothing any more, or died)."""
        fd = self._fds.pop(pid, -1)
        if fd >= 0:
            os.close(fd)

    def close_locked(self) -> None:
        for pid in list(self._fds):
            self.forget_locked(pid)

    def watched_pids_locked(self) -> list[int]:
        return list(self._fds)


def _readable(fds: list[int]) -> set[int]:
    """Those of ``fds`` readable now (a pidfd: its process exited). ``poll``, not ``select``:
    a daemon with many clients has descriptors past ``select``'s 1024."""
    if not fds:
        return set()
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    return {fd for fd, _ in poller.poll(0)}


def _stat_fields(pid: int) -> list[bytes] | None:
    """Fields 3.. of ``/proc/PID/stat`` (after ``pid (comm)``; ``comm`` may hold spaces and
    parentheses), or ``None`` when it cannot be read (gone, no procfs)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rindex(b")") + 2:].split()
    except (OSError, ValueError):
        return None


def process_start(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot, field 22 of ``/proc/PID/stat``):
    with the pid, names one process across pid reuse. ``None`` when it cannot be read (gone, no
    procfs, another pid namespace)."""
    fields = _stat_fields(pid)
    try:
        return int(fields[19]) if fields is not None else None
    except (ValueError, IndexError):
        return None


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (the fallback without pidfds): it exists and is not a zombie (an
    exited child its parent has not reaped yet holds its pid, but writes nothing any more)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    fields = _stat_fields(pid)
    return not fields or fields[0] not in (b"Z", b"X")  # (state; unreadable: alive, as kill said)
