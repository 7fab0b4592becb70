"""ec_connector_extra_config → ectier settings (bindings/ectier_vllm/config.py), without vLLM.

The mapping module imports neither vLLM nor torch, so the core suite tests it; the connector itself
is tested inside vLLM by tests_vllm/ (scripts/test_vllm.sh).
"""

from __future__ import annotations

import subprocess
import sys

import pytest

from ectier.errors import ConfigError
from ectier_vllm.config import ConnectorSettings, default_namespace, settings_from_extra_config

NS = "Qwen/Qwen3-VL-30B-A3B-Instruct@main:bfloat16"


def test_default_namespace_names_model_revision_dtype():
    import torch

    assert default_namespace("Qwen/Qwen3-VL-30B-A3B-Instruct", None, torch.bfloat16) == NS
    assert default_namespace("m", "abc123", "float16") == "m@abc123:float16"


def test_defaults_are_inprocess_with_the_engine_namespace():
    s = settings_from_extra_config(None, default_ns=NS)
    assert isinstance(s, ConnectorSettings)
    assert s.mode == "inprocess" and s.namespace == NS and s.cache.namespace == NS
    assert s.load_timeout_s == 10.0
    assert s.save_queue_depth == 16
    assert settings_from_extra_config({"mode": "daemon", "save_queue_depth": 3}, default_ns=NS).save_queue_depth == 3


def test_remote_section_maps_onto_cache_config():
    s = settings_from_extra_config({"remote": {"backend": "redis", "addresses": "10.0.0.5:7000", "timeout_s": 1}},
                                   default_ns=NS)
    assert s.cache.remote.enabled and s.cache.remote.addresses == "10.0.0.5:7000" and s.cache.remote.timeout_s == 1.0
    with pytest.raises(ConfigError, match=r"ec_connector_extra_config\.remote: not used in daemon mode"):
        settings_from_extra_config({"mode": "daemon", "remote": {"backend": "redis"}}, default_ns=NS)


def test_tier_sub_dicts_map_onto_cache_config():
    s = settings_from_extra_config(
        {"host": {"capacity_bytes": "2GiB", "pin_memory": False},
         "nvme": {"path": "/nvme/ectier", "capacity_bytes": "100GiB", "codec": "zstd-planes"},
         "namespace": "custom", "load_timeout_s": 2},
        default_ns=NS,
    )
    assert s.cache.host.capacity_bytes == 2 << 30 and s.cache.host.pin_memory is False
    assert s.cache.nvme.path == "/nvme/ectier" and s.cache.nvme.codec == "zstd-planes"
    assert s.namespace == "custom" == s.cache.namespace and s.load_timeout_s == 2.0


def test_daemon_mode():
    s = settings_from_extra_config({"mode": "daemon", "socket_path": "/run/ectier/ectier.sock",
                                    "daemon_timeout_s": 5}, default_ns=NS)
    assert s.mode == "daemon" and s.cache is None and s.socket_path == "/run/ectier/ectier.sock"
    assert s.daemon_timeout_s == 5.0
    assert s.daemon_answer_wait_s == 0.0  # the default (docs/vllm.md)


