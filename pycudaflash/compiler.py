"""Compilation of the kernels in ``cuda_src/`` and its caches.

This module is the only place that knows how a kernel variant is built:

* a *variant* is one pass (:data:`PASSES`: ``'fwd'``/``'bwd'`` for float32,
  ``'*_f16'`` for float16/bfloat16 with ``mma.sync``, ``'*_sm90'`` for
  float16/bfloat16 with Hopper's ``wgmma``) plus its ``-D`` defines (head-dim
  bucket, mask mode, dtype, tile sizes, modifiers: :func:`defines`) and the
  layout constants every variant shares (:data:`LAYOUT`); the kernels define
  none of these themselves (``#error`` where one is missing).  A variant with
  score or mask modifiers also carries their device code
  (``defs[MOD_CODE]``, :func:`pycudaflash.mods.kernel_code`), which comes
  first in its source (:func:`variant_source`);
* a kernel takes its arrays as ``__restrict__`` pointers, then at most the
  sizes Nq, Nk, D, then one struct of ``cuda_src/flash_params.cuh``; the
  launch code fills all of them by the names and C layout read from the
  source (:func:`kernel_params`), and launches it by the shape (threads,
  tile, shared memory) the kernel states in its cubin (:func:`kernel_shape`);
* its source is the pass's ``.cu`` file with the ``cuda_src/`` headers it
  includes inlined (:func:`source`), so that PyCUDA's disk cache,
  keyed on the text, notices an edit in any of them (or another modifier);
* it is compiled to a cubin by PyCUDA's ``compile`` with ``no_extern_c=True``
  for the current device's architecture (``sm_90a`` for the ``*_sm90``
  passes), cached on disk by PyCUDA (``cache_dir()``), loaded through the
  driver (``pycudaflash._driver``) and kept per (context, variant).

:func:`compile_offline` runs the same compilation through ``nvcc`` alone (no
GPU needed) and reports registers and spills; the test suite uses it to
build every variant the library can request.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

COMMON = "flash_common.cuh"
#: The source file of each pass; it reaches the shared headers through
#: ``#include``.  The ``*_f16`` passes serve float16 and bfloat16
#: (``ELEM_BF16`` picks the type).
PASSES: Dict[str, str] = {
    "fwd": "flash_fwd.cu",
    "bwd": "flash_bwd.cu",
    "fwd_f16": "flash_fwd_f16.cu",
    "bwd_f16": "flash_bwd_f16.cu",
    "fwd_sm90": "flash_fwd_sm90.cu",
    "bwd_sm90": "flash_bwd_sm90.cu",
    "fwd_sm90_tma": "flash_fwd_sm90_tma.cu",
}
#: Passes built for an architecture-specific target (wgmma needs sm_90a).
PASS_ARCH: Dict[str, str] = {"fwd_sm90": "sm_90a", "bwd_sm90": "sm_90a", "fwd_sm90_tma": "sm_90a"}
#: The Hopper forward that loads through the TMA from a producer warp: a plan takes it
#: instead of fwd_sm90 where the tile sizes say fwd90_tma and q, k, v have tensor maps.
TMA_PASSES = {"fwd_sm90": "fwd_sm90_tma"}
#: Architectures whose 16-bit passes are the Hopper (wgmma) kernels, and the
#: environment variable that turns them off (``0``: use the mma.sync kernels).
HOPPER_ARCHES = ("sm_90",)
HOPPER_ENV = "PYCUDAFLASH_WGMMA"
TILES_ENV = "PYCUDAFLASH_TILES"
#: Environment variables that change which variant a problem gets.
TUNING_ENV = (HOPPER_ENV, TILES_ENV)
#: Passes that have a Hopper version.
HOPPER_PASSES = {"fwd": "fwd_sm90", "bwd": "bwd_sm90"}
WG_THREADS = 128  # threads of a warpgroup


def hopper_serves(kind: str, head_dim: int, mask_kind: str = "none", mods: bool = False,
                  t: Optional["Tiles"] = None) -> bool:
    """Whether the Hopper version of pass ``kind`` covers a head-dim bucket and mask kind (and
    modifiers, ``mods``).

    At head dim 128 the backward keeps dK and dV of 64 keys in one
    warpgroup's registers; a float mask's addressing would then spill: that
    case stays on the mma.sync kernel.  With a modifier's code at the head
    dims of :data:`MODS_SPILL_BUCKETS` the backward serves where the tile
    sizes ``t`` allow it (``bwd90_mods`` >= 0); whether a given expression
    takes it depends on its compiled code (:func:`spill_checked`).
    """
    if kind == "fwd":
        return True
    mods_off = mods and head_dim in MODS_SPILL_BUCKETS and (t is None or t.bwd90_mods < 0)
    return not ((head_dim == 128 and mask_kind == "float") or mods_off)


#: Head-dim buckets where the Hopper backward with a modifier's code spills for some expressions
#: (ALiBi with a document mask at 128: 256 bytes), not for others (ALiBi alone, a document mask).
MODS_SPILL_BUCKETS = (96, 128, 256)


def spill_checked(pass_: str, head_dim: int, mods: bool) -> bool:
    """Whether a variant is taken only where its compiled dK/dV kernel keeps at most
    ``Tiles.bwd90_mods`` bytes a thread in local memory (else the mma.sync pass serves): the
    Hopper backward with a modifier's code at :data:`MODS_SPILL_BUCKETS`."""
    return pass_ == HOPPER_PASSES["bwd"] and mods and head_dim in MODS_SPILL_BUCKETS


#: Input dtypes the kernels implement.
DTYPES = ("float32", "float16", "bfloat16")
#: Head dims are padded up to one of these (kernels specialise on the bucket).
HEAD_DIM_BUCKETS = (32, 64, 128, 256)  # float32
HEAD_DIM_BUCKETS_F16 = (64, 96, 128, 192, 256)  # float16, bfloat16
#: Dense mask kinds -> MASK_MODE define.
MASK_MODES = {"none": 0, "bool": 1, "float": 2}
#: Options for every kernel (the architecture is added per device).
NVCC_OPTIONS = ("-O3", "-std=c++17")

