"""Files of the daemon outside its cache: the socket path, stale host-arena and scratch files."""

from __future__ import annotations

import fcntl
import logging
import os
import re
import socket
import stat

from ..errors import EctierError

__all__ = ["claim_socket_path", "reclaim_stale_arenas", "remove_created_dirs"]

log = logging.getLogger("ectier.daemon")


def reclaim_stale_arenas(shm_dir: str) -> None:
    """Remove arena files of this user's daemons in ``shm_dir`` that died without cleaning up
    (``ectier-<uid>-<pid>.arena`` whose process is gone, or is this very process, and that no live
    daemon holds flock'ed), and their scratch files (``ectier-<uid>-<pid>.scratch-<n>``, see
    :mod:`ectier.daemon.scratch`). Errors are logged, never raised."""
    pattern = re.compile(rf"ectier-{os.getuid()}-(\d+)\.(?:arena|scratch-\d+)")
    for name in os.listdir(shm_dir):
        m = pattern.fullmatch(name)
        if m is None:
            continue
        path = os.path.join(shm_dir, name)
        pid = int(m.group(1))
        if pid != os.getpid():
            try:
                os.kill(pid, 0)
                continue  # that process lives (possibly a daemon without the arena lock)
            except ProcessLookupError:
                pass
            except PermissionError:
                continue
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            if os.fstat(fd).st_uid != os.getuid():
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live daemon holds it
            os.unlink(path)
            log.warning("removed the %s %s of a daemon that did not shut down cleanly",
                        "arena" if name.endswith(".arena") else "scratch file", path)
        except OSError as exc:
            log.warning("could not remove the stale arena %s: %s", path, exc)
        finally:
            os.close(fd)

def claim_socket_path(path: str) -> list[str]:
    """Make ``path`` free for a new listening socket: create its directory, or remove a stale
    socket of a dead daemon. Returns the directories it created, deepest last (a start that fails
    later removes them again with :func:`remove_created_dirs`).

    Raises:
        EctierError: (naming ``daemon.socket_path``) a daemon listens there, the path is not a
            socket, or its directory cannot be created.
    """
    try:
        st = os.lstat(path)
    except OSError:
        created = []
        parent = os.path.abspath(os.path.dirname(path) or ".")
        while not os.path.lexists(parent):
            created.insert(0, parent)
            parent = os.path.dirname(parent)
        try:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        except OSError as exc:
            remove_created_dirs(created)
            reason = exc.strerror
            if isinstance(exc, (FileExistsError, NotADirectoryError)):  # a file where a directory goes
                reason = f"{parent!r} is not a directory"
            raise EctierError(f"daemon.socket_path: cannot create the directory of {path!r}: "
                              f"{reason}") from None
        return created
    if not stat.S_ISSOCK(st.st_mode):  # never delete a file that is not a (stale) socket
        raise EctierError(f"daemon.socket_path: {path!r} exists and is not a socket; remove it or "
                          "choose another path")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except OSError:
        os.unlink(path)  # stale socket of a dead daemon
        return []
    finally:
        probe.close()
    raise EctierError(f"daemon.socket_path: a daemon is already listening on {path!r}")


def remove_created_dirs(created: list[str]) -> None:
    """Remove the directories :func:`claim_socket_path` created, deepest first, where still empty
    (a failed start leaves nothing behind; a directory something else wrote into is kept)."""
    for path in reversed(created):
        try:
            os.rmdir(path)
        except OSError:
            return
