"""Torch helpers: tensor validation, dtype names, byte views, device strings.

The only module of the lower layers that imports torch; tiers and the cache use it so that the
pure-Python layers (entry, index, policy, codec) stay free of torch.
"""

from __future__ import annotations

import math
import operator

import torch

from .entry import DTYPE_ITEMSIZE, EntryMeta, dtype_itemsize
from .errors import InvalidDeviceError, InvalidTensorError

__all__ = [
    "dtype_name",
    "torch_dtype",
    "meta_for",
    "byte_view",
    "empty_for",
    "output_for",
    "check_out_kind",
    "meta_from_spec",
    "tensor_from_bytes",
    "parse_device",
    "cuda_available",
]


#: ``torch.dtype -> its name`` for every dtype of :data:`~ectier.entry.DTYPE_ITEMSIZE` this torch
#: build has (one dict lookup per put instead of ``str(dtype)`` and ``getattr``)
_DTYPE_NAMES: dict[torch.dtype, str] = {
    getattr(torch, n): n for n in DTYPE_ITEMSIZE if isinstance(getattr(torch, n, None), torch.dtype)}


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16 -> "bfloat16"``.

    Raises:
        InvalidTensorError: for a dtype ectier does not store (e.g. quantized types).
    """
    name = _DTYPE_NAMES.get(dtype)
    if name is None:
        raise InvalidTensorError(f"tensor dtype {dtype} is not supported")
    return name


_TORCH_DTYPES: dict[str, torch.dtype] = {n: d for d, n in _DTYPE_NAMES.items()}


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16" -> torch.bfloat16``.

    Raises:
        InvalidTensorError: for an unknown name or one this torch build lacks (e.g. an fp8 type).
    """
    dt = _TORCH_DTYPES.get(name)
    if dt is None:
        raise InvalidTensorError(f"dtype {name!r} is not available in torch {torch.__version__}")
    return dt


def meta_for(namespace: str, key: str, tensor: object, *, arg: str = "tensor") -> EntryMeta:
    """Describe ``tensor`` for storage.

    Raises:
        InvalidTensorError: naming ``arg`` when it is not a dense, non-quantized ``torch.Tensor``.
    """
    if not isinstance(tensor, torch.Tensor):
        raise InvalidTensorError(f"{arg}: expected torch.Tensor, got {type(tensor).__name__}")
    if tensor.layout is not torch.strided or tensor.is_nested:
        layout = "a nested tensor" if tensor.is_nested else tensor.layout
        raise InvalidTensorError(f"{arg}: only dense (strided) tensors are stored, got {layout}")
    if tensor.is_quantized or tensor.is_meta:
        raise InvalidTensorError(f"{arg}: quantized and meta tensors hold no storable bytes")
    name = _DTYPE_NAMES.get(tensor.dtype) or dtype_name(tensor.dtype)  # (dtype_name raises)
    shape = tuple(tensor.shape)  # a torch.Size holds ints >= 0
    return EntryMeta.trusted(namespace, key, name, shape, tensor.numel() * DTYPE_ITEMSIZE[name])


def meta_from_spec(namespace: str, key: str, dtype: str, shape: object) -> EntryMeta:
    """Describe an entry of ``dtype`` and ``shape`` that is not a tensor yet (a shared-memory put).

    Raises:
        InvalidTensorError: ``shape`` is not a sequence of ints (a float or a bool dimension is
            refused, never truncated), or ``dtype`` is unknown.
    """
    try:  # ints (numpy's too)
        if any(isinstance(d, bool) for d in shape):
            raise TypeError
        dims = tuple(operator.index(d) for d in shape)
    except (TypeError, ValueError):
        raise InvalidTensorError(f"shape: expected a sequence of ints, got {shape!r}") from None
    return EntryMeta(namespace, key, dtype, dims, math.prod(dims) * dtype_itemsize(dtype))


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat ``uint8`` tensor on the same device, in C order.

    Zero-copy for a contiguous tensor; a non-contiguous tensor is first made contiguous (one copy),
    so what is stored is always the logical C-order content, whatever the strides.
    """
    if tensor.is_contiguous() and not tensor.requires_grad and tensor.numel() > 1 and not (
            tensor.is_conj() or tensor.is_neg()):
        return tensor.view(-1).view(torch.uint8)  # the common case: two views, no copy
    # Lazy conjugate / negative-bit views (``x.conj()`` of a complex tensor) keep the original bytes
    # plus a flag; ``view(uint8)`` refuses them. Materialise the logical values (no copy without a flag).
    t = tensor.detach().resolve_conj().resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.dim() == 0:
        t = t.reshape(1)
    flat = t.reshape(-1)
    if flat.stride(0) != 1:
        # Only a tensor of 0 or 1 element is "contiguous" with another stride (``x[::5][:1]``,
        # ``empty[::2]``); view(uint8) needs stride 1. Same memory, zero-copy.
        flat = flat.as_strided(flat.shape, (1,))
    return flat.view(torch.uint8)


def empty_for(meta: EntryMeta, device: torch.device | str = "cpu", *, pin_memory: bool = False) -> torch.Tensor:
    """An uninitialised tensor of ``meta``'s shape and dtype on ``device``."""
    return torch.empty(meta.shape, dtype=torch_dtype(meta.dtype), device=device, pin_memory=pin_memory)


