"""A key that no query may see is never read: NaN or Inf stored in it changes nothing (the
float64 reference, the NumPy backend, and on every backend and dtype for the keys outside the
band and the key lengths)."""

from __future__ import annotations

import numpy as np
import pytest

from pycudaflash import flash_attn_backward, flash_attn_forward
from pycudaflash.reference import reference_backward, reference_forward

B, H, NQ, NK, D = 2, 2, 37, 53, 16
RNG = np.random.default_rng(21)
Q, K, V, DOUT = (RNG.standard_normal((B, H, n, D)).astype(np.float32) for n in (NQ, NK, NK, NQ))
COLUMN_MASK = np.ones((B, 1, NQ, NK), bool)
COLUMN_MASK[:, :, :, 7] = False  # key 7: no query of any head may see it
COLUMN_MASK[1, :, :, 20:25] = False

# (options, the keys no query may see: bool (B, H or 1, NK))
CASES = {
    "key_lengths": (dict(key_lengths=np.array([30, 53])), np.arange(NK)[None, None, :] >= np.array([30, 53])[:, None, None]),
    "causal_top_left": (dict(causal=True), np.broadcast_to(np.arange(NK) >= NQ, (1, 1, NK))),
    "window": (dict(window=(3, 2)), np.broadcast_to(np.arange(NK) > NQ - 1 + 2, (1, 1, NK))),
    "bool_mask_column": (dict(mask=COLUMN_MASK), ~COLUMN_MASK.any(axis=2)),
}


def _poisoned(x: np.ndarray, unseen: np.ndarray, value: float) -> np.ndarray:
    y = x.copy()
    y[np.broadcast_to(unseen, x.shape[:3])] = value
    return y


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("poison", [np.nan, np.inf, -np.inf])
def test_unseen_keys_change_nothing(name: str, poison: float) -> None:
    opts, unseen = CASES[name]
    assert unseen.any(), "the case must have keys that no query sees"
    Kp, Vp = _poisoned(K, unseen, poison), _poisoned(V, unseen, poison)
    for fwd, bwd, kw in ((flash_attn_forward, flash_attn_backward, dict(backend="numpy")),
                         (reference_forward, reference_backward, {})):
        clean = fwd(Q, K, V, **opts, **kw)
        dirty = fwd(Q, Kp, Vp, **opts, **kw)
        for a, b in zip(clean, dirty):
            np.testing.assert_array_equal(a, b)
        if bwd is flash_attn_backward:
            g_clean = bwd(DOUT, Q, K, V, *clean, **opts, **kw)
            g_dirty = bwd(DOUT, Q, Kp, Vp, *dirty, **opts, **kw)
        else:
            g_clean, g_dirty = bwd(DOUT, Q, K, V, **opts), bwd(DOUT, Q, Kp, Vp, **opts)
        for a, b in zip(g_clean, g_dirty):
            np.testing.assert_array_equal(a, b)
        dk, dv = g_dirty[1], g_dirty[2]
        assert not np.broadcast_to(unseen[..., None], dk.shape)[dk != 0].any(), "an unseen key got a dk"
        assert not np.broadcast_to(unseen[..., None], dv.shape)[dv != 0].any(), "an unseen key got a dv"


def test_a_seen_key_still_carries_its_nan() -> None:
    """Only keys no query may see are left out: a NaN in a key some query sees reaches that query."""
    Vp = V.copy()
    Vp[0, 0, 3] = np.nan  # seen by every query without a mask
    out, _ = flash_attn_forward(Q, K, Vp, backend="numpy")
    assert np.isnan(out[0, 0]).all()
    ref, _ = reference_forward(Q, K, Vp)
    assert np.isnan(ref[0, 0]).all()


@pytest.mark.parametrize("causal, left, right", [("none", -1, -1), ("top_left", -1, -1), ("bottom_right", 5, -1),
                                                 ("none", 3, 2), ("top_left", 40, -1)])
