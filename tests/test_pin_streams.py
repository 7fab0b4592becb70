"""The scheduler's pin of an entry in the GPU tier and the worker's use of it when the two run on
different threads, hence different current streams (ectier_vllm.store): the read is ordered on the
scheduler's stream, so an event is recorded there at the pin and the worker's stream waits on it,
and the tensor is ``record_stream``-ed on the worker's stream. ``torch.cuda`` faked
(tests/cuda_fakes.py) with a CUDA-looking tensor; tests/test_gpu.py runs it on a real device."""

from __future__ import annotations

import torch

from cuda_fakes import FakeCuda
from ectier_vllm.store import ready_event, use_on_current_stream


class _CudaLooking:
    """A tensor on ``cuda:0`` as far as the two helpers look: its device and ``record_stream``."""

    device = torch.device("cuda:0")

    def __init__(self) -> None:
        self.recorded: list = []

    def record_stream(self, stream) -> None:
        self.recorded.append(stream)


def test_the_worker_stream_waits_for_the_event_recorded_on_the_scheduler_stream(monkeypatch):
    fake = FakeCuda(monkeypatch)
    scheduler, worker = fake.Stream(), fake.Stream()
    tensor = _CudaLooking()
    fake.current = scheduler
    ready = ready_event(tensor)
    assert fake.log == [("record", ready, scheduler)]
    fake.current = worker
    use_on_current_stream(tensor, ready)
    assert fake.log[1:] == [("wait_event", worker)]
    assert tensor.recorded == [worker]


def test_a_cpu_tensor_needs_no_event_and_nothing_is_asked_of_cuda(monkeypatch):
    fake = FakeCuda(monkeypatch)
    t = torch.zeros(4)
    ready = ready_event(t)
    use_on_current_stream(t, ready)
    assert ready is None and fake.log == []
