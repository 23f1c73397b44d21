"""CUDA backend: launches the kernels of ``cuda_src/`` through PyCUDA.

Everything here runs after validation; it receives a
:class:`~pycudaflash._problem.Problem` and a stream.  The library works in the
device's *primary* context (shared with PyTorch and CuPy in the same
process): :func:`activate` retains it and makes it current.  All launches,
copies and temporaries go on the caller's stream; the host waits only when
numpy results must come back.
"""

from __future__ import annotations

import atexit
import os
import threading
from typing import Any, Dict, Optional, Tuple

import numpy as np

from . import compiler
from ._problem import Operand, Problem
from .semantics import BAND_UNBOUNDED

_state = threading.local()
_primary: Dict[int, Any] = {}
MAX_GRID_YZ = 65535
MAX_JOBS = 2**31 - 1 - 2**20  # job indices (int32) stay below 2**31 with a grid of up to 2**20 blocks
LOG2E = 1.4426950408889634


# ------------------------------------------------------------------ context


def activate(device: Optional[int] = None):
    """Retain the primary context of ``device`` and make it current; return it.

    ``device`` defaults to the device of the current context if there is one,
    else ``$PYCUDAFLASH_DEVICE`` or 0.  Idempotent.
    """
    import pycuda.driver as drv

    if device is None:
        # Fast path: the context this thread activated last is still current.
        last = getattr(_state, "last", None)
        if last is not None:
            current = drv.Context.get_current()
            if current is not None and _handle(current) == last[0]:
                return last[1]
    drv.init()
    current = drv.Context.get_current()
    if device is None:
        if current is not None:
            device = _ordinal_of(current.get_device())
        else:
            device = int(os.environ.get("PYCUDAFLASH_DEVICE", "0"))
    ctx = _primary.get(device)
    if ctx is None:
        ctx = drv.Device(device).retain_primary_context()
        _primary[device] = ctx
        if len(_primary) == 1:
            atexit.register(_release)
    if current is None or _handle(current) != _handle(ctx):
        ctx.push()
        pushed = getattr(_state, "pushed", [])
        pushed.append(ctx)
        _state.pushed = pushed
    _state.last = (_handle(ctx), ctx)
    return ctx


_sm_counts: Dict[int, int] = {}


def _sm_count() -> int:
    """Multiprocessors of the current context's device (memoised per context)."""
    import pycuda.driver as drv

    key = compiler.context_key()
    n = _sm_counts.get(key)
    if n is None:
        n = _sm_counts[key] = drv.Context.get_device().get_attribute(drv.device_attribute.MULTIPROCESSOR_COUNT)
    return n


def _ordinal_of(dev) -> int:
    import pycuda.driver as drv

    bus = dev.pci_bus_id()
    for i in range(drv.Device.count()):
        if drv.Device(i).pci_bus_id() == bus:
            return i
    return 0


def _handle(ctx) -> int:
    h = getattr(ctx, "handle", None)
    return int(h) if h is not None else id(ctx)


def deactivate() -> None:
    """Pop the contexts :func:`activate` pushed on this thread (also run at exit)."""
    _release()


def _release() -> None:
    import pycuda.driver as drv

    # Pop as many contexts as were pushed here, whatever made itself current
    # since (a runtime-API library may have re-bound the same primary context).
    for _ in getattr(_state, "pushed", []):
        try:
            drv.Context.pop()
        except Exception:
            break
    _state.pushed = []
    _state.last = None


# ---------------------------------------------------------------- workspace


class _Workspace:
    """Grow-only float32/int32 scratch memory, one per stream.

    Work on one stream runs in order, so a later call may reuse the memory of
    an earlier one on the same stream; different streams never share it.
    """

    def __init__(self) -> None:
        self.alloc = None
        self.nbytes = 0

    def get(self, nbytes: int, stream) -> int:
        import pycuda.driver as drv

        if nbytes > self.nbytes:
            if self.alloc is not None:
                # Earlier work on this stream may still read the old buffer.
                if stream is not None:
                    stream.synchronize()
                else:
                    drv.Context.synchronize()
                self.alloc.free()
            self.alloc = drv.mem_alloc(max(nbytes, 256))
            self.nbytes = nbytes
        return int(self.alloc)


