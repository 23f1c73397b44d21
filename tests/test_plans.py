"""Pieces of the launch path that need no GPU: stream handles, packed kernel
parameters, the fast path's overlap test and per-call key lengths."""

from __future__ import annotations

import ctypes
import struct
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from pycudaflash import _calls, _driver, _validate
from pycudaflash._arrays import byte_span
from pycudaflash._streams import stream_handle
from pycudaflash.cuda_backend import _bits, _Kernel, _Ref


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
    k = _Kernel("k", 0x1234, (3, 2, 1), 128, 4096, "PiqfP", (_Ref(2, 64), -3, 1 << 40, 0.25, 0))
    assert k.fn == 0x1234 and k.grid == (3, 2, 1) and k.block == (128, 1, 1) and k.smem == 4096
    assert list(k.slots) == [0, 0xFFFFFFFD, 1 << 40, _bits("f", 0.25), 0]
    assert k.refs == ((0, 2, 64),)
    # The argument-pointer array points at the slots, 8 bytes apart.
    base = ctypes.addressof(k.slots)
    assert [k.addrs[i] for i in range(5)] == [base + 8 * i for i in range(5)]
    # A launch writes the referenced pointer (value 2 plus offset 64) and passes the rest as packed.
    k.launch([0, 0, 0x7F0000002000], 0x5000)
    assert k.slots[0] == 0x7F0000002040
    assert fake.calls == [(0x1234, 3, 2, 1, 128, 1, 1, 4096, 0x5000, k.addr, None)]
    k.launch([0, 0, 0x100], 0)  # the default stream: a null handle
    assert k.slots[0] == 0x140 and fake.calls[-1][8] is None
    with pytest.raises(ValueError, match="format"):
        _Kernel("k", 1, (1, 1, 1), 32, 0, "i", (_Ref(0),))
    with pytest.raises(ValueError, match="arguments"):
        _Kernel("k", 1, (1, 1, 1), 32, 0, "ii", (1,))


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
