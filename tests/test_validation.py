"""Argument validation: every bad input raises a clear error before any work.

Each check runs for numpy (host) arrays and for device-like arrays.  The
device-like arrays are :class:`FakeDeviceArray` objects that expose only
``__cuda_array_interface__`` with a made-up pointer: validation reads
metadata and must never dereference it, so no GPU is needed (except for the
one test that copies device ``key_lengths`` to the host).
"""

from __future__ import annotations

import ctypes
import itertools
import math
import re
import sys
from typing import Any, Dict, Optional, Sequence, Tuple

import ml_dtypes
import numpy as np
import pytest

import pycudaflash
from pycudaflash._arrays import as_operand, broadcast_operand
from pycudaflash._validate import validate_backward, validate_forward
from pycudaflash.semantics import band

B, H, NQ, NK, D = 2, 3, 5, 7, 4
Q_SHAPE = (B, H, NQ, D)
K_SHAPE = (B, H, NK, D)
LSE_SHAPE = (B, H, NQ)
MASK_SHAPE = (B, H, NQ, NK)

KINDS = ("host", "device")


# --------------------------------------------------------------------------
# device-like arrays
# --------------------------------------------------------------------------


def _c_strides(shape: Sequence[int]) -> Tuple[int, ...]:
    """Element strides of a C-contiguous array."""
    strides = []
    step = 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


class FakeDeviceArray:
    """An object that only exposes ``__cuda_array_interface__`` (version 3).

    The pointer is made up (and aligned unless ``offset`` says otherwise);
    nothing may ever read from it.
    """

    _next_ptr = itertools.count(0x7F00_0000_0000, 0x10_0000)

    def __init__(
        self,
        shape: Sequence[int],
        dtype: Any = np.float32,
        *,
        strides: Optional[Sequence[int]] = None,
        typestr: Optional[str] = None,
        offset: int = 0,
        read_only: bool = False,
        byte_strides: Optional[Sequence[int]] = None,
    ) -> None:
        itemsize = np.dtype(dtype).itemsize
        if byte_strides is None and strides is not None:
            byte_strides = tuple(s * itemsize for s in strides)
        self.ptr = next(self._next_ptr) + offset
        self.__cuda_array_interface__ = {
            "shape": tuple(shape),
            "typestr": typestr if typestr is not None else np.dtype(dtype).str,
            "data": (self.ptr, read_only),
            "strides": None if byte_strides is None else tuple(byte_strides),
            "version": 3,
        }


def make(kind: str, shape: Sequence[int], dtype: Any = np.float32, **kw: Any) -> Any:
    """A C-contiguous host array or a fake device array of ``shape``."""
    if kind == "host":
        rng = np.random.default_rng(0)
        return rng.standard_normal(tuple(shape)).astype(dtype)
    return FakeDeviceArray(shape, dtype, **kw)


def make_permuted(
    kind: str, base_shape: Sequence[int], perm: Sequence[int], dtype: Any = np.float32
) -> Any:
    """A view ``base.transpose(perm)`` of a contiguous ``base_shape`` array."""
    if kind == "host":
        return make("host", base_shape, dtype).transpose(perm)
    base = _c_strides(base_shape)
    return FakeDeviceArray(
        [base_shape[p] for p in perm], dtype, strides=[base[p] for p in perm]
    )


def make_last_dim_strided(kind: str, shape: Sequence[int]) -> Any:
    """An array whose last dimension has stride 2 elements."""
    if kind == "host":
        wide = tuple(shape[:-1]) + (2 * shape[-1],)
        return make("host", wide)[..., ::2]
    strides = list(_c_strides(tuple(shape[:-1]) + (2 * shape[-1],)))
    strides[-1] = 2
    return FakeDeviceArray(shape, strides=strides)


def make_reversed(kind: str, shape: Sequence[int], axis: int = 2) -> Any:
    """An array with a negative stride along ``axis``."""
    if kind == "host":
        index = [slice(None)] * len(shape)
        index[axis] = slice(None, None, -1)
        return make("host", shape)[tuple(index)]
    strides = list(_c_strides(shape))
    strides[axis] = -strides[axis]
    return FakeDeviceArray(shape, strides=strides)


def make_read_only(kind: str, shape: Sequence[int], dtype: Any = np.float32) -> Any:
    """A read-only array (numpy flag, or the interface's read-only flag)."""
    if kind == "host":
        arr = make("host", shape, dtype)
        arr.setflags(write=False)
        return arr
    return FakeDeviceArray(shape, dtype, read_only=True)


def other_kind(kind: str) -> str:
    """'device' for 'host' and vice versa."""
    return "device" if kind == "host" else "host"


# --------------------------------------------------------------------------
# argument sets
# --------------------------------------------------------------------------


def fwd_args(kind: str, **overrides: Any) -> Dict[str, Any]:
    """Valid forward arguments with some replaced."""
    args: Dict[str, Any] = dict(
        q=make(kind, Q_SHAPE), k=make(kind, K_SHAPE), v=make(kind, K_SHAPE),
    )
    args.update(overrides)
    return args


def bwd_args(kind: str, **overrides: Any) -> Dict[str, Any]:
    """Valid backward arguments with some replaced."""
    args: Dict[str, Any] = dict(
        dout=make(kind, Q_SHAPE), q=make(kind, Q_SHAPE), k=make(kind, K_SHAPE),
        v=make(kind, K_SHAPE), out=make(kind, Q_SHAPE), lse=make(kind, LSE_SHAPE),
    )
    args.update(overrides)
    return args


def run_fwd(args: Dict[str, Any]) -> Any:
    """validate_forward on an argument dict."""
    args = dict(args)
    return validate_forward(args.pop("q"), args.pop("k"), args.pop("v"), **args)


def run_bwd(args: Dict[str, Any]) -> Any:
    """validate_backward on an argument dict."""
    args = dict(args)
    pos = [args.pop(n) for n in ("dout", "q", "k", "v", "out", "lse")]
    return validate_backward(*pos, **args)


@pytest.fixture(params=KINDS)
def kind(request: pytest.FixtureRequest) -> str:
    """Run a test with host arrays and with device-like arrays."""
    return request.param


# --------------------------------------------------------------------------
# not an array at all
# --------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [[[1.0]], 3.0, object(), None])
def test_q_not_an_array(kind: str, bad: Any) -> None:
    expected = r"q must be a numpy\.ndarray or an object exposing __cuda_array_interface__"
    with pytest.raises(TypeError, match=expected):
        run_fwd(fwd_args(kind, q=bad))


@pytest.mark.parametrize("name", ["k", "v"])
def test_k_v_not_an_array(kind: str, name: str) -> None:
    with pytest.raises(TypeError, match=rf"{name} must be a numpy\.ndarray .* got list"):
        run_fwd(fwd_args(kind, **{name: [1.0, 2.0]}))


@pytest.mark.parametrize("name", ["dout", "out", "lse"])
def test_backward_required_inputs_missing(kind: str, name: str) -> None:
    with pytest.raises(TypeError, match=rf"{name} must be a numpy\.ndarray .* got NoneType"):
        run_bwd(bwd_args(kind, **{name: None}))


def test_torch_cpu_like_object_is_not_a_device_array() -> None:
    class RaisesOnAccess:
        @property
        def __cuda_array_interface__(self) -> Any:
            raise AttributeError("not a CUDA tensor")

    with pytest.raises(TypeError, match="q must be a numpy.ndarray .* got RaisesOnAccess"):
        run_fwd(fwd_args("host", q=RaisesOnAccess()))


# --------------------------------------------------------------------------
# dimensions and shapes
# --------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["q", "k", "v"])
@pytest.mark.parametrize("shape", [(B, H, D), (B, H, NQ, D, 1)])
def test_forward_ndim(kind: str, name: str, shape: Tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match=rf"{name} must have 4 dimensions"):
        run_fwd(fwd_args(kind, **{name: make(kind, shape)}))


@pytest.mark.parametrize("name", ["dout", "out", "dq", "dk", "dv"])
def test_backward_ndim(kind: str, name: str) -> None:
    with pytest.raises(ValueError, match=rf"{name} must have 4 dimensions"):
        run_bwd(bwd_args(kind, **{name: make(kind, (B * H, NQ, D))}))


@pytest.mark.parametrize("name", ["k", "v"])
@pytest.mark.parametrize("axis, label", [(0, "batch size B"), (3, "head dimension D")])
def test_qkv_dim_mismatch(kind: str, name: str, axis: int, label: str) -> None:
    shape = list(K_SHAPE)
    shape[axis] += 1
    expected = rf"{name} has {label} = {shape[axis]} but q has {K_SHAPE[axis]}"
    with pytest.raises(ValueError, match=expected):
        run_fwd(fwd_args(kind, **{name: make(kind, shape)}))


@pytest.mark.parametrize("name", ["k", "v"])
def test_kv_heads_must_divide_the_query_heads(kind: str, name: str) -> None:
    shape = (B, H + 1, NK, D)
    expected = re.escape(f"{name} has {H + 1} heads, which must divide the {H} heads of q")
    with pytest.raises(ValueError, match=expected):
        run_fwd(fwd_args(kind, **{name: make(kind, shape)}))