# Layout constants shared by the kernels and the launch code; :data:`LAYOUT` hands them to
# every variant as -D (the kernels #error without them).
FWD_WARPS = 4  # float32 forward (a tile size of the 16-bit forward: Tiles.fwd_warps)
BWD_WARPS = 8  # dK/dV kernel (float32 and mma.sync)
DQ_WARPS = 4  # deterministic dQ kernel
# rows per warp of the backward's preprocess and dQ conversion kernels (16: a lane has several
# loads in flight; 4 ran at about 2 TB/s on the H200)
PRE_ROWS = 16
PRE_WARPS = 8  # warps per block of those kernels
SMEM_PAD = 4  # floats of padding per shared-memory row (float32 kernels)
SMEM_PAD_H = 8  # 16-bit elements of padding per row (mma.sync kernels)
FLOAT_BYTES = 4
HALF_BYTES = 2


def pass_name(kind: str, dtype: str, arch: Optional[str] = None, head_dim: Optional[int] = None,
              mask_kind: str = "none", hopper: Optional[bool] = None, mods: bool = False) -> str:
    """Pass for ``kind`` ('fwd' or 'bwd'), an input dtype name and an architecture.

    On Hopper (``arch`` in :data:`HOPPER_ARCHES`) the 16-bit passes with a
    wgmma version use it where it covers the head-dim bucket, mask kind and
    modifiers (:func:`hopper_serves`), unless ``hopper`` is False (default:
    ``$PYCUDAFLASH_WGMMA``, see :func:`use_hopper_kernels`).
    """
    if dtype not in DTYPES:
        raise ValueError(f"no kernels for dtype {dtype!r}")
    if dtype == "float32":
        return kind
    if hopper is None:
        hopper = use_hopper_kernels()
    if (arch in HOPPER_ARCHES and kind in HOPPER_PASSES and hopper
            and (head_dim is None or hopper_serves(kind, head_dim, mask_kind, mods,
                                                   tiles(head_dim, dtype, arch)))):
        return HOPPER_PASSES[kind]
    return f"{kind}_f16"


def use_hopper_kernels() -> bool:
    """Whether ``$PYCUDAFLASH_WGMMA`` allows the Hopper kernels (default yes)."""
    val = os.environ.get(HOPPER_ENV, "1").strip()
    if val not in ("0", "1"):
        raise ValueError(f"${HOPPER_ENV} must be 0 or 1, got {val!r}")
    return val == "1"


def build_arch(pass_: str, arch: str) -> str:
    """Target a pass is compiled for on a device of architecture ``arch``."""
    need = PASS_ARCH.get(pass_)
    if need is None:
        return arch
    if arch.rstrip("a") != need.rstrip("a"):
        raise ValueError(f"pass {pass_!r} runs only on {need.rstrip('a')}, not {arch}")
    return need


def buckets(dtype: str = "float32") -> Tuple[int, ...]:
    """Head-dim buckets of a dtype's kernels."""
    return HEAD_DIM_BUCKETS if dtype == "float32" else HEAD_DIM_BUCKETS_F16


def kernel_dir() -> Path:
    """Folder holding the ``.cu`` sources (in the package, or the source tree)."""
    here = Path(__file__).resolve().parent
    for cand in (here / "cuda_src", here.parent / "cuda_src"):
        if (cand / COMMON).is_file():
            return cand
    raise FileNotFoundError(f"cuda_src/{COMMON} not found next to {here}")


def head_dim_bucket(d: int, dtype: str = "float32") -> int:
    """Smallest bucket of ``dtype``'s kernels that holds head dim ``d`` (1 <= d <= 256)."""
    for bucket in buckets(dtype):
        if d <= bucket:
            return bucket
    raise ValueError(f"head dim {d} exceeds the largest supported ({buckets(dtype)[-1]})")


@dataclass(frozen=True)
class Tiles:
    """Tile sizes of one head-dim bucket (rows of Q / keys of K per block), handed to the kernels as
    defines (:func:`defines`); what follows from them (a block's rows, threads, shared memory) the
    kernels state themselves (:func:`kernel_shape`).

    The forward's query rows are ``fwd_warps`` warps of ``fwd_mt`` 16-row blocks each (fixed at
    4 x 1 for float32).
    """

    fwd_bc: int
    bwd_br: int
    bwd_bc: int
    dq_bc: int
    fwd_warps: int = FWD_WARPS
    fwd_mt: int = 1
    fwd90_bc: int = 0  # keys per step of the Hopper forward (0: not used here)
    fwd90_wgs: int = 2  # warpgroups (of 64 query rows) per block of the Hopper forward
    fwd90_minb: int = 1  # blocks per SM its registers must allow
    # Hopper forward grid: 0 one block per query tile; 1 as many blocks as
    # fit the device at once (persistent), which take the next free job from
    # a job counter
    fwd90_persist: int = 0
    # (batch, head) pairs per group of the persistent forward's job order
    # (jobs of a group in tile-rank order, longest first); 0: chosen per call
    fwd90_group: int = 0
    # the Hopper forward with a modifier's code (which needs registers per
    # score): keys per step (at most fwd90_bc) and whether its blocks persist
    fwd90_mods_bc: int = 64
    fwd90_mods_persist: int = 1
    # keys a step tried first for a modifier's forward (at most fwd90_bc), kept
    # where the expression's compiled kernel has no local memory; 0: never.
    # H200, D 128: ALiBi 1591 us against 1728 at 64, soft-capping 1605 against 1773
    fwd90_mods_wide: int = 128
    # 1: the Hopper forward loads through the TMA from a producer warp where it can
    # (flash_fwd_sm90_tma.cu; one job a block)
    fwd90_tma: int = 0
    bwd90_br: int = 0  # query rows per step of the Hopper backward
    bwd90_wgs: int = 2  # warpgroups (of 64 keys, up to head dim 128) per block of the Hopper backward
    # The Hopper backward with a modifier's code at MODS_SPILL_BUCKETS: taken
    # where its dK/dV kernel has at most this many bytes of local memory a
    # thread (spills; else mma.sync serves), -1 never.  H200, head dim 128:
    # soft-capping with 8 bytes of spill loads 5.04 ms, mma.sync 7.15.
    bwd90_mods: int = 32
    # 1: the Hopper backward adds dQi through staged tiles and the copy engine
    # (flash_bwd_sm90.cu, up to head dim 128 where D is the bucket's) instead of
    # float32 atomics (0).  H100, bfloat16, N 4096, TFLOP/s backward: 260.3
    # against 233.4 at head dim 128, 310.2 against 311.5 at 64 (kept on atomics).
    bwd90_dq_bulk: int = 0


def _lean(arch: Optional[str]) -> bool:
    """Pre-Hopper architectures (smaller shared memory, tighter register allocation)."""
    return arch is not None and int(arch.split("_")[1].rstrip("abf")) < 90


