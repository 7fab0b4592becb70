"""The directory an NVMe store lives in, seen from outside LMDB: which filesystem holds it, and
moving a damaged LMDB environment aside.

- :func:`mount_of` finds the mount holding a path in ``/proc/self/mountinfo`` text (the longest
  mount point that is a prefix of the resolved path; of equal ones, the last mounted). It is a
  pure function of its ``mountinfo`` argument, which tests pass in.
- :func:`check_local_filesystem` refuses a store on a network or FUSE filesystem (NFS, CIFS/SMB,
  9p, Ceph, GlusterFS, Lustre, GPFS, ``fuse.*``, ...): LMDB relies on POSIX locks and a shared
  memory map that such filesystems do not keep coherent (LMDB's documentation: "do not use LMDB
  databases on remote filesystems"). ``nvme.allow_network_fs: true`` opts out.
- :func:`free_bytes` is what a file may still take on a directory's filesystem (``statvfs``; the
  host tier's shared arena asks it too); :func:`check_space` refuses an ``nvme.capacity_bytes``
  the filesystem cannot hold (``nvme.thin_provisioning: true`` opts out).
- :func:`missing_dirs` lists the directories an open is about to create, and
  :func:`remove_created` takes them away again after an open that was refused (a budget the disk
  cannot hold, a store that cannot be opened): the store's own files first, under its lock, then
  each directory that is then empty — nothing is left behind, and nothing else is removed.
- :func:`move_aside` renames ``<store>/lmdb`` (and ``segment.0``) into ``<store>/damaged-<UTC time>/`` (used by
  ``nvme.on_damaged: reset``; ``ectier fsck --repair`` names its ``damaged-*`` directory with
  :func:`damaged_target` and journals its renames, :mod:`ectier.tiers.repairswap`). The copy stays inside the store
  directory: on the same filesystem (a rename, no copy), and possible when the store directory is
  itself a mount point. :func:`fsync_path` syncs one file or directory, raising on failure.

See docs/operations.md ("The NVMe tier on disk").
"""

from __future__ import annotations

import fcntl
import os
import tempfile
import re
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError

__all__ = ["Mount", "NETWORK_FS_TYPES", "MEMORY_FS_TYPES", "in_memory", "parse_mountinfo", "mount_of",
           "is_network_fs", "check_local_filesystem", "move_aside", "damaged_target", "damaged_copies", "MOUNTINFO_PATH", "free_bytes", "probe_subdir",
           "check_space", "missing_dirs", "remove_created", "STORE_FILES", "take_store_lock", "drop_store_lock", "sync_dirs",
           "fsync_path"]

MOUNTINFO_PATH = "/proc/self/mountinfo"

#: filesystem types that keep their files in memory (the daemon's arena belongs on one)
MEMORY_FS_TYPES = frozenset({"tmpfs", "ramfs", "hugetlbfs"})

#: what an open creates in a new store directory, deepest first (the lock file last)
STORE_FILES = ("lmdb/data.mdb", "lmdb/lock.mdb", "lmdb", "segment.0", "ectier.lock")

#: Filesystem types (``/proc/self/mountinfo``'s type field) on which LMDB's locking is unsafe:
#: network and cluster filesystems, and FUSE (any ``fuse.<name>`` too).
NETWORK_FS_TYPES = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "ncpfs", "9p", "afs", "coda", "davfs",
    "ceph", "glusterfs", "lustre", "gpfs", "beegfs", "orangefs", "pvfs2", "panfs", "wekafs",
    "ocfs2", "gfs2", "virtiofs", "fuse", "fuseblk",
})

_ESCAPE = re.compile(r"\\([0-7]{3})")


@dataclass(frozen=True)
class Mount:
    """One line of mountinfo: ``mount_point`` (absolute), ``fstype`` (e.g. ``"ext4"``,
    ``"fuse.sshfs"``) and ``source`` (e.g. ``"server:/export"``)."""

    mount_point: str
    fstype: str
    source: str


