"""Validated, normalised descriptions of one attention call.

``pycudaflash._validate`` builds these from the public arguments; the backends
(``pycudaflash.cpu`` and ``pycudaflash.cuda_backend``) consume them and never
look at the user's objects again except through :class:`Operand`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

from .semantics import Band


@dataclass(frozen=True)
class Operand:
    """One array argument, host or device, described uniformly.

    ``strides`` are in elements (not bytes) and may be 0 on broadcast
    dimensions (masks only).  For host operands ``array`` is the numpy array
    (a view with exactly ``shape``/``strides``) and ``ptr`` is 0; for device
    operands ``ptr`` is the device address of element ``[0, ..., 0]``.
    """

    name: str
    kind: str  # 'host' | 'device'
    obj: Any  # the object the caller passed
    shape: tuple
    strides: tuple
    dtype: np.dtype
    ptr: int = 0
    array: Optional[np.ndarray] = None
    read_only: bool = False  # device operands: the exporter's read-only flag

    @property
    def on_device(self) -> bool:
        return self.kind == "device"


@dataclass(frozen=True)
class Problem:
    """A validated forward or backward call.

    Shapes: q (B, H, Nq, D); k, v (B, Hkv, Nk, D) with ``Hkv`` dividing ``H``
    (query head ``h`` reads K/V head ``h // (H // Hkv)``); out like q; lse
    (B, H, Nq).  ``score_mod``/``mask_mod`` are :class:`pycudaflash.mods.Modifier`
    objects reading the tensors of ``mod_tensors``: host arrays as given in a
    host call; in a device call, device arrays as :class:`Operand` (float32,
    int32 or bool) and host arrays converted to those types.
    ``mask`` is already broadcast to (B, H, Nq, Nk) (zero strides where the
    caller's mask had size-1 or missing dimensions).  ``key_lengths`` is a
    validated host int32 array of shape (B,) with values in [0, Nk].
    ``out``/``lse`` are caller-provided output buffers in the forward pass and
    the saved forward results (inputs) in the backward pass.
    """

    B: int
    H: int
    Nq: int
    Nk: int
    D: int
    dtype: np.dtype
    scale: float
    causal: str  # 'none' | 'top_left' | 'bottom_right'
    window_left: int  # -1 = unbounded
    window_right: int  # -1 = unbounded
    band: Band
    on_device: bool
    q: Operand
    k: Operand
    v: Operand
    out: Optional[Operand] = None
    lse: Optional[Operand] = None
    mask: Optional[Operand] = None
    mask_kind: str = "none"  # 'none' | 'bool' | 'float'
    key_lengths: Optional[np.ndarray] = None
    # backward only
    dout: Optional[Operand] = None
    dq: Optional[Operand] = None
    dk: Optional[Operand] = None
    dv: Optional[Operand] = None
    deterministic: bool = False
    extra: dict = field(default_factory=dict)
    Hkv: int = 0  # K/V heads (0: H)
    score_mod: Any = None
    mask_mod: Any = None
    mod_tensors: Optional[dict] = None
    block_map: Any = None  # a device call's pycudaflash.BlockMap (holding the block maps), or None

    @property
    def plain(self) -> bool:
        """No modifier: what every backend runs."""
        return self.score_mod is None and self.mask_mod is None

    @property
    def kv_heads(self) -> int:
        """Heads of k and v (``Hkv``)."""
        return self.Hkv or self.H
