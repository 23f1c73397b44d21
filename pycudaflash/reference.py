"""Float64 reference attention, written as plain untiled math.

This module states the masking semantics a second time, independently of
:func:`pycudaflash.semantics.band`: the allowed-mask is built from explicit
index grids ``i = arange(Nq)[:, None]`` and ``j = arange(Nk)[None, :]``.
Only the argument parsers of :mod:`pycudaflash.semantics` are shared.

Every result is float64 whatever the input dtype, so the backends can be
compared against it with relative-norm errors.
"""

from __future__ import annotations

from typing import Any, Optional, Tuple

import numpy as np

from .mods import as_modifier, positions
from .semantics import normalize_causal, normalize_scale, normalize_window

__all__ = ["reference_forward", "reference_backward", "masked_scores", "softmax_parts", "repeat_kv_heads",
           "sum_kv_groups"]


def _as_f64(x: Any) -> np.ndarray:
    """Any float array (float16, bfloat16, float32, float64) as float64."""
    return np.asarray(x, dtype=np.float64)


def masked_scores(
    q: np.ndarray,
    k: np.ndarray,
    *,
    scale: Optional[float],
    causal: Any,
    window: Any,
    mask: Any,
    key_lengths: Any,
    score_mod: Any = None,
    mask_mod: Any = None,
    mod_tensors: Any = None,
) -> Tuple[np.ndarray, float]:
    """Scaled, biased and masked scores ``S`` (B, H, Nq, Nk) and the scale.

    Positions that may not be attended hold ``-inf``.  ``score_mod`` (a
    :class:`pycudaflash.mods.Modifier` or its source) replaces each score
    after the bias; ``mask_mod`` excludes the positions where it is False.
    """
    return _scores(q, k, scale, causal, window, mask, key_lengths, score_mod, mask_mod, mod_tensors)[:2]