def _unescape(field: str) -> str:
    return _ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field)


def parse_mountinfo(text: str) -> list[Mount]:
    """Parse ``/proc/self/mountinfo`` text (``proc(5)``) into mounts, in file order.

    Lines that do not have the documented shape are skipped (never an error). Octal escapes in
    mount points (``\\040`` for a space) are decoded.
    """
    mounts = []
    for line in text.splitlines():
        fields = line.split(" ")
        try:
            sep = fields.index("-", 6)
        except ValueError:
            continue
        if len(fields) < sep + 3 or not fields[4].startswith("/"):
            continue
        mounts.append(Mount(_unescape(fields[4]), _unescape(fields[sep + 1]), _unescape(fields[sep + 2])))
    return mounts


def _contains(mount_point: str, path: str) -> bool:
    if mount_point == "/":
        return True
    mp = mount_point.rstrip("/")
    return path == mp or path.startswith(mp + "/")


def in_memory(path: str | os.PathLike) -> bool | None:
    """Whether ``path`` is on a filesystem held in memory (:data:`MEMORY_FS_TYPES`); ``None``
    where the mount table cannot tell."""
    mount = mount_of(path)
    return None if mount is None else mount.fstype in MEMORY_FS_TYPES


def mount_of(path: str | os.PathLike, mountinfo: str | None = None) -> Mount | None:
    """The mount that holds ``path`` (resolved: symlinks followed, made absolute; the path itself
    need not exist yet).

    Args:
        path: a file or directory path.
        mountinfo: mountinfo text; ``None`` (default) reads ``/proc/self/mountinfo``.

    Returns:
        The :class:`Mount`, or ``None`` when mountinfo cannot be read (not Linux) or lists no
        mount holding the path.
    """
    if mountinfo is None:
        try:
            with open(MOUNTINFO_PATH, encoding="utf-8", errors="surrogateescape") as f:
                mountinfo = f.read()
        except OSError:
            return None
    resolved = os.path.realpath(os.fspath(path))
    best: Mount | None = None
    for mount in parse_mountinfo(mountinfo):
        if _contains(mount.mount_point, resolved) and (
                best is None or len(mount.mount_point.rstrip("/")) >= len(best.mount_point.rstrip("/"))):
            best = mount
    return best


def is_network_fs(fstype: str) -> bool:
    """True for a network, cluster or FUSE filesystem type (see :data:`NETWORK_FS_TYPES`)."""
    return fstype in NETWORK_FS_TYPES or fstype.startswith("fuse.")


def check_local_filesystem(path: str | os.PathLike, *, allow: bool, mountinfo: str | None = None) -> Mount | None:
    """Refuse a store directory on a network or FUSE filesystem unless ``allow``.

    Args:
        path: the store directory (``nvme.path``).
        allow: ``nvme.allow_network_fs``; when true nothing is refused.
        mountinfo: mountinfo text for tests; ``None`` reads ``/proc/self/mountinfo``.

    Returns:
        The mount holding ``path`` (``None`` if unknown).

    Raises:
        ConfigError: ``path`` is on a network/FUSE filesystem; the message names ``nvme.path``, the
            filesystem type and mount point, and ``nvme.allow_network_fs``.
    """
    mount = mount_of(path, mountinfo)
    if mount is not None and is_network_fs(mount.fstype) and not allow:
        raise ConfigError(
            f"nvme.path: {os.fspath(path)!r} is on a {mount.fstype} filesystem (mounted at "
            f"{mount.mount_point!r} from {mount.source!r}); LMDB's locks and shared memory map are not "
            "safe on network or FUSE filesystems. Put the store on a local disk, or set "
            "nvme.allow_network_fs: true if this filesystem keeps fcntl locks and mmap coherent "
            "(and only one host opens the store)"
        )
    return mount


