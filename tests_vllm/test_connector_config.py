"""ECTierConnector configs in vLLM's real engine set-up: in-process mode with workers in other
processes, a bad extra config, a GPU tier without CUDA and NVMe paths that cannot be used stop
the engine naming the key; the encoder output width comes from the model (a namespace of another
width is a miss, an unknown width falls back to rows and dtype, and says so)."""

from __future__ import annotations

import pytest
import torch

import harness as H
from conftest import run_step
from connector_helpers import GPU, errors_of, inproc, same_bytes
from ectier_vllm import testing as ct


def test_inprocess_mode_is_refused_when_workers_are_other_processes(model_dir, tmp_path):
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

    from ectier.errors import ConfigError
    from ectier_vllm.connector import ECTierConnector

    cfg = H.make_vllm_config(model_dir, "ec_consumer", inproc(tmp_path))
    assert cfg.parallel_config.distributed_executor_backend == "uni"
    cfg.parallel_config.distributed_executor_backend = "mp"  # as with --tensor-parallel-size 2
    with pytest.raises(ConfigError, match=r'ec_connector_extra_config\.mode: "inprocess" \(the default\) needs .* '
                                          r'"mode": "daemon", .*VLLM_ENABLE_V1_MULTIPROCESSING=0'):
        ECTierConnector(cfg, ECConnectorRole.SCHEDULER)
    from ectier_vllm.store import open_stores

    assert open_stores() == 0


def test_bad_extra_config_stops_the_engine_with_the_key_named(model_dir, monkeypatch):
    from ectier.errors import ConfigError

    cfg = H.make_vllm_config(model_dir, "ec_consumer", {"mode": "daemon", "host": {"capacity_bytes": "1GiB"}})
    with pytest.raises(ConfigError, match=r"ec_connector_extra_config\.host: not used in daemon mode"):
        H.make_scheduler(cfg, monkeypatch)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_gpu_tier_without_cuda_stops_the_engine_naming_the_key(model_dir, tmp_path):
    """The gpu key reaches TieredCache: on a machine without CUDA the store refuses to open, and
    the error names the extra-config key (nothing is left open)."""
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

    from ectier.errors import ConfigError
    from ectier_vllm.connector import ECTierConnector
    from ectier_vllm.store import open_stores

    cfg = H.make_vllm_config(model_dir, "ec_consumer", {**inproc(tmp_path), "gpu": GPU})
    with pytest.raises(ConfigError, match=r"ec_connector_extra_config\.gpu\.capacity_bytes: .*CUDA is not available"):
        ECTierConnector(cfg, ECConnectorRole.SCHEDULER)
    assert open_stores() == 0


def warnings_of(monkeypatch):
    """The connector module's logger.warning calls, formatted (vLLM's loggers need not propagate)."""
    import ectier_vllm.connector as conn_mod

    lines: list[str] = []
    monkeypatch.setattr(conn_mod.logger, "warning", lambda fmt, *args, **kw: lines.append(fmt % args))
    return lines


def test_encoder_output_width_is_the_models(engine, tmp_path):
    """The tiny Qwen2-Audio's encoder outputs have the text hidden size (64); Qwen3-VL's deepstack
    encoders concatenate 1 + len(deepstack_visual_indexes) outputs of out_hidden_size; Qwen3-Omni
    (vision config under thinker_config) has both widths (images, audio)."""
    from types import SimpleNamespace as NS_

    from ectier_vllm.connector import encoder_output_widths

    sched, worker = engine("ec_consumer", inproc(tmp_path))
    assert ct.widths(sched.ec_connector) == ct.widths(worker.connector) == {H.WIDTH} == {64}
    deep = NS_(out_hidden_size=2048, deepstack_visual_indexes=[8, 16, 24])
    qwen3_vl_30b = NS_(hf_config=NS_(vision_config=deep), get_inputs_embeds_size=lambda: 2048)
    assert encoder_output_widths(qwen3_vl_30b) == {8192}
    omni = NS_(hf_config=NS_(thinker_config=NS_(vision_config=deep)), get_inputs_embeds_size=lambda: 2048)
    assert encoder_output_widths(omni) == {2048, 8192}

    def broken():
        raise AttributeError("no text config")

    assert encoder_output_widths(NS_(hf_config=NS_(), get_inputs_embeds_size=broken)) is None


