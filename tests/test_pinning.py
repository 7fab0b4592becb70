"""ectier/pinning.py without a GPU: the calls it makes to CUDA's runtime (a fake ``cudart``), what a
refusal returns and logs. On a GPU machine the registrations run for real in tests/test_gpu.py."""

from __future__ import annotations

import contextlib
import logging

import torch

from ectier import pinning


def _fake_cuda(monkeypatch, rc: int):
    calls, devices = [], []

    class FakeCudart:
        def cudaHostRegister(self, ptr, size, flags):
            calls.append(("register", ptr, size, flags))
            return rc

        def cudaHostUnregister(self, ptr):
            calls.append(("unregister", ptr))
            return rc

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", lambda d: devices.append(d) or contextlib.nullcontext())
    return calls, devices


def test_a_registration_is_portable_all_bytes_and_under_the_device_given(monkeypatch):
    calls, devices = _fake_cuda(monkeypatch, 0)
    buf = torch.empty(1000, dtype=torch.float32)
    assert pinning.register_host(buf, device=torch.device("cuda", 3))
    assert calls == [("register", buf.data_ptr(), 4000, pinning.HOST_REGISTER_PORTABLE)]
    assert devices == [torch.device("cuda", 3)]
    assert pinning.unregister_host(buf.data_ptr(), device=torch.device("cuda", 3))
    assert calls[-1] == ("unregister", buf.data_ptr()) and devices[-1] == torch.device("cuda", 3)  # never device 0


def test_a_refusal_is_false_and_one_warning_naming_the_memory(monkeypatch, caplog):
    calls, devices = _fake_cuda(monkeypatch, 2)
    with caplog.at_level(logging.WARNING, logger="ectier.pinning"):
        assert not pinning.register_host(torch.empty(64, dtype=torch.uint8), what="the test arena")
    assert devices == [0]  # the current device when none is given
    assert [r.getMessage() for r in caplog.records if "the test arena" in r.getMessage()]
    assert not pinning.unregister_host(torch.empty(8, dtype=torch.uint8))


def test_nothing_is_registered_without_cuda_or_for_no_bytes(monkeypatch):
    calls, _ = _fake_cuda(monkeypatch, 0)
    assert not pinning.register_host(torch.empty(0, dtype=torch.uint8))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert not pinning.register_host(torch.empty(64, dtype=torch.uint8))
    assert calls == []
    if torch.version.cuda is None:  # a CPU build loads no CUDA runtime: nothing to clear
        assert pinning.clear_cuda_error() is False