class _JobCounter:
    """Two int32 in device memory, zero between launches: the job counter of
    the persistent Hopper forward and its count of finished blocks (the last
    block of a launch sets both back to zero).  One per stream, as the
    workspace: launches on one stream run one after another."""

    def __init__(self) -> None:
        import pycuda.driver as drv

        self.alloc = drv.mem_alloc(8)
        drv.memset_d32(self.alloc, 0, 2)


# Device state of each (context handle, stream handle), made on first use.
_workspaces: Dict[Tuple[int, int], _Workspace] = {}
_job_counters: Dict[Tuple[int, int], _JobCounter] = {}


def _stream_state(table: Dict[Tuple[int, int], Any], make, stream):
    """``table``'s object for the current context and ``stream`` (``make()`` on first use)."""
    import pycuda.driver as drv

    key = (_handle(drv.Context.get_current()), 0 if stream is None else int(stream.handle))
    obj = table.get(key)
    if obj is None:
        obj = table[key] = make()
    return obj


def _workspace(stream) -> _Workspace:
    return _stream_state(_workspaces, _Workspace, stream)


def _job_counter(stream) -> int:
    return int(_stream_state(_job_counters, _JobCounter, stream).alloc)


def _align(n: int, a: int = 256) -> int:
    return (n + a - 1) // a * a


# ------------------------------------------------------------------ operands


class _DevArg:
    """Device pointer and element strides of one operand, plus what keeps it alive."""

    def __init__(self, ptr: int, strides: Tuple[int, ...], keep: Any = None, host: Any = None):
        self.ptr = int(ptr)
        self.strides = tuple(int(s) for s in strides)
        self.keep = keep  # device buffer owned by this call (uploaded copy / new output)
        self.host = host  # numpy array to copy results back into


def _upload(arr: np.ndarray, stream):
    import pycuda.gpuarray as gpuarray

    return gpuarray.to_gpu_async(np.ascontiguousarray(arr), stream=stream)


def _c_strides(shape) -> Tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


def _input(op: Operand, stream) -> _DevArg:
    if op.on_device:
        return _DevArg(op.ptr, op.strides)
    buf = _upload(op.array, stream)
    return _DevArg(int(buf.gpudata), _c_strides(op.shape), keep=buf)


