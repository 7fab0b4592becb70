"""RedisBackend against real servers: a 3-node Redis Cluster and one plain server on loopback
(tests/redis_cluster.py starts them; installs redis-server when missing).

Round trips byte-exact around chunk boundaries and at 64 MiB, overwrite, delete, exists, misses;
half-written entries (chunks without a manifest, a manifest whose chunk is gone or altered) read as
misses; prefixes are separate; a killed or hung node fails calls within about the deadline while
the keys on the other nodes are still served; AUTH / ACL and TLS pass through.
"""

from __future__ import annotations

import array
import os
import threading
import time

import pytest

from ectier.config import RemoteTierConfig
from ectier.errors import CorruptRecordError
from ectier.tiers.remote.backend import RemoteError, RemoteTimeout
from ectier.tiers.remote.redis import MANIFEST, RedisBackend
from redis_cluster import AUTH_PASSWORD, Servers  # noqa: F401
from redis_cluster import redis_cluster, redis_cluster_fn, redis_single, redis_single_auth  # noqa: F401
from redis_cluster import redis_single_fn, redis_single_tls  # noqa: F401
from server_helpers import eventually

KiB, MiB = 1 << 10, 1 << 20
CHUNK = 64 * KiB  # the smallest remote.chunk_bytes: many chunks from small objects
D = 5.0  # deadline of the calls that are not about deadlines


def backend(servers: Servers, **kw) -> RedisBackend:
    kw.setdefault("chunk_bytes", CHUNK)
    return RedisBackend(RemoteTierConfig(backend="redis", addresses=servers.addresses, **kw))


@pytest.fixture(params=["cluster", "single"])
def servers(request) -> Servers:
    return request.getfixturevalue("redis_cluster" if request.param == "cluster" else "redis_single")


@pytest.fixture
def b(servers, request):
    be = backend(servers, prefix=f"t-{request.node.name}".replace("[", "-").replace("]", ""))
    yield be
    be.close()


def chunk_keys(servers: Servers, be: RedisBackend, key: str) -> set[str]:
    return servers.all_keys(f"{be.describe()['prefix']}:c:{key}:*")


SIZES = [0, 1, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK - 1, 3 * CHUNK, 3 * CHUNK + 1]


@pytest.mark.parametrize("n", SIZES)
def test_round_trip_byte_exact(b, n):
    data = os.urandom(n)
    assert b.exists("k", deadline_s=D) is False
    b.put("k", data, deadline_s=D)
    assert b.get("k", deadline_s=D) == data
    assert b.exists("k", deadline_s=D) is True


def _record(n: int):
    from ectier.record import RecordHeader, checksum

    payload = os.urandom(n)
    header = RecordHeader(codec_id=0, dtype="uint8", shape=(n,), namespace="ns", key="k", raw_nbytes=n,
                          payload_nbytes=n, payload_checksum=checksum(payload), version=1, created_ns=1)
    return header, payload