def test_k_and_v_heads_must_agree(kind: str) -> None:
    with pytest.raises(ValueError, match="k and v must have the same number of heads, got 1 and"):
        run_fwd(fwd_args(kind, k=make(kind, (B, 1, NK, D))))


def test_nk_mismatch(kind: str) -> None:
    expected = rf"k and v must have the same number of keys Nk, got {NK} and {NK + 1}"
    with pytest.raises(ValueError, match=expected):
        run_fwd(fwd_args(kind, v=make(kind, (B, H, NK + 1, D))))


@pytest.mark.parametrize("label", ["B", "H", "Nq", "Nk", "D"])
def test_zero_size(kind: str, label: str) -> None:
    sizes = dict(B=B, H=H, Nq=NQ, Nk=NK, D=D)
    sizes[label] = 0
    q = make(kind, (sizes["B"], sizes["H"], sizes["Nq"], sizes["D"]))
    k = make(kind, (sizes["B"], sizes["H"], sizes["Nk"], sizes["D"]))
    v = make(kind, (sizes["B"], sizes["H"], sizes["Nk"], sizes["D"]))
    with pytest.raises(ValueError, match=rf"{label} must be at least 1, got 0"):
        validate_forward(q, k, v)


def test_head_dim_too_large(kind: str) -> None:
    q = make(kind, (1, 1, 2, 257))
    k = make(kind, (1, 1, 3, 257))
    with pytest.raises(ValueError, match="head dimension D must be at most 256, got 257"):
        validate_forward(q, k, k)


def test_head_dim_256_is_fine(kind: str) -> None:
    q = make(kind, (1, 1, 2, 256))
    k = make(kind, (1, 1, 3, 256))
    assert validate_forward(q, k, k).D == 256


def test_forward_out_shape(kind: str) -> None:
    expected = re.escape(f"out must have shape (B, H, Nq, D) = {Q_SHAPE} like q")
    with pytest.raises(ValueError, match=expected):
        run_fwd(fwd_args(kind, out=make(kind, K_SHAPE)))


@pytest.mark.parametrize("name", ["dout", "out", "dq"])
def test_backward_q_like_shapes(kind: str, name: str) -> None:
    expected = re.escape(f"{name} must have shape (B, H, Nq, D) = {Q_SHAPE} like q")
    with pytest.raises(ValueError, match=expected):
        run_bwd(bwd_args(kind, **{name: make(kind, K_SHAPE)}))


@pytest.mark.parametrize("name", ["dk", "dv"])
def test_backward_k_like_shapes(kind: str, name: str) -> None:
    expected = re.escape(f"{name} must have shape (B, Hkv, Nk, D) = {K_SHAPE} like k")
    with pytest.raises(ValueError, match=expected):
        run_bwd(bwd_args(kind, **{name: make(kind, Q_SHAPE)}))


@pytest.mark.parametrize("shape", [(B, H, NK), (B, H, NQ, 1), (B * H * NQ,)])
def test_lse_shape(kind: str, shape: Tuple[int, ...]) -> None:
    expected = re.escape(f"lse must have shape (B, H, Nq) = {LSE_SHAPE}")
    with pytest.raises(ValueError, match=expected):
        run_fwd(fwd_args(kind, lse=make(kind, shape)))
    expected = re.escape(f"lse must have shape (B, H, Nq) = {LSE_SHAPE}")
    with pytest.raises(ValueError, match=expected):
        run_bwd(bwd_args(kind, lse=make(kind, shape)))


# --------------------------------------------------------------------------
# dtypes
# --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float64, np.int32, np.int16, np.complex64, np.bool_])
def test_unsupported_dtype(kind: str, dtype: Any) -> None:
    q, k = make(kind, Q_SHAPE, dtype), make(kind, K_SHAPE, dtype)
    args = fwd_args(kind, q=q, k=k, v=make(kind, K_SHAPE, dtype))
    name = np.dtype(dtype).name
    expected = (
        rf"q has dtype {name}, which is not supported; "
        r"supported dtypes: float32, float16, bfloat16"
    )
    with pytest.raises(TypeError, match=expected):
        run_fwd(args)


def test_non_native_byte_order_is_unsupported() -> None:
    q = make("host", Q_SHAPE).astype(">f4")
    with pytest.raises(TypeError, match="q has dtype >f4, which is not supported"):
        run_fwd(fwd_args("host", q=q))


@pytest.mark.parametrize("name", ["k", "v", "out"])
def test_forward_dtype_mismatch(kind: str, name: str) -> None:
    shape = K_SHAPE if name in ("k", "v") else Q_SHAPE
    with pytest.raises(TypeError, match=rf"{name} has dtype float64 but q has float32"):
        run_fwd(fwd_args(kind, **{name: make(kind, shape, np.float64)}))


@pytest.mark.parametrize("name", ["dout", "out", "dq", "dk", "dv"])
def test_backward_dtype_mismatch(kind: str, name: str) -> None:
    shape = K_SHAPE if name in ("dk", "dv") else Q_SHAPE
    with pytest.raises(TypeError, match=rf"{name} has dtype float16 but q has float32"):
        run_bwd(bwd_args(kind, **{name: make(kind, shape, np.float16)}))


@pytest.mark.parametrize("dtype", [np.float64, np.float16, np.int32])
def test_lse_dtype(kind: str, dtype: Any) -> None:
    match = rf"lse must have dtype float32, got {np.dtype(dtype).name}"
    with pytest.raises(TypeError, match=match):
        run_fwd(fwd_args(kind, lse=make(kind, LSE_SHAPE, dtype)))
    with pytest.raises(TypeError, match=match):
        run_bwd(bwd_args(kind, lse=make(kind, LSE_SHAPE, dtype)))


# --------------------------------------------------------------------------
# layouts and pointers
# --------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["q", "k", "v", "out", "lse"])
def test_forward_last_dim_not_contiguous(kind: str, name: str) -> None:
    shape = {"q": Q_SHAPE, "out": Q_SHAPE, "lse": LSE_SHAPE}.get(name, K_SHAPE)
    expected = rf"{name} must be contiguous in its last dimension \(stride 1\), got stride 2"
    with pytest.raises(ValueError, match=expected):
        run_fwd(fwd_args(kind, **{name: make_last_dim_strided(kind, shape)}))


@pytest.mark.parametrize("name", ["dout", "out", "lse", "dq", "dk", "dv"])
def test_backward_last_dim_not_contiguous(kind: str, name: str) -> None:
    shape = {"lse": LSE_SHAPE, "dk": K_SHAPE, "dv": K_SHAPE}.get(name, Q_SHAPE)
    with pytest.raises(ValueError, match=rf"{name} must be contiguous in its last dimension"):
        run_bwd(bwd_args(kind, **{name: make_last_dim_strided(kind, shape)}))


def test_head_dim_1_is_trivially_contiguous(kind: str) -> None:
    q = make_last_dim_strided(kind, (B, H, NQ, 1))
    k = make_last_dim_strided(kind, (B, H, NK, 1))
    prob = validate_forward(q, k, k)
    assert prob.D == 1
    assert prob.q.strides[-1] == 2


@pytest.mark.parametrize("name, axis", [("q", 2), ("k", 0), ("v", 3), ("out", 1)])
def test_forward_negative_strides(kind: str, name: str, axis: int) -> None:
    shape = Q_SHAPE if name in ("q", "out") else K_SHAPE
    expected = rf"{name} has a negative stride .* along dimension {axis}"
    with pytest.raises(ValueError, match=expected):
        run_fwd(fwd_args(kind, **{name: make_reversed(kind, shape, axis)}))


@pytest.mark.parametrize("name", ["dout", "lse", "dk"])
def test_backward_negative_strides(kind: str, name: str) -> None:
    shape = {"lse": LSE_SHAPE, "dk": K_SHAPE}.get(name, Q_SHAPE)
    with pytest.raises(ValueError, match=rf"{name} has a negative stride"):
        run_bwd(bwd_args(kind, **{name: make_reversed(kind, shape, 1)}))


def test_host_byte_stride_not_multiple_of_itemsize() -> None:
    buf = np.zeros(4096, dtype=np.uint8)
    q = np.ndarray(Q_SHAPE, dtype=np.float32, buffer=buf, strides=(440, 132, 22, 4))
    expected = "q has a byte stride of 22 along dimension 2 .* not a multiple of its item size 4"
    with pytest.raises(ValueError, match=expected):
        run_fwd(fwd_args("host", q=q))


def test_device_byte_stride_not_multiple_of_itemsize() -> None:
    k = FakeDeviceArray(K_SHAPE, byte_strides=(4 * 84, 4 * 28, 18, 4))
    expected = "k has a byte stride of 18 along dimension 2 .* not a multiple of its item size 4"
    with pytest.raises(ValueError, match=expected):
        run_fwd(fwd_args("device", k=k))


@pytest.mark.parametrize("name", ["q", "k", "v", "out", "lse"])
def test_forward_device_pointer_misaligned(name: str) -> None:
    shape = {"q": Q_SHAPE, "out": Q_SHAPE, "lse": LSE_SHAPE}.get(name, K_SHAPE)
    bad = FakeDeviceArray(shape, offset=2)
    expected = rf"{name} device pointer {bad.ptr:#x} is not aligned to its element size of 4 bytes"
    with pytest.raises(ValueError, match=expected):
        run_fwd(fwd_args("device", **{name: bad}))