def check_out_kind(out: object) -> None:
    """What a read's ``out`` must be whatever the entry: a tensor whose bytes are its values.

    Raises:
        InvalidTensorError: not a tensor, or a conjugate or negative view (``out.is_conj()``,
            ``out.is_neg()``: its bytes are not the values it shows, so bytes written into it would
            not be the entry's values).
    """
    if not isinstance(out, torch.Tensor):
        raise InvalidTensorError(f"out: expected a contiguous CPU tensor, got {type(out).__name__}")
    if out.is_conj() or out.is_neg():
        raise InvalidTensorError("out: a conjugate or negative view (out.is_conj() / out.is_neg()) cannot take an "
                                 "entry's bytes in place; pass a plain tensor (e.g. torch.empty_like(out))")


def output_for(meta: EntryMeta, out: torch.Tensor | None) -> torch.Tensor:
    """Where a CPU read of ``meta`` lands: a fresh tensor, or the caller's ``out`` (checked).

    Raises:
        InvalidTensorError: ``out`` is not a contiguous CPU tensor, is a conjugate or negative view
            (:func:`check_out_kind`), requires grad, or its dtype
            or shape is not the entry's (the message names both; a shape of as many bytes is refused too: ``out``
            is returned itself, never a view of it in another shape).
    """
    dtype = torch_dtype(meta.dtype)
    if out is None:
        return torch.empty(meta.shape, dtype=dtype)
    check_out_kind(out)
    if not out.is_cpu or out.is_nested or not out.is_contiguous():
        raise InvalidTensorError("out: expected a contiguous CPU tensor")
    if out.requires_grad:
        raise InvalidTensorError("out: a tensor that requires grad cannot be written in place; pass "
                                 "out.detach() or a tensor without requires_grad")
    if out.dtype != dtype or tuple(out.shape) != meta.shape:
        raise InvalidTensorError(
            f"out: the entry is {meta.dtype} {meta.shape}, out is {str(out.dtype).removeprefix('torch.')} "
            f"{tuple(out.shape)}; pass an out of the entry's shape and dtype"
        )
    return out


def tensor_from_bytes(meta: EntryMeta, data: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """The entry ``meta`` from its flat ``uint8`` CPU bytes: a zero-copy view of ``data``, or a
    copy into the caller's ``out`` (checked as :func:`output_for` does)."""
    if out is not None:
        out = output_for(meta, out)
        dst = byte_view(out)
        if dst.numel() and dst.data_ptr() != data.data_ptr():  # already decoded into out: no copy
            dst.copy_(data)
        return out
    if meta.nbytes:
        return data.view(torch_dtype(meta.dtype)).view(meta.shape)
    return torch.empty(meta.shape, dtype=torch_dtype(meta.dtype))


def cuda_available() -> bool:
    """True when torch sees at least one CUDA device."""
    return torch.cuda.is_available()


_CPU = torch.device("cpu")


def parse_device(device: object, *, arg: str = "device") -> torch.device:
    """Validate a device argument: ``None``/``"cpu"`` or an explicit ``"cuda:<index>"``.

    A bare ``"cuda"`` is refused (CUDA ordering rule 6 of docs/architecture.md: device strings are
    explicit, the calling worker's index), as is an index this machine does not have.

    Raises:
        InvalidDeviceError: naming ``arg``.
    """
    if device is None:
        return _CPU
    try:
        dev = torch.device(device)  # type: ignore[arg-type]
    except (RuntimeError, TypeError) as exc:
        raise InvalidDeviceError(f"{arg}: cannot parse {device!r} as a device: {exc}") from None
    if dev.type == "cpu":
        return dev
    if dev.type != "cuda":
        raise InvalidDeviceError(f"{arg}: {dev.type!r} devices are not supported (use 'cpu' or 'cuda:<index>')")
    if dev.index is None:
        raise InvalidDeviceError(f"{arg}: use an explicit 'cuda:<index>' (the calling worker's device), not {device!r}")
    if not torch.cuda.is_available():
        raise InvalidDeviceError(f"{arg}: {device!r} requested but CUDA is not available on this machine")
    if dev.index >= torch.cuda.device_count():
        raise InvalidDeviceError(
            f"{arg}: {device!r} does not exist; this machine has {torch.cuda.device_count()} CUDA device(s)"
        )
    return dev
