"""Bad input wherever it enters — the public API, the config loaders, the daemon protocol (mutated
frames), the CLI — gets a clear, typed error and changes nothing stored.

"Nothing stored changes" is checked against a snapshot taken before the bad call: every key's
write version (a write always takes a new one) and, at the end, every entry's bytes. Random and
byte-mutated daemon frames are checked against the daemon's contents the same way, and every error
reply must be a typed one (never ``InternalError``: that is an unexpected exception in a handler).
The atheris harness ``tools/fuzz_protocol.py`` (on demand) shares its oracle with the smoke test
here, which runs it without atheris.
"""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ectier import testing
from ectier import CacheConfig, HostTierConfig, TieredCache
from ectier.cli import main as cli_main
from ectier.errors import (ConfigError, EctierError, EntryTooLargeError, InvalidDeviceError, InvalidKeyError,
                           InvalidTensorError)

from conftest import KiB, MiB, assert_same, check_quiescent, make_config, random_tensor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# ============================================================================ public API

VALUES = {
    "h0": random_tensor((100, 64), torch.bfloat16, 1),  # host
    "h1": random_tensor((7, 3, 5), torch.float32, 2),
    "n0": random_tensor((300 * KiB,), torch.uint8, 3),  # larger than host: NVMe
}


def _populated(tmp: str) -> TieredCache:
    cache = TieredCache(make_config(Path(tmp) / "nvme", host_bytes=256 * KiB, nvme_bytes=2 * MiB, block_bytes=16 * KiB))
    for k, t in VALUES.items():
        cache.put(k, t)
    return cache


def _snapshot(cache: TieredCache):
    return testing.versions(cache), len(cache)


bad_key = st.one_of(st.none(), st.integers(), st.binary(max_size=8), st.just(""), st.lists(st.text(max_size=2), max_size=2),
                    st.text(max_size=4).map(lambda s: s + "\ud800"), st.just("x" * (64 * KiB + 1)))
bad_namespace = st.one_of(st.just(""), st.integers(), st.text(max_size=3).map(lambda s: "\udc80" + s),
                          st.just("n" * 5000))
bad_tensor = st.sampled_from(["none", "list", "numpy", "bytes", "meta", "sparse", "complex32", "nested"])
bad_cost = st.one_of(st.floats(max_value=-1e-9), st.just(float("nan")), st.just(float("inf")), st.text(max_size=2),
                     st.booleans())
bad_device = st.sampled_from(["cuda", "gpu", "cuda:x", "cuda:-1", 5, "cpu:0:1", "tpu:0"])
bad_out = st.sampled_from(["shape", "dtype", "strided", "list", "cuda-like", "requires-grad"])
bad_keys = st.sampled_from([None, 5, 1.5, b"ab", "ab", [None], [""]])
bad_shape = st.one_of(st.lists(st.integers(max_value=-1), min_size=1, max_size=3), st.just([1.5]), st.just([True]),
                      st.just("ab"), st.just(5), st.just([2**40, 2**40]), st.just([None]))
bad_dtype = st.one_of(st.sampled_from(["float128", "qint8", "", "torch.float32", "BF16"]), st.integers())


def _make_bad_tensor(kind):
    return {
        "none": lambda: None, "list": lambda: [1, 2], "numpy": lambda: np.ones(3), "bytes": lambda: b"\0" * 8,
        "meta": lambda: torch.empty(3, device="meta"), "sparse": lambda: torch.zeros(3).to_sparse(),
        "complex32": lambda: torch.zeros(2, dtype=torch.complex32),
        "nested": lambda: torch.nested.nested_tensor([torch.zeros(2), torch.zeros(3)]),
    }[kind]()


def _make_bad_out(kind, key):
    t = VALUES[key]
    return {
        "shape": lambda: torch.empty(t.numel() + 1, dtype=t.dtype),
        "dtype": lambda: torch.empty(t.shape, dtype=torch.float64),
        "strided": lambda: torch.empty(t.numel() * 2, dtype=t.dtype)[::2],
        "list": lambda: [0] * t.numel(),
        "cuda-like": lambda: torch.empty(t.shape, dtype=t.dtype, device="meta"),
        "requires-grad": lambda: torch.zeros(t.shape, dtype=t.dtype if t.dtype.is_floating_point else torch.float32,
                                             requires_grad=True),
    }[kind]()


