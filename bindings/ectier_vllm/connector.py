"""``ECTierConnector``: vLLM 0.33's EC connector over ectier.

Enable with::

    --ec-transfer-config '{"ec_connector": "ECTierConnector",
                           "ec_role": "ec_producer" | "ec_consumer" | "ec_both",
                           "ec_connector_extra_config": {"mode": "daemon", "socket_path": "..."}}'

(the name is registered by ectier's vLLM plugin, :mod:`ectier_vllm.plugin`; without the installed
entry point add ``"ec_connector_module_path": "ectier_vllm.connector"``).

How a stored item reaches a consumer's ``encoder_cache`` (one step = one ``schedule()``):

1. ``ensure_cache_available(request)`` (scheduler, before the request is scheduled): for each of
   the request's items still ahead of ``num_computed_tokens`` that ectier holds, start a
   promotion towards the worker's device (in-process: ``TieredCache.prefetch(keys, device=)``,
   whose ``LoadHandle`` s the connector polls; NVMe → host, and host → GPU tier when the device is
   ``gpu.device``) and defer the request (``False``) until it is done, then *pin* the entry
   (``acquire``: a host-arena lease, checksum checked; an entry only the GPU tier holds is read
   from it onto the worker's device instead; daemon mode: a ``get`` lease, once the daemon's
   batched ``prefetch`` answered ready) and check its shape and dtype against what the
   request expects (``(num_embeds, width)`` of the model dtype; ``width``: the model's encoder
   output width, :func:`encoder_output_widths`; an entry of another width, i.e. another model's
   under the same namespace, is a miss with a warning naming the namespace, never loaded). A
   pinned entry can be neither evicted nor deleted until the worker has copied it. Anything wrong (vanished, corrupt, wrong
   shape/dtype, promotion missed or timed out, store error) releases the item: it counts as a miss
   and the encoder recomputes it.
2. ``has_cache_item(mm_hash)`` (after a local encoder-cache miss): True only for a pinned item,
   so vLLM never schedules a load this connector could not serve.
3. ``update_state_after_alloc`` / ``build_connector_meta``: the pinned items become
   :class:`~ectier_vllm.metadata.LoadItem` s of this step's metadata.
4. ``start_load_caches`` (worker): copies each item onto the worker's own device
   (``cuda:<index>``; CPU without CUDA), checks shape (width included) and dtype again, and stores it in
   ``encoder_cache``. A load that still fails (daemon restarted, ...) puts a zero placeholder of
   the pinned shape so the step does not crash, removes it right after the step's embeddings are
   gathered, and reports the requests: ``take_unavailable_requests`` fails them (retryable).
   vLLM's encoder-cache manager still lists such an item, so later requests get it reloaded by
   this connector from the store, or are failed (retryable) until vLLM evicts it.
5. ``update_connector_output``: the worker's report drops the pins and feeds the metrics.

Producer: ``save_caches`` stores each freshly encoded item without waiting for the copy. In-process,
``TieredCache.put`` returns a ``PutHandle`` after enqueueing: the cache's copy engine copies a CUDA
tensor into the GPU tier (on ``gpu.device``) or device-to-host into the pinned host arena, on its
own stream, which first waits for an event recorded on the current stream (after the encoder's
kernels). A save is reported only once ``handle.done()``; a handle with an ``error`` (the copy
failed: the item is then a miss and will be re-encoded) is a logged save failure. In daemon mode
(``DaemonClient.put`` copies to the CPU inline), the connector starts the device-to-host copy
itself on the current stream (pinned buffer, event, source tensor kept alive) and hands the host
copy to the daemon once the event has completed. Completions are reported in the worker
metadata; ``shutdown`` waits for all of them and flushes. With tensor (or pipeline, prefill
context) parallelism only the engine's lead worker saves and counts (:mod:`ectier_vllm.ranks`);
every worker loads. Where vLLM drops the workers' report (a producer on the V1 model runner), the
scheduler counts the saves it can see in the store (:mod:`ectier_vllm.confirm`).

This module is the only place where ectier errors become misses (each one logged; a kind of
per-item warning at most once per ``WARN_INTERVAL_S``, with a count of the ones left out).
"""

from __future__ import annotations

