"""The GPU tier's arena against vLLM's GPU memory budget, checked when the worker's connector starts.

vLLM 0.33 builds the worker's EC connector in ``init_worker_distributed_environment``
(``ensure_ec_transfer_initialized``), inside ``Worker.init_device`` and *before* its start-up
memory snapshot; in in-process mode the connector opens the store there, so the GPU tier's arena
(``gpu.capacity_bytes``) is allocated first. vLLM then asks for ``gpu_memory_utilization`` x the
device's total memory of what is free after the arena (``request_memory``: "Free memory on device
... is less than desired GPU memory utilization"), and sizes the model, activations and KV cache
inside that. The arena therefore comes *on top of* vLLM's budget: it must fit in the headroom

    headroom = free memory when the connector starts - ceil(gpu_memory_utilization x total)

:func:`check_gpu_arena_fits` refuses a larger arena at once, with an error naming the key, instead
of letting vLLM fail later with its own message, which does not mention the arena.
"""

from __future__ import annotations

import math

import torch

from ectier.config_checks import format_bytes
from ectier.errors import ConfigError

from .config import operator_key


def arena_headroom(free: int, total: int, gpu_memory_utilization: float) -> int:
    """Bytes of device memory left beside vLLM's budget: ``free - ceil(total * utilization)``
    (negative when vLLM alone would not fit)."""
    return free - math.ceil(total * gpu_memory_utilization)


def check_gpu_arena_fits(capacity_bytes: int, device: str, gpu_memory_utilization: float,
                         config_path: str | None = None) -> None:
    """Raise if a GPU-tier arena of ``capacity_bytes`` on ``device`` would not leave vLLM its budget.

    Args:
        capacity_bytes: the arena's size in bytes (``gpu.capacity_bytes``).
        device: the arena's device, ``"cuda:<i>"``.
        gpu_memory_utilization: vLLM's ``cache_config.gpu_memory_utilization`` (0 < u <= 1).
        config_path: the ectier config file the GPU tier came from, if any (named in the error).

    Raises:
        ConfigError: naming ``ec_connector_extra_config.gpu.capacity_bytes`` (or the config file's
            ``gpu.capacity_bytes``), the arena, the free and total memory, vLLM's budget and the
            headroom. Nothing is checked where CUDA cannot be queried (the store's open reports that).
    """
    try:
        free, total = torch.cuda.mem_get_info(torch.device(device))
    except (RuntimeError, AssertionError):  # no CUDA (CPU build, no device): the store says so
        return
    headroom = arena_headroom(free, total, gpu_memory_utilization)
    if capacity_bytes <= headroom:
        return
    budget = math.ceil(total * gpu_memory_utilization)
    raise ConfigError(operator_key(
        f"gpu.capacity_bytes: the GPU tier's arena of {format_bytes(capacity_bytes)} ({capacity_bytes} bytes) "
        f"does not fit beside vLLM's memory budget on {device}: it is allocated when the engine starts, "
        f"before vLLM measures the device, so it comes on top of gpu_memory_utilization="
        f"{gpu_memory_utilization} ({format_bytes(budget)} of the device's {format_bytes(total)}); with "
        f"{format_bytes(free)} free now that leaves a headroom of {format_bytes(headroom)} ({headroom} bytes) "
        f"for the arena. Lower gpu.capacity_bytes to at most the headroom, or lower --gpu-memory-utilization",
        config_path,
    ))
