"""How config errors reach a user: paths that no file system can hold (a NUL byte), every bad field
of a mapping or file at once, and errors from ``ECTIER_*`` variables labelled by the variable.

The command-line cases run ``ectier serve`` through click's runner: a bad config must be a usage
error (exit code 2, a message naming the field and the input at fault, no traceback) before the
daemon starts.
"""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from ectier.cli import main
from ectier.config import CacheConfig, DaemonConfig, HostTierConfig, NvmeTierConfig
from ectier.errors import ConfigError
from ectier_vllm.config import settings_from_extra_config

NUL = "a\0b"


# ------------------------------------------------------------------------------ NUL bytes


@pytest.mark.parametrize(
    "section, field",
    [("nvme", "path"), ("daemon", "socket_path"), ("daemon", "shm_dir"), ("daemon", "allowed_group"),
     ("daemon", "metrics_host")],
)
def test_a_nul_byte_in_a_path_or_name_is_a_config_error_naming_the_field(section, field):
    with pytest.raises(ConfigError, match=rf"^{section}\.{field}: contains a NUL byte"):
        CacheConfig.from_dict({section: {field: f"/tmp/{NUL}"}})
    cls = {"nvme": NvmeTierConfig, "daemon": DaemonConfig}[section]
    with pytest.raises(ConfigError, match=rf"^{section}\.{field}:"):
        cls(**{field: f"/tmp/{NUL}"})


def test_a_path_that_cannot_be_encoded_is_a_config_error():
    with pytest.raises(ConfigError, match=r"^nvme\.path: cannot be encoded"):
        NvmeTierConfig(path="/tmp/\ud800")


def test_tiered_cache_with_a_nul_in_nvme_path_raises_config_error(tmp_path):
    """Before: the config was accepted and the cache's mkdir raised a bare ValueError."""
    from ectier.cache import TieredCache

    with pytest.raises(ConfigError, match=r"^nvme\.path"):
        TieredCache(CacheConfig(host=HostTierConfig(capacity_bytes="1MiB"),
                                nvme=NvmeTierConfig(path=str(tmp_path / NUL))))


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner(env={"COLUMNS": "200"})