def test_config_path(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("host:\n  capacity_bytes: 64MiB\n")
    s = settings_from_extra_config({"config_path": str(p)}, default_ns=NS)
    assert s.cache.host.capacity_bytes == 64 << 20 and s.cache.namespace == NS


@pytest.mark.parametrize(
    "extra, needle",
    [
        ({"hosts": {}}, "ec_connector_extra_config.hosts: unknown key (did you mean 'host'?)"),
        ({"mode": "remote"}, "ec_connector_extra_config.mode: expected one of inprocess, daemon"),
        ({"namespace": ""}, "ec_connector_extra_config.namespace"),
        ({"load_timeout_s": 0}, "ec_connector_extra_config.load_timeout_s"),
        ({"load_timeout_s": True}, "ec_connector_extra_config.load_timeout_s"),
        ({"save_queue_depth": 0}, "ec_connector_extra_config.save_queue_depth: expected an int from 1"),
        ({"save_queue_depth": 2.5}, "ec_connector_extra_config.save_queue_depth"),
        ({"mode": "daemon", "daemon_timeout_s": float("inf")}, "ec_connector_extra_config.daemon_timeout_s"),
        ({"host": {"capacity_bytes": "lots"}}, "ec_connector_extra_config.host.capacity_bytes"),
        ({"host": {"capacty_bytes": 1}}, "ec_connector_extra_config.host.capacty_bytes"),
        ({"host": 5}, "ec_connector_extra_config.host: expected a mapping"),
        ({"mode": "daemon", "host": {}}, "ec_connector_extra_config.host: not used in daemon mode"),
        ({"daemon_timeout_s": 2}, "ec_connector_extra_config.daemon_timeout_s: only used in daemon mode"),
        ({"mode": "daemon", "daemon_answer_wait_s": -1}, "ec_connector_extra_config.daemon_answer_wait_s: expected"),
        ({"mode": "daemon", "daemon_answer_wait_s": 2}, "ec_connector_extra_config.daemon_answer_wait_s: expected"),
        ({"mode": "daemon", "daemon_answer_wait_s": True}, "ec_connector_extra_config.daemon_answer_wait_s"),
        ({"daemon_answer_wait_s": 0.001}, "ec_connector_extra_config.daemon_answer_wait_s: only used in daemon mode"),
        ({"socket_path": "/x.sock"}, "ec_connector_extra_config.socket_path: only used in daemon mode"),
        ({"mode": "daemon", "config_path": "x.yaml"}, "ec_connector_extra_config.config_path: not used in daemon mode"),
        ({"socket_path": "/x.sock"}, "ec_connector_extra_config.socket_path: only used in daemon mode"),
        ({"mode": "daemon", "socket_path": ""}, "ec_connector_extra_config.socket_path"),
        ({"config_path": "x.yaml", "host": {}}, "ec_connector_extra_config.config_path: give either"),
        ({"config_path": "/does/not/exist.yaml"},
         "ec_connector_extra_config.config_path: cannot read YAML file '/does/not/exist.yaml'"),
        ({"config_path": ""}, "ec_connector_extra_config.config_path: expected a path string"),
        ([1, 2], "ec_connector_extra_config: expected a mapping"),
    ],
)
def test_invalid_extra_config_names_the_key(extra, needle):
    with pytest.raises(ConfigError) as info:
        settings_from_extra_config(extra, default_ns=NS)
    assert needle in str(info.value)


def test_gpu_key_maps_onto_cache_config_gpu():
    s = settings_from_extra_config(
        {"gpu": {"device": "cuda:1", "capacity_bytes": "2GiB", "block_bytes": "2MiB", "policy": "gdsf",
                 "copy_streams": 4}, "host": {"capacity_bytes": "1GiB"}},
        default_ns=NS,
    )
    gpu = s.cache.gpu
    assert gpu.enabled and gpu.device == "cuda:1" and gpu.capacity_bytes == 2 << 30
    assert gpu.block_bytes == 2 << 20 and gpu.policy == "gdsf" and gpu.copy_streams == 4
    assert s.cache.host.capacity_bytes == 1 << 30
    assert not settings_from_extra_config({}, default_ns=NS).cache.gpu.enabled  # off unless asked


@pytest.mark.parametrize(
    "gpu, needle",
    [
        ({"device": "cuda"}, "ec_connector_extra_config.gpu.device: expected an explicit 'cuda:<index>'"),
        ({"block_bytes": 1000}, "ec_connector_extra_config.gpu.block_bytes"),
        ({"capacity_bytes": "lots"}, "ec_connector_extra_config.gpu.capacity_bytes"),
        ({"copy_streams": 9}, "ec_connector_extra_config.gpu.copy_streams"),
        ({"policy": "fifo"}, "ec_connector_extra_config.gpu.policy"),
        ({"capacty_bytes": 1}, "ec_connector_extra_config.gpu.capacty_bytes: unknown setting"),
        (3, "ec_connector_extra_config.gpu: expected a mapping"),
    ],
)
def test_invalid_gpu_sub_config_names_the_field(gpu, needle):
    with pytest.raises(ConfigError) as info:
        settings_from_extra_config({"gpu": gpu}, default_ns=NS)
    assert needle in str(info.value)


@pytest.mark.parametrize(
    "extra, needle",
    [
        ({"namespace": "n" * 4097}, "ec_connector_extra_config.namespace: longer than 4096 bytes"),
        ({"namespace": "ns\ud800"}, "ec_connector_extra_config.namespace: not encodable as UTF-8"),
        ({"socket_path": "/tmp/" + "s" * 150 + ".sock"},
         "ec_connector_extra_config.socket_path: 160 bytes, longer than the 107 bytes"),
        ({"socket_path": "/tmp/a\0b.sock"}, "ec_connector_extra_config.socket_path: contains a NUL byte"),
        ({"daemon_timeout_s": 1e-6}, "ec_connector_extra_config.daemon_timeout_s: at least 0.01 s"),
        ({"daemon_timeout_s": 0.009}, "ec_connector_extra_config.daemon_timeout_s: at least 0.01 s"),
    ],
)
def test_daemon_mode_refuses_at_start_what_would_fail_every_call(extra, needle):
    """Regression: daemon mode started with these and then every save failed and every lookup
    missed (the in-process store refused the namespace at start-up; the socket path and the
    timeout could never work)."""
    with pytest.raises(ConfigError) as info:
        settings_from_extra_config({"mode": "daemon", **extra}, default_ns=NS)
    assert needle in str(info.value)


def test_daemon_mode_edge_values_still_start():
    s = settings_from_extra_config({"mode": "daemon", "namespace": "n" * 4096, "daemon_timeout_s": 0.01,
                                    "socket_path": "/" + "s" * 106}, default_ns=NS)
    assert s.daemon_timeout_s == 0.01 and len(s.socket_path) == 107 and len(s.namespace) == 4096


def test_a_namespace_no_store_takes_is_refused_in_process_too():
    with pytest.raises(ConfigError, match=r"^ec_connector_extra_config\.namespace: not encodable as UTF-8"):
        settings_from_extra_config({"namespace": "ns\ud800"}, default_ns=NS)


@pytest.mark.parametrize("extra, needle", [
    ({"remote": {"addresses": "10.0.0.5:7000,10.0.0.6:7000"}}, "ec_connector_extra_config.remote.backend: not set"),
    ({"nvme": {"capacity_bytes": "1TiB", "write_through": True}}, "ec_connector_extra_config.nvme.path: not set"),
    ({"gpu": {"device": "cuda:0"}}, "ec_connector_extra_config.gpu.capacity_bytes: not set"),
])
def test_an_inline_tier_that_switches_nothing_on_is_refused(extra, needle):
    """Regression: these started a host-only store with no error (two-node EPD: 0 % hits)."""
    with pytest.raises(ConfigError) as info:
        settings_from_extra_config({"namespace": "ns", **extra}, default_ns=NS)
    assert str(info.value).startswith(needle), str(info.value)


def test_an_inline_tier_switched_off_explicitly_still_starts(tmp_path):
    s = settings_from_extra_config({"nvme": {"path": None, "capacity_bytes": "1TiB"},
                                    "remote": {"backend": "none"}}, default_ns=NS)
    assert not s.cache.nvme.enabled and not s.cache.remote.enabled
    p = tmp_path / "c.yaml"
    p.write_text("remote:\n  addresses: 10.0.0.5:7000\n")
    with pytest.raises(ConfigError, match=r"^ec_connector_extra_config\.config_path \(.*\): remote\.backend: not set"):
        settings_from_extra_config({"config_path": str(p)}, default_ns=NS)


def test_gpu_key_is_refused_in_daemon_mode():
    with pytest.raises(ConfigError, match=r"ec_connector_extra_config\.gpu: not used in daemon mode"):
        settings_from_extra_config({"mode": "daemon", "gpu": {"capacity_bytes": "1GiB"}}, default_ns=NS)


def test_mapping_module_imports_neither_vllm_nor_torch():
    code = ("import sys, ectier_vllm.config; "
            "bad = [m for m in ('vllm', 'torch') if m in sys.modules]; assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_bad_field_in_the_config_file_names_the_file_and_the_field(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("host:\n  capacity_bytez: 64MiB\n")
    with pytest.raises(ConfigError) as info:
        settings_from_extra_config({"config_path": str(p)}, default_ns=NS)
    msg = str(info.value)
    assert msg.startswith(f"ec_connector_extra_config.config_path ({str(p)!r}): host.capacity_bytez: "), msg
    assert "ec_connector_extra_config.host." not in msg  # not reported as if it were inline
    assert msg.count(str(p)) == 1, msg  # named once, in front
