"""Child process of ``test_repair_kill.py``: ``ectier fsck --repair`` SIGKILLed at one chosen point.

``python tests/repair_kill.py POINT STORE_DIR``

Runs :func:`ectier.fsck.repair` on the damaged store in ``STORE_DIR`` and kills itself
(``SIGKILL``: no handler, no ``finally``, no flush) right after the step ``POINT`` names. The steps
are found from outside, as the repair does them — by the path of a rename, of a removal, or by a
count of record writes — so that the same points exist in any implementation of the repair that
makes those moves (and the test can be run against the code before the swap was journaled). If the
point is never reached it prints ``NOT KILLED`` and exits with status 3.

Points, in the order a repair reaches them:

- ``building``: after the 10th record written into the staging store (``NvmeTier.write``);
- ``journal-unrenamed``: the swap's journal written under its temporary name, before the rename
  that makes it the journal (``repair-swap.json``);
- ``journal-written``: after the swap's journal (``repair-swap.json``) was renamed into place;
- ``lmdb-aside``, ``segment-aside``: after the damaged ``lmdb``, ``segment.0`` went into ``damaged-*``;
- ``lmdb-in``, ``segment-in``: after the rebuilt ``lmdb``, ``segment.0`` went into the store directory;
- ``staging-removed``: after the ``.repair-*`` staging directory was removed.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
from pathlib import Path

POINTS = ("building", "journal-unrenamed", "journal-written", "lmdb-aside", "segment-aside", "lmdb-in", "segment-in", "staging-removed")


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _reached(point: str, store: Path, dst: Path) -> bool:
    aside = dst.parent.name.startswith("damaged-") and dst.parent.parent == store
    return {"journal-written": dst == store / "repair-swap.json",
            "lmdb-aside": aside and dst.name == "lmdb",
            "segment-aside": aside and dst.name == "segment.0",
            "lmdb-in": dst == store / "lmdb",
            "segment-in": dst == store / "segment.0"}.get(point, False)


def arm(point: str, store: Path) -> None:
    """Patch the process so that it is SIGKILLed right after ``point`` (module docstring)."""
    from ectier.tiers.nvme import NvmeTier

    for name in ("rename", "replace"):
        real = getattr(os, name)

        def moved(src, dst, *args, _real=real, **kwargs):
            if point == "journal-unrenamed" and Path(os.path.abspath(dst)) == store / "repair-swap.json":
                _die()
            _real(src, dst, *args, **kwargs)
            if _reached(point, store, Path(os.path.abspath(dst))):
                _die()

        setattr(os, name, moved)
    real_rmtree = shutil.rmtree

    def rmtree(path, *args, **kwargs):
        real_rmtree(path, *args, **kwargs)
        if point == "staging-removed" and Path(path).name.startswith(".repair-"):
            _die()

    shutil.rmtree = rmtree
    real_write = NvmeTier.write
    written = [0]

    def write(self, *args, **kwargs):
        ok = real_write(self, *args, **kwargs)
        written[0] += 1
        if point == "building" and written[0] == 10:
            _die()
        return ok

    NvmeTier.write = write


def main(point: str, store: str) -> None:
    from ectier.fsck import repair

    path = Path(os.path.abspath(store))
    arm(point, path)
    repair(path)
    print("NOT KILLED", flush=True)
    sys.exit(3)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