@pytest.mark.parametrize("n", [0, 1, CHUNK - 200, CHUNK, CHUNK + 1, 3 * CHUNK + 7])
def test_put_record_stores_the_joined_record_byte_exact(servers, b, n):
    """A record written as parts (header, payload) is the object ``pack_record`` would make,
    chunked the same way: a reader with another chunk size reads it too."""
    from ectier.record import pack_record

    header, payload = _record(n)
    b.put_record("r", header, payload, deadline_s=D)
    want = bytes(pack_record(header, payload))
    assert b.get("r", deadline_s=D) == want
    assert len(chunk_keys(servers, b, "r")) == -(-len(want) // CHUNK)
    other = backend(servers, prefix=b.describe()["prefix"], chunk_bytes=MiB)
    try:
        assert other.get("r", deadline_s=D) == want
    finally:
        other.close()


def test_64_mib_with_the_default_chunk_size(servers, request):
    be = RedisBackend(RemoteTierConfig(backend="redis", addresses=servers.addresses, prefix="big"))
    data = os.urandom(64 * MiB)
    try:
        be.put("big", data, deadline_s=30)
        assert be.get("big", deadline_s=30) == data
        assert len(chunk_keys(servers, be, "big")) == 64 * MiB // be.describe()["chunk_bytes"]
        be.delete("big", deadline_s=30)
        assert servers.all_keys("big:*") == set()
    finally:
        be.close()


def test_bytes_like_inputs(b):
    words = array.array("H", range(40_000))  # 80,000 bytes of 2-byte items
    b.put("a", words, deadline_s=D)
    assert b.get("a", deadline_s=D) == words.tobytes()
    b.put("m", memoryview(bytearray(b"xyz" * 30_000))[5:], deadline_s=D)
    assert b.get("m", deadline_s=D) == (b"xyz" * 30_000)[5:]


def test_missing_key_is_none(b):
    assert b.get("never-written", deadline_s=D) is None
    assert b.exists("never-written", deadline_s=D) is False
    b.delete("never-written", deadline_s=D)  # no error


def test_overwrite_replaces_and_drops_the_old_chunks(servers, b):
    big, small = os.urandom(5 * CHUNK + 7), os.urandom(100)
    b.put("k", big, deadline_s=D)
    old = chunk_keys(servers, b, "k")
    assert len(old) == 6
    b.put("k", small, deadline_s=D)
    assert b.get("k", deadline_s=D) == small
    new = chunk_keys(servers, b, "k")
    assert len(new) == 1 and not (new & old)


def test_a_reader_with_another_chunk_size_reads_the_writers_layout(servers, b):
    data = os.urandom(4 * CHUNK + 3)
    b.put("k", data, deadline_s=D)
    other = backend(servers, prefix=b.describe()["prefix"], chunk_bytes=MiB)
    try:
        assert other.get("k", deadline_s=D) == data
    finally:
        other.close()


def test_delete_removes_manifest_and_chunks(servers, b):
    b.put("k", os.urandom(3 * CHUNK), deadline_s=D)
    b.put("other", b"stays", deadline_s=D)
    b.delete("k", deadline_s=D)
    assert b.get("k", deadline_s=D) is None and b.exists("k", deadline_s=D) is False
    assert chunk_keys(servers, b, "k") == set()
    assert b.get("other", deadline_s=D) == b"stays"


def test_prefixes_are_separate(servers):
    a, c = backend(servers, prefix="pa"), backend(servers, prefix="pb")
    try:
        a.put("k", b"from a", deadline_s=D)
        assert c.get("k", deadline_s=D) is None and c.exists("k", deadline_s=D) is False
        c.put("k", b"from c", deadline_s=D)
        assert a.get("k", deadline_s=D) == b"from a"
        c.delete("k", deadline_s=D)
        assert a.get("k", deadline_s=D) == b"from a"
    finally:
        a.close()
        c.close()


# ----------------------------------------------------------------------------- half-written entries


def test_chunks_without_a_manifest_are_a_miss(servers, b):
    """A writer that died after its chunks: nothing is visible."""
    prefix = b.describe()["prefix"]
    raw = servers.raw()
    try:
        for i in range(3):
            raw.set(f"{prefix}:c:k:{'ab' * 16}:{i}", os.urandom(CHUNK))
    finally:
        raw.close()
    assert b.get("k", deadline_s=D) is None
    assert b.exists("k", deadline_s=D) is False


@pytest.mark.parametrize("damage", ["chunk deleted", "chunk altered", "chunk truncated", "manifest cut",
                                    "manifest garbage", "manifest a list"])
def test_a_damaged_entry_is_a_miss_or_a_corrupt_record(servers, b, damage):
    """A missing chunk is a plain miss (the server evicts chunks; an overwrite removes them); a
    damaged object raises CorruptRecordError (the tier counts it in checksum_failures)."""
    data = os.urandom(3 * CHUNK + 10)
    b.put("k", data, deadline_s=D)
    prefix = b.describe()["prefix"]
    middle = sorted(chunk_keys(servers, b, "k"), key=lambda k: int(k.rsplit(":", 1)[1]))[1]
    raw = servers.raw()
    try:
        if damage == "chunk deleted":
            raw.delete(middle)
        elif damage == "chunk altered":  # same length, one bit flipped: only the hash sees it
            value = bytearray(raw.get(middle))
            value[100] ^= 1
            raw.set(middle, bytes(value))
        elif damage == "chunk truncated":
            raw.set(middle, raw.get(middle)[:-1])
        elif damage == "manifest cut":
            raw.set(f"{prefix}:m:k", raw.get(f"{prefix}:m:k")[:-1])
        elif damage == "manifest a list":  # another tool writing under the prefix (WRONGTYPE)
            raw.delete(f"{prefix}:m:k")
            raw.rpush(f"{prefix}:m:k", b"x")
        else:
            raw.set(f"{prefix}:m:k", b"\0" * MANIFEST.size)
    finally:
        raw.close()
    if damage == "chunk deleted":
        assert b.get("k", deadline_s=D) is None
    else:
        with pytest.raises(CorruptRecordError):
            b.get("k", deadline_s=D)
    if damage in ("chunk deleted", "manifest cut", "manifest garbage"):
        assert b.exists("k", deadline_s=D) is False
    if damage == "manifest a list":  # one key's fault, not the store's: the next key is served
        b.put("other", data, deadline_s=D)
        assert b.get("other", deadline_s=D) == data


@pytest.mark.parametrize("forged", ["two million chunks", "a chunk of one byte"])
def test_a_forged_manifest_is_refused_before_naming_its_chunks(servers, b, forged):
    """A manifest written by another tool that declares more than ``remote.max_entry_bytes`` (two
    million chunks of 64 KiB: 128 GiB), or chunks below ``remote.chunk_bytes``' minimum, is
    refused at once: ``get`` raises CorruptRecordError within the deadline (the old code named and
    asked every chunk, past the deadline), ``exists`` is False, ``delete`` removes the manifest
    alone, and the key can be written again."""
    data = os.urandom(3 * CHUNK + 10)
    b.put("k", data, deadline_s=D)
    prefix = b.describe()["prefix"]
    n, cb = (2_000_000, CHUNK) if forged == "two million chunks" else (len(data), 1)
    raw = servers.raw()
    try:
        raw.set(f"{prefix}:m:k", MANIFEST.pack(b"ECRM", 1, 0, 0, n, cb, n * cb, 0, b"g" * 16))
    finally:
        raw.close()
    t0 = time.monotonic()
    with pytest.raises(CorruptRecordError, match="max_entry_bytes" if cb == CHUNK else "consistent"):
        b.get("k", deadline_s=D)
    assert b.exists("k", deadline_s=D) is False
    b.delete("k", deadline_s=D)
    assert time.monotonic() - t0 < D, "the forged manifest's chunks were asked"
    b.put("k", data, deadline_s=D)
    assert b.get("k", deadline_s=D) == data


@pytest.mark.parametrize("then", ["delete", "overwrite"])
def test_an_object_larger_than_a_lowered_max_entry_bytes_leaves_no_chunks_behind(servers, b, then):
    """An object written before ``remote.max_entry_bytes`` was lowered (or by a host with a larger
    value) is no longer read (a CorruptRecordError naming the knob), but a delete or an overwrite
    by the host with the lower value still unlinks its chunks: they have no TTL, and before, such
    a manifest was dropped unparsed and its chunks left to the eviction policy."""
    data = os.urandom(5 * CHUNK + 7)
    b.put("k", data, deadline_s=D)
    old = chunk_keys(servers, b, "k")
    assert len(old) == 6
    lower = backend(servers, prefix=b.describe()["prefix"], max_entry_bytes=2 * CHUNK)
    try:
        with pytest.raises(CorruptRecordError, match="max_entry_bytes"):
            lower.get("k", deadline_s=D)
        if then == "delete":
            lower.delete("k", deadline_s=D)
            assert b.get("k", deadline_s=D) is None
        else:
            lower.put("k", b"x" * 100, deadline_s=D)
            assert lower.get("k", deadline_s=D) == b"x" * 100
        assert not (chunk_keys(servers, b, "k") & old), "the old object's chunks were left behind"
    finally:
        lower.close()


def test_concurrent_writers_and_readers_never_see_mixed_bytes(b):
    """Threads overwrite one key with whole values while others read it: a read is a value that was
    written, or a miss (a chunk dropped by the next overwrite), never a mix."""
    values = [bytes([i]) * (2 * CHUNK + i) for i in range(4)]
    b.put("k", values[0], deadline_s=D)
    seen, errors = [], []

    def writer(v):
        try:
            for _ in range(5):
                b.put("k", v, deadline_s=D)
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    def reader():
        try:
            for _ in range(10):
                seen.append(b.get("k", deadline_s=D))
        except Exception as exc:  # pragma: no cover
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(v,)) for v in values] + [threading.Thread(target=reader)
                                                                            for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert all(s is None or s in values for s in seen)
    assert b.get("k", deadline_s=D) in values


# ----------------------------------------------------------------------------- modes, bad input


def test_describe_says_the_mode_and_no_secret(servers, request):
    be = backend(servers)
    try:
        assert be.describe()["mode"] == "not connected"
        be.exists("x", deadline_s=D)
        want = "cluster" if servers.cluster else "single"
        assert be.describe() == {"backend": "redis", "addresses": servers.addresses, "mode": want,
                                 "prefix": "ectier", "chunk_bytes": CHUNK, "tls": False, "auth": False,
                                 "nodes_down": []}
    finally:
        be.close()
    with pytest.raises(RemoteError, match="closed"):
        be.get("x", deadline_s=D)
    be.close()  # idempotent


@pytest.mark.parametrize("call", [
    lambda be: be.put("", b"x", deadline_s=D),
    lambda be: be.get(7, deadline_s=D),
    lambda be: be.get("k", deadline_s=0),
    lambda be: be.exists("k", deadline_s=-1.0),
    lambda be: be.delete("k", deadline_s=True),
])
def test_bad_arguments_are_value_errors(redis_single, call):
    be = backend(redis_single)
    with pytest.raises(ValueError, match="key|deadline_s"):
        call(be)
    with pytest.raises(TypeError, match="data"):
        be.put("k", 12, deadline_s=D)
    be.close()


# ----------------------------------------------------------------------------- faults

DEADLINE = 0.5


def _keys_by_liveness(servers: Servers, be: RedisBackend, keys: list[str], victim) -> tuple[list, list]:
    """(keys all of whose parts are on live nodes, keys with a part on ``victim``)."""
    prefix = be.describe()["prefix"]
    on_victim = servers.keys_on(victim)
    dead = [k for k in keys if f"{prefix}:m:{k}" in on_victim
            or any(c.startswith(f"{prefix}:c:{k}:") for c in on_victim)]
    return [k for k in keys if k not in dead], dead


@pytest.mark.parametrize("fault", ["killed", "hung"])
def test_a_failed_node_fails_within_the_deadline_and_the_others_still_serve(redis_cluster_fn, fault):
    servers = redis_cluster_fn
    be = backend(servers, timeout_s=DEADLINE)
    keys = [f"k{i}" for i in range(12)]
    for k in keys:
        be.put(k, k.encode() * 5000, deadline_s=D)  # 2 chunks each: parts on several nodes
    victim = servers.node_of("ectier:m:k0")
    live, dead = _keys_by_liveness(servers, be, keys, victim)
    assert live and dead
    (servers.kill if fault == "killed" else servers.pause)(victim)
    try:
        for k in dead[:3]:
            start = time.monotonic()
            with pytest.raises(RemoteError):
                be.get(k, deadline_s=DEADLINE)
            assert time.monotonic() - start < 3 * DEADLINE
        start = time.monotonic()
        with pytest.raises(RemoteError):
            be.put("big", os.urandom(MiB), deadline_s=DEADLINE)  # 16 chunks: some land on the victim
        assert time.monotonic() - start < 3 * DEADLINE
        for k in live:
            assert be.get(k, deadline_s=DEADLINE) == k.encode() * 5000
    finally:
        if fault == "hung":
            servers.resume(victim)
    if fault == "hung":  # served again by itself, by the same backend (within seconds)
        assert _eventually(lambda: be.get(dead[0], deadline_s=DEADLINE)) == dead[0].encode() * 5000
    be.close()


def _eventually(fn, within_s: float = 15.0):
    return eventually(fn, (RemoteError,), within_s)


def test_a_hung_node_raises_remote_timeout(redis_cluster_fn):
    servers = redis_cluster_fn
    be = backend(servers, timeout_s=DEADLINE)
    be.put("k", b"v", deadline_s=D)
    victim = servers.node_of("ectier:m:k")
    servers.pause(victim)
    try:
        with pytest.raises(RemoteTimeout):
            be.get("k", deadline_s=DEADLINE)
    finally:
        servers.resume(victim)
        be.close()


def test_a_hung_first_seed_leaves_time_for_the_other_seeds(redis_cluster_fn):
    """remote.addresses names seeds: one that accepts connections and never answers (SIGSTOP)
    takes its share of the connect deadline, not all of it; the next seed connects."""
    servers = redis_cluster_fn
    first = servers.nodes[0]  # the first seed of servers.addresses
    writer = backend(servers, timeout_s=D)
    keys = [f"s{i}" for i in range(24)]
    for k in keys:
        writer.put(k, b"v" * 10, deadline_s=D)
    writer.close()
    live = [k for k in keys if servers.node_of(f"ectier:m:{k}") is not first
            and not any(c.startswith(f"ectier:c:{k}:") for c in servers.keys_on(first))]
    assert live
    servers.pause(first)
    try:
        be = backend(servers, timeout_s=1.0)  # it used to spend every call's deadline on the first seed
        assert _eventually(lambda: be.get(live[0], deadline_s=1.0), within_s=8) == b"v" * 10
        assert be.describe()["mode"] == "cluster"
        be.close()
    finally:
        servers.resume(first)


def test_a_server_down_at_start_is_reached_once_it_is_up(redis_single_fn):
    servers = redis_single_fn
    be = backend(servers, timeout_s=DEADLINE)
    be.put("k", b"v", deadline_s=D)
    node = servers.nodes[0]
    servers.kill(node)
    start = time.monotonic()
    with pytest.raises(RemoteError):
        be.get("k", deadline_s=DEADLINE)
    assert time.monotonic() - start < 3 * DEADLINE
    fresh = backend(servers, timeout_s=DEADLINE)  # made while the server is down
    with pytest.raises(RemoteError):
        fresh.exists("k", deadline_s=DEADLINE)
    servers.restart(node)  # empty again: no persistence
    for be_ in (be, fresh):
        be_.put("k", b"back", deadline_s=D)
        assert be_.get("k", deadline_s=D) == b"back"
        be_.close()
    assert fresh.describe()["mode"] == "single"


# ----------------------------------------------------------------------------- AUTH / ACL, TLS


def test_auth_refused_without_the_password_and_served_with_it(redis_single_auth):
    servers = redis_single_auth
    for kw in ({}, {"password": "wrong"}):
        be = backend(servers, **kw)
        with pytest.raises(RemoteError) as info:
            be.put("k", b"v", deadline_s=D)
        assert AUTH_PASSWORD not in str(info.value)
        be.close()
    be = backend(servers, password=AUTH_PASSWORD)
    be.put("k", b"secret bytes", deadline_s=D)
    assert be.get("k", deadline_s=D) == b"secret bytes"
    assert be.describe()["auth"] is True and AUTH_PASSWORD not in repr(be.describe())
    be.close()


@pytest.mark.parametrize("kw", [{}, {"password": "wrong-secret"}])
def test_a_wrong_password_is_an_authentication_error_naming_the_settings_logged_once(redis_single_auth, kw, caplog):
    be = backend(redis_single_auth, **kw)
    with caplog.at_level("ERROR", logger="ectier.tiers.remote.redis"):
        for _ in range(3):
            with pytest.raises(RemoteError, match="authentication failed.*remote.username / remote.password") as info:
                be.get("k", deadline_s=D)
            assert "wrong-secret" not in str(info.value) and AUTH_PASSWORD not in str(info.value)
    logged = [r for r in caplog.records if "authentication failed" in r.getMessage()]
    assert len(logged) == 1 and "remote.password" in logged[0].getMessage()
    be.close()


def test_acl_user_is_passed_through(redis_single_auth):
    """The ACL of docs/remote-redis.md is enough, and its key pattern is enforced."""
    servers = redis_single_auth
    raw = servers.raw()
    raw.execute_command("ACL", "SETUSER", "ectier-user", "reset", "on", ">user-pw", "~acl:*", "+@read", "+@write",
                        "+@connection", "+info", "+cluster|info", "+cluster|slots", "+cluster|shards")
    raw.close()
    ok = backend(servers, username="ectier-user", password="user-pw", prefix="acl")
    data = os.urandom(3 * CHUNK)
    ok.put("k", data, deadline_s=D)
    ok.put("k", data, deadline_s=D)  # an overwrite (unlinks the old chunks)
    assert ok.exists("k", deadline_s=D) and ok.get("k", deadline_s=D) == data
    ok.delete("k", deadline_s=D)
    ok.close()
    outside = backend(servers, username="ectier-user", password="user-pw", prefix="other")
    with pytest.raises(RemoteError, match="NoPermission|permission"):
        outside.put("k", b"v", deadline_s=D)
    outside.close()


def test_tls_is_passed_through(redis_single_tls):
    servers = redis_single_tls
    be = backend(servers, tls=True, tls_ca_path=servers.tls_ca_path)
    be.put("k", os.urandom(CHUNK + 1), deadline_s=D)
    assert be.exists("k", deadline_s=D) and be.describe()["tls"] is True
    be.close()
    plain = backend(servers, timeout_s=1.0)
    with pytest.raises(RemoteError):
        plain.get("k", deadline_s=1.0)
    plain.close()


def test_a_put_failing_on_a_dead_node_unlinks_the_chunks_it_wrote_on_the_live_ones(redis_cluster_fn):
    """A put whose chunks reach a dead node midway leaves no chunks on the live nodes: they have
    no manifest and no TTL, so under noeviction or a volatile-* policy they were never removed
    (every put during a node outage leaked memory)."""
    servers = redis_cluster_fn
    be = backend(servers, timeout_s=DEADLINE)
    be.put("warm", b"v", deadline_s=D)
    servers.kill(servers.node_of("ectier:m:warm"))
    failed = []
    for i in range(6):
        try:
            be.put(f"big{i}", os.urandom(MiB), deadline_s=D)  # 16 chunks: some on the dead node
        except RemoteError:
            failed.append(f"big{i}")
    assert failed
    left = servers.all_keys("ectier:c:big*", live_only=True)
    assert not [c for c in left if c.split(":")[2] in failed]  # no chunk of a failed put stays
    be.close()
