"""Loads of daemon entries onto a CUDA device that never wait on the host (issue 14, item 2).

A worker in daemon mode reads an entry as a read-only view of the daemon's arena
(:meth:`~ectier.daemon.client.DaemonClient.get_view`). Onto a GPU, :class:`DeviceLoads` copies it
on the h2d lane of a :class:`~ectier.copy.CudaCopyEngine` (a stream of its own that first waits for
the caller's current stream, rule 1), makes the caller's current stream wait for the copy's event
(rule 4: the model's kernels that read the result come after it, and the host never waits), and
holds the view until the copy completed (rule 3: the daemon's pin under it, and so its bytes,
stay put while the DMA reads them), in a :class:`~ectier.copy.Completer`'s thread. A blocking
``view.to(device)`` instead synchronized the model's stream inside ``start_load_caches``.

The copy is asynchronous only from page-locked memory: the arena's read-only mapping is registered
at the first load onto a device (:meth:`ArenaView.page_locked`); a view of an earlier daemon run's
mapping is copied from pageable memory (correct, and the host waits for that copy's staging).

Imports torch only when used, like the client's other data calls.
"""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["DeviceLoads", "device_loads"]

_LOADS: "DeviceLoads | None" = None
_LOADS_LOCK = threading.Lock()


class DeviceLoads:
    """Copies of CPU tensors (arena views) onto devices, ordered by streams and events.

    Args:
        engines: how devices are reached (default: one :class:`~ectier.copy.CudaCopyEngine` per
            CUDA device, made at first use; ``ectier.copy.Engines(copy_engine=...)`` in tests).
        completer: the thread that holds each copy's sources until it completed.
    """

    def __init__(self, engines: Any = None, completer: Any = None) -> None:
        from ..copy import Completer, Engines

        self._engines = engines if engines is not None else Engines()
        self._completer = completer if completer is not None else Completer("ectier-daemon-loads")

    def to_device(self, view: Any, device: Any) -> Any:
        """``view`` (a CPU tensor) copied onto ``device``: a tensor of its dtype and shape, ready on
        the caller's current stream of ``device`` (no host sync); ``view`` is referenced until the
        copy completed. Without a copy engine for ``device`` (the CPU), a plain copy, done here.

        Raises:
            InvalidDeviceError: ``device`` is no device of this machine.
        """
        import torch

        from ..tensors import byte_view, parse_device

        dev = parse_device(device)
        engine = self._engines.engine_for(dev, 2)
        if engine is None:
            return view.to(dev, copy=True)
        out = torch.empty(tuple(view.shape), dtype=view.dtype, device=dev)
        handle = engine.copy([(byte_view(out), byte_view(view))], lane="h2d")  # refs held by the handle
        handle.wait_stream(dev)
        self._completer.submit(handle, lambda: None)  # the handle (so the view) lives until the copy is done
        return out

    def drain(self, timeout_s: float | None = None) -> bool:
        """Wait until every copy submitted so far completed; False on timeout (seconds)."""
        return self._completer.drain(timeout_s)


def device_loads() -> DeviceLoads:
    """This process's :class:`DeviceLoads` (made at first use)."""
    global _LOADS
    with _LOADS_LOCK:
        if _LOADS is None:
            _LOADS = DeviceLoads()
        return _LOADS
