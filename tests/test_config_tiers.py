"""A tier section of a config file that sets the tier's fields but not the field that switches the
tier on (``nvme.path``, ``remote.backend``, ``gpu.capacity_bytes``) is an error naming that field
(ectier/config_sources.py, ``tiers_left_off``), never a store that starts without the tier and
says nothing (two-node EPD: 0 % hits, no log line)."""

from __future__ import annotations

import json

import pytest
import yaml

from ectier.config import CacheConfig
from ectier.errors import ConfigError


@pytest.mark.parametrize("section, fields, switch", [
    ("remote", {"addresses": "10.0.0.5:7000,10.0.0.6:7000"}, "remote.backend"),
    ("nvme", {"capacity_bytes": "1TiB", "write_through": True}, "nvme.path"),
    ("gpu", {"device": "cuda:1", "block_bytes": "2MiB"}, "gpu.capacity_bytes"),
])
def test_a_file_section_that_switches_nothing_on_names_the_switch(tmp_path, section, fields, switch):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"host": {"capacity_bytes": "1MiB"}, section: fields}))
    with pytest.raises(ConfigError) as info:
        CacheConfig.load(path)
    (problem,) = info.value.problems
    assert problem.startswith(f"{switch}: not set"), problem
    assert all(f"{section}.{key}" in problem for key in fields), problem  # what would do nothing
    assert problem.endswith(f"(in {str(path)!r})"), problem
    with pytest.raises(ConfigError, match=f"^{switch}: not set"):
        CacheConfig.from_json(json.dumps({section: fields}))


def test_a_switch_set_to_off_an_empty_section_and_a_full_dump_still_load(tmp_path):
    text = ("nvme:\n  path: null\n  capacity_bytes: 1TiB\nremote:\n  backend: none\n  timeout_s: 1\n"
            "gpu:\n  capacity_bytes: 0\n  device: cuda:1\n")
    cfg = CacheConfig.from_yaml(text)
    assert not cfg.nvme.enabled and not cfg.remote.enabled and not cfg.gpu.enabled
    assert CacheConfig.from_yaml("nvme: {}\nremote:\ngpu: {}\n") == CacheConfig()
    dump = tmp_path / "dump.json"
    dump.write_text(json.dumps(CacheConfig().to_dict()))  # every field, the tiers off
    assert CacheConfig.load(dump) == CacheConfig()


def test_another_problem_of_the_section_is_reported_alone():
    with pytest.raises(ConfigError) as info:
        CacheConfig.from_yaml("nvme:\n  zstd_level: 99\n")
    assert [m.split(":")[0] for m in info.value.problems] == ["nvme.zstd_level"]


def test_an_unknown_key_elsewhere_does_not_hide_the_switch_left_off(tmp_path):
    """A typo's message lists the known sections ("did you mean host? (known: ... remote ...)");
    that list is not a problem of the remote section, which is still reported (every bad field of
    a file at once, docs/operations.md). It was hidden until the typo was fixed."""
    path = tmp_path / "c.yaml"
    path.write_text("hots: 1\nremote:\n  addresses: a:1\n")
    with pytest.raises(ConfigError) as info:
        CacheConfig.load(path)
    problems = info.value.problems
    assert len(problems) == 2, problems
    assert problems[0].startswith("hots: unknown setting") and problems[1].startswith("remote.backend: not set")


def test_a_file_named_after_a_section_does_not_hide_its_switch_left_off(tmp_path):
    """Another problem's "(in '.../remote.yaml')" named the remote section, so the remote
    section's own problem was taken as reported already and left out."""
    path = tmp_path / "remote.yaml"
    path.write_text("host:\n  capacity_bytes: lots\nremote:\n  addresses: '10.0.0.1:6379'\n")
    with pytest.raises(ConfigError) as info:
        CacheConfig.load(path)
    assert [m.split(":")[0] for m in info.value.problems] == ["host.capacity_bytes", "remote.backend"]


def test_a_programs_mapping_is_not_judged_so():
    """CacheConfig.from_dict (a program's mapping, e.g. tests that inject a remote backend) keeps
    accepting a section without its switch; files and the vLLM connector's inline sections refuse it."""
    assert not CacheConfig.from_dict({"nvme": {"policy": "gdsf"}}).nvme.enabled


def test_environment_variables_that_set_a_tier_left_off_are_an_error_naming_the_switch():
    with pytest.raises(ConfigError, match="nvme.path: not set") as info:
        CacheConfig.from_env(environ={"ECTIER_NVME__CAPACITY_BYTES": "1GiB"})
    assert "ECTIER_NVME__CAPACITY_BYTES" in info.value.env_vars
    with pytest.raises(ConfigError, match="remote.backend: not set"):
        CacheConfig.from_env(environ={"ECTIER_REMOTE__ADDRESSES": "127.0.0.1:6379"})
    cfg = CacheConfig.from_env(environ={"ECTIER_REMOTE__ADDRESSES": "127.0.0.1:6379", "ECTIER_REMOTE__BACKEND": "redis"})
    assert cfg.remote.enabled
    assert CacheConfig.from_env(environ={"ECTIER_NVME__CAPACITY_BYTES": "1GiB", "ECTIER_NVME__PATH": "/tmp/x"}).nvme.enabled


