"""Pieces of the launch path that need no GPU: stream handles, packed kernel
parameters, the fast path's overlap test and per-call key lengths."""

from __future__ import annotations

import ctypes
import struct
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from pycudaflash import _calls, _driver, _validate, compiler
from pycudaflash._arrays import byte_span
from pycudaflash._streams import stream_handle
from pycudaflash.cuda_backend import _bits, _Kernel, _Pointers, _Ref


class _Proto:
    def __cuda_stream__(self):
        return (0, 0xBEEF)


@pytest.mark.parametrize("stream, handle", [
    (0, 0), (7, 7), (SimpleNamespace(cuda_stream=11), 11), (SimpleNamespace(ptr=12), 12),
    (SimpleNamespace(handle=13), 13), (_Proto(), 0xBEEF),
])
def test_stream_handles(stream, handle) -> None:
    assert stream_handle(stream) == handle


@pytest.mark.parametrize("stream", [True, "default", 1.5, SimpleNamespace(handle="x"), object()])
def test_bad_streams_raise_type_error(stream) -> None:
    with pytest.raises(TypeError, match="stream must be"):
        stream_handle(stream)


def test_negative_stream_handle_raises() -> None:
    with pytest.raises(ValueError, match=">= 0"):
        stream_handle(-1)


def test_parameter_bits() -> None:
    assert _bits("f", 1.5) == struct.unpack("<I", struct.pack("<f", 1.5))[0]
    assert _bits("i", -1) == 0xFFFFFFFF
    assert _bits("q", -2) == 2**64 - 2
    assert _bits("P", 0x7F0000001000) == 0x7F0000001000


class _FakeLaunch:
    """Stands for libcuda's cuLaunchKernel: records the integer value of every argument."""

    def __init__(self) -> None:
        self.calls: list = []
        self.restype = None

    def __call__(self, *args: Any) -> int:
        self.calls.append(tuple(None if a is None else a.value for a in args))
        return 0


