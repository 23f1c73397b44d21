"""TMA tensor maps (pycudaflash._tma) and the TMA / mbarrier header (cuda_src/flash_tma.cuh).

CPU: what a map holds for contiguous and transposed operands, every refusal, the driver call's
arguments; the header compiles for sm_90a.  GPU (sm_90): boxes loaded through a map land in
shared memory in the 128-byte swizzle, with zeros past N and D.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from pycudaflash import _driver, _tma, compiler

ROOT = Path(__file__).resolve().parent.parent


def _contiguous(shape):
    B, H, N, D = shape
    return (H * N * D, N * D, D, 1)


@pytest.mark.parametrize("shape, strides, dtype, rows", [
    ((2, 4, 100, 128), _contiguous((2, 4, 100, 128)), "bfloat16", 128),
    ((3, 5, 77, 72), _contiguous((3, 5, 77, 72)), "float16", 64),
    # (B, N, H, D) memory seen as (B, H, N, D): rows H*D apart, heads D apart
    ((2, 6, 33, 64), (33 * 6 * 64, 64, 6 * 64, 1), "bfloat16", 176),
    # a view into a wider buffer (row stride 256 for D 40)
    ((1, 2, 9, 40), (2 * 9 * 256, 9 * 256, 256, 1), "float16", 16),
])
def test_a_map_holds_the_operand_innermost_first_in_bytes(shape, strides, dtype, rows) -> None:
    tm = _tma.tile_map(shape, strides, dtype, rows)
    es = _tma.ELEM_BYTES[dtype]
    assert tm.dims == tuple(reversed(shape))
    assert tm.strides == (strides[2] * es, strides[1] * es, strides[0] * es)
    assert tm.box == (_tma.ATOM_BYTES // es, rows, 1, 1) and tm.box[0] * es == _tma.ATOM_BYTES
    assert all(s % _tma.ALIGN == 0 for s in tm.strides)
    assert _tma.tma_reason(shape, strides, dtype, rows) is None


def test_dimensions_of_one_element_get_packed_aligned_strides() -> None:
    # (strides of size-1 dimensions are never stepped along; whatever they were, the map's are
    # the packed extents, rounded up to 16 bytes)
    tm = _tma.tile_map((1, 1, 1, 36), (0, 7, 3, 1), "float16", 8)
    assert tm.strides == (80, 80, 80)
    tm = _tma.tile_map((1, 3, 1, 64), (5, 64, 1, 1), "bfloat16", 8)
    assert tm.strides == (128, 128, 384)


@pytest.mark.parametrize("shape, strides, dtype, rows, message", [
    ((2, 4, 100, 68), _contiguous((2, 4, 100, 68)), "float16", 64, "row stride \\(136 bytes\\)"),
    ((2, 4, 100, 64), (0, 0, 64, 1), "float16", 64, "head dimension is broadcast"),
    ((2, 4, 100, 64), (0, 6400, 64, 1), "float16", 64, "batch dimension is broadcast"),
    ((2, 4, 100, 64), (4 * 100 * 64, 100 * 64, 64, 2), "float16", 64, "head dim must be contiguous"),
    ((2, 4, 100, 64), (4 * 100 * 64, 100 * 64, -64, 1), "float16", 64, "row stride"),
    ((2, 4, 100, 64), (2 ** 40, 100 * 64, 64, 1), "float16", 64, "not below 2\\*\\*40"),
    ((2, 4, 100, 64), _contiguous((2, 4, 100, 64)), "float16", 0, "1 to 256 rows"),
    ((2, 4, 100, 64), _contiguous((2, 4, 100, 64)), "float16", 257, "1 to 256 rows"),
    ((2, 4, 100, 64), _contiguous((2, 4, 100, 64)), "float32", 64, "float16 and bfloat16 only"),
    ((4, 100, 64), (6400, 64, 1), "float16", 64, "\\(B, H, N, D\\)"),
    ((2, 0, 100, 64), _contiguous((2, 0, 100, 64)), "float16", 64, "at least 1"),
    ((1, 1, 2 ** 32 + 1, 64), _contiguous((1, 1, 2 ** 32 + 1, 64)), "float16", 64, "exceeds"),
])
def test_what_a_map_cannot_describe_is_named(shape, strides, dtype, rows, message) -> None:
    assert _tma.tma_reason(shape, strides, dtype, rows) is not None
    with pytest.raises(ValueError, match=message):
        _tma.tile_map(shape, strides, dtype, rows)


def test_encode_passes_the_map_to_the_driver_and_returns_its_128_bytes(monkeypatch) -> None:
    calls = []
    enum = lambda kind: (lambda value: (kind, value))
    words = [(0x0123456789ABCDEF * (k + 1)) & (2 ** 64 - 1) for k in range(16)]
    fake = SimpleNamespace(CUtensorMapDataType=enum("dtype"), CUtensorMapInterleave=enum("interleave"),
                           CUtensorMapSwizzle=enum("swizzle"), CUtensorMapL2promotion=enum("l2"),
                           CUtensorMapFloatOOBfill=enum("oob"),
                           cuuint64_t=lambda x: ("u64", x), cuuint32_t=lambda x: ("u32", x))
    monkeypatch.setattr(_driver, "driver", lambda: fake)
    monkeypatch.setattr(_driver, "check", lambda name, *args: calls.append((name, args)) or
                        SimpleNamespace(opaque=words))
    tm = _tma.tile_map((2, 4, 100, 128), _contiguous((2, 4, 100, 128)), "bfloat16", 128)
    raw = _tma.encode(tm, 0x7F0000001000)
    assert len(raw) == _tma.MAP_BYTES and raw == np.array(words, "<u8").tobytes()
    (name, args), = calls
    assert name == "cuTensorMapEncodeTiled"
    assert args[:3] == (("dtype", _tma.DATA_TYPES["bfloat16"]), 4, 0x7F0000001000)
    assert [x for _, x in args[3]] == list(tm.dims) and [x for _, x in args[4]] == list(tm.strides)
    assert [x for _, x in args[5]] == list(tm.box) and [x for _, x in args[6]] == [1, 1, 1, 1]
    assert args[7:] == (("interleave", _tma.INTERLEAVE_NONE), ("swizzle", _tma.SWIZZLE_128B),
                        ("l2", _tma.L2_PROMOTION_256B), ("oob", _tma.OOB_FILL_ZEROS))
    with pytest.raises(ValueError, match="16-byte aligned"):
        _tma.encode(tm, 0x7F0000001008)
    assert len(calls) == 1
    # (the C++ host path's arguments: the same values, flat)
    a = _tma.encode_args(tm)
    assert a == (_tma.DATA_TYPES["bfloat16"], 4, *tm.dims, *tm.strides, *tm.box, 1, 1, 1, 1,
                 _tma.INTERLEAVE_NONE, _tma.SWIZZLE_128B, _tma.L2_PROMOTION_256B, _tma.OOB_FILL_ZEROS)


def test_the_encoding_values_are_the_drivers() -> None:
    """The enumeration values the maps use (and the C++ host path passes on) are those of the
    driver's headers, as cuda-bindings states them."""
    drv = pytest.importorskip("cuda.bindings.driver", reason="cuda-bindings is not installed")
    assert _tma.DATA_TYPES == {"float16": int(drv.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_FLOAT16),
                               "bfloat16": int(drv.CUtensorMapDataType.CU_TENSOR_MAP_DATA_TYPE_BFLOAT16)}
    assert _tma.INTERLEAVE_NONE == int(drv.CUtensorMapInterleave.CU_TENSOR_MAP_INTERLEAVE_NONE)
    assert _tma.SWIZZLE_128B == int(drv.CUtensorMapSwizzle.CU_TENSOR_MAP_SWIZZLE_128B)
    assert _tma.L2_PROMOTION_256B == int(drv.CUtensorMapL2promotion.CU_TENSOR_MAP_L2_PROMOTION_L2_256B)
    assert _tma.OOB_FILL_ZEROS == int(drv.CUtensorMapFloatOOBfill.CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE)


