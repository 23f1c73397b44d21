"""pycudaflash: FlashAttention forward and backward as readable CUDA kernels driven by PyCUDA."""

from ._backends import available_backends, cuda_status
from ._driver import CudaError, Graph, capture
from ._calls import clear as clear_plans
from .blockmap import BlockMap
from .api import PreparedCall, flash_attn_backward, flash_attn_forward, prepare_backward, prepare_forward

__version__ = "0.1.0"

__all__ = [
    "flash_attn_forward",
    "flash_attn_backward",
    "prepare_forward",
    "prepare_backward",
    "PreparedCall",
    "BlockMap",
    "clear_plans",
    "capture",
    "Graph",
    "CudaError",
    "available_backends",
    "cuda_status",
    "__version__",
]
