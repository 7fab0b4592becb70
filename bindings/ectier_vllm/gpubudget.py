"""The GPU tier's arena inside what vLLM leaves of the device, checked when the arena is created.

vLLM 0.33 builds the worker's EC connector in ``init_worker_distributed_environment``
(``ensure_ec_transfer_initialized``), inside ``Worker.init_device`` and *before* its start-up
memory snapshot and profiling. A worker connector with a GPU tier therefore does not open the
in-process store there; the scheduler's connector, which vLLM's engine core builds after it has
profiled the model and allocated its budget (``gpu_memory_utilization`` x the device's memory:
weights, activations, KV cache), opens the store shared by both in the same process, and the
worker joins it at first use. The arena (``gpu.capacity_bytes``) is thus allocated from what vLLM
left, never inside the memory vLLM measured and distributed, and vLLM's own start-up check ("Free
memory on device ... is less than desired GPU memory utilization") never sees it:

    headroom = free device memory when the store is opened (after vLLM's allocations)

:func:`check_gpu_arena_fits` refuses an arena larger than that at once, with an error naming the
key and the headroom, instead of a CUDA out-of-memory error.
"""

from __future__ import annotations

import torch

from ectier.config_checks import format_bytes
from ectier.errors import ConfigError

from .config import operator_key


def check_gpu_arena_fits(capacity_bytes: int, device: str, config_path: str | None = None) -> None:
    """Raise if a GPU-tier arena of ``capacity_bytes`` does not fit in ``device``'s free memory now.

    Args:
        capacity_bytes: the arena's size in bytes (``gpu.capacity_bytes``).
        device: the arena's device, ``"cuda:<i>"``.
        config_path: the ectier config file the GPU tier came from, if any (named in the error).

    Raises:
        ConfigError: naming ``ec_connector_extra_config.gpu.capacity_bytes`` (or the config file's
            ``gpu.capacity_bytes``), the arena, the free and total memory (the headroom vLLM
            left). Nothing is checked where CUDA cannot be queried (the store's open reports that).
    """
    try:
        free, total = torch.cuda.mem_get_info(torch.device(device))
    except (RuntimeError, AssertionError):  # no CUDA (CPU build, no device): the store says so
        return
    if capacity_bytes <= free:
        return
    raise ConfigError(operator_key(
        f"gpu.capacity_bytes: the GPU tier's arena of {format_bytes(capacity_bytes)} ({capacity_bytes} bytes) "
        f"does not fit in what vLLM left on {device}: it is allocated after vLLM has taken its budget "
        f"(gpu_memory_utilization x the device's {format_bytes(total)}: model, activations, KV cache), and "
        f"{format_bytes(free)} ({free} bytes) is free then: the headroom for the arena. Lower "
        f"gpu.capacity_bytes to at most the headroom, or lower --gpu-memory-utilization",
        config_path,
    ))
