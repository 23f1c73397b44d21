"""CUDA backend: launches the kernels of ``cuda_src/`` on any stream.

Everything here runs after validation.  A validated
:class:`~pycudaflash._problem.Problem` becomes a *plan* (:class:`ForwardPlan`,
:class:`BackwardPlan`): the kernels, grids, shared-memory sizes and packed
kernel parameters of one call signature, with only the device pointers left
to fill in.  A plan is built once per signature (``pycudaflash.api`` and
``pycudaflash.torch`` keep them) and then launched with fresh pointers on
any stream, which is all a repeated call costs.

Launches go through the driver (``pycudaflash._driver``, on NVIDIA's
``cuda-bindings``), so a call runs on whatever stream it is given: a pycuda,
torch or cupy stream or a raw handle.  A call runs in the current context
when it is on the arrays' device (torch and cupy bind the device's primary
context), else in the device's primary context, pushed for the call and
popped before it returns: no context is ever left pushed.

Memory: outputs the caller did not pass are allocated as the inputs' kind
(torch tensors through torch's caching allocator, cupy arrays through
cupy's, anything else as pycuda ``GPUArray``s from a memory pool).  A call's
workspace comes from torch's allocator on torch's current stream, else from
a stream-ordered pool of this library (``cuMemAllocFromPoolAsync``), so no
call synchronises the device except one that must return numpy arrays.
"""

from __future__ import annotations

import ctypes
import os
import struct
import sys
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import _driver, _tma, compiler
from ._validate import kernel_array, kernel_dtype
from .mods import kernel_code
from ._problem import Operand, Problem
from ._streams import default_stream, stream_handle
from .semantics import BAND_UNBOUNDED

MAX_GRID_YZ = 65535
#: Tile shapes of block maps one pass reads at most (the backward's dK/dV and dQ kernels).
MAX_MAP_SHAPES = 2
MAX_JOBS = 2**31 - 1 - 2**20  # job indices (int32) stay below 2**31 with a grid of up to 2**20 blocks
LOG2E = 1.4426950408889634
_ALIGN = 256  # alignment of each region of a workspace


# ------------------------------------------------------------------ context


def activate(device: Optional[int] = None):
    """Make the primary context of ``device`` current for PyCUDA on this thread; return it.

    The library itself needs no such call: each call makes its context
    current and pops it again.  This helper is for scripts that want PyCUDA
    objects (``GPUArray``, ``Stream``) in the context the library uses
    without ``pycuda.autoinit``.  ``device`` defaults to the device of the
    current context, else ``$PYCUDAFLASH_DEVICE`` or 0.  Undo it with
    :func:`deactivate` (also run at exit for the main thread).
    """
    import pycuda.driver as drv

    drv.init()
    if device is None:
        cur = _driver.current_context()
        device = (_driver.context_device(cur) if cur
                  else int(os.environ.get("PYCUDAFLASH_DEVICE", "0")))
    ctx = _pycuda_primary(device)
    current = drv.Context.get_current()
    if current is None or int(current.handle) != int(ctx.handle) or _driver.current_context() != int(ctx.handle):
        ctx.push()
        _state.pushed = getattr(_state, "pushed", 0) + 1
    return ctx


_state = threading.local()
_pycuda_primaries: Dict[int, Any] = {}


def _pycuda_primary(device: int):
    """PyCUDA's handle of the primary context of ``device`` (retained once)."""
    import atexit

    import pycuda.driver as drv

    ctx = _pycuda_primaries.get(device)
    if ctx is None:
        drv.init()
        ctx = _pycuda_primaries[device] = drv.Device(device).retain_primary_context()
        if len(_pycuda_primaries) == 1:
            atexit.register(deactivate)
    return ctx


def deactivate() -> None:
    """Pop the contexts :func:`activate` pushed on this thread."""
    import pycuda.driver as drv

    for _ in range(getattr(_state, "pushed", 0)):
        try:
            drv.Context.pop()
        except Exception:
            break
    _state.pushed = 0


def _device_hint(obj: Any) -> Optional[int]:
    """Device ordinal of a torch or cupy array (None for other kinds: the current context decides)."""
    dev = getattr(obj, "device", None)
    index = getattr(dev, "index", None)  # torch
    if isinstance(index, int):
        return index
    ident = getattr(dev, "id", None)  # cupy
    return ident if isinstance(ident, int) else None


# ------------------------------------------------------------ kernel launches


class _Ref:
    """A pointer parameter filled at launch: ``vals[src] + offset``."""

    __slots__ = ("src", "offset")

    def __init__(self, src: int, offset: int = 0) -> None:
        self.src, self.offset = src, offset


def _bits(code: str, value: Any) -> int:
    """The 64-bit slot holding one kernel parameter (little-endian, low bytes used)."""
    if code == "f":
        return struct.unpack("<I", struct.pack("<f", float(value)))[0]
    if code == "i":
        return int(value) & 0xFFFFFFFF
    return int(value) & 0xFFFFFFFFFFFFFFFF  # 'q' and 'P'


class _Pointers:
    """The pointer parameters of one plan's launches, in one ctypes array.

    Slots ``0 .. n-1`` hold the call's value slots (the plan's ``vals``);
    after them, one slot for each distinct ``vals[src] + offset`` that a
    kernel takes (a workspace region, ...).  Every kernel's pointer
    parameters point into this array, so a call writes each pointer once
    (:meth:`fill`) however many kernels read it.
    """

    CAPACITY = 32

    __slots__ = ("n", "array", "derived", "_slots")

    def __init__(self, n: int) -> None:
        self.n = n
        self.array = (ctypes.c_uint64 * self.CAPACITY)()
        self.derived: Tuple[Tuple[int, int, int], ...] = ()  # (slot, src, offset)
        self._slots: Dict[Tuple[int, int], int] = {}

    def address(self, ref: "_Ref") -> int:
        """Address of the slot holding ``ref``'s value (a new slot for a new offset)."""
        if not 0 <= ref.src < self.n:
            raise ValueError(f"pointer reference to value slot {ref.src} of {self.n}")
        slot = ref.src if ref.offset == 0 else self._slots.get((ref.src, ref.offset))
        if slot is None:
            slot = self.n + len(self.derived)
            if slot >= self.CAPACITY:
                raise ValueError(f"more than {self.CAPACITY} distinct pointer parameters")
            self._slots[(ref.src, ref.offset)] = slot
            self.derived += ((slot, ref.src, ref.offset),)
        return ctypes.addressof(self.array) + 8 * slot

    def fill(self, vals: Sequence[int]) -> None:
        """Write a call's values and the pointers derived from them."""
        a = self.array
        a[:self.n] = vals
        for slot, src, offset in self.derived:
            a[slot] = vals[src] + offset


#: Packing code (:func:`_bits`) of each C type a kernel's scalar parameters may have.
_SCALAR_CODES = {"i64": "q", "long long": "q", "int": "i", "u32": "i", "unsigned": "i", "float": "f"}


