"""MooncakeBackend against a real Mooncake Store: ``mooncake_master`` with its HTTP metadata server
and one store node on loopback (tests/mooncake_master.py starts them; installs libibverbs1 when
missing).

Round trips byte-exact from 1 B to 64 MiB, overwrite (larger and smaller), delete (also of an
object a reader holds a lease on), exists, misses, prefixes; a master killed or hung fails every
call within about its deadline (never Mooncake's own 30 s) and a hung one is served again by
itself; a master down when the backend is made is reached once it is up.
"""

from __future__ import annotations

import array
import os
import time

import pytest

from ectier.config import RemoteTierConfig
from ectier.errors import ConfigError, CorruptRecordError
from ectier.tiers.remote import open_backend
from ectier.tiers.remote.backend import RemoteError, RemoteTimeout
from ectier.tiers.remote.mooncake import MooncakeBackend
from mooncake_master import mooncake_store, mooncake_store_fn  # noqa: F401
from server_helpers import eventually, free_port

KiB, MiB = 1 << 10, 1 << 20
D = 20.0  # deadline of the calls that are not about deadlines
DEADLINE = 1.0


@pytest.fixture
def b(mooncake_store, request):
    be = open_backend(mooncake_store.config(prefix=f"t-{request.node.name}".replace("[", "-").replace("]", "")))
    yield be
    be.close()


def _eventually(fn, within_s: float = 20.0):
    return eventually(fn, (RemoteError,), within_s)


@pytest.mark.parametrize("n", [1, 7, 4 * KiB - 1, 4 * KiB, MiB + 1, 16 * MiB, 64 * MiB])
def test_round_trip_byte_exact(b, n):
    data = os.urandom(n)
    assert b.exists("k", deadline_s=D) is False
    b.put("k", data, deadline_s=D)
    assert b.get("k", deadline_s=D) == data
    assert b.exists("k", deadline_s=D) is True


def test_open_backend_makes_a_mooncake_backend(b):
    assert isinstance(b, MooncakeBackend)
    d = b.describe()
    assert d["backend"] == "mooncake" and d["protocol"] == "tcp"
    assert _eventually(lambda: b.exists("nothing", deadline_s=D)) is False and b.describe()["connected"] is True


def test_bytes_like_inputs(b):
    words = array.array("H", range(40_000))  # 80,000 bytes of 2-byte items
    b.put("a", words, deadline_s=D)
    assert b.get("a", deadline_s=D) == words.tobytes()
    b.put("m", memoryview(bytearray(b"xyz" * 1000))[3:], deadline_s=D)
    assert b.get("m", deadline_s=D) == b"xyz" * 999


def test_an_empty_object_is_refused_with_a_value_error(b):
    with pytest.raises(ValueError, match="data"):
        b.put("e", b"", deadline_s=D)


def test_missing_key_is_none(b):
    assert b.get("absent", deadline_s=D) is None
    assert b.exists("absent", deadline_s=D) is False


@pytest.mark.parametrize("first,second", [(1000, 3 * MiB), (3 * MiB, 1000)])
def test_overwrite_replaces(b, first, second):
    b.put("k", os.urandom(first), deadline_s=D)
    assert len(b.get("k", deadline_s=D)) == first
    new = os.urandom(second)
    b.put("k", new, deadline_s=D)  # Mooncake's plain put would keep the old value
    assert b.get("k", deadline_s=D) == new


def test_delete_removes_even_right_after_a_read(b):
    b.put("k", b"v" * 5000, deadline_s=D)
    assert b.get("k", deadline_s=D) == b"v" * 5000  # the read leaves a lease on the object
    b.delete("k", deadline_s=D)
    assert b.get("k", deadline_s=D) is None and b.exists("k", deadline_s=D) is False
    b.delete("k", deadline_s=D)  # absent: no error


def test_prefixes_are_separate(mooncake_store):
    one, two = open_backend(mooncake_store.config(prefix="p1")), open_backend(mooncake_store.config(prefix="p2"))
    try:
        one.put("k", b"one", deadline_s=D)
        assert two.get("k", deadline_s=D) is None
        two.put("k", b"two", deadline_s=D)
        assert one.get("k", deadline_s=D) == b"one" and two.get("k", deadline_s=D) == b"two"
    finally:
        one.close()
        two.close()


def test_two_clients_see_each_others_objects(mooncake_store):
    one, two = open_backend(mooncake_store.config()), open_backend(mooncake_store.config())
    try:
        data = os.urandom(5 * MiB + 3)
        one.put("shared", data, deadline_s=D)
        assert two.get("shared", deadline_s=D) == data
        two.delete("shared", deadline_s=D)
        assert one.get("shared", deadline_s=D) is None
    finally:
        one.close()
        two.close()


