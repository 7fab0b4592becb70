"""ectier — a tiered store for multimodal encoder outputs (vLLM's encoder cache, keyed by ``mm_hash``).

Public API::

    from ectier import TieredCache, CacheConfig, HostTierConfig, NvmeTierConfig
    cache = TieredCache(CacheConfig(nvme=NvmeTierConfig(path="/nvme/ectier")))
    cache.put(mm_hash, encoder_output)          # (N, 8192) bfloat16 for Qwen3-VL -> PutHandle
    cache.prefetch([mm_hash], device="cuda:0")  # -> [LoadHandle]: promotions start early
    tensor = cache.get(mm_hash)                 # byte-identical copy, or None

See ``docs/architecture.md`` for the layers.
"""

from .config import CacheConfig, GpuTierConfig, HostTierConfig, NvmeTierConfig, parse_bytes
from .errors import (
    ConfigError,
    CorruptRecordError,
    EctierError,
    EntryTooLargeError,
    InvalidArgumentError,
    InvalidDeviceError,
    InvalidLeaseError,
    LeaseExpiredError,
    CacheClosedError,
    InvalidKeyError,
    InvalidTensorError,
    StoreLockedError,
    StoreOpenError,
    StoreDamagedError,
    TierWriteError,
    UnknownCodecError,
)
from .sizing import image_tokens, smart_resize

__version__ = "0.1.0"


def __getattr__(name: str):
    # TieredCache imports torch (~2 s); load it on first use so that control-only users (the daemon
    # client's contains/stats, `ectier stats`, `ectier size`) do not pay for it.
    if name in ("TieredCache", "PutHandle", "LoadHandle"):
        from . import cache

        return getattr(cache, name)
    raise AttributeError(f"module 'ectier' has no attribute {name!r}")

__all__ = [
    "TieredCache",
    "PutHandle",
    "LoadHandle",
    "CacheConfig",
    "GpuTierConfig",
    "HostTierConfig",
    "NvmeTierConfig",
    "parse_bytes",
    "image_tokens",
    "smart_resize",
    "EctierError",
    "ConfigError",
    "CorruptRecordError",
    "EntryTooLargeError",
    "InvalidArgumentError",
    "InvalidDeviceError",
    "InvalidLeaseError",
    "LeaseExpiredError",
    "CacheClosedError",
    "InvalidKeyError",
    "InvalidTensorError",
    "StoreLockedError",
    "StoreOpenError",
    "StoreDamagedError",
    "TierWriteError",
    "UnknownCodecError",
    "__version__",
]