@pytest.mark.parametrize("name", ["dout", "dq", "dk", "dv"])
def test_backward_device_pointer_misaligned(name: str) -> None:
    shape = K_SHAPE if name in ("dk", "dv") else Q_SHAPE
    bad = FakeDeviceArray(shape, offset=1)
    with pytest.raises(ValueError, match=rf"{name} device pointer {bad.ptr:#x} is not aligned"):
        run_bwd(bwd_args("device", **{name: bad}))


# --------------------------------------------------------------------------
# host/device mixing and output buffers
# --------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["k", "v", "out", "lse", "mask"])
def test_forward_mixed_kinds(kind: str, name: str) -> None:
    shape = {"q": Q_SHAPE, "out": Q_SHAPE, "lse": LSE_SHAPE, "mask": MASK_SHAPE}.get(name, K_SHAPE)
    wrong = make(other_kind(kind), shape)
    expected = rf"{name} is a .* but q is a .*; .* must all be numpy arrays or all device arrays"
    with pytest.raises(TypeError, match=expected):
        run_fwd(fwd_args(kind, **{name: wrong}))


@pytest.mark.parametrize("name", ["dout", "q", "out", "lse", "dq", "dk", "dv"])
def test_backward_mixed_kinds(kind: str, name: str) -> None:
    shape = {"lse": LSE_SHAPE, "dk": K_SHAPE, "dv": K_SHAPE}.get(name, Q_SHAPE)
    with pytest.raises(TypeError, match="must all be numpy arrays or all device arrays"):
        run_bwd(bwd_args(kind, **{name: make(other_kind(kind), shape)}))


@pytest.mark.parametrize("name", ["out", "lse"])
def test_forward_read_only_output(kind: str, name: str) -> None:
    shape = LSE_SHAPE if name == "lse" else Q_SHAPE
    with pytest.raises(ValueError, match=rf"output buffer {name} is read-only"):
        run_fwd(fwd_args(kind, **{name: make_read_only(kind, shape)}))


@pytest.mark.parametrize("name", ["dq", "dk", "dv"])
def test_backward_read_only_output(kind: str, name: str) -> None:
    shape = Q_SHAPE if name == "dq" else K_SHAPE
    with pytest.raises(ValueError, match=rf"output buffer {name} is read-only"):
        run_bwd(bwd_args(kind, **{name: make_read_only(kind, shape)}))


def test_backward_read_only_inputs_are_fine(kind: str) -> None:
    args = bwd_args(kind, **{n: make_read_only(kind, Q_SHAPE) for n in ("dout", "out")})
    args["lse"] = make_read_only(kind, LSE_SHAPE)
    assert run_bwd(args).out is not None


def test_output_with_zero_stride(kind: str) -> None:
    if kind == "host":
        out = np.zeros(Q_SHAPE, np.float32)
        out = np.lib.stride_tricks.as_strided(out, Q_SHAPE, (0,) + out.strides[1:])
    else:
        out = FakeDeviceArray(Q_SHAPE, strides=(0,) + _c_strides(Q_SHAPE)[1:])
    with pytest.raises(ValueError, match="output buffer out has stride 0 along dimension 0"):
        run_fwd(fwd_args(kind, out=out))


def test_outputs_may_be_strided(kind: str) -> None:
    out = make_permuted(kind, (B, NQ, H, D), (0, 2, 1, 3))
    lse = make_permuted(kind, (H, B, NQ), (1, 0, 2))
    prob = run_fwd(fwd_args(kind, out=out, lse=lse))
    assert prob.out.strides == (NQ * H * D, D, H * D, 1)
    assert prob.lse.strides == (NQ, B * NQ, 1)


# --------------------------------------------------------------------------
# options
# --------------------------------------------------------------------------


@pytest.mark.parametrize("causal", ["yes", "top-left", 1, 0.0])
def test_unknown_causal(kind: str, causal: Any) -> None:
    expected = "causal must be False, True, 'top_left' or 'bottom_right'"
    with pytest.raises(ValueError, match=expected):
        run_fwd(fwd_args(kind, causal=causal))
    with pytest.raises(ValueError, match="causal must be"):
        run_bwd(bwd_args(kind, causal=causal))


@pytest.mark.parametrize("window", [3, (1, 2, 3), "ab", (1.5, 2)])
def test_window_not_a_pair_of_ints(kind: str, window: Any) -> None:
    with pytest.raises(TypeError, match="window"):
        run_fwd(fwd_args(kind, window=window))


def test_window_side_below_minus_one(kind: str) -> None:
    expected = r"window left must be >= 0 \(or -1/None for unbounded\), got -2"
    with pytest.raises(ValueError, match=expected):
        run_fwd(fwd_args(kind, window=(-2, 0)))
    with pytest.raises(ValueError, match="window right must be >= 0"):
        run_bwd(bwd_args(kind, window=(None, -5)))


@pytest.mark.parametrize("scale", ["0.5", b"1", 1j, [0.5], True])
def test_scale_not_real(kind: str, scale: Any) -> None:
    with pytest.raises(TypeError, match="scale must be a real number"):
        run_fwd(fwd_args(kind, scale=scale))


@pytest.mark.parametrize("scale", [math.inf, -math.inf, math.nan])
def test_scale_not_finite(kind: str, scale: float) -> None:
    with pytest.raises(ValueError, match="scale must be finite"):
        run_fwd(fwd_args(kind, scale=scale))
    with pytest.raises(ValueError, match="scale must be finite"):
        run_bwd(bwd_args(kind, scale=scale))


@pytest.mark.parametrize("deterministic", [1, 0, "yes", None])
def test_deterministic_not_bool(kind: str, deterministic: Any) -> None:
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        run_bwd(bwd_args(kind, deterministic=deterministic))


# --------------------------------------------------------------------------
# mask
# --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.int32, np.uint8, np.float64, np.float16])
def test_mask_dtype(kind: str, dtype: Any) -> None:
    name = np.dtype(dtype).name
    with pytest.raises(TypeError, match=rf"mask must have dtype bool, float32, got {name}"):
        run_fwd(fwd_args(kind, mask=make(kind, MASK_SHAPE, dtype)))
    with pytest.raises(TypeError, match="mask must have dtype"):
        run_bwd(bwd_args(kind, mask=make(kind, MASK_SHAPE, dtype)))


@pytest.mark.parametrize(
    "shape", [(NQ, NK + 1), (B, H, NQ, NK, 1), (3 * B, 1, 1, 1), (NK, NQ), (H, NQ, 2)]
)
def test_mask_not_broadcastable(kind: str, shape: Tuple[int, ...]) -> None:
    expected = f"mask of shape {shape} is not broadcastable to (B, H, Nq, Nk) = {MASK_SHAPE}"
    with pytest.raises(ValueError, match=re.escape(expected)):
        run_fwd(fwd_args(kind, mask=make(kind, shape, np.bool_)))


def test_mask_negative_stride(kind: str) -> None:
    if kind == "host":
        mask = np.ones(MASK_SHAPE, np.bool_)[:, :, ::-1, :]
    else:
        strides = list(_c_strides(MASK_SHAPE))
        strides[2] = -strides[2]
        mask = FakeDeviceArray(MASK_SHAPE, np.bool_, strides=strides)
    with pytest.raises(ValueError, match="mask has a negative stride"):
        run_fwd(fwd_args(kind, mask=mask))


def test_device_mask_misaligned() -> None:
    mask = FakeDeviceArray((NQ, NK), np.float32, offset=2)
    with pytest.raises(ValueError, match=rf"mask device pointer {mask.ptr:#x} is not aligned"):
        run_fwd(fwd_args("device", mask=mask))


def test_device_bool_mask_any_address_is_aligned() -> None:
    mask = FakeDeviceArray((NQ, NK), np.bool_, offset=3)
    assert run_fwd(fwd_args("device", mask=mask)).mask_kind == "bool"