class _Kernel:
    """One kernel launch with its parameters packed once.

    ``params`` (:func:`pycudaflash.compiler.kernel_params`) names what the
    kernel takes: ``args`` gives each pointer and scalar parameter by name; the
    last parameter is the plan's struct ``struct``.  Each parameter has an
    8-byte slot (the driver copies each parameter's own size from its
    address); pointers given as :class:`_Ref` point into the plan's
    :class:`_Pointers` instead, written by each call, and the struct is passed
    from its own memory.  ``launch(stream)`` launches it.
    """

    __slots__ = ("name", "fn", "grid", "block", "smem", "slots", "addrs", "addr", "refs", "pointers", "struct",
                 "launch")

    def __init__(self, name: str, fn: Any, grid: Tuple[int, int, int], threads: int, smem: int,
                 params: "compiler.KernelParams", args: Dict[str, Any], pointers: _Pointers, struct: Any) -> None:
        names = params.pointers + tuple(n for n, _ in params.scalars)
        missing = [n for n in names if n not in args]
        unknown = [n for n in args if n not in names]
        if missing or unknown:
            raise ValueError(f"{name}: no value for parameters {missing}; {unknown} are no parameters of it")
        if type(struct).__name__ != params.struct.name or ctypes.sizeof(struct) != params.struct.size:
            raise ValueError(f"{name} takes struct {params.struct.name}, not {type(struct).__name__}")
        n = len(names) + 1
        self.name, self.fn, self.grid, self.block, self.smem = name, int(fn), grid, (threads, 1, 1), smem
        self.slots = (ctypes.c_uint64 * n)()
        base = ctypes.addressof(self.slots)
        self.addrs = (ctypes.c_void_p * n)(*[base + 8 * i for i in range(n)])
        self.addr = ctypes.addressof(self.addrs)
        refs = []
        for i, pname in enumerate(params.pointers):
            arg = args[pname]
            if isinstance(arg, _Ref):
                refs.append((i, arg.src, arg.offset))
                self.addrs[i] = pointers.address(arg)
            else:
                self.slots[i] = _bits("P", arg)
        for i, (sname, ctype) in enumerate(params.scalars, len(params.pointers)):
            if isinstance(args[sname], _Ref):
                raise ValueError(f"{name}: scalar parameter {sname!r} given a pointer reference")
            self.slots[i] = _bits(_SCALAR_CODES[ctype], args[sname])
        self.addrs[n - 1] = ctypes.addressof(struct)
        self.refs = tuple(refs)
        self.pointers, self.struct = pointers, struct  # (kept alive with the addresses into them)
        self.launch = _driver.Launch(self.fn, self.grid, self.block, self.smem, self.addr)


def _fill_struct(layout: "compiler.ParamStruct", fields: Dict[str, Any]) -> Any:
    """A new struct of ``layout`` with ``fields`` set by name (the others 0): a number for a
    scalar field, a mapping by name for a struct field, a sequence for an array field."""
    struct = layout.ctype()
    _set_fields(struct, fields, layout.name)
    return struct


def _set_fields(struct: Any, fields: Dict[str, Any], where: str) -> None:
    known = dict(struct._fields_)
    for name, value in fields.items():
        ctype = known.get(name)
        if ctype is None:
            raise ValueError(f"struct {where} has no field {name!r}")
        if issubclass(ctype, (ctypes.Structure, ctypes.Array)):
            _set_compound(getattr(struct, name), value, f"{where}.{name}")
        else:
            setattr(struct, name, _scalar(ctype, value, f"struct {where} field {name!r}"))


def _set_compound(target: Any, value: Any, where: str) -> None:
    """Fill a struct (from a mapping) or an array (from a sequence, possibly shorter) in place."""
    if isinstance(target, ctypes.Structure):
        if not isinstance(value, dict):
            raise TypeError(f"{where} is a struct: give a dict, not {value!r}")
        _set_fields(target, value, where)
        return
    if len(value) > len(target):
        raise ValueError(f"{where} holds {len(target)} elements, given {len(value)}")
    for k, x in enumerate(value):
        if isinstance(target[k], (ctypes.Structure, ctypes.Array)):
            _set_compound(target[k], x, f"{where}[{k}]")
        else:
            target[k] = _scalar(target._type_, x, f"{where}[{k}]")


def _scalar(ctype: Any, value: Any, where: str) -> Any:
    """``value`` checked for a scalar field of ctypes type ``ctype``."""
    if ctype is ctypes.c_float:
        return float(value)
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{where} ({ctype.__name__}) given {value!r}")
    if ctype(value).value != value:
        raise ValueError(f"{where} ({ctype.__name__}) cannot hold {value}")
    return value


# ------------------------------------------------------- per-stream device state

# Job counters of the persistent Hopper forward: two int32 per stream, zero
# between launches (the last block of a launch sets both back to zero).
# Launches on one stream run in order, so one pair per (context, stream)
# suffices; they come from slabs allocated once and never freed.
_COUNTER_SLAB = 1024
_counters: Dict[Tuple[int, int], int] = {}
_slabs: Dict[int, List[int]] = {}  # context -> [slab pointer, next free slot]
_counter_lock = threading.Lock()


def _job_counter(ctx: int, stream: int) -> int:
    """Device pointer of the job counter of ``stream`` in context ``ctx`` (made on first use)."""
    key = (ctx, stream)
    ptr = _counters.get(key)
    if ptr is None:
        with _counter_lock:
            ptr = _counters.get(key)
            if ptr is None:
                slab = _slabs.get(ctx)
                if slab is None or slab[1] == _COUNTER_SLAB:
                    if _driver.is_capturing(stream):
                        raise RuntimeError(
                            "the first call on a stream of a new context cannot be captured into a graph: "
                            "make one call on any stream of this device before capturing")
                    base = _driver.mem_alloc(8 * _COUNTER_SLAB)
                    _driver.memset_d32(base, 0, 2 * _COUNTER_SLAB)
                    slab = _slabs[ctx] = [base, 0]
                ptr = _counters[key] = slab[0] + 8 * slab[1]
                slab[1] += 1
    return ptr


def job_counters() -> Dict[Tuple[int, int], int]:
    """``{(context, stream): device pointer}`` of the job counters made so far."""
    return dict(_counters)


# ------------------------------------------------------------------ variants


def _kernel_dtype(prob: Problem) -> str:
    """Name of the problem's input dtype as the compiler knows it."""
    name = np.dtype(prob.dtype).name
    if name not in compiler.DTYPES:
        raise TypeError(f"no CUDA kernels for dtype {name}")
    return name


class _Variant:
    """The compiled variant a problem needs for one pass, on the current device.

    Made once per (context, pass kind, dtype, head-dim bucket, mask kind,
    grouping, tuning environment, modifiers' device code) and kept.
    ``mod_names``: the tensors its modifiers read, in their ``ModTensors`` slots.
    """

    def __init__(self, pass_: str, defs: Dict[str, Any], tiles: "compiler.Tiles", head_dim: int, dtype: str,
                 arch: str, mod_names: Tuple[str, ...] = ()) -> None:
        self.pass_, self.defs, self.tiles = pass_, defs, tiles
        self.head_dim, self.dtype, self.arch = head_dim, dtype, arch
        self.mod_names = mod_names
        self._defs_key = tuple(sorted(defs.items()))
        self._shapes: Dict[str, "compiler.KernelShape"] = {}
        self._map_tiles: Dict[str, Tuple[int, int]] = {}
        self._resident: Dict[str, int] = {}

    def shape(self, kernel: str) -> "compiler.KernelShape":
        """Threads, tile and dynamic shared memory of ``kernel``, as its source states them."""
        shape = self._shapes.get(kernel)
        if shape is None:
            shape = self._shapes[kernel] = compiler.kernel_shape(self.pass_, self.defs, kernel)
        return shape

    def map_tile(self, kernel: str) -> Tuple[int, int]:
        """The tiles (rows, keys) of ``kernel``'s block map of a bool mask."""
        tile = self._map_tiles.get(kernel)
        if tile is None:
            tile = self._map_tiles[kernel] = compiler.map_tile(self.pass_, self.defs, kernel)
        return tile

    def resident_blocks(self, kernel: str) -> int:
        """Blocks of ``kernel`` one SM holds at once."""
        n = self._resident.get(kernel)
        if n is None:
            shape = self.shape(kernel)
            n = self._resident[kernel] = compiler.resident_blocks(self.function(kernel), shape.threads, shape.smem)
        return n

    def params(self, kernel: str) -> "compiler.KernelParams":
        """The parameters of ``kernel``, read from its signature."""
        return compiler.kernel_params(self.pass_, kernel, self._defs_key)

    def function(self, kernel: str):
        """The kernel's CUfunction, its shared-memory limit raised to its shape's."""
        return compiler.get_function(self.pass_, self.defs, kernel, self.shape(kernel).smem)


_variants: Dict[Tuple, _Variant] = {}


