"""Tools for checking an attention implementation against a reference.

Importable without PyCUDA or a GPU.  Four groups of helpers:

* :func:`check` (and :class:`CheckResult`): one comparison of a computed array
  against a float64 reference, with a relative-norm bound, an element bound,
  and exact checks of the non-finite pattern (NaN, ``-inf``).
* :func:`attention_problems` (a Hypothesis strategy), :func:`make_inputs` and
  :func:`attention_kwargs`: random attention problems with every masking
  feature, odd sizes, broadcast masks, strided layouts and float32, float16
  or bfloat16 inputs.
* :func:`noise_floors`: the size each result would have without
  cancellation, to scale :func:`check`'s ``atol`` for results that are
  legitimately tiny (``dq``/``dk`` of rows that see a single key, an ``out``
  element averaging a few random values).
* :func:`lowp_reference_forward` and :func:`lowp_reference_backward`: a naive
  attention computed in float16 or bfloat16 the way plain torch operations
  compute it, the baseline that float16/bfloat16 results are held to.

Example
-------
A property test of one's own attention variant ``my_attention``::

    from hypothesis import given
    from pycudaflash.reference import reference_forward
    from pycudaflash.testing import attention_kwargs, attention_problems, check, make_inputs

    @given(attention_problems(max_seqlen=130, max_elements=2_000_000))
    def test_mine(problem):
        x = make_inputs(problem)
        kw = attention_kwargs(problem, x)
        out, lse = my_attention(x["q"], x["k"], x["v"], **kw)
        ref_out, ref_lse = reference_forward(x["q"], x["k"], x["v"], **kw)
        check("out", out, ref_out, rtol_norm=2e-6).raise_if_failed()
        check("lse", lse, ref_lse, rtol_norm=2e-6).raise_if_failed()
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any, Dict, Optional, Sequence, Tuple, Union

import numpy as np

__all__ = [
    "CheckResult",
    "check",
    "relative_error",
    "AttentionProblem",
    "attention_problems",
    "make_inputs",
    "attention_kwargs",
    "noise_floors",
    "lowp_reference_forward",
    "lowp_reference_backward",
    "allowed_and_bias",
    "to_host",
    "numpy_dtype",
    "selected_profile",
    "PROFILE_ENV",
    "INTERESTING_HEAD_DIMS",
    "INTERESTING_SEQLENS",
    "MASK_PATTERNS",
    "MASK_SHAPES",
]

#: Head dimensions drawn with extra probability: powers of two, one off them,
#: and the sizes of common models.
INTERESTING_HEAD_DIMS: Tuple[int, ...] = (
    1, 8, 17, 32, 63, 64, 65, 96, 127, 128, 129, 160, 192, 255, 256,
)

#: Sequence lengths drawn with extra probability: tile sizes and one off them.
INTERESTING_SEQLENS: Tuple[int, ...] = (
    1, 2, 17, 63, 64, 65, 97, 113, 127, 128, 129, 257, 511, 700,
)

#: Broadcast shapes a mask is drawn with, as names resolved by
#: :meth:`AttentionProblem.mask_array_shape`.
MASK_SHAPES: Tuple[str, ...] = ("NqNk", "1HNqNk", "B1NqNk", "BHNqNk", "111Nk")

#: How a bool mask's entries are drawn (AttentionProblem.mask_pattern).
MASK_PATTERNS: Tuple[str, ...] = ("random", "blocks")


# --------------------------------------------------------------------------
# Host conversion
# --------------------------------------------------------------------------


def to_host(x: Any) -> np.ndarray:
    """Copy an array to host memory as a numpy array, keeping its dtype.

    Accepts numpy arrays, pycuda ``GPUArray`` and cupy arrays (through
    ``.get()``) and torch tensors (through ``.detach().cpu()``; bfloat16 tensors
    come back as float32 because numpy has no native bfloat16).

    Parameters
    ----------
    x : array-like
        The array to copy.

    Returns
    -------
    numpy.ndarray
    """
    if isinstance(x, np.ndarray):
        return x
    mod = type(x).__module__
    if mod.startswith("torch"):
        t = x.detach().cpu()
        if str(t.dtype) == "torch.bfloat16":
            t = t.float()
        return t.numpy()
    getter = getattr(x, "get", None)
    if callable(getter):
        return np.asarray(getter())
    return np.asarray(x)


# --------------------------------------------------------------------------
# Comparison
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckResult:
    """Outcome of one :func:`check` comparison.

    Attributes
    ----------
    name : str
        Label of the compared quantity (``'out'``, ``'dq'``, ...).
    max_abs : float
        Largest ``|out - ref|`` over the elements where both are finite.
    rel_norm : float
        ``||out - ref||_2 / ||ref||_2`` over the elements where ``ref`` is
        finite (``||out - ref||_2`` itself when ``||ref||_2 == 0``); ``inf``
        when ``out`` is not finite somewhere ``ref`` is.
    first_bad : tuple of int or None
        Index (C order) of the first element that fails, or None.
    n_nonfinite : int
        Number of non-finite values of ``out`` where ``ref`` is finite.
    ok : bool
        Whether the comparison passed.
    n_bad : int
        Number of failing elements.
    rtol_norm : float
        The relative-norm bound used.
    elem_bound : float
        The scalar part of the element bound, ``elem_factor * rtol_norm *
        max|ref|`` (raised per element by ``elem_factor * atol``).
    reason : str
        Why the check failed (empty when it passed).
    """

    name: str
    max_abs: float
    rel_norm: float
    first_bad: Optional[Tuple[int, ...]]
    n_nonfinite: int
    ok: bool
    n_bad: int = 0
    rtol_norm: float = 0.0
    elem_bound: float = 0.0
    reason: str = ""

    def __str__(self) -> str:
        status = "ok" if self.ok else "FAIL"
        text = (
            f"{self.name}: {status} rel_norm={self.rel_norm:.3e} (bound {self.rtol_norm:.1e}) "
            f"max_abs={self.max_abs:.3e} (elem bound {self.elem_bound:.2e}) "
            f"n_bad={self.n_bad} nonfinite={self.n_nonfinite} first_bad={self.first_bad}"
        )
        if self.reason:
            text += f" [{self.reason}]"
        return text

    def __bool__(self) -> bool:
        return self.ok

    def raise_if_failed(self) -> "CheckResult":
        """Raise ``AssertionError`` with the one-line summary if the check failed.

        Returns
        -------
        CheckResult
            ``self``, so calls can be chained.
        """
        if not self.ok:
            raise AssertionError(str(self))
        return self

    #: Alias of :meth:`raise_if_failed`.
    assert_ok = raise_if_failed


def _as_f64(x: Any) -> np.ndarray:
    return np.asarray(to_host(x), dtype=np.float64)


def _first_index(flags: np.ndarray) -> Optional[Tuple[int, ...]]:
    """C-order index of the first True in ``flags`` (None if there is none)."""
    if not flags.any():
        return None
    flat = int(np.argmax(flags))  # argmax scans in C order whatever the strides
    return tuple(int(i) for i in np.unravel_index(flat, flags.shape))


def check(
    name: str,
    out: Any,
    ref: Any,
    *,
    rtol_norm: float,
    atol: Union[None, float, np.ndarray] = None,
    exact: Optional[np.ndarray] = None,
    elem_factor: float = 4.0,
) -> CheckResult:
    """Compare a computed array ``out`` with a reference ``ref``.

    Both are converted to float64 (device arrays are copied to the host).
    Element ``i`` *fails* when any of these holds:

    * ``ref[i]`` is finite and ``out[i]`` is not (NaN or infinite);
    * ``ref[i]`` is not finite and ``out[i]`` differs from it: a ``-inf`` in
      ``ref`` (an ``lse`` row that sees no key) must be exactly ``-inf``, a
      ``+inf`` exactly ``+inf``, a NaN a NaN;
    * ``exact[i]`` is True and ``out[i] != ref[i]`` (e.g. the exact zeros of
      rows that see no key);
    * ``|out[i] - ref[i]| > elem_factor * max(atol[i], rtol_norm * max|ref|)``,
      the maximum taken over the finite entries of ``ref``.

    The whole comparison passes when no element fails and, over the elements
    where ``ref`` is finite,
    ``||out - ref||_2 <= rtol_norm * ||ref||_2 + ||atol||_2``.

    The element bound catches a single wrong element (an unwritten row, a tile
    edge) that the norm would average away.  It is ``elem_factor`` times
    looser than the per-element scale of the norm bound because the largest
    of many rounding errors is several times their root mean square, while
    ``max|ref|`` (or ``atol[i]``) is only a few times the typical size: with
    ``elem_factor = 1``, honest rounding errors that pass the norm bound would
    trip it.  ``atol`` is an absolute noise floor for quantities that are
    legitimately near zero (see :func:`noise_floors`).

    Parameters
    ----------
    name : str
        Label used in the summary line.
    out : array-like
        Computed values (numpy, pycuda ``GPUArray``, cupy, torch).
    ref : array-like
        Reference values, same shape as ``out``.
    rtol_norm : float
        Bound on the relative-norm error ``||out - ref|| / ||ref||``.
    atol : float or array broadcastable to ``ref.shape``, optional
        Absolute floor, per element when an array.  Default 0.
    exact : bool array broadcastable to ``ref.shape``, optional
        Elements that must match ``ref`` exactly.
    elem_factor : float, optional
        How much looser the element bound is than ``max(atol[i], rtol_norm *
        max|ref|)`` (default 4).

    Returns
    -------
    CheckResult
        Call ``.raise_if_failed()`` on it to turn a failure into an
        ``AssertionError`` carrying the summary line.
    """
    o = _as_f64(out)
    r = _as_f64(ref)
    rtol_norm = float(rtol_norm)
    if o.shape != r.shape:
        return CheckResult(
            name, math.nan, math.nan, None, 0, False, n_bad=0, rtol_norm=rtol_norm,
            reason=f"shape {o.shape} != reference shape {r.shape}",
        )
    a = np.zeros(r.shape) if atol is None else np.broadcast_to(
        np.asarray(atol, dtype=np.float64), r.shape
    )

    ref_fin = np.isfinite(r)
    out_fin = np.isfinite(o)
    both = ref_fin & out_fin
    # Non-finite values of out where ref is finite.
    nonfinite = ref_fin & ~out_fin
    # Non-finite pattern of ref must be reproduced exactly (NaN matches NaN).
    pattern = ~ref_fin & ~((o == r) | (np.isnan(o) & np.isnan(r)))

    diff = np.abs(np.where(both, o, 0.0) - np.where(both, r, 0.0))
    max_ref = float(np.max(np.abs(r), where=ref_fin, initial=0.0))
    elem_bound = float(elem_factor) * rtol_norm * max_ref
    too_far = both & (diff > np.maximum(float(elem_factor) * a, elem_bound))
    bad = nonfinite | pattern | too_far
    if exact is not None:
        ex = np.broadcast_to(np.asarray(exact, dtype=bool), r.shape)
        bad |= ex & both & (o != r)

    n_nonfinite = int(np.count_nonzero(nonfinite))
    n_bad = int(np.count_nonzero(bad))
    max_abs = float(diff.max(initial=0.0))
    err_norm = float(np.sqrt(np.sum(diff * diff)))
    ref_norm = float(np.sqrt(np.sum(np.where(ref_fin, r * r, 0.0))))
    atol_norm = float(np.sqrt(np.sum(np.where(ref_fin, a * a, 0.0))))
    if n_nonfinite:
        rel_norm = math.inf
    elif ref_norm > 0.0:
        rel_norm = err_norm / ref_norm
    else:
        rel_norm = err_norm
    norm_ok = n_nonfinite == 0 and err_norm <= rtol_norm * ref_norm + atol_norm

    reasons = []
    if n_nonfinite:
        reasons.append(f"{n_nonfinite} non-finite where the reference is finite")
    n_pattern = int(np.count_nonzero(pattern))
    if n_pattern:
        reasons.append(f"{n_pattern} mismatched -inf/+inf/NaN reference entries")
    n_far = int(np.count_nonzero(too_far))
    if n_far:
        reasons.append(f"{n_far} elements beyond the element bound")
    n_exact = n_bad - int(np.count_nonzero(nonfinite | pattern | too_far))
    if n_exact:
        reasons.append(f"{n_exact} elements not exactly equal where required")
    if not norm_ok and not n_nonfinite:
        reasons.append("relative-norm error above bound")
    ok = n_bad == 0 and norm_ok
    return CheckResult(
        name=name,
        max_abs=max_abs,
        rel_norm=rel_norm,
        first_bad=_first_index(bad),
        n_nonfinite=n_nonfinite,
        ok=ok,
        n_bad=n_bad,
        rtol_norm=rtol_norm,
        elem_bound=elem_bound,
        reason="; ".join(reasons),
    )


def relative_error(out: Any, ref: Any, floor: Any = None) -> float:
    """Relative-norm error ``||out - ref||_2 / ||ref||_2`` in float64.

    Only the elements where ``ref`` is finite are compared; the result is
    ``inf`` when ``out`` is not finite at one of them or does not reproduce a
    non-finite entry of ``ref`` exactly.  When the denominator is 0 the
    absolute norm ``||out - ref||_2`` is returned.

    Parameters
    ----------
    out, ref : array-like
        Same shape.
    floor : array-like, optional
        Broadcastable to ``ref``'s shape: a noise floor per element (see
        :func:`noise_floors`).  The denominator becomes
        ``||ref||_2 + ||floor||_2``, the scale on which :func:`check` applies
        its norm bound when ``atol = rtol_norm * floor``; so an error measured
        this way, used as ``rtol_norm``, admits exactly that absolute error.

    Returns
    -------
    float
    """
    o = _as_f64(out)
    r = _as_f64(ref)
    if o.shape != r.shape:
        raise ValueError(f"shape {o.shape} != reference shape {r.shape}")
    ref_fin = np.isfinite(r)
    if not np.all(np.isfinite(o[ref_fin])):
        return math.inf
    if not np.all((o[~ref_fin] == r[~ref_fin]) | (np.isnan(o[~ref_fin]) & np.isnan(r[~ref_fin]))):
        return math.inf
    d = np.where(ref_fin, o, 0.0) - np.where(ref_fin, r, 0.0)
    err = float(np.sqrt(np.sum(d * d)))
    den = float(np.sqrt(np.sum(np.where(ref_fin, r * r, 0.0))))
    if floor is not None:
        f = np.broadcast_to(np.asarray(floor, dtype=np.float64), r.shape)
        den += float(np.sqrt(np.sum(np.where(ref_fin, f * f, 0.0))))
    return err / den if den > 0.0 else err


# --------------------------------------------------------------------------
# Noise floors
# --------------------------------------------------------------------------


def _row_norms(x: np.ndarray) -> np.ndarray:
    return np.sqrt(np.sum(x * x, axis=-1))


def noise_floors(
    q: Any,
    k: Any,
    v: Any,
    dout: Any = None,
    *,
    scale: Optional[float] = None,
    causal: Any = False,
    window: Any = None,
    mask: Any = None,
    key_lengths: Any = None,
    score_mod: Any = None,
    mask_mod: Any = None,
    mod_tensors: Any = None,
) -> Dict[str, np.ndarray]:
    """Size each result would have without cancellation, per element.

    Every attention result is a sum of signed terms: ``out_i = sum_j P_ij
    v_j``, ``dv_j = sum_i P_ij dO_i``, ``dq_i = scale sum_j dS_ij k_j`` with
    ``dS_ij = P_ij (dP_ij - D_i)``, and so on.  When the terms cancel, the
    result is small but its rounding error is not: ``dS`` is exactly 0 for a
    row that sees a single key (``dP_ij = D_i = dO_i . v_j``) while ``dP_ij``
    and ``D_i`` each carry an error of about ``u ||dO_i|| ||v_j||``; a single
    ``out`` element averaging a few random values may be near 0.  A relative
    error is meaningless for such a result, so :func:`check` takes
    ``atol = rtol * floor`` with the floors computed here: the size the sum
    would have if its terms added up at random (the root of the sum of their
    squares), for inputs with independent entries as :func:`make_inputs`
    draws them (``|a . b|`` is then typically ``||a|| ||b|| / sqrt(D)``):

    * ``'out'``: ``sqrt(sum_j P_ij^2 v_jd^2)``;
    * ``'dv'``: ``sqrt(sum_i P_ij^2 ||dO_i||^2 / D)``;
    * ``'dq'``: ``|scale| (||dO_i|| sqrt(sum_j P_ij^2 ||v_j||^2 k_jd^2 / D)
      + sqrt(sum_j P_ij^2 D_i^2 k_jd^2))``;
    * ``'dk'``: ``|scale| (||v_j|| sqrt(sum_i P_ij^2 ||dO_i||^2 q_id^2 / D)
      + sqrt(sum_i P_ij^2 D_i^2 q_id^2))``, the second terms for the
      ``P_ij D_i`` part of ``dS_ij``, with ``D_i^2 ~ ||dO_i||^2 ||out_i||^2 /
      D``; each element with its own ``k_jd`` or ``q_id`` (a row that sees
      one key has ``dq_i`` = its rounding error times ``k_j``);
    * ``'lse'``: ``|scale| ||q_i|| max_j ||k_j|| / sqrt(D) + max|bias|``, the
      size of the largest scores.

    The sums of ``P_ij^2`` are products with the square of the float64
    reference's probabilities.  For a result without cancellation the
    floor is about its own size (measured: ``||floor|| / ||ref||`` has median
    1.0 for ``out`` and ``dv`` and 1.5 for ``dq`` and ``dk``), so
    ``atol = rtol * floor`` loosens the tolerance there about twofold, while a
    cancelled result is held to rounding noise.

    Parameters
    ----------
    q, k, v : array-like, shapes (B, H, Nq, D), (B, Hkv, Nk, D), (B, Hkv, Nk, D)
        The inputs (``Hkv`` divides ``H``; a K/V head's floors for dk and dv
        combine those of its group's query heads as a root of summed squares).
    dout : array-like, shape (B, H, Nq, D), optional
        Output gradient; without it only ``'out'`` and ``'lse'`` are returned.
    scale, causal, window, mask, key_lengths, score_mod, mask_mod, mod_tensors
        The attention options, as in
        :func:`pycudaflash.reference.reference_forward` (the probabilities
        are those of the modified scores; the derivative of a score
        modifier is taken as at most 1 in size).

    Returns
    -------
    dict of str to numpy.ndarray
        ``'out'``, ``'lse'`` and, with ``dout``, ``'dq'``, ``'dk'`` and
        ``'dv'``; each broadcastable to the shape of its quantity.
    """
    from .reference import masked_scores, repeat_kv_heads, softmax_parts, sum_kv_groups

    q64 = _as_f64(q)
    Hkv = np.shape(k)[1]
    k64, v64 = repeat_kv_heads(_as_f64(k), q64.shape[1], "k"), repeat_kv_heads(_as_f64(v), q64.shape[1], "v")
    D = q64.shape[-1]
    s = 1.0 / math.sqrt(D) if scale is None else float(scale)
    root_d = math.sqrt(D)
    bias = 0.0
    if mask is not None:
        m = np.asarray(to_host(mask))
        if m.dtype != np.bool_:
            m64 = m.astype(np.float64)
            bias = float(np.max(np.abs(m64), where=np.isfinite(m64), initial=0.0))

    # The reference's probabilities P (0 where masked and on rows that see no
    # key), then P^2 in place once out = P V is taken.
    S, _ = masked_scores(q64, k64, scale=s, causal=causal, window=window, mask=mask, key_lengths=key_lengths,
                         score_mod=score_mod, mask_mod=mask_mod, mod_tensors=mod_tensors)
    P2, _ = softmax_parts(S)
    out64 = np.matmul(P2, v64)
    P2 *= P2

    def p2_sum(values: np.ndarray) -> np.ndarray:
        """sum_j P_ij^2 values_jd, (B, H, Nq, D)."""
        return np.matmul(P2, values)

    def p2t_sum(weights: np.ndarray) -> np.ndarray:
        """sum_i P_ij^2 weights_id, (B, H, Nk, D)."""
        return np.matmul(np.swapaxes(P2, -1, -2), weights)

    kmax_row = np.max(_row_norms(k64), axis=-1, initial=0.0)  # (B, H)
    floors: Dict[str, np.ndarray] = {
        "out": np.sqrt(p2_sum(v64 * v64)),
        "lse": abs(s) * _row_norms(q64) * kmax_row[..., None] / root_d + bias,
    }
    if dout is None:
        return floors

    do64 = _as_f64(dout)
    do_norm2 = np.sum(do64 * do64, axis=-1)  # ||dO_i||^2
    # dS_ij = P_ij (dP_ij - D_i): the D_i terms are as large as the dP_ij terms
    # (they cancel them exactly in a row that sees one key), with the typical
    # size D_i^2 ~ ||dO_i||^2 ||out_i||^2 / D; add their sums too.
    d2 = do_norm2 * np.sum(out64 * out64, axis=-1) / D  # (B, H, Nq)
    q2 = q64 * q64
    k2 = k64 * k64
    v_norm2 = np.sum(v64 * v64, axis=-1)  # ||v_j||^2
    floors["dv"] = np.sqrt(p2t_sum(do_norm2[..., None]) / D)
    floors["dq"] = abs(s) * (np.sqrt(do_norm2[..., None] * p2_sum(v_norm2[..., None] * k2) / D)
                             + np.sqrt(d2[..., None] * p2_sum(k2)))
    floors["dk"] = abs(s) * (np.sqrt(v_norm2[..., None] * p2t_sum(do_norm2[..., None] * q2) / D)
                             + np.sqrt(p2t_sum(d2[..., None] * q2)))
    # A K/V head's gradient sums its group's terms, each group member's at random.
    for name in ("dk", "dv"):
        floors[name] = np.sqrt(sum_kv_groups(floors[name] ** 2, Hkv))
    return floors


# --------------------------------------------------------------------------
# Low-precision baseline
# --------------------------------------------------------------------------


def allowed_and_bias(
    B: int,
    H: int,
    Nq: int,
    Nk: int,
    *,
    causal: Any,
    window: Any,
    mask: Any,
    key_lengths: Any,
) -> Tuple[np.ndarray, Optional[np.ndarray]]:
    """The masking of a problem split into what is attended and what is added.

    Parameters
    ----------
    B, H, Nq, Nk : int
        Problem sizes.
    causal, window, mask, key_lengths
        As in :func:`pycudaflash.reference.reference_forward`.

    Returns
    -------
    allowed : ndarray of bool, shape (B, H, Nq, Nk)
        The causal, window, key-length and bool-mask conditions combined with
        the reference's rules (True = attend).
    bias : ndarray or None
        A float ``mask``, in its own dtype, broadcast to (B, H, Nq, Nk)
        (``-inf`` entries included); None for a bool mask or none.
    """
    from .reference import masked_scores

    m = None if mask is None else np.asarray(to_host(mask))
    bool_mask = m if m is not None and m.dtype == np.bool_ else None
    zq = np.zeros((B, H, Nq, 1))
    zk = np.zeros((B, H, Nk, 1))
    S, _ = masked_scores(zq, zk, scale=1.0, causal=causal, window=window, mask=bool_mask,
                   key_lengths=key_lengths)
    allowed = S == 0.0
    bias = None
    if m is not None and m.dtype != np.bool_:
        bias = np.broadcast_to(m, (B, H, Nq, Nk))
    return allowed, bias


def _with_mods(allowed: np.ndarray, score_mod: Any, mask_mod: Any, mod_tensors: Any
               ) -> Tuple[np.ndarray, Any, Dict[str, Any]]:
    """``allowed`` with ``mask_mod`` applied, the score Modifier (or None), and the position grids
    the modifiers read."""
    from .mods import as_modifier, positions

    B, H, Nq, Nk = allowed.shape
    pos = dict(positions(B, H, range(Nq), range(Nk)), tensors=mod_tensors)
    mmod = as_modifier(mask_mod, mod_tensors, "mask")
    if mmod is not None:
        allowed = allowed & np.broadcast_to(mmod.evaluate(**pos), allowed.shape)
    return allowed, as_modifier(score_mod, mod_tensors, "score"), pos


class _LowpForward:
    """The pieces of a low-precision forward pass that the backward pass reuses."""

    def __init__(
        self, q: np.ndarray, k: np.ndarray, v: np.ndarray, dtype: np.dtype, scale: float,
        allowed: np.ndarray, bias: Optional[np.ndarray], smod: Any = None, pos: Optional[Dict[str, Any]] = None,
        order: str = "torch",
    ) -> None:
        f32 = np.float32

        def rnd(x: np.ndarray) -> np.ndarray:
            return x.astype(dtype).astype(f32)

        def srnd(x: np.ndarray) -> np.ndarray:  # scores: in the dtype (torch) or float32 (blockwise)
            return rnd(x) if order == "torch" else x

        self.rnd, self.order = rnd, order
        self.q, self.k, self.v = (np.asarray(x, dtype=f32) for x in (q, k, v))
        self.scale = f32(scale)
        # S = q k^T (float32 accumulation, stored in the dtype), then * scale.
        S = srnd(np.matmul(self.q, np.swapaxes(self.k, -1, -2)))
        S = srnd(S * self.scale)
        if bias is not None:
            # A bias of the input dtype keeps the scores in that dtype; a
            # float32 bias promotes them to float32 (torch's type promotion).
            with np.errstate(over="ignore"):
                S = S + bias.astype(f32)
            if bias.dtype == dtype:
                S = srnd(S)
        # A score modifier: evaluated on the rounded scores, its result rounded once (its slope
        # kept, rounded, for the backward's dS).
        self.slope = None
        if smod is not None:
            with np.errstate(all="ignore"):
                self.slope = srnd(np.broadcast_to(smod.derivative().evaluate(S.astype(np.float64), **pos),
                                                  S.shape).astype(f32))
                S = srnd(np.broadcast_to(smod.evaluate(S.astype(np.float64), **pos), S.shape).astype(f32))
        S = np.where(allowed, S, f32(-np.inf))
        # Softmax in float32; a row that sees no key gets P = 0 and lse = -inf.
        m = np.max(S, axis=-1, initial=-np.inf)
        seen = np.isfinite(m)
        m_safe = np.where(seen, m, f32(0))
        E = np.exp(S - m_safe[..., None])
        row_sum = np.sum(E, axis=-1, dtype=f32)
        l_safe = np.where(seen, row_sum, f32(1))
        self.P = E / l_safe[..., None]  # float32, as torch's softmax(dtype=float32)
        self.Pd = rnd(self.P)  # .to(dtype)
        self.lse = np.where(seen, m_safe + np.log(l_safe), f32(-np.inf)).astype(f32)
        if order == "torch":
            self.out = rnd(np.matmul(self.Pd, self.v))
        else:  # exp(S - m) rounded, the products summed, divided by l at the end
            self.out = rnd(np.matmul(rnd(E), self.v) / l_safe[..., None])


def _check_order(order: Any) -> None:
    if order not in ("torch", "blockwise"):
        raise ValueError(f"order must be 'torch' or 'blockwise', got {order!r}")


def _lowp_dtype(q: Any, dtype: Any) -> np.dtype:
    """The low-precision dtype: ``dtype`` by name or dtype, else q's dtype."""
    if dtype is None:
        return np.asarray(q).dtype
    return numpy_dtype(dtype) if isinstance(dtype, str) else np.dtype(dtype)


def lowp_reference_forward(
    q: Any,
    k: Any,
    v: Any,
    *,
    scale: Optional[float] = None,
    causal: Any = False,
    window: Any = None,
    mask: Any = None,
    key_lengths: Any = None,
    dtype: Any = None,
    score_mod: Any = None,
    mask_mod: Any = None,
    mod_tensors: Any = None,
    order: str = "torch",
) -> Tuple[np.ndarray, np.ndarray]:
    """Naive attention in a low-precision dtype, as plain torch operations compute it.

    Emulates, with float32 NumPy arithmetic and a rounding to ``dtype`` after
    every operation, the explicit attention that torch runs for tensors of
    that dtype on a GPU::

        s = (q @ k.transpose(-1, -2)) * scale      # each op rounded to dtype
        s = s + mask                               # float32 mask: s becomes float32
        s = s.masked_fill(~allowed, -inf)
        p = softmax(s, dim=-1, dtype=float32).to(dtype)
        out = p @ v                                # float32 accumulation, rounded
        lse = logsumexp(s.float(), dim=-1)

    Matrix products accumulate in float32, as cuBLAS does for 16-bit inputs
    (the products of two 16-bit numbers are exact in float32).  This is the
    baseline that float16/bfloat16 results are compared with: an
    implementation is expected to be at least about as accurate as it.

    Parameters
    ----------
    q : array, shape (B, H, Nq, D)
    k, v : arrays, shape (B, Hkv, Nk, D)
        Values representable in ``dtype`` (they are used as they are); ``Hkv``
        divides ``H`` (grouped K/V heads are repeated, as ``repeat_interleave``
        would, and their gradients summed over each group).
    scale, causal, window, mask, key_lengths
        As in :func:`pycudaflash.reference.reference_forward`.  A float mask
        of dtype ``dtype`` is added in that dtype, any other float mask in
        float32.
    score_mod, mask_mod, mod_tensors
        Modifiers (:mod:`pycudaflash.mods`): ``mask_mod`` is one more
        condition; ``score_mod`` is evaluated on the rounded (biased) scores
        and its result rounded once to ``dtype``, as a fused score function
        would be (torch would round after each of its operations).
    dtype : str or dtype, optional
        ``'float16'`` or ``'bfloat16'`` (``'float32'`` gives a naive float32
        attention); default q's dtype.
    order : {'torch', 'blockwise'}, optional
        ``'torch'`` (default): the operations above.  ``'blockwise'``: the
        order of fused (flash) kernels, in the same dtype: the scores stay
        in float32 (``q @ k^T``, the scale, a bias and ``score_mod`` are not
        rounded), ``exp(s - rowmax(s))`` is rounded to ``dtype`` for the
        product with ``v``, and the float32 product is divided by the row
        sum before the one rounding of ``out``.  The two orders round
        different numbers: on large outputs their errors agree, on a
        handful of elements one may be far luckier than the other.

    Returns
    -------
    out : ndarray, shape (B, H, Nq, D), ``dtype``
        0 on rows that see no key.
    lse : ndarray, shape (B, H, Nq), float32
        ``-inf`` on rows that see no key.
    """
    dt = _lowp_dtype(q, dtype)
    q_, k_, v_ = (np.asarray(to_host(x)) for x in (q, k, v))
    B, H, Nq, D = q_.shape
    Nk = k_.shape[2]
    from .reference import repeat_kv_heads
    from .semantics import normalize_scale

    allowed, bias = allowed_and_bias(
        B, H, Nq, Nk, causal=causal, window=window, mask=mask, key_lengths=key_lengths,
    )
    allowed, smod, pos = _with_mods(allowed, score_mod, mask_mod, mod_tensors)
    _check_order(order)
    k_, v_ = repeat_kv_heads(k_, H, "k"), repeat_kv_heads(v_, H, "v")
    fwd = _LowpForward(q_, k_, v_, dt, normalize_scale(scale, D), allowed, bias, smod, pos, order)
    return fwd.out.astype(dt), fwd.lse


def lowp_reference_backward(
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
    dtype: Any = None,
    score_mod: Any = None,
    mask_mod: Any = None,
    mod_tensors: Any = None,
    order: str = "torch",
) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Gradients of :func:`lowp_reference_forward`, as torch's autograd computes them.

    Recomputes the forward pass, then follows the backward of each torch
    operation, rounding every result to ``dtype`` (products accumulate in
    float32)::

        dV = P^T dO                                 # P in dtype
        dP = dO V^T
        dS = P * (dP - rowsum(dP * P))              # softmax backward, float32 P,
                                                    # rounded to dtype
        dS = dS * score_mod'(s)                     # with a score modifier
        dS = dS * scale                             # backward of "* scale"
        dQ = dS K,  dK = dS^T Q

    torch's softmax backward forms the row sum from ``dP`` and its own
    float32 output ``P``; it equals ``rowsum(dO * O)`` (what flash attention
    uses) in exact arithmetic.

    With ``order='blockwise'``, the order of fused kernels: the scores and
    ``P`` in float32 (see :func:`lowp_reference_forward`), ``D = rowsum(dO *
    O)`` from the rounded output ``O``, ``dP = dO V^T`` and ``dS = P * (dP -
    D)`` (times the modifier's slope) in float32, ``P`` and ``dS`` rounded
    to ``dtype`` for their products, the scale applied to the float32 sums
    of ``dQ`` and ``dK``.

    Parameters
    ----------
    dout : array, shape (B, H, Nq, D)
        Gradient with respect to ``out``, representable in ``dtype``.
    q, k, v, scale, causal, window, mask, key_lengths, dtype, score_mod, mask_mod, mod_tensors, order
        As in :func:`lowp_reference_forward`.

    Returns
    -------
    dq : ndarray, shape (B, H, Nq, D), ``dtype``
    dk, dv : ndarrays, shape (B, Hkv, Nk, D), ``dtype``
        Rows that see no key contribute nothing and get ``dq = 0``.
    """
    dt = _lowp_dtype(q, dtype)
    q_, k_, v_ = (np.asarray(to_host(x)) for x in (q, k, v))
    B, H, Nq, D = q_.shape
    Nk, Hkv = k_.shape[2], k_.shape[1]
    from .reference import repeat_kv_heads, sum_kv_groups
    from .semantics import normalize_scale

    allowed, bias = allowed_and_bias(
        B, H, Nq, Nk, causal=causal, window=window, mask=mask, key_lengths=key_lengths,
    )
    allowed, smod, pos = _with_mods(allowed, score_mod, mask_mod, mod_tensors)
    _check_order(order)
    k_, v_ = repeat_kv_heads(k_, H, "k"), repeat_kv_heads(v_, H, "v")
    fwd = _LowpForward(q_, k_, v_, dt, normalize_scale(scale, D), allowed, bias, smod, pos, order)
    rnd = fwd.rnd
    dO = np.asarray(to_host(dout), dtype=np.float32)
    dv = rnd(np.matmul(np.swapaxes(fwd.Pd, -1, -2), dO))
    if order == "torch":
        dP = rnd(np.matmul(dO, np.swapaxes(fwd.v, -1, -2)))
        rows = np.sum(dP * fwd.P, axis=-1, dtype=np.float32)
        dS = rnd(fwd.P * (dP - rows[..., None]))
        if fwd.slope is not None:
            dS = rnd(dS * np.where(fwd.P > 0, fwd.slope, np.float32(0)))
        dS = rnd(dS * fwd.scale)
        dq = rnd(np.matmul(dS, fwd.k))
        dk = rnd(np.matmul(np.swapaxes(dS, -1, -2), fwd.q))
    else:
        dP = np.matmul(dO, np.swapaxes(fwd.v, -1, -2))
        rows = np.sum(dO * fwd.out, axis=-1, dtype=np.float32)
        dS = fwd.P * (dP - rows[..., None])
        if fwd.slope is not None:
            dS = dS * np.where(fwd.P > 0, fwd.slope, np.float32(0))
        dS = rnd(dS)
        dq = rnd(np.matmul(dS, fwd.k) * fwd.scale)
        dk = rnd(np.matmul(np.swapaxes(dS, -1, -2), fwd.q) * fwd.scale)
    # Grouped K/V heads: the backward of repeating them sums each group (float32, rounded once).
    dk, dv = rnd(sum_kv_groups(dk, Hkv)), rnd(sum_kv_groups(dv, Hkv))
    return dq.astype(dt), dk.astype(dt), dv.astype(dt)


# --------------------------------------------------------------------------
# Problems
# --------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionProblem:
    """One randomly drawn attention problem (sizes, options and a data seed).

    Attributes
    ----------
    B, H, Nq, Nk, D : int
        Batch, heads, query length, key length, head dimension.
    dtype : str
        Input dtype name: ``'float32'``, ``'float16'`` or ``'bfloat16'``.
    scale : float or None
        Score scale (None: the default ``1/sqrt(D)``).
    causal : bool or str
        ``False``, ``True``, ``'top_left'`` or ``'bottom_right'``.
    window : tuple or None
        ``(left, right)``; each side None, -1 or a non-negative int.
    key_lengths : tuple of int or None
        Per batch element, in ``[0, Nk]``.
    mask_kind : str or None
        None, ``'bool'`` or ``'float'``.
    mask_shape : str or None
        One of :data:`MASK_SHAPES`.
    mask_density : float
        Probability that a bool mask entry is True (attend).
    mask_pattern : str
        One of :data:`MASK_PATTERNS`. ``'random'``: each bool mask entry drawn alone; ``'blocks'``: the
        (Nq, Nk) plane cut into rectangles at random rows and keys (off any
        tile grid), each rectangle all True with probability ``mask_density``
        and else all False (tiles of the kernels' block maps then come out
        empty, full and partial).
    mask_inf_fraction : float
        Fraction of ``-inf`` entries in a float mask.
    mask_empty_rows : bool
        Whether some mask rows are fully masked (all False / all ``-inf``).
    mask_in_dtype : bool
        Whether a float mask is stored in the input dtype (float16 or
        bfloat16) rather than in float32.
    layout : str
        ``'bhnd'`` (contiguous) or ``'bnhd'`` (a (B, N, H, D) array viewed as
        (B, H, N, D)).
    seed : int
        Seed of the random inputs.
    Hkv : int
        Heads of k and v, a divisor of ``H`` (grouped-query attention); 0
        means ``H``.
    """

    B: int
    H: int
    Nq: int
    Nk: int
    D: int
    dtype: str = "float32"
    scale: Optional[float] = None
    causal: Union[bool, str] = False
    window: Optional[Tuple[Optional[int], Optional[int]]] = None
    key_lengths: Optional[Tuple[int, ...]] = None
    mask_kind: Optional[str] = None
    mask_shape: Optional[str] = None
    mask_density: float = 0.5
    mask_pattern: str = "random"
    mask_inf_fraction: float = 0.0
    mask_empty_rows: bool = False
    mask_in_dtype: bool = False
    layout: str = "bhnd"
    seed: int = 0
    Hkv: int = 0

    @property
    def kv_heads(self) -> int:
        """Heads of k and v."""
        return self.Hkv or self.H

    @property
    def elements(self) -> int:
        """``B * H * Nq * Nk * D``, the size measure that the strategy caps."""
        return self.B * self.H * self.Nq * self.Nk * self.D

    def mask_array_shape(self) -> Optional[Tuple[int, ...]]:
        """The shape of the mask array, or None without a mask."""
        if self.mask_kind is None:
            return None
        B, H, Nq, Nk = self.B, self.H, self.Nq, self.Nk
        return {
            "NqNk": (Nq, Nk),
            "1HNqNk": (1, H, Nq, Nk),
            "B1NqNk": (B, 1, Nq, Nk),
            "BHNqNk": (B, H, Nq, Nk),
            "111Nk": (1, 1, 1, Nk),
        }[self.mask_shape]


def _hyp():
    """Import Hypothesis lazily so the comparison helpers work without it."""
    try:
        from hypothesis import strategies as st
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "pycudaflash.testing's strategies need Hypothesis: pip install hypothesis"
        ) from exc
    return st


def attention_problems(
    max_batch: int = 2,
    max_heads: int = 3,
    max_seqlen: int = 700,
    max_head_dim: int = 256,
    dtypes: Sequence[str] = ("float32",),
    masks: bool = True,
    *,
    max_elements: Optional[int] = None,
    groups: bool = False,
):
    """Hypothesis strategy of :class:`AttentionProblem`.

    Sizes are drawn with a bias towards off-tile values
    (:data:`INTERESTING_HEAD_DIMS`, :data:`INTERESTING_SEQLENS`); ``Nq`` and
    ``Nk`` are equal in about a third of the draws and independent otherwise.
    Every option is drawn: scale (None, 0, or ``c / sqrt(D)`` with
    ``0.05 <= |c| <= 2``),
    causal mode, window sides (None, -1, small, up to the length), key lengths
    (including 0 and ``Nk``), mask kind and broadcast shape (a float mask of a
    float16/bfloat16 problem is float32 or in the input dtype), and layout.

    Parameters
    ----------
    max_batch, max_heads, max_seqlen, max_head_dim : int
        Upper bounds of B, H, Nq and Nk, and D.
    dtypes : sequence of str
        Input dtypes to draw from (``'float32'``, ``'float16'``,
        ``'bfloat16'``; the last needs ``ml_dtypes``).
    masks : bool
        Whether dense masks are drawn at all.
    max_elements : int, optional
        Cap on ``B * H * Nq * Nk * D``; sizes are drawn one after the other
        (D, then the lengths, then B and H) each within what the cap leaves.
    groups : bool
        Whether k and v may have fewer heads than q (``Hkv``, a divisor of
        ``H``, drawn in about half the problems with ``H > 1``).

    Returns
    -------
    hypothesis.strategies.SearchStrategy
    """
    st = _hyp()
    if min(max_batch, max_heads, max_seqlen, max_head_dim) < 1:
        raise ValueError("every maximum must be at least 1")
    if not dtypes:
        raise ValueError("dtypes must not be empty")
    cap = max_elements if max_elements is not None else 1 << 62
    if cap < 1:
        raise ValueError("max_elements must be at least 1")

    def biased(draw, interesting: Sequence[int], hi: int) -> int:
        hi = max(1, hi)
        picks = [x for x in interesting if x <= hi]
        if picks:
            return draw(st.one_of(st.sampled_from(picks), st.integers(1, hi)))
        return draw(st.integers(1, hi))

    def side(draw, n: int):
        return draw(st.one_of(
            st.none(), st.just(-1), st.integers(0, 4), st.integers(0, max(0, n)),
        ))

    @st.composite
    def strategy(draw) -> AttentionProblem:
        D = biased(draw, INTERESTING_HEAD_DIMS, min(max_head_dim, cap))
        room = max(1, cap // D)
        if draw(st.sampled_from(["independent", "independent", "equal"])) == "equal":
            Nq = Nk = biased(draw, INTERESTING_SEQLENS, min(max_seqlen, math.isqrt(room)))
        else:
            first = biased(draw, INTERESTING_SEQLENS, min(max_seqlen, room))
            second = biased(draw, INTERESTING_SEQLENS, min(max_seqlen, room // first))
            Nq, Nk = (first, second) if draw(st.booleans()) else (second, first)
        room = max(1, room // (Nq * Nk))
        B = draw(st.integers(1, max(1, min(max_batch, room))))
        H = draw(st.integers(1, max(1, min(max_heads, room // B))))
        Hkv = 0
        if groups and H > 1 and draw(st.booleans()):
            Hkv = draw(st.sampled_from([d for d in range(1, H) if H % d == 0]))

        dtype = draw(st.sampled_from(list(dtypes)))
        scale = draw(st.one_of(
            st.none(),
            st.sampled_from([1.0, 0.5, 2.0, -1.0, 0.0]),
            st.builds(
                lambda c, sign: sign * c,
                st.floats(0.05, 2.0, allow_nan=False, allow_infinity=False),
                st.sampled_from([1.0, -1.0]),
            ),
        ))
        if scale is not None:
            scale = float(scale) / math.sqrt(D)
        causal = draw(st.sampled_from([False, True, "top_left", "bottom_right"]))
        window = None
        if draw(st.booleans()):
            n = max(Nq, Nk)
            window = (side(draw, n), side(draw, n))
        key_lengths = None
        if draw(st.booleans()):
            key_lengths = tuple(
                draw(st.one_of(st.just(0), st.just(Nk), st.integers(0, Nk)))
                for _ in range(B)
            )
        mask_kind = mask_shape = None
        density, pattern, inf_fraction, empty_rows, in_dtype = 0.5, "random", 0.0, False, False
        if masks and draw(st.booleans()):
            mask_kind = draw(st.sampled_from(["bool", "float"]))
            mask_shape = draw(st.sampled_from(list(MASK_SHAPES)))
            density = draw(st.sampled_from([0.5, 0.9, 0.1, 1.0]))
            if mask_kind == "bool":
                pattern = draw(st.sampled_from(list(MASK_PATTERNS)))
            inf_fraction = draw(st.sampled_from([0.1, 0.0, 0.5]))
            # A '111Nk' mask has one row for every query: emptying it masks
            # the whole problem, so do that less often.
            weights = [False, False, False, True] if mask_shape == "111Nk" else [True, False]
            empty_rows = draw(st.sampled_from(weights))
            if mask_kind == "float" and dtype != "float32":
                in_dtype = draw(st.booleans())
        layout = draw(st.sampled_from(["bhnd", "bnhd"]))
        seed = draw(st.integers(0, 2**32 - 1))
        return AttentionProblem(
            B=B, H=H, Nq=Nq, Nk=Nk, D=D, dtype=dtype, scale=scale, causal=causal,
            window=window, key_lengths=key_lengths, mask_kind=mask_kind,
            mask_shape=mask_shape, mask_density=density, mask_pattern=pattern,
            mask_inf_fraction=inf_fraction, mask_empty_rows=empty_rows,
            mask_in_dtype=in_dtype, layout=layout, seed=seed, Hkv=Hkv,
        )

    return strategy()


def numpy_dtype(name: str) -> np.dtype:
    """The numpy dtype of ``'float32'``, ``'float16'`` or ``'bfloat16'``.

    ``'bfloat16'`` needs the ``ml_dtypes`` package.
    """
    if name == "bfloat16":
        try:
            import ml_dtypes
        except ImportError as exc:
            raise ImportError("bfloat16 inputs need ml_dtypes: pip install ml_dtypes") from exc
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(name)


def _layout_view(x: np.ndarray, layout: str) -> np.ndarray:
    """``x`` (B, H, N, D) as a view with the requested memory layout."""
    if layout == "bhnd":
        return np.ascontiguousarray(x)
    if layout == "bnhd":
        base = np.ascontiguousarray(x.transpose(0, 2, 1, 3))  # (B, N, H, D) memory
        return base.transpose(0, 2, 1, 3)
    raise ValueError(f"layout must be 'bhnd' or 'bnhd', got {layout!r}")


def _round_nonzero(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``x`` rounded to ``dtype``, with values that round to zero kept away from it.

    A value that a 16-bit type flushes to zero becomes ``+-2**-14`` (normal
    in float16, bfloat16 and float32), so the inputs never hold exact zeros.
    """
    y = x.astype(dtype)
    zero = y == 0
    if zero.any():
        y[zero] = np.where(x[zero] < 0, -(2.0 ** -14), 2.0 ** -14).astype(dtype)
    return y


def _mask(problem: AttentionProblem, rng: np.random.Generator) -> Optional[np.ndarray]:
    shape = problem.mask_array_shape()
    if shape is None:
        return None
    if problem.mask_pattern not in MASK_PATTERNS:
        raise ValueError(f"mask_pattern must be one of {MASK_PATTERNS}, got {problem.mask_pattern!r}")
    rows = shape[-2]
    if problem.mask_kind == "bool" and problem.mask_pattern == "blocks":
        lead = int(np.prod(shape[:-2]))
        m = np.empty((lead, rows, shape[-1]), bool)
        for plane in m:
            cuts_q = np.unique(np.concatenate([[0, rows], rng.integers(0, rows + 1, rng.integers(0, 5))]))
            cuts_k = np.unique(np.concatenate([[0, shape[-1]], rng.integers(0, shape[-1] + 1, rng.integers(0, 5))]))
            cells = rng.random((len(cuts_q) - 1, len(cuts_k) - 1)) < problem.mask_density
            plane[:] = np.repeat(np.repeat(cells, np.diff(cuts_q), axis=0), np.diff(cuts_k), axis=1)
        m = m.reshape(shape)
    elif problem.mask_kind == "bool":
        m = rng.random(shape) < problem.mask_density
    else:
        m = rng.standard_normal(shape).astype(np.float32)
        m[rng.random(shape) < problem.mask_inf_fraction] = -np.inf
    if problem.mask_empty_rows:
        fill = False if problem.mask_kind == "bool" else -np.inf
        lead = m.reshape(-1, rows, shape[-1])
        n_empty = 1 + rows // 16
        for sl in lead:
            if rng.random() < 0.7:
                picks = rng.choice(rows, size=min(rows, n_empty), replace=False)
                sl[picks, :] = fill
    if problem.mask_kind == "float" and problem.mask_in_dtype:
        m = m.astype(numpy_dtype(problem.dtype))
    return m


def make_inputs(
    problem: AttentionProblem, rng: Optional[np.random.Generator] = None
) -> Dict[str, Optional[np.ndarray]]:
    """Random host inputs of a problem.

    Parameters
    ----------
    problem : AttentionProblem
    rng : numpy.random.Generator, optional
        Default: ``numpy.random.default_rng(problem.seed)``.

    Returns
    -------
    dict
        ``'q'`` (B, H, Nq, D), ``'k'``, ``'v'`` (B, Hkv, Nk, D) and ``'dout'``
        (B, H, Nq, D): standard-normal float32 draws rounded to
        ``problem.dtype`` (never to zero), each a view in ``problem.layout``
        (for ``'bnhd'``, ``x.transpose(0, 2, 1, 3)`` is the contiguous
        (B, N, H, D) array); ``'mask'``: None, bool (True = attend) or float32
        (``-inf`` allowed; in ``problem.dtype`` with ``mask_in_dtype``) of
        ``problem.mask_array_shape()``; ``'key_lengths'``: None or int32 of
        shape (B,).
    """
    if rng is None:
        rng = np.random.default_rng(problem.seed)
    dt = numpy_dtype(problem.dtype)
    B, H, Nq, Nk, D = problem.B, problem.H, problem.Nq, problem.Nk, problem.D

    def normal(heads: int, n: int) -> np.ndarray:
        x = rng.standard_normal((B, heads, n, D), dtype=np.float32)
        return _layout_view(_round_nonzero(x, dt), problem.layout)

    Hkv = problem.kv_heads
    q, k, v, dout = normal(H, Nq), normal(Hkv, Nk), normal(Hkv, Nk), normal(H, Nq)
    kl = None
    if problem.key_lengths is not None:
        kl = np.asarray(problem.key_lengths, dtype=np.int32).reshape(B)
    return {"q": q, "k": k, "v": v, "dout": dout, "mask": _mask(problem, rng), "key_lengths": kl}


def attention_kwargs(problem: AttentionProblem, inputs: Dict[str, Any]) -> Dict[str, Any]:
    """Keyword arguments shared by the public API and the reference.

    Returns
    -------
    dict
        ``scale``, ``causal``, ``window``, ``mask`` and ``key_lengths``, with
        the mask and key lengths taken from ``inputs``.
    """
    return {
        "scale": problem.scale,
        "causal": problem.causal,
        "window": problem.window,
        "mask": inputs.get("mask"),
        "key_lengths": inputs.get("key_lengths"),
    }


# --------------------------------------------------------------------------
# Hypothesis profile selection
# --------------------------------------------------------------------------

#: Environment variable that names the Hypothesis profile of the test suite.
PROFILE_ENV = "PYCUDAFLASH_HYPOTHESIS_PROFILE"


def selected_profile() -> str:
    """Name of the Hypothesis profile the test suite runs under.

    ``$PYCUDAFLASH_HYPOTHESIS_PROFILE`` when set, else ``'gpu'`` when a CUDA
    device is usable and ``'ci'`` otherwise.
    """
    name = os.environ.get(PROFILE_ENV, "").strip()
    if name:
        return name
    try:
        from ._backends import cuda_status

        usable = cuda_status()[0]
    except Exception:
        usable = False
    return "gpu" if usable else "ci"
