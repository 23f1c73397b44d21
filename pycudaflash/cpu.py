"""NumPy backend: the tiled FlashAttention-2 algorithm of the CUDA kernels.

The loops mirror the kernels block for block, vectorised over the batch and
head dimensions (every tile is a ``(B, H, rows, cols)`` array):

* forward: the query tiles ``Qi`` of ``Br`` rows are the outer loop; for each,
  the key/value tiles ``Kj``, ``Vj`` of ``Bc`` keys that the band can reach
  are streamed through an online softmax (running row max ``mi``, running
  row sum ``li`` and an unnormalised output accumulator);
* backward: the key/value tiles are the outer loop, accumulating ``dKj`` and
  ``dVj``; the query tiles that can see them are the inner loop, adding into
  a float32 ``dQ`` accumulator.

Arithmetic is float32 whatever the storage dtype: each tile is cast to
float32 when loaded, and results are cast to the output dtype when stored.
Exponentials are natural (``np.exp``) throughout, so ``lse`` is a natural-log
log-sum-exp directly (the kernels may use ``exp2`` with ``log2(e)`` folded
into the scale; the two agree up to rounding).

Rows that see no key give ``out = 0``, ``lse = -inf`` and zero gradients,
without NaN and without numpy floating-point warnings.
"""

from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import numpy as np

from ._problem import Operand, Problem
from .mods import positions
from .semantics import Band, band

__all__ = ["forward", "backward", "run_forward", "run_backward"]

_F32 = np.float32
_NEG_INF = _F32(-np.inf)