def test_namespace_clash_with_another_width_is_a_miss_never_loaded(engine, tmp_path, monkeypatch):
    """Another model's (40, 7) bf16 entry under the same namespace: same rows and dtype as this
    request expects, but not this encoder's width: a miss with one warning naming the namespace."""
    warned = warnings_of(monkeypatch)
    sched, worker = engine("ec_both", {**inproc(tmp_path), "namespace": "shared"})
    item = H.Item("w" * 64, 0, 40)
    ct.store(sched.ec_connector).put(item.mm_hash, torch.ones(40, 7, dtype=H.DTYPE))
    sched.add_request(H.make_request("c", [item]))
    so, out = run_step(sched, worker)
    assert so.scheduled_encoder_inputs == {"c": [0]}  # re-encoded, not loaded
    assert worker.encoded == [item.mm_hash]
    assert same_bytes(worker.encoder_cache[item.mm_hash], H.encoder_output(item.mm_hash, 40))
    stats = out[0].scheduler_stats.ec_connector_stats
    assert stats["rejected"] == 1 and stats.get("hits", 0) == 0 and stats.get("loads", 0) == 0
    clash = [w for w in warned if "namespace clash" in w]
    assert len(clash) == 1 and "'shared'" in clash[0] and "(40, 7)" in clash[0] and "(40, 64)" in clash[0]
    assert errors_of(out) == {}


def test_unknown_encoder_width_falls_back_to_rows_and_dtype_and_says_so(model_dir, tmp_path, monkeypatch):
    from vllm.config import ModelConfig
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

    from ectier_vllm.connector import ECTierConnector

    warned = warnings_of(monkeypatch)
    cfg = H.make_vllm_config(model_dir, "ec_consumer", inproc(tmp_path))

    def broken(self):
        raise AttributeError("no text config")

    monkeypatch.setattr(ModelConfig, "get_inputs_embeds_size", broken)
    conn = ECTierConnector(cfg, ECConnectorRole.SCHEDULER)
    try:
        assert ct.widths(conn) is None
        assert len([w for w in warned if "cannot determine the encoder output width" in w]) == 1
    finally:
        conn.shutdown()


def test_nvme_path_that_cannot_be_created_names_the_key(model_dir, tmp_path):
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

    from ectier.errors import StoreOpenError
    from ectier_vllm.connector import ECTierConnector
    from ectier_vllm.store import open_stores

    (tmp_path / "file").write_text("x")
    extra = inproc(tmp_path)
    extra["nvme"]["path"] = str(tmp_path / "file" / "nvme")  # under a regular file
    cfg = H.make_vllm_config(model_dir, "ec_consumer", extra)
    with pytest.raises(StoreOpenError, match=r"^ec_connector_extra_config\.nvme\.path: cannot create"):
        ECTierConnector(cfg, ECConnectorRole.SCHEDULER)
    assert open_stores() == 0


def test_nvme_path_in_use_names_the_key_and_the_config_file(model_dir, tmp_path):
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole

    from ectier.cache import TieredCache
    from ectier.config import CacheConfig
    from ectier.errors import StoreLockedError
    from ectier_vllm.connector import ECTierConnector

    nvme = inproc(tmp_path)["nvme"]
    other = TieredCache(CacheConfig.from_dict({"host": {"capacity_bytes": "1MiB", "pin_memory": False}, "nvme": nvme}))
    try:
        path = tmp_path / "ectier.yaml"
        path.write_text(f"host:\n  capacity_bytes: 2MiB\n  pin_memory: false\nnvme:\n  path: {nvme['path']}\n"
                        "  capacity_bytes: 64MiB\n  sync: false\n  map_initial_bytes: 4MiB\n")
        cfg = H.make_vllm_config(model_dir, "ec_consumer", {"config_path": str(path)})
        with pytest.raises(StoreLockedError) as info:
            ECTierConnector(cfg, ECConnectorRole.SCHEDULER)
        assert str(info.value).startswith(f"ec_connector_extra_config.config_path ({str(path)!r}): nvme.path: ")
        assert "in use by another TieredCache in this process" in str(info.value)
    finally:
        other.close()
