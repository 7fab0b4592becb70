"""``DaemonClient.put`` of a CUDA tensor (the vLLM producer's save in daemon mode, #14 item 2):
copied device → the daemon's shared arena on a copy stream after the producer's event, straight
into the page-locked mapping; bytes exact. GPU only."""

from __future__ import annotations

import os

import pytest
import torch

from daemon_helpers import MiB, DaemonProcess, daemon_config, remove_dir, short_tmpdir, write_config
from ectier.daemon.client import DaemonClient

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture
def daemon():
    d = short_tmpdir()
    cfg = daemon_config(d, host_bytes=64 * MiB, nvme=False)
    proc = DaemonProcess(write_config(os.path.join(d, "cfg.json"), cfg), cfg["daemon"]["socket_path"]).start()
    try:
        yield proc
    finally:
        proc.stop()
        remove_dir(d)


@pytest.mark.parametrize("contiguous", [True, False])
def test_a_cuda_tensor_is_put_after_the_producers_event(daemon, contiguous):
    """The producer writes the tensor on its own stream and records an event; the put (as from the
    connector's save thread) waits for that event, not for the device: the bytes are the final ones."""
    dev = torch.device("cuda:0")
    producer = torch.cuda.Stream(dev)
    with torch.cuda.stream(producer):
        base = torch.zeros(2048, 8192, dtype=torch.bfloat16, device=dev)
        torch.cuda._sleep(50_000_000)  # the kernels that fill the output are still running ...
        base.add_(torch.arange(8192, device=dev, dtype=torch.bfloat16))
        tensor = base if contiguous else base[:, ::2]
        event = torch.cuda.Event()
        event.record(producer)
    with DaemonClient(daemon.socket_path) as c:
        c.put("k", tensor, after=event)  # ... the copy waits for them
        producer.synchronize()
        expect = tensor.contiguous().cpu()
        got = c.get("k")
    assert got.shape == tensor.shape and torch.equal(got.view(torch.int16), expect.view(torch.int16))


def test_a_view_loaded_onto_the_gpu_is_ready_on_the_current_stream_and_pinned_until_copied(daemon):
    """The worker's load in daemon mode: a view of the arena copied on the h2d lane (no host sync),
    the consumer stream waiting for it; the daemon's pin lives until the copy completed, so an
    overwrite meanwhile goes to other bytes and the copy reads the loaded version."""
    from ectier.daemon.client_device import device_loads

    dev = torch.device("cuda:0")
    old = torch.arange(32 * MiB, dtype=torch.uint8) % 251
    new = torch.full((32 * MiB,), 7, dtype=torch.uint8)
    with DaemonClient(daemon.socket_path) as c:
        c.put("k", old)
        view = c.get_view("k")
        torch.cuda._sleep(50_000_000)  # the consumer stream is busy: the lane's copy waits for it
        got = c.view_to_device(view, dev)
        del view  # only the copy holds the pin now
        c.put("k", new)  # an overwrite while the copy waits: other bytes
        got_host = got.cpu()  # on the current stream: after the copy
        assert device_loads().drain(30)
    assert torch.equal(got_host, old)