bad_call = st.one_of(
    st.tuples(st.just("put-key"), bad_key),
    st.tuples(st.just("put-tensor"), bad_tensor),
    st.tuples(st.just("put-cost"), bad_cost),
    st.tuples(st.just("put-namespace"), bad_namespace),
    st.tuples(st.just("put-too-large"), st.just(None)),
    st.tuples(st.just("get-key"), bad_key),
    st.tuples(st.just("get-device"), bad_device),
    st.tuples(st.just("get-out"), st.tuples(bad_out, st.sampled_from(sorted(VALUES)))),
    st.tuples(st.just("get-namespace"), bad_namespace),
    st.tuples(st.just("reserve-shape"), bad_shape),
    st.tuples(st.just("reserve-dtype"), bad_dtype),
    st.tuples(st.just("commit-aborted"), st.sampled_from(["commit", "abort"])),
    st.tuples(st.just("delete-key"), bad_key),
    st.tuples(st.just("contains-key"), bad_key),
    st.tuples(st.just("prefetch-keys"), bad_keys),
)

# the word the error message must contain, per call
WORD = {"put-key": "key", "get-key": "key", "delete-key": "key", "contains-key": "key", "put-tensor": "tensor",
        "put-cost": "cost_s", "put-namespace": "namespace", "get-namespace": "namespace",
        "put-too-large": "capacity_bytes", "get-device": "device", "get-out": "out", "reserve-dtype": "dtype",
        "commit-aborted": "lease", "prefetch-keys": "key"}


def _call(cache, name, arg):
    if name == "put-key":
        cache.put(arg, VALUES["h0"])
    elif name == "put-tensor":
        cache.put("h0", _make_bad_tensor(arg))
    elif name == "put-cost":
        cache.put("h0", torch.ones(3), cost_s=arg)
    elif name == "put-namespace":
        cache.put("h0", torch.ones(3), namespace=arg)
    elif name == "put-too-large":
        cache.put("h0", torch.zeros(3 * MiB, dtype=torch.uint8))
    elif name == "get-key":
        cache.get(arg)
    elif name == "get-device":
        cache.get("h0", device=arg)
    elif name == "get-out":
        kind, key = arg
        cache.get(key, out=_make_bad_out(kind, key))
    elif name == "get-namespace":
        cache.get("h0", namespace=arg)
    elif name == "reserve-shape":
        lease = cache.reserve("h0", dtype="uint8", shape=arg)
        cache.abort(lease)  # (only reached if the bad shape was accepted: the test then fails)
    elif name == "reserve-dtype":
        cache.reserve("h0", dtype=arg, shape=[4])
    elif name == "commit-aborted":
        lease = cache.reserve("h0", dtype="uint8", shape=[8])
        cache.abort(lease)
        getattr(cache, arg)(lease)
    elif name == "delete-key":
        cache.delete(arg)
    elif name == "contains-key":
        cache.contains(arg)
    elif name == "prefetch-keys":
        cache.prefetch(arg)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(calls=st.lists(bad_call, min_size=1, max_size=5))
def test_bad_api_calls_raise_typed_errors_and_change_nothing(calls):
    with tempfile.TemporaryDirectory(prefix="ectier-bad-") as tmp:
        cache = _populated(tmp)
        try:
            before = _snapshot(cache)
            for name, arg in calls:
                with pytest.raises((EctierError, ValueError, TypeError)) as info:
                    _call(cache, name, arg)
                assert not isinstance(info.value, (AssertionError, KeyError, AttributeError, IndexError))
                text = str(info.value)
                assert text, f"{name}: an error without a message"
                if name in WORD:
                    assert WORD[name] in text, f"{name}({arg!r}): {text!r} does not name {WORD[name]!r}"
                if name == "reserve-shape":
                    assert isinstance(info.value, (InvalidTensorError, EntryTooLargeError)), info.value
                assert _snapshot(cache) == before, f"{name}({arg!r}) changed what is stored"
            check_quiescent(cache)
            for k, t in VALUES.items():
                assert_same(cache.get(k), t)
        finally:
            cache.close()


def test_reserve_refuses_float_and_bool_dimensions(tmp_path):
    """Regression: reserve() ran int() over the shape, so [1.5] reserved 1 element and [True] 1
    element, silently; numpy integers stay accepted."""
    with TieredCache(make_config(tmp_path / "nvme", nvme=False)) as cache:
        for shape in ([1.5], [True], [2, 2.0], ["3"]):
            with pytest.raises(InvalidTensorError, match="shape"):
                cache.reserve("k", dtype="uint8", shape=shape)
        lease = cache.reserve("k", dtype="uint8", shape=[np.int64(3), np.int32(2)])
        assert lease.meta.shape == (3, 2)
        cache.abort(lease)
        assert len(cache) == 0


