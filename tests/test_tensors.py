"""Tests for ectier.tensors: dtype names, byte views, tensor metadata, device strings. CPU only.

Byte views are checked against numpy: the tensor is built from known bytes and the same view
(transpose, step slice, ...) is applied to a numpy uint8 array with a trailing itemsize axis, so the
expected C-order bytes never come from torch itself.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ectier.entry import DTYPE_ITEMSIZE, EntryMeta
from ectier.errors import InvalidDeviceError, InvalidTensorError
from ectier.tensors import byte_view, dtype_name, empty_for, meta_for, parse_device, torch_dtype

TORCH_DTYPE_NAMES = [n for n in sorted(DTYPE_ITEMSIZE) if isinstance(getattr(torch, n, None), torch.dtype)]


# ------------------------------------------------------------------------------------ dtypes


def test_common_dtypes_are_available_in_this_torch():
    for name in ("bool", "uint8", "int8", "float16", "bfloat16", "float32", "float64", "int64", "complex64"):
        assert name in TORCH_DTYPE_NAMES


@pytest.mark.parametrize("name", TORCH_DTYPE_NAMES)
def test_dtype_name_round_trip(name):
    dt = torch_dtype(name)
    assert isinstance(dt, torch.dtype)
    assert dt is getattr(torch, name)
    assert dtype_name(dt) == name
    assert torch.empty((), dtype=dt).element_size() == DTYPE_ITEMSIZE[name], "DTYPE_ITEMSIZE disagrees with torch"


@pytest.mark.parametrize("alias, name", [(torch.half, "float16"), (torch.float, "float32"), (torch.long, "int64"), (torch.cfloat, "complex64")])
def test_dtype_name_of_aliases_is_canonical(alias, name):
    assert dtype_name(alias) == name


@pytest.mark.parametrize("dt", [torch.qint8, torch.quint8, torch.qint32, torch.complex32])
def test_unsupported_dtypes(dt):
    with pytest.raises(InvalidTensorError, match="not supported"):
        dtype_name(dt)


@pytest.mark.parametrize("not_a_dtype", ["float32", "torch.float32", torch.float32.__class__, None])
def test_dtype_name_rejects_non_dtypes(not_a_dtype):
    with pytest.raises(InvalidTensorError):
        dtype_name(not_a_dtype)


@pytest.mark.parametrize("name", ["float", "half", "torch.float32", "qint8", "complex32", "", "Tensor", "nn"])
def test_torch_dtype_rejects_names_outside_the_table(name):
    with pytest.raises(InvalidTensorError, match=repr(name).replace("(", r"\(")):
        torch_dtype(name)


# -------------------------------------------------------------------------------- byte_view


def tensor_from_bytes(raw: bytes, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).reshape(shape) if raw else torch.empty(shape, dtype=dtype)


def random_bytes(n: int, name: str, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    if name == "bool":
        return rng.integers(0, 2, n, dtype=np.uint8).tobytes()  # only 0/1 are valid bools
    return rng.integers(0, 256, n, dtype=np.uint8).tobytes()


@st.composite
def views(draw):
    """(tensor view, numpy uint8 array of the same view with a trailing itemsize axis)."""
    name = draw(st.sampled_from(TORCH_DTYPE_NAMES))
    dt = getattr(torch, name)
    itemsize = DTYPE_ITEMSIZE[name]
    shape = tuple(draw(st.lists(st.integers(0, 5), min_size=0, max_size=4)))
    nelem = int(np.prod(shape)) if shape else 1
    raw = random_bytes(nelem * itemsize, name, draw(st.integers(0, 2**32 - 1)))
    t = tensor_from_bytes(raw, dt, shape)
    a = np.frombuffer(raw, dtype=np.uint8).reshape(shape + (itemsize,))
    for _ in range(draw(st.integers(0, 3))):
        if t.dim() == 0:
            break
        op = draw(st.sampled_from(["transpose", "slice", "select", "flip-free-step", "expand"]))
        d = draw(st.integers(0, t.dim() - 1))
        if op == "transpose" and t.dim() >= 2:
            e = draw(st.integers(0, t.dim() - 1))
            t = t.transpose(d, e)
            a = np.swapaxes(a, d, e)
        elif op == "slice":
            start = draw(st.integers(0, t.shape[d]))
            step = draw(st.integers(1, 3))
            idx = [slice(None)] * t.dim()
            idx[d] = slice(start, None, step)
            t = t[tuple(idx)]
            a = a[tuple(idx)]
        elif op == "select" and t.shape[d] > 0:
            i = draw(st.integers(0, t.shape[d] - 1))
            t = t.select(d, i)
            a = np.take(a, i, axis=d)
        elif op == "flip-free-step":
            t = t.movedim(d, -1)
            a = np.moveaxis(a, d, -2)
        elif op == "expand":
            t = t.unsqueeze(0).expand(2, *t.shape)
            a = np.broadcast_to(a[None], (2,) + a.shape)
    return t, a


@settings(max_examples=300, deadline=None)
@given(views())
def test_byte_view_is_c_order_bytes_of_any_view(case):
    t, a = case
    bv = byte_view(t)
    assert bv.dtype == torch.uint8 and bv.dim() == 1 and bv.device == t.device
    expected = np.ascontiguousarray(a).tobytes()
    assert bv.numel() == len(expected) == t.numel() * t.element_size()
    assert bv.numpy().tobytes() == expected
    # the same as the bytes of ``.contiguous()`` (copied into a fresh tensor: a 0/1-element
    # "contiguous" tensor may keep a stride != 1, which view(uint8) itself refuses)
    fresh = torch.empty(t.shape, dtype=t.dtype).copy_(t.contiguous())
    assert bv.numpy().tobytes() == fresh.reshape(-1).view(torch.uint8).numpy().tobytes()


def test_byte_view_of_transposed_matrix():
    t = torch.arange(6, dtype=torch.int16).reshape(2, 3).t()
    assert not t.is_contiguous()
    assert byte_view(t).numpy().tobytes() == np.array([[0, 3], [1, 4], [2, 5]], dtype="<i2").tobytes()


def test_byte_view_of_zero_dim_tensor():
    t = torch.tensor(1.5, dtype=torch.float32)
    bv = byte_view(t)
    assert bv.shape == (4,)
    assert bv.numpy().tobytes() == np.float32(1.5).tobytes()


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 4, 2)])
def test_byte_view_of_zero_size_tensor(shape):
    bv = byte_view(torch.empty(shape, dtype=torch.bfloat16))
    assert bv.dtype == torch.uint8 and bv.shape == (0,)


@pytest.mark.parametrize(
    "make, expected",
    [
        (lambda: torch.arange(10, dtype=torch.float32)[::5][:1], np.array([0.0], dtype="<f4")),
        (lambda: torch.arange(12, dtype=torch.int32).reshape(3, 4)[1:2, 2], np.array([6], dtype="<i4")),
        (lambda: torch.empty(0, dtype=torch.bfloat16)[::2], np.zeros(0, dtype=np.uint8)),
        (lambda: torch.empty(5, dtype=torch.float16)[4:4:3], np.zeros(0, dtype=np.uint8)),
    ],
    ids=["one-elem-stride5", "one-elem-column", "empty-step2", "empty-slice-step3"],
)
def test_byte_view_of_single_or_no_element_with_odd_stride(make, expected):
    t = make()
    assert t.is_contiguous() and t.reshape(-1).stride(0) != 1  # the awkward case
    bv = byte_view(t)
    assert bv.numpy().tobytes() == expected.tobytes()
    if t.numel():
        assert bv.data_ptr() == t.data_ptr()  # still zero-copy


def test_byte_view_of_contiguous_tensor_is_zero_copy():
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    bv = byte_view(t)
    assert bv.data_ptr() == t.data_ptr()
    bv[0] = 0xFF  # writes through: same memory
    assert t.view(torch.uint8)[0, 0] == 0xFF


def test_byte_view_of_offset_contiguous_slice():
    base = torch.arange(10, dtype=torch.int32)
    t = base[3:7]
    assert t.is_contiguous() and t.storage_offset() == 3
    assert byte_view(t).numpy().tobytes() == np.arange(3, 7, dtype="<i4").tobytes()


def test_byte_view_detaches_autograd():
    t = torch.ones(3, requires_grad=True)
    bv = byte_view(t * 2)
    assert not bv.requires_grad
    assert bv.numpy().tobytes() == np.full(3, 2.0, dtype="<f4").tobytes()


def test_byte_view_of_conjugate_view_stores_the_conjugated_values():
    x = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    c = x.conj()
    assert c.is_conj()
    assert byte_view(c).numpy().tobytes() == np.array([1 - 2j, 3 + 4j], dtype="<c8").tobytes()
    assert x[0].imag == 2  # the source is untouched


def test_byte_view_of_negative_view():
    x = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    neg = x.conj().imag  # a float view with the negative bit set (strided: .contiguous() resolves it)
    assert neg.is_neg()
    assert byte_view(neg).numpy().tobytes() == np.array([-2.0, 4.0], dtype="<f4").tobytes()


# ------------------------------------------------------------------------- meta / empty_for


def test_meta_for_describes_the_tensor():
    t = torch.zeros(5, 7, dtype=torch.bfloat16).t()
    m = meta_for("ns", "k", t)
    assert m == EntryMeta("ns", "k", "bfloat16", (7, 5), 70)
    assert all(type(d) is int for d in m.shape)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: np.zeros(3), "expected torch.Tensor, got ndarray"),
        (lambda: [1, 2], "expected torch.Tensor, got list"),
        (lambda: torch.zeros(2, 2).to_sparse(), "dense"),
        (lambda: torch.empty(3, device="meta"), "meta"),
        (lambda: torch.quantize_per_tensor(torch.zeros(2), 0.1, 0, torch.qint8), "quantized"),
        (lambda: torch.zeros(2, dtype=torch.complex32), "not supported"),
    ],
    ids=["ndarray", "list", "sparse", "meta", "quantized", "complex32"],
)
def test_meta_for_rejects_unstorable(make, match):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized / complex32 creation warns (deprecated, experimental)
        try:
            value = make()
        except (RuntimeError, AttributeError) as exc:  # pragma: no cover - removed from a future torch
            pytest.skip(f"this torch cannot build the case: {exc}")
    with pytest.raises(InvalidTensorError, match=match):
        meta_for("ns", "k", value, arg="encoder_output")


def test_meta_for_names_the_argument():
    with pytest.raises(InvalidTensorError, match="^encoder_output:"):
        meta_for("ns", "k", "nope", arg="encoder_output")


def test_empty_for_matches_meta():
    m = EntryMeta("ns", "k", "float16", (3, 4), 24)
    t = empty_for(m)
    assert t.shape == (3, 4) and t.dtype == torch.float16 and t.device.type == "cpu"


# ---------------------------------------------------------------------------------- devices


@pytest.mark.parametrize("value", [None, "cpu", torch.device("cpu")])
def test_parse_device_cpu(value):
    assert parse_device(value) == torch.device("cpu")


def test_parse_device_refuses_bare_cuda():
    with pytest.raises(InvalidDeviceError, match=r"^device: use an explicit 'cuda:<index>'"):
        parse_device("cuda")


@pytest.mark.parametrize("value", ["gpu", "cuda:x", "", "cuda:", "cuda:0:1", "cpu0", ["cpu"], 1.5])
def test_parse_device_garbage(value):
    with pytest.raises(InvalidDeviceError, match="^dev:"):
        parse_device(value, arg="dev")


@pytest.mark.parametrize("value", ["meta", "mps", "xpu:0"])
def test_parse_device_unsupported_types(value):
    with pytest.raises(InvalidDeviceError, match="not supported"):
        parse_device(value)


def test_parse_device_cuda_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(InvalidDeviceError, match="CUDA is not available"):
        parse_device("cuda:0")


@pytest.fixture
def two_gpus(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)


def test_parse_device_happy_path_with_two_devices(two_gpus):
    assert parse_device("cuda:1") == torch.device("cuda", 1)
    assert parse_device("cuda:0") == torch.device("cuda", 0)
    assert parse_device(torch.device("cuda", 1)) == torch.device("cuda:1")


def test_parse_device_index_out_of_range(two_gpus):
    with pytest.raises(InvalidDeviceError, match=r"^device: 'cuda:2' does not exist; this machine has 2 CUDA device"):
        parse_device("cuda:2")
    with pytest.raises(InvalidDeviceError, match="explicit"):
        parse_device("cuda")  # still refused with devices present


def test_invalid_device_error_is_a_value_error():
    assert issubclass(InvalidDeviceError, ValueError)