def test_a_file_whose_tier_an_environment_variable_switches_on_loads(tmp_path, monkeypatch):
    import click

    from ectier.commands.daemon_cmd import load_config

    path = tmp_path / "c.yaml"
    path.write_text("nvme: {capacity_bytes: 1GiB}\n")
    monkeypatch.setenv("ECTIER_NVME__PATH", str(tmp_path / "store"))
    cfg = load_config(str(path))  # what `ectier serve --config` reads
    assert cfg.nvme.enabled and cfg.nvme.capacity_bytes == 1 << 30
    monkeypatch.delenv("ECTIER_NVME__PATH")
    with pytest.raises(click.BadParameter, match="nvme.path: not set"):
        load_config(str(path))
    with pytest.raises(ConfigError, match="nvme.path: not set"):
        CacheConfig.load(path)  # read alone, the file is still judged as it is


def test_a_programs_base_is_not_judged_by_from_env_only_what_the_variables_set(tmp_path):
    base = CacheConfig.from_dict({"nvme": {"capacity_bytes": "1GiB"}})  # from_dict accepts it
    assert CacheConfig.from_env(environ={}, base=base).nvme.capacity_bytes == 1 << 30
    with pytest.raises(ConfigError, match="nvme.path: not set") as info:
        CacheConfig.from_env(environ={"ECTIER_NVME__SYNC": "false"}, base=base)
    assert info.value.env_vars == ("ECTIER_NVME__SYNC",)
    path = tmp_path / "c.yaml"
    path.write_text("remote: {timeout_s: 7}\n")
    with pytest.raises(ConfigError, match="remote.backend: not set") as info:
        CacheConfig.from_env(environ={"ECTIER_CONFIG": str(path)})
    assert info.value.env_vars == ("ECTIER_CONFIG",) and str(path) in str(info.value)


@pytest.mark.parametrize("via", ["ECTIER_CONFIG", "serve --config"])
def test_a_variable_that_switches_a_files_tier_off_loads(tmp_path, monkeypatch, via):
    """``ECTIER_NVME__PATH=null`` / ``ECTIER_REMOTE__BACKEND=none`` over a file that sets the tier
    up: the tier off for this run (the file untouched), as a file's own ``path: null`` is. It was
    refused ("nvme.path: not set ... (in the file)") although the variable set it."""
    from ectier.commands.daemon_cmd import load_config

    path = tmp_path / "c.yaml"
    path.write_text(f"nvme: {{path: {tmp_path / 'store'}, capacity_bytes: 1GiB, codec: zstd}}\n"
                    "remote: {backend: redis, addresses: '127.0.0.1:6379'}\n")
    monkeypatch.setenv("ECTIER_NVME__PATH", "null")
    monkeypatch.setenv("ECTIER_REMOTE__BACKEND", "none")
    if via == "ECTIER_CONFIG":
        monkeypatch.setenv("ECTIER_CONFIG", str(path))
        cfg = CacheConfig.from_env()
    else:
        cfg = load_config(str(path))
    assert not cfg.nvme.enabled and not cfg.remote.enabled


@pytest.mark.parametrize("via", ["ECTIER_CONFIG", "serve --config"])
def test_a_file_that_gives_the_switch_off_loads_under_variables_as_alone(tmp_path, monkeypatch, via):
    """A file whose section gives the switch as its off value (``nvme: {path: null, ...}``) loads
    through ``ECTIER_CONFIG`` and ``ectier serve --config`` as it does through ``CacheConfig.load``;
    a variable that sets a field of that tier, without its switch, is still refused."""
    import click

    from ectier.commands.daemon_cmd import load_config

    path = tmp_path / "c.yaml"
    path.write_text("nvme: {path: null, capacity_bytes: 1GiB}\n")
    assert not CacheConfig.load(path).nvme.enabled
    monkeypatch.setenv("ECTIER_HOST__CAPACITY_BYTES", "1MiB")
    if via == "ECTIER_CONFIG":
        monkeypatch.setenv("ECTIER_CONFIG", str(path))
        load = CacheConfig.from_env
        refused = ConfigError
    else:
        load = lambda: load_config(str(path))  # noqa: E731
        refused = click.BadParameter
    cfg = load()
    assert not cfg.nvme.enabled and cfg.host.capacity_bytes == 1 << 20
    monkeypatch.setenv("ECTIER_NVME__CODEC", "zstd")
    with pytest.raises(refused, match="nvme.path: not set"):
        load()


def test_the_module_docstring_tree_names_every_field():
    """ectier/config.py's tree of fields (what a reader sees first) names every field of every
    section: a field added to a dataclass and not to the tree fails here."""
    import dataclasses
    import re

    import ectier.config as config_module

    tree = config_module.__doc__.split("Every field is checked")[0]
    words = set(re.findall(r"\w+", tree))
    cfg = config_module.CacheConfig()
    missing = [f"{top.name}.{f.name}" for top in dataclasses.fields(cfg) if dataclasses.is_dataclass(getattr(cfg, top.name))
               for f in dataclasses.fields(getattr(cfg, top.name)) if f.name not in words]
    missing += [f.name for f in dataclasses.fields(cfg) if f.name not in words]
    assert missing == []