def tiles(head_dim: int, dtype: str = "float32", arch: Optional[str] = None) -> Tiles:
    """Tile sizes for a head-dim bucket of a dtype on ``arch`` (default: sm_90).

    The kernels' defaults match the sm_90 choice.  Before sm_90 the 16-bit
    kernels use one 16-row block per forward warp and query tiles that fit
    163 KB of shared memory, which keeps them free of register spills.

    ``$PYCUDAFLASH_TILES`` overrides them for tuning experiments, e.g.
    ``"128:fwd_bc=32,bwd_br=32;h64:fwd_bc=128,fwd_mt=2"`` (an ``h`` before
    the head dim selects the float16/bfloat16 kernels).  It is read when a
    call signature is planned: a running process that changes it calls
    :func:`pycudaflash.clear_plans` before its next calls.
    """
    return _tiles(head_dim, dtype, _lean(arch), os.environ.get(TILES_ENV, "").strip())


@functools.lru_cache(maxsize=None)
def _tiles(head_dim: int, dtype: str, lean: bool, spec: str) -> Tiles:
    """:func:`tiles` for one architecture class and override spec (memoised)."""
    half = dtype != "float32"
    big = head_dim > 128
    if half and lean:
        sizes = dict(
            fwd_warps=4,
            fwd_mt=1,
            fwd_bc=64 if head_dim <= 128 else 32,
            bwd_br=64 if head_dim <= 96 else 32,
            bwd_bc=64 if big else 128,
            dq_bc=16 if big else 32,
        )
    elif half:
        # Measured on the H200 (scripts/f16_tune.py): two 16-row blocks per
        # warp where the registers allow it.  Hopper, head dim 64: the
        # forward with 64 keys a step fits 128 registers, so 2 blocks share
        # an SM; the backward fits 3 warpgroups (192 keys) in 168 registers.
        sizes = dict(
            fwd_warps=4,
            fwd_mt=2 if head_dim <= 128 else 1,
            fwd_bc=64 if head_dim <= 64 else 32,
            bwd_br=128 if head_dim <= 64 else (32 if head_dim > 192 else 64),
            bwd_bc=64 if big else 128,
            dq_bc=32 if big else 64,
            fwd90_bc=64 if head_dim <= 64 else (128 if head_dim <= 128 else 64),
            fwd90_wgs=2,
            fwd90_minb=2 if head_dim <= 64 else 1,
            # persistent blocks with a job counter where the registers allow
            # (at head dim 64 and above 128 the loop would spill)
            fwd90_persist=1 if 64 < head_dim <= 128 else 0,
            # the TMA forward above head dim 64 (H200, N 4096: 0.91 ms against 1.32
            # at 128, 0.93 against 1.20 at 256; at 64, where two cp.async blocks
            # share an SM, 1.88 against 1.53)
            fwd90_tma=1 if head_dim > 64 else 0,
            bwd90_br=64,
            bwd90_wgs=3 if head_dim <= 64 else 2,
            bwd90_dq_bulk=1 if 64 < head_dim <= 128 else 0,
        )
    else:
        small = head_dim <= 64
        sizes = dict(
            fwd_bc=32 if big else 64,
            # (before sm_90, 64 query rows at head dim 128 would not fit 163 KB)
            bwd_br=32 if (big or small or lean) else 64,
            bwd_bc=32 if big else 64,
            dq_bc=(16 if lean else 32) if big else 64,
        )
    sizes.update(_parse_tile_spec(spec).get(("h" if half else "") + str(head_dim), {}))
    if not half and (sizes.get("fwd_warps", FWD_WARPS) != FWD_WARPS or sizes.get("fwd_mt", 1) != 1):
        raise ValueError("PYCUDAFLASH_TILES: the float32 forward has fixed warps")
    return Tiles(**sizes)


def _parse_tile_spec(spec: str) -> Dict[str, Dict[str, int]]:
    """``$PYCUDAFLASH_TILES`` as {bucket key: {tile name: size}}."""
    out: Dict[str, Dict[str, int]] = {}
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        hd, _, items = part.partition(":")
        for item in filter(None, (i.strip() for i in items.split(","))):
            key, _, val = item.partition("=")
            if key not in Tiles.__dataclass_fields__:
                raise ValueError(f"PYCUDAFLASH_TILES: unknown tile size {key!r}")
            out.setdefault(hd.strip(), {})[key] = int(val)
    return out


SWZ_COLS = 64  # columns of a 128-byte swizzle block (Hopper kernels)
SMEM_ALIGN = 1024  # alignment slack of the swizzled tiles
#: The layout constants above, as every variant's kernels receive them.
LAYOUT: Dict[str, int] = dict(BWD_WARPS=BWD_WARPS, DQ_WARPS=DQ_WARPS, PRE_ROWS=PRE_ROWS, PRE_WARPS=PRE_WARPS,
                              SMEM_PAD=SMEM_PAD, SMEM_PAD_H=SMEM_PAD_H, SWZ_COLS=SWZ_COLS, SMEM_ALIGN=SMEM_ALIGN,
                              WG_THREADS=WG_THREADS)


_ELF_SECTION = struct.Struct("<IIQQQQIIQQ")  # name, type, flags, addr, offset, size, link, info, align, entsize
_ELF_SYMBOL = struct.Struct("<IBBHQQ")  # name, info, other, section index, value, size
_SHT_SYMTAB = 2


def cubin_constant(image: bytes, name: str) -> int:
    """The initial value of the ``int`` constant ``name`` (a ``__constant__`` variable of the source)
    in a cubin, an ELF64 file: how a kernel states a size the launch code needs (its shared
    memory, say) once, in CUDA, and the launch code reads it without a GPU."""
    if image[:4] != b"\x7fELF" or image[4] != 2 or image[5] != 1:
        raise ValueError("not a little-endian ELF64 image")
    shoff = struct.unpack_from("<Q", image, 0x28)[0]
    shentsize, shnum = struct.unpack_from("<HH", image, 0x3A)
    sections = [_ELF_SECTION.unpack_from(image, shoff + i * shentsize) for i in range(shnum)]
    want = name.encode()
    for sec in sections:
        if sec[1] != _SHT_SYMTAB:
            continue
        strings = sections[sec[6]][4]
        for off in range(sec[4], sec[4] + sec[5], sec[9]):
            st_name, _, _, shndx, value, size = _ELF_SYMBOL.unpack_from(image, off)
            end = image.index(b"\0", strings + st_name)
            if image[strings + st_name:end] == want:
                if size != 4 or not 0 < shndx < shnum:
                    raise ValueError(f"symbol {name!r} is not a 4-byte constant with a value")
                return struct.unpack_from("<i", image, sections[shndx][4] + value)[0]
    raise KeyError(f"no symbol {name!r} in the image")


