"""Pieces of the launch path that need no GPU: stream handles, packed kernel
parameters, the fast path's overlap test and per-call key lengths."""

from __future__ import annotations

import ctypes
import struct
from types import SimpleNamespace
from typing import Any, Callable, List

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


def _demo_params() -> compiler.KernelParams:
    st = compiler.ParamStruct("S", (("a", "i64"), ("b", "float")),
                              type("S", (ctypes.Structure,), {"_fields_": [("a", ctypes.c_int64), ("b", ctypes.c_float)]}))
    return compiler.KernelParams(("X", "Y", "Z"), (("n", "int"), ("m", "i64")), st)


def test_kernel_packs_parameters_by_name(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = _FakeLaunch()
    monkeypatch.setattr(_driver, "_libcuda_raw", lambda name: fake)
    kp = _demo_params()
    ptrs = _Pointers(3)
    struct = kp.struct.ctype(a=7, b=0.5)
    k = _Kernel("k", 0x1234, (3, 2, 1), 128, 4096, kp, dict(Z=_Ref(1), X=_Ref(2, 64), Y=0, n=-3, m=1 << 40), ptrs,
                struct)
    assert k.fn == 0x1234 and k.grid == (3, 2, 1) and k.block == (128, 1, 1) and k.smem == 4096
    # Slots: pointers in signature order (Y fixed at 0), then the scalars; the struct is passed from its memory.
    assert list(k.slots)[1:5] == [0, 0, 0xFFFFFFFD, 1 << 40]
    assert k.refs == ((0, 2, 64), (2, 1, 0))
    base, table = ctypes.addressof(k.slots), ctypes.addressof(ptrs.array)
    assert [k.addrs[i] for i in (1, 3, 4)] == [base + 8, base + 24, base + 32]
    assert k.addrs[0] == table + 8 * 3 and k.addrs[2] == table + 8 * 1 and k.addrs[5] == ctypes.addressof(struct)
    assert ptrs.derived == ((3, 2, 64),)
    # A second kernel taking the same value + offset shares its slot.
    k2 = _Kernel("k2", 0x99, (1, 1, 1), 32, 0, kp, dict(X=_Ref(2, 64), Y=0, Z=0, n=1, m=2), ptrs, struct)
    assert k2.addrs[0] == k.addrs[0] and ptrs.derived == ((3, 2, 64),)
    # A call writes the values and the derived pointers; the launch passes the argument array.
    ptrs.fill([0, 0x7F0000001000, 0x7F0000002000])
    assert ptrs.array[0:4] == [0, 0x7F0000001000, 0x7F0000002000, 0x7F0000002040]
    k.launch(0x5000)
    assert fake.calls == [(0x1234, 3, 2, 1, 128, 1, 1, 4096, 0x5000, k.addr, None)]
    ptrs.fill([0, 0, 0x100])
    k.launch(0)  # the default stream: a null handle
    assert ptrs.array[3] == 0x140 and fake.calls[-1][8] is None


@pytest.mark.parametrize("args, message", [
    (dict(X=0, Y=0, n=1, m=2), r"no value for parameters \['Z'\]"),
    (dict(X=0, Y=0, Z=0, n=1, m=2, w=3), r"\['w'\] are no parameters"),
    (dict(X=0, Y=0, Z=0, n=_Ref(0), m=2), "scalar parameter 'n' given a pointer reference"),
    (dict(X=_Ref(3), Y=0, Z=0, n=1, m=2), "value slot 3 of 3"),
])
def test_kernel_refuses_wrong_arguments(monkeypatch: pytest.MonkeyPatch, args: dict, message: str) -> None:
    monkeypatch.setattr(_driver, "_libcuda_raw", lambda name: _FakeLaunch())
    kp = _demo_params()
    with pytest.raises(ValueError, match=message):
        _Kernel("k", 1, (1, 1, 1), 32, 0, kp, args, _Pointers(3), kp.struct.ctype())


def test_struct_fields_are_filled_by_name_and_checked() -> None:
    from pycudaflash.cuda_backend import _fill_struct

    kp = _demo_params()
    s = _fill_struct(kp.struct, dict(a=-5, b=2))
    assert (s.a, s.b) == (-5, 2.0)
    assert _fill_struct(kp.struct, {}).a == 0  # (fields a pass does not use stay 0)
    with pytest.raises(ValueError, match="no field 'c'"):
        _fill_struct(kp.struct, dict(c=1))
    with pytest.raises(TypeError, match="field 'a'"):
        _fill_struct(kp.struct, dict(a=1.5))
    small = compiler.ParamStruct("T", (("n", "int"),), type("T", (ctypes.Structure,), {"_fields_": [("n", ctypes.c_int32)]}))
    with pytest.raises(ValueError, match="cannot hold"):
        _fill_struct(small, dict(n=1 << 40))


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
    """A variant of pass ``pass_`` whose kernels need no GPU: handles 0, parameters read from the
    source, launch shapes made up (``shapes``: kernel -> (threads, tile))."""

    def __init__(self, pass_: str, defs: dict, shapes: dict) -> None:
        self.pass_, self.defs, self.shapes = pass_, defs, shapes
        self.tiles = compiler.tiles(defs["HEAD_DIM"], "float16", "sm_80")
        self.mod_names: tuple = ()

    def function(self, kernel: str) -> int:
        return 0

    def shape(self, kernel: str) -> compiler.KernelShape:
        return compiler.KernelShape(*self.shapes.get(kernel, (256, 1)), 0)

    def params(self, kernel: str) -> compiler.KernelParams:
        return compiler.kernel_params(self.pass_, kernel, tuple(sorted(self.defs.items())))

    def map_tile(self, kernel: str) -> tuple:
        return {"flash_bwd_dkdv_kernel": (64, 128), "flash_bwd_dq_kernel": (64, 64)}[kernel]

    def resident_blocks(self, kernel: str) -> int:
        return 1


@pytest.mark.parametrize("hkv", [4, 2])
def test_backward_plan_of_grouped_heads(monkeypatch: pytest.MonkeyPatch, hkv: int) -> None:
    """With fewer K/V heads the dK/dV kernel writes per query head into the workspace (contiguous
    (B, H, Nk, D)) and a last kernel sums each group into dk, dv; without, it writes dk, dv itself."""
    from pycudaflash import cuda_backend

    fake = _FakeVariant("bwd_f16", compiler.defines("bwd_f16", 64, "none", "float16", "sm_80", groups=hkv < 4),
                        {"flash_bwd_dkdv_kernel": (256, 64), "flash_bwd_preprocess": (256, 32)})
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
    assert dkdv.grid == (H, B, 2) and kernels["flash_bwd_preprocess"].grid == (-(-B * H * Nq // 32), 1, 1)
    # One struct for every kernel of the plan, passed last.
    p = plan.struct
    assert all(k.addrs[len(k.addrs) - 1] == ctypes.addressof(p) for k in plan.kernels)
    assert (p.H, p.kv_group, p.Hkv, p.vec) == (H, H // hkv, hkv, 1)  # (vec: D 64, aligned rows)
    assert (p.dk_sb, p.dk_sh, p.dk_sn) == (hkv * Nk * D, Nk * D, D) == (p.dv_sb, p.dv_sh, p.dv_sn)
    assert p.total_rows == B * H * Nq and p.kv_total == B * hkv * Nk * D
    P = cuda_backend.BackwardPlan
    ptr = dict(zip(compiler.kernel_params("bwd_f16", "flash_bwd_dkdv_kernel").pointers, range(99)))
    refs = {i: (src, off) for i, src, off in dkdv.refs}
    if hkv == H:
        assert refs[ptr["dK"]] == (P.DK, 0) and refs[ptr["dV"]] == (P.DV, 0)
        assert "flash_bwd_sum_groups" not in kernels
        assert (p.dkh_sb, p.dkh_sh, p.dkh_sn) == (p.dk_sb, p.dk_sh, p.dk_sn)
        return
    # Per-query-head dK, dV in the workspace, contiguous (B, H, Nk, D), then summed into dk, dv.
    dk_h, dv_h = refs[ptr["dK"]], refs[ptr["dV"]]
    assert dk_h[0] == dv_h[0] == P.WS and dv_h[1] - dk_h[1] >= 2 * B * H * Nk * D
    assert (p.dkh_sb, p.dkh_sh, p.dkh_sn) == (H * Nk * D, Nk * D, D) == (p.dvh_sb, p.dvh_sh, p.dvh_sn)
    sums = kernels["flash_bwd_sum_groups"]
    assert plan.kernels[-1] is sums and sums.grid[1] == 2
    sptr = compiler.kernel_params("bwd_f16", "flash_bwd_sum_groups").pointers
    srefs = {sptr[i]: (src, off) for i, src, off in sums.refs}
    assert srefs == {"dKh": dk_h, "dVh": dv_h, "dK": (P.DK, 0), "dV": (P.DV, 0)}
    # (one pointer slot each, shared by the two kernels)
    assert sums.addrs[sptr.index("dKh")] == dkdv.addrs[ptr["dK"]]
    assert plan.ws_bytes >= 2 * 2 * B * H * Nk * D


# (a bool mask's shape or a mask modifier with its tensors, and the map's planes: (batch, heads))
_MAP_SOURCES = [
    ("mask", (2, 1, 33, 70), (2, 1)), ("mask", (1, 4, 33, 70), (1, 4)), ("mask", (33, 70), (1, 1)),
    ("mask", (2, 4, 33, 70), (2, 4)),
    ("mask_mod", ("doc[b, i] == doc[b, j]", {"doc": np.zeros((2, 70), np.int32)}), (2, 1)),
    ("mask_mod", ("keep[h, j]", {"keep": np.ones((4, 70), bool)}), (1, 4)),
    ("mask_mod", ("(i // 8) != (j // 8)", {}), (1, 1)),
    ("mask_mod", ("tab[b, h, i] >= j", {"tab": np.zeros((2, 4, 33), np.int32)}), (2, 4)),
    ("both", ((2, 1, 33, 70), "keep[h, j]", {"keep": np.ones((4, 70), bool)}), (2, 4)),
    ("both", ((33, 70), "(i // 8) != (j // 8)", {}), (1, 1)),
    ("both", ((1, 4, 33, 70), "doc[b, i] == doc[b, j]", {"doc": np.zeros((2, 70), np.int32)}), (2, 4)),
]


@pytest.mark.parametrize("source, what, planes", _MAP_SOURCES)
@pytest.mark.parametrize("deterministic", [False, True])
def test_backward_plan_builds_the_block_maps(monkeypatch: pytest.MonkeyPatch, source: str, what: tuple,
                                             planes: tuple, deterministic: bool) -> None:
    """A bool mask, a mask modifier, or both together get one block map a tile shape of the
    kernels that read it, built first (flash_tile_map with a bool mask, else flash_mod_tile_map:
    grid (tiles, heads of the map, batch elements of the map), its tile sizes passed), each after
    the launch that clears its seen-key bits (flash_clear_seen: grid (1, heads, batch elements)),
    each in its own workspace region of a plane's bytes (map_plane_bytes: a byte a tile, padded to
    4, then a word for every 32 keys) a plane, and the reader's tmap points there.  A map has a
    plane per batch element and head that the mask does not broadcast over or that the modifier
    reads."""
    from pycudaflash import cuda_backend
    from pycudaflash.mods import mask_mod

    B, H, Nq, Nk, D = 2, 4, 33, 70, 64
    x = {n: np.ones((B, H, Nq if n in ("q", "dout", "out") else Nk, D), np.float16)
         for n in ("q", "k", "v", "dout", "out")}
    if source == "mask":
        kw, mods, kind, builder = dict(mask=np.ones(what, bool)), (None, None), "bool", "flash_tile_map"
    elif source == "mask_mod":
        kw = dict(mask_mod=what[0], mod_tensors=what[1] or None)
        mods, kind, builder = (None, mask_mod(*what)), "none", "flash_mod_tile_map"
    else:
        kw = dict(mask=np.ones(what[0], bool), mask_mod=what[1], mod_tensors=what[2] or None)
        mods, kind, builder = (None, mask_mod(*what[1:])), "bool", "flash_tile_map"
        what = what[1:]
    fake = _FakeVariant("bwd_f16", compiler.defines("bwd_f16", 64, kind, "float16", "sm_80", mods=mods),
                        {"flash_bwd_dkdv_kernel": (256, 128), "flash_bwd_preprocess": (256, 32),
                         "flash_bwd_dq_kernel": (128, 64)})
    fake.mod_names = tuple(sorted(what[1])) if source != "mask" else ()
    monkeypatch.setattr(cuda_backend, "_variant", lambda prob, kind: fake)
    monkeypatch.setattr(_driver, "_libcuda_raw", lambda name: _FakeLaunch())
    prob = _validate.validate_backward(x["dout"], x["q"], x["k"], x["v"], x["out"], np.zeros((B, H, Nq), np.float32),
                                       deterministic=deterministic, **kw)
    names = cuda_backend.OPERANDS["bwd"][:-1]
    shapes = dict(zip((names[i] for i in cuda_backend.BackwardPlan.OUTPUTS), cuda_backend._output_shapes(prob, "bwd")))
    plan = cuda_backend.BackwardPlan(prob, cuda_backend._plan_strides(prob, names, shapes), True)
    P = cuda_backend.BackwardPlan
    readers = ["flash_bwd_dkdv_kernel"] + (["flash_bwd_dq_kernel"] if deterministic else [])
    builders = [k for k in plan.kernels if k.name in ("flash_tile_map", "flash_mod_tile_map")]
    clears = [k for k in plan.kernels if k.name == "flash_clear_seen"]
    assert [k.name for k in plan.kernels[:2 * len(builders)]] == ["flash_clear_seen", builder] * len(readers)
    bparams = compiler.kernel_params("bwd_f16", builder)
    cparams = compiler.kernel_params("bwd_f16", "flash_clear_seen")
    regions = []
    for built, clear, reader in zip(builders, clears, readers):
        br, bc = fake.map_tile(reader)
        tiles = -(-Nq // br) * -(-Nk // bc)
        assert built.grid == (tiles, planes[1], planes[0])
        assert clear.grid == (1, planes[1], planes[0])
        n_ptr = len(cparams.pointers)
        assert dict(zip((n for n, _ in cparams.scalars), clear.slots[n_ptr:n_ptr + len(cparams.scalars)])) == \
            {"Nk": Nk, "tiles": tiles}
        assert {cparams.pointers[i]: (src, off) for i, src, off in clear.refs}["tmap"] == \
            {bparams.pointers[i]: (src, off) for i, src, off in built.refs}["tmap"]
        n_ptr = len(bparams.pointers)
        sizes = dict(zip((n for n, _ in bparams.scalars), built.slots[n_ptr:n_ptr + len(bparams.scalars)]))
        assert sizes == {"Nq": Nq, "Nk": Nk, "br": br, "bc": bc}
        brefs = {bparams.pointers[i]: (src, off) for i, src, off in built.refs}
        assert brefs["tmap"][0] == P.WS
        if source != "mask_mod":
            assert brefs["mask"] == (P.M, 0)
        kernel = next(k for k in plan.kernels if k.name == reader)
        rptr = compiler.kernel_params("bwd_f16", reader).pointers
        assert {rptr[i]: (src, off) for i, src, off in kernel.refs}["tmap"] == brefs["tmap"]
        plane_bytes = -(-tiles // 4) * 4 + 4 * -(-Nk // 32)
        assert cuda_backend.map_plane_bytes(tiles, Nk) == plane_bytes
        regions.append((brefs["tmap"][1], plane_bytes * planes[0] * planes[1]))
    regions.sort()
    for (a, n), (b, _) in zip(regions, regions[1:]):
        assert a + n <= b, "block maps overlap"
    assert regions[-1][0] + regions[-1][1] <= plan.ws_bytes


def test_a_plan_without_a_bool_mask_or_mask_modifier_builds_no_block_map(monkeypatch: pytest.MonkeyPatch) -> None:
    """A float mask, a score modifier alone or no mask at all: no builder, every tmap 0."""
    from pycudaflash import cuda_backend
    from pycudaflash.mods import score_mod

    B, H, Nq, Nk, D = 2, 4, 33, 70, 64
    x = {n: np.ones((B, H, Nq if n in ("q", "dout", "out") else Nk, D), np.float16)
         for n in ("q", "k", "v", "dout", "out")}
    for kw, kind, mods in ((dict(mask=np.zeros((Nq, Nk), np.float32)), "float", (None, None)),
                           (dict(score_mod="score * 2"), "none", (score_mod("score * 2"), None)),
                           ({}, "none", (None, None))):
        fake = _FakeVariant("bwd_f16", compiler.defines("bwd_f16", 64, kind, "float16", "sm_80", mods=mods),
                            {"flash_bwd_dkdv_kernel": (256, 128), "flash_bwd_preprocess": (256, 32),
                             "flash_bwd_dq_kernel": (128, 64)})
        monkeypatch.setattr(cuda_backend, "_variant", lambda prob, kind: fake)
        monkeypatch.setattr(_driver, "_libcuda_raw", lambda name: _FakeLaunch())
        prob = _validate.validate_backward(x["dout"], x["q"], x["k"], x["v"], x["out"],
                                           np.zeros((B, H, Nq), np.float32), deterministic=True, **kw)
        names = cuda_backend.OPERANDS["bwd"][:-1]
        shapes = dict(zip((names[i] for i in cuda_backend.BackwardPlan.OUTPUTS),
                          cuda_backend._output_shapes(prob, "bwd")))
        plan = cuda_backend.BackwardPlan(prob, cuda_backend._plan_strides(prob, names, shapes), True)
        assert not [k for k in plan.kernels if k.name.endswith("tile_map")]
        for reader in ("flash_bwd_dkdv_kernel", "flash_bwd_dq_kernel"):
            kernel = next(k for k in plan.kernels if k.name == reader)
            rptr = compiler.kernel_params("bwd_f16", reader).pointers
            assert "tmap" not in {rptr[i] for i, _, _ in kernel.refs}, f"{reader} got a block map"


def _hopper_plans(monkeypatch: pytest.MonkeyPatch, local: int, record: Callable[[Any, str], Any]) -> List[Any]:
    """Variants chosen as on an sm_90 device without tuning variables or memoised variants, where
    every compiled kernel reports ``local`` bytes of local memory; returns the list to which
    ``record(variant, kernel)`` of each such question is appended."""
    from pycudaflash import cuda_backend

    monkeypatch.delenv(compiler.HOPPER_ENV, raising=False)
    monkeypatch.delenv(compiler.TILES_ENV, raising=False)
    monkeypatch.setattr(compiler, "arch_of_current_device", lambda: "sm_90")
    monkeypatch.setattr(compiler, "context_key", lambda: 1)
    monkeypatch.setattr(cuda_backend, "_variants", {})
    asked: List[Any] = []

    def local_bytes(var: Any, kernel: str) -> int:
        asked.append(record(var, kernel))
        return local

    monkeypatch.setattr(cuda_backend, "_local_bytes", local_bytes)
    return asked


@pytest.mark.parametrize("head_dim, local, want", [(128, 0, "bwd_sm90"), (128, 32, "bwd_sm90"),
                                                   (128, 48, "bwd_f16"), (256, 256, "bwd_f16"),
                                                   (64, 256, "bwd_sm90")])
def test_the_hopper_backward_takes_a_modifier_where_its_compiled_code_fits(monkeypatch: pytest.MonkeyPatch,
                                                                           head_dim: int, local: int,
                                                                           want: str) -> None:
    """At the spill-checked head dims the backward with a modifier is the Hopper pass where its
    compiled dK/dV kernel keeps at most Tiles.bwd90_mods bytes of local memory, else mma.sync;
    at other head dims nothing is checked."""
    from pycudaflash import cuda_backend

    asked = _hopper_plans(monkeypatch, local, lambda var, kernel: var.pass_)
    assert compiler.tiles(head_dim, "float16", "sm_90").bwd90_mods == 32
    B, H, Nq, Nk = 1, 2, 20, 30
    x = {n: np.ones((B, H, Nq if n in ("q", "dout", "out") else Nk, head_dim), np.float16)
         for n in ("q", "k", "v", "dout", "out")}
    prob = _validate.validate_backward(x["dout"], x["q"], x["k"], x["v"], x["out"],
                                       np.zeros((B, H, Nq), np.float32), score_mod="30 * tanh(score / 30)")
    var = cuda_backend._variant(prob, "bwd")
    assert var.pass_ == want
    assert asked == (["bwd_sm90"] if head_dim != 64 else [])
    assert cuda_backend._variant(prob, "bwd") is var and len(asked) <= 1  # (decided once)
    plain = _validate.validate_backward(x["dout"], x["q"], x["k"], x["v"], x["out"], np.zeros((B, H, Nq), np.float32))
    assert cuda_backend._variant(plain, "bwd").pass_ == "bwd_sm90" and len(asked) <= 1


@pytest.mark.parametrize("head_dim, local, want_bc", [(128, 0, 128), (128, 8, 64), (64, 0, 64)])
def test_a_modifiers_forward_takes_more_keys_a_step_where_they_compile_without_spills(
        monkeypatch: pytest.MonkeyPatch, head_dim: int, local: int, want_bc: int) -> None:
    """The Hopper forward with a modifier tries Tiles.fwd90_mods_wide keys a step and keeps it
    where the compiled kernel has no local memory; where the wide step is no wider (head dim 64)
    nothing is compiled to find out, nor for a call without modifiers."""
    from pycudaflash import cuda_backend

    asked = _hopper_plans(monkeypatch, local, lambda var, kernel: (var.pass_, kernel, var.defs["BC"]))
    t = compiler.tiles(head_dim, "bfloat16", "sm_90")
    assert (t.fwd90_mods_bc, t.fwd90_mods_wide) == (64, 128)
    q, k, v = (np.ones((1, 2, 20, head_dim), np.float16) for _ in range(3))
    prob = _validate.validate_forward(q, k, v, score_mod="score - 0.5 * abs(i - j)")
    var = cuda_backend._variant(prob, "fwd")
    assert var.pass_ == "fwd_sm90" and var.defs["BC"] == want_bc
    assert asked == ([("fwd_sm90", "flash_fwd_kernel", 128)] if head_dim == 128 else [])
    assert cuda_backend._variant(prob, "fwd") is var and len(asked) <= 1  # (decided once)
    plain = _validate.validate_forward(q, k, v)
    assert cuda_backend._variant(plain, "fwd").defs["BC"] == t.fwd90_bc and len(asked) <= 1


@pytest.mark.parametrize("source, what, planes", [_MAP_SOURCES[0], _MAP_SOURCES[4], _MAP_SOURCES[8]])
def test_a_block_map_holds_the_maps_and_builds_them_once(monkeypatch: pytest.MonkeyPatch, source: str, what: tuple,
                                                         planes: tuple) -> None:
    """With a BlockMap the plan launches no map builder of its own: its readers' tmap are value slots
    from MAP0 (one a tile shape), filled at launch with memory the BlockMap owns; the first launch
    runs each builder into it (then waits on the stream), a second one runs none and reads the same
    memory; a launch without the BlockMap raises, and so does one that would build while capturing."""
    import dataclasses

    from pycudaflash import BlockMap, cuda_backend
    from pycudaflash.mods import mask_mod

    B, H, Nq, Nk, D = 2, 4, 33, 70, 64
    x = {n: np.ones((B, H, Nq if n in ("q", "dout", "out") else Nk, D), np.float16)
         for n in ("q", "k", "v", "dout", "out")}
    if source == "mask":
        bm, mods, kind = BlockMap(mask=np.ones(what, bool)), (None, None), "bool"
    elif source == "mask_mod":
        bm, mods, kind = BlockMap(mask_mod=what[0], mod_tensors=what[1]), (None, mask_mod(*what)), "none"
    else:
        bm = BlockMap(mask=np.ones(what[0], bool), mask_mod=what[1], mod_tensors=what[2])
        mods, kind = (None, mask_mod(*what[1:])), "bool"
    fake = _FakeVariant("bwd_f16", compiler.defines("bwd_f16", 64, kind, "float16", "sm_80", mods=mods),
                        {"flash_bwd_dkdv_kernel": (256, 128), "flash_bwd_preprocess": (256, 32),
                         "flash_bwd_dq_kernel": (128, 64)})
    fake.mod_names = tuple(sorted(bm.mod_tensors))
    monkeypatch.setattr(cuda_backend, "_variant", lambda prob, kind: fake)
    monkeypatch.setattr(_driver, "_libcuda_raw", lambda name: _FakeLaunch())
    prob = _validate.validate_backward(x["dout"], x["q"], x["k"], x["v"], x["out"], np.zeros((B, H, Nq), np.float32),
                                       deterministic=True, block_map=bm)
    assert prob.block_map is None  # (host arrays: the maps are built per call)
    prob = dataclasses.replace(prob, block_map=bm)  # (as a device call's)
    names = cuda_backend.OPERANDS["bwd"][:-1]
    shapes = dict(zip((names[i] for i in cuda_backend.BackwardPlan.OUTPUTS), cuda_backend._output_shapes(prob, "bwd")))
    plan = cuda_backend.BackwardPlan(prob, cuda_backend._plan_strides(prob, names, shapes), True)
    assert not [k for k in plan.kernels if k.name.endswith("tile_map")]
    readers = ("flash_bwd_dkdv_kernel", "flash_bwd_dq_kernel")  # (tile shapes 64 x 128 and 64 x 64)
    assert len(plan.map_specs) == len(plan.map_builders) == 2
    assert plan.N_VALS == plan.MAP0 + cuda_backend.MAX_MAP_SHAPES == plan.MOD0 + len(fake.mod_names) + 2
    for k, (reader, spec, builds) in enumerate(zip(readers, plan.map_specs, plan.map_builders)):
        br, bc = fake.map_tile(reader)
        tiles = -(-Nq // br) * -(-Nk // bc)
        band = cuda_backend._band(prob)
        assert spec[1:] == (br, bc, planes[0], planes[1], *band,
                            cuda_backend.map_plane_bytes(tiles, Nk) * planes[0] * planes[1])
        clear, build = builds
        assert clear.name == "flash_clear_seen" and clear.grid == (1, planes[1], planes[0])
        assert build.grid == (tiles, planes[1], planes[0])
        bptr = compiler.kernel_params("bwd_f16", spec[0]).pointers
        cptr = compiler.kernel_params("bwd_f16", "flash_clear_seen").pointers
        assert {bptr[i]: (src, off) for i, src, off in build.refs}["tmap"] == (plan.MAP0 + k, 0)
        assert {cptr[i]: (src, off) for i, src, off in clear.refs}["tmap"] == (plan.MAP0 + k, 0)
        kernel = next(kk for kk in plan.kernels if kk.name == reader)
        rptr = compiler.kernel_params("bwd_f16", reader).pointers
        assert {rptr[i]: (src, off) for i, src, off in kernel.refs}["tmap"] == (plan.MAP0 + k, 0)

    allocs, launched, synced = iter(range(0x1000, 0x100000, 0x1000)), [], []
    monkeypatch.setattr(_driver, "mem_alloc", lambda n: next(allocs))
    monkeypatch.setattr(_driver, "synchronize", lambda stream: synced.append(stream))
    monkeypatch.setattr(_driver, "is_capturing", lambda stream: False)
    monkeypatch.setattr(plan, "launch", lambda vals, ctx, stream, builds=(): launched.append((list(vals), builds)))
    mods = [0x50000 + 0x100 * i for i in range(len(fake.mod_names))]  # (as device tensors' addresses)
    for _ in range(2):
        cuda_backend.launch_plan(plan, plan.values([0] * 10), 77, 5, None, 0x9000000, mods, bm)
    (v1, b1), (v2, b2) = launched
    assert list(b1) == [0, 1] and list(b2) == [] and synced == [5]
    assert v1[plan.MAP0:plan.MAP0 + 2] == v2[plan.MAP0:plan.MAP0 + 2] == [0x1000, 0x2000]
    assert sorted(bm._maps.values()) == [0x1000, 0x2000] and all(key[0] == 77 for key in bm._maps)
    with pytest.raises(ValueError, match="planned with a block_map and is given none"):
        cuda_backend.launch_plan(plan, plan.values([0] * 10), 77, 5, None, 0x9000000, mods, None)
    monkeypatch.setattr(_driver, "is_capturing", lambda stream: True)
    freed = []
    monkeypatch.setattr(_driver, "mem_free", lambda ptr: freed.append(ptr))
    monkeypatch.setattr(_driver, "enter", lambda device=None: (77, False))
    monkeypatch.setattr(_driver, "context_device", lambda ctx: 0)
    other = BlockMap(mask=bm.mask, mask_mod=bm.mask_mod, mod_tensors=bm.mod_tensors)
    with pytest.raises(ValueError, match="cannot be built during graph capture"):
        cuda_backend.launch_plan(plan, plan.values([0] * 10), 77, 5, None, 0x9000000, mods, other)
    # (nothing is allocated while capturing: an allocation would end the capture)
    assert not other._maps and freed == [] and next(allocs) == 0x3000 and len(launched) == 2


@pytest.mark.parametrize("aligned, row_pad, want_tma", [(True, 0, True), (False, 0, False), (True, 4, False)])
def test_the_tma_forward_plan_carries_tensor_maps_encoded_per_addresses(monkeypatch: pytest.MonkeyPatch,
                                                                        aligned: bool, row_pad: int,
                                                                        want_tma: bool) -> None:
    """Where the tile sizes say fwd90_tma and q, k, v are aligned and describable, the forward plan
    takes the TMA pass: its kernel gets no q, k, v pointers, the struct carries their maps, and a
    launch encodes them again only for new addresses; otherwise (unaligned operands, rows of
    264 bytes) the plan keeps fwd_sm90."""
    import dataclasses

    import ml_dtypes

    from pycudaflash import _tma, cuda_backend

    tiles = dataclasses.replace(compiler.tiles(128, "bfloat16", "sm_90"), fwd90_tma=1)
    fakes = {}
    for tma, pass_, threads in ((False, "fwd_sm90", 256), (True, "fwd_sm90_tma", 384)):
        fakes[tma] = _FakeVariant(pass_, compiler.defines(pass_, 128, "none", "bfloat16", "sm_90", groups=True),
                                  {"flash_fwd_kernel": (threads, 128)})
        fakes[tma].tiles = tiles
    monkeypatch.setattr(cuda_backend, "_variant", lambda prob, kind, tma=False: fakes[tma])
    monkeypatch.setattr(cuda_backend, "_sm_count", lambda: 132)
    monkeypatch.setattr(_driver, "_libcuda_raw", lambda name: _FakeLaunch())
    encoded = []
    monkeypatch.setattr(_tma, "encode", lambda tm, ptr: encoded.append((tm, ptr)) or bytes([len(encoded)]) * 128)
    B, H, Hkv, Nq, Nk, D = 2, 4, 2, 100, 150, 128
    bf16 = ml_dtypes.bfloat16
    q = np.ones((B, H, Nq, D + row_pad), bf16)[..., :D]
    k, v = (np.ones((B, Hkv, Nk, D), bf16) for _ in range(2))
    prob = _validate.validate_forward(q, k, v, causal=True)
    names = cuda_backend.OPERANDS["fwd"][:-1]
    shapes = dict(zip((names[i] for i in cuda_backend.ForwardPlan.OUTPUTS), cuda_backend._output_shapes(prob, "fwd")))
    strides = cuda_backend._plan_strides(prob, names, shapes)
    plan = cuda_backend.ForwardPlan(prob, strides, aligned)
    fwd = next(kk for kk in plan.kernels if kk.name == "flash_fwd_kernel")
    pointers = compiler.kernel_params(plan.pass_, "flash_fwd_kernel", tuple(sorted(fakes[want_tma].defs.items()))).pointers
    if not want_tma:
        assert plan.pass_ == "fwd_sm90" and plan.tma_maps == () and "Q" in pointers
        return
    assert plan.pass_ == "fwd_sm90_tma" and not {"Q", "K", "V"} & set(pointers)
    # (the maps as the kernel's struct holds them: 128 bytes each, 64-byte aligned)
    assert all(getattr(type(plan.struct), m).offset % 64 == 0 and getattr(type(plan.struct), m).size == 128
               for m in ("q_map", "k_map", "v_map"))
    assert fwd.grid == (-(-Nq // 128), H, B)
    bc = fakes[True].defs["BC"]
    assert plan.tma_maps == (_tma.tile_map((B, H, Nq, D), strides["q"], "bfloat16", 128),
                             _tma.tile_map((B, Hkv, Nk, D), strides["k"], "bfloat16", bc),
                             _tma.tile_map((B, Hkv, Nk, D), strides["v"], "bfloat16", bc))
    P = cuda_backend.ForwardPlan
    vals = plan.values([0x10000, 0x20000, 0x30000, 0x40000, 0x50000, 0])
    for _ in range(2):
        plan.launch(list(vals), 77, 5)
    assert [ptr for _, ptr in encoded] == [0x10000, 0x20000, 0x30000]  # (once for the same addresses)
    assert [bytes(getattr(plan.struct, m)) for m in ("q_map", "k_map", "v_map")] == [bytes([n]) * 128 for n in (1, 2, 3)]
    vals[P.Q] = 0x60000
    plan.launch(list(vals), 77, 5)
    assert [ptr for _, ptr in encoded[3:]] == [0x60000, 0x20000, 0x30000]
    assert bytes(plan.struct.q_map) == bytes([4]) * 128
    # Exported for the C++ host path: each map's struct word, operand slot and encoding arguments
    # after the struct (which that path re-encodes per address).
    words = plan.export(77, 5)
    assert words[0] == cuda_backend.EXPORT_VERSION and words[11] == 3
    at = 12 + 3 * words[8] + words[9]
    for name, tm, slot in zip(("q_map", "k_map", "v_map"), plan.tma_maps, (P.Q, P.K, P.V)):
        args = _tma.encode_args(tm)
        assert words[at:at + 3 + len(args)] == [getattr(type(plan.struct), name).offset // 8, slot, len(args), *args]
        at += 3 + len(args)
    assert words[at] == next(kk for kk in plan.kernels).fn  # (the kernels follow)
