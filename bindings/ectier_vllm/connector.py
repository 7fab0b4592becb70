"""``ECTierConnector``: vLLM 0.33's EC connector over ectier.

Enable with::

    --ec-transfer-config '{"ec_connector": "ECTierConnector",
                           "ec_role": "ec_producer" | "ec_consumer" | "ec_both",
                           "ec_connector_extra_config": {"mode": "daemon", "socket_path": "..."}}'

(the name is registered by ectier's vLLM plugin, :mod:`ectier_vllm.plugin`; without the installed
entry point add ``"ec_connector_module_path": "ectier_vllm.connector"``).

How a stored item reaches a consumer's ``encoder_cache`` (one step = one ``schedule()``):

1. ``ensure_cache_available(request)`` (scheduler, before the request is scheduled): for each of
   the request's items still ahead of ``num_computed_tokens`` that vLLM's own encoder cache does
   not hold (allocated and not yet reported freed) and ectier does, start a promotion towards the worker's device (in-process: ``TieredCache.prefetch(keys, device=)``,
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

Producer: ``save_caches`` stores each freshly encoded item without waiting for a copy or the store
(:mod:`ectier_vllm.saves`): in-process, a CUDA tensor goes to ``TieredCache.put``, which only
enqueues its copy on the cache's copy engine (after an event on the current stream); everything
else (a CPU tensor, any daemon-mode save) goes to a background put thread through a bounded queue;
a full queue or a failed put drops the save (a logged save failure). A save is reported only once
the store holds it. Completions are reported in the worker
metadata; ``shutdown`` waits for all of them and flushes. With tensor (or pipeline, prefill
context) parallelism only the engine's lead worker saves and counts (:mod:`ectier_vllm.ranks`);
every worker loads. Where vLLM drops the workers' report (a producer on the V1 model runner), the
scheduler counts the saves it can see in the store (:mod:`ectier_vllm.confirm`).

The connector (this module, :mod:`.scheduler`, :mod:`.worker`) is the only place where ectier errors become misses (each one logged; a kind of
per-item warning at most once per ``WARN_INTERVAL_S``, with a count of the ones left out).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase, ECConnectorRole

from ectier.errors import ConfigError, StoreLockedError, StoreOpenError
from ectier.logutil import RateLimitedLogger
from ectier.tensors import dtype_name

from .common import (STORE_ERRORS, WARN_INTERVAL_S, ectier_variables_ignored, encoder_output_widths, logger,
                     route_core_logs)
from .config import PREFIX, ConnectorSettings, default_namespace, operator_key, settings_from_extra_config
from .gpubudget import check_gpu_arena_fits
from .metrics import ECTierConnectorStats, ECTierPromMetrics
from .scheduler import Promotion, SchedulerSide
from .daemon_store import DaemonStore
from .store import InProcessStore, open_inprocess
from .worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig

__all__ = ["ECTierConnector", "Promotion", "STORE_ERRORS", "WARN_INTERVAL_S", "encoder_output_widths", "logger"]


class ECTierConnector(SchedulerSide, WorkerSide, ECConnectorBase):
    """vLLM ECConnector backed by ectier (in-process :class:`TieredCache` or ``ectier serve``)."""

    def __init__(self, vllm_config: "VllmConfig", role: ECConnectorRole):
        super().__init__(vllm_config=vllm_config, role=role)
        route_core_logs()
        model_config = vllm_config.model_config
        self._model_dtype: torch.dtype = model_config.dtype
        self._model_dtype_name = dtype_name(self._model_dtype)
        #: widths an encoder output of this model may have (None: unknown; rows and dtype checked)
        self._widths: frozenset[int] | None = encoder_output_widths(model_config)
        ec_config = vllm_config.ec_transfer_config
        self.settings: ConnectorSettings = settings_from_extra_config(
            ec_config.ec_connector_extra_config,
            default_ns=default_namespace(model_config.model, model_config.revision, model_config.dtype),
        )
        backend = vllm_config.parallel_config.distributed_executor_backend
        if self.is_consumer:  # (a pure producer never loads: its ranks' answers cannot differ)
            _refuse_ranks_with_own_schedulers(backend, vllm_config.parallel_config.world_size)
        if self.settings.mode == "inprocess" and backend not in ("uni", "external_launcher"):
            # only these run the scheduler and the worker in one process; elsewhere each process
            # would get its own, different in-process store
            raise ConfigError(
                f"ec_connector_extra_config.mode: \"inprocess\" (the default) needs the scheduler and the "
                f"worker in one process (distributed_executor_backend \"uni\", i.e. one GPU per engine); "
                f"this engine uses {backend!r}: run `ectier serve` and set \"mode\": \"daemon\", or run "
                f"the engine in one process (on a CPU-only engine: VLLM_ENABLE_V1_MULTIPROCESSING=0)"
            )
        self._device: str | None = None
        self._store_obj: DaemonStore | InProcessStore | None = None
        if self.settings.mode == "daemon":
            self._store_obj = DaemonStore(self.settings.socket_path, self.settings.namespace,
                                          self.settings.daemon_timeout_s, self.settings.daemon_answer_wait_s)
        else:
            self._check_gpu_device()
            if role != ECConnectorRole.WORKER or not self.settings.cache.gpu.enabled:
                self._open_store()
            # else: a worker with a GPU tier opens the store at first use. vLLM builds it before
            # its memory profiling; the scheduler's connector, built after vLLM has allocated its
            # budget (same process), opens the shared store then, so the arena is sized from
            # what vLLM leaves (gpubudget.py)
        self._stats: dict[str, Any] = {}
        self._init_scheduler_side(vllm_config, role)
        self._init_worker_side(role)
        self._closed = False
        self._warn = RateLimitedLogger(logger, WARN_INTERVAL_S)
        logger.info(
            "ECTierConnector (%s, %s): namespace %r, mode %s, encoder output width %s",
            role.name.lower(), ec_config.ec_role, self.settings.namespace, self.settings.mode,
            self._width_text(),
        )
        ignored = ectier_variables_ignored()
        if ignored:
            logger.warning("ectier: %s set in the environment but not read by the vLLM connector: its settings "
                           "come from ec_connector_extra_config (or the file its config_path names)",
                           ", ".join(ignored))
        if self._widths is None:
            logger.warning(
                "ectier: cannot determine the encoder output width of %s; stored entries are "
                "checked for rows and dtype only (a namespace clash with another model of the same "
                "dtype would not be detected)", model_config.model,
            )

    # ================================================================== helpers
    def _count(self, **kw: float) -> None:
        self._report = True  # the worker side reports its counters in the next worker metadata
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

    @property
    def _store(self) -> "DaemonStore | InProcessStore":
        """The store (opened here at first use by a worker with a GPU tier, see ``__init__``)."""
        if self._store_obj is None:
            self._open_store()
        return self._store_obj

    def _open_store(self) -> None:
        """Open (or join) this process's in-process store. The GPU tier's arena, when this call
        creates it, must fit in the device memory vLLM left (:mod:`ectier_vllm.gpubudget`)."""
        gpu = self.settings.cache.gpu

        def check_budget() -> None:
            if gpu.enabled:
                check_gpu_arena_fits(gpu.capacity_bytes, gpu.device, self.settings.config_path)

        try:
            self._store_obj = open_inprocess(self.settings.cache, before_create=check_budget)
        except (StoreOpenError, StoreLockedError) as exc:
            raise type(exc)(operator_key(str(exc), self.settings.config_path)) from exc
        except ConfigError as exc:
            if str(exc).startswith(PREFIX):  # the budget check names the operator's key already
                raise
            # the machine refuses the tiers (gpu.* without CUDA; an nvme.path that cannot be
            # created or is in use): same error type, restated with the operator's key
            raise ConfigError(operator_key(str(exc), self.settings.config_path)) from exc

    def _target_device(self) -> str:
        """Where the scheduler promotes and pins for: in-process mode, the worker's device (same
        process); daemon mode ignores it (and the scheduler process must not touch CUDA)."""
        return self.worker_device() if self.settings.mode == "inprocess" else "cpu"

    def worker_device(self) -> str:
        """This worker's device: ``cuda:<current index>`` under CUDA, else ``cpu``; never bare ``cuda``."""
        if self._device is None:
            from vllm.platforms import current_platform

            if current_platform.is_cuda_alike() and torch.cuda.is_available():
                self._device = f"cuda:{torch.cuda.current_device()}"
            else:
                self._device = "cpu"
        return self._device

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
        self._saving = False  # save_caches from now on: nothing
        store = self._store_obj
        try:
            self.saves.close()  # every save submitted is finished (stored or failed) ...
            self._poll_saves()  # ... and counted
            for mm_hash in list(self._pins):
                self._release_pin(mm_hash)
            if store is not None:
                store.flush()
        except STORE_ERRORS as exc:
            logger.warning("ectier: shutdown flush failed (%s: %s)", type(exc).__name__, exc)
        finally:
            try:
                if store is not None:
                    store.close()
            except STORE_ERRORS as exc:
                logger.warning("ectier: closing the store failed (%s: %s)", type(exc).__name__, exc)


def _refuse_ranks_with_own_schedulers(backend: Any, world_size: int) -> None:
    """With ``external_launcher`` every rank is a process of its own, with a scheduler of its own,
    and vLLM needs every rank's scheduler to take the same decisions. Over more than one rank a
    consumer's connector cannot promise that: its answers (found, or encode) depend on what each
    rank's store held and on when each rank's daemon answer came in; only the lead worker saves.
    One rank's scheduler would then load an item that another's encodes (collectives hang or mix
    data).

    Raises:
        ConfigError: ``external_launcher`` with ``parallel_config.world_size`` > 1.
    """
    if backend == "external_launcher" and world_size > 1:
        raise ConfigError(
            f"ECTierConnector: distributed_executor_backend \"external_launcher\" with a world size of "
            f"{world_size} (tensor x pipeline parallel) is not supported: each rank runs its own scheduler, "
            f"and the connector's answers (load or encode) could differ between ranks. Run the engine with "
            f"vLLM's own executor (\"mp\" or \"ray\") and \"mode\": \"daemon\", or with one rank per engine"
        )