def _tile_starts(lo: int, hi: int, block: int) -> range:
    """Starts of the grid-aligned blocks of size ``block`` that cover ``[lo, hi)``."""
    if hi <= lo:
        return range(0)
    return range((lo // block) * block, hi, block)


class _Mods:
    """The score and mask modifiers of a call (:mod:`pycudaflash.mods`) and their tensors."""

    def __init__(self, score_mod: Any, mask_mod: Any, tensors: Any, B: int, H: int) -> None:
        self.score, self.mask, self.tensors = score_mod, mask_mod, tensors
        self.B, self.H = B, H

    def positions(self, i0: int, i1: int, j0: int, j1: int) -> Dict[str, Any]:
        return dict(positions(self.B, self.H, range(i0, i1), range(j0, j1)), tensors=self.tensors)


def _tile_allowed(
    i0: int,
    i1: int,
    j0: int,
    j1: int,
    bnd: Band,
    key_lengths: Optional[np.ndarray],
    kl_min: int,
    mask: Optional[np.ndarray],
    mods: Optional[_Mods] = None,
) -> Optional[np.ndarray]:
    """Element-wise allowed-mask of tile ``[i0, i1) x [j0, j1)``.

    Combines the band, the key lengths, a bool dense mask and a mask modifier; the result
    broadcasts against ``(B, H, i1 - i0, j1 - j0)``.  ``None`` means every
    element of the tile is allowed.
    """
    allowed: Optional[np.ndarray] = None
    # Band: only built when the tile crosses one of its diagonals.
    if j0 - (i1 - 1) < bnd.lo_off or (j1 - 1) - i0 > bnd.hi_off:
        diff = np.arange(j0, j1)[None, :] - np.arange(i0, i1)[:, None]
        allowed = (diff >= bnd.lo_off) & (diff <= bnd.hi_off)
    # Key lengths: only when the tile reaches past the shortest sequence.
    if key_lengths is not None and j1 > kl_min:
        keep = np.arange(j0, j1)[None, None, None, :] < key_lengths[:, None, None, None]
        allowed = keep if allowed is None else allowed & keep
    # Bool dense mask tile.
    if mask is not None and mask.dtype == np.bool_:
        tile = mask[:, :, i0:i1, j0:j1]
        allowed = tile if allowed is None else allowed & tile
    # Mask modifier.
    if mods is not None and mods.mask is not None:
        keep = mods.mask.evaluate(**mods.positions(i0, i1, j0, j1))
        allowed = keep if allowed is None else allowed & keep
    return allowed


def _scores(
    Qi: np.ndarray,
    Kj: np.ndarray,
    scale: float,
    allowed: Optional[np.ndarray],
    mask: Optional[np.ndarray],
    i0: int,
    i1: int,
    j0: int,
    j1: int,
    mods: Optional[_Mods] = None,
    slope: bool = False,
) -> Any:
    """``Sij = scale * Qi Kj^T (+ float bias)``, the score modifier applied, ``-inf`` where
    not allowed; with ``slope`` also the modifier's derivative at the unmodified scores
    (None without a score modifier)."""
    Sij = np.matmul(Qi, np.swapaxes(Kj, -1, -2))
    Sij *= _F32(scale)
    if mask is not None and mask.dtype != np.bool_:
        # A bias beyond the float32 range rounds to +-inf, silently.
        with np.errstate(over="ignore"):
            Sij += mask[:, :, i0:i1, j0:j1].astype(_F32)
    dmod = None
    if mods is not None and mods.score is not None:
        pos = mods.positions(i0, i1, j0, j1)
        if slope:
            dmod = np.broadcast_to(mods.score.derivative().evaluate(Sij, **pos), Sij.shape).astype(_F32)
        with np.errstate(over="ignore"):
            Sij = np.broadcast_to(mods.score.evaluate(Sij, **pos), Sij.shape).astype(_F32)
    if allowed is not None:
        Sij = np.where(allowed, Sij, _NEG_INF)
    return (Sij, dmod) if slope else Sij


def _key_limit(nk: int, key_lengths: Optional[np.ndarray]) -> Tuple[int, int]:
    """``(kl_max, kl_min)``: keys past ``kl_max`` are padding for every batch."""
    if key_lengths is None or key_lengths.size == 0:
        return nk, nk
    return min(nk, int(key_lengths.max())), int(key_lengths.min())


def _keys_seen(B: int, H: int, Nq: int, Nk: int, bnd: Band, key_lengths: Optional[np.ndarray], kl_min: int,
               mask: Optional[np.ndarray], Br: int, Bc: int, mods: Optional[_Mods] = None) -> np.ndarray:
    """(B, H, Nk) bool: whether any query row may see each key.  A key no row may see is
    zeroed where it is loaded, so that a NaN or Inf stored in it changes nothing."""
    j = np.arange(Nk)
    # Band and key lengths alone: key j is seen when some row 0 <= i < Nq has lo <= j - i <= hi.
    by_band = (j >= bnd.lo_off) & (j <= Nq - 1 + bnd.hi_off)
    if key_lengths is not None:
        by_band = by_band & (j[None, :] < key_lengths[:, None])
    if (mask is None or mask.dtype != np.bool_) and (mods is None or mods.mask is None):
        return np.broadcast_to(np.broadcast_to(by_band, (B, Nk))[:, None, :], (B, H, Nk))
    # A dense bool mask or a mask modifier: the columns of every tile pair the band reaches.
    seen = np.zeros((B, H, Nk), dtype=bool)
    for j0 in range(0, Nk, Bc):
        j1 = min(j0 + Bc, Nk)
        lo, hi = bnd.query_range(j0, j1, Nq)
        for i0 in _tile_starts(lo, hi, Br):
            i1 = min(i0 + Br, Nq)
            allowed = _tile_allowed(i0, i1, j0, j1, bnd, key_lengths, kl_min, mask, mods)
            if allowed is None:
                seen[:, :, j0:j1] = True
                break
            seen[:, :, j0:j1] |= np.broadcast_to(np.asarray(allowed).any(axis=-2), (B, H, j1 - j0))
    return seen


def _load_keys(x: np.ndarray, j0: int, j1: int, seen: np.ndarray) -> np.ndarray:
    """Rows ``[j0, j1)`` of k or v in float32, one head per query head (a K/V head serves
    ``H // Hkv`` query heads), zero where no query may see the key."""
    tile = np.asarray(x[:, :, j0:j1, :], dtype=_F32)
    H = seen.shape[1]
    if tile.shape[1] != H:
        tile = np.repeat(tile, H // tile.shape[1], axis=1)
    part = seen[:, :, j0:j1]
    return tile if part.all() else np.where(part[..., None], tile, _F32(0))


def forward(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    *,
    scale: float,
    causal: str,
    window_left: int,
    window_right: int,
    mask: Optional[np.ndarray],
    key_lengths: Optional[np.ndarray],
    out: np.ndarray,
    lse: np.ndarray,
    block_q: int = 64,
    block_k: int = 64,
    score_mod: Any = None,
    mask_mod: Any = None,
    mod_tensors: Any = None,
) -> None:
    """Tiled FlashAttention-2 forward pass, written into ``out`` and ``lse``.

    Parameters
    ----------
    q : ndarray, shape (B, H, Nq, D)
    k, v : ndarrays, shape (B, H, Nk, D)
        Any strides and float dtype; tiles are computed in float32.
    scale : float
        Score scale.
    causal : {'none', 'top_left', 'bottom_right'}
        Normalised causal mode.
    window_left, window_right : int
        Window sides, ``-1`` = unbounded.
    mask : ndarray or None
        Broadcastable to (B, H, Nq, Nk): bool (True = attend) or float (added
        to the scaled scores, ``-inf`` allowed).
    key_lengths : ndarray of int, shape (B,), or None
        Keys at or past ``key_lengths[b]`` are masked.
    out : ndarray, shape (B, H, Nq, D)
        Output buffer (its dtype is the storage dtype of the result).
    lse : ndarray, shape (B, H, Nq)
        Natural-log log-sum-exp buffer (float32); ``-inf`` for rows that see
        no key.
    block_q, block_k : int
        Tile sizes ``Br`` (query rows) and ``Bc`` (keys).
    score_mod, mask_mod : pycudaflash.mods.Modifier, optional
        Modifiers (with ``mod_tensors``, the host arrays they read): the
        score modifier replaces each scaled, biased score; the mask modifier
        excludes where it is False.
    k, v may have fewer heads than q (``Hkv`` dividing ``H``): query head ``h``
    reads K/V head ``h // (H // Hkv)``.
    """
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    Br, Bc = int(block_q), int(block_k)
    if mask is not None:
        mask = np.broadcast_to(mask, (B, H, Nq, Nk))
    if key_lengths is not None:
        key_lengths = np.asarray(key_lengths, dtype=np.int64).reshape(B)
    bnd = band(Nq, Nk, causal, window_left, window_right)
    kl_max, kl_min = _key_limit(Nk, key_lengths)
    mods = _Mods(score_mod, mask_mod, mod_tensors, B, H) if score_mod is not None or mask_mod is not None else None
    key_seen = _keys_seen(B, H, Nq, Nk, bnd, key_lengths, kl_min, mask, Br, Bc, mods)
    Tr = -(-Nq // Br)

    for r in range(Tr):
        i0, i1 = r * Br, min((r + 1) * Br, Nq)
        # Load Qi and initialise the running statistics.
        Qi = np.asarray(q[:, :, i0:i1, :], dtype=_F32)
        Oi = np.zeros((B, H, i1 - i0, D), dtype=_F32)
        li = np.zeros((B, H, i1 - i0), dtype=_F32)
        mi = np.full((B, H, i1 - i0), _NEG_INF, dtype=_F32)

        # Key tiles reachable from this row tile, cut at the longest sequence.
        lo, hi = bnd.key_range(i0, i1, Nk)
        hi = min(hi, kl_max)
        for j0 in _tile_starts(lo, hi, Bc):
            j1 = min(j0 + Bc, Nk)
            # Load Kj, Vj (keys no query may see read as zeros).
            Kj, Vj = _load_keys(k, j0, j1, key_seen), _load_keys(v, j0, j1, key_seen)
            # Sij = scale Qi Kj^T + bias, masked to -inf.
            allowed = _tile_allowed(i0, i1, j0, j1, bnd, key_lengths, kl_min, mask, mods)
            Sij = _scores(Qi, Kj, scale, allowed, mask, i0, i1, j0, j1, mods)
            # New running max; a row still at -inf uses 0 as its reference.
            mi_new = np.maximum(mi, Sij.max(axis=-1))
            m_ref = np.where(mi_new == _NEG_INF, _F32(0), mi_new)
            # Pij = exp(Sij - mi_new) (0 on masked entries).
            Pij = np.exp(Sij - m_ref[..., None])
            # Rescale factor of the old statistics, exp(mi - mi_new).
            alpha = np.exp(mi - m_ref)
            # li = alpha li + rowsum(Pij).
            li = alpha * li + Pij.sum(axis=-1)
            # Oi = alpha Oi + Pij Vj.
            Oi = alpha[..., None] * Oi + np.matmul(Pij, Vj)
            mi = mi_new

        # Normalise: Oi / li and Li = mi + log(li); rows that saw nothing stay 0 / -inf.
        seen = li > 0
        l_safe = np.where(seen, li, _F32(1))
        Oi = Oi / l_safe[..., None]
        Li = np.where(seen, mi + np.log(l_safe), _NEG_INF)
        out[:, :, i0:i1, :] = Oi.astype(out.dtype, copy=False)
        lse[:, :, i0:i1] = Li.astype(lse.dtype, copy=False)


def backward(
    dout: np.ndarray,
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    out: np.ndarray,
    lse: np.ndarray,
    *,
    scale: float,
    causal: str,
    window_left: int,
    window_right: int,
    mask: Optional[np.ndarray],
    key_lengths: Optional[np.ndarray],
    dq: np.ndarray,
    dk: np.ndarray,
    dv: np.ndarray,
    block_q: int = 64,
    block_k: int = 64,
    score_mod: Any = None,
    mask_mod: Any = None,
    mod_tensors: Any = None,
) -> None:
    """Tiled FlashAttention-2 backward pass, written into ``dq``, ``dk``, ``dv``.

    Parameters
    ----------
    dout : ndarray, shape (B, H, Nq, D)
        Gradient of the loss with respect to ``out``.
    q, k, v : ndarrays
        Forward inputs, as in :func:`forward`.
    out : ndarray, shape (B, H, Nq, D)
        Saved forward output.
    lse : ndarray, shape (B, H, Nq)
        Saved natural-log log-sum-exp (``-inf`` on rows that saw no key).
    scale, causal, window_left, window_right, mask, key_lengths
        As in :func:`forward`; they must match the forward call.
    dq : ndarray, shape (B, H, Nq, D)
    dk, dv : ndarrays, shape (B, H, Nk, D)
        Output buffers, written fully.
    block_q, block_k : int
        Tile sizes ``Br`` (query rows) and ``Bc`` (keys).
    score_mod, mask_mod, mod_tensors
        As in :func:`forward`; the gradient through the score modifier is its
        derivative with respect to the score.  With fewer K/V heads than
        query heads, dk and dv sum the gradients of each group.
    """
    B, H, Nq, D = q.shape
    Nk, Hkv = k.shape[2], k.shape[1]
    Br, Bc = int(block_q), int(block_k)
    if mask is not None:
        mask = np.broadcast_to(mask, (B, H, Nq, Nk))
    if key_lengths is not None:
        key_lengths = np.asarray(key_lengths, dtype=np.int64).reshape(B)
    bnd = band(Nq, Nk, causal, window_left, window_right)
    kl_max, kl_min = _key_limit(Nk, key_lengths)
    mods = _Mods(score_mod, mask_mod, mod_tensors, B, H) if score_mod is not None or mask_mod is not None else None
    key_seen = _keys_seen(B, H, Nq, Nk, bnd, key_lengths, kl_min, mask, Br, Bc, mods)
    Tc = -(-Nk // Bc)

    # Preprocess: Di = rowsum(dOi * Oi) in float32.
    D_all = np.sum(
        np.asarray(dout, dtype=_F32) * np.asarray(out, dtype=_F32), axis=-1, dtype=_F32
    )
    # Li = -inf (row saw no key) becomes +inf so that exp(Sij - Li) = 0 there.
    L_all = np.asarray(lse, dtype=_F32)
    L_all = np.where(L_all == _NEG_INF, _F32(np.inf), L_all)
    dQ_acc = np.zeros((B, H, Nq, D), dtype=_F32)

    for c in range(Tc):
        j0, j1 = c * Bc, min((c + 1) * Bc, Nk)
        # Load Kj, Vj (keys no query may see read as zeros) and zero dKj, dVj.
        Kj, Vj = _load_keys(k, j0, j1, key_seen), _load_keys(v, j0, j1, key_seen)
        dKj = np.zeros((B, H, j1 - j0, D), dtype=_F32)
        dVj = np.zeros((B, H, j1 - j0, D), dtype=_F32)

        # Query tiles that can see this key tile (none if it is all padding).
        lo, hi = bnd.query_range(j0, j1, Nq)
        if j0 >= kl_max:
            hi = lo
        for i0 in _tile_starts(lo, hi, Br):
            i1 = min(i0 + Br, Nq)
            # Load Qi, dOi, Li, Di.
            Qi = np.asarray(q[:, :, i0:i1, :], dtype=_F32)
            dOi = np.asarray(dout[:, :, i0:i1, :], dtype=_F32)
            Li = L_all[:, :, i0:i1]
            Di = D_all[:, :, i0:i1]
            # Sij = scale Qi Kj^T + bias, masked to -inf.
            allowed = _tile_allowed(i0, i1, j0, j1, bnd, key_lengths, kl_min, mask, mods)
            Sij, slope = _scores(Qi, Kj, scale, allowed, mask, i0, i1, j0, j1, mods, slope=True)
            # Pij = exp(Sij - Li).
            Pij = np.exp(Sij - Li[..., None])
            # dVj += Pij^T dOi.
            dVj += np.matmul(np.swapaxes(Pij, -1, -2), dOi)
            # dPij = dOi Vj^T.
            dPij = np.matmul(dOi, np.swapaxes(Vj, -1, -2))
            # dSij = Pij * (dPij - Di), times the score modifier's slope where anything flows.
            dSij = Pij * (dPij - Di[..., None])
            if slope is not None:
                with np.errstate(invalid="ignore", over="ignore"):
                    dSij = np.where(dSij == 0, _F32(0), dSij * slope)
            # dKj += dSij^T Qi (scale applied once at the end).
            dKj += np.matmul(np.swapaxes(dSij, -1, -2), Qi)
            # dQi += dSij Kj (scale applied once at the end).
            dQ_acc[:, :, i0:i1, :] += np.matmul(dSij, Kj)

        # Write dKj = scale dKj and dVj (summed over each group of query heads).
        if Hkv != H:
            dKj = dKj.reshape(B, Hkv, H // Hkv, j1 - j0, D).sum(axis=2)
            dVj = dVj.reshape(B, Hkv, H // Hkv, j1 - j0, D).sum(axis=2)
        dk[:, :, j0:j1, :] = (dKj * _F32(scale)).astype(dk.dtype, copy=False)
        dv[:, :, j0:j1, :] = dVj.astype(dv.dtype, copy=False)

    # Write dQ = scale dQ.
    dq[...] = (dQ_acc * _F32(scale)).astype(dq.dtype, copy=False)


def _host_array(op: Operand) -> np.ndarray:
    """The numpy view of a host operand."""
    if op.array is None:
        raise ValueError(f"{op.name} is not a host array")
    return op.array


def _result(op: Optional[Operand], made: np.ndarray) -> np.ndarray:
    """The caller's own buffer when one was given, else the array made here."""
    if op is None:
        return made
    if isinstance(op.obj, np.ndarray) and op.obj.shape == made.shape:
        return op.obj
    return made


def _output(op: Optional[Operand], shape: tuple, dtype: np.dtype) -> np.ndarray:
    """The caller's output view, or a new uninitialised array."""
    if op is not None:
        return _host_array(op)
    return np.empty(shape, dtype=dtype)


def run_forward(prob: Problem) -> Tuple[np.ndarray, np.ndarray]:
    """Run :func:`forward` on a validated host problem.

    Parameters
    ----------
    prob : Problem
        Validated forward call whose operands are host arrays.

    Returns
    -------
    out : ndarray, shape (B, H, Nq, D), dtype of ``q``
    lse : ndarray, shape (B, H, Nq), float32
        The caller's buffers when given.
    """
    B, H, Nq, D = prob.B, prob.H, prob.Nq, prob.D
    out = _output(prob.out, (B, H, Nq, D), prob.dtype)
    lse = _output(prob.lse, (B, H, Nq), np.dtype(np.float32))
    forward(
        _host_array(prob.q), _host_array(prob.k), _host_array(prob.v),
        scale=prob.scale, causal=prob.causal,
        window_left=prob.window_left, window_right=prob.window_right,
        mask=None if prob.mask is None else _host_array(prob.mask),
        key_lengths=prob.key_lengths, out=out, lse=lse,
        score_mod=prob.score_mod, mask_mod=prob.mask_mod, mod_tensors=prob.mod_tensors,
    )
    return _result(prob.out, out), _result(prob.lse, lse)


def run_backward(prob: Problem) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Run :func:`backward` on a validated host problem.

    Parameters
    ----------
    prob : Problem
        Validated backward call whose operands are host arrays; ``prob.out``
        and ``prob.lse`` are the saved forward results.

    Returns
    -------
    dq, dk, dv : ndarrays shaped like q, k, v, dtype of ``q``
        The caller's buffers when given.
    """
    B, H, Nq, Nk, D = prob.B, prob.H, prob.Nq, prob.Nk, prob.D
    if prob.dout is None or prob.out is None or prob.lse is None:
        raise ValueError("a backward problem needs dout, out and lse")
    dq = _output(prob.dq, (B, H, Nq, D), prob.dtype)
    Hkv = prob.Hkv or H
    dk = _output(prob.dk, (B, Hkv, Nk, D), prob.dtype)
    dv = _output(prob.dv, (B, Hkv, Nk, D), prob.dtype)
    backward(
        _host_array(prob.dout), _host_array(prob.q), _host_array(prob.k),
        _host_array(prob.v), _host_array(prob.out), _host_array(prob.lse),
        scale=prob.scale, causal=prob.causal,
        window_left=prob.window_left, window_right=prob.window_right,
        mask=None if prob.mask is None else _host_array(prob.mask),
        key_lengths=prob.key_lengths, dq=dq, dk=dk, dv=dv,
        score_mod=prob.score_mod, mask_mod=prob.mask_mod, mod_tensors=prob.mod_tensors,
    )
    return _result(prob.dq, dq), _result(prob.dk, dk), _result(prob.dv, dv)
