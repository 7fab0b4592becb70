"""Entry identity and metadata: keys, namespaces, digests, dtypes, versions. Pure Python (no torch).

- A **key** is vLLM's ``mm_hash`` (a blake3 hex digest, a ``lora:``-prefixed digest) or any id a
  client chooses: any non-empty ``str`` up to :data:`MAX_KEY_BYTES` bytes of UTF-8. Keys are never
  used as file paths.
- The **namespace** (model / encoder identity) is part of the identity: ``(namespace, key)``.
- The **digest** of an identity (BLAKE2b-256 over the length-prefixed UTF-8 of both) is the fixed
  32-byte id used inside the tiers (LMDB keys are limited to 511 bytes). Every stored record also
  carries the full namespace and key, which are compared on read, so even a digest collision
  reads as a miss, never as another entry's bytes.
- Shape and dtype travel with every entry in :class:`EntryMeta`; dtypes are named as torch names
  them without the ``torch.`` prefix (``"bfloat16"``, ``"float8_e4m3fn"``).
"""

from __future__ import annotations

import enum
import functools
import hashlib
import math
import threading
import time
from dataclasses import dataclass

from .errors import InvalidArgumentError, InvalidKeyError, InvalidTensorError

__all__ = [
    "MAX_KEY_BYTES",
    "DTYPE_ITEMSIZE",
    "EntryMeta",
    "EntryState",
    "validate_key",
    "validate_keys",
    "validate_namespace",
    "validate_cost",
    "entry_digest",
    "dtype_itemsize",
    "next_version",
    "advance_version",
]

#: Longest accepted key, in bytes of UTF-8 (vLLM's mm_hash is 64 hex characters).
MAX_KEY_BYTES = 65536
#: Longest accepted namespace, in bytes of UTF-8.
MAX_NAMESPACE_BYTES = 4096

#: Bytes per element of every dtype ectier stores (torch names, without ``torch.``).
DTYPE_ITEMSIZE: dict[str, int] = {
    "bool": 1,
    "uint8": 1,
    "int8": 1,
    "float8_e4m3fn": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "int16": 2,
    "uint16": 2,
    "float16": 2,
    "bfloat16": 2,
    "int32": 4,
    "uint32": 4,
    "float32": 4,
    "int64": 8,
    "uint64": 8,
    "float64": 8,
    "complex64": 8,
    "complex128": 16,
}


def _utf8(text: str) -> bytes:
    # surrogatepass: a str from a JSON/msgpack client may hold lone surrogates; keep them distinct.
    return text.encode("utf-8", "surrogatepass")