def _mask_input(op: Optional[Operand], stream, convert=None) -> _DevArg:
    """Device pointer and strides of the dense mask (float masks as float32).

    ``convert`` is the kernel that turns a device float mask stored in the
    input's 16-bit type into a compact float32 copy.
    """
    if op is None:
        return _DevArg(0, (0, 0, 0, 0))
    needs_f32 = op.dtype.kind != "b" and op.dtype != np.float32
    if op.on_device and not needs_f32:
        return _DevArg(op.ptr, op.strides)
    if op.on_device:
        import pycuda.gpuarray as gpuarray

        if convert is None:
            raise TypeError(f"a {op.dtype} mask needs the float32 conversion kernel")
        dims = tuple(1 if st == 0 else n for n, st in zip(op.shape, op.strides))
        buf = gpuarray.empty(dims, np.float32)
        total = int(np.prod(dims))
        blocks = max(1, min((total + 255) // 256, 132 * 16))
        convert.prepared_async_call((blocks, 1, 1), (256, 1, 1), stream, op.ptr, int(buf.gpudata),
                                    dims[1], dims[2], dims[3], *op.strides, total)
        cs = _c_strides(dims)
        return _DevArg(int(buf.gpudata), tuple(0 if st == 0 else c for st, c in zip(op.strides, cs)), keep=buf)
    # Upload the compact mask (size 1 on broadcast dims) and keep zero strides there.
    arr = op.array
    compact = arr[tuple(slice(0, 1) if s == 0 else slice(None) for s in op.strides)]
    if needs_f32:
        compact = compact.astype(np.float32)
    buf = _upload(compact, stream)
    cs = _c_strides(compact.shape)
    strides = tuple(0 if s == 0 else c for s, c in zip(op.strides, cs))
    return _DevArg(int(buf.gpudata), strides, keep=buf)


def _output(op: Optional[Operand], shape, dtype, on_device: bool) -> _DevArg:
    import pycuda.gpuarray as gpuarray

    if op is not None and op.on_device:
        return _DevArg(op.ptr, op.strides, keep=None)
    buf = gpuarray.empty(shape, dtype)
    host = None
    if not on_device:
        host = op.array if op is not None else np.empty(shape, dtype)
    return _DevArg(int(buf.gpudata), _c_strides(shape), keep=buf, host=host)


def _result(arg: _DevArg, op: Optional[Operand]):
    """What the API returns for one output: the caller's buffer, a GPUArray or numpy."""
    if arg.host is not None:
        return arg.host
    if op is not None:
        return op.obj
    return arg.keep


def _finish_host(args, stream) -> None:
    """Wait for the stream, then copy device results back into their numpy arrays."""
    import pycuda.driver as drv

    if stream is not None:
        stream.synchronize()
    else:
        drv.Context.synchronize()
    for a in args:
        if a.host is not None:
            a.host[...] = a.keep.get()


def _key_lengths(prob: Problem, stream, ws_ptr: int) -> int:
    """Copy the validated key lengths into the workspace; return the device pointer (0 if none)."""
    import pycuda.driver as drv

    if prob.key_lengths is None:
        return 0
    kl = np.ascontiguousarray(prob.key_lengths, dtype=np.int32)
    if stream is not None:
        drv.memcpy_htod_async(ws_ptr, kl, stream)
    else:
        drv.memcpy_htod(ws_ptr, kl)
    return ws_ptr


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


def _vec_ok(args, D: int, itemsize: int = 4) -> int:
    """16-byte loads are possible: D a whole number of 16 bytes, rows and bases 16-byte aligned."""
    per16 = 16 // itemsize
    if D % per16:
        return 0
    for a in args:
        if a.ptr % 16:
            return 0
        if any(s % per16 for s in a.strides[:-1]):
            return 0
    return 1


def _kernel_dtype(prob: Problem) -> str:
    """Name of the problem's input dtype as the compiler knows it."""
    name = np.dtype(prob.dtype).name
    if name not in compiler.DTYPES:
        raise TypeError(f"no CUDA kernels for dtype {name}")
    return name


class _Variant:
    """The compiled variant a problem needs for one pass, on the current device.

    Made once per (context, pass kind, dtype, head-dim bucket, mask kind,
    tuning environment) and kept: a launch then only looks up its kernels
    and shared-memory sizes.
    """

    def __init__(self, pass_: str, defs: Dict[str, int], tiles: "compiler.Tiles", head_dim: int, dtype: str,
                 arch: str) -> None:
        self.pass_, self.defs, self.tiles = pass_, defs, tiles
        self.head_dim, self.dtype, self.arch = head_dim, dtype, arch
        self._smem: Dict[str, int] = {}
        self._functions: Dict[str, Any] = {}
        self._resident: Dict[str, int] = {}

    def smem(self, kernel: str) -> int:
        """Dynamic shared memory of ``kernel`` in this variant (bytes)."""
        n = self._smem.get(kernel)
        if n is None:
            n = self._smem[kernel] = compiler.smem_bytes(kernel, self.head_dim, self.dtype, self.arch, self.pass_,
                                                         self.defs)
        return n

    def backward_block(self) -> Tuple[int, int]:
        """(keys, threads) of one block of the dK/dV kernel."""
        if self.pass_ == "bwd_sm90":
            return compiler.bwd90_block(self.defs)
        return self.tiles.bwd_bc, 32 * compiler.BWD_WARPS

    def forward_block(self) -> Tuple[int, int]:
        """(query rows, threads) of one forward block."""
        if self.pass_ == "fwd_sm90":
            wgs = self.defs["FWD_WGS"]
            return compiler.WG_ROWS * wgs, compiler.WG_THREADS * wgs
        return self.tiles.fwd_br, 32 * self.tiles.fwd_warps

    def resident_blocks(self, kernel: str, threads: int) -> int:
        """Blocks of ``kernel`` (prepared by :meth:`function`) one SM holds at once."""
        n = self._resident.get(kernel)
        if n is None:
            n = self._resident[kernel] = compiler.resident_blocks(self._functions[kernel], threads,
                                                                  self.smem(kernel))
        return n

    def function(self, kernel: str, arg_format: str):
        """The prepared kernel, its shared-memory limit raised to :meth:`smem`."""
        fn = self._functions.get(kernel)
        if fn is None:
            fn = self._functions[kernel] = compiler.get_function(self.pass_, self.defs, kernel, arg_format,
                                                                 self.smem(kernel))
        return fn


_variants: Dict[Tuple, _Variant] = {}


def _variant(prob: Problem, kind: str) -> _Variant:
    """Pass, defines and tiles of ``kind`` ('fwd' or 'bwd') for ``prob`` (memoised)."""
    dt = _kernel_dtype(prob)
    env = tuple(os.environ.get(name) for name in compiler.TUNING_ENV)
    key = (compiler.context_key(), kind, dt, compiler.head_dim_bucket(prob.D, dt), prob.mask_kind, env)
    var = _variants.get(key)
    if var is None:
        arch = compiler.arch_of_current_device()
        hd = key[3]
        pass_ = compiler.pass_name(kind, dt, arch, hd, prob.mask_kind)
        var = _variants[key] = _Variant(pass_, compiler.defines(pass_, hd, prob.mask_kind, dt, arch),
                                        compiler.tiles(hd, dt, arch), hd, dt, arch)
    return var


def _three(strides) -> Tuple[int, int, int]:
    return int(strides[0]), int(strides[1]), int(strides[2])


# ------------------------------------------------------------------ forward

_FWD_FORMAT = "PPPPPPP" + "iii" + "q" * 19 + "f" + "iii"
_FWD90_FORMAT = _FWD_FORMAT + "iiiP"  # + heads, jobs, log2 of the job group, job counter
# L2 share for the Kj, Vj of one job group of the persistent forward
_JOB_GROUP_BYTES = 16 << 20
_MASK_CONVERT_FORMAT = "PP" + "qqq" + "qqqq" + "q"


def run_forward(prob: Problem, stream=None):
    """Launch the forward pass; return ``(out, lse)``."""
    activate()
    _check_grid(prob)
    B, H, Nq, Nk, D = prob.B, prob.H, prob.Nq, prob.Nk, prob.D
    var = _variant(prob, "fwd")
    hopper = var.pass_ == "fwd_sm90"
    fn = var.function("flash_fwd_kernel", _FWD90_FORMAT if hopper else _FWD_FORMAT)
    conv = _mask_converter(prob, var)

    q, k, v = (_input(op, stream) for op in (prob.q, prob.k, prob.v))
    out = _output(prob.out, (B, H, Nq, D), prob.dtype, prob.on_device)
    lse = _output(prob.lse, (B, H, Nq), np.float32, prob.on_device)
    mask = _mask_input(prob.mask, stream, conv)
    ws = _workspace(stream)
    kl_ptr = _key_lengths(prob, stream, ws.get(4 * B, stream)) if prob.key_lengths is not None else 0
    lo, hi = _band(prob)
    itemsize = np.dtype(prob.dtype).itemsize
    # 16-bit outputs are stored in aligned pairs under the same condition.
    vec = _vec_ok((q, k, v) if itemsize == 4 else (q, k, v, out), D, itemsize)
    rows, threads = var.forward_block()
    grid = ((Nq + rows - 1) // rows, H, B)
    extra = ()
    if hopper:
        # Jobs: query tiles of every (batch, head).  Persistent blocks take
        # them from the job counter; otherwise one block each.
        jobs = grid[0] * H * B
        counter, group_shift = 0, 0
        if var.defs["FWD_PERSIST"]:  # (_check_grid bounds the jobs)
            counter = _job_counter(stream)
            group_shift = _job_group_shift(prob, var.tiles.fwd90_group, itemsize)
            grid = (min(jobs, var.resident_blocks("flash_fwd_kernel", threads) * _sm_count()), 1, 1)
        extra = (H, jobs, group_shift, counter)
    fn.prepared_async_call(
        grid, (threads, 1, 1), stream,
        q.ptr, k.ptr, v.ptr, out.ptr, lse.ptr, mask.ptr, kl_ptr,
        Nq, Nk, D,
        *_three(q.strides), *_three(k.strides), *_three(v.strides), *_three(out.strides),
        *_three(lse.strides), *mask.strides,
        np.float32(prob.scale * LOG2E), lo, hi, vec, *extra,
        shared_size=var.smem("flash_fwd_kernel"),
    )
    if not prob.on_device:
        _finish_host((out, lse), stream)
    return _result(out, prob.out), _result(lse, prob.lse)


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


def _mask_converter(prob: Problem, var: _Variant):
    """The 16-bit float mask conversion kernel, where the problem needs it.

    (Validation admits a mask of 16-bit floats only in the inputs' own dtype.)
    """
    m = prob.mask
    if m is None or not m.on_device or m.dtype.kind == "b" or m.dtype == np.float32:
        return None
    return var.function("flash_convert_mask", _MASK_CONVERT_FORMAT)


# ----------------------------------------------------------------- backward

_PRE_FORMAT = "PPPPPP" + "iii" + "q" + "q" * 9
_DKDV_FORMAT = "PPPPPPPPPPP" + "iii" + "q" * 22 + "ff" + "iii"
_DQ_FORMAT = "PPPPPPPPP" + "iii" + "q" * 19 + "ff" + "iii"
_CONVERT_FORMAT = "PP" + "iii" + "q" + "qqq" + "i"
# Rows per warp of the preprocess and dQ conversion kernels (PRE_ROWS in their .cu files).
PRE_ROWS = 4
PRE_WARPS = 8  # warps per block of those kernels


def run_backward(prob: Problem, stream=None):
    """Launch the backward pass; return ``(dq, dk, dv)``."""
    activate()
    _check_grid(prob)
    B, H, Nq, Nk, D = prob.B, prob.H, prob.Nq, prob.Nk, prob.D
    var = _variant(prob, "bwd")
    f_pre = var.function("flash_bwd_preprocess", _PRE_FORMAT)
    f_kv = var.function("flash_bwd_dkdv_kernel", _DKDV_FORMAT)
    if prob.deterministic:
        f_dq = var.function("flash_bwd_dq_kernel", _DQ_FORMAT)
    else:
        f_conv = var.function("flash_bwd_convert_dq", _CONVERT_FORMAT)
    conv = _mask_converter(prob, var)

    q, k, v, o, do = (_input(op, stream) for op in (prob.q, prob.k, prob.v, prob.out, prob.dout))
    lse = _input(prob.lse, stream)
    dq = _output(prob.dq, (B, H, Nq, D), prob.dtype, prob.on_device)
    dk = _output(prob.dk, (B, H, Nk, D), prob.dtype, prob.on_device)
    dv = _output(prob.dv, (B, H, Nk, D), prob.dtype, prob.on_device)
    mask = _mask_input(prob.mask, stream, conv)

    # Workspace: Di, Li*log2e (B*H*Nq each), key lengths, dQ accumulator.
    rows = B * H * Nq
    off_l2 = _align(4 * rows)
    off_kl = off_l2 + _align(4 * rows)
    off_dq = off_kl + _align(4 * B)
    total = off_dq + (0 if prob.deterministic else 4 * rows * D)
    base = _workspace(stream).get(total, stream)
    d_ptr, l2_ptr, dqacc_ptr = base, base + off_l2, (0 if prob.deterministic else base + off_dq)
    kl_ptr = _key_lengths(prob, stream, base + off_kl) if prob.key_lengths is not None else 0
    lo, hi = _band(prob)
    itemsize = np.dtype(prob.dtype).itemsize
    # 16-bit dK, dV (and deterministic dQ) are stored in aligned pairs under the same condition.
    vec = _vec_ok((q, k, v, do) if itemsize == 4 else (q, k, v, do, dq, dk, dv), D, itemsize)
    scale = np.float32(prob.scale)
    scale_log2 = np.float32(prob.scale * LOG2E)

    # 1. Di = rowsum(dO o O), Li*log2(e); the dQ accumulator zeroed.
    row_blocks = ((rows + PRE_ROWS * PRE_WARPS - 1) // (PRE_ROWS * PRE_WARPS), 1, 1)
    f_pre.prepared_async_call(
        row_blocks, (32 * PRE_WARPS, 1, 1), stream,
        do.ptr, o.ptr, lse.ptr, d_ptr, l2_ptr, dqacc_ptr, H, Nq, D, rows,
        *_three(do.strides), *_three(o.strides), *_three(lse.strides),
    )

    # 2. dK, dV (and dQ by atomics): one block per key tile.
    keys, threads = var.backward_block()
    f_kv.prepared_async_call(
        ((Nk + keys - 1) // keys, H, B), (threads, 1, 1), stream,
        q.ptr, k.ptr, v.ptr, do.ptr, d_ptr, l2_ptr, dqacc_ptr, dk.ptr, dv.ptr, mask.ptr, kl_ptr,
        Nq, Nk, D,
        *_three(q.strides), *_three(k.strides), *_three(v.strides), *_three(do.strides),
        *_three(dk.strides), *_three(dv.strides), *mask.strides,
        scale_log2, scale, lo, hi, vec,
        shared_size=var.smem("flash_bwd_dkdv_kernel"),
    )
    # 3. dQ: deterministic kernel, or copy of the accumulator.
    if prob.deterministic:
        f_dq.prepared_async_call(
            ((Nq + var.tiles.dq_br - 1) // var.tiles.dq_br, H, B), (32 * compiler.DQ_WARPS, 1, 1), stream,
            q.ptr, k.ptr, v.ptr, do.ptr, d_ptr, l2_ptr, dq.ptr, mask.ptr, kl_ptr,
            Nq, Nk, D,
            *_three(q.strides), *_three(k.strides), *_three(v.strides), *_three(do.strides),
            *_three(dq.strides), *mask.strides,
            scale_log2, scale, lo, hi, vec,
            shared_size=var.smem("flash_bwd_dq_kernel"),
        )
    else:
        f_conv.prepared_async_call(
            row_blocks, (32 * PRE_WARPS, 1, 1), stream,
            dqacc_ptr, dq.ptr, H, Nq, D, rows, *_three(dq.strides), vec,
        )
    if not prob.on_device:
        _finish_host((dq, dk, dv), stream)
    return tuple(_result(a, op) for a, op in ((dq, prob.dq), (dk, prob.dk), (dv, prob.dv)))


def compile_info() -> Dict[str, Any]:
    """Where kernels are cached and what this process compiled."""
    return {
        "cache_dir": compiler.cache_dir(),
        "nvcc_version": compiler.nvcc_version(),
        "variants_compiled": list(compiler.compiled_variants),
    }
