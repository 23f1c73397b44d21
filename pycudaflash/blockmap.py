"""Block maps a caller keeps: a mask summarised once on the GPU and reused by every call.

The kernels skip the tiles of the score matrix that a bool mask or a mask
modifier leaves empty and take the unmasked path on those it leaves full
(``flash_tile_map`` in ``cuda_src/flash_common.cuh``).  Without a
:class:`BlockMap` a call builds that summary (its *block maps*, one per
tile shape of its kernels) at every call; with one, the first call of each
tile shape builds it into memory the BlockMap owns and every later call,
of any layer or step with the same mask, reads it as it is::

    bm = pycudaflash.BlockMap(mask_mod="doc[b, i] == doc[b, j]", mod_tensors=dict(doc=doc))
    for layer in layers:
        out = flash_attention(q, k, v, block_map=bm)

A BlockMap holds its mask, mask modifier and modifier tensors and passes
them to the calls (which then take no ``mask`` or ``mask_mod`` of their
own).  It is a snapshot: the maps are built from the values those arrays
hold when a map is first built, and a later change to them is not seen
by the maps (make a new BlockMap instead).  The NumPy backend takes the
mask and modifier from it and needs no maps.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

__all__ = ["BlockMap"]


class BlockMap:
    """The block maps of a bool mask, a mask modifier or both, built on the GPU once and reused.

    Parameters
    ----------
    mask : bool array, optional
        Broadcastable to (B, H, Nq, Nk), True = attend: as ``mask`` of
        :func:`pycudaflash.flash_attn_forward` (a device array for device
        calls).  A float mask has no block map: pass it to the calls.
    mask_mod : str or pycudaflash.mods.Modifier, optional
        As ``mask_mod`` of :func:`pycudaflash.flash_attn_forward`.
    mod_tensors : mapping of str to array, optional
        The tensors ``mask_mod`` reads.  A call's ``score_mod`` may read
        them too, and the call may add tensors of other names.

    Notes
    -----
    Maps are built on the stream of the first call that needs them, which
    then waits for them (once), so that calls on any stream may read them
    afterwards; a call being captured into a CUDA graph cannot build one
    (run it once before the capture).  Their memory is released with the
    BlockMap.  Thread-safe.
    """

    def __init__(self, mask: Any = None, mask_mod: Any = None, mod_tensors: Optional[Mapping[str, Any]] = None
                 ) -> None:
        if mask is None and mask_mod is None:
            raise ValueError("a BlockMap needs a bool mask, a mask_mod or both")
        if mask is not None and not _is_bool(mask):
            raise TypeError(f"a BlockMap's mask must be a bool array (a float mask has no block map), "
                            f"got dtype {getattr(mask, 'dtype', type(mask).__name__)}")
        if mod_tensors is not None and not isinstance(mod_tensors, Mapping):
            raise TypeError(f"mod_tensors must be a mapping of names to arrays, got {type(mod_tensors).__name__}")
        if mod_tensors and mask_mod is None:
            raise ValueError("mod_tensors given without a mask_mod")
        if mask_mod is not None:
            from .mods import as_modifier

            mask_mod = as_modifier(mask_mod, mod_tensors, "mask")
        self.mask = mask
        self.mask_mod = mask_mod
        self.mod_tensors: Dict[str, Any] = dict(mod_tensors or {})
        self._maps: Dict[Tuple[Any, ...], int] = {}
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _free, self._maps)
        self._finalizer.atexit = False  # (at exit the process's memory goes with it)

    def __repr__(self) -> str:
        parts = []
        if self.mask is not None:
            parts.append(f"mask of shape {tuple(getattr(self.mask, 'shape', ()))}")
        if self.mask_mod is not None:
            parts.append(f"mask_mod {self.mask_mod.src!r}")
        return f"BlockMap({', '.join(parts)}; {len(self._maps)} maps built)"

    def block_mask(self, B: int, H: int, Nq: int, Nk: int, *, block_q: int = 128, block_k: int = 128,
                   causal: Any = False, window: Any = None, key_lengths: Any = None) -> Any:
        """The host summary of this mask for a call of these sizes and options, computed with
        numpy (:func:`pycudaflash.blockmask.build_block_mask`, the reference of the GPU maps):
        its ``kinds`` per tile, ``sparsity`` (the fraction of tiles a call skips) and bits.

        Parameters
        ----------
        B, H, Nq, Nk : int
            The call's batch, heads, query and key lengths.
        block_q, block_k : int, optional
            Tile sizes of the summary.
        causal, window, key_lengths : optional
            The call's band, as in :func:`pycudaflash.flash_attn_forward`.

        Returns
        -------
        pycudaflash.blockmask.BlockMask
        """
        from .blockmask import build_block_mask
        from .testing import to_host

        mask = None if self.mask is None else to_host(self.mask)
        tensors = {name: to_host(t) for name, t in self.mod_tensors.items()}
        return build_block_mask(B, H, Nq, Nk, block_q=block_q, block_k=block_k, causal=causal, window=window,
                                mask=mask, key_lengths=key_lengths, mask_mod=self.mask_mod,
                                mod_tensors=tensors or None)

    def call_args(self, mask: Any, mask_mod: Any, mod_tensors: Optional[Mapping[str, Any]]
                  ) -> Tuple[Any, Any, Optional[Dict[str, Any]]]:
        """A call's ``mask``, ``mask_mod`` and ``mod_tensors`` with this BlockMap's: the call may
        give no mask or mask_mod of its own (but these same objects again), and a tensor it names
        like one of the BlockMap's must be the same object."""
        if (mask is not None and mask is not self.mask) or (mask_mod is not None and mask_mod is not self.mask_mod):
            raise ValueError("a call with a block_map takes its mask and mask_mod from the BlockMap: "
                             "pass them to the BlockMap, not to the call")
        if mod_tensors is not None and not isinstance(mod_tensors, Mapping):
            raise TypeError(f"mod_tensors must be a mapping of names to arrays, got {type(mod_tensors).__name__}")
        merged = dict(self.mod_tensors)
        for name, t in (mod_tensors or {}).items():
            if name in merged and merged[name] is not t:
                raise ValueError(f"mod_tensors[{name!r}] of the call is not the BlockMap's tensor of that name")
            merged[name] = t
        return self.mask, self.mask_mod, (merged or None)

    def address(self, key: Tuple[Any, ...], nbytes: int, alloc: Callable[[int], int]) -> Tuple[int, bool]:
        """The device address of the map ``key`` (context, tile shape, planes, sizes: the launch
        code's), and whether it was allocated now (with ``alloc(nbytes)``) and is still to be built."""
        with self._lock:
            ptr = self._maps.get(key)
            if ptr is not None:
                return ptr, False
            ptr = self._maps[key] = alloc(nbytes)
            return ptr, True

    def forget(self, key: Tuple[Any, ...]) -> None:
        """Drop map ``key`` (its build did not happen); its memory is freed."""
        with self._lock:
            ptr = self._maps.pop(key, None)
        if ptr is not None:
            _free({key: ptr})