@pytest.mark.parametrize(
    "shape, zero_axes",
    [
        ((NQ, NK), (0, 1)),
        ((1, H, 1, NK), (0, 2)),
        ((B, 1, NQ, NK), (1,)),
        ((NK,), (0, 1, 2)),
        (MASK_SHAPE, ()),
    ],
)
@pytest.mark.parametrize("dtype, mask_kind", [(np.bool_, "bool"), (np.float32, "float")])
def test_mask_broadcast(
    kind: str, shape: Tuple[int, ...], zero_axes: Tuple[int, ...], dtype: Any, mask_kind: str
) -> None:
    mask = make(kind, shape, dtype)
    for run, args in ((run_fwd, fwd_args(kind, mask=mask)), (run_bwd, bwd_args(kind, mask=mask))):
        prob = run(args)
        assert prob.mask_kind == mask_kind
        assert prob.mask.shape == MASK_SHAPE
        assert prob.mask.dtype == np.dtype(dtype)
        assert prob.mask.obj is mask
        for axis in range(4):
            assert (prob.mask.strides[axis] == 0) == (axis in zero_axes)
        if kind == "host":
            assert prob.mask.array.shape == MASK_SHAPE
            assert np.shares_memory(prob.mask.array, mask)
            np.testing.assert_array_equal(prob.mask.array, np.broadcast_to(mask, MASK_SHAPE))
            itemsize = np.dtype(dtype).itemsize
            assert tuple(s // itemsize for s in prob.mask.array.strides) == prob.mask.strides
        else:
            assert prob.mask.ptr == mask.ptr
            assert prob.mask.array is None


def test_no_mask(kind: str) -> None:
    prob = run_fwd(fwd_args(kind))
    assert prob.mask is None and prob.mask_kind == "none"


# --------------------------------------------------------------------------
# key_lengths
# --------------------------------------------------------------------------


@pytest.mark.parametrize("lengths", [[3], [1, 2, 3], np.array([[1, 2]]), np.int32(3), []])
def test_key_lengths_shape(kind: str, lengths: Any) -> None:
    with pytest.raises((ValueError, TypeError), match=r"key_lengths must"):
        run_fwd(fwd_args(kind, key_lengths=lengths))


@pytest.mark.parametrize("lengths", [[3], [1, 2, 3], np.array([[1, 2]]), []])
def test_key_lengths_shape_value_error(kind: str, lengths: Any) -> None:
    with pytest.raises(ValueError, match=re.escape(f"key_lengths must have shape (B,) = ({B},)")):
        run_fwd(fwd_args(kind, key_lengths=lengths))


@pytest.mark.parametrize("lengths", [5, 2.0, "12", {1, 2}])
def test_key_lengths_wrong_type(kind: str, lengths: Any) -> None:
    expected = "key_lengths must be a list, tuple, numpy array or device array of integers"
    with pytest.raises(TypeError, match=expected):
        run_fwd(fwd_args(kind, key_lengths=lengths))


@pytest.mark.parametrize(
    "lengths", [[1.0, 2.0], np.array([1.5, 2.0]), [True, False], np.array([1, 2], np.float32)]
)
def test_key_lengths_not_integer(kind: str, lengths: Any) -> None:
    with pytest.raises(TypeError, match="key_lengths must have an integer dtype"):
        run_fwd(fwd_args(kind, key_lengths=lengths))


@pytest.mark.parametrize(
    "lengths, b, value",
    [([3, NK + 1], 1, NK + 1), ([-1, 2], 0, -1), (np.array([0, 100], np.uint8), 1, 100)],
)
def test_key_lengths_out_of_range(kind: str, lengths: Any, b: int, value: int) -> None:
    expected = re.escape(
        f"key_lengths values must lie in [0, Nk] = [0, {NK}], got key_lengths[{b}] = {value}"
    )
    with pytest.raises(ValueError, match=expected):
        run_fwd(fwd_args(kind, key_lengths=lengths))
    with pytest.raises(ValueError, match=re.escape("key_lengths values must lie in [0, Nk]")):
        run_bwd(bwd_args(kind, key_lengths=lengths))


@pytest.mark.parametrize(
    "lengths",
    [[0, NK], (NK, 3), np.array([2, 5], np.int64), np.array([2, 9, 5, 7], np.uint16)[::2]],
)
def test_key_lengths_valid(kind: str, lengths: Any) -> None:
    prob = run_fwd(fwd_args(kind, key_lengths=lengths))
    assert prob.key_lengths.dtype == np.int32
    assert prob.key_lengths.shape == (B,)
    assert prob.key_lengths.flags.c_contiguous
    np.testing.assert_array_equal(prob.key_lengths, np.asarray(lengths))


def test_device_key_lengths_shape_checked_without_copy() -> None:
    lengths = FakeDeviceArray((B + 1,), np.int32)
    expected = re.escape(f"key_lengths must have shape (B,) = ({B},), got ({B + 1},)")
    with pytest.raises(ValueError, match=expected):
        run_fwd(fwd_args("device", key_lengths=lengths))


def test_device_key_lengths_dtype_checked_without_copy() -> None:
    lengths = FakeDeviceArray((B,), np.float32)
    with pytest.raises(TypeError, match="key_lengths must have an integer dtype, got float32"):
        run_fwd(fwd_args("device", key_lengths=lengths))


def test_device_key_lengths_misaligned() -> None:
    lengths = FakeDeviceArray((B,), np.int32, offset=2)
    expected = rf"key_lengths device pointer {lengths.ptr:#x} is not aligned"
    with pytest.raises(ValueError, match=expected):
        run_fwd(fwd_args("device", key_lengths=lengths))


def test_host_key_lengths_with_device_inputs() -> None:
    prob = run_fwd(fwd_args("device", key_lengths=np.array([1, 2])))
    np.testing.assert_array_equal(prob.key_lengths, [1, 2])


@pytest.mark.skipif(
    not pycudaflash.cuda_status()[0],
    reason="copying device key_lengths to the host needs PyCUDA and a CUDA GPU: "
    + pycudaflash.cuda_status()[1],
)
def test_device_key_lengths_copied_and_checked(kind: str) -> None:
    import pycuda.gpuarray as gpuarray

    from pycudaflash import cuda_backend

    cuda_backend.activate()  # the library's primary context, as every other CUDA test

    good = gpuarray.to_gpu(np.array([NK, 2], np.int32))
    prob = run_fwd(fwd_args(kind, key_lengths=good))
    np.testing.assert_array_equal(prob.key_lengths, [NK, 2])
    bad = gpuarray.to_gpu(np.array([1, NK + 3], np.int64))
    with pytest.raises(ValueError, match=re.escape(f"got key_lengths[1] = {NK + 3}")):
        run_fwd(fwd_args(kind, key_lengths=bad))


# --------------------------------------------------------------------------
# the array adapter
# --------------------------------------------------------------------------


@pytest.mark.parametrize("typestr", ["<V2", "|V4", "<V8"])
def test_void_typestr(typestr: str) -> None:
    itemsize = np.dtype(typestr).itemsize
    q = FakeDeviceArray(Q_SHAPE, np.float32, typestr=typestr)
    hint = "pass dtype='bfloat16'" if itemsize == 2 else "pass dtype= to name it"
    with pytest.raises(
        TypeError,
        match=rf"the {itemsize}-byte type cannot be identified from __cuda_array_interface__.*"
        rf"no __dlpack__ that would identify it; {hint}",
    ):
        run_fwd(fwd_args("device", q=q))


def test_bfloat16_typestr_via_public_api() -> None:
    q = FakeDeviceArray(Q_SHAPE, typestr="<V2")
    with pytest.raises(TypeError, match="the 2-byte type cannot be identified"):
        pycudaflash.flash_attn_forward(q, make("device", K_SHAPE), make("device", K_SHAPE))


def test_unknown_typestr() -> None:
    q = FakeDeviceArray(Q_SHAPE, typestr="<zz")
    with pytest.raises(TypeError, match="q has element type '<zz'"):
        run_fwd(fwd_args("device", q=q))


def test_host_operand() -> None:
    arr = make("host", Q_SHAPE)
    op = as_operand(arr, "q")
    assert op.kind == "host" and not op.on_device
    assert op.array is arr and op.obj is arr and op.ptr == 0
    assert op.shape == Q_SHAPE and op.strides == _c_strides(Q_SHAPE)
    assert op.dtype == np.float32


def test_device_operand_contiguous_default_strides() -> None:
    arr = FakeDeviceArray(Q_SHAPE)
    op = as_operand(arr, "q")
    assert op.kind == "device" and op.on_device
    assert op.ptr == arr.ptr and op.array is None and op.obj is arr
    assert op.shape == Q_SHAPE and op.strides == _c_strides(Q_SHAPE)


def test_zero_size_operand_is_allowed() -> None:
    for arr in (np.zeros((0, 3)), FakeDeviceArray((0, 3), np.float64)):
        op = as_operand(arr, "x")
        assert op.shape == (0, 3)


def test_broadcast_operand_rejects_too_many_dims() -> None:
    op = as_operand(np.zeros((1, 1, 1, 1, 1), np.bool_), "mask")
    with pytest.raises(ValueError, match="mask of shape .* is not broadcastable"):
        broadcast_operand(op, MASK_SHAPE)


def test_masked_device_array_rejected() -> None:
    q = FakeDeviceArray(Q_SHAPE)
    q.__cuda_array_interface__["mask"] = object()
    with pytest.raises(TypeError, match="q is a masked device array"):
        run_fwd(fwd_args("device", q=q))


# --------------------------------------------------------------------------
# valid problems
# --------------------------------------------------------------------------


def test_transposed_layout_is_used_without_copy(kind: str) -> None:
    # (B, N, H, D) storage viewed as (B, H, N, D).
    q = make_permuted(kind, (B, NQ, H, D), (0, 2, 1, 3))
    k = make_permuted(kind, (B, NK, H, D), (0, 2, 1, 3))
    v = make_permuted(kind, (B, NK, H, D), (0, 2, 1, 3))
    prob = validate_forward(q, k, v)
    assert prob.q.shape == Q_SHAPE and prob.k.shape == K_SHAPE
    assert prob.q.strides == (NQ * H * D, D, H * D, 1)
    assert prob.k.strides == (NK * H * D, D, H * D, 1)
    assert prob.q.obj is q and prob.k.obj is k and prob.v.obj is v
    if kind == "host":
        assert prob.q.array is q and not q.flags.c_contiguous
    else:
        assert prob.q.ptr == q.ptr


def test_broadcast_inputs_are_accepted(kind: str) -> None:
    # k and v shared across heads (stride 0), as with grouped-query attention.
    if kind == "host":
        k = np.broadcast_to(make("host", (B, 1, NK, D)), K_SHAPE)
    else:
        strides = list(_c_strides((B, 1, NK, D)))
        strides[1] = 0
        k = FakeDeviceArray(K_SHAPE, strides=strides)
    prob = run_fwd(fwd_args(kind, k=k, v=k))
    assert prob.k.strides[1] == 0


def test_forward_problem_fields(kind: str) -> None:
    out, lse = make(kind, Q_SHAPE), make(kind, LSE_SHAPE)
    args = fwd_args(
        kind, causal="bottom_right", window=(2, None), scale=0.25, out=out, lse=lse,
        key_lengths=[4, 7],
    )
    prob = run_fwd(args)
    assert (prob.B, prob.H, prob.Nq, prob.Nk, prob.D) == (B, H, NQ, NK, D)
    assert prob.dtype == np.float32
    assert prob.scale == 0.25
    assert prob.causal == "bottom_right"
    assert (prob.window_left, prob.window_right) == (2, -1)
    assert prob.band == band(NQ, NK, "bottom_right", 2, -1)
    assert prob.on_device == (kind == "device")
    assert prob.out.obj is out and prob.lse.obj is lse
    assert prob.dout is None and prob.dq is None and prob.dk is None and prob.dv is None
    assert prob.deterministic is False
    np.testing.assert_array_equal(prob.key_lengths, [4, 7])


def test_forward_defaults(kind: str) -> None:
    prob = run_fwd(fwd_args(kind, causal=True))
    assert prob.scale == pytest.approx(1 / math.sqrt(D))
    assert prob.causal == "top_left"
    assert (prob.window_left, prob.window_right) == (-1, -1)
    assert prob.out is None and prob.lse is None and prob.key_lengths is None


def test_backward_problem_fields(kind: str) -> None:
    dq, dk, dv = make(kind, Q_SHAPE), make(kind, K_SHAPE), make(kind, K_SHAPE)
    args = bwd_args(kind, deterministic=True, dq=dq, dk=dk, dv=dv, causal=False, window=[3, 1])
    prob = run_bwd(args)
    assert prob.dout.obj is args["dout"]
    assert prob.out.obj is args["out"] and prob.lse.obj is args["lse"]
    assert prob.dq.obj is dq and prob.dk.obj is dk and prob.dv.obj is dv
    assert prob.deterministic is True
    assert prob.causal == "none"
    assert prob.band == band(NQ, NK, "none", 3, 1)


def test_backward_outputs_optional(kind: str) -> None:
    prob = run_bwd(bwd_args(kind, deterministic=np.bool_(False)))
    assert prob.dq is None and prob.dk is None and prob.dv is None
    assert prob.deterministic is False


# --------------------------------------------------------------------------
# the public API raises the same errors
# --------------------------------------------------------------------------

API_FORWARD_CASES = [
    (lambda kind: dict(q=[1.0]), TypeError, "q must be a numpy.ndarray"),
    (lambda kind: dict(k=make(kind, (B, H, D))), ValueError, "k must have 4 dimensions"),
    (
        lambda kind: dict(v=make(kind, (B, H, NK + 1, D))),
        ValueError, "k and v must have the same number of keys",
    ),
    (
        lambda kind: dict(q=make(kind, Q_SHAPE, np.float64)),
        TypeError, "q has dtype float64, which is not supported",
    ),
    (
        lambda kind: dict(k=make(kind, K_SHAPE, np.float64)),
        TypeError, "k has dtype float64 but q has float32",
    ),
    (
        lambda kind: dict(q=make_last_dim_strided(kind, Q_SHAPE)),
        ValueError, "q must be contiguous in its last dimension",
    ),
    (
        lambda kind: dict(k=make(other_kind(kind), K_SHAPE)),
        TypeError, "must all be numpy arrays or all device arrays",
    ),
    (
        lambda kind: dict(out=make_read_only(kind, Q_SHAPE)),
        ValueError, "output buffer out is read-only",
    ),
    (
        lambda kind: dict(lse=make(kind, LSE_SHAPE, np.float64)),
        TypeError, "lse must have dtype float32",
    ),
    (lambda kind: dict(causal="both"), ValueError, "causal must be"),
    (lambda kind: dict(window=5), TypeError, "window must be None or a pair"),
    (lambda kind: dict(scale=math.nan), ValueError, "scale must be finite"),
    (lambda kind: dict(mask=make(kind, (NQ, 2), np.bool_)), ValueError, "is not broadcastable"),
    (lambda kind: dict(mask=make(kind, MASK_SHAPE, np.int64)), TypeError, "mask must have dtype"),
    (lambda kind: dict(key_lengths=[NK + 1, 0]), ValueError, "key_lengths values must lie in"),
]


@pytest.mark.parametrize("case", range(len(API_FORWARD_CASES)))
def test_public_forward_raises_validation_errors(kind: str, case: int) -> None:
    overrides, exc, match = API_FORWARD_CASES[case]
    args = fwd_args(kind, **overrides(kind))
    with pytest.raises(exc, match=re.escape(match)):
        run_fwd(args)
    q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
    with pytest.raises(exc, match=re.escape(match)):
        pycudaflash.flash_attn_forward(q, k, v, **args)


API_BACKWARD_CASES = [
    (lambda kind: dict(dout=make(kind, K_SHAPE)), ValueError, "dout must have shape (B, H, Nq, D)"),
    (lambda kind: dict(lse=make(kind, (B, H))), ValueError, "lse must have shape (B, H, Nq)"),
    (
        lambda kind: dict(dk=make(kind, K_SHAPE, np.float16)),
        TypeError, "dk has dtype float16 but q has float32",
    ),
    (
        lambda kind: dict(dv=make_read_only(kind, K_SHAPE)),
        ValueError, "output buffer dv is read-only",
    ),
    (
        lambda kind: dict(dq=make(other_kind(kind), Q_SHAPE)),
        TypeError, "must all be numpy arrays or all device arrays",
    ),
    (lambda kind: dict(deterministic="no"), TypeError, "deterministic must be a bool"),
    (lambda kind: dict(window=(0, -3)), ValueError, "window right must be >= 0"),
    (
        lambda kind: dict(key_lengths=[1.0, 2.0]),
        TypeError, "key_lengths must have an integer dtype",
    ),
]


@pytest.mark.parametrize("case", range(len(API_BACKWARD_CASES)))
def test_public_backward_raises_validation_errors(kind: str, case: int) -> None:
    overrides, exc, match = API_BACKWARD_CASES[case]
    args = bwd_args(kind, **overrides(kind))
    with pytest.raises(exc, match=re.escape(match)):
        run_bwd(args)
    pos = [args.pop(n) for n in ("dout", "q", "k", "v", "out", "lse")]
    with pytest.raises(exc, match=re.escape(match)):
        pycudaflash.flash_attn_backward(*pos, **args)


class _GradTensor:
    """Stands for a tensor that requires grad: it refuses to export itself,
    but its detached view exposes the same memory."""

    def __init__(self, inner):
        self._inner = inner

    @property
    def __cuda_array_interface__(self):
        raise RuntimeError("Can't export tensors that require gradient, use tensor.detach()")

    def detach(self):
        return self._inner


def test_tensor_requiring_grad_is_read_through_its_detached_view():
    from pycudaflash._arrays import as_operand

    inner = FakeDeviceArray((2, 3, 5, 8), np.float32)
    op = as_operand(_GradTensor(inner), "q")
    assert op.kind == "device" and op.ptr == inner.__cuda_array_interface__["data"][0]
    assert isinstance(op.obj, _GradTensor)


class _TorchStandIn:
    """Just enough of a torch module for the tensor fast path of ``as_operand``."""

    class Tensor:
        """A CUDA tensor whose array interface may not be read."""

        def __init__(self, shape, dtype, strides, ptr, is_cuda=True, layout="strided"):
            self.shape, self.dtype, self._strides, self._ptr = shape, dtype, strides, ptr
            self.is_cuda, self.layout = is_cuda, layout

        def stride(self):
            return self._strides

        def data_ptr(self):
            return self._ptr

        @property
        def __cuda_array_interface__(self):
            raise RuntimeError("the fast path must not build the array interface")

    strided = "strided"
    float32, float16, bfloat16, bool, int32 = "f32", "f16", "bf16", "b1", "i32"
    complex64 = "c64"


def test_torch_tensors_are_read_through_their_accessors(monkeypatch: pytest.MonkeyPatch) -> None:
    from pycudaflash._arrays import as_operand

    torch = _TorchStandIn()
    monkeypatch.setitem(sys.modules, "torch", torch)
    t = torch.Tensor((2, 3, 5, 8), "bf16", (120, 8, 24, 1), 0x1000)
    op = as_operand(t, "q")
    assert (op.kind, op.shape, op.strides, op.ptr, op.obj) == ("device", (2, 3, 5, 8), (120, 8, 24, 1), 0x1000, t)
    assert op.dtype == np.dtype(ml_dtypes.bfloat16) and not op.read_only
    assert as_operand(torch.Tensor((4,), "b1", (1,), 0x2000), "mask").dtype == np.bool_
    # Not on the GPU, not strided, or a dtype outside the table: the generic
    # path decides (here the stand-in has no usable array interface, so it
    # rejects them; the good tensor above got through only by the fast path).
    for bad in (torch.Tensor((4,), "f32", (1,), 0, is_cuda=False), torch.Tensor((4,), "f32", (1,), 0, layout="coo"),
                torch.Tensor((4,), "c64", (1,), 0x3000)):
        with pytest.raises(TypeError, match="must be a numpy.ndarray or an object exposing"):
            as_operand(bad, "q")


# --------------------------------------------------------------------------
# float16 and bfloat16
# --------------------------------------------------------------------------

BF16 = np.dtype(ml_dtypes.bfloat16)
HALF_DTYPES = (np.dtype(np.float16), BF16)
HALF_IDS = ("float16", "bfloat16")


def _dtype_kw(kind: str, dtype: np.dtype) -> Dict[str, Any]:
    """``dtype=`` for fake bfloat16 device arrays, whose typestr is the opaque '<V2'."""
    return {"dtype": "bfloat16"} if kind == "device" and dtype == BF16 else {}


def half_fwd_args(kind: str, elem: np.dtype, **overrides: Any) -> Dict[str, Any]:
    """Valid forward arguments in the 2-byte dtype ``elem``."""
    args: Dict[str, Any] = dict(
        q=make(kind, Q_SHAPE, elem), k=make(kind, K_SHAPE, elem), v=make(kind, K_SHAPE, elem),
        **_dtype_kw(kind, elem),
    )
    args.update(overrides)
    return args


def half_bwd_args(kind: str, elem: np.dtype, **overrides: Any) -> Dict[str, Any]:
    """Valid backward arguments in the 2-byte dtype ``elem`` (lse float32)."""
    args: Dict[str, Any] = dict(
        dout=make(kind, Q_SHAPE, elem), q=make(kind, Q_SHAPE, elem),
        k=make(kind, K_SHAPE, elem), v=make(kind, K_SHAPE, elem),
        out=make(kind, Q_SHAPE, elem), lse=make(kind, LSE_SHAPE),
        **_dtype_kw(kind, elem),
    )
    args.update(overrides)
    return args


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=HALF_IDS)
def test_half_dtypes_accepted(kind: str, dtype: np.dtype) -> None:
    outs = dict(out=make(kind, Q_SHAPE, dtype), lse=make(kind, LSE_SHAPE))
    prob = run_fwd(half_fwd_args(kind, dtype, **outs))
    assert prob.dtype == dtype
    assert prob.q.dtype == prob.out.dtype == dtype and prob.lse.dtype == np.float32
    grads = dict(dq=make(kind, Q_SHAPE, dtype), dk=make(kind, K_SHAPE, dtype),
                 dv=make(kind, K_SHAPE, dtype))
    prob = run_bwd(half_bwd_args(kind, dtype, **grads))
    assert prob.dtype == dtype
    assert all(getattr(prob, n).dtype == dtype for n in ("dout", "out", "dq", "dk", "dv"))


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=HALF_IDS)
@pytest.mark.parametrize("name", ["k", "v", "out"])
def test_half_mixed_with_float32(kind: str, dtype: np.dtype, name: str) -> None:
    shape = K_SHAPE if name in ("k", "v") else Q_SHAPE
    label = HALF_IDS[HALF_DTYPES.index(dtype)]
    with pytest.raises(TypeError, match=rf"{name} has dtype float32 but q has {label}"):
        run_fwd(half_fwd_args("host", dtype, **{name: make("host", shape)}))
    with pytest.raises(TypeError, match=rf"{name} has dtype {label} but q has float32"):
        run_fwd(fwd_args("host", **{name: make("host", shape, dtype)}))