def _clean_env(monkeypatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("ECTIER_"):
            monkeypatch.delenv(name)


def _usage_error(result, *texts: str) -> str:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert isinstance(result.exception, SystemExit), result.exception
    error = result.output[result.output.index("Error:"):]
    for text in texts:
        assert text in error, result.output
    return error


@pytest.mark.parametrize("section, field", [("nvme", "path"), ("daemon", "socket_path")])
def test_serve_with_a_nul_byte_in_a_path_is_a_usage_error(runner, tmp_path, monkeypatch, section, field):
    """Before: `ectier serve` started and died with a ValueError traceback (embedded null byte)."""
    _clean_env(monkeypatch)
    cfg = {"host": {"capacity_bytes": "1MiB"}, "nvme": {"path": str(tmp_path / "nvme")},
           "daemon": {"socket_path": str(tmp_path / "d.sock"), "shm_dir": str(tmp_path)}}
    cfg[section][field] = str(tmp_path / NUL)
    path = tmp_path / "daemon.json"
    path.write_text(json.dumps(cfg))
    result = runner.invoke(main, ["serve", "--config", str(path)])
    _usage_error(result, "Invalid value for --config", f"{section}.{field}", "NUL")


# ------------------------------------------------------------------- every problem at once


def test_from_dict_reports_every_bad_field_at_once_first_one_first():
    data = {
        "host": {"capacity_bytes": "lots", "block_bytes": 3, "policy": "mru"},
        "nvme": {"path": "/nvme", "codec": "brotli", "sinc": True},
        "daemon": {"lease_s": -1},
        "namespace": "",
    }
    with pytest.raises(ConfigError) as info:
        CacheConfig.from_dict(data)
    err = info.value
    fields = [m.split(":")[0] for m in err.problems]
    assert fields[0] == "host.capacity_bytes"
    assert set(fields) == {"host.capacity_bytes", "host.block_bytes", "host.policy", "nvme.codec", "nvme.sinc",
                           "daemon.lease_s", "namespace"}
    assert str(err).splitlines() == list(err.problems)
    assert str(err).startswith("host.capacity_bytes: cannot read 'lots'")


def test_a_value_that_fails_to_parse_is_reported_once():
    with pytest.raises(ConfigError) as info:
        HostTierConfig(capacity_bytes="8 gigs", block_bytes="4 megs")
    assert [m.split(":")[0] for m in info.value.problems] == ["host.capacity_bytes", "host.block_bytes"]


def test_checks_across_fields_do_not_judge_a_field_that_failed():
    """nvme.map_initial_bytes failed to parse: the check 'map_max_bytes >= map_initial_bytes' must
    not compare against the default the user did not choose; nor the root's 'no tier could store'
    check against a default nvme section."""
    with pytest.raises(ConfigError) as info:
        CacheConfig.from_dict({"nvme": {"path": "/nvme", "map_initial_bytes": "big", "map_max_bytes": "2MiB"}})
    assert [m.split(":")[0] for m in info.value.problems] == ["nvme.map_initial_bytes"]
    with pytest.raises(ConfigError) as info:
        CacheConfig.from_dict({"host": {"capacity_bytes": 0}, "nvme": {"path": "/nvme", "codec": "nope"}})
    assert [m.split(":")[0] for m in info.value.problems] == ["nvme.codec"]


def test_a_yaml_file_reports_all_its_errors(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("host:\n  capacity_bytes: 1XB\n  pin_memory: maybe\nnvme:\n  zstd_level: 99\n")
    with pytest.raises(ConfigError) as info:
        CacheConfig.load(path)
    assert [m.split(":")[0] for m in info.value.problems] == ["host.capacity_bytes", "host.pin_memory",
                                                               "nvme.zstd_level"]


def test_connector_settings_prefix_every_problem_with_the_operator_key():
    with pytest.raises(ConfigError) as info:
        settings_from_extra_config({"host": {"capacity_bytes": "x", "policy": "y"}}, default_ns="m")
    lines = str(info.value).splitlines()
    assert lines == list(info.value.problems)
    assert len(lines) == 2 and all(line.startswith("ec_connector_extra_config.host.") for line in lines)


# ------------------------------------------------------------------------ ECTIER_* variables


def test_from_env_reports_every_bad_variable_and_names_them():
    env = {"ECTIER_HOST__CAPACITY_BYTES": "lots", "ECTIER_NVME__SYNC": "maybe", "ECTIER_BOGUS": "1",
           "ECTIER_NVME__CODEC": "brotli"}
    with pytest.raises(ConfigError) as info:
        CacheConfig.from_env(env)
    err = info.value
    assert len(err.problems) == 4
    assert set(err.env_vars) == set(env)


def test_from_env_labels_a_check_across_fields_with_the_variable_that_set_it():
    with pytest.raises(ConfigError) as info:
        CacheConfig.from_env({"ECTIER_HOST__CAPACITY_BYTES": "0"})
    assert info.value.env_vars == ("ECTIER_HOST__CAPACITY_BYTES",)


def test_from_env_labels_errors_of_the_config_file_it_loads(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("host:\n  capacity_bytes: lots\n")
    with pytest.raises(ConfigError, match=r"^host\.capacity_bytes") as info:
        CacheConfig.from_env({"ECTIER_CONFIG": str(path)})
    assert info.value.env_vars == ("ECTIER_CONFIG",)


def test_serve_labels_an_env_error_by_the_variable_not_config(runner, monkeypatch):
    """Before: "Invalid value for --config" although no --config was given."""
    _clean_env(monkeypatch)
    result = runner.invoke(main, ["serve"], env={"ECTIER_HOST__CAPACITY_BYTES": "lots"})
    error = _usage_error(result, "Invalid value for ECTIER_HOST__CAPACITY_BYTES", "host.capacity_bytes")
    assert "--config" not in error


def test_serve_with_a_good_config_and_a_bad_variable_names_the_variable(runner, tmp_path, monkeypatch):
    _clean_env(monkeypatch)
    path = tmp_path / "c.yaml"
    path.write_text("host:\n  capacity_bytes: 1MiB\n")
    result = runner.invoke(main, ["serve", "--config", str(path)], env={"ECTIER_NVME__CODEC": "brotli"})
    error = _usage_error(result, "Invalid value for ECTIER_NVME__CODEC", "nvme.codec")
    assert "--config" not in error


def test_serve_reports_all_problems_of_its_config_file(runner, tmp_path, monkeypatch):
    _clean_env(monkeypatch)
    path = tmp_path / "c.yaml"
    path.write_text("host:\n  capacity_bytes: lots\nnvme:\n  codec: brotli\ndaemon:\n  max_clients: 0\n")
    result = runner.invoke(main, ["serve", "--config", str(path)])
    _usage_error(result, "Invalid value for --config", "host.capacity_bytes", "nvme.codec", "daemon.max_clients")


def test_serve_reports_a_bad_file_and_bad_variables_together(runner, tmp_path, monkeypatch):
    """A bad --config hid the variables' problems: a second run then showed new ones."""
    _clean_env(monkeypatch)
    path = tmp_path / "c.yaml"
    path.write_text("host:\n  capacity_bytes: lots\n")
    env = {"ECTIER_DAEMON__LEASE_S": "-3", "ECTIER_HOST__CAPACITY_BYTE": "1"}
    result = runner.invoke(main, ["serve", "--config", str(path)], env=env)
    error = _usage_error(result, "--config", "ECTIER_DAEMON__LEASE_S", "ECTIER_HOST__CAPACITY_BYTE",
                         "host.capacity_bytes", "(from ECTIER_DAEMON__LEASE_S)", "did you mean ECTIER_HOST__CAPACITY_BYTES?")
    assert "would do nothing" not in error


def test_beside_a_bad_file_a_variable_good_with_that_file_is_not_blamed(runner, tmp_path, monkeypatch):
    """The variables are judged alone over the defaults: a check across fields (view_pin_bytes
    against a host arena the file makes larger) must not blame a variable that is fine (review)."""
    _clean_env(monkeypatch)
    path = tmp_path / "c.yaml"
    path.write_text("host:\n  capacity_bytes: 64GiB\n  capcity: 1\n")
    result = runner.invoke(main, ["serve", "--config", str(path)], env={"ECTIER_DAEMON__VIEW_PIN_BYTES": "40GiB"})
    error = _usage_error(result, "host.capcity")
    assert "view_pin_bytes" not in error and "ECTIER_DAEMON__VIEW_PIN_BYTES" not in error, error


@pytest.mark.parametrize("name, hint", [
    ("ECTIER_HOST_CAPACITY_BYTES", "did you mean ECTIER_HOST__CAPACITY_BYTES?"),  # one "_" for "__"
    ("ECTIER_HOSTS__CAPACITY_BYTES", "did you mean ECTIER_HOST__CAPACITY_BYTES?"),
    ("ECTIER_XYZ__A", "(sections: host, "),
    ("ECTIER_GPU_X", "unknown setting 'gpu_x'"),  # no hint naming a setting that does not exist either
])
def test_a_misspelt_variable_gets_a_hint(name, hint):
    with pytest.raises(ConfigError) as info:
        CacheConfig.from_env({name: "1"})
    assert info.value.env_vars == (name,) and hint in str(info.value), str(info.value)
    assert "GPU__X" not in str(info.value)


# ------------------------------------------------------------------------ daemon.socket_mode


@pytest.mark.parametrize("text, quoted", [("600", "0600"), ("660", "0660"), ("1000", "0600")])
def test_an_unquoted_decimal_socket_mode_in_yaml_is_refused_with_the_fix(tmp_path, text, quoted):
    """Regression: YAML reads an unquoted 600 as the decimal 600, which became mode 0o1130 (the
    owner could not write the socket), silently; 660 was reported as '1224 gives access to every user'."""
    path = tmp_path / "c.yaml"
    path.write_text(f"daemon:\n  socket_mode: {text}\n")
    with pytest.raises(ConfigError) as info:
        CacheConfig.load(path)
    message = str(info.value)
    assert message.startswith(f"daemon.socket_mode: {text} is above 0o777"), message
    assert "YAML" in message and "decimal" in message and f'"{quoted}"' in message, message
    with pytest.raises(ConfigError, match="daemon.socket_mode: 600 is above 0o777"):
        DaemonConfig(socket_mode=600)


@pytest.mark.parametrize("yaml_value, bits", [("0600", 0o600), ("0660", 0o660), ('"0600"', 0o600), ('"600"', 0o600),
                                              ('"0o600"', 0o600), ("384", 0o600)])
def test_socket_mode_takes_octal_strings_and_ints_of_the_mode(tmp_path, yaml_value, bits):
    """An unquoted 0600 is YAML's octal 384; JSON users give 384; strings are octal."""
    path = tmp_path / "c.yaml"
    path.write_text(f"daemon:\n  socket_mode: {yaml_value}\n")
    assert CacheConfig.load(path).daemon.socket_mode_bits == bits
    assert CacheConfig.from_dict({"daemon": {"socket_mode": 0o660}}).daemon.socket_mode == "0660"


@pytest.mark.parametrize("value, says", [(0, "leaves the socket's owner without read and write"),
                                         ("0400", "leaves the socket's owner without read and write"),
                                         (0o7777, "0o7777 sets setuid/setgid/sticky bits")])
def test_a_socket_mode_its_owner_cannot_use_or_with_special_bits_is_refused(value, says):
    """Regression: 0 was taken as 0000 (only root could connect), and YAML's octal 07777 was told
    'YAML reads an unquoted 4095 as a decimal number'."""
    with pytest.raises(ConfigError, match="^daemon.socket_mode: ") as info:
        DaemonConfig(socket_mode=value)
    assert says in str(info.value), str(info.value)


@pytest.mark.parametrize("value", [0, -1, -0.5, float("inf"), "30"])
def test_lease_s_has_one_rule_and_one_message(value):
    """Regression: lease_s 0 said 'must be > 0' but -1 said '>= 0'."""
    with pytest.raises(ConfigError, match=r"^daemon\.lease_s: expected a finite number of seconds > 0, got "):
        DaemonConfig(lease_s=value)
    assert DaemonConfig(lease_s=0.01).lease_s == 0.01


# ------------------------------------------------------------------------ duplicate keys


def test_a_key_given_twice_in_a_yaml_section_is_an_error_naming_it_the_file_and_both_lines(tmp_path):
    """Regression: the last value won silently (a user's first capacity_bytes was ignored)."""
    path = tmp_path / "c.yaml"
    path.write_text("host:\n  capacity_bytes: 1MiB\n  pin_memory: false\n  capacity_bytes: 2MiB\n"
                    "nvme:\n  zstd_level: 99\n")
    with pytest.raises(ConfigError) as info:
        CacheConfig.load(path)
    first, *rest = info.value.problems
    assert first.startswith("host.capacity_bytes: "), first
    assert str(path) in first and "lines 2 and 4" in first, first
    # the rest of the file is still judged: every problem at once, each naming its field
    assert [m.split(":")[0] for m in rest] == ["nvme.zstd_level"]


def test_a_section_given_twice_in_yaml_is_an_error_and_its_values_are_not_judged(tmp_path):
    path = tmp_path / "c.yml"
    path.write_text("host:\n  capacity_bytes: 1MiB\nnvme:\n  path: /nvme\nhost:\n  capacity_bytes: lots\n"
                    "host:\n  pin_memory: false\n")
    with pytest.raises(ConfigError) as info:
        CacheConfig.load(path)
    assert len(info.value.problems) == 1, info.value.problems
    assert info.value.problems[0].startswith("host: "), info.value.problems
    assert "lines 1, 5 and 7" in info.value.problems[0] and str(path) in info.value.problems[0]


@pytest.mark.parametrize("text", [
    "host:\n  capacity_bytes: 1MiB\nhost:\n  capacity_bytes: 2MiB\nhots: 1\n",
    "namespace: a\nnamespace: b\nnvmee: {}\n",
])
def test_a_repeated_section_keeps_the_problems_of_the_other_keys(tmp_path, text):
    """An unknown key's message lists every known name, the repeated one too: it was dropped."""
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        CacheConfig.load(path)
    assert len(info.value.problems) == 2, info.value.problems
    assert "unknown" in info.value.problems[1], info.value.problems


def test_keys_given_twice_in_json_are_errors_naming_their_dotted_path_and_the_file(tmp_path):
    path = tmp_path / "c.json"
    path.write_text('{"host": {"capacity_bytes": 1048576, "capacity_bytes": 2097152},'
                    ' "namespace": "a", "namespace": "b"}')
    with pytest.raises(ConfigError) as info:
        CacheConfig.load(path)
    assert sorted(m.split(":")[0] for m in info.value.problems) == ["host.capacity_bytes", "namespace"]
    assert all(str(path) in m for m in info.value.problems), info.value.problems
    with pytest.raises(ConfigError, match=r"^host\.capacity_bytes: given more than once"):
        CacheConfig.from_json('{"host": {"capacity_bytes": 1048576, "capacity_bytes": 1048576}}')


def test_a_daemon_setting_given_twice_stops_serve_with_a_usage_error(runner, tmp_path, monkeypatch):
    """``ectier serve --config`` reads the daemon section through the same loaders. (The file is
    checked with ``CacheConfig.load`` first: were it accepted, ``serve`` would run the daemon.)"""
    _clean_env(monkeypatch)
    json_path = tmp_path / "c.json"
    json_path.write_text('{"daemon": {"lease_s": 5, "lease_s": 10}}')
    with pytest.raises(ConfigError, match=r"^daemon\.lease_s: given more than once"):
        CacheConfig.load(json_path)
    path = tmp_path / "c.yaml"
    path.write_text(f"host:\n  capacity_bytes: 1MiB\ndaemon:\n  socket_path: {tmp_path / 'd.sock'}\n"
                    "  max_clients: 8\n  max_clients: 16\n")
    with pytest.raises(ConfigError, match=r"^daemon\.max_clients: given more than once"):
        CacheConfig.load(path)
    result = runner.invoke(main, ["serve", "--config", str(path)])
    _usage_error(result, "Invalid value for --config", "daemon.max_clients", "lines 5 and 6")


def test_a_key_next_to_a_yaml_merge_overrides_it_and_is_no_duplicate():
    """A guard for the duplicate check: ``<<:`` plus an explicit key of the same name is YAML's
    override, not a key given twice."""
    text = "host:\n  <<: {capacity_bytes: 1MiB, pin_memory: false}\n  capacity_bytes: 2MiB\n"
    config = CacheConfig.from_yaml(text)
    assert config.host.capacity_bytes == 2 << 20 and config.host.pin_memory is False


def test_a_file_that_is_no_mapping_says_what_it_holds_in_words(tmp_path):
    """Regression: a JSON file holding null said "got NoneType"."""
    for text, kind in (("null", "null"), ("[1, 2]", "a list"), ('"host"', "a string")):
        path = tmp_path / "c.json"
        path.write_text(text)
        with pytest.raises(ConfigError, match=rf"must hold a mapping at top level, got {kind}$"):
            CacheConfig.load(path)


def test_a_bad_value_in_a_config_file_names_the_file(tmp_path):
    """Regression: only duplicate keys named the file; a typo in a long file said which field, not where."""
    path = tmp_path / "c.yaml"
    path.write_text("host:\n  capcity_bytes: 1MiB\nnvme:\n  zstd_level: 99\n")
    with pytest.raises(ConfigError) as info:
        CacheConfig.load(path)
    assert [m.split(":")[0] for m in info.value.problems] == ["host.capcity_bytes", "nvme.zstd_level"]
    assert all(m.endswith(f"(in {str(path)!r})") for m in info.value.problems), info.value.problems


def test_json_text_is_not_named_as_a_file_in_errors():
    with pytest.raises(ConfigError) as info:
        CacheConfig.from_json('{"host": {"capacity_bytes": 1, "capacity_bytes": 2}}')
    assert info.value.problems[0].startswith("host.capacity_bytes: given more than once in text;"), info.value.problems


def test_a_file_with_a_repeated_key_names_itself_in_its_other_problems_too(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("host:\n  capacity_bytes: 1MiB\nhost:\n  capacity_bytes: 2MiB\nnvme:\n  zstd_level: 99\n")
    with pytest.raises(ConfigError) as info:
        CacheConfig.load(path)
    dup, other = info.value.problems
    assert dup.startswith("host: given more than once") and other.startswith("nvme.zstd_level: ")
    assert other.endswith(f"(in {str(path)!r})"), other


@pytest.mark.parametrize("text", ["[]\n", "false\n", "0\n", "''\n"])
def test_a_yaml_file_holding_an_empty_non_mapping_is_refused_not_taken_as_defaults(tmp_path, text):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match="must hold a mapping at top level"):
        CacheConfig.load(path)


@pytest.mark.parametrize("mode", ["0644", "0604", "0666", "0601"])
def test_a_socket_mode_with_bits_for_other_users_is_refused_saying_which_bits(mode):
    """0644 was refused as 'gives access to every user', which it does not (connecting needs write)."""
    with pytest.raises(ConfigError) as info:
        DaemonConfig(socket_mode=mode)
    message = str(info.value)
    assert message.startswith(f"daemon.socket_mode: {mode} sets permission bits for other users"), message
    assert "every user" not in message and "0600 or 0660" in message, message