def probe_subdir(path: str | os.PathLike) -> None:
    """Make a subdirectory in ``path`` and remove it again: an existing directory can pass a path
    or permission check and still take none (``/proc``; root passes every permission check).

    Raises:
        OSError: the subdirectory cannot be made (the caller names its option).
    """
    os.rmdir(tempfile.mkdtemp(prefix="ectier-probe-", dir=path))


def free_bytes(path: str | os.PathLike) -> int | None:
    """Bytes a file of an unprivileged user may still take on the filesystem of ``path``
    (``statvfs``: ``f_bavail * f_frsize``), or ``None`` if unknown (``path`` cannot be asked)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def check_space(path: str | os.PathLike, capacity_bytes: int, held_bytes: int, *, thin: bool) -> None:
    """Refuse an NVMe budget the filesystem under ``path`` cannot hold: ``capacity_bytes`` above
    the free bytes plus ``held_bytes`` (what the store's records already take of the budget).

    Nothing is checked with ``thin`` (``nvme.thin_provisioning``) or when the free space is unknown.

    Raises:
        ConfigError: naming ``nvme.capacity_bytes``, the free bytes and the opt-in.
    """
    free = None if thin else free_bytes(path)
    if free is None or capacity_bytes <= free + held_bytes:
        return
    held = f" + {held_bytes} bytes its records already take" if held_bytes else ""
    raise ConfigError(
        f"nvme.capacity_bytes: {capacity_bytes} bytes ({capacity_bytes / 2**30:.2f} GiB) do not fit the "
        f"filesystem of nvme.path {str(path)!r}: it has {free} bytes ({free / 2**30:.2f} GiB) free{held}; "
        f"lower nvme.capacity_bytes, free space there, or set nvme.thin_provisioning: true to accept a "
        f"budget above the free space (writes past it then fail with disk full)")


def missing_dirs(path: str | os.PathLike) -> list[Path]:
    """``path`` and those of its parents that do not exist yet, deepest first: what a
    ``mkdir(parents=True)`` of it would create (``[]`` for a directory that exists)."""
    out: list[Path] = []
    p = Path(os.path.abspath(os.fspath(path)))
    while not os.path.lexists(p) and p != p.parent:
        out.append(p)
        p = p.parent
    return out


def remove_created(created: list[Path]) -> None:
    """Remove what a refused open created: ``created`` (:func:`missing_dirs` before the open,
    deepest first) once its store is closed. In the deepest, the store's own files
    (:data:`STORE_FILES`) go first, while this holds the store's lock; then each directory that
    is empty. Nothing is removed when another process holds that lock (the directory is its
    store now); anything else found there stays, and its directory with it. Never raises."""
    if not created:
        return
    store = created[0]
    try:
        lock = open(store / "ectier.lock", "a+")
    except OSError:
        lock = None  # no lock file (the open failed before it): nothing of a store there
    try:
        if lock is not None:
            try:
                fcntl.flock(lock.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return  # another process opened it meanwhile: its store now
            for name in STORE_FILES:
                target = store / name
                try:
                    if target.is_dir() and not target.is_symlink():
                        target.rmdir()
                    else:
                        target.unlink()
                except OSError:
                    pass  # absent, or a directory with other files: left as it is
    finally:
        if lock is not None:
            lock.close()
    for d in created:
        try:
            d.rmdir()
        except OSError:
            return  # not empty (or not ours to remove): it and its parents stay


def damaged_copies(store_dir: str | os.PathLike, prefix: str = "damaged-") -> list[Path]:
    """The ``damaged-*`` directories left in ``store_dir`` by :func:`move_aside`, oldest first
    (``prefix=".repair-"``: the staging directories of ``ectier fsck --repair`` runs that were
    killed)."""
    d = Path(store_dir)
    try:
        return sorted(p for p in d.iterdir() if p.name.startswith(prefix) and p.is_dir())
    except OSError:
        return []


def damaged_target(store_dir: str | os.PathLike) -> Path:
    """A ``store_dir/damaged-<YYYYmmddTHHMMSSZ>[-n]`` path that does not exist yet (not created)."""
    d = Path(store_dir)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = d / f"damaged-{stamp}"
    n = 0
    while target.exists():
        n += 1
        target = d / f"damaged-{stamp}-{n}"
    return target


def move_aside(store_dir: str | os.PathLike) -> Path:
    """Rename ``store_dir/lmdb`` to ``store_dir/damaged-<YYYYmmddTHHMMSSZ>[-n]/lmdb`` (and the
    segment file ``store_dir/segment.0`` next to it, when there is one). A store that lost its
    ``lmdb/`` (deleted, or moved by a move aside a kill cut between its two renames) has only its
    segment moved.

    The caller holds the store's directory lock and has closed the LMDB environment.

    Returns:
        The new ``damaged-*`` directory (a store directory of its own: ``ectier fsck --path`` reads it).

    Raises:
        OSError: the rename failed (the environment stays where it was).
    """
    d = Path(store_dir)
    target = damaged_target(d)
    target.mkdir()
    try:
        if (d / "lmdb").exists() or not (d / "segment.0").exists():
            os.rename(d / "lmdb", target / "lmdb")
    except OSError:
        target.rmdir()
        raise
    if (d / "segment.0").exists():  # layout v2: the payloads go with their index
        os.rename(d / "segment.0", target / "segment.0")
    _fsync_dir(d)
    return target


#: the store lock files (``(st_dev, st_ino)``) whose flock this process took, with its pid then
#: (a forked child inherits the parent's entries; the pid tells them apart). No lock: dict calls
#: are atomic, and a lock held by another thread at a fork would stay held in the child.
_HELD: dict[tuple[int, int], int] = {}


def _file_id(lock_file) -> tuple[int, int]:
    st = os.fstat(lock_file.fileno())
    return st.st_dev, st.st_ino


def take_store_lock(lock_file) -> str | None:
    """Take the exclusive ``flock`` of a store's open ``ectier.lock`` without waiting: ``None``
    when taken, else who holds it, ``"another TieredCache in this process"`` (this process took
    it and holds it still) or ``"another process"``."""
    key = _file_id(lock_file)
    try:
        fcntl.flock(lock_file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        here = _HELD.get(key) == os.getpid()
        return "another TieredCache in this process" if here else "another process"
    _HELD[key] = os.getpid()
    return None


def drop_store_lock(lock_file) -> None:
    """Release a lock :func:`take_store_lock` took (the file stays open: the caller closes it)."""
    key = _file_id(lock_file)
    if _HELD.get(key) == os.getpid():
        _HELD.pop(key, None)
    fcntl.flock(lock_file.fileno(), fcntl.LOCK_UN)


def sync_dirs(store_dir: str | os.PathLike, created: list[Path]) -> None:
    """Make the store's directory entries durable (``fsync`` of each directory): ``lmdb/`` (its
    files), the store directory (``segment.0``, ``lmdb/``, the lock file) and the parent of each
    directory in ``created`` (:func:`missing_dirs` before the open). With ``nvme.sync`` a put is
    durable across power loss when it returns; a file whose name is not yet on disk would take every
    record with it. A directory that cannot be opened or synced is skipped (never raises)."""
    d = Path(store_dir)
    for target in [d / "lmdb", d, *(c.parent for c in created)]:
        _fsync_dir(target)


def fsync_path(path: str | os.PathLike) -> None:
    """``fsync`` a file or directory (its entries: a rename into it is durable once this returns).

    Raises:
        OSError: it cannot be opened or synced.
    """
    fd = os.open(path, os.O_RDONLY | (os.O_DIRECTORY if os.path.isdir(path) else 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(d: Path) -> None:
    try:
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
