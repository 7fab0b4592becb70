"""Device → host copies of the daemon client's ``put`` (a CUDA tensor into the shared arena).

Imports torch only when called, like the client's other data calls.
"""

from __future__ import annotations

import threading

_streams: dict = {}  # device -> this process's copy stream for puts (one per device, reused)
_streams_lock = threading.Lock()


def _put_stream(device):
    """The put copies' stream of ``device``: one, reused (a new one per put cycled through torch's
    pool, into vLLM's streams among them), from the high-priority pool (``ectier.copy.copy_stream``)."""
    from ..copy import copy_stream

    with _streams_lock:
        stream = _streams.get(device)
        if stream is None:
            stream = _streams[device] = copy_stream(device)
        return stream


def device_bytes(tensor, after):
    """``tensor``'s bytes (flat uint8, C order) on its CUDA device, valid on the current stream
    once it waited for ``after`` (or, without it, the stream that was current before)."""
    import torch

    from ..tensors import byte_view

    stream = torch.cuda.current_stream(tensor.device)
    if after is not None:
        stream.wait_event(after)
    return byte_view(tensor)  # a non-contiguous tensor is made contiguous here, after the wait


def device_to_host(tensor, after):
    """One D2H copy of a CUDA ``tensor``'s bytes (the arena is not page-locked, or a scratch file)."""
    import torch

    with torch.cuda.device(tensor.device):
        src = device_bytes(tensor, after)
        return src.cpu()  # synchronous: returns once copied


def copy_from_device(arena, extents, tensor, after) -> None:
    """Copy a CUDA ``tensor`` straight into page-locked ``arena`` extents (DMA, no staging) on a
    side stream that first waits for ``after``; returns once the copies are done."""
    import torch

    stream = _put_stream(tensor.device)
    if after is None:
        stream.wait_stream(torch.cuda.current_stream(tensor.device))
    try:
        with torch.cuda.stream(stream):
            src = device_bytes(tensor, after)
            off = 0
            for start, length in extents:
                arena[start : start + length].copy_(src[off : off + length], non_blocking=True)
                off += length
    finally:  # also on an error: the caller's abort gives the extents back, so no copy may be left running
        stream.synchronize()