def test_kernel_packs_fixed_parameters_and_references(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeLaunch()
    monkeypatch.setattr(_driver, "_libcuda_raw", lambda name: fake)
    ptrs = _Pointers(3)
    k = _Kernel("k", 0x1234, (3, 2, 1), 128, 4096, "PiqfPP", (_Ref(2, 64), -3, 1 << 40, 0.25, 0, _Ref(1)), ptrs)
    assert k.fn == 0x1234 and k.grid == (3, 2, 1) and k.block == (128, 1, 1) and k.smem == 4096
    assert list(k.slots) == [0, 0xFFFFFFFD, 1 << 40, _bits("f", 0.25), 0, 0]
    assert k.refs == ((0, 2, 64), (5, 1, 0))
    # Fixed parameters point at the kernel's slots, 8 bytes apart; references into the pointer
    # table: a value slot itself (offset 0) or a slot after the values for value + offset.
    base, table = ctypes.addressof(k.slots), ctypes.addressof(ptrs.array)
    assert [k.addrs[i] for i in range(1, 5)] == [base + 8 * i for i in range(1, 5)]
    assert k.addrs[5] == table + 8 * 1 and k.addrs[0] == table + 8 * 3
    assert ptrs.derived == ((3, 2, 64),)
    # A second kernel taking the same value + offset shares its slot.
    k2 = _Kernel("k2", 0x99, (1, 1, 1), 32, 0, "P", (_Ref(2, 64),), ptrs)
    assert k2.addrs[0] == k.addrs[0] and ptrs.derived == ((3, 2, 64),)
    # A call writes the values and the derived pointers; the launch passes the argument array.
    ptrs.fill([0, 0x7F0000001000, 0x7F0000002000])
    assert ptrs.array[0:4] == [0, 0x7F0000001000, 0x7F0000002000, 0x7F0000002040]
    k.launch(0x5000)
    assert fake.calls == [(0x1234, 3, 2, 1, 128, 1, 1, 4096, 0x5000, k.addr, None)]
    ptrs.fill([0, 0, 0x100])
    k.launch(0)  # the default stream: a null handle
    assert ptrs.array[3] == 0x140 and fake.calls[-1][8] is None
    with pytest.raises(ValueError, match="format"):
        _Kernel("k", 1, (1, 1, 1), 32, 0, "i", (_Ref(0),), ptrs)
    with pytest.raises(ValueError, match="value slot 3 of 3"):
        _Kernel("k", 1, (1, 1, 1), 32, 0, "P", (_Ref(3),), ptrs)
    with pytest.raises(ValueError, match="format"):
        _Kernel("k", 1, (1, 1, 1), 32, 0, "ii", (1,), ptrs)


def test_outputs_disjoint_by_address_range() -> None:
    ptrs = [1000, 2000, 0, 3000]
    spans = [500, 500, 0, 100]
    assert _calls.outputs_disjoint(ptrs, spans, (3,))
    assert not _calls.outputs_disjoint([1000, 2000, 0, 1400], spans, (3,))  # starts inside the first
    assert not _calls.outputs_disjoint([1000, 2000, 0, 900], [500, 500, 0, 200], (3,))  # ends inside it
    assert _calls.outputs_disjoint([1000, 2000, 0, 1500], spans, (3,))  # touches, no overlap
    assert _calls.outputs_disjoint([1000, 2000, 0, 1200], [500, 500, 0, 0], (3,))  # empty output


def test_byte_span() -> None:
    assert byte_span((2, 3), (3, 1), 4) == 24
    assert byte_span((2, 3), (8, 1), 2) == 2 * (1 + 8 + 2)
    assert byte_span((2, 0, 3), (0, 3, 1), 4) == 0
    assert byte_span((4, 1), (0, 1), 4) == 4  # broadcast rows share one element


def test_host_key_lengths_checked_per_call() -> None:
    assert _validate.host_key_lengths([3, 0], 2, 5).tolist() == [3, 0]
    assert _validate.host_key_lengths(np.array([5, 1], np.int64), 2, 5).dtype == np.int32
    with pytest.raises(ValueError, match=r"key_lengths values must lie in \[0, Nk\] = \[0, 5\]"):
        _validate.host_key_lengths([6, 0], 2, 5)
    with pytest.raises(ValueError, match=r"shape \(B,\) = \(2,\)"):
        _validate.host_key_lengths([1, 2, 3], 2, 5)
    with pytest.raises(TypeError, match="integer dtype"):
        _validate.host_key_lengths(np.array([1.0, 2.0]), 2, 5)


def test_default_streams_are_never_captured_and_the_driver_is_not_asked() -> None:
    from pycudaflash import _driver

    for handle in _driver.DEFAULT_STREAMS:
        assert _driver.is_capturing(handle) is False


class _FakeVariant:
    """A variant of pass ``pass_`` whose kernels need no GPU: handles 0, formats read from the source."""

    def __init__(self, pass_: str, defs: dict) -> None:
        self.pass_, self.defs = pass_, defs
        self.tiles = compiler.tiles(defs["HEAD_DIM"], "float16", "sm_80")

    def function(self, kernel: str) -> int:
        return 0

    def smem(self, kernel: str) -> int:
        return 0

    def format(self, kernel: str) -> str:
        return compiler.parameter_format(self.pass_, kernel)

    def backward_block(self) -> tuple:
        return self.tiles.bwd_bc, 32 * compiler.BWD_WARPS


@pytest.mark.parametrize("hkv", [4, 2])
def test_backward_plan_of_grouped_heads(monkeypatch: pytest.MonkeyPatch, hkv: int) -> None:
    """With fewer K/V heads the dK/dV kernel writes per query head into the workspace (contiguous
    (B, H, Nk, D)) and a last kernel sums each group into dk, dv; without, it writes dk, dv itself."""
    from pycudaflash import cuda_backend

    fake = _FakeVariant("bwd_f16", compiler.defines("bwd_f16", 64, "none", "float16", "sm_80", groups=hkv < 4))
    monkeypatch.setattr(cuda_backend, "_variant", lambda prob, kind: fake)
    monkeypatch.setattr(_driver, "_libcuda_raw", lambda name: _FakeLaunch())
    B, H, Nq, Nk, D = 2, 4, 33, 70, 64
    x = {n: np.ones(s, np.float16) for n, s in (("q", (B, H, Nq, D)), ("k", (B, hkv, Nk, D)),
                                                 ("v", (B, hkv, Nk, D)), ("dout", (B, H, Nq, D)),
                                                 ("out", (B, H, Nq, D)))}
    prob = _validate.validate_backward(x["dout"], x["q"], x["k"], x["v"], x["out"], np.zeros((B, H, Nq), np.float32))
    names = cuda_backend.OPERANDS["bwd"][:-1]
    shapes = dict(zip((names[i] for i in cuda_backend.BackwardPlan.OUTPUTS), cuda_backend._output_shapes(prob, "bwd")))
    assert shapes["dk"] == shapes["dv"] == (B, hkv, Nk, D)
    plan = cuda_backend.BackwardPlan(prob, cuda_backend._plan_strides(prob, names, shapes), True)
    kernels = {k.name: k for k in plan.kernels}
    dkdv = kernels["flash_bwd_dkdv_kernel"]
    P = cuda_backend.BackwardPlan
    refs = {i: (src, off) for i, src, off in dkdv.refs}
    dk_strides = [dkdv.slots[i] for i in range(26, 29)]  # dk_sb, dk_sh, dk_sn (after Nq, Nk, D and q, k, v, dout strides)
    assert dkdv.slots[len(dkdv.slots) - 1] == H // hkv  # kv_group, the last parameter
    assert dkdv.slots[len(dkdv.slots) - 2] == 1  # vec: 16-byte loads and paired stores (D 64, aligned rows)
    if hkv == H:
        assert refs[7] == (P.DK, 0) and refs[8] == (P.DV, 0) and "flash_bwd_sum_groups" not in kernels
        assert dk_strides == [hkv * Nk * D, Nk * D, D]
        return
    # Per-query-head dK, dV in the workspace, contiguous (B, H, Nk, D), then summed into dk, dv.
    assert refs[7][0] == refs[8][0] == P.WS and refs[8][1] - refs[7][1] >= 2 * B * H * Nk * D
    assert dk_strides == [H * Nk * D, Nk * D, D]
    sums = kernels["flash_bwd_sum_groups"]
    assert plan.kernels[-1] is sums and sums.grid[1] == 2
    srefs = {i: (src, off) for i, src, off in sums.refs}
    assert srefs == {0: refs[7], 1: refs[8], 2: (P.DK, 0), 3: (P.DV, 0)}
    assert sums.addrs[0] == dkdv.addrs[7] and sums.addrs[1] == dkdv.addrs[8]  # (one pointer slot each)
    assert list(sums.slots)[4:9] == [hkv, H // hkv, Nk, D, B * hkv * Nk * D]
    assert list(sums.slots)[9:15] == [hkv * Nk * D, Nk * D, D] * 2
    assert plan.ws_bytes >= 2 * 2 * B * H * Nk * D