def test_keys_seen_by_the_band_alone_match_the_tile_walk(causal: str, left: int, right: int) -> None:
    """The NumPy backend derives the seen keys of a band and key lengths directly; the walk over
    tile pairs (taken with a dense mask, here one that excludes nothing) must agree."""
    from pycudaflash import cpu
    from pycudaflash.semantics import band

    kl = np.array([30, 53])
    for nq, nk in ((NQ, NK), (NK, NQ)):
        bnd = band(nq, nk, causal, left, right)
        direct = cpu._keys_seen(B, H, nq, nk, bnd, kl, int(kl.min()), None, 16, 16)
        walked = cpu._keys_seen(B, H, nq, nk, bnd, kl, int(kl.min()), np.ones((B, H, nq, nk), bool), 16, 16)
        assert np.array_equal(direct, walked)
        assert not direct.all()


# On every backend and dtype: the band and the key lengths (the kernels zero-fill the keys and
# values past the keys some row of the problem may see when they load a tile).
_BAND_CASES = {
    "key_lengths": dict(key_lengths=np.array([130, 300])),
    "causal_top_left": dict(causal=True),
    "window": dict(window=(20, 7)),
    "window_and_key_lengths": dict(causal="bottom_right", window=(40, None), key_lengths=np.array([250, 161])),
}
_BQ, _BK = 97, 300  # (several key tiles, none full)


def _band_unseen(opts: dict, nq: int, nk: int) -> np.ndarray:
    """bool (B, 1, nk): the keys no row may see (from the float64 reference's own rule)."""
    from pycudaflash.semantics import band, normalize_causal, normalize_window

    lo, hi = band(nq, nk, normalize_causal(opts.get("causal", False)),
                  *normalize_window(opts.get("window"))).key_range(0, nq, nk)
    j = np.arange(nk)
    seen = (j >= lo) & (j < hi)
    kl = opts.get("key_lengths")
    lengths = np.full(B, nk) if kl is None else np.asarray(kl)
    return ~(seen[None, :] & (j[None, :] < lengths[:, None]))[:, None, :]


@pytest.mark.parametrize("name", sorted(_BAND_CASES))
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_unseen_keys_change_nothing_on_every_backend(backend: str, name: str, dtype: str) -> None:
    import ml_dtypes

    np_dtype = {"float32": np.float32, "float16": np.float16, "bfloat16": ml_dtypes.bfloat16}[dtype]
    opts = _BAND_CASES[name]
    rng = np.random.default_rng(5)
    q, k, v, do = (rng.standard_normal((B, H, n, 64)).astype(np_dtype) for n in (_BQ, _BK, _BK, _BQ))
    unseen = _band_unseen(opts, _BQ, _BK)
    assert unseen.any() and not unseen.all(), "the case must have seen and unseen keys"
    results = []
    for poison in (None, np.nan, np.inf):
        kp, vp = (k, v) if poison is None else (_poisoned(k, unseen, poison), _poisoned(v, unseen, poison))
        out, lse = flash_attn_forward(q, kp, vp, backend=backend, **opts)
        grads = flash_attn_backward(do, q, kp, vp, out, lse, backend=backend, deterministic=True, **opts)
        results.append((out, lse, *grads))
    for dirty in results[1:]:
        for a, b, what in zip(results[0], dirty, ("out", "lse", "dq", "dk", "dv")):
            assert np.array_equal(np.asarray(a, np.float64), np.asarray(b, np.float64), equal_nan=True), \
                f"{what} changed when the unseen keys hold NaN or Inf"
    dk, dv = results[1][3], results[1][4]
    mask = np.broadcast_to(unseen[..., None], dk.shape)
    assert not np.asarray(dk, np.float64)[mask].any() and not np.asarray(dv, np.float64)[mask].any(), \
        "an unseen key got a gradient"
    assert np.isfinite(np.asarray(results[0][0], np.float64)).all()
