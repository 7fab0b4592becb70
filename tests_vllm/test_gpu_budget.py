"""The GPU tier's arena against vLLM's ``gpu_memory_utilization`` (docs/vllm.md, "GPU and host memory").

The device is a stand-in: ``torch.cuda.mem_get_info`` answers for an 80 GiB GPU with 70 GiB free,
as the worker's connector sees it inside vLLM's ``Worker.init_device``. No arena is allocated.
"""

from __future__ import annotations

import json

import pytest
import torch

import harness as H

GiB = 1 << 30


@pytest.fixture
def device_80g(monkeypatch):
    asked = []

    def mem_get_info(device=None):
        asked.append(str(device))
        return 70 * GiB, 80 * GiB

    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    return asked


def extra(gpu_bytes: str, **more):
    return {"namespace": "gpu-budget", "host": {"capacity_bytes": "4MiB", "block_bytes": "64KiB", "pin_memory": False},
            "gpu": {"device": "cuda:0", "capacity_bytes": gpu_bytes}, **more}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the stand-in device must not meet a real one")
def test_gpu_arena_beyond_vllms_headroom_stops_the_engine_naming_the_key_and_headroom(model_dir, device_80g):
    """vLLM will ask for 0.85 x 80 = 68 GiB of the 70 GiB free: 2 GiB of headroom for the arena.
    A 4 GiB arena is refused by the worker's connector, before anything is allocated."""
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

    from ectier.errors import ConfigError
    from ectier_vllm.connector import ECTierConnector
    from ectier_vllm.store import open_stores

    cfg = H.make_vllm_config(model_dir, "ec_consumer", extra("4GiB"), gpu_memory_utilization=0.85)
    with pytest.raises(ConfigError) as err:
        ECTierConnector(cfg, ECConnectorRole.WORKER)
    msg = str(err.value)
    assert msg.startswith("ec_connector_extra_config.gpu.capacity_bytes: ")
    assert "arena of 4.0 GiB" in msg and "headroom of 2.0 GiB" in msg
    assert "gpu_memory_utilization=0.85 (68.0 GiB of the device's 80.0 GiB)" in msg and "70.0 GiB free" in msg
    assert device_80g == ["cuda:0"]
    assert open_stores() == 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the stand-in device must not meet a real one")
def test_gpu_arena_within_the_headroom_passes_the_check(model_dir, device_80g):
    """A 1 GiB arena fits in the 2 GiB headroom: the connector goes on to open the store (which,
    on this machine without CUDA, then refuses the GPU tier for that reason, not the budget)."""
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

    from ectier.errors import ConfigError
    from ectier_vllm.connector import ECTierConnector

    cfg = H.make_vllm_config(model_dir, "ec_consumer", extra("1GiB"), gpu_memory_utilization=0.85)
    with pytest.raises(ConfigError, match=r"ec_connector_extra_config\.gpu\.capacity_bytes: .*CUDA is not available") as err:
        ECTierConnector(cfg, ECConnectorRole.WORKER)
    assert "headroom" not in str(err.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the stand-in device must not meet a real one")
def test_gpu_budget_error_names_the_config_file_and_only_the_worker_checks(model_dir, device_80g, tmp_path):
    """From a config_path file the error names the file and its field. The scheduler's connector
    does not check (vLLM builds it after its profiling, when free memory no longer means headroom)."""
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

    from ectier.errors import ConfigError
    from ectier_vllm.connector import ECTierConnector

    path = tmp_path / "engine.json"
    path.write_text(json.dumps({"host": {"capacity_bytes": "4MiB", "block_bytes": "64KiB", "pin_memory": False},
                                "gpu": {"device": "cuda:0", "capacity_bytes": "3GiB"}}))
    cfg = H.make_vllm_config(model_dir, "ec_consumer", {"namespace": "gpu-budget", "config_path": str(path)},
                             gpu_memory_utilization=0.85)
    with pytest.raises(ConfigError, match=rf"ec_connector_extra_config\.config_path \('{path}'\): gpu\.capacity_bytes: .*headroom of 2\.0 GiB"):
        ECTierConnector(cfg, ECConnectorRole.WORKER)
    with pytest.raises(ConfigError, match="CUDA is not available") as err:
        ECTierConnector(cfg, ECConnectorRole.SCHEDULER)
    assert "headroom" not in str(err.value)
