"""The swap that ends ``ectier fsck --repair``, made safe against a kill at any point of it.

A repair builds a fresh store in a staging directory ``<store>/.repair-<time>-<pid>``, then swaps
it in: the damaged ``lmdb/`` and ``segment.0`` go into ``<store>/damaged-<time>/``, the fresh ones
take their places, the staging directory goes. Those are several renames; a kill between them
used to leave the store half-swapped (a new index without its segment: every record quarantined at
the next open; or an old segment without its index: "lost its index"), and the next repair then
deleted the staging directory holding the rest of the rebuilt store.

So the swap is journaled. :func:`begin` runs once the staging store is complete: it syncs its
files and directories, then writes ``<store>/repair-swap.json`` (written to a temporary name,
synced, renamed, the directory synced) naming, relative to the store directory (the store may be
moved before the journal is finished), the staging directory, the ``damaged-*`` directory and the
files on each side. From then on the only outcome is the rebuilt store in place — the user asked
for it, and it is whole and durable — so the journal is only ever **rolled forward**, never undone:
:func:`finish` makes every step idempotent, keyed on which paths exist:

1. each old file not yet in ``damaged-*`` is renamed there (before that directory holds it, the
   file at its place is the old one: new ones move in only after every old one is aside);
2. each new file still in the staging directory is renamed into place;
3. the directories are synced, the staging directory removed, the journal removed last (the store
   directory synced).

Whoever next takes the store's lock finishes a pending swap before anything else: ``ectier fsck``
(check or repair) and a cache's open (:class:`~ectier.tiers.nvme_env.NvmeEnv`, which logs a
warning). Refusing the open instead would stop an engine for a step with one possible result and
no decision left to a person. A staging directory a journal names is never removed as a killed
repair's leftover (``ectier.fsck``), and a journal naming files that are in neither place (someone
deleted them) is an error that changes nothing.

See docs/operations.md ("Damaged store: ectier fsck") and docs/reliability.md.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import StoreOpenError
from .nvme_segment import SEGMENT_NAME
from .storedir import damaged_target, fsync_path

__all__ = ["JOURNAL_NAME", "SwapJournal", "pending", "begin", "finish", "finish_pending"]

#: the journal's file name in the store directory (not ``.repair-*``: that is a staging directory)
JOURNAL_NAME = "repair-swap.json"
_TMP_NAME = JOURNAL_NAME + ".tmp"
_FILES = ("lmdb", SEGMENT_NAME)  # what a store directory's swap moves, in this order


@dataclass(frozen=True)
class SwapJournal:
    """One pending swap, names relative to the store directory: ``staging`` (``.repair-*``),
    ``damaged`` (``damaged-*``), ``old`` (the store's files moved aside), ``new`` (the staging
    store's files moved in), each a subset of ``("lmdb", "segment.0")`` in that order."""

    staging: str
    damaged: str
    old: tuple[str, ...]
    new: tuple[str, ...]


def pending(store: str | os.PathLike, who: str = "--path") -> SwapJournal | None:
    """The swap journaled in ``store``, or ``None``. The caller holds the store's lock.

    ``who`` names the option that gave the path in messages (``"--path"``, ``"nvme.path"``).

    Raises:
        StoreOpenError: the journal cannot be read or does not have the shape :func:`begin`
            writes (the message names it; nothing is changed).
    """
    path = Path(store) / JOURNAL_NAME
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise StoreOpenError(f"{who}: cannot read the repair journal {str(path)!r}: {exc.strerror}") from None
    try:
        raw = json.loads(text)
        journal = SwapJournal(raw["staging"], raw["damaged"], tuple(raw["old"]), tuple(raw["new"]))
        ok = (journal.staging.startswith(".repair-") and journal.damaged.startswith("damaged-")
              and "/" not in journal.staging + journal.damaged and journal.new
              and all(n in _FILES for n in journal.old + journal.new))
    except (ValueError, KeyError, TypeError, AttributeError):
        ok = False
    if not ok:
        raise StoreOpenError(f"{who}: the repair journal {str(path)!r} is not one ectier wrote ({text[:200]!r}); "
                             "move it away after checking the store's directories by hand")
    return journal


def begin(store: str | os.PathLike, staging: str | os.PathLike) -> SwapJournal:
    """Journal the swap of the complete store in ``staging`` (a ``.repair-*`` directory in
    ``store``) into ``store``: sync the staging store, write and sync the journal. Nothing is
    renamed yet (:func:`finish` does it). The caller holds the store's lock.

    Raises:
        OSError: a sync or the journal's write failed (no journal then: the store is unchanged).
    """
    d, staging = Path(store), Path(staging)
    new = tuple(n for n in _FILES if (staging / n).exists())
    for name in ("lmdb/data.mdb", SEGMENT_NAME, "lmdb", "."):
        if (staging / name).exists():
            fsync_path(staging / name)
    journal = SwapJournal(staging.name, damaged_target(d).name, tuple(n for n in _FILES if (d / n).exists()), new)
    tmp = d / _TMP_NAME
    with open(tmp, "w") as f:
        f.write(json.dumps(asdict(journal)))
        f.flush()
        os.fsync(f.fileno())
    os.rename(tmp, d / JOURNAL_NAME)
    fsync_path(d)
    return journal


def finish(store: str | os.PathLike, journal: SwapJournal) -> None:
    """Roll the swap of ``journal`` forward from wherever it stopped (steps in the module
    docstring), then remove the staging directory and, last, the journal. The caller holds the
    store's lock.

    Raises:
        OSError: a rename or sync failed (the journal stays: finishing again resumes there).
        FileNotFoundError: a file of the rebuilt store is neither in the staging directory nor in
            place (the journal stays; nothing was renamed).
    """
    d = Path(store)
    staging, damaged = d / journal.staging, d / journal.damaged
    in_place = [n for n in journal.new if (d / n).exists() and (n not in journal.old or (damaged / n).exists())]
    lost = [n for n in journal.new if not (staging / n).exists() and n not in in_place]
    if lost:
        raise FileNotFoundError(f"the rebuilt store's {', '.join(lost)} is neither in {str(staging)!r} nor in place")
    damaged.mkdir(exist_ok=True)
    for name in journal.old:
        if not (damaged / name).exists() and (d / name).exists():
            os.rename(d / name, damaged / name)
    for name in journal.new:
        if (staging / name).exists():
            if (d / name).exists():
                raise FileExistsError(f"{str(d / name)!r} is in the way of the rebuilt store's {name}")
            os.rename(staging / name, d / name)
    fsync_path(damaged)
    fsync_path(d)
    shutil.rmtree(staging, ignore_errors=True)
    os.unlink(d / JOURNAL_NAME)
    fsync_path(d)


def finish_pending(store: str | os.PathLike, who: str = "--path") -> SwapJournal | None:
    """Finish the swap journaled in ``store`` if there is one (:func:`pending`, :func:`finish`);
    returns its journal, or ``None`` (nothing pending: a journal's leftover temporary file, from a
    kill before the swap began, is removed). The caller holds the store's lock.

    Raises:
        StoreOpenError: the journal is unreadable, or the swap cannot be finished (the message
            says why, and where the damaged store and the rebuilt one are).
    """
    d = Path(store)
    journal = pending(d, who)
    if journal is None:
        try:
            os.unlink(d / _TMP_NAME)
        except OSError:
            pass
        return None
    try:
        finish(d, journal)
    except OSError as exc:
        raise StoreOpenError(
            f"{who}: cannot finish the swap of the repair journaled in {str(d / JOURNAL_NAME)!r} ({exc}); the "
            f"damaged store is in {str(d / journal.damaged)!r}, the rebuilt one in {str(d / journal.staging)!r} "
            f"(what is not in place yet); once the cause is fixed, `ectier fsck --path {str(d)!r}` finishes it (to give "
            f"up on the rebuilt store instead: move back what is in {journal.damaged}, then remove the journal)") from None
    return journal
