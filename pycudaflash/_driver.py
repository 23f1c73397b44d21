"""The CUDA driver calls of the CUDA backend, through NVIDIA's ``cuda-bindings``.

PyCUDA compiles the kernels (``pycudaflash.compiler``); everything that runs
them goes through this module: contexts, modules, launches on any stream
(PyCUDA cannot wrap a foreign stream handle), stream-ordered temporaries,
stream capture and graphs.  Every call's result is checked
(:func:`check`), and a failure raises :class:`CudaError` naming the call.

Contexts
--------
The library never leaves a context pushed.  :func:`enter` makes a context
current for one call: the thread's current context when it is on the wanted
device (torch and cupy bind the device's primary context to their threads),
else the device's primary context, pushed, to be popped by :func:`leave`
when the call returns.
"""

from __future__ import annotations

import ctypes
import sys
import threading
from typing import Any, Dict, Optional, Tuple

__all__ = [
    "CudaError",
    "check",
    "driver",
    "enter",
    "leave",
    "current_context",
    "context_device",
    "device_attribute",
    "compute_capability",
    "Module",
    "Launch",
    "alloc_async",
    "free_async",
    "mem_alloc",
    "mem_free",
    "is_capturing",
    "Graph",
    "capture",
]

_drv: Any = None
_init_lock = threading.Lock()


class CudaError(RuntimeError):
    """A CUDA driver call failed: ``call`` is its name, ``code`` the CUresult."""

    def __init__(self, call: str, code: int, name: str) -> None:
        super().__init__(f"{call} failed: {name} ({code})")
        self.call, self.code, self.name = call, code, name


def driver() -> Any:
    """``cuda.bindings.driver``, initialised (``cuInit``) on first use."""
    global _drv
    if _drv is None:
        with _init_lock:
            if _drv is None:
                from cuda.bindings import driver as d

                _check_result("cuInit", d.cuInit(0))
                _drv = d
    return _drv


def _check_result(call: str, res: Tuple[Any, ...]) -> Any:
    """The values of a driver call's result tuple; raise on a failed CUresult."""
    err = res[0]
    code = int(err)
    if code != 0:
        name = str(err)
        try:
            ok, text = _drv.cuGetErrorName(err) if _drv is not None else (1, None)
            if int(ok) == 0 and text:
                name = text.decode()
        except Exception:  # the message is best effort; the code is exact
            pass
        raise CudaError(call, code, name)
    if len(res) == 1:
        return None
    return res[1] if len(res) == 2 else res[1:]


def check(call: str, *args: Any) -> Any:
    """Call ``driver().<call>(*args)`` and return its values; raise :class:`CudaError` on failure."""
    return _check_result(call, getattr(driver(), call)(*args))


# ------------------------------------------------------------------ contexts

_primary: Dict[int, Any] = {}  # device ordinal -> retained primary CUcontext
_primary_handles: Dict[int, int] = {}  # device ordinal -> handle of its primary context
_ctx_devices: Dict[int, int] = {}  # context handle -> device ordinal


def current_context() -> int:
    """Handle of the calling thread's current context (0: none).

    Called on every launch, so it goes to libcuda through ``ctypes`` (as
    :class:`Launch` does): half the host time of the cuda-bindings call.
    The handle is written into a buffer of the calling thread's own (the
    call releases the GIL, and another thread may ask at the same time).
    """
    try:
        out, ref = _current_out.buf
    except AttributeError:
        out = ctypes.c_void_p()
        out, ref = _current_out.buf = (out, ctypes.byref(out))
    code = _libcuda("cuCtxGetCurrent")(ref)
    if code:
        _check_result("cuCtxGetCurrent", (driver().CUresult(code),))
    return out.value or 0


_current_out = threading.local()


def context_device(ctx: int) -> int:
    """Device ordinal of context ``ctx`` (which must be current, or known)."""
    dev = _ctx_devices.get(ctx)
    if dev is None:
        if current_context() != ctx:
            raise RuntimeError("context_device: the context is neither current nor known")
        dev = _ctx_devices[ctx] = int(check("cuCtxGetDevice"))
    return dev


