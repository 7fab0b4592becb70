"""The Mooncake backend's pool of registered memory (ectier/tiers/remote/mooncake_pool.py): its
bound, reuse only of buffers nothing lives over, the copy that computes the payload's checksum;
then against a real Mooncake Store (tests/mooncake_master.py): gets and record puts register no
buffer per call once warm, a fetched tensor keeps its bytes however many fetches follow, several
fetches at once, the bound with tensors held past it (the per-call path serves them)."""

from __future__ import annotations

import gc
import os
import threading

import numpy as np
import pytest
import torch
import xxhash

from ectier.codec import RawCodec
from ectier.entry import EntryMeta, entry_digest
from ectier.record import header_nbytes, pack_record, unpack_header
from ectier.tiers.nvme_record import encode_record
from ectier.tiers.remote.mooncake import MooncakeBackend
from ectier.tiers.remote.mooncake_pool import BufferPool, capacity_for, copy_hashing
from ectier.tiers.remote.tier import RemoteTier
from mooncake_master import mooncake_store  # noqa: F401

KiB, MiB = 1 << 10, 1 << 20
D = 20.0


class FakeStore:
    """Counts registrations; refuses one when ``refuse`` is set."""

    def __init__(self) -> None:
        self.registered: dict[int, int] = {}
        self.unregistered: list[int] = []
        self.refuse = False

    def register_buffer(self, ptr: int, size: int) -> int:
        if self.refuse:
            return -1
        self.registered[ptr] = size
        return 0

    def unregister_buffer(self, ptr: int) -> int:
        self.unregistered.append(ptr)
        del self.registered[ptr]
        return 0


# ----------------------------------------------------------------------------- the pool alone

def test_capacity_classes_leave_at_most_an_eighth_unused():
    assert capacity_for(1) == MiB and capacity_for(MiB) == MiB
    for n in (MiB + 1, 3 * MiB + 5, 16 * MiB + 300, 64 * MiB + 300, 255 * MiB):
        c = capacity_for(n)
        assert n <= c <= n + n // 8


def test_the_bound_holds_and_a_request_past_it_is_refused():
    store, pool = FakeStore(), BufferPool(8 * MiB)
    bufs = [pool.acquire(store, MiB) for _ in range(8)]
    assert all(b is not None for b in bufs)
    assert pool.acquire(store, MiB) is None  # all 8 MiB leased
    assert pool.acquire(store, 9 * MiB) is None  # larger than the whole pool
    d = pool.describe()
    assert d["held_bytes"] == d["out_bytes"] == 8 * MiB and d["refusals"] == 2
    assert sum(store.registered.values()) == 8 * MiB


def test_a_buffer_is_reused_only_once_its_last_view_died():
    store, pool = FakeStore(), BufferPool(2 * MiB)
    a = pool.acquire(store, MiB)
    view = a.view(MiB)
    np.frombuffer(view, dtype=np.uint8)[:] = 7
    tensor = torch.frombuffer(view[100:], dtype=torch.uint8)  # what the tier hands out
    del view, a
    gc.collect()
    b = pool.acquire(store, MiB)  # the first is still under the tensor: a second buffer
    assert b is not None and pool.acquire(store, MiB) is None
    np.frombuffer(b.array, dtype=np.uint8)[:] = 9
    assert bool((tensor == 7).all())
    pool.give_back(b)
    c = pool.acquire(store, MiB)
    assert c is b  # the free one, not the one under the tensor
    del tensor
    d = pool.acquire(store, MiB)  # the tensor died: its buffer is back
    assert d is not None and d is not c
    assert pool.describe()["registrations"] == 2


def test_a_view_dying_on_another_thread_returns_its_buffer():
    store, pool = FakeStore(), BufferPool(MiB)
    box = [pool.acquire(store, 1000).view(1000)]
    t = threading.Thread(target=box.clear)
    t.start()
    t.join()
    assert pool.acquire(store, 1000) is not None and pool.describe()["registrations"] == 1


def test_free_buffers_make_room_for_another_size_and_are_unregistered():
    store, pool = FakeStore(), BufferPool(4 * MiB)
    small = [pool.acquire(store, MiB) for _ in range(4)]
    for b in small:
        pool.give_back(b)
    big = pool.acquire(store, 3 * MiB)
    assert big is not None and len(store.unregistered) == 3  # the oldest free ones dropped
    assert pool.describe()["held_bytes"] == 4 * MiB


