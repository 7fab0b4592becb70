"""``ectier.daemon.client_device.DeviceLoads`` without a GPU: a copy engine that runs copies only
when told (``ectier.testing.DeferredCopyEngine``) stands for the h2d lane. What is checked: the
source view (a read-only view of the daemon's arena, whose storage's end releases the daemon's
pin) stays alive until its copy completed, never less; the result has its bytes once it did."""

from __future__ import annotations

import gc

import torch

from ectier.copy import Engines
from ectier.daemon.client_device import DeviceLoads
from ectier.moves.views import pinned_view
from ectier.testing import DeferredCopyEngine


def test_the_source_view_and_its_pin_live_until_the_copy_completed():
    engine = DeferredCopyEngine()
    loads = DeviceLoads(Engines(copy_engine=engine))
    arena = torch.arange(4096, dtype=torch.int32).view(torch.uint8)
    released = []
    view = pinned_view(arena, 1024, 2048, torch.int16, (32, 32), lambda: released.append(True))
    expect = view.clone()
    out = loads.to_device(view, "cpu")
    del view
    gc.collect()
    assert engine.pending == 1 and not released  # the copy has not run: the pin is held
    assert engine.complete() == 1
    assert loads.drain(5)
    gc.collect()
    assert released == [True]  # once, after the copy
    assert out.dtype == torch.int16 and out.shape == (32, 32) and torch.equal(out, expect)


def test_without_a_copy_engine_the_copy_is_made_at_once():
    loads = DeviceLoads(Engines())  # the CPU: no engine
    src = torch.randn(8, 16)
    out = loads.to_device(src, "cpu")
    assert torch.equal(out, src) and out.data_ptr() != src.data_ptr()