@dataclass(frozen=True)
class KernelShape:
    """How a kernel is launched, as its source states it (``LAUNCH_SHAPE`` in ``flash_common.cuh``):
    ``threads`` a block, ``tile`` rows or keys a block (the unit of its grid), ``smem`` bytes of
    dynamic shared memory."""

    threads: int
    tile: int
    smem: int


def shape_from_cubin(image: bytes, kernel: str) -> KernelShape:
    """The :class:`KernelShape` of ``kernel`` read from a cubin."""
    return KernelShape(*(cubin_constant(image, f"{kernel}_{what}") for what in ("threads", "tile", "smem_bytes")))


def map_tile(pass_: str, defs: Dict[str, int], kernel: str) -> Tuple[int, int]:
    """The tiles (rows, keys) of ``kernel``'s block map of a bool mask (``TILE_MAP`` in
    ``flash_common.cuh``), read from its cubin."""
    image = get_module(pass_, defs).image
    return cubin_constant(image, f"{kernel}_map_rows"), cubin_constant(image, f"{kernel}_map_keys")


def kernel_shape(pass_: str, defs: Dict[str, int], kernel: str) -> KernelShape:
    """The :class:`KernelShape` of ``kernel`` in a variant (its module in the current context)."""
    return shape_from_cubin(get_module(pass_, defs).image, kernel)


#: The entry of a variant's defines that holds its modifiers' device code (no ``-D``).
MOD_CODE = "MOD_CODE"


def defines(pass_: str, head_dim: int, mask_kind: str, dtype: str = "float32",
            arch: Optional[str] = None, groups: bool = False, mods: Tuple[Any, Any] = (None, None),
            wide: bool = False) -> Dict[str, Any]:
    """The ``-D`` defines of one variant (``dtype`` picks float16/bfloat16 for ``*_f16`` passes;
    ``groups``: k and v have fewer heads than q; ``mods``: the score and mask
    :class:`pycudaflash.mods.Modifier`, or None), and with modifiers their device code
    (``MOD_CODE``).  ``wide``: the Hopper forward with modifiers at ``Tiles.fwd90_mods_wide``
    keys a step (cuda_backend keeps such a variant only where its compiled kernel has no
    local memory)."""
    if pass_ not in PASSES:
        raise ValueError(f"unknown pass {pass_!r}")
    half = pass_ != "fwd" and pass_ != "bwd"
    if half != (dtype != "float32"):
        raise ValueError(f"pass {pass_!r} does not serve dtype {dtype!r}")
    if head_dim not in buckets(dtype):
        raise ValueError(f"head dim {head_dim} is not a bucket {buckets(dtype)}")
    t = tiles(head_dim, dtype, arch)
    score, mask = mods
    out: Dict[str, Any] = {"HEAD_DIM": head_dim, "MASK_MODE": MASK_MODES[mask_kind], "KV_GROUPS": int(groups),
                           "SCORE_MOD": int(score is not None), "MASK_MOD": int(mask is not None)}
    if score is not None or mask is not None:
        from .mods import kernel_code

        out[MOD_CODE] = kernel_code(score, mask)[1]
    if half:
        out["ELEM_BF16"] = int(dtype == "bfloat16")
        out["LEAN_REGISTERS"] = int(_lean(arch))  # (the register budget class of the architecture)
    if pass_ in ("fwd_sm90", "fwd_sm90_tma"):
        if not t.fwd90_bc:
            raise ValueError(f"pass {pass_!r} has no tiles for arch {arch}")
        # A dense mask's addressing needs registers: D 256 then takes 32 keys a
        # step, and the tighter register budgets of 3 warpgroups (168) or 2
        # blocks per SM (128) would spill.
        dense = mask_kind != "none" or MOD_CODE in out  # (a modifier's code counts as a dense mask's)
        out["BC"] = min(t.fwd90_bc, 32) if (dense and head_dim > 192) else t.fwd90_bc
        out["FWD_WGS"] = min(t.fwd90_wgs, 2) if dense else t.fwd90_wgs
        out["FWD_MINB"] = 1 if dense else t.fwd90_minb
        # (the next job's K/V head, computed under the last product, would spill
        # registers with a dense mask's addressing: one job a block there)
        out["FWD_PERSIST"] = int(t.fwd90_persist > 0 and not (groups and dense))
        if MOD_CODE in out:
            out["BC"] = min(out["BC"], t.fwd90_mods_wide if wide else t.fwd90_mods_bc)
            out["FWD_PERSIST"] = int(out["FWD_PERSIST"] and t.fwd90_mods_persist > 0)
        if pass_ == "fwd_sm90_tma":  # (one job a block, the maps in the parameter struct)
            out.update(FWD_PERSIST=0, FWD_MINB=1, FWD_TMA=1)
            if mask_kind == "bool" and head_dim == 128:
                # (its consumers' 240 registers would spill the bool mask's
                # addressing at 128 keys a step: 48 bytes)
                out["BC"] = min(out["BC"], 64)
    elif pass_ == "bwd_sm90":
        if not t.bwd90_br or not hopper_serves("bwd", head_dim, mask_kind, MOD_CODE in out, t):
            raise ValueError(f"pass {pass_!r} does not serve head dim {head_dim} with mask {mask_kind!r}"
                             + (" and modifiers" if MOD_CODE in out else ""))
        # 3 warpgroups only where 168 registers suffice (not with a dense mask
        # or modifiers) and for the layout up to head dim 128.
        plain = mask_kind == "none" and MOD_CODE not in out
        wgs = t.bwd90_wgs if (plain and head_dim <= 128) else min(t.bwd90_wgs, 2)
        out.update(B90_BR=t.bwd90_br, B90_WGS=wgs, DQ_BC=_dq_bc(t, head_dim, MOD_CODE in out),
                   DQ_BULK=int(t.bwd90_dq_bulk > 0 and head_dim <= 128))
    elif pass_.startswith("fwd"):
        out.update(BC=t.fwd_bc, FWD_WARPS=t.fwd_warps)
        if not half and MOD_CODE in out and _lean(arch):
            # (the float32 kernel's masked and modified score paths of 64 keys would spill
            # before sm_90: 32 keys a step there)
            out["BC"] = min(out["BC"], 32)
        if half:
            out["FWD_MT"] = t.fwd_mt
    else:
        out.update(BWD_BR=t.bwd_br, BWD_BC=t.bwd_bc, DQ_BC=_dq_bc(t, head_dim, half and MOD_CODE in out))
    return out