def repeat_kv_heads(x: np.ndarray, H: int, name: str = "k") -> np.ndarray:
    """k or v with one head per query head: grouped-query attention reads K/V head
    ``h // (H // Hkv)`` for query head ``h`` (``Hkv`` must divide ``H``)."""
    hkv = x.shape[1]
    if hkv == H:
        return x
    if hkv < 1 or H % hkv:
        raise ValueError(f"{name} has {hkv} heads, which must divide the {H} heads of q")
    return np.repeat(x, H // hkv, axis=1)


def sum_kv_groups(dx: np.ndarray, hkv: int) -> np.ndarray:
    """(B, H, N, D) terms of repeated K/V heads (gradients, say) summed back onto the ``hkv`` heads."""
    B, H, N, D = dx.shape
    return dx if hkv == H else dx.reshape(B, hkv, H // hkv, N, D).sum(axis=2)


def _scores(q: np.ndarray, k: np.ndarray, scale: Optional[float], causal: Any, window: Any, mask: Any,
            key_lengths: Any, score_mod: Any = None, mask_mod: Any = None, mod_tensors: Any = None,
            slope: bool = False) -> Tuple[np.ndarray, float, Optional[np.ndarray], np.ndarray]:
    """:func:`masked_scores`, with ``slope`` the derivative of the score modifier at each
    (unmodified) score (None without a score modifier), and whether any query may see each
    key, (B, H, Nk)."""
    if q.ndim != 4 or k.ndim != 4:
        raise ValueError("q and k must have shape (B, H, N, D)")
    B, H, Nq, D = q.shape
    Nk = k.shape[2]
    k = repeat_kv_heads(k, H, "k")
    mode = normalize_causal(causal)
    left, right = normalize_window(window)
    s = normalize_scale(scale, D)

    # Index grids: query row i, key column j.
    i = np.arange(Nq)[:, None]
    j = np.arange(Nk)[None, :]
    off = Nk - Nq if mode == "bottom_right" else 0

    # Causal and window conditions, (Nq, Nk).
    allowed = np.ones((Nq, Nk), dtype=bool)
    if mode != "none":
        allowed &= j <= i + off
    if left >= 0:
        allowed &= j >= i + off - left
    if right >= 0:
        allowed &= j <= i + off + right
    allowed = np.broadcast_to(allowed, (B, H, Nq, Nk))

    # Key padding: key j of batch element b exists when j < key_lengths[b].
    if key_lengths is not None:
        kl = np.asarray(key_lengths).astype(np.int64).reshape(B)
        allowed = allowed & (j[None, None] < kl[:, None, None, None])

    # Dense mask: bool selects, float is an additive bias.
    bias: Optional[np.ndarray] = None
    if mask is not None:
        m = np.asarray(mask)
        if m.dtype == np.bool_:
            allowed = allowed & np.broadcast_to(m, (B, H, Nq, Nk))
        else:
            bias = np.broadcast_to(np.asarray(m, dtype=np.float64), (B, H, Nq, Nk))

    # Modifiers read b, h, i, j as broadcast grids; mask_mod excludes like the other conditions.
    smod, mmod = as_modifier(score_mod, mod_tensors, "score"), as_modifier(mask_mod, mod_tensors, "mask")
    pos = dict(positions(B, H, range(Nq), range(Nk)), tensors=mod_tensors)
    if mmod is not None:
        allowed = allowed & np.broadcast_to(mmod.evaluate(**pos), (B, H, Nq, Nk))
    # A key no query may see is never read: zero it (a NaN or Inf stored there changes nothing).
    seen = np.broadcast_to(allowed, (B, H, Nq, Nk)).any(axis=2)
    if not seen.all():
        k = np.where(seen[..., None], k, 0.0)

    # S = scale * Q K^T (+ bias), the score modifier, -inf where not allowed.
    S = np.matmul(q, np.swapaxes(k, -1, -2))
    S *= s
    if bias is not None:
        S += bias
    dmod = None
    if smod is not None:
        if slope:
            dmod = np.broadcast_to(smod.derivative().evaluate(S, **pos), S.shape)
        S = np.array(np.broadcast_to(smod.evaluate(S, **pos), S.shape), dtype=np.float64)
    np.copyto(S, -np.inf, where=~allowed)
    return S, s, dmod, seen


def softmax_parts(S: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """Row probabilities ``P`` and natural-log ``lse`` of scores ``S``.

    ``S`` is overwritten by ``P``.  A row whose scores are all ``-inf`` gets
    ``P = 0`` and ``lse = -inf``.
    """
    m = np.max(S, axis=-1, initial=-np.inf)
    seen = np.isfinite(m)
    m_safe = np.where(seen, m, 0.0)
    # exp(S - m); exp(-inf) = 0 silently and m_safe is finite, so no inf - inf.
    P = S
    P -= m_safe[..., None]
    np.exp(P, out=P)
    l = np.sum(P, axis=-1)
    l_safe = np.where(seen, l, 1.0)
    # Normalise the rows; lse = m + log(l).
    P /= l_safe[..., None]
    lse = np.where(seen, m_safe + np.log(l_safe), -np.inf)
    return P, lse


def reference_forward(
    q: Any,
    k: Any,
    v: Any,
    *,
    scale: Optional[float] = None,
    causal: Any = False,
    window: Any = None,
    mask: Any = None,
    key_lengths: Any = None,
    score_mod: Any = None,
    mask_mod: Any = None,
    mod_tensors: Any = None,
) -> Tuple[np.ndarray, np.ndarray]:
    """Attention forward pass in float64, without tiling.

    Parameters
    ----------
    q : array, shape (B, H, Nq, D)
    k, v : arrays, shape (B, Hkv, Nk, D)
        Any float dtype; converted to float64.  ``Hkv`` divides ``H``: query
        head ``h`` reads K/V head ``h // (H // Hkv)`` (grouped-query and, with
        ``Hkv = 1``, multi-query attention).
    scale : float, optional
        Score scale, default ``1/sqrt(D)``.
    causal : bool or {'top_left', 'bottom_right'}, optional
        ``True``/``'top_left'``: ``j <= i``; ``'bottom_right'``:
        ``j <= i + Nk - Nq``.
    window : (left, right), optional
        ``i + off - left <= j <= i + off + right`` with ``off = Nk - Nq`` for
        bottom-right alignment, else 0; ``None``/``-1`` leaves a side open.
    mask : array, optional
        Broadcastable to (B, H, Nq, Nk); bool (True = attend) or float (added
        to the scaled scores, ``-inf`` allowed, ``+inf``/NaN not supported).
    key_lengths : int array of shape (B,), optional
        Key ``j`` of batch element ``b`` is masked when ``j >= key_lengths[b]``.
    score_mod, mask_mod : str or pycudaflash.mods.Modifier, optional
        Modifier expressions (:mod:`pycudaflash.mods`): ``score_mod``
        replaces each scaled (and biased) score; ``mask_mod`` excludes the
        positions where it is False.
    mod_tensors : mapping of name to array, optional
        The tensors the modifiers read.

    Returns
    -------
    out : ndarray, shape (B, H, Nq, D), float64
        ``softmax(S) V``; 0 on rows that see no key.
    lse : ndarray, shape (B, H, Nq), float64
        Natural-log log-sum-exp of each row of ``S``; ``-inf`` on rows that see
        no key.
    """
    q64 = _as_f64(q)
    # K/V heads repeated for grouped queries.
    k64, v64 = repeat_kv_heads(_as_f64(k), q64.shape[1], "k"), repeat_kv_heads(_as_f64(v), q64.shape[1], "v")
    S, _, _, seen = _scores(q64, k64, scale, causal, window, mask, key_lengths, score_mod, mask_mod, mod_tensors)
    P, lse = softmax_parts(S)
    # O = P V (keys no query may see read as zeros).
    out = np.matmul(P, np.where(seen[..., None], v64, 0.0))
    return out, lse


def reference_backward(
    dout: Any,
    q: Any,
    k: Any,
    v: Any,
    *,
    scale: Optional[float] = None,
    causal: Any = False,
    window: Any = None,
    mask: Any = None,
    key_lengths: Any = None,
    score_mod: Any = None,
    mask_mod: Any = None,
    mod_tensors: Any = None,
) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Attention backward pass in float64, recomputing the forward itself.

    Parameters
    ----------
    dout : array, shape (B, H, Nq, D)
        Gradient of the loss with respect to ``out``.
    q, k, v, scale, causal, window, mask, key_lengths, score_mod, mask_mod, mod_tensors
        As in :func:`reference_forward`; the gradient through ``score_mod``
        is its derivative with respect to the score (:mod:`pycudaflash.mods`).

    Returns
    -------
    dq : ndarray, shape (B, H, Nq, D), float64
    dk, dv : ndarrays, shape (B, Hkv, Nk, D), float64 (summed over each group)
        Gradients of the loss; rows that see no key contribute nothing and get
        ``dq = 0``.
    """
    q64, dO = _as_f64(q), _as_f64(dout)
    # K/V heads repeated for grouped queries.
    hkv = np.shape(k)[1]
    k64, v64 = repeat_kv_heads(_as_f64(k), q64.shape[1], "k"), repeat_kv_heads(_as_f64(v), q64.shape[1], "v")
    S, s, dmod, seen = _scores(q64, k64, scale, causal, window, mask, key_lengths, score_mod, mask_mod,
                               mod_tensors, slope=True)
    # Keys no query may see read as zeros.
    k64, v64 = np.where(seen[..., None], k64, 0.0), np.where(seen[..., None], v64, 0.0)
    # P = exp(S - lse), 0 on masked positions and on rows that see no key.
    P, _ = softmax_parts(S)
    O = np.matmul(P, v64)
    # dV = P^T dO.
    dv = np.matmul(np.swapaxes(P, -1, -2), dO)
    # dP = dO V^T.
    dP = np.matmul(dO, np.swapaxes(v64, -1, -2))
    # D_i = rowsum(dO * O).
    Di = np.sum(dO * O, axis=-1)
    # dS = P * (dP - D_i), times the score modifier's slope (nothing flows where dS is 0).
    dS = P * (dP - Di[..., None])
    if dmod is not None:
        with np.errstate(invalid="ignore"):
            dS = np.where(dS == 0.0, 0.0, dS * dmod)
    # dQ = scale dS K, dK = scale dS^T Q.
    dq = s * np.matmul(dS, k64)
    dk = s * np.matmul(np.swapaxes(dS, -1, -2), q64)
    # Grouped queries: each K/V head sums the gradients of its group.
    return dq, sum_kv_groups(dk, hkv), sum_kv_groups(dv, hkv)
