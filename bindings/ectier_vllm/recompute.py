"""Load or recompute, per item: the scheduler side answers a miss when bringing an item to the worker
would take longer than the encoder takes to recompute it. Pure logic: imports neither vLLM nor torch.

- :class:`TierBandwidth`: per tier, an exponentially weighted moving average (EWMA) of the bandwidth
  of observed reads, bytes per second. A read of ``nbytes`` in ``seconds`` updates its tier's
  estimate ``bw <- (1 - alpha) * bw + alpha * nbytes / seconds`` (the first read sets it).
  ``"host"``: the worker's load (pinned host arena → the worker's device); ``"nvme"`` (or
  ``"remote"``): a promotion into the host tier.
- :class:`EncoderCost`: the encoder's seconds per token on this engine: configured
  (``ec_connector_extra_config.encoder_seconds_per_token``, then fixed), or an EWMA of the
  encoder steps observed (``seconds / tokens`` per step; see :meth:`EncoderCost.observe`).
- :class:`RecomputePolicy`: for an item of ``nbytes`` bytes and ``tokens`` rows held by the tiers
  ``path`` (the tiers its bytes go through, e.g. ``("nvme", "host")``: promoted, then loaded), the
  expected load time is ``sum(nbytes / bw[t] for t in path)`` and the recompute time
  ``tokens * seconds_per_token``; the item is recomputed when the load would take longer.
  Unknown estimates (a tier not read ``min_samples`` times yet, no encoder timing) always load, and
  every ``explore_every``-th item that would be recomputed is loaded anyway, so that a tier's
  estimate keeps being refreshed (a tier never read again would keep a stale bandwidth for ever).
"""

from __future__ import annotations

import math
import threading
from dataclasses import dataclass

__all__ = ["Decision", "EncoderCost", "EncoderStepTimer", "LoadOrRecompute", "RecomputePolicy", "TierBandwidth"]

#: weight of the newest observation in every EWMA
ALPHA = 0.2
#: reads of a tier (or encoder steps) observed before its estimate is used
MIN_SAMPLES = 3
#: of the items the estimates would recompute, every this-many-th is loaded anyway (estimate refresh)
EXPLORE_EVERY = 16


def _check_alpha(alpha: float) -> float:
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not 0 < alpha <= 1:
        raise ValueError(f"alpha: expected a number in (0, 1], got {alpha!r}")
    return float(alpha)


def _ok(x: float) -> bool:
    return not isinstance(x, bool) and isinstance(x, (int, float)) and math.isfinite(x) and x > 0


class TierBandwidth:
    """EWMA of observed read bandwidth per tier (bytes per second). Thread-safe.

    Args:
        alpha: weight of the newest read, in (0, 1].
        min_samples: reads of a tier before :meth:`bytes_per_s` answers (``None`` before).

    Raises:
        ValueError: ``alpha`` outside (0, 1] or ``min_samples`` < 1.
    """

    def __init__(self, alpha: float = ALPHA, min_samples: int = MIN_SAMPLES) -> None:
        self.alpha = _check_alpha(alpha)
        if min_samples < 1:
            raise ValueError(f"min_samples: expected >= 1, got {min_samples!r}")
        self.min_samples = min_samples
        self._bw: dict[str, float] = {}
        self._n: dict[str, int] = {}
        self._lock = threading.Lock()

    def observe(self, tier: str, nbytes: int, seconds: float) -> None:
        """One read of ``nbytes`` bytes from ``tier`` that took ``seconds``; an empty or instant read
        (``nbytes`` or ``seconds`` not > 0, not finite) is ignored, and so is one whose rate is
        not a finite number > 0 (overflow: an EWMA of inf would never come back)."""
        if not (_ok(nbytes) and _ok(seconds)):
            return
        rate = nbytes / seconds
        if not _ok(rate):
            return
        with self._lock:
            old = self._bw.get(tier)
            self._bw[tier] = rate if old is None else (1 - self.alpha) * old + self.alpha * rate
            self._n[tier] = self._n.get(tier, 0) + 1

    def bytes_per_s(self, tier: str) -> float | None:
        """The tier's estimate, or ``None`` while it has fewer than ``min_samples`` reads."""
        with self._lock:
            return self._bw.get(tier) if self._n.get(tier, 0) >= self.min_samples else None

    def expected_s(self, path: tuple[str, ...], nbytes: int) -> float | None:
        """Seconds to move ``nbytes`` through every tier of ``path`` (``None``: one is unknown)."""
        total = 0.0
        for tier in path:
            bw = self.bytes_per_s(tier)
            if bw is None:
                return None
            total += nbytes / bw
        return total

    def snapshot(self) -> dict[str, dict[str, float]]:
        """``{tier: {"bytes_per_s", "reads"}}`` of every tier read at least once."""
        with self._lock:
            return {t: {"bytes_per_s": bw, "reads": self._n[t]} for t, bw in self._bw.items()}


