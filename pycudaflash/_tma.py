"""TMA tensor maps of the Hopper kernels' operands (see ``cuda_src/flash_tma.cuh``).

A tensor map describes a ``(B, H, N, D)`` float16 or bfloat16 operand to the
Tensor Memory Accelerator: a kernel copies a box of 64 head-dim columns x
``rows`` rows of one ``(b, h)`` plane into shared memory with one instruction,
in the 128-byte swizzle its ``wgmma`` operands use, and elements outside the
tensor (rows past ``N``, columns past ``D``) arrive as zeros.

:func:`tile_map` checks what the hardware requires (16-byte aligned row, head
and batch strides below 2**40, at most 2**32 elements a dimension, a
contiguous head dim, no broadcast dimension) and raises ``ValueError``
naming the first thing it cannot describe; :func:`tma_reason` says the same
without raising, for choosing a kernel.  :func:`encode` asks the driver for
the 128 bytes a kernel receives (``TmaMap``); the base address must be 16-byte
aligned.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

from . import _driver

#: Bytes of one swizzled shared-memory row: the inner extent of every box.
ATOM_BYTES = 128
#: Global addresses and strides: multiples of this many bytes.
ALIGN = 16
#: Largest box extent, stride and dimension the hardware takes.
MAX_BOX = 256
MAX_STRIDE = 2 ** 40
MAX_DIM = 2 ** 32
#: Bytes of an encoded map.
MAP_BYTES = 128
ELEM_BYTES = {"float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class TileMap:
    """A tensor map before encoding, innermost dimension first.

    ``dims``: ``(D, N, H, B)`` in elements; ``strides``: bytes between
    consecutive rows, heads and batch elements; ``box``: ``(64, rows, 1, 1)``
    (64 columns of 2 bytes: one swizzled row).
    """

    dtype: str
    dims: Tuple[int, int, int, int]
    strides: Tuple[int, int, int]
    box: Tuple[int, int, int, int]


def tma_reason(shape: Sequence[int], strides: Sequence[int], dtype: str, rows: int) -> Optional[str]:
    """Why a ``(B, H, N, D)`` operand with element ``strides`` cannot have a tensor map with
    boxes of ``rows`` rows; None where it can."""
    if dtype not in ELEM_BYTES:
        return f"no tensor maps for dtype {dtype!r} (float16 and bfloat16 only)"
    if len(shape) != 4 or len(strides) != 4:
        return f"a tensor map describes a (B, H, N, D) operand, got shape {tuple(shape)}"
    if not 1 <= rows <= MAX_BOX:
        return f"a box has 1 to {MAX_BOX} rows, got {rows}"
    es = ELEM_BYTES[dtype]
    if 64 * es != ATOM_BYTES:
        return f"a box's 64 columns must fill one {ATOM_BYTES}-byte swizzled row"
    B, H, N, D = (int(x) for x in shape)
    if min(B, H, N, D) < 1:
        return f"every dimension must be at least 1, got shape {tuple(shape)}"
    if max(B, H, N, D) > MAX_DIM:
        return f"a dimension exceeds {MAX_DIM} elements"
    if int(strides[3]) != 1 and D > 1:
        return f"the head dim must be contiguous (stride 1), got stride {strides[3]}"
    for name, n, st in (("row", N, strides[2]), ("head", H, strides[1]), ("batch", B, strides[0])):
        st = int(st)
        if n > 1 and st == 0:
            return f"the {name} dimension is broadcast (stride 0)"
        if n > 1 and (st * es % ALIGN or st < 0):
            return f"the {name} stride ({st * es} bytes) is not a positive multiple of {ALIGN} bytes"
        if st * es >= MAX_STRIDE:
            return f"the {name} stride ({st * es} bytes) is not below 2**40"
    return None


def tile_map(shape: Sequence[int], strides: Sequence[int], dtype: str, rows: int) -> TileMap:
    """The tensor map of a ``(B, H, N, D)`` operand with element ``strides``, boxes of ``rows``
    rows by 64 columns; ``ValueError`` where the hardware cannot describe it (:func:`tma_reason`)."""
    why = tma_reason(shape, strides, dtype, rows)
    if why is not None:
        raise ValueError(why)
    B, H, N, D = (int(x) for x in shape)
    es = ELEM_BYTES[dtype]
    # (a dimension of one element is never stepped along: it gets the packed stride, the
    # extent of the dimensions inside it rounded up to ALIGN)
    out, inner = [], -(-D * es // ALIGN) * ALIGN
    for n, st in ((N, strides[2]), (H, strides[1]), (B, strides[0])):
        out.append(int(st) * es if n > 1 else inner)
        inner = out[-1] * n
    return TileMap(dtype, (D, N, H, B), tuple(out), (ATOM_BYTES // es, rows, 1, 1))


#: ``cuTensorMapEncodeTiled``'s enumeration values of every map here (the driver's ABI, as cuda.h
#: numbers them): data types, no interleave, the 128-byte swizzle, L2 promotion of 256 bytes and
#: out-of-bounds elements read as zeros.
DATA_TYPES = {"float16": 6, "bfloat16": 9}
INTERLEAVE_NONE, SWIZZLE_128B, L2_PROMOTION_256B, OOB_FILL_ZEROS = 0, 3, 3, 0


def encode_args(tm: TileMap) -> Tuple[int, ...]:
    """The integer arguments of ``cuTensorMapEncodeTiled`` for ``tm`` after the base address, as
    the C++ host path receives them: data type, rank, then ``rank`` dims, ``rank - 1`` byte
    strides, ``rank`` box extents, ``rank`` element strides, interleave, swizzle, L2 promotion,
    out-of-bounds fill."""
    rank = len(tm.dims)
    return (DATA_TYPES[tm.dtype], rank, *tm.dims, *tm.strides, *tm.box, *([1] * rank),
            INTERLEAVE_NONE, SWIZZLE_128B, L2_PROMOTION_256B, OOB_FILL_ZEROS)


def encode(tm: TileMap, ptr: int) -> bytes:
    """The 128 bytes of ``tm`` over the operand at device address ``ptr`` (16-byte aligned),
    from the driver (``cuTensorMapEncodeTiled``)."""
    if int(ptr) % ALIGN:
        raise ValueError(f"a tensor map's base address must be {ALIGN}-byte aligned, got {int(ptr):#x}")
    d = _driver.driver()
    a = encode_args(tm)
    rank = a[1]
    dims, strides = a[2:2 + rank], a[2 + rank:1 + 2 * rank]
    box, elem = a[1 + 2 * rank:1 + 3 * rank], a[1 + 3 * rank:1 + 4 * rank]
    interleave, swizzle, l2, oob = a[1 + 4 * rank:]
    m = _driver.check("cuTensorMapEncodeTiled", d.CUtensorMapDataType(a[0]), rank, int(ptr),
                      [d.cuuint64_t(x) for x in dims], [d.cuuint64_t(x) for x in strides],
                      [d.cuuint32_t(x) for x in box], [d.cuuint32_t(x) for x in elem],
                      d.CUtensorMapInterleave(interleave), d.CUtensorMapSwizzle(swizzle),
                      d.CUtensorMapL2promotion(l2), d.CUtensorMapFloatOOBfill(oob))
    words = [int(w) for w in m.opaque]
    return struct.pack(f"<{len(words)}Q", *words)
