"""Bounds on a generated request stream, shared by ``ectier demo`` and ``ectier bench`` (no
numpy or torch here: the command line imports it to build its options)."""

from __future__ import annotations

from ..errors import ConfigError

__all__ = ["MAX_ITEMS", "MAX_REQUESTS", "check_stream"]

#: Most requests one generated stream holds (it is kept in memory: ~100 bytes a request).
MAX_REQUESTS = 10_000_000
#: Most images in a generated catalogue (drawn one by one in Python: ~50 us each, ~50 s at this bound).
MAX_ITEMS = 1_000_000


def check_stream(requests: int, seed: int) -> None:
    """Raise ConfigError unless ``1 <= requests <= MAX_REQUESTS`` and ``seed >= 0`` (numpy's
    generators take non-negative seeds only); the message names the option."""
    if not 1 <= requests <= MAX_REQUESTS:
        raise ConfigError(f"requests: must be in [1, {MAX_REQUESTS:,}], got {requests}")
    if seed < 0:
        raise ConfigError(f"seed: must be >= 0, got {seed}")
