"""Every kernel variant the library can request compiles with nvcc, without spills.

Runs on machines without a GPU: it needs only ``nvcc``, and takes minutes
(every variant for sm_80 and sm_90), so it runs only when asked:
``PYCUDAFLASH_TEST_COMPILE=1 python -m pytest tests/test_compile.py``.
The source and options are the ones :mod:`pycudaflash.compiler` hands to
PyCUDA at run time.
"""

import os
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest

from pycudaflash import compiler

ARCHES = ("sm_80", "sm_90")

ASK_ENV = "PYCUDAFLASH_TEST_COMPILE"

pytestmark = [
    pytest.mark.skipif(os.environ.get(ASK_ENV) != "1",
                       reason=f"compiling every variant takes minutes: set {ASK_ENV}=1 to run it"),
    pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH"),
]


def _mod_variants(arch):
    """The variants of two representative modifier pairs (ALiBi with a document mask; soft-capping
    with a prefix-LM mask) for every pass, dtype and head-dim bucket, without a dense mask."""
    import numpy as np

    from pycudaflash.mods import mask_mod, score_mod

    pairs = [(score_mod("score - slope[h] * abs(i - j)", dict(slope=np.zeros(4, np.float32))),
              mask_mod("doc[b, i] == doc[b, j]", dict(doc=np.zeros((2, 8), np.int32)))),
             (score_mod("30 * tanh(score / 30)"), mask_mod("(j <= i) | (j < prefix[b])",
                                                            dict(prefix=np.zeros(2, np.int32))))]
    for mods in pairs:
        yield from compiler.all_variants(arch=arch, groups=(False,), mods=mods, mask_kinds=("none",))


@pytest.fixture(scope="module")
def builds():
    items = [(p, d, a) for a in ARCHES for p, d in compiler.all_variants(arch=a)]
    items += [(p, d, a) for a in ARCHES for p, d in _mod_variants(a)]
    jobs = max(1, min(8, os.cpu_count() or 1))
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return [r for r in pool.map(lambda it: compiler.compile_offline(*it), items)]


def _label(r):
    return f"{r.pass_} {dict((k, v) for k, v in r.defines.items() if k != compiler.MOD_CODE)} {r.arch}"


def test_variant_count(builds):
    # Per architecture: 2 passes x 3 mask modes x (4 float32 head-dim buckets
    # + 2 16-bit dtypes x 5 buckets); on sm_90 also the Hopper passes of the
    # 16-bit dtypes: the forward for every bucket and mask mode (and its TMA
    # version where the tiles say fwd90_tma), the backward for all of them but
    # bucket 128 with a float mask.
    # Each twice: k and v with as many heads as q, and with fewer.
    per_mask = len(compiler.HEAD_DIM_BUCKETS) + 2 * len(compiler.HEAD_DIM_BUCKETS_F16)
    tma = sum(compiler.tiles(hd, "bfloat16", "sm_90").fwd90_tma > 0 for hd in compiler.HEAD_DIM_BUCKETS_F16)
    hopper = 2 * ((2 * len(compiler.HEAD_DIM_BUCKETS_F16) + tma) * len(compiler.MASK_MODES) - 1)
    plain = [r for r in builds if compiler.MOD_CODE not in r.defines]
    assert len(plain) == 2 * (2 * len(compiler.MASK_MODES) * per_mask * len(ARCHES) + hopper)
    assert sum(r.arch == "sm_90a" for r in plain) == 2 * hopper
    # The modifier variants: 2 pairs x 2 passes x the buckets, per architecture, and on sm_90
    # the Hopper passes of the 16-bit dtypes where they serve modifiers (compiler.hopper_serves:
    # the forward, its TMA version and the backward at every bucket with the default tiles).
    mods = len(builds) - len(plain)
    hopper_mods = sum(compiler.hopper_serves(kind, hd, "none", True, compiler.tiles(hd, "bfloat16", "sm_90"))
                      for kind in ("fwd", "bwd") for hd in compiler.HEAD_DIM_BUCKETS_F16)
    assert hopper_mods == 2 * len(compiler.HEAD_DIM_BUCKETS_F16)
    # ... and the forwards' wide variants (Tiles.fwd90_mods_wide keys a step where that is wider)
    wide = 0
    for hd in compiler.HEAD_DIM_BUCKETS_F16:
        t = compiler.tiles(hd, "bfloat16", "sm_90")
        if min(t.fwd90_bc, t.fwd90_mods_wide) > min(t.fwd90_bc, t.fwd90_mods_bc):
            wide += 1 + (t.fwd90_tma > 0)
    assert wide == 4  # (head dims 96 and 128, each with and without the TMA)
    assert mods == 2 * (2 * per_mask * len(ARCHES) + 2 * (hopper_mods + tma + wide))