def primary_context(device: int) -> Any:
    """The retained primary context of ``device`` (retained once per process)."""
    ctx = _primary.get(device)
    if ctx is None:
        with _init_lock:
            ctx = _primary.get(device)
            if ctx is None:
                dev = check("cuDeviceGet", device)
                ctx = check("cuDevicePrimaryCtxRetain", dev)
                _ctx_devices[int(ctx)] = device
                _primary_handles[device] = int(ctx)
                _primary[device] = ctx
    return ctx


def enter(device: Optional[int] = None) -> Tuple[int, bool]:
    """Make a context current for one call; return ``(context handle, pushed)``.

    With a ``device`` (the arrays are torch or cupy arrays, which live in
    the device's primary context) that primary context: nothing to push
    where it is current already, as on torch's threads.  With None the
    current context, whatever it is (a pycuda user's own), else device 0's
    primary context.  Pass ``pushed`` to :func:`leave` when the call is done.
    """
    cur = current_context()
    if device is None:
        if cur:
            return cur, False
        device = 0
    prim = primary_context(device)
    if cur == _primary_handles[device]:
        return cur, False
    check("cuCtxPushCurrent", prim)
    return _primary_handles[device], True


def leave(pushed: bool) -> None:
    """Pop the context :func:`enter` pushed (nothing when it pushed none)."""
    if pushed:
        check("cuCtxPopCurrent")


_attr_cache: Dict[Tuple[int, str], int] = {}


def device_attribute(device: int, name: str) -> int:
    """``CU_DEVICE_ATTRIBUTE_<name>`` of a device (memoised)."""
    key = (device, name)
    val = _attr_cache.get(key)
    if val is None:
        d = driver()
        attr = getattr(d.CUdevice_attribute, "CU_DEVICE_ATTRIBUTE_" + name)
        val = _attr_cache[key] = int(check("cuDeviceGetAttribute", attr, check("cuDeviceGet", device)))
    return val


def compute_capability(device: int) -> Tuple[int, int]:
    """``(major, minor)`` of a device."""
    return (device_attribute(device, "COMPUTE_CAPABILITY_MAJOR"),
            device_attribute(device, "COMPUTE_CAPABILITY_MINOR"))


# ------------------------------------------------------------------ modules


class Module:
    """A cubin loaded into the current context, and its kernels."""

    def __init__(self, image: bytes) -> None:
        self.image = image
        self.handle = check("cuModuleLoadData", image)
        self._functions: Dict[str, Any] = {}

    def function(self, name: str) -> Any:
        """The CUfunction ``name`` (memoised)."""
        fn = self._functions.get(name)
        if fn is None:
            fn = self._functions[name] = check("cuModuleGetFunction", self.handle, name.encode())
        return fn


def function_attribute(fn: Any, name: str) -> int:
    """``CU_FUNC_ATTRIBUTE_<name>`` of a kernel."""
    attr = getattr(driver().CUfunction_attribute, "CU_FUNC_ATTRIBUTE_" + name)
    return int(check("cuFuncGetAttribute", attr, fn))


def set_function_attribute(fn: Any, name: str, value: int) -> None:
    """Set ``CU_FUNC_ATTRIBUTE_<name>`` of a kernel."""
    attr = getattr(driver().CUfunction_attribute, "CU_FUNC_ATTRIBUTE_" + name)
    check("cuFuncSetAttribute", fn, attr, int(value))


