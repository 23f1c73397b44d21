"""Block masks: which (query tile, key tile) pairs of a mask hold any attended element.

A dense mask, a mask modifier and the band (causal, window, key lengths) are
summarised once per (batch, head, query tile, key tile) as

* ``EMPTY`` (0): no element attended: the tile pair is skipped;
* ``FULL`` (2): every element attended: no per-element mask is needed;
* ``PARTIAL`` (1): some are: the elements come from :attr:`BlockMask.bits`,
  the mask bit-packed along the keys (bit ``j % 32`` of word ``j // 32``).

A :class:`BlockMask` is built once (here with numpy) and can be reused by
every call and layer with the same mask and tile sizes, as FlexAttention's
block mask is.  :meth:`BlockMask.retile` coarsens a summary to a kernel's own
tile sizes (a multiple of the ones it was built with), and
:meth:`BlockMask.key_lists` / :meth:`BlockMask.query_lists` give the tiles a
forward or a dK/dV pass would visit, PARTIAL and FULL apart
(:class:`TileLists`).  This module is the reference of the summary.  The
CUDA kernels build their own summary of a bool mask or a mask modifier on
the GPU at every call (``flash_tile_map`` in ``cuda_src/flash_common.cuh``:
the kinds, without the bits) and do not take a :class:`BlockMask`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .semantics import band, normalize_causal, normalize_window

__all__ = ["BlockMask", "TileLists", "build_block_mask", "EMPTY", "PARTIAL", "FULL"]

EMPTY, PARTIAL, FULL = 0, 1, 2


@dataclass(frozen=True)
class BlockMask:
    """The block summary of a mask (see the module documentation).

    Attributes
    ----------
    kinds : ndarray of int8, shape (B, H, Tr, Tc)
        EMPTY, PARTIAL or FULL per (batch, head, query tile, key tile).
    bits : ndarray of uint32, shape (B, H, Nq, ceil(Nk / 32))
        The element mask, bit-packed along the keys.
    block_q, block_k : int
        Tile sizes ``Br`` and ``Bc``.
    nq, nk : int
        Query and key lengths.
    """

    kinds: np.ndarray
    bits: np.ndarray
    block_q: int
    block_k: int
    nq: int
    nk: int

    def allowed(self) -> np.ndarray:
        """The element mask, (B, H, Nq, Nk) bool, unpacked from :attr:`bits`."""
        j = np.arange(self.nk)
        return ((self.bits[..., j // 32] >> (j % 32).astype(np.uint32)) & 1).astype(bool)

    @property
    def sparsity(self) -> float:
        """Fraction of tile pairs that are EMPTY."""
        return float(np.mean(self.kinds == EMPTY))

    def retile(self, block_q: int, block_k: int) -> "BlockMask":
        """The same mask summarised with larger tiles, multiples of these (a kernel's own tile
        sizes): a tile of the new grid is EMPTY or FULL when every tile of this grid it covers
        is, else PARTIAL.  The bits are shared."""
        for name, new, old in (("block_q", block_q, self.block_q), ("block_k", block_k, self.block_k)):
            if not isinstance(new, (int, np.integer)) or new < old or new % old:
                raise ValueError(f"{name} must be a multiple of {old}, got {new!r}")
        fq, fk = block_q // self.block_q, block_k // self.block_k
        B, H, Tr, Tc = self.kinds.shape
        Tr2, Tc2 = -(-Tr // fq), -(-Tc // fk)
        # Sub-tiles past Nq or Nk do not exist (-1); every new tile covers at least one that does.
        padded = np.full((B, H, Tr2 * fq, Tc2 * fk), -1, dtype=np.int8)
        padded[:, :, :Tr, :Tc] = self.kinds
        blocks = padded.reshape(B, H, Tr2, fq, Tc2, fk)
        absent = blocks == -1
        empty = ((blocks == EMPTY) | absent).all(axis=(3, 5))
        full = ((blocks == FULL) | absent).all(axis=(3, 5))
        kinds = np.where(empty, EMPTY, np.where(full, FULL, PARTIAL)).astype(np.int8)
        return BlockMask(kinds=kinds, bits=self.bits, block_q=int(block_q), block_k=int(block_k), nq=self.nq,
                         nk=self.nk)

    def key_lists(self) -> "TileLists":
        """For each (batch, head, query tile) the key tiles to visit, as a forward pass walks them
        (EMPTY ones left out), the PARTIAL ones and the FULL ones apart (:class:`TileLists`)."""
        return _lists(self.kinds)

    def query_lists(self) -> "TileLists":
        """For each (batch, head, key tile) the query tiles to visit, as a dK/dV pass walks them."""
        return _lists(np.swapaxes(self.kinds, 2, 3))


@dataclass(frozen=True)
class TileLists:
    """Tiles to visit per (batch, head, outer tile), in increasing order, padded with -1.

    Attributes
    ----------
    partial_count, full_count : ndarray of int32, shape (B, H, T_outer)
    partial, full : ndarray of int32, shape (B, H, T_outer, T_inner)
        The first ``*_count`` entries of each row are the inner tiles of that kind.
    """

    partial_count: np.ndarray
    partial: np.ndarray
    full_count: np.ndarray
    full: np.ndarray


def _lists(kinds: np.ndarray) -> TileLists:
    """TileLists of a (B, H, T_outer, T_inner) kinds array (inner tiles along the last axis)."""
    out = []
    for kind in (PARTIAL, FULL):
        hit = kinds == kind
        count = hit.sum(axis=-1).astype(np.int32)
        # A stable sort of (not hit) puts the hit tiles first, in increasing order.
        order = np.argsort(~hit, axis=-1, kind="stable").astype(np.int32)
        inner = np.arange(kinds.shape[-1])
        out += [count, np.where(inner < count[..., None], order, np.int32(-1)).astype(np.int32)]
    return TileLists(partial_count=out[0], partial=out[1], full_count=out[2], full=out[3])


def build_block_mask(B: int, H: int, Nq: int, Nk: int, *, block_q: int = 64, block_k: int = 64,
                     causal: Any = False, window: Any = None, mask: Any = None, key_lengths: Any = None,
                     mask_mod: Any = None, mod_tensors: Any = None) -> BlockMask:
    """Summarise the masking rules of a call (:mod:`pycudaflash.semantics`).

    Parameters
    ----------
    B, H, Nq, Nk : int
        Batch, heads, query and key lengths.
    block_q, block_k : int
        Tile sizes.
    causal, window, key_lengths : optional
        As in :func:`pycudaflash.flash_attn_forward`.
    mask : bool array broadcastable to (B, H, Nq, Nk), optional
        True = attend.  (A float bias is not a condition: it has no block
        summary.)
    mask_mod, mod_tensors : optional
        A mask modifier and its tensors (:mod:`pycudaflash.mods`).
    """
    for name, n in (("B", B), ("H", H), ("Nq", Nq), ("Nk", Nk), ("block_q", block_q), ("block_k", block_k)):
        if not isinstance(n, (int, np.integer)) or n < 1:
            raise ValueError(f"{name} must be a positive int, got {n!r}")
    mode = normalize_causal(causal)
    left, right = normalize_window(window)
    bnd = band(Nq, Nk, mode, left, right)
    i = np.arange(Nq)[:, None]
    j = np.arange(Nk)[None, :]
    allowed = np.broadcast_to((j - i >= bnd.lo_off) & (j - i <= bnd.hi_off), (B, H, Nq, Nk))
    if key_lengths is not None:
        kl = np.asarray(key_lengths).astype(np.int64).reshape(B)
        allowed = allowed & (j[None, None] < kl[:, None, None, None])
    if mask is not None:
        m = np.asarray(mask)
        if m.dtype != np.bool_:
            raise TypeError(f"a block mask summarises a bool mask, got {m.dtype}")
        allowed = allowed & np.broadcast_to(m, (B, H, Nq, Nk))
    if mask_mod is not None:
        from .mods import as_modifier, positions

        mm = as_modifier(mask_mod, mod_tensors, "mask")
        allowed = allowed & np.broadcast_to(
            mm.evaluate(**positions(B, H, range(Nq), range(Nk)), tensors=mod_tensors), (B, H, Nq, Nk))
    allowed = np.ascontiguousarray(np.broadcast_to(allowed, (B, H, Nq, Nk)))
    # Per tile pair: attended elements against the pair's size (edge tiles are smaller).
    Tr, Tc = -(-Nq // block_q), -(-Nk // block_k)
    padded = np.zeros((B, H, Tr * block_q, Tc * block_k), dtype=np.int32)
    padded[:, :, :Nq, :Nk] = allowed
    counts = padded.reshape(B, H, Tr, block_q, Tc, block_k).sum(axis=(3, 5))
    rows = np.minimum(block_q, Nq - np.arange(Tr) * block_q)
    cols = np.minimum(block_k, Nk - np.arange(Tc) * block_k)
    size = rows[:, None] * cols[None, :]
    kinds = np.where(counts == 0, EMPTY, np.where(counts == size, FULL, PARTIAL)).astype(np.int8)
    # Bits: key j is bit j % 32 of word j // 32.
    words = -(-Nk // 32)
    padded_bits = np.zeros((B, H, Nq, words * 32), dtype=np.uint32)
    padded_bits[..., :Nk] = allowed
    weights = (np.uint32(1) << np.arange(32, dtype=np.uint32))
    bits = (padded_bits.reshape(B, H, Nq, words, 32) * weights).sum(axis=-1, dtype=np.uint64).astype(np.uint32)
    return BlockMask(kinds=kinds, bits=bits, block_q=int(block_q), block_k=int(block_k), nq=Nq, nk=Nk)