# A probe of the header: one block per (row tile, head, batch element); thread 0 arms a barrier
# with the box bytes and loads the tile's HEAD_DIM/64 boxes; all threads wait on it and copy the
# swizzled shared memory out as it lies.
PROBE = r"""
#include "flash_common_sm90.cuh"
#define ROWS 64
extern "C" __global__ void __launch_bounds__(256)
tma_probe(const __grid_constant__ TmaMap map, unsigned short *out) {
    extern __shared__ __align__(1024) unsigned char raw[];
    unsigned char *tile = swizzle_base(raw);
    __shared__ u64 full;
    if (threadIdx.x == 0) {
        mbar_init(&full, 1);
        fence_barrier_init();
    }
    __syncthreads();  // (the barrier is initialised before anyone waits on it)
    if (threadIdx.x == 0) {
        tma_prefetch_map(&map);
        mbar_arrive_expect_tx(&full, HD_ATOMS * ROWS * SWZ_ROW_BYTES);
        for (int a = 0; a < HD_ATOMS; ++a)
            tma_load(tile + a * ROWS * SWZ_ROW_BYTES, &map, &full, a * SWZ_COLS, blockIdx.x * ROWS, blockIdx.y,
                     blockIdx.z);
    }
    mbar_wait(&full, 0);
    const int bytes = HD_ATOMS * ROWS * SWZ_ROW_BYTES;
    unsigned short *dst = out + ((size_t)(blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x) * (bytes / 2);
    for (int e = threadIdx.x; e < bytes / 2; e += blockDim.x) dst[e] = ((const unsigned short *)tile)[e];
}
"""


