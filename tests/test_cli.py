"""The ``ectier`` command line: ``size``, ``models``, ``--version`` and the argument errors of ``demo``.

Every bad input must be a click usage error: exit code 2, a message naming the argument, no traceback.
"""

from __future__ import annotations

import json
from importlib import metadata

import pytest
from click.testing import CliRunner

from ectier import __version__
from ectier.cli import main

# The seed documents' worked examples: (size, resized, grid t x h x w, patches, tokens, bytes).
WORKED = [
    ("1024x1024", "1024x1024", (1, 64, 64), 4096, 1024, 16_777_216),
    ("1920x1080", "1920x1088", (1, 68, 120), 8160, 2040, 33_423_360),
    ("256x256", "256x256", (1, 16, 16), 256, 64, 1_048_576),
]


@pytest.fixture
def runner() -> CliRunner:
    return CliRunner(env={"COLUMNS": "120"})


def _usage_error(result, *names: str) -> None:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    assert isinstance(result.exception, SystemExit)
    assert "Error:" in result.output
    error = result.output[result.output.index("Error:"):]  # not the usage line, which names everything
    for name in names:
        assert name in error, result.output


def test_version(runner):
    result = runner.invoke(main, ["--version"])
    assert result.exit_code == 0
    assert result.output.strip() == f"ectier {__version__}"


def test_console_script_is_declared():
    scripts = {ep.name: ep.value for ep in metadata.entry_points(group="console_scripts")}
    assert scripts.get("ectier") == "ectier.cli:main"


@pytest.mark.parametrize("size, resized, grid, patches, tokens, nbytes", WORKED)
def test_size_table_worked_examples(runner, size, resized, grid, patches, tokens, nbytes):
    result = runner.invoke(main, ["size", size])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "qwen3-vl" in out
    assert resized in out
    assert "x".join(map(str, grid)) in out
    assert str(patches) in out
    assert f"({tokens}, 8192)" in out
    assert "bfloat16" in out
    assert str(nbytes) in out
    assert "MiB" in out


def test_size_several_sizes_in_one_table(runner):
    result = runner.invoke(main, ["size", *(w[0] for w in WORKED)])
    assert result.exit_code == 0, result.output
    for _, _, _, _, tokens, nbytes in WORKED:
        assert str(nbytes) in result.output
        assert f"({tokens}, 8192)" in result.output


def test_size_json_worked_examples(runner):
    result = runner.invoke(main, ["size", "--json", *(w[0] for w in WORKED)])
    assert result.exit_code == 0, result.output
    records = json.loads(result.output)
    assert len(records) == 3
    for rec, (size, resized, grid, patches, tokens, nbytes) in zip(records, WORKED):
        assert f"{rec['width']}x{rec['height']}" == size
        assert f"{rec['resized_width']}x{rec['resized_height']}" == resized
        assert (rec["grid_t"], rec["grid_h"], rec["grid_w"]) == grid
        assert rec["num_patches"] == patches
        assert rec["num_tokens"] == tokens
        assert rec["shape"] == [tokens, 8192]
        assert rec["dtype"] == "bfloat16"
        assert rec["nbytes"] == nbytes == tokens * 8192 * 2
        assert rec["model"] == "qwen3-vl"


@pytest.mark.parametrize("text", ["1920×1080", "1920,1080", "1920X1080"])
def test_size_accepts_other_separators(runner, text):
    result = runner.invoke(main, ["size", "--json", text])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)[0]["nbytes"] == 33_423_360


def test_size_gemma3_fixed_tokens(runner):
    result = runner.invoke(main, ["size", "640x480", "--model", "gemma3", "--json"])
    assert result.exit_code == 0, result.output
    rec = json.loads(result.output)[0]
    assert rec["model"] == "gemma3"
    assert rec["num_tokens"] == 256
    assert rec["shape"] == [256, 5376]
    assert rec["nbytes"] == 256 * 5376 * 2
    assert rec["resized_width"] is None
    table = runner.invoke(main, ["size", "640x480", "-m", "Gemma-3"])
    assert table.exit_code == 0, table.output
    assert "2752512" in table.output


