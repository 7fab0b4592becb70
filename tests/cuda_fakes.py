"""A stand-in for ``torch.cuda`` on a machine without CUDA: enough of it for
:class:`ectier.copy.CudaCopyEngine` to run its code paths with CPU tensors (the copies themselves
run at once, on the CPU), logging what the engine asks of streams and events, and failing where a
test says so. Used by tests/test_copy_engine_cpu.py."""

from __future__ import annotations

import contextlib

import torch


class FakeCuda:
    """Patches ``torch.cuda`` (through ``monkeypatch``) and logs ``(what, object id)`` calls.

    Attributes:
        log: the calls, in order: ``("wait_event", stream)``, ``("record", event, stream)``,
            ``("synchronize", stream)``, ``("copy", dst)``.
        query_error / synchronize_error: raised by every event's ``query()`` / ``synchronize()``
            when set (a CUDA error that surfaces when a copy's completion is observed).
    """

    def __init__(self, monkeypatch) -> None:
        self.log: list[tuple] = []
        self.query_error: BaseException | None = None
        self.synchronize_error: BaseException | None = None
        fake = self

        class Stream:
            def __init__(self, device=None, priority=0) -> None:
                self.device = torch.device(device) if device is not None else torch.device("cuda:0")

            def wait_event(self, event) -> None:
                fake.log.append(("wait_event", self))

            def wait_stream(self, stream) -> None:
                fake.log.append(("wait_stream", self))

            def synchronize(self) -> None:
                fake.log.append(("synchronize", self))

        class Event:
            def __init__(self, enable_timing=False, blocking=False, interprocess=False) -> None:
                pass

            def record(self, stream=None) -> None:
                fake.log.append(("record", self, stream))

            def query(self) -> bool:
                if fake.query_error is not None:
                    raise fake.query_error
                return True

            def synchronize(self) -> None:
                if fake.synchronize_error is not None:
                    raise fake.synchronize_error

        self.Stream, self.Event = Stream, Event
        self.current = Stream()
        for name, value in {
            "is_available": lambda: True, "device_count": lambda: 1, "Stream": Stream, "Event": Event,
            "device": lambda d: contextlib.nullcontext(), "stream": lambda s: contextlib.nullcontext(),
            "current_stream": lambda d=None: self.current,
        }.items():
            monkeypatch.setattr(torch.cuda, name, value)