@pytest.mark.parametrize("name", ["dout", "dq", "dk", "dv"])
def test_half_backward_mixed(kind: str, name: str) -> None:
    shape = K_SHAPE if name in ("dk", "dv") else Q_SHAPE
    args = half_bwd_args(kind, np.dtype(np.float16), **{name: make(kind, shape, np.float32)})
    with pytest.raises(TypeError, match=rf"{name} has dtype float32 but q has float16"):
        run_bwd(args)


def test_float16_and_bfloat16_do_not_mix() -> None:
    args = half_fwd_args("host", np.dtype(np.float16), v=make("host", K_SHAPE, BF16))
    with pytest.raises(TypeError, match="v has dtype bfloat16 but q has float16"):
        run_fwd(args)


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=HALF_IDS)
def test_half_lse_must_be_float32(kind: str, dtype: np.dtype) -> None:
    label = HALF_IDS[HALF_DTYPES.index(dtype)]
    lse = make(kind, LSE_SHAPE, dtype)
    with pytest.raises(TypeError, match=rf"lse must have dtype float32, got {label}"):
        run_fwd(half_fwd_args(kind, dtype, lse=lse))
    with pytest.raises(TypeError, match=rf"lse must have dtype float32, got {label}"):
        run_bwd(half_bwd_args(kind, dtype, lse=lse))


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=HALF_IDS)
@pytest.mark.parametrize("mask_dtype, mask_kind", [(np.bool_, "bool"), (np.float32, "float")])
def test_half_inputs_bool_or_float32_mask(
    kind: str, dtype: np.dtype, mask_dtype: Any, mask_kind: str
) -> None:
    prob = run_fwd(half_fwd_args(kind, dtype, mask=make(kind, (NQ, NK), mask_dtype)))
    assert prob.mask_kind == mask_kind and prob.mask.dtype == np.dtype(mask_dtype)


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=HALF_IDS)
def test_half_inputs_mask_in_input_dtype(kind: str, dtype: np.dtype) -> None:
    prob = run_fwd(half_fwd_args(kind, dtype, mask=make(kind, (NQ, NK), dtype)))
    assert prob.mask_kind == "float" and prob.mask.dtype == dtype


