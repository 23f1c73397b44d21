"""Compilation of the kernels in ``cuda_src/`` and its caches.

This module is the only place that knows how a kernel variant is built:

* a *variant* is one pass (``'fwd'`` or ``'bwd'``) plus its ``-D`` defines
  (head-dim bucket, mask mode, tile sizes);
* its source is ``flash_common.cuh`` pasted in front of the pass's ``.cu``
  file (no ``#include``, so PyCUDA's disk cache is keyed on the plain text);
* it is compiled by PyCUDA's ``SourceModule`` with ``no_extern_c=True`` for the
  current device's architecture, cached on disk by PyCUDA (``cache_dir()``)
  and in memory per (context, variant) on top of that.

:func:`compile_offline` runs the same compilation through ``nvcc`` alone (no
GPU needed) and reports registers and spills; the test suite uses it to
build every variant the library can request.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Tuple

PASSES = {"fwd": "flash_fwd.cu", "bwd": "flash_bwd.cu"}
COMMON = "flash_common.cuh"
#: Head dims are padded up to one of these (kernels specialise on the bucket).
HEAD_DIM_BUCKETS = (32, 64, 128, 256)
#: Dense mask kinds -> MASK_MODE define.
MASK_MODES = {"none": 0, "bool": 1, "float": 2}
#: Options for every kernel (the architecture is added per device).
NVCC_OPTIONS = ("-O3", "-std=c++17")

FWD_WARPS = 4
BWD_WARPS = 8
DQ_WARPS = 4
SMEM_PAD = 4  # floats of padding per shared-memory row (see flash_common.cuh)
FLOAT_BYTES = 4


def kernel_dir() -> Path:
    """Folder holding the ``.cu`` sources (in the package, or the source tree)."""
    here = Path(__file__).resolve().parent
    for cand in (here / "cuda_src", here.parent / "cuda_src"):
        if (cand / COMMON).is_file():
            return cand
    raise FileNotFoundError(f"cuda_src/{COMMON} not found next to {here}")


def head_dim_bucket(d: int) -> int:
    """Smallest bucket that holds head dim ``d`` (1 <= d <= 256)."""
    for bucket in HEAD_DIM_BUCKETS:
        if d <= bucket:
            return bucket
    raise ValueError(f"head dim {d} exceeds the largest supported ({HEAD_DIM_BUCKETS[-1]})")


@dataclass(frozen=True)
class Tiles:
    """Tile sizes of one head-dim bucket (rows of Q / keys of K per block)."""

    fwd_br: int
    fwd_bc: int
    bwd_br: int
    bwd_bc: int
    dq_br: int
    dq_bc: int


def tiles(head_dim: int) -> Tiles:
    """Tile sizes for a head-dim bucket; the kernels' defaults match these.

    ``$PYCUDAFLASH_TILES`` overrides them for tuning experiments, e.g.
    ``"128:fwd_bc=32,bwd_br=32;64:fwd_bc=128"``.
    """
    big = head_dim > 128
    small = head_dim <= 64
    sizes = dict(
        fwd_br=16 * FWD_WARPS,
        fwd_bc=32 if big else 64,
        bwd_br=32 if (big or small) else 64,
        bwd_bc=32 if big else 64,
        dq_br=16 * DQ_WARPS,
        dq_bc=32 if big else 64,
    )
    sizes.update(_tile_overrides().get(head_dim, {}))
    return Tiles(**sizes)


def _tile_overrides() -> Dict[int, Dict[str, int]]:
    spec = os.environ.get("PYCUDAFLASH_TILES", "").strip()
    out: Dict[int, Dict[str, int]] = {}
    for part in filter(None, (p.strip() for p in spec.split(";"))):
        hd, _, items = part.partition(":")
        for item in filter(None, (i.strip() for i in items.split(","))):
            key, _, val = item.partition("=")
            if key not in Tiles.__dataclass_fields__ or key in ("fwd_br", "dq_br"):
                raise ValueError(f"PYCUDAFLASH_TILES: unknown or fixed tile size {key!r}")
            out.setdefault(int(hd), {})[key] = int(val)
    return out


def smem_bytes(kernel: str, head_dim: int) -> int:
    """Dynamic shared memory of a kernel, mirroring the layout in its .cu file."""
    t = tiles(head_dim)
    ld = head_dim + SMEM_PAD
    if kernel == "flash_fwd_kernel":
        floats = (t.fwd_br + 2 * t.fwd_bc) * ld
    elif kernel == "flash_bwd_dkdv_kernel":
        floats = (2 * t.bwd_bc + 2 * t.bwd_br) * ld + 2 * t.bwd_br * (t.bwd_bc + SMEM_PAD) + 2 * t.bwd_br
    elif kernel == "flash_bwd_dq_kernel":
        floats = (2 * t.dq_br + 2 * t.dq_bc) * ld
    else:
        floats = 0
    return floats * FLOAT_BYTES


def defines(pass_: str, head_dim: int, mask_kind: str) -> Dict[str, int]:
    """The ``-D`` defines of one variant."""
    if pass_ not in PASSES:
        raise ValueError(f"unknown pass {pass_!r}")
    if head_dim not in HEAD_DIM_BUCKETS:
        raise ValueError(f"head dim {head_dim} is not a bucket {HEAD_DIM_BUCKETS}")
    t = tiles(head_dim)
    out = {"HEAD_DIM": head_dim, "MASK_MODE": MASK_MODES[mask_kind]}
    if pass_ == "fwd":
        out["BC"] = t.fwd_bc
    else:
        out.update(BWD_BR=t.bwd_br, BWD_BC=t.bwd_bc, DQ_BC=t.dq_bc)
    return out


def all_variants() -> Iterator[Tuple[str, Dict[str, int]]]:
    """Every (pass, defines) the library can request."""
    for pass_ in PASSES:
        for hd in HEAD_DIM_BUCKETS:
            for mk in MASK_MODES:
                yield pass_, defines(pass_, hd, mk)


@functools.lru_cache(maxsize=None)
def source(pass_: str) -> str:
    """Full source text of a pass: the common header, then the pass."""
    kdir = kernel_dir()
    common = (kdir / COMMON).read_text()
    body = (kdir / PASSES[pass_]).read_text()
    return f'#line 1 "{COMMON}"\n{common}\n#line 1 "{PASSES[pass_]}"\n{body}'


def options(defs: Dict[str, int]) -> List[str]:
    """nvcc options of a variant (without the architecture)."""
    return list(NVCC_OPTIONS) + [f"-D{k}={v}" for k, v in sorted(defs.items())]


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
_functions: Dict[tuple, object] = {}
compiled_variants: List[Tuple[str, Tuple[Tuple[str, int], ...]]] = []


def _context_key() -> int:
    import pycuda.driver as drv

    ctx = drv.Context.get_current()
    if ctx is None:
        raise RuntimeError("no current CUDA context (call pycudaflash.cuda_backend.activate())")
    return int(ctx.handle)


def arch_of_current_device() -> str:
    import pycuda.driver as drv

    major, minor = drv.Context.get_device().compute_capability()
    return f"sm_{major}{minor}"


def get_module(pass_: str, defs: Dict[str, int]):
    """The compiled module of a variant in the current context (memoised)."""
    from pycuda.compiler import SourceModule

    key = (_context_key(), pass_, tuple(sorted(defs.items())))
    mod = _modules.get(key)
    if mod is not None:
        return mod
    with _lock:
        mod = _modules.get(key)
        if mod is None:
            mod = SourceModule(
                source(pass_),
                options=options(defs),
                arch=arch_of_current_device(),
                no_extern_c=True,
                cache_dir=_explicit_cache_dir(),
            )
            _modules[key] = mod
            compiled_variants.append((pass_, key[2]))
    return mod


def get_function(pass_: str, defs: Dict[str, int], name: str, arg_format: str, smem: int = 0):
    """A prepared kernel function with its dynamic shared memory limit raised to ``smem``."""
    import pycuda.driver as drv

    key = (_context_key(), pass_, tuple(sorted(defs.items())), name)
    fn = _functions.get(key)
    if fn is not None:
        return fn
    mod = get_module(pass_, defs)
    fn = mod.get_function(name)
    fn.prepare(arg_format)
    if smem > 48 * 1024:
        dev = drv.Context.get_device()
        limit = dev.get_attribute(drv.device_attribute.MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
        if smem > limit:
            raise RuntimeError(
                f"{name} (head dim bucket {defs.get('HEAD_DIM')}) needs {smem} bytes of shared "
                f"memory; this device allows {limit} per block"
            )
        fn.set_attribute(drv.function_attribute.MAX_DYNAMIC_SHARED_SIZE_BYTES, smem)
    _functions[key] = fn
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
    src = source(pass_)
    digest = hashlib.sha1((src + repr(sorted(defs.items())) + arch).encode()).hexdigest()[:12]
    with tempfile.TemporaryDirectory(prefix="pycudaflash-") as tmp:
        cu = Path(tmp) / f"kernel_{digest}.cu"
        cu.write_text(src)
        cmd = [nvcc, "--cubin", *options(defs), "-arch", arch, "-Xptxas", "-v", str(cu), "-o",
               str(Path(tmp) / "kernel.cubin")]
        proc = subprocess.run(cmd, capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    regs, spills, stack = parse_ptxas(log)
    return OfflineResult(pass_, dict(defs), arch, proc.returncode == 0, log, regs, spills, stack)


def warm_cache(arch: Optional[str] = None, jobs: int = 8, variants=None) -> List[Tuple[str, Dict[str, int], float]]:
    """Compile variants into PyCUDA's disk cache in parallel (nvcc processes).

    Returns ``(pass, defines, seconds)`` for each.  Later ``get_module`` calls
    for these variants then only load the cached cubins.
    """
    import time
    from concurrent.futures import ThreadPoolExecutor

    from pycuda.compiler import compile as pycuda_compile

    if arch is None:
        arch = arch_of_current_device()
    todo = list(variants if variants is not None else all_variants())

    def build(item):
        pass_, defs = item
        t0 = time.perf_counter()
        pycuda_compile(source(pass_), options=options(defs), arch=arch, no_extern_c=True,
                       cache_dir=_explicit_cache_dir())
        return pass_, defs, time.perf_counter() - t0

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(build, todo))
