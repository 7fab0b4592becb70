"""Drives vLLM 0.33's ``ECMooncakeConnector`` for ``ectier bench connectors`` (variant ``mooncake``).

vLLM's Mooncake connector pushes: the producer's *scheduler* connector plans a push for each
request that names its consumer (``ec_transfer_params``: ``consumer_zmq`` and, per item, a
``transfer_id``); the producer's worker reserves a destination in the consumer worker's registered
receive pool over zmq (``start_save_caches``), takes the tensor in ``save_caches``, and its
dispatcher thread writes it with Mooncake's ``TransferEngine`` (``batch_transfer_sync_write``) once
``build_connector_worker_meta`` flushes, then tells the consumer, whose control thread publishes a
readiness event to the consumer's scheduler connector. The consumer scheduler answers
``ensure_cache_available`` with ``False`` until a worker step has handed the received pool view
to the encoder cache (``start_load_caches``) and reported it loaded.

So this variant runs four connectors in one process, on loopback (``ec_ip`` and the engine's
host ``127.0.0.1``, ``mooncake_protocol`` ``tcp``, ``ec_buffer_device`` ``cpu``), with the calls
vLLM's scheduler and model runner (``ec_connector_model_runner_mixin``) make, in their order:

- the consumer worker first: ``start_worker_services`` (what vLLM's worker does after loading the
  model: registers the receive pool, starts the control channel);
- producer, per item: scheduler ``ensure_cache_available`` + ``update_state_after_alloc`` +
  ``build_connector_meta``; worker ``bind_connector_metadata``, ``start_save_caches``,
  ``save_caches``, ``get_finished``, ``build_connector_worker_meta``, ``clear_connector_metadata``;
  scheduler ``update_connector_output``; then one such step (without ``save_caches``) every
  ``step_s`` until the worker reports no pending save (``pending_saves``); the scheduler's
  ``take_unavailable_requests`` naming the request is a failed save;
- consumer, per item: scheduler ``ensure_cache_available``; each ``False`` is a whole engine step
  (scheduler ``build_connector_meta``, worker ``bind_connector_metadata`` + ``start_load_caches`` +
  ``build_connector_worker_meta`` + ``clear_connector_metadata``, scheduler
  ``update_connector_output``); then ``has_cache_item``, ``update_state_after_alloc``,
  ``build_connector_meta``, the worker's step (its ``start_load_caches`` finds the item in the
  encoder cache), every byte copied out, ``update_connector_output``, ``request_finished``.

Timings (seconds) are the driver's (:mod:`.connector_driver`), with these meanings here:
``save_block_s`` is ``save_caches``; ``save_calls_s`` every worker call of the producer's steps
until no save is pending (scheduler calls are left out, as the other variants have none);
``loadable_s`` from the first worker call until then; ``lookup_s`` the consumer's steps until
``has_cache_item`` (the pool view reaches the encoder cache inside them: no bytes move on the
consumer, the producer wrote them); ``load_s`` the bind + ``start_load_caches`` of the step that
schedules the item plus touching every byte.

vLLM is imported on first use (through :mod:`.connector_driver`), never at import.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any, Callable

import torch

from .connector_driver import ITEM_TIMEOUT_S, POLL_S, _request, _v

__all__ = ["MooncakeConnectors", "ec_settings", "skip_reason"]

#: the logger vLLM's producer scheduler warns on when the model has no tokenizer (the benchmark's
#: tiny model): it cannot name placeholder metadata fields, which says nothing about the bytes
_RESOLVER_LOGGER = "vllm.distributed.ec_transfer.ec_connector.utils"


def skip_reason() -> str | None:
    """Why ``ECMooncakeConnector`` cannot run here (``None``: it can): vLLM's own check that the
    Mooncake client (``mooncake.engine``) imports, with the import error it wraps."""
    from vllm.distributed.ec_transfer.ec_connector.mooncake.transfer import ensure_mooncake_available

    try:
        ensure_mooncake_available()
    except ImportError as exc:
        cause = f" ({type(exc.__cause__).__name__}: {exc.__cause__})" if exc.__cause__ else ""
        return (f"{exc}{cause}; the Mooncake client is mooncake-transfer-engine-non-cuda on a CPU "
                "machine (it loads libibverbs.so.1)")
    return None


def _free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listened on a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ec_settings(pool_bytes: int) -> tuple[dict[str, Any], list[Callable[[], None]]]:
    """``ECTransferConfig`` keyword arguments for a loopback, TCP, CPU-buffer run whose receive
    (and staging) pool holds ``pool_bytes`` bytes, and the undo functions of what it changed:
    ``VLLM_HOST_IP`` is set to ``127.0.0.1`` (the address vLLM gives Mooncake's engine; by default
    the host's outgoing interface) and vLLM's placeholder-metadata warning logger is raised to
    ERROR."""
    before = os.environ.get("VLLM_HOST_IP")
    os.environ["VLLM_HOST_IP"] = "127.0.0.1"
    resolver = logging.getLogger(_RESOLVER_LOGGER)
    level = resolver.level
    resolver.setLevel(logging.ERROR)
    undo = [lambda: os.environ.pop("VLLM_HOST_IP", None) if before is None
            else os.environ.__setitem__("VLLM_HOST_IP", before),
            lambda: resolver.setLevel(level)]
    kwargs = {"ec_buffer_size": pool_bytes, "ec_buffer_device": "cpu", "ec_ip": "127.0.0.1",
              "ec_port": _free_port()}
    return kwargs, undo


class MooncakeConnectors:
    """The four connectors of one (variant, N) run. ``make(role, which)`` builds one connector
    (``role`` ``ec_producer`` | ``ec_consumer``, ``which`` ``SCHEDULER`` | ``WORKER``); ``n``
    tokens per item; ``control_addr`` the consumer's zmq address (``tcp://127.0.0.1:<ec_port>``).

    Raises (constructor): whatever vLLM raises starting the consumer's services (e.g.
    ``RuntimeError`` "EC Mooncake control channel failed to bind")."""

    def __init__(self, make: Callable[[str, str], Any], n: int, control_addr: str) -> None:
        self.n, self.control_addr = n, control_addr
        self._conns: list[Any] = []
        try:
            self.c_worker = self._add(make("ec_consumer", "WORKER"))
            self.c_worker.start_worker_services()
            self.c_sched = self._add(make("ec_consumer", "SCHEDULER"))
            self.p_sched = self._add(make("ec_producer", "SCHEDULER"))
            self.p_worker = self._add(make("ec_producer", "WORKER"))
            self.p_worker.start_worker_services()
        except BaseException:
            self.shutdown()
            raise
        self._reqs: dict[str, Any] = {}

    def _add(self, conn):
        self._conns.append(conn)
        return conn

    def shutdown(self) -> None:
        """Shut every connector down (producer first: its dispatcher may still talk to the consumer)."""
        for c in reversed(self._conns):
            c.shutdown()
        self._conns.clear()

    def _req(self, req_id: str, mm_hash: str):
        params = {"consumer_zmq": self.control_addr, "ec_items": [{"mm_hash": mm_hash, "transfer_id": f"t-{mm_hash}"}]}
        return _request(req_id, mm_hash, self.n, ec_params=params)

    def _worker_step(self, worker, meta, encoder_cache: dict, save: tuple[dict, str] | None = None) -> tuple[Any, float]:
        """One model-runner step of ``worker`` (mixin order); returns its worker metadata and the
        seconds inside ``save_caches``."""
        worker.bind_connector_metadata(meta)
        if worker.is_producer:
            worker.start_save_caches(encoder_cache=encoder_cache)
        if worker.is_consumer:
            worker.start_load_caches(encoder_cache)
        blocked = 0.0
        if save is not None:
            s0 = time.perf_counter()
            worker.save_caches(*save)
            blocked = time.perf_counter() - s0
        worker.get_finished(set())
        wmeta = worker.build_connector_worker_meta()
        worker.clear_connector_metadata()
        return wmeta, blocked

    def produce(self, mm_hash: str, tensor: torch.Tensor, step_s: float) -> dict[str, float]:
        """Save one item (see the module docstring); returns save_block_s, save_calls_s, loadable_s,
        completion_calls.

        Raises:
            RuntimeError: the scheduler reports the save failed, or it is still pending after
                :data:`~.connector_driver.ITEM_TIMEOUT_S`.
        """
        req = self._reqs[mm_hash] = self._req(f"p-{mm_hash}", mm_hash)
        empty = _v().SchedulerOutput.make_empty
        self.p_sched.ensure_cache_available(req, 0)
        self.p_sched.update_state_after_alloc(req, 0)
        meta = self.p_sched.build_connector_meta(empty())
        t0 = time.perf_counter()
        wmeta, block = self._worker_step(self.p_worker, meta, {}, save=({mm_hash: tensor}, mm_hash))
        done = time.perf_counter()
        calls, steps = done - t0, 0
        while True:
            self.p_sched.update_connector_output(_v().ECConnectorOutput(ec_connector_worker_meta=wmeta))
            if req.request_id in self.p_sched.take_unavailable_requests():
                raise RuntimeError(f"ECMooncakeConnector: the push of {mm_hash} failed (see vLLM's log)")
            if not wmeta.pending_saves:
                return {"save_block_s": block, "save_calls_s": calls, "loadable_s": done - t0,
                        "completion_calls": steps}
            if time.perf_counter() - t0 > ITEM_TIMEOUT_S:
                raise RuntimeError(f"ECMooncakeConnector: push of {mm_hash} pending after {ITEM_TIMEOUT_S} s")
            time.sleep(step_s)
            meta = self.p_sched.build_connector_meta(empty())
            c0 = time.perf_counter()
            wmeta, _ = self._worker_step(self.p_worker, meta, {})
            done = time.perf_counter()
            calls += done - c0
            steps += 1

    def consume(self, req_id: str, mm_hash: str, dst: torch.Tensor) -> dict[str, float]:
        """Load one pushed item into ``dst`` (every byte copied); returns lookup_s, lookup_steps,
        load_s, consumer_s.

        Raises:
            RuntimeError: the item is still not available after
                :data:`~.connector_driver.ITEM_TIMEOUT_S`, or ``has_cache_item`` denies it.
        """
        sched, worker, out = self.c_sched, self.c_worker, _v().ECConnectorOutput
        empty = _v().SchedulerOutput.make_empty
        req = self._req(req_id, mm_hash)
        cache: dict[str, torch.Tensor] = {}
        t0 = time.perf_counter()
        steps = 1
        while not sched.ensure_cache_available(req, 0):
            wmeta, _ = self._worker_step(worker, sched.build_connector_meta(empty()), cache)
            sched.update_connector_output(out(ec_connector_worker_meta=wmeta))
            steps += 1
            if time.perf_counter() - t0 > ITEM_TIMEOUT_S:
                raise RuntimeError(f"ECMooncakeConnector: {mm_hash} still deferred after {ITEM_TIMEOUT_S} s")
            time.sleep(POLL_S)
        if not sched.has_cache_item(mm_hash):
            raise RuntimeError(f"ECMooncakeConnector: has_cache_item({mm_hash}) is False for a pushed item")
        t1 = time.perf_counter()
        sched.update_state_after_alloc(req, 0)
        meta = sched.build_connector_meta(empty())
        t2 = time.perf_counter()
        worker.bind_connector_metadata(meta)
        worker.start_load_caches(cache)
        dst.copy_(cache[mm_hash])
        t3 = time.perf_counter()
        worker.get_finished(set())
        wmeta = worker.build_connector_worker_meta()
        worker.clear_connector_metadata()
        sched.update_connector_output(out(ec_connector_worker_meta=wmeta))
        sched.request_finished(req)
        t4 = time.perf_counter()
        self.p_sched.request_finished(self._reqs.pop(mm_hash))  # the producer's end of the request
        return {"lookup_s": t1 - t0, "lookup_steps": steps, "load_s": t3 - t2, "consumer_s": t4 - t0}