def test_half_inputs_mask_of_the_other_half_dtype(kind: str) -> None:
    f16 = np.dtype(np.float16)
    with pytest.raises(TypeError, match="mask must have dtype bool, float32, float16, got bfloat16"):
        # A device bfloat16 mask identifies itself through __dlpack__.
        mask = make(kind, (NQ, NK), BF16) if kind == "host" else bf16_dlpack((NQ, NK))
        run_fwd(half_fwd_args(kind, f16, mask=mask))
    with pytest.raises(TypeError, match="mask must have dtype bool, float32, bfloat16, got float16"):
        run_fwd(half_fwd_args(kind, BF16, mask=make(kind, (NQ, NK), f16)))
    with pytest.raises(TypeError, match="mask must have dtype bool, float32, float16, got float64"):
        run_fwd(half_fwd_args(kind, f16, mask=make(kind, (NQ, NK), np.float64)))


@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=HALF_IDS)
@pytest.mark.parametrize("name", ["q", "k", "out", "dq", "dv"])
def test_half_device_pointer_alignment_is_two_bytes(dtype: np.dtype, name: str) -> None:
    shape = K_SHAPE if name in ("k", "v", "dk", "dv") else Q_SHAPE
    # Offset 2 is aligned for a 2-byte type ...
    ok = FakeDeviceArray(shape, dtype, offset=2)
    assert run_bwd(half_bwd_args("device", dtype, **{name: ok})).dtype == dtype
    # ... offset 1 is not.
    bad = FakeDeviceArray(shape, dtype, offset=1)
    expected = rf"{name} device pointer {bad.ptr:#x} is not aligned to its element size of 2 bytes"
    with pytest.raises(ValueError, match=expected):
        run_bwd(half_bwd_args("device", dtype, **{name: bad}))


def test_half_byte_stride_must_be_even() -> None:
    k = FakeDeviceArray(K_SHAPE, np.float16, byte_strides=(2 * 84, 2 * 28, 7, 2))
    with pytest.raises(ValueError, match="k has a byte stride of 7 .* not a multiple of its item size 2"):
        run_fwd(half_fwd_args("device", np.dtype(np.float16), k=k))


def test_half_transposed_layout_strides_in_elements(kind: str) -> None:
    q = make_permuted(kind, (B, NQ, H, D), (0, 2, 1, 3), BF16)
    k = make_permuted(kind, (B, NK, H, D), (0, 2, 1, 3), BF16)
    prob = validate_forward(q, k, k, **_dtype_kw(kind, BF16))
    assert prob.q.strides == (NQ * H * D, D, H * D, 1)
    assert prob.dtype == BF16


# --------------------------------------------------------------------------
# opaque '<V2' element types: __dlpack__ or an explicit dtype
# --------------------------------------------------------------------------


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p),
                ("deleter", ctypes.c_void_p)]


class _DLManagedTensorVersioned(ctypes.Structure):
    _fields_ = [("major", ctypes.c_uint32), ("minor", ctypes.c_uint32),
                ("manager_ctx", ctypes.c_void_p), ("deleter", ctypes.c_void_p),
                ("flags", ctypes.c_uint64), ("dl_tensor", _DLTensor)]


_PyCapsule_New = ctypes.PYFUNCTYPE(
    ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p
)(("PyCapsule_New", ctypes.pythonapi))