def test_forget_drops_a_buffer_a_failed_transfer_may_use_and_refused_registration_is_none():
    store, pool = FakeStore(), BufferPool(2 * MiB)
    b = pool.acquire(store, MiB)
    pool.forget(b)
    assert pool.describe()["held_bytes"] == 0
    store.refuse = True
    assert pool.acquire(store, MiB) is None and pool.describe()["held_bytes"] == 0


def test_close_refuses_new_leases_and_views_outlive_it():
    store, pool = FakeStore(), BufferPool(2 * MiB)
    view = pool.acquire(store, MiB).view(MiB)
    pool.give_back(pool.acquire(store, MiB))
    pool.close(store)
    assert pool.acquire(store, 10) is None
    np.frombuffer(view, dtype=np.uint8)[:] = 3  # still valid memory
    del view
    assert pool.describe()["held_bytes"] == 0


@pytest.mark.parametrize("n", [0, 1, MiB - 1, 3 * MiB + 17])
def test_copy_hashing_copies_and_returns_the_xxh3(n):
    src = np.frombuffer(os.urandom(n), dtype=np.uint8)
    dst = np.zeros(n, dtype=np.uint8)
    assert copy_hashing(memoryview(dst), memoryview(src)) == xxhash.xxh3_64_intdigest(src)
    assert bytes(dst) == bytes(src)


def test_copy_hashing_refuses_a_destination_of_another_length():
    with pytest.raises(ValueError, match="room"):
        copy_hashing(memoryview(bytearray(3)), memoryview(b"abcd"))


# ----------------------------------------------------------------------------- on a Mooncake Store

class Counting:
    """A Mooncake client that counts its calls by name."""

    def __init__(self, client) -> None:
        self._client = client
        self.calls: dict[str, int] = {}

    def __getattr__(self, name):
        attr = getattr(self._client, name)
        if not callable(attr):
            return attr

        def counted(*args, **kw):
            self.calls[name] = self.calls.get(name, 0) + 1
            return attr(*args, **kw)
        return counted


@pytest.fixture
def counted(mooncake_store, request):
    from mooncake.store import MooncakeDistributedStore

    made: list[Counting] = []

    def factory():
        made.append(Counting(MooncakeDistributedStore()))
        return made[-1]

    def make(cls=MooncakeBackend, **kw):
        prefix = f"pool-{request.node.name}".replace("[", "-").replace("]", "")
        be = cls(mooncake_store.config(prefix=prefix, **kw), store_factory=factory)
        opened.append(be)
        assert be.exists("warm-up", deadline_s=D) is False
        return be, made[-1]

    opened: list[MooncakeBackend] = []
    yield make
    for be in opened:
        be.close()


def _record(key: str, n: int, version: int = 1):
    payload = torch.frombuffer(bytearray(os.urandom(n)), dtype=torch.uint8)
    return encode_record(RawCodec(), EntryMeta("ns", key, "uint8", (n,), n), payload, version), payload


def test_warm_gets_and_record_puts_register_no_buffer(counted):
    be, client = counted()
    rec, _ = _record("k", 2 * MiB)
    be.put_record("k", rec.header, rec.payload, deadline_s=D)
    for _ in range(10):
        got = be.get("k", deadline_s=D)
        assert bytes(got) == bytes(pack_record(rec.header, rec.payload))
        del got
        be.put_record("k", rec.header, rec.payload, deadline_s=D)
    assert client.calls.get("register_buffer", 0) == 1  # one pool buffer, registered once
    assert client.calls.get("get_size", 0) == 0  # the size it wrote: known
    assert client.calls.get("upsert_parts", 0) == 0 and client.calls["upsert_from"] == 11
    pool = be.describe()["buffer_pool"]
    assert pool["registrations"] == 1 and pool["reuses"] == 20 and pool["out_bytes"] == 0


def test_put_record_stores_the_payloads_checksum_whatever_the_header_says(counted):
    be, _ = counted()
    meta = EntryMeta("ns", "k", "uint8", (5000,), 5000)
    rec = encode_record(RawCodec(), meta, torch.frombuffer(bytearray(os.urandom(5000)), dtype=torch.uint8), 1,
                        with_checksum=False)
    assert rec.header.payload_checksum == 0
    be.put_record("k", rec.header, rec.payload, deadline_s=D)
    got = bytes(be.get("k", deadline_s=D))
    assert unpack_header(got[:header_nbytes(got)]).payload_checksum == xxhash.xxh3_64_intdigest(rec.payload)
    assert got.endswith(bytes(rec.payload))


