"""Tests for ectier.config: defaults, validation messages, loaders (dict, JSON, YAML, env), round
trips and immutability (byte counts: tests/test_config_bytes.py)."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from ectier.config import CacheConfig, HostTierConfig, NvmeTierConfig
from ectier.errors import ConfigError, EctierError

KiB, MiB, GiB, TiB = 1024, 1024**2, 1024**3, 1024**4


# -------------------------------------------------------------------------------- defaults


def test_defaults_are_valid_and_documented_values():
    c = CacheConfig()
    assert c.namespace == "default"
    assert c.host == HostTierConfig() and c.nvme == NvmeTierConfig()
    assert c.host.capacity_bytes == GiB
    assert c.host.block_bytes == 256 * KiB
    assert c.host.pin_memory is None
    assert c.host.admit_wait_s == 5.0
    assert c.nvme.path is None and not c.nvme.enabled
    assert c.nvme.capacity_bytes == 16 * GiB
    assert c.nvme.codec == "raw"
    assert c.nvme.sync is True and c.nvme.write_through is False and c.nvme.flush_on_close is True
    assert c.nvme.map_initial_bytes == 256 * MiB and c.nvme.map_max_bytes is None


def test_config_error_is_an_ectier_value_error():
    assert issubclass(ConfigError, EctierError) and issubclass(ConfigError, ValueError)


def test_frozen():
    c = CacheConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.namespace = "x"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.host.capacity_bytes = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.nvme.path = "/tmp"  # type: ignore[misc]


def test_map_ceiling_bytes():
    assert NvmeTierConfig(capacity_bytes=GiB).map_ceiling_bytes == 2 * GiB + 256 * MiB
    assert NvmeTierConfig(map_max_bytes=512 * MiB).map_ceiling_bytes == 512 * MiB
    assert NvmeTierConfig(capacity_bytes=0, map_initial_bytes=512 * MiB).map_ceiling_bytes == 512 * MiB


def test_nvme_path_accepts_pathlike(tmp_path):
    n = NvmeTierConfig(path=tmp_path)
    assert n.path == str(tmp_path) and isinstance(n.path, str) and n.enabled


def test_replace_revalidates():
    c = CacheConfig()
    assert c.replace(namespace="m").namespace == "m"
    with pytest.raises(ConfigError, match="^namespace"):
        c.replace(namespace="")
    with pytest.raises(ConfigError, match=r"unknown field\(s\) hots; the fields are .*host"):
        c.replace(hots=None)
    assert c.replace(namespace="m") == dataclasses.replace(c, namespace="m")


# ----------------------------------------------------------------------- field validation

# (section, field, bad value): every one must raise ConfigError whose message starts with the
# dotted field name, both from the dataclass constructor and from from_dict.
BAD_FIELDS = [
    ("host", "capacity_bytes", -1),
    ("host", "capacity_bytes", 1.5),
    ("host", "capacity_bytes", True),
    ("host", "block_bytes", 3 * KiB),
    ("host", "block_bytes", 5 * KiB),  # not a power of two
    ("host", "block_bytes", 128 * MiB),  # above 64 MiB
    ("host", "block_bytes", 0),
    ("host", "pin_memory", "yes"),
    ("host", "pin_memory", 1),
    ("host", "admit_wait_s", -0.1),
    ("host", "admit_wait_s", "5"),
    ("host", "admit_wait_s", True),
    ("host", "admit_wait_s", math.nan),
    ("nvme", "path", ""),
    ("nvme", "path", 42),
    ("nvme", "capacity_bytes", -5),
    ("nvme", "codec", "lz4"),
    ("nvme", "codec", 0),
    ("nvme", "zstd_level", 23),
    ("nvme", "zstd_level", -8),
    ("nvme", "zstd_level", 1.0),
    ("nvme", "sync", "false"),
    ("nvme", "write_through", 0),
    ("nvme", "flush_on_close", None),
    ("nvme", "map_initial_bytes", MiB - 1),
    ("nvme", "map_max_bytes", MiB - 1),
    ("nvme", "map_max_bytes", 128 * MiB),  # below map_initial_bytes (256 MiB)
]
SECTION_CLS = {"host": HostTierConfig, "nvme": NvmeTierConfig}


@pytest.mark.parametrize("section, name, value", BAD_FIELDS, ids=[f"{s}.{n}={v!r}" for s, n, v in BAD_FIELDS])
def test_bad_field_from_constructor_names_dotted_field(section, name, value):
    with pytest.raises(ConfigError) as info:
        SECTION_CLS[section](**{name: value})
    assert str(info.value).startswith(f"{section}.{name}:"), str(info.value)


@pytest.mark.parametrize("section, name, value", BAD_FIELDS, ids=[f"{s}.{n}={v!r}" for s, n, v in BAD_FIELDS])
def test_bad_field_from_dict_names_dotted_field(section, name, value):
    with pytest.raises(ConfigError) as info:
        CacheConfig.from_dict({section: {name: value}})
    assert str(info.value).startswith(f"{section}.{name}:"), str(info.value)


@pytest.mark.parametrize("value", ["", 5, None, "x" * 4097, "é" * 2049])
def test_bad_namespace(value):
    with pytest.raises(ConfigError, match="^namespace"):
        CacheConfig(namespace=value)


def test_namespace_limit_is_in_bytes():
    CacheConfig(namespace="x" * 4096)
    CacheConfig(namespace="é" * 2048)  # 4096 bytes


@pytest.mark.parametrize("block", [4 * KiB, 8 * KiB, 256 * KiB, 64 * MiB])
def test_good_block_sizes(block):
    assert HostTierConfig(block_bytes=block).block_bytes == block


def test_known_codecs_accepted():
    for name in ("raw", "zstd", "zstd-planes"):
        assert NvmeTierConfig(codec=name).codec == name


def test_unknown_codec_names_field_and_lists_known():
    with pytest.raises(ConfigError) as info:
        CacheConfig.from_dict({"nvme": {"codec": "zstd-plane"}})
    msg = str(info.value)
    assert msg.startswith("nvme.codec:") and "zstd-planes" in msg and "raw" in msg


def test_host_capacity_zero_needs_nvme(tmp_path):
    with pytest.raises(ConfigError, match=r"^host\.capacity_bytes.*nvme\.path"):
        CacheConfig(host=HostTierConfig(capacity_bytes=0))
    c = CacheConfig(host=HostTierConfig(capacity_bytes=0), nvme=NvmeTierConfig(path=str(tmp_path)))
    assert c.host.capacity_bytes == 0


@pytest.mark.parametrize("field, value", [("host", {"capacity_bytes": 1}), ("nvme", "raw")])
def test_section_of_wrong_type(field, value):
    with pytest.raises(ConfigError, match=f"^{field}"):
        CacheConfig(**{field: value})


# -------------------------------------------------------------------------------- from_dict


def test_from_dict_parses_byte_strings_everywhere():
    c = CacheConfig.from_dict(
        {
            "namespace": "Qwen/Qwen3-VL@main:bfloat16",
            "host": {"capacity_bytes": "4GiB", "block_bytes": "1MiB", "pin_memory": False, "admit_wait_s": 0.5},
            "nvme": {
                "path": "/nvme/ec",
                "capacity_bytes": "2GB",
                "codec": "zstd-planes",
                "zstd_level": 3,
                "sync": False,
                "map_initial_bytes": "512MiB",
                "map_max_bytes": "10GiB",
            },
        }
    )
    assert c.namespace == "Qwen/Qwen3-VL@main:bfloat16"
    assert c.host == HostTierConfig(4 * GiB, MiB, False, 0.5)
    assert c.nvme.capacity_bytes == 2 * 10**9
    assert c.nvme.map_initial_bytes == 512 * MiB and c.nvme.map_max_bytes == 10 * GiB
    assert (c.nvme.codec, c.nvme.zstd_level, c.nvme.sync) == ("zstd-planes", 3, False)


def test_from_dict_empty_and_null_sections_are_defaults():
    assert CacheConfig.from_dict({}) == CacheConfig()
    assert CacheConfig.from_dict({"host": None, "nvme": {}}) == CacheConfig()


def test_from_dict_accepts_section_objects():
    host = HostTierConfig(capacity_bytes=MiB)
    assert CacheConfig.from_dict({"host": host}).host is host


@pytest.mark.parametrize(
    "data, dotted, hint",
    [
        ({"hots": {}}, "hots", "host"),
        ({"host": {"capacity": 1}}, "host.capacity", "host.capacity_bytes"),
        ({"nvme": {"zstd_levle": 3}}, "nvme.zstd_levle", "nvme.zstd_level"),
        ({"namespce": "x"}, "namespce", "namespace"),
    ],
)
def test_from_dict_unknown_key_did_you_mean(data, dotted, hint):
    with pytest.raises(ConfigError) as info:
        CacheConfig.from_dict(data)
    msg = str(info.value)
    assert msg.startswith(f"{dotted}: unknown setting")
    assert f"did you mean {hint}?" in msg


def test_from_dict_unknown_key_without_close_match_lists_known():
    with pytest.raises(ConfigError) as info:
        CacheConfig.from_dict({"host": {"zzzzzz": 1}})
    msg = str(info.value)
    assert msg.startswith("host.zzzzzz: unknown setting") and "did you mean" not in msg
    assert "capacity_bytes" in msg and "block_bytes" in msg


@pytest.mark.parametrize("data, name", [([], "config"), ({"host": 5}, "host"), ({"nvme": "x"}, "nvme")])
def test_from_dict_non_mapping(data, name):
    with pytest.raises(ConfigError, match=f"^{name}: expected a mapping"):
        CacheConfig.from_dict(data)


def _nondefault() -> CacheConfig:
    return CacheConfig(
        namespace="m:bf16",
        host=HostTierConfig(capacity_bytes=3 * GiB, block_bytes=64 * KiB, pin_memory=True, admit_wait_s=1.25),
        nvme=NvmeTierConfig(
            path="/data/ec", capacity_bytes=5 * GiB, codec="zstd", zstd_level=-3, sync=False,
            write_through=True, flush_on_close=False, map_initial_bytes=64 * MiB, map_max_bytes=GiB,
        ),
    )


def test_to_dict_round_trip_and_json_serializable():
    c = _nondefault()
    d = c.to_dict()
    assert d["host"]["capacity_bytes"] == 3 * GiB and d["nvme"]["path"] == "/data/ec"
    assert CacheConfig.from_dict(d) == c
    assert CacheConfig.from_dict(json.loads(json.dumps(d))) == c
    assert CacheConfig.from_dict(CacheConfig().to_dict()) == CacheConfig()


# --------------------------------------------------------------------------------- files


def test_from_json_file_and_text(tmp_path):
    c = _nondefault()
    text = json.dumps(c.to_dict())
    p = tmp_path / "c.json"
    p.write_text(text)
    assert CacheConfig.from_json(p) == c
    assert CacheConfig.from_json(str(p)) == c
    assert CacheConfig.from_json(text) == c
    assert CacheConfig.from_json('{"host": {"capacity_bytes": "2MiB"}}').host.capacity_bytes == 2 * MiB


def test_from_json_errors(tmp_path):
    with pytest.raises(ConfigError, match="invalid JSON"):
        CacheConfig.from_json("{not json")
    with pytest.raises(ConfigError, match="cannot read"):
        CacheConfig.from_json(tmp_path / "missing.json")
    p = tmp_path / "list.json"
    p.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="mapping"):
        CacheConfig.from_json(p)
    with pytest.raises(ConfigError, match=r"^host\.capacity_bytes"):
        CacheConfig.from_json('{"host": {"capacity_bytes": "lots"}}')


def test_from_yaml_file_and_text(tmp_path):
    text = "namespace: m\nhost:\n  capacity_bytes: 4GiB\n  pin_memory: false\nnvme:\n  path: /x\n  map_max_bytes: null\n"
    p = tmp_path / "c.yaml"
    p.write_text(text)
    for source in (p, str(p), text):
        c = CacheConfig.from_yaml(source)
        assert c.namespace == "m"
        assert c.host.capacity_bytes == 4 * GiB and c.host.pin_memory is False
        assert c.nvme.path == "/x" and c.nvme.map_max_bytes is None


def test_from_yaml_empty_file_is_defaults_and_errors(tmp_path):
    p = tmp_path / "empty.yaml"
    p.write_text("")
    assert CacheConfig.from_yaml(p) == CacheConfig()
    with pytest.raises(ConfigError, match="invalid YAML"):
        CacheConfig.from_yaml("host: [\n")
    with pytest.raises(ConfigError, match="mapping"):
        CacheConfig.from_yaml("- a\n- b\n")
    with pytest.raises(ConfigError, match=r"^nvme\.sinc: unknown setting; did you mean nvme\.sync"):
        CacheConfig.from_yaml("nvme:\n  sinc: true\n")


@pytest.mark.parametrize("suffix", [".json", ".yaml", ".yml", ".JSON"])
def test_load_by_suffix(tmp_path, suffix):
    c = _nondefault()
    p = tmp_path / f"cfg{suffix}"
    if suffix.lower() == ".json":
        p.write_text(json.dumps(c.to_dict()))
    else:
        import yaml

        p.write_text(yaml.safe_dump(c.to_dict()))
    assert CacheConfig.load(p) == c
    assert CacheConfig.load(str(p)) == c


def test_load_unknown_suffix(tmp_path):
    p = tmp_path / "cfg.toml"
    p.write_text("")
    with pytest.raises(ConfigError, match=r"\.json, \.yaml or \.yml"):
        CacheConfig.load(p)


# ---------------------------------------------------------------------------------- env


def test_from_env_overlays_defaults():
    c = CacheConfig.from_env(
        {
            "ECTIER_NAMESPACE": "model-a",
            "ECTIER_HOST__CAPACITY_BYTES": "2GiB",
            "ECTIER_HOST__PIN_MEMORY": "no",
            "ECTIER_HOST__ADMIT_WAIT_S": "0.25",
            "ECTIER_NVME__PATH": "/nvme/ec",
            "ECTIER_NVME__SYNC": "false",
            "ECTIER_NVME__WRITE_THROUGH": "1",
            "ECTIER_NVME__MAP_MAX_BYTES": "none",
            "ECTIER_NVME__CODEC": "zstd",
            "PATH": "/usr/bin",  # not ours: ignored
            "OTHER_ECTIER_HOST": "x",
        }
    )
    assert c.namespace == "model-a"
    assert c.host.capacity_bytes == 2 * GiB and c.host.pin_memory is False and c.host.admit_wait_s == 0.25
    assert c.nvme.path == "/nvme/ec" and c.nvme.sync is False and c.nvme.write_through is True
    assert c.nvme.map_max_bytes is None and c.nvme.codec == "zstd"
    # untouched fields keep their defaults
    assert c.host.block_bytes == 256 * KiB and c.nvme.flush_on_close is True


def test_from_env_empty_is_defaults():
    assert CacheConfig.from_env({}) == CacheConfig()


@pytest.mark.parametrize(
    "raw, expected", [("true", True), ("YES", True), ("on", True), ("0", False), ("Off", False), ("null", None)]
)
def test_from_env_booleans_and_null(raw, expected):
    assert CacheConfig.from_env({"ECTIER_HOST__PIN_MEMORY": raw}).host.pin_memory is expected


NVME_ON = {"ECTIER_NVME__PATH": "/nvme/ec"}  # (an NVMe field without the tier's path is an error)


def test_from_env_plain_int_field():
    assert CacheConfig.from_env({**NVME_ON, "ECTIER_NVME__ZSTD_LEVEL": "5"}).nvme.zstd_level == 5
    with pytest.raises(ConfigError, match="ECTIER_NVME__ZSTD_LEVEL"):
        CacheConfig.from_env({**NVME_ON, "ECTIER_NVME__ZSTD_LEVEL": "high"})


def test_from_env_map_max_bytes_value():
    c = CacheConfig.from_env({**NVME_ON, "ECTIER_NVME__MAP_MAX_BYTES": "8GiB"})
    assert c.nvme.map_max_bytes == 8 * GiB


@pytest.mark.parametrize(
    "env, match",
    [
        ({"ECTIER_NVME__SYNC": "maybe"}, "^ECTIER_NVME__SYNC: expected true/false"),
        ({"ECTIER_HOST__ADMIT_WAIT_S": "soon"}, "^ECTIER_HOST__ADMIT_WAIT_S"),
        ({"ECTIER_HOST__ADMIT_WAIT_S": "nan"}, r"^host\.admit_wait_s"),
        ({"ECTIER_HOST__CAPACITY_BYTES": "lots"}, r"^host\.capacity_bytes"),
        ({"ECTIER_HOST__CAPACITY_BYTES": "none"}, r"^host\.capacity_bytes"),  # not optional
        ({"ECTIER_HOST__CAPACITY": "1"}, r"^ECTIER_HOST__CAPACITY: unknown.*did you mean ECTIER_HOST__CAPACITY_BYTES\?"),
        ({"ECTIER_NVME__SYNCH": "1"}, r"did you mean ECTIER_NVME__SYNC\?"),
        ({"ECTIER_DISK__PATH": "/x"}, r"^ECTIER_DISK__PATH: no config section 'disk'"),
        ({"ECTIER_HOST": "1"}, "^ECTIER_HOST: unknown"),
        ({"ECTIER_BOGUS": "1"}, "^ECTIER_BOGUS: unknown"),
    ],
)
def test_from_env_errors_name_the_variable_or_field(env, match):
    with pytest.raises(ConfigError, match=match):
        CacheConfig.from_env(env)


def test_from_env_layers_over_config_file(tmp_path):
    p = tmp_path / "base.yaml"
    p.write_text("namespace: from-file\nhost:\n  capacity_bytes: 3GiB\n  block_bytes: 1MiB\n")
    c = CacheConfig.from_env({"ECTIER_CONFIG": str(p), "ECTIER_HOST__CAPACITY_BYTES": "5GiB"})
    assert c.namespace == "from-file"  # from the file
    assert c.host.block_bytes == MiB  # from the file
    assert c.host.capacity_bytes == 5 * GiB  # env wins over the file


def test_from_env_explicit_base_and_prefix():
    base = _nondefault()
    c = CacheConfig.from_env({"MY_NVME__ZSTD_LEVEL": "7", "ECTIER_NAMESPACE": "ignored"}, prefix="MY_", base=base)
    assert c == dataclasses.replace(base, nvme=dataclasses.replace(base.nvme, zstd_level=7))


def test_from_env_reads_os_environ(monkeypatch):
    import os

    for name in list(os.environ):
        if name.startswith("ECTIER_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("ECTIER_HOST__BLOCK_BYTES", "512KiB")
    assert CacheConfig.from_env().host.block_bytes == 512 * KiB


def test_from_env_result_is_validated_as_a_whole():
    with pytest.raises(ConfigError, match=r"^host\.capacity_bytes.*nvme\.path"):
        CacheConfig.from_env({"ECTIER_HOST__CAPACITY_BYTES": "0"})
    c = CacheConfig.from_env({"ECTIER_HOST__CAPACITY_BYTES": "0", "ECTIER_NVME__PATH": "/nvme"})
    assert c.host.capacity_bytes == 0


def test_byte_strings_accepted_by_the_constructors_too():
    assert HostTierConfig(capacity_bytes="8MiB").capacity_bytes == 8 << 20
    assert NvmeTierConfig(capacity_bytes="2GB").capacity_bytes == 2 * 10**9
    with pytest.raises(ConfigError, match="^host.capacity_bytes: cannot read"):
        HostTierConfig(capacity_bytes="8 gigs")


@pytest.mark.parametrize("text", ["-1", "-4GiB", " -2 MiB"])
def test_a_negative_byte_string_says_it_is_negative(text):
    """A negative count as text (a file, an ECTIER_* variable) was 'cannot read ... as bytes'."""
    with pytest.raises(ConfigError, match=r"^host\.capacity_bytes: must be >= 0 bytes, got '"):
        HostTierConfig(capacity_bytes=text)
    with pytest.raises(ConfigError, match="must be >= 0 bytes") as err:
        CacheConfig.from_env({"ECTIER_HOST__CAPACITY_BYTES": text})
    assert err.value.env_vars == ("ECTIER_HOST__CAPACITY_BYTES",)
    with pytest.raises(ConfigError, match="cannot read"):
        HostTierConfig(capacity_bytes="--1")


def test_host_budget_below_one_block_is_refused():
    with pytest.raises(ConfigError, match="^host.capacity_bytes: 100 is less than one block"):
        HostTierConfig(capacity_bytes=100)


def test_infinite_wait_is_refused():
    with pytest.raises(ConfigError, match="^host.admit_wait_s"):
        HostTierConfig(admit_wait_s=float("inf"))


def test_all_budgets_zero_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="both 0"):
        CacheConfig(host=HostTierConfig(capacity_bytes=0), nvme=NvmeTierConfig(path=str(tmp_path), capacity_bytes=0))


def test_yaml_reads_exponent_floats_as_numbers(tmp_path):
    """PyYAML (YAML 1.1) reads an unquoted ``5e-1`` as a string ("expected a finite number of
    seconds, got '5e-1'"); the config reads it as YAML 1.2 does, a number. Strings stay strings."""
    path = tmp_path / "c.yaml"
    path.write_text("namespace: 1e\nhost:\n  admit_wait_s: 5e-1\nremote:\n  backend: none\n  timeout_s: 2E0\n")
    cfg = CacheConfig.load(str(path))
    assert cfg.host.admit_wait_s == 0.5 and cfg.remote.timeout_s == 2.0 and cfg.namespace == "1e"