class Launch:
    """One kernel launch whose arguments are fixed but for the stream: ``cuLaunchKernel`` of the
    CUfunction handle ``fn`` with the kernel's array of argument pointers at address ``params``.

    The one driver call of a repeated call's hot path goes to libcuda through
    ``ctypes``, with every argument but the stream converted once, here: on
    the H200 machine ``cuda.bindings.driver.cuLaunchKernel`` spent about 6 us
    of Python argument handling per launch, ctypes with its argument types
    converting eleven Python integers about 2.5 us, the prepared call about
    1 us.  Every other entry point goes through cuda-bindings.
    """

    __slots__ = ("_fn", "_head", "_params")

    def __init__(self, fn: int, grid: Tuple[int, int, int], block: Tuple[int, int, int], smem: int,
                 params: int) -> None:
        u = ctypes.c_uint
        self._fn = _libcuda_raw("cuLaunchKernel")
        self._head = (ctypes.c_void_p(fn), *(u(int(x)) for x in (*grid, *block, smem)))
        self._params = ctypes.c_void_p(params)

    def __call__(self, stream: int) -> None:
        code = self._fn(*self._head, ctypes.c_void_p(stream), self._params, None)
        if code:
            _check_result("cuLaunchKernel", (driver().CUresult(code),))


#: ctypes signatures of the entry points called in libcuda directly (with typed arguments).
_LIBCUDA_ARGTYPES = {
    "cuCtxGetCurrent": [ctypes.c_void_p],
}
_libcuda_fns: Dict[str, Any] = {}


def _libcuda(name: str) -> Any:
    """Entry point ``name`` of the process's libcuda (the one cuda-bindings loaded), typed for ctypes."""
    fn = _libcuda_fns.get(name)
    if fn is None:
        fn = _libcuda_raw(name)
        fn.argtypes = _LIBCUDA_ARGTYPES[name]
        _libcuda_fns[name] = fn
    return fn


def _libcuda_raw(name: str) -> Any:
    """Entry point ``name`` of the process's libcuda, untyped: every argument must be a ctypes
    object of the parameter's type.  (Indexing a library makes a new function object each time,
    so typing one does not type another.)"""
    global _libcuda_dll
    if _libcuda_dll is None:
        driver()
        _libcuda_dll = ctypes.CDLL(_libcuda_name())
    fn = _libcuda_dll[name]
    fn.restype = ctypes.c_int
    return fn


_libcuda_dll: Any = None


def _libcuda_name() -> str:
    return "nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1"


# ------------------------------------------------------------------- memory

_pools: Dict[int, Any] = {}


def _pool(device: int) -> Any:
    """This library's stream-ordered memory pool on ``device`` (kept, not released at syncs)."""
    pool = _pools.get(device)
    if pool is None:
        d = driver()
        props = d.CUmemPoolProps()
        props.allocType = d.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        props.location.type = d.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        props.location.id = device
        pool = check("cuMemPoolCreate", props)
        check("cuMemPoolSetAttribute", pool, d.CUmemPool_attribute.CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
              d.cuuint64_t(2**64 - 1))
        _pools[device] = pool
    return pool


def alloc_async(nbytes: int, device: int, stream: int) -> int:
    """``nbytes`` of device memory, ordered on ``stream`` (free it with :func:`free_async`)."""
    return int(check("cuMemAllocFromPoolAsync", max(int(nbytes), 256), _pool(device), stream))


def free_async(ptr: int, stream: int) -> None:
    """Free memory of :func:`alloc_async` once the work queued on ``stream`` is done."""
    check("cuMemFreeAsync", ptr, stream)


def mem_alloc(nbytes: int) -> int:
    """``cuMemAlloc`` in the current context (never freed by the caller's stream order)."""
    return int(check("cuMemAlloc", max(int(nbytes), 4)))


def mem_free(ptr: int) -> None:
    """``cuMemFree`` of a :func:`mem_alloc` allocation (in its context, made current by the caller)."""
    check("cuMemFree", ptr)


def memcpy_htod_async(dst: int, src_address: int, nbytes: int, stream: int) -> None:
    check("cuMemcpyHtoDAsync", dst, src_address, nbytes, stream)


def memcpy_dtoh_async(dst_address: int, src: int, nbytes: int, stream: int) -> None:
    check("cuMemcpyDtoHAsync", dst_address, src, nbytes, stream)