def test_fetched_tensors_keep_their_bytes_through_many_more_fetches(counted):
    be, _ = counted()
    tier = RemoteTier(_tier_cfg(be), be)
    sizes = [MiB + 7, 3 * MiB, 64 * KiB, 5 * MiB + 1]
    want = {}
    for i, n in enumerate(sizes):
        data = torch.frombuffer(bytearray(os.urandom(n)), dtype=torch.uint8)
        key = f"k{i}"
        assert tier.write(EntryMeta("ns", key, "uint8", (n,), n), data, 1, entry_digest("ns", key))
        want[key] = data
    kept = []
    for r in range(30):
        key = f"k{r % len(sizes)}"
        _, out = tier.fetch(entry_digest("ns", key), "ns", key)
        assert torch.equal(out, want[key])
        if r % 3 == 0:
            kept.append((key, out))  # held while the others come and go
        out[:16] = 0  # a writable tensor of its own: scribbling on it changes no other
        del out
    for key, out in kept:
        assert torch.equal(out[16:], want[key][16:])
    pool = be.describe()["buffer_pool"]
    assert pool["reuses"] > 0 and pool["out_bytes"] > 0
    del kept, out
    assert be.describe()["buffer_pool"]["out_bytes"] == 0


def _tier_cfg(be):
    from ectier.config import RemoteTierConfig

    return RemoteTierConfig(backend="mooncake", addresses="127.0.0.1:1", timeout_s=D)  # the tier's own knobs


def test_several_fetches_at_once_get_their_own_bytes(counted):
    be, _ = counted()
    tier = RemoteTier(_tier_cfg(be), be)
    want = {}
    for i in range(6):
        n = MiB + 1000 * i
        data = torch.frombuffer(bytearray(os.urandom(n)), dtype=torch.uint8)
        assert tier.write(EntryMeta("ns", f"k{i}", "uint8", (n,), n), data, 1, entry_digest("ns", f"k{i}"))
        want[f"k{i}"] = data
    bad: list[str] = []

    def work(t: int) -> None:
        held = []
        for r in range(12):
            key = f"k{(t + r) % 6}"
            got = tier.fetch(entry_digest("ns", key), "ns", key)
            if got is None or not torch.equal(got[1], want[key]):
                bad.append(key)
            held = [got] + held[:2]
        for got in held:
            key = got[0].key
            if not torch.equal(got[1], want[key]):
                bad.append(key)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert bad == []


def test_past_the_bound_fetches_use_memory_registered_for_the_call(counted):
    be, client = counted(mooncake_buffer_pool_bytes=4 * MiB)
    tier = RemoteTier(_tier_cfg(be), be)
    want = {}
    for i in range(8):
        data = torch.frombuffer(bytearray(os.urandom(MiB - 4096)), dtype=torch.uint8)
        assert tier.write(EntryMeta("ns", f"k{i}", "uint8", (MiB - 4096,), MiB - 4096), data, 1,
                          entry_digest("ns", f"k{i}"))
        want[f"k{i}"] = data
    held = [tier.fetch(entry_digest("ns", f"k{i}"), "ns", f"k{i}") for i in range(8)]
    assert all(torch.equal(got[1], want[got[0].key]) for got in held)
    pool = be.describe()["buffer_pool"]
    assert pool["held_bytes"] <= 4 * MiB and pool["refusals"] >= 4
    assert client.calls.get("register_buffer", 0) >= 4 + 4  # the pool's 4, then one per call past it
    del held
    before = client.calls["register_buffer"]
    for i in range(4):
        assert torch.equal(tier.fetch(entry_digest("ns", f"k{i}"), "ns", f"k{i}")[1], want[f"k{i}"])
    assert client.calls["register_buffer"] == before  # back in the pool


