"""The GPU tier's arena inside what vLLM leaves of the device (docs/vllm.md, "GPU and host memory").

The device is a stand-in: ``torch.cuda.mem_get_info`` answers for an 80 GiB GPU with 70 GiB free
while vLLM's worker starts (where it builds the worker's connector), and 10 GiB free once vLLM has
profiled the model and taken its budget (where it builds the scheduler's connector). No arena is
allocated (no CUDA here: the store then refuses the GPU tier for that reason).
"""

from __future__ import annotations

import json

import pytest
import torch

import harness as H

GiB = 1 << 30
NOCUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="the stand-in device must not meet a real one")


class Device80G:
    """``torch.cuda.mem_get_info`` of an 80 GiB device; ``free`` as the test sets it."""

    def __init__(self) -> None:
        self.free = 70 * GiB  # at vLLM's Worker.init_device
        self.asked: list[str] = []

    def __call__(self, device=None):
        self.asked.append(str(device))
        return self.free, 80 * GiB

    def after_vllms_profiling(self) -> None:
        self.free = 10 * GiB  # vLLM took 0.85 x 80 = 68 GiB of the 70 (and some for its context)


@pytest.fixture
def device_80g(monkeypatch):
    dev = Device80G()
    monkeypatch.setattr(torch.cuda, "mem_get_info", dev)
    return dev


def extra(gpu_bytes: str, **more):
    return {"namespace": "gpu-budget", "host": {"capacity_bytes": "4MiB", "block_bytes": "64KiB", "pin_memory": False},
            "gpu": {"device": "cuda:0", "capacity_bytes": gpu_bytes}, **more}


@NOCUDA
def test_the_worker_allocates_no_gpu_arena_before_vllms_profiling(model_dir, device_80g):
    """A 12 GiB arena would not fit beside vLLM's 68 GiB before profiling (2 GiB headroom then);
    the worker's connector, which vLLM builds at that point, opens nothing and asks nothing: the
    arena is not allocated there (before: refused, or allocated outside vLLM's budget)."""
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

    from ectier_vllm.connector import ECTierConnector
    from ectier_vllm.store import open_stores

    cfg = H.make_vllm_config(model_dir, "ec_consumer", extra("12GiB"), gpu_memory_utilization=0.85)
    worker = ECTierConnector(cfg, ECConnectorRole.WORKER)
    assert open_stores() == 0 and device_80g.asked == []
    worker.shutdown()
    assert open_stores() == 0


@NOCUDA
def test_gpu_arena_beyond_what_vllm_left_stops_the_engine_naming_the_key_and_headroom(model_dir, device_80g):
    """After vLLM's profiling 10 GiB are free: the scheduler's connector, which opens the store
    then, refuses a 12 GiB arena before allocating anything."""
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

    from ectier.errors import ConfigError
    from ectier_vllm.connector import ECTierConnector
    from ectier_vllm.store import open_stores

    cfg = H.make_vllm_config(model_dir, "ec_consumer", extra("12GiB"), gpu_memory_utilization=0.85)
    ECTierConnector(cfg, ECConnectorRole.WORKER)
    device_80g.after_vllms_profiling()
    with pytest.raises(ConfigError) as err:
        ECTierConnector(cfg, ECConnectorRole.SCHEDULER)
    msg = str(err.value)
    assert msg.startswith("ec_connector_extra_config.gpu.capacity_bytes: ")
    assert "arena of 12.0 GiB" in msg and "10.0 GiB (10737418240 bytes) is free then: the headroom" in msg
    assert "device's 80.0 GiB" in msg
    assert device_80g.asked == ["cuda:0"]
    assert open_stores() == 0


@NOCUDA
def test_gpu_arena_within_what_vllm_left_passes_the_check(model_dir, device_80g):
    """A 4 GiB arena fits in the 10 GiB left: the store is opened (and, on this machine without
    CUDA, then refuses the GPU tier for that reason, not the budget)."""
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

    from ectier.errors import ConfigError
    from ectier_vllm.connector import ECTierConnector

    cfg = H.make_vllm_config(model_dir, "ec_consumer", extra("4GiB"), gpu_memory_utilization=0.85)
    device_80g.after_vllms_profiling()
    with pytest.raises(ConfigError, match=r"ec_connector_extra_config\.gpu\.capacity_bytes: .*CUDA is not available") as err:
        ECTierConnector(cfg, ECConnectorRole.SCHEDULER)
    assert "headroom" not in str(err.value)


@NOCUDA
def test_gpu_budget_error_names_the_config_file(model_dir, device_80g, tmp_path):
    """From a config_path file the error names the file and its field; a worker that opens the
    store at its first use checks the same way."""
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

    from ectier.errors import ConfigError
    from ectier_vllm.connector import ECTierConnector

    path = tmp_path / "engine.json"
    path.write_text(json.dumps({"host": {"capacity_bytes": "4MiB", "block_bytes": "64KiB", "pin_memory": False},
                                "gpu": {"device": "cuda:0", "capacity_bytes": "11GiB"}}))
    cfg = H.make_vllm_config(model_dir, "ec_consumer", {"namespace": "gpu-budget", "config_path": str(path)},
                             gpu_memory_utilization=0.85)
    device_80g.after_vllms_profiling()
    pattern = rf"ec_connector_extra_config\.config_path \('{path}'\): gpu\.capacity_bytes: .*the headroom"
    with pytest.raises(ConfigError, match=pattern):
        ECTierConnector(cfg, ECConnectorRole.SCHEDULER)
    worker = ECTierConnector(cfg, ECConnectorRole.WORKER)
    with pytest.raises(ConfigError, match=pattern):
        worker.saves.submit("k" * 64, torch.zeros(2, 2))  # the first use opens the store
