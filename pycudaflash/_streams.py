"""The stream a call runs on, as a raw ``CUstream`` handle.

Accepted: a pycuda ``Stream``, a torch or cupy stream, any object with the
``__cuda_stream__`` protocol (cuda.core), a ``cuda.bindings`` ``CUstream``,
or a plain integer handle (0 is the legacy default stream).  Without one, a
call on torch tensors runs on torch's current stream of their device, a call
on cupy arrays on cupy's current stream, anything else on the default stream.
"""

from __future__ import annotations

import sys
from typing import Any

__all__ = ["stream_handle", "default_stream"]


def stream_handle(stream: Any) -> int:
    """The ``CUstream`` handle of a stream object (see the module docstring).

    Raises
    ------
    TypeError
        For anything that is not one of the accepted stream kinds.
    """
    if isinstance(stream, int) and not isinstance(stream, bool):
        if stream < 0:
            raise ValueError(f"a stream handle must be >= 0, got {stream}")
        return stream
    proto = getattr(stream, "__cuda_stream__", None)
    if callable(proto):
        return int(proto()[1])
    for attr in ("cuda_stream", "ptr", "handle"):  # torch, cupy, pycuda
        h = getattr(stream, attr, None)
        if isinstance(h, int) and not isinstance(h, bool):
            return h
    if type(stream).__name__ == "CUstream":  # cuda.bindings
        return int(stream)
    raise TypeError(
        "stream must be None, a pycuda.driver.Stream, a torch.cuda.Stream, a cupy stream, an object "
        f"with __cuda_stream__, a CUstream or an int handle; got {type(stream).__name__}"
    )


def default_stream(obj: Any) -> int:
    """The stream a call with ``stream=None`` runs on, from its first array ``obj``."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        return torch._C._cuda_getCurrentRawStream(obj.device.index)
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(obj, cupy.ndarray):
        return int(cupy.cuda.get_current_stream().ptr)
    return 0
