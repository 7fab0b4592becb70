"""Bad input to the CLI: ``ectier serve`` with bad configs or a store in use (exit 1/2, one line,
store files unchanged), ``size``/``models`` with random arguments, the crash campaign's
arguments, empty paths; and configs that fail at open (a locked NVMe store, a file that is not
UTF-8, ``pin_memory`` without CUDA). (The public API and config loaders: test_bad_input.py.)"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st

from ectier import CacheConfig, HostTierConfig, TieredCache
from ectier.cli import main as cli_main
from ectier.errors import ConfigError, EctierError

from conftest import KiB, MiB, assert_same, make_config


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ============================================================================ CLI


def _tree_digest(root: Path) -> str:
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        if p.is_file() and p.name != "lock.mdb":
            h.update(p.name.encode() + p.read_bytes())
    return h.hexdigest()


@pytest.mark.parametrize("text, word", [
    ("nvme: {path: STORE, capacity_bytes: -5}", "nvme.capacity_bytes"),
    ("nvme: {path: STORE, codec: brotli}", "nvme.codec"),
    ("nvme: {path: STORE}\nhost: {capacity_bytes: 0}", "host.capacity_bytes"),
    ("- just\n- a list", "mapping"),
    ("nvme: {path: STORE, sync: perhaps}", "nvme.sync"),
    ("{{{", "YAML"),
])  # (host.pin_memory: true is no bad config for the daemon: tests/test_daemon_lifecycle.py)
def test_serve_with_bad_config_leaves_the_store_untouched(tmp_path, text, word):
    store = tmp_path / "store"
    with TieredCache(make_config(store, host_bytes=0)) as cache:
        cache.put("k", torch.ones(100))
    before = _tree_digest(store)
    cfg = tmp_path / "bad.yaml"
    cfg.write_text(text.replace("STORE", str(store)))
    r = CliRunner().invoke(cli_main, ["serve", "--config", str(cfg)])
    assert r.exit_code in (1, 2), r.output
    assert word.lower() in r.output.lower() and "Traceback" not in r.output, r.output
    assert _tree_digest(store) == before


def test_serve_on_a_store_in_use_is_a_clean_error_and_changes_nothing(tmp_path):
    from daemon_helpers import daemon_config, short_tmpdir, remove_dir, write_config

    d = short_tmpdir()
    try:
        cfg = daemon_config(d, host_bytes=1 * MiB)
        held = TieredCache(CacheConfig.from_dict({k: v for k, v in cfg.items() if k != "daemon"}))
        try:
            held.put("k", torch.ones(10))
            held.flush()
            before = _tree_digest(Path(cfg["nvme"]["path"]))
            r = CliRunner().invoke(cli_main, ["serve", "--config", write_config(os.path.join(d, "c.json"), cfg)])
            assert r.exit_code == 1, r.output
            assert "nvme.path" in r.output and "in use" in r.output and "Traceback" not in r.output
            assert _tree_digest(Path(cfg["nvme"]["path"])) == before
            assert_same(held.get("k"), torch.ones(10))
        finally:
            held.close()
        assert not [f for f in os.listdir(d) if f.endswith((".arena", ".sock"))]
    finally:
        remove_dir(d)


@settings(max_examples=60, deadline=None)
@given(args=st.lists(st.one_of(st.text(max_size=12), st.sampled_from(["--json", "--model", "x", "0x0", "1e9x1",
                                                                        "99999999x1", "-1x5", "--socket"])),
                     max_size=4))
def test_cli_size_and_models_never_trace_back(args):
    runner = CliRunner()
    for cmd in (["size", *args], ["models", *args]):
        r = runner.invoke(cli_main, cmd)
        assert r.exit_code in (0, 2), (cmd, r.exit_code, r.output, r.exception)
        assert "Traceback" not in r.output


@pytest.mark.parametrize("args", [["--kills", "0"], ["--variants", "nope"], ["--max-delay-s", "-1"], ["--kills", "x"],
                                  ["--daemon-every", "0"]])
def test_crash_campaign_bad_arguments_are_usage_errors(args, capsys):
    sys.path.insert(0, REPO)
    from tools import crash_campaign

    with pytest.raises(SystemExit) as info:
        crash_campaign.main(args)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and args[0] in err, err


def test_failed_nvme_open_removes_the_shared_arena_file(tmp_path):
    """The NVMe tier fails to open (its store is in use): the host tier opened before it is closed
    again, so the daemon's shared arena file does not leak."""
    from ectier.errors import StoreLockedError

    cfg = CacheConfig.from_dict({"host": {"capacity_bytes": "1MiB", "block_bytes": "64KiB", "pin_memory": False},
                                 "nvme": {"path": str(tmp_path / "nvme"), "capacity_bytes": "16MiB"}})
    arena = tmp_path / "arena.shm"
    with TieredCache(cfg):  # holds the store's lock
        with pytest.raises(StoreLockedError):
            TieredCache(cfg, host_shm_path=str(arena))
        assert not arena.exists(), "the shared arena file leaked"


@pytest.mark.parametrize("content", [b"host: {capacity_bytes: 1MiB}\n\xff\xfe not utf-8\n",
                                     b"nvme: {path: \"a\\0b\"}\n"], ids=["not-utf8", "nul-in-path"])
def test_config_file_that_is_not_utf8_or_a_nul_path_is_a_config_error(tmp_path, content):
    from ectier.errors import ConfigError

    path = tmp_path / "bad.yaml"
    path.write_bytes(content)
    with pytest.raises(ConfigError):
        CacheConfig.load(str(path))
    res = CliRunner().invoke(cli_main, ["serve", "--config", str(path)])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA pins")
def test_pin_memory_true_without_cuda_names_the_knob():
    """In-process it named host.capacity_bytes (the allocation failed); the daemon started unpinned."""
    with pytest.raises(ConfigError, match="^host.pin_memory"):
        TieredCache(CacheConfig(host=HostTierConfig(capacity_bytes=1 * MiB, pin_memory=True)))


@pytest.mark.parametrize("args, option", [
    (["stats", "--socket", ""], "--socket"),
    (["serve", "--socket", ""], "--socket"),
    (["fsck", "--path", ""], "--path"),
])
def test_an_empty_path_is_refused_not_taken_as_the_default(args, option):
    """``--socket ""`` used the default socket and ``--path ""`` the current directory, silently."""
    r = CliRunner().invoke(cli_main, args)
    assert r.exit_code == 2 and option in r.output and "empty path" in r.output, r.output


def test_a_closed_cache_cannot_be_entered_again(tmp_path):
    cache = TieredCache(make_config(tmp_path / "nvme", host_bytes=64 * KiB))
    cache.close()
    with pytest.raises(EctierError, match="closed"):
        with cache:
            pass  # (never reached)
