"""RemoteTier.fetch on a backend that returns a writable buffer (as Mooncake's ``get_into`` does):
a raw record's payload is handed out as the tensor without a copy, every record check still runs
first (a damaged, foreign or short object is a counted miss, never wrong bytes), and a read-only
``bytes`` (as Redis returns) is copied as before. No Mooncake server needed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ectier.config import RemoteTierConfig
from ectier.entry import EntryMeta, entry_digest
from ectier.testing import MemoryBackend
from ectier.tiers.remote.tier import RemoteTier


class WritableBackend(MemoryBackend):
    """Gets return a memoryview of a new writable numpy buffer (kept in ``last`` for the checks)."""

    def __init__(self) -> None:
        super().__init__()
        self.last: np.ndarray | None = None

    def get(self, key, *, deadline_s):
        raw = super().get(key, deadline_s=deadline_s)
        if raw is None:
            return None
        self.last = np.frombuffer(bytearray(raw), dtype=np.uint8)
        return memoryview(self.last)


def _tier(backend) -> RemoteTier:
    return RemoteTier(RemoteTierConfig(backend="redis", addresses="127.0.0.1:1"), backend)


def _put(tier: RemoteTier, key: str, n: int) -> tuple[bytes, torch.Tensor]:
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n))
    digest = entry_digest("ns", key)
    assert tier.write(EntryMeta("ns", key, "uint8", (n,), n), data, 1, digest)
    return digest, data


@pytest.mark.parametrize("n", [1, 4095, 1 << 20])
def test_a_raw_record_in_a_writable_buffer_is_handed_out_without_a_copy(n):
    be = WritableBackend()
    tier = _tier(be)
    digest, data = _put(tier, "k", n)
    header, out = tier.fetch(digest, "ns", "k")
    assert header.raw_nbytes == n and torch.equal(out, data)
    lo = be.last.ctypes.data
    assert lo < out.data_ptr() and out.data_ptr() + n == lo + be.last.size  # a view of the payload


def test_read_only_bytes_are_copied_into_a_writable_tensor():
    be = MemoryBackend()  # returns bytes
    tier = _tier(be)
    digest, data = _put(tier, "k", 1000)
    _, out = tier.fetch(digest, "ns", "k")
    assert torch.equal(out, data)
    out[0] ^= 1  # writable, and not the stored bytes
    assert torch.equal(tier.fetch(digest, "ns", "k")[1], data)


@pytest.mark.parametrize("damage", ["payload bit", "header bit", "truncated", "foreign key"])
def test_a_damaged_object_in_a_writable_buffer_is_a_counted_miss(damage):
    be = WritableBackend()
    tier = _tier(be)
    digest, _ = _put(tier, "k", 4096)
    (obj_key,) = be.objects
    raw = bytearray(be.objects[obj_key])
    if damage == "payload bit":
        raw[-1] ^= 1
    elif damage == "header bit":
        raw[10] ^= 1
    elif damage == "truncated":
        del raw[-1]
    be.objects[obj_key] = bytes(raw)
    key = "other" if damage == "foreign key" else "k"
    assert tier.fetch(digest, "ns", key) is None
    assert tier.describe()["checksum_failures"] == 1
