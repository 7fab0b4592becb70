"""Bad input wherever it enters — the public API and the config loaders here, the daemon protocol
(mutated frames: test_bad_input_daemon.py), the CLI (test_bad_input_cli.py) — gets a clear,
typed error and changes nothing stored.

"Nothing stored changes" is checked against a snapshot taken before the bad call: every key's
write version (a write always takes a new one) and, at the end, every entry's bytes."""

from __future__ import annotations

import hashlib
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ectier import testing
from ectier import CacheConfig, TieredCache
from ectier.errors import ConfigError, EctierError, EntryTooLargeError, InvalidTensorError

from conftest import KiB, MiB, assert_same, check_quiescent, make_config, random_tensor


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
