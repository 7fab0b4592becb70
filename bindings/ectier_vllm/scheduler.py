"""The scheduler side of :class:`~ectier_vllm.connector.ECTierConnector` (engine-core process).

Each step: ``ensure_cache_available`` promotes the request's stored items towards the worker and
pins them once ready (all through :meth:`SchedulerSide._promotion`, the one place that decides
whether an item is looked up, waited for or a miss); ``has_cache_item`` answers from the pins;
``update_state_after_alloc`` / ``build_connector_meta`` hand the pinned items to the workers;
``update_connector_output`` drops the pins the workers report loaded and takes their counters.
See the module docstring of :mod:`ectier_vllm.connector` for the whole path.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorMetadata, ECConnectorRole
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import ECConnectorOutput

from . import confirm as save_confirm
from .common import STORE_ERRORS, logger
from .metadata import ECTierConnectorMetadata, ECTierWorkerMetadata, LoadItem
from .metrics import merge_stats_data
from .recompute import LoadOrRecompute
from .store import NOT_STORED, Pin

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request


class Promotion(str, enum.Enum):
    """Where an item stands for the scheduler (``ECTierConnector._promotion``); each member equals
    its value (``Promotion.WAIT == "wait"``), what :class:`~ectier_vllm.recompute.LoadOrRecompute`
    is given."""

    MISS = "miss"  #: not stored: vLLM encodes it
    WAIT = "wait"  #: a promotion towards the worker is in flight: the request waits this step
    TIMEOUT = "timeout"  #: the promotion ran past ``load_timeout_s``: re-encode
    READY = "ready"  #: ready to pin


@dataclass
class _PinState:
    pin: Pin
    req_ids: set[str] = field(default_factory=set)


@dataclass
class _Prefetch:
    handles: list[Any]
    started: float
    #: the requests waiting for it (request_finished drops a promotion nobody waits for any more)
    req_ids: set[str] = field(default_factory=set)


class SchedulerSide:
    """Scheduler-side methods of the connector (a mixin: the state is set up in
    ``ECTierConnector.__init__``, :meth:`_init_scheduler_side`)."""

    def _init_scheduler_side(self, vllm_config: "VllmConfig", role: ECConnectorRole) -> None:
        self._pins: dict[str, _PinState] = {}
        # bytes per encoder-output row (_item_nbytes); 0: several widths, or an unknown one
        widths = self._widths
        self._row_bytes = 0 if widths is None or len(widths) != 1 else next(iter(widths)) * self._model_dtype.itemsize
        self._prefetching: dict[str, _Prefetch] = {}
        self._to_load: dict[str, LoadItem] = {}
        self._unavailable: set[str] = set()
        # req_id -> mm_hashes settled for it: already placed in the worker's encoder_cache, or
        # refused (wrong shape/dtype, promotion timed out): not looked up again in later steps
        # (e.g. the next chunks of a chunked prefill)
        self._settled: dict[str, set[str]] = {}
        #: the requests of the pins' req_ids (their items' positions: _add_sharers), until finished
        self._requests: dict[str, "Request"] = {}
        # lookups are counted once per (request, item) (metrics.py): the request the last
        # ensure_cache_available call was about (vLLM asks has_cache_item for its items right
        # after it), and per request the items counted since vLLM last allocated them (a request
        # vLLM could not place, e.g. no KV room, is asked about again next step: not a new lookup)
        self._asking: "Request | None" = None
        self._counted: dict[str, set[str]] = {}
        # mm_hashes whose load failed at a worker after vLLM's encoder-cache manager had counted
        # them as present: until the manager evicts them (free_encoder_mm_hashes) vLLM would
        # neither encode nor load them again, so this connector reloads them from the store itself,
        # or fails the requests that need them (never a worker crash)
        self._poisoned: set[str] = set()
        # mm_hashes vLLM's encoder-cache manager holds: allocated (update_state_after_alloc: encoded
        # or loaded) and not evicted since (free_encoder_mm_hashes). vLLM serves them itself and
        # never asks has_cache_item about them, so they are neither promoted, pinned nor counted
        self._local: set[str] = set()
        # load or recompute, per item (recompute.py): fed by the lookups and the workers' reports;
        # off with an in-process GPU tier (a wait may then be a host -> GPU promotion, never worth skipping)
        gpu_tier = self.settings.cache is not None and self.settings.cache.gpu.enabled
        self._recompute = LoadOrRecompute(self.settings.recompute and not gpu_tier, self.settings.encoder_seconds_per_token)
        # producer on the V1 model runner: the scheduler counts the saves (see confirm.py)
        self._confirm: save_confirm.SaveConfirmer | None = None
        if role == ECConnectorRole.SCHEDULER and not save_confirm.reports_reach_scheduler(
                vllm_config, is_producer=self.is_producer, is_consumer=self.is_consumer):
            self._confirm = save_confirm.SaveConfirmer(timeout_s=save_confirm.CONFIRM_TIMEOUT_S)

    def _release_pin(self, mm_hash: str) -> None:
        state = self._pins.pop(mm_hash, None)
        if state is None:
            return
        try:
            self._store.release(state.pin, staged_as=mm_hash)
        except STORE_ERRORS as exc:
            self._warn.warning(("release-pin", type(exc).__name__), "ectier: releasing the pin of %s failed (%s: %s)",
                               mm_hash, type(exc).__name__, exc)


    def has_cache_item(self, identifier: str) -> bool:
        """True iff the item is pinned in ectier for a load (see module docstring, step 2)."""
        hit = identifier in self._pins
        # vLLM asks only after its own encoder cache missed: it no longer holds the item (evicted
        # earlier in this step, or its whole cache reset by reset_encoder_cache, which reports nothing)
        self._local.discard(identifier)
        if self.is_consumer:  # a pure producer never loads: its lookups are no misses
            self._count_lookup(identifier, hit)
        return hit

    def _count_lookup(self, identifier: str, hit: bool) -> None:
        """Count ``lookups`` and ``hits``/``misses`` once per (request, item) until vLLM
        allocates the item for the request (``update_state_after_alloc``) or the request finishes;
        an item of no request ensure_cache_available saw is counted at every call."""
        asking = self._asking
        if asking is not None and any(f.identifier == identifier for f in asking.mm_features):
            counted = self._counted.setdefault(asking.request_id, set())
            if identifier in counted:
                return
            counted.add(identifier)
        self._count(lookups=1, **{"hits" if hit else "misses": 1})

    def ensure_cache_available(self, request: "Request", num_computed_tokens: int) -> bool:
        self._asking = request  # the request vLLM asks has_cache_item about next
        if not self.is_consumer or self._closed:
            return True
        if request.request_id in self._unavailable:
            # a worker load failed: vLLM 0.33 calls take_unavailable_requests before
            # update_connector_output in update_from_output, so the request is failed at the end of
            # this step; it must not run again meanwhile
            return False
        req_id = request.request_id
        settled = self._settled.get(req_id, ())
        pins, poisoned, local = self._pins, self._poisoned, self._local
        # daemon mode: every item of the request is asked about in one request (store.expect)
        self._store.expect([f.identifier for f in request.mm_features
                            if f.mm_position.offset + f.mm_position.length > num_computed_tokens
                            and f.identifier not in pins
                            and (f.identifier in poisoned or (f.identifier not in settled and f.identifier not in local))])
        ready = True
        for index, feature in enumerate(request.mm_features):
            pos = feature.mm_position
            if pos.offset + pos.length <= num_computed_tokens:
                continue  # already consumed by the prompt's computed part
            mm_hash = feature.identifier
            # poisoned first: an item settled for this request (refused, timed out, recomputed ahead
            # of its chunk) that another request's failed load poisoned since is neither encoded nor
            # loaded by vLLM, which counts it as present: it must be reloaded (or the request failed)
            if mm_hash in poisoned:
                repaired = self._repair(request, index, mm_hash)
                settled = self._settled.get(req_id, settled)
                if repaired is Promotion.WAIT:
                    ready = False
                elif repaired is not Promotion.READY:
                    self._unavailable.add(req_id)
                    return False
                continue
            if mm_hash in settled:
                continue
            state = pins.get(mm_hash)
            if state is not None:  # (its load may be this step's: a sharer fails with it, _add_sharers)
                self._join(state, request)
                continue
            if mm_hash in local:
                continue  # vLLM's own encoder cache holds it
            status = self._promotion(mm_hash, req_id)
            if status is Promotion.MISS:
                self._recompute.check(mm_hash, status, 0, 0)  # forgets its pending promotion
                continue
            if status is Promotion.WAIT and self._unanswered(mm_hash):
                ready = False  # daemon mode: no answer in yet, so nothing to estimate a load from
                continue
            rows = request.get_num_encoder_embeds(index)
            if self._recompute.check(mm_hash, status, self._item_nbytes(rows), rows):
                # loading would take longer than encoding: a miss (vLLM encodes it); the promotion
                # goes on, so a later request may find it in the host tier
                self._count(recompute_chosen=1)
                self._prefetching.pop(mm_hash, None)
                settled = self._settle(req_id, mm_hash)
                continue
            if status is Promotion.WAIT:
                ready = False
            elif status is Promotion.TIMEOUT:
                settled = self._settle(req_id, mm_hash)
            else:  # READY
                self._try_pin(request, index, mm_hash, rows)
                settled = self._settled.get(req_id, settled)  # a refused pin settles the item
        if not ready:
            self._count(deferrals=1)
        return ready

    def _settle(self, req_id: str, mm_hash: str) -> set[str]:
        """Mark ``mm_hash`` settled for request ``req_id`` (not looked up again for it); returns
        the request's settled set."""
        settled = self._settled.setdefault(req_id, set())
        settled.add(mm_hash)
        return settled

    def _promotion(self, mm_hash: str, req_id: str) -> "Promotion":
        """Where ``mm_hash`` stands (a :class:`Promotion`). In-process, ``TieredCache.prefetch`` towards the worker's device
        gives ``LoadHandle`` s; in daemon mode the store's handles are answered by the daemon's
        batched ``prefetch`` (one request per step, its reply never waited for beyond
        ``daemon_answer_wait_s``: unanswered is WAIT). ``None`` from the
        store's ``lookup``: pin at once (an in-process cache of a host tier only, where there
        is nothing to promote; a daemon without the op, whose ``get`` promotes synchronously).
        ``req_id``: the request asking, which waits for the promotion while it is WAIT."""
        pf = self._prefetching.get(mm_hash)
        if pf is None:
            try:
                # a local miss is final unless a remote tier may hold it: then the promotion
                # fetches it (in the cache's own threads) and the request waits until it landed or missed
                handles = self._store.lookup(mm_hash, self._target_device())
            except STORE_ERRORS as exc:
                self._miss("lookup", mm_hash, exc)
                return Promotion.MISS
            if handles is None:
                return Promotion.READY
            if handles is NOT_STORED:
                return Promotion.MISS
            pf = self._prefetching[mm_hash] = _Prefetch(handles, time.monotonic())
        pf.req_ids.add(req_id)
        handles = pf.handles
        if handles[0].done() if len(handles) == 1 else all(h.done() for h in handles):
            del self._prefetching[mm_hash]
            for h in handles:
                if not h.wait(0):  # done: False = gone meanwhile (evicted, deleted, failed copy)
                    if h.error is not None:
                        self._miss("prefetch", mm_hash, h.error)
                    return Promotion.MISS
            return Promotion.READY
        if time.monotonic() - pf.started > self.settings.load_timeout_s:
            del self._prefetching[mm_hash]
            self._count(rejected=1)
            self._miss(f"promotion still running after load_timeout_s={self.settings.load_timeout_s}", mm_hash)
            return Promotion.TIMEOUT
        return Promotion.WAIT

    def _unanswered(self, mm_hash: str) -> bool:
        """True while every handle of the item's promotion still waits for the daemon's first
        answer (``DaemonLoad.pending``; an in-process ``LoadHandle`` is never pending)."""
        pf = self._prefetching.get(mm_hash)
        if pf is None:
            return False
        handles = pf.handles
        if len(handles) == 1:
            return getattr(handles[0], "pending", False)
        return all(getattr(h, "pending", False) for h in handles)

    def _repair(self, request: "Request", index: int, mm_hash: str) -> "Promotion":
        """Load a poisoned item for ``request`` from the store: READY (pinned), WAIT (promotion
        in flight: defer the request), or MISS (give up)."""
        if mm_hash not in self._pins:
            status = self._promotion(mm_hash, request.request_id)
            if status is Promotion.WAIT:
                return status
            if status is Promotion.READY:
                self._try_pin(request, index, mm_hash, request.get_num_encoder_embeds(index))
        state = self._pins.get(mm_hash)
        if state is None:
            self._warn.warning(
                "gone", "ectier: %s failed to load earlier and is no longer in the store; failing request %s "
                "(retryable) until vLLM's encoder cache drops it", mm_hash, request.request_id,
            )
            return Promotion.MISS
        self._join(state, request)
        self._add_load(mm_hash, state, request.request_id)
        return Promotion.READY

    def _add_load(self, mm_hash: str, state: _PinState, req_id: str) -> None:
        item = self._to_load.get(mm_hash)
        if item is None:
            self._to_load[mm_hash] = LoadItem(mm_hash, tuple(state.pin.shape), state.pin.dtype, [req_id])
        elif req_id not in item.req_ids:
            item.req_ids.append(req_id)

    def _try_pin(self, request: "Request", index: int, mm_hash: str, rows: int) -> None:
        store = self._store
        try:
            pin = store.acquire(mm_hash, self._target_device())
        except STORE_ERRORS as exc:
            self._count(rejected=1)
            self._miss("pin", mm_hash, exc)
            return
        if pin is None:
            return  # a miss (never stored, evicted, or quarantined by its checksum)
        dtype = self._model_dtype_name
        shape = tuple(pin.shape)
        width_ok = len(shape) == 2 and (self._widths is None or shape[1] in self._widths)
        if len(shape) != 2 or shape[0] != rows or pin.dtype != dtype or not width_ok:
            self._count(rejected=1)
            want = f"({rows}, {'*' if self._widths is None else self._width_text()})"
            if len(shape) == 2 and not width_ok:
                self._warn.warning(
                    "namespace-clash", "ectier: namespace %r holds %s as %s %s, but this model's encoder outputs are "
                    "%s %s: probably a namespace clash (another model stores under the same "
                    "namespace; set ec_connector_extra_config.namespace to a name of its own); "
                    "not loaded, re-encoding",
                    self.settings.namespace, mm_hash, shape, pin.dtype, want, dtype,
                )
            else:
                self._warn.warning(
                    "shape-mismatch", "ectier: %s is stored as %s %s but request %s expects %s %s; re-encoding",
                    mm_hash, shape, pin.dtype, request.request_id, want, dtype,
                )
            self._settle(request.request_id, mm_hash)
            try:
                store.release(pin)
            except STORE_ERRORS as exc:
                self._warn.warning(("release", type(exc).__name__), "ectier: releasing %s failed (%s)", mm_hash, exc)
            return
        self._pins[mm_hash] = state = _PinState(pin, set())
        self._join(state, request)
        store.stage(mm_hash, pin)

    def update_state_after_alloc(self, request: "Request", index: int) -> None:
        mm_hash = request.mm_features[index].identifier
        if self._confirm is not None:  # a pure producer: every allocated item is encoded and saved
            self._confirm.expect(mm_hash, self._item_nbytes(request.get_num_encoder_embeds(index)))
        counted = self._counted.get(request.request_id)
        if counted is not None:  # placed: vLLM asks again only if it needs the item anew
            counted.discard(mm_hash)
        self._local.add(mm_hash)  # vLLM's encoder cache holds it once this step ran
        state = self._pins.get(mm_hash)
        if not self.is_consumer or state is None:
            return
        self._join(state, request)
        self._add_load(mm_hash, state, request.request_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        self._store.new_step()  # the daemon's answers of this step are spent
        # items vLLM's encoder-cache manager evicted this step: it will encode or load them again
        freed = scheduler_output.free_encoder_mm_hashes
        if freed:
            self._poisoned.difference_update(freed)
            self._local.difference_update(freed)
            # a request that needs such an item again (preempted, resumed from token 0) looks it
            # up afresh: settled meant "in vLLM's encoder cache, or refused", and it no longer is there
            for settled in self._settled.values():
                settled.difference_update(freed)
        self._add_sharers(scheduler_output)
        meta = ECTierConnectorMetadata(loads=list(self._to_load.values()))
        self._to_load = {}
        return meta

    def _join(self, state: _PinState, request: "Request") -> None:
        state.req_ids.add(request.request_id)
        self._requests[request.request_id] = request

    def _add_sharers(self, scheduler_output: SchedulerOutput) -> None:
        """Every request whose tokens of this step reach an item being loaded goes with its load:
        vLLM calls ``update_state_after_alloc`` for the first request that needs an item in a step
        only, and a failed load must fail each request that runs on its placeholder. A request
        whose chunk stops before the item (chunked prefill) does not: its later chunk gets the
        item again."""
        scheduled = scheduler_output.num_scheduled_tokens
        start = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        cached = scheduler_output.scheduled_cached_reqs
        start.update(zip(cached.req_ids, cached.num_computed_tokens))
        for mm_hash, item in self._to_load.items():
            state = self._pins.get(mm_hash)
            for req_id in state.req_ids if state is not None else ():
                if req_id in item.req_ids or not scheduled.get(req_id):
                    continue
                lo, request = start.get(req_id), self._requests.get(req_id)
                # (a position unknown: failed with it, never run on zeros)
                if request is None or lo is None or _reaches(request, mm_hash, lo, lo + scheduled[req_id]):
                    item.req_ids.append(req_id)

    def update_connector_output(self, connector_output: ECConnectorOutput) -> None:
        meta = connector_output.ec_connector_worker_meta
        if not isinstance(meta, ECTierWorkerMetadata):
            return
        if self._confirm is not None and (meta.saved or meta.save_failed):
            # the workers' reports do reach us on this runner: count theirs, stop confirming
            logger.info("ectier: the workers report their saves; the scheduler stops counting them itself")
            self._confirm = None
        if meta.failed:  # counted once per item here, not once per worker that failed it
            self._count(load_failures=len(meta.failed))
        for mm_hash in meta.loaded:
            if mm_hash not in meta.failed:
                state = self._pins.get(mm_hash)
                for req_id in state.req_ids if state is not None else ():
                    self._settle(req_id, mm_hash)
                self._release_pin(mm_hash)
        self._poisoned.difference_update(h for h in meta.loaded if h not in meta.failed)
        for mm_hash, req_ids in meta.failed.items():
            self._unavailable.update(req_ids)
            self._poisoned.add(mm_hash)
            self._release_pin(mm_hash)
        self._send_releases()
        if meta.stats:
            self._recompute.observe_report(meta.stats)  # takes out encoder_tokens/_seconds
            self._stats = merge_stats_data(self._stats, meta.stats)

    def _send_releases(self) -> None:
        """The pins released by this call go to the store in one request (daemon mode: sent
        without waiting for its reply)."""
        try:
            self._store.send_releases()
        except STORE_ERRORS as exc:
            self._warn.warning(("release-pin", type(exc).__name__), "ectier: releasing pins failed (%s: %s)",
                               type(exc).__name__, exc)

    def take_unavailable_requests(self) -> set[str]:
        out, self._unavailable = self._unavailable, set()
        return out

    def request_finished(self, request: "Request") -> tuple[bool, dict[str, Any] | None]:
        req_id = request.request_id
        self._settled.pop(req_id, None)
        self._counted.pop(req_id, None)
        self._requests.pop(req_id, None)
        if self._asking is request:
            self._asking = None
        for feature in request.mm_features:
            mm_hash = feature.identifier
            state = self._pins.get(mm_hash)
            if state is not None:
                state.req_ids.discard(req_id)
                if not state.req_ids and mm_hash not in self._to_load:
                    self._release_pin(mm_hash)
            pf = self._prefetching.get(mm_hash)
            if pf is not None:  # finished (aborted) while it waited for the item's promotion
                pf.req_ids.discard(req_id)
                if not pf.req_ids:  # nobody waits for it any more: a later request asks afresh
                    del self._prefetching[mm_hash]
                    self._recompute.forget(mm_hash)
        self._send_releases()
        return False, None

    def _confirm_saves(self) -> None:
        found = self._confirm.poll(self._store.stored_now, STORE_ERRORS)
        if found.saves:
            self._count(saves=found.saves, save_bytes=found.save_bytes)
        if found.failed:
            self._count(save_failures=len(found.failed))
            self._warn.warning(
                "save-unconfirmed", "ectier: %s (and %d more) not in the store %.0f s after it was encoded; "
                "counted as a failed save", found.failed[0], len(found.failed) - 1, save_confirm.CONFIRM_TIMEOUT_S)

    def _item_nbytes(self, rows: int) -> int:
        """Bytes of an encoder output of ``rows`` rows: rows x width x the model dtype's size
        (0 when the model has several widths or an unknown one)."""
        return rows * self._row_bytes


def _reaches(request: "Request", mm_hash: str, lo: int, hi: int) -> bool:
    """Whether tokens ``[lo, hi)`` of ``request`` overlap one of its items ``mm_hash``."""
    return any(f.identifier == mm_hash and f.mm_position.offset < hi
               and f.mm_position.offset + f.mm_position.length > lo for f in request.mm_features)
