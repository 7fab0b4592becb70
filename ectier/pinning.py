"""Page-locking memory ectier did not allocate (``cudaHostRegister``): a shared arena mapping.

One place for what the call needs on a real GPU machine (docs/architecture.md, CUDA ordering
rules):

- it runs with the device that will copy selected (``torch.cuda.device``): a worker thread's
  current device is device 0 whatever its engine's, and a registration from there would open
  a CUDA context on a GPU another engine owns;
- the registration is *portable* (``cudaHostRegisterPortable``): every CUDA context of the
  process sees the memory as page-locked, not only the one current at the call;
- a refusal leaves CUDA's per-thread "last error" set (torch's binding does not clear it), and
  torch's next kernel-launch check in that thread would raise it as if the launch had failed;
  it is cleared here (``cudaGetLastError`` of the ``libcudart`` torch loaded).

A refusal only costs speed (copies stay pageable): logged, never raised.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging

import torch

from .tensors import cuda_available

__all__ = ["register_host", "unregister_host", "clear_cuda_error"]

log = logging.getLogger(__name__)

#: ``cudaHostRegisterPortable``: page-locked for every CUDA context, not only the current one
HOST_REGISTER_PORTABLE = 1
#: ``cudaHostRegisterReadOnly``: memory mapped read-only (a read-only mapping cannot be
#: registered without it); the GPU only reads it
HOST_REGISTER_READ_ONLY = 8


def _ok(rc: object) -> bool:
    return (rc.value if hasattr(rc, "value") else int(rc)) == 0


def register_host(buffer: torch.Tensor, *, device: torch.device | int | None = None, what: str = "memory",
                  read_only: bool = False) -> bool:
    """Page-lock the CPU memory of ``buffer`` (a contiguous CPU tensor, e.g. a shared mapping).

    Args:
        buffer: the memory; its ``numel() * element_size()`` bytes from ``data_ptr()``.
        device: the CUDA device whose context registers it (default: the current one).
        what: how the log line names the memory.
        read_only: the memory is mapped read-only (``cudaHostRegisterReadOnly``: copies from it only).

    Returns:
        True if registered; False without CUDA, for an empty buffer, or when the driver refused
        (logged as a WARNING naming ``what``; the pending CUDA error is cleared).
    """
    nbytes = buffer.numel() * buffer.element_size()
    if nbytes == 0 or not cuda_available():
        return False
    with torch.cuda.device(device if device is not None else torch.cuda.current_device()):
        flags = HOST_REGISTER_PORTABLE | (HOST_REGISTER_READ_ONLY if read_only else 0)
        rc = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), nbytes, flags)
        if _ok(rc):
            return True
        clear_cuda_error()
    log.warning("cudaHostRegister of %s failed (%s); copies to and from it stay pageable", what, rc)
    return False


def unregister_host(buffer: torch.Tensor | int, *, device: torch.device | int | None = None) -> bool:
    """Undo :func:`register_host` (before the memory is unmapped; ``buffer``: the tensor, or its
    ``data_ptr()``), under ``device`` (the one that registered it: from any thread, never a context
    on another GPU). True on success; a refusal is logged at DEBUG and its CUDA error cleared."""
    ptr = buffer if isinstance(buffer, int) else buffer.data_ptr()
    with torch.cuda.device(device) if device is not None else contextlib.nullcontext():
        rc = torch.cuda.cudart().cudaHostUnregister(ptr)
        if _ok(rc):
            return True
        clear_cuda_error()
    log.debug("cudaHostUnregister failed (%s)", rc)
    return False


_cudart: ctypes.CDLL | None | bool = False  # False: not looked up yet


def _loaded_cudart() -> ctypes.CDLL | None:
    """The ``libcudart`` this process has loaded (torch's), from ``/proc/self/maps``; ``None``
    if none is (a CPU build) or it cannot be opened."""
    global _cudart
    if _cudart is False:
        _cudart = None
        try:
            with open("/proc/self/maps") as f:
                paths = {line.split()[-1] for line in f if "libcudart" in line and "/" in line}
            for path in sorted(paths):
                try:
                    _cudart = ctypes.CDLL(path)
                    break
                except OSError:
                    continue
        except OSError:
            pass
    return _cudart


def clear_cuda_error() -> bool:
    """Clear this thread's pending CUDA runtime error (``cudaGetLastError``) left by a refused
    call whose binding did not clear it. True if the runtime was reached."""
    lib = _loaded_cudart()
    if lib is None:
        return False
    try:
        lib.cudaGetLastError()
    except (AttributeError, OSError):
        return False
    return True