class HandBuiltCapsule:
    """A DLPack capsule around a DLManagedTensor built here (no destructor).

    numpy cannot export bfloat16 through DLPack, so the bfloat16 case needs
    its own struct.  The struct, shape array and capsule name are kept alive
    with this object.
    """

    def __init__(self, shape: Sequence[int], code: int, bits: int, lanes: int = 1,
                 *, versioned: bool = False, device_type: int = 2, ptr: int = 0x7E00_0000_0000) -> None:
        self.shape = (ctypes.c_int64 * len(shape))(*shape)
        tensor = _DLTensor(
            data=ptr, device=_DLDevice(device_type, 0), ndim=len(shape),
            dtype=_DLDataType(code, bits, lanes), shape=self.shape, strides=None, byte_offset=0,
        )
        if versioned:
            self.struct: Any = _DLManagedTensorVersioned(major=1, minor=0, flags=0, dl_tensor=tensor)
            self.name = b"dltensor_versioned"
        else:
            self.struct = _DLManagedTensor(dl_tensor=tensor)
            self.name = b"dltensor"
        self.capsule = _PyCapsule_New(ctypes.addressof(self.struct), self.name, None)


class FakeDlpackArray(FakeDeviceArray):
    """A fake device array whose typestr is '<V2' and that has ``__dlpack__``.

    ``capsule()`` makes the capsule that ``__dlpack__`` returns; the keyword
    arguments of each call are recorded in ``calls``.
    """

    def __init__(self, shape: Sequence[int], capsule: Any, **kw: Any) -> None:
        super().__init__(shape, np.float16, typestr="<V2", **kw)
        self._capsule = capsule
        self.calls: list = []

    def __dlpack__(self, **kwargs: Any) -> Any:
        self.calls.append(kwargs)
        return self._capsule()

    def __dlpack_device__(self) -> Tuple[int, int]:
        return (2, 0)


def bf16_dlpack(shape: Sequence[int], **kw: Any) -> FakeDlpackArray:
    """A '<V2' fake whose DLPack capsule says bfloat16 (kDLBfloat, 16 bits)."""
    built: list = []

    def capsule() -> Any:
        built.append(HandBuiltCapsule(shape, code=4, bits=16))
        return built[-1].capsule

    arr = FakeDlpackArray(shape, capsule, **kw)
    arr.built = built
    return arr


def numpy_dlpack(shape: Sequence[int], dtype: Any) -> FakeDlpackArray:
    """A '<V2' fake whose capsule is numpy's own export of a host array of ``dtype``."""
    host = np.zeros(shape, dtype)
    return FakeDlpackArray(shape, lambda: host.__dlpack__())


def test_dlpack_capsule_parser_on_numpy_capsules() -> None:
    from pycudaflash._arrays import _capsule_type

    assert _capsule_type(np.zeros(3, np.float16).__dlpack__()) == (2, 16, 1)
    assert _capsule_type(np.zeros(3, np.uint16).__dlpack__()) == (1, 16, 1)
    assert _capsule_type(np.zeros(3, np.float32).__dlpack__()) == (2, 32, 1)
    assert _capsule_type(np.zeros(3, np.int8).__dlpack__()) == (0, 8, 1)


@pytest.mark.parametrize("versioned", [False, True], ids=["legacy", "versioned"])
def test_dlpack_capsule_parser_on_hand_built_capsules(versioned: bool) -> None:
    from pycudaflash._arrays import _capsule_type

    built = HandBuiltCapsule((2, 3), code=4, bits=16, versioned=versioned)
    assert _capsule_type(built.capsule) == (4, 16, 1)
    built = HandBuiltCapsule((2, 3), code=2, bits=16, lanes=2, versioned=versioned)
    assert _capsule_type(built.capsule) == (2, 16, 2)


def test_dlpack_capsule_parser_rejects_other_objects() -> None:
    from pycudaflash._arrays import _capsule_type

    target = ctypes.c_int64(0)
    wrong_name = _PyCapsule_New(ctypes.addressof(target), b"something_else", None)
    for bad in (wrong_name, object(), b"dltensor"):
        with pytest.raises(TypeError, match="not an unconsumed DLPack capsule"):
            _capsule_type(bad)


def test_bfloat16_recognised_through_dlpack(kind: str) -> None:
    q, k, v = bf16_dlpack(Q_SHAPE), bf16_dlpack(K_SHAPE), bf16_dlpack(K_SHAPE)
    prob = validate_forward(q, k, v)
    assert prob.dtype == BF16 and prob.q.dtype == BF16
    assert prob.q.ptr == q.ptr
    # The producer was asked not to synchronise any stream.
    assert q.calls == [{"stream": -1}]


def test_bfloat16_dlpack_backward_with_float32_lse() -> None:
    args = dict(
        dout=bf16_dlpack(Q_SHAPE), q=bf16_dlpack(Q_SHAPE), k=bf16_dlpack(K_SHAPE),
        v=bf16_dlpack(K_SHAPE), out=bf16_dlpack(Q_SHAPE), lse=make("device", LSE_SHAPE),
        dq=bf16_dlpack(Q_SHAPE), dk=bf16_dlpack(K_SHAPE), dv=bf16_dlpack(K_SHAPE),
    )
    prob = run_bwd(args)
    assert prob.dtype == BF16 and prob.dq.dtype == BF16 and prob.lse.dtype == np.float32


def test_float16_recognised_through_numpy_dlpack() -> None:
    q, k = numpy_dlpack(Q_SHAPE, np.float16), numpy_dlpack(K_SHAPE, np.float16)
    prob = validate_forward(q, k, k)
    assert prob.dtype == np.float16


def test_dlpack_capsule_is_released_not_consumed() -> None:
    import gc
    import weakref

    host = np.zeros(Q_SHAPE, np.float16)
    alive = weakref.ref(host)
    q = FakeDlpackArray(Q_SHAPE, host.__dlpack__)
    del host
    assert validate_forward(q, q, q).dtype == np.float16
    del q
    gc.collect()
    # numpy's capsule destructor frees the export only if the capsule was not
    # consumed (renamed); otherwise the array would stay alive.
    assert alive() is None


@pytest.mark.parametrize(
    "dtype, text", [(np.uint16, "uint16"), (np.int16, "int16")]
)
def test_dlpack_other_2_byte_types_rejected(dtype: Any, text: str) -> None:
    q = numpy_dlpack(Q_SHAPE, dtype)
    with pytest.raises(TypeError, match=rf"q has element type {text} according to __dlpack__"):
        validate_forward(q, make("device", K_SHAPE, np.float16), make("device", K_SHAPE, np.float16))


def test_dlpack_vector_lanes_rejected() -> None:
    keep = []

    def capsule() -> Any:
        keep.append(HandBuiltCapsule(Q_SHAPE, 2, 16, lanes=2))
        return keep[-1].capsule

    q = FakeDlpackArray(Q_SHAPE, capsule)
    with pytest.raises(TypeError, match="q has element type float16 x 2 lanes according to __dlpack__"):
        validate_forward(q, q, q)


def test_dlpack_size_disagreeing_with_typestr() -> None:
    host = np.zeros(Q_SHAPE, np.float32)
    q = FakeDlpackArray(Q_SHAPE, lambda: host.__dlpack__())
    with pytest.raises(TypeError, match=r"'<V2' .* but __dlpack__ reports float32 \(4 bytes\)"):
        validate_forward(q, q, q)


def test_failing_dlpack_is_a_type_error() -> None:
    def boom() -> Any:
        raise BufferError("cannot export")

    q = FakeDlpackArray(Q_SHAPE, boom)
    with pytest.raises(TypeError, match=r"q has an opaque .* __dlpack__ failed \(BufferError"):
        validate_forward(q, q, q)


@pytest.mark.parametrize(
    "spelling", ["bfloat16", "torch.bfloat16", BF16, ml_dtypes.bfloat16],
    ids=["name", "torch-name", "dtype", "scalar-type"],
)
def test_explicit_dtype_names_opaque_inputs(spelling: Any) -> None:
    q = FakeDeviceArray(Q_SHAPE, BF16)
    k = FakeDeviceArray(K_SHAPE, BF16)
    assert q.__cuda_array_interface__["typestr"] == "<V2"
    prob = validate_forward(q, k, k, dtype=spelling, out=FakeDeviceArray(Q_SHAPE, BF16))
    assert prob.dtype == BF16 and prob.out.dtype == BF16


def test_explicit_float16_names_opaque_inputs() -> None:
    q = FakeDeviceArray(Q_SHAPE, typestr="<V2")
    k = FakeDeviceArray(K_SHAPE, typestr="<V2")
    assert validate_forward(q, k, k, dtype=np.float16).dtype == np.float16


def test_explicit_dtype_with_typed_inputs(kind: str) -> None:
    # Typed inputs need no dtype=, but may carry one that agrees.
    for dtype, name in ((np.dtype(np.float32), "float32"), (np.dtype(np.float16), "float16"),
                        (BF16, "bfloat16")):
        args = fwd_args(kind, q=make(kind, Q_SHAPE, dtype), k=make(kind, K_SHAPE, dtype),
                        v=make(kind, K_SHAPE, dtype), dtype=name)
        if kind == "host" or dtype != BF16:
            assert run_fwd(args).dtype == dtype


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_explicit_dtype_conflicts_with_typed_input(kind: str, dtype: str) -> None:
    args = half_fwd_args(kind, np.dtype(np.float16), dtype=dtype)
    with pytest.raises(TypeError, match=rf"q has dtype float16 but dtype='{dtype}' was given"):
        run_fwd(args)


