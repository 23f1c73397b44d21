"""Masking semantics shared by every backend.

A query row ``i`` (0-based, ``0 <= i < Nq``) of batch element ``b`` may attend
to key ``j`` (``0 <= j < Nk``) when every active condition holds:

* ``causal='top_left'`` (or ``True``): ``j <= i``  (torch SDPA ``is_causal``).
* ``causal='bottom_right'``: ``j <= i + Nk - Nq``  (FlashAttention's alignment).
* ``window=(left, right)``: ``i + off - left <= j <= i + off + right``, where
  ``off = Nk - Nq`` for ``causal='bottom_right'`` and ``0`` otherwise; a side that
  is ``None`` or ``-1`` is unbounded.
* ``key_lengths[b]``: ``j < key_lengths[b]`` (padding of the keys).
* bool ``mask[b, h, i, j]`` is True (True = attend, as in torch SDPA).

A float ``mask`` is added to the scaled scores (``-inf`` allowed).  A row that
sees no key (or only keys with a ``-inf`` bias) gives ``out = 0``,
``lse = -inf`` and zero gradients.

The causal, window and key-length conditions together form a *band*: row ``i``
sees exactly the keys ``j`` with ``i + lo_off <= j <= i + hi_off`` and
``j < key_length``.  Kernels use the band to skip whole key tiles.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

CAUSAL_MODES = ("none", "top_left", "bottom_right")

#: Stand-in for an unbounded band side; larger than any supported length.
BAND_UNBOUNDED = 1 << 30


def normalize_causal(causal: object) -> str:
    """Map the public ``causal`` argument to one of :data:`CAUSAL_MODES`."""
    if causal is False or causal is None:
        return "none"
    if causal is True:
        return "top_left"
    if isinstance(causal, str) and causal in ("top_left", "bottom_right"):
        return causal
    raise ValueError(
        f"causal must be False, True, 'top_left' or 'bottom_right', got {causal!r}"
    )


def normalize_window(window: object) -> tuple[int, int]:
    """Map ``window`` to ``(left, right)`` with ``-1`` meaning unbounded."""
    if window is None:
        return (-1, -1)
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window must be None or a pair (left, right), got {window!r}")
    sides = []
    for name, side in zip(("left", "right"), window):
        if side is None:
            sides.append(-1)
            continue
        if isinstance(side, bool) or not isinstance(side, (int,)) and not hasattr(side, "__index__"):
            raise TypeError(f"window {name} must be an int or None, got {side!r}")
        side = int(side.__index__()) if not isinstance(side, int) else side
        if side < -1:
            raise ValueError(f"window {name} must be >= 0 (or -1/None for unbounded), got {side}")
        sides.append(side)
    return (sides[0], sides[1])


def normalize_scale(scale: object, head_dim: int) -> float:
    """``scale`` defaults to ``1/sqrt(D)``; it must be a finite real number."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim)
    if isinstance(scale, bool):
        raise TypeError("scale must be a real number, got a bool")
    try:
        value = float(scale)
    except (TypeError, ValueError):
        raise TypeError(f"scale must be a real number, got {scale!r}") from None
    if not math.isfinite(value):
        raise ValueError(f"scale must be finite, got {value}")
    return value


@dataclass(frozen=True)
class Band:
    """Row ``i`` sees keys ``j`` with ``i + lo_off <= j <= i + hi_off``."""

    lo_off: int
    hi_off: int

    def key_range(self, i0: int, i1: int, nk: int) -> tuple[int, int]:
        """Half-open range of keys seen by any row in ``[i0, i1)`` (may be empty)."""
        lo = max(0, i0 + self.lo_off)
        hi = min(nk, i1 - 1 + self.hi_off + 1)
        return lo, max(lo, hi)

    def query_range(self, j0: int, j1: int, nq: int) -> tuple[int, int]:
        """Half-open range of rows that see any key in ``[j0, j1)`` (may be empty)."""
        lo = max(0, j0 - self.hi_off)
        hi = min(nq, j1 - 1 - self.lo_off + 1)
        return lo, max(lo, hi)


def band(nq: int, nk: int, causal: str, left: int, right: int) -> Band:
    """The band of the causal and window conditions (key lengths excluded)."""
    off = nk - nq if causal == "bottom_right" else 0
    lo = off - left if left >= 0 else -BAND_UNBOUNDED
    hi = off + right if right >= 0 else BAND_UNBOUNDED
    if causal != "none":
        hi = min(hi, off)
    return Band(lo, hi)
