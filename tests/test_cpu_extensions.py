"""The NumPy backend with score and mask modifiers and with grouped-query attention, against
the float64 reference (the public calls and the kernels follow in the masking issue)."""

from __future__ import annotations

import numpy as np
import pytest

from pycudaflash import cpu
from pycudaflash.mods import mask_mod, score_mod
from pycudaflash.reference import reference_backward, reference_forward
from pycudaflash.testing import relative_error

B, H, NQ, NK, D = 2, 4, 97, 113, 32
RNG = np.random.default_rng(41)
SLOPE = np.array([0.5, 0.25, 0.125, 0.0625], np.float32)
DOC = np.sort(RNG.integers(0, 4, size=(B, 128)), axis=1).astype(np.int32)
PREFIX = np.array([10, 40])
TENSORS = dict(slope=SLOPE, doc=DOC, prefix=PREFIX)

CASES = {
    "softcap_causal": (dict(causal="top_left"), "10 * tanh(score / 10)", None, H),
    "alibi_key_lengths": (dict(key_lengths=np.array([100, 60])), "score - slope[h] * abs(i - j)", None, H),
    "mixed_window": (dict(window=(30, 5)), "where(score > 0, score * 1.5, exp(score) - 1)", None, H),
    "document": ({}, None, "doc[b, i] == doc[b, j]", H),
    "prefix_lm_and_softcap": ({}, "20 * tanh(score / 20)", "(j <= i) | (j < prefix[b])", H),
    "gqa_2_causal": (dict(causal="bottom_right"), None, None, 2),
    "mqa_alibi": ({}, "score - slope[h] * abs(i - j)", None, 1),
    "gqa_2_document": ({}, None, "doc[b, i] == doc[b, j]", 2),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_numpy_backend_matches_the_reference(name: str) -> None:
    opts, smod_src, mmod_src, hkv = CASES[name]
    q, dout = (RNG.standard_normal((B, H, NQ, D)).astype(np.float32) for _ in range(2))
    k, v = (RNG.standard_normal((B, hkv, NK, D)).astype(np.float32) for _ in range(2))
    used = {n: t for n, t in TENSORS.items() if any(src and n + "[" in src for src in (smod_src, mmod_src))}
    smod = score_mod(smod_src, used) if smod_src else None
    mmod = mask_mod(mmod_src, used) if mmod_src else None
    causal = opts.get("causal", "none")
    left, right = opts.get("window", (-1, -1))
    kl = opts.get("key_lengths")
    common = dict(scale=D ** -0.5, causal=causal, window_left=left, window_right=right, mask=None,
                  key_lengths=kl, score_mod=smod, mask_mod=mmod, mod_tensors=used)
    out, lse = np.full((B, H, NQ, D), np.nan, np.float32), np.full((B, H, NQ), np.nan, np.float32)
    cpu.forward(q, k, v, out=out, lse=lse, **common)
    dq = np.full((B, H, NQ, D), np.nan, np.float32)
    dk, dv = (np.full((B, hkv, NK, D), np.nan, np.float32) for _ in range(2))
    cpu.backward(dout, q, k, v, out, lse, dq=dq, dk=dk, dv=dv, **common)
    ref_kw = dict(causal=False if causal == "none" else causal, window=opts.get("window"), key_lengths=kl,
                  score_mod=smod, mask_mod=mmod, mod_tensors=used)
    r_out, r_lse = reference_forward(q, k, v, **ref_kw)
    r_dq, r_dk, r_dv = reference_backward(dout, q, k, v, **ref_kw)
    # float32 tiles against float64: at most 3.0e-7 measured over these cases; the bound is 2x that.
    for got, want, what in ((out, r_out, "out"), (dq, r_dq, "dq"), (dk, r_dk, "dk"), (dv, r_dv, "dv")):
        assert got.shape == want.shape, what
        assert relative_error(got, want) < 6e-7, (what, relative_error(got, want))
    finite = np.isfinite(r_lse)
    assert np.array_equal(np.isfinite(lse), finite)
    np.testing.assert_allclose(lse[finite], r_lse[finite], rtol=0, atol=2e-5)