def _variant(prob: Problem, kind: str, tma: bool = False) -> _Variant:
    """Pass, defines and tiles of ``kind`` ('fwd' or 'bwd') for ``prob`` (memoised); with ``tma``
    the TMA version of the pass (:data:`compiler.TMA_PASSES`).  A spill-checked pass
    (:func:`compiler.spill_checked`) is compiled first and kept only where its local memory
    fits ``Tiles.bwd90_mods``; else the mma.sync pass serves.  The Hopper forward with modifiers
    takes its wide variant (``Tiles.fwd90_mods_wide`` keys a step) where that compiles with no
    local memory."""
    dt = _kernel_dtype(prob)
    env = tuple(os.environ.get(name) for name in compiler.TUNING_ENV)
    groups = prob.kv_heads != prob.H
    names, code = ((), None) if prob.plain else kernel_code(prob.score_mod, prob.mask_mod)
    key = (compiler.context_key(), kind, dt, compiler.head_dim_bucket(prob.D, dt), prob.mask_kind, groups, env, code,
           tma)
    var = _variants.get(key)
    if var is None:
        arch = compiler.arch_of_current_device()
        hd = key[3]
        pass_ = compiler.pass_name(kind, dt, arch, hd, prob.mask_kind, mods=not prob.plain)
        if tma:
            pass_ = compiler.TMA_PASSES[pass_]
        make = lambda p, wide=False: _Variant(p, compiler.defines(p, hd, prob.mask_kind, dt, arch, groups=groups,
                                                                  mods=(prob.score_mod, prob.mask_mod), wide=wide),
                                              compiler.tiles(hd, dt, arch), hd, dt, arch, names)
        var = make(pass_)
        checked = compiler.spill_checked(pass_, hd, not prob.plain)
        if checked and _local_bytes(var, SPILL_KERNEL) > var.tiles.bwd90_mods:
            # (this expression's code spills the Hopper backward's registers: mma.sync serves)
            var = make(compiler.pass_name(kind, dt, arch, hd, prob.mask_kind, hopper=False, mods=True))
        if kind == "fwd" and not prob.plain:
            wide = make(pass_, wide=True)
            if wide.defs["BC"] != var.defs["BC"] and _local_bytes(wide, "flash_fwd_kernel") == 0:
                var = wide  # (the expression fits more keys a step without spilling)
        _variants[key] = var
    return var


#: The kernel of a spill-checked variant (compiler.spill_checked) whose local memory decides.
SPILL_KERNEL = "flash_bwd_dkdv_kernel"


def _local_bytes(var: _Variant, kernel: str) -> int:
    """Bytes of local memory (register spills) a thread of the variant's ``kernel`` has, as
    compiled (compiles the variant on first use)."""
    return _driver.function_attribute(var.function(kernel), "LOCAL_SIZE_BYTES")


def _sm_count() -> int:
    """Multiprocessors of the current context's device."""
    dev = _driver.context_device(compiler.context_key())
    return _driver.device_attribute(dev, "MULTIPROCESSOR_COUNT")


# ------------------------------------------------------------------ plans


