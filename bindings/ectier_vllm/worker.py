"""The worker side of :class:`~ectier_vllm.connector.ECTierConnector` (each model-runner process).

``save_caches`` stores freshly encoded items without waiting for their copies (the lead worker
only, :mod:`ectier_vllm.ranks`); ``start_load_caches`` places the items the scheduler pinned in
``encoder_cache``; ``build_connector_worker_meta`` reports both to the scheduler.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from ectier.tensors import dtype_name
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

from .common import STORE_ERRORS
from .metadata import ECTierConnectorMetadata, ECTierWorkerMetadata
from .ranks import is_lead_worker
from .recompute import EncoderStepTimer
from .saves import SaveQueue, SaveQueueFullError


class WorkerSide:
    """Worker-side methods of the connector (a mixin: the state is set up in
    ``ECTierConnector.__init__``, :meth:`_init_worker_side`)."""

    def _init_worker_side(self, role: ECConnectorRole) -> None:
        # worker side; only the lead worker (TP rank 0, first PP stage, PCP rank 0) saves and counts
        self._lead = role != ECConnectorRole.WORKER or is_lead_worker()
        #: saves off the model step (:mod:`ectier_vllm.saves`)
        self.saves = SaveQueue(lambda: self._store, depth=self.settings.save_queue_depth)
        #: this connector saves (a producer's lead worker; False again once shut down)
        self._saving = self.is_producer and self._lead
        self._saved: list[str] = []
        self._save_failed: list[str] = []
        self._loaded: list[str] = []
        self._failed: dict[str, list[str]] = {}
        self._placeholders: list[tuple[dict, str]] = []
        #: something may be due in this step's report (a save submitted or in flight, a load, a
        #: counter, a placeholder, an encoder timing); with it False and :attr:`_saves_done`
        #: empty, the completion calls return after two attribute reads
        self._report = False
        #: the save queue's deque of finished saves (the put thread appends to it)
        self._saves_done = self.saves.done
        # the producer's encoder time per step, for the scheduler's load-or-recompute choice: an
        # ec_both engine only, since a step opens in start_load_caches, which vLLM's model runners
        # call on consumers only (a pure producer's timer never timed a step, yet cost every
        # save_caches a mark and two clock reads)
        settings = self.settings
        self._encoder_timer = EncoderStepTimer() if (
            role == ECConnectorRole.WORKER and self.is_producer and self.is_consumer and self._lead
            and settings.recompute and settings.encoder_seconds_per_token is None) else None

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any) -> None:
        """Hand ``encoder_cache[mm_hash]`` to the :class:`~ectier_vllm.saves.SaveQueue`: never
        waits for a copy or the store (a full queue or a failing store drops the save, counted).
        The finished saves are reported by a later completion call (``build_connector_worker_meta``,
        at the end of each step), not here: this runs once per item on the model step."""
        if not self._saving:
            return  # not a producer, shut down, or another rank of this TP group (PP stage, PCP group) saves
        tensor = encoder_cache.get(mm_hash)
        if tensor is None:
            return
        self._report = True
        timer = self._encoder_timer
        if timer is not None:
            timer.item(tensor.shape[0], _mark(tensor))
            t0 = time.perf_counter()
        try:
            self.saves.submit(mm_hash, tensor)
        except STORE_ERRORS as exc:  # the queue is full, or the in-process put refused it
            self._save_failure(mm_hash, exc)
        if timer is not None:
            timer.saved(time.perf_counter() - t0)

    def _save_failure(self, mm_hash: str, exc: BaseException) -> None:
        self._count(save_failures=1)
        self._save_failed.append(mm_hash)
        kind = "save-dropped" if isinstance(exc, SaveQueueFullError) else ("save", type(exc).__name__)
        self._warn.warning(kind, "ectier: saving %s failed (%s: %s); it is not shared",
                           mm_hash, type(exc).__name__, exc)

    def start_save_caches(self, **kwargs: Any) -> None:
        """Nothing: vLLM calls this at the start of each step, and the saves finished by then are
        taken by the same step's ``build_connector_worker_meta`` (the only call that reports
        them), so a look here would only cost the model step a cold call's time."""
        return None

    def _poll_saves(self) -> None:
        """Report the saves the queue finished since the last poll (never blocks; with nothing
        finished, one call that returns at once)."""
        for result in self.saves.finished():
            if result.error is not None:
                self._save_failure(result.mm_hash, result.error)
            else:
                self._count(saves=1, save_bytes=result.nbytes)  # (sets _report)
                self._saved.append(result.mm_hash)

    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        self._load_caches(encoder_cache)
        if self._encoder_timer is not None:  # the step's encoder runs next
            self._report = True
            self._encoder_timer.begin(_mark(None if self.worker_device() == "cpu" else torch.device(self.worker_device())))

    def _load_caches(self, encoder_cache: dict[str, torch.Tensor]) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, ECTierConnectorMetadata):
            return
        device = self.worker_device()
        if meta.loads:
            self._report = True
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
        if not (self._report or self._saves_done):
            return None  # the common step: nothing saved, loaded or counted since the last report
        if self._placeholders:
            for cache, mm_hash in self._placeholders:
                cache.pop(mm_hash, None)
            self._placeholders = []
        saves = self.saves
        if saves.done or saves.in_flight:
            self._poll_saves()
        timer = self._encoder_timer
        if timer is not None:
            for tokens, seconds in timer.take():
                self._count(encoder_tokens=tokens, encoder_seconds=seconds)
        # due next time: CUDA puts still in flight (the put thread's saves land in _saves_done)
        self._report = bool(saves.in_flight)
        if not (self._loaded or self._failed or self._saved or self._save_failed or self._stats):
            return None  # nothing to report this step (the common case of a step with no item)
        meta = ECTierWorkerMetadata(
            loaded=self._loaded, failed=self._failed, saved=self._saved,
            save_failed=self._save_failed, stats=self._stats,
        )
        self._loaded, self._failed, self._saved, self._save_failed, self._stats = [], {}, [], [], {}
        return meta


def _mark(where: "torch.Tensor | torch.device | None") -> tuple[float, Any]:
    """Now, and for a CUDA tensor or device a timing event recorded on its current stream
    (EncoderStepTimer); ``None``: the CPU."""
    event = None
    if where is not None and (where.is_cuda if isinstance(where, torch.Tensor) else where.type == "cuda"):
        device = where.device if isinstance(where, torch.Tensor) else where
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))
    return time.perf_counter(), event