def test_closed_cache_and_bad_config_change_nothing_on_disk(tmp_path):
    cache = _populated(str(tmp_path))
    cfg = cache.config
    cache.close()
    data = tmp_path / "nvme" / "lmdb" / "data.mdb"
    digest_before = hashlib.sha256(data.read_bytes()).hexdigest()
    for bad in ({"nvme": {"path": str(tmp_path / "nvme"), "capacity_bytes": -1}},
                {"nvme": {"path": str(tmp_path / "nvme"), "codec": "lz4"}},
                {"host": {"capacity_bytes": "lots"}, "nvme": {"path": str(tmp_path / "nvme")}},
                {"nvme": {"path": str(tmp_path / "nvme"), "sync": "maybe"}}):
        with pytest.raises(ConfigError):
            TieredCache(bad)
    for op in (lambda: cache.put("h0", torch.ones(2)), lambda: cache.get("h0"), lambda: cache.delete("h0"),
               lambda: cache.flush(), lambda: cache.reserve("h0", dtype="uint8", shape=[1])):
        with pytest.raises(EctierError, match="closed"):
            op()
    assert hashlib.sha256(data.read_bytes()).hexdigest() == digest_before
    with TieredCache(cfg) as again:
        for k, t in VALUES.items():
            assert_same(again.get(k), t)


# ============================================================================ config loaders

FIELDS = ["namespace", "host", "nvme", "daemon", "capacity_bytes", "block_bytes", "path", "codec", "sync",
          "map_max_bytes", "lease_s", "socket_mode", "policy", "admit_wait_s", "zstd_level", "bogus"]
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), st.floats(allow_nan=True),
                    st.text(max_size=12), st.sampled_from(["4GiB", "-1", "1e3", "0x10", "lru", "zstd", "raw", "0600"]))
config_trees = st.recursive(scalars, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                            st.dictionaries(st.sampled_from(FIELDS), inner, max_size=4)),
                            max_leaves=12)


@settings(max_examples=200, deadline=None)
@given(tree=config_trees)
def test_config_from_dict_is_valid_or_a_config_error(tree):
    try:
        cfg = CacheConfig.from_dict(tree)
    except ConfigError as exc:
        assert str(exc)
    else:
        assert isinstance(cfg, CacheConfig)


@settings(max_examples=150, deadline=None)
@given(text=st.one_of(st.text(max_size=200), config_trees.map(lambda t: __import__("json").dumps(t, default=str))))
def test_config_text_loaders_are_valid_or_a_config_error(text):
    for loader in (CacheConfig.from_yaml, CacheConfig.from_json):
        try:
            loader(text)
        except ConfigError as exc:
            assert str(exc)


@settings(max_examples=150, deadline=None)
@given(env=st.dictionaries(st.sampled_from(["ECTIER_NAMESPACE", "ECTIER_HOST__CAPACITY_BYTES", "ECTIER_NVME__SYNC",
                                            "ECTIER_NVME__MAP_MAX_BYTES", "ECTIER_DAEMON__LEASE_S", "ECTIER_BOGUS",
                                            "ECTIER_HOST__NOPE__DEEP", "ECTIER_NVME__CODEC", "ECTIER_HOST"]),
                           st.text(max_size=10), max_size=4))
def test_config_from_env_is_valid_or_a_config_error(env):
    try:
        CacheConfig.from_env(env)
    except ConfigError as exc:
        assert str(exc)


# ============================================================================ daemon protocol


@pytest.fixture(scope="module")
def populated_daemon():
    from daemon_helpers import DaemonProcess, daemon_config, make_tensor, remove_dir, short_tmpdir, write_config
    from ectier.daemon.client import DaemonClient

    d = short_tmpdir()
    proc = None
    try:
        cfg = daemon_config(d, host_bytes=8 * MiB, write_through=True, max_frame_bytes=64 * KiB)
        proc = DaemonProcess(write_config(os.path.join(d, "cfg.json"), cfg), cfg["daemon"]["socket_path"]).start()
        specs = {f"stored-entry-number-{i}": make_tensor(40 + i, "bfloat16", (17 * (i + 1), 33)) for i in range(3)}
        with DaemonClient(proc.socket_path) as c:
            for k, t in specs.items():
                c.put(k, t)
        proc.specs = specs
        yield proc
    finally:
        if proc is not None:
            proc.stop()
        remove_dir(d)