class EncoderCost:
    """The encoder's seconds per token: configured (fixed) or learned (EWMA of observed steps).

    Args:
        seconds_per_token: a configured value (> 0): observations are then ignored. ``None``: learn.
        alpha: weight of the newest step, in (0, 1].
        min_samples: steps observed before a learned value is used.

    Raises:
        ValueError: ``seconds_per_token`` not a finite number > 0, or a bad ``alpha``.
    """

    def __init__(self, seconds_per_token: float | None = None, *, alpha: float = ALPHA,
                 min_samples: int = MIN_SAMPLES) -> None:
        if seconds_per_token is not None and not _ok(seconds_per_token):
            raise ValueError(f"seconds_per_token: expected a finite number > 0, got {seconds_per_token!r}")
        self.configured = seconds_per_token is not None
        self.alpha = _check_alpha(alpha)
        self.min_samples = min_samples
        self._s = seconds_per_token
        self._n = 0
        self._lock = threading.Lock()

    @property
    def source(self) -> str:
        """``"configured"``, ``"learned"`` (enough steps seen) or ``"unknown"``."""
        if self.configured:
            return "configured"
        return "learned" if self._n >= self.min_samples else "unknown"

    def observe(self, tokens: int, seconds: float) -> None:
        """One encoder run of ``tokens`` tokens (all items of a step) that took ``seconds``."""
        if self.configured or not (_ok(tokens) and _ok(seconds)):
            return
        rate = seconds / tokens
        if not _ok(rate):  # underflow to 0: recomputing would look free
            return
        with self._lock:
            self._s = rate if self._s is None else (1 - self.alpha) * self._s + self.alpha * rate
            self._n += 1

    def seconds_per_token(self) -> float | None:
        if self.configured:
            return self._s
        with self._lock:
            return self._s if self._n >= self.min_samples else None

    def seconds(self, tokens: int) -> float | None:
        """Expected seconds to recompute an item of ``tokens`` tokens (``None``: unknown)."""
        s = self.seconds_per_token()
        return None if s is None else s * tokens


@dataclass(frozen=True)
class Decision:
    """``recompute``: answer a miss. ``load_s`` / ``recompute_s``: the estimates compared (``None``:
    unknown). ``explored``: the estimates said recompute, but this item is loaded to refresh them."""

    recompute: bool
    load_s: float | None
    recompute_s: float | None
    explored: bool = False


