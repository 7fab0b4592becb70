"""What a move reports: the outcome of a commit (:class:`Commit`) and the mark of a demotion whose
copy is still in flight (:data:`IN_FLIGHT`). Used by :mod:`ectier.mover` and the move handlers of
``ectier/moves/``; both names are re-exported by :mod:`ectier.mover`.
"""

from __future__ import annotations

import enum

__all__ = ["Commit", "IN_FLIGHT"]

#: what a demotion whose copy is still in flight returns (true): counted when the copy completes
IN_FLIGHT = "in flight"


class Commit(enum.Enum):
    """The outcome of :meth:`Mover.commit`."""

    COMMITTED = "committed"  #: the entry is visible, the key's current version
    SUPERSEDED = "superseded"  #: a newer write won; this put is ordered before it (stands)
    CANCELLED = "cancelled"  #: deleted while its copy ran; ordered before the delete (stands)
    DROPPED = "dropped"  #: a promotion no longer needed (the key changed or is already there)

    @property
    def stands(self) -> bool:
        """Whether the write counts as done for its caller."""
        return self is not Commit.DROPPED

    @property
    def committed(self) -> bool:
        return self is Commit.COMMITTED