def _dq_bc(t: Any, head_dim: int, mods: bool) -> int:
    """Keys a step of the deterministic dQ kernel: the tile's, but 16 in the 16-bit passes with a
    modifier's code at head dim 256 (their dQi takes the registers; the float32 kernel keeps
    its tile, with which it does not spill)."""
    return 16 if (mods and head_dim >= 256) else t.dq_bc


def all_variants(dtypes: Tuple[str, ...] = DTYPES, arch: Optional[str] = None,
                 groups: Tuple[bool, ...] = (False, True), mods: Tuple[Any, Any] = (None, None),
                 mask_kinds: Tuple[str, ...] = tuple(MASK_MODES)) -> Iterator[Tuple[str, Dict[str, Any]]]:
    """Every (pass, defines) the library can request on ``arch`` (default sm_90).

    On Hopper that includes both the wgmma passes and the mma.sync passes
    they replace (``$PYCUDAFLASH_WGMMA=0`` selects the latter).  ``groups``:
    the variants for k, v with as many heads as q (False) and fewer (True).
    ``mods``: the score and mask :class:`pycudaflash.mods.Modifier` (or None)
    the variants carry; ``mask_kinds``: the dense mask kinds to cover.
    """
    arch = arch or "sm_90"
    with_mods = mods != (None, None)
    for g in groups:
        for dtype in dtypes:
            for kind in ("fwd", "bwd"):
                for hopper in (False, True):
                    for hd in buckets(dtype):
                        for mk in mask_kinds:
                            pass_ = pass_name(kind, dtype, arch, hd, mk, hopper=hopper, mods=with_mods)
                            # (without a Hopper version, both settings name the same pass)
                            if hopper and pass_ == pass_name(kind, dtype, arch, hd, mk, hopper=False, mods=with_mods):
                                continue
                            yield pass_, defines(pass_, hd, mk, dtype, arch, groups=g, mods=mods)
                            fwd90 = [pass_]
                            if pass_ in TMA_PASSES and tiles(hd, dtype, arch).fwd90_tma:
                                fwd90.append(TMA_PASSES[pass_])
                                yield fwd90[-1], defines(fwd90[-1], hd, mk, dtype, arch, groups=g, mods=mods)
                            # (a modifier's wider forward, taken where it does not spill)
                            for p in fwd90 if with_mods else ():
                                wide = defines(p, hd, mk, dtype, arch, groups=g, mods=mods, wide=True)
                                if wide != defines(p, hd, mk, dtype, arch, groups=g, mods=mods):
                                    yield p, wide


@functools.lru_cache(maxsize=None)
def source(pass_: str) -> str:
    """Full source text of a pass: its file with every ``#include "..."`` of ``cuda_src/``
    replaced by the header's text (once per header, as ``#pragma once`` would), and ``#line``
    directives so that nvcc names the right file and line.

    PyCUDA's disk cache keys on this text, so a change in any header a pass
    includes compiles its variants again.
    """
    kdir = kernel_dir()
    seen = {PASSES[pass_]}
    return "\n".join(_flatten(PASSES[pass_], kdir, seen)) + "\n"


def variant_source(pass_: str, defs: Dict[str, Any]) -> str:
    """The source a variant is compiled from: its modifiers' device code (``defs[MOD_CODE]``, if
    any) and then the pass's :func:`source`."""
    code = defs.get(MOD_CODE)
    return (f'#line 1 "modifiers"\n{code}' if code else "") + source(pass_)


_LOCAL_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"\s*$')


def _flatten(name: str, kdir: Path, seen: set) -> List[str]:
    out = [f'#line 1 "{name}"']
    for lineno, line in enumerate((kdir / name).read_text().splitlines(), 1):
        m = _LOCAL_INCLUDE.match(line)
        if m:
            header = m.group(1)
            if not (kdir / header).is_file():
                raise FileNotFoundError(f"{name}:{lineno}: included {header!r} is not in {kdir}")
            if header not in seen:
                seen.add(header)
                out += _flatten(header, kdir, seen)
            out.append(f'#line {lineno + 1} "{name}"')
        elif line.strip() == "#pragma once":
            out.append("")  # (each header is pasted once anyway)
        else:
            out.append(line)
    return out


#: C types of the fields of a parameter struct and of a kernel's scalar parameters, with the
#: ctypes type that lays them out as the C compilers do.
FIELD_TYPES: Dict[str, Any] = {"i64": ctypes.c_int64, "long long": ctypes.c_int64, "int": ctypes.c_int32,
                               "u32": ctypes.c_uint32, "unsigned": ctypes.c_uint32, "float": ctypes.c_float,
                               "unsigned long long": ctypes.c_uint64, "u64": ctypes.c_uint64}
#: Bytes a kernel's parameters may fill (the classic limit of every architecture).
PARAM_LIMIT = 4096


@dataclass(frozen=True)
class ParamStruct:
    """A parameter struct of the source: its fields ``(name, C type)`` in declaration order and
    ``ctype``, a :class:`ctypes.Structure` of the same fields (hence the same C layout)."""

    name: str
    fields: Tuple[Tuple[str, str], ...]
    ctype: Any

    @property
    def size(self) -> int:
        return ctypes.sizeof(self.ctype)


@dataclass(frozen=True)
class KernelParams:
    """What a kernel takes, read from its signature: ``pointers``, the names of its leading
    ``__restrict__`` pointer parameters; ``scalars``, the ``(name, C type)`` of the few scalar
    parameters after them; last, one ``const __grid_constant__`` struct (its pass's scalars)."""

    pointers: Tuple[str, ...]
    scalars: Tuple[Tuple[str, str], ...]
    struct: ParamStruct

    @property
    def size(self) -> int:
        """Bytes of the kernel's parameters (each pointer or scalar in 8 at most, the struct after)."""
        return 8 * (len(self.pointers) + len(self.scalars)) + self.struct.size

    def names(self) -> Tuple[str, ...]:
        """Every name the launch code fills: pointers, scalars and struct fields."""
        return self.pointers + tuple(n for n, _ in self.scalars) + tuple(n for n, _ in self.struct.fields)


def _strip_comments(text: str) -> str:
    """``text`` without comments, its continued lines (backslash-newline) joined."""
    text = re.sub(r"/\*.*?\*/", " ", re.sub(r"//[^\n]*", "", text), flags=re.S)
    return text.replace("\\\n", " ")