import enum

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from ectier.tensors import dtype_name
from vllm.distributed.ec_transfer.ec_connector.base import (
    ECConnectorBase,
    ECConnectorMetadata,
    ECConnectorRole,
)
from vllm.logger import init_logger
from vllm.v1.core.sched.output import SchedulerOutput
from vllm.v1.outputs import ECConnectorOutput

from ectier.errors import ConfigError, EctierError, StoreLockedError, StoreOpenError
from ectier.logutil import RateLimitedLogger

from . import confirm as save_confirm
from .config import ConnectorSettings, default_namespace, operator_key, settings_from_extra_config
from .gpubudget import check_gpu_arena_fits
from .metadata import ECTierConnectorMetadata, ECTierWorkerMetadata, LoadItem
from .metrics import ECTierConnectorStats, ECTierPromMetrics, merge_stats_data
from .ranks import is_lead_worker
from .store import DaemonStore, Pin, open_inprocess

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request

logger = init_logger(__name__)

#: errors that become misses: ectier's own, OS-level trouble talking to the daemon, and torch's
#: device errors while copying an entry (RuntimeError: torch.OutOfMemoryError, CUDA errors)
STORE_ERRORS = (EctierError, OSError, RuntimeError)
#: per-item warnings (misses, failed saves and loads) of one kind are written at most once per
#: this many seconds, with a count of the ones left out (a daemon that is down fails every item)
WARN_INTERVAL_S = 10.0


def encoder_output_widths(model_config: Any) -> frozenset[int] | None:
    """Widths of the tensors vLLM puts in ``encoder_cache`` for this model (``None``: unknown).

    Usually one: the language model's input-embedding size (``ModelConfig.get_inputs_embeds_size()``:
    the text hidden size, or a projection size), which is what vLLM itself assumes for ``mm_embeds``
    inputs and its CPU EC connector. Exception: "deepstack" vision encoders (Qwen3-VL, Qwen3-VL-MoE,
    Qwen3.5, ...: ``vision_config.deepstack_visual_indexes``) return the main embedding and one
    extra embedding per deepstack level concatenated, ``(N, vision_config.out_hidden_size * (1 +
    len(deepstack_visual_indexes)))``, which ``embed_input_ids`` splits again (2048 * 4 = 8192 for
    Qwen3-VL-30B-A3B); every visual item of such a model has that width. Qwen3-Omni keeps its
    vision config in ``thinker_config``: its images/videos have the deepstack width, its audio the
    input-embedding size, so both are accepted.
    """
    try:
        hf = model_config.hf_config
        base = int(model_config.get_inputs_embeds_size())
        vision = getattr(hf, "vision_config", None)
        if vision is not None and getattr(vision, "deepstack_visual_indexes", None) is not None:
            deep = int(vision.out_hidden_size) * (1 + len(vision.deepstack_visual_indexes))
            others = any(getattr(hf, k, None) is not None for k in ("audio_config", "thinker_config"))
            widths = {deep, base} if others else {deep}
        else:
            widths = {base}
            thinker = getattr(hf, "thinker_config", None)
            vision = getattr(thinker, "vision_config", None) if thinker is not None else None
            if vision is not None and getattr(vision, "deepstack_visual_indexes", None) is not None:
                widths.add(int(vision.out_hidden_size) * (1 + len(vision.deepstack_visual_indexes)))
    except Exception:  # noqa: BLE001 - an unusual config: fall back to the rows+dtype check
        return None
    return frozenset(widths) if all(w > 0 for w in widths) else None


class Promotion(enum.Enum):
    """Where an item stands for the scheduler (``ECTierConnector._promotion``)."""

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


@dataclass
class _PendingSave:
    """A save in flight: a ``TieredCache.put`` ``PutHandle`` (in-process), or, in daemon mode, our
    own D2H copy awaiting its event."""

    mm_hash: str
    nbytes: int
    handle: Any = None  # PutHandle (in-process); None once a daemon put returned
    host: torch.Tensor | None = None  # daemon mode: pinned host copy ...
    event: Any = None  # ... valid once this CUDA event completed
    source: torch.Tensor | None = None  # kept alive until the copy completed