class RecomputePolicy:
    """Per item: load (from the tiers on its path) or recompute (see the module docstring).

    Args:
        bandwidth: the per-tier read estimates.
        encoder: the encoder's cost per token.
        explore_every: of the items it would recompute, load every this-many-th (``0``: never).

    Raises:
        ValueError: ``explore_every`` < 0.
    """

    def __init__(self, bandwidth: TierBandwidth, encoder: EncoderCost, *, explore_every: int = EXPLORE_EVERY) -> None:
        if explore_every < 0:
            raise ValueError(f"explore_every: expected >= 0, got {explore_every!r}")
        self.bandwidth = bandwidth
        self.encoder = encoder
        self.explore_every = explore_every
        self._would = 0
        self._lock = threading.Lock()

    def decide(self, path: tuple[str, ...], nbytes: int, tokens: int) -> Decision:
        """Whether to recompute an item of ``nbytes`` bytes and ``tokens`` tokens held at ``path``
        (the tiers it would be read through, nearest the worker last, e.g. ``("nvme", "host")``)."""
        load_s = self.bandwidth.expected_s(path, nbytes)
        recompute_s = self.encoder.seconds(tokens)
        if load_s is None or recompute_s is None or load_s <= recompute_s:
            return Decision(False, load_s, recompute_s)
        with self._lock:
            self._would += 1
            explore = self.explore_every > 0 and self._would % self.explore_every == 0
        return Decision(not explore, load_s, recompute_s, explored=explore)

    def snapshot(self) -> dict[str, object]:
        """Estimates for logs and stats: tiers' bandwidths, seconds per token and its source."""
        return {"tiers": self.bandwidth.snapshot(), "encoder_seconds_per_token": self.encoder.seconds_per_token(),
                "encoder_source": self.encoder.source}


#: promotions followed at most (one per item a request waits for; older ones are forgotten)
MAX_TRACKED = 4096
#: the path of an item the scheduler had to wait for: promoted into the host tier (from NVMe or the
#: remote tier, whichever holds it), then loaded by the worker
PROMOTED_PATH = ("promote", "host")


class LoadOrRecompute:
    """The scheduler side's use of :class:`RecomputePolicy` (:mod:`ectier_vllm.scheduler` calls it).

    ``check(mm_hash, status, nbytes, tokens)`` is called with each lookup's outcome (``status``:
    ``"wait"`` while a promotion runs, ``"ready"``, ``"miss"``, ``"timeout"``) and returns True
    when the item should be recomputed instead (a promotion is needed and the policy says the load
    would be slower; the promotion itself goes on, so a later request may find it in the host tier).

    Promotion reads are observed as the scheduler sees them, once per step: a promotion's duration
    lies between the last step that saw it pending and the step that saw it ready; the lower end
    is observed (an optimistic bandwidth: recompute is chosen only when even that is too slow), and a
    promotion done within one step gives no observation (a tier that fast is never worth skipping).
    A promotion given up (``"timeout"``: past ``load_timeout_s``) is observed as taking at least
    as long as it was waited for: a tier that turned that slow is then recomputed at once, instead
    of each later item waiting ``load_timeout_s`` first.
    An item the policy *explores* (loaded although the estimates said recompute) stays loaded until
    its promotion is done, and if that took one step its upper end is observed (from the step
    that started it to the one that saw it ready): an estimate that went stale is refreshed.
    Worker loads (``load_bytes`` over the sum of ``load_seconds`` of a report) are the ``"host"``
    reads; the reports' ``encoder_tokens`` / ``encoder_seconds`` (the producer's own encoder steps,
    :class:`EncoderStepTimer`) teach the encoder's cost unless it is configured.

    Args:
        enabled: False: ``check`` always loads (nothing is learned either).
        seconds_per_token: the encoder's configured cost (``None``: learned).
        now: the clock (seconds); tests pass their own.
    """

    def __init__(self, enabled: bool = True, seconds_per_token: float | None = None, *,
                 explore_every: int = EXPLORE_EVERY, now=None) -> None:
        import time

        self.enabled = enabled
        self.policy = RecomputePolicy(TierBandwidth(), EncoderCost(seconds_per_token), explore_every=explore_every)
        self._now = now or time.monotonic
        # mm_hash -> (first, last pending, nbytes, explored: loaded whatever the estimates say)
        self._pending: dict[str, tuple[float, float, int, bool]] = {}

    def check(self, mm_hash: str, status: str, nbytes: int, tokens: int) -> bool:
        if not self.enabled:
            return False
        now = self._now()
        if status == "wait":
            first, _, _, explored = self._pending.get(mm_hash, (now, now, nbytes, False))
            self._pending[mm_hash] = (first, now, nbytes, explored)
            if len(self._pending) > MAX_TRACKED:  # requests that went away mid-promotion: oldest first
                del self._pending[next(iter(self._pending))]
            if explored:
                return False  # chosen to refresh the estimates: waited for until it is loaded
            decision = self.policy.decide(PROMOTED_PATH, nbytes, tokens)
            if decision.recompute:
                del self._pending[mm_hash]
                return True
            if decision.explored:
                self._pending[mm_hash] = (first, now, nbytes, True)
            return False
        seen = self._pending.pop(mm_hash, None)
        if status in ("ready", "timeout") and seen is not None:
            first, last, size, explored = seen
            if status == "timeout" or (explored and last == first):  # waited for all along / its upper end
                last = now
            self.policy.bandwidth.observe(PROMOTED_PATH[0], size, last - first)
        return False

    def forget(self, mm_hash: str) -> None:
        """Nobody waits for ``mm_hash``'s promotion any more (its requests finished)."""
        self._pending.pop(mm_hash, None)

    def observe_report(self, stats: dict) -> None:
        """Learn from a worker report's ``stats`` (``encoder_tokens``/``encoder_seconds`` are taken
        out of it: they are inputs of this estimate, not counters)."""
        tokens, seconds = stats.pop("encoder_tokens", 0), stats.pop("encoder_seconds", 0.0)
        if not self.enabled:
            return
        self.policy.encoder.observe(tokens, seconds)
        loads = stats.get("load_seconds") or ()
        self.policy.bandwidth.observe("host", stats.get("load_bytes", 0), float(sum(loads)))


