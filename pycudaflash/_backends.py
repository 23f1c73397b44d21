"""Which backends are usable here, and which one a call runs on."""

from __future__ import annotations

import functools
from typing import Any, List, Optional, Tuple

from ._problem import Problem

BACKENDS = ("cuda", "numpy")


@functools.lru_cache(maxsize=None)
def cuda_status() -> Tuple[bool, str]:
    """``(usable, reason)``: whether PyCUDA (which compiles the kernels) and NVIDIA's
    cuda-bindings (which launch them) import, and the driver sees a CUDA device."""
    try:
        import pycuda.compiler  # noqa: F401  (imported only to see that it imports)
    except Exception as exc:  # ImportError, or a missing libcuda
        return False, f"PyCUDA is not importable ({type(exc).__name__}: {exc})"
    try:
        from . import _driver

        _driver.driver()
        count = int(_driver.check("cuDeviceGetCount"))
    except ImportError as exc:
        return False, f"cuda-bindings is not importable ({exc}): pip install cuda-bindings"
    except Exception as exc:
        return False, f"the CUDA driver could not be initialised ({type(exc).__name__}: {exc})"
    if count < 1:
        return False, "no CUDA device is present"
    return True, f"{count} CUDA device(s)"


def available_backends() -> List[str]:
    """Backends usable in this process, best first."""
    return (["cuda"] if cuda_status()[0] else []) + ["numpy"]


def choose_backend(prob: Problem, backend: Optional[str], stream: Any) -> str:
    """Pick the backend for a validated problem; raise if the request is impossible."""
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be None, 'cuda' or 'numpy', got {backend!r}")
    if stream is not None:
        from ._streams import stream_handle

        stream_handle(stream)  # (TypeError for anything that is not a stream)
    if prob.on_device:
        if backend == "numpy":
            raise ValueError("backend='numpy' needs host (numpy) arrays, got device arrays")
        return "cuda"
    if backend == "numpy":
        return "numpy"
    usable, reason = cuda_status()
    if backend == "cuda" and not usable:
        raise RuntimeError(f"backend='cuda' was requested but {reason}")
    return "cuda" if usable else "numpy"
