"""Fork detection: an object opened before ``fork()`` knows, in the child, that it is not its to use.

LMDB environments, CUDA contexts, arenas and their locks belong to the process that opened them
(``docs/architecture.md``, CUDA ordering rule 5). Each ``os.fork`` bumps a generation counter in
the child; a :class:`ForkMark` taken at open compares against it.
"""

from __future__ import annotations

import os

from .errors import ProcessForkedError

__all__ = ["ForkMark"]

_GENERATION = [0]
os.register_at_fork(after_in_child=lambda: _GENERATION.__setitem__(0, _GENERATION[0] + 1))


class ForkMark:
    """The process generation at construction; :attr:`forked` is True in any child forked since."""

    __slots__ = ("_generation",)

    def __init__(self) -> None:
        self._generation = _GENERATION[0]

    @property
    def forked(self) -> bool:
        return self._generation != _GENERATION[0]

    def check(self, what: str) -> None:
        """Raise :class:`~ectier.errors.ProcessForkedError` naming ``what`` in a forked child."""
        if self._generation != _GENERATION[0]:
            raise ProcessForkedError(
                f"this {what} was opened in a process before a fork(); its LMDB environment, host arena "
                f"and locks are not usable in a forked child: open a new {what} in the child")