def test_explicit_dtype_conflicts_with_dlpack() -> None:
    q = numpy_dlpack(Q_SHAPE, np.float16)
    with pytest.raises(TypeError, match="q has dtype float16 but dtype='bfloat16' was given"):
        validate_forward(q, q, q, dtype="bfloat16")
    q = bf16_dlpack(Q_SHAPE)
    with pytest.raises(TypeError, match="q has dtype bfloat16 but dtype='float16' was given"):
        validate_forward(q, q, q, dtype="float16")


def test_explicit_dtype_conflicts_with_one_output() -> None:
    q = FakeDeviceArray(Q_SHAPE, BF16)
    k = FakeDeviceArray(K_SHAPE, BF16)
    out = FakeDeviceArray(Q_SHAPE, np.float16)
    with pytest.raises(TypeError, match="out has dtype float16 but dtype='bfloat16' was given"):
        validate_forward(q, k, k, out=out, dtype="bfloat16")


def test_explicit_dtype_of_other_size_cannot_name_v2() -> None:
    q = FakeDeviceArray(Q_SHAPE, BF16)
    with pytest.raises(TypeError, match=r"opaque 2-byte element type '<V2' .* dtype='float32'"):
        validate_forward(q, q, q, dtype="float32")


@pytest.mark.parametrize("bad", ["float64", "int16", "half-ish", np.float64, 3, object()])
def test_explicit_dtype_unsupported(kind: str, bad: Any) -> None:
    with pytest.raises(TypeError, match="dtype must be None or one of 'float32', 'float16', 'bfloat16'"):
        run_fwd(fwd_args(kind, dtype=bad))


def test_opaque_inputs_need_dlpack_or_dtype_in_backward() -> None:
    args = half_bwd_args("device", BF16)
    del args["dtype"]
    with pytest.raises(TypeError, match=r"dout has the opaque element type '<V2'.*pass dtype='bfloat16'"):
        run_bwd(args)


def test_opaque_mask_is_named_by_dtype_too() -> None:
    prob = run_fwd(half_fwd_args("device", BF16, mask=FakeDeviceArray((NQ, NK), BF16)))
    assert prob.mask.dtype == BF16 and prob.mask_kind == "float"


def test_opaque_tensor_requiring_grad_uses_dlpack_of_detached_view() -> None:
    q = _GradTensor(bf16_dlpack(Q_SHAPE))
    k = _GradTensor(bf16_dlpack(K_SHAPE))
    prob = validate_forward(q, k, k)
    assert prob.dtype == BF16 and prob.q.obj is q


def test_output_buffer_requiring_grad_is_not_read_only() -> None:
    out = _GradTensor(FakeDeviceArray(Q_SHAPE))
    assert run_fwd(fwd_args("device", out=out)).out.obj is out


API_DTYPE_CASES = [
    (lambda: dict(q=FakeDeviceArray(Q_SHAPE, BF16), k=FakeDeviceArray(K_SHAPE, BF16),
                  v=FakeDeviceArray(K_SHAPE, BF16)), "pass dtype='bfloat16'"),
    (lambda: dict(q=numpy_dlpack(Q_SHAPE, np.float16), k=numpy_dlpack(K_SHAPE, np.float16),
                  v=numpy_dlpack(K_SHAPE, np.float16), dtype="bfloat16"),
     "q has dtype float16 but dtype='bfloat16' was given"),
    (lambda: dict(q=make("host", Q_SHAPE, np.float16), k=make("host", K_SHAPE, np.float16),
                  v=make("host", K_SHAPE, np.float16), dtype="bfloat16"),
     "q has dtype float16 but dtype='bfloat16' was given"),
    (lambda: dict(q=make("host", Q_SHAPE, np.float16), k=make("host", K_SHAPE),
                  v=make("host", K_SHAPE, np.float16)), "k has dtype float32 but q has float16"),
    (lambda: dict(q=numpy_dlpack(Q_SHAPE, np.uint16), k=make("device", K_SHAPE, np.float16),
                  v=make("device", K_SHAPE, np.float16)), "element type uint16 according to __dlpack__"),
    (lambda: dict(q=make("host", Q_SHAPE), k=make("host", K_SHAPE), v=make("host", K_SHAPE),
                  dtype="float64"), "dtype must be None or one of"),
]


@pytest.mark.parametrize("case", range(len(API_DTYPE_CASES)))
def test_public_api_dtype_errors_before_any_launch(case: int, monkeypatch: pytest.MonkeyPatch) -> None:
    from pycudaflash import api

    def no_launch(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a backend was chosen although validation should have failed")

    monkeypatch.setattr(api, "choose_backend", no_launch)
    make_args, match = API_DTYPE_CASES[case]
    args = make_args()
    with pytest.raises(TypeError, match=re.escape(match)):
        pycudaflash.flash_attn_forward(**args)
    q, k, v = args["q"], args["k"], args["v"]
    bwd = dict(out=q, lse=make("host" if isinstance(q, np.ndarray) else "device", LSE_SHAPE))
    extra = {"dtype": args["dtype"]} if "dtype" in args else {}
    with pytest.raises(TypeError, match=re.escape(match)):
        pycudaflash.flash_attn_backward(q, q, k, v, bwd["out"], bwd["lse"], **extra)


class TypedOpaqueArray(FakeDeviceArray):
    """A '<V2' fake that, like a PyCUDA GPUArray, carries its numpy ``dtype``."""

    def __init__(self, shape: Sequence[int], dtype: Any) -> None:
        super().__init__(shape, np.float16, typestr="<V2")
        self.dtype = np.dtype(dtype)


def test_own_numpy_dtype_names_opaque_inputs() -> None:
    # The bfloat16 GPUArrays this library returns go back into it as they are.
    q, k = TypedOpaqueArray(Q_SHAPE, BF16), TypedOpaqueArray(K_SHAPE, BF16)
    prob = validate_forward(q, k, k, out=TypedOpaqueArray(Q_SHAPE, BF16))
    assert prob.dtype == BF16 and prob.out.dtype == BF16
    q16 = TypedOpaqueArray(Q_SHAPE, np.float16)
    assert validate_forward(q16, q16, q16).dtype == np.float16
    with pytest.raises(TypeError, match="q has dtype bfloat16 but dtype='float16' was given"):
        validate_forward(q, k, k, dtype="float16")


@pytest.mark.parametrize("own", [np.float32, np.dtype("<V2")], ids=["other-size", "opaque"])
def test_own_dtype_that_cannot_name_opaque_type(own: Any) -> None:
    q = TypedOpaqueArray(Q_SHAPE, own)
    with pytest.raises(TypeError, match="the 2-byte type cannot be identified"):
        validate_forward(q, q, q)


def test_cuda_grid_limits() -> None:
    """Sizes the CUDA kernels cannot index raise ValueError (checked before any launch)."""
    from types import SimpleNamespace

    from pycudaflash import cuda_backend

    cuda_backend._check_grid(SimpleNamespace(B=16, H=16, Nq=1024))
    with pytest.raises(ValueError, match="B and H"):
        cuda_backend._check_grid(SimpleNamespace(B=1, H=cuda_backend.MAX_GRID_YZ + 1, Nq=1))
    with pytest.raises(ValueError, match="ceil"):  # int32 job numbers of the persistent forward
        cuda_backend._check_grid(SimpleNamespace(B=65535, H=65535, Nq=1 << 20))


def test_persistent_job_groups() -> None:
    """The persistent forward's job groups: one head where every query tile
    sees every key, else a power of two dividing B * H whose heads' K and V
    fit the group's L2 share."""
    from types import SimpleNamespace

    from pycudaflash import cuda_backend
    from pycudaflash.semantics import band

    def shift(B, H, N, D, causal, fixed=0, itemsize=2, Nk=None):
        Nk = Nk or N
        prob = SimpleNamespace(B=B, H=H, Nq=N, Nk=Nk, D=D, band=band(N, Nk, causal, -1, -1))
        return cuda_backend._job_group_shift(prob, fixed, itemsize)

    budget = cuda_backend._JOB_GROUP_BYTES
    assert shift(16, 16, 1024, 128, "none") == 0
    for B, H, N, D in [(16, 16, 1024, 128), (4, 16, 4096, 128), (1, 16, 16384, 128), (16, 32, 1024, 64),
                       (6, 10, 777, 100)]:
        s = shift(B, H, N, D, "top_left")
        heads = 1 << s
        assert (B * H) % heads == 0, (B, H, N, D, s)
        assert heads * 2 * N * D * 2 <= budget or heads == 1, (B, H, N, D, s)
        # the largest such power of two
        assert (B * H) % (2 * heads) or 2 * heads * 2 * N * D * 2 > budget, (B, H, N, D, s)
    assert shift(16, 16, 1024, 128, "top_left") == 5
    assert shift(3, 5, 1024, 128, "top_left") == 0  # B * H odd
    assert shift(1, 1, 1 << 16, 128, "bottom_right") == 0  # one head's K, V exceed the share
    assert shift(16, 16, 1024, 128, "top_left", fixed=1) == 0
    assert shift(16, 16, 1024, 128, "none", fixed=4) == 2
    assert shift(2, 3, 1024, 128, "top_left", fixed=8) == 1  # (at most what divides B * H)
