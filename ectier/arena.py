"""Block allocator over one preallocated region. Pure Python; knows nothing of tensors.

The region is cut into ``nblocks`` fixed blocks. An allocation of ``n`` blocks returns a list of
*extents* ``(first_block, count)``: one run when a free run is large enough (best fit), otherwise
the largest free runs until ``n`` is covered. Because an entry may span several runs, a byte budget
can always be used to the last block: evicting ``n`` blocks' worth of entries always makes room for
``n`` blocks, whatever the order of frees (no fragmentation failure). Frees coalesce with their
neighbours.

Not thread-safe: the owning cache holds its lock around calls.
"""

from __future__ import annotations

import bisect

__all__ = ["BlockAllocator", "Extent"]

#: ``(first_block, block_count)``
Extent = tuple[int, int]


class BlockAllocator:
    """Free-run bookkeeping for a region of ``nblocks`` blocks.

    Raises:
        ValueError: ``nblocks < 0``; a free of blocks that are not allocated (double free).
    """

    def __init__(self, nblocks: int) -> None:
        if nblocks < 0:
            raise ValueError(f"nblocks: must be >= 0, got {nblocks}")
        self.nblocks = nblocks
        self._starts: list[int] = [0] if nblocks else []  # sorted starts of free runs
        self._runs: dict[int, int] = {0: nblocks} if nblocks else {}  # start -> length
        self.free_blocks = nblocks

    @property
    def used_blocks(self) -> int:
        """Blocks currently allocated."""
        return self.nblocks - self.free_blocks

    def alloc(self, count: int) -> list[Extent] | None:
        """Allocate ``count`` blocks, all or nothing; ``[]`` for ``count == 0``, ``None`` if short."""
        if count < 0:
            raise ValueError(f"count: must be >= 0, got {count}")
        if count == 0:
            return []
        if count > self.free_blocks:
            return None
        best = None
        for start in self._starts:  # best fit: the smallest single run that holds everything
            length = self._runs[start]
            if length >= count and (best is None or length < self._runs[best]):
                best = start
                if length == count:
                    break
        if best is not None:
            self._take(best, count)
            return [(best, count)]
        extents: list[Extent] = []
        remaining = count
        for start in sorted(self._starts, key=lambda s: -self._runs[s]):
            take = min(self._runs[start], remaining)
            self._take(start, take)
            extents.append((start, take))
            remaining -= take
            if remaining == 0:
                break
        extents.sort()
        return extents

    def free(self, extents: list[Extent]) -> None:
        """Return extents to the free runs, merging neighbours.

        Raises:
            ValueError: an extent outside the region, with a negative count, overlapping a free
                run (double free) or another extent of the same call. Nothing is freed then.
        """
        if len(extents) == 1 and extents[0][1] > 0:  # the common case: one run, checked and merged at once
            self._free_one(*extents[0])
            return
        # Check every extent before changing anything, so a bad call leaves the runs untouched.
        prev_end = None
        for start, count in sorted(extents):
            if count < 0:
                raise ValueError(f"extent ({start}, {count}): count must be >= 0")
            if count == 0:
                continue
            if start < 0 or start + count > self.nblocks:
                raise ValueError(f"extent ({start}, {count}) lies outside 0..{self.nblocks}")
            if prev_end is not None and start < prev_end:
                raise ValueError(f"extent ({start}, {count}) overlaps another extent of the same free")
            prev_end = start + count
            i = bisect.bisect_left(self._starts, start)
            prev_start = self._starts[i - 1] if i > 0 else None
            next_start = self._starts[i] if i < len(self._starts) else None
            if (prev_start is not None and prev_start + self._runs[prev_start] > start) or (
                next_start is not None and start + count > next_start
            ):
                raise ValueError(f"extent ({start}, {count}) is already free (double free)")
        for start, count in extents:
            if count == 0:
                continue
            i = bisect.bisect_left(self._starts, start)
            prev_start = self._starts[i - 1] if i > 0 else None
            next_start = self._starts[i] if i < len(self._starts) else None
            new_start, new_len = start, count
            if prev_start is not None and prev_start + self._runs[prev_start] == start:
                new_start = prev_start
                new_len += self._runs.pop(prev_start)
                self._starts.pop(i - 1)
                i -= 1
            if next_start is not None and start + count == next_start:
                new_len += self._runs.pop(next_start)
                self._starts.pop(i)
            self._runs[new_start] = new_len
            self._starts.insert(i, new_start)
            self.free_blocks += count

    def _free_one(self, start: int, count: int) -> None:
        """:meth:`free` of one extent of ``count > 0`` blocks (same checks, one search)."""
        if start < 0 or start + count > self.nblocks:
            raise ValueError(f"extent ({start}, {count}) lies outside 0..{self.nblocks}")
        starts, runs = self._starts, self._runs
        i = bisect.bisect_left(starts, start)
        prev_start = starts[i - 1] if i > 0 else None
        next_start = starts[i] if i < len(starts) else None
        prev_end = prev_start + runs[prev_start] if prev_start is not None else None
        if (prev_end is not None and prev_end > start) or (next_start is not None and start + count > next_start):
            raise ValueError(f"extent ({start}, {count}) is already free (double free)")
        new_start, new_len = start, count
        if prev_end == start:
            new_start = prev_start
            new_len += runs.pop(prev_start)
            starts.pop(i - 1)
            i -= 1
        if next_start is not None and start + count == next_start:
            new_len += runs.pop(next_start)
            starts.pop(i)
        runs[new_start] = new_len
        starts.insert(i, new_start)
        self.free_blocks += count

    def free_runs(self) -> list[Extent]:
        """The free runs, sorted by start (for tests and stats)."""
        return [(s, self._runs[s]) for s in self._starts]

    def _take(self, start: int, count: int) -> None:
        length = self._runs.pop(start)
        i = bisect.bisect_left(self._starts, start)
        self._starts.pop(i)
        if length > count:
            self._runs[start + count] = length - count
            self._starts.insert(i, start + count)
        self.free_blocks -= count