@pytest.mark.parametrize("zero_copy", [True, False])
def test_an_object_larger_than_max_entry_bytes_is_refused_before_it_is_read(mooncake_store, zero_copy, monkeypatch):
    """An object under our prefix larger than the reader's ``remote.max_entry_bytes`` (written by
    another tool, or a host with a larger value) is refused after ``get_size``, before a buffer
    of its size is allocated: CorruptRecordError naming the knob (the tier counts a checksum
    failure; before, any size was allocated and read whole). The next key is served."""
    monkeypatch.setattr(MooncakeBackend, "zero_copy", zero_copy)
    writer = open_backend(mooncake_store.config(prefix="big"))
    reader = open_backend(mooncake_store.config(prefix="big", max_entry_bytes=MiB))
    try:
        writer.put("k", os.urandom(3 * MiB), deadline_s=D)
        writer.put("small", b"x" * KiB, deadline_s=D)
        with pytest.raises(CorruptRecordError, match="remote.max_entry_bytes=1048576"):
            reader.get("k", deadline_s=D)
        assert reader.get("small", deadline_s=D) == b"x" * KiB
    finally:
        writer.close()
        reader.close()


@pytest.mark.parametrize("call", [
    lambda b: b.put("", b"x", deadline_s=D), lambda b: b.put("k", b"x", deadline_s=0),
    lambda b: b.put("k", 12, deadline_s=D), lambda b: b.get(None, deadline_s=D),
    lambda b: b.exists("k", deadline_s=-1), lambda b: b.delete("k", deadline_s=True),
])
def test_bad_arguments_are_value_errors(b, call):
    with pytest.raises((ValueError, TypeError)):
        call(b)


def test_a_config_for_mooncake_names_its_fields():
    with pytest.raises(ConfigError, match="remote.mooncake_protocol"):
        RemoteTierConfig(backend="mooncake", addresses="127.0.0.1:1", mooncake_protocol="udp")
    with pytest.raises(ConfigError, match="remote.addresses"):
        RemoteTierConfig(backend="mooncake", addresses="127.0.0.1:1,127.0.0.1:2")
    with pytest.raises(ConfigError, match="remote.mooncake_metadata_server"):
        RemoteTierConfig(backend="mooncake", addresses="127.0.0.1:1", mooncake_metadata_server="127.0.0.1:8080")
    cfg = RemoteTierConfig(backend="mooncake", addresses="127.0.0.1:1", mooncake_global_segment_bytes="1GiB")
    assert cfg.mooncake_global_segment_bytes == 1 << 30


# ----------------------------------------------------------------------------- faults


@pytest.mark.parametrize("fault", ["killed", "hung"])
def test_a_failed_master_fails_every_call_within_the_deadline(mooncake_store_fn, fault):
    store = mooncake_store_fn
    be = open_backend(store.config())
    be.put("k", b"v" * 1000, deadline_s=D)
    (store.kill_master if fault == "killed" else store.pause_master)()
    try:
        for call in (lambda: be.get("k", deadline_s=DEADLINE), lambda: be.put("n", b"x" * MiB, deadline_s=DEADLINE),
                     lambda: be.exists("k", deadline_s=DEADLINE), lambda: be.delete("other", deadline_s=DEADLINE)):
            start = time.monotonic()
            with pytest.raises(RemoteError):
                call()
            assert time.monotonic() - start < 3 * DEADLINE  # not Mooncake's 30 s RPC timeout
    finally:
        if fault == "hung":
            store.resume_master()
    if fault == "hung":  # served again by itself, by the same backend
        assert _eventually(lambda: be.get("k", deadline_s=DEADLINE), within_s=60) == b"v" * 1000
    else:  # a master started again holds nothing, and the same backend writes to it
        store.start_master()
        _eventually(lambda: be.put("k2", b"back", deadline_s=DEADLINE), within_s=60)
        assert be.get("k2", deadline_s=D) == b"back"
    be.close()


def test_a_hung_master_raises_remote_timeout(mooncake_store_fn):
    store = mooncake_store_fn
    be = open_backend(store.config())
    be.put("k", b"v", deadline_s=D)
    store.pause_master()
    try:
        with pytest.raises(RemoteTimeout):
            be.get("k", deadline_s=DEADLINE)
        assert be.describe()["late_calls"] >= 1  # still running on its own thread, not the caller's
    finally:
        store.resume_master()
        be.close()


def test_close_with_a_hung_master_returns_within_its_bound_with_one_warning(mooncake_store_fn, caplog):
    store = mooncake_store_fn
    be = open_backend(store.config(timeout_s=DEADLINE))
    be.put("k", b"v" * 1000, deadline_s=D)
    store.pause_master()  # Mooncake's own teardown would now take its timeouts (~10-16 s)
    try:
        with caplog.at_level("WARNING", logger="ectier.tiers.remote.mooncake"):
            start = time.monotonic()
            be.close()
            elapsed = time.monotonic() - start
    finally:
        store.resume_master()
    assert elapsed < 4 * DEADLINE
    assert len([r for r in caplog.records if "left open" in r.getMessage()]) == 1
    with pytest.raises(RemoteError, match="closed"):
        be.get("k", deadline_s=DEADLINE)
    be.close()  # idempotent