def test_all_variants_compile(builds):
    failed = [f"{_label(r)}\n{r.log[-2000:]}" for r in builds if not r.ok]
    assert not failed, "nvcc failed:\n" + "\n\n".join(failed)


_BWD = {"flash_bwd_preprocess", "flash_bwd_dkdv_kernel", "flash_bwd_dq_kernel", "flash_bwd_convert_dq",
        "flash_bwd_sum_groups"}
#: The kernels of each pass.
KERNELS = {"fwd": {"flash_fwd_kernel"}, "bwd": _BWD,
           "fwd_f16": {"flash_fwd_kernel", "flash_convert_mask"}, "bwd_f16": _BWD | {"flash_convert_mask"},
           "fwd_sm90": {"flash_fwd_kernel", "flash_convert_mask"}, "bwd_sm90": _BWD | {"flash_convert_mask"},
           "fwd_sm90_tma": {"flash_fwd_kernel", "flash_convert_mask"}}
#: Dynamic shared memory one block may have (bytes), by architecture.
SMEM_OPTIN = {"sm_80": 166912, "sm_90": 232448, "sm_90a": 232448}


def test_no_local_memory_spills(builds):
    """No kernel spills, but the dK/dV kernel of variants taken only when their spills fit
    Tiles.bwd90_mods (compiler.spill_checked; cuda_backend reads the compiled kernel's local
    memory and otherwise takes the mma.sync pass, which is checked here), and a modifier's wide
    forward (kept only where it has no local memory; the default forward is checked here)."""
    bad = []
    for r in builds:
        expected = KERNELS[r.pass_]
        assert expected <= set(r.spills), f"{_label(r)}: ptxas report lacks {expected - set(r.spills)}"
        hd, mods = r.defines["HEAD_DIM"], compiler.MOD_CODE in r.defines
        checked = compiler.spill_checked(r.pass_, hd, mods)
        # (a modifier's wide forward, kept at run time only where it has no local memory)
        wide = (mods and r.pass_.startswith("fwd_sm90")
                and r.defines["BC"] > compiler.tiles(hd, "bfloat16").fwd90_mods_bc)
        for kernel, (stores, loads) in r.spills.items():
            if (checked and kernel == "flash_bwd_dkdv_kernel") or (wide and kernel == "flash_fwd_kernel"):
                continue
            if stores or loads or r.stack.get(kernel, 0):
                bad.append(f"{_label(r)} {kernel}: {stores} B spill stores, {loads} B spill loads, "
                           f"{r.stack.get(kernel)} B stack")
    assert not bad, "local memory used:\n" + "\n".join(bad)


def test_every_kernel_states_a_launch_shape_that_fits(builds):
    """Each kernel's threads, tile and shared memory come from its cubin; the shared memory fits
    the architecture, the threads its launch bounds (a whole number of warps, at most 1024)."""
    seen = 0
    for r in builds:
        for kernel in KERNELS[r.pass_]:
            shape = compiler.shape_from_cubin(r.image, kernel)
            assert 0 <= shape.smem <= SMEM_OPTIN[r.arch], f"{_label(r)} {kernel}: {shape}"
            assert shape.threads % 32 == 0 and 0 < shape.threads <= 1024, f"{_label(r)} {kernel}: {shape}"
            assert shape.tile > 0, f"{_label(r)} {kernel}: {shape}"
            seen += shape.smem > 0
    assert seen > 0


def test_spill_parser_detects_spills():
    log = ("ptxas info    : Compiling entry function 'k' for 'sm_90'\n"
           "ptxas info    : Function properties for k\n"
           "    16 bytes stack frame, 8 bytes spill stores, 4 bytes spill loads\n"
           "ptxas info    : Used 255 registers, used 1 barriers\n")
    regs, spills, stack = compiler.parse_ptxas(log)
    assert regs == {"k": 255} and spills == {"k": (8, 4)} and stack == {"k": 16}


# ptxas notes that it serialised the warpgroup MMAs or had to insert
# warpgroup arrives (divergent control flow or registers around wgmma): the
# Hopper kernels then lose their overlap of products and softmax.
_WGMMA_NOTES = ("(C7510)", "(C7511)", "(C7515)", "(C7519)", "(C7520)", "wgmma.mma_async instructions are serialized")


def test_no_wgmma_serialisation(builds):
    bad = [f"{_label(r)}: {line.strip()}" for r in builds if r.arch == "sm_90a"
           for line in r.log.splitlines() if any(n in line for n in _WGMMA_NOTES)]
    assert not bad, "ptxas serialised wgmma:\n" + "\n".join(bad)