def as_block_map(block_map: Any) -> Optional[BlockMap]:
    """``block_map`` checked: None or a :class:`BlockMap`."""
    if block_map is not None and not isinstance(block_map, BlockMap):
        raise TypeError(f"block_map must be a pycudaflash.BlockMap, got {type(block_map).__name__}")
    return block_map


def call_args(block_map: Any, mask: Any, mask_mod: Any, mod_tensors: Any) -> Tuple[Any, Any, Any]:
    """A call's mask, mask_mod and mod_tensors, those of ``block_map`` merged in where there is one."""
    bm = as_block_map(block_map)
    return (mask, mask_mod, mod_tensors) if bm is None else bm.call_args(mask, mask_mod, mod_tensors)


def _is_bool(a: Any) -> bool:
    dtype = getattr(a, "dtype", None)
    if dtype is None:
        import numpy as np

        dtype = np.asarray(a).dtype
    return str(dtype) in ("bool", "torch.bool")


def _free(maps: Dict[Tuple[Any, ...], int]) -> None:
    """Release the maps' memory (each in its context: the key's first entry)."""
    from . import _driver

    for key, ptr in list(maps.items()):
        _, pushed = _driver.enter(_driver.context_device(key[0]))
        try:
            _driver.mem_free(ptr)
        finally:
            _driver.leave(pushed)
    maps.clear()