def _probe_options(head_dim: int):
    defs = compiler.defines("fwd_sm90", head_dim, "none", "bfloat16", "sm_90")
    return [*compiler.options(defs), "-I", str(ROOT / "cuda_src")]


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
def test_the_tma_header_compiles_for_sm90a(tmp_path: Path) -> None:
    cu = tmp_path / "probe.cu"
    cu.write_text(PROBE)
    r = subprocess.run(["nvcc", "--cubin", *_probe_options(128), "-arch", "sm_90a", "-Xptxas", "-v", str(cu),
                        "-o", str(tmp_path / "probe.cubin")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "tma_probe" in r.stderr and " 0 bytes spill stores" in r.stderr


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize("head_dim, mask_kind", [(64, "none"), (128, "none"), (256, "bool")])
def test_the_tma_forward_compiles_without_spills(head_dim: int, mask_kind: str) -> None:
    """The TMA forward (bfloat16, one job a block): the consumer warpgroups' code fits the
    registers setmaxnreg gives them."""
    defs = compiler.defines("fwd_sm90_tma", head_dim, mask_kind, "bfloat16", "sm_90")
    assert (defs["FWD_PERSIST"], defs["FWD_TMA"]) == (0, 1)
    r = compiler.compile_offline("fwd_sm90_tma", defs, "sm_90")
    assert r.ok, r.log[-3000:]
    assert r.spills["flash_fwd_kernel"] == (0, 0) and r.registers["flash_fwd_kernel"] > 0


def _unswizzle(tile: np.ndarray, atoms: int, rows: int) -> np.ndarray:
    """A [atoms][rows][64] 128-byte-swizzled tile of 16-bit words as a [rows][64 atoms] array."""
    t = tile.reshape(atoms, rows, 8, 8)  # (atom, row, 16-byte chunk as stored, word)
    r = np.arange(rows)[:, None]
    chunk = np.arange(8)[None, :] ^ (r % 8)  # logical chunk c sits at c ^ (row % 8)
    out = t[:, r, chunk, :]  # (atom, row, logical chunk, word)
    return out.transpose(1, 0, 2, 3).reshape(rows, atoms * 64)


def test_unswizzle_inverts_the_documented_layout() -> None:
    # (the probe's reading of shared memory, checked on a layout built from the rule itself)
    rows, atoms = 16, 2
    logical = np.arange(rows * atoms * 64, dtype=np.uint16).reshape(rows, atoms * 64)
    stored = np.zeros((atoms, rows, 8, 8), np.uint16)
    for r in range(rows):
        for a in range(atoms):
            for c in range(8):
                stored[a, r, c ^ (r % 8)] = logical[r, a * 64 + 8 * c:a * 64 + 8 * c + 8]
    assert np.array_equal(_unswizzle(stored.ravel(), atoms, rows), logical)
    stored[0, 3, 0, 0] += 1
    assert not np.array_equal(_unswizzle(stored.ravel(), atoms, rows), logical)


@pytest.mark.gpu
@pytest.mark.parametrize("shape, layout", [((2, 3, 150, 128), "bhnd"), ((1, 2, 70, 72), "bnhd")])
def test_boxes_land_swizzled_with_zeros_past_the_tensor(cuda: None, shape, layout) -> None:
    from pycuda.compiler import compile as pycuda_compile

    B, H, N, D = shape
    rows, head_dim = 64, 128
    atoms = head_dim // 64
    g = np.random.default_rng(5)
    x = g.integers(1, 2 ** 15, size=shape).astype(np.uint16)  # (nonzero: zeros can only be fill)
    mem = np.ascontiguousarray(x if layout == "bhnd" else x.transpose(0, 2, 1, 3))
    strides = tuple(s // 2 for s in (x if layout == "bhnd" else mem.transpose(0, 2, 1, 3)).strides)
    ctx, pushed = _driver.enter()
    try:
        if compiler.arch_of_current_device() not in compiler.HOPPER_ARCHES:
            pytest.skip("TMA needs sm_90")
        image = pycuda_compile(PROBE, options=_probe_options(head_dim), arch="sm_90a", no_extern_c=True)
        fn = _driver.Module(image).function("tma_probe")
        n_rt = -(-N // rows)
        tile_words = atoms * rows * 64
        src = _driver.mem_alloc(mem.nbytes)
        dst = _driver.mem_alloc(B * H * n_rt * tile_words * 2)
        got = np.full(B * H * n_rt * tile_words, 0xFFFF, np.uint16)  # (poisoned)
        _driver.memcpy_htod_async(src, mem.ctypes.data, mem.nbytes, 0)
        _driver.memcpy_htod_async(dst, got.ctypes.data, got.nbytes, 0)
        tmap = (ctypes.c_uint64 * 16).from_buffer_copy(_tma.encode(_tma.tile_map(shape, strides, "bfloat16", rows), src))
        out_arg = ctypes.c_uint64(dst)
        params = (ctypes.c_void_p * 2)(ctypes.addressof(tmap), ctypes.addressof(out_arg))
        smem = atoms * rows * 128 + 1024
        _driver.set_function_attribute(fn, "MAX_DYNAMIC_SHARED_SIZE_BYTES", smem)
        _driver.Launch(int(fn), (n_rt, H, B), (256, 1, 1), smem, ctypes.addressof(params))(0)
        _driver.memcpy_dtoh_async(got.ctypes.data, dst, got.nbytes, 0)
        _driver.synchronize(0)
        _driver.mem_free(src)
        _driver.mem_free(dst)
    finally:
        _driver.leave(pushed)
    tiles = got.reshape(B, H, n_rt, tile_words)
    for b in range(B):
        for h in range(H):
            plane = np.concatenate([_unswizzle(tiles[b, h, t], atoms, rows) for t in range(n_rt)])
            want = np.zeros_like(plane)
            want[:N, :D] = x[b, h]
            assert np.array_equal(plane, want), (b, h)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize("case", ["plain", "causal_key_lengths_nan", "gqa_bnhd_window"])
def test_the_tma_forward_gives_the_cp_async_forwards_results_bit_for_bit(cuda: None, monkeypatch, head_dim: int,
                                                                          case: str) -> None:
    """With fwd90_tma the plan takes the TMA forward; it runs the same arithmetic in the same order
    as fwd_sm90, so out and lse are equal to the bit.  NaN stored in the keys and values past the
    key lengths (which boundary tiles hold) changes nothing."""
    torch = pytest.importorskip("torch", reason="torch is not installed")
    import pycudaflash
    from pycudaflash import _validate, cuda_backend

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the TMA forward needs sm_90")
    g = torch.Generator(device="cuda").manual_seed(head_dim)
    B, H, Nq, Nk = 2, 4, 300, 333
    hkv = 2 if case.startswith("gqa") else H
    mk = lambda h, n: torch.randn(B, h, n, head_dim, device="cuda", dtype=torch.bfloat16, generator=g)
    q, k, v = mk(H, Nq), mk(hkv, Nk), mk(hkv, Nk)
    kw: dict = {}
    if case == "causal_key_lengths_nan":
        kl = torch.tensor([333, 190], device="cuda", dtype=torch.int32)
        k[1, :, 190:] = float("nan")
        v[1, :, 190:] = float("nan")
        kw = dict(causal=True, key_lengths=kl)
    elif case == "gqa_bnhd_window":
        q, k, v = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v))
        kw = dict(causal=True, window=(100, 0))
    monkeypatch.delenv(compiler.HOPPER_ENV, raising=False)  # (a session fixture may have set it to 0)
    runs = {}
    for tma in (0, 1):
        monkeypatch.setenv("PYCUDAFLASH_TILES", f"h{head_dim}:fwd90_tma={tma}")
        pycudaflash.clear_plans()
        plan = cuda_backend.plan(_validate.validate_forward(q, k, v, **kw), "fwd")[0]
        assert plan.pass_ == ("fwd_sm90_tma" if tma else "fwd_sm90")
        out, lse = pycudaflash.flash_attn_forward(q, k, v, **kw)
        torch.cuda.synchronize()
        runs[tma] = (out, lse)
    pycudaflash.clear_plans()
    (o0, l0), (o1, l1) = runs[0], runs[1]
    assert not torch.isnan(o1).any()
    assert torch.equal(o0, o1) and torch.equal(l0, l1)
