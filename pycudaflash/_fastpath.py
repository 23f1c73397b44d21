"""The C++ host path of the torch operators: build, load, state.

``csrc/torch_ops.cpp`` registers the CUDA kernels of ``pycudaflash::flash_fwd``
and ``flash_bwd`` and the autograd of ``flash_fwd`` on CUDA tensors, so that
a repeated call runs no Python between torch's dispatcher and
``cuLaunchKernel`` (the file says how).  It is compiled on first use with the
host C++ compiler (``$CXX``, else ``c++``; the same compiler nvcc drives)
against the installed torch's headers, into the kernel cache directory, and
loaded with ``torch.ops.load_library``; later processes load the built
library.  It includes no CUDA header: the driver's entry points are handed
to it here.

``$PYCUDAFLASH_TORCH_CPP=0`` keeps the operators on their Python
implementations.  Where the library cannot be built, the first CUDA call
warns once (with the compiler's message) and the Python implementations
serve; results are the same, host time per call is higher.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import warnings
from pathlib import Path
from typing import List, Optional

import torch

ENV = "PYCUDAFLASH_TORCH_CPP"
SOURCE = Path(__file__).with_name("csrc") / "torch_ops.cpp"
#: Entry points of libcuda the library calls, in the order ``pycudaflash_fast_init`` takes them.
DRIVER_ENTRY_POINTS = ("cuLaunchKernel", "cuCtxGetCurrent", "cuCtxPushCurrent_v2", "cuCtxPopCurrent_v2",
                       "cuGetErrorName", "cuTensorMapEncodeTiled")

_lock = threading.Lock()
_state: Optional[bool] = None  # None: not tried; True: loaded; False: off or failed
_lib: Optional[ctypes.CDLL] = None
reason = "not loaded yet"


def enabled() -> bool:
    """Whether ``$PYCUDAFLASH_TORCH_CPP`` allows the C++ path (anything but ``0``)."""
    return os.environ.get(ENV, "1") != "0"


def loaded() -> bool:
    """Whether the C++ path serves CUDA tensors in this process (loading it on first call)."""
    if _state is None:
        ensure()
    return bool(_state)


#: A function that only the C++ runtime library defines (``std::locale::classic()``).
_RUNTIME_PROBE = "_ZNSt6locale7classicEv"


def cxx_runtime() -> Optional[str]:
    """The file of the C++ runtime (libstdc++) this process has loaded, where it can be told.

    The library links against that very file: a compiler whose shared runtime is not
    installed for linking would otherwise copy its static one into the library, and two
    runtimes in one process disagree (their locales and exceptions are not each other's).
    """
    try:
        with open("/proc/self/maps") as maps:
            for line in maps:
                path = line.split(maxsplit=5)[-1].strip()
                if os.path.basename(path).startswith("libstdc++.so"):
                    return path
    except OSError:
        pass
    return None


def compile_command(source: Path, output: Path) -> List[str]:
    """The compiler command that builds the library from ``source`` into ``output``."""
    from torch.utils import cpp_extension

    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    cmd = [os.environ.get("CXX", "c++"), "-O2", "-std=c++20", "-shared", "-fPIC", "-w",
           f"-D_GLIBCXX_USE_CXX11_ABI={abi}"]
    cmd += [f"-I{p}" for p in cpp_extension.include_paths()]
    cmd += [str(source), "-o", str(output)]
    for p in cpp_extension.library_paths():
        cmd += [f"-L{p}", f"-Wl,-rpath,{p}"]
    cmd += ["-lc10", "-ltorch_cpu", "-ltorch"]
    runtime = cxx_runtime()  # (before the compiler's own -lstdc++, which then adds nothing)
    return cmd + ([runtime] if runtime else [])


def own_runtime(path: Path) -> bool:
    """Whether the built library at ``path`` defines C++ runtime functions itself (a static
    libstdc++ copied in) instead of taking them from the shared one; False where ``nm`` is absent."""
    nm = shutil.which("nm")
    if nm is None:
        return False
    res = subprocess.run([nm, "-D", "--defined-only", str(path)], capture_output=True, text=True)
    return res.returncode == 0 and any(line.split()[-1:] == [_RUNTIME_PROBE] for line in res.stdout.splitlines())


def library_path() -> Path:
    """Where the library built from the current source for this torch lives (built or not)."""
    from .compiler import cache_dir

    text = SOURCE.read_bytes()
    command = compile_command(SOURCE, Path("torch_ops.so"))
    tag = hashlib.sha256(text + "\0".join([torch.__version__, sys.platform, *command]).encode()).hexdigest()[:20]
    return Path(cache_dir()) / "torch-ops" / f"torch_ops-{tag}.so"


def build(path: Path) -> None:
    """Compile the library to ``path`` (atomically: a concurrent build wins or loses whole)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=path.parent)
    os.close(fd)
    try:
        res = subprocess.run(compile_command(SOURCE, Path(tmp)), capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"building {SOURCE.name} failed ({res.returncode}):\n{res.stderr[-4000:]}")
        if own_runtime(Path(tmp)):
            raise RuntimeError(f"building {SOURCE.name}: the library carries its own copy of the C++ runtime "
                               f"(the compiler linked a static libstdc++; two runtimes in one process disagree); "
                               f"set $CXX to a compiler whose shared libstdc++ is installed")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def build_if_missing() -> Path:
    """The library's path, built first where it is not there yet."""
    path = library_path()
    if not path.exists():
        build(path)
    return path


def ensure() -> bool:
    """Build (once per source and torch version) and load the library; True where it serves."""
    global _state, _lib, reason
    with _lock:
        if _state is not None:
            return _state
        if not enabled():
            _state, reason = False, f"${ENV}=0"
            return False
        try:
            from . import _driver

            path = build_if_missing()
            torch.ops.load_library(str(path))
            lib = ctypes.CDLL(str(path))
            _driver.driver()
            addresses = (ctypes.c_uint64 * len(DRIVER_ENTRY_POINTS))(
                *[ctypes.cast(_driver._libcuda_raw(n), ctypes.c_void_p).value for n in DRIVER_ENTRY_POINTS])
            if lib.pycudaflash_fast_init(addresses, len(DRIVER_ENTRY_POINTS)) != 0:
                raise RuntimeError("pycudaflash_fast_init refused the driver's entry points")
            _lib, _state, reason = lib, True, f"loaded from {path}"
        except Exception as exc:  # (reported once; the Python implementations serve)
            _state, reason = False, f"{type(exc).__name__}: {exc}"
            warnings.warn(f"pycudaflash: the C++ host path of the torch operators is unavailable, the Python "
                          f"path serves CUDA tensors (same results, more host time per call): {reason}. "
                          f"Set {ENV}=0 to choose the Python path without this warning.", RuntimeWarning,
                          stacklevel=3)
        return _state


def status() -> str:
    """One line on the C++ path in this process, without building or loading it."""
    if not enabled():
        return f"off (${ENV}=0)"
    if _state is not None:
        return reason if _state else f"unavailable: {reason}"
    try:
        path = library_path()
    except Exception as exc:  # (no kernel cache directory without PyCUDA's platformdirs)
        return f"n/a, no kernel cache directory ({type(exc).__name__}: {exc})"
    if path.exists():
        return f"built, not loaded yet: {path}"
    return f"not built yet (the first CUDA call builds it into {path.parent})"


def clear() -> None:
    """Forget the C++ path's plans (:func:`pycudaflash._calls.clear`)."""
    if _lib is not None:
        _lib.pycudaflash_fast_clear()