@pytest.mark.parametrize("second", [3 * MiB, 1000, 2 * MiB + 1])
def test_an_object_another_client_replaced_or_deleted_is_read_as_it_is_now(counted, second):
    mine, client = counted()
    other, _ = counted()
    first = os.urandom(2 * MiB)
    mine.put("k", first, deadline_s=D)
    assert bytes(mine.get("k", deadline_s=D)) == first  # size known from here on
    data = os.urandom(second)
    other.put("k", data, deadline_s=D)
    assert bytes(mine.get("k", deadline_s=D)) == data  # grown past the hint: asks the size after all
    assert bytes(mine.get("k", deadline_s=D)) == data
    other.delete("k", deadline_s=D)
    assert mine.get("k", deadline_s=D) is None
    assert client.calls.get("get_size", 0) == (1 if second > capacity_for(2 * MiB) else 0)


def test_a_copy_into_the_pool_ending_past_the_deadline_writes_nothing(counted, monkeypatch):
    import time

    from ectier.tiers.remote import mooncake_io
    from ectier.tiers.remote.backend import RemoteTimeout

    be, _ = counted()
    old, _ = _record("k", MiB, version=1)
    be.put_record("k", old.header, old.payload, deadline_s=D)
    new, _ = _record("k", MiB, version=2)
    real = mooncake_io.copy_hashing

    def slow(dst, src):
        time.sleep(1.0)  # the caller gives up meanwhile (and may reuse src)
        return real(dst, src)

    monkeypatch.setattr(mooncake_io, "copy_hashing", slow)
    with pytest.raises(RemoteTimeout):
        be.put_record("k", new.header, new.payload, deadline_s=0.3)
    time.sleep(1.5)  # the late call ended
    monkeypatch.setattr(mooncake_io, "copy_hashing", real)
    assert bytes(be.get("k", deadline_s=D)) == bytes(pack_record(old.header, old.payload))


def test_a_record_past_pooled_put_max_bytes_goes_through_upsert_parts_with_its_checksum(counted):
    class SmallPooledPuts(MooncakeBackend):
        pooled_put_max_bytes = MiB

    be, client = counted(SmallPooledPuts)
    meta = EntryMeta("ns", "k", "uint8", (2 * MiB,), 2 * MiB)
    rec = encode_record(RawCodec(), meta, torch.frombuffer(bytearray(os.urandom(2 * MiB)), dtype=torch.uint8), 1,
                        with_checksum=False)
    be.put_record("k", rec.header, rec.payload, deadline_s=D)  # 2 MiB: within half the 16 MiB client buffer
    assert client.calls.get("upsert_parts", 0) == 1 and client.calls.get("upsert_from", 0) == 0
    got = bytes(be.get("k", deadline_s=D))
    assert unpack_header(got[:header_nbytes(got)]).payload_checksum == xxhash.xxh3_64_intdigest(rec.payload)
    assert got.endswith(bytes(rec.payload))


def test_no_pool_registers_per_call(counted):
    be, client = counted(mooncake_buffer_pool_bytes=0)
    be.put("k", os.urandom(MiB), deadline_s=D)
    for _ in range(3):
        assert len(be.get("k", deadline_s=D)) == MiB
    assert client.calls["register_buffer"] == 4 and be.describe()["buffer_pool"] is None


@pytest.mark.parametrize("pooled_max", [64 * MiB, 0], ids=["from the pool", "upsert_parts"])
def test_a_known_checksum_is_stored_as_given_and_an_object_that_fails_it_is_a_miss(counted, pooled_max):
    class Backend(MooncakeBackend):
        pooled_put_max_bytes = pooled_max

    be, client = counted(Backend)
    tier = RemoteTier(_tier_cfg(be), be)
    n = 2 * MiB + 3
    data = torch.frombuffer(bytearray(os.urandom(n)), dtype=torch.uint8)
    right = xxhash.xxh3_64_intdigest(data.numpy())
    for key, csum in (("good", right), ("bad", right ^ 1)):
        assert tier.write(EntryMeta("ns", key, "uint8", (n,), n), data, 1, entry_digest("ns", key),
                          payload_checksum=csum)
        got = bytes(be.get(tier.key_of(entry_digest("ns", key)), deadline_s=D))
        assert unpack_header(got[:header_nbytes(got)]).payload_checksum == csum  # stored as given
    assert client.calls.get("upsert_parts", 0) == (0 if pooled_max else 2)
    hit = tier.fetch(entry_digest("ns", "good"), "ns", "good")
    assert hit is not None and torch.equal(hit[1], data)
    assert tier.fetch(entry_digest("ns", "bad"), "ns", "bad") is None  # its payload is not what its header says
    assert tier.describe()["checksum_failures"] == 1
