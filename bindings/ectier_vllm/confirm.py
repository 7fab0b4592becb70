"""Producer saves counted by the scheduler when the workers' reports never reach it.

vLLM 0.33's V1 model runner (``GPUModelRunner.execute_model``) runs a pure ``ec_producer``'s
encoder inside the EC connector's context manager and returns
``make_empty_encoder_model_runner_output(...)`` from inside it: the ``ECConnectorOutput`` the
context manager fills (the worker metadata with the completed saves and the worker counters) is
never attached, so the scheduler never sees it and ``vllm:ectier_saves_total`` would stay 0 on
encoder instances. The V2 runner (``ActiveECConnector``, ``MMEncoderModelRunner``) and any
consumer (whose load runs in the V1 runner's ``_preprocess``) attach it.

On that one configuration (:func:`reports_reach_scheduler` is False) the scheduler-side connector
counts the saves itself with a :class:`SaveConfirmer`: each item vLLM allocates in its encoder
cache (``update_state_after_alloc``: a producer encodes it this step) is *expected*, and
``get_ec_connector_stats`` (once per step, after the workers ran) asks the store whether the
expected items are there: present is a save (bytes: rows x the model's encoder output width x
its dtype size), absent after :data:`CONFIRM_TIMEOUT_S` a save failure. The scheduler is one
per engine, so nothing is counted once per rank; the workers' own counters are the ones vLLM
drops, so nothing is counted twice. Should a worker report arrive after all (a runner that
behaves otherwise), the connector stops confirming and counts what the workers report.

In daemon mode the store's ``contains`` is sent without waiting for the reply
(:class:`~ectier_vllm.daemon_lookups.StoredQueries`), which a later poll reads once it has
arrived: the scheduler never waits on the daemon here. An item whose answer is not in yet stays
expected; a daemon that is down, or hung past ``daemon_timeout_s``, makes the item absent for
now (asked again after the back-off), and after :data:`CONFIRM_TIMEOUT_S` a save failure.

Caveats: an item another producer stored counts as this producer's save; so does, in-process, an
item whose put is still in flight (``TieredCache.contains`` answers True for it) even if its copy
then fails (the worker logs that failure); one evicted before it was seen (a store much smaller
than a step's outputs) counts as a failure. A lookup that fails (daemon down) is retried at the
next check until the timeout.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable

#: seconds an expected save may stay invisible in the store before it counts as a failure
CONFIRM_TIMEOUT_S = 60.0
#: after an item was not found, wait this long before asking again, doubling up to the cap
#: (a daemon-mode save in flight can take hundreds of ms; one lookup per item per step would add
#: a daemon round trip per item to every scheduler step meanwhile)
RECHECK_FIRST_S = 0.01
RECHECK_MAX_S = 1.0


def reports_reach_scheduler(vllm_config: Any, *, is_producer: bool, is_consumer: bool) -> bool:
    """False only where vLLM 0.33 drops the workers' EC connector output: a pure producer on the
    V1 model runner (see the module docstring). ``vllm_config.use_v2_model_runner`` is the
    property the workers themselves use to pick their runner."""
    if not is_producer or is_consumer:
        return True
    return bool(vllm_config.use_v2_model_runner)


@dataclass
class _Expected:
    nbytes: int
    since: float
    next_check: float
    wait: float = RECHECK_FIRST_S


@dataclass
class Confirmed:
    """What one :meth:`SaveConfirmer.poll` found: ``saves`` items present (``save_bytes`` their
    bytes), ``failed`` mm_hashes still absent after :data:`CONFIRM_TIMEOUT_S`."""

    saves: int = 0
    save_bytes: int = 0
    failed: tuple[str, ...] = ()


class SaveConfirmer:
    """Expected producer saves, confirmed by asking the store (see the module docstring)."""

    def __init__(self, *, timeout_s: float = CONFIRM_TIMEOUT_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._expected: dict[str, _Expected] = {}
        self._timeout_s = timeout_s
        self._clock = clock

    def __len__(self) -> int:
        return len(self._expected)

    def expect(self, mm_hash: str, nbytes: int) -> None:
        """``mm_hash`` is being encoded and saved (``nbytes``: its size in bytes, 0 if unknown)."""
        now = self._clock()
        self._expected[mm_hash] = _Expected(nbytes, now, now)

    def poll(self, stored: Callable[[list[str]], dict[str, bool | None]],
             errors: tuple[type[BaseException], ...]) -> Confirmed:
        """Ask ``stored`` about the expected items due for a check, in one call; it answers per
        item True (present), False (absent: asked again after a back-off) or None (its answer is
        not in yet: asked again at the next poll). ``errors`` raised by it mean "absent" for all.
        Returns what was confirmed or given up (and forgets those)."""
        now = self._clock()
        due = [h for h, exp in self._expected.items() if now >= exp.next_check]
        out = Confirmed()
        if not due:
            return out
        try:
            found = stored(due)
        except errors:
            found = {}
        failed: list[str] = []
        for mm_hash in due:
            exp = self._expected[mm_hash]
            present = found.get(mm_hash, False)
            if present:
                del self._expected[mm_hash]
                out.saves += 1
                out.save_bytes += exp.nbytes
            elif now - exp.since >= self._timeout_s:
                del self._expected[mm_hash]
                failed.append(mm_hash)
            elif present is False:
                exp.next_check = now + exp.wait
                exp.wait = min(2 * exp.wait, RECHECK_MAX_S)
        out.failed = tuple(failed)
        return out

    def clear(self) -> None:
        self._expected.clear()
