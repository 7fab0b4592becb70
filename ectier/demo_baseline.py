"""The ``ectier demo`` baseline: a safetensors file per ``mm_hash``, like vLLM's ``ECExampleConnector``."""

from __future__ import annotations

import os
from pathlib import Path

import torch

__all__ = ["SafetensorsPerItemStore"]


class SafetensorsPerItemStore:
    """Baseline store that mirrors the behaviour of vLLM's in-tree ``ECExampleConnector``.

    Written from that connector's documented behaviour (no vLLM code copied): one directory per
    ``mm_hash`` holding ``encoder_cache.safetensors`` with a single tensor named ``"ec_cache"``;
    save is ``tensor.cpu()`` + ``safetensors.torch.save_file``, synchronous, on pageable memory;
    load is ``safetensors.torch.load_file(path)["ec_cache"]``; presence is ``os.path.exists``;
    nothing is ever evicted (the directory grows without bound). Unlike ectier it turns the key
    into a file path.

    Args:
        root: directory for the per-item directories (created if missing).

    Raises:
        ImportError: safetensors is not installed.

    ``save`` raises ``OSError`` where safetensors cannot write the file (a full disk).
    """

    FILENAME = "encoder_cache.safetensors"
    TENSOR_NAME = "ec_cache"

    def __init__(self, root: str | os.PathLike) -> None:
        import safetensors
        import safetensors.torch as st

        self._st = st
        self._error = safetensors.SafetensorError
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def path(self, mm_hash: str) -> str:
        """``{root}/{mm_hash}/encoder_cache.safetensors``."""
        return os.path.join(self.root, mm_hash, self.FILENAME)

    def has(self, mm_hash: str) -> bool:
        """True if a file exists for ``mm_hash`` (the connector's ``has_cache_item``)."""
        return os.path.exists(self.path(mm_hash))

    def save(self, mm_hash: str, tensor: torch.Tensor) -> None:
        """Write ``tensor`` (any device) to its own safetensors file (the connector's ``save_caches``)."""
        path = self.path(mm_hash)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        try:
            self._st.save_file({self.TENSOR_NAME: tensor.cpu()}, path)
        except self._error as exc:  # (a full disk inside safetensors is no OSError)
            raise OSError(f"safetensors baseline: cannot write {path}: {exc}") from None

    def load(self, mm_hash: str, *, materialize: bool = True) -> torch.Tensor:
        """Read the tensor back (the connector's ``start_load_caches``). Raises FileNotFoundError.

        On the CPU, ``load_file`` returns a tensor backed by a lazy memory map of the file: no
        byte is read until first use (the demo passes ``materialize=False`` and reads every byte
        itself, as the consumer does). ``materialize`` (default) copies the bytes out of the
        mapping into an owned tensor (``clone``), as a load with ``device=<cuda device>`` reads
        every byte at load time.
        """
        tensor = self._st.load_file(self.path(mm_hash))[self.TENSOR_NAME]
        return tensor.clone() if materialize and tensor.device.type == "cpu" else tensor