def map_plane_bytes(tiles: int, Nk: int) -> int:
    """Bytes of one plane of a block map of ``tiles`` tiles (``map_plane_bytes`` in
    flash_common.cuh): a byte a tile, then from the next multiple of 4 the seen-key bits,
    a 32-bit word for every 32 keys."""
    return -(-tiles // 4) * 4 + 4 * -(-Nk // 32)


def _band(prob: Problem) -> Tuple[int, int]:
    lo = max(prob.band.lo_off, -BAND_UNBOUNDED)
    hi = min(prob.band.hi_off, BAND_UNBOUNDED)
    return lo, hi


def _check_grid(prob: Problem) -> None:
    if prob.B > MAX_GRID_YZ or prob.H > MAX_GRID_YZ:
        raise ValueError(f"B and H must each be <= {MAX_GRID_YZ} on the CUDA backend, got B={prob.B}, H={prob.H}")
    # The persistent Hopper forward numbers its jobs (query tiles of at least
    # 64 rows) with int32.
    jobs = prob.B * prob.H * -(-prob.Nq // 64)
    if jobs > MAX_JOBS:
        raise ValueError(f"B * H * ceil(Nq / 64) must be <= {MAX_JOBS} on the CUDA backend, got {jobs}")


def _three(strides) -> Tuple[int, int, int]:
    return int(strides[0]), int(strides[1]), int(strides[2])


def c_strides(shape: Sequence[int]) -> Tuple[int, ...]:
    """Element strides of a C-contiguous array of ``shape``."""
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= int(n)
    return tuple(reversed(strides))


def _vec_ok(strides: Sequence[Sequence[int]], D: int, itemsize: int, aligned: bool) -> int:
    """16-byte loads are possible: D a whole number of 16 bytes, rows and bases 16-byte aligned
    (``strides``: the batch, head and row strides of each array)."""
    per16 = 16 // itemsize
    if D % per16 or not aligned:
        return 0
    return int(all(s % per16 == 0 for st in strides for s in st))


def _grid_stride_blocks(total: int, threads: int) -> int:
    """Blocks of a grid-stride kernel over ``total`` elements: one element a thread, at most 16
    blocks for each of an H100's 132 SMs (the kernel loops over the rest)."""
    return max(1, min(-(-total // threads), 132 * 16))


class _Workspace:
    """Byte offsets of the regions of one call's workspace (each 256-byte aligned)."""

    def __init__(self) -> None:
        self.nbytes = 0

    def region(self, nbytes: int) -> int:
        off = self.nbytes
        self.nbytes += -(-max(int(nbytes), 1) // _ALIGN) * _ALIGN
        return off


def _mask_plan(prob: Problem, ws: _Workspace, mask_strides: Tuple[int, ...],
               plan: "_Plan") -> Tuple[Any, Tuple[int, ...], Dict[str, Any], Optional[Dict[str, Any]]]:
    """The mask pointer a pass reads, its strides, the struct fields of the mask, and the pointers
    of the conversion launch that a 16-bit float mask needs (reading ``plan``'s mask and workspace
    value slots; None without one).

    A device float mask stored in the inputs' 16-bit type is converted into
    a compact float32 copy in the workspace (size 1 on broadcast dims).
    """
    m = prob.mask
    if m is None:
        return 0, (0, 0, 0, 0), {}, None
    src, ws_src = plan.M, plan.WS
    if m.dtype.kind == "b" or m.dtype == np.float32:
        return _Ref(src), mask_strides, {}, None
    dims = tuple(1 if st == 0 else n for n, st in zip(m.shape, mask_strides))
    total = int(np.prod(dims))
    off = ws.region(4 * total)
    fields = dict(zip(("src_sb", "src_sh", "src_sq", "src_sk"), mask_strides),
                  mask_n1=dims[1], mask_n2=dims[2], mask_n3=dims[3], mask_total=total)
    cs = c_strides(dims)
    return (_Ref(ws_src, off), tuple(0 if st == 0 else c for st, c in zip(mask_strides, cs)), fields,
            dict(mask_src=_Ref(src), mask=_Ref(ws_src, off)))


def _strides(prefix: str, strides: Sequence[int]) -> Dict[str, int]:
    """Struct fields ``<prefix>_sb, _sh, _sn``: the batch, head and row strides of an array."""
    sb, sh, sn = _three(strides)
    return {prefix + "_sb": sb, prefix + "_sh": sh, prefix + "_sn": sn}


# L2 share for the Kj, Vj of one job group of the persistent forward
_JOB_GROUP_BYTES = 16 << 20


class _Plan:
    """What every plan has: its kernels, workspace size and launch lock."""

    kernels: List[_Kernel]
    pointers: _Pointers  # the pointer parameters of every kernel
    ws_bytes: int
    kl_offset: int  # workspace offset of host key lengths (-1: none)
    dims: Tuple[int, int, int, int, int]  # B, H, Nq, Nk, D
    counter: bool
    L: int  # value slot of lse
    OUTPUTS: Tuple[int, ...]  # value slots of the outputs
    OUTPUT_NAMES: str  # (for messages)
    shapes: Tuple[Tuple[int, ...], ...]  # shapes of the outputs
    out_dtypes: Tuple[np.dtype, ...]  # dtypes of the outputs
    dtype: np.dtype  # dtype of the inputs
    MOD0: int  # value slot of the first modifier tensor (after the pass's own slots)
    mod_names: Tuple[str, ...]  # the modifiers' tensors, in their slots
    mod_offsets: Tuple[int, ...]  # workspace offset of each one given on the host (-1: on the device)
    MAP0: int  # value slot of the first block map a BlockMap holds (after the modifiers' slots)
    # those maps: (builder, br, bc, planes_b, planes_h, band_lo, band_hi, bytes), in their slots
    map_specs: List[Tuple[Any, ...]]
    map_builders: List[Tuple[_Kernel, ...]]  # the launches that build each one
    tma_maps: Tuple[Any, ...] = ()  # tensor maps of q, k, v (pycudaflash._tma) the struct carries

    def _describe(self, prob: Problem, kind: str) -> None:
        self.shapes, self.dtype = _output_shapes(prob, kind), prob.dtype
        self.out_dtypes = tuple(np.dtype(np.float32) if i == self.L else prob.dtype for i in self.OUTPUTS)
        self.dims = (prob.B, prob.H, prob.Nq, prob.Nk, prob.D)

    def values(self, ptrs: Sequence[int]) -> List[int]:
        """The value slots of a launch: the operands' pointers (:data:`OPERANDS` order), then zeros for
        the key lengths, workspace, job counter and modifier tensors (set by :func:`execute`)."""
        return [*ptrs, *(0,) * (self.N_VALS - len(ptrs))]

    def _begin(self, prob: Problem, kind: str) -> "_Variant":
        """Start a plan of pass ``kind``: its lock, pointer table and sizes; its variant."""
        _check_grid(prob)
        var = _variant(prob, kind)
        self._lock = threading.Lock()
        self.mod_names, self.MOD0 = var.mod_names, self.N_VALS
        self.N_VALS = self.MOD0 + len(self.mod_names)
        # (a BlockMap's maps: one slot for each tile shape of the pass's kernels)
        self.MAP0, self.map_specs, self.map_builders = self.N_VALS, [], []
        self.N_VALS += MAX_MAP_SHAPES if prob.block_map is not None else 0
        self.pointers = _Pointers(self.N_VALS)
        self._sizes = dict(Nq=prob.Nq, Nk=prob.Nk, D=prob.D)
        self._describe(prob, kind)
        return var

    def _mod_fields(self, prob: Problem, ws: "_Workspace") -> Dict[str, Any]:
        """The struct fields of the modifiers' tensors (sizes and element strides; their data
        addresses are a call's, :meth:`launch`), and workspace room for those on the host."""
        if not self.mod_names:
            self.mod_offsets = ()
            return {}
        sizes, strides, offsets = [], [], []
        for name in self.mod_names:
            t = prob.mod_tensors[name]
            if isinstance(t, Operand):
                shape, st = t.shape, t.strides
                offsets.append(-1)
            else:
                shape, st = t.shape, c_strides(t.shape)
                offsets.append(ws.region(kernel_dtype(t.dtype).itemsize * int(np.prod(shape))))
            sizes.append(list(shape))
            strides.append(list(st))
        self.mod_offsets = tuple(offsets)
        return dict(mods=dict(size=sizes, stride=strides))

    def _struct(self, var: "_Variant", kernel: str, fields: Dict[str, Any]) -> None:
        """The plan's parameter struct (of ``kernel``'s type, which every kernel of the pass takes)."""
        self.struct = _fill_struct(var.params(kernel).struct, fields)
        self._mod_data = self.struct.mods.data if self.mod_names else None

    def _kernel(self, var: "_Variant", name: str, grid: Tuple[int, int, int], **pointers: Any) -> _Kernel:
        """Kernel ``name`` of the variant launched on ``grid``, its pointer parameters (and scalars
        other than the sizes) given by name, its sizes (Nq, Nk, D, those it takes) and the struct
        from the plan."""
        params = var.params(name)
        args = dict(pointers)
        for size, _ in params.scalars:
            if size in args:
                continue
            if size not in self._sizes:
                raise ValueError(f"{name}: scalar parameter {size!r} is none of {sorted(self._sizes)}")
            args[size] = self._sizes[size]
        shape = var.shape(name)
        return _Kernel(name, var.function(name), grid, shape.threads, shape.smem, params, args, self.pointers,
                       self.struct)

    def _tile_maps(self, prob: Problem, var: "_Variant", ws: "_Workspace", mask_ref: Any,
                   mask_strides: Tuple[int, ...], readers: Sequence[str]) -> Tuple[Dict[str, Any], List[_Kernel]]:
        """The block map that each kernel of ``readers`` takes (``tmap``: a workspace region, 0
        without one) and the launches that build them, one for each distinct tile shape: of a
        bool mask and the mask modifier together (``flash_tile_map``) or, without a bool
        mask, of the mask modifier (``flash_mod_tile_map``), after ``flash_clear_seen`` has
        cleared its seen-key bits.  A map has a plane per batch element and head, one for a
        dimension that the bool mask broadcasts over (a zero stride of ``mask_strides``, as
        the kernels read it) and the mask modifier does not read (``map_plane`` in
        flash_common.cuh: the kinds of its tiles, then the bits of the keys that some row may
        see under the mask and the band, :func:`map_plane_bytes`).  With a BlockMap the maps
        are its memory (value slots from MAP0, :attr:`map_specs`, whose band is part of the
        BlockMap's key) and their launches run only where it has not built them yet
        (:attr:`map_builders`, :func:`launch_plan`)."""
        refs: Dict[str, Any] = {name: 0 for name in readers}
        mod = prob.mask_mod
        per_b, per_h = (mod.reads("b"), mod.reads("h")) if mod is not None else (False, False)
        if prob.mask is not None and prob.mask.dtype.kind == "b":
            per_b, per_h = per_b or mask_strides[0] != 0, per_h or mask_strides[1] != 0
            builder, inputs = "flash_tile_map", dict(mask=mask_ref)
        elif mod is not None:
            builder, inputs = "flash_mod_tile_map", {}
        else:
            return refs, []
        planes_b, planes_h = (prob.B if per_b else 1), (prob.H if per_h else 1)
        built: Dict[Tuple[int, int], Any] = {}
        launches: List[_Kernel] = []
        for name in readers:
            br, bc = var.map_tile(name)
            if (br, bc) not in built:
                tiles = -(-prob.Nq // br) * -(-prob.Nk // bc)
                nbytes = map_plane_bytes(tiles, prob.Nk) * planes_h * planes_b
                if prob.block_map is not None:
                    if len(self.map_specs) == MAX_MAP_SHAPES:
                        raise ValueError(f"more than {MAX_MAP_SHAPES} block-map tile shapes in one pass")
                    ref = _Ref(self.MAP0 + len(self.map_specs))
                    self.map_specs.append((builder, br, bc, planes_b, planes_h, *_band(prob), nbytes))
                else:
                    ref = _Ref(self.WS, ws.region(nbytes))
                build = (self._kernel(var, "flash_clear_seen", (1, planes_h, planes_b), tmap=ref, tiles=tiles),
                         self._kernel(var, builder, (tiles, planes_h, planes_b), **inputs, tmap=ref, br=br, bc=bc))
                if prob.block_map is not None:
                    self.map_builders.append(build)
                else:
                    launches += build
                built[br, bc] = ref
            refs[name] = built[br, bc]
        return refs, launches

    def _finish(self, kernels: List[_Kernel], ws: "_Workspace", pass_: str) -> None:
        self.kernels = kernels
        self._launches = tuple(k.launch for k in kernels)
        self.ws_bytes = ws.nbytes
        self.pass_ = pass_

    def launch(self, vals: List[int], ctx: int, stream: int, builds: Sequence[int] = ()) -> None:
        """Launch every kernel with the pointers ``vals`` (workspace and key lengths already in place),
        first the builds of the BlockMap's maps ``builds`` (indices of :attr:`map_specs`)."""
        if self.counter:
            vals[self.CNT] = _job_counter(ctx, stream)
        with self._lock:  # (the pointer slots are the plan's: one call at a time)
            self.pointers.fill(vals)
            if self.tma_maps:
                self._set_maps(vals)
            if self._mod_data is not None:  # (the modifiers' tensors: addresses in the struct)
                self._mod_data[:len(self.mod_names)] = vals[self.MOD0:self.MOD0 + len(self.mod_names)]
            for k in builds:
                for build in self.map_builders[k]:
                    build.launch(stream)
            for launch in self._launches:
                launch(stream)

    def export(self, ctx: int, stream: int) -> List[int]:
        """The plan as int64 words for the C++ host path (``pycudaflash/csrc/torch_ops.cpp``, which
        documents the layout), its job counter that of ``stream``.  Plans with modifiers, whose
        struct holds a call's tensor addresses, and host key lengths stay with :meth:`launch`;
        tensor maps go with their encoding arguments, encoded there for each new address."""
        if self.mod_names or self.map_specs:
            raise ValueError("a plan with modifier tensors or a BlockMap's maps cannot be exported")
        counter = 0
        if self.counter:
            _, pushed = _driver.enter(_driver.context_device(ctx))
            try:
                counter = _job_counter(ctx, stream)
            finally:
                _driver.leave(pushed)
        raw = bytes(self.struct)
        raw += bytes(-len(raw) % 8)
        struct_words = list(struct.unpack(f"<{len(raw) // 8}q", raw))
        derived = self.pointers.derived
        words = [EXPORT_VERSION, ctx, self.N_VALS, self.KL, self.WS, self.CNT if self.counter else -1, counter,
                 self.ws_bytes, len(derived), len(struct_words), len(self.kernels), len(self.tma_maps)]
        for triple in derived:
            words += triple
        words += struct_words
        for name, tm, slot in zip(("q_map", "k_map", "v_map"), self.tma_maps, (self.Q, self.K, self.V)):
            args = _tma.encode_args(tm)
            words += [getattr(type(self.struct), name).offset // 8, slot, len(args), *args]
        base = ctypes.addressof(self.pointers.array)
        for k in self.kernels:
            n = len(k.addrs)
            words += [k.fn, *k.grid, *k.block, k.smem, n]
            refs = {i for i, _, _ in k.refs}
            for i in range(n):
                if i in refs:
                    words += [(k.addrs[i] - base) // 8, 0]
                elif i == n - 1:
                    words += [EXPORT_STRUCT, 0]
                else:
                    words += [EXPORT_VALUE, k.slots[i]]
        return [w - (1 << 64) if w >= 1 << 63 else w for w in words]


#: Version of the layout :meth:`_Plan.export` writes, and its codes of a kernel's struct parameter
#: and of a parameter passed by value.
EXPORT_VERSION, EXPORT_STRUCT, EXPORT_VALUE = 2, -1, -2


class ForwardPlan(_Plan):
    """The forward launches of one call signature.

    ``vals`` order (:meth:`launch`): q, k, v, out, lse, mask, key lengths,
    workspace, job counter, the modifiers' tensors.
    """

    Q, K, V, O, L, M, KL, WS, CNT = range(9)
    N_VALS = 9
    OUTPUTS = (O, L)
    OUTPUT_NAMES = "out= and lse="

    def __init__(self, prob: Problem, strides: Dict[str, Tuple[int, ...]], aligned: bool) -> None:
        var = self._begin(prob, "fwd")
        self.tma_maps = self._tma_maps(prob, var, strides, aligned)
        if self.tma_maps:
            var = _variant(prob, "fwd", tma=True)
        B, H, Nq, D = prob.B, prob.H, prob.Nq, prob.D
        ws = _Workspace()
        self.kl_offset = ws.region(4 * B) if prob.key_lengths is not None else -1
        mask_ref, mask_strides, mask_fields, conv = _mask_plan(prob, ws, strides.get("mask", (0, 0, 0, 0)), self)
        itemsize = np.dtype(prob.dtype).itemsize
        # 16-bit outputs are stored in aligned pairs under the same condition.
        names = ("q", "k", "v") if itemsize == 4 else ("q", "k", "v", "out")
        lo, hi = _band(prob)
        fields = dict(
            **_strides("q", strides["q"]), **_strides("k", strides["k"]), **_strides("v", strides["v"]),
            **_strides("o", strides["out"]), **_strides("l", strides["lse"]),
            **dict(zip(("m_sb", "m_sh", "m_sq", "m_sk"), mask_strides)), **mask_fields,
            **self._mod_fields(prob, ws), scale_log2=prob.scale * LOG2E, scale=prob.scale, band_lo=lo, band_hi=hi,
            vec=_vec_ok([_three(strides[n]) for n in names], D, itemsize, aligned),
            H=H, kv_group=H // prob.kv_heads)
        shape = var.shape("flash_fwd_kernel")
        grid = ((Nq + shape.tile - 1) // shape.tile, H, B)
        pointers = dict(Q=_Ref(self.Q), K=_Ref(self.K), V=_Ref(self.V), O=_Ref(self.O), LSE=_Ref(self.L),
                        mask=mask_ref, key_lengths=_Ref(self.KL))  # (key lengths 0: none)
        if self.tma_maps:  # (q, k and v reach the TMA forward through their maps)
            for name in ("Q", "K", "V"):
                del pointers[name]
            self._tma_key: Optional[Tuple[int, int, int]] = None
        self.counter = False
        if var.pass_ == "fwd_sm90":
            # Jobs: query tiles of every (batch, head).  Persistent blocks take
            # them from the job counter; otherwise one block each.
            fields["n_jobs"] = jobs = grid[0] * H * B
            pointers["sched"] = 0
            if var.defs["FWD_PERSIST"]:  # (_check_grid bounds the jobs)
                self.counter = True
                pointers["sched"] = _Ref(self.CNT)
                fields["group_shift"] = _job_group_shift(prob, var.tiles.fwd90_group, itemsize)
                grid = (min(jobs, var.resident_blocks("flash_fwd_kernel") * _sm_count()), 1, 1)
        self._struct(var, "flash_fwd_kernel", fields)
        maps, kernels = self._tile_maps(prob, var, ws, mask_ref, mask_strides, ("flash_fwd_kernel",))
        if conv is not None:
            blocks = _grid_stride_blocks(fields["mask_total"], var.shape("flash_convert_mask").threads)
            kernels.append(self._kernel(var, "flash_convert_mask", (blocks, 1, 1), **conv))
        kernels.append(self._kernel(var, "flash_fwd_kernel", grid, **pointers, tmap=maps["flash_fwd_kernel"]))
        self._finish(kernels, ws, var.pass_)


    @staticmethod
    def _tma_maps(prob: Problem, var: _Variant, strides: Dict[str, Tuple[int, ...]], aligned: bool) -> Tuple[Any, ...]:
        """The tensor maps of q, k and v where the TMA forward serves the call (a pass with a TMA
        version, tile sizes that say ``fwd90_tma``, 16-byte aligned operands that maps can
        describe: :func:`pycudaflash._tma.tma_reason`); () where it does not."""
        if var.pass_ not in compiler.TMA_PASSES or not var.tiles.fwd90_tma or not aligned:
            return ()
        tvar = _variant(prob, "fwd", tma=True)
        br, bc = tvar.shape("flash_fwd_kernel").tile, int(tvar.defs["BC"])
        dt = _kernel_dtype(prob)
        kv = (prob.B, prob.kv_heads, prob.Nk, prob.D)
        ops = (((prob.B, prob.H, prob.Nq, prob.D), strides["q"], br), (kv, strides["k"], bc), (kv, strides["v"], bc))
        if any(_tma.tma_reason(shape, st, dt, rows) is not None for shape, st, rows in ops):
            return ()
        return tuple(_tma.tile_map(shape, st, dt, rows) for shape, st, rows in ops)

    def _set_maps(self, vals: Sequence[int]) -> None:
        """The struct's q_map, k_map and v_map for the call's q, k and v (encoded again only when
        those addresses change; a launch copies the struct, so a captured graph keeps them)."""
        key = (int(vals[self.Q]), int(vals[self.K]), int(vals[self.V]))
        if key == self._tma_key:
            return
        base = ctypes.addressof(self.struct)
        for name, tm, ptr in zip(("q_map", "k_map", "v_map"), self.tma_maps, key):
            raw = _tma.encode(tm, ptr)
            ctypes.memmove(base + getattr(type(self.struct), name).offset, raw, len(raw))
        self._tma_key = key

def _job_group_shift(prob: Problem, fixed: int, itemsize: int) -> int:
    """log2 of the (batch, head) pairs per group of the persistent forward's job order.

    Where a causal or window band makes the query tiles of a head unequal,
    a group holds as many heads as have their Kj, Vj in ``_JOB_GROUP_BYTES``
    (a power of two that divides B * H; ``fixed`` > 0 asks for at most that
    many), so that the job list ends on short tiles, longest first.  With
    jobs of equal length (or lengths set by key lengths, which tile rank
    does not order) one head per group keeps its tiles together.
    """
    lo, hi = _band(prob)
    if fixed <= 0 and lo <= 1 - prob.Nq and hi >= prob.Nk - 1:  # every query row sees every key
        return 0
    bh = prob.B * prob.H
    want = fixed if fixed > 0 else _JOB_GROUP_BYTES // (2 * prob.Nk * prob.D * itemsize)
    heads = min(want, bh & -bh)  # (bh & -bh: the largest power of two dividing bh)
    return max(heads, 1).bit_length() - 1


class BackwardPlan(_Plan):
    """The backward launches of one call signature.

    ``vals`` order (:meth:`launch`): q, k, v, out, dout, lse, dq, dk, dv,
    mask, key lengths, workspace, the modifiers' tensors.
    """

    Q, K, V, O, DO, L, DQ, DK, DV, M, KL, WS = range(12)
    CNT = -1
    N_VALS = 12
    OUTPUTS = (DQ, DK, DV)
    OUTPUT_NAMES = "dq=, dk= and dv="

    def __init__(self, prob: Problem, strides: Dict[str, Tuple[int, ...]], aligned: bool) -> None:
        var = self._begin(prob, "bwd")
        self.counter = False
        B, H, Nq, Nk, D = prob.B, prob.H, prob.Nq, prob.Nk, prob.D
        rows = B * H * Nq
        # Workspace: Di, Li*log2e (B*H*Nq each), key lengths, dQ accumulator, converted mask,
        # and with grouped K/V heads the per-query-head dK, dV (B, H, Nk, D) that step 4 sums.
        Hkv = prob.kv_heads
        group = H // Hkv
        ws = _Workspace()
        d_ref, l2_ref = _Ref(self.WS, ws.region(4 * rows)), _Ref(self.WS, ws.region(4 * rows))
        self.kl_offset = ws.region(4 * B) if prob.key_lengths is not None else -1
        dqacc = 0 if prob.deterministic else _Ref(self.WS, ws.region(4 * rows * D))
        mask_ref, mask_strides, mask_fields, conv = _mask_plan(prob, ws, strides.get("mask", (0, 0, 0, 0)), self)
        itemsize = np.dtype(prob.dtype).itemsize
        st = {n: _three(strides[n]) for n in ("q", "k", "v", "out", "dout", "lse", "dq", "dk", "dv")}
        dk_ref, dv_ref = _Ref(self.DK), _Ref(self.DV)
        if group > 1:  # (the dK/dV kernel writes per query head into the workspace)
            dk_ref = _Ref(self.WS, ws.region(itemsize * B * H * Nk * D))
            dv_ref = _Ref(self.WS, ws.region(itemsize * B * H * Nk * D))
            st["dkh"] = st["dvh"] = _three(c_strides((B, H, Nk, D)))
        else:
            st["dkh"], st["dvh"] = st["dk"], st["dv"]
        # 16-bit dK, dV (and deterministic dQ) are stored in aligned pairs under the same condition.
        names = ("q", "k", "v", "dout") if itemsize == 4 else ("q", "k", "v", "dout", "dq", "dkh", "dvh")
        lo, hi = _band(prob)
        self._struct(var, "flash_bwd_dkdv_kernel", dict(
            **{f: x for n in ("q", "k", "v", "dq", "dkh", "dvh", "dk", "dv") for f, x in _strides(n, st[n]).items()},
            **_strides("do", st["dout"]), **_strides("o", st["out"]), **_strides("l", st["lse"]),
            **dict(zip(("m_sb", "m_sh", "m_sq", "m_sk"), mask_strides)), **mask_fields, **self._mod_fields(prob, ws),
            scale_log2=prob.scale * LOG2E, scale=prob.scale, band_lo=lo, band_hi=hi,
            vec=_vec_ok([st[n] for n in names], D, itemsize, aligned),
            rows_vec=_vec_ok([st["dout"], st["out"]], D, itemsize, aligned),
            dq_vec=_vec_ok([st["dq"]], D, itemsize, aligned),
            H=H, kv_group=group, Hkv=Hkv, total_rows=rows, kv_total=B * Hkv * Nk * D))
        q, k, v, do = _Ref(self.Q), _Ref(self.K), _Ref(self.V), _Ref(self.DO)
        readers = ("flash_bwd_dkdv_kernel",) + (("flash_bwd_dq_kernel",) if prob.deterministic else ())
        maps, kernels = self._tile_maps(prob, var, ws, mask_ref, mask_strides, readers)
        if conv is not None:
            blocks = _grid_stride_blocks(mask_fields["mask_total"], var.shape("flash_convert_mask").threads)
            kernels.append(self._kernel(var, "flash_convert_mask", (blocks, 1, 1), **conv))
        # 1. Di = rowsum(dO o O), Li*log2(e); the dQ accumulator zeroed.
        pre = var.shape("flash_bwd_preprocess").tile
        row_blocks = ((rows + pre - 1) // pre, 1, 1)
        kernels.append(self._kernel(var, "flash_bwd_preprocess", row_blocks, dO=do, O=_Ref(self.O),
                                    LSE=_Ref(self.L), Dvec=d_ref, L2vec=l2_ref, dQacc=dqacc))
        # 2. dK, dV (and dQ by atomics): one block per key tile, grid (H, B, key tiles).
        keys = var.shape("flash_bwd_dkdv_kernel").tile
        if -(-Nk // keys) > MAX_GRID_YZ:
            raise ValueError(f"Nk must be <= {MAX_GRID_YZ * keys} for this backward (key tiles of {keys}), "
                             f"got {Nk}")
        inputs = dict(Q=q, K=k, V=v, dO=do, Dvec=d_ref, L2vec=l2_ref, mask=mask_ref, key_lengths=_Ref(self.KL))
        kernels.append(self._kernel(var, "flash_bwd_dkdv_kernel", (H, B, (Nk + keys - 1) // keys), **inputs,
                                    tmap=maps["flash_bwd_dkdv_kernel"], dQacc=dqacc, dK=dk_ref, dV=dv_ref))
        # 3. dQ: deterministic kernel, or rounding of the accumulator.
        if prob.deterministic:
            br = var.shape("flash_bwd_dq_kernel").tile
            kernels.append(self._kernel(var, "flash_bwd_dq_kernel", ((Nq + br - 1) // br, H, B), **inputs,
                                        tmap=maps["flash_bwd_dq_kernel"], dQ=_Ref(self.DQ)))
        else:
            kernels.append(self._kernel(var, "flash_bwd_convert_dq", row_blocks, dQacc=dqacc, dQ=_Ref(self.DQ)))
        # 4. Grouped K/V heads: dK, dV of each K/V head, the sum over its group (a fixed order).
        if group > 1:
            blocks = _grid_stride_blocks(B * Hkv * Nk * D, var.shape("flash_bwd_sum_groups").threads)
            kernels.append(self._kernel(var, "flash_bwd_sum_groups", (blocks, 2, 1), dKh=dk_ref, dVh=dv_ref,
                                        dK=_Ref(self.DK), dV=_Ref(self.DV)))
        self._finish(kernels, ws, var.pass_)


# ------------------------------------------------------------ running a plan


def _torch_current(obj: Any, stream: int) -> Any:
    """torch, when ``obj`` is a torch tensor and ``stream`` is torch's current stream of its device
    (and not captured by :class:`pycudaflash.capture`, which torch's allocator does not know of)."""
    torch = sys.modules.get("torch")
    if torch is None or not isinstance(obj, torch.Tensor) or (_driver.capturing and stream in _driver.capturing):
        return None
    return torch if torch._C._cuda_getCurrentRawStream(obj.device.index) == stream else None


def execute(plan: _Plan, vals: List[int], ctx: int, device: int, stream: int, kl_host: Optional[np.ndarray],
            like: Any, workspace: int = 0, mod_values: Sequence[Any] = (), block_map: Any = None) -> None:
    """Run ``plan`` with ``vals`` on ``stream``: a workspace for the call, the key lengths, the
    modifiers' tensors (:func:`mod_values`), the BlockMap's maps, the launches.

    ``like`` is the first input: the workspace comes from torch's caching
    allocator when it is a torch tensor on torch's current stream (graph
    capture safe), else from this library's stream-ordered pool, unless the
    caller owns one (``workspace``, at least ``plan.ws_bytes``).
    """
    if plan.ws_bytes == 0 or workspace:
        launch_plan(plan, vals, ctx, stream, kl_host, workspace, mod_values, block_map)
        return
    torch = _torch_current(like, stream)
    if torch is not None:
        buf = like.new_empty((plan.ws_bytes,), dtype=torch.uint8)  # (freed after the launches, in stream order)
        launch_plan(plan, vals, ctx, stream, kl_host, buf.data_ptr(), mod_values, block_map)
        return
    base = _driver.alloc_async(plan.ws_bytes, device, stream)
    try:
        launch_plan(plan, vals, ctx, stream, kl_host, base, mod_values, block_map)
    finally:
        _driver.free_async(base, stream)


def launch_plan(plan: _Plan, vals: List[int], ctx: int, stream: int, kl_host: Optional[np.ndarray],
                workspace: int, mod_values: Sequence[Any] = (), block_map: Any = None) -> None:
    """Launch ``plan`` with ``workspace`` (at least ``plan.ws_bytes``; 0 when it needs none), host
    key lengths and host modifier tensors copied into it first, and the maps of ``block_map``
    (the plan's BlockMap, :mod:`pycudaflash.blockmap`): those it does not hold yet are built
    first, and the host waits for them once."""
    vals[plan.WS] = workspace
    if kl_host is not None and plan.kl_offset >= 0:
        dst = workspace + plan.kl_offset
        _driver.memcpy_htod_async(dst, kl_host.ctypes.data, kl_host.nbytes, stream)
        vals[plan.KL] = dst
    if len(mod_values) != len(plan.mod_names):
        raise ValueError(f"the plan's modifiers read {len(plan.mod_names)} tensors, given {len(mod_values)}")
    for k, (value, off) in enumerate(zip(mod_values, plan.mod_offsets)):
        if isinstance(value, np.ndarray):
            if _driver.is_capturing(stream):
                raise ValueError("mod_tensors given on the host cannot be captured into a graph: pass them as "
                                 "device arrays")
            value, dst = np.ascontiguousarray(value), workspace + off
            _driver.memcpy_htod_async(dst, value.ctypes.data, value.nbytes, stream)
        else:
            dst = int(value)
        vals[plan.MOD0 + k] = dst
    if not plan.map_specs:
        plan.launch(vals, ctx, stream)
        return
    if block_map is None:
        raise ValueError("this call was planned with a block_map and is given none")

    def alloc(nbytes: int) -> int:
        # (checked before the allocation, which would end a capture)
        if _driver.is_capturing(stream):
            raise ValueError("a BlockMap's maps cannot be built during graph capture: run the call once "
                             "before capturing it")
        return _driver.mem_alloc(nbytes)

    builds, keys = [], []
    try:
        for k, spec in enumerate(plan.map_specs):
            key = (ctx, *spec, *plan.dims[2:4])
            ptr, fresh = block_map.address(key, spec[-1], alloc)
            vals[plan.MAP0 + k] = ptr
            if fresh:
                builds.append(k)
                keys.append(key)
        plan.launch(vals, ctx, stream, builds)
        if builds:  # (once built, calls on any stream may read them)
            _driver.synchronize(stream)
    except BaseException:
        for key in keys:
            block_map.forget(key)
        raise


def mod_values(plan: _Plan, tensors: Optional[Dict[str, Any]]) -> List[Any]:
    """A call's modifier tensors in ``plan``'s slots: device addresses (of device operands), or host
    arrays in the kernels' element types (copied into the workspace at launch)."""
    out: List[Any] = []
    for name in plan.mod_names:
        t = (tensors or {})[name]
        out.append(t.ptr if isinstance(t, Operand) else kernel_array(name, t))
    return out


def empty_like_input(like: Any, shape: Tuple[int, ...], dtype: np.dtype, device: int, stream: int) -> Any:
    """A new device array of ``like``'s kind: torch, cupy, or else a pycuda GPUArray."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(like, torch.Tensor):
        out = torch.empty(shape, dtype=_torch_dtype(torch, dtype), device=like.device)
        if torch._C._cuda_getCurrentRawStream(like.device.index) != stream:
            out.record_stream(torch.cuda.ExternalStream(stream, device=like.device))
        return out
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(like, cupy.ndarray):
        with cupy.cuda.Device(device):
            return cupy.empty(shape, dtype=dtype)
    return _pycuda_empty(shape, dtype, device)


def device_copy_like(like: Any, host: np.ndarray, device: int) -> Any:
    """A device copy of a small host array, of ``like``'s kind (it owns its memory)."""
    out = empty_like_input(like, host.shape, host.dtype, device, 0)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(out, torch.Tensor):
        out.copy_(torch.from_numpy(host))
    else:
        _driver.check("cuMemcpyHtoD", _ptr(out), host.ctypes.data, host.nbytes)
    return out


def _torch_dtype(torch: Any, dtype: np.dtype) -> Any:
    return getattr(torch, np.dtype(dtype).name)


_pycuda_pools: Dict[int, Any] = {}


def _pycuda_empty(shape: Tuple[int, ...], dtype: np.dtype, device: int) -> Any:
    """A pycuda ``GPUArray`` from a memory pool of the device's primary context."""
    import pycuda.driver as drv
    import pycuda.gpuarray as gpuarray
    import pycuda.tools

    ctx = _pycuda_primary(device)
    cur = drv.Context.get_current()
    pushed = cur is None or int(cur.handle) != _driver.current_context()
    if pushed:
        ctx.push()
    try:
        key = _driver.current_context()
        pool = _pycuda_pools.get(key)
        if pool is None:
            pool = _pycuda_pools[key] = pycuda.tools.DeviceMemoryPool()
        return gpuarray.GPUArray(shape, dtype, allocator=pool.allocate)
    finally:
        if pushed:
            drv.Context.pop()


def _plan_strides(prob: Problem, names: Sequence[str], out_shapes: Dict[str, Tuple[int, ...]]) -> Dict[str, Tuple]:
    """Element strides of every operand as the kernels see them (allocated outputs C-contiguous)."""
    strides: Dict[str, Tuple[int, ...]] = {}
    for name in names:
        op = getattr(prob, name)
        if op is not None:
            strides[name] = op.strides
        elif name in out_shapes:
            strides[name] = c_strides(out_shapes[name])
    if prob.mask is not None:
        strides["mask"] = prob.mask.strides
    return strides


def stream_for(stream: Any, like: Any) -> int:
    """The raw stream handle a call runs on."""
    return default_stream(like) if stream is None else stream_handle(stream)


#: Operands of each pass, in the order of :func:`plan`'s and :func:`launch`'s ``ptrs`` and ``objs``
#: (the order of the plans' value slots).
OPERANDS = {
    "fwd": ("q", "k", "v", "out", "lse", "mask"),
    "bwd": ("q", "k", "v", "out", "dout", "lse", "dq", "dk", "dv", "mask"),
}
_PLANS = {"fwd": ForwardPlan, "bwd": BackwardPlan}


def plan(prob: Problem, kind: str) -> Tuple[_Plan, int, int]:
    """``(plan, context, device)`` of pass ``kind`` of a validated device problem (compiles on first use)."""
    ctx, pushed = _driver.enter(_device_hint(prob.q.obj))
    try:
        device = _driver.context_device(ctx)
        _check_device(prob, device)
        cls = _PLANS[kind]
        names = OPERANDS[kind][:-1]
        shapes = dict(zip((names[i] for i in cls.OUTPUTS), _output_shapes(prob, kind)))
        ptrs = [op.ptr for op in (getattr(prob, n) for n in OPERANDS[kind]) if op is not None]
        return cls(prob, _plan_strides(prob, names, shapes), _aligned(ptrs)), ctx, device
    finally:
        _driver.leave(pushed)


def _output_shapes(prob: Problem, kind: str) -> Tuple[Tuple[int, ...], ...]:
    qs, ks = (prob.B, prob.H, prob.Nq, prob.D), (prob.B, prob.kv_heads, prob.Nk, prob.D)
    return (qs, qs[:3]) if kind == "fwd" else (qs, ks, ks)


def run(prob: Problem, kind: str, stream: Any = None, keep: Optional[Callable[[Any, int, int], None]] = None):
    """Run pass ``kind`` of a validated problem; return its outputs (``(out, lse)`` or ``(dq, dk, dv)``).

    ``keep(plan, context, device)``, when given, receives the plan for later
    calls of the same signature (``pycudaflash._calls``).
    """
    if not prob.on_device:
        return _run_host(prob, stream, kind)
    plan_, ctx, device = plan(prob, kind)
    if keep is not None:
        keep(plan_, ctx, device)
    ops = [getattr(prob, n) for n in OPERANDS[kind]]
    ptrs = [op.ptr if op is not None else 0 for op in ops]
    objs = [op.obj if op is not None else None for op in ops]
    ctx, pushed = _driver.enter(_device_hint(prob.q.obj))
    try:
        return launch(plan_, ctx, device, stream_for(stream, prob.q.obj), ptrs, objs, kl_host=prob.key_lengths,
                      mods=mod_values(plan_, prob.mod_tensors), block_map=prob.block_map)
    finally:
        _driver.leave(pushed)


def launch(plan_: _Plan, ctx: int, device: int, stream: int, ptrs: Sequence[int], objs: Sequence[Any],
           device_kl: int = 0, kl_host: Optional[np.ndarray] = None, workspace: int = 0,
           mods: Sequence[Any] = (), block_map: Any = None) -> Tuple[Any, ...]:
    """Allocate the outputs missing from ``objs``, launch ``plan_`` and return its outputs.

    ``ptrs`` and ``objs``: pointers and objects of the pass's
    :data:`OPERANDS` (None and 0 where absent).  Key lengths, where the plan
    has them: ``device_kl``, a device int32 array read in place, or
    ``kl_host``, validated host int32 values copied into the workspace.
    ``workspace``: device memory of the caller's for the plan's workspace
    (0: one per call).  ``mods``: the modifiers' tensors (:func:`mod_values`).  ``block_map``:
    the call's :class:`pycudaflash.BlockMap` (a plan made with one needs one).
    """
    like = objs[0]
    vals = plan_.values(ptrs)
    if any(objs[i] is None for i in plan_.OUTPUTS):
        _refuse_capture(like, stream, plan_.OUTPUT_NAMES)
    outs = []
    for i, shape, dtype in zip(plan_.OUTPUTS, plan_.shapes, plan_.out_dtypes):
        o = objs[i]
        if o is None:
            o = empty_like_input(like, shape, dtype, device, stream)
            vals[i] = _ptr(o)
        outs.append(o)
    execute(plan_, vals, ctx, device, stream, _key_lengths_arg(plan_, vals, stream, device_kl, kl_host), like,
            workspace, mods, block_map)
    return tuple(outs)


def _key_lengths_arg(plan: _Plan, vals: List[int], stream: int, device_kl: int,
                     kl_host: Optional[np.ndarray]) -> Optional[np.ndarray]:
    """Host key lengths to copy into the workspace (None when absent or read on the device)."""
    if device_kl:
        vals[plan.KL] = device_kl
        return None
    if kl_host is None:
        return None
    if _driver.is_capturing(stream):
        raise ValueError("key_lengths given on the host cannot be captured into a graph: pass them as an int32 "
                         "device tensor to pycudaflash.torch.flash_attention")
    return kl_host


def _refuse_capture(like: Any, stream: int, names: str) -> None:
    """Outputs allocated here (outside torch's graph-aware allocator) would be freed and reused while a
    captured graph still writes them."""
    if _torch_current(like, stream) is None and _driver.is_capturing(stream):
        raise ValueError(f"a call captured into a graph must be given its output buffers ({names})")


def _ptr(obj: Any) -> int:
    """Device pointer of an array this module allocated."""
    data_ptr = getattr(obj, "data_ptr", None)
    if callable(data_ptr):  # torch
        return int(data_ptr())
    gpudata = getattr(obj, "gpudata", None)
    if gpudata is not None:  # pycuda
        return int(gpudata)
    return int(obj.data.ptr)  # cupy


def _aligned(ptrs: Sequence[int]) -> bool:
    return all(p % 16 == 0 for p in ptrs)


def _check_device(prob: Problem, device: int) -> None:
    """Every device operand must live on the call's device."""
    named = [(name, getattr(prob, name)) for name in ("q", "k", "v", "out", "lse", "dout", "dq", "dk", "dv", "mask")]
    named += [(f"mod_tensors[{n!r}]", t) for n, t in (prob.mod_tensors or {}).items() if isinstance(t, Operand)]
    for name, op in named:
        if op is None or not op.ptr:
            continue
        where = _driver.pointer_device(op.ptr)
        if where is not None and where != device:
            raise ValueError(f"{name} lives on device {where} but the call runs on device {device}")


# ------------------------------------------------------------- host arrays


def _run_host(prob: Problem, stream: Any, kind: str):
    """numpy in, numpy out on the GPU: upload, launch, copy back, wait."""
    ctx, pushed = _driver.enter(None)
    try:
        device = _driver.context_device(ctx)
        handle = 0 if stream is None else stream_handle(stream)
        cls = _PLANS[kind]
        names = OPERANDS[kind]
        out_names = [names[i] for i in cls.OUTPUTS]
        out_shapes = dict(zip(out_names, _output_shapes(prob, kind)))
        arrays: Dict[str, np.ndarray] = {n: np.ascontiguousarray(getattr(prob, n).array)
                                         for n in names[:-1] if n not in out_shapes}
        mask_strides = None
        if prob.mask is not None:
            m = prob.mask
            compact = m.array[tuple(slice(0, 1) if s == 0 else slice(None) for s in m.strides)]
            arrays["mask"] = np.ascontiguousarray(compact)
            cs = c_strides(compact.shape)
            mask_strides = tuple(0 if s == 0 else c for s, c in zip(m.strides, cs))
        results = {}
        for n in out_names:
            op = getattr(prob, n)
            dt = np.dtype(np.float32) if n == "lse" else prob.dtype
            results[n] = op.array if op is not None else np.empty(out_shapes[n], dt)
        staged = {n: np.empty(out_shapes[n], results[n].dtype) for n in out_names}
        regions = _Workspace()
        offsets = {n: regions.region(a.nbytes) for n, a in list(arrays.items()) + list(staged.items())}
        base = _driver.alloc_async(regions.nbytes, device, handle)
        try:
            for n, a in arrays.items():
                _driver.memcpy_htod_async(base + offsets[n], a.ctypes.data, a.nbytes, handle)
            strides = {n: c_strides(a.shape) for n, a in list(arrays.items()) + list(staged.items())}
            if mask_strides is not None:
                strides["mask"] = mask_strides
            plan: _Plan = cls(prob, strides, True)
            vals = plan.values([base + offsets[n] if n in offsets else 0 for n in names])
            execute(plan, vals, ctx, device, handle, _key_lengths_arg(plan, vals, handle, 0, prob.key_lengths), None,
                    mod_values=mod_values(plan, prob.mod_tensors))
            for n, a in staged.items():
                _driver.memcpy_dtoh_async(a.ctypes.data, base + offsets[n], a.nbytes, handle)
        finally:
            _driver.free_async(base, handle)
        _driver.synchronize(handle)
        for n in out_names:
            results[n][...] = staged[n]
        return tuple(results[n] for n in out_names)
    finally:
        _driver.leave(pushed)


def compile_info() -> Dict[str, Any]:
    """Where kernels are cached and what this process compiled."""
    return {
        "cache_dir": compiler.cache_dir(),
        "nvcc_version": compiler.nvcc_version(),
        "variants_compiled": list(compiler.compiled_variants),
    }