class ECTierConnector(ECConnectorBase):
    """vLLM ECConnector backed by ectier (in-process :class:`TieredCache` or ``ectier serve``)."""

    def __init__(self, vllm_config: "VllmConfig", role: ECConnectorRole):
        super().__init__(vllm_config=vllm_config, role=role)
        model_config = vllm_config.model_config
        self._model_dtype: torch.dtype = model_config.dtype
        #: widths an encoder output of this model may have (None: unknown; rows and dtype checked)
        self._widths: frozenset[int] | None = encoder_output_widths(model_config)
        ec_config = vllm_config.ec_transfer_config
        self.settings: ConnectorSettings = settings_from_extra_config(
            ec_config.ec_connector_extra_config,
            default_ns=default_namespace(model_config.model, model_config.revision, model_config.dtype),
        )
        backend = vllm_config.parallel_config.distributed_executor_backend
        if self.settings.mode == "inprocess" and backend not in ("uni", "external_launcher"):
            # only these run the scheduler and the worker in one process; elsewhere each process
            # would get its own, different in-process store
            raise ConfigError(
                f"ec_connector_extra_config.mode: \"inprocess\" needs the scheduler and the worker in "
                f"one process (distributed_executor_backend \"uni\", i.e. one GPU per engine); this "
                f"engine uses {backend!r}: run `ectier serve` and set \"mode\": \"daemon\""
            )
        self._device: str | None = None
        if self.settings.mode == "daemon":
            self._store = DaemonStore(self.settings.socket_path, self.settings.namespace, self.settings.daemon_timeout_s)
        else:
            self._check_gpu_device()
            if role == ECConnectorRole.WORKER:
                self._check_gpu_budget(vllm_config)
            try:
                self._store = open_inprocess(self.settings.cache)
            except (ConfigError, StoreOpenError, StoreLockedError) as exc:
                # the machine refuses the tiers (gpu.* without CUDA; an nvme.path that cannot be
                # created or is in use): same error type, restated with the operator's key
                raise type(exc)(operator_key(str(exc), self.settings.config_path)) from exc
        self._stats: dict[str, Any] = {}
        # scheduler side
        self._pins: dict[str, _PinState] = {}
        self._prefetching: dict[str, _Prefetch] = {}
        self._to_load: dict[str, LoadItem] = {}
        self._unavailable: set[str] = set()
        # req_id -> mm_hashes settled for it: already placed in the worker's encoder_cache, or
        # refused (wrong shape/dtype, promotion timed out): not looked up again in later steps
        # (e.g. the next chunks of a chunked prefill)
        self._settled: dict[str, set[str]] = {}
        # mm_hashes whose load failed at a worker after vLLM's encoder-cache manager had counted
        # them as present: until the manager evicts them (free_encoder_mm_hashes) vLLM would
        # neither encode nor load them again, so this connector reloads them from the store itself,
        # or fails the requests that need them (never a worker crash)
        self._poisoned: set[str] = set()
        # producer on the V1 model runner: the scheduler counts the saves (see confirm.py)
        self._confirm: save_confirm.SaveConfirmer | None = None
        if role == ECConnectorRole.SCHEDULER and not save_confirm.reports_reach_scheduler(
                vllm_config, is_producer=self.is_producer, is_consumer=self.is_consumer):
            self._confirm = save_confirm.SaveConfirmer(timeout_s=save_confirm.CONFIRM_TIMEOUT_S)
        # worker side; only the lead worker (TP rank 0, first PP stage, PCP rank 0) saves and counts
        self._lead = role != ECConnectorRole.WORKER or is_lead_worker()
        self._pending_saves: list[_PendingSave] = []
        self._saved: list[str] = []
        self._save_failed: list[str] = []
        self._loaded: list[str] = []
        self._failed: dict[str, list[str]] = {}
        self._placeholders: list[tuple[dict, str]] = []
        self._closed = False
        self._warn = RateLimitedLogger(logger, WARN_INTERVAL_S)
        logger.info(
            "ECTierConnector (%s, %s): namespace %r, mode %s, encoder output width %s",
            role.name.lower(), ec_config.ec_role, self.settings.namespace, self.settings.mode,
            self._width_text(),
        )
        if self._widths is None:
            logger.warning(
                "ectier: cannot determine the encoder output width of %s; stored entries are "
                "checked for rows and dtype only (a namespace clash with another model of the same "
                "dtype would not be detected)", model_config.model,
            )

    # ================================================================== helpers
    def _count(self, **kw: float) -> None:
        for k, v in kw.items():
            self._stats[k] = self._stats.get(k, 0) + v

    def _width_text(self) -> str:
        return "unknown" if self._widths is None else " or ".join(str(w) for w in sorted(self._widths))

    def _miss(self, what: str, mm_hash: str, exc: BaseException | None = None) -> None:
        if exc is None:
            self._warn.warning(("miss", what), "ectier: %s for %s; treated as a miss", what, mm_hash)
        else:
            self._warn.warning(("miss", what, type(exc).__name__), "ectier: %s for %s failed (%s: %s); treated as a miss",
                               what, mm_hash, type(exc).__name__, exc)

    def _release_pin(self, mm_hash: str) -> None:
        state = self._pins.pop(mm_hash, None)
        if state is None:
            return
        self._store.unstage(mm_hash)
        try:
            self._store.release(state.pin)
        except STORE_ERRORS as exc:
            self._warn.warning(("release-pin", type(exc).__name__), "ectier: releasing the pin of %s failed (%s: %s)",
                               mm_hash, type(exc).__name__, exc)

    def _check_gpu_device(self) -> None:
        """A GPU tier must sit on the worker's own device: ``put`` refuses tensors of another device
        and ``prefetch`` would never promote into it."""
        gpu = self.settings.cache.gpu
        device = self.worker_device()
        if gpu.enabled and device.startswith("cuda") and device != gpu.device:
            raise ConfigError(
                f"ec_connector_extra_config.gpu.device: is {gpu.device!r}, but this engine's worker "
                f"runs on {device!r}; set gpu.device to the worker's device"
            )

    def _check_gpu_budget(self, vllm_config: "VllmConfig") -> None:
        """The worker's connector opens the store before vLLM's memory snapshot: a GPU-tier arena
        must fit beside ``gpu_memory_utilization`` (:mod:`ectier_vllm.gpubudget`)."""
        gpu = self.settings.cache.gpu
        if gpu.enabled:
            check_gpu_arena_fits(gpu.capacity_bytes, gpu.device, vllm_config.cache_config.gpu_memory_utilization,
                                 self.settings.config_path)

    def _target_device(self) -> str:
        """Where the scheduler promotes and pins for: in-process mode, the worker's device (same
        process); daemon mode ignores it (and the scheduler process must not touch CUDA)."""
        return self.worker_device() if self._store.mode == "inprocess" else "cpu"

    def worker_device(self) -> str:
        """This worker's device: ``cuda:<current index>`` under CUDA, else ``cpu``; never bare ``cuda``."""
        if self._device is None:
            from vllm.platforms import current_platform

            if current_platform.is_cuda_alike() and torch.cuda.is_available():
                self._device = f"cuda:{torch.cuda.current_device()}"
            else:
                self._device = "cpu"
        return self._device

    # ================================================================== scheduler side
    def has_cache_item(self, identifier: str) -> bool:
        """True iff the item is pinned in ectier for a load (see module docstring, step 2)."""
        self._count(lookups=1)
        if identifier in self._pins:
            self._count(hits=1)
            return True
        self._count(misses=1)
        return False

    def ensure_cache_available(self, request: "Request", num_computed_tokens: int) -> bool:
        if not self.is_consumer or self._closed:
            return True
        if request.request_id in self._unavailable:
            # a worker load failed: vLLM 0.33 calls take_unavailable_requests before
            # update_connector_output in update_from_output, so the request is failed at the end of
            # this step; it must not run again meanwhile
            return False
        settled = self._settled.get(request.request_id, ())
        # daemon mode: every item of the request is asked about in one round trip (store.expect)
        self._store.expect([f.identifier for f in request.mm_features
                            if f.mm_position.offset + f.mm_position.length > num_computed_tokens
                            and f.identifier not in settled and f.identifier not in self._pins])
        ready = True
        for index, feature in enumerate(request.mm_features):
            pos = feature.mm_position
            if pos.offset + pos.length <= num_computed_tokens:
                continue  # already consumed by the prompt's computed part
            mm_hash = feature.identifier
            if mm_hash in self._settled.get(request.request_id, ()):
                continue
            if mm_hash in self._poisoned:
                repaired = self._repair(request, index, mm_hash)
                if repaired is Promotion.WAIT:
                    ready = False
                elif repaired is not Promotion.READY:
                    self._unavailable.add(request.request_id)
                    return False
                continue
            state = self._pins.get(mm_hash)
            if state is not None:
                state.req_ids.add(request.request_id)
                continue
            status = self._promotion(mm_hash)
            if status is Promotion.WAIT:
                ready = False
            elif status is Promotion.TIMEOUT:
                self._settled.setdefault(request.request_id, set()).add(mm_hash)
            elif status is Promotion.READY:
                self._try_pin(request, index, mm_hash)
        if not ready:
            self._count(deferrals=1)
        return ready

    def _promotion(self, mm_hash: str) -> "Promotion":
        """Where ``mm_hash`` stands (a :class:`Promotion`). In-process, ``TieredCache.prefetch`` towards the worker's device
        gives ``LoadHandle`` s; in daemon mode the store's handles are answered by the daemon's
        batched ``prefetch`` (one round trip per step, no I/O waited for); a daemon without it
        (``None``): ``acquire`` promotes there, synchronously."""
        pf = self._prefetching.get(mm_hash)
        if pf is None:
            try:
                if not self._store.contains(mm_hash):
                    return Promotion.MISS
                handles = self._store.prefetch([mm_hash], self._target_device())
            except STORE_ERRORS as exc:
                self._miss("lookup", mm_hash, exc)
                return Promotion.MISS
            if handles is None:
                return Promotion.READY
            pf = self._prefetching[mm_hash] = _Prefetch(handles, time.monotonic())
        if all(h.done() for h in pf.handles):
            del self._prefetching[mm_hash]
            for h in pf.handles:
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

    def _repair(self, request: "Request", index: int, mm_hash: str) -> "Promotion":
        """Load a poisoned item for ``request`` from the store: READY (pinned), WAIT (promotion
        in flight: defer the request), or MISS (give up)."""
        if mm_hash not in self._pins:
            status = self._promotion(mm_hash)
            if status is Promotion.WAIT:
                return status
            if status is Promotion.READY:
                self._try_pin(request, index, mm_hash)
        state = self._pins.get(mm_hash)
        if state is None:
            self._warn.warning(
                "gone", "ectier: %s failed to load earlier and is no longer in the store; failing request %s "
                "(retryable) until vLLM's encoder cache drops it", mm_hash, request.request_id,
            )
            return Promotion.MISS
        state.req_ids.add(request.request_id)
        self._add_load(mm_hash, state, request.request_id)
        return Promotion.READY

    def _add_load(self, mm_hash: str, state: _PinState, req_id: str) -> None:
        item = self._to_load.get(mm_hash)
        if item is None:
            self._to_load[mm_hash] = LoadItem(mm_hash, tuple(state.pin.shape), state.pin.dtype, [req_id])
        elif req_id not in item.req_ids:
            item.req_ids.append(req_id)

    def _try_pin(self, request: "Request", index: int, mm_hash: str) -> None:
        try:
            pin = self._store.acquire(mm_hash, self._target_device())
        except STORE_ERRORS as exc:
            self._count(rejected=1)
            self._miss("pin", mm_hash, exc)
            return
        if pin is None:
            return  # a miss (never stored, evicted, or quarantined by its checksum)
        rows, dtype = request.get_num_encoder_embeds(index), dtype_name(self._model_dtype)
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
            self._settled.setdefault(request.request_id, set()).add(mm_hash)
            try:
                self._store.release(pin)
            except STORE_ERRORS as exc:
                self._warn.warning(("release", type(exc).__name__), "ectier: releasing %s failed (%s)", mm_hash, exc)
            return
        self._pins[mm_hash] = _PinState(pin, {request.request_id})
        self._store.stage(mm_hash, pin)

    def update_state_after_alloc(self, request: "Request", index: int) -> None:
        mm_hash = request.mm_features[index].identifier
        if self._confirm is not None:  # a pure producer: every allocated item is encoded and saved
            self._confirm.expect(mm_hash, self._item_nbytes(request.get_num_encoder_embeds(index)))
        state = self._pins.get(mm_hash)
        if not self.is_consumer or state is None:
            return
        state.req_ids.add(request.request_id)
        self._add_load(mm_hash, state, request.request_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        self._store.new_step()  # the daemon's answers of this step are spent
        # items vLLM's encoder-cache manager evicted this step: it will encode or load them again
        self._poisoned.difference_update(scheduler_output.free_encoder_mm_hashes)
        meta = ECTierConnectorMetadata(loads=list(self._to_load.values()))
        self._to_load = {}
        return meta

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
                    self._settled.setdefault(req_id, set()).add(mm_hash)
                self._release_pin(mm_hash)
        self._poisoned.difference_update(h for h in meta.loaded if h not in meta.failed)
        for mm_hash, req_ids in meta.failed.items():
            self._unavailable.update(req_ids)
            self._poisoned.add(mm_hash)
            self._release_pin(mm_hash)
        if meta.stats:
            self._stats = merge_stats_data(self._stats, meta.stats)

    def take_unavailable_requests(self) -> set[str]:
        out, self._unavailable = self._unavailable, set()
        return out

    def request_finished(self, request: "Request") -> tuple[bool, dict[str, Any] | None]:
        self._settled.pop(request.request_id, None)
        for feature in request.mm_features:
            state = self._pins.get(feature.identifier)
            if state is not None:
                state.req_ids.discard(request.request_id)
                if not state.req_ids and feature.identifier not in self._to_load:
                    self._release_pin(feature.identifier)
        return False, None

    # ================================================================== worker side
    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any) -> None:
        if not self.is_producer or self._closed or not self._lead:
            return  # another rank of this TP group (PP stage, PCP group) saves the same output
        tensor = encoder_cache.get(mm_hash)
        if tensor is None:
            return
        nbytes = tensor.numel() * tensor.element_size()
        try:
            if tensor.device.type == "cuda" and not self._store.async_put:  # daemon mode
                self._pending_saves.append(_start_d2h(mm_hash, tensor, nbytes))
            else:
                handle = self._store.put(mm_hash, tensor)
                self._pending_saves.append(_PendingSave(mm_hash, nbytes, handle=handle))
        except STORE_ERRORS as exc:  # e.g. no room for a pinned staging copy (OutOfMemoryError)
            self._save_failure(mm_hash, exc)
        self._poll_saves(wait=False)

    def _save_failure(self, mm_hash: str, exc: BaseException) -> None:
        self._count(save_failures=1)
        self._save_failed.append(mm_hash)
        self._warn.warning(("save", type(exc).__name__), "ectier: saving %s failed (%s: %s); it is not shared",
                           mm_hash, type(exc).__name__, exc)

    def start_save_caches(self, **kwargs: Any) -> None:
        self._poll_saves(wait=False)

    def _poll_saves(self, *, wait: bool) -> None:
        still: list[_PendingSave] = []
        for ps in self._pending_saves:
            try:
                if ps.event is not None:  # our own D2H copy (daemon mode)
                    if wait:
                        ps.event.synchronize()
                    elif not ps.event.query():
                        still.append(ps)
                        continue
                    handle = self._store.put(ps.mm_hash, ps.host)
                    ps.event, ps.source, ps.handle = None, None, handle
                h = ps.handle
                if h is not None:
                    if wait:
                        h.wait()
                    elif not h.done():
                        still.append(ps)
                        continue
                    if not h.wait(0):  # the copy failed (reported, not raised, by ectier)
                        self._save_failure(ps.mm_hash, h.error or EctierError("put reported failure"))
                        continue
            except STORE_ERRORS as exc:
                self._save_failure(ps.mm_hash, exc)
                continue
            self._count(saves=1, save_bytes=ps.nbytes)
            self._saved.append(ps.mm_hash)
        self._pending_saves = still

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, ECTierConnectorMetadata):
            return
        device = self.worker_device()
        for item in meta.loads:
            if item.mm_hash in encoder_cache:
                self._loaded.append(item.mm_hash)
                continue
            t0 = time.perf_counter()
            problem = None
            tensor = None
            try:
                tensor = self._store.get(item.mm_hash, device)
            except STORE_ERRORS as exc:
                problem = f"{type(exc).__name__}: {exc}"
            if problem is None:
                if tensor is None:
                    problem = "no longer stored"
                elif (
                    tuple(tensor.shape) != tuple(item.shape)
                    or dtype_name(tensor.dtype) != item.dtype
                    or (self._widths is not None and tensor.shape[-1] not in self._widths)
                ):
                    want = f"{item.shape} {item.dtype}" + (f", width {self._width_text()}" if self._widths else "")
                    problem = f"read {tuple(tensor.shape)} {dtype_name(tensor.dtype)}, expected {want}"
            if problem is not None:
                self._warn.warning(
                    "load", "ectier: loading %s failed (%s); failing requests %s (retryable)",
                    item.mm_hash, problem, item.req_ids,
                )
                self._failed[item.mm_hash] = list(item.req_ids)  # counted by the scheduler, once
                # a placeholder keeps this step from crashing in the embedding gather; it is
                # removed in build_connector_worker_meta, right after the gather
                from ectier.tensors import torch_dtype

                encoder_cache[item.mm_hash] = torch.zeros(item.shape, dtype=torch_dtype(item.dtype), device=device)
                self._placeholders.append((encoder_cache, item.mm_hash))
                continue
            encoder_cache[item.mm_hash] = tensor
            self._loaded.append(item.mm_hash)
            if self._lead:  # every rank loads; one counts
                seconds = time.perf_counter() - t0
                self._count(loads=1, load_bytes=tensor.numel() * tensor.element_size())
                self._stats.setdefault("load_seconds", []).append(seconds)

    def build_connector_worker_meta(self) -> ECTierWorkerMetadata | None:
        for cache, mm_hash in self._placeholders:
            cache.pop(mm_hash, None)
        self._placeholders = []
        self._poll_saves(wait=False)
        meta = ECTierWorkerMetadata(
            loaded=self._loaded, failed=self._failed, saved=self._saved,
            save_failed=self._save_failed, stats=self._stats,
        )
        self._loaded, self._failed, self._saved, self._save_failed, self._stats = [], {}, [], [], {}
        if not (meta.loaded or meta.failed or meta.saved or meta.save_failed or meta.stats):
            return None
        return meta

    # ================================================================== both
    def get_ec_connector_stats(self) -> ECTierConnectorStats | None:
        if self.role != ECConnectorRole.SCHEDULER:
            return None  # worker counters travel in the worker metadata
        if self._confirm is not None and len(self._confirm):
            self._confirm_saves()
        if not self._stats:
            return None
        stats = ECTierConnectorStats(data=self._stats)
        self._stats = {}
        return stats

    def _confirm_saves(self) -> None:
        found = self._confirm.poll(self._store.contains, STORE_ERRORS)
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
        if self._widths is None or len(self._widths) != 1:
            return 0
        return rows * next(iter(self._widths)) * self._model_dtype.itemsize

    @classmethod
    def build_ec_connector_stats(cls, data: dict[str, Any] | None = None) -> ECTierConnectorStats | None:
        return ECTierConnectorStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues) -> ECTierPromMetrics:
        return ECTierPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            self._poll_saves(wait=True)
            for mm_hash in list(self._pins):
                self._release_pin(mm_hash)
            self._store.flush()
        except STORE_ERRORS as exc:
            logger.warning("ectier: shutdown flush failed (%s: %s)", type(exc).__name__, exc)
        finally:
            try:
                self._store.close()
            except STORE_ERRORS as exc:
                logger.warning("ectier: closing the store failed (%s: %s)", type(exc).__name__, exc)


def _start_d2h(mm_hash: str, tensor: torch.Tensor, nbytes: int) -> _PendingSave:
    """Daemon mode (``DaemonClient.put`` is synchronous): D2H on the current stream into pinned memory.

    The copy is queued after the encoder's kernels on the same stream (rule 1 holds without a side
    stream); ``source`` keeps the (possibly view-of-a-batch) tensor alive until the event completes
    (rule 2); the host copy is read only after the event completed (rule 3).
    """
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(tensor.device))
    return _PendingSave(mm_hash, nbytes, host=host, event=event, source=tensor)