class EncoderStepTimer:
    """A producer worker's encoder time per step: from the end of ``start_load_caches`` (:meth:`begin`)
    to the start of the step's last ``save_caches`` (:meth:`item`), minus the time spent inside the
    earlier saves of the step (:meth:`saved`). A mark is ``(seconds, event)``: with CUDA ``event``
    is a timing event recorded on the current stream, and the GPU time between the two events is
    used once the last one has completed (``event.query()``); ``event`` None: wall-clock seconds.
    """

    def __init__(self) -> None:
        self._start = None
        self._last = None
        self._tokens = 0
        self._saving = 0.0  # seconds inside save_caches before the last item's mark
        self._save_now = 0.0
        self._closed: list[tuple[int, object, object, float]] = []

    def begin(self, mark: tuple[float, object]) -> None:
        self._close()
        self._start, self._last, self._tokens, self._saving, self._save_now = mark, None, 0, 0.0, 0.0

    def item(self, tokens: int, mark: tuple[float, object]) -> None:
        if self._start is None:
            return
        self._tokens += tokens
        self._last = mark
        self._saving += self._save_now
        self._save_now = 0.0

    def saved(self, seconds: float) -> None:
        """Seconds the last item's ``save_caches`` took (not encoder time if another item follows)."""
        self._save_now += seconds

    def _close(self) -> None:
        if self._start is not None and self._last is not None and self._tokens:
            self._closed.append((self._tokens, self._start, self._last, self._saving))
        self._start = self._last = None
        self._tokens = 0

    def take(self) -> list[tuple[int, float]]:
        """Finished steps ``(tokens, seconds)`` (the current step is finished by this call); a step
        whose last CUDA event has not completed yet is kept for a later call."""
        if self._start is None and not self._closed:
            return []  # no step open, none kept
        self._close()
        out, keep = [], []
        for tokens, (t0, e0), (t1, e1), saving in self._closed:
            if e0 is not None and e1 is not None:
                if not e1.query():
                    keep.append((tokens, (t0, e0), (t1, e1), saving))
                    continue
                seconds = e0.elapsed_time(e1) / 1e3  # milliseconds
            else:
                seconds = (t1 - t0) - saving
            if seconds > 0:
                out.append((tokens, seconds))
        self._closed = keep
        return out