def _declared_type(text: str, where: str) -> str:
    base = re.sub(r"\s+", " ", re.sub(r"\bconst\b", "", text)).strip()
    if base not in FIELD_TYPES:
        raise ValueError(f"{where}: no layout for type {base!r} (one of {sorted(FIELD_TYPES)})")
    return base


def _active(body: str, defs: Dict[str, Any], where: str) -> str:
    """The lines of ``body`` that ``#if EXPR`` / ``#else`` / ``#endif`` keep under the variant's
    defines (EXPR: names, numbers, ``||``, ``&&``, ``!`` and parentheses; an undefined name is 0,
    as in C)."""
    kept: List[str] = []
    stack: List[bool] = []
    for line in body.splitlines():
        d = re.fullmatch(r"\s*#\s*(if|else|endif)\b(.*)", line)
        if d is None:
            if all(stack):
                kept.append(line)
            continue
        word, expr = d.group(1), d.group(2).strip()
        if word == "if":
            if not re.fullmatch(r"[\w\s|&!()]*", expr) or not expr:
                raise ValueError(f"{where}: cannot evaluate '#if {expr}'")
            py = re.sub(r"[A-Za-z_]\w*", lambda m: str(int(defs.get(m.group(0), 0))), expr)
            py = py.replace("||", " or ").replace("&&", " and ").replace("!", " not ")
            stack.append(bool(eval(py, {"__builtins__": {}})))
        elif not stack:
            raise ValueError(f"{where}: #{word} without #if")
        elif word == "else":
            stack[-1] = not stack[-1]
        else:
            stack.pop()
    if stack:
        raise ValueError(f"{where}: #if without #endif")
    return "\n".join(kept)


_FIELD_DECL = re.compile(r"([A-Za-z_][\w ]*?)\s+([A-Za-z_]\w*(?:\s*\[\s*\d+\s*\])*"
                         r"(?:\s*,\s*[A-Za-z_]\w*(?:\s*\[\s*\d+\s*\])*)*)")


