"""The short flag: ``"ec_connector": "ECTierConnector"`` without ``ec_connector_module_path``,
through ectier's ``vllm.general_plugins`` entry point (docs/vllm.md, "Enable the connector")."""

from __future__ import annotations

import ast
import os

import pytest

import harness as H

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENTRY_POINT = "ectier = ectier_vllm.plugin:register"


@pytest.fixture
def registry(monkeypatch):
    """vLLM's EC connector registry as a fresh vLLM process has it (no ECTierConnector yet)."""
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    fresh = {k: v for k, v in ECConnectorFactory._registry.items() if k != "ECTierConnector"}
    monkeypatch.setattr(ECConnectorFactory, "_registry", fresh)
    return fresh


def declared_entry_points() -> dict[str, list[str]]:
    """setup.py's ``entry_points=`` literal."""
    with open(os.path.join(ROOT, "setup.py"), encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "setup":
            for kw in node.keywords:
                if kw.arg == "entry_points":
                    return ast.literal_eval(kw.value)
    raise AssertionError("setup.py has no setup(entry_points=...)")


def short_form_config(model_dir, tmp_path):
    return H.make_vllm_config(model_dir, "ec_both", {"namespace": "plugin-test", "host": {
        "capacity_bytes": "4MiB", "block_bytes": "64KiB", "pin_memory": False}}, module_path=None)


def test_plugin_registers_the_name_so_the_factory_needs_no_module_path(registry, model_dir, tmp_path):
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    from ectier_vllm.connector import ECTierConnector
    from ectier_vllm.plugin import register

    cfg = short_form_config(model_dir, tmp_path)
    assert cfg.ec_transfer_config.ec_connector_module_path is None
    with pytest.raises(ValueError, match="Unsupported connector type: ECTierConnector"):
        ECConnectorFactory.create_connector(cfg, ECConnectorRole.SCHEDULER)  # no plugin: vLLM refuses
    register()
    register()  # vLLM may load plugins more than once per process
    conn = ECConnectorFactory.create_connector(cfg, ECConnectorRole.SCHEDULER)
    try:
        assert type(conn) is ECTierConnector and conn.settings.namespace == "plugin-test"
    finally:
        conn.shutdown()


def test_setup_declares_the_plugin_entry_point():
    from importlib.metadata import EntryPoint

    from ectier_vllm.plugin import register

    declared = declared_entry_points()
    assert ENTRY_POINT in declared.get("vllm.general_plugins", []), declared
    name, value = (part.strip() for part in ENTRY_POINT.split("="))
    assert EntryPoint(name, value, "vllm.general_plugins").load() is register


def test_vllm_loads_the_plugin_from_installed_metadata(registry, model_dir, tmp_path, monkeypatch):
    """An ``ectier`` distribution whose entry_points.txt is what setup.py declares (as pip writes
    it into site-packages) is found and run by vLLM's own plugin loader."""
    import vllm.plugins
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    from ectier_vllm.connector import ECTierConnector

    site = tmp_path / "site-packages"
    dist = site / "ectier-0.1.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: ectier\nVersion: 0.1.0\n")
    lines = [f"[{group}]\n" + "".join(f"{spec}\n" for spec in specs) for group, specs in declared_entry_points().items()]
    (dist / "entry_points.txt").write_text("\n".join(lines))
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("VLLM_PLUGINS", "ectier")  # only ours (vLLM's own LoRA resolver plugins aside)
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    vllm.plugins.load_general_plugins()
    assert "ECTierConnector" in ECConnectorFactory._registry
    conn = ECConnectorFactory.create_connector(short_form_config(model_dir, tmp_path), ECConnectorRole.WORKER)
    try:
        assert type(conn) is ECTierConnector
    finally:
        conn.shutdown()