def memset_d32(ptr: int, value: int, count: int) -> None:
    check("cuMemsetD32", ptr, value, count)


def synchronize(stream: int) -> None:
    check("cuStreamSynchronize", stream)


def pointer_device(ptr: int) -> Optional[int]:
    """Device ordinal that owns a device pointer (None when the driver does not know it)."""
    d = driver()
    res = d.cuPointerGetAttribute(d.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, ptr)
    if int(res[0]) != 0:
        return None
    return int(res[1])


# ------------------------------------------------------- capture and graphs


#: The legacy and per-thread default stream handles, which are never captured.
DEFAULT_STREAMS = (0, 1, 2)


def is_capturing(stream: int) -> bool:
    """Whether ``stream`` is being captured into a graph (never a default stream: asking the driver
    about the legacy stream while another stream captures would itself break that capture)."""
    if stream in DEFAULT_STREAMS:
        return False
    status = check("cuStreamIsCapturing", stream)
    return int(status) != int(driver().CUstreamCaptureStatus.CU_STREAM_CAPTURE_STATUS_NONE)


#: Streams being captured by :class:`capture` (their calls take no memory from torch's allocator,
#: which knows nothing of that capture).
capturing: set = set()


class Graph:
    """A CUDA graph captured from a stream, instantiated for replay.

    Made by :func:`capture`.  :meth:`replay` launches it on a stream;
    the graph owns the stream-ordered temporaries its calls made, and
    reads and writes the same device buffers on every replay.
    """

    def __init__(self) -> None:
        self.graph: Any = None
        self.exec: Any = None
        self.stream: int = 0
        self._device: Optional[int] = None

    def replay(self, stream: Any = None) -> None:
        """Launch the graph on ``stream`` (default: the stream it was captured on)."""
        from ._streams import stream_handle

        if self.exec is None:
            raise RuntimeError("the graph has not been captured")
        handle = self.stream if stream is None else stream_handle(stream)
        ctx, pushed = enter(self._device)
        try:
            check("cuGraphLaunch", self.exec, handle)
        finally:
            leave(pushed)

    def __del__(self) -> None:
        try:
            if self.exec is not None:
                _drv.cuGraphExecDestroy(self.exec)
            if self.graph is not None:
                _drv.cuGraphDestroy(self.graph)
        except Exception:
            pass


class capture:
    """Capture the work queued on a stream into a :class:`Graph`.

    ::

        with pycudaflash.capture(stream) as graph:
            flash_attn_forward(q, k, v, out=out, lse=lse, stream=stream)
        graph.replay()

    ``stream`` is a non-default stream (a pycuda ``Stream``, a torch or cupy
    stream, or a ``CUstream`` handle).  Calls inside write into output
    buffers passed to them; their temporaries become part of the graph.
    """

    def __init__(self, stream: Any, device: Optional[int] = None) -> None:
        from ._streams import stream_handle

        self.handle = stream_handle(stream)
        if self.handle in DEFAULT_STREAMS:
            raise ValueError("capture needs a non-default stream (the default stream cannot be captured)")
        self.graph = Graph()
        self.graph.stream = self.handle
        self.graph._device = device
        self._pushed = False

    def __enter__(self) -> Graph:
        d = driver()
        ctx, self._pushed = enter(self.graph._device)
        self.graph._device = context_device(ctx)
        try:
            check("cuStreamBeginCapture", self.handle,
                  d.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
        except BaseException:
            leave(self._pushed)
            raise
        capturing.add(self.handle)
        return self.graph

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        capturing.discard(self.handle)
        try:
            graph = check("cuStreamEndCapture", self.handle)
            if exc_type is None:
                self.graph.graph = graph
                self.graph.exec = check("cuGraphInstantiate", graph, 0)
            elif graph is not None and int(graph) != 0:
                check("cuGraphDestroy", graph)
        finally:
            leave(self._pushed)