def _daemon_contents(proc):
    from daemon_helpers import daemon_stats, tensor_digest
    from ectier.daemon.client import DaemonClient

    with DaemonClient(proc.socket_path) as c:
        got = {k: (None if (t := c.get(k)) is None else tensor_digest(t)) for k in proc.specs}
    st_ = daemon_stats(proc.socket_path)
    # (not host used_bytes: a mutated reserve may evict to make room; evicted entries stay on NVMe)
    return got, st_["entries"], st_["tiers"]["nvme"]["entries"], st_["tiers"]["nvme"]["used_bytes"]


BASE_REQUESTS = [
    {"id": 1, "op": "hello", "version": 1, "client": "fuzz"},
    {"id": 2, "op": "ping"},
    {"id": 3, "op": "get", "key": "stored-entry-number-0"},
    {"id": 4, "op": "contains", "key": "stored-entry-number-1", "namespace": "test"},
    {"id": 5, "op": "stats"},
    {"id": 6, "op": "reserve", "key": "zz", "dtype": "bfloat16", "shape": [3, 4]},
    {"id": 7, "op": "abort", "lease": 123456789},
    {"id": 8, "op": "release", "lease": 987654321},
    {"id": 9, "op": "delete", "key": "zz"},
    {"id": 10, "op": "get", "key": "zz", "namespace": "other"},
]

mutation = st.tuples(st.sampled_from(["flip", "insert", "delete", "truncate", "duplicate", "set"]),
                     st.integers(0, 1 << 16), st.integers(0, 255))


def _mutate(data: bytes, mutations) -> bytes:
    b = bytearray(data)
    for kind, pos, byte in mutations:
        if not b:
            break
        p = pos % len(b)
        if kind == "flip":
            b[p] ^= 1 << (byte % 8)
        elif kind == "set":
            b[p] = byte
        elif kind == "insert":
            b.insert(p, byte)
        elif kind == "delete":
            del b[p]
        elif kind == "truncate":
            del b[p:]
        elif kind == "duplicate":
            b[p:p] = b[p:p + 1 + byte % 8]
    return bytes(b)


def _frames(reqs) -> bytes:
    out = b""
    for r in reqs:
        body = msgpack.packb(r, use_bin_type=True)
        out += len(body).to_bytes(4, "big") + body
    return out


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                   HealthCheck.function_scoped_fixture])
@given(reqs=st.lists(st.sampled_from(BASE_REQUESTS), min_size=1, max_size=3),
       mutations=st.lists(mutation, min_size=1, max_size=3))
def test_mutated_frames_get_typed_errors_and_change_nothing(populated_daemon, reqs, mutations):
    from daemon_helpers import RawConn

    before = _daemon_contents(populated_daemon)
    with RawConn(populated_daemon.socket_path, timeout=10) as raw:
        try:
            raw.send(_mutate(_frames(reqs), mutations))
            raw.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass  # the daemon hung up first (fatal framing error)
        replies = raw.replies_until_eof()
    for r in replies:
        assert isinstance(r, dict) and "ok" in r and "id" in r
        if not r["ok"]:
            assert r["error"]["type"] != "InternalError", r
            assert r["error"]["message"]
    after = _daemon_contents(populated_daemon)
    assert after == before, "a mutated frame changed what the daemon stores"
    assert after[0] == {k: __import__("daemon_helpers").tensor_digest(t) for k, t in populated_daemon.specs.items()}


def test_fuzz_harness_smoke_without_atheris():
    """The atheris harness's oracle, fed seeded random and mutated inputs (atheris not needed)."""
    sys.path.insert(0, REPO)
    from tools import fuzz_protocol

    fuzz_protocol.run_random(iterations=300, seed=1)


def test_fuzz_harness_cli_without_atheris_is_a_clear_message(tmp_path):
    from fork_helpers import forked_python

    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = forked_python([os.path.join(REPO, "tools", "fuzz_protocol.py"), "--random", "50"], stdout=True, env=env)
    try:
        out = proc.stdout.read()
        assert proc.wait(120) == 0, proc.stderr_text()[-2000:]
    finally:
        proc.close()
    assert "50 inputs" in out
    assert list(tmp_path.iterdir()) == [], "the harness left its temporary store behind"


def test_fuzz_harness_killed_by_sigterm_still_removes_its_store(tmp_path):
    from fork_helpers import forked_python

    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = forked_python([os.path.join(REPO, "tools", "fuzz_protocol.py"), "--random", "10000000"], env=env)
    try:
        deadline = time.monotonic() + 60
        while not list(tmp_path.iterdir()) and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert list(tmp_path.iterdir()), "the harness never created its store"
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
        assert proc.returncode == 128 + signal.SIGTERM, proc.stderr_text()[-2000:]
    finally:
        proc.close()
    assert list(tmp_path.iterdir()) == [], "the harness left its temporary store behind"


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