def test_a_master_down_at_start_is_reached_once_it_is_up(mooncake_store_fn):
    store = mooncake_store_fn
    store.kill_master()
    be = open_backend(store.config(timeout_s=DEADLINE))  # made while the master is down
    try:
        start = time.monotonic()
        with pytest.raises(RemoteError):
            be.exists("k", deadline_s=DEADLINE)
        assert time.monotonic() - start < 3 * DEADLINE
        assert be.describe()["connected"] is False
        store.start_master()
        _eventually(lambda: be.put("k", b"up", deadline_s=DEADLINE), within_s=60)
        assert be.get("k", deadline_s=D) == b"up" and be.describe()["connected"] is True
    finally:
        be.close()


def test_a_master_that_never_answers_costs_each_call_its_deadline_only():
    port = free_port()  # nothing listens there
    be = open_backend(RemoteTierConfig(backend="mooncake", addresses=f"127.0.0.1:{port}", timeout_s=DEADLINE,
                                       mooncake_metadata_server=f"http://127.0.0.1:{port}/metadata",
                                       mooncake_global_segment_bytes=0))
    try:
        for _ in range(3):
            start = time.monotonic()
            with pytest.raises(RemoteError, match="does not accept connections|not reached"):
                be.get("k", deadline_s=DEADLINE)
            assert time.monotonic() - start < 3 * DEADLINE
    finally:
        be.close()
    with pytest.raises(RemoteError, match="closed"):
        be.get("k", deadline_s=DEADLINE)


@pytest.mark.parametrize("n", [0, 1000, 6 * MiB, 12 * MiB])  # the fixture's client buffer: 16 MiB
def test_put_record_stores_header_then_payload_byte_exact(b, n):
    import torch

    from ectier.codec import RawCodec
    from ectier.entry import EntryMeta
    from ectier.record import pack_record
    from ectier.tiers.nvme_record import encode_record

    payload = torch.frombuffer(bytearray(os.urandom(n)), dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
    rec = encode_record(RawCodec(), EntryMeta("ns", "k", "uint8", (n,), n), payload, 3)
    b.put_record("r", rec.header, rec.payload, deadline_s=D)  # upsert_parts up to 8 MiB, else joined
    assert b.get("r", deadline_s=D) == bytes(pack_record(rec.header, rec.payload))


def test_a_store_node_killed_is_errors_within_the_deadline_and_bounded_memory(mooncake_store_fn, monkeypatch):
    from ectier.tiers.remote import mooncake_calls

    store = mooncake_store_fn
    be = open_backend(store.config())
    try:
        be.put("k", os.urandom(2 * MiB), deadline_s=D)
        store.node.stop()  # the only node with memory: every transfer now fails
        start = time.monotonic()
        with pytest.raises(RemoteError):
            be.get("k", deadline_s=DEADLINE)
        assert time.monotonic() - start < 3 * DEADLINE
        held = be.describe()["held_bytes"]
        assert held >= 2 * MiB  # the failed transfer's buffer is kept, not freed under it
        monkeypatch.setattr(mooncake_calls, "HOLD_CAP_BYTES", 1)
        with pytest.raises(RemoteError, match="kept"):  # past the cap: no new transfer
            be.get("k", deadline_s=DEADLINE)
    finally:
        be.close()


def test_buffers_of_failed_transfers_are_released_after_hold_s(mooncake_store_fn, monkeypatch):
    from ectier.tiers.remote import mooncake_calls

    monkeypatch.setattr(mooncake_calls, "HOLD_S", 0.0)
    store = mooncake_store_fn
    be = open_backend(store.config())
    try:
        be.put("k", os.urandom(2 * MiB), deadline_s=D)
        store.node.stop()
        with pytest.raises(RemoteError):
            be.get("k", deadline_s=DEADLINE)
        assert be.describe()["held_bytes"] >= 2 * MiB
        be.exists("k", deadline_s=DEADLINE)  # the next call (the master's) unregisters and drops it...
        assert be.describe()["held_bytes"] == 0  # ...so memory stays bounded through an outage
    finally:
        be.close()


def test_a_get_while_the_object_is_being_written_is_a_miss_not_an_error(mooncake_store):
    """A reader polling a key whose put is in flight on another client gets ``None`` (Mooncake
    answers REPLICA_IS_NOT_READY until the write completes), never a RemoteError — an error
    would back the whole tier off for ``remote.backoff_s``."""
    import threading

    cfg = mooncake_store.config(prefix="t-not-ready", mooncake_local_buffer_bytes="96MiB")
    writer, reader = open_backend(cfg), open_backend(cfg)
    data = os.urandom(32 * MiB)
    errors: list[BaseException] = []
    try:
        for i in range(6):
            key = f"k{i}"
            t = threading.Thread(target=lambda k=key: writer.put(k, data, deadline_s=D))
            t.start()
            got = None
            while got is None:
                try:
                    got = reader.get(key, deadline_s=D)
                except RemoteError as exc:
                    errors.append(exc)
                    break
            t.join()
            assert errors == [], errors
            assert bytes(got) == data
    finally:
        writer.close()
        reader.close()