@functools.lru_cache(maxsize=None)
def param_struct(pass_: str, name: str, defs: Tuple[Tuple[str, Any], ...] = ()) -> ParamStruct:
    """Fields and C layout of ``struct name`` as variant ``(pass_, defs)``'s source declares it
    (:func:`variant_source`; ``defs`` as sorted items): lines ``TYPE NAME[, NAME ...];`` of the
    types in :data:`FIELD_TYPES` or of other structs of the source, a NAME possibly an array
    (``data[8]``, ``size[8][4]``), nothing else (no pointers: those are kernel parameters of
    their own, or addresses held as ``unsigned long long``), under ``#if`` lines evaluated
    with the defines."""
    variant = dict(defs)
    text = _strip_comments(variant_source(pass_, variant))
    found = re.findall(r"\bstruct\s+" + _ALIGNAS + re.escape(name) + r"\s*\{([^{}]*)\}\s*;", text)
    if len(found) != 1:
        raise ValueError(f"{pass_}: {len(found)} definitions of struct {name} in the source")
    align, body = int(found[0][0] or 1), found[0][1]
    fields: List[Tuple[str, str]] = []
    ctypes_fields: List[Tuple[str, Any]] = []
    where = f"{pass_}: struct {name}"
    off = 0  # (the C layout: each field at a multiple of its alignment, which alignas may raise)

    def place(field: str, t: Any) -> None:
        nonlocal off, align
        a = _alignment(t)
        at = -(-off // a) * a
        if at != -(-off // ctypes.alignment(t)) * ctypes.alignment(t):  # (ctypes would not pad enough)
            ctypes_fields.append((f"_pad{len(ctypes_fields)}", ctypes.c_ubyte * (at - off)))
        ctypes_fields.append((field, t))
        off, align = at + ctypes.sizeof(t), max(align, a)

    for decl in filter(None, (d.strip() for d in _active(body, variant, where).split(";"))):
        m = _FIELD_DECL.fullmatch(decl)
        if m is None:
            raise ValueError(f"{where}: cannot lay out the declaration {decl!r}")
        base = re.sub(r"\s+", " ", re.sub(r"\bconst\b", "", m.group(1))).strip()
        if base not in FIELD_TYPES and re.search(r"\bstruct\s+" + _ALIGNAS + re.escape(base) + r"\s*\{", text):
            ctype, layout = base, param_struct(pass_, base, defs).ctype
        else:
            ctype = _declared_type(m.group(1), where)
            layout = FIELD_TYPES[ctype]
        for item in (f.strip() for f in m.group(2).split(",")):
            field = re.match(r"\w+", item).group(0)
            dims = [int(n) for n in re.findall(r"\[\s*(\d+)\s*\]", item)]
            if any(field == f for f, _ in fields):
                raise ValueError(f"{where}: field {field!r} declared twice")
            t = layout
            for n in reversed(dims):
                t = t * n
            fields.append((field, ctype + "".join(f"[{n}]" for n in dims)))
            place(field, t)
    if not fields:
        raise ValueError(f"{where} has no fields")
    size = -(-off // align) * align
    natural = -(-off // max(ctypes.alignment(t) for _, t in ctypes_fields)) * max(
        ctypes.alignment(t) for _, t in ctypes_fields)
    if size != natural:  # (the tail padding of an over-aligned struct)
        ctypes_fields.append((f"_pad{len(ctypes_fields)}", ctypes.c_ubyte * (size - off)))
    layout = type(name, (ctypes.Structure,), {"_fields_": ctypes_fields, "_align_": align})
    return ParamStruct(name, tuple(fields), layout)


# ``struct alignas(N) NAME {`` : the group is N (empty without alignas).
_ALIGNAS = r"(?:alignas\s*\(\s*(\d+)\s*\)\s+)?"


def _alignment(t: Any) -> int:
    """The C alignment of a ctypes field type: its struct's ``alignas`` where it has one."""
    while issubclass(t, ctypes.Array):
        t = t._type_
    return max(getattr(t, "_align_", 1), ctypes.alignment(t))


_POINTER_PARAM = re.compile(r"(?:const\s+)?[A-Za-z_][\w ]*?\s*\*\s*(?:const\s+)?__restrict__\s+([A-Za-z_]\w*)")
_SCALAR_PARAM = re.compile(r"((?:const\s+)?[A-Za-z_][\w ]*?)\s+([A-Za-z_]\w*)")
_STRUCT_PARAM = re.compile(r"const\s+__grid_constant__\s+([A-Za-z_]\w*)\s+[A-Za-z_]\w*")


@functools.lru_cache(maxsize=None)
def kernel_params(pass_: str, kernel: str, defs: Tuple[Tuple[str, Any], ...] = ()) -> KernelParams:
    """The parameters of ``kernel`` in variant ``(pass_, defs)`` (``defs`` as sorted items; the
    struct may depend on them), read from its signature in the source:
    ``__restrict__`` pointers, then scalars, then ``const __grid_constant__ NAME p`` with
    ``struct NAME`` in the source (:func:`param_struct`).  The launch code fills all of them by
    name, so that it and the kernel cannot disagree.  A kernel defined more than once (one
    definition per ``#if`` branch) must take the same parameters in each."""
    text = _strip_comments(source(pass_))
    found = set()
    where = f"{pass_}/{kernel}"
    for m in re.finditer(r'extern\s+"C"\s+__global__[^;{]*?\b' + re.escape(kernel) + r"\s*\(([^()]*)\)", text):
        params = [re.sub(r"\s+", " ", p).strip() for p in m.group(1).split(",")]
        last = _STRUCT_PARAM.fullmatch(params[-1])
        if last is None:
            raise ValueError(f"{where}: the last parameter {params[-1]!r} is not 'const __grid_constant__ STRUCT p'")
        pointers: List[str] = []
        scalars: List[Tuple[str, str]] = []
        for p in params[:-1]:
            ptr = _POINTER_PARAM.fullmatch(p)
            if ptr is not None:
                if scalars:
                    raise ValueError(f"{where}: pointer parameter {p!r} after a scalar one")
                pointers.append(ptr.group(1))
                continue
            sc = _SCALAR_PARAM.fullmatch(p)
            if sc is None or "*" in p:
                raise ValueError(f"{where}: parameter {p!r} is neither a '__restrict__' pointer nor a scalar")
            scalars.append((sc.group(2), _declared_type(sc.group(1), where)))
        found.add((tuple(pointers), tuple(scalars), last.group(1)))
    if len(found) != 1:
        raise ValueError(f"{where}: {len(found)} distinct signatures in the source")
    pointers_, scalars_, name = found.pop()
    params = KernelParams(pointers_, scalars_, param_struct(pass_, name, defs))
    names = params.names()
    if len(set(names)) != len(names):
        raise ValueError(f"{where}: a name repeats among its parameters and the fields of struct {name}")
    if params.size > PARAM_LIMIT:
        raise ValueError(f"{where}: {params.size} bytes of parameters, over the limit of {PARAM_LIMIT}")
    return params


def options(defs: Dict[str, int]) -> List[str]:
    """nvcc options of a variant (without the architecture): its defines and :data:`LAYOUT`."""
    both = set(defs) & set(LAYOUT)
    if both:
        raise ValueError(f"variant defines {sorted(both)} are layout constants")
    return list(NVCC_OPTIONS) + [f"-D{k}={v}" for k, v in sorted({**LAYOUT, **defs}.items()) if k != MOD_CODE]


def cache_dir() -> str:
    """Directory of PyCUDA's on-disk kernel cache as this library uses it."""
    explicit = os.environ.get("PYCUDAFLASH_CACHE_DIR") or os.environ.get("PYCUDA_CACHE_DIR")
    if explicit:
        return explicit
    import platformdirs

    return os.path.join(platformdirs.user_cache_dir("pycuda", "pycuda"), "compiler-cache-v1")


def _explicit_cache_dir() -> Optional[str]:
    return os.environ.get("PYCUDAFLASH_CACHE_DIR") or None


@functools.lru_cache(maxsize=None)
def nvcc_version(nvcc: str = "nvcc") -> str:
    """Last line of ``nvcc --version``, or 'not found'."""
    path = shutil.which(nvcc)
    if path is None:
        return "not found"
    try:
        out = subprocess.run([path, "--version"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        return f"error ({exc})"
    lines = [ln for ln in out.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else "unknown"


# ------------------------------------------------------------- run time

_lock = threading.Lock()
_modules: Dict[tuple, object] = {}
compiled_variants: List[Tuple[str, Tuple[Tuple[str, int], ...]]] = []


def context_key() -> int:
    """Handle of the current CUDA context: the key of the per-context caches."""
    from . import _driver

    ctx = _driver.current_context()
    if not ctx:
        raise RuntimeError("no current CUDA context")
    return ctx


_arches: Dict[int, str] = {}


def arch_of_current_device() -> str:
    """``sm_XY`` of the current context's device (memoised per context)."""
    from . import _driver

    key = context_key()
    arch = _arches.get(key)
    if arch is None:
        major, minor = _driver.compute_capability(_driver.context_device(key))
        arch = _arches[key] = f"sm_{major}{minor}"
    return arch


def cubin(pass_: str, defs: Dict[str, int], arch: str) -> bytes:
    """The cubin of a variant for ``arch``, compiled by PyCUDA (through its disk cache)."""
    from pycuda.compiler import compile as pycuda_compile

    return pycuda_compile(variant_source(pass_, defs), options=options(defs), arch=build_arch(pass_, arch),
                          no_extern_c=True, cache_dir=_explicit_cache_dir())


#: Seconds a variant may take to come from PyCUDA's cache before :func:`get_module` says that it
#: is compiling it (``$PYCUDAFLASH_QUIET=1``: never).
COMPILE_NOTICE_S = 0.5


@contextlib.contextmanager
def _compile_notice(pass_: str, defs: Dict[str, int], arch: str) -> Iterator[None]:
    """One line on stderr if the block (a cubin from the cache, or nvcc) outlasts COMPILE_NOTICE_S."""
    if os.environ.get("PYCUDAFLASH_QUIET", "") == "1":
        yield
        return
    label = f"{pass_} ({', '.join(f'{k}={v}' for k, v in sorted(defs.items()) if k != MOD_CODE)})"
    timer = threading.Timer(COMPILE_NOTICE_S, lambda: print(
        f"pycudaflash: compiling kernel variant {label} for {build_arch(pass_, arch)}; it is cached "
        f"for later runs ('python -m pycudaflash warm' builds them all)", file=sys.stderr, flush=True))
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def get_module(pass_: str, defs: Dict[str, int]):
    """The variant's module (:class:`pycudaflash._driver.Module`) in the current context (memoised)."""
    from . import _driver

    key = (context_key(), pass_, tuple(sorted(defs.items())))
    mod = _modules.get(key)
    if mod is not None:
        return mod
    with _lock:
        mod = _modules.get(key)
        if mod is None:
            arch = arch_of_current_device()
            with _compile_notice(pass_, defs, arch):
                image = cubin(pass_, defs, arch)
            mod = _modules[key] = _driver.Module(image)
            compiled_variants.append((pass_, key[2]))
    return mod


def resident_blocks(fn, threads: int, smem: int) -> int:
    """Blocks of the kernel ``fn`` (a CUfunction of the current context) that one SM holds at once.

    The occupancy rules of the current device: registers (allocated per warp
    in units of 256), shared memory (dynamic ``smem``, static, and what the
    driver reserves per block), threads and blocks per SM.
    """
    from . import _driver

    dev = _driver.context_device(context_key())

    def attr(name: str) -> int:
        return _driver.device_attribute(dev, name)

    num_regs = _driver.function_attribute(fn, "NUM_REGS")
    warps = -(-threads // 32)
    regs_per_warp = -(-num_regs * 32 // 256) * 256
    by_regs = (attr("MAX_REGISTERS_PER_MULTIPROCESSOR") // max(regs_per_warp, 1)) // warps
    per_block = smem + _driver.function_attribute(fn, "SHARED_SIZE_BYTES") + attr("RESERVED_SHARED_MEMORY_PER_BLOCK")
    by_smem = attr("MAX_SHARED_MEMORY_PER_MULTIPROCESSOR") // per_block
    by_threads = attr("MAX_THREADS_PER_MULTIPROCESSOR") // threads
    n = min(by_regs, by_smem, by_threads, attr("MAX_BLOCKS_PER_MULTIPROCESSOR"))
    if n < 1:
        raise RuntimeError(f"a block of {threads} threads, {num_regs} registers and {per_block} bytes of shared "
                           "memory does not fit one SM of this device")
    return n


def get_function(pass_: str, defs: Dict[str, int], name: str, smem: int = 0):
    """The CUfunction ``name`` of a variant, its dynamic shared-memory limit raised to ``smem``."""
    from . import _driver

    mod = get_module(pass_, defs)
    known = name in mod._functions
    fn = mod.function(name)
    if known:
        return fn
    if smem > 48 * 1024:
        limit = _driver.device_attribute(_driver.context_device(context_key()),
                                         "MAX_SHARED_MEMORY_PER_BLOCK_OPTIN")
        if smem > limit:
            raise RuntimeError(
                f"{name} (head dim bucket {defs.get('HEAD_DIM')}) needs {smem} bytes of shared "
                f"memory; this device allows {limit} per block"
            )
        _driver.set_function_attribute(fn, "MAX_DYNAMIC_SHARED_SIZE_BYTES", smem)
    if smem > 0:
        # Ask for the largest shared-memory carveout, so that as many blocks as
        # the registers allow also fit by shared memory.
        _driver.set_function_attribute(fn, "PREFERRED_SHARED_MEMORY_CARVEOUT", 100)
    return fn


# ------------------------------------------------------------ offline build


@dataclass
class OfflineResult:
    """Outcome of one offline nvcc build of a variant."""

    pass_: str
    defines: Dict[str, int]
    arch: str
    ok: bool
    log: str
    registers: Dict[str, int]
    spills: Dict[str, Tuple[int, int]]  # kernel -> (spill stores, spill loads) bytes
    stack: Dict[str, int]
    image: bytes = b""  # the cubin (empty where nvcc failed)


_FUNC_RE = re.compile(r"Compiling entry function '(\w+)'")
_SPILL_RE = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REG_RE = re.compile(r"Used (\d+) registers")


def parse_ptxas(log: str) -> Tuple[Dict[str, int], Dict[str, Tuple[int, int]], Dict[str, int]]:
    """Registers, spills and stack frame per kernel from ``-Xptxas -v`` output."""
    regs: Dict[str, int] = {}
    spills: Dict[str, Tuple[int, int]] = {}
    stack: Dict[str, int] = {}
    current = None
    for line in log.splitlines():
        m = _FUNC_RE.search(line)
        if m:
            current = m.group(1)
            continue
        if current is None:
            continue
        m = _SPILL_RE.search(line)
        if m:
            stack[current] = int(m.group(1))
            spills[current] = (int(m.group(2)), int(m.group(3)))
        m = _REG_RE.search(line)
        if m:
            regs[current] = int(m.group(1))
    return regs, spills, stack


def compile_offline(pass_: str, defs: Dict[str, int], arch: str, nvcc: str = "nvcc") -> OfflineResult:
    """Build a variant to a cubin with nvcc alone (same source and options as at run time)."""
    src = variant_source(pass_, defs)
    arch = build_arch(pass_, arch)
    digest = hashlib.sha1((src + repr(sorted(defs.items())) + arch).encode()).hexdigest()[:12]
    with tempfile.TemporaryDirectory(prefix="pycudaflash-") as tmp:
        cu = Path(tmp) / f"kernel_{digest}.cu"
        cu.write_text(src)
        cmd = [nvcc, "--cubin", *options(defs), "-arch", arch, "-Xptxas", "-v", str(cu), "-o",
               str(Path(tmp) / "kernel.cubin")]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        image = (Path(tmp) / "kernel.cubin").read_bytes() if proc.returncode == 0 else b""
    log = proc.stdout + proc.stderr
    regs, spills, stack = parse_ptxas(log)
    return OfflineResult(pass_, dict(defs), arch, proc.returncode == 0, log, regs, spills, stack, image)


def warm_cache(arch: Optional[str] = None, jobs: int = 8, variants=None,
               progress: Optional[Callable[[int, int, str, Dict[str, int], float], None]] = None
               ) -> List[Tuple[str, Dict[str, int], float]]:
    """Compile variants into PyCUDA's disk cache in parallel (nvcc processes).

    Returns ``(pass, defines, seconds)`` for each, in the order given.  Later
    ``get_module`` calls for these variants then only load the cached cubins.
    ``progress(done, total, pass, defines, seconds)`` is called as each one
    finishes.
    """
    import time
    from concurrent.futures import ThreadPoolExecutor, as_completed

    if arch is None:
        arch = arch_of_current_device()
    todo = list(variants if variants is not None else all_variants(arch=arch))

    def build(item):
        pass_, defs = item
        t0 = time.perf_counter()
        cubin(pass_, defs, arch)
        return pass_, defs, time.perf_counter() - t0

    results: Dict[int, Tuple[str, Dict[str, int], float]] = {}
    with ThreadPoolExecutor(max_workers=max(1, jobs)) as pool:
        futures = {pool.submit(build, item): i for i, item in enumerate(todo)}
        for fut in as_completed(futures):
            results[futures[fut]] = res = fut.result()
            if progress is not None:
                progress(len(results), len(todo), *res)
    return [results[i] for i in range(len(todo))]