def _check_utf8(text: str, arg: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidKeyError(
            f"{arg}: not encodable as UTF-8 (lone surrogate at index {exc.start}); records and the "
            "daemon protocol store identities as UTF-8"
        ) from None


def validate_key(key: object, *, arg: str = "key") -> str:
    """Return ``key`` if it is a non-empty ``str`` of at most :data:`MAX_KEY_BYTES` UTF-8 bytes.

    Raises:
        InvalidKeyError: naming ``arg`` for a non-str, empty or too long key, or one that is not
            valid Unicode text (a lone surrogate cannot be written as UTF-8).
    """
    if not isinstance(key, str):
        raise InvalidKeyError(f"{arg}: expected str (e.g. vLLM's mm_hash), got {type(key).__name__}")
    if not key:
        raise InvalidKeyError(f"{arg}: must be a non-empty string")
    try:
        key.encode("utf-8")
    except UnicodeEncodeError:
        _check_utf8(key, arg)  # raises, naming the position
    if len(key) > MAX_KEY_BYTES // 4 and len(_utf8(key)) > MAX_KEY_BYTES:
        raise InvalidKeyError(f"{arg}: {len(_utf8(key))} bytes of UTF-8, longer than {MAX_KEY_BYTES}")
    return key


def validate_keys(keys: object, *, arg: str = "keys") -> list[str]:
    """Return ``keys`` (any iterable of keys but one ``str``) as a list, each checked by
    :func:`validate_key`.

    Raises:
        InvalidKeyError: naming ``arg`` for one ``str`` or ``bytes`` given where a list of keys
            is expected (its characters are not keys), for anything not iterable (``None``), or
            for an invalid key among them.
    """
    if isinstance(keys, (str, bytes)):
        raise InvalidKeyError(f"{arg}: expected a list of keys, got one {type(keys).__name__}")
    try:
        out = list(keys)
    except TypeError:
        raise InvalidKeyError(f"{arg}: expected a list of keys, got {type(keys).__name__}") from None
    for key in out:
        validate_key(key)
    return out


def validate_namespace(namespace: object, *, arg: str = "namespace") -> str:
    """Return ``namespace`` if it is a non-empty ``str`` of at most 4096 UTF-8 bytes.

    Raises:
        InvalidKeyError: naming ``arg`` otherwise.
    """
    if not isinstance(namespace, str) or not namespace:
        raise InvalidKeyError(f"{arg}: expected a non-empty str, got {namespace!r}")
    _check_utf8(namespace, arg)
    if len(_utf8(namespace)) > MAX_NAMESPACE_BYTES:
        raise InvalidKeyError(f"{arg}: longer than {MAX_NAMESPACE_BYTES} bytes of UTF-8")
    return namespace


def validate_cost(cost_s: object) -> float | None:
    """Return ``cost_s`` (a put's recompute seconds) if it is ``None`` or a finite number >= 0.

    Raises:
        InvalidArgumentError: naming ``cost_s`` otherwise.
    """
    if cost_s is not None and (isinstance(cost_s, bool) or not isinstance(cost_s, (int, float))
                               or not 0 <= cost_s < math.inf):
        raise InvalidArgumentError(f"cost_s: expected a finite number of seconds >= 0, got {cost_s!r}")
    return cost_s


def entry_digest(namespace: str, key: str) -> bytes:
    """The 32-byte id of ``(namespace, key)``: BLAKE2b-256 of both, each length-prefixed (8 bytes LE).

    Length prefixes make ``("a", "bc")`` and ``("ab", "c")`` different identities. The digests of
    the last :data:`_DIGEST_MEMO` short identities are remembered (a hash costs ~2 us per call).
    """
    if len(key) <= 256 and len(namespace) <= 256:
        return _memo_digest(namespace, key)
    return _digest(namespace, key)


def _digest(namespace: str, key: str) -> bytes:
    ns, k = _utf8(namespace), _utf8(key)
    h = hashlib.blake2b(digest_size=32, person=b"ectier-entry")
    h.update(len(ns).to_bytes(8, "little"))
    h.update(ns)
    h.update(len(k).to_bytes(8, "little"))
    h.update(k)
    return h.digest()


#: identities whose digest :func:`entry_digest` remembers (at most ~1 MiB of keys)
_DIGEST_MEMO = 4096
_memo_digest = functools.lru_cache(maxsize=_DIGEST_MEMO)(_digest)


def dtype_itemsize(dtype: str) -> int:
    """Bytes per element of ``dtype`` (a torch dtype name).

    Raises:
        InvalidTensorError: for a dtype ectier does not store.
    """
    try:
        return DTYPE_ITEMSIZE[dtype]
    except KeyError:
        raise InvalidTensorError(
            f"dtype {dtype!r} is not supported; supported: {', '.join(sorted(DTYPE_ITEMSIZE))}"
        ) from None


class EntryState(enum.Enum):
    """Where an entry is in its lifecycle inside one memory tier.

    ``RESERVED`` (bytes accounted, invisible) → ``COMMITTED`` (visible, evictable when unpinned)
    → ``LEAVING`` (chosen as a victim: still readable while it demotes, never chosen again).
    """

    RESERVED = "reserved"
    COMMITTED = "committed"
    LEAVING = "leaving"


@dataclass(frozen=True)
class EntryMeta:
    """What travels with every entry: identity, dtype, shape and size.

    Fields:
        namespace, key: the identity (see module docstring).
        dtype: torch dtype name, e.g. ``"bfloat16"``.
        shape: tensor shape, e.g. ``(2040, 8192)`` for a 1920x1080 image on Qwen3-VL.
        nbytes: ``prod(shape) * itemsize(dtype)``, checked at construction.

    Raises:
        InvalidTensorError: if the fields disagree (unknown dtype, negative dim, wrong nbytes).
    """

    namespace: str
    key: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int

    def __post_init__(self) -> None:
        itemsize = dtype_itemsize(self.dtype)
        if not isinstance(self.shape, tuple) or any(
            isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in self.shape
        ):
            raise InvalidTensorError(f"shape: expected a tuple of ints >= 0, got {self.shape!r}")
        expected = math.prod(self.shape) * itemsize
        if isinstance(self.nbytes, bool) or not isinstance(self.nbytes, int) or self.nbytes != expected:
            raise InvalidTensorError(
                f"nbytes: {self.nbytes} does not match shape {self.shape} x {itemsize} bytes ({expected})"
            )

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return DTYPE_ITEMSIZE[self.dtype]

    @classmethod
    def trusted(cls, namespace: str, key: str, dtype: str, shape: tuple[int, ...], nbytes: int) -> "EntryMeta":
        """An :class:`EntryMeta` whose fields are consistent by construction (read off a tensor:
        ``dtype`` a name of :data:`DTYPE_ITEMSIZE`, ``shape`` ints >= 0, ``nbytes`` their product
        times the item size), built without the checks of ``__init__`` (~1 us saved per put)."""
        meta = object.__new__(cls)
        meta.__dict__.update(namespace=namespace, key=key, dtype=dtype, shape=shape, nbytes=nbytes)
        return meta


#: Highest write version a stored record may carry: versions are wall-clock ns (2**63 ns is the
#: year 2262). A record above it is a forged or damaged header (quarantined at open,
#: ``ectier.tiers.nvme_scan``); the version clock never follows it past the record's u64 field.
MAX_VERSION = (1 << 63) - 1

_version_lock = threading.Lock()
_last_version = 0


def advance_version(floor: int) -> None:
    """Make every later :func:`next_version` larger than ``floor``.

    Called when a store is opened with the highest version it holds, so that an overwrite after a
    restart wins even if the wall clock is now behind the clock that wrote the store. A ``floor``
    above :data:`MAX_VERSION` (a forged header) is ignored: later versions would not fit a record.
    """
    global _last_version
    if floor > MAX_VERSION:
        return
    with _version_lock:
        _last_version = max(_last_version, int(floor))


def next_version() -> int:
    """A strictly increasing 64-bit write version: ``max(last + 1, time.time_ns())``.

    Stamped on every committed write (and stored in NVMe records) so that a stale copy of a key can
    always be told from the current one.
    """
    global _last_version
    with _version_lock:
        _last_version = max(_last_version + 1, time.time_ns())
        return _last_version