def test_size_model_alias(runner):
    result = runner.invoke(main, ["size", "1024x1024", "--model", "Qwen/Qwen3-VL-30B-A3B-Instruct", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)[0]["nbytes"] == 16_777_216


@pytest.mark.parametrize("bad", ["abc", "1920", "1920x", "5x-10", "0x100", "10x0", "1.5x2"])
def test_size_bad_size_is_usage_error(runner, bad):
    _usage_error(runner.invoke(main, ["size", bad]), "Invalid value for 'SIZES...'", repr(bad))


def test_size_bad_one_of_several(runner):
    _usage_error(runner.invoke(main, ["size", "1024x1024", "nope"]), "SIZES", "'nope'")


def test_size_extreme_aspect_ratio_is_usage_error(runner):
    _usage_error(runner.invoke(main, ["size", "1x1000"]), "SIZES", "1x1000", "aspect ratio")


def test_size_unknown_model_is_usage_error(runner):
    _usage_error(runner.invoke(main, ["size", "1024x1024", "--model", "llava"]), "--model", "'llava'", "qwen3-vl")


def test_size_needs_an_argument(runner):
    _usage_error(runner.invoke(main, ["size"]), "Missing argument 'SIZES...'")


def test_models_table_and_json(runner):
    result = runner.invoke(main, ["models"])
    assert result.exit_code == 0, result.output
    assert "qwen3-vl" in result.output and "gemma3" in result.output
    assert "8192" in result.output and "5376" in result.output
    rows = {r["name"]: r for r in json.loads(runner.invoke(main, ["models", "--json"]).output)}
    assert rows["qwen3-vl"]["min_tokens"] == 64 and rows["qwen3-vl"]["max_tokens"] == 16384
    assert rows["qwen3-vl"]["min_bytes"] == 1 << 20 and rows["qwen3-vl"]["max_bytes"] == 256 << 20
    assert rows["gemma3"]["min_tokens"] == rows["gemma3"]["max_tokens"] == 256
    assert "qwen3_vl_moe" in rows["qwen3-vl"]["aliases"]


def test_unknown_command_is_usage_error(runner):
    _usage_error(runner.invoke(main, ["frobnicate"]), "frobnicate")


@pytest.mark.parametrize(
    "args, names",
    [
        (["--codec", "lz4"], ["--codec", "lz4"]),
        (["--requests", "0"], ["--requests"]),
        (["--zipf", "-1"], ["--zipf"]),
        (["--host-bytes", "lots"], ["--host-bytes", "lots"]),
        (["--nvme-bytes", "1.5B"], ["--nvme-bytes"]),
        (["--model", "nope"], ["--model"]),
        (["--images", "0"], ["--images"]),
        (["--host-bytes", "0", "--nvme-bytes", "0"], ["--host-bytes", "--nvme-bytes"]),
    ],
)
def test_demo_bad_options_are_usage_errors(runner, args, names):
    _usage_error(runner.invoke(main, ["demo", *args]), *names)


def test_help_mentions_every_command(runner):
    result = runner.invoke(main, ["--help"])
    assert result.exit_code == 0
    for cmd in ("size", "models", "demo"):
        assert cmd in result.output


# ========================================================================================= stats


def _daemon_stats(cache) -> dict:
    """What a daemon's ``stats`` request answers: the cache's stats plus a daemon section (no client)."""
    return {**cache.stats(), "daemon": {"socket": "/nowhere/ectier.sock", "clients": [], "leases": {"put": 0, "get": 0},
                                        "leases_expired": 0}}


def _stats_table(monkeypatch, data) -> dict[str, list[str]]:
    """``ectier stats`` printing ``data`` (the daemon client's answer): row label -> its cells."""
    from ectier.daemon import client as client_mod

    class Answering:
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def stats(self):
            return data

    monkeypatch.setattr(client_mod, "DaemonClient", Answering)
    r = CliRunner(env={"COLUMNS": "200"}).invoke(main, ["stats", "--socket", "/nowhere/ectier.sock"])
    assert r.exit_code == 0, r.output
    return {cells[0]: cells[1:] for line in r.output.splitlines() if line.count("│") >= 3
            for cells in [[c.strip() for c in line.split("│")[1:-1]]]}


def test_stats_table_shows_the_write_behind_counters_and_no_remote_rows_without_a_remote_tier(
        monkeypatch, tmp_path):
    import torch

    from ectier import testing
    from ectier.config import CacheConfig

    cfg = CacheConfig.from_dict({"host": {"capacity_bytes": 1 << 20, "block_bytes": 16 << 10,
                                          "write_behind_fraction": 0.25},
                                 "nvme": {"path": str(tmp_path / "nvme"), "capacity_bytes": 16 << 20}})
    with testing.make_cache(cfg) as cache:
        for i in range(12):
            cache.put(f"k{i}", torch.full((192 << 10,), i, dtype=torch.uint8))
        assert testing.write_behind_idle(cache)
        data = _daemon_stats(cache)
    host = data["tiers"]["host"]
    assert host["clean_evictions"] + host["dirty_evictions"] == host["evictions"] > 0
    assert host["write_behind_writes"] > 0
    table = _stats_table(monkeypatch, data)
    # before: no write-behind rows; eight remote-only rows of dashes without a remote tier
    assert table["clean evictions"] == [str(host["clean_evictions"]), "—"]
    assert table["dirty evictions"] == [str(host["dirty_evictions"]), "—"]
    assert table["drops (lost)"] == [str(host["drops"]), "—"]  # (was no row: a lost entry looked written)
    assert table["write-behind writes"] == [str(host["write_behind_writes"]), "—"]
    assert table["write-behind failures"] == ["0", "—"]
    assert "write-behind bytes" in table and "eviction write s" in table
    for remote_only in ("misses", "errors", "timeouts", "degraded (back-off)", "skipped in back-off",
                        "skipped: node down"):
        assert remote_only not in table, remote_only
    assert table["checksum failures"] == ["—", "0"]  # the NVMe tier's
    for nvme_only in ("quarantined", "write failures", "read failures"):  # (were no rows: never shown)
        assert table[nvme_only] == ["—", "0"], nvme_only


def test_stats_table_shows_the_remote_rows_with_a_remote_tier(monkeypatch):
    import torch

    from ectier import testing
    from ectier.config import CacheConfig

    cfg = CacheConfig.from_dict({"host": {"capacity_bytes": 1 << 20, "block_bytes": 16 << 10},
                                 "remote": {"backend": "redis", "addresses": "unused:1"}})
    with testing.make_cache(cfg, remote_backend=testing.MemoryBackend()) as cache:
        cache.put("a", torch.zeros(1000, dtype=torch.uint8))
        assert cache.get("absent") is None
        data = _daemon_stats(cache)
    table = _stats_table(monkeypatch, data)
    assert list(data["tiers"]) == ["host", "remote"]
    assert table["misses"] == ["—", str(data["tiers"]["remote"]["misses"])]
    assert table["degraded (back-off)"] == ["—", "no"]
    assert table["timeouts"] == ["—", "0"] and table["errors"] == ["—", "0"]
    assert table["clean evictions"][1] == "—"


@pytest.mark.parametrize("kind", ["file", "directory"])
def test_stats_against_a_path_that_is_not_a_socket_says_so(tmp_path, kind):
    path = tmp_path / "ectier.sock"
    path.write_text("") if kind == "file" else path.mkdir()
    r = CliRunner().invoke(main, ["stats", "--socket", str(path), "--timeout", "1"])
    assert r.exit_code != 0 and "Traceback" not in r.output
    assert "it is not a socket" in r.output, r.output  # (it said "Connection refused")


def test_stats_against_another_programs_socket_says_it_is_not_an_ectier_daemon(tmp_path):
    import socket
    import threading

    path = str(tmp_path / "other.sock")
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen()

    def answer_like_http() -> None:
        conn, _ = server.accept()
        conn.recv(4096)
        conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
        conn.close()

    t = threading.Thread(target=answer_like_http, daemon=True)
    t.start()
    try:
        r = CliRunner().invoke(main, ["stats", "--socket", path, "--timeout", "2"])
    finally:
        t.join(5)
        server.close()
    assert r.exit_code != 0 and "Traceback" not in r.output
    assert "did not answer 'hello' as an ectier daemon does" in r.output, r.output  # (a bare frame-size error)


def test_demo_nvme_budget_below_one_block_names_its_own_option(runner, tmp_path):
    result = runner.invoke(main, ["demo", "--images", "2", "--quiet", "--dir", str(tmp_path), "--nvme-bytes", "1000"])
    assert result.exit_code == 2, result.output
    assert "--nvme-bytes (nvme.capacity_bytes): 1000 bytes is below one" in result.output, result.output


def test_serve_log_level_is_case_insensitive(tmp_path):
    """``--log-level DEBUG`` is what an operator types (it was refused as an invalid choice)."""
    res = CliRunner().invoke(main, ["serve", "--log-level", "DEBUG", "--config", str(tmp_path / "missing.yaml")])
    assert res.exit_code == 2 and "--log-level" not in res.output and "missing.yaml" in res.output, res.output